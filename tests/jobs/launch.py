"""Starting and stopping the probe tests' process trees, with nothing left behind.

Each tree runs in its own session, so one ``killpg`` ends the launcher, its
ranks and their children even when a test fails half-way.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

JOBS = Path(__file__).resolve().parent


@dataclass
class Tree:
    proc: subprocess.Popen[bytes]
    directory: Path
    ready: dict[int, dict[str, Any]]  # rank -> what it wrote in ready.<rank>

    @property
    def launcher_pid(self) -> int:
        return self.proc.pid


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(cmd: Sequence[str], directory: Path, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start a tree in its own session; ``env`` adds variables to the launcher's environment."""
    directory.mkdir(parents=True, exist_ok=True)
    log = (directory / "log").open("wb")
    full_env = dict(os.environ, **(env or {}))
    return subprocess.Popen(list(cmd), stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=full_env)


def wait_ready(proc: subprocess.Popen[bytes], directory: Path, world_size: int, timeout_s: float) -> Tree:
    """Poll for every rank's ready file; fail early if the launcher died."""
    deadline = time.monotonic() + timeout_s
    files = [directory / f"ready.{r}" for r in range(world_size)]
    while not all(f.exists() for f in files):
        if proc.poll() is not None:
            raise RuntimeError(f"launcher exited with {proc.returncode}:\n{(directory / 'log').read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"ranks not ready after {timeout_s}s:\n{(directory / 'log').read_text()[-3000:]}")
        time.sleep(0.05)
    ready = {r: json.loads(f.read_text()) for r, f in enumerate(files)}
    return Tree(proc, directory, ready)


def stop(proc: subprocess.Popen[bytes], directory: Path) -> None:
    """Release the ranks, give them a moment to leave cleanly, then kill the whole session."""
    (directory / "release").touch()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def process_tree_cmd(directory: Path, world_size: int, run_id: str) -> list[str]:
    return [sys.executable, str(JOBS / "process_tree.py"), str(directory), str(world_size), run_id]


def torchrun_cmd(directory: Path, run_id: str, nproc: int = 2) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", run_id,
        "--max-restarts", "0", str(JOBS / "tiny_torchrun_job.py"), str(directory),
    ]
