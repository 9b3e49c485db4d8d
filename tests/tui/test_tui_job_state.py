"""One story of the incident: the job's state from the agents' memory, verdict staleness, membership after actions.

The snapshots here carry what a real agent adds to each reading
(rankscope.wire.rank_progress: each rank's last progress and start, the
machine's generation and when it last saw ranks), so these are the numbers
every view, attached early or late, computes its header from.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from rankscope.contract.snapshot import (
    CaptureError,
    CaptureErrorKind,
    Frame,
    Instant,
    JobSnapshot,
    MachineSnapshot,
    ProcessRole,
    ProcessStack,
    RankCounters,
    RankInfo,
    RankStacks,
    ThreadStack,
)
from rankscope.tui import digest as dg
from rankscope.tui import filter as flt
from rankscope.tui import health as hl
from rankscope.tui import staleness, story
from rankscope.tui import state as st
from rankscope.tui.analysis import build_stack_view
from rankscope.tui.widgets.metrics import render_row
from rankscope.tui.widgets.verdict import header_text, verdict_text_rich

pytestmark = pytest.mark.timeout(60)

T0 = 1_700_000_000.0
MACHINES = ("machine-0", "machine-1")


def snap(wall: float, *, progress: float | None, started: float = T0 - 100, pids: int = 1000,
         ranks: bool = True, seen: float | None = None, stacks: str | None = None,
         unreachable: tuple[str, ...] = (), extra: tuple[MachineSnapshot, ...] = ()) -> JobSnapshot:
    """Two machines of two ranks each; ``progress``: the ranks' last step per the agent (None: none yet)."""
    ms = []
    for i, name in enumerate(MACHINES):
        address = f"127.0.0.1:{59990 + i}"
        if name in unreachable:
            ms.append(MachineSnapshot(name, address, False, None))
            continue
        infos = tuple(RankInfo(r, r % 2, 4, pids + r, last_progress_wall=progress, started_wall=started)
                      for r in (2 * i, 2 * i + 1)) if ranks else ()
        # The plugin's step counters: they tell a rank before its first step from one whose state is unknown.
        counters = tuple(RankCounters(r.rank, r.pid, 4, None, None, steps=0 if progress is None else 9,
                                      last_step_wall=progress) for r in infos)
        st_ = ()
        if stacks is not None and ranks:
            st_ = tuple(RankStacks(r.rank, ProcessStack(r.pid, ProcessRole.MAIN, (ThreadStack(
                1, (Frame("recv" if r.rank == 3 else stacks, "train.py", 5), Frame("main", "train.py", 1)),
                "MainThread"),))) for r in infos)
        ms.append(MachineSnapshot(name, address, True, Instant(wall, wall - T0), ranks=infos, stacks=st_,
                                  counters=counters, generation=1, ranks_seen_wall=wall if ranks else seen))
    return JobSnapshot(Instant(wall, wall - T0), (*ms, *extra))


def fold(snaps: list[JobSnapshot], state: st.AppState | None = None) -> st.AppState:
    # The app's handling of a loaded series: each capture with its analysis, each poll as its readings.
    return st.apply_series(state or st.AppState(), ((dg.digest(x), build_stack_view(x, None) if x.all_stacks() else None,
                                                     x.captured.wall) for x in snaps))


def header(s: st.AppState) -> str:
    return header_text(s, "2 agents", False).plain.splitlines()[0]


def test_a_view_attached_late_says_what_the_view_that_watched_says_within_a_poll() -> None:
    # Steps until T0+10, then nothing: the early view watched it all, the late one attaches at T0+190.
    early = fold([snap(T0 + i, progress=T0 + min(i, 10)) for i in range(0, 191)])
    late = fold([snap(T0 + 190, progress=T0 + 10)])
    assert hl.health(early) == hl.health(late)  # from its first poll on
    late = fold([snap(T0 + 191, progress=T0 + 10)], late)
    early = fold([snap(T0 + 191, progress=T0 + 10)], early)
    assert hl.health(late).kind == "hung" and hl.health(late).text == "hung since 22:13:30 (181 s)"
    assert header(early) == header(late)
    assert header(late).startswith("HUNG since 22:13:30")
    # Before the hang passes --hang-after a late view reads "progressing" from the agents, not its own window.
    assert hl.health(fold([snap(T0 + 20, progress=T0 + 19)])).kind == "healthy"


