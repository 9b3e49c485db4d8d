"""benchmarks/bench_shim.py's summary: the shim's extra cost per call and its ratio, from the ranks' figures."""

from __future__ import annotations

import sys

import pytest
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


def test_repeated_runs_report_the_min_and_median_of_each_paths_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """The machine may be loaded by other work: each run is one sample, and the figures are their min and median."""
    extras = iter([(1.0, 5.0), (3.0, 2.5), (2.0, 1.5)])  # (native sync extra, native async extra) per run

    def one_run(*_args: object, **_kwargs: object) -> dict[str, object]:
        sync, async_ = next(extras)
        us = {"sync_plain": 30.0, "sync_shim": 30.0 + sync, "async_plain": 32.0, "async_shim": 32.0 + async_}
        native = bench_shim.summarize({"exit_code": 0, "all_ranks_reported": True, "tail": "", "ranks": [
            {**rank(0), "us_per_call": us, "path": "native", "wrapper_us": {"sync": 0.25 * sync, "async": 0.5}}]})
        return {"backend": "gloo", "world": 1, "rounds": 3, "calls_per_block": 400, "block": 20, "shim": native}

    monkeypatch.setattr(bench_shim, "bench", one_run)
    got = bench_shim.repeated("gloo", 1, 400, 3, 3, ROOT, ("native",))
    s = got["summary"]["shim"]
    assert s["sync_extra_us"] == {"min": 1.0, "median": 2.0, "runs": 3}
    assert s["async_extra_us"] == {"min": 1.5, "median": 2.5, "runs": 3}
    assert s["sync_ratio"]["min"] == 1.033 and s["sync_wrapper_us"]["median"] == 0.5
    text = "\n".join(bench_shim.repeated_lines(got))
    assert "native shim sync  extra +1.00 / +2.00 µs   ratio 1.033 / 1.067x" in text, text
    assert "wrapper around a no-op +0.25 / +0.50 µs" in text, text
    assert text.count("run ") == 3 and "the wrapper around a no-op (its own work, no collective): sync +0.25 µs" \
        not in text  # each run's side by side, the summary's figures once
