from __future__ import annotations

import json
from pathlib import Path

import pytest
from rankscope.contract.bundle import Bundle, BundleError, loads, read_bundle, write_bundle
from rankscope.contract.snapshot import (
    CaptureError,
    CaptureErrorKind,
    Communicator,
    Frame,
    Instant,
    JobSnapshot,
    Layout,
    MachineSnapshot,
    OpCounters,
    ProcessRole,
    ProcessStack,
    RankCounters,
    RankInfo,
    RankStacks,
    ThreadStack,
)
from repo_paths import ROOT


def _snapshot() -> JobSnapshot:
    frames = (Frame("wait", "/x/dist.py", 12, None), Frame("<module>", "train.py", 3, is_shim=True))
    stacks = RankStacks(
        rank=1,
        main=ProcessStack(pid=11, role=ProcessRole.MAIN, threads=(ThreadStack(1, frames, "MainThread"),)),
        subprocesses=(ProcessStack(pid=12, role=ProcessRole.DATALOADER, threads=None,
                                   error=CaptureError(CaptureErrorKind.GONE, "exited", "")),),
    )
    counters = RankCounters(
        rank=1, pid=11, world_size=2, job_id="j", heartbeat_wall=5.0,
        communicators=(Communicator("c0", "gloo", "DATA_PARALLEL_GROUP", (0, 1)),),
        ops=(OpCounters("c0", "all_reduce", 3, 3, 2, recent_throughput=(1.0, 2.5)),),
    )
    good = MachineSnapshot("m0", "127.0.0.1:1", True, Instant(1.0, 2.0),
                           ranks=(RankInfo(rank=1, local_rank=1, world_size=2, pid=11),),
                           stacks=(stacks,), counters=(counters,))
    lost = MachineSnapshot("m1", "127.0.0.1:2", False, None,
                           error=CaptureError(CaptureErrorKind.UNREACHABLE, "connection refused", "start the agent"))
    return JobSnapshot(Instant(1.0, 2.0), (good, lost), job_id="j", layout=Layout(tp=2, dp=1))


def test_round_trip_keeps_every_value(tmp_path: Path) -> None:
    bundle = Bundle(snapshots=(_snapshot(),), created_wall=3.0, ground_truth={"fault": "hang-p2p", "rank": 1})
    path = write_bundle(bundle, tmp_path / "b.json")
    back = read_bundle(path)
    assert back.snapshots == bundle.snapshots
    assert back.ground_truth == {"fault": "hang-p2p", "rank": 1}
    assert back.latest.machines[1].error is not None
    assert back.latest.machines[1].error.kind is CaptureErrorKind.UNREACHABLE
    assert back.latest.all_counters()[1].ops[0].recent_throughput == (1.0, 2.5)


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d.update(format="other"), "not a rankscope bundle"),
        (lambda d: d.update(version=99), "version 99"),
        (lambda d: d["snapshots"][0]["machines"][0]["ranks"][0].update(rank="one"),
         "snapshots[0].machines[0].ranks[0].rank: expected an integer"),
        (lambda d: d["snapshots"][0]["machines"][0].pop("reachable"), "required field 'reachable'"),
        (lambda d: d["snapshots"][0]["machines"][0]["stacks"][0]["main"].update(role="wizard"),
         "'wizard' is not one of"),
        (lambda d: d.update(snapshots=[]), "non-empty list"),
    ],
)
def test_malformed_bundle_names_the_field(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    from rankscope.contract.bundle import bundle_to_dict

    data = bundle_to_dict(Bundle(snapshots=(_snapshot(),), created_wall=3.0))
    mutate(data)
    with pytest.raises(BundleError) as info:
        loads(json.dumps(data), "t.json")
    assert needle in str(info.value)
    assert info.value.fix


def test_not_json_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(BundleError, match="not valid JSON"):
        loads("{", "x")
    with pytest.raises(BundleError, match="no such file"):
        read_bundle(tmp_path / "nope.json")


def test_every_contract_field_is_documented() -> None:
    import dataclasses
    import re

    import rankscope.contract.snapshot as contract

    doc = (ROOT / "docs" / "bundle-format.md").read_text()
    sections = dict(re.findall(r"^## (\w+)\n(.*?)(?=^## |\Z)", doc, flags=re.S | re.M))
    for name in dir(contract):
        cls = getattr(contract, name)
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            continue
        assert name in sections, f"docs/bundle-format.md has no section for {name}"
        for f in dataclasses.fields(cls):
            assert f"`{f.name}`" in sections[name], f"{name}.{f.name} is not documented"


def test_identical_frames_are_shared_but_never_loosen_the_checks() -> None:
    from rankscope.contract.bundle import bundle_to_dict

    snap = _snapshot()
    data = bundle_to_dict(Bundle(snapshots=(snap, snap), created_wall=3.0))
    back = loads(json.dumps(data))
    f0 = back.snapshots[0].all_stacks()[1].main.threads[0].frames[0]  # type: ignore[index]
    assert f0 == Frame("wait", "/x/dist.py", 12, None)
    # a second frame equal in value except that its line is `true` must still be refused
    thread = data["snapshots"][1]["machines"][0]["stacks"][0]["main"]["threads"][0]
    thread["frames"].append(dict(thread["frames"][0], line=True))
    with pytest.raises(BundleError, match=r"snapshots\[1\]\.machines\[0\]\.stacks\[0\]\.main\.threads\[0\]\.frames\[2\]\.line"):
        loads(json.dumps(data))
