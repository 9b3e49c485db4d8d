"""The events timeline: captures, verdict changes, agents lost and found (newest first)."""

from __future__ import annotations

import textwrap

from rankscope.tui.health import fmt_time
from rankscope.tui.state import AppState
from rankscope.tui.widgets.table import LineTable
from rich.text import Text

KIND_STYLES = {"lost": "bold red", "found": "bold green", "verdict": "bold yellow", "capture": "cyan",
               "capture-failed": "red", "poll-failed": "red", "hung": "bold red", "resumed": "green", "info": "dim",
               "action": "magenta", "evicted": "bold magenta", "restarted": "bold green"}


class EventsPanel(LineTable):
    _state: AppState | None = None

    def on_resize(self) -> None:
        if self._state is not None:  # laid out (a tab just shown) or resized: the rows wrap at the new width
            self.show(self._state)

    def show(self, state: AppState) -> None:
        self._state = state
        width = self.size.width  # 0 before its first layout (a tab just shown): drawn again once laid out
        key = (len(state.events), state.events[-1] if state.events else None, width)
        if key == getattr(self, "_shown", None):
            return
        self._shown = key
        events = tuple(reversed(state.events))
        kind_w = max((len(e.kind) for e in events), default=5)
        # What happened is read whole: a long line goes on in the rows below it (one line per row), never cut
        # ("the job resumed from step 20 (the newest checkpoint eve").
        room = max(20, width - 8 - kind_w - 6) if width > 0 else 0
        rows: list[tuple[str | Text, ...]] = []
        for e in events:
            lines = textwrap.wrap(e.text, room, break_on_hyphens=False) if room else [e.text]
            rows.append((fmt_time(e.wall), Text(e.kind, KIND_STYLES.get(e.kind, "")), lines[0] if lines else ""))
            rows.extend(("", "", line) for line in lines[1:])
        self.set_rows(("time", "event", "what"), rows)
