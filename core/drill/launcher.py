"""Starts the drill's "machines" on loopback and stops every process it started.

A machine is one ``torchrun`` node (multi-node static rendezvous on
127.0.0.1, ``--max-restarts 0``) plus one rankscope agent scoped to that
node's ranks (``--launcher-pid``), on its own port. The set of machines is a
list of labels chosen per launch, node rank = position in the list, so a
restart may run the same job on a different set of machines (an eviction
swaps a label for a standby's) while the agents of surviving machines stay.

With actions on, every machine also runs the job's code from its own
hot-updatable link, ``state/<machine>/code/current``, into
``state/<machine>/code/versions`` (a worktree per version of the drill's
code repository ``code/repo``, see ``rankscope.drill.user_code``), and its
agent gets its own actions config (``state/<machine>/actions.json``) naming
that link and the warm standbys the drill would bring in. The restart path
(:meth:`Launcher.restart`) applies each machine's pending lazy hot-update
before its processes start again.

With ``warm`` on, a machine's node is not torchrun but a parked node
(``rankscope.drill.warm``): a supervisor whose interpreters have already
imported torch and the job's modules; the launcher tells it over a local
socket which ranks to become, with torchrun's environment, and they run the
worker as ``python -m`` would. Every machine and idle standby keeps one
parked node ready; one that was used is replaced by a fresh one once the
job has resumed (parking imports torch: not while the restart needs the
cores). A restart (eviction or hot-update) so costs the rendezvous and the
checkpoint load, not the imports.

Cleanup must not depend on the job behaving: torchrun starts every rank in
a session of its own, and dataloader workers and checkpoint writers hang off
the ranks. So every process started here carries a marker in its
environment (``RANKSCOPE_DRILL_RUN_ID``), inherited by all descendants, and
``stop`` kills the trees it knows of, then sweeps the process table for the
marker until nothing is left (``rankscope.drill.processes``).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rankscope.contract.errors import RankscopeError
from rankscope.drill.faults import DrillLayout, machine_name
from rankscope.drill.processes import kill_trees, signal_trees, sweep
from rankscope.drill.spawner import SPAWNER, free_port
from rankscope.drill.worker import RUN_ID_ENV, STORES_ENV, latest_checkpoint
from rankscope.wire.spawn import with_parent_death_signal
from rankscope.wire.tls import write_private

if TYPE_CHECKING:
    from rankscope.actions.config import ActionsConfig

AGENT_START_TIMEOUT_S = 30.0
# A node's log (its ranks' output): torchrun's, or a parked node's (warm restarts).
NODE_LOG_SUFFIXES = (".torchrun.log", ".warm.log")
AGENTS_AFTER_RESTART_S = 20.0  # the longest a restart's new agents wait for the job to resume before they start
PARK_AFTER_S = 300.0  # the longest a fresh parked node waits for the restarted job to resume before it starts


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
class Parked:
    """A parked node waiting for its go (``rankscope.drill.warm``): its supervisor and its socket."""

    name: str
    proc: subprocess.Popen[bytes]
    socket: Path
    log: Path
    started_mono: float


@dataclass(frozen=True, slots=True)
class WarmStart:
    """One go: the machine, its ranks' pids (the parked interpreters), whether each had finished importing."""

    name: str
    pids: tuple[int, ...]
    warm: tuple[bool, ...]
    parked_for_s: float  # how long the node had been parked when told to go


