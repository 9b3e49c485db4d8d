"""benchmarks/bench_shim.py's summary: the shim's extra cost per call and its ratio, from the ranks' figures."""

from __future__ import annotations

import sys

from repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_shim


def rank(r: int, settled: bool = True) -> dict[str, object]:
    return {"rank": r, "us_per_call": {"sync_plain": 10.0, "sync_shim": 11.5, "async_plain": 12.0, "async_shim": 14.0},
            "cpu_us_per_call": {"sync_plain": 4.0, "sync_shim": 5.25, "async_plain": 5.0, "async_shim": 6.0},
            "writer_us": 0.75, "collectives": 24200, "shim_counts": {"cl": 12100, "wr": 12100, "wc": 12100 if settled else 12099},
            "settled": settled, "device": "cpu", "torch": "2.13.0"}


def test_the_summary_takes_rank_0s_figures_and_every_ranks_settling() -> None:
    job = {"exit_code": 0, "ranks": [rank(0), rank(1, settled=False)], "all_ranks_reported": True, "tail": ""}
    got = bench_shim.summarize(job)
    assert (got["sync_shim_extra_us"], got["sync_shim_ratio"], got["async_shim_extra_us"]) == (1.5, 1.15, 2.0)
    assert (got["sync_shim_extra_cpu_us"], got["async_shim_extra_cpu_us"], got["writer_us"]) == (1.25, 1.0, 0.75)
    assert got["counters_settled"] is False  # one rank's WC lagged its WR: the whole run says so
    text = "\n".join(bench_shim.report_lines({"backend": "gloo", "world": 2, "rounds": 3, "calls_per_block": 2000,
                                              "shim": got}))
    assert "sync  plain     10.00 µs   shim     11.50 µs   +1.50 µs (1.150x)" in text
    assert "calling thread's CPU: plain 4.00 µs, shim 5.25 µs, +1.25 µs" in text
    assert "the counter writer alone (launch + completion): 0.75 µs" in text
    assert "NOT settled: WC < WR" in text


def test_a_run_where_no_rank_reported_says_so() -> None:
    got = bench_shim.summarize({"exit_code": 1, "ranks": [], "all_ranks_reported": False, "tail": "boom"})
    assert got == {"error": "no rank reported (exit code 1)", "tail": "boom"}
    text = "\n".join(bench_shim.report_lines({"backend": "gloo", "world": 1, "rounds": 3, "calls_per_block": 2000,
                                              "shim": got}))
    assert "native shim (plain vs the C wrapper): ERROR no rank reported (exit code 1)" in text


def test_plain_python_and_native_figures_stand_side_by_side() -> None:
    native = bench_shim.summarize({"exit_code": 0, "ranks": [{**rank(0), "path": "native"}], "all_ranks_reported": True,
                                   "tail": ""})
    slow = {**rank(0), "us_per_call": {"sync_plain": 10.5, "sync_shim": 14.5, "async_plain": 12.5, "async_shim": 19.0},
            "path": "python"}
    python = bench_shim.summarize({"exit_code": 0, "ranks": [slow], "all_ranks_reported": True, "tail": ""})
    assert (native["path"], python["path"]) == ("native", "python")
    text = "\n".join(bench_shim.report_lines({"backend": "gloo", "world": 1, "rounds": 3, "calls_per_block": 2000,
                                              "shim": native, "python_shim": python}))
    assert ("    sync  plain    10.00   Python shim    14.50 (+4.00, 1.381x)   native shim    11.50 (+1.50, 1.150x)"
            in text), text
    assert ("    async plain    12.00   Python shim    19.00 (+6.50, 1.520x)   native shim    14.00 (+2.00, 1.167x)"
            in text), text
    assert "Python shim (plain vs the Python wrapper) on cpu" in text and "fast path did not build" not in text
    text = "\n".join(bench_shim.side_by_side({"shim": {**native, "path": "python"}, "python_shim": python}))
    assert "the native run counted in Python: the fast path did not build there" in text
