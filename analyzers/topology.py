"""Where each rank sits in the parallel layout, and which ranks share a group.

A rank's coordinates (tp, cp, ep, dp, pp) come from the parallel sizes and an
order string that says which dimension varies fastest: Megatron's default
``tp-cp-ep-dp-pp`` gives ``rank = tp + TP*(cp + CP*(ep + EP*(dp + DP*pp)))``.
A group of kind K is every rank that agrees on all coordinates except K.

Sizes typed by a person can be wrong; the communicators the CCL plugin
recorded cannot. So when a snapshot carries real membership for a kind, that
membership is used for the kind and the typed sizes only fill the rest.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np
from rankscope.contract.ranks import compact_ranks
from rankscope.contract.snapshot import (
    DEFAULT_ORDER,
    DIM_WORDS,
    DIMS,
    SIZES_FIX,
    Communicator,
    JobSnapshot,
    Layout,
    OpCounters,
    RankCounters,
    order_names,
)
from rankscope.contract.vocabulary import canonical_op, is_unnamed_group


@functools.lru_cache(maxsize=64)
def parse_order(order: str) -> tuple[str, ...]:
    """Split an order string into all five dimensions, fastest varying first.

    Short forms such as ``tp-pp-dp`` are completed with the missing
    dimensions at the end: they have size 1 wherever a short form is used, so
    their place does not change any rank's coordinates.
    """
    text = order.strip().lower()
    if not text:
        raise ValueError(f"empty rank order; use e.g. {DEFAULT_ORDER!r} (Megatron's default) or 'tp-pp-dp'")
    parts = order_names(text)
    unknown = [p for p in parts if p not in DIMS]
    if unknown:
        raise ValueError(
            f"unknown dimension(s) {', '.join(unknown)} in rank order {order!r}; "
            f"use names from {', '.join(DIMS)} joined by '-', e.g. {DEFAULT_ORDER!r}"
        )
    dupes = sorted({p for p in parts if parts.count(p) > 1})
    if dupes:
        raise ValueError(
            f"dimension(s) {', '.join(dupes)} appear twice in rank order {order!r}; name each once, e.g. 'tp-pp-dp'"
        )
    return parts + tuple(d for d in DIMS if d not in parts)


def layout_sizes(layout: Layout) -> dict[str, int]:
    return {d: getattr(layout, d) for d in DIMS}


def validate_layout(layout: Layout) -> tuple[str, ...]:
    """Check sizes and order; returns the parsed order. Errors carry the fix."""
    problems = layout.size_problems()
    if problems:
        raise ValueError(f"{problems}; {SIZES_FIX}")
    return parse_order(layout.order)


# Communicator descriptions (Megatron's names and short ones a launcher may use)
# mapped to the layout dimension they stand for.
_MEGATRON_GROUPS: dict[str, str] = {
    "TENSOR_MODEL_PARALLEL_GROUP": "tp",
    "PIPELINE_MODEL_PARALLEL_GROUP": "pp",
    "DATA_PARALLEL_GROUP": "dp",
    "CONTEXT_PARALLEL_GROUP": "cp",
    "EXPERT_MODEL_PARALLEL_GROUP": "ep",
}


@functools.lru_cache(maxsize=1024)  # a job has a handful of distinct descriptions, on thousands of communicators
def kind_of_description(description: str) -> str | None:
    """The layout dimension a communicator stands for, or None if it is another group.

    Megatron's exact names win; otherwise the first word decides (``pp``,
    ``tp_group``, ``pipeline-3``...). Composite groups such as Megatron's
    ``DATA_PARALLEL_GROUP_WITH_CP`` or ``TENSOR_AND_DATA_PARALLEL_GROUP`` are
    not one dimension and are skipped.
    """
    upper = description.strip().upper()
    if upper in _MEGATRON_GROUPS:
        return _MEGATRON_GROUPS[upper]
    words = [w for w in re.split(r"[^a-z0-9]+", description.lower()) if w]
    if not words or "with" in words or "and" in words:
        return None
    first = re.sub(r"\d+$", "", words[0])
    if first in DIMS:
        return first
    return next((kind for kind, word in DIM_WORDS.items() if first == word), None)


@dataclass(frozen=True, slots=True)
class Topology:
    """Coordinates and group membership of every rank of one job.

    ``explicit`` holds, per kind, groups recorded by the CCL plugin; for
    those kinds they replace what the sizes would say.
    """

    layout: Layout
    world_size: int
    explicit: tuple[tuple[str, tuple[tuple[int, ...], ...]], ...] = ()
    assumed: bool = False  # True when no sizes were known and every rank is put in one DP group

    @property
    def order(self) -> tuple[str, ...]:
        """All five dimensions, fastest varying first, from the layout's order string."""
        return parse_order(self.layout.order)

    def _explicit(self, kind: str) -> tuple[tuple[int, ...], ...] | None:
        for k, groups in self.explicit:
            if k == kind:
                return groups
        return None

    def size(self, kind: str) -> int:
        groups = self._explicit(kind)
        if groups is not None:
            return max((len(g) for g in groups), default=1)
        return layout_sizes(self.layout)[_check_kind(kind)]

    def _stride(self, kind: str) -> int:
        sizes = layout_sizes(self.layout)
        stride = 1
        for dim in self.order:
            if dim == kind:
                return stride
            stride *= sizes[dim]
        raise ValueError(kind)

    def coords(self, rank: int) -> dict[str, int]:
        sizes = layout_sizes(self.layout)
        out: dict[str, int] = {}
        rest = rank
        for dim in self.order:
            out[dim] = rest % sizes[dim]
            rest //= sizes[dim]
        for kind, groups in self.explicit:
            for group in groups:
                if rank in group:
                    out[kind] = group.index(rank)
                    break
        return {d: out[d] for d in DIMS}

    def group_of(self, rank: int, kind: str) -> tuple[int, ...]:
        """The ranks that share every coordinate with ``rank`` except ``kind``."""
        groups = self._explicit(_check_kind(kind))
        if groups is not None:
            for group in groups:
                if rank in group:
                    return group
            return (rank,)
        size = layout_sizes(self.layout)[kind]
        stride = self._stride(kind)
        coord = (rank // stride) % size
        base = rank - coord * stride
        return tuple(base + i * stride for i in range(size))

    def groups(self, kind: str) -> tuple[tuple[int, ...], ...]:
        """All groups of one kind, ordered by their lowest rank (that order is the group index)."""
        groups = self._explicit(_check_kind(kind))
        if groups is not None:
            return groups
        seen: set[int] = set()
        out: list[tuple[int, ...]] = []
        for rank in range(self.world_size):
            if rank in seen:
                continue
            group = self.group_of(rank, kind)
            seen.update(group)
            out.append(group)
        return tuple(out)

    def group_index(self, rank: int, kind: str) -> int:
        """Which group of that kind holds ``rank`` (the position in :meth:`groups`)."""
        groups = self._explicit(_check_kind(kind))
        if groups is not None:
            for i, group in enumerate(groups):
                if rank in group:
                    return i
            return -1
        # Lowest-rank order equals the order of the other coordinates, fastest first.
        sizes = layout_sizes(self.layout)
        index, scale, rest = 0, 1, rank
        for dim in self.order:
            c = rest % sizes[dim]
            rest //= sizes[dim]
            if dim != kind:
                index += c * scale
                scale *= sizes[dim]
        return index

    def kinds(self) -> tuple[str, ...]:
        """Kinds whose groups say something: more than one rank and not the whole job."""
        return tuple(k for k in DIMS if 1 < self.size(k) < self.world_size)


def group_ids(topology: Topology, kind: str) -> np.ndarray:
    """For every rank, the index of its group of ``kind`` (the order of ``Topology.groups``)."""
    world = topology.world_size
    for k, groups in topology.explicit:
        if k == kind:
            out = np.full(world, -1, dtype=np.int64)
            for i, group in enumerate(groups):
                members = np.asarray(group, dtype=np.int64)
                out[members[(members >= 0) & (members < world)]] = i
            return out
    sizes = layout_sizes(topology.layout)
    rest = np.arange(world, dtype=np.int64)
    index = np.zeros(world, dtype=np.int64)
    scale = 1
    for dim in topology.order:
        coord = rest % sizes[dim]
        rest = rest // sizes[dim]
        if dim != kind:
            index += coord * scale
            scale *= sizes[dim]
    return index


def _check_kind(kind: str) -> str:
    if kind not in DIMS:
        raise ValueError(f"unknown group kind {kind!r}; use one of {', '.join(DIMS)}")
    return kind


def distinct_communicators(counters: Mapping[int, RankCounters]) -> dict[str, Communicator]:
    """Every communicator the ranks' counters name, once per id (the first rank's record of it).

    Each member lists its groups, so a group of n ranks is seen n times; the
    analyzers look at each once. A record that does not know its members
    (NCCL's profiler plugin knows its commHash, size and place, not the global
    ranks) gets them from the records of that id: see ``communicator_joins``.
    """
    out: dict[str, Communicator] = {}
    unknown = False
    for rc in counters.values():
        for c in rc.communicators:
            if c.comm_id not in out:
                out[c.comm_id] = c
                unknown = unknown or not c.ranks
    if unknown:
        for j in communicator_joins(counters, out):
            out[j.comm_id] = replace(out[j.comm_id], ranks=j.members, comm_nranks=j.nranks,
                                     description=out[j.comm_id].description or j.torch_description)
    return out


@dataclass(frozen=True, slots=True)
class CommJoin:
    """One communicator known only by id (NCCL's commHash), joined from the ranks whose counters report it.

    ``members``: the global ranks, in NCCL's rank order where reported; the
    torch process group with the same members (``torch_group``, as the shim
    recorded it) gives the whole list, those that never reported included.
    ``missing_places``: NCCL ranks in it that no counter file reports (a
    size larger than the reporters); ``missing_ranks`` their global ranks,
    where the torch group says them.
    """

    comm_id: str
    members: tuple[int, ...]
    reporters: tuple[int, ...]
    nranks: int
    missing_places: tuple[int, ...]
    missing_ranks: tuple[int, ...]
    torch_group: str  # the torch group's id ("" when none matches)
    torch_description: str


def communicator_joins(counters: Mapping[int, RankCounters],
                       known: Mapping[str, Communicator] | None = None) -> list[CommJoin]:
    """The communicators whose records name no members, joined by id (see ``CommJoin``)."""
    first: dict[str, Communicator] = {}
    reported: dict[str, dict[int, int]] = {}  # comm_id -> global rank -> its NCCL rank (-1: not said)
    nranks: dict[str, int] = {}
    for rc in counters.values():
        for c in rc.communicators:
            first.setdefault(c.comm_id, c)
            if not c.ranks:
                reported.setdefault(c.comm_id, {})[rc.rank] = c.comm_rank
                nranks[c.comm_id] = max(nranks.get(c.comm_id, 0), c.comm_nranks)
    comms = known if known is not None else first
    torch_groups = [c for c in comms.values() if c.ranks]
    unknown = [cid for cid in reported if not comms.get(cid, first[cid]).ranks]  # (no rank's record knew them)
    # Indexed once: a job has thousands of groups and as many NCCL communicators, never compared pairwise.
    by_members: dict[frozenset[int], list[Communicator]] = {}
    for g in torch_groups:
        by_members.setdefault(frozenset(g.ranks), []).append(g)
    at_place: dict[tuple[int, int], list[Communicator]] | None = None  # (global rank, place) -> groups
    tied: dict[str, list[Communicator]] = {}
    for cid in unknown:
        places, size = reported[cid], nranks.get(cid, 0)
        # The torch group of this communicator: same members at the places NCCL reported (torch's group rank
        # is NCCL's rank), or (when some never reported) a group of NCCL's size with the reporters in place.
        def in_place(g: Communicator, places: dict[int, int] = places) -> bool:
            return all(p < 0 or (p < len(g.ranks) and g.ranks[p] == r) for r, p in places.items())
        tied[cid] = [g for g in by_members.get(frozenset(places), ()) if in_place(g)]
        if tied[cid] or not size or not places or not all(0 <= p < size for p in places.values()):
            continue
        if at_place is None:
            at_place = {}
            for g in torch_groups:
                for p, r in enumerate(g.ranks):
                    at_place.setdefault((r, p), []).append(g)
        r0, p0 = next(iter(places.items()))
        tied[cid] = [g for g in at_place.get((r0, p0), ()) if len(g.ranks) == size and in_place(g)]
    chosen = _assign_groups(counters, tied, first)
    out: list[CommJoin] = []
    for cid in unknown:
        places, size = reported[cid], nranks.get(cid, 0)
        by_place = sorted(places.items(), key=lambda kv: (kv[1] < 0, kv[1], kv[0]))
        reporters = tuple(g for g, _ in by_place)
        group = chosen.get(cid)
        members = group.ranks if group is not None else reporters
        missing_places = tuple(sorted(set(range(size)) - set(places.values()))) if size > len(places) else ()
        missing_ranks = tuple(sorted(r for r in members if r not in places))
        out.append(CommJoin(cid, members, reporters, size, missing_places, missing_ranks,
                            group.comm_id if group is not None else "",
                            group.description if group is not None else ""))
    return out


def _assign_groups(counters: Mapping[int, RankCounters], tied: Mapping[str, list[Communicator]],
                   first: Mapping[str, Communicator]) -> dict[str, Communicator]:
    """Each NCCL communicator's torch group, one to one where members alone cannot tell (a 2-rank job's
    default group and its TP group hold the same ranks): the group whose shim rows match the communicator's
    rows best (the same operations launched as often on the same ranks) wins; then the same backend, then
    the lower id. A communicator left without a free group shares its best one."""
    if not any(len(gs) > 1 for gs in tied.values()):
        return {cid: gs[0] for cid, gs in tied.items() if gs}
    wanted = {cid for cid in tied} | {g.comm_id for gs in tied.values() for g in gs}
    sig: dict[str, set[tuple[int, str, int]]] = {}
    for r, rc in counters.items():
        for o in rc.ops:
            if o.comm_id in wanted:
                sig.setdefault(o.comm_id, set()).add((r, canonical_op(o.op), o.cl))
    pairs = sorted(((len(sig.get(cid, set()) & sig.get(g.comm_id, set())), g.backend == first[cid].backend,
                     cid, g) for cid, gs in tied.items() for g in gs),
                   key=lambda t: (-t[0], not t[1], t[3].comm_id, t[2]))
    chosen: dict[str, Communicator] = {}
    taken: set[str] = set()
    for _, _, cid, g in pairs:
        if cid not in chosen and g.comm_id not in taken:
            chosen[cid] = g
            taken.add(g.comm_id)
    for _, _, cid, g in pairs:
        chosen.setdefault(cid, g)
    return chosen


def group_role_name(members: tuple[int, ...], topology: Topology | None) -> str:
    """A group without a description named by its role in the layout and its members: ``DP group [1, 3]``.

    The role is the layout's kind whose group has exactly these members; none fits: ``group [...]``.
    """
    shown = ", ".join(map(str, members)) if len(members) <= 8 else compact_ranks(members)
    if topology is not None and members:
        for kind in DIMS:
            if topology.size(kind) > 1 and set(topology.group_of(members[0], kind)) == set(members):
                return f"{kind.upper()} group [{shown}]"
        if set(members) == set(range(topology.world_size)):
            return f"all ranks [{shown}]"
    return f"group [{shown}]"


def _joined_op(o: OpCounters, comm_id: str, places: tuple[int, ...] | None) -> OpCounters:
    """The plugin's row under its torch group's id, in the vocabulary's name, its peers as global ranks.

    ``places``: the members in NCCL's rank order (None when the order is not known: the peers, places in
    the communicator, cannot be turned into global ranks and are dropped rather than misread).
    """
    peers = tuple(places[p] for p in o.open_peers if 0 <= p < len(places)) if places is not None else ()
    # built field by field, not with dataclasses.replace: thousands of ranks' rows per capture
    return OpCounters(comm_id, canonical_op(o.op), o.cl, o.wr, o.wc, o.last_launched_seq, o.last_completed_seq,
                      o.bytes_total, o.last_duration_s, o.recent_throughput, o.last_launch_wall,
                      o.last_complete_wall, peers)


def _one_row(host: OpCounters, device: OpCounters) -> OpCounters:
    """The shim's row and the plugin's row of one collective on one rank, as one: the device's completion,
    timings and peers (the GPU's truth), the host's launch count (what every member's shim compares)."""
    d = device
    return OpCounters(d.comm_id, d.op, host.cl, d.wr, d.wc, d.last_launched_seq, d.last_completed_seq,
                      d.bytes_total, d.last_duration_s if d.last_duration_s is not None else host.last_duration_s,
                      d.recent_throughput or host.recent_throughput, host.last_launch_wall or d.last_launch_wall,
                      d.last_complete_wall, d.open_peers)


def joined_counters(counters: Mapping[int, RankCounters],
                    topology: Topology | None = None) -> dict[int, RankCounters]:
    """Each real group once: NCCL's communicators (the profiler plugin's, known by commHash, size and place)
    folded into the torch groups the shim recorded (id, description, members), one row per collective.

    - a plugin communicator joined to a torch group (``communicator_joins``) disappears into it: its ops
      take the group's id, the vocabulary's names (``AllReduce`` -> ``all_reduce``) and global peers; where
      the shim has a row for the same op, the two become one (``_one_row``);
    - a plugin communicator with no torch group keeps its hash, with the members its reporters give;
    - a group without a description (torch's ``undefined``) is named by its role (``group_role_name``).

    Counters with nothing to join come back as they are (one pass over the communicators).
    """
    unnamed = topology is not None and any(is_unnamed_group(c.description) and c.ranks
                                           for rc in counters.values() for c in rc.communicators)
    joins = {j.comm_id: j for j in communicator_joins(counters)}
    if not joins and not unnamed:
        return dict(counters)
    first: dict[str, Communicator] = {}
    for rc in counters.values():
        for c in rc.communicators:
            first.setdefault(c.comm_id, c)
    target: dict[str, str] = {}  # plugin comm id -> the id its rows go under
    places: dict[str, tuple[int, ...] | None] = {}
    named: dict[str, Communicator] = {}  # every communicator that stays, as the analysis sees it
    for cid, j in joins.items():
        target[cid] = j.torch_group or cid
        complete = bool(j.torch_group) or (not j.missing_places and len(j.members) == j.nranks)
        places[cid] = j.members if complete else None
        if not j.torch_group:
            c = first[cid]
            named[cid] = replace(c, ranks=j.members, comm_nranks=j.nranks or c.comm_nranks)
    for cid, c in first.items():
        if cid in joins and cid not in named:
            continue
        c = named.get(cid, c)
        if is_unnamed_group(c.description) and c.ranks:
            c = replace(c, description=group_role_name(c.ranks, topology))
        named[cid] = c
    out: dict[int, RankCounters] = {}
    for r, rc in counters.items():
        comms = tuple(c if named[c.comm_id] is first[c.comm_id] else replace(named[c.comm_id], comm_rank=c.comm_rank)
                      for c in rc.communicators
                      if c.comm_id in named and (c.comm_id not in joins or c.comm_id == target[c.comm_id]))
        rows: dict[tuple[str, str], OpCounters] = {}
        device: dict[tuple[str, str], OpCounters] = {}
        for o in rc.ops:
            if o.comm_id in joins:
                d = _joined_op(o, target[o.comm_id], places[o.comm_id])
                device.setdefault((d.comm_id, d.op), d)
            else:
                rows.setdefault((o.comm_id, o.op), o)
        for key, d in device.items():
            host = rows.get(key)
            rows[key] = _one_row(host, d) if host is not None else d
        out[r] = replace(rc, communicators=comms, ops=tuple(rows.values()))
    return out


def joined_snapshot(snapshot: JobSnapshot, topology: Topology | None = None) -> JobSnapshot:
    """``snapshot`` with each machine's counters joined (``joined_counters``); the same object when nothing is."""
    counters = snapshot.all_counters()
    if not counters:
        return snapshot
    joined = joined_counters(counters, topology)
    if all(joined[r] is rc for r, rc in counters.items()):
        return snapshot
    machines = tuple(replace(m, counters=tuple(joined[c.rank] for c in m.counters)) if m.counters else m
                     for m in snapshot.machines)
    return replace(snapshot, machines=machines)


def communicator_groups(snapshot: JobSnapshot) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Per kind, the distinct groups recorded by the CCL plugin on any rank."""
    found: dict[str, set[tuple[int, ...]]] = {}
    for comm in distinct_communicators(snapshot.all_counters()).values():
        kind = kind_of_description(comm.description)
        if kind is None or not comm.ranks:
            continue
        found.setdefault(kind, set()).add(tuple(comm.ranks))
    return {k: tuple(sorted(v, key=lambda g: (min(g), g))) for k, v in found.items()}


def topology_for(snapshot: JobSnapshot, layout: Layout | None) -> Topology:
    """The job's topology from the given layout (else the snapshot's), refined by real membership.

    With no sizes known at all, every rank is put into one DP group and
    ``assumed`` is set, so callers can say that only single ranks and
    machines can be suspected.
    """
    chosen = layout if layout is not None else snapshot.layout
    explicit = communicator_groups(snapshot)
    world = snapshot.world_size
    if world is None:
        ranks_seen = [r for m in snapshot.machines for r in (*(ri.rank for ri in m.ranks), *(s.rank for s in m.stacks))]
        world = max(ranks_seen) + 1 if ranks_seen else 0
    assumed = False
    if chosen is None:
        if explicit:
            sizes = {k: max(len(g) for g in groups) for k, groups in explicit.items()}
            chosen = Layout(tp=sizes.get("tp", 1), pp=sizes.get("pp", 1), dp=sizes.get("dp", 1),
                            cp=sizes.get("cp", 1), ep=sizes.get("ep", 1))
        else:
            chosen = Layout(dp=max(world, 1))
            assumed = True
    validate_layout(chosen)
    product = chosen.tp * chosen.cp * chosen.ep * chosen.dp * chosen.pp
    if not assumed and product != world and world and not explicit:
        raise ValueError(
            f"the layout's sizes multiply to {product} ranks "
            f"(tp={chosen.tp} cp={chosen.cp} ep={chosen.ep} dp={chosen.dp} pp={chosen.pp}) "
            f"but the job has {world} ranks; pass sizes whose product is {world}"
        )
    world = max(world, product)
    # Real membership wins only where it covers the job; a partial record would hide ranks.
    usable = tuple(
        (k, groups) for k, groups in sorted(explicit.items())
        if len({r for g in groups for r in g}) >= world
    )
    return Topology(layout=chosen, world_size=world, explicit=usable, assumed=assumed)


def placement_of(snapshot: JobSnapshot) -> Mapping[int, str]:
    """Rank -> machine for every rank an agent reported (as a rank or by its stacks)."""
    placement = dict(snapshot.rank_to_machine())
    for m in snapshot.machines:
        for s in m.stacks:
            placement.setdefault(s.rank, m.machine)
    return placement
