"""The fail-slow verdict's words agree with what it names: its lead evidence is about the rank it names, and a rank
slow in its own send (the slow link between it and the ranks waiting) is worded as communication slow.

Both from the drills: on a thermal drill the verdict named rank 7 (the sampled stacks and the counters agreed) but
led with the counters' line about rank 6, its machine's other late rank; the slow-comm drill's rank, whose sends
were delayed, was called "non-communication slow" like a rank that computes slowly.
"""

from __future__ import annotations

import dataclasses

from rankscope.analyzers.failslow import FailSlowDetector
from rankscope.analyzers.failslow_config import DEFAULT_WEIGHTS, FailSlowConfig
from rankscope.analyzers.failslow_vote import FailSlowVerdict
from rankscope.analyzers.stack_samples import RankWaits, SampledWaitResult, waits_in_its_send
from rankscope.contract.snapshot import JobSnapshot, OpCounters, StackSampleWindow
from series_fixtures import Ops, make_series

# rank -> samples per one-second window: (in a collective, in a send/recv, computing)
Shares = dict[int, tuple[int, int, int]]
WAITING = (60, 33, 7)  # a healthy rank waits for its peers ~93 % of the time (the drills' peers)


def with_samples(snaps: list[JobSnapshot], shares: Shares) -> list[JobSnapshot]:
    """Each snapshot with one sampled window per rank of the second before it."""
    out = []
    for s in snaps:
        wall = s.captured.wall
        machines = tuple(dataclasses.replace(m, samples=tuple(
            StackSampleWindow(ri.rank, 1000 + ri.rank, wall - 1.0, wall, *shares.get(ri.rank, WAITING))
            for ri in m.ranks)) for m in s.machines)
        out.append(dataclasses.replace(s, machines=machines))
    return out


def late_at(late: dict[str, int]) -> Ops:
    """All 8 ranks on one all-reduce communicator per entry of ``late``; on each, its rank comes last to every
    call (it spent far less time in the collective than the others)."""

    def ops(t: int, r: int) -> tuple[OpCounters, ...]:
        return tuple(OpCounters(comm, "all_reduce", t + 1, t + 1, t + 1,
                                last_duration_s=0.05 if r == rank else 0.20 + 0.002 * ((r + t) % 5),
                                recent_throughput=(1e8,) * 5) for comm, rank in late.items())
    return ops


def run(snaps: list[JobSnapshot], config: FailSlowConfig | None = None) -> FailSlowVerdict:
    det = FailSlowDetector(config)
    verdict = None
    for s in snaps:
        verdict = det.update(s)
    assert verdict is not None
    return verdict


def test_the_lead_evidence_is_about_the_rank_the_verdict_names() -> None:
    """Ranks 6 and 7 (machine m3) each come last on one communicator, so the counters blame both; the samples name
    rank 7 alone. The verdict names rank 7, and the counters' line that leads it is rank 7's, not rank 6's."""
    # the counters lead (the samples weigh less here), as on the thermal drill
    config = FailSlowConfig(weights={**DEFAULT_WEIGHTS, "samples": 0.5})
    snaps = with_samples(make_series(40, ops=late_at({"c0": 6, "c1": 7})), {7: (20, 20, 60)})
    verdict = run(snaps, config)
    top = verdict.verdict.top
    ccl = [f for f in verdict.flags if f.detector == "ccl" and f.machine == "m3"]
    assert ccl and ccl[0].ranks == (6, 7), "both of m3's late ranks are blamed by the counters"
    assert top is not None and top.machines == ("m3",) and top.ranks == (7,)
    assert top.sources[0] == "ccl", top.sources
    assert top.evidence[0].startswith("[ccl] rank 7 arrived last in 20 of its last 20 collectives on comm c1"), \
        top.evidence
    assert "rank 6" not in top.evidence[0]
    summary = verdict.verdict.summary
    assert summary.startswith("fail-slow: rank 7 (GPU 1, assumed from its local rank) on m3 (non-communication slow)"
                              " — [ccl] rank 7 arrived last"), summary


def test_a_suspect_naming_every_blamed_rank_keeps_all_their_evidence() -> None:
    verdict = run(make_series(40, ops=late_at({"c0": 6, "c1": 7})))
    top = verdict.verdict.top
    assert top is not None and top.ranks == (6, 7)
    assert top.evidence[0].startswith("[ccl] rank 6 arrived last") and "rank 7" not in top.evidence[0]


def pipeline_waits_on(rank: int, peer: int) -> Ops:
    """Rank ``peer``'s recv open on ``rank`` at every poll (the pipeline waits on its send), beside one all-reduce
    communicator at which ``rank`` comes last (its replica waits on it at the gradient all-reduce)."""
    collective = late_at({"c0": rank})

    def ops(t: int, r: int) -> tuple[OpCounters, ...]:
        recv = (OpCounters("p", "recv", t + 2, t + 2, t + 1, open_peers=(rank,)),) if r == peer else ()
        return collective(t, r) + recv
    return ops


