"""Aegis §4.2 / §5.2 over counters: who lags, who has requests stuck, who is slow."""

from __future__ import annotations

from rankscope.analyzers.ccl import analyze_counters, comm_rows, counter_findings
from rankscope.analyzers.degradation import degradation_findings
from rankscope.analyzers.findings import Suspect, SuspectKind, Verdict
from rankscope.analyzers.verdict import merge_verdicts
from rankscope.contract.snapshot import (
    Communicator,
    Instant,
    JobSnapshot,
    MachineSnapshot,
    OpCounters,
    RankCounters,
    RankInfo,
)

PP = Communicator("1", "gloo", "PIPELINE_MODEL_PARALLEL_GROUP", (0, 1, 2, 3))


def rc(rank: int, ops: list[OpCounters], comms: tuple[Communicator, ...] = (PP,), **kw: object) -> RankCounters:
    return RankCounters(rank=rank, pid=100 + rank, world_size=4, job_id="j", heartbeat_wall=1.0,
                        communicators=comms, ops=tuple(ops), **kw)  # type: ignore[arg-type]


def ar(cl: int, wc: int | None = None, td: float = 0.01, ring: tuple[float, ...] = (1e9,)) -> OpCounters:
    return OpCounters("1", "all_reduce", cl, cl, cl if wc is None else wc, last_duration_s=td, recent_throughput=ring)


def snapshot(counters: list[RankCounters]) -> JobSnapshot:
    machines = tuple(MachineSnapshot(f"m{r // 2}", "127.0.0.1:1", True, Instant(1.0, 1.0),
                                     ranks=tuple(RankInfo(rank=x, local_rank=x % 2, world_size=4, pid=100 + x)
                                                 for x in (r, r + 1)),
                                     counters=tuple(c for c in counters if c.rank in (r, r + 1)))
                     for r in (0, 2))
    return JobSnapshot(Instant(1.0, 1.0), machines)


def test_lagging_rank_is_the_computation_side_suspect() -> None:
    counters = {0: rc(0, [ar(10, wc=9)]), 1: rc(1, [ar(10, wc=9)]), 2: rc(2, [ar(9)]), 3: rc(3, [ar(10, wc=9)])}
    (top, *_rest) = counter_findings(counters, {2: "m1"})
    assert top.ranks == (2,) and top.machines == ("m1",) and top.sources == ("ccl",)
    assert "CL 9 < 10" in top.evidence[0] and "PIPELINE_MODEL_PARALLEL_GROUP" in top.evidence[0]
    (rows,) = comm_rows(counters.values()).values()
    assert [(r.rank, r.cl, r.wr, r.wc) for r in rows] == [(0, 10, 10, 9), (1, 10, 10, 9), (2, 9, 9, 9), (3, 10, 10, 9)]
    assert [r.rank for r in rows if r.lags] == [2]
    assert [r.rank for r in rows if r.open_requests] == [0, 1, 3]


def test_a_one_call_skew_without_waiters_is_not_a_finding() -> None:
    counters = {0: rc(0, [ar(10)]), 1: rc(1, [ar(9)]), 2: rc(2, [ar(10)]), 3: rc(3, [ar(10)])}
    assert counter_findings(counters) == ()


def test_open_p2p_request_names_the_pair_and_the_peer_that_never_posted() -> None:
    recv = OpCounters("1", "recv", 3, 3, 2, open_peers=(0,))
    send0 = OpCounters("1", "send", 2, 2, 2)
    counters = {0: rc(0, [ar(5), send0]), 1: rc(1, [ar(5), recv]), 2: rc(2, [ar(5)]), 3: rc(3, [ar(5)])}
    (top,) = counter_findings(counters)
    assert top.ranks == (0, 1)
    assert "WC 2 < WR 3" in top.evidence[0] and "rank 0 has no open send to rank 1" in top.evidence[0]


def test_collective_stuck_with_everyone_launched_is_communication_side() -> None:
    counters = {r: rc(r, [ar(7, wc=6 if r == 3 else 7)]) for r in range(4)}
    (top,) = counter_findings(counters)
    assert top.ranks == (3,) and "every member launched" in top.evidence[0]


def test_verdict_notes_stale_and_corrupt_files_and_missing_ranks() -> None:
    bad = RankCounters(rank=1, pid=None, world_size=None, job_id=None, heartbeat_wall=None, error="truncated")
    old = rc(2, [ar(3)], stale=True, stale_reason="process 102 is gone")
    v = analyze_counters(snapshot([rc(0, [ar(3)]), bad, old]))
    assert v.missing_ranks == (3,)
    assert any("truncated" in n for n in v.notes) and any("102 is gone" in n for n in v.notes)
    assert v.suspects == ()


