"""The TUI's pure parts: the state fold, the filter, the history arrays, the poll loop, stack text."""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import replace
from pathlib import Path

import pytest
from queue_source import QueueSource
from rankscope.contract.ranks import compact_ranks
from rankscope.contract.snapshot import Frame, JobSnapshot, ProcessRole, ProcessStack, RankInfo, RankStacks, ThreadStack
from rankscope.tui import digest as dg
from rankscope.tui import filter as flt
from rankscope.tui import health as hl
from rankscope.tui import schedule, story
from rankscope.tui import state as st
from rankscope.tui.analysis import build_stack_view, rank_stack_lines
from rankscope.tui.app import AppOptions, RankscopeApp
from rankscope.tui.series import Series
from rankscope.tui.sources import poll_loop
from rankscope.tui.widgets import sparkline as spk
from tui_bundles import T0, fig7_bundle, job, lost_series
from tui_screen import screen_text, until

pytestmark = pytest.mark.timeout(60)


def fold(snaps: tuple[JobSnapshot, ...], hang_after_s: float = 30.0) -> st.AppState:
    s = st.AppState(hang_after_s=hang_after_s)
    for snap in snaps:
        s = st.apply_poll(s, dg.digest(snap), snap.captured.wall)  # the app's handling of a poll
    return s


def test_the_state_is_a_function_of_the_snapshots() -> None:
    snaps = fig7_bundle().snapshots
    a, b = fold(snaps), fold(snaps)
    assert a.machines == b.machines and a.comms == b.comms and a.events == b.events
    assert a.metric_history.get("node09/gpu1") == b.metric_history.get("node09/gpu1")
    h = hl.health(a)
    assert h.kind == "hung" and "46 s" in h.text  # progress stopped at T0+2, the last snapshot is T0+48
    assert [e.kind for e in a.events] == ["hung"]


def test_lost_and_found_machines_keep_their_ranks_and_are_logged() -> None:
    first, lost, back = lost_series()
    s = fold((first, lost))
    node05 = next(m for m in s.machines if m.name == "node05")
    assert not node05.reachable and node05.ranks == (10, 11)  # the map keeps its shape
    assert s.lost == ("node05",)
    s = st.apply_poll(s, dg.digest(back), back.captured.wall)
    assert s.lost == ()
    assert [e.kind for e in s.events] == ["lost", "found"]


def test_ccl_digest_marks_the_laggard_and_open_requests() -> None:
    d = dg.digest(fig7_bundle().latest)
    pp24 = next(c for c in d.comms if c.comm_id == "pp24")
    assert pp24.mismatch
    rows = {r.rank: r for r in pp24.rows}
    assert rows[30].lags and not rows[24].lags
    assert rows[26].open_requests and rows[28].open_requests and not rows[24].open_requests
    assert not next(c for c in d.comms if c.comm_id == "pp0").mismatch


def test_metric_outliers_are_flagged_and_listed_first() -> None:
    d = dg.digest(fig7_bundle().latest)
    first = d.metric_rows[0]
    assert (first.machine, first.gpu, first.outliers) == ("node09", 1, frozenset({"temp"}))
    assert sum(1 for r in d.metric_rows if r.outliers) == 1


def test_filter_by_rank_range_machine_and_frame_text() -> None:
    snap = fig7_bundle().latest
    s = st.apply_capture_analyzed(fold((snap,)), dg.digest(snap), build_stack_view(snap), snap.captured.wall)
    assert flt.compile_filter("24-27", s.machines, s.stacks).ranks == frozenset(range(24, 28))
    assert flt.compile_filter("r3", s.machines, s.stacks).ranks == frozenset({3})
    assert flt.compile_filter("node12", s.machines, s.stacks).ranks == frozenset({24, 25})
    assert flt.compile_filter("all_gather", s.machines, s.stacks).ranks == frozenset({30, 31})
    assert flt.compile_filter("nothing-like-this", s.machines, s.stacks).ranks == frozenset()
    assert not flt.compile_filter("  ", s.machines, s.stacks).active


