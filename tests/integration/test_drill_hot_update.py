"""Hot-update on the drill (ByteRobust §6.1): new code in place, on the same machines, immediately and lazily.

One small real job (TP=1, PP=2, DP=1: one rank on each of two machines) with
real agents serving actions, each machine running the drill's user code from
its own code link. The update is planned and confirmed through ``JobClient``
exactly as the TUI's `u` sends it (``update_request``, ``summarize(...)
.confirmation()``); the drill's recovery restarts the job on the same machines
when every agent switched its link and asked for a restart. Which code every
step ran is read back from the ranks' own records (``code_runs`` per process
start, ``code`` per logged loss).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_helpers import process_state, wait_for
from rankscope.actions.audit import AuditLog
from rankscope.actions.config import load_actions_config, local_standbys
from rankscope.actions.history import HotUpdateHistory, UpdateKind, UpdateState
from rankscope.actions.model import (
    RESTART_REQUESTED,
    ActionKind,
    ActionRequest,
    ActionResult,
    ActionState,
    AuditRecord,
    UpdateMode,
)
from rankscope.drill import user_code, warm
from rankscope.drill.control import DrillMachines, Recovery, RecoveryEvent
from rankscope.drill.faults import DrillLayout
from rankscope.drill.launcher import Launcher, TrainingOptions
from rankscope.drill.processes import marked_processes
from rankscope.drill.progress import read_progress, stepped_past
from rankscope.tui.actions import new_action_id, rollback_request, summarize, update_request
from rankscope.wire.client import JobClient
from rankscope.wire.sync_loop import run_sync

LAYOUT = DrillLayout(tp=1, pp=2, dp=1, machines=2)
MACHINES = ("machine-0", "machine-1")
# Far more steps than the test lasts: the job must still be running at every update (it is stopped at the end).
TRAINING = TrainingOptions(steps=100_000, checkpoint_every=5, micro_batches=2, loader_workers=0)
LAST_STAGE_RANK = 1


def version_of(link: Path) -> str:
    return user_code.load(str(link)).version


def steps_done(run_dir: Path) -> int:
    progress = read_progress(run_dir)
    return min((p.step for p in progress.values()), default=0) if len(progress) == LAYOUT.world else 0


def loss_records(run_dir: Path) -> list[dict[str, object]]:
    """The last stage's loss records; a line the rank is writing right now is left for the next read."""
    out = []
    for line in (run_dir / "loss" / f"rank{LAST_STAGE_RANK}.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def code_runs(run_dir: Path, rank: int) -> list[dict[str, object]]:
    """Every process start of ``rank`` its code recorded (``user_code.record_run``), oldest first."""
    path = run_dir / user_code.CODE_RUNS_DIR / f"rank{rank}.jsonl"
    out = []
    for line in (path.read_text().splitlines() if path.exists() else ()):
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


async def act(launcher: Launcher, request: ActionRequest) -> list[ActionResult]:
    """Plan, confirm as the TUI does (yes to the named machines) and run; every agent's final result."""
    async with JobClient(list(launcher.addresses().values()), launcher.token(), acting=True) as client:
        summary = summarize(request, await client.plan_action(request))
        assert summary.runnable, (summary.errors, launcher.notes)
        assert summary.phrase is None  # a hot-update needs a yes, not a typed phrase
        return [u.event async for u in client.run_action(request, summary.confirmation())
                if isinstance(u.event, ActionResult)]


@pytest.fixture
def drill(tmp_path: Path) -> Iterator[tuple[Launcher, Recovery]]:
    launcher = Launcher(tmp_path / "run", LAYOUT, TRAINING, counters=False, actions=True, warm=True)
    recovery: Recovery | None = None
    try:
        launcher.start_nodes()
        launcher.start_agents()
        recovery = Recovery(launcher, DrillMachines(launcher), on_event=launcher.notes.append)
        recovery.start()
        yield launcher, recovery
    finally:
        if recovery is not None:
            recovery.stop()
        launcher.stop()
        assert marked_processes(launcher.run_id) == []


def watch_old_processes(launcher: Launcher) -> dict[str, list[str]]:
    """Spies on the launcher's own start of the nodes and of the agents during a restart: the state
    (``process_state``) of the agents, then of the nodes, running now, when the new nodes get their go, and when the
    new agents start (then also whether every rank had stepped since the restart began: "resumed")."""
    old = [a.proc.pid for a in launcher.agents.values()] + [n.proc.pid for n in launcher.nodes.values()]
    seen: dict[str, list[str]] = {}
    go, start_agents = launcher.start_nodes, launcher.start_agents

    def spy_go(*args: Any, **kwargs: Any) -> Any:
        seen["go"] = [process_state(pid) for pid in old]
        return go(*args, **kwargs)

    def spy_agents(*args: Any, **kwargs: Any) -> Any:
        assert launcher.last_restart is not None
        since, step = launcher.last_restart
        seen["agents"] = [process_state(pid) for pid in old]
        seen["agents"].append("resumed" if stepped_past(launcher.run_dir, LAYOUT.world, since, step) else "not yet")
        return start_agents(*args, **kwargs)

    launcher.start_nodes, launcher.start_agents = spy_go, spy_agents  # type: ignore[method-assign]
    return seen


def resumed_on(launcher: Launcher, event: RecoveryEvent, version: str, runs_before: dict[int, int]) -> None:
    """Every rank restarted once more, on its own machine, on ``version``, and completed a step after the restart."""
    wait_for(lambda: stepped_past(launcher.run_dir, LAYOUT.world, event.restart_began_wall, event.resume_step), 120,
             "every rank to resume", interval_s=0.1)
    for rank in range(LAYOUT.world):
        runs = code_runs(launcher.run_dir, rank)
        assert len(runs) == runs_before[rank] + 1, runs
        old, new = runs[-2], runs[-1]
        assert new["machine"] == old["machine"] == MACHINES[rank]  # the same machine: not rescheduled
        assert new["pid"] != old["pid"]  # a new process
        assert new["version"] == version and new["start_step"] == event.resume_step


@pytest.mark.drill
@pytest.mark.timeout(900)
def test_hot_update_immediately_then_lazily_then_roll_back_on_the_same_machines(
        drill: tuple[Launcher, Recovery]) -> None:
    launcher, recovery = drill
    run_dir = launcher.run_dir
    links = {m: launcher.code_link(m) for m in MACHINES}
    wait_for(lambda: steps_done(run_dir) >= 3, 120, "the job's first steps", interval_s=0.1)
    assert {m: version_of(link) for m, link in links.items()} == dict.fromkeys(MACHINES, "v1")
    assert [r["version"] for rank in range(LAYOUT.world) for r in code_runs(run_dir, rank)] == ["v1", "v1"]
    # Each agent's config names its own machine's link, and the repository the git refs come from.
    for m in MACHINES:
        config = load_actions_config(launcher.state_dir(m) / "actions.json", launcher.state_dir(m))
        assert config is not None and config.hot_update is not None
        assert config.hot_update.current == links[m] and config.hot_update.repo == launcher.code_repo
        assert local_standbys(config.eviction) == ()  # this drill has no warm standbys

    # ---- immediate: v2 (a git tag), as the TUI's `u` sends it ---------------------------------------------
    # Each machine has a parked node (torch imported, v1 not: the code comes from the link after the go).
    wait_for(lambda: launcher.parked_ready(MACHINES), 400, "the machines' parked nodes")
    parked = {m: tuple(warm.ask(launcher.parked[m].socket, {"op": "status"})["pids"]) for m in MACHINES}
    runs = {rank: len(code_runs(run_dir, rank)) for rank in range(LAYOUT.world)}
    seen = watch_old_processes(launcher)
    now = time.time()
    results = run_sync(act(launcher, update_request("v2", UpdateMode.IMMEDIATE,
                                                       new_action_id(ActionKind.HOT_UPDATE, now), "drill-test")))
    assert [r.state for r in results] == [ActionState.SUCCEEDED] * 2, [r.message for r in results]
    assert all(RESTART_REQUESTED in r.message for r in results)
    event = recovery.wait(1, 120)
    assert event.ok and event.kind == "hot_update", event.message
    assert event.machines == MACHINES and event.evicted == () and event.joined == ()
    assert launcher.machines() == MACHINES
    resumed_on(launcher, event, "v2", runs)
    # The old agents and nodes were held frozen ("T", no SIGTERM) while the new ranks started, and were gone only
    # once the job had resumed, before the new agents started on the agents' ports.
    assert seen == {"go": ["T"] * 4, "agents": ["gone"] * 4 + ["resumed"]}, seen
    # The restart in place went through the parked nodes: the parked processes became the ranks, warm.
    assert [(w.name, w.pids, w.warm) for w in launcher.warm_starts[-2:]] == [(m, parked[m], (True,)) for m in MACHINES]
    assert [code_runs(run_dir, r)[-1]["pid"] for r in range(LAYOUT.world)] == [parked[m][0] for m in MACHINES]
    v2_trees = {m: os.path.realpath(link) for m, link in links.items()}
    assert {m: version_of(link) for m, link in links.items()} == dict.fromkeys(MACHINES, "v2")
    # The losses say which code computed each step: v1 up to the restart, v2 from the checkpoint on.
    wait_for(lambda: loss_records(run_dir)[-1]["code"] == "v2", 60, "a loss computed by v2", interval_s=0.1)
    logged = loss_records(run_dir)
    first_v2 = next(i for i, x in enumerate(logged) if x["code"] == "v2")
    assert all(x["code"] == "v1" for x in logged[:first_v2])
    assert logged[first_v2]["step"] == event.resume_step + 1
    assert all(x["code"] == "v2" for x in logged[first_v2:])

    # ---- lazy: v3 waits while the job runs on v2, and rides on the next restart ----------------------------
    results = run_sync(act(launcher, update_request("v3", UpdateMode.LAZY,
                                                       new_action_id(ActionKind.HOT_UPDATE, time.time()),
                                                       "drill-test")))
    assert [r.state for r in results] == [ActionState.SUCCEEDED] * 2, [r.message for r in results]
    assert all("pending on" in r.message for r in results)
    at = steps_done(run_dir)
    wait_for(lambda: steps_done(run_dir) >= at + 10, 60, "ten more steps on v2", interval_s=0.1)
    assert {m: version_of(link) for m, link in links.items()} == dict.fromkeys(MACHINES, "v2")
    assert [len(code_runs(run_dir, rank)) for rank in range(LAYOUT.world)] == [2, 2]  # no restart
    assert len(recovery.events) == 1 and loss_records(run_dir)[-1]["code"] == "v2"
    for m in MACHINES:
        pending = HotUpdateHistory(launcher.state_dir(m) / "hot_update_history.sqlite").pending()
        assert pending is not None and pending.to_version.label.startswith("git:v3 (")

    runs = {rank: len(code_runs(run_dir, rank)) for rank in range(LAYOUT.world)}
    seen = watch_old_processes(launcher)
    launcher.restart(launcher.machines())  # the next restart (a failure or an eviction would take this path too)
    # With a lazy update pending, the agents ended (exited, maybe not yet collected) before the nodes were let go:
    # none may apply it itself. The nodes were still held frozen.
    assert [state in ("Z", "gone") for state in seen["go"][:2]] == [True, True] and seen["go"][2:] == ["T", "T"], seen
    assert launcher.last_restart is not None
    restart_wall, resume = launcher.last_restart
    restarted = RecoveryEvent("explicit", (), (), MACHINES, True, "", 0.0, 0.0, restart_wall, resume, "restart")
    resumed_on(launcher, restarted, "v3", runs)
    assert {m: version_of(link) for m, link in links.items()} == dict.fromkeys(MACHINES, "v3")

    # ---- rollback: back to v2, immediately ----------------------------------------------------------------
    runs = {rank: len(code_runs(run_dir, rank)) for rank in range(LAYOUT.world)}
    results = run_sync(act(launcher, rollback_request(UpdateMode.IMMEDIATE,
                                                         new_action_id(ActionKind.ROLLBACK, time.time()), "drill-test")))
    assert [r.state for r in results] == [ActionState.SUCCEEDED] * 2, [r.message for r in results]
    event = recovery.wait(2, 120)
    assert event.ok and event.kind == "rollback" and event.machines == MACHINES, event.message
    resumed_on(launcher, event, "v2", runs)
    assert {m: os.path.realpath(link) for m, link in links.items()} == v2_trees  # the same v2 tree as before

    # ---- the history: who, when, what, result ---------------------------------------------------------------
    for m in MACHINES:
        entries = HotUpdateHistory(launcher.state_dir(m) / "hot_update_history.sqlite").entries()
        got = [(e.kind, e.mode, e.state, e.trigger, e.to_version.label.split(" ")[0]) for e in entries]
        assert got == [
            (UpdateKind.ROLLBACK, UpdateMode.IMMEDIATE, UpdateState.APPLIED, "immediate", "git:v2"),
            (UpdateKind.UPDATE, UpdateMode.LAZY, UpdateState.APPLIED, "restart", "git:v3"),
            (UpdateKind.UPDATE, UpdateMode.IMMEDIATE, UpdateState.APPLIED, "immediate", "git:v2"),
        ], got
        assert all(e.who == "drill-test" and e.applied_at is not None and e.applied_at >= e.requested_at
                   for e in entries)
        # The audit log (what the TUI's history shows) has the lazy update's application under its derived id.
        audit: list[AuditRecord] = list(AuditLog(launcher.state_dir(m) / "audit.sqlite").records())
        applied = [r for r in audit if r.action_id == f"{entries[1].action_id}.restart"]
        assert [r.result for r in applied] == ["started", "succeeded"] and "v3" in applied[-1].message


# ---- without processes: the recovery's rule for restarting in place, the per-machine code set-up ----------


def _record(seq: int, action_id: str, kind: ActionKind, result: str, message: str = "",
            machines: tuple[str, ...] = ()) -> AuditRecord:
    return AuditRecord(seq, action_id, "alice", 1000.0 + seq, kind, "hot-update", result, message, machines)


def test_the_recovery_restarts_in_place_only_once_every_agent_switched_and_one_asked(tmp_path: Path) -> None:
    from rankscope.drill.control import SETTLE_S, _Seen

    launcher = Launcher(tmp_path, LAYOUT, TRAINING, counters=False, actions=True)
    recovery = Recovery(launcher, DrillMachines(launcher))
    agents = set(MACHINES)
    seen: dict[str, _Seen] = {}

    def add(machine: str, record: AuditRecord) -> None:
        seen.setdefault(record.action_id, _Seen(record.kind)).add(machine, record)

    add("machine-0", _record(1, "hu-1", ActionKind.HOT_UPDATE, "started"))
    add("machine-0", _record(2, "hu-1", ActionKind.HOT_UPDATE, "progress", f"{RESTART_REQUESTED} (immediate)"))
    add("machine-0", _record(3, "hu-1", ActionKind.HOT_UPDATE, "succeeded"))
    assert recovery._finished(seen, agents) is None  # machine-1 has not begun: it may still be switching
    add("machine-1", _record(1, "hu-1", ActionKind.HOT_UPDATE, "started"))
    assert recovery._finished(seen, agents) is None  # begun, not finished
    add("machine-1", _record(2, "hu-1", ActionKind.HOT_UPDATE, "succeeded", f"... {RESTART_REQUESTED} from the launcher"))
    found = recovery._finished(seen, agents)
    assert found is not None and found.kind == ActionKind.HOT_UPDATE and found.action_id == "hu-1"
    assert found.restart_requested == MACHINES

    # A lazy update finished everywhere asks for nothing: no restart, and it is not looked at again.
    seen.clear()
    for m in MACHINES:
        add(m, _record(4, "hu-2", ActionKind.HOT_UPDATE, "started"))
        add(m, _record(5, "hu-2", ActionKind.HOT_UPDATE, "succeeded", "pending on m: applied at the next restart"))
    assert recovery._finished(seen, agents) is None and "hu-2" in recovery._handled

    # A lazy update whose window expired on one agent: only that agent records it (id + ".window"). It is taken
    # as complete once its agents have been quiet for SETTLE_S, and the restart applies the others' pending ones.
    seen.clear()
    add("machine-0", _record(7, "hu-2.window", ActionKind.HOT_UPDATE, "started"))
    add("machine-0", _record(8, "hu-2.window", ActionKind.HOT_UPDATE, "succeeded", f"window expired; {RESTART_REQUESTED}"))
    assert recovery._finished(seen, agents) is None  # machine-1 may still be on its way
    seen["hu-2.window"].last_mono -= SETTLE_S
    found = recovery._finished(seen, agents)
    assert found is not None and found.restart_requested == ("machine-0",)

    # An eviction is taken as complete only after its agents' quiet time: another agent may yet begin it.
    seen.clear()
    add("machine-1", _record(9, "ev-1", ActionKind.EVICT, "started"))
    add("machine-1", _record(10, "ev-1", ActionKind.EVICT, "succeeded"))
    assert recovery._finished(seen, agents) is None
    add("machine-0", _record(9, "ev-1", ActionKind.EVICT, "started"))  # the slow one
    add("machine-0", _record(10, "ev-1", ActionKind.EVICT, "succeeded"))
    seen["ev-1"].last_mono -= SETTLE_S
    found = recovery._finished(seen, agents)
    assert found is not None and found.kind == ActionKind.EVICT and found.machines == ()  # nothing runs here

    # "started" lines that name the whole eviction (each agent's part and EvictArgs.together): complete the moment
    # every machine named has ended, with no quiet time (an agent that never begins its part is still waited out).
    seen.clear()
    both = ("machine-1", "machine-0")
    add("machine-1", _record(11, "ev-2", ActionKind.EVICT, "started", machines=both))
    add("machine-1", _record(12, "ev-2", ActionKind.EVICT, "succeeded", machines=("machine-1",)))
    assert recovery._finished(seen, agents) is None  # machine-0's part has not even begun
    add("machine-0", _record(11, "ev-2", ActionKind.EVICT, "started", machines=("machine-0", "machine-1")))
    assert recovery._finished(seen, agents) is None  # begun, not ended
    add("machine-0", _record(12, "ev-2", ActionKind.EVICT, "succeeded", machines=("machine-0",)))
    found = recovery._finished(seen, agents)  # at once: no SETTLE_S
    assert found is not None and found.kind == ActionKind.EVICT and found.action_id == "ev-2"

    # One agent failed: the job is not restarted on mixed code; the event says so.
    seen.clear()
    add("machine-0", _record(6, "rb-1", ActionKind.ROLLBACK, "succeeded", RESTART_REQUESTED))
    add("machine-1", _record(6, "rb-1", ActionKind.ROLLBACK, "failed", "git could not resolve"))
    found = recovery._finished(seen, agents)
    assert found is not None and found.results == {"machine-0": "succeeded", "machine-1": "failed"}
    recovery._restart_in_place(found)
    (event,) = recovery.events
    assert not event.ok and event.kind == "rollback" and "machine-1" in event.message and event.machines == ()
    assert launcher.nodes == {}  # nothing was started


def test_each_drill_machine_gets_its_own_code_link_and_agent_config(tmp_path: Path) -> None:
    from rankscope.actions.agent_service import ActionService
    from rankscope.actions.blocklist import Blocklist
    from rankscope.actions.model import EvictArgs, Targets

    launcher = Launcher(tmp_path, LAYOUT, TRAINING, counters=False, actions=True)
    launcher.standbys = ["standby-0", "standby-1"]
    paths = {m: launcher._actions_config(m) for m in (*MACHINES, "standby-0")}
    trees = set()
    for m, path in paths.items():
        config = load_actions_config(path, launcher.state_dir(m))
        assert config is not None and config.hot_update is not None
        assert config.hot_update.current == launcher.code_link(m) and config.hot_update.current.is_symlink()
        assert config.hot_update.versions_dir == launcher.code_versions(m)
        trees.add(os.path.realpath(config.hot_update.current))
        code = user_code.load(str(config.hot_update.current))
        assert code.version == "v1" and code.lr(0.01, 7) == 0.01  # v1 changes nothing: losses stay bit for bit
        # Every agent reads the launcher's current pool (a standby's own plan leaves itself out).
        assert local_standbys(config.eviction) == ("standby-0", "standby-1")
    assert len(trees) == 3  # one version tree per machine: each machine has its own copy of the code
    config = load_actions_config(paths["machine-0"], launcher.state_dir("machine-0"))
    assert config is not None
    service = ActionService(config, "machine-0", lambda: ())

    def evict_plan() -> tuple[str, ...]:
        plan = run_sync(service.plan(ActionRequest("ev-1", ActionKind.EVICT, Targets(("machine-0",)),
                                                      EvictArgs("hang"), "alice")))
        assert "self-checks first" in plan.steps[-1], plan.steps
        return plan.standbys

    assert evict_plan() == ("standby-0", "standby-1")
    # The pool changes while the agent runs (a standby added, one blocked by any agent): the next plan shows it.
    launcher.standbys.append("standby-2")
    Blocklist(launcher.state_dir("machine-1") / "blocklist.sqlite").block(("standby-0",), "failed", "t", "e-1")
    launcher.write_standbys()
    assert evict_plan() == ("standby-1", "standby-2")
    # The repository has the three versions as tags, each module saying its name.
    for version in ("v1", "v2", "v3"):
        assert f"VERSION = {version!r}" in user_code._git(launcher.code_repo, "show", f"{version}:drill_user_code.py")
    # Without actions (or with code=False) the nodes get no link and the worker runs as it always did.
    plain = Launcher(tmp_path / "plain", LAYOUT, TRAINING, counters=False)
    assert not plain.hot_updates and plain.apply_pending_updates(MACHINES) == []


def test_a_drill_without_git_runs_without_code_links_and_says_why(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from rankscope.contract.errors import RankscopeError

    def no_git(repo: Path, *argv: str) -> str:
        raise RankscopeError("git failed while making the drill's code repository: not found", "install git")

    monkeypatch.setattr(user_code, "_git", no_git)
    launcher = Launcher(tmp_path, LAYOUT, TRAINING, counters=False, actions=True)
    assert launcher._code_env("machine-0") == {}
    assert not launcher.hot_updates and any("hot-update off" in n and "install git" in n for n in launcher.notes)
    config = load_actions_config(launcher._actions_config("machine-0"), launcher.state_dir("machine-0"))
    assert config is not None and config.hot_update is None  # `u` is refused with the fix, eviction still works
