"""Messages between the data workers and the app, named in the past tense.

Polls arrive about once a second; if the UI falls behind (a 16k-rank
snapshot, a slow terminal), an undelivered ``SnapshotReceived`` of a poll is
replaced by the newer one instead of queueing up (toolong's ``can_replace``):
the screen shows the latest state, never a backlog.
"""

from __future__ import annotations

from collections.abc import Callable

from rankscope.actions.model import AuditRecord
from rankscope.tui.analysis import StackView
from rankscope.tui.digest import PollDigest
from rankscope.tui.state_actions import ActionsState
from textual.message import Message


class SnapshotReceived(Message):
    """A poll was digested off the UI thread and is ready to fold into the state."""

    def __init__(self, digest: PollDigest, received_wall: float) -> None:
        super().__init__()
        self.digest = digest
        self.received_wall = received_wall

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, SnapshotReceived)


class CaptureAnalyzed(Message):
    """A stack capture was taken and analyzed (never replaced: each one is an event)."""

    def __init__(self, digest: PollDigest, view: StackView, received_wall: float) -> None:
        super().__init__()
        self.digest = digest
        self.view = view
        self.received_wall = received_wall


class CaptureFailed(Message):
    def __init__(self, error: str, received_wall: float) -> None:
        super().__init__()
        self.error = error
        self.received_wall = received_wall


class PollFailed(Message):
    """The whole poll failed (not one agent: those come back as unreachable machines)."""

    def __init__(self, error: str, received_wall: float) -> None:
        super().__init__()
        self.error = error
        self.received_wall = received_wall

    def can_replace(self, message: Message) -> bool:
        return isinstance(message, PollFailed)


class AgentLost(Message):
    """Posted by the app after a poll shows a machine that was reachable is not any more."""

    def __init__(self, machine: str) -> None:
        super().__init__()
        self.machine = machine


class AgentFound(Message):
    """Posted by the app after a poll shows a lost machine answering again."""

    def __init__(self, machine: str) -> None:
        super().__init__()
        self.machine = machine


class AuditReceived(Message):
    """An agent's audit stream delivered a record (the action controller's watch posts it)."""

    def __init__(self, address: str, record: AuditRecord) -> None:
        super().__init__()
        self.address = address
        self.record = record


class AuditNoted(Message):
    """An agent's audit stream is missing, and why (it reconnects); ``text`` empty: it is open again."""

    def __init__(self, address: str, text: str) -> None:
        super().__init__()
        self.address = address
        self.text = text


class ActionChanged(Message):
    """The action controller began or answered a confirmation, or a run ended.

    ``change`` is one of the pure reducers of ``rankscope.tui.state_actions``
    with its arguments bound (``functools.partial``); the app applies it.
    """

    def __init__(self, change: Callable[[ActionsState], ActionsState]) -> None:
        super().__init__()
        self.change = change
