"""Finding torchrun's ranks on this machine without being told their PIDs.

torchrun's elastic agent starts each rank with its coordinates in the
environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``GROUP_RANK``,
``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RUN_ID``, ``MASTER_ADDR``/``PORT``), so
the ranks are found by reading every process's environment
(``/proc/PID/environ``). How the pieces are told apart:

- A rank is the *top-most* process carrying a given ``RANK`` (within one run
  id): a rank's children inherit its environment, so a DataLoader worker or a
  checkpoint writer has the same ``RANK`` but its parent has it too.
- If that top-most process is a wrapper (a shell running ``python train.py``,
  ``numactl``, ``taskset``, ``env``...) with exactly one child carrying the
  same ``RANK``, the child is the rank: stacks of ``bash`` tell nobody anything.
- The launcher is the parent of the top-most process: torchrun's agent
  (``torchrun`` / ``python -m torch.distributed.run``). If the launcher itself
  carries ``RANK`` (started from a shell that exported one, as SLURM scripts
  do), it is still not a rank: a process whose children carry *other* ranks
  is a launcher.
- A rank's subprocesses are all its descendants (not crossing into another
  rank). Their role, first match wins:
  1. ``RANKSCOPE_ROLE`` in the child's environment (``main``, ``dataloader``,
     ``checkpoint``, ``compile``, ``other``). /proc shows the environment a
     process was *exec'd* with, so this works for spawned and ``subprocess``
     children, not for plain ``fork`` children;
  2. process name ``pt_data_worker``: torch's DataLoader worker loop renames
     itself so (``torch.multiprocessing._set_thread_name``), fork or spawn;
  3. ``checkpoint`` or ``ckpt`` in the process name or command line (a forked
     writer can rename itself with ``prctl(PR_SET_NAME)``, 15 characters);
  4. ``compile_worker`` in the command line or a ``pt_compile`` name: torch
     inductor's compile pool;
  5. otherwise ``other``.

Processes whose environment cannot be read (another user's, without root) are
skipped and listed in ``DiscoveryResult.skipped`` with the reason, never raised.

Anyone can set ``RANK`` and torchrun's other variables, so claiming them makes
no rank: a rank must belong to one of the job's users (``users``: the agent's
``--job-user``, by default the agent's own user), or, for an agent run by root
without ``--job-user``, to root or to the user of the launcher that started it
(torchrun, ``torch.distributed.run``/``launch``, Slurm's step daemon, or
``--launcher-pid``).
Refused claims are listed in ``skipped``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from rankscope.contract.snapshot import ProcessInfo, ProcessRole, RankInfo
from rankscope.probes.host import forget_dead, process_info

# Processes that only wrap the real training interpreter.
WRAPPER_NAMES = frozenset(
    {"sh", "bash", "dash", "zsh", "env", "numactl", "taskset", "nice", "ionice", "stdbuf", "timeout", "time", "chrt"}
)
ROLE_ENV = "RANKSCOPE_ROLE"
_ENV_KEYS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
    "MASTER_ADDR", "MASTER_PORT", ROLE_ENV, "SLURM_JOB_ID", "SLURMD_NODENAME",
)


@dataclass(frozen=True, slots=True)
class SkippedProcess:
    """A process whose environment could not be read, and why."""

    pid: int
    name: str
    reason: str


@dataclass(frozen=True, slots=True)
class DiscoveryResult:
    ranks: tuple[RankInfo, ...]
    skipped: tuple[SkippedProcess, ...] = ()


# What a launcher's command line contains: torchrun and its module forms, and Slurm's step daemon.
LAUNCHER_WORDS = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "slurmstepd")


@dataclass(frozen=True, slots=True)
class _Proc:
    pid: int
    ppid: int
    uid: int
    name: str
    cmdline: tuple[str, ...]
    env: Mapping[str, str]  # only the keys rankscope reads

    @property
    def rank(self) -> int | None:
        return _int(self.env.get("RANK"))

    @property
    def run_id(self) -> str | None:
        return self.env.get("TORCHELASTIC_RUN_ID")

    @property
    def is_rank_candidate(self) -> bool:
        return all(_int(self.env.get(k)) is not None for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))


def _int(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


def role_of(name: str, cmdline: tuple[str, ...], env: Mapping[str, str]) -> ProcessRole:
    """The role of a rank's subprocess, by the rules in the module docstring."""
    declared = env.get(ROLE_ENV, "").strip().lower()
    if declared in {r.value for r in ProcessRole}:
        return ProcessRole(declared)
    lowered_name = name.lower()
    joined = " ".join(cmdline).lower()
    if lowered_name == "pt_data_worker":
        return ProcessRole.DATALOADER
    if any(word in lowered_name or word in joined for word in ("checkpoint", "ckpt")):
        return ProcessRole.CHECKPOINT
    if "compile_worker" in joined or lowered_name.startswith("pt_compile"):
        return ProcessRole.COMPILE
    return ProcessRole.OTHER


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def parse_stat(raw: str) -> tuple[str, str, int] | None:
    """(name, state, ppid) from the text of ``/proc/PID/stat``; None when it is not such a line. The name sits
    between the first "(" and the last ")": a process may call itself anything, brackets and spaces included."""
    open_at, close_at = raw.find("("), raw.rfind(")")
    if open_at < 0 or close_at < open_at:
        return None
    rest = raw[close_at + 1:].split()
    if len(rest) < 2 or not rest[1].isdigit():
        return None
    return raw[open_at + 1:close_at], rest[0], int(rest[1])


