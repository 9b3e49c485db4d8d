"""The drill: layout math, fault registry and ground truth (no processes), then real drills.

The real drills start torchrun nodes, ranks with dataloader workers and
checkpoint writers, and agents, so they are marked ``drill`` and kept few:
the hang-p2p acceptance drill through the agents (with the cleanup check),
Ctrl-C cleanup, and bit-for-bit resume on another set of machines.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from agent_helpers import ctrl_c_works, process_state
from drill_processes import processes_under
from headless_drills import DRILL_TIMEOUT_S, HANG_P2P, HeadlessDrills
from rankscope.cli.main import main as cli_main
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import ProcessRole
from rankscope.drill.faults import FAULTS, DrillLayout, FaultPlan, ground_truth, make_plan
from rankscope.drill.processes import marked_processes
from rankscope.drill.progress import ProgressWatcher, read_progress, write_progress
from rankscope.drill.worker import RUN_ID_ENV

# --------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------


def test_rank_order_is_tp_then_dp_then_pp() -> None:
    layout = DrillLayout(tp=2, pp=2, dp=2, machines=4)
    assert [layout.coords(r) for r in range(8)] == [
        (0, 0, 0), (1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1), (1, 1, 1)]
    assert all(layout.rank_of(*layout.coords(r)) == r for r in range(8))
    assert layout.group_of("tp", 5) == (4, 5)
    assert layout.group_of("dp", 5) == (5, 7)
    assert layout.group_of("pp", 5) == (1, 5)
    assert layout.ranks_on(2) == (4, 5)
    assert layout.machine_of(7) == 3


def test_groups_partition_the_world_in_the_same_order_for_everyone() -> None:
    layout = DrillLayout(tp=2, pp=4, dp=4, machines=16)
    for kind, size in (("tp", 2), ("pp", 4), ("dp", 4)):
        groups = layout.groups(kind)
        assert sorted(r for g in groups for r in g) == list(range(32))
        assert {len(g) for g in groups} == {size}
    # ByteRobust Fig. 7 has pp before dp; in Megatron's default order a PP group strides by TP*DP.
    assert layout.group_of("pp", 0) == (0, 8, 16, 24)


def test_ranks_that_do_not_split_over_the_machines_name_the_divisors() -> None:
    with pytest.raises(RankscopeError) as err:
        DrillLayout(tp=2, pp=2, dp=2, machines=3)
    assert "1, 2, 4, 8" in err.value.fix


# --------------------------------------------------------------------------
# faults and ground truth
# --------------------------------------------------------------------------


def test_hang_p2p_ground_truth_names_the_pipeline_group_and_its_machines() -> None:
    layout = DrillLayout()
    truth = ground_truth(make_plan("hang-p2p", layout, rank=5, step=20), layout)
    assert truth.suspect_kind == "pp"
    assert truth.suspect_ranks == (1, 5)
    assert truth.suspect_machines == ("machine-0", "machine-2")
    assert truth.machine == "machine-2"
    assert truth.frame == "drill_injected_hang_p2p"
    assert dict(truth.coords) == {"tp": 1, "dp": 0, "pp": 1}


def test_group_faults_default_to_a_group_that_exists() -> None:
    assert make_plan("hang-collective", DrillLayout(), rank=3).group == "tp"
    assert make_plan("hang-collective", DrillLayout(tp=1, pp=2, dp=2, machines=2), rank=3).group == "dp"
    truth = ground_truth(make_plan("hang-collective", DrillLayout(), rank=3, group="dp"), DrillLayout())
    assert (truth.suspect_kind, truth.suspect_ranks) == ("dp", (1, 3))
    with pytest.raises(RankscopeError):
        make_plan("hang-p2p", DrillLayout(tp=2, pp=1, dp=2, machines=2), rank=0)
    with pytest.raises(RankscopeError):
        make_plan("hang-compute", DrillLayout(), rank=0, group="tp")


def test_a_random_rank_is_reproducible_and_stays_on_the_chosen_machine() -> None:
    layout = DrillLayout()
    picks = {make_plan("crash", layout, seed=s).rank for s in range(20)}
    assert len(picks) > 1
    assert make_plan("crash", layout, seed=7).rank == make_plan("crash", layout, seed=7).rank
    assert {make_plan("crash", layout, machine=3, seed=s).rank for s in range(20)} <= {6, 7}
    with pytest.raises(RankscopeError):
        make_plan("crash", layout, rank=0, machine=3)
    with pytest.raises(RankscopeError):
        make_plan("crash", layout, rank=8)
    with pytest.raises(RankscopeError):
        make_plan("no-such-fault", layout)


def test_machine_and_checkpoint_faults() -> None:
    layout = DrillLayout()
    contention = ground_truth(make_plan("cpu-contention", layout, machine=1, seed=0), layout)
    assert (contention.suspect_kind, contention.suspect_ranks, contention.suspect_machines) == (
        "machine", (2, 3), ("machine-1",))
    assert contention.injected_by == "orchestrator"
    stall = ground_truth(make_plan("checkpoint-stall", layout, rank=2, step=12), layout, checkpoint_every=5)
    assert (stall.step, stall.role, stall.suspect_ranks) == (15, "checkpoint", (2,))


def test_plan_travels_through_the_environment_and_intermittent_faults_toggle() -> None:
    plan = make_plan("slow-compute", DrillLayout(), rank=4, step=10, factor=1.5, on_steps=3, off_steps=2)
    again = FaultPlan.from_env(plan.to_env())
    assert again == plan
    assert [again.active(s) for s in range(8, 20)] == [
        False, False, True, True, True, False, False, True, True, True, False, False]
    assert FaultPlan.from_env(None).name == "none"
    assert not FaultPlan.from_env(None).hits(0, 100)


def test_every_fault_has_a_category_and_a_suspect() -> None:
    assert {f.category for f in FAULTS.values()} == {"none", "hang", "slow"}
    for spec in FAULTS.values():
        assert spec.suspect in {"none", "rank", "machine", "group", "pp", "desync"}
        if spec.by == "rank" and spec.name != "none":
            assert spec.frame is not None and spec.frame.startswith("drill_injected_")


def test_bad_drill_flags_exit_2_with_a_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["drill", "--headless", "--fault", "melt", "--no-agents"]) == 2
    assert "choose one of" in capsys.readouterr().err
    assert cli_main(["drill", "--headless", "--machines", "3"]) == 2
    assert cli_main(["drill", "--headless", "--fault", "hang-p2p", "--fault-step", "30", "--steps", "20"]) == 2


# --------------------------------------------------------------------------
# progress
# --------------------------------------------------------------------------


def test_progress_stops_when_no_rank_advances(tmp_path: Path) -> None:
    now = [100.0]
    (tmp_path / "progress").mkdir()
    watcher = ProgressWatcher(tmp_path, world=2, clock=lambda: now[0])
    write_progress(tmp_path, 0, 3)
    write_progress(tmp_path, 1, 3)
    watcher.poll()
    assert watcher.min_step() == 3
    now[0] += 4.0
    write_progress(tmp_path, 1, 4)
    watcher.poll()
    assert watcher.idle_seconds() == 0.0
    now[0] += 6.0
    watcher.poll()
    assert watcher.idle_seconds() == 6.0
    assert watcher.min_step() == 3 and watcher.max_step() == 4
    assert read_progress(tmp_path)[1].pid == os.getpid()


# --------------------------------------------------------------------------
# real drills
# --------------------------------------------------------------------------


def _innermost_names(frames: list[str]) -> str:
    return " ".join(frames)


@pytest.mark.drill
@pytest.mark.timeout(DRILL_TIMEOUT_S + 60)
def test_hang_p2p_drill_through_the_agents(headless_drills: HeadlessDrills) -> None:
    # `rankscope drill --headless`, hang-p2p at rank 5, step 6 (the job test_analyze_drills.py grades, run once)
    drill = headless_drills.run(*HANG_P2P)
    report = drill.report

    assert report["stall"]["reason"] == "stalled"
    cap = report["captured"]
    machines = {m["machine"]: m for m in cap["machines"]}
    assert sorted(machines) == ["machine-0", "machine-1", "machine-2", "machine-3"]
    for i, name in enumerate(sorted(machines)):
        m = machines[name]
        assert m["reachable"], m["error"]
        assert m["ranks_seen"] == [2 * i, 2 * i + 1]
    assert cap["ranks_with_stacks"] == list(range(8))
    # The faulty rank shows the injected frame, in its main process.
    assert cap["injected_frame_at_faulty_rank"] is True
    assert {f["rank"] for f in cap["injected_frame_found_in"]} == {5}
    ranks = {int(r): v for m in machines.values() for r, v in m["ranks"].items()}
    # Rank 1 is rank 5's pipeline peer: it waits for the gradient rank 5 never sends.
    assert "recv_backward" in _innermost_names(ranks[1]["main"])
    for rank, r in ranks.items():
        if rank == 5:
            continue
        text = _innermost_names(r["main"])
        assert any(op in text for op in ("recv", "send", "all_reduce", "barrier")), (rank, r["main"])
        roles = sorted(sp["role"] for sp in r["subprocesses"])
        assert roles == [ProcessRole.CHECKPOINT.value, ProcessRole.DATALOADER.value], (rank, r["subprocesses"])
    # The bundle holds the same snapshot and the ground truth.
    bundle = json.loads(Path(report["bundle"]).read_text())
    assert bundle["ground_truth"]["rank"] == 5 and bundle["ground_truth"]["suspect_ranks"] == [1, 5]
    # Every process of the drill is gone.
    assert marked_processes(report["run_id"]) == []
    assert processes_under(drill.run_dir) == []


FORKER = """
import subprocess, sys, time
print("ready", flush=True)
while True:  # a new child every millisecond or so, as an agent starts py-spy windows back to back
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    time.sleep(0.001)
"""


@pytest.mark.timeout(120)
def test_kill_trees_leaves_no_child_a_forking_process_starts_while_it_is_being_stopped(tmp_path: Path) -> None:
    """The trees are frozen before anything is signalled: a child forked between the collection and the
    SIGTERM would be re-parented to init, out of the tree, and only the run's sweep would find it."""
    from rankscope.drill.processes import kill_trees

    run_id = f"forker-{os.getpid()}"
    env = {**os.environ, RUN_ID_ENV: run_id}
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", FORKER], env=env, stdout=subprocess.PIPE)
        try:
            assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
            while len(marked_processes(run_id)) < 10:  # a busy tree, forking as it is stopped
                time.sleep(0.05)
            kill_trees([proc.pid])
            proc.wait(timeout=10)
            assert marked_processes(run_id) == []
        finally:
            for pid in marked_processes(run_id):
                with contextlib.suppress(psutil.Error):
                    psutil.Process(pid).kill()
            if proc.poll() is None:
                proc.kill()


