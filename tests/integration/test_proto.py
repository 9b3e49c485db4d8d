"""The wire format: committed generated code, field coverage and lossless round trips."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any

import pytest
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
from rankscope.contract.bundle import Bundle, dumps, loads
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import (
    CaptureError,
    CaptureErrorKind,
    Instant,
    JobSnapshot,
    ProcessRole,
    ProcessStack,
)
from rankscope.wire.action_messages import (
    event_from_proto,
    event_to_proto,
    plan_from_proto,
    plan_to_proto,
    request_from_proto,
    request_to_proto,
)
from rankscope.wire.codec import ENUMS, MESSAGES, WIRE_ONLY, from_proto, optional_inner, to_proto
from rankscope.wire.proto import rankscope_pb2 as pb
from rankscope.wire.proto.generate import GENERATED, HERE, generate
from rankscope.wire.snapshot_codec import machine_from_proto, machine_to_proto
from snapshot_fixtures import rich_job


@pytest.mark.timeout(120)
def test_regenerating_changes_nothing(tmp_path: Path) -> None:
    fresh = generate(tmp_path)
    for name in GENERATED:
        committed = (HERE / name).read_bytes()
        assert fresh[name] == committed, f"{name} differs from a fresh protoc run: run `python -m rankscope.wire.proto.generate` and commit"
    assert b"from rankscope.wire.proto import rankscope_pb2" in fresh["rankscope_pb2_grpc.py"]
    assert b"\nimport rankscope_pb2" not in fresh["rankscope_pb2_grpc.py"]


@pytest.mark.parametrize("cls", list(MESSAGES), ids=lambda c: c.__name__)
def test_every_contract_field_has_a_proto_field(cls: type) -> None:
    descriptor = MESSAGES[cls].DESCRIPTOR
    wire = {f.name: f for f in descriptor.fields if f.name not in WIRE_ONLY.get(cls, ())}
    ours = {f.name for f in dataclasses.fields(cls)}
    assert set(wire) == ours, f"{cls.__name__}: only in proto {set(wire) - ours}, only in contract {ours - set(wire)}"
    hints = typing.get_type_hints(cls)
    for name in ours:
        if optional_inner(hints[name]) is not None:
            assert wire[name].has_presence, f"{cls.__name__}.{name} can be None but the proto field has no presence"


def _holding(member: Any) -> Any:
    """A contract value whose message carries ``member`` (one per enum type)."""
    holders: dict[type, Any] = {
        CaptureErrorKind: lambda m: CaptureError(m, "m"),
        ProcessRole: lambda m: ProcessStack(1, m, None),
        ActionKind: lambda m: ActionResult("a1", m, ActionState.FAILED, "m"),
        ActionState: lambda m: ActionResult("a1", ActionKind.EVICT, m, "m"),
        UpdateMode: lambda m: RollbackArgs("v1", m),
        VersionSource: lambda m: HotUpdateArgs(m, "/srv/v2" if m == VersionSource.DIR else "v2"),
    }
    return holders[type(member)](member)


@pytest.mark.parametrize("enum_cls", list(ENUMS), ids=lambda c: c.__name__)
def test_every_enum_member_crosses_the_wire(enum_cls: type) -> None:
    for member in enum_cls:  # type: ignore[var-annotated]
        value = _holding(member)
        assert from_proto(type(value), to_proto(value)) == value


def test_an_unknown_enum_value_from_a_newer_agent_falls_back() -> None:
    msg = pb.CaptureError(kind=99, message="new kind")  # type: ignore[arg-type]
    assert from_proto(CaptureError, msg) == CaptureError(CaptureErrorKind.FAILED, "new kind", "")


def test_a_rich_job_snapshot_survives_proto_bytes_and_back() -> None:
    job = rich_job()
    wire = to_proto(job).SerializeToString()
    back = from_proto(JobSnapshot, pb.JobSnapshot.FromString(wire))
    assert back == job
    # the distinctions that matter: None vs empty threads, missing vs zero readings
    stacks = back.machines[0].stacks[0]
    assert stacks.subprocesses[0].threads is None and stacks.subprocesses[1].threads == ()
    assert back.machines[0].ranks[0].group_rank is None and back.machines[0].ranks[1].group_rank == 2
    assert back.machines[1].captured is None and back.machines[1].host is None
    gone = stacks.subprocesses[0]
    assert gone.error is not None and (gone.error.process_state, gone.error.wchan) == ("Z", "do_exit")
    assert gone.truncated == "ends mid-line" and stacks.main.truncated is None
    assert back.machines[0].ranks[0].rank_source is None and back.machines[0].ranks[1].rank_source


def test_a_minimal_job_snapshot_round_trips() -> None:
    job = JobSnapshot(captured=Instant(0.0, 0.0), machines=())
    assert from_proto(JobSnapshot, to_proto(job)) == job


def test_machine_snapshot_round_trips_alone() -> None:
    machine = rich_job().machines[0]
    assert machine_from_proto(pb.MachineSnapshot.FromString(machine_to_proto(machine).SerializeToString())) == machine


def test_bundle_round_trip_of_a_snapshot_that_crossed_the_wire() -> None:
    """What `rankscope snapshot` does: proto from the agents -> JobSnapshot -> bundle JSON -> JobSnapshot."""
    job = from_proto(JobSnapshot, pb.JobSnapshot.FromString(to_proto(rich_job()).SerializeToString()))
    bundle = Bundle(snapshots=(job,), created_wall=1.7e9 + 1, meta={"command": "snapshot"})
    back = loads(dumps(bundle))
    assert back.snapshots == (job,) and back.latest == rich_job()
    assert back.meta == {"command": "snapshot"}


# ---- the action protocol ------------------------------------------------------


@pytest.mark.parametrize("request_", [
    ActionRequest("a-1", ActionKind.EVICT, Targets(("node-3",), (6, 7)), EvictArgs("stuck in all_gather"), "alice",
                  "job-7"),
    ActionRequest("a-2", ActionKind.HOT_UPDATE, Targets(), HotUpdateArgs(VersionSource.GIT, "v2.1", UpdateMode.LAZY,
                                                                           3600.0, "fix the loader"), "bob"),
    ActionRequest("a-3", ActionKind.HOT_UPDATE, Targets(("n1",)), HotUpdateArgs(VersionSource.DIR, "/srv/v3"), "bob"),
    ActionRequest("a-4", ActionKind.ROLLBACK, Targets(ranks=(0,)), RollbackArgs("", UpdateMode.IMMEDIATE), "carol"),
    ActionRequest("a-5", ActionKind.BACKUP, Targets(), BackupArgs("nightly"), "dave"),
], ids=lambda r: r.kind.value)
def test_action_requests_survive_the_wire(request_: ActionRequest) -> None:
    wire = request_to_proto(request_).SerializeToString()
    assert request_from_proto(pb.ActionRequest.FromString(wire)) == request_


def test_request_and_plan_messages_cover_every_model_field() -> None:
    request_fields = {f.name for f in pb.ActionRequest.DESCRIPTOR.fields} | {"args"}
    # `caller` is what the agent learnt from the token the request came with: set on arrival, never sent, so a
    # client cannot claim another's identity.
    assert request_fields - {"evict", "hot_update", "backup", "rollback"} == \
        {f.name for f in dataclasses.fields(ActionRequest)} - {"caller"}
    assert "caller" not in request_fields
    assert {f.name for f in pb.ActionPlan.DESCRIPTOR.fields} == {f.name for f in dataclasses.fields(ActionPlan)}


def test_an_action_plan_survives_the_wire() -> None:
    plan = ActionPlan("a-1", ActionKind.EVICT, "evict node-3", ("node-3",),
                      (ProcessRef("node-3", 100, 6), ProcessRef("node-3", 101, None)), ("spare-1",), ((6, 2), (7, 3)),
                      (("scontrol", "update", "NodeName=node-3"), ("scontrol", "requeue", "12")), ("drain",),
                      ("few standbys",), True, "evict node-3")
    assert plan_from_proto(pb.ActionPlan.FromString(plan_to_proto(plan).SerializeToString())) == plan


def test_progress_results_audit_records_and_confirmations_round_trip() -> None:
    progress = ActionProgress("a-1", 1.7e9, 2, 3, "sent SIGTERM")
    result = ActionResult("a-1", ActionKind.EVICT, ActionState.SUCCEEDED, "done", 1.7e9, None, ("pid 3",), True)
    assert event_from_proto(event_to_proto(progress)) == progress
    assert event_from_proto(event_to_proto(result)) == result
    assert event_from_proto(event_to_proto(result)).finished is None  # unset, not 0.0
    record = AuditRecord(7, "a-1", "alice", 1.7e9, ActionKind.HOT_UPDATE, "hot_update the whole job", "started",
                         "", ("n1", "n2"))
    assert from_proto(AuditRecord, to_proto(record)) == record
    confirmation = Confirmation(("n1",), (0, 1), "evict n1")
    assert from_proto(Confirmation, to_proto(confirmation)) == confirmation


def test_an_action_request_without_kind_or_arguments_is_refused_not_guessed() -> None:
    good = request_to_proto(ActionRequest("a-1", ActionKind.EVICT, Targets(("n1",)), EvictArgs("r"), "alice"))
    no_kind = pb.ActionRequest()
    no_kind.CopyFrom(good)
    no_kind.kind = pb.ACTION_KIND_UNSPECIFIED
    with pytest.raises(RankscopeError, match="malformed action request"):
        request_from_proto(no_kind)
    mismatched = pb.ActionRequest()
    mismatched.CopyFrom(good)
    mismatched.kind = pb.ACTION_KIND_HOT_UPDATE
    with pytest.raises(RankscopeError, match="carries evict arguments"):
        request_from_proto(mismatched)
    shell = pb.ActionRequest()
    shell.CopyFrom(good)
    shell.evict.reason = "x\nrm -rf /"
    with pytest.raises(RankscopeError, match="eviction reason"):
        request_from_proto(shell)
