"""Relays that merge: the readings of the agents behind a relay folded into one (``MergedReadings``).

LLNL STAT merges the stacks of its tasks into one prefix tree with a rank set
per node at every level of its tree of daemons, so the front end receives work
in proportion to the distinct stacks, not to the tasks. A relay here does the
same with the compact replies of the agents it relays to (``fold``): their
frames become one ``StackTree`` (a stack is the node of its innermost frame),
their communicators one table, their processes, threads and operation
counters one set of columns, and each machine keeps only its own header. A
relay behind a relay folds that one's merged machines in as its own, so the
client gets one merged reply per relay it talks to, however deep the tree.

A child that did not answer is an unreachable stand-in, and the relay names
the machines it last heard behind that child (a relay gone takes its whole
subtree with it) with their ranks, so nothing behind it is lost silently.

The client reads a merged reply with ``MergedTables``: the tables every merged
machine points into, taken by the machines in order (``rankscope.wire.delta``
decodes each machine against what it holds of it, as for any reply).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

from rankscope.contract.snapshot import CaptureError, CaptureErrorKind, Frame, OpCounters, ProcessStack, ThreadStack
from rankscope.wire.codec import DECODING, ProtoConversionError, WireError, encoder
from rankscope.wire.columns import ColumnsError, read_values, write_columns
from rankscope.wire.compact import (
    CODED_FRAMES,
    CODED_PROCESS,
    ERROR_AT,
    FRAMES_AT,
    ROLE_AT,
    THREADS_AT,
    ReadTables,
    expand_runs,
    rank_runs,
)
from rankscope.wire.proto import rankscope_pb2 as pb

# The tables and columns a machine's header leaves to the merged reply.
_OWN_TABLES = ("stack_table", "communicator_table", "relayed", "merged", "op_columns", "process_columns",
               "process_errors", "thread_columns")
# A frame as the merged tree keys it: name, filename, line (0: none), module (None: none), flags.
_FrameKey = tuple[str, str, int, str | None, int]
_MAIN = 1  # ProcessRole MAIN's proto number


class _Source:
    """One reply's tables as the merge reads them: a plain compact reply's StackTable, or a merged reply's tree."""

    def __init__(self, msg: pb.MachineSnapshot | pb.MergedReadings, merger: Merger) -> None:
        self.merger = merger
        self.comms = msg.communicator_table
        self.comm_out: dict[int, int] = {}
        self.stack_out: dict[int, int] = {}
        self.frame_out: dict[int, int] = {}
        if isinstance(msg, pb.MergedReadings):
            t: Any = msg.stack_tree
            self.tree: tuple[list[int], list[int]] | None = (list(t.node_frame), list(t.node_parent))
            if len(t.node_frame) != len(t.node_parent):
                raise WireError("stack_tree's node columns differ in length")
            self.refs: list[int] = []
            self.starts: list[int] = []
        else:
            t = msg.stack_table
            self.tree = None
            self.refs = list(t.stack_frames)
            self.starts = list(itertools.accumulate(t.stack_lengths, initial=0))
            if self.starts[-1] != len(self.refs):
                raise WireError("stack_table's stack lengths do not add up to its frame references")
        self.strings: list[str] = list(t.strings)
        self.frame_columns = (list(t.frame_name), list(t.frame_filename), list(t.frame_line), list(t.frame_module),
                              list(t.frame_flags))
        if len({len(c) for c in self.frame_columns}) > 1:
            raise WireError("the frame columns differ in length")

    def _string(self, i: int) -> str:
        if not 0 <= i < len(self.strings):
            raise WireError(f"string {i} is not in the table (it holds {len(self.strings)})")
        return self.strings[i]

    def frame(self, i: int) -> int:
        out = self.frame_out.get(i)
        if out is None:
            names, files, lines, modules, flags = self.frame_columns
            if not 0 <= i < len(names):
                raise WireError(f"frame {i} is not in the table (it holds {len(names)})")
            key = (self._string(names[i]), self._string(files[i]), lines[i],
                   self._string(modules[i] - 1) if modules[i] else None, flags[i])
            out = self.frame_out[i] = self.merger.frame(key)
        return out

    def stack(self, i: int) -> int:
        """The merged tree's node for this reply's stack (or node) ``i``."""
        out = self.stack_out.get(i)
        if out is not None:
            return out
        if self.tree is None:
            if not 0 <= i < len(self.starts) - 1:
                raise WireError(f"stack {i} is not in stack_table (it holds {len(self.starts) - 1})")
            node = 0
            for ref in reversed(self.refs[self.starts[i]:self.starts[i + 1]]):  # outermost frame first
                node = self.merger.node(node, self.frame(ref))
        else:
            frames, parents = self.tree
            if not 0 <= i <= len(frames):
                raise WireError(f"node {i} is not in stack_tree (it holds {len(frames)})")
            path: list[int] = []  # this node and its parents not yet placed, innermost first
            at = i
            while at and at not in self.stack_out:
                parent = parents[at - 1]
                if parent >= at:
                    raise WireError(f"node {at}'s parent {parent} does not come before it")
                path.append(at)
                at = parent
            node = self.stack_out.get(at, 0)
            for at in reversed(path):
                node = self.stack_out[at] = self.merger.node(node, self.frame(frames[at - 1]))
        self.stack_out[i] = node
        return node

    def communicator(self, i: int) -> int:
        out = self.comm_out.get(i)
        if out is None:
            if not 0 <= i < len(self.comms):
                raise WireError(f"communicator {i} is not in communicator_table (it holds {len(self.comms)})")
            out = self.comm_out[i] = self.merger.communicator(self.comms[i])
        return out


