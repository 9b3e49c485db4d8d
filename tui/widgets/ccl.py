"""CCL counters: per communicator, then per rank (Aegis CL / WR / WC).

The list shows one row per communicator with its description, the spread of
launches and the open requests, and a sparkline of completions per poll; a
communicator whose ranks disagree is marked and sorted first. `enter` opens
one communicator's ranks (CL/WR/WC each, the laggards highlighted), `esc`
goes back. `o` changes the sort.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from rankscope.contract.ranks import compact_ranks
from rankscope.tui.digest import CommView
from rankscope.tui.filter import Filter
from rankscope.tui.state import AppState
from rankscope.tui.widgets.sparkline import deltas, sparkline
from rankscope.tui.widgets.table import Cell, LineTable
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.widgets import Static

SORTS = ("mismatch", "comm", "size", "progress")


def sort_comms(comms: list[CommView], key: str) -> list[CommView]:
    if key == "comm":
        return sorted(comms, key=lambda c: c.comm_id)
    if key == "size":
        return sorted(comms, key=lambda c: (-len(c.ranks), c.comm_id))
    if key == "progress":
        return sorted(comms, key=lambda c: (c.progress, c.comm_id))
    return sorted(comms, key=lambda c: (not c.mismatch, c.comm_id))


class CclPanel(Vertical):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("o", "cycle_sort", "Sort"),
    ]

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.sort_key = "mismatch"
        self.opened: str | None = None  # comm_id shown rank by rank
        self._rows: list[CommView] = []
        self._state: AppState | None = None
        self._filter: Filter | None = None
        self._shown: tuple[object, ...] = ()

    def compose(self) -> ComposeResult:
        yield Static(id="ccl-title")
        yield LineTable(id="ccl-table")

    def show(self, state: AppState, flt: Filter, force: bool = False) -> None:
        key = (state.comms, state.comm_history, flt, self.sort_key, self.opened)
        # By identity: a new poll is a new tuple; comparing 2,048 communicators by value costs more than a redraw.
        if not force and len(key) == len(self._shown) and all(a is b for a, b in zip(key, self._shown, strict=True)):
            return
        self._shown = key
        self._state = state
        self._filter = flt if flt.active else None
        if self.opened is not None:
            comm = next((c for c in state.comms if c.comm_id == self.opened), None)
            if comm is not None:
                self._show_comm(comm, state.machine_of_rank())
                return
            self.opened = None
        self._show_list(state)

    def _show_list(self, state: AppState) -> None:
        table = self.query_one("#ccl-table", LineTable)
        title = self.query_one("#ccl-title", Static)
        comms = [c for c in state.comms if self._filter is None or not self._filter.ranks.isdisjoint(c.ranks)]
        comms = sort_comms(comms, self.sort_key)
        self._rows = comms
        bad = sum(1 for c in comms if c.mismatch)
        head = Text(f"{len(comms)} communicators, ")
        head.append(f"{bad} with mismatches", "bold red" if bad else "green")
        head.append(f"  sort: {self.sort_key} (o)  enter: ranks  progress: completions per poll (▁ flat: none)",
                    "dim")
        if not state.comms:
            head = Text("no CCL counters: is the job started with `rankscope run` (CCL plugin)?", "dim")
        title.update(head)
        def render(c: CommView) -> tuple[Cell, ...]:
            flag0: Cell = Text("!", "bold red") if c.mismatch else " "
            name0 = Text(c.comm_id + (f" {c.description}" if c.description else ""), "bold" if c.mismatch else "")
            if not c.rows:  # recorded, but no rank of it reports counters (yet): no numbers to show, say so
                return (flag0, name0, str(len(c.ranks)), "-", "-", "-", "-", Text("none reporting", "dim"))
            cls = [r.cl for r in c.rows]
            wr = sum(r.wr for r in c.rows)
            wc = sum(r.wc for r in c.rows)
            flag: Cell = Text("!", "bold red") if c.mismatch else " "
            name = Text(c.comm_id + (f" {c.description}" if c.description else ""), "bold" if c.mismatch else "")
            hist = deltas(state.comm_history.get(c.comm_id))
            cl_text: Cell = Text(f"{min(cls)}-{max(cls)}", "bold red") if min(cls) != max(cls) else f"{min(cls)}-{max(cls)}"
            open_text: Cell = Text(str(wr - wc), "bold red") if wr > wc else str(wr - wc)
            missing = f" ({len(c.missing)} silent)" if c.missing else ""
            return (flag, name, f"{len(c.ranks)}{missing}", cl_text, str(wr), str(wc), open_text, sparkline(hist, 10))

        table.set_rows(("", "communicator", "size", "CL min-max", "WR", "WC", "open", "progress"), self._rows,
                       render=render, shrink=1)

    def _show_comm(self, comm: CommView, where: Mapping[int, str]) -> None:
        table = self.query_one("#ccl-table", LineTable)
        title = self.query_one("#ccl-title", Static)
        rows: list[tuple[Cell, ...]] = []
        head = Text(f"{comm.comm_id} {comm.description} [{comm.backend}] ranks {compact_ranks(comm.ranks, 4)}", "bold")
        head.append("  esc: back", "dim")
        if comm.missing:
            head.append(f"  no counters from {compact_ranks(comm.missing, 4)}", "yellow")
        title.update(head)
        for r in comm.rows:
            if self._filter is not None and r.rank not in self._filter.ranks:
                continue
            notes = []
            if r.lags:
                notes.append("CL lags")
            if r.open_requests:
                notes.append(f"{r.wr - r.wc} open")
            if r.stale:
                notes.append("stale")
            style = "bold red" if (r.lags or r.open_requests) else ""
            rows.append((Text(str(r.rank), style), where.get(r.rank, "?"), Text(str(r.cl), "bold red" if r.lags else ""),
                         str(r.wr), Text(str(r.wc), "bold red" if r.open_requests else ""),
                         Text(", ".join(notes) or "ok", style or "green")))
        table.set_rows(("rank", "machine", "CL", "WR", "WC", "state"), rows, cursor=0)

    def on_line_table_row_selected(self, event: LineTable.RowSelected) -> None:
        event.stop()
        if self.opened is None and 0 <= event.index < len(self._rows) and self._state is not None:
            self.opened = self._rows[event.index].comm_id
            self.show(self._state, self._filter or Filter("", frozenset()), force=True)

    def back(self) -> bool:
        """Close an opened communicator; False when there was none (esc goes further up)."""
        if self.opened is None or self._state is None:
            return False
        self.opened = None
        self.show(self._state, self._filter or Filter("", frozenset()), force=True)
        return True

    def action_cycle_sort(self) -> None:
        self.sort_key = SORTS[(SORTS.index(self.sort_key) + 1) % len(SORTS)]
        if self._state is not None:
            self.show(self._state, self._filter or Filter("", frozenset()), force=True)