# A process that ignores SIGTERM (an agent whose graceful stop takes its time), with a child that does not.
STUBBORN = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(120)
def test_trees_signalled_together_are_stopped_without_waiting_for_each_others_grace() -> None:
    """What a restart does: the agents are signalled first, the nodes next, and the nodes' stop does not wait
    for the agents' grace; the agents are SIGKILLed only once their own grace is over."""
    from rankscope.drill.processes import signal_trees

    stubborn = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE)
    plain = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert stubborn.stdout is not None
        grandchild = int(stubborn.stdout.readline())
        agents = signal_trees([stubborn.pid], grace_s=600.0)
        assert sorted(p.pid for p in agents.procs) == sorted([stubborn.pid, grandchild])
        signal_trees([plain.pid]).finish()
        assert plain.wait(timeout=10) == -signal.SIGTERM
        assert stubborn.poll() is None, "the nodes' stop waited out (or cut short) the agents' grace"
        agents.kill_at = time.monotonic()  # the agents' grace is over: what is left is killed
        agents.finish()
        assert stubborn.wait(timeout=10) == -signal.SIGKILL
        assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    finally:
        for proc in (stubborn, plain):
            if proc.poll() is None:
                proc.kill()


# A process that answers SIGTERM by starting a child and carries on (an agent whose sampler starts its next py-spy
# window while the agent stops gracefully, and whose stop outlasts the launcher's grace).
LATE_FORKER = """
import signal, subprocess, sys, time
def start_another(signum, frame):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    print(child.pid, flush=True)
signal.signal(signal.SIGTERM, start_another)
print("ready", flush=True)
time.sleep(120)
"""