def test_series_shifts_and_adds_keys() -> None:
    s = Series().pushed(("a", "b"), (1.0, 2.0)).pushed(("a", "b"), (3.0, 4.0))
    assert s.get("a") == (1.0, 3.0) and s.get("b") == (2.0, 4.0)
    s2 = s.pushed(("b", "c"), (5.0, 6.0))
    assert s2.get("a") == (1.0, 3.0) and s2.get("b") == (2.0, 4.0, 5.0) and s2.get("c") == (6.0,)
    assert s.get("b") == (2.0, 4.0)  # the older series is unchanged
    assert spk.sparkline([0, 1, 2, 3, 4, 5, 6, 7]) == "▁▂▃▄▅▆▇█"
    assert compact_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


async def test_poll_loop_never_overlaps_and_survives_a_failing_poll() -> None:
    class SlowSource(QueueSource):
        def __init__(self) -> None:
            super().__init__("slow")
            self.running = 0
            self.most = 0
            self.calls = 0

        async def poll(self) -> JobSnapshot | None:
            self.calls += 1
            self.running += 1
            self.most = max(self.most, self.running)
            try:
                await asyncio.sleep(0.03)  # slower than the interval
                if self.calls == 2:
                    raise ConnectionError("agent went away")
                return job(T0 + self.calls, stacks=False, step=self.calls, hung=False)
            finally:
                self.running -= 1

    source = SlowSource()
    got: list[JobSnapshot] = []
    errors: list[BaseException] = []

    async def deliver(snap: JobSnapshot) -> None:
        got.append(snap)

    task = asyncio.create_task(poll_loop(source, deliver, 0.001, errors.append))
    deadline = asyncio.get_running_loop().time() + 10
    while len(got) < 4 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert source.most == 1
    assert len(got) >= 4 and [type(e) for e in errors] == [ConnectionError]
    assert [s.captured.wall for s in got[:3]] == [T0 + 1, T0 + 3, T0 + 4]


def test_rank_stack_text_has_threads_subprocesses_and_readable_source_lines() -> None:
    here = Path(inspect.getsourcefile(test_rank_stack_text_has_threads_subprocesses_and_readable_source_lines) or "")
    line = inspect.getsourcelines(test_rank_stack_text_has_threads_subprocesses_and_readable_source_lines)[1]
    main = ProcessStack(7, ProcessRole.MAIN, (ThreadStack(1, (Frame("test_fn", str(here), line + 1),), "MainThread"),
                                               ThreadStack(2, (Frame("poll", "/nowhere.py", 3),), "pin_memory")))
    worker = ProcessStack(8, ProcessRole.DATALOADER, None, name="worker")
    text = "\n".join(rank_stack_lines(RankStacks(3, main, (worker,))))
    assert "thread MainThread" in text and "thread pin_memory" in text
    assert "here = Path(inspect.getsourcefile" in text  # the line of the frame, read from the file
    assert "process 8 [dataloader] worker" in text


def test_the_rank_screen_styles_each_line_by_what_it_shows_not_by_its_words() -> None:
    from rankscope.contract.snapshot import CaptureError, CaptureErrorKind
    from rankscope.tui.screens.rank import rank_text

    # A thread named like a process line and a frame named like a fix must keep their own styles.
    main = ProcessStack(7, ProcessRole.MAIN, (ThreadStack(1, (Frame("fix: later", "/nowhere.py", 3),), "process 9"),))
    worker = ProcessStack(8, ProcessRole.DATALOADER, None, name="worker",
                          error=CaptureError(CaptureErrorKind.PERMISSION, "ptrace refused", "run as root"))
    text = rank_text(3, "m0", "TP group 1", RankStacks(3, main, (worker,)))
    styles = {text.plain[s.start:s.end].strip(): str(s.style) for s in text.spans}
    assert styles["process 7 [main]"] == "bold cyan" and styles["process 8 [dataloader] worker"] == "bold cyan"
    assert styles["thread process 9"] == "bold"
    assert "fix: later (/nowhere.py:3)" not in styles  # a frame: unstyled, whatever its name says
    assert styles["no stack: permission: ptrace refused"] == "yellow" and styles["fix: run as root"] == "yellow"


async def test_two_tuis_fed_the_same_snapshots_draw_the_same_screen() -> None:
    screens = []
    for _ in range(2):
        first, lost, _back = lost_series()
        source = QueueSource("agents", initial=(first,))
        app = RankscopeApp(source, AppOptions(poll_interval_s=0.01, capture_on_start=False), clock=lambda: T0 + 9)
        async with app.run_test(size=(100, 30)) as pilot:
            await app.loaded.wait()
            source.push_poll(lost)
            while app.state.polls < 2:
                await pilot.pause(0.02)
            await pilot.pause()
            screens.append(screen_text(app))
    assert screens[0] == screens[1]
    assert "1 lost" in screens[0]


