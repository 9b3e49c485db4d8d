"""After a restart both views of a pair tell one story: every running rank's stacks without a key press, each hang
and restart once, in the acting view's words.

Driven through the store's reducers (the code the app runs on every poll, capture and journal read) with the
recorded Fig. 7 job: 16 machines of two ranks, one snapshot a second.
"""

from __future__ import annotations

from dataclasses import replace

from rankscope.tui import digest as dg
from rankscope.tui import schedule, story
from rankscope.tui import state as st
from rankscope.tui.analysis import build_stack_view
from tui_bundles import T0, job


def _poll(s: st.AppState, snap: object, wall: float) -> st.AppState:
    return st.apply_poll(s, dg.digest(snap), wall)  # type: ignore[arg-type]


def _running(s: st.AppState, start: float, n: int, step: int) -> st.AppState:
    for i in range(n):
        s = _poll(s, job(start + i, stacks=False, step=step + i, hung=False), start + i)
    return s


def test_a_capture_missing_running_ranks_is_taken_again_without_a_key() -> None:
    s = _running(st.AppState(), T0, 8, 100)
    # The capture after the restart reached 12 of the 16 machines: the ranks of the other 4 have no stack.
    full = job(T0 + 8, stacks=True, step=108, hung=False)
    partial = replace(full, machines=tuple(replace(m, stacks=()) if i >= 12 else m
                                           for i, m in enumerate(full.machines)))
    s = st.apply_capture_analyzed(st.apply_capture_begun(s), dg.digest(partial),
                                  build_stack_view(partial, partial.layout), T0 + 8)
    assert schedule.uncaptured_ranks(s) == frozenset(range(24, 32))
    s = _running(s, T0 + 9, 3, 109)
    assert not schedule.refresh_capture_due(s), "not sooner than REFRESH_AFTER_S after the last capture"
    s = _running(s, T0 + 12, 2, 112)
    assert schedule.refresh_capture_due(s)
    s = st.apply_capture_begun(st.apply_refresh_captured(s, schedule.uncaptured_ranks(s)))  # as the app does
    assert not schedule.refresh_capture_due(s), "one capture at a time"
    # The retake read none of them (taken in the restart's last moments): the same set is retaken, a bounded number
    # of times (once per set left the map at "not captured since a restart" until s was pressed).
    for i in range(schedule.REFRESH_TRIES - 1):
        s = st.apply_capture_analyzed(s, dg.digest(partial), build_stack_view(partial, partial.layout), T0 + 14 + 6 * i)
        s = _running(s, T0 + 15 + 6 * i, 5, 115 + 6 * i)
        assert schedule.refresh_capture_due(s), i
        s = st.apply_capture_begun(st.apply_refresh_captured(s, schedule.uncaptured_ranks(s)))
    s = st.apply_capture_analyzed(s, dg.digest(partial), build_stack_view(partial, partial.layout), T0 + 39)
    s = _running(s, T0 + 40, 6, 140)
    assert not schedule.refresh_capture_due(s), "at most REFRESH_TRIES captures for one set of missing ranks"
    s = st.apply_capture_analyzed(st.apply_capture_begun(s), dg.digest(job(T0 + 46, stacks=True, step=146, hung=False)),
                                  build_stack_view(full, full.layout), T0 + 46)
    assert schedule.uncaptured_ranks(s) == frozenset() and not schedule.refresh_capture_due(s)


def test_a_capture_of_an_earlier_launch_misses_every_running_rank() -> None:
    s = _running(st.AppState(), T0, 6, 100)
    capture = job(T0 + 6, stacks=True, step=106, hung=False)
    s = st.apply_capture_analyzed(s, dg.digest(capture), build_stack_view(capture, capture.layout), T0 + 6)
    s = replace(s, restarts=s.restarts + 1)  # the job restarted since (new pids): that capture is of other processes
    assert schedule.uncaptured_ranks(s) == frozenset(range(32))