@pytest.mark.timeout(120)
def test_a_child_started_after_the_sigterm_is_killed_with_its_parent_at_the_grace() -> None:
    """The trees were collected before the SIGTERM; a process still running at its grace is collected again, so
    the SIGKILL reaches what it started since, instead of leaving it, orphaned, for the run's final sweep."""
    from rankscope.drill.processes import signal_trees

    proc = subprocess.Popen([sys.executable, "-c", LATE_FORKER], stdout=subprocess.PIPE)
    late = 0
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
        stopping = signal_trees([proc.pid], grace_s=600.0)
        assert [p.pid for p in stopping.procs] == [proc.pid]
        late = int(proc.stdout.readline())  # started by its SIGTERM handler, after the collection
        assert psutil.Process(late).ppid() == proc.pid
        stopping.kill_at = time.monotonic()  # its grace is over
        stopping.finish()
        assert proc.wait(timeout=10) == -signal.SIGKILL
        assert not psutil.pid_exists(late) or psutil.Process(late).status() == psutil.STATUS_ZOMBIE, \
            "the child started during the grace outlived the stop"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if late:
            with contextlib.suppress(psutil.Error):
                psutil.Process(late).kill()


def test_descendants_come_from_one_reading_of_the_process_table() -> None:
    from rankscope.drill.processes import _descendants

    stubborn = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE)
    try:
        assert stubborn.stdout is not None
        grandchild = int(stubborn.stdout.readline())
        assert _descendants([stubborn.pid]) == [grandchild]
        assert sorted(_descendants([os.getpid()])) == sorted(p.pid for p in psutil.Process().children(recursive=True))
    finally:
        stubborn.kill()
        stubborn.wait(timeout=10)
        with contextlib.suppress(psutil.Error):
            psutil.Process(grandchild).kill()


