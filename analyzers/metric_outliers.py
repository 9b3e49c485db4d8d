"""Cross-host metric outliers (Aegis §5.1): above λ+2δ of the peers for the whole window T.

In synchronous training every machine runs the same program at the same pace,
so one metric should move alike on all of them. For each metric, each machine
is compared with its *peers*: λ is the other machines' mean now and δ their
standard deviation across machines over the last ``window_s`` seconds. A
machine whose value sits beyond λ ± k·δ (k = 2 in the paper) in every update
for ``window_s`` seconds is an outlier. Aegis uses ten minutes in production; a
drill needs seconds, hence the parameter.

Why peers only: with a handful of machines a single outlier inflates the
spread of a pool that includes itself so much that it can never exceed
λ + 2δ (with four machines its z-score is at most 1.5). Leaving it out is what
"above its peers" means anyway.

Why a floor on δ: peers that report identical values (a stand-in NVML, a
pinned clock) have δ = 0, and then any difference would be an outlier; the
spread used is at least ``rel_floor`` of λ and the metric's own noise floor.

Why both sides for some metrics: Aegis looks at "higher than"; a throttled SM
clock or an idle GPU is *lower* than its peers, so each metric says which side
is suspect (``MetricSpec.direction``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from rankscope.analyzers.series import METRICS, Direction, MetricSpec, RunTracker, SeriesStore

# Metrics Aegis-style thresholds run on by default. Step time has its own
# detector (step_time.py) and is left out here so it is not counted twice.
DEFAULT_METRICS: tuple[str, ...] = (
    "proc_cpu_percent",
    "host_cpu_percent",
    "host_mem_percent",
    "host_load_1m",
    "gpu_util_percent",
    "gpu_power_w",
    "gpu_temperature_c",
    "gpu_sm_clock_mhz",
    "gpu_pcie_kbps",
    "gpu_nvlink_kbps",
)


@dataclass(frozen=True, slots=True)
class OutlierFinding:
    """One machine beyond its peers on one metric, and for how long.

    ``alarmed`` is True once the condition has held for the whole window; a
    finding that is not yet alarmed is a candidate (a burst may still end).
    """

    machine: str
    metric: str
    side: Direction  # HIGH or LOW: the side the machine is on
    value: float
    peer_mean: float  # λ
    peer_std: float  # δ as used (after the floor)
    z: float
    since_mono: float
    held_s: float
    alarmed: bool

    def evidence(self) -> str:
        spec = METRICS[self.metric]
        sign = "+" if self.side is Direction.HIGH else "-"
        return (
            f"{spec.label} {self.value:.4g}{spec.unit} vs peers {self.peer_mean:.4g}±{self.peer_std:.2g}{spec.unit} "
            f"(λ{sign}{abs(self.z):.1f}δ) for {self.held_s:.0f}s"
        )


def peer_stats(window: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per machine: its peers' mean now (λ) and their spread over the window (δ).

    ``window`` is (time, machine), NaN where absent. For machine j and each
    sample time, the peers are the other machines with a value then; λ is
    their mean at the newest time, δ the root mean of their variance around
    their own mean at each time of the window. Measuring the spread *across
    machines at each time* rather than over all samples pooled keeps a change
    every machine goes through together (memory filling up, a new phase of
    training) from making everybody an outlier of their own past. Computed from
    per-time sums: O(time × machines). NaN where a machine has no peer.
    """
    ok = np.isfinite(window)
    x = np.where(ok, window, 0.0)
    total_n, total_s, total_q = ok.sum(axis=1), x.sum(axis=1), (x * x).sum(axis=1)
    n = total_n[:, None] - ok  # peers per (time, machine)
    s = total_s[:, None] - x
    q = total_q[:, None] - x * x
    has = n > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_t = np.where(has, s / np.maximum(n, 1), np.nan)
        var_t = np.where(has, np.maximum(q / np.maximum(n, 1) - mean_t * mean_t, 0.0), np.nan)
        counted = has.sum(axis=0)
        var = np.where(counted > 0, np.nansum(var_t, axis=0) / np.maximum(counted, 1), np.nan)
    return mean_t[-1], np.sqrt(var)


