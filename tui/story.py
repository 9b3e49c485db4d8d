"""Events, and one story told once: the same moment seen by two views, or by a view and the agents' journal, is one
event.

A pair of views (an acting one and a read-only one attached later) each log what they see at their own polls; the
acting view also journals the moments that matter (``journal_worthy``) for views attached later. These rules say
when two events tell one moment (``same_moments``), merge a view's events in time order (``merged``) and date the
moments a poll found (``before_its_resumption``, ``when_found``). The store (``rankscope.tui.state``) applies them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

EVENTS_KEPT = 500


@dataclass(frozen=True, slots=True)
class Event:
    wall: float
    kind: str  # capture, verdict, lost, found, capture-failed, hung, resumed, restarted, evicted, action, info
    text: str
    # A verdict that names no suspect (no verdict, or a running job's timing): shown, not kept by the journal.
    names_nobody: bool = False
    # A resumption a view saw in the ranks' progress ("training runs again"), not the restarter's account of the
    # step it resumed from (journaled as such: JournalEntry.observed).
    observed: bool = False
    # A fail-slow reading (a verdict): the machines the detectors name, () when they name none now; None: not one
    # (journaled as JournalEntry.slow).
    slow: tuple[str, ...] | None = None


# Moments every view sees for itself and the acting view also journals: one story, told once. An event of these
# kinds within ONE_STORY_S of one of the same kind, with nothing between them that starts a new chapter (a hang
# that resumed, a restart), is the same moment seen by two views.
ONE_STORY_KINDS = frozenset({"hung", "restarted"})
ONE_STORY_S = 30.0
RESTART_SETTLE_S = 30.0  # after a restart a view saw, its agents going and coming back are still the restart
_CHAPTERS = {"hung": frozenset({"resumed", "restarted"}), "restarted": frozenset({"hung", "evicted"}),
             "resumed": frozenset({"hung", "restarted"})}


def same_moment(events: Sequence[Event], e: Event) -> Event | None:
    """An event of ``events`` that tells the moment ``e`` tells, or None: the same words within ``ONE_STORY_S`` (a
    view's own line and the journal's copy of it, stamped a moment apart; journal kinds) or, for a hang or a
    resumption, with no new chapter between them; or for ``ONE_STORY_KINDS`` the same kind with no new chapter
    between them within ``ONE_STORY_S``."""
    return next(iter(same_moments(events, e)), None)


def _new_chapter(events: Sequence[Event], kind: str, a: float, b: float) -> bool:
    """Something between the times ``a`` and ``b`` starts a new chapter for events of ``kind`` (at the later time
    too: a restart is stamped at its first step when a poll found both)."""
    lo, hi = sorted((a, b))
    return any(x.kind in _CHAPTERS[kind] and lo < x.wall <= hi for x in events)


def _new_reading(events: Sequence[Event], slow: tuple[str, ...], a: float, b: float) -> bool:
    """Between the times ``a`` and ``b`` the job restarted, lost machines to an eviction, or the fail-slow detectors
    read other than ``slow``."""
    lo, hi = sorted((a, b))
    return any(lo < x.wall < hi and (x.kind in ("evicted", "restarted") or (x.slow is not None and x.slow != slow))
               for x in events)


def same_moments(events: Sequence[Event], e: Event) -> list[Event]:
    """Every event of ``events`` that tells the moment ``e`` tells (``same_moment``): a view that saw one restart
    twice (once before every agent was back, once after) has two lines the journal's one line replaces.

    The same words of a hang ("no progress since 10:09:26", the agents' mark) or a resumption, with no new chapter
    between them, are one moment however far apart they were seen: a view attached late logged the hang a minute
    after the acting view had journaled it, and listed it twice."""
    found: list[Event] = []
    if e.kind in JOURNAL_KINDS:  # (captures repeat their words every 10 s in fail-slow mode: each is a capture)
        found = [o for o in events if o.kind == e.kind and o.text == e.text and (
            abs(o.wall - e.wall) <= ONE_STORY_S
            or (e.kind in ("hung", "resumed") and not _new_chapter(events, e.kind, o.wall, e.wall)))]
    if e.slow is not None:
        # The fail-slow detectors of each view of a pair name the slow machine at their own moment, in their own
        # evidence's words: one reading until a restart, an eviction or another reading comes between them.
        found += [o for o in events if o.slow == e.slow and not any(o is f for f in found)
                  and not _new_reading(events, e.slow, o.wall, e.wall)]
    if e.kind not in ONE_STORY_KINDS:
        return found
    for other in events:
        if other.kind != e.kind or abs(other.wall - e.wall) > ONE_STORY_S or any(other is f for f in found):
            continue
        if not _new_chapter(events, e.kind, other.wall, e.wall):
            found.append(other)
    return found


def merged(told: tuple[Event, ...], events: Iterable[Event]) -> tuple[Event, ...]:
    """``told`` and ``events`` in time order, each moment once (stable: one poll's events keep their order). An
    agent's audit record carries its own time, earlier than what this view already logged: appended as it came,
    the newest-first list put 08:43:38 above 08:43:39."""
    new = tuple(events)
    if new and told:
        # The same moment told twice (the agents' journal and an audit stream, both replayed at attach) is one event.
        first = min(e.wall for e in new)
        have = {(e.wall, e.kind, e.text) for e in told if e.wall >= first}
        # Against what this batch told before it too: a restart and its first step found by one poll, after an
        # earlier restart's "training runs again", read as that earlier moment (no restart between them in the
        # events kept) and the resumption was dropped.
        kept: list[Event] = []
        for e in new:
            if (e.wall, e.kind, e.text) not in have and same_moment((*told, *kept), e) is None:
                kept.append(e)
        new = tuple(kept)
    if not new:
        return told
    out = (*told, *new)
    if told and min(e.wall for e in new) < told[-1].wall:
        out = tuple(sorted(out, key=lambda e: e.wall))
    return out[-EVENTS_KEPT:]


JOURNAL_KINDS = frozenset({"hung", "verdict", "evicted", "restarted", "resumed", "action"})
_FINAL_WORDS = (" succeeded on ", " failed on ", " refused on ", " cancelled on ")


def journal_worthy(event: Event) -> bool:
    """An event the agents' incident journal keeps for a view attached later: the hang, verdicts that name
    suspects, how actions ended, evictions, restarts and resumed training (not captures, polls or action steps)."""
    if event.kind not in JOURNAL_KINDS:
        return False
    if event.kind == "verdict":
        return not event.names_nobody
    if event.kind == "action":
        return any(w in event.text for w in _FINAL_WORDS)
    return True


TOLD_BEFORE_S = 0.001  # a restart is stamped this much before the resumption that was stamped first


def before_its_resumption(events: Sequence[Event], wall: float) -> float:
    """When to tell a restart a view found at ``wall``: just before the journal's resumption of it if that is stamped
    earlier (within RESTART_SETTLE_S, with no hang, eviction or other restart between them), else at ``wall``."""
    cut = max((e.wall for e in events if e.kind in _CAUSES and e.wall < wall), default=wall - RESTART_SETTLE_S)
    first = min((e.wall for e in events if e.kind == "resumed" and not e.observed
                 and max(cut, wall - RESTART_SETTLE_S) < e.wall < wall), default=None)
    return wall if first is None else first - TOLD_BEFORE_S


_CAUSES = frozenset({"hung", "evicted", "restarted"})


def when_found(mark: float | None, now_wall: float, before: Sequence[Event]) -> float:
    """When a moment a poll found happened: the agents' mark of it (a launch's start, its first step), never later
    than the poll that found it nor earlier than the hang, eviction or restart before it (an agent's clock a little
    behind the view's must not put a restart above the eviction that brought it)."""
    if mark is None:
        return now_wall
    return min(now_wall, max(mark, max((e.wall for e in before if e.kind in _CAUSES), default=mark)))
