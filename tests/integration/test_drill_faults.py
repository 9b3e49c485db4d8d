"""The desync, dataloader-deadlock and sigstop faults: their ground truth, their scoring, and real drills.

The first tests are pure (plans, ground truth, grading). The real drills
(marked ``drill``, one job per fault, ~1 min each on two loaded cores) check
that each fault happens as defined on a live TP=2 PP=2 DP=2 job through the
agents: the desync group sits one step ahead inside the injected frame while
everyone else waits in the closing barrier; the dataloader worker's two
threads hold each other's lock while its rank waits for data; the stopped
rank is in state T and py-spy cannot read it. Each drill also leaves no
process behind (a stopped one included).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from drill_processes import processes_under
from rankscope.analyzers.findings import Finding, Suspect, SuspectKind, Verdict
from rankscope.cli.main import main as cli_main
from rankscope.contract.errors import RankscopeError
from rankscope.drill.faults import HANG_FAULTS, DrillLayout, ground_truth, make_plan
from rankscope.drill.injection import desync_ranks
from rankscope.drill.processes import marked_processes
from rankscope.drill.scoring import score_verdict

LAYOUT = DrillLayout(tp=2, pp=2, dp=2, machines=4)

# --------------------------------------------------------------------------
# ground truth
# --------------------------------------------------------------------------


def test_new_faults_are_hang_faults() -> None:
    assert {"desync", "dataloader-deadlock", "sigstop"} <= set(HANG_FAULTS)


def test_desync_names_exactly_the_ranks_that_run_ahead() -> None:
    truth = ground_truth(make_plan("desync", LAYOUT, rank=2, step=5), LAYOUT)
    assert (truth.suspect_kind, truth.suspect_ranks, truth.suspect_machines) == ("desync", (2, 3), ("machine-1",))
    assert truth.group == "tp" and truth.frame == "drill_injected_desync" and truth.injected_by == "rank"
    # Another group: rank 5's pipeline runs ahead, on two machines.
    truth = ground_truth(make_plan("desync", LAYOUT, rank=5, step=5, group="pp"), LAYOUT)
    assert (truth.suspect_ranks, truth.suspect_machines) == ((1, 5), ("machine-0", "machine-2"))
    assert desync_ranks(make_plan("desync", LAYOUT, rank=5, group="pp"), LAYOUT) == {1, 5}
    assert desync_ranks(make_plan("hang-collective", LAYOUT, rank=5), LAYOUT) == frozenset()


def test_a_desync_of_the_whole_job_is_refused() -> None:
    with pytest.raises(RankscopeError, match="every rank"):
        make_plan("desync", DrillLayout(tp=2, pp=1, dp=1, machines=1), rank=0, group="tp")


def test_sigstop_and_deadlock_ground_truth() -> None:
    stop = ground_truth(make_plan("sigstop", LAYOUT, rank=5, step=5), LAYOUT)
    assert (stop.suspect_kind, stop.suspect_ranks, stop.machine) == ("rank", (5,), "machine-2")
    assert (stop.injected_by, stop.process_state, stop.frame) == ("orchestrator", "T", None)
    lock = ground_truth(make_plan("dataloader-deadlock", LAYOUT, rank=3, step=5), LAYOUT)
    assert (lock.suspect_kind, lock.suspect_ranks, lock.role) == ("rank", (3,), "dataloader")
    assert lock.frame == "drill_injected_dataloader_deadlock" and lock.process_state is None


def test_a_dataloader_fault_without_dataloader_workers_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["drill", "--headless", "--fault", "dataloader-deadlock", "--loader-workers", "0"]) == 2
    assert "--loader-workers 1" in capsys.readouterr().err


# --------------------------------------------------------------------------
# grading a desync
# --------------------------------------------------------------------------


def _suspect(kind: SuspectKind, ranks: tuple[int, ...], machines: tuple[str, ...]) -> Suspect:
    return Suspect(kind=kind, ranks=ranks, machines=machines, score=1.0, evidence=("x",))


def test_a_desync_is_top_1_only_as_a_desync_of_exactly_the_ranks_ahead() -> None:
    truth = ground_truth(make_plan("desync", LAYOUT, rank=2, step=5), LAYOUT).to_dict()
    right = Finding(kind="desync", ranks=(2, 3), summary="ranks 2-3 in another collective")
    graded = score_verdict(Verdict(suspects=(), summary="desync", findings=(right,)), truth)
    assert graded["correct"] and graded["truth_position"] == 1 and graded["named"] == {"kind": "desync", "ranks": [2, 3]}
    # The waiting majority named instead, or a superset: wrong.
    for ranks in ((0, 1, 4, 5, 6, 7), (0, 1, 2, 3), (2,)):
        wrong = Finding(kind="desync", ranks=ranks, summary="")
        assert not score_verdict(Verdict(suspects=(), summary="", findings=(wrong,)), truth)["correct"]
    # Right ranks, wrong kind: the TP group as a part to evict is not the program mismatch.
    tp = _suspect(SuspectKind.TP, (2, 3), ("machine-1",))
    graded = score_verdict(Verdict(suspects=(tp,), summary="TP group 1"), truth)
    assert not graded["correct"] and graded["named"]["kind"] == "tp"
    # One finding per split group: together they name the ranks ahead.
    halves = (Finding(kind="desync", ranks=(2,), summary=""), Finding(kind="desync", ranks=(3,), summary=""))
    assert score_verdict(Verdict(suspects=(), summary="", findings=halves), truth)["correct"]
    stray = (*halves, Finding(kind="desync", ranks=(6,), summary=""))
    assert not score_verdict(Verdict(suspects=(), summary="", findings=stray), truth)["correct"]
    # A desync reported after another finding is found, but not first.
    other = Finding(kind="fr-size-mismatch", ranks=(0, 1), summary="")
    graded = score_verdict(Verdict(suspects=(), summary="", findings=(other, right)), truth)
    assert not graded["correct"] and graded["truth_position"] == 2
    assert not score_verdict(Verdict(suspects=(), summary="no verdict"), truth)["correct"]


# --------------------------------------------------------------------------
# real drills
# --------------------------------------------------------------------------


def _drill(tmp_path: Path, fault: str, rank: int, **plan: Any) -> dict[str, Any]:
    """One headless drill through the agents; afterwards nothing it started may be alive."""
    from rankscope.drill.launcher import TrainingOptions
    from rankscope.drill.session import DrillConfig, run_headless

    config = DrillConfig(layout=LAYOUT, plan=make_plan(fault, LAYOUT, rank=rank, step=5, **plan),
                         training=TrainingOptions(steps=45, checkpoint_every=5), run_dir=tmp_path / "run",
                         stall_seconds=3.0)
    report = run_headless(config)
    assert marked_processes(report["run_id"]) == []
    assert processes_under(tmp_path / "run") == []
    assert report["stall"]["reason"] == "stalled", report["stall"]
    return report


def _ranks(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {int(r): v for m in report["captured"]["machines"] for r, v in m["ranks"].items()}


def _names(frames: list[str]) -> list[str]:
    return [f.split(" (")[0] for f in frames]


@pytest.mark.drill
@pytest.mark.timeout(300)
def test_desync_drill_puts_its_group_one_step_ahead(tmp_path: Path) -> None:
    report = _drill(tmp_path, "desync", 2)
    # Everyone completed the same steps: the group ahead is inside its extra step, which never ends.
    assert set(report["stall"]["steps"].values()) == {5}
    found = report["captured"]["injected_frame_found_in"]
    assert sorted((f["rank"], f["role"]) for f in found) == [(2, "main"), (3, "main")]
    ranks = _ranks(report)
    assert sorted(ranks) == list(range(8))
    for rank, r in ranks.items():
        names = _names(r["main"])
        if rank in (2, 3):
            # Inside a step's communication with a stage that has left the loop.
            assert "train_step" in names and ("send" in names or "recv" in names), (rank, names)
            assert "barrier" not in names
        else:
            # The closing barrier, outside any step.
            assert names[0] == "barrier" and "train" in names and "train_step" not in names, (rank, names)


@pytest.mark.drill
@pytest.mark.timeout(300)
def test_dataloader_deadlock_drill_locks_the_worker_and_its_rank_waits(tmp_path: Path) -> None:
    report = _drill(tmp_path, "dataloader-deadlock", 3)
    found = report["captured"]["injected_frame_found_in"]
    assert [(f["rank"], f["role"]) for f in found] == [(3, "dataloader")]
    ranks = _ranks(report)
    worker = next(sp for sp in ranks[3]["subprocesses"] if sp["pid"] == found[0]["pid"])
    assert worker["error"] is None
    bundle = _read(report)
    main = [f.name for m in bundle.latest.machines for rs in m.stacks if rs.rank == 3
            for t in rs.main.threads or () if t.thread_name == "MainThread" for f in t.frames]
    # The rank's main process waits in the DataLoader for the batch its worker never sends, before its step.
    assert "_MultiProcessingDataLoaderIter._get_data" in main and "train_step" not in main, main
    threads = {t.thread_name: [f.name for f in t.frames] for m in bundle.latest.machines for rs in m.stacks
               if rs.rank == 3 for sp in rs.subprocesses if sp.pid == found[0]["pid"] for t in sp.threads or ()}
    # Both sides of the lock-order deadlock: the worker's main thread and its peer thread.
    assert threads["MainThread"][0] == "drill_injected_dataloader_deadlock"
    assert threads["drill-deadlock-peer"][0] == "drill_injected_dataloader_deadlock.<locals>.peer"
    assert report["verdict"]["correct"], report["verdict"]["summary"]


@pytest.mark.drill
@pytest.mark.timeout(300)
def test_sigstop_drill_stops_the_rank_so_py_spy_cannot_read_it(tmp_path: Path) -> None:
    report = _drill(tmp_path, "sigstop", 5)
    assert report["stopped_rank"]["rank"] == 5 and report["stopped_rank"]["state"] == "stopped"
    ranks = _ranks(report)
    assert ranks[5]["main"] == [] and ranks[5]["error"], ranks[5]
    assert report["captured"]["ranks_with_stacks"] == [0, 1, 2, 3, 4, 6, 7]
    assert report["ground_truth"]["process_state"] == "T"
    # The agent says why: the process state it read from /proc when py-spy failed.
    errors = [rs.main.error for m in _read(report).latest.machines for rs in m.stacks if rs.rank == 5]
    assert len(errors) == 1 and errors[0] is not None and errors[0].process_state == "T", errors
    # The verdict: the stopped rank alone is the prime suspect, its waiting peers are its victims.
    verdict = report["verdict"]
    assert verdict["correct"] and verdict["top"]["ranks"] == [5], verdict["summary"]


def _read(report: dict[str, Any]) -> Any:
    from rankscope.contract.bundle import read_bundle

    return read_bundle(Path(report["bundle"]))


def test_skip_send_names_the_pipeline_pair_as_a_desync() -> None:
    truth = ground_truth(make_plan("skip-send", LAYOUT, rank=5, step=5), LAYOUT)
    assert (truth.suspect_kind, truth.suspect_ranks, truth.group) == ("desync", (1, 5), "pp")
    assert truth.frame == "drill_injected_skip_send" and "skip-send" in HANG_FAULTS
    with pytest.raises(RankscopeError, match="pipeline send"):
        make_plan("skip-send", LAYOUT, rank=5, step=5, group="tp")
