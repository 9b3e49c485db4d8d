"""Reading the CCL plugin's per-rank counter files (Aegis Phase-2 CL/WR/WC).

The files live in shared memory (``/dev/shm/rankscope`` unless ``rankscope run
--counter-dir`` said otherwise), one per rank and writer, named
``<job_id>.rank<R>[.nccl].ccl``. The layout and its seqlock protocol are in
``rankscope.ccl_plugin.layout``; this reader never takes a lock, so a rank
hung with its GIL held is read like any other.

A file that is truncated, corrupt or from another layout version comes back
as a ``RankCounters`` with ``error`` set (and a fix in the text); a file left by
a dead process comes back with ``stale`` set. Nothing here raises.

The directory is shared memory other local users may reach, so nothing there is
trusted by name: the directory must belong to the agent's or the job's user and
be writable by no one else, and each file is opened without following a link
and without blocking (a FIFO would hold ``open()`` for good), then accepted only
when it is a regular file of one of those users that starts with the layout's
magic number. A refusal is said once on stderr with its fix, never with the
file's bytes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rankscope.ccl_plugin import layout as L
from rankscope.ccl_plugin.writer import process_start_ticks
from rankscope.contract.snapshot import Communicator, OpCounters, RankCounters, RankInfo

SEQLOCK_RETRIES = 200
# Under a busy writer a record can be mid-update on many reads in a row; keep
# trying (yielding the CPU) for this long before calling it torn.
SEQLOCK_PATIENCE_S = 0.2
# A file without a writer pid is trusted while its heartbeat is this fresh.
FRESH_HEARTBEAT_S = 30.0
# A header's world size above this is nonsense (no job has more ranks); a rank must lie in [0, world size).
MAX_WORLD_SIZE = 1 << 24

# O_NOFOLLOW: a link planted there would show another file's bytes to whoever reads the counters.
# O_NONBLOCK: a FIFO would block open() for good (and with it the agent's reading thread).
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
DIR_MODE = 0o700  # how rankscope creates the directory when it is missing
DIR_FIX = (f"remove it and let rankscope create it (mode {DIR_MODE:o}), or point {L.ENV_DIR} (rankscope run "
           "--counter-dir, rankscope agent --counter-dir) at a directory only the job's user can write")
_said: set[str] = set()
_said_lock = threading.Lock()

_NAME = re.compile(r"^(?P<job>.*)\.rank(?P<rank>\d+)(?:\.(?P<kind>[a-z]+))?\.ccl$")


class _Torn(Exception):
    """A seqlocked record stayed odd or kept changing through every retry."""


@dataclass(frozen=True, slots=True)
class CounterFile:
    """One parsed file plus the header facts used to match it to a rank."""

    path: Path
    counters: RankCounters
    pid_start_ticks: int = 0


def default_directory() -> Path:
    return Path(os.environ.get(L.ENV_DIR) or L.DEFAULT_DIR)


def say_once(message: str) -> None:
    """A refusal on stderr, the first time only: the agent reads the directory every few seconds."""
    with _said_lock:
        if message in _said:
            return
        _said.add(message)
    print(f"rankscope: {message}", file=sys.stderr, flush=True)


def trusted_uids(ranks: Sequence[RankInfo] = ()) -> frozenset[int]:
    """Whose counter files are read: this process's user, the ranks' users, and root."""
    uids = {os.geteuid(), 0}
    for info in ranks:
        with contextlib.suppress(OSError):  # gone: its files are judged by the other users
            uids.add(os.stat(f"/proc/{info.pid}").st_uid)
    return frozenset(uids)


def ensure_directory(directory: Path | None = None) -> None:
    """Create the counter directory (mode 0700) if it is missing, so another local user cannot create it first."""
    base = default_directory() if directory is None else directory
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        os.mkdir(base, DIR_MODE)
    except OSError:
        pass  # there already, or not ours to make: list_counter_files checks whoever made it


def directory_problem(st: os.stat_result, owners: frozenset[int]) -> str | None:
    """Why a counter directory is not to be trusted, or None."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in owners:
        return f"belongs to uid {st.st_uid}, not to the job's user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"can be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def file_problem(st: os.stat_result, owners: frozenset[int]) -> str | None:
    """Why an opened counter file is not to be read, or None."""
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file (a FIFO, device or directory planted there?)"
    if st.st_uid not in owners:
        return f"belongs to uid {st.st_uid}, not to the job's user (uid {os.geteuid()})"
    return None


