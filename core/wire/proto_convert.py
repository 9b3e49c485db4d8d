"""Snapshot contract <-> protobuf: the one place where the two meet.

The messages in ``rankscope.wire.proto`` mirror the dataclasses of
``rankscope.contract.snapshot`` name for name, so the conversion is driven by the
dataclass fields instead of one hand-written function per type: a field added
to the contract cannot be silently dropped on the wire, because
tests/integration/test_proto.py checks that every dataclass field has a proto field of the
same name (and that every optional value has presence on the wire).

``None`` travels as an unset field (proto3 ``optional`` or an absent message),
never as zero, so a missing reading stays missing after the trip.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import keyword
import operator
import os
import threading
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from enum import Enum
from typing import Any, TypeVar

from google.protobuf.message import Message
from rankscope.actions.agent_protocol import Confirmation
from rankscope.actions.model import (
    ActionKind,
    ActionPlan,
    ActionProgress,
    ActionRequest,
    ActionResult,
    ActionState,
    AuditRecord,
    BackupArgs,
    EvictArgs,
    HotUpdateArgs,
    ProcessRef,
    RollbackArgs,
    Targets,
    UpdateMode,
    VersionSource,
)
from rankscope.contract.errors import RankscopeError
from rankscope.contract.fast_make import slot_setters, slots_only
from rankscope.contract.snapshot import (
    CaptureError,
    CaptureErrorKind,
    Communicator,
    Frame,
    GpuMetrics,
    GpuStatus,
    HostMetrics,
    Instant,
    JobSnapshot,
    Layout,
    MachineSnapshot,
    OpCounters,
    ProcessInfo,
    ProcessRole,
    ProcessStack,
    RankCounters,
    RankInfo,
    RankStacks,
    StackSampleWindow,
    ThreadStack,
)
from rankscope.wire.columns import ColumnsError, field_values, make_objects, read_values, write_columns
from rankscope.wire.proto import rankscope_pb2 as pb

T = TypeVar("T")

# Which message carries which dataclass.
MESSAGES: dict[type, type[Message]] = {
    Instant: pb.Instant,
    CaptureError: pb.CaptureError,
    Frame: pb.Frame,
    ThreadStack: pb.ThreadStack,
    ProcessStack: pb.ProcessStack,
    RankStacks: pb.RankStacks,
    ProcessInfo: pb.ProcessInfo,
    RankInfo: pb.RankInfo,
    HostMetrics: pb.HostMetrics,
    GpuMetrics: pb.GpuMetrics,
    GpuStatus: pb.GpuStatus,
    Communicator: pb.Communicator,
    OpCounters: pb.OpCounters,
    RankCounters: pb.RankCounters,
    StackSampleWindow: pb.StackSampleWindow,
    MachineSnapshot: pb.MachineSnapshot,
    Layout: pb.Layout,
    JobSnapshot: pb.JobSnapshot,
    # the action protocol (rankscope.actions.model); ActionRequest and ActionPlan
    # have hand-written conversions below (a oneof, and nested tuples)
    Targets: pb.Targets,
    EvictArgs: pb.EvictArgs,
    HotUpdateArgs: pb.HotUpdateArgs,
    BackupArgs: pb.BackupArgs,
    RollbackArgs: pb.RollbackArgs,
    ProcessRef: pb.ProcessRef,
    ActionProgress: pb.ActionProgress,
    ActionResult: pb.ActionResult,
    AuditRecord: pb.AuditRecord,
    Confirmation: pb.Confirmation,
}

# Proto enum value names are the contract member names with a prefix
# (ProcessRole.MAIN <-> PROCESS_ROLE_MAIN). A value this side does not know
# (sent by a newer agent) decodes to the fallback instead of failing the snapshot.
# A fallback of None means there is no safe guess: an unknown or unset value is
# an error (an agent must never run a different action kind or mode than asked).
ENUMS: dict[type[Enum], tuple[str, Enum | None]] = {
    ProcessRole: ("PROCESS_ROLE_", ProcessRole.OTHER),
    CaptureErrorKind: ("CAPTURE_ERROR_KIND_", CaptureErrorKind.FAILED),
    ActionKind: ("ACTION_KIND_", None),
    ActionState: ("ACTION_STATE_", ActionState.FAILED),
    UpdateMode: ("UPDATE_MODE_", None),
    VersionSource: ("VERSION_SOURCE_", None),
}

# Fields whose Optional tuple is wrapped in a message so that "absent" (None)
# differs from "empty": (dataclass, field) -> the wrapper's repeated field.
WRAPPED: dict[tuple[type, str], str] = {
    (ProcessStack, "threads"): "threads",
}


class ProtoConversionError(RankscopeError):
    """A message from an agent did not fit the snapshot contract."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "run the same rankscope version on the agents and on this machine")


# --------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------


def machine_to_proto(machine: MachineSnapshot, *, compact: bool = True) -> pb.MachineSnapshot:
    """``compact``: stacks and communicators as per-machine tables (see ``rankscope.proto``'s StackTable).

    A client decodes both forms; the plain form is what agents sent before the tables existed.
    """
    msg = pb.MachineSnapshot()
    if not compact:
        _encoder(MachineSnapshot)(machine, msg)
        return msg
    tables = _WireTables()
    _ENCODING.tables = tables
    try:
        _encoder(MachineSnapshot)(machine, msg)
    finally:
        _ENCODING.tables = None
    tables.write(msg)
    return msg


