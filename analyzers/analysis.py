"""The one analysis entry: a snapshot's stacks and CCL counters, plus any other detector's verdict, merged.

The TUI (``tui.analysis.build_stack_view``), ``rankscope analyze``,
``rankscope watch``, the drill's scorer (``analyze_snapshot``), the fail-slow
suite and ``failslow.replay`` call ``analyze_job`` (their fail-slow rounds
are ``rounds.round_of`` of it), so one capture gets one verdict wherever it
is looked at. In order: each rank's state (``chain.rank_views`` from its
stacks, the counters' waits ``ccl_desync.counter_waits``, process state) ->
who waits for whom (``chain.follow_chain``) -> roots and victims -> suspects
on the layout (``suspects``) -> one verdict (``verdict.merge_verdicts``,
``not_a_rank.settle``, the timing judgement); typed results pass along and
the words are made from them (``labels``, ``render``). The detectors:

- stacks (ByteRobust §5.1): grouping, prefix tree, hang chain and suspects;
- CCL counters (Aegis §4.2, CL/WR/WC), when the plugin recorded any;
- ``others``: verdicts a caller already has for the same capture (a flight
  recorder dump's, a fail-slow round's degrader, what logs say).

When every member of a communicator waits in the same call and no detector
pins a rank, the verdict says "not a rank" (``rankscope.analyzers.not_a_rank``).

A CCL verdict that names nobody is not merged (it would only re-word the
stacks' headline); its summary and notes are kept as notes.

Last, the timing judgement (``rankscope.analyzers.progress``): a snapshot
its agents say was taken while the job made steps caught its ranks
mid-step, so their differences are timing, not a fault; ``verdict`` then
names no suspect and ``before_timing`` keeps what was set aside.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rankscope.analyzers.ccl import analyze_counters
from rankscope.analyzers.ccl_desync import counter_waits
from rankscope.analyzers.findings import Verdict
from rankscope.analyzers.not_a_rank import settle
from rankscope.analyzers.progress import ProgressAtCapture, progress_at_capture, timing_not_fault
from rankscope.analyzers.stacks import DEFAULT_OPTIONS, SignatureOptions
from rankscope.analyzers.suspects import StackAnalysis, analyze_stacks
from rankscope.analyzers.topology import joined_snapshot, topology_for
from rankscope.analyzers.verdict import merge_findings, merge_verdicts
from rankscope.contract.snapshot import JobSnapshot, Layout


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


def analyze_job(snapshot: JobSnapshot, layout: Layout | None = None, options: SignatureOptions = DEFAULT_OPTIONS,
                others: Sequence[Verdict] = ()) -> JobAnalysis:
    """Stacks + CCL counters (+ ``others``) → the merged verdict (see the module docstring).

    Raises ValueError (with the fix) when ``layout`` does not fit the job.
    """
    # One communicator per real group, one row per collective: the plugin's NCCL communicators joined into the
    # shim's torch groups, groups without a description named by their role in the layout.
    snapshot = joined_snapshot(snapshot, topology_for(snapshot, layout))
    all_counters = snapshot.all_counters()
    waits = counter_waits(all_counters) if all_counters else None  # built once for the chain and the CL rule
    stacks = analyze_stacks(snapshot, layout, options, waits)
    counters = analyze_counters(snapshot, layout, waits) if all_counters and not others else None
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
                          findings=merge_findings(v, counters))
    verdict = settle(verdict, snapshot)  # "not a rank": every member of a communicator in one call, none pinned
    progress = progress_at_capture(snapshot)
    if progress is None or not progress.running:
        return JobAnalysis(stacks, counters, merged_with, verdict, progress)
    return JobAnalysis(stacks, counters, merged_with, timing_not_fault(verdict, progress), progress, verdict)


def analyze_snapshot(snapshot: JobSnapshot, layout: Layout | None = None) -> Verdict:
    """Every detector with data in ``snapshot``, merged: ``analyze_job``'s verdict (the drill's scorer, benchmarks).

    Raises ValueError (with the fix) when ``layout`` does not fit the job.
    """
    return analyze_job(snapshot, layout).verdict