class _Short(Exception):
    """The file ended before a record it declares (truncated, perhaps while being read)."""


def _pread(fd: int, off: int, size: int) -> bytes:
    """``size`` bytes at ``off``, read (never mapped: a file truncated under a mapping kills the reader with
    SIGBUS, and any local user who can write the file could do that to a root agent)."""
    raw = os.pread(fd, size, off)
    if len(raw) != size:
        raise _Short(f"truncated while being read ({off + len(raw)} bytes where a record needs {off + size})")
    return raw


def _read_stable(fd: int, off: int, size: int, seq_off: int | None = None) -> bytes:
    """A consistent copy of ``size`` bytes at ``off`` whose seqlock sits at ``seq_off`` (default: first).

    The seqlock word is read on its own before the copy and again after it, three system calls: the kernel's
    string copy may load a record's words in any order, so the word inside the copy alone could have been
    loaded after a field the writer was changing (a new CL was once read beside the old byte count). The copy's
    own word must agree too. A writer that stores without pause leaves a reader a window only as wide as the
    three calls, hence the retries.
    """
    at = 0 if seq_off is None else seq_off
    deadline = 0.0
    while True:
        for _ in range(SEQLOCK_RETRIES):
            s1 = L.SEQ.unpack(_pread(fd, off + at, L.SEQ.size))[0]
            if s1 & 1:
                continue
            raw = _pread(fd, off, size)
            if L.SEQ.unpack_from(raw, at)[0] == s1 and L.SEQ.unpack(_pread(fd, off + at, L.SEQ.size))[0] == s1:
                return raw
        now = time.monotonic()
        if not deadline:
            deadline = now + SEQLOCK_PATIENCE_S
        elif now > deadline:
            raise _Torn(f"record at offset {off} stayed mid-update for {SEQLOCK_PATIENCE_S:.1f} s "
                        "(its writer died while writing it?)")
        time.sleep(0)


def _read_header(fd: int) -> bytes:
    """Header bytes with its mutable part consistent (the header seq guards it)."""
    return _read_stable(fd, 0, L.HEADER_SIZE, L.HEADER_SEQ_OFFSET)


def staleness(pid: int, start_ticks: int, heartbeat: float, flags: int, now: float) -> str | None:
    """Why the file's writer is gone, or None if it may still be alive."""
    if flags & L.FLAG_CLEAN_EXIT:
        return "the process exited cleanly and left its file behind"
    if pid <= 0:  # no pid to check: only the heartbeat can tell
        if now - heartbeat <= FRESH_HEARTBEAT_S:
            return None
        return f"no writer pid and no heartbeat for {now - heartbeat:.0f} s"
    if os.path.exists(f"/proc/{pid}"):
        if start_ticks and process_start_ticks(pid) not in (0, start_ticks):
            return f"pid {pid} now belongs to another process (the writer exited)"
        return None  # alive: an old heartbeat then means hung, which is what we are here for
    return f"process {pid} is gone; last heartbeat {now - heartbeat:.0f} s ago"


def _corrupt(path: Path, rank: int, why: str) -> CounterFile:
    msg = (f"counter file {path} is unreadable: {why}; delete it if its job is over, "
           "or check that the rank and rankscope use the same version")
    return CounterFile(path, RankCounters(rank=rank, pid=None, world_size=None, job_id=None,
                                          heartbeat_wall=None, error=msg))


