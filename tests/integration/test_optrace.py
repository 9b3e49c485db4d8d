"""Per-operation traces as a fail-slow source: the three real ByteDance traces, constructed ones, bad input.

Why the three real traces get the verdicts asserted below (figures from the
data, per step, each worker against the median of its own pipeline stage):

- AR (dp 4, pp 4, tp 4; 16 recorded workers, 44 steps): rank 0 (stage 0, dp
  rank 0) spends 2.50× its stage peers' time in forward compute, 2.27× in
  backward and 2.23× in the optimizer, in every one of the 44 steps; every
  other worker is within 1 % of its peers. The other stages of its
  data-parallel replica (ranks 16, 32, 48) spend hundreds of times their
  peers' time in backward sends, but a send lasts until the receiver takes
  it: they wait for rank 0 (victims), and the other replicas wait seconds in
  grads-reduce-scatter for that replica. Verdict: rank 0 is a slow worker,
  in compute; no stage is slow (stage compute medians 19.2–20.1 s a step).
- ST (dp 2, pp 4; 8 workers, 32 steps): stage 3 computes 1.62× the other
  stages in all 32 steps, and its two workers are within 0.7 % of each other;
  no worker is 1.2× its stage peer in any lasting way (the largest median
  ratio is 1.004). Verdict: stage 3 is slow, a partition imbalance (the last
  stage carries the loss head), not a machine; no single worker is to blame.
- SE (dp 32, pp 2, dsp 2; 64 workers, 43 steps): the work varies from
  micro-batch to micro-batch (forward compute's coefficient of variation is
  22 % on a median worker, against 2–3 % in the other two traces), the
  slowest worker of a stage changes in 91 % of the steps and no worker's
  median ratio to its peers exceeds 1.05. Verdict: no single worker is to
  blame; stage 1 computes 1.32× stage 0 even at its fastest worker in every
  step, so it is also named as a slow stage.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rankscope.analyzers.optrace import TraceError, analyze_trace
from rankscope.contract.errors import RankscopeError
from rankscope.formats.optrace_io import read_op_trace, read_trace_meta
from repo_paths import shared

_FIRST_TRACE = shared("external", "bytedance-straggler-traces", "trace-AR.parquet")
TRACES = _FIRST_TRACE.parent if _FIRST_TRACE is not None else None
needs_traces = pytest.mark.skipif(TRACES is None, reason="the shared ByteDance traces are not here (set RANKSCOPE_SHARED)")


def load(name: str) -> dict[str, object]:
    pytest.importorskip("pyarrow")
    assert TRACES is not None
    return read_op_trace(TRACES / f"trace-{name}.parquet")


@needs_traces
def test_ar_trace_names_rank_0_slow_in_compute_and_its_replica_as_victims() -> None:
    v = analyze_trace(load("AR"))
    assert (v.workers, v.stages, v.steps) == (16, 4, 44)
    assert {w.rank for w in v.slow_workers} == {0}
    ops = {w.op: w for w in v.slow_workers}
    assert set(ops) == {"forward-compute", "backward-compute", "optimizer"}
    assert all(w.kind == "compute" and w.stage == 0 and w.dp_rank == 0 and w.steps_slow == w.steps == 44
               for w in v.slow_workers)
    assert 2.4 < ops["forward-compute"].ratio < 2.6 and 2.2 < ops["backward-compute"].ratio < 2.4
    assert v.victims == (16, 32, 48)
    assert not v.slow_stages and not v.no_single_worker
    assert v.summary.startswith("slow worker: rank 0 (stage 0, dp rank 0)")


@needs_traces
def test_st_trace_names_stage_3_a_partition_imbalance_and_no_worker() -> None:
    v = analyze_trace(load("ST"))
    assert (v.workers, v.stages, v.steps) == (8, 4, 32)
    assert v.no_single_worker
    assert [s.stage for s in v.slow_stages] == [3]
    s = v.slow_stages[0]
    assert 1.55 < s.ratio < 1.7 and s.steps_slow == s.steps == 32 and s.spread < 1.01
    assert "partition imbalance" in v.summary and "no single worker" in v.summary


@needs_traces
def test_se_trace_blames_no_worker_the_work_varies_per_micro_batch() -> None:
    v = analyze_trace(load("SE"))
    assert (v.workers, v.stages, v.steps) == (64, 2, 43)
    assert v.no_single_worker and not v.victims
    assert v.compute_cv > 0.15 and v.slowest_changes > 0.8  # varying work, a different slowest worker each step
    assert [s.stage for s in v.slow_stages] == [1] and 1.2 < v.slow_stages[0].ratio < 1.45


@needs_traces
def test_meta_files_read_as_flat_key_values() -> None:
    assert TRACES is not None
    meta = read_trace_meta(TRACES / "meta-AR.yaml")
    assert (meta["dp_size"], meta["pp_size"], meta["tp_size"], meta["world_size"]) == ("4", "4", "4", "64")


@needs_traces
def test_cli_prints_the_verdict_as_json() -> None:
    assert TRACES is not None
    pytest.importorskip("pyarrow")
    out = subprocess.run([sys.executable, "-m", "rankscope", "analyze", "--op-trace", str(TRACES / "trace-ST.parquet"),
                          "--trace-meta", str(TRACES / "meta-ST.yaml"), "--json"], capture_output=True, text=True,
                         check=True)
    data = json.loads(out.stdout)
    assert data["no_single_worker"] and [s["stage"] for s in data["slow_stages"]] == [3]
    assert data["meta"]["pp_size"] == "4"


@needs_traces
def test_a_trace_given_where_a_bundle_goes_is_read_as_a_trace(tmp_path: Path) -> None:
    """`rankscope analyze trace-AR.parquet` (no flag) gives the --op-trace verdict, told by the parquet bytes."""
    assert TRACES is not None
    pytest.importorskip("pyarrow")

    def analyze(*args: str) -> dict[str, object]:
        out = subprocess.run([sys.executable, "-m", "rankscope", "analyze", *args, "--json"], capture_output=True,
                             text=True, check=True)
        return json.loads(out.stdout)  # type: ignore[no-any-return]

    trace = str(TRACES / "trace-AR.parquet")
    assert analyze(trace) == analyze("--op-trace", trace)
    # a CSV with the trace's columns too (by its header), wherever it is
    cols = synthetic(slow={(1, "forward-compute"): 2.0})
    csv_path = tmp_path / "trace.csv"
    names = list(cols)
    csv_path.write_text("\n".join([",".join(names)] + [",".join(str(cols[n][i]) for n in names)
                                                      for i in range(len(cols["rank"]))]) + "\n")
    slow = analyze(str(csv_path))["slow_workers"]
    assert isinstance(slow, list) and {(w["rank"], w["op"]) for w in slow} == {(1, "forward-compute")}
    # the traces' folder itself: named for what it holds, with a command that reads one
    out = subprocess.run([sys.executable, "-m", "rankscope", "analyze", str(TRACES)], capture_output=True, text=True)
    assert out.returncode == 2 and "it holds op trace(s): trace-AR.parquet, trace-SE.parquet, trace-ST.parquet" \
        in out.stderr and f"rankscope analyze {trace}" in out.stderr, out.stderr


def test_op_trace_sniffing_never_raises_and_needs_the_magic_or_the_columns(tmp_path: Path) -> None:
    from rankscope.formats.optrace_io import looks_like_op_trace

    cases = {"a.parquet": b"PAR1rest", "b.csv": b"dp_rank,stage,rank,step,optype,duration\n0,0,0,0,x,1\n",
             "c.csv": b"rank,value\n1,2\n", "d.txt": b"optype,duration\n", "e.json": b"{}", "f": b""}
    for name, raw in cases.items():
        (tmp_path / name).write_bytes(raw)
    assert [n for n in cases if looks_like_op_trace(tmp_path / n)] == ["a.parquet", "b.csv"]
    assert not looks_like_op_trace(tmp_path / "absent")


@settings(max_examples=150, deadline=None)
@given(raw=st.binary(max_size=300), suffix=st.sampled_from(["", ".csv", ".parquet", ".txt"]))
def test_fuzz_op_trace_sniffing_is_a_yes_or_no_for_any_bytes(raw: bytes, suffix: str) -> None:
    from rankscope.formats.optrace_io import looks_like_op_trace

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"t{suffix}"
        path.write_bytes(raw)
        found = looks_like_op_trace(path)
        assert found in (True, False)
        assert found or not raw.startswith(b"PAR1")  # parquet's magic is always enough
        assert not found or raw.startswith(b"PAR1") or suffix == ".csv"  # else only a CSV, by its header


# ---- constructed traces --------------------------------------------------------


def synthetic(*, slow: dict[tuple[int, str], float] | None = None, stage_factor: dict[int, float] | None = None,
              workers: int = 4, stages: int = 2, steps: int = 10, seed: int = 0) -> dict[str, list[object]]:
    """Workers rank = stage * workers + dp; per step 4 micro-batches of each op with 2 % noise."""
    rng = np.random.default_rng(seed)
    cols: dict[str, list[object]] = {k: [] for k in ("dp_rank", "stage", "rank", "step", "optype", "duration")}
    base = {"forward-compute": 0.1, "backward-compute": 0.2, "optimizer": 0.02, "forward-send": 0.01,
            "backward-send": 0.01, "grads-reduce-scatter": 0.05}
    for s in range(stages):
        for d in range(workers):
            r = s * workers + d
            for step in range(steps):
                for op, t in base.items():
                    for _ in range(4 if "compute" in op or "send" in op else 1):
                        f = (slow or {}).get((r, op), 1.0) * ((stage_factor or {}).get(s, 1.0) if "compute" in op else 1.0)
                        for k, v in (("dp_rank", d), ("stage", s), ("rank", r), ("step", step), ("optype", op),
                                     ("duration", t * f * (1 + 0.02 * rng.standard_normal()))):
                            cols[k].append(v)
    return cols


def test_constructed_slow_worker_and_slow_link_are_told_apart() -> None:
    v = analyze_trace(synthetic(slow={(5, "backward-compute"): 1.6, (2, "forward-send"): 3.0}))
    got = {(w.rank, w.op, w.kind) for w in v.slow_workers}
    assert got == {(5, "backward-compute", "compute"), (2, "forward-send", "communication")}
    assert not v.slow_stages


def test_constructed_healthy_trace_blames_nobody() -> None:
    v = analyze_trace(synthetic())
    assert v.no_single_worker and not v.slow_stages and "no single worker" in v.summary


def test_constructed_heavy_stage_is_a_stage_not_its_workers() -> None:
    v = analyze_trace(synthetic(stage_factor={1: 1.5}))
    assert v.no_single_worker and [s.stage for s in v.slow_stages] == [1]


def test_a_slowed_worker_does_not_make_its_stage_slow() -> None:
    v = analyze_trace(synthetic(slow={(4, "forward-compute"): 3.0, (4, "backward-compute"): 3.0}))
    assert {w.rank for w in v.slow_workers} == {4} and not v.slow_stages


def test_csv_with_the_same_columns_reads_without_pyarrow(tmp_path: Path) -> None:
    cols = synthetic(slow={(1, "forward-compute"): 2.0})
    path = tmp_path / "trace.csv"
    names = list(cols)
    lines = [",".join(names)] + [",".join(str(cols[n][i]) for n in names) for i in range(len(cols["rank"]))]
    path.write_text("\n".join(lines) + "\n")
    v = analyze_trace(read_op_trace(path))
    assert {(w.rank, w.op) for w in v.slow_workers} == {(1, "forward-compute")}


# ---- bad input -----------------------------------------------------------------


def test_missing_column_and_empty_trace_are_named() -> None:
    cols = synthetic()
    del cols["stage"]
    with pytest.raises(TraceError, match="'stage'"):
        analyze_trace(cols)
    with pytest.raises(TraceError, match="no rows"):
        analyze_trace({k: [] for k in ("dp_rank", "stage", "rank", "step", "optype", "duration")})


def test_missing_pyarrow_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    path = tmp_path / "t.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(RankscopeError) as err:
        read_op_trace(path)
    assert "pyarrow" in err.value.message and "rankscope[traces]" in err.value.fix


def test_a_file_that_is_not_parquet_is_an_error_with_a_fix(tmp_path: Path) -> None:
    pytest.importorskip("pyarrow")
    path = tmp_path / "t.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(RankscopeError, match="not a readable parquet"):
        read_op_trace(path)


def test_bad_meta_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "meta.yaml"
    path.write_text("dp_size: 2\njust words\n")
    with pytest.raises(RankscopeError, match="line 2"):
        read_trace_meta(path)


row = st.fixed_dictionaries({
    "dp_rank": st.integers(-2, 3), "stage": st.integers(-1, 2), "rank": st.integers(-1, 9), "step": st.integers(0, 4),
    "optype": st.sampled_from(["forward-compute", "backward-compute", "forward-send", "optimizer", "gc", "x"]),
    "duration": st.one_of(st.floats(0, 10), st.just(float("nan")), st.just(-1.0), st.text(max_size=3)),
})


@given(st.lists(row, max_size=60))
@settings(max_examples=200, deadline=None)
def test_any_rows_give_a_verdict_or_a_trace_error(rows: list[dict[str, object]]) -> None:
    cols = {k: [r[k] for r in rows] for k in ("dp_rank", "stage", "rank", "step", "optype", "duration")}
    try:
        v = analyze_trace(cols)
    except TraceError as exc:
        assert str(exc)
    else:
        assert v.workers >= 1 and v.summary
