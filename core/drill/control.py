"""Recovery on the drill: warm standbys, and the restart that ends a local eviction.

The mechanism, in order (ByteRobust §6.2 over-eviction with warm standbys):

1. The drill's agents serve actions (``Launcher(actions=True)``: each agent
   has ``--state-dir run_dir/state/<machine>`` and the ``local`` eviction
   backend). Idle standbys are "machines" with an agent and no ranks.
2. A person (the TUI, or a test through ``JobClient``) plans and confirms
   ``evict`` of the suspect group's machines. Each machine's agent stops its
   own ranks (SIGTERM, then SIGKILL) and blocks the machine in its persistent
   blocklist with the reason. Agents own processes; they do not launch jobs.
3. :class:`Recovery`, a thread of the drill's orchestrator, follows every
   agent's audit stream (``JobClient.watch_all_audit``). When every agent
   that began an eviction has finished it and at least one succeeded, it
   drives :class:`~rankscope.actions.evict_backends.LocalBackend` over
   :class:`DrillMachines`: stop what is left of the evicted nodes, self-check
   idle standbys (skipping blocked or failing ones), restart the job on the
   remaining machines plus the standbys that passed. Ranks resume from the
   newest step every rank has saved.

The orchestrator restarts the job because on the drill it is the launcher
(as torchrun's elastic agent, Slurm's requeue or a Kubernetes controller is
elsewhere); the agent only stops and blocks, exactly as on a real cluster.

Hot-update (ByteRobust §6.1) takes the same path without rescheduling: each
agent switches its machine's code link and records "restart requested"
(immediate, or a lazy update whose window expired). When every agent that
began the update finished it with success and one requested a restart,
:class:`Recovery` restarts the job on the SAME machines
(``launcher.restart(launcher.machines())``); the ranks resume from the newest
checkpoint on the new code. A lazy update is applied by the launcher's
restart path itself (``Launcher.apply_pending_updates``).

Each restart that brought the job back is written to the agents' incident
journal (``rankscope.actions.journal``, kind "resumed": the step the ranks
resume from, the machines, the code they run), so every view, the acting one
and a pair attached later, tells it in its Events; a journal that cannot be
written is a note, never an error of the drill.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from rankscope.actions.evict_backends import EvictionOutcome, LocalBackend, SelfCheck
from rankscope.actions.journal import JournalEntry
from rankscope.actions.model import RESTART_REQUESTED, ActionKind, ActionResult, ActionState, AuditRecord
from rankscope.contract.errors import RankscopeError
from rankscope.drill.launcher import Launcher
from rankscope.drill.progress import read_loaded
from rankscope.wire.sync_loop import run_sync

if TYPE_CHECKING:
    from rankscope.wire.tls import ClientTLS

FINAL = frozenset({ActionState.SUCCEEDED.value, ActionState.FAILED.value, ActionState.CANCELLED.value,
                   ActionState.REFUSED.value})
DEFAULT_DAILY_FAILURE_RATE = 0.0012  # ByteRobust Table 5 is reproduced by 0.12 % per machine per day


def standby_name(index: int) -> str:
    return f"standby-{index}"


def default_standbys(machines: int, daily_failure_rate: float = DEFAULT_DAILY_FAILURE_RATE) -> int:
    """The P99 pool of the binomial model (``size_standby_pool``), at least one so the drill can recover."""
    from rankscope.analyzers.standby import size_standby_pool

    return max(1, size_standby_pool(machines, daily_failure_rate).count)


def blocked_machines(launcher: Launcher) -> frozenset[str]:
    """Every machine some agent of this drill has blocked (each agent keeps its own persistent list)."""
    return launcher.blocked_machines()


def block_reason(launcher: Launcher, machine: str) -> str:
    from rankscope.actions.blocklist import Blocklist

    for path in sorted((launcher.run_dir / "state").glob("*/blocklist.sqlite")):
        with contextlib.suppress(Exception):
            for entry in Blocklist(path).blocked():
                if entry.machine == machine:
                    return entry.reason
    return "evicted"


@dataclass
class DrillMachines:
    """The drill's implementation of :class:`~rankscope.actions.evict_backends.DrillControl`.

    Warm standbys check themselves while they wait (:meth:`precheck`), as
    ByteRobust's standbys have passed their self-check before they are
    needed; a result younger than ``fresh_s`` is taken at join time, an older
    one (or none) is checked again then.
    """

    launcher: Launcher
    check: Callable[[str], SelfCheck] | None = None  # stand-in for tests; default: the real self-check
    fresh_s: float = 600.0
    restarts: int = 0
    checked: dict[str, tuple[float, SelfCheck]] = field(default_factory=dict)  # machine -> (monotonic, result)

    def machines(self) -> tuple[str, ...]:
        return self.launcher.machines()

    def standbys(self) -> tuple[str, ...]:
        return tuple(self.launcher.standbys)

    def stop(self, machine: str) -> None:
        # Signalled only: the restart that follows waits for it beside the other old processes while the new
        # ranks start (and the drill's stop, when no restart follows).
        self.launcher.stop_node(machine, wait=False)

    def self_check(self, machine: str) -> SelfCheck:
        """CPU and memory, an exact matrix product, NVML GPUs when expected, a real two-process gloo all_reduce.

        On a real cluster the standby runs this on itself; the drill's standbys
        share this host, so running it here checks the same hardware.
        """
        cached = self.checked.get(machine)
        if cached is not None and time.monotonic() - cached[0] <= self.fresh_s and cached[1].ok:
            return cached[1]
        result = self._run_check(machine)
        self.checked[machine] = (time.monotonic(), result)
        return result

    def _run_check(self, machine: str) -> SelfCheck:
        if self.check is not None:
            return self.check(machine)
        from rankscope.actions.self_check import SelfCheckConfig, self_check

        # The drill's standbys share one loaded host with the job and its parked nodes: the check's two
        # processes import torch, which took 77-95 s at load 45 (past the default 60 s + 30 s).
        return self_check(machine, SelfCheckConfig(min_free_memory_bytes=256 << 20, collective_timeout_s=300.0))

    def precheck(self, machines: tuple[str, ...], after: Callable[[], object] | None = None) -> threading.Thread:
        """Self-check idle standbys in the background, one after the other (the host has few cores).

        ``after`` runs first (waiting for the parked nodes to finish importing: both import torch).
        """

        def run() -> None:
            if after is not None:
                with contextlib.suppress(Exception):
                    after()
            for m in machines:
                with contextlib.suppress(Exception):  # a failed check is checked again at join time
                    self.self_check(m)

        thread = threading.Thread(target=run, name="drill-standby-precheck", daemon=True)
        thread.start()
        return thread

    def restart(self, machines: tuple[str, ...]) -> None:
        self.launcher.restart(machines, resume=True)
        self.restarts += 1


@dataclass(frozen=True, slots=True)
class RecoveryEvent:
    """One eviction seen in the audit stream and what the drill did about it."""

    action_id: str
    evicted: tuple[str, ...]
    joined: tuple[str, ...]
    machines: tuple[str, ...]  # the job's machines after the restart (empty when it did not restart)
    ok: bool
    message: str
    evicted_mono: float  # when the last agent's eviction result was seen
    restarted_mono: float  # when the job's nodes and agents were up again
    restart_began_wall: float  # wall clock as the drill began the restart (progress after it is the new job's)
    resume_step: int  # the step the ranks resume from (newest step all ranks saved)
    kind: str = ActionKind.EVICT.value  # or hot_update / rollback: a restart in place on the new code
    # Where the ranks said their state came from ("checkpoint", "backup", "start"); "" when they did not say
    # within RANKS_LOADED_S, and then ``resume_step`` is the newest checkpoint every rank saved.
    resume_source: str = ""


JournalWriter = Callable[[Sequence[JournalEntry]], Sequence[JournalEntry]]  # append, return the merged story
JOURNAL_BY = "rankscope drill"  # who the drill's journal entries are written by
RANKS_LOADED_S = 60.0  # how long a restart's journal entry waits for every rank to say which step it loaded
JOURNAL_DEADLINE_S = 5.0  # per agent: the note comes quickly when agents do not answer
HISTORY_FILE = "hot_update_history.sqlite"  # in each agent's state directory (ActionsConfig.history_path)


def agents_journal(launcher: Launcher) -> JournalWriter:
    """Append to the incident journal of every agent of the drill now, with the act token: what
    ``JobClient.journal`` does for the TUI. Returns the merged story (empty when no agent answered)."""

    def write(entries: Sequence[JournalEntry]) -> Sequence[JournalEntry]:
        from rankscope.wire.client import JobClient

        async def go() -> tuple[JournalEntry, ...]:
            async with JobClient(list(launcher.addresses().values()), launcher.token(), acting=True,
                                 deadline_s=JOURNAL_DEADLINE_S) as client:
                return await client.journal(entries)

        return run_sync(go())

    return write


def code_label(launcher: Launcher, machines: Sequence[str]) -> str:
    """The code ``machines`` run: each one's last applied hot-update or rollback (the drill's first version when
    none was), one label when they agree; "" for a drill without code links (or one that cannot be read)."""
    if not getattr(launcher, "hot_updates", False):
        return ""
    from rankscope.actions.history import HotUpdateHistory
    from rankscope.drill.user_code import INITIAL_VERSION

    on: dict[str, list[str]] = {}
    for m in machines:
        path = launcher.state_dir(m) / HISTORY_FILE
        try:
            current = HotUpdateHistory(path).current() if path.exists() else None
        except RankscopeError:
            current = None
        on.setdefault(current.label if current is not None else f"git:{INITIAL_VERSION}", []).append(m)
    if len(on) == 1:
        return next(iter(on))
    return "; ".join(f"{label} on {' '.join(ms)}" for label, ms in sorted(on.items()))


def resumed_text(event: RecoveryEvent, code: str) -> str:
    """The journal's line for a restart that brought the job back."""
    if event.resume_source == "backup":
        step = f"step {event.resume_step} (the in-memory backup every rank held)"
    elif event.resume_step > 0:
        step = f"step {event.resume_step} (the newest checkpoint every rank saved)"
    else:
        step = ("its start (no checkpoint or backup every rank held)" if event.resume_source
                else "its start (no checkpoint every rank saved)")
    why = (f"after evicting {' '.join(event.evicted)}" if event.evicted
           else f"after {event.kind} {event.action_id}, in place")
    joined = f" ({' '.join(event.joined)} joined)" if event.joined else ""
    return (f"the job resumed from {step} on {' '.join(event.machines)}{joined} {why}"
            + (f", code {code}" if code else ""))


