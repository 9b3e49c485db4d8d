"""Ending a drill's processes, whatever they do: whole trees, then a sweep of the process table by the run's marker.

torchrun starts every rank in a session of its own, and dataloader workers
and checkpoint writers hang off the ranks, so a tree is frozen and collected
before it is signalled, and every process a drill starts carries the run's
marker in its environment (``worker.RUN_ID_ENV``), inherited by all
descendants, for the final sweep to find what the trees missed.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankscope.drill.worker import RUN_ID_ENV


def kill_trees(pids: Sequence[int], *, grace_s: float = 2.0) -> None:
    """SIGTERM each process with all its descendants, then SIGKILL what is left after ``grace_s``."""
    signal_trees(pids, grace_s=grace_s).finish()


@dataclass
class Stopping:
    """Process trees that were sent SIGTERM and are given until ``kill_at`` (monotonic) to end by themselves.

    Several such groups can be signalled one after the other and waited for
    together: their graces run at the same time, not one after another.
    """

    procs: list[Any]  # psutil.Process
    kill_at: float
    grace_s: float

    def finish(self) -> None:
        """Wait until every process ended; SIGKILL what is still running at ``kill_at`` and wait for it too.

        The processes ran again after their SIGTERM, and one still running at
        ``kill_at`` may have started children since its tree was collected (an
        agent's sampler starts its next py-spy window while the agent stops
        gracefully): its tree is frozen and collected again before the SIGKILL,
        or they would outlive it, orphaned, where no tree leads to them.
        """
        import psutil

        alive = _wait_dead(self.procs, max(0.0, self.kill_at - time.monotonic()))
        if alive:
            trees = _frozen_trees([{p.pid: p for p in alive}])[0]
            alive = list(trees.values())
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        _wait_dead(alive, self.grace_s)
        self.procs = []


def signal_trees(pids: Sequence[int], *, grace_s: float = 2.0) -> Stopping:
    """SIGTERM each process with all its descendants, now; ``finish()`` on the result waits (and SIGKILLs)."""
    return signal_forest([(pids, grace_s)])[0]


def signal_forest(groups: Sequence[tuple[Sequence[int], float]]) -> list[Stopping]:
    """SIGTERM several groups of process trees at once, each with its own grace; one Stopping per group.

    The trees are frozen and collected in one pass first (:func:`freeze_forest`).
    """
    frozen = freeze_forest([pids for pids, _grace in groups])
    return [trees.terminate(grace) for trees, (_pids, grace) in zip(frozen, groups, strict=True)]


@dataclass
class Frozen:
    """Process trees, every process stopped (SIGSTOP) and none signalled yet: they take no CPU and start nothing
    until :meth:`terminate` sends each its SIGTERM and lets it run to its end."""

    procs: list[Any]  # psutil.Process

    def terminate(self, grace_s: float) -> Stopping:
        import psutil

        for p in self.procs:
            with contextlib.suppress(psutil.Error):
                p.terminate()  # pending while stopped...
                p.resume()  # ...delivered now (and a rank stopped by the thermal fault runs to die)
        stopping = Stopping(self.procs, time.monotonic() + grace_s, grace_s)
        self.procs = []
        return stopping


def freeze_forest(groups: Sequence[Sequence[int]]) -> list[Frozen]:
    """Freeze several groups of process trees, all of them in one pass; one :class:`Frozen` per group.

    The trees are frozen (SIGSTOP) and collected again until no new process
    shows up before anything is terminated: a process that forks between the
    collection and its signal (an agent starting a py-spy, torchrun a worker)
    would leave an orphan that only the run's final sweep could find, and a
    killed parent's children are re-parented and can no longer be found from it.
    Every group is collected from the same reading of the process table per
    round (a restart stops agents and nodes: one reading costs 0.03-0.1 s).
    """
    import psutil

    found: list[dict[int, psutil.Process]] = []
    for pids in groups:
        procs: dict[int, psutil.Process] = {}
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                procs[pid] = psutil.Process(pid)
        found.append(procs)
    return [Frozen(list(procs.values())) for procs in _frozen_trees(found)]


def _frozen_trees(found: list[dict[int, Any]]) -> list[dict[int, Any]]:
    """Each group of processes (pid -> psutil.Process) with all their descendants, every one of them stopped
    (SIGSTOP) before its children were read, so none can start another unseen; left stopped."""
    import psutil

    frozen: set[int] = set()
    while True:
        pending = [[pid for pid in procs if pid not in frozen] for procs in found]
        if not any(pending):
            break
        for procs, new in zip(found, pending, strict=True):
            for pid in new:
                frozen.add(pid)
                with contextlib.suppress(psutil.Error):
                    procs[pid].suspend()
        children = _children_map()
        for procs, new in zip(found, pending, strict=True):
            for pid in _descendants(new, children):
                with contextlib.suppress(psutil.Error):
                    procs.setdefault(pid, psutil.Process(pid))
    return found


def _children_map() -> dict[int, list[int]]:
    """Parent pid -> its children's pids, from one pass over the process table.

    On Linux each ``/proc/PID/stat`` is read directly: psutil's ``process_iter`` builds an object per process
    and took 4-5 times as long (0.6 s against 0.13 s for 200 processes at load 40), on every round of a stop.
    """
    if not os.path.isdir("/proc/self"):
        import psutil

        children: dict[int, list[int]] = {}
        for p in psutil.process_iter(["ppid"]):
            children.setdefault(p.info["ppid"], []).append(p.pid)
        return children
    children = {}
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            ppid = _parent_of(entry.name)
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry.name))
    return children


def _parent_of(pid: str) -> int | None:
    """The parent pid in ``/proc/PID/stat`` (None: the process is gone). The name before it is in parentheses
    and may hold spaces and parentheses itself, so the fields are counted from the last ')'."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split(b" ", 2)[1])
    except (OSError, ValueError, IndexError):
        return None


