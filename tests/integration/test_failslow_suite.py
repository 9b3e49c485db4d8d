"""The fail-slow scorecard: its TP/FP/FN rules and arithmetic, its plan, and one small live suite."""

from __future__ import annotations

import dataclasses
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rankscope.contract.bundle import read_bundle
from rankscope.drill.faults import DrillLayout, machine_name
from rankscope.drill.progress import ProgressWatcher, write_progress
from rankscope.drill.suite import (
    DrillRecord,
    OnsetClock,
    SuiteConfig,
    plan_suite,
    prf,
    run_suite,
    score_records,
    scorecard_lines,
)


def rec(kind: str, *, detected: bool, right: bool = True, t: float | None = 30.0, index: int = 0) -> DrillRecord:
    machine = None if kind == "none" else "machine-1"
    named = (("machine-1",) if right else ("machine-3",)) if detected else ()
    return DrillRecord(index=index, kind=kind, rank=None if kind == "none" else 2, machine=machine,
                       expected_machines=() if kind == "none" else ("machine-1",), detected=detected,
                       named_machines=named, right_machine=detected and right, right_group=detected and right,
                       onset_to_verdict_s=t if detected else None)


def test_outcomes_follow_the_documented_rules() -> None:
    assert rec("slow-compute", detected=True).outcome == "tp"
    assert rec("slow-compute", detected=True, right=False).outcome == "fp+fn"
    assert rec("slow-compute", detected=False).outcome == "fn"
    assert rec("none", detected=True).outcome == "fp"
    assert rec("none", detected=False).outcome == "tn"


def test_precision_recall_f1_from_constructed_records() -> None:
    records = [
        *[rec("slow-compute", detected=True, t=20.0 + i) for i in range(8)],  # 8 TP
        rec("slow-compute", detected=False),  # FN
        rec("slow-comm", detected=True, right=False),  # FP + FN
        rec("slow-comm", detected=True, t=70.0),  # TP, but after 60 s
        rec("none", detected=True),  # FP (false alarm)
        rec("none", detected=False),
    ]
    card = score_records(records)
    o = card["overall"]
    assert (o["tp"], o["fp"], o["fn"]) == (9, 2, 2)
    assert o["precision"] == round(9 / 11, 4) and o["recall"] == round(9 / 11, 4)
    assert o["f1"] == round(9 / 11, 4)
    sc = card["kinds"]["slow-compute"]
    assert (sc["drills"], sc["detected"], sc["right_machine"], sc["tp"], sc["fn"], sc["fp"]) == (9, 8, 8, 8, 1, 0)
    assert sc["precision"] == 1.0 and sc["recall"] == round(8 / 9, 4)
    assert sc["onset_to_verdict_s"] == {"min": 20.0, "median": 24.0, "max": 27.0} and sc["named_within_s"] == 8
    comm = card["kinds"]["slow-comm"]
    assert (comm["tp"], comm["fp"], comm["fn"], comm["named_within_s"]) == (1, 1, 1, 0)
    assert card["baselines"] == {"drills": 2, "false_alarms": 1, "errors": 0}
    assert "none" not in card["kinds"]


def test_empty_denominators_are_none_not_zero_division() -> None:
    assert prf(0, 0, 0) == {"tp": 0, "fp": 0, "fn": 0, "precision": None, "recall": None, "f1": None}
    assert prf(0, 0, 3)["recall"] == 0.0 and prf(0, 0, 3)["precision"] is None
    assert prf(0, 2, 3)["f1"] == 0.0
    card = score_records([rec("none", detected=False)])
    assert card["overall"]["f1"] is None and card["baselines"]["false_alarms"] == 0


def test_plan_is_seeded_cycles_the_kinds_and_spreads_baselines() -> None:
    config = SuiteConfig(faulty=20, baselines=5, seed=11)
    items = plan_suite(config)
    assert [i.index for i in items] == list(range(25))
    names = [i.plan.name for i in items]
    assert names.count("none") == 5 and names[0] != "none" and names[-1] != "none"
    faulty = [i.plan for i in items if i.plan.name != "none"]
    assert [p.name for p in faulty[:5]] == list(config.kinds) and all(names.count(k) == 4 for k in config.kinds)
    assert len({p.rank for p in faulty}) > 3, "ranks are drawn, not fixed"
    assert [i.plan for i in plan_suite(config)] == [i.plan for i in items]
    assert [i.plan.rank for i in plan_suite(SuiteConfig(seed=12))] != [i.plan.rank for i in items]
    slow = next(p for p in faulty if p.name == "slow-compute")
    assert slow.factor == 1.5 and slow.machine == DrillLayout().machine_of(slow.rank)
    assert all(i.loader_workers == (1 if i.plan.name == "slow-dataloader" else 0) for i in items)


