"""Counter files of a hand-built job, and the drill's desync in stacks and counters (tests of the CCL analyzers, the TUI).

Stacks in the shapes the drill and the stack tests use, counters as the CCL
plugin writes them: ranks a step ahead block in their pipeline send while the
others wait in a barrier those ranks never launched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace

from rankscope.contract.snapshot import Communicator, JobSnapshot, Layout, OpCounters, RankCounters, RankStacks
from stack_fixtures import RECV, SEND, TRAIN, rank_stacks

BARRIER = [*TRAIN[:2], "barrier distributed_c10d.py"]
L8 = Layout(tp=2, pp=2, dp=2, ranks_per_machine=2)  # tp-cp-ep-dp-pp: TP (0,1), DP (0,2), PP (0,4)
TP8 = [(0, 1), (2, 3), (4, 5), (6, 7)]
DP8 = [(0, 2), (1, 3), (4, 6), (5, 7)]
PP8 = [(0, 4), (1, 5), (2, 6), (3, 7)]


class Counters:
    """Per-rank counter files of one job: communicators, then ops added rank by rank."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.comms: dict[str, Communicator] = {}
        self.ops: dict[int, list[OpCounters]] = {r: [] for r in range(world)}

    def comm(self, cid: str, desc: str, ranks: Sequence[int]) -> str:
        self.comms[cid] = Communicator(cid, "nccl", desc, tuple(ranks))
        return cid

    def op(self, rank: int, cid: str, op: str, cl: int, wc: int | None = None, peers: Iterable[int] = ()) -> None:
        self.ops[rank].append(OpCounters(cid, op, cl, cl, cl if wc is None else wc, open_peers=tuple(peers)))

    def files(self) -> dict[int, RankCounters]:
        return {r: RankCounters(rank=r, pid=1000 + r, world_size=self.world, job_id="j", heartbeat_wall=1.0,
                                communicators=tuple(c for c in self.comms.values() if r in c.ranks),
                                ops=tuple(self.ops[r]))
                for r in range(self.world)}


def with_counters(snap: JobSnapshot, counters: Mapping[int, RankCounters]) -> JobSnapshot:
    machines = tuple(replace(m, counters=tuple(counters[r.rank] for r in m.ranks if r.rank in counters))
                     for m in snap.machines)
    return replace(snap, machines=machines)


def steady(c: Counters, groups: Sequence[Sequence[int]], desc: str, prefix: str, cl: int) -> None:
    """Groups whose members all launched and finished ``cl`` all-reduces: they agree."""
    for i, g in enumerate(groups):
        cid = c.comm(f"{prefix}{i}", desc, g)
        for r in g:
            c.op(r, cid, "all_reduce", cl)


def pipeline(c: Counters, sends: Mapping[int, int] = {}, recvs: Mapping[int, int] = {}) -> None:
    """PP pairs (stage 0, stage 1): 20 sends and recvs each; ``sends``/``recvs``: rank -> peer with one open."""
    for i, (a, b) in enumerate(PP8):
        cid = c.comm(f"pp{i}", "PIPELINE_MODEL_PARALLEL_GROUP", (a, b))
        for r, peer in ((a, b), (b, a)):
            c.op(r, cid, "send", 21 if r in sends else 20, 20, [peer] if r in sends else [])
            c.op(r, cid, "recv", 21 if r in recvs else 20, 20, [peer] if r in recvs else [])


def drill_desync(ahead: tuple[int, int], world_barrier: bool = True) -> tuple[dict[int, RankStacks], Counters]:
    """The drill's desync: one TP pair ran a step more; the rest left the loop for the closing barrier.

    The pair blocks in its pipeline send (stage 0) or recv (stage 1); the others wait in the world barrier,
    which the pair never launched.
    """
    first_stage = ahead[0] < 4
    stacks = {r: rank_stacks(r, (SEND if first_stage else RECV) if r in ahead else BARRIER) for r in range(8)}
    c = Counters(8)
    world = c.comm("0", "default_pg", range(8))
    for r in range(8):
        if r not in ahead:
            c.op(r, world, "barrier", 1, 0 if world_barrier else 1)
    steady(c, TP8, "TENSOR_MODEL_PARALLEL_GROUP", "tp", 80)
    steady(c, DP8, "DATA_PARALLEL_GROUP", "dp", 5)
    pp_of = dict(PP8) | {b: a for a, b in PP8}
    if first_stage:
        pipeline(c, sends={r: pp_of[r] for r in ahead})
    else:
        pipeline(c, recvs={r: pp_of[r] for r in ahead})
    return stacks, c
