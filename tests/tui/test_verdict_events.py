"""A capture's verdict event is kept by the agents' journal by what the verdict says (its status), not its words."""

from __future__ import annotations

from rankscope.analyzers.findings import VerdictStatus
from rankscope.tui import digest as dg
from rankscope.tui import state as st
from rankscope.tui import story
from rankscope.tui.analysis import build_stack_view
from tui_bundles import T0, job


def _verdict_event(stuck: bool) -> tuple[story.Event, VerdictStatus]:
    snap = job(T0 + 60, stacks=True, step=103, hung=stuck)
    view = build_stack_view(snap, snap.layout)
    s = st.apply_capture(st.AppState(), dg.digest(snap), view, T0 + 60)
    events = [e for e in s.events if e.kind == "verdict"]
    assert len(events) == 1, s.events
    return events[0], view.verdict.status


def test_a_verdict_naming_suspects_goes_to_the_journal() -> None:
    event, status = _verdict_event(stuck=True)
    assert status is VerdictStatus.NAMED and not event.names_nobody
    assert story.journal_worthy(event)


def test_a_capture_naming_nobody_is_shown_but_not_journaled() -> None:
    event, status = _verdict_event(stuck=False)  # every rank in the optimizer: one stack group, no verdict
    assert status is VerdictStatus.NO_VERDICT and event.names_nobody
    assert event.text.startswith("no verdict") and not story.journal_worthy(event)