def machine_from_proto(msg: pb.MachineSnapshot) -> MachineSnapshot:
    """One agent's own reply (without what it relayed: ``machines_from_proto`` gives those too)."""
    return _decode_machine(msg, "MachineSnapshot")


def machines_from_proto(msg: pb.MachineSnapshot) -> list[MachineSnapshot]:
    """An agent's reply and, for a relaying agent, the replies it forwarded (its own first, depth first)."""
    out = [machine_from_proto(msg)]
    for i, child in enumerate(msg.relayed):
        out.extend(machines_from_proto_at(child, f"MachineSnapshot.relayed[{i}]"))
    return out


def machines_from_proto_at(msg: pb.MachineSnapshot, where: str) -> list[MachineSnapshot]:
    out = [_decode_machine(msg, where)]
    for i, child in enumerate(msg.relayed):
        out.extend(machines_from_proto_at(child, f"{where}.relayed[{i}]"))
    return out


# The reading a client holds of the agent at an address, by the version its agent gave it (None: not held).
Holding = Callable[[str, int], MachineSnapshot | None]


def held_from_proto(msg: pb.MachineSnapshot, address: str,
                    held: Holding) -> list[tuple[str, MachineSnapshot, int | None]]:
    """Like ``machines_from_proto``, for a reply that may be a delta (``MachineSnapshot.since``).

    ``held(address, version)``: the reading of that version this client holds
    of the agent at that address (``address`` for the agent asked, the address
    a relay reported for the ones it relayed): a delta names the reading its
    request named, which need not be the newest one when requests overlap.
    What a delta leaves out is taken from it, the
    same objects, so an unchanged rank costs nothing to decode. Returns each
    machine with the address it is held under and its version.
    """
    out: list[tuple[str, MachineSnapshot, int | None]] = []
    _held_at(msg, address, held, "MachineSnapshot", out)
    return out


def _held_at(msg: pb.MachineSnapshot, address: str, held: Holding, where: str,
             out: list[tuple[str, MachineSnapshot, int | None]]) -> None:
    previous: MachineSnapshot | None = None
    if msg.HasField("since"):
        previous = held(address, msg.since)
        if previous is None:
            raise ProtoConversionError(
                f"agent at {address} sent a delta against reading {msg.since:#x}, which this client does not hold")
    out.append((address, _decode_machine(msg, where, previous), msg.version if msg.HasField("version") else None))
    for i, child in enumerate(msg.relayed):
        _held_at(child, child.address, held, f"{where}.relayed[{i}]", out)


def _decode_machine(msg: pb.MachineSnapshot, where: str, previous: MachineSnapshot | None = None) -> MachineSnapshot:
    _DECODING.previous = previous
    try:
        return typing.cast(MachineSnapshot, _decoder(MachineSnapshot)(msg))
    except _WireError as exc:
        raise ProtoConversionError(f"agent sent a {where} that does not fit the contract: "
                                   f"{where}{''.join(reversed(exc.path))}: {exc.problem}") from None
    finally:
        _DECODING.previous = None


# ---- the action protocol ------------------------------------------------------

# ActionRequest.args is a oneof: which member carries which kind's arguments.
_ARGS_FIELD: dict[ActionKind, str] = {
    ActionKind.EVICT: "evict",
    ActionKind.HOT_UPDATE: "hot_update",
    ActionKind.BACKUP: "backup",
    ActionKind.ROLLBACK: "rollback",
}
_ARGS_CLASS: dict[str, type] = {"evict": EvictArgs, "hot_update": HotUpdateArgs, "backup": BackupArgs,
                                "rollback": RollbackArgs}


