"""Finding a machine's ranks (``discover``), which every poll, capture and action plan runs, beside a base commit.

    python benchmarks/bench_discovery.py [--ranks 8] [--children 2] [--others 300] [--calls 20] [--runs 3]
                                         [--base-ref HEAD~1]

Starts a machine's worth of processes: ``--ranks`` ranks under one launcher (each a shell holding ``--children``
subprocesses, with torchrun's variables in their environment) and ``--others`` unrelated processes (a GPU node
runs hundreds: daemons, workers, shells). Then, alternating this checkout and ``--base-ref`` in fresh processes,
times ``--calls`` discoveries each (wall and CPU per call, median), checks both found the same ranks, and prints
the ratio base / new. Figures only: the host's load is printed beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from base_code import base_tree  # noqa: E402 (the benchmarks folder is not a package)
from bench_bundle import _child, _env  # noqa: E402 (the benchmarks folder is not a package)

_DISCOVER = """
import statistics, sys, time
from rankscope.probes.discovery import discover
launcher, calls = int(sys.argv[1]), int(sys.argv[2])
discover(launcher_pid=launcher)  # imports and first reads aside
walls, cpus = [], []
for _ in range(calls):
    t, c = time.perf_counter(), time.process_time()
    found = discover(launcher_pid=launcher)
    walls.append(time.perf_counter() - t)
    cpus.append(time.process_time() - c)
ranks = sorted((r.rank, len(r.subprocesses)) for r in found.ranks)
print(statistics.median(walls), statistics.median(cpus), ranks)
"""


def _start_machine(ranks: int, children: int, others: int) -> tuple[subprocess.Popen[bytes], list[subprocess.Popen[bytes]]]:
    """A launcher holding ``ranks`` ranks (a shell each, with ``children`` sleeping subprocesses), and others."""
    holders = " ".join(["sleep 600 &"] * children)
    ranks_code = (
        "import os, subprocess, sys\n"
        f"procs = [subprocess.Popen(['sh', '-c', '{holders} wait'], env=dict(os.environ, RANK=str(r), LOCAL_RANK=str(r),"
        f" WORLD_SIZE='{ranks}', TORCHELASTIC_RUN_ID='bench')) for r in range({ranks})]\n"
        "sys.stdout.write('ready\\n'); sys.stdout.flush()\n"
        "[p.wait() for p in procs]\n"
    )
    launcher = subprocess.Popen([sys.executable, "-c", ranks_code], stdout=subprocess.PIPE, start_new_session=True)
    assert launcher.stdout is not None
    launcher.stdout.readline()
    crowd = [subprocess.Popen(["sleep", "600"], start_new_session=True) for _ in range(others)]
    return launcher, crowd


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--children", type=int, default=2, help="subprocesses per rank (dataloader workers, writers)")
    ap.add_argument("--others", type=int, default=300, help="unrelated processes on the machine")
    ap.add_argument("--calls", type=int, default=20, help="discoveries per run")
    ap.add_argument("--runs", type=int, default=3, help="runs of each side, alternating")
    ap.add_argument("--base-ref", default="HEAD~1", help="the commit to compare with (default: HEAD~1)")
    args = ap.parse_args()
    launcher, crowd = _start_machine(args.ranks, args.children, args.others)
    try:
        sides = {"new": _env(None), "base": _env(base_tree(args.base_ref))}
        walls: dict[str, list[float]] = {s: [] for s in sides}
        cpus: dict[str, list[float]] = {s: [] for s in sides}
        found: dict[str, str] = {}
        for _ in range(args.runs):
            for side, env in sides.items():
                wall, cpu, ranks = _child(_DISCOVER, [str(launcher.pid), str(args.calls)], env)[2].split(" ", 2)
                walls[side].append(float(wall))
                cpus[side].append(float(cpu))
                found[side] = ranks.strip()
        processes = sum(1 for e in os.listdir("/proc") if e.isdigit())
        print(f"{args.ranks} ranks of {args.children} subprocesses among {processes} processes; base {args.base_ref}; "
              f"{args.runs} runs of {args.calls} calls each, alternating; {os.cpu_count()} CPUs, "
              f"load {os.getloadavg()[0]:.1f}")
        for side in sides:
            print(f"{side:<5} discover per call: wall median {statistics.median(walls[side]) * 1e3:6.1f} ms, "
                  f"CPU median {statistics.median(cpus[side]) * 1e3:6.1f} ms   found {found[side]}")
        print(f"base / new (medians): wall {statistics.median(walls['base']) / statistics.median(walls['new']):.2f}x, "
              f"CPU {statistics.median(cpus['base']) / statistics.median(cpus['new']):.2f}x; "
              f"same ranks found: {found['base'] == found['new']}")
        return 0 if found["base"] == found["new"] else 1
    finally:
        for proc in (*crowd, launcher):
            os.killpg(proc.pid, 9)
            proc.wait()


if __name__ == "__main__":
    sys.exit(main())
