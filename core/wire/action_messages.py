"""The action protocol's messages: requests, plans, progress and results, confirmations, audit records.

``ActionRequest`` and ``ActionPlan`` have hand-written conversions (a oneof,
and nested tuples); the rest go through the generic codec (``rankscope.wire.codec``).
"""

from __future__ import annotations

import typing

from rankscope.actions.agent_protocol import Confirmation
from rankscope.actions.model import (
    ActionKind,
    ActionPlan,
    ActionProgress,
    ActionRequest,
    ActionResult,
    AuditRecord,
    BackupArgs,
    EvictArgs,
    HotUpdateArgs,
    ProcessRef,
    RollbackArgs,
    Targets,
)
from rankscope.contract.errors import RankscopeError
from rankscope.wire.codec import (
    ProtoConversionError,
    decode_message,
    enum_from_proto,
    enum_to_proto,
    from_proto,
    to_proto,
)
from rankscope.wire.proto import rankscope_pb2 as pb

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
    msg = pb.ActionRequest(action_id=request.action_id, kind=enum_to_proto(request.kind),  # type: ignore[arg-type]
                           requested_by=request.requested_by)
    msg.targets.CopyFrom(typing.cast(pb.Targets, to_proto(request.targets)))
    getattr(msg, _ARGS_FIELD[request.kind]).CopyFrom(to_proto(request.args))
    if request.job_id is not None:
        msg.job_id = request.job_id
    return msg


def request_from_proto(msg: pb.ActionRequest) -> ActionRequest:
    """A client's request -> ActionRequest; the model's own checks run (ids, refs, reasons)."""
    try:
        kind = typing.cast(ActionKind, enum_from_proto(ActionKind, int(msg.kind)))
        which = msg.WhichOneof("args")
        if which is None:
            raise ValueError(f"a {kind.value} request carries no arguments")
        if which != _ARGS_FIELD[kind]:
            raise ValueError(f"a {kind.value} request carries {which} arguments")
        args = decode_message(_ARGS_CLASS[which], getattr(msg, which), f"ActionRequest.{which}")
        targets = decode_message(Targets, msg.targets, "ActionRequest.targets")
    except (TypeError, ValueError) as exc:
        raise ActionDecodeError(f"malformed action request: {exc}") from None
    return ActionRequest(
        action_id=msg.action_id, kind=kind, targets=targets, args=args, requested_by=msg.requested_by,
        job_id=msg.job_id if msg.HasField("job_id") else None,
    )


def plan_to_proto(plan: ActionPlan) -> pb.ActionPlan:
    msg = pb.ActionPlan(
        action_id=plan.action_id, kind=enum_to_proto(plan.kind), summary=plan.summary,  # type: ignore[arg-type]
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
            action_id=msg.action_id, kind=typing.cast(ActionKind, enum_from_proto(ActionKind, int(msg.kind))),
            summary=msg.summary, machines=tuple(msg.machines),
            processes=tuple(decode_message(ProcessRef, p, "ActionPlan.processes") for p in msg.processes),
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
