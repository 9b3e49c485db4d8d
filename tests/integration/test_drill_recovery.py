"""Recovery on the drill, end to end: hang -> verdict -> evict -> standbys join -> training resumes bit for bit.

One small real job (TP=1, PP=2, DP=2: two pipelines, one rank per machine),
real agents with actions, real py-spy, the real analyzers and the real action
RPCs. The eviction is confirmed with the typed phrase, exactly as the TUI
sends it; the drill's recovery (``rankscope.drill.control``) restarts the job
on the remaining machines plus the warm standbys. The losses after recovery
are compared, as float hex, with a fault-free run of the same deterministic
job.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from agent_helpers import wait_for
from rankscope.actions.agent_protocol import confirmation_for
from rankscope.actions.blocklist import Blocklist
from rankscope.actions.evict_backends import SelfCheck
from rankscope.actions.journal import JournalEntry
from rankscope.actions.model import ActionPlan, ActionResult, ActionState
from rankscope.analyzers.analysis import analyze_snapshot
from rankscope.drill import warm
from rankscope.drill.control import DrillMachines, blocked_machines, default_standbys, evict_machines
from rankscope.drill.faults import DrillLayout, make_plan
from rankscope.drill.launcher import Launcher, TrainingOptions
from rankscope.drill.processes import marked_processes
from rankscope.drill.progress import stepped_past
from rankscope.drill.session import DrillConfig, DrillSession
from rankscope.probes.discovery import discover_ranks
from rankscope.wire.sync_loop import run_sync


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-800:] if path.exists() else "(no log)"

LAYOUT = DrillLayout(tp=1, pp=2, dp=2, machines=4)
TRAINING = TrainingOptions(steps=12, checkpoint_every=4, micro_batches=2, loader_workers=0)
FAULT_STEP = 6
# The backup drill's job: no checkpoints, and enough steps for a backup to land before the hang.
BACKUP_TRAINING = TrainingOptions(steps=54, checkpoint_every=0, micro_batches=2, loader_workers=0)


def losses(run_dir: Path, rank: int) -> list[tuple[int, str]]:
    lines = (run_dir / "loss" / f"rank{rank}.jsonl").read_text().splitlines()
    return [(int(json.loads(x)["step"]), str(json.loads(x)["loss"])) for x in lines]


def reference_losses(run_dir: Path, training: TrainingOptions) -> dict[int, dict[int, str]]:
    """The same job without a fault, on one machine (placement does not enter the arithmetic)."""
    layout = DrillLayout(tp=LAYOUT.tp, pp=LAYOUT.pp, dp=LAYOUT.dp, machines=1)
    job = Launcher(run_dir, layout, training, counters=False)
    try:
        job.start_nodes()
        for node in job.nodes.values():
            node.proc.wait(timeout=900)  # a loaded shared host (load 83) took over 200 s
        assert set(job.node_exit_codes().values()) == {0}
    finally:
        job.stop()
    return {r: dict(losses(run_dir, r)) for r in last_stage_ranks()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[int, str]]:
    """One fault-free run for both recovery drills: the last stage's loss at each step, as float hex.

    A step's loss depends on the step alone (its seed, its batch, the weights before it), not on how many steps
    the job runs nor on whether it checkpoints, so the longer job's first steps are the shorter job's: the drill
    with checkpoints compares its 12 steps with the first 12 of this run (a wrong assumption fails that test).
    """
    losses = reference_losses(tmp_path_factory.mktemp("reference"), BACKUP_TRAINING)
    assert all(sorted(losses[r]) == list(range(1, BACKUP_TRAINING.steps + 1)) for r in losses), losses
    return losses


async def read_journal(agents: list[str], token: str) -> tuple[JournalEntry, ...]:
    from rankscope.wire.client import JobClient

    async with JobClient(agents, token) as client:
        return await client.journal()


async def plan_eviction(agents: list[str], token: str, machines: tuple[str, ...]) -> list[ActionPlan]:
    """What the TUI shows before `e` is confirmed: every owning agent's plan (planning changes nothing)."""
    from rankscope.actions.model import ActionKind, ActionRequest, EvictArgs, Targets
    from rankscope.wire.client import JobClient

    request = ActionRequest("plan-evict", ActionKind.EVICT, Targets(machines), EvictArgs("hang-p2p"), "drill-test")
    async with JobClient(agents, token) as client:
        return [p for p in (await client.plan_action(request)).values() if isinstance(p, ActionPlan)]


