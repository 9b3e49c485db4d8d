"""How fast stack aggregation judges a 16k-rank job: `python benchmarks/bench_analyze.py`.

Builds (untimed) a JobSnapshot of 16,384 ranks laid out TP=8, PP=16, DP=128
on 8-GPU machines. Every rank has a ~40-frame main thread, an idle
pin-memory thread and two dataloader workers, each made of its own Frame
objects as a decoded capture would be. Several outlier patterns are mixed in:
a stalled pipeline (Fig. 7 style), a lone rank stuck in compute, a rank whose
dataloader worker is stuck, and line-number jitter among healthy ranks.

Then it times, side by side:
- ``analyze_stacks`` (grouping + prefix tree + suspect ranking), and
  ``group_stacks`` alone;
- a naive baseline: one signature string per rank built by joining
  ``name (file)`` of every frame, grouped in a dict of strings.
It prints the median and best of several runs, the ratio, and the peak
memory of one analysis (tracemalloc, measured in a separate run because
tracing slows Python down).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Mapping

from rankscope.analyzers.analysis import analyze_stacks
from rankscope.analyzers.stacks import group_stacks
from rankscope.contract.snapshot import (
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

TP, PP, DP, RPM = 8, 16, 128, 8
WORLD = TP * PP * DP
SITE = "/opt/venv/lib/python3.11/site-packages"

COMMON = [("<module>", "/workspace/pretrain_gpt.py")] + [
    (f"layer_{i}", f"/workspace/megatron/core/module_{i % 7}.py") for i in range(28)
] + [("train", "/workspace/megatron/training/training.py"), ("train_step", "/workspace/megatron/training/training.py")]
HEALTHY_TAIL = [("MixedPrecisionOptimizer.step", "/workspace/megatron/core/optimizer/optimizer.py"),
                ("finish_grad_sync", "/workspace/megatron/core/distributed/distributed_data_parallel.py"),
                ("start_grad_sync", "/workspace/megatron/core/distributed/param_and_grad_buffer.py"),
                ("wrapper", f"{SITE}/torch/distributed/c10d_logger.py"),
                ("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py")]
P2P = [("forward_backward_pipelining_without_interleaving", "/workspace/megatron/core/pipeline_parallel/schedules.py"),
       ("recv_backward", "/workspace/megatron/core/pipeline_parallel/p2p_communication.py"),
       ("_communicate", "/workspace/megatron/core/pipeline_parallel/p2p_communication.py"),
       ("wrapper", f"{SITE}/torch/distributed/c10d_logger.py")]
COMPUTE_TAIL = [("forward_step", "/workspace/megatron/core/pipeline_parallel/schedules.py"),
                ("_call_impl", f"{SITE}/torch/nn/modules/module.py"),
                ("GPTModel.forward", "/workspace/megatron/core/models/gpt/gpt_model.py"),
                ("slow_kernel", "/workspace/megatron/core/fusions/fused_bias_gelu.py")]
PIN = [("Thread._bootstrap", "/usr/lib/python3.11/threading.py"), ("_pin_memory_loop", f"{SITE}/torch/utils/data/_utils/pin_memory.py"),
       ("do_one_step", f"{SITE}/torch/utils/data/_utils/pin_memory.py"), ("Queue.get", "/usr/lib/python3.11/multiprocessing/queues.py"),
       ("wait", "/usr/lib/python3.11/multiprocessing/connection.py"), ("select", "/usr/lib/python3.11/selectors.py")]
WORKER = [("_worker_loop", f"{SITE}/torch/utils/data/_utils/worker.py"), ("Queue.get", "/usr/lib/python3.11/multiprocessing/queues.py"),
          ("wait", "/usr/lib/python3.11/multiprocessing/connection.py"), ("select", "/usr/lib/python3.11/selectors.py")]
WORKER_STUCK = [("_worker_loop", f"{SITE}/torch/utils/data/_utils/worker.py"), ("fetch", f"{SITE}/torch/utils/data/_utils/fetch.py"),
                ("__getitem__", "/workspace/data/indexed_dataset.py"), ("read_shard", "/workspace/data/indexed_dataset.py")]


def _frames(spec: list[tuple[str, str]], jitter: int) -> tuple[Frame, ...]:
    # New str and Frame objects per rank, like a decoded capture (no sharing between ranks).
    return tuple(Frame(name="".join(name), filename="".join(file), line=10 + i + jitter)
                 for i, (name, file) in enumerate(reversed(spec)))


def build_snapshot() -> tuple[JobSnapshot, Layout, dict[str, list[int]]]:
    layout = Layout(tp=TP, pp=PP, dp=DP, order="tp-pp-dp", ranks_per_machine=RPM)
    # pipeline of dp=77 stalled (all its TP x PP ranks), rank 5000 alone in compute, rank 9000's worker stuck
    stalled = [tp + TP * (pp + PP * 77) for pp in range(PP) for tp in range(TP)]
    patterns = {"stalled pipeline (dp=77)": stalled, "lone compute rank": [5000], "stuck dataloader": [9000]}
    machines = []
    for m in range(WORLD // RPM):
        infos, stacks = [], []
        for rank in range(m * RPM, (m + 1) * RPM):
            if rank in patterns["lone compute rank"]:
                tail = [*P2P[:1], *COMPUTE_TAIL]
            elif rank in stalled:
                op = "irecv" if (rank // TP) % PP < PP - 1 else "isend"
                tail = [*P2P, (op, f"{SITE}/torch/distributed/distributed_c10d.py")]
            else:
                tail = HEALTHY_TAIL
            main = ThreadStack(thread_id=rank, frames=_frames(COMMON + tail, rank % 5), thread_name="MainThread",
                               os_thread_id=100_000 + rank)
            pin = ThreadStack(thread_id=rank + 1, frames=_frames(PIN, 0), thread_name=f"Thread-{rank % 3}")
            workers = tuple(
                ProcessStack(pid=200_000 + 2 * rank + w, role=ProcessRole.DATALOADER, threads=(
                    ThreadStack(thread_id=1, frames=_frames(WORKER_STUCK if rank == 9000 and w == 1 else WORKER, 0),
                                thread_name="MainThread"),))
                for w in range(2))
            stacks.append(RankStacks(rank=rank, main=ProcessStack(pid=100_000 + rank, role=ProcessRole.MAIN,
                                                                  threads=(main, pin)), subprocesses=workers))
            infos.append(RankInfo(rank=rank, local_rank=rank % RPM, world_size=WORLD, pid=100_000 + rank))
        machines.append(MachineSnapshot(machine=f"node{m:04d}", address="10.0.0.1:7077", reachable=True,
                                        captured=Instant(0.0, 0.0), ranks=tuple(infos), stacks=tuple(stacks)))
    snap = JobSnapshot(captured=Instant(0.0, 0.0), machines=tuple(machines), layout=layout)
    return snap, layout, patterns


def naive_grouping(stacks: Mapping[int, RankStacks]) -> dict[str, list[int]]:
    """What one would write first: a string per rank, grouped in a dict."""
    groups: dict[str, list[int]] = {}
    for rank, rs in stacks.items():
        parts = []
        for proc in (rs.main, *rs.subprocesses):
            for t in proc.threads or ():
                parts.append("|".join(f"{f.name} ({os.path.basename(f.filename)})" for f in t.frames))
        groups.setdefault("\n".join(sorted(parts)), []).append(rank)
    return groups


def timed(fn: Callable[[], object], repeat: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds per run; on a shared machine the CPU time is the steadier figure."""
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()

    t0 = time.perf_counter()
    snap, layout, patterns = build_snapshot()
    stacks = snap.all_stacks()
    frames = sum(len(t.frames) for rs in stacks.values() for p in (rs.main, *rs.subprocesses) for t in p.threads or ())
    print(f"built {WORLD} ranks, {frames} frames ({frames / WORLD:.0f} per rank) in {time.perf_counter() - t0:.1f} s "
          f"(untimed); python {sys.version.split()[0]}, {os.cpu_count()} CPUs")

    analysis = analyze_stacks(snap, layout)
    top = analysis.verdict.top
    print(f"verdict: {analysis.verdict.summary}")
    for name, ranks in patterns.items():
        print(f"  injected {name}: {len(ranks)} rank(s) from {ranks[0]}")
    print(f"  groups: {[len(g.ranks) for g in analysis.grouping.groups]}")
    print(f"  top suspect: {top.kind if top else None} ranks {len(top.ranks) if top else 0} "
          f"machines {top.machines[:3] if top else ()}...")
    naive = naive_grouping(stacks)
    print(f"  naive baseline finds {len(naive)} groups (line numbers ignored, wrappers kept)")

    full = timed(lambda: analyze_stacks(snap, layout), args.repeat)
    grouping = timed(lambda: group_stacks(stacks), args.repeat)
    base = timed(lambda: naive_grouping(stacks), args.repeat)

    tracemalloc.start()
    analyze_stacks(snap, layout)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()

    def fmt(xs: tuple[list[float], list[float]]) -> str:
        wall, cpu = xs
        return (f"wall median {statistics.median(wall) * 1e3:7.1f} ms (best {min(wall) * 1e3:6.1f}), "
                f"CPU median {statistics.median(cpu) * 1e3:7.1f} ms (best {min(cpu) * 1e3:6.1f})")

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"\n{WORLD} ranks, {args.repeat} runs each (load average {load:.1f} on {os.cpu_count()} CPUs):")
    print(f"  analyze_stacks (group + tree + suspects): {fmt(full)}")
    print(f"  group_stacks alone:                       {fmt(grouping)}")
    print(f"  naive dict-of-strings grouping:           {fmt(base)}")
    med = {name: statistics.median(xs[1]) for name, xs in (("full", full), ("group", grouping), ("naive", base))}
    print(f"  ratio (CPU) naive / group_stacks: {med['naive'] / med['group']:.2f}x; "
          f"naive / full analysis: {med['naive'] / med['full']:.2f}x")
    print(f"  peak memory of one analyze_stacks (tracemalloc): {peak / 2**20:.1f} MiB")
    goal = med["full"]
    print(f"  target < 1 s, goal 200 ms (CPU median): {'goal met' if goal < 0.2 else 'under 1 s' if goal < 1 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
