"""Warm parking: a parked node per machine, ready to become that machine's ranks at the next start.

A parked node (``rankscope.drill.warm``) is a supervisor whose interpreters
have already imported torch and the job's modules; told over a local socket
which ranks to become, with torchrun's environment, they run the worker as
``python -m`` would. Every machine and idle standby keeps one parked node
ready; one that was used is replaced by a fresh one once the job has resumed
(parking imports torch: not while the restart needs the cores). A restart so
costs the rendezvous and the checkpoint load, not the imports.
"""

from __future__ import annotations

import itertools
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from rankscope.contract.errors import RankscopeError
from rankscope.drill.faults import DrillLayout
from rankscope.drill.processes import kill_trees, log_tail, reap
from rankscope.drill.spawner import Start

GO_TIMEOUT_S = 30.0  # the longest a node parked just now may take to start listening for its go
PARK_AFTER_S = 300.0  # the longest a fresh parked node waits for the restarted job to resume before it starts
PARKED_LOG_SUFFIX = ".warm.log"


@dataclass
class Parked:
    """A parked node waiting for its go: its supervisor and its socket."""

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


@dataclass(frozen=True, slots=True)
class Went:
    """A parked node that took its go as node ``node_rank`` of the job."""

    node_rank: int
    parked: Parked
    start: WarmStart


