"""Attach by Slurm job id and evict through Slurm, on a real Slurm cluster on this machine.

One cluster (node1..node3; partition ``train`` = node1,node2, ``standby`` =
node3) and one 2-node job of 8 real torch ranks (tests/jobs/tiny_torchrun_job.py,
4 per node under torchrun) serve every test here; the eviction test runs
last because it requeues the job. The suite installs slurm-wlm and munge when
they are missing and it runs as root; otherwise these tests skip, saying why.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import PY, Processes, clean_env, ctrl_c_works, make_token_file, wait_for
from hypothesis import given, settings
from hypothesis import strategies as st
from rankscope.actions.agent_protocol import ActionError, Confirmation
from rankscope.actions.audit import AuditLog
from rankscope.actions.evict_backends import SlurmBackend
from rankscope.actions.model import (
    ActionKind,
    ActionPlan,
    ActionRequest,
    ActionResult,
    ActionState,
    EvictArgs,
    Targets,
)
from rankscope.contract.bundle import bundle_to_dict, read_bundle
from rankscope.contract.errors import RankscopeError
from rankscope.drill.slurm_cluster import LocalSlurmCluster, ensure_installed
from rankscope.drill.slurm_drill import node_state
from rankscope.formats.slurm_fields import parse_fields
from rankscope.wire.agents_spec import hostfile_members
from rankscope.wire.client import JobClient, capture_once
from rankscope.wire.lease import KeepAlive
from rankscope.wire.slurm import SlurmAgents, job_info, parse_announcements
from rankscope.wire.target import slurm_target
from repo_paths import JOBS

JOB = JOBS / "tiny_torchrun_job.py"
RANKSCOPE = Path(sys.executable).parent / "rankscope"
RANKS_PER_NODE = 4
READY_TIMEOUT_S = 400.0  # eight torch ranks importing torch on a loaded 2-core machine

slurm = pytest.mark.slurm


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurmCluster]:
    why = ensure_installed()
    if why is not None:
        pytest.skip(why)
    c = LocalSlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=3, partitions={"standby": (3,)})
    with c:
        yield c


def _wait_state(cluster: LocalSlurmCluster, job_id: str, state: str, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cluster.job_field(job_id, "%T") == state:
            return True
        time.sleep(0.3)
    return False


def agent_processes() -> list[int]:
    """Running (not zombie) rankscope agents started by a --slurm session, anywhere on this machine (srun not counted)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"--slurm-scope" in cmdline and b"agent" in cmdline and not cmdline[0].endswith(b"srun") \
                and state != "Z":
            out.append(int(proc.name))
    return out


class TorchJob:
    def __init__(self, cluster: LocalSlurmCluster, folder: Path) -> None:
        self.cluster, self.folder = cluster, folder
        script = folder / "job.sh"
        # One torchrun per node, sized from Slurm's variables so a requeued (shrunk or moved) job still fits.
        script.write_text(
            "#!/bin/bash\n"
            'echo "start nodes=$SLURM_JOB_NODELIST restart=${SLURM_RESTART_COUNT:-0}"\n'
            f"rm -f {folder}/ready.*\n"
            "srun -N$SLURM_JOB_NUM_NODES -n$SLURM_JOB_NUM_NODES --ntasks-per-node=1 bash -c "
            f"'exec {PY} -m torch.distributed.run --nnodes $SLURM_JOB_NUM_NODES --nproc-per-node {RANKS_PER_NODE} "
            f"--node-rank $SLURM_NODEID --master-addr 127.0.0.1 --master-port $((20000 + SLURM_JOB_ID % 20000)) "
            f"{JOB} {folder}'\n")
        # The standby node3 is busy while the job starts, so the job gets node1 and node2 and node3 stays idle.
        blocker = cluster.sbatch("-w", "node3", "-o", "/dev/null", "--wrap", "sleep 600")
        assert _wait_state(cluster, blocker, "RUNNING", 60)
        self.id = cluster.sbatch("-N2", "--ntasks-per-node=1", "-o", str(folder / "out-%j.txt"), str(script))
        assert _wait_state(cluster, self.id, "RUNNING", 120), cluster.job_field(self.id, "%T %R")
        cluster.run("scancel", blocker)

    def ready(self) -> int:
        return len(list(self.folder.glob("ready.*")))

    def output(self) -> str:
        out = self.folder / f"out-{self.id}.txt"
        return out.read_text(errors="replace") if out.exists() else ""


