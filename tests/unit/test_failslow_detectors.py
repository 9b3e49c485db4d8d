"""The fail-slow detectors on constructed series: noise must not alarm, a slow machine must.

Every series is built from seeded random noise around a healthy level, one
snapshot per second, four machines of two ranks each. Faults are added on top:
a one-sample spike, a burst shorter than the continuity window, and a
persistently slow machine (1.5× step time, +30% CPU, a hotter GPU).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

import numpy as np
import pytest
from rankscope.analyzers.call_tally import narrow_to_common_end
from rankscope.analyzers.failslow import FailSlowDetector, replay
from rankscope.analyzers.failslow_config import FailSlowConfig
from rankscope.analyzers.failslow_vote import DetectorFlag, FailSlowVerdict
from rankscope.analyzers.failslow_words import slow_kind
from rankscope.analyzers.findings import Suspect, SuspectKind
from rankscope.analyzers.metric_outliers import MetricOutlierDetector
from rankscope.analyzers.minder import MinderDetector, denoise
from rankscope.analyzers.rounds import StackRound
from rankscope.analyzers.series import SeriesStore
from rankscope.analyzers.step_time import StepTimeDetector
from rankscope.contract.snapshot import (
    Communicator,
    Instant,
    JobSnapshot,
    MachineSnapshot,
    OpCounters,
    RankCounters,
)
from series_fixtures import (
    BURST,
    MACHINES,
    SLOW_ALL,
    SLOW_STEP,
    SPIKE,
    Ops,
    combine,
    make_series,
    slow_machine,
)


def run_detector(snaps: list[JobSnapshot], config: FailSlowConfig | None = None) -> list[FailSlowVerdict]:
    det = FailSlowDetector(config)
    return [det.update(s) for s in snaps]


# ---- series --------------------------------------------------------------


def test_series_builds_machine_matrices_and_step_times() -> None:
    snaps = make_series(5)
    store = SeriesStore()
    for s in snaps:
        assert store.add(s)
    assert not store.add(snaps[2]), "an older snapshot must be ignored"
    t, machines, cpu = store.matrix("proc_cpu_percent")
    assert machines == MACHINES and cpu.shape == (5, 4)
    assert np.allclose(t, [100, 101, 102, 103, 104])
    assert np.all(np.abs(cpu / 60.0 - 1) < 0.2)
    _, _, temp = store.matrix("gpu_temperature_c")
    assert np.all(temp > 50)
    steps = store.latest_rank_steps()
    assert sorted(steps) == list(range(8)) and all(abs(v - 0.5) < 0.1 for v in steps.values())
    assert store.ranks_of("m3") == (6, 7)
    with pytest.raises(KeyError):
        store.matrix("nope")


def test_series_marks_unreachable_machines_missing_not_zero() -> None:
    snaps = make_series(4, unreachable=lambda t, m: m == "m3" and t >= 2)
    store = SeriesStore()
    for s in snaps:
        store.add(s)
    _, machines, cpu = store.matrix("host_cpu_percent")
    assert machines == MACHINES, "the address of an unreachable agent maps back to its machine"
    col = machines.index("m3")
    assert np.isfinite(cpu[:2, col]).all() and np.isnan(cpu[2:, col]).all()
    assert store.missing_machines == ("m3",) and store.reachable_machines == ("m0", "m1", "m2")


def test_step_time_derived_from_step_counter_and_grows_while_stuck() -> None:
    def snap(t: float, steps: int, dur: float | None) -> JobSnapshot:
        c = RankCounters(0, 1, 1, "j", t, steps=steps, last_step_duration_s=dur)
        return JobSnapshot(Instant(t, t), (MachineSnapshot("m0", "a", True, Instant(t, t), counters=(c,)),))

    def steps_after(store: SeriesStore, *snaps: JobSnapshot) -> list[float]:
        out = []
        for s in snaps:
            store.add(s)
            out.append(store.latest_rank_steps().get(0, math.nan))
        return out

    v = steps_after(SeriesStore(), snap(0.0, 0, None), snap(2.0, 4, None),  # 4 steps in 2 s
                    snap(3.0, 6, None))  # 2 steps in 1 s
    assert math.isnan(v[0]) and v[1:] == pytest.approx([0.5, 0.5])
    v2 = steps_after(SeriesStore(), snap(0.0, 10, 0.4), snap(1.0, 11, 0.4),
                     snap(5.0, 11, 0.4))  # no step for 4 s: reported as 4 s, not the stale 0.4
    assert v2 == pytest.approx([0.4, 0.4, 4.0])


# ---- Aegis §5.1 ------------------------------------------------------------


def _outliers(snaps: list[JobSnapshot], window_s: float = 15.0) -> list[tuple[str, str, bool]]:
    store, det, seen = SeriesStore(), MetricOutlierDetector(window_s=window_s), []
    for s in snaps:
        store.add(s)
        seen += [(f.machine, f.metric, f.alarmed) for f in det.update(store)]
    return seen


def test_outliers_ignore_noise_spikes_and_short_bursts() -> None:
    seen = _outliers(make_series(60, combine(SPIKE, BURST)))
    assert not [s for s in seen if s[2]], "nothing may alarm"
    # the burst was seen as a candidate: the detector looked and waited
    assert ("m2", "proc_cpu_percent", False) in seen


def test_outliers_alarm_on_a_persistently_hotter_busier_machine_only_after_the_window() -> None:
    store, det = SeriesStore(), MetricOutlierDetector(window_s=15.0)
    first_alarm: dict[str, float] = {}
    for s in make_series(40, slow_machine("m2", 10, {"proc_cpu": 1.3, "temp": 1.25})):
        store.add(s)
        for f in det.update(store):
            # a healthy machine may look low next to peers that include the hot one
            # for a moment, while the window still holds the healthy past; never for long
            assert f.machine == "m2" or (not f.alarmed and f.side.value == "low"), f
            if f.alarmed:
                assert f.machine == "m2"
                first_alarm.setdefault(f.metric, s.captured.mono)
                assert f.side.value == "high" and f.z > 2 and f.held_s >= 14.7
    assert set(first_alarm) == {"proc_cpu_percent", "gpu_temperature_c"}
    assert all(t >= 100 + 10 + 15 for t in first_alarm.values())


def test_outliers_ignore_a_change_every_machine_goes_through() -> None:
    def everyone_busier(t: int, _m: str) -> dict[str, float]:
        return {"proc_cpu": 1.0 + 0.03 * t, "temp": 1.0 + 0.01 * t}

    assert not [s for s in _outliers(make_series(40, everyone_busier)) if s[2]]


def test_outliers_see_a_throttled_clock_on_the_low_side() -> None:
    store, det = SeriesStore(), MetricOutlierDetector(window_s=10.0)
    alarms = set()
    for s in make_series(30, slow_machine("m0", 5, {"clock": 0.75})):
        store.add(s)
        alarms |= {(f.machine, f.metric, f.side.value) for f in det.update(store) if f.alarmed}
    assert alarms == {("m0", "gpu_sm_clock_mhz", "low")}


# ---- Minder ----------------------------------------------------------------


def _minder(snaps: list[JobSnapshot], continuity_s: float = 15.0) -> list[tuple[str, str, bool]]:
    store, det, seen = SeriesStore(), MinderDetector(continuity_s=continuity_s), []
    for s in snaps:
        store.add(s)
        res = det.update(store)
        seen += [(f.machine, f.metric, f.alarmed) for f in res.findings]
        if res.alarm is not None:
            assert res.alarm.alarmed
    return seen


def test_denoise_removes_a_single_sample_spike() -> None:
    x = np.ones((9, 2))
    x[4, 0] = 5.0
    x[6, 1] = np.nan
    y = denoise(x)
    assert np.allclose(y, 1.0)


def test_minder_ignores_spikes_and_bursts_shorter_than_continuity() -> None:
    seen = _minder(make_series(70, combine(SPIKE, BURST)))
    assert not [s for s in seen if s[2]]
    assert not [s for s in seen if s[0] == "m1"], "a one-sample spike is denoised away"
    assert any(s[0] == "m2" for s in seen), "the burst is a candidate for a while"


def test_minder_alarms_on_the_dissimilar_machine_by_metric_priority() -> None:
    store, det = SeriesStore(), MinderDetector(continuity_s=15.0)
    alarm = None
    for s in make_series(45, slow_machine("m3", 5, {"proc_cpu": 1.3, "temp": 1.25})):
        store.add(s)
        res = det.update(store)
        if res.alarm is not None and alarm is None:
            alarm = res.alarm
            assert s.captured.mono >= 100 + 5 + 15
    assert alarm is not None and alarm.machine == "m3"
    assert alarm.metric == "proc_cpu_percent", "CPU comes before GPU temperature in Minder's priority"
    assert alarm.side == "high" and alarm.separation > 1.5


def test_minder_needs_three_machines() -> None:
    store, det = SeriesStore(), MinderDetector()
    for s in make_series(12, slow_machine("m1", 0, {"proc_cpu": 2.0}), machines=("m0", "m1")):
        store.add(s)
        res = det.update(store)
    assert res.alarm is None and not res.findings and "3 or more" in res.notes[0]


# ---- step time -------------------------------------------------------------


def test_step_time_flags_the_slow_machine_and_its_ranks_and_the_trend_shows_it() -> None:
    store, det = SeriesStore(), StepTimeDetector(window_s=15.0)
    for s in make_series(40, SLOW_STEP):
        store.add(s)
        res = det.update(store)
    assert [(f.machine, f.ranks, f.alarmed) for f in res.findings] == [("m2", (4, 5), True)]
    assert res.findings[0].ratio == pytest.approx(1.5, rel=0.15)
    # the job median is the healthy machines' step; m2 alone moves the mean, not the median
    assert res.trend.baseline_s == pytest.approx(0.5, rel=0.1)
    assert dict(res.per_machine)["m2"] == pytest.approx(0.75, rel=0.15)


def test_step_time_ignores_noise() -> None:
    store, det = SeriesStore(), StepTimeDetector(window_s=15.0)
    for s in make_series(60, combine(SPIKE, BURST)):
        store.add(s)
        assert not [f for f in det.update(store).findings if f.alarmed]


def test_step_trend_rises_when_the_whole_job_slows() -> None:
    def everyone_slower(t: int, _m: str) -> dict[str, float]:
        return {"step": 1.0 + 0.02 * t}

    store, det = SeriesStore(), StepTimeDetector(window_s=15.0)
    for s in make_series(40, everyone_slower):
        store.add(s)
        res = det.update(store)
    assert res.trend.ratio is not None and res.trend.ratio > 1.5
    assert res.trend.slope is not None and res.trend.slope == pytest.approx(0.01, rel=0.3)
    assert not res.findings, "nobody is slower than the others"


# ---- the combined detector -----------------------------------------------


def test_healthy_job_with_noise_bursts_never_alarms() -> None:
    for seed in (1, 2, 3):
        verdicts = run_detector(make_series(80, combine(SPIKE, BURST), seed=seed))
        assert all(not v.verdict.suspects for v in verdicts), [v.verdict.summary for v in verdicts if v.verdict.suspects]
        assert max(v.confidence for v in verdicts) == 0.0
        assert not any(v.confident for v in verdicts)
        assert verdicts[-1].verdict.summary.startswith("no fail-slow: 4 machines")


def test_slow_step_machine_alarms_with_rising_confidence() -> None:
    verdicts = run_detector(make_series(90, SLOW_STEP))
    named = [v for v in verdicts if v.verdict.suspects]
    assert named, "a 1.5× slower machine must alarm"
    assert {v.machine for v in named} == {"m2"}
    assert named[0].verdict.top is not None and named[0].verdict.top.ranks == (4, 5)
    assert named[0].rounds >= 10 + 20, "not before the step window has passed"
    conf = [v.confidence for v in named]
    assert conf[-1] > conf[0] and all(b >= a - 1e-9 for a, b in itertools.pairwise(conf))
    assert named[-1].slow_since_mono is not None and 110 <= named[-1].slow_since_mono <= 112
    assert "m2" in named[-1].verdict.summary and "step_time" in named[-1].verdict.summary


def test_agreeing_detectors_give_more_confidence_than_one() -> None:
    one = run_detector(make_series(90, SLOW_STEP))
    many = run_detector(make_series(90, SLOW_ALL))
    assert many[-1].machine == one[-1].machine == "m2"
    assert set(many[-1].verdict.suspects[0].sources) >= {"step_time", "metrics", "minder"}
    assert many[-1].confidence > one[-1].confidence
    assert many[-1].confident and not one[45].confident
    # agreement also gets there sooner
    first = next(i for i, v in enumerate(many) if v.confident)
    assert one[first].confidence < many[first].confidence


def test_unreachable_machine_is_noted_not_a_crash() -> None:
    snaps = make_series(30, SLOW_STEP, unreachable=lambda t, m: m == "m0" and t >= 25)
    verdicts = run_detector(snaps)
    last = verdicts[-1]
    assert last.verdict.missing_ranks == (0, 1)
    assert any("unreachable: m0" in n for n in last.verdict.notes)


def _round(kind: SuspectKind, group: int, ranks: tuple[int, ...], machines: tuple[str, ...]) -> StackRound:
    return StackRound(Suspect(kind, ranks, machines, 1.0, ("outliers",), group_index=group), len(ranks), "x") \
        if group >= 0 else StackRound(None, 0, "ok")


def test_stack_rounds_name_the_most_flagged_group_after_enough_rounds() -> None:
    det = FailSlowDetector(FailSlowConfig(rounds_needed=5))
    snaps = make_series(13)
    pp = _round(SuspectKind.PP, 1, (4, 5, 6, 7), ("m2", "m3"))
    dp = _round(SuspectKind.DP, 0, (0, 2), ("m0", "m1"))
    healthy = _round(SuspectKind.PP, -1, (), ())
    rounds = [pp, None, dp, None, pp, None, healthy, None, pp, None, pp, None, pp]
    verdicts = [det.update(s, r) for s, r in zip(snaps, rounds, strict=True)]
    assert not verdicts[10].verdict.suspects, "3 of 5 rounds is not a clear majority"
    flags = [f for f in verdicts[7].flags if f.detector == "stacks"]
    assert flags and not any(f.alarmed for f in flags), "only 4 rounds so far"
    last = verdicts[-1]
    stacks = [f for f in last.flags if f.detector == "stacks"]
    assert {f.machine for f in stacks} == {"m2", "m3"} and all(f.alarmed for f in stacks)
    assert {f.ranks for f in stacks} == {(4, 5), (6, 7)}
    assert stacks[0].evidence == "PP group #1 (ranks 4-7) flagged in 4 of the last 5 stack rounds"
    # one suspect: the group, on both its machines (over-eviction), not two machines
    top = last.verdict.top
    assert len(last.verdict.suspects) == 1 and top is not None
    assert top.kind is SuspectKind.PP and top.group_index == 1 and top.ranks == (4, 5, 6, 7)
    assert set(top.machines) == {"m2", "m3"} and set(last.machines) == {"m2", "m3"}
    assert last.verdict.summary.startswith("suspect, not a verdict: PP group #1 (ranks 4-7) on m")  # 0.64 < the bar


def test_stack_rounds_need_a_majority() -> None:
    det = FailSlowDetector(FailSlowConfig(rounds_needed=5))
    pp = _round(SuspectKind.PP, 1, (4, 5, 6, 7), ("m2", "m3"))
    dp = _round(SuspectKind.DP, 0, (0, 2), ("m0", "m1"))
    healthy = _round(SuspectKind.PP, -1, (), ())
    verdicts = [det.update(s, r) for s, r in zip(make_series(5), [pp, healthy, dp, pp, pp], strict=True)]
    stacks = [f for f in verdicts[-1].flags if f.detector == "stacks"]
    assert stacks and not any(f.alarmed for f in stacks), "3 of 5 rounds is timing noise, not a degrader"
    assert not verdicts[-1].verdict.suspects
    assert verdicts[-1].verdict.summary.endswith("flagged in 3 of the last 5 stack rounds (alarms at 4 of 5 rounds)")


def _allreduce(late: Callable[[int], int | None], slow_link: int | None = None, comms: int = 1) -> Ops:
    """Every rank on ``comms`` all-reduce communicators of all 8 ranks; call t+1 completed at time t.

    ``late(t)`` is the rank that came last to call t: it spent far less time in
    the collective. A slow-link rank moves its bytes at a third of the others' rate.
    """
    rng = np.random.default_rng(3)

    def ops(t: int, r: int) -> tuple[OpCounters, ...]:
        out = []
        for c in range(comms):
            td = 0.05 if r == late(t) else 0.20 * (1 + 0.05 * rng.standard_normal())
            rate = 1e8 / 3 if r == slow_link else 1e8 * (1 + 0.05 * rng.standard_normal())
            out.append(OpCounters(f"c{c}", "all_reduce", t + 1, t + 1, t + 1, last_duration_s=td,
                                  recent_throughput=(rate,) * 5))
        return tuple(out)
    return ops


def test_ccl_late_arriver_is_blamed_once_it_is_late_call_after_call() -> None:
    verdicts = run_detector(make_series(20, ops=_allreduce(late=lambda _t: 5)))
    assert not any(f.detector == "ccl" for v in verdicts[:14] for f in v.flags), "fourteen calls are not enough"
    assert all([(f.machine, f.ranks) for f in v.flags if f.detector == "ccl"] == [("m2", (5,))] for v in verdicts[14:])
    assert verdicts[14].machine == "m2" and verdicts[-1].confidence > verdicts[14].confidence
    top = verdicts[-1].verdict.top
    assert top is not None and top.evidence[0].startswith(
        "[ccl] rank 5 arrived last in 20 of its last 20 collectives on comm c0")
    assert not verdicts[-1].confident, "the late-arriver test alone is never confident"


def test_ccl_a_different_late_arriver_each_call_blames_nobody() -> None:
    """Someone is always last; in a healthy job it is not always the same rank."""
    verdicts = run_detector(make_series(30, ops=_allreduce(late=lambda t: (t * 3) % 8)))
    assert not any(f.detector == "ccl" for v in verdicts for f in v.flags)
    assert not any(v.verdict.suspects for v in verdicts)


def test_ccl_repeated_polls_of_one_call_count_once() -> None:
    snaps = make_series(20, ops=_allreduce(late=lambda _t: 5))
    # the same call (t=0) seen by ten polls: still one call
    frozen = [dataclasses.replace(s, machines=snaps[0].machines) for s in snaps]
    verdicts = run_detector(frozen)
    assert not any(f.detector == "ccl" for v in verdicts for f in v.flags)


def test_ccl_healthy_counters_with_noise_blame_nobody() -> None:
    verdicts = run_detector(make_series(30, ops=_allreduce(late=lambda _t: None)))
    assert not any(f.detector == "ccl" for v in verdicts for f in v.flags)


def test_ccl_slow_links_narrow_to_the_shared_rank() -> None:
    verdicts = run_detector(make_series(20, ops=_allreduce(late=lambda _t: None, slow_link=6, comms=2)))
    last = verdicts[-1]
    assert last.machine == "m3" and last.verdict.top is not None and last.verdict.top.ranks == (6,)
    assert "share rank 6" in last.verdict.top.evidence[0]


def test_narrow_to_common_end() -> None:
    assert narrow_to_common_end([(1, 2), (2, 3), (2, 4)]) == (2,)
    assert narrow_to_common_end([(1, 2), (3, 4)]) == (), "no shared end: the network, not a host"
    assert narrow_to_common_end([(1, 2)]) == (1, 2)
    assert narrow_to_common_end([(6,), (6,)]) == (6,)
    assert narrow_to_common_end([(1, 2), (3, 4), (1, 5)]) == (1,)


def test_history_keeps_every_round() -> None:
    det = FailSlowDetector(FailSlowConfig(history_len=10))
    snaps = make_series(15)
    for s in snaps:
        det.update(s)
    assert len(det.history) == 10 and det.history[-1].rounds == 15
    assert det.update(snaps[3]) is det.latest, "an old snapshot changes nothing"


def test_replay_gives_the_live_answer_in_any_order() -> None:
    snaps = make_series(60, SLOW_ALL)
    live = run_detector(snaps)
    replayed = replay(list(reversed(snaps)))
    assert [v.confidence for v in replayed] == [v.confidence for v in live]
    assert replayed[-1].machine == "m2"


def test_two_machines_still_name_the_slow_one_without_minder() -> None:
    """With one peer, Minder cannot tell which of two differs; step time and Aegis's one-sided test can."""
    verdicts = run_detector(make_series(60, slow_machine("m1", 5, {"step": 1.5, "temp": 1.25}), machines=("m0", "m1")))
    last = verdicts[-1]
    assert last.machine == "m1" and set(last.verdict.top.sources) == {"step_time", "metrics"}  # type: ignore[union-attr]
    assert any("3 or more machines" in n for n in last.verdict.notes)


