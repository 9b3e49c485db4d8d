"""The TUI's one store: the reducers for what the app used to keep beside ``AppState`` (#15).

The filter, the fail-slow view, the audit log, the confirmation under way and
the capture-scheduling facts are changed only by these pure functions; the
app's message handlers call them (tests/tui drive the app end to end).
"""

from __future__ import annotations

import inspect
from dataclasses import replace

from rankscope.actions.model import ActionKind, AuditRecord
from rankscope.contract.snapshot import JobSnapshot
from rankscope.tui import digest as dg
from rankscope.tui import filter as flt
from rankscope.tui import health as hl
from rankscope.tui import schedule
from rankscope.tui import state as st
from rankscope.tui import state_actions as sa
from rankscope.tui.analysis import build_stack_view
from rankscope.tui.failslow_state import EMPTY
from rankscope.tui.screens.main import MainScreen
from tui_bundles import T0, fig7_bundle, job


def fold(snaps: tuple[JobSnapshot, ...]) -> st.AppState:
    s = st.AppState()
    for snap in snaps:
        s = st.apply_poll(s, dg.digest(snap), snap.captured.wall)  # the app's handling of a poll
    return s


def record(seq: int, kind: ActionKind, result: str, machines: tuple[str, ...], what: str = "x") -> AuditRecord:
    return AuditRecord(seq, f"a{seq}", "alice@host", T0 + seq, kind, what, result, "", machines)


def test_a_filter_is_compiled_against_the_state_and_recompiled_against_each_new_capture() -> None:
    snaps = fig7_bundle().snapshots
    s = fold(snaps[:-1])  # no stacks yet
    assert st.apply_filter(s, "node05").filter.ranks == frozenset({10, 11})
    s = st.apply_filter(s, "gather_output")  # a frame of machine 15's ranks, not captured yet
    assert s.filter.active and s.filter.ranks == frozenset()
    capture = snaps[-1]
    s = st.apply_capture_analyzed(s, dg.digest(capture), build_stack_view(capture, capture.layout), capture.captured.wall)
    assert s.filter.text == "gather_output" and s.filter.ranks == frozenset({30, 31})
    assert st.apply_filter(s, "  ").filter == flt.NO_FILTER


def test_an_audit_record_is_a_row_and_an_event_once_and_a_succeeded_eviction_marks_its_machines() -> None:
    s = fold((job(T0, stacks=False, step=1, hung=False),))
    s = st.apply_audit_note(s, "127.0.0.1:50105", "audit of node05: no agent answered — reconnecting")
    assert s.actions.log.notes == (("127.0.0.1:50105", "audit of node05: no agent answered — reconnecting"),)
    started = record(1, ActionKind.EVICT, "started", ("node05",), "evict node05")
    s1 = st.apply_audit(s, "127.0.0.1:50105", started)
    assert [x.record for x in s1.actions.log.lines] == [started]
    assert s1.actions.log.notes == ()  # the stream is back
    assert s1.events[-1].kind == "action" and "evict started on node05 by alice@host" in s1.events[-1].text
    assert s1.evicted == frozenset()
    assert st.apply_audit(s1, "127.0.0.1:50105", started) is s1  # a resumed stream replays: nothing changes
    assert s.actions.log.lines == ()  # the state before is untouched
    s2 = st.apply_audit(s1, "127.0.0.1:50105", record(2, ActionKind.EVICT, "succeeded", ("node05",)))
    assert s2.evicted == frozenset({"node05"}) and s2.awaiting_restart
    assert next(m for m in s2.machines if m.name == "node05").evicted
    assert [e.kind for e in s2.events[-2:]] == ["action", "evicted"]
    assert s2.actions.log.version == 3


def test_an_actions_progress_steps_are_rows_of_the_actions_view_not_events() -> None:
    """A backup's per-machine progress records flooded Events and pushed the incident's story off the screen."""
    s = fold((job(T0, stacks=False, step=1, hung=False),))
    started = st.apply_audit(s, "127.0.0.1:50105", record(1, ActionKind.BACKUP, "started", ("node05",), "backup"))
    progressed = st.apply_audit(started, "127.0.0.1:50105",
                                record(2, ActionKind.BACKUP, "progress", ("node05",), "backup"))
    assert len(progressed.actions.log.lines) == 2
    assert progressed.events == started.events
    done = st.apply_audit(progressed, "127.0.0.1:50105", record(3, ActionKind.BACKUP, "succeeded", ("node05",), "backup"))
    assert done.events[-1].kind == "action" and "backup succeeded on node05" in done.events[-1].text


def test_an_evicted_machines_audit_stream_ending_is_no_note_before_or_after_the_eviction_is_seen() -> None:
    # Its agent stops as the eviction runs, often before the eviction's own record arrives from another agent.
    s = fold((job(T0, stacks=False, step=1, hung=False),))
    node05 = next(m.address for m in s.machines if m.name == "node05")
    node06 = next(m.address for m in s.machines if m.name == "node06")
    s = st.apply_audit_note(s, node05, "audit of node05: handshake failed (Server shutdown) — reconnecting")
    s = st.apply_audit_note(s, node06, "audit of node06: no agent answered — reconnecting")
    s = st.apply_audit(s, node06, record(1, ActionKind.EVICT, "succeeded", ("node05",)))
    assert s.evicted == frozenset({"node05"})
    assert s.actions.log.notes == ()  # node06's stream is back (its record came), node05 is out of the job
    s = st.apply_audit_note(s, node06, "audit of node06: no agent answered — reconnecting")
    assert st.apply_audit_note(s, node05, "audit of node05: no agent answered — reconnecting") is s
    assert [a for a, _ in s.actions.log.notes] == [node06]
    assert st.apply_audit_note(s, node06, "").actions.log.notes == ()  # its stream is open again (AuditResumed)
    by_hostfile = st.apply_evicted(s, (), T0, frozenset({node06}))  # or marked evicted by the hostfile
    assert by_hostfile.actions.log.notes == ()


