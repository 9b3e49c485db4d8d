"""The counters' late arrivers and slow links, kept over calls (Aegis §5.2): which rank is blamed on which machine.

In a healthy job *someone* arrives last at every collective; what marks a slow computer is being the late arriver
(TD < α·mean) call after call, and what marks a slow link is its low throughput (N > β·mean) call after call.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from rankscope.analyzers.call_tally import CallTally, collective_calls, narrow_to_common_end
from rankscope.analyzers.degradation import degradation_findings
from rankscope.analyzers.failslow_config import FailSlowConfig
from rankscope.analyzers.topology import joined_counters
from rankscope.contract.ranks import compact_ranks
from rankscope.contract.snapshot import JobSnapshot


@dataclass(frozen=True, slots=True)
class Blame:
    """The ranks of one machine the counters blame: each rank's own evidence (first blamed first), the most calls
    any was flagged in, and the ranks blamed as the common end of slow links (N > β·mean) rather than late."""

    evidence: tuple[tuple[int, str], ...]
    calls: int
    link_ranks: tuple[int, ...] = ()

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(r for r, _ in self.evidence)


class LateArrivals:
    """Each collective call tallied per communicator and member: late (TD) and slow-link (N) marks."""

    def __init__(self, config: FailSlowConfig) -> None:
        self.config = config
        self._late: CallTally[tuple[str, int]] = CallTally(config.ccl_calls_window)
        self._links: CallTally[tuple[str, int]] = CallTally(config.ccl_calls_window)
        self._late_example: dict[int, str] = {}

    def targets(self, snapshot: JobSnapshot, step_s: float | None, rank_machine: Mapping[int, str],
                notes: list[str]) -> dict[str, Blame]:
        """Aegis §5.2 on the counters, kept over calls: machine -> (ranks, evidence, flagged calls).

        In a healthy job *someone* arrives last at every collective; what marks
        a slow computer is being the late arriver (TD < α·mean) call after call.
        So each distinct call (seen once, however many polls show it) is
        tallied per communicator and member, and a rank is blamed once it was
        flagged in at least ``ccl_fraction`` of its last ``ccl_calls_window``
        calls on one communicator (and ``ccl_min_calls`` of them). Per
        communicator, because a rank's communicators tell different stories:
        the slow rank's whole data-parallel replica arrives late at the
        gradient all-reduce every step, while inside its tensor-parallel
        group only the calls right after its slow compute are late; mixed
        together, neither would reach the bar.

        Slow links (N > β·mean) are tallied the same way per communicator, then
        narrowed to the rank the slow communicators share, the source or
        destination every slow link touches (RootDiag's idea); links that
        share no rank point at the network and only make a note. N here is
        measured per request including any wait for the peers, so on a call
        where some member arrived late the others' low throughput is that
        wait, not their link: such calls are not counted as slow links.
        """
        # one row per collective: the plugin's NCCL communicators joined into the shim's groups
        counters = joined_counters(snapshot.all_counters())
        if not counters:
            return {}
        cfg = self.config
        found = degradation_findings(counters, cfg.alpha, cfg.beta)
        # Lateness that is a sliver of a step (a millisecond on a tiny
        # collective) is scheduling noise, not a slow computer.
        floor = max(cfg.ccl_min_lateness_s, cfg.ccl_min_lateness_share * step_s if step_s else 0.0)
        late = {(f.comm_id, f.op, f.rank): f for f in found if f.kind == "slow_compute" and f.mean - f.value >= floor}
        waited = {(f.comm_id, f.op) for f in found if f.kind == "slow_compute"}
        slow = {(f.comm_id, f.op, f.rank) for f in found if f.kind == "slow_link" and (f.comm_id, f.op) not in waited}
        for (comm, op), (call, with_td, with_n) in collective_calls(counters).items():
            self._late.add((comm, op, call), [(comm, r) for r in with_td],
                           {(comm, r) for r in with_td if (comm, op, r) in late})
            self._links.add((comm, op, call), [(comm, r) for r in with_n],
                            {(comm, r) for r in with_n if (comm, op, r) in slow})
        for f in late.values():
            self._late_example[f.rank] = f.evidence()
        targets: dict[str, Blame] = {}

        def blame(rank: int, evidence: str, calls: int, link: bool = False) -> None:
            m = rank_machine.get(rank)
            if m is None:
                return
            held = targets.get(m, Blame((), 0))
            if rank not in held.ranks:
                targets[m] = Blame((*held.evidence, (rank, evidence)), max(held.calls, calls),
                                   (*held.link_ranks, rank) if link else held.link_ranks)

        persistent = self._late.persistent(cfg.ccl_min_calls, cfg.ccl_fraction)
        victims = self._victims({rank for _comm, rank in persistent})
        for (comm, rank), (hits, seen) in sorted(persistent.items(), key=lambda kv: (-kv[1][0], kv[0])):
            why = victims.get(rank)
            if why is not None:
                if why not in notes:
                    notes.append(why)
                continue
            blame(rank, f"rank {rank} arrived last in {hits} of its last {seen} collectives on comm {comm} "
                        f"(TD < {cfg.alpha:g}·mean); latest: {self._late_example.get(rank, '-')}", hits)
        links: dict[str, set[int]] = {}
        hits_of: dict[int, int] = {}
        for (comm, rank), (hits, _seen) in self._links.persistent(cfg.ccl_min_calls, cfg.ccl_fraction).items():
            links.setdefault(comm, set()).add(rank)
            hits_of[rank] = max(hits_of.get(rank, 0), hits)
        if links:
            ends = narrow_to_common_end(list(links.values()))
            if ends:
                for r in ends:
                    blame(r, f"slow links (N > {cfg.beta:g}·mean) on {len(links)} communicator(s) share rank "
                             f"{compact_ranks(ends)}", hits_of.get(r, 0), link=True)
            else:
                notes.append(f"slow links on {len(links)} communicators share no rank: look at the network")
        return targets

    def _victims(self, blamed: set[int]) -> dict[int, str]:
        """Late arrivers whose lateness is their wait on another blamed rank in a group they share: rank -> note.

        A rank that waits on a slow peer in one collective reaches its next collective late too: with rank 5
        slow, its TP peer rank 4 waits in their TP all-reduce (its TD there is long, rank 5's short) and then both
        come last to their own data-parallel all-reduces, so the tally blamed rank 4 beside rank 5. Rank r is such
        a victim of rank s when, over their last calls on a communicator both belong to, s arrived last in at
        least ``ccl_waited_share`` of its calls and r in fewer than half as many as s (r waited there). Two
        ranks each the other's victim on different groups stay blamed: nothing says which one waited first.
        """
        cfg = self.config
        members: dict[str, list[int]] = {}
        for comm, rank in self._late.tallied():
            members.setdefault(comm, []).append(rank)
        waited: dict[int, list[tuple[int, str, int, int, int]]] = {}  # r -> (s, comm, s's hits, s's calls, r's hits)
        for comm, ranks in sorted(members.items()):
            for s in ranks:
                s_hits, s_calls = self._late.hits((comm, s))
                if s not in blamed or s_hits < max(2, cfg.ccl_waited_share * s_calls):
                    continue
                for r in ranks:
                    r_hits = self._late.hits((comm, r))[0]
                    if r != s and r in blamed and 2 * r_hits < s_hits:
                        waited.setdefault(r, []).append((s, comm, s_hits, s_calls, r_hits))
        out: dict[int, str] = {}
        for r, edges in sorted(waited.items()):
            for s, comm, s_hits, s_calls, r_hits in edges:
                if any(back[0] == r for back in waited.get(s, ())):
                    continue  # each waited on the other somewhere
                out[r] = (f"rank {r} arrives late at its collectives because it waits on rank {s}: on comm {comm} "
                          f"rank {s} arrived last in {s_hits} of its last {s_calls} calls, rank {r} in {r_hits}; "
                          "not counted as slow compute")
                break
        return out
