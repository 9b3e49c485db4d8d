"""How fast the flight-recorder comparison judges a large job: `python benchmarks/bench_fr.py [--ranks N]`.

Builds (untimed) N ranks' decoded dumps, 2,000 entries each (torch's usual
TORCH_FR_BUFFER_SIZE), spread over the default group, a TP group of 8 and a
DP group of N/8, with one rank that stopped early and one with a shape
mismatch. Then it times, side by side, ``analyze_dumps`` (alignment, every
rule, the wavefront) and a baseline that only reads every entry
(``read_entry``), the floor any comparison must pay. Prints medians and the
ratio. Times are CPU time (process_time), so a busy machine skews them less.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from rankscope.analyzers.flight_recorder import analyze_dumps
from rankscope.contract.fr_records import read_entry


def build(ranks: int, per_rank: int) -> dict[int, dict[str, Any]]:
    tp = 8
    out: dict[int, dict[str, Any]] = {}
    for r in range(ranks):
        tp_pg, dp_pg = f"tp{r // tp}", f"dp{r % tp}"
        cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(ranks)))},
               tp_pg: {"name": tp_pg, "desc": "tp", "ranks": str([r // tp * tp + i for i in range(tp)])},
               dp_pg: {"name": dp_pg, "desc": "dp", "ranks": str(list(range(r % tp, ranks, tp)))}}
        seqs = {"0": 0, tp_pg: 0, dp_pg: 0}
        entries = []
        n = per_rank - 3 if r == 5 else per_rank  # rank 5 stopped early
        for i in range(n):
            pg, desc = (("0", "default_pg"), (tp_pg, "tp"), (dp_pg, "dp"))[i % 3]
            seqs[pg] += 1
            shape = [64, 1024] if not (r == 9 and i == per_rank // 2) else [64, 1000]
            entries.append({"record_id": i, "process_group": [pg, desc], "collective_seq_id": seqs[pg],
                            "p2p_seq_id": 0, "profiling_name": "nccl:all_reduce", "input_sizes": [shape],
                            "output_sizes": [shape], "input_dtypes": ["BFloat16"], "output_dtypes": ["BFloat16"],
                            "state": "completed" if i < n - 1 else "started", "is_p2p": False})
        out[r] = {"version": "2.10", "pg_config": cfg, "entries": entries}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    dumps = build(args.ranks, args.entries)
    total = args.ranks * args.entries

    def baseline() -> None:
        for r, d in dumps.items():
            for e in d["entries"]:
                read_entry(e, r)

    timings: dict[str, list[float]] = {"analyze_dumps": [], "read entries only": []}
    result = None
    for _ in range(args.repeat):
        t = time.process_time()
        result = analyze_dumps(dumps)
        timings["analyze_dumps"].append(time.process_time() - t)
        t = time.process_time()
        baseline()
        timings["read entries only"].append(time.process_time() - t)
    assert result is not None
    print(f"{args.ranks} ranks x {args.entries} entries = {total:,} entries")
    for name, ts in timings.items():
        print(f"  {name:>18}: median {statistics.median(ts):.2f} s, best {min(ts):.2f} s")
    ratio = statistics.median(timings["analyze_dumps"]) / statistics.median(timings["read entries only"])
    print(f"  ratio analyze / read: {ratio:.1f}x")
    print(f"  findings: {[(f.kind, f.ranks) for f in result.findings][:4]}")
    print(f"  first wavefront group: {result.wavefront[0].communicator} behind {result.wavefront[0].behind}")


if __name__ == "__main__":
    main()
