"""Sampling every rank's main thread a few times a second without pausing it.

One ``py-spy record --nonblocking`` per rank runs for a window of a few
seconds at a few Hz and writes its samples as collapsed stacks (``--format
raw --threads --idle``: idle threads included, since a rank waiting in a
collective is "idle" to the OS); the main thread's samples are classified
(``analyzers.stack_samples``) into one ``StackSampleWindow``, and the next
window starts. Non-blocking sampling reads the rank's memory while it runs:
a paused many-thread process costs milliseconds per sample, and pausing every
rank several times a second would itself make the job slow.

Why windows of separate py-spy runs rather than one endless one: py-spy
writes its output only when a recording ends, and a window's process costs a
few tens of milliseconds of CPU to start (measured ~60 ms), against a window of
seconds; the window is a trade between that cost and how soon a verdict can come.
So a rank's first window is short (``window_s``: the first figures within
seconds of attaching) and the ones after it longer (``steady_window_s``): the
samples per second are the same, the starts, measured at 60 % of the cost at
5 s windows, are halved.

The sampler runs only while someone asks for it: each request renews a lease
(``lease_s``); when polls stop, the loops end after their current window.
A failure (ptrace refused, the rank gone, py-spy missing) becomes a window
with an ``error`` and the fix, never an exception in the agent.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from rankscope.contract.collapsed import parse_collapsed
from rankscope.contract.snapshot import CaptureError, CaptureErrorKind, RankInfo, StackSampleWindow
from rankscope.probes.pyspy import FIX_FAILED, FIX_TOOL_MISSING, classify_pyspy_failure, kill_and_reap, pyspy_binary

MIN_RATE_HZ, MAX_RATE_HZ = 1, 20
DEFAULT_WINDOW_S = 5  # each window is one py-spy start (~60 ms of CPU): longer windows, fewer starts
STEADY_WINDOW_S = 10  # every window of a rank after its first
RETRY_PAUSE_S = 2.0  # after a failed window, before the next try (a refused ptrace must not spin)


class StackSampler:
    """Per-rank sampling loops, started on demand and kept while the lease is renewed."""

    def __init__(self, window_s: int = DEFAULT_WINDOW_S, keep_s: float = 120.0, lease_s: float = 30.0,
                 binary: str | None = None, steady_window_s: int = STEADY_WINDOW_S) -> None:
        self.window_s = max(1, int(window_s))
        self.steady_window_s = max(self.window_s, int(steady_window_s))
        self.keep_s = keep_s
        self.lease_s = lease_s
        self.binary = binary if binary is not None else pyspy_binary()
        self.rate_hz = 0
        self._demanded = -1e18
        self._tasks: dict[int, asyncio.Task[None]] = {}  # pid -> its loop
        self._windows: list[StackSampleWindow] = []
        self._dir = Path(tempfile.mkdtemp(prefix="rankscope-samples-"))

    @property
    def active(self) -> bool:
        return any(not t.done() for t in self._tasks.values())

    def demand(self, ranks: Sequence[RankInfo], rate_hz: float) -> None:
        """Renew the lease and make sure every rank's main process has a loop (call from the event loop)."""
        self._demanded = time.monotonic()
        self.rate_hz = int(min(MAX_RATE_HZ, max(MIN_RATE_HZ, round(rate_hz))))
        for r in ranks:
            task = self._tasks.get(r.pid)
            if task is None or task.done():
                self._tasks[r.pid] = asyncio.create_task(self._loop(r.rank, r.pid), name=f"sample-{r.pid}")

    def windows(self) -> tuple[StackSampleWindow, ...]:
        """The windows that ended within ``keep_s``, oldest first."""
        cutoff = time.time() - self.keep_s
        self._windows = [w for w in self._windows if w.end_wall >= cutoff]
        return tuple(self._windows)

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def _loop(self, rank: int, pid: int) -> None:
        length = self.window_s
        while time.monotonic() - self._demanded < self.lease_s:
            window = await self.sample_once(rank, pid, self.rate_hz or MIN_RATE_HZ, length)
            self._windows.append(window)
            length = self.steady_window_s
            if window.error is not None:
                if window.error.kind in (CaptureErrorKind.GONE, CaptureErrorKind.TOOL_MISSING):
                    return  # a restarted rank is a new pid, with a new loop
                await asyncio.sleep(RETRY_PAUSE_S)

    async def sample_once(self, rank: int, pid: int, rate_hz: int, window_s: int | None = None) -> StackSampleWindow:
        """One window of one process: ``window_s`` seconds (default: the first window's) at ``rate_hz``, classified."""
        start = time.time()
        seconds = window_s or self.window_s

        def failed(error: CaptureError) -> StackSampleWindow:
            return StackSampleWindow(rank, pid, start, time.time(), error=error)

        if self.binary is None:
            return failed(CaptureError(CaptureErrorKind.TOOL_MISSING, "py-spy is not installed", FIX_TOOL_MISSING))
        out = self._dir / f"{pid}.raw"
        out.unlink(missing_ok=True)
        proc = await asyncio.create_subprocess_exec(
            self.binary, "record", "--nonblocking", "--idle", "--threads", "--nolineno", "--format", "raw",
            "--rate", str(rate_hz), "--duration", str(seconds), "--pid", str(pid), "--output", str(out),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            _, err = await asyncio.wait_for(proc.communicate(), seconds + 15.0)
        except TimeoutError:
            await kill_and_reap(proc)
            return failed(classify_pyspy_failure(None, "", pid))
        except asyncio.CancelledError:
            # Reaped here, while the loop runs: a transport left to the garbage collector after the loop closed
            # prints "Event loop is closed" tracebacks on the agent's way out.
            await kill_and_reap(proc)
            raise
        if proc.returncode != 0 or not out.is_file():
            return failed(classify_pyspy_failure(proc.returncode, err.decode(errors="replace"), pid))
        try:
            counts = parse_collapsed(out.read_text(errors="replace"), pid)
        except ValueError as exc:
            return failed(CaptureError(CaptureErrorKind.FAILED, f"unreadable py-spy samples for pid {pid}: {exc}",
                                       FIX_FAILED.format(pid=pid)))
        return StackSampleWindow(rank, pid, start, time.time(), collective=counts["collective"], p2p=counts["p2p"],
                                 compute=counts["compute"], data=counts["data"], other=counts["other"])
