"""One snapshot digested into what the views draw: machines, communicators, metric rows and the job's clock.

Digesting walks every rank's counters, so the app does it off the UI thread
(``digest``), once per snapshot; the store folds the ``PollDigest`` in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
from rankscope.analyzers.ccl import CommRow, comm_rows
from rankscope.analyzers.metric_outliers import snapshot_outliers
from rankscope.analyzers.progress import RHYTHM_WARMUP
from rankscope.analyzers.series import METRICS as SERIES_METRICS
from rankscope.analyzers.topology import joined_counters
from rankscope.contract.snapshot import GpuMetrics, HostMetrics, JobSnapshot, MachineSnapshot
from rankscope.tui.startup import starting_stack


@dataclass(frozen=True, slots=True)
class MachineView:
    name: str
    address: str
    reachable: bool
    error: str | None
    ranks: tuple[int, ...]
    host: HostMetrics | None
    gpus: tuple[GpuMetrics, ...]
    gpu_note: str | None
    pids: tuple[int, ...] = ()  # the ranks' main pids: new pids for the same ranks mean the job restarted
    evicted: bool = False  # an eviction of this machine succeeded: it runs none of the job's ranks any more
    # The agent's memory of the job (rankscope.wire.rank_progress), in the agent's clock; ages are measured on the
    # agent's own clock too (its reading's time minus the mark), so no two machines' clocks are compared.
    clock_info: bool = False  # the agent reports these at all (older agents and bundles do not)
    progress_mark: float | None = None  # the latest progress of any of its ranks
    progress_age_s: float | None = None
    start_mark: float | None = None  # the youngest of its rank processes started then
    start_age_s: float | None = None
    # Ranks with no progress yet in their current process: known to be starting (their counters show no step
    # yet, or their stack is in imports or at rendezvous), or of unknown state (no counters, no stack change).
    starting: tuple[int, ...] = ()
    unknown: tuple[int, ...] = ()
    seen_mark: float | None = None  # when it last saw a rank of the job
    seen_age_s: float | None = None


@dataclass(frozen=True, slots=True)
class CommView:
    comm_id: str
    description: str
    backend: str
    ranks: tuple[int, ...]
    rows: tuple[CommRow, ...]
    missing: tuple[int, ...]  # member ranks with no counters
    progress: int  # sum of completed requests: moves while the communicator works
    mismatch: bool  # a member lags in launches or has open requests (computed once, sorted on often)


METRICS = ("cpu", "mem", "load", "gpu", "gmem", "temp", "power")


@dataclass(frozen=True, slots=True)
class MetricRow:
    """One line of the metrics view: a GPU of a machine (or the machine when it has none)."""

    key: str  # "<machine>/gpu<i>" or "<machine>/cpu": the sparkline's key too
    machine: str
    gpu: int | None
    reachable: bool
    ranks: tuple[int, ...]
    values: tuple[float | None, ...]  # in METRICS order
    outliers: frozenset[str]  # names from METRICS that stand out among their peers
    evicted: bool = False  # taken out of the job: its agent is stopped on purpose, not lost


def _pct(used: int | None, total: int | None) -> float | None:
    if used is None or not total:
        return None
    return 100.0 * used / total


# The series specs (direction, noise floor) of the columns, so the view flags what the detector would.
_METRIC_SPECS = tuple(SERIES_METRICS[n] for n in ("host_cpu_percent", "host_mem_percent", "host_load_1m",
                                                  "gpu_util_percent", "gpu_mem_used_percent", "gpu_temperature_c",
                                                  "gpu_power_w"))
_HOST_COLUMNS = 3  # cpu, mem, load: one reading per machine, compared machine with machine


def metric_rows(machines: Sequence[MachineView]) -> tuple[MetricRow, ...]:
    """Rows with their outliers (beyond λ±2δ of their peers, Aegis §5.1: ``snapshot_outliers``), outliers first.

    Host columns compare machines (a machine's GPU rows repeat its host
    reading, which must not count as its own peers); GPU columns compare GPUs.
    """
    raw: list[tuple[str, MachineView, int | None, tuple[float | None, ...]]] = []
    for m in machines:
        h = m.host
        host = (h.cpu_percent, _pct(h.mem_used_bytes, h.mem_total_bytes), h.load_1m) if h else (None, None, None)
        if m.gpus:
            for g in m.gpus:
                raw.append((f"{m.name}/gpu{g.index}", m, g.index,
                            (*host, g.util_percent, _pct(g.mem_used_bytes, g.mem_total_bytes), g.temperature_c,
                             g.power_w)))
        else:
            raw.append((f"{m.name}/cpu", m, None, (*host, None, None, None, None)))
    if not raw:
        return ()
    table = np.array([[np.nan if v is None else v for v in r[3]] for r in raw], dtype=float)
    flags = np.zeros(table.shape, dtype=bool)
    first: dict[str, int] = {}  # machine name -> its first row
    slot: dict[str, int] = {}  # machine name -> its place among the machines
    for i, r in enumerate(raw):
        if r[1].name not in first:
            slot[r[1].name] = len(first)
            first[r[1].name] = i
    of_machine = np.fromiter((slot[r[1].name] for r in raw), dtype=np.intp, count=len(raw))
    host_flags = snapshot_outliers(table[list(first.values()), :_HOST_COLUMNS], _METRIC_SPECS[:_HOST_COLUMNS])
    flags[:, :_HOST_COLUMNS] = host_flags[of_machine]
    flags[:, _HOST_COLUMNS:] = snapshot_outliers(table[:, _HOST_COLUMNS:], _METRIC_SPECS[_HOST_COLUMNS:])
    rows = [MetricRow(key, m.name, gi, m.reachable, m.ranks, vals,
                      frozenset(METRICS[j] for j in np.flatnonzero(flags[i])) if flags[i].any() else frozenset())
            for i, (key, m, gi, vals) in enumerate(raw)]
    order = np.argsort(~flags.any(axis=1), kind="stable")
    return tuple(rows[i] for i in order)


@dataclass(frozen=True, slots=True)
class PollDigest:
    snapshot: JobSnapshot
    wall: float
    machines: tuple[MachineView, ...]
    comms: tuple[CommView, ...]
    steps: int | None  # the most optimizer steps any rank reported
    progress: int  # steps + every collective completion: moves while anything moves
    world_size: int | None
    has_stacks: bool
    # Readings for the sparklines, keyed and ordered here (off the UI thread) so folding them in is one array copy.
    metric_keys: tuple[str, ...] = ()
    metric_values: np.ndarray = field(default_factory=lambda: np.empty(0))
    comm_keys: tuple[str, ...] = ()
    comm_values: np.ndarray = field(default_factory=lambda: np.empty(0))
    metric_rows: tuple[MetricRow, ...] = ()
    # The longest step any rank last reported (its counters' own duration), past its launch's first steps: the job's
    # rhythm from the first poll on, before its progress marks have told enough gaps.
    longest_step_s: float | None = None


def _machine_view(m: MachineSnapshot) -> MachineView:
    err = None
    if m.error is not None:
        err = m.error.message  # its first words say what happened (token refused, nothing listening, ...)
    gpus: tuple[GpuMetrics, ...] = ()
    note = None
    if m.gpus is not None:
        gpus = m.gpus.gpus
        if not m.gpus.available:
            note = m.gpus.reason or "no GPU"
    ranks = sorted(m.ranks, key=lambda r: r.rank)
    wall = m.captured.wall if m.captured is not None else None
    info = m.reachable and wall is not None and (
        m.generation is not None or any(r.started_wall is not None for r in ranks))
    if not info or wall is None:
        return MachineView(m.machine, m.address, m.reachable, err, tuple(r.rank for r in ranks), m.host, gpus, note,
                           tuple(r.pid for r in ranks))
    progress = max((r.last_progress_wall for r in ranks if r.last_progress_wall is not None), default=None)
    start = max((r.started_wall for r in ranks if r.started_wall is not None), default=None)
    pid_of = {r.rank: r.pid for r in ranks}
    known = {c.rank for c in m.counters if not c.error and c.pid in (None, pid_of.get(c.rank))}
    known |= {s.rank for s in m.stacks if starting_stack(s)}
    quiet = [r.rank for r in ranks if r.last_progress_wall is None]
    return MachineView(
        m.machine, m.address, m.reachable, err, tuple(r.rank for r in ranks), m.host, gpus, note,
        tuple(r.pid for r in ranks), clock_info=True,
        progress_mark=progress, progress_age_s=None if progress is None else max(0.0, wall - progress),
        start_mark=start, start_age_s=None if start is None else max(0.0, wall - start),
        starting=tuple(r for r in quiet if r in known), unknown=tuple(r for r in quiet if r not in known),
        seen_mark=m.ranks_seen_wall, seen_age_s=None if m.ranks_seen_wall is None else max(0.0, wall - m.ranks_seen_wall),
    )


_KEYS: dict[tuple[str, ...], tuple[str, ...]] = {}


def _keys(keys: Iterable[str]) -> tuple[str, ...]:
    """The same key tuple object for the same keys, so the UI thread compares by identity, not 16k strings."""
    t = tuple(keys)
    got = _KEYS.get(t)
    if got is None:
        if len(_KEYS) > 8:
            _KEYS.clear()
        _KEYS[t] = got = t
    return got


def digest(snapshot: JobSnapshot) -> PollDigest:
    """Everything the views need from one snapshot, computed once (O(ranks × ops))."""
    machines = sorted(
        (_machine_view(m) for m in snapshot.machines),
        key=lambda mv: (mv.ranks[0] if mv.ranks else 1 << 62, mv.name),
    )
    members: dict[str, tuple[str, str, tuple[int, ...]]] = {}
    steps: int | None = None
    longest: float | None = None
    has_stacks = False
    # one communicator per real group: NCCL's (the plugin's, by hash) joined into the shim's torch groups
    joined = joined_counters(snapshot.all_counters())
    for m in snapshot.machines:
        has_stacks = has_stacks or bool(m.stacks)
        for rc in (joined.get(c.rank, c) for c in m.counters):
            if rc.steps is not None:
                steps = rc.steps if steps is None else max(steps, rc.steps)
                d = rc.last_step_duration_s
                if rc.steps > RHYTHM_WARMUP and d is not None and math.isfinite(d) and d > 0:
                    longest = d if longest is None else max(longest, d)
            for c in rc.communicators:
                members.setdefault(c.comm_id, (c.description, c.backend, c.ranks))
    comms: list[CommView] = []
    progress = steps or 0
    table = comm_rows(joined.get(c.rank, c) for m in snapshot.machines for c in m.counters)  # the CL/WR/WC table
    for cid in sorted(set(members) | set(table)):
        rows = table.get(cid, ())
        desc, backend, ranks = members.get(cid, ("", "", tuple(r.rank for r in rows)))
        done = sum(r.wc for r in rows)
        progress += done
        present = {r.rank for r in rows}
        missing = tuple(r for r in ranks if r not in present)
        mismatch = any(r.lags or r.open_requests for r in rows)
        comms.append(CommView(cid, desc, backend, tuple(ranks), rows, missing, done, mismatch))
    readings: dict[str, float] = {}
    for mv in machines:
        if not mv.reachable:
            continue
        if mv.host is not None and mv.host.cpu_percent is not None:
            readings[f"{mv.name}/cpu"] = mv.host.cpu_percent
        for g in mv.gpus:
            if g.util_percent is not None:
                readings[f"{mv.name}/gpu{g.index}"] = g.util_percent
    return PollDigest(
        snapshot, snapshot.captured.wall, tuple(machines), tuple(comms), steps, progress, snapshot.world_size,
        has_stacks, _keys(readings), np.fromiter(readings.values(), dtype=float, count=len(readings)),
        _keys(c.comm_id for c in comms), np.fromiter((float(c.progress) for c in comms), dtype=float, count=len(comms)),
        metric_rows(machines), longest,
    )


@dataclass(frozen=True, slots=True)
class JobClock:
    """The job's state as its agents remember it, over the machines of the job (evicted ones are not).

    Marks are agent wall-clock times (shown as they are, so every view shows
    the same "since"); ages are measured by each agent on its own clock.
    """

    running: bool  # some machine of the job runs ranks
    progress_mark: float | None  # the job's latest progress in its current launch (None: none yet)
    progress_age_s: float | None
    start_mark: float | None  # the youngest rank process started then
    start_age_s: float | None
    starting: tuple[int, ...]  # ranks known to be before their first step (MachineView.starting)
    unknown: tuple[int, ...]  # ranks with no progress and no way to tell (no counters, no stack change yet)
    seen_mark: float | None  # ranks were last seen then (for a job with none running now)
    seen_age_s: float | None


def _latest(pairs: Iterable[tuple[float | None, float | None]]) -> tuple[float | None, float | None]:
    """The latest mark and the smallest age among machines' (mark, age) pairs."""
    got = [(m, a) for m, a in pairs if m is not None and a is not None]
    if not got:
        return None, None
    return max(m for m, _ in got), min(a for _, a in got)


def job_clock(machines: Sequence[MachineView]) -> JobClock | None:
    """None when no reachable machine of the job reports the agents' memory (older agents, bundles)."""
    ms = [m for m in machines if m.reachable and not m.evicted and m.clock_info]
    if not ms:
        return None
    running = [m for m in ms if m.ranks]
    progress = _latest((m.progress_mark, m.progress_age_s) for m in running)
    start = _latest((m.start_mark, m.start_age_s) for m in running)
    seen = _latest((m.seen_mark, m.seen_age_s) for m in ms)
    starting = tuple(sorted(r for m in running for r in m.starting))
    unknown = tuple(sorted(r for m in running for r in m.unknown))
    return JobClock(bool(running), *progress, *start, starting, unknown, *seen)
