"""Toasts coalesced and bounded: at most ``MAX_TOASTS`` visible, one per kind, a few lines each.

During an eviction eight toasts (one per agent and step) stacked up over the right 40 % of a 160-column screen and
half of an 80x24 one, hiding the state, the job id and a dialog's buttons. A toast of a kind already shown (its
title's first word: "evict 1/3", "evict result", ...) replaces it, with the new line last; the oldest go when more than
``MAX_TOASTS`` are up. While a dialog is open, toasts wait for it to close (``RankscopeApp`` holds them), so none
covers it; what the dialog itself must say is written inside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from textual.notifications import Notification

MAX_TOASTS = 3
MAX_LINES = 4  # per toast: a merged toast keeps its newest lines


def kind_of(title: str) -> str:
    """A toast's kind: its title's first word ("evict 1/3", "evict 2/3" and "evict result" are one kind)."""
    return title.split(" ", 1)[0]


def coalesce(current: Sequence[Notification], new: Notification) -> tuple[list[Notification], Notification]:
    """The notifications to take down and the one to put up for ``new``.

    A titled notification merges with those of the same kind (``kind_of``) and severity (their lines first, repeats once);
    then the oldest others go until ``MAX_TOASTS`` fit.
    """
    drop: list[Notification] = []
    add = new
    if new.title:
        same = [n for n in current if kind_of(n.title) == kind_of(new.title) and n.severity == new.severity]
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
