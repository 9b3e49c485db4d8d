"""When a counted request completes (WC), learned without a wait on the user's thread.

A blocking host call has completed when it returns. Everything else is kept for the background thread's poll: async
Works (in ``STATE.pending``, or the native fast path's Work ring) are asked ``is_completed()``; a synchronous call on
CUDA tensors gets a CUDA event recorded on the current stream, queried in launch order (``STATE.device_events``).
Where our NCCL profiler plugin is loaded it times the device work, so such requests are settled at once. The thread
polls only while something is open (and ``POLL_LINGER_S`` after), and writes the file's heartbeat every second.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

from rankscope.ccl_plugin.hook_state import STATE, disable
from rankscope.ccl_plugin.writer import Request

POLL_INTERVAL_S = 0.005
POLL_LINGER_S = 1.0  # the poller keeps its fast pace this long after the last open request, so calls need not wake it
EVENT_POOL_MAX = 256  # completed CUDA events kept for reuse (creating one costs more than recording it)
HEARTBEAT_INTERVAL_S = 1.0


def complete_all(reqs: list[Request]) -> None:
    """WC for requests that are over now (TD and N from their launch)."""
    w = STATE.writer
    if w is None:
        return
    for r in reqs:
        w.complete(r)


def settle_all(reqs: list[Request]) -> None:
    """WC for device work the NCCL profiler plugin times: over for the shim, TD and N are the plugin's."""
    w = STATE.writer
    if w is None:
        return
    for r in reqs:
        w.settle(r)


def arm_poller() -> None:
    """Something is open that only the background thread may see finish: make sure it polls."""
    if not STATE.polling:
        STATE.polling = True
        STATE.wake.set()  # it may be in its one-second heartbeat sleep


def complete_on_device(reqs: list[Request]) -> None:
    """A synchronous call on CUDA tensors returned with its work only enqueued: WC when the device is done.

    An event recorded now on the current stream completes after the
    collective (torch ordered this stream after it before returning). The
    background thread polls it; nothing here waits. With the profiler plugin
    loaded the plugin times the device work and the request is settled now.
    """
    if STATE.plugin:
        settle_all(reqs)
        return
    cuda = STATE.cuda
    if cuda is None:
        cuda = STATE.cuda = sys.modules["torch"].cuda
    if cuda.is_current_stream_capturing():
        complete_all(reqs)  # captured into a CUDA graph: nothing was launched now
        return
    pool = STATE.event_pool
    ev = pool.pop() if pool else cuda.Event()
    ev.record()
    STATE.device_events.append((ev, reqs))
    arm_poller()


def poll_device() -> bool:
    """WC for the synchronous CUDA calls the device has finished (background thread): event queries, no waits.

    Returns whether device work is still open.
    """
    q = STATE.device_events
    pool = STATE.event_pool
    while q:
        ev, reqs = q[0]
        try:
            done = bool(ev.query())
        except Exception:  # a failed device (sticky error, aborted communicator) runs nothing any more
            done = True
        if not done:
            break
        q.popleft()
        complete_all(reqs)
        if len(pool) < EVENT_POOL_MAX:
            pool.append(ev)
    return bool(q)


def watch(work: Any, reqs: list[Request], on_device: bool = False) -> None:
    """Arrange for WC when ``work`` completes, without waiting on it: the background poll asks it.

    ``on_device``: a Work on CUDA tensors, whose ``wait()`` returns before the device is done; its
    ``is_completed()`` asks the device. With our NCCL plugin loaded the plugin times it: settled now.
    """
    if on_device and STATE.plugin:
        settle_all(reqs)
        return
    STATE.pending[id(work)] = (work, reqs)
    if not STATE.polling:
        arm_poller()


def poll_pending() -> bool:
    """WC (no TD or N: the poll sees that, not when) for async Works now complete; whether any is still open."""
    pending = STATE.pending
    for key, (work, _reqs) in list(pending.items()):
        try:
            done = bool(work.is_completed())
        except Exception:
            done = True  # a failed Work is no longer in flight either way
        if done:
            entry = pending.pop(key, None)
            if entry is not None:
                settle_all(entry[1])
    return bool(pending)


def open_works() -> int:
    """Async Works the poll still waits on (both paths' keeping places)."""
    return len(STATE.pending) + (len(STATE.ring) if STATE.ring is not None else 0)


# One pass at a time: the background thread polls, and so do the exit (shutdown) and a benchmark's timed blocks;
# two passes over one queue popped the same finished event twice (IndexError on the H200, which disabled the shim).
_POLL_LOCK = threading.Lock()


def poll() -> bool:
    """One pass over everything open; whether anything still is."""
    with _POLL_LOCK:
        ring = STATE.ring
        native = ring.poll() > 0 if ring is not None and len(ring) else False
        works = poll_pending() if STATE.pending else False
        device = poll_device() if STATE.device_events else False
        return native or works or device


def _background() -> None:
    """Heartbeat every second; poll open Works and device work while any are open, and a while after.

    The lingering keeps a job that issues async work step after step from waking this thread on every
    call (a wake costs the caller a lock and this thread the GIL).
    """
    linger = max(1, int(POLL_LINGER_S / POLL_INTERVAL_S))
    quiet = 0
    next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
    while True:
        try:
            if STATE.polling:
                STATE.wake.wait(POLL_INTERVAL_S)
                STATE.wake.clear()
                if poll():
                    quiet = 0
                else:
                    quiet += 1
                    if quiet >= linger:
                        STATE.polling = False
                        quiet = 0
            else:
                STATE.wake.wait(max(0.0, next_beat - time.monotonic()))
                STATE.wake.clear()
                if poll():  # opened while this thread was going to sleep: no wake came
                    STATE.polling = True
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_INTERVAL_S
                w = STATE.writer
                if w is not None:
                    w.heartbeat()
        except Exception as exc:
            disable("heartbeat thread", exc)
            return


def start_thread() -> None:
    if STATE.thread is None:
        STATE.thread = threading.Thread(target=_background, name="rankscope-ccl", daemon=True)
        STATE.thread.start()

