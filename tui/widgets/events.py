"""The events timeline: captures, verdict changes, agents lost and found (newest first)."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence

from rankscope.tui.health import fmt_time
from rankscope.tui.state import AppState
from rankscope.tui.story import Event
from rankscope.tui.widgets.table import LineTable
from rich.text import Text

KIND_STYLES = {"lost": "bold red", "found": "bold green", "verdict": "bold yellow", "capture": "cyan",
               "capture-failed": "red", "poll-failed": "red", "hung": "bold red", "resumed": "green", "info": "dim",
               "action": "magenta", "evicted": "bold magenta", "restarted": "bold green"}
KIND_W = max(len(kind) for kind in KIND_STYLES)


class EventsPanel(LineTable):
    _state: AppState | None = None
    _shown: tuple[tuple[Event, ...], int] | None = None

    def on_resize(self) -> None:
        if self._state is not None:  # laid out (a tab just shown) or resized: the rows wrap at the new width
            self.show(self._state)

    def show(self, state: AppState) -> None:
        self._state = state
        width = self.size.width  # 0 before its first layout (a tab just shown): drawn again once laid out
        # The events by identity (a new tuple whenever they change): the journal's line replacing a view's own one
        # leaves their count and the newest the same, and the screen kept the replaced line.
        if self._shown is not None and self._shown[0] is state.events and self._shown[1] == width:
            return
        self._shown = (state.events, width)
        # The vertical scrollbar's columns are kept free whether it shows or not: rows as wide as the panel made a
        # horizontal scrollbar, drawn over the bottom row ("... after the restart   ▂▂"), and a row cut there.
        room = max(0, width - self.styles.scrollbar_size_vertical) if width > 0 else 0
        self.set_rows(("time", "event", "what"), event_rows(state.events, room))


def event_rows(events: Sequence[Event], width: int) -> list[tuple[str | Text, ...]]:
    """The rows of ``events`` (newest first) at ``width`` cells (0: not laid out yet, nothing wrapped). What happened
    is read whole: a long line goes on in the rows below it, never cut ("the job resumed from step 20 (the newest
    checkpoint eve"). The kind column's width is that of every kind a view may log, not of those it holds: two views
    of a pair holding different kinds wrapped one restart's line at different places ("now on mach" / "now on machi")."""
    kind_w = max([KIND_W, *(len(e.kind) for e in events)])
    room = max(20, width - 8 - kind_w - 6) if width > 0 else 0
    rows: list[tuple[str | Text, ...]] = []
    for e in reversed(events):
        lines = textwrap.wrap(e.text, room, break_on_hyphens=False) if room else [e.text]
        rows.append((fmt_time(e.wall), Text(e.kind, KIND_STYLES.get(e.kind, "")), lines[0] if lines else ""))
        rows.extend(("", "", line) for line in lines[1:])
    return rows
