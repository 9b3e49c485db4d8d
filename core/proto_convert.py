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
    StackSampleWindow,
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


def machine_to_proto(machine: MachineSnapshot) -> pb.MachineSnapshot:
    return typing.cast(pb.MachineSnapshot, to_proto(machine))


def machine_from_proto(msg: pb.MachineSnapshot) -> MachineSnapshot:
    return from_proto(MachineSnapshot, msg)


def job_to_proto(job: JobSnapshot) -> pb.JobSnapshot:
    return typing.cast(pb.JobSnapshot, to_proto(job))


def job_from_proto(msg: pb.JobSnapshot) -> JobSnapshot:
    return from_proto(JobSnapshot, msg)


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
    member = None
    if value is not None and value.name.startswith(prefix):
        member = enum_cls.__members__.get(value.name[len(prefix):])
    if member is not None:
        return member
    if fallback is None:
        raise ValueError(f"{enum_cls.__name__} value {number} is unset or unknown here")
    return fallback
