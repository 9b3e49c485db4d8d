"""Stage 3 of the pass (docs/analysis-pass.md): who waits on whom.

Takes ``stage_rank_states.RankStates``; passes on ``Waits``. A collective
waiter waits on the members of its groups that are not at its call site (on
the whole job when all its layout groups are complete there); a send/recv
waits on the stage it talks to (the peers the counters name, else the
adjacent pipeline stage its words point at). A rank idle in the autograd
engine whose data-parallel peers all wait in one collective is inside
backward's gradient reduction: a collective waiter too.

Pure: stdlib, numpy and the snapshot contract; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rankscope.analyzers.chain import BACKWARD_SITE, GroupId, RankGroups, RankState, RankView, SiteIndex, SiteKey
from rankscope.analyzers.stage_rank_states import RankStates


@dataclass(frozen=True, slots=True)
class Waits:
    """The waits of every rank: who waits in a collective or a send/recv, and toward whom."""

    states: RankStates
    views: Mapping[int, RankView]  # the states, backward's gradient reduction resolved
    groups: RankGroups
    index: SiteIndex  # each group's ranks by call site
    collective: frozenset[int]
    p2p: frozenset[int]
    on_world: frozenset[int]  # collective waiters that wait on the whole job
    p2p_targets: Mapping[int, set[int]]  # send/recv waiter -> the ranks it waits on (empty: the whole job)
    p2p_waiters: Mapping[int, list[int]]  # rank -> the send/recv waiters toward it
    majority: frozenset[int]  # the ranks of a stack group larger than any other: the job running, not a root


def waits_of(states: RankStates) -> Waits:
    """Each waiting rank's targets, from the states and the layout's groups."""
    evidence = states.evidence
    sizes = [len(g.ranks) for g in evidence.grouping.groups]
    unique_majority = len(sizes) > 0 and sizes[0] > 1 and (len(sizes) == 1 or sizes[0] > sizes[1])
    majority = frozenset(evidence.grouping.groups[0].ranks) if unique_majority else frozenset()
    groups = RankGroups(evidence.topology, list(states.views))
    views = dict(states.views)
    _resolve_backward(views, groups)
    index = SiteIndex(views, groups)
    collective = {r for r, v in views.items() if v.state is RankState.COLLECTIVE}
    p2p = {r for r, v in views.items() if v.state is RankState.P2P}
    # A collective waiter whose layout groups are all complete at its site waits on the whole job.
    # (Decided once per group and call site: all the ranks at one site of one group get the same answer.)
    complete: dict[tuple[GroupId, SiteKey], bool] = {}

    def whole_group_at(gid: GroupId, key: SiteKey) -> bool:
        hit = complete.get((gid, key))
        if hit is None:
            hit = complete[(gid, key)] = len(index.sites(gid).get(key, ())) == len(groups.of_id(gid))
        return hit

    on_world = {r for r in collective if all(whole_group_at(groups.gid(k, r), index.at(r)) for k in groups.kinds)}
    p2p_targets = {r: _p2p_peers(r, views[r], groups) for r in p2p}  # empty: no pipeline known, wait on all
    # Who waits on x through a send/recv toward it: inverted once, not searched in x's pipeline per step.
    p2p_waiters: dict[int, list[int]] = {}
    for m, targets in p2p_targets.items():
        for t in targets:
            p2p_waiters.setdefault(t, []).append(m)
    return Waits(states, views, groups, index, frozenset(collective), frozenset(p2p), frozenset(on_world),
                 p2p_targets, p2p_waiters, majority)


def _resolve_backward(views: dict[int, RankView], groups: RankGroups) -> None:
    """Ranks idle in the autograd engine whose DP peers all wait in one collective: in the gradient reduction."""
    if "dp" not in groups.kinds:
        return
    for rank, v in list(views.items()):
        if v.state is not RankState.COMPUTING or v.site != BACKWARD_SITE:
            continue
        peers = [views.get(m) for m in groups.group("dp", rank) if m != rank]
        others = [p for p in peers if p is not None and p.site != BACKWARD_SITE]
        sites = {p.site for p in others if p.state is RankState.COLLECTIVE}
        if others and len(sites) == 1 and all(p.state is RankState.COLLECTIVE for p in others):
            views[rank] = RankView(rank, RankState.COLLECTIVE, frame=v.frame, site=BACKWARD_SITE)
        else:
            views[rank] = RankView(rank, RankState.COMPUTING, frame=v.frame)


def _p2p_peers(rank: int, v: RankView, groups: RankGroups) -> set[int]:
    if v.peers:  # the counters name them
        return set(v.peers)
    if "pp" not in groups.kinds:
        return set()
    stages = groups.group("pp", rank)
    i = stages.index(rank)
    out: set[int] = set()
    if v.direction in ("prev", "both") and i > 0:
        out.add(stages[i - 1])
    if v.direction in ("next", "both") and i + 1 < len(stages):
        out.add(stages[i + 1])
    if not out:  # the words pointed past the pipeline's end: the direction guess was wrong, take both sides
        out = {stages[j] for j in (i - 1, i + 1) if 0 <= j < len(stages)}
    return out



__all__ = ["Waits", "waits_of"]
