"""The device check: rankscope on real NCCL and a real GPU, as one command of at most 8 minutes.

Run (on a machine with an NVIDIA GPU and a CUDA build of torch):

    python benchmarks/gpu_check.py [--json] [--budget-s 470] [--parts env,build,nvml,drills,shim,soak]

Parts, each in its own process under its own timeout; a part that fails is
reported and the others still run, within the overall budget:

- env:    Python, torch, CUDA, NCCL, the GPUs; which of rankscope's
          dependencies are missing (the drill then captures without agents).
- build:  the NCCL profiler plugin, compiled from ccl_plugin/nccl.
- nvml:   NVML's readings of every GPU (what the Metrics view shows).
- drills: ``rankscope drill --headless --backend nccl`` (shim and plugin
          loaded) for the hang kinds (hang-compute, hang-collective,
          hang-p2p), 4 ranks on 2 local machines: per fault the verdict
          against the ground truth, the CCL counters of every rank, NVML
          during the fault, whether a rank died.
- evidence: the GPU's own evidence read right, the same way: a pipeline
          stage that skips one send (skip-send: the pair waits on each
          other), a DataLoader deadlock in this job that uses send/recv
          (dataloader-deadlock), and a healthy run (none) for false alarms;
          each graded against its truth. Where the 4 ranks share fewer
          GPUs, the report says so (their kernels interfere).
- slow:   one slow kind (slow-compute, 1.5x) through the fail-slow
          scorecard (``rankscope drill --suite failslow --backend nccl``),
          watched live to a confident verdict.
- shim:   the shim's cost per all_reduce beside the plain call (NCCL, one
          rank: no network in the figure), bench_shim.py.
- soak:   NCCL, 2 ranks, with and without the profiler plugin: the plugin's
          cost per call, and >= 10,000 collectives per rank with the plugin
          loaded; every rank must exit cleanly and report.

Without CUDA it stops at once with the reason (exit code 2). rankscope need
not be installed: the working tree is made importable through a folder of
links (``rankscope`` -> core/, probes/, ...) on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_shim import report_lines as bench_lines  # noqa: E402
from bench_shim import run_session  # noqa: E402

PARTS = ("env", "build", "nvml", "drills", "evidence", "slow", "shim", "soak")
HANG_FAULTS = ("hang-compute", "hang-collective", "hang-p2p")
EVIDENCE_FAULTS = ("skip-send", "dataloader-deadlock", "none")
DRILL_RANKS = 4  # DRILL_LAYOUT's world
DRILL_LAYOUT = ["--tp", "2", "--pp", "2", "--dp", "1", "--machines", "2", "--fault-step", "8"]
# where each installed package lives in the working tree (pyproject's package-dir)
PACKAGE_DIRS = {"probes": "probes", "analyzers": "analyzers", "ccl_plugin": "ccl_plugin", "tui": "tui"}
AGENT_MODULES = ("grpc", "google.protobuf", "psutil", "cryptography")
DIED_SIGNS = ("Segmentation fault", "SIGSEGV", "SIGABRT", "signal 11", "core dumped", "Fatal Python error")


class NoCuda(Exception):
    pass


# ---- making the working tree importable ------------------------------------------


def tree_site(base: Path) -> Path:
    """A folder holding ``rankscope`` as links into the working tree, for PYTHONPATH."""
    pkg = base / "rankscope"
    pkg.mkdir(parents=True, exist_ok=True)
    for entry in (ROOT / "core").iterdir():
        link = pkg / entry.name
        if not link.exists():
            link.symlink_to(entry)
    for name, folder in PACKAGE_DIRS.items():
        link = pkg / name
        if not link.exists():
            link.symlink_to(ROOT / folder)
    return base


def child_env(site: Path | None) -> dict[str, str]:
    env = dict(os.environ)
    if site is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH")) if p)
    return env


def rankscope_importable(tmp: Path) -> Path | None:
    """None when rankscope imports as installed; else the linked site folder now on sys.path."""
    if importlib.util.find_spec("rankscope") is not None:
        return None
    site = tree_site(tmp / "site")
    sys.path.insert(0, str(site))
    return site


# ---- parts ------------------------------------------------------------------------


ENV_PROBE = r"""
import json, sys
info = {"python": sys.version.split()[0]}
try:
    import torch
