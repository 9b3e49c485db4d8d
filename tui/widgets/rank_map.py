"""The rank map: every rank as one cell, machines as rows, coloured by stack group.

Drawn line by line (``render_line``) so only the visible rows cost anything:
16,384 ranks over 2,048 machines scroll as cheaply as 16. When the machines
do not fit one per row, several are packed side by side in each row.

Each group has a letter as well as a colour (A is the dominant group), so the
map reads the same in a 16-colour terminal, over tmux, or in `capture-pane`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

from rankscope.tui.filter import Filter
from rich.segment import Segment
from rich.style import Style
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

GROUP_COLOURS = ("green", "red", "yellow", "magenta", "cyan", "blue", "bright_red", "bright_yellow")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


def group_glyph(index: int) -> str:
    return LETTERS[index] if index < len(LETTERS) else "+"


def group_style(index: int) -> Style:
    return Style(color=GROUP_COLOURS[min(index, len(GROUP_COLOURS) - 1)], bold=index > 0)


MISSING = Style(color="white", dim=True)
LOST = Style(color="red", dim=True)
EVICTED = Style(color="yellow", dim=True, strike=True)
FILTERED_OUT = Style(color="bright_black")


@dataclass(frozen=True, slots=True)
class MapMachine:
    name: str
    ranks: tuple[int, ...]
    reachable: bool
    evicted: bool = False  # taken out of the job: listed (struck through) so the pair sees where it went
    restarting: bool = False  # its agent is away because the job restarts (an eviction, a hot-update): not lost


LABEL_MAX = 21  # the longest IPv4 address and port (255.255.255.255:65535): an agent's address is never cut


def fit_label(name: str, width: int) -> str:
    """A machine name in ``width`` cells; a longer one ends in an ellipsis, never silently cut (a port 59999
    shown as 5999 is another agent)."""
    if len(name) <= width:
        return name.ljust(width)
    return name[: max(0, width - 1)] + "…"


class RankMapPanel(ScrollView, can_focus=True):
    """Cells per rank; arrows or h/j/k/l move a cursor, enter opens that rank's stack."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("left,h", "move(0,-1)", "Left", show=False),
        Binding("right,l", "move(0,1)", "Right", show=False),
        Binding("up,k", "move(-1,0)", "Up", show=False),
        Binding("down,j", "move(1,0)", "Down", show=False),
        Binding("pageup", "move(-10,0)", "Page up", show=False),
        Binding("pagedown", "move(10,0)", "Page down", show=False),
        Binding("enter", "open", "Open rank", show=False),
    ]

    class RankChosen(Message):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank

    class CursorMoved(Message):
        """The cursor is on another rank (or on none): the screen says which, and on which machine."""

        def __init__(self, rank: int | None, machine: str | None) -> None:
            super().__init__()
            self.rank = rank
            self.machine = machine

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.machines: tuple[MapMachine, ...] = ()
        self.group_of_rank: Mapping[int, int] = {}
        self.filter: Filter | None = None
        self.cursor = (0, 0)  # (row, cell column)
        self._rows: list[tuple[int, ...]] = []  # machine indexes per row
        self._label_w = 0
        self._slot = 1  # cells per machine block
        self._strips: dict[int, Strip] = {}  # rendered rows, until the data, cursor or size change
        self._announced: tuple[int | None, str | None] | None = None  # the last rank and machine said to be under it
        self._style_cache: dict[tuple[int, bool], Style] = {}
        self._style_base: Style | None = None

    # -- data -------------------------------------------------------------

    def show(self, machines: Sequence[MapMachine], group_of_rank: Mapping[int, int], flt: Filter) -> None:
        machines = tuple(machines)
        new_filter = flt if flt.active else None
        if machines == self.machines and group_of_rank is self.group_of_rank and new_filter == self.filter:
            return  # nothing on the map changed (the usual poll): keep the drawn rows
        self.machines = machines
        self.group_of_rank = group_of_rank
        self.filter = flt if flt.active else None
        self._relayout()
        self.refresh()
        if self._announced is not None and self._announced[0] is not None and self._under_cursor() != self._announced:
            # Another rank sits under the cursor now (a restart moved ranks, machines came or went): say which, or
            # the line below the map keeps naming the rank and machine the cursor was moved to before. Only once a
            # rank was named: the first data under a cursor nobody moved names nothing (the groups keep the lines).
            self._announce()

    def on_resize(self) -> None:
        self._relayout()

    def _relayout(self) -> None:
        self._strips.clear()
        width = max(10, self.size.width or 80)
        height = max(1, self.size.height or 10)
        self._label_w = min(LABEL_MAX, max((len(m.name) for m in self.machines), default=4))
        self._slot = max((len(m.ranks) for m in self.machines), default=1) or 1
        room = width - self._label_w - 1
        per_row = max(1, room // (self._slot + 1))
        n = len(self.machines)
        # One machine per row while they fit (easiest to read); else pack evenly, as few per row as fill the panel.
        per_row = 1 if n <= height else min(per_row, -(-n // height))
        self._rows = [tuple(range(i, min(n, i + per_row))) for i in range(0, n, per_row)]
        widest = self._label_w + 1 + per_row * (self._slot + 1)
        self.virtual_size = Size(widest, len(self._rows))
        row, col = self.cursor
        self.cursor = (min(row, max(0, len(self._rows) - 1)), col)

    # -- cursor -----------------------------------------------------------

    def rank_at(self, row: int, col: int) -> int | None:
        if not (0 <= row < len(self._rows)):
            return None
        j, k = divmod(col, self._slot)
        if j >= len(self._rows[row]):
            return None
        ranks = self.machines[self._rows[row][j]].ranks
        return ranks[k] if k < len(ranks) else None

    @property
    def cursor_rank(self) -> int | None:
        return self.rank_at(*self.cursor)

    def action_move(self, drow: int, dcol: int) -> None:
        if not self._rows:
            return
        row, col = self.cursor
        row = max(0, min(len(self._rows) - 1, row + drow))
        max_col = len(self._rows[row]) * self._slot - 1
        col = max(0, min(max_col, col + dcol))
        old_row = self.cursor[0]
        self.cursor = (row, col)
        self._strips.pop(old_row, None)
        self._strips.pop(row, None)
        self.scroll_to_region_row(row)
        self.refresh()
        self._announce()

    def _under_cursor(self) -> tuple[int | None, str | None]:
        row, col = self.cursor
        rank = self.rank_at(row, col)
        machine = None
        if rank is not None:
            machine = self.machines[self._rows[row][col // self._slot]].name
        return rank, machine

    def _announce(self) -> None:
        self._announced = self._under_cursor()
        self.post_message(self.CursorMoved(*self._announced))

    def scroll_to_region_row(self, row: int) -> None:
        top = self.scroll_offset.y
        height = self.size.height
        if row < top:
            self.scroll_to(y=row, animate=False)
        elif row >= top + height:
            self.scroll_to(y=row - height + 1, animate=False)

    def action_open(self) -> None:
        rank = self.cursor_rank
        if rank is not None:
            self.post_message(self.RankChosen(rank))

    # -- drawing ----------------------------------------------------------

    def _cell(self, rank: int, reachable: bool, restarting: bool = False) -> tuple[str, int]:
        """A rank's glyph and style slot (see ``_styles``)."""
        if self.filter is not None and rank not in self.filter.ranks:
            return "·", -3
        if not reachable:
            return ("↻", -1) if restarting else ("×", -2)
        g = self.group_of_rank.get(rank)
        if g is None:
            # No capture of the processes running now (the job restarted since): "○", not "?" (no stack), which
            # read as something missing on a healthy job.
            return ("○", -4) if not self.group_of_rank else ("?", -1)
        return group_glyph(g), min(g, len(GROUP_COLOURS) - 1)

    def _style(self, slot: int, base: Style, cursor: bool) -> Style:
        key = (slot, cursor)
        got = self._style_cache.get(key)
        if got is None:
            specials = {-4: Style(), -3: FILTERED_OUT, -2: LOST, -1: MISSING}
            st = specials[slot] if slot in specials else group_style(slot)
            got = base + st + (Style(reverse=True) if cursor else Style())
            self._style_cache[key] = got
        return got

    def _row_strip(self, row: int, base: Style) -> Strip:
        """One row of the map as runs of equal style (a few segments, not one per rank)."""
        members = self._rows[row]
        first = self.machines[members[0]]
        label = fit_label(first.name, self._label_w) + " "
        segs = [Segment(label, base + (EVICTED if first.evicted else Style(dim=True) if first.reachable else LOST))]
        cur_row, cur_col = self.cursor
        show_cursor = self.has_focus and row == cur_row
        run_text: list[str] = []
        run_key: tuple[int, bool] | None = None

        def flush() -> None:
            if run_key is not None and run_text:
                segs.append(Segment("".join(run_text), self._style(run_key[0], base, run_key[1])))

        for j, mi in enumerate(members):
            m = self.machines[mi]
            for k in range(self._slot + 1):
                if k < len(m.ranks):
                    ch, slot = self._cell(m.ranks[k], m.reachable, m.restarting)
                    key = (slot, show_cursor and j * self._slot + k == cur_col)
                else:
                    ch, key = " ", (-4, False)
                if key != run_key:
                    flush()
                    run_text, run_key = [], key
                run_text.append(ch)
        flush()
        return Strip(segs)

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        row = scroll_y + y
        width = self.size.width
        base = self.rich_style
        if row >= len(self._rows):
            return Strip.blank(width, base)
        if base != self._style_base:
            self._style_cache.clear()
            self._strips.clear()
            self._style_base = base
        strip = self._strips.get(row)
        if strip is None:
            strip = self._row_strip(row, base)
            self._strips[row] = strip
        return strip.crop(scroll_x, scroll_x + width).extend_cell_length(width, base)

    def on_focus(self) -> None:
        self._strips.clear()
        self.refresh()
        self._announce()

    def on_blur(self) -> None:
        self._strips.clear()
        self.refresh()