class _Folded:
    """One child's part of the merged reply, checked and mapped into the merged tables before any of it is kept."""

    def __init__(self, errors_before: int) -> None:
        self.errors_before = errors_before  # the process_errors already merged: this child's come after them
        self.headers: list[pb.MachineSnapshot] = []
        self.ops: list[list[Any]] | None = None
        self.processes: list[list[Any]] | None = None
        self.threads: list[list[Any]] | None = None
        self.errors: list[pb.CaptureError] = []
        self.ranks_at: dict[int, set[int]] = {}  # node -> ranks whose main process has a thread ending there

    def add(self, headers: Sequence[pb.MachineSnapshot], source: _Source, tables: Any) -> None:
        """The machines ``headers`` whose tables and columns are ``tables`` (a reply or a MergedReadings)."""
        ops = read_values(OpCounters, tables.op_columns) if tables.HasField("op_columns") else None
        processes = read_values(ProcessStack, tables.process_columns, CODED_PROCESS) \
            if tables.HasField("process_columns") else None
        threads = read_values(ThreadStack, tables.thread_columns, CODED_FRAMES) \
            if tables.HasField("thread_columns") else None
        if threads is not None:
            threads[FRAMES_AT] = [source.stack(i) for i in threads[FRAMES_AT]]
        if processes is not None:
            errors = tables.process_errors
            coded = processes[ERROR_AT]
            if coded and not -1 <= min(coded) <= max(coded) < len(errors):
                raise WireError(f"column 'error': points outside the {len(errors)} process_errors sent")
            offset = self.errors_before + len(self.errors)
            processes[ERROR_AT] = [-1 if e < 0 else e + offset for e in coded]
            self.errors.extend(errors)
            self._rank_sets(headers, processes, threads)
        for header in headers:
            h = pb.MachineSnapshot()
            h.CopyFrom(header)
            for name in _OWN_TABLES:
                h.ClearField(name)  # type: ignore[arg-type]
            for c in h.counters:
                if len(c.communicator_refs):
                    refs = [source.communicator(r) for r in c.communicator_refs]
                    del c.communicator_refs[:]
                    c.communicator_refs.extend(refs)
            for s in h.stacks:
                for process in (s.main, *s.subprocesses):
                    for thread in process.threads.threads:
                        if thread.HasField("stack_ref"):
                            thread.stack_ref = source.stack(thread.stack_ref)
            self.headers.append(h)
        for name, values in (("ops", ops), ("processes", processes), ("threads", threads)):
            if values is not None:
                mine = getattr(self, name)
                if mine is None:
                    setattr(self, name, values)
                else:
                    for column, more in zip(mine, values, strict=True):
                        column.extend(more)

    def _rank_sets(self, headers: Sequence[pb.MachineSnapshot], processes: list[list[Any]],
                   threads: list[list[Any]] | None) -> None:
        counts = processes[THREADS_AT]
        if min(counts, default=0) < -1:
            raise WireError("column 'threads': holds a count below -1")
        starts = list(itertools.accumulate((max(0, n) for n in counts), initial=0))
        nodes = threads[FRAMES_AT] if threads is not None else []
        if starts[-1] > len(nodes):
            raise WireError(f"the processes take {starts[-1]} thread rows, {len(nodes)} are sent")
        row = 0
        for header in headers:
            for s in header.stacks:
                if not s.HasField("process_rows"):
                    continue
                if row < len(counts) and processes[ROLE_AT][row] == _MAIN:
                    for node in nodes[starts[row]:starts[row + 1]]:
                        self.ranks_at.setdefault(node, set()).add(s.rank)
                row += s.process_rows


