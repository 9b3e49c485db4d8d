"""Metrics per machine and GPU, outliers highlighted, a trend per row.

An outlier is a value beyond λ±2δ of its peers, on the side its metric
says is suspect (Aegis §5.1, ``analyzers.metric_outliers.snapshot_outliers``:
the detector's rule, so a GPU flagged here is the one fail-slow would name,
and it fires with four machines); it is drawn in bold red and sorted first so a
thermal-throttled GPU on machine 1,733 is on the first screen.
"""

from __future__ import annotations

from collections.abc import Sequence

from rankscope.tui.digest import METRICS, MetricRow
from rankscope.tui.filter import Filter
from rankscope.tui.series import Series
from rankscope.tui.state import AppState
from rankscope.tui.widgets.sparkline import sparkline
from rankscope.tui.widgets.table import Cell, LineTable
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static


def _fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


SPECS = (".0f", ".0f", ".1f", ".0f", ".0f", ".0f", ".0f")


def column_medians(rows: Sequence[MetricRow]) -> tuple[float | None, ...]:
    """Each column's median over the rows of the job (evicted ones are not peers): what an outlier is beside."""
    out: list[float | None] = []
    for j in range(len(METRICS)):
        vals = sorted(v for r in rows if not r.evicted and (v := r.values[j]) is not None)
        out.append(vals[len(vals) // 2] if vals else None)
    return tuple(out)


def direction(v: float | None, median: float | None) -> str:
    """``▲`` above its peers' median, ``▼`` below: an outlier told by text, not by colour alone."""
    if v is None or median is None or v == median:
        return "≠"
    return "▲" if v > median else "▼"


def render_row(row: MetricRow, history: Series,
               medians: tuple[float | None, ...] = ()) -> tuple[Cell, ...]:
    label: Cell = Text(row.machine + " evicted", "dim yellow") if row.evicted else \
        row.machine if row.reachable else Text(row.machine + " lost", "dim red")
    cells: list[Cell] = [label, "-" if row.gpu is None else str(row.gpu)]
    for j, (name, v, spec) in enumerate(zip(METRICS, row.values, SPECS, strict=True)):
        text = _fmt(v, spec)
        if name in row.outliers:
            arrow = direction(v, medians[j] if j < len(medians) else None)
            cells.append(Text(f"{text}{arrow}", "bold red"))
        else:
            cells.append(text)
    cells.append(sparkline(history.get(row.key), 10))
    return tuple(cells)


class MetricsPanel(Vertical):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._shown: tuple[object, ...] = ()

    def compose(self) -> ComposeResult:
        yield Static(id="metrics-title")
        yield LineTable(id="metrics-table")

    def show(self, state: AppState, flt: Filter) -> None:
        key = (state.metric_rows, state.metric_history, flt)
        if all(a is b for a, b in zip(key, self._shown, strict=False)) and self._shown:
            return
        self._shown = key
        rows = state.metric_rows
        if flt.active:
            rows = tuple(r for r in rows if not flt.ranks.isdisjoint(r.ranks))
        history = state.metric_history
        medians = column_medians(rows)
        self.query_one("#metrics-table", LineTable).set_rows(
            ("machine", "gpu", "cpu%", "mem%", "load", "gpu%", "gmem%", "°C", "W", "trend"), rows,
            render=lambda r: render_row(r, history, medians))
        machines = {r.machine for r in rows if not r.evicted}
        evicted = {r.machine for r in rows if r.evicted}
        flagged = sum(1 for r in rows if r.outliers)
        title = Text(f"{len(machines)} machines, {sum(1 for r in rows if r.gpu is not None and not r.evicted)} GPUs")
        if evicted:
            title.append(f" ({len(evicted)} evicted)", "yellow")
        if flagged:
            # Told in words too (a monochrome terminal, a colour-blind reader): which value, which way, beside what.
            why: list[str] = []
            for r in rows:
                for j, name in enumerate(METRICS):
                    if name in r.outliers and len(why) < 3:
                        arrow = direction(r.values[j], medians[j])
                        word = {"▲": "high", "▼": "low"}.get(arrow, "unlike")
                        why.append(f"{r.machine}{'' if r.gpu is None else f' gpu{r.gpu}'} {name} {word}: "
                                   f"{_fmt(r.values[j], SPECS[j])} vs median {_fmt(medians[j], SPECS[j])}")
            title.append(f"  {flagged} outlier{'s' if flagged != 1 else ''}: {'; '.join(why)} (▲ above / ▼ below "
                         "the others, listed first)", "bold red")
        notes = {m.gpu_note for m in state.machines if m.gpu_note and m.name in machines}
        if notes:
            title.append(f"\nGPU: {'; '.join(sorted(notes))[:300]}", "dim")
        self.query_one("#metrics-title", Static).update(title)