def _refused(path: Path, rank: int, why: str, fix: str) -> CounterFile:
    """A file rankscope will not read: said once on stderr, and in the rank's counters (never its bytes)."""
    msg = f"counter file {path} is refused: it {why}; {fix}"
    say_once(msg)
    return CounterFile(path, RankCounters(rank=rank, pid=None, world_size=None, job_id=None,
                                          heartbeat_wall=None, error=msg))


def read_counter_file(path: Path, now: float | None = None, *, owners: frozenset[int] | None = None,
                      dir_fd: int | None = None) -> CounterFile:
    """Parse one counter file; problems come back in ``counters.error``, never raised.

    ``owners``: the users whose files are read (default: :func:`trusted_uids`). ``dir_fd``: the directory
    already opened and checked (``path.name`` is opened in it).
    """
    m = _NAME.match(path.name)
    name_rank = int(m.group("rank")) if m else -1
    now = time.time() if now is None else now
    owners = trusted_uids() if owners is None else owners
    try:
        try:
            fd = os.open(path.name if dir_fd is not None else path, _OPEN_FLAGS, dir_fd=dir_fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                return _refused(path, name_rank, "is a symbolic link (counter files are never followed)",
                                "delete it; the rank writes its own file there")
            raise
        with open(fd, "rb") as fh:
            st = os.fstat(fh.fileno())
            problem = file_problem(st, owners)
            if problem is not None:
                return _refused(path, name_rank, problem, "delete it; the rank writes its own file there")
            size = st.st_size
            if size < L.HEADER_SIZE:
                return _corrupt(path, name_rank, f"truncated ({size} bytes, the header alone is {L.HEADER_SIZE})")
            if os.pread(fh.fileno(), len(L.MAGIC), 0) != L.MAGIC:  # written once, before the file is published
                return _corrupt(path, name_rank, "no counter-file magic number, not a rankscope counter file")
            if size > L.FILE_SIZE:
                return _corrupt(path, name_rank, f"{size} bytes, larger than any counter file ({L.FILE_SIZE})")
            return _parse(path, fh.fileno(), size, name_rank, now)
    except (_Torn, _Short) as exc:
        return _corrupt(path, name_rank, str(exc))
    except (OSError, ValueError, IndexError, UnicodeError) as exc:  # vanished, or bad numbers
        return _corrupt(path, name_rank, f"{type(exc).__name__}: {exc}")


def _header_problem(h: dict[str, Any], size: int) -> str | None:
    """Why the header's counts and offsets cannot be this layout's, or None: every count is bounded by the
    layout's own table sizes and every table must lie inside the file, before anything is read or allocated."""
    if h["file_size"] > size:
        return f"truncated ({size} of {h['file_size']} bytes)"
    if (h["max_comms"] > L.MAX_COMMS or h["max_ops"] > L.MAX_OPS or h["member_pool_size"] > L.MEMBER_POOL
            or h["n_comms"] > h["max_comms"] or h["n_ops"] > h["max_ops"]
            or h["comm_table_offset"] + h["max_comms"] * L.COMM_SIZE > size
            or h["op_table_offset"] + h["max_ops"] * L.OP_SIZE > size
            or h["member_pool_offset"] + h["member_pool_size"] * L.MEMBER.size > size):
        return "table sizes in the header do not fit the file"
    if not 0 < h["world_size"] <= MAX_WORLD_SIZE or not 0 <= h["rank"] < h["world_size"]:
        return f"rank {h['rank']} of world size {h['world_size']} is not a rank of any job"
    return None


def _parse(path: Path, fd: int, size: int, name_rank: int, now: float) -> CounterFile:
    h = dict(zip((n for n, _, _ in L.HEADER_FIELDS), L.HEADER.unpack(_read_header(fd)), strict=True))
    if h["magic"] != L.MAGIC:
        return _corrupt(path, name_rank, "bad magic number, not a rankscope counter file")
    if h["version"] not in L.READABLE_VERSIONS:
        readable = ", ".join(str(v) for v in L.READABLE_VERSIONS)
        return _corrupt(path, name_rank, f"layout version {h['version']}, this rankscope reads {readable}")
    problem = _header_problem(h, size)
    if problem is not None:
        return _corrupt(path, name_rank, problem)
    n_comms, n_ops = h["n_comms"], h["n_ops"]
    comms: list[Communicator] = []
    members_end = 0  # the writer hands out member slices in order: they never overlap, so at most the pool in all
    for i in range(n_comms):
        raw = _read_stable(fd, h["comm_table_offset"] + i * L.COMM_SIZE, L.COMM_SIZE)
        if h["version"] == 1:
            _, first, count, cid, backend, desc = L.COMM_V1.unpack(raw)
            nranks, comm_rank = 0, -1
        else:
            _, first, count, cid, backend, desc, nranks, comm_rank = L.COMM.unpack(raw)
            if not -1 <= comm_rank < nranks:  # nonsense from a broken writer: unknown
                nranks, comm_rank = 0, -1
        if first + count > h["member_pool_size"] or first < members_end:
            return _corrupt(path, name_rank, f"communicator {i} members lie outside the member pool "
                            "or over another communicator's")
        members_end = first + count
        base = h["member_pool_offset"] + first * L.MEMBER.size
        members = tuple(v[0] for v in L.MEMBER.iter_unpack(_pread(fd, base, count * L.MEMBER.size)))
        comms.append(Communicator(L.decode(cid), L.decode(backend), L.decode(desc), members,
                                  comm_nranks=nranks, comm_rank=comm_rank))
    ops: list[OpCounters] = []
    for i in range(n_ops):
        raw = _read_stable(fd, h["op_table_offset"] + i * L.OP_SIZE, L.OP_SIZE)
        v = L.OP.unpack(raw)
        comm_index, op = v[1], L.decode(v[3])
        (cl, wr, wc, lls, lcs, nbytes, dur, lw, cw), ring = v[4:13], v[13:13 + L.RING_LEN]
        ring_next, ring_count, n_peers = v[13 + L.RING_LEN:16 + L.RING_LEN]
        peers = v[17 + L.RING_LEN:17 + L.RING_LEN + min(n_peers, L.MAX_OPEN_PEERS)]
        if comm_index >= n_comms:
            return _corrupt(path, name_rank, f"op slot {i} names communicator {comm_index} of {n_comms}")
        count = min(ring_count, L.RING_LEN)
        recent = tuple(ring[(ring_next - count + k) % L.RING_LEN] for k in range(count))  # oldest first
        # A completion without a time (the shim's untimed rows where NCCL's plugin times the device) has no duration:
        # its 0.0 is not a measurement, and a fail-slow reading of it would name the rank fastest of all.
        ops.append(OpCounters(
            comm_id=comms[comm_index].comm_id, op=op, cl=cl, wr=wr, wc=wc, last_launched_seq=lls,
            last_completed_seq=lcs, bytes_total=nbytes, last_duration_s=dur if wc and cw else None,
            recent_throughput=recent, last_launch_wall=lw or None, last_complete_wall=cw or None,
            open_peers=tuple(dict.fromkeys(peers))))  # the plugin keeps one entry per open request
    why = staleness(h["pid"], h["pid_start_ticks"], h["heartbeat_wall"], h["flags"], now)
    counters = RankCounters(
        rank=h["rank"], pid=h["pid"], world_size=h["world_size"], job_id=L.decode(h["job_id"]) or None,
        heartbeat_wall=h["heartbeat_wall"], communicators=tuple(comms), ops=tuple(ops),
        steps=h["steps"] if h["writer_kind"] == L.WRITER_PYTHON else None,
        last_step_duration_s=h["last_step_duration"] or None, last_step_wall=h["last_step_wall"] or None,
        stale=why is not None, stale_reason=why)
    return CounterFile(path, counters, h["pid_start_ticks"])


def list_counter_files(directory: Path | None = None, owners: frozenset[int] | None = None
                       ) -> tuple[CounterFile, ...]:
    """Every counter file in the directory, parsed (missing directory: none; untrusted directory: none, said once)."""
    base = default_directory() if directory is None else directory
    owners = trusted_uids() if owners is None else owners
    try:
        dir_fd = os.open(base, _DIR_FLAGS)
    except FileNotFoundError:
        return ()
    except OSError as exc:
        say_once(f"counter directory {base} cannot be read ({exc.strerror}); {DIR_FIX}")
        return ()
    try:
        problem = directory_problem(os.fstat(dir_fd), owners)
        if problem is not None:
            say_once(f"counter directory {base} is refused: it {problem}; {DIR_FIX}")
            return ()
        names = sorted(n for n in os.listdir(dir_fd) if n.endswith(L.FILE_SUFFIX) and not n.startswith("."))
        now = time.time()
        return tuple(read_counter_file(base / n, now, owners=owners, dir_fd=dir_fd) for n in names)
    except OSError:
        return ()
    finally:
        os.close(dir_fd)


def _merge(files: Sequence[CounterFile]) -> RankCounters:
    """One rank's view from its writers (Python hooks and NCCL plugin may both write)."""
    first = files[0].counters
    if len(files) == 1:
        return first
    comms: dict[str, Communicator] = {}
    ops: list[OpCounters] = []
    errors = [f.counters.error for f in files if f.counters.error]
    steps = next((f.counters.steps for f in files if f.counters.steps is not None), None)
    step_s = next((f.counters.last_step_duration_s for f in files if f.counters.last_step_duration_s), None)
    step_wall = next((f.counters.last_step_wall for f in files if f.counters.last_step_wall), None)
    for f in files:
        for c in f.counters.communicators:
            comms.setdefault(c.comm_id, c)
        ops.extend(f.counters.ops)
    beats = [f.counters.heartbeat_wall for f in files if f.counters.heartbeat_wall is not None]
    return replace(first, communicators=tuple(comms.values()), ops=tuple(ops), steps=steps,
                   last_step_duration_s=step_s, last_step_wall=step_wall, heartbeat_wall=max(beats) if beats else None,
                   stale=all(f.counters.stale for f in files),
                   error="; ".join(e for e in errors if e) or None)


def read_counters(ranks: Sequence[RankInfo], directory: Path | None = None) -> tuple[RankCounters, ...]:
    """Counters of the given ranks, one ``RankCounters`` per rank that has a file.

    A file belongs to a rank when its header pid is the rank's pid; failing
    that (a file from a writer whose pid we do not know), when its rank
    matches and it is not stale. Corrupt files whose name carries the rank are
    returned with ``error`` set so the gap is visible.
    """
    files = list_counter_files(directory, trusted_uids(ranks))
    by_pid: dict[int, list[CounterFile]] = {}
    by_rank: dict[int, list[CounterFile]] = {}
    for f in files:
        if f.counters.pid is not None:
            by_pid.setdefault(f.counters.pid, []).append(f)
        by_rank.setdefault(f.counters.rank, []).append(f)
    out: list[RankCounters] = []
    for info in ranks:
        mine = by_pid.get(info.pid)
        if mine:
            mine = [f for f in mine if f.counters.rank == info.rank] or mine
        else:
            candidates = by_rank.get(info.rank, [])
            live = [f for f in candidates if not f.counters.stale and f.counters.error is None]
            mine = live or [f for f in candidates if f.counters.error is not None]
        if mine:
            out.append(replace(_merge(mine), rank=info.rank))
    return tuple(out)
