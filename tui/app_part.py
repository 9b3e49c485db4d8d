"""What each part of the app sees of the whole ``RankscopeApp`` (``rankscope.tui.app``), named for the type checker.

The app is put together from parts by concern, each a mixin of ``RankscopeApp``: the data workers and the handlers
of what they post (``app_workers``), the keys and the actions they call (``app_keys``), the toasts
(``app_toasts``) and the agents' incident journal (``app_journal``). At run time a part is a plain class; to the
type checker it is an ``App`` with the store, source and options that ``RankscopeApp.__init__`` sets and the
methods one part calls on another, which ``RankscopeApp`` must provide (abstract here, so a missing one is an
error where the app is built). Textual reads ``@on`` handlers and ``BINDINGS`` from ``App`` subclasses only: those
are declared on ``RankscopeApp`` itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import asyncio
    from abc import abstractmethod
    from collections.abc import Callable
    from pathlib import Path

    from rankscope.tui import state as st
    from rankscope.tui.actions import ActionController
    from rankscope.tui.app_options import AppOptions
    from rankscope.tui.failslow_state import FailSlowFeeder
    from rankscope.tui.screens.main import MainScreen
    from rankscope.tui.sources import Source
    from textual.app import App

    class AppPart(App[int]):
        source: Source
        options: AppOptions
        clock: Callable[[], float]
        state: st.AppState  # the one store: changed only by the reducers of rankscope.tui.state
        actions: ActionController
        failslow: FailSlowFeeder
        loaded: asyncio.Event
        last_copied: str | None
        last_written: Path | None

        @property
        @abstractmethod
        def main(self) -> MainScreen: ...

        @abstractmethod
        def redraw(self) -> None: ...

        @abstractmethod
        def action_capture(self) -> None: ...

        @abstractmethod
        def _follow_journal(self) -> None: ...

        @abstractmethod
        def _read_journal_at_attach(self) -> None: ...

else:
    AppPart = object
