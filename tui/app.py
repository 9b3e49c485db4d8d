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

``RankscopeApp`` is put together from parts by concern (``rankscope.tui.app_part`` says how): the workers and the
handlers of what they post (``app_workers``), the keys and their actions (``app_keys``), the toasts (``app_toasts``)
and the incident journal (``app_journal``). This module holds what joins them (the store, the screen, the redraw)
and the app's start-up (``run_attach``, ``run_bundle``, ``run_loaded``).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

from rankscope.contract.bundle import Bundle
from rankscope.contract.heap import settle_in_this_process
from rankscope.tui import state as st
from rankscope.tui.actions import ActionController
from rankscope.tui.app_journal import JournalFollow, JournalPart
from rankscope.tui.app_keys import ACTION_KEYS, KEY_BINDINGS, KeysPart
from rankscope.tui.app_options import AppOptions, AttachOptions
from rankscope.tui.app_toasts import ToastsPart
from rankscope.tui.app_workers import WorkersPart
from rankscope.tui.failslow_state import FailSlowFeeder
from rankscope.tui.screens.main import MainScreen
from rankscope.tui.sources import BundleSource, LiveSource, Source
from rankscope.tui.widgets.rank_map import RankMapPanel
from rankscope.tui.widgets.stack_tree import StackTreePanel
from textual import on
from textual.app import App
from textual.binding import BindingType
from textual.css.query import NoMatches
from textual.notifications import Notification
from textual.screen import Screen
from textual.widgets import Input, TabbedContent

__all__ = ["AppOptions", "AttachOptions", "RankscopeApp", "run_app", "run_attach", "run_bundle", "run_loaded"]

SMALL_BUNDLE_BYTES = 4 << 20  # read before the UI opens; larger bundles are read by the app, in a thread


class RankscopeApp(WorkersPart, KeysPart, ToastsPart, JournalPart, App[int]):
    CSS_PATH = "rankscope.tcss"
    TITLE = "rankscope"
    BINDINGS: ClassVar[list[BindingType]] = KEY_BINDINGS

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

    # -- widget messages (Textual reads ``@on`` handlers from App classes only: they stay here, see app_part) -----

    @on(TabbedContent.TabActivated)
    def _tab_changed(self) -> None:
        self.redraw()
        if not isinstance(self.focused, Input):  # keys typed fast ("2" then "/") must not lose the filter box
            self.main.focus_view()

    @on(Input.Submitted, "#filter-input")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        self.set_filter(event.value)
        event.input.display = False
        self.main.focus_view()

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

    async def on_unmount(self) -> None:
        # The session is over; a stuck channel must not block the exit.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.source.close(), timeout=2.0)


# -- start-up ---------------------------------------------------------------


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
