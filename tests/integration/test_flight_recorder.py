"""Flight recorder dumps (pickle and JSON) read as CCL counters; the rank that never arrived is named."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from rankscope.contract.errors import RankscopeError
from rankscope.formats.flight_recorder import (
    analyze_flight_recorder_dir,
    dumps_to_counters,
    load_dump,
    read_flight_recorder_dir,
)

JOB = textwrap.dedent("""
    import os, pickle, sys, time
    from pathlib import Path
    import torch, torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace, _dump_fr_trace_json
    out = Path(sys.argv[1])
    dist.init_process_group("gloo")
    r = dist.get_rank()
    pp = dist.new_group([0, 1], group_desc="PIPELINE_MODEL_PARALLEL_GROUP")
    for _ in range(3):
        dist.all_reduce(torch.ones(4))
    dist.broadcast(torch.ones(8), 0, group=pp)
    # gloo moves bytes only: same byte counts, different shapes / dtypes go through and are recorded
    dist.all_reduce(torch.ones(4) if r == 0 else torch.ones(2, 2), group=pp)
    dist.all_reduce(torch.ones(4) if r == 0 else torch.ones(4, dtype=torch.int32), group=pp)

    def settled(n_open):
        # gloo marks a work done before its worker thread retires the recorder entry: wait for the entries
        es = pickle.loads(_dump_fr_trace(True, False, False)).get("entries", [])
        return sum(not (e.get("retired") or e.get("state") == "completed") for e in es) == n_open

    def dump(n_open):
        deadline = time.monotonic() + 120
        while not settled(n_open):
            if time.monotonic() > deadline:
                sys.exit(f"rank {r}: flight recorder never settled with {n_open} open entries")
            time.sleep(0.02)
        (out / "json" / f"rank{r}.json").write_bytes(_dump_fr_trace_json())
        (out / "pkl" / f"nccl_trace_rank_{r}").write_bytes(_dump_fr_trace(True, False, False))
        (out / f"dumped{r}").touch()

    def wait_for(p):
        deadline = time.monotonic() + 120
        while not p.exists():
            if time.monotonic() > deadline:
                sys.exit(f"rank {r}: timed out waiting for {p.name}")
            time.sleep(0.02)

    if r == 1:  # the late rank: its dump shows it never reached the 4th all_reduce
        dump(0)
        wait_for(out / "dumped0")
        dist.all_reduce(torch.ones(4))
    else:
        work = dist.all_reduce(torch.ones(4), async_op=True)
        wait_for(out / "dumped1")
        dump(1)
        work.wait()
    dist.destroy_process_group()