def test_the_journal_tells_a_hang_and_a_restart_once_in_the_acting_views_words() -> None:
    # The read-only view saw the hang 14 s after the acting view journaled it, and the restart before every agent
    # was back: without one story, Events listed each twice ("hung at 02:07:14" and "at 02:07:28").
    s = st.AppState(read_only=True)
    s = replace(s, events=(story.Event(T0 + 14, "hung", "no progress since 00:00:00"),
                           story.Event(T0 + 40, "restarted", "the job restarted on standby-0 (agent not back yet)")))
    s = st.apply_journal(s, [(T0, "hung", "no progress since 23:59:58"),
                             (T0 + 42, "restarted", "the job restarted on node00, standby-0")])
    assert [(e.wall - T0, e.kind, e.text) for e in s.events] == [
        (0.0, "hung", "no progress since 23:59:58"), (42.0, "restarted", "the job restarted on node00, standby-0")]
    # The same moment seen again by this view after the journal told it: not a second line.
    s = st.apply_failure(s, "hung", "no progress since 00:00:01", T0 + 20)
    assert sum(e.kind == "hung" for e in s.events) == 1
    # A new hang after the restart is a new moment.
    s = st.apply_failure(s, "hung", "no progress since 00:01:00", T0 + 60)
    assert sum(e.kind == "hung" for e in s.events) == 2


def test_the_ranks_own_step_durations_give_the_rhythm_from_the_first_polls() -> None:
    # A view attached a few steps before a hang had seen too few progress marks: it waited the whole 30 s ceiling.
    from test_tui_failslow import fs_series

    s = st.AppState()
    for snap in fs_series(8, slow=None):  # 0.5 s steps (±3 %), the counters' last_step_duration_s, one poll a second
        s = st.apply_poll(s, dg.digest(snap), snap.captured.wall)
    assert dg.digest(fs_series(2, slow=None)[0]).longest_step_s is None, "a launch's first steps are no rhythm"
    assert s.hang.from_rhythm and s.hang_threshold_s == 6.0 and s.hang.longest_gap_s is not None
    assert 0.48 < s.hang.longest_gap_s <= 1.0


def test_the_same_words_a_moment_apart_are_one_event() -> None:
    # "training runs again: first step at 04:47:51" twice: the view's own line and the journal's copy of the acting
    # view's, stamped milliseconds apart.
    s = st.apply_failure(st.AppState(read_only=True), "resumed", "training runs again after the restart", T0 + 10)
    s = st.apply_journal(s, [(T0 + 10.2, "resumed", "training runs again after the restart")])
    assert [e.text for e in s.events] == ["training runs again after the restart"]
    s = st.apply_journal(s, [(T0 + 9.0, "resumed", "the job resumed from step 20 (the newest checkpoint)")])
    assert len(s.events) == 2, "other words are another moment"


def test_a_restart_the_pair_saw_twice_is_told_once_in_the_journals_words() -> None:
    # The read-only view logged the restart before every agent was back and again once they were; the journal's line
    # replaced only the first, and the pair's Events listed the restart twice where the acting view had it once.
    s = replace(st.AppState(read_only=True), events=(
        story.Event(T0 + 40, "restarted", "the job restarted on node01, standby-0 (agent not back yet)"),
        story.Event(T0 + 44, "restarted", "the job restarted on node01, standby-0")))
    s = st.apply_journal(s, [(T0 + 41, "restarted", "the job restarted on node01, standby-0 (standby-0 joined)")])
    assert [(e.wall - T0, e.text) for e in s.events] == [
        (41.0, "the job restarted on node01, standby-0 (standby-0 joined)")]



def _new_pids(snap: object, machines: range) -> object:
    """``snap`` with the ranks of ``machines`` (indices) running as new processes."""
    ms = tuple(replace(m, ranks=tuple(replace(r, pid=r.pid + 50_000) for r in m.ranks)) if i in machines else m
               for i, m in enumerate(snap.machines))  # type: ignore[attr-defined]
    return replace(snap, machines=ms)  # type: ignore[type-var]


def test_a_poll_that_catches_two_launches_at_once_does_not_hide_the_restart() -> None:
    # The acting view polled while half the ranks were new processes and half still the old ones: it took the new
    # pids in, found nothing changed at the next poll, never saw the restart and logged "progress resumed" after its
    # HUNG, where its pair (polling a moment later) logged the restart.
    s = _running(st.AppState(), T0, 5, 100)
    for i in range(40):
        s = _poll(s, job(T0 + 5 + i, stacks=False, step=104, hung=True), T0 + 5 + i)
    assert [e.kind for e in s.events].count("hung") == 1
    s = _poll(s, _new_pids(job(T0 + 46, stacks=False, step=1, hung=False), range(8)), T0 + 46)
    assert s.restarts == 0, "two launches at once: not yet"
    for i in range(3):
        s = _poll(s, _new_pids(job(T0 + 47 + i, stacks=False, step=2 + i, hung=False), range(16)), T0 + 47 + i)
    assert s.restarts == 1
    assert [e.kind for e in s.events if e.kind in ("hung", "restarted", "resumed")] == ["hung", "restarted"]
    assert not any(e.text == "progress resumed" for e in s.events)