class ActionDecodeError(RankscopeError):
    """An action message that does not make a valid request (refused before anything runs)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "send a request built by rankscope's client from the same rankscope version")


def request_to_proto(request: ActionRequest) -> pb.ActionRequest:
    msg = pb.ActionRequest(action_id=request.action_id, kind=_enum_to_proto(request.kind),  # type: ignore[arg-type]
                           requested_by=request.requested_by)
    msg.targets.CopyFrom(typing.cast(pb.Targets, to_proto(request.targets)))
    getattr(msg, _ARGS_FIELD[request.kind]).CopyFrom(to_proto(request.args))
    if request.job_id is not None:
        msg.job_id = request.job_id
    return msg


def request_from_proto(msg: pb.ActionRequest) -> ActionRequest:
    """A client's request -> ActionRequest; the model's own checks run (ids, refs, reasons)."""
    try:
        kind = typing.cast(ActionKind, _enum_from_proto(ActionKind, int(msg.kind)))
        which = msg.WhichOneof("args")
        if which is None:
            raise ValueError(f"a {kind.value} request carries no arguments")
        if which != _ARGS_FIELD[kind]:
            raise ValueError(f"a {kind.value} request carries {which} arguments")
        args = _decode_message(_ARGS_CLASS[which], getattr(msg, which), f"ActionRequest.{which}")
        targets = _decode_message(Targets, msg.targets, "ActionRequest.targets")
    except (TypeError, ValueError) as exc:
        raise ActionDecodeError(f"malformed action request: {exc}") from None
    return ActionRequest(
        action_id=msg.action_id, kind=kind, targets=targets, args=args, requested_by=msg.requested_by,
        job_id=msg.job_id if msg.HasField("job_id") else None,
    )


def plan_to_proto(plan: ActionPlan) -> pb.ActionPlan:
    msg = pb.ActionPlan(
        action_id=plan.action_id, kind=_enum_to_proto(plan.kind), summary=plan.summary,  # type: ignore[arg-type]
        machines=plan.machines, standbys=plan.standbys, steps=plan.steps, warnings=plan.warnings,
        typed_confirmation=plan.typed_confirmation, confirm_phrase=plan.confirm_phrase,
    )
    msg.processes.extend(typing.cast(pb.ProcessRef, to_proto(p)) for p in plan.processes)
    msg.backup_peers.extend(pb.BackupPeer(rank=r, peer=p) for r, p in plan.backup_peers)
    msg.commands.extend(pb.Argv(argv=argv) for argv in plan.commands)
    return msg


def plan_from_proto(msg: pb.ActionPlan) -> ActionPlan:
    try:
        return ActionPlan(
            action_id=msg.action_id, kind=typing.cast(ActionKind, _enum_from_proto(ActionKind, int(msg.kind))),
            summary=msg.summary, machines=tuple(msg.machines),
            processes=tuple(_decode_message(ProcessRef, p, "ActionPlan.processes") for p in msg.processes),
            standbys=tuple(msg.standbys),
            backup_peers=tuple((int(b.rank), int(b.peer)) for b in msg.backup_peers),
            commands=tuple(tuple(c.argv) for c in msg.commands),
            steps=tuple(msg.steps), warnings=tuple(msg.warnings),
            typed_confirmation=msg.typed_confirmation, confirm_phrase=msg.confirm_phrase,
        )
    except (TypeError, ValueError) as exc:
        raise ProtoConversionError(f"agent sent an ActionPlan that does not fit the contract: {exc}") from None


def event_to_proto(event: ActionProgress | ActionResult) -> pb.ActionEvent:
    if isinstance(event, ActionResult):
        return pb.ActionEvent(result=typing.cast(pb.ActionResult, to_proto(event)))
    return pb.ActionEvent(progress=typing.cast(pb.ActionProgress, to_proto(event)))


def event_from_proto(msg: pb.ActionEvent) -> ActionProgress | ActionResult:
    which = msg.WhichOneof("event")
    if which == "result":
        return from_proto(ActionResult, msg.result)
    if which == "progress":
        return from_proto(ActionProgress, msg.progress)
    raise ProtoConversionError("agent sent an ActionEvent with neither progress nor result")


def confirmation_to_proto(confirmation: Confirmation) -> pb.Confirmation:
    return typing.cast(pb.Confirmation, to_proto(confirmation))


def confirmation_from_proto(msg: pb.Confirmation) -> Confirmation:
    return from_proto(Confirmation, msg)


def audit_to_proto(record: AuditRecord) -> pb.AuditRecord:
    return typing.cast(pb.AuditRecord, to_proto(record))


def audit_from_proto(msg: pb.AuditRecord) -> AuditRecord:
    return from_proto(AuditRecord, msg)


def to_proto(obj: Any) -> Message:
    """Any contract dataclass -> its message (plain form: no tables)."""
    cls = type(obj)
    msg_cls = MESSAGES.get(cls)
    if msg_cls is None:
        raise TypeError(f"{cls.__name__} has no proto message")
    msg = msg_cls()
    _encoder(cls)(obj, msg)
    return msg


def from_proto(cls: type[T], msg: Message) -> T:
    """A message -> the contract dataclass ``cls``."""
    try:
        return typing.cast(T, _decode_message(cls, msg, cls.__name__))
    except (TypeError, ValueError) as exc:
        raise ProtoConversionError(f"agent sent a {cls.__name__} that does not fit the contract: {exc}") from None


# --------------------------------------------------------------------------
# the codec: compiled once per type
# --------------------------------------------------------------------------
#
# A 2,048-agent capture holds millions of values. Looking up type hints and
# dispatching on them for each value cost three quarters of the client's CPU,
# so each dataclass gets one encoder and one decoder, built on first use from
# its fields; per value only the work the field's type needs is left.

Encoder = Callable[[Any, Any], None]  # (value, message to fill in place)
Decoder = Callable[[Any], Any]

# Proto fields that carry no contract field: the compact form's tables and the
# relay's forwarded replies (tests/integration/test_proto.py checks every other field).
WIRE_ONLY: dict[type, frozenset[str]] = {
    ThreadStack: frozenset({"stack_ref"}),
    RankStacks: frozenset({"process_rows"}),
    Communicator: frozenset({"rank_runs"}),
    RankInfo: frozenset({"same"}),
    RankCounters: frozenset({"communicator_refs", "ops_same", "op_rows"}),
    MachineSnapshot: frozenset({"stack_table", "communicator_table", "relayed", "version", "since", "op_columns",
                                  "thread_columns", "process_columns", "process_errors"}),
}

_HINTS: dict[type, dict[str, Any]] = {}
_ENCODERS: dict[type, Encoder] = {}
_DECODERS: dict[type, Decoder] = {}


class _WireError(Exception):
    """A value that does not fit, with the field path built on the way out (innermost part first)."""

    def __init__(self, problem: str) -> None:
        super().__init__(problem)
        self.problem = problem
        self.path: list[str] = []


def _hints(cls: type) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = typing.get_type_hints(cls)
        _HINTS[cls] = hints
    return hints


def optional_inner(tp: Any) -> Any | None:
    """X for ``X | None``, else None (also used by the tests)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _encoder(cls: type) -> Encoder:
    enc = _ENCODERS.get(cls)
    if enc is None:
        enc = _ENCODERS[cls] = _build_encoder(cls)
    return enc


def _decoder(cls: type) -> Decoder:
    dec = _DECODERS.get(cls)
    if dec is None:
        dec = _DECODERS[cls] = _build_decoder(cls)
    return dec


