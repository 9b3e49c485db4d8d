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

The numbers per rank are numpy arrays, so a 16k-rank job costs the same few
vector operations per kind as a small one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
from rankscope.analyzers.ccl_desync import CounterWaits, counter_waits
from rankscope.analyzers.chain import (
    DESYNC_ADVICE,
    TERMINAL,
    Chain,
    RankState,
    RankView,
    counted_waits,
    desync_evidence,
    desync_summary,
    follow_chain,
    rank_views,
)
from rankscope.analyzers.findings import Finding, Suspect, SuspectKind, Verdict, finding_to_json
from rankscope.analyzers.labels import group_name, summary_of
from rankscope.analyzers.not_a_rank import same_stacks_stall, stack_stall
from rankscope.analyzers.stacks import (
    DEFAULT_OPTIONS,
    MAIN_LANE,
    Grouping,
    PrefixNode,
    SignatureOptions,
    communication_kind,
    diverging_frame,
    group_stacks,
    is_communication,
    tree_from_grouping,
    with_dominant,
)
from rankscope.analyzers.topology import (
    DIMS,
    Topology,
    compact_machines,
    compact_ranks,
    group_ids,
    natural_key,
    topology_for,
)
from rankscope.contract.snapshot import JobSnapshot, Layout, ProcessRole, RankStacks

# Among equally good candidates, the kind ByteRobust evicts first.
_KIND_PREFERENCE: tuple[str, ...] = ("pp", "dp", "tp", "cp", "ep", "machine", "rank")
_MAX_SUSPECTS = 12
_MAX_RANK_CANDIDATES = 256


@dataclass(frozen=True, slots=True)
class StackAnalysis:
    """Everything the stack detector found: the groups, the tree, the verdict, the layout used."""

    grouping: Grouping
    tree: PrefixNode
    verdict: Verdict
    topology: Topology
    chain: Chain | None = None  # every rank's state and who waits for whom (rankscope.analyzers.chain)


@dataclass(slots=True)
class _Candidate:
    kind: str
    ranks: np.ndarray  # sorted int64
    hits: int
    group_index: int | None
    groups: tuple[int, ...]  # group indices of that kind merged into this candidate
    bonus: float = 0.0  # 1.0 when the candidate is where the outliers' origin points (see _Origin)
    why: str = ""
    roots: tuple[int, ...] = ()  # the origin ranks stuck in their own work inside it (Suspect.roots)


@dataclass(frozen=True, slots=True)
class _Origin:
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