# ---- the drill's layout: per-communicator lateness and pipeline waits ------
# Four machines of one TP pair each (ranks 2m, 2m+1); DP groups pair the same
# stage of the two replicas ({0,2}, {1,3}, {4,6}, {5,7}); PP groups pair the
# stages of one replica ({0,4}, {1,5}, {2,6}, {3,7}).

DP_OF = {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3), 4: (4, 6), 6: (4, 6), 5: (5, 7), 7: (5, 7)}
PP_PEER = {r: (r + 4) % 8 for r in range(8)}


def drill_comms(r: int) -> tuple[Communicator, ...]:
    dp = DP_OF[r]
    return (Communicator(f"dp{dp[0]}", "gloo", "DATA_PARALLEL_GROUP", dp),
            Communicator(f"tp{r // 2}", "gloo", "TENSOR_MODEL_PARALLEL_GROUP", (r - r % 2, r - r % 2 + 1)),
            Communicator(f"pp{min(r, PP_PEER[r])}", "gloo", "PIPELINE_MODEL_PARALLEL_GROUP",
                         tuple(sorted((r, PP_PEER[r])))))


def drill_ops(late_dp: Callable[[int], set[int]], late_tp: Callable[[int], set[int]],
              waits: Callable[[int, int], int | None], seed: int = 5) -> Ops:
    """Every rank's gradient all-reduce (DP), tensor all-reduce (TP) and pipeline recv at poll t.

    ``late_dp(t)`` / ``late_tp(t)``: the ranks that came last to call t of their
    DP / TP all-reduce (a much shorter TD). ``waits(t, r)``: the peer rank r's
    open recv waits on at poll t, or None.
    """
    rng = np.random.default_rng(seed)

    def ops(t: int, r: int) -> tuple[OpCounters, ...]:
        def td(late: bool) -> float:
            return 0.05 if late else 0.20 * (1 + 0.05 * rng.standard_normal())

        peer = waits(t, r)
        dp, tp = DP_OF[r], (r - r % 2, r - r % 2 + 1)
        return (
            OpCounters(f"dp{dp[0]}", "all_reduce", t + 1, t + 1, t + 1, last_duration_s=td(r in late_dp(t)),
                       recent_throughput=(1e8,) * 5),
            OpCounters(f"tp{tp[0] // 2}", "all_reduce", 16 * (t + 1), 16 * (t + 1), 16 * (t + 1),
                       last_duration_s=td(r in late_tp(t)), recent_throughput=(1e8,) * 5),
            OpCounters(f"pp{min(r, PP_PEER[r])}", "recv", 4 * t + 1, 4 * t + 1, 4 * t, open_peers=(peer,) if peer is not None else ()),
        )
    return ops


