"""A folder of saved ``py-spy dump --json`` outputs, read as a job snapshot.

For jobs rankscope's agents never watched: an engineer (or a cluster's own
tracer) dumps each rank's main process to ``rank<R>.json`` and, optionally,
its subprocesses to ``rank<R>.<name>.json``; ``rankscope analyze --pyspy-dir``
then groups them like a live capture. Nothing is lost quietly: an unreadable
file becomes a gap with its reason, and ranks with no file are reported
missing by the analyzer.

Machines are not in py-spy's output, so ranks are placed on consecutive
machines ``machine-<i>`` by ``--ranks-per-machine``; without it each rank is
its own ``machine-<rank>`` and a note says the placement is a guess.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

from rankscope.errors import RankscopeError
from rankscope.snapshot import (
    CaptureError,
    CaptureErrorKind,
    Instant,
    JobSnapshot,
    Layout,
    MachineSnapshot,
    ProcessRole,
    ProcessStack,
    RankInfo,
    RankStacks,
)

_FILE = re.compile(r"^rank(\d+)(?:\.([A-Za-z0-9_\-.]+?))?\.json$")
_HOW = ("save each rank's stacks with `py-spy dump --pid <PID> --json > DIR/rank<R>.json` "
        "(and `DIR/rank<R>.<name>.json` for its dataloader or checkpoint subprocesses)")


def role_from_name(name: str) -> ProcessRole:
    """A subprocess's role told from the name its file was given (``rank3.dataloader0.json``)."""
    low = name.lower()
    if "data" in low or "loader" in low or "worker" in low:
        return ProcessRole.DATALOADER
    if "ckpt" in low or "checkpoint" in low or "save" in low:
        return ProcessRole.CHECKPOINT
    if "compile" in low or "inductor" in low:
        return ProcessRole.COMPILE
    return ProcessRole.OTHER


def _parse(path: Path, role: ProcessRole, name: str) -> ProcessStack:
    from rankscope.probes.pyspy import parse_pyspy_dump

    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        return ProcessStack(pid=0, role=role, threads=None, name=name, error=CaptureError(
            CaptureErrorKind.FAILED, f"{path.name} is not readable py-spy JSON: {exc}",
            f"re-capture it with `py-spy dump --pid <PID> --json > {path}`"))
    pid = 0
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("pid"), int):
        pid = int(data[0]["pid"])
    return parse_pyspy_dump(data, pid, role, name)


def load_pyspy_dir(directory: str | Path, layout: Layout | None = None) -> JobSnapshot:
    """Read ``rank<R>.json`` (+ ``rank<R>.<name>.json``) files into a JobSnapshot."""
    root = Path(directory)
    if not root.is_dir():
        raise RankscopeError(f"--pyspy-dir {root} is not a folder", _HOW)
    mains: dict[int, Path] = {}
    subs: dict[int, list[tuple[str, Path]]] = {}
    ignored: list[str] = []
    for path in sorted(root.iterdir()):
        m = _FILE.match(path.name)
        if not m or not path.is_file():
            if path.suffix == ".json":
                ignored.append(path.name)
            continue
        rank = int(m.group(1))
        if m.group(2):
            subs.setdefault(rank, []).append((m.group(2), path))
        else:
            mains[rank] = path
    if not mains:
        raise RankscopeError(f"no rank<R>.json files in {root}", _HOW)

    sizes = layout.tp * layout.pp * layout.dp * layout.cp * layout.ep if layout is not None else 0
    world = max(max(mains) + 1, sizes, max(subs, default=-1) + 1)
    rpm = layout.ranks_per_machine if layout is not None else None
    notes: list[str] = []
    if rpm is None:
        notes.append("machines unknown: each rank is shown as its own machine; pass --ranks-per-machine")
    if ignored:
        notes.append(f"ignored files not named rank<R>.json or rank<R>.<name>.json: {', '.join(ignored[:5])}")

    per_machine: dict[str, tuple[list[RankInfo], list[RankStacks]]] = {}
    for rank in sorted(set(mains) | set(subs)):
        if rank in mains:
            main = _parse(mains[rank], ProcessRole.MAIN, "")
        else:
            main = ProcessStack(pid=0, role=ProcessRole.MAIN, threads=None, error=CaptureError(
                CaptureErrorKind.FAILED, f"rank{rank}.json is missing though subprocess files exist",
                _HOW))
        children = tuple(_parse(p, role_from_name(name), name) for name, p in sorted(subs.get(rank, [])))
        machine = f"machine-{rank // rpm}" if rpm else f"machine-{rank}"
        infos, stacks = per_machine.setdefault(machine, ([], []))
        infos.append(RankInfo(rank=rank, local_rank=rank % rpm if rpm else 0, world_size=world, pid=main.pid))
        stacks.append(RankStacks(rank=rank, main=main, subprocesses=children))

    now = Instant(wall=time.time(), mono=time.monotonic())
    machines = tuple(
        MachineSnapshot(machine=name, address=str(root), reachable=True, captured=now,
                        ranks=tuple(infos), stacks=tuple(stacks))
        for name, (infos, stacks) in per_machine.items()
    )
    return JobSnapshot(captured=now, machines=machines, job_id=root.name, layout=layout, notes=tuple(notes))
