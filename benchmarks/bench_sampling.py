"""What sampling every rank's stacks costs the job: step time with the sampler on and off, side by side.

    python benchmarks/bench_sampling.py [--phase-s 40] [--pairs 3] [--rate 5]

Starts the drill's job the plain way (TP=2 PP=2 DP=2, 8 ranks over 2
torchrun nodes, no counters, no fault), then alternates phases of
``--phase-s`` seconds with the agent's sampler (``probes.sampler``: one
``py-spy record --nonblocking`` per rank, ``--rate`` Hz, 5 s windows, the
code the agent runs) off and on, ``--pairs`` times (off, on, off, on, …, so a
machine getting busier over the run weighs on both sides). Each phase's step
time is the job's own: rank 0's completed steps over the phase's wall time,
read from the drill's progress files. Prints every phase, the median step
time of each side, their ratio (the overhead), and the py-spy CPU seconds per
sampled second.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import psutil
from rankscope.drill.faults import DrillLayout, make_plan
from rankscope.drill.launcher import TrainingOptions
from rankscope.drill.progress import ProgressWatcher
from rankscope.drill.session import DrillConfig, DrillSession
from rankscope.probes.discovery import discover_ranks
from rankscope.probes.sampler import StackSampler


def step_time(watcher: ProgressWatcher, seconds: float) -> float:
    """Seconds per step of rank 0 over the next ``seconds``."""
    first = watcher.poll()[0]
    time.sleep(seconds)  # a measurement window, not a synchronisation
    last = watcher.poll()[0]
    return (last.wall - first.wall) / max(1, last.step - first.step)


def pyspy_cpu() -> float:
    """CPU seconds of the py-spy recorders: those this process waited for, and those still running.

    The drill's torchrun nodes and ranks are children of this process too, but
    they run until the end, so the finished children's times are py-spy's only.
    """
    me = psutil.Process()
    t = me.cpu_times()
    running = 0.0
    for c in me.children(recursive=True):
        try:
            if c.name() == "py-spy":
                ct = c.cpu_times()
                running += ct.user + ct.system
        except psutil.Error:
            continue
    return t.children_user + t.children_system + running


async def sampled_phase(pids: list[tuple[int, int]], rate: int, seconds: float, watcher: ProgressWatcher,
                        ) -> tuple[float, int]:
    from rankscope.snapshot import RankInfo

    sampler = StackSampler(lease_s=seconds + 5)
    ranks = [RankInfo(rank=r, local_rank=0, world_size=len(pids), pid=p) for r, p in pids]
    sampler.demand(ranks, rate)
    await asyncio.sleep(1.0)  # the recorders start before the measurement begins
    step = await asyncio.to_thread(step_time, watcher, seconds)
    windows = sampler.windows()
    await sampler.close()
    return step, sum(w.samples for w in windows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase-s", type=float, default=40.0)
    p.add_argument("--pairs", type=int, default=3)
    p.add_argument("--rate", type=int, default=5)
    args = p.parse_args()
    layout = DrillLayout(tp=2, pp=2, dp=2, machines=2)
    config = DrillConfig(layout=layout, plan=make_plan("none", layout, step=5), counters=False, agents=False,
                         training=TrainingOptions(steps=1_000_000, checkpoint_every=0, loader_workers=0))
    off: list[float] = []
    on: list[float] = []
    with DrillSession(config) as s:
        s.wait_for_steps(5, 300)
        watcher = ProgressWatcher(s.run_dir, layout.world)
        launchers = [n.proc.pid for n in s.launcher.nodes.values()]
        pids = sorted((r.rank, r.pid) for lp in launchers for r in discover_ranks(launcher_pid=lp))
        print(f"job: {len(pids)} ranks, load {psutil.getloadavg()[0]:.1f}; phases of {args.phase_s:g} s, "
              f"sampling at {args.rate} Hz", flush=True)
        cpu_sampling = 0.0
        sampled_s = 0.0
        for i in range(args.pairs):
            t = step_time(watcher, args.phase_s)
            off.append(t)
            print(f"pair {i}: off {1000 * t:7.1f} ms/step", flush=True)
            before = pyspy_cpu()
            t, samples = asyncio.run(sampled_phase(pids, args.rate, args.phase_s, watcher))
            cpu_sampling += pyspy_cpu() - before
            sampled_s += args.phase_s + 1.0
            on.append(t)
            print(f"pair {i}: on  {1000 * t:7.1f} ms/step ({samples} samples in its windows)", flush=True)
    m_off, m_on = statistics.median(off), statistics.median(on)
    print(f"median step time: sampling off {1000 * m_off:.1f} ms, on {1000 * m_on:.1f} ms; "
          f"ratio on/off {m_on / m_off:.3f} ({100 * (m_on / m_off - 1):+.1f} %); "
          f"per pair: {', '.join(f'{b / a:.3f}' for a, b in zip(off, on, strict=True))}")
    print(f"py-spy CPU: {cpu_sampling:.2f} s over {sampled_s:.0f} s sampled "
          f"({100 * cpu_sampling / sampled_s:.1f} % of one core for {len(pids)} ranks); load now "
          f"{psutil.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
