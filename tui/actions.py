"""The action keys (e evict, u hot-update, b checkpoint backup): plan, confirm by name, run, watch the audit log.

The TUI never decides on its own: a key builds an ``ActionRequest`` from
what the screen shows (the verdict's top suspect, or the suspect under the
rank-map cursor), asks the agents for their plan, and shows that plan --
exact machines, processes (pid, rank), standbys, backup peers and the argv
the backend will run -- in a ``ConfirmModal`` whose default is Cancel.
Eviction needs the phrase typed (k9s); only then does the request go out,
with a confirmation of exactly the planned targets (the client and each
agent check it again). Progress and the result are shown as they come.

Every attached TUI, read-only ones included, follows the agents' audit
streams (``watch_audit``), so a person in the other pane of a pair sees an
action happen live. The audit records feed the Events view, and the
Actions view (``ActionsPanel``) with the hot-update history and the warm
standby sizing (ByteRobust §6.2's P99 binomial).

Nothing here imports grpc: the source's passthroughs reach the client.
"""

from __future__ import annotations

import getpass
import secrets
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rankscope.actions.agent_protocol import (
    ActionError,
    ActionUpdate,
    AgentLost,
    AuditItem,
    AuditResumed,
    Confirmation,
    confirmation_for,
)
from rankscope.actions.model import (
    ActionKind,
    ActionPlan,
    ActionProgress,
    ActionRequest,
    ActionResult,
    BackupArgs,
    ConfirmationRule,
    EvictArgs,
    HotUpdateArgs,
    RollbackArgs,
    Targets,
    UpdateMode,
    VersionSource,
)
from rankscope.analyzers.chain import DESYNC_ADVICE
from rankscope.analyzers.eviction_scope import GROUP, EvictionOption, EvictionScope, eviction_scope, option_line
from rankscope.analyzers.findings import Suspect, SuspectKind
from rankscope.analyzers.labels import suspect_label
from rankscope.contract.errors import RankscopeError
from rankscope.contract.ranks import compact_ranks
from rankscope.tui import health as hl
from rankscope.tui import staleness
from rankscope.tui import state as st
from rankscope.tui import state_actions as sa
from rankscope.tui.analysis import StackView
from rankscope.tui.messages import ActionChanged, AuditNoted, AuditReceived
from rankscope.tui.state_actions import KIND_LABELS, printable
from rankscope.tui.toasts import Topic
from rich.text import Text
from textual.message import Message

if TYPE_CHECKING:
    from rankscope.tui.screens.confirm import PlanningModal

# What the agent's interceptor says when a read token asks to act (see rankscope.wire.agent).
_ROLE_REFUSAL = ("needs a token with the 'act' role", "does not allow this call with this token")
ACT_TOKEN_FIX = ("attach with --token-file naming a token the agents accept with the 'act' role "
                 "(a line 'act:<token>' in the agents' token file)")


@runtime_checkable
class ActionSource(Protocol):
    """What a source offers for actions (LiveSource; BundleSource refuses with the fix)."""

    act_problem: tuple[str, str] | None

    async def plan_action(self, request: ActionRequest) -> Mapping[str, ActionPlan | ActionError]: ...

    def run_action(self, request: ActionRequest, confirmation: Confirmation) -> AsyncIterator[ActionUpdate]: ...

    def watch_audit(self, since: int | None = 0) -> AsyncIterator[AuditItem]: ...


# --------------------------------------------------------------------------
# requests from what is on screen (pure)
# --------------------------------------------------------------------------


def pick_suspect(view: StackView | None, selected_rank: int | None = None) -> Suspect | None:
    """The suspect an eviction aims at: the verdict's top one, unless the person points at an outlier rank.

    A selected rank of the dominant (healthy) stack group says nothing -- the
    map's cursor starts on rank 0 -- so only an outlier rank picks the most
    likely suspect holding it.
    """
    if view is None or not view.verdict.suspects:
        return None
    dominant = view.dominant
    if selected_rank is not None and (dominant is None or selected_rank not in dominant.ranks):
        for s in view.verdict.suspects:
            if selected_rank in s.ranks:
                return s
    return view.verdict.top


