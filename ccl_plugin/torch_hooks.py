"""Counting torch.distributed's collectives and p2p calls into the counter file.

Why wrapping functions (and not a backend): it works for every backend (gloo,
NCCL, ...) without user changes. ``install()`` replaces each function both in
``torch.distributed.distributed_c10d`` (so torch's own internal calls and
later ``from ... import`` bindings see it) and in ``torch.distributed`` (so
Megatron's import-time ``from torch.distributed import all_gather_into_tensor``
gets it when the autoload patches before user code runs).

Per call: CL += 1 and one WR per request issued (a p2p call issues one;
``batch_isend_irecv`` counts each op it carries). WC when the request
completes, learned without adding a wait:

- CPU tensors (gloo): a synchronous call has completed when it returns; an
  async Work is kept (the native fast path keeps it in a C ring, the Python
  path in a table) and the background thread's poll asks ``is_completed()``.
  Nothing runs on the user's thread after the call: not a wrapped
  ``Work.wait`` (it cost every wait, the user's and torch's own), not the
  Work's future (its callback runs on the backend's thread and has to take
  the GIL from the user's thread). The poll learns that the Work is over, not
  when: such a completion is WC without TD or N (synchronous calls and the
  NCCL plugin time them).
- CUDA tensors with the NCCL profiler plugin loaded (``NCCL_PROFILER_PLUGIN``
  naming ours): the plugin sees the device's own start and end of every
  collective in its file, so the shim only counts the launch and names the
  group; WC at return, without TD or N (no CUDA event, no Work polling).
- CUDA tensors without the plugin: every call returns once its kernel is enqueued, and
  even ``Work.wait()`` only orders the current stream after it; the Work's
  future is marked complete at enqueue too (its callbacks run at once on
  CUDA-aware futures). So a synchronous call records a CUDA event on the
  current stream right after it returns (torch has ordered that stream after
  the collective, or ran the collective on it) and an async Work is kept as on
  the host; the background thread polls ``event.query()`` /
  ``work.is_completed()`` (both are cudaEventQuery: no host synchronisation,
  never on the user's thread). Under CUDA graph capture nothing runs at call
  time: such calls complete at return.

TD is launch to completion; N (bytes/TD) goes into the ring of the last five.

The per-call path is a handful of attribute and integer operations: each
wrapper caches its (group -> op slot) resolution at first use, arguments are
read by position, and the writer stores only the fields a call changes. Where
the native fast path builds (``native``: a C extension compiled at first use),
a collective's wrapper is a C callable that does a call's whole work (flags,
arguments, cached slot, launch and completion stores, an async Work into the
ring, a CUDA call settled where the plugin times it) and hands everything else
(first use of a group, a payload that is not one tensor, a synchronous CUDA
call without the plugin, a full ring) to the Python code below; otherwise that
Python code is the wrapper. The
background thread polls only while something is open (and a second after),
and a call wakes it only when it sleeps.

Where torch offers ``ProcessGroup.register_pre_hook`` / ``register_post_hook``
(2.14+), those are used as well, since they also see collectives issued from
C++ (DDP's reducer); in 2.13 they do not exist and the path is skipped.

Every hook body is guarded: the first internal error disables the hooks with
one line on stderr, and the user's call proceeds as if we were not there.
torch is imported only inside functions (the plugin must import stdlib only).

This module patches torch and ends the counting; the pieces it installs live
beside it: ``call_args`` (which functions, how a call's arguments are read),
``wrappers`` (the counting wrappers), ``group_slots`` (a group's row and each
wrapper's slot cache), ``completion`` (the background poll: Works, the fast
path's Work ring, CUDA events), ``group_hooks`` (ProcessGroup's own hooks),
``counter_file`` (the file, opened at first use) and ``hook_state`` (what they
share, and the off switch).
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rankscope.ccl_plugin import native
from rankscope.ccl_plugin.call_args import OPS
from rankscope.ccl_plugin.completion import poll
from rankscope.ccl_plugin.group_hooks import install_pg_hooks
from rankscope.ccl_plugin.group_slots import forget_groups, group_entry
from rankscope.ccl_plugin.hook_state import STATE, disable, use_fast
from rankscope.ccl_plugin.wrappers import make_wrapper

ENV_KEEP = "RANKSCOPE_CCL_KEEP"  # "1": leave the file behind at exit (marked clean), for post-mortems


def _wrap_new_group(c10d: Any, dist: Any) -> None:
    """Record each process group's members and description when it is created."""
    orig = c10d.new_group

    @functools.wraps(orig)
    def new_group(*args: Any, **kwargs: Any) -> Any:
        pg = orig(*args, **kwargs)
        if not STATE.disabled:
            try:
                if pg is not None and pg is not c10d.GroupMember.NON_GROUP_MEMBER:
                    group_entry(pg)
            except Exception as exc:
                disable("new_group", exc)
        return pg

    _replace(c10d, dist, "new_group", new_group)