async def test_fail_slow_mode_captures_every_ten_seconds() -> None:
    source = QueueSource("agents", initial=(job(T0, stacks=False, step=1, hung=False),))
    clock = [T0]
    app = RankscopeApp(source, AppOptions(poll_interval_s=0.01, capture_on_start=False, fail_slow=True),
                       clock=lambda: clock[0])
    async with app.run_test(size=(100, 30)) as pilot:
        await app.loaded.wait()
        for i, wall in enumerate((T0 + 1, T0 + 12, T0 + 15, T0 + 23)):
            clock[0] = wall
            source.push_capture(job(wall + 0.5, stacks=True, step=i + 2, hung=False))
            source.push_poll(job(wall, stacks=False, step=i + 2, hung=False))
            while not any(p[0] == wall for p in app.state.progress_points):  # this poll is folded in
                await pilot.pause(0.02)
            # every capture started so far has been folded into the state
            while app.state.capturing or sum(e.kind == "capture" for e in app.state.events) < source.captures_started:
                await pilot.pause(0.02)
        # At the first poll (none before), at T0+12 (10.5 s after the capture of T0+1.5), not at T0+15,
        # then at T0+23 (10.5 s after T0+12.5).
        assert source.captures_started == 3, [(e.wall - T0, e.kind) for e in app.state.events]


def _restarted_on_standby(wall: float, step: int) -> JobSnapshot:
    """The job after node05 was evicted: its ranks 10-11 run on standby-0, every rank under a new pid."""
    from dataclasses import replace

    snap = job(wall, stacks=False, step=step, hung=False, lost=(5,))
    machines = []
    for m in snap.machines:
        ranks = tuple(replace(r, pid=r.pid + 50_000) for r in m.ranks)
        if m.machine == "node05":
            machines.append(replace(m, ranks=()))
            machines.append(replace(m, machine="standby-0", address="standby-0:50051", reachable=True, error=None,
                                    ranks=tuple(RankInfo(r, r % 2, 32, 60_000 + r) for r in (10, 11))))
        else:
            machines.append(replace(m, ranks=ranks))
    return replace(snap, machines=tuple(machines))


def test_an_evicted_machine_is_out_of_the_job_and_the_restart_is_seen() -> None:
    from dataclasses import replace

    first = job(T0, stacks=False, step=100, hung=False)
    s = fold((first,))
    s = st.apply_evicted(s, ["node05"], T0 + 1)
    node05 = next(m for m in s.machines if m.name == "node05")
    assert node05.evicted and node05.ranks == () and s.machines[-1] is node05  # listed last, holding no ranks
    assert len(s.job_machines) == 15 and s.lost == ()
    assert st.apply_evicted(s, ["node05"], T0 + 2) is s  # the same record seen again changes nothing

    # Every agent is restarted with the job (the drill's agents are scoped to a torchrun pid): unreachable a while.
    gone = job(T0 + 30, stacks=False, step=100, hung=False, lost=tuple(range(16)))
    s = st.apply_poll(s, dg.digest(gone), T0 + 30)
    assert s.restarts == 0 and s.lost == () and len(s.restarting) == 15  # restarting with the job, not lost
    # They answer again before the new ranks exist: no ranks seen is not yet a restart.
    between = replace(job(T0 + 35, stacks=False, step=0, hung=False, lost=(5,)),
                      machines=tuple(replace(m, ranks=()) for m in gone.machines))
    between = replace(between, machines=tuple(replace(m, reachable=m.machine != "node05") for m in between.machines))
    s = st.apply_poll(s, dg.digest(between), T0 + 35)
    assert s.restarts == 0
    # node05's agent stays gone; the job runs again with a standby, every rank under a new pid.
    s = st.apply_poll(s, dg.digest(_restarted_on_standby(T0 + 40, 96)), T0 + 40)
    assert s.restarts == 1 and s.lost == ()
    assert [e.kind for e in s.events][-2:] == ["evicted", "restarted"]  # agents away for the restart: no rows
    assert "standby-0" in s.events[-1].text and "node05" not in s.events[-1].text
    # The ranks that moved, said in words; only those: the others ran on their machines before the agents went.
    assert s.events[-1].text.endswith("its ranks run under new pids; ranks 10-11 now on standby-0"), s.events[-1].text
    assert s.events[-1].text.startswith("the job restarted on node00, node01,")
    assert s.progress_points == ((T0 + 40, s.progress_points[0][1]),)  # counters start again in new processes
    assert hl.health(s).kind != "hung"  # 40 s without the old counters moving is not a hang
    assert next(m for m in s.machines if m.name == "node05").evicted
    # The same pids again is the same job, not another restart.
    s = st.apply_poll(s, dg.digest(_restarted_on_standby(T0 + 41, 97)), T0 + 41)
    assert s.restarts == 1


