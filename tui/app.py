"""The rankscope TUI: attach to a job's agents (or open a bundle) and inspect it live.

How data flows (and why nothing here can freeze the screen):
- a poll worker (async) awaits ``Source.poll``, digests the snapshot in a
  thread, posts ``SnapshotReceived`` and only then schedules the next poll,
  so polls never overlap and a lost agent only delays the next one;
- captures (`s`, a stop in progress, or every 10 s in fail-slow mode) run
  in their own worker; the stack analysis runs in a thread;
- every message is folded into the one immutable ``AppState`` by the reducers
  of ``rankscope.tui.state``, and the visible view is redrawn from that state
  alone. The services (the fail-slow feeder, the action controller) keep only
  their working state and post messages; what the screens draw -- the filter,
  the fail-slow view, the audit log, what is being confirmed, whether a capture
  runs -- is in the state.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from rankscope.contract.bundle import Bundle, write_bundle
from rankscope.contract.heap import settle_in_this_process
from rankscope.contract.ranks import compact_ranks
from rankscope.tui import state as st
from rankscope.tui.actions import ActionController
from rankscope.tui.analysis import rank_stack_lines, verdict_text
from rankscope.tui.app_journal import JournalFollow, JournalPart
from rankscope.tui.app_options import AppOptions, AttachOptions
from rankscope.tui.app_toasts import ToastsPart
from rankscope.tui.app_workers import WorkersPart
from rankscope.tui.failslow_state import FailSlowFeeder
from rankscope.tui.screens.help import HelpScreen
from rankscope.tui.screens.main import VIEWS, MainScreen
from rankscope.tui.screens.rank import RankScreen
from rankscope.tui.sources import BundleSource, LiveSource, Source
from rankscope.tui.widgets.ccl import CclPanel
from rankscope.tui.widgets.rank_map import RankMapPanel, group_glyph
from rankscope.tui.widgets.stack_tree import StackTreePanel
from textual import on, work
from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.css.query import NoMatches
from textual.notifications import Notification
from textual.screen import Screen
from textual.widgets import Input, TabbedContent

__all__ = ["AppOptions", "AttachOptions", "RankscopeApp", "run_app", "run_attach", "run_bundle", "run_loaded"]

# Only bound when the session may act (see RankscopeApp.__init__).
ACTION_KEYS: tuple[tuple[str, str, str], ...] = (("e", "evict", "Evict"), ("u", "update", "Update"),
                                                 ("b", "backup", "Backup"))
SMALL_BUNDLE_BYTES = 4 << 20  # read before the UI opens; larger bundles are read by the app, in a thread


class RankscopeApp(WorkersPart, ToastsPart, JournalPart, App[int]):
    CSS_PATH = "rankscope.tcss"
    TITLE = "rankscope"
    # e, u and b (evict, hot-update, checkpoint backup) are bound per app in __init__, and only when the session
    # is not read-only: under --read-only they do not exist at all (nvitop's --readonly).
    BINDINGS: ClassVar[list[BindingType]] = [
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

    def __init__(self, source: Source, options: AppOptions | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        super().__init__()
        self.source = source
        self.options = options or AppOptions()
        self.clock = clock
        # The one store: everything the screens draw; changed only by the reducers of rankscope.tui.state.
        self.state = st.AppState(layout=self.options.layout, source_label=source.label,
                                 read_only=self.options.read_only, hang_after_s=self.options.hang_after_s)
        self.last_copied: str | None = None
        self.last_written: Path | None = None
        self.loaded = asyncio.Event()  # set once the initial snapshots are on screen
        self.actions = ActionController(self)  # the action keys and the agents' audit streams (posts messages)
        if not self.options.read_only:
            for key, action, description in ACTION_KEYS:
                self.bind(key, action, description=description)
        # Fail-slow detectors, fed every snapshot off the UI thread (view 7); their views come as messages.
        self.failslow = FailSlowFeeder(self, self.options.failslow_config)
        self._held_toasts: list[Notification] = []  # raised while a dialog was open (``_on_notify``)
        self._journaled: set[tuple[float, str, str]] = set()  # events written to (or read from) the agents' journal
        self._journal_follow = JournalFollow()  # when the journal was last read, whether a read is under way

    # -- setup --------------------------------------------------------------

    def get_default_screen(self) -> Screen[Any]:
        return MainScreen()

    @property
    def main(self) -> MainScreen:
        screen = self.screen_stack[0]
        assert isinstance(screen, MainScreen)
        return screen

    @on(MainScreen.Ready)
    def _main_ready(self) -> None:
        """MainScreen's widgets exist: only now can data be drawn."""
        self.set_interval(0.2, self._release_toasts)  # toasts held while a dialog is open
        if self.options.exit_on_sigint:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # no signals here: Ctrl-C stays
                asyncio.get_running_loop().add_signal_handler(signal.SIGINT, self.exit)
        self.redraw()
        self._load()

    # -- drawing ------------------------------------------------------------

    def redraw(self) -> None:
        self._write_journal()
        try:
            main = self.main
        except (AssertionError, IndexError):
            return
        if not main.is_mounted:
            return
        if self.state.source_label != self.source.label:
            # The source names what it reaches (a bundle once read, the agents left after a hostfile change or an
            # eviction): the store takes the name in before the header draws it.
            self.state = st.apply_source_label(self.state, self.source.label)
        # A poll, record or result may arrive while the app is closing and the screen's widgets are already gone
        # (seen with polls every 10 ms in a pilot test): nothing is left to draw on.
        with contextlib.suppress(NoMatches):
            main.draw(self.state)

    @on(TabbedContent.TabActivated)
    def _tab_changed(self) -> None:
        self.redraw()
        if not isinstance(self.focused, Input):  # keys typed fast ("2" then "/") must not lose the filter box
            self.main.focus_view()

    # -- actions ------------------------------------------------------------

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

    @on(Input.Submitted, "#filter-input")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        self.set_filter(event.value)
        event.input.display = False
        self.main.focus_view()

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

    @on(RankMapPanel.RankChosen)
    def _rank_chosen(self, event: RankMapPanel.RankChosen) -> None:
        self.open_rank(event.rank)

    @on(StackTreePanel.GroupChosen)
    def _group_chosen(self, event: StackTreePanel.GroupChosen) -> None:
        ranks = event.group.ranks
        flt = self.state.filter
        if flt.active:
            ranks = tuple(r for r in ranks if r in flt.ranks) or ranks
        self.open_rank(ranks[0])

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

    async def on_unmount(self) -> None:
        # The session is over; a stuck channel must not block the exit.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.source.close(), timeout=2.0)


