"""The flight-recorder comparison: PyTorch's own fr_trace test cases give PyTorch's answers, the rules one
by one, damaged dumps, the laggard wavefront, and fuzzing of the reader and the analyzer."""

from __future__ import annotations

import json
import pickle
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from rankscope.analyzers.findings import NOT_A_RANK, Finding, finding_to_json
from rankscope.analyzers.flight_recorder import ADVICE, SERIOUS, FrAnalysis, analyze_dumps, wavefront_line
from rankscope.cli.main import main
from rankscope.contract.errors import RankscopeError
from rankscope.formats.flight_recorder import read_flight_recorder_dir
from repo_paths import shared

FIXTURES = shared("external", "pytorch-fr-test-fixtures")
needs_fixtures = pytest.mark.skipif(FIXTURES is None, reason="shared/external/pytorch-fr-test-fixtures not found")


def entry(record: int, op: str, ins: Any, outs: Any, *, seq: int = 0, state: str = "completed",
          pg: tuple[str, str] = ("0", "default_pg"), in_dt: Any = "float32", out_dt: Any = "float32",
          p2p: bool = False, p2p_seq: int = 0) -> dict[str, Any]:
    """An entry with the fields PyTorch's dumps have (dtypes a string, as in its tests, or a list)."""
    return {"record_id": record, "profiling_name": f"nccl:{op}", "state": state, "process_group": list(pg),
            "input_sizes": ins, "output_sizes": outs, "input_dtypes": in_dt, "output_dtypes": out_dt,
            "collective_seq_id": str(seq), "p2p_seq_id": str(p2p_seq), "time_created_ns": 0, "frames": [],
            "is_p2p": p2p}


def dumps(*per_rank: list[dict[str, Any]], members: str = "") -> dict[int, dict[str, Any]]:
    ranks = members or str(list(range(len(per_rank))))
    cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}}
    return {r: {"entries": es, "pg_config": cfg, "rank": r, "version": "2.8"} for r, es in enumerate(per_rank)}


def kinds(a: FrAnalysis) -> list[tuple[str, tuple[int, ...]]]:
    return [(f.kind, f.ranks) for f in a.findings]


# ---------------------------------------------------------------- PyTorch's test cases


@needs_fixtures
def test_case1_matched_all_reduce_passes_like_pytorch() -> None:
    assert FIXTURES is not None
    report = read_flight_recorder_dir(FIXTURES / "case1-matched", None)
    assert report.verdict.findings == ()
    # three collectives, as build_db counts them: "1" on rank 0 ([0]) and on rank 1 ([1]) are two groups
    waves = report.analysis.wavefront
    assert [(w.communicator, w.members, w.head_seq, w.lagging) for w in waves] == [
        ("0:default_pg", (0, 1), 0, False), ("1:sub_pg [0]", (0,), 0, False), ("1:sub_pg [1]", (1,), 0, False)]