def test_a_restart_seen_before_every_agent_is_back_names_the_silent_machines() -> None:
    from dataclasses import replace

    s = fold((job(T0, stacks=False, step=100, hung=False),))
    s = st.apply_evicted(s, ["node05"], T0 + 1)
    # A warm restart: the ranks run again before node07's agent answers (agents restart after the nodes).
    back = _restarted_on_standby(T0 + 10, 96)
    back = replace(back, machines=tuple(replace(m, reachable=False, ranks=()) if m.machine == "node07" else m
                                        for m in back.machines))
    s = st.apply_poll(s, dg.digest(back), T0 + 10)
    assert s.restarts == 1 and s.events[-1].kind == "restarted"
    text = s.events[-1].text
    assert "standby-0, node06, node08" in text and "node07 (agent not back yet)" in text
    assert "node05" not in text  # evicted: not waited for


def test_no_ranks_anywhere_is_idle_not_hung() -> None:
    from dataclasses import replace

    first = job(T0, stacks=False, step=100, hung=False)
    ended = replace(first, captured=replace(first.captured, wall=T0 + 60),
                    machines=tuple(replace(m, ranks=(), counters=()) for m in first.machines))
    s = fold((first, ended))
    assert hl.health(s).kind == "idle" and hl.health(s).text == "no ranks running"


def test_one_reading_is_not_called_healthy_and_a_confident_slow_machine_is_in_the_header() -> None:
    from rankscope.tui.widgets.verdict import header_text

    s = fold((job(T0, stacks=False, step=100, hung=False),))
    assert hl.health(s).kind == "unknown"  # one reading: nothing is known about progress yet
    s = fold(lost_series())
    assert hl.health(s).kind == "healthy"
    line = header_text(s, "16 agents", False, slow_machine="node09").plain.splitlines()[0]
    # The machines before the time (an 80-column screen cuts the end); three polls show no rhythm yet: the ceiling.
    assert line == ("slow: node09 (fail-slow, key 7) │ 16/16 machines │ 1.00 steps/s │ step 0 s ago, hang at 30 s "
                    "(no rhythm yet)"), line
    # On a narrower screen (the padding takes 2 columns) the line says less until it fits, the countdown whole:
    # first without the rhythm's basis, then without the step rate (the Metrics and Fail-slow views show it).
    assert header_text(s, "16 agents", False, slow_machine="node09", width=100).plain.splitlines()[0] == \
        "slow: node09 (key 7) │ 16/16 machines │ 1.00 steps/s │ step 0 s ago, hang at 30 s"
    s = st.apply_evicted(s, ["node15", "node14"], T0 + 3)
    assert header_text(s, "16 agents", False, slow_machine="machine-09", width=80).plain.splitlines()[0] == \
        "slow: machine-09 (key 7) │ 14/14 machines 2 evicted │ step 0 s ago, hang at 30 s"


def test_a_capture_a_few_milliseconds_after_a_poll_is_no_step_rate() -> None:
    s = st.AppState()
    for i in range(8):  # 1 step/s, one poll a second; a capture 5 ms after the last poll has moved 3 steps on
        snap = job(T0 + i, stacks=False, step=100 + i, hung=False)
        s = st.apply_poll(s, dg.digest(snap), T0 + i)
    capture = job(T0 + 7.005, stacks=False, step=110, hung=False)
    s = st.apply_poll(s, dg.digest(capture), T0 + 7.005)
    assert hl.health(s).kind == "healthy", hl.health(s)  # not "slow: 1 steps/s, was 600"


