"""Fan-out at scale (#16): real agent servers on loopback, a relaying agent, the client's own limits."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from rankscope.contract.heap import settle_in_this_process
from rankscope.contract.snapshot import (
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
from rankscope.wire.agent import AgentConfig, RunningAgent, start_agent
from rankscope.wire.client import JobClient
from rankscope.wire.fanout import error_for_rpc
from rankscope.wire.tokens import TokenSet, parse_tokens

pytestmark = pytest.mark.timeout(120)
TOKEN = "t" * 32
RANKS_PER_MACHINE = 2
WORLD = Communicator("w", "nccl", "WORLD", tuple(range(64)))
FRAMES = tuple(Frame(f"layer{i}", "model.py", 10 + i) for i in range(12))
LAUNCHES: dict[int, int] = {}  # machine -> its ranks' all-reduce count (a test moves one machine on)


def tokens() -> TokenSet:
    return parse_tokens(f"read:{TOKEN}\n", "test")


def source_for(machine: int) -> Callable[[bool], Awaitable[MachineSnapshot]]:
    """Machine ``machine``'s ranks, as the probes would read them (the agent server and wire are the real ones)."""
    ranks = [machine * RANKS_PER_MACHINE + i for i in range(RANKS_PER_MACHINE)]

    async def read(stacks: bool) -> MachineSnapshot:
        return MachineSnapshot(
            machine=f"m{machine}", address="", reachable=True, captured=Instant(1.0, 2.0),
            ranks=tuple(RankInfo(r, r % RANKS_PER_MACHINE, 64, 1000 + r) for r in ranks),
            stacks=tuple(RankStacks(r, ProcessStack(1000 + r, ProcessRole.MAIN, (ThreadStack(1, (
                *FRAMES, Frame("recv" if r == 5 else "all_reduce", "c10d.py", 1))),))) for r in ranks) if stacks else (),
            counters=tuple(RankCounters(r, 1000 + r, 64, "job", 1.0, (WORLD,), (OpCounters(
                "w", "all_reduce", LAUNCHES.get(machine, 1), LAUNCHES.get(machine, 1), LAUNCHES.get(machine, 1)),))
                for r in ranks),
        )

    return read


async def serve(machine: int, *, relay_to: tuple[str, ...] = ()) -> RunningAgent:
    config = AgentConfig(tokens=tokens(), port=0, machine_name=f"m{machine}", relay_to=relay_to, relay_token=TOKEN)
    return await start_agent(config, source=source_for(machine))


@pytest.fixture
async def leaves() -> AsyncIterator[list[RunningAgent]]:
    agents = [await serve(m) for m in range(1, 9)]
    try:
        yield agents
    finally:
        for a in agents:
            await a.stop(0)


def check_machines(machines: list[MachineSnapshot], expected: list[int]) -> None:
    assert sorted(m.machine for m in machines) == sorted(f"m{i}" for i in expected)
    assert all(m.reachable for m in machines)
    stacks = {s.rank: s for m in machines for s in m.stacks}
    assert sorted(stacks) == sorted(i * RANKS_PER_MACHINE + k for i in expected for k in range(RANKS_PER_MACHINE))
    inner = {r: s.main.threads[0].frames[-1].name for r, s in stacks.items() if s.main.threads}
    assert inner[5] == "recv" and {n for r, n in inner.items() if r != 5} == {"all_reduce"}
    assert all(c.communicators == (WORLD,) for m in machines for c in m.counters)


async def test_a_relaying_agent_merges_the_replies_of_the_agents_below_it(leaves: list[RunningAgent]) -> None:
    half = len(leaves) // 2
    relay_a = await serve(0, relay_to=tuple(a.address for a in leaves[:half]))
    relay_b = await serve(9, relay_to=(*(a.address for a in leaves[half:]), "127.0.0.1:1"))
    try:
        async with JobClient([relay_a.address, relay_b.address], TOKEN, deadline_s=30) as client:
            snap = await client.capture()
            poll = await client.poll()
        machines = {m.address: m for m in snap.machines}
        lost = machines.pop("127.0.0.1:1")  # a child the relay could not reach: said so, by its address
        assert not lost.reachable and lost.error is not None and "nothing listening" in lost.error.message
        check_machines(list(machines.values()), list(range(10)))
        assert machines[relay_a.address].machine == "m0"
        assert {m.address for m in machines.values()} == {relay_a.address, relay_b.address} | {a.address for a in leaves}
        # the frames of ranks on different machines, sent in different tables, are one object on the client
        frames = {id(s.main.threads[0].frames[0]) for m in snap.machines for s in m.stacks if s.main.threads}
        assert len(frames) == 1
        assert sorted(m.machine for m in poll.machines if m.reachable) == sorted(f"m{i}" for i in range(10))
        assert all(not m.stacks for m in poll.machines)
    finally:
        await relay_a.stop(0)
        await relay_b.stop(0)