def _stat_fields(pid: int) -> tuple[str, str, int] | None:
    """``parse_stat`` of ``/proc/PID/stat``; None when the process is gone."""
    try:
        return parse_stat(_read(f"/proc/{pid}/stat").decode(errors="replace"))
    except OSError:
        return None


def _effective_uid(pid: int) -> int:
    """The effective uid (the second field of ``Uid:`` in ``/proc/PID/status``), -1 when unreadable."""
    try:
        for line in _read(f"/proc/{pid}/status").split(b"\n"):
            if line.startswith(b"Uid:"):
                fields = line.split()
                return int(fields[2]) if len(fields) > 2 else -1
    except (OSError, ValueError):
        pass
    return -1


def _environment(raw: bytes) -> dict[str, str]:
    """The keys rankscope reads, from ``/proc/PID/environ`` (NUL-separated ``KEY=value``)."""
    if b"RANK" not in raw:  # every key that makes a rank or names a role holds it: most processes stop here
        return {}
    env: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        name = key.decode(errors="replace")
        if sep and name in _ENV_KEY_SET:
            env[name] = value.decode(errors="replace")
    return env


_ENV_KEY_SET = frozenset(_ENV_KEYS)
_KERNEL_THREADS_PARENT = 2  # kthreadd: its children are kernel threads (no environment, no command line)
_UNREAD_UID = -1


def _command_line(pid: int) -> tuple[str, ...]:
    try:
        return tuple(a.decode(errors="replace") for a in _read(f"/proc/{pid}/cmdline").split(b"\0")[:-1])
    except OSError:
        return ()


