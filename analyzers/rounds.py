"""Fail-slow rounds (ByteRobust §5.1): repeated aggregation names the degrader.

A slow job does not stop, so one capture shows the slow group only by
chance: its ranks are more often caught somewhere else than the others. The
aggregation is therefore repeated (every 10 s by default); each round flags
the parallel group that best explains that round's outliers, and after N
rounds (5 by default) the group flagged most often is the degrader.

This class is pure: whoever captures (the TUI, ``rankscope watch``) feeds it
one analysis per round and paces the rounds with ``interval_s``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rankscope.analyzers.findings import Suspect
from rankscope.analyzers.suspects import StackAnalysis
from rankscope.analyzers.topology import compact_machines, compact_ranks

DEFAULT_INTERVAL_S = 10.0
DEFAULT_ROUNDS = 5


@dataclass(frozen=True, slots=True)
class RoundResult:
    """What one round flagged (None when its stacks showed no outliers)."""

    index: int
    flagged: Suspect | None
    outliers: int
    summary: str


def _key(s: Suspect) -> tuple[str, tuple[int, ...]]:
    return (str(s.kind), s.ranks)


class FailSlowRounds:
    """Counts, round after round, which parallel group held the outliers."""

    def __init__(self, rounds: int = DEFAULT_ROUNDS, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        if rounds < 1:
            raise ValueError(f"fail-slow rounds must be at least 1, got {rounds}")
        if interval_s <= 0:
            raise ValueError(f"the interval between rounds must be positive, got {interval_s}")
        self.rounds = rounds
        self.interval_s = interval_s
        self._history: list[RoundResult] = []

    @property
    def history(self) -> tuple[RoundResult, ...]:
        return tuple(self._history)

    @property
    def done(self) -> bool:
        return len(self._history) >= self.rounds

    def add_round(self, analysis: StackAnalysis) -> None:
        """Record one round: its top suspect is the group with the most outliers this time."""
        top = analysis.verdict.top
        self._history.append(RoundResult(
            index=len(self._history),
            flagged=top,
            outliers=len(analysis.grouping.outlier_ranks),
            summary=analysis.verdict.summary,
        ))

    def counts(self) -> list[tuple[Suspect, int]]:
        """Each group flagged in the last N rounds with its flag count, most flagged first."""
        window = self._history[-self.rounds:]
        tally: dict[tuple[str, tuple[int, ...]], list[Suspect]] = {}
        for r in window:
            if r.flagged is not None:
                tally.setdefault(_key(r.flagged), []).append(r.flagged)
        ordered = sorted(tally.values(), key=lambda flags: (-len(flags), -sum(s.score for s in flags)))
        return [(flags[-1], len(flags)) for flags in ordered]

    def flagged(self) -> Suspect | None:
        """The degrader once N rounds are in, else None (also None if no round had outliers)."""
        if not self.done:
            return None
        counts = self.counts()
        if not counts:
            return None
        best, n = counts[0]
        window = len(self._history[-self.rounds:])
        runner_up = f"; next: {counts[1][0].kind} ranks {compact_ranks(counts[1][0].ranks)} ({counts[1][1]})" \
            if len(counts) > 1 else ""
        evidence = (
            f"{best.kind} ranks {compact_ranks(best.ranks)} on {compact_machines(best.machines)} "
            f"flagged in {n} of the last {window} rounds{runner_up}",
            *(f"round {r.index}: {r.summary}" for r in self._history[-self.rounds:]),
        )
        return Suspect(
            kind=best.kind, ranks=best.ranks, machines=best.machines, score=n / window, evidence=evidence,
            sources=("fail-slow-rounds",), group_index=best.group_index, diverging_frame=best.diverging_frame,
        )
