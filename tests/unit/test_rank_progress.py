"""The agent's memory of its job: per-rank last progress, launches, and a late client reading the same numbers."""

from __future__ import annotations

from dataclasses import replace

from rankscope.analyzers.progress import counters_progress_wall
from rankscope.contract.snapshot import (
    Frame,
    Instant,
    MachineSnapshot,
    OpCounters,
    ProcessRole,
    ProcessStack,
    RankCounters,
    RankInfo,
    RankStacks,
    ThreadStack,
)
from rankscope.wire.rank_progress import ProgressTracker


def ranks(pids: dict[int, int]) -> tuple[RankInfo, ...]:
    return tuple(RankInfo(rank=r, local_rank=r, world_size=2, pid=p) for r, p in pids.items())


def counters(rank: int, pid: int, step_wall: float | None, op_wall: float | None) -> RankCounters:
    ops = (OpCounters("c0", "all_reduce", 3, 3, 3, last_complete_wall=op_wall),) if op_wall else ()
    return RankCounters(rank=rank, pid=pid, world_size=2, job_id=None, heartbeat_wall=None, ops=ops,
                        steps=1 if step_wall else None, last_step_wall=step_wall)


def stack(rank: int, pid: int, fn: str) -> RankStacks:
    thread = ThreadStack(1, (Frame(fn, "train.py", 10), Frame("main", "train.py", 1)), "MainThread")
    return RankStacks(rank, ProcessStack(pid, ProcessRole.MAIN, (thread,)))


def reading(wall: float, pids: dict[int, int], cs: tuple[RankCounters, ...] = (),
            st: tuple[RankStacks, ...] = ()) -> MachineSnapshot:
    return MachineSnapshot("m0", "127.0.0.1:1", True, Instant(wall, wall), ranks=ranks(pids), counters=cs, stacks=st)


def started(pid: int) -> float:
    return {10: 100.0, 11: 100.0, 20: 500.0, 21: 500.0}.get(pid, 0.0)


def test_counters_progress_is_the_last_step_else_the_last_completion() -> None:
    assert counters_progress_wall(counters(0, 10, 150.0, 170.0)) == 150.0  # a restart's collectives are no step
    assert counters_progress_wall(counters(0, 10, None, 140.0)) == 140.0  # a writer that counts no steps
    assert counters_progress_wall(counters(0, 10, None, None)) is None


def test_a_job_without_optimizer_steps_progresses_by_its_collectives() -> None:
    """Issue 26: a job with no torch.optim (steps stay 0) whose collectives advanced is never 'hung since its
    start'; once the job has made steps, a restarted process at 0 steps waits for its first step."""
    no_optimizer = RankCounters(rank=0, pid=10, world_size=2, job_id=None, heartbeat_wall=None, steps=0,
                                ops=(OpCounters("c0", "all_reduce", 60, 60, 60, last_complete_wall=170.0),))
    assert counters_progress_wall(no_optimizer) == 170.0
    assert counters_progress_wall(no_optimizer, job_counts_steps=True) is None
    # collectives in its first seconds are its set-up (a restart's rendezvous), not progress
    assert counters_progress_wall(no_optimizer, started_wall=160.0) is None
    assert counters_progress_wall(no_optimizer, started_wall=100.0) == 170.0
    tracker = ProgressTracker(started)
    got = tracker.observe(reading(400.0, {0: 10}, (no_optimizer,)))
    assert got.ranks[0].last_progress_wall == 170.0  # pid 10 started at 100
    # the job made steps once: a new process of the rank at 0 steps has not progressed yet
    tracker.observe(reading(410.0, {0: 10}, (counters(0, 10, 405.0, 406.0),)))
    restarted = tracker.observe(reading(600.0, {0: 20}, (replace(no_optimizer, pid=20),)))
    assert restarted.ranks[0].last_progress_wall is None


def test_a_late_tracker_reads_the_same_last_progress_as_one_that_watched_from_the_start() -> None:
    early, late = ProgressTracker(started), ProgressTracker(started)
    for wall in (150.0, 160.0, 170.0):
        early.observe(reading(wall, {0: 10, 1: 11}, (counters(0, 10, min(wall, 160.0), None),
                                                      counters(1, 11, None, min(wall, 161.0)))))
    a = early.observe(reading(400.0, {0: 10, 1: 11}, (counters(0, 10, 160.0, None), counters(1, 11, None, 161.0))))
    b = late.observe(reading(400.0, {0: 10, 1: 11}, (counters(0, 10, 160.0, None), counters(1, 11, None, 161.0))))
    assert [r.last_progress_wall for r in a.ranks] == [r.last_progress_wall for r in b.ranks] == [160.0, 161.0]
    assert [r.started_wall for r in b.ranks] == [100.0, 100.0]


def test_new_pids_are_a_new_generation_that_has_made_no_progress_yet() -> None:
    t = ProgressTracker(started)
    first = t.observe(reading(150.0, {0: 10, 1: 11}, (counters(0, 10, 150.0, None),)))
    assert first.generation == 1 and first.ranks[0].last_progress_wall == 150.0
    # The relaunch: new pids, still importing (no counters of theirs yet; the old files linger under the old pids).
    second = t.observe(reading(510.0, {0: 20, 1: 21}, (counters(0, 10, 150.0, None),)))
    assert second.generation == 2
    assert [r.last_progress_wall for r in second.ranks] == [None, None]
    assert [r.started_wall for r in second.ranks] == [500.0, 500.0]
    # A counter stamped before the process started belongs to an older process of the rank.
    third = t.observe(reading(520.0, {0: 20, 1: 21}, (counters(0, 20, 490.0, None), counters(1, 21, 515.0, None))))
    assert [r.last_progress_wall for r in third.ranks] == [None, 515.0]
    assert third.ranks_seen_wall == 520.0
    gone = t.observe(reading(600.0, {}))
    assert gone.generation == 2 and gone.ranks_seen_wall == 520.0  # when the job's ranks were last seen here
    never = ProgressTracker(started).observe(reading(600.0, {}))
    assert never.generation == 0 and never.ranks_seen_wall is None  # an agent up with no ranks of its job yet


def test_without_counters_a_changed_stack_between_captures_is_progress() -> None:
    t = ProgressTracker(started)
    a = t.observe(reading(150.0, {0: 10}, st=(stack(0, 10, "forward"),)))
    assert a.ranks[0].last_progress_wall is None  # one stack says nothing
    b = t.observe(reading(160.0, {0: 10}, st=(stack(0, 10, "backward"),)))
    assert b.ranks[0].last_progress_wall == 150.0  # it moved after the capture of 150
    c = t.observe(reading(170.0, {0: 10}, st=(stack(0, 10, "backward"),)))  # stuck in the same frame
    d = t.observe(reading(175.0, {0: 10}))  # a poll: no stacks, nothing learnt
    assert c.ranks[0].last_progress_wall == d.ranks[0].last_progress_wall == 150.0


def test_with_counters_a_changed_stack_is_no_progress() -> None:
    """A capture of a hung rank differs from one taken while it trained: the counters alone say it is stuck."""
    t = ProgressTracker(started)
    t.observe(reading(150.0, {0: 10}, (counters(0, 10, 149.0, None),), st=(stack(0, 10, "forward"),)))
    hung = t.observe(reading(400.0, {0: 10}, (counters(0, 10, 160.0, None),), st=(stack(0, 10, "recv"),)))
    assert hung.ranks[0].last_progress_wall == 160.0
