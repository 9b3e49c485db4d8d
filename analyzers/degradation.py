"""Aegis §5.2: slow compute and slow links from per-iteration TD and N.

For one collective op on one communicator, compare the members' latest call
(an iteration's sample: the counters hold the last duration TD and the ring
of the last L=5 work-request throughputs):

- TD < α·mean(TD) (α = 0.8): since a collective ends at the same time on
  every member, the member that spent the least time in it arrived last; its
  computation before the call is slow.
- N > β·mean(N) (β = 1.5): a slow link. The paper calls N a throughput yet
  flags it when *larger*; we read N as the time cost of moving data, so here
  N = mean over the ring of 1/throughput (seconds per byte): larger is slower,
  and "N > β·mean" keeps the paper's direction. Dividing by the ring's bytes
  keeps ops of different sizes comparable.

Only members whose latest completed call is the one most members are on (same WC) are compared, so a
rank that is one call ahead does not look fast. The fail-slow detector
decides how long the findings must last.
Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from rankscope.contract.snapshot import OpCounters, RankCounters
from rankscope.contract.vocabulary import is_point_to_point

ALPHA = 0.8
BETA = 1.5
MIN_MEMBERS = 2


@dataclass(frozen=True, slots=True)
class DegradationFinding:
    kind: str  # "slow_compute" | "slow_link"
    comm_id: str
    op: str
    rank: int
    value: float  # TD (s) or N (s/byte)
    mean: float
    threshold: float  # α·mean or β·mean

    def evidence(self) -> str:
        if self.kind == "slow_compute":
            return (f"rank {self.rank}: {self.op} on comm {self.comm_id} took {self.value * 1e3:.2f} ms < "
                    f"α·mean {self.threshold * 1e3:.2f} ms: it arrived last (held up before this collective)")
        return (f"rank {self.rank}: {self.op} on comm {self.comm_id} moves data at "
                f"{1 / self.value / 1e6 if self.value > 0 else 0:.1f} MB/s, N {self.value:.3g} s/B > β·mean "
                f"{self.threshold:.3g} s/B (slow link)")


def inverse_throughput(ring: tuple[float, ...]) -> float | None:
    """N: mean seconds per byte over the ring (None without samples)."""
    vals = [1.0 / t for t in ring if t > 0]
    return sum(vals) / len(vals) if vals else None


def compared_ops(counters: Mapping[int, RankCounters]) -> Iterator[tuple[int, OpCounters]]:
    """(rank, op) for every collective op a rank completed, from fresh counters: what members are compared on.

    Point-to-point ops are left out (a pair's two sides do different work), and so are ops never completed and ranks
    whose counters are stale or unreadable.
    """
    for r, rc in counters.items():
        if rc.error is not None or rc.stale:
            continue
        for o in rc.ops:
            if not is_point_to_point(o.op) and o.wc > 0:
                yield r, o


def degradation_findings(counters: Mapping[int, RankCounters], alpha: float = ALPHA,
                         beta: float = BETA) -> tuple[DegradationFinding, ...]:
    """TD and N outliers per (communicator, collective op) among members on the same call."""
    rows: dict[tuple[str, str], dict[int, tuple[int, float | None, float | None]]] = {}
    for r, o in compared_ops(counters):
        rows.setdefault((o.comm_id, o.op), {})[r] = (o.wc, o.last_duration_s, inverse_throughput(o.recent_throughput))
    out: list[DegradationFinding] = []
    for (cid, op), per_rank in sorted(rows.items()):
        # the call most members last completed (ties: the later one)
        counts: dict[int, int] = {}
        for v in per_rank.values():
            counts[v[0]] = counts.get(v[0], 0) + 1
        call = max(counts, key=lambda c: (counts[c], c))
        same = {r: v for r, v in per_rank.items() if v[0] == call}
        tds = {r: v[1] for r, v in same.items() if v[1] is not None and v[1] > 0}
        if len(tds) >= MIN_MEMBERS:
            mean = sum(tds.values()) / len(tds)
            for r, td in sorted(tds.items()):
                if td < alpha * mean:
                    out.append(DegradationFinding("slow_compute", cid, op, r, td, mean, alpha * mean))
        ns = {r: v[2] for r, v in same.items() if v[2] is not None}
        if len(ns) >= MIN_MEMBERS:
            mean = sum(ns.values()) / len(ns)
            for r, n in sorted(ns.items()):
                if n > beta * mean:
                    out.append(DegradationFinding("slow_link", cid, op, r, n, mean, beta * mean))
    return tuple(out)
