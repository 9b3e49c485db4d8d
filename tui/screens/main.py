"""The main screen: job header, the five views as tabs, the filter line, the footer."""

from __future__ import annotations

from rankscope.tui.analysis import StackView
from rankscope.tui.filter import filter_summary
from rankscope.tui.health import health
from rankscope.tui.staleness import failslow_target, map_groups, verdict_stale
from rankscope.tui.state import AppState
from rankscope.tui.widgets.audit import ActionsPanel
from rankscope.tui.widgets.ccl import CclPanel
from rankscope.tui.widgets.events import EventsPanel
from rankscope.tui.widgets.failslow import FailSlowPanel
from rankscope.tui.widgets.metrics import MetricsPanel
from rankscope.tui.widgets.rank_map import MapMachine, RankMapPanel, group_glyph
from rankscope.tui.widgets.stack_tree import StackTreePanel
from rankscope.tui.widgets.verdict import (
    JobHeader,
    VerdictPanel,
    failslow_verdict_text,
    header_text,
    legend_text,
    verdict_text_rich,
)
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Footer, Input, Static, TabbedContent, TabPane

VIEWS = ("overview", "stacks", "ccl", "metrics", "events", "actions", "failslow")
# What takes the keys in each view, so arrows and enter work right after switching.
FOCUS = {"overview": "#rank-map", "stacks": "#groups", "ccl": "#ccl-table", "metrics": "#metrics-table",
         "events": "#events-panel", "actions": "#audit-table", "failslow": "#failslow-panel"}


class MainScreen(Screen[None]):
    """Views draw the state the app hands them (its one store); only the visible one is redrawn on each update."""

    class Ready(Message):
        """The screen's widgets exist: only now can the state be drawn."""

    def compose(self) -> ComposeResult:
        yield JobHeader(id="job-header")
        with TabbedContent(initial="overview", id="views"):
            with TabPane("1 Overview", id="overview"), Vertical(id="overview-body"):
                yield VerdictPanel(id="verdict")
                yield RankMapPanel(id="rank-map")
                yield Static(id="legend")
            with TabPane("2 Stacks", id="stacks"):
                yield StackTreePanel(id="stack-panel")
            with TabPane("3 CCL", id="ccl"):
                yield CclPanel(id="ccl-panel")
            with TabPane("4 Metrics", id="metrics"):
                yield MetricsPanel(id="metrics-panel")
            with TabPane("5 Events", id="events"):
                yield EventsPanel(id="events-panel")
            with TabPane("6 Actions", id="actions"):
                yield ActionsPanel(id="actions-panel")
            with TabPane("7 Fail-slow", id="failslow"):
                yield FailSlowPanel(id="failslow-panel")
        yield Input(placeholder="filter: rank (12, 8-15), machine name or frame text; enter applies, esc closes",
                    id="filter-input")
        yield Footer(compact=True)

    def __init__(self) -> None:
        super().__init__()
        self.map_cursor: tuple[int, str | None] | None = None  # the rank (and machine) the map's cursor is on, above the legend
        self._shown_text: dict[str, Text] = {}
        self._state: AppState | None = None  # the last drawn, for the cursor note

    def _set(self, selector: str, text: Text) -> None:
        """Update a text panel only when its text changed: an update re-lays out the screen."""
        old = self._shown_text.get(selector)
        if old == text:
            return
        self._shown_text[selector] = text
        # The header has a fixed height and the verdict does not wrap: while their line count stays, the screen's
        # layout cannot change, and skipping the relayout keeps a 1 Hz header update cheap.
        fixed = selector in ("#job-header", "#verdict") and old is not None and \
            old.plain.count("\n") == text.plain.count("\n")
        self.query_one(selector, Static).update(text, layout=not fixed)

    def on_rank_map_panel_cursor_moved(self, event: RankMapPanel.CursorMoved) -> None:
        state = self._state
        self.map_cursor = None if event.rank is None else (event.rank, event.machine)
        self._draw_legend(state.stacks if state is not None else None)

    def _cursor_note(self, view: StackView | None) -> str:
        """The rank under the map's cursor, in the capture on screen: drawn afresh with every capture (it kept the
        group of the capture before)."""
        if self.map_cursor is None:
            return ""
        rank, machine = self.map_cursor
        state = self._state
        groups = map_groups(state) if state is not None else {}
        g = groups.get(rank)
        where = f"group {group_glyph(g)}: {view.groups[g].main_summary}" \
            if view is not None and g is not None and g < len(view.groups) else \
            ("not captured since the restart" if view is not None and not groups else "no stack")
        return f"▸ rank {rank} · {machine} · {where}"

    def _draw_legend(self, view: StackView | None) -> None:
        note = self._cursor_note(view)
        legend = legend_text(view, width=max(20, self.size.width - 2) if self.size.width else None)
        if note:
            legend = Text.assemble((note, "bold"), "\n", legend)
        self._set("#legend", legend)

    def on_mount(self) -> None:
        self.post_message(self.Ready())

    def focus_view(self) -> None:
        self.query_one(FOCUS[self.active_view]).focus()

    @property
    def active_view(self) -> str:
        return self.query_one("#views", TabbedContent).active or "overview"

    def draw(self, state: AppState) -> None:
        flt, read_only = state.filter, state.read_only
        self._state = state
        # The filter is shown in the header, not in a bar of its own: no relayout of the screen when it changes.
        verdict = state.failslow.verdict if state.failslow is not None else None
        slow = verdict.machine if verdict is not None and verdict.confident else None
        self._set("#job-header",
            header_text(state, state.source_label, read_only, filter_summary(flt), slow, self.size.width))
        view = self.active_view
        if view == "overview":
            room = 3 if self.size.height >= 40 else (2 if self.size.height >= 24 else 1)
            # Timing, not a fault: a capture taken while the job made steps (apply_capture decided it). A hang's
            # capture gone stale since keeps its suspects, dim, for reading.
            progressing = state.verdict is not None and state.verdict.running
            stale = verdict_stale(state)
            slow_target, _ = failslow_target(state) if stale is not None or progressing or state.stacks is None \
                else (None, None)
            if slow_target is not None and verdict is not None:
                # The job runs and the detectors name a slow machine: that is the verdict `e` acts on.
                self._set("#verdict", failslow_verdict_text(verdict.verdict.summary, slow_target,
                                                            state.machine_of_rank(), not read_only))
            else:
                self._set("#verdict", verdict_text_rich(state.stacks, flt, room, progressing, stale,
                                                        state.capture_wall, state.machine_of_rank(), not read_only))
            group_of = map_groups(state)
            machines = [MapMachine(m.name, m.ranks, m.reachable, m.evicted, state.awaiting_restart)
                        for m in state.machines]
            self.query_one("#rank-map", RankMapPanel).show(machines, group_of, flt)
            self._draw_legend(state.stacks)
        elif view == "stacks":
            self.query_one("#stack-panel", StackTreePanel).show(state.stacks, flt)
        elif view == "ccl":
            self.query_one("#ccl-panel", CclPanel).show(state, flt)
        elif view == "metrics":
            self.query_one("#metrics-panel", MetricsPanel).show(state, flt)
        elif view == "events":
            self.query_one("#events-panel", EventsPanel).show(state)
        elif view == "actions":
            self.query_one("#actions-panel", ActionsPanel).show(state, state.actions.log, read_only)
        elif view == "failslow":
            panel = self.query_one("#failslow-panel", FailSlowPanel)
            h = health(state)
            panel.show(state.failslow, self.size.width, self.size.height,
                       frozenset(m.name for m in state.machines if m.evicted), h.text if h.kind == "hung" else None)
