"""Minder-style faulty machine detection: per-metric similarity with continuity.

Minder (NSDI'25, §3–4) rests on four ideas, each kept here in a form that
needs no trained model:

1. *Similarity* (§3.1): machines of a 3D-parallel job load alike, so their
   recent windows of a metric look alike; the machine whose window is farthest
   from the others (largest sum of pairwise distances) is the candidate.
2. *Continuity* (§3.2, §4.4 step 2): a candidate must be the same machine in
   consecutive windows for ``continuity_s`` before it alarms (Minder uses four
   minutes; drills need seconds). Bursts and single spikes do not last.
3. *Denoising per metric* (§3.3): Minder reconstructs each window through a
   per-metric LSTM-VAE. We use a running median, which removes one-sample
   spikes outright, then a running mean. It is the "simple" end of their
   model comparison and needs no training data a drill does not have.
4. *Metric priority* (§3.4, Table 2, Fig. 7): metrics are tried in order and
   the first metric whose candidate has lasted raises the alarm. Table 2's
   list, cut down to what our agents read: CPU usage first (for a drill on one
   host that is the rank processes' CPU), then memory, then the GPU duty
   cycle, power, temperature, clocks, PCIe and NVLink throughput.

Normalisation (§4.1): each machine's window is divided by a scale common to
all machines (the peers' median level, at least the metric's ``scale_floor``),
so distances are relative and comparable across metrics, and noise on an
idle metric does not look like a difference. Minder's min-max normalisation
uses a metric's fixed limits; rescaling by the data's own min and max would
blow noise up to the full range when all machines are healthy.

Deciding the candidate: Minder z-scores the sums of distances ("normal
score"). With the four to eight machines of a drill that score is bounded
((n-1)/√n, 1.5 for four machines) whatever the fault, so a window's candidate
is instead required to be far from the others in absolute terms (mean relative
distance at least ``similarity_threshold``) *and* clearly the farthest (its
sum at least ``separation`` times the runner-up's; one outlier among n
machines gives about n-1). The z-score is still reported. Two machines cannot
be told apart this way, so Minder needs three or more.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from rankscope.analyzers.series import METRICS, FloatArray, RunTracker, SeriesStore

# Minder Table 2, in its priority order, mapped onto what rankscope reads.
MINDER_PRIORITY: tuple[str, ...] = (
    "proc_cpu_percent",
    "host_cpu_percent",
    "host_mem_percent",
    "gpu_util_percent",
    "gpu_mem_used_percent",
    "gpu_power_w",
    "gpu_temperature_c",
    "gpu_sm_clock_mhz",
    "gpu_pcie_kbps",
    "gpu_nvlink_kbps",
)


def denoise(values: FloatArray, median_width: int = 3, mean_width: int = 3) -> FloatArray:
    """Running median then running mean along time (axis 0).

    NaNs (missing samples) are first filled from the nearest earlier sample,
    then the nearest later one, as Minder pads missing points (§4.1).
    """
    x = np.array(values, dtype=np.float64, copy=True)
    if x.ndim != 2 or x.shape[0] == 0:
        return x
    ok = np.isfinite(x)
    rows = np.arange(x.shape[0])[:, None]
    cols = np.arange(x.shape[1])
    last_ok = np.maximum.accumulate(np.where(ok, rows, 0), axis=0)
    x = x[last_ok, cols]  # forward fill
    first = ok.argmax(axis=0)
    x = np.where(rows < first[None, :], x[first, cols][None, :], x)  # back fill before the first sample
    # Edges are padded with the median of the three samples nearest the edge:
    # repeating (or reflecting) the edge sample would let a spike in the newest
    # two samples survive exactly where it matters most.
    for width, reduce in ((median_width, np.median), (mean_width, np.mean)):
        half = width // 2
        if width <= 1 or x.shape[0] < 2:
            continue
        head = np.median(x[:3], axis=0, keepdims=True)
        tail = np.median(x[-3:], axis=0, keepdims=True)
        padded = np.concatenate([np.repeat(head, half, axis=0), x, np.repeat(tail, width - 1 - half, axis=0)])
        windows = np.lib.stride_tricks.sliding_window_view(padded, width, axis=0)
        x = np.asarray(reduce(windows, axis=-1), dtype=np.float64)
    return x


def dissimilarity(vectors: FloatArray) -> tuple[FloatArray, FloatArray]:
    """Per machine (column): mean RMS distance to the others, and Minder's normal score of the sums.

    ``vectors`` is (window, machines), already normalised. A column that is
    all NaN gets NaN.
    """
    n = vectors.shape[1]
    if n < 2:
        return np.full(n, np.nan), np.full(n, np.nan)
    diff = vectors[:, :, None] - vectors[:, None, :]
    dist = np.sqrt(np.nanmean(diff**2, axis=0))  # (n, n) RMS distance per pair
    np.fill_diagonal(dist, 0.0)
    mean_dist = np.nansum(dist, axis=1) / (n - 1)
    sd = float(np.std(mean_dist))
    normal = (mean_dist - float(np.mean(mean_dist))) / sd if sd > 0 else np.zeros(n)
    return mean_dist, normal


@dataclass(frozen=True, slots=True)
class MinderFinding:
    """A machine that has been the most dissimilar on a metric, and for how long."""

    machine: str
    metric: str
    distance: float  # mean relative RMS distance to the other machines
    separation: float  # its distance over the runner-up's
    normal_score: float  # Minder's z-score of the sums of distances
    side: str  # "high" / "low": where its window sits relative to the peers' median
    since_mono: float
    held_s: float
    alarmed: bool

    def evidence(self) -> str:
        spec = METRICS[self.metric]
        return (
            f"{spec.label} unlike peers ({self.side}): distance {self.distance:.2f} "
            f"({self.separation:.1f}× the next machine) for {self.held_s:.0f}s"
        )


@dataclass(frozen=True, slots=True)
class MinderResult:
    """This update's candidates per metric, and the alarm of the first metric (by priority) that lasted."""

    findings: tuple[MinderFinding, ...]
    alarm: MinderFinding | None
    notes: tuple[str, ...] = ()


