"""A standby's self-check: verdicts on recorded readings, and one real run (NVML absent here, gloo on loopback)."""

from __future__ import annotations

import pytest
from rankscope.actions.self_check import (
    SelfCheckConfig,
    check_arithmetic,
    judge_gpus,
    judge_host,
    self_check,
)
from rankscope.contract.snapshot import GpuMetrics, GpuStatus, HostMetrics


def test_host_needs_cores_and_free_memory() -> None:
    cfg = SelfCheckConfig(min_cpus=4, min_free_memory_bytes=8 << 30)
    ok = judge_host(HostMetrics(None, cpu_count=8, mem_total_bytes=64 << 30, mem_used_bytes=16 << 30), cfg)
    assert [(name, passed) for name, passed, _ in ok] == [("cpu count", True), ("free memory", True)]
    short = judge_host(HostMetrics(None, cpu_count=2, mem_total_bytes=16 << 30, mem_used_bytes=12 << 30), cfg)
    assert [passed for _, passed, _ in short] == [False, False]
    assert short[1][2] == "4.0 GiB free, need 8.0 GiB"
    unknown = judge_host(HostMetrics(None, 2, None, None, error="memory: /proc unreadable"), cfg)
    assert not unknown[1][1] and "/proc unreadable" in unknown[1][2]


def test_gpus_are_judged_from_nvml_readings() -> None:
    absent = GpuStatus(available=False, reason="no GPU data: NVML Shared Library Not Found")
    assert judge_gpus(absent, SelfCheckConfig())[0][1]  # a CPU machine needs none
    needed = judge_gpus(absent, SelfCheckConfig(expect_gpus=8))
    assert not needed[0][1] and "8 expected" in needed[0][2]
    status = GpuStatus(available=True, gpus=(GpuMetrics(0, ecc_uncorrected=0), GpuMetrics(1, ecc_uncorrected=2),
                                             GpuMetrics(2, xid_events=(79,))))
    checks = judge_gpus(status, SelfCheckConfig(expect_gpus=4))
    assert checks[0] == ("gpu count", False, "3 GPU(s), need 4")
    assert checks[1] == ("gpu 0", True, "healthy")
    assert checks[2] == ("gpu 1", False, "2 uncorrectable ECC error(s)")
    assert checks[3] == ("gpu 2", False, "Xid 79")


def test_arithmetic_check_is_exact() -> None:
    assert check_arithmetic() == ("cpu arithmetic", True, "exact")


@pytest.mark.drill
def test_a_real_self_check_runs_a_gloo_all_reduce_over_loopback() -> None:
    result = self_check("standby-0", SelfCheckConfig(min_free_memory_bytes=1 << 20, collective_timeout_s=60))
    checks = {name: (passed, detail) for name, passed, detail in result.checks}
    assert checks["loopback collective"] == (True, "gloo all_reduce over 127.0.0.1 exact"), checks
    assert checks["cpu arithmetic"][0] and checks["cpu count"][0]
    assert result.ok and result.machine == "standby-0"


def test_a_broken_interpreter_fails_the_collective_with_its_reason() -> None:
    from rankscope.actions.self_check import check_loopback_collective

    name, ok, detail = check_loopback_collective(python="/nonexistent/python", timeout_s=5)
    assert (name, ok) == ("loopback collective", False) and "cannot start" in detail
