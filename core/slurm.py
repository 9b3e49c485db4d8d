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
certificates (a throw-away CA, made per session by ``rankscope.tls``) travel
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
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType, TracebackType

from rankscope.errors import RankscopeError
from rankscope.tls import ClientTLS, make_session

ANNOUNCE_PREFIX = "RANKSCOPE_AGENT_READY"  # rankscope.agent prints it; not imported, to keep grpc out of here
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
CLI_TIMEOUT_S = 30.0
# srun's report of one task's end: "srun: error: node2: task 1: Exited with exit code 3"
TASK_FAILED = re.compile(r"srun: error: (\S+): tasks? [0-9,\-]+: (?:Exited|Killed|Terminated|Aborted)")
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


def parse_fields(text: str) -> dict[str, str]:
    """``scontrol show -o`` output (``Key=Value Key2=Value two ...``) -> a dict.

    A value may contain spaces (``Command=``, ``Reason=``): it runs up to the
    next `` Key=``. Keys repeat in a few records; the first one wins.
    """
    out: dict[str, str] = {}
    matches = list(re.finditer(r"(?:^|\s)([A-Za-z][A-Za-z0-9_:/]*)=", text))
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        out.setdefault(m.group(1), text[m.end():end].strip())
    return out


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
    """One agent per node of a running job, for as long as the ``with`` block lasts."""

    job_id: str
    agent_command: Sequence[str] = (sys.executable, "-m", "rankscope", "agent")
    state_dir: str | None = None  # on each node, ``%n`` replaced by the node's name: enables actions
    extra_agent_args: Sequence[str] = ()
    start_timeout_s: float = START_TIMEOUT_S
    env: Mapping[str, str] | None = None  # the Slurm commands' environment (SLURM_CONF); default: ours
    # filled in by start()
    job: SlurmJob | None = None
    agents: dict[str, str] = field(default_factory=dict)  # node -> host:port
    missing: list[MissingNode] = field(default_factory=list)
    step: str | None = None
    token: str = ""
    tls: ClientTLS | None = None
    _srun: subprocess.Popen[str] | None = None
    _stderr: list[str] = field(default_factory=list)
    _ready: dict[str, tuple[str, str]] = field(default_factory=dict)  # node -> (port, step)
    _failed: dict[str, str] = field(default_factory=dict)  # node -> srun's words about its task
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _changed: threading.Condition | None = None

    def _base_env(self) -> dict[str, str]:
        return dict(self.env if self.env is not None else os.environ)

    def start(self) -> SlurmAgents:
        require("srun")
        job = self.job = job_info(self.job_id, self.env)
        if job.state != "RUNNING":
            raise RankscopeError(f"job {self.job_id} is {job.state}, not RUNNING: its nodes have nothing to inspect",
                                 "attach once squeue shows it running (state R)")
        if not job.nodes:
            raise RankscopeError(f"job {self.job_id} has no nodes", "check it with scontrol show job")
        addresses = node_addresses(job.nodes, self.env)
        session = make_session()
        self.token = secrets.token_hex(24)
        self.tls = session.client_tls(mutual=True)
        env = self._base_env()
        env.update(session.server_env(mutual=True))
        env["RANKSCOPE_TOKEN"] = f"act:{self.token}"
        for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_STEP_ID", "SLURM_NODELIST"):
            env.pop(name, None)  # started from inside another job, srun would aim at that one
        args = [*self.agent_command, "--slurm-scope", "--announce", "--bind", "0.0.0.0", "--port", "0"]
        if self.state_dir:
            args += ["--state-dir", self.state_dir]
        args += list(self.extra_agent_args)
        argv = ["srun", "--jobid", self.job_id, "--overlap", "-N", str(len(job.nodes)), "--ntasks-per-node=1",
                "-w", ",".join(job.nodes), "--job-name", "rankscope-agent", "--kill-on-bad-exit=0",
                "--unbuffered", *args]
        self._changed = threading.Condition(self._lock)
        self._srun = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()
        try:
            self._wait_ready(job.nodes)
        except BaseException:
            self.stop()
            raise
        for node in job.nodes:
            if node in self._ready:
                self.agents[node] = f"{addresses[node]}:{self._ready[node][0]}"
            else:
                self.missing.append(MissingNode(node, self._why_missing(node)))
        return self

    def _read_stdout(self) -> None:
        assert self._srun is not None and self._srun.stdout is not None and self._changed is not None
        for line in self._srun.stdout:
            if ANNOUNCE_PREFIX not in line:
                continue
            f = dict(w.split("=", 1) for w in line.split(ANNOUNCE_PREFIX, 1)[1].split() if "=" in w)
            if "machine" in f and "port" in f:
                with self._changed:
                    self._ready[f["machine"]] = (f["port"], f.get("step", ""))
                    self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def _read_stderr(self) -> None:
        assert self._srun is not None and self._srun.stderr is not None and self._changed is not None
        for line in self._srun.stderr:
            with self._changed:
                self._stderr.append(line.rstrip())
                del self._stderr[:-40]
                failed = TASK_FAILED.search(line)
                if failed is not None:
                    self._failed.setdefault(failed.group(1), line.strip())
                self._changed.notify_all()

    def _wait_ready(self, nodes: Sequence[str]) -> None:
        assert self._srun is not None and self._changed is not None
        deadline = time.monotonic() + self.start_timeout_s
        with self._changed:
            while len(set(self._ready) | set(self._failed)) < len(nodes) and self._srun.poll() is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(min(left, 0.5))
            words = " | ".join(self._stderr[-6:])
        if self._ready:
            self.step = next(iter(self._ready.values()))[1] or None
            return
        lowered = words.lower()
        if "access/permission denied" in lowered or "not the owner" in lowered or "permission denied" in lowered:
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

    def stop(self) -> None:
        """Cancel the agent step and make sure srun and the agents are gone."""
        proc, self._srun = self._srun, None
        if proc is None:
            return
        if self.step and "." in self.step:
            run_cli(["scancel", self.step], env=self.env, timeout_s=STOP_TIMEOUT_S)
        elif proc.poll() is None:
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
    """While inside: SIGTERM raises KeyboardInterrupt, so ``with`` blocks clean up as on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def missing_lines(missing: Sequence[MissingNode]) -> list[str]:
    return [f"  {m.node}: NO AGENT: {m.reason}" for m in missing]