def last_stage_ranks() -> list[int]:
    return [r for r in range(LAYOUT.world) if LAYOUT.coords(r)[2] == LAYOUT.pp - 1]


@pytest.mark.drill
@pytest.mark.timeout(900)
def test_evicting_a_hung_pipeline_brings_in_standbys_and_training_resumes_bit_for_bit(
        tmp_path: Path, reference: dict[int, dict[int, str]]) -> None:
    assert all(set(range(1, TRAINING.steps + 1)) <= set(reference[r]) for r in last_stage_ranks())

    plan = make_plan("hang-p2p", LAYOUT, rank=2, step=FAULT_STEP)
    config = DrillConfig(layout=LAYOUT, plan=plan, training=TRAINING, run_dir=tmp_path / "run", stall_seconds=3.0,
                         standbys=2)
    with DrillSession(config) as s:
        assert sorted(s.agents) == ["machine-0", "machine-1", "machine-2", "machine-3", "standby-0", "standby-1"]
        s.wait_for_steps(1, 180)
        # Every machine and standby keeps a parked node (interpreters with torch imported), parked once the
        # job ran its first step; the eviction is confirmed once they are ready, as a real standby pool is.
        slots = ("machine-0", "machine-1", "machine-2", "machine-3", "standby-0", "standby-1")
        assert s.launcher.wait_parked(slots, 400), {n: _tail(p.log) for n, p in s.launcher.parked.items()}
        parked = {n: tuple(warm.ask(s.launcher.parked[n].socket, {"op": "status"})["pids"]) for n in slots}
        first_job = {n.name: n.proc.pid for n in s.launcher.nodes.values()}
        # Checked while they waited, after parking (both import torch); one not done is checked at join.
        s.standbys_checked(600)
        stall = s.wait_until_stalled()
        assert stall.reason == "stalled", stall
        verdict = analyze_snapshot(s.capture())
        top = verdict.top
        assert top is not None, verdict.summary
        # Rank 2 never sends its gradient to rank 0: the suspect is their pipeline, on machines 0 and 2.
        assert sorted(top.machines) == sorted(s.truth.suspect_machines) == ["machine-0", "machine-2"]

        # Each agent's plan shows the warm standbys that would join (the launcher's pool, in the order taken).
        plans = run_sync(plan_eviction(list(s.agents.values()), s.token(), top.machines))
        assert sorted(p.machines for p in plans) == [("machine-0",), ("machine-2",)]
        assert [p.standbys for p in plans] == [("standby-0", "standby-1")] * 2
        assert all("self-checks first" in p.steps[-1] for p in plans), [p.steps for p in plans]
        results = run_sync(evict_machines(list(s.agents.values()), s.token(), top.machines,
                                             f"hang-p2p: {verdict.summary}", requested_by="drill-test"))
        assert sorted(r.state for r in results) == [ActionState.SUCCEEDED] * 2, [r.message for r in results]

        event = s.wait_for_recovery(1, timeout_s=240)
        assert event.ok, event.message
        assert sorted(event.evicted) == ["machine-0", "machine-2"]
        assert event.joined == ("standby-0", "standby-1")
        assert s.launcher.machines() == ("machine-1", "machine-3", "standby-0", "standby-1")
        assert s.launcher.standbys == []
        # Survivors and standbys alike restarted from their parked nodes: the very processes parked before the
        # eviction became the ranks (found by discovery as torchrun's ranks are), already done importing.
        restarted = s.launcher.warm_starts[-4:]
        assert [(w.name, w.pids, w.warm) for w in restarted] == [
            (m, parked[m], (True,)) for m in ("machine-1", "machine-3", "standby-0", "standby-1")]
        # The evicted machines' parked nodes are gone with them.
        assert not {"machine-0", "machine-2"} & set(s.launcher.parked)
        # The evicted machines are in the persistent blocklist, with the reason, and their agents are gone.
        assert blocked_machines(s.launcher) >= {"machine-0", "machine-2"}
        entry = next(e for e in Blocklist(s.launcher.state_dir("machine-0") / "blocklist.sqlite").blocked())
        assert entry.machine == "machine-0" and entry.reason.startswith("hang-p2p")
        assert sorted(s.agents) == ["machine-1", "machine-3", "standby-0", "standby-1"]
        # Nothing was lost beyond the last checkpoint before the fault.
        assert event.resume_step == (FAULT_STEP // TRAINING.checkpoint_every) * TRAINING.checkpoint_every
        assert event.resume_source == "checkpoint"  # said by every rank of the new job
        # The restart is in the agents' incident journal, for every view's Events: the step, machines and code.
        story = run_sync(read_journal(list(s.agents.values()), s.token()))
        (resumed,) = [e for e in story if e.kind == "resumed"]
        assert resumed.text.startswith(f"the job resumed from step {event.resume_step} (the newest checkpoint every "
                                       "rank saved) on machine-1 machine-3 standby-0 standby-1 (standby-0 standby-1 "
                                       "joined) after evicting machine-0 machine-2"), resumed.text
        assert resumed.text.endswith(", code git:v1") == s.launcher.hot_updates, resumed.text
        assert not [n for n in s.notes if "incident journal" in n], s.notes
        wait_for(lambda: stepped_past(s.run_dir, s.layout.world, event.restart_began_wall, event.resume_step), 180,
                 "every rank to complete a step after the restart", interval_s=0.1)
        # Found as torchrun's ranks are, once each has stepped: a parked process publishes its rank's environment
        # when it becomes the rank, which may be just after the recovery is reported (a loaded host found none).
        for node in s.launcher.nodes.values():
            assert node.proc.pid != first_job.get(node.name)
            found = discover_ranks(launcher_pid=node.proc.pid)
            assert [(r.rank, r.pid, r.world_size) for r in found] == [(node.node_rank, parked[node.name][0], 4)]
        s.wait_for_steps(TRAINING.steps, timeout_s=240)
        run_id = s.launcher.run_id
    assert marked_processes(run_id) == []

    for rank in last_stage_ranks():
        logged = losses(tmp_path / "run", rank)
        before = [s for s, _ in logged[:FAULT_STEP]]
        after = logged[FAULT_STEP:]
        assert before == list(range(1, FAULT_STEP + 1))  # the steps done before the hang
        # After recovery every step from the checkpoint on is there once, in order ...
        assert [s for s, _ in after] == list(range(event.resume_step + 1, TRAINING.steps + 1))
        # ... and bit for bit what the fault-free run computed (float hex), before and after the fault.
        assert dict(after) == {s: reference[rank][s] for s, _ in after}
        assert dict(logged[:len(before)]) == {s: reference[rank][s] for s in before}


def test_local_backend_over_the_drill_skips_a_standby_that_fails_its_check(tmp_path: Path) -> None:
    """DrillMachines wired into LocalBackend without processes: the plan and the standby choice."""
    from rankscope.actions.evict_backends import LocalBackend

    launcher = Launcher(tmp_path, LAYOUT, TRAINING, counters=False, actions=True)
    launcher.standbys = ["standby-0", "standby-1"]
    checked: list[str] = []

    def check(machine: str) -> SelfCheck:
        checked.append(machine)
        ok = machine != "standby-0"
        return SelfCheck(machine, ok, (("loopback collective", ok, "exact" if ok else "wrong sums"),))

    control = DrillMachines(launcher, check=check)
    restarted: list[tuple[str, ...]] = []
    control.restart = restarted.append  # type: ignore[method-assign]
    control.machines = lambda: ("machine-0", "machine-1", "machine-2", "machine-3")  # type: ignore[method-assign]
    control.stop = lambda machine: None  # type: ignore[method-assign]
    backend = LocalBackend(control)
    plan = backend.plan(("machine-2",), "hang")
    assert plan.standbys == ("standby-0",)
    outcome = backend.evict(("machine-2",), "hang")
    assert outcome.ok and outcome.replacements == ("standby-1",)
    assert checked == ["standby-0", "standby-1"]
    assert restarted == [("machine-0", "machine-1", "machine-3", "standby-1")]


def test_the_default_pool_is_the_binomial_p99_and_at_least_one() -> None:
    assert default_standbys(4) == 1
    assert default_standbys(1024) == 4  # ByteRobust Table 5
    assert default_standbys(128, daily_failure_rate=0.05) > 2


@pytest.mark.drill
@pytest.mark.timeout(600)
def test_a_backup_taken_before_the_hang_is_restored_from_the_peers_after_eviction(
        tmp_path: Path, reference: dict[int, dict[int, str]]) -> None:
    """No checkpoints at all: only the `b` backup (own + peer copies in the agents' stores) can save the steps."""
    from rankscope.actions.model import ActionKind, ActionRequest, BackupArgs, Targets
    from rankscope.actions.shard_store import ShardStore
    from rankscope.wire.client import JobClient

    # The backup must reach the ranks before they hang; a step of this tiny job takes tens of milliseconds.
    training = BACKUP_TRAINING
    fault_step = 50
    plan = make_plan("hang-p2p", LAYOUT, rank=2, step=fault_step)
    config = DrillConfig(layout=LAYOUT, plan=plan, training=training, run_dir=tmp_path / "run", stall_seconds=3.0,
                         standbys=2)

    async def back_up(agents: list[str], token: str) -> tuple[list[ActionPlan], list[ActionResult]]:
        request = ActionRequest("backup-1", ActionKind.BACKUP, Targets(), BackupArgs(), "drill-test")
        async with JobClient(agents, token, acting=True) as client:
            answers = await client.plan_action(request)
            plans = [p for p in answers.values() if isinstance(p, ActionPlan)]
            return plans, [u.event async for u in client.run_action(request, confirmation_for(plans))
                           if isinstance(u.event, ActionResult)]

    with DrillSession(config) as s:
        s.wait_for_steps(2, 180)
        running = [a for name, a in s.agents.items() if name.startswith("machine-")]
        plans, backed = run_sync(back_up(running, s.token()))
        # The plans name each rank's backup peer: the mirror, outside every group the rank is in.
        assert sorted(pair for plan in plans for pair in plan.backup_peers) == [(0, 3), (1, 2), (2, 1), (3, 0)]
        assert [r.state for r in backed] == [ActionState.SUCCEEDED] * 4, [r.message for r in backed]
        stores = {m: ShardStore(s.launcher.state_dir(m) / "shards") for m in ("machine-0", "machine-1", "machine-2",
                                                                              "machine-3")}
        # Each rank's shard is on its own machine and on its backup peer's (rank 0 <-> 3, 1 <-> 2: the mirror).
        for rank, peer in ((0, 3), (1, 2), (2, 1), (3, 0)):
            assert stores[f"machine-{rank}"].steps(rank) and stores[f"machine-{peer}"].steps(rank)
        backup_step = min(max(stores[f"machine-{r}"].steps(r)) for r in range(4))
        assert 0 < backup_step <= fault_step

        stall = s.wait_until_stalled()
        assert stall.reason == "stalled", stall
        # Hung now, so every snapshot is written. The restore can only take a step held for every rank in
        # the stores that outlive the eviction (machines 1 and 3). Each rank snapshots the next two step
        # multiples of the agents' align after its agent's request lands; requests landing more than one
        # align apart leave no common step, and the restart silently fell back to step 0.
        held = {r: sorted({st for m in ("machine-1", "machine-3") for st in stores[m].steps(r)}) for r in range(4)}
        common = set.intersection(*(set(v) for v in held.values()))
        assert common, f"no backed-up step common to every rank in the surviving stores: {held}"
        top = analyze_snapshot(s.capture()).top
        assert top is not None and sorted(top.machines) == ["machine-0", "machine-2"]
        results = run_sync(evict_machines(list(s.agents.values()), s.token(), top.machines, "hang-p2p",
                                             requested_by="drill-test"))
        assert [r.state for r in results] == [ActionState.SUCCEEDED] * 2, [r.message for r in results]
        event = s.wait_for_recovery(1, timeout_s=240)
        assert event.ok, event.message
        # The restart's story names the step the ranks loaded from the backup, not the checkpoints (there are none).
        assert (event.resume_step, event.resume_source) == (max(common), "backup"), (event, held)
        story = run_sync(read_journal(list(s.agents.values()), s.token()))
        (resumed,) = [e for e in story if e.kind == "resumed"]
        assert resumed.text.startswith(f"the job resumed from step {max(common)} (the in-memory backup every rank "
                                       "held) on "), resumed.text
        wait_for(lambda: stepped_past(s.run_dir, s.layout.world, event.restart_began_wall, event.resume_step), 180,
                 "every rank to complete a step after the restart", interval_s=0.1)
        s.wait_for_steps(training.steps, timeout_s=240)
        recovery = (f"recovery events {s.recovery.events if s.recovery else None}, notes {s.notes}, "
                    f"steps held {held}, run dir {tmp_path / 'run'}")
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "run" / "logs").glob("*.log"))
    # Ranks 0 and 2 lost their machines: they come back from their peers' copies (on machines 3 and 1).
    restored = [line for line in logs.splitlines() if "restored" in line]
    assert "rank 0 restored step" in logs and "rank 2 restored step" in logs, (restored, recovery)
    for rank in last_stage_ranks():
        logged = losses(tmp_path / "run", rank)
        after = logged[fault_step:]
        resumed_from = after[0][0] - 1
        # Nothing lost beyond the backup: the job resumes at the newest step every rank had backed up.
        assert backup_step <= resumed_from <= fault_step
        assert resumed_from == max(common), (resumed_from, held)
        assert [s for s, _ in after] == list(range(resumed_from + 1, training.steps + 1))
        assert dict(after) == {s: reference[rank][s] for s, _ in after}


