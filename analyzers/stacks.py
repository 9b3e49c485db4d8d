"""Stack aggregation (ByteRobust §5.1): one signature per rank, ranks grouped by it.

A hung job has thousands of ranks, nearly all waiting in the same place. The
few that are somewhere else point at the fault. To see them, every rank's
stacks are reduced to a *signature* that leaves out what differs between
healthy ranks for no reason (addresses, by default line numbers, wrapper
frames of torch and of the interpreter), and ranks are grouped by equal
signatures. The largest group is taken as healthy, the rest as outliers.

A rank's signature covers its main thread, its other busy threads and its
subprocesses (dataloader workers, checkpoint writers): a worker stuck while
the main thread waits for it must make that rank stand out.

Speed: 16k ranks x 40 frames is 650k frames per capture. Each distinct frame
is normalised once and interned to an int; a thread is then a tuple of ints,
interned again, and ranks are grouped by an int per rank with numpy. Strings
are built only for the few distinct groups.

A prefix tree of all stacks (as LLNL's STAT draws it) shows where groups part
ways; it is built from the groups, not from the ranks, so its cost does not
grow with the job.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
from rankscope.contract.snapshot import Frame, ProcessRole, RankStacks, main_thread

# --------------------------------------------------------------------------
# options and results
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SignatureOptions:
    """What a signature keeps. The defaults suit a hang: coarse, stable, complete."""

    keep_lines: bool = False
    fold_wrappers: bool = True
    include_subprocesses: bool = True
    include_idle_threads: bool = False
    extra_wrappers: tuple[str, ...] = ()  # more function names to fold, e.g. a team's own decorators


DEFAULT_OPTIONS = SignatureOptions()


@dataclass(frozen=True, slots=True)
class Lane:
    """One part of a signature: one thread of a rank's main process or of one of its subprocesses.

    ``role`` is the process's role as the capture typed it (a DataLoader
    worker, a checkpoint writer); ``side_thread`` says the thread is not its
    process's main thread; ``frames`` are normalised, outermost first. The
    label is made from these for people; nothing reads it back.
    """

    role: ProcessRole
    side_thread: bool
    frames: tuple[str, ...]

    @property
    def label(self) -> str:
        return lane_label(self.role, self.side_thread)

    @property
    def is_main(self) -> bool:
        """The main thread of the rank's own process: the lane that says where the rank itself is."""
        return self.role is ProcessRole.MAIN and not self.side_thread


def lane_label(role: ProcessRole, side_thread: bool) -> str:
    """A lane's label as people read it: ``main``, ``main/thread``, ``dataloader``, ``dataloader/thread``."""
    return f"{role}/thread" if side_thread else str(role)


@dataclass(frozen=True, slots=True)
class StackGroup:
    """Ranks whose signatures are equal.

    ``frames`` are the main thread's normalised frames, outermost first;
    ``lanes`` are all the parts of the signature (main thread, other busy
    threads, subprocesses), each a typed ``Lane``.
    """

    signature: str
    ranks: tuple[int, ...]
    summary: str
    frames: tuple[str, ...]
    lanes: tuple[Lane, ...] = ()

    @property
    def main_summary(self) -> str:
        """The summary's first part, its first lane's (the main thread's): what a one-line legend shows."""
        return _lane_words(self.lanes[0]) if self.lanes else self.summary


@dataclass(frozen=True, slots=True)
class Grouping:
    """Groups largest first; indices into ``groups`` of the healthy and the outlier ones."""

    groups: tuple[StackGroup, ...]
    dominant: tuple[int, ...]
    outliers: tuple[int, ...]
    unseen: tuple[int, ...] = ()  # ranks whose main process could not be read
    notes: tuple[str, ...] = field(default=())
    tie: str = ""  # how a tie for largest was settled (the lowest rank's group taken as healthy); empty: no tie

    @property
    def outlier_ranks(self) -> tuple[int, ...]:
        return tuple(sorted(r for i in self.outliers for r in self.groups[i].ranks))


@dataclass(frozen=True, slots=True)
class PrefixNode:
    """One frame of the merged stack tree and the ranks whose stacks pass through it."""

    frame: str
    ranks: tuple[int, ...]
    children: tuple[PrefixNode, ...] = ()


_MAIN_LANE = lane_label(ProcessRole.MAIN, False)
_MAIN_THREADS = lane_label(ProcessRole.MAIN, True)

# --------------------------------------------------------------------------
# frame normalisation
# --------------------------------------------------------------------------