@needs_fixtures
def test_case4_size_mismatch_fails_the_second_broadcast_like_pytorch(capsys: pytest.CaptureFixture[str]) -> None:
    assert FIXTURES is not None
    report = read_flight_recorder_dir(FIXTURES / "case4-size-mismatch", None)
    # PyTorch: one collective, record 1, _broadcast_oop, pass_check False
    assert report.verdict.findings == (Finding(
        "fr-size-mismatch", (0, 1),
        "input_sizes disagree at _broadcast_oop seq 0, record 1 in pg 0:default_pg: rank 0 [[5, 5]] vs rank 1 [[4, 4]]",
        ("rank 0: [[5, 5]]", "rank 1: [[4, 4]]"), "0:default_pg", ADVICE["fr-size-mismatch"]),)
    assert report.verdict.summary.startswith("flight recorder: input_sizes disagree at _broadcast_oop")
    code = main(["analyze", "--flight-recorder", str(FIXTURES / "case4-size-mismatch"), "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0
    assert data["findings"] == [finding_to_json(report.verdict.findings[0])]
    assert data["fr_wavefront"][0]["communicator"] == "0:default_pg" and data["fr_wavefront"][0]["ahead"] == []
    code = main(["analyze", "--flight-recorder", str(FIXTURES / "case4-size-mismatch")])
    text = capsys.readouterr().out
    assert "[fr-size-mismatch] ranks 0-1 on 0:default_pg: input_sizes disagree at _broadcast_oop" in text
    assert "pg 0:default_pg: all 2 rank(s) at seq 0" in text


@needs_fixtures
def test_a_folder_of_dumps_given_as_the_argument_is_read_as_flight_recorder_dumps(
        capsys: pytest.CaptureFixture[str]) -> None:
    """What a new user types first: `rankscope analyze DIR`. The folder is told by its files, not by a flag."""
    assert FIXTURES is not None
    folder = FIXTURES / "case4-size-mismatch"
    assert main(["analyze", "--flight-recorder", str(folder), "--json"]) == 0
    flagged = json.loads(capsys.readouterr().out)
    assert main(["analyze", str(folder), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == flagged
    # one rank's file: refused with the folder to pass, never "not a bundle"
    assert main(["analyze", str(folder / "dump_file_rank_0.json")]) == 2
    err = capsys.readouterr().err
    assert "one rank's PyTorch flight recorder dump" in err and f"rankscope analyze {folder}" in err
    # the folder given as py-spy dumps: named for what it is, with the flag to use
    assert main(["analyze", "--dumps", str(folder)]) == 2
    err = capsys.readouterr().err
    assert "holds PyTorch flight recorder dumps, not py-spy dumps" in err and f"--flight-recorder {folder}" in err


def test_dump_sniffing_tells_pickles_and_json_objects_from_py_spy_and_bundles(tmp_path: Path) -> None:
    from rankscope.formats.flight_recorder import holds_dumps, looks_like_dump

    files = {"rank0": pickle.dumps({"entries": [], "version": "2.8", "pg_config": {}}),
             "rank1.json": json.dumps({"version": "2.8", "pg_config": {}, "entries": []}).encode(),
             "rank2.txt": b"Process 4242: python train.py\nPython v3.11.7 (/usr/bin/python3)\n\nThread 4242 (idle)\n",
             "rank3.json": b'[{"pid": 4242, "thread_id": 1, "frames": []}]',
             "bundle.json": b'{"format": "rankscope.bundle", "version": 3, "entries": []}'}
    for name, raw in files.items():
        (tmp_path / name).write_bytes(raw)
    assert [n for n in files if looks_like_dump(tmp_path / n)] == ["rank0", "rank1.json"]
    assert not looks_like_dump(tmp_path / "absent")
    assert not holds_dumps(tmp_path)  # py-spy dumps among them: not a flight recorder folder
    for name in ("rank2.txt", "rank3.json"):
        (tmp_path / name).unlink()
    assert holds_dumps(tmp_path) and not holds_dumps(tmp_path / "absent")


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=600), dump=st.dictionaries(st.text(max_size=8), st.integers(), max_size=4))
def test_fuzz_dump_sniffing_never_raises_and_knows_every_pickle(tmp_path: Path, raw: bytes, dump: dict[str, int]) -> None:
    from rankscope.formats.flight_recorder import looks_like_dump

    (tmp_path / "any").write_bytes(raw)
    assert looks_like_dump(tmp_path / "any") in (True, False)
    (tmp_path / "pickled").write_bytes(pickle.dumps({"entries": [], **dump}))
    assert looks_like_dump(tmp_path / "pickled")


@needs_fixtures
def test_case6_empty_coalesced_on_rank0_names_rank0_missing_like_pytorch(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert FIXTURES is not None
    report = read_flight_recorder_dir(FIXTURES / "case6-empty-coalesced-on-rank0", None)
    # PyTorch: all_reduce matched; _reduce_oop record 1 "not all ranks joining", missing rank 0, no mismatch
    assert kinds(report.analysis) == [("fr-missing-ranks", (0,))]
    f = report.analysis.findings[0]
    assert f.summary == "rank(s) 0 never joined _reduce_oop seq 0, record 1 in pg 0:default_pg"
    assert f.evidence == ("rank 1 recorded _reduce_oop seq 0, record 1 in pg 0:default_pg",
                          "rank 0: last entry seq 0 (all_reduce, completed)")
    (w,) = report.analysis.wavefront
    assert (w.behind, w.ahead, w.next_op) == ((0,), (1,), "_reduce_oop seq 0")
    main(["analyze", "--flight-recorder", str(FIXTURES / "case6-empty-coalesced-on-rank0")])
    assert ("pg 0:default_pg: rank(s) 0 behind at seq 0 (1 op); rank(s) 1 at seq 0 (4 ops) "
            "(next: _reduce_oop seq 0)") in capsys.readouterr().out


# ---------------------------------------------------------------- the rules, after fr_trace's match cases


def _pair(a: dict[str, Any], b: dict[str, Any]) -> FrAnalysis:
    return analyze_dumps(dumps([a], [b]))


def test_op_type_mismatch_stops_further_comparison() -> None:
    got = _pair(entry(0, "all_reduce", [[4, 4]], [[4, 4]]), entry(0, "all_gather", [[4, 4]], [[9]]))
    assert kinds(got) == [("fr-op-mismatch", (0, 1))]
    assert got.findings[0].evidence == ("rank 0: all_reduce", "rank 1: all_gather")


def test_sizes_inputs_then_outputs_then_each_ops_own_rule() -> None:
    base = entry(0, "all_reduce", [[4, 4]], [[4, 4]])
    assert "input_sizes" in _pair(base, entry(0, "all_reduce", [[5, 4]], [[4, 4]])).findings[0].summary
    out = _pair(base, entry(0, "all_reduce", [[4, 4]], [[5, 4]]))
    assert kinds(out) == [("fr-size-mismatch", (0, 1)), ("fr-size-mismatch", (1,))]
    assert "output_sizes" in out.findings[0].summary and "keeps the shape" in out.findings[1].evidence[0]
    both = entry(0, "all_reduce", [[4, 4]], [[5, 4]])  # the same wrong call on both ranks: its own rule fails
    assert kinds(_pair(both, both)) == [("fr-size-mismatch", (0, 1))]
    ag = entry(0, "all_gather_into_tensor_coalesced", [[4, 4]], [[32]])
    assert kinds(_pair(ag, ag)) == []
    bad_ag = entry(0, "_all_gather_base", [[4, 4]], [[16]])
    assert kinds(_pair(bad_ag, bad_ag)) == [("fr-size-mismatch", (0, 1))]
    rs = entry(0, "reduce_scatter", [[4, 4]], [[8]])
    assert kinds(_pair(rs, rs)) == []
    bad_rs = entry(0, "_reduce_scatter_base", [[4, 4]], [[4, 4]])
    assert "x group size 2" in _pair(bad_rs, bad_rs).findings[0].evidence[0]


def test_uneven_sizes_by_design_are_not_mismatches_but_all_to_all_totals_are_checked() -> None:
    a2a = _pair(entry(0, "all_to_all", [[4, 4]], [[2, 4]]), entry(0, "all_to_all", [[2, 4]], [[4, 4]]))
    assert kinds(a2a) == []
    bad = _pair(entry(0, "all_to_all", [[4, 4]], [[4, 4]]), entry(0, "all_to_all", [[4, 4]], [[2, 4]]))
    assert kinds(bad) == [("fr-size-mismatch", (0, 1))]
    assert bad.findings[0].evidence == ("total input numel 32 vs total output numel 24 over the group",)
    g1 = entry(0, "gather", [[4, 4]], [[4, 4], [4, 4]])
    for other in (entry(0, "gather", [[4, 4]], [[]], out_dt=""), entry(0, "gather", [[4, 4]], [[4, 4]], out_dt="")):
        assert kinds(_pair(g1, other)) == []
    assert kinds(_pair(entry(0, "all_gather_v", [[4]], [[9]]), entry(0, "all_gather_v", [[5]], [[9]]))) == []


def test_dtype_and_state_mismatches() -> None:
    f32 = entry(0, "all_reduce", [[4, 4]], [[4, 4]])
    f16 = entry(0, "all_reduce", [[4, 4]], [[4, 4]], out_dt="float16")
    got = _pair(f16, f32)
    assert kinds(got) == [("fr-dtype-mismatch", (0, 1)), ("fr-dtype-mismatch", (0,))]
    assert "output_dtypes" in got.findings[0].summary and got.findings[1].evidence == (
        "rank 0: input ['float32'] but output ['float16']",)
    lists = _pair(entry(0, "all_reduce", [[4]], [[4]], in_dt=["Float"], out_dt=["Float"]),
                  entry(0, "all_reduce", [[4]], [[4]], in_dt=["BFloat16"], out_dt=["BFloat16"]))
    assert kinds(lists) == [("fr-dtype-mismatch", (0, 1))]
    state = _pair(entry(0, "all_reduce", [[4, 4]], [[4, 4]], state="scheduled"), f32)
    assert kinds(state) == [("fr-state-mismatch", (0, 1))]
    assert state.findings[0].summary.endswith("rank 0 scheduled vs rank 1 completed")


def test_the_majority_is_taken_as_right_and_the_odd_rank_named() -> None:
    ok = [entry(0, "all_reduce", [[8]], [[8]], state="started")]
    got = analyze_dumps(dumps(ok, ok, [entry(0, "all_reduce", [[8]], [[8]], state="scheduled")], ok))
    assert kinds(got) == [("fr-state-mismatch", (2,))]
    assert got.findings[0].evidence == ("ranks 0-1,3: started", "rank 2: scheduled")


@pytest.mark.parametrize("op", ["broadcast", "_broadcast_oop", "reduce", "_reduce_oop", "all_reduce", "barrier",
                                "all_reduce_barrier", "allreduce_coalesced", "scatter", "gather", "all_to_all_single"])
def test_every_collective_matched_with_itself_gives_nothing(op: str) -> None:
    e = entry(0, op, [[4, 4]], [[4, 4]])
    assert kinds(_pair(e, e)) == []


def test_coalesced_calls_align_by_position_and_later_collectives_by_seq() -> None:
    r0 = [entry(0, "broadcast", [[4]], [[4]], seq=1), entry(1, "broadcast", [[6]], [[6]], seq=1),
          entry(2, "coalesced", [[]], [[]], seq=1), entry(3, "all_reduce", [[2]], [[2]], seq=2)]
    r1 = [entry(0, "broadcast", [[4]], [[4]], seq=1), entry(1, "broadcast", [[6]], [[6]], seq=1),
          entry(2, "coalesced", [[]], [[]], seq=1), entry(3, "all_reduce", [[3]], [[3]], seq=2)]
    got = analyze_dumps(dumps(r0, r1))
    assert [f.summary for f in got.findings] == [
        "input_sizes disagree at all_reduce seq 2, record 3 in pg 0:default_pg: rank 0 [[2]] vs rank 1 [[3]]"]


def test_p2p_sends_pair_with_recvs() -> None:
    pg = ("0", "default_pg")
    send = {**entry(0, "send 0->1", [[4]], [[4]], pg=pg, p2p=True, p2p_seq=1)}
    recv = {**entry(0, "recv 1<-0", [[5]], [[5]], pg=pg, p2p=True, p2p_seq=1)}
    got = analyze_dumps(dumps([send], [recv]))
    assert kinds(got) == [("fr-size-mismatch", (0, 1))]
    assert got.findings[0].evidence == ("rank 0 sends [[4]]", "rank 1 receives [[5]]")
    unanswered = analyze_dumps(dumps([send, {**send, "record_id": 1}], [{**recv, "output_sizes": [[4]]}]))
    assert kinds(unanswered) == [("fr-missing-ranks", (1,))]


# ---------------------------------------------------------------- damaged dumps, missing ranks, wavefront


def _run(n: int, start: int = 1, record0: int = 0, op: str = "all_reduce") -> list[dict[str, Any]]:
    return [entry(record0 + i, op, [[4]], [[4]], seq=start + i) for i in range(n)]


def test_a_wrapped_buffer_is_flagged_and_its_lost_past_never_accused() -> None:
    got = analyze_dumps(dumps(_run(6), _run(3, start=4, record0=3)))
    assert kinds(got) == [("fr-truncated-dump", (1,))]
    assert "first record is 3" in got.findings[0].evidence[0]
    assert got.wavefront[0].head_seq == 6 and not got.wavefront[0].lagging


def test_record_gaps_empty_dumps_missing_dumps_and_versions() -> None:
    gap = _run(2) + _run(2, start=3, record0=5)
    got = analyze_dumps(dumps(gap, _run(4)))
    assert kinds(got) == [("fr-truncated-dump", (0,))] and "jump at 1->5" in got.findings[0].evidence[0]
    empty = analyze_dumps(dumps(_run(2), []))
    assert kinds(empty) == [("fr-missing-ranks", (1,)), ("fr-empty-dump", (1,))]
    (w,) = empty.wavefront
    assert (w.least_seq, w.behind, w.ahead) == (None, (1,), (0,))
    assert wavefront_line(json.loads(json.dumps(_wjson(w)))).startswith(
        "pg 0:default_pg: rank(s) 1 behind at no entry in this group; rank(s) 0 at seq 2")
    absent = analyze_dumps(dumps(_run(2), _run(2), members="[0, 1, 2]"))
    assert kinds(absent) == [("fr-missing-dump", (2,))] and absent.wavefront[0].no_dump == (2,)
    mixed = dumps(_run(1), _run(1))
    mixed[1]["version"] = "2.10"
    assert kinds(analyze_dumps(mixed)) == [("fr-version-mismatch", (0, 1))]


def _wjson(w: Any) -> dict[str, object]:
    from rankscope.analyzers.flight_recorder import wavefront_to_json

    return wavefront_to_json(w)


def test_malformed_entries_become_findings_and_the_rest_is_still_compared() -> None:
    r0 = [*_run(2), {"record_id": 2, "state": "completed"}]  # no process group: unusable
    r1 = _run(2)
    r1[1]["input_sizes"] = "four by four"
    got = analyze_dumps(dumps(r0, r1))
    assert kinds(got) == [("fr-malformed-entry", (0,)), ("fr-malformed-entry", (1,))]
    assert got.findings[0].evidence == ("rank 0: no process_group unreadable in 1 entry (first at record 2)",)
    assert got.findings[1].evidence == ("rank 1: input_sizes unreadable in 1 entry (first at record 1)",)
    assert got.wavefront[0].head_seq == 2


def test_the_wavefront_lists_lagging_groups_first_most_behind_first() -> None:
    tp, pp = ("1", "tp"), ("2", "pp")

    def rank(dp_seq: int, tp_seq: int, pp_seq: int) -> list[dict[str, Any]]:
        es = _run(dp_seq) + [entry(0, "all_reduce", [[4]], [[4]], seq=s + 1, pg=tp) for s in range(tp_seq)]
        es += [entry(0, "broadcast", [[4]], [[4]], seq=s + 1, pg=pp) for s in range(pp_seq)]
        return [{**e, "record_id": i} for i, e in enumerate(es)]

    d = dumps(rank(5, 3, 2), rank(5, 3, 4), rank(5, 2, 4), rank(5, 3, 4))
    for r in d:
        d[r]["pg_config"].update({"1": {"name": "1", "desc": "tp", "ranks": [0, 1, 2, 3]},
                                  "2": {"name": "2", "desc": "pp", "ranks": "[0, 1, 2, 3]"}})
    got = analyze_dumps(d)
    assert [(w.communicator, w.behind, w.least_seq, w.ahead, w.head_seq) for w in got.wavefront] == [
        ("2:pp", (0,), 2, (1, 2, 3), 4), ("1:tp", (2,), 2, (0, 1, 3), 3), ("0:default_pg", (0, 1, 2, 3), 5, (), 5)]
    assert [p.rank for p in got.wavefront[0].ranks] == [0, 1, 2, 3]
    assert kinds(got) == [("fr-missing-ranks", (2,)), ("fr-missing-ranks", (0,))]


# ---------------------------------------------------------------- fuzzing


JSONISH = st.recursive(st.none() | st.booleans() | st.integers(-5, 2**40) | st.floats(allow_nan=True)
                       | st.text(max_size=12), lambda c: st.lists(c, max_size=4)
                       | st.dictionaries(st.text(max_size=8), c, max_size=4), max_leaves=10)
SIZES = st.lists(st.lists(st.integers(0, 8), max_size=3), max_size=3)
FIELD = {
    "record_id": st.integers(-2, 20) | JSONISH,
    "profiling_name": st.sampled_from(["nccl:all_reduce", "gloo:broadcast", "nccl:send 0->1", "nccl:recv 1<-0",
                                       "nccl:coalesced", "nccl:send x", "all_gather", "", ":"]) | JSONISH,
    "process_group": st.sampled_from([["0", "default_pg"], ("1", "tp"), ["0"], [], ["2", "pp", "x"]]) | JSONISH,
    "collective_seq_id": st.integers(-1, 6) | st.sampled_from(["3", "x", ""]) | JSONISH,
    "p2p_seq_id": st.integers(0, 4) | JSONISH,
    "input_sizes": SIZES | JSONISH, "output_sizes": SIZES | JSONISH,
    "input_dtypes": st.sampled_from(["Float", ["Float"], ["Half", "Float"], []]) | JSONISH,
    "output_dtypes": st.sampled_from(["Float", ["Float"], []]) | JSONISH,
    "state": st.sampled_from(["scheduled", "started", "completed"]) | JSONISH,
    "is_p2p": st.booleans() | JSONISH, "retired": st.booleans() | JSONISH,
    "time_created_ns": st.integers(0, 2**62) | JSONISH, "time_discovered_completed_ns": JSONISH,
}
ENTRY = st.fixed_dictionaries({}, optional=FIELD) | JSONISH
DUMP = st.fixed_dictionaries({"entries": st.lists(ENTRY, max_size=6)}, optional={
    "pg_config": st.dictionaries(st.sampled_from(["0", "1", "2"]), st.fixed_dictionaries(
        {}, optional={"name": st.sampled_from(["0", "1", "2"]) | JSONISH, "desc": st.text(max_size=5) | JSONISH,
                      "ranks": st.sampled_from(["[0, 1]", "[0, 1, 2]", [0, 2], "[]", "0,1", "x"]) | JSONISH})
        | JSONISH, max_size=3) | JSONISH,
    "version": st.sampled_from(["2.8", "2.10"]) | JSONISH, "pg_status": JSONISH, "rank": JSONISH}) | JSONISH


def _check(a: FrAnalysis) -> None:
    for f in a.findings:
        assert f.kind in ADVICE and all(isinstance(r, int) for r in f.ranks) and f.summary
        json.dumps(finding_to_json(f))
    for w in a.wavefront:
        wavefront_line(json.loads(json.dumps(_wjson(w))))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.integers(0, 3), DUMP, max_size=4))
def test_fuzz_the_analyzer_never_raises_on_any_dump_content(raw: dict[int, Any]) -> None:
    _check(analyze_dumps(raw))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.integers(0, 3), DUMP | st.binary(max_size=40), min_size=1, max_size=3),
       st.booleans())