@pytest.mark.timeout(120)
def test_groups_signalled_in_one_pass_keep_their_own_grace() -> None:
    """A restart signals its agents and its nodes in one pass (signal_forest): each group's trees are collected
    whole, the nodes' stop does not wait for the agents' grace, and what outlives its own grace is SIGKILLed."""
    from rankscope.drill.processes import signal_forest

    stubborn = subprocess.Popen([sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE)
    ends_at_sigterm = STUBBORN.replace("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n", "")
    plain = subprocess.Popen([sys.executable, "-c", ends_at_sigterm], stdout=subprocess.PIPE)
    try:
        assert stubborn.stdout is not None and plain.stdout is not None
        grandchild, plain_child = int(stubborn.stdout.readline()), int(plain.stdout.readline())
        agents, nodes = signal_forest([([stubborn.pid], 600.0), ([plain.pid], 2.0)])
        assert sorted(p.pid for p in agents.procs) == sorted([stubborn.pid, grandchild])
        assert sorted(p.pid for p in nodes.procs) == sorted([plain.pid, plain_child])
        nodes.finish()
        assert plain.wait(timeout=10) == -signal.SIGTERM
        assert not psutil.pid_exists(plain_child) or psutil.Process(plain_child).status() == psutil.STATUS_ZOMBIE
        assert stubborn.poll() is None, "the nodes' stop waited out (or cut short) the agents' grace"
        agents.kill_at = time.monotonic()
        agents.finish()
        assert stubborn.wait(timeout=10) == -signal.SIGKILL
    finally:
        for proc in (stubborn, plain):
            if proc.poll() is None:
                proc.kill()


@pytest.mark.timeout(120)
def test_frozen_trees_are_held_unsignalled_until_they_are_let_go() -> None:
    """What a restart does with the old agents: frozen with the old job, held so (no SIGTERM: their graceful stop
    would take the cores the new ranks need) until the job has resumed, then terminated with their grace."""
    from rankscope.drill.processes import freeze_forest

    ends_at_sigterm = STUBBORN.replace("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n", "")
    agent = subprocess.Popen([sys.executable, "-c", ends_at_sigterm], stdout=subprocess.PIPE)
    node = subprocess.Popen([sys.executable, "-c", ends_at_sigterm], stdout=subprocess.PIPE)
    try:
        assert agent.stdout is not None and node.stdout is not None
        agent_child, node_child = int(agent.stdout.readline()), int(node.stdout.readline())
        agents, nodes = freeze_forest([[agent.pid], [node.pid]])
        assert sorted(p.pid for p in agents.procs) == sorted([agent.pid, agent_child])
        assert sorted(p.pid for p in nodes.procs) == sorted([node.pid, node_child])
        assert {pid: process_state(pid) for pid in (agent.pid, agent_child, node.pid, node_child)} == dict.fromkeys(
            (agent.pid, agent_child, node.pid, node_child), "T")
        nodes.terminate(2.0).finish()
        assert node.wait(timeout=10) == -signal.SIGTERM
        # The nodes are gone; the agents are still held, stopped, with no signal delivered.
        assert [process_state(agent.pid), process_state(agent_child)] == ["T", "T"] and agent.poll() is None
        agents.terminate(2.0).finish()
        assert agent.wait(timeout=10) == -signal.SIGTERM
        assert process_state(agent_child) in ("gone", "Z")
        assert agents.procs == [] and agents.terminate(2.0).procs == []  # let go once; again is nothing
    finally:
        for proc in (agent, node):
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=10)
        for pid in (agent_child, node_child):
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()


