"""Snapshots turned into per-machine and per-rank metric time series.

The fail-slow detectors (Aegis §5.1 cross-host outliers, Minder's machine
similarity, per-rank step time) all compare machines over time, so they need
the same thing: for one metric, a matrix of samples with one row per snapshot
and one column per machine. ``SeriesStore`` builds it incrementally from the
``JobSnapshot``s it is fed, in time order.

Time is the *job* snapshot's monotonic clock (``JobSnapshot.captured.mono``),
the clock of the process that polled all agents: each agent's own
``captured`` instant comes from its own host and cannot be compared across
machines.

A value that could not be read is NaN in the matrix (an unreachable agent, a
GPU field NVML refused), never a made-up zero, so a detector can tell "absent"
from "idle".
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import numpy.typing as npt
from rankscope.contract.snapshot import GpuMetrics, JobSnapshot, MachineSnapshot

FloatArray = npt.NDArray[np.float64]


class Direction(StrEnum):
    """Which side of its peers makes a machine suspect for a metric."""

    HIGH = "high"  # e.g. temperature, step time: higher than peers is bad
    LOW = "low"  # e.g. SM clock: a throttled GPU clocks lower
    BOTH = "both"  # e.g. utilisation: a slow machine can be busier or idler than its peers


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """How a metric is read and compared.

    ``floor`` is the smallest spread that counts as real, in the metric's own
    unit: peers that agree perfectly (a standard deviation of zero) would
    otherwise make any tiny difference an outlier. ``scale_floor`` is the
    smallest scale used to normalise the metric for distances (Minder), so a
    metric near zero (an idle CPU) does not turn noise into big ratios.
    """

    name: str
    label: str
    unit: str
    direction: Direction
    floor: float
    scale_floor: float


# The metrics the store extracts, machine level. GPU metrics are folded over a
# machine's GPUs by the side that matters (the hottest GPU, the slowest clock),
# since one bad GPU is what slows a machine and a mean would hide it.
METRICS: Mapping[str, MetricSpec] = {
    s.name: s
    for s in (
        MetricSpec("step_time_s", "step time", "s", Direction.HIGH, 0.005, 0.01),
        MetricSpec("proc_cpu_percent", "rank process CPU", "%", Direction.BOTH, 2.0, 10.0),
        MetricSpec("host_cpu_percent", "host CPU", "%", Direction.BOTH, 2.0, 10.0),
        MetricSpec("host_mem_percent", "host memory", "%", Direction.HIGH, 1.0, 10.0),
        MetricSpec("host_load_1m", "load (1 min)", "", Direction.HIGH, 0.2, 1.0),
        MetricSpec("gpu_util_percent", "GPU utilisation", "%", Direction.BOTH, 2.0, 10.0),
        MetricSpec("gpu_mem_used_percent", "GPU memory used", "%", Direction.BOTH, 1.0, 10.0),
        MetricSpec("gpu_power_w", "GPU power", "W", Direction.BOTH, 5.0, 50.0),
        MetricSpec("gpu_temperature_c", "GPU temperature", "°C", Direction.HIGH, 1.0, 20.0),
        MetricSpec("gpu_sm_clock_mhz", "GPU SM clock", "MHz", Direction.LOW, 15.0, 200.0),
        MetricSpec("gpu_pcie_kbps", "PCIe throughput", "kB/s", Direction.BOTH, 1000.0, 10000.0),
        MetricSpec("gpu_nvlink_kbps", "NVLink throughput", "kB/s", Direction.BOTH, 1000.0, 10000.0),
    )
}


def _mean(values: Iterable[float | None]) -> float:
    got = [float(v) for v in values if v is not None and math.isfinite(v)]
    return sum(got) / len(got) if got else math.nan


def _fold(gpus: tuple[GpuMetrics, ...], attr: str, how: str) -> float:
    vals = [float(v) for g in gpus if (v := getattr(g, attr)) is not None and math.isfinite(float(v))]
    if not vals:
        return math.nan
    if how == "max":
        return max(vals)
    if how == "min":
        return min(vals)
    return sum(vals) / len(vals)


def _sum_pair(a: float | None, b: float | None) -> float | None:
    if a is None and b is None:
        return None
    return (a or 0.0) + (b or 0.0)


def machine_metrics(m: MachineSnapshot) -> dict[str, float]:
    """One machine's metric values in one snapshot (NaN where not read); step time excluded.

    Step time needs the previous snapshot, so ``SeriesStore`` derives it.
    """
    out: dict[str, float] = dict.fromkeys(METRICS, math.nan)
    if not m.reachable:
        return out
    out["proc_cpu_percent"] = _mean(r.process.cpu_percent for r in m.ranks if r.process is not None)
    if m.host is not None:
        h = m.host
        out["host_cpu_percent"] = h.cpu_percent if h.cpu_percent is not None else math.nan
        if h.mem_used_bytes is not None and h.mem_total_bytes:
            out["host_mem_percent"] = 100.0 * h.mem_used_bytes / h.mem_total_bytes
        out["host_load_1m"] = h.load_1m if h.load_1m is not None else math.nan
    if m.gpus is not None and m.gpus.available and m.gpus.gpus:
        gs = m.gpus.gpus
        out["gpu_util_percent"] = _fold(gs, "util_percent", "mean")
        out["gpu_power_w"] = _fold(gs, "power_w", "mean")
        out["gpu_temperature_c"] = _fold(gs, "temperature_c", "max")
        out["gpu_sm_clock_mhz"] = _fold(gs, "sm_clock_mhz", "min")
        out["gpu_mem_used_percent"] = _mean(
            100.0 * g.mem_used_bytes / g.mem_total_bytes for g in gs if g.mem_used_bytes is not None and g.mem_total_bytes
        )
        out["gpu_pcie_kbps"] = _mean(_sum_pair(g.pcie_tx_kbps, g.pcie_rx_kbps) for g in gs)
        out["gpu_nvlink_kbps"] = _mean(_sum_pair(g.nvlink_tx_kbps, g.nvlink_rx_kbps) for g in gs)
    return out


@dataclass(slots=True)
class _StepState:
    """What is needed to turn a rank's step counter into a step duration."""

    steps: int
    advanced_at: float  # job mono time at which the counter was last seen to move


