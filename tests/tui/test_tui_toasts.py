"""Toasts coalesced by kind and bounded, so they never pile up over the header or a dialog."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from rankscope.actions.model import ActionKind
from rankscope.tui.toasts import MAX_LINES, MAX_TOASTS, KindedNotification, ToastKind, Topic, coalesce, kind_of
from textual.notifications import Notification


def toast(message: str, title: str = "", at: float = 0.0, severity: str = "information",
          kind: ToastKind | None = None) -> Notification:
    if kind is None:
        return Notification(message, title, severity, 5.0, raised_at=at)  # type: ignore[arg-type]
    return KindedNotification(message, title, severity, 5.0, raised_at=at, kind=kind)  # type: ignore[arg-type]


def shown_after(*new: Notification) -> list[Notification]:
    shown: list[Notification] = []
    for n in new:
        drop, add = coalesce(shown, n)
        shown = [s for s in shown if s not in drop] + [add]
    return shown


def test_a_kind_already_shown_is_merged_with_the_newest_line_last() -> None:
    shown = shown_after(*(toast(f"machine-{i}: SIGTERM 2 processes", "evict 1/2", at=i, kind=ActionKind.EVICT)
                          for i in range(4)))
    (merged,) = shown
    assert merged.title == "evict 1/2" and kind_of(merged) is ActionKind.EVICT
    assert merged.message.splitlines() == [f"machine-{i}: SIGTERM 2 processes" for i in range(4)][-MAX_LINES:]


def test_an_actions_steps_and_its_result_are_one_toast() -> None:
    (merged,) = shown_after(toast("machine-3: SIGTERM", "evict 1/3", at=0, kind=ActionKind.EVICT),
                            toast("machine-3: blocked", "evict 3/3", at=1, kind=ActionKind.EVICT),
                            toast("machine-3: succeeded", "evict result", at=2, kind=ActionKind.EVICT))
    assert merged.title == "evict result" and merged.message.splitlines()[-1] == "machine-3: succeeded"


def test_the_kind_given_where_a_toast_is_raised_decides_not_its_title() -> None:
    # A rollback's refusal is titled "hot-update" (the dialog it came from) but is no step of a hot-update under
    # way; a toast raised with no kind merges with nothing, whatever its title.
    shown = shown_after(toast("machine-1: staged", "hot-update 1/2", at=0, kind=ActionKind.HOT_UPDATE),
                        toast("no such version\nfix: pick one", "hot-update", at=1, kind=ActionKind.ROLLBACK),
                        toast("a note", "hot-update", at=2))
    assert [(n.title, kind_of(n)) for n in shown] == [("hot-update 1/2", ActionKind.HOT_UPDATE),
                                                      ("hot-update", ActionKind.ROLLBACK), ("hot-update", None)]


def test_at_most_three_are_up_and_the_oldest_go_first() -> None:
    kinds: list[ToastKind] = [*ActionKind, *Topic]
    shown = shown_after(*(toast(f"note {i}", f"kind{i} x", at=i, kind=kinds[i % len(kinds)]) for i in range(7)))
    assert [n.message for n in shown] == ["note 4", "note 5", "note 6"]


@given(st.lists(st.tuples(st.sampled_from([None, ActionKind.EVICT, ActionKind.HOT_UPDATE, Topic.CANNOT_ACT]),
                          st.text(min_size=1, max_size=30)), max_size=30))
def test_never_more_than_the_bound_nor_longer_than_its_lines(raised: list[tuple[ToastKind | None, str]]) -> None:
    shown = shown_after(*(toast(m, "t", at=i, kind=k) for i, (k, m) in enumerate(raised)))
    assert len(shown) <= MAX_TOASTS
    assert all(len(n.message.splitlines()) <= MAX_LINES for n in shown)
    kinded = [kind_of(n) for n in shown if kind_of(n) is not None]
    assert len(kinded) == len(set(kinded)), "one toast per kind"



def test_a_toast_that_arrives_as_the_app_quits_is_dropped_not_a_traceback() -> None:
    # A worker's toast handled after the last screen was popped: asking for the screen raised ScreenStackError and
    # the quit ended in a traceback.
    from rankscope.contract.bundle import Bundle
    from rankscope.tui.app import AppOptions, RankscopeApp
    from rankscope.tui.sources import BundleSource
    from textual.notifications import Notify

    app = RankscopeApp(BundleSource(Bundle((), 0.0), "empty"), AppOptions())
    assert not app.screen_stack  # not running: as after its last screen is gone
    app._on_notify(Notify(Notification("evict result: done", severity="information")))
    assert not list(app._notifications) and not app._held_toasts