class Merger:
    """The merged reply being built from a relay's children (``fold`` makes one)."""

    def __init__(self) -> None:
        self.out = pb.MergedReadings()
        self.strings: dict[str, int] = {}
        self.frames: dict[_FrameKey, int] = {}
        self.nodes: dict[tuple[int, int], int] = {}  # (parent node, frame) -> node, numbered from 1
        self.comms: dict[bytes, int] = {}
        self.ops: list[list[Any]] | None = None
        self.processes: list[list[Any]] | None = None
        self.threads: list[list[Any]] | None = None
        self.ranks_at: dict[int, set[int]] = {}

    def string(self, text: str) -> int:
        i = self.strings.get(text)
        if i is None:
            i = self.strings[text] = len(self.strings)
            self.out.stack_tree.strings.append(text)
        return i

    def frame(self, key: _FrameKey) -> int:
        i = self.frames.get(key)
        if i is None:
            i = self.frames[key] = len(self.frames)
            name, filename, line, module, flags = key
            t = self.out.stack_tree
            t.frame_name.append(self.string(name))
            t.frame_filename.append(self.string(filename))
            t.frame_line.append(line)
            t.frame_module.append(0 if module is None else self.string(module) + 1)
            t.frame_flags.append(flags)
        return i

    def node(self, parent: int, frame: int) -> int:
        i = self.nodes.get((parent, frame))
        if i is None:
            i = self.nodes[parent, frame] = len(self.nodes) + 1
            self.out.stack_tree.node_frame.append(frame)
            self.out.stack_tree.node_parent.append(parent)
        return i

    def communicator(self, comm: pb.Communicator) -> int:
        key = comm.SerializeToString(deterministic=True)
        i = self.comms.get(key)
        if i is None:
            i = self.comms[key] = len(self.comms)
            self.out.communicator_table.add().CopyFrom(comm)
        return i

    def child(self, reply: pb.MachineSnapshot) -> list[pb.MachineSnapshot]:
        """Fold in one child's reply (its own reading, then what it relayed or merged); returns the headers kept.

        A reply that does not fit raises ``WireError`` or ``ColumnsError`` and leaves the merged columns as they
        were (its new frames, nodes and communicators stay in the tables, unused)."""
        folded = _Folded(len(self.out.process_errors))
        self._child_into(reply, folded)
        for name in ("ops", "processes", "threads"):
            more = getattr(folded, name)
            if more is None:
                continue
            mine = getattr(self, name)
            if mine is None:
                setattr(self, name, more)
            else:
                for column, values in zip(mine, more, strict=True):
                    column.extend(values)
        for node, ranks in folded.ranks_at.items():
            self.ranks_at.setdefault(node, set()).update(ranks)
        self.out.process_errors.extend(folded.errors)
        self.out.machines.extend(folded.headers)
        return folded.headers

    def _child_into(self, reply: pb.MachineSnapshot, folded: _Folded) -> None:
        folded.add([reply], _Source(reply, self), reply)
        for child in reply.relayed:  # a relay that was not asked to merge (or could not)
            self._child_into(child, folded)
        if reply.HasField("merged"):
            folded.add(list(reply.merged.machines), _Source(reply.merged, self), reply.merged)

    def finish(self) -> pb.MergedReadings:
        out = self.out
        if self.ops is not None:
            write_columns(OpCounters, self.ops, out.op_columns)
        if self.processes is not None:
            write_columns(ProcessStack, self.processes, out.process_columns, CODED_PROCESS)
        if self.threads is not None:
            write_columns(ThreadStack, self.threads, out.thread_columns, CODED_FRAMES)
        for node in sorted(self.ranks_at):
            out.node_ranks.add(node=node, rank_runs=rank_runs(sorted(self.ranks_at[node])))
        return out


