"""py-spy capture against real processes, and each way it fails, for real.

- permission denied: real py-spy run as `nobody` (setpriv) against a root process;
- process gone: a pid that has exited;
- time-out: a target frozen by the cgroup freezer (state D), which really makes
  py-spy hang in ptrace, killed at its limit;
- stopped target, non-Python target, py-spy missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from agent_helpers import wait_ready_file
from rankscope.contract.snapshot import CaptureErrorKind, ProcessInfo, ProcessRole, RankInfo
from rankscope.probes import pyspy
from rankscope.probes.pyspy import (
    capture_stacks,
    classify_pyspy_failure,
    dump_process,
    parse_pyspy_dump,
    pyspy_binary,
)

TARGET = """
import os, sys, threading, time
def helper_waits(event):
    event.wait()
def hold_in_named_function(release):
    while not os.path.exists(release):
        time.sleep(0.05)
event = threading.Event()
threading.Thread(target=helper_waits, args=(event,), name="helper_thread", daemon=True).start()
open(sys.argv[2], "w").close()
hold_in_named_function(sys.argv[1])
"""

# stderr of py-spy 0.4.3 (RUST_BACKTRACE=0), recorded on this machine.
PERMISSION_STDERR = "Permission Denied: Try running again with elevated permissions by going 'sudo env \"PATH=$PATH\" !!'\n"
GONE_STDERR = (
    "Error: Failed to get process executable name. Check that the process is running.\n\nCaused by:\n"
    "    0: No such file or directory (os error 2)\n    1: No such file or directory (os error 2)\n"
)
NOT_PYTHON_STDERR = "Error: Failed to find python version from target process\n"
STOPPED_STDERR = (
    "Error: Failed to get stack traces\n\nCaused by:\n    0: Failed to suspend process\n"
    "    1: unexpected waitpid result PtraceEvent(Pid(5270), SIGSTOP, 128) to 5270\n"
)


@pytest.fixture
def target(tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A live Python process parked in `hold_in_named_function`, with a named helper thread."""
    ready = tmp_path / "ready"
    proc = subprocess.Popen([sys.executable, "-c", TARGET, str(tmp_path / "release"), str(ready)])
    try:
        wait_ready_file(ready, proc, 30)
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=10)


def _exited_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


# --------------------------------------------------------------------------
# Success
# --------------------------------------------------------------------------


async def test_dump_reads_real_frames_innermost_first(target: subprocess.Popen[bytes]) -> None:
    stack = await dump_process(target.pid, ProcessRole.MAIN, timeout_s=20, name="python")
    assert stack.error is None and stack.threads is not None
    assert (stack.pid, stack.role, stack.name) == (target.pid, ProcessRole.MAIN, "python")
    assert stack.capture_seconds is not None
    threads = {t.thread_name: t for t in stack.threads}
    main = threads["MainThread"]
    assert [f.name for f in main.frames] == ["hold_in_named_function", "<module>"]
    assert main.os_thread_id == target.pid
    assert all(not f.native and isinstance(f.line, int) for f in main.frames)
    helper = [f.name for f in threads["helper_thread"].frames]
    assert "helper_waits" in helper and helper.index("helper_waits") > helper.index("Event.wait")


async def test_native_frames_are_marked_and_carry_no_addresses(target: subprocess.Popen[bytes]) -> None:
    stack = await dump_process(target.pid, ProcessRole.MAIN, native=True, timeout_s=30)
    assert stack.error is None and stack.threads is not None
    frames = [f for t in stack.threads for f in t.frames]
    native = [f for f in frames if f.native]
    assert native and all(f.module for f in native)
    assert "hold_in_named_function" in [f.name for f in frames if not f.native]
    assert not [f.name for f in frames if re.match(r"^0x[0-9a-f]+$", f.name)]


def test_parse_round_trips_a_saved_dump(target: subprocess.Popen[bytes], tmp_path: Path) -> None:
    """`rankscope analyze --pyspy-dir` reads files like this one."""
    binary = pyspy_binary()
    assert binary is not None
    out = subprocess.run([binary, "dump", "--pid", str(target.pid), "--json"], capture_output=True, text=True,
                         timeout=30, check=True).stdout
    stack = parse_pyspy_dump(json.loads(out), target.pid, ProcessRole.MAIN)
    assert stack.error is None and stack.threads is not None
    assert "hold_in_named_function" in [f.name for t in stack.threads for f in t.frames]


def test_parse_rejects_malformed_input_without_raising() -> None:
    for bad in ({"threads": []}, [1, 2], [{"frames": "nope"}], "text"):
        stack = parse_pyspy_dump(bad, 42, ProcessRole.OTHER)
        assert stack.threads is None
        assert stack.error is not None and stack.error.kind is CaptureErrorKind.FAILED
        assert "42" in stack.error.message and stack.error.fix