except Exception as exc:
    print(json.dumps({**info, "error": f"torch does not import: {exc}"})); sys.exit(0)
info["torch"] = torch.__version__
info["cuda_build"] = torch.version.cuda
info["cuda_available"] = torch.cuda.is_available()
if info["cuda_available"]:
    info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    try:
        v = torch.cuda.nccl.version()
        info["nccl"] = ".".join(str(x) for x in v) if isinstance(v, tuple) else str(v)
    except Exception as exc:
        info["nccl"] = f"unknown ({exc})"
print(json.dumps(info))
"""


def part_env(ctx: dict[str, Any]) -> dict[str, Any]:
    code, out = run_session(["-c", ENV_PROBE], ctx["env"], 60)
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("{")), None)
    if code != 0 or line is None:
        raise RuntimeError(f"the environment probe failed (exit {code}): {out[-1500:]}")
    info: dict[str, Any] = json.loads(line)
    if not info.get("cuda_available") and ctx["backend"] == "nccl":
        why = info.get("error") or (f"torch {info.get('torch')} is a CPU build" if not info.get("cuda_build")
                                    else f"torch {info.get('torch')} (CUDA {info.get('cuda_build')}) sees no GPU")
        raise NoCuda(f"no CUDA here: torch.cuda.is_available() is False ({why}). This check needs an NVIDIA GPU, "
                     "its driver and a CUDA build of torch; run it on the GPU machine (see README, 'GPU check').")
    missing = [m for m in AGENT_MODULES if importlib.util.find_spec(m) is None]
    info["missing_agent_modules"] = missing
    info["agents"] = not missing
    info["pynvml"] = importlib.util.find_spec("pynvml") is not None
    info["py_spy"] = _py_spy() is not None
    info["rankscope"] = "installed" if ctx["site"] is None else f"from the working tree ({ctx['site']})"
    ctx["agents"] = not missing
    return info


def _py_spy() -> str | None:
    import shutil

    return shutil.which("py-spy") or (str(Path(sys.executable).parent / "py-spy")
                                      if (Path(sys.executable).parent / "py-spy").exists() else None)


def part_build(ctx: dict[str, Any]) -> dict[str, Any]:
    from rankscope.ccl_plugin.build import BuildError, build_plugin

    try:
        lib = build_plugin(ctx["tmp"] / "lib")
    except BuildError as exc:
        raise RuntimeError(f"{exc.message}; fix: {exc.fix}") from exc
    ctx["plugin"] = lib
    return {"plugin": str(lib), "bytes": lib.stat().st_size}


NVML_PROBE = r"""
import json
from rankscope.contract.bundle import to_jsonable
from rankscope.probes.gpu import gpu_status
print(json.dumps(to_jsonable(gpu_status())))
"""


def part_nvml(ctx: dict[str, Any]) -> dict[str, Any]:
    code, out = run_session(["-c", NVML_PROBE], ctx["env"], 60)
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("{")), None)
    if code != 0 or line is None:
        raise RuntimeError(f"NVML probe failed (exit {code}): {out[-1500:]}")
    status: dict[str, Any] = json.loads(line)
    return status


def _counters_of(bundle_path: Path) -> tuple[dict[str, list[str]], list[dict[str, Any]]]:
    """Per rank: its counters as 'comm op CL/WR/WC' (open ones marked), one row per collective (the plugin's
    NCCL communicators joined into the shim's groups, as the analysis reads them); NVML during the fault."""
    from rankscope.analyzers.topology import joined_counters
    from rankscope.contract.bundle import read_bundle, to_jsonable

    snap = read_bundle(bundle_path).snapshots[0]
    joined = joined_counters(snap.all_counters())
    per_rank: dict[str, list[str]] = {}
    gpus: list[dict[str, Any]] = []
    for m in snap.machines:
        for c in (joined.get(rc.rank, rc) for rc in m.counters):
            descs = {x.comm_id: (x.description or x.comm_id, x.comm_nranks, x.comm_rank) for x in c.communicators}
            for o in c.ops:
                desc, nranks, crank = descs.get(o.comm_id, (o.comm_id, 0, -1))
                where = f"{desc[:28]}" + (f"[{crank}/{nranks}]" if nranks else "")
                mark = " OPEN" if o.wc < o.wr else ""
                peers = f" peers {list(o.open_peers)}" if o.open_peers else ""
                per_rank.setdefault(str(c.rank), []).append(f"{where} {o.op} {o.cl}/{o.wr}/{o.wc}{mark}{peers}")
        if m.gpus is not None and not gpus:
            gpus = [{k: v for k, v in to_jsonable(g).items()
                     if k in ("index", "name", "util_percent", "power_w", "mem_used_bytes", "temperature_c")}
                    for g in m.gpus.gpus]
    return per_rank, gpus


def _died(report: dict[str, Any], run_dir: Path) -> list[str]:
    signs: list[str] = []
    stall = report.get("stall", {})
    if stall.get("reason") == "job-exited":
        signs.append("the job exited before the capture")
    for node, code in (stall.get("node_exit_codes") or {}).items():
        if code is not None:
            signs.append(f"{node} exited with {code} before the capture")
    for log in sorted((run_dir / "logs").glob("*.log")):
        text = log.read_text(errors="replace")
        for sign in DIED_SIGNS:
            if sign in text:
                signs.append(f"{log.name}: {sign}")
    return signs


def one_drill(ctx: dict[str, Any], fault: str, timeout_s: float) -> dict[str, Any]:
    run_dir = ctx["tmp"] / f"drill-{fault}"
    argv = ["-m", "rankscope", "drill", "--headless", "--json", "--backend", ctx["backend"], "--fault", fault,
            *DRILL_LAYOUT, "--steps", "40", "--checkpoint-every", "0", "--stall-seconds", "5",
            "--start-timeout", "150", "--stall-timeout", "90", "--run-dir", str(run_dir),
            *(["--fault-rank", "3"] if fault != "none" else [])]  # the second machine's: the verdict must name it
    if not ctx.get("agents", True):
        argv.append("--no-agents")
    started = time.monotonic()
    code, out = run_session(argv, ctx["env"], timeout_s)
    took = round(time.monotonic() - started, 1)
    start = out.find("{\n")
    if code != 0 or start < 0:
        return {"fault": fault, "error": f"drill exit {code} after {took} s", "tail": out[-2500:],
                "died": _died({}, run_dir) if run_dir.exists() else []}
    report = json.loads(out[start:out.rindex("}") + 1])
    verdict = report.get("verdict", {})
    counters, gpus = _counters_of(Path(report["bundle"]))
    return {
        "fault": fault, "seconds": took, "truth": report["ground_truth"].get("suspect_ranks"),
        "truth_machines": report["ground_truth"].get("suspect_machines"),
        "verdict": verdict.get("summary"), "correct": verdict.get("correct"),
        "named_ranks": (verdict.get("top") or {}).get("ranks"), "stall": report["stall"]["reason"],
        "steps": report["stall"]["steps"], "counters": counters, "nvml_during": gpus,
        "died": _died(report, run_dir), "leftovers": report.get("leftover_processes", []),
        "notes": report.get("notes", []),
    }


def part_drills(ctx: dict[str, Any], deadline: float, faults: tuple[str, ...] = HANG_FAULTS) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fault in faults:
        left = deadline - time.monotonic()
        if left < 45:
            out[fault] = {"fault": fault, "error": f"skipped: {left:.0f} s left of the budget"}
            continue
        try:
            out[fault] = one_drill(ctx, fault, min(150.0, left))
        except Exception as exc:  # one drill's failure is reported; the others still run
            out[fault] = {"fault": fault, "error": f"{type(exc).__name__}: {exc}"}
    return out


def part_slow(ctx: dict[str, Any], deadline: float) -> dict[str, Any]:
    """One slow-compute drill of the fail-slow scorecard, watched live to a confident verdict."""
    argv = ["-m", "rankscope", "drill", "--suite", "failslow", "--json", "--backend", ctx["backend"],
            *DRILL_LAYOUT, "--suite-drills", "1", "--suite-baselines", "0", "--stack-interval", "3",
            "--time-limit", "60", "--start-timeout", "150", "--run-dir", str(ctx["tmp"] / "suite")]
    code, out = run_session(argv, ctx["env"], max(30.0, deadline - time.monotonic()))
    start = out.find("{\n")
    if code != 0 or start < 0:
        raise RuntimeError(f"suite exit {code}: {out[-2500:]}")
    result: dict[str, Any] = json.loads(out[start:out.rindex("}") + 1])
    return result


def _bench(ctx: dict[str, Any], argv: list[str], timeout_s: float) -> dict[str, Any]:
    code, out = run_session([str(ROOT / "benchmarks" / "bench_shim.py"), "--json", *argv], ctx["env"], timeout_s)
    start = out.find("{\n")
    if code != 0 or start < 0:
        raise RuntimeError(f"bench_shim exit {code}: {out[-2500:]}")
    result: dict[str, Any] = json.loads(out[start:out.rindex("}") + 1])
    return result


def part_shim(ctx: dict[str, Any], deadline: float) -> dict[str, Any]:
    return _bench(ctx, ["--backend", ctx["backend"], "--world", "1", "--calls", "2000", "--rounds", "3"],
                  min(120.0, deadline - time.monotonic()))


def part_soak(ctx: dict[str, Any], deadline: float) -> dict[str, Any]:
    # 2 rounds x 4 blocks x 1250 calls + 200 warm-up = 10,200 collectives per rank and run
    result = _bench(ctx, ["--backend", ctx["backend"], "--world", "2", "--calls", "1250", "--rounds", "2", "--plugin"],
                    max(30.0, deadline - time.monotonic()))
    plugin = result.get("plugin", {})
    result["soak_ok"] = bool(plugin.get("exit_code") == 0 and plugin.get("all_ranks_reported")
                             and plugin.get("collectives_per_rank", 0) >= 10_000)
    return result


# ---- the report -------------------------------------------------------------------


def report_lines(result: dict[str, Any]) -> list[str]:
    lines = [f"rankscope GPU check on {result['backend']} ({result['seconds']:.0f} s of a {result['budget_s']:.0f} s "
             "budget)"]
    for part in PARTS:
        r = result["parts"].get(part)
        if r is None:
            continue
        if "error" in r and part not in ("drills", "evidence"):
            lines.append(f"[{part}] FAILED: {r['error']}")
            continue
        data = r["data"]
        if part == "env":
            lines.append(f"[env] Python {data['python']}, torch {data['torch']} (CUDA {data['cuda_build']}), "
                         f"NCCL {data.get('nccl')}, GPUs: {', '.join(data.get('gpus', []))}; rankscope "
                         f"{data['rankscope']}; agents: {'yes' if data['agents'] else 'no, missing ' + ', '.join(data['missing_agent_modules'])}; "
                         f"py-spy: {data['py_spy']}; pynvml: {data['pynvml']}")
        elif part == "build":
            lines.append(f"[build] NCCL profiler plugin: {data['plugin']} ({data['bytes']} bytes)")
        elif part == "nvml":
            if not data.get("available"):
                lines.append(f"[nvml] not available: {data.get('reason')}")
            for g in data.get("gpus", []):
                lines.append(f"[nvml] GPU {g['index']} {g.get('name')}: util {g.get('util_percent')} %, "
                             f"mem {g.get('mem_used_bytes')}/{g.get('mem_total_bytes')} B, {g.get('temperature_c')} C, "
                             f"{g.get('power_w')} W, SM {g.get('sm_clock_mhz')} MHz, PCIe tx/rx "
                             f"{g.get('pcie_tx_kbps')}/{g.get('pcie_rx_kbps')} kB/s, ECC {g.get('ecc_corrected')}/"
                             f"{g.get('ecc_uncorrected')}, remapped rows {g.get('remapped_rows')}, "
                             f"NVLink {g.get('nvlink_tx_kbps')}")
        elif part in ("drills", "evidence"):
            if "error" in r:
                lines.append(f"[{part}] FAILED: {r['error']}")
                continue
            gpus = len((result["parts"].get("env", {}).get("data") or {}).get("gpus", []))
            if part == "evidence" and 0 < gpus < DRILL_RANKS:
                lines.append(f"[evidence] the drill's {DRILL_RANKS} ranks share {gpus} GPU(s): their kernels "
                             "interfere, so a rank slow on its GPU slows its neighbours too (not a clean slow-GPU case)")
            for fault, d in data.items():
                if "error" in d:
                    lines.append(f"[drill {fault}] ERROR {d['error']}")
                    lines.extend(f"    {ln}" for ln in d.get("tail", "").splitlines()[-12:])
                    continue
                ok = "RIGHT" if d["correct"] else "WRONG"
                lines.append(f"[drill {fault}] {ok}: verdict '{d['verdict']}'; truth ranks {d['truth']} on "
                             f"{d['truth_machines']}; stall {d['stall']} at steps {d['steps']}; {d['seconds']} s")
                lines.append(f"    rank died: {'; '.join(d['died']) if d['died'] else 'no'}"
                             + (f"; leftovers stopped by force: {d['leftovers']}" if d["leftovers"] else ""))
                for rank, ops in sorted(d["counters"].items(), key=lambda kv: int(kv[0])):
                    lines.append(f"    r{rank}: " + "; ".join(ops))
                for g in d["nvml_during"]:
                    lines.append(f"    NVML during: GPU {g['index']} util {g.get('util_percent')} %, "
                                 f"{g.get('power_w')} W")
                for note in d["notes"]:
                    lines.append(f"    note: {note}")
        elif part == "slow":
            from rankscope.drill.suite import scorecard_lines

            for d in data.get("drills", []):
                lines.append(f"[slow {d['kind']}] {d['outcome']}: rank {d['rank']} on {d['machine']}; verdict "
                             f"'{d.get('summary') or d.get('error') or 'no confident verdict'}'"
                             + (f" after {d['onset_to_verdict_s']} s" if d.get("onset_to_verdict_s") else "")
                             + f"; detectors: {', '.join(d.get('last_flags') or []) or '-'}")
            lines.extend(f"[slow] {ln}" for ln in scorecard_lines(data))
        elif part in ("shim", "soak"):
            lines.extend(f"[{part}] {ln}" for ln in bench_lines(data))
            if part == "soak":
                lines.append(f"[soak] >= 10,000 collectives per rank with the plugin, every rank exited cleanly: "
                             f"{'yes' if data.get('soak_ok') else 'NO'}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="the report as JSON")
    ap.add_argument("--budget-s", type=float, default=470.0, help="overall time budget (default 470 s)")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                    help="gloo: the same check on CPU, to test the check itself where no GPU is (default nccl)")
    ap.add_argument("--keep", type=Path, help="keep run folders (logs, bundles) here instead of a temp dir")
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        print(f"gpu_check: unknown parts {sorted(unknown)}; choose from {','.join(PARTS)}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    with contextlib.ExitStack() as stack:
        if args.keep is not None:
            args.keep.mkdir(parents=True, exist_ok=True)
            tmp = args.keep
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="rankscope-gpu-check-")))
        site = rankscope_importable(tmp)
        ctx: dict[str, Any] = {"tmp": tmp, "site": site, "env": child_env(site), "backend": args.backend}
        result: dict[str, Any] = {"backend": args.backend, "budget_s": args.budget_s, "parts": {}}
        steps: dict[str, Callable[[], dict[str, Any]]] = {
            "env": lambda: part_env(ctx),
            "build": lambda: part_build(ctx),
            "nvml": lambda: part_nvml(ctx),
            "drills": lambda: part_drills(ctx, deadline - 270.0 if "soak" in parts else deadline),
            "evidence": lambda: part_drills(ctx, deadline - 270.0 if "soak" in parts else deadline, EVIDENCE_FAULTS),
            "slow": lambda: part_slow(ctx, deadline - 150.0 if "soak" in parts else deadline),
            "shim": lambda: part_shim(ctx, deadline),
            "soak": lambda: part_soak(ctx, deadline),
        }
        for part in ["env", *[p for p in parts if p != "env"]]:  # env first: no CUDA, no point going on
            started = time.monotonic()
            if part != "env" and started > deadline - 10:
                result["parts"][part] = {"error": "skipped: the budget is spent"}
                continue
            try:
                result["parts"][part] = {"data": steps[part]()}
            except NoCuda as exc:
                result["parts"][part] = {"error": str(exc)}
                result["seconds"] = time.monotonic() - t0
                print(json.dumps(result, indent=2, default=str) if args.json else f"gpu_check: {exc}")
                return 2
            except Exception as exc:  # reported; the other parts still run
                result["parts"][part] = {"error": f"{type(exc).__name__}: {exc}"}
            result["parts"][part]["seconds"] = round(time.monotonic() - started, 1)
        result["seconds"] = time.monotonic() - t0
    print(json.dumps(result, indent=2, default=str) if args.json else "\n".join(report_lines(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