def test_a_capture_of_a_job_making_steps_names_no_suspect() -> None:
    # A view attached to a healthy job, and a restart's first step, captured ranks mid-step and listed "DESYNC ...
    # evicting machines will not cure it" and eight more suspects for a job running at 5 steps/s.
    from rankscope.tui.widgets.verdict import verdict_text_rich

    snap = fig7_bundle().latest
    view = build_stack_view(snap, snap.layout)
    n = len(view.verdict.suspects)
    assert n >= 1
    hung_text = verdict_text_rich(view, flt.Filter("", frozenset()), progressing=False, taken=T0 + 48)
    running_text = verdict_text_rich(view, flt.Filter("", frozenset()), progressing=True, taken=T0 + 48)
    hung, running = hung_text.plain, running_text.plain
    assert hung.startswith("verdict: ") and "▸" in hung and "node12" in hung
    # No count of differences: it is timing too, and a pair capturing a moment later counted other numbers.
    assert running.startswith(f"capture of {hl.fmt_time(T0 + 48)}:\n no verdict: the job was making progress, so "
                              "the differences between its ranks' stacks"), running
    assert "timing, not a fault (y copies them)" in running
    assert "▸" not in running and "node12" not in running, "no suspect of a running job is drawn"
    assert {str(span.style) for span in running_text.spans if span.start > running.index(":")} == {"dim"}
    assert "bold yellow" in {str(span.style) for span in hung_text.spans}
    stale = verdict_text_rich(view, flt.NO_FILTER, progressing=True, stale="the job progressed after it",
                              taken=T0 + 48).plain
    # A capture that named no verdict has no verdict to go stale: no "stale" mark over its "no verdict".
    assert stale.startswith(f"capture of {hl.fmt_time(T0 + 48)}:\n no verdict"), stale
    assert "stale" not in stale


def test_a_capture_is_of_a_running_job_only_while_it_steps() -> None:
    """The mark follows the job's own steps: the first seconds of a hang (still "healthy" until --hang-after)
    keep their suspects; a capture one second after a step names none; so does the Events line."""
    polls = [job(T0 + i, stacks=False, step=100 + i, hung=False) for i in range(10)]
    s = st.AppState()
    for p in polls:
        s = st.apply_poll(s, dg.digest(p), p.captured.wall)
    assert hl.making_steps(s)
    capture = job(T0 + 10, stacks=True, step=110, hung=True)
    running = st.apply_capture_analyzed(s, dg.digest(capture), build_stack_view(capture, capture.layout), T0 + 10)
    assert running.verdict is not None and running.verdict.running
    assert running.events[-1].kind == "verdict" and running.events[-1].text.startswith("no verdict: the job was")
    # Two views capturing a running job a moment apart log the same words: no count of groups, which is timing.
    assert running.events[-2].text == "captured 32 ranks' stacks of a job making steps"
    # Five seconds without a step: not hung yet (the job's rhythm of 1 s steps makes 6 s a hang), nor "healthy":
    # stalled, and not stepping.
    for i in range(10, 16):  # (the first poll of the stop still moved the operation counters)
        s = st.apply_poll(s, dg.digest(job(T0 + i, stacks=False, step=109, hung=True)), T0 + i)
    assert hl.health(s) == hl.Health("stalled", "no progress for 5 s") and not hl.making_steps(s)
    capture = job(T0 + 16, stacks=True, step=109, hung=True)
    stuck = st.apply_capture_analyzed(s, dg.digest(capture), build_stack_view(capture, capture.layout), T0 + 16)
    assert stuck.verdict is not None and not stuck.verdict.running
    assert stuck.stacks is not None and stuck.events[-1].text == stuck.stacks.verdict.summary