def peer_scores(window: np.ndarray, spec: MetricSpec, rel_floor: float = 0.05) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per machine: λ, δ as used (after the floors) and the z-score of its newest value.

    ``window`` is (time, machine) as in ``peer_stats``; a single row (one
    snapshot) measures the peers' spread at that instant only.
    """
    lam, sd = peer_stats(window)
    delta = np.maximum(np.maximum(sd, rel_floor * np.abs(lam)), spec.floor)
    with np.errstate(invalid="ignore", divide="ignore"):
        z = (window[-1] - lam) / delta
    return lam, delta, z


def beyond(z: np.ndarray, spec: MetricSpec, k_sigma: float = 2.0) -> np.ndarray:
    """Which z-scores are outliers: past k·δ on the side the metric says is suspect (``MetricSpec.direction``)."""
    high = spec.direction in (Direction.HIGH, Direction.BOTH)
    low = spec.direction in (Direction.LOW, Direction.BOTH)
    zz = np.where(np.isfinite(z), z, 0.0)  # NaN (no peer) is never an outlier
    out: np.ndarray = np.zeros(z.shape, dtype=bool)
    if high:
        out |= zz > k_sigma
    if low:
        out |= zz < -k_sigma
    return out


def snapshot_outliers(values: np.ndarray, specs: Sequence[MetricSpec], k_sigma: float = 2.0,
                      rel_floor: float = 0.05) -> np.ndarray:
    """Outliers in one snapshot: ``values`` is (row, metric), NaN where absent; True where a row is beyond its peers.

    The same rule as the streaming detector (each row against the *other*
    rows, δ floored), without the lasting window: a view of one moment
    highlights, the detector alarms. With four machines and one hot GPU the
    hot one is flagged, where a mean + 2σ over all rows never can be.
    """
    flags = np.zeros(values.shape, dtype=bool)
    if values.shape[0] < 2:
        return flags
    for j, spec in enumerate(specs):
        _, _, z = peer_scores(values[None, :, j], spec, rel_floor)
        flags[:, j] = beyond(z, spec, k_sigma)
    return flags


class MetricOutlierDetector:
    """Streaming Aegis §5.1 detector over a ``SeriesStore``; call ``update`` after each ``store.add``."""

    def __init__(
        self,
        window_s: float = 30.0,
        k_sigma: float = 2.0,
        rel_floor: float = 0.05,
        metrics: Sequence[str] = DEFAULT_METRICS,
    ) -> None:
        self.window_s = window_s
        self.k_sigma = k_sigma
        self.rel_floor = rel_floor
        self.metrics = tuple(metrics)
        self._runs = RunTracker()

    def update(self, store: SeriesStore) -> tuple[OutlierFinding, ...]:
        """Current candidates and alarms, alarmed first, strongest first."""
        now = store.now
        if now is None:
            return ()
        scored: dict[tuple[str, str, Direction], tuple[float, float, float, float]] = {}
        for metric in self.metrics:
            spec = METRICS[metric]
            _, machines, values = store.matrix(metric, since=now - self.window_s)
            if values.shape[0] == 0 or len(machines) < 2:
                continue
            lam, delta, z = peer_scores(values, spec, self.rel_floor)
            current = values[-1]
            for j in np.flatnonzero(beyond(z, spec, self.k_sigma)):
                zj = float(z[j])
                side = Direction.HIGH if zj > 0 else Direction.LOW
                scored[(metric, machines[j], side)] = (float(current[j]), float(lam[j]), float(delta[j]), zj)
        runs = self._runs.update(now, scored)
        findings = []
        for key, (value, peer_mean, peer_std, score) in scored.items():
            metric, m, side = key
            run = runs[key]
            # The window is "the lasting T": a run counts once it spans T (with a
            # little slack for poll jitter, so a 1 s poll does not need T + 1 s).
            alarmed = run.held_s >= self.window_s * 0.98
            findings.append(OutlierFinding(m, metric, side, value, peer_mean, peer_std, score, run.since, run.held_s,
                                           alarmed))
        findings.sort(key=lambda f: (not f.alarmed, -f.held_s, -abs(f.z)))
        return tuple(findings)
