"""The app's state as a pure function of what it received.

Every snapshot (a poll or a capture) is first digested into a ``PollDigest``
(off the UI thread: it walks every rank's counters), then folded into an
immutable ``AppState`` by ``apply_*`` reducers. Widgets draw from the state
only, so the same sequence of snapshots always draws the same screens: two
engineers attached to the same agents see the same thing, and a recorded
bundle replays exactly.

Times shown are taken from the snapshots, never from the clock here: ``now``
is passed in (the receive time when live, the bundle's own time offline).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime

import numpy as np
from rankscope.actions.model import RESTART_REQUESTED, ActionKind, ActionState, AuditRecord
from rankscope.analyzers.metric_outliers import snapshot_outliers
from rankscope.analyzers.progress import mid_step_window
from rankscope.analyzers.series import METRICS as SERIES_METRICS
from rankscope.analyzers.topology import compact_ranks
from rankscope.contract.snapshot import (
    GpuMetrics,
    HostMetrics,
    JobSnapshot,
    Layout,
    MachineSnapshot,
    RankStacks,
    main_thread,
)
from rankscope.tui.analysis import StackView
from rankscope.tui.failslow_state import FailSlowView
from rankscope.tui.state_actions import ActionsState, audit_line_text, drop_notes, log_note, log_record

HISTORY = 60  # points kept for sparklines (one per poll, about a minute at 1 Hz)
EVENTS_KEPT = 500
# Snapshots kept for `w`: bounded by ranks so 16k-rank jobs do not eat the memory.
KEPT_RANK_SNAPSHOTS = 65_536


# --------------------------------------------------------------------------
# digests of one snapshot
# --------------------------------------------------------------------------


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
class CommRow:
    """One rank's counters in one communicator, summed over operation kinds."""

    rank: int
    cl: int
    wr: int
    wc: int
    lags: bool  # launched fewer collectives than the others of its communicator
    open_requests: bool  # wc < wr: requests issued and not completed
    stale: bool


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


# Where a rank's main thread is while its process is still starting: importing modules, or meeting the others.
_STARTUP_FILES = ("<frozen importlib",)
_STARTUP_FUNCTIONS = frozenset({"init_process_group", "rendezvous", "_store_based_barrier", "next_rendezvous",
                                "_rendezvous_helper", "_create_tcp_store", "_init_process_group_helper"})


def starting_stack(stacks: RankStacks) -> bool:
    """Whether a rank's stack shows it still starting (not a steady state to compare with the others')."""
    main = main_thread(stacks.main)
    if main is None:
        return False
    return any(f.filename.startswith(_STARTUP_FILES) or f.name in _STARTUP_FUNCTIONS for f in main.frames)


def importing_stack(stacks: RankStacks) -> bool:
    """Whether a rank's main thread is importing modules (starting, however long imports take on a loaded host)."""
    threads = stacks.main.threads or ()
    main = next((t for t in threads if t.thread_name == "MainThread"), threads[0] if threads else None)
    return main is not None and any(f.filename.startswith(_STARTUP_FILES) for f in main.frames)


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
    totals: dict[str, dict[int, list[int]]] = {}
    stale: set[int] = set()
    steps: int | None = None
    has_stacks = False
    for m in snapshot.machines:
        has_stacks = has_stacks or bool(m.stacks)
        for rc in m.counters:
            if rc.stale or rc.error:
                stale.add(rc.rank)
            if rc.steps is not None:
                steps = rc.steps if steps is None else max(steps, rc.steps)
            for c in rc.communicators:
                members.setdefault(c.comm_id, (c.description, c.backend, c.ranks))
            for op in rc.ops:
                t = totals.setdefault(op.comm_id, {}).setdefault(rc.rank, [0, 0, 0])
                t[0] += op.cl
                t[1] += op.wr
                t[2] += op.wc
    comms: list[CommView] = []
    progress = steps or 0
    for cid in sorted(set(members) | set(totals)):
        desc, backend, ranks = members.get(cid, ("", "", tuple(sorted(totals.get(cid, {})))))
        per = totals.get(cid, {})
        top_cl = max((v[0] for v in per.values()), default=0)
        rows = tuple(
            CommRow(r, v[0], v[1], v[2], v[0] < top_cl, v[2] < v[1], r in stale) for r, v in sorted(per.items())
        )
        done = sum(v[2] for v in per.values())
        progress += done
        missing = tuple(r for r in ranks if r not in per)
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
        metric_rows(machines),
    )


