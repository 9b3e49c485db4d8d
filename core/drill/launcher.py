"""Starts the drill's "machines" on loopback and stops every process it started.

A machine is one ``torchrun`` node (multi-node static rendezvous on
127.0.0.1, ``--max-restarts 0``) plus one rankscope agent scoped to that
node's ranks (``--launcher-pid``), on its own port. The set of machines is a
list of labels chosen per launch, node rank = position in the list, so a
restart may run the same job on a different set of machines (an eviction
swaps a label for a standby's) while the agents of surviving machines stay.

The launcher composes the run's parts, one module each: the agents
(``rankscope.drill.agents``), with actions on the job's code per machine for
hot-updates (``rankscope.drill.code_versions``; the restart path,
:meth:`Launcher.restart`, applies each machine's pending lazy hot-update
before its processes start again), and with ``warm`` on parked nodes instead
of torchrun (``rankscope.drill.parking``). Every process is started from one
thread (``rankscope.drill.spawner``).

Cleanup must not depend on the job behaving: torchrun starts every rank in
a session of its own, and dataloader workers and checkpoint writers hang off
the ranks. So every process started here carries a marker in its
environment (``RANKSCOPE_DRILL_RUN_ID``), inherited by all descendants, and
``stop`` kills the trees it knows of, then sweeps the process table for the
marker until nothing is left (``rankscope.drill.processes``).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.contract.errors import RankscopeError
from rankscope.drill.agents import AGENT_START_TIMEOUT_S, Agent, Agents
from rankscope.drill.checkpoints import STORES_ENV, latest_checkpoint
from rankscope.drill.code_versions import JobCode
from rankscope.drill.faults import DrillLayout, machine_name
from rankscope.drill.parking import PARKED_LOG_SUFFIX, Parked, Parking, WarmStart
from rankscope.drill.processes import Frozen, Stopping, freeze_forest, kill_trees, reap, signal_trees, sweep
from rankscope.drill.spawner import SPAWNER, free_port
from rankscope.drill.worker import RUN_ID_ENV
from rankscope.wire.spawn import with_parent_death_signal

# A node's log (its ranks' output): torchrun's, or a parked node's (warm restarts).
NODE_LOG_SUFFIXES = (".torchrun.log", PARKED_LOG_SUFFIX)
AGENTS_AFTER_RESTART_S = 20.0  # the longest a restart's new agents wait for the job to resume before they start
# A restart's grace before SIGKILL. Agents: a watched agent's graceful stop waits for its open streams (the TUI's)
# for 2 s. Nodes: their ranks end at SIGTERM; a parked node's supervisor gives them 2 s.
AGENT_GRACE_S = 0.5
NODE_GRACE_S = 2.0


@dataclass(frozen=True, slots=True)
class TrainingOptions:
    """The worker's flags (see ``python -m rankscope.drill.worker train --help``)."""

    steps: int = 60
    seed: int = 0
    hidden: int = 64
    layers_per_stage: int = 2
    micro_batches: int = 4
    micro_batch_size: int = 8
    loader_workers: int = 1
    checkpoint_every: int = 5
    pg_timeout_s: float = 900.0
    backend: str = "gloo"  # "nccl": ranks on GPUs (rankscope.drill.gpu)

    def worker_args(self, layout: DrillLayout, run_dir: Path, *, resume: bool) -> list[str]:
        args = [
            "--run-dir", str(run_dir), "--tp", str(layout.tp), "--pp", str(layout.pp), "--dp", str(layout.dp),
            "--machines", str(layout.machines), "--steps", str(self.steps), "--seed", str(self.seed),
            "--hidden", str(self.hidden), "--layers-per-stage", str(self.layers_per_stage),
            "--micro-batches", str(self.micro_batches), "--micro-batch-size", str(self.micro_batch_size),
            "--loader-workers", str(self.loader_workers), "--checkpoint-every", str(self.checkpoint_every),
            "--pg-timeout", str(self.pg_timeout_s),
        ]
        if self.backend != "gloo":
            args += ["--backend", self.backend]
        return [*args, "--resume"] if resume else args


