"""Saved py-spy dumps, text or JSON, read as a job snapshot.

For jobs rankscope's agents never watched: an engineer saves what py-spy
printed and ``rankscope analyze DUMPS`` groups it like a live capture. DUMPS
is a folder or a single pasted file; each file is one of

- ``rank<R>.txt`` / ``rank<R>.json``: rank R's main process (``py-spy dump
  --pid P``, text or ``--json``); more processes in the same text file
  (``--subprocesses``) are its children, and ``rank<R>.<name>.txt|json``
  holds one child named by the file;
- any other text file holding py-spy text: one node, several processes one
  after another (``pgrep ... | xargs -n1 py-spy dump --pid``).

Rank numbers, by the first rule that applies (recorded per rank in
``RankInfo.rank_source`` so a wrong guess is visible):
``file-name`` (``rank<R>``), else within a node file ``cmdline`` (every
process shows a distinct ``--local_rank``/``LOCAL_RANK``), else ``pid-order``
(ascending PIDs, the order a launcher starts its ranks), else ``file-order``;
nodes are numbered in ``--node-order`` or file-name order, and a node's first
rank is its index times ``--ranks-per-machine`` when given, else the count of
processes in the nodes before it.

Nothing is lost quietly: a file that is not a dump is named with the reason,
lines that are not py-spy output are quoted, a process py-spy could not read
is a gap with py-spy's error, and a cut dump is flagged ``truncated``.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import (
    CaptureError,
    CaptureErrorKind,
    Instant,
    JobSnapshot,
    Layout,
    MachineSnapshot,
    ProcessInfo,
    ProcessRole,
    ProcessStack,
    RankInfo,
    RankStacks,
)

_DUMP_SUFFIX = re.compile(r"\.(json|txt|log|out|dump)$")
_RANK_FILE = re.compile(r"^rank[_-]?(\d+)(?:\.([A-Za-z0-9_\-.]+))?$")
_LOCAL_RANK = re.compile(r"(--local[_-]rank|LOCAL_RANK)[=\s]+(\d+)")
_HOW = ("save each rank's stacks with `py-spy dump --pid <PID> > DIR/rank<R>.txt` (or `--json > DIR/rank<R>.json`), "
        "or each node's with `pgrep -P <LAUNCHER_PID> | xargs -n1 py-spy dump --pid > DIR/<node>.txt 2>&1`")
_MAX_NOTES_PER_FILE = 3


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


@dataclass(frozen=True, slots=True)
class _Process:
    """One process read from a file."""

    stack: ProcessStack
    cmdline: str | None
    file: str


def _parse_json(text: str, name: str, role: ProcessRole, sub: str) -> ProcessStack:
    from rankscope.probes.pyspy import parse_pyspy_dump

    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        return ProcessStack(pid=0, role=role, threads=None, name=sub, error=CaptureError(
            CaptureErrorKind.FAILED, f"{name} is not readable py-spy JSON: {exc}",
            f"re-capture it with `py-spy dump --pid <PID> --json > {name}`"))
    pid = 0
    if isinstance(data, list) and data and isinstance(data[0], dict) and isinstance(data[0].get("pid"), int):
        pid = int(data[0]["pid"])
    return parse_pyspy_dump(data, pid, role, sub)


def _child_role(stack: ProcessStack, cmdline: str | None) -> ProcessRole:
    """A child process's role, from its stacks (a DataLoader worker loop) or its command line."""
    for thread in stack.threads or ():
        if any(f.name == "_worker_loop" for f in thread.frames):
            return ProcessRole.DATALOADER
    return role_from_name(cmdline or "")


def _with_role(stack: ProcessStack, role: ProcessRole, name: str = "") -> ProcessStack:
    return ProcessStack(pid=stack.pid, role=role, threads=stack.threads, error=stack.error,
                        name=name or stack.name, capture_seconds=stack.capture_seconds, truncated=stack.truncated)


def _files(root: Path, notes: list[str]) -> list[Path]:
    from rankscope.contract.ranks import natural_key
    from rankscope.formats.incident_logs import holds_pyspy, log_kind

    if root.is_file():
        return [root]
    if not root.is_dir():
        raise RankscopeError(f"{root} is neither a folder nor a file of py-spy dumps", _HOW)
    out = []
    for path in sorted(root.iterdir(), key=lambda p: natural_key(p.stem)):
        if path.name.startswith("."):
            continue
        if path.is_dir():
            notes.append(f"{path.name}/: a folder, not read (dumps are read from {root} only)")
            continue
        head = _head(path)
        if log_kind(head) is not None and not holds_pyspy(head):
            # NCCL/PyTorch logs beside the dumps are evidence of their own (formats.incident_logs).
            notes.append(f"{path.name}: a log, not a dump: read by `rankscope analyze {root}` with the dumps")
            continue
        out.append(path)
    return out


