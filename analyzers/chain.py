"""Who waits for whom: each rank's state, and the ranks a hang's waiters lead back to.

Outlier stacks say *where* ranks differ; they do not say which difference
started the hang. Here every rank gets a state from its main thread (and the
reason it could not be read):

- ``collective``: inside a collective (its call site is the op plus the line
  of the frame that called into torch.distributed, so two calls from one
  function stay apart);
- ``p2p``: inside a send or recv, waiting for an adjacent pipeline stage;
- ``loading``: waiting for a batch from its DataLoader (or its worker);
- ``computing``: in its own work, not waiting for any rank;
- ``stopped``: the process is stopped (``T``), told by /proc when py-spy failed;
- ``unreadable``: no stack (py-spy failed, the process is gone, its machine is
  unreachable).

A waiting rank waits on the members of its groups that are not at its call
site: a collective whose every member of some group is present would finish,
so only the *incomplete* groups (any layout kind; the whole job when all its
layout groups are complete) hold the ranks it waits for. Send/recv waits on
the adjacent stage it talks to. Following these edges backwards from every
rank that is not waiting (computing, loading, stopped, unreadable) gives the
*roots* and their *victims*: the waiters that lead to them. A victim is
evidence under its root, never a suspect of its own.

A rank whose main thread sits in the autograd engine with nothing visible
below it, while its data-parallel peers all wait in one collective, is inside
backward's gradient reduction: DDP and FSDP launch it from C++ autograd hooks
that py-spy cannot show. That is a collective at another call site than its
peers'. Ranks of one group at different collective sites that no root
explains, where no smaller group is complete at any site, form a *desync*:
usually a program mismatch (data or control flow), which eviction will not
cure.

Pure: stdlib and the snapshot contract; no I/O.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import numpy as np
from rankscope.analyzers.ccl_desync import CounterWaits, comm_label, crossed_waits, waiting_together
from rankscope.analyzers.stacks import (
    DEFAULT_OPTIONS,
    SignatureOptions,
    communication_kind,
    frame_text,
    is_wrapper,
)
from rankscope.analyzers.topology import DIMS, Topology, compact_ranks, group_ids
from rankscope.contract.snapshot import (
    CaptureError,
    CaptureErrorKind,
    Frame,
    OpCounters,
    RankCounters,
    RankStacks,
    main_thread,
)
from rankscope.contract.vocabulary import direction_word, is_point_to_point

DESYNC_ADVICE = ("evicting machines will not cure it: a desync is usually a program mismatch (different data or "
                 "control flow on these ranks, e.g. an extra batch or a rank-dependent branch); fix the code or the "
                 "data split, then restart from the last checkpoint")
BACKWARD_SITE = "gradient reduction inside backward (autograd hooks, not visible to py-spy)"
_MAX_PER_ROOT_SEARCH = 32  # roots searched one by one; beyond this, one search for all


class RankState(StrEnum):
    COMPUTING = "computing"
    LOADING = "loading data"
    COLLECTIVE = "collective"
    P2P = "send/recv"
    STOPPED = "stopped"
    UNREADABLE = "unreadable"
    UNKNOWN = "not captured"  # no data at all (a file missing from a dump folder): neither root nor waiter


TERMINAL = frozenset({RankState.COMPUTING, RankState.LOADING, RankState.STOPPED, RankState.UNREADABLE})
"""States that wait for no other rank: where a chain of waiters ends."""


@dataclass(frozen=True, slots=True)
class RankView:
    """One rank's state, where it is, and (when unreadable) why.

    ``site`` identifies a collective or send/recv call (op and caller line);
    ``frame`` is the innermost frame that explains the state; ``direction``
    is "prev", "next" or "both" for send/recv (the stage it talks to);
    ``reason`` says why a rank is unreadable or stopped, with /proc's state.
    """

    rank: int
    state: RankState
    frame: str = ""
    site: str = ""
    direction: str = ""
    reason: str = ""
    process_state: str | None = None
    wchan: str | None = None
    host_wait: str = ""  # the frame where the host waits on its GPU (.item(), cudaStreamSynchronize, ...)
    native: bool = False  # the stack has native frames (py-spy --native): no host_wait then means none
    peers: tuple[int, ...] = ()  # the ranks a send/recv waits on, when the counters name them (open_peers)
    counted: str = ""  # what the counters say of a wait the stack cannot show (an asynchronous collective)

    def short(self) -> str:
        """A few words: "loading data", "unreadable: permission, process state D in nv_wait"."""
        if self.state not in (RankState.UNREADABLE, RankState.STOPPED, RankState.UNKNOWN):
            return self.state.value
        extra = [self.reason.split(":", 1)[0]] if ":" in self.reason else []
        if self.process_state:
            extra.append(f"process state {self.process_state}" + (f" in {self.wchan}" if self.wchan else ""))
        return f"{self.state.value}: {', '.join(extra)}" if extra else self.state.value

    def describe(self) -> str:
        if self.counted:
            return f"{'in a collective' if self.state is RankState.COLLECTIVE else 'in send/recv'}: {self.counted}"
        if self.state is RankState.COLLECTIVE:
            return f"in a collective: {self.site}"
        if self.state is RankState.P2P:
            return f"in send/recv: {self.site}"
        if self.state is RankState.LOADING:
            return f"loading data: {self.frame}"
        if self.state is RankState.COMPUTING:
            return f"computing: {self.frame}"
        return f"{self.state.value}: {self.reason}"


@dataclass(frozen=True, slots=True)
class Root:
    """A rank the others wait on, and the waiting ranks that lead to it."""

    rank: int
    view: RankView
    victims: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Desync:
    """Ranks of one group stuck in different collectives; ``ranks`` are the odd ones out."""

    group_kind: str  # the layout kind of the group, or "world"
    group: tuple[int, ...]
    ranks: tuple[int, ...]
    victims: tuple[int, ...]
    sites: tuple[tuple[str, tuple[int, ...]], ...]  # call site -> ranks there, largest first
    tie: bool = False  # the two largest sites hold as many ranks: the odd ones out are a choice
    communicator: str = ""  # the counters' communicator, when the counters told it (a crossed wait)
    evidence: tuple[str, ...] = ()  # the counters' lines: the lag, and each side's wait on the other


@dataclass(frozen=True, slots=True)
class Chain:
    views: Mapping[int, RankView]
    roots: tuple[Root, ...]  # most victims first
    desyncs: tuple[Desync, ...]
    unexplained: tuple[int, ...]  # waiting ranks that lead to no root

    @property
    def root_ranks(self) -> frozenset[int]:
        return frozenset(r.rank for r in self.roots)


# --------------------------------------------------------------------------
# states
# --------------------------------------------------------------------------

_FRAME_KEY = operator.attrgetter("name", "filename", "line")
_TORCH_DISTRIBUTED = re.compile(r"(^|/)torch/distributed/")
_COMM_BASENAMES = frozenset({"distributed_c10d.py", "c10d_logger.py"})
_AUTOGRAD_ENGINE = frozenset({("_engine_run_backward", "graph.py"), ("run_backward", "__init__.py"),
                              ("backward", "__init__.py"), ("backward", "_tensor.py")})
_DATALOADER_FILES = frozenset({"dataloader.py", "fetch.py"})
# Where a host waits on its GPU (host_wait_frame): the CUDA/HIP synchronisations, and the torch calls that make them.
_NATIVE_SYNC = re.compile(r"^(cu|cuda|hip)(Stream|Event|Device|Ctx)Synchronize")
_SYNC_NAMES = frozenset({"item", "cpu", "tolist", "synchronize", "_local_scalar_dense", "THPVariable_item",
                         "THPVariable_cpu", "THPVariable_tolist", "stream_synchronize", "device_synchronize"})
_PREV_WORDS = ("recv_forward", "recv_activation", "send_backward", "send_grad", "recv_prev", "send_prev")
_NEXT_WORDS = ("recv_backward", "recv_grad", "send_forward", "send_activation", "recv_next", "send_next")


def _base(filename: str) -> str:
    return filename.replace("\\", "/").rsplit("/", 1)[-1]


def _in_torch_distributed(f: Frame) -> bool:
    path = f.filename.replace("\\", "/")
    return bool(_TORCH_DISTRIBUTED.search(path)) or _base(path) in _COMM_BASENAMES


def _short(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def unreadable_reason(error: CaptureError | None, fallback: str) -> tuple[str, str | None, str | None]:
    """The py-spy error, /proc's state and wchan of a rank that could not be read."""
    if error is None:
        return fallback, None, None
    state = error.process_state
    wchan = error.wchan
    text = f"{error.kind}: {error.message.strip()}"
    if state:
        text += f"; process state {describe_process_state(state)}"
    if wchan:
        text += f", sleeping in {wchan}"
    return text, state, wchan