@dataclass
class Agent:
    """One machine's agent and the address it listens on."""

    name: str
    proc: subprocess.Popen[bytes]
    address: str
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
    agents: dict[str, Agent] = field(default_factory=dict)
    helpers: list[subprocess.Popen[bytes]] = field(default_factory=list)
    token_file: Path | None = None
    master_port: int = 0
    counters: bool = True  # load the CCL counter plugin in the ranks (RANKSCOPE_CCL) and point agents at its files
    actions: bool = False  # agents serve actions (state under run_dir/state/<machine>, eviction backend local)
    code: bool = True  # with actions: ranks run the drill's user code from a hot-updatable link per machine
    standbys: list[str] = field(default_factory=list)  # idle warm standbys: an agent each, no ranks
    warm: bool = False  # nodes are parked interpreters told to become ranks (rankscope.drill.warm), not torchrun
    preload: tuple[str, ...] = ()  # what parked interpreters import while they wait (default: DRILL_PRELOAD)
    parked: dict[str, Parked] = field(default_factory=dict)  # machine -> its parked node, ready for the next go
    warm_starts: list[WarmStart] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # Set by restart() once the old processes are gone: (wall clock, the step the ranks resume from).
    last_restart: tuple[float, int] | None = None

    def __post_init__(self) -> None:
        for sub in ("logs", "progress", "loss", "checkpoints", "counters"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        self._ccl_env: dict[str, str] = {}
        if self.counters:
            self._ccl_env = self._counter_env()
        self._park_lock = threading.Lock()
        self._park_requests: queue.Queue[str] = queue.Queue()
        self._parker: threading.Thread | None = None
        self._parker_stop = threading.Event()
        self._park_dir: Path | None = None
        self._park_ids = itertools.count(1)  # next() is atomic: the parker thread and a restart both park
        self._go: tuple[float, int] = (0.0, 0)  # (wall clock, start step) of the last start: parking waits for it

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

    def _popen(self, argv: Sequence[str], log: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
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
            started = self._go_nodes(labels, envs, worker)
            self.request_parks(labels)
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
            node = Node(name=label, node_rank=node_rank, proc=self._popen(argv, log, per_node), log=log)
            self.nodes[label] = node
            started.append(node)
        return started

    # ---- warm nodes (rankscope.drill.warm) ----------------------------------------

    def _go_nodes(self, labels: Sequence[str], envs: Sequence[Mapping[str, str]], worker: Sequence[str]) -> list[Node]:
        """Every machine's go at once (each waits for its parked node's answer); node rank = position in ``labels``.

        The nodes that took their go are the job's even when another failed; the first failure is raised then.
        """
        with self._park_lock:  # made once, not by each thread that parks a node of its own (a cold start)
            if self._park_dir is None:
                self._park_dir = Path(tempfile.mkdtemp(prefix="rs-park-"))
        with ThreadPoolExecutor(max_workers=len(labels), thread_name_prefix="drill-go") as pool:
            futures = [pool.submit(self._go_node, label, node_rank, env, worker)
                       for node_rank, (label, env) in enumerate(zip(labels, envs, strict=True))]
        started: list[Node] = []
        failure: RankscopeError | None = None
        for label, future in zip(labels, futures, strict=True):
            try:
                node, went = future.result()
            except RankscopeError as exc:
                failure = failure or exc
                continue
            self.nodes[label] = node
            self.warm_starts.append(went)
            started.append(node)
        if failure is not None:
            raise failure
        return started

    def _go_node(self, label: str, node_rank: int, env: Mapping[str, str],
                 worker: Sequence[str]) -> tuple[Node, WarmStart]:
        """Tell ``label``'s parked node to become node ``node_rank`` (one parked now if none is: a cold start)."""
        from rankscope.drill import warm

        with self._park_lock:
            parked = self.parked.pop(label, None)
        if parked is None or parked.proc.poll() is not None:
            parked = self._park(label)
        base = self.base_env()
        added = {k: v for k, v in env.items() if base.get(k) != v}
        per = self.layout.ranks_per_machine
        specs = []
        for local in range(per):
            rank_env = warm.rank_env(rank=node_rank * per + local, local_rank=local, world=self.layout.world,
                                     local_world=per, node_rank=node_rank, nodes=self.layout.machines,
                                     master_addr="127.0.0.1", master_port=self.master_port, run_id=self.run_id)
            specs.append(warm.RankSpec({**added, **rank_env}, ["rankscope.drill.worker", "train", *worker],
                                       module=True, cwd=str(self.run_dir)).to_json())
        deadline = time.monotonic() + AGENT_START_TIMEOUT_S
        while True:  # a node parked just now may not listen yet
            try:
                reply = warm.ask(parked.socket, {"op": "go", "ranks": specs})
                break
            except warm.WarmError as exc:
                if (not isinstance(exc, warm.NotListening) or parked.proc.poll() is not None
                        or time.monotonic() > deadline):
                    kill_trees([parked.proc.pid])
                    raise RankscopeError(f"the parked node of {label} did not take its go: {exc} ({_tail(parked.log)})",
                                         f"read {parked.log}") from exc
                time.sleep(0.05)
        went = WarmStart(label, tuple(int(p) for p in reply["pids"]), tuple(bool(w) for w in reply["warm"]),
                         time.monotonic() - parked.started_mono)
        return Node(name=label, node_rank=node_rank, proc=parked.proc, log=parked.log), went

    def _park(self, label: str) -> Parked:
        from rankscope.drill import warm

        if self._park_dir is None:  # short: a Unix socket path has at most 107 bytes
            self._park_dir = Path(tempfile.mkdtemp(prefix="rs-park-"))
        sock = self._park_dir / f"{next(self._park_ids)}.sock"
        log = self.run_dir / "logs" / f"{label}{NODE_LOG_SUFFIXES[1]}"
        argv = warm.node_argv(self.python, sock, self.layout.ranks_per_machine, self.preload or warm.DRILL_PRELOAD)
        return Parked(label, self._popen(argv, log, self.base_env()), sock, log, time.monotonic())

    def request_parks(self, labels: Sequence[str]) -> None:
        """Park a node for each of ``labels`` that has none, once the job has resumed from its last start.

        Parking imports torch: done while a restarted job loads and takes its
        first step, it would take the cores the restart is measured on. So one
        thread of the launcher waits for that and parks (through the spawner,
        like every process of the drill), and the restart is not held up.
        """
        for label in labels:
            self._park_requests.put(label)
        if self._parker is None:
            self._parker_stop.clear()
            self._parker = threading.Thread(target=self._parking, name="drill-parker", daemon=True)
            self._parker.start()

    def _parking(self) -> None:
        while not self._parker_stop.is_set():
            try:
                label = self._park_requests.get(timeout=0.5)
            except queue.Empty:
                continue
            deadline = time.monotonic() + PARK_AFTER_S
            while not self._parker_stop.is_set() and not self._resumed() and time.monotonic() < deadline:
                self._parker_stop.wait(0.5)
            with self._park_lock:
                wanted = (label in self.nodes or label in self.standbys) and not self._parker_stop.is_set()
                if wanted and (label not in self.parked or self.parked[label].proc.poll() is not None):
                    self.parked[label] = self._park(label)

    def _resumed(self) -> bool:
        """Every rank of the job has done a step since its last start (or the job is not running)."""
        from rankscope.drill.progress import stepped_past

        if not self.nodes or not all(self.nodes_alive().values()):
            return True
        since, step = self._go
        return stepped_past(self.run_dir, self.layout.world, since, step)

    def parked_ready(self, names: Sequence[str]) -> bool:
        """Every one of ``names`` has a parked node whose interpreters have finished importing."""
        from rankscope.drill import warm

        for name in names:
            with self._park_lock:
                parked = self.parked.get(name)
            if parked is None or parked.proc.poll() is not None:
                return False
            try:
                status = warm.ask(parked.socket, {"op": "status"})
            except warm.WarmError:
                return False
            if status.get("went") or None in status.get("ready", [None]):
                return False
        return True

    def wait_parked(self, names: Sequence[str], timeout_s: float) -> bool:
        """Block until :meth:`parked_ready` (True) or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while not self.parked_ready(names):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def _take_parked(self, names: Sequence[str]) -> list[Parked]:
        """The parked nodes of ``names``, no longer the launcher's (the caller stops them)."""
        with self._park_lock:
            return [self.parked.pop(n) for n in names if n in self.parked]

    def _unpark(self, names: Sequence[str]) -> None:
        gone = self._take_parked(names)
        kill_trees([p.proc.pid for p in gone])
        for p in gone:
            _reap(p.proc)

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

    # ---- the job's code (hot-update) -------------------------------------------

    @property
    def hot_updates(self) -> bool:
        return self.actions and self.code

    @property
    def code_repo(self) -> Path:
        """The drill's code repository (tags v1, v2, v3): the ``repo`` of every agent's hot-update config."""
        return self.run_dir / "code" / "repo"

    def code_link(self, name: str) -> Path:
        """The link machine ``name``'s ranks import their code from."""
        return self.state_dir(name) / "code" / "current"

    def code_versions(self, name: str) -> Path:
        return self.state_dir(name) / "code" / "versions"

    def _prepare_code(self, name: str) -> None:
        """The repository (once) and ``name``'s link, at the initial version when it has none yet."""
        from rankscope.actions.hot_update import CodeVersions
        from rankscope.drill import user_code

        user_code.make_repo(self.code_repo)
        versions = CodeVersions(self.code_link(name), self.code_versions(name), self.code_repo)
        if versions.target() is None:
            versions.switch(versions.checkout(user_code.INITIAL_VERSION))

    def _code_env(self, label: str) -> dict[str, str]:
        from rankscope.drill import user_code

        try:
            self._prepare_code(label)
        except RankscopeError as exc:
            if self.nodes:  # some nodes already run from their links: a half-set-up job must not start
                raise
            # No git here (say): the drill runs as without actions' code links, and says why.
            self.code = False
            self.notes.append(f"hot-update off on this drill: {exc.message} (fix: {exc.fix})")
            return {}
        return {user_code.CODE_ENV: str(self.code_link(label)), user_code.MACHINE_ENV: label}

    def _hot_update_config(self, name: str) -> ActionsConfig:
        from rankscope.actions.config import ActionsConfig, HotUpdateSettings

        return ActionsConfig(state_dir=self.state_dir(name),
                             hot_update=HotUpdateSettings(self.code_link(name), self.code_versions(name),
                                                          self.code_repo))

    def _updates_pending(self, machines: Sequence[str]) -> bool:
        """Whether any of ``machines`` has a lazy hot-update waiting for the next restart."""
        from rankscope.actions.history import HotUpdateHistory

        if not self.hot_updates:
            return False
        for name in machines:
            path = self._hot_update_config(name).history_path
            with contextlib.suppress(RankscopeError, OSError):
                if path.exists() and HotUpdateHistory(path).pending() is not None:
                    return True
        return False

    def apply_pending_updates(self, machines: Sequence[str]) -> list[str]:
        """Apply each machine's pending lazy hot-update, for the restart about to happen; what was done.

        ByteRobust §6.1 applies a lazy update in the recovery procedure of
        the next restart. On a cluster the agent would do it in its restart
        path; on the drill the launcher is the restart path (the agents are
        scoped to a torchrun pid, so they are stopped and started with the
        nodes), so it calls the agents' code (``apply_pending``) on each
        machine's history and link while nothing of that machine runs.
        """
        from rankscope.actions.history import UpdateState
        from rankscope.actions.hot_update import JobEvent, JobEventKind
        from rankscope.actions.procedures.update import apply_pending

        done: list[str] = []
        if not self.hot_updates:
            return done
        for name in machines:
            self._prepare_code(name)
            record = apply_pending(self._hot_update_config(name), name, JobEvent(JobEventKind.RESTART, time.time()))
            if record is not None:
                ok = record.state == UpdateState.APPLIED
                done.append(f"{name}: {'applied' if ok else 'could not apply'} pending {record.to_version.label} "
                            f"at the restart{'' if ok else ': ' + record.message}")
        self.notes.extend(done)
        return done

    def blocked_machines(self) -> frozenset[str]:
        """Every machine some agent of this drill has blocked (each agent keeps its own persistent list)."""
        from rankscope.actions.blocklist import Blocklist

        out: set[str] = set()
        for path in sorted((self.run_dir / "state").glob("*/blocklist.sqlite")):
            with contextlib.suppress(Exception):  # a list being created right now is read next time
                out.update(entry.machine for entry in Blocklist(path).blocked())
        return frozenset(out)

    def machines(self) -> tuple[str, ...]:
        """The labels of the running nodes, by node rank."""
        return tuple(n.name for n in sorted(self.nodes.values(), key=lambda n: n.node_rank))

    def stop_node(self, name: str) -> None:
        """Kill one node's torchrun and its ranks; it stays listed (dead) until the next restart."""
        node = self.nodes.get(name)
        if node is not None:
            kill_trees([node.proc.pid])
            _reap(node.proc)

    def nodes_alive(self) -> dict[str, bool]:
        return {name: n.proc.poll() is None for name, n in self.nodes.items()}

    def node_exit_codes(self) -> dict[str, int | None]:
        return {name: n.proc.poll() for name, n in self.nodes.items()}

    # ---- agents -----------------------------------------------------------

    def ensure_token(self) -> Path:
        if self.token_file is None:
            path = self.run_dir / "rankscope.token"
            write_private(path, (secrets.token_hex(16) + "\n").encode())
            self.token_file = path
        return self.token_file

    def token(self) -> str:
        return self.ensure_token().read_text().strip()

    def state_dir(self, name: str) -> Path:
        """Where the agent of machine ``name`` keeps its audit log and blocklist; it outlives the agent."""
        return self.run_dir / "state" / name

    def _agent_argv(self, name: str, port: int, port_file: Path, scope: Sequence[str]) -> list[str]:
        argv = [
            self.python, "-m", "rankscope", "agent", "--bind", "127.0.0.1", "--port", str(port),
            "--port-file", str(port_file), "--token-file", str(self.ensure_token()), "--machine-name", name, *scope,
        ]
        if self._ccl_env:
            argv += ["--counter-dir", str(self.counter_dir)]
        if self.actions:
            # Eviction backend `local` (the default): the agent stops its own ranks and blocks the machine;
            # the drill's recovery (rankscope.drill.control) restarts the job. The layout lets a backup
            # plan name each rank's peer.
            self.state_dir(name).mkdir(parents=True, exist_ok=True)
            argv += ["--state-dir", str(self.state_dir(name)), "--actions-config", str(self._actions_config(name))]
        return argv

    def _actions_config(self, name: str) -> Path:
        """Machine ``name``'s agent config, written anew at each agent start (the standby pool changes).

        One file per machine: each agent's hot-update section names its own
        machine's code link. The local eviction points at the standby list
        (:meth:`write_standbys`), so every eviction plan lists who would join.
        """
        path = self.state_dir(name) / "actions.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        layout = {"tp": self.layout.tp, "pp": self.layout.pp, "dp": self.layout.dp,
                  "ranks_per_machine": self.layout.ranks_per_machine}
        # The drill's steps take milliseconds, so the agents' requests land steps apart: about 8 on a
        # lightly loaded 2-core host, more under load. Ranks whose requests land more than one align
        # apart share no backed-up step and the restore falls back to the checkpoint; 16 leaves room.
        backup = {"align_steps": 16, "wait_s": 60}
        config: dict[str, Any] = {"eviction": {"backend": "local", "local": {"standbys_file": str(self.write_standbys())}},
                                  "layout": layout, "backup": backup}
        if self.hot_updates:
            self._prepare_code(name)
            config["hot_update"] = {"current": str(self.code_link(name)), "versions_dir": str(self.code_versions(name)),
                                    "repo": str(self.code_repo)}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(config, indent=1))
        os.replace(tmp, path)
        return path

    def write_standbys(self) -> Path:
        """``state/standbys.json``: the idle standbys not blocked, in the order the recovery takes them.

        Agents read it at each eviction plan (``[eviction.local]
        standbys_file``): the pool changes while they run (standbys are added
        after the job's agents start, and join at a recovery).
        """
        path = self.run_dir / "state" / "standbys.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        blocked = self.blocked_machines()
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps([m for m in self.standbys if m not in blocked]))
        os.replace(tmp, path)
        return path

    def start_agents(self, *, timeout_s: float = AGENT_START_TIMEOUT_S,
                     ports: Mapping[str, int] | None = None) -> dict[str, str]:
        """One agent per running node, scoped to that node's torchrun pid, and one per idle standby; name -> address.

        ``ports`` pins the port of some machines' agents (a restart keeps the
        addresses a TUI already holds); the others pick a free port.

        Raises ``RankscopeError`` (with the agent's log tail) when an agent
        does not come up; nodes already started keep running.
        """
        pending: dict[str, tuple[subprocess.Popen[bytes], Path, Path]] = {}
        wanted = {name: ["--launcher-pid", str(node.proc.pid)] for name, node in self.nodes.items()}
        # A standby runs no ranks: its agent is scoped to a run id no rank has, so it sees none of the
        # job's ranks on this shared host (on a real cluster it would be alone on its machine).
        wanted.update({name: ["--run-id", f"standby-{name}"] for name in self.standbys if name not in wanted})
        for name, scope in wanted.items():
            if name in self.agents:
                continue
            port_file = self.run_dir / "logs" / f"{name}.agent.port"
            port_file.unlink(missing_ok=True)
            log = self.run_dir / "logs" / f"{name}.agent.log"
            argv = self._agent_argv(name, (ports or {}).get(name, 0), port_file, scope)
            pending[name] = (self._popen(argv, log, self.base_env()), port_file, log)
        deadline = time.monotonic() + timeout_s
        while pending:
            for name, (proc, port_file, log) in list(pending.items()):
                port = _read_port(port_file)
                if port is not None:
                    self.agents[name] = Agent(name=name, proc=proc, address=f"127.0.0.1:{port}", log=log)
                    del pending[name]
                elif proc.poll() is not None:
                    for other, _, _ in pending.values():
                        self.helpers.append(other)
                    raise RankscopeError(
                        f"the agent of {name} exited with status {proc.returncode}: {_tail(log)}",
                        f"read {log}; check that `python -m rankscope agent --help` works in this environment",
                    )
            if pending and time.monotonic() > deadline:
                for other, _, _ in pending.values():
                    self.helpers.append(other)
                raise RankscopeError(f"agents of {', '.join(pending)} did not report a port within {timeout_s:.0f} s",
                                     f"read the agent logs in {self.run_dir / 'logs'}")
            time.sleep(0.05)
        return self.addresses()

    def start_standbys(self, names: Sequence[str], *, timeout_s: float = AGENT_START_TIMEOUT_S) -> dict[str, str]:
        """Add idle warm standbys (an agent each, no ranks) to the pool; returns every agent's address."""
        for name in names:
            if name in self.nodes or name in self.standbys:
                raise RankscopeError(f"{name} is already a machine of this drill", "give each standby its own name")
            self.standbys.append(name)
        addresses = self.start_agents(timeout_s=timeout_s)
        if self.warm:
            self.request_parks(names)
        return addresses

    def addresses(self) -> dict[str, str]:
        return {name: a.address for name, a in self.agents.items()}

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
        if self.actions:
            self.write_standbys()
        leaving = [self.agents.pop(name) for name in list(self.agents) if name not in self.standbys]
        unparked = self._take_parked([name for name in list(self.parked) if name not in machines
                                      and name not in self.standbys])
        # Agents first: an agent that saw its ranks end in this restart would take it for a failure of the job
        # and apply a pending lazy update itself (trigger "failure"), racing the launcher's own application below;
        # with such an update pending, the agents end before the nodes are stopped. Otherwise nothing waits for
        # them before it must (the new agents take their ports): their grace runs beside the nodes' stop and
        # start. A short grace: a watched agent's graceful stop waits for its open streams (the TUI's) for 2 s.
        agents_stopping = signal_trees([a.proc.pid for a in leaving], grace_s=0.5)
        if self._updates_pending(machines):
            agents_stopping.finish()
        signal_trees([n.proc.pid for n in self.nodes.values()] + [p.proc.pid for p in unparked]).finish()
        for proc in [n.proc for n in self.nodes.values()] + [p.proc for p in unparked]:
            _reap(proc)
        self.nodes.clear()
        self.last_restart = (time.time(), min((latest_checkpoint(self.run_dir, r) for r in range(self.layout.world)),
                                              default=0))
        self.apply_pending_updates(machines)  # nothing of these machines runs now: lazy updates ride on this restart
        self.start_nodes(machines, resume=resume, env=env)
        agents_stopping.finish()  # their ports are taken again by the new agents
        for proc in [a.proc for a in leaving]:
            _reap(proc)
        if not agents:
            return {}
        # The new agents start once the job has taken its first step (or AGENTS_AFTER_RESTART_S passed): their
        # interpreters, gRPC and first scans of /proc took the cores the ranks' rendezvous, load and first step
        # needed (on this shared host), as parking would (request_parks). Until then the views show them
        # restarting; a job that ends or fails at once does not hold them up (``_resumed``).
        deadline = time.monotonic() + AGENTS_AFTER_RESTART_S
        while not self._resumed() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.start_agents(ports=ports)

    # ---- helpers (noise processes etc.) -------------------------------------

    def start_helper(self, argv: Sequence[str], log_name: str, env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
        full_env = self.base_env()
        if env:
            full_env.update(env)
        proc = self._popen(argv, self.run_dir / "logs" / log_name, full_env)
        self.helpers.append(proc)
        return proc

    # ---- everything ---------------------------------------------------------

    def stop(self) -> list[int]:
        """Stop every process of this run; returns the pids the final sweep still had to kill."""
        self._parker_stop.set()
        if self._parker is not None:
            self._parker.join(timeout=30)
            self._parker = None
        self._unpark(list(self.parked))
        if self._park_dir is not None:
            shutil.rmtree(self._park_dir, ignore_errors=True)
            self._park_dir = None
        roots = [n.proc.pid for n in self.nodes.values()] + [a.proc.pid for a in self.agents.values()]
        roots += [h.pid for h in self.helpers]
        kill_trees(roots)
        for proc in [n.proc for n in self.nodes.values()] + [a.proc for a in self.agents.values()] + self.helpers:
            _reap(proc)
        self.nodes.clear()
        self.agents.clear()
        self.helpers.clear()
        return sweep(self.run_id)


def _read_port(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _tail(path: Path, lines: int = 3) -> str:
    try:
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _reap(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def node_logs(run_dir: Path) -> list[Path]:
    """Every node log of a drill's run folder, torchrun's and parked nodes' alike, by name."""
    return sorted(p for p in (run_dir / "logs").glob("*.log") if p.name.endswith(NODE_LOG_SUFFIXES))
