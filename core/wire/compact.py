"""The compact form of a machine's reply: per-machine tables that its ranks point into.

Ranks of one job run the same code, so most of a machine's stacks are the
same frames; and every rank of a group names the same members. The agent
sends each distinct frame, stack and communicator once per machine and the
ranks point into the tables; processes, threads and operation counters travel
as named columns (``rankscope.wire.columns``). Importing this module installs
these forms into the generic codec (``rankscope.wire.codec``).
"""

from __future__ import annotations

import dataclasses
import itertools
import typing
from collections.abc import Callable, Sequence
from typing import Any

from rankscope.contract.snapshot import (
    CaptureError,
    Communicator,
    Frame,
    MachineSnapshot,
    OpCounters,
    ProcessRole,
    ProcessStack,
    RankCounters,
    RankStacks,
    ThreadStack,
)
from rankscope.wire.codec import (
    DECODE_WRAPPERS,
    DECODING,
    ENCODING,
    INSTALLED,
    SPECIAL_DECODERS,
    SPECIAL_ENCODERS,
    TABLED,
    TAKERS,
    Decoder,
    WireError,
    decoder,
    encoder,
    enum_to_proto,
    field_decoder,
)
from rankscope.wire.columns import ColumnsError, field_values, make_objects, read_values, write_columns
from rankscope.wire.proto import rankscope_pb2 as pb

# ---- the compact form: per-machine tables ---------------------------------------
#
# Ranks of one job run the same code, so most of a machine's stacks are the
# same frames; and every rank of a group names the same members. The agent
# sends each distinct frame, stack and communicator once per machine and the
# ranks point into the tables. The client keeps one object per distinct
# frame, stack and communicator across all machines of a reply (``_INTERNED``),
# so identical stacks of thousands of ranks are one tuple in memory.

# Distinct frames, stacks and communicators already made (shared frozen objects); emptied when it grows past
# _INTERN_LIMIT so a long-running TUI does not keep every stack it ever saw.
_INTERNED: dict[Any, Any] = {}
_INTERN_LIMIT = 200_000
# Stack tables already read, by their bytes: the decoded columns and the frames and stacks made from them so far.
_TableState = tuple[list[str], int, tuple[list[int], ...], list[Frame | None], list[int], list[int],
                    list[tuple[Frame, ...] | None]]
_STACK_TABLES: dict[bytes, _TableState] = {}
_STACK_TABLE_BYTES = [0]  # the bytes of the tables kept; emptied past _STACK_TABLE_LIMIT (their decoded forms are larger)
_STACK_TABLE_LIMIT = 16 << 20
_NATIVE, _SHIM, _HAS_LINE = 1, 2, 4


def _intern(key: Any, make: Callable[[], Any]) -> Any:
    hit = _INTERNED.get(key)
    if hit is None:
        if len(_INTERNED) >= _INTERN_LIMIT:
            _INTERNED.clear()
        hit = _INTERNED[key] = make()
    return hit


def rank_runs(ranks: Sequence[int]) -> list[int]:
    """``ranks`` as (first, step, count) triples, greedily; expands back to exactly ``ranks``."""
    out: list[int] = []
    i, n = 0, len(ranks)
    while i < n:
        first = ranks[i]
        if i + 1 == n:
            out += [first, 1, 1]
            break
        step = ranks[i + 1] - first
        j = i + 1
        while j + 1 < n and ranks[j + 1] - ranks[j] == step:
            j += 1
        out += [first, step, j - i + 1]
        i = j + 1
    return out


def expand_runs(runs: Sequence[int]) -> tuple[int, ...]:
    if len(runs) % 3:
        raise WireError(f"rank_runs holds {len(runs)} numbers, not whole (first, step, count) triples")
    out: list[int] = []
    for k in range(0, len(runs), 3):
        first, step, count = runs[k], runs[k + 1], runs[k + 2]
        if count < 0 or count > 1 << 24:
            raise WireError(f"rank_runs has a run of {count} ranks")
        out.extend(range(first, first + step * count, step) if step else [first] * count)
    return tuple(out)


