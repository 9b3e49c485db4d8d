"""The Events view's rows: every view of a pair wraps one event's words at the same places."""

from __future__ import annotations

from rankscope.tui.story import Event
from rankscope.tui.widgets.events import event_rows

T0 = 1_700_000_000.0
RESTART = Event(T0, "restarted", "the job restarted on machine-1, machine-3, standby-0, standby-1 (agent not back "
                                 "yet): its ranks run under new pids; ranks 0-1 now on machine-1; ranks 4-5 now on "
                                 "standby-0")


def _what(rows: list[tuple[object, ...]]) -> list[str]:
    return [str(r[2]) for r in rows]


def test_one_event_wraps_the_same_whatever_other_kinds_a_view_holds() -> None:
    # The acting view held a "capture-failed" row, its pair did not: the kind column was as wide as the longest kind
    # held, and the restart's line broke at "now on mach" in one view and "now on machi" in the other.
    acting = event_rows((Event(T0 - 5, "capture-failed", "a capture failed"), RESTART), 160)
    pair = event_rows((Event(T0 - 5, "info", "a note"), RESTART), 160)
    assert _what(acting)[: len(_what(pair)) - 1] == _what(pair)[:-1]
    restart_rows = [w for w in _what(pair) if w != "a note"]
    assert len(restart_rows) >= 2 and " ".join(restart_rows) == RESTART.text, restart_rows
    assert all(len(w) <= 160 - 8 - len("capture-failed") - 6 for w in _what(acting))


def test_rows_are_newest_first_and_unwrapped_before_the_first_layout() -> None:
    rows = event_rows((Event(T0, "hung", "no progress since 00:00:00"), RESTART), 0)
    assert _what(rows) == [RESTART.text, "no progress since 00:00:00"]
