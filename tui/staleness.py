"""Whether the capture on screen still describes the job: a stale verdict is shown for reading, never acted on."""

from __future__ import annotations

from collections.abc import Mapping

from rankscope.contract.ranks import compact_ranks
from rankscope.tui.health import fmt_time
from rankscope.tui.state import AppState


def verdict_stale(state: AppState) -> str | None:
    """Why the verdict on screen no longer describes the job (None: it does).

    A verdict belongs to one capture of one launch in one state: it goes
    stale when the job restarts, progresses after it, or has no ranks left;
    a capture of ranks still starting is never a steady state. A stale
    verdict is shown for reading but never aims an action.
    """
    mark = state.verdict
    if state.stacks is None or mark is None:
        return None
    if mark.restarting:
        return "taken while the job was restarting"
    if state.restarts > mark.restarts:
        return "the job restarted after this capture"
    evicted = state.evicted | {m.name for m in state.machines if m.evicted}
    acted = sorted({m for s in state.stacks.verdict.suspects for m in s.machines} & evicted)
    if acted:
        return f"its suspects {' '.join(acted)} were evicted"
    job = [m for m in state.job_machines if m.reachable]
    silent = any(m.ranks for m in state.job_machines if not m.reachable)  # lost agents keep their last ranks
    if job and not silent and not any(m.ranks for m in job):
        return "the job has no ranks running now"
    if mark.starting:
        return f"taken while ranks {compact_ranks(mark.starting, 4)} were still starting"
    clock = state.clock
    if mark.clock_info and clock is not None:
        # A capture that carried no progress mark (its readings had none) is dated by its own time: a hang's
        # last step before it is no progress after it.
        before = mark.progress_mark if mark.progress_mark is not None else mark.wall
        if clock.progress_mark is not None and clock.progress_mark > before:
            return f"the job progressed after it (last step {fmt_time(clock.progress_mark)})"
    elif state.progress_points and state.progress_points[-1][1] != mark.progress_count:
        return "the job progressed after it"
    return None


def map_groups(state: AppState) -> Mapping[int, int]:
    """The capture's stack group of each rank, for the rank map: none once the job restarted after the capture.

    The new processes have their ranks on other machines (standbys): coloured by the old capture, a standby
    showed the hung rank's group (the injected frame) while the restarted job was still starting.
    """
    if state.stacks is None or (state.verdict is not None and state.restarts > state.verdict.restarts):
        return {}
    return state.stacks.group_of_rank