class WireTables:
    """What one machine's compact reply shares: strings, frames, stacks and communicators."""

    def __init__(self) -> None:
        self.strings: dict[str, int] = {}
        self.frames: dict[Frame, int] = {}
        self.stacks: dict[tuple[Frame, ...], int] = {}
        self.stack_by_id: dict[int, int] = {}  # id(frames tuple) -> stack index: shared tuples cost one lookup
        self.comms: dict[Communicator, int] = {}
        self.ops: list[tuple[OpCounters, ...]] = []  # each rank's, in counters order: written as op_columns
        self.processes: list[tuple[ProcessStack, ...]] = []  # each rank's, main first: written as process_columns
        self.table = pb.StackTable()

    def string(self, text: str) -> int:
        i = self.strings.get(text)
        if i is None:
            i = self.strings[text] = len(self.strings)
        return i

    def stack(self, frames: tuple[Frame, ...]) -> int:
        i = self.stack_by_id.get(id(frames))
        if i is not None:
            return i
        i = self.stacks.get(frames)
        if i is None:
            i = self.stacks[frames] = len(self.stacks)
            refs = []
            for frame in frames:
                f = self.frames.get(frame)
                if f is None:
                    f = self.frames[frame] = len(self.frames)
                    t = self.table
                    t.frame_name.append(self.string(frame.name))
                    t.frame_filename.append(self.string(frame.filename))
                    t.frame_line.append(0 if frame.line is None else frame.line)
                    t.frame_module.append(0 if frame.module is None else self.string(frame.module) + 1)
                    t.frame_flags.append((_NATIVE if frame.native else 0) | (_SHIM if frame.is_shim else 0)
                                         | (0 if frame.line is None else _HAS_LINE))
                refs.append(f)
            self.table.stack_frames.extend(refs)
            self.table.stack_lengths.append(len(refs))
        self.stack_by_id[id(frames)] = i
        return i

    def _write_processes(self, msg: pb.MachineSnapshot) -> None:
        processes = list(itertools.chain.from_iterable(self.processes))
        values = field_values(ProcessStack, processes)
        values[_ROLE_AT] = [_ROLE_NUMBERS[role] for role in values[_ROLE_AT]]
        threads = [t for t in values[_THREADS_AT] if t]
        values[_THREADS_AT] = [-1 if t is None else len(t) for t in values[_THREADS_AT]]
        errors: list[int] = []
        error_enc = encoder(CaptureError)
        for error in values[_ERROR_AT]:
            if error is None:
                errors.append(-1)
            else:
                errors.append(len(msg.process_errors))
                error_enc(error, msg.process_errors.add())
        values[_ERROR_AT] = errors
        write_columns(ProcessStack, values, msg.process_columns, _CODED_PROCESS)
        if threads:
            thread_values = field_values(ThreadStack, list(itertools.chain.from_iterable(threads)))
            thread_values[_FRAMES_AT] = [self.stack(frames) for frames in thread_values[_FRAMES_AT]]
            write_columns(ThreadStack, thread_values, msg.thread_columns, _CODED_FRAMES)

    def communicator(self, comm: Communicator) -> int:
        i = self.comms.get(comm)
        if i is None:
            i = self.comms[comm] = len(self.comms)
        return i

    def write(self, msg: pb.MachineSnapshot) -> None:
        if self.processes:  # first: their threads add their stacks to the table
            self._write_processes(msg)
        if self.stacks:
            self.table.strings.extend(self.strings)
            msg.stack_table.CopyFrom(self.table)
        for comm in self.comms:
            c = msg.communicator_table.add(comm_id=comm.comm_id, backend=comm.backend, description=comm.description,
                                           comm_nranks=comm.comm_nranks, comm_rank=comm.comm_rank)
            runs = rank_runs(comm.ranks)
            if len(runs) < len(comm.ranks):
                c.rank_runs.extend(runs)
            else:
                c.ranks.extend(comm.ranks)
        if self.ops:
            write_columns(OpCounters, field_values(OpCounters, list(itertools.chain.from_iterable(self.ops))),
                          msg.op_columns)


