"""One rank's full capture: every thread of its main process and its subprocesses."""

from __future__ import annotations

from typing import ClassVar

from rankscope.contract.snapshot import RankStacks
from rankscope.tui.analysis import StackLine, rank_stack_entries
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer, Static


def rank_text(rank: int, machine: str, group: str, stacks: RankStacks | None) -> Text:
    t = Text()
    t.append(f"rank {rank}", "bold")
    t.append(f"  on {machine}  {group}\n\n")
    if stacks is None:
        t.append("no stack captured for this rank (press s on the main screen to capture)", "yellow")
        return t
    for line, kind in rank_stack_entries(stacks):
        t.append(line + "\n", _STYLES.get(kind, ""))
    return t


_STYLES = {StackLine.PROCESS: "bold cyan", StackLine.THREAD: "bold", StackLine.PROBLEM: "yellow",
           StackLine.SOURCE: "dim"}


class RankScreen(Screen[None]):
    """`n`/`p` walk the ranks of the same group; `y` copies this stack; `esc` goes back."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape", "app.pop_screen", "Back"),
        Binding("n", "step(1)", "Next rank"),
        Binding("p", "step(-1)", "Prev rank"),
        Binding("j", "scroll(1)", "Down", show=False),
        Binding("k", "scroll(-1)", "Up", show=False),
    ]

    def __init__(self, rank: int, ranks: tuple[int, ...], lookup: dict[int, tuple[str, str, RankStacks | None]]) -> None:
        super().__init__()
        self.rank = rank
        self.ranks = ranks or (rank,)
        self.lookup = lookup

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="rank-scroll"):
            yield Static(id="rank-stack")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self._draw()

    def _draw(self) -> None:
        machine, group, stacks = self.lookup.get(self.rank, ("?", "", None))
        self.query_one("#rank-stack", Static).update(rank_text(self.rank, machine, group, stacks))

    @property
    def text(self) -> str:
        machine, group, stacks = self.lookup.get(self.rank, ("?", "", None))
        return rank_text(self.rank, machine, group, stacks).plain

    def action_step(self, delta: int) -> None:
        i = self.ranks.index(self.rank) if self.rank in self.ranks else 0
        self.rank = self.ranks[(i + delta) % len(self.ranks)]
        self._draw()

    def action_scroll(self, delta: int) -> None:
        scroll = self.query_one("#rank-scroll", VerticalScroll)
        scroll.scroll_to(y=scroll.scroll_offset.y + delta, animate=False)