# --------------------------------------------------------------------------
# the state
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, eq=False)
class Series:
    """The last ``HISTORY`` readings of many keys (machines, GPUs, communicators) as one array.

    A 2,048-machine job has 16k GPU keys; one array shifted per poll costs a
    copy, where a tuple per key cost 16k Python objects a second. Each push
    returns a new Series, so older states stay valid (compared by identity).
    """

    keys: tuple[str, ...] = ()
    index: Mapping[str, int] = field(default_factory=dict)
    values: np.ndarray = field(default_factory=lambda: np.empty((0, HISTORY)))

    def get(self, key: str) -> tuple[float, ...]:
        i = self.index.get(key)
        if i is None:
            return ()
        row = self.values[i]
        return tuple(float(x) for x in row[~np.isnan(row)])

    def __contains__(self, key: str) -> bool:
        return key in self.index

    def pushed(self, keys_in: tuple[str, ...], readings: Sequence[float] | np.ndarray) -> Series:
        keys, index = self.keys, self.index
        values = self.values
        if keys_in is keys or keys_in == keys:  # the usual case: the same machines as last time, in the same order
            column = np.asarray(readings, dtype=float)
        else:
            new_keys = [k for k in keys_in if k not in index]
            if new_keys:
                keys = (*keys, *new_keys)
                index = {k: i for i, k in enumerate(keys)}
                values = np.vstack([values, np.full((len(new_keys), HISTORY), np.nan)])
            column = np.full(len(keys), np.nan)
            column[[index[k] for k in keys_in]] = readings
        shifted = np.empty_like(values)
        shifted[:, :-1] = values[:, 1:]
        shifted[:, -1] = column
        return Series(keys, index, shifted)


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


@dataclass(frozen=True, slots=True)
class VerdictMark:
    """What the job was doing when the capture behind the verdict was taken (see ``verdict_stale``)."""

    wall: float  # the capture's time
    restarts: int  # the job's launches seen before it
    progress_mark: float | None  # the job's last progress per its agents then (with clock info)
    progress_count: int  # the summed counters then (without)
    clock_info: bool
    starting: tuple[int, ...] = ()  # ranks caught before their first step
    # The job was making steps when captured: ranks caught at different points of a step differ by timing, so
    # the capture names no suspect (a restart's first step, a view attached to a healthy job, `s` on one).
    running: bool = False
    restarting: bool = False  # taken while the job restarted (an eviction's or a hot-update's): no steady state


@dataclass(frozen=True, slots=True)
class Event:
    wall: float
    kind: str  # capture, verdict, lost, found, capture-failed, hung, resumed, restarted, evicted, action, info
    text: str


# --------------------------------------------------------------------------
# filter
# --------------------------------------------------------------------------

_RANKS = re.compile(r"^\s*r?(\d+)(?:\s*-\s*(\d+))?\s*$")


@dataclass(frozen=True, slots=True)
class Filter:
    """What `/` selects: ranks by number or range, machines by name, or ranks whose stacks contain the text."""

    text: str
    ranks: frozenset[int]

    @property
    def active(self) -> bool:
        return bool(self.text)


NO_FILTER = Filter("", frozenset())


@dataclass(frozen=True, slots=True)
class AppState:
    now_wall: float = 0.0
    layout: Layout | None = None
    job_id: str | None = None
    world_size: int | None = None
    machines: tuple[MachineView, ...] = ()
    comms: tuple[CommView, ...] = ()
    metric_rows: tuple[MetricRow, ...] = ()
    comm_history: Series = field(default_factory=Series)  # completions per communicator
    metric_history: Series = field(default_factory=Series)  # "<machine>/cpu" and "<machine>/gpu<i>" utilisation
    progress_points: tuple[tuple[float, int], ...] = ()
    step_points: tuple[tuple[float, int], ...] = ()
    last_progress_wall: float | None = None
    stacks: StackView | None = None
    capture_wall: float | None = None
    events: tuple[Event, ...] = ()
    kept: tuple[JobSnapshot, ...] = ()
    polls: int = 0
    hung_reported: bool = False
    evicted: frozenset[str] = frozenset()  # machines an eviction took out of the job (from the audit logs)
    restarts: int = 0  # times the job's ranks came back with new pids (an eviction, a hot-update, a relaunch)
    rank_pids: Mapping[int, int] = field(default_factory=dict)  # each rank's last seen pid
    clock: JobClock | None = None  # the job's state per its agents (None: they do not report it)
    verdict: VerdictMark | None = None  # what the job was doing when ``stacks`` was captured
    evicted_addresses: frozenset[str] = frozenset()  # agents taken out of the job (hostfile, audit)
    awaiting_restart: bool = False  # an eviction succeeded and the job has not come back yet: not "finished"
    # Machines whose agents went away while the job restarted: "restarting" (not lost) until they answer again,
    # also after the job's ranks came back (an idle standby's agent, one slower than the rest).
    restarting: frozenset[str] = frozenset()
    # What the session is (fixed at start): drawn in the header and deciding what the screens offer.
    source_label: str = ""
    read_only: bool = False
    hang_after_s: float = 30.0  # no progress this long is a hang (the one setting: --hang-after)
    # What the person and the services set (apply_filter, apply_failslow, apply_audit, ...).
    filter: Filter = NO_FILTER
    failslow: FailSlowView | None = None  # the fail-slow detectors' latest view (view 7)
    actions: ActionsState = field(default_factory=ActionsState)
    # Capture scheduling (see ``capture_due``): a capture is running; the automatic capture waits for the job's
    # first step; the job's ranks have shown counters; the progress mark whose stop was captured already.
    capturing: bool = False
    capture_after_start: bool = False
    job_counts: bool = False
    hang_captured_for: float | None = None

    @property
    def lost(self) -> tuple[str, ...]:
        """Machines whose agent does not answer; evicted ones are not lost, they were taken out on purpose."""
        return tuple(m.name for m in self.machines if not m.reachable and not m.evicted and m.name not in self.restarting)

    @property
    def job_machines(self) -> tuple[MachineView, ...]:
        return tuple(m for m in self.machines if not m.evicted)

    def machine_of_rank(self) -> dict[int, str]:
        return {r: m.name for m in self.machines for r in m.ranks}