_PROCESS_ERRORS = frozenset({CaptureErrorKind.PERMISSION, CaptureErrorKind.TIMEOUT, CaptureErrorKind.GONE,
                             CaptureErrorKind.UNREACHABLE})


def _about_the_process(error: CaptureError | None) -> bool:
    """Whether a failed capture says something about the process (ptrace refused, no answer, gone, /proc state).

    A file that is not py-spy output, or a tool that is missing, says nothing
    about the rank: such a rank is unknown, not a suspect.
    """
    if error is None:
        return False
    return error.kind in _PROCESS_ERRORS or bool(error.process_state)


def describe_process_state(state: str) -> str:
    words = {"D": "D (uninterruptible sleep, usually a driver or I/O call)", "T": "T (stopped)",
             "t": "t (stopped by a tracer)", "Z": "Z (zombie: exited, not reaped)", "R": "R (running)",
             "S": "S (sleeping)", "gone": "gone (the process no longer exists)"}
    return words.get(state, state)


class _ViewCache:
    """The views of the stacks read so far: ranks of a large job share a few stacks, so each is read once.

    A capture's decoder and a bundle's reader share one tuple object between
    ranks whose stacks are identical: such a tuple is found by identity, with
    no frame looked at (the tuple is kept, so its id holds).
    """

    __slots__ = ("by_frames", "by_object")

    def __init__(self) -> None:
        self.by_object: dict[int, tuple[tuple[Frame, ...], RankView]] = {}
        self.by_frames: dict[tuple[object, ...], RankView] = {}

    def view(self, frames: tuple[Frame, ...], options: SignatureOptions) -> RankView:
        seen = self.by_object.get(id(frames))
        if seen is not None and seen[0] is frames:
            return seen[1]
        key = tuple(map(_FRAME_KEY, frames))  # strings hash once each; frames would hash field by field
        got = self.by_frames.get(key)
        if got is None:
            got = self.by_frames[key] = _stack_view(0, frames, options)
        self.by_object[id(frames)] = (frames, got)
        return got