def _head(path: Path, size: int = 65536) -> str:
    try:
        with path.open("rb") as f:
            return f.read(size).decode("utf-8", errors="replace")
    except OSError:
        return ""


_FRAME_LINE = re.compile(r"(?m)^\s*(?:\.\.\.\s*)?\S+ \([^()\s]+:\d+\)")


def looks_like_pyspy(path: Path) -> bool:
    """Whether a file's first bytes look like py-spy output, text or JSON."""
    from rankscope.formats.incident_logs import holds_pyspy

    head = _head(path, 8192)
    return holds_pyspy(head) or '"frames"' in head or head.lstrip().startswith("Error:") or \
        _FRAME_LINE.search(head) is not None


def _node_rank_rule(procs: list[_Process]) -> tuple[list[int], list[str]]:
    """Local ranks of a node's processes in file order, and the rule that told each."""
    found = [_LOCAL_RANK.search(p.cmdline or "") for p in procs]
    if all(found) and len({int(m.group(2)) for m in found if m}) == len(procs):
        return ([int(m.group(2)) for m in found if m],
                [f"cmdline: {m.group(0)}" for m in found if m])
    pids = [p.stack.pid for p in procs]
    if all(pids) and len(set(pids)) == len(pids):
        order = sorted(pids)
        return ([order.index(pid) for pid in pids],
                [f"pid-order: pid {pid} is #{order.index(pid)} of {len(pids)} by ascending pid" for pid in pids])
    return list(range(len(procs))), [f"file-order: process #{i} of {len(procs)} in the file (pids missing or repeated)"
                                     for i in range(len(procs))]


def _attach_workers(workers: list[_Process], procs: list[_Process], locals_: list[int], start: int, node: str,
                    subs: dict[int, list[_Process]], notes: list[str]) -> None:
    """A node file's DataLoader workers, each given to the rank whose --local_rank its command line repeats."""
    by_cmdline = {p.cmdline: start + local for p, local in zip(procs, locals_, strict=True) if p.cmdline}
    orphans = []
    for w in workers:
        rank = by_cmdline.get(w.cmdline) if w.cmdline and _LOCAL_RANK.search(w.cmdline) else None
        if rank is None:
            orphans.append(str(w.stack.pid))
            continue
        subs.setdefault(rank, []).append(_Process(_with_role(w.stack, ProcessRole.DATALOADER, "dataloader"),
                                                  w.cmdline, node))
    if orphans:
        notes.append(f"{node}: DataLoader worker(s) pid {', '.join(orphans[:8])} not given to any rank "
                     "(no rank process with the same command line and --local_rank); not analyzed")


def _ordered_nodes(nodes: dict[str, list[_Process]], node_order: Sequence[str] | None,
                   notes: list[str]) -> tuple[list[str], str]:
    if not node_order:
        return list(nodes), "file-name order"
    by_key = {}
    for name in nodes:
        by_key[name] = name
        by_key[Path(name).stem] = name
    unknown = [n for n in node_order if n not in by_key]
    if unknown:
        raise RankscopeError(f"--node-order names {', '.join(unknown)}, which no dump file is",
                             f"name node files by their file name or stem: {', '.join(nodes) or '(none)'}")
    ordered = list(dict.fromkeys(by_key[n] for n in node_order))
    rest = [n for n in nodes if n not in ordered]
    if rest:
        notes.append(f"--node-order does not name {', '.join(rest)}: placed after the named nodes, in file order")
    return ordered + rest, "--node-order"


def is_dumps(path: Path) -> bool:
    """A folder, or a file that is not a bundle (a bundle is a JSON object), is read as saved dumps."""
    if path.is_dir():
        return True
    try:
        with path.open("rb") as f:
            head = f.read(256).lstrip()
    except OSError:
        return False
    return not head.startswith(b"{")


_IDENTICAL = re.compile(r"(?:identical|the same|same stacks?)\s+(?:on|for|across|in)\s+(?:all|every)\s+(?:(\d+)\s+)?"
                        r"(?:other\s+)?(?:ranks?|processes|workers|GPUs)", re.IGNORECASE)


