"""Aegis Phase-2 (§4.2): suspects from the CL/WR/WC counters of every rank.

Per communicator and collective op, the members launch the same collectives
in the same order, so their launch counts (CL) move together:

- computation side: a member whose CL lags the others never launched the
  collective the others are waiting in (they show an open request, WC < WR):
  it is stuck before the call, in its own computation;
- communication side: a member with WC < WR has requests stuck on the wire
  (the paper's "WR < WC" is a typo); the peers of those requests are suspects
  with it, and a peer that has no open request back never posted its side.

Both kinds become ``Suspect``s of kind RANK with source ``ccl``, so the
verdict merge can rank them together with the stack verdict. A lagging side
that is itself blocked in a call its partners never entered, waiting on the
ranks that wait for it, is not computation side: the two sides are at
different points of the program, one ``desync`` suspect and finding
(``rankscope.analyzers.ccl_desync``).
``comm_rows`` gives the TUI one row per communicator and operation with the mismatches
flagged. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from rankscope.analyzers.ccl_desync import (
    CounterWaits,
    CrossedWait,
    OpTable,
    comm_label,
    counter_waits,
    crossed_waits,
    op_table,
)
from rankscope.analyzers.chain import DESYNC_ADVICE
from rankscope.analyzers.findings import Finding, Side, Suspect, SuspectKind, Verdict, VerdictStatus, suspect_order
from rankscope.analyzers.not_a_rank import counter_stalls, table_stalls, waiting_on
from rankscope.analyzers.topology import CommJoin, communicator_joins
from rankscope.contract.ranks import compact_ranks
from rankscope.contract.snapshot import JobSnapshot, Layout, RankCounters
from rankscope.contract.vocabulary import is_point_to_point, matching_op

SOURCE = "ccl"
# Scores on this detector's own scale (the merge rescales): a lagging rank
# that others wait for is the strongest signal Aegis has.
SCORE_CL_LAG = 1.0
SCORE_P2P_UNPOSTED = 0.95
SCORE_OPEN_REQUEST = 0.8


@dataclass(frozen=True, slots=True)
class CommRow:
    """One rank's counters in one communicator, summed over operation kinds (a row of the CL/WR/WC table)."""

    rank: int
    cl: int  # collectives launched (a send/recv is no collective: matched per peer pair, not counted here)
    wr: int
    wc: int
    lags: bool  # launched fewer collectives than the others of its communicator
    open_requests: bool  # wc < wr: requests issued and not completed
    stale: bool


def comm_rows(counters: Iterable[RankCounters]) -> dict[str, tuple[CommRow, ...]]:
    """Per communicator id, one row per rank with counters on it, by rank: the CL/WR/WC table (Aegis §4.2).

    A rank whose counters are stale or unreadable keeps its row, marked stale.
    """
    totals: dict[str, dict[int, list[int]]] = {}
    stale: set[int] = set()
    for rc in counters:
        if rc.stale or rc.error:
            stale.add(rc.rank)
        for op in rc.ops:
            t = totals.setdefault(op.comm_id, {}).setdefault(rc.rank, [0, 0, 0])
            t[0] += 0 if is_point_to_point(op.op) else op.cl
            t[1] += op.wr
            t[2] += op.wc
    out: dict[str, tuple[CommRow, ...]] = {}
    for cid, per in totals.items():
        top_cl = max((v[0] for v in per.values()), default=0)
        out[cid] = tuple(CommRow(r, v[0], v[1], v[2], v[0] < top_cl, v[2] < v[1], r in stale)
                         for r, v in sorted(per.items()))
    return out


_label = comm_label


