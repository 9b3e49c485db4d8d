"""Counting what a process group runs outside the Python wrappers, through ``ProcessGroup``'s own hooks (torch 2.14+).

They also see collectives issued from C++ (DDP's reducer). A call that came through a wrapper is already counted, so
the pre-hook skips it (the per-thread flag). torch 2.13 has no such hooks: the path is skipped.
"""

from __future__ import annotations

from typing import Any

from rankscope.ccl_plugin.completion import complete_all, watch
from rankscope.ccl_plugin.counter_file import ensure_writer
from rankscope.ccl_plugin.hook_state import STATE, disable
from rankscope.ccl_plugin.writer import Request


def install_pg_hooks(dist: Any) -> bool:
    """torch 2.14+: ProcessGroup pre/post hooks also see C++-issued collectives (DDP's reducer)."""
    pg_cls = getattr(dist, "ProcessGroup", None)
    STATE.pg_hooks = bool(pg_cls is not None and hasattr(pg_cls, "register_pre_hook")
                          and hasattr(pg_cls, "register_post_hook"))
    return STATE.pg_hooks


def hook_group(pg: Any, idx: int, on_device: bool = False) -> None:
    """Count what ``pg`` runs outside our Python wrappers, through its own hooks.

    Not exercised here: torch 2.13 has no such hooks. The hook arguments are
    read by duck typing (an op ``name`` and an ``op_id`` pairing pre and post),
    and any surprise disables the counters with one line on stderr.
    ``on_device``: the group runs NCCL, whose Works' futures complete at
    enqueue, so completion is polled through ``is_completed()``.
    """
    open_reqs: dict[Any, Request] = {}
    tls = STATE.tls

    def pre(args: Any) -> None:
        if STATE.disabled or getattr(tls, "depth", False):
            return  # issued through a wrapped Python call: already counted
        try:
            w = STATE.writer or ensure_writer()
            op = str(getattr(args, "name", "unknown")).lower()
            open_reqs[getattr(args, "op_id", None)] = w.launch(w.slot(idx, op), 0)
        except Exception as exc:
            disable("ProcessGroup pre-hook", exc)

    def post(args: Any) -> None:
        if STATE.disabled:
            return
        try:
            req = open_reqs.pop(getattr(args, "op_id", None), None)
            if req is None:
                return
            work = getattr(args, "work", None)
            if work is not None:
                watch(work, [req], on_device)
            else:
                complete_all([req])
        except Exception as exc:
            disable("ProcessGroup post-hook", exc)

    pg.register_pre_hook(pre)
    pg.register_post_hook(post)
