"""The pairing command in full: what a second person runs to watch this job read-only (key P).

In Events it was cut at the panel's width, and printed whole only after quitting.
"""

from __future__ import annotations

from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static


def pair_hint(command: str) -> str:
    """The line that offers the pairing command (the drill prints it; the view logs it as its first event)."""
    return f"pair (read-only, e.g. in a second tmux pane): {command}"


class PairScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape,P,q", "app.pop_screen", "Close")]

    def __init__(self, command: str | None) -> None:
        super().__init__()
        self.command = command

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-box"):
            yield Static(Text("Pair: a second, read-only view of this job", "bold"))
            if self.command:
                yield Static(Text("Run this in another terminal or tmux pane (copied to the clipboard, OSC 52):"))
                yield Static(Text(self.command, "bold cyan"), id="pair-command")
                yield Static(Text("It attaches with --read-only: it sees the job, the verdicts and every action "
                                  "live, and changes nothing.", "dim"))
            else:
                yield Static(Text("This view was not started with a pairing command (the drill writes one); attach "
                                  "the same agents with rankscope attach ... --read-only.", "yellow"))
            yield Static(Text("esc closes", "dim"))