def healthy_waits(seed: int = 11, share: float = 0.25) -> Callable[[int, int], int | None]:
    """Each rank waits on its pipeline peer in about ``share`` of the polls, whichever replica it is in."""
    rng = np.random.default_rng(seed)
    table = rng.random((400, 8)) < share
    return lambda t, r: PP_PEER[r] if table[t, r] else None


def slow_rank_3(t: int, start: int = 0) -> tuple[set[int], set[int], bool]:
    """Rank 3 (m1) computes slowly from ``start``: its replica (ranks 2, 3, 6, 7) arrives late at every
    gradient all-reduce, rank 3 comes last to a third of its TP calls, and rank 7 waits on it in most polls."""
    on = t >= start
    return ({2, 3, 6, 7} if on else set()), ({3} if on and t % 3 == 0 else set()), on


def test_ccl_lateness_is_tallied_per_communicator() -> None:
    """Late at every gradient all-reduce, but only at a third of its TP calls: mixed together the rank
    would be late in two thirds of its calls (below the bar); per communicator the DP story is plain."""
    ops = drill_ops(late_dp=lambda t: {3}, late_tp=lambda t: {3} if t % 3 == 0 else set(), waits=lambda t, r: None)
    verdicts = run_detector(make_series(25, ops=ops, comms=drill_comms))
    ccl = [f for f in verdicts[-1].flags if f.detector == "ccl"]
    assert [(f.machine, f.ranks) for f in ccl] == [("m1", (3,))]
    assert "on comm dp1" in ccl[0].evidence and not verdicts[-1].confident