def test_a_process_name_with_spaces_and_parentheses_does_not_hide_its_parent() -> None:
    """The process table is read from /proc/PID/stat, whose second field is the name in parentheses."""
    from rankscope.drill.processes import _children_map, _parent_of

    named = subprocess.Popen([sys.executable, "-c", "import sys, time\n"
                              "open('/proc/self/comm', 'w').write(') 7 (x y')\nprint(flush=True)\ntime.sleep(60)"],
                             stdout=subprocess.PIPE)
    try:
        assert named.stdout is not None
        named.stdout.readline()
        assert psutil.Process(named.pid).name() == ") 7 (x y"
        assert _parent_of(str(named.pid)) == os.getpid()
        assert named.pid in _children_map()[os.getpid()]
        assert _parent_of("999999999") is None
    finally:
        named.kill()
        named.wait(timeout=10)


@pytest.mark.drill
@pytest.mark.timeout(180)
def test_ctrl_c_stops_every_process_of_the_drill(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        ctrl_c_works([sys.executable, "-m", "rankscope", "drill", "--headless", "--tp", "1", "--pp", "2", "--dp", "1",
                      "--machines", "2", "--fault", "hang-compute", "--fault-rank", "1", "--fault-step", "3",
                      "--stall-seconds", "600", "--stall-timeout", "600", "--no-agents", "--run-dir", str(run_dir)]),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 150
        ranks: dict[int, int] = {}
        while time.monotonic() < deadline and proc.poll() is None:
            progress = read_progress(run_dir)
            ranks = {r: p.step for r, p in progress.items()}
            if len(ranks) == 2 and min(ranks.values()) >= 3:
                break
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()[1]
        assert len(ranks) == 2, ranks
        run_id = next(p for p in psutil.Process(proc.pid).children(recursive=True)
                      if RUN_ID_ENV in p.environ()).environ()[RUN_ID_ENV]
        assert len(marked_processes(run_id)) >= 6  # 2 torchrun, 2 ranks, their writers and loader workers
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, err
        assert marked_processes(run_id) == []
        assert processes_under(run_dir) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.drill
@pytest.mark.timeout(300)
def test_after_a_crash_training_resumes_bit_for_bit_on_another_set_of_machines(tmp_path: Path) -> None:
    from rankscope.drill.faults import FAULT_ENV
    from rankscope.drill.launcher import Launcher, TrainingOptions

    layout = DrillLayout(tp=1, pp=2, dp=1, machines=2)
    training = TrainingOptions(steps=10, checkpoint_every=5, micro_batches=2)

    def wait_for(launcher: Launcher) -> dict[str, int | None]:
        for node in launcher.nodes.values():
            node.proc.wait(timeout=150)
        return launcher.node_exit_codes()

    def losses(run_dir: Path) -> list[tuple[int, str]]:
        lines = (run_dir / "loss" / "rank1.jsonl").read_text().splitlines()
        return [(json.loads(x)["step"], json.loads(x)["loss"]) for x in lines]

    crash = make_plan("crash", layout, rank=1, step=8)
    job = Launcher(tmp_path / "b", layout, training)
    try:
        job.start_nodes(["machine-0", "machine-1"], env={FAULT_ENV: crash.to_env()})
        assert 0 not in set(wait_for(job).values())
        before = dict(losses(tmp_path / "b"))
        assert sorted(before) == list(range(1, 9))
        # machine-1 is "evicted": the job comes back on machine-0 and a standby, from the step-5 checkpoint.
        job.restart(["machine-0", "machine-4"], resume=True, env={FAULT_ENV: ""}, agents=False)
        assert [n.name for n in sorted(job.nodes.values(), key=lambda n: n.node_rank)] == ["machine-0", "machine-4"]
        assert set(wait_for(job).values()) == {0}
    finally:
        job.stop()
    after = losses(tmp_path / "b")
    assert [s for s, _ in after] == [*range(1, 9), *range(6, 11)]
    # Bit for bit: steps 6-8, computed again from the step-5 checkpoint on other
    # machines, give the same losses (as float hex) as before the crash.
    resumed = dict(after[8:])
    assert {s: resumed[s] for s in (6, 7, 8)} == {s: before[s] for s in (6, 7, 8)}


def test_standbys_default_to_a_pool_that_can_refill_a_group_with_the_tui_and_to_none_headless() -> None:
    from rankscope.cli.commands.drill import build_config
    from rankscope.cli.main import build_parser
    from rankscope.drill.control import default_standbys

    def standbys(*argv: str) -> int:
        return int(build_config(build_parser().parse_args(["drill", *argv])).standbys)

    assert standbys() == max(default_standbys(4), 2)  # a PP group of the default layout spans 2 machines
    assert standbys("--pp", "4", "--dp", "1", "--machines", "4") == 4
    assert standbys("--headless") == 0
    assert standbys("--headless", "--standbys", "2") == 2
    with pytest.raises(RankscopeError, match="negative"):
        standbys("--standbys", "-1")
    # Restarts are warm (parked interpreters) unless asked otherwise.
    assert build_config(build_parser().parse_args(["drill"])).warm is True
    assert build_config(build_parser().parse_args(["drill", "--cold-restarts"])).warm is False


def test_the_checkpoint_writer_keeps_only_the_newest_checkpoints_of_its_rank(tmp_path: Path) -> None:
    from rankscope.drill.checkpoints import CHECKPOINTS_KEPT, latest_checkpoint, prune_checkpoints

    out = tmp_path / "checkpoints"
    out.mkdir()
    for step in (5, 10, 15, 20, 25, 30, 100):
        (out / f"rank0-step{step}.pt").write_bytes(b"x")
    (out / "rank1-step5.pt").write_bytes(b"x")  # another rank's files are not this writer's to delete
    prune_checkpoints(out, 0, CHECKPOINTS_KEPT)
    assert sorted(p.name for p in out.iterdir()) == ["rank0-step100.pt", "rank0-step20.pt", "rank0-step25.pt",
                                                     "rank0-step30.pt", "rank1-step5.pt"]  # by step, not by name
    assert latest_checkpoint(tmp_path, 0) == 100


def test_an_attached_drill_says_what_it_did_once_its_tui_quit(tmp_path: Path) -> None:
    # After `q` the attached drill stopped its job and printed nothing: the screen was gone and with it the story.
    from rankscope.cli.commands.drill import attached_report_lines
    from rankscope.drill.control import DrillMachines, Recovery, RecoveryEvent
    from rankscope.drill.session import DrillConfig, DrillSession

    layout = DrillLayout(tp=2, pp=2, dp=1, machines=2)
    s = DrillSession(DrillConfig(layout=layout, run_dir=tmp_path, plan=make_plan("hang-p2p", layout, rank=3, step=6)))
    for rank, step in ((0, 40), (1, 40), (2, 40), (3, 38)):
        write_progress(tmp_path, rank, step)
    s.recovery = Recovery(s.launcher, DrillMachines(s.launcher))
    s.recovery.events.append(RecoveryEvent("a1", ("machine-1",), ("standby-0",), ("machine-0", "standby-0"), True, "",
                                           0.0, 0.0, 0.0, 12))
    s.recovery.events.append(RecoveryEvent("a2", ("machine-0",), (), (), False, "no standby left", 0.0, 0.0, 0.0, 0))
    s.watcher.poll()
    lines = attached_report_lines(s, 0)
    assert lines[0].startswith(f"drill {s.launcher.run_id} stopped (the TUI quit); fault hang-p2p at rank 3, step 6")
    assert lines[1] == f"steps: ranks 3 at step 38; ranks 0-2 at step 40 (of {s.config.training.steps})"
    assert lines[2] == "evict machine-1: restarted on machine-0 standby-0, standby-0 joined, resumed from step 12"
    assert lines[3] == "evict machine-0: not restarted: no standby left"
    assert lines[4:] == ["every process the drill started has stopped", f"logs, losses and progress: {tmp_path}"]
    s.leftovers = [123]
    assert "stopped 1 leftover processes by force: 123" in attached_report_lines(s, 1)[-2]
    assert "(the TUI ended with code 1)" in attached_report_lines(s, 1)[0]


def test_a_crash_report_reads_the_logs_of_parked_nodes_and_torchrun_nodes_alike(tmp_path: Path) -> None:
    from rankscope.drill.session import log_errors

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "machine-0.torchrun.log").write_text("step 3\nRuntimeError: boom on rank 0\n")
    (logs / "machine-1.warm.log").write_text("rankscope warm: go\nValueError: boom on rank 1\n")
    (logs / "machine-1.agent.log").write_text("rankscope agent: RuntimeError: not a node's\n")
    assert log_errors(tmp_path) == {"machine-0": ["RuntimeError: boom on rank 0"],
                                    "machine-1": ["ValueError: boom on rank 1"]}