def test_slow_is_measured_against_the_usual_pace_not_one_quick_reading() -> None:
    s = st.AppState()
    steps = 100
    for i in range(12):  # a steady 2 steps/s with one quick pair (6 steps in a second) early on
        steps += 6 if i == 2 else 2
        s = st.apply_poll(s, dg.digest(job(T0 + i, stacks=False, step=steps, hung=False)), T0 + i)
    assert hl.health(s).kind == "healthy", hl.health(s)
    for i in range(12, 23):  # then a step every other second: a quarter of the usual pace, over the header's window
        steps += 1 if i % 2 else 0
        s = st.apply_poll(s, dg.digest(job(T0 + i, stacks=False, step=steps, hung=False)), T0 + i)
    h = hl.health(s)
    assert h.kind == "slow" and h.text == "slow: 0.50 steps/s, usually 1.50", h
    # The header's rate is the same number: "slow: 0.00 steps/s, usually 1.37 │ 2.81 steps/s" said two things.
    from rankscope.tui.widgets.verdict import header_text
    assert header_text(s, "x", False).plain.startswith("slow: 0.50 steps/s, usually 1.50 │ 16/16 machines │ 0.50 steps/s")


def test_no_progress_counts_to_the_hang_threshold_and_the_capture_and_is_never_healthy() -> None:
    from rankscope.tui.widgets.verdict import header_text

    s = st.AppState()
    for i in range(10):  # 1 step/s
        s = st.apply_poll(s, dg.digest(job(T0 + i, stacks=False, step=100 + i, hung=False, step_s=1.0)), T0 + i)
    assert hl.health(s).kind == "healthy" and hl.recent_step_rate(s) == 1.0
    # The job's rhythm (1 s steps, as its counters time them) sets the threshold: 3 of its longest steps, at least
    # 6 s (was a fixed 30 s).
    assert s.hang_threshold_s == 6.0
    for i in range(10, 16):  # then no step at all (the first poll of the stop still moved the operation counters)
        s = st.apply_poll(s, dg.digest(job(T0 + i, stacks=False, step=109, hung=True, step_s=1.0)), T0 + i)
    line = header_text(s, "x", False).plain.splitlines()[0]
    assert line.startswith("no progress for 5 s │ 16/16 machines │ ") and \
        line.endswith("│ hang + capture in 1 s (3× its 1.0 s step)"), line
    s = st.apply_poll(s, dg.digest(job(T0 + 16, stacks=False, step=109, hung=True, step_s=1.0)), T0 + 16)
    assert hl.health(s).kind == "hung" and schedule.hang_capture_due(s)
    assert "│ 0.00 steps/s │ capture due" in header_text(s, "x", False).plain
    assert [e.text for e in s.events if e.kind == "hung"] == [f"no progress since {hl.fmt_time(T0 + 10)}"]


def test_a_healthy_job_with_long_and_uneven_steps_is_never_called_hung() -> None:
    # 1 s steps with a 5 s checkpoint save every 8th step, then a job of 12 s steps: judged by their own rhythm.
    # During a save every rank is between collectives (all completed, counters still): the ceiling judges it.
    s = st.AppState()
    wall, step = T0, 100
    for i in range(40):
        took = 5.0 if i % 8 == 7 else 1.0
        wall += took
        step += 1
        for t in range(int(wall - took) + 1, int(wall)):  # the polls in between
            s = st.apply_poll(s, dg.digest(job(t, stacks=False, step=step - 1, hung=False, step_s=1.0)), t)
            assert hl.health(s).kind != "hung", (i, t, hl.health(s))
            assert s.hang_threshold_s == 30.0 and s.hang.basis() == "--hang-after", (i, t, s.hang)
        s = st.apply_poll(s, dg.digest(job(wall, stacks=False, step=step, hung=False, step_s=took)), wall)
    # The last step was a save's (5 s, timed by the ranks' counters), the job moves: 3 of it.
    assert s.hang_threshold_s == 15.0 and s.hang.longest_gap_s == 5.0
    assert not any(e.kind == "hung" for e in s.events)
    slow = st.AppState()
    for i in range(8):  # 12 s steps: 36 s would be the rhythm's threshold, the --hang-after ceiling is 30 s
        slow = st.apply_poll(slow, dg.digest(job(T0 + 12 * i, stacks=False, step=100 + i, hung=False, step_s=12.0)),
                             T0 + 12 * i)
    assert slow.hang_threshold_s == 30.0 and slow.hang.basis() == "--hang-after"