# Frames that only forward a call; folding them keeps signatures equal across
# torch versions, compiled/uncompiled modules and decorator stacks.
_WRAPPERS_BY_FILE: dict[str, frozenset[str]] = {
    "module.py": frozenset({"_call_impl", "_wrapped_call_impl"}),
    "c10d_logger.py": frozenset({"wrapper"}),
    "_contextlib.py": frozenset({"decorate_context"}),
    "eval_frame.py": frozenset({"_fn"}),
    "threading.py": frozenset({"_bootstrap", "_bootstrap_inner", "run"}),
    "contextlib.py": frozenset({"inner"}),
    "functools.py": frozenset({"wrapper", "_wrapper"}),
}
_WRAPPER_NAMES = frozenset({"wrapper", "_wrapper", "wrapped", "inner", "decorated"})

# Native frames of the interpreter itself (py-spy --native): the same on every rank.
_INTERPRETER_NATIVE = re.compile(
    r"^(_?Py|cfunction_|method_vectorcall|slot_tp_|vectorcall|_start$|__libc_start|start_thread$|clone3?$)"
)

# A non-main thread whose innermost frame is one of these is parked, not working.
_IDLE = {
    "threading.py": frozenset({"wait", "_wait_for_tstate_lock", "join", "acquire"}),
    "queue.py": frozenset({"get", "put", "wait"}),
    "selectors.py": frozenset({"select", "poll"}),
    "socket.py": frozenset({"accept", "recv", "recv_into"}),
    "connection.py": frozenset({"wait", "poll", "_poll", "_recv", "_recv_bytes", "recv", "accept"}),
    "synchronize.py": frozenset({"wait", "__enter__"}),
    "pin_memory.py": frozenset({"do_one_step"}),
}

_OWN_PLUGIN = "/ccl_plugin/"

_ADDRESS = re.compile(r"\s*(\+\s*)?0x[0-9a-fA-F]+")


def _short(name: str) -> str:
    """The function's own name: py-spy 0.4 qualifies methods (``Thread.run``)."""
    return name.rsplit(".", 1)[-1]


def _basename(filename: str) -> str:
    return filename.replace("\\", "/").rsplit("/", 1)[-1]


def frame_text(frame: Frame, keep_lines: bool = False) -> str:
    """``name (file.py)`` or ``name (file.py:123)``; no addresses, no directories.

    Directories are dropped because the same code lives under different paths
    on different machines (virtual environments, user homes).
    """
    name = _ADDRESS.sub("", frame.name).strip() or "?"
    base = _ADDRESS.sub("", _basename(frame.filename)).strip()
    if keep_lines and frame.line is not None:
        return f"{name} ({base}:{frame.line})" if base else name
    return f"{name} ({base})" if base else name


def is_wrapper(frame: Frame, options: SignatureOptions) -> bool:
    # rankscope's own CCL plugin wraps torch.distributed calls; its frames are instrumentation and are
    # always folded, so a job looks the same with the plugin loaded or not.
    if _OWN_PLUGIN in frame.filename.replace("\\", "/"):
        return True
    if not options.fold_wrappers:
        return False
    if frame.native and _INTERPRETER_NATIVE.match(frame.name):
        return True
    short = _short(frame.name)
    base = _basename(frame.filename)
    by_file = _WRAPPERS_BY_FILE.get(base)
    if by_file is not None and short in by_file:
        return True
    return short in _WRAPPER_NAMES or short in options.extra_wrappers


