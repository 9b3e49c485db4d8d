"""The Python side's counter-file writer: one mmap'd file per rank in shared memory.

Why a file in /dev/shm and a seqlock: the agent must read the counters while
the training process is hung, possibly with its GIL held, so the reader can
never depend on the writer's cooperation. Every store goes straight into the
shared mapping; the seqlock (see ``layout``) keeps readers from seeing half an
update. A lock serialises this process's own threads (the training thread and
the threads that run Work completion callbacks), so there is one writer.

Cost matters (µs per collective): each op slot keeps its numbers in Python and,
per call, stores only the fields that call changed, through 8-byte views of
its own bytes in the mapping (an item store costs a fraction of a
``struct.pack_into``). A call that changes a p2p peer rewrites the slot's whole
dynamic part in one pack.

With the native fast path loaded (``native.load()``, passed as ``fast``), every store of a slot goes through
its C ``Slot`` (the collective wrapper in C stores through the same one): a C call holds the GIL from the
odd seq to the even one, so no thread's store lands inside another's. The Python stores below are the
fallback and the reference; both keep the ring's place and the per-communicator sequence numbers in memory
both can reach (the slot's own words, an array).
"""

from __future__ import annotations

import array
import contextlib
import errno
import mmap
import os
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from rankscope.ccl_plugin import layout as L