class ReadTables:
    """One compact reply's tables, decoded into shared objects as they are first used."""

    def __init__(self, msg: pb.MachineSnapshot) -> None:
        self.init_rows(msg)
        t = msg.stack_table
        # Machines whose ranks stand at the same lines (a hung job: most of them) send the same table; its
        # frames and stacks are decoded once and shared, so such a machine costs one lookup for its stacks.
        key = t.SerializeToString() if len(t.stack_lengths) else b""
        seen = _STACK_TABLES.get(key) if key else None
        self.strings: list[str]
        self.frames: list[Frame | None]
        self.stacks: list[tuple[Frame, ...] | None]
        self.columns: tuple[list[int], ...]
        if seen is not None:
            (self.strings, self.frame_count, self.columns, self.frames, self.refs, self.starts,
             self.stacks) = seen
            return
        self.strings = list(t.strings)
        names, files, lines = list(t.frame_name), list(t.frame_filename), list(t.frame_line)
        modules, flags = list(t.frame_module), list(t.frame_flags)
        count = len(names)
        if not count == len(files) == len(lines) == len(modules) == len(flags):
            raise WireError("stack_table's frame columns differ in length")
        self.frame_count = count
        self.columns = (names, files, lines, modules, flags)
        self.frames = [None] * count
        lengths = list(t.stack_lengths)
        refs = list(t.stack_frames)
        if sum(lengths) != len(refs):
            raise WireError("stack_table's stack lengths do not add up to its frame references")
        self.refs = refs
        self.starts = list(itertools.accumulate(lengths, initial=0))
        self.stacks = [None] * len(lengths)
        if key:
            if _STACK_TABLE_BYTES[0] + len(key) > _STACK_TABLE_LIMIT:
                _STACK_TABLES.clear()
                _STACK_TABLE_BYTES[0] = 0
            _STACK_TABLE_BYTES[0] += len(key)
            _STACK_TABLES[key] = (self.strings, self.frame_count, self.columns, self.frames, self.refs, self.starts,
                                  self.stacks)

    def init_rows(self, msg: pb.MachineSnapshot | pb.MergedReadings) -> None:
        """The columns and communicators of ``msg`` (a reply, or a relay's merged readings), taken as used."""
        self.ops = _TakenRows("op_columns", "counters", msg.op_columns if msg.HasField("op_columns") else None,
                              lambda columns: make_objects(OpCounters, read_values(OpCounters, columns)))
        self.threads = _TakenRows("thread_columns", "processes",
                                  msg.thread_columns if msg.HasField("thread_columns") else None, self._threads)
        self.processes = _TakenRows("process_columns", "ranks' stacks",
                                    msg.process_columns if msg.HasField("process_columns") else None, self._processes)
        self.errors = msg.process_errors
        self.comm_msgs = list(msg.communicator_table)
        self.comms: list[Communicator | None] = [None] * len(self.comm_msgs)

    def _string(self, i: int) -> str:
        if not 0 <= i < len(self.strings):
            raise WireError(f"string {i} is not in stack_table (it holds {len(self.strings)})")
        return self.strings[i]

    def frame(self, i: int) -> Frame:
        if not 0 <= i < self.frame_count:
            raise WireError(f"frame {i} is not in stack_table (it holds {self.frame_count})")
        made = self.frames[i]
        if made is None:
            names, files, lines, modules, flags = self.columns
            key = (self._string(names[i]), self._string(files[i]), lines[i] if flags[i] & _HAS_LINE else None,
                   self._string(modules[i] - 1) if modules[i] else None, bool(flags[i] & _NATIVE),
                   bool(flags[i] & _SHIM))
            made = self.frames[i] = _intern(("frame", *key), lambda: Frame(*key))
        return made

    def stack(self, i: int) -> tuple[Frame, ...]:
        if not 0 <= i < len(self.stacks):
            raise WireError(f"stack {i} is not in stack_table (it holds {len(self.stacks)})")
        made = self.stacks[i]
        if made is None:
            frames = tuple([self.frame(r) for r in self.refs[self.starts[i]:self.starts[i + 1]]])
            made = self.stacks[i] = _intern(("stack", frames), lambda: frames)
        return made

    def mark(self) -> tuple[int, int, int]:
        return self.ops.taken, self.processes.taken, self.threads.taken

    def rewind(self, at: tuple[int, int, int]) -> None:
        self.ops.taken, self.processes.taken, self.threads.taken = at

    def check_all_taken(self) -> None:
        for rows in (self.ops, self.processes, self.threads):
            rows.check_all_taken()

    def release(self) -> None:
        """Lets go of the reply: its rows' makers are methods of these tables (a cycle that held the whole parsed
        reply, megabytes a machine, until the cyclic collector found it)."""
        for rows in (self.ops, self.processes, self.threads):
            rows.release()

    def _processes(self, columns: pb.Columns) -> list[ProcessStack]:
        values = read_values(ProcessStack, columns, _CODED_PROCESS)
        values[_ROLE_AT] = list(map(_ROLE_DECODER, values[_ROLE_AT]))
        take = self.threads.take
        if min(values[_THREADS_AT], default=0) < -1:
            raise ColumnsError("column 'threads': holds a count below -1")
        values[_THREADS_AT] = [None if n < 0 else take(n) for n in values[_THREADS_AT]]
        errors, error_dec = self.errors, decoder(CaptureError)
        if values[_ERROR_AT] and not -1 <= min(values[_ERROR_AT]) <= max(values[_ERROR_AT]) < len(errors):
            raise ColumnsError(f"column 'error': points outside the {len(errors)} process_errors sent")
        values[_ERROR_AT] = [None if i < 0 else error_dec(errors[i]) for i in values[_ERROR_AT]]
        return make_objects(ProcessStack, values)

    def _threads(self, columns: pb.Columns) -> list[ThreadStack]:
        values = read_values(ThreadStack, columns, _CODED_FRAMES)
        values[_FRAMES_AT] = [self.stack(i) for i in values[_FRAMES_AT]]
        return make_objects(ThreadStack, values)

    def communicator(self, i: int) -> Communicator:
        if not 0 <= i < len(self.comms):
            raise WireError(f"communicator {i} is not in communicator_table (it holds {len(self.comms)})")
        made = self.comms[i]
        if made is None:
            made = self.comms[i] = communicator_of(self.comm_msgs[i])
        return made


