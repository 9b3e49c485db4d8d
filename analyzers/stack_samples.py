"""A straggler from sampled stacks alone: the rank that rarely waits while its peers wait for it.

A job started without ``rankscope run`` has no counters, so no step times and
no late arrivers; a few one-shot stack captures catch the slow rank only by
chance. Sampling every rank's main thread a few times a second (py-spy's
non-blocking mode: the rank is never paused) and classifying each sample
gives, per rank, the share of its time spent *waiting for other ranks* (in a
collective or a point-to-point transfer). In a synchronous job the slow rank
is the one that rarely waits: everyone else spends the extra time it takes in
their collectives and receives, waiting for it.

The test. For rank r with ``k`` waiting samples out of ``n``, and its peers
(every other sampled rank: the whole job meets in the data-parallel
all-reduce, so all of them end up waiting for it) with pooled waiting share
``p``, the null hypothesis is that r waits at least ``p0`` of its time, where
``p0`` is the share whose odds are a quarter of the peers' odds but no more
than 20 points below the peers' share (``null_share``; ``p`` is taken at its
Wilson lower bound). The one-sided binomial p-value ``P[X ≤ k]`` for
``X ~ Bin(n, p0)`` is Bonferroni-corrected for the number of ranks tested,
and ``1 − p`` is the confidence. Building the margin into the null keeps the
systematic differences of a healthy job (a pipeline stage that waits 30 % of
the time against its neighbour's 40 %, or 90 % against 97 % on a saturated
machine) from ever becoming "significant" however many samples pile up,
while a real straggler's confidence grows with every window. The 20 points
follow from the smallest slowdown worth naming: if a healthy rank waits a
share ``w`` of a step and one rank takes ``f`` times as long, every step
takes ``f`` times as long; the peers then wait ``1 − (1 − w)/f`` of their
time and the slow rank ``w/f``, a gap of ``1 − 1/f`` whatever ``w`` is. A
20-point margin never names a rank less than 1.25× slow, while a 1.5× one
(a 33-point gap) is named within a minute at 5 Hz; healthy ranks of the
drill differ from their pooled peers by 8 points or less. Samples within a few seconds are not
independent draws; a window of a few Hz over steps of tens of milliseconds
spreads them over many steps, and the margin absorbs the rest.

Everything here is pure: the agent reads py-spy's output with
``contract.collapsed.parse_collapsed`` (each sample classed by
``contract.frames.classify``) and ships ``StackSampleWindow``s; callers feed
windows in.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

from rankscope.contract.frames import CLASSES
from rankscope.contract.ranks import compact_ranks
from rankscope.contract.snapshot import StackSampleWindow

# --------------------------------------------------------------------------
# statistics (stdlib only)
# --------------------------------------------------------------------------


def binom_cdf(k: int, n: int, p: float) -> float:
    """P[X ≤ k] for X ~ Binomial(n, p), summed in log space (n is at most a few thousand samples)."""
    if k < 0:
        return 0.0
    if k >= n or p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0
    lp, lq = math.log(p), math.log1p(-p)
    logs = [math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq
            for i in range(k + 1)]
    top = max(logs)
    return min(1.0, math.exp(top) * sum(math.exp(x - top) for x in logs))


def wilson_lower(successes: int, n: int, z: float = 2.0) -> float:
    """The Wilson score interval's lower bound of a proportion (0 when nothing was seen)."""
    if n <= 0:
        return 0.0
    phat = successes / n
    denom = 1 + z * z / n
    centre = phat + z * z / (2 * n)
    spread = z * math.sqrt(phat * (1 - phat) / n + z * z / (4 * n * n))
    return max(0.0, (centre - spread) / denom)


# --------------------------------------------------------------------------
# the detector
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RankWaits:
    """One rank's classified samples over the horizon."""

    rank: int
    samples: int
    waiting: int
    counts: tuple[tuple[str, int], ...]

    @property
    def share(self) -> float:
        return self.waiting / self.samples if self.samples else math.nan


@dataclass(frozen=True, slots=True)
class Straggler:
    """A rank that waits far less than its peers: their waits are for it."""

    rank: int
    waits: RankWaits
    peers: tuple[int, ...]
    peer_share: float  # pooled waiting share of the peers
    p_value: float  # Bonferroni-corrected
    confidence: float  # 1 − p_value

    def evidence(self) -> str:
        c = dict(self.waits.counts)
        busy = max(("compute", "data", "other"), key=lambda k: c.get(k, 0))
        return (f"rank {self.rank} waited for peers in {self.waits.waiting} of {self.waits.samples} sampled stacks "
                f"({100 * self.waits.share:.0f} %, mostly {busy}) while its {len(self.peers)} peers waited "
                f"{100 * self.peer_share:.0f} % of theirs; p = {self.p_value:.1e}")