def rank_view(rank: int, rs: RankStacks | None, missing_reason: str = "",
              options: SignatureOptions = DEFAULT_OPTIONS, cache: _ViewCache | None = None) -> RankView:
    """One rank's state from its main thread, or why there is none (``cache``: the views of stacks read so far)."""
    if rs is None:
        # Absence is evidence only when something tried to read the rank: an unreachable machine says so;
        # a file missing from a folder of dumps says nothing about the rank.
        unreachable = missing_reason.startswith("machine ") and " unreachable" in missing_reason
        return RankView(rank, RankState.UNREADABLE if unreachable else RankState.UNKNOWN,
                        reason=missing_reason or "no stacks in the snapshot")
    main = main_thread(rs.main) if rs.main.threads else None
    if main is None or not main.frames:
        why = missing_reason or ("main thread shows no Python frames (the process is exiting or not in Python yet)"
                                 if rs.main.threads else "no threads captured")
        text, state, wchan = unreadable_reason(rs.main.error, why)
        what = RankState.STOPPED if state in ("T", "t") else RankState.UNREADABLE
        if rs.main.threads is None and not _about_the_process(rs.main.error):
            what = RankState.UNKNOWN
        return RankView(rank, what, reason=text, process_state=state, wchan=wchan)
    if cache is not None:
        got = cache.view(main.frames, options)
        return RankView(rank, got.state, got.frame, got.site, got.direction, host_wait=got.host_wait,
                        native=got.native)
    return _stack_view(rank, main.frames, options)


def host_wait_frame(frames: Sequence[Frame]) -> str:
    """The frame where the host waits on its GPU, from the innermost frames up to the first Python one; "" if none.

    NCCL's collectives return once their kernel is queued: a rank waiting for
    a peer shows where its host next synchronises (design §8), natively
    ``cudaStreamSynchronize`` under ``_local_scalar_dense_cuda`` under
    ``item`` (``py-spy --native``), in Python ``torch.cuda.synchronize``.
    """
    for f in frames:
        name = f.name.split("(", 1)[0].strip()
        short = name.rsplit("::", 1)[-1].rsplit(".", 1)[-1]
        if f.native:
            if (_NATIVE_SYNC.match(short) or short in _SYNC_NAMES or short.startswith("_local_scalar_dense")
                    or (short in ("wait", "synchronize") and ("Work" in name or "Event" in name or "Stream" in name))):
                return frame_text(f)
            continue
        path = f.filename.replace("\\", "/")
        # (a Work's future waits on the host; torch.cuda's Event.wait only makes a stream wait, so it is not one)
        if (short in _SYNC_NAMES and "torch/" in path) or (short == "wait" and "torch/futures/" in path):
            return frame_text(f)
        return ""
    return ""


def _stack_view(rank: int, stack: tuple[Frame, ...], options: SignatureOptions) -> RankView:
    frames = [f for f in stack if not is_wrapper(f, options)]  # innermost first
    if not frames:
        return RankView(rank, RankState.COMPUTING, frame="(only wrapper frames)")
    host_wait = host_wait_frame(frames)
    native = any(f.native for f in frames)
    # A --native stack ends in native code (the CUDA runtime, libc, c10d): the state is read from its Python
    # frames; the native ones below them only say whether the host waits on its GPU.
    first_py = next((i for i, f in enumerate(frames) if not f.native), 0)
    frames = frames[first_py:]
    inner_text = frame_text(frames[0])
    kind = communication_kind(inner_text)
    if kind is not None:
        # The call site: the op, then the first frame outside torch.distributed and the comm helpers, with its line.
        i = 0
        while i + 1 < len(frames) and (_in_torch_distributed(frames[i + 1])
                                       or communication_kind(frame_text(frames[i + 1])) is not None):
            i += 1
        caller = frame_text(frames[i + 1], keep_lines=True) if i + 1 < len(frames) else "(top of stack)"
        site = f"{_short(frames[0].name)} <- {caller}"
        if kind == "p2p":
            names = " ".join(_short(f.name).lower() for f in frames[: i + 2])
            prev = any(w in names for w in _PREV_WORDS)
            nxt = any(w in names for w in _NEXT_WORDS)
            direction = "prev" if prev and not nxt else "next" if nxt and not prev else "both"
            return RankView(rank, RankState.P2P, frame=inner_text, site=site, direction=direction)
        return RankView(rank, RankState.COLLECTIVE, frame=inner_text, site=site)
    loader = next((i for i, f in enumerate(frames) if _base(f.filename) in _DATALOADER_FILES), None)
    if loader is not None:
        shown = " <- ".join(frame_text(f) for f in frames[max(loader - 1, 0):loader + 1])
        return RankView(rank, RankState.LOADING, frame=f"{shown} (waits for a batch from its DataLoader)")
    if (_short(frames[0].name), _base(frames[0].filename)) in _AUTOGRAD_ENGINE:
        # Resolved in follow_chain: gradient reduction when its DP peers wait in a collective, else compute.
        return RankView(rank, RankState.COMPUTING, frame=inner_text, site=BACKWARD_SITE, host_wait=host_wait,
                        native=native)
    return RankView(rank, RankState.COMPUTING, frame=inner_text, host_wait=host_wait, native=native)


