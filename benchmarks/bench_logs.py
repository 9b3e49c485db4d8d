"""How fast `rankscope analyze` reads a 16k-rank job's pasted logs: `python benchmarks/bench_logs.py`.

Writes (untimed) into a temporary folder:
- ``watchdog/``: one log per rank of 16,384 ranks, as torchrun leaves them:
  a few ordinary lines, the watchdog's timeout line and its PG status line
  (`[rankN]:` prefixed), with two ranks behind (last enqueued work below the
  SeqNum the others time out in) and two that only got the dump signal;
- ``ras.json``: `ncclras -f json` of one 16,384-rank communicator (each rank
  with its status and per-operation counts), three ranks behind in AllReduce
  and one missing;
- ``crash/``: a crashed job's logs, one per rank of 16,384: each rank's NCCL
  Bootstrap line, then the IB completion error that names the NIC of the
  planted node and a DistBackendError (every rank off that node), plus the
  planted node's kernel log with its NIC link down;
- ``ras-blocks.txt``: `ncclras` text with 200,000 INCOMPLETE communicator
  blocks naming processes on one host (many small communicators of one
  machine that stopped answering): the rules fold them into one suspect.

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


CRASH_NODE = 777  # the node whose NIC went down: ranks 6216-6223
RAS_BLOCKS = 200_000


def write_crash(root: Path) -> None:
    root.mkdir()
    bad_ip = f"10.{CRASH_NODE // 256}.{CRASH_NODE % 256}.1"
    for r in range(WORLD):
        node = r // 8
        ip = f"10.{node // 256}.{node % 256}.1"
        pre = f"[rank{r}]:node{node:04d}:{20_000 + r}:{20_000 + r} [{r % 8}] "
        lines = [f"{pre}NCCL INFO Bootstrap : Using eth0:{ip}<0>", f"[rank{r}]: step 9000 loss 1.234"]
        if node != CRASH_NODE:
            lines += [f"{pre}transport/net_ib.cc:1696 NCCL WARN NET/IB : Got completion from peer {bad_ip}<4{r % 10}211> "
                      f"with status=12 opcode=0 len=0 vendor err 129 (Recv) localGid ::ffff:{ip} remoteGids::ffff:"
                      f"{bad_ip}",
                      f"[rank{r}]:torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
                      "NCCLUtils.hpp:317, remote process exited or there was a network error, NCCL version 2.21.5"]
        (root / f"rank{r}.log").write_text("\n".join(lines) + "\n")
    (root / f"node{CRASH_NODE:04d}-kern.log").write_text(
        f"May  2 10:11:02 node{CRASH_NODE:04d} kernel: mlx5_core 0000:5e:00.0 ib0: Link down\n")


def write_ras_blocks(root: Path) -> None:
    root.mkdir()
    blocks = [f"#0-{i} ({i:016x}) INCOMPLETE\n  Missing communicator data from 1 rank\n"
              f"  Rank {i % 8} -- GPU {i % 8} managed by process {30_000 + i % 8} on node stuck-node\n"
              for i in range(RAS_BLOCKS)]
    (root / "ras-blocks.txt").write_text("Errors\n======\n\n" + "\n".join(blocks))


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


def bench(name: str, path: Path, runs: int, expect: set[int], machine: str | None = None) -> None:
    times = []
    data: dict[str, object] = {}
    for _ in range(runs):
        took, data = run_once(path)
        times.append(took)
    named = {r for s in data["suspects"] for r in s["ranks"]}  # type: ignore[union-attr,index]
    ok = expect <= named and (machine is None or data["suspects"][0]["machines"] == [machine])  # type: ignore[index]
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
        write_crash(root / "crash")
        write_ras_blocks(root / "blocks")
        bench("crash logs, 16,384 ranks and a kernel log", root / "crash", args.runs, set(),
              machine=f"node{CRASH_NODE:04d}")
        bench(f"RAS text, {RAS_BLOCKS:,} blocks on one host", root / "blocks", args.runs, set(), machine="stuck-node")


if __name__ == "__main__":
    main_()
