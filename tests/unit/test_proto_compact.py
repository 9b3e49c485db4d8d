"""The compiled codec and the compact wire form (#16): random snapshots survive the trip, bad tables are refused."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import typing
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankscope.contract.bundle import read_bundle
from rankscope.contract.snapshot import (
    Communicator,
    Frame,
    Instant,
    MachineSnapshot,
    ProcessRole,
    ProcessStack,
    RankCounters,
    RankStacks,
    ThreadStack,
)
from rankscope.wire.codec import ProtoConversionError
from rankscope.wire.compact import expand_runs, rank_runs
from rankscope.wire.delta import ReadingVersions, held_from_proto
from rankscope.wire.proto import rankscope_pb2 as pb
from rankscope.wire.snapshot_codec import machine_from_proto, machine_to_proto, machines_from_proto
from repo_paths import DATA
from snapshot_fixtures import machines, rich_job


def trip(machine: MachineSnapshot, *, compact: bool) -> MachineSnapshot:
    wire = machine_to_proto(machine, compact=compact).SerializeToString()
    return machine_from_proto(pb.MachineSnapshot.FromString(wire))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(machines())
def test_random_machines_round_trip_in_both_forms(machine: MachineSnapshot) -> None:
    assert trip(machine, compact=True) == machine
    assert trip(machine, compact=False) == machine


@settings(max_examples=50)
@given(st.lists(st.integers(-10, 10), max_size=30))
def test_rank_runs_expand_back_to_the_same_ranks(ranks: list[int]) -> None:
    assert expand_runs(rank_runs(ranks)) == tuple(ranks)


def test_a_world_group_is_one_run_and_shared_stacks_are_sent_once() -> None:
    world = Communicator("w", "nccl", "WORLD", tuple(range(16384)))
    frames = tuple(Frame(f"f{i}", "model.py", i) for i in range(40))
    ranks = []
    for r in range(8):
        thread = ThreadStack(1, frames)
        ranks.append(RankStacks(r, ProcessStack(100 + r, ProcessRole.MAIN, (thread,))))
    machine = MachineSnapshot("m", "a:1", True, Instant(1.0, 2.0), stacks=tuple(ranks),
                              counters=tuple(RankCounters(r, 1, 16384, "j", 1.0, (world,)) for r in range(8)))
    msg = machine_to_proto(machine)
    assert list(msg.stack_table.stack_lengths) == [40] and len(msg.stack_table.frame_name) == 40
    assert [list(c.rank_runs) for c in msg.communicator_table] == [[0, 1, 16384]]
    assert all(list(c.communicator_refs) == [0] and not c.communicators for c in msg.counters)
    plain = machine_to_proto(machine, compact=False).ByteSize()
    assert msg.ByteSize() * 20 < plain  # the plain form lists the world group 8 times and the frames 8 times
    back = machine_from_proto(msg)
    assert back == machine
    # every rank's identical stack is one tuple on the client, and the group one object
    assert len({id(s.main.threads[0].frames) for s in back.stacks if s.main.threads}) == 1
    assert len({id(c.communicators[0]) for c in back.counters}) == 1


def test_a_machine_sent_in_the_plain_form_by_an_older_agent_still_decodes() -> None:
    machine = rich_job().machines[0]
    plain = machine_to_proto(machine, compact=False)
    assert not plain.HasField("stack_table") and not plain.communicator_table
    assert machine_from_proto(pb.MachineSnapshot.FromString(plain.SerializeToString())) == machine


def test_a_compact_reply_from_before_the_columns_still_decodes() -> None:
    """Threads pointing into stack_table by stack_ref and operation counters as messages, as agents sent them
    before a machine's processes, threads and counters became columns."""
    frames = (Frame("step", "train.py", 7), Frame("main", "train.py", 1))
    machine = MachineSnapshot("m", "a:1", True, Instant(1.0, 2.0), stacks=(
        RankStacks(0, ProcessStack(10, ProcessRole.MAIN, (ThreadStack(10, frames, "MainThread"),))),))
    msg = machine_to_proto(machine, compact=False)
    thread = msg.stacks[0].main.threads.threads[0]
    thread.ClearField("frames")
    thread.stack_ref = 0
    msg.stack_table.MergeFrom(pb.StackTable(
        strings=["step", "train.py", "main"], frame_name=[0, 2], frame_filename=[1, 1], frame_line=[7, 1],
        frame_module=[0, 0], frame_flags=[4, 4], stack_frames=[0, 1], stack_lengths=[2]))
    assert machine_from_proto(pb.MachineSnapshot.FromString(msg.SerializeToString())) == machine
    thread.stack_ref = 3
    with pytest.raises(ProtoConversionError, match="stack_ref: stack 3 is not in stack_table"):
        machine_from_proto(msg)