# A relay's memory of what it heard behind each child: child address -> (address, machine, ranks) of each machine.
Behind = dict[str, list[tuple[str, str, tuple[int, ...]]]]


def fold(children: Sequence[pb.MachineSnapshot], behind: Behind) -> pb.MergedReadings:
    """The replies of a relay's children (each as ``FanOut.forward`` gives it) folded into one.

    ``behind`` is the relay's memory of the machines last heard behind each child: updated from the replies that
    fold, and read for a child that did not answer (its machines become stand-ins naming it and their ranks).
    """
    merger = Merger()
    for child in children:
        if not child.reachable:
            merger.out.machines.add().CopyFrom(child)
            for address, machine, ranks in behind.get(child.address, ()):
                merger.out.machines.add().CopyFrom(_behind_stand_in(address, machine, ranks, child))
            continue
        try:
            headers = merger.child(child)
        except (WireError, ColumnsError, ValueError) as exc:
            problem = exc.problem if isinstance(exc, WireError) else str(exc)
            stand_in = pb.MachineSnapshot(machine=child.machine or child.address, address=child.address)
            encoder(CaptureError)(CaptureError(
                CaptureErrorKind.FAILED, f"the agent at {child.address} sent a reply that does not fit: {problem}",
                "run the same rankscope version on every agent and relay"), stand_in.error)
            merger.out.machines.add().CopyFrom(stand_in)
            continue
        behind[child.address] = [(h.address, h.machine, tuple(r.rank for r in h.ranks)) for h in headers[1:]]
    return merger.finish()


def _behind_stand_in(address: str, machine: str, ranks: tuple[int, ...], relay: pb.MachineSnapshot) -> pb.MachineSnapshot:
    msg = pb.MachineSnapshot(machine=machine, address=address, reachable=False)
    encoder(CaptureError)(CaptureError(
        CaptureErrorKind.UNREACHABLE,
        f"not heard: {machine} ({ranks_text(ranks)}) is behind the relay at {relay.address}, which did not answer "
        f"({relay.error.message})",
        f"{relay.error.fix} (the relay at {relay.address} forwards for this machine)"), msg.error)
    return msg


def ranks_text(ranks: Sequence[int]) -> str:
    """``ranks`` as a short phrase: "rank 5", "ranks 0-7", "ranks 0-7, 16-23", "no ranks"."""
    if not ranks:
        return "no ranks"
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans: list[str] = []
    ordered = sorted(set(ranks))
    first = last = ordered[0]
    for r in [*ordered[1:], None]:
        if r is not None and r == last + 1:
            last = r
            continue
        spans.append(str(first) if first == last else f"{first}-{last}")
        if r is not None:
            first = last = r
    return "ranks " + ", ".join(spans)


