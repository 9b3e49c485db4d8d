"""A capture through relays that merge equals a direct capture: the same machines, verdict, groups and counters.

Twelve real agent servers on loopback (their readings from a source, as the probes would give them: the agent
server, its relaying, the wire and the client are the production ones), asked directly and through a two-level
tree of merging relays: one relay for four agents, and one for four more agents and that relay.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from rankscope.analyzers.analysis import analyze_job
from rankscope.contract.snapshot import (
    Communicator,
    Frame,
    Instant,
    JobSnapshot,
    MachineSnapshot,
    OpCounters,
    ProcessInfo,
    ProcessRole,
    ProcessStack,
    RankCounters,
    RankInfo,
    RankStacks,
    ThreadStack,
)
from rankscope.wire.agent import AgentConfig, RunningAgent, start_agent
from rankscope.wire.client import JobClient
from rankscope.wire.tokens import parse_tokens

pytestmark = pytest.mark.timeout(180)
TOKEN = "m" * 32
AGENTS, RANKS_PER_MACHINE, TP = 12, 4, 4
WORLD_SIZE = AGENTS * RANKS_PER_MACHINE
STUCK = 13  # waits in a recv while the others of its group wait in the all-reduce
OUTER = tuple(Frame(f"layer{i}", "model.py", 20 + i) for i in range(10))
WORLD = Communicator("world", "nccl", "WORLD", tuple(range(WORLD_SIZE)))


def reading(machine: int, stacks: bool, launches: int) -> MachineSnapshot:
    ranks = range(machine * RANKS_PER_MACHINE, (machine + 1) * RANKS_PER_MACHINE)

    def tp(r: int) -> Communicator:
        first = r - r % TP
        return Communicator(f"tp{first}", "nccl", "TENSOR_MODEL_PARALLEL_GROUP", tuple(range(first, first + TP)))

    return MachineSnapshot(
        machine=f"node{machine:02d}", address="", reachable=True, captured=Instant(100.0, 5.0),
        hostname=f"node{machine:02d}",
        ranks=tuple(RankInfo(r, r % RANKS_PER_MACHINE, WORLD_SIZE, 1000 + r, group_rank=machine,
                             run_id="merge-job", process=ProcessInfo(1000 + r, 999, ProcessRole.MAIN, "python"))
                    for r in ranks),
        stacks=tuple(RankStacks(r, ProcessStack(1000 + r, ProcessRole.MAIN, (
            ThreadStack(1000 + r, (Frame("recv" if r == STUCK else "all_reduce", "distributed_c10d.py", 2500),
                                   *OUTER), "MainThread", 1000 + r, True, True),
            ThreadStack(2000 + r, (Frame("pin", "pin_memory.py", 3),), "pin_memory"))),
            (ProcessStack(3000 + r, ProcessRole.DATALOADER, (ThreadStack(3000 + r, (Frame("fetch", "worker.py", 9),)),)),))
            for r in ranks) if stacks else (),
        counters=tuple(RankCounters(r, 1000 + r, WORLD_SIZE, "merge-job", 100.0, (WORLD, tp(r)), (
            OpCounters("world", "barrier", 3, 3, 3, 3, 3),
            OpCounters(tp(r).comm_id, "all_reduce", launches, launches, launches - (1 if r == STUCK - 1 else 0),
                       launches, launches - 1, 1 << 20, 0.01)), steps=launches) for r in ranks),
    )


LAUNCHES: dict[int, int] = {}


def source_for(machine: int) -> Callable[[bool], Awaitable[MachineSnapshot]]:
    async def read(stacks: bool) -> MachineSnapshot:
        return reading(machine, stacks, LAUNCHES.get(machine, 40))

    return read


def relay_only(name: str) -> Callable[[bool], Awaitable[MachineSnapshot]]:
    async def read(stacks: bool) -> MachineSnapshot:  # a relay host runs no ranks of the job
        return MachineSnapshot(machine=name, address="", reachable=True, captured=Instant(100.0, 5.0))

    return read


@dataclasses.dataclass
class Tree:
    leaves: list[RunningAgent]
    lower: RunningAgent  # relays for leaves 0-3
    upper: RunningAgent  # relays for leaves 4-7 and the lower relay; leaves 8-11 are asked directly


async def _agent(name: str, source: Callable[[bool], Awaitable[MachineSnapshot]],
                 relay_to: tuple[str, ...] = ()) -> RunningAgent:
    config = AgentConfig(tokens=parse_tokens(f"read:{TOKEN}\n", "test"), port=0, machine_name=name,
                         relay_to=relay_to, relay_token=TOKEN)
    return await start_agent(config, source=source)


@pytest.fixture
async def tree() -> AsyncIterator[Tree]:
    leaves = [await _agent(f"node{m:02d}", source_for(m)) for m in range(AGENTS)]
    lower = await _agent("relay-low", relay_only("relay-low"), tuple(a.address for a in leaves[:4]))
    upper = await _agent("relay-up", relay_only("relay-up"), (*(a.address for a in leaves[4:8]), lower.address))
    try:
        yield Tree(leaves, lower, upper)
    finally:
        for a in (upper, lower, *leaves):
            await a.stop(0)


def _through(t: Tree) -> list[str]:
    return [t.upper.address, *(a.address for a in t.leaves[8:])]


def _job(snap: JobSnapshot) -> JobSnapshot:
    """The machines that run ranks, by name (a relay host's own empty reading aside)."""
    return dataclasses.replace(snap, machines=tuple(sorted((m for m in snap.machines if m.ranks or not m.reachable),
                                                           key=lambda m: m.machine)))


def _same_reading(direct: JobSnapshot, merged: JobSnapshot) -> None:
    assert [m.machine for m in merged.machines] == [f"node{m:02d}" for m in range(AGENTS)]
    for a, b in zip(direct.machines, merged.machines, strict=True):
        assert a == b  # every field: ranks, stacks, counters, host, address
    assert sum(len(m.stacks) for m in merged.machines) in (0, WORLD_SIZE)


async def test_a_capture_through_merging_relays_equals_a_direct_capture(tree: Tree) -> None:
    async with JobClient([a.address for a in tree.leaves], TOKEN, deadline_s=30) as direct_client:
        direct = _job(await direct_client.capture())
    async with JobClient(_through(tree), TOKEN, deadline_s=30) as client:
        raw = await client.capture()
    merged = _job(raw)
    assert {m.machine for m in raw.machines} - {m.machine for m in merged.machines} == {"relay-low", "relay-up"}
    _same_reading(direct, merged)
    a, b = analyze_job(direct), analyze_job(merged)
    assert b.verdict == a.verdict and b.counters == a.counters
    assert STUCK in {r for s in b.verdict.suspects for r in s.ranks}
    groups = [(g.ranks, g.signature) for g in b.stacks.grouping.groups]
    assert groups == [(g.ranks, g.signature) for g in a.stacks.grouping.groups]
    assert (STUCK,) in [tuple(r) for r, _ in groups]
    assert b.stacks.grouping.outlier_ranks == a.stacks.grouping.outlier_ranks == (STUCK,)


async def test_polls_through_merging_relays_follow_the_counters_as_direct_ones_do(tree: Tree) -> None:
    async with JobClient(_through(tree), TOKEN, deadline_s=30) as client, \
            JobClient([a.address for a in tree.leaves], TOKEN, deadline_s=30) as direct_client:
        first = _job(await client.poll())
        second = _job(await client.poll())  # deltas through two merges: what did not change is the object held
        assert all(a.ops is b.ops for x, y in zip(first.machines, second.machines, strict=True)
                   for a, b in zip(x.counters, y.counters, strict=True))
        LAUNCHES.update({1: 41, 6: 43, 9: 44})  # behind the lower relay, behind the upper one, asked directly
        try:
            third = _job(await client.poll())
            direct = _job(await direct_client.poll())
        finally:
            LAUNCHES.clear()
    _same_reading(direct, third)
    assert {m.machine: m.counters[0].steps for m in third.machines} == \
        {f"node{m:02d}": {1: 41, 6: 43, 9: 44}.get(m, 40) for m in range(AGENTS)}
    assert analyze_job(third).verdict == analyze_job(direct).verdict


async def test_a_relay_gone_is_named_with_the_ranks_behind_it_and_the_rest_arrives(tree: Tree) -> None:
    async with JobClient(_through(tree), TOKEN, deadline_s=10) as client:
        await client.poll()  # the client and the upper relay learn what is behind each relay
        await tree.lower.stop(0)
        snap = await client.capture()
    by_name = {m.machine: m for m in snap.machines}
    lost = [by_name[f"node{m:02d}"] for m in range(4)]
    assert not any(m.reachable for m in lost)
    for m, machine in enumerate(lost):
        assert machine.error is not None
        first = m * RANKS_PER_MACHINE
        assert f"node{m:02d} (ranks {first}-{first + RANKS_PER_MACHINE - 1}) is behind the relay at " \
               f"{tree.lower.address}" in machine.error.message
    assert not by_name["relay-low"].reachable
    arrived = [by_name[f"node{m:02d}"] for m in range(4, AGENTS)]
    assert all(m.reachable for m in arrived)
    assert sorted(s.rank for m in arrived for s in m.stacks) == list(range(4 * RANKS_PER_MACHINE, WORLD_SIZE))
    # the analysis says which ranks it could not see, rather than judging without them silently
    verdict = analyze_job(_job(snap)).verdict
    assert set(range(4 * RANKS_PER_MACHINE)) <= set(verdict.missing_ranks)


async def test_the_upper_relay_gone_takes_its_whole_subtree_named_on_the_client(tree: Tree) -> None:
    async with JobClient(_through(tree), TOKEN, deadline_s=10) as client:
        await client.poll()
        await tree.upper.stop(0)
        snap = await client.poll()
    by_name = {m.machine: m for m in snap.machines}
    for m in range(8):  # behind the upper relay, directly or through the lower one
        machine = by_name[f"node{m:02d}"]
        assert not machine.reachable and machine.error is not None
        assert f"is behind the relay at {tree.upper.address}" in machine.error.message
    assert all(by_name[f"node{m:02d}"].reachable for m in range(8, AGENTS))