def _replicate(representative: dict[str, tuple[int | None, str]], nodes: dict[str, list[_Process]],
               mains: dict[int, _Process], sources: dict[int, str], subs: dict[int, list[_Process]],
               world: int, notes: list[str]) -> None:
    """One pasted stack said to be "identical on all N ranks" stands for every rank, when the count is known."""
    if len(representative) != 1 or mains or subs or len(nodes) != 1:
        return
    name, (count, words) = next(iter(representative.items()))
    if name not in nodes:
        return
    count = count or world or None
    if count is None or count < 2:
        notes.append(f"{name}: one stack said to be {words!r}, but not how many ranks: read as one rank; pass "
                     "the layout (--tp/--pp/--dp) to read it for every rank")
        return
    proc = nodes.pop(name)[0]
    for rank in range(count):
        pid = proc.stack.pid if rank == 0 else 0
        stack = ProcessStack(pid=pid, role=ProcessRole.MAIN, threads=proc.stack.threads, error=proc.stack.error,
                             name=proc.stack.name, truncated=proc.stack.truncated)
        mains[rank] = _Process(stack, proc.cmdline, name)
        sources[rank] = f"representative: {name} says {words!r}"
    notes.append(f"{name}: one stack stands for all {count} ranks ({words!r}); the ranks' own pids are unknown, so "
                 "the stacks cannot single out a rank")


