"""The chain of waits' vocabulary: each rank's state, who waits on whom, and the words for them.

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

The pass computes them in stages (docs/analysis-pass.md): states in
``stage_rank_states``, the waits in ``stage_waits``, roots and desyncs in
``stage_roots``. This module holds only what they pass on and what later
readers (suspects, "not a rank", completeness, the views) read.

Pure: stdlib and the snapshot contract; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

import numpy as np
from rankscope.analyzers.topology import Topology, group_ids
from rankscope.contract.ranks import compact_ranks
from rankscope.contract.snapshot import DIMS, CaptureError, CaptureErrorKind

DESYNC_ADVICE = ("evicting machines will not cure it: a desync is usually a program mismatch (different data or "
                 "control flow on these ranks, e.g. an extra batch or a rank-dependent branch); fix the code or the "
                 "data split, then restart from the last checkpoint")
BACKWARD_SITE = "gradient reduction inside backward (autograd hooks, not visible to py-spy)"


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
    error_kind: CaptureErrorKind | None = None  # why its capture failed, as the capture typed it (None: it did not)

    def short(self) -> str:
        """A few words: "loading data", "unreadable: permission, process state D in nv_wait"."""
        if self.state not in (RankState.UNREADABLE, RankState.STOPPED, RankState.UNKNOWN):
            return self.state.value
        extra = [str(self.error_kind)] if self.error_kind is not None else []
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



def describe_process_state(state: str) -> str:
    words = {"D": "D (uninterruptible sleep, usually a driver or I/O call)", "T": "T (stopped)",
             "t": "t (stopped by a tracer)", "Z": "Z (zombie: exited, not reaped)", "R": "R (running)",
             "S": "S (sleeping)", "gone": "gone (the process no longer exists)"}
    return words.get(state, state)



class GroupId(NamedTuple):
    """A group by its kind and its number among that kind's groups; ``alone``: a rank in no group of the kind, a
    group of its own, and ``number`` is that rank (a rank number may be negative in a damaged capture, so it cannot
    be folded into the numbers' range)."""

    kind: str
    number: int
    alone: bool = False


WORLD_ID = GroupId("world", 0)
"""The whole job, as one group."""


class RankGroups:
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

    def gid(self, kind: str, rank: int) -> GroupId:
        i = self.index[kind].get(rank)
        return GroupId(kind, i) if i is not None else GroupId(kind, rank, alone=True)

    def group(self, kind: str, rank: int) -> tuple[int, ...]:
        i = self.index[kind].get(rank)
        return self.members[kind][i] if i is not None else (rank,)

    def of_id(self, gid: GroupId) -> tuple[int, ...]:
        return (gid.number,) if gid.alone else self.members[gid.kind][gid.number]



SiteKey = tuple[RankState, str]
"""Where a rank is: its state and call site (two ranks at one key wait in the same call)."""


class SiteIndex:
    """The ranks of each group bucketed by call site, built on first use (a group is read once, however many ask)."""

    __slots__ = ("buckets", "groups", "views")

    def __init__(self, views: Mapping[int, RankView], groups: RankGroups) -> None:
        self.views = views
        self.groups = groups
        self.buckets: dict[GroupId, dict[SiteKey, list[int]]] = {}

    def at(self, rank: int) -> SiteKey:
        v = self.views.get(rank)
        return (v.state, v.site) if v is not None else (RankState.UNREADABLE, "")

    def sites(self, gid: GroupId) -> dict[SiteKey, list[int]]:
        got = self.buckets.get(gid)
        if got is None:
            got = self.buckets[gid] = {}
            for m in self.groups.of_id(gid):
                got.setdefault(self.at(m), []).append(m)
        return got


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
    "WORLD_ID",
    "Chain",
    "Desync",
    "GroupId",
    "RankGroups",
    "RankState",
    "RankView",
    "Root",
    "SiteIndex",
    "SiteKey",
    "describe_process_state",
    "desync_evidence",
    "desync_summary",
    "unreadable_reason",
]
