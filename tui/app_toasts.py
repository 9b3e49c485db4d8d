"""The app's toasts: merged by kind and bounded (``rankscope.tui.toasts``), held while a dialog is open so none
covers it, and the toasts that say an agent was lost or is back."""

from __future__ import annotations

from rankscope.tui.app_part import AppPart
from rankscope.tui.messages import AgentFound, AgentLost
from rankscope.tui.toasts import ToastKind, coalesce, kinded
from textual.notifications import Notification, Notify, SeverityLevel
from textual.screen import ModalScreen


class ToastsPart(AppPart):
    _held_toasts: list[Notification]  # raised while a dialog was open (``_on_notify``)

    def notify(self, message: str, *, title: str = "", severity: SeverityLevel = "information",
               timeout: float | None = None, markup: bool = True, kind: ToastKind | None = None) -> None:
        """``App.notify`` with the toast's kind, given where it is raised: toasts of one kind merge (``tui.toasts``)."""
        if kind is None:
            super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)
            return
        self.post_message(Notify(kinded(message, title, severity,
                                        self.NOTIFICATION_TIMEOUT if timeout is None else timeout, markup, kind)))

    def _on_notify(self, event: Notify) -> None:
        """Toasts coalesced by kind and bounded (``tui.toasts``); held while a dialog is open, so none covers it.
        None once the last screen is gone: a worker's toast that arrives as the app quits is no one's news (asking
        for the screen then raised, and the quit ended in a traceback)."""
        if not self.screen_stack:
            return
        if isinstance(self.screen, ModalScreen):
            self._held_toasts.append(event.notification)
            return
        self._show_toast(event.notification)

    def _show_toast(self, notification: Notification) -> None:
        drop, add = coalesce(list(self._notifications), notification)
        for n in drop:
            if n in self._notifications:
                self._unnotify(n, refresh=False)
        self._notifications.add(add)
        self._refresh_notifications()

    def _release_toasts(self) -> None:
        """The toasts held while a dialog was open, once it closed (those still within their time); toasts raised
        before a dialog opened are taken down while it is open (they covered its buttons)."""
        if isinstance(self.screen, ModalScreen):
            up = list(self._notifications)
            if up:
                for n in up:
                    self._unnotify(n, refresh=False)
                self._held_toasts.extend(up)
                self._refresh_notifications()
            return
        if not self._held_toasts:
            return
        held = list(self._held_toasts)  # working state of the toasts, not drawn state: kept in place
        self._held_toasts.clear()
        for n in held:
            if n.time_left > 0:
                self._show_toast(n)

    def on_agent_lost(self, message: AgentLost) -> None:
        if self.state.awaiting_restart:  # the job restarts with its agents: "restarting" (header, map, Events)
            return
        self.notify(f"agent {message.machine} lost", severity="warning", timeout=4)

    def on_agent_found(self, message: AgentFound) -> None:
        if self.state.awaiting_restart:
            return
        self.notify(f"agent {message.machine} is back", timeout=3)
