"""The action protocol over real gRPC on loopback: plan, confirm, run once, audit, broadcast.

Agents are real gRPC servers (in this process, or ``rankscope agent`` as a
subprocess for the CLI flags); ranks are real processes with torchrun's
environment and a child process, found by the agent's own discovery, and the
local eviction really signals them. Every agent is scoped to the test's run id,
so it never sees (or stops) anybody else's processes.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import psutil
import pytest
from agent_helpers import PY, Processes, clean_env, wait_for
from rankscope.actions.agent_protocol import (
    ActionError,
    ActionUpdate,
    AgentLost,
    AuditResumed,
    Confirmation,
    combined_phrase,
    confirmation_for,
)
from rankscope.actions.audit import AuditLog
from rankscope.actions.blocklist import Blocklist
from rankscope.actions.config import ActionsConfig, EvictionSettings, HotUpdateSettings, load_actions_config
from rankscope.actions.history import HotUpdateHistory, UpdateState
from rankscope.actions.model import (
    ActionKind,
    ActionPlan,
    ActionProgress,
    ActionRequest,
    ActionResult,
    ActionState,
    AuditRecord,
    BackupArgs,
    EvictArgs,
    HotUpdateArgs,
    RollbackArgs,
    Targets,
    UpdateMode,
    VersionSource,
)
from rankscope.contract.errors import RankscopeError
from rankscope.contract.snapshot import Layout
from rankscope.wire.access import token_fingerprint
from rankscope.wire.action_client import UNOWNED
from rankscope.wire.action_messages import confirmation_to_proto, event_from_proto, request_to_proto
from rankscope.wire.agent import AgentConfig, RunningAgent, start_agent
from rankscope.wire.client import JobClient
from rankscope.wire.fanout import auth_metadata
from rankscope.wire.proto import rankscope_pb2 as pb
from rankscope.wire.proto import rankscope_pb2_grpc as pb_grpc
from rankscope.wire.tokens import parse_tokens

pytestmark = pytest.mark.timeout(120)

READ = "read0123456789abcdef0123456789ab"
ACT = "act00123456789abcdef0123456789ab"
TOKENS = parse_tokens(f"read:{READ}\nact:{ACT}", "test")

# A rank with a worker child (a dataloader stand-in); with "1" it ignores SIGTERM, like a rank stuck in C code.
RANK_TREE = """
import os, signal, subprocess, sys, time
ready, ignore_term = sys.argv[1], sys.argv[2] == "1"
if ignore_term:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(1)"])
with open(ready + ".tmp", "w") as f:
    f.write(str(child.pid))
os.replace(ready + ".tmp", ready)
while True:
    time.sleep(1)
"""


class RankTree:
    def __init__(self, proc: subprocess.Popen[bytes], child_pid: int, rank: int) -> None:
        self.proc, self.child_pid, self.rank = proc, child_pid, rank

    def child_gone(self) -> bool:
        try:
            return psutil.Process(self.child_pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True


def start_rank_tree(procs: Processes, rank: int, world_size: int, run_id: str, *, ignore_term: bool = False) -> RankTree:
    ready = procs.folder / f"tree{rank}-{uuid.uuid4().hex[:6]}.ready"
    env = clean_env()
    env.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world_size), GROUP_RANK=str(rank),
               LOCAL_WORLD_SIZE="1", TORCHELASTIC_RUN_ID=run_id)
    proc = subprocess.Popen([PY, "-c", RANK_TREE, str(ready), "1" if ignore_term else "0"], env=env,
                            start_new_session=True)
    procs.started.append(proc)

    def is_ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"rank {rank} exited with {proc.returncode}")
        return ready.exists()

    wait_for(is_ready, 30, f"rank {rank} to start its child")
    return RankTree(proc, int(ready.read_text()), rank)


@pytest.fixture
def run_id() -> str:
    return f"rankscope-actions-{uuid.uuid4().hex[:10]}"


@asynccontextmanager
async def serving(name: str, run_id: str, actions: ActionsConfig | None) -> AsyncIterator[RunningAgent]:
    config = AgentConfig(tokens=TOKENS, port=0, machine_name=name, run_id=run_id, actions=actions)
    agent = await start_agent(config)
    try:
        yield agent
    finally:
        await agent.stop(0)


def evict(action_id: str, *machines: str, ranks: tuple[int, ...] = ()) -> ActionRequest:
    return ActionRequest(action_id, ActionKind.EVICT, Targets(machines, ranks), EvictArgs("hung in all_gather"),
                         "alice")


async def collect(client: JobClient, request: ActionRequest, confirmation: Confirmation) -> list[ActionUpdate]:
    return [u async for u in client.run_action(request, confirmation)]


def results(updates: list[ActionUpdate]) -> list[ActionResult]:
    return [u.event for u in updates if isinstance(u.event, ActionResult)]


async def run_raw(address: str, token: str, request: ActionRequest,
                  confirmation: Confirmation) -> list[ActionProgress | ActionResult]:
    """RunAction straight on the stub: what a client that skips its own checks would send."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.RankscopeAgentStub(channel)  # type: ignore[no-untyped-call]
        message = pb.RunActionRequest(request=request_to_proto(request),
                                      confirmation=confirmation_to_proto(confirmation))
        return [event_from_proto(r) async for r in stub.RunAction(message, metadata=auth_metadata(token), timeout=60)]