class _TakenRows:
    """The objects of one of a reply's Columns, taken in order by the messages that point into it (``take``)."""

    def __init__(self, field: str, takers: str, columns: pb.Columns | None,
                 make: Callable[[pb.Columns], list[Any]]) -> None:
        self.field, self.takers, self.columns, self.make = field, takers, columns, make
        self.made: list[Any] | None = None  # made when the first taker takes its rows
        self.taken = 0

    def take(self, n: int) -> tuple[Any, ...]:
        if n == 0:
            return ()  # (a process whose capture found no threads, in a reply that may have no thread rows at all)
        made = self.made
        if made is None:
            if self.columns is None:
                raise WireError(f"{self.takers} take rows of {self.field} but their machine sent none")
            try:
                made = self.made = self.make(self.columns)
            except ColumnsError as exc:
                raise WireError(f"{self.field}: {exc}") from None
        start = self.taken
        if start + n > len(made):
            raise WireError(f"takes rows {start}-{start + n - 1} of {self.field}, which holds {len(made)}")
        self.taken = start + n
        return tuple(made[start:start + n])

    def release(self) -> None:
        self.columns = self.made = None
        self.make = _released

    def check_all_taken(self) -> None:
        rows = self.columns.rows if self.columns is not None else 0
        if self.taken != rows:
            exc = WireError(f"{self.field} holds {rows} rows but the {self.takers} take {self.taken}")
            exc.path.append(f".{self.field}")
            raise exc


def _released(columns: pb.Columns) -> list[Any]:
    raise AssertionError("rows taken after their reply was decoded")