def fmt_time(wall: float | None) -> str:
    if wall is None:
        return "-"
    return datetime.fromtimestamp(wall, UTC).strftime("%H:%M:%S")


def _with_events(state: AppState, events: Iterable[Event]) -> tuple[Event, ...]:
    """The events in time order (stable: one poll's events keep their order). An agent's audit record carries its
    own time, earlier than what this view already logged: appended as it came, the newest-first list put 08:43:38
    above 08:43:39."""
    new = tuple(events)
    if new and state.events:
        # The same moment told twice (the agents' journal and an audit stream, both replayed at attach) is one event.
        first = min(e.wall for e in new)
        have = {(e.wall, e.kind, e.text) for e in state.events if e.wall >= first}
        new = tuple(e for e in new if (e.wall, e.kind, e.text) not in have)
    if not new:
        return state.events
    merged = (*state.events, *new)
    if state.events and min(e.wall for e in new) < state.events[-1].wall:
        merged = tuple(sorted(merged, key=lambda e: e.wall))
    return merged[-EVENTS_KEPT:]


JOURNAL_KINDS = frozenset({"hung", "verdict", "evicted", "restarted", "resumed", "action"})
_FINAL_WORDS = (" succeeded on ", " failed on ", " refused on ", " cancelled on ")


def journal_worthy(event: Event) -> bool:
    """An event the agents' incident journal keeps for a view attached later: the hang, verdicts that name
    suspects, how actions ended, evictions, restarts and resumed training (not captures, polls or action steps)."""
    if event.kind not in JOURNAL_KINDS:
        return False
    if event.kind == "verdict":
        return not event.text.startswith("no verdict")
    if event.kind == "action":
        return any(w in event.text for w in _FINAL_WORDS)
    return True


def apply_journal(state: AppState, entries: Iterable[tuple[float, str, str]]) -> AppState:
    """The agents' journal (wall, kind, text): what happened before this view attached, as events, each once."""
    return replace(state, events=_with_events(state, [Event(w, k, t) for w, k, t in entries]))


_UPDATE_TARGET = re.compile(r" to (.+) \((?:immediate|lazy)\)$")


def code_version(state: AppState) -> str | None:
    """The code the job runs since its latest hot-update or rollback that succeeded (None: none seen)."""
    for record in reversed(state.actions.log.history()):
        if record.result == ActionState.SUCCEEDED.value:
            m = _UPDATE_TARGET.search(record.what)
            return m.group(1) if m else None
    return None