def test_ccl_low_throughput_while_waiting_on_a_late_arriver_is_no_slow_link() -> None:
    """N is measured per request including the wait: the early arrivers of a call someone came late to
    move their bytes 'slowly' only because they waited."""
    rng = np.random.default_rng(2)

    def ops(t: int, r: int) -> tuple[OpCounters, ...]:
        late = r == 5
        return (OpCounters("c0", "all_reduce", t + 1, t + 1, t + 1, last_duration_s=0.05 if late else 0.2,
                           recent_throughput=(1e8 if late or r != 6 else 1e8 / 3,) * 5),
                OpCounters("c1", "all_reduce", t + 1, t + 1, t + 1,
                           last_duration_s=0.05 if late else 0.2 * (1 + 0.05 * rng.standard_normal()),
                           recent_throughput=(1e8 if r != 6 else 1e8 / 3,) * 5))
    verdicts = run_detector(make_series(20, ops=ops))
    assert not any("slow link" in f.evidence for v in verdicts for f in v.flags)
    assert {f.machine for f in verdicts[-1].flags if f.detector == "ccl"} == {"m2"}, "the late arriver, not rank 6"


def test_p2p_waits_name_the_rank_its_pipeline_peers_wait_on() -> None:
    base = healthy_waits()

    def waits(t: int, r: int) -> int | None:
        return 3 if r == 7 and t >= 10 and t % 10 != 0 else base(t, r)

    verdicts = run_detector(make_series(45, ops=drill_ops(lambda t: set(), lambda t: set(), waits), comms=drill_comms))
    alarmed = [(i, f) for i, v in enumerate(verdicts) for f in v.flags if f.detector == "p2p_wait" and f.alarmed]
    assert alarmed and {f.machine for _, f in alarmed} == {"m1"} and all(f.ranks == (3,) for _, f in alarmed)
    assert alarmed[0][0] >= 29, "20 polls seen, half of them waiting on it, for 10 s"
    assert "peers waited on rank 3" in alarmed[-1][1].evidence and "data-parallel peers (rank 1:" in alarmed[-1][1].evidence
    assert not verdicts[-1].confident, "one detector alone is never confident"


