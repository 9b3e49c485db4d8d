"""How a view tells a job's launches: a job that ran its last step and whose ranks exit is neither hung nor
restarted; a restart is told once its launch is whole, and its first step each time; two views of one stall count
down to the same second, whenever each attached.

Driven through the store's reducers (the code the app runs on every poll) with the recorded Fig. 7 job: 16
machines of two ranks, one snapshot a second, its agents' memory of the job (progress marks, process starts)
attached as agents ship it.
"""

from __future__ import annotations

from dataclasses import replace

from rankscope.contract.snapshot import JobSnapshot, MachineSnapshot
from rankscope.tui import digest as dg
from rankscope.tui import health as hl
from rankscope.tui import state as st
from rankscope.tui.widgets.verdict import header_text
from tui_bundles import T0, job

STARTED = T0 - 100.0  # the ranks' processes started then


def clocked(snap: JobSnapshot, progress_wall: float, seen_wall: float | None = None) -> JobSnapshot:
    """The snapshot with its agents' memory: every rank last progressed at ``progress_wall``."""
    wall = snap.captured.wall
    return replace(snap, machines=tuple(
        replace(m, generation=1, ranks_seen_wall=seen_wall if seen_wall is not None else wall,
                ranks=tuple(replace(r, last_progress_wall=progress_wall, started_wall=STARTED) for r in m.ranks))
        for m in snap.machines))


def running(wall: float, step: int, step_s: float = 1.0, hung: bool = False, last_step: float | None = None
            ) -> JobSnapshot:
    return clocked(job(wall, stacks=False, step=step, hung=hung, step_s=step_s),
                   last_step if last_step is not None else wall)


def poll(s: st.AppState, snap: JobSnapshot) -> st.AppState:
    return st.apply_poll(s, dg.digest(snap), snap.captured.wall)


def kinds(s: st.AppState) -> list[str]:
    return [e.kind for e in s.events if e.kind in ("hung", "restarted", "resumed")]


def exiting(snap: JobSnapshot, left: dict[int, int], seen_wall: float) -> JobSnapshot:
    """Every rank's process has ended and its counter file is gone (a clean exit removes it), except the ranks of
    ``left``, still seen under the pid given (a process of the rank that outlived it, carrying its rank variables)."""
    def machine(m: MachineSnapshot) -> MachineSnapshot:
        ranks = tuple(replace(r, pid=left[r.rank], last_progress_wall=None) for r in m.ranks if r.rank in left)
        return replace(m, ranks=ranks, counters=(), ranks_seen_wall=m.captured.wall if ranks else seen_wall)
    return replace(snap, machines=tuple(machine(m) for m in snap.machines))


def test_a_job_past_its_last_step_whose_ranks_exit_is_neither_hung_nor_restarted() -> None:
    s = st.AppState()
    for i in range(10):  # 1 s steps, timed by the ranks' counters
        s = poll(s, running(T0 + i, 100 + i))
    last = T0 + 9
    # The last step was the last: every collective it launched completed (the closing barrier included), and the
    # ranks tear down -- slowly on a loaded host. Nobody waits on a peer: the ceiling judges the quiet, not the
    # 6 s that 3 of its 1 s steps would give a stuck collective.
    for i in range(10, 30):
        s = poll(s, running(T0 + i, 109, last_step=last))
        assert s.hang.seconds == 30.0, (i, s.hang)
        assert hl.health(s).kind != "hung", (i, hl.health(s))
    # The ranks' processes end; for a moment the ranks of one machine are seen under other pids (processes that
    # outlived their rank), every other machine runs none: the job ending, not a launch.
    leftover = {30: 9030, 31: 9031}
    s = poll(s, exiting(running(T0 + 30, 109, last_step=last), leftover, seen_wall=T0 + 29))
    s = poll(s, exiting(running(T0 + 31, 109, last_step=last), leftover, seen_wall=T0 + 29))
    s = poll(s, exiting(running(T0 + 32, 109, last_step=last), {}, seen_wall=T0 + 31))
    assert kinds(s) == [], [e.text for e in s.events]
    assert s.restarts == 0 and hl.health(s).kind == "idle", hl.health(s)
    s = poll(s, exiting(running(T0 + 70, 109, last_step=last), {}, seen_wall=T0 + 31))
    assert hl.health(s).text.startswith("finished: no ranks running since"), hl.health(s)
    assert kinds(s) == []


