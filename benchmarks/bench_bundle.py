"""Opening a large bundle and `rankscope analyze` on it, beside another commit's code, run for run.

    python benchmarks/bench_fanout.py --sizes 2048 --base-max 0 --bundle --keep-bundle   # writes the bundle
    python benchmarks/bench_bundle.py /tmp/bench-fanout-new-2048.json [--base-ref HEAD~3] [--runs 5]

Each run is a fresh process (a user's command: imports, reading, analysis,
printing, exit), alternating this checkout and the code at ``--base-ref``
(``git archive`` of it, unpacked once into the temp folder, put first on
``sys.path`` with its subpackages inside it, as the install maps them), so load on this machine weighs on both alike. Prints, per
side: the open alone (``read_bundle`` in-process CPU, imports excluded), writing
it again (``write_bundle``, version 4, in-process CPU) and
the whole ``rankscope analyze BUNDLE`` command (CPU of the child and wall),
min and median of ``--runs``, and the ratio of the medians; then whether
both sides give the same verdict (``--json``: summary, suspects, findings,
groups, notes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from base_code import base_tree  # noqa: E402 (the benchmarks folder is not a package)

# Run in the child: time read_bundle alone, after the imports it needs, then writing what it read again
# (version 4, to a temporary file): what the TUI's `w` and `snapshot -o` cost.
_OPEN_WRITE = """
import os, sys, tempfile, time
from rankscope.contract.bundle import read_bundle, write_bundle
try:
    from rankscope.contract.heap import collector_paused
except ImportError:  # a base from before it had the pause in the bundle module
    from rankscope.contract.bundle import no_cyclic_gc as collector_paused
with collector_paused():
    t = time.process_time()
    b = read_bundle(sys.argv[1])
    opened = time.process_time() - t
    with tempfile.TemporaryDirectory() as d:
        t = time.process_time()
        write_bundle(b, os.path.join(d, "b.json"))
        written = time.process_time() - t
print(opened, written)
"""
# The console script's body, so the base side runs its own main() from its own tree.
_ANALYZE = "import sys\nfrom rankscope.cli.main import main\nsys.exit(main(sys.argv[1:]))\n"


def _env(pkg: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a user's install has its bytecode compiled; compile once, not per run
    if pkg is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(pkg), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _child(code: str, argv: list[str], env: dict[str, str]) -> tuple[float, float, str]:
    """(child CPU s, wall s, stdout) of ``python -c code argv``."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}")
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, wall, proc.stdout


def _stats(values: list[float]) -> str:
    return f"min {min(values):5.2f}  median {statistics.median(values):5.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("bundle", type=Path)
    ap.add_argument("--base-ref", default="HEAD~1", help="the commit to compare with (default: HEAD~1)")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    if not args.bundle.is_file():
        raise SystemExit(f"{args.bundle}: no such file (write one with bench_fanout.py --bundle --keep-bundle)")
    sides = {"new": _env(None), "base": _env(base_tree(args.base_ref))}
    for env in sides.values():  # warm: bytecode written, file in the page cache
        _child(_ANALYZE, ["analyze", str(args.bundle)], env)
    opened: dict[str, list[float]] = {s: [] for s in sides}
    written: dict[str, list[float]] = {s: [] for s in sides}
    cpu: dict[str, list[float]] = {s: [] for s in sides}
    wall: dict[str, list[float]] = {s: [] for s in sides}
    for _ in range(args.runs):
        for side, env in sides.items():
            o, w = map(float, _child(_OPEN_WRITE, [str(args.bundle)], env)[2].split())
            opened[side].append(o)
            written[side].append(w)
            c, w, _ = _child(_ANALYZE, ["analyze", str(args.bundle)], env)
            cpu[side].append(c)
            wall[side].append(w)
    print(f"bundle {args.bundle} ({args.bundle.stat().st_size / 1e6:.0f} MB); base {args.base_ref}; "
          f"{args.runs} runs each, alternating; {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    for side in sides:
        print(f"{side:<5} open cpu {_stats(opened[side])}   write cpu {_stats(written[side])}   analyze cpu {_stats(cpu[side])}   "
              f"wall {_stats(wall[side])}")
    keys = ("summary", "suspects", "findings", "groups", "notes")
    verdicts = [{k: v for k, v in json.loads(_child(_ANALYZE, ["analyze", "--json", str(args.bundle)], env)[2]).items()
                 if k in keys} for env in sides.values()]
    ratio = statistics.median(cpu["base"]) / statistics.median(cpu["new"])
    open_ratio = statistics.median(opened["base"]) / statistics.median(opened["new"])
    write_ratio = statistics.median(written["base"]) / statistics.median(written["new"])
    print(f"base / new (medians): open {open_ratio:.2f}x, write {write_ratio:.2f}x, analyze {ratio:.2f}x; "
          f"same verdict (--json): {'yes' if verdicts[0] == verdicts[1] else 'NO'}")
    print(json.dumps({"open_cpu_s": opened, "write_cpu_s": written, "analyze_cpu_s": cpu, "analyze_wall_s": wall}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
