"""Whether the capture on screen still describes the job: a stale verdict is shown for reading, never acted on."""

from __future__ import annotations

from collections.abc import Mapping

from rankscope.analyzers.eviction_scope import degrader_suspect
from rankscope.analyzers.findings import Suspect
from rankscope.analyzers.topology import Topology
from rankscope.contract.ranks import compact_ranks
from rankscope.tui.health import fmt_time, health
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


def failslow_target(state: AppState) -> tuple[Suspect | None, str | None]:
    """The fail-slow verdict `e` acts on, or why there is none (``(None, None)``: no fail-slow verdict at all).

    A confident verdict of the detectors that are still fed (the job makes
    steps) is live: it is the current reading of the job, not an old capture.
    It is stale once its machine was evicted, its agent is away, or the job
    stopped making steps (a hang is read from the stacks). The machine is the
    default target; its degrader group (``degrader_suspect``) is offered.
    """
    fs = state.failslow.verdict if state.failslow is not None else None
    top = fs.verdict.top if fs is not None and fs.confident else None
    if fs is None or top is None or not top.machines:
        return None, None
    evicted = state.evicted | {m.name for m in state.machines if m.evicted}
    gone = sorted(set(top.machines) & evicted)
    if gone:
        return None, f"its suspect {' '.join(gone)} was evicted"
    away = sorted(m.name for m in state.machines if m.name in top.machines and not m.reachable)
    if away:
        return None, f"the agent of {' '.join(away)} does not answer"
    kind = health(state).kind
    if kind not in ("healthy", "slow"):
        return None, f"the job is {kind} now"
    topology = Topology(state.layout, state.world_size) if state.layout is not None and state.world_size else None
    return degrader_suspect(top, topology, state.machine_of_rank()), None
