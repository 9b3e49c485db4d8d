"""Desync told by the counters: members of one communicator that wait for each other at different calls.

Aegis' CL rule (``rankscope.analyzers.ccl``) reads a member whose launch
count (CL) lags while its peers wait in the collective as stuck before the
call, in its own computation. That holds when the laggard waits for nobody.
When the laggard is itself blocked in a call its partners never entered (a
send or recv whose peer never posted the matching op, or a collective it
launched ahead of some members) and those waits lead back to the ranks that
wait for it, the two sides wait for each other: neither is stuck in its own
work, they are at different points of the program. That is a desync (an
extra step or a rank-dependent branch on one side), which evicting machines
will not cure.

Who waits on whom, from the counters (``r -> p``: r cannot go on until p acts):

- collective: a member with an open request on an op (WC < WR) after c
  launches waits on every member of the communicator that launched that op
  fewer than c times;
- send/recv: a rank with an open send (recv) to peer p waits on p when p has
  no open recv (send) back to it: p never posted its side.

Callers may add waits from other evidence (the chain adds the stacks'
send/recv states, for counters that do not record point-to-point ops).

A *crossed wait* is a collective lag (the waiting side W launched the op, the
lagging side G did not) where every rank of G, following these waits, comes
back to a rank of W. The side named is the smaller one: the few ranks off the
many's path. On a tie the laggards are named (they are not in the call the
others wait in), and the tie is said. Lags whose named sides overlap are one
mismatch, told once. Pure: the snapshot contract only; flight-recorder dumps
become counters (sequence numbers as launches), so they are read the same way.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from rankscope.analyzers.topology import distinct_communicators
from rankscope.contract.ranks import compact_ranks
from rankscope.contract.snapshot import Communicator, OpCounters, RankCounters
from rankscope.contract.vocabulary import canonical_op, direction_word, is_point_to_point, matching_op

_MAX_PATHS = 3  # laggards whose way back is spelled out; the rest are counted

_Node = int | tuple[str, str, int]  # a rank, or "the members of comm C that launched op fewer than c times"


@dataclass(frozen=True, slots=True)
class CrossedWait:
    """One desync the counters show: ``ranks`` are the side named, ``victims`` the side that waits for them."""

    communicator: str  # "comm 0 (default_pg)": where the first lag was seen
    members: tuple[int, ...]
    op: str  # the collective the waiting side launched and the lagging side did not
    waiting: tuple[int, ...]
    lagging: tuple[int, ...]
    ranks: tuple[int, ...]
    victims: tuple[int, ...]
    tie: bool
    evidence: tuple[str, ...]


def comm_label(comm: Communicator) -> str:
    return f"comm {comm.comm_id}" + (f" ({comm.description})" if comm.description else "")


@dataclass(frozen=True, slots=True)
class OpTable:
    """Every rank's counters by communicator, then op, then rank: one pass over the ranks' files.

    Both the CL rule and the desync graph go communicator by communicator and
    op by op; indexing each rank's list of ops per communicator instead costs
    members x ops of every member for each communicator, seconds at 16k ranks.
    A rank with two rows for one (communicator, op) keeps its first.

    ``open_ops``: the (communicator, op) pairs where some rank has a request
    open (WC < WR). Every wait, lag and open request either rule reports
    starts at one, so both skip the rest: in a running or a hung job most
    communicators have nothing open, and at 16k ranks they are thousands.
    """

    comms: dict[str, Communicator]
    ops: dict[str, dict[str, dict[int, OpCounters]]]  # comm_id -> op -> rank -> its counters
    open_ops: frozenset[tuple[str, str]] = frozenset()

    def of(self, comm_id: str) -> dict[str, dict[int, OpCounters]]:
        return self.ops.get(comm_id, {})

    def open_of(self, comm_id: str) -> list[str]:
        """The ops of ``comm_id`` with a request open on some rank, in name order."""
        return sorted(op for op in self.of(comm_id) if (comm_id, op) in self.open_ops)

    def posted_back(self, comm_id: str, op: str, rank: int, peer: int) -> bool:
        """Whether ``peer`` has the matching side of ``rank``'s open send/recv: its recv/send open toward ``rank``.

        Matched per peer pair, whatever each writer called the op (``send``, ``Send``, ``isend``).
        """
        other = matching_op(op)
        for name, by_rank in self.of(comm_id).items():
            if other is not None and canonical_op(name) == other:
                theirs = by_rank.get(peer)
                if theirs is not None and rank in theirs.open_peers:
                    return True
        return False

    def received_in_pair(self, comm_id: str, op: str, rank: int, peer: int) -> bool:
        """Whether ``peer`` posted every matching op to ``rank``'s open ones, on a communicator of just the two.

        Only there do the counts say it per pair: ``peer`` issued at least as
        many recvs (sends) as ``rank`` issued sends (recvs), and none is open
        toward ``rank``, so the transfers happened and ``rank``'s open request
        is done but not yet settled (the shim settles async requests in the
        background, which cannot run while a rank holds the GIL in a C call).
        Such a request waits on nobody: reading it as a wait would turn a rank
        stuck in its own work into half of a desync.
        """
        comm = self.comms.get(comm_id)
        if comm is None or len(set(comm.ranks)) != 2:
            return False
        other = matching_op(op)
        mine = theirs = 0
        for name, by_rank in self.of(comm_id).items():
            kind = canonical_op(name)
            if kind == canonical_op(op) and (o := by_rank.get(rank)) is not None:
                mine += o.wr
            elif other is not None and kind == other and (o := by_rank.get(peer)) is not None:
                theirs += o.wr
        return theirs >= mine


def op_table(counters: Mapping[int, RankCounters]) -> OpTable:
    ops: dict[str, dict[str, dict[int, OpCounters]]] = {}
    open_ops: set[tuple[str, str]] = set()
    for r, rc in counters.items():
        for o in rc.ops:
            ops.setdefault(o.comm_id, {}).setdefault(o.op, {}).setdefault(r, o)
            if o.wc < o.wr:
                open_ops.add((o.comm_id, o.op))
    return OpTable(distinct_communicators(counters), ops, frozenset(open_ops))


def live_counters(counters: Mapping[int, RankCounters]) -> dict[int, RankCounters]:
    """The counters that say something now: read without error and not stale."""
    return {r: rc for r, rc in counters.items() if rc.error is None and not rc.stale}


@dataclass(frozen=True, slots=True)
class Together:
    """A communicator whose every member launched ``op`` ``cl`` times and has it open: they wait in it together."""

    comm: Communicator
    op: str
    cl: int
    rows: tuple[OpCounters, ...]  # each member's counters of that op, in member order


def waiting_together(table: OpTable, live: Mapping[int, RankCounters]) -> list[Together]:
    """Communicators whose members all wait in one collective together (a symmetric stall, by the counters).

    Every member needs a live counter file (one without could be the rank the
    others wait on), and NCCL's size, where known, must not count more
    members than report the communicator.
    """
    out: list[Together] = []
    for cid, comm in table.comms.items():
        open_ops = table.open_of(cid)  # first: most communicators have nothing open, and their members are many
        members = comm.ranks
        if not open_ops or len(members) < 2 or any(m not in live for m in members):
            continue
        if comm.comm_nranks and comm.comm_nranks > len(members):
            continue
        for op in open_ops:
            if is_point_to_point(op):
                continue
            by_rank = table.of(cid).get(op, {})
            rows = [by_rank.get(m) for m in members]
            if any(o is None or o.wc >= o.wr for o in rows):
                continue
            if len({o.cl for o in rows if o is not None}) != 1:
                continue
            out.append(Together(comm, op, rows[0].cl if rows[0] is not None else 0,
                                tuple(o for o in rows if o is not None)))
            break
    return out


@dataclass(frozen=True, slots=True)
class _Lag:
    comm: Communicator
    op: str
    top: int
    waiting: tuple[int, ...]
    lagging: tuple[int, ...]
    lag_cl: int


class _Waits:
    """The waits-for graph, with one line of evidence per edge out of a rank."""

    def __init__(self) -> None:
        self.out: dict[_Node, list[_Node]] = {}
        self.why: dict[tuple[int, _Node], str] = {}

    def with_extra(self, live: Mapping[int, RankCounters], extra: Mapping[int, Mapping[int, str]]) -> _Waits:
        """A copy with the ``extra`` waits (rank -> {peer: why}) between live ranks added where not already there."""
        g = _Waits()
        g.out = {n: list(targets) for n, targets in self.out.items()}
        g.why = dict(self.why)
        for r, peers in extra.items():
            for p, why in peers.items():
                if r in live and p in live and p not in g.out.get(r, ()):
                    g.add(r, p, why)
        return g

    def add(self, a: _Node, b: _Node, why: str = "") -> None:
        self.out.setdefault(a, []).append(b)
        if why and isinstance(a, int):
            self.why.setdefault((a, b), why)

    def path(self, start: int, targets: set[int]) -> list[_Node] | None:
        """The shortest way from ``start`` to any of ``targets`` (breadth first), or None."""
        parent: dict[_Node, _Node | None] = {start: None}
        todo: deque[_Node] = deque([start])
        while todo:
            n = todo.popleft()
            for m in self.out.get(n, ()):
                if m in parent:
                    continue
                parent[m] = n
                if isinstance(m, int) and m in targets:
                    way: list[_Node] = [m]
                    back: _Node | None = n
                    while back is not None:
                        way.append(back)
                        back = parent[back]
                    return way[::-1]
                todo.append(m)
        return None


@dataclass(frozen=True, slots=True)
class CounterWaits:
    """Who waits on whom by the counters alone: built once per capture for the CL rule, the desync check and
    the chain of waits (which adds the stacks' send/recv waits to a copy)."""

    live: Mapping[int, RankCounters]  # read without error and not stale
    table: OpTable
    graph: _Waits
    lags: tuple[_Lag, ...]


def counter_waits(counters: Mapping[int, RankCounters]) -> CounterWaits:
    live = live_counters(counters)
    table = op_table(live)
    graph, lags = _graph(live, table)
    return CounterWaits(live, table, graph, tuple(lags))


def _graph(live: Mapping[int, RankCounters], table: OpTable) -> tuple[_Waits, list[_Lag]]:
    g = _Waits()
    lags: list[_Lag] = []
    for cid, comm in table.comms.items():
        open_ops = table.open_of(cid)  # a wait or a lag needs a request open on its (communicator, op)
        members = [r for r in comm.ranks if r in live] if open_ops else []
        if not members:
            continue
        label = comm_label(comm)
        by_op = table.of(cid)
        for op in open_ops:
            by_rank = by_op[op]
            rows = {r: by_rank.get(r) for r in members}
            if is_point_to_point(op):
                for r, o in rows.items():
                    if o is None or o.wc >= o.wr:
                        continue
                    for p in o.open_peers:
                        if (p in live and not table.posted_back(cid, op, r, p)
                                and not table.received_in_pair(cid, op, r, p)):
                            g.add(r, p, f"rank {r} waits in {op} {direction_word(op)} rank {p} on {label} "
                                        f"(WC {o.wc} < WR {o.wr}); rank {p} never posted the matching "
                                        f"{matching_op(op)}")
                continue
            cls = {r: (o.cl if o is not None else 0) for r, o in rows.items()}
            levels = sorted(set(cls.values()))
            for r, o in rows.items():
                if o is None or o.wc >= o.wr or o.cl == levels[0]:
                    continue
                node = (cid, op, o.cl)
                if node not in g.out:
                    for m, launched in cls.items():
                        if launched < o.cl:
                            g.add(node, m)
                # (the node's edges are the members that never launched it: counted once per launch, not per rank)
                g.add(r, node, f"rank {r} waits in {op} on {label} (its launch {o.cl}, which "
                               f"{len(g.out[node])} member(s) never launched)")
            top = levels[-1]
            waiting = tuple(r for r, o in rows.items() if o is not None and o.cl == top and o.wc < o.wr)
            lagging = tuple(r for r, n in cls.items() if n < top)
            if waiting and lagging:
                lags.append(_Lag(comm, op, top, waiting, lagging, max(cls[r] for r in lagging)))
    return g, lags


def _describe(g: _Waits, way: list[_Node], op: str) -> str:
    """``rank 2 waits in send to rank 6 ...; rank 6 waits in barrier for this side``."""
    first = g.why.get((way[0], way[1]), f"rank {way[0]} waits") if isinstance(way[0], int) else ""
    end = way[-1]
    direct = len(way) == 2 or (len(way) == 3 and not isinstance(way[1], int))
    return f"{first}; {'and' if direct else 'that leads back to'} rank {end}, which waits in {op} for this side"


def crossed_waits(counters: Mapping[int, RankCounters], extra: Mapping[int, Mapping[int, str]] | None = None,
                  waits: CounterWaits | None = None) -> tuple[CrossedWait, ...]:
    """Desyncs the counters show (see the module docstring), largest waiting side first.

    ``extra``: more waits, rank -> {peer: why}, from evidence beside the counters.
    ``waits``: ``counter_waits(counters)``, when the caller has built it already.
    """
    if waits is None:
        waits = counter_waits(counters)
    if len(waits.live) < 2:
        return ()
    g = waits.graph.with_extra(waits.live, extra) if extra else waits.graph
    found: list[CrossedWait] = []
    for lag in waits.lags:
        targets = set(lag.waiting)
        ways = {r: g.path(r, targets) for r in lag.lagging}
        if any(w is None for w in ways.values()):
            continue  # some laggard waits for nobody (or for a rank outside): a computation-side lag, not a desync
        label = comm_label(lag.comm)
        tie = len(lag.lagging) == len(lag.waiting)
        named, others = ((lag.lagging, lag.waiting) if len(lag.lagging) <= len(lag.waiting)
                         else (lag.waiting, lag.lagging))
        lines = [f"{lag.op} on {label}: ranks {compact_ranks(lag.waiting)} launched it (CL {lag.top}) and wait "
                 f"in it; ranks {compact_ranks(lag.lagging)} never did (CL {lag.lag_cl} < {lag.top})"]
        shown = sorted(lag.lagging)[:_MAX_PATHS]
        for r in shown:
            way = ways[r]
            assert way is not None
            lines.append(_describe(g, way, lag.op))
        if len(lag.lagging) > len(shown):
            lines.append(f"... and {len(lag.lagging) - len(shown)} more rank(s) of that side wait the same way")
        lines.append("each side waits for the other, so neither is stuck in its own work (a rank stuck in its "
                     "own work waits for nobody): they are at different points of the program")
        if tie:
            lines.append(f"both sides hold {len(named)} ranks: the ones that never launched {lag.op} are named; "
                         "either side may be the one that strayed")
        found.append(CrossedWait(label, tuple(lag.comm.ranks), lag.op, tuple(sorted(lag.waiting)),
                                 tuple(sorted(lag.lagging)), tuple(sorted(named)), tuple(sorted(others)), tie,
                                 tuple(lines)))
    found.extend(_crossed_pairs(waits, g))
    return _merge(found)


def _crossed_pairs(waits: CounterWaits, g: _Waits) -> list[CrossedWait]:
    """Two ranks each waiting in a send/recv on the other, neither posting the matching op: a pipeline pair
    deadlocked by one side skipping (or reordering) a send. Matched per peer pair; either side may have strayed.
    """
    out: list[CrossedWait] = []
    for r, targets in g.out.items():
        if not isinstance(r, int):
            continue
        for p in targets:
            if not isinstance(p, int) or p <= r or r not in g.out.get(p, ()):
                continue
            comm = _pair_comm(waits, r, p)
            members = tuple(comm.ranks) if comm is not None else (r, p)
            lines = (g.why.get((r, p), f"rank {r} waits on rank {p}"), g.why.get((p, r), f"rank {p} waits on rank {r}"),
                     f"ranks {r} and {p} each wait for the other's side of a transfer: one of them skipped or "
                     "reordered a send (a program mismatch); either may be the one that strayed")
            out.append(CrossedWait(comm_label(comm) if comm is not None else f"ranks {r} and {p}", members, "send",
                                   (r, p), (r, p), (r, p), (), True, lines))
    return out


def _pair_comm(waits: CounterWaits, r: int, p: int) -> Communicator | None:
    """The communicator of ``r``'s open send/recv toward ``p``."""
    rc = waits.live.get(r)
    for o in rc.ops if rc is not None else ():
        if is_point_to_point(o.op) and o.wc < o.wr and p in o.open_peers:
            return waits.table.comms.get(o.comm_id)
    return None


def _merge(found: list[CrossedWait]) -> tuple[CrossedWait, ...]:
    """Lags whose named sides share a rank are one mismatch (its two halves, or one lag per communicator)."""
    found.sort(key=lambda c: (-len(c.victims), c.ranks))
    out: list[CrossedWait] = []
    for c in found:
        same = next((i for i, o in enumerate(out) if set(o.ranks) & set(c.ranks)), None)
        # A tie in a small communicator whose waiting side is the named side of a larger mismatch is that
        # mismatch seen from inside one group (two ranks of different groups a step ahead each wait on a peer
        # that never launched their call): its laggards are victims, not odd ones out.
        ahead = next((i for i, o in enumerate(out) if c.tie and set(c.waiting) <= set(o.ranks)), None)
        if same is None and ahead is None:
            out.append(c)
            continue
        o = out[same if same is not None else ahead]  # type: ignore[index]
        if same is None:
            out[ahead] = CrossedWait(o.communicator, o.members, o.op, o.waiting, o.lagging, o.ranks,  # type: ignore[index]
                                     tuple(sorted((set(o.victims) | set(c.lagging)) - set(o.ranks))), o.tie,
                                     (*o.evidence, *(e for e in c.evidence if e not in o.evidence)))
            continue
        ranks = set(o.ranks) | set(c.ranks)
        out[same] = CrossedWait(o.communicator, o.members, o.op, o.waiting, o.lagging, tuple(sorted(ranks)),
                                tuple(sorted((set(o.victims) | set(c.victims)) - ranks)), o.tie and c.tie,
                                (*o.evidence, *(e for e in c.evidence if e not in o.evidence)))
    return tuple(out)


__all__ = ["CounterWaits", "CrossedWait", "OpTable", "Together", "comm_label",
           "counter_waits", "crossed_waits", "live_counters", "op_table", "waiting_together"]
