"""Which peer keeps each rank's checkpoint backup (ByteRobust §6.3, Fig. 9).

Over-eviction removes every machine of a suspect parallel group at once (§5).
A rank's in-memory checkpoint survives that only if its backup copy lives on a
machine that no single group of the rank reaches: if the rank and its peer
shared a TP, PP, DP (or CP, EP) group, evicting that group would take both
copies. So the peer must differ from the rank in at least two coordinates
(sharing a group of kind X means agreeing on every coordinate except X), and,
because eviction is by machine, no group may span both machines.

The rule, checked against Fig. 9:

1. The *mirror* of a rank shifts its DP and PP coordinates by half their size
   (keeping its TP index, so the two exchange shards of the same shape). With
   even sizes the mirror of the mirror is the rank itself, so pairs *exchange*
   their states, as the paper's P2P backup does. If only one of DP/PP is
   larger than one, CP, EP and then TP are shifted as well until two
   coordinates differ.
2. If every mirror is on a machine that shares no group with the rank's
   machine, the mirrors are the plan.
3. Otherwise each machine backs up to the nearest following machine that
   shares no group with it, same slot (local rank) on that machine.
4. If no such machine exists (a single parallel group, e.g. pure DP / ZeRO,
   spans all machines), the neighbouring machine takes the backup, as the
   paper prescribes, and the notes say which group would lose both copies.

Fig. 9 (TP=2, PP=4, DP=2, two ranks per machine) is reproduced by Megatron's
default order ``tp-cp-ep-dp-pp`` (tp fastest, pp slowest): rank 8 is (tp 0,
dp 0, pp 2), its mirror (tp 0, dp 1, pp 0) is rank 2, and rank 9 mirrors to
rank 3 -- "ranks 8 and 9 exchange their optimizer states with ranks 2 and 3".
(The order ``tp-pp-dp`` with a neighbour-stage rule also maps 8 to 2, but that
rule puts both copies inside one PP group as soon as a machine holds two DP
replicas; the half shift does not.)

Group membership comes from the shared :mod:`rankscope.analyzers.topology`
(so recorded communicators win over typed sizes); only the inverse,
coordinates -> rank, needed for the mirror, is computed here.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from rankscope.analyzers.topology import Topology
from rankscope.analyzers.topology import parse_order as _topology_parse_order
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import DEFAULT_ORDER, DIMS, SIZES_FIX, Layout

# Shifted first when building the mirror; the rest join only if two coordinates do not differ yet.
_MIRROR_FIRST: tuple[str, ...] = ("dp", "pp")
_MIRROR_THEN: tuple[str, ...] = ("cp", "ep", "tp")


@dataclass(frozen=True, slots=True)
class BackupPair:
    """Rank ``rank`` keeps its backup copy on rank ``peer`` (and so on ``peer_machine``)."""

    rank: int
    peer: int
    machine: str
    peer_machine: str


@dataclass(frozen=True, slots=True)
class BackupPlan:
    """One pair per rank, ordered by rank.

    ``safe`` is true when no single parallel group of any kind spans both
    machines of any pair, i.e. over-evicting any one group never loses both
    copies. ``unsafe`` lists the pairs for which that does not hold, with the
    group kinds that would take both.
    """

    pairs: tuple[BackupPair, ...]
    world_size: int
    machines: tuple[tuple[str, tuple[int, ...]], ...]  # (machine, its ranks), in machine order
    rule: str  # "mirror", "next-free-machine", "neighbour" or "mixed"
    safe: bool
    unsafe: tuple[tuple[int, int, tuple[str, ...]], ...]  # (rank, peer, group kinds spanning both machines)
    notes: tuple[str, ...]


def parse_order(order: str) -> tuple[str, ...]:
    """The shared order parser (:func:`rankscope.analyzers.topology.parse_order`), its errors with a fix."""
    try:
        return _topology_parse_order(order)
    except ValueError as exc:
        raise RankscopeError(f"bad rank order {order!r}: {exc}",
                             f"use Megatron's default {DEFAULT_ORDER!r} or e.g. 'tp-pp-dp' (first name varies fastest)"
                             ) from exc


class _Grid:
    """Coordinates -> rank for the mirror (the shared Topology only goes rank -> coordinates)."""

    def __init__(self, sizes: Mapping[str, int], order: tuple[str, ...]) -> None:
        self.sizes = dict(sizes)
        self.order = order
        strides: dict[str, int] = {}
        stride = 1
        for dim in order:
            strides[dim] = stride
            stride *= self.sizes[dim]
        self.strides = strides
        self.world_size = stride

    def coords(self, rank: int) -> dict[str, int]:
        return {d: (rank // self.strides[d]) % self.sizes[d] for d in self.order}

    def rank(self, coords: Mapping[str, int]) -> int:
        return sum((coords[d] % self.sizes[d]) * self.strides[d] for d in self.order)


def backup_plan(
    layout: Layout | Topology,
    world_size: int | None = None,
    ranks_per_machine: int | None = None,
    machine_of: Mapping[int, str] | None = None,
) -> BackupPlan:
    """Pair every rank with the peer that keeps its checkpoint backup.

    ``layout`` is the job's :class:`~rankscope.contract.snapshot.Layout`, or its
    :class:`~rankscope.analyzers.topology.Topology` -- then the group
    membership the CCL plugin recorded decides which machines a group spans.
    Machines are consecutive blocks of ``ranks_per_machine`` ranks (named
    ``machine-<i>``; default: the layout's, else the TP size), unless
    ``machine_of`` gives the real rank -> machine map found in the job.
    """
    if isinstance(layout, Topology):
        lay, order = layout.layout, layout.order
        sizes = _sizes(lay, order)
        world_size = layout.world_size if world_size is None else world_size
    else:
        lay, order = layout, parse_order(layout.order)
        sizes = _sizes(lay, order)
    grid = _Grid(sizes, order)
    if world_size is None:
        world_size = grid.world_size
    if world_size != grid.world_size:
        raise RankscopeError(
            f"the layout {lay.sizes_text('(all sizes 1)')} covers {grid.world_size} ranks but the job has {world_size}",
            "pass sizes whose product is the world size (tp*cp*ep*dp*pp)",
        )
    machine_names, ranks_by_machine = _machines(world_size, lay, ranks_per_machine, machine_of)
    if len(ranks_by_machine) < 2:
        raise RankscopeError(
            f"all {world_size} ranks are on one machine, so no backup can leave it",
            "pass --ranks-per-machine with the number of ranks each machine really hosts",
        )
    machine_index = {r: i for i, ranks in enumerate(ranks_by_machine) for r in ranks}
    topology = layout if isinstance(layout, Topology) else Topology(lay, world_size)
    kinds = tuple(d for d in order if topology.size(d) > 1)
    spans = _group_spans(topology, kinds, machine_index)
    linked = _linked_machines(len(ranks_by_machine), spans)

    notes: list[str] = []
    peers: dict[int, int] = {}
    rule = "mirror"
    mirror = _mirror_map(grid, kinds)
    if mirror is not None and all(machine_index[p] not in linked[machine_index[r]] for r, p in mirror.items()):
        peers = mirror
    else:
        peers, rule = _fallback(ranks_by_machine, machine_index, linked, notes, kinds)
        if mirror is None:
            notes.insert(0, f"only one parallel dimension ({'/'.join(kinds).upper() or 'none'}) is larger than one, "
                            "so no rank has a mirror outside its group")
        else:
            notes.insert(0, "some mirrors (DP and PP shifted by half) share a group's machines with their rank; "
                            "backups go to the nearest machine outside the rank's groups")

    unsafe: list[tuple[int, int, tuple[str, ...]]] = []
    touching = _groups_touching(spans, len(ranks_by_machine))
    spanning: dict[tuple[int, int], tuple[str, ...]] = {}
    for r in range(world_size):
        key = (machine_index[r], machine_index[peers[r]])
        if key not in spanning:
            spanning[key] = tuple(kind for kind, per_machine in touching.items()
                                  if per_machine[key[0]] & per_machine[key[1]])
        both = spanning[key]
        if both:
            unsafe.append((r, peers[r], both))
    if unsafe:
        kinds_lost = sorted({k for _, _, ks in unsafe for k in ks})
        notes.append(f"{len(unsafe)} of {world_size} pairs would lose both copies if a whole "
                     f"{'/'.join(kinds_lost).upper()} group were over-evicted")
    if all(peers[peers[r]] == r for r in range(world_size)):
        notes.append("every pair exchanges: each rank stores exactly its peer's shard")

    pairs = tuple(BackupPair(r, peers[r], machine_names[machine_index[r]], machine_names[machine_index[peers[r]]])
                  for r in range(world_size))
    return BackupPlan(
        pairs=pairs,
        world_size=world_size,
        machines=tuple((machine_names[i], ranks) for i, ranks in enumerate(ranks_by_machine)),
        rule=rule,
        safe=not unsafe,
        unsafe=tuple(unsafe),
        notes=tuple(notes),
    )


def _sizes(lay: Layout, order: tuple[str, ...]) -> dict[str, int]:
    problems = lay.size_problems()
    if problems:
        raise RankscopeError(problems, SIZES_FIX)
    sizes = {d: getattr(lay, d) for d in DIMS}
    # parse_order appends dimensions the string left out; those must be unused, or ranks would be misplaced.
    named = set(lay.order_names())
    missing = [d for d in order if sizes[d] > 1 and d not in named]
    if missing:
        raise RankscopeError(f"the rank order {lay.order!r} does not place {', '.join(missing)}",
                             f"add {', '.join(missing)} to --order (e.g. {DEFAULT_ORDER})")
    return sizes



def _machines(
    world_size: int, lay: Layout, ranks_per_machine: int | None, machine_of: Mapping[int, str] | None,
) -> tuple[list[str], list[tuple[int, ...]]]:
    """Machine names and the ranks each hosts, in machine order."""
    if machine_of is not None:
        missing = [r for r in range(world_size) if r not in machine_of]
        if missing:
            raise RankscopeError(f"no machine known for rank(s) {missing[:8]}{'...' if len(missing) > 8 else ''}",
                                 "wait until every agent reports its ranks, or pass --ranks-per-machine")
        names: list[str] = []
        by_name: dict[str, list[int]] = {}
        for r in range(world_size):
            m = machine_of[r]
            if m not in by_name:
                names.append(m)
                by_name[m] = []
            by_name[m].append(r)
        return names, [tuple(by_name[m]) for m in names]
    rpm = ranks_per_machine if ranks_per_machine is not None else lay.ranks_per_machine
    if rpm is None:
        rpm = lay.tp
    if isinstance(rpm, bool) or not isinstance(rpm, int) or rpm < 1 or world_size % rpm:
        raise RankscopeError(f"{world_size} ranks cannot be split into machines of {rpm!r} ranks",
                             "pass --ranks-per-machine with a divisor of the world size (GPUs per machine)")
    count = world_size // rpm
    # The same names rankscope.analyzers.placement.Placement gives ranks no agent reported.
    return [f"machine-{i}" for i in range(count)], [tuple(range(i * rpm, (i + 1) * rpm)) for i in range(count)]


def _group_spans(topology: Topology, kinds: Sequence[str],
                 machine_index: Mapping[int, int]) -> dict[str, list[set[int]]]:
    """For each group kind, the machine set of each of its groups."""
    return {kind: [{machine_index[r] for r in group if r in machine_index} for group in topology.groups(kind)]
            for kind in kinds}


def _linked_machines(count: int, spans: Mapping[str, list[set[int]]]) -> list[set[int]]:
    """Machines that share at least one group with each machine (itself included)."""
    linked = [{m} for m in range(count)]
    for groups in spans.values():
        for machines in groups:
            for m in machines:
                linked[m] |= machines
    return linked


def _groups_touching(spans: Mapping[str, list[set[int]]], count: int) -> dict[str, list[set[int]]]:
    """Per kind and machine, the indices of the groups with a rank on that machine."""
    out: dict[str, list[set[int]]] = {}
    for kind, groups in spans.items():
        per_machine: list[set[int]] = [set() for _ in range(count)]
        for index, machines in enumerate(groups):
            for m in machines:
                per_machine[m].add(index)
        out[kind] = per_machine
    return out


def _mirror_map(grid: _Grid, kinds: Sequence[str]) -> dict[int, int] | None:
    """Every rank's mirror, or None when fewer than two dimensions can be shifted (a single group)."""
    shifted = [d for d in _MIRROR_FIRST if d in kinds]
    for d in _MIRROR_THEN:
        if len(shifted) >= 2:
            break
        if d in kinds:
            shifted.append(d)
    if len(shifted) < 2:
        return None
    out: dict[int, int] = {}
    for r in range(grid.world_size):
        c = grid.coords(r)
        for d in shifted:
            c[d] = (c[d] + grid.sizes[d] // 2) % grid.sizes[d]
        out[r] = grid.rank(c)
    return out


def _fallback(
    ranks_by_machine: Sequence[tuple[int, ...]], machine_index: Mapping[int, int], linked: Sequence[set[int]],
    notes: list[str], kinds: Sequence[str],
) -> tuple[dict[int, int], str]:
    """Per machine: the nearest following machine outside its groups, else its neighbour; same slot there."""
    count = len(ranks_by_machine)
    target: list[int] = []
    neighbour_used = 0
    for m in range(count):
        free = next(((m + k) % count for k in range(1, count) if (m + k) % count not in linked[m]), None)
        if free is None:
            # Pair neighbours as exchanges (0<->1, 2<->3, ...) when the count is even, else a ring.
            free = m ^ 1 if count % 2 == 0 else (m + 1) % count
            neighbour_used += 1
        target.append(free)
    peers: dict[int, int] = {}
    for m, ranks in enumerate(ranks_by_machine):
        there = ranks_by_machine[target[m]]
        for slot, r in enumerate(ranks):
            peers[r] = there[slot % len(there)]
    if neighbour_used:
        notes.append(f"{neighbour_used} of {count} machines share a group with every other machine "
                     f"(kinds {'/'.join(kinds).upper() or 'none'}); they back up to the neighbouring machine")
    if neighbour_used == count:
        return peers, "neighbour"
    return peers, "next-free-machine" if neighbour_used == 0 else "mixed"


@dataclass(frozen=True, slots=True)
class RestorePlan:
    """Which step the job resumes from and where each rank's shard comes from.

    All ranks must resume from the same step, so the step is the newest one
    for which every rank has a copy somewhere. A rank takes its local copy
    when its machine still holds that step (nothing crosses the network),
    else its backup peer's copy -- the case for ranks that moved to a
    standby after an eviction.
    """

    step: int | None
    sources: tuple[tuple[int, str], ...]  # (rank, "local" | "peer"), by rank
    missing: tuple[int, ...]  # ranks with no copy of any step
    notes: tuple[str, ...]


def restore_plan(world_size: int, local: Mapping[int, Sequence[int]], peer: Mapping[int, Sequence[int]]) -> RestorePlan:
    """Choose the common restore step and each rank's source.

    ``local[r]``: steps the machine now hosting rank r holds for it (its own
    agent's store); ``peer[r]``: steps r's backup peer's agent holds for it.
    """
    available = {r: set(local.get(r, ())) | set(peer.get(r, ())) for r in range(world_size)}
    missing = tuple(r for r, steps in available.items() if not steps)
    if missing:
        return RestorePlan(None, (), missing,
                           (f"{len(missing)} rank(s) have no checkpoint copy at all: resume from the last "
                            "persistent checkpoint instead",))
    common = set.intersection(*available.values()) if available else set()
    if not common:
        return RestorePlan(None, (), (), ("no step is held for every rank: the copies come from different steps; "
                                          "resume from the last persistent checkpoint instead",))
    step = max(common)
    sources = tuple((r, "local" if step in set(local.get(r, ())) else "peer") for r in range(world_size))
    notes: list[str] = []
    newest = max(max(s) for s in available.values())
    if newest > step:
        notes.append(f"step {newest} is not held for every rank; resuming from step {step}")
    from_peer = [r for r, src in sources if src == "peer"]
    if from_peer:
        notes.append(f"{len(from_peer)} rank(s) restore from their backup peer")
    return RestorePlan(step, sources, (), tuple(notes))
