"""Snapshots for wire and bundle tests: one that sets every field, and a hypothesis strategy for random machines."""

from __future__ import annotations

from hypothesis import strategies as st
from rankscope.contract.snapshot import (
    CaptureError,
    CaptureErrorKind,
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
    ProcessInfo,
    ProcessRole,
    ProcessStack,
    RankCounters,
    RankInfo,
    RankStacks,
    ThreadStack,
)


def rich_job() -> JobSnapshot:
    """A snapshot that sets every field, with None and empty values where they mean something."""
    frames = (
        Frame("recv", "torch/distributed/distributed_c10d.py", 1234, "torch.distributed", False, False),
        Frame("ncclGroupEnd", "libnccl.so", None, None, True, False),
        Frame("<module>", "train.py", 1, None, False, True),
    )
    thread = ThreadStack(thread_id=2**62 + 3, frames=frames, thread_name="MainThread", os_thread_id=4242, active=True, owns_gil=True)
    main = ProcessStack(pid=100, role=ProcessRole.MAIN, threads=(thread, ThreadStack(7, ())), name="python", capture_seconds=0.125)
    worker_gone = ProcessStack(
        pid=101, role=ProcessRole.DATALOADER, threads=None,
        error=CaptureError(CaptureErrorKind.GONE, "exited during the capture", "nothing to do", process_state="Z",
                           wchan="do_exit"), name="pt_data_worker", truncated="ends mid-line",
    )
    empty = ProcessStack(pid=102, role=ProcessRole.CHECKPOINT, threads=())  # captured, no threads: not the same as None
    pinfo = ProcessInfo(100, 99, ProcessRole.MAIN, "python", ("python", "train.py", "--lr", "0.1"), "S", 99.5, 2**33, 12)
    sub = ProcessInfo(101, 100, ProcessRole.DATALOADER, "pt_data_worker")
    rank = RankInfo(rank=5, local_rank=1, world_size=8, pid=100, group_rank=2, local_world_size=2, run_id="job-7",
                    launcher_pid=99, master_addr="10.0.0.1", master_port=29500, process=pinfo, subprocesses=(sub,),
                    rank_source="pid-order: pid 100 is #1 of 2 by ascending pid in node02.txt")
    bare_rank = RankInfo(rank=4, local_rank=0, world_size=8, pid=98)
    gpu = GpuMetrics(0, "H100", "GPU-abc", 97.0, 40.5, 10**10, 8 * 10**10, 71.0, 650.5, 1980.0, 2619.0, 1.5, 2.5,
                     100.0, 200.0, 3, 0, 1, 2, (79, 48))
    counters = RankCounters(
        rank=5, pid=100, world_size=8, job_id="job-7", heartbeat_wall=1.7e9,
        communicators=(Communicator("c1", "nccl", "PIPELINE_MODEL_PARALLEL_GROUP", (1, 5)),),
        ops=(OpCounters("c1", "send", 10, 40, 39, 10, 9, 123456789, 0.25, (1e9, 2.5e9), 1.7e9 - 1, 1.7e9 - 0.5, (1,)),
             OpCounters("c1", "all_reduce", 3, 3, 3)),
        steps=42, last_step_duration_s=1.25, stale=True, stale_reason="heartbeat 12 s old", error=None,
    )
    corrupt = RankCounters(rank=4, pid=None, world_size=None, job_id=None, heartbeat_wall=None,
                           error="truncated counter file")
    machine = MachineSnapshot(
        machine="node02", address="10.0.0.2:50051", reachable=True, captured=Instant(1.7e9, 12345.5),
        hostname="node02.cluster", ranks=(bare_rank, rank),
        stacks=(RankStacks(5, main, (worker_gone, empty)), RankStacks(4, ProcessStack(98, ProcessRole.OTHER, None))),
        host=HostMetrics(55.5, 64, 2**40, 2**39, 3.5, None),
        gpus=GpuStatus(True, (gpu, GpuMetrics(1)), None, "550.54"),
        counters=(counters, corrupt),
        error=CaptureError(CaptureErrorKind.TIMEOUT, "one py-spy call ran out of time", "raise --timeout"),
    )
    lost = MachineSnapshot(
        machine="10.0.0.3:50051", address="10.0.0.3:50051", reachable=False, captured=None,
        error=CaptureError(CaptureErrorKind.UNREACHABLE, "no agent answered", "start the agent"),
    )
    no_gpu = MachineSnapshot(machine="cpu", address="c:1", reachable=True, captured=Instant(1.0, 2.0),
                             host=HostMetrics(None, None, None, None, error="psutil failed"),
                             gpus=GpuStatus(False, reason="NVML not found"))
    return JobSnapshot(
        captured=Instant(1.7e9 + 0.5, 12345.0), machines=(machine, lost, no_gpu), job_id="job-7",
        layout=Layout(tp=2, pp=4, dp=1, cp=1, ep=1, order="tp-cp-ep-pp-dp", ranks_per_machine=2),
        notes=("first note", "second"),
    )