def test_a_bundle_written_before_the_compact_form_still_opens() -> None:
    bundle = read_bundle(DATA / "bundles" / "v1-before-compact.json")
    assert bundle.latest == rich_job()


def _column(msg: pb.MachineSnapshot, field: str, columns: str = "op_columns") -> pb.Column:
    return next(c for c in getattr(msg, columns).columns if c.field == field)


def _bad(mutate: object) -> pb.MachineSnapshot:
    machine = rich_job().machines[0]
    msg = machine_to_proto(machine)
    mutate(msg)  # type: ignore[operator]
    return msg


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda m: _column(m, "frames", "thread_columns").__setattr__("values", b"\x63" * m.thread_columns.rows),
     "stacks.process_rows: stack 99 is not in stack_table"),
    (lambda m: m.stacks[0].__setattr__("process_rows", 999), "process_rows: takes rows 0-998 of process_columns"),
    (lambda m: m.stacks[0].__setattr__("process_rows", 0), "0 process rows: a rank's stacks have a main process"),
    (lambda m: m.stacks[0].subprocesses.add(), "a rank's stacks carry both processes and process_rows"),
    (lambda m: m.ClearField("thread_columns"), "processes take rows of thread_columns but their machine sent none"),
    (lambda m: m.stacks[-1].ClearField("process_rows"), "process_columns holds \\d+ rows but the ranks' stacks take"),
    (lambda m: (m.ClearField("process_columns"), m.ClearField("process_errors"), m.ClearField("stack_table"),
                m.ClearField("communicator_table"), m.ClearField("op_columns"), m.ClearField("stacks"),
                [c.ClearField("op_rows") for c in m.counters], [c.ClearField("communicator_refs") for c in m.counters]),
     "thread_columns holds \\d+ rows but the processes take 0"),
    (lambda m: _column(m, "threads", "process_columns").__setattr__("values", b"\xfe" * m.process_columns.rows),
     "column 'threads': holds a count below -1"),
    (lambda m: _column(m, "error", "process_columns").__setattr__("values", b"\x05" * m.process_columns.rows),
     "column 'error': points outside the"),
    (lambda m: m.stack_table.stack_lengths.append(5), "do not add up"),
    (lambda m: m.stack_table.frame_flags.append(1), "columns differ"),
    (lambda m: m.stack_table.frame_name.__setitem__(0, 1000), "string 1000 is not in stack_table"),
    (lambda m: m.counters[0].communicator_refs.append(7), "communicator 7 is not in communicator_table"),
    (lambda m: (m.communicator_table[0].ClearField("ranks"), m.communicator_table[0].rank_runs.extend([1, 2])),
     "not whole"),
    (lambda m: m.ClearField("stack_table"), "stack 0 is not in stack_table"),
    (lambda m: [m.ClearField(f) for f in ("stack_table", "communicator_table", "op_columns", "process_columns",
                                          "thread_columns")],
     "sent none"),
    (lambda m: m.ClearField("op_columns"), "take rows of op_columns but their machine sent none"),
    (lambda m: m.counters[0].__setattr__("op_rows", 999), "takes rows 0-998 of op_columns, which holds"),
    (lambda m: [c for c in m.counters if c.HasField("op_rows")][-1].ClearField("op_rows"), r"op_columns: op_columns holds \d+ rows but the counters take"),
    (lambda m: m.counters[0].ops.add(comm_id="x", op="y"), "both ops and op_rows"),
    (lambda m: m.op_columns.columns.remove(_column(m, "cl")), "column 'cl' is missing and OpCounters.cl has no default"),
    (lambda m: _column(m, "comm_id").__setattr__("values", b"\x63" * m.op_columns.rows),
     "column 'comm_id': indexes a string outside"),
    (lambda m: _column(m, "wr").__setattr__("values", _column(m, "wr").values * 2), r"column 'wr': has \d+ values for"),
    (lambda m: _column(m, "wc").absent.append(0), "column 'wc': marks values absent but the field is not optional"),
])
def test_bad_tables_are_refused_with_the_field_named(mutate: object, needle: str) -> None:
    with pytest.raises(ProtoConversionError, match=needle) as info:
        machine_from_proto(_bad(mutate))
    assert "MachineSnapshot" in info.value.message and info.value.fix


