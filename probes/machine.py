"""One capture of this machine: ranks, their stacks, host and GPU metrics, CCL counters.

This is what an agent answers a snapshot request with. It never raises for a
per-process failure (those are recorded in place, see ``rankscope.probes.pyspy``),
and the blocking psutil/NVML/file work runs in threads so an agent's event
loop keeps serving other requests meanwhile.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from rankscope.contract.snapshot import (
    CaptureError,
    CaptureErrorKind,
    Instant,
    MachineSnapshot,
    ProcessRole,
    RankCounters,
    RankInfo,
    RankStacks,
)
from rankscope.probes import host
from rankscope.probes.ccl_counters import read_counters
from rankscope.probes.discovery import discover_ranks
from rankscope.probes.gpu import gpu_status, process_gpus
from rankscope.probes.pyspy import capture_stacks

# Shortest window over which CPU percentages are measured when the capture
# itself is quicker (stacks off): a rate over a few milliseconds is noise.
MIN_CPU_WINDOW_S = 0.2


@dataclass(frozen=True, slots=True)
class CaptureOptions:
    stacks: bool = True
    native: bool = False
    subprocesses: bool = True
    timeout_s: float = 5.0  # per py-spy call
    concurrency: int = 8  # py-spy calls at once


@dataclass(frozen=True, slots=True)
class Scope:
    """Which job on this machine: by launcher PID, torchrun run id, and where its counter files are."""

    launcher_pid: int | None = None
    run_id: str | None = None
    counter_dir: Path | None = None
    slurm_job: str | None = None  # SLURM_JOB_ID of the ranks (an agent started inside the job)
    slurm_node: str | None = None  # SLURMD_NODENAME: several Slurm nodes may share one host
    users: frozenset[int] | None = None  # whose processes may be ranks (None: discovery.default_users)


def _all_pids(ranks: tuple[RankInfo, ...]) -> list[int]:
    return [p for r in ranks for p in (r.pid, *(s.pid for s in r.subprocesses))]


def _refresh(rank: RankInfo) -> RankInfo:
    """Re-read per-process readings at the end of the capture, so CPU% covers the capture window."""
    main = host.process_info(rank.pid, ProcessRole.MAIN) or rank.process
    subs = tuple(host.process_info(s.pid, s.role) or s for s in rank.subprocesses)
    return replace(rank, process=main, subprocesses=subs)


def with_gpus(ranks: tuple[RankInfo, ...], owners: dict[int, tuple[int, str | None]]) -> tuple[RankInfo, ...]:
    """Each rank with the GPU its main process computes on (``process_gpus``); unchanged where NVML did not say."""
    return tuple(replace(r, gpu=owners[r.pid][0], gpu_uuid=owners[r.pid][1]) if r.pid in owners else r for r in ranks)


async def capture_machine(machine: str, address: str, scope: Scope, options: CaptureOptions,
                          found: Callable[[tuple[RankInfo, ...]], None] | None = None) -> MachineSnapshot:
    """Everything this machine can tell about its ranks right now.

    ``found`` is called with the ranks as soon as they are discovered, before
    the stacks: the agent starts its sampler there, so sampling runs during a
    capture's py-spy dumps (seconds on a loaded machine) rather than after them.
    """
    captured = Instant(wall=time.time(), mono=time.monotonic())
    started = time.monotonic()
    await asyncio.to_thread(host.prime_cpu)
    ranks = await asyncio.to_thread(discover_ranks, launcher_pid=scope.launcher_pid, run_id=scope.run_id,
                                    slurm_job=scope.slurm_job, slurm_node=scope.slurm_node, users=scope.users)
    await asyncio.to_thread(host.prime_cpu, _all_pids(ranks))
    if found is not None:
        found(ranks)

    stacks: tuple[RankStacks, ...] = ()
    if options.stacks and ranks:
        stacks = await capture_stacks(
            ranks, native=options.native, subprocesses=options.subprocesses,
            timeout_s=options.timeout_s, concurrency=options.concurrency,
        )

    error: CaptureError | None = None
    counters: tuple[RankCounters, ...] = ()
    try:
        counters = await asyncio.to_thread(read_counters, ranks, scope.counter_dir)
    except Exception as exc:  # the reader promises not to raise; if it does, the snapshot still stands
        error = CaptureError(CaptureErrorKind.FAILED, f"CCL counter files could not be read: {exc}",
                             "check the counter directory (--counter-dir) and the rankscope versions on both sides")

    remaining = MIN_CPU_WINDOW_S - (time.monotonic() - started)
    if remaining > 0:
        await asyncio.sleep(remaining)  # a measurement window for CPU%, not a synchronisation
    ranks = tuple(await asyncio.to_thread(lambda: [_refresh(r) for r in ranks]))
    host_metrics = await asyncio.to_thread(host.host_metrics)
    gpus = await asyncio.to_thread(gpu_status)
    if gpus.available and ranks:
        owners = await asyncio.to_thread(process_gpus, [r.pid for r in ranks])
        ranks = with_gpus(ranks, owners)

    return MachineSnapshot(
        machine=machine,
        address=address,
        reachable=True,
        captured=captured,
        hostname=socket.gethostname(),
        ranks=ranks,
        stacks=stacks,
        host=host_metrics,
        gpus=gpus,
        counters=counters,
        error=error,
    )