def test_a_hung_job_makes_no_steps_per_second_in_any_view() -> None:
    def stepping(wall: float, last_step: int) -> JobSnapshot:
        got = snap(wall, progress=T0 + last_step)
        return replace(got, machines=tuple(replace(m, counters=tuple(replace(c, steps=last_step) for c in m.counters))
                                           for m in got.machines))

    # The early view's window holds the steps before the hang; the late one's only the hang.
    early = fold([stepping(T0 + i, min(i, 10)) for i in range(1, 46)])
    late = fold([stepping(T0 + 44, 10), stepping(T0 + 45, 10)])
    assert hl.step_rate(early) is not None and hl.step_rate(early) > 0.1  # type: ignore[operator]
    assert header(early) == header(late)
    assert header(late).startswith("HUNG since 22:13:30 (35 s) │ 2/2 machines │ 0.00 steps/s │ capture due"), \
        header(late)


def test_the_backup_modal_of_a_hung_job_says_first_that_no_shard_will_come() -> None:
    from rankscope.tui.actions import backup_title

    assert backup_title(fold([snap(T0 + 20, progress=T0 + 19)])) == "Checkpoint backup"
    hung = backup_title(fold([snap(T0 + 190, progress=T0 + 10)]))
    assert hung.startswith("Checkpoint backup — the job is hung since 22:13:30 (180 s): no rank reaches a step "
                           "boundary, so no shard will come"), hung


def test_ranks_before_their_first_step_are_starting_then_hung_if_they_never_step() -> None:
    s = fold([snap(T0 + 5, progress=None, started=T0)])
    assert hl.health(s) == hl.Health("starting", "starting: 4 ranks before their first step")
    s = fold([snap(T0 + 45, progress=None, started=T0)])
    assert hl.health(s).kind == "hung" and "since its start at 22:13:20" in hl.health(s).text


def test_a_verdict_goes_stale_when_the_job_progresses_restarts_or_finishes() -> None:
    hung = [snap(T0 + i, progress=T0 + 10) for i in range(40, 45)]
    s = fold([*hung, snap(T0 + 45, progress=T0 + 10, stacks="send")])
    assert s.stacks is not None and s.stacks.verdict.suspects
    assert staleness.verdict_stale(s) is None  # a capture of the hang, nothing moved since
    assert staleness.verdict_stale(fold([snap(T0 + 46, progress=T0 + 10)], s)) is None
    # Progress after the capture: the verdict is a record, not a diagnosis.
    moved = fold([snap(T0 + 50, progress=T0 + 49)], s)
    assert staleness.verdict_stale(moved) == "the job progressed after it (last step 22:14:09)"
    # A restart: new pids everywhere.
    restarted = fold([snap(T0 + 60, progress=None, started=T0 + 55, pids=2000)], s)
    assert restarted.restarts == 1
    assert staleness.verdict_stale(restarted) == "the job restarted after this capture"
    assert staleness.map_groups(s) == s.stacks.group_of_rank and set(staleness.map_groups(s)) == {0, 1, 2, 3}
    assert staleness.map_groups(moved) is s.stacks.group_of_rank  # stale, but the same processes: still their groups
    assert staleness.map_groups(restarted) == {}  # new processes: the old capture says nothing of them
    rich_text = verdict_text_rich(restarted.stacks, flt.NO_FILTER, stale=staleness.verdict_stale(restarted),
                                  taken=restarted.capture_wall)
    text = rich_text.plain
    assert text.startswith("verdict of 22:14:05 (stale: the job restarted after this capture; s captures again)")
    # Its suspects are a record, drawn dim: no alarm colour on a job that has moved on.
    first = text.index("\n")
    assert "▸" in text[first:]
    assert {str(span.style) for span in rich_text.spans if span.start >= first} == {"dim"}
    live = verdict_text_rich(s.stacks, flt.NO_FILTER, stale=None, taken=s.capture_wall)
    assert "bold yellow" in {str(span.style) for span in live.spans}, "the live verdict keeps its colours"
    # The job ends: no ranks on any machine.
    ended = fold([snap(T0 + 70, progress=None, ranks=False, seen=T0 + 69)], s)
    assert staleness.verdict_stale(ended) == "the job has no ranks running now"