@dataclass
class Node:
    """One machine's torchrun node."""

    name: str
    node_rank: int
    proc: subprocess.Popen[bytes]
    log: Path


@dataclass
class Launcher:
    """Owns every process of one drill run (nodes, agents, extra helpers)."""

    run_dir: Path
    layout: DrillLayout
    training: TrainingOptions = field(default_factory=TrainingOptions)
    run_id: str = field(default_factory=lambda: "drill-" + secrets.token_hex(6))
    extra_env: Mapping[str, str] = field(default_factory=dict)
    python: str = sys.executable
    nodes: dict[str, Node] = field(default_factory=dict)
    helpers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    master_port: int = 0
    counters: bool = True  # load the CCL counter plugin in the ranks (RANKSCOPE_CCL) and point agents at its files
    actions: bool = False  # agents serve actions (state under run_dir/state/<machine>, eviction backend local)
    code: bool = True  # with actions: ranks run the drill's user code from a hot-updatable link per machine
    standbys: list[str] = field(default_factory=list)  # idle warm standbys: an agent each, no ranks
    warm: bool = False  # nodes are parked interpreters told to become ranks (rankscope.drill.warm), not torchrun
    preload: tuple[str, ...] = ()  # what parked interpreters import while they wait (default: DRILL_PRELOAD)
    notes: list[str] = field(default_factory=list)
    # Set by restart() once the old processes are gone: (wall clock, the step the ranks resume from).
    last_restart: tuple[float, int] | None = None

    def __post_init__(self) -> None:
        for sub in ("logs", "progress", "loss", "checkpoints", "counters"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        self._ccl_env: dict[str, str] = {}
        if self.counters:
            self._ccl_env = self._counter_env()
        self._go: tuple[float, int] = (0.0, 0)  # (wall clock, start step) of the last start: parking waits for it
        # Nodes stopped without waiting (stop_node(wait=False)): the next restart or stop waits for them.
        self._stopping_nodes: list[Stopping] = []
        # The old processes a restart holds frozen until the job has resumed, with their grace (a stop ends them too).
        self._held: list[tuple[Frozen, float]] = []
        self.job_code = JobCode(self.run_dir, self.state_dir, enabled=self.actions and self.code, notes=self.notes)
        self.agent_pool = Agents(self.run_dir, self.layout, self.python, self.popen, self.base_env, self.state_dir,
                                 counter_dir=self.counter_dir if self._ccl_env else None, actions=self.actions,
                                 code=self.job_code, standbys=lambda: self.standbys, orphans=self.helpers)
        self.parking = Parking(self.run_dir, self.layout, self.python, self.preload, self.popen, self.base_env,
                               wanted=lambda label: label in self.nodes or label in self.standbys,
                               resumed=self._resumed)

    @property
    def counter_dir(self) -> Path:
        return self.run_dir / "counters"

    def _counter_env(self) -> dict[str, str]:
        """The environment that loads the CCL plugin in every rank, as ``rankscope run`` does."""
        try:
            from rankscope.ccl_plugin import autoload

            autoload.install_pth()
        except (ImportError, OSError) as exc:
            self.notes.append(f"CCL counters off: {exc}")
            return {}
        plugin = None
        if self.training.backend == "nccl":  # NCCL's profiler plugin beside the Python counters
            from rankscope.ccl_plugin.build import BuildError, build_plugin

            try:
                plugin = build_plugin()
            except BuildError as exc:
                self.notes.append(f"NCCL profiler plugin not built ({exc.message}); Python counters only. {exc.fix}")
        return autoload.ccl_env(self.counter_dir, self.run_id, plugin)

    # ---- environment ------------------------------------------------------

    def base_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self._ccl_env)
        env.update(self.extra_env)
        env[RUN_ID_ENV] = self.run_id
        env["PYTHONUNBUFFERED"] = "1"
        env["OMP_NUM_THREADS"] = "1"
        return env

    def popen(self, argv: Sequence[str], log: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        # A restart is started from a process whose gRPC client threads are live: no preexec_fn (see
        # rankscope.wire.spawn). The child is started by the spawner thread, so its parent-death signal means
        # "the drill's process ended".
        def start() -> subprocess.Popen[bytes]:
            with open(log, "ab") as out:
                return subprocess.Popen(
                    with_parent_death_signal(argv, self.python), stdin=subprocess.DEVNULL, stdout=out,
                    stderr=subprocess.STDOUT, env=dict(env), start_new_session=True, cwd=str(self.run_dir),
                )

        return SPAWNER.run(start)

    # ---- nodes ----------------------------------------------------------------

    def start_nodes(self, machines: Sequence[str] | None = None, *, resume: bool = False,
                    env: Mapping[str, str] | None = None) -> list[Node]:
        """Start one torchrun node per machine label; node rank = position in ``machines``.

        ``machines`` defaults to machine-0 .. machine-(K-1). Its length must be
        the layout's machine count; the labels may differ between launches.
        """
        labels = list(machines) if machines is not None else [machine_name(i) for i in range(self.layout.machines)]
        if len(labels) != self.layout.machines:
            raise RankscopeError(f"{len(labels)} machines given for a layout of {self.layout.machines}",
                                 "pass one machine label per node")
        if self.nodes:
            raise RankscopeError("the job is already running", "stop the run (Launcher.stop) before starting it again")
        self.master_port = free_port()
        node_env = self.base_env()
        if env:
            node_env.update(env)
        worker = self.training.worker_args(self.layout, self.run_dir, resume=resume)
        started = []
        start = min((latest_checkpoint(self.run_dir, r) for r in range(self.layout.world)), default=0)
        self._go = (time.time(), start if resume else 0)
        envs = []
        for node_rank, label in enumerate(labels):
            per_node = dict(node_env, **self._backup_env(labels, node_rank)) if self.actions else node_env
            if self.hot_updates:
                per_node = dict(per_node, **self._code_env(label))
            envs.append(per_node)
        if self.warm:
            went, failure = self.parking.go_all(labels, envs, worker, master_port=self.master_port, run_id=self.run_id)
            for go in went:  # the nodes that took their go are the job's even when another failed
                node = Node(name=go.start.name, node_rank=go.node_rank, proc=go.parked.proc, log=go.parked.log)
                self.nodes[node.name] = node
                started.append(node)
            if failure is not None:
                raise failure
            self.parking.request(labels)
            return started
        for node_rank, (label, per_node) in enumerate(zip(labels, envs, strict=True)):
            argv = [
                self.python, "-m", "torch.distributed.run",
                "--nnodes", str(self.layout.machines), "--node-rank", str(node_rank),
                "--nproc-per-node", str(self.layout.ranks_per_machine),
                "--rdzv-backend", "static", "--rdzv-id", self.run_id,
                "--master-addr", "127.0.0.1", "--master-port", str(self.master_port), "--local-addr", "127.0.0.1",
                "--max-restarts", "0", "--monitor-interval", "0.5",
                "-m", "rankscope.drill.worker", "train", *worker,
            ]
            log = self.run_dir / "logs" / f"{label}{NODE_LOG_SUFFIXES[0]}"
            node = Node(name=label, node_rank=node_rank, proc=self.popen(argv, log, per_node), log=log)
            self.nodes[label] = node
            started.append(node)
        return started

    def _resumed(self) -> bool:
        """Every rank of the job has done a step since its last start (or the job is not running)."""
        from rankscope.drill.progress import stepped_past

        if not self.nodes or not all(self.nodes_alive().values()):
            return True
        since, step = self._go
        return stepped_past(self.run_dir, self.layout.world, since, step)

    def _backup_env(self, labels: Sequence[str], node_rank: int) -> dict[str, str]:
        """Where this node's ranks find a backup request and put their shards (``rankscope.ccl_plugin.backup``).

        Each rank writes to its own machine's store and to the store of the
        machine of its backup peer (``backup_plan``, over this launch's
        placement); on resume it restores from the store of the machine it
        now runs on, else from any other machine of the job (``STORES_ENV``).
        """
        from rankscope.analyzers.backup_plan import backup_plan
        from rankscope.ccl_plugin.backup import ENV_REQUEST, ENV_TARGETS, REQUEST_FILE, SHARDS_DIR

        per = self.layout.ranks_per_machine
        stores = [str(self.state_dir(label) / SHARDS_DIR) for label in labels]
        try:
            peers = {p.rank: p.peer for p in backup_plan(self.layout.to_snapshot_layout(), self.layout.world).pairs}
        except RankscopeError as exc:
            self.notes.append(f"checkpoint backup without peers: {exc.message}")
            peers = {}
        mine = range(node_rank * per, (node_rank + 1) * per)
        targets = {str(r): [stores[node_rank]] + ([stores[peers[r] // per]] if r in peers else []) for r in mine}
        return {ENV_REQUEST: str(self.state_dir(labels[node_rank]) / REQUEST_FILE), ENV_TARGETS: json.dumps(targets),
                STORES_ENV: json.dumps(stores)}

    def machines(self) -> tuple[str, ...]:
        """The labels of the running nodes, by node rank."""
        return tuple(n.name for n in sorted(self.nodes.values(), key=lambda n: n.node_rank))

    def stop_node(self, name: str, *, wait: bool = True) -> None:
        """Kill one node's torchrun and its ranks; it stays listed (dead) until the next restart.

        ``wait=False`` signals its tree and returns: the next restart (or :meth:`stop`)
        waits for it beside the other old nodes' while the new ranks start.
        """
        node = self.nodes.get(name)
        if node is None:
            return
        # The whole tree, frozen and collected before the SIGTERM, even when nothing waits for it now: torchrun or
        # a parked node's supervisor alone would end its ranks and exit, and the ranks' own children (loader
        # workers, checkpoint writers) would be orphans no later collection of the tree could find.
        stopping = signal_trees([node.proc.pid], grace_s=NODE_GRACE_S)
        if wait:
            stopping.finish()
            reap(node.proc)
        else:
            self._stopping_nodes.append(stopping)

    def nodes_alive(self) -> dict[str, bool]:
        return {name: n.proc.poll() is None for name, n in self.nodes.items()}

    def node_exit_codes(self) -> dict[str, int | None]:
        return {name: n.proc.poll() for name, n in self.nodes.items()}

    # ---- warm parking (rankscope.drill.parking) ------------------------------------

    @property
    def parked(self) -> dict[str, Parked]:
        """Machine -> its parked node, ready for the next go."""
        return self.parking.parked

    @property
    def warm_starts(self) -> list[WarmStart]:
        return self.parking.warm_starts

    def request_parks(self, labels: Sequence[str]) -> None:
        self.parking.request(labels)

    def parked_ready(self, names: Sequence[str]) -> bool:
        return self.parking.ready(names)

    def wait_parked(self, names: Sequence[str], timeout_s: float) -> bool:
        return self.parking.wait(names, timeout_s)

    # ---- the job's code (rankscope.drill.code_versions) -------------------------------

    @property
    def hot_updates(self) -> bool:
        return self.job_code.enabled

    @property
    def code_repo(self) -> Path:
        return self.job_code.repo

    def code_link(self, name: str) -> Path:
        return self.job_code.link(name)

    def code_versions(self, name: str) -> Path:
        return self.job_code.versions(name)

    def _code_env(self, label: str) -> dict[str, str]:
        return self.job_code.env(label, running=bool(self.nodes))

    def apply_pending_updates(self, machines: Sequence[str]) -> list[str]:
        return self.job_code.apply_pending(machines)

    # ---- agents (rankscope.drill.agents) ----------------------------------------------

    @property
    def agents(self) -> dict[str, Agent]:
        return self.agent_pool.running

    def state_dir(self, name: str) -> Path:
        """Where the agent of machine ``name`` keeps its audit log and blocklist; it outlives the agent."""
        return self.run_dir / "state" / name

    def ensure_token(self) -> Path:
        return self.agent_pool.ensure_token()

    def token(self) -> str:
        return self.agent_pool.token()

    def _actions_config(self, name: str) -> Path:
        return self.agent_pool.actions_config(name)

    def write_standbys(self) -> Path:
        return self.agent_pool.write_standbys()

    def blocked_machines(self) -> frozenset[str]:
        return self.agent_pool.blocked_machines()

    def start_agents(self, *, timeout_s: float = AGENT_START_TIMEOUT_S,
                     ports: Mapping[str, int] | None = None) -> dict[str, str]:
        """One agent per running node, scoped to that node's torchrun pid, and one per idle standby; name -> address.

        ``ports`` pins the port of some machines' agents (a restart keeps the
        addresses a TUI already holds); the others pick a free port.
        """
        scopes = {name: ["--launcher-pid", str(node.proc.pid)] for name, node in self.nodes.items()}
        # A standby runs no ranks: its agent is scoped to a run id no rank has, so it sees none of the
        # job's ranks on this shared host (on a real cluster it would be alone on its machine).
        scopes.update({name: ["--run-id", f"standby-{name}"] for name in self.standbys if name not in scopes})
        return self.agent_pool.start(scopes, timeout_s=timeout_s, ports=ports)

    def start_standbys(self, names: Sequence[str], *, timeout_s: float = AGENT_START_TIMEOUT_S) -> dict[str, str]:
        """Add idle warm standbys (an agent each, no ranks) to the pool; returns every agent's address."""
        for name in names:
            if name in self.nodes or name in self.standbys:
                raise RankscopeError(f"{name} is already a machine of this drill", "give each standby its own name")
            self.standbys.append(name)
        addresses = self.start_agents(timeout_s=timeout_s)
        if self.warm:
            self.parking.request(names)
        return addresses

    def addresses(self) -> dict[str, str]:
        return self.agent_pool.addresses()

    def restart(self, machines: Sequence[str], *, resume: bool = True, env: Mapping[str, str] | None = None,
                agents: bool = True) -> dict[str, str]:
        """Run the job again on ``machines`` (e.g. after an eviction swapped one for a standby).

        The job is stopped and restarted from the newest checkpoint all ranks
        saved; in between, each machine's pending lazy hot-update is applied
        (:meth:`apply_pending_updates`). Agents are scoped to a node's torchrun pid, so each is
        restarted too: machines that stay keep their agent's address, a
        machine that left loses its agent, a new machine gets one (a standby
        that joins keeps its address and leaves the standby pool).
        """
        ports = {name: int(a.address.rsplit(":", 1)[1]) for name, a in self.agents.items() if name in machines}
        # Standbys that join leave the pool; the idle ones keep their agents as they are.
        self.standbys = [s for s in self.standbys if s not in machines]
        leaving = [self.agents.pop(name) for name in list(self.agents) if name not in self.standbys]
        unparked = self.parking.take([name for name in list(self.parked) if name not in machines
                                      and name not in self.standbys])
        old_nodes = [n.proc for n in self.nodes.values()] + [p.proc for p in unparked]
        # Every old process first, agents and nodes in one pass: frozen, none of them runs a line of Python again
        # until it is let go (and then only to end), so the checkpoints on disk are final, and the old job takes no
        # core from what follows (a hot-updated job trains at full speed until here).
        agents_frozen, nodes_frozen = freeze_forest([[a.proc.pid for a in leaving], [p.pid for p in old_nodes]])
        held = [(nodes_frozen, NODE_GRACE_S), (agents_frozen, AGENT_GRACE_S)]
        self._held.extend(held)
        self.nodes.clear()
        try:
            # An agent that saw its ranks end in this restart would take it for a failure of the job and apply a
            # pending lazy update itself (trigger "failure"), racing the launcher's own application below: with
            # such an update pending, the agents end before the nodes are let go.
            lazy_update = self.job_code.pending(machines)
            if lazy_update:
                agents_frozen.terminate(AGENT_GRACE_S).finish()
            if self.training.backend != "gloo":
                # A GPU's memory is free only once its old process is gone: the new ranks start after.
                self._finish_old(nodes_frozen.terminate(NODE_GRACE_S), old_nodes)
            self.last_restart = (time.time(), min((latest_checkpoint(self.run_dir, r)
                                                   for r in range(self.layout.world)), default=0))
            if lazy_update:  # nothing of these machines runs now: lazy updates ride on this restart
                self.apply_pending_updates(machines)
            try:
                self.start_nodes(machines, resume=resume, env=env)
            finally:
                if self.actions:  # the standbys that joined leave the pool the idle standbys' agents plan with
                    self.write_standbys()  # (after the go: it reads every machine's blocklist)
            if agents:
                # The new agents start once the job has taken its first step (or AGENTS_AFTER_RESTART_S passed):
                # their interpreters, gRPC and first scans of /proc took the cores the ranks' rendezvous, load and
                # first step needed (on this shared host), as parking would (request_parks). Until then the views
                # show them restarting; a job that ends or fails at once does not hold them up (``_resumed``).
                deadline = time.monotonic() + AGENTS_AFTER_RESTART_S
                while not self._resumed() and time.monotonic() < deadline:
                    time.sleep(0.05)
        finally:
            # The old processes are let go only now, whatever happened: their ends took the cores the new ranks'
            # rendezvous needed (a torch rank's teardown 50-70 ms of the kernel's time; an agent's graceful stop,
            # gRPC, streams and samplers, 0.3-0.5 s of CPU for six). Both graces run together; the agents' ports
            # are taken again by the new agents, so they are gone before those start.
            nodes_stopping, agents_stopping = (frozen.terminate(grace) for frozen, grace in held)
            self._finish_old(nodes_stopping, old_nodes)
            agents_stopping.finish()
            for item in held:
                self._held.remove(item)
            for proc in [a.proc for a in leaving]:
                reap(proc)
        if not agents:
            return {}
        return self.start_agents(ports=ports)

    # ---- helpers (noise processes etc.) -------------------------------------

    def start_helper(self, argv: Sequence[str], log_name: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        full_env = self.base_env()
        if env:
            full_env.update(env)
        proc = self.popen(argv, self.run_dir / "logs" / log_name, full_env)
        self.helpers.append(proc)
        return proc

    # ---- everything ---------------------------------------------------------

    def _finish_old(self, stopping: Stopping, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        """Wait for a restart's old nodes to be gone (those stopped before it too), and collect them."""
        stopping.finish()
        while self._stopping_nodes:
            self._stopping_nodes.pop().finish()
        for proc in procs:
            reap(proc)

    def stop(self) -> list[int]:
        """Stop every process of this run; returns the pids the final sweep still had to kill."""
        self.parking.stop()
        roots = [n.proc.pid for n in self.nodes.values()] + [a.proc.pid for a in self.agents.values()]
        roots += [h.pid for h in self.helpers]
        kill_trees(roots)
        for frozen, grace in list(self._held):  # a restart in another thread holds them: they end now
            frozen.terminate(grace).finish()
        while self._stopping_nodes:
            self._stopping_nodes.pop().finish()
        for proc in [n.proc for n in self.nodes.values()] + [a.proc for a in self.agents.values()] + self.helpers:
            reap(proc)
        self.nodes.clear()
        self.agents.clear()
        self.helpers.clear()
        missed: list[str] = []
        left = sweep(self.run_id, found=missed)
        if missed:
            self.notes.append(f"the stop missed {len(missed)} process(es), killed by the final sweep: "
                              + "; ".join(missed))
        return left


def node_logs(run_dir: Path) -> list[Path]:
    """Every node log of a drill's run folder, torchrun's and parked nodes' alike, by name."""
    return sorted(p for p in (run_dir / "logs").glob("*.log") if p.name.endswith(NODE_LOG_SUFFIXES))
