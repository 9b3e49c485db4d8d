"""Where every process of a drill is started from, and the free loopback port a node or an agent listens on."""

from __future__ import annotations

import queue
import socket
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path


class Spawner:
    """One thread that lives as long as this process and starts every process of every drill.

    Linux sends a child its parent-death signal (the shim's PR_SET_PDEATHSIG) when the *thread* that
    started it ends, not when its process does. A restart runs on the recovery thread (and helpers on
    others), so every process it started -- the restarted job and its agents -- got SIGTERM whenever that
    thread ended: it did after any round that raised until the watcher was made to go on, and still could
    by a BaseException (grpc.aio raises CancelledError, which is no Exception, for a call it cancelled
    itself). The drill then "shut itself down" with no message (#12). Started from this thread, they get
    SIGTERM only when the drill's process itself ends (killed, crashed): what the signal is for.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._jobs: queue.SimpleQueue[_SpawnJob] = queue.SimpleQueue()

    def run(self, start: Callable[[], subprocess.Popen[bytes]]) -> subprocess.Popen[bytes]:
        """``start()`` called on the spawner thread; its process, or what it raised."""
        with self._lock:
            # Not alive in a child forked from this process (fork copies only the forking thread): start one.
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._serve, name="drill-spawner", daemon=True)
                self._thread.start()
        job = _SpawnJob(start)
        self._jobs.put(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        assert job.proc is not None
        return job.proc

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                job.proc = job.start()
            except BaseException as exc:  # handed to the caller: this thread must never end
                job.error = exc
            finally:
                job.done.set()


@dataclass
class _SpawnJob:
    start: Callable[[], subprocess.Popen[bytes]]
    proc: subprocess.Popen[bytes] | None = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


SPAWNER = Spawner()
# How a drill's part starts one process of its run: argv, its log, its environment (``Launcher.popen``).
Start = Callable[[Sequence[str], Path, Mapping[str, str]], subprocess.Popen[bytes]]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


__all__ = ["SPAWNER", "Spawner", "Start", "free_port"]