def test_onset_is_read_from_the_rank_progress_file(tmp_path: Path) -> None:
    (tmp_path / "progress").mkdir()
    clock = OnsetClock(ProgressWatcher(tmp_path, 8), rank=5, step=3)
    write_progress(tmp_path, 5, 2)
    assert clock.poll() is None
    before = time.monotonic()
    write_progress(tmp_path, 5, 3)
    onset = clock.poll()
    assert onset is not None and before - 0.05 <= onset <= time.monotonic() + 0.05 and clock.exact
    write_progress(tmp_path, 5, 9)
    assert clock.poll() == onset, "the onset is fixed once seen"


def test_scorecard_lines_show_each_kind_and_the_overall_figures() -> None:
    records = [rec("slow-compute", detected=True), rec("thermal", detected=False), rec("none", detected=False)]
    lines = scorecard_lines({"scorecard": score_records(records), "wall_s": 12.0})
    text = "\n".join(lines)
    assert "slow-compute" in text and "thermal" in text and "confident false alarms: 0" in text
    assert "TP 1 FP 0 FN 1" in text and "F1 0.67" in text


def test_cli_rejects_an_empty_suite_with_the_fix() -> None:
    proc = subprocess.run([sys.executable, "-m", "rankscope", "drill", "--suite", "failslow", "--suite-drills", "0",
                           "--suite-baselines", "0"], capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 2 and "at least one drill" in proc.stderr and "fix:" in proc.stderr


# ---- one small live drill ----------------------------------------------------


@pytest.mark.drill
@pytest.mark.timeout(300)
def test_live_drill_is_watched_from_its_onset_and_cleaned_up(tmp_path: Path) -> None:
    """A real 8-rank gloo job with rank 1.5x slower, watched live for a short while.

    Short on purpose (the full scorecard is benchmarks/failslow_scorecard.py,
    minutes per drill): this checks the machinery: the onset found from the
    progress files, polls at about 1 Hz, stack rounds, every process stopped,
    and a confident verdict, if one came this soon, naming the slow machine.
    """
    config = SuiteConfig(faulty=1, baselines=0, seed=3, kinds=("slow-compute",), fault_step=10,
                         stack_interval_s=4.0, time_limit_s=15.0, run_root=tmp_path, record=True)
    result = run_suite(config)
    json.dumps(result, default=str)  # the --json report
    (d,) = result["drills"]
    assert d["kind"] == "slow-compute" and d["error"] is None, d
    assert d["machine"] == machine_name(DrillLayout().machine_of(d["rank"]))
    assert d["watched_after_onset_s"] is not None
    assert d["detected"] or d["watched_after_onset_s"] >= config.time_limit_s
    # Polls at about 1 Hz and stack rounds every 4 s while it watched; a confident verdict ends the watch early.
    assert d["polls"] >= min(10, 0.5 * d["watched_after_onset_s"]) and d["stack_rounds"] >= 1, d
    assert d["detected"] or d["stack_rounds"] >= 3, d
    assert not d["leftovers"], "the drill's own stop left nothing for the sweep"
    if d["detected"]:
        assert d["right_machine"] and d["outcome"] == "tp", d
    series = read_bundle(Path(d["run_dir"]) / "watch.json")
    assert len(series.snapshots) == d["polls"] and series.ground_truth["rank"] == d["rank"]


# ---- the slow faults' strength: steered to `factor` times the healthy step ----


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_slow_compute_burn_follows_the_steps_taken_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """Healthy steps of 0.2 s and 4 micro-batches; at 1.5x the rank first burns the nominal 0.1 s a step
    (0.025 s per micro-batch). When observers make every step 3x long (0.6 s without the fault), the burn
    follows to 0.5 x 0.6 s, so the fault stays half a step; it never falls below the nominal 0.1 s when
    peers catch up while it burns, and never rises past 3 x 1.5 x 0.2 s however long a step gets."""
    from rankscope.drill import injection
    from rankscope.drill.faults import FaultPlan

    clock = FakeClock()
    burns: list[float] = []
    monkeypatch.setattr(injection.time, "perf_counter", clock)
    monkeypatch.setattr(injection, "drill_injected_slow_compute", burns.append)
    inj = injection.Injector(FaultPlan(name="slow-compute", rank=3, step=10, factor=1.5), 3)

    def step(n: int, unfaulted: float) -> float:
        """One step that takes `unfaulted` seconds plus whatever the rank burns in it; returns the burn."""
        inj.step = n
        inj.at_step_start()
        before = len(burns)
        for _ in range(4):
            inj.before_compute()
            inj.after_compute()
        burned = sum(burns[before:])
        clock.now += unfaulted + burned
        return burned

    assert [step(n, 0.2) for n in range(10)] == [0.0] * 10 and inj.healthy_step_s() == pytest.approx(0.2)
    assert step(10, 0.2) == pytest.approx(0.1) and burns[-4:] == pytest.approx([0.025] * 4)
    observed = [step(n, 0.6) for n in range(11, 20)]  # every step made 3x long by something else
    assert observed[-1] == pytest.approx(0.5 * 0.6), observed
    assert all(b >= a - 1e-9 for a, b in itertools.pairwise(observed)), "the burn rises to it, it does not swing"
    caught_up = [step(n, 0.05) for n in range(20, 30)]  # peers caught up while it burned
    assert caught_up[-1] == pytest.approx(0.1), "never below the nominal (1.5 - 1) x 0.2 s"
    runaway = [step(n, 20.0) for n in range(30, 40)]
    assert max(runaway) == pytest.approx(3 * 1.5 * 0.2), "never past 3 x 1.5 healthy steps"
    other = injection.Injector(FaultPlan(name="slow-compute", rank=3, step=10, factor=1.5), 2)
    other.step = 11
    other.after_compute()
    assert len(burns) == 4 * 30, "only the faulty rank burns"


def test_thermal_stop_is_steered_to_factor_times_the_healthy_step() -> None:
    from rankscope.drill.outside_fault import _HealthyStep

    h = _HealthyStep(fault_step=10)
    for s in range(12):
        h.saw(s, 1000.0 + 0.2 * s)  # steps past the fault step are not healthy and are ignored
    assert h.seconds() == pytest.approx(0.2)
    first = h.stepped(11, 1000.0, 2.0)
    assert first == pytest.approx(0.2), "stopped one healthy step per step at 2x"
    longer = h.stepped(12, 1000.3, 2.0)  # that step took 0.3 s, short of 2 x 0.2 s
    assert longer == pytest.approx(0.2 + 0.5 * 0.1)
    shorter = h.stepped(13, 1000.3 + 0.6, 2.0)  # 0.6 s: too long now
    assert shorter < longer


def test_unprepared_drills_score_in_their_own_column() -> None:
    prepared = [rec("slow-compute", detected=True, t=25.0), rec("none", detected=False)]
    plain = [dataclasses.replace(r, unprepared=True) for r in (
        rec("slow-compute", detected=True, t=40.0), rec("slow-compute", detected=False), rec("none", detected=True))]
    card = score_records(prepared + plain)
    assert card["kinds"]["slow-compute"]["drills"] == 1 and card["baselines"]["false_alarms"] == 0
    un = card["unprepared"]
    assert (un["kinds"]["slow-compute"]["drills"], un["kinds"]["slow-compute"]["tp"]) == (2, 1)
    assert un["baselines"]["false_alarms"] == 1 and (un["overall"]["tp"], un["overall"]["fp"]) == (1, 1)
    lines = scorecard_lines({"scorecard": card, "wall_s": 1.0})
    assert lines[0].endswith("unprepared job")
    assert next(line for line in lines if line.startswith("slow-compute")).endswith("1/2 (1 <=60s)")
    assert lines[-1].startswith("unprepared jobs (plain torchrun, no counters): TP 1 FP 1 FN 1")
    assert "unprepared" not in score_records(prepared)