def _decode_message(cls: type, msg: Message, where: str) -> Any:
    try:
        return _decoder(cls)(msg)
    except _WireError as exc:
        raise ValueError(f"{where}{''.join(reversed(exc.path))}: {exc.problem}") from None


# ---- encoding -------------------------------------------------------------------


def _build_encoder(cls: type) -> Encoder:
    steps: list[Encoder] = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        tp = optional_inner(tp) or tp
        steps.append(_field_encoder(cls, f.name, tp))
    special = _SPECIAL_ENCODERS.get(cls)

    def encode(obj: Any, msg: Any) -> None:
        for step in steps:
            step(obj, msg)
        if special is not None:
            special(obj, msg)

    return encode


def _field_encoder(cls: type, name: str, tp: Any) -> Encoder:
    getter = operator.attrgetter(name)
    if (cls, name) in _TABLED:
        return lambda obj, msg: None  # written by the type's special encoder (plain form or table reference)
    wrapped = WRAPPED.get((cls, name))
    if wrapped is not None:
        (item_tp, _) = typing.get_args(tp)
        item_enc = _encoder(item_tp)

        def enc_wrapped(obj: Any, msg: Any) -> None:
            value = getter(obj)
            if value is not None:
                holder = getattr(msg, name)
                holder.SetInParent()  # present even when the tuple is empty
                rep = getattr(holder, wrapped)
                for v in value:
                    item_enc(v, rep.add())

        return enc_wrapped
    if typing.get_origin(tp) is tuple:
        (item_tp, _) = typing.get_args(tp)
        if _is_dataclass_type(item_tp):
            item_enc = _encoder(item_tp)

            def enc_messages(obj: Any, msg: Any) -> None:
                value = getter(obj)
                if value:
                    rep = getattr(msg, name)
                    for v in value:
                        item_enc(v, rep.add())

            return enc_messages

        def enc_scalars(obj: Any, msg: Any) -> None:
            value = getter(obj)
            if value:
                getattr(msg, name).extend(value)

        return enc_scalars
    if _is_dataclass_type(tp):
        sub = _encoder(tp)

        def enc_message(obj: Any, msg: Any) -> None:
            value = getter(obj)
            if value is not None:
                holder = getattr(msg, name)
                holder.SetInParent()
                sub(value, holder)

        return enc_message
    if isinstance(tp, type) and issubclass(tp, Enum):
        numbers = {m: _enum_to_proto(m) for m in tp}

        def enc_enum(obj: Any, msg: Any) -> None:
            value = getter(obj)
            if value is not None:
                setattr(msg, name, numbers[value])

        return enc_enum

    def enc_scalar(obj: Any, msg: Any) -> None:
        value = getter(obj)
        if value is not None:
            setattr(msg, name, value)

    return enc_scalar


# ---- decoding -------------------------------------------------------------------


def _build_decoder(cls: type) -> Decoder:
    plan: list[tuple[str, bool, Decoder | None]] = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        inner = optional_inner(tp)
        plan.append((f.name, inner is not None, _field_decoder(cls, f.name, inner or tp)))
    special = _SPECIAL_DECODERS.get(cls)
    decode = _fast_decoder(cls, plan, special, _plain_decoder(cls, plan, special))
    if cls is MachineSnapshot:
        return _with_tables(decode)
    return decode


def _fast_decoder(cls: type, plan: list[tuple[str, bool, Decoder | None]],
                  special: Callable[[Any, list[Any]], list[Any]] | None, plain: Decoder) -> Decoder:
    """One generated function per type: a single constructor call over the message's fields.

    The generic loop of ``_plain_decoder`` cost ~10 us per message (a capture of 2,048 agents decodes
    400,000 of them); written out per type, the same work is a few attribute reads. It reports no
    field path: on a value that does not fit it runs ``plain`` again, which raises naming the field.
    """
    namespace: dict[str, Any] = {"cls": cls, "special": special, "plain": plain, "_WireError": _WireError}
    args = []
    for i, (name, optional, conv) in enumerate(plan):
        read = f"getattr(msg, {name!r})" if keyword.iskeyword(name) else f"msg.{name}"
        value = read if conv is None else f"c{i}({read})"
        if conv is not None:
            namespace[f"c{i}"] = conv
        args.append(f"({value} if msg.HasField({name!r}) else None)" if optional else value)
    if slots_only(cls):
        # Filled through its slots, not the frozen __init__ (see rankscope.contract.fast_make): 3x sooner.
        namespace["new"] = object.__new__
        for i, setter in enumerate(slot_setters(cls)):
            namespace[f"s{i}"] = setter
        if special is not None:
            values = [f"v[{i}]" for i in range(len(args))]
            lines = [f"v = special(msg, [{', '.join(args)}])"]
        else:
            values, lines = args, []
        lines += ["o = new(cls)", *(f"s{i}(o, {v})" for i, v in enumerate(values)), "return o"]
    else:
        body = f"[{', '.join(args)}]" if special is not None else ", ".join(args)
        lines = [f"return cls(*special(msg, {body}))" if special is not None else f"return cls({body})"]
    if cls in _TAKERS:
        # ``plain`` decodes the message again to name the field: it must take the same rows of the reply's columns,
        # so the rows this attempt took are given back first.
        namespace["decoding"] = _DECODING
        source = ("def decode(msg):\n    tables = getattr(decoding, 'tables', None)\n"
                  "    at = tables.mark() if tables is not None else None\n    try:\n"
                  + "".join(f"        {line}\n" for line in lines)
                  + "    except _WireError:\n        if at is not None:\n            tables.rewind(at)\n"
                  "        return plain(msg)\n")
    else:
        source = "def decode(msg):\n    try:\n" + "".join(f"        {line}\n" for line in lines) \
            + "    except _WireError:\n        return plain(msg)\n"
    exec(compile(source, f"<decoder of {cls.__name__}>", "exec"), namespace)  # generated from the fields only
    return typing.cast(Decoder, namespace["decode"])


