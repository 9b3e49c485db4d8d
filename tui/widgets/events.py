"""The events timeline: captures, verdict changes, agents lost and found (newest first)."""

from __future__ import annotations

from rankscope.tui.health import fmt_time
from rankscope.tui.state import AppState
from rankscope.tui.widgets.table import LineTable
from rich.text import Text

KIND_STYLES = {"lost": "bold red", "found": "bold green", "verdict": "bold yellow", "capture": "cyan",
               "capture-failed": "red", "poll-failed": "red", "hung": "bold red", "resumed": "green", "info": "dim",
               "action": "magenta", "evicted": "bold magenta", "restarted": "bold green"}


class EventsPanel(LineTable):
    def show(self, state: AppState) -> None:
        key = (len(state.events), state.events[-1] if state.events else None)
        if key == getattr(self, "_shown", None):
            return
        self._shown = key
        rows = [(fmt_time(e.wall), Text(e.kind, KIND_STYLES.get(e.kind, "")), e.text) for e in reversed(state.events)]
        self.set_rows(("time", "event", "what"), rows)
