"""Fail-slow rounds (ByteRobust §5.1): repeated aggregation names the degrader.

A slow job does not stop, so one capture shows the slow group only by
chance: its ranks are more often caught somewhere else than the others. The
aggregation is therefore repeated (every 10 s by default); each round flags
the parallel group that best explains that round's outliers, and after N
rounds (5 by default) the group flagged most often is the degrader.

One rule (``tally``) decides, for ``rankscope analyze`` and for the
fail-slow detector behind ``watch`` and the TUI, so a recording gets the same
answer from all three: the most flagged group is named once N rounds are in,
when it was flagged in more than ``DEFAULT_MAJORITY`` of them and more often
than any other group. ByteRobust starts its rounds only once a job has slowed
down; watching all the time, a clear majority is asked for, since in a
healthy pipeline-parallel job the stages are caught at different points and
timing alone flags some group in two or three rounds of five.

A round is what the stacks alone flagged in one capture (``round_of``, the
stack verdict's top suspect, before any other detector or the timing
judgement speaks): ``watch``, the drill suite, ``failslow.replay``,
``rankscope analyze`` and the TUI all count that one, so the rounds
scorecard measures what each of them shows.

This module is pure: whoever captures feeds it one round per capture and
paces the rounds with ``interval_s``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rankscope.analyzers.findings import Suspect, SuspectKind
from rankscope.analyzers.labels import suspect_label
from rankscope.contract.ranks import compact_machines

if TYPE_CHECKING:  # the fail-slow detector uses the rule without the stack analysis
    from rankscope.analyzers.analysis import JobAnalysis
    from rankscope.contract.snapshot import JobSnapshot, Layout

DEFAULT_INTERVAL_S = 10.0
DEFAULT_ROUNDS = 5
DEFAULT_MAJORITY = 0.6  # the degrader is flagged in more than this share of the rounds (4 of 5)


@dataclass(frozen=True, slots=True)
class StackRound:
    """What one capture's stacks flagged: the one round every fail-slow consumer counts."""

    flagged: Suspect | None  # the stack verdict's top suspect (None: its stacks showed no outliers)
    outliers: int  # outlier ranks of the stack grouping
    summary: str  # the stack verdict's headline


def round_of(analysis: JobAnalysis) -> StackRound:
    """One capture's stack round, from its one analysis (``analysis.analyze_job``)."""
    stacks = analysis.stacks
    return StackRound(stacks.verdict.top, len(stacks.grouping.outlier_ranks), stacks.verdict.summary)


def stack_round(snapshot: JobSnapshot, layout: Layout | None = None) -> StackRound | None:
    """One capture's stack round (``round_of`` of its ``analyze_job``); None when it holds no stacks to count.

    Raises ValueError (with the fix) when ``layout`` does not fit the job.
    """
    if not snapshot.all_stacks():
        return None
    from rankscope.analyzers.analysis import analyze_job  # only a capture with stacks needs the stack analysis

    return round_of(analyze_job(snapshot, layout))


def try_stack_round(snapshot: JobSnapshot, layout: Layout | None = None) -> tuple[StackRound | None, str | None]:
    """``stack_round`` for a loop that goes on without it: (the round, why it was skipped). A layout that does not
    fit the job costs this round, with the reason, never the caller (the other detectors still run)."""
    try:
        return stack_round(snapshot, layout), None  # None: no stacks, no round, nothing to count
    except ValueError as exc:
        return None, f"stack round skipped: {exc}"


@dataclass(frozen=True, slots=True)
class RoundResult:
    """What one round flagged (None when its stacks showed no outliers)."""

    index: int
    flagged: Suspect | None
    outliers: int
    summary: str


def group_key(s: Suspect) -> tuple[str, tuple[int, ...]]:
    """A flagged group is its kind and ranks (its score and evidence change from round to round)."""
    return (str(s.kind), s.ranks)