def _plain_decoder(cls: type, plan: list[tuple[str, bool, Decoder | None]],
                   special: Callable[[Any, list[Any]], list[Any]] | None) -> Decoder:
    def decode(msg: Any) -> Any:
        values: list[Any] = []
        name = ""
        try:
            for name, optional, conv in plan:
                if optional and not msg.HasField(name):
                    values.append(None)
                elif conv is None:
                    values.append(getattr(msg, name))
                else:
                    values.append(conv(getattr(msg, name)))
            if special is not None:
                name = ""
                values = special(msg, values)
        except _WireError as exc:
            if name:
                exc.path.append(f".{name}")
            raise
        return cls(*values)

    return decode


def _with_tables(decode: Decoder) -> Decoder:
    """A machine's decoder: its replies' tables are what its threads and counters point into."""

    def decode_machine(msg: Any) -> Any:
        tables = _ReadTables(msg) if msg.HasField("stack_table") or len(msg.communicator_table) \
            or msg.HasField("op_columns") or msg.HasField("process_columns") or msg.HasField("thread_columns") \
            else None
        previous, _DECODING.tables = getattr(_DECODING, "tables", None), tables
        try:
            machine = decode(msg)
            if tables is not None:
                tables.check_all_taken()
            return machine
        finally:
            _DECODING.tables = previous
            if tables is not None:
                tables.release()

    return decode_machine


def _field_decoder(cls: type, name: str, tp: Any) -> Decoder | None:
    """How to turn the message's field into the contract value; None: protobuf's own value is it."""
    if (cls, name) in _TABLED:
        return _nothing  # filled by the type's special decoder (plain list or table references)
    if (cls, name) == (MachineSnapshot, "ranks"):
        return _decode_ranks
    wrapped = WRAPPED.get((cls, name))
    if wrapped is not None:
        (item_tp, _) = typing.get_args(tp)
        item_dec = _decoder(item_tp)
        return lambda holder: tuple([item_dec(v) for v in getattr(holder, wrapped)])
    if typing.get_origin(tp) is tuple:
        (item_tp, _) = typing.get_args(tp)
        if _is_dataclass_type(item_tp):
            item_dec = _decoder(item_tp)
            return lambda raw: tuple([item_dec(v) for v in raw])
        if isinstance(item_tp, type) and issubclass(item_tp, Enum):
            raise TypeError(f"{cls.__name__}.{name}: tuples of enums have no wire form")
        return tuple
    if _is_dataclass_type(tp):
        return _decoder(tp)
    if isinstance(tp, type) and issubclass(tp, Enum):
        enum_cls = tp

        known = {v.number: _enum_from_proto(enum_cls, v.number) for v in _enum_descriptor(enum_cls).values
                 if v.number != 0 or ENUMS[enum_cls][1] is not None}

        def dec_enum(raw: int) -> Enum:
            member = known.get(raw)
            if member is not None:
                return member
            try:
                return _enum_from_proto(enum_cls, raw)
            except ValueError as exc:
                raise _WireError(str(exc)) from None

        return dec_enum
    if tp in (int, float, str, bool):
        return None  # protobuf hands back exactly these types for int64, double, string and bool fields
    raise TypeError(f"{cls.__name__}.{name}: cannot decode type {tp!r}")


# ---- the compact form: per-machine tables ---------------------------------------
#
# Ranks of one job run the same code, so most of a machine's stacks are the
# same frames; and every rank of a group names the same members. The agent
# sends each distinct frame, stack and communicator once per machine and the
# ranks point into the tables. The client keeps one object per distinct
# frame, stack and communicator across all machines of a reply (``_INTERNED``),
# so identical stacks of thousands of ranks are one tuple in memory.

# Contract fields written through a table in the compact form (by the type's special encoder).
_TABLED: frozenset[tuple[type, str]] = frozenset({(ThreadStack, "frames"), (RankCounters, "communicators"),
                                                  (RankCounters, "ops"), (RankStacks, "main"),
                                                  (RankStacks, "subprocesses")})
_ENCODING = threading.local()
_DECODING = threading.local()
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
        raise _WireError(f"rank_runs holds {len(runs)} numbers, not whole (first, step, count) triples")
    out: list[int] = []
    for k in range(0, len(runs), 3):
        first, step, count = runs[k], runs[k + 1], runs[k + 2]
        if count < 0 or count > 1 << 24:
            raise _WireError(f"rank_runs has a run of {count} ranks")
        out.extend(range(first, first + step * count, step) if step else [first] * count)
    return tuple(out)


class _WireTables:
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
        error_enc = _encoder(CaptureError)
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


