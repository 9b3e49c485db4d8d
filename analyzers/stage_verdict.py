"""Stage 6 of the pass (docs/analysis-pass.md): one verdict for the capture.

Takes the stacks' ``StackAnalysis`` (with the ``Evidence`` it was read
from); passes on ``JobAnalysis``, what every view of a capture is drawn
from. The CCL counters' verdict (Aegis §4.2, CL/WR/WC) and any verdicts the
caller already has for the same capture (``others``: a flight recorder
dump's, a fail-slow round's degrader, what logs say) are merged with the
stacks' (``verdict.merge_verdicts``); then "not a rank" (``not_a_rank.settle``:
every member of a communicator in one call, none pinned), then the timing
judgement (``progress``: a capture of a job making steps caught its ranks
mid-step, so their differences are timing, not a fault).

A CCL verdict that names nobody is not merged (it would only re-word the
stacks' headline); its summary and notes are kept as notes.

Pure: stdlib, numpy and the snapshot contract; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rankscope.analyzers.ccl import analyze_counters
from rankscope.analyzers.findings import Verdict
from rankscope.analyzers.not_a_rank import settle
from rankscope.analyzers.progress import ProgressAtCapture, progress_at_capture, set_aside_as_timing
from rankscope.analyzers.stage_evidence import Evidence
from rankscope.analyzers.stage_suspects import StackAnalysis
from rankscope.analyzers.verdict import merge_findings, merge_verdicts


@dataclass(frozen=True, slots=True)
class JobAnalysis:
    """What every view of a capture is drawn from."""

    stacks: StackAnalysis
    counters: Verdict | None  # the CCL verdict (None: no counters in the capture, or ``others`` given)
    merged_with: tuple[Verdict, ...]  # the verdicts merged into the stacks' (empty: the stacks speak alone)
    verdict: Verdict  # the one verdict: the stacks', merged with ``merged_with``, the timing judgement applied
    # When the job last progressed before the capture, per its agents (None: they did not say: py-spy dumps, flight
    # recorder dumps, older bundles).
    progress: ProgressAtCapture | None = None
    before_timing: Verdict | None = None  # the verdict as if the job were stuck (None: the same as ``verdict``)

    @property
    def timing_not_fault(self) -> bool:
        """The capture caught the job making steps: its ranks' differences are timing, not a fault."""
        return self.progress is not None and self.progress.running

    @property
    def fault_verdict(self) -> Verdict:
        """The verdict before the timing judgement (what a capture of a running job set aside)."""
        return self.before_timing if self.before_timing is not None else self.verdict


def verdict_of(evidence: Evidence, stacks: StackAnalysis, others: Sequence[Verdict] = ()) -> JobAnalysis:
    """The stacks' verdict merged with the counters' (or ``others``), "not a rank" and timing applied."""
    snapshot = evidence.snapshot
    counters = (analyze_counters(snapshot, evidence.layout, evidence.waits)
                if evidence.counters and not others else None)
    merged_with = tuple(others) or ((counters,) if counters is not None and counters.suspects else ())
    # merge_verdicts also folds one detector's suspects: a rank, its TP group and its DP group holding one root
    # are one suspect whether or not another detector spoke.
    # A capture without stacks (flight recorder dumps, logs alone) gives the stacks nothing to say: the other
    # detectors speak alone.
    spoken = (stacks.verdict,) if not others or any(m.stacks for m in snapshot.machines) else ()
    verdict = merge_verdicts(*spoken, *merged_with)
    if not merged_with and counters is not None:
        v = verdict
        verdict = Verdict(v.suspects, v.summary, v.missing_ranks, (*v.notes, counters.summary, *counters.notes),
                          findings=merge_findings(v, counters), status=v.status)
    verdict = settle(verdict, snapshot)  # "not a rank": every member of a communicator in one call, none pinned
    progress = progress_at_capture(snapshot)
    if progress is None or not progress.running:
        return JobAnalysis(stacks, counters, merged_with, verdict, progress)
    return JobAnalysis(stacks, counters, merged_with, set_aside_as_timing(verdict, progress), progress, verdict)


__all__ = ["JobAnalysis", "verdict_of"]
