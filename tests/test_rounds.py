"""Fail-slow rounds: the group flagged most over N aggregation rounds is the degrader."""

from __future__ import annotations

import pytest
from rankscope.analyzers.findings import SuspectKind
from rankscope.analyzers.rounds import FailSlowRounds
from rankscope.analyzers.suspects import StackAnalysis, analyze_stacks
from rankscope.snapshot import Layout

from tests.stack_fixtures import COMPUTE, OPTIMIZER, RECV, rank_stacks, snapshot

LAYOUT = Layout(tp=2, pp=2, dp=4, ranks_per_machine=2)  # rank = tp + 2*(dp + 4*pp)


def _round(slow: dict[int, list[str]]) -> StackAnalysis:
    stacks = {r: rank_stacks(r, slow.get(r, OPTIMIZER)) for r in range(16)}
    return analyze_stacks(snapshot(stacks, 16, 2, LAYOUT))


# The degrader: PP groups of dp=1 (ranks 2,3 and 10,11 on node1 and node5), caught waiting in
# their pipeline in most rounds; one round catches an unrelated rank instead, one sees nothing.
SLOW_PIPELINE = {2: RECV, 3: RECV, 10: RECV, 11: RECV}
ROUNDS = [SLOW_PIPELINE, {7: COMPUTE}, SLOW_PIPELINE, {}, SLOW_PIPELINE]


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
    assert degrader.score == pytest.approx(3 / 5)
    assert degrader.sources == ("fail-slow-rounds",)
    assert degrader.evidence[0].startswith("pp ranks 2-3,10-11 on node1, node5 flagged in 3 of the last 5 rounds")
    history = rounds.history
    assert [r.outliers for r in history] == [4, 1, 4, 0, 4]
    assert history[3].flagged is None
    assert [(s.ranks, n) for s, n in rounds.counts()] == [((2, 3, 10, 11), 3), ((7,), 1)]


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
