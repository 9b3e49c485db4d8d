"""Metrics per machine and GPU, outliers highlighted, a trend per row.

An outlier is a value more than two standard deviations above the mean of
all machines (Aegis §5.1); it is drawn in bold red and sorted first so a
thermal-throttled GPU on machine 1,733 is on the first screen.
"""

from __future__ import annotations

from rankscope.tui.state import AppState, Filter, MachineView, outliers, sparkline
from rankscope.tui.widgets.events import VimTable
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Static

ROWS_MAX = 500


def _pct(used: int | None, total: int | None) -> float | None:
    if used is None or not total:
        return None
    return 100.0 * used / total


def _fmt(v: float | None, spec: str = ".0f") -> str:
    return "-" if v is None else format(v, spec)


class MetricsPanel(Vertical):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._shown: tuple[object, ...] = ()

    def compose(self) -> ComposeResult:
        yield Static(id="metrics-title")
        yield VimTable(id="metrics-table")

    def show(self, state: AppState, flt: Filter) -> None:
        key = (state.machines, state.metric_history, flt)
        if key == self._shown:
            return
        self._shown = key
        machines = [m for m in state.machines if not flt.active or set(m.ranks) & flt.ranks]
        rows: list[tuple[str, MachineView, int | None]] = []  # key, machine, gpu index
        for m in machines:
            if m.gpus:
                rows.extend((f"{m.name}/gpu{g.index}", m, g.index) for g in m.gpus)
            else:
                rows.append((f"{m.name}/cpu", m, None))
        figures: dict[str, dict[str, float]] = {"cpu": {}, "mem": {}, "gpu": {}, "gmem": {}, "temp": {}, "power": {}}
        for key_, m, gi in rows:
            if m.host is not None:
                if m.host.cpu_percent is not None:
                    figures["cpu"][key_] = m.host.cpu_percent
                mem = _pct(m.host.mem_used_bytes, m.host.mem_total_bytes)
                if mem is not None:
                    figures["mem"][key_] = mem
            if gi is not None:
                g = next(x for x in m.gpus if x.index == gi)
                for name, val in (("gpu", g.util_percent), ("gmem", _pct(g.mem_used_bytes, g.mem_total_bytes)),
                                  ("temp", g.temperature_c), ("power", g.power_w)):
                    if val is not None:
                        figures[name][key_] = val
        flagged = {name: outliers(vals) for name, vals in figures.items()}
        any_flag = {k for s in flagged.values() for k in s}
        rows.sort(key=lambda r: (r[0] not in any_flag, m_order(r[1], state), r[2] or 0))
        table = self.query_one("#metrics-table", VimTable)
        table.clear(columns=True)
        table.add_columns("machine", "gpu", "cpu%", "mem%", "load", "gpu%", "gmem%", "°C", "W", "trend")

        def cell(name: str, key_: str, spec: str = ".0f") -> Text:
            v = figures[name].get(key_)
            return Text(_fmt(v, spec), "bold red" if key_ in flagged[name] else "")

        for key_, m, gi in rows[:ROWS_MAX]:
            label = Text(m.name, "" if m.reachable else "dim red")
            if not m.reachable:
                label.append(" lost")
            load = _fmt(m.host.load_1m if m.host else None, ".1f")
            trend = sparkline(state.metric_history.get(key_, ()), 10)
            table.add_row(label, "-" if gi is None else str(gi), cell("cpu", key_), cell("mem", key_), load,
                          cell("gpu", key_), cell("gmem", key_), cell("temp", key_), cell("power", key_), trend)
        title = Text(f"{len(machines)} machines, {sum(1 for r in rows if r[2] is not None)} GPUs")
        if any_flag:
            title.append(f"  {len(any_flag)} outlier rows (red, listed first)", "bold red")
        notes = {m.gpu_note for m in machines if m.gpu_note}
        if notes:
            title.append(f"  GPU: {'; '.join(sorted(notes))[:60]}", "dim")
        if len(rows) > ROWS_MAX:
            title.append(f"  showing {ROWS_MAX} of {len(rows)}; narrow with /", "yellow")
        self.query_one("#metrics-title", Static).update(title)


def m_order(m: MachineView, state: AppState) -> int:
    return m.ranks[0] if m.ranks else 1 << 30
