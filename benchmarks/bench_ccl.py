"""What the CCL counters cost, side by side with no counters and with PyTorch's flight recorder.

Run: python benchmarks/bench_ccl.py [--steps 60] [--calls 20000] [--json]

1. Step time of a small real gloo job (2 ranks via torchrun; per step: an MLP
   forward/backward, one all_reduce per gradient, an all_gather, a broadcast
   and a barrier), run three times in one go: no counters (baseline), with the
   counters loaded by the .pth hook (as `rankscope run` does), and with the
   flight recorder on (TORCH_FR_BUFFER_SIZE=2000). Goal: under 2 % of step time.
2. Per-call cost of small all_reduce calls (world of 1, gloo): in one process
   with the hooks loaded, the wrapper and the original function in interleaved
   blocks (best block of each); the difference per call. Goal: under 3 µs.
3. The writer alone (launch + completion of one request) in this process.
4. The NCCL profiler plugin's cost per event, from its C harness. Goal: < 200 ns.
Best of repeats (noise on a shared machine only ever adds time); read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

STEP_JOB = r'''
import os, sys, time, json
import torch, torch.distributed as dist
dist.init_process_group("gloo")
steps = int(sys.argv[1]); out = sys.argv[2]
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(64, 256)
times = []
for step in range(steps + 5):
    t0 = time.perf_counter()
    model(x).sum().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    dist.all_gather_into_tensor(torch.empty(64 * dist.get_world_size()), torch.ones(64))
    dist.broadcast(torch.ones(64), 0)
    dist.barrier()
    opt.step(); opt.zero_grad()
    if step >= 5:
        times.append(time.perf_counter() - t0)
if dist.get_rank() == 0:
    open(out, "w").write(json.dumps(times))
dist.destroy_process_group()
'''

MICRO_JOB = r'''
import sys, time, tempfile, json
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
n = int(sys.argv[1]); t = torch.ones(1)
wrapped = dist.all_reduce
plain = getattr(wrapped, "__rankscope_original__", wrapped)
for _ in range(2000):
    wrapped(t); plain(t)
# interleaved blocks, best block of each: the machine is shared, noise only adds time
best = {"plain": float("inf"), "wrapped": float("inf")}
for _ in range(max(1, n // 1000)):
    for name, fn in (("plain", plain), ("wrapped", wrapped)):
        t0 = time.perf_counter()
        for _ in range(1000):
            fn(t)
        best[name] = min(best[name], (time.perf_counter() - t0) / 1000)
print(json.dumps({"plain_s": best["plain"], "wrapped_s": best["wrapped"],
                  "hooked": wrapped is not plain}))
dist.destroy_process_group()
'''


def _env(mode: str, counter_dir: Path) -> dict[str, str]:
    from rankscope.ccl_plugin.autoload import ccl_env
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANKSCOPE_", "TORCH_FR_", "TORCH_NCCL_TRACE"))}
    env["OMP_NUM_THREADS"] = "1"
    if mode == "counters":
        env.update(ccl_env(counter_dir, "bench"))
    elif mode == "flight_recorder":
        env["TORCH_FR_BUFFER_SIZE"] = "2000"
    return env


def step_times(mode: str, steps: int, tmp: Path) -> list[float]:
    script = tmp / "step_job.py"
    script.write_text(STEP_JOB)
    out = tmp / f"steps-{mode}.json"
    err = ""
    for _ in range(3):  # a rendezvous can fail on a loaded machine: try again, then say why
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(script), str(steps), str(out)], env=_env(mode, tmp / "c"),
                              capture_output=True, text=True, timeout=600, check=False)
        if proc.returncode == 0:
            return list(json.loads(out.read_text()))
        err = proc.stderr[-2000:]
    raise SystemExit(f"the {mode} step job failed three times:\n{err}")


def micro(mode: str, calls: int, tmp: Path) -> dict[str, float]:
    script = tmp / "micro_job.py"
    script.write_text(MICRO_JOB)
    proc = subprocess.run([sys.executable, str(script), str(calls)], env=_env(mode, tmp / "c"), check=True,
                          capture_output=True, text=True, timeout=600)
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def writer_cost(n: int, tmp: Path) -> float:
    """Best block of 1000 launch+complete pairs."""
    from rankscope.ccl_plugin.writer import CounterWriter
    w = CounterWriter(tmp / "w", rank=0, world_size=1, job_id="bench")
    s = w.slot(w.comm("0", "gloo", "", (0,)), "all_reduce")
    best = float("inf")
    for _ in range(max(1, n // 1000)):
        t0 = time.perf_counter()
        for _ in range(1000):
            w.complete(w.launch(s, 4))
        best = min(best, (time.perf_counter() - t0) / 1000)
    w.close()
    return best


def plugin_ns(tmp: Path) -> float | None:
    from rankscope.ccl_plugin.build import BuildError, build_plugin, find_compiler, source_dir
    cc = find_compiler()
    try:
        lib = build_plugin(tmp / "lib")
    except BuildError as exc:
        print(f"NCCL plugin not built: {exc.message}", file=sys.stderr)
        return None
    assert cc is not None
    exe = tmp / "harness"
    subprocess.run([cc, "-O2", "-std=c11", "-I", str(source_dir()), "-o", str(exe), str(source_dir() / "harness.c"),
                    "-ldl"], check=True)
    env = {**os.environ, "RANKSCOPE_CCL_DIR": str(tmp / "c"), "RANKSCOPE_JOB_ID": "bench"}
    runs = []
    for _ in range(5):
        out = subprocess.run([str(exe), str(lib), "bench", "300000"], env=env, capture_output=True, text=True,
                             check=True).stdout
        runs.append(float(out.split()[-1]))
    return min(runs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--calls", type=int, default=50000)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved runs of the three step-time modes")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from rankscope.ccl_plugin.autoload import install_pth
    install_pth()  # what `rankscope run` does on first use
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        modes = ("baseline", "counters", "flight_recorder")
        # rounds interleave the modes, so a burst of load on the shared machine
        # hits all three; each mode's figure is its best round's median
        rounds: dict[str, list[float]] = {m: [] for m in modes}
        for _ in range(args.rounds):
            for m in modes:
                rounds[m].append(statistics.median(step_times(m, args.steps, tmp)))
        med = {m: min(v) for m, v in rounds.items()}
        mic = micro("counters", args.calls, tmp)
        assert mic["hooked"], "the hooks did not load as expected"
        per_call_us = (mic["wrapped_s"] - mic["plain_s"]) * 1e6
        writer_us = writer_cost(100000, tmp) * 1e6
        ns = plugin_ns(tmp)
    result = {
        "step_median_ms": {m: round(v * 1e3, 3) for m, v in med.items()},
        "step_overhead_pct": {m: round((med[m] / med["baseline"] - 1) * 100, 2) for m in modes},
        "all_reduce_per_call_us": {"plain": round(mic["plain_s"] * 1e6, 2),
                                   "with_counters": round(mic["wrapped_s"] * 1e6, 2)},
        "hook_cost_per_call_us": round(per_call_us, 2),
        "writer_launch_plus_complete_us": round(writer_us, 2),
        "nccl_plugin_ns_per_event": None if ns is None else round(ns, 1),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{'drill-like step (2 ranks, gloo)':36} {'median ms':>10} {'vs baseline':>12}")
    for m in modes:
        print(f"  {m:34} {med[m] * 1e3:10.3f} {result['step_overhead_pct'][m]:+11.2f}%")
    print(f"{'small all_reduce (world 1)':36} {'µs/call':>10}")
    print(f"  {'plain (the original function)':34} {mic['plain_s'] * 1e6:10.2f}")
    print(f"  {'with counters (the wrapper)':34} {mic['wrapped_s'] * 1e6:10.2f}")
    print(f"  {'hook cost per call':34} {per_call_us:10.2f}   (goal < 3 µs)")
    print(f"  {'writer launch+complete alone':34} {writer_us:10.2f}")
    print(f"{'NCCL plugin per event (harness)':36} {'' if ns is None else f'{ns:10.1f} ns'}   (goal < 200 ns)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
