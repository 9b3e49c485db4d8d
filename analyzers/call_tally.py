"""The CCL counters kept over calls: per key, was it flagged in each of its last calls (``CallTally``); which call
of each collective the members last completed (``collective_calls``); the rank slow links share
(``narrow_to_common_end``)."""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Generic, TypeVar

from rankscope.analyzers.degradation import compared_ops, inverse_throughput
from rankscope.contract.snapshot import RankCounters


def narrow_to_common_end(groups: Sequence[Iterable[int]]) -> tuple[int, ...]:
    """The ranks present in more of the slow groups (links, communicators) than any other.

    Aegis §5.2 narrows the GPUs that suffer slow communication to the source or
    destination they share, like RootDiag in its Algorithm 1: if G is the
    culprit, every slow link touches G. Returns () when no rank is in two of
    the groups, which points at the network rather than a host.
    """
    sets = [set(g) for g in groups if g]
    if len(sets) < 2:
        return tuple(sorted(sets[0])) if sets else ()
    counts = Counter(r for s in sets for r in s)
    best = max(counts.values())
    if best < 2:
        return ()
    return tuple(sorted(r for r, c in counts.items() if c == best))


K = TypeVar("K", bound=Hashable)


class CallTally(Generic[K]):
    """Per key (a rank, a rank on a communicator): was it flagged, in each of its last calls?

    A call is counted once, however many polls still show it as the latest.
    """

    def __init__(self, window: int, remember: int = 4096) -> None:
        self.window = window
        self._marks: dict[K, deque[bool]] = {}
        self._seen: dict[tuple[object, ...], None] = {}  # insertion-ordered, bounded
        self._remember = remember

    def add(self, call: tuple[object, ...], members: Iterable[K], flagged: set[K]) -> None:
        if call in self._seen:
            return
        self._seen[call] = None
        if len(self._seen) > self._remember:
            del self._seen[next(iter(self._seen))]
        for k in members:
            self._marks.setdefault(k, deque(maxlen=self.window)).append(k in flagged)

    def hits(self, key: K) -> tuple[int, int]:
        """(flagged, seen) over the key's last calls; (0, 0) for a key never seen."""
        marks = self._marks.get(key)
        return (sum(marks), len(marks)) if marks else (0, 0)

    def tallied(self) -> Iterable[K]:
        """Every key seen."""
        return self._marks.keys()

    def persistent(self, min_calls: int, fraction: float) -> dict[K, tuple[int, int]]:
        """Keys flagged in at least ``fraction`` of their last calls (at least ``min_calls`` seen): (hits, calls)."""
        out: dict[K, tuple[int, int]] = {}
        for k, marks in self._marks.items():
            hits = sum(marks)
            if len(marks) >= min_calls and hits >= fraction * len(marks):
                out[k] = (hits, len(marks))
        return out


def collective_calls(counters: Mapping[int, RankCounters]) -> dict[tuple[str, str], tuple[int, list[int], list[int]]]:
    """Per (communicator, collective op): the call most members last completed, and who has TD / N for it.

    The same ops as ``degradation.degradation_findings`` (``compared_ops``:
    members compared on one call), so the ranks tallied are the ranks that
    analysis compared.
    """
    rows: dict[tuple[str, str], dict[int, tuple[int, bool, bool]]] = {}
    for r, o in compared_ops(counters):
        has_td = o.last_duration_s is not None and o.last_duration_s > 0
        has_n = inverse_throughput(o.recent_throughput) is not None
        rows.setdefault((o.comm_id, o.op), {})[r] = (o.wc, has_td, has_n)
    out: dict[tuple[str, str], tuple[int, list[int], list[int]]] = {}
    for key, per_rank in rows.items():
        counts = Counter(v[0] for v in per_rank.values())
        call = max(counts, key=lambda c: (counts[c], c))
        same = {r: v for r, v in per_rank.items() if v[0] == call}
        out[key] = (call, sorted(r for r, v in same.items() if v[1]), sorted(r for r, v in same.items() if v[2]))
    return out