@pytest.mark.parametrize("error", [RuntimeError("an audit stream broke in a way the client did not expect"),
                                   asyncio.CancelledError("grpc.aio cancelled a call itself")],
                         ids=["Exception", "CancelledError"])
def test_a_failing_round_of_the_recovery_watcher_leaves_it_and_the_processes_it_started_running(
        tmp_path: Path, error: BaseException) -> None:
    """The watcher's thread is the parent (PR_SET_PDEATHSIG) of the restarted job and agents: it must not end.

    A round that raised used to end the thread, which sent SIGTERM to every process it had restarted: the
    drill "shut itself down" with no message. A child started from the thread shows it: it must outlive
    a failed round, and the failure must be said.
    """
    import subprocess
    import threading

    from rankscope.drill.control import Recovery
    from rankscope.wire.spawn import with_parent_death_signal

    class OneMachine:
        run_dir = tmp_path

        def addresses(self) -> dict[str, str]:
            return {"machine-0": "127.0.0.1:1"}

    rounds: list[int] = []
    children: list[subprocess.Popen[bytes]] = []
    notes: list[str] = []
    third = threading.Event()
    recovery = Recovery(OneMachine(), DrillMachines(OneMachine()), on_event=notes.append)  # type: ignore[arg-type]

    async def follow(addresses: dict[str, str]) -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:  # a restart happens on this thread: its processes die with the thread
            children.append(subprocess.Popen(with_parent_death_signal(["sleep", "60"])))
            return None
        if len(rounds) == 2:
            raise error
        third.set()
        recovery._stop.wait(0.05)
        return None

    recovery._follow = follow  # type: ignore[assignment,method-assign]
    recovery.start()
    try:
        assert third.wait(30), f"the watcher did not go on after a failed round: {recovery.errors}"
        assert recovery._thread is not None and recovery._thread.is_alive()
        assert children[0].poll() is None, "the restarted processes were killed with the watcher's thread"
        assert notes == [f"recovery round failed (it goes on): {type(error).__name__}: {error}"]
    finally:
        recovery.stop()
        for child in children:
            child.kill()
            child.wait()


