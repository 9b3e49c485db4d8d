"""Contract dataclasses <-> protobuf messages: the one generic codec, driven by the dataclass fields.

The messages in ``rankscope.wire.proto`` mirror the dataclasses of
``rankscope.contract.snapshot`` (and of the action protocol,
``rankscope.actions.model``) name for name, so the conversion is driven by the
dataclass fields instead of one hand-written function per type: a field added
to the contract cannot be silently dropped on the wire, because
tests/integration/test_proto.py checks that every dataclass field has a proto field of the
same name (and that every optional value has presence on the wire).

``None`` travels as an unset field (proto3 ``optional`` or an absent message),
never as zero, so a missing reading stays missing after the trip.

What a machine's reply sends more compactly (``rankscope.wire.compact``) and
what it leaves out as unchanged (``rankscope.wire.delta``) hook into this codec;
``rankscope.wire.snapshot_codec`` is the entry for a machine's reply and
``rankscope.wire.action_messages`` for the action protocol.
"""

from __future__ import annotations

import dataclasses
import keyword
import operator
import threading
import types
import typing
from collections.abc import Callable
from enum import Enum
from typing import Any, TypeVar

from google.protobuf.message import Message
from rankscope.actions.agent_protocol import Confirmation
from rankscope.actions.model import (
    ActionKind,
    ActionProgress,
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


def to_proto(obj: Any) -> Message:
    """Any contract dataclass -> its message (plain form: no tables)."""
    cls = type(obj)
    msg_cls = MESSAGES.get(cls)
    if msg_cls is None:
        raise TypeError(f"{cls.__name__} has no proto message")
    msg = msg_cls()
    encoder(cls)(obj, msg)
    return msg


def from_proto(cls: type[T], msg: Message) -> T:
    """A message -> the contract dataclass ``cls``."""
    try:
        return typing.cast(T, decode_message(cls, msg, cls.__name__))
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
                                  "thread_columns", "process_columns", "process_errors", "merged"}),
}

# What the generic codec leaves to the compact tables and the delta (rankscope.wire.compact and
# rankscope.wire.delta fill these when imported; rankscope.wire.snapshot_codec imports both):
# contract fields written through a table in the compact form (by the type's special encoder),
TABLED: set[tuple[type, str]] = set()
# each type's encoder and decoder of those fields,
SPECIAL_ENCODERS: dict[type, Encoder] = {}
SPECIAL_DECODERS: dict[type, Callable[[Any, list[Any]], list[Any]]] = {}
# fields decoded by a hook instead of by their type, what wraps a type's whole decoder,
FIELD_DECODERS: dict[tuple[type, str], Decoder] = {}
DECODE_WRAPPERS: dict[type, Callable[[Decoder], Decoder]] = {}
# types whose messages take rows of a reply's columns, themselves or through what they hold,
TAKERS: set[type] = set()
# and which of the two are installed: a type they change is never compiled without them.
INSTALLED: set[str] = set()
_HOOKED = frozenset({ThreadStack, RankCounters, RankStacks, MachineSnapshot})
# The state of the one encoding and decoding under way in this thread (tables, the reading a delta refers to).
ENCODING = threading.local()
DECODING = threading.local()

_HINTS: dict[type, dict[str, Any]] = {}
_ENCODERS: dict[type, Encoder] = {}
_DECODERS: dict[type, Decoder] = {}


class WireError(Exception):
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


def _check_hooks(cls: type) -> None:
    if cls in _HOOKED and not {"compact", "delta"} <= INSTALLED:
        raise RuntimeError(f"{cls.__name__}'s codec needs the compact tables and the delta: "
                           "import rankscope.wire.snapshot_codec")


def encoder(cls: type) -> Encoder:
    enc = _ENCODERS.get(cls)
    if enc is None:
        enc = _ENCODERS[cls] = _build_encoder(cls)
    return enc


def decoder(cls: type) -> Decoder:
    dec = _DECODERS.get(cls)
    if dec is None:
        dec = _DECODERS[cls] = _build_decoder(cls)
    return dec


def decode_message(cls: type, msg: Message, where: str) -> Any:
    try:
        return decoder(cls)(msg)
    except WireError as exc:
        raise ValueError(f"{where}{''.join(reversed(exc.path))}: {exc.problem}") from None


# ---- encoding -------------------------------------------------------------------


def _build_encoder(cls: type) -> Encoder:
    _check_hooks(cls)
    steps: list[Encoder] = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        tp = optional_inner(tp) or tp
        steps.append(_field_encoder(cls, f.name, tp))
    special = SPECIAL_ENCODERS.get(cls)

    def encode(obj: Any, msg: Any) -> None:
        for step in steps:
            step(obj, msg)
        if special is not None:
            special(obj, msg)

    return encode