@example({0: b"\x95\x00\x00\x00\x00\x00\x00\x00\x80"}, False)  # a pickle frame too long: OverflowError
def test_fuzz_the_folder_reader_gives_a_report_or_a_clear_error(raw: dict[int, Any], as_json: bool) -> None:
    with tempfile.TemporaryDirectory() as d:
        for rank, dump in raw.items():
            data = dump if isinstance(dump, bytes) else (
                json.dumps(dump, default=str).encode() if as_json else pickle.dumps(dump))
            (Path(d) / f"nccl_trace_rank_{rank}").write_bytes(data)
        try:
            report = read_flight_recorder_dir(Path(d), None)
        except RankscopeError as exc:
            assert exc.fix  # names the fix
            return
        _check(report.analysis)
        assert set(report.verdict.findings) >= set(report.analysis.findings)


CALL = st.tuples(st.sampled_from(["all_reduce", "broadcast", "all_gather_into_tensor", "barrier"]),
                 st.lists(st.integers(1, 6), min_size=1, max_size=2), st.sampled_from(["Float", "Half"]))


def _clean(calls: list[tuple[str, list[int], str]], size: int) -> list[dict[str, Any]]:
    out = []
    for i, (op, shape, dt) in enumerate(calls):
        n = 1
        for d in shape:
            n *= d
        outs = [[n * size]] if op == "all_gather_into_tensor" else [shape]
        out.append(entry(i, op, [shape], outs, seq=i + 1, in_dt=[dt], out_dt=[dt]))
    return out


