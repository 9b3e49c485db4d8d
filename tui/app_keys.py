"""The app's keys (``KEY_BINDINGS``, and the action keys bound only when the session may act) and the actions they
call; the command palette offers the same actions."""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rankscope.contract.bundle import Bundle, write_bundle
from rankscope.contract.ranks import compact_ranks
from rankscope.tui import state as st
from rankscope.tui.analysis import rank_stack_lines, verdict_text
from rankscope.tui.app_part import AppPart
from rankscope.tui.screens.help import HelpScreen
from rankscope.tui.screens.main import VIEWS, MainScreen
from rankscope.tui.screens.rank import RankScreen
from rankscope.tui.widgets.ccl import CclPanel
from rankscope.tui.widgets.rank_map import RankMapPanel, group_glyph
from rankscope.tui.widgets.stack_tree import StackTreePanel
from textual import work
from textual.app import SystemCommand
from textual.binding import Binding, BindingType
from textual.screen import Screen
from textual.widgets import Input, TabbedContent

# e, u and b (evict, hot-update, checkpoint backup) are bound per app (``ACTION_KEYS``), and only when the session
# is not read-only: under --read-only they do not exist at all (nvitop's --readonly).
KEY_BINDINGS: list[BindingType] = [
    Binding("1", "view('overview')", "Overview", show=False, id="view.overview"),
    Binding("2", "view('stacks')", "Stacks", show=False, id="view.stacks"),
    Binding("3", "view('ccl')", "CCL", show=False, id="view.ccl"),
    Binding("4", "view('metrics')", "Metrics", show=False, id="view.metrics"),
    Binding("5", "view('events')", "Events", show=False, id="view.events"),
    Binding("6", "view('actions')", "Actions", show=False, id="view.actions"),
    Binding("7", "view('failslow')", "Fail-slow", show=False, id="view.failslow"),
    Binding("s", "capture", "Capture", id="capture", tooltip="capture every rank's stack now"),
    Binding("slash", "filter", "Filter", id="filter", tooltip="filter by rank, machine or frame text"),
    # y and w are listed by ? (and the palette), not in the footer: at 80 columns it must keep e, u and b.
    Binding("y", "copy", "Copy", show=False, id="copy", tooltip="copy the selected stack or the verdict"),
    Binding("w", "write_bundle", "Write", show=False, id="write", tooltip="write what was seen to a bundle"),
    Binding("question_mark", "help", "Help", id="help"),
    Binding("P", "pair", "Pair", show=False, id="pair", tooltip="the read-only pairing command, in full"),
    Binding("escape", "go_back", "Back", show=False),
    Binding("q", "quit", "Quit", id="quit"),
]

# Only bound when the session may act (see RankscopeApp.__init__).
ACTION_KEYS: tuple[tuple[str, str, str], ...] = (("e", "evict", "Evict"), ("u", "update", "Update"),
                                                 ("b", "backup", "Backup"))