async def test_polls_carry_only_what_changed_through_relays_too(leaves: list[RunningAgent]) -> None:
    relay = await serve(0, relay_to=tuple(a.address for a in leaves[:4]))
    try:
        async with JobClient([relay.address, *(a.address for a in leaves[4:])], TOKEN, deadline_s=30) as client:
            first = {m.machine: m for m in (await client.poll()).machines}
            second = {m.machine: m for m in (await client.poll()).machines}
            assert sorted(second) == sorted(f"m{i}" for i in range(9)) and all(m.reachable for m in second.values())
            for name, m in second.items():  # nothing changed: every rank and counter list is the one already held
                assert m == dataclasses.replace(first[name], captured=m.captured, ranks_seen_wall=m.ranks_seen_wall)
                assert all(a is b for a, b in zip(m.ranks, first[name].ranks, strict=True)) and m.ranks
                assert all(a.ops is b.ops for a, b in zip(m.counters, first[name].counters, strict=True))
            LAUNCHES.update({2: 7, 6: 9})  # one machine behind the relay moves on, and one asked directly
            third = {m.machine: m for m in (await client.poll()).machines}
            for name, m in third.items():
                launches = {"m2": 7, "m6": 9}.get(name, 1)
                assert {op.cl for c in m.counters for op in c.ops} == {launches}
                assert all(a.ops is b.ops for a, b in zip(m.counters, second[name].counters, strict=True)) \
                    == (launches == 1)
                assert all(a is b for a, b in zip(m.ranks, second[name].ranks, strict=True))
        async with JobClient([relay.address, *(a.address for a in leaves[4:])], TOKEN, deadline_s=30) as fresh:
            whole = {m.machine: m for m in (await fresh.poll()).machines}  # a new client: whole readings
        assert {n: (m.ranks, m.counters) for n, m in whole.items()} == \
            {n: (m.ranks, m.counters) for n, m in third.items()}
    finally:
        LAUNCHES.clear()
        await relay.stop(0)


async def test_overlapping_fan_outs_leave_the_garbage_collector_as_they_found_it(leaves: list[RunningAgent]) -> None:
    async with JobClient([a.address for a in leaves], TOKEN, deadline_s=30) as client:
        assert gc.isenabled()
        polls = await asyncio.gather(client.poll(), client.capture(), client.poll())  # the pause is shared
        assert gc.isenabled() and all(len(p.machines) == len(leaves) for p in polls)
        gc.disable()
        try:
            await client.poll()
            assert not gc.isenabled()  # a caller that turned it off keeps it off
        finally:
            gc.enable()


async def test_what_a_fan_out_made_is_set_aside_from_the_collector_in_a_process_that_asked(
        leaves: list[RunningAgent]) -> None:
    # Set aside, the readings are not walked by every full collection (0.25 s a capture at 16,384 ranks); a process
    # that embeds the client (this one) keeps its own cyclic garbage collectable unless it asks.
    gc.unfreeze()
    try:
        async with JobClient([a.address for a in leaves], TOKEN, deadline_s=30) as client:
            await client.poll()
            assert gc.get_freeze_count() == 0 and gc.isenabled()
            settle_in_this_process()
            snap = await client.poll()
            assert gc.get_freeze_count() > 0 and gc.isenabled() and all(m.reachable for m in snap.machines)
            machine = snap.machines[0]
            assert not any(o is machine for o in gc.get_objects())  # the newest reading is among what is set aside
    finally:
        settle_in_this_process(False)
        gc.unfreeze()


async def test_overlapping_calls_each_decode_their_delta_against_the_reading_they_named(
        leaves: list[RunningAgent]) -> None:
    # A TUI polls while its capture is out: both ask for what changed since the same reading, and the reply that
    # comes second is a delta against a reading that is no longer the newest one held.
    async with JobClient([a.address for a in leaves], TOKEN, deadline_s=30) as client:
        await client.poll()
        for launches in (3, 4):
            LAUNCHES.update(dict.fromkeys(range(1, 9), launches))  # every machine moves on: every reply is new
            try:
                polled, captured, again = await asyncio.gather(client.poll(), client.capture(), client.poll())
            finally:
                LAUNCHES.clear()
            for snap in (polled, captured, again):
                assert all(m.reachable for m in snap.machines), [m.error for m in snap.machines if not m.reachable]
                assert {op.cl for m in snap.machines for c in m.counters for op in c.ops} == {launches}
            check_machines(list(captured.machines), list(range(1, 9)))


async def test_more_agents_than_channels_are_all_asked_with_the_channels_bounded(leaves: list[RunningAgent]) -> None:
    async with JobClient([a.address for a in leaves], TOKEN, deadline_s=30, max_channels=3) as client:
        assert client.max_channels == 3
        for _ in range(2):
            snap = await client.capture()
            check_machines(list(snap.machines), list(range(1, 9)))
        assert 1 <= client.peak_channels <= 3
    async with JobClient([a.address for a in leaves], TOKEN, deadline_s=30) as roomy:
        await roomy.poll()
        assert roomy.peak_channels == len(leaves)  # within the limit, channels stay open for the next poll


def test_running_out_of_descriptors_blames_the_limit_not_the_agent() -> None:
    exc = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                               "failed to connect to all addresses; last error: UNKNOWN: ipv4:10.0.0.7:50051: "
                               "Too many open files")
    machine = error_for_rpc("10.0.0.7:50051", exc, 10.0)
    assert machine.error is not None and machine.error.kind is CaptureErrorKind.FAILED
    assert machine.error.message.startswith("not asked: this client ran out of file descriptors")
    assert "ulimit -n" in machine.error.fix
    assert "start `rankscope agent`" not in machine.error.fix and "is `rankscope agent` running" not in machine.error.fix


def test_the_client_raises_its_open_file_limit_to_the_hard_limit() -> None:
    code = (
        "import resource\n"
        "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))\n"
        "from rankscope.wire.client import JobClient\nfrom rankscope.wire.fanout import channel_budget\n"
        "c = JobClient(['127.0.0.1:1'], None)\n"
        "now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]\n"
        "print(now == hard or hard == resource.RLIM_INFINITY, c.max_channels == channel_budget(now), hard > 256)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    if out[2] == "False":
        pytest.skip("this machine's hard open-file limit is 256 or less: nothing to raise")
    assert out[:2] == ["True", "True"]
