"""Host and per-process readings through psutil.

CPU percentages are rates: psutil measures them between two calls on the same
``psutil.Process`` object (or, for the whole host, between two calls of
``psutil.cpu_percent``). An agent is polled again and again, so this module
keeps the process objects it has seen and reports the CPU used since the last
reading. The very first reading of a process has no earlier sample; it is
reported as ``None`` (unknown) rather than psutil's meaningless ``0.0``.
A one-shot capture primes the samples first (``prime_cpu``) and reads them at
the end, so it measures over the time the capture took.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from typing import TypeVar

import psutil
from rankscope.contract.snapshot import HostMetrics, ProcessInfo, ProcessRole

T = TypeVar("T")

_lock = threading.Lock()
# pid -> Process object holding psutil's last CPU sample. A pid reused by a new
# process is told apart by psutil itself (Process.is_running compares creation
# times), so a stale entry is replaced rather than trusted.
_tracked: dict[int, psutil.Process] = {}
_sampled: set[int] = set()
_host_primed = False


def _tracked_process(pid: int) -> tuple[psutil.Process, bool]:
    """The cached Process for ``pid`` and whether it already holds a CPU sample."""
    with _lock:
        proc = _tracked.get(pid)
        if proc is not None and proc.is_running():
            return proc, pid in _sampled
        proc = psutil.Process(pid)
        _tracked[pid] = proc
        _sampled.discard(pid)
        return proc, False


def forget_dead() -> None:
    """Drop cached processes that have exited (called once per discovery, not per process)."""
    with _lock:
        for pid in [p for p, proc in _tracked.items() if not proc.is_running()]:
            del _tracked[pid]
            _sampled.discard(pid)


def prime_cpu(pids: Iterable[int] = ()) -> None:
    """Take a first CPU sample of the host and of ``pids`` so a later reading is a real rate."""
    global _host_primed
    psutil.cpu_percent(interval=None)
    _host_primed = True
    for pid in pids:
        try:
            proc, _ = _tracked_process(pid)
            proc.cpu_percent(interval=None)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        with _lock:
            _sampled.add(pid)


def process_info(pid: int, role: ProcessRole) -> ProcessInfo | None:
    """psutil's view of one process, or None when it no longer exists.

    Each field is read on its own: a field the kernel refuses (another user's
    process) is ``None`` while the rest is still reported.
    """
    try:
        proc, has_sample = _tracked_process(pid)
        with proc.oneshot():
            ppid = proc.ppid()
            name = proc.name()
            cmdline = tuple(_or_none(proc.cmdline) or ())
            state = _or_none(proc.status)
            cpu = _or_none(lambda: proc.cpu_percent(interval=None))
            mem = _or_none(proc.memory_info)
            threads = _or_none(proc.num_threads)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        # Even the name is refused: report the pid and nothing else.
        return ProcessInfo(pid=pid, ppid=0, role=role, name="")
    with _lock:
        _sampled.add(pid)
    return ProcessInfo(
        pid=pid,
        ppid=ppid,
        role=role,
        name=name,
        cmdline=cmdline,
        state=state,
        cpu_percent=cpu if has_sample else None,
        rss_bytes=mem.rss if mem is not None else None,
        num_threads=threads,
    )


def host_metrics() -> HostMetrics:
    """CPU, memory and load of the whole machine; never raises."""
    global _host_primed
    errors: list[str] = []
    cpu: float | None = None
    try:
        value = psutil.cpu_percent(interval=None)
        cpu = value if _host_primed else None
        _host_primed = True
    except OSError as exc:  # /proc/stat unreadable
        errors.append(f"cpu: {exc}")
    total = used = None
    try:
        vm = psutil.virtual_memory()
        total, used = vm.total, vm.used
    except OSError as exc:
        errors.append(f"memory: {exc}")
    load: float | None = None
    try:
        load = os.getloadavg()[0]
    except OSError as exc:
        errors.append(f"load: {exc}")
    return HostMetrics(
        cpu_percent=cpu,
        cpu_count=psutil.cpu_count(),
        mem_total_bytes=total,
        mem_used_bytes=used,
        load_1m=load,
        error="; ".join(errors) or None,
    )


def _or_none(read: Callable[[], T]) -> T | None:
    """One psutil field, or None when the kernel refuses it (another user's process)."""
    try:
        return read()
    except psutil.AccessDenied:
        return None