@settings(max_examples=50, deadline=None)
@given(st.lists(CALL, min_size=1, max_size=6), st.integers(3, 5), st.data())
def test_fuzz_identical_ranks_agree_and_one_changed_shape_names_exactly_that_rank(
        calls: list[tuple[str, list[int], str]], size: int, data: st.DataObject) -> None:
    clean = _clean(calls, size)
    agree = analyze_dumps(dumps(*[clean] * size))
    assert not [f for f in agree.findings if f.kind in SERIOUS]
    assert not any(w.lagging for w in agree.wavefront)
    odd = data.draw(st.integers(0, size - 1))
    at = data.draw(st.integers(0, len(clean) - 1))
    changed = [dict(e) for e in clean]
    changed[at]["input_sizes"] = [[99, 7]]
    got = analyze_dumps(dumps(*[changed if r == odd else clean for r in range(size)]))
    size_findings = [f for f in got.findings if f.kind == "fr-size-mismatch"]
    assert size_findings and all(f.ranks == (odd,) for f in size_findings)
    assert f"seq {at + 1}" in size_findings[0].summary
    # a rank that stopped early is behind in the wavefront and missing from the next call
    short = analyze_dumps(dumps(*[clean[:at] if r == odd else clean for r in range(size)]))
    (w,) = short.wavefront
    assert w.behind == (odd,) and w.head_seq == len(clean)
    assert [(f.kind, f.ranks) for f in short.findings if f.kind in SERIOUS] == [("fr-missing-ranks", (odd,))]


