"""Python stacks of a rank's processes through ``py-spy dump --json``.

One py-spy per process: ``--subprocesses --json`` is broken in py-spy 0.4.3,
and a separate call gives each process its own time limit, so one stuck
process (a frozen cgroup, uninterruptible I/O) costs that process only.
Calls run concurrently up to a bound, since each py-spy briefly pauses its
target and a machine with many ranks must not be paused all at once.

A failure never fails the capture: it becomes a ``ProcessStack`` with
``threads=None`` and a ``CaptureError`` that says what went wrong and what to
run about it (the classification follows py-spy 0.4.3's messages).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import psutil
from rankscope.contract.snapshot import (
    CaptureError,
    CaptureErrorKind,
    Frame,
    ProcessRole,
    ProcessStack,
    RankInfo,
    RankStacks,
    ThreadStack,
)

FIX_PERMISSION = (
    "py-spy needs ptrace rights over the process: run the agent as root (or as the job's user), "
    "or allow tracing with `sudo sysctl kernel.yama.ptrace_scope=0`; in a container add the capability "
    "(`docker run --cap-add SYS_PTRACE`, Kubernetes securityContext.capabilities.add: [SYS_PTRACE])"
)
FIX_GONE = "the process exited; take a new snapshot, and check the launcher's log if a rank died"
FIX_TIMEOUT = (
    "py-spy got no answer in time: the process may be in uninterruptible sleep (state D: stuck I/O, "
    "a frozen cgroup) or the machine is overloaded; look at `cat /proc/{pid}/stack` and retry with a longer timeout"
)
FIX_NOT_PYTHON = "py-spy reads Python stacks only; for a native process use `gdb -p {pid} -batch -ex 'thread apply all bt'`"
FIX_TOOL_MISSING = "install py-spy next to rankscope: `pip install py-spy==0.4.3` (or `pip install 'rankscope[agent]'`)"
FIX_STOPPED = "the process is stopped or already traced by a debugger: detach gdb/strace, or resume it with `kill -CONT {pid}`"
FIX_TRACED = (
    "another tool is attached to the process ({name}, pid {tracer}) and ptrace allows one tracer at a time: "
    "detach it (quit gdb / stop strace, or `kill {tracer}` if it is stuck) and capture again"
)
FIX_SUSPEND_REFUSED = (
    "ptrace refused to pause pid {pid}: if py-spy read the job's other processes as the same user, something "
    "else holds this one (a debugger or a second py-spy: `grep TracerPid /proc/{pid}/status`) or it is exiting "
    "or stuck in the kernel (`cat /proc/{pid}/stat /proc/{pid}/wchan`); otherwise: " + FIX_PERMISSION
)
FIX_FAILED = "run `py-spy dump --pid {pid}` by hand to see the full error"

_ADDRESS = re.compile(r"^0x[0-9a-fA-F]+$")


def pyspy_binary() -> str | None:
    """The py-spy executable: the one installed next to this interpreter first, then PATH."""
    local = Path(sys.executable).parent / "py-spy"
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which("py-spy")


# --------------------------------------------------------------------------
# Parsing
# --------------------------------------------------------------------------


def _frame(raw: object) -> Frame:
    if not isinstance(raw, dict):
        raise ValueError(f"frame is not an object: {raw!r:.80}")
    module = raw.get("module")
    name = str(raw.get("name", "?"))
    if _ADDRESS.match(name):
        name = "??"  # an unsymbolised native frame: addresses differ per process and are not kept
    line = raw.get("line")
    return Frame(
        name=name,
        filename=str(raw.get("filename", "")),
        line=int(line) if isinstance(line, int) and line > 0 else None,
        module=str(module) if module is not None else None,
        # py-spy sets ``module`` (the shared library) only on native frames.
        native=module is not None,
        is_shim=bool(raw.get("is_shim_entry", False)),
    )


def parse_pyspy_dump(data: object, pid: int, role: ProcessRole, name: str = "") -> ProcessStack:
    """Turn the JSON of ``py-spy dump --json`` (a list of threads) into a ``ProcessStack``.

    Malformed input comes back as a ``ProcessStack`` with a FAILED error, so a
    bad file in ``rankscope analyze --pyspy-dir`` shows up as a gap, not a crash.
    """
    try:
        if not isinstance(data, list):
            raise ValueError(f"expected a list of threads, got {type(data).__name__}")
        threads: list[ThreadStack] = []
        for raw in data:
            if not isinstance(raw, dict):
                raise ValueError(f"thread is not an object: {raw!r:.80}")
            frames = raw.get("frames") or []
            if not isinstance(frames, list):
                raise ValueError("thread frames are not a list")
            os_tid = raw.get("os_thread_id")
            tname = raw.get("thread_name")
            threads.append(
                ThreadStack(
                    thread_id=int(raw.get("thread_id", 0)),
                    frames=tuple(_frame(f) for f in frames),
                    thread_name=str(tname) if tname is not None else None,
                    os_thread_id=int(os_tid) if isinstance(os_tid, int) else None,
                    active=bool(raw.get("active", False)),
                    owns_gil=bool(raw.get("owns_gil", False)),
                )
            )
    except (ValueError, TypeError) as exc:
        return ProcessStack(
            pid=pid, role=role, threads=None, name=name,
            error=CaptureError(CaptureErrorKind.FAILED, f"unreadable py-spy output for pid {pid}: {exc}",
                               FIX_FAILED.format(pid=pid)),
        )
    return ProcessStack(pid=pid, role=role, threads=tuple(threads), name=name)


# --------------------------------------------------------------------------
# Failures
# --------------------------------------------------------------------------


def _summary(stderr: str) -> str:
    """py-spy's error without the Rust backtrace: the 'Error:' line and its causes."""
    lines = []
    for line in stderr.splitlines():
        if line.strip().startswith("Stack backtrace:"):
            break
        if line.strip():
            lines.append(line.strip())
    return " ".join(lines)[:400] or "no message"