def test_p2p_waits_blame_nobody_without_a_replica_to_compare_with() -> None:
    """DP=1 (each data-parallel group holds its rank alone): nothing says how often the same pipeline place of
    another replica is waited on. On the H200 a healthy 2-stage pipeline had its second stage's recv open on the
    device in 28 of 30 polls, and compared with all ranks the first stage's rank read as slow."""
    base = healthy_waits()

    def waits(t: int, r: int) -> int | None:
        return 3 if r == 7 and t % 10 != 0 else base(t, r)

    def alone(r: int) -> tuple[Communicator, ...]:
        return tuple(Communicator(c.comm_id if "DATA" not in c.description else f"dp-{r}", c.backend, c.description,
                                  (r,) if "DATA" in c.description else c.ranks) for c in drill_comms(r))

    series = make_series(45, ops=drill_ops(lambda t: set(), lambda t: set(), waits), comms=alone)
    assert not any(f.detector == "p2p_wait" for v in run_detector(series) for f in v.flags)


def test_p2p_healthy_waits_and_a_burst_never_alarm() -> None:
    """Peers waiting on each other a quarter of the time, and a 5 s burst (shorter than the 10 s hold)
    in which rank 7 waits on rank 3 in every poll: nothing alarms."""
    base = healthy_waits(share=0.25)

    def burst(t: int, r: int) -> int | None:
        return 3 if r == 7 and 20 <= t < 25 else base(t, r)

    for waits in (base, burst):
        verdicts = run_detector(make_series(60, ops=drill_ops(lambda t: set(), lambda t: set(), waits), comms=drill_comms))
        assert not any(f.detector == "p2p_wait" and f.alarmed for v in verdicts for f in v.flags)
        assert not any(v.verdict.suspects for v in verdicts)


