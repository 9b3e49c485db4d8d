"""One event loop per process for the gRPC calls of synchronous callers (scripts, the drill, the benchmarks).

Why not ``asyncio.run`` per call: grpc.aio has one completion-queue poller per
process, and every event loop that made a channel stays bound to its socket.
A call cancelled as its channel closes (a stream left before its end) completes
inside gRPC a moment later, and whichever live loop reads that completion hands
it to the loop the call belonged to. When that loop was an ``asyncio.run``
that has already returned, the handover fails and prints "Exception in callback
PollerCompletionQueue._handle_events ... RuntimeError: Event loop is closed".
With every synchronous caller of the process on this one loop -- the main
thread's one-off calls and the drill's recovery thread alike -- there is no
closed loop for such a completion to be handed to: the loop lives until the
process exits, and closes then, after the work on it has ended.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar, cast

T = TypeVar("T")

CLOSE_GRACE_S = 5.0  # at exit, and after an interrupt: how long cancelled work may take to close its channels
THREAD_NAME = "rankscope-grpc-loop"


class _Loop:
    """The loop and the thread that runs it, in the process that started them."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.loop.call_soon(ready.set)
        self.thread = threading.Thread(target=self.loop.run_forever, name=THREAD_NAME, daemon=True)
        self.thread.start()
        ready.wait()

    def close(self) -> None:
        """End what still runs on the loop (its channels close as it unwinds), then stop and close the loop."""
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result(CLOSE_GRACE_S)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(CLOSE_GRACE_S)
        if self.thread.is_alive():  # something blocks the loop's thread: leave the loop to the process's end
            return
        with contextlib.suppress(Exception):
            self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()


async def _cancel_all() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_asyncgens()


_lock = threading.Lock()
_current: _Loop | None = None
_closed = False


def _the_loop() -> _Loop:
    global _current
    with _lock:
        if _closed:
            raise RuntimeError("rankscope's gRPC loop is closed: the process is exiting")
        if _current is None or _current.pid != os.getpid():  # a forked child has the object but not the thread
            _current = _Loop()
        return _current


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to its end on the process's gRPC loop and return its result (or raise its error); the calling
    thread waits. Like ``asyncio.run``, not from inside a running event loop. An interrupt (Ctrl-C) cancels
    ``coro`` and waits for it to unwind, so its channels are closed before the interrupt goes on."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        coro.close()
        raise RuntimeError("run_sync() cannot be called from a running event loop; await the coroutine instead")
    unwound = threading.Event()
    raised: list[BaseException] = []

    async def guarded() -> T | None:
        try:
            return await coro
        except BaseException as exc:  # handed to the caller below, as raised
            # Not through the future: it would turn a CancelledError of the coroutine's own (grpc.aio raises one
            # for a call it cancelled itself) into concurrent.futures.CancelledError without its message.
            raised.append(exc)
            return None
        finally:
            unwound.set()

    try:
        future = asyncio.run_coroutine_threadsafe(guarded(), _the_loop().loop)
    except BaseException:
        coro.close()
        raise
    try:
        result = future.result()
    except BaseException:
        if not future.done():  # interrupted while waiting: the work stops, and is left only once it has unwound
            future.cancel()
            unwound.wait(CLOSE_GRACE_S)
        raise
    if raised:
        raise raised[0]
    return cast(T, result)


def close() -> None:
    """Close the loop (at exit; registered when this module is imported, so any exit handler of the code that uses
    it -- registered later -- runs first, while the loop still runs). Later calls of ``run_sync`` fail."""
    global _closed
    with _lock:
        _closed = True
        current = _current
    if current is not None and current.pid == os.getpid():
        current.close()


atexit.register(close)

__all__ = ["close", "run_sync"]
