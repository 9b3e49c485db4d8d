"""A real Slurm cluster on this one machine, for the tests and the Slurm drill.

Debian's slurm-wlm and munge: one munged, one slurmctld and one slurmd per
node, every node on this host (``NodeName=node[1-N]``, one slurmd port each),
every file under one base directory. Nothing is written outside it and
nothing outlives ``stop()``: the jobs are cancelled first (stopping slurmd
does not end them), then the daemons, then any process left holding a file of
the base directory open (slurmstepd rewrites its environment for its process
title, so open files are how its processes are told apart) and their
descendants are killed.

``ensure_installed()`` installs the packages with apt-get when they are
missing and we are root (a fresh CI machine); otherwise it says why not, and
the tests that need the cluster skip with that reason.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from rankscope.contract.errors import RankscopeError

DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "sinfo", "scancel")
PACKAGES = ("slurm-wlm", "munge")
DAEMON_NAMES = frozenset({"slurmstepd", "slurmd", "slurmctld", "munged"})
START_TIMEOUT_S = 60.0


def missing_tools() -> list[str]:
    return [t for t in (*DAEMONS, *CLIENTS) if shutil.which(t) is None]


def ensure_installed() -> str | None:
    """None when Slurm and munge are usable here; else why not (after installing them if we may)."""
    if not missing_tools():
        return None
    if os.geteuid() != 0:
        return f"Slurm is not installed ({', '.join(missing_tools())} missing) and installing it needs root"
    if shutil.which("apt-get") is None:
        return "Slurm is not installed and this machine has no apt-get to install slurm-wlm and munge"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *PACKAGES]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=600)
    if proc.returncode != 0:  # the package lists may be missing on a fresh machine
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, check=False, timeout=600)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=600)
    if proc.returncode != 0 or missing_tools():
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return f"installing {' '.join(PACKAGES)} failed: {tail}"
    return None


def _free_port_block(count: int) -> int:
    """A port P such that P, P+1 (slurmctld, SlurmdPort) and P+101..P+count-1 (one slurmd per node) look free.

    Bases are drawn below the kernel's ephemeral range, where a busy machine's
    outgoing connections do not land, and only the ports used are checked.
    """
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(12000, 30000 - count)
        if all(_port_free(p) for p in (base, base + 1, *range(base + 101, base + count))):
            return base
    raise RankscopeError("no free block of ports for the Slurm daemons", "free some ports, or pass a port")


def _port_free(port: int) -> bool:
    with socket.socket() as t:
        try:
            t.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class LocalSlurmCluster:
    """``nodes`` Slurm nodes (node1..nodeN) on this host, all state under ``base``."""

    base: Path
    nodes: int = 2
    partitions: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # extra partitions: name -> node numbers
    port: int | None = None
    cred_expire_s: int = 10  # a requeued job may start again after this + 1 s (10 is Slurm's minimum)
    _procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    @property
    def node_names(self) -> tuple[str, ...]:
        return tuple(f"node{i}" for i in range(1, self.nodes + 1))

    def env(self) -> dict[str, str]:
        """The environment the Slurm client commands need (SLURM_CONF)."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def run(self, *argv: str, timeout_s: float = 30.0, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(list(argv), env=self.env(), capture_output=True, text=True, timeout=timeout_s, check=False)
        if check and proc.returncode != 0:
            raise RankscopeError(f"{' '.join(argv)} failed: {proc.stderr.strip() or proc.stdout.strip()}",
                                 f"read {self.base / 'log'}")
        return proc

    # ---- start -------------------------------------------------------------------

    def _config(self, host: str, port: int) -> str:
        b = self.base
        lines = [
            "ClusterName=rankscope-local", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={port}",
            f"SlurmdPort={port + 1}", "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={b}/munge/munge.socket,cred_expire={self.cred_expire_s}",
            f"StateSaveLocation={b}/state", f"SlurmdSpoolDir={b}/spool/%n",
            f"SlurmctldPidFile={b}/run/slurmctld.pid", f"SlurmdPidFile={b}/run/slurmd-%n.pid",
            f"SlurmctldLogFile={b}/log/slurmctld.log", f"SlurmdLogFile={b}/log/slurmd-%n.log",
            "SlurmctldDebug=info", "SlurmdDebug=info",
            "SlurmdParameters=config_overrides",  # every node declares 2 CPUs whatever this host has
            "MailProg=/bin/true", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none", "MpiDefault=none", "SwitchType=switch/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core", "SchedulerType=sched/backfill",
            "SchedulerParameters=bf_interval=1,sched_interval=2",  # a requeued job starts within seconds
            "ReturnToService=2", "SlurmctldTimeout=30", "SlurmdTimeout=10", "InactiveLimit=0", "KillWait=5",
            "MinJobAge=300", "Waittime=0",
            f"NodeName=node[1-{self.nodes}] NodeHostname={host} NodeAddr=127.0.0.1 "
            f"Port={port + 101}-{port + 100 + self.nodes} CPUs=2 RealMemory=1000 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO",
        ]
        for name, numbers in self.partitions.items():
            nodes = ",".join(f"node{i}" for i in numbers)
            lines.append(f"PartitionName={name} Nodes={nodes} Default=NO MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def start(self) -> LocalSlurmCluster:
        why = ensure_installed()
        if why is not None:
            raise RankscopeError(why, "install slurm-wlm and munge (apt-get install slurm-wlm munge) as root")
        if self.base.exists():
            shutil.rmtree(self.base)
        for sub in ("munge", "state", "spool", "log", "run"):
            (self.base / sub).mkdir(parents=True)
        # munged wants every directory above its socket searchable by all.
        for d in (self.base, *self.base.parents):
            if d == Path("/"):
                break
            if d.stat().st_mode & 0o001 == 0 and d.owner() == "root":
                d.chmod(d.stat().st_mode | 0o711)
        (self.base / "munge").chmod(0o755)
        port = self.port or _free_port_block(self.nodes + 101)
        self.port = port
        host = socket.gethostname()
        self.conf.write_text(self._config(host, port), encoding="utf-8")
        m = self.base / "munge"
        subprocess.run(["mungekey", "-c", "-k", str(m / "munge.key")], check=True, capture_output=True)
        subprocess.run(["munged", f"--socket={m}/munge.socket", f"--key-file={m}/munge.key",
                        f"--log-file={m}/munged.log", f"--pid-file={m}/munged.pid", f"--seed-file={m}/munged.seed"],
                       check=True, capture_output=True)
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for name in self.node_names:
            (self.base / "spool" / name).mkdir()
            self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            proc = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False, timeout_s=10)
            idle = {line.split()[0] for line in proc.stdout.splitlines() if line.split()[1:] == ["idle"]}
            if idle >= set(self.node_names):
                return self
            time.sleep(0.2)
        log = (self.base / "log" / "slurmctld.log")
        tail = log.read_text(errors="replace").splitlines()[-5:] if log.exists() else []
        self.stop()
        raise RankscopeError(f"the local Slurm cluster did not come up: {' | '.join(tail)}", f"read {self.base}/log")

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.base / "log" / f"{name}.out", "wb")  # noqa: SIM115 - the daemon keeps it
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=self.env())
        out.close()
        self._procs[name] = proc
        (self.base / "run" / f"{name}.realpid").write_text(str(proc.pid))

    # ---- jobs ----------------------------------------------------------------------

    def sbatch(self, *args: str) -> str:
        """Submit a batch job; its id."""
        return self.run("sbatch", "--parsable", *args).stdout.strip().split(";")[0]

    def job_field(self, job_id: str, fmt: str) -> str:
        return self.run("squeue", "-h", "-j", job_id, "-o", fmt, check=False).stdout.strip()

    def steps(self, job_id: str) -> list[str]:
        """The job's running steps (``J.S NAME``), batch and extern steps not counted."""
        out = self.run("squeue", "-h", "-s", "-j", job_id, "-o", "%i %j", check=False).stdout
        return [line.strip() for line in out.splitlines()
                if line.strip() and not line.split()[0].endswith((".batch", ".extern"))]

    # ---- stop ----------------------------------------------------------------------

    def _ours(self) -> set[int]:
        """Daemons and step daemons holding a file of the base directory open."""
        base = str(self.base) + "/"
        found: set[int] = set()
        for fd_dir in Path("/proc").glob("[0-9]*/fd"):
            try:
                pid = int(fd_dir.parent.name)
                if (fd_dir.parent / "comm").read_text().strip() not in DAEMON_NAMES:
                    continue
                if any(os.readlink(fd).startswith(base) for fd in fd_dir.iterdir()):
                    found.add(pid)
            except (OSError, ValueError):
                continue
        return found

    @staticmethod
    def _descendants(roots: set[int]) -> set[int]:
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
            except (OSError, ValueError, IndexError):
                continue
        out, frontier = set(roots), list(roots)
        while frontier:
            for child in children.get(frontier.pop(), ()):
                if child not in out:
                    out.add(child)
                    frontier.append(child)
        return out

    def stop(self) -> None:
        """Cancel every job, stop the daemons, kill whatever of this cluster is left."""
        if not self.conf.exists():
            return
        ctld = self._procs.get("slurmctld")
        if ctld is not None and ctld.poll() is None:
            self.run("scancel", "--full", "-u", str(os.getuid()), check=False, timeout_s=15)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self.run("squeue", "-h", "-t", "R,CG,PD", check=False,
                                                           timeout_s=10).stdout.strip():
                time.sleep(0.2)
        everything = self._descendants(self._ours())
        munged = self.base / "munge" / "munged.pid"
        pids = [p.pid for p in self._procs.values()]
        if munged.exists():
            pids.append(int(munged.read_text().strip() or 0))
        for pid in pids:
            _signal(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.1)
        left = {p for p in everything | self._descendants(self._ours()) | set(pids) if _alive(p)}
        for pid in left:
            _signal(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in left):
            time.sleep(0.05)  # SIGKILL is not instant: "stopped" means gone
        for proc in self._procs.values():
            proc.wait(timeout=10)
        self._procs.clear()

    def __enter__(self) -> LocalSlurmCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal(pid: int, sig: signal.Signals) -> None:
    if pid > 1:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


def _alive(pid: int) -> bool:
    """Running and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