def counted_waits(views: Mapping[int, RankView], waits: CounterWaits) -> dict[int, RankView]:
    """The views, with ranks the stacks show in their own work that the counters show waiting made waiters.

    NCCL returns from a collective (or an isend/irecv) once its kernel is
    queued; the host waits later, where it next synchronises (design §8). So a
    rank waiting for a peer shows ``<module>`` at the line calling ``.item()``,
    or backward: "computing" to the stacks. Such a rank is a waiter in the
    collective its counters show launched and unfinished (WC < WR) when
    either its host waits on its GPU (``host_wait_frame``), or the counters
    say whom it waits for (a member that never launched it: Aegis' CL rule; a
    peer that never posted the matching send/recv), or every member launched
    it (all wait in it together). A stack with native frames but no
    synchronisation among them shows the host busy in its own work: it stays
    so. A waiter's site names the collective by its communicator and launch
    count, so the members of one call share a site whichever line each host
    synchronises at.
    """
    out = dict(views)
    launched: dict[tuple[str, str, int], bool] = {}  # (comm, op, launch) -> every member launched it: once each

    def everyone(o: OpCounters) -> bool:
        key = (o.comm_id, o.op, o.cl)
        got = launched.get(key)
        if got is None:
            got = launched[key] = _everyone_launched(waits, o)
        return got

    for r, v in views.items():
        rc = waits.live.get(r)
        if v.state is not RankState.COMPUTING or rc is None:
            continue
        open_ops = [o for o in rc.ops if o.wc < o.wr]
        if not open_ops:
            continue
        host = v.host_wait or ("backward (DDP's gradient reduction waits on the GPU)" if v.site == BACKWARD_SITE
                               else "")
        if v.native and not host:
            continue  # its native frames show the host busy, not syncing: it is in its own work, whatever is open
        where = f"; its host waits at {host}" if host else ""
        edges = waits.graph.out.get(r, [])
        lagged = sorted(n for n in edges if isinstance(n, tuple))
        if lagged:
            cid, op, cl = lagged[0]
            never = sorted(m for m in waits.graph.out.get(lagged[0], []) if isinstance(m, int))
            out[r] = _counted(v, RankState.COLLECTIVE, cid, op, cl, waits, rc,
                              f"rank(s) {compact_ranks(never)} never launched it{where}")
            continue
        unposted = sorted(n for n in edges if isinstance(n, int))
        p2p = [o for o in open_ops if is_point_to_point(o.op) and o.open_peers]
        if unposted or (host and p2p):
            o = next((o for o in p2p if set(o.open_peers) & set(unposted)), p2p[0] if p2p else None)
            if o is not None:
                peers = tuple(sorted(set(unposted) & set(o.open_peers))) or o.open_peers
                out[r] = replace(
                    v, state=RankState.P2P, site=f"{o.op} on {_comm_name(waits, o.comm_id)} (queued, not finished)",
                    direction="", peers=peers,
                    counted=(f"{o.op} {direction_word(o.op)} rank(s) {compact_ranks(peers)} on "
                             f"{_comm_name(waits, o.comm_id)} is open (WC {o.wc} < WR {o.wr}){where}"))
                continue
        for o in sorted((o for o in open_ops if not is_point_to_point(o.op)), key=lambda o: (o.comm_id, o.op)):
            if host or everyone(o):
                why = f"every member launched it{where}" if everyone(o) else where[2:]
                out[r] = _counted(v, RankState.COLLECTIVE, o.comm_id, o.op, o.cl, waits, rc, why)
                break
    return out


def _comm_name(waits: CounterWaits, comm_id: str) -> str:
    comm = waits.table.comms.get(comm_id)
    return comm_label(comm) if comm is not None else f"comm {comm_id}"


def _everyone_launched(waits: CounterWaits, o: OpCounters) -> bool:
    """Whether every member of ``o``'s communicator with live counters launched ``o``'s op as often as ``o``'s rank."""
    comm = waits.table.comms.get(o.comm_id)
    by_rank = waits.table.of(o.comm_id).get(o.op, {})
    members = [m for m in (comm.ranks if comm is not None else ()) if m in waits.live]
    return len(members) > 1 and all((mo := by_rank.get(m)) is not None and mo.cl == o.cl for m in members)


def _counted(v: RankView, state: RankState, cid: str, op: str, cl: int, waits: CounterWaits, rc: RankCounters,
             why: str) -> RankView:
    name = _comm_name(waits, cid)
    mine = next((o for o in rc.ops if o.comm_id == cid and o.op == op), None)
    counts = f" (WC {mine.wc} < WR {mine.wr})" if mine is not None else ""
    return replace(v, state=state, site=f"{op} on {name}, launch {cl} (queued, not finished)",
                   counted=f"{op} launch {cl} on {name} is open{counts}" + (f": {why}" if why else ""))


