"""Host metrics through psutil (real), GPU metrics through NVML.

There is no GPU here, so NVML's real path is checked to report "no GPU data";
the readings themselves are checked with a stand-in for the ``pynvml`` module
given to ``GpuReader`` through the same interface, some of whose calls raise
``NVMLError_NotSupported`` as real GPUs do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
from rankscope.contract.snapshot import ProcessRole, RankInfo
from rankscope.probes import host
from rankscope.probes.gpu import GpuReader, gpu_status
from rankscope.probes.machine import with_gpus

# --------------------------------------------------------------------------
# Host
# --------------------------------------------------------------------------


def test_host_metrics_are_this_machines() -> None:
    host.prime_cpu()
    m = host.host_metrics()
    assert m.error is None
    assert m.cpu_count == psutil.cpu_count()
    assert m.mem_total_bytes == psutil.virtual_memory().total
    assert m.mem_used_bytes is not None and 0 < m.mem_used_bytes <= m.mem_total_bytes
    assert m.cpu_percent is not None and 0.0 <= m.cpu_percent <= 100.0
    assert m.load_1m == pytest.approx(os.getloadavg()[0], abs=2.0)


@pytest.fixture
def busy_child() -> Iterator[subprocess.Popen[bytes]]:
    """A child spinning on the CPU until it reads a line, so its CPU% is well above zero."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, select\nwhile not select.select([sys.stdin], [], [], 0)[0]: pass"],
        stdin=subprocess.PIPE,
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


def test_process_info_reads_a_live_process(busy_child: subprocess.Popen[bytes]) -> None:
    first = host.process_info(busy_child.pid, ProcessRole.DATALOADER)
    assert first is not None
    assert (first.pid, first.ppid, first.role) == (busy_child.pid, os.getpid(), ProcessRole.DATALOADER)
    assert first.cmdline[0] == sys.executable
    assert first.rss_bytes is not None and first.rss_bytes > 0
    assert first.num_threads is not None and first.num_threads >= 1
    assert first.state in {psutil.STATUS_RUNNING, psutil.STATUS_SLEEPING}
    assert first.cpu_percent is None  # no earlier sample: unknown, not 0.0
    # A real CPU rate needs a window; wait on a condition (the child has used CPU), not a fixed sleep.
    proc = psutil.Process(busy_child.pid)
    start = sum(proc.cpu_times()[:2])
    while sum(proc.cpu_times()[:2]) - start < 0.05:
        pass
    second = host.process_info(busy_child.pid, ProcessRole.DATALOADER)
    assert second is not None and second.cpu_percent is not None and second.cpu_percent > 0.0


def test_process_info_of_a_gone_process_is_none() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    assert host.process_info(proc.pid, ProcessRole.MAIN) is None


# --------------------------------------------------------------------------
# GPU: the real path on this machine
# --------------------------------------------------------------------------


def test_real_nvml_on_a_machine_without_gpu_says_no_gpu_data() -> None:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        pass
    else:
        pytest.skip("this machine has a working NVML")
    status = gpu_status()
    assert status.available is False and status.gpus == ()
    assert status.reason is not None and status.reason.startswith("no GPU data: ")
    assert gpu_status() == status  # asking again changes nothing and raises nothing


# --------------------------------------------------------------------------
# GPU: the readings, with a stand-in pynvml
# --------------------------------------------------------------------------


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):
    pass


class NVMLError_Timeout(NVMLError):
    pass


class NVMLError_LibraryNotFound(NVMLError):
    pass


