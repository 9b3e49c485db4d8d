"""The process's one event loop for synchronous callers (rankscope.wire.sync_loop)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading

import pytest
from rankscope.wire.sync_loop import THREAD_NAME, run_sync


async def _where() -> tuple[asyncio.AbstractEventLoop, str]:
    return asyncio.get_running_loop(), threading.current_thread().name


def test_every_caller_of_every_thread_runs_on_the_same_loop_in_its_own_thread() -> None:
    first, thread = run_sync(_where())
    got: list[tuple[asyncio.AbstractEventLoop, str]] = []
    others = [threading.Thread(target=lambda: got.append(run_sync(_where()))) for _ in range(3)]
    for t in others:
        t.start()
    for t in others:
        t.join()
    assert thread == THREAD_NAME
    assert [loop for loop, _ in got] == [first] * 3
    assert run_sync(_where())[0] is first and not first.is_closed()


def test_the_coroutines_result_and_errors_reach_the_caller_as_they_were() -> None:
    async def value() -> list[int]:
        return [1, 2, 3]

    async def fails(exc: BaseException) -> None:
        raise exc

    assert run_sync(value()) == [1, 2, 3]
    with pytest.raises(ValueError, match="bad reply"):
        run_sync(fails(ValueError("bad reply")))
    # grpc.aio raises CancelledError for a call it cancelled itself: the caller sees that one, with its message.
    with pytest.raises(asyncio.CancelledError, match="cancelled a call itself"):
        run_sync(fails(asyncio.CancelledError("cancelled a call itself")))


def test_it_refuses_to_block_a_running_loop_and_closes_the_coroutine() -> None:
    async def inner() -> int:
        return 1

    async def outer() -> str:
        coro = inner()
        with pytest.raises(RuntimeError, match="running event loop"):
            run_sync(coro)
        return "closed" if coro.cr_frame is None else "left open"

    assert asyncio.run(outer()) == "closed"


AT_EXIT = r"""
import asyncio
from rankscope.wire.sync_loop import run_sync

async def leave_one_running():
    async def forever():
        try:
            await asyncio.sleep(3600)
        finally:
            print("unwound at exit", flush=True)
    asyncio.get_running_loop().create_task(forever())
    return "started"

print(run_sync(leave_one_running()), flush=True)
"""


def test_at_exit_what_still_runs_on_the_loop_is_cancelled_and_unwinds_before_the_loop_closes() -> None:
    run = subprocess.run([sys.executable, "-c", AT_EXIT], capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["started", "unwound at exit"], run.stdout + run.stderr
    assert run.stderr == ""
