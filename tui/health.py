"""What the job is doing now, read from the store's readings: healthy, stalled, hung, slow, starting, idle, ...

The rules read only what ``Readings`` names (the store's ``AppState`` has it
all); the store applies them as it folds a capture in, the header and the
capture scheduling ask them too. Times shown are the snapshots' own.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

import numpy as np
from rankscope.analyzers.progress import RHYTHM_FACTOR, RHYTHM_MIN_S, HangThreshold, mid_step_window, timing_summary
from rankscope.tui.analysis import StackView
from rankscope.tui.digest import CommView, JobClock, MachineView


class Readings(Protocol):
    """What the health rules read of the job's readings (``rankscope.tui.state.AppState``)."""

    @property
    def progress_points(self) -> tuple[tuple[float, int], ...]: ...
    @property
    def step_points(self) -> tuple[tuple[float, int], ...]: ...
    @property
    def last_progress_wall(self) -> float | None: ...
    @property
    def clock(self) -> JobClock | None: ...
    @property
    def hang_after_s(self) -> float: ...
    @property
    def hang_threshold_s(self) -> float: ...
    @property
    def job_machines(self) -> tuple[MachineView, ...]: ...
    @property
    def restarting(self) -> frozenset[str]: ...
    @property
    def awaiting_restart(self) -> bool: ...
    @property
    def comms(self) -> tuple[CommView, ...]: ...


def fmt_time(wall: float | None) -> str:
    if wall is None:
        return "-"
    return datetime.fromtimestamp(wall, UTC).strftime("%H:%M:%S")


def step_rate(state: Readings) -> float | None:
    """Steps per second over the kept window, from the counters (None without step counters)."""
    pts = state.step_points
    if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
        return None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


RATE_WINDOW_S = 10.0  # the header's step rate: over this recent window, never the kept minute's average
QUIET_MIN_S = 5.0  # no progress this long (or three usual steps, if longer) is no longer "healthy"


def recent_step_rate(state: Readings, window_s: float = RATE_WINDOW_S) -> float | None:
    """Steps per second over the last ``window_s`` of readings (the last two when they are further apart).

    A lifetime (or whole-minute) average hid a hang: 22 s into one the header still read 0.62 steps/s.
    """
    pts = state.step_points
    if len(pts) < 2:
        return None
    end_wall, end = pts[-1]
    start = next((p for p in pts if end_wall - p[0] <= window_s), pts[-2])
    if start[0] >= end_wall:
        start = pts[-2]
    span = end_wall - start[0]
    return (end - start[1]) / span if span > 0 else None


def progress_age(state: Readings) -> float | None:
    """Seconds since the job's last progress (a step, or collective progress), per its agents or the readings."""
    clock = state.clock
    if clock is not None:
        return clock.progress_age_s if clock.running else None
    if state.last_progress_wall is None or not state.progress_points:
        return None
    return max(0.0, state.progress_points[-1][0] - state.last_progress_wall)


def hang_threshold(step_s: float | None, settled: bool, ceiling_s: float) -> HangThreshold:
    """How long without progress is a hang, from what the latest reading says of the job's rhythm.

    ``step_s``: the longest step the ranks' counters last timed (their own durations, past a launch's first steps;
    None: none known). No progress for ``RHYTHM_FACTOR`` times it is a hang, never sooner than ``RHYTHM_MIN_S``,
    never later than the ceiling (``--hang-after``).

    Read from the latest reading alone, never from a history of polls: while the job stalls its counters stand
    still, so every view (an acting one attached at the start, a read-only one attached in the hang) counts down
    to the same second. A history each view kept of what it happened to poll gave two views of one hang two
    countdowns.

    ``settled``: every collective any rank launched has completed and no rank lags its communicator -- nobody
    waits on a peer. A stuck collective is what the rhythm judges; ranks quiet between collectives (a job past its
    last step, tearing down; a checkpoint save every rank makes) are judged by the ceiling. A job that had finished
    its steps was called hung 8 s after its last step while its ranks exited.
    """
    if step_s is None:
        return HangThreshold(ceiling_s, None, False)
    wanted = max(RHYTHM_MIN_S, RHYTHM_FACTOR * step_s)
    if settled:
        return HangThreshold(ceiling_s, step_s, False)
    return HangThreshold(min(wanted, ceiling_s), step_s, wanted < ceiling_s)


