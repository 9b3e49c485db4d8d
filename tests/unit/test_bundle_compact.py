"""Bundle versions 2, 3 and 4 (#16): shared frames, stacks and groups written once, then every type as columns of
distinct values, then number columns packed; bundles of versions 1, 2 and 3 still read."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankscope.contract.bundle import Bundle, BundleError, bundle_to_dict, dumps, loads, read_bundle, write_bundle
from rankscope.contract.packed import PackError, pack_lists, pack_numbers, split, unpack
from rankscope.contract.snapshot import Instant, JobSnapshot, MachineSnapshot
from repo_paths import DATA
from snapshot_fixtures import machines, rich_job


def test_version_2_round_trips_and_shares_what_the_ranks_share(tmp_path: Path) -> None:
    job = rich_job()
    path = tmp_path / "b.json"
    path.write_text(dumps(Bundle((job, job), 5.0, meta={"k": "v"}), version=2))
    back = read_bundle(path)
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
    for version in (2, 3, 4):
        back = loads(dumps(Bundle((JobSnapshot(Instant(1.0, 2.0), many),), 1.0), version=version)).latest
        frames = {id(m.stacks[0].main.threads[0].frames) for m in back.machines}  # type: ignore[index]
        assert len(frames) == 1 and back.machines == many


def _v2() -> dict:  # type: ignore[type-arg]
    return json.loads(dumps(Bundle((rich_job(),), 5.0), version=2))  # type: ignore[no-any-return]


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda d: d["snapshots"][0]["machines"][0]["stacks"][0]["main"]["threads"][0].update(stack=9),
     r"snapshots\[0\]\.machines\[0\]\.stacks\[0\]\.main\.threads\[0\]\.stack: 9 is not an index"),
    (lambda d: d["snapshots"][0]["stack_table"][0].append(7), r"stack_table\[0\]: 7 is not an index"),
    (lambda d: d["snapshots"][0]["machines"][0]["counters"][0].update(communicator_refs=[True]),
     r"counters\[0\]\.communicator_refs: True is not an index"),
    (lambda d: d["snapshots"][0].update(frame_table={}), r"frame_table: expected a list"),
    (lambda d: d["snapshots"][0]["frame_table"][0].update(line="x"), r"frames\[0\]\.line: expected an integer"),
    (lambda d: d.update(version=5), "reads versions 1, 2, 3, 4"),
])
def test_bad_tables_are_refused_with_the_field_named(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    data = _v2()
    mutate(data)
    with pytest.raises(BundleError, match=needle):
        loads(json.dumps(data))


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(machines(), min_size=1, max_size=3))
def test_random_snapshots_round_trip_through_versions_2_3_and_4(ms: list[MachineSnapshot]) -> None:
    job = JobSnapshot(Instant(1.0, 2.0), tuple(ms))
    for version in (2, 3, 4):
        assert loads(dumps(Bundle((job, job), 1.0), version=version)).snapshots == (job, job)


# ---- version 3: columns of distinct values ----------------------------------------------------------------------


def test_version_3_keeps_each_distinct_object_once(tmp_path: Path) -> None:
    job = rich_job()
    (tmp_path / "b.json").write_text(dumps(Bundle((job, job), 5.0, ground_truth={"fault": "x"}), version=3))
    back = read_bundle(tmp_path / "b.json")
    assert back.snapshots == (job, job) and back.ground_truth == {"fault": "x"}
    assert back.snapshots[0] is back.snapshots[1]  # the same snapshot twice is one row
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["version"] == 3 and data["snapshots"] == [0, 0]
    frames = data["tables"]["Frame"]
    assert frames["rows"] == 3 and frames["columns"]["name"] == [f.name for f in job.machines[0].stacks[0].main.threads[0].frames]  # type: ignore[index]
    assert data["tables"]["MachineSnapshot"]["rows"] == len(job.machines)


def test_bundles_written_before_version_4_still_open() -> None:
    assert read_bundle(DATA / "bundles" / "v3-before-packed.json").latest == rich_job()
    assert read_bundle(DATA / "bundles" / "v2-before-columns.json").latest == rich_job()
    assert read_bundle(DATA / "bundles" / "v1-before-compact.json").latest == rich_job()


def test_the_writer_lays_out_rows_as_when_version_3_was_fixed() -> None:
    # the fixture was written by the first version-3 writer (a generic loop over fields); the per-type writers
    # that replaced it must give the same tables, rows in the same order, byte for byte
    fixture = (DATA / "bundles" / "v3-before-packed.json").read_text()
    # columns of fields added since then (defaults when absent, so old files still read) are the only change
    added_since = {"Communicator": ("comm_nranks", "comm_rank"), "RankInfo": ("gpu", "gpu_uuid")}
    data = json.loads(dumps(Bundle((rich_job(),), 5.0), version=3))
    for table, columns in added_since.items():
        for column in columns:
            del data["tables"][table]["columns"][column]
    assert data == json.loads(fixture)


def _v3() -> dict:  # type: ignore[type-arg]
    return json.loads(dumps(Bundle((rich_job(),), 5.0), version=3))  # type: ignore[no-any-return]


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda d: d["tables"]["RankInfo"]["columns"]["rank"].__setitem__(0, "one"),
     r"tables\.RankInfo\.columns\.rank\[0\]: expected int, got str"),
    (lambda d: d["tables"]["RankInfo"]["columns"]["rank"].__setitem__(0, True), r"rank\[0\]: expected int, got bool"),
    (lambda d: d["tables"]["Frame"]["columns"]["name"].append("x"), r"Frame\.columns\.name: expected a list of 3"),
    (lambda d: d["tables"]["MachineSnapshot"]["columns"].pop("reachable"), r"reachable: the column is missing"),
    (lambda d: d["tables"]["MachineSnapshot"]["columns"]["reachable"].__setitem__(0, None), r"null"),
    (lambda d: d["tables"]["ProcessStack"]["columns"]["role"].__setitem__(0, "wizard"), r"'wizard' is not one of"),
    (lambda d: d["tables"]["RankStacks"]["columns"]["main"].__setitem__(0, 99), r"main\[0\]: 99 is not a row"),
    (lambda d: d["tuples"]["Frame"][0].append(-1), r"tuples\.Frame\[0\]: -1 is not a row of Frame"),
    (lambda d: d["tables"]["ThreadStack"]["columns"]["frames"].__setitem__(0, 50), r"tuples\.Frame"),
    (lambda d: d["tables"]["OpCounters"]["columns"]["recent_throughput"].__setitem__(0, ["x"]), "list of float"),
    (lambda d: d.update(snapshots=[7]), r"snapshots\[0\]: 7 is not a row of JobSnapshot"),
    (lambda d: d.update(tables=[]), "per-type tables"),
    (lambda d: d["tables"]["Instant"].update(rows=-1), "rows"),
])
def test_bad_columns_are_refused_with_the_table_column_and_row_named(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    _assert_refused(_v3(), mutate, needle)


def _assert_refused(data: dict, mutate: Callable[[dict], object], needle: str) -> None:  # type: ignore[type-arg]
    """``data`` changed by ``mutate`` is refused with a BundleError that names the file, matches ``needle`` and
    gives a fix."""
    mutate(data)
    with pytest.raises(BundleError, match=needle) as info:
        loads(json.dumps(data), "b.json")
    assert info.value.message.startswith("b.json: ") and info.value.fix


def _places(data: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) of a parsed bundle's tables, where a fuzzed value can go."""
    out: list[tuple[Any, Any]] = []

    def walk(v: Any) -> None:
        items = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, list) else ()
        for k, child in items:
            out.append((v, k))
            walk(child)

    walk({"tables": data["tables"], "tuples": data["tuples"], "snapshots": data["snapshots"]})
    return out


JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-3, 300) | st.floats(allow_nan=False) | st.text(max_size=3),
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=3), c, max_size=2),
                           max_leaves=5)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_any_value_anywhere_in_the_tables_either_reads_or_is_refused_as_a_bundle_error(data: st.DataObject) -> None:
    bundle = data.draw(st.sampled_from([_v3, _v4]))()
    container, key = data.draw(st.sampled_from(_places(bundle)))
    container[key] = data.draw(JSON_VALUES)
    with contextlib.suppress(BundleError):
        loads(json.dumps(bundle))


def test_whole_seconds_written_without_a_point_read_as_floats() -> None:
    data = _v3()
    data["tables"]["Instant"]["columns"]["wall"] = [int(w) for w in data["tables"]["Instant"]["columns"]["wall"]]
    data["tables"]["OpCounters"]["columns"]["recent_throughput"][0] = [1, 2.5]
    back = loads(json.dumps(data)).latest
    assert type(back.captured.wall) is float and back.captured.wall == int(rich_job().captured.wall)
    ops = [op for m in back.machines for c in m.counters for op in c.ops]
    assert any(op.recent_throughput == (1.0, 2.5) and all(type(x) is float for x in op.recent_throughput) for op in ops)


# ---- version 4: number columns packed ---------------------------------------------------------------------------


def _v4() -> dict:  # type: ignore[type-arg]
    return json.loads(dumps(Bundle((rich_job(),), 5.0)))  # type: ignore[no-any-return]