class FakeNvml:
    """The part of pynvml GpuReader uses: two GPUs, the second an older one with fewer features."""

    NVMLError = NVMLError
    NVML_TEMPERATURE_GPU = 0
    NVML_CLOCK_SM = 1
    NVML_CLOCK_MEM = 2
    NVML_PCIE_UTIL_TX_BYTES = 0
    NVML_PCIE_UTIL_RX_BYTES = 1
    NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS = 0
    NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR = 1
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX = 138
    NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX = 139
    nvmlEventTypeXidCriticalError = 8

    def __init__(self, init_error: Exception | None = None) -> None:
        self.init_error = init_error
        self.pending_events: list[SimpleNamespace] = []
        self.nvlink_kib = 1000  # cumulative per link, grows between readings
        self.stamp_us = 1_000_000
        self.shut_down = False
        # handle -> (pid, used memory in bytes or None) of each compute context, as NVML lists them
        self.processes: dict[str, list[tuple[int, int | None]]] = {}
        self.processes_error: Exception | None = None

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.shut_down = True

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:
        return f"h{i}"

    def nvmlDeviceGetIndex(self, handle: str) -> int:
        return int(handle[1:])

    def nvmlDeviceGetName(self, h: str) -> bytes | str:
        return b"NVIDIA H100 80GB HBM3" if h == "h0" else "Tesla V100"

    def nvmlDeviceGetUUID(self, h: str) -> str:
        return f"GPU-{h}"

    def nvmlDeviceGetUtilizationRates(self, h: str) -> SimpleNamespace:
        return SimpleNamespace(gpu=97, memory=41)

    def nvmlDeviceGetMemoryInfo(self, h: str) -> SimpleNamespace:
        return SimpleNamespace(used=60 << 30, total=80 << 30, free=20 << 30)

    def nvmlDeviceGetTemperature(self, h: str, sensor: int) -> int:
        return 71

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:
        if h == "h1":
            raise NVMLError_NotSupported()
        return 612_500  # mW

    def nvmlDeviceGetClockInfo(self, h: str, clock: int) -> int:
        return {1: 1980, 2: 2619}[clock]

    def nvmlDeviceGetPcieThroughput(self, h: str, counter: int) -> int:
        return 1200 if counter == 0 else 3400

    def nvmlDeviceGetTotalEccErrors(self, h: str, kind: int, counter: int) -> int:
        return 5 if kind == 0 else 1

    def nvmlDeviceGetRetiredPages(self, h: str, cause: int) -> list[int]:
        if h == "h0":
            raise NVMLError_NotSupported()  # H100 remaps rows instead of retiring pages
        return [0x1000] * (2 if cause == 0 else 1)

    def nvmlDeviceGetRemappedRows(self, h: str) -> tuple[int, int, bool, bool]:
        if h == "h1":
            raise NVMLError_NotSupported()
        return (3, 1, False, False)

    def nvmlDeviceGetNvLinkState(self, h: str, link: int) -> int:
        if h == "h1":
            raise NVMLError_NotSupported()
        if link >= 4:
            raise NVMLError_NotSupported()  # only 4 links on this board
        return 1

    def nvmlDeviceGetFieldValues(self, h: str, fields: list[tuple[int, int]]) -> list[SimpleNamespace]:
        return [
            SimpleNamespace(nvmlReturn=0, timestamp=self.stamp_us,
                            value=SimpleNamespace(ullVal=self.nvlink_kib * (2 if fid == 139 else 1)))
            for fid, _link in fields
        ]

    def nvmlDeviceGetComputeRunningProcesses(self, h: str) -> list[SimpleNamespace]:
        if self.processes_error is not None:
            raise self.processes_error
        return [SimpleNamespace(pid=pid, usedGpuMemory=mem) for pid, mem in self.processes.get(h, ())]

    def nvmlEventSetCreate(self) -> str:
        return "events"

    def nvmlEventSetFree(self, events: str) -> None:
        pass

    def nvmlDeviceRegisterEvents(self, h: str, types: int, events: str) -> None:
        if h == "h1":
            raise NVMLError_NotSupported()

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> SimpleNamespace:
        assert timeout_ms == 0  # the agent must never block on events
        if not self.pending_events:
            raise NVMLError_Timeout()
        return self.pending_events.pop(0)


def _reader(fake: Any) -> GpuReader:
    return GpuReader(fake)


def test_readings_from_nvml_with_unsupported_fields_as_none() -> None:
    fake = FakeNvml()
    reader = _reader(fake)
    status = reader.status()
    assert status.available and status.reason is None and status.driver_version == "550.54.15"
    g0, g1 = status.gpus
    assert (g0.index, g0.name, g0.uuid) == (0, "NVIDIA H100 80GB HBM3", "GPU-h0")
    assert (g0.util_percent, g0.mem_util_percent) == (97.0, 41.0)
    assert (g0.mem_used_bytes, g0.mem_total_bytes) == (60 << 30, 80 << 30)
    assert (g0.temperature_c, g0.power_w) == (71.0, 612.5)
    assert (g0.sm_clock_mhz, g0.mem_clock_mhz) == (1980.0, 2619.0)
    assert (g0.pcie_tx_kbps, g0.pcie_rx_kbps) == (1200.0, 3400.0)
    assert (g0.ecc_corrected, g0.ecc_uncorrected) == (5, 1)
    assert g0.retired_pages is None and g0.remapped_rows == 4
    assert g0.nvlink_tx_kbps is None  # a rate needs two readings
    # The older GPU: no power reading, no NVLink, no row remapping; pages retired instead.
    assert g1.name == "Tesla V100" and g1.power_w is None
    assert g1.nvlink_tx_kbps is None and g1.remapped_rows is None and g1.retired_pages == 3
    assert g1.util_percent == 97.0  # the rest is still read