def test_a_stuck_collective_is_still_judged_by_the_rhythm() -> None:
    s = st.AppState()
    for i in range(10):
        s = poll(s, running(T0 + i, 100 + i))
    last = T0 + 9
    for i in range(10, 16):  # rank 30 never launched its send; its peers' receives stay open
        s = poll(s, running(T0 + i, 109, hung=True, last_step=last))
    assert s.hang.seconds == 6.0 and hl.health(s).kind == "hung"
    assert kinds(s) == ["hung"]


def test_a_restart_is_told_once_its_ranks_are_back_on_every_machine_that_answers() -> None:
    s = st.AppState()
    for i in range(6):
        s = poll(s, running(T0 + i, 100 + i))
    new_pids = {r: 5000 + r for r in range(32)}
    # The new launch's ranks start on the last machine first; the others answer and run none yet.
    s = poll(s, exiting(running(T0 + 6, 105), {30: 5030, 31: 5031}, seen_wall=T0 + 5))
    assert s.restarts == 0
    back = running(T0 + 7, 1)
    back = replace(back, machines=tuple(replace(m, ranks=tuple(replace(r, pid=new_pids[r.rank], last_progress_wall=None)
                                                               for r in m.ranks)) for m in back.machines))
    s = poll(s, back)
    assert s.restarts == 1 and kinds(s) == ["restarted"], [e.text for e in s.events]


def test_two_views_attached_at_different_times_count_down_to_the_same_second() -> None:
    """The acting view watched a slow step (4 s: 12 s of rhythm) the read-only view, attached later, never saw;
    fed the same readings from then on, both judge the stall the same: from what the readings say now."""
    snaps = [running(T0 + i, 100 + i, step_s=4.0 if i == 3 else 1.0) for i in range(12)]
    last = T0 + 11
    snaps += [running(T0 + i, 111, hung=True, last_step=last) for i in range(12, 17)]
    early, late = st.AppState(), st.AppState()
    for snap in snaps:
        early = poll(early, snap)
    for snap in snaps[8:]:
        late = poll(late, snap)
    assert early.hang == late.hang and early.hang.seconds == 6.0, (early.hang, late.hang)
    # The countdown, the header's last part (its step rate is each view's own window of polls).
    countdowns = [header_text(v, "x", False).plain.splitlines()[0].split("│")[-1].strip() for v in (early, late)]
    assert countdowns == ["hang + capture in 1 s (3× its 1.0 s step)"] * 2, countdowns


def relaunched(wall: float, step: int, pid_base: int, first_step: float) -> JobSnapshot:
    """The job's ranks under new pids (``pid_base`` + rank), their first step made at ``first_step``."""
    snap = running(wall, step, last_step=first_step)
    return replace(snap, machines=tuple(replace(m, ranks=tuple(replace(r, pid=pid_base + r.rank) for r in m.ranks))
                                        for m in snap.machines))


def test_each_restart_found_with_its_first_step_by_one_poll_tells_that_the_training_runs_again() -> None:
    """A poll found the restart and the new launch's first step at once (the ranks stepped before the poll): the
    second restart's resumption read as the first one's, with no restart between them in the events kept, and was
    dropped (the hot-update's resumption on v2 was told nowhere)."""
    s = st.AppState()
    for i in range(6):
        s = poll(s, running(T0 + i, 100 + i))
    s = poll(s, relaunched(T0 + 10, 50, 5000, first_step=T0 + 9.5))
    for i in range(11, 60):
        s = poll(s, relaunched(T0 + i, 40 + i, 5000, first_step=T0 + i))
    s = poll(s, relaunched(T0 + 61, 60, 7000, first_step=T0 + 60.5))
    assert kinds(s) == ["restarted", "resumed", "restarted", "resumed"], [(e.kind, e.text) for e in s.events]
    assert s.restarts == 2