def test_a_rank_slow_in_its_send_is_communication_slow() -> None:
    """The slow-comm drill: rank 6's sends are delayed. The pipeline waits on it and it comes last to its
    collectives, as a slow computer would, but it does not compute: its own samples wait as much as its peers wait
    (96 % against their 93 %), more of them in its send (56 % against their 33 %). That is the link between it and
    the ranks waiting."""
    snaps = with_samples(make_series(40, ops=pipeline_waits_on(6, 2)), {6: (40, 56, 4)})
    verdict = run(snaps)
    top = verdict.verdict.top
    assert verdict.confident and top is not None and top.ranks == (6,), verdict.verdict.summary
    assert set(top.sources) == {"ccl", "p2p_wait"}
    assert "(communication slow)" in verdict.verdict.summary, verdict.verdict.summary


def test_the_same_waits_on_a_rank_that_computes_are_non_communication_slow() -> None:
    """The slow-compute control: the same counters, but rank 6 computes half its time (its samples wait 50 %)."""
    snaps = with_samples(make_series(40, ops=pipeline_waits_on(6, 2)), {6: (25, 25, 50)})
    verdict = run(snaps)
    top = verdict.verdict.top
    assert verdict.confident and top is not None and top.ranks == (6,), verdict.verdict.summary
    assert "(non-communication slow)" in verdict.verdict.summary, verdict.verdict.summary


def test_without_samples_the_counters_alone_say_non_communication_slow() -> None:
    verdict = run(make_series(40, ops=pipeline_waits_on(6, 2)))
    assert verdict.verdict.top is not None and verdict.verdict.top.ranks == (6,)
    assert "(non-communication slow)" in verdict.verdict.summary, verdict.verdict.summary


def _waits(rank: int, samples: int, waiting: float, p2p: float) -> RankWaits:
    """A rank's classified samples: ``waiting`` of them waiting for peers, ``p2p`` of them in a send/recv."""
    n_wait, n_p2p = round(waiting * samples), round(p2p * samples)
    return RankWaits(rank, samples, n_wait, (("collective", n_wait - n_p2p), ("p2p", n_p2p),
                                              ("compute", samples - n_wait)))


def _result(rank: RankWaits, waiting: float = 0.926, p2p: float = 0.311) -> SampledWaitResult:
    """``rank`` among 7 peers of 121 samples each (the drills' 45 s), who wait ``waiting``, ``p2p`` in a send/recv."""
    return SampledWaitResult((rank, *(_waits(r, 121, waiting, p2p) for r in range(1, 8))), (), 10, 45.0)


def test_a_rank_in_its_send_is_told_from_one_that_computes_or_shares_a_noisy_machine() -> None:
    """The drills' figures over 45 s of samples (slow-comm, cpu-contention, thermal, slow compute)."""
    assert waits_in_its_send(_result(_waits(0, 121, 0.917, 0.769)), (0,))  # slow-comm: waits, in its send
    assert not waits_in_its_send(_result(_waits(0, 243, 0.872, 0.218), 0.928, 0.355), (0,))  # cpu-contention
    assert not waits_in_its_send(_result(_waits(0, 220, 0.591, 0.368), 0.929, 0.300), (0,))  # thermal: computes
    assert not waits_in_its_send(_result(_waits(0, 122, 0.492, 0.189), 0.918, 0.306), (0,))  # slow compute
    # in its send more than its peers, but waiting far less: it computes slowly too
    assert not waits_in_its_send(_result(_waits(0, 121, 0.80, 0.70)), (0,))
    assert not waits_in_its_send(_result(_waits(0, 10, 0.9, 0.4)), (0,)), "ten samples are too few to tell"
    assert not waits_in_its_send(_result(_waits(0, 121, 0.917, 0.769)), (9,)), "a rank never sampled says nothing"
    assert not waits_in_its_send(SampledWaitResult((_waits(0, 121, 0.917, 0.769),), (), 1, 45.0), (0,)), \
        "no peers sampled"


def test_a_late_arriver_alone_that_waits_like_its_peers_stays_non_communication_slow() -> None:
    """Only the pipeline's waits on a rank's send say its slowness is in that send: the counters' late arrival
    alone (early in the slow drills it blamed a rank that merely waited) keeps the late arriver's kind."""
    verdict = run(with_samples(make_series(40, ops=late_at({"c0": 6})), {6: (40, 56, 4)}))
    top = verdict.verdict.top
    assert top is not None and top.ranks == (6,) and top.sources == ("ccl",)
    assert "(non-communication slow)" in verdict.verdict.summary, verdict.verdict.summary