def test_version_4_is_written_with_number_columns_packed_and_reads_back_the_same(tmp_path: Path) -> None:
    job = rich_job()
    back = read_bundle(write_bundle(Bundle((job, job), 5.0), tmp_path / "b.json"))
    assert back.snapshots == (job, job) and back.snapshots[0] is back.snapshots[1]
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["version"] == 4
    cols = data["tables"]["RankInfo"]["columns"]
    assert set(cols["rank"]) == {"int8"} and cols["run_id"] == [r.run_id for m in job.machines for r in m.ranks]
    assert set(data["tables"]["Instant"]["columns"]["wall"]) == {"float64"}
    assert set(data["tuples"]["Frame"]) == {"int8", "lengths"}
    # many ranks: the packed form is also the smaller one
    many = tuple(dataclasses.replace(job.machines[0], machine=f"m{i}") for i in range(300))
    big = Bundle((dataclasses.replace(job, machines=many),), 5.0)
    assert len(dumps(big)) < len(dumps(big, version=3)) and loads(dumps(big)) == big


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda d: d["tables"]["RankInfo"]["columns"]["rank"].update(int8="***"), r"RankInfo\.columns\.rank: int8: not base64"),
    (lambda d: d["tables"]["RankInfo"]["columns"]["rank"].update(int8=42), "expected a base64 string"),
    (lambda d: d["tables"]["RankInfo"]["columns"]["rank"].update(int8="AAAA"), r"rank: expected 2 values, got 3"),
    (lambda d: d["tables"]["RankInfo"]["columns"].update(rank={"int16": "AAAA"}), "3 bytes is not a whole number of 2-byte"),
    (lambda d: d["tables"]["RankInfo"]["columns"].update(rank={"int9": "AA=="}), "as the packed column's key"),
    (lambda d: d["tables"]["RankInfo"]["columns"].update(rank={"float64": "AAAAAAAA8D8AAAAAAADwPw=="}),
     "expected whole numbers"),
    (lambda d: d["tables"]["Instant"]["columns"].update(wall={"float64": "AAAAAAAA+H8AAAAAAAD4fwAAAAAAAPh/"}),
     "not finite"),
    (lambda d: d["tables"]["Frame"]["columns"].update(name={"int8": "AAE="}), "str values cannot be packed"),
    (lambda d: d["tables"]["RankStacks"]["columns"]["main"].update(int8="AGM="), r"main\[1\]: 99 is not a row"),
    (lambda d: d["tuples"]["Frame"].update(int8="AAH/"), r"tuples\.Frame: -1 is not a row of Frame"),
    (lambda d: d["tuples"]["Frame"]["lengths"].update(int8="BAA="), "lengths add up to 4 but 3 numbers"),
    (lambda d: d["tuples"]["Frame"]["lengths"].update(int8="/wQ="), "negative length"),
    (lambda d: d["tuples"]["Frame"].pop("lengths"), "needs its lengths"),
    (lambda d: d["tables"]["Communicator"]["columns"]["ranks"].pop("lengths"), "needs its lengths"),
    (lambda d: d["tables"]["OpCounters"]["columns"]["cl"].update(lengths={"int8": "Ag=="}), "has no lengths"),
])
def test_bad_packed_columns_are_refused_with_the_table_and_column_named(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    _assert_refused(_v4(), mutate, needle)


_NUMBERS = st.one_of(st.lists(st.integers(-(1 << 63), (1 << 63) - 1), min_size=1, max_size=40),
                     st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=40))


@settings(max_examples=200, deadline=None)
@given(_NUMBERS)
def test_numbers_come_back_exactly_from_their_packed_form(values: list[Any]) -> None:
    packed = pack_numbers(values)
    assert packed is not None
    back, kind, lists = unpack(json.loads(json.dumps(packed)))
    assert back == values and all(type(v) is kind for v in back) and lists is None


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(-1000, 1 << 40), max_size=6), min_size=1, max_size=10))
def test_lists_of_numbers_come_back_exactly_from_their_packed_form(lists: list[list[int]]) -> None:
    packed = pack_lists(lists)
    assert packed is not None
    values, _, lengths = unpack(json.loads(json.dumps(packed)))
    assert lengths is not None and split(tuple(values), lengths) == [tuple(x) for x in lists]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 5), st.integers(1, 12), st.data())
def test_lists_all_of_one_length_come_back_exactly(n: int, count: int, data: st.DataObject) -> None:
    # the common column (every rank has as many ops, threads, ranks per machine) is cut without slicing
    lists = [data.draw(st.lists(st.integers(-5, 5), min_size=n, max_size=n)) for _ in range(count)]
    packed = pack_lists(lists)
    assert packed is not None
    values, _, lengths = unpack(json.loads(json.dumps(packed)))
    assert lengths is not None and split(tuple(values), lengths) == [tuple(x) for x in lists]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["int8", "int16", "int32", "int64", "float64", "lengths", "x"]),
                       st.one_of(st.text(max_size=12), st.binary(max_size=12).map(lambda b: base64.b64encode(b).decode()),
                                 st.integers(), st.dictionaries(st.sampled_from(["int8", "int64", "float64"]),
                                                                st.binary(max_size=9).map(
                                                                    lambda b: base64.b64encode(b).decode()))),
                       max_size=3))
def test_any_packed_value_either_unpacks_or_is_refused_as_a_pack_error(packed: dict[str, Any]) -> None:
    with contextlib.suppress(PackError):
        values, kind, lengths = unpack(packed)
        assert all(type(v) is kind for v in values)
        assert lengths is None or [x for part in split(tuple(values), lengths) for x in part] == values
