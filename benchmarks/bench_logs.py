"""How fast `rankscope analyze` reads a 16k-rank job's pasted logs: `python benchmarks/bench_logs.py`.

Writes (untimed) into a temporary folder:
- ``watchdog/``: one log per rank of 16,384 ranks, as torchrun leaves them:
  a few ordinary lines, the watchdog's timeout line and its PG status line
  (`[rankN]:` prefixed), with two ranks behind (last enqueued work below the
  SeqNum the others time out in) and two that only got the dump signal;
- ``ras.json``: `ncclras -f json` of one 16,384-rank communicator (each rank
  with its status and per-operation counts), three ranks behind in AllReduce
  and one missing.

Then times, each as the whole ``rankscope analyze DIR --json`` run in-process
(reading, the rules, the JSON), the median and best of ``--runs``, and checks
that the planted ranks are named. Goal: under 2 s each.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from rankscope.cli.main import main

WORLD = 16_384
SEQ = 123_456
BEHIND = (5_000, 12_001)
SIGNALLED = (77, 9_999)
RAS_BEHIND = (3, 8_191, 16_000)
RAS_MISSING = 4_242


def write_watchdog(root: Path) -> None:
    root.mkdir()
    for r in range(WORLD):
        pre = f"[rank{r}]:[E603 17:48:01.005271823 ProcessGroupNCCL.cpp:632] "
        pg = f"[rank{r}]:[E603 17:48:01.005538748 ProcessGroupNCCL.cpp:2268] [PG ID 0 PG GUID 0(default_pg) Rank {r}] "
        lines = [f"[rank{r}]: step {SEQ // 7} loss 1.234 lr 3e-4", f"[rank{r}]: W1 NCCL INFO comm 0x7f ready"]
        if r in BEHIND:
            lines.append(f"{pg}Received a dump signal due to a collective timeout from  rank 0 and we will try our "
                         f"best to dump the debug info. Last enqueued NCCL work: {SEQ - 1}, last completed NCCL "
                         f"work: {SEQ - 1}.")
        elif r in SIGNALLED:
            lines.append(f"{pg}Received a dump signal due to a collective timeout from  rank 0 and we will try our "
                         f"best to dump the debug info. Last enqueued NCCL work: {SEQ + 2}, last completed NCCL "
                         f"work: {SEQ - 1}.")
        else:
            lines.append(f"{pre}[Rank {r}] Watchdog caught collective operation timeout: WorkNCCL(SeqNum={SEQ}, "
                         "OpType=ALLREDUCE, NumelIn=8652160, NumelOut=8652160, Timeout(ms)=1800000) ran for 1800068 "
                         "milliseconds before timing out.")
            lines.append(f"{pg} failure detected by watchdog at work sequence id: {SEQ} PG status: last enqueued "
                         f"work: {SEQ + 2}, last completed work: {SEQ - 1}")
        (root / f"rank{r}.log").write_text("\n".join(lines) + "\n")


def write_ras(root: Path) -> None:
    root.mkdir()
    ranks = []
    for r in range(WORLD):
        if r == RAS_MISSING:
            continue
        ranks.append({"rank": r, "host": f"node{r // 8:04d}", "pid": 10_000 + r, "cuda_dev": r % 8,
                      "nvml_dev": r % 8, "status": {"init_state": 0, "async_error": 0, "finalize_called": False,
                                                    "destroy_flag": False, "abort_flag": False},
                      "collective_counts": {"Broadcast": 2, "Reduce": 0, "AllGather": 640,
                                            "ReduceScatter": 640, "AllReduce": 9_000 if r in RAS_BEHIND else 9_001}})
    doc = {"nccl_version": "2.28.7", "cuda_runtime_version": 12090, "cuda_driver_version": 12090,
           "timestamp": "2026-11-27 09:00:00", "communicators_count": 1,
           "communicators": [{"hash": "0xfa93daea854b060b", "secondary_hash": "0x1:0x2", "size": WORLD,
                              "ranks_count": WORLD - 1, "missing_ranks_count": 1, "ranks": ranks,
                              "missing_ranks": [{"rank": RAS_MISSING, "host": f"node{RAS_MISSING // 8:04d}",
                                                 "pid": 10_000 + RAS_MISSING, "cuda_dev": 2, "nvml_dev": 2,
                                                 "status": {"unresponsive": True, "considered_dead": False}}]}],
           "ras": {"collection_time_sec": 1.5, "timeouts_count": 0}}
    (root / "ras.json").write_text(json.dumps(doc, indent=2))


def run_once(path: Path) -> tuple[float, dict[str, object]]:
    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = main(["analyze", str(path), "--json"])
    took = time.perf_counter() - t0
    if code != 0:
        raise SystemExit(f"rankscope analyze {path} exited {code}")
    data: dict[str, object] = json.loads(out.getvalue())
    return took, data


def bench(name: str, path: Path, runs: int, expect: set[int]) -> None:
    times = []
    data: dict[str, object] = {}
    for _ in range(runs):
        took, data = run_once(path)
        times.append(took)
    named = {r for s in data["suspects"] for r in s["ranks"]}  # type: ignore[union-attr,index]
    ok = expect <= named
    print(f"{name}: median {statistics.median(times):.2f} s, best {min(times):.2f} s over {runs} runs; "
          f"verdict: {data['summary']}; planted ranks named: {'yes' if ok else 'NO ' + str(sorted(named)[:10])}")
    if not ok:
        sys.exit(1)


def main_() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        write_watchdog(root / "watchdog")
        write_ras(root / "ras")
        print(f"wrote {WORLD:,} ranks' watchdog logs and a {WORLD:,}-rank RAS JSON "
              f"({(root / 'ras' / 'ras.json').stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.1f} s")
        bench("watchdog logs, 16,384 files", root / "watchdog", args.runs, set(BEHIND))
        bench("RAS JSON, 16,384 ranks", root / "ras", args.runs, set(RAS_BEHIND) | {RAS_MISSING})


if __name__ == "__main__":
    main_()
