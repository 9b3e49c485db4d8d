"""Who the pipeline keeps waiting on, poll after poll (Aegis §4.2's computation side, over time)."""

from __future__ import annotations

import math
from collections import Counter, deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from rankscope.contract.ranks import compact_ranks
from rankscope.contract.snapshot import RankCounters
from rankscope.contract.vocabulary import is_point_to_point


@dataclass(frozen=True, slots=True)
class PeerWait:
    """A rank its pipeline peers keep waiting on, against its data-parallel peers."""

    rank: int
    waited: int  # polls in which some peer had an open send/recv naming it
    polls: int
    peers_mean: float  # the same count, averaged over its data-parallel peers
    peers: tuple[int, ...]

    @property
    def ratio(self) -> float:
        return self.waited / self.peers_mean if self.peers_mean > 0 else math.inf

    def evidence(self) -> str:
        against = (f"{self.ratio:.1f}× its data-parallel peers (rank {compact_ranks(self.peers)}: "
                   f"{self.peers_mean:.0f})" if self.peers_mean > 0 else
                   f"never its data-parallel peers (rank {compact_ranks(self.peers)})")
        return f"peers waited on rank {self.rank} (open send/recv) in {self.waited} of the last {self.polls} polls, {against}"


class PeerWaitTally:
    """Who the pipeline keeps waiting on, poll after poll (Aegis §4.2's computation side, over time).

    An open point-to-point request on rank A naming peer B means A is waiting
    for B's side of the transfer: B has not launched it yet. In a healthy
    pipeline every stage waits on its neighbours part of the time, and the
    ranks at the same place of the other data-parallel replicas (its
    ``DATA_PARALLEL_GROUP``) are waited on about as often. A rank that
    computes, sends or is fed slowly is waited on far more often than they
    are: its own replica's other stage stalls on it step after step. Counting
    this per poll narrows a slow replica (which the collectives' late-arriver
    test sees as a whole) to the rank holding it up. Without recorded
    data-parallel groups, all other ranks are the peers; with one recorded
    but no replica (DP=1) nobody is compared and nobody blamed.
    """

    def __init__(self, window: int) -> None:
        self._polls: deque[set[int]] = deque(maxlen=max(1, window))
        self._pairs: deque[set[tuple[int, int]]] = deque(maxlen=max(1, window))  # (waiter, waited on) per poll
        self._dp: dict[int, tuple[int, ...]] = {}
        self._ranks: set[int] = set()

    def add(self, counters: Mapping[int, RankCounters]) -> None:
        waited: set[int] = set()
        pairs: set[tuple[int, int]] = set()
        for r, rc in counters.items():
            if rc.error is not None or rc.stale:
                continue
            self._ranks.add(r)
            for c in rc.communicators:
                if "DATA_PARALLEL" in c.description.upper() and r in c.ranks:
                    self._dp[r] = tuple(x for x in c.ranks if x != r)
            for o in rc.ops:
                if is_point_to_point(o.op):
                    waited.update(p for p in o.open_peers if p != r)
                    pairs.update((r, p) for p in o.open_peers if p != r)
        self._polls.append(waited)
        self._pairs.append(pairs)

    def polls(self) -> int:
        return len(self._polls)

    def waits_on(self, waiters: Collection[int], waited: Collection[int]) -> int:
        """Polls in which some rank of ``waiters`` had an open send/recv naming a rank of ``waited``."""
        return sum(1 for pairs in self._pairs if any(a in waiters and b in waited for a, b in pairs))

    def blamed(self, min_polls: int, min_share: float, ratio: float) -> list[PeerWait]:
        polls = len(self._polls)
        if polls < min_polls:
            return []
        counts = Counter(r for waited in self._polls for r in waited)
        # It must still be so now: a burst early in the window must not carry
        # a rank over the bar after the burst is over.
        recent = list(self._polls)[-max(5, polls // 3):]
        now = Counter(r for waited in recent for r in waited)
        out = []
        for r in sorted(self._ranks):
            # A recorded data-parallel group without other members (DP=1) has no replica to compare with: in a
            # pipeline one stage's ranks are always waited on more than the other's (on a GPU job a recv posted
            # ahead stays open on the device), which compared with all ranks blamed a healthy first stage.
            peers = self._dp[r] if r in self._dp else tuple(x for x in sorted(self._ranks) if x != r)
            if not peers:
                continue
            mean = sum(counts.get(p, 0) for p in peers) / len(peers)
            n = counts.get(r, 0)
            if n >= min_share * polls and n >= ratio * mean and now.get(r, 0) >= min_share * len(recent):
                out.append(PeerWait(r, n, polls, mean, peers))
        return out