def test_nvlink_throughput_is_a_rate_between_readings() -> None:
    fake = FakeNvml()
    reader = _reader(fake)
    reader.status()
    fake.nvlink_kib += 500  # per link, over 0.5 s
    fake.stamp_us += 500_000
    g0 = reader.status().gpus[0]
    # 4 links x 500 KiB in 0.5 s = 4000 KiB/s; RX counts twice as much in the fake.
    assert g0.nvlink_tx_kbps == pytest.approx(4000.0)
    assert g0.nvlink_rx_kbps == pytest.approx(8000.0)


def test_xid_events_are_collected_without_waiting_and_kept() -> None:
    fake = FakeNvml()
    reader = _reader(fake)
    assert reader.status().gpus[0].xid_events == ()
    fake.pending_events = [
        SimpleNamespace(device="h0", eventType=8, eventData=79),
        SimpleNamespace(device="h0", eventType=8, eventData=48),
    ]
    status = reader.status()
    assert status.gpus[0].xid_events == (79, 48)
    assert status.gpus[1].xid_events == ()
    assert reader.status().gpus[0].xid_events == (79, 48)  # still shown on the next snapshot


def test_nvml_failing_to_start_is_no_gpu_data() -> None:
    reader = _reader(FakeNvml(init_error=NVMLError_LibraryNotFound("NVML Shared Library Not Found")))
    status = reader.status()
    assert status == reader.status()
    assert status.available is False and status.gpus == ()
    assert status.reason == "no GPU data: NVML could not start: NVML Shared Library Not Found"


def test_an_unexpected_nvml_failure_never_raises() -> None:
    fake = FakeNvml()

    def broken(h: str) -> None:
        raise RuntimeError("driver went away")

    fake.nvmlDeviceGetHandleByIndex = broken  # type: ignore[method-assign,assignment]
    status = _reader(fake).status()
    assert status.available is False
    assert status.reason is not None and status.reason.startswith("no GPU data: ") and "driver went away" in status.reason


def test_close_shuts_nvml_down() -> None:
    fake = FakeNvml()
    reader = _reader(fake)
    reader.status()
    reader.close()
    assert fake.shut_down


# --------------------------------------------------------------------------
# GPU: which GPU each rank's process computes on
# --------------------------------------------------------------------------


def test_each_ranks_gpu_comes_from_its_process_not_its_local_rank() -> None:
    """Rank pids 100 and 101 with local ranks 0 and 1, launched the other way round (CUDA_VISIBLE_DEVICES):
    100 computes on GPU 1, 101 on GPU 0 and has a stray context on GPU 1 (it touched that device once)."""
    fake = FakeNvml()
    fake.processes = {"h0": [(101, 30 << 30), (999, 1 << 30)], "h1": [(100, 40 << 30), (101, 500 << 20)]}
    owners = GpuReader(fake).process_gpus([100, 101, 102])
    assert owners == {100: (1, "GPU-h1"), 101: (0, "GPU-h0")}  # 102 has no context: not guessed
    ranks = (RankInfo(rank=0, local_rank=0, world_size=3, pid=100), RankInfo(rank=1, local_rank=1, world_size=3, pid=101),
             RankInfo(rank=2, local_rank=2, world_size=3, pid=102))
    got = with_gpus(ranks, owners)
    assert [(r.rank, r.local_rank, r.gpu, r.gpu_uuid) for r in got] == [
        (0, 0, 1, "GPU-h1"), (1, 1, 0, "GPU-h0"), (2, 2, None, None)]


def test_a_process_nvml_cannot_measure_still_gets_its_gpu() -> None:
    """Without per-process memory accounting (usedGpuMemory None: some drivers, MIG) a single context still names
    the GPU; a device whose process list is not supported is skipped."""
    fake = FakeNvml()
    fake.processes = {"h1": [(100, None)]}
    assert GpuReader(fake).process_gpus([100]) == {100: (1, "GPU-h1")}
    fake.processes_error = NVMLError_NotSupported()
    assert GpuReader(fake).process_gpus([100]) == {}


def test_without_nvml_no_rank_gets_a_gpu() -> None:
    reader = GpuReader(FakeNvml(init_error=NVMLError_LibraryNotFound("libnvidia-ml.so.1 not found")))
    assert reader.process_gpus([100]) == {}
    assert GpuReader(FakeNvml()).process_gpus([]) == {}
