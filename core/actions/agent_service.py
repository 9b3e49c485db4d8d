"""The agent's side of the action protocol: plan, confirm, carry out once, audit, broadcast.

An agent owns one machine. A client names an action and typed arguments
(:class:`~rankscope.actions.model.ActionRequest`); this module turns it into
the procedure the agent was configured with (``--actions-config``), never
into anything a client wrote. The order of every run is fixed:

1. A repeated ``action_id`` gets the recorded result back (the audit log's
   ledger); nothing is done twice, even across an agent restart.
2. Plan again, now: targets must belong to this agent's job -- the machine it
   is and the ranks it sees -- or the request is refused.
3. The confirmation must name exactly the plan's machines and ranks, and for
   eviction carry the typed phrase. Any mismatch refuses; nothing is done.
4. Claim the id, run the procedure in a worker thread, stream its progress,
   record the result.

Every step becomes an audit record (who, when, what, result) and is fanned out
to every ``WatchAudit`` subscriber through its own bounded queue: a slow
subscriber loses nothing (it re-reads the log from its last ``seq``) and never
holds up the action. The action runs as its own task, so a client that
disconnects mid-way does not stop it half done.

Procedures in this version:

``evict``
    ``local`` backend: SIGTERM this machine's rank processes (and their worker
    subprocesses) found by discovery, SIGKILL what is left after the grace
    period, block the machine. Restarting the job without it is left to the
    launcher (torchrun's restarts, the drill, the scheduler); when the config
    names the launcher's warm standbys (``[eviction.local] standbys``, or
    ``standbys_file``, a JSON list the launcher keeps current) the plan lists
    those that would join (minus blocked ones).
    ``slurm`` / ``kubernetes`` / ``command``: the configured
    :class:`~rankscope.actions.evict_backends.EvictionBackend` is called for
    this machine and the machine is blocked when it succeeds.
``hot_update`` / ``rollback``
    :class:`~rankscope.actions.hot_update.HotUpdater` switches the code link
    (immediate) or records a pending lazy update. The agent does not stop the
    ranks itself: on an immediate switch it records "restart requested" and
    the launcher restarts them on the new code. A pending lazy update is
    applied by :meth:`ActionService.supervise_once` (the agent calls it
    periodically): when its window expired (switch, "restart requested") or
    when the agent saw its ranks die (switch only: the job is restarting
    anyway), and by :func:`apply_pending` in a launcher's restart path.
``backup``
    Write ``<state dir>/backup.request``; the ranks' in-process plugin
    (``rankscope.ccl_plugin.backup``) snapshots parameters and optimizer state
    at the next step boundaries and writes each shard with its SHA-256 to this
    agent's store (``<state dir>/shards``) and to its backup peer's. The agent
    waits for a new shard of each of its ranks, verifies it and reports the
    shards it holds (its own ranks' and its peers' copies).

No grpc here: ``rankscope.agent`` wraps this service in the RPCs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import tomllib
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from rankscope.actions.agent_protocol import Confirmation, confirmation_problem
from rankscope.actions.audit import AuditLog
from rankscope.actions.blocklist import Blocklist
from rankscope.actions.evict_backends import (
    BACKENDS,
    EvictionBackend,
    KubernetesBackend,
    SiteCommandBackend,
    SlurmBackend,
)
from rankscope.actions.history import HotUpdateHistory, UpdateKind, UpdateRecord, Version
from rankscope.actions.hot_update import CodeVersions, HotUpdater, JobEvent, JobEventKind
from rankscope.actions.model import (
    ActionKind,
    ActionPlan,
    ActionProgress,
    ActionRequest,
    ActionResult,
    ActionState,
    AuditRecord,
    BackupArgs,
    EvictArgs,
    HotUpdateArgs,
    ProcessRef,
    RollbackArgs,
    Targets,
    UpdateMode,
    VersionSource,
    check_machine,
    confirm_phrase_for,
)
from rankscope.ccl_plugin.backup import REQUEST_FILE, SHARDS_DIR
from rankscope.errors import RankscopeError
from rankscope.snapshot import Layout, RankInfo

DEFAULT_GRACE_S = 10.0
BACKUP_WAIT_S = 60.0  # for every rank to reach a step boundary and write its shard
SUBSCRIBER_QUEUE = 256  # records a watcher may lag behind before it re-reads the log
CONFIG_FIX = "see `rankscope agent --help` for the --actions-config format"
PROGRESS = "progress"  # the audit result of an intermediate step
# In an action's audit records: the code link was switched and the launcher is to restart the ranks on it.
RESTART_REQUESTED = "restart requested"
SUPERVISE_INTERVAL_S = 5.0  # how often the agent checks a pending lazy update's window and its ranks


# --------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class EvictionSettings:
    """Which backend evicts, and its settings (keyword arguments of the backend's class)."""

    backend: str = "local"
    grace_s: float = DEFAULT_GRACE_S  # local: SIGTERM, then SIGKILL after this long
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HotUpdateSettings:
    current: Path  # the link the job runs its code from
    versions_dir: Path
    repo: Path | None = None
    git: str = "git"


@dataclass(frozen=True, slots=True)
class ActionsConfig:
    """The procedures an agent may carry out, and where it keeps its state."""

    state_dir: Path
    eviction: EvictionSettings = field(default_factory=EvictionSettings)
    hot_update: HotUpdateSettings | None = None
    layout: Layout | None = None  # for the backup plan
    backup_wait_s: float = BACKUP_WAIT_S  # how long a backup waits for the ranks' shards
    backup_align_steps: int = 1  # ranks snapshot at step multiples of this (> the steps between agents' requests)

    @property
    def audit_path(self) -> Path:
        return self.state_dir / "audit.sqlite"

    @property
    def blocklist_path(self) -> Path:
        return self.state_dir / "blocklist.sqlite"

    @property
    def history_path(self) -> Path:
        return self.state_dir / "hot_update_history.sqlite"


_BACKEND_KEYS: dict[str, frozenset[str]] = {
    "local": frozenset({"standbys", "standbys_file"}),
    "slurm": frozenset({"job_id", "restart", "step_id", "scontrol", "scancel", "sinfo", "standby_partition",
                        "standby_reservation", "timeout_s"}),
    "kubernetes": frozenset({"namespace", "selector", "kubectl", "context", "timeout_s"}),
    "command": frozenset({"script", "job_id", "timeout_s"}),
}


def load_actions_config(path: Path | None, state_dir: Path | None) -> ActionsConfig | None:
    """``--actions-config`` (TOML, or JSON by suffix) and ``--state-dir`` -> the config; None: no actions.

    Format (every section optional)::

        state_dir = "/var/lib/rankscope"      # --state-dir wins
        [eviction]
        backend = "slurm"                     # local | slurm | kubernetes | command
        grace_s = 10                          # local: SIGTERM -> SIGKILL
        [eviction.slurm]                      # the chosen backend's settings
        job_id = "12345"
        restart = "requeue"
        # [eviction.local]                    # local: the launcher's warm standbys, in the order
        # standbys = ["spare-0", "spare-1"]   # it takes them (shown in the eviction plan), or
        # standbys_file = "/run/standbys.json"  # a JSON list the launcher keeps current (read per plan)
        [hot_update]
        current = "/srv/job/code"             # a symbolic link the job runs from
        versions_dir = "/srv/job/versions"
        repo = "/srv/job/repo"                # for git refs
        [backup]
        wait_s = 60                           # for every rank's shard
        align_steps = 1                       # snapshot at step multiples of this; more than the steps
                                              # that pass between the agents' requests
        [layout]                              # for the backup plan
        tp = 2
        pp = 4
        dp = 2
        order = "tp-cp-ep-dp-pp"
        ranks_per_machine = 2
    """
    data: dict[str, Any] = {}
    if path is not None:
        data = _read_config(path)
    where = str(path) if path is not None else "--state-dir"
    folder = state_dir if state_dir is not None else data.get("state_dir")
    if folder is None:
        if path is None:
            return None
        raise RankscopeError(f"{where}: no state directory for the audit log, blocklist and history",
                             "pass --state-dir DIR or set state_dir in the file")
    known = {"state_dir", "eviction", "hot_update", "layout", "backup"}
    _no_unknown(data, known, where)
    backup = data.get("backup", {})
    if not isinstance(backup, dict) or set(backup) - {"wait_s", "align_steps"}:
        raise RankscopeError(f"{where} [backup]: only wait_s and align_steps are known", CONFIG_FIX)
    return ActionsConfig(
        state_dir=Path(folder),
        eviction=_eviction(data.get("eviction", {}), where),
        hot_update=_hot_update(data.get("hot_update"), where),
        layout=_layout(data.get("layout"), where),
        backup_wait_s=float(backup.get("wait_s", BACKUP_WAIT_S)),
        backup_align_steps=max(1, int(backup.get("align_steps", 1))),
    )


def _read_config(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RankscopeError(f"cannot read --actions-config {path}: {exc}", "check the path") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise RankscopeError(f"{path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}",
                             CONFIG_FIX) from None
    if not isinstance(data, dict):
        raise RankscopeError(f"{path} must hold a table of settings", CONFIG_FIX)
    return data


def _no_unknown(section: Mapping[str, Any], known: set[str] | frozenset[str], where: str) -> None:
    unknown = sorted(set(section) - set(known))
    if unknown:
        raise RankscopeError(f"{where}: unknown setting(s) {', '.join(unknown)}",
                             f"use only {', '.join(sorted(known)) or '(none)'}; {CONFIG_FIX}")


def _table(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise RankscopeError(f"{where} must be a table", CONFIG_FIX)
    return value


def _eviction(value: Any, where: str) -> EvictionSettings:
    section = _table(value, f"{where} [eviction]")
    backend = str(section.get("backend", "local"))
    if backend not in BACKENDS:
        raise RankscopeError(f"{where}: unknown eviction backend {backend!r}", f"use one of {', '.join(BACKENDS)}")
    _no_unknown(section, {"backend", "grace_s", *BACKENDS}, f"{where} [eviction]")
    grace = section.get("grace_s", DEFAULT_GRACE_S)
    if isinstance(grace, bool) or not isinstance(grace, int | float) or not 0 <= grace <= 600:
        raise RankscopeError(f"{where}: grace_s must be 0-600 seconds, got {grace!r}", "use the default 10")
    options = dict(_table(section.get(backend, {}), f"{where} [eviction.{backend}]"))
    _no_unknown(options, _BACKEND_KEYS[backend], f"{where} [eviction.{backend}]")
    if backend == "local" and "standbys" in options:
        options["standbys"] = _machine_list(options["standbys"], f"{where} [eviction.local] standbys")
    if backend == "local" and "standbys_file" in options:
        file = options["standbys_file"]
        if not isinstance(file, str) or not file.startswith("/"):
            raise RankscopeError(f"{where} [eviction.local] standbys_file must be an absolute path, got {file!r}",
                                 'write it as standbys_file = "/path/to/standbys.json"')
    settings = EvictionSettings(backend, float(grace), options)
    make_backend(settings)  # a bad setting fails at start-up, not at the first eviction
    return settings


def _machine_list(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise RankscopeError(f"{where} must be a list of machine names, got {value!r}",
                             'write it as standbys = ["spare-0", "spare-1"]')
    try:
        return tuple(dict.fromkeys(check_machine(v) for v in value))
    except RankscopeError as exc:
        raise RankscopeError(f"{where}: {exc.message}", exc.fix) from None


def local_standbys(settings: EvictionSettings) -> tuple[str, ...]:
    """The warm standbys the launcher takes, in order, when ``local`` eviction names them (else none).

    ``standbys_file`` is read at each call: the pool changes as standbys join
    and new ones are added, while an agent reads its config once.
    """
    if settings.backend != "local":
        return ()
    names = tuple(settings.options.get("standbys", ()))
    file = settings.options.get("standbys_file")
    if file is None:
        return names
    try:
        listed = json.loads(Path(file).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return names  # no pool written (yet): none on hand
    except (OSError, ValueError) as exc:
        raise RankscopeError(f"cannot read the standby list {file}: {exc}",
                             "the launcher writes it as a JSON list of machine names") from None
    return tuple(dict.fromkeys((*names, *_machine_list(listed, f"standby list {file}"))))


def _hot_update(value: Any, where: str) -> HotUpdateSettings | None:
    if value is None:
        return None
    section = _table(value, f"{where} [hot_update]")
    _no_unknown(section, {"current", "versions_dir", "repo", "git"}, f"{where} [hot_update]")
    missing = [k for k in ("current", "versions_dir") if k not in section]
    if missing:
        raise RankscopeError(f"{where} [hot_update] needs {' and '.join(missing)}", CONFIG_FIX)
    repo = section.get("repo")
    return HotUpdateSettings(Path(section["current"]), Path(section["versions_dir"]),
                             Path(repo) if repo else None, str(section.get("git", "git")))


def _layout(value: Any, where: str) -> Layout | None:
    if value is None:
        return None
    section = dict(_table(value, f"{where} [layout]"))
    _no_unknown(section, {"tp", "pp", "dp", "cp", "ep", "order", "ranks_per_machine"}, f"{where} [layout]")
    try:
        return Layout(**section)
    except TypeError as exc:
        raise RankscopeError(f"{where} [layout]: {exc}", CONFIG_FIX) from None


def make_backend(settings: EvictionSettings) -> EvictionBackend | None:
    """The configured eviction backend; None for ``local`` (the agent stops its own ranks)."""
    if settings.backend == "local":
        return None
    options = dict(settings.options)
    try:
        if settings.backend == "slurm":
            return SlurmBackend(**options)
        if settings.backend == "kubernetes":
            return KubernetesBackend(**options)
        if settings.backend == "command":
            return SiteCommandBackend(**options)
    except TypeError as exc:
        raise RankscopeError(f"[eviction.{settings.backend}]: {exc}", CONFIG_FIX) from None
    return None


# --------------------------------------------------------------------------
# lazy hot-updates applied by a trigger (restart, failure, window)
# --------------------------------------------------------------------------


def triggered_request(record: UpdateRecord, machine: str, trigger: str) -> ActionRequest:
    """The audit entry of a lazy update applied by ``trigger`` rather than by a request made now.

    Its id is the original request's with the trigger appended, so the TUI's
    history shows the request (pending) and, under the derived id, when and
    why it was applied; its requester is the original one.
    """
    action_id = f"{record.action_id[:100]}.{trigger}"
    targets = Targets(machines=(machine,))
    who = f"{record.who} (lazy, applied at {trigger})"[:200]
    if record.kind == UpdateKind.ROLLBACK:
        return ActionRequest(action_id, ActionKind.ROLLBACK, targets,
                             RollbackArgs(to_version=record.to_version.path, mode=UpdateMode.LAZY), who)
    return ActionRequest(action_id, ActionKind.HOT_UPDATE, targets,
                         HotUpdateArgs(VersionSource.DIR, record.to_version.path, UpdateMode.LAZY,
                                       record.window_s), who)


def _audit_triggered(audit: AuditLog, machine: str, record: UpdateRecord, trigger: str, state: ActionState,
                     message: str, clock: Callable[[], float]) -> None:
    request = triggered_request(record, machine, trigger)
    what = f"{record.kind.value} {machine} to {record.to_version.label} (lazy, applied at {trigger})"
    if audit.begin(request, what, (machine,)) is not None:
        return  # already recorded (the same trigger seen twice)
    audit.finish(request, ActionResult(request.action_id, request.kind, state, message, clock(), clock(),
                                       (record.describe(),)), what, (machine,))


def apply_pending(config: ActionsConfig, machine: str, event: JobEvent,
                  clock: Callable[[], float] = time.time) -> UpdateRecord | None:
    """Apply ``machine``'s pending lazy update for a restart or failure, before the processes start again.

    This is the launcher's half of a lazy hot-update (ByteRobust §6.1: the
    update rides on the next restart, at no extra cost). The launcher calls
    it in its restart path with the machine's actions config, after the old
    processes (and the machine's agent) are stopped and before the new ones
    start, so they start on the new code. The history and the audit log get
    the outcome; returns the applied (or failed) record, None when nothing
    was pending.
    """
    if config.hot_update is None:
        return None
    settings = config.hot_update
    history = HotUpdateHistory(config.history_path, clock)
    pending = history.pending()
    if pending is None:
        return None
    updater = HotUpdater(CodeVersions(settings.current, settings.versions_dir, settings.repo, settings.git), history,
                         None, clock)
    audit = AuditLog(config.audit_path, clock)
    trigger = event.kind.value
    try:
        record = updater.on_event(event)
    except (OSError, RankscopeError) as exc:
        message = exc.message if isinstance(exc, RankscopeError) else str(exc)
        _audit_triggered(audit, machine, pending, trigger, ActionState.FAILED,
                         f"{machine}: pending {pending.to_version.label} could not be applied at the {trigger}: "
                         f"{message}", clock)
        return history.get(pending.id)
    if record is None:
        return None
    _audit_triggered(audit, machine, record, trigger, ActionState.SUCCEEDED,
                     f"{machine} now runs its code from {record.to_version.label}: the pending lazy update was "
                     f"applied at the {trigger}, before the ranks started again", clock)
    return record


# --------------------------------------------------------------------------
# the service
# --------------------------------------------------------------------------

Report = Callable[[str], None]
RanksReader = Callable[[], tuple[RankInfo, ...]]


@dataclass(frozen=True, slots=True)
class _Planned:
    """A plan and what the procedure needs to carry it out."""

    plan: ActionPlan
    ranks: tuple[RankInfo, ...]
    total: int  # progress steps


class _Subscriber:
    def __init__(self) -> None:
        self.queue: asyncio.Queue[AuditRecord] = asyncio.Queue(SUBSCRIBER_QUEUE)
        self.lagged = False

    def offer(self, record: AuditRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except asyncio.QueueFull:
            self.lagged = True  # it will re-read the log from its last seq; the action never waits


class _Execution:
    """One running action: its events so far, for every caller following it."""

    def __init__(self, request: ActionRequest) -> None:
        self.request = request
        self.events: list[ActionProgress | ActionResult] = []
        self.changed = asyncio.Condition()
        self.task: asyncio.Task[None] | None = None

    async def add(self, event: ActionProgress | ActionResult) -> None:
        async with self.changed:
            self.events.append(event)
            self.changed.notify_all()

    def _more_than(self, seen: int) -> Callable[[], bool]:
        return lambda: len(self.events) > seen

    async def follow(self, replayed: bool) -> AsyncIterator[ActionProgress | ActionResult]:
        seen = 0
        while True:
            async with self.changed:
                await self.changed.wait_for(self._more_than(seen))
                batch = self.events[seen:]
            seen += len(batch)
            for event in batch:
                if isinstance(event, ActionResult):
                    yield replace(event, replayed=replayed) if replayed else event
                    return
                yield event


class ActionService:
    """Plans and carries out actions on this agent's machine; keeps and broadcasts the audit log."""

    def __init__(self, config: ActionsConfig, machine: str, ranks: RanksReader,
                 clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self.machine = machine
        self._ranks = ranks
        self._clock = clock
        self.audit = AuditLog(config.audit_path, clock)
        self.blocklist = Blocklist(config.blocklist_path, clock)
        self.history = HotUpdateHistory(config.history_path, clock)
        self.backend = make_backend(config.eviction)
        self.versions = (CodeVersions(config.hot_update.current, config.hot_update.versions_dir,
                                      config.hot_update.repo, config.hot_update.git)
                         if config.hot_update is not None else None)
        self._subscribers: set[_Subscriber] = set()
        self._executions: dict[str, _Execution] = {}
        self._seen_pids: frozenset[int] | None = None  # the ranks seen while a lazy update is pending
        self._publish_lock = asyncio.Lock()
        last = self.audit.records()
        self._published = last[-1].seq if last else 0

    # ---- planning ---------------------------------------------------------------------

    async def plan(self, request: ActionRequest) -> ActionPlan:
        """What ``request`` would do here; raises RankscopeError when it is refused."""
        return (await asyncio.to_thread(self._plan, request)).plan

    def _plan(self, request: ActionRequest) -> _Planned:
        ranks = self._ranks()
        self._check_job(request, ranks)
        if request.kind == ActionKind.EVICT:
            return self._plan_evict(request, ranks)
        if request.kind in (ActionKind.HOT_UPDATE, ActionKind.ROLLBACK):
            return self._plan_update(request, ranks)
        return self._plan_backup(request, ranks)

    def _check_job(self, request: ActionRequest, ranks: tuple[RankInfo, ...]) -> None:
        """An agent acts only on its own job: the machine it is and the ranks it sees."""
        others = [m for m in request.targets.machines if m != self.machine]
        if others:
            raise RankscopeError(
                f"refused: {' '.join(others)} {'is' if len(others) == 1 else 'are'} not this agent's machine "
                f"({self.machine})",
                "send each machine's part of an action to that machine's agent (rankscope's client does this)")
        seen = {r.rank for r in ranks}
        unseen = sorted(set(request.targets.ranks) - seen)
        if unseen:
            raise RankscopeError(
                f"refused: rank(s) {' '.join(map(str, unseen))} do not run on {self.machine} "
                f"(its ranks: {' '.join(map(str, sorted(seen))) or 'none found'})",
                "target ranks this machine runs; take a fresh snapshot if the job was restarted")
        run_ids = {r.run_id for r in ranks if r.run_id}
        if request.job_id is not None and run_ids and request.job_id not in run_ids:
            raise RankscopeError(
                f"refused: job {request.job_id} does not run on {self.machine} (it runs {' '.join(sorted(run_ids))})",
                "attach to the agents of the job you mean")

    def _processes(self, ranks: tuple[RankInfo, ...]) -> tuple[ProcessRef, ...]:
        refs: list[ProcessRef] = []
        for r in ranks:
            refs.append(ProcessRef(self.machine, r.pid, r.rank))
            refs.extend(ProcessRef(self.machine, s.pid, r.rank) for s in r.subprocesses)
        return tuple(refs)

    def _plan_evict(self, request: ActionRequest, ranks: tuple[RankInfo, ...]) -> _Planned:
        assert isinstance(request.args, EvictArgs)
        machines = (self.machine,)
        processes = self._processes(ranks)
        rank_list = " ".join(str(r.rank) for r in ranks) or "none"
        warnings: list[str] = []
        if request.targets.ranks:
            warnings.append(f"eviction takes the whole machine {self.machine}: all its ranks ({rank_list}) stop, "
                            "not only the ones named")
        block = f"block {self.machine} (reason: {request.args.reason}) so no restart brings it back"
        if self.backend is None:
            if not ranks:
                warnings.append(f"no ranks found on {self.machine}: nothing to stop, the machine is only blocked")
            try:
                configured = local_standbys(self.config.eviction)
            except RankscopeError as exc:
                configured = ()
                warnings.append(f"standbys unknown: {exc.message}")
            blocked = {e.machine for e in self.blocklist.blocked()}
            standbys = tuple(m for m in configured if m not in blocked and m != self.machine)
            if "standbys" not in self.config.eviction.options and "standbys_file" not in self.config.eviction.options:
                restart = "restarting the job without this machine is left to the launcher (torchrun, the drill)"
            elif standbys:
                restart = (f"the launcher restarts the job without this machine, with warm standby(s) "
                           f"{' '.join(standbys)} joining in this order, one per evicted machine; each standby "
                           "self-checks first and one that fails is skipped")
            else:
                restart = "the launcher has no unblocked warm standby: the job cannot restart at its size"
                warnings.append(f"no warm standby left to replace {self.machine} "
                                f"(blocked: {' '.join(sorted(blocked & set(configured))) or 'none'})")
            steps = (f"SIGTERM {len(processes)} process(es) of ranks {rank_list} on {self.machine}",
                     f"SIGKILL any still running after {self.config.eviction.grace_s:g} s",
                     block,
                     restart)
            plan = ActionPlan(
                action_id=request.action_id, kind=ActionKind.EVICT,
                summary=f"evict {self.machine}: stop ranks {rank_list} and block it",
                machines=machines, processes=processes, standbys=standbys, steps=steps, warnings=tuple(warnings),
                typed_confirmation=True, confirm_phrase=confirm_phrase_for(ActionKind.EVICT, machines))
            return _Planned(plan, ranks, 3)
        backend_plan = self.backend.joined(request.args.together).plan(machines, request.args.reason)
        plan = ActionPlan(
            action_id=request.action_id, kind=ActionKind.EVICT,
            summary=f"evict {self.machine} via {self.backend.name} (ranks {rank_list})",
            machines=backend_plan.machines, processes=processes, standbys=backend_plan.standbys,
            commands=backend_plan.commands, steps=(*backend_plan.steps, block),
            warnings=(*warnings, *backend_plan.warnings),
            typed_confirmation=True, confirm_phrase=confirm_phrase_for(ActionKind.EVICT, backend_plan.machines))
        return _Planned(plan, ranks, 2)

    def _plan_update(self, request: ActionRequest, ranks: tuple[RankInfo, ...]) -> _Planned:
        if self.versions is None:
            raise RankscopeError(f"refused: the agent on {self.machine} has no hot-update configured",
                                 "add a [hot_update] section (current, versions_dir, repo) to its --actions-config")
        args = request.args
        assert isinstance(args, HotUpdateArgs | RollbackArgs)
        current = self.versions.target()
        steps: list[str] = []
        if isinstance(args, HotUpdateArgs):
            if args.source == VersionSource.GIT:
                if self.versions.repo is None:
                    raise RankscopeError(f"refused: the agent on {self.machine} has no code repository configured",
                                         "set [hot_update] repo in its --actions-config, or use a prepared directory")
                # Resolved now, so a ref that does not exist is refused in the plan, before anyone confirms.
                commit = self.versions.commit_of(args.version)
                steps.append(f"check out git ref {args.version} (commit {commit[:12]}) of {self.versions.repo} "
                             f"under {self.versions.versions_dir}")
            else:
                self.versions.prepared(args.version)  # refuses a directory missing on this machine now
                steps.append(f"use the prepared directory {args.version}")
            to = f"{args.source.value}:{args.version}"
            verb = "hot-update"
        else:
            target = self._rollback_target(args)
            to = target.label
            verb = "roll back"
        mode = args.mode
        steps.append(f"point {self.versions.current} (now {current or 'unset'}) at {to}"
                     + (" now" if mode == UpdateMode.IMMEDIATE else " when the update is applied"))
        rank_list = " ".join(str(r.rank) for r in ranks) or "none"
        if mode == UpdateMode.IMMEDIATE:
            steps.append(f"request a restart of ranks {rank_list}: the launcher restarts them on the new code "
                         "(the agent does not stop them)")
        else:
            window = args.window_s if isinstance(args, HotUpdateArgs) else 24 * 3600.0
            steps.append(f"record it as pending: applied at the next restart or failure, at the latest in "
                         f"{window / 3600:g} h")
        plan = ActionPlan(
            action_id=request.action_id, kind=request.kind,
            summary=f"{verb} {self.machine} to {to} ({mode.value})",
            machines=(self.machine,), processes=self._processes(ranks), steps=tuple(steps))
        return _Planned(plan, ranks, 2)

    def _rollback_target(self, args: RollbackArgs) -> Version:
        if args.to_version:
            for record in self.history.entries():
                for v in (record.to_version, record.from_version):
                    if v is not None and args.to_version in (v.label, v.path):
                        return v
            raise RankscopeError(f"refused: no version {args.to_version!r} in the hot-update history of "
                                 f"{self.machine}", "pick a version listed in the update history")
        target = self.history.rollback_target()
        if target is None:
            raise RankscopeError(f"refused: {self.machine} has no earlier version to roll back to",
                                 "hot-update to the version you want instead")
        return target

    def _plan_backup(self, request: ActionRequest, ranks: tuple[RankInfo, ...]) -> _Planned:
        assert isinstance(request.args, BackupArgs)
        from rankscope.analyzers.backup_plan import backup_plan

        warnings: list[str] = []
        peers: tuple[tuple[int, int], ...] = ()
        mine = set(request.targets.ranks) or {r.rank for r in ranks}
        if not mine:
            warnings.append(f"no ranks found on {self.machine}: nothing to back up here")
        if self.config.layout is None:
            warnings.append("no [layout] in the agent's --actions-config: backup peers not shown (the ranks know "
                            "theirs from RANKSCOPE_BACKUP_TARGETS)")
        else:
            world = ranks[0].world_size if ranks else None
            try:
                pairs = backup_plan(self.config.layout, world_size=world).pairs
                peers = tuple((p.rank, p.peer) for p in pairs if p.rank in mine)
            except RankscopeError as exc:
                warnings.append(f"backup peers unknown: {exc.message}")
        plan = ActionPlan(
            action_id=request.action_id, kind=ActionKind.BACKUP,
            summary=f"back up the checkpoints of ranks {' '.join(map(str, sorted(mine))) or 'none'} to their peers",
            machines=(self.machine,), processes=self._processes(ranks), backup_peers=peers,
            steps=(f"write the backup request {self.config.state_dir / REQUEST_FILE}",
                   "each rank snapshots parameters and optimizer state at its next step boundaries into CPU memory "
                   "and writes the shard, with its SHA-256, to this agent's store and to its backup peer's",
                   f"wait up to {self.config.backup_wait_s:g} s for a new shard of every rank here and verify its checksum"),
            warnings=tuple(warnings))
        return _Planned(plan, ranks, 3)

    # ---- running ----------------------------------------------------------------------

    async def run(self, request: ActionRequest, confirmation: Confirmation
                  ) -> AsyncIterator[ActionProgress | ActionResult]:
        """Progress of the action, ending with exactly one result (see the module docstring for the order)."""
        if request.action_id in self._executions:
            async for event in self._follow_running(request):
                yield event
            return
        try:
            if await asyncio.to_thread(self.audit.result_of, request.action_id) is not None:
                seen = await asyncio.to_thread(self.audit.begin, request, self._what(request))
                if seen is not None:
                    yield seen
                    return
            planned = await asyncio.to_thread(self._plan, request)
        except RankscopeError as exc:
            yield await self._refuse(request, exc.message)
            return
        problem = confirmation_problem(planned.plan, request, confirmation)
        if problem is not None:
            yield await self._refuse(request, f"refused: {problem}; nothing was done")
            return
        if request.action_id in self._executions:  # the same id arrived again while this one was planning
            async for event in self._follow_running(request):
                yield event
            return
        # From here to the insert there is no await: one execution per id, whoever comes second follows it.
        execution = _Execution(request)
        self._executions[request.action_id] = execution
        # Its own task: a client that goes away mid-way does not leave the action half done.
        execution.task = asyncio.create_task(self._execute(execution, planned))
        async for event in execution.follow(replayed=False):
            yield event

    async def _follow_running(self, request: ActionRequest) -> AsyncIterator[ActionProgress | ActionResult]:
        """The same id is running now: follow it and get its result (marked replayed); a different request is refused."""
        running = self._executions[request.action_id]
        if running.request != request:
            yield await self._refuse(request, f"action id {request.action_id} is already in use for a different "
                                              "request; nothing was done")
            return
        async for event in running.follow(replayed=True):
            yield event

    async def _execute(self, execution: _Execution, planned: _Planned) -> None:
        request, plan = execution.request, planned.plan
        try:
            seen = await asyncio.to_thread(self.audit.begin, request, plan.summary, plan.machines)
            await self._publish()
            if seen is not None:
                await execution.add(seen)
                return
            started = self._clock()
            loop = asyncio.get_running_loop()
            steps: asyncio.Queue[ActionProgress | None] = asyncio.Queue()
            count = 0

            def report(message: str) -> None:  # called from the worker thread
                nonlocal count
                count += 1
                progress = ActionProgress(request.action_id, self._clock(), count, max(planned.total, count), message)
                loop.call_soon_threadsafe(steps.put_nowait, progress)

            work = asyncio.ensure_future(asyncio.to_thread(self._procedure, request, planned, report))
            work.add_done_callback(lambda _: steps.put_nowait(None))
            while (progress := await steps.get()) is not None:
                await asyncio.to_thread(self._note, request, plan, progress.message)
                await self._publish()
                await execution.add(progress)
            try:
                state, message, details = work.result()
            except RankscopeError as exc:
                state, message, details = ActionState.FAILED, exc.message, (f"fix: {exc.fix}",) if exc.fix else ()
            except Exception as exc:  # a procedure's bug must still end the action with a recorded result
                state, message, details = ActionState.FAILED, f"{type(exc).__name__}: {exc}", ()
            result = ActionResult(request.action_id, request.kind, state, message, started, self._clock(), details)
            await asyncio.to_thread(self.audit.finish, request, result, plan.summary, plan.machines)
            await self._publish()
            await execution.add(result)
        except Exception as exc:  # the audit log itself failed: say so to whoever follows
            await execution.add(ActionResult(request.action_id, request.kind, ActionState.FAILED,
                                             f"the agent could not record the action: {type(exc).__name__}: {exc}"))
        finally:
            self._executions.pop(request.action_id, None)

    def _procedure(self, request: ActionRequest, planned: _Planned,
                   report: Report) -> tuple[ActionState, str, tuple[str, ...]]:
        if request.kind == ActionKind.EVICT:
            if self.backend is None:
                return self._evict_local(request, planned, report)
            return self._evict_backend(request, planned, report)
        if request.kind in (ActionKind.HOT_UPDATE, ActionKind.ROLLBACK):
            return self._update(request, report)
        return self._backup(request, planned, report)

    def _backup(self, request: ActionRequest, planned: _Planned,
                report: Report) -> tuple[ActionState, str, tuple[str, ...]]:
        """Ask this machine's ranks for a backup through the request file, then wait for and verify their shards.

        The ranks' in-process plugin (``rankscope.ccl_plugin.backup``) watches
        the file at every optimizer step boundary; the agent never talks to a
        rank, so a hung rank costs a timeout here, not a hung agent.
        """
        from rankscope.actions.shard_store import ShardCorrupt, ShardStore

        store = ShardStore(self.config.state_dir / SHARDS_DIR)
        ranks = sorted(set(request.targets.ranks) or {r.rank for r in planned.ranks})
        if not ranks:
            return ActionState.SUCCEEDED, f"no ranks on {self.machine}: nothing to back up", ()
        newest_before = {r: max(store.steps(r), default=-1) for r in ranks}
        path = self.config.state_dir / REQUEST_FILE
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps({"request_id": request.action_id, "written": self._clock(),
                                   "align": self.config.backup_align_steps}))
        os.replace(tmp, path)
        report(f"asked ranks {' '.join(map(str, ranks))} for a backup at their next step boundary ({path})")
        wait_s = self.config.backup_wait_s
        deadline = time.monotonic() + wait_s
        while True:
            newest = {r: max(store.steps(r), default=-1) for r in ranks}
            late = [r for r in ranks if newest[r] <= newest_before[r]]
            if not late:
                break
            if time.monotonic() > deadline:
                return (ActionState.FAILED,
                        f"rank(s) {' '.join(map(str, late))} on {self.machine} wrote no backup within "
                        f"{wait_s:g} s: they are not reaching a step boundary (hung?), or the backup hook is "
                        "not loaded in them (start the job with `rankscope run`, which loads it)", ())
            time.sleep(0.1)
        details: list[str] = []
        for r in ranks:
            try:
                got = store.get(r, newest[r])
            except ShardCorrupt as exc:
                return ActionState.FAILED, exc.message, tuple(details)
            if got is None:
                return ActionState.FAILED, f"the shard of rank {r} step {newest[r]} vanished before it was read", ()
            info = got[0]
            details.append(f"rank {r}: step {info.step}, {info.size} bytes, sha256 {info.sha256[:16]}")
        report(f"verified {len(ranks)} shard(s)")
        held = {r: s for r, s in store.inventory().items() if r not in ranks and s}
        if held:
            details.append("peer copies held here: " + ", ".join(f"rank {r} steps {list(s)}" for r, s in held.items()))
        steps = sorted({newest[r] for r in ranks})
        return (ActionState.SUCCEEDED,
                f"backed up ranks {' '.join(map(str, ranks))} on {self.machine} at step {' '.join(map(str, steps))} "
                "(own copy here, peer copy on the backup peer's machine)", tuple(details))

    def _evict_local(self, request: ActionRequest, planned: _Planned,
                     report: Report) -> tuple[ActionState, str, tuple[str, ...]]:
        assert isinstance(request.args, EvictArgs)
        import psutil

        targets = _live_processes(planned.plan.processes)
        for proc in targets:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGTERM)
        report(f"sent SIGTERM to {len(targets)} process(es): {' '.join(str(p.pid) for p in targets) or 'none'}")
        left = _wait_gone(targets, self.config.eviction.grace_s)
        for proc in left:
            with contextlib.suppress(psutil.Error):
                proc.send_signal(signal.SIGKILL)
        stuck = _wait_gone(left, 5.0)
        report(f"SIGKILL to {len(left)} process(es) still running after {self.config.eviction.grace_s:g} s"
               if left else "every process ended after SIGTERM")
        self.blocklist.block((self.machine,), request.args.reason, request.requested_by, request.action_id)
        report(f"blocked {self.machine}")
        ranks = " ".join(str(r.rank) for r in planned.ranks) or "none"
        details = tuple(f"pid {p.pid} (rank {p.rank}) stopped" for p in planned.plan.processes
                        if p.pid not in {s.pid for s in stuck})
        if stuck:
            return (ActionState.FAILED,
                    f"{' '.join(str(p.pid) for p in stuck)} on {self.machine} survived SIGKILL (uninterruptible?); "
                    f"{self.machine} is blocked", details)
        return (ActionState.SUCCEEDED,
                f"stopped ranks {ranks} on {self.machine} ({len(targets)} process(es), {len(left)} needed SIGKILL) "
                f"and blocked it; the launcher restarts the job without it", details)

    def _evict_backend(self, request: ActionRequest, planned: _Planned,
                       report: Report) -> tuple[ActionState, str, tuple[str, ...]]:
        assert isinstance(request.args, EvictArgs) and self.backend is not None
        report(f"running {len(planned.plan.commands)} {self.backend.name} command(s)")
        outcome = self.backend.joined(request.args.together).evict(planned.plan.machines, request.args.reason)
        details = tuple(f"exit {run.returncode}: {' '.join(run.argv)}" for run in outcome.runs)
        if outcome.replacements:
            details += (f"replacements: {' '.join(outcome.replacements)}",)
        if not outcome.ok:
            return ActionState.FAILED, outcome.message, details
        report(f"{self.backend.name}: {outcome.message}")
        self.blocklist.block(outcome.machines, request.args.reason, request.requested_by, request.action_id)
        return ActionState.SUCCEEDED, f"{outcome.message}; blocked {' '.join(outcome.machines)}", details

    def _update(self, request: ActionRequest, report: Report) -> tuple[ActionState, str, tuple[str, ...]]:
        assert self.versions is not None
        restarts: list[str] = []

        def restart_requested(version: Version, trigger: str) -> None:
            # The launcher restarts the ranks; the agent records the request and stops nothing.
            restarts.append(version.label)
            report(f"{RESTART_REQUESTED} ({trigger}): the launcher restarts the ranks on {version.label}")

        updater = HotUpdater(self.versions, self.history, restart_requested, self._clock)
        if isinstance(request.args, HotUpdateArgs):
            record = updater.update(request.action_id, request.requested_by, request.args)
        else:
            assert isinstance(request.args, RollbackArgs)
            record = updater.rollback(request.action_id, request.requested_by, request.args)
        report(record.describe())
        if record.mode == UpdateMode.LAZY:
            deadline = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(record.deadline))
            return (ActionState.SUCCEEDED,
                    f"pending on {self.machine}: {record.to_version.label} is applied at the next restart or "
                    f"failure, at the latest {deadline}", (record.describe(),))
        return (ActionState.SUCCEEDED,
                f"{self.machine} now runs its code from {record.to_version.label}; {RESTART_REQUESTED} from the "
                "launcher (the agent did not stop the ranks)", (record.describe(),))

    async def _refuse(self, request: ActionRequest, message: str) -> ActionResult:
        now = self._clock()
        await asyncio.to_thread(self.audit.refuse, request, self._what(request), message)
        await self._publish()
        return ActionResult(request.action_id, request.kind, ActionState.REFUSED, message, now, now)

    @staticmethod
    def _what(request: ActionRequest) -> str:
        return f"{request.kind.value} {request.targets.describe()}"

    def _note(self, request: ActionRequest, plan: ActionPlan, message: str) -> None:
        """Append one progress line to the audit log (the log's public ``note``, on the service's clock)."""
        self.audit.note(request, plan.summary, message, plan.machines, PROGRESS)

    # ---- a pending lazy update: its window and the job's failures --------------------

    async def supervise_once(self) -> UpdateRecord | None:
        """Apply a pending lazy hot-update that is due; the agent calls this every few seconds.

        Due when the agent saw its ranks die since the last call (a failure:
        the code is switched, no restart is requested, the job is restarting
        anyway) or when the update's window expired (the code is switched and
        a restart is requested from the launcher, as for an immediate update).
        Both outcomes go into the history and the audit stream.
        """
        record = await asyncio.to_thread(self._supervise)
        if record is not None:
            await self._publish()
        return record

    def _supervise(self) -> UpdateRecord | None:
        if self.versions is None:
            return None
        pending = self.history.pending()
        if pending is None:
            self._seen_pids = None  # ranks are only watched while something waits for a failure
            return None
        pids = frozenset(r.pid for r in self._ranks())
        died = self._seen_pids is not None and bool(self._seen_pids - pids)
        self._seen_pids = pids
        restarts: list[str] = []

        def restart_requested(version: Version, trigger: str) -> None:
            restarts.append(trigger)

        updater = HotUpdater(self.versions, self.history, restart_requested, self._clock)
        trigger = JobEventKind.FAILURE.value if died else "window"
        try:
            record = updater.on_event(JobEvent(JobEventKind.FAILURE, self._clock())) if died else updater.tick()
        except (OSError, RankscopeError) as exc:
            message = exc.message if isinstance(exc, RankscopeError) else str(exc)
            _audit_triggered(self.audit, self.machine, pending, trigger, ActionState.FAILED,
                             f"{self.machine}: pending {pending.to_version.label} could not be applied at the "
                             f"{trigger}: {message}", self._clock)
            return self.history.get(pending.id)
        if record is None:
            return None
        if died:
            message = (f"{self.machine} now runs its code from {record.to_version.label}: its ranks ended (a "
                       "failure), so the pending lazy update was applied for their restart")
        else:
            message = (f"{self.machine} now runs its code from {record.to_version.label}: the pending lazy "
                       f"update's window expired; {RESTART_REQUESTED} from the launcher")
        _audit_triggered(self.audit, self.machine, record, trigger, ActionState.SUCCEEDED, message, self._clock)
        return record

    # ---- the audit stream -------------------------------------------------------------

    async def _publish(self) -> None:
        """Fan every record not yet broadcast out to the subscribers, in seq order."""
        async with self._publish_lock:
            fresh = await asyncio.to_thread(self.audit.records, self._published)
            for record in fresh:
                for subscriber in tuple(self._subscribers):
                    subscriber.offer(record)
                self._published = record.seq

    async def watch(self, after_seq: int | None) -> AsyncIterator[AuditRecord]:
        """Records with seq > ``after_seq`` (None: from now on), then every new one as it is written."""
        subscriber = _Subscriber()
        self._subscribers.add(subscriber)  # before reading the backlog, so nothing falls in between
        try:
            last = self._published if after_seq is None else after_seq
            catch_up = after_seq is not None
            while True:
                if catch_up or subscriber.lagged:
                    catch_up = subscriber.lagged = False
                    # Everything broadcast so far comes from the log; later records come through the queue.
                    for record in await asyncio.to_thread(self.audit.records, last):
                        if record.seq > self._published:
                            break
                        last = record.seq
                        yield record
                record = await subscriber.queue.get()
                if subscriber.lagged:
                    continue  # records were dropped: re-read the log (it holds this one too)
                if record.seq > last:
                    last = record.seq
                    yield record
        finally:
            self._subscribers.discard(subscriber)

    def interrupted(self) -> tuple[str, ...]:
        """Actions an earlier run of the agent started and never finished."""
        return self.audit.interrupted()

    async def close(self) -> None:
        """Let running actions finish and record their results (bounded by their own timeouts)."""
        tasks = [e.task for e in self._executions.values() if e.task is not None]
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def _live_processes(processes: tuple[ProcessRef, ...]) -> list[Any]:
    """psutil handles of the planned processes that still exist (a pid reused since would be a different process:
    the plan is made just before, from a fresh discovery)."""
    import psutil

    out = []
    for ref in processes:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(ref.pid)
            if proc.pid != os.getpid():
                out.append(proc)
    return out


def _gone(proc: Any) -> bool:
    import psutil

    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def _wait_gone(procs: list[Any], timeout_s: float) -> list[Any]:
    """Poll until every process ended (a zombie counts as ended: its parent reaps it) or the time is up."""
    deadline = time.monotonic() + timeout_s
    left = [p for p in procs if not _gone(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if not _gone(p)]
    return left