def _scan() -> tuple[dict[int, _Proc], list[SkippedProcess]]:
    """Every process with the environment keys rankscope reads, from ``/proc`` directly.

    This runs in every poll, capture and plan, over every process of the machine (hundreds on a GPU node), so
    each is read as little as tells whether it matters: its stat line and environment; the owner and command
    line only of the processes the claim check and the roles read (those carrying rank variables, their
    parents, the launchers, and their descendants, the subprocesses). psutil's iteration made about seven
    reads of each."""
    skipped: list[SkippedProcess] = []
    me = os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return {}, skipped
    seen: dict[int, tuple[int, str, dict[str, str]]] = {}  # pid -> (ppid, name, env)
    for entry in entries:
        if not entry.isdigit():
            continue
        pid = int(entry)
        fields = _stat_fields(pid)
        if fields is None:
            continue  # gone while we looked
        name, state, ppid = fields
        if state == "Z":
            continue  # a zombie has no environment or command line left
        if pid == _KERNEL_THREADS_PARENT or ppid == _KERNEL_THREADS_PARENT:
            seen[pid] = (ppid, name, {})
            continue
        try:
            environ = _read(f"/proc/{pid}/environ")
        except PermissionError:
            skipped.append(SkippedProcess(pid, name, "environment not readable (permission denied): run rankscope as root or as the job's user"))
            environ = b""
        except OSError:
            continue  # gone while we looked
        seen[pid] = (ppid, name, {} if pid == me else _environment(environ))  # rankscope itself is never a rank
    children: dict[int, list[int]] = {}
    for pid, (ppid, _name, _env) in seen.items():
        children.setdefault(ppid, []).append(pid)
    claimed = [pid for pid, (_ppid, _name, env) in seen.items() if "RANK" in env]
    wanted = set(claimed) | {seen[pid][0] for pid in claimed}
    below = list(claimed)
    while below:
        for child in children.get(below.pop(), ()):
            if child not in wanted:
                wanted.add(child)
                below.append(child)
    procs: dict[int, _Proc] = {}
    for pid, (ppid, name, env) in seen.items():
        if pid in wanted:
            procs[pid] = _Proc(pid, ppid, _effective_uid(pid), name, _command_line(pid), env)
        else:  # nothing reads its owner or command line
            procs[pid] = _Proc(pid, ppid, _UNREAD_UID, name, (), env)
    return procs, skipped


def _ancestors(pid: int, procs: Mapping[int, _Proc]) -> list[int]:
    out: list[int] = []
    seen = {pid}
    current = procs.get(pid)
    while current is not None and current.ppid and current.ppid not in seen:
        out.append(current.ppid)
        seen.add(current.ppid)
        current = procs.get(current.ppid)
    return out


def _same_rank(a: _Proc, b: _Proc) -> bool:
    return a.rank == b.rank and a.run_id == b.run_id


def default_users() -> frozenset[int] | None:
    """The job's users when none are configured: the agent's own; None for root (a launcher's user, see above)."""
    uid = os.geteuid()
    return None if uid == 0 else frozenset({uid})


def claim_problem(p: _Proc, procs: Mapping[int, _Proc], users: frozenset[int] | None,
                  launcher_pid: int | None) -> str | None:
    """Why a process that carries rank variables is not taken for a rank, or None."""
    if users is not None:
        if p.uid in users:
            return None
        return f"claims RANK but belongs to uid {p.uid}, not to the job's users ({', '.join(map(str, sorted(users)))})"
    if p.uid == 0:
        return None  # root's processes are trusted by a root agent anyway
    launcher = procs.get(p.ppid)
    if launcher is None or launcher.uid != p.uid:
        return (f"claims RANK but its parent is not a launcher of its own user (uid {p.uid}); "
                "name the job's user with --job-user")
    if launcher.pid == launcher_pid or any(w in " ".join(launcher.cmdline) for w in LAUNCHER_WORDS):
        return None
    return (f"claims RANK but was not started by torchrun or Slurm (parent {launcher.pid} {launcher.name!r}); "
            "name the job's user with --job-user")


