"""Headless drills that several tests assert on, each run once per session (the ``headless_drills`` fixture).

A drill (real torchrun nodes, ranks, agents and py-spy) costs tens of seconds on two cores; where tests of
different files check different things about the same job (the same fault, rank, step and options), they ask
for it by its command line and the first to ask runs it: one job, every assertion kept.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DRILL_TIMEOUT_S = 420  # one headless drill, start to stop, on a loaded 2-core machine
# The hang-p2p drill of the default TP=2 PP=2 DP=2 job on 4 machines, rank 5 (stage 1) at step 6, a 3 s stall:
# test_drill.py checks its capture and cleanup, test_analyze_drills.py grades its verdict.
HANG_P2P = ("hang-p2p", 5, 6, "--stall-seconds", "3")


@dataclass(frozen=True)
class HeadlessDrill:
    """What ``rankscope drill --headless --json`` left: its report, the bundle it wrote and its run folder."""

    report: dict[str, Any]
    bundle: Path
    run_dir: Path


class HeadlessDrills:
    """Runs ``rankscope drill --headless`` once per distinct command line and hands every asker the same result.

    A drill that failed is not run again for the next asker: the failure (with the drill's stderr) is raised
    to each of them.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.procs: list[subprocess.Popen[str]] = []
        self._done: dict[tuple[str, ...], HeadlessDrill | AssertionError] = {}

    def run(self, fault: str, rank: int, step: int, *options: str) -> HeadlessDrill:
        key = (fault, str(rank), str(step), *options)
        if key not in self._done:
            self._done[key] = self._run(key)
        found = self._done[key]
        if isinstance(found, AssertionError):
            raise found
        return found

    def _run(self, key: tuple[str, ...]) -> HeadlessDrill | AssertionError:
        fault, rank, step, *options = key
        folder = self.folder / f"{fault}-{rank}-{step}-{len(self._done)}"
        folder.mkdir(parents=True)
        bundle = folder / "bundle.json"
        cmd = [sys.executable, "-m", "rankscope", "drill", "--headless", "--json", "--fault", fault,
               "--fault-rank", rank, "--fault-step", step, *options, "--run-dir", str(folder / "run"), "-o", str(bundle)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.procs.append(proc)
        try:
            out, err = proc.communicate(timeout=DRILL_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return AssertionError(f"drill {' '.join(key)} did not end within {DRILL_TIMEOUT_S} s")
        finally:
            self._stop(proc)  # a timeout (ours or pytest's) leaves no drill running
        if proc.returncode != 0:
            return AssertionError(f"drill {' '.join(key)} failed ({proc.returncode}):\n{err[-3000:]}")
        return HeadlessDrill(json.loads(out), bundle, folder / "run")

    @staticmethod
    def _stop(proc: subprocess.Popen[str]) -> None:
        if proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)  # the drill stops its job and agents on SIGTERM
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def close(self) -> None:
        for proc in self.procs:
            self._stop(proc)