def new_action_id(kind: ActionKind, now: float) -> str:
    """Unique per press (the agents carry out an id at most once), readable in the audit log."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    return f"{KIND_LABELS[kind]}-{stamp}-{secrets.token_hex(3)}"


def requester() -> str:
    """Who acts, as the audit log records it: user@host of this terminal."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    return printable(f"{user}@{socket.gethostname()} (rankscope attach)")


def evict_request(suspect: Suspect, action_id: str, who: str, job_id: str | None = None,
                  option: EvictionOption | None = None) -> ActionRequest:
    """Evict ``option``'s machines (default: every machine of the suspect group, ByteRobust §5.3), named by machine.

    The controller passes the option of ``eviction_scope`` the person chose: the machines the evidence pins, or
    the whole group.
    """
    evidence = suspect.evidence[0] if suspect.evidence else "named by the verdict"
    machines = option.machines if option is not None else tuple(suspect.machines)
    if option is not None and option.scope != GROUP and set(option.ranks) != set(suspect.ranks):
        label = f"{_ranks_words(option.ranks)} of {suspect_label(suspect)}"
    else:
        label = suspect_label(suspect) + (" (whole group)" if option is not None else "")
    reason = printable(f"{label}: {evidence}")
    return ActionRequest(action_id, ActionKind.EVICT, Targets(tuple(machines)), EvictArgs(reason), who, job_id)


def evict_title(suspect: Suspect, option: EvictionOption) -> str:
    """The eviction dialog's title: what is evicted and why, in the words of ``eviction_scope``."""
    if option.scope == GROUP or set(option.ranks) == set(suspect.ranks):  # "rank 1 of rank 1" said nothing
        return f"Evict {suspect_label(suspect)}: {option_line(option)}"
    return f"Evict {_ranks_words(option.ranks)} of {suspect_label(suspect)}: {option_line(option)}"


def _ranks_words(ranks: Sequence[int]) -> str:
    """``rank 5``, ``ranks 4-5``: the title read "Evict rank 4-5 of PP groups #0 and #1"."""
    return f"rank{'s' if len(ranks) != 1 else ''} {compact_ranks(ranks, 8)}"


def scope_text(scope: EvictionScope, chosen: EvictionOption) -> Text:
    """Why this plan takes what it takes, and the other plan offered beside it (with its cost)."""
    t = Text()
    if chosen.scope == GROUP:
        t.append("scope: the whole suspect group (ByteRobust's over-eviction)", "bold")
    else:
        t.append("scope: only what the evidence names", "bold")
    default = " (the default)" if chosen == scope.default else ""
    t.append(f"{default}; {scope.reason}\n")
    other = scope.other if chosen == scope.default else scope.default
    if other is not None:
        what = "over-evict the whole group" if other.scope == GROUP else "evict only what the evidence names"
        extra = f", {len(scope.extra_of_group)} more than the evidence names" if other.scope == GROUP else ""
        t.append(f"other plan: {what}: {option_line(other)}{extra} — ctrl+o (the '{other_label(other)}' button)\n", "dim")
    return t


def other_label(option: EvictionOption) -> str:
    """The dialog's button for the plan not shown (short: the plan text names its machines)."""
    n = len(option.machines)
    what = "Whole group" if option.scope == GROUP else "Only the evidence"
    return f"{what} ({n} machine{'s' if n != 1 else ''})"


def update_request(version: str, mode: UpdateMode, action_id: str, who: str,
                   job_id: str | None = None) -> ActionRequest:
    """Hot-update the whole job: a path is a prepared directory, anything else a git ref."""
    version = version.strip()
    source = VersionSource.DIR if version.startswith("/") else VersionSource.GIT
    return ActionRequest(action_id, ActionKind.HOT_UPDATE, Targets(), HotUpdateArgs(source, version, mode), who,
                         job_id)


def rollback_request(mode: UpdateMode, action_id: str, who: str, job_id: str | None = None) -> ActionRequest:
    return ActionRequest(action_id, ActionKind.ROLLBACK, Targets(), RollbackArgs(mode=mode), who, job_id)


def backup_request(action_id: str, who: str, job_id: str | None = None) -> ActionRequest:
    return ActionRequest(action_id, ActionKind.BACKUP, Targets(), BackupArgs(), who, job_id)


