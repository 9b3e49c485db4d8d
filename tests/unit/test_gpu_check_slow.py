"""The GPU check's slow part: the slow-gpu fault and its refusal off a GPU, where the slow drills run, and the
grading per rank and GPU of recorded drill results (no process is started here)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from rankscope.cli.main import main as cli_main
from rankscope.contract.errors import RankscopeError
from rankscope.drill.faults import FAULT_ENV, FAULTS, DrillLayout, FaultPlan, ground_truth, make_plan, refuse_off_gpu
from rankscope.drill.gpu import rank_device
from rankscope.drill.suite import DrillRecord
from repo_paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check

LAYOUT = DrillLayout(tp=2, pp=2, dp=1, machines=2)


# ---- the fault ---------------------------------------------------------------------


def test_slow_gpu_is_a_slow_rank_fault_that_needs_cuda() -> None:
    spec = FAULTS["slow-gpu"]
    assert (spec.category, spec.suspect, spec.by, spec.frame) == ("slow", "rank", "rank", "drill_injected_slow_gpu")
    assert spec.needs_cuda and not FAULTS["slow-compute"].needs_cuda
    assert [n for n, f in FAULTS.items() if f.needs_cuda] == ["slow-gpu"]
    plan = make_plan("slow-gpu", LAYOUT, rank=3, step=10, factor=2.5, backend="nccl")
    truth = ground_truth(plan, LAYOUT)
    assert (truth.rank, truth.machine, truth.suspect_ranks, truth.factor) == (3, "machine-1", (3,), 2.5)
    assert FaultPlan.from_env(plan.to_env()) == plan


def test_slow_gpu_on_cpu_is_refused_with_the_fix() -> None:
    for backend in ("gloo", "cpu"):
        with pytest.raises(RankscopeError) as err:
            make_plan("slow-gpu", LAYOUT, rank=3, backend=backend)
        assert err.value.message == f"slow-gpu acts on the rank's GPU, and a --backend {backend} drill runs on CPU"
        assert "pass --backend nccl" in err.value.fix and "--fault slow-compute" in err.value.fix
    refuse_off_gpu("slow-gpu", "nccl")
    refuse_off_gpu("slow-compute", "gloo")  # a host fault runs anywhere
    make_plan("slow-gpu", LAYOUT, rank=3)  # no backend given: validated where the backend is known


def test_the_drill_command_refuses_slow_gpu_on_gloo_before_starting_anything(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["drill", "--headless", "--fault", "slow-gpu", "--no-agents", "--backend", "gloo"]) == 2
    err = capsys.readouterr().err
    assert "slow-gpu acts on the rank's GPU" in err and "--backend nccl" in err and "Traceback" not in err


def test_a_worker_told_to_slow_its_gpu_on_gloo_exits_with_the_reason(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from rankscope.drill import worker

    plan = make_plan("slow-gpu", DrillLayout(), rank=1, step=5)
    monkeypatch.setenv(FAULT_ENV, plan.to_env())
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    with pytest.raises(SystemExit) as exc:
        worker.main(["train", "--run-dir", str(tmp_path), "--backend", "gloo"])
    assert str(exc.value) == "drill worker: slow-gpu acts on the rank's GPU; run the drill with --backend nccl"
    assert not (tmp_path / "progress").exists()  # refused before the rank wrote or started anything


def _injector_at_fault(device: Any) -> Any:
    from rankscope.drill.injection import Injector

    inj = Injector(FaultPlan(name="slow-gpu", rank=0, step=4, factor=2.0), 0, device)
    for step in range(5):  # steps 2 and 3 are healthy steps it measures
        inj.step = step
        inj.at_step_start()
        inj.before_compute()
    return inj


def test_the_injector_refuses_to_slow_a_cpu_device() -> None:
    import torch

    inj = _injector_at_fault(torch.device("cpu"))
    assert inj.healthy_step_s() is not None and inj.mine()
    with pytest.raises(SystemExit, match="slow-gpu needs the rank's CUDA device; run the drill with --backend nccl"):
        inj.after_compute()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_the_injector_queues_products_on_the_ranks_gpu() -> None:
    import torch

    inj = _injector_at_fault(torch.device("cuda", 0))
    inj.after_compute()
    assert inj._operand is not None and inj._operand.device.type == "cuda" and inj._matmul_s > 0
    assert inj.gpu_matmuls(100 * inj._matmul_s) == 100


# ---- where the slow drills run ------------------------------------------------------


def test_the_slow_part_places_its_drills_by_the_gpus_there() -> None:
    cpu = gpu_check.slow_placement("gloo", 0)
    assert (cpu["layout"], cpu["rank"], cpu["gpu"], cpu["shared"]) == (
        {"tp": 2, "pp": 2, "dp": 1, "machines": 2}, 3, None, None)
    one = gpu_check.slow_placement("nccl", 1)
    assert (one["world"], one["rank"], one["gpu"]) == (4, 3, 0)
    assert one["shared"] == "ranks 0-3 share GPU 0: a slow GPU slows them all; graded on rank only"
    eight = gpu_check.slow_placement("nccl", 8)
    assert (eight["layout"], eight["rank"], eight["gpu"], eight["shared"]) == (
        {"tp": 2, "pp": 2, "dp": 1, "machines": 1}, 3, 3, None)
    two = gpu_check.slow_placement("nccl", 2)
    assert (two["world"], two["rank"], two["gpu"], two["shared"]) == (2, 1, 1, None)


@given(st.integers(min_value=2, max_value=16))
def test_with_several_gpus_the_slow_rank_has_its_own_and_it_is_its_local_rank(gpus: int) -> None:
    pl = gpu_check.slow_placement("nccl", gpus)
    layout = DrillLayout(**pl["layout"])
    assert layout.world == pl["world"] and pl["shared"] is None
    others = {rank_device(r, gpus) for r in range(layout.world) if r != pl["rank"]}
    assert pl["gpu"] == rank_device(pl["rank"], gpus) not in others
    # the verdict names a rank's GPU by its local rank: on one machine that is the device it was bound to
    assert pl["gpu"] == layout.ranks_on(layout.machine_of(pl["rank"])).index(pl["rank"])


# ---- grading recorded results -------------------------------------------------------


def record(kind: str, *, detected: bool = True, ranks: tuple[int, ...] = (3,), summary: str | None = None,
           machines: tuple[str, ...] = ("machine-0",), seconds: float | None = 12.5, peak: float = 0.0,
           error: str | None = None) -> dict[str, Any]:
    rec = DrillRecord(index=0, kind=kind, rank=None if kind == "none" else 3, machine=None, expected_machines=(),
                      detected=detected, named_machines=machines if detected else (),
                      named_ranks=ranks if detected else (), summary=summary if detected else None,
                      onset_to_verdict_s=seconds if detected else None, peak_confidence=peak,
                      peak_machines=machines if peak else (), sources=("ccl", "step_time") if detected else (),
                      error=error)
    return json.loads(json.dumps(rec.to_dict()))  # as the part reads it back from its child


GPU_VERDICT = ("fail-slow: rank 3 (GPU 3) on machine-0 (non-communication slow) — [ccl] rank 3 arrived last in 9 of "
               "its last 10 collectives; confidence 0.83 from ccl+step_time")


def graded(name: str, placement: dict[str, Any], rec: dict[str, Any]) -> dict[str, Any]:
    truth = gpu_check.slow_truth(name, placement, 2.0)
    return {**gpu_check.grade_slow(name, truth, rec), "seconds": 70.0}


def test_a_slow_gpu_named_by_rank_gpu_and_kind_is_right_and_reported_so() -> None:
    pl = gpu_check.slow_placement("nccl", 8)
    d = graded("slow-gpu", pl, record("slow-gpu", summary=GPU_VERDICT))
    assert d["right"] and d["wrong"] == [] and (d["named_gpu"], d["c4"], d["kind_right"]) == (
        3, "non-communication slow", True)
    text = "\n".join(gpu_check.slow_lines({"placement": pl, "drills": {"slow-gpu": d}}))
    assert "[slow] 4 ranks (tp 2 x pp 2 x dp 1) on 1 machine(s), a GPU each: the slow rank 3 has GPU 3 to itself" in text
    assert (f"[slow slow-gpu] RIGHT: fault slow-gpu x2 at rank 3 (GPU 3) on machine-0; truth rank 3, GPU 3, "
            f"non-communication slow; verdict '{GPU_VERDICT}' (ranks [3]); kind right; 12.5 s from the fault to the "
            "verdict; drill 70.0 s") in text
    assert text.endswith("[slow] graded per rank and GPU: 1 of 1 slow drills right; C4's kind right in 1, wrong in "
                         "0, not stated in 0; false alarms on the healthy run: not run")


def test_the_wrong_gpu_or_a_whole_machine_is_wrong_and_says_why_and_the_kind_is_graded_beside() -> None:
    pl = gpu_check.slow_placement("nccl", 8)
    wrong_gpu = graded("slow-gpu", pl, record("slow-gpu", summary=GPU_VERDICT.replace("(GPU 3)", "(GPU 1)")))
    assert not wrong_gpu["right"] and wrong_gpu["wrong"] == ["names GPU 1, not GPU 3"]
    comm = graded("slow-gpu", pl, record("slow-gpu", summary=GPU_VERDICT.replace("non-communication", "communication")))
    assert comm["right"] and (comm["c4"], comm["kind_right"]) == ("communication slow", False)
    assert "(ranks [3]); kind WRONG (communication slow); 12.5 s" in "\n".join(
        gpu_check.slow_lines({"placement": pl, "drills": {"slow-gpu": comm}}))
    cpu = gpu_check.slow_placement("gloo", 0)
    machine = graded("slow-host", cpu, record("slow-compute", ranks=(2, 3), machines=("machine-1",),
                                               summary="fail-slow: machine-1 — [stacks] ...; confidence 0.9"))
    assert machine["wrong"] == ["names rank(s) [2, 3], not rank 3 alone"] and machine["kind_right"] is None
    text = "\n".join(gpu_check.slow_lines({"placement": cpu, "drills": {"slow-host": machine}}))
    assert "[slow] 4 ranks (tp 2 x pp 2 x dp 1) on 2 machine(s) on CPU: graded on rank, C4's kind beside it" in text
    assert "[slow slow-host] WRONG: fault slow-compute x2 at rank 3 on machine-1; truth rank 3, non-communication slow" in text
    assert "(ranks [2, 3]); kind not stated; 12.5 s from the fault" in text
    assert "    wrong: names rank(s) [2, 3], not rank 3 alone" in text
    assert "[slow] graded per rank: 0 of 1 slow drills right; C4's kind right in 0, wrong in 0, not stated in 1" in text


def test_on_a_shared_gpu_the_rank_is_graded_and_the_sharing_said() -> None:
    pl = gpu_check.slow_placement("nccl", 1)
    # the verdict's GPU is the rank's local rank on its drill machine; on one shared GPU that is not graded
    d = graded("slow-gpu", pl, record("slow-gpu", summary=GPU_VERDICT.replace("(GPU 3) on machine-0",
                                                                              "(GPU 1) on machine-1")))
    assert d["right"] and d["truth"]["gpu"] == 0 and not d["truth"]["gpu_graded"]
    text = "\n".join(gpu_check.slow_lines({"placement": pl, "drills": {"slow-gpu": d}}))
    assert "[slow] 4 ranks (tp 2 x pp 2 x dp 1) on 2 machine(s): ranks 0-3 share GPU 0: a slow GPU slows them all; " \
           "graded on rank only" in text
    assert "truth rank 3, non-communication slow;" in text and "graded per rank: 1 of 1" in text


def test_a_missed_drill_and_one_that_did_not_run_are_wrong() -> None:
    pl = gpu_check.slow_placement("nccl", 8)
    missed = graded("slow-gpu", pl, record("slow-gpu", detected=False, peak=0.5))
    assert missed["wrong"] == ["no confident verdict (peak confidence 0.50 on machine-0)"]
    failed = graded("slow-host", pl, record("slow-compute", detected=False, error="the job exited"))
    assert failed["wrong"] == ["the drill did not run to a verdict: the job exited"]


def test_the_healthy_run_counts_false_alarms_and_words_a_suspicion_as_one() -> None:
    pl = gpu_check.slow_placement("nccl", 8)
    quiet = graded("none", pl, record("none", detected=False, peak=0.41, machines=("machine-0",)))
    assert quiet["right"] and quiet["suspicion"] == "suspicion below the bar, not a verdict: machine-0 at confidence 0.41"
    alarm = graded("none", pl, record("none", summary="fail-slow: rank 2 (GPU 2) on machine-0 — ...", ranks=(2,)))
    assert not alarm["right"] and alarm["wrong"] == ["a fail-slow verdict on a healthy run: a false alarm"]
    ok = graded("slow-gpu", pl, record("slow-gpu", summary=GPU_VERDICT))
    lines = gpu_check.slow_lines({"placement": pl, "drills": {"slow-gpu": ok, "none": quiet}})
    assert "[slow none] RIGHT: fault none (a healthy run); truth no fail-slow verdict; verdict none confident; " \
           "drill 70.0 s" in lines
    assert "    suspicion below the bar, not a verdict: machine-0 at confidence 0.41" in lines
    assert lines[-1].endswith("1 of 1 slow drills right; C4's kind right in 1, wrong in 0, not stated in 0; false "
                              "alarms on the healthy run: 0")
    lines = gpu_check.slow_lines({"placement": pl, "drills": {"none": alarm}})
    assert "[slow none] WRONG" in lines[1] and lines[-1].endswith("false alarms on the healthy run: 1")


def test_on_gloo_the_slow_gpu_drill_is_skipped_with_the_refusal(tmp_path: Path) -> None:
    # the budget is spent: nothing starts; slow-gpu is refused before the budget is even looked at
    data = gpu_check.part_slow({"backend": "gloo", "tmp": tmp_path, "gpus": 0}, time.monotonic())
    assert data["drills"]["slow-gpu"]["skipped"] == (
        "needs CUDA: slow-gpu acts on the rank's GPU, and a --backend gloo drill runs on CPU; fix: pass --backend "
        "nccl on a machine with an NVIDIA GPU, or drill a rank slow on its host with --fault slow-compute")
    assert data["drills"]["slow-host"]["skipped"].endswith("s left of the budget")
    assert list(tmp_path.iterdir()) == []
    text = "\n".join(gpu_check.report_lines({"backend": "gloo", "budget_s": 60.0, "seconds": 1.0,
                                             "parts": {"slow": {"data": data}}}))
    assert "[slow slow-gpu] skipped: needs CUDA: slow-gpu acts on the rank's GPU" in text
    assert "[slow] graded per rank: 0 of 0 slow drills right; C4's kind right in 0, wrong in 0, not stated in 0; " \
           "false alarms on the healthy run: not run" in text


def test_a_hang_drills_line_says_how_long_the_verdict_took() -> None:
    drill = {"fault": "hang-compute", "seconds": 50.0, "truth": [3], "truth_machines": ["machine-1"],
             "verdict": "rank 3 on machine-1", "correct": True, "named_ranks": [3], "stall": "stalled",
             "steps": {"0": 8}, "died": [], "leftovers": [], "counters": {}, "nvml_during": [], "notes": [],
             "to_verdict_s": 7.25}
    text = "\n".join(gpu_check.report_lines({"backend": "nccl", "budget_s": 470.0, "seconds": 60.0,
                                             "parts": {"drills": {"data": {"hang-compute": drill}}}}))
    assert "[drill hang-compute] RIGHT: verdict 'rank 3 on machine-1'; truth ranks [3] on ['machine-1']; stall " \
           "stalled at steps {'0': 8}; 50.0 s (verdict 7.25 s after the fault)" in text
