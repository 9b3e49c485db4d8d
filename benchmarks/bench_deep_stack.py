"""How long the analysis takes, and how much memory, for stacks thousands of frames deep.

Four ranks on two machines parked under the same ``depth`` frames (a
recursive model, deep autograd, generated code), one of them in another
innermost frame: ``analyze_job`` (what ``rankscope analyze`` and the TUI run)
groups them and builds the prefix tree, a chain ``depth`` nodes long. Prints
seconds and the Python heap's peak (tracemalloc, a second untimed run) per depth; the goal is a
10,000-frame stack in under 1 s. ``--ref REF`` runs the same depths with the
analyzers of another git ref in a subprocess, side by side (a RecursionError
there is printed as such).

    .venv/bin/python benchmarks/bench_deep_stack.py [--depths 600,10000,20000] [--ref main]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

GOAL_S = 1.0


def deep_snapshot(depth: int) -> object:
    from rankscope.contract.snapshot import (
        Frame,
        Instant,
        JobSnapshot,
        MachineSnapshot,
        ProcessRole,
        ProcessStack,
        RankInfo,
        RankStacks,
        ThreadStack,
    )

    machines = []
    for m in range(2):
        ranks, stacks = [], []
        for r in (2 * m, 2 * m + 1):
            outer = tuple(Frame(f"layer{i}", "model.py", i, None) for i in range(depth))
            inner = Frame("sleep" if r == 3 else "wait", "dist.py", 1, None)
            stacks.append(RankStacks(r, ProcessStack(100 + r, ProcessRole.MAIN,
                                                     (ThreadStack(1, (inner, *reversed(outer)), "Main"),))))
            ranks.append(RankInfo(rank=r, local_rank=r % 2, world_size=4, pid=100 + r))
        machines.append(MachineSnapshot(f"m{m}", "x", True, Instant(1.0, 2.0), ranks=tuple(ranks),
                                        stacks=tuple(stacks)))
    return JobSnapshot(Instant(1.0, 2.0), tuple(machines), job_id="deep")


def measure(depth: int) -> dict[str, object]:
    from rankscope.analyzers.analysis import analyze_job

    snapshot = deep_snapshot(depth)
    started = time.perf_counter()
    try:
        analyze_job(snapshot)  # type: ignore[arg-type]
    except RecursionError:
        return {"depth": depth, "seconds": None, "peak_mb": None, "error": "RecursionError"}
    seconds = time.perf_counter() - started
    tracemalloc.start()  # a second run for the memory: tracing slows every allocation, so it is not timed
    analyze_job(snapshot)  # type: ignore[arg-type]
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"depth": depth, "seconds": seconds, "peak_mb": peak / 2**20, "error": None}


def show(label: str, row: dict[str, object]) -> None:
    if row["error"]:
        print(f"[{label}] {row['depth']:>6} frames: {row['error']}")
        return
    seconds = float(row["seconds"])  # type: ignore[arg-type]
    goal = f" ({'within' if seconds < GOAL_S else 'OVER'} the {GOAL_S:g} s goal)" if row["depth"] == 10_000 else ""
    print(f"[{label}] {row['depth']:>6} frames: {seconds:.3f} s, heap peak {row['peak_mb']:.0f} MB{goal}")


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        print(json.dumps(measure(int(sys.argv[2]))))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--depths", default="600,10000,20000")
    p.add_argument("--ref", help="also measure the analyzers of this git ref (e.g. main)")
    args = p.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    if args.ref:
        sys.path.insert(0, str(Path(__file__).parent))
        from base_code import base_tree

        env = dict(os.environ, PYTHONPATH=str(base_tree(args.ref)))
        for depth in depths:
            done = subprocess.run([sys.executable, __file__, "--one", str(depth)], capture_output=True, text=True,
                                  env=env, timeout=600, check=False)
            lines = done.stdout.strip().splitlines()
            row = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "depth": depth, "error": f"exit {done.returncode}: {done.stderr.strip().splitlines()[-1:]}"}
            show(args.ref, row)
    for depth in depths:
        show("this checkout", measure(depth))


if __name__ == "__main__":
    main()
