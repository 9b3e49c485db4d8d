"""The CCL shim's (and NCCL profiler plugin's) cost per collective, beside a plain run, on gloo or NCCL.

Run: python benchmarks/bench_shim.py [--backend gloo|nccl] [--world 1|2] [--calls 2000] [--rounds 3]
                                     [--block 20] [--paths native,python] [--plugin] [--repeats N] [--base-ref REF] [--json]

The one measurement of the shim's cost per call. Each rank (started by
torchrun) times ``--rounds`` times ``--calls`` small all_reduce calls (1024
floats), synchronous and async (``async_op=True`` then ``wait()``), through
the original function (plain) and through the shim's wrapper, in short
interleaved blocks of ``--block`` calls; the best block per figure (noise on a
shared machine only ever adds time, and a short block has a chance to run
without being preempted). Both wait through torch's own ``Work.wait`` (the shim leaves
it alone: an async Work's completion is the background thread's poll). The
counter files live in /dev/shm, as in production (a file on disk would add
page-writeback faults to the stores).
Each figure is given twice: wall time per call, and CPU time of the calling
thread per call (what the training thread itself spends; on a machine shared
with other work, wall time also holds the waits for a core). On NCCL the
blocks synchronise the device every 100 calls and at their end, so the host
never runs far ahead and the figure is what a step pays, the device's own time
included. The counter writer alone (one launch and its completion, no torch)
is timed in the same process.

The shim has two paths: the native fast path (a C wrapper, built at first
use) and the Python one it falls back to (``RANKSCOPE_CCL_NATIVE=0``, or no
compiler). ``--paths`` runs the job once per path (both by default), each
beside its own plain figures, and prints them side by side.

After the timing the shim's counter file must settle: WC catches up with WR
once the device is idle (the proof that completion is learned off the
device, not at return), and the bench says so.

``--repeats N`` (without ``--base-ref``): the whole side-by-side N times,
each run's figures, then the min and median of the extra µs and the ratio per
path (the machine may be loaded by other work: one run is one sample).

``--base-ref REF``: the same job alternately with this checkout's shim and
with the shim at ``REF`` (its trees unpacked and put first on the ranks'
path), ``--repeats`` times each, so a change's effect shows beside the noise
of a shared machine (each run's figures, then the medians).

``--plugin`` (NCCL, world >= 2: NCCL takes a shortcut with one rank and calls
no plugin): the job runs twice, without and with ``NCCL_PROFILER_PLUGIN``
(built from ccl_plugin/nccl), and the plugin's cost is the difference of the
plain figures of the two runs. Each run reports how many collectives it made
and whether every rank exited cleanly. Step time of a small job with and
without the counters (and with PyTorch's flight recorder): bench_ccl.py, which
takes its per-call figure from here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARK = "BENCH_SHIM "


# ---- the rank side ---------------------------------------------------------------


def _worker(args: argparse.Namespace) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    import torch
    import torch.distributed as dist

    if args.backend == "nccl":
        from rankscope.drill import gpu

        gpus = torch.cuda.device_count()
        os.environ.update(gpu.not_set(os.environ, gpu.nccl_rank_env(rank, world, gpus, "bench-shim")))
        torch.cuda.set_device(gpu.rank_device(rank, gpus))
        dev = torch.device("cuda", torch.cuda.current_device())
        dist.init_process_group("nccl", device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo")
    from rankscope.ccl_plugin import completion, hook_state, torch_hooks, wrappers

    if not torch_hooks.install(Path(args.counter_dir), "bench-shim"):
        raise SystemExit("the shim did not install")
    fast = hook_state.STATE.fast
    c10d = sys.modules["torch.distributed.distributed_c10d"]
    shim = c10d.all_reduce
    plain = shim.__rankscope_original__

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    x = torch.ones(1024, device=dev)
    made = 0

    def block(fn: Any, is_async: bool, n: int) -> tuple[float, float]:
        """(wall, calling thread's CPU) seconds per call."""
        nonlocal made
        sync()
        c0, t0 = time.thread_time(), time.perf_counter()
        for i in range(n):
            if is_async:
                fn(x, async_op=True).wait()
            else:
                fn(x)
            if dev.type == "cuda" and i % 100 == 99:
                torch.cuda.synchronize()
        sync()
        t1, c1 = time.perf_counter(), time.thread_time()
        made += n
        return (t1 - t0) / n, (c1 - c0) / n

    for fn in (plain, shim):  # warm-up: communicators, caches, the shim's first-call set-up
        block(fn, False, 50)
        block(fn, True, 50)
    best: dict[str, float] = {}
    best_cpu: dict[str, float] = {}
    order = [("plain", plain), ("shim", shim)]
    size = max(1, min(args.block, args.calls))
    for r in range(args.rounds):
        for variant, is_async in (("sync", False), ("async", True)):
            for j in range(max(1, args.calls // size)):  # short blocks, plain and shim in turn
                for name, fn in order if (r + j) % 2 == 0 else order[::-1]:
                    key = f"{variant}_{name}"
                    wall, cpu = block(fn, is_async, size)
                    best[key] = min(best.get(key, float("inf")), wall)
                    best_cpu[key] = min(best_cpu.get(key, float("inf")), cpu)
    writer_s = writer_cost(Path(args.counter_dir) / "writer-alone", args.calls, args.rounds, fast)
    wrapper_us = wrapper_cost(wrappers, completion, x, args.calls, args.rounds)
    # the counters must settle once the device is idle: WC = WR, learned by the shim's poller
    from rankscope.probes.ccl_counters import read_counter_file

    writer = hook_state.STATE.writer
    settled, counts = False, (0, 0, 0)
    deadline = time.monotonic() + 10.0
    while writer is not None and time.monotonic() < deadline:
        ops = [o for o in read_counter_file(writer.path).counters.ops if o.op == "all_reduce"]
        counts = (sum(o.cl for o in ops), sum(o.wr for o in ops), sum(o.wc for o in ops))
        if counts[1] == counts[2]:
            settled = True
            break
        time.sleep(0.02)
    dist.barrier()
    result = {"rank": rank, "us_per_call": {k: round(v * 1e6, 3) for k, v in best.items()},
              "cpu_us_per_call": {k: round(v * 1e6, 3) for k, v in best_cpu.items()},
              "writer_us": round(writer_s * 1e6, 3), "wrapper_us": wrapper_us, "collectives": made, "shim_source": torch_hooks.__file__,
              "path": "native" if fast is not None else "python",
              "shim_counts": {"cl": counts[0], "wr": counts[1], "wc": counts[2]}, "settled": settled,
              "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
              "torch": torch.__version__}
    print(MARK + json.dumps(result), flush=True)
    dist.destroy_process_group()
    return 0


class _DoneWork:
    """What a finished async call returns, as the shim reads it."""

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        return True


def _no_op(tensor: Any, op: Any = None, group: Any = None, async_op: bool = False) -> Any:
    """all_reduce's signature, no collective: what is left of a call is the wrapper's own work."""
    return _DoneWork() if async_op else None


def wrapper_cost(wrappers: Any, completion: Any, x: Any, calls: int, rounds: int) -> dict[str, float]:
    """The shim's wrapper around a function that does nothing, beside that function: its own extra µs per call,
    sync and async (best of short interleaved blocks; no collective's noise in the difference). Counted on the
    job's default group, as a real call is."""
    wrapped = wrappers.make_wrapper("all_reduce", _no_op)
    best: dict[str, float] = {}
    for _ in range(max(1, rounds)):
        for variant, is_async in (("sync", False), ("async", True)):
            for j in range(max(1, calls // 20)):
                for name, fn in (("plain", _no_op), ("shim", wrapped)) if j % 2 == 0 else (("shim", wrapped),
                                                                                            ("plain", _no_op)):
                    t0 = time.perf_counter()
                    for _ in range(20):
                        fn(x, async_op=is_async)
                    key = f"{variant}_{name}"
                    best[key] = min(best.get(key, float("inf")), (time.perf_counter() - t0) / 20)
            completion.poll()  # the background poll's work, off the timed blocks
    return {v: round((best[f"{v}_shim"] - best[f"{v}_plain"]) * 1e6, 3) for v in ("sync", "async")}


def writer_cost(directory: Path, calls: int, rounds: int, fast: Any = None) -> float:
    """The counter writer alone: best block's seconds per launch + completion of one request."""
    from rankscope.ccl_plugin.writer import CounterWriter

    w = CounterWriter(directory, rank=0, world_size=1, job_id="bench-writer", fast=fast)
    try:
        s = w.slot(w.comm("0", "gloo", "", (0,)), "all_reduce")
        best = float("inf")
        for _ in range(max(1, rounds)):
            t0 = time.perf_counter()
            for _ in range(calls):
                w.complete(w.launch(s, 4096))
            best = min(best, (time.perf_counter() - t0) / calls)
        return best
    finally:
        w.close()


# ---- the launching side -----------------------------------------------------------


def run_session(code_or_args: list[str], env: dict[str, str], timeout_s: float) -> tuple[int | None, str]:
    """A Python child in a session of its own; (exit code or None on timeout, its output).

    On timeout the whole session gets SIGINT (the drill stops what it started), then SIGKILL: nothing it
    started outlives the part.
    """
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, *code_or_args], env=env, stdout=out, stderr=subprocess.STDOUT,
                                text=True, cwd=str(ROOT), start_new_session=True)
        code: int | None
        try:
            code = proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            code = None
            for sig, grace in ((signal.SIGINT, 20.0), (signal.SIGKILL, 10.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, sig)
                try:
                    proc.wait(timeout=grace)
                    break
                except subprocess.TimeoutExpired:
                    continue
        out.seek(0)
        return code, out.read()


def run_job(backend: str, world: int, calls: int, rounds: int, plugin: Path | None, tmp: Path,
            timeout_s: float = 300.0, base: Path | None = None, path: str = "native", block: int = 20) -> dict[str, Any]:
    """One torchrun of the worker; every rank's figures, the exit code and whether every rank reported.

    ``base``: a folder whose ``rankscope`` the ranks import instead of this checkout's. ``path``: the shim's
    native fast path or its Python one.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANKSCOPE_", "NCCL_PROFILER"))}
    env["OMP_NUM_THREADS"] = "1"
    env["RANKSCOPE_CCL_NATIVE"] = "0" if path == "python" else "1"
    if base is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(base), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if plugin is not None:
        env["NCCL_PROFILER_PLUGIN"] = str(plugin)
        env["RANKSCOPE_CCL_DIR"] = str(tmp / "plugin-counters")
        env["RANKSCOPE_JOB_ID"] = "bench-plugin"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(world),
           str(Path(__file__).resolve()), "--worker", "--backend", backend, "--calls", str(calls),
           "--rounds", str(rounds), "--block", str(block), "--counter-dir", str(tmp / "shim-counters")]
    code, out = run_session(cmd[1:], env, timeout_s)
    ranks = [json.loads(ln[len(MARK):]) for ln in out.splitlines() if ln.startswith(MARK)]
    return {"exit_code": code, "ranks": sorted(ranks, key=lambda r: r["rank"]), "all_ranks_reported": len(ranks) == world,
            "tail": "" if code == 0 and len(ranks) == world else out[-3000:]}


def summarize(job: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's figures, the shim's extra µs per call and its ratio to plain, per variant."""
    if not job["ranks"]:
        return {"error": f"no rank reported (exit code {job['exit_code']})", "tail": job["tail"]}
    r0 = job["ranks"][0]
    us = r0["us_per_call"]
    cpu = r0.get("cpu_us_per_call", {})
    out: dict[str, Any] = {"us_per_call": us, "cpu_us_per_call": cpu, "writer_us": r0.get("writer_us"),
                           "wrapper_us": r0.get("wrapper_us"),
                           "device": r0["device"], "torch": r0["torch"], "shim_source": r0.get("shim_source"),
                           "collectives_per_rank": r0["collectives"], "exit_code": job["exit_code"],
                           "all_ranks_reported": job["all_ranks_reported"],
                           "counters_settled": all(r["settled"] for r in job["ranks"]),
                           "shim_counts": r0["shim_counts"], "path": r0.get("path", "python")}
    for variant in ("sync", "async"):
        p, s = us.get(f"{variant}_plain"), us.get(f"{variant}_shim")
        if p and s:
            out[f"{variant}_shim_extra_us"] = round(s - p, 3)
            out[f"{variant}_shim_ratio"] = round(s / p, 4)
        p, s = cpu.get(f"{variant}_plain"), cpu.get(f"{variant}_shim")
        if p and s:
            out[f"{variant}_shim_extra_cpu_us"] = round(s - p, 3)
    return out


PATHS = ("native", "python")
# result key of each path's run: "shim" is the path production loads where it builds
PATH_KEYS = {"native": "shim", "python": "python_shim"}


def bench(backend: str, world: int, calls: int, rounds: int, with_plugin: bool, tmp: Path,
          paths: tuple[str, ...] = PATHS, block: int = 20) -> dict[str, Any]:
    result: dict[str, Any] = {"backend": backend, "world": world, "calls_per_block": calls, "rounds": rounds,
                              "block": block}
    for path in paths:
        result[PATH_KEYS[path]] = summarize(run_job(backend, world, calls, rounds, None, tmp, path=path, block=block))
    if with_plugin:
        sys.path.insert(0, str(ROOT))
        from rankscope.ccl_plugin.build import BuildError, build_plugin

        try:
            lib = build_plugin(tmp / "lib")
        except BuildError as exc:
            result["plugin"] = {"error": f"{exc.message} ({exc.fix})"}
            return result
        with_lib = summarize(run_job(backend, world, calls, rounds, lib, tmp, block=block))
        result["plugin"] = with_lib
        p0 = result["shim"].get("us_per_call", {}).get("sync_plain")
        p1 = with_lib.get("us_per_call", {}).get("sync_plain")
        if p0 and p1:
            with_lib["plugin_extra_us"] = round(p1 - p0, 3)
            with_lib["plugin_ratio"] = round(p1 / p0, 4)
    return result


def compare(backend: str, world: int, calls: int, rounds: int, base_ref: str, repeats: int,
            tmp: Path, block: int = 20) -> dict[str, Any]:
    """This checkout's shim and the one at ``base_ref``, in alternating runs of the same job."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from base_code import base_tree

    base = base_tree(base_ref)
    runs: dict[str, list[dict[str, Any]]] = {"new": [], "base": []}
    for i in range(repeats):
        for side in ("new", "base") if i % 2 == 0 else ("base", "new"):
            job = run_job(backend, world, calls, rounds, None, tmp, base=base if side == "base" else None, block=block)
            runs[side].append(summarize(job))
    medians = {side: {key: statistics.median(r[key] for r in rs if key in r) for key in EXTRA_KEYS
                      if any(key in r for r in rs)} for side, rs in runs.items()}
    return {"backend": backend, "world": world, "calls_per_block": calls, "rounds": rounds, "block": block,
            "base_ref": base_ref,
            "runs": runs, "medians": medians}


EXTRA_KEYS = ("sync_shim_extra_us", "async_shim_extra_us", "sync_shim_extra_cpu_us", "async_shim_extra_cpu_us")


def compare_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"all_reduce of 1024 floats, {result['backend']}, world {result['world']}, best block of "
             f"{result.get('block', result['calls_per_block'])} calls among {result['rounds']}×"
             f"{result['calls_per_block']}; this checkout (new) and {result['base_ref']} (base), "
             "alternating runs; the shim's extra µs per call, wall (calling thread's CPU)"]
    for side in ("new", "base"):
        for r in result["runs"][side]:
            if "error" in r:
                lines.append(f"  {side:4} ERROR {r['error']}")
                continue
            lines.append(f"  {side:4} sync {r.get('sync_shim_extra_us', float('nan')):+7.2f} "
                         f"({r.get('sync_shim_extra_cpu_us', float('nan')):+6.2f})   async "
                         f"{r.get('async_shim_extra_us', float('nan')):+7.2f} "
                         f"({r.get('async_shim_extra_cpu_us', float('nan')):+6.2f})   plain sync "
                         f"{r['us_per_call'].get('sync_plain', float('nan')):.2f} µs; "
                         f"{'settled' if r['counters_settled'] else 'NOT settled'}")
    for side in ("new", "base"):
        m = result["medians"][side]
        lines.append(f"  median {side:4}: " + ", ".join(f"{k.replace('_shim_extra', '')} {v:+.2f}" for k, v in m.items()))
    return lines


TITLES = {"shim": "native shim (plain vs the C wrapper)", "python_shim": "Python shim (plain vs the Python wrapper)",
          "plugin": "with NCCL_PROFILER_PLUGIN"}


def side_by_side(result: dict[str, Any]) -> list[str]:
    """Plain, Python shim and native shim per variant: µs per call, the extra and the ratio to each run's plain."""
    native, python = result.get("shim", {}), result.get("python_shim", {})
    if "us_per_call" not in native or "us_per_call" not in python:
        return []
    lines = ["  side by side (µs per call; each shim against the plain call of its own run):"]
    for variant in ("sync", "async"):
        cells = [f"plain {native['us_per_call'].get(f'{variant}_plain', float('nan')):8.2f}"]
        for label, part in (("Python shim", python), ("native shim", native)):
            extra, ratio = part.get(f"{variant}_shim_extra_us"), part.get(f"{variant}_shim_ratio")
            if extra is not None:
                cells.append(f"{label} {part['us_per_call'][f'{variant}_shim']:8.2f} ({extra:+.2f}, {ratio:.3f}x)")
        lines.append(f"    {variant:5} " + "   ".join(cells))
    if native.get("path") != "native":
        lines.append("    (the native run counted in Python: the fast path did not build there; see its stderr)")
    return lines


def repeated(backend: str, world: int, calls: int, rounds: int, repeats: int, tmp: Path,
             paths: tuple[str, ...] = PATHS, block: int = 20) -> dict[str, Any]:
    """The side-by-side run ``repeats`` times; per path and variant the min and median of the extra and the ratio."""
    runs = [bench(backend, world, calls, rounds, False, tmp, paths, block) for _ in range(max(1, repeats))]
    summary: dict[str, dict[str, dict[str, float]]] = {}
    for path in paths:
        key = PATH_KEYS[path]
        for variant in ("sync", "async"):
            for figure in ("extra_us", "ratio", "extra_cpu_us"):
                vals = [r[key][f"{variant}_shim_{figure}"] for r in runs if f"{variant}_shim_{figure}" in r[key]]
                if vals:
                    summary.setdefault(key, {})[f"{variant}_{figure}"] = {
                        "min": round(min(vals), 3), "median": round(statistics.median(vals), 3), "runs": len(vals)}
    for path in paths:
        key = PATH_KEYS[path]
        for variant in ("sync", "async"):
            vals = [r[key]["wrapper_us"][variant] for r in runs if r[key].get("wrapper_us")]
            if vals:
                summary.setdefault(key, {})[f"{variant}_wrapper_us"] = {
                    "min": round(min(vals), 3), "median": round(statistics.median(vals), 3), "runs": len(vals)}
    return {"backend": backend, "world": world, "calls_per_block": calls, "rounds": rounds, "block": block,
            "repeats": len(runs),
            "runs": runs, "summary": summary}


def repeated_lines(result: dict[str, Any]) -> list[str]:
    lines = []
    for i, run in enumerate(result["runs"], 1):
        lines.append(f"run {i} of {result['repeats']}:")
        lines += ["  " + ln for ln in report_lines(run)[:4]]
    lines.append(f"over {result['repeats']} runs (min / median; each shim against the plain call of its own run):")
    for key, figures in result["summary"].items():
        for variant in ("sync", "async"):
            e, r, c = (figures.get(f"{variant}_{f}") for f in ("extra_us", "ratio", "extra_cpu_us"))
            if e is None or r is None:
                continue
            w = figures.get(f"{variant}_wrapper_us")
            lines.append(f"  {TITLES[key].split(' (')[0]:11} {variant:5} extra {e['min']:+.2f} / {e['median']:+.2f} µs"
                         f"   ratio {r['min']:.3f} / {r['median']:.3f}x"
                         + (f"   calling thread's CPU {c['min']:+.2f} / {c['median']:+.2f} µs" if c else "")
                         + (f"   wrapper around a no-op {w['min']:+.2f} / {w['median']:+.2f} µs" if w else ""))
    return lines


def report_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"all_reduce of 1024 floats, {result['backend']}, world {result['world']}, "
             f"best block of {result.get('block', result['calls_per_block'])} calls among {result['rounds']}×"
             f"{result['calls_per_block']} per figure"]
    lines += side_by_side(result)
    for name in ("shim", "python_shim", "plugin"):
        part = result.get(name)
        if part is None:
            continue
        title = TITLES[name]
        if "error" in part:
            lines.append(f"  {title}: ERROR {part['error']}")
            continue
        us = part["us_per_call"]
        lines.append(f"  {title} on {part['device']} (torch {part['torch']}): exit {part['exit_code']}, "
                     f"every rank reported: {part['all_ranks_reported']}, {part['collectives_per_rank']} "
                     f"collectives per rank")
        cpu = part.get("cpu_us_per_call", {})
        for variant in ("sync", "async"):
            extra = part.get(f"{variant}_shim_extra_us")
            extra_cpu = part.get(f"{variant}_shim_extra_cpu_us")
            lines.append(f"    {variant:5} plain {us.get(f'{variant}_plain', float('nan')):9.2f} µs   shim "
                         f"{us.get(f'{variant}_shim', float('nan')):9.2f} µs   "
                         + (f"{extra:+.2f} µs ({part[f'{variant}_shim_ratio']:.3f}x)" if extra is not None else "")
                         + (f"   calling thread's CPU: plain {cpu[f'{variant}_plain']:.2f} µs, shim "
                            f"{cpu[f'{variant}_shim']:.2f} µs, {extra_cpu:+.2f} µs" if extra_cpu is not None else ""))
        if part.get("writer_us") is not None:
            lines.append(f"    the counter writer alone (launch + completion): {part['writer_us']:.2f} µs")
        if part.get("wrapper_us"):
            w = part["wrapper_us"]
            lines.append(f"    the wrapper around a no-op (its own work, no collective): sync {w['sync']:+.2f} µs, "
                         f"async {w['async']:+.2f} µs")
        c = part["shim_counts"]
        lines.append(f"    shim counters after the run: CL {c['cl']} WR {c['wr']} WC {c['wc']} "
                     f"({'settled: WC = WR' if part['counters_settled'] else 'NOT settled: WC < WR'})")
        if name == "plugin" and "plugin_extra_us" in part:
            lines.append(f"    plugin: plain call {part['plugin_extra_us']:+.2f} µs ({part['plugin_ratio']:.3f}x) "
                         f"against the run without it")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--world", type=int, default=1)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--block", type=int, default=20, help="calls per timed block (plain and shim blocks alternate)")
    ap.add_argument("--paths", default=",".join(PATHS),
                    help="the shim's paths to run, each its own job: native (the C fast path), python")
    ap.add_argument("--plugin", action="store_true", help="also run with the NCCL profiler plugin loaded")
    ap.add_argument("--base-ref", default="", help="also run the shim at this commit, alternating with this one")
    ap.add_argument("--repeats", type=int, default=None,
                    help="runs of the whole side-by-side, with min/median (default 1); runs per side with --base-ref "
                         "(default 3)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--counter-dir", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)
    paths = tuple(p for p in args.paths.split(",") if p)
    if not paths or any(p not in PATHS for p in paths):
        ap.error(f"--paths: a comma-separated choice of {', '.join(PATHS)} (got {args.paths!r})")
    shm = Path("/dev/shm")  # where production keeps the counter files
    with tempfile.TemporaryDirectory(prefix="bench-shim-", dir=shm if shm.is_dir() else None) as d:
        if args.base_ref:
            result = compare(args.backend, args.world, args.calls, args.rounds, args.base_ref, args.repeats or 3,
                             Path(d), args.block)
            print(json.dumps(result, indent=2) if args.json else "\n".join(compare_lines(result)))
            return 0
        if args.repeats and args.repeats > 1:
            result = repeated(args.backend, args.world, args.calls, args.rounds, args.repeats, Path(d), paths,
                              args.block)
            print(json.dumps(result, indent=2) if args.json else "\n".join(repeated_lines(result)))
            return 0
        result = bench(args.backend, args.world, args.calls, args.rounds, args.plugin, Path(d), paths, args.block)
    print(json.dumps(result, indent=2) if args.json else "\n".join(report_lines(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