def test_slow_rank_in_a_pipeline_is_named_confidently_by_agreeing_detectors() -> None:
    """The late-arriver test names rank 3's whole replica (m1 and m3); the pipeline waits single out m1."""
    base = healthy_waits()

    def waits(t: int, r: int) -> int | None:
        return 3 if r == 7 and slow_rank_3(t, 5)[2] and t % 7 != 0 else base(t, r)

    ops = drill_ops(lambda t: slow_rank_3(t, 5)[0], lambda t: slow_rank_3(t, 5)[1], waits)
    verdicts = run_detector(make_series(50, ops=ops, comms=drill_comms))
    ccl = {f.machine for f in verdicts[-1].flags if f.detector == "ccl"}
    # The whole slow replica arrives late, but m3's rank 7 only because it waited on rank 3 in its recv.
    assert ccl == {"m1"}, "m3 waits on m1: its lateness is no slow compute"
    assert any(n.startswith("m3 arrives late at its collectives because it waits on m1") for n in verdicts[-1].verdict.notes)
    first = next(i for i, v in enumerate(verdicts) if v.confident)
    assert all(v.machines == ("m1",) for v in verdicts[first:])
    assert set(verdicts[-1].verdict.top.sources) >= {"ccl", "p2p_wait"}  # type: ignore[union-attr]

    # Without the pipeline waits, the replica alone names no machine confidently.
    ops = drill_ops(lambda t: slow_rank_3(t, 5)[0], lambda t: slow_rank_3(t, 5)[1], base)
    assert not any(v.confident for v in run_detector(make_series(50, ops=ops, comms=drill_comms)))