@pytest.fixture(scope="module")
def torch_job(cluster: LocalSlurmCluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TorchJob]:
    job = TorchJob(cluster, tmp_path_factory.mktemp("slurm-job"))
    wait_for(lambda: job.ready() == 2 * RANKS_PER_NODE, READY_TIMEOUT_S, f"8 ranks of job {job.id}: {job.output()}")
    yield job
    (job.folder / "release").touch()
    cluster.run("scancel", job.id, check=False)


# --------------------------------------------------------------------------
# attach by job id
# --------------------------------------------------------------------------


@slurm
@pytest.mark.timeout(900)
def test_snapshot_by_job_id_gets_every_rank_with_its_stack_per_node_and_leaves_nothing(
        cluster: LocalSlurmCluster, torch_job: TorchJob, tmp_path: Path) -> None:
    bundle = tmp_path / "snap.json"
    proc = subprocess.run([str(RANKSCOPE), "snapshot", "--slurm", torch_job.id, "-o", str(bundle),
                           "--deadline", "120", "--timeout", "60", "--slurm-timeout", "180"],
                          env={**clean_env(), **cluster.env()}, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Read as rankscope reads it (bundle version 2 keeps each distinct stack once), in the expanded form.
    data = bundle_to_dict(read_bundle(bundle))
    (snap,) = data["snapshots"]
    machines = {m["machine"]: m for m in snap["machines"]}
    assert set(machines) == {"node1", "node2"}  # named after their Slurm nodes, though both are this host
    # Each agent scoped itself to its node: the two nodes share one /proc, yet each reports its own four ranks.
    assert sorted(r["rank"] for r in machines["node1"]["ranks"]) == [0, 1, 2, 3]
    assert sorted(r["rank"] for r in machines["node2"]["ranks"]) == [4, 5, 6, 7]
    for m in machines.values():
        assert len(m["stacks"]) == RANKS_PER_NODE
        for stack in m["stacks"]:
            assert "park_until_released" in json.dumps(stack["main"]["threads"]), stack["rank"]
    assert data["meta"]["slurm_job"] == torch_job.id and data["meta"]["slurm_nodes_without_agent"] == {}
    assert "stacks: 8 captured, 0 failed" in proc.stdout
    # Nothing left: no agent step in the job, no agent process on the machine; the job runs on.
    assert [s for s in cluster.steps(torch_job.id) if "rankscope" in s] == []
    assert agent_processes() == []
    assert cluster.job_field(torch_job.id, "%T") == "RUNNING"


def _announce(node: str, port: int) -> str:
    return f"RANKSCOPE_AGENT_READY machine={node} host=h port={port} step=7.1"


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.from_regex(r"node[0-9]{1,3}", fullmatch=True), st.integers(1, 65535)),
                min_size=1, max_size=5, unique_by=lambda t: t[0]),
       st.data())
def test_announcements_of_agents_that_share_one_line_of_srun_output_are_each_read_on_their_own(
        agents: list[tuple[str, int]], data: st.DataObject) -> None:
    # srun --unbuffered passes on writes as they come: a CI run once saw node1's and node2's announcements on
    # one line, and node2's fields overwrote node1's, so node1 was reported as never started.
    lines = [_announce(n, p) for n, p in agents]
    text = "".join(line + data.draw(st.sampled_from(["", " ", "\n", "\r\n"])) for line in lines)
    got = [a for line in text.splitlines() for a in parse_announcements(line)]
    assert got == [(n, str(p), "7.1") for n, p in agents]