class _Interner:
    """Frames and lanes to small ints, so signatures compare and hash as int tuples.

    The per-frame work is two C-level ``map`` calls (attribute getter, dict
    lookup); a frame is normalised in Python only the first time it is seen.
    A thread's raw id tuple (wrappers still in, as -1) is interned per lane
    label, so folding and the idle test also run once per distinct stack.
    """

    __slots__ = (
        "_by_object",
        "_frame_ids",
        "_get",
        "_idle_ids",
        "_key",
        "_lane_idle",
        "_lane_ids",
        "_lane_kinds",
        "_raw",
        "frame_texts",
        "lanes",
        "options",
    )

    def __init__(self, options: SignatureOptions) -> None:
        self.options = options
        self._frame_ids: dict[tuple[object, ...], int] = {}
        self._get = self._frame_ids.get
        self._key = (operator.attrgetter("name", "filename", "line") if options.keep_lines
                     else operator.attrgetter("name", "filename"))
        self.frame_texts: list[str] = []
        self._idle_ids: set[int] = set()
        self._raw: dict[str, dict[tuple[int | None, ...], int]] = {}
        # A capture's decoder and a bundle's reader share one tuple object between the ranks whose stacks are
        # identical: its lane is found by identity, with no frame looked at (the tuple is kept, so its id holds).
        self._by_object: dict[tuple[str, int], tuple[tuple[Frame, ...], int]] = {}
        self._lane_ids: dict[tuple[str, tuple[int, ...]], int] = {}
        self._lane_idle: list[bool] = []
        self._lane_kinds: list[tuple[ProcessRole, bool]] = []  # each lane's role and side_thread (see Lane)
        self.lanes: list[tuple[str, tuple[int, ...]]] = []

    def _add_frame(self, frame: Frame) -> None:
        key = self._key(frame)
        if key in self._frame_ids:
            return
        if is_wrapper(frame, self.options):
            fid = -1
        else:
            fid = len(self.frame_texts)
            self.frame_texts.append(frame_text(frame, self.options.keep_lines))
            if _short(frame.name) in _IDLE.get(_basename(frame.filename), ()):
                self._idle_ids.add(fid)
        self._frame_ids[key] = fid

    def thread_lane(self, label: str, frames: tuple[Frame, ...], role: ProcessRole, side_thread: bool) -> int:
        """The lane id of one thread's stack under ``label``: ``lane_label(role, side_thread)``, made once per
        process by the caller, so each thread's lookup hashes a string."""
        seen = self._by_object.get((label, id(frames)))
        if seen is not None and seen[0] is frames:
            return seen[1]
        lid = self._thread_lane(label, frames, role, side_thread)
        self._by_object[(label, id(frames))] = (frames, lid)
        return lid

    def _thread_lane(self, label: str, frames: tuple[Frame, ...], role: ProcessRole, side_thread: bool) -> int:
        raw: tuple[int | None, ...] = tuple(map(self._get, map(self._key, frames)))
        by_raw = self._raw.get(label)
        if by_raw is None:
            by_raw = self._raw[label] = {}
        lid = by_raw.get(raw)  # a raw tuple holding None (an unseen frame) is never stored, so it misses
        if lid is None and None in raw:
            for f in frames:
                self._add_frame(f)
            raw = tuple(map(self._get, map(self._key, frames)))
            lid = by_raw.get(raw)
        if lid is None:
            ids = tuple(i for i in raw if i is not None and i >= 0)
            key = (label, ids)
            lid = self._lane_ids.get(key)
            if lid is None:
                lid = len(self.lanes)
                self._lane_ids[key] = lid
                self.lanes.append(key)
                self._lane_kinds.append((role, side_thread))
                self._lane_idle.append(not ids or ids[0] in self._idle_ids)
            by_raw[raw] = lid
        return lid

    def lane(self, lane_id: int) -> Lane:
        """A lane with its frames as text, outermost first (the order people read a tree in)."""
        ids = self.lanes[lane_id][1]
        texts = self.frame_texts
        role, side_thread = self._lane_kinds[lane_id]
        return Lane(role, side_thread, tuple(texts[i] for i in reversed(ids)))


def _rank_lanes(interner: _Interner, rs: RankStacks) -> tuple[int, ...]:
    """The rank's signature as lane ids: its main thread first, then the rest as a sorted set.

    A set, because ranks differ in how many identical idle workers they run,
    and thread or process order means nothing. (Written flat: this runs once
    per rank of a 16k-rank job.)
    """
    lane = interner.thread_lane
    idle = interner._lane_idle
    keep_idle = interner.options.include_idle_threads
    threads = rs.main.threads or ()
    main = main_thread(rs.main)
    main_lane = lane(_MAIN_LANE, main.frames if main is not None else (), ProcessRole.MAIN, False)
    others: list[int] = []
    if len(threads) > 1:
        for t in threads:
            if t is not main:
                lid = lane(_MAIN_THREADS, t.frames, ProcessRole.MAIN, True)
                if keep_idle or not idle[lid]:
                    others.append(lid)
    if interner.options.include_subprocesses:
        for sub in rs.subprocesses:
            if not sub.threads:
                continue  # a worker that exited mid-capture is not evidence; see Grouping.notes
            role = sub.role
            label, thread_label = lane_label(role, False), lane_label(role, True)
            sub_main = main_thread(sub)
            for t in sub.threads:
                lid = (lane(label, t.frames, role, False) if t is sub_main
                       else lane(thread_label, t.frames, role, True))
                if keep_idle or not idle[lid]:
                    others.append(lid)
    if not others:
        return (main_lane,)
    return (main_lane, *sorted(set(others)))