@dataclass(frozen=True, slots=True)
class Tally:
    """The rounds counted: each flagged group with its count, most flagged first."""

    counts: tuple[tuple[Suspect, int], ...]  # the latest flag of each group, and how often it was flagged
    window: int  # rounds counted (flagged or not)
    named: bool  # the rule holds: the first group is the degrader

    @property
    def best(self) -> Suspect | None:
        return self.counts[0][0] if self.counts else None


def required_flags(rounds: int, majority: float = DEFAULT_MAJORITY) -> int:
    """How many of ``rounds`` flags a group needs to be named."""
    return int(majority * rounds) + 1


def tally(flags: Sequence[Suspect | None], rounds: int, majority: float = DEFAULT_MAJORITY) -> Tally:
    """The one rounds rule over the last ``rounds`` flags (None: a round with no outliers).

    Most flagged first; equal counts by the higher summed score. Named once
    ``rounds`` rounds are in, the first group was flagged in more than
    ``majority`` of them, and strictly more often than the runner-up.
    """
    window = list(flags)[-rounds:]
    groups: dict[tuple[str, tuple[int, ...]], list[Suspect]] = {}
    for s in window:
        if s is not None:
            groups.setdefault(group_key(s), []).append(s)
    ordered = sorted(groups.values(), key=lambda fl: (-len(fl), -sum(s.score for s in fl)))
    counts = tuple((fl[-1], len(fl)) for fl in ordered)
    named = (len(window) >= rounds and bool(counts) and counts[0][1] > majority * len(window)
             and (len(counts) == 1 or counts[1][1] < counts[0][1]))
    return Tally(counts, len(window), named)


class FailSlowRounds:
    """Counts, round after round, which parallel group held the outliers."""

    def __init__(self, rounds: int = DEFAULT_ROUNDS, interval_s: float = DEFAULT_INTERVAL_S,
                 majority: float = DEFAULT_MAJORITY) -> None:
        if rounds < 1:
            raise ValueError(f"fail-slow rounds must be at least 1, got {rounds}")
        if interval_s <= 0:
            raise ValueError(f"the interval between rounds must be positive, got {interval_s}")
        self.rounds = rounds
        self.interval_s = interval_s
        self.majority = majority
        self._history: list[RoundResult] = []

    @property
    def history(self) -> tuple[RoundResult, ...]:
        return tuple(self._history)

    @property
    def done(self) -> bool:
        return len(self._history) >= self.rounds

    def add_round(self, stack_round: StackRound) -> None:
        """Record one round: its top suspect is the group with the most outliers this time."""
        self._history.append(RoundResult(len(self._history), stack_round.flagged, stack_round.outliers,
                                         stack_round.summary))

    def counts(self) -> list[tuple[Suspect, int]]:
        """Each group flagged in the last N rounds with its flag count, most flagged first."""
        return list(self._tally().counts)

    def _tally(self) -> Tally:
        return tally([r.flagged for r in self._history], self.rounds, self.majority)

    def flagged(self) -> Suspect | None:
        """The degrader once N rounds are in and the rule holds (``tally``), else None."""
        t = self._tally()
        if not t.named:
            return None
        best, n = t.counts[0]
        counts, window = t.counts, t.window
        runner_up = f"; next: {suspect_label(counts[1][0])} ({counts[1][1]})" if len(counts) > 1 else ""
        where = "" if best.kind is SuspectKind.MACHINE else f" on {compact_machines(best.machines)}"
        evidence = (
            f"{suspect_label(best)}{where} flagged in {n} of the last {window} rounds{runner_up}",
            *(f"round {r.index}: {r.summary}" for r in self._history[-self.rounds:]),
        )
        return Suspect(
            kind=best.kind, ranks=best.ranks, machines=best.machines, score=n / window, evidence=evidence,
            sources=("fail-slow-rounds",), group_index=best.group_index, diverging_frame=best.diverging_frame,
            roots=best.roots,
        )