def apply_snapshot(state: AppState, d: PollDigest, now_wall: float) -> AppState:
    """Fold one poll (or the counters and metrics of a capture) into the state."""
    hang_after_s = state.hang_after_s
    events: list[Event] = []
    before = {m.name: m.reachable for m in state.machines}
    for m in d.machines:
        if m.name in state.evicted or m.address in state.evicted_addresses:
            continue  # its agent going away is the eviction's doing, not news
        was = before.get(m.name)
        if was is False and m.reachable and m.name in state.restarting:
            events.append(Event(now_wall, "found", f"{m.name} is back after the restart"))
        elif was is True and not m.reachable and state.awaiting_restart:
            # The launcher restarts the job's agents with it (an eviction, a hot-update): one word for it everywhere.
            events.append(Event(now_wall, "restarting", f"{m.name} restarting with the job"))
        elif was is True and not m.reachable:
            events.append(Event(now_wall, "lost", f"agent {m.name} ({m.address}) lost: {m.error or 'no answer'}"))
        elif was is False and m.reachable:
            events.append(Event(now_wall, "found", f"agent {m.name} ({m.address}) is back"))
        elif was is None and not m.reachable:
            events.append(Event(now_wall, "lost", f"agent {m.name} ({m.address}) unreachable: {m.error or 'no answer'}"))
    # A lost machine keeps its last known ranks and metrics so the map keeps its shape.
    old = {m.name: m for m in state.machines}
    machines = tuple(
        replace(old[m.name], reachable=False, error=m.error) if not m.reachable and m.name in old else m
        for m in d.machines
    )
    names = {m.name for m in machines}
    addresses = {m.address for m in machines}
    # A machine missing from this poll is kept (lost), unless its agent now answers under its name: an agent that
    # did not answer a view's first poll was known by its address, and that stand-in stayed as a 7th machine.
    machines += tuple(replace(m, reachable=False, error="missing from the last poll") for m in state.machines
                      if m.name not in names and m.address not in addresses)
    machines = _mark_evicted(machines, state.evicted, state.evicted_addresses)
    metric_rows = _mark_evicted_rows(d.metric_rows, frozenset(m.name for m in machines if m.evicted))
    restarted, rank_pids = _restarted(state.rank_pids, machines)
    restarting = frozenset(
        m.name for m in machines if not m.reachable and not m.evicted
        and (m.name in state.restarting or (state.awaiting_restart and before.get(m.name) is not False)))
    if restarted:
        # A warm restart resumes the job before every machine's agent is back: those are named too, in place.
        on = ", ".join(m.name if m.reachable else f"{m.name} (agent not back yet)" for m in machines
                       if not m.evicted and (m.ranks or not m.reachable))
        # The machines first: at the end of a long line a notification covered the standbys that joined.
        version = code_version(state)
        code = f"; code {version}" if version else ""
        # Ranks that now run on another machine (a standby took an evicted machine's place): said, not left to
        # the rank map to show silently.
        was_on = state.machine_of_rank()
        moved_ranks: dict[str, list[int]] = {}
        for m in machines:
            if m.reachable and not m.evicted:
                for r in m.ranks:
                    if was_on.get(r) != m.name:
                        moved_ranks.setdefault(m.name, []).append(r)
        placed = "".join(f"; ranks {compact_ranks(sorted(rs), 6)} now on {name}"
                         for name, rs in sorted(moved_ranks.items()))
        events.append(Event(now_wall, "restarted",
                            f"the job restarted on {on}: its ranks run under new pids{placed}{code}"))
        # Counters start again in the new processes: the old progress and step points would read as a
        # hang or a negative rate.
        state = replace(state, progress_points=(), step_points=(), last_progress_wall=None, hung_reported=False)
    metric_history = state.metric_history.pushed(d.metric_keys, d.metric_values)
    comms = d.comms if d.comms else state.comms
    comm_history = state.comm_history.pushed(d.comm_keys, d.comm_values) if d.comms else state.comm_history
    progress_points = (*state.progress_points, (d.wall, d.progress))[-HISTORY:]
    step_points = state.step_points
    if d.steps is not None:
        step_points = (*step_points, (d.wall, d.steps))[-HISTORY:]
    clock = job_clock(machines)
    last_progress = state.last_progress_wall
    hung_reported = state.hung_reported
    if clock is not None:
        # The agents remember when the job last progressed: a view attached late says what an early one says.
        moved = clock.progress_mark is not None and (last_progress is None or clock.progress_mark > last_progress)
        if moved and last_progress is None and state.restarts + restarted > 0:
            events.append(Event(now_wall, "resumed", f"training runs again: first step at {fmt_time(clock.progress_mark)}"))
        elif moved and hung_reported:
            events.append(Event(now_wall, "resumed", "progress resumed"))
        if moved:
            hung_reported = False
        last_progress = clock.progress_mark
        age = clock.progress_age_s if clock.progress_mark is not None else clock.start_age_s
        known = clock.progress_mark is not None or bool(clock.starting)  # else: nothing tells a hang from a start
        if clock.running and known and not moved and not hung_reported and age is not None and age >= hang_after_s:
            since = clock.progress_mark if clock.progress_mark is not None else clock.start_mark
            events.append(Event(now_wall, "hung", f"no progress since {fmt_time(since)}"))
            hung_reported = True
    else:
        moved = not state.progress_points or d.progress != state.progress_points[-1][1]
        if moved or last_progress is None:
            last_progress = d.wall
        if moved and hung_reported and state.progress_points:
            events.append(Event(now_wall, "resumed", "progress resumed"))
            hung_reported = False
        elif not moved and not hung_reported and d.wall - last_progress >= hang_after_s and d.progress > 0:
            events.append(Event(now_wall, "hung", f"no progress since {fmt_time(last_progress)}"))
            hung_reported = True
    world = d.world_size or state.world_size
    limit = max(2, KEPT_RANK_SNAPSHOTS // max(1, world or 1))
    kept = (*state.kept, d.snapshot)[-limit:]
    return replace(
        state,
        now_wall=now_wall,
        layout=d.snapshot.layout or state.layout,
        job_id=d.snapshot.job_id or state.job_id,
        world_size=world,
        machines=machines,
        comms=comms,
        metric_rows=metric_rows,
        comm_history=comm_history,
        metric_history=metric_history,
        progress_points=progress_points,
        step_points=step_points,
        last_progress_wall=last_progress,
        events=_with_events(state, events),
        kept=kept,
        polls=state.polls + 1,
        hung_reported=hung_reported,
        restarts=state.restarts + (1 if restarted else 0),
        rank_pids=rank_pids,
        clock=clock,
        awaiting_restart=state.awaiting_restart and not restarted,
        restarting=restarting,
    )


def _mark_evicted(machines: tuple[MachineView, ...], evicted: frozenset[str],
                  addresses: frozenset[str] = frozenset()) -> tuple[MachineView, ...]:
    """Evicted machines (by name, or by agent address) hold no ranks (theirs run elsewhere now) and go last."""
    out = [m for m in machines if m.name in evicted or m.address in addresses]
    if not out:
        return machines
    kept = tuple(m for m in machines if not (m.name in evicted or m.address in addresses))
    gone = tuple(replace(m, evicted=True, ranks=(), pids=(), starting=(), unknown=()) for m in out)
    return kept + gone


def _mark_evicted_rows(rows: tuple[MetricRow, ...], evicted: frozenset[str]) -> tuple[MetricRow, ...]:
    """The metrics view's rows of evicted machines say so and go last (their agents answer no more: not lost)."""
    if not evicted or not any(r.machine in evicted for r in rows):
        return rows
    return (tuple(r for r in rows if r.machine not in evicted)
            + tuple(replace(r, evicted=True, outliers=frozenset()) for r in rows if r.machine in evicted))


def _restarted(known: Mapping[int, int], machines: Sequence[MachineView]) -> tuple[bool, Mapping[int, int]]:
    """Whether the job's ranks came back as new processes, and the pids now known per rank.

    Restarted: none of the ranks seen now has the pid it last had. The last
    pid of each rank is remembered across polls where the rank is not seen
    (agents restarting with the job, a job between its stop and its start).
    """
    seen = {r: pid for m in machines if m.reachable for r, pid in zip(m.ranks, m.pids, strict=False)}
    if not seen:
        return False, known
    both = seen.keys() & known.keys()
    restarted = bool(both) and all(known[r] != seen[r] for r in both)
    return restarted, {**known, **seen}


def apply_evicted(state: AppState, machines: Iterable[str], now_wall: float, addresses: Iterable[str] = ()) -> AppState:
    """An eviction of ``machines`` succeeded (an agent's audit log), or the hostfile marks ``addresses`` evicted."""
    new = frozenset(machines) - state.evicted
    new_addresses = frozenset(addresses) - state.evicted_addresses
    if not new and not new_addresses:
        return state
    evicted = state.evicted | new
    evicted_addresses = state.evicted_addresses | new_addresses
    names = sorted((new | {m.name for m in state.machines if m.address in new_addresses}) - state.evicted)
    events = [Event(now_wall, "evicted", f"evicted {' '.join(names)}: out of the job, its ranks restart elsewhere")] \
        if names else []
    s = replace(state, evicted=evicted, evicted_addresses=evicted_addresses,
                machines=_mark_evicted(state.machines, evicted, evicted_addresses),
                events=_with_events(state, events), awaiting_restart=state.awaiting_restart or bool(new))
    # A note on an evicted machine's audit stream (its agent stopped as the eviction ran) is no longer news.
    return replace(s, actions=replace(s.actions, log=drop_notes(s.actions.log, _evicted_addresses(s))))


def apply_capture(state: AppState, d: PollDigest, view: StackView, now_wall: float) -> AppState:
    """A capture carries stacks: fold its counters in, then its analysis, and log verdict changes.

    The verdict is marked with what the job was doing at the capture, so it
    can be told stale later (``verdict_stale``). Ranks caught before their
    first step (importing, at rendezvous) are noted: their stacks are not a
    steady state to compare, unless they have been starting for longer than
    ``hang_after_s`` (then never reaching a step is the problem).
    """
    s = apply_snapshot(state, d, now_wall)
    hang_after_s = s.hang_after_s
    running = health(s).kind in ("healthy", "slow") and making_steps(s)
    events = [Event(now_wall, "capture", f"captured {len(d.snapshot.all_stacks())} ranks' stacks, "
                    f"{len(view.groups)} groups")]
    if running:
        events.append(Event(now_wall, "verdict", running_capture_text(view)))
    elif state.stacks is None or state.stacks.verdict.summary != view.verdict.summary:
        events.append(Event(now_wall, "verdict", view.verdict.summary))
    # Quiet ranks (no step yet in their process) caught importing are starting however long their imports take
    # on a loaded host: a capture of them named a rank "computing" in <module> (pstats.py) and aimed `e` at it.
    importing = {r for r, st in d.snapshot.all_stacks().items() if importing_stack(st)}
    starting = tuple(sorted(r for m in d.machines if m.reachable and m.start_age_s is not None
                            and m.name not in s.evicted and m.address not in s.evicted_addresses
                            for r in (*m.starting, *m.unknown)
                            # A rank with no counters and an ordinary stack is not known to be starting, however
                            # young: were it, a job without counters that hangs early could never be acted on.
                            if (r in m.starting and m.start_age_s < hang_after_s) or r in importing))
    clock = s.clock
    mark = VerdictMark(d.wall, s.restarts, clock.progress_mark if clock is not None else None, d.progress,
                       clock is not None, starting, running, state.awaiting_restart)
    s = replace(s, stacks=view, capture_wall=d.wall, verdict=mark, events=_with_events(s, events))
    # A text filter matches frames: against the new capture's groups it selects other ranks.
    return apply_filter(s, s.filter.text) if s.filter.active else s


def making_steps(state: AppState) -> bool:
    """The job stepped within ``mid_step_window`` of its step time (``rankscope analyze``'s rule too), per its
    agents (or, without their memory, by the readings' progress counts): a capture now finds its ranks mid-step.

    Not the same as "healthy": for ``hang_after_s`` after a job stops it still reads healthy, and a capture then
    (``s`` in the first seconds of a hang) must keep its suspects.
    """
    pts = state.progress_points
    if not pts:
        return False
    rate = step_rate(state)
    window = mid_step_window(1.0 / rate if rate else None)
    clock = state.clock
    if clock is not None:
        return clock.progress_mark is not None and clock.progress_age_s is not None and clock.progress_age_s <= window
    # Steps where the job counts them (its operations move within a step, and a rank stalling mid-step still
    # moved them a moment ago), else the summed operation counters.
    if len(state.step_points) >= 2:
        pts = state.step_points
    now, count = pts[-1]
    earlier = [c for wall, c in pts[:-1] if now - wall <= window]
    return bool(earlier) and earlier[0] != count


def running_capture_text(view: StackView) -> str:
    """What a capture of a job making steps says instead of suspects."""
    n = len(view.verdict.suspects)
    if not n:
        return "no verdict: the job was making progress and every rank's stack agrees"
    what = "the one stack difference between its ranks" if n == 1 else f"the {n} stack differences between its ranks"
    return (f"no verdict: the job was making progress, so {what} (caught at different points of a step) "
            f"{'is' if n == 1 else 'are'} timing, not a fault")


def verdict_stale(state: AppState) -> str | None:
    """Why the verdict on screen no longer describes the job (None: it does).

    A verdict belongs to one capture of one launch in one state: it goes
    stale when the job restarts, progresses after it, or has no ranks left;
    a capture of ranks still starting is never a steady state. A stale
    verdict is shown for reading but never aims an action.
    """
    mark = state.verdict
    if state.stacks is None or mark is None:
        return None
    if mark.restarting:
        return "taken while the job was restarting"
    if state.restarts > mark.restarts:
        return "the job restarted after this capture"
    evicted = state.evicted | {m.name for m in state.machines if m.evicted}
    acted = sorted({m for s in state.stacks.verdict.suspects for m in s.machines} & evicted)
    if acted:
        return f"its suspects {' '.join(acted)} were evicted"
    job = [m for m in state.job_machines if m.reachable]
    silent = any(m.ranks for m in state.job_machines if not m.reachable)  # lost agents keep their last ranks
    if job and not silent and not any(m.ranks for m in job):
        return "the job has no ranks running now"
    if mark.starting:
        return f"taken while ranks {compact_ranks(mark.starting, 4)} were still starting"
    clock = state.clock
    if mark.clock_info and clock is not None:
        # A capture that carried no progress mark (its readings had none) is dated by its own time: a hang's
        # last step before it is no progress after it.
        before = mark.progress_mark if mark.progress_mark is not None else mark.wall
        if clock.progress_mark is not None and clock.progress_mark > before:
            return f"the job progressed after it (last step {fmt_time(clock.progress_mark)})"
    elif state.progress_points and state.progress_points[-1][1] != mark.progress_count:
        return "the job progressed after it"
    return None


def map_groups(state: AppState) -> Mapping[int, int]:
    """The capture's stack group of each rank, for the rank map: none once the job restarted after the capture.

    The new processes have their ranks on other machines (standbys): coloured by the old capture, a standby
    showed the hung rank's group (the injected frame) while the restarted job was still starting.
    """
    if state.stacks is None or (state.verdict is not None and state.restarts > state.verdict.restarts):
        return {}
    return state.stacks.group_of_rank


def apply_failure(state: AppState, what: str, message: str, now_wall: float) -> AppState:
    return replace(state, events=_with_events(state, [Event(now_wall, what, message)]))


def apply_info(state: AppState, message: str, now_wall: float) -> AppState:
    return apply_failure(state, "info", message, now_wall)


# --------------------------------------------------------------------------
# derived figures
# --------------------------------------------------------------------------


def step_rate(state: AppState) -> float | None:
    """Steps per second over the kept window, from the counters (None without step counters)."""
    pts = state.step_points
    if len(pts) < 2 or pts[-1][0] <= pts[0][0]:
        return None
    return (pts[-1][1] - pts[0][1]) / (pts[-1][0] - pts[0][0])


RATE_WINDOW_S = 10.0  # the header's step rate: over this recent window, never the kept minute's average
QUIET_MIN_S = 5.0  # no progress this long (or three usual steps, if longer) is no longer "healthy"


def recent_step_rate(state: AppState, window_s: float = RATE_WINDOW_S) -> float | None:
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


def progress_age(state: AppState) -> float | None:
    """Seconds since the job's last progress (a step, or collective progress), per its agents or the readings."""
    clock = state.clock
    if clock is not None:
        return clock.progress_age_s if clock.running else None
    if state.last_progress_wall is None or not state.progress_points:
        return None
    return max(0.0, state.progress_points[-1][0] - state.last_progress_wall)


def quiet_after(state: AppState) -> float:
    """No progress this long makes the job "stalled" (before it is hung): three usual steps, at least
    ``QUIET_MIN_S``, always before the hang threshold."""
    rate = step_rate(state)
    usual = 3.0 / rate if rate else 0.0
    return min(max(QUIET_MIN_S, usual), 0.8 * state.hang_after_s)


@dataclass(frozen=True, slots=True)
class Health:
    kind: str  # healthy, stalled, hung, slow, starting, idle, finished, unknown
    text: str


def _clock_health(clock: JobClock, hang_after_s: float) -> Health | None:
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
    if clock.progress_age_s >= hang_after_s:
        return Health("hung", f"hung since {fmt_time(clock.progress_mark)} ({clock.progress_age_s:.0f} s)")
    return None


def health(state: AppState) -> Health:
    """What the job is doing now (hung after ``state.hang_after_s`` without progress), read from the state."""
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
            return Health("idle", f"restarting: the agents of the job's ranks restart with it ({len(silent)})")
        # The ranks live on machines whose agents do not answer now: nothing can be said about the job.
        return Health("unknown", f"the agents of the job's ranks do not answer ({len(silent)}): "
                      f"{silent[0].error or 'no answer'}")
    if clock is not None and not clock.running and state.awaiting_restart:
        seen = f" since {fmt_time(clock.seen_mark)}" if clock.seen_mark is not None else ""
        return Health("idle", f"restarting: no ranks running{seen}")
    if clock is not None:
        clocked = _clock_health(clock, hang_after_s)
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
        if since is not None and last[0] - since >= hang_after_s:
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


_BARS = "▁▂▃▄▅▆▇█"


def sparkline(values: Sequence[float], width: int = 12) -> str:
    vals = list(values)[-width:]
    if not vals:
        return ""
    lo, hi = min(vals), max(vals)
    if hi == lo:
        return _BARS[0] * len(vals)
    return "".join(_BARS[min(7, int((v - lo) / (hi - lo) * 7.999))] for v in vals)


def deltas(values: Sequence[float]) -> list[float]:
    return [float(b - a) for a, b in itertools.pairwise(values)]


def compile_filter(text: str, state: AppState) -> Filter:
    text = text.strip()
    if not text:
        return NO_FILTER
    hits: set[int] = set()
    for part in (p for p in text.split(",") if p.strip()):
        m = _RANKS.match(part)
        if m:
            a = int(m.group(1))
            b = int(m.group(2)) if m.group(2) else a
            hits.update(range(min(a, b), max(a, b) + 1))
            continue
        needle = part.strip().lower()
        for mv in state.machines:
            if needle in mv.name.lower() or needle in mv.address.lower():
                hits.update(mv.ranks)
        if state.stacks is not None:
            for g in state.stacks.groups:
                if needle in g.signature.lower() or any(needle in f.lower() for f in g.frames):
                    hits.update(g.ranks)
    return Filter(text, frozenset(hits))


def filter_summary(f: Filter) -> str:
    if not f.active:
        return ""
    return f"filter '{f.text}': {len(f.ranks)} ranks ({compact_ranks(f.ranks, 4) or 'none'})"


def apply_source_label(state: AppState, label: str) -> AppState:
    """What the source reaches, as the header names it ("4 agents", "bundle x.json")."""
    return replace(state, source_label=label)


def apply_filter(state: AppState, text: str) -> AppState:
    """The person typed a filter (`/`); the empty text clears it."""
    return replace(state, filter=compile_filter(text, state))


# --------------------------------------------------------------------------
# what the services post: fail-slow views, audit records, action progress
# --------------------------------------------------------------------------


def apply_failslow(state: AppState, view: FailSlowView) -> AppState:
    """The fail-slow detectors produced a newer view (they compute off the UI thread and post it)."""
    return replace(state, failslow=view)


def apply_audit(state: AppState, address: str, record: AuditRecord) -> AppState:
    """An agent's audit record: a line of the Actions view and an event; a succeeded eviction marks its machines.

    A record seen before (a resumed stream replays from the start) changes nothing.
    """
    log = log_record(state.actions.log, address, record)
    if log is state.actions.log:
        return state
    s = replace(state, actions=replace(state.actions, log=log))
    s = apply_failure(s, "action", audit_line_text(record), record.when)
    if record.kind == ActionKind.EVICT and record.result == ActionState.SUCCEEDED.value:
        s = apply_evicted(s, record.machines, record.when)
    elif record.kind in (ActionKind.HOT_UPDATE, ActionKind.ROLLBACK) and RESTART_REQUESTED in record.message and \
            record.result == ActionState.SUCCEEDED.value:
        # The launcher restarts the job in place on the new code: its agents going away meanwhile is "restarting".
        s = replace(s, awaiting_restart=True)
    return s


def apply_audit_note(state: AppState, address: str, text: str) -> AppState:
    """Why an agent's audit stream is missing (shown under the Actions summary; ``text`` empty: its stream is open
    again). Not for an evicted machine's agent: its stream is no longer followed, and its agent stopping with it
    is no problem to show."""
    if not text:
        return replace(state, actions=replace(state.actions, log=drop_notes(state.actions.log, frozenset({address}))))
    if address in _evicted_addresses(state):
        return state
    if state.awaiting_restart:
        text = f"audit of {machine_name(state, address)}: restarting with the job — reconnecting"
    return replace(state, actions=replace(state.actions, log=log_note(state.actions.log, address, text)))


def machine_name(state: AppState, address: str) -> str:
    """The machine an agent address speaks for (the address itself when no poll named it): toasts name machines."""
    return next((m.name for m in state.machines if m.address == address), address)


def _evicted_addresses(state: AppState) -> frozenset[str]:
    """The agents out of the job: marked evicted by address (hostfile), or speaking for an evicted machine."""
    return state.evicted_addresses | {m.address for m in state.machines if m.name in state.evicted}


def apply_actions(state: AppState, actions: ActionsState) -> AppState:
    """The actions part replaced (``rankscope.tui.state_actions``: a confirm begun or answered, a run ended)."""
    return replace(state, actions=actions)


# --------------------------------------------------------------------------
# capture scheduling: when the app captures by itself
# --------------------------------------------------------------------------


def apply_capture_begun(state: AppState) -> AppState:
    return replace(state, capturing=True)


def apply_capture_ended(state: AppState) -> AppState:
    """A capture was analyzed or failed: another may start."""
    return replace(state, capturing=False)


def apply_await_start(state: AppState) -> AppState:
    """The job restarted (or was starting when attached): the automatic capture waits for its first step --
    ranks importing or at rendezvous are no steady state to compare, and no hang capture fires meanwhile."""
    return replace(state, capture_after_start=True)


def apply_counters_seen(state: AppState, d: PollDigest) -> AppState:
    """A poll: once the job's ranks have shown counters, a rank with none yet is still starting."""
    counts = state.job_counts or d.steps is not None or bool(d.comms)
    return state if counts == state.job_counts else replace(state, job_counts=counts)


def _unknown_for_long(state: AppState, clock: JobClock) -> bool:
    """Ranks with no counters and no step for ``hang_after_s`` since they started: only stacks can tell more.

    New processes have no counter files yet for a while (imports): capturing then caught them mid-import.
    A job whose ranks have shown counters will show them again once the new ranks have imported: on a loaded
    host that took longer than ``hang_after_s``, and a capture then caught a restart mid-import.
    """
    return bool(clock.unknown) and not state.job_counts and (
        clock.start_age_s is None or clock.start_age_s >= state.hang_after_s)


def started_capture_due(state: AppState) -> bool:
    """The capture waiting for the job's first step may go now (it stepped, or only stacks can tell more)."""
    clock = state.clock
    return state.capture_after_start and not state.capturing and (
        clock is None or (not clock.starting and (clock.progress_mark is not None or _unknown_for_long(state, clock))))


def apply_started_captured(state: AppState) -> AppState:
    return replace(state, capture_after_start=False)


def hang_capture_due(state: AppState) -> bool:
    """Progress stopped and this stop was not captured yet.

    After a restart, ranks slow to reach their first step (a loaded host, a backup being restored) are
    captured once they step, not as a hang: that capture caught rendezvous and restore stacks.
    """
    restarting = state.capture_after_start and state.restarts > 0
    return health(state).kind == "hung" and not restarting and \
        state.hang_captured_for != state.last_progress_wall


def apply_hang_captured(state: AppState) -> AppState:
    """The current stop is being captured: no second capture for it."""
    return replace(state, hang_captured_for=state.last_progress_wall)