def test_a_capture_of_ranks_still_starting_is_never_a_steady_state_verdict() -> None:
    s = fold([snap(T0 + 5, progress=None, started=T0), snap(T0 + 6, progress=None, started=T0, stacks="import")])
    assert s.verdict is not None and s.verdict.starting == (0, 1, 2, 3)
    assert staleness.verdict_stale(s) == "taken while ranks 0-3 were still starting"


def test_a_young_job_without_counters_that_hangs_in_its_own_code_can_be_acted_on() -> None:
    # Ranks 5 s old, no counters, caught in the pipeline (not importing, not at rendezvous): nothing says they
    # are starting, so the verdict aims `e` (the TUI's real-agent eviction test hangs exactly like this).
    young = snap(T0 + 5, progress=None, started=T0, stacks="send")
    young = replace(young, machines=tuple(replace(m, counters=()) for m in young.machines))
    s = fold([young])
    assert s.stacks is not None and s.stacks.verdict.suspects
    assert s.verdict is not None and s.verdict.starting == ()
    assert staleness.verdict_stale(s) is None


def test_without_counters_a_rank_that_never_stepped_is_unknown_unless_its_stack_shows_it_starting() -> None:
    bare = snap(T0 + 5, progress=None, started=T0)
    bare = replace(bare, machines=tuple(replace(m, counters=()) for m in bare.machines))
    # Processes 5 s old with no counter file yet (a restart's ranks importing torch): starting, not "no plugin".
    assert hl.health(fold([bare])) == hl.Health("starting", "starting: 4 ranks before their first step")
    old = replace(bare, captured=Instant(T0 + 45, 45.0),
                  machines=tuple(replace(m, captured=Instant(T0 + 45, 45.0)) for m in bare.machines))
    s = fold([old])
    assert hl.health(s).kind == "unknown" and "no counters" in hl.health(s).text
    assert not any(e.kind == "hung" for e in fold([replace(bare, captured=Instant(T0 + 90, 90.0))]).events)
    # Its stack in the import machinery says what the counters could not: a capture of it is no steady state.
    importing = snap(T0 + 6, progress=None, started=T0, stacks="x")
    frames = (Frame("_find_spec", "<frozen importlib._bootstrap>", 1), Frame("main", "train.py", 1))
    importing = replace(importing, machines=tuple(replace(m, counters=(), stacks=tuple(
        replace(rs, main=replace(rs.main, threads=(ThreadStack(1, frames, "MainThread"),))) for rs in m.stacks))
        for m in importing.machines))
    s = fold([importing], s)
    assert s.verdict is not None and s.verdict.starting == (0, 1, 2, 3)
    assert staleness.verdict_stale(s) == "taken while ranks 0-3 were still starting"


def test_ranks_caught_importing_are_starting_however_long_their_imports_take() -> None:
    # On a loaded host a restart's ranks imported for longer than --hang-after; a capture then named one of them
    # "computing" in <module> (pstats.py) and, fresh, aimed `e` at its machine.
    frames = (Frame("<module>", "pstats.py", 1), Frame("_call_with_frames_removed", "<frozen importlib._bootstrap>", 241),
              Frame("main", "train.py", 1))
    late = snap(T0 + 45, progress=None, started=T0, stacks="x")
    late = replace(late, machines=tuple(replace(m, stacks=tuple(
        replace(rs, main=replace(rs.main, threads=(ThreadStack(1, frames, "MainThread"),))) if rs.rank == 2 else rs
        for rs in m.stacks)) for m in late.machines))
    s = fold([late])
    assert s.verdict is not None and 2 in s.verdict.starting
    assert (staleness.verdict_stale(s) or "").startswith("taken while ranks"), staleness.verdict_stale(s)


def test_an_agent_silent_at_a_views_first_poll_is_one_machine_once_it_answers() -> None:
    # At load ~80 a read-only view's first poll got no answer from one agent (named by its address, the client
    # knowing no name yet); the agent answered under its name later and the header read "5/7 machines 2 lost".
    first = snap(T0, progress=T0)
    first = replace(first, machines=(first.machines[0], MachineSnapshot("127.0.0.1:59991", "127.0.0.1:59991", False,
                                                                        None)))
    s = fold([first, snap(T0 + 1, progress=T0 + 1)])
    assert sorted(m.name for m in s.machines) == ["machine-0", "machine-1"]
    assert "2/2 machines" in header(s) and "lost" not in header(s), header(s)