class Parking:
    """The parked nodes of one drill run, and the thread that parks new ones once the job has resumed.

    ``wanted(label)``: whether ``label`` is still a machine or standby of the
    run (one that left gets no new parked node); ``resumed()``: whether the job
    has done a step since its last start (parking waits for it).
    """

    def __init__(self, run_dir: Path, layout: DrillLayout, python: str, preload: tuple[str, ...], start: Start,
                 base_env: Callable[[], dict[str, str]], wanted: Callable[[str], bool],
                 resumed: Callable[[], bool]) -> None:
        self.run_dir, self.layout, self.python, self.preload = run_dir, layout, python, preload
        self._start, self._base_env, self._wanted, self._resumed = start, base_env, wanted, resumed
        self.parked: dict[str, Parked] = {}  # machine -> its parked node, ready for the next go
        self.warm_starts: list[WarmStart] = []
        self._lock = threading.Lock()
        self._requests: queue.Queue[str] = queue.Queue()
        self._parker: threading.Thread | None = None
        self._stop = threading.Event()
        self._dir: Path | None = None
        self._ids = itertools.count(1)  # next() is atomic: the parker thread and a restart both park

    def go_all(self, labels: Sequence[str], envs: Sequence[Mapping[str, str]], worker: Sequence[str], *,
               master_port: int, run_id: str) -> tuple[list[Went], RankscopeError | None]:
        """Every machine's go at once (each waits for its parked node's answer); node rank = position in ``labels``.

        Returns the nodes that took their go (the job's even when another
        failed) and the first failure, if any.
        """
        with self._lock:  # made once, not by each thread that parks a node of its own (a cold start)
            if self._dir is None:
                self._dir = Path(tempfile.mkdtemp(prefix="rs-park-"))
        with ThreadPoolExecutor(max_workers=len(labels), thread_name_prefix="drill-go") as pool:
            # Node 0 first: its rank 0 hosts the job's store before the others get their go (``warm.host_store``:
            # a rank that asked before the store was there waited 0.5-0.66 s for torch's next try). The rest at once.
            first = pool.submit(self._go, labels[0], 0, envs[0], worker, master_port, run_id)
            wait([first])  # its outcome is taken below with the others'
            futures = [first, *(pool.submit(self._go, label, node_rank, env, worker, master_port, run_id)
                                for node_rank, (label, env) in enumerate(zip(labels, envs, strict=True))
                                if node_rank > 0)]
        went: list[Went] = []
        failure: RankscopeError | None = None
        for node_rank, future in enumerate(futures):
            try:
                parked, start = future.result()
            except RankscopeError as exc:
                failure = failure or exc
                continue
            self.warm_starts.append(start)
            went.append(Went(node_rank, parked, start))
        return went, failure

    def _go(self, label: str, node_rank: int, env: Mapping[str, str], worker: Sequence[str], master_port: int,
            run_id: str) -> tuple[Parked, WarmStart]:
        """Tell ``label``'s parked node to become node ``node_rank`` (one parked now if none is: a cold start)."""
        from rankscope.drill import warm

        with self._lock:
            parked = self.parked.pop(label, None)
        if parked is None or parked.proc.poll() is not None:
            parked = self._park(label)
        base = self._base_env()
        added = {k: v for k, v in env.items() if base.get(k) != v}
        per = self.layout.ranks_per_machine
        specs = []
        for local in range(per):
            rank = node_rank * per + local
            rank_env = warm.rank_env(rank=rank, local_rank=local, world=self.layout.world,
                                     local_world=per, node_rank=node_rank, nodes=self.layout.machines,
                                     master_addr="127.0.0.1", master_port=master_port, run_id=run_id)
            # The job's store is hosted for the ranks, by the interpreter that becomes rank 0, before it does.
            rank_env[warm.AGENT_STORE_ENV] = "True"
            specs.append(warm.RankSpec({**added, **rank_env}, ["rankscope.drill.worker", "train", *worker],
                                       module=True, cwd=str(self.run_dir),
                                       store_port=master_port if rank == 0 else 0).to_json())
        deadline = time.monotonic() + GO_TIMEOUT_S
        while True:  # a node parked just now may not listen yet
            try:
                reply = warm.ask(parked.socket, {"op": "go", "ranks": specs})
                break
            except warm.WarmError as exc:
                if (not isinstance(exc, warm.NotListening) or parked.proc.poll() is not None
                        or time.monotonic() > deadline):
                    kill_trees([parked.proc.pid])
                    raise RankscopeError(
                        f"the parked node of {label} did not take its go: {exc} ({log_tail(parked.log)})",
                        f"read {parked.log}") from exc
                time.sleep(0.05)
        return parked, WarmStart(label, tuple(int(p) for p in reply["pids"]), tuple(bool(w) for w in reply["warm"]),
                                 time.monotonic() - parked.started_mono)

    def _park(self, label: str) -> Parked:
        from rankscope.drill import warm

        if self._dir is None:  # short: a Unix socket path has at most 107 bytes
            self._dir = Path(tempfile.mkdtemp(prefix="rs-park-"))
        sock = self._dir / f"{next(self._ids)}.sock"
        log = self.run_dir / "logs" / f"{label}{PARKED_LOG_SUFFIX}"
        argv = warm.node_argv(self.python, sock, self.layout.ranks_per_machine, self.preload or warm.DRILL_PRELOAD)
        return Parked(label, self._start(argv, log, self._base_env()), sock, log, time.monotonic())

    def request(self, labels: Sequence[str]) -> None:
        """Park a node for each of ``labels`` that has none, once the job has resumed from its last start.

        Parking imports torch: done while a restarted job loads and takes its
        first step, it would take the cores the restart is measured on. So one
        thread waits for that and parks (through the spawner, like every
        process of the drill), and the restart is not held up.
        """
        for label in labels:
            self._requests.put(label)
        if self._parker is None:
            self._stop.clear()
            self._parker = threading.Thread(target=self._parking, name="drill-parker", daemon=True)
            self._parker.start()

    def _parking(self) -> None:
        while not self._stop.is_set():
            try:
                label = self._requests.get(timeout=0.5)
            except queue.Empty:
                continue
            deadline = time.monotonic() + PARK_AFTER_S
            while not self._stop.is_set() and not self._resumed() and time.monotonic() < deadline:
                self._stop.wait(0.5)
            with self._lock:
                wanted = self._wanted(label) and not self._stop.is_set()
                if wanted and (label not in self.parked or self.parked[label].proc.poll() is not None):
                    self.parked[label] = self._park(label)

    def ready(self, names: Sequence[str]) -> bool:
        """Every one of ``names`` has a parked node whose interpreters have finished importing."""
        from rankscope.drill import warm

        for name in names:
            with self._lock:
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

    def wait(self, names: Sequence[str], timeout_s: float) -> bool:
        """Block until :meth:`ready` (True) or ``timeout_s`` passed (False)."""
        deadline = time.monotonic() + timeout_s
        while not self.ready(names):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def take(self, names: Sequence[str]) -> list[Parked]:
        """The parked nodes of ``names``, no longer parking's (the caller stops them)."""
        with self._lock:
            return [self.parked.pop(n) for n in names if n in self.parked]

    def stop(self) -> None:
        """End the parking thread and every parked node."""
        self._stop.set()
        if self._parker is not None:
            self._parker.join(timeout=30)
            self._parker = None
        gone = self.take(list(self.parked))
        kill_trees([p.proc.pid for p in gone])
        for p in gone:
            reap(p.proc)
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
