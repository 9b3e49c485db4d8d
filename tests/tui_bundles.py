"""Recorded bundles for the TUI tests, built from contract dataclasses.

The main one is ByteRobust's Fig. 7 hang (TP=2, PP=4, DP=4, two ranks per
machine, pp varying before dp): machine 15 waits in all_gather_into_tensor,
14 in isend, 12-13 in irecv, 0-11 in the optimizer. The answer is the PP
group on machines 12-15 (ranks 24-31). Times are fixed so screenshots are
the same on every run.
"""

from __future__ import annotations

from rankscope.contract.bundle import Bundle
from rankscope.contract.snapshot import (
    Communicator,
    Frame,
    GpuMetrics,
    GpuStatus,
    HostMetrics,
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

T0 = 1_790_000_000.0  # 2026-09-21 ~20:53 UTC; any fixed time does
FIG7_LAYOUT = Layout(tp=2, pp=4, dp=4, order="tp-cp-ep-pp-dp", ranks_per_machine=2)

OUTER = (("<module>", "train.py", 210), ("main", "train.py", 180), ("train_step", "train.py", 120))
TAILS: dict[str, tuple[tuple[str, str, int], ...]] = {
    "optimizer": (("step", "torch/optim/adam.py", 166), ("_single_tensor_adam", "torch/optim/adam.py", 402)),
    "irecv": (("forward_step", "megatron/schedules.py", 88), ("recv_forward", "megatron/p2p_communication.py", 41),
              ("irecv", "torch/distributed/distributed_c10d.py", 2115)),
    "isend": (("forward_step", "megatron/schedules.py", 88), ("send_forward", "megatron/p2p_communication.py", 57),
              ("isend", "torch/distributed/distributed_c10d.py", 2070)),
    "all_gather": (("forward_step", "megatron/schedules.py", 88), ("gather_output", "megatron/tensor_parallel.py", 33),
                   ("all_gather_into_tensor", "torch/distributed/distributed_c10d.py", 2890)),
}


def fig7_state(rank: int) -> str:
    machine = rank // 2
    if machine == 15:
        return "all_gather"
    if machine == 14:
        return "isend"
    if machine in (12, 13):
        return "irecv"
    return "optimizer"


def frames_for(state: str) -> tuple[Frame, ...]:
    path = (*OUTER, *TAILS[state])
    return tuple(Frame(name, f"/job/{fname}", line) for name, fname, line in reversed(path))  # innermost first


def rank_stacks(rank: int, state: str, pid: int) -> RankStacks:
    main = ProcessStack(pid, ProcessRole.MAIN, (ThreadStack(pid, frames_for(state), "MainThread", pid, True, True),),
                        name="python")
    loader = ProcessStack(pid + 1, ProcessRole.DATALOADER,
                          (ThreadStack(pid + 1, (Frame("wait", "/job/threading.py", 320),
                                                 Frame("_worker_loop", "/job/torch/utils/data/_utils/worker.py", 300)),
                                       "MainThread"),), name="pt_data_worker")
    return RankStacks(rank, main, (loader,))


def pp_peers(rank: int, layout: Layout = FIG7_LAYOUT) -> tuple[int, ...]:
    tp = rank % layout.tp
    dp = rank // (layout.tp * layout.pp)
    return tuple(tp + layout.tp * (pp + layout.pp * dp) for pp in range(layout.pp))


def counters_for(rank: int, world: int, step: int, hung: bool, step_s: float | None = None) -> RankCounters:
    """One PP communicator per rank: in the hang, rank 30 never launched its last send. ``step_s``: how long the
    rank's last step took, as its counters time it (None: not timed)."""
    peers = pp_peers(rank)
    comm = Communicator(f"pp{peers[0]}", "gloo", "PIPELINE_MODEL_PARALLEL_GROUP", peers)
    cl = step * 4
    wc = cl
    if hung and rank in peers and peers[0] == 24:
        if rank == 30:
            cl -= 1
        wc = cl - 1 if rank in (26, 28) else cl  # irecv posted, never completed
    ops = (OpCounters(comm.comm_id, "p2p", cl, cl, wc, open_peers=(30,) if wc < cl else ()),)
    return RankCounters(rank, 1000 + rank, world, "fig7", T0, (comm,), ops, steps=step, last_step_duration_s=step_s)


def machine(index: int, wall: float, *, stacks: bool, step: int, hung: bool, world: int = 32,
            reachable: bool = True, gpu_temp: float = 60.0, step_s: float | None = None) -> MachineSnapshot:
    name = f"node{index:02d}"
    address = f"127.0.0.1:{50100 + index}"
    if not reachable:
        from rankscope.contract.snapshot import CaptureError, CaptureErrorKind

        return MachineSnapshot(name, address, False, None,
                               error=CaptureError(CaptureErrorKind.UNREACHABLE, "connection refused", "start the agent"))
    ranks = (2 * index, 2 * index + 1)
    infos = tuple(RankInfo(r, r % 2, world, 1000 + r, group_rank=index) for r in ranks)
    st = tuple(rank_stacks(r, fig7_state(r) if hung else "optimizer", 1000 + r) for r in ranks) if stacks else ()
    host = HostMetrics(40.0 + index, 32, 128 << 30, (40 + index) << 30, 2.5)
    gpus = GpuStatus(True, tuple(GpuMetrics(i, "H100", util_percent=90.0 - index, mem_used_bytes=60 << 30,
                                            mem_total_bytes=80 << 30,
                                            temperature_c=gpu_temp if i == 1 else 60.0, power_w=500.0)
                                 for i in range(2)), driver_version="555.42")
    counters = tuple(counters_for(r, world, step, hung, step_s) for r in ranks)
    return MachineSnapshot(name, address, True, Instant(wall, wall - T0), name, infos, st, host, gpus, counters)


def job(wall: float, *, stacks: bool, step: int, hung: bool, lost: tuple[int, ...] = (),
        hot_machine: int | None = None, step_s: float | None = None) -> JobSnapshot:
    ms = tuple(machine(i, wall, stacks=stacks, step=step, hung=hung, reachable=i not in lost,
                       gpu_temp=95.0 if i == hot_machine else 60.0, step_s=step_s) for i in range(16))
    return JobSnapshot(Instant(wall, wall - T0), ms, job_id="fig7", layout=FIG7_LAYOUT)


def fig7_bundle() -> Bundle:
    """Three healthy polls, then no progress for 45 s, then a capture that shows the hang."""
    snaps = (
        job(T0, stacks=False, step=100, hung=False),
        job(T0 + 1, stacks=False, step=101, hung=False),
        job(T0 + 2, stacks=False, step=102, hung=True, hot_machine=9),
        job(T0 + 47, stacks=False, step=102, hung=True, hot_machine=9),
        job(T0 + 48, stacks=True, step=102, hung=True, hot_machine=9),
    )
    return Bundle(snaps, T0 + 48, ground_truth={"fault": "hang-p2p", "machines": ["node12", "node13", "node14",
                                                                                  "node15"]})


def lost_series() -> tuple[JobSnapshot, JobSnapshot, JobSnapshot]:
    """All reachable, then node05 lost, then node05 back."""
    return (
        job(T0, stacks=False, step=10, hung=False),
        job(T0 + 1, stacks=False, step=11, hung=False, lost=(5,)),
        job(T0 + 2, stacks=False, step=12, hung=False),
    )


def big_job(machines: int = 2048, ranks_per_machine: int = 8, *, wall: float = T0, stacks: bool = True,
            outlier_machine: int = 1733) -> JobSnapshot:
    """A large job (16,384 ranks by default) for the benchmark; one machine's ranks diverge."""
    world = machines * ranks_per_machine
    layout = Layout(tp=8, pp=8, dp=world // 64, ranks_per_machine=ranks_per_machine)
    ms = []
    for i in range(machines):
        ranks = tuple(range(i * ranks_per_machine, (i + 1) * ranks_per_machine))
        infos = tuple(RankInfo(r, r % ranks_per_machine, world, 10_000 + r, group_rank=i) for r in ranks)
        state = "irecv" if i == outlier_machine else "optimizer"
        st = tuple(rank_stacks(r, state, 10_000 + r) for r in ranks) if stacks else ()
        host = HostMetrics(30.0 + (i % 7), 96, 1 << 40, (200 + i % 50) << 30, 10.0)
        gpus = GpuStatus(True, tuple(GpuMetrics(g, "H100", util_percent=95.0, temperature_c=99.0 if i == 7 else 61.0,
                                                mem_used_bytes=70 << 30, mem_total_bytes=80 << 30, power_w=650.0)
                                     for g in range(ranks_per_machine)))
        counters = tuple(
            RankCounters(r, 10_000 + r, world, "big", wall,
                         (Communicator(f"tp{r // 8}", "nccl", "TENSOR_MODEL_PARALLEL_GROUP",
                                       tuple(range(r // 8 * 8, r // 8 * 8 + 8))),),
                         (OpCounters(f"tp{r // 8}", "all_reduce", 500 - (1 if i == outlier_machine else 0), 500, 500),),
                         steps=50)
            for r in ranks)
        ms.append(MachineSnapshot(f"node{i:04d}", f"10.0.{i // 256}.{i % 256}:50051", True,
                                  Instant(wall, wall - T0), f"node{i:04d}", infos, st, host, gpus, counters))
    return JobSnapshot(Instant(wall, wall - T0), tuple(ms), job_id="big", layout=layout)