def collectives_settled(comms: Sequence[CommView]) -> bool:
    """The ranks' counters show every launched collective completed and no rank behind its communicator."""
    return bool(comms) and not any(c.mismatch for c in comms)


def quiet_after(state: Readings) -> float:
    """No progress this long makes the job "stalled" (before it is hung): three usual steps, at least
    ``QUIET_MIN_S``, always before the hang threshold."""
    rate = step_rate(state)
    usual = 3.0 / rate if rate else 0.0
    return min(max(QUIET_MIN_S, usual), 0.8 * state.hang_threshold_s)


@dataclass(frozen=True, slots=True)
class Health:
    kind: str  # healthy, stalled, hung, slow, starting, idle, finished, unknown
    text: str
    short: str = ""  # what a narrow header says instead, where the rest of its line tells the detail ("" : the text)


def _clock_health(clock: JobClock, hang_after_s: float, threshold_s: float) -> Health | None:
    """The job's state from its agents' memory; None: progressing (the step rate decides healthy or slow)."""
    if not clock.running:
        if clock.seen_mark is None or clock.seen_age_s is None:
            return Health("idle", "no ranks running: the agents answer but have seen none of the job's ranks")
        if clock.seen_age_s < hang_after_s:
            return Health("idle", f"no ranks running since {fmt_time(clock.seen_mark)} (stopping or restarting)")
        return Health("finished", f"finished: no ranks running since {fmt_time(clock.seen_mark)}")
    if clock.progress_mark is None or clock.progress_age_s is None:
        age = clock.start_age_s
        if not clock.starting:
            if age is not None and age < hang_after_s:  # new processes (a restart) before their counters exist
                return Health("starting", f"starting: {len(clock.unknown)} ranks before their first step")
            return Health("unknown", "progress unknown: no counters (CCL plugin not loaded?) and no stack "
                          "change between captures yet")
        if age is not None and age >= hang_after_s:
            return Health("hung", f"hung since its start at {fmt_time(clock.start_mark)} ({age:.0f} s): "
                          "no rank has made a step")
        return Health("starting", f"starting: {len(clock.starting)} ranks before their first step")
    if clock.progress_age_s >= threshold_s:
        return Health("hung", f"hung since {fmt_time(clock.progress_mark)} ({clock.progress_age_s:.0f} s)")
    return None


def _agents_restart(n: int) -> str:
    return "1 machine's agent restarts" if n == 1 else f"{n} machines' agents restart"


def health(state: Readings) -> Health:
    """What the job is doing now (hung after ``state.hang_threshold_s`` without progress: the job's rhythm, at most
    ``hang_after_s``), read from the state.

    Between a succeeded eviction or hot-update and the restart it brings (``awaiting_restart``), no progress is the
    restart's: the ranks left wait on the ones stopped until the launcher stops them too. That is "restarting", not
    stalled or hung (by hand: "no progress for 21 s │ hang + capture in 9 s" and a "hung" event, seconds after a
    fail-slow eviction of a job that was training), said with how long, so a restart that never comes is seen.
    """
    judged = _judged(state)
    if state.awaiting_restart and judged.kind in ("stalled", "hung"):
        age = progress_age(state)
        waited = f" (no progress for {age:.0f} s)" if age is not None else ""
        return Health("idle", f"restarting: the job waits for its launcher to restart it{waited}", "restarting")
    return judged


