"""A snapshot's own evidence that its job was making steps (rankscope.analyzers.progress), and what analyze says then."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from ccl_fixtures import L8, drill_desync, with_counters
from rankscope.analyzers.analysis import analyze_job
from rankscope.analyzers.findings import VerdictStatus
from rankscope.analyzers.progress import MID_STEP_S, mid_step_window, progress_at_capture
from rankscope.cli.main import main
from rankscope.contract.bundle import Bundle, write_bundle
from rankscope.contract.snapshot import JobSnapshot
from stack_fixtures import snapshot


def _desync(progressed_s_before: float | None, step_s: float | None = None) -> JobSnapshot:
    """The drill's desync (a real fault by its stacks and counters), its ranks last progressing that long before."""
    stacks, c = drill_desync((2, 3))
    snap = with_counters(snapshot(stacks, 8, 2, L8), c.files())
    wall = snap.captured.wall
    machines = []
    for m in snap.machines:
        ranks = tuple(dataclasses.replace(r, last_progress_wall=None if progressed_s_before is None
                                          else wall - progressed_s_before) for r in m.ranks)
        counters = tuple(dataclasses.replace(x, last_step_duration_s=step_s) for x in m.counters)
        machines.append(dataclasses.replace(m, ranks=ranks, counters=counters))
    return dataclasses.replace(snap, machines=tuple(machines))


def test_a_snapshot_taken_within_a_step_of_progress_caught_a_running_job() -> None:
    assert progress_at_capture(_desync(None)) is None  # no agent memory: nothing to say
    running = progress_at_capture(_desync(0.5))
    assert running is not None and running.running and running.age_s == pytest.approx(0.5)
    assert running.window_s == MID_STEP_S
    stopped = progress_at_capture(_desync(30.0))
    assert stopped is not None and not stopped.running and stopped.age_s == pytest.approx(30.0)
    # slow steps widen the window to two of them
    slow = progress_at_capture(_desync(8.0, step_s=5.0))
    assert slow is not None and slow.window_s == 10.0 and slow.running


def test_the_verdict_of_a_running_job_is_set_aside_as_timing_and_says_what_it_set_aside() -> None:
    snap = _desync(0.5)
    job = analyze_job(snap, L8)  # the one analysis applies the timing judgement itself
    verdict = job.fault_verdict
    assert verdict.suspects  # the evidence alone names the pair
    assert job.timing_not_fault and job.progress == progress_at_capture(snap)
    kept = job.verdict
    assert kept.suspects == () and kept.findings == ()
    assert kept.summary.startswith("no verdict: the job was making progress (it last progressed ")
    assert kept.summary.endswith("are timing, not a fault")
    assert kept.status is VerdictStatus.TIMING and verdict.status is VerdictStatus.NAMED
    assert kept.notes[-1] == f"set aside as timing: {verdict.summary}"


@pytest.mark.parametrize(("before_s", "named"), [(0.5, False), (30.0, True), (None, True)])
def test_analyze_names_no_suspect_in_a_snapshot_of_a_job_making_steps(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, before_s: float | None, named: bool) -> None:
    path = write_bundle(Bundle((_desync(before_s),), 1.0), tmp_path / "b.json")
    assert main(["analyze", str(path), "--tp", "2", "--pp", "2", "--dp", "2", "--ranks-per-machine", "2",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    if named:
        assert [s["ranks"] for s in out["suspects"]][:1] == [[2, 3]]
    else:
        assert out["suspects"] == [] and out["findings"] == []
        assert out["summary"].startswith("no verdict: the job was making progress (it last progressed ")
        assert any(n.startswith("set aside as timing: ") and "2" in n for n in out["notes"])


def test_the_mid_step_window_is_two_step_times_and_never_under_three_seconds() -> None:
    # one rule for the TUI (step time from its polls' rate) and analyze (from the snapshot's counters)
    assert mid_step_window(None) == MID_STEP_S == 3.0
    assert mid_step_window(0.0) == 3.0 and mid_step_window(0.2) == 3.0  # a fast job: the floor
    assert mid_step_window(10.0) == 20.0  # a slow job's snapshot 15 s after a step still caught it mid-step