METRIC_NAMES: tuple[str, ...] = tuple(METRICS)
_METRIC_INDEX: dict[str, int] = {name: i for i, name in enumerate(METRIC_NAMES)}


@dataclass(frozen=True, slots=True)
class _Row:
    """One snapshot's values: machine columns in the store's first-seen order.

    ``values`` is (metrics, machines known at that time); machines seen later
    are NaN in older rows. Ranks are kept as two parallel arrays.
    """

    t: float
    values: FloatArray
    ranks: npt.NDArray[np.int64]
    rank_steps: FloatArray
    job_step: float  # median step time over the ranks that have one (NaN if none)


class SeriesStore:
    """A bounded, time-ordered record of metric values per machine and rank.

    Feed it snapshots oldest first with ``add``; rows older than ``max_age_s``
    (relative to the newest) are dropped so a long watch stays small. A
    snapshot not newer than the last one is ignored (a replayed or reordered
    poll must not create a step of zero seconds).
    """

    def __init__(self, max_age_s: float = 900.0, max_rows: int = 4096) -> None:
        self.max_age_s = max_age_s
        self._rows: deque[_Row] = deque(maxlen=max_rows)
        self._steps: dict[int, _StepState] = {}
        self._machines: dict[str, int] = {}  # name -> column, first seen first
        self._rank_machine: dict[int, str] = {}
        # An unreachable agent is reported under its address; the name it gave
        # while it answered is kept so its column does not change identity.
        self._names: dict[str, str] = {}
        self._ranks_by_machine: dict[str, tuple[int, ...]] | None = None  # cache of ranks_of, reset by add
        self.missing_machines: tuple[str, ...] = ()
        self.reachable_machines: tuple[str, ...] = ()
        self.missing_ranks: tuple[int, ...] = ()

    # ---- feeding ---------------------------------------------------------

    def add(self, snapshot: JobSnapshot) -> bool:
        """Record one snapshot; returns False (and records nothing) if it is not newer."""
        t = snapshot.captured.mono
        if self._rows and t <= self._rows[-1].t:
            return False
        per_machine: dict[str, dict[str, float]] = {}
        rank_step: dict[int, float] = {}
        self._ranks_by_machine = None
        for m in snapshot.machines:
            if m.reachable:
                self._names[m.address] = m.machine
            name = self.name_of(m)
            self._machines.setdefault(name, len(self._machines))
            for r in m.ranks:
                self._rank_machine[r.rank] = name
            for c in m.counters:
                self._rank_machine.setdefault(c.rank, name)
            values = machine_metrics(m)
            steps: list[float] = []
            if m.reachable:
                for c in m.counters:
                    step = self._step_time(c.rank, c.steps, c.last_step_duration_s, t)
                    if step is not None:
                        rank_step[c.rank] = step
                        steps.append(step)
            values["step_time_s"] = float(np.median(steps)) if steps else math.nan
            per_machine[name] = values
        table = np.full((len(METRIC_NAMES), len(self._machines)), np.nan, dtype=np.float64)
        for name, values in per_machine.items():
            table[:, self._machines[name]] = [values[k] for k in METRIC_NAMES]
        ranks = np.array(sorted(rank_step), dtype=np.int64)
        steps_arr = np.array([rank_step[int(r)] for r in ranks], dtype=np.float64)
        job_step = float(np.median(steps_arr)) if steps_arr.size else math.nan
        self._rows.append(_Row(t, table, ranks, steps_arr, job_step))
        while self._rows and t - self._rows[0].t > self.max_age_s:
            self._rows.popleft()
        self.missing_machines = tuple(self.name_of(m) for m in snapshot.machines if not m.reachable)
        self.reachable_machines = tuple(m.machine for m in snapshot.machines if m.reachable)
        seen = {c.rank for m in snapshot.machines for c in m.counters} | {r.rank for m in snapshot.machines for r in m.ranks}
        world = snapshot.world_size
        self.missing_ranks = tuple(sorted(set(range(world)) - seen)) if world else ()
        return True

    def name_of(self, m: MachineSnapshot) -> str:
        """The machine's name, also while its agent is unreachable (then reported by address)."""
        return m.machine if m.reachable else self._names.get(m.address, m.machine)

    def _step_time(self, rank: int, steps: int | None, last_duration: float | None, t: float) -> float | None:
        """The rank's current step duration, or None when it cannot be told yet.

        The plugin's own ``last_step_duration_s`` is preferred. Without it the
        duration is derived from how many steps passed between two polls. In
        both cases a rank whose counter has not moved for longer than its last
        step took is reported with the time it has been stuck, so a rank that
        slows to a crawl shows a growing step time instead of its old one.
        """
        value: float | None = None
        prev = self._steps.get(rank)
        if steps is not None:
            if prev is None or steps < prev.steps:  # first sight, or a restarted job
                self._steps[rank] = _StepState(steps, t)
            elif steps > prev.steps:
                if last_duration is None:
                    value = (t - prev.advanced_at) / (steps - prev.steps)
                self._steps[rank] = _StepState(steps, t)
            else:
                stuck = t - prev.advanced_at
                if last_duration is not None and stuck > last_duration:
                    value = stuck
        if value is None and last_duration is not None and math.isfinite(last_duration):
            value = last_duration
        return value

    # ---- reading ---------------------------------------------------------

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def now(self) -> float | None:
        """Time of the newest snapshot (job monotonic seconds)."""
        return self._rows[-1].t if self._rows else None

    @property
    def machines(self) -> tuple[str, ...]:
        return tuple(self._machines)

    def ranks_of(self, machine: str) -> tuple[int, ...]:
        if self._ranks_by_machine is None:
            by: dict[str, list[int]] = {}
            for r, m in self._rank_machine.items():
                by.setdefault(m, []).append(r)
            self._ranks_by_machine = {m: tuple(sorted(rs)) for m, rs in by.items()}
        return self._ranks_by_machine.get(machine, ())

    def rank_machine(self) -> dict[int, str]:
        return dict(self._rank_machine)

    def _select(self, since: float | None, last: int | None) -> list[_Row]:
        """Rows at or after ``since`` (job mono seconds), at most the ``last`` newest."""
        rows = self._rows
        start = 0
        if since is not None:
            start = bisect.bisect_left([r.t for r in rows], since)
        if last is not None:
            start = max(start, len(rows) - last)
        return [rows[i] for i in range(start, len(rows))]

    def times(self, since: float | None = None, last: int | None = None) -> FloatArray:
        return np.array([r.t for r in self._select(since, last)], dtype=np.float64)

    def matrix(self, metric: str, since: float | None = None, last: int | None = None,
               ) -> tuple[FloatArray, tuple[str, ...], FloatArray]:
        """``(times, machines, values)`` with values shaped (len(times), len(machines)), NaN where absent.

        ``since`` keeps rows at or after that job time; ``last`` keeps at most
        that many of the newest rows.
        """
        if metric not in _METRIC_INDEX:
            raise KeyError(f"unknown metric {metric!r}; known: {', '.join(METRIC_NAMES)}")
        k = _METRIC_INDEX[metric]
        rows = self._select(since, last)
        machines = self.machines
        values = np.full((len(rows), len(machines)), np.nan, dtype=np.float64)
        for i, row in enumerate(rows):
            values[i, : row.values.shape[1]] = row.values[k]
        return np.array([r.t for r in rows], dtype=np.float64), machines, values

    def job_steps(self) -> tuple[FloatArray, FloatArray]:
        """The job's step time (median over ranks) per row: ``(times, values)``, NaN where none."""
        return (np.array([r.t for r in self._rows], dtype=np.float64),
                np.array([r.job_step for r in self._rows], dtype=np.float64))

    def latest_rank_steps(self) -> dict[int, float]:
        """The newest step time of each rank that has one."""
        if not self._rows:
            return {}
        row = self._rows[-1]
        return {int(r): float(v) for r, v in zip(row.ranks, row.rank_steps, strict=True)}

    def latest(self, metric: str) -> dict[str, float]:
        """The newest value of ``metric`` per machine (NaN where absent)."""
        _, machines, values = self.matrix(metric, last=1)
        if values.shape[0] == 0:
            return {}
        return dict(zip(machines, values[0].tolist(), strict=True))


# --------------------------------------------------------------------------
# Persistence: how long a condition has held
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Run:
    """A condition that has held without a break since ``since`` (last seen at ``last``)."""

    since: float
    last: float

    @property
    def held_s(self) -> float:
        return self.last - self.since


class RunTracker:
    """Tracks, per key, since when a condition has held in consecutive updates.

    Continuity (Minder §3.2) and "for the lasting T" (Aegis §5.1) are the same
    idea: a condition must hold in every update for a while before it counts.
    A key absent from one update has its run broken and restarted later.
    """

    def __init__(self) -> None:
        self._runs: dict[object, Run] = {}

    def update(self, t: float, keys: Iterable[object]) -> dict[object, Run]:
        """Record that exactly ``keys`` hold at time ``t``; returns their runs."""
        now = set(keys)
        runs = {k: Run(self._runs[k].since if k in self._runs else t, t) for k in now}
        self._runs = runs
        return dict(runs)

    def get(self, key: object) -> Run | None:
        return self._runs.get(key)
