"""Where a hang most likely started: the outlier stack groups that are not waiting for anyone.

Read by the rank states (a busy side process makes its rank a root) and by
the suspects (the group an origin points at is lifted above those that only
fit the layout). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from rankscope.analyzers.stacks import Grouping, Lane
from rankscope.contract.frames import communication_kind, is_communication
from rankscope.contract.snapshot import ProcessRole


@dataclass(frozen=True, slots=True)
class Origin:
    """Outlier ranks that are not waiting for anyone: where a hang most likely started.

    ``side`` follows Aegis's split: "compute" when the ranks are stuck in
    their own work (or a busy subprocess), so the ranks themselves are
    suspect; "p2p" or "collective" when they are stuck on their way into a
    call that talks to others, so the group they were talking to is suspect.
    ``lane`` is where the stuck frame is: the main thread's, or a busy thread
    or subprocess of the rank, with its process role typed.
    """

    ranks: tuple[int, ...]
    side: str
    frame: str
    lane: Lane


def origins_of(grouping: Grouping) -> list[Origin]:
    """Outlier groups stuck somewhere other than a call that waits for other ranks.

    In a hang the peers of a stuck rank wait in send/recv or a collective;
    the ranks doing something else are where the fault started. A group
    whose main thread waits but which runs a busy thread or subprocess the
    healthy ranks lack (a stuck dataloader worker) counts as stuck in its own
    work.
    """
    if not grouping.dominant:
        return []
    healthy = grouping.groups[grouping.dominant[0]]
    healthy_lanes = set(healthy.lanes)
    out: list[Origin] = []
    for i in grouping.outliers:
        g = grouping.groups[i]
        extra = [lane for lane in g.lanes[1:]
                 if lane not in healthy_lanes and lane.frames and not is_communication(lane.frames[-1])]
        if extra:
            out.append(Origin(g.ranks, "compute", extra[0].frames[-1], extra[0]))
            continue
        if not g.frames or is_communication(g.frames[-1]):
            continue
        shared = 0
        for a, b in zip(healthy.frames, g.frames, strict=False):
            if a != b:
                break
            shared += 1
        main = g.lanes[0] if g.lanes else Lane(ProcessRole.MAIN, False, g.frames)
        entering = [f for f in g.frames[shared:] if communication_kind(f)]
        if entering:
            side = communication_kind(entering[-1]) or "collective"
            out.append(Origin(g.ranks, side, entering[-1], main))
        else:
            out.append(Origin(g.ranks, "compute", g.frames[-1], main))
    return out


__all__ = ["Origin", "origins_of"]
