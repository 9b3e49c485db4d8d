"""Contract objects as columns on the wire (rankscope.wire.columns): exact round trips, refusals that name the column."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rankscope.contract.snapshot import (
    CaptureError,
    CaptureErrorKind,
    Instant,
    MachineSnapshot,
    OpCounters,
    ProcessRole,
    ProcessStack,
    RankStacks,
)
from rankscope.wire.columns import ColumnsError, field_values, make_objects, read_values, write_columns
from rankscope.wire.proto import rankscope_pb2 as pb
from rankscope.wire.snapshot_codec import machine_from_proto, machine_to_proto
from snapshot_fixtures import rich_job


@dataclasses.dataclass(frozen=True, slots=True)
class EveryKind:
    """One field of each kind a column can carry."""

    name: str
    count: int
    ratio: float
    flag: bool
    note: str | None = None
    limit: int | None = None
    seen: float | None = 1.5
    words: tuple[str, ...] = ()
    sizes: tuple[int, ...] = (1, 2)
    rates: tuple[float, ...] | None = None


finite = st.floats(allow_nan=False, allow_infinity=False)
every_kind = st.builds(
    EveryKind, st.text(max_size=4), st.integers(-2**63, 2**63 - 1), finite, st.booleans(),
    st.none() | st.text(max_size=3), st.none() | st.integers(-5, 5), st.none() | finite,
    st.lists(st.text(max_size=2), max_size=3).map(tuple), st.lists(st.integers(0, 9), max_size=3).map(tuple),
    st.none() | st.lists(finite, max_size=3).map(tuple))
op_counters = st.builds(
    OpCounters, st.sampled_from(["tp0", "dp1", "world"]), st.sampled_from(["all_reduce", "send"]),
    st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6),
    st.integers(0, 2**40), st.none() | finite, st.lists(finite, max_size=4).map(tuple), st.none() | finite,
    st.none() | finite, st.lists(st.integers(0, 16383), max_size=3).map(tuple))


def trip(cls: type, objs: list[object]) -> list[object]:
    msg = pb.Columns()
    write_columns(cls, field_values(cls, objs), msg)
    return make_objects(cls, read_values(cls, pb.Columns.FromString(msg.SerializeToString())))


@settings(max_examples=60, deadline=None)
@given(st.lists(every_kind, max_size=6))
def test_objects_of_every_column_kind_come_back_equal(objs: list[EveryKind]) -> None:
    back = trip(EveryKind, objs)  # type: ignore[arg-type]
    assert back == objs
    assert all(type(b.flag) is bool and type(b.ratio) is float for b in back)  # type: ignore[attr-defined]


@settings(max_examples=60, deadline=None)
@given(st.lists(op_counters, max_size=20))
def test_operation_counters_come_back_equal(objs: list[OpCounters]) -> None:
    assert trip(OpCounters, objs) == objs  # type: ignore[arg-type]


def test_a_column_of_defaults_is_not_sent_and_unknown_columns_are_ignored() -> None:
    objs = [EveryKind("a", 1, 0.5, True), EveryKind("b", 2, 1.5, False, words=("x",))]
    msg = pb.Columns()
    write_columns(EveryKind, field_values(EveryKind, objs), msg)
    assert [c.field for c in msg.columns] == ["name", "count", "ratio", "flag", "words"]
    assert list(msg.strings) == ["a", "b", "x"]  # strings are sent once, the columns index them
    msg.columns.add(field="from_a_newer_sender", type="int8", values=b"\x07\x07")
    assert make_objects(EveryKind, read_values(EveryKind, msg)) == objs


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda m: m.columns.add(field="name", type="int8", values=b"\0\0"), "column 'name' is sent twice"),
    (lambda m: m.columns.remove(m.columns[1]), "column 'count' is missing and EveryKind.count has no default"),
    (lambda m: m.columns[1].__setattr__("values", b"\1"), "column 'count': has 1 values for 2 rows"),
    (lambda m: m.columns[0].__setattr__("values", b"\0\5"), "column 'name': indexes a string outside the 3 sent"),
    (lambda m: m.columns[0].__setattr__("values", b"\0\xff"), "column 'name': indexes a string outside"),
    (lambda m: m.columns[2].__setattr__("type", "int8"), "column 'ratio': holds int8 values for a field of type float"),
    (lambda m: m.columns[1].__setattr__("type", "float64"), "column 'count': holds float64 values for a field of type"),
    (lambda m: m.columns[1].__setattr__("type", "uint7"), "column 'count': 'uint7' is not a packed number type"),
    (lambda m: m.columns[2].__setattr__("values", b"\0" * 9), "column 'ratio': float64: 9 bytes is not a whole"),
    (lambda m: m.columns[1].absent.append(0), "column 'count': marks values absent but the field is not optional"),
    (lambda m: m.columns.add(field="note", type="int8", values=b"\0\0", absent=[2]),
     "column 'note': marks a row absent outside"),
    (lambda m: m.columns[4].lengths.append(0), "column 'words': has 3 lengths for 2 rows"),
    (lambda m: m.columns[4].lengths.__setitem__(0, 2), "column 'words': lengths add up to 3 but 1 values"),
    (lambda m: m.columns[1].lengths.extend([1, 1]), "column 'count': has lengths but the field is not a tuple"),
])
def test_columns_that_do_not_fit_are_refused_naming_the_column(mutate: object, needle: str) -> None:
    msg = pb.Columns()
    write_columns(EveryKind, field_values(EveryKind, [EveryKind("a", 1, 0.5, True),
                                                      EveryKind("b", 2, 1.5, False, words=("x",))]), msg)
    mutate(msg)  # type: ignore[operator]
    with pytest.raises(ColumnsError, match=needle):
        read_values(EveryKind, msg)


column_msgs = st.builds(
    pb.Column, field=st.sampled_from([f.name for f in dataclasses.fields(EveryKind)] + ["other"]),
    type=st.sampled_from(["int8", "int16", "int64", "float64", "", "x"]), values=st.binary(max_size=24),
    absent=st.lists(st.integers(0, 4), max_size=2), lengths=st.lists(st.integers(0, 3), max_size=4))


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 4), st.lists(column_msgs, max_size=12), st.lists(st.text(max_size=2), max_size=3))
def test_any_columns_message_either_reads_into_objects_or_raises_a_columns_error(
        rows: int, columns: list[pb.Column], strings: list[str]) -> None:
    msg = pb.Columns(rows=rows, columns=columns, strings=strings)
    try:
        objs = make_objects(EveryKind, read_values(EveryKind, pb.Columns.FromString(msg.SerializeToString())))
    except ColumnsError:
        return
    assert len(objs) == rows
    assert all(isinstance(o.count, int) and isinstance(o.name, str) for o in objs)
    assert all(o.rates is None or all(isinstance(x, float) or math.isnan(x) for x in o.rates) for o in objs)


def test_a_machines_counters_travel_as_one_set_of_columns() -> None:
    machine = rich_job().machines[0]
    msg = machine_to_proto(machine)
    with_ops = [c for c in machine.counters if c.ops]
    assert with_ops and all(not c.ops for c in msg.counters)
    assert [c.op_rows for c in msg.counters if c.HasField("op_rows")] == [len(c.ops) for c in with_ops]
    assert msg.op_columns.rows == sum(len(c.ops) for c in machine.counters)
    assert machine_from_proto(pb.MachineSnapshot.FromString(msg.SerializeToString())) == machine


def test_processes_without_threads_or_with_a_failed_capture_travel_as_columns() -> None:
    failed = CaptureError(CaptureErrorKind.PERMISSION, "ptrace refused", "run as root", "S", "futex_wait")
    stacks = (RankStacks(0, ProcessStack(10, ProcessRole.MAIN, ())),  # a capture that found no threads
              RankStacks(1, ProcessStack(11, ProcessRole.MAIN, None, failed),
                         (ProcessStack(12, ProcessRole.DATALOADER, None, failed),)))
    machine = MachineSnapshot("m", "a:1", True, Instant(1.0, 2.0), stacks=stacks)
    msg = machine_to_proto(machine)
    assert [s.process_rows for s in msg.stacks] == [1, 2] and not msg.HasField("thread_columns")
    assert len(msg.process_errors) == 2  # one each: the columns point at them
    back = machine_from_proto(pb.MachineSnapshot.FromString(msg.SerializeToString()))
    assert back == machine and back.stacks[0].main.threads == () and back.stacks[1].main.threads is None
