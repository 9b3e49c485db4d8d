"""Waiting for processes to end, as a stop does (the agents' eviction, a drill restart): woken by each exit."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from unittest import mock

import psutil
import pytest
from rankscope.actions.procedures.evict import wait_gone


def _sleeper(seconds: float = 120.0) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", f"print(flush=True); import time; time.sleep({seconds})"],
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None
    proc.stdout.readline()  # started (and past its imports)
    return proc


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfd", "polled"])
def test_the_processes_still_running_are_returned_and_the_ended_ones_are_not(pidfds: bool) -> None:
    ends, stays = _sleeper(), _sleeper()
    try:
        handles = [psutil.Process(ends.pid), psutil.Process(stays.pid)]
        ends.terminate()
        os.waitid(os.P_PID, ends.pid, os.WEXITED | os.WNOWAIT)  # ended, not reaped: a zombie counts as ended
        with contextlib.ExitStack() as stack:
            if not pidfds:
                stack.enter_context(mock.patch.object(os, "pidfd_open", side_effect=OSError("no pidfds")))
            assert [p.pid for p in wait_gone(handles, 0.5)] == [stays.pid]  # at the deadline: those left...
            assert ends.poll() is not None  # ... the ended one left for its parent to reap
            stays.kill()
            assert wait_gone(handles, 60.0) == []  # ... or once every one has ended
    finally:
        for proc in (ends, stays):
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def test_a_process_reaped_before_the_wait_or_whose_pid_was_reused_counts_as_ended() -> None:
    proc = _sleeper()
    handle = psutil.Process(proc.pid)
    proc.kill()
    proc.wait(timeout=10)
    assert wait_gone([handle], 60.0) == []
    with mock.patch.object(psutil.Process, "is_running", return_value=False):  # the pid now names another process
        other = _sleeper()
        try:
            assert wait_gone([psutil.Process(other.pid)], 60.0) == []
        finally:
            other.kill()
            other.wait(timeout=10)