def communicator_of(c: pb.Communicator) -> Communicator:
    key = ("comm", c.SerializeToString())  # its bytes: cheaper than a tuple of its members, and as exact
    hit = _INTERNED.get(key)
    if hit is not None:
        return typing.cast(Communicator, hit)
    runs = tuple(c.rank_runs)
    if runs and len(c.ranks):
        raise WireError("a communicator carries both ranks and rank_runs")
    return typing.cast(Communicator, _intern(key, lambda: Communicator(
        c.comm_id, c.backend, c.description, expand_runs(runs) if runs else tuple(c.ranks),
        c.comm_nranks, c.comm_rank if c.HasField("comm_rank") else -1)))  # not sent: unknown, not rank 0


def _encode_thread(obj: ThreadStack, msg: Any) -> None:
    # Only the plain form writes a thread as a message (the compact form's threads are thread_columns); a reply of
    # the compact form before the columns, with threads pointing into stack_table by stack_ref, still decodes.
    rep = msg.frames
    frame_enc = encoder(Frame)
    for frame in obj.frames:
        frame_enc(frame, rep.add())


def _decode_thread(msg: Any, values: list[Any]) -> list[Any]:
    if msg.HasField("stack_ref"):
        tables: ReadTables | None = getattr(DECODING, "tables", None)
        if tables is None:
            raise WireError("a thread points into a stack table but its machine sent none")
        try:
            values[1] = tables.stack(msg.stack_ref)
        except WireError as exc:
            exc.path.append(".stack_ref")
            raise
    else:
        values[1] = tuple([_FRAME_DECODER(f) for f in msg.frames])
    return values


def _encode_counters(obj: RankCounters, msg: Any) -> None:
    tables: WireTables | None = getattr(ENCODING, "tables", None)
    if tables is None:
        rep = msg.communicators
        comm_enc = encoder(Communicator)
        for comm in obj.communicators:
            comm_enc(comm, rep.add())
        ops, op_enc = msg.ops, encoder(OpCounters)
        for op in obj.ops:
            op_enc(op, ops.add())
        return
    if obj.communicators:
        msg.communicator_refs.extend([tables.communicator(c) for c in obj.communicators])
    if obj.ops:
        msg.op_rows = len(obj.ops)
        tables.ops.append(obj.ops)


def _decode_counters(msg: Any, values: list[Any]) -> list[Any]:
    tables: ReadTables | None = getattr(DECODING, "tables", None)
    refs = msg.communicator_refs
    if len(refs):
        if tables is None:
            raise WireError("counters point into a communicator table but their machine sent none")
        values[COMMS_AT] = tuple([tables.communicator(r) for r in refs])
    else:
        values[COMMS_AT] = tuple([communicator_of(c) for c in msg.communicators])
    if msg.HasField("op_rows"):
        if len(msg.ops):
            raise WireError("counters carry both ops and op_rows")
        if tables is None:
            raise WireError("counters take rows of op_columns but their machine sent none")
        values[OPS_AT] = tables.ops.take(msg.op_rows)
    else:
        op_dec = decoder(OpCounters)
        values[OPS_AT] = tuple([op_dec(o) for o in msg.ops])
    return values


def _encode_rank_stacks(obj: RankStacks, msg: Any) -> None:
    tables: WireTables | None = getattr(ENCODING, "tables", None)
    if tables is None:
        process_enc = encoder(ProcessStack)
        process_enc(obj.main, msg.main)
        for process in obj.subprocesses:
            process_enc(process, msg.subprocesses.add())
    else:
        msg.process_rows = 1 + len(obj.subprocesses)
        tables.processes.append((obj.main, *obj.subprocesses))


def _decode_rank_stacks(msg: Any, values: list[Any]) -> list[Any]:
    if msg.HasField("process_rows"):
        tables: ReadTables | None = getattr(DECODING, "tables", None)
        try:
            if msg.HasField("main") or len(msg.subprocesses):
                raise WireError("a rank's stacks carry both processes and process_rows")
            if tables is None:
                raise WireError("ranks' stacks take rows of process_columns but their machine sent none")
            if msg.process_rows < 1:
                raise WireError("0 process rows: a rank's stacks have a main process")
            processes = tables.processes.take(msg.process_rows)
        except WireError as exc:
            exc.path.append(".process_rows")
            raise
        values[_MAIN_AT], values[_SUBPROCESSES_AT] = processes[0], processes[1:]
    else:
        process_dec = decoder(ProcessStack)
        values[_MAIN_AT] = process_dec(msg.main)
        values[_SUBPROCESSES_AT] = tuple([process_dec(p) for p in msg.subprocesses])
    return values


