"""The drill on Slurm: the README's incident (hang -> `e` -> drain, requeue, resume) on a real Slurm cluster.

``run_slurm_drill`` starts a local multi-node Slurm cluster
(``rankscope.drill.slurm_cluster``: one slurmd per node on this host, plus idle
standby nodes in a ``standby`` partition), or uses the one ``SLURM_CONF``
names, and runs the drill's training job as one ``sbatch``: one torchrun per
node (``srun -N$SLURM_JOB_NUM_NODES``), node rank ``$SLURM_NODEID``. The
injected fault rides in the job's environment only for its first run; a
requeued run (``SLURM_RESTART_COUNT`` > 0) starts with ``--resume`` and no fault.

Then what an on-call engineer does with ``rankscope attach --slurm J``, minus
the keyboard: wait until progress stops, start the agents inside the job
(``rankscope.wire.slurm.SlurmAgents``: TLS, a session token), capture, let the
analyzers name the suspect machines, plan and confirm their eviction (what
`e` sends), and watch Slurm drain them, requeue the job and restart it on
the remaining nodes plus standbys, until every rank has trained past the step
it resumed from (the checkpoint, or the in-memory backup when newer).
Everything it started is stopped at the end, also on failure and Ctrl-C.
"""

from __future__ import annotations

import os
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rankscope.contract.errors import RankscopeError
from rankscope.drill.faults import FAULT_ENV, DrillLayout, FaultPlan, ground_truth
from rankscope.drill.launcher import TrainingOptions
from rankscope.drill.progress import read_progress, stepped_past
from rankscope.drill.spawner import free_port
from rankscope.drill.worker import RUN_ID_ENV
from rankscope.wire.sync_loop import run_sync

STANDBY_PARTITION = "standby"
POLL_S = 0.5


@dataclass(frozen=True, slots=True)
class SlurmDrillConfig:
    layout: DrillLayout
    plan: FaultPlan
    training: TrainingOptions
    run_dir: Path | None = None
    standbys: int = 2  # idle standby nodes of the local cluster (its ``standby`` partition)
    standby_partition: str = STANDBY_PARTITION
    stall_seconds: float = 5.0
    start_timeout_s: float = 600.0
    stall_timeout_s: float = 300.0
    restart_timeout_s: float = 600.0
    capture_timeout_s: float = 20.0


def batch_script(config: SlurmDrillConfig, run_dir: Path, port: int) -> str:
    """The job: one torchrun per node, resumed and without the fault when Slurm restarts it."""
    layout, training = config.layout, config.training
    worker = shlex.join(training.worker_args(layout, run_dir, resume=False))
    torchrun = (f"exec {shlex.quote(sys.executable)} -m torch.distributed.run --nnodes $SLURM_JOB_NUM_NODES "
                f"--node-rank $SLURM_NODEID --nproc-per-node {layout.ranks_per_machine} --rdzv-backend static "
                f"--master-addr 127.0.0.1 --master-port $PORT --max-restarts 0 "
                f"-m rankscope.drill.worker train {worker} $RESUME")
    return "\n".join([
        "#!/bin/bash",
        'echo "rankscope drill: start on $SLURM_JOB_NODELIST, restart ${SLURM_RESTART_COUNT:-0}"',
        'RESUME=""',
        f"PORT=$(( {port} + ${{SLURM_RESTART_COUNT:-0}} ))",
        'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then RESUME="--resume"; unset ' + FAULT_ENV + "; fi",
        "export PORT RESUME",
        f"srun -N$SLURM_JOB_NUM_NODES -n$SLURM_JOB_NUM_NODES --ntasks-per-node=1 bash -c {shlex.quote(torchrun)}",
        "",
    ])


