"""Stage 2 of the pass (docs/analysis-pass.md): every rank's state, from its stacks and its counters.

Takes ``stage_evidence.Evidence``; passes on ``RankStates``: each rank's
``RankView`` (``rankscope.analyzers.chain`` says what the states mean). The
main thread says where a rank is; a busy subprocess or thread the healthy
ranks lack makes its rank computing or loading whatever its main thread
shows; the counters turn a rank "computing" to its stacks into a waiter when
its host waits on a collective or send/recv it launched (``counted_waits``).

Pure: stdlib, numpy and the snapshot contract; no I/O.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from rankscope.analyzers.ccl_desync import CounterWaits, comm_label
from rankscope.analyzers.chain import BACKWARD_SITE, RankState, RankView, unreadable_reason
from rankscope.analyzers.origins import origins_of
from rankscope.analyzers.stacks import (
    DEFAULT_OPTIONS,
    SignatureOptions,
    frame_text,
    is_wrapper,
)
from rankscope.analyzers.stage_evidence import Evidence
from rankscope.contract.frames import communication_kind
from rankscope.contract.ranks import compact_ranks
from rankscope.contract.snapshot import (
    CaptureError,
    CaptureErrorKind,
    Frame,
    OpCounters,
    ProcessRole,
    RankCounters,
    RankStacks,
    main_thread,
)
from rankscope.contract.vocabulary import direction_word, is_point_to_point


@dataclass(frozen=True, slots=True)
class RankStates:
    """Every rank's state; ``counted``: rank -> "p2p" / "collective" where only the counters show the wait."""

    evidence: Evidence
    views: Mapping[int, RankView]
    counted: Mapping[int, str]


def rank_states(evidence: Evidence) -> RankStates:
    """Each rank's ``RankView``: its stacks read, busy side processes and the counters' waits applied."""
    views = rank_views(evidence.stacks, evidence.topology.world_size, evidence.missing, evidence.options,
                       evidence.unreachable)
    for o in origins_of(evidence.grouping):
        # A busy subprocess or thread the healthy ranks lack (a stuck DataLoader worker) makes its rank wait on
        # it whatever its main thread shows: the rank is where a chain can end.
        if o.side == "compute" and not o.lane.is_main:
            state = RankState.LOADING if o.lane.role is ProcessRole.DATALOADER else RankState.COMPUTING
            for r in o.ranks:
                views[r] = RankView(r, state, frame=f"[{o.lane.label}] {o.frame}")
    counted: dict[int, str] = {}
    if evidence.waits is not None:
        views = counted_waits(views, evidence.waits)  # asynchronous collectives: a host syncing on its GPU waits
        counted = {r: ("p2p" if v.state is RankState.P2P else "collective") for r, v in views.items()
                   if v.counted and v.state in (RankState.P2P, RankState.COLLECTIVE)}
    return RankStates(evidence, views, counted)


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
              options: SignatureOptions = DEFAULT_OPTIONS, cache: _ViewCache | None = None, *,
              unreachable: bool = False) -> RankView:
    """One rank's state from its main thread, or why there is none (``cache``: the views of stacks read so far;
    ``unreachable``: the rank's machine could not be reached)."""
    if rs is None:
        # Absence is evidence only when something tried to read the rank: an unreachable machine says so;
        # a file missing from a folder of dumps says nothing about the rank.
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
        return RankView(rank, what, reason=text, process_state=state, wchan=wchan,
                        error_kind=rs.main.error.kind if rs.main.error is not None else None)
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
        # Resolved in the waits stage: gradient reduction when its DP peers wait in a collective, else compute.
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
               options: SignatureOptions = DEFAULT_OPTIONS, unreachable: Collection[int] = ()) -> dict[int, RankView]:
    """Every rank of the job, read or not (``unreachable``: the ranks of machines whose agent was not reached)."""
    out: dict[int, RankView] = {}
    cache = _ViewCache()
    for rank in range(world):
        out[rank] = rank_view(rank, stacks.get(rank), missing.get(rank, ""), options, cache,
                              unreachable=rank in unreachable)
    for rank, rs in stacks.items():  # ranks beyond the layout's world still get a view
        if rank not in out:
            out[rank] = rank_view(rank, rs, missing.get(rank, ""), options, cache)
    return out



__all__ = ["RankStates", "counted_waits", "host_wait_frame", "rank_states", "rank_view", "rank_views"]