def rank_views(stacks: Mapping[int, RankStacks], world: int, missing: Mapping[int, str],
               options: SignatureOptions = DEFAULT_OPTIONS) -> dict[int, RankView]:
    """Every rank of the job, read or not."""
    out: dict[int, RankView] = {}
    cache = _ViewCache()
    for rank in range(world):
        out[rank] = rank_view(rank, stacks.get(rank), missing.get(rank, ""), options, cache)
    for rank, rs in stacks.items():  # ranks beyond the layout's world still get a view
        if rank not in out:
            out[rank] = rank_view(rank, rs, missing.get(rank, ""), options, cache)
    return out


# --------------------------------------------------------------------------
# the chain
# --------------------------------------------------------------------------


class _Groups:
    """Every rank's group of each kind with more than one rank, and the whole job, by small ids.

    Groups are named by ``(kind, index)`` rather than by their member tuples,
    so a lookup never hashes a group of thousands of ranks.
    """

    def __init__(self, topology: Topology, ranks: Sequence[int]) -> None:
        self.kinds = tuple(k for k in DIMS if topology.size(k) > 1)
        self.index: dict[str, dict[int, int]] = {}
        self.members: dict[str, tuple[tuple[int, ...], ...]] = {}
        for kind in self.kinds:
            gid = group_ids(topology, kind)  # vector work: a 16k-rank job has thousands of groups per kind
            valid = np.flatnonzero(gid >= 0)
            order = valid[np.argsort(gid[valid], kind="stable")]
            cuts = np.flatnonzero(np.diff(gid[order])) + 1
            parts = np.split(order, cuts) if order.size else []
            groups = tuple(tuple(p.tolist()) for p in parts)
            self.members[kind] = groups
            first = {g[0]: i for i, g in enumerate(groups)}
            self.index[kind] = {r: first[g[0]] for g in groups for r in g}
        self.world = tuple(sorted(ranks))
        self.members["world"] = (self.world,)
        self.index["world"] = dict.fromkeys(self.world, 0)

    def gid(self, kind: str, rank: int) -> tuple[str, int]:
        i = self.index[kind].get(rank)
        # A rank in no group of the kind is a group of its own, named apart (a rank number may be negative in a
        # damaged capture, so it cannot be folded into the index's range).
        return (kind, i) if i is not None else (f"alone:{kind}", rank)

    def group(self, kind: str, rank: int) -> tuple[int, ...]:
        i = self.index[kind].get(rank)
        return self.members[kind][i] if i is not None else (rank,)

    def of_id(self, gid: tuple[str, int]) -> tuple[int, ...]:
        kind, i = gid
        return (i,) if kind.startswith("alone:") else self.members[kind][i]


_Key = tuple[RankState, str]