class KeysPart(AppPart):
    def action_view(self, view: str) -> None:
        if view in VIEWS:
            self.main.query_one("#views", TabbedContent).active = view
            self.redraw()
            self.main.focus_view()

    def action_evict(self) -> None:
        self.actions.evict(self.selected_rank())

    def action_update(self) -> None:
        self.actions.update()

    def action_backup(self) -> None:
        self.actions.backup()

    def selected_rank(self) -> int | None:
        """The rank the person points at (map cursor, stack group), so `e` can aim at that suspect."""
        main = self.main
        if main.active_view == "overview":
            return main.query_one("#rank-map", RankMapPanel).cursor_rank
        if main.active_view == "stacks":
            group = main.query_one("#stack-panel", StackTreePanel).selected
            return group.ranks[0] if group is not None and group.ranks else None
        return None

    def action_filter(self) -> None:
        box = self.main.query_one("#filter-input", Input)
        box.display = True
        box.value = self.state.filter.text
        # Focus now, not at the next idle: keys typed right after `/` (a paste, tmux send-keys) belong to the box.
        self.main.set_focus(box)

    def set_filter(self, text: str) -> None:
        self.state = st.apply_filter(self.state, text)
        self.redraw()

    def action_go_back(self) -> None:
        box = self.main.query_one("#filter-input", Input)
        if box.display:
            box.display = False
            self.main.focus_view()
            return
        if self.main.active_view == "ccl" and self.main.query_one("#ccl-panel", CclPanel).back():
            return
        if self.state.filter.active:
            self.set_filter("")

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.options.read_only))

    def action_pair(self) -> None:
        """The pairing command in full, one key away (and on the clipboard)."""
        from rankscope.tui.screens.pair import PairScreen

        command = self.options.pair_command
        if command:
            self.copy_to_clipboard(command)
        self.push_screen(PairScreen(command))

    def action_copy(self) -> None:
        text = self.selection_text()
        self.copy_to_clipboard(text)
        self.last_copied = text
        self.notify(f"copied {len(text.splitlines())} lines (OSC 52)", timeout=2)

    def selection_text(self) -> str:
        """What `y` copies: the rank on screen, else the selected stack group, else the verdict."""
        screen = self.screen
        if isinstance(screen, RankScreen):
            return screen.text
        if isinstance(screen, MainScreen) and screen.active_view == "stacks":
            group = screen.query_one("#stack-panel", StackTreePanel).selected
            stacks = self._capture_snapshot_stacks()
            if group is not None and group.ranks:
                rs = stacks.get(group.ranks[0])
                head = (f"group {group_glyph(group.index)}: {len(group.ranks)} ranks "
                        f"({compact_ranks(group.ranks, 20)})")
                body = rank_stack_lines(rs, with_source=False) if rs is not None else list(group.frames)
                return "\n".join([head, *body])
        return verdict_text(self.state.stacks)

    def _capture_snapshot_stacks(self) -> dict[int, Any]:
        for snap in reversed(self.state.kept):
            stacks = snap.all_stacks()
            if stacks:
                return stacks
        return {}

    def action_write_bundle(self) -> None:
        if not self.state.kept:
            self.notify("nothing received yet to write", severity="warning")
            return
        stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(self.state.now_wall or self.clock()))
        path = self.options.bundle_dir / f"rankscope-{stamp}.json"
        bundle = Bundle(snapshots=self.state.kept, created_wall=self.clock(),
                        meta={"written_by": "rankscope attach", "source": self.source.label})
        self._write(bundle, path)

    @work(group="write", thread=True)
    def _write(self, bundle: Bundle, path: Path) -> None:
        try:
            written = write_bundle(bundle, path)
        except OSError as exc:
            self.call_from_thread(self.notify, f"could not write {path}: {exc}", severity="error")
            return
        self.last_written = written
        self.call_from_thread(self.notify, f"wrote {len(bundle.snapshots)} snapshots to {written}")

    def open_rank(self, rank: int) -> None:
        view = self.state.stacks
        stacks = self._capture_snapshot_stacks()
        where = self.state.machine_of_rank()
        group_ranks: tuple[int, ...] = (rank,)
        lookup: dict[int, tuple[str, str, Any]] = {}
        if view is not None and rank in view.group_of_rank:
            g = view.groups[view.group_of_rank[rank]]
            group_ranks = g.ranks
        for r in group_ranks:
            gi = view.group_of_rank.get(r) if view is not None else None
            label = f"group {group_glyph(gi)}" if gi is not None else "no stack group"
            lookup[r] = (where.get(r, "?"), label, stacks.get(r))
        self.push_screen(RankScreen(rank, group_ranks, lookup))

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Capture stacks now", "py-spy every rank through the agents (s)", self.action_capture)
        yield SystemCommand("Copy verdict or stack", "OSC 52 clipboard (y)", self.action_copy)
        yield SystemCommand("Write bundle", "save what was seen to a JSON bundle (w)", self.action_write_bundle)
        yield SystemCommand("Filter", "by rank, machine or frame text (/)", self.action_filter)
        yield SystemCommand("Keys", "all keys (?)", self.action_help)
        if not self.options.read_only:
            yield SystemCommand("Evict suspect group", "plan, confirm by typing, evict (e)", self.action_evict)
            yield SystemCommand("Hot-update / rollback", "version and mode, plan, confirm (u)", self.action_update)
            yield SystemCommand("Checkpoint backup", "plan the backup peers, confirm (b)", self.action_backup)
        for view in VIEWS:
            yield SystemCommand(f"Show {view}", f"switch to the {view} view", lambda v=view: self.action_view(v))