def _judged(state: Readings) -> Health:
    hang_after_s = state.hang_after_s
    if not state.progress_points:
        return Health("unknown", "waiting for the first poll")
    job = state.job_machines
    running = [m for m in job if m.reachable]
    if job and not running:
        first = next((m.error for m in job if m.error), None)
        if state.awaiting_restart or all(m.name in state.restarting for m in job):
            # The launcher restarts the remaining machines' agents with the job.
            return Health("idle", "restarting: the job's agents do not answer yet")
        return Health("unknown", f"no agent answers: {first}" if first else "no agent of the job answers")
    silent = [m for m in job if not m.reachable and m.ranks]
    clock = state.clock
    if silent and not any(m.ranks for m in running):
        if state.awaiting_restart or all(m.name in state.restarting for m in silent):
            # Their agents restart with the job (an eviction, a hot-update): not lost.
            # Narrow, the header's machine count says how many ("1/5 machines 4 restarting").
            return Health("idle", f"restarting: {_agents_restart(len(silent))} with the job", "restarting")
        # The ranks live on machines whose agents do not answer now: nothing can be said about the job.
        return Health("unknown", f"the agents of the job's ranks do not answer ({len(silent)}): "
                      f"{silent[0].error or 'no answer'}")
    if clock is not None and not clock.running and state.awaiting_restart:
        seen = f" since {fmt_time(clock.seen_mark)}" if clock.seen_mark is not None else ""
        return Health("idle", f"restarting: no ranks running{seen}")
    if clock is not None:
        clocked = _clock_health(clock, hang_after_s, state.hang_threshold_s)
        if clocked is not None:
            return clocked
    elif running and not any(m.ranks for m in running):
        # Not a hang: nothing to wait for. The job ended, has not started, or is between a stop and a restart.
        return Health("idle", "no ranks running")
    else:
        if len(state.progress_points) < 2:
            # One reading says nothing about progress (a bundle of one capture, the first poll): not "healthy".
            return Health("unknown", "progress unknown (one reading)")
        last = state.progress_points[-1]
        if last[1] == 0 and not state.comms:
            return Health("unknown", "no counters (CCL plugin not loaded?)")
        since = state.last_progress_wall
        if since is not None and last[0] - since >= state.hang_threshold_s:
            return Health("hung", f"hung since {fmt_time(since)} ({last[0] - since:.0f} s)")
    age = progress_age(state)
    if age is not None and age >= quiet_after(state):
        # Between a quiet spell and the hang threshold: not "healthy" ("healthy │ 0.62 steps/s" 22 s into a hang).
        return Health("stalled", f"no progress for {age:.0f} s")
    pts = state.step_points
    if len(pts) >= 6:
        # Rates over readings at least half a second apart: a capture's reading lands milliseconds after a
        # poll's, and a few steps over a few milliseconds is no rate (it read as thousands of steps/s).
        rates = [(b[1] - a[1]) / (b[0] - a[0]) for a, b in itertools.pairwise(pts) if b[0] - a[0] >= 0.5]
        if rates:
            # Against the window's median, not its best: one quick pair of polls is not the job's pace.
            usual = float(np.median(rates))
            recent = recent_step_rate(state)  # the header's rate: one number, not two that disagree
            if usual > 0 and recent is not None and recent < 0.5 * usual:
                return Health("slow", f"slow: {recent:.2f} steps/s, usually {usual:.2f}")
    return Health("healthy", "healthy")


def making_steps(state: Readings) -> bool:
    """By the readings' progress counts, the job moved within ``mid_step_window`` of its step time: a capture now
    finds its ranks mid-step. For readings without the agents' progress marks (older agents, bundles); where a
    capture carries them, its analysis judges it (``JobAnalysis.timing_not_fault``, ``rankscope analyze``'s too).

    Not the same as "healthy": for ``hang_after_s`` after a job stops it still reads healthy, and a capture then
    (``s`` in the first seconds of a hang) must keep its suspects.
    """
    pts = state.progress_points
    if not pts:
        return False
    rate = step_rate(state)
    window = mid_step_window(1.0 / rate if rate else None)
    # Steps where the job counts them (its operations move within a step, and a rank stalling mid-step still
    # moved them a moment ago), else the summed operation counters.
    if len(state.step_points) >= 2:
        pts = state.step_points
    now, count = pts[-1]
    earlier = [c for wall, c in pts[:-1] if now - wall <= window]
    return bool(earlier) and earlier[0] != count


def running_capture_text(view: StackView) -> str:
    """What a capture of a job making steps says instead of suspects."""
    # No count: how many differences a capture of a running job catches is itself timing (the acting view counted
    # "6 stack differences" where its pair, capturing a moment later, counted "3": two stories of one restart).
    return timing_summary(bool(view.verdict.suspects))