def _decode_frame(msg: Any) -> Frame:
    key = (msg.name, msg.filename, msg.line if msg.HasField("line") else None,
           msg.module if msg.HasField("module") else None, msg.native, msg.is_shim)
    return typing.cast(Frame, _intern(("frame", *key), lambda: Frame(*key)))


_FRAME_DECODER: Decoder = _decode_frame
COMMS_AT = [f.name for f in dataclasses.fields(RankCounters)].index("communicators")
OPS_AT = [f.name for f in dataclasses.fields(RankCounters)].index("ops")
_THREADS_AT = [f.name for f in dataclasses.fields(ProcessStack)].index("threads")
_ROLE_AT = [f.name for f in dataclasses.fields(ProcessStack)].index("role")
_ERROR_AT = [f.name for f in dataclasses.fields(ProcessStack)].index("error")
_MAIN_AT = [f.name for f in dataclasses.fields(RankStacks)].index("main")
_SUBPROCESSES_AT = [f.name for f in dataclasses.fields(RankStacks)].index("subprocesses")
# process_columns: a process's role as its proto number, its threads as a count of thread rows, its error as a number
_CODED_PROCESS = frozenset({"role", "threads", "error"})
_FRAMES_AT = [f.name for f in dataclasses.fields(ThreadStack)].index("frames")
_CODED_FRAMES = frozenset({"frames"})  # thread_columns: a thread's frames as the number of its stack in stack_table
# What a relay's merge (rankscope.wire.merge) reads and writes of the same columns.
CODED_PROCESS, CODED_FRAMES = _CODED_PROCESS, _CODED_FRAMES
THREADS_AT, ERROR_AT, ROLE_AT, FRAMES_AT = _THREADS_AT, _ERROR_AT, _ROLE_AT, _FRAMES_AT


def _with_tables(decode: Decoder) -> Decoder:
    """A machine's decoder: its replies' tables are what its threads and counters point into."""

    def decode_machine(msg: Any) -> Any:
        own = msg.HasField("stack_table") or len(msg.communicator_table) or msg.HasField("op_columns") \
            or msg.HasField("process_columns") or msg.HasField("thread_columns")
        # A machine of a relay's merged readings points into their tables (rankscope.wire.merge), taken in turn.
        tables = ReadTables(msg) if own else getattr(DECODING, "shared_tables", None)
        previous, DECODING.tables = getattr(DECODING, "tables", None), tables
        try:
            machine = decode(msg)
            if own and tables is not None:
                tables.check_all_taken()
            return machine
        finally:
            DECODING.tables = previous
            if own and tables is not None:
                tables.release()

    return decode_machine


# process_columns' role column: the proto numbers of ProcessRole (an unknown one decodes to the enum's fallback).
_ROLE_NUMBERS = {role: enum_to_proto(role) for role in ProcessRole}
_ROLE_DECODER = typing.cast(Decoder, field_decoder(ProcessStack, "role", ProcessRole))


TABLED.update({(ThreadStack, "frames"), (RankCounters, "communicators"), (RankCounters, "ops"),
               (RankStacks, "main"), (RankStacks, "subprocesses")})
SPECIAL_ENCODERS.update({ThreadStack: _encode_thread, RankCounters: _encode_counters, RankStacks: _encode_rank_stacks})
SPECIAL_DECODERS.update({ThreadStack: _decode_thread, RankCounters: _decode_counters, RankStacks: _decode_rank_stacks})
DECODE_WRAPPERS[MachineSnapshot] = _with_tables
TAKERS.update({MachineSnapshot, RankStacks, RankCounters})
INSTALLED.add("compact")
