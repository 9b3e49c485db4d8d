"""Toasts coalesced and bounded: at most ``MAX_TOASTS`` visible, one per kind, a few lines each.

During an eviction eight toasts (one per agent and step) stacked up over the right 40 % of a 160-column screen and
half of an 80x24 one, hiding the state, the job id and a dialog's buttons. A toast is given its kind where it is raised
(``RankscopeApp.notify(..., kind=...)``: the action it is about, or a ``Topic``); one of a kind already shown ("evict
1/3", "evict result", ...) replaces it, with the new line last; the oldest go when more than ``MAX_TOASTS`` are up.
While a dialog is open, toasts wait for it to close (``RankscopeApp`` holds them), so none covers it; what the dialog
itself must say is written inside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TypeAlias

from rankscope.actions.model import ActionKind
from textual.notifications import Notification, SeverityLevel

MAX_TOASTS = 3
MAX_LINES = 4  # per toast: a merged toast keeps its newest lines


class Topic(StrEnum):
    """Kinds of toasts about no one action."""

    CANNOT_ACT = "cannot act"  # an action key refused before anything was planned
    NO_SUSPECT = "no suspect"  # e found nothing it may evict now (stale, mid-step or no verdict)
    DESYNC = "desync"  # e refused: a desync is not cured by evicting machines


ToastKind: TypeAlias = ActionKind | Topic


@dataclass
class KindedNotification(Notification):
    """A notification with the kind it merges by, set where it is raised (never read back from its title)."""

    kind: ToastKind | None = None


def kinded(message: str, title: str, severity: SeverityLevel, timeout: float, markup: bool,
           kind: ToastKind) -> KindedNotification:
    """The notification ``App.notify`` would make, with its kind."""
    return KindedNotification(message, title, severity, timeout, markup=markup, kind=kind)


def kind_of(notification: Notification) -> ToastKind | None:
    """A toast's kind: ``None`` for one raised without a kind (it merges with none)."""
    return notification.kind if isinstance(notification, KindedNotification) else None


def coalesce(current: Sequence[Notification], new: Notification) -> tuple[list[Notification], Notification]:
    """The notifications to take down and the one to put up for ``new``.

    A notification with a kind merges with those of the same kind (``kind_of``) and severity (their lines first,
    repeats once); then the oldest others go until ``MAX_TOASTS`` fit.
    """
    drop: list[Notification] = []
    add = new
    kind = kind_of(new)
    if kind is not None:
        same = [n for n in current if kind_of(n) == kind and n.severity == new.severity]
        if same:
            lines: list[str] = []
            for n in [*same, new]:
                for line in n.message.splitlines():
                    if line in lines:
                        lines.remove(line)
                    lines.append(line)
            add = replace(new, message="\n".join(lines[-MAX_LINES:]))
            drop.extend(same)
    if "\n" in add.message and len(add.message.splitlines()) > MAX_LINES:
        add = replace(add, message="\n".join(add.message.splitlines()[:MAX_LINES]))
    rest = sorted((n for n in current if n not in drop), key=lambda n: n.raised_at)
    while len(rest) >= MAX_TOASTS:
        drop.append(rest.pop(0))
    return drop, add