def test_a_late_views_own_hang_in_the_journals_words_is_one_row_however_late() -> None:
    # A pair attached a minute into the hang logged "no progress since ..." (the agents' mark, the same words the
    # acting view journaled) 60 s after the journal's line: two HUNG rows in the pair, one in the acting view.
    s = st.apply_journal(st.AppState(read_only=True), [(T0, "hung", "no progress since 23:59:58")])
    s = st.apply_failure(s, "hung", "no progress since 23:59:58", T0 + 60)
    assert [(e.wall - T0, e.kind) for e in s.events] == [(0.0, "hung")]
    # The acting view's "training runs again" read from the journal after the pair's own, 45 s apart: one row.
    s = st.apply_failure(s, "restarted", "the job restarted on node00", T0 + 100)
    s = st.apply_failure(s, "resumed", "training runs again after the restart", T0 + 130)
    s = st.apply_journal(s, [(T0 + 175, "resumed", "training runs again after the restart")])
    assert sum(e.kind == "resumed" for e in s.events) == 1
    # After a new hang the same words are a new moment.
    s = st.apply_failure(s, "hung", "no progress since 00:03:00", T0 + 200)
    s = st.apply_journal(s, [(T0 + 260, "resumed", "training runs again after the restart")])
    assert sum(e.kind == "resumed" for e in s.events) == 2


def test_progress_between_an_eviction_and_the_restart_is_not_a_resumed_hang() -> None:
    # The read-only view saw the job's progress move after the eviction and before it saw the restart: it logged
    # "progress resumed" after the HUNG, where the acting view told the restart and its first step.
    s = _running(st.AppState(read_only=True), T0, 5, 100)
    for i in range(40):
        s = _poll(s, job(T0 + 5 + i, stacks=False, step=104, hung=True), T0 + 5 + i)
    s = st.apply_evicted(s, ["node05"], T0 + 45)
    assert s.awaiting_restart
    s = _poll(s, job(T0 + 46, stacks=False, step=105, hung=False, lost=(5,)), T0 + 46)
    assert not any(e.text == "progress resumed" for e in s.events)
    s = _poll(s, _new_pids(job(T0 + 47, stacks=False, step=1, hung=False, lost=(5,)), range(16)), T0 + 47)
    assert s.restarts == 1 and not s.awaiting_restart
    assert [e.kind for e in s.events if e.kind in ("hung", "restarted", "resumed")] == ["hung", "restarted"]


def test_events_read_in_the_order_things_happened_restart_then_resumed_from_then_the_first_step() -> None:
    # By hand: the journal's "resumed from step N" (written when the new ranks had loaded) was listed before the
    # view's own "restarted" row, stamped when the view's poll found the new pids, a moment later. The restart is
    # told just before the resumption stamped first, and the first step at the ranks' own mark of it. The ranks of
    # a warm restart are parked processes started long before (here at +31, before the eviction): their start is
    # no time for the restart.
    from test_tui_job_state import T0 as J0
    from test_tui_job_state import fold, snap

    for journal_first in (True, False):
        s = fold([snap(J0 + i, progress=J0 + 10) for i in range(30, 34)], st.AppState(read_only=True))
        s = st.apply_evicted(s, ["machine-9"], J0 + 34)
        resumed_from = [(J0 + 43, "resumed", "the job resumed from step 20 on machine-0 machine-1")]
        if journal_first:
            s = st.apply_journal(s, resumed_from)
        s = fold([snap(J0 + 45, progress=None, started=J0 + 31, pids=2000)], s)
        if not journal_first:
            s = st.apply_journal(s, resumed_from)
        s = fold([snap(J0 + 48, progress=J0 + 46.5, started=J0 + 31, pids=2000)], s)
        told = [(round(e.wall - J0, 3), e.kind, e.text.split(":")[0]) for e in s.events
                if e.kind in ("evicted", "restarted", "resumed")]
        assert told == [(34.0, "evicted", "evicted machine-9"),
                        (42.999, "restarted", "the job restarted on machine-0, machine-1"),
                        (43.0, "resumed", "the job resumed from step 20 on machine-0 machine-1"),
                        (46.5, "resumed", "training runs again after the restart")], (journal_first, told)