# A drill process that records whether a SIGTERM was ever sent to it: it blocks SIGTERM, so a sent one stays
# pending (read in /proc) instead of racing the test, then says it is ready.
TERM_BLOCKING = """
import signal, sys, time
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
open(sys.argv[1], "w").close()
while True:
    time.sleep(60)
"""


def _sigterm_sent(pid: int) -> bool:
    """Whether SIGTERM is pending at ``pid`` (shared or thread-private pending set, /proc/PID/status)."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return any(int(fields[key].strip(), 16) & (1 << (15 - 1)) for key in ("ShdPnd", "SigPnd"))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread ends by raising
@pytest.mark.parametrize("how", ["returns", "raises CancelledError"])
def test_a_drill_process_outlives_the_thread_that_started_it(tmp_path: Path, how: str) -> None:
    """The restarted job and its agents are started by the recovery thread; the thread's end must not stop them.

    Linux sends the parent-death signal (the drill's children ask for SIGTERM) when the *thread* that
    started a child ends. Started from the recovery thread, the restarted job and its agents got SIGTERM
    when that thread ended: the drill "shut itself down" with no message (#12). A real launcher process
    started from a thread that then ends (normally, or by a BaseException grpc.aio raises) must get no
    SIGTERM, and still be stopped by the launcher.
    """
    import os
    import sys
    import threading

    from agent_helpers import wait_for

    launcher = Launcher(tmp_path, DrillLayout(), counters=False)
    ready = tmp_path / "ready"
    started: list[int] = []
    native: list[int] = []

    def restart() -> None:
        native.append(threading.get_native_id())
        started.append(launcher.start_helper([sys.executable, "-c", TERM_BLOCKING, str(ready)], "helper.log").pid)
        wait_for(ready.exists, 60, "the helper to block SIGTERM (its death signal is set before that)")
        if how != "returns":
            raise asyncio.CancelledError()

    thread = threading.Thread(target=restart, name="recovery-like")
    thread.start()
    thread.join()
    # The death signal is sent as the thread's task exits in the kernel, a little after join() returns.
    wait_for(lambda: not Path(f"/proc/self/task/{native[0]}").exists(), 30, "the thread's task to be gone")
    try:
        assert not _sigterm_sent(started[0]), "the drill process got SIGTERM when the thread that started it ended"
        assert started[0] in marked_processes(launcher.run_id)
    finally:
        os.kill(started[0], 9)  # it blocks SIGTERM: the launcher's stop would wait its grace period
        launcher.stop()
    assert marked_processes(launcher.run_id) == []


def test_a_restart_that_brings_the_job_back_is_written_to_the_agents_journal_with_its_step_and_code(
        tmp_path: Path) -> None:
    """Recovery's own part, without processes: the "resumed" entry each restart writes (the step the ranks resume
    from, the machines, the code), and a journal that cannot be written is a note, never an error of the drill."""
    from rankscope.actions.history import HotUpdateHistory, UpdateKind, UpdateState, Version
    from rankscope.actions.model import ActionKind, UpdateMode
    from rankscope.drill.control import HISTORY_FILE, JOURNAL_BY, Recovery, _Finished

    launcher = Launcher(tmp_path, LAYOUT, TRAINING, counters=False, actions=True)
    launcher.standbys = ["standby-0"]
    running = ["machine-0", "machine-1", "machine-2", "machine-3"]
    launcher.machines = lambda: tuple(running)  # type: ignore[method-assign]
    control = DrillMachines(launcher, check=lambda m: SelfCheck(m, True, ()))
    control.stop = lambda machine: None  # type: ignore[method-assign]

    def restart(machines: tuple[str, ...]) -> None:
        running[:] = machines
        launcher.last_restart = (1000.0, 8)  # the launcher reads the newest step every rank saved

    control.restart = restart  # type: ignore[method-assign]
    written: list[JournalEntry] = []
    notes: list[str] = []

    def journal(entries: list[JournalEntry]) -> list[JournalEntry]:
        written.extend(entries)
        return written

    recovery = Recovery(launcher, control, on_event=notes.append, journal=journal)
    recovery._recover("evict-1", ("machine-2",))
    (entry,) = written
    assert entry.kind == "resumed" and entry.by == JOURNAL_BY
    assert entry.text == ("the job resumed from step 8 (the newest checkpoint every rank saved) on machine-0 "
                          "machine-1 machine-3 standby-0 (standby-0 joined) after evicting machine-2, code git:v1")
    assert recovery.events[-1].ok and recovery.events[-1].resume_step == 8

    # A hot-update to v2 applied on every machine: the restart in place names the code the job runs now.
    for m in running:
        history = HotUpdateHistory(launcher.state_dir(m) / HISTORY_FILE)
        record = history.request("update-1", "alice", UpdateKind.UPDATE, UpdateMode.IMMEDIATE, 0.0,
                                 Version("git:v1 (aaaa)", "/v1"), Version("git:v2 (bbbb)", "/v2"))
        history.finish(record.id, UpdateState.APPLIED, "immediate")
    done = {m: ActionState.SUCCEEDED.value for m in running}
    recovery._restart_in_place(_Finished(ActionKind.HOT_UPDATE, "update-1", tuple(running), done, ("machine-0",)))
    assert written[-1].text == ("the job resumed from step 8 (the newest checkpoint every rank saved) on machine-0 "
                                "machine-1 machine-3 standby-0 after hot_update update-1, in place, code git:v2 (bbbb)")
    assert written[-1].wall >= entry.wall

    # Agents that take nothing, or a client that fails: a note each, and the drill goes on with its event.
    recovery.journal = lambda entries: ()
    recovery._restart_in_place(_Finished(ActionKind.HOT_UPDATE, "update-2", tuple(running), done, ("machine-0",)))

    def broken(entries: list[JournalEntry]) -> list[JournalEntry]:
        raise ConnectionError("no agent listens")

    recovery.journal = broken
    recovery._restart_in_place(_Finished(ActionKind.HOT_UPDATE, "update-3", tuple(running), done, ("machine-0",)))
    assert [e.ok for e in recovery.events] == [True, True, True, True]
    assert any("no agent took the restart into its incident journal" in n for n in notes), notes
    assert any("ConnectionError: no agent listens" in n for n in notes), notes
    assert recovery.errors == []