@dataclass
class Recovery:
    """Follows the agents' audit streams; a finished eviction ends in a restart with standbys.

    ``journal`` appends to the agents' incident journal (default: every agent of the drill, ``agents_journal``);
    each restart that brought the job back is written there as a "resumed" entry.
    """

    launcher: Launcher
    control: DrillMachines
    on_event: Callable[[str], None] = lambda _msg: None
    journal: JournalWriter | None = None
    events: list[RecoveryEvent] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        self._handled: set[str] = set()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._main, name="drill-recovery", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def wait(self, count: int, timeout_s: float) -> RecoveryEvent:
        """Block until ``count`` evictions have been handled; the last one's event."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while len(self.events) < count:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RankscopeError(
                        f"no recovery within {timeout_s:.0f} s (handled {len(self.events)}, errors: "
                        f"{'; '.join(self.errors) or 'none'})",
                        f"read the agent logs in {self.launcher.run_dir / 'logs'}")
                self._changed.wait(min(left, 0.5))
            return self.events[count - 1]

    # ---- the watcher ----------------------------------------------------------------

    def _main(self) -> None:
        # This thread must outlive every round: a round that fails is reported and the next one starts. Its
        # end used to take the whole restarted job and its agents with it, silently (their parent-death
        # signal followed the thread that started them; they are now started by the launcher's spawner
        # thread), and even now it would end the recovery unseen. grpc.aio raises CancelledError, which is no
        # Exception, for a call it cancelled itself: that is a failed round too.
        while not self._stop.is_set():
            try:
                self._round()
            except (Exception, asyncio.CancelledError) as exc:
                message = f"recovery round failed (it goes on): {type(exc).__name__}: {exc}"
                self.errors.append(message)
                self.on_event(message)
                self._stop.wait(RETRY_S)

    def _round(self) -> None:
        addresses = dict(self.launcher.addresses())
        if not addresses:
            self._stop.wait(0.2)
            return
        # On the process's one gRPC loop, not a loop of its own per round: a round's loop, closed while the
        # streams it cancelled still had completions coming, made another thread's loop print a traceback.
        found = run_sync(self._follow(addresses))
        if found is None:
            return
        if found.kind == ActionKind.EVICT:
            self._recover(found.action_id, found.machines)
        else:
            self._restart_in_place(found)

    async def _follow(self, addresses: dict[str, str]) -> _Finished | None:
        """Follow these agents until an eviction or a hot-update has finished everywhere (None: stopping)."""
        from rankscope.wire.client import JobClient

        machine_of = {address: name for name, address in addresses.items()}
        seen: dict[str, _Seen] = {}
        queue: asyncio.Queue[tuple[str, AuditRecord]] = asyncio.Queue()
        async with JobClient(list(addresses.values()), self.launcher.token()) as client:

            async def pump() -> None:
                async for item in client.watch_all_audit(since=0, retry_s=0.5):
                    if isinstance(item, tuple):  # (not an AgentLost or AuditResumed)
                        await queue.put(item)

            pumping = asyncio.create_task(pump())
            try:
                while not self._stop.is_set():
                    try:
                        address, record = await asyncio.wait_for(queue.get(), 0.5)
                    except TimeoutError:
                        pass
                    else:
                        if record.kind in WATCHED and record.action_id not in self._handled:
                            seen.setdefault(record.action_id, _Seen(record.kind)).add(
                                machine_of.get(address, ""), record)
                    found = self._finished(seen, set(addresses))
                    if found is not None:
                        self._handled.add(found.action_id)
                        return found  # the client closes before anything is started
            finally:
                pumping.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await pumping
        return None

    def _finished(self, seen: dict[str, _Seen], agents: set[str]) -> _Finished | None:
        for action_id, s in seen.items():
            if action_id in self._handled or not s.began or not s.began <= set(s.finished):
                continue
            if s.kind == ActionKind.EVICT:
                # Each agent carries out only its own machine's part, and one slowed down (a loaded host, a slow
                # /proc scan) may record "started" after another finished. Each "started" line names every machine
                # the eviction takes (EvictArgs.together): once all of them have ended, all are restarted at once;
                # without such a line, once the action's agents have been quiet for SETTLE_S.
                every_part_ended = bool(s.named) and s.named <= set(s.finished)
                if not every_part_ended and time.monotonic() - s.last_mono < SETTLE_S:
                    continue
                if ActionState.SUCCEEDED.value in s.finished.values():
                    evicted = tuple(m for m in self.launcher.machines()
                                    if s.finished.get(m) == ActionState.SUCCEEDED.value)
                    return _Finished(s.kind, action_id, evicted)
                continue
            # A whole-job update reaches every agent at once; one aimed at some machines is taken as complete
            # once its agents have been quiet for SETTLE_S (their "started" records arrive within milliseconds).
            if not (agents <= s.began or time.monotonic() - s.last_mono >= SETTLE_S):
                continue
            if s.restart_requested or any(r != ActionState.SUCCEEDED.value for r in s.finished.values()):
                return _Finished(s.kind, action_id, tuple(sorted(s.began)), s.finished, s.restart_requested)
            self._handled.add(action_id)  # lazy and pending everywhere: applied at the next restart
        return None

    def _restart_in_place(self, found: _Finished) -> None:
        """Restart the job on the machines it runs on, on the code the agents switched to (§6.1)."""
        seen = time.monotonic()
        machines = self.launcher.machines()
        failed = sorted(m for m, r in found.results.items() if r != ActionState.SUCCEEDED.value)
        if failed:
            message = (f"{found.kind.value} {found.action_id} did not succeed on {' '.join(failed)}: the job was not "
                       "restarted (machines would run different code); roll back or update again")
            self.on_event(message)
            self._add(RecoveryEvent(found.action_id, (), (), (), False, message, seen, time.monotonic(), time.time(),
                                    0, found.kind.value))
            return
        self.on_event(f"{found.kind.value} {found.action_id}: restarting the job in place on "
                      f"{' '.join(machines)} (restart requested by {' '.join(found.restart_requested)})")
        began_wall = time.time()
        self.launcher.last_restart = None  # set again by this restart once the old processes are gone
        try:
            self.control.restart(machines)
            ok, message = True, f"restarted {' '.join(machines)} in place on the new code ({found.kind.value})"
        except RankscopeError as exc:
            ok, message = False, f"the restart after {found.kind.value} {found.action_id} failed: {exc.message}"
        began_wall, resume = self.launcher.last_restart or (began_wall, 0)
        self.on_event(message)
        event = RecoveryEvent(found.action_id, (), (), self.launcher.machines() if ok else (), ok, message, seen,
                              time.monotonic(), began_wall, resume, found.kind.value)
        if ok:
            event = self._as_loaded(event)
            self._journal_resumed(event)
        self._add(event)

    def _add(self, event: RecoveryEvent) -> None:
        with self._changed:
            self.events.append(event)
            self._changed.notify_all()

    def _recover(self, action_id: str, evicted: tuple[str, ...]) -> None:
        seen, began_wall = time.monotonic(), time.time()
        before = dict(self.launcher.addresses())  # the evicted machines' agents are stopped by the eviction
        blocked = blocked_machines(self.launcher)
        reason = block_reason(self.launcher, evicted[0]) if evicted else "evicted"
        self.on_event(f"eviction {action_id} of {' '.join(evicted)} finished: restarting with standbys")
        self.launcher.last_restart = None  # set again by the restart once the old processes are gone
        try:
            outcome = LocalBackend(self.control, lambda: blocked).evict(evicted, reason)
        except RankscopeError as exc:
            outcome = EvictionOutcome(False, evicted, exc.message)
        # The step the restart resumed from, read by the restart itself: read here, after it, the checkpoints
        # are those of the *new* job too (a warm restart of a short job may have finished it by now).
        began_wall, resume = self.launcher.last_restart or (began_wall, 0)
        event = RecoveryEvent(action_id, evicted, outcome.replacements,
                              self.launcher.machines() if outcome.ok else (), outcome.ok, outcome.message, seen,
                              time.monotonic(), began_wall, resume)
        if outcome.ok:
            mark_evicted_in_hostfile(self.launcher.run_dir / HOSTFILE, before, evicted)
        self.on_event(outcome.message)
        if outcome.ok:
            event = self._as_loaded(event)
            self._journal_resumed(event)
        self._add(event)

    def _as_loaded(self, event: RecoveryEvent) -> RecoveryEvent:
        """The event with the step every rank of the new job says it loaded (a `b` backup is newer than the
        checkpoints the launcher sees). Waits for the ranks' reports, at most RANKS_LOADED_S; a restart without
        running nodes, or ranks that do not say in time, keep the checkpoint step."""
        if not self.launcher.nodes:
            return event
        world = self.launcher.layout.world
        deadline = time.monotonic() + RANKS_LOADED_S
        while True:
            loaded = read_loaded(self.launcher.run_dir, event.restart_began_wall)
            if len(loaded) >= world:
                # Ranks agree on the step (they all-reduce it); the lowest is what the job resumed from.
                first = min(loaded.values(), key=lambda lo: lo.step)
                return replace(event, resume_step=first.step, resume_source=first.source)
            # The ranks write their reports in another process: a file poll, ended early by the drill's stop.
            if time.monotonic() > deadline or self._stop.wait(0.2):
                return event

    def _journal_resumed(self, event: RecoveryEvent) -> None:
        """Write the restart to the agents' incident journal; what fails is a note, the drill goes on."""
        try:
            entry = JournalEntry(time.time(), "resumed", resumed_text(event, code_label(self.launcher, event.machines)),
                                 JOURNAL_BY)
            write = self.journal if self.journal is not None else agents_journal(self.launcher)
            story = write([entry])
        except (Exception, asyncio.CancelledError) as exc:
            self.on_event(f"the restart was not written to the agents' incident journal ({type(exc).__name__}: "
                          f"{exc}): the views' Events will not show the step the job resumed from")
            return
        if not any(e.kind == entry.kind and e.text == entry.text for e in story):
            self.on_event("no agent took the restart into its incident journal: the views' Events will not show "
                          "the step the job resumed from")