def test_a_late_arriver_waiting_on_its_slow_pipeline_peer_is_not_blamed() -> None:
    """The drill's slow-compute at rank 4 (m2): rank 4 comes last to its gradient all-reduce, and so does
    rank 1 (m0), which waited in its recv for rank 5, rank 4's TP partner. View 7 alarmed "● ccl m0 r1 ...
    (slow compute)" on the healthy machine; m0's ranks wait on m2's in most polls, m2's seldom on m0's."""
    base = healthy_waits(share=0.1)

    def waits(t: int, r: int) -> int | None:
        return PP_PEER[r] if r in (0, 1) and t % 7 != 0 else base(t, r)

    ops = drill_ops(lambda t: {4, 1}, lambda t: {4} if t % 3 == 0 else set(), waits)
    verdicts = run_detector(make_series(40, ops=ops, comms=drill_comms))
    last = verdicts[-1]
    assert {(f.machine, f.ranks) for f in last.flags if f.detector == "ccl"} == {("m2", (4,))}
    note = next(n for n in last.verdict.notes if n.startswith("m0 arrives late"))
    assert "waits on m2" in note and "not counted as slow compute" in note
    assert last.machines == ("m2",)

    # Without the waits the same lateness is blamed on both machines: the rule rests on who waits on whom.
    ops = drill_ops(lambda t: {4, 1}, lambda t: {4} if t % 3 == 0 else set(), base)
    alone = run_detector(make_series(40, ops=ops, comms=drill_comms))[-1]
    assert {f.machine for f in alone.flags if f.detector == "ccl"} == {"m0", "m2"}