def _ranks_word(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _machines(ranks: tuple[int, ...], placement: Mapping[int, str]) -> tuple[str, ...]:
    return tuple(sorted({placement[r] for r in ranks if r in placement}))


def counter_findings(counters: Mapping[int, RankCounters], placement: Mapping[int, str] | None = None,
                     crossed: tuple[CrossedWait, ...] | None = None, table: OpTable | None = None,
                     ) -> tuple[Suspect, ...]:
    """The suspects the counters point at (computation side first; a desync as one suspect).

    ``crossed``: the counters' crossed waits when the caller has them already;
    ``table``: ``op_table`` of the counters read without error, likewise.
    """
    placement = placement or {}
    live = {r: rc for r, rc in counters.items() if rc.error is None}
    if table is None:
        table = op_table(live)
    found: dict[tuple[int, ...], tuple[float, list[str]]] = {}
    sides: dict[tuple[int, ...], set[Side]] = {}  # suspect -> the sides its lines show
    pinned: dict[tuple[int, ...], set[int]] = {}  # suspect -> the ranks the counters pin (Suspect.roots)
    waits_on: dict[int, set[int]] = {}  # rank -> the ranks it waits for (a lag it waits in, a side never posted)

    def add(ranks: tuple[int, ...], score: float, line: str, roots: tuple[int, ...] = (), side: Side | None = None,
            ) -> None:
        key = tuple(sorted(set(ranks)))
        if side is not None:
            sides.setdefault(key, set()).add(side)
        old = found.get(key)
        if old is None:
            found[key] = (score, [line])
        else:
            found[key] = (max(old[0], score), [*old[1], line])
        pinned.setdefault(key, set()).update(roots)

    # Members of a communicator that all wait in one call together (a symmetric stall) lag elsewhere because
    # they are blocked there, not in their own work: a lag behind them leads to the stall, not to a rank.
    stalls = table_stalls(table, live)
    stalled = {r for st in stalls for r in st.ranks}
    members_of = [frozenset(st.ranks) for st in stalls]
    stalled_with = {r: members_of[i] for i, st in enumerate(stalls) for r in st.ranks}  # a member's own stall
    for cid, comm in table.comms.items():
        open_ops = table.open_of(cid)  # each line below reads a request open (a waiting leader, WC < WR)
        if not open_ops:
            continue
        members = [r for r in comm.ranks if r in live]
        by_op = table.of(cid)
        for op in open_ops:
            by_rank = by_op[op]
            row = {r: by_rank.get(r) for r in members}
            if not any(o is not None for o in row.values()):
                continue
            if is_point_to_point(op):
                # communication side: open point-to-point requests, and whether the peer posted its side
                for r, o in row.items():
                    if o is None or o.wc >= o.wr:
                        continue
                    for peer in o.open_peers or ():
                        if peer in stalled and peer not in (stalled_with.get(r) or ()):
                            continue  # the peer is blocked in a symmetric stall: that stall is what r waits on
                        posted = table.posted_back(cid, op, r, peer)
                        line = (f"rank {r}: {op} on {_label(comm)} WC {o.wc} < WR {o.wr}, open with rank {peer}"
                                + ("" if posted or peer not in live
                                   else f"; rank {peer} has no open {matching_op(op)} to rank {r}"))
                        score = SCORE_OPEN_REQUEST if posted or peer not in live else SCORE_P2P_UNPOSTED
                        if score == SCORE_P2P_UNPOSTED:
                            waits_on.setdefault(r, set()).add(peer)
                        # The peer that never posted its side is the cause; both posted: the link between them.
                        add((r, peer), score, line + f" ({Side.COMMUNICATION})",
                            (peer,) if score == SCORE_P2P_UNPOSTED else (), Side.COMMUNICATION)
                    if not o.open_peers:
                        add((r,), SCORE_OPEN_REQUEST * 0.5,
                            f"rank {r}: {op} on {_label(comm)} WC {o.wc} < WR {o.wr}, peer unknown")
                continue
            # computation side: CL behind members that wait in it
            cls = {r: (o.cl if o else 0) for r, o in row.items()}
            top = max(cls.values(), default=0)
            leaders = [r for r, c in cls.items() if c == top]
            waiting = [r for r in leaders if (o := row[r]) is not None and o.wc < o.wr]
            laggards = tuple(r for r, c in cls.items() if c < top)
            if laggards and waiting and set(laggards) <= stalled:
                for w in waiting:  # they wait on a symmetric stall (its communicator's suspect and finding say so)
                    waits_on.setdefault(w, set()).update(laggards)
                continue
            if laggards and waiting:
                for w in waiting:
                    waits_on.setdefault(w, set()).update(laggards)
                add(laggards, SCORE_CL_LAG,
                    f"rank {', '.join(map(str, laggards))}: {op} CL {min(cls[r] for r in laggards)} < {top} on "
                    f"{_label(comm)}; {_ranks_word(waiting)} {'waits' if len(waiting) == 1 else 'wait'} in it "
                    f"({Side.OWN_WORK})", laggards, Side.OWN_WORK)
            # communication side: every member launched it, yet a request never completed
            launched = [o.cl for o in row.values() if o is not None]
            if len(members) == len(comm.ranks) > 1 and all(o is not None and o.wc < o.wr for o in row.values()) \
                    and len(set(launched)) == 1:
                continue  # every member waits in it together: no rank to name (rankscope.analyzers.not_a_rank)
            if len(launched) == len(members) and min(launched) == max(launched):
                for r, o in row.items():
                    if o is not None and o.wc < o.wr:
                        add((r,), SCORE_OPEN_REQUEST,
                            f"rank {r}: {op} on {_label(comm)} WC {o.wc} < WR {o.wr} with every member "
                            f"launched ({Side.COMMUNICATION})", side=Side.COMMUNICATION)
    # A rank is pinned only where the counters show it waiting for nobody: a peer that never posted its send
    # because it waits in a collective itself is a link of the chain, not its end.
    suspects = [Suspect(SuspectKind.RANK, ranks, _machines(ranks, placement), score, tuple(lines), (SOURCE,),
                        roots=tuple(sorted(r for r in pinned.get(ranks, ()) if not waits_on.get(r))),
                        sides=frozenset(sides.get(ranks, ())))
                for ranks, (score, lines) in found.items()]
    suspects = _fold_victims(suspects, waits_on)
    suspects = _fold_desyncs(suspects, crossed_waits(live) if crossed is None else crossed, placement)
    suspects.sort(key=suspect_order)
    return tuple(suspects)


def _fold_victims(suspects: list[Suspect], waits_on: Mapping[int, set[int]]) -> list[Suspect]:
    """Suspects that only wait, through the counters, on another suspect's rank become that root's victims.

    One stuck rank makes its partners lag in the next collectives too: in a
    pipeline hang every rank of the stalled stage is behind on its data-parallel
    all-reduce, each at the same score as the rank that started it, and the
    first of them in rank order was named (rank 2 on the wrong machine, when
    rank 6 never posted the send rank 2 waits for). Following who waits for
    whom to the ranks that wait for nobody (the roots) tells them apart; a
    suspect all of whose ranks wait on someone is evidence under the best
    suspect holding a root it leads to. Waits that go round (no root) fold nothing.
    """
    roots = {r for targets in waits_on.values() for r in targets if not waits_on.get(r)}
    hosts = sorted((s for s in suspects if roots & set(s.ranks)), key=suspect_order)
    if not hosts:
        return suspects
    waited_by: dict[int, set[int]] = {}
    for waiter, targets in waits_on.items():
        for target in targets:
            waited_by.setdefault(target, set()).add(waiter)

    def waiters(of: set[int]) -> set[int]:
        """Every rank whose waits lead to one of ``of`` (one walk back over the edges, whatever the job's size)."""
        seen: set[int] = set()
        todo = list(of)
        while todo:
            for w in waited_by.get(todo.pop(), ()):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen

    leading = [waiters(roots & set(h.ranks)) for h in hosts]  # the ranks that lead to each host's roots
    host_ids = {id(h) for h in hosts}
    folded: dict[int, list[str]] = {}  # id(host) -> the lines of the suspects folded into it
    folded_sides: dict[int, set[Side]] = {}  # id(host) -> the sides those lines show
    out: list[Suspect] = []
    for s in suspects:
        at = None
        if id(s) not in host_ids and all(waits_on.get(r) for r in s.ranks):
            at = next((i for i, lead in enumerate(leading) if lead.intersection(s.ranks)), None)
        if at is None:
            out.append(s)
        else:
            folded.setdefault(id(hosts[at]), []).extend(f"  waits on it: {line}" for line in s.evidence)
            folded_sides.setdefault(id(hosts[at]), set()).update(s.sides)
    result: list[Suspect] = []
    for s in out:
        lines = folded.get(id(s))
        if lines is None:
            result.append(s)
            continue
        victims = (waiters(set(s.ranks)) | set(s.victims)) - set(s.ranks)
        result.append(replace(s, evidence=(*s.evidence, *lines[:6]), victims=tuple(sorted(victims)),
                              sides=s.sides | folded_sides.get(id(s), set())))
    return result


def desync_line(c: CrossedWait) -> str:
    """The headline of a desync the counters show."""
    if set(c.ranks) >= set(c.members):  # the whole communicator: a pair deadlocked on its send/recv
        return (f"desync: ranks {compact_ranks(c.ranks)} of {c.communicator} wait for each other's send/recv "
                "(one skipped or reordered a send)")
    return (f"desync: ranks {compact_ranks(c.ranks)} and the other {len(c.victims)} ranks of {c.communicator} "
            "wait for each other at different calls")


def _fold_desyncs(suspects: list[Suspect], crossed: tuple[CrossedWait, ...],
                  placement: Mapping[int, str]) -> list[Suspect]:
    """A crossed wait is one desync suspect: the lags and open requests inside it are its evidence, not suspects.

    Read alone, the lagging side looks stuck in its own computation and each
    unposted send/recv looks like a pair to evict; both are halves of one
    program mismatch.
    """
    if not crossed:
        return suspects
    out: list[Suspect] = []
    inside: list[tuple[set[int], list[str]]] = [(set(c.ranks) | set(c.victims), []) for c in crossed]
    for s in suspects:
        home = next((lines for ranks, lines in inside if set(s.ranks) <= ranks), None)
        if home is None:
            out.append(s)
        else:
            home.extend(s.evidence)
    for c, (_, lines) in zip(crossed, inside, strict=True):
        machines = _machines(c.ranks, placement)
        evidence = (desync_line(c), *c.evidence, *(f"counters: {x}" for x in lines[:6]), f"advice: {DESYNC_ADVICE}")
        out.append(Suspect(SuspectKind.DESYNC, c.ranks, machines, SCORE_CL_LAG, evidence, (SOURCE,),
                           victims=c.victims, state="desync", roots=() if c.tie else c.ranks, title=desync_line(c)))
    return out


def desync_finding(c: CrossedWait) -> Finding:
    """A desync the counters show, as a finding (kind ``desync``, the advice that eviction will not cure it)."""
    return Finding(kind="desync", ranks=c.ranks, summary=desync_line(c), evidence=c.evidence,
                   communicator=c.communicator, advice=DESYNC_ADVICE)


def join_note(j: CommJoin) -> str:
    """What a communicator known only by NCCL's id says of its members: who reports it, who never did."""
    tied = f" = torch group {j.torch_group}" + (f" ({j.torch_description})" if j.torch_description else "")
    head = f"comm {j.comm_id}{tied if j.torch_group else ''}"
    if not j.missing_places and not j.missing_ranks:
        return ""
    if j.missing_ranks:
        who = f"rank(s) {compact_ranks(j.missing_ranks)}"
    else:
        who = (f"NCCL rank(s) {compact_ranks(j.missing_places)} (global ranks unknown: no torch group has these "
               "members)")
    size = f"NCCL counts {j.nranks} ranks; " if j.nranks else ""
    return (f"{head}: {size}{len(j.reporters)} report it ({compact_ranks(j.reporters)}); {who} never did "
            "(no counter file, or the rank never created it): their counters cannot be compared")


def analyze_counters(snapshot: JobSnapshot, layout: Layout | None = None, waits: CounterWaits | None = None) -> Verdict:
    """The CCL verdict for one snapshot (``layout`` is accepted for symmetry; membership comes from the files).

    ``waits``: ``counter_waits(snapshot.all_counters())``, when the caller has built it already.
    """
    counters = snapshot.all_counters()
    seen_ranks = {r.rank for m in snapshot.machines for r in m.ranks}
    missing = tuple(sorted(seen_ranks - set(counters)))
    notes = [f"rank {r}: {rc.error}" for r, rc in sorted(counters.items()) if rc.error]
    notes += [f"rank {r}: counters stale ({rc.stale_reason})" for r, rc in sorted(counters.items()) if rc.stale]
    notes += [line for j in communicator_joins(counters) if (line := join_note(j))]
    if not counters:
        return Verdict((), "no CCL counters (start the job with `rankscope run`)", missing, tuple(notes),
                       status=VerdictStatus.NO_VERDICT)
    if waits is None:
        waits = counter_waits(counters)  # one index and wait graph of the counters for both rules
    crossed = crossed_waits(counters, waits=waits)
    placement = snapshot.rank_to_machine()
    suspects = counter_findings(waits.live, placement, crossed, waits.table)
    world = range(snapshot.world_size) if snapshot.world_size else sorted(counters)
    stalls = counter_stalls(waits, world)
    # A communicator smaller than the job whose members all wait together is the group to look at (its links,
    # its machines' GPUs), with no rank of it pinned; the whole job stalled that way has no group to name.
    parts = [st for st in stalls if not st.whole_job]
    suspects += tuple(Suspect(SuspectKind.COMM, st.ranks, _machines(st.ranks, placement), SCORE_OPEN_REQUEST,
                              (st.summary(), *st.evidence), (SOURCE,), victims=victims)
                      for st, victims in zip(parts, waiting_on(waits, [st.ranks for st in parts]), strict=True))
    status = VerdictStatus.NAMED
    if suspects:
        top = suspects[0]
        summary = f"CCL counters: {top.evidence[0]}"
    elif stalls:
        summary, status = stalls[0].summary(), VerdictStatus.NOT_A_RANK
    else:
        summary, status = "CCL counters: every communicator's members agree", VerdictStatus.NO_VERDICT
    return Verdict(suspects, summary, missing, tuple(notes),
                   findings=(*map(desync_finding, crossed), *(st.finding() for st in stalls)), status=status)