# ---- the client's side --------------------------------------------------------------------------


class MergedTables(ReadTables):
    """A merged reply's tables: what every machine of it points into, taken by the machines in order."""

    def __init__(self, merged: pb.MergedReadings) -> None:
        self.init_rows(merged)
        t = merged.stack_tree
        self.strings = list(t.strings)
        self.columns = (list(t.frame_name), list(t.frame_filename), list(t.frame_line), list(t.frame_module),
                        list(t.frame_flags))
        if len({len(c) for c in self.columns}) > 1:
            raise WireError("stack_tree's frame columns differ in length")
        self.frame_count = len(self.columns[0])
        self.frames = [None] * self.frame_count
        self.node_frame, self.node_parent = list(t.node_frame), list(t.node_parent)
        if len(self.node_frame) != len(self.node_parent):
            raise WireError("stack_tree's node columns differ in length")
        # Checked once here, so that walking a path up always ends at the root and finds its frames.
        for at, (frame, parent) in enumerate(zip(self.node_frame, self.node_parent, strict=True), start=1):
            if parent >= at:
                raise WireError(f"node {at}'s parent {parent} does not come before it")
            if frame >= self.frame_count:
                raise WireError(f"node {at}'s frame {frame} is not in stack_tree (it holds {self.frame_count})")
        self.stacks = [()] + [None] * len(self.node_frame)
        self.rank_sets = [(n.node, tuple(n.rank_runs)) for n in merged.node_ranks]
        for node, _ in self.rank_sets:
            if not 0 <= node < len(self.stacks):
                raise WireError(f"node_ranks names node {node}, which stack_tree does not hold")

    def stack(self, i: int) -> tuple[Frame, ...]:
        """Node ``i``'s stack: its frame, then its parent's stack (innermost first, as a thread's frames are)."""
        stacks = self.stacks
        if not 0 <= i < len(stacks):
            raise WireError(f"node {i} is not in stack_tree (it holds {len(stacks) - 1})")
        made = stacks[i]
        if made is not None:
            return made
        path: list[int] = []
        at = i
        while stacks[at] is None:
            path.append(at)
            at = self.node_parent[at - 1]
        below = stacks[at]
        assert below is not None
        for at in reversed(path):
            below = stacks[at] = (self.frame(self.node_frame[at - 1]), *below)
        return below

    def node_ranks(self) -> dict[int, tuple[int, ...]]:
        """STAT's rank sets: node -> the ranks whose main process has a thread whose stack ends there."""
        return {node: expand_runs(runs) for node, runs in self.rank_sets}


def merged_children(msg: pb.MachineSnapshot, where: str,
                    decode: Callable[[pb.MachineSnapshot, str], None]) -> None:
    """Decode each machine of ``msg.merged`` with ``decode(machine, where)`` against the merged tables; a merged
    reply that does not fit raises ``ProtoConversionError`` naming where."""
    try:
        tables = MergedTables(msg.merged)
    except WireError as exc:
        raise ProtoConversionError(f"agent sent a {where}.merged that does not fit the contract: {exc.problem}") \
            from None
    previous = getattr(DECODING, "shared_tables", None)
    DECODING.shared_tables = tables
    try:
        for i, child in enumerate(msg.merged.machines):
            decode(child, f"{where}.merged.machines[{i}]")
        try:
            tables.check_all_taken()
        except WireError as exc:
            raise ProtoConversionError(f"agent sent a {where}.merged that does not fit the contract: "
                                       f"{exc.problem}") from None
    finally:
        DECODING.shared_tables = previous
        tables.release()


__all__ = ["Behind", "MergedTables", "Merger", "fold", "merged_children", "ranks_text"]