def test_binary_is_found_next_to_the_interpreter() -> None:
    assert pyspy_binary() == str(Path(sys.executable).parent / "py-spy")


# --------------------------------------------------------------------------
# Failures, for real
# --------------------------------------------------------------------------


async def test_permission_denied_when_py_spy_runs_unprivileged(
    target: subprocess.Popen[bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    setpriv = shutil.which("setpriv")
    real = pyspy_binary()
    if os.geteuid() != 0 or setpriv is None or real is None:
        pytest.skip("needs root and setpriv to run py-spy as nobody against a root process")
    wrapper = tmp_path / "py-spy-as-nobody"
    wrapper.write_text(f'#!/bin/sh\nexec {setpriv} --reuid=65534 --regid=65534 --clear-groups {real} "$@"\n')
    wrapper.chmod(0o755)
    monkeypatch.setattr(pyspy, "pyspy_binary", lambda: str(wrapper))
    stack = await dump_process(target.pid, ProcessRole.MAIN, timeout_s=20)
    assert stack.threads is None and stack.error is not None
    assert stack.error.kind is CaptureErrorKind.PERMISSION
    assert str(target.pid) in stack.error.message
    assert "SYS_PTRACE" in stack.error.fix and "ptrace_scope" in stack.error.fix


async def test_process_gone() -> None:
    pid = _exited_pid()
    stack = await dump_process(pid, ProcessRole.MAIN, timeout_s=20)
    assert stack.threads is None and stack.error is not None
    assert stack.error.kind is CaptureErrorKind.GONE
    assert "exited" in stack.error.fix
    assert (stack.error.process_state, stack.error.wchan) == ("gone", None)
    assert stack.error.message.endswith("[process gone]")


@pytest.fixture
def frozen(target: subprocess.Popen[bytes]) -> Iterator[int]:
    """The target frozen by the cgroup v1 freezer: uninterruptible, as a process stuck in I/O."""
    base = Path("/sys/fs/cgroup/freezer")
    group = base / f"rankscope-test-{os.getpid()}-{target.pid}"
    try:
        group.mkdir()
        (group / "cgroup.procs").write_text(str(target.pid))
        (group / "freezer.state").write_text("FROZEN")
    except OSError as exc:
        with contextlib.suppress(OSError):
            group.rmdir()
        pytest.skip(f"cgroup freezer not usable here: {exc}")
    try:
        yield target.pid
    finally:
        (group / "freezer.state").write_text("THAWED")
        (base / "cgroup.procs").write_text(str(target.pid))
        group.rmdir()


async def test_timeout_on_a_frozen_process_kills_py_spy(frozen: int) -> None:
    stack = await dump_process(frozen, ProcessRole.MAIN, timeout_s=1.0)
    assert stack.threads is None and stack.error is not None
    assert stack.error.kind is CaptureErrorKind.TIMEOUT
    assert f"/proc/{frozen}/stack" in stack.error.fix
    # frozen by the cgroup freezer: uninterruptible sleep, parked in the freezer's kernel function
    assert stack.error.process_state == "D" and stack.error.wchan is not None
    assert f"state D (uninterruptible sleep), in {stack.error.wchan}" in stack.error.message
    # The py-spy that hung was killed and reaped, not left behind.
    leftovers = [p for p in psutil.process_iter(["name", "cmdline"])
                 if p.info["name"] == "py-spy" and str(frozen) in (p.info["cmdline"] or [])]
    assert leftovers == []


async def test_stopped_process_names_the_fix(target: subprocess.Popen[bytes]) -> None:
    os.kill(target.pid, signal.SIGSTOP)
    # The signal is delivered asynchronously: on a loaded machine /proc can still say R for a moment.
    deadline = time.monotonic() + 20
    while Path(f"/proc/{target.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the target did not stop"
        time.sleep(0.01)
    [captured] = await capture_stacks([RankInfo(rank=0, local_rank=0, world_size=1, pid=target.pid)], timeout_s=20)
    stack = captured.main
    assert stack.error is not None and stack.error.kind is CaptureErrorKind.FAILED
    assert f"kill -CONT {target.pid}" in stack.error.fix
    # the agent records what /proc says of the process: stopped, in the kernel's signal-stop
    assert stack.error.process_state == "T"
    assert stack.error.wchan == Path(f"/proc/{target.pid}/wchan").read_text().strip() != ""
    assert "[state T (stopped)" in stack.error.message


async def test_process_already_traced_by_another_tool_names_it(target: subprocess.Popen[bytes]) -> None:
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is needed to hold the target traced")
    tracer = subprocess.Popen([strace, "-p", str(target.pid), "-o", os.devnull], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while f"TracerPid:\t{tracer.pid}" not in Path(f"/proc/{target.pid}/status").read_text():
            assert tracer.poll() is None and time.monotonic() < deadline, "strace did not attach"
            time.sleep(0.02)
        stack = await dump_process(target.pid, ProcessRole.MAIN, timeout_s=20)
    finally:
        tracer.terminate()
        tracer.wait(timeout=10)
    assert stack.error is not None and stack.error.kind is CaptureErrorKind.FAILED
    assert f"traced by pid {tracer.pid} (strace)" in stack.error.message
    assert f"kill {tracer.pid}" in stack.error.fix


async def test_non_python_process() -> None:
    proc = subprocess.Popen(["sleep", "60"])
    try:
        stack = await dump_process(proc.pid, ProcessRole.OTHER, timeout_s=20)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert stack.error is not None and stack.error.kind is CaptureErrorKind.NOT_PYTHON


async def test_py_spy_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pyspy, "pyspy_binary", lambda: None)
    stack = await dump_process(os.getpid(), ProcessRole.MAIN)
    assert stack.error is not None and stack.error.kind is CaptureErrorKind.TOOL_MISSING
    assert "pip install py-spy" in stack.error.fix


def test_classification_of_recorded_messages(target: subprocess.Popen[bytes]) -> None:
    live = target.pid
    assert classify_pyspy_failure(None, "", live).kind is CaptureErrorKind.TIMEOUT
    assert classify_pyspy_failure(1, PERMISSION_STDERR, live).kind is CaptureErrorKind.PERMISSION
    assert classify_pyspy_failure(1, GONE_STDERR, _exited_pid()).kind is CaptureErrorKind.GONE
    assert classify_pyspy_failure(1, NOT_PYTHON_STDERR, live).kind is CaptureErrorKind.NOT_PYTHON
    stopped = classify_pyspy_failure(1, STOPPED_STDERR, live)
    assert stopped.kind is CaptureErrorKind.FAILED and "kill -CONT" in stopped.fix
    other = classify_pyspy_failure(3, "Error: something new\n\nStack backtrace:\n  0: main\n", live)
    assert other.kind is CaptureErrorKind.FAILED
    assert "something new" in other.message and "Stack backtrace" not in other.message
    assert f"py-spy dump --pid {live}" in other.fix


# --------------------------------------------------------------------------
# Many processes: failures stay per process
# --------------------------------------------------------------------------


async def test_capture_records_each_failure_and_keeps_the_rest(target: subprocess.Popen[bytes]) -> None:
    gone = _exited_pid()
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        ranks = [
            RankInfo(rank=0, local_rank=0, world_size=2, pid=target.pid, subprocesses=(
                ProcessInfo(pid=gone, ppid=target.pid, role=ProcessRole.CHECKPOINT, name="gone"),
                ProcessInfo(pid=sleeper.pid, ppid=target.pid, role=ProcessRole.OTHER, name="sleep"),
            )),
            RankInfo(rank=1, local_rank=1, world_size=2, pid=gone),
        ]
        stacks = await capture_stacks(ranks, timeout_s=20, concurrency=1)
        only_main = await capture_stacks(ranks[:1], subprocesses=False, timeout_s=20)
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    assert [s.rank for s in stacks] == [0, 1]
    r0, r1 = stacks
    assert r0.main.error is None and r0.main.threads
    assert [(p.pid, p.role, p.error.kind if p.error else None) for p in r0.subprocesses] == [
        (gone, ProcessRole.CHECKPOINT, CaptureErrorKind.GONE),
        (sleeper.pid, ProcessRole.OTHER, CaptureErrorKind.NOT_PYTHON),
    ]
    assert r1.main.error is not None and r1.main.error.kind is CaptureErrorKind.GONE
    assert r1.main.error.process_state == "gone"
    assert r0.subprocesses[1].error is not None and r0.subprocesses[1].error.process_state == "S"  # sleep(1)
    assert only_main[0].subprocesses == ()


async def test_cancelling_a_capture_leaves_no_py_spy_behind(frozen: int) -> None:
    task = asyncio.ensure_future(dump_process(frozen, ProcessRole.MAIN, timeout_s=60))
    deadline = time.monotonic() + 20
    while not [p for p in psutil.process_iter(["name", "cmdline"])
               if p.info["name"] == "py-spy" and str(frozen) in (p.info["cmdline"] or [])]:
        assert time.monotonic() < deadline, "py-spy never started"
        await asyncio.sleep(0.02)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    leftovers = [p for p in psutil.process_iter(["name", "cmdline"])
                 if p.info["name"] == "py-spy" and str(frozen) in (p.info["cmdline"] or [])]
    assert leftovers == []