def _descendants(pids: Sequence[int], children: dict[int, list[int]] | None = None) -> list[int]:
    """Every descendant of ``pids``, from one pass over the process table (psutil's ``children(recursive=True)``
    reads the whole table once per process asked: a tenth of a second per node tree on a loaded host)."""
    if children is None:
        children = _children_map()
    found: list[int] = []
    todo = list(pids)
    seen = set(todo)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in seen:
                seen.add(child)
                found.append(child)
                todo.append(child)
    return found


def _wait_dead(procs: Sequence[Any], timeout_s: float) -> list[Any]:
    """Wait until every one of ``procs`` (psutil) has died or ``timeout_s`` passed; those still running.

    A zombie counts as dead: a rank's child whose parent died first is left to
    PID 1 to reap, and a container's init may do that only every second or so
    (psutil.wait_procs counts it as alive until then: 1.2 s of each restart).
    Our own children are left for their Popen to reap, with their exit status.
    Woken as each one exits (the agents' eviction waits the same way), not by polling: a restart's old
    processes are waited for while its new ranks start, on the same cores.
    """
    from rankscope.actions.procedures.evict import wait_gone

    return wait_gone(procs, timeout_s)


def marked_processes(run_id: str) -> list[int]:
    """Pids of live processes whose environment carries this run's marker."""
    import psutil

    found = []
    me = os.getpid()
    for p in psutil.process_iter(["pid"]):
        if p.pid == me:
            continue
        try:
            if p.environ().get(RUN_ID_ENV) == run_id and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p.pid)
        except psutil.Error:
            continue
    return found


def sweep(run_id: str, *, rounds: int = 5, found: list[str] | None = None) -> list[int]:
    """Kill every process still marked with ``run_id``; returns those it found.

    ``found`` receives a line per process (pid, parent, command line): what a stop missed, for its notes.
    """
    import psutil

    killed: list[int] = []
    for _ in range(rounds):
        pids = marked_processes(run_id)
        if not pids:
            break
        killed.extend(pids)
        procs = []
        for pid in pids:
            try:
                p = psutil.Process(pid)
                if found is not None:
                    found.append(describe(p))
                p.send_signal(signal.SIGCONT)
                p.kill()
                procs.append(p)
            except psutil.Error:
                continue
        psutil.wait_procs(procs, timeout=2.0)
    return killed


def describe(proc: Any) -> str:
    """One line naming a process (psutil): its pid, its parent's and its command line."""
    import psutil

    try:
        with proc.oneshot():
            return f"{proc.pid} (parent {proc.ppid()}): {' '.join(proc.cmdline())[:200] or proc.name()}"
    except psutil.Error:
        return f"{proc.pid} (gone)"


def reap(proc: subprocess.Popen[bytes]) -> None:
    """Collect a process that was just killed (at most 5 s), so it leaves no zombie."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


# What gRPC and asyncio print when something is closed out of order at shutdown; a clean end prints none of it.
SHUTDOWN_NOISE = ("Traceback", "Exception ignored", "Event loop is closed", "Bad file descriptor",
                  "epoll_wait", "was never awaited", "Task was destroyed")


# torchrun answers the SIGTERM of an orderly stop (the drill's end, a restart) by raising SignalException out of its
# main, which prints a traceback: by design, whatever the order of the shutdown. It cannot be stopped without it:
# SIGTERM is also the parent-death signal that makes torchrun stop its ranks when the drill dies, so torchrun must
# keep handling it. Exactly that report -- its frames and the SignalException for signal 15 -- is not noise.
TORCHRUN_STOPPED = re.compile(r"^Traceback \(most recent call last\):\n(?:[ \t].*\n)*"
                              r"torch\.distributed\.elastic\.multiprocessing\.api\.SignalException: "
                              r"Process \d+ got signal: 15$", re.MULTILINE)


def shutdown_noise(text: str) -> list[str]:
    """The lines of ``text`` (a process's output or log) that hold any of :data:`SHUTDOWN_NOISE`, torchrun's report
    of the SIGTERM that stopped it (:data:`TORCHRUN_STOPPED`) aside."""
    return [line for line in TORCHRUN_STOPPED.sub("", text).splitlines() if any(n in line for n in SHUTDOWN_NOISE)]


def log_tail(path: Path, lines: int = 3) -> str:
    """The last lines of a process's log on one line, for an error that says why it ended."""
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


__all__ = ["SHUTDOWN_NOISE", "TORCHRUN_STOPPED", "Frozen", "Stopping", "describe", "freeze_forest", "kill_trees",
           "log_tail", "marked_processes", "reap", "shutdown_noise", "signal_forest", "signal_trees", "sweep"]
