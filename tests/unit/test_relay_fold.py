"""Relays that merge: children's replies folded into one prefix tree, one table and one set of columns, then
decoded back into the very machines the children sent; bad merged replies are refused, never crash."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rankscope.contract.snapshot import (
    CaptureError,
    CaptureErrorKind,
    Communicator,
    Frame,
    Instant,
    MachineSnapshot,
    OpCounters,
    ProcessRole,
    ProcessStack,
    RankCounters,
    RankInfo,
    RankStacks,
    ThreadStack,
)
from rankscope.wire.codec import ProtoConversionError
from rankscope.wire.delta import ReadingVersions, held_from_proto
from rankscope.wire.merge import MergedTables, fold, ranks_text
from rankscope.wire.proto import rankscope_pb2 as pb
from rankscope.wire.snapshot_codec import machine_to_proto, machines_from_proto
from snapshot_fixtures import machines, rich_job

WORLD = Communicator("w", "nccl", "WORLD", tuple(range(32)))
OUTER = tuple(Frame(f"layer{i}", "model.py", 10 + i) for i in range(6))
PIN = (Frame("pin", "pin_memory.py", 3), Frame("loop", "pin_memory.py", 1))


def machine(index: int, *, stuck: int = 5, ranks_per: int = 4) -> MachineSnapshot:
    ranks = [index * ranks_per + k for k in range(ranks_per)]
    return MachineSnapshot(
        machine=f"m{index}", address=f"127.0.0.1:{7000 + index}", reachable=True, captured=Instant(1.0, 2.0),
        ranks=tuple(RankInfo(r, r % ranks_per, 32, 1000 + r) for r in ranks),
        stacks=tuple(RankStacks(r, ProcessStack(1000 + r, ProcessRole.MAIN, (
            ThreadStack(1, (Frame("recv" if r == stuck else "all_reduce", "c10d.py", 1), *OUTER)),
            ThreadStack(2, PIN))), (ProcessStack(2000 + r, ProcessRole.DATALOADER, None, CaptureError(
                CaptureErrorKind.GONE, f"worker of {r} gone", "nothing")),)) for r in ranks),
        counters=tuple(RankCounters(r, 1000 + r, 32, "job", 1.0, (WORLD, Communicator(
            f"tp{index}", "nccl", "TP", tuple(ranks))), (OpCounters("w", "all_reduce", 7, 7, 6 if r == stuck else 7),))
            for r in ranks),
    )


def relay_reply(own: MachineSnapshot, children: list[pb.MachineSnapshot],
                behind: dict[str, list[tuple[str, str, tuple[int, ...]]]] | None = None) -> pb.MachineSnapshot:
    msg = machine_to_proto(own)
    msg.merged.CopyFrom(fold(children, {} if behind is None else behind))
    return pb.MachineSnapshot.FromString(msg.SerializeToString())


def test_a_merged_reply_decodes_into_the_machines_the_children_sent() -> None:
    leaves = [machine(i) for i in range(1, 7)]
    reply = relay_reply(machine(0), [machine_to_proto(m) for m in leaves])
    assert not reply.relayed and len(reply.merged.machines) == 6
    # the six machines' identical frames are one tree: 2 innermost variants of one 7-frame stack, and the pin thread
    assert len(reply.merged.stack_tree.node_frame) == 6 + 2 + 2
    assert all(not m.HasField("stack_table") and not m.communicator_table for m in reply.merged.machines)
    # WORLD once, and each machine's TP group
    assert len(reply.merged.communicator_table) == 1 + 6
    assert machines_from_proto(reply) == [machine(0), *leaves]


def test_rank_sets_name_the_ranks_whose_stacks_end_at_each_node() -> None:
    reply = relay_reply(machine(0), [machine_to_proto(machine(i)) for i in range(1, 4)])
    tables = MergedTables(reply.merged)
    by_stack = {tables.stack(node)[0].name: ranks for node, ranks in tables.node_ranks().items()}
    assert by_stack == {"recv": (5,), "all_reduce": tuple(r for r in range(4, 16) if r != 5),
                        "pin": tuple(range(4, 16))}


def test_a_relay_behind_a_relay_is_folded_in_as_its_own_machines() -> None:
    lower = relay_reply(machine(1), [machine_to_proto(machine(i)) for i in (2, 3)])
    plain = machine_to_proto(machine(4))
    plain.relayed.add().CopyFrom(machine_to_proto(machine(5)))  # a relay that was not asked to merge
    top = relay_reply(machine(0), [lower, plain, machine_to_proto(machine(6))])
    assert [m.machine for m in top.merged.machines] == ["m1", "m2", "m3", "m4", "m5", "m6"]
    assert machines_from_proto(top) == [machine(i) for i in range(7)]


def test_a_child_gone_takes_the_machines_behind_it_named_with_their_ranks() -> None:
    behind: dict[str, list[tuple[str, str, tuple[int, ...]]]] = {}
    lower = relay_reply(machine(1), [machine_to_proto(machine(i)) for i in (2, 3)])
    lower.address = "127.0.0.1:7001"
    relay_reply(machine(0), [lower, machine_to_proto(machine(4))], behind)
    assert behind["127.0.0.1:7001"] == [("127.0.0.1:7002", "m2", (8, 9, 10, 11)),
                                        ("127.0.0.1:7003", "m3", (12, 13, 14, 15))]
    gone = machine_to_proto(MachineSnapshot("m1", "127.0.0.1:7001", False, None, error=CaptureError(
        CaptureErrorKind.UNREACHABLE, "no answer: the agent at 127.0.0.1:7001 did not answer within 5.0 s",
        "raise --deadline")))
    got = machines_from_proto(relay_reply(machine(0), [gone, machine_to_proto(machine(4))], behind))
    assert [(m.machine, m.reachable) for m in got] == [("m0", True), ("m1", False), ("m2", False), ("m3", False),
                                                         ("m4", True)]
    m2 = got[2]
    assert m2.error is not None and m2.error.kind is CaptureErrorKind.UNREACHABLE
    assert "m2 (ranks 8-11) is behind the relay at 127.0.0.1:7001" in m2.error.message
    assert "did not answer within 5.0 s" in m2.error.message and "raise --deadline" in m2.error.fix
    assert got[4] == machine(4)


def test_a_child_whose_reply_does_not_fit_is_a_stand_in_and_the_rest_arrives() -> None:
    bad = machine_to_proto(machine(2))
    bad.thread_columns.columns[[c.field for c in bad.thread_columns.columns].index("frames")].values = b"\x7f" * 8
    got = machines_from_proto(relay_reply(machine(0), [machine_to_proto(machine(1)), bad, machine_to_proto(machine(3))]))
    assert [m.machine for m in got] == ["m0", "m1", "m2", "m3"]
    assert got[1] == machine(1) and got[3] == machine(3)
    assert not got[2].reachable and got[2].error is not None and "does not fit" in got[2].error.message


def test_deltas_pass_through_a_merge_and_decode_against_what_is_held() -> None:
    versions = {i: ReadingVersions() for i in (1, 2)}

    def child(i: int, m: MachineSnapshot, since: int | None) -> pb.MachineSnapshot:
        msg = machine_to_proto(m)
        versions[i].stamp(msg, since)
        return msg

    first = {i: machine(i) for i in (1, 2)}
    r1 = relay_reply(machine(0), [child(i, first[i], None) for i in (1, 2)])
    held = {(a, v): m for a, m, v in held_from_proto(r1, "relay", lambda a, v: None)}
    later = {1: first[1], 2: dataclasses.replace(first[2], counters=first[2].counters[:1] + tuple(
        dataclasses.replace(c, ops=(OpCounters("w", "all_reduce", 9, 9, 9),)) for c in first[2].counters[1:]))}
    since = {m.address: v for (a, v), m in held.items() if a != "relay"}
    r2 = relay_reply(machine(0), [child(i, later[i], since[later[i].address]) for i in (1, 2)])
    assert all(m.HasField("since") for m in r2.merged.machines)
    got = held_from_proto(r2, "relay", lambda a, v: held.get((a, v)))
    assert [m for _, m, _ in got] == [machine(0), later[1], later[2]]


def test_ranks_are_named_in_short_spans() -> None:
    assert ranks_text([]) == "no ranks"
    assert ranks_text([5]) == "rank 5"
    assert ranks_text([3, 0, 1, 2, 7, 9, 8]) == "ranks 0-3, 7-9"


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(machines(), min_size=1, max_size=4))
def test_random_machines_survive_a_merge(children: list[MachineSnapshot]) -> None:
    own = rich_job().machines[0]
    children = [dataclasses.replace(m, reachable=True) for m in children]
    reply = relay_reply(own, [machine_to_proto(m) for m in children])
    assert machines_from_proto(reply) == [own, *children]


def _merged() -> pb.MachineSnapshot:
    return relay_reply(machine(0), [machine_to_proto(machine(i)) for i in (1, 2)])


def _set(field: str, values: list[int]) -> Callable[[pb.MachineSnapshot], None]:
    def mutate(msg: pb.MachineSnapshot) -> None:
        column = getattr(msg.merged.stack_tree, field)
        del column[:]
        column.extend(values)

    return mutate


def _both_ranks_and_runs(msg: pb.MachineSnapshot) -> None:
    comm = msg.merged.communicator_table[0]  # one the children's ranks point at
    comm.ranks.append(0)
    comm.rank_runs.extend([0, 1, 1])


@pytest.mark.parametrize(("mutate", "needle"), [
    (_set("node_parent", [0, 5, 1, 2, 3, 4, 5, 6, 7, 8]), "does not come before it"),
    (_set("node_frame", [0, 99, 2, 3, 4, 5, 6, 7, 8, 9]), "frame 99 is not in stack_tree"),
    (_set("node_frame", [0, 1]), "node columns differ in length"),
    (_set("frame_line", [1]), "frame columns differ in length"),
    (lambda msg: msg.merged.node_ranks.add(node=77, rank_runs=[0, 1, 1]), "node_ranks names node 77"),
    (lambda msg: msg.merged.machines.pop(), "merged that does not fit the contract: op_columns holds 8 rows but the counters take 4"),
    (lambda msg: msg.merged.machines[0].counters[0].communicator_refs.append(40), "communicator 40 is not in"),
    (_both_ranks_and_runs, "carries both ranks and rank_runs"),
])
def test_bad_merged_replies_are_refused_naming_what_does_not_fit(mutate: Callable[[pb.MachineSnapshot], object],
                                                                 needle: str) -> None:
    msg = _merged()
    mutate(msg)
    with pytest.raises(ProtoConversionError, match=needle):
        machines_from_proto(msg)


def test_a_communicator_no_rank_points_at_does_not_refuse_the_merged_reply() -> None:
    msg = _merged()
    msg.merged.communicator_table.add(comm_id="unused", ranks=[0, 1], rank_runs=[0, 1, 2])  # does not fit, unused
    direct = machines_from_proto(_merged())
    got = machines_from_proto(msg)
    assert got == direct
    assert {c.comm_id for m in got for rc in m.counters for c in rc.communicators} == {"w", "tp0", "tp1", "tp2"}


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_random_changes_to_a_merged_reply_decode_or_are_refused(data: st.DataObject) -> None:
    msg = _merged()
    tree = msg.merged.stack_tree
    for field in ("node_parent", "node_frame", "frame_name", "frame_module"):
        column = getattr(tree, field)
        if data.draw(st.booleans()):
            values = data.draw(st.lists(st.integers(0, 40), max_size=len(column) + 2))
            del column[:]
            column.extend(values)
    if data.draw(st.booleans()):
        raw = bytearray(msg.merged.SerializeToString())
        for _ in range(data.draw(st.integers(1, 4))):
            at = data.draw(st.integers(0, len(raw) - 1))
            raw[at] = data.draw(st.integers(0, 255))
        with contextlib.suppress(Exception):  # protobuf's own refusal of bytes that are no message
            msg.merged.CopyFrom(pb.MergedReadings.FromString(bytes(raw)))
    with contextlib.suppress(ProtoConversionError):
        machines_from_proto(msg)
    # a relay folding such a reply in turn makes a stand-in of it, or folds it: it never fails
    merged = fold([msg], {})
    assert len(merged.machines) >= 1


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=400))
def test_random_bytes_as_merged_readings_decode_or_are_refused(data: bytes) -> None:
    try:
        merged = pb.MergedReadings.FromString(data)
    except Exception:  # not a message at all: protobuf's own refusal
        return
    msg = machine_to_proto(machine(0))
    msg.merged.CopyFrom(merged)
    with contextlib.suppress(ProtoConversionError):
        machines_from_proto(msg)
    fold([msg], {})