@dataclass(frozen=True, slots=True)
class SampledWaitResult:
    """Every rank's waits and the ranks the test names, most confident first."""

    ranks: tuple[RankWaits, ...]
    stragglers: tuple[Straggler, ...]
    windows: int
    horizon_s: float

    @property
    def top(self) -> Straggler | None:
        return self.stragglers[0] if self.stragglers else None


def rank_waits(windows: Iterable[StackSampleWindow]) -> dict[int, RankWaits]:
    """Per rank, the classified samples of the windows given, added up."""
    sums: dict[int, dict[str, int]] = {}
    for w in windows:
        if w.error is not None:
            continue
        s = sums.setdefault(w.rank, dict.fromkeys(CLASSES, 0))
        for k in CLASSES:
            s[k] += getattr(w, k)
    out = {}
    for r, s in sums.items():
        total = sum(s.values())
        out[r] = RankWaits(r, total, s["collective"] + s["p2p"], tuple(s.items()))
    return out


def sampling_problems(windows: Iterable[StackSampleWindow]) -> tuple[str, ...]:
    """One line per distinct failure among each rank's newest window: which ranks, what failed, the fix.

    A failed window carries no samples, so the wait test is silent about its
    rank; this says why. Only the newest window of a rank counts: one that
    failed a minute ago and has been sampled since is not a problem now.
    """
    newest: dict[int, StackSampleWindow] = {}
    for w in windows:
        if w.rank not in newest or w.end_wall > newest[w.rank].end_wall:
            newest[w.rank] = w
    # By kind of failure, not by message: each message names its own pid, and a restart of 1,000 ranks is
    # one line (the lowest rank's message stands for the others).
    failed: dict[tuple[str, str], list[StackSampleWindow]] = {}
    for w in sorted(newest.values(), key=lambda w: w.rank):
        if w.error is not None:
            failed.setdefault((str(w.error.kind), w.error.fix), []).append(w)
    lines = []
    for (_, fix), ws in sorted(failed.items(), key=lambda kv: kv[1][0].rank):
        ranks = [w.rank for w in ws]
        first = ws[0].error
        assert first is not None
        lines.append(f"sampling failed on rank{'s' if len(ranks) > 1 else ''} {compact_ranks(ranks, limit=8)}: "
                     f"{first.message}" + (f" (and {len(ranks) - 1} more alike)" if len(ranks) > 1 else "")
                     + (f" (fix: {fix})" if fix else ""))
    return tuple(lines)


# The null's margins (see the module docstring): a quarter of the peers' odds of waiting, 20 points below them.
ODDS_MARGIN = 0.25
MIN_GAP = 0.2
# How far below its peers' pooled waiting share a rank may wait and still count as waiting like them
# (``waits_in_its_send``): over the drills' 45 s of samples the slow-comm rank waited 1 point less than its peers
# (77 % of its samples in its send/recv against their 31 %); the slow compute, data loader and thermal ranks 30 to
# 60 points less.
WAIT_TOLERANCE = 0.05


def waits_in_its_send(result: SampledWaitResult, ranks: Collection[int], tolerance: float = WAIT_TOLERANCE) -> bool:
    """Whether each of ``ranks`` spends its slow time in its own send/recv: it waits about as much as the other ranks
    (its waiting share no more than ``tolerance`` below their pooled share) and more of its samples sit in a
    send/recv than theirs do (its share there, at the lower end of its confidence interval (Wilson), above theirs).

    A rank that computes, loads or is fed slowly waits less than the ranks waiting for it. A rank the others wait on
    that waits as much as they do, in its send/recv, is slow in that transfer: the slow link between it and the
    ranks waiting (C4's communication slow). Ranks without samples, or with no peers sampled, say nothing (False).
    """
    by_rank = {w.rank: w for w in result.ranks}
    if not ranks or any(r not in by_rank or by_rank[r].samples == 0 for r in ranks):
        return False
    others = [w for w in result.ranks if w.rank not in ranks]
    samples = sum(w.samples for w in others)
    if samples == 0:
        return False
    peers_waiting = sum(w.waiting for w in others) / samples
    peers_p2p = sum(dict(w.counts).get("p2p", 0) for w in others) / samples
    return all(by_rank[r].share >= peers_waiting - tolerance
               and wilson_lower(dict(by_rank[r].counts).get("p2p", 0), by_rank[r].samples) > peers_p2p
               for r in ranks)


