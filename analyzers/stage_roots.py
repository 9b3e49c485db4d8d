"""Stage 4 of the pass (docs/analysis-pass.md): the ranks a hang's waiters lead back to.

Takes ``stage_waits.Waits``; passes on ``Roots``: the ``Chain`` (roots with
their victims, desyncs, waiters explained by neither). Following the waits
backwards from every rank that waits for nobody (computing, loading,
stopped, unreadable) gives the roots and their victims; ranks of one group
at different collective sites that no root explains, where no smaller group
is complete at any site, form a desync; a crossed wait the counters show
(``ccl_desync.crossed_waits``) that no root explains is one too.

Searched backwards from the ranks that wait for nobody, except the
majority's: most of a job doing the same work is the job running, not where
it stopped. A group's ranks are bucketed by call site once, so one step from
a rank visits each (group, call site) pair once: the cost grows with the
job, not its square.

Pure: stdlib, numpy and the snapshot contract; no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rankscope.analyzers.ccl_desync import CounterWaits, crossed_waits, waiting_together
from rankscope.analyzers.chain import (
    BACKWARD_SITE,
    TERMINAL,
    WORLD_ID,
    Chain,
    Desync,
    GroupId,
    RankGroups,
    RankState,
    RankView,
    Root,
    SiteKey,
)
from rankscope.analyzers.stage_waits import Waits
from rankscope.contract.snapshot import RankCounters

_MAX_PER_ROOT_SEARCH = 32  # roots searched one by one; beyond this, one search for all


@dataclass(frozen=True, slots=True)
class Roots:
    """The chain the waits lead to, beside the waits it was followed on."""

    waits: Waits
    chain: Chain


def roots_of(w: Waits) -> Roots:
    """Roots (ranks others wait on, with their victims), desyncs, and waiters explained by neither."""
    evidence = w.states.evidence
    counters, waits = evidence.counters, evidence.waits
    views, groups, index, majority = w.views, w.groups, w.index, w.majority
    collective, p2p, on_world = w.collective, w.p2p, w.on_world
    p2p_targets, p2p_waiters = w.p2p_targets, w.p2p_waiters
    p2p_on_world = {r for r, t in p2p_targets.items() if not t}
    # Per (group, call site) where ranks wait: the members that wait on the group's other ranks, and those that
    # wait on the whole job (reached through the world scope); computed once per pair, however many ranks ask.
    waiting_by_group: dict[GroupId, list[tuple[SiteKey, list[int]]]] = {}

    def waiting_sites(gid: GroupId) -> list[tuple[SiteKey, list[int]]]:
        got = waiting_by_group.get(gid)
        if got is None:
            whole = gid == WORLD_ID
            got = waiting_by_group[gid] = []
            for key, members in index.sites(gid).items():
                if key[0] is RankState.COLLECTIVE:
                    got.append((key, [m for m in members if (m in on_world) == whole]))
                elif key[0] is RankState.P2P:
                    got.append((key, [m for m in members if m in p2p_on_world] if whole else []))
        return got

    scopes: dict[int, tuple[GroupId, ...]] = {}  # rank -> its groups' ids and the world's

    def waiters_of(x: int, done: set[tuple[GroupId, SiteKey]]) -> list[int]:
        """The ranks that wait on ``x``."""
        mine = index.at(x)
        out: list[int] = []
        mine_scopes = scopes.get(x)
        if mine_scopes is None:
            mine_scopes = scopes[x] = (*(groups.gid(k, x) for k in groups.kinds), WORLD_ID)
        for gid in mine_scopes:
            for key, members in waiting_sites(gid):
                if key == mine or (gid, key) in done:
                    continue
                done.add((gid, key))
                out.extend(members)
        out.extend(p2p_waiters.get(x, ()))
        return out

    def victims_from(starts: Sequence[int]) -> set[int]:
        seen: set[int] = set()
        done: set[tuple[GroupId, SiteKey]] = set()
        todo = list(starts)
        while todo:
            for w in waiters_of(todo.pop(), done):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen - set(starts)

    terminals = [r for r, v in sorted(views.items()) if v.state in TERMINAL and r not in majority]
    roots: list[Root] = []
    if len(terminals) <= _MAX_PER_ROOT_SEARCH:
        roots = [Root(t, views[t], tuple(sorted(victims_from([t]) - set(terminals)))) for t in terminals]
    else:
        shared = tuple(sorted(victims_from(terminals)))
        roots = [Root(t, views[t], shared) for t in terminals]
    roots = [r for r in roots if r.victims]
    roots.sort(key=lambda r: (-len(r.victims), r.rank))
    explained = {v for r in roots for v in r.victims}
    lost = {r for r in collective | p2p if r not in explained}
    crossed = _crossed(views, groups, counters, waits, p2p_targets, explained, victims_from) if counters else []
    in_crossed = {r for d in crossed for r in (*d.ranks, *d.victims)}
    # Communicators whose members all wait in one collective together (by the counters): a site of theirs is a
    # call on that communicator, never a mismatch on a group it splits.
    together = [frozenset(t.comm.ranks) for t in waiting_together(waits.table, waits.live)] if waits else []
    desyncs = crossed + _merge_across_kinds(_merge_alike(_desyncs(views, groups, lost - in_crossed, together)), views,
                                            groups)
    in_desync = {r for d in desyncs for r in (*d.ranks, *d.victims)}
    unexplained = tuple(sorted(r for r in lost if r not in in_desync))
    return Roots(w, Chain(views=views, roots=tuple(roots), desyncs=tuple(desyncs), unexplained=unexplained))


def _crossed(views: Mapping[int, RankView], groups: RankGroups, counters: Mapping[int, RankCounters],
             waits: CounterWaits | None, p2p_targets: Mapping[int, set[int]], explained: set[int],
             victims_from: Callable[[Sequence[int]], set[int]]) -> list[Desync]:
    """The counters' crossed waits that no root explains, as desyncs with the chain's victims under them."""
    extra: dict[int, dict[int, str]] = {}
    for r, peers in p2p_targets.items():
        for p in peers:
            pv = views.get(p)
            if pv is not None and pv.state is not RankState.P2P:
                extra.setdefault(r, {})[p] = (f"rank {r} is in {views[r].site} toward rank {p}, which is not in a "
                                              f"send/recv ({pv.describe()})")
    out: list[Desync] = []
    for c in crossed_waits(counters, extra, waits):
        named = set(c.ranks)
        if named & explained or any(views[r].state in TERMINAL for r in named if r in views):
            continue  # a root explains these ranks, or the stacks show them in their own work: not a desync
        victims = {v for v in (set(c.victims) | victims_from(c.ranks)) - named
                   if v not in views or views[v].state not in TERMINAL}
        sides = []
        for side in (tuple(sorted(victims)), c.ranks):
            by_site: dict[str, list[int]] = {}
            for r in side:
                v = views.get(r)
                by_site.setdefault(v.site if v is not None and v.site else "(no stack)", []).append(r)
            sides += sorted(by_site.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
        members = set(c.members)
        kind = next((k for k in groups.kinds if set(groups.group(k, c.members[0])) == members),
                    "world" if members >= set(groups.world) else "comm")
        out.append(Desync(group_kind=kind, group=c.members, ranks=c.ranks, victims=tuple(sorted(victims)),
                          sites=tuple((site, tuple(rs)) for site, rs in sides), tie=c.tie,
                          communicator=c.communicator, evidence=c.evidence))
    return out



def _desyncs(views: Mapping[int, RankView], groups: RankGroups, lost: set[int],
             together: Sequence[frozenset[int]] = ()) -> list[Desync]:
    """Groups whose members all wait in collectives at two or more call sites, that no root explains."""
    out: list[Desync] = []
    seen: set[tuple[int, ...]] = set()
    candidates: list[tuple[str, tuple[int, ...]]] = []
    for kind in groups.kinds:
        for gid in {groups.gid(kind, r) for r in lost}:
            candidates.append((kind, groups.of_id(gid)))
    if not groups.kinds or not candidates:
        candidates.append(("world", groups.world))
    candidates.sort(key=lambda kg: (len(kg[1]), kg[1]))  # the smallest group that shows it
    taken: set[int] = set()
    job_wide: dict[str, int] = {}  # call site -> how many unexplained ranks of the whole job are there
    for r in lost:
        v = views.get(r)
        if v is not None:
            job_wide[v.site] = job_wide.get(v.site, 0) + 1
    for kind, group in candidates:
        if group in seen or taken & set(group) or len(group) < 2:
            continue
        seen.add(group)
        members = [views.get(m) for m in group]
        if any(m is None or m.state is not RankState.COLLECTIVE or m.rank not in lost for m in members):
            continue
        by_site: dict[str, list[int]] = {}
        for m in members:
            assert m is not None
            by_site.setdefault(m.site, []).append(m.rank)
        if len(by_site) < 2:
            continue
        # A site whose ranks complete a smaller group is a call on that group, not a mismatch on this one.
        if all(_complete_elsewhere(views, groups, kind, ranks, site) for site, ranks in by_site.items()):
            continue
        # Ranks held in a symmetric stall of another communicator (by the counters) are not off this group's
        # path: they are blocked in that call, which is the finding (rankscope.analyzers.not_a_rank).
        if any(set(ranks) <= t and all((v := views.get(m)) is not None and v.site == site for m in t)
               for site, ranks in by_site.items() for t in together):
            continue
        # On a tie within a small group, the call site most unexplained ranks of the whole job share is
        # the majority's (two-rank groups split 1-1; the job as a whole says which side strayed).
        sites = sorted(by_site.items(), key=lambda kv: (-len(kv[1]), -job_wide.get(kv[0], 0),
                                                        kv[0] == BACKWARD_SITE, min(kv[1])))
        tie = len(sites[1][1]) == len(sites[0][1])
        odd = sorted(r for _, ranks in sites[1:] for r in ranks)
        out.append(Desync(group_kind="world" if group == groups.world else kind, group=group, ranks=tuple(odd),
                          victims=tuple(sorted(sites[0][1])),
                          sites=tuple((s, tuple(sorted(r))) for s, r in sites), tie=tie))
        taken.update(group)
    return out


def _merge_alike(desyncs: list[Desync]) -> list[Desync]:
    """Desyncs of groups of one kind with the same call sites are one mismatch, told once.

    Two ranks of a tensor-parallel pair a step ahead split each of their two data-parallel pairs:
    that is one group of ranks off the majority's path, not two separate suspects.
    """
    merged: dict[tuple[str, tuple[str, ...]], list[Desync]] = {}
    for d in desyncs:
        merged.setdefault((d.group_kind, tuple(site for site, _ in d.sites)), []).append(d)
    out: list[Desync] = []
    for (kind, names), alike in merged.items():
        if len(alike) == 1:
            out.append(alike[0])
            continue
        sites = tuple((name, tuple(sorted({r for d in alike for r in dict(d.sites)[name]}))) for name in names)
        out.append(Desync(group_kind=kind, group=tuple(sorted({r for d in alike for r in d.group})),
                          ranks=tuple(sorted({r for d in alike for r in d.ranks})),
                          victims=tuple(sorted({r for d in alike for r in d.victims})),
                          sites=sites, tie=any(d.tie for d in alike)))
    return out


def _merge_across_kinds(desyncs: list[Desync], views: Mapping[int, RankView], groups: RankGroups) -> list[Desync]:
    """Desyncs of groups of different kinds whose odd ones out stray to one call, from one majority call of the
    whole job, are one mismatch of the job.

    Two ranks of different pipeline stages and TP groups, each a step ahead in the same TP all-reduce while
    everyone else waits in the epoch-end barrier, split a TP group and a PP group: one extra step on two ranks,
    named together (issue 29), not two suspects of which the first would be taken.
    """
    world = groups.world
    if not desyncs:
        return desyncs
    by_sites: dict[tuple[str, ...], list[Desync]] = {}
    for d in desyncs:
        by_sites.setdefault(tuple(site for site, _ in d.sites), []).append(d)
    out: list[Desync] = []
    for names, alike in by_sites.items():
        majority = names[0]
        at_majority = tuple(sorted(r for r in world if (v := views.get(r)) is not None and v.site == majority))
        odd = tuple(sorted({r for d in alike for r in d.ranks}))
        # Several groups (of one kind or more) stray the same way, and with the majority's call they make the job.
        several = len(alike) > 1 or any(d.group_kind in groups.kinds and len(d.group) > len(groups.group(
            d.group_kind, d.group[0])) for d in alike)
        if not several or set(at_majority) | set(odd) != set(world) or len(world) < 3:
            out.extend(alike)
            continue
        sites = ((majority, at_majority),
                 *((name, tuple(sorted({r for d in alike for r in dict(d.sites).get(name, ())}))) for name in names[1:]))
        out.append(Desync(group_kind="world", group=tuple(sorted(world)), ranks=odd, victims=at_majority,
                          sites=sites, tie=False))
    return out


def _complete_elsewhere(views: Mapping[int, RankView], groups: RankGroups, kind: str, ranks: list[int],
                        site: str) -> bool:
    if site == BACKWARD_SITE:
        return False  # the gradient reduction is on the data-parallel group
    for other in groups.kinds:
        if other == kind:
            continue
        g = groups.group(other, ranks[0])
        if len(g) < len(groups.group(kind, ranks[0])) and all(
                (v := views.get(m)) is not None and v.state is RankState.COLLECTIVE and v.site == site for m in g):
            return True
    return False



__all__ = ["Roots", "roots_of"]