@settings(max_examples=80, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_either_decode_or_raise_a_conversion_error(data: bytes) -> None:
    try:
        msg = pb.MachineSnapshot.FromString(data)
    except Exception:  # not a message at all: protobuf's own refusal
        return
    with contextlib.suppress(ProtoConversionError):
        machines_from_proto(msg)


def test_a_relayed_reply_expands_into_each_machine() -> None:
    a, b = rich_job().machines[0], rich_job().machines[2]
    msg = machine_to_proto(b)
    msg.relayed.add().CopyFrom(machine_to_proto(a))
    assert machines_from_proto(pb.MachineSnapshot.FromString(msg.SerializeToString())) == [b, a]


def test_decoding_a_reply_leaves_no_cycle_holding_the_parsed_reply() -> None:
    # The client pauses the cyclic collector while it decodes and then sets what lives aside (gc.freeze): a cycle
    # made while decoding would keep the whole parsed reply (megabytes a machine) until the process ends.
    msg = pb.MachineSnapshot.FromString(machine_to_proto(rich_job().machines[0]).SerializeToString())
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        machines_from_proto(msg)
        del msg
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        left = [type(o).__qualname__ for o in gc.garbage
                if getattr(type(o), "__module__", "").startswith(("rankscope.", "google."))]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if collecting:
            gc.enable()
    assert left == []


# ---- the delta form (DescribeRequest.since): what did not change is a mark, and the client keeps its objects ----


def _reply(versions: ReadingVersions, machine: MachineSnapshot, since: int | None) -> pb.MachineSnapshot:
    msg = machine_to_proto(machine)
    versions.stamp(msg, since)
    return pb.MachineSnapshot.FromString(msg.SerializeToString())


Held = tuple[MachineSnapshot, int | None]  # a decoded reading and its version, as the client keeps them


def _decode(msg: pb.MachineSnapshot, held: Held | None) -> Held:
    [(address, machine, version)] = held_from_proto(
        msg, "a:1", lambda a, v: held[0] if held is not None and a == "a:1" and held[1] == v else None)
    assert address == "a:1"
    return machine, version


@st.composite
def reading_pairs(draw: st.DrawFn) -> tuple[MachineSnapshot, MachineSnapshot]:
    """A reading and a later one that keeps some of its ranks' descriptions and counters and changes others."""
    first, other = draw(machines()), draw(machines())
    keep = st.lists(st.booleans(), min_size=8, max_size=8)
    ranks, counters = draw(keep), draw(keep)
    return first, dataclasses.replace(
        first, captured=other.captured,
        ranks=tuple(r if ranks[i] else dataclasses.replace(o, rank=r.rank)
                    for i, (r, o) in enumerate(zip(first.ranks, other.ranks * 4, strict=False))) + other.ranks[:1],
        counters=tuple(c if counters[i] else dataclasses.replace(o, rank=c.rank)
                       for i, (c, o) in enumerate(zip(first.counters, other.counters * 4, strict=False))))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(reading_pairs())
def test_a_delta_against_the_held_reading_decodes_to_the_new_reading_reusing_what_did_not_change(
        pair: tuple[MachineSnapshot, MachineSnapshot]) -> None:
    first, second = pair
    versions = ReadingVersions()
    held = _decode(_reply(versions, first, None), None)
    assert held[0] == first and held[1] is not None
    msg = _reply(versions, second, held[1])
    assert msg.since == held[1]
    got, version = _decode(msg, held)
    assert got == second and version not in (None, held[1])
    before_ranks = {r.rank: r for r in held[0].ranks}
    before_ops = {c.rank: c.ops for c in held[0].counters}
    unique = {r for r in before_ranks if [x.rank for x in first.ranks].count(r) == 1}
    for r, sent in zip(got.ranks, msg.ranks, strict=True):
        assert sent.same == (r.rank in unique and [x.rank for x in second.ranks].count(r.rank) == 1
                             and r == before_ranks[r.rank])
        if sent.same:
            assert r is before_ranks[r.rank]  # the client's own object, not a copy
    for c, sent in zip(got.counters, msg.counters, strict=True):
        if sent.ops_same:
            assert c.ops is before_ops[c.rank] and not sent.ops
    # a client that never held a reading (or an older one, which ignores `version`) gets it whole
    assert _decode(_reply(versions, second, None), None)[0] == second
    assert machine_from_proto(_reply(versions, second, None)) == second


def test_an_unchanged_reading_costs_a_mark_per_rank_and_changes_are_sent() -> None:
    machine = dataclasses.replace(rich_job().machines[0], stacks=())  # what a poll reads
    versions = ReadingVersions()
    whole = _reply(versions, machine, None)
    held = _decode(whole, None)
    again = _reply(versions, machine, held[1])
    assert all(r.same for r in again.ranks) and all(c.ops_same for c in again.counters) and machine.counters
    assert again.ByteSize() < whole.ByteSize() and not len(again.communicator_table)
    assert all(r.ByteSize() <= 8 for r in again.ranks)  # a rank number and the mark
    assert not any(len(c.ops) or len(c.communicator_refs) for c in again.counters)
    got, version = _decode(again, held)
    assert got == machine and version not in (None, held[1])
    assert all(a is b for a, b in zip(got.ranks, held[0].ranks, strict=True)) and got.ranks
    # a version the agent no longer remembers (or never gave): the whole reading, never a guess
    assert not any(r.same for r in _reply(versions, machine, 12345).ranks)
    for _ in range(versions.keep + 1):
        _reply(versions, machine, None)
    assert not _reply(versions, machine, held[1]).HasField("since")


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda m: m.__setattr__("since", m.since + 1), "does not hold"),
    (lambda m: m.ranks.add(rank=99, same=True), "same for rank 99"),
    (lambda m: m.counters.add(rank=99, ops_same=True), "ops_same for rank 99"),
])
def test_a_delta_that_does_not_fit_the_held_reading_is_refused(mutate: Callable[[pb.MachineSnapshot], object],
                                                                needle: str) -> None:
    machine = rich_job().machines[0]
    versions = ReadingVersions()
    held = _decode(_reply(versions, machine, None), None)
    msg = _reply(versions, machine, held[1])
    mutate(msg)
    with pytest.raises(ProtoConversionError, match=needle):
        _decode(msg, held)
    with pytest.raises(ProtoConversionError):  # nor does a client that holds nothing take marks for data
        machines_from_proto(msg)


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_as_a_delta_either_decode_or_raise_a_conversion_error(data: bytes) -> None:
    machine = rich_job().machines[0]
    versions = ReadingVersions()
    held = _decode(_reply(versions, machine, None), None)
    try:
        msg = pb.MachineSnapshot.FromString(data)
    except Exception:
        return
    msg.since = typing.cast(int, held[1])
    with contextlib.suppress(ProtoConversionError):
        _decode(msg, held)