# ---- plan -> run -> result: the local eviction ------------------------------------------------


async def test_local_eviction_plans_then_stops_the_rank_tree_and_blocks_the_machine(
        procs: Processes, run_id: str, tmp_path: Path) -> None:
    tree = start_rank_tree(procs, 0, 2, run_id)
    other = procs.rank(1, 2, run_id=f"{run_id}-other")  # another job on the same host: never touched
    state = tmp_path / "state-m0"
    async with serving("m0", run_id, ActionsConfig(state, EvictionSettings(grace_s=5.0))) as agent, \
            JobClient([agent.address], ACT, acting=True) as client:
        request = evict("evict-1", "m0")
        plans = await client.plan_action(request)
        plan = plans[agent.address]
        assert isinstance(plan, ActionPlan), plan
        assert plan.machines == ("m0",)
        assert {p.pid for p in plan.processes} == {tree.proc.pid, tree.child_pid}
        assert {p.rank for p in plan.processes} == {0}
        assert plan.typed_confirmation and plan.confirm_phrase == "evict m0"
        assert tree.proc.poll() is None, "planning must not touch the rank"

        updates = await collect(client, request, confirmation_for(plans.values(), typed="evict m0"))

        assert all(u.address == agent.address for u in updates)
        (result,) = results(updates)
        assert result.state == ActionState.SUCCEEDED, result.message
        assert not result.replayed
        assert updates[-1].event == result  # progress first, the result last
        progress = [u.event.message for u in updates if isinstance(u.event, ActionProgress)]
        assert any("SIGTERM" in m for m in progress) and any("blocked m0" in m for m in progress)
        assert tree.proc.wait(timeout=10) == -signal.SIGTERM
        wait_for(tree.child_gone, 10, "the rank's child to be stopped")
        assert other.proc.poll() is None, "a rank of another run id was stopped"
    blocked = Blocklist(state / "blocklist.sqlite").blocked()
    assert [(b.machine, b.reason, b.who, b.action_id) for b in blocked] == [
        ("m0", "hung in all_gather", "alice", "evict-1")]
    audit = [(r.action_id, r.who, r.result) for r in AuditLog(state / "audit.sqlite").records()]
    who = f"alice (act token {token_fingerprint(ACT)})"  # the client's name and the token the agent saw
    assert audit[0] == ("evict-1", who, "started") and audit[-1] == ("evict-1", who, "succeeded")
    assert {r for _, _, r in audit[1:-1]} == {"progress"}


async def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace_period(
        procs: Processes, run_id: str, tmp_path: Path) -> None:
    tree = start_rank_tree(procs, 0, 1, run_id, ignore_term=True)
    async with serving("m0", run_id, ActionsConfig(tmp_path / "s", EvictionSettings(grace_s=0.5))) as agent, \
            JobClient([agent.address], ACT, acting=True) as client:
        request = evict("evict-stubborn", "m0")
        await client.plan_action(request)
        updates = await collect(client, request, Confirmation(("m0",), (), "evict m0"))
    (result,) = results(updates)
    assert result.state == ActionState.SUCCEEDED, result.message
    assert "2 needed SIGKILL" in result.message  # the child inherited the ignored SIGTERM
    assert tree.proc.wait(timeout=10) == -signal.SIGKILL


# ---- idempotency ---------------------------------------------------------------------------


