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
- slow:   a rank slow on its host (slow-host: the slow-compute fault burns
          CPU), a rank slow on its GPU (slow-gpu: extra matrix products
          queued on its own device before its collectives) and a healthy
          run (none), each a live drill of the fail-slow scorecard watched
          to a confident verdict, graded per rank and GPU: the verdict must
          name the slow rank alone and, on NCCL, its GPU index; C4's kind
          (communication or non-communication slow) is graded beside it
          (right, wrong or not stated). Any verdict on the
          healthy run is a false alarm; a suspicion below the bar is
          reported as one. With several GPUs the slow rank has one of its
          own; where ranks share one GPU the report says so and grades the
          rank only. On gloo slow-gpu is skipped (it needs CUDA).
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
import re
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
# the slow part's drills, the GPU's own first where the budget runs short: the check's name -> the drill's fault
# (slow-host is the slow-compute fault: CPU burned)
SLOW_DRILLS = {"slow-gpu": "slow-gpu", "slow-host": "slow-compute", "none": "none"}
# C4's kind of each slow fault: the rank itself computes slowly (on its host or its GPU) and its peers wait for it
SLOW_C4_KIND = {"slow-compute": "non-communication slow", "slow-gpu": "non-communication slow"}
SLOW_TIME_LIMIT_S = 40.0  # after the fault's onset (a healthy run is watched as long)
SLOW_START_TIMEOUT_S = 150.0
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
    ctx["gpus"] = len(info.get("gpus") or [])
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
        "to_verdict_s": (report.get("times_s") or {}).get("fault_to_captured"),  # the verdict is read at capture
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


def slow_placement(backend: str, gpus: int) -> dict[str, Any]:
    """Where the slow part's drills run: their layout, the slow rank, its GPU, and whether ranks share GPUs.

    With several GPUs the job shrinks to fit (4 ranks from 4 GPUs, else 2) on one machine, so that every rank,
    the slow one included, has a GPU of its own, and its GPU index is its local rank (what a verdict names).
    With one GPU the 4 ranks share it: a slow GPU slows them all, and the grade is the rank's only.
    """
    from rankscope.drill.gpu import rank_device, shares_gpus

    layout = {"tp": 2, "pp": 2, "dp": 1, "machines": 2}
    if backend == "nccl" and gpus >= 2:
        layout = {"tp": 2, "pp": 2 if gpus >= 4 else 1, "dp": 1, "machines": 1}
    world = layout["tp"] * layout["pp"] * layout["dp"]
    rank = world - 1  # on the last machine: the verdict must name it, not the first one
    if backend != "nccl" or gpus < 1:
        return {"layout": layout, "world": world, "rank": rank, "gpu": None, "shared": None}
    gpu = rank_device(rank, gpus)  # as the drill's worker binds it
    shared = None
    if shares_gpus(world, gpus):
        shared = (f"ranks 0-{world - 1} share GPU 0: a slow GPU slows them all; graded on rank only" if gpus == 1
                  else f"{world} ranks share {gpus} GPUs: a slow GPU slows its neighbours too; graded on rank only")
    return {"layout": layout, "world": world, "rank": rank, "gpu": gpu, "shared": shared}


SLOW_PROBE = r"""
import json, sys
from pathlib import Path
from rankscope.drill.faults import DrillLayout, make_plan
from rankscope.drill.suite import DrillPlan, SuiteConfig, run_drill
a = json.loads(sys.argv[1])
layout = DrillLayout(**a["layout"])
config = SuiteConfig(layout=layout, stack_interval_s=3.0, time_limit_s=a["time_limit_s"],
                     start_timeout_s=a["start_timeout_s"], run_root=Path(a["run_root"]), backend=a["backend"],
                     record=True)
plan = make_plan(a["fault"], layout, rank=a["rank"], step=config.fault_step, factor=a["factor"], backend=a["backend"])
record = run_drill(DrillPlan(index=a["index"], plan=plan, loader_workers=0), config)
print("RECORD " + json.dumps(record.to_dict()))
"""


