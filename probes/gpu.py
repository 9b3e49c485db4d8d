"""GPU readings through NVML (``nvidia-ml-py``), touched in this module only.

Like nvitop, NVML being absent or failing is handled in one place: ``GpuReader``
turns it into ``GpuStatus(available=False, reason="no GPU data: <why>")``, and
``gpu_status()`` never raises. Each reading is guarded on its own, so a field
the GPU does not support (``NVMLError_NotSupported``) is ``None`` while the
others are still reported.

Units, as NVML gives them: PCIe throughput in KB/s (NVML's 20 ms window);
NVLink throughput in KiB/s, computed from NVML's cumulative per-link counters
between two readings (the first reading has no rate, so it is ``None``); power
in watts (NVML reports mW); clocks in MHz. ECC counts are volatile (since the
driver loaded); retired pages sum both causes; remapped rows sum correctable
and uncorrectable. Xid events are collected from an NVML event set with a zero
wait, and the last few per GPU are kept so a snapshot shows recent ones.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any, TypeVar

from rankscope.contract.snapshot import GpuMetrics, GpuStatus

T = TypeVar("T")

XID_KEEP = 16  # recent Xid codes kept per GPU
NVLINK_MAX_LINKS = 18  # NVML_NVLINK_MAX_LINKS in current drivers
UINT_MAX = 0xFFFFFFFF


def _load_nvml() -> ModuleType:
    import pynvml  # nvidia-ml-py; imported here so the rest of rankscope never needs it

    module: ModuleType = pynvml
    return module


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class GpuReader:
    """NVML, initialised once and read on demand. ``nvml`` stands in for ``pynvml`` in tests."""

    def __init__(self, nvml: ModuleType | Any | None = None) -> None:
        self._nvml: Any = nvml
        self._lock = threading.Lock()
        self._ready = False
        self._failure: str | None = None
        self._events: Any = None
        self._xids: dict[int, deque[int]] = {}
        # (gpu index, "tx"/"rx") -> (cumulative KiB summed over links, timestamp in µs)
        self._nvlink_last: dict[tuple[int, str], tuple[int, int]] = {}

    # ---- lifecycle -------------------------------------------------------

    def _start(self) -> bool:
        """Initialise NVML once; remember why it failed so every later call says the same."""
        if self._ready:
            return True
        try:
            if self._nvml is None:
                self._nvml = _load_nvml()
            self._nvml.nvmlInit()
        except ImportError:
            self._failure = "nvidia-ml-py is not installed (pip install 'rankscope[agent]')"
            return False
        except Exception as exc:  # pynvml raises NVMLError subclasses; an odd driver may raise others
            self._failure = f"NVML could not start: {_text(exc)}"
            return False
        self._ready = True
        self._failure = None
        self._register_xid_events()
        return True

    def close(self) -> None:
        with self._lock:
            if not self._ready:
                return
            if self._events is not None:
                self._guard(lambda: self._nvml.nvmlEventSetFree(self._events))
                self._events = None
            self._guard(self._nvml.nvmlShutdown)
            self._ready = False

    # ---- one guarded reading ----------------------------------------------

    def _guard(self, read: Callable[..., T], *args: Any) -> T | None:
        try:
            return read(*args)
        except self._nvml.NVMLError:
            return None

    # ---- Xid events --------------------------------------------------------

    def _register_xid_events(self) -> None:
        nv = self._nvml
        events = self._guard(nv.nvmlEventSetCreate)
        if events is None:
            return
        count = self._guard(nv.nvmlDeviceGetCount) or 0
        registered = False
        for i in range(count):
            try:
                handle = nv.nvmlDeviceGetHandleByIndex(i)
                nv.nvmlDeviceRegisterEvents(handle, nv.nvmlEventTypeXidCriticalError, events)
                registered = True
            except nv.NVMLError:
                continue  # Xid events not supported on this GPU (or it vanished)
        if registered:
            self._events = events
        else:
            self._guard(lambda: nv.nvmlEventSetFree(events))

    def _drain_xids(self) -> None:
        """Collect pending Xid events without waiting (timeout 0)."""
        if self._events is None:
            return
        nv = self._nvml
        for _ in range(256):  # bounded: an event storm must not stall the agent
            try:
                data = nv.nvmlEventSetWait_v2(self._events, 0)
            except nv.NVMLError:
                return  # NVML_ERROR_TIMEOUT: nothing pending (or events unsupported)
            if data.eventType != nv.nvmlEventTypeXidCriticalError:
                continue
            index = self._guard(nv.nvmlDeviceGetIndex, data.device)
            if index is None:
                continue
            self._xids.setdefault(int(index), deque(maxlen=XID_KEEP)).append(int(data.eventData))

    # ---- readings ----------------------------------------------------------

    def _nvlink_rate(self, index: int, handle: Any, direction: str, field_id: int) -> float | None:
        nv = self._nvml
        links = [link for link in range(NVLINK_MAX_LINKS)
                 if self._guard(nv.nvmlDeviceGetNvLinkState, handle, link) == 1]
        if not links:
            return None
        values = self._guard(lambda: nv.nvmlDeviceGetFieldValues(handle, [(field_id, link) for link in links]))
        if values is None:
            return None
        total = 0
        stamp = 0
        for v in values:
            if v.nvmlReturn != 0:
                return None
            total += int(v.value.ullVal)
            stamp = max(stamp, int(v.timestamp))
        previous = self._nvlink_last.get((index, direction))
        self._nvlink_last[(index, direction)] = (total, stamp)
        if previous is None or stamp <= previous[1]:
            return None
        return (total - previous[0]) / ((stamp - previous[1]) / 1e6)

    def _read_gpu(self, index: int) -> GpuMetrics:
        nv = self._nvml
        g = self._guard
        handle = g(lambda: nv.nvmlDeviceGetHandleByIndex(index))
        if handle is None:
            return GpuMetrics(index=index)
        util = g(lambda: nv.nvmlDeviceGetUtilizationRates(handle))
        mem = g(lambda: nv.nvmlDeviceGetMemoryInfo(handle))
        power_mw = g(lambda: nv.nvmlDeviceGetPowerUsage(handle))

        def ecc(kind: int) -> int | None:
            return g(lambda: int(nv.nvmlDeviceGetTotalEccErrors(handle, kind, nv.NVML_VOLATILE_ECC)))

        def retired() -> int | None:
            pages = [g(nv.nvmlDeviceGetRetiredPages, handle, cause)
                      for cause in (nv.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
                                    nv.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR)]
            known = [len(p) for p in pages if p is not None]
            return sum(known) if known else None

        remapped = g(lambda: nv.nvmlDeviceGetRemappedRows(handle))
        name = g(lambda: nv.nvmlDeviceGetName(handle))
        uuid = g(lambda: nv.nvmlDeviceGetUUID(handle))
        temp = g(lambda: nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))
        sm = g(lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_SM))
        memclk = g(lambda: nv.nvmlDeviceGetClockInfo(handle, nv.NVML_CLOCK_MEM))
        tx = g(lambda: nv.nvmlDeviceGetPcieThroughput(handle, nv.NVML_PCIE_UTIL_TX_BYTES))
        rx = g(lambda: nv.nvmlDeviceGetPcieThroughput(handle, nv.NVML_PCIE_UTIL_RX_BYTES))
        return GpuMetrics(
            index=index,
            name=_text(name) if name is not None else None,
            uuid=_text(uuid) if uuid is not None else None,
            util_percent=float(util.gpu) if util is not None else None,
            mem_util_percent=float(util.memory) if util is not None else None,
            mem_used_bytes=int(mem.used) if mem is not None else None,
            mem_total_bytes=int(mem.total) if mem is not None else None,
            temperature_c=float(temp) if temp is not None else None,
            power_w=power_mw / 1000.0 if power_mw is not None else None,
            sm_clock_mhz=float(sm) if sm is not None else None,
            mem_clock_mhz=float(memclk) if memclk is not None else None,
            pcie_tx_kbps=float(tx) if tx is not None else None,
            pcie_rx_kbps=float(rx) if rx is not None else None,
            nvlink_tx_kbps=self._nvlink_rate(index, handle, "tx", nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX),
            nvlink_rx_kbps=self._nvlink_rate(index, handle, "rx", nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX),
            ecc_corrected=ecc(nv.NVML_MEMORY_ERROR_TYPE_CORRECTED),
            ecc_uncorrected=ecc(nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED),
            retired_pages=retired(),
            remapped_rows=int(remapped[0]) + int(remapped[1]) if remapped is not None else None,
            xid_events=tuple(self._xids.get(index, ())),
        )

    def status(self) -> GpuStatus:
        """Every GPU's readings, or ``available=False`` with the reason. Never raises."""
        with self._lock:
            try:
                if not self._start():
                    return GpuStatus(available=False, reason=f"no GPU data: {self._failure}")
                nv = self._nvml
                count = self._guard(nv.nvmlDeviceGetCount)
                if count is None:
                    return GpuStatus(available=False, reason="no GPU data: NVML could not count the GPUs")
                if count == 0:
                    return GpuStatus(available=False, reason="no GPU data: NVML sees no GPU on this machine")
                self._drain_xids()
                driver = self._guard(nv.nvmlSystemGetDriverVersion)
                return GpuStatus(
                    available=True,
                    gpus=tuple(self._read_gpu(i) for i in range(count)),
                    driver_version=_text(driver) if driver is not None else None,
                )
            except Exception as exc:  # the one place NVML may fail in ways not foreseen
                return GpuStatus(available=False, reason=f"no GPU data: NVML failed while reading: {_text(exc)}")


    def process_gpus(self, pids: Iterable[int]) -> dict[int, tuple[int, str | None]]:
        """pid -> (device index, UUID) of the GPU each of ``pids`` computes on, from NVML's running compute
        processes per device. A pid with contexts on several devices (a rank that also touched GPU 0) is placed
        where it uses the most memory. Empty without NVML; never raises."""
        wanted = set(pids)
        with self._lock:
            try:
                if not wanted or not self._start():
                    return {}
                nv = self._nvml
                best: dict[int, tuple[int, int, str | None]] = {}  # pid -> (memory, index, uuid)
                for index in range(self._guard(nv.nvmlDeviceGetCount) or 0):
                    handle = self._guard(nv.nvmlDeviceGetHandleByIndex, index)
                    if handle is None:
                        continue
                    procs = self._guard(nv.nvmlDeviceGetComputeRunningProcesses, handle) or ()
                    uuid: str | None = None
                    for proc in procs:
                        pid = int(getattr(proc, "pid", -1))
                        if pid not in wanted:
                            continue
                        if uuid is None:
                            raw = self._guard(nv.nvmlDeviceGetUUID, handle)
                            uuid = _text(raw) if raw is not None else None
                        used = getattr(proc, "usedGpuMemory", None)
                        memory = int(used) if isinstance(used, int) else -1  # None: NVML could not say
                        if pid not in best or memory > best[pid][0]:
                            best[pid] = (memory, index, uuid)
                return {pid: (index, uuid) for pid, (_m, index, uuid) in best.items()}
            except Exception:  # a reading the agent can live without: the ranks' GPUs are then assumed
                return {}


_default: GpuReader | None = None
_default_lock = threading.Lock()


def default_reader() -> GpuReader:
    """The process-wide reader, so NVML is initialised once and Xid events accumulate."""
    global _default
    with _default_lock:
        if _default is None:
            _default = GpuReader()
        return _default


def gpu_status() -> GpuStatus:
    """NVML's view of this machine; ``available=False, reason="no GPU data: ..."`` when there is none."""
    return default_reader().status()


def process_gpus(pids: Iterable[int]) -> dict[int, tuple[int, str | None]]:
    """pid -> (device index, UUID) of each process's GPU, as NVML sees it; empty without NVML."""
    return default_reader().process_gpus(pids)