def null_share(peer_share: float, odds_margin: float, min_gap: float) -> float:
    """The least waiting share a rank is assumed to have under the null, given its peers'.

    Both at most ``odds_margin`` times the peers' odds of waiting and at least
    ``min_gap`` below their share: the smaller of the two, so that neither a
    small difference near 0 % or 100 % (where odds swing) nor a modest one in
    the middle can be called a straggler.
    """
    if peer_share <= 0.0:
        return 0.0
    if peer_share >= 1.0:
        return max(0.0, 1.0 - min_gap)
    odds = odds_margin * peer_share / (1.0 - peer_share)
    return max(0.0, min(odds / (1.0 + odds), peer_share - min_gap))


def find_stragglers(waits: Mapping[int, RankWaits], *, odds_margin: float = ODDS_MARGIN, min_gap: float = MIN_GAP,
                    min_samples: int = 20,
                    min_peer_share: float = 0.1, peers_of: Mapping[int, Sequence[int]] | None = None,
                    ) -> list[Straggler]:
    """The binomial test of the module docstring for every rank with ``min_samples``; all results, best first.

    The null share comes from ``null_share`` (peers' odds times ``odds_margin``,
    at least ``min_gap`` below them).

    ``peers_of`` narrows a rank's peers (default: every other rank). Peers that
    hardly wait themselves (below ``min_peer_share``) mean nobody is held up,
    and nobody is tested against them.
    """
    tested = [w for w in waits.values() if w.samples >= min_samples]
    out = []
    for w in tested:
        peer_ranks = [p for p in (peers_of.get(w.rank, ()) if peers_of is not None else waits) if p != w.rank]
        peers = [waits[p] for p in peer_ranks if p in waits and waits[p].samples >= min_samples]
        n_peer = sum(p.samples for p in peers)
        k_peer = sum(p.waiting for p in peers)
        if not peers or n_peer == 0 or k_peer / n_peer < min_peer_share:
            continue
        p0 = null_share(wilson_lower(k_peer, n_peer), odds_margin, min_gap)
        p_value = min(1.0, binom_cdf(w.waiting, w.samples, p0) * len(tested))
        out.append(Straggler(w.rank, w, tuple(sorted(p.rank for p in peers)), k_peer / n_peer, p_value,
                             1.0 - p_value))
    return sorted(out, key=lambda s: (s.p_value, s.waits.share, s.rank))


class SampledWaitDetector:
    """Keeps the windows of the last ``horizon_s`` seconds and tests them on each update.

    Windows arrive again and again (an agent sends all it holds); each is
    kept once, by rank, process and start. The horizon is measured on the
    agents' own wall clocks, from the newest window end of each rank's
    agent, so machines' clock offsets do not matter.
    """

    def __init__(self, horizon_s: float = 45.0, odds_margin: float = ODDS_MARGIN, min_gap: float = MIN_GAP,
                 min_samples: int = 20, min_peer_share: float = 0.1) -> None:
        self.horizon_s = horizon_s
        self.odds_margin = odds_margin
        self.min_gap = min_gap
        self.min_samples = min_samples
        self.min_peer_share = min_peer_share
        self._windows: dict[tuple[int, int, float], StackSampleWindow] = {}

    def add(self, windows: Iterable[StackSampleWindow]) -> None:
        newest: dict[int, float] = {}
        for w in windows:
            self._windows.setdefault((w.rank, w.pid, w.start_wall), w)
        for w in self._windows.values():
            newest[w.rank] = max(newest.get(w.rank, w.end_wall), w.end_wall)
        self._windows = {k: w for k, w in self._windows.items() if w.end_wall >= newest[w.rank] - self.horizon_s}

    def result(self, peers_of: Mapping[int, Sequence[int]] | None = None) -> SampledWaitResult:
        waits = rank_waits(self._windows.values())
        found = find_stragglers(waits, odds_margin=self.odds_margin, min_gap=self.min_gap, min_samples=self.min_samples,
                                min_peer_share=self.min_peer_share, peers_of=peers_of)
        return SampledWaitResult(tuple(waits[r] for r in sorted(waits)), tuple(found), len(self._windows),
                                 self.horizon_s)