def slow_truth(name: str, placement: dict[str, Any], factor: float) -> dict[str, Any]:
    """What a right verdict on slow drill ``name`` names: the rank, its machine, its GPU (graded where it has one
    of its own), C4's kind."""
    fault = SLOW_DRILLS[name]
    if fault == "none":
        return {"fault": "none"}
    from rankscope.drill.faults import DrillLayout, machine_name

    rank = placement["rank"]
    return {"fault": fault, "factor": factor, "rank": rank,
            "machine": machine_name(DrillLayout(**placement["layout"]).machine_of(rank)),
            "gpu": placement["gpu"], "gpu_graded": placement["gpu"] is not None and not placement["shared"],
            "c4": SLOW_C4_KIND[fault]}


def grade_slow(name: str, truth: dict[str, Any], record: dict[str, Any]) -> dict[str, Any]:
    """One slow drill's record (``suite.DrillRecord.to_dict``) graded against its truth, per rank and GPU.

    A faulty drill is right when its first confident verdict names the slow rank alone and its GPU index where
    the rank had a GPU of its own; C4's kind is graded beside it (``kind_right``: True, False, or None when the
    verdict does not say). A healthy one is right when no confident verdict came (a suspicion below the bar is
    kept, worded as one).
    """
    summary = record.get("summary")
    out: dict[str, Any] = {"drill": name, "fault": truth["fault"], "truth": truth, "verdict": summary,
                           "named_ranks": list(record.get("named_ranks") or []),
                           "flags": list(record.get("last_flags") or []),
                           "named_machines": list(record.get("named_machines") or []),
                           "sources": list(record.get("sources") or []), "confidence": record.get("confidence"),
                           "to_verdict_s": record.get("onset_to_verdict_s"), "error": record.get("error"),
                           "leftovers": list(record.get("leftovers") or []), "wrong": []}
    peak = record.get("peak_confidence") or 0.0
    if truth["fault"] == "none":
        if record.get("detected"):
            out["wrong"].append("a fail-slow verdict on a healthy run: a false alarm")
        elif peak > 0:
            out["suspicion"] = (f"suspicion below the bar, not a verdict: {', '.join(record.get('peak_machines') or [])}"
                                f" at confidence {peak:.2f}")
        if record.get("error"):
            out["wrong"].append(f"the drill did not run: {record['error']}")
        out["right"] = not out["wrong"]
        return out
    if record.get("error") and not record.get("detected"):
        out["wrong"].append(f"the drill did not run to a verdict: {record['error']}")
    elif not record.get("detected"):
        out["wrong"].append("no confident verdict" + (f" (peak confidence {peak:.2f} on "
                                                       f"{', '.join(record.get('peak_machines') or []) or '-'})"
                                                       if peak else ""))
    else:
        rank = truth["rank"]
        if out["named_ranks"] != [rank]:
            out["wrong"].append(f"names rank(s) {out['named_ranks']}, not rank {rank} alone")
        named_gpu = re.search(rf"\brank {rank} \(GPU (\d+)\b", summary or "")  # NVML's, or assumed
        out["named_gpu"] = int(named_gpu.group(1)) if named_gpu else None
        if truth["gpu_graded"] and out["named_gpu"] != truth["gpu"]:
            out["wrong"].append(f"names GPU {out['named_gpu']}, not GPU {truth['gpu']}" if named_gpu
                                else f"does not name GPU {truth['gpu']}")
        kind = re.search(r"\((non-communication slow|communication slow)\)", summary or "")
        out["c4"] = kind.group(1) if kind else None
        out["kind_right"] = out["c4"] == truth["c4"] if kind else None
    out["right"] = not out["wrong"]
    return out


def one_slow_drill(ctx: dict[str, Any], name: str, placement: dict[str, Any], index: int,
                   timeout_s: float) -> dict[str, Any]:
    from rankscope.drill.suite import FAULT_KNOBS

    fault = SLOW_DRILLS[name]
    factor = FAULT_KNOBS.get(fault, {}).get("factor", 2.0)
    truth = slow_truth(name, placement, factor)
    args = {"layout": placement["layout"], "fault": fault, "rank": placement["rank"] if fault != "none" else None,
            "factor": factor, "index": index, "backend": ctx["backend"], "time_limit_s": SLOW_TIME_LIMIT_S,
            "start_timeout_s": SLOW_START_TIMEOUT_S, "run_root": str(ctx["tmp"] / "slow")}
    started = time.monotonic()
    code, out = run_session(["-c", SLOW_PROBE, json.dumps(args)], ctx["env"], timeout_s)
    took = round(time.monotonic() - started, 1)
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("RECORD ")), None)
    if code != 0 or line is None:
        return {"drill": name, "fault": fault, "truth": truth, "error": f"drill exit {code} after {took} s",
                "tail": out[-2500:]}
    graded = grade_slow(name, truth, json.loads(line[len("RECORD "):]))
    graded["seconds"] = took
    return graded