def test_a_capture_without_progress_marks_is_not_stale_by_the_hangs_last_step() -> None:
    hung = [snap(T0 + i, progress=T0 + 10) for i in range(40, 45)]
    s = fold(hung)
    blind = snap(T0 + 45, progress=T0 + 10, stacks="send")
    blind = replace(blind, machines=tuple(replace(m, ranks=tuple(replace(r, last_progress_wall=None) for r in m.ranks),
                                                  counters=()) for m in blind.machines))
    s = fold([blind, snap(T0 + 46, progress=T0 + 10)], s)
    assert s.verdict is not None and s.verdict.progress_mark is None
    assert staleness.verdict_stale(s) is None, staleness.verdict_stale(s)  # the last step (T0+10) came before the capture
    assert staleness.verdict_stale(fold([snap(T0 + 50, progress=T0 + 49)], s)) == \
        "the job progressed after it (last step 22:14:09)"


def test_no_ranks_is_stopping_then_finished_and_a_late_view_agrees() -> None:
    running = [snap(T0 + i, progress=T0 + i) for i in range(3)]
    s = fold([*running, snap(T0 + 10, progress=None, ranks=False, seen=T0 + 2)])
    assert hl.health(s) == hl.Health("idle", "no ranks running since 22:13:22 (stopping or restarting)")
    s = fold([snap(T0 + 40, progress=None, ranks=False, seen=T0 + 2)], s)
    assert hl.health(s) == hl.Health("finished", "finished: no ranks running since 22:13:22")
    assert "│ - steps/s" in header(s), header(s)  # the steps of the window are not a rate of a finished job
    late = fold([snap(T0 + 40, progress=None, ranks=False, seen=T0 + 2)])
    assert hl.health(late) == hl.health(s)
    never = fold([snap(T0 + 40, progress=None, ranks=False, seen=None)])
    assert hl.health(never).text == "no ranks running: the agents answer but have seen none of the job's ranks"


def test_evicted_machines_are_evicted_in_every_view_never_lost() -> None:
    s = fold([snap(T0 + i, progress=T0 + i) for i in range(3)])
    # The acting view learns it from the audit log (by machine name) ...
    by_audit = st.apply_evicted(s, ["machine-1"], T0 + 3)
    # ... a view attached later from the hostfile (by agent address); the agents are stopped either way.
    by_hostfile = st.apply_evicted(fold([snap(T0 + 3, progress=T0 + 3)]), [], T0 + 3, ["127.0.0.1:59991"])
    for view in (by_audit, by_hostfile):
        view = fold([snap(T0 + 4, progress=T0 + 4, unreachable=("machine-1",))], view)
        gone = next(m for m in view.machines if m.name == "machine-1")
        assert gone.evicted and not gone.reachable and view.lost == ()
        line = header(view)
        assert "1/1 machines 1 evicted" in line and "lost" not in line, line
        assert [e.kind for e in view.events if e.kind == "lost"] == []
        # The metrics view (4) listed it as "machine-1 lost" (the e2e test's run 4): evicted, and last.
        labels = [render_row(r, view.metric_history)[0] for r in view.metric_rows]
        assert [str(label) for label in labels] == ["machine-0", "machine-1 evicted"], labels
    # The fail-slow view (7) keeps machines it saw in its window: the evicted one is not "lost" there either.
    from rankscope.tui.failslow_state import EMPTY, HeatRow
    from rankscope.tui.widgets.failslow import heat_text

    rows = (HeatRow("machine-0", (0, 1), (1.0, 1.0), 1.0, 0.2, True),
            HeatRow("machine-1", (2, 3), (None, None), None, None, False))
    text = heat_text(replace(EMPTY, heat=rows), 100, 10, (), frozenset({"machine-1"})).plain
    assert "machine-1" in text and " evicted" in text and "lost" not in text, text
    assert " lost" in heat_text(replace(EMPTY, heat=rows), 100, 10).plain  # a machine that went away unasked


