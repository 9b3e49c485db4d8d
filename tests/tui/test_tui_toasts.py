"""Toasts coalesced by kind and bounded, so they never pile up over the header or a dialog."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from rankscope.tui.toasts import MAX_LINES, MAX_TOASTS, coalesce, kind_of
from textual.notifications import Notification


def toast(message: str, title: str = "", at: float = 0.0, severity: str = "information") -> Notification:
    return Notification(message, title, severity, 5.0, raised_at=at)  # type: ignore[arg-type]


def shown_after(*new: Notification) -> list[Notification]:
    shown: list[Notification] = []
    for n in new:
        drop, add = coalesce(shown, n)
        shown = [s for s in shown if s not in drop] + [add]
    return shown


def test_a_kind_already_shown_is_merged_with_the_newest_line_last() -> None:
    shown = shown_after(*(toast(f"machine-{i}: SIGTERM 2 processes", "evict 1/2", at=i) for i in range(4)))
    (merged,) = shown
    assert merged.title == "evict 1/2"
    assert merged.message.splitlines() == [f"machine-{i}: SIGTERM 2 processes" for i in range(4)][-MAX_LINES:]


def test_an_actions_steps_and_its_result_are_one_toast() -> None:
    (merged,) = shown_after(toast("machine-3: SIGTERM", "evict 1/3", at=0), toast("machine-3: blocked", "evict 3/3", at=1),
                            toast("machine-3: succeeded", "evict result", at=2))
    assert merged.title == "evict result" and merged.message.splitlines()[-1] == "machine-3: succeeded"


def test_at_most_three_are_up_and_the_oldest_go_first() -> None:
    shown = shown_after(*(toast(f"note {i}", f"kind{i} x", at=i) for i in range(8)))
    assert [n.message for n in shown] == ["note 5", "note 6", "note 7"]


@given(st.lists(st.tuples(st.sampled_from(["", "evict 1/2", "evict result", "hot-update"]),
                          st.text(min_size=1, max_size=30)), max_size=30))
def test_never_more_than_the_bound_nor_longer_than_its_lines(raised: list[tuple[str, str]]) -> None:
    shown = shown_after(*(toast(m, t, at=i) for i, (t, m) in enumerate(raised)))
    assert len(shown) <= MAX_TOASTS
    assert all(len(n.message.splitlines()) <= MAX_LINES for n in shown)
    titled = [kind_of(n.title) for n in shown if n.title]
    assert len(titled) == len(set(titled)), "one toast per kind"