class _Placement:
    """Rank -> machine, as an index array for vector work and names for people."""

    def __init__(self, snapshot: JobSnapshot, world: int, ranks_per_machine: int | None) -> None:
        names: list[str] = []
        index: dict[str, int] = {}
        ids = np.full(world, -1, dtype=np.int64)

        def mid_of(name: str) -> int:
            mid = index.get(name)
            if mid is None:
                mid = index[name] = len(names)
                names.append(name)
            return mid

        for machine in snapshot.machines:  # what the agents saw is the truth
            seen = np.fromiter((*(r.rank for r in machine.ranks), *(s.rank for s in machine.stacks)), dtype=np.int64)
            seen = seen[(seen >= 0) & (seen < world)]
            if seen.size:
                ids[seen] = mid_of(machine.machine)
        if ranks_per_machine:  # ranks no agent reported: consecutive blocks
            unplaced = np.flatnonzero(ids < 0)
            for block in np.unique(unplaced // ranks_per_machine).tolist():
                lo, hi = block * ranks_per_machine, (block + 1) * ranks_per_machine
                span = ids[lo:hi]
                span[span < 0] = mid_of(f"machine-{block}")
        self.ids = ids
        self.names = names

    def machines(self, ranks: np.ndarray | Sequence[int]) -> tuple[str, ...]:
        arr = np.asarray(ranks, dtype=np.int64)
        arr = arr[(arr >= 0) & (arr < self.ids.size)]
        mids = np.unique(self.ids[arr])
        return tuple(sorted((self.names[m] for m in mids.tolist() if m >= 0), key=natural_key))


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
    outliers: np.ndarray, seen: np.ndarray, topology: Topology, placement: _Placement,
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
    for mid in np.unique(mids[mids >= 0]).tolist():
        ranks = np.flatnonzero(placement.ids == mid)
        if int(seen[ranks].sum()) >= n_seen:
            continue
        out.append(_Candidate("machine", ranks, int(is_out[ranks].sum()), None, ()))
    for rank in single_rank_groups:
        out.append(_Candidate("rank", np.asarray([rank], dtype=np.int64), 1, None, ()))
    return out


def _score(c: _Candidate, n_outliers: int) -> float:
    return (c.hits / n_outliers) * (c.hits / c.ranks.size) + c.bonus


def _rank_candidates(cands: list[_Candidate], n_outliers: int, placement: _Placement) -> list[_Candidate]:
    def key(c: _Candidate) -> tuple[float, int, int, int]:
        return (-round(_score(c, n_outliers), 9), len(placement.machines(c.ranks)),
                _KIND_PREFERENCE.index(c.kind), int(c.ranks[0]))

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


def _origins(grouping: Grouping) -> list[_Origin]:
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
    out: list[_Origin] = []
    for i in grouping.outliers:
        g = grouping.groups[i]
        extra = [(label, frames) for label, frames in g.lanes[1:]
                 if (label, frames) not in healthy_lanes and frames and not is_communication(frames[-1])]
        if extra:
            label, frames = extra[0]
            out.append(_Origin(g.ranks, "compute", frames[-1], label))
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
            out.append(_Origin(g.ranks, side, entering[-1], MAIN_LANE))
        else:
            out.append(_Origin(g.ranks, "compute", g.frames[-1], MAIN_LANE))
    return out


def _ranks_are(ranks: set[int] | tuple[int, ...]) -> str:
    return f"rank {next(iter(ranks))} is" if len(ranks) == 1 else f"ranks {compact_ranks(ranks)} are"


def _apply_origins(
    cands: list[_Candidate], origins: list[_Origin], grouping: Grouping, topology: Topology,
    placement: _Placement, counted: Mapping[int, str] | None = None,
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
        where = "" if o.lane == MAIN_LANE else f" in its {o.lane}"
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
    c: _Candidate, grouping: Grouping, n_outliers: int, machines: tuple[str, ...], placement: _Placement,
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


def _missing_ranks(
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


def _suspects_for(
    grouping: Grouping, topology: Topology, placement: _Placement, missing: dict[int, str],
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
    origins = _origins(grouping)
    _apply_origins(cands, origins, grouping, topology, placement, counted)
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


def _state_words(chain: Chain, ranks: set[int]) -> str:
    """What a suspect's root ranks are doing, in a few words."""
    views = [chain.views[r] for r in sorted(ranks) if r in chain.views and chain.views[r].state in TERMINAL]
    if not views:
        return ""
    return views[0].short()


def _root_lines(chain: Chain, ranks: set[int], placement: _Placement) -> list[str]:
    lines: list[str] = []
    for root in chain.roots:
        if root.rank not in ranks:
            continue
        waits = sorted({chain.views[v].site or chain.views[v].frame for v in root.victims if v in chain.views})
        where = compact_machines(placement.machines(root.victims))
        line = (f"root: rank {root.rank} is {root.view.describe()}; {len(root.victims)} rank(s) wait on it "
                f"(ranks {compact_ranks(root.victims)} on {where}, at {'; '.join(waits[:3])}"
                f"{'; ...' if len(waits) > 3 else ''}): they are its victims, not suspects of their own")
        if root.view.state in (RankState.UNREADABLE, RankState.STOPPED):
            line += "; absence is evidence: a rank the others wait on whose stack cannot be read is the prime suspect"
        lines.append(line)
    return lines


def _apply_chain(
    suspects: list[Suspect], explains: list[set[int]], chain: Chain, placement: _Placement, topology: Topology,
    grouping: Grouping,
) -> tuple[list[Suspect], list[set[int]], list[Finding]]:
    """Put the chain's verdict into the ranking: roots first with their victims, victims never on their own.

    - a suspect holding a root gets the root's victims and a ``root:`` line;
    - a suspect that holds no root or desync but only ranks waiting on one is dropped (one chain, one suspect);
    - a root no suspect holds (an unreadable rank has no stack group) becomes a suspect of its own;
    - a desync becomes one suspect of kind ``desync`` and a finding, replacing suspects inside its group.
    """
    roots = chain.root_ranks
    victims = {v for r in chain.roots for v in r.victims}
    findings: list[Finding] = []
    out: list[tuple[Suspect, set[int]]] = []
    for d in chain.desyncs:
        ranks = set(d.ranks)
        machines = placement.machines(d.ranks)
        comm = d.communicator or ("the whole job" if d.group_kind == "world" else (
            group_name(d.group_kind, (topology.group_index(d.group[0], d.group_kind),))))
        summary = desync_summary(d)
        evidence = desync_evidence(d)
        findings.append(Finding(kind="desync", ranks=d.ranks, summary=summary, evidence=evidence,
                                communicator=comm, advice=DESYNC_ADVICE))
        out.append((Suspect(
            kind=SuspectKind.DESYNC, ranks=d.ranks, machines=machines,
            score=round(2.0 + len(d.victims) / max(topology.world_size, 1), 6),
            evidence=(f"{summary} (ranks {compact_ranks(d.ranks)} on {compact_machines(machines)}, {comm})",
                      *evidence, f"advice: {DESYNC_ADVICE}"),
            sources=("stacks",), victims=d.victims, state="desync",
            roots=() if d.tie else d.ranks,  # on a tie either side may have strayed
            title=summary,
        ), ranks | set(d.victims)))
    in_desync = {r for d in chain.desyncs for r in (*d.ranks, *d.victims)}
    held: set[int] = set()
    for s, explained in zip(suspects, explains, strict=True):
        members = set(s.ranks)
        if in_desync and members <= in_desync:
            continue  # the desync suspect speaks for these ranks
        mine = members & roots
        if not mine and (roots or in_desync) and (members & set(grouping.outlier_ranks)) <= victims | in_desync:
            continue  # only ranks that wait on a root: evidence under that root
        if mine:
            # Every rank that waits on its roots, its own members included: they are why the group is named.
            own_victims = tuple(sorted({v for r in chain.roots if r.rank in mine for v in r.victims} - mine))
            lines = _root_lines(chain, mine, placement)
            s = replace(s, evidence=(s.evidence[0], *lines, *s.evidence[1:]), victims=own_victims,
                        state=_state_words(chain, mine), roots=tuple(sorted(mine)))
            # The chain says who waits on whom; the layout's "mostly outliers around it" guess is not needed.
            explained = (members & set(grouping.outlier_ranks)) | set(own_victims) | mine
            held |= mine
        out.append((s, explained))
    world = max(topology.world_size, 1)
    for root in chain.roots:
        absent = root.view.state in (RankState.UNREADABLE, RankState.STOPPED)
        alone = any(se[0].ranks == (root.rank,) for se in out)
        if alone or (root.rank in held and not absent):
            continue  # an unreadable root is named alone even inside a group: no stack group holds it
        strong = root.view.process_state in ("D", "T", "t", "Z", "gone") or root.view.state is RankState.STOPPED
        machines = placement.machines([root.rank])
        out.append((Suspect(
            kind=SuspectKind.RANK, ranks=(root.rank,), machines=machines,
            score=round(1.0 + (0.5 if strong else 0.0) + 0.5 * len(root.victims) / world, 6),
            evidence=(f"rank {root.rank} on {compact_machines(machines) or 'unknown machines'}: "
                      f"{root.view.state.value} while {len(root.victims)} rank(s) wait on it",
                      *_root_lines(chain, {root.rank}, placement)),
            sources=("stacks",), victims=root.victims, state=_state_words(chain, {root.rank}), roots=(root.rank,),
        ), {root.rank, *root.victims}))
        held.add(root.rank)
    out.sort(key=lambda se: -se[0].score)
    return [s for s, _ in out], [e for _, e in out], findings


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


def analyze_stacks(
    snapshot: JobSnapshot, layout: Layout | None = None, options: SignatureOptions = DEFAULT_OPTIONS,
    waits: CounterWaits | None = None,
) -> StackAnalysis:
    """Group the snapshot's stacks and rank the parallel groups that explain the outliers.

    ``waits``: ``counter_waits(snapshot.all_counters())``, when the caller has built it already.

    Raises ValueError (with the fix in its message) when the layout does not
    fit the job.
    """
    topology = topology_for(snapshot, layout)
    rpm = (layout.ranks_per_machine if layout is not None else None) or topology.layout.ranks_per_machine
    if rpm is None and snapshot.layout is not None:
        rpm = snapshot.layout.ranks_per_machine
    stacks = snapshot.all_stacks()
    grouping = group_stacks(stacks, options)
    placement = _Placement(snapshot, topology.world_size, rpm)
    missing = _missing_ranks(snapshot, topology, grouping, stacks)
    notes = list(grouping.notes)

    views = rank_views(stacks, topology.world_size, missing, options)
    for o in _origins(grouping):
        # A busy subprocess or thread the healthy ranks lack (a stuck DataLoader worker) makes its rank wait on
        # it whatever its main thread shows: the rank is where a chain can end.
        if o.side == "compute" and o.lane != MAIN_LANE:
            state = RankState.LOADING if o.lane.startswith(str(ProcessRole.DATALOADER)) else RankState.COMPUTING
            for r in o.ranks:
                views[r] = RankView(r, state, frame=f"[{o.lane}] {o.frame}")
    counters = snapshot.all_counters()
    if counters and waits is None:
        waits = counter_waits(counters)
    counted: dict[int, str] = {}
    if waits is not None:
        views = counted_waits(views, waits)  # asynchronous collectives: a host syncing on its GPU waits in one
        counted = {r: ("p2p" if v.state is RankState.P2P else "collective") for r, v in views.items()
                   if v.counted and v.state in (RankState.P2P, RankState.COLLECTIVE)}
    sizes = [len(g.ranks) for g in grouping.groups]
    unique_majority = len(sizes) > 0 and sizes[0] > 1 and (len(sizes) == 1 or sizes[0] > sizes[1])
    majority = frozenset(grouping.groups[0].ranks) if unique_majority else frozenset()
    chain = follow_chain(views, topology, majority, counters, waits)
    named = chain.root_ranks | {r for d in chain.desyncs for r in d.ranks}
    chosen: tuple[list[Suspect], list[set[int]]] | None = None  # the suspects of the grouping a tie settled on

    # When several groups tie for largest, no majority says which is healthy: the chain decides (a group
    # holding a root or a desync is never the healthy one), then the choice whose outliers are best explained
    # by one parallel group.
    if grouping.groups and grouping.dominant:
        top = len(grouping.groups[0].ranks)
        tied = [i for i, g in enumerate(grouping.groups) if len(g.ranks) == top]
        if len(tied) > 1:
            free = [t for t in tied if not named.intersection(grouping.groups[t].ranks)] or tied
            best, best_score = grouping, -1.0
            for t in free:
                trial = with_dominant(grouping, (t,))
                found, found_explains = _suspects_for(trial, topology, placement, missing, counted)
                score = found[0].score if found else 0.0
                if score > best_score + 1e-9:
                    best, best_score, chosen = trial, score, (found, found_explains)
            if named:
                notes = [n for n in notes if not n.startswith(f"{len(tied)} groups of {top} ranks tie")]
                notes.append(f"{len(tied)} groups of {top} ranks tie for largest, so no majority says which is "
                             f"healthy: the chain of waits decides (group {best.dominant[0]} taken as healthy; "
                             f"it holds no root)")
            elif best.dominant != grouping.dominant:
                notes.append(f"group {best.dominant[0]} taken as healthy instead: its complement is explained "
                             "better by one parallel group")
            grouping = best

    suspects, explains = (chosen if chosen is not None
                          else _suspects_for(grouping, topology, placement, missing, counted))
    suspects, explains, findings = _apply_chain(suspects, explains, chain, placement, topology, grouping)
    tree = tree_from_grouping(grouping)
    missing_ranks = tuple(sorted(missing))
    if missing_ranks:
        notes.append(f"{len(missing_ranks)} rank(s) could not be seen: {compact_ranks(missing_ranks)}"
                     + _reason_digest(missing))
    exiting = [r for r, why in missing.items() if why.startswith(("main thread shows no Python frames", "gone"))]
    if len(exiting) * 2 >= max(topology.world_size, 1):
        notes.append(f"{len(exiting)} of {topology.world_size} ranks are exiting or gone: the job looks crashed, "
                     "not hung; the launcher's log names the rank that failed first")
    if topology.assumed and suspects:
        notes.append("no parallel sizes known: only ranks and machines can be suspected; "
                     "pass --tp/--pp/--dp (and --order) to name parallel groups")
    seen_count = sum(len(g.ranks) for g in grouping.groups)
    summary, apart = _summary(grouping, suspects, explains, seen_count, notes, named)
    stall = stack_stall(chain, range(topology.world_size), waits)
    # Counters that cover every rank and hold no open request say the device owes the hosts nothing: ranks alike
    # at a sync point are a running GPU job caught there, not a stall below them (no counters: a pasted dump).
    settled = waits is not None and set(range(topology.world_size)) <= set(waits.live) and not waits.table.open_ops
    if stall is None and not suspects and not named and len(grouping.groups) == 1 and not missing_ranks \
            and seen_count == topology.world_size >= 2 and not settled:
        # Every rank of the job shows the same stacks: that is the finding (the stall is below the ranks).
        same = grouping.groups[0]
        # (the views as read, before the chain: it calls backward compute when no DP peer is seen elsewhere)
        stall = same_stacks_stall(same.frames, same.ranks, [views[r] for r in same.ranks if r in views])
    if stall is not None:
        # Every rank in one call and none behind: the stack groups differ only above that call, so no suspect
        # of theirs is more than a guess.
        if suspects:
            notes.append(f"set aside, every rank waits in the same call: {summary}")
        suspects, summary, apart = [], stall.summary(), []
        findings.append(stall.finding())
    verdict = Verdict(suspects=tuple(suspects), summary=summary, missing_ranks=missing_ranks, notes=tuple(notes),
                      findings=tuple(findings), named=tuple(apart))
    return StackAnalysis(grouping=grouping, tree=tree, verdict=verdict, topology=topology, chain=chain)


def _reason_digest(missing: dict[int, str]) -> str:
    reasons: dict[str, list[int]] = {}
    for rank, why in missing.items():
        reasons.setdefault(why, []).append(rank)
    parts = [f"{why} (ranks {compact_ranks(r)})" for why, r in sorted(reasons.items(), key=lambda kv: min(kv[1]))]
    return " — " + "; ".join(parts[:4]) + ("; ..." if len(parts) > 4 else "")


def _summary(
    grouping: Grouping, suspects: list[Suspect], explains: list[set[int]], seen: int, notes: list[str],
    named: frozenset[int] | set[int] = frozenset(),
) -> tuple[str, list[Suspect]]:
    """The stack verdict's headline, and the suspects it names apart when it names several (``Verdict.named``)."""
    if named and suspects:
        # The chain named where the hang starts: account for its roots and the outliers, victims included.
        cover = _independent_cover(suspects, explains, set(grouping.outlier_ranks) | set(named))
    elif seen == 0:
        return "no verdict: no rank's stacks could be read", []
    elif len(grouping.groups) == 1:
        return f"no verdict: all {seen} ranks show the same stacks", []
    elif not grouping.dominant:
        return f"no verdict: no two of the {seen} ranks show the same stacks", []
    elif not suspects:
        return "no verdict: the outliers fit no group smaller than the whole job", []
    else:
        cover = _independent_cover(suspects, explains, set(grouping.outlier_ranks))
    if len(cover) > 1:
        notes.append(f"{len(cover)} separate outlier sets, each explained by its own suspect")
        return summary_of(cover), cover
    return summary_of(suspects[:1]), []


def suspect_to_json(s: Suspect) -> dict[str, object]:
    return {
        "kind": str(s.kind),
        "ranks": list(s.ranks),
        "machines": list(s.machines),
        "score": s.score,
        "evidence": list(s.evidence),
        "sources": list(s.sources),
        "group_index": s.group_index,
        "groups": list(s.groups),
        "diverging_frame": s.diverging_frame,
        "victims": list(s.victims),
        "state": s.state,
        "roots": list(s.roots),
    }


def verdict_to_json(analysis: StackAnalysis) -> dict[str, object]:
    """The ``rankscope analyze --json`` shape: groups, dominant, outliers, suspects (most likely first)."""
    g = analysis.grouping
    topo = analysis.topology
    groups = []
    for i, group in enumerate(g.groups):
        groups.append({
            "index": i,
            "size": len(group.ranks),
            "ranks": list(group.ranks),
            "summary": group.summary,
            "healthy": i in g.dominant,
            "diverging_frame": None if i in g.dominant else diverging_frame(g, group),
            "frames": list(group.frames),
            "lanes": [{"label": label, "frames": list(frames)} for label, frames in group.lanes],
        })
    v = analysis.verdict
    return {
        "summary": v.summary,
        "world_size": topo.world_size,
        "layout": {**{d: topo.size(d) for d in DIMS}, "order": "-".join(topo.order),
                   "ranks_per_machine": topo.layout.ranks_per_machine,
                   "from_communicators": [k for k, _ in topo.explicit], "assumed": topo.assumed},
        "groups": groups,
        "dominant": list(g.dominant),
        "outliers": list(g.outliers),
        "suspects": [suspect_to_json(s) for s in v.suspects],
        "findings": [finding_to_json(f) for f in v.findings],
        "chain": chain_to_json(analysis.chain) if analysis.chain is not None else None,
        "missing_ranks": list(v.missing_ranks),
        "notes": list(v.notes),
    }


def chain_to_json(chain: Chain) -> dict[str, object]:
    """The roots the waiting ranks lead to (with their victims) and the waiters no root explains."""
    return {
        "roots": [{"rank": r.rank, "state": r.view.state.value, "detail": r.view.describe(),
                   "process_state": r.view.process_state, "wchan": r.view.wchan, "victims": list(r.victims)}
                  for r in chain.roots],
        "desyncs": [{"group_kind": d.group_kind, "ranks": list(d.ranks), "victims": list(d.victims),
                     "sites": [{"site": site, "ranks": list(ranks)} for site, ranks in d.sites], "tie": d.tie}
                    for d in chain.desyncs],
        "unexplained": list(chain.unexplained),
    }


__all__ = ["StackAnalysis", "analyze_stacks", "chain_to_json", "suspect_to_json", "verdict_to_json"]