def follow_chain(views: Mapping[int, RankView], topology: Topology, majority: frozenset[int] = frozenset(),
                 counters: Mapping[int, RankCounters] | None = None, waits: CounterWaits | None = None) -> Chain:
    """Roots (ranks others wait on, with their victims), desyncs, and waiters explained by neither.

    ``counters`` (CL/WR/WC per communicator, or a flight recorder's as
    counters) tell desyncs the stacks cannot: ranks blocked in a send or recv
    whose peers wait in a collective they never launched (see
    ``rankscope.analyzers.ccl_desync``; ``waits``: their ``counter_waits``
    when the caller has built it already). Only such a crossed wait that no
    root explains is a desync here; the stacks' send/recv states add the
    waits the counters do not record.

    Searched backwards from the ranks that wait for nobody, except those of
    ``majority`` (the ranks of a stack group larger than any other): most of
    a job doing the same work is the job running, not where it stopped. A
    group's ranks
    are bucketed by call site once, so one step from a rank visits each
    (group, call site) pair once: the cost grows with the job, not its square.
    """
    groups = _Groups(topology, list(views))
    views = dict(views)
    _resolve_backward(views, groups)

    def at(rank: int) -> _Key:
        v = views.get(rank)
        return (v.state, v.site) if v is not None else (RankState.UNREADABLE, "")

    buckets: dict[tuple[str, int], dict[_Key, list[int]]] = {}

    def sites(gid: tuple[str, int]) -> dict[_Key, list[int]]:
        got = buckets.get(gid)
        if got is None:
            got = buckets[gid] = {}
            for m in groups.of_id(gid):
                got.setdefault(at(m), []).append(m)
        return got

    collective = {r for r, v in views.items() if v.state is RankState.COLLECTIVE}
    p2p = {r for r, v in views.items() if v.state is RankState.P2P}
    # A collective waiter whose layout groups are all complete at its site waits on the whole job.
    # (Decided once per group and call site: all the ranks at one site of one group get the same answer.)
    complete: dict[tuple[tuple[str, int], _Key], bool] = {}

    def whole_group_at(gid: tuple[str, int], key: _Key) -> bool:
        hit = complete.get((gid, key))
        if hit is None:
            hit = complete[(gid, key)] = len(sites(gid).get(key, ())) == len(groups.of_id(gid))
        return hit

    on_world = {r for r in collective if all(whole_group_at(groups.gid(k, r), at(r)) for k in groups.kinds)}
    p2p_targets = {r: _p2p_peers(r, views[r], groups) for r in p2p}  # empty: no pipeline known, wait on all
    p2p_on_world = {r for r, t in p2p_targets.items() if not t}
    world_id = ("world", 0)
    # Who waits on x through a send/recv toward it: inverted once, not searched in x's pipeline per step.
    p2p_waiters: dict[int, list[int]] = {}
    for m, targets in p2p_targets.items():
        for t in targets:
            p2p_waiters.setdefault(t, []).append(m)
    # Per (group, call site) where ranks wait: the members that wait on the group's other ranks, and those that
    # wait on the whole job (reached through the world scope); computed once per pair, however many ranks ask.
    waiting_by_group: dict[tuple[str, int], list[tuple[_Key, list[int]]]] = {}

    def waiting_sites(gid: tuple[str, int]) -> list[tuple[_Key, list[int]]]:
        got = waiting_by_group.get(gid)
        if got is None:
            whole = gid == world_id
            got = waiting_by_group[gid] = []
            for key, members in sites(gid).items():
                if key[0] is RankState.COLLECTIVE:
                    got.append((key, [m for m in members if (m in on_world) == whole]))
                elif key[0] is RankState.P2P:
                    got.append((key, [m for m in members if m in p2p_on_world] if whole else []))
        return got

    scopes: dict[int, tuple[tuple[str, int], ...]] = {}  # rank -> its groups' ids and the world's

    def waiters_of(x: int, done: set[tuple[tuple[str, int], _Key]]) -> list[int]:
        """The ranks that wait on ``x``."""
        mine = at(x)
        out: list[int] = []
        mine_scopes = scopes.get(x)
        if mine_scopes is None:
            mine_scopes = scopes[x] = (*(groups.gid(k, x) for k in groups.kinds), world_id)
        for gid in mine_scopes:
            for key, members in waiting_sites(gid):
                if key == mine or (gid, key) in done:
                    continue
                done.add((gid, key))
                out.extend(members)
        out.extend(p2p_waiters.get(x, ()))
        return out

    def victims_from(starts: Sequence[int]) -> set[int]:
        seen: set[int] = set()
        done: set[tuple[tuple[str, int], _Key]] = set()
        todo = list(starts)
        while todo:
            for w in waiters_of(todo.pop(), done):
                if w not in seen:
                    seen.add(w)
                    todo.append(w)
        return seen - set(starts)

    terminals = [r for r, v in sorted(views.items()) if v.state in TERMINAL and r not in majority]
    roots: list[Root] = []
    if len(terminals) <= _MAX_PER_ROOT_SEARCH:
        roots = [Root(t, views[t], tuple(sorted(victims_from([t]) - set(terminals)))) for t in terminals]
    else:
        shared = tuple(sorted(victims_from(terminals)))
        roots = [Root(t, views[t], shared) for t in terminals]
    roots = [r for r in roots if r.victims]
    roots.sort(key=lambda r: (-len(r.victims), r.rank))
    explained = {v for r in roots for v in r.victims}
    lost = {r for r in collective | p2p if r not in explained}
    crossed = _crossed(views, groups, counters, waits, p2p_targets, explained, victims_from) if counters else []
    in_crossed = {r for d in crossed for r in (*d.ranks, *d.victims)}
    # Communicators whose members all wait in one collective together (by the counters): a site of theirs is a
    # call on that communicator, never a mismatch on a group it splits.
    together = [frozenset(t.comm.ranks) for t in waiting_together(waits.table, waits.live)] if waits else []
    desyncs = crossed + _merge_across_kinds(_merge_alike(_desyncs(views, groups, lost - in_crossed, together)), views,
                                            groups)
    in_desync = {r for d in desyncs for r in (*d.ranks, *d.victims)}
    unexplained = tuple(sorted(r for r in lost if r not in in_desync))
    return Chain(views=views, roots=tuple(roots), desyncs=tuple(desyncs), unexplained=unexplained)


def _crossed(views: Mapping[int, RankView], groups: _Groups, counters: Mapping[int, RankCounters],
             waits: CounterWaits | None, p2p_targets: Mapping[int, set[int]], explained: set[int],
             victims_from: Callable[[Sequence[int]], set[int]]) -> list[Desync]:
    """The counters' crossed waits that no root explains, as desyncs with the chain's victims under them."""
    extra: dict[int, dict[int, str]] = {}
    for r, peers in p2p_targets.items():
        for p in peers:
            pv = views.get(p)
            if pv is not None and pv.state is not RankState.P2P:
                extra.setdefault(r, {})[p] = (f"rank {r} is in {views[r].site} toward rank {p}, which is not in a "
                                              f"send/recv ({pv.describe()})")
    out: list[Desync] = []
    for c in crossed_waits(counters, extra, waits):
        named = set(c.ranks)
        if named & explained or any(views[r].state in TERMINAL for r in named if r in views):
            continue  # a root explains these ranks, or the stacks show them in their own work: not a desync
        victims = {v for v in (set(c.victims) | victims_from(c.ranks)) - named
                   if v not in views or views[v].state not in TERMINAL}
        sides = []
        for side in (tuple(sorted(victims)), c.ranks):
            by_site: dict[str, list[int]] = {}
            for r in side:
                v = views.get(r)
                by_site.setdefault(v.site if v is not None and v.site else "(no stack)", []).append(r)
            sides += sorted(by_site.items(), key=lambda kv: (-len(kv[1]), min(kv[1])))
        members = set(c.members)
        kind = next((k for k in groups.kinds if set(groups.group(k, c.members[0])) == members),
                    "world" if members >= set(groups.world) else "comm")
        out.append(Desync(group_kind=kind, group=c.members, ranks=c.ranks, victims=tuple(sorted(victims)),
                          sites=tuple((site, tuple(rs)) for site, rs in sides), tie=c.tie,
                          communicator=c.communicator, evidence=c.evidence))
    return out


