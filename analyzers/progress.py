"""Was the job making steps when a snapshot was taken? Told by the snapshot itself.

A snapshot of a running job catches its ranks at different points of a
step: some wait in a collective the others have not launched yet, stacks
stand at different calls. In a hang those differences are the evidence; in
a job making steps they are timing, and naming a suspect from them would
send an engineer to evict a healthy machine. The agents remember when each
rank last progressed (``RankInfo.last_progress_wall``): a snapshot taken
within a step or two of that caught a running job. Snapshots without that
memory (py-spy dumps, flight recorder dumps, older bundles) say nothing here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rankscope.analyzers.findings import Verdict, VerdictStatus
from rankscope.contract.snapshot import JobSnapshot, RankCounters

# A job that stepped this recently (or within two of its own step times) is caught mid-step by a snapshot.
MID_STEP_S = 3.0


# A process at 0 optimizer steps whose collectives completed only this soon after it started is still setting up
# (a restart's rendezvous, restoring a backup): below the TUI's default --hang-after (30 s), so a job with no
# optimizer is never "hung since its start" while its collectives move.
SETUP_S = 20.0


def counters_progress_wall(counters: RankCounters, job_counts_steps: bool = False,
                           started_wall: float | None = None) -> float | None:
    """When the CCL plugin last saw this rank make progress (None: none yet): the one rule agents and views use.

    A job that makes optimizer steps progresses by them: the collectives of a
    restart (rendezvous barriers, restoring a backup) are not training, and
    counting them said "progress resumed" many seconds before any step did.
    A job with no optimizer (its step count stays 0 while its collectives
    advance: an inference or evaluation loop, a bare collective loop) and a
    writer that counts no steps progress by their last completed collective;
    such a job is never "hung since its start" while its collectives move.
    ``job_counts_steps``: the job made optimizer steps before (an earlier
    process of the rank, another rank): then a process at 0 steps has made no
    progress until its first step, whatever its collectives do.
    ``started_wall``: when the process started; collectives of its first
    ``SETUP_S`` at 0 steps are its set-up, not progress (an agent restarted
    with the job has no memory of its steps).
    """
    if counters.steps:
        return counters.last_step_wall or None
    if counters.steps is not None and job_counts_steps:
        return None
    marks = [op.last_complete_wall for op in counters.ops if op.last_complete_wall]
    mark = max(marks) if marks else None
    if mark is not None and counters.steps is not None and started_wall is not None and mark - started_wall < SETUP_S:
        return None
    return mark


def mid_step_window(step_s: float | None) -> float:
    """How long after its last progress a job taking ``step_s`` per step (None: unknown) is still mid-step.

    The one rule for "was it making steps": ``rankscope analyze`` reads the step
    time from the snapshot's counters, the TUI from the step rate of its polls.
    """
    return max(MID_STEP_S, 2.0 * step_s) if step_s is not None and step_s > 0 else MID_STEP_S


# A stall is judged against the job's own rhythm (Mycroft's and NCCL RAS' seconds, not a fixed half minute): no
# progress for RHYTHM_FACTOR times its longest recent gap between progress marks (its slow steps, checkpoint saves
# included) is a hang, never sooner than RHYTHM_MIN_S, never later than the ceiling (--hang-after). Until
# RHYTHM_GAPS gaps are known the ceiling alone decides: a job just started has shown no rhythm yet.
RHYTHM_FACTOR = 3.0
RHYTHM_MIN_S = 6.0
RHYTHM_GAPS = 5
RHYTHM_KEPT = 200  # gaps remembered: a checkpoint save every 100 steps stays in view
RHYTHM_WARMUP = 3  # a launch's first gaps (imports, compilation, the first checkpoint load) are not its rhythm


@dataclass(frozen=True, slots=True)
class HangThreshold:
    """How long without progress is a hang for this job, and why (the countdown says it)."""

    seconds: float
    longest_gap_s: float | None  # the longest recent gap between progress marks (None: too few known)
    from_rhythm: bool  # False: the ceiling decided (too few gaps, or the rhythm asks for more)

    def basis(self) -> str:
        if self.from_rhythm and self.longest_gap_s is not None:
            return f"{RHYTHM_FACTOR:g}× its {self.longest_gap_s:.1f} s step"
        if self.longest_gap_s is None:
            return "no rhythm yet"
        return "--hang-after"


def hang_threshold(gaps: Sequence[float], ceiling_s: float) -> HangThreshold:
    """The stall that makes a hang, from the job's recent gaps between progress marks (oldest first)."""
    if len(gaps) < RHYTHM_GAPS:
        return HangThreshold(ceiling_s, None, False)
    longest = max(gaps[-RHYTHM_KEPT:])
    wanted = max(RHYTHM_MIN_S, RHYTHM_FACTOR * longest)
    return HangThreshold(min(wanted, ceiling_s), longest, wanted < ceiling_s)


@dataclass(frozen=True, slots=True)
class ProgressAtCapture:
    age_s: float  # how long before the snapshot the job last progressed
    window_s: float  # within this, a snapshot finds the ranks mid-step

    @property
    def running(self) -> bool:
        return self.age_s <= self.window_s


def progress_at_capture(snapshot: JobSnapshot) -> ProgressAtCapture | None:
    """How long before ``snapshot`` its job last progressed, per its agents; None when they did not say."""
    marks = [r.last_progress_wall for m in snapshot.machines if m.reachable for r in m.ranks
             if r.last_progress_wall is not None]
    if not marks:
        return None
    steps = sorted(c.last_step_duration_s for m in snapshot.machines for c in m.counters
                   if c.last_step_duration_s is not None and c.last_step_duration_s > 0)
    window = mid_step_window(steps[len(steps) // 2] if steps else None)
    return ProgressAtCapture(max(0.0, snapshot.captured.wall - max(marks)), window)


def timing_summary(differences: bool, progress: ProgressAtCapture | None = None) -> str:
    """The one wording of the timing judgement: a capture caught the job making steps, so what its ranks' stacks
    differ by is timing, not a fault (``differences``: they differ at all). ``progress`` adds when the job last
    progressed (the analysis' verdict); without it nothing is counted (the TUI's capture line: two views capturing
    a moment apart must tell one story)."""
    if not differences:
        return "no verdict: the job was making progress and every rank's stack agrees"
    when = (f" (it last progressed {progress.age_s:.1f} s before the capture, within {progress.window_s:.0f} s)"
            if progress is not None else "")
    return (f"no verdict: the job was making progress{when}, so the differences between its ranks' stacks (caught at "
            "different points of a step) are timing, not a fault")


def set_aside_as_timing(verdict: Verdict, progress: ProgressAtCapture) -> Verdict:
    """The verdict of a snapshot taken while the job made steps: no suspects, and what was set aside, said."""
    if not verdict.suspects and not verdict.findings:
        return verdict
    summary = timing_summary(True, progress)
    return Verdict((), summary, verdict.missing_ranks, (*verdict.notes, f"set aside as timing: {verdict.summary}"),
                   status=VerdictStatus.TIMING)


__all__ = ["MID_STEP_S", "SETUP_S", "ProgressAtCapture", "counters_progress_wall", "mid_step_window", "progress_at_capture",
           "set_aside_as_timing", "timing_summary"]
