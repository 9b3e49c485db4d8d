"""What sampling every rank's stacks costs the job: step time with the sampler on and off, side by side.

    python benchmarks/bench_sampling.py [--phase-s 20] [--pairs 4] [--rate 5] [--window-s 5] [--steady-window-s 10]

Starts the drill's job the plain way (TP=2 PP=2 DP=2, 8 ranks over 2
torchrun nodes, no counters, no fault), then alternates phases of
``--phase-s`` seconds with the agent's sampler (``probes.sampler``: one
``py-spy record --nonblocking`` per rank, ``--rate`` Hz, ``--window-s``
windows, the code the agent runs) off and on, in ABBA order (off on on off,
off on on off, ...: a load that drifts linearly over a block weighs the
same on both sides). Each phase's step time is the job's own: rank 0's
completed steps over the phase's wall time, read from the drill's progress
files.

Two figures, because on a shared machine the first is noise-bound:
- the step-time ratio on/off (medians, and per ABBA block), with the load
  average of each phase;
- the CPU the recorders took against the CPU the ranks took meanwhile. The
  sampler never pauses a rank (non-blocking reads), so its only cost to the
  job is CPU it takes from it: on a machine where the ranks compete for
  cores (this one: 8 ranks on 2) the step time grows by at most that share;
  on a node with a core to spare per rank, by less.
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
from rankscope.probes.sampler import DEFAULT_WINDOW_S, STEADY_WINDOW_S, StackSampler


def ranks_cpu(pids: list[tuple[int, int]]) -> float:
    """CPU seconds the ranks' processes have used so far."""
    total = 0.0
    for _, pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        total += t.user + t.system
    return total


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
                        window_s: int, steady_window_s: int) -> tuple[float, int]:
    from rankscope.contract.snapshot import RankInfo

    sampler = StackSampler(window_s=window_s, lease_s=seconds + 5, steady_window_s=steady_window_s)
    ranks = [RankInfo(rank=r, local_rank=0, world_size=len(pids), pid=p) for r, p in pids]
    sampler.demand(ranks, rate)
    await asyncio.sleep(1.0)  # the recorders start before the measurement begins
    step = await asyncio.to_thread(step_time, watcher, seconds)
    windows = sampler.windows()
    await sampler.close()
    return step, sum(w.samples for w in windows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase-s", type=float, default=20.0)
    p.add_argument("--pairs", type=int, default=4, help="off/on pairs (even: whole ABBA blocks)")
    p.add_argument("--rate", type=int, default=5)
    p.add_argument("--window-s", type=int, default=DEFAULT_WINDOW_S, help="seconds of a rank's first py-spy recording")
    p.add_argument("--steady-window-s", type=int, default=STEADY_WINDOW_S, help="seconds of each recording after it")
    args = p.parse_args()
    layout = DrillLayout(tp=2, pp=2, dp=2, machines=2)
    config = DrillConfig(layout=layout, plan=make_plan("none", layout, step=5), counters=False, agents=False,
                         training=TrainingOptions(steps=1_000_000, checkpoint_every=0, loader_workers=0))
    phases: list[tuple[bool, float, float]] = []  # (sampling on, s/step, load average at its end)
    with DrillSession(config) as s:
        s.wait_for_steps(5, 300)
        watcher = ProgressWatcher(s.run_dir, layout.world)
        launchers = [n.proc.pid for n in s.launcher.nodes.values()]
        pids = sorted((r.rank, r.pid) for lp in launchers for r in discover_ranks(launcher_pid=lp))
        print(f"job: {len(pids)} ranks on {psutil.cpu_count()} cores, load {psutil.getloadavg()[0]:.1f}; phases of "
              f"{args.phase_s:g} s, sampling at {args.rate} Hz in windows of {args.window_s} s, then {args.steady_window_s} s", flush=True)
        cpu_sampling = cpu_ranks_on = 0.0
        sampled_s = 0.0
        order = [on for i in range(args.pairs) for on in ((False, True) if i % 2 == 0 else (True, False))]
        for on in order:
            if on:
                before, ranks_before = pyspy_cpu(), ranks_cpu(pids)
                t, samples = asyncio.run(sampled_phase(pids, args.rate, args.phase_s, watcher, args.window_s,
                                                       args.steady_window_s))
                cpu_sampling += pyspy_cpu() - before
                cpu_ranks_on += ranks_cpu(pids) - ranks_before
                sampled_s += args.phase_s + 1.0
                note = f" ({samples} samples in its windows)"
            else:
                t, note = step_time(watcher, args.phase_s), ""
            phases.append((on, t, psutil.getloadavg()[0]))
            print(f"{'on ' if on else 'off'} {1000 * t:7.1f} ms/step, load {phases[-1][2]:.0f}{note}", flush=True)
    off = [t for on, t, _ in phases if not on]
    on_ = [t for on, t, _ in phases if on]
    blocks = [phases[i:i + 4] for i in range(0, len(phases) - 3, 4)]
    per_block = [sum(t for o, t, _ in b if o) / sum(t for o, t, _ in b if not o) for b in blocks]
    m_off, m_on = statistics.median(off), statistics.median(on_)
    loads = [ld for _, _, ld in phases]
    print(f"median step time: sampling off {1000 * m_off:.1f} ms, on {1000 * m_on:.1f} ms; "
          f"ratio on/off {m_on / m_off:.3f} ({100 * (m_on / m_off - 1):+.1f} %); per ABBA block: "
          f"{', '.join(f'{r:.3f}' for r in per_block) or '-'}; load {min(loads):.0f}-{max(loads):.0f}")
    print(f"py-spy CPU: {cpu_sampling:.2f} s over {sampled_s:.0f} s sampled "
          f"({100 * cpu_sampling / sampled_s:.1f} % of one core for {len(pids)} ranks, "
          f"{1000 * cpu_sampling / sampled_s / len(pids):.1f} ms per rank per second); the ranks used "
          f"{cpu_ranks_on:.1f} CPU-s meanwhile: sampling took {100 * cpu_sampling / (cpu_sampling + cpu_ranks_on):.2f} % "
          f"of the CPU the job and its sampling got")
    return 0


if __name__ == "__main__":
    sys.exit(main())