def _resolve_backward(views: dict[int, RankView], groups: _Groups) -> None:
    """Ranks idle in the autograd engine whose DP peers all wait in one collective: in the gradient reduction."""
    if "dp" not in groups.kinds:
        return
    for rank, v in list(views.items()):
        if v.state is not RankState.COMPUTING or v.site != BACKWARD_SITE:
            continue
        peers = [views.get(m) for m in groups.group("dp", rank) if m != rank]
        others = [p for p in peers if p is not None and p.site != BACKWARD_SITE]
        sites = {p.site for p in others if p.state is RankState.COLLECTIVE}
        if others and len(sites) == 1 and all(p.state is RankState.COLLECTIVE for p in others):
            views[rank] = RankView(rank, RankState.COLLECTIVE, frame=v.frame, site=BACKWARD_SITE)
        else:
            views[rank] = RankView(rank, RankState.COMPUTING, frame=v.frame)


def _p2p_peers(rank: int, v: RankView, groups: _Groups) -> set[int]:
    if v.peers:  # the counters name them
        return set(v.peers)
    if "pp" not in groups.kinds:
        return set()
    stages = groups.group("pp", rank)
    i = stages.index(rank)
    out: set[int] = set()
    if v.direction in ("prev", "both") and i > 0:
        out.add(stages[i - 1])
    if v.direction in ("next", "both") and i + 1 < len(stages):
        out.add(stages[i + 1])
    if not out:  # the words pointed past the pipeline's end: the direction guess was wrong, take both sides
        out = {stages[j] for j in (i - 1, i + 1) if 0 <= j < len(stages)}
    return out


def _desyncs(views: Mapping[int, RankView], groups: _Groups, lost: set[int],
             together: Sequence[frozenset[int]] = ()) -> list[Desync]:
    """Groups whose members all wait in collectives at two or more call sites, that no root explains."""
    out: list[Desync] = []
    seen: set[tuple[int, ...]] = set()
    candidates: list[tuple[str, tuple[int, ...]]] = []
    for kind in groups.kinds:
        for gid in {groups.gid(kind, r) for r in lost}:
            candidates.append((kind, groups.of_id(gid)))
    if not groups.kinds or not candidates:
        candidates.append(("world", groups.world))
    candidates.sort(key=lambda kg: (len(kg[1]), kg[1]))  # the smallest group that shows it
    taken: set[int] = set()
    job_wide: dict[str, int] = {}  # call site -> how many unexplained ranks of the whole job are there
    for r in lost:
        v = views.get(r)
        if v is not None:
            job_wide[v.site] = job_wide.get(v.site, 0) + 1
    for kind, group in candidates:
        if group in seen or taken & set(group) or len(group) < 2:
            continue
        seen.add(group)
        members = [views.get(m) for m in group]
        if any(m is None or m.state is not RankState.COLLECTIVE or m.rank not in lost for m in members):
            continue
        by_site: dict[str, list[int]] = {}
        for m in members:
            assert m is not None
            by_site.setdefault(m.site, []).append(m.rank)
        if len(by_site) < 2:
            continue
        # A site whose ranks complete a smaller group is a call on that group, not a mismatch on this one.
        if all(_complete_elsewhere(views, groups, kind, ranks, site) for site, ranks in by_site.items()):
            continue
        # Ranks held in a symmetric stall of another communicator (by the counters) are not off this group's
        # path: they are blocked in that call, which is the finding (rankscope.analyzers.not_a_rank).
        if any(set(ranks) <= t and all((v := views.get(m)) is not None and v.site == site for m in t)
               for site, ranks in by_site.items() for t in together):
            continue
        # On a tie within a small group, the call site most unexplained ranks of the whole job share is
        # the majority's (two-rank groups split 1-1; the job as a whole says which side strayed).
        sites = sorted(by_site.items(), key=lambda kv: (-len(kv[1]), -job_wide.get(kv[0], 0),
                                                        kv[0] == BACKWARD_SITE, min(kv[1])))
        tie = len(sites[1][1]) == len(sites[0][1])
        odd = sorted(r for _, ranks in sites[1:] for r in ranks)
        out.append(Desync(group_kind="world" if group == groups.world else kind, group=group, ranks=tuple(odd),
                          victims=tuple(sorted(sites[0][1])),
                          sites=tuple((s, tuple(sorted(r))) for s, r in sites), tie=tie))
        taken.update(group)
    return out


