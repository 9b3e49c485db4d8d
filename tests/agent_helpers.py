"""Real agents and stand-in ranks for the agent and client tests.

Agents run as ``python -m rankscope agent --port 0 --port-file F`` in their
own session, so a test can SIGKILL one like a crashed machine and the
finalizer can always clean up its whole process group. A "rank" is a real
Python process started with torchrun's environment variables, so the agent's
discovery and py-spy see it exactly as they would see a training rank.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

PY = sys.executable
START_TIMEOUT_S = 30.0

# A rank stand-in: `threads` threads each parked `depth` frames deep in a recognisable
# function. Deep, many-threaded stacks make py-spy take a while (tenths of a second),
# which gives a test a real window in which a capture is under way.
RANK_SCRIPT = """
import sys, threading, time
threads, depth, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
barrier = threading.Barrier(threads + 1)
def parked_in_rankscope_test(n):
    if n == 0:
        barrier.wait()
        while True:
            time.sleep(1)
    return parked_in_rankscope_test(n - 1)
for _ in range(threads):
    threading.Thread(target=parked_in_rankscope_test, args=(depth,), daemon=True).start()
barrier.wait(timeout=30)
open(ready, "w").write("ready")
while True:
    time.sleep(1)
"""
RANK_FUNCTION = "parked_in_rankscope_test"


def wait_for(condition: object, timeout_s: float, what: str, interval_s: float = 0.02) -> None:
    """Poll a real condition until it holds, or fail naming what never happened.

    ``interval_s``: a condition that reads logs of a running job polls less often, to leave it the CPU.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def process_state(pid: int) -> str:
    """The one-letter state in /proc/PID/stat ("T": stopped, "Z": zombie), "gone" when there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "gone"
    return stat[stat.rindex(")") + 2]


def wait_ready_file(path: Path, proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Wait until a started target writes its ready file; fail at once if it exits first."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, "target exited early"
        assert time.monotonic() < deadline, "target never became ready"
        time.sleep(0.02)


def make_token_file(folder: Path, name: str = "token") -> tuple[str, Path]:
    token = secrets.token_hex(16)
    path = folder / name
    path.write_text(token + "\n")
    path.chmod(0o600)
    return token, path


def clean_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RANKSCOPE_TOKEN", None)
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    return env


@dataclass
class AgentProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass
class RankProcess:
    proc: subprocess.Popen[bytes]
    rank: int
    run_id: str


def kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process and everything in its session (py-spy children included)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


class Processes:
    """Starts agents and ranks for one test and kills every one of them at the end."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.started: list[subprocess.Popen[bytes]] = []

    def agent(self, name: str, *args: str, token_file: Path | None = None, env: dict[str, str] | None = None) -> AgentProcess:
        port_file = self.folder / f"{name}.port"
        log = self.folder / f"{name}.log"
        port_file.unlink(missing_ok=True)  # an agent restarted under the same name: wait for the new one's file
        cmd = [PY, "-m", "rankscope", "agent", "--port", "0", "--port-file", str(port_file), "--machine-name", name, *args]
        if token_file is not None:
            cmd += ["--token-file", str(token_file)]
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env or clean_env(),
                                    start_new_session=True)
        self.started.append(proc)

        def ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"agent {name} exited with {proc.returncode}:\n{log.read_text()}")
            return port_file.exists()

        wait_for(ready, START_TIMEOUT_S, f"agent {name} to write its port file")
        return AgentProcess(proc=proc, port=int(port_file.read_text()), log=log)

    def rank(self, rank: int, world_size: int, *, run_id: str | None = None, threads: int = 2, depth: int = 5) -> RankProcess:
        run_id = run_id or f"rankscope-test-{uuid.uuid4().hex[:12]}"
        ready = self.folder / f"rank{rank}-{run_id}.ready"
        env = clean_env()
        env.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world_size), GROUP_RANK=str(rank),
                   LOCAL_WORLD_SIZE="1", TORCHELASTIC_RUN_ID=run_id)
        proc = subprocess.Popen([PY, "-c", RANK_SCRIPT, str(threads), str(depth), str(ready)], env=env,
                                start_new_session=True)
        self.started.append(proc)

        def is_ready() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"rank {rank} exited with {proc.returncode}")
            return ready.exists()

        wait_for(is_ready, START_TIMEOUT_S, f"rank {rank} to park its threads")
        return RankProcess(proc=proc, rank=rank, run_id=run_id)

    def close(self) -> None:
        for proc in reversed(self.started):
            kill_group(proc)


def ctrl_c_works(argv: list[str]) -> list[str]:
    """``argv`` for a child a test interrupts with SIGINT: Python installs its KeyboardInterrupt handler only
    when SIGINT is not ignored at start, and a suite started in the background of a non-interactive shell
    (`pytest &`) has it ignored, which every child inherits: the test would then hang, not the product.

    A shim restores SIGINT and execs the command (not a preexec_fn: this process's gRPC threads may be live,
    see rankscope.wire.spawn)."""
    shim = "import os, signal, sys\nsignal.signal(signal.SIGINT, signal.SIG_DFL)\nos.execvp(sys.argv[1], sys.argv[1:])\n"
    return [sys.executable, "-S", "-c", shim, *argv]