@given(st.text(max_size=300))
def test_any_srun_output_line_parses_without_raising(text: str) -> None:
    for machine, port, _ in parse_announcements(text):
        assert machine and port.isdigit()


@slurm
@pytest.mark.timeout(600)
def test_a_node_whose_agent_fails_is_named_and_the_other_nodes_answer(
        cluster: LocalSlurmCluster, torch_job: TorchJob, tmp_path: Path) -> None:
    wrapper = tmp_path / "agent.sh"
    wrapper.write_text("#!/bin/bash\n"
                       'if [ "$SLURMD_NODENAME" = node2 ]; then echo "no GPU driver on $SLURMD_NODENAME" >&2; exit 3; fi\n'
                       f'exec {PY} -m rankscope agent "$@"\n')
    wrapper.chmod(0o755)
    with SlurmAgents(torch_job.id, agent_command=(str(wrapper),), env=cluster.env(), start_timeout_s=180) as session:
        assert set(session.agents) == {"node1"}
        (missing,) = session.missing
        assert missing.node == "node2" and "no GPU driver on node2" in missing.reason
        snap = capture_once(list(session.agents.values()), session.token, tls=session.tls, deadline_s=120,
                            timeout_s=60)
        (machine,) = snap.machines
        assert machine.reachable and sorted(r.rank for r in machine.ranks) == [0, 1, 2, 3]
    assert agent_processes() == []


@slurm
def test_clear_errors_for_a_job_that_is_not_running_unknown_or_without_slurm(
        cluster: LocalSlurmCluster, tmp_path: Path) -> None:
    held = cluster.sbatch("--hold", "-p", "standby", "-o", "/dev/null", "--wrap", "sleep 60")
    try:
        with pytest.raises(RankscopeError, match=f"job {held} is PENDING, not RUNNING") as err:
            SlurmAgents(held, env=cluster.env()).start()
        assert "squeue" in err.value.fix
    finally:
        cluster.run("scancel", held, check=False)
    with pytest.raises(RankscopeError, match="Slurm knows no job 987654"):
        job_info("987654", env=cluster.env())
    with pytest.raises(RankscopeError, match="not a Slurm job id"):
        job_info("12; rm -rf /", env=cluster.env())
    bare = {**clean_env(), "PATH": str(Path(sys.executable).parent)}  # no Slurm commands on this PATH
    proc = subprocess.run([str(RANKSCOPE), "snapshot", "--slurm", "1"], env=bare, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "is not on PATH" in proc.stderr and "login node" in proc.stderr
    assert agent_processes() == []


@slurm
@pytest.mark.timeout(600)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_interrupting_a_watch_by_job_id_stops_its_agents(
        cluster: LocalSlurmCluster, torch_job: TorchJob, sig: signal.Signals) -> None:
    proc = subprocess.Popen(ctrl_c_works([str(RANKSCOPE), "watch", "--slurm", torch_job.id, "--json",
                                          "--stack-interval", "0", "--slurm-timeout", "180"]),
                            env={**clean_env(), **cluster.env()}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        first = json.loads(proc.stdout.readline())  # printed once the agents answer
        assert first["event"] == "start" and len(first["agents"]) == 2
        assert len(agent_processes()) == 2
        proc.send_signal(sig)  # Ctrl-C, or a kill from a job scheduler
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert agent_processes() == []
    assert [s for s in cluster.steps(torch_job.id) if "rankscope" in s] == []
    assert cluster.job_field(torch_job.id, "%T") == "RUNNING"


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.from_regex(r"[A-Z][A-Za-z]{0,8}", fullmatch=True),
                       st.from_regex(r"[A-Za-z0-9_,()\[\]/.:-]{0,12}( [a-z0-9]{1,5}){0,2}", fullmatch=True),
                       min_size=1, max_size=6))
def test_scontrol_one_line_records_parse_back_into_their_fields(fields: dict[str, str]) -> None:
    line = " ".join(f"{k}={v}" for k, v in fields.items())
    assert parse_fields(line) == {k: v.strip() for k, v in fields.items()}