def test_ccl_and_stack_verdicts_agreeing_rank_first() -> None:
    counters = [rc(0, [ar(10, wc=9)]), rc(1, [ar(9)]), rc(2, [ar(10, wc=9)]), rc(3, [ar(10, wc=9)])]
    ccl = analyze_counters(snapshot(counters))
    stacks = Verdict((Suspect(SuspectKind.RANK, (3,), ("m1",), 0.9, ("stack outlier",), ("stacks",)),
                      Suspect(SuspectKind.RANK, (1,), ("m0",), 0.8, ("stack outlier",), ("stacks",))), "stacks")
    merged = merge_verdicts(stacks, ccl)
    assert merged.top is not None and merged.top.ranks == (1,) and set(merged.top.sources) == {"stacks", "ccl"}


def test_short_td_marks_the_late_arriver_and_large_n_the_slow_link() -> None:
    tds = {0: 0.100, 1: 0.100, 2: 0.010, 3: 0.100}
    rings = {0: (1e9,) * 5, 1: (1e9,) * 5, 2: (1e9,) * 5, 3: (1e8,) * 5}
    counters = {r: rc(r, [ar(4, td=tds[r], ring=rings[r])]) for r in range(4)}
    kinds = {(f.kind, f.rank) for f in degradation_findings(counters)}
    assert kinds == {("slow_compute", 2), ("slow_link", 3)}
    # a rank one call ahead is not compared with the others
    counters[2] = rc(2, [ar(5, td=0.010)])
    assert {(f.kind, f.rank) for f in degradation_findings(counters)} == {("slow_link", 3)}


def test_a_stalled_pipeline_stage_names_the_rank_that_started_it_and_its_lagging_partners_wait_on_it() -> None:
    # The drill's hang-p2p at rank 6 (TP=2 PP=2 DP=2, two ranks a machine): rank 6 never posts the send rank 2
    # waits for; its TP peer 7, rank 2's TP peer 3 and every DP peer then wait in all-reduces that ranks 2, 3, 6
    # and 7 never launch, each lag scoring as high as rank 6's own. Only rank 6 waits for nobody.
    comms = {name: Communicator(name, "gloo", desc, ranks) for name, desc, ranks in [
        ("tp23", "TENSOR_MODEL_PARALLEL_GROUP", (2, 3)), ("tp67", "TENSOR_MODEL_PARALLEL_GROUP", (6, 7)),
        ("dp02", "DATA_PARALLEL_GROUP", (0, 2)), ("dp13", "DATA_PARALLEL_GROUP", (1, 3)),
        ("dp46", "DATA_PARALLEL_GROUP", (4, 6)), ("dp57", "DATA_PARALLEL_GROUP", (5, 7)),
        ("pp26", "PIPELINE_MODEL_PARALLEL_GROUP", (2, 6))]}

    def op(comm: str, name: str, cl: int, waiting: bool = False, peers: tuple[int, ...] = ()) -> OpCounters:
        return OpCounters(comm, name, cl, cl, cl - 1 if waiting else cl, open_peers=peers)

    ops: dict[int, list[OpCounters]] = {
        0: [op("dp02", "all_reduce", 21, waiting=True)], 1: [op("dp13", "all_reduce", 21, waiting=True)],
        4: [op("dp46", "all_reduce", 21, waiting=True)], 5: [op("dp57", "all_reduce", 21, waiting=True)],
        2: [op("tp23", "all_reduce", 328), op("dp02", "all_reduce", 20), op("pp26", "recv", 81, True, (6,))],
        3: [op("tp23", "all_reduce", 329, waiting=True), op("dp13", "all_reduce", 20)],
        6: [op("tp67", "all_reduce", 330), op("dp46", "all_reduce", 20), op("pp26", "send", 80)],
        7: [op("tp67", "all_reduce", 331, waiting=True), op("dp57", "all_reduce", 20)],
    }
    counters = {r: rc(r, o, tuple(c for c in comms.values() if r in c.ranks)) for r, o in ops.items()}
    placement = {r: f"machine-{r // 2}" for r in range(8)}
    top, *rest = counter_findings(counters, placement)
    assert top.ranks == (6,) and top.machines == ("machine-3",)
    assert top.victims == (0, 1, 2, 3, 4, 5, 7)
    assert any("waits on it: rank 2: all_reduce CL 328 < 329" in e for e in top.evidence)
    # what is left is rank 6 again (the pair of the unposted send), never a suspect made only of its victims
    assert all(6 in s.ranks for s in rest), rest
    machines = tuple(MachineSnapshot(f"machine-{m}", f"127.0.0.1:{m}", True, Instant(1.0, 1.0),
                                     ranks=tuple(RankInfo(rank=r, local_rank=r % 2, world_size=8, pid=100 + r)
                                                 for r in (2 * m, 2 * m + 1)),
                                     counters=tuple(counters[r] for r in (2 * m, 2 * m + 1)))
                     for m in range(4))
    verdict = merge_verdicts(analyze_counters(JobSnapshot(Instant(1.0, 1.0), machines)))
    assert verdict.suspects[0].ranks == (6,) and verdict.suspects[0].machines == ("machine-3",)
