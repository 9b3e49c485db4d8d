"""How the drill knows each rank's step without asking the ranks.

Each rank replaces a tiny file ``<run_dir>/progress/rank<R>`` after every
step (write to a temporary name, then ``os.replace``, so a reader never sees
half a file). The orchestrator reads the folder; a hung rank needs to answer
nothing. "Progress stopped" means no rank advanced for a chosen number of
seconds, timed on the orchestrator's monotonic clock, so the ranks' clocks
never matter.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PROGRESS_DIR = "progress"


@dataclass(frozen=True, slots=True)
class RankProgress:
    """What a rank last reported: steps completed, its pid and its state."""

    rank: int
    step: int
    pid: int
    state: str  # "starting", "running", "done", "failed"
    wall: float


def progress_path(run_dir: Path, rank: int) -> Path:
    return run_dir / PROGRESS_DIR / f"rank{rank}"


def write_progress(run_dir: Path, rank: int, step: int, state: str = "running") -> None:
    """Record that ``rank`` has completed ``step`` steps (called by the rank)."""
    target = progress_path(run_dir, rank)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"rank": rank, "step": step, "pid": os.getpid(), "state": state, "wall": time.time()}))
    os.replace(tmp, target)


PHASES_DIR = "phases"


def write_phase(run_dir: Path, rank: int, phase: str, loaded: LoadedStep | None = None) -> None:
    """Append that ``rank`` reached ``phase`` ("entered": the script runs, "joined": the rendezvous is done,
    "loaded": the checkpoint is in, "stepped": its first step is done), with the wall clock: where a start's time
    goes, read afterwards (a watcher polling the progress files sees a step only when it looks). ``loaded``: the
    step the rank starts from and where it came from (the "loaded" phase)."""
    folder = run_dir / PHASES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    record: dict[str, object] = {"rank": rank, "pid": os.getpid(), "phase": phase, "wall": time.time()}
    if loaded is not None:
        record.update(step=loaded.step, source=loaded.source)
    with open(folder / f"rank{rank}.jsonl", "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


@dataclass(frozen=True)
class LoadedStep:
    """The step a rank's training starts from and where its state came from: "checkpoint", "backup" (an
    in-memory backup, `b`) or "start" (nothing saved: step 0)."""

    step: int
    source: str


def _phase_reports(run_dir: Path, since_wall: float) -> Iterator[tuple[int, str, float, dict[str, Any]]]:
    """Every report at or after ``since_wall``, in file order: (rank, phase, wall, the whole record)."""
    for path in sorted((run_dir / PHASES_DIR).glob("rank*.jsonl")):
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue  # replaced or removed right now: read next time
        for line in lines:
            try:
                data = json.loads(line)
                rank, phase, wall = int(data["rank"]), str(data["phase"]), float(data["wall"])
            except (ValueError, KeyError, TypeError, IndexError, OverflowError):  # Infinity as a rank
                continue  # a line being written right now, or not a report
            if wall >= since_wall:
                yield rank, phase, wall, data


def read_loaded(run_dir: Path, since_wall: float) -> dict[int, LoadedStep]:
    """rank -> the step it said it loaded at or after ``since_wall`` (its newest such report)."""
    out: dict[int, LoadedStep] = {}
    for rank, phase, _wall, data in _phase_reports(run_dir, since_wall):
        if phase == "loaded" and "step" in data:
            try:
                out[rank] = LoadedStep(int(data["step"]), str(data["source"]))
            except (ValueError, KeyError, TypeError, OverflowError):
                continue  # a report without its step's source: not one we wrote
    return out


def read_phases(run_dir: Path, since_wall: float = 0.0) -> dict[str, dict[int, float]]:
    """phase -> rank -> the wall clock of the rank's first report of it at or after ``since_wall``."""
    out: dict[str, dict[int, float]] = {}
    for rank, phase, wall, _data in _phase_reports(run_dir, since_wall):
        out.setdefault(phase, {}).setdefault(rank, wall)
    return out


def read_progress(run_dir: Path) -> dict[int, RankProgress]:
    """Every rank's latest report; a file being replaced right now is skipped this round."""
    out: dict[int, RankProgress] = {}
    folder = run_dir / PROGRESS_DIR
    if not folder.is_dir():
        return out
    for path in folder.glob("rank*"):
        if path.name.endswith(".tmp"):
            continue
        try:
            data = json.loads(path.read_text())
            p = RankProgress(rank=int(data["rank"]), step=int(data["step"]), pid=int(data["pid"]),
                             state=str(data["state"]), wall=float(data["wall"]))
        except (OSError, ValueError, KeyError, TypeError, OverflowError):  # Infinity as a number
            continue
        out[p.rank] = p
    return out


class ProgressWatcher:
    """Polls the progress folder and remembers when each rank last moved.

    ``timeline`` keeps, per rank, the orchestrator's monotonic time at which
    each new step was first seen, so step times before and after a slow fault
    can be compared without trusting the ranks' clocks.
    """

    def __init__(self, run_dir: Path, world: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.run_dir = run_dir
        self.world = world
        self.clock = clock
        self.latest: dict[int, RankProgress] = {}
        self.last_change = clock()
        self.timeline: dict[int, list[tuple[int, float]]] = {r: [] for r in range(world)}

    def poll(self) -> dict[int, RankProgress]:
        now = self.clock()
        current = read_progress(self.run_dir)
        for rank, p in current.items():
            old = self.latest.get(rank)
            if old is None or old.step != p.step or old.state != p.state:
                self.last_change = now
                if old is None or old.step != p.step:
                    self.timeline.setdefault(rank, []).append((p.step, now))
        self.latest.update(current)
        return dict(self.latest)

    def min_step(self) -> int:
        if len(self.latest) < self.world:
            return 0
        return min(p.step for p in self.latest.values())

    def max_step(self) -> int:
        return max((p.step for p in self.latest.values()), default=0)

    def all_done(self) -> bool:
        return len(self.latest) == self.world and all(p.state == "done" for p in self.latest.values())

    def idle_seconds(self) -> float:
        return self.clock() - self.last_change

    def pids(self) -> dict[int, int]:
        return {r: p.pid for r, p in self.latest.items()}

    def step_seconds(self, rank: int, first: int, last: int) -> float | None:
        """Mean seconds per step of ``rank`` between steps ``first`` and ``last`` as seen here."""
        seen = {s: t for s, t in self.timeline.get(rank, [])}
        steps = sorted(s for s in seen if first <= s <= last)
        if len(steps) < 2:
            return None
        return (seen[steps[-1]] - seen[steps[0]]) / (steps[-1] - steps[0])


def stepped_past(run_dir: Path, world: int, since_wall: float, step: int) -> bool:
    """Every rank 0..world-1 reported, at or after ``since_wall``, that it runs (or ran to the end) past ``step``:
    a (re)started job has resumed."""
    progress = read_progress(run_dir)
    return all((p := progress.get(r)) is not None and p.wall >= since_wall and p.step > step
               and p.state in ("running", "done") for r in range(world))