# --------------------------------------------------------------------------
# plans as a person reads them (pure)
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PlanSummary:
    """Every agent's answer to one request: the plans, the refusals, and what confirming takes."""

    request: ActionRequest
    plans: tuple[ActionPlan, ...]
    errors: tuple[ActionError, ...]

    @property
    def runnable(self) -> bool:
        return bool(self.plans) and not self.errors

    @property
    def rule(self) -> ConfirmationRule:
        """The one confirmation rule, over the plans in the client's order (what it checks them against)."""
        return ConfirmationRule.of(self.plans, self.request.kind)

    @property
    def machines(self) -> tuple[str, ...]:
        return self.rule.machines

    @property
    def in_rank_order(self) -> tuple[ActionPlan, ...]:
        """The plans as a person reads them: by the lowest rank each acts on, then machine.

        The agents answer in the order the client lists them, which is the order they came up in: the backup
        plan of ranks 0-1 was once last, below the modal's fold. The phrase and the confirmation keep the
        client's order (``plans``), which is what it checks them against.
        """
        def key(plan: ActionPlan) -> tuple[int, tuple[str, ...]]:
            ranks = [p.rank for p in plan.processes if p.rank is not None]
            ranks += [rank for rank, _peer in plan.backup_peers]
            return (min(ranks) if ranks else 1 << 62, plan.machines)
        return tuple(sorted(self.plans, key=key))

    @property
    def shown_machines(self) -> tuple[str, ...]:
        """The planned machines in the order the plans are shown."""
        return ConfirmationRule.of(self.in_rank_order).machines

    @property
    def phrase(self) -> str | None:
        """The phrase to type (eviction), or None when an explicit yes is enough."""
        return self.rule.phrase

    def accepts(self, answer: str | bool | None) -> bool:
        """Whether what the person typed (or their yes) confirms the plans."""
        return self.rule.accepts(answer)

    def confirmation(self, typed: str = "") -> Confirmation:
        """Exactly the planned targets, as ``run_action`` wants them."""
        return confirmation_for(self.plans, self.request.targets.ranks, typed if self.phrase is not None else "")


def backup_title(state: st.AppState) -> str:
    """The backup modal's title; on a hung job it says first that no shard will come (a rank snapshots its state
    at a step boundary, and a hung rank reaches none), so a person at 3 a.m. does not wait a minute to learn it."""
    h = hl.health(state)
    if h.kind != "hung":
        return "Checkpoint backup"
    return (f"Checkpoint backup — the job is {h.text}: no rank reaches a step boundary, so no shard will come and "
            "this backup fails after its wait; a restart resumes from the last backup or checkpoint")


def summarize(request: ActionRequest, answers: Mapping[str, ActionPlan | ActionError]) -> PlanSummary:
    plans = tuple(a for a in answers.values() if isinstance(a, ActionPlan))
    errors = tuple(a for a in answers.values() if isinstance(a, ActionError))
    return PlanSummary(request, plans, errors)


def plan_text(summary: PlanSummary, process_limit: int = 64) -> Text:
    """The plan, exactly: machines, processes (pid, rank), standbys, backup peers, argv, steps, warnings."""
    import shlex

    t = Text()
    kind = KIND_LABELS[summary.request.kind]
    t.append(f"{kind} ", "bold")
    t.append(" ".join(summary.shown_machines) or "(no machine)", "bold red" if kind == "evict" else "bold")
    t.append(f"   action {summary.request.action_id}\n", "dim")
    if summary.request.kind == ActionKind.EVICT:
        assert isinstance(summary.request.args, EvictArgs)
        t.append(f"reason: {summary.request.args.reason}\n", "italic")
    for e in summary.errors:
        t.append(f"✗ {e.message}\n", "bold red")
        if e.fix:
            t.append(f"  fix: {e.fix}\n", "yellow")
    shown = 0
    for plan in summary.in_rank_order:
        t.append(f"\n▸ {plan.summary}\n", "bold cyan")
        by_rank: dict[int | None, list[int]] = {}
        for p in plan.processes:
            by_rank.setdefault(p.rank, []).append(p.pid)
        if by_rank:
            t.append("  processes (rank: pids): ")
            parts = []
            for rank, pids in sorted(by_rank.items(), key=lambda kv: (kv[0] is None, kv[0] or 0)):
                if shown >= process_limit:
                    parts.append(f"… +{len(plan.processes) - shown} more")
                    break
                parts.append(f"{'?' if rank is None else rank}: {' '.join(map(str, pids))}")
                shown += len(pids)
            t.append("; ".join(parts) + "\n")
        else:
            t.append("  processes: none found on this machine\n", "yellow")
        if plan.standbys:
            # The agent lists the pool on hand; one standby takes each evicted machine's place.
            joining = len(plan.machines) if plan.machines else len(plan.standbys)
            if joining < len(plan.standbys):
                t.append(f"  standbys on hand: {' '.join(plan.standbys)} ({joining} joins, one per evicted "
                         "machine)\n", "green")
            else:
                t.append(f"  standbys joining: {' '.join(plan.standbys)}\n", "green")
        if plan.backup_peers:
            t.append("  backup peers (rank→peer): " + " ".join(f"{r}→{p}" for r, p in plan.backup_peers) + "\n")
        for argv in plan.commands:
            t.append(f"  runs: {shlex.join(argv)}\n", "magenta")
        for step in plan.steps:
            t.append(f"  · {step}\n", "dim")
        for w in plan.warnings:
            t.append(f"  ! {w}\n", "yellow")
    return t