def test_a_restart_with_no_resumption_before_it_is_told_when_seen_and_its_first_step_never_before_it() -> None:
    from test_tui_job_state import T0 as J0
    from test_tui_job_state import fold, snap

    s = fold([snap(J0 + i, progress=J0 + 10) for i in range(30, 34)], st.AppState())
    s = st.apply_evicted(s, ["machine-9"], J0 + 34)
    # A resumption of another chapter (before the eviction) is not this restart's.
    s = st.apply_journal(s, [(J0 + 20, "resumed", "the job resumed from step 5 on machine-0")])
    # The ranks' progress mark reads before the restart was seen (an agent clock a little behind the view's).
    s = fold([snap(J0 + 45, progress=J0 + 40, started=J0 + 31, pids=2000)], s)
    told = [(e.wall - J0, e.kind) for e in s.events if e.kind in ("evicted", "restarted", "resumed")]
    assert told == [(20.0, "resumed"), (34.0, "evicted"), (45.0, "restarted"), (45.0, "resumed")], told
    # A hot-update's warm restart a minute later: its parked ranks started just after the first restart. Stamped at
    # their start, it read as the first restart seen again and both its rows were dropped (the tmux incident test).
    s = fold([snap(J0 + 46 + i, progress=J0 + 46 + i, started=J0 + 31, pids=2000) for i in range(10)], s)
    s = fold([snap(J0 + 110, progress=None, started=J0 + 50, pids=3000),
              snap(J0 + 112, progress=J0 + 111.5, started=J0 + 50, pids=3000)], s)
    told = [(e.wall - J0, e.kind) for e in s.events if e.kind in ("restarted", "resumed")]
    assert told[-2:] == [(110.0, "restarted"), (111.5, "resumed")], told


def test_a_restart_is_told_before_the_restarters_account_by_its_kind_never_before_a_views_sighting() -> None:
    # Whether a resumption is the restarter's account ("resumed from step N") or a view's sighting of the first
    # step is a fact carried with it (Event.observed, journaled as JournalEntry.observed), not read from its words.
    from test_tui_job_state import T0 as J0
    from test_tui_job_state import fold, snap

    words = "the job runs again on machine-0 machine-1"
    for observed in (False, True):
        s = fold([snap(J0 + i, progress=J0 + 10) for i in range(30, 34)], st.AppState(read_only=True))
        s = st.apply_evicted(s, ["machine-9"], J0 + 34)
        s = st.apply_journal(s, [story.Event(J0 + 43, "resumed", words, observed=observed)])
        s = fold([snap(J0 + 45, progress=None, started=J0 + 31, pids=2000)], s)
        restarted = next(e.wall - J0 for e in s.events if e.kind == "restarted")
        assert round(restarted, 3) == (45.0 if observed else 42.999), observed
    # The view's own sightings carry the fact.
    s = fold([snap(J0 + 48, progress=J0 + 46.5, started=J0 + 31, pids=2000)], s)
    own = [e for e in s.events if e.kind == "resumed" and e.text == "training runs again after the restart"]
    assert len(own) == 1 and own[0].observed


def _failslow(machine: str | None, words: str) -> object:
    from rankscope.analyzers.failslow_vote import FailSlowVerdict
    from rankscope.analyzers.findings import Suspect, SuspectKind, Verdict
    from rankscope.tui.failslow_state import FailSlowView

    suspects = (Suspect(SuspectKind.MACHINE, (4, 5), (machine,), 0.8, (words,)),) if machine else ()
    verdict = FailSlowVerdict(Verdict(suspects, words), 0.8, True, (), None, 20)
    return FailSlowView(verdict, (), None, (), machine, (), (), 1)


def test_a_pair_tells_the_slowdown_once_though_its_detectors_name_it_later_in_other_words() -> None:
    # By hand (fail-slow drill, 80x24): the read-only view listed the slowdown twice, the acting view's journaled
    # verdict of 16:36:43 ("rank 4 arrived last ...; confidence 0.82") and its own of 16:37:20 ("rank 5 ...; 0.74").
    # Which machines a fail-slow reading names is carried with it (Event.slow, JournalEntry.slow), not read from text.
    from rankscope.actions.journal import JournalEntry, entries_from_bytes, entries_to_bytes
    from test_tui_job_state import T0 as J0
    from test_tui_job_state import fold, snap

    acting = JournalEntry(J0 + 43, "verdict", "slow: machine-2 — fail-slow: machine machine-2 (rank 4 last)",
                          "alice@desk", slow=("machine-2",))
    (told,) = entries_from_bytes(entries_to_bytes([acting]))
    for journal_first in (True, False):
        s = fold([snap(J0 + i, progress=J0 + i) for i in range(30, 34)], st.AppState(read_only=True))
        if journal_first:
            s = st.apply_journal(s, [story.Event(told.wall, told.kind, told.text, slow=told.slow)])
        s = st.apply_failslow(replace(s, now_wall=J0 + 80), _failslow("machine-2", "fail-slow: machine-2 (rank 5)"))
        if not journal_first:
            s = st.apply_journal(s, [story.Event(told.wall, told.kind, told.text, slow=told.slow)])
        slow = [(e.wall - J0, e.text) for e in s.events if e.slow]
        assert slow == [(43.0, acting.text)], (journal_first, slow)
        # An eviction starts another chapter: the same machine named after it is news.
        s = st.apply_evicted(s, ["machine-1"], J0 + 90)
        s = st.apply_failslow(replace(s, now_wall=J0 + 95), _failslow(None, "no machine"))
        s = st.apply_failslow(replace(s, now_wall=J0 + 99), _failslow("machine-2", "again"))
        assert [(e.wall - J0, e.slow) for e in s.events if e.slow is not None] == [
            (43.0, ("machine-2",)), (95.0, ()), (99.0, ("machine-2",))]