def test_a_note_replaces_the_agents_earlier_note_in_its_place() -> None:
    log = sa.log_note(sa.log_note(sa.ActionLog(), "a:1", "one"), "b:2", "two")
    log = sa.log_note(log, "a:1", "one again")
    assert log.notes == (("a:1", "one again"), ("b:2", "two"))


def test_a_confirmation_begun_then_cancelled_runs_nothing_and_a_confirmed_one_runs_until_it_ends() -> None:
    s = st.AppState()
    s = st.apply_actions(s, sa.begin_confirm(s.actions, "evict-1"))
    assert s.actions.confirming == "evict-1" and s.actions.running is None
    cancelled = st.apply_actions(s, sa.answer_confirm(s.actions, "evict-1", confirmed=False))
    assert cancelled.actions.confirming is None and cancelled.actions.running is None
    confirmed = st.apply_actions(s, sa.answer_confirm(s.actions, "evict-1", confirmed=True))
    assert confirmed.actions.confirming is None and confirmed.actions.running == "evict-1"
    assert sa.end_action(confirmed.actions, "backup-2") is confirmed.actions  # another action's end
    assert sa.end_action(confirmed.actions, "evict-1").running is None


def test_a_fail_slow_view_replaces_the_last_one() -> None:
    s = st.AppState()
    assert s.failslow is None
    first = replace(EMPTY, updates=1)
    second = replace(EMPTY, updates=2, skipped=3)
    assert st.apply_failslow(st.apply_failslow(s, first), second).failslow is second


def test_a_hang_is_captured_once_per_stop_and_a_waiting_capture_goes_once_the_job_steps() -> None:
    s = fold(fig7_bundle().snapshots[:-1])  # progress stopped at T0+2, 45 s ago
    assert hl.health(s).kind == "hung" and schedule.hang_capture_due(s)
    s = st.apply_hang_captured(s)
    assert s.hang_captured_for == s.last_progress_wall and not schedule.hang_capture_due(s)
    # After a restart, a slow first step is waited for, not captured as a hang.
    waiting = st.apply_await_start(replace(st.apply_hang_captured(s), hang_captured_for=None, restarts=1))
    assert waiting.capture_after_start and not schedule.hang_capture_due(waiting)
    # The waiting capture goes when nothing says the ranks are still starting (here: no job clock), not while
    # another capture runs.
    assert waiting.clock is None and schedule.started_capture_due(waiting)
    busy = st.apply_capture_begun(waiting)
    assert busy.capturing and not schedule.started_capture_due(busy)
    assert schedule.started_capture_due(st.apply_capture_ended(busy))
    assert not st.apply_started_captured(waiting).capture_after_start


def test_counters_seen_once_stay_seen() -> None:
    s = st.AppState()
    d = dg.digest(job(T0, stacks=False, step=3, hung=False))
    assert d.steps == 3
    s = st.apply_counters_seen(s, d)
    assert s.job_counts
    assert st.apply_counters_seen(s, replace(d, steps=None, comms=())) is s


def test_the_main_screen_draws_the_state_alone() -> None:
    params = list(inspect.signature(MainScreen.draw).parameters.values())
    assert [p.name for p in params] == ["self", "state"] and params[1].annotation in (st.AppState, "AppState")


def test_the_drills_resumed_entry_folds_into_events_in_time_order_once() -> None:
    """The step the job resumed from comes from the journal (the drill's recovery writes it once its agents are
    back): folded after the restart the view saw itself (told at the resumption's moment when the view saw it a
    poll late), in time order, and once however often it is read."""
    s = fold((job(T0, stacks=False, step=100, hung=False),))
    restarted = job(T0 + 40, stacks=False, step=96, hung=False)
    restarted = replace(restarted, machines=tuple(
        replace(m, ranks=tuple(replace(r, pid=r.pid + 50_000) for r in m.ranks)) for m in restarted.machines))
    s = st.apply_poll(s, dg.digest(restarted), T0 + 40)
    assert s.restarts == 1 and s.events[-1].kind == "restarted"
    resumed = (T0 + 38.5, "resumed", "the job resumed from step 96 (the newest checkpoint every rank saved) on "
                                     "node00 node01 after evicting node05, code git:v2 (bbbb)")
    hung = (T0 + 5.0, "hung", "no progress since 00:00:00")
    once = st.apply_journal(s, [hung, resumed])
    again = st.apply_journal(once, [resumed, hung])
    assert again.events == once.events  # read again after the restart: nothing twice
    walls = [e.wall for e in once.events]
    assert walls == sorted(walls)  # the Events view lists them newest first, in time order
    kinds = [(e.kind, e.text) for e in once.events]
    # the restart the view saw a poll late is told just before the journal's resumption of it, as it happened
    assert kinds.index(("resumed", resumed[2])) == kinds.index(next(k for k in kinds if k[0] == "restarted")) + 1
    assert next(e.wall for e in once.events if e.kind == "restarted") < resumed[0]
    assert kinds.index(("hung", hung[2])) < kinds.index(("resumed", resumed[2]))
