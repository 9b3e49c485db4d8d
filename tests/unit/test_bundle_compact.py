"""Bundle version 2 (#16): shared frames, stacks and groups written once; version 1 still reads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankscope.contract.bundle import Bundle, BundleError, bundle_to_dict, dumps, loads, read_bundle, write_bundle
from rankscope.contract.snapshot import Instant, JobSnapshot, MachineSnapshot
from snapshot_fixtures import machines, rich_job


def test_version_2_round_trips_and_shares_what_the_ranks_share(tmp_path: Path) -> None:
    job = rich_job()
    back = read_bundle(write_bundle(Bundle((job, job), 5.0, meta={"k": "v"}), tmp_path / "b.json"))
    assert back.snapshots == (job, job) and back.meta == {"k": "v"}
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["version"] == 2
    snap = data["snapshots"][0]
    assert len(snap["frame_table"]) == 3 and snap["stack_table"] == [[0, 1, 2], []]
    thread = snap["machines"][0]["stacks"][0]["main"]["threads"][0]
    assert "frames" not in thread and thread["stack"] == 0
    assert snap["machines"][0]["counters"][0]["communicator_refs"] == [0]


def test_version_1_is_what_tools_that_edit_bundles_get_and_it_still_reads() -> None:
    job = rich_job()
    data = bundle_to_dict(Bundle((job,), 5.0))
    assert data["version"] == 1 and "frame_table" not in data["snapshots"][0]
    assert loads(json.dumps(data)).latest == job


def test_identical_stacks_of_many_ranks_are_one_tuple_after_reading() -> None:
    job = rich_job()
    machine = job.machines[0]
    many = tuple(MachineSnapshot(f"m{i}", f"a{i}", True, Instant(1.0, 2.0), stacks=machine.stacks) for i in range(50))
    back = loads(dumps(Bundle((JobSnapshot(Instant(1.0, 2.0), many),), 1.0))).latest
    frames = {id(m.stacks[0].main.threads[0].frames) for m in back.machines}  # type: ignore[index]
    assert len(frames) == 1 and back.machines == many


def _v2() -> dict:  # type: ignore[type-arg]
    return json.loads(dumps(Bundle((rich_job(),), 5.0)))  # type: ignore[no-any-return]


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda d: d["snapshots"][0]["machines"][0]["stacks"][0]["main"]["threads"][0].update(stack=9),
     r"snapshots\[0\]\.machines\[0\]\.stacks\[0\]\.main\.threads\[0\]\.stack: 9 is not an index"),
    (lambda d: d["snapshots"][0]["stack_table"][0].append(7), r"stack_table\[0\]: 7 is not an index"),
    (lambda d: d["snapshots"][0]["machines"][0]["counters"][0].update(communicator_refs=[True]),
     r"counters\[0\]\.communicator_refs: True is not an index"),
    (lambda d: d["snapshots"][0].update(frame_table={}), r"frame_table: expected a list"),
    (lambda d: d["snapshots"][0]["frame_table"][0].update(line="x"), r"frames\[0\]\.line: expected an integer"),
    (lambda d: d.update(version=3), "reads versions 1, 2"),
])
def test_bad_tables_are_refused_with_the_field_named(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    data = _v2()
    mutate(data)
    with pytest.raises(BundleError, match=needle):
        loads(json.dumps(data))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(machines(), min_size=1, max_size=3))
def test_random_snapshots_round_trip_through_version_2(ms: list[MachineSnapshot]) -> None:
    job = JobSnapshot(Instant(1.0, 2.0), tuple(ms))
    assert loads(dumps(Bundle((job, job), 1.0))).snapshots == (job, job)