def discover(*, launcher_pid: int | None = None, run_id: str | None = None, slurm_job: str | None = None,
             slurm_node: str | None = None, users: frozenset[int] | None = None) -> DiscoveryResult:
    """Ranks on this machine (optionally of one launcher, run id or Slurm job and node), with skipped processes.

    ``users``: whose processes may be ranks (None: :func:`default_users`, see the module doc)."""
    users = default_users() if users is None else users
    procs, skipped = _scan()
    forget_dead()
    children: dict[int, list[int]] = {}
    for p in procs.values():
        children.setdefault(p.ppid, []).append(p.pid)

    tops: list[_Proc] = []
    for p in procs.values():
        if not p.is_rank_candidate:
            continue
        parent = procs.get(p.ppid)
        if parent is not None and parent.is_rank_candidate and _same_rank(parent, p):
            continue  # an inherited environment: a child of the rank, not a rank
        if any(procs[c].is_rank_candidate and not _same_rank(procs[c], p) for c in children.get(p.pid, ()) if c in procs):
            continue  # a launcher started from a shell that already had RANK set (SLURM, a user's export)
        if run_id is not None and p.run_id != run_id:
            continue
        if launcher_pid is not None and launcher_pid not in _ancestors(p.pid, procs):
            continue
        if slurm_job is not None and p.env.get("SLURM_JOB_ID") != slurm_job:
            continue
        if slurm_node is not None and p.env.get("SLURMD_NODENAME") != slurm_node:
            continue  # several Slurm nodes may share one host (and one /proc); each agent keeps its own
        problem = claim_problem(p, procs, users, launcher_pid)
        if problem is not None:
            skipped.append(SkippedProcess(p.pid, p.name, problem))
            continue
        tops.append(p)

    rank_pids: dict[int, _Proc] = {}
    launcher_of: dict[int, int] = {}
    for top in tops:
        rank_proc = top
        # Step through wrappers (bash -c "python train.py", numactl ...) to the interpreter.
        while rank_proc.name in WRAPPER_NAMES:
            same = [procs[c] for c in children.get(rank_proc.pid, ()) if c in procs and _same_rank(procs[c], top)]
            if len(same) != 1:
                break
            rank_proc = same[0]
        rank_pids[rank_proc.pid] = rank_proc
        launcher_of[rank_proc.pid] = top.ppid

    ranks: list[RankInfo] = []
    for pid, p in rank_pids.items():
        main = process_info(pid, ProcessRole.MAIN)
        if main is None:
            continue  # exited while we looked
        subs = tuple(_subprocesses(pid, procs, children, set(rank_pids)))
        env = p.env
        ranks.append(
            RankInfo(
                rank=int(env["RANK"]),
                local_rank=int(env["LOCAL_RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                pid=pid,
                group_rank=_int(env.get("GROUP_RANK")),
                local_world_size=_int(env.get("LOCAL_WORLD_SIZE")),
                run_id=env.get("TORCHELASTIC_RUN_ID"),
                launcher_pid=launcher_of[pid] or None,
                master_addr=env.get("MASTER_ADDR"),
                master_port=_int(env.get("MASTER_PORT")),
                process=main,
                subprocesses=subs,
            )
        )
    ranks.sort(key=lambda r: (r.rank, r.run_id or "", r.pid))
    return DiscoveryResult(tuple(ranks), tuple(skipped))


def _subprocesses(
    root: int, procs: Mapping[int, _Proc], children: Mapping[int, list[int]], rank_pids: set[int]
) -> list[ProcessInfo]:
    """All descendants of a rank, labelled by role, not crossing into another rank."""
    out: list[ProcessInfo] = []
    stack = list(children.get(root, ()))
    while stack:
        pid = stack.pop(0)
        if pid in rank_pids or pid not in procs:
            continue
        p = procs[pid]
        info = process_info(pid, role_of(p.name, p.cmdline, p.env))
        if info is not None:
            out.append(info)
        stack.extend(children.get(pid, ()))
    out.sort(key=lambda i: i.pid)
    return out


def discover_ranks(*, launcher_pid: int | None = None, run_id: str | None = None, slurm_job: str | None = None,
                   slurm_node: str | None = None, users: frozenset[int] | None = None) -> tuple[RankInfo, ...]:
    """The ranks on this machine, sorted by global rank, each with its labelled subprocesses.

    ``launcher_pid`` keeps the ranks started under that process (torchrun's
    agent or any ancestor of it); ``run_id`` keeps those whose
    ``TORCHELASTIC_RUN_ID`` matches; ``slurm_job``/``slurm_node`` keep those
    whose ``SLURM_JOB_ID``/``SLURMD_NODENAME`` match (an agent started inside a
    Slurm job). Several filters together keep the intersection. ``users``: whose processes may be ranks (None:
    :func:`default_users`; see the module doc).
    """
    return discover(launcher_pid=launcher_pid, run_id=run_id, slurm_job=slurm_job, slurm_node=slurm_node,
                    users=users).ranks