@given(st.text(max_size=200))
def test_any_scontrol_output_parses_without_raising(text: str) -> None:
    parsed = parse_fields(text)
    assert all("=" not in k for k in parsed)


@slurm
@pytest.mark.timeout(600)
def test_a_killed_client_leaves_no_agent_step_behind(cluster: LocalSlurmCluster, torch_job: TorchJob) -> None:
    proc = subprocess.Popen(ctrl_c_works([str(RANKSCOPE), "watch", "--slurm", torch_job.id, "--json",
                                          "--stack-interval", "0", "--slurm-timeout", "180"]),
                            env={**clean_env(), **cluster.env()}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline())["event"] == "start"
        assert len(agent_processes()) == 2
        proc.kill()  # SIGKILL: no handler runs, nothing is cancelled by the client itself
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    # srun learns its parent died (SIGTERM at the parent's death) and ends the step; the agents' lease
    # would end them too, later, had srun been lost with a whole login node.
    wait_for(lambda: not agent_processes() and not [s for s in cluster.steps(torch_job.id) if "rankscope" in s],
             300, f"the agent step of job {torch_job.id} to end ({cluster.steps(torch_job.id)})")
    assert cluster.job_field(torch_job.id, "%T") == "RUNNING"


@slurm
@pytest.mark.timeout(600)
def test_a_user_slurm_does_not_allow_into_the_job_is_told_so(
        cluster: LocalSlurmCluster, torch_job: TorchJob, tmp_path: Path) -> None:
    # The real srun, run as another user (nobody) than the job's owner (root): Slurm itself refuses the step.
    shim = tmp_path / "bin"
    shim.mkdir()
    srun = shim / "srun"
    srun.write_text(f"#!/bin/sh\nexec setpriv --reuid=65534 --regid=65534 --clear-groups {shutil.which('srun')} \"$@\"\n")
    srun.chmod(0o755)
    env = {**cluster.env(), "PATH": f"{shim}:{os.environ['PATH']}"}
    with pytest.raises(RankscopeError, match=f"Slurm did not allow a step in job {torch_job.id}: .*permission denied") \
            as err:
        SlurmAgents(torch_job.id, env=env, start_timeout_s=300).start()
    assert "job's owner" in err.value.fix
    assert agent_processes() == []


def test_an_agent_under_a_lease_lives_while_its_client_renews_it_and_stops_once_the_client_is_gone(
        tmp_path: Path) -> None:
    """The lease --slurm agents serve under: renewed by KeepAlive's token-bearing health checks, else it ends."""
    token, token_file = make_token_file(tmp_path)
    procs = Processes(tmp_path)
    try:
        agent = procs.agent("leased", "--lease", "5", token_file=token_file)
        with KeepAlive(lambda: [agent.address], token, every_s=0.25) as keep:
            # Renewed past two leases: the agent stays.
            wait_for(lambda: keep.rounds >= 40 or agent.proc.poll() is not None, 300, "forty keep-alive rounds")
            assert agent.proc.poll() is None, agent.log_text()
        # A caller without the token does not count: only the client's own calls renew the lease.
        with KeepAlive(lambda: [agent.address], "not-the-token", every_s=0.5):
            assert agent.proc.wait(timeout=300) == 0
        assert "no client called for 5 s (--lease)" in agent.log_text()
    finally:
        procs.close()


# --------------------------------------------------------------------------
# eviction through Slurm (last: it requeues the job)
# --------------------------------------------------------------------------