INT64 = st.integers(-(2**63), 2**63 - 1)
SMALL = st.integers(-5, 40)
FLOAT = st.floats(allow_nan=False, allow_infinity=False)
TEXT = st.text(max_size=12)
# few distinct names, so random stacks share frames and stacks the way ranks of one job do
NAMES = st.sampled_from(["forward", "recv", "all_reduce", "<module>", "wait", "ncclGroupEnd", "é✓"])

frames = st.builds(Frame, NAMES, st.sampled_from(["train.py", "c10d.py", "libnccl.so", ""]),
                   st.none() | st.integers(-3, 2**63 - 1), st.none() | st.sampled_from(["torch", "", "m"]),
                   st.booleans(), st.booleans())
stack_pool = st.lists(st.lists(frames, max_size=6).map(tuple), min_size=1, max_size=4)


@st.composite
def machines(draw: st.DrawFn) -> MachineSnapshot:
    pool = draw(stack_pool)
    pick = st.sampled_from(pool)
    threads = st.builds(ThreadStack, INT64, pick, st.none() | TEXT, st.none() | INT64, st.booleans(), st.booleans())
    error = st.none() | st.builds(CaptureError, st.sampled_from(list(CaptureErrorKind)), TEXT, TEXT,
                                  st.none() | TEXT, st.none() | TEXT)
    procs = st.builds(ProcessStack, INT64, st.sampled_from(list(ProcessRole)),
                      st.none() | st.lists(threads, max_size=3).map(tuple), error, TEXT, st.none() | FLOAT,
                      st.none() | TEXT)
    rank_lists = st.lists(SMALL, max_size=8).map(tuple) | st.integers(0, 50).map(lambda n: tuple(range(n)))
    comms = st.lists(st.builds(Communicator, st.sampled_from(["c0", "c1", "c2"]), st.just("nccl"), TEXT, rank_lists,
                               st.integers(-1, 60), st.integers(-3, 60)),
                     min_size=1, max_size=3)
    comm_pool = draw(comms)
    ops = st.builds(OpCounters, st.sampled_from(["c0", "c1"]), st.sampled_from(["send", "all_reduce"]), INT64,
                    INT64, INT64, INT64, INT64, INT64, st.none() | FLOAT, st.lists(FLOAT, max_size=3).map(tuple),
                    st.none() | FLOAT, st.none() | FLOAT, st.lists(SMALL, max_size=3).map(tuple))
    counters = st.builds(RankCounters, SMALL, st.none() | INT64, st.none() | INT64, st.none() | TEXT,
                         st.none() | FLOAT, st.lists(st.sampled_from(comm_pool), max_size=4).map(tuple),
                         st.lists(ops, max_size=3).map(tuple), st.none() | INT64, st.none() | FLOAT,
                         st.none() | FLOAT, st.booleans(), st.none() | TEXT, st.none() | TEXT)
    stacks = st.builds(RankStacks, SMALL, procs, st.lists(procs, max_size=2).map(tuple))
    ranks = st.builds(RankInfo, SMALL, SMALL, SMALL, INT64)
    return MachineSnapshot(
        machine=draw(TEXT), address=draw(TEXT), reachable=draw(st.booleans()),
        captured=draw(st.none() | st.builds(Instant, FLOAT, FLOAT)), hostname=draw(st.none() | TEXT),
        ranks=tuple(draw(st.lists(ranks, max_size=2))), stacks=tuple(draw(st.lists(stacks, max_size=3))),
        counters=tuple(draw(st.lists(counters, max_size=3))), generation=draw(st.none() | INT64),
    )