HOSTFILE = "agents.txt"  # the drill's hostfile, which the pairing command attaches with


def mark_evicted_in_hostfile(path: Path, addresses: dict[str, str], evicted: tuple[str, ...]) -> None:
    """Mark the evicted machines' agents in the hostfile, so every view, attached now or later, shows them evicted."""
    from rankscope.wire.agents_spec import hostfile_members, write_hostfile

    if not path.exists():
        return
    with contextlib.suppress(RankscopeError, OSError):
        members, gone, names = hostfile_members(path)
        out = {addresses[m]: m for m in evicted if m in addresses}  # address -> machine name
        write_hostfile(path, [a for a in members if a not in out], [*gone, *sorted(out)], {**names, **out})


WATCHED = frozenset({ActionKind.EVICT, ActionKind.HOT_UPDATE, ActionKind.ROLLBACK})
RETRY_S = 1.0  # pause after a failed round of the recovery watcher
SETTLE_S = 2.0  # quiet time after an action's last record before it is taken as complete (see _finished)


@dataclass
class _Seen:
    """One action as the agents' audit streams showed it so far."""

    kind: ActionKind
    began: set[str] = field(default_factory=set)
    named: set[str] = field(default_factory=set)  # the machines its "started" lines name (an eviction: all it takes)
    finished: dict[str, str] = field(default_factory=dict)  # machine -> final result
    restart_requested: tuple[str, ...] = ()  # machines whose agent asked the launcher for a restart
    last_mono: float = field(default_factory=time.monotonic)

    def add(self, machine: str, record: AuditRecord) -> None:
        self.began.add(machine)
        if record.result == "started":
            self.named.update(record.machines)
        self.last_mono = time.monotonic()
        if RESTART_REQUESTED in record.message and machine not in self.restart_requested:
            self.restart_requested = (*self.restart_requested, machine)
        if record.result in FINAL:
            self.finished[machine] = record.result


