"""Snapshot contract <-> protobuf: the one place where the two meet.

The messages in ``rankscope.proto`` mirror the dataclasses of
``rankscope.snapshot`` name for name, so the conversion is driven by the
dataclass fields instead of one hand-written function per type: a field added
to the contract cannot be silently dropped on the wire, because
tests/test_proto.py checks that every dataclass field has a proto field of the
same name (and that every optional value has presence on the wire).

``None`` travels as an unset field (proto3 ``optional`` or an absent message),
never as zero, so a missing reading stays missing after the trip.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from typing import Any, TypeVar

from google.protobuf.message import Message
from rankscope.errors import RankscopeError
from rankscope.proto import rankscope_pb2 as pb
from rankscope.snapshot import (
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
    ThreadStack,
)

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
    MachineSnapshot: pb.MachineSnapshot,
    Layout: pb.Layout,
    JobSnapshot: pb.JobSnapshot,
}

# Proto enum value names are the contract member names with a prefix
# (ProcessRole.MAIN <-> PROCESS_ROLE_MAIN). A value this side does not know
# (sent by a newer agent) decodes to the fallback instead of failing the snapshot.
ENUMS: dict[type[Enum], tuple[str, Enum]] = {
    ProcessRole: ("PROCESS_ROLE_", ProcessRole.OTHER),
    CaptureErrorKind: ("CAPTURE_ERROR_KIND_", CaptureErrorKind.FAILED),
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


def machine_to_proto(machine: MachineSnapshot) -> pb.MachineSnapshot:
    return typing.cast(pb.MachineSnapshot, to_proto(machine))


def machine_from_proto(msg: pb.MachineSnapshot) -> MachineSnapshot:
    return from_proto(MachineSnapshot, msg)


def job_to_proto(job: JobSnapshot) -> pb.JobSnapshot:
    return typing.cast(pb.JobSnapshot, to_proto(job))


def job_from_proto(msg: pb.JobSnapshot) -> JobSnapshot:
    return from_proto(JobSnapshot, msg)


def to_proto(obj: Any) -> Message:
    """Any contract dataclass -> its message."""
    cls = type(obj)
    msg_cls = MESSAGES.get(cls)
    if msg_cls is None:
        raise TypeError(f"{cls.__name__} has no proto message")
    msg = msg_cls()
    for f in dataclasses.fields(cls):
        value = getattr(obj, f.name)
        if value is None:
            continue  # unset on the wire
        wrapped = WRAPPED.get((cls, f.name))
        if wrapped is not None:
            holder = getattr(msg, f.name)
            holder.SetInParent()  # present even when the tuple is empty
            getattr(holder, wrapped).extend(to_proto(v) for v in value)
        elif dataclasses.is_dataclass(value):
            getattr(msg, f.name).CopyFrom(to_proto(value))
        elif isinstance(value, Enum):
            setattr(msg, f.name, _enum_to_proto(value))
        elif isinstance(value, tuple):
            getattr(msg, f.name).extend(
                to_proto(v) if dataclasses.is_dataclass(v) else v for v in value
            )
        else:
            setattr(msg, f.name, value)
    return msg


def from_proto(cls: type[T], msg: Message) -> T:
    """A message -> the contract dataclass ``cls``."""
    try:
        return typing.cast(T, _decode_message(cls, msg, cls.__name__))
    except (TypeError, ValueError) as exc:
        raise ProtoConversionError(f"agent sent a {cls.__name__} that does not fit the contract: {exc}") from None


# --------------------------------------------------------------------------
# decoding
# --------------------------------------------------------------------------

_HINTS: dict[type, dict[str, Any]] = {}


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


def _decode_message(cls: type, msg: Message, where: str) -> Any:
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        tp = _hints(cls)[f.name]
        inner = optional_inner(tp)
        if inner is not None:
            if not msg.HasField(f.name):
                kwargs[f.name] = None
                continue
            tp = inner
        raw = getattr(msg, f.name)
        wrapped = WRAPPED.get((cls, f.name))
        if wrapped is not None:
            raw = getattr(raw, wrapped)
        kwargs[f.name] = _decode_value(tp, raw, f"{where}.{f.name}")
    return cls(**kwargs)


def _decode_value(tp: Any, raw: Any, where: str) -> Any:
    if typing.get_origin(tp) is tuple:
        (item_tp, _ellipsis) = typing.get_args(tp)
        return tuple(_decode_value(item_tp, v, f"{where}[{i}]") for i, v in enumerate(raw))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _decode_message(tp, raw, where)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return _enum_from_proto(tp, int(raw))
    if tp is float:
        return float(raw)
    if tp is int:
        return int(raw)
    if tp is bool:
        return bool(raw)
    if tp is str:
        return str(raw)
    raise TypeError(f"{where}: cannot decode type {tp!r}")


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
    if value is None or not value.name.startswith(prefix):
        return fallback
    member = enum_cls.__members__.get(value.name[len(prefix):])
    return member if member is not None else fallback