""")


@pytest.mark.drill
def test_real_gloo_dumps_name_the_rank_that_never_arrived(tmp_path: Path) -> None:
    (tmp_path / "json").mkdir()
    (tmp_path / "pkl").mkdir()
    script = tmp_path / "fr_job.py"
    script.write_text(JOB)
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "200"}
    env.pop("RANKSCOPE_CCL", None)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(script), str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for fmt in ("pkl", "json"):
        report = read_flight_recorder_dir(tmp_path / fmt, None)
        snapshot, verdict = report.snapshot, report.verdict
        counters = snapshot.all_counters()
        assert set(counters) == {0, 1}
        ar = {r: next(o for o in c.ops if o.comm_id == "0" and o.op == "all_reduce") for r, c in counters.items()}
        assert (ar[0].cl, ar[0].wc, ar[1].cl, ar[1].wc) == (4, 3, 3, 3), fmt
        descs = {c.comm_id: c.description for c in counters[0].communicators}
        assert descs == {"0": "default_pg", "1": "PIPELINE_MODEL_PARALLEL_GROUP"}
        assert verdict.top is not None and verdict.top.ranks == (1,), (fmt, verdict)
        assert "all_reduce CL 3 < 4" in verdict.top.evidence[0]
        # the entries compared across ranks: the two program mismatches and the rank that never arrived
        got = [(f.kind, f.ranks, f.communicator, f.summary) for f in verdict.findings]
        pp = "1:PIPELINE_MODEL_PARALLEL_GROUP"
        assert got == [
            ("fr-size-mismatch", (0, 1), pp,
             f"input_sizes disagree at all_reduce seq 2, record 4 in pg {pp}: rank 0 [[4]] vs rank 1 [[2, 2]]"),
            ("fr-dtype-mismatch", (0, 1), pp,
             f"input_dtypes disagree at all_reduce seq 3, record 5 in pg {pp}: rank 0 ['Float'] vs rank 1 ['Int']"),
            ("fr-missing-ranks", (1,), "0:default_pg",
             "rank(s) 1 never joined all_reduce seq 4, record 6 in pg 0:default_pg"),
        ], fmt
        waves = {w.communicator: w for w in report.analysis.wavefront}
        assert [w.communicator for w in report.analysis.wavefront] == ["0:default_pg", pp]  # laggard first
        d = waves["0:default_pg"]
        assert (d.least_seq, d.behind, d.head_seq, d.ahead, d.next_op) == (3, (1,), 4, (0,), "all_reduce seq 4")
        assert (waves[pp].head_seq, waves[pp].ahead) == (3, ())


def _entry(seq: int, retired: bool, pg: tuple[str, str] = ("0", "default_pg")) -> dict[str, object]:
    return {"record_id": seq - 1, "pg_id": int(pg[0]), "process_group": pg, "collective_seq_id": seq,
            "p2p_seq_id": 0, "profiling_name": "nccl:all_reduce", "time_created_ns": 10**18 + seq,
            "input_sizes": [[4, 2]], "input_dtypes": ["Float"], "state": "completed" if retired else "scheduled",
            "retired": retired, "is_p2p": False, "time_discovered_completed_ns": 0}


def test_pg_config_gives_members_and_bytes_follow_dtypes(tmp_path: Path) -> None:
    cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}}
    dumps = {r: {"version": "2.10", "pg_config": cfg, "pg_status": {}, "entries": [_entry(1, True)]} for r in (0, 1)}
    (counters, notes) = dumps_to_counters(dumps)
    assert counters[0].communicators[0].ranks == (0, 1, 2) and counters[0].ops[0].bytes_total == 32
    assert notes == []


def test_missing_and_unreadable_dumps_are_reported_not_crashed_on(tmp_path: Path) -> None:
    cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}}
    for r, n in ((0, 2), (1, 1)):
        entries = [_entry(i, i < 2 or r == 1) for i in range(1, n + 1)]
        (tmp_path / f"rank{r}").write_bytes(pickle.dumps({"version": "2.10", "pg_config": cfg, "entries": entries}))
    (tmp_path / "rank2").write_bytes(b"\x80\x04garbage")
    _, verdict = analyze_flight_recorder_dir(tmp_path, None)
    assert 2 in verdict.missing_ranks
    assert any("rank2: unreadable" in n for n in verdict.notes)
    assert verdict.top is not None and verdict.top.ranks == (1,)


def test_a_pickle_that_would_run_code_is_refused(tmp_path: Path) -> None:
    evil = tmp_path / "rank0"
    evil.write_bytes(pickle.dumps({"entries": [], "x": os.system}))  # a global reference: could be called
    with pytest.raises(pickle.UnpicklingError):
        load_dump(evil)
    with pytest.raises(RankscopeError) as err:
        analyze_flight_recorder_dir(tmp_path, None)
    assert "TORCH_FR_BUFFER_SIZE" in err.value.fix
    with pytest.raises(RankscopeError):
        analyze_flight_recorder_dir(tmp_path / "absent", None)


def test_a_pickle_is_told_by_its_protocol_header_not_one_byte(tmp_path: Path) -> None:
    """A stray byte 0x80 (a damaged text dump) is not a flight recorder dump; a real pickle is."""
    from rankscope.formats.flight_recorder import looks_like_dump

    stray, real = tmp_path / "rank0.txt", tmp_path / "rank1"
    stray.write_bytes(b"\x80")
    real.write_bytes(pickle.dumps({"entries": []}, protocol=2))
    assert not looks_like_dump(stray)
    assert looks_like_dump(real)
