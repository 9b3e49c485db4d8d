"""What an agent remembers of its job between readings: per rank, when it last made progress; its launches.

A client that attaches three minutes into a hang has no history of its own:
if each view judged progress from the readings it saw, a late view would
call a hung job healthy until its own window filled, and date the hang from
when it attached. So the agent keeps that memory and ships it in every
reading (``RankInfo.last_progress_wall``, ``started_wall``,
``MachineSnapshot.generation`` and ``ranks_seen_wall``), and every client
computes "hung since", "progressing" and "no ranks running" from the same
numbers.

Progress of one rank (one process: a new pid starts from nothing):
- counters present: its last optimizer step (or, for a writer that counts
  no steps or a job that makes none, its last completed collective), as the
  plugin stamped it (exact, even for an agent started late;
  ``rankscope.analyzers.progress.counters_progress_wall``);
- no counters: when a capture finds the main-thread stack changed since the
  capture before, the time of that earlier capture (it moved after then;
  only captures carry stacks, so this moves at capture pace).

A generation is one launch of the job's ranks on this machine: a reading
where none of the ranks seen before keeps its pid (the launcher restarted
them) starts the next one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, replace

from rankscope.analyzers.progress import counters_progress_wall
from rankscope.contract.snapshot import MachineSnapshot, RankInfo, RankStacks, main_thread


def stack_signature(stacks: RankStacks) -> tuple[str, ...] | None:
    """The main process's main-thread frames (what 'the stack changed' compares); None without a stack."""
    main = main_thread(stacks.main)
    if main is None:
        return None
    return tuple(f"{f.name} {f.filename}:{f.line}" for f in main.frames)


def process_started_wall(pid: int) -> float | None:
    """The process's start time (wall clock), None when it is gone or hidden."""
    import psutil

    with contextlib.suppress(psutil.Error):
        return float(psutil.Process(pid).create_time())
    return None


@dataclass(slots=True)
class _Rank:
    pid: int
    started_wall: float | None
    progress_wall: float | None = None
    signature: tuple[str, ...] | None = None
    signature_wall: float | None = None


class ProgressTracker:
    """Folds each reading of one machine into its memory and returns the reading with that memory attached."""

    def __init__(self, started_of: Callable[[int], float | None] = process_started_wall) -> None:
        self._ranks: dict[int, _Rank] = {}
        self._started_of = started_of
        self.generation = 0
        self.ranks_seen_wall: float | None = None
        self._counts_steps = False  # the job made optimizer steps: a restarted process progresses by its steps

    def observe(self, machine: MachineSnapshot) -> MachineSnapshot:
        if not machine.reachable or machine.captured is None:
            return machine
        now = machine.captured.wall
        counters = {c.rank: c for c in machine.counters if not c.error}
        self._counts_steps = self._counts_steps or any(c.steps for c in counters.values())
        stacks = {s.rank: s for s in machine.stacks}
        seen_before = {r.rank for r in machine.ranks if r.rank in self._ranks}
        if machine.ranks and (self.generation == 0 or (
                seen_before and all(self._ranks[r.rank].pid != r.pid for r in machine.ranks if r.rank in seen_before))):
            self.generation += 1
        out: list[RankInfo] = []
        for info in machine.ranks:
            known = self._ranks.get(info.rank)
            if known is None or known.pid != info.pid:
                known = self._ranks[info.rank] = _Rank(info.pid, self._started_of(info.pid))
            c = counters.get(info.rank)
            counted = c is not None and c.pid in (None, info.pid)
            if c is not None and counted:
                mark = counters_progress_wall(c, self._counts_steps, known.started_wall)
                if mark is not None and (known.started_wall is None or mark >= known.started_wall):
                    known.progress_wall = max(known.progress_wall or mark, mark)
            s = stacks.get(info.rank)
            if not counted and s is not None and (sig := stack_signature(s)) is not None:
                # The stack moved some time after the earlier capture: that capture's time is what is known.
                # (With counters they alone decide: two captures minutes apart of a hung rank differ from a
                # healthy one's, and calling that progress "now" hid a hang from a view attached late.)
                if known.signature is not None and sig != known.signature and known.signature_wall is not None:
                    known.progress_wall = max(known.progress_wall or known.signature_wall, known.signature_wall)
                known.signature, known.signature_wall = sig, now
            out.append(replace(info, last_progress_wall=known.progress_wall, started_wall=known.started_wall))
        if machine.ranks:
            self.ranks_seen_wall = now
        return replace(machine, ranks=tuple(out), generation=self.generation,
                       ranks_seen_wall=self.ranks_seen_wall)
