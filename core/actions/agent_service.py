"""The agent's side of the action protocol: plan, confirm, carry out once, audit, broadcast.

An agent owns one machine. A client names an action and typed arguments
(:class:`~rankscope.actions.model.ActionRequest`); :class:`ActionService`
turns it into the procedure the agent was configured with
(:mod:`~rankscope.actions.config`), never into anything a client wrote. The
order of every run is fixed:

1. A repeated ``action_id`` gets the recorded result back (the audit log's
   ledger); nothing is done twice, even across an agent restart.
2. Plan again, now (:mod:`~rankscope.actions.planning`, from facts gathered
   here): targets must belong to this agent's job -- the machine it is and
   the ranks it sees -- or the request is refused.
3. The confirmation must name exactly the plan's machines and ranks, and for
   eviction carry the typed phrase. Any mismatch refuses; nothing is done.
4. Claim the id, run the procedure (:mod:`~rankscope.actions.procedures`) in
   a worker thread, stream its progress, record the result.

Every step becomes an audit record (who, when, what, result) and is fanned out
to every ``WatchAudit`` subscriber through its own bounded queue: a slow
subscriber loses nothing (it re-reads the log from its last ``seq``) and never
holds up the action. The action runs as its own task, so a client that
disconnects mid-way does not stop it half done. A pending lazy hot-update is
applied by :meth:`ActionService.supervise_once`, which the agent calls every
:data:`SUPERVISE_INTERVAL_S`.

No grpc here: ``rankscope.wire.agent`` wraps this service in the RPCs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

from rankscope.actions.agent_protocol import Confirmation
from rankscope.actions.audit import AuditLog
from rankscope.actions.blocklist import Blocklist
from rankscope.actions.config import ActionsConfig, local_standbys, make_backend
from rankscope.actions.history import HotUpdateHistory, UpdateRecord, Version
from rankscope.actions.hot_update import HotUpdater, JobEvent, JobEventKind
from rankscope.actions.model import (
    RESTART_REQUESTED,
    ActionKind,
    ActionPlan,
    ActionProgress,
    ActionRequest,
    ActionResult,
    ActionState,
    AuditRecord,
    ConfirmationRule,
    EvictArgs,
    HotUpdateArgs,
    VersionSource,
)
from rankscope.actions.planning import (
    CodeLink,
    Planned,
    StandbyPool,
    check_job,
    plan_backend_eviction,
    plan_backup,
    plan_hot_update,
    plan_local_eviction,
    plan_rollback,
)
from rankscope.actions.procedures import Outcome, Report
from rankscope.actions.procedures.backup import back_up
from rankscope.actions.procedures.evict import evict_locally, evict_with_backend
from rankscope.actions.procedures.update import apply_due, switch_code
from rankscope.ccl_plugin.backup import REQUEST_FILE
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import RankInfo

SUBSCRIBER_QUEUE = 256  # records a watcher may lag behind before it re-reads the log
SUPERVISE_INTERVAL_S = 5.0  # how often the agent checks a pending lazy update's window and its ranks

RanksReader = Callable[[], tuple[RankInfo, ...]]


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
        self.versions = config.hot_update.code_versions() if config.hot_update is not None else None
        self._subscribers: set[_Subscriber] = set()
        self._executions: dict[str, _Execution] = {}
        self._seen_pids: frozenset[int] | None = None  # the ranks seen while a lazy update is pending
        self._publish_lock = asyncio.Lock()
        last = self.audit.records()
        self._published = last[-1].seq if last else 0

    # ---- planning: gather what this machine knows now, let the planner decide -------------

    async def plan(self, request: ActionRequest) -> ActionPlan:
        """What ``request`` would do here; raises RankscopeError when it is refused."""
        return (await asyncio.to_thread(self._plan, request)).plan

    def _plan(self, request: ActionRequest) -> Planned:
        ranks = self._ranks()
        check_job(request, self.machine, ranks)
        if request.kind == ActionKind.EVICT:
            return self._plan_evict(request, ranks)
        if request.kind in (ActionKind.HOT_UPDATE, ActionKind.ROLLBACK):
            return self._plan_update(request, ranks)
        return plan_backup(request, self.machine, ranks, self.config.layout,
                           str(self.config.state_dir / REQUEST_FILE), self.config.backup_wait_s)

    def _plan_evict(self, request: ActionRequest, ranks: tuple[RankInfo, ...]) -> Planned:
        assert isinstance(request.args, EvictArgs)
        if self.backend is not None:
            evicted = self.backend.joined(request.args.together).plan((self.machine,), request.args.reason)
            return plan_backend_eviction(request, self.machine, ranks, self.backend.name, evicted)
        return plan_local_eviction(request, self.machine, ranks, self.config.eviction.grace_s, self._standbys())

    def _standbys(self) -> StandbyPool:
        """The launcher's warm standbys as the config names them, read now, and the machines blocked now."""
        options = self.config.eviction.options
        problem = ""
        try:
            names = local_standbys(self.config.eviction)
        except RankscopeError as exc:
            names, problem = (), exc.message
        blocked = frozenset(e.machine for e in self.blocklist.blocked())
        return StandbyPool("standbys" in options or "standbys_file" in options, names, blocked, problem)

    def _plan_update(self, request: ActionRequest, ranks: tuple[RankInfo, ...]) -> Planned:
        versions = self.versions
        if versions is None:  # the planner refuses, naming the [hot_update] section to add
            planner = plan_hot_update if request.kind == ActionKind.HOT_UPDATE else plan_rollback
            return planner(request, self.machine, ranks, None)
        target = versions.target()  # refuses a code directory that is not a link
        code = CodeLink(str(versions.current), str(target) if target is not None else None,
                        str(versions.versions_dir), str(versions.repo) if versions.repo is not None else None)
        if request.kind == ActionKind.ROLLBACK:
            return plan_rollback(request, self.machine, ranks, code, self.history.entries(),
                                 self.history.rollback_target())
        args = request.args
        assert isinstance(args, HotUpdateArgs)
        commit = ""
        if args.source == VersionSource.GIT and versions.repo is not None:
            # Resolved now, so a ref that does not exist is refused in the plan, before anyone confirms.
            commit = versions.commit_of(args.version)
        elif args.source == VersionSource.DIR:
            versions.prepared(args.version)  # refuses a directory missing on this machine now
        return plan_hot_update(request, self.machine, ranks, code, commit)

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
        problem = ConfirmationRule.of(planned.plan).problem(confirmation, request.targets.ranks)
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

    async def _execute(self, execution: _Execution, planned: Planned) -> None:
        request, plan = execution.request, planned.plan
        try:
            seen = await asyncio.to_thread(self.audit.begin, request, plan.summary, _action_machines(request, plan))
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

    def _procedure(self, request: ActionRequest, planned: Planned, report: Report) -> Outcome:
        if request.kind == ActionKind.EVICT:
            if self.backend is None:
                return evict_locally(request, planned, report, self.machine, self.config.eviction.grace_s,
                                     self.blocklist)
            return evict_with_backend(request, planned, report, self.backend, self.blocklist)
        if request.kind in (ActionKind.HOT_UPDATE, ActionKind.ROLLBACK):
            assert self.versions is not None
            return switch_code(request, report, self.machine, self.versions, self.history, self._clock)
        return back_up(request, planned, report, self.machine, self.config.state_dir, self.config.backup_wait_s,
                       self.config.backup_align_steps, self._clock)

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
        self.audit.note(request, plan.summary, message, plan.machines)

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

        def restart_requested(version: Version, trigger: str) -> None:
            """The window expired: the audit record below asks the launcher to restart the ranks."""

        updater = HotUpdater(self.versions, self.history, restart_requested, self._clock)

        def apply() -> UpdateRecord | None:
            return updater.on_event(JobEvent(JobEventKind.FAILURE, self._clock())) if died else updater.tick()

        def applied(record: UpdateRecord) -> str:
            if died:
                # The agent cannot tell a failure from the job's normal end (the ranks are not its children):
                # either way the code is switched for the next start, and the words must not say more.
                return (f"{self.machine} now runs its code from {record.to_version.label}: its ranks ended (a "
                        "failure, a restart or the job's end), so the pending lazy update was applied for their "
                        "next start")
            return (f"{self.machine} now runs its code from {record.to_version.label}: the pending lazy "
                    f"update's window expired; {RESTART_REQUESTED} from the launcher")

        trigger = JobEventKind.FAILURE.value if died else "window"
        return apply_due(self.audit, self.history, self.machine, pending, trigger, apply, applied, self._clock)

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


def _action_machines(request: ActionRequest, plan: ActionPlan) -> tuple[str, ...]:
    """The machines an action's "started" line names: this agent's part, and for an eviction also the machines
    the other agents' parts take (``EvictArgs.together``), so whoever follows the audit logs (the drill's
    recovery) knows when every part has ended instead of waiting for the logs to go quiet."""
    if isinstance(request.args, EvictArgs):
        return tuple(dict.fromkeys((*plan.machines, *request.args.together)))
    return plan.machines
