"""`?`: every key, grouped by what it is for."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("views", (("1-7", "overview, stacks, CCL, metrics, events, actions (the agents' audit log, update history, "
                      "standby sizing), fail-slow (step-time heat map and flags)"),
               ("tab", "next panel"),
               ("enter", "open: a rank on the map, a group, a communicator"),
               ("esc", "back; clears the filter on the main screen"))),
    ("move", (("arrows, h j k l", "move"), ("pgup / pgdn", "page"), ("g / G", "top / bottom of a table"))),
    ("find", (("/", "filter by rank (12, 8-15), machine name or frame text"),
              ("o", "CCL: change the sort"), ("n / p", "rank view: next / previous rank of the group"))),
    ("act", (("s", "capture stacks now"), ("y", "copy the selected stack or the verdict (OSC 52)"),
             ("w", "write what was seen to a bundle file"), ("P", "the read-only pairing command, in full"),
             ("ctrl+p", "command palette"), ("q", "quit"))),
)
# Listed only when the session may act: under --read-only these keys do not exist.
ACTION_KEYS_HELP: tuple[tuple[str, str], ...] = (
    ("e", "evict what the evidence names (ctrl+o in the plan: the whole group), then type the phrase"),
    ("u", "hot-update (git ref or prepared directory; immediate or lazy) or roll back"),
    ("b", "checkpoint backup to peers outside each rank's groups"),
)


def help_table(read_only: bool) -> Table:
    table = Table(box=None, show_header=False, padding=(0, 2))
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    sections = KEYS if read_only else (*KEYS, ("change the job", ACTION_KEYS_HELP))
    for section, rows in sections:
        table.add_row(Text(section.upper(), "bold"), "")
        for key, what in rows:
            table.add_row(key, what)
    if read_only:
        table.add_row("", Text("read-only: no keys change the job (view 6 shows what the acting view does, live)",
                               "yellow"))
    return table


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,question_mark,q", "app.pop_screen", "Close"),
    ]

    def __init__(self, read_only: bool = False) -> None:
        super().__init__()
        self.read_only = read_only

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(Text("rankscope keys", "bold"))
            yield Static(help_table(self.read_only))
