"""When the app captures by itself: once a restarted (or starting) job has made its first step, and once per stop
when progress stops. Questions asked of the store; the reducers that mark a capture begun, waited for or taken
are the store's (``apply_await_start``, ``apply_started_captured``, ``apply_hang_captured``).
"""

from __future__ import annotations

from rankscope.tui.digest import JobClock
from rankscope.tui.health import health
from rankscope.tui.state import AppState
from rankscope.tui.story import journal_worthy


def _unknown_for_long(state: AppState, clock: JobClock) -> bool:
    """Ranks with no counters and no step for ``hang_after_s`` since they started: only stacks can tell more.

    New processes have no counter files yet for a while (imports): capturing then caught them mid-import.
    A job whose ranks have shown counters will show them again once the new ranks have imported: on a loaded
    host that took longer than ``hang_after_s``, and a capture then caught a restart mid-import.
    """
    return bool(clock.unknown) and not state.job_counts and (
        clock.start_age_s is None or clock.start_age_s >= state.hang_after_s)


def started_capture_due(state: AppState) -> bool:
    """The capture waiting for the job's first step may go now (it stepped, or only stacks can tell more)."""
    clock = state.clock
    return state.capture_after_start and not state.capturing and (
        clock is None or (not clock.starting and (clock.progress_mark is not None or _unknown_for_long(state, clock))))


def hang_capture_due(state: AppState) -> bool:
    """Progress stopped and this stop was not captured yet.

    After a restart, ranks slow to reach their first step (a loaded host, a backup being restored) are
    captured once they step, not as a hang: that capture caught rendezvous and restore stacks. Nor between an
    eviction and the restart it brings: the launcher is stopping the ranks left, and their stacks are of a dying job
    (a capture there named a new culprit two seconds after the eviction).
    """
    restarting = (state.capture_after_start and state.restarts > 0) or state.awaiting_restart
    return health(state).kind == "hung" and not restarting and \
        state.hang_captured_for != state.last_progress_wall


# A capture that misses running ranks (their agent was not back yet, their process still starting) is retaken
# this long after it, up to REFRESH_TRIES times for one set of missing ranks: every running rank's stacks are on
# screen without a key press. (Once per set was not enough: a retake in the restart's last moments read no rank,
# the same set stayed missing, and the map kept "not captured since a restart" until s.)
REFRESH_AFTER_S = 5.0
REFRESH_TRIES = 3


def uncaptured_ranks(state: AppState) -> frozenset[int]:
    """Ranks running now (past their first step, on machines whose agents answer) that the capture on screen has no
    stack of: all of them when the capture is of an earlier launch (the job restarted since)."""
    running = {r for m in state.job_machines if m.reachable for r in m.ranks
               if r not in m.starting and r not in m.unknown}
    if state.stacks is None or state.verdict is None:
        return frozenset()
    if state.verdict.restarts < state.restarts:
        return frozenset(running)
    return frozenset(running - set(state.stacks.group_of_rank))


def refresh_capture_due(state: AppState) -> bool:
    """The job runs again (after a restart or a hot-update) and the capture on screen misses some of its running
    ranks: capture again, ``REFRESH_AFTER_S`` after the last capture, at most ``REFRESH_TRIES`` times for one set."""
    if state.capturing or state.capture_after_start or state.capture_wall is None:
        return False
    if state.now_wall - state.capture_wall < REFRESH_AFTER_S or health(state).kind not in ("healthy", "slow"):
        return False
    missing = uncaptured_ranks(state)
    return bool(missing) and (missing != state.refreshed_for or state.refresh_tries < REFRESH_TRIES)


# The incident journal (``rankscope.actions.journal``) is written by others while an incident goes on: the acting
# view (the hang, verdicts, evictions, restarts) and whoever restarted the job (the drill's recovery writes the step
# it resumed from once its agents are back, which can be many seconds after a view saw the restart). A view reads it
# every JOURNAL_EVERY_S while the story may still change: while the job restarts, and until JOURNAL_FOLLOW_S after
# the newest moment of the story (its own or the journal's), so a line written late still reaches every view.
JOURNAL_EVERY_S = 2.0
JOURNAL_FOLLOW_S = 90.0


def journal_read_due(state: AppState, last_read_wall: float | None) -> bool:
    """Read the agents' journal again now (``last_read_wall``: when it was last read; None: never)."""
    if last_read_wall is not None and state.now_wall - last_read_wall < JOURNAL_EVERY_S:
        return False
    if state.awaiting_restart or state.restarting or state.capture_after_start:
        return True
    newest = next((e.wall for e in reversed(state.events) if journal_worthy(e)), None)
    return newest is not None and state.now_wall - newest <= JOURNAL_FOLLOW_S