@slurm
def test_too_few_standbys_plan_a_shrink_and_nodes_outside_the_job_are_refused(
        cluster: LocalSlurmCluster, torch_job: TorchJob, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_CONF", str(cluster.conf))  # the backend runs scontrol as an agent in the job would
    j = torch_job.id
    # Evicting node1 and node2 together, each agent drains and excludes both: the first requeue ends the
    # other agent before it could act on its own node.
    both = SlurmBackend(job_id=j, standby_partition="standby").joined(["node1"]).plan(["node2"], "hung PP group")
    assert both.machines == ("node2",) and both.standbys == ("node3",)
    assert both.commands == (
        ("scontrol", "update", "nodename=node2,node1", "state=drain", "reason=hung PP group"),
        ("scontrol", "requeue", j),
        ("scontrol", "update", f"jobid={j}", "NumNodes=1", "NumTasks=1", "ExcNodeList=node2,node1"),
    )
    backend = SlurmBackend(job_id=j)  # no standby partition: nothing replaces node2
    plan = backend.plan(["node2"], "slow NIC")
    assert plan.commands[1:] == (("scontrol", "requeue", j),
                                 ("scontrol", "update", f"jobid={j}", "NumNodes=1", "NumTasks=1",
                                  "ExcNodeList=node2"))
    assert plan.standbys == () and "shrinks from 2 to 1 nodes" in plan.warnings[0]
    with pytest.raises(RankscopeError, match="not nodes of job"):
        backend.plan(["node3"], "r")
    assert node_state("node2", cluster.env()) in ("allocated", "mixed")  # planning changed nothing: not drained


@slurm
@pytest.mark.timeout(900)
def test_evicting_a_node_drains_it_the_job_restarts_on_a_reserved_standby_and_attach_follows_it(
        cluster: LocalSlurmCluster, torch_job: TorchJob, tmp_path: Path) -> None:
    j = torch_job.id
    # The spare: node3, held in a reservation (a job may not run there until the eviction releases it).
    cluster.run("scontrol", "create", "reservation", "ReservationName=spares", "Nodes=node3", "StartTime=now",
                "Duration=60", "Users=root")
    state = tmp_path / "state" / "%n"
    request = ActionRequest("evict-node2", ActionKind.EVICT, Targets(("node2",)),
                            EvictArgs("rankscope test: PP group hung"), "alice")
    # What `attach --slurm J` runs: agents in the job, their lease renewed, followed across the requeue.
    with slurm_target(j, env=cluster.env(), state_dir=str(state), agent_args=("--slurm-standby-reservation", "spares"),
                      start_timeout_s=180, follow=True) as target:
        assert target.hostfile is not None
        first = hostfile_members(target.hostfile)[0]
        assert sorted(first) == sorted(target.agents) and len(first) == 2

        async def evict() -> tuple[ActionPlan | ActionError, list[ActionResult]]:
            async with JobClient(target.agents, target.token, tls=target.tls, acting=True,
                                 deadline_s=120) as client:
                (plan,) = (await client.plan_action(request)).values()
                updates = [u async for u in client.run_action(request, Confirmation(("node2",), (), "evict node2"))]
            return plan, [u.event for u in updates if isinstance(u.event, ActionResult)]

        plan, results = asyncio.run(evict())
        assert isinstance(plan, ActionPlan), plan
        assert plan.commands == (
            ("scontrol", "update", "nodename=node2", "state=drain", "reason=rankscope test: PP group hung"),
            ("scontrol", "delete", "reservationname=spares"),
            ("scontrol", "requeue", j),
            ("scontrol", "update", f"jobid={j}", "ExcNodeList=node2"),
        )
        assert plan.standbys == ("node3",)
        # The agent was inside the job: the requeue ended its step, so its stream may have broken after the
        # result was recorded. The audit log on the node is the record either way.
        audit = AuditLog(Path(str(state).replace("%n", "node2")) / "audit.sqlite")
        recorded = audit.result_of("evict-node2")
        assert recorded is not None and recorded.state == ActionState.SUCCEEDED, (recorded, results)
        assert any(d == f"exit 0: scontrol requeue {j}" for d in recorded.details), recorded.details
        assert node_state("node2", cluster.env()) in ("drained", "draining")
        wait_for(lambda: cluster.job_field(j, "%T %N") == "RUNNING node[1,3]", 180,
                 f"job {j} running again on node1 and the standby node3 ({cluster.job_field(j, '%T %N %R')}; "
                 f"{cluster.run('scontrol', 'show', 'job', j).stdout})")
        wait_for(lambda: "restart=1" in torch_job.output(), 60, f"the restarted batch script: {torch_job.output()}")
        assert "start nodes=node[1,3] restart=1" in torch_job.output()
        # attach follows the job: agents started again on its new nodes, listed in the session's hostfile.
        wait_for(lambda: sorted(hostfile_members(target.hostfile)[0]) != sorted(first)  # type: ignore[arg-type]
                 and len(hostfile_members(target.hostfile)[0]) == 2, 300,  # type: ignore[arg-type]
                 "the agents of the requeued job's new allocation")
        wait_for(lambda: torch_job.ready() == 2 * RANKS_PER_NODE, READY_TIMEOUT_S, "the restarted job's 8 ranks")
        followed = hostfile_members(target.hostfile)[0]
        snap = capture_once(followed, target.token, tls=target.tls, deadline_s=120, timeout_s=60)
        by_machine = {m.machine: sorted(r.rank for r in m.ranks) for m in snap.machines}
        assert by_machine == {"node1": [0, 1, 2, 3], "node3": [4, 5, 6, 7]}
        assert len([s for s in cluster.steps(j) if "rankscope" in s]) == 1  # the new agent step, only
    assert agent_processes() == []
    assert [s for s in cluster.steps(j) if "rankscope" in s] == []
    cluster.run("scontrol", "update", "nodename=node2", "state=resume")


@slurm
def test_stopping_the_cluster_leaves_no_process_even_with_a_job_running(tmp_path: Path) -> None:
    why = ensure_installed()
    if why is not None:
        pytest.skip(why)
    c = LocalSlurmCluster(tmp_path / "c", nodes=1).start()
    job = c.sbatch("-o", str(tmp_path / "c" / "out.txt"), "--wrap", "srun sleep 600")
    assert _wait_state(c, job, "RUNNING", 60)
    wait_for(lambda: bool(c.steps(job)), 60, "the job's step")
    c.stop()
    base = str(tmp_path / "c")
    left = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            fds = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except (OSError, IndexError):
            continue
        if state != "Z" and any(f.startswith(base) for f in fds):
            left.append((proc.name, (proc / "comm").read_text().strip()))
    assert left == []
    assert subprocess.run(["pgrep", "-f", f"{base}/slurm.conf"], capture_output=True).stdout == b""


def test_following_a_requeue_survives_an_unexpected_error_in_a_relaunch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The follower thread starts srun with a parent-death signal bound to the thread: if an unexpected error ended
    it, the agents it had started would stop silently. It reports the error and starts the agents again."""
    from rankscope.wire import slurm as slurm_mod

    monkeypatch.setattr(slurm_mod, "FOLLOW_RETRY_S", 0.01)
    agents = slurm_mod.SlurmAgents("42")
    agents._srun = subprocess.Popen(["true"], text=True)  # the first agent step, ended by a requeue
    job = slurm_mod.SlurmJob("42", "RUNNING", ("n1",), 1, 1, "debug", "root")
    monkeypatch.setattr(agents, "_wait_running", lambda: job)
    attempts: list[int] = []

    def launch(j: slurm_mod.SlurmJob) -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise ValueError("a malformed announcement")
        agents._srun = subprocess.Popen(["sleep", "60"], text=True)  # agents up again until the session ends

    monkeypatch.setattr(agents, "_launch", launch)
    told: list[str] = []
    relaunched = threading.Event()

    def on_change(_: slurm_mod.SlurmAgents, what: str) -> None:
        told.append(what)
        if "runs again" in what:
            relaunched.set()

    agents.follow(on_change)
    try:
        assert relaunched.wait(60), told
        assert told[0] == "agents could not be started again in job 42: ValueError: a malformed announcement", told
        assert len(attempts) == 2 and agents._follower is not None and agents._follower.is_alive()
    finally:
        agents._closing.set()
        srun = agents._srun
        if srun is not None:
            srun.kill()
            srun.wait()
        if agents._follower is not None:
            agents._follower.join(10)