def test_agents_of_the_ranks_not_answering_is_not_a_job_without_ranks() -> None:
    standby = MachineSnapshot("standby-0", "127.0.0.1:59999", True, Instant(T0 + 5, 5.0), generation=0)
    s = fold([snap(T0 + i, progress=T0 + i, extra=(standby,)) for i in range(3)])
    s = fold([snap(T0 + 5, progress=None, ranks=False, stacks=None, extra=(standby,),
                   unreachable=MACHINES)], s)
    h = hl.health(s)
    assert h.kind == "unknown" and h.text.startswith("the agents of the job's ranks do not answer (2)"), h
    assert "no ranks running" not in h.text


def test_between_an_eviction_and_the_restart_the_job_is_restarting_not_finished() -> None:
    s = fold([snap(T0 + i, progress=T0 + i) for i in range(3)])
    s = st.apply_evicted(s, ["machine-1"], T0 + 3)
    s = fold([snap(T0 + 60, progress=None, ranks=False, seen=T0 + 4, unreachable=("machine-1",))], s)
    assert hl.health(s) == hl.Health("idle", "restarting: no ranks running since 22:13:24")
    # The launcher restarts the remaining machines' agents with the job: for a while none answers. Not "lost".
    down = fold([snap(T0 + 62, progress=None, unreachable=MACHINES)], s)
    assert hl.health(down) == hl.Health("idle", "restarting: the job's agents do not answer yet")
    assert "1 restarting 1 evicted" in header(down) and "lost" not in header(down), header(down)
    # Never "lost" for the agent the restart takes away, and no row of which agents this view found away at its
    # polls: a pair's two views listed different "restarting with the job" rows for one restart.
    assert [e.text for e in down.events if e.kind in ("lost", "restarting", "found")] == []
    s = fold([snap(T0 + 70, progress=None, started=T0 + 65, pids=3000, unreachable=("machine-1",))], s)
    assert s.restarts == 1 and not s.awaiting_restart
    assert hl.health(s).kind == "starting"


def test_a_hot_update_that_restarts_the_job_is_restarting_and_a_capture_meanwhile_says_so() -> None:
    from rankscope.actions.model import RESTART_REQUESTED, ActionKind, AuditRecord
    from rankscope.tui.analysis import build_stack_view

    s = fold([snap(T0 + i, progress=T0 + i) for i in range(3)])
    s = st.apply_audit(s, "127.0.0.1:1", AuditRecord(
        1, "hot-update-x", "alice", T0 + 3, ActionKind.HOT_UPDATE, "hot-update to v2", "succeeded",
        f"machine-0 now runs its code from v2; {RESTART_REQUESTED} from the launcher", ("machine-0",)))
    assert s.awaiting_restart
    down = fold([snap(T0 + 5, progress=None, unreachable=MACHINES)], s)
    assert "2 restarting" in header(down) and "lost" not in header(down), header(down)
    assert not [e for e in down.events if e.kind == "lost"]
    capture = snap(T0 + 6, progress=T0 + 2)
    taken = st.apply_capture_analyzed(s, dg.digest(capture), build_stack_view(capture, capture.layout), T0 + 6)
    assert staleness.verdict_stale(taken) == "taken while the job was restarting"
    # A capture while no rank runs reads nobody: no capture or verdict row (its pair, not capturing then, has none).
    empty = snap(T0 + 7, progress=None, ranks=False)
    nobody = st.apply_capture_analyzed(down, dg.digest(empty), build_stack_view(empty, empty.layout), T0 + 7)
    assert [e.kind for e in nobody.events if e.wall >= T0 + 7] == []
    assert nobody.stacks is not None and not nobody.stacks.groups
    # Nor while the ranks are still listed but each process ended during the capture: "captured 4 ranks' stacks,
    # 0 readable" and "no verdict: no rank's stacks could be read" were logged then, in one view only.
    ending = snap(T0 + 8, progress=T0 + 2)
    gone = CaptureError(CaptureErrorKind.GONE, "the process exited", process_state="gone")
    ending = replace(ending, machines=tuple(replace(m, stacks=tuple(
        RankStacks(r.rank, ProcessStack(r.pid, ProcessRole.MAIN, None, gone)) for r in m.ranks))
        for m in ending.machines))
    assert len(ending.all_stacks()) == 4
    still = st.apply_capture_analyzed(down, dg.digest(ending), build_stack_view(ending, ending.layout), T0 + 8)
    assert [e.kind for e in still.events if e.wall >= T0 + 8] == []
    # Outside a restart the same capture is news: the ranks' processes are gone.
    told = st.apply_capture_analyzed(fold([snap(T0 + 7, progress=T0 + 7)]), dg.digest(ending),
                                     build_stack_view(ending, ending.layout), T0 + 8)
    assert [e.kind for e in told.events if e.wall >= T0 + 8] == ["capture", "verdict"]
    assert "0 readable" in told.events[-2].text, told.events[-2].text