class _ReadTables:
    """One compact reply's tables, decoded into shared objects as they are first used."""

    def __init__(self, msg: pb.MachineSnapshot) -> None:
        self.ops = _TakenRows("op_columns", "counters", msg.op_columns if msg.HasField("op_columns") else None,
                              lambda columns: make_objects(OpCounters, read_values(OpCounters, columns)))
        self.threads = _TakenRows("thread_columns", "processes",
                                  msg.thread_columns if msg.HasField("thread_columns") else None, self._threads)
        self.processes = _TakenRows("process_columns", "ranks' stacks",
                                    msg.process_columns if msg.HasField("process_columns") else None, self._processes)
        self.errors = msg.process_errors
        self.comm_msgs = list(msg.communicator_table)
        self.comms: list[Communicator | None] = [None] * len(self.comm_msgs)
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
            raise _WireError("stack_table's frame columns differ in length")
        self.frame_count = count
        self.columns = (names, files, lines, modules, flags)
        self.frames = [None] * count
        lengths = list(t.stack_lengths)
        refs = list(t.stack_frames)
        if sum(lengths) != len(refs):
            raise _WireError("stack_table's stack lengths do not add up to its frame references")
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

    def _string(self, i: int) -> str:
        if not 0 <= i < len(self.strings):
            raise _WireError(f"string {i} is not in stack_table (it holds {len(self.strings)})")
        return self.strings[i]

    def frame(self, i: int) -> Frame:
        if not 0 <= i < self.frame_count:
            raise _WireError(f"frame {i} is not in stack_table (it holds {self.frame_count})")
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
            raise _WireError(f"stack {i} is not in stack_table (it holds {len(self.stacks)})")
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
        errors, error_dec = self.errors, _decoder(CaptureError)
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
            raise _WireError(f"communicator {i} is not in communicator_table (it holds {len(self.comms)})")
        made = self.comms[i]
        if made is None:
            made = self.comms[i] = _communicator(self.comm_msgs[i])
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
                raise _WireError(f"{self.takers} take rows of {self.field} but their machine sent none")
            try:
                made = self.made = self.make(self.columns)
            except ColumnsError as exc:
                raise _WireError(f"{self.field}: {exc}") from None
        start = self.taken
        if start + n > len(made):
            raise _WireError(f"takes rows {start}-{start + n - 1} of {self.field}, which holds {len(made)}")
        self.taken = start + n
        return tuple(made[start:start + n])

    def release(self) -> None:
        self.columns = self.made = None
        self.make = _released

    def check_all_taken(self) -> None:
        rows = self.columns.rows if self.columns is not None else 0
        if self.taken != rows:
            exc = _WireError(f"{self.field} holds {rows} rows but the {self.takers} take {self.taken}")
            exc.path.append(f".{self.field}")
            raise exc


def _released(columns: pb.Columns) -> list[Any]:
    raise AssertionError("rows taken after their reply was decoded")


def _communicator(c: pb.Communicator) -> Communicator:
    key = ("comm", c.SerializeToString())  # its bytes: cheaper than a tuple of its members, and as exact
    hit = _INTERNED.get(key)
    if hit is not None:
        return typing.cast(Communicator, hit)
    runs = tuple(c.rank_runs)
    if runs and len(c.ranks):
        raise _WireError("a communicator carries both ranks and rank_runs")
    return typing.cast(Communicator, _intern(key, lambda: Communicator(
        c.comm_id, c.backend, c.description, expand_runs(runs) if runs else tuple(c.ranks),
        c.comm_nranks, c.comm_rank if c.HasField("comm_rank") else -1)))  # not sent: unknown, not rank 0


def _encode_thread(obj: ThreadStack, msg: Any) -> None:
    # Only the plain form writes a thread as a message (the compact form's threads are thread_columns); a reply of
    # the compact form before the columns, with threads pointing into stack_table by stack_ref, still decodes.
    rep = msg.frames
    frame_enc = _encoder(Frame)
    for frame in obj.frames:
        frame_enc(frame, rep.add())


def _decode_thread(msg: Any, values: list[Any]) -> list[Any]:
    if msg.HasField("stack_ref"):
        tables: _ReadTables | None = getattr(_DECODING, "tables", None)
        if tables is None:
            raise _WireError("a thread points into a stack table but its machine sent none")
        try:
            values[1] = tables.stack(msg.stack_ref)
        except _WireError as exc:
            exc.path.append(".stack_ref")
            raise
    else:
        values[1] = tuple([_FRAME_DECODER(f) for f in msg.frames])
    return values


def _encode_counters(obj: RankCounters, msg: Any) -> None:
    tables: _WireTables | None = getattr(_ENCODING, "tables", None)
    if tables is None:
        rep = msg.communicators
        comm_enc = _encoder(Communicator)
        for comm in obj.communicators:
            comm_enc(comm, rep.add())
        ops, op_enc = msg.ops, _encoder(OpCounters)
        for op in obj.ops:
            op_enc(op, ops.add())
        return
    if obj.communicators:
        msg.communicator_refs.extend([tables.communicator(c) for c in obj.communicators])
    if obj.ops:
        msg.op_rows = len(obj.ops)
        tables.ops.append(obj.ops)


def _decode_counters(msg: Any, values: list[Any]) -> list[Any]:
    if msg.ops_same:
        before = _previous_counters().get(msg.rank)
        if before is None:
            raise _WireError(f"ops_same for rank {msg.rank}, which the reading it refers to has no counters of")
        values[_OPS_AT], values[_COMMS_AT] = before.ops, before.communicators
        return values
    tables: _ReadTables | None = getattr(_DECODING, "tables", None)
    refs = msg.communicator_refs
    if len(refs):
        if tables is None:
            raise _WireError("counters point into a communicator table but their machine sent none")
        values[_COMMS_AT] = tuple([tables.communicator(r) for r in refs])
    else:
        values[_COMMS_AT] = tuple([_communicator(c) for c in msg.communicators])
    if msg.HasField("op_rows"):
        if len(msg.ops):
            raise _WireError("counters carry both ops and op_rows")
        if tables is None:
            raise _WireError("counters take rows of op_columns but their machine sent none")
        values[_OPS_AT] = tables.ops.take(msg.op_rows)
    else:
        op_dec = _decoder(OpCounters)
        values[_OPS_AT] = tuple([op_dec(o) for o in msg.ops])
    return values


