"""From outlier stacks to the parallel group and machines to evict (ByteRobust §5.1, step 3).

The outlier ranks of a hang rarely form one layout group by chance: when a
pipeline stage stalls, its whole pipeline waits in send/recv; when a rank
never joins a gradient all-reduce, its data-parallel peers wait in it. So
every group of every kind is scored by how well it *explains* the outliers:

    score = coverage * purity
    coverage = outlier ranks inside the candidate / all outlier ranks
    purity   = outlier ranks inside the candidate / ranks of the candidate

A candidate is the union of the groups of one kind that hold outliers and
share machines: with TP=2 on two-GPU machines, Fig. 7's stalled pipeline is
two PP groups (tp=0 and tp=1) on the same four machines, and machines are what
gets evicted. Single outlier ranks and machines are candidates too, so a lone
stuck rank is named as such rather than blamed on its whole pipeline.

Where the hang started lifts a candidate by 1.0 (so scores above 1 mean
"named by the origin", below 1 "fits the layout only"). Outliers waiting in
send/recv or a collective are consequences; an outlier stuck anywhere else
is an origin, and following Aegis's split:

- computation side: stuck in its own work (or a busy dataloader/checkpoint
  subprocess the healthy ranks lack) -> the rank itself;
- communication side: stuck on its way *into* a send/recv or collective ->
  the group it was calling: PP for point-to-point, else the kind whose other
  members all wait in a collective.

Fig. 7 has no origin (every outlier waits), so the layout score decides.

This module scores and ranks; the stage that uses it (``stage_suspects``)
settles the verdict, and ``labels`` words its headline.

The numbers per rank are numpy arrays, so a 16k-rank job costs the same few
vector operations per kind as a small one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from rankscope.analyzers.findings import Suspect, SuspectKind, kind_order
from rankscope.analyzers.labels import group_name
from rankscope.analyzers.origins import Origin, origins_of
from rankscope.analyzers.placement import Placement
from rankscope.analyzers.stacks import (
    Grouping,
    diverging_frame,
)
from rankscope.analyzers.topology import Topology, group_ids
from rankscope.contract.frames import communication_kind
from rankscope.contract.ranks import compact_machines, compact_ranks

_MAX_SUSPECTS = 12
_MAX_RANK_CANDIDATES = 256


@dataclass(slots=True)
class _Candidate:
    kind: str
    ranks: np.ndarray  # sorted int64
    hits: int
    group_index: int | None
    groups: tuple[int, ...]  # group indices of that kind merged into this candidate
    bonus: float = 0.0  # 1.0 when the candidate is where the outliers' origin points (see Origin)
    why: str = ""
    roots: tuple[int, ...] = ()  # the origin ranks stuck in their own work inside it (Suspect.roots)


def _merge_by_machine(touched: list[np.ndarray], machine_ids: np.ndarray) -> list[list[int]]:
    """Connected components of groups that share a machine (indices into ``touched``)."""
    parent = list(range(len(touched)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[int, int] = {}
    for i, members in enumerate(touched):
        for mid in np.unique(machine_ids[members]).tolist():
            if mid < 0:
                continue
            j = owner.setdefault(mid, i)
            a, b = find(i), find(j)
            if a != b:
                parent[max(a, b)] = min(a, b)
    comps: dict[int, list[int]] = {}
    for i in range(len(touched)):
        comps.setdefault(find(i), []).append(i)
    return list(comps.values())


def _candidates(
    outliers: np.ndarray, seen: np.ndarray, topology: Topology, placement: Placement,
    single_rank_groups: Sequence[int],
) -> list[_Candidate]:
    """Every group (merged by shared machines), machine and lone rank that holds outliers."""
    world = topology.world_size
    is_out = np.zeros(world, dtype=bool)
    is_out[outliers] = True
    n_seen = int(seen.sum())
    out: list[_Candidate] = []
    for kind in topology.kinds():
        gid = group_ids(topology, kind)
        valid = gid >= 0
        n_groups = int(gid.max()) + 1 if valid.any() else 0
        hits = np.bincount(gid[valid & is_out], minlength=n_groups)
        touched_idx = np.flatnonzero(hits)
        if touched_idx.size == 0:
            continue
        order = np.argsort(gid, kind="stable")
        counts = np.bincount(gid[valid], minlength=n_groups)
        starts = np.r_[0, np.cumsum(counts)] + int((~valid).sum())
        touched = [np.sort(order[starts[g]:starts[g] + counts[g]]) for g in touched_idx.tolist()]
        for comp in _merge_by_machine(touched, placement.ids):
            ranks = np.unique(np.concatenate([touched[i] for i in comp]))
            if int(seen[ranks].sum()) >= n_seen:
                continue  # the whole job: says nothing
            groups = tuple(int(touched_idx[i]) for i in comp)
            out.append(_Candidate(kind, ranks, int(is_out[ranks].sum()), min(groups), groups))
    # machines holding outliers
    mids = placement.ids[outliers]
    for _, ranks in placement.ranks_of(np.unique(mids[mids >= 0])):
        if int(seen[ranks].sum()) >= n_seen:
            continue
        out.append(_Candidate("machine", ranks, int(is_out[ranks].sum()), None, ()))
    for rank in single_rank_groups:
        out.append(_Candidate("rank", np.asarray([rank], dtype=np.int64), 1, None, ()))
    return out


def _score(c: _Candidate, n_outliers: int) -> float:
    return (c.hits / n_outliers) * (c.hits / c.ranks.size) + c.bonus


def _rank_candidates(cands: list[_Candidate], n_outliers: int, placement: Placement) -> list[_Candidate]:
    def key(c: _Candidate) -> tuple[float, int, int, int]:
        return (-round(_score(c, n_outliers), 9), placement.machine_count(c.ranks),
                kind_order(c.kind), int(c.ranks[0]))

    ordered = sorted(cands, key=key)
    unique: list[_Candidate] = []
    seen_sets: set[bytes] = set()
    for c in ordered:
        k = c.ranks.tobytes()
        if k in seen_sets:
            continue  # same ranks under another name: keep the preferred kind
        seen_sets.add(k)
        unique.append(c)
    return unique


def _kind_label(c: _Candidate) -> str:
    if c.kind == "rank":
        return f"rank {int(c.ranks[0])}"
    if c.kind == "machine":
        return "machine"
    return group_name(c.kind, c.groups)


def describe(c: _Candidate, machines: tuple[str, ...]) -> str:
    where = compact_machines(machines) or "unknown machines"
    if c.kind == "machine":
        return f"machine {where}"
    return f"{_kind_label(c)} on {where}"


def _ranks_are(ranks: set[int] | tuple[int, ...]) -> str:
    return f"rank {next(iter(ranks))} is" if len(ranks) == 1 else f"ranks {compact_ranks(ranks)} are"


def _applyorigins_of(
    cands: list[_Candidate], origins: list[Origin], grouping: Grouping, topology: Topology,
    placement: Placement, counted: Mapping[int, str] | None = None,
) -> None:
    """Lift the candidates the origins point at above those that only fit the layout.

    ``counted``: rank -> "p2p" / "collective" for ranks the counters show waiting where their stacks cannot
    (an asynchronous NCCL call: the host syncs elsewhere, often among the healthy majority).
    """
    waiting: dict[int, str] = dict(counted or {})
    for i in grouping.outliers:
        g = grouping.groups[i]
        kind = communication_kind(g.frames[-1]) if g.frames else None
        if kind is not None:
            waiting.update(dict.fromkeys(g.ranks, kind))
    for o in origins:
        ranks = set(o.ranks)
        where = "" if o.lane.is_main else f" in its {o.lane.label}"
        if o.side == "compute":
            own = "its" if len(ranks) == 1 else "their"
            why = (f"origin: {_ranks_are(ranks)} stuck in {own} own work{where} ({o.frame}), not waiting "
                   "for other ranks: a computation-side fault, the rank itself is suspect")
            machines = {int(placement.ids[r]) for r in ranks if r < placement.ids.size}
            for c in cands:
                members = set(c.ranks.tolist())
                if (c.kind == "rank" and members <= ranks) or (
                        c.kind == "machine" and members == ranks and len(machines) == 1):
                    c.bonus, c.why, c.roots = 1.0, why, tuple(sorted(members))
            continue
        kinds = ["pp"] if o.side == "p2p" else [k for k in topology.kinds() if k != "pp"]
        fitting: list[str] = []
        for kind in kinds:
            if kind not in topology.kinds():
                continue
            peers = {p for r in o.ranks for p in topology.group_of(r, kind)} - ranks
            if peers and all(waiting.get(p) == o.side for p in peers):
                fitting.append(kind)
        lift = 1.0 if fitting else 0.5
        is_out = set(grouping.outlier_ranks)
        for kind in fitting:
            # Merging groups by shared machines can swallow the origin's own group into the whole job (a PP group
            # across two machines whose other PP group holds an outlier too): the group its peers wait in is
            # still a candidate of its own.
            if not any(c.kind == kind and ranks & set(c.ranks.tolist()) for c in cands):
                group = sorted({p for r in ranks for p in topology.group_of(r, kind)})
                index = topology.group_index(group[0], kind)
                cands.append(_Candidate(kind, np.asarray(group, dtype=np.int64), len(is_out.intersection(group)),
                                        index, (index,)))
        for c in cands:
            if c.kind in (fitting or kinds) and ranks & set(c.ranks.tolist()):
                peers_say = "the peers in this group wait for it" if fitting else "this is the group it was calling"
                c.bonus = max(c.bonus, lift)
                c.why = (f"origin: {_ranks_are(ranks)} stuck on the way into a {o.side} call "
                         f"({o.frame}) and {peers_say}: a communication-side fault, the group is suspect")


def _evidence(
    c: _Candidate, grouping: Grouping, n_outliers: int, machines: tuple[str, ...], placement: Placement,
    missing: dict[int, str],
) -> tuple[tuple[str, ...], str | None]:
    members = set(c.ranks.tolist())
    lines = [
        f"{describe(c, machines)}: holds {c.hits} of the {n_outliers} outlier ranks; "
        f"{c.hits} of its {c.ranks.size} ranks are outliers (ranks {compact_ranks(members)})"
    ]
    first_div: str | None = None
    for i in grouping.outliers:
        g = grouping.groups[i]
        inside = members.intersection(g.ranks)
        if not inside:
            continue
        div = diverging_frame(grouping, g)
        if first_div is None:
            first_div = div
        where = compact_machines(placement.machines(sorted(inside)))
        line = f"{'rank' if len(inside) == 1 else 'ranks'} {compact_ranks(inside)} ({where}): {g.summary}"
        if div:
            line += f"; leaves the healthy path at {div}"
        lines.append(line)
    if grouping.dominant:
        healthy = grouping.groups[grouping.dominant[0]]
        lines.append(f"healthy majority: {len(healthy.ranks)} ranks at {healthy.summary}")
    if c.why:
        lines.insert(1, c.why)
    gone = sorted(r for r in members if r in missing)
    if gone:
        lines.append(f"ranks {compact_ranks(gone)} of this group could not be seen: "
                     + "; ".join(sorted({missing[r] for r in gone})))
    return tuple(lines), first_div


def suspects_for(
    grouping: Grouping, topology: Topology, placement: Placement, missing: dict[int, str],
    counted: Mapping[int, str] | None = None,
) -> tuple[list[Suspect], list[set[int]]]:
    """Suspects best first, and for each the outlier ranks it accounts for."""
    outlier_ranks = np.asarray(grouping.outlier_ranks, dtype=np.int64)
    outlier_ranks = outlier_ranks[outlier_ranks < topology.world_size]
    if outlier_ranks.size == 0:
        return [], []
    seen = np.zeros(topology.world_size, dtype=bool)
    for g in grouping.groups:
        idx = np.asarray(g.ranks, dtype=np.int64)
        seen[idx[idx < topology.world_size]] = True
    # Lone ranks are candidates too: every outlier of a small set, else those alone in their group.
    if outlier_ranks.size <= _MAX_RANK_CANDIDATES:
        singles = outlier_ranks.tolist()
    else:
        singles = [grouping.groups[i].ranks[0] for i in grouping.outliers if len(grouping.groups[i].ranks) == 1]
    n = int(outlier_ranks.size)
    cands = _candidates(outlier_ranks, seen, topology, placement, singles)
    origins = origins_of(grouping)
    _applyorigins_of(cands, origins, grouping, topology, placement, counted)
    ranked = _rank_candidates(cands, n, placement)
    is_out = set(outlier_ranks.tolist())
    origin_ranks = {r for o in origins for r in o.ranks}
    # Groups around an origin that are mostly outliers: the ranks waiting on it.
    sick = [set(c.ranks.tolist()) & is_out for c in cands if 2 * c.hits >= c.ranks.size]
    suspects: list[Suspect] = []
    explains: list[set[int]] = []
    for c in ranked[:_MAX_SUSPECTS]:
        members = set(c.ranks.tolist())
        explained = members & is_out
        if c.bonus:
            starts = members & origin_ranks
            for group in sick:
                if group & starts:
                    explained |= group
        explains.append(explained)
        machines = placement.machines(c.ranks)
        evidence, div = _evidence(c, grouping, n, machines, placement, missing)
        suspects.append(Suspect(
            kind=SuspectKind(c.kind),
            ranks=tuple(c.ranks.tolist()),
            machines=machines,
            score=round(_score(c, n), 6),
            evidence=evidence,
            sources=("stacks",),
            group_index=c.group_index,
            groups=c.groups if len(c.groups) > 1 else (),
            diverging_frame=div,
            roots=c.roots,
            title=describe(c, machines),
        ))
    return suspects, explains


def _independent_cover(suspects: list[Suspect], explains: list[set[int]], outliers: set[int]) -> list[Suspect]:
    """Suspects that together account for all outliers without overlapping, best first (greedy).

    A suspect accounts for its own outlier ranks; one that names where a hang
    started also accounts for the mostly-outlier groups around it (the ranks
    waiting on it).
    """
    cover: list[Suspect] = []
    left = set(outliers)
    taken: set[int] = set()
    for s, explained in zip(suspects, explains, strict=True):
        if not left:
            break
        ranks = set(s.ranks)
        if ranks & taken or not explained & left:
            continue
        cover.append(s)
        taken |= ranks
        left -= explained
    return cover


def named_apart(grouping: Grouping, suspects: list[Suspect], explains: list[set[int]],
                named: frozenset[int] | set[int] = frozenset()) -> list[Suspect]:
    """The suspects a verdict names apart (``Verdict.named``): those that together account for the outlier ranks
    (and the chain's roots and desyncs, ``named``) without overlapping, when it takes more than one; else none."""
    if not suspects:
        return []
    cover = _independent_cover(suspects, explains, set(grouping.outlier_ranks) | set(named))
    return cover if len(cover) > 1 else []


__all__ = [
    "describe",
    "named_apart",
    "suspects_for",
]