def result_is_role_refusal(result: ActionResult) -> bool:
    return any(m in result.message for m in _ROLE_REFUSAL)


# --------------------------------------------------------------------------
# the controller: keys -> plan -> confirm -> run, and the audit watch
# --------------------------------------------------------------------------


class ActionHost(Protocol):
    """What the controller uses of the app (``RankscopeApp``), named here so this module does not import the app.

    (The app imports this module; an import back would close a circle, tests/integration/test_layers.py.)
    """

    state: st.AppState
    clock: Callable[[], float]

    @property
    def source(self) -> Any: ...

    @property
    def notify(self) -> Callable[..., None]: ...

    @property
    def push_screen(self) -> Callable[..., Any]: ...

    @property
    def run_worker(self) -> Callable[..., Any]: ...

    def post_message(self, message: Message) -> bool: ...


class ActionController:
    """Drives the action keys of one app: talks to the agents and posts what happens as messages.

    What is drawn (the audit log, the plan being confirmed, the action under
    way) is in the app's ``AppState.actions``, changed by the app's handlers
    of these messages; the controller keeps only its working state.
    """

    def __init__(self, app: ActionHost, who: Callable[[], str] = requester) -> None:
        self.app = app
        self.who = who
        self.last_result: dict[str, ActionResult] = {}  # agent address -> result of the latest run here
        self.watching = False

    @property
    def source(self) -> Any:
        return self.app.source

    def _problem(self) -> tuple[str, str] | None:
        if not isinstance(self.source, ActionSource):
            return ("this source cannot act", "attach to a live job's agents")
        running = self.app.state.actions.running
        if running is not None:
            return (f"action {running} is still under way", "wait for its result (Actions view, 6)")
        return self.source.act_problem

    def _refuse_if_cannot_act(self) -> bool:
        problem = self._problem()
        if problem is None:
            return False
        message, fix = problem
        self.app.notify(f"{message}\nfix: {fix}", title="cannot act", severity="error", timeout=8,
                        kind=Topic.CANNOT_ACT)
        return True

    def _job_id(self) -> str | None:
        return self.app.state.job_id

    # -- keys -----------------------------------------------------------------

    def evict(self, selected_rank: int | None = None) -> None:
        if self._refuse_if_cannot_act():
            return
        stale = staleness.verdict_stale(self.app.state)
        mark = self.app.state.verdict
        if stale is not None or mark is None or mark.running:
            # The stacks name nothing to act on now; a live fail-slow verdict (view 7) may: the job is running.
            slow, why = staleness.failslow_target(self.app.state)
            if slow is not None:
                scope = eviction_scope(slow, self.app.state.machine_of_rank())
                self.evict_option(slow, scope, scope.default)
                return
            if why is not None and stale is None and (mark is None or mark.running):
                self.app.notify(f"nothing to evict now: the fail-slow verdict is stale ({why})\n"
                                "fix: wait for the detectors' next verdict (view 7), or capture (s) if the job is "
                                "stuck", title="no suspect", severity="warning", timeout=8,
                                kind=Topic.NO_SUSPECT)
                return
        if stale is not None:
            # A verdict of another launch, or of a job that moved on, must never pick machines to take out.
            self.app.notify(f"nothing to evict now: the verdict on screen is stale ({stale})\n"
                            "fix: if the job is stuck again, capture (s) and evict from the new verdict",
                            title="no suspect", severity="warning", timeout=8,
                            kind=Topic.NO_SUSPECT)
            return
        if mark is not None and mark.running:
            # Ranks caught mid-step differ by timing: no machine is to blame for that.
            self.app.notify("nothing to evict now: the capture on screen was taken while the job was making "
                            "progress, so it names no suspect\nfix: if the job stops, capture (s) and evict from "
                            "the new verdict", title="no suspect", severity="warning", timeout=8,
                            kind=Topic.NO_SUSPECT)
            return
        suspect = pick_suspect(self.app.state.stacks, selected_rank)
        if suspect is None:
            self.app.notify("no suspect to evict: capture stacks (s) until the verdict names a group",
                            severity="warning", timeout=6)
            return
        if suspect.kind is SuspectKind.DESYNC:
            # A program mismatch moves with the program: new machines would run the same code into the same wait.
            self.app.notify(f"no eviction for a desync: ranks {compact_ranks(suspect.ranks, 8)} are at another point "
                            f"of the program than the {len(suspect.victims)} ranks waiting for them\n"
                            f"fix: {DESYNC_ADVICE}", title="desync", severity="warning", timeout=12,
                            kind=Topic.DESYNC)
            return
        scope = eviction_scope(suspect, self.app.state.machine_of_rank())
        self.evict_option(suspect, scope, scope.default)

    def evict_option(self, suspect: Suspect, scope: EvictionScope, option: EvictionOption) -> None:
        """Plan the eviction of ``option``; its dialog offers the scope's other option beside it."""
        request = evict_request(suspect, new_action_id(ActionKind.EVICT, self.app.clock()), self.who(),
                                self._job_id(), option)
        other = scope.other if option == scope.default else scope.default
        alternative = None if other is None or other == option else (
            partial(self.evict_option, suspect, scope, other), other_label(other))
        self._plan(request, evict_title(suspect, option), scope_text(scope, option), alternative)

    def update(self) -> None:
        if self._refuse_if_cannot_act():
            return
        from rankscope.tui.screens.confirm import UpdateChoice, UpdateModal

        def chosen(choice: UpdateChoice | None) -> None:
            if choice is None:
                return
            now = self.app.clock()
            try:
                if choice.rollback:
                    request = rollback_request(choice.mode, new_action_id(ActionKind.ROLLBACK, now), self.who(),
                                               self._job_id())
                else:
                    request = update_request(choice.version, choice.mode, new_action_id(ActionKind.HOT_UPDATE, now),
                                             self.who(), self._job_id())
            except RankscopeError as exc:
                self.app.notify(f"{exc.message}\nfix: {exc.fix}", title="hot-update", severity="error", timeout=8,
                                kind=ActionKind.ROLLBACK if choice.rollback else ActionKind.HOT_UPDATE)
                return
            title = "Roll back" if choice.rollback else f"Hot-update to {choice.version} ({choice.mode.value})"
            self._plan(request, title)

        self.app.push_screen(UpdateModal(), chosen)

    def backup(self) -> None:
        if self._refuse_if_cannot_act():
            return
        request = backup_request(new_action_id(ActionKind.BACKUP, self.app.clock()), self.who(), self._job_id())
        self._plan(request, backup_title(self.app.state))

    # -- plan, confirm, run ---------------------------------------------------------

    def _plan(self, request: ActionRequest, title: str, preface: Text | None = None,
              alternative: tuple[Callable[[], None], str] | None = None) -> None:
        from rankscope.tui.screens.confirm import PlanningModal

        planning = PlanningModal(KIND_LABELS[request.kind])
        worker = self.app.run_worker(self._plan_then_confirm(request, title, planning, preface, alternative),
                                     group="action-plan", exclusive=True)

        def planning_closed(plan_in: bool | None) -> None:
            if plan_in:
                return  # the dialog takes over
            worker.cancel()  # escape: the plan is not wanted any more
            self.app.notify(f"{KIND_LABELS[request.kind]} cancelled while planning: nothing was sent", timeout=4)

        self.app.push_screen(planning, planning_closed)

    async def _plan_then_confirm(self, request: ActionRequest, title: str, planning: PlanningModal,
                                 preface: Text | None = None,
                                 alternative: tuple[Callable[[], None], str] | None = None) -> None:
        from rankscope.tui.screens.confirm import ConfirmModal

        try:
            answers: Mapping[str, ActionPlan | ActionError] | Exception = await self.source.plan_action(request)
        except Exception as exc:  # the screen stays; the person reads why
            answers = exc
        if planning.is_attached and planning.is_current:  # the notice down (True: not cancelled) before what follows
            await planning.dismiss(True)
        if isinstance(answers, RankscopeError):
            self.app.notify(f"{answers.message}\nfix: {answers.fix}", title="no plan", severity="error", timeout=8,
                            kind=request.kind)
            return
        if isinstance(answers, Exception):
            self.app.notify(f"planning failed: {type(answers).__name__}: {answers}", severity="error", timeout=8)
            return
        summary = summarize(request, answers)
        text = plan_text(summary)
        if preface is not None:
            text = Text.assemble(preface, "\n", text)
        modal = ConfirmModal(title, summary, text, alternative[1] if alternative is not None else None)

        def answered(confirmed: bool | None) -> None:
            self.app.post_message(ActionChanged(partial(sa.answer_confirm, action_id=request.action_id,
                                                        confirmed=bool(confirmed))))
            if not confirmed and modal.switched and alternative is not None:
                alternative[0]()  # the other plan, asked of the agents afresh; nothing was sent for this one
                return
            if not confirmed:
                self.app.notify(f"{KIND_LABELS[request.kind]} cancelled: nothing was sent", timeout=4)
                return
            self.app.run_worker(self._run(summary, modal.typed), group="action-run")

        self.app.post_message(ActionChanged(partial(sa.begin_confirm, action_id=request.action_id)))
        self.app.push_screen(modal, answered)

    async def _run(self, summary: PlanSummary, typed: str) -> None:
        request = summary.request
        kind = KIND_LABELS[request.kind]
        try:
            async for update in self.source.run_action(request, summary.confirmation(typed)):
                event = update.event
                if isinstance(event, ActionProgress):
                    self.app.notify(f"{st.machine_name(self.app.state, update.address)}: {event.message}",
                                    title=f"{kind} {event.step}/{event.total}", timeout=4, kind=request.kind)
                elif isinstance(event, ActionResult):
                    self.last_result[update.address] = event
                    self._show_result(update.address, event)
        except RankscopeError as exc:
            self.app.notify(f"{exc.message}\nfix: {exc.fix}", title=f"{kind} not sent", severity="error", timeout=10,
                            kind=request.kind)
        except Exception as exc:
            self.app.notify(f"{kind} failed: {type(exc).__name__}: {exc}", severity="error", timeout=10)
        finally:
            self.app.post_message(ActionChanged(partial(sa.end_action, action_id=request.action_id)))

    def _show_result(self, address: str, result: ActionResult) -> None:
        kind = KIND_LABELS[result.kind]
        if result_is_role_refusal(result):
            self.app.notify(f"{st.machine_name(self.app.state, address)} refused: this token may not act (nothing was done there)\nfix: {ACT_TOKEN_FIX}",
                            title=f"{kind} refused", severity="error", timeout=12, kind=result.kind)
            return
        extra = f" (recorded result of {result.action_id})" if result.replayed else ""
        name = st.machine_name(self.app.state, address)
        self.app.notify(f"{name}: {result.state.value}: {result.message}{extra}", title=f"{kind} result",
                        severity="information" if result.ok else "error", timeout=10, kind=result.kind)

    # -- the audit watch ----------------------------------------------------------

    def start_watch(self) -> None:
        """Follow every agent's audit log for as long as the app runs (read-only sessions too)."""
        if self.watching or not isinstance(self.source, ActionSource):
            return
        self.watching = True
        self.app.run_worker(self._watch(), group="audit", exit_on_error=False)

    async def _watch(self) -> None:
        async for item in self.source.watch_audit(since=0):
            if isinstance(item, AuditResumed):
                self.app.post_message(AuditNoted(item.address, ""))  # no note: its stream is open again
            elif isinstance(item, AgentLost):
                note = f"audit of {item.address}: {item.message}"
                if item.fix:
                    note += f" (fix: {item.fix})"
                self.app.post_message(AuditNoted(item.address, note + (" — reconnecting" if item.retrying else "")))
            else:
                address, record = item
                self.app.post_message(AuditReceived(address, record))