def _wait(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(POLL_S)
    raise RankscopeError(f"the Slurm drill timed out after {timeout_s:g} s waiting for {what}",
                         "the machine may be overloaded: raise --start-timeout/--stall-timeout, or read the run dir")


@dataclass
class SlurmDrillJob:
    """The drill's cluster (or the one SLURM_CONF names) and its training job, while the ``with`` block lasts."""

    config: SlurmDrillConfig
    say: Callable[[str], None]
    run_dir: Path = Path()
    env: dict[str, str] | None = None
    job: str = ""
    report: dict[str, Any] | None = None
    _cluster: Any = None

    def __enter__(self) -> SlurmDrillJob:
        config, layout = self.config, self.config.layout
        self.run_dir = config.run_dir or Path(tempfile.mkdtemp(prefix="rankscope-slurm-drill-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ)
        self.report = {"launcher": "slurm", "run_dir": str(self.run_dir), "fault": config.plan.name,
                       "world": layout.world}
        try:
            if os.environ.get("SLURM_CONF") is None:
                from rankscope.drill.slurm_cluster import LocalSlurmCluster

                nodes = layout.machines + config.standbys
                standby_numbers = tuple(range(layout.machines + 1, nodes + 1))
                self._cluster = LocalSlurmCluster(
                    self.run_dir / "slurm", nodes=nodes,
                    partitions={config.standby_partition: standby_numbers} if standby_numbers else {})
                self._cluster.start()
                self.env = self._cluster.env()
                self.say(f"local Slurm cluster: {nodes} nodes ({config.standbys} standby) under "
                         f"{self.run_dir / 'slurm'}")
            self.report["slurm_conf"] = self.env.get("SLURM_CONF")
            self.job = _submit(config, self.run_dir, self.env, self._cluster)
            self.report["job"] = self.job
            self.say(f"job {self.job}: {layout.world} ranks on {layout.machines} nodes, fault {config.plan.name}")
            _wait(lambda: _all_at(self.run_dir, layout.world, 1), config.start_timeout_s, "every rank's first step")
            self.report["nodes"] = list(_job_nodes(self.job, self.env))
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.job:
            from rankscope.wire.slurm import run_cli

            run_cli(["scancel", self.job], env=self.env, timeout_s=30)
        if self._cluster is not None:
            self._cluster.stop()

    def agent_args(self) -> tuple[str, ...]:
        counters = ("--counter-dir", str(self.run_dir / "counters"))
        if self.config.standbys:
            return (*counters, "--slurm-standby-partition", self.config.standby_partition)
        return counters

    def state_dir(self) -> str:
        return str(self.run_dir / "state" / "%n")


def run_slurm_drill(config: SlurmDrillConfig, on_event: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The whole incident on Slurm, headless; returns the report (``rankscope drill --launcher slurm --json``)."""
    say = on_event or (lambda _m: None)
    with SlurmDrillJob(config, say) as d:
        assert d.report is not None and d.env is not None
        report, env, job, run_dir, world = d.report, d.env, d.job, d.run_dir, config.layout.world
        stall_step = _wait_stalled(run_dir, world, config)
        report["stalled_at_steps"] = stall_step
        say(f"progress stopped at steps {stall_step}")
        report.update(_attach_and_evict(config, d))
        say(f"evicted {' '.join(report['evicted'])}; waiting for Slurm to restart job {job}")
        requeued_wall = report["evicted_wall"]
        _wait(lambda: _state(job, env).startswith("RUNNING") and set(_job_nodes(job, env)).isdisjoint(
            report["evicted"]), config.restart_timeout_s, f"job {job} running again without the evicted nodes")
        report["restarted_on"] = list(_job_nodes(job, env))
        report["drained"] = {n: node_state(n, env) for n in report["evicted"]}
        hung_at = max(stall_step.values()) if stall_step else 0
        _wait(lambda: stepped_past(run_dir, world, requeued_wall, hung_at), config.restart_timeout_s,
              f"every rank of the restarted job to train past step {hung_at}, where it hung")
        progress = read_progress(run_dir)
        report["resumed"] = True
        report["resumed_steps"] = {r: p.step for r, p in sorted(progress.items())}
        report["resumed_from"] = _resume_lines(run_dir)
        say(f"job {job} resumed on {' '.join(report['restarted_on'])}: {report['resumed_from'] or 'see logs'}")
        return report


def run_slurm_drill_attached(config: SlurmDrillConfig, on_event: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The incident on Slurm with the TUI attached by job id, as `rankscope attach --slurm J` would.

    The person at the keyboard sees the hang, presses `e`: the suspect nodes
    are drained and the job requeued; the agents follow the job to its new
    nodes and the TUI shows it resume. When the TUI quits the job is
    cancelled and the cluster stopped; the report says what Slurm did.
    """
    from rankscope.tui.app import AppOptions, AttachOptions, run_attach
    from rankscope.wire.target import slurm_target

    say = on_event or (lambda _m: None)
    with SlurmDrillJob(config, say) as d:
        assert d.report is not None and d.env is not None
        say(f"attaching to job {d.job} with --slurm (agents inside the job, TLS) ...")
        with slurm_target(d.job, env=d.env, state_dir=d.state_dir(), agent_args=d.agent_args(), follow=True,
                          start_timeout_s=config.capture_timeout_s * 6) as target:
            started = time.time()
            code = run_attach(target.agents, target.token,
                              AppOptions(layout=config.layout.to_snapshot_layout(), hang_after_s=config.stall_seconds),
                              AttachOptions(tls=target.tls, hostfile=target.hostfile))
        report = d.report
        report["tui_exit"] = int(code or 0)
        info_nodes = _job_nodes(d.job, d.env) if _state(d.job, d.env).startswith("RUNNING") else ()
        report["now_on"] = list(info_nodes)
        report["restarts"] = _restarts(d.job, d.env)
        drained = [n for n in report["nodes"] if node_state(n, d.env).startswith("drain")]
        report["drained"] = drained
        progress = read_progress(d.run_dir)
        report["steps"] = {r: p.step for r, p in sorted(progress.items()) if p.wall >= started}
        report["resumed_from"] = _resume_lines(d.run_dir)
        return report


def _submit(config: SlurmDrillConfig, run_dir: Path, env: dict[str, str], cluster: Any) -> str:
    from rankscope.wire.slurm import run_cli

    script = run_dir / "drill-job.sh"
    script.write_text(batch_script(config, run_dir, free_port()), encoding="utf-8")
    job_env = dict(env, **{RUN_ID_ENV: "slurm-drill", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"})
    job_env.update(_counter_env(run_dir))
    if config.plan.name != "none":
        job_env[FAULT_ENV] = config.plan.to_env()
    blockers: list[str] = []
    if cluster is not None and config.standbys:
        # The standbys are busy while the job starts, so it lands on the others and they stay the idle spares.
        nodes = ",".join(f"node{i}" for i in range(config.layout.machines + 1,
                                                   config.layout.machines + config.standbys + 1))
        blockers.append(cluster.sbatch("-w", nodes, "-N", str(config.standbys), "-o", "/dev/null",
                                       "--wrap", "sleep 3600"))
        _wait(lambda: _state(blockers[0], env).startswith("RUNNING"), 60, "the standby placeholder job")
    proc = run_cli(["sbatch", "--parsable", "-N", str(config.layout.machines), "--ntasks-per-node=1",
                    "-o", str(run_dir / "job-%j.out"), "--open-mode=append", "--chdir", str(run_dir), str(script)],
                   env=job_env)
    if proc.returncode != 0:
        raise RankscopeError(f"sbatch failed: {proc.stderr.strip()}", "check the cluster with sinfo")
    job = proc.stdout.strip().split(";")[0]
    _wait(lambda: _state(job, env).startswith("RUNNING"), 120, f"job {job} to start")
    for b in blockers:
        run_cli(["scancel", b], env=env)
    return job


def _counter_env(run_dir: Path) -> dict[str, str]:
    """The CCL counter plugin in every rank, as ``rankscope run`` and the local drill load it ({} without it)."""
    try:
        from rankscope.ccl_plugin import autoload

        autoload.install_pth()
        return autoload.ccl_env(run_dir / "counters", "slurm-drill")
    except (ImportError, OSError):
        return {}


def _state(job: str, env: dict[str, str]) -> str:
    from rankscope.wire.slurm import run_cli

    return run_cli(["squeue", "-h", "-j", job, "-o", "%T"], env=env).stdout.strip()


def _job_nodes(job: str, env: dict[str, str]) -> tuple[str, ...]:
    from rankscope.wire.slurm import job_info

    return job_info(job, env).nodes


def _restarts(job: str, env: dict[str, str]) -> int:
    from rankscope.wire.slurm import job_info

    return int(job_info(job, env).fields.get("Restarts", "0") or 0)


def node_state(node: str, env: dict[str, str]) -> str:
    """What Slurm says of ``node`` now (sinfo %T: idle, allocated, drained, ...)."""
    from rankscope.wire.slurm import run_cli

    return run_cli(["sinfo", "-h", "-n", node, "-o", "%T"], env=env).stdout.strip()


def _all_at(run_dir: Path, world: int, step: int) -> bool:
    progress = read_progress(run_dir)
    return len(progress) >= world and all(p.step >= step for r, p in progress.items() if r < world)


def _wait_stalled(run_dir: Path, world: int, config: SlurmDrillConfig) -> dict[int, int]:
    """Until no rank advanced for ``stall_seconds`` (a hang); the steps then."""
    last: dict[int, int] = {}
    moved = time.monotonic()
    deadline = moved + config.stall_timeout_s
    while time.monotonic() < deadline:
        steps = {r: p.step for r, p in read_progress(run_dir).items() if r < world}
        if steps != last:
            last, moved = steps, time.monotonic()
        elif len(steps) == world and time.monotonic() - moved >= config.stall_seconds:
            return steps
        time.sleep(POLL_S)
    raise RankscopeError(f"progress did not stop within {config.stall_timeout_s:g} s", "use a hang fault (hang-p2p)")


def _attach_and_evict(config: SlurmDrillConfig, d: SlurmDrillJob) -> dict[str, Any]:
    """What `rankscope attach --slurm J` and `e` do: capture, name the suspect machines, evict them."""
    from rankscope.drill.control import evict_machines
    from rankscope.wire.client import capture_once
    from rankscope.wire.target import slurm_target

    out: dict[str, Any] = {}
    run_dir = d.run_dir
    with slurm_target(d.job, env=d.env, state_dir=d.state_dir(), agent_args=d.agent_args(),
                      start_timeout_s=config.capture_timeout_s * 6) as session:
        agents = session.agents
        snap = capture_once(agents, session.token, tls=session.tls, deadline_s=120, timeout_s=config.capture_timeout_s)
        out["captured_ranks"] = len(snap.rank_to_machine())
        out["agents_missing"] = [m.node for m in session.missing]
        from rankscope.analyzers.analysis import analyze_snapshot

        verdict = analyze_snapshot(snap, config.layout.to_snapshot_layout())
        top = verdict.top
        if top is None:
            raise RankscopeError(f"the analyzers named no suspect: {verdict.summary}", "read the captured stacks")
        out["verdict"] = verdict.summary
        out["suspect_ranks"] = list(top.ranks)
        truth = ground_truth(config.plan, config.layout)
        out["truth_ranks"] = list(truth.suspect_ranks)
        machines = tuple(top.machines)
        out["evicted"] = list(machines)
        out["evicted_wall"] = time.time()
        results = run_sync(evict_machines(agents, session.token or "", machines,
                                          f"rankscope drill: {verdict.summary}"[:200], tls=session.tls))
        out["eviction_results"] = [r.message for r in results]
    # The requeue ended the agent step: the audit logs on the nodes are the record.
    from rankscope.actions.audit import AuditLog

    out["audit"] = {}
    for node in machines:
        path = run_dir / "state" / node / "audit.sqlite"
        if path.exists():
            records = AuditLog(path).records()
            out["audit"][node] = [f"{r.result}: {r.message}" for r in records][-2:]
    return out


def _resume_lines(run_dir: Path) -> list[str]:
    """What the restarted ranks said about where they resumed (checkpoint or backup)."""
    lines: list[str] = []
    for log in sorted((run_dir / "logs").glob("*.log")) if (run_dir / "logs").is_dir() else []:
        lines += [line.strip() for line in log.read_text(errors="replace").splitlines() if "resum" in line.lower()]
    for out in sorted(run_dir.glob("job-*.out")):
        lines += [line.strip() for line in out.read_text(errors="replace").splitlines()
                  if "restor" in line.lower() or "resum" in line.lower() or "rankscope drill: start" in line]
    return lines[-4:]