def _encode_rank_stacks(obj: RankStacks, msg: Any) -> None:
    tables: _WireTables | None = getattr(_ENCODING, "tables", None)
    if tables is None:
        process_enc = _encoder(ProcessStack)
        process_enc(obj.main, msg.main)
        for process in obj.subprocesses:
            process_enc(process, msg.subprocesses.add())
    else:
        msg.process_rows = 1 + len(obj.subprocesses)
        tables.processes.append((obj.main, *obj.subprocesses))


def _decode_rank_stacks(msg: Any, values: list[Any]) -> list[Any]:
    if msg.HasField("process_rows"):
        tables: _ReadTables | None = getattr(_DECODING, "tables", None)
        try:
            if msg.HasField("main") or len(msg.subprocesses):
                raise _WireError("a rank's stacks carry both processes and process_rows")
            if tables is None:
                raise _WireError("ranks' stacks take rows of process_columns but their machine sent none")
            if msg.process_rows < 1:
                raise _WireError("0 process rows: a rank's stacks have a main process")
            processes = tables.processes.take(msg.process_rows)
        except _WireError as exc:
            exc.path.append(".process_rows")
            raise
        values[_MAIN_AT], values[_SUBPROCESSES_AT] = processes[0], processes[1:]
    else:
        process_dec = _decoder(ProcessStack)
        values[_MAIN_AT] = process_dec(msg.main)
        values[_SUBPROCESSES_AT] = tuple([process_dec(p) for p in msg.subprocesses])
    return values


def _nothing(raw: Any) -> None:
    return None


def _decode_frame(msg: Any) -> Frame:
    key = (msg.name, msg.filename, msg.line if msg.HasField("line") else None,
           msg.module if msg.HasField("module") else None, msg.native, msg.is_shim)
    return typing.cast(Frame, _intern(("frame", *key), lambda: Frame(*key)))


_FRAME_DECODER: Decoder = _decode_frame
_COMMS_AT = [f.name for f in dataclasses.fields(RankCounters)].index("communicators")
_OPS_AT = [f.name for f in dataclasses.fields(RankCounters)].index("ops")
_THREADS_AT = [f.name for f in dataclasses.fields(ProcessStack)].index("threads")
_ROLE_AT = [f.name for f in dataclasses.fields(ProcessStack)].index("role")
_ERROR_AT = [f.name for f in dataclasses.fields(ProcessStack)].index("error")
_MAIN_AT = [f.name for f in dataclasses.fields(RankStacks)].index("main")
_SUBPROCESSES_AT = [f.name for f in dataclasses.fields(RankStacks)].index("subprocesses")
# process_columns: a process's role as its proto number, its threads as a count of thread rows, its error as a number
_CODED_PROCESS = frozenset({"role", "threads", "error"})
_FRAMES_AT = [f.name for f in dataclasses.fields(ThreadStack)].index("frames")
# Types whose messages take rows of a reply's columns, themselves or through what they hold.
_TAKERS = frozenset({MachineSnapshot, RankStacks, RankCounters})
_CODED_FRAMES = frozenset({"frames"})  # thread_columns: a thread's frames as the number of its stack in stack_table


# ---- the delta form: what did not change since the reading a client holds --------
#
# A TUI polls every agent every second; a job whose state did not change would
# otherwise cost its whole description again each time (22 MB and seconds of
# decoding at 2,048 agents). The agent remembers, for its last few readings,
# a digest of each rank's description and of each rank's operation counters
# (with its communicators); a client that names one of them as `since` gets
# those that are still the same as a mark only, and keeps its own objects.
# What changes all the time (heartbeats, step counts, host and GPU metrics)
# is always sent.


def _decode_ranks(raw: Any) -> tuple[RankInfo, ...]:
    dec = _decoder(RankInfo)
    out: list[RankInfo] = []
    before: dict[int, RankInfo] | None = None
    for i, r in enumerate(raw):
        if r.same:
            if before is None:
                previous: MachineSnapshot | None = getattr(_DECODING, "previous", None)
                before = {x.rank: x for x in previous.ranks} if previous is not None else {}
            made = before.get(r.rank)
            if made is None:
                exc = _WireError(f"same for rank {r.rank}, which the reading it refers to does not list")
                exc.path.append(f"[{i}]")
                raise exc
            out.append(made)
        else:
            out.append(dec(r))
    return tuple(out)


def _previous_counters() -> dict[int, RankCounters]:
    previous: MachineSnapshot | None = getattr(_DECODING, "previous", None)
    if previous is None:
        return {}
    cached: tuple[MachineSnapshot, dict[int, RankCounters]] | None = getattr(_DECODING, "counters_of", None)
    if cached is None or cached[0] is not previous:
        cached = _DECODING.counters_of = (previous, {c.rank: c for c in previous.counters})
    return cached[1]


