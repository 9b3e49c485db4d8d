"""Hot-update and rollback: switch this machine's code link now or record a lazy update, and apply it later.

:class:`~rankscope.actions.hot_update.HotUpdater` switches the code link
(immediate) or records a pending lazy update. The agent never stops the
ranks: on a switch it records :data:`~rankscope.actions.model.RESTART_REQUESTED`
and the launcher restarts them on the new code. A pending lazy update
(ByteRobust §6.1) is applied

- by the agent's supervisor (:func:`apply_due`, every few seconds) when its
  window expired (switch, restart requested) or when the ranks the agent saw
  are gone (a failure: switch only, the job is restarting anyway);
- by :func:`apply_pending` in a launcher's restart path, after the old
  processes stopped and before the new ones start.

Each such application is audited under the request's id plus the trigger
(``.window``, ``.failure``, ``.restart``), with the original requester.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from rankscope.actions.audit import AuditLog
from rankscope.actions.config import ActionsConfig
from rankscope.actions.history import HotUpdateHistory, UpdateKind, UpdateRecord, Version
from rankscope.actions.hot_update import CodeVersions, HotUpdater, JobEvent
from rankscope.actions.model import (
    RESTART_REQUESTED,
    ActionKind,
    ActionRequest,
    ActionResult,
    ActionState,
    HotUpdateArgs,
    RollbackArgs,
    Targets,
    UpdateMode,
    VersionSource,
)
from rankscope.actions.procedures import Outcome, Report
from rankscope.contract.errors import RankscopeError


def switch_code(request: ActionRequest, report: Report, machine: str, versions: CodeVersions,
                history: HotUpdateHistory, clock: Callable[[], float]) -> Outcome:
    """Carry out a confirmed hot-update or rollback: switch now and request a restart, or record it as pending."""

    def restart_requested(version: Version, trigger: str) -> None:
        # The launcher restarts the ranks; the agent records the request and stops nothing.
        report(f"{RESTART_REQUESTED} ({trigger}): the launcher restarts the ranks on {version.label}")

    updater = HotUpdater(versions, history, restart_requested, clock)
    if isinstance(request.args, HotUpdateArgs):
        record = updater.update(request.action_id, request.requested_by, request.args)
    else:
        assert isinstance(request.args, RollbackArgs)
        record = updater.rollback(request.action_id, request.requested_by, request.args)
    report(record.describe())
    if record.mode == UpdateMode.LAZY:
        deadline = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(record.deadline))
        return (ActionState.SUCCEEDED,
                f"pending on {machine}: {record.to_version.label} is applied at the next restart or "
                f"failure, at the latest {deadline}", (record.describe(),))
    return (ActionState.SUCCEEDED,
            f"{machine} now runs its code from {record.to_version.label}; {RESTART_REQUESTED} from the "
            "launcher (the agent did not stop the ranks)", (record.describe(),))


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


def apply_due(audit: AuditLog, history: HotUpdateHistory, machine: str, pending: UpdateRecord, trigger: str,
              apply: Callable[[], UpdateRecord | None], applied: Callable[[UpdateRecord], str],
              clock: Callable[[], float]) -> UpdateRecord | None:
    """Apply ``pending`` through ``apply`` (the updater's answer to ``trigger``) and audit how it went.

    Returns the applied record; the failed one (from the history) when the
    switch failed; None when it was not due. ``applied`` words the success.
    """
    try:
        record = apply()
    except (OSError, RankscopeError) as exc:
        message = exc.message if isinstance(exc, RankscopeError) else str(exc)
        _audit_triggered(audit, machine, pending, trigger, ActionState.FAILED,
                         f"{machine}: pending {pending.to_version.label} could not be applied at the {trigger}: "
                         f"{message}", clock)
        return history.get(pending.id)
    if record is None:
        return None
    _audit_triggered(audit, machine, record, trigger, ActionState.SUCCEEDED, applied(record), clock)
    return record


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
    history = HotUpdateHistory(config.history_path, clock)
    pending = history.pending()
    if pending is None:
        return None
    updater = HotUpdater(config.hot_update.code_versions(), history, None, clock)
    trigger = event.kind.value
    return apply_due(AuditLog(config.audit_path, clock), history, machine, pending, trigger,
                     lambda: updater.on_event(event),
                     lambda record: f"{machine} now runs its code from {record.to_version.label}: the pending lazy "
                                    f"update was applied at the {trigger}, before the ranks started again",
                     clock)