def _field_encoder(cls: type, name: str, tp: Any) -> Encoder:
    getter = operator.attrgetter(name)
    if (cls, name) in TABLED:
        return lambda obj, msg: None  # written by the type's special encoder (plain form or table reference)
    wrapped = WRAPPED.get((cls, name))
    if wrapped is not None:
        (item_tp, _) = typing.get_args(tp)
        item_enc = encoder(item_tp)

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
            item_enc = encoder(item_tp)

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
        sub = encoder(tp)

        def enc_message(obj: Any, msg: Any) -> None:
            value = getter(obj)
            if value is not None:
                holder = getattr(msg, name)
                holder.SetInParent()
                sub(value, holder)

        return enc_message
    if isinstance(tp, type) and issubclass(tp, Enum):
        numbers = {m: enum_to_proto(m) for m in tp}

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
    _check_hooks(cls)
    plan: list[tuple[str, bool, Decoder | None]] = []
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        inner = optional_inner(tp)
        plan.append((f.name, inner is not None, field_decoder(cls, f.name, inner or tp)))
    special = SPECIAL_DECODERS.get(cls)
    decode = _fast_decoder(cls, plan, special, _plain_decoder(cls, plan, special))
    wrap = DECODE_WRAPPERS.get(cls)
    return wrap(decode) if wrap is not None else decode


def _fast_decoder(cls: type, plan: list[tuple[str, bool, Decoder | None]],
                  special: Callable[[Any, list[Any]], list[Any]] | None, plain: Decoder) -> Decoder:
    """One generated function per type: a single constructor call over the message's fields.

    The generic loop of ``_plain_decoder`` cost ~10 us per message (a capture of 2,048 agents decodes
    400,000 of them); written out per type, the same work is a few attribute reads. It reports no
    field path: on a value that does not fit it runs ``plain`` again, which raises naming the field.
    """
    namespace: dict[str, Any] = {"cls": cls, "special": special, "plain": plain, "WireError": WireError}
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
    if cls in TAKERS:
        # ``plain`` decodes the message again to name the field: it must take the same rows of the reply's columns,
        # so the rows this attempt took are given back first.
        namespace["decoding"] = DECODING
        source = ("def decode(msg):\n    tables = getattr(decoding, 'tables', None)\n"
                  "    at = tables.mark() if tables is not None else None\n    try:\n"
                  + "".join(f"        {line}\n" for line in lines)
                  + "    except WireError:\n        if at is not None:\n            tables.rewind(at)\n"
                  "        return plain(msg)\n")
    else:
        source = "def decode(msg):\n    try:\n" + "".join(f"        {line}\n" for line in lines) \
            + "    except WireError:\n        return plain(msg)\n"
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
        except WireError as exc:
            if name:
                exc.path.append(f".{name}")
            raise
        return cls(*values)

    return decode


def _nothing(raw: Any) -> None:
    return None


def field_decoder(cls: type, name: str, tp: Any) -> Decoder | None:
    """How to turn the message's field into the contract value; None: protobuf's own value is it."""
    if (cls, name) in TABLED:
        return _nothing  # filled by the type's special decoder (plain list or table references)
    hook = FIELD_DECODERS.get((cls, name))
    if hook is not None:
        return hook
    wrapped = WRAPPED.get((cls, name))
    if wrapped is not None:
        (item_tp, _) = typing.get_args(tp)
        item_dec = decoder(item_tp)
        return lambda holder: tuple([item_dec(v) for v in getattr(holder, wrapped)])
    if typing.get_origin(tp) is tuple:
        (item_tp, _) = typing.get_args(tp)
        if _is_dataclass_type(item_tp):
            item_dec = decoder(item_tp)
            return lambda raw: tuple([item_dec(v) for v in raw])
        if isinstance(item_tp, type) and issubclass(item_tp, Enum):
            raise TypeError(f"{cls.__name__}.{name}: tuples of enums have no wire form")
        return tuple
    if _is_dataclass_type(tp):
        return decoder(tp)
    if isinstance(tp, type) and issubclass(tp, Enum):
        enum_cls = tp

        known = {v.number: enum_from_proto(enum_cls, v.number) for v in _enum_descriptor(enum_cls).values
                 if v.number != 0 or ENUMS[enum_cls][1] is not None}

        def dec_enum(raw: int) -> Enum:
            member = known.get(raw)
            if member is not None:
                return member
            try:
                return enum_from_proto(enum_cls, raw)
            except ValueError as exc:
                raise WireError(str(exc)) from None

        return dec_enum
    if tp in (int, float, str, bool):
        return None  # protobuf hands back exactly these types for int64, double, string and bool fields
    raise TypeError(f"{cls.__name__}.{name}: cannot decode type {tp!r}")


# --------------------------------------------------------------------------
# enums
# --------------------------------------------------------------------------


def _enum_descriptor(enum_cls: type[Enum]) -> Any:
    return pb.DESCRIPTOR.enum_types_by_name[enum_cls.__name__]


def enum_to_proto(value: Enum) -> int:
    prefix, _fallback = ENUMS[type(value)]
    return int(_enum_descriptor(type(value)).values_by_name[prefix + value.name].number)


def enum_from_proto(enum_cls: type[Enum], number: int) -> Enum:
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