def test_metric_outliers_fire_with_four_machines() -> None:
    """The hot GPU of four one-GPU machines is flagged (a mean + 2σ over four rows never can be: z ≤ 1.5)."""
    snap = job(T0, stacks=False, step=1, hung=False, hot_machine=2)
    ms = tuple(replace(m, gpus=replace(m.gpus, gpus=m.gpus.gpus[1:])) if m.gpus is not None else m
               for m in snap.machines[:4])
    snap = JobSnapshot(snap.captured, ms, job_id=snap.job_id, layout=snap.layout)
    flagged = [(r.machine, r.gpu, r.outliers) for r in dg.digest(snap).metric_rows if r.outliers]
    assert flagged == [("node02", 1, frozenset({"temp"}))]


def test_metric_outliers_compare_a_host_reading_with_other_machines_only() -> None:
    """A machine's GPU rows repeat its host reading: they are not its peers, so one busy host among four stands out."""
    snap = job(T0, stacks=False, step=1, hung=False)
    ms = list(snap.machines[:4])
    host = ms[3].host
    assert host is not None
    ms = [replace(m, host=replace(m.host, cpu_percent=40.0)) if m.host is not None else m for m in ms]
    ms[3] = replace(ms[3], host=replace(host, cpu_percent=97.0))
    rows = dg.digest(JobSnapshot(snap.captured, tuple(ms), job_id=snap.job_id, layout=snap.layout)).metric_rows
    assert {(r.machine, r.gpu) for r in rows if "cpu" in r.outliers} == {("node03", 0), ("node03", 1)}


def test_a_metric_outlier_is_told_by_text_with_its_direction_and_its_peers() -> None:
    from rankscope.tui.widgets.metrics import column_medians, render_row

    rows = (
        dg.MetricRow("m0/gpu0", "m0", 0, True, (0,), (50.0, 40.0, 1.0, 95.0, 70.0, 99.0, 650.0), frozenset({"temp"})),
        *(dg.MetricRow(f"m{i}/gpu0", f"m{i}", 0, True, (i,), (50.0, 40.0, 1.0, 95.0, 70.0, 61.0, 650.0),
                       frozenset()) for i in range(1, 4)),
    )
    medians = column_medians(rows)
    cells = render_row(rows[0], Series(), medians)
    hot = cells[2 + dg.METRICS.index("temp")]
    assert str(hot) == "99▲", hot  # above the others: the arrow says it without colour


@pytest.mark.parametrize("read_only", [False, True], ids=["acting view", "pair view"])
async def test_the_step_the_job_resumed_from_is_read_from_the_journal_however_late_it_is_written(
        read_only: bool) -> None:
    """The drill's recovery writes "resumed from step N ..., code ..." to the agents' journal once its agents are
    back, which can be long after a view saw the restart; a view reads the journal on its polls while the story may
    still change and shows the entry in Events, in time order, once. (The views read it at the restart and 5 s
    later: an entry written after that never reached the read-only view.)"""
    from rankscope.actions.journal import JournalEntry
    from rankscope.tui import schedule

    class JournalSource(QueueSource):
        def __init__(self) -> None:
            super().__init__("agents", initial=(job(T0, stacks=False, step=100, hung=False),))
            self.story: list[JournalEntry] = [JournalEntry(T0 - 30, "hung", "no progress since 00:00:00", "alice")]
            self.reads = 0
            self.late: JournalEntry | None = None  # written once this many more reads have returned
            self.late_after = 0

        async def journal(self, entries: tuple[JournalEntry, ...] = ()) -> tuple[JournalEntry, ...]:
            self.story = sorted({(e.wall, e.kind, e.text): e for e in (*self.story, *entries)}.values(),
                                key=lambda e: e.wall)
            self.reads += not entries
            told = tuple(self.story)
            if not entries and self.late is not None:
                self.late_after -= 1
                if self.late_after == 0:
                    self.story.append(self.late)
            return told

    source = JournalSource()
    clock = [T0 + 1]
    app = RankscopeApp(source, AppOptions(poll_interval_s=0.01, capture_on_start=False, read_only=read_only),
                       clock=lambda: clock[0])
    text = ("the job resumed from step 96 (the newest checkpoint every rank saved) on node00 standby-0 "
            "(standby-0 joined) after evicting node05, code git:v2 (bbbb)")
    async with app.run_test(size=(160, 40)) as pilot:
        await until(pilot, lambda: source.reads == 1 and any(e.kind == "hung" for e in app.state.events), 10,
                    "the journal read at attach")
        # The restart is seen long before the drill writes its entry: only after the third read from the restart on.
        source.late, source.late_after = JournalEntry(T0 + 52.5, "resumed", text, "rankscope drill"), 3
        for i in range(12):  # a poll every JOURNAL_EVERY_S of the view's clock, the job stepping on standby-0
            clock[0] = T0 + 40 + i * schedule.JOURNAL_EVERY_S
            reads = source.reads
            source.push_poll(_restarted_on_standby(clock[0], 96 + i))
            await until(pilot, lambda before=reads: source.reads > before, 10, f"a journal read at poll {i}")
        assert app.state.restarts == 1
        await until(pilot, lambda: any(e.text == text for e in app.state.events), 10, "the resumed entry in Events")
        assert sum(e.text == text for e in app.state.events) == 1, "later reads add nothing twice"
        walls = [e.wall for e in app.state.events]
        assert walls == sorted(walls), [(e.wall - T0, e.kind) for e in app.state.events]
        kinds = [e.kind for e in app.state.events]
        assert kinds.index("hung") < kinds.index("restarted") < kinds.index("resumed")
        await pilot.press("5")
        await pilot.pause()
        lines = screen_text(app).splitlines()
        first = next(i for i, line in enumerate(lines) if "resumed from step 96" in line)
        assert any("the job restarted on" in line for line in lines[first + 1:]), "newest first"
        if not read_only:  # the acting view writes its own moments; the drill's entry is not written back
            assert sum(e.text == text for e in source.story) == 1


