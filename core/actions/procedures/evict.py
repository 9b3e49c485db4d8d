"""Eviction: stop this machine's ranks and block it (``local``), or have a scheduler backend evict it.

``local``: SIGTERM every planned rank process (and their worker
subprocesses), SIGKILL what is left after the grace period, block the
machine. Restarting the job without it is the launcher's (torchrun's
restarts, the drill, the scheduler). ``slurm`` / ``kubernetes`` /
``command``: the configured
:class:`~rankscope.actions.evict_backends.EvictionBackend` runs the argv the
plan showed, and the machines it evicted are blocked when it succeeds.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import time
from collections.abc import Sequence
from typing import Any

from rankscope.actions.blocklist import Blocklist
from rankscope.actions.evict_backends import EvictionBackend
from rankscope.actions.model import ActionRequest, ActionState, EvictArgs, ProcessRef
from rankscope.actions.planning import Planned
from rankscope.actions.procedures import Outcome, Report

KILL_WAIT_S = 5.0  # after SIGKILL: a process still there is stuck in the kernel (uninterruptible)


def evict_locally(request: ActionRequest, planned: Planned, report: Report, machine: str, grace_s: float,
                  blocklist: Blocklist) -> Outcome:
    """SIGTERM, SIGKILL after ``grace_s``, block ``machine``; failed when a process survives SIGKILL."""
    assert isinstance(request.args, EvictArgs)
    import psutil

    targets = _live_processes(planned.plan.processes)
    for proc in targets:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    report(f"sent SIGTERM to {len(targets)} process(es): {' '.join(str(p.pid) for p in targets) or 'none'}")
    left = wait_gone(targets, grace_s)
    for proc in left:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGKILL)
    stuck = wait_gone(left, KILL_WAIT_S)
    report(f"SIGKILL to {len(left)} process(es) still running after {grace_s:g} s"
           if left else "every process ended after SIGTERM")
    blocklist.block((machine,), request.args.reason, request.requested_by, request.action_id)
    report(f"blocked {machine}")
    ranks = " ".join(str(r.rank) for r in planned.ranks) or "none"
    details = tuple(f"pid {p.pid} (rank {p.rank}) stopped" for p in planned.plan.processes
                    if p.pid not in {s.pid for s in stuck})
    if stuck:
        return (ActionState.FAILED,
                f"{' '.join(str(p.pid) for p in stuck)} on {machine} survived SIGKILL (uninterruptible?); "
                f"{machine} is blocked", details)
    return (ActionState.SUCCEEDED,
            f"stopped ranks {ranks} on {machine} ({len(targets)} process(es), {len(left)} needed SIGKILL) "
            f"and blocked it; the launcher restarts the job without it", details)


def evict_with_backend(request: ActionRequest, planned: Planned, report: Report, backend: EvictionBackend,
                       blocklist: Blocklist) -> Outcome:
    """Run the backend's eviction of the planned machines; block them when it succeeds."""
    assert isinstance(request.args, EvictArgs)
    report(f"running {len(planned.plan.commands)} {backend.name} command(s)")
    outcome = backend.joined(request.args.together).evict(planned.plan.machines, request.args.reason)
    details = tuple(f"exit {run.returncode}: {' '.join(run.argv)}" for run in outcome.runs)
    if outcome.replacements:
        details += (f"replacements: {' '.join(outcome.replacements)}",)
    if not outcome.ok:
        return ActionState.FAILED, outcome.message, details
    report(f"{backend.name}: {outcome.message}")
    blocklist.block(outcome.machines, request.args.reason, request.requested_by, request.action_id)
    return ActionState.SUCCEEDED, f"{outcome.message}; blocked {' '.join(outcome.machines)}", details


def _live_processes(processes: tuple[ProcessRef, ...]) -> list[Any]:
    """psutil handles of the planned processes that still exist (a pid reused since would be a different process:
    the plan is made just before, from a fresh discovery)."""
    import psutil

    out = []
    for ref in processes:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(ref.pid)
            if proc.pid != os.getpid():
                out.append(proc)
    return out


def _gone(proc: Any) -> bool:
    import psutil

    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.Error:
        return True


def wait_gone(procs: Sequence[Any], timeout_s: float) -> list[Any]:
    """Wait until every process (psutil) ended or the time is up; those still running.

    A zombie counts as ended (its parent reaps it; a container's init may do
    that only every second or so). The kernel wakes the wait as each process
    exits (a pidfd per process, Linux 5.3+): no polling interval is added to
    a stop, and the waiting costs no CPU the processes starting beside it
    need. Where pidfds are missing, the processes are polled every 20 ms.
    """
    deadline = time.monotonic() + timeout_s
    watched: dict[int, Any] = {}  # pidfd -> process
    left: list[Any] = []
    try:
        for proc in procs:
            try:
                fd = os.pidfd_open(proc.pid)
            except ProcessLookupError:
                continue  # gone (and reaped) already
            except (AttributeError, OSError):
                return _poll_gone(procs, deadline)
            # Checked after the pidfd is open: the pid cannot be reused while it refers to this process.
            if _gone(proc):
                os.close(fd)
                continue
            watched[fd] = proc
        while watched:
            wait_s = deadline - time.monotonic()
            if wait_s <= 0:
                break
            poller = select.poll()
            for fd in watched:
                poller.register(fd, select.POLLIN)
            for fd, _event in poller.poll(wait_s * 1000):
                os.close(fd)
                del watched[fd]
        left = list(watched.values())
    finally:
        for fd in watched:
            os.close(fd)
    return left


def _poll_gone(procs: Sequence[Any], deadline: float) -> list[Any]:
    left = [p for p in procs if not _gone(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.02)
        left = [p for p in left if not _gone(p)]
    return left