def _merge_alike(desyncs: list[Desync]) -> list[Desync]:
    """Desyncs of groups of one kind with the same call sites are one mismatch, told once.

    Two ranks of a tensor-parallel pair a step ahead split each of their two data-parallel pairs:
    that is one group of ranks off the majority's path, not two separate suspects.
    """
    merged: dict[tuple[str, tuple[str, ...]], list[Desync]] = {}
    for d in desyncs:
        merged.setdefault((d.group_kind, tuple(site for site, _ in d.sites)), []).append(d)
    out: list[Desync] = []
    for (kind, names), alike in merged.items():
        if len(alike) == 1:
            out.append(alike[0])
            continue
        sites = tuple((name, tuple(sorted({r for d in alike for r in dict(d.sites)[name]}))) for name in names)
        out.append(Desync(group_kind=kind, group=tuple(sorted({r for d in alike for r in d.group})),
                          ranks=tuple(sorted({r for d in alike for r in d.ranks})),
                          victims=tuple(sorted({r for d in alike for r in d.victims})),
                          sites=sites, tie=any(d.tie for d in alike)))
    return out


def _merge_across_kinds(desyncs: list[Desync], views: Mapping[int, RankView], groups: _Groups) -> list[Desync]:
    """Desyncs of groups of different kinds whose odd ones out stray to one call, from one majority call of the
    whole job, are one mismatch of the job.

    Two ranks of different pipeline stages and TP groups, each a step ahead in the same TP all-reduce while
    everyone else waits in the epoch-end barrier, split a TP group and a PP group: one extra step on two ranks,
    named together (issue 29), not two suspects of which the first would be taken.
    """
    world = groups.world
    if not desyncs:
        return desyncs
    by_sites: dict[tuple[str, ...], list[Desync]] = {}
    for d in desyncs:
        by_sites.setdefault(tuple(site for site, _ in d.sites), []).append(d)
    out: list[Desync] = []
    for names, alike in by_sites.items():
        majority = names[0]
        at_majority = tuple(sorted(r for r in world if (v := views.get(r)) is not None and v.site == majority))
        odd = tuple(sorted({r for d in alike for r in d.ranks}))
        # Several groups (of one kind or more) stray the same way, and with the majority's call they make the job.
        several = len(alike) > 1 or any(d.group_kind in groups.kinds and len(d.group) > len(groups.group(
            d.group_kind, d.group[0])) for d in alike)
        if not several or set(at_majority) | set(odd) != set(world) or len(world) < 3:
            out.extend(alike)
            continue
        sites = ((majority, at_majority),
                 *((name, tuple(sorted({r for d in alike for r in dict(d.sites).get(name, ())}))) for name in names[1:]))
        out.append(Desync(group_kind="world", group=tuple(sorted(world)), ranks=odd, victims=at_majority,
                          sites=sites, tie=False))
    return out


def _complete_elsewhere(views: Mapping[int, RankView], groups: _Groups, kind: str, ranks: list[int],
                        site: str) -> bool:
    if site == BACKWARD_SITE:
        return False  # the gradient reduction is on the data-parallel group
    for other in groups.kinds:
        if other == kind:
            continue
        g = groups.group(other, ranks[0])
        if len(g) < len(groups.group(kind, ranks[0])) and all(
                (v := views.get(m)) is not None and v.state is RankState.COLLECTIVE and v.site == site for m in g):
            return True
    return False


def desync_summary(d: Desync) -> str:
    where = ("the job" if d.group_kind == "world" else d.communicator if d.group_kind == "comm"
             else f"their {d.group_kind.upper()} group")
    if d.evidence and set(d.ranks) >= set(d.group):  # the whole group: a pair deadlocked on its send/recv
        return (f"desync: ranks {compact_ranks(d.ranks)} of {where} wait for each other's send/recv "
                "(one skipped or reordered a send)")
    if d.evidence:  # told by the counters: the odd ones out may wait in a send/recv, not a collective
        return (f"desync: ranks {compact_ranks(d.ranks)} and the other {len(d.victims)} ranks of {where} "
                "wait for each other at different calls")
    return (f"desync: ranks {compact_ranks(d.ranks)} are in a different collective from the other "
            f"{len(d.victims)} ranks of {where}")


def desync_evidence(d: Desync) -> tuple[str, ...]:
    lines = [f"{len(ranks)} rank(s) {compact_ranks(ranks)} at {site}" for site, ranks in d.sites]
    lines += d.evidence
    if d.tie and not d.evidence:
        lines.append(f"the two largest call sites tie at {len(d.sites[0][1])} ranks: ranks "
                     f"{compact_ranks(d.ranks)} named as the odd ones out by the rule (the site not in backward, "
                     "then the lowest rank, is taken as the majority); either side may be the one that strayed")
    if any(s == BACKWARD_SITE for s, _ in d.sites):
        lines.append("ranks shown in backward are read as inside its gradient reduction because their "
                     "data-parallel peers all wait in another collective; if that collective is this step's "
                     "gradient sync instead, those ranks are slow in backward")
    return tuple(lines)


__all__ = [
    "BACKWARD_SITE",
    "DESYNC_ADVICE",
    "TERMINAL",
    "Chain",
    "Desync",
    "RankState",
    "RankView",
    "Root",
    "counted_waits",
    "describe_process_state",
    "desync_evidence",
    "desync_summary",
    "follow_chain",
    "host_wait_frame",
    "rank_view",
    "rank_views",
    "unreadable_reason",
]