# --------------------------------------------------------------------------
# grouping
# --------------------------------------------------------------------------


def _lane_words(lane: Lane) -> str:
    """One lane of a signature in a few words: its innermost frame and that frame's caller."""
    frames = lane.frames
    if not frames:
        return f"[{lane.label}] (no Python frames)"
    inner = frames[-1]
    text = inner if len(frames) < 2 else f"{inner} <- {frames[-2].split(' (', 1)[0]}"
    return text if lane.is_main else f"[{lane.label}] {text}"


def _summary(lanes: tuple[Lane, ...]) -> str:
    return " | ".join(_lane_words(lane) for lane in lanes)


def group_stacks(stacks: Mapping[int, RankStacks], options: SignatureOptions = DEFAULT_OPTIONS) -> Grouping:
    """Group ranks by signature; the largest group is dominant, the others are outliers.

    When several groups tie for largest, the one holding the lowest rank is
    taken and a note says so (the suspect ranking may pick another, see
    ``rankscope.analyzers.suspects``). When no two ranks agree, nobody is
    dominant and there are no outliers: there is no majority to compare with.
    """
    interner = _Interner(options)
    rank_ids: list[int] = []
    sig_ids: list[int] = []
    sig_index: dict[tuple[int, ...], int] = {}
    sig_keys: list[tuple[int, ...]] = []
    unseen: list[int] = []
    lost_workers = 0
    for rank in sorted(stacks):
        rs = stacks[rank]
        main = main_thread(rs.main) if rs.main.threads else None
        if main is None or not main.frames:
            # No Python frames: the interpreter is exiting or not running Python yet; nothing to compare.
            unseen.append(rank)
            continue
        lost_workers += sum(1 for s in rs.subprocesses if s.threads is None)
        key = _rank_lanes(interner, rs)
        sid = sig_index.get(key)
        if sid is None:
            sid = len(sig_keys)
            sig_index[key] = sid
            sig_keys.append(key)
        rank_ids.append(rank)
        sig_ids.append(sid)

    notes: list[str] = []
    if lost_workers:
        notes.append(f"{lost_workers} subprocess(es) could not be read and were left out of the signatures")
    groups = _build_groups(interner, np.asarray(rank_ids, dtype=np.int64), np.asarray(sig_ids, dtype=np.int64),
                           sig_keys)
    dominant, outliers, more, tie = _choose_dominant(groups)
    notes.extend(more)
    return Grouping(groups=groups, dominant=dominant, outliers=outliers, unseen=tuple(unseen), notes=tuple(notes),
                    tie=tie)


def _build_groups(
    interner: _Interner, ranks: np.ndarray, sig_ids: np.ndarray, sig_keys: list[tuple[int, ...]]
) -> tuple[StackGroup, ...]:
    if ranks.size == 0:
        return ()
    order = np.argsort(sig_ids, kind="stable")
    sorted_ids = sig_ids[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])
    ends = np.r_[starts[1:], sorted_ids.size]
    members = [(int(sorted_ids[s]), ranks[order[s:e]]) for s, e in zip(starts, ends, strict=True)]
    # Largest first; among equals the group holding the lowest rank first, so output is stable.
    members.sort(key=lambda m: (-m[1].size, int(m[1][0])))
    out: list[StackGroup] = []
    for sid, member_ranks in members:
        lanes = tuple(interner.lane(lid) for lid in sig_keys[sid])
        signature = "\n".join(f"[{lane.label}]\n" + "\n".join(f"  {f}" for f in lane.frames) for lane in lanes)
        out.append(StackGroup(
            signature=signature,
            ranks=tuple(member_ranks.tolist()),
            summary=_summary(lanes),
            frames=lanes[0].frames,
            lanes=lanes,
        ))
    return tuple(out)


def _choose_dominant(groups: tuple[StackGroup, ...]) -> tuple[tuple[int, ...], tuple[int, ...], list[str], str]:
    """The healthy groups, the outliers, notes, and how a tie for largest was settled (``Grouping.tie``)."""
    if not groups:
        return (), (), [], ""
    sizes = [len(g.ranks) for g in groups]
    if len(groups) > 1 and sizes[0] == 1:
        return (), (), [f"no two of the {len(groups)} ranks show the same stacks: there is no majority to compare "
                         "with"], ""
    tied = [i for i, s in enumerate(sizes) if s == sizes[0]]
    tie = f"{len(tied)} groups of {sizes[0]} ranks tie for largest; group 0 (lowest rank) taken as healthy" \
        if len(tied) > 1 else ""
    return (0,), tuple(range(1, len(groups))), [], tie


