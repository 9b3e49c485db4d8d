"""When the app captures by itself: once a restarted (or starting) job has made its first step, and once per stop
when progress stops. Questions asked of the store; the reducers that mark a capture begun, waited for or taken
are the store's (``apply_await_start``, ``apply_started_captured``, ``apply_hang_captured``).
"""

from __future__ import annotations

from rankscope.tui.digest import JobClock
from rankscope.tui.health import health
from rankscope.tui.state import AppState


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
    captured once they step, not as a hang: that capture caught rendezvous and restore stacks.
    """
    restarting = state.capture_after_start and state.restarts > 0
    return health(state).kind == "hung" and not restarting and \
        state.hang_captured_for != state.last_progress_wall
