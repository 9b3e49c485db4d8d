"""Step time as a first-class fail-slow signal: per rank, per machine, and its trend.

A fail-slow fault shows first as a longer step. Two questions are asked of it:

- *Is the job slowing down?* The job's step time (median over ranks) now,
  against its own baseline (the median of its first ``baseline_points``
  samples), and its slope over the window. This says that something is slow,
  not who.
- *Which machine is slow?* A machine whose step time (median of its ranks)
  stays at least ``ratio_threshold`` times its peers' median for ``window_s``
  seconds. Within it, the ranks above the same bar are named.

In a tightly synchronous job every rank's optimizer step ends together, so
the per-machine comparison finds a slow machine only where the step time is
measured on the rank's own work (the plugin's step hook) or the ranks drift
apart; the other detectors cover the rest. The trend is useful either way.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from rankscope.analyzers.series import RunTracker, SeriesStore


@dataclass(frozen=True, slots=True)
class StepTrend:
    """The job's step time now, at its start, and how fast it is changing."""

    step_s: float | None  # median over ranks, newest snapshot
    baseline_s: float | None  # median of the first samples seen
    ratio: float | None  # step_s / baseline_s
    slope: float | None  # seconds of step time gained per second of wall time over the window
    samples: int

    def evidence(self) -> str:
        if self.step_s is None:
            return "step time: not reported yet"
        if self.ratio is None or self.baseline_s is None:
            return f"step time {self.step_s:.3g}s"
        return f"step time {self.step_s:.3g}s, {self.ratio:.2f}× its start ({self.baseline_s:.3g}s)"


@dataclass(frozen=True, slots=True)
class StepTimeFinding:
    """A machine whose step time sits above its peers', and for how long."""

    machine: str
    ranks: tuple[int, ...]  # its ranks above the bar (all of its ranks if none alone is)
    step_s: float
    peers_s: float
    ratio: float
    since_mono: float
    held_s: float
    alarmed: bool

    def evidence(self) -> str:
        return (
            f"step time {self.step_s:.3g}s, {self.ratio:.2f}× peers ({self.peers_s:.3g}s) "
            f"for {self.held_s:.0f}s"
        )


@dataclass(frozen=True, slots=True)
class StepTimeResult:
    findings: tuple[StepTimeFinding, ...]
    trend: StepTrend
    per_machine: tuple[tuple[str, float], ...]  # newest step time per machine (NaN-free)
    per_rank: tuple[tuple[int, float], ...]  # newest step time per rank (NaN-free)


def job_trend(times: np.ndarray, job_step: np.ndarray, baseline_points: int, window_s: float) -> StepTrend:
    """Trend of the job's step time series (NaN where the job reported none)."""
    ok = np.isfinite(job_step)
    if not ok.any():
        return StepTrend(None, None, None, None, 0)
    t, v = times[ok], job_step[ok]
    step = float(v[-1])
    base = float(np.median(v[:baseline_points])) if v.size >= min(baseline_points, 3) else None
    recent = t >= t[-1] - window_s
    slope: float | None = None
    if int(recent.sum()) >= 3 and float(np.ptp(t[recent])) > 0:
        slope = float(np.polyfit(t[recent], v[recent], 1)[0])
    ratio = step / base if base else None
    return StepTrend(step, base, ratio, slope, int(v.size))


class StepTimeDetector:
    """Streaming step-time detector over a ``SeriesStore``; call ``update`` after each ``store.add``."""

    def __init__(self, window_s: float = 20.0, ratio_threshold: float = 1.2, baseline_points: int = 10) -> None:
        self.window_s = window_s
        self.ratio_threshold = ratio_threshold
        self.baseline_points = baseline_points
        self._runs = RunTracker()

    def update(self, store: SeriesStore) -> StepTimeResult:
        now = store.now
        t, job_step = store.job_steps()
        trend = job_trend(t, job_step, self.baseline_points, self.window_s)
        newest_rank = store.latest_rank_steps()
        machine_now = {m: v for m, v in store.latest("step_time_s").items() if math.isfinite(v)}
        if now is None:
            return StepTimeResult((), trend, (), ())
        above: dict[str, tuple[float, float, tuple[int, ...]]] = {}
        for m, v in machine_now.items():
            peers = [pv for pm, pv in machine_now.items() if pm != m]
            if not peers:
                continue
            peer = float(np.median(peers))
            if peer <= 0 or v < self.ratio_threshold * peer:
                continue
            slow = tuple(r for r in store.ranks_of(m) if newest_rank.get(r, 0.0) >= self.ratio_threshold * peer)
            above[m] = (v, peer, slow or store.ranks_of(m))
        runs = self._runs.update(now, above)
        findings = []
        for m, (v, peer, slow) in above.items():
            run = runs[m]
            findings.append(StepTimeFinding(m, slow, v, peer, v / peer, run.since, run.held_s,
                                            run.held_s >= self.window_s * 0.98))
        findings.sort(key=lambda f: (not f.alarmed, -f.ratio))
        return StepTimeResult(
            tuple(findings), trend, tuple(sorted(machine_now.items())), tuple(sorted(newest_rank.items())),
        )