async def test_the_same_action_id_twice_acts_once_and_returns_the_same_result(
        procs: Processes, run_id: str, tmp_path: Path) -> None:
    first_rank = start_rank_tree(procs, 0, 1, run_id)
    state = tmp_path / "state"
    async with serving("m0", run_id, ActionsConfig(state, EvictionSettings(grace_s=5.0))) as agent, \
            JobClient([agent.address], ACT, acting=True) as client:
        request = evict("evict-once", "m0")
        await client.plan_action(request)
        (first,) = results(await collect(client, request, Confirmation(("m0",), (), "evict m0")))
        assert first.state == ActionState.SUCCEEDED
        first_rank.proc.wait(timeout=10)
        # The job restarted on this machine: a replay of the old id must not stop the new rank.
        second_rank = start_rank_tree(procs, 0, 1, run_id)
        await client.plan_action(request)
        (again,) = results(await collect(client, request, Confirmation(("m0",), (), "evict m0")))
        assert again.replayed
        assert (again.state, again.message, again.started, again.finished, again.details) == \
            (first.state, first.message, first.started, first.finished, first.details)
        assert second_rank.proc.poll() is None, "the repeated id acted a second time"
        # The same id with a different request is refused, not replayed.
        other = ActionRequest("evict-once", ActionKind.EVICT, Targets(("m0",)), EvictArgs("another reason"), "bob")
        (refused,) = [e for e in await run_raw(agent.address, ACT, other, Confirmation(("m0",), (), "evict m0"))
                      if isinstance(e, ActionResult)]
        assert refused.state == ActionState.REFUSED and "already used" in refused.message
        assert second_rank.proc.poll() is None
    started = [r for r in AuditLog(state / "audit.sqlite").records() if r.result == "started"]
    assert [r.action_id for r in started] == ["evict-once"]
    assert len(Blocklist(state / "blocklist.sqlite").entries()) == 1


# ---- confirmation, tokens, targets -------------------------------------------------------


async def test_a_confirmation_that_does_not_name_the_planned_targets_is_refused_and_nothing_happens(
        procs: Processes, run_id: str, tmp_path: Path) -> None:
    tree = start_rank_tree(procs, 0, 1, run_id)
    state = tmp_path / "state"
    async with serving("m0", run_id, ActionsConfig(state, EvictionSettings(grace_s=1.0))) as agent, \
            JobClient([agent.address], ACT, acting=True) as client:
        request = evict("evict-mismatch", "m0")
        plans = await client.plan_action(request)
        # the client itself refuses a wrong phrase or missing targets before sending anything
        with pytest.raises(RankscopeError, match="typed confirmation"):
            await collect(client, request, Confirmation(("m0",), (), "evict"))
        await client.plan_action(request)
        with pytest.raises(RankscopeError, match="nothing was sent"):
            await collect(client, request, Confirmation((), (), "evict m0"))
        assert combined_phrase(ActionKind.EVICT, [p for p in plans.values() if isinstance(p, ActionPlan)]) == \
            "evict m0"
        # the agent refuses too, whatever a client sends
        for wrong in (Confirmation(("m0",), (), "evict m1"), Confirmation(("m0", "m1"), (), "evict m0"),
                      Confirmation(("m0",), (0,), "evict m0"), Confirmation(("m0",), (), "")):
            (result,) = await run_raw(agent.address, ACT, request, wrong)
            assert isinstance(result, ActionResult) and result.state == ActionState.REFUSED, result
            assert "nothing was done" in result.message
    assert tree.proc.poll() is None
    assert Blocklist(state / "blocklist.sqlite").blocked() == ()
    audit = AuditLog(state / "audit.sqlite").records()
    assert [r.result for r in audit] == ["refused"] * 4


async def test_a_read_token_plans_and_watches_but_cannot_run(procs: Processes, run_id: str, tmp_path: Path) -> None:
    tree = start_rank_tree(procs, 0, 1, run_id)
    async with serving("m0", run_id, ActionsConfig(tmp_path / "s")) as agent, \
            JobClient([agent.address], READ) as reader:
        request = evict("evict-read", "m0")
        plans = await reader.plan_action(request)
        assert isinstance(plans[agent.address], ActionPlan)
        with pytest.raises(RankscopeError, match="read-only"):
            await collect(reader, request, Confirmation(("m0",), (), "evict m0"))
        with pytest.raises(grpc.aio.AioRpcError) as denied:
            await run_raw(agent.address, READ, request, Confirmation(("m0",), (), "evict m0"))
        assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.aio.AioRpcError) as anonymous:
            await run_raw(agent.address, "", request, Confirmation(("m0",), (), "evict m0"))
        assert anonymous.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # the read token still sees the audit stream (here: empty, then a record when an actor is refused)
        watch = reader.watch_audit(agent.address, since=0)
        pending = asyncio.ensure_future(anext(watch))
        await run_raw(agent.address, ACT, request, Confirmation(("m0",), (), "wrong"))
        record = await asyncio.wait_for(pending, 30)
        assert isinstance(record, AuditRecord) and record.result == "refused"
        await watch.aclose()
    assert tree.proc.poll() is None