def part_slow(ctx: dict[str, Any], deadline: float) -> dict[str, Any]:
    """A rank slow on its host, one slow on its GPU and a healthy run, each watched live and graded per rank and
    GPU; a GPU fault on a CPU run is skipped with the refusal's reason and fix."""
    from rankscope.contract.errors import RankscopeError
    from rankscope.drill.faults import refuse_off_gpu

    placement = slow_placement(ctx["backend"], ctx.get("gpus", 0))
    drills: dict[str, Any] = {}
    for index, name in enumerate(SLOW_DRILLS):
        try:
            refuse_off_gpu(SLOW_DRILLS[name], ctx["backend"])
        except RankscopeError as exc:
            drills[name] = {"drill": name, "fault": SLOW_DRILLS[name], "skipped": f"needs CUDA: {exc.message}; "
                            f"fix: {exc.fix}"}
            continue
        left = deadline - time.monotonic()
        if left < 60:
            drills[name] = {"drill": name, "fault": SLOW_DRILLS[name], "skipped": f"{left:.0f} s left of the budget"}
            continue
        try:
            drills[name] = one_slow_drill(ctx, name, placement, index,
                                          min(SLOW_START_TIMEOUT_S + SLOW_TIME_LIMIT_S + 60.0, left))
        except Exception as exc:  # one drill's failure is reported; the others still run
            drills[name] = {"drill": name, "fault": SLOW_DRILLS[name], "error": f"{type(exc).__name__}: {exc}"}
    return {"placement": placement, "drills": drills}


def _bench(ctx: dict[str, Any], argv: list[str], timeout_s: float) -> dict[str, Any]:
    code, out = run_session([str(ROOT / "benchmarks" / "bench_shim.py"), "--json", *argv], ctx["env"], timeout_s)
    start = out.find("{\n")
    if code != 0 or start < 0:
        raise RuntimeError(f"bench_shim exit {code}: {out[-2500:]}")
    result: dict[str, Any] = json.loads(out[start:out.rindex("}") + 1])
    return result


def part_shim(ctx: dict[str, Any], deadline: float) -> dict[str, Any]:
    """The shim alone (one rank: no network in the figure), then on NCCL with the profiler plugin loaded as
    ``rankscope run`` loads it (two ranks: with one NCCL calls no plugin), where the plugin settles a CUDA call and
    the shim only counts it."""
    result = _bench(ctx, ["--backend", ctx["backend"], "--world", "1", "--calls", "2000", "--rounds", "3"],
                    min(120.0, deadline - time.monotonic()))
    if ctx["backend"] == "nccl" and deadline - time.monotonic() > 90:
        try:
            result["with_plugin"] = _bench(ctx, ["--backend", "nccl", "--world", "2", "--calls", "400", "--rounds",
                                                 "2", "--paths", "native", "--plugin"],
                                           min(200.0, deadline - time.monotonic()))
        except RuntimeError as exc:  # the figure without the plugin still stands
            result["with_plugin"] = {"error": str(exc)[-1500:]}
    return result


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
                         f"NCCL {data.get('nccl')}, GPUs: {', '.join(data.get('gpus') or ['none'])}; rankscope "
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
                             f"{d['truth_machines']}; stall {d['stall']} at steps {d['steps']}; {d['seconds']} s"
                             + (f" (verdict {d['to_verdict_s']} s after the fault)" if d.get("to_verdict_s") else ""))
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
            lines.extend(slow_lines(data))
        elif part in ("shim", "soak"):
            lines.extend(f"[{part}] {ln}" for ln in bench_lines(data))
            plugin = data.get("with_plugin")
            if plugin is not None:
                lines.extend([f"[{part}] with the plugin: FAILED {plugin['error']}"] if "error" in plugin
                             else (f"[{part}] {ln}" for ln in bench_lines(plugin)))
            if part == "soak":
                lines.append(f"[soak] >= 10,000 collectives per rank with the plugin, every rank exited cleanly: "
                             f"{'yes' if data.get('soak_ok') else 'NO'}")
    return lines