def process_start_ticks(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot (/proc/<pid>/stat field 22); 0 if unknown.

    Stored in the header so a reader can tell a live writer from a new process
    that happens to reuse the pid of a dead one.
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            raw = fh.read()
        # the command name (field 2) may contain spaces and parens: split after the last ')'
        return int(raw[raw.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_EXCL with O_NOFOLLOW: the file is always a new one of ours, never a link or a file another user planted at
# the temporary name (which would make this rank write its counters over whatever the link points at).
_FILE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
DIR_FIX = ("remove it and let rankscope make it, or point RANKSCOPE_CCL_DIR (rankscope run --counter-dir) at a "
           "directory only the job's user can write")


def _warn(message: str) -> None:
    """One line on stderr: the writer never raises into the training code, it turns itself off and says so."""
    print(f"rankscope: {message}", file=sys.stderr, flush=True)


def _directory_problem(st: os.stat_result) -> str | None:
    """Why a counter directory may not hold this rank's file: another user's, or one others can write."""
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory"
    if st.st_uid not in (os.geteuid(), 0):
        return f"belongs to uid {st.st_uid}, not to this rank's user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"can be written by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _create(directory: Path, name: str, pid: int, fill: Callable[[mmap.mmap], None]) -> mmap.mmap | None:
    """The counter file ``name``, mapped, filled by ``fill`` and published; None (said on stderr) if refused.

    The directory is made 0700 when missing (so no other user makes the shared default first), tightened to 0700
    when it is ours and others can write it, and refused when it belongs to another user or stays writable by
    others. The file is built under a temporary name and renamed into place, so a reader never finds a file
    whose header is not written yet; both happen relative to the one directory opened and checked here, and the
    file is made with O_EXCL|O_NOFOLLOW, so no link (at the directory's path or at either name) is followed.
    """
    try:
        with contextlib.suppress(FileExistsError):
            directory.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(directory, 0o700)
        dir_fd = os.open(directory, _DIR_FLAGS)
    except OSError as exc:
        why = "is a symbolic link" if exc.errno == errno.ELOOP else f"cannot be opened ({exc.strerror})"
        _warn(f"counter directory {directory} {why}; this rank's counters are off: {DIR_FIX}")
        return None
    try:
        st = os.fstat(dir_fd)
        if st.st_uid == os.geteuid() and stat.S_ISDIR(st.st_mode) and st.st_mode & 0o022:
            with contextlib.suppress(OSError):
                os.fchmod(dir_fd, 0o700)
                st = os.fstat(dir_fd)
        problem = _directory_problem(st)
        if problem is not None:
            _warn(f"counter directory {directory} is refused: it {problem}; this rank's counters are off: {DIR_FIX}")
            return None
        tmp = f".{name}.{pid}.tmp"
        try:
            fd = os.open(tmp, _FILE_FLAGS, 0o644, dir_fd=dir_fd)
        except FileExistsError:  # a leftover of an earlier writer with this pid, or a planted name: remove the name
            os.unlink(tmp, dir_fd=dir_fd)
            fd = os.open(tmp, _FILE_FLAGS, 0o644, dir_fd=dir_fd)
        try:
            os.ftruncate(fd, L.FILE_SIZE)
            mm = mmap.mmap(fd, L.FILE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        fill(mm)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        return mm
    except OSError as exc:
        _warn(f"counter file {directory / name} cannot be made ({exc.strerror}); this rank's counters are off")
        return None
    finally:
        os.close(dir_fd)


class CounterFileFull(Exception):
    """The file's fixed tables are full; callers stop recording new communicators/ops."""


class OpSlot:
    """One (communicator, operation) row. Its counters live in the file only (read back where a store
    adds to them); what a store cannot read back cheaply (open peers) is kept here."""

    __slots__ = ("comm_index", "d", "index", "native", "offset", "op", "open_peers", "q", "view")

    def __init__(self, index: int, comm_index: int, op: str) -> None:
        self.index = index
        self.offset = L.op_offset(index)
        self.comm_index = comm_index
        self.op = op
        self.open_peers: dict[int, int] = {}  # global rank -> open requests to/from it
        # the slot's bytes in the mapping, as 8-byte words (unsigned and double); set by the writer
        self.view: memoryview | None = None
        self.q: memoryview = _NO_VIEW
        self.d: memoryview[float] = _NO_VIEW.cast("d")
        self.native: Any = None  # the fast path's Slot over the same bytes, when it is loaded


# A launched work request, handed back at completion to compute TD and N:
# (slot, sequence number in its communicator, bytes, peer or None, launch time).
# A plain tuple: it is built on every call, and that is the cheapest object.
Request = tuple[OpSlot, int, int, "int | None", float]


_PEERS_PACK = struct.Struct(f"<II{L.MAX_OPEN_PEERS}i").pack_into
_PEERS_OFFSET = L.OP_OFFSETS["n_open_peers"]
_clock = time.perf_counter
_NO_VIEW = memoryview(b"")  # a slot not yet placed in a file
_NO_PEERS = (0,) * L.MAX_OPEN_PEERS
# Word indexes of the per-call fields inside a slot (every one 8-aligned; ring_next and ring_count share a
# word, ring_next in its low half): what launch/complete store one by one, each under the slot's seqlock
# (odd seq first, even seq last: the stores of one thread reach memory in program order).
_W = {name: off // 8 for name, off in L.OP_OFFSETS.items() if off % 8 == 0}
_SEQ, _CL, _WR, _WC = _W["seq"], _W["cl"], _W["wr"], _W["wc"]
_LAUNCHED, _COMPLETED, _BYTES = _W["last_launched_seq"], _W["last_completed_seq"], _W["bytes_total"]
_DURATION, _LAUNCH_WALL, _COMPLETE_WALL = _W["last_duration"], _W["last_launch_wall"], _W["last_complete_wall"]
_RING, _RING_POS = _W["ring"], _W["ring_next"]
assert L.OP_OFFSETS["ring_count"] == L.OP_OFFSETS["ring_next"] + 4
_RING_AFTER = tuple((i + 1) % L.RING_LEN for i in range(L.RING_LEN))
# The views store native words; the file is little endian.
_LITTLE_ENDIAN = sys.byteorder == "little"


class CounterWriter:
    """Owns one rank's counter file. Thread-safe; one instance per process."""

    def __init__(self, directory: Path, *, rank: int, world_size: int, job_id: str,
                 pid: int | None = None, writer_kind: int = L.WRITER_PYTHON, fast: ModuleType | None = None) -> None:
        self.pid = os.getpid() if pid is None else pid
        self.rank = rank
        self.path = directory / L.file_name(job_id, rank)
        self._lock = threading.Lock()
        self._comms: dict[str, int] = {}
        # per communicator: the last launched sequence number (an array: the fast path stores into it too)
        self._comm_seq = array.array("Q", bytes(8 * L.MAX_COMMS))
        self._fast = fast
        self._slots: dict[tuple[int, str], OpSlot] = {}
        self._members_used = 0
        self._steps = 0
        self._last_step_mono: float | None = None
        self._last_step_duration = 0.0
        self._last_step_wall = 0.0
        self._heartbeat = time.time()
        self._closed = False
        # Events read one clock (perf_counter) and derive wall time from it.
        self._wall_offset = time.time() - time.perf_counter()
        now = time.time()

        def fill(mm: mmap.mmap) -> None:
            L.HEADER.pack_into(
                mm, 0, L.MAGIC, L.VERSION, L.HEADER_SIZE, L.FILE_SIZE, 0, self.pid,
                process_start_ticks(self.pid), rank, world_size, writer_kind, 0, now, now, 0, 0.0, 0.0,
                0, 0, L.MAX_COMMS, L.MAX_OPS, L.MEMBER_POOL, 0, L.COMM_TABLE_OFFSET, L.OP_TABLE_OFFSET,
                L.MEMBER_POOL_OFFSET, L.encode(job_id, L.JOB_ID_LEN), b"")

        mm = _create(directory, self.path.name, self.pid, fill)
        # None: refused (said on stderr). The writer then keeps counting into private memory nobody reads instead
        # of raising into the training code.
        self.enabled = mm is not None
        if mm is None:
            mm = mmap.mmap(-1, L.FILE_SIZE)
            fill(mm)
        self._mm = mm

    # ---- seqlocked stores ------------------------------------------------

    def _publish_header(self) -> None:
        mm = self._mm
        seq = L.SEQ.unpack_from(mm, L.HEADER_SEQ_OFFSET)[0] + 1
        L.SEQ.pack_into(mm, L.HEADER_SEQ_OFFSET, seq)
        L.HEADER_MUTABLE.pack_into(
            mm, L.HEADER_MUTABLE_OFFSET, self._heartbeat, self._steps, self._last_step_duration,
            self._last_step_wall, len(self._comms), len(self._slots), L.MAX_COMMS, L.MAX_OPS,
            L.MEMBER_POOL, self._members_used)
        L.SEQ.pack_into(mm, L.HEADER_SEQ_OFFSET, seq + 1)

    # ---- registration ----------------------------------------------------

    def comm(self, comm_id: str, backend: str, description: str, members: tuple[int, ...]) -> int:
        """Index of the communicator ``comm_id``, recording it on first sight."""
        idx = self._comms.get(comm_id)
        if idx is not None:
            return idx
        with self._lock:
            idx = self._comms.get(comm_id)
            if idx is not None:
                return idx
            idx = len(self._comms)
            if idx >= L.MAX_COMMS:
                raise CounterFileFull(f"more than {L.MAX_COMMS} communicators")
            # the group's size and this rank's place in it, as NCCL's init reports them to the profiler
            # plugin: what a reader ties an NCCL communicator (plugin file) to this torch group by
            nranks = len(members)
            comm_rank = members.index(self.rank) if self.rank in members else -1
            members = members[: max(0, L.MEMBER_POOL - self._members_used)]
            first = self._members_used
            for i, r in enumerate(members):
                L.MEMBER.pack_into(self._mm, L.member_offset(first + i), r)
            self._members_used += len(members)
            off = L.comm_offset(idx)
            L.COMM.pack_into(self._mm, off, 0, first, len(members), L.encode(comm_id, L.COMM_ID_LEN),
                             L.encode(backend, L.BACKEND_LEN), L.encode(description, L.DESC_LEN), nranks, comm_rank)
            L.SEQ.pack_into(self._mm, off, 2)  # even: complete
            self._comms[comm_id] = idx
            self._publish_header()
            return idx

    def slot(self, comm_index: int, op: str) -> OpSlot:
        key = (comm_index, op)
        s = self._slots.get(key)
        if s is not None:
            return s
        with self._lock:
            s = self._slots.get(key)
            if s is not None:
                return s
            index = len(self._slots)
            if index >= L.MAX_OPS:
                raise CounterFileFull(f"more than {L.MAX_OPS} (communicator, op) pairs")
            if not _LITTLE_ENDIAN:
                raise CounterFileFull("the counter file is little endian and this host is not")
            s = OpSlot(index, comm_index, op)
            s.view = memoryview(self._mm)[s.offset : s.offset + L.OP_SIZE]
            s.q, s.d = s.view.cast("Q"), s.view.cast("d")
            L.OP_STATIC.pack_into(self._mm, s.offset + 8, comm_index, 0, L.encode(op, L.OP_NAME_LEN))
            s.q[_SEQ] = 2  # even: complete (the dynamic part is the file's zeros)
            if self._fast is not None:
                s.native = self._fast.Slot(s.view, self._comm_seq, comm_index, self._wall_offset)
            self._slots[key] = s
            self._publish_header()
            return s

    # ---- events ------------------------------------------------------------

    def launch(self, s: OpSlot, nbytes: int, peer: int | None = None, launch: bool = True) -> Request:
        """CL (if ``launch``) and one WR: a call issued one work request of ``nbytes``."""
        mono = _clock()
        native = s.native
        if native is not None:
            if peer is None:
                return (s, native.launch(nbytes, launch, mono), nbytes, peer, mono)
            with self._lock:  # the open peers: one thread at a time
                s.open_peers[peer] = s.open_peers.get(peer, 0) + 1
                return (s, native.launch(nbytes, launch, mono, self._peers(s)), nbytes, peer, mono)
        lock = self._lock
        lock.acquire()  # not `with`: the context-manager protocol costs about as much again
        try:
            q = s.q
            odd = q[_SEQ] + 1
            q[_SEQ] = odd
            if launch:
                q[_CL] += 1
            q[_WR] += 1
            seqs = self._comm_seq
            seq = seqs[s.comm_index] + 1
            seqs[s.comm_index] = q[_LAUNCHED] = seq
            q[_BYTES] += nbytes
            s.d[_LAUNCH_WALL] = mono + self._wall_offset
            if peer is not None:
                s.open_peers[peer] = s.open_peers.get(peer, 0) + 1
                self._store_peers(s)
            q[_SEQ] = odd + 1
        finally:
            lock.release()
        return (s, seq, nbytes, peer, mono)

    def complete(self, req: Request) -> None:
        """WC: the request finished; TD from its launch, N = bytes/TD into the ring."""
        mono = _clock()
        s, comm_seq, nbytes, peer, t0 = req
        native = s.native
        if native is not None:
            if peer is None:
                native.complete(comm_seq, nbytes, t0, mono)
                return
            with self._lock:
                native.complete(comm_seq, nbytes, t0, mono, self._drop_peer(s, peer))
            return
        dur = mono - t0
        lock = self._lock
        lock.acquire()
        try:
            q, d = s.q, s.d
            odd = q[_SEQ] + 1
            q[_SEQ] = odd
            q[_WC] += 1
            if comm_seq > q[_COMPLETED]:
                q[_COMPLETED] = comm_seq
            d[_DURATION] = dur
            d[_COMPLETE_WALL] = mono + self._wall_offset
            if nbytes > 0 and dur > 0:
                pos = q[_RING_POS]
                i, count = pos & 0xFFFFFFFF, pos >> 32
                d[_RING + i] = nbytes / dur
                q[_RING_POS] = _RING_AFTER[i] | min(count + 1, L.RING_LEN) << 32
            if peer is not None:
                self._close_peer(s, peer)
            q[_SEQ] = odd + 1
        finally:
            lock.release()

    def settle(self, req: Request) -> None:
        """WC without TD or N: the request is known to be over, but not when (another writer times it)."""
        s, comm_seq, _nbytes, peer, _t0 = req
        native = s.native
        if native is not None:
            if peer is None:
                native.settle(comm_seq)
                return
            with self._lock:
                native.settle(comm_seq, self._drop_peer(s, peer))
            return
        lock = self._lock
        lock.acquire()
        try:
            q = s.q
            odd = q[_SEQ] + 1
            q[_SEQ] = odd
            q[_WC] += 1
            if comm_seq > q[_COMPLETED]:
                q[_COMPLETED] = comm_seq
            if peer is not None:
                self._close_peer(s, peer)
            q[_SEQ] = odd + 1
        finally:
            lock.release()

    def _close_peer(self, s: OpSlot, peer: int) -> None:
        """One request to/from ``peer`` is over (inside the slot's odd seq)."""
        self._drop_peer(s, peer)
        self._store_peers(s)

    @staticmethod
    def _drop_peer(s: OpSlot, peer: int) -> tuple[int, ...]:
        """One request to/from ``peer`` is over; the open peers left, as stored."""
        left = s.open_peers.get(peer, 0) - 1
        if left > 0:
            s.open_peers[peer] = left
        else:
            s.open_peers.pop(peer, None)
        return CounterWriter._peers(s)

    @staticmethod
    def _peers(s: OpSlot) -> tuple[int, ...]:
        """The open peers as the file keeps them: the first MAX_OPEN_PEERS."""
        return tuple(s.open_peers)[: L.MAX_OPEN_PEERS]

    def _store_peers(self, s: OpSlot) -> None:
        peers = self._peers(s)
        _PEERS_PACK(self._mm, s.offset + _PEERS_OFFSET, len(peers), 0, *peers, *_NO_PEERS[len(peers):])

    def step(self) -> None:
        """An optimizer step finished: count it and time it against the previous one."""
        mono = time.perf_counter()
        with self._lock:
            self._steps += 1
            if self._last_step_mono is not None:
                self._last_step_duration = mono - self._last_step_mono
            self._last_step_mono = mono
            self._last_step_wall = self._heartbeat = time.time()
            self._publish_header()

    def heartbeat(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._heartbeat = time.time()
            self._publish_header()

    def close(self, remove: bool = True) -> None:
        """Clean exit: mark the file and (by default) remove it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            flags = L.U32.unpack_from(self._mm, L.HEADER_FLAGS_OFFSET)[0]
            L.U32.pack_into(self._mm, L.HEADER_FLAGS_OFFSET, flags | L.FLAG_CLEAN_EXIT)
            if remove and self.enabled:
                with contextlib.suppress(OSError):
                    self.path.unlink()
            for s in self._slots.values():  # the mapping closes only once no view of it is left
                if s.native is not None:
                    s.native.release()
                for view in (s.q, s.d, s.view):
                    if view is not None:
                        view.release()
            with contextlib.suppress(BufferError, ValueError):
                self._mm.close()
