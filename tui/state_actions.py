"""The actions part of the app's state: the agents' audit log as this TUI has seen it, and what it is doing.

Immutable, changed only by the pure functions here (``AppState.actions`` holds
one ``ActionsState``; ``rankscope.tui.state.apply_audit`` and friends fold
it into the whole state). The action controller (``rankscope.tui.actions``)
talks to the agents and posts messages; the app's handlers call these.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from rankscope.actions.model import ActionKind, ActionState, AuditRecord

KIND_LABELS = {ActionKind.EVICT: "evict", ActionKind.HOT_UPDATE: "hot-update", ActionKind.BACKUP: "backup",
               ActionKind.ROLLBACK: "rollback"}
FINAL_RESULTS = frozenset(s.value for s in ActionState if s.final)


def printable(text: str, limit: int = 300) -> str:
    """One line of at most ``limit`` printable characters (agents' text reaches the screen and the audit log)."""
    clean = "".join(ch if ch.isprintable() else " " for ch in text)
    return " ".join(clean.split())[:limit] or "-"


def audit_line_text(record: AuditRecord) -> str:
    """One line for the Events view and notifications."""
    machines = " ".join(record.machines) or "-"
    what = record.message if record.result == "progress" else record.what
    return printable(f"{KIND_LABELS.get(record.kind, record.kind)} {record.result} on {machines} "
                     f"by {record.who}: {what}", 400)


@dataclass(frozen=True, slots=True)
class AuditLine:
    address: str
    record: AuditRecord


@dataclass(frozen=True, slots=True)
class ActionLog:
    """Audit records from every agent (deduplicated by agent and seq) and notes about the streams."""

    lines: tuple[AuditLine, ...] = ()
    notes: tuple[tuple[str, str], ...] = ()  # (agent address, why its stream is missing), in arrival order
    version: int = 0  # bumped on every change, so the panel redraws only when needed
    seen: frozenset[tuple[str, int]] = frozenset()

    def history(self) -> list[AuditRecord]:
        """The hot-update history: updates and rollbacks with how each ended, oldest first."""
        return [x.record for x in self.lines if x.record.kind in (ActionKind.HOT_UPDATE, ActionKind.ROLLBACK)
                and x.record.result in FINAL_RESULTS]


def log_record(log: ActionLog, address: str, record: AuditRecord) -> ActionLog:
    """The log with ``record`` from ``address`` added; the same log when it was seen already (streams resume)."""
    key = (address, record.seq)
    if key in log.seen:
        return log
    return ActionLog((*log.lines, AuditLine(address, record)), tuple(n for n in log.notes if n[0] != address),
                     log.version + 1, log.seen | {key})


def log_note(log: ActionLog, address: str, text: str) -> ActionLog:
    """Why ``address``'s audit stream is missing (replaces its earlier note; a record from it clears the note)."""
    notes = [n for n in log.notes if n[0] != address]
    if len(notes) < len(log.notes):  # keep its place, as a dict would
        notes = [(a, text if a == address else t) for a, t in log.notes]
    else:
        notes.append((address, text))
    return replace(log, notes=tuple(notes), version=log.version + 1)


def drop_notes(log: ActionLog, addresses: frozenset[str]) -> ActionLog:
    """The log without the notes of ``addresses`` (agents out of the job: their streams are no longer followed)."""
    notes = tuple(n for n in log.notes if n[0] not in addresses)
    return log if len(notes) == len(log.notes) else replace(log, notes=notes, version=log.version + 1)


@dataclass(frozen=True, slots=True)
class ActionsState:
    """What the Actions view and the action keys know: the log, the plan being confirmed, the action under way."""

    log: ActionLog = field(default_factory=ActionLog)
    confirming: str | None = None  # the action id whose plan is on screen waiting for a yes or no
    running: str | None = None  # the action id under way from this TUI (one at a time)


def begin_confirm(actions: ActionsState, action_id: str) -> ActionsState:
    return replace(actions, confirming=action_id)


def answer_confirm(actions: ActionsState, action_id: str, confirmed: bool) -> ActionsState:
    """The person answered: a yes makes the action the one under way; either way nothing is confirming."""
    confirming = None if actions.confirming == action_id else actions.confirming
    return replace(actions, confirming=confirming, running=action_id if confirmed else actions.running)


def end_action(actions: ActionsState, action_id: str) -> ActionsState:
    """The run of ``action_id`` ended (a result, an error, or its stream closed)."""
    return replace(actions, running=None) if actions.running == action_id else actions
