"""What the NCCL profiler plugin costs NCCL's threads, per call, beside a plugin that does nothing.

Run: python benchmarks/bench_plugin.py [--rounds 1000000] [--repeats 5] [--json]

Both libraries are driven through their dlsym'd ncclProfiler_v5 tables by the same C harness
(ccl_plugin/nccl/harness.c, `bench` mode), in NCCL's order: per round one collective started and stopped
by the host, then its kernel channel, one proxy op with one step (SendWait), their stops: 10 calls. The
no-op plugin (ccl_plugin/nccl/noop_profiler.c) is the baseline: what the call through a plugin table and
the harness's descriptor building cost by themselves. One thread, no contention; best of the repeats (noise
on a shared machine only ever adds time). Goal: under 200 ns a call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _build(tmp: Path) -> tuple[Path, Path, Path] | None:
    from rankscope.ccl_plugin.build import BuildError, build_plugin, find_compiler, source_dir
    try:
        lib = build_plugin(tmp / "lib")
    except BuildError as exc:
        print(f"NCCL plugin not built: {exc.message} ({exc.fix})", file=sys.stderr)
        return None
    cc = find_compiler()
    assert cc is not None
    src = source_dir()
    noop = tmp / "libnoop_profiler.so"
    subprocess.run([cc, "-O2", "-std=c11", "-fPIC", "-shared", "-fvisibility=hidden", "-I", str(src), "-o",
                    str(noop), str(src / "noop_profiler.c")], check=True)
    harness = tmp / "harness"
    subprocess.run([cc, "-O2", "-std=c11", "-I", str(src), "-o", str(harness), str(src / "harness.c"), "-ldl"],
                   check=True)
    return lib, noop, harness


def _ns_per_call(harness: Path, lib: Path, rounds: int, env: dict[str, str]) -> float:
    out = subprocess.run([str(harness), str(lib), "bench", str(rounds)], env=env, capture_output=True, text=True,
                         check=True).stdout
    return float(out.split()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=1_000_000, help="harness rounds (10 plugin calls each)")
    ap.add_argument("--repeats", type=int, default=5, help="interleaved runs of each library; the best is kept")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        built = _build(tmp)
        if built is None:
            return 1
        lib, noop, harness = built
        env = {**os.environ, "RANKSCOPE_CCL_DIR": str(tmp / "counters"), "RANKSCOPE_JOB_ID": "bench", "RANK": "0"}
        plugin_runs, noop_runs = [], []
        for _ in range(args.repeats):  # interleaved, so a burst of load hits both alike
            noop_runs.append(_ns_per_call(harness, noop, args.rounds, env))
            plugin_runs.append(_ns_per_call(harness, lib, args.rounds, env))
    plugin, base = min(plugin_runs), min(noop_runs)
    result = {"rounds": args.rounds, "repeats": args.repeats, "plugin_ns_per_call": plugin,
              "noop_ns_per_call": base, "added_ns_per_call": round(plugin - base, 1),
              "ratio": round(plugin / base, 2) if base > 0 else None}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'rankscope plugin, per call':30} {plugin:8.1f} ns   (goal < 200 ns)")
    print(f"{'no-op plugin (baseline)':30} {base:8.1f} ns")
    print(f"{'added by rankscope':30} {plugin - base:8.1f} ns   ratio {plugin / base:.2f}x" if base > 0 else "")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