def load_pyspy_dir(path: str | Path, layout: Layout | None = None,
                   node_order: Sequence[str] | None = None) -> JobSnapshot:
    """Read a folder (or one file) of py-spy dumps, text or JSON, into a JobSnapshot."""
    from rankscope.contract.ranks import compact_ranks
    from rankscope.probes.pyspy_text import FrameCache, parse_pyspy_text

    root = Path(path)
    notes: list[str] = []
    mains: dict[int, _Process] = {}
    subs: dict[int, list[_Process]] = {}
    nodes: dict[str, list[_Process]] = {}
    sources: dict[int, str] = {}
    cache: FrameCache = {}
    representative: dict[str, tuple[int | None, str]] = {}  # file -> (ranks it stands for, the words saying so)
    for file in _files(root, notes):
        try:
            raw = file.read_bytes()
        except OSError as exc:
            notes.append(f"{file.name}: not readable ({exc.strerror or exc})")
            continue
        if b"\0" in raw[:4096]:
            notes.append(f"{file.name}: not a py-spy dump (binary content)")
            continue
        text = raw.decode("utf-8", errors="replace")
        named = _RANK_FILE.match(_DUMP_SUFFIX.sub("", file.name))
        rank = int(named.group(1)) if named else None
        sub = named.group(2) if named else None
        if text.lstrip()[:1] in ("[", "{"):
            if rank is None:
                notes.append(f"{file.name}: py-spy JSON holds one process and its name gives no rank; "
                             "name it rank<R>.json")
                continue
            role = role_from_name(sub) if sub else ProcessRole.MAIN
            procs = [_Process(_parse_json(text, file.name, role, sub or ""), None, file.name)]
        else:
            parsed = parse_pyspy_text(text, cache=cache)
            if not parsed.processes:
                why = parsed.problems[0] if parsed.problems else "the file is empty"
                notes.append(f"{file.name}: not a py-spy dump (no `Process N:`, `Thread N` or `Error:` line; "
                             f"{why})")
                continue
            notes.extend(f"{file.name}: {p}" for p in parsed.problems[:_MAX_NOTES_PER_FILE + 1])
            procs = [_Process(p.stack, p.cmdline, file.name) for p in parsed.processes]
            said = _IDENTICAL.search(text)
            if said is not None and len(procs) == 1:
                representative[file.name] = (int(said.group(1)) if said.group(1) else None, said.group(0))
        if rank is None:
            nodes[file.name] = procs
            continue
        if sub:
            subs.setdefault(rank, []).extend(
                _Process(_with_role(p.stack, role_from_name(sub), sub), p.cmdline, p.file) for p in procs)
            continue
        if rank in mains:
            notes.append(f"{file.name}: rank {rank} was already read from {mains[rank].file}; kept that one")
            continue
        mains[rank] = _Process(_with_role(procs[0].stack, ProcessRole.MAIN), procs[0].cmdline, file.name)
        sources[rank] = f"file-name: {file.name}"
        subs.setdefault(rank, []).extend(
            _Process(_with_role(p.stack, _child_role(p.stack, p.cmdline)), p.cmdline, p.file) for p in procs[1:])

    sizes_given = layout.tp * layout.pp * layout.dp * layout.cp * layout.ep if layout is not None else 0
    _replicate(representative, nodes, mains, sources, subs, sizes_given, notes)
    rpm = layout.ranks_per_machine if layout is not None else None
    machine_of: dict[int, str] = {}
    local_of: dict[int, int] = {}
    ordered, how = _ordered_nodes(nodes, node_order, notes)
    offset = 0
    for index, name in enumerate(ordered):
        # DataLoader workers (a forked copy of their rank, command line included) are no ranks:
        # numbering them would shift every rank after them.
        procs = [p for p in nodes[name] if _child_role(p.stack, None) is not ProcessRole.DATALOADER]
        workers = [p for p in nodes[name] if _child_role(p.stack, None) is ProcessRole.DATALOADER]
        if not procs:
            notes.append(f"{name}: holds only DataLoader workers (in _worker_loop), no rank process")
            continue
        locals_, rules = _node_rank_rule(procs)
        start = index * rpm if rpm else offset
        offset += len(procs)
        for proc, local, rule in zip(procs, locals_, rules, strict=True):
            rank = start + local
            if rank in mains:
                notes.append(f"{name}: pid {proc.stack.pid} would be rank {rank}, already read from "
                             f"{mains[rank].file}; kept that one")
                continue
            mains[rank] = _Process(_with_role(proc.stack, ProcessRole.MAIN), proc.cmdline, name)
            sources[rank] = f"{rule} in {name}, node #{index} by {how} (first rank {start})"
            machine_of[rank] = Path(name).stem
            local_of[rank] = local
        _attach_workers(workers, procs, locals_, start, name, subs, notes)

    if not mains and not subs:
        from rankscope.formats.flight_recorder import holds_dumps
        from rankscope.formats.optrace_io import looks_like_op_trace

        if root.is_dir() and holds_dumps(root):
            raise RankscopeError(f"{root} holds PyTorch flight recorder dumps, not py-spy dumps",
                                 f"rankscope analyze --flight-recorder {root} (or `rankscope analyze {root}`)")
        traces = sorted(p for p in root.iterdir() if p.is_file() and looks_like_op_trace(p)) if root.is_dir() else []
        if traces:
            raise RankscopeError(f"no py-spy dumps in {root}; it holds op trace(s): {', '.join(p.name for p in traces)}",
                                 f"rankscope analyze {traces[0]} (one trace at a time; --trace-meta for its meta-*.yaml)")
        raise RankscopeError(f"no py-spy dumps in {root}" + (f" ({'; '.join(notes[:3])})" if notes else ""), _HOW)
    sizes = layout.tp * layout.pp * layout.dp * layout.cp * layout.ep if layout is not None else 0
    world = max(max(mains, default=-1) + 1, sizes, max(subs, default=-1) + 1)
    if rpm is None and any(r not in machine_of for r in mains):
        notes.append("machines unknown for ranks read from rank<R> files: each is shown as its own machine; "
                     "pass --ranks-per-machine")

    per_machine: dict[str, tuple[list[RankInfo], list[RankStacks]]] = {}
    for rank in sorted(set(mains) | set(subs)):
        found = mains.get(rank)
        if found is not None:
            main = found.stack
        else:
            main = ProcessStack(pid=0, role=ProcessRole.MAIN, threads=None, error=CaptureError(
                CaptureErrorKind.FAILED, f"rank {rank}'s main process has no dump though its subprocesses do",
                _HOW))
        children = tuple(p.stack for p in subs.get(rank, []))
        machine = machine_of.get(rank) or (f"machine-{rank // rpm}" if rpm else f"machine-{rank}")
        local = local_of.get(rank, rank % rpm if rpm else 0)
        info = None
        if found is not None and found.cmdline:
            argv = tuple(found.cmdline.split())
            info = ProcessInfo(pid=main.pid, ppid=0, role=ProcessRole.MAIN, name=Path(argv[0]).name, cmdline=argv)
        infos, stacks = per_machine.setdefault(machine, ([], []))
        infos.append(RankInfo(rank=rank, local_rank=local, world_size=world, pid=main.pid, process=info,
                              rank_source=sources.get(rank)))
        stacks.append(RankStacks(rank=rank, main=main, subprocesses=children))

    cut: dict[str, list[int]] = {}
    for rank, proc in sorted(mains.items()):
        if proc.stack.truncated and proc.stack.error is None:
            cut.setdefault(proc.stack.truncated, []).append(rank)
    for why, ranks in list(cut.items())[:_MAX_NOTES_PER_FILE]:
        notes.append(f"rank(s) {compact_ranks(ranks)}: stacks incomplete, read for what they hold: {why}")
    if len(cut) > _MAX_NOTES_PER_FILE:
        more = sorted(r for ranks in list(cut.values())[_MAX_NOTES_PER_FILE:] for r in ranks)
        notes.append(f"rank(s) {compact_ranks(more)}: stacks incomplete too, for other reasons (see --json)")

    now = Instant(wall=time.time(), mono=time.monotonic())
    machines = tuple(
        MachineSnapshot(machine=name, address=str(root), reachable=True, captured=now,
                        ranks=tuple(infos), stacks=tuple(stacks))
        for name, (infos, stacks) in per_machine.items()
    )
    return JobSnapshot(captured=now, machines=machines, job_id=root.stem, layout=layout, notes=tuple(notes))