class ReadingVersions:
    """An agent's memory of its last few replies, so that a client holding one gets a delta against it."""

    def __init__(self, keep: int = 16) -> None:
        self.keep = keep  # a few clients (a TUI, a script, a relay) poll one agent at once
        self._digests: dict[int, tuple[dict[int, bytes], dict[int, bytes]]] = {}

    def stamp(self, msg: pb.MachineSnapshot, since: int | None) -> None:
        """Give ``msg`` (a whole reading, compact form) a version and, when ``since`` is remembered, make it
        a delta against that reading."""
        ranks = _digests((r.rank, (r.SerializeToString(deterministic=True),)) for r in msg.ranks)
        table = msg.communicator_table
        op_rows = _OpRows(msg)
        ops = _digests((c.rank, (*(o.SerializeToString(deterministic=True) for o in c.ops),
                                 *(table[r].SerializeToString(deterministic=True) for r in c.communicator_refs
                                   if r < len(table)),
                                 *(m.SerializeToString(deterministic=True) for m in c.communicators),
                                 *op_rows.parts(i)))
                       for i, c in enumerate(msg.counters))
        version = int.from_bytes(os.urandom(8), "little")
        old = self._digests.get(since) if since is not None else None
        if old is not None:
            old_ranks, old_ops = old
            for r in msg.ranks:
                if r.rank in ranks and old_ranks.get(r.rank) == ranks[r.rank]:
                    rank = r.rank
                    r.Clear()
                    r.rank, r.same = rank, True
            for i, c in enumerate(msg.counters):
                if c.rank in ops and old_ops.get(c.rank) == ops[c.rank]:
                    op_rows.drop(i)
                    for name in ("ops", "communicator_refs", "communicators", "op_rows"):
                        c.ClearField(name)
                    c.ops_same = True
            op_rows.write(msg)
            if all(c.ops_same for c in msg.counters):
                msg.ClearField("communicator_table")
            msg.since = typing.cast(int, since)
        msg.version = version
        self._digests[version] = (ranks, ops)
        while len(self._digests) > self.keep:
            del self._digests[next(iter(self._digests))]


class _OpRows:
    """A compact reply's op_columns cut by the counters that own the rows: their digest parts, and the columns
    again without the rows of counters a delta marks ``ops_same``."""

    def __init__(self, msg: pb.MachineSnapshot) -> None:
        self.values = read_values(OpCounters, msg.op_columns) if msg.HasField("op_columns") else []
        self.rows: dict[int, range] = {}  # the position of a counters entry in msg.counters -> its rows
        start = 0
        for i, c in enumerate(msg.counters):
            if c.HasField("op_rows"):
                self.rows[i] = range(start, start + c.op_rows)
                start += c.op_rows
        self.dropped: set[int] = set()

    def parts(self, at: int) -> tuple[bytes, ...]:
        rows = self.rows.get(at)
        if rows is None:
            return ()
        # repr of ints, floats (exact), strings and tuples of them: the rows' values, whatever their column order
        return (repr([column[rows.start:rows.stop] for column in self.values]).encode(),)

    def drop(self, at: int) -> None:
        self.dropped.update(self.rows.get(at, ()))

    def write(self, msg: pb.MachineSnapshot) -> None:
        if not self.dropped:
            return
        keep = [i for i in range(len(self.values[0])) if i not in self.dropped]
        msg.ClearField("op_columns")
        if keep:
            write_columns(OpCounters, [[column[i] for i in keep] for column in self.values], msg.op_columns)


def _digests(items: Iterable[tuple[int, tuple[bytes, ...]]]) -> dict[int, bytes]:
    """rank -> a digest of its parts; a rank listed twice has none (it is always sent whole)."""
    out: dict[int, bytes] = {}
    twice: set[int] = set()
    for rank, parts in items:
        if rank in out:
            twice.add(rank)
        h = hashlib.blake2b(digest_size=16)
        for part in parts:
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        out[rank] = h.digest()
    for rank in twice:
        del out[rank]
    return out
_SPECIAL_ENCODERS: dict[type, Encoder] = {ThreadStack: _encode_thread, RankCounters: _encode_counters,
                                           RankStacks: _encode_rank_stacks}
_SPECIAL_DECODERS: dict[type, Callable[[Any, list[Any]], list[Any]]] = {
    ThreadStack: _decode_thread, RankCounters: _decode_counters, RankStacks: _decode_rank_stacks,
}


# --------------------------------------------------------------------------
# enums
# --------------------------------------------------------------------------


def _enum_descriptor(enum_cls: type[Enum]) -> Any:
    return pb.DESCRIPTOR.enum_types_by_name[enum_cls.__name__]


def _enum_to_proto(value: Enum) -> int:
    prefix, _fallback = ENUMS[type(value)]
    return int(_enum_descriptor(type(value)).values_by_name[prefix + value.name].number)


def _enum_from_proto(enum_cls: type[Enum], number: int) -> Enum:
    prefix, fallback = ENUMS[enum_cls]
    value = _enum_descriptor(enum_cls).values_by_number.get(number)
    member = None
    if value is not None and value.name.startswith(prefix):
        member = enum_cls.__members__.get(value.name[len(prefix):])
    if member is not None:
        return member
    if fallback is None:
        raise ValueError(f"{enum_cls.__name__} value {number} is unset or unknown here")
    return fallback


# process_columns' role column: the proto numbers of ProcessRole (an unknown one decodes to the enum's fallback).
_ROLE_NUMBERS = {role: _enum_to_proto(role) for role in ProcessRole}
_ROLE_DECODER = typing.cast(Decoder, _field_decoder(ProcessStack, "role", ProcessRole))
