"""The events timeline: captures, verdict changes, agents lost and found."""

from __future__ import annotations

from typing import ClassVar

from rankscope.tui.state import AppState, fmt_time
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.widgets import DataTable

KIND_STYLES = {"lost": "bold red", "found": "bold green", "verdict": "bold yellow", "capture": "cyan",
               "capture-failed": "red", "poll-failed": "red", "hung": "bold red", "resumed": "green", "info": "dim"}


class VimTable(DataTable[Text | str]):
    """A row-cursor table that also answers to j/k/g/G."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("j", "cursor_down", "Down", show=False),
        Binding("k", "cursor_up", "Up", show=False),
        Binding("g", "scroll_top", "Top", show=False),
        Binding("G", "scroll_bottom", "Bottom", show=False),
    ]

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id, cursor_type="row", zebra_stripes=False)


class EventsPanel(VimTable):
    """Newest first."""

    def on_mount(self) -> None:
        self.add_columns("time", "event", "what")
        self._shown: tuple[int, object] = (-1, None)

    def show(self, state: AppState) -> None:
        key = (len(state.events), state.events[-1] if state.events else None)
        if key == self._shown:
            return
        self._shown = key
        self.clear()
        for e in reversed(state.events):
            self.add_row(fmt_time(e.wall), Text(e.kind, KIND_STYLES.get(e.kind, "")), e.text)