def run_app(source: Source, options: AppOptions) -> int:
    settle_in_this_process()  # this process is the TUI's: what it holds is set aside from the collector
    app = RankscopeApp(source, replace(options, exit_on_sigint=True))
    result = app.run()
    return app.return_code or result or 0


def run_attach(agents: Sequence[str], token: str | None, options: AppOptions,
               reach: AttachOptions | None = None) -> int:
    """Attach the TUI to a job's agents and block until the user quits (``attach`` and the drills call this)."""
    r = reach or AttachOptions()
    source = LiveSource(agents, token, deadline_s=r.deadline_s, native=r.native, capture_timeout_s=r.capture_timeout_s,
                        acting=not options.read_only, act_problem=r.act_problem, tls=r.tls, sample_hz=r.sample_hz,
                        hostfile=r.hostfile, evicted=r.evicted, machine_names=r.machine_names)
    return run_app(source, options)


def run_bundle(path: str | Path, options: AppOptions) -> int:
    """Open a saved bundle (or recorded series) with the same views, offline.

    A small bundle is read here, so a wrong file fails like any CLI error;
    a big one is read inside the app, which shows that it is loading.
    """
    from rankscope.contract.bundle import BundleError, read_bundle

    p = Path(path)
    try:
        size = p.stat().st_size
    except OSError:
        raise BundleError(f"{p}: no such file; check the path given to --bundle") from None
    name = f"bundle {p.name}"
    if size < SMALL_BUNDLE_BYTES:
        return run_loaded(read_bundle(p), name, options)
    source = BundleSource(label=f"{name} ({size / 2**20:.0f} MB)", path=p)
    return run_app(source, options)


def run_loaded(bundle: Bundle, label: str, options: AppOptions) -> int:
    """Show a bundle already in memory (a small saved one, or saved py-spy dumps read by the CLI) offline."""
    return run_app(BundleSource(bundle, label=label), options)