def test_a_dump_file_cut_short_is_named_and_its_rank_shown_without_a_dump(tmp_path: Path) -> None:
    gloo_cfg = {"": {"name": "", "desc": "", "ranks": "[]"}}  # what gloo writes: no membership
    for r in range(3):
        data = {"version": "2.10", "pg_config": gloo_cfg, "entries": [
            {**e, "profiling_name": "gloo:all_reduce", "process_group": ("0", "default_pg")} for e in _run(2)]}
        blob = pickle.dumps(data)
        (tmp_path / f"nccl_trace_rank_{r}").write_bytes(blob[: len(blob) // 2] if r == 2 else blob)
    report = read_flight_recorder_dir(tmp_path, None)
    assert kinds(report.analysis) == [("fr-unreadable-dump", (2,))]
    assert report.analysis.findings[0].evidence[0].startswith("rank 2: nccl_trace_rank_2: ")
    (w,) = report.analysis.wavefront
    assert (w.members, w.no_dump, w.head_seq) == ((0, 1, 2), (2,), 2)
    assert 2 in report.verdict.missing_ranks


@pytest.mark.parametrize("case", ["allreduce_coalesced", "broadcast-coalesced", "reduce-scatter-coalesced"])
def test_pytorch_cases_2_3_5_matched_coalesced_calls_give_nothing(case: str) -> None:
    if case == "allreduce_coalesced":  # test case 2
        es = [entry(0, "allreduce_coalesced", [[4, 4]], [[4, 4]])]
    elif case == "broadcast-coalesced":  # test case 3: seq id does not grow inside a coalesced call
        es = [entry(0, "broadcast", [[4, 4]], [[4, 4]]), entry(1, "broadcast", [[4, 4]], [[4, 4]]),
              entry(2, "coalesced", [[]], [[]])]
    else:  # test case 5
        es = [entry(0, "_reduce_oop", [[4, 4]], [[4, 4]]), entry(1, "_reduce_oop", [[4, 4]], [[4, 4]]),
              entry(2, "REDUCE_SCATTER_coalesced", [[]], [[]])]
    got = analyze_dumps(dumps(es, [dict(e) for e in es]))
    assert kinds(got) == [] and not got.wavefront[0].lagging


def test_past_the_cap_mismatches_are_summed_up_not_listed() -> None:
    r0 = _run(14)
    r1 = [{**e, "input_sizes": [[5]], "output_sizes": [[5]]} for e in _run(14)]
    got = analyze_dumps(dumps(r0, r1))
    assert [f.kind for f in got.findings] == ["fr-size-mismatch"] * 10 + ["fr-mismatch-cap"]
    assert got.findings[-1].summary == "4 more mismatch(es) in pg 0:default_pg not listed"


def test_at_the_same_call_the_rank_whose_op_got_least_far_is_the_laggard() -> None:
    done = _run(3)
    stuck = [*_run(2), {**_run(3)[2], "state": "scheduled"}]
    got = analyze_dumps(dumps(done, stuck, done))
    (w,) = got.wavefront
    assert (w.behind, w.ahead) == ((1,), (0, 2))
    assert wavefront_line(_wjson(w)) == ("pg 0:default_pg: rank(s) 1 behind at seq 3 (all_reduce scheduled); "
                                         "rank(s) 0,2 at seq 3 (all_reduce completed)")
    assert kinds(got) == [("fr-state-mismatch", (1,))]


def test_a_side_without_data_has_no_dtype_to_disagree_with() -> None:
    root = entry(0, "gather", [[4, 4]], [[4, 4], [4, 4]])
    leaf = entry(0, "gather", [[4, 4]], [[]], out_dt="float16")  # no output on a non-root rank
    assert kinds(_pair(root, leaf)) == []
    assert kinds(_pair(root, {**leaf, "input_dtypes": "float16"})) == [("fr-dtype-mismatch", (0, 1))]


def test_many_ranks_out_of_step_are_summed_up_in_the_evidence() -> None:
    full, short = _run(2), _run(1)
    got = analyze_dumps(dumps(*([full] * 4 + [short] * 12)))
    (f,) = got.findings
    assert (f.kind, f.ranks) == ("fr-missing-ranks", tuple(range(4, 16)))
    assert len(f.evidence) == 12 and f.evidence[-1] == "... and 2 more rank(s) alike"
    shapes = [[{**e, "input_sizes": [[r + 1]], "output_sizes": [[r + 1]]} for e in _run(1)] for r in range(13)]
    (g,) = analyze_dumps(dumps(*shapes)).findings
    assert g.ranks == tuple(range(13)) and g.evidence[-1] == "... and 3 more value(s)"


def test_every_member_in_the_same_unfinished_collective_is_not_a_rank() -> None:
    """Both ranks' last entry is all_reduce seq 3, started, never completed: a symmetric stall (issue 29)."""
    def rank(last_state: str) -> list[dict[str, Any]]:
        return [entry(i, "all_reduce", [[4]], [[4]], seq=i + 1) for i in range(2)] + [
            entry(2, "all_reduce", [[4]], [[4]], seq=3, state=last_state)]

    a = analyze_dumps(dumps(rank("started"), rank("started")))
    (stall,) = [f for f in a.findings if f.kind == NOT_A_RANK]
    assert stall.ranks == (0, 1) and stall.summary.startswith("not a rank: all 2 members of pg 0:default_pg")
    assert "seq 3" in stall.summary and "RAS" in stall.advice
    # completed everywhere (a snapshot of a healthy job), or one rank a call behind: no stall
    assert not [f for f in analyze_dumps(dumps(rank("completed"), rank("completed"))).findings if f.kind == NOT_A_RANK]
    behind = dumps(rank("started"), rank("started")[:2])
    assert not [f for f in analyze_dumps(behind).findings if f.kind == NOT_A_RANK]