def _wrap_init(c10d: Any, dist: Any) -> None:
    """Open the counter file once the rank is known; steps from the optimizer hook."""
    orig = c10d.init_process_group

    @functools.wraps(orig)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        forget_groups()
        result = orig(*args, **kwargs)
        if not STATE.disabled:
            try:
                group_entry(None)
            except Exception as exc:
                disable("init_process_group", exc)
        return result

    _replace(c10d, dist, "init_process_group", init_process_group)

    orig_destroy = c10d.destroy_process_group

    @functools.wraps(orig_destroy)
    def destroy_process_group(*args: Any, **kwargs: Any) -> Any:
        forget_groups()
        return orig_destroy(*args, **kwargs)

    _replace(c10d, dist, "destroy_process_group", destroy_process_group)


def _replace(c10d: Any, dist: Any, attr: str, new: Any) -> None:
    """Put ``new`` in place of ``attr`` in c10d, and in torch.distributed where it re-exports the same object."""
    old = getattr(c10d, attr)
    setattr(c10d, attr, new)
    if getattr(dist, attr, None) is old:
        setattr(dist, attr, new)



def plugin_loaded(environ: Mapping[str, str] | None = None) -> bool:
    """Whether NCCL loads rankscope's profiler plugin in this process (read once, at install)."""
    from rankscope.ccl_plugin.build import LIB_NAME

    return LIB_NAME in Path((os.environ if environ is None else environ).get("NCCL_PROFILER_PLUGIN", "")).name


def install(directory: Path, job_id: str) -> bool:
    """Patch torch.distributed (imports torch). Returns False and says why when it cannot."""
    if STATE.installed:
        return True
    STATE.directory = directory
    STATE.job_id = job_id
    try:
        # Through sys.modules: this may run inside torch's own first import,
        # when `torch.distributed` is not yet an attribute of `torch`.
        dist = sys.modules["torch.distributed"]
        if not dist.is_available():
            print("rankscope: torch.distributed is not available; CCL counters off", file=sys.stderr)
            return False
        c10d = sys.modules["torch.distributed.distributed_c10d"]
        missing = [n for n in ("get_process_group_ranks", "_get_default_group") if not hasattr(c10d, n)]
        if missing:
            print(f"rankscope: this torch is too old for CCL counters (no {', '.join(missing)})", file=sys.stderr)
            return False
        STATE.dist, STATE.c10d = dist, c10d
        STATE.plugin = plugin_loaded()
        use_fast(native.load())
        for name in OPS:
            orig = getattr(c10d, name, None)
            if orig is None or hasattr(orig, "__rankscope_original__"):
                continue
            _replace(c10d, dist, name, make_wrapper(name, orig))
        _wrap_new_group(c10d, dist)
        _wrap_init(c10d, dist)
        # the optimizer step hook waits for the writer: torch.optim cannot be
        # imported while torch itself is still initialising (we run inside it)
        # ProcessGroup hooks (2.14+): added per group as groups are first seen;
        # they count only calls that did not come through a wrapper.
        install_pg_hooks(dist)
        STATE.installed = True
        return True
    except Exception as exc:
        disable("install", exc)
        return False


def shutdown() -> None:
    """Clean exit: remove this rank's file (atexit)."""
    w = STATE.writer
    if w is not None and w.pid == os.getpid():  # a forked child leaves its parent's file alone
        with contextlib.suppress(Exception):
            poll()
        with contextlib.suppress(Exception):
            w.close(remove=os.environ.get(ENV_KEEP) != "1")