# ---- C4's slow kind from host evidence ---------------------------------------------------------------------------


def test_a_machine_slow_by_host_evidence_is_named_with_its_c4_kind() -> None:
    """Step time, the rank's CPU and a hotter GPU: the machine computes slowly and its peers wait for it."""
    last = run_detector(make_series(90, SLOW_ALL))[-1]
    assert last.confident and last.verdict.summary.startswith(
        "fail-slow: machine m2 (ranks 4-5) (non-communication slow) — ["), \
        last.verdict.summary
    below = run_detector(make_series(45, SLOW_STEP))[-1]  # the step time alone, not long enough: a suspicion
    assert not below.confident and below.verdict.summary.startswith(
        "suspect, not a verdict: machine m2 (ranks 4-5) (non-communication slow) — [step_time]"), below.verdict.summary
    assert "confidence 0.52 from step_time, below the 0.70 bar" in below.verdict.summary


def _flag(detector: str, metric: str | None = None, evidence: str = "x", links: tuple[int, ...] = ()) -> DetectorFlag:
    return DetectorFlag(detector, "m2", (4, 5), metric, 0.9, evidence, True, link_ranks=links)


def test_the_c4_kind_follows_the_strongest_evidence() -> None:
    comm, compute = "communication slow", "non-communication slow"
    assert slow_kind(_flag("metrics", "gpu_nvlink_kbps")) == comm  # a link's throughput stands out
    assert slow_kind(_flag("minder", "gpu_pcie_kbps")) == comm
    assert slow_kind(_flag("metrics", "gpu_temperature_c")) == compute
    assert slow_kind(_flag("minder", "proc_cpu_percent")) == compute
    assert slow_kind(_flag("step_time", "step_time_s")) == compute
    # the counters' slow links: their common end is the suspect's rank (typed on the flag, never read from its words)
    assert slow_kind(_flag("ccl", links=(4,)), (4,)) == comm
    assert slow_kind(_flag("ccl", links=(4,))) == comm
    assert slow_kind(_flag("ccl", links=(4,)), (5,)) == compute  # the suspect is the flag's late rank, not the link's end
    assert slow_kind(_flag("ccl", evidence="slow links (N > 1.5·mean) on 2 communicator(s) share rank 4")) == compute
    assert slow_kind(_flag("ccl", evidence="rank 4 arrived last in 9 of its last 10 calls")) == compute
    assert slow_kind(_flag("p2p_wait")) == compute
    # a rank its pipeline peers wait on, that itself waits as much as they do: its send is what is slow
    assert slow_kind(_flag("p2p_wait"), (4,), slow_send=True) == comm
    assert slow_kind(_flag("ccl"), (4,), slow_send=True) == comm
    assert slow_kind(_flag("step_time", "step_time_s"), (4,), slow_send=True) == compute
    # stack rounds: the outliers part from the others in a send (a slow link) or in their own work
    assert slow_kind(_flag("stacks"), frame="isend (torch/distributed/distributed_c10d.py)") == comm
    assert slow_kind(_flag("stacks"), frame="forward (model.py)") == compute
    assert slow_kind(_flag("stacks")) == compute


def test_a_stack_group_parting_in_a_send_is_communication_slow() -> None:
    det = FailSlowDetector(FailSlowConfig(rounds_needed=5))
    pp = StackRound(Suspect(SuspectKind.PP, (4, 5, 6, 7), ("m2", "m3"), 1.0, ("outliers",), group_index=1,
                            diverging_frame="isend (torch/distributed/distributed_c10d.py)"), 4, "x")
    verdicts = [det.update(s, pp) for s in make_series(6)]
    summary = verdicts[-1].verdict.summary
    assert summary.startswith("fail-slow: PP group #1 (ranks 4-7) on m2, m3 (communication slow) — [stacks]"), summary