def test_a_job_has_resumed_once_every_rank_reported_a_step_past_the_restart(tmp_path: Path) -> None:
    import time

    from rankscope.drill.progress import stepped_past, write_progress

    (tmp_path / "progress").mkdir()  # made by each rank as it starts
    since = time.time()
    write_progress(tmp_path, 0, 9)
    write_progress(tmp_path, 1, 8)  # still at the restart's step
    assert not stepped_past(tmp_path, 2, since, 8)
    write_progress(tmp_path, 1, 9, "starting")  # a start record is not a step done
    assert not stepped_past(tmp_path, 2, since, 8)
    write_progress(tmp_path, 1, 12, "done")
    assert stepped_past(tmp_path, 2, since, 8)
    assert not stepped_past(tmp_path, 3, since, 8)  # rank 2 never reported
    assert not stepped_past(tmp_path, 2, time.time() + 60, 8)  # reports from before the restart do not count


def test_the_quit_report_grades_the_first_verdict_against_the_ground_truth() -> None:
    # hang-p2p at rank 6 (machine-3): the verdict names PP groups 2-3 on machine-1 and machine-3, pinning rank 6.
    from rankscope.analyzers.findings import Suspect, SuspectKind, Verdict
    from rankscope.cli.commands.drill import verdict_grade_lines
    from rankscope.drill.faults import ground_truth

    layout = DrillLayout(tp=2, pp=2, dp=2, machines=4)
    truth = ground_truth(make_plan("hang-p2p", layout, rank=6, step=20), layout)
    top = Suspect(SuspectKind.PP, (2, 3, 6, 7), ("machine-1", "machine-3"), 1.0, ("PP groups 2-3",), ("stacks",),
                  victims=(0, 1, 2, 3, 4, 5, 7), roots=(6,))
    placement = {r: f"machine-{r // 2}" for r in range(8)}
    lines = verdict_grade_lines(truth, Verdict((top,), "PP groups 2-3 on machine-1, machine-3"), 1040.0, placement,
                                1000.0)
    assert lines[0].startswith("verdict, 40.0 s after the fault: PP groups 2-3 on machine-1, machine-3  [right: "
                               "fault on machine-3"), lines[0]
    assert lines[1] == ("  evict what the evidence names (default): machine-3: faulty machine evicted, "
                        "extra machines: 0, standbys used: 1")
    assert lines[2] == ("  over-evict the group (ByteRobust): machine-1 machine-3: faulty machine evicted, "
                        "extra machines: 1, standbys used: 2")
    assert lines[3].startswith("  why: the evidence pins rank 6")


def test_the_reports_say_the_expected_suspect_in_words_and_grade_with_one_word() -> None:
    from rankscope.cli.commands.drill import expected_suspect_words
    from rankscope.drill.faults import ground_truth

    layout = DrillLayout(tp=2, pp=2, dp=2, machines=4)
    rank = ground_truth(make_plan("hang-compute", layout, rank=3, step=20), layout)
    assert expected_suspect_words(rank) == "rank 3 on machine-1"  # was "rank ranks (3,) on machine-1"
    assert expected_suspect_words(rank.to_dict()) == "rank 3 on machine-1"
    group = ground_truth(make_plan("hang-p2p", layout, rank=6, step=20), layout)
    assert expected_suspect_words(group) == "PP group (ranks 2,6) on machine-1, machine-3"
    assert expected_suspect_words(ground_truth(make_plan("none", layout), layout)) == "nobody"
