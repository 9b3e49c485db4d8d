"""Stage 1 of the pass (docs/analysis-pass.md): the evidence in, read once.

Takes a ``JobSnapshot`` (and the layout the user gave); passes on
``Evidence``: the snapshot with the plugin's communicators joined into the
torch groups, the layout as a ``Topology``, every rank's machine, the stacks
grouped by signature (ByteRobust §5.1), the ranks that could not be seen and
why, and the CCL counters with their waits (``ccl_desync.counter_waits``).
Later stages read these and never read the snapshot again for them.

Raises ValueError (with the fix) when the layout does not fit the job.
Pure: stdlib, numpy and the snapshot contract; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rankscope.analyzers.ccl_desync import CounterWaits, counter_waits
from rankscope.analyzers.placement import Placement
from rankscope.analyzers.stacks import DEFAULT_OPTIONS, Grouping, SignatureOptions, group_stacks
from rankscope.analyzers.topology import Topology, joined_snapshot, topology_for
from rankscope.contract.snapshot import CaptureErrorKind, JobSnapshot, Layout, RankCounters, RankStacks


@dataclass(frozen=True, slots=True)
class Evidence:
    """What the capture holds, read once: stacks grouped, counters and their waits, the layout, the machines."""

    snapshot: JobSnapshot  # communicators joined into the torch groups when ``gather`` was asked to join
    layout: Layout | None  # as the user gave it
    options: SignatureOptions
    topology: Topology
    placement: Placement
    stacks: Mapping[int, RankStacks]
    grouping: Grouping
    missing: dict[int, str]  # rank -> why it could not be seen
    counters: Mapping[int, RankCounters]
    waits: CounterWaits | None  # None: no counters in the capture
    exiting: tuple[int, ...] = ()  # of the ranks not seen, those whose process is gone or shows no Python frames
    # Of the ranks not seen, those of a machine whose agent could not be reached: their absence is evidence (a rank
    # view says unreadable), where a rank merely missing from a folder of dumps says nothing (not captured).
    unreachable: frozenset[int] = frozenset()


def gather(snapshot: JobSnapshot, layout: Layout | None = None, options: SignatureOptions = DEFAULT_OPTIONS,
           join: bool = True) -> Evidence:
    """The capture's evidence; ``join``: one communicator per real group, one row per collective (the plugin's
    NCCL communicators joined into the shim's torch groups, groups without a description named by their role).
    """
    if join:
        snapshot = joined_snapshot(snapshot, topology_for(snapshot, layout))
    topology = topology_for(snapshot, layout)
    rpm = (layout.ranks_per_machine if layout is not None else None) or topology.layout.ranks_per_machine
    if rpm is None and snapshot.layout is not None:
        rpm = snapshot.layout.ranks_per_machine
    stacks = snapshot.all_stacks()
    grouping = group_stacks(stacks, options)
    placement = Placement(snapshot, topology.world_size, rpm)
    missing = missing_ranks(snapshot, topology, grouping, stacks)
    counters = snapshot.all_counters()
    waits = counter_waits(counters) if counters else None
    return Evidence(snapshot, layout, options, topology, placement, stacks, grouping, missing, counters, waits,
                    exiting_ranks(grouping, stacks), unreachable_ranks(snapshot))


def unreachable_ranks(snapshot: JobSnapshot) -> frozenset[int]:
    """The ranks of the machines whose agent could not be reached."""
    return frozenset(r.rank for m in snapshot.machines if not m.reachable for r in m.ranks)


def missing_ranks(
    snapshot: JobSnapshot, topology: Topology, grouping: Grouping, stacks: Mapping[int, RankStacks]
) -> dict[int, str]:
    """Rank -> why it could not be seen, for every expected rank without readable stacks."""
    reasons: dict[int, str] = {}
    for m in snapshot.machines:
        if not m.reachable:
            why = f"machine {m.machine} unreachable" + (f" ({m.error.message})" if m.error else "")
            for r in m.ranks:
                reasons.setdefault(r.rank, why)
    for rank in grouping.unseen:
        err = stacks[rank].main.error
        if err is not None:
            reasons[rank] = f"{err.kind}: {err.message}"
        elif stacks[rank].main.threads:
            reasons[rank] = "main thread shows no Python frames (the process is exiting or not in Python yet)"
        else:
            reasons[rank] = "no threads captured"
    for rank in range(topology.world_size):
        if rank not in stacks:
            reasons.setdefault(rank, "no stacks in the snapshot")
    return reasons


def exiting_ranks(grouping: Grouping, stacks: Mapping[int, RankStacks]) -> tuple[int, ...]:
    """The unseen ranks whose process is gone or is leaving Python (its main thread has no Python frames)."""
    out = []
    for rank in grouping.unseen:
        err = stacks[rank].main.error
        if (err.kind == CaptureErrorKind.GONE) if err is not None else bool(stacks[rank].main.threads):
            out.append(rank)
    return tuple(out)


__all__ = ["Evidence", "exiting_ranks", "gather", "missing_ranks", "unreachable_ranks"]