async def test_targets_outside_the_agents_job_are_refused(procs: Processes, run_id: str, tmp_path: Path) -> None:
    tree = start_rank_tree(procs, 0, 2, run_id)
    async with serving("m0", run_id, ActionsConfig(tmp_path / "s")) as agent, \
            JobClient([agent.address], ACT, acting=True) as client:
        plans = await client.plan_action(evict("evict-far", "m9"))
        assert isinstance(plans[UNOWNED], ActionError) and "machine m9" in plans[UNOWNED].message
        assert agent.address not in plans
        # an agent asked directly about another machine or a rank it does not run refuses with the fix
        async with grpc.aio.insecure_channel(agent.address) as channel:
            stub = pb_grpc.RankscopeAgentStub(channel)  # type: ignore[no-untyped-call]
            for request, needle in ((evict("x1", "m9"), "m9 is not this agent's machine (m0)"),
                                    (evict("x2", "m0", ranks=(1,)), "rank(s) 1 do not run on m0")):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.PlanAction(request_to_proto(request), metadata=auth_metadata(READ))
                assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
                assert needle in (refused.value.details() or "") and "\nfix: " in (refused.value.details() or "")
        (result,) = await run_raw(agent.address, ACT, evict("x3", "m9"), Confirmation(("m9",), (), "evict m9"))
        assert isinstance(result, ActionResult) and result.state == ActionState.REFUSED
        assert "not this agent's machine" in result.message
    assert tree.proc.poll() is None


async def test_an_agent_without_actions_says_how_to_enable_them(run_id: str) -> None:
    async with serving("m0", run_id, None) as agent, JobClient([agent.address], ACT, acting=True) as client:
        plans = await client.plan_action(evict("a1", "m0"))
        error = plans[agent.address]
        assert isinstance(error, ActionError) and "no actions configured" in error.message
        assert "--state-dir" in error.fix
        watch = client.watch_audit(agent.address)
        lost = await asyncio.wait_for(anext(watch), 30)
        assert isinstance(lost, AgentLost) and not lost.retrying and "--state-dir" in lost.fix
        await watch.aclose()


# ---- the audit stream ----------------------------------------------------------------------


async def test_a_second_client_sees_the_action_live_on_the_audit_stream(
        procs: Processes, run_id: str, tmp_path: Path) -> None:
    tree = start_rank_tree(procs, 0, 1, run_id)
    async with serving("m0", run_id, ActionsConfig(tmp_path / "s", EvictionSettings(grace_s=5.0))) as agent, \
            JobClient([agent.address], ACT, acting=True) as actor, \
            JobClient([agent.address], READ) as watcher:
        seen: list[AuditRecord] = []
        subscribed = asyncio.Event()
        finished = asyncio.Event()

        async def watch() -> None:
            async for item in watcher.watch_audit(agent.address, since=None):  # live only: no backlog
                assert isinstance(item, AuditRecord), item
                seen.append(item)
                if item.action_id == "probe":
                    subscribed.set()
                if item.action_id == "evict-live" and item.result in ("succeeded", "failed"):
                    finished.set()
                    return

        task = asyncio.create_task(watch())
        try:
            # A refused probe proves the stream is open before the action starts (each try is audited).
            while not subscribed.is_set():
                await run_raw(agent.address, ACT, evict("probe", "m0"), Confirmation())
                try:
                    await asyncio.wait_for(subscribed.wait(), 1.0)
                except TimeoutError:
                    continue
            request = evict("evict-live", "m0")
            await actor.plan_action(request)
            updates = await collect(actor, request, Confirmation(("m0",), (), "evict m0"))
            await asyncio.wait_for(finished.wait(), 30)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    mine = [r for r in seen if r.action_id == "evict-live"]
    assert mine[0].result == "started" and mine[-1].result == "succeeded"
    assert [r.message for r in mine if r.result == "progress"] == \
        [u.event.message for u in updates if isinstance(u.event, ActionProgress)]
    assert all(r.who == f"alice (act token {token_fingerprint(ACT)})" and r.machines == ("m0",) for r in mine)
    assert [r.seq for r in seen] == sorted({r.seq for r in seen}), "records repeated or out of order"
    assert tree.proc.poll() is not None