def test_a_view_reads_the_journal_while_the_story_may_change_and_then_no_more() -> None:
    """Reads every JOURNAL_EVERY_S while the job restarts and until JOURNAL_FOLLOW_S after the story's newest moment;
    a job training quietly since costs its agents no journal reads."""
    from rankscope.tui import schedule

    s = replace(st.AppState(), now_wall=T0 + 100)
    assert not schedule.journal_read_due(s, None), "no story yet"
    assert schedule.journal_read_due(replace(s, awaiting_restart=True), T0 + 100 - schedule.JOURNAL_EVERY_S)
    assert not schedule.journal_read_due(replace(s, awaiting_restart=True), T0 + 99.5), "not sooner than every 2 s"
    told = replace(s, events=(story.Event(T0 + 50, "resumed", "the job resumed from step 96"),
                              story.Event(T0 + 99, "capture", "captured 32 ranks' stacks of a job making steps")))
    assert schedule.journal_read_due(told, T0 + 90)
    quiet = replace(told, now_wall=T0 + 50 + schedule.JOURNAL_FOLLOW_S + 1)
    assert not schedule.journal_read_due(quiet, T0 + 90), "captures of a running job are no story"


def test_the_capture_event_counts_the_ranks_the_verdict_could_compare() -> None:
    """ "captured 4 ranks' stacks, 1 groups" stood beside "no verdict: all 1 ranks show the same stacks": the
    ranks whose stacks could not be read were counted as captured."""
    from rankscope.contract.snapshot import CaptureError, CaptureErrorKind

    capture = job(T0 + 10, stacks=True, step=110, hung=True)
    gone = CaptureError(CaptureErrorKind.GONE, "the process exited", "capture again")
    machines = tuple(replace(m, stacks=tuple(replace(rs, main=ProcessStack(rs.main.pid, ProcessRole.MAIN, None, gone))
                                             if rs.rank >= 4 else rs for rs in m.stacks))
                     for m in capture.machines)
    capture = replace(capture, machines=machines)
    view = build_stack_view(capture, capture.layout)
    read = sum(len(g.ranks) for g in view.groups)
    assert read == 4, read
    s = st.apply_capture_analyzed(st.AppState(), dg.digest(capture), view, T0 + 10)
    event = next(e for e in s.events if e.kind == "capture")
    assert event.text.startswith(f"captured 32 ranks' stacks, 4 readable in {len(view.groups)} group")
    assert "28 could not be read" in event.text
    whole = st.apply_capture_analyzed(st.AppState(), dg.digest(job(T0, stacks=True, step=110, hung=True)),
                                      build_stack_view(job(T0, stacks=True, step=110, hung=True)), T0)
    assert next(e for e in whole.events if e.kind == "capture").text.startswith("captured 32 ranks' stacks, ")
    assert "could not be read" not in next(e for e in whole.events if e.kind == "capture").text