@dataclass(frozen=True, slots=True)
class _Finished:
    kind: ActionKind
    action_id: str
    machines: tuple[str, ...]
    results: dict[str, str] = field(default_factory=dict)
    restart_requested: tuple[str, ...] = ()


async def evict_machines(agents: list[str], token: str, machines: tuple[str, ...], reason: str,
                         requested_by: str = "drill", tls: ClientTLS | None = None) -> list[ActionResult]:
    """Plan, confirm with the typed phrase and run an eviction of ``machines``: what the TUI's `e` sends.

    Returns each agent's final result. Raises RankscopeError when an agent
    gives no plan (nothing is sent then).
    """
    import uuid

    from rankscope.actions.agent_protocol import combined_phrase, confirmation_for
    from rankscope.actions.model import ActionPlan, ActionRequest, EvictArgs, Targets
    from rankscope.wire.client import JobClient

    request = ActionRequest(action_id=f"evict-{uuid.uuid4().hex[:12]}", kind=ActionKind.EVICT,
                            targets=Targets(machines=machines), args=EvictArgs(reason=reason),
                            requested_by=requested_by)
    async with JobClient(agents, token, acting=True, tls=tls) as client:
        answers = await client.plan_action(request)
        plans = [p for p in answers.values() if isinstance(p, ActionPlan)]
        confirmation = confirmation_for(plans, typed=combined_phrase(ActionKind.EVICT, plans))
        return [u.event async for u in client.run_action(request, confirmation) if isinstance(u.event, ActionResult)]