def with_dominant(grouping: Grouping, dominant: Iterable[int]) -> Grouping:
    """The same groups with another choice of healthy groups (the rest become outliers)."""
    dom = tuple(sorted(set(dominant)))
    outliers = tuple(i for i in range(len(grouping.groups)) if i not in dom)
    return Grouping(groups=grouping.groups, dominant=dom, outliers=outliers, unseen=grouping.unseen,
                    notes=grouping.notes, tie=grouping.tie)


# --------------------------------------------------------------------------
# prefix tree and divergence
# --------------------------------------------------------------------------


def tree_from_grouping(grouping: Grouping) -> PrefixNode:
    """The STAT-style tree: root -> lane label -> frames outermost first, with rank sets.

    Built from the distinct groups: a node's ranks are the union of the
    groups that pass through it. Without recursion and in memory linear in
    the frames: a stack thousands of frames deep (recursive models, deep
    autograd, generated code) is one long chain of nodes.
    """
    # Node n: its frame, its children (step -> node, in insertion order) and the groups passing through it.
    # Children are always numbered after their parent, so building from the last node back to the root meets
    # every child before its parent.
    labels: list[str] = ["all ranks"]
    children: list[dict[str, int]] = [{}]
    through: list[set[int]] = [set()]
    for gi, group in enumerate(grouping.groups):
        through[0].add(gi)
        for lane in group.lanes:
            node = 0
            for step in (f"[{lane.label}]", *lane.frames):
                kid = children[node].get(step)
                if kid is None:
                    kid = children[node][step] = len(labels)
                    labels.append(step)
                    children.append({})
                    through.append(set())
                through[kid].add(gi)
                node = kid
    cache: dict[frozenset[int], tuple[int, ...]] = {}
    arrays = [np.asarray(g.ranks, dtype=np.int64) for g in grouping.groups]

    def ranks_for(gids: set[int]) -> tuple[int, ...]:
        key = frozenset(gids)
        got = cache.get(key)
        if got is None:
            parts = [arrays[i] for i in sorted(key)]
            got = tuple(np.sort(np.concatenate(parts)).tolist()) if parts else ()
            cache[key] = got
        return got

    built: list[PrefixNode | None] = [None] * len(labels)
    for n in range(len(labels) - 1, -1, -1):
        kids = [built[k] for k in children[n].values()]
        built[n] = PrefixNode(frame=labels[n], ranks=ranks_for(through[n]),
                              children=tuple(sorted((k for k in kids if k is not None),
                                                    key=lambda c: (-len(c.ranks), c.ranks[:1]))))
        for k in children[n].values():
            built[k] = None  # held by its parent now; the list keeps no second reference
    root = built[0]
    assert root is not None
    return root


def _common_prefix(a: tuple[str, ...], b: tuple[str, ...]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def diverging_frame(grouping: Grouping, group: StackGroup) -> str | None:
    """Where ``group`` leaves the healthy path: its first frame that no dominant stack has there.

    Main-thread differences come first; a subprocess or thread lane is
    prefixed with its label. None for a dominant group, or when nothing
    differs (which cannot happen for two distinct groups).
    """
    if not grouping.dominant:
        return None
    healthy = grouping.groups[grouping.dominant[0]]
    if group is healthy or group.signature == healthy.signature:
        return None
    healthy_lanes: dict[tuple[ProcessRole, bool], list[tuple[str, ...]]] = {}
    for lane in healthy.lanes:
        healthy_lanes.setdefault((lane.role, lane.side_thread), []).append(lane.frames)
    for lane in group.lanes:
        frames, label = lane.frames, lane.label
        candidates = healthy_lanes.get((lane.role, lane.side_thread), [])
        if frames in candidates:
            continue
        prefix = "" if lane.is_main else f"[{label}] "
        if not candidates:
            return f"{prefix}{frames[0] if frames else '(no frames)'} (a {label} lane the healthy ranks lack)"
        best = max(candidates, key=lambda c: _common_prefix(c, frames))
        n = _common_prefix(best, frames)
        if n < len(frames):
            return f"{prefix}{frames[n]}"
        return f"{prefix}{frames[-1] if frames else '(no frames)'} (stops here; healthy ranks go deeper)"
    # Everything of the group is also in the healthy group: the healthy one has an extra lane.
    missing = [lane.label for lane in healthy.lanes if lane not in group.lanes]
    if missing:
        return f"[{missing[0]}] lane missing (healthy ranks have it)"
    return None
