"""A read-only table that draws only the rows on screen.

Textual's DataTable builds per-row structures for every row it holds, which
costs seconds at 16,384 ranks or 2,048 machines x 8 GPUs each second. The
views here only ever show one screen of rows, so this table keeps the rows
as plain tuples and renders a line when it is asked for (``render_line``),
caching the strips of rows it has drawn until the rows change. No rows are
dropped: all of them can be scrolled to.

Keys: arrows or j/k, page up/down, g/G or home/end; enter selects.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from rich.cells import cell_len
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.binding import Binding, BindingType
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

Cell = str | Text
WIDTH_SAMPLE = 100  # column widths from the header and the first rows: enough to size, cheap at any size

HEADER = Style(bold=True, underline=True)
CURSOR = Style(reverse=True)


def _identity(row: Any) -> tuple[Cell, ...]:
    return tuple(row)


class LineTable(ScrollView, can_focus=True):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "move(-1)", "Up", show=False),
        Binding("down,j", "move(1)", "Down", show=False),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home,g", "edge(-1)", "Top", show=False),
        Binding("end,G", "edge(1)", "Bottom", show=False),
        Binding("enter", "select", "Open", show=False),
    ]

    class RowHighlighted(Message):
        def __init__(self, table: LineTable, index: int) -> None:
            super().__init__()
            self.table = table
            self.index = index

        @property
        def control(self) -> LineTable:
            return self.table

    class RowSelected(Message):
        def __init__(self, table: LineTable, index: int) -> None:
            super().__init__()
            self.table = table
            self.index = index

        @property
        def control(self) -> LineTable:
            return self.table

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.columns: tuple[str, ...] = ()
        self.rows: Sequence[Any] = []
        self._make_cells: Callable[[Any], tuple[Cell, ...]] = _identity
        self.widths: list[int] = []
        self._natural: list[int] = []  # each column's widest cell of the sample
        self._shrink: int | None = None
        self.cursor_row = 0
        self._cache: dict[tuple[int, bool], Strip] = {}

    # -- data -------------------------------------------------------------

    def set_rows(self, columns: Sequence[str], rows: Sequence[Any], *, cursor: int | None = None,
                 render: Callable[[Any], tuple[Cell, ...]] | None = None, shrink: int | None = None) -> None:
        """Replace the rows; the cursor stays on the same index unless told otherwise.

        With ``render``, ``rows`` are records and their cells are made only
        when a row comes on screen (a 16k-row table costs one screen of cells).
        ``shrink``: the column that gives up width (its cells end in "…") when
        the columns are wider than the table, so the columns after it stay on
        screen (a long communicator name pushed the CCL view's "open" off an
        80-column screen).
        """
        self._shrink = shrink
        self.columns = tuple(columns)
        self.rows = rows
        self._make_cells = render or _identity
        widths = [cell_len(c) for c in self.columns]
        for record in self.rows[:WIDTH_SAMPLE]:
            for i, cell in enumerate(self._make_cells(record)):
                n = cell.cell_len if isinstance(cell, Text) else cell_len(cell)
                if n > widths[i]:
                    widths[i] = n
        self._natural = widths
        self.widths = self._fitted()
        if cursor is not None:
            self.cursor_row = cursor
        self.cursor_row = max(0, min(self.cursor_row, len(self.rows) - 1))
        self._cache.clear()
        self.virtual_size = Size(sum(self.widths) + 2 * len(self.widths), len(self.rows) + 1)
        self.refresh()

    def _fitted(self) -> list[int]:
        """The natural widths, the ``shrink`` column narrowed (not below its header) to fit the table's width."""
        widths = list(self._natural)
        room = self.size.width
        i = self._shrink
        if i is None or not room or i >= len(widths):
            return widths
        over = sum(widths) + 2 * len(widths) - room
        if over > 0:
            widths[i] = max(cell_len(self.columns[i]), widths[i] - over)
        return widths

    # -- cursor -----------------------------------------------------------

    def _move_to(self, index: int) -> None:
        if not self.rows:
            return
        index = max(0, min(len(self.rows) - 1, index))
        if index == self.cursor_row:
            return
        self.cursor_row = index
        body = max(1, self.size.height - 1)
        top = self.scroll_offset.y
        if index < top:
            self.scroll_to(y=index, animate=False)
        elif index >= top + body:
            self.scroll_to(y=index - body + 1, animate=False)
        self.refresh()
        self.post_message(self.RowHighlighted(self, index))

    def action_move(self, delta: int) -> None:
        self._move_to(self.cursor_row + delta)

    def action_page(self, direction: int) -> None:
        self._move_to(self.cursor_row + direction * max(1, self.size.height - 2))

    def action_edge(self, direction: int) -> None:
        self._move_to(0 if direction < 0 else len(self.rows) - 1)

    def action_select(self) -> None:
        if self.rows:
            self.post_message(self.RowSelected(self, self.cursor_row))

    # -- drawing ----------------------------------------------------------

    def _line(self, cells: Sequence[Cell], base: Style, extra: Style | None) -> Strip:
        segs: list[Segment] = []
        for i, cell in enumerate(cells):
            width = self.widths[i] if i < len(self.widths) else 0
            segs.append(Segment(" ", base))
            if isinstance(cell, Text):
                text = cell.copy()
                text.truncate(width, overflow="ellipsis", pad=True)
                segs.extend(Segment(s.text, base + s.style if s.style else base) for s in text.render(self.app.console))
            else:
                segs.append(Segment(cell[:width].ljust(width), base))
            segs.append(Segment(" ", base))
        strip = Strip(segs)
        if extra is not None:
            strip = strip.apply_style(extra)
        return strip

    def render_line(self, y: int) -> Strip:
        scroll_x, scroll_y = self.scroll_offset
        width = self.size.width
        base = self.rich_style
        if y == 0:
            strip = self._line(self.columns, base + HEADER, None)
        else:
            index = scroll_y + y - 1
            if index >= len(self.rows):
                return Strip.blank(width, base)
            selected = index == self.cursor_row and self.has_focus
            key = (index, selected)
            cached = self._cache.get(key)
            if cached is None:
                cached = self._line(self._make_cells(self.rows[index]), base, CURSOR if selected else None)
                self._cache[key] = cached
            strip = cached
        return strip.crop(scroll_x, scroll_x + width).extend_cell_length(width, base)

    def on_focus(self) -> None:
        self._cache.clear()
        self.refresh()

    def on_blur(self) -> None:
        self._cache.clear()
        self.refresh()

    def on_resize(self) -> None:
        self._cache.clear()
        if self._shrink is not None:
            self.widths = self._fitted()
            self.virtual_size = Size(sum(self.widths) + 2 * len(self.widths), len(self.rows) + 1)