def _pid_alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


def _tracer(pid: int) -> tuple[int, str] | None:
    """The process already ptrace-attached to ``pid`` (a debugger, strace), if any."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("TracerPid:"):
            tracer = int(line.split()[1])
            if tracer == 0:
                return None
            try:
                name = psutil.Process(tracer).name()
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                name = "?"
            return tracer, name
    return None


_STATE_NAMES = {"R": "running", "S": "sleeping", "D": "uninterruptible sleep", "T": "stopped",
                "t": "traced", "Z": "zombie", "X": "dead", "I": "idle", "P": "parked", "gone": "gone"}


def read_process_state(pid: int) -> tuple[str | None, str | None]:
    """The state letter of ``/proc/<pid>/stat`` (or "gone") and the kernel function it sleeps in.

    Recorded when a capture fails, because why py-spy got nothing often lies
    there: D (stuck in I/O or a frozen cgroup), T (stopped), Z (exited,
    unreaped). ``(None, None)`` when /proc cannot tell (not Linux, no rights).
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return "gone", None
    except OSError:
        return None, None
    # The command name is in parentheses and may itself hold spaces or ')'.
    rest = stat[stat.rfind(")") + 1:].split()
    state = rest[0] if rest else None
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        wchan = ""
    return state, (wchan if wchan and wchan != "0" else None)


def describe_state(state: str | None, wchan: str | None) -> str:
    """``state T (stopped), in do_signal_stop`` for messages; empty when nothing was read."""
    if state is None:
        return ""
    name = _STATE_NAMES.get(state, "")
    text = "process gone" if state == "gone" else f"state {state}" + (f" ({name})" if name else "")
    return text + (f", in {wchan}" if wchan else "")


def classify_pyspy_error(text: str, pid: int | str) -> tuple[CaptureErrorKind, str, str]:
    """What py-spy's error text alone says: the kind of failure, what happened to ``pid``, and the fix.

    Pure, so a dump saved on another machine is judged by the same rules as a
    live capture (which adds what only the live process can tell).
    """
    low = text.lower()
    if "failed to suspend process" in low and ("eperm" in low or "operation not permitted" in low):
        # ptrace refused to pause it: privilege, or something else holds it.
        return (CaptureErrorKind.PERMISSION, f"ptrace refused to pause pid {pid}",
                FIX_SUSPEND_REFUSED.format(pid=pid))
    if "permission denied" in low or "operation not permitted" in low or "sys_ptrace" in low or "eperm" in low:
        return CaptureErrorKind.PERMISSION, f"ptrace not permitted on pid {pid}", FIX_PERMISSION
    if ("no such process" in low or "esrch" in low or "check that the process is running" in low
            or "os error 3)" in low):
        return CaptureErrorKind.GONE, f"pid {pid} is gone", FIX_GONE
    if ("failed to find python version" in low or "failed to find a python interpreter" in low
            or "no python processes found" in low or "unsupported version of python" in low):
        return (CaptureErrorKind.NOT_PYTHON, f"pid {pid} runs no Python py-spy can read",
                FIX_NOT_PYTHON.format(pid=pid))
    if "failed to suspend process" in low:
        return CaptureErrorKind.FAILED, f"py-spy could not pause pid {pid}", FIX_STOPPED.format(pid=pid)
    return CaptureErrorKind.FAILED, f"py-spy failed on pid {pid}", FIX_FAILED.format(pid=pid)


