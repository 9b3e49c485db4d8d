"""Attach to a Slurm job by its id: agents started inside the job's allocation.

``SlurmAgents(job_id)`` finds the job's nodes with the Slurm CLI (``scontrol
show job``), then starts one agent per node as one job step::

    srun --jobid J --overlap -N <n> --ntasks-per-node=1 -w <nodes> \\
         python -m rankscope agent --slurm-scope --announce --bind 0.0.0.0 --port 0 ...

``--overlap`` lets the step share the job's CPUs with the running training
step (without it srun waits for them forever). Each agent scopes discovery to
its job and node (``SLURM_JOB_ID``, ``SLURMD_NODENAME`` in the ranks'
environment), prints one ``RANKSCOPE_AGENT_READY`` line with its port, and is
reached at its node's ``NodeAddr``.

Secrets never touch a disk or a command line: the session's token and its TLS
certificates (a throw-away CA, made per session by ``rankscope.wire.tls``) travel
in srun's environment, which Slurm hands to the step and which only the owner
and root can read. The agents serve mutual TLS: only this client's
certificate is accepted.

Leaving the ``with`` block (normally, on Ctrl-C, SIGTERM or an error) cancels
the agent step (``scancel J.S``), waits for srun to end and kills it if it
does not. A node whose agent did not start is reported with srun's words;
the others are used.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType, TracebackType

from rankscope.contract.errors import RankscopeError
from rankscope.formats.slurm_fields import parse_fields
from rankscope.wire.spawn import with_parent_death_signal
from rankscope.wire.tls import ClientTLS, make_session

ANNOUNCE_PREFIX = "RANKSCOPE_AGENT_READY"  # rankscope.wire.agent prints it; not imported, to keep grpc out of here
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
CLI_TIMEOUT_S = 30.0
# srun's report of one task's end: "srun: error: node2: task 1: Exited with exit code 3"
TASK_FAILED = re.compile(r"srun: error: (\S+): tasks? [0-9,\-]+: (?:Exited|Killed|Terminated|Aborted)")
LEASE_S = 60.0  # the agents stop by themselves this long after their client was last heard from
FOLLOW_POLL_S = 1.0  # how often a followed job's state is read while it is requeued
FOLLOW_RETRY_S = 10.0
ACTIVE_STATES = ("RUNNING", "PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "CONFIGURING", "COMPLETING",
                 "RESIZING", "SUSPENDED")
DENIED_WORDS = ("access/permission denied", "not the owner", "permission denied", "access denied")
SLURM_FIX = "run rankscope on a login node of the cluster (where squeue and srun work), or load Slurm (module load slurm)"


def require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        raise RankscopeError(f"the Slurm command {tool!r} is not on PATH: --slurm needs the Slurm CLI", SLURM_FIX)
    return path


def run_cli(argv: Sequence[str], *, timeout_s: float = CLI_TIMEOUT_S,
            env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """One Slurm client command; a hang (a wrong SLURM_CONF makes them retry for a minute) is an error."""
    require(argv[0])
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False,
                              env=dict(env) if env is not None else None)
    except subprocess.TimeoutExpired:
        raise RankscopeError(f"`{' '.join(argv)}` did not answer within {timeout_s:g} s",
                             "is slurmctld reachable? check SLURM_CONF and `scontrol ping`") from None


def expand_nodes(nodelist: str, env: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """A Slurm hostlist (``node[1-3,7]``) -> names, as Slurm itself expands them."""
    if not nodelist or nodelist in ("(null)", "None"):
        return ()
    proc = run_cli(["scontrol", "show", "hostnames", nodelist], env=env)
    if proc.returncode != 0:
        raise RankscopeError(f"cannot expand the node list {nodelist!r}: {proc.stderr.strip()}", SLURM_FIX)
    return tuple(line.strip() for line in proc.stdout.splitlines() if line.strip())


@dataclass(frozen=True, slots=True)
class SlurmJob:
    job_id: str
    state: str
    nodes: tuple[str, ...]
    num_nodes: int
    num_tasks: int
    partition: str
    user: str
    fields: Mapping[str, str] = field(default_factory=dict, repr=False)


def job_info(job_id: str, env: Mapping[str, str] | None = None) -> SlurmJob:
    """The job as ``scontrol show job -o J`` tells it; a RankscopeError naming the fix when it cannot."""
    if not re.fullmatch(r"[0-9]+(_[0-9]+)?", job_id):
        raise RankscopeError(f"{job_id!r} is not a Slurm job id", "give the number squeue shows, e.g. --slurm 12345")
    proc = run_cli(["scontrol", "show", "job", "-o", job_id], env=env)
    if proc.returncode != 0 or not proc.stdout.strip():
        words = proc.stderr.strip() or proc.stdout.strip()
        if "invalid job id" in words.lower():
            raise RankscopeError(f"Slurm knows no job {job_id} ({words})", "check the id with squeue -u $USER")
        raise RankscopeError(f"scontrol show job {job_id} failed: {words}", SLURM_FIX)
    f = parse_fields(proc.stdout.strip().splitlines()[0])
    user = f.get("UserId", "").split("(")[0]
    return SlurmJob(job_id, f.get("JobState", "UNKNOWN"), expand_nodes(f.get("NodeList", ""), env),
                    _int(f.get("NumNodes", "0")), _int(f.get("NumTasks", "0")), f.get("Partition", ""), user, f)


def node_addresses(nodes: Sequence[str], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Each node's ``NodeAddr`` (how the controller reaches it), else its name."""
    out = {n: n for n in nodes}
    if not nodes:
        return out
    proc = run_cli(["scontrol", "show", "node", "-o", ",".join(nodes)], env=env)
    for line in proc.stdout.splitlines():
        f = parse_fields(line)
        if f.get("NodeName") in out and f.get("NodeAddr"):
            out[f["NodeName"]] = f["NodeAddr"]
    return out


