"""Constructed fail-slow series: seeded noise around a healthy level, one snapshot a second, faults on top.

Four machines of two ranks each; a fault scales metrics of one machine for a
time (a one-sample spike, a short burst, a persistently slow machine).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from rankscope.contract.snapshot import (
    CaptureError,
    CaptureErrorKind,
    Communicator,
    GpuMetrics,
    GpuStatus,
    HostMetrics,
    Instant,
    JobSnapshot,
    MachineSnapshot,
    OpCounters,
    ProcessInfo,
    ProcessRole,
    RankCounters,
    RankInfo,
)

MACHINES = ("m0", "m1", "m2", "m3")
RPM = 2  # ranks per machine
HEALTHY = {"step": 0.5, "proc_cpu": 60.0, "host_cpu": 40.0, "temp": 60.0, "util": 80.0, "power": 250.0, "clock": 1400.0}
NOISE = 0.03  # relative noise on every sample

# A fault: (t, machine) -> {metric: factor}
Fault = Callable[[int, str], dict[str, float]]


def no_fault(_t: int, _m: str) -> dict[str, float]:
    return {}


# CCL ops of one rank at one time: (t, rank) -> its OpCounters
Ops = Callable[[int, int], tuple[OpCounters, ...]]


def make_series(n: int, fault: Fault = no_fault, seed: int = 7, machines: tuple[str, ...] = MACHINES,
                unreachable: Callable[[int, str], bool] = lambda _t, _m: False,
                ops: Ops = lambda _t, _r: (),
                comms: Callable[[int], tuple[Communicator, ...]] = lambda _r: ()) -> list[JobSnapshot]:
    """``n`` snapshots one second apart; each metric noisy around HEALTHY times the fault's factor."""
    rng = np.random.default_rng(seed)
    steps = {r: 0 for r in range(len(machines) * RPM)}
    out = []
    for t in range(n):
        ms = []
        for i, m in enumerate(machines):
            f = fault(t, m)

            def v(key: str, f: dict[str, float] = f) -> float:
                return float(HEALTHY[key] * f.get(key, 1.0) * (1 + NOISE * rng.standard_normal()))

            ranks = tuple(range(i * RPM, (i + 1) * RPM))
            if unreachable(t, m):
                # as the real client does, an unreachable agent is named by its address
                ms.append(MachineSnapshot(f"127.0.0.1:{5000 + i}", f"127.0.0.1:{5000 + i}", False, None,
                                          error=CaptureError(CaptureErrorKind.UNREACHABLE, "connection refused")))
                continue
            infos, counters = [], []
            for r in ranks:
                step = v("step")
                steps[r] += 1
                infos.append(RankInfo(r, r % RPM, len(machines) * RPM, 1000 + r,
                                      process=ProcessInfo(1000 + r, 1, ProcessRole.MAIN, "python", cpu_percent=v("proc_cpu"))))
                counters.append(RankCounters(r, 1000 + r, len(machines) * RPM, "job", float(t), steps=steps[r],
                                             last_step_duration_s=step, ops=ops(t, r), communicators=comms(r)))
            gpus = GpuStatus(True, tuple(GpuMetrics(g, util_percent=v("util"), temperature_c=v("temp"), power_w=v("power"),
                                                    sm_clock_mhz=v("clock")) for g in range(2)))
            ms.append(MachineSnapshot(m, f"127.0.0.1:{5000 + i}", True, Instant(1000.0 + t, 50.0 + t * 1.3),
                                      ranks=tuple(infos), host=HostMetrics(v("host_cpu"), 8, 16 << 30, 8 << 30, 1.0),
                                      gpus=gpus, counters=tuple(counters)))
        out.append(JobSnapshot(Instant(1_700_000_000.0 + t, 100.0 + t), tuple(ms)))
    return out


def slow_machine(machine: str, start: int, factors: dict[str, float], end: int = 10**9) -> Fault:
    def fault(t: int, m: str) -> dict[str, float]:
        return factors if m == machine and start <= t < end else {}
    return fault


def combine(*faults: Fault) -> Fault:
    def fault(t: int, m: str) -> dict[str, float]:
        out: dict[str, float] = {}
        for f in faults:
            out.update(f(t, m))
        return out
    return fault


SPIKE = slow_machine("m1", 20, {"step": 3.0, "proc_cpu": 1.6, "temp": 1.4, "util": 0.3}, end=21)
BURST = slow_machine("m2", 30, {"step": 1.6, "proc_cpu": 1.4, "temp": 1.3, "clock": 0.7}, end=36)
SLOW_STEP = slow_machine("m2", 10, {"step": 1.5})
SLOW_ALL = slow_machine("m2", 10, {"step": 1.5, "proc_cpu": 1.3, "temp": 1.25})
