"""Fail-slow rounds: the group flagged most over N aggregation rounds is the degrader."""

from __future__ import annotations

from dataclasses import replace

import pytest
from rankscope.analyzers.analysis import analyze_job
from rankscope.analyzers.failslow import replay
from rankscope.analyzers.findings import SuspectKind
from rankscope.analyzers.rounds import FailSlowRounds, StackRound, round_of
from rankscope.contract.snapshot import Instant, JobSnapshot, Layout
from stack_fixtures import COMPUTE, NOW, OPTIMIZER, RECV, rank_stacks, snapshot

LAYOUT = Layout(tp=2, pp=2, dp=4, ranks_per_machine=2)  # rank = tp + 2*(dp + 4*pp)


def _round(slow: dict[int, list[str]]) -> StackRound:
    stacks = {r: rank_stacks(r, slow.get(r, OPTIMIZER)) for r in range(16)}
    return round_of(analyze_job(snapshot(stacks, 16, 2, LAYOUT)))


# The degrader: PP groups of dp=1 (ranks 2,3 and 10,11 on node1 and node5), caught waiting in
# their pipeline in most rounds; one round catches an unrelated rank instead.
SLOW_PIPELINE = {2: RECV, 3: RECV, 10: RECV, 11: RECV}
ROUNDS = [SLOW_PIPELINE, {7: COMPUTE}, SLOW_PIPELINE, SLOW_PIPELINE, SLOW_PIPELINE]
# Three of five, one round seeing nothing: the most flagged group, but no clear majority.
THREE_OF_FIVE = [SLOW_PIPELINE, {7: COMPUTE}, SLOW_PIPELINE, {}, SLOW_PIPELINE]


def test_degrader_is_the_group_flagged_most_after_five_rounds() -> None:
    rounds = FailSlowRounds()
    assert rounds.rounds == 5 and rounds.interval_s == 10.0
    for i, slow in enumerate(ROUNDS):
        assert rounds.flagged() is None, f"no verdict before round 5 (after {i})"
        rounds.add_round(_round(slow))
    degrader = rounds.flagged()
    assert degrader is not None
    assert degrader.kind is SuspectKind.PP
    assert degrader.ranks == (2, 3, 10, 11)
    assert degrader.machines == ("node1", "node5")
    assert degrader.score == pytest.approx(4 / 5)
    assert degrader.sources == ("fail-slow-rounds",)
    assert degrader.evidence[0] == ("PP groups #2 and #3 (ranks 2-3,10-11) on node1, node5 flagged in 4 of the last 5 "
                                    "rounds; next: rank 7 (1)")  # named as every suspect is (labels), never "rank ranks"
    history = rounds.history
    assert [r.outliers for r in history] == [4, 1, 4, 4, 4]
    assert [(s.ranks, n) for s, n in rounds.counts()] == [((2, 3, 10, 11), 4), ((7,), 1)]


def test_three_of_five_is_no_majority() -> None:
    rounds = FailSlowRounds()
    for slow in THREE_OF_FIVE:
        rounds.add_round(_round(slow))
    assert rounds.done and rounds.flagged() is None
    assert [r.outliers for r in rounds.history] == [4, 1, 4, 0, 4] and rounds.history[3].flagged is None
    assert [(s.ranks, n) for s, n in rounds.counts()] == [((2, 3, 10, 11), 3), ((7,), 1)]


def _recording(rounds: list[dict[int, list[str]]]) -> list[JobSnapshot]:
    """One capture every 10 s, as `rankscope watch --record` writes them."""
    out = []
    for i, slow in enumerate(rounds):
        snap = snapshot({r: rank_stacks(r, slow.get(r, OPTIMIZER)) for r in range(16)}, 16, 2, LAYOUT)
        at = Instant(NOW.wall + 10 * i, NOW.mono + 10 * i)
        out.append(replace(snap, captured=at, machines=tuple(replace(m, captured=at) for m in snap.machines)))
    return out


@pytest.mark.parametrize("recording, named", [(ROUNDS, (2, 3, 10, 11)), (THREE_OF_FIVE, None)])
def test_analyze_and_watch_give_one_recording_the_same_answer(recording: list[dict[int, list[str]]],
                                                              named: tuple[int, ...] | None) -> None:
    """`analyze` counts rounds with FailSlowRounds, `watch` and the TUI with the fail-slow detector: one rule."""
    snaps = _recording(recording)
    rounds = FailSlowRounds()
    for snap in snaps:
        rounds.add_round(round_of(analyze_job(snap, LAYOUT)))
    by_analyze = rounds.flagged()
    last = replay(snaps, layout=LAYOUT)[-1]
    alarmed = {f.ranks for f in last.flags if f.detector == "stacks" and f.alarmed}
    assert (by_analyze.ranks if by_analyze is not None else None) == named
    # the detector names the group per machine, each with that machine's ranks of it
    assert (tuple(sorted(r for ranks in alarmed for r in ranks)) if alarmed else None) == named


def test_only_the_last_n_rounds_count() -> None:
    rounds = FailSlowRounds(rounds=3, interval_s=2.0)
    for slow in [{7: COMPUTE}, {7: COMPUTE}, {7: COMPUTE}, SLOW_PIPELINE, SLOW_PIPELINE]:
        rounds.add_round(_round(slow))
    degrader = rounds.flagged()
    assert degrader is not None and degrader.ranks == (2, 3, 10, 11)
    assert degrader.score == pytest.approx(2 / 3)


def test_quiet_rounds_name_nobody() -> None:
    rounds = FailSlowRounds(rounds=2)
    rounds.add_round(_round({}))
    rounds.add_round(_round({}))
    assert rounds.done and rounds.flagged() is None


@pytest.mark.parametrize("n, interval", [(0, 10.0), (5, 0.0)])
def test_bad_settings_are_refused(n: int, interval: float) -> None:
    with pytest.raises(ValueError, match="must be"):
        FailSlowRounds(rounds=n, interval_s=interval)
