"""Capture all ranks of a 16-rank drill through the agents, beside the loop an engineer would type.

    python benchmarks/bench_capture.py [--tp 2 --pp 2 --dp 4 --machines 4] [--repeat 3]

Starts a real drill (TP=2, PP=2, DP=4 over 4 local machines by default), lets
a hang-p2p fault stop it so every rank holds still, then times, in the same
run and on the same hung job:

- ``agents``: one ``JobClient.capture`` through the drill's agents (all
  machines at once; every rank plus its dataloader worker and checkpoint
  writer);
- ``agents, ranks only``: the same without subprocesses;
- ``loop``: ``for pid in <rank pids>; do py-spy dump --pid $pid; done`` in
  bash, the sequential loop an engineer would type;
- ``loop, all pids``: the same loop over every pid the agents captured.

Prints the median of ``--repeat`` runs of each, and the ratios loop / agents.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rankscope.contract.snapshot import JobSnapshot
from rankscope.drill.faults import DrillLayout, make_plan
from rankscope.drill.launcher import TrainingOptions
from rankscope.drill.session import DrillConfig, DrillSession


def timed(fn: Callable[[], object], repeat: int) -> tuple[float, object]:
    times = []
    result: object = None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def stacks_of(snap: JobSnapshot) -> tuple[int, int]:
    """(ranks with a main-thread stack, processes with stacks) in a snapshot."""
    ranks = sum(1 for rs in snap.all_stacks().values() if rs.main.threads)
    procs = sum(1 for rs in snap.all_stacks().values() for p in (rs.main, *rs.subprocesses) if p.threads)
    return ranks, procs


def bash_loop(pids: list[int], py_spy: str) -> Callable[[], object]:
    script = f'for pid in {" ".join(map(str, pids))}; do {py_spy} dump --pid $pid > /dev/null; done'

    def run() -> object:
        return subprocess.run(["bash", "-c", script], check=False, capture_output=True)

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--machines", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--run-dir", type=Path)
    args = ap.parse_args()

    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    layout = DrillLayout(tp=args.tp, pp=args.pp, dp=args.dp, machines=args.machines)
    plan = make_plan("hang-p2p", layout, rank=layout.world - 1, step=3)
    config = DrillConfig(layout=layout, plan=plan, training=TrainingOptions(steps=30), run_dir=args.run_dir,
                         stall_seconds=3.0, start_timeout_s=300)
    print(f"starting a {layout.world}-rank drill (tp {layout.tp} x pp {layout.pp} x dp {layout.dp}) "
          f"on {layout.machines} machines ...", file=sys.stderr, flush=True)
    with DrillSession(config) as s:
        s.wait_for_steps(1, config.start_timeout_s)
        stall = s.wait_until_stalled()
        if stall.reason != "stalled" or not s.agents:
            print(f"drill did not reach a steady hang ({stall.reason}; agents {s.agents}); notes: {s.notes}",
                  file=sys.stderr)
            return 1
        from rankscope.wire.client import capture_once

        agents, token = list(s.agents.values()), s.token()
        capture_once(agents, token)  # warm: the first call also opens the channels
        t_agents, snap = timed(lambda: capture_once(agents, token), args.repeat)
        t_agents_ranks, snap_ranks = timed(lambda: capture_once(agents, token, subprocesses=False), args.repeat)
        assert isinstance(snap, JobSnapshot) and isinstance(snap_ranks, JobSnapshot)
        rank_pids = [p for _, p in sorted(s.watcher.pids().items())]
        all_pids = [p.pid for rs in snap.all_stacks().values() for p in (rs.main, *rs.subprocesses)]
        t_loop, _ = timed(bash_loop(rank_pids, py_spy), args.repeat)
        t_loop_all, _ = timed(bash_loop(all_pids, py_spy), args.repeat)

    ranks, procs = stacks_of(snap)
    ranks_only, _ = stacks_of(snap_ranks)
    print(f"drill: {layout.world} ranks on {layout.machines} machines, hung by hang-p2p; median of {args.repeat} runs")
    print(f"  agents (ranks + subprocesses): {t_agents:7.3f} s  ({ranks} ranks, {procs} processes with stacks)")
    print(f"  agents (ranks only):           {t_agents_ranks:7.3f} s  ({ranks_only} ranks with stacks)")
    print(f"  sequential py-spy loop, ranks: {t_loop:7.3f} s  ({len(rank_pids)} pids)")
    print(f"  sequential py-spy loop, all:   {t_loop_all:7.3f} s  ({len(all_pids)} pids)")
    print(f"  ratio loop/agents, ranks only:      {t_loop / t_agents_ranks:5.2f}x")
    print(f"  ratio loop/agents, same processes:  {t_loop_all / t_agents:5.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