def test_after_a_warm_restart_the_old_launchs_progress_mark_is_not_the_first_step() -> None:
    # The tmux incident test, after the hot-update: the warm restart's parked ranks were read with their rank's
    # progress of the launch before (J0+55); taken for the first step, "training runs again" was stamped at the
    # restart, read as the eviction's resumption seen again and dropped, and the real first step was told nowhere.
    from test_tui_job_state import T0 as J0
    from test_tui_job_state import fold, snap

    s = fold([snap(J0 + i, progress=J0 + 10) for i in range(30, 34)], st.AppState())
    s = st.apply_evicted(s, ["machine-9"], J0 + 34)
    s = fold([snap(J0 + 45, progress=None, started=J0 + 31, pids=2000)], s)
    s = fold([snap(J0 + 46 + i, progress=J0 + 46 + i, started=J0 + 31, pids=2000) for i in range(10)], s)
    s = st.apply_journal(s, [(J0 + 108, "resumed", "the job resumed from step 368 on machine-0 machine-1, code v2")])
    s = fold([snap(J0 + 110, progress=J0 + 55, started=J0 + 50, pids=3000)], s)
    assert [e.kind for e in s.events if e.wall > J0 + 100] == ["restarted", "resumed"]  # the journal's only
    s = fold([snap(J0 + 112, progress=J0 + 111.5, started=J0 + 50, pids=3000)], s)
    told = [(round(e.wall - J0, 3), e.kind, e.text[:30]) for e in s.events if e.kind in ("restarted", "resumed")]
    assert told[-3:] == [(107.999, "restarted", "the job restarted on machine-0"),
                         (108.0, "resumed", "the job resumed from step 368 "),
                         (111.5, "resumed", "training runs again after the ")], told
    assert not any(e.kind == "hung" for e in s.events)
    # A new launch that never steps is still called hung: from the restart seen, by the ceiling.
    s = fold([snap(J0 + 200 + i, progress=J0 + 111.5, started=J0 + 50, pids=4000) for i in (0, 40)], s)
    assert [(round(e.wall - J0), e.text) for e in s.events if e.kind == "hung"][-1:] == [
        (240, f"no progress since {st.fmt_time(J0 + 200)}")], s.events[-3:]


def test_the_journals_resumption_after_a_restart_this_view_has_not_seen_yet_keeps_the_views_earlier_one() -> None:
    """The read-only view read the journal (the acting view's restart of a hot-update and its "training runs again")
    before seeing that restart itself: the journal's line read as the view's own line of the eviction's restart
    (no restart between them in the view's events) and the view's line was dropped; the pair's stories differed."""
    again = "training runs again after the restart"
    s = replace(st.AppState(read_only=True), events=(
        story.Event(T0, "hung", "no progress since 00:00:00"),
        story.Event(T0 + 20, "restarted", "the job restarted on node01, standby-0: its ranks run under new pids"),
        story.Event(T0 + 25, "resumed", again, observed=True)))
    # The journal's lines not read before (a view passes each entry once): the hot-update's restart and first step.
    s = st.apply_journal(s, [
        story.Event(T0 + 200, "restarted", "the job restarted on node01, standby-0: its ranks run under new pids; "
                                           "code git:v2"),
        story.Event(T0 + 206, "resumed", again, observed=True)])
    assert [(e.wall - T0, e.kind) for e in s.events if e.kind != "hung"] == [
        (20, "restarted"), (25, "resumed"), (200, "restarted"), (206, "resumed")], s.events
