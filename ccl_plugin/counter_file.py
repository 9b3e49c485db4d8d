"""This rank's counter file, opened at the first counted call (the rank is known only once a group exists).

Opening it starts what lives as long as the file: the background poll and heartbeat thread, and the optimizer's
step hook that counts steps.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rankscope.ccl_plugin.completion import start_thread
from rankscope.ccl_plugin.hook_state import STATE, disable
from rankscope.ccl_plugin.writer import CounterWriter


def ensure_writer() -> CounterWriter:
    """The open counter file, opened now if this is the first call."""
    w = STATE.writer
    if w is None:
        c10d = STATE.c10d
        directory = STATE.directory or Path("/dev/shm/rankscope")
        w = CounterWriter(directory, rank=int(c10d.get_rank()), world_size=int(c10d.get_world_size()),
                          job_id=STATE.job_id, fast=STATE.fast)
        STATE.writer = w
        start_thread()
        try:
            install_step_hook()
        except Exception as exc:  # counters still work without step counts
            print(f"rankscope: optimizer step counting off: {type(exc).__name__}: {exc}", file=sys.stderr)
    return w


def install_step_hook() -> None:
    """Count optimizer steps into the file (torch.optim is imported here: never while torch initialises)."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def on_step(_opt: Any, _args: Any, _kwargs: Any) -> None:
        if STATE.disabled or STATE.writer is None:
            return
        try:
            STATE.writer.step()
        except Exception as exc:
            disable("optimizer step hook", exc)

    register_optimizer_step_post_hook(on_step)
