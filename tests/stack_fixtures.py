"""Building blocks for stack tests: snapshots of made-up ranks with real contract types.

Stacks are written outermost first (as people read them) as ``"func file.py"``
strings and stored innermost first, the order py-spy reports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rankscope.contract.snapshot import (
    CaptureError,
    CaptureErrorKind,
    Frame,
    Instant,
    JobSnapshot,
    Layout,
    MachineSnapshot,
    ProcessRole,
    ProcessStack,
    RankInfo,
    RankStacks,
    ThreadStack,
)

NOW = Instant(wall=1_700_000_000.0, mono=100.0)

TRAIN = ["<module> train.py", "main train.py", "train_loop train.py"]
OPTIMIZER = [*TRAIN, "step optimizer.py", "all_reduce distributed_c10d.py"]
RECV = [*TRAIN, "forward_backward schedules.py", "recv_forward p2p.py", "irecv distributed_c10d.py"]
SEND = [*TRAIN, "forward_backward schedules.py", "send_forward p2p.py", "isend distributed_c10d.py"]
COMPUTE = [*TRAIN, "forward_backward schedules.py", "forward model.py", "matmul_slow model.py"]
WORKER_IDLE = ["_worker_loop worker.py", "get queues.py", "poll connection.py", "select selectors.py"]
WORKER_STUCK = ["_worker_loop worker.py", "fetch fetch.py", "__getitem__ dataset.py", "read_shard dataset.py"]


def frames(spec: Sequence[str], line: int | None = None) -> tuple[Frame, ...]:
    """``["outer a.py", "inner b.py"]`` -> frames innermost first."""
    out = []
    for item in reversed(spec):
        name, _, file = item.partition(" ")
        out.append(Frame(name=name, filename=f"/site/pkg/{file}", line=line))
    return tuple(out)


def process(pid: int, main: Sequence[str], role: ProcessRole = ProcessRole.MAIN,
            threads: Sequence[Sequence[str]] = (), line: int | None = None) -> ProcessStack:
    ts = [ThreadStack(thread_id=pid * 10, frames=frames(main, line), thread_name="MainThread", os_thread_id=pid)]
    ts += [ThreadStack(thread_id=pid * 10 + i + 1, frames=frames(t), thread_name=f"Thread-{i + 1}",
                       os_thread_id=pid + i + 1) for i, t in enumerate(threads)]
    return ProcessStack(pid=pid, role=role, threads=tuple(ts))


def rank_stacks(rank: int, main: Sequence[str], workers: Sequence[Sequence[str]] = (),
                threads: Sequence[Sequence[str]] = ()) -> RankStacks:
    subs = tuple(process(10_000 + rank * 10 + i, w, ProcessRole.DATALOADER) for i, w in enumerate(workers))
    return RankStacks(rank=rank, main=process(1000 + rank, main, threads=threads), subprocesses=subs)


def unreadable(rank: int, kind: CaptureErrorKind = CaptureErrorKind.TIMEOUT) -> RankStacks:
    return RankStacks(rank=rank, main=ProcessStack(pid=1000 + rank, role=ProcessRole.MAIN, threads=None,
                                                   error=CaptureError(kind, f"py-spy {kind} on pid {1000 + rank}")))


def snapshot(stacks: Mapping[int, RankStacks], world: int, rpm: int, layout: Layout | None = None,
             absent: Sequence[int] = ()) -> JobSnapshot:
    """Machines ``node<i>`` host ``rpm`` consecutive ranks; ranks in ``absent`` have no stacks at all."""
    machines = []
    for m in range(world // rpm):
        ranks = range(m * rpm, (m + 1) * rpm)
        machines.append(MachineSnapshot(
            machine=f"node{m}", address=f"127.0.0.1:{7000 + m}", reachable=True, captured=NOW,
            ranks=tuple(RankInfo(rank=r, local_rank=r % rpm, world_size=world, pid=1000 + r) for r in ranks),
            stacks=tuple(stacks[r] for r in ranks if r in stacks and r not in absent),
        ))
    return JobSnapshot(captured=NOW, machines=tuple(machines), layout=layout)