async def test_after_a_restart_the_automatic_capture_waits_for_the_first_step() -> None:
    # At load ~80 a restart's ranks imported and restored their backup for longer than --hang-after: a capture then
    # (as a hang "since its start", or because their counter files did not exist yet) caught rendezvous and import
    # stacks and drew a noisy verdict of three suspects. It must wait for the new launch's first step.
    from queue_source import QueueSource
    from rankscope.tui.app import AppOptions, RankscopeApp
    from tui_screen import until

    source = QueueSource("2 agents", initial=(snap(T0 + 39, progress=T0 + 10),))
    app = RankscopeApp(source, AppOptions(poll_interval_s=0.01, hang_after_s=30, capture_on_start=False),
                       clock=lambda: T0 + 100)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, app.loaded.is_set)
        source.push_capture(snap(T0 + 41, progress=T0 + 10, stacks="send"))
        source.push_poll(snap(T0 + 40, progress=T0 + 10))
        await until(pilot, lambda: app.state.stacks is not None)  # the hang's capture
        assert source.captures_started == 1
        no_counter_files = snap(T0 + 100, progress=None, started=T0 + 55, pids=2000)
        no_counter_files = replace(no_counter_files, machines=tuple(replace(m, counters=())
                                                                    for m in no_counter_files.machines))
        slow_start = snap(T0 + 101, progress=None, started=T0 + 55, pids=2000)  # counters, no step in 46 s
        for reading in (no_counter_files, slow_start):
            source.push_poll(reading)
            await until(pilot, lambda r=reading: app.state.kept[-1] is r)  # type: ignore[misc]  # folded in
            assert app.state.restarts == 1
            assert not app.state.capturing and source.captures_started == 1, reading.captured.wall - T0
        assert hl.health(app.state).text.startswith("hung since its start")
        source.push_capture(snap(T0 + 111, progress=T0 + 110, started=T0 + 55, pids=2000, stacks="step"))
        source.push_poll(snap(T0 + 110, progress=T0 + 110, started=T0 + 55, pids=2000))
        await until(pilot, lambda: app.state.capture_wall == T0 + 111)  # the first step: now it captures
        assert source.captures_started == 2
        assert staleness.verdict_stale(app.state) is None


async def test_a_view_attached_while_the_job_starts_captures_at_its_first_step() -> None:
    from queue_source import QueueSource
    from rankscope.tui.app import AppOptions, RankscopeApp
    from tui_screen import until

    source = QueueSource("2 agents", initial=(snap(T0 + 5, progress=None, started=T0),))
    app = RankscopeApp(source, AppOptions(poll_interval_s=0.01, hang_after_s=30), clock=lambda: T0 + 5)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, app.loaded.is_set)
        assert hl.health(app.state).kind == "starting"
        assert not app.state.capturing and source.captures_started == 0  # not at attach: the ranks are importing
        source.push_capture(snap(T0 + 9, progress=T0 + 8, started=T0, stacks="step"))
        source.push_poll(snap(T0 + 8, progress=T0 + 8, started=T0))
        await until(pilot, lambda: app.state.capture_wall == T0 + 9)
        assert source.captures_started == 1 and staleness.verdict_stale(app.state) is None


