"""What the counting hooks share: one state object, the per-thread "inside a wrapped call" flag, and the off switch.

Every hook body reports its first internal error through ``disable``: counting stops with one line on stderr and the
user's call proceeds as if the hooks were not there. Never raises.
"""

from __future__ import annotations

import collections
import contextlib
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

from rankscope.ccl_plugin.writer import CounterWriter, Request


class _ThreadFlags(threading.local):
    """Per thread: inside a wrapped call (its inner calls and the ProcessGroup hooks count nothing)."""

    depth = False


class _State:
    """Everything the hooks share, in one place so tests can reset it."""

    def __init__(self) -> None:
        self.writer: CounterWriter | None = None
        self.directory: Path | None = None
        self.job_id = "job"
        self.disabled = False
        self.installed = False
        self.tls: Any = _ThreadFlags()  # or the fast path's ThreadFlags (use_fast)
        self.groups: dict[int, tuple[Any, int, tuple[int, ...]]] = {}  # id(pg) -> (pg, comm index, members)
        # id(work) -> (work, requests): async Works (host or device) not yet seen complete. Only single
        # dict operations touch it (atomic under the GIL), so settling needs no lock.
        self.pending: dict[int, tuple[Any, list[Request]]] = {}
        self.wake = threading.Event()
        self.polling = False  # the background thread polls at its fast pace (no wake needed)
        self.plugin = False  # NCCL's profiler plugin is ours: it times device work, the shim only counts
        self.thread: threading.Thread | None = None
        self.dist: Any = None
        self.pg_hooks = False  # torch offers ProcessGroup.register_pre_hook / register_post_hook
        self.c10d: Any = None
        # Device completion (CUDA tensors): events recorded after synchronous calls, in launch order
        # (one stream completes in order, so the poller looks at the oldest first). Async Works (host or
        # device) wait in ``pending`` (or the fast path's ring) for ``is_completed()``.
        self.device_events: collections.deque[tuple[Any, list[Request]]] = collections.deque()
        self.event_pool: list[Any] = []
        self.cuda: Any = None  # torch.cuda, once the first CUDA payload is seen
        self.fast: ModuleType | None = None  # the native fast path, when it loaded (chosen at install)
        self.ring: Any = None  # the fast path's WorkRing: async Works its wrappers keep for the poll


STATE = _State()


def use_fast(fast: ModuleType | None) -> None:
    """Count through the native fast path (``fast``) or in Python (None), before any wrapper is made.

    With the fast path the per-thread "inside a wrapped call" flag is its C thread-local, which the Python
    code reads and sets through the same attribute, so both paths see one flag.
    """
    STATE.fast = fast
    STATE.tls = fast.ThreadFlags() if fast is not None else _ThreadFlags()
    STATE.ring = fast.WorkRing() if fast is not None else None



def disable(where: str, exc: BaseException) -> None:
    """First internal failure: stop counting, say so once, never raise."""
    if not STATE.disabled:
        STATE.disabled = True
        with contextlib.suppress(Exception):
            print(f"rankscope: CCL counters disabled after an internal error in {where}: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