def parse_announcements(line: str) -> list[tuple[str, str, str]]:
    """(machine, port, step) of every agent announcement in one line of srun's output.

    srun --unbuffered passes on each task's writes as they come, so two agents
    that announce at the same moment can share one line; each announcement is
    read on its own, never one's fields over the other's.
    """
    found: list[tuple[str, str, str]] = []
    for part in line.split(ANNOUNCE_PREFIX)[1:]:
        fields = dict(w.split("=", 1) for w in part.split() if "=" in w)
        machine, port = fields.get("machine", ""), fields.get("port", "")
        if machine and port.isascii() and port.isdigit():
            found.append((machine, port, fields.get("step", "")))
    return found


def _int(text: str) -> int:
    m = re.match(r"\d+", text)
    return int(m.group()) if m else 0


# --------------------------------------------------------------------------
# the agent step
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MissingNode:
    node: str
    reason: str


@dataclass
class SlurmAgents:
    """One agent per node of a running job, for as long as the ``with`` block lasts.

    ``follow()`` keeps it so across requeues: when the job's step of agents
    ends (a requeue ends every step) and the job runs again, on a new
    allocation, it starts agents there with the same token and certificates and
    calls ``on_change``. The agents serve under a lease (``lease_s``) that the
    client renews (``rankscope.wire.lease.KeepAlive``), and srun gets SIGTERM if
    the process that started it dies, so a killed client leaves no step behind.
    """

    job_id: str
    agent_command: Sequence[str] = (sys.executable, "-m", "rankscope", "agent")
    state_dir: str | None = None  # on each node, ``%n`` replaced by the node's name: enables actions
    extra_agent_args: Sequence[str] = ()
    start_timeout_s: float = START_TIMEOUT_S
    env: Mapping[str, str] | None = None  # the Slurm commands' environment (SLURM_CONF); default: ours
    lease_s: float = LEASE_S  # 0: agents without a lease
    # filled in by start()
    job: SlurmJob | None = None
    agents: dict[str, str] = field(default_factory=dict)  # node -> host:port
    missing: list[MissingNode] = field(default_factory=list)
    step: str | None = None
    token: str = ""
    tls: ClientTLS | None = None
    launches: int = 0  # agent steps started: 1 after start(), one more per requeue followed
    _srun: subprocess.Popen[str] | None = None
    _srun_env: dict[str, str] = field(default_factory=dict, repr=False)
    _stderr: list[str] = field(default_factory=list)
    _ready: dict[str, tuple[str, str]] = field(default_factory=dict)  # node -> (port, step)
    _addresses: dict[str, str] = field(default_factory=dict)  # node -> host, for the launch under way
    _failed: dict[str, str] = field(default_factory=dict)  # node -> srun's words about its task
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _changed: threading.Condition | None = None
    _closing: threading.Event = field(default_factory=threading.Event)
    _launch_lock: threading.Lock = field(default_factory=threading.Lock)
    _follower: threading.Thread | None = None

    def _base_env(self) -> dict[str, str]:
        return dict(self.env if self.env is not None else os.environ)

    def prepare(self) -> SlurmAgents:
        """Make the session's token and certificates (``start`` does it when not done yet).

        Done apart from ``start`` so a client can begin renewing the agents'
        lease (``ready_addresses``) while ``start`` still waits for slower nodes.
        """
        if self._srun_env:
            return self
        session = make_session()
        self.token = secrets.token_hex(24)
        self.tls = session.client_tls(mutual=True)
        env = self._base_env()
        env.update(session.server_env(mutual=True))
        env["RANKSCOPE_TOKEN"] = f"act:{self.token}"
        for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID", "SLURM_NODELIST"):
            env.pop(name, None)  # started from inside another job, srun would aim at that one
        self._srun_env = env
        self._changed = threading.Condition(self._lock)
        return self

    def start(self) -> SlurmAgents:
        require("srun")
        job = job_info(self.job_id, self.env)
        if job.state != "RUNNING":
            raise RankscopeError(f"job {self.job_id} is {job.state}, not RUNNING: its nodes have nothing to inspect",
                                 "attach once squeue shows it running (state R)")
        self.prepare()
        self._launch(job)
        return self

    def ready_addresses(self) -> list[str]:
        """Every agent heard from so far, those of a launch still waiting for other nodes included."""
        with self._lock:
            return [f"{self._addresses[node]}:{port}" for node, (port, _) in self._ready.items()
                    if node in self._addresses]

    def _argv(self, job: SlurmJob) -> list[str]:
        args = [*self.agent_command, "--slurm-scope", "--announce", "--bind", "0.0.0.0", "--port", "0"]
        if self.lease_s > 0:
            args += ["--lease", f"{self.lease_s:g}"]
        if self.state_dir:
            args += ["--state-dir", self.state_dir]
        args += list(self.extra_agent_args)
        return ["srun", "--jobid", self.job_id, "--overlap", "-N", str(len(job.nodes)), "--ntasks-per-node=1",
                "-w", ",".join(job.nodes), "--job-name", "rankscope-agent", "--kill-on-bad-exit=0",
                "--unbuffered", *args]

    def _launch(self, job: SlurmJob) -> None:
        """Start the agent step on the job's current nodes and wait for their announcements."""
        if not job.nodes:
            raise RankscopeError(f"job {self.job_id} has no nodes", "check it with scontrol show job")
        addresses = node_addresses(job.nodes, self.env)
        with self._lock:
            self._stderr, self._ready, self._failed = [], {}, {}
            self._addresses = addresses
            self.step = None
        with self._launch_lock:  # stop() takes the same lock: a step started is a step it sees and ends
            if self._closing.is_set():
                raise RankscopeError("the session is closing", "nothing to do")
            # SIGTERM to srun when the thread that starts it ends, so no step outlives a killed client (srun
            # forwards it to the agents; elsewhere the agents' lease does the same, later). No preexec_fn: a
            # requeue is followed while this client's gRPC threads are live (see rankscope.wire.spawn).
            require("srun")  # said here: through the shim, a missing srun would only be a traceback on its stderr
            proc = subprocess.Popen(with_parent_death_signal(self._argv(job)), env=self._srun_env,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            self._srun = proc
        threading.Thread(target=self._read_stdout, args=(proc,), daemon=True).start()
        threading.Thread(target=self._read_stderr, args=(proc,), daemon=True).start()
        try:
            self._wait_ready(proc, job.nodes)
        except BaseException:
            self._end(proc)
            raise
        agents: dict[str, str] = {}
        missing: list[MissingNode] = []
        for node in job.nodes:
            if node in self._ready:
                agents[node] = f"{addresses[node]}:{self._ready[node][0]}"
            else:
                missing.append(MissingNode(node, self._why_missing(node)))
        self.job, self.agents, self.missing = job, agents, missing
        self.launches += 1

    def _read_stdout(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None and self._changed is not None
        for line in proc.stdout:
            for node, port, step in parse_announcements(line):
                with self._changed:
                    self._ready[node] = (port, step)
                    self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def _read_stderr(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None and self._changed is not None
        for line in proc.stderr:
            with self._changed:
                self._stderr.append(line.rstrip())
                del self._stderr[:-40]
                failed = TASK_FAILED.search(line)
                if failed is not None:
                    self._failed.setdefault(failed.group(1), line.strip())
                self._changed.notify_all()

    def _wait_ready(self, proc: subprocess.Popen[str], nodes: Sequence[str]) -> None:
        assert self._changed is not None
        deadline = time.monotonic() + self.start_timeout_s
        with self._changed:
            while len(set(self._ready) | set(self._failed)) < len(nodes) and proc.poll() is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 0.5))
            words = " | ".join(self._stderr[-6:])
        if self._ready:
            self.step = next(iter(self._ready.values()))[1] or None
            return
        lowered = words.lower()
        if any(w in lowered for w in DENIED_WORDS):
            raise RankscopeError(f"Slurm did not allow a step in job {self.job_id}: {words}",
                                 "only the job's owner (or root/an operator) can start a step in it: run as that user")
        if "not found" in lowered and ("rankscope" in lowered or "python" in lowered or "no such file" in lowered):
            raise RankscopeError(f"the agent command does not exist on the job's nodes: {words}",
                                 "install rankscope where the nodes see it, or pass --slurm-agent-command")
        raise RankscopeError(
            f"no agent started in job {self.job_id} within {self.start_timeout_s:g} s"
            + (f": {words}" if words else ""),
            "check that rankscope is installed on the nodes (same path as here, or --slurm-agent-command) and "
            "read srun's words above")

    def _why_missing(self, node: str) -> str:
        with self._lock:
            if node in self._failed:
                own = [w for w in self._stderr if node in w or not TASK_FAILED.search(w)]
                return f"its agent ended: {' | '.join(own[-4:])}"
            words = " | ".join(self._stderr[-4:])
        return f"its agent did not start within {self.start_timeout_s:g} s" + (f" (srun: {words})" if words else "")

    # ---- following the job across requeues ---------------------------------------------------------------

    def follow(self, on_change: Callable[[SlurmAgents, str], None]) -> None:
        """From now on, re-launch the agents whenever their step ends while the job runs on (a requeue).

        ``on_change(self, what)`` is called from a background thread after each
        attempt: ``what`` says what happened in words (new agents, or why none).
        """
        self._follower = threading.Thread(target=self._follow, args=(on_change,), name="rankscope-slurm-follow",
                                          daemon=True)
        self._follower.start()

    def _follow(self, on_change: Callable[[SlurmAgents, str], None]) -> None:
        while not self._closing.is_set():
            proc = self._srun
            if proc is None:
                return
            proc.wait()  # the agent step ended: the job was requeued (or ended), or the agents died
            if self._closing.is_set():
                return
            before = self.job.nodes if self.job is not None else ()
            job = self._wait_running()
            if job is None:
                return
            if self._closing.is_set():
                return
            try:
                self._launch(job)
            except Exception as exc:  # this thread must outlive any one attempt (see below)
                # The srun this thread starts asks for SIGTERM when the *thread* that started it ends, not the
                # process: were this thread to end on an error, the agents of the next requeue it had started
                # would stop with no word (the drill's recovery thread did exactly that, #12). Say it, go on.
                if self._closing.is_set():
                    return
                why = exc.message if isinstance(exc, RankscopeError) else f"{type(exc).__name__}: {exc}"
                on_change(self, f"agents could not be started again in job {self.job_id}: {why}")
                if self._closing.wait(FOLLOW_RETRY_S):
                    return
                continue
            moved = "" if tuple(job.nodes) == tuple(before) else f" (was {','.join(before)})"
            on_change(self, f"job {self.job_id} runs again on {','.join(job.nodes)}{moved}: "
                            f"{len(self.agents)} agents started there")

    def _wait_running(self) -> SlurmJob | None:
        """The job once it runs again; None when it ended or the session closes."""
        while not self._closing.is_set():
            try:
                job = job_info(self.job_id, self.env)
            except RankscopeError:
                job = None
            if job is not None and job.state == "RUNNING":
                return job
            if job is not None and job.state not in ACTIVE_STATES:
                return None
            self._closing.wait(FOLLOW_POLL_S)
        return None

    def stop(self) -> None:
        """Cancel the agent step and make sure srun and the agents are gone."""
        self._closing.set()
        with self._launch_lock:
            proc, self._srun = self._srun, None
        if proc is not None:
            self._end(proc)
        follower = self._follower
        if follower is not None and follower is not threading.current_thread():
            follower.join(timeout=STOP_TIMEOUT_S)

    def _end(self, proc: subprocess.Popen[str]) -> None:
        """This agent step cancelled, its srun reaped."""
        if proc.poll() is None:
            if self.step and "." in self.step:
                run_cli(["scancel", self.step], env=self.env, timeout_s=STOP_TIMEOUT_S)
            else:
                proc.send_signal(signal.SIGTERM)  # srun forwards it to the agents
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=STOP_TIMEOUT_S)
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()

    def __enter__(self) -> SlurmAgents:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """While inside: SIGTERM and SIGHUP (a closed terminal or tmux pane) raise KeyboardInterrupt, so ``with``
    blocks clean up as on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, before in previous.items():
            signal.signal(sig, before)


def missing_lines(missing: Sequence[MissingNode]) -> list[str]:
    return [f"  {m.node}: NO AGENT: {m.reason}" for m in missing]