async def test_a_view_attached_after_an_eviction_logs_it_once_and_never_as_lost() -> None:
    # The pair's late view (the hand-driven drill): its first reading has stand-ins for the agents the hostfile
    # marks evicted, named by the hostfile. The Events view read "lost: agent machine-1 unreachable" for each.
    from queue_source import QueueSource
    from rankscope.tui.app import AppOptions, RankscopeApp
    from rankscope.wire.fanout import evicted_stand_in
    from tui_screen import until

    gone = replace(evicted_stand_in("127.0.0.1:59991"), machine="machine-1")
    first = snap(T0 + 5, progress=T0 + 5, unreachable=("machine-1",))
    first = replace(first, machines=(first.machines[0], gone))
    source = QueueSource("1 agents", initial=(first,))
    source.evicted_addresses = frozenset({"127.0.0.1:59991"})  # type: ignore[attr-defined]  # as LiveSource has
    app = RankscopeApp(source, AppOptions(poll_interval_s=0.01, capture_on_start=False), clock=lambda: T0 + 5)
    async with app.run_test(size=(120, 40)) as pilot:
        await until(pilot, app.loaded.is_set)
        source.push_poll(first)
        await until(pilot, lambda: len(app.state.kept) == 2)
        kinds = [(e.kind, e.text) for e in app.state.events if "machine-1" in e.text]
        assert kinds == [("info", "evicted before this view attached (the hostfile marks them): machine-1")], kinds
        assert [m.name for m in app.state.machines if m.evicted] == ["machine-1"] and app.state.lost == ()
        assert "1/1 machines 1 evicted" in header(app.state) and not app.state.awaiting_restart


def test_events_stay_in_time_order_when_an_audit_record_carries_an_earlier_time() -> None:
    from rankscope.actions.model import ActionKind, AuditRecord

    s = fold([snap(T0 + i, progress=T0 + i) for i in range(5)])
    s = st.apply_info(s, "later note", T0 + 9)
    s = st.apply_audit(s, "127.0.0.1:1", AuditRecord(1, "hot-update-x", "alice", T0 + 7, ActionKind.HOT_UPDATE,
                                                      "hot-update machine-0 to v2 (immediate)", "succeeded", "ok",
                                                      ("machine-0",)))
    walls = [e.wall for e in s.events]
    assert walls == sorted(walls) and s.events[-1].text == "later note"
    assert st.code_version(s) == "v2"


def test_an_agent_slower_back_than_the_ranks_stays_restarting_not_lost() -> None:
    s = fold([snap(T0 + i, progress=T0 + i) for i in range(3)])
    s = st.apply_evicted(s, ["machine-1"], T0 + 3)
    s = fold([snap(T0 + 5, progress=None, unreachable=MACHINES)], s)
    assert s.restarting == {"machine-0"}
    # The job's ranks came back elsewhere (the restart seen, awaiting_restart cleared) while machine-0's agent is
    # still away: restarting, not lost, until it answers.
    restarted = replace(s, awaiting_restart=False, restart_seen_wall=T0 + 8)
    s = fold([snap(T0 + 9, progress=None, unreachable=MACHINES)], restarted)
    assert s.lost == () and "1 restarting" in header(s) and "lost" not in header(s), header(s)
    s = fold([snap(T0 + 12, progress=T0 + 11, unreachable=("machine-1",))], s)
    assert s.restarting == frozenset()
    # Back, it is no news of its own (the header stops saying "restarting"): no row one view of a pair may miss.
    assert [e.text for e in s.events if e.kind in ("found", "lost")] == []
    # Just after the restart the old agent may still answer, then go as the new one takes its port, then come back:
    # one view of a pair catches that flap, the other not; it is the restart, no row.
    s = fold([snap(T0 + 14, progress=T0 + 13, unreachable=("machine-0", "machine-1"))], s)
    assert s.restarting == {"machine-0"} and s.lost == ()
    s = fold([snap(T0 + 15, progress=T0 + 14, unreachable=("machine-1",))], s)
    assert [e.text for e in s.events if e.kind in ("found", "lost")] == []
    # An agent that has not come back once the restart settled is news: lost, said once.
    s = fold([snap(T0 + 20, progress=T0 + 19, unreachable=("machine-0", "machine-1"))], s)
    s = fold([snap(T0 + 8 + story.RESTART_SETTLE_S + 1, progress=T0 + 38, unreachable=("machine-0", "machine-1"))], s)
    assert s.lost == ("machine-0",) and s.restarting == frozenset()
    address = next(m.address for m in s.machines if m.name == "machine-0")
    assert [e.text for e in s.events if e.kind == "lost"] == [
        f"agent machine-0 ({address}) did not come back after the restart: no answer"]


