"""Where a hang most likely started: the outlier stack groups that are not waiting for anyone.

Read by the rank states (a busy side process makes its rank a root) and by
the suspects (the group an origin points at is lifted above those that only
fit the layout). Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from rankscope.analyzers.stacks import MAIN_LANE, Grouping
from rankscope.contract.frames import communication_kind, is_communication


@dataclass(frozen=True, slots=True)
class Origin:
    """Outlier ranks that are not waiting for anyone: where a hang most likely started.

    ``side`` follows Aegis's split: "compute" when the ranks are stuck in
    their own work (or a busy subprocess), so the ranks themselves are
    suspect; "p2p" or "collective" when they are stuck on their way into a
    call that talks to others, so the group they were talking to is suspect.
    """

    ranks: tuple[int, ...]
    side: str
    frame: str
    lane: str


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
        extra = [(label, frames) for label, frames in g.lanes[1:]
                 if (label, frames) not in healthy_lanes and frames and not is_communication(frames[-1])]
        if extra:
            label, frames = extra[0]
            out.append(Origin(g.ranks, "compute", frames[-1], label))
            continue
        if not g.frames or is_communication(g.frames[-1]):
            continue
        shared = 0
        for a, b in zip(healthy.frames, g.frames, strict=False):
            if a != b:
                break
            shared += 1
        entering = [f for f in g.frames[shared:] if communication_kind(f)]
        if entering:
            side = communication_kind(entering[-1]) or "collective"
            out.append(Origin(g.ranks, side, entering[-1], MAIN_LANE))
        else:
            out.append(Origin(g.ranks, "compute", g.frames[-1], MAIN_LANE))
    return out


__all__ = ["Origin", "origins_of"]
