"""The agents' incident journal, as the app keeps it: read at attach (and again while the story may still change),
and the moments a late view must see written to every agent once.

A late pair view tells the same story as the view that watched it happen; the incident goes on without the journal
when an agent has none.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from rankscope.tui import schedule, story
from rankscope.tui import state as st
from rankscope.tui.app_part import AppPart


@dataclass(slots=True)
class JournalFollow:
    """The journal reader's working state (nothing drawn): when it last read, and whether a read is under way."""

    read_wall: float | None = None  # state.now_wall at the last read's start
    reading: bool = False

    def began(self, now_wall: float) -> None:
        self.read_wall, self.reading = now_wall, True


class JournalPart(AppPart):
    """Reads and writes the agents' journal; what it reads is folded into the store (``st.apply_journal``)."""

    _journaled: set[tuple[float, str, str]]  # events written to (or read from) the agents' journal
    _journal_follow: JournalFollow  # when the journal was last read, whether a read is under way

    def _read_journal_at_attach(self) -> None:
        """What the agents' journal tells of the time before this view attached (a live source's only)."""
        if self.source.live and callable(getattr(self.source, "journal", None)):
            self._journal_follow.began(self.state.now_wall)
            self.run_worker(self._read_journal(), group="journal-read", exit_on_error=False)

    def _follow_journal(self) -> None:
        """Read the agents' journal again when ``schedule.journal_read_due`` says so, one read at a time."""
        follow = self._journal_follow
        if follow.reading or not self.source.live or not callable(getattr(self.source, "journal", None)):
            return
        if not schedule.journal_read_due(self.state, follow.read_wall):
            return
        follow.began(self.state.now_wall)
        self.run_worker(self._read_journal(again=True), group="journal-read", exit_on_error=False)

    async def _read_journal(self, again: bool = False) -> None:
        """What happened before this view attached, from the agents' incident journal (a late pair view tells the
        same story as the view that watched it happen); ``again``: what was written since (a restart's resumed
        step), each entry once, a failure said only at attach."""
        journal = getattr(self.source, "journal", None)
        if not callable(journal):
            return
        try:
            entries = await journal()
        except Exception as exc:  # an older agent, a lost one: the view works without the story
            if not again:
                self.state = st.apply_info(self.state, f"no incident journal from the agents: {exc}", self.clock())
            return
        finally:
            self._journal_follow.reading = False
        new = [e for e in entries if (e.wall, e.kind, e.text) not in self._journaled]
        if again and not new:
            return
        self._journaled.update((e.wall, e.kind, e.text) for e in new)
        self.state = st.apply_journal(self.state, (story.Event(e.wall, e.kind, e.text, observed=e.observed, slow=e.slow)
                                                        for e in new))
        self.redraw()

    def _write_journal(self) -> None:
        """The moments a late view must see (``story.journal_worthy``), written once to every agent's journal."""
        journal = getattr(self.source, "journal", None)
        if self.options.read_only or not callable(journal):
            return
        from rankscope.actions.journal import JournalEntry
        from rankscope.tui.actions import requester

        new = [e for e in self.state.events if story.journal_worthy(e) and (e.wall, e.kind, e.text) not in self._journaled]
        if not new:
            return
        self._journaled.update((e.wall, e.kind, e.text) for e in new)
        who = requester()
        entries = [JournalEntry(e.wall, e.kind, e.text, who, e.observed, e.slow) for e in new]

        async def write() -> None:
            with contextlib.suppress(Exception):  # the journal is for later views; the incident goes on without it
                await journal(entries)

        self.run_worker(write(), group="journal")