def test_at_80_columns_a_restarts_header_is_whole_and_counts_its_machines_once() -> None:
    # By hand at 80x24, after confirming an eviction: "restarting: 3 machines' agents restart with the job │ 1/5
    # machines 4 restarti…", the count cut and told twice, differently. Narrow, the state is "restarting" and the
    # machine count says how many.
    standby = MachineSnapshot("standby-0", "127.0.0.1:59999", True, Instant(T0 + 3, 3.0), generation=1)
    s = fold([snap(T0 + i, progress=T0 + i, extra=(standby,)) for i in range(3)])
    s = replace(s, awaiting_restart=True)
    s = fold([snap(T0 + 3, progress=T0 + 2, unreachable=MACHINES[:1], ranks=False, extra=(standby,))], s)
    assert hl.health(s).text == "restarting: 1 machine's agent restarts with the job"
    wide = header_text(s, "3 agents", False, width=160).plain.splitlines()[0]
    assert wide.startswith("restarting: 1 machine's agent restarts with the job │ 2/3 machines 1 restarting"), wide
    for width in (80, 60):
        first = header_text(s, "3 agents", False, width=width).plain.splitlines()[0].rstrip()
        assert first.startswith("restarting │ 2/3 machines 1 restarting") and "…" not in first, (width, first)
        assert len(first) <= width - 2, first


def test_no_hang_capture_between_an_eviction_and_the_restart_it_brings() -> None:
    from rankscope.tui import schedule

    # Steps until T0+10, then a hang, captured once.
    s = fold([snap(T0 + i, progress=T0 + min(i, 10)) for i in range(0, 60, 2)])
    assert hl.health(s).kind == "hung" and schedule.hang_capture_due(s)
    s = st.apply_hang_captured(s)
    assert not schedule.hang_capture_due(s)
    # The stopped machine's peers see their collectives end as its ranks are killed: their progress mark moves once,
    # then stands while the launcher stops them. A capture then read the dying job and named a new culprit
    # ("rank 3 on machine-1") two seconds after the eviction, before the restart.
    evicted = st.apply_evicted(s, ["machine-1"], T0 + 61)
    assert evicted.awaiting_restart
    dying = [snap(T0 + 62 + i, progress=T0 + 62) for i in range(0, 40, 2)]
    after = fold(dying, evicted)
    assert hl.health(after).kind == "idle" and after.last_progress_wall == T0 + 62
    assert not schedule.hang_capture_due(after)
    # Without the eviction the same readings are a new stop of a running job: captured.
    assert schedule.hang_capture_due(fold(dying, s))


def test_a_training_job_evicted_for_being_slow_is_restarting_until_it_restarts_never_hung() -> None:
    # By hand, a fail-slow eviction of a job that was training: the ranks left waited on the evicted ones until the
    # launcher stopped them, and the header said "no progress for 21 s │ hang + capture in 9 s" and Events "hung",
    # seconds after the eviction, before the restart.
    s = fold([snap(T0 + i, progress=T0 + i) for i in range(0, 20, 2)])
    assert hl.health(s).kind == "healthy"
    evicted = st.apply_evicted(s, ["machine-1"], T0 + 19)
    waiting = fold([snap(T0 + 20 + i, progress=T0 + 18) for i in range(0, 50, 2)], evicted)
    h = hl.health(waiting)
    assert (h.kind, h.text, h.short) == ("idle", "restarting: the job waits for its launcher to restart it (no "
                                         "progress for 50 s)", "restarting")
    assert [e.kind for e in waiting.events if e.wall > T0 + 19] == []
    first = header(waiting)
    assert first.startswith("restarting: the job waits for its launcher to restart it") and "hang" not in first, first
    # The same readings without the eviction: stalled, then hung, as before.
    stopped = fold([snap(T0 + 20 + i, progress=T0 + 18) for i in range(0, 50, 2)], s)
    assert hl.health(stopped).kind == "hung"
    assert [e.kind for e in stopped.events if e.wall > T0 + 19] == ["hung"]
    # The restart comes (new pids, a first step): training again, and a hang after it is a hang again.
    back = fold([snap(T0 + 72 + i, progress=T0 + 72 + i, pids=2000, started=T0 + 70) for i in range(0, 10, 2)],
                waiting)
    assert not back.awaiting_restart and hl.health(back).kind == "healthy"
    hung = fold([snap(T0 + 82 + i, progress=T0 + 80) for i in range(0, 60, 2)], back)
    assert hl.health(hung).kind == "hung" and [e.kind for e in hung.events if e.wall > T0 + 81] == ["hung"]
