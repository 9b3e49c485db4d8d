"""The one analysis entry: a snapshot's stacks and CCL counters, plus any other detector's verdict, merged.

The TUI (``tui.analysis.build_stack_view``), ``rankscope analyze``,
``rankscope watch``, the drill's scorer (``analyze_snapshot``), the fail-slow
suite and ``failslow.replay`` call ``analyze_job`` (their fail-slow rounds
are ``rounds.round_of`` of it), so one capture gets one verdict wherever it
is looked at.

The pass runs its stages in order, each a module that takes the previous
stage's typed result and never calls back into an earlier one
(docs/analysis-pass.md tells it stage by stage):

1. ``stage_evidence.gather``: the snapshot -> ``Evidence`` (stacks grouped,
   counters and their waits, the layout, the machines);
2. ``stage_rank_states.rank_states`` -> ``RankStates`` (each rank's state);
3. ``stage_waits.waits_of`` -> ``Waits`` (who waits on whom);
4. ``stage_roots.roots_of`` -> ``Roots`` (the chain: roots, victims, desyncs);
5. ``stage_suspects.suspects_of`` -> ``StackAnalysis`` (suspects on the
   layout, the stacks' verdict);
6. ``stage_verdict.verdict_of`` -> ``JobAnalysis`` (the counters' verdict and
   ``others`` merged, "not a rank", the timing judgement).

The words are made from the typed results (``labels``, ``render``).
"""

from __future__ import annotations

from collections.abc import Sequence

from rankscope.analyzers.findings import Verdict
from rankscope.analyzers.stacks import DEFAULT_OPTIONS, SignatureOptions
from rankscope.analyzers.stage_evidence import gather
from rankscope.analyzers.stage_rank_states import rank_states
from rankscope.analyzers.stage_roots import roots_of
from rankscope.analyzers.stage_suspects import StackAnalysis, suspects_of
from rankscope.analyzers.stage_verdict import JobAnalysis, verdict_of
from rankscope.analyzers.stage_waits import waits_of
from rankscope.contract.snapshot import JobSnapshot, Layout


def analyze_job(snapshot: JobSnapshot, layout: Layout | None = None, options: SignatureOptions = DEFAULT_OPTIONS,
                others: Sequence[Verdict] = ()) -> JobAnalysis:
    """Stacks + CCL counters (+ ``others``) → the merged verdict, stage by stage (see the module docstring).

    Raises ValueError (with the fix) when ``layout`` does not fit the job.
    """
    evidence = gather(snapshot, layout, options)
    stacks = suspects_of(roots_of(waits_of(rank_states(evidence))))
    return verdict_of(evidence, stacks, others)


def analyze_stacks(snapshot: JobSnapshot, layout: Layout | None = None,
                   options: SignatureOptions = DEFAULT_OPTIONS) -> StackAnalysis:
    """The stacks' verdict alone (stages 1-5), on the snapshot as given: no communicators joined, no merge.

    Raises ValueError (with the fix in its message) when the layout does not fit the job.
    """
    return suspects_of(roots_of(waits_of(rank_states(gather(snapshot, layout, options, join=False)))))


def analyze_snapshot(snapshot: JobSnapshot, layout: Layout | None = None) -> Verdict:
    """Every detector with data in ``snapshot``, merged: ``analyze_job``'s verdict (the drill's scorer, benchmarks).

    Raises ValueError (with the fix) when ``layout`` does not fit the job.
    """
    return analyze_job(snapshot, layout).verdict


__all__ = ["JobAnalysis", "analyze_job", "analyze_snapshot", "analyze_stacks"]