def classify_pyspy_failure(returncode: int | None, stderr: str, pid: int) -> CaptureError:
    """What a failed py-spy run means, with the fix. ``returncode`` None: py-spy was killed at its time limit."""
    if returncode is None:
        return CaptureError(CaptureErrorKind.TIMEOUT, f"py-spy did not answer for pid {pid} in time",
                            FIX_TIMEOUT.format(pid=pid))
    text = _summary(stderr)
    tracer = _tracer(pid)
    if tracer is not None:
        # Only one tracer at a time: ptrace says EPERM, but no privilege would help.
        tracer_pid, tracer_name = tracer
        return CaptureError(CaptureErrorKind.FAILED,
                            f"pid {pid} is already traced by pid {tracer_pid} ({tracer_name}): {text}",
                            FIX_TRACED.format(pid=pid, tracer=tracer_pid, name=tracer_name))
    kind, what, fix = classify_pyspy_error(stderr, pid)
    if kind is not CaptureErrorKind.PERMISSION and not _pid_alive(pid):
        kind, what, fix = CaptureErrorKind.GONE, f"pid {pid} is gone", FIX_GONE
    if kind is CaptureErrorKind.FAILED and what.startswith("py-spy failed"):
        what += f" (exit {returncode})"
    return CaptureError(kind, f"{what}: {text}", fix)


# --------------------------------------------------------------------------
# Capture
# --------------------------------------------------------------------------


async def dump_process(
    pid: int, role: ProcessRole, *, native: bool = False, timeout_s: float = 5.0, name: str = ""
) -> ProcessStack:
    """Stacks of one process; any failure is returned in ``ProcessStack.error``, never raised."""
    started = time.monotonic()
    # The state py-spy meets, read before it runs: a failed attach can change it (py-spy's
    # detach may resume a stopped process). Two small /proc reads, also when all goes well.
    met = read_process_state(pid)

    def failed(error: CaptureError) -> ProcessStack:
        elapsed = time.monotonic() - started
        if error.kind is not CaptureErrorKind.TOOL_MISSING:
            after = read_process_state(pid)  # after py-spy is done, or killed (which detaches it)
            state, wchan = after if after[0] == "gone" or met[0] is None else met
            seen = describe_state(state, wchan)
            error = CaptureError(error.kind, f"{error.message} [{seen}]" if seen else error.message, error.fix,
                                 process_state=state, wchan=wchan)
        return ProcessStack(pid=pid, role=role, threads=None, error=error, name=name, capture_seconds=elapsed)

    binary = pyspy_binary()
    if binary is None:
        return failed(CaptureError(CaptureErrorKind.TOOL_MISSING, "py-spy is not installed", FIX_TOOL_MISSING))
    args = [binary, "dump", "--pid", str(pid), "--json"]
    if native:
        args.append("--native")
    # Without a Rust backtrace py-spy's stderr is just its message.
    env = dict(os.environ, RUST_BACKTRACE="0")
    try:
        proc = await asyncio.create_subprocess_exec(
            *args, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env
        )
    except OSError as exc:
        return failed(CaptureError(CaptureErrorKind.TOOL_MISSING, f"py-spy could not be started: {exc}",
                                   FIX_TOOL_MISSING))
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout_s)
    except TimeoutError:
        await kill_and_reap(proc)
        return failed(classify_pyspy_failure(None, "", pid))
    except asyncio.CancelledError:
        await kill_and_reap(proc)
        raise
    stderr = err.decode(errors="replace")
    if proc.returncode != 0:
        return failed(classify_pyspy_failure(proc.returncode, stderr, pid))
    try:
        data = json.loads(out.decode(errors="replace"))
    except ValueError as exc:
        return failed(CaptureError(CaptureErrorKind.FAILED, f"py-spy printed no JSON for pid {pid}: {exc}",
                                   FIX_FAILED.format(pid=pid)))
    stack = parse_pyspy_dump(data, pid, role, name)
    return ProcessStack(pid=stack.pid, role=stack.role, threads=stack.threads, error=stack.error,
                        name=stack.name, capture_seconds=time.monotonic() - started)


async def kill_and_reap(proc: asyncio.subprocess.Process) -> None:
    """Kill a py-spy past its limit and reap it; the kernel detaches ptrace when it dies."""
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(proc.wait(), timeout=5.0)


async def capture_stacks(
    ranks: Sequence[RankInfo],
    *,
    native: bool = False,
    subprocesses: bool = True,
    timeout_s: float = 5.0,
    concurrency: int = 8,
) -> tuple[RankStacks, ...]:
    """Stacks of every rank's main process (and, by default, each subprocess), in the order of ``ranks``."""
    gate = asyncio.Semaphore(max(1, concurrency))

    async def one(pid: int, role: ProcessRole, name: str) -> ProcessStack:
        async with gate:
            return await dump_process(pid, role, native=native, timeout_s=timeout_s, name=name)

    jobs: list[tuple[int, list[asyncio.Task[ProcessStack]]]] = []
    async with asyncio.TaskGroup() as group:
        for rank in ranks:
            main_name = rank.process.name if rank.process is not None else ""
            tasks = [group.create_task(one(rank.pid, ProcessRole.MAIN, main_name))]
            if subprocesses:
                tasks += [group.create_task(one(s.pid, s.role, s.name)) for s in rank.subprocesses]
            jobs.append((rank.rank, tasks))
    return tuple(
        RankStacks(rank=r, main=tasks[0].result(), subprocesses=tuple(t.result() for t in tasks[1:]))
        for r, tasks in jobs
    )
