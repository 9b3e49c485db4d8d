"""Scorecard of real drills: `python benchmarks/drill_scorecard.py [--drills 16] [--seed S]`.

Runs ``rankscope drill --headless`` (TP=2, PP=2, DP=2 over 4 local machines,
real torchrun, agents and py-spy) once per drill, cycling through the hang
faults, each at a rank drawn from the seed. Every bundle is judged with
``rankscope.analyzers.verdict.analyze_snapshot`` and graded with
``rankscope.drill.scoring.score_verdict``; the table shows the expected and
the named suspect, whether the top suspect is of the right kind and holds the
faulty machine, and how long it took from the fault to the verdict (the
drill's fault-to-capture time plus the analysis). A desync is graded on the
verdict's first finding (kind ``desync``, exactly the ranks that ran ahead;
see ``score_verdict``), so its "named" column shows that finding.

One drill at a time, each in its own process group; on Ctrl-C or a timeout
the running drill is stopped with SIGTERM (it then stops its job and agents).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from rankscope.analyzers import ccl, suspects
from rankscope.analyzers.analysis import analyze_snapshot
from rankscope.analyzers.topology import placement_of
from rankscope.contract.bundle import read_bundle
from rankscope.drill import faults
from rankscope.drill.scoring import score_verdict

# The drill's hang faults that leave the job standing. ``crash`` is left out by default: torchrun tears the
# crashed rank's node down and the rest of the job exits soon after, so a capture shows exiting processes,
# not a hang (the analyzer says "the job looks crashed" and names no suspect); pass --faults to include it.
HANG_FAULTS = tuple(f for f in faults.HANG_FAULTS if f != "crash")
WORLD = 8
_PRELOADED = (ccl, suspects)  # imported up front so the timed analysis does not include imports


def run_drill(fault: str, rank: int, workdir: Path, timeout_s: float,
              backend: str = "gloo") -> tuple[dict[str, Any] | None, Path, str]:
    bundle = workdir / f"{fault}-r{rank}.json"
    cmd = [sys.executable, "-m", "rankscope", "drill", "--headless", "--json", "--fault", fault,
           "--fault-rank", str(rank), "--fault-step", "5", "--run-dir", str(workdir / f"run-{fault}-r{rank}"),
           "-o", str(bundle), "--backend", backend]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except BaseException:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    if proc.returncode != 0:
        return None, bundle, err.strip().splitlines()[-1] if err.strip() else f"exit {proc.returncode}"
    return json.loads(out), bundle, ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drills", type=int, default=2 * len(HANG_FAULTS), help="drills (default: each fault twice)")
    parser.add_argument("--seed", type=int, default=20251121)
    parser.add_argument("--faults", default=",".join(HANG_FAULTS), help="comma-separated fault names to cycle")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per drill")
    parser.add_argument("--keep", type=Path, help="keep bundles in this folder (default: a temporary one)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON lines too")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="the drills' backend (nccl: ranks on the machine's GPUs, see rankscope drill --backend)")
    args = parser.parse_args()
    faults = [f.strip() for f in args.faults.split(",") if f.strip()]
    rng = random.Random(args.seed)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="rankscope-scorecard-"))
    workdir.mkdir(parents=True, exist_ok=True)

    rows: list[dict[str, Any]] = []
    header = (f"{'#':>2} {'fault':<17} {'rank':>4} {'machine':<10} {'expect':<6} {'named':<6} {'top machines':<22} "
              f"{'kind':<4} {'mach':<4} {'fault->verdict':>14} {'analysis':>9}  named ranks")
    print(f"{args.drills} drills on {args.backend}, TP=2 PP=2 DP=2 on 4 machines, seed {args.seed}, bundles in {workdir}")
    print(header)
    print("-" * len(header))
    for i in range(args.drills):
        fault = faults[i % len(faults)]
        rank = rng.randrange(WORLD)
        t0 = time.monotonic()
        report, bundle_path, error = run_drill(fault, rank, workdir, args.timeout, args.backend)
        wall = time.monotonic() - t0
        if report is None:
            rows.append({"fault": fault, "rank": rank, "error": error, "correct": False, "drill_s": wall})
            print(f"{i + 1:>2} {fault:<17} {rank:>4} drill failed: {error}")
            continue
        bundle = read_bundle(bundle_path)
        a0 = time.perf_counter()
        verdict = analyze_snapshot(bundle.latest)
        analysis_s = time.perf_counter() - a0
        graded = score_verdict(verdict, bundle.ground_truth or {}, placement_of(bundle.latest))
        captured = (report.get("times_s") or {}).get("fault_to_captured")
        to_verdict = captured + analysis_s if isinstance(captured, (int, float)) else None
        top = graded["top"] or {}
        named = graded.get("named") or {"kind": top.get("kind"), "ranks": top.get("ranks")}  # a desync: its finding
        row = {"fault": fault, "rank": rank, "machine": graded["expected"]["machine"],
               "expected": graded["expected"]["kind"], "named": named["kind"], "named_ranks": named["ranks"],
               "top_machines": top.get("machines"),
               "kind_ok": graded["kind_ok"], "machine_ok": graded["machine_ok"], "correct": graded["correct"],
               "extra_machines": graded["extra_machines"], "truth_position": graded["truth_position"],
               # The plan `e` executes (scoring.score_eviction): its default and the over-eviction of the group.
               "eviction": graded["eviction"],
               "fault_to_verdict_s": to_verdict, "analysis_s": analysis_s, "drill_s": wall,
               "summary": verdict.summary}
        rows.append(row)
        machines = ",".join(m.replace("machine-", "m") for m in top.get("machines") or []) or "-"
        tv = f"{to_verdict:.1f} s" if to_verdict is not None else "?"
        print(f"{i + 1:>2} {fault:<17} {rank:>4} {row['machine'] or '-':<10} {row['expected']:<6} "
              f"{row['named'] or '-':<6} {machines:<22} {'ok' if row['kind_ok'] else 'NO':<4} "
              f"{'ok' if row['machine_ok'] else 'NO':<4} {tv:>14} {analysis_s * 1e3:>7.1f}ms  {row['named_ranks']}")
        if not row["correct"]:
            print(f"   wrong: {verdict.summary}")
        if args.json:
            print(json.dumps(row))

    done = [r for r in rows if "error" not in r]
    correct = sum(1 for r in rows if r["correct"])
    print("-" * len(header))
    print(f"correct (right kind and faulty machine in the top suspect): {correct}/{len(rows)}")
    if done:
        print(f"right kind: {sum(r['kind_ok'] for r in done)}/{len(done)}; "
              f"faulty machine in top suspect: {sum(r['machine_ok'] for r in done)}/{len(done)}; "
              f"extra machines evicted (mean): {statistics.mean(r['extra_machines'] for r in done):.2f}")
        plans = [r["eviction"] for r in done if r.get("eviction")]
        if plans:
            # What `e` takes, against the faulty machine: its default (precise where the evidence pins a rank)
            # and ByteRobust's over-eviction of the whole group.
            for scope, name in (("precise", "the default plan"), ("group", "over-eviction")):
                print(f"{name}: faulty machine evicted {sum(e[scope]['right'] for e in plans)}/{len(plans)}, "
                      f"extra machines (mean) {statistics.mean(e[scope]['extra_machines'] for e in plans):.2f}")
            print(f"default is precise in {sum(e['default'] == 'precise' for e in plans)}/{len(plans)} drills")
        times = [r["fault_to_verdict_s"] for r in done if r["fault_to_verdict_s"] is not None]
        if times:
            print(f"fault -> verdict: median {statistics.median(times):.1f} s, max {max(times):.1f} s "
                  f"(the drill's stall detection waits for {5.0:.0f} s without progress before capturing)")
        print(f"analysis per bundle: median {statistics.median(r['analysis_s'] for r in done) * 1e3:.1f} ms")
    print("per fault (correct/drills, fault -> verdict median):")
    for fault in dict.fromkeys(r["fault"] for r in rows):
        rs = [r for r in rows if r["fault"] == fault]
        ts = [r["fault_to_verdict_s"] for r in rs if r.get("fault_to_verdict_s") is not None]
        median = f"{statistics.median(ts):.1f} s" if ts else "-"
        print(f"  {fault:<20} {sum(r['correct'] for r in rs)}/{len(rs)}  {median}")
    failed = [r for r in rows if "error" in r]
    if failed:
        print(f"drills that did not run: {len(failed)} ({'; '.join(r['error'] for r in failed)})")
    return 0 if correct == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