async def test_watch_audit_resumes_after_the_last_record_and_marks_a_lost_agent(
        procs: Processes, run_id: str, tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with serving("m0", run_id, ActionsConfig(state)) as agent:
        for i in range(3):
            await run_raw(agent.address, ACT, evict(f"r{i}", "m0"), Confirmation())
        async with JobClient([agent.address], READ) as client:
            watch = client.watch_audit(agent.address, since=1)
            backlog = [await asyncio.wait_for(anext(watch), 30) for _ in range(2)]
            assert [r.action_id for r in backlog if isinstance(r, AuditRecord)] == ["r1", "r2"]
            await agent.stop(0)
            lost = await asyncio.wait_for(anext(watch), 30)
            assert isinstance(lost, AgentLost) and lost.retrying
            # The agent comes back on its port with nothing new to tell: the stream says it is open again (the
            # TUI drops its lost note), then goes on after the last record it gave.
            port = int(agent.address.rsplit(":", 1)[1])
            again = await start_agent(AgentConfig(tokens=TOKENS, port=port, machine_name="m0", run_id=run_id,
                                                  actions=ActionsConfig(state)))
            try:
                resumed = await asyncio.wait_for(anext(watch), 30)
                assert resumed == AuditResumed(agent.address)
                await run_raw(again.address, ACT, evict("r3", "m0"), Confirmation())
                after = await asyncio.wait_for(anext(watch), 30)
                assert isinstance(after, AuditRecord) and after.action_id == "r3"  # r0-r2 not again
            finally:
                await watch.aclose()
                await again.stop(0)


# ---- scheduler backends, hot-update, rollback, backup --------------------------------------


def code_link_at_v1(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Two prepared code directories and the job's code link, pointing at the first."""
    v1, v2 = tmp_path / "code-v1", tmp_path / "code-v2"
    v1.mkdir()
    v2.mkdir()
    current = tmp_path / "job" / "code"
    current.parent.mkdir()
    os.symlink(v1, current)
    return v1, v2, current


async def test_hot_update_switches_the_code_and_requests_a_restart_then_rolls_back(
        procs: Processes, run_id: str, tmp_path: Path) -> None:
    tree = start_rank_tree(procs, 0, 1, run_id)
    v1, v2, current = code_link_at_v1(tmp_path)
    state = tmp_path / "state"
    config = ActionsConfig(state, hot_update=HotUpdateSettings(current, tmp_path / "versions",
                                                                   prepared_roots=(tmp_path,)))
    async with serving("m0", run_id, config) as agent, JobClient([agent.address], ACT, acting=True) as client:
        update = ActionRequest("hu-1", ActionKind.HOT_UPDATE, Targets(), HotUpdateArgs(VersionSource.DIR, str(v2)),
                               "alice")
        plan = (await client.plan_action(update))[agent.address]
        assert isinstance(plan, ActionPlan) and not plan.typed_confirmation and plan.machines == ("m0",)
        assert os.readlink(current) == str(v1), "planning switched the code"
        updates = await collect(client, update, Confirmation(("m0",)))
        (result,) = results(updates)
        assert result.state == ActionState.SUCCEEDED, result.message
        assert os.readlink(current) == str(v2)
        assert any("restart requested" in u.event.message for u in updates if isinstance(u.event, ActionProgress))
        assert tree.proc.poll() is None, "the agent must leave the restart to the launcher"

        lazy = ActionRequest("hu-2", ActionKind.HOT_UPDATE, Targets(), HotUpdateArgs(VersionSource.DIR, str(v1),
                                                                                      UpdateMode.LAZY), "alice")
        await client.plan_action(lazy)
        (pending,) = results(await collect(client, lazy, Confirmation(("m0",))))
        assert pending.state == ActionState.SUCCEEDED and "pending" in pending.message
        assert os.readlink(current) == str(v2)

        back = ActionRequest("rb-1", ActionKind.ROLLBACK, Targets(), RollbackArgs(), "bob")
        plan = (await client.plan_action(back))[agent.address]
        assert isinstance(plan, ActionPlan) and str(v1) in plan.summary
        (rolled,) = results(await collect(client, back, Confirmation(("m0",))))
        assert rolled.state == ActionState.SUCCEEDED, rolled.message
        assert os.readlink(current) == str(v1)
    states = [(r.action_id, r.state) for r in HotUpdateHistory(state / "hot_update_history.sqlite").entries()]
    assert states == [("rb-1", UpdateState.APPLIED), ("hu-2", UpdateState.SUPERSEDED), ("hu-1", UpdateState.APPLIED)]


async def test_backup_plans_the_peers_and_fails_when_no_rank_writes_a_shard(
        procs: Processes, run_id: str, tmp_path: Path) -> None:
    start_rank_tree(procs, 2, 4, run_id)
    start_rank_tree(procs, 3, 4, run_id)
    config = ActionsConfig(tmp_path / "s", layout=Layout(tp=2, dp=2, ranks_per_machine=2), backup_wait_s=1.0)
    async with serving("m1", run_id, config) as agent, JobClient([agent.address], ACT, acting=True) as client:
        request = ActionRequest("bk-1", ActionKind.BACKUP, Targets(), BackupArgs(), "alice")
        plan = (await client.plan_action(request))[agent.address]
        assert isinstance(plan, ActionPlan)
        assert {rank for rank, _ in plan.backup_peers} == {2, 3}
        assert all(peer in (0, 1) for _, peer in plan.backup_peers)  # on the other machine
        (result,) = results(await collect(client, request, Confirmation(("m1",))))
    # These ranks have no backup hook: the request file is written, no shard comes, and the result says so.
    assert json.loads((tmp_path / "s" / "backup.request").read_text())["request_id"] == "bk-1"
    assert result.state == ActionState.FAILED and "rank(s) 2 3 on m1 wrote no backup" in result.message


async def test_a_plan_slower_than_the_poll_deadline_still_arrives(
        procs: Processes, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # An agent's first plan after it (re)started imports its planning code and scans /proc: on a loaded machine
    # it took longer than the poll deadline, and every agent of the restarted job read as "no answer" (#12).
    start_rank_tree(procs, 0, 2, run_id)
    config = ActionsConfig(tmp_path / "s", layout=Layout(tp=2, ranks_per_machine=2))
    deadline_s = 1.0
    async with serving("m1", run_id, config) as agent, \
            JobClient([agent.address], ACT, acting=True, deadline_s=deadline_s) as client:
        assert agent.service is not None and agent.service.actions is not None
        planner = agent.service.actions.plan

        async def slow_plan(request: ActionRequest) -> ActionPlan:
            await asyncio.sleep(3 * deadline_s)  # the planning code of the real agent, late
            return await planner(request)

        monkeypatch.setattr(agent.service.actions, "plan", slow_plan)
        request = ActionRequest("bk-slow", ActionKind.BACKUP, Targets(), BackupArgs(), "alice")
        plan = (await client.plan_action(request))[agent.address]
    assert isinstance(plan, ActionPlan), plan
    assert plan.machines == ("m1",) and "ranks 0 " in plan.summary


# ---- the CLI: rankscope agent --state-dir --actions-config ------------------------------------


async def test_the_agent_cli_evicts_with_a_config_file(procs: Processes, run_id: str, tmp_path: Path) -> None:
    tree = start_rank_tree(procs, 0, 1, run_id)
    config = tmp_path / "actions.toml"
    config.write_text(f'state_dir = "{tmp_path / "cli-state"}"\n[eviction]\nbackend = "local"\ngrace_s = 3\n')
    tokens = tmp_path / "tokens"
    tokens.write_text(f"read:{READ}\nact:{ACT}\n")
    tokens.chmod(0o600)
    agent = procs.agent("cli-m0", "--run-id", run_id, "--actions-config", str(config), token_file=tokens)
    async with JobClient([agent.address], ACT, acting=True) as client:
        request = evict("evict-cli", "cli-m0")
        plan = (await client.plan_action(request))[agent.address]
        assert isinstance(plan, ActionPlan) and plan.processes and plan.processes[0].pid == tree.proc.pid
        (result,) = results(await collect(client, request, Confirmation(("cli-m0",), (), "evict cli-m0")))
    assert result.state == ActionState.SUCCEEDED, result.message
    assert tree.proc.wait(timeout=10) == -signal.SIGTERM
    assert [e.machine for e in Blocklist(tmp_path / "cli-state" / "blocklist.sqlite").blocked()] == ["cli-m0"]
    wait_for(lambda: "actions enabled (eviction: local" in agent.log_text(), 10, "the agent to log its actions")


def test_actions_config_errors_name_the_fix(tmp_path: Path) -> None:
    assert load_actions_config(None, None) is None
    bad = tmp_path / "a.toml"
    for text, needle in (('[eviction]\nbackend = "pbs"\n', "unknown eviction backend"),
                         ('[eviction]\nbackend = "slurm"\n[eviction.slurm]\njob = "1"\n', "unknown setting(s) job"),
                         ("[hot_update]\ncurrent = '/x'\n", "needs versions_dir"),
                         ("[eviction\n", "not valid TOML")):
        bad.write_text(text)
        with pytest.raises(RankscopeError, match=needle.replace("(", r"\(").replace(")", r"\)")):
            load_actions_config(bad, tmp_path)
    bad.write_text("[eviction]\nbackend = 'local'\n")
    with pytest.raises(RankscopeError, match="no state directory"):
        load_actions_config(bad, None)
    good = tmp_path / "a.json"
    good.write_text(json.dumps({"eviction": {"backend": "command", "command": {"script": "/opt/evict"}},
                                "layout": {"tp": 2, "pp": 2}}))
    config = load_actions_config(good, tmp_path / "st")
    assert config is not None and config.eviction.backend == "command" and config.layout == Layout(tp=2, pp=2)
    assert config.audit_path == tmp_path / "st" / "audit.sqlite"


# ---- several agents, a lost agent, a slow watcher --------------------------------------------


async def test_one_eviction_over_two_machines_goes_to_each_owner_with_its_part(
        procs: Processes, tmp_path: Path) -> None:
    run_a, run_b = f"rankscope-actions-a-{uuid.uuid4().hex[:8]}", f"rankscope-actions-b-{uuid.uuid4().hex[:8]}"
    rank0 = start_rank_tree(procs, 0, 2, run_a)
    rank1 = start_rank_tree(procs, 1, 2, run_b)
    settings = EvictionSettings(grace_s=5.0)
    async with serving("m0", run_a, ActionsConfig(tmp_path / "s0", settings)) as a0, \
            serving("m1", run_b, ActionsConfig(tmp_path / "s1", settings)) as a1, \
            JobClient([a0.address, a1.address], ACT, acting=True) as client:
        watched: list[tuple[str, AuditRecord] | AgentLost] = []
        done = asyncio.Event()

        async def watch() -> None:
            async for item in client.watch_all_audit(since=0):
                watched.append(item)
                if sum(1 for w in watched if isinstance(w, tuple) and w[1].result == "succeeded") == 2:
                    done.set()

        task = asyncio.create_task(watch())
        try:
            # named by machine (m0) and by rank (1): each agent gets only its own machine
            request = ActionRequest("evict-group", ActionKind.EVICT, Targets(("m0",), (1,)), EvictArgs("PP group 0"),
                                    "alice")
            plans = await client.plan_action(request)
            assert set(plans) == {a0.address, a1.address}, plans
            good = [p for p in plans.values() if isinstance(p, ActionPlan)]
            assert sorted(p.machines for p in good) == [("m0",), ("m1",)]
            phrase = combined_phrase(ActionKind.EVICT, good)
            assert sorted(phrase.split()[1:]) == ["m0", "m1"]
            updates = await collect(client, request, confirmation_for(good, ranks=(1,), typed=phrase))
            await asyncio.wait_for(done.wait(), 30)
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    by_agent = {u.address: u.event for u in updates if isinstance(u.event, ActionResult)}
    assert {a: r.state for a, r in by_agent.items()} == {a0.address: ActionState.SUCCEEDED,
                                                        a1.address: ActionState.SUCCEEDED}
    assert rank0.proc.wait(timeout=10) == -signal.SIGTERM and rank1.proc.wait(timeout=10) == -signal.SIGTERM
    finals = {(address, r.machines) for address, r in (w for w in watched if isinstance(w, tuple))
              if r.result == "succeeded"}
    assert finals == {(a0.address, ("m0",)), (a1.address, ("m1",))}
    # each agent's "started" line names the whole eviction (its part first): a follower of the audit logs (the
    # drill's recovery) knows when every part has ended
    starts = {(address, r.machines) for address, r in (w for w in watched if isinstance(w, tuple))
              if r.result == "started"}
    assert starts == {(a0.address, ("m0", "m1")), (a1.address, ("m1", "m0"))}


async def test_an_agent_lost_mid_action_gives_an_unknown_outcome_not_an_exception(
        procs: Processes, run_id: str, tmp_path: Path) -> None:
    start_rank_tree(procs, 0, 1, run_id, ignore_term=True)  # holds the action in its grace period
    config = tmp_path / "actions.toml"
    config.write_text("[eviction]\ngrace_s = 60\n")
    tokens = tmp_path / "tokens"
    tokens.write_text(f"act:{ACT}\n")
    tokens.chmod(0o600)
    agent = procs.agent("lost-m0", "--run-id", run_id, "--state-dir", str(tmp_path / "st"),
                        "--actions-config", str(config), token_file=tokens)
    async with JobClient([agent.address], ACT, acting=True) as client:
        request = evict("evict-lost", "lost-m0")
        await client.plan_action(request)
        updates: list[ActionUpdate] = []
        async for update in client.run_action(request, Confirmation(("lost-m0",), (), "evict lost-m0")):
            updates.append(update)
            if isinstance(update.event, ActionProgress) and "SIGTERM" in update.event.message:
                os.killpg(agent.proc.pid, signal.SIGKILL)  # the machine dies mid-action
    (result,) = results(updates)
    assert result.state == ActionState.FAILED and "outcome on" in result.message and "unknown" in result.message


async def test_a_slow_watcher_loses_nothing_and_holds_up_nobody(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rankscope.actions import agent_service

    monkeypatch.setattr(agent_service, "SUBSCRIBER_QUEUE", 2)
    service = agent_service.ActionService(ActionsConfig(tmp_path / "s"), "m0", lambda: ())
    watch = service.watch(0)
    request = evict("w0", "m0")
    first = asyncio.ensure_future(anext(watch))
    [event] = [e async for e in service.run(request, Confirmation())]  # refused: no confirmation
    assert isinstance(event, ActionResult) and event.state == ActionState.REFUSED
    assert (await asyncio.wait_for(first, 10)).action_id == "w0"
    # nobody reads while ten more actions are refused: the queue (2) overflows, the actions do not wait
    for i in range(1, 11):
        [event] = [e async for e in service.run(evict(f"w{i}", "m0"), Confirmation())]
        assert isinstance(event, ActionResult) and event.state == ActionState.REFUSED
    rest = [await asyncio.wait_for(anext(watch), 10) for _ in range(10)]
    assert [r.action_id for r in rest] == [f"w{i}" for i in range(1, 11)]
    assert [r.seq for r in rest] == list(range(2, 12))
    await watch.aclose()


async def test_the_same_id_sent_twice_at_once_runs_once_and_both_get_the_result(
        procs: Processes, run_id: str, tmp_path: Path) -> None:
    tree = start_rank_tree(procs, 0, 1, run_id, ignore_term=True)  # the grace period keeps the first one running
    state = tmp_path / "state"
    async with serving("m0", run_id, ActionsConfig(state, EvictionSettings(grace_s=1.0))) as agent:
        request = evict("evict-race", "m0")
        confirmation = Confirmation(("m0",), (), "evict m0")
        first, second = await asyncio.gather(run_raw(agent.address, ACT, request, confirmation),
                                             run_raw(agent.address, ACT, request, confirmation))
    end_first, end_second = first[-1], second[-1]
    assert isinstance(end_first, ActionResult) and isinstance(end_second, ActionResult)
    assert end_first.state == end_second.state == ActionState.SUCCEEDED
    assert sorted([end_first.replayed, end_second.replayed]) == [False, True]
    assert end_first.message == end_second.message
    assert tree.proc.wait(timeout=10) == -signal.SIGKILL
    started = [r for r in AuditLog(state / "audit.sqlite").records() if r.result == "started"]
    assert len(started) == 1


async def test_a_restarted_agent_still_replays_a_finished_action(run_id: str, tmp_path: Path) -> None:
    config = ActionsConfig(tmp_path / "state", EvictionSettings(grace_s=1.0))
    request = evict("evict-restart", "m0")
    confirmation = Confirmation(("m0",), (), "evict m0")
    async with serving("m0", run_id, config) as agent:
        first = (await run_raw(agent.address, ACT, request, confirmation))[-1]
    async with serving("m0", run_id, config) as agent:  # a new process would open the same state dir
        replies = await run_raw(agent.address, ACT, request, confirmation)
    assert len(replies) == 1, "a replay streams only the recorded result"
    again = replies[0]
    assert isinstance(first, ActionResult) and isinstance(again, ActionResult)
    assert first.state == ActionState.SUCCEEDED and "blocked" in first.message
    assert again.replayed and (again.state, again.message) == (first.state, first.message)
    assert [r.result for r in AuditLog(tmp_path / "state" / "audit.sqlite").records()].count("started") == 1


async def test_the_running_agent_applies_a_lazy_update_when_its_window_expires(run_id: str, tmp_path: Path) -> None:
    """The agent's supervisor task (every SUPERVISE_INTERVAL_S) is what applies a due lazy update, unasked."""
    _v1, v2, current = code_link_at_v1(tmp_path)
    config = ActionsConfig(tmp_path / "state", hot_update=HotUpdateSettings(current, tmp_path / "versions",
                                                                   prepared_roots=(tmp_path,)))
    async with serving("m0", run_id, config) as agent, JobClient([agent.address], ACT, acting=True) as client:
        assert agent.supervisor is not None and not agent.supervisor.done()
        lazy = ActionRequest("hu-w", ActionKind.HOT_UPDATE, Targets(),
                             HotUpdateArgs(VersionSource.DIR, str(v2), UpdateMode.LAZY, window_s=1.0), "alice")
        (pending,) = results(await collect(client, lazy, Confirmation(("m0",))))
        assert pending.state == ActionState.SUCCEEDED and "pending" in pending.message

        async def applied() -> AuditRecord:
            async for record in client.watch_all_audit(since=0):
                if isinstance(record, tuple) and record[1].action_id == "hu-w.window" and \
                        record[1].result == "succeeded":
                    return record[1]
            raise AssertionError("the audit stream ended")

        record = await asyncio.wait_for(applied(), 30)
        assert "restart requested" in record.message and os.readlink(current) == str(v2)
    assert agent.supervisor.done()  # stopped with the agent
    (entry,) = HotUpdateHistory(tmp_path / "state" / "hot_update_history.sqlite").entries()
    assert entry.state == UpdateState.APPLIED and entry.trigger == "window"