class MinderDetector:
    """Streaming Minder detector over a ``SeriesStore``; call ``update`` after each ``store.add``."""

    def __init__(
        self,
        window_points: int = 8,
        continuity_s: float = 20.0,
        similarity_threshold: float = 0.10,
        separation: float = 1.5,
        metrics: Sequence[str] = MINDER_PRIORITY,
        median_width: int = 3,
        mean_width: int = 3,
    ) -> None:
        self.window_points = window_points
        self.continuity_s = continuity_s
        self.similarity_threshold = similarity_threshold
        self.separation = separation
        self.metrics = tuple(metrics)
        self.median_width = median_width
        self.mean_width = mean_width
        self._runs = RunTracker()

    def candidate(self, metric: str, values: FloatArray, machines: Sequence[str]) -> tuple[int, float, float, float, str] | None:
        """This window's candidate for one metric: (column, distance, separation, normal score, side)."""
        keep = np.flatnonzero(np.isfinite(values).any(axis=0)).tolist()
        if len(keep) < 3:
            return None
        # Denoise a little more than the window, so its first samples are not at an edge.
        x = denoise(values[:, keep], self.median_width, self.mean_width)[-self.window_points:]
        level = float(np.median(np.nanmean(x, axis=0)))
        scale = max(abs(level), METRICS[metric].scale_floor)
        mean_dist, normal = dissimilarity(x / scale)
        order = np.argsort(-mean_dist)
        top, second = int(order[0]), int(order[1])
        dist, runner_up = float(mean_dist[top]), float(mean_dist[second])
        sep = dist / runner_up if runner_up > 0 else math.inf
        if dist < self.similarity_threshold or sep < self.separation:
            return None
        others = np.delete(x, top, axis=1)
        side = "high" if float(np.nanmean(x[:, top])) > float(np.median(others)) else "low"
        return keep[top], dist, sep, float(normal[top]), side

    def update(self, store: SeriesStore) -> MinderResult:
        now = store.now
        if now is None:
            return MinderResult((), None)
        if len(store.machines) < 3:
            return MinderResult((), None, ("minder: needs 3 or more machines to tell the odd one out",))
        found: dict[tuple[str, str], tuple[float, float, float, str]] = {}
        for metric in self.metrics:
            t, machines, values = store.matrix(metric, last=self.window_points + self.median_width)
            if t.size < self.window_points:
                continue
            got = self.candidate(metric, values, machines)
            if got is not None:
                j, dist, sep, normal, side = got
                found[(metric, machines[j])] = (dist, sep, normal, side)
        runs = self._runs.update(now, found)
        findings = []
        for (metric, machine), (dist, sep, normal, side) in found.items():
            run = runs[(metric, machine)]
            alarmed = run.held_s >= self.continuity_s * 0.98
            findings.append(MinderFinding(machine, metric, dist, sep, normal, side, run.since, run.held_s, alarmed))
        rank = {m: i for i, m in enumerate(self.metrics)}
        findings.sort(key=lambda f: (not f.alarmed, rank[f.metric], -f.held_s))
        alarm = findings[0] if findings and findings[0].alarmed else None
        return MinderResult(tuple(findings), alarm)