def _where(rank: int, gpu: int | None, machine: str | None = None) -> str:
    return f"rank {rank}" + (f" (GPU {gpu})" if gpu is not None else "") + (f" on {machine}" if machine else "")


def slow_lines(data: dict[str, Any]) -> list[str]:
    """The slow part: where its drills ran, then per drill its fault, truth, verdict, right or wrong (and why),
    seconds from the fault to the verdict; the tally last."""
    pl = data["placement"]
    lay = pl["layout"]
    shape = f"{pl['world']} ranks (tp {lay['tp']} x pp {lay['pp']} x dp {lay['dp']}) on {lay['machines']} machine(s)"
    if pl["gpu"] is None:
        lines = [f"[slow] {shape} on CPU: graded on rank, C4's kind beside it"]
    elif pl["shared"]:
        lines = [f"[slow] {shape}: {pl['shared']}"]
    else:
        lines = [f"[slow] {shape}, a GPU each: the slow rank {pl['rank']} has GPU {pl['gpu']} to itself; graded on "
                 "rank and GPU"]
    right = faulty = 0
    kinds: dict[bool | None, int] = {True: 0, False: 0, None: 0}  # C4's kind of the confident verdicts
    for name, d in data["drills"].items():
        tag = f"[slow {name}]"
        if "skipped" in d:
            lines.append(f"{tag} skipped: {d['skipped']}")
            continue
        if "tail" in d:
            lines.append(f"{tag} ERROR {d['error']}")
            lines.extend(f"    {ln}" for ln in d["tail"].splitlines()[-12:])
            continue
        if "truth" not in d:
            lines.append(f"{tag} ERROR {d.get('error')}")
            continue
        t = d["truth"]
        if t["fault"] == "none":
            fault, truth = "none (a healthy run)", "no fail-slow verdict"
        else:
            faulty += 1
            right += bool(d["right"])
            fault = f"{t['fault']} x{t['factor']:g} at {_where(t['rank'], t['gpu'], t['machine'])}"
            truth = f"rank {t['rank']}" + (f", GPU {t['gpu']}" if t["gpu_graded"] else "") + f", {t['c4']}"
        verdict = f"'{d['verdict']}' (ranks {d['named_ranks']})" if d.get("verdict") else "none confident"
        when = f"; {d['to_verdict_s']} s from the fault to the verdict" if d.get("to_verdict_s") is not None else ""
        kind = ""
        if "kind_right" in d:
            kinds[d["kind_right"]] += 1
            kind = ("; kind right" if d["kind_right"] else f"; kind WRONG ({d['c4']})" if d["kind_right"] is False
                    else "; kind not stated")
        lines.append(f"{tag} {'RIGHT' if d['right'] else 'WRONG'}: fault {fault}; truth {truth}; verdict {verdict}"
                     f"{kind}{when}; drill {d.get('seconds', '-')} s")
        if d["wrong"]:
            lines.append(f"    wrong: {'; '.join(d['wrong'])}")
            lines.extend(f"    detector {flag}" for flag in d.get("flags", []))  # each one's last word: why
        if d.get("suspicion"):
            lines.append(f"    {d['suspicion']}")
        if d.get("leftovers"):
            lines.append(f"    leftovers stopped by force: {d['leftovers']}")
    healthy = data["drills"].get("none", {})
    alarms = str(sum("false alarm" in w for w in healthy["wrong"])) if "wrong" in healthy else "not run"
    lines.append(f"[slow] graded per rank{' and GPU' if pl['gpu'] is not None and not pl['shared'] else ''}: "
                 f"{right} of {faulty} slow drills right; C4's kind right in {kinds[True]}, wrong in "
                 f"{kinds[False]}, not stated in {kinds[None]}; false alarms on the healthy run: {alarms}")
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
