"""`rankscope analyze`: bundles, folders of py-spy dumps, JSON and text, and clear errors."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rankscope.cli.main import main
from rankscope.contract.bundle import Bundle, write_bundle
from rankscope.contract.snapshot import Layout
from repo_paths import FIG7
from stack_fixtures import COMPUTE, OPTIMIZER, RECV, rank_stacks, snapshot

FIG7_FLAGS = ["--tp", "2", "--pp", "4", "--dp", "4", "--order", "tp-pp-dp", "--ranks-per-machine", "2"]


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["analyze", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_pyspy_dir_json_names_the_fig7_pipeline(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--pyspy-dir", str(FIG7), *FIG7_FLAGS, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["summary"] == "PP groups #6 and #7 on machine-12..15"
    top = data["suspects"][0]
    assert top["kind"] == "pp" and top["machines"] == [f"machine-{m}" for m in (12, 13, 14, 15)]
    assert top["ranks"] == list(range(24, 32)) and top["score"] == 1.0 and top["evidence"]
    assert [g["size"] for g in data["groups"]] == [24, 4, 2, 2]
    assert data["dominant"] == [0] and data["outliers"] == [1, 2, 3]
    assert data["layout"]["order"] == "tp-pp-dp-cp-ep" and data["world_size"] == 32


def test_pyspy_dir_text(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "--pyspy-dir", str(FIG7), *FIG7_FLAGS)
    assert code == 0
    assert out.startswith("verdict: PP groups #6 and #7 on machine-12..15\n")
    assert "[outlier] 2 rank(s) 30-31: all_gather_into_tensor (distributed_c10d.py)" in out
    assert "1. [pp] score 1.00  machines: machine-12, machine-13, machine-14, machine-15" in out


def test_pyspy_dir_with_gaps_keeps_going_and_says_what_is_missing(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    for f in FIG7.glob("rank*.json"):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "rank3.json").unlink()
    (tmp_path / "rank5.json").write_text("{not json")
    code, out, _ = _run(capsys, "--pyspy-dir", str(tmp_path), *FIG7_FLAGS, "--json")
    assert code == 0
    data = json.loads(out)
    assert data["missing_ranks"] == [3, 5]
    assert data["suspects"][0]["kind"] == "pp"
    assert any("rank5.json is not readable py-spy JSON" in n for n in data["notes"])


def test_bundle_with_layout_flags_and_rounds(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    layout = Layout(tp=2, pp=2, dp=2, ranks_per_machine=2)
    snaps = []
    for slow in ({1: COMPUTE, 0: RECV, 5: RECV, 4: RECV}, {1: COMPUTE}, {1: COMPUTE, 5: RECV}):
        stacks = {r: rank_stacks(r, slow.get(r, OPTIMIZER)) for r in range(8)}
        snaps.append(snapshot(stacks, 8, 2, layout))
    path = write_bundle(Bundle(snapshots=tuple(snaps), created_wall=1.0), tmp_path / "b.json")
    code, out, _ = _run(capsys, str(path), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["suspects"][0]["kind"] == "rank" and data["suspects"][0]["ranks"] == [1]
    fail_slow = data["fail_slow"]
    assert len(fail_slow["rounds"]) == 3
    assert fail_slow["degrader"]["ranks"] == [1] and fail_slow["degrader"]["score"] == 1.0
    # flags override the bundle's layout; a layout that does not fit is refused with the fix
    code, _, err = _run(capsys, str(path), "--dp", "3")
    assert code == 2
    assert "multiply to 12 ranks" in err and "fix:" in err
    code, out, _ = _run(capsys, str(path), "--snapshot", "1")
    assert code == 0 and out.startswith("verdict: rank 1 on node0")


@pytest.mark.parametrize("argv, message", [
    ((), "give exactly one of BUNDLE, --dumps PATH, --flight-recorder DIR, --op-trace FILE or --logs PATH"),
    (("--pyspy-dir", "/nonexistent/dumps"), "is neither a folder nor a file of py-spy dumps"),
    (("--pyspy-dir", str(FIG7), "--order", "tp-xx"), "unknown dimension"),
    (("--pyspy-dir", str(FIG7), "--tp", "0"), "--tp must be a whole number of at least 1, got 0"),
])
def test_errors_name_the_fix(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str) -> None:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    assert message in err and "fix:" in err
    assert "Traceback" not in err


def test_a_missing_bundle_names_no_option_analyze_lacks_and_json_errors_are_json(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    code, out, err = _run(capsys, str(missing))
    assert code == 2 and out == "" and f"{missing}: no such file" in err and "fix: check the bundle's path" in err
    assert "--bundle" not in err  # analyze takes the bundle as an argument
    code, out, err = _run(capsys, str(missing), "--json")
    assert code == 2 and err == ""
    assert json.loads(out) == {"error": {"verb": "analyze", "message": f"{missing}: no such file",
                                         "fix": "check the bundle's path (a file written by `rankscope snapshot -o`, "
                                                "`w` in the TUI or the drill)"}}


def test_empty_pyspy_dir_says_how_to_fill_it(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = _run(capsys, "--pyspy-dir", str(tmp_path))
    assert code == 2 and "no py-spy dumps in" in err and "py-spy dump --pid" in err


def _fr_entry(seq: int, retired: bool) -> dict[str, object]:
    # One entry of PyTorch's flight-recorder dump (the fields rankscope.formats.flight_recorder reads).
    return {"record_id": seq - 1, "pg_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "profiling_name": "nccl:all_reduce", "time_created_ns": 10**18 + seq,
            "input_sizes": [[4, 2]], "input_dtypes": ["Float"], "state": "completed" if retired else "scheduled",
            "retired": retired, "is_p2p": False, "time_discovered_completed_ns": 0}


@pytest.mark.skipif(importlib.util.find_spec("rankscope.formats.flight_recorder") is None,
                    reason="no flight-recorder reader in this tree")
def test_flight_recorder_dumps_are_judged_by_their_counters(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import pickle

    cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2]"}}
    for rank, launched in ((0, 3), (1, 2), (2, 3)):  # rank 1 never launched the 3rd all_reduce
        entries = [_fr_entry(i, i < 3) for i in range(1, launched + 1)]
        (tmp_path / f"rank{rank}").write_bytes(pickle.dumps({"version": "2.10", "pg_config": cfg, "entries": entries}))
    code, out, _ = _run(capsys, "--flight-recorder", str(tmp_path), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["groups"] == [] and data["suspects"][0]["ranks"] == [1]
    assert data["suspects"][0]["sources"] == ["ccl"]
    code, out, _ = _run(capsys, "--flight-recorder", str(tmp_path))
    assert code == 0 and "1. [rank]" in out


def test_the_installed_command_runs() -> None:
    proc = subprocess.run([sys.executable, "-m", "rankscope", "analyze", "--pyspy-dir", str(FIG7), *FIG7_FLAGS,
                           "--json"], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["suspects"][0]["machines"][0] == "machine-12"


@pytest.mark.parametrize("counters", [True, False])
def test_analyze_the_tui_and_the_drill_give_one_capture_one_verdict(
        counters: bool, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """One analysis entry (analyzers.analysis.analyze_job): the same summary and suspects from every consumer."""
    from dataclasses import replace

    from rankscope.analyzers.analysis import analyze_snapshot
    from rankscope.tui.analysis import build_stack_view
    from tui_bundles import fig7_bundle

    snap = fig7_bundle().latest  # stacks, and CCL counters in which rank 30 launched one send fewer
    if not counters:
        snap = replace(snap, machines=tuple(replace(m, counters=()) for m in snap.machines))
    write_bundle(Bundle((snap,), snap.captured.wall), tmp_path / "b.json")
    code, out, _ = _run(capsys, str(tmp_path / "b.json"), "--json")
    assert code == 0
    by_cli = json.loads(out)
    by_drill = analyze_snapshot(snap)
    by_tui = build_stack_view(snap).verdict
    assert by_cli["summary"] == by_drill.summary == by_tui.summary
    assert [s["ranks"] for s in by_cli["suspects"]] == [list(s.ranks) for s in by_drill.suspects] \
        == [list(s.ranks) for s in by_tui.suspects]
    assert ("stacks_summary" in by_cli) is counters  # the counters name rank 30: merged with the stacks


def test_text_names_a_large_jobs_strided_groups_exactly_in_one_line(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # 256 ranks, tp 2 pp 4 dp 32: one pipeline stage (ranks 6-7 of every 8) is 32 runs, too many to list
    layout = Layout(tp=2, pp=4, dp=32, order="tp-pp-dp", ranks_per_machine=2)
    stacks = {r: rank_stacks(r, RECV if r % 8 >= 6 else OPTIMIZER) for r in range(256)}
    path = write_bundle(Bundle(snapshots=(snapshot(stacks, 256, 2, layout),), created_wall=1.0), tmp_path / "b.json")
    code, out, _ = _run(capsys, str(path))
    assert code == 0
    assert "[healthy] 192 rank(s) 0-5,8-13,…,248-253 (32 runs of 6, one every 8):" in out
    assert "[outlier] 64 rank(s) 6-7,14-15,…,254-255 (32 runs of 2, one every 8):" in out
    code, out, _ = _run(capsys, str(path), "--json")
    assert [len(g["ranks"]) for g in json.loads(out)["groups"]] == [192, 64]  # --json keeps every rank


def test_a_saved_incident_opens_on_the_capture_of_the_hang_not_on_the_polls_after_it(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # What `w` saves: every poll (counters, no stacks) and every capture. The hang's capture sits in the middle; the
    # polls after it and a capture of the job running again came later. The last snapshot said "no verdict".
    from tui_bundles import T0, fig7_bundle, job

    incident = fig7_bundle().snapshots  # 4 polls, then the capture of the hang (index 4)
    later = (job(T0 + 49, stacks=False, step=102, hung=True), job(T0 + 90, stacks=True, step=140, hung=False),
             *(job(T0 + 91 + i, stacks=False, step=141 + i, hung=False) for i in range(3)))
    path = write_bundle(Bundle(snapshots=(*incident, *later), created_wall=T0 + 95), tmp_path / "saved.json")
    code, out, _ = _run(capsys, str(path), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["snapshot"] == {"index": 4, "of": 10,
                                "why": "the latest capture naming suspects of a stuck job (the incident)"}
    assert data["suspects"] and set(data["suspects"][0]["machines"]) <= {"node12", "node13", "node14", "node15"}
    # The rounds are the captures only (the polls asked for no stacks), each naming its snapshot.
    assert [r["snapshot"] for r in data["fail_slow"]["rounds"]] == [4, 6]
    code, text, _ = _run(capsys, str(path))
    assert text.splitlines()[1] == ("snapshot 4 of 10: the latest capture naming suspects of a stuck job (the "
                                    "incident) (--snapshot I judges another)")
    assert "no rank's stacks could be read" not in text
    code, out, _ = _run(capsys, str(path), "--snapshot", "-1", "--json")
    assert code == 0 and "snapshot" not in json.loads(out)  # asked for: the last one, as given
