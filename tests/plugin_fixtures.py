"""Counter files as NCCL's profiler plugin writes them, for a small GPU job.

The plugin knows a communicator by its commHash, its size and this rank's
place in it, never its members' global ranks; it names operations as NCCL does
(``AllReduce``, ``Send``, ``Recv``); an open point-to-point request names its
peer by place in the communicator; TD and N come from the kernel-channel and
proxy events (``last_duration_s``, ``recent_throughput``). No shim groups:
the analysis must join and read these alone.

Stacks are a GPU job's: NCCL's calls return once queued, so every host waits
at its next synchronisation (``.item()``) whatever its GPU waits on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from ccl_fixtures import with_counters
from rankscope.contract.snapshot import Communicator, JobSnapshot, Layout, OpCounters, RankCounters, RankStacks
from stack_fixtures import TRAIN, rank_stacks, snapshot

SYNC = [*TRAIN, "train_step train.py", "item torch/_tensor.py"]  # the host waits on its GPU
LOADER_WAIT = [*TRAIN, "__next__ dataloader.py", "_next_data dataloader.py", "_get_data dataloader.py",
               "get queues.py", "poll connection.py", "select selectors.py"]
LOADER_STUCK = ["_worker_loop worker.py", "fetch fetch.py", "__getitem__ dataset.py", "read_shard dataset.py"]
LOADER_IDLE = ["_worker_loop worker.py", "get queues.py", "poll connection.py", "select selectors.py"]


class PluginJob:
    """Communicators by hash (members only implied by who reports them), ops in NCCL's names."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.comms: dict[int, list[Communicator]] = {r: [] for r in range(world)}
        self.ops: dict[int, list[OpCounters]] = {r: [] for r in range(world)}
        self.places: dict[str, tuple[int, ...]] = {}

    def comm(self, comm_hash: str, members: Sequence[int]) -> str:
        self.places[comm_hash] = tuple(members)
        for place, r in enumerate(members):
            self.comms[r].append(Communicator(comm_hash, "nccl", "", (), comm_nranks=len(members), comm_rank=place))
        return comm_hash

    def op(self, rank: int, comm_hash: str, op: str, cl: int, open_: int = 0, peers: Iterable[int] = (),
           td: float | None = 0.010, ring: Sequence[float] = (2.0e9,) * 5, nbytes: int = 1 << 20) -> None:
        """``open_``: requests still open (WC = WR - open_); ``peers``: global ranks, written as places."""
        places = self.places[comm_hash]
        wr = cl * 4  # NCCL counts a request per channel step: more than one per call
        self.ops[rank].append(OpCounters(
            comm_hash, op, cl, wr, wr - open_, bytes_total=nbytes * cl, last_duration_s=td,
            recent_throughput=tuple(ring), open_peers=tuple(places.index(p) for p in peers)))

    def files(self) -> dict[int, RankCounters]:
        return {r: RankCounters(rank=r, pid=1000 + r, world_size=self.world, job_id="j", heartbeat_wall=1.0,
                                communicators=tuple(self.comms[r]), ops=tuple(self.ops[r]))
                for r in range(self.world)}


def gpu_snapshot(job: PluginJob, layout: Layout, stacks: Mapping[int, RankStacks] | None = None) -> JobSnapshot:
    """Every rank's host at ``.item()`` unless ``stacks`` says otherwise."""
    rpm = layout.ranks_per_machine or job.world
    got = {r: rank_stacks(r, SYNC, workers=[LOADER_IDLE]) for r in range(job.world)} | dict(stacks or {})
    return with_counters(snapshot(got, job.world, rpm, layout), job.files())


# TP=1, PP=2, DP=2 on two machines (tp-cp-ep-dp-pp): PP pairs (0, 2), (1, 3); DP groups (0, 1), (2, 3).
PIPE = Layout(tp=1, pp=2, dp=2, ranks_per_machine=2)


def pipeline_job(step: int = 10, skipped_send: int | None = None) -> PluginJob:
    """Each step stage 0 sends forward, stage 1 receives and sends backward, stage 0 receives; then each stage's
    DP group all-reduces. ``skipped_send``: a stage-0 rank that skipped its forward send this step and went on to
    its backward recv; its pipeline peer waits for the send, its DP peer in the all-reduce."""
    job = PluginJob(4)
    job.comm("d0000000000000aa", (0, 1, 2, 3))  # the default communicator: no ops
    pairs = {0: job.comm("0a0a0a0a0a0a0a0a", (0, 2)), 1: job.comm("1b1b1b1b1b1b1b1b", (1, 3))}
    dps = {0: job.comm("5c5c5c5c5c5c5c5c", (0, 1)), 1: job.comm("6d6d6d6d6d6d6d6d", (2, 3))}
    for first in (0, 1):
        second = first + 2
        pp = pairs[first]
        if first == skipped_send:
            job.op(first, pp, "Send", step - 1)
            job.op(first, pp, "Recv", step, open_=1, peers=[second])  # the gradient that never comes
            job.op(second, pp, "Recv", step, open_=1, peers=[first])  # the activation that never came
            job.op(second, pp, "Send", step - 1)
            job.op(first, dps[0], "AllReduce", step - 1)
            job.op(second, dps[1], "AllReduce", step - 1)
        else:
            for r in (first, second):
                job.op(r, pp, "Send", step)
                job.op(r, pp, "Recv", step)
            job.op(first, dps[0], "AllReduce", step, open_=1 if skipped_send is not None else 0)
            job.op(second, dps[1], "AllReduce", step, open_=1 if skipped_send is not None else 0)
    return job


# TP=2, DP=2 on one machine and one GPU (tp-cp-ep-dp-pp): TP groups (0, 1), (2, 3); DP groups (0, 2), (1, 3).
ONE_GPU = Layout(tp=2, dp=2, ranks_per_machine=4)


def loader_job(step: int = 10, stuck: int = 1) -> tuple[PluginJob, dict[int, RankStacks]]:
    """Each step: a batch, the TP all-reduce, then the first DP replica sends to the second on the default
    communicator (ranks 0, 1 only send; 2, 3 only receive). ``stuck``'s DataLoader worker hangs before this
    step's batch: its TP peer waits in the all-reduce, its DP peer (or itself) in the transfer."""
    job = PluginJob(4)
    world = job.comm("d0000000000000aa", (0, 1, 2, 3))
    tps = {0: job.comm("7a7a7a7a7a7a7a7a", (0, 1)), 1: job.comm("8b8b8b8b8b8b8b8b", (2, 3))}
    job.comm("9c9c9c9c9c9c9c9c", (0, 2))
    job.comm("aeaeaeaeaeaeaeae", (1, 3))
    stuck_tp = stuck // 2
    for r in range(4):
        tp, dp = r % 2, r // 2
        mine = r == stuck or (dp == stuck_tp and r != stuck)  # its TP group never finished this step's all-reduce
        job.op(r, tps[dp], "AllReduce", step - 1 if r == stuck else step, open_=1 if mine and r != stuck else 0)
        peer = r + 2 if dp == 0 else r - 2
        sender = peer if dp == 1 else r
        sent = step - 1 if (sender // 2 == stuck_tp) else step
        if dp == 0:
            job.op(r, world, "Send", sent)
        else:
            job.op(r, world, "Recv", step, open_=1 if sent < step else 0, peers=[peer] if sent < step else [])
        del tp
    stacks = {stuck: rank_stacks(stuck, LOADER_WAIT, workers=[LOADER_STUCK])}
    return job, stacks
