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
        """Wait until every process ended; SIGKILL what is still running at ``kill_at`` and wait for it too."""
        import psutil

        alive = _wait_dead(self.procs, max(0.0, self.kill_at - time.monotonic()))
        for p in alive:
            with contextlib.suppress(psutil.Error):
                p.kill()
        _wait_dead(alive, self.grace_s)
        self.procs = []


def signal_trees(pids: Sequence[int], *, grace_s: float = 2.0) -> Stopping:
    """SIGTERM each process with all its descendants, now; ``finish()`` on the result waits (and SIGKILLs).

    The trees are frozen (SIGSTOP) and collected again until no new process
    shows up before anything is terminated: a process that forks between the
    collection and its signal (an agent starting a py-spy, torchrun a worker)
    would leave an orphan that only the run's final sweep could find, and a
    killed parent's children are re-parented and can no longer be found from it.
    """
    import psutil

    procs: dict[int, psutil.Process] = {}
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs[pid] = psutil.Process(pid)
    frozen: set[int] = set()
    while pending := [p for pid, p in procs.items() if pid not in frozen]:
        for p in pending:
            frozen.add(p.pid)
            with contextlib.suppress(psutil.Error):
                p.suspend()
        for pid in _descendants([p.pid for p in pending]):
            with contextlib.suppress(psutil.Error):
                procs.setdefault(pid, psutil.Process(pid))
    for p in procs.values():
        with contextlib.suppress(psutil.Error):
            p.terminate()  # pending while stopped...
            p.resume()  # ...delivered now (and a rank stopped by the thermal fault runs to die)
    return Stopping(list(procs.values()), time.monotonic() + grace_s, grace_s)


def _descendants(pids: Sequence[int]) -> list[int]:
    """Every descendant of ``pids``, from one pass over the process table (psutil's ``children(recursive=True)``
    reads the whole table once per process asked: a tenth of a second per node tree on a loaded host)."""
    import psutil

    children: dict[int, list[int]] = {}
    for p in psutil.process_iter(["ppid"]):
        children.setdefault(p.info["ppid"], []).append(p.pid)
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
    """
    import psutil

    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    while True:
        still = []
        for p in pending:
            with contextlib.suppress(psutil.Error):  # gone: NoSuchProcess
                if p.status() != psutil.STATUS_ZOMBIE:
                    still.append(p)
        pending = still
        if not pending or time.monotonic() >= deadline:
            return pending
        time.sleep(0.02)


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


def sweep(run_id: str, *, rounds: int = 5) -> list[int]:
    """Kill every process still marked with ``run_id``; returns those it found."""
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
                p.send_signal(signal.SIGCONT)
                p.kill()
                procs.append(p)
            except psutil.Error:
                continue
        psutil.wait_procs(procs, timeout=2.0)
    return killed


def reap(proc: subprocess.Popen[bytes]) -> None:
    """Collect a process that was just killed (at most 5 s), so it leaves no zombie."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def log_tail(path: Path, lines: int = 3) -> str:
    """The last lines of a process's log on one line, for an error that says why it ended."""
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


__all__ = ["Stopping", "kill_trees", "log_tail", "marked_processes", "reap", "signal_trees", "sweep"]
