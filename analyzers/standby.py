"""How many warm standby machines to keep (ByteRobust §6.2).

Machine failures in large jobs are mostly independent single-node events, so
the number of machines failing within one window is modelled as a binomial
draw: N machines, each failing within the window with probability q. The pool
is sized at the 99th percentile of that distribution: with that many idle,
self-checked standbys, 99 windows in 100 need no rescheduling at all.

The paper gives the model and the percentile, not the failure rate; that is
estimated per cluster from its own history and passed in as a daily rate. The
window is how long the pool must cover before it is replenished (a day by
default, the unit the rate is quoted in). The per-window probability assumes
a constant hazard over the day: q = 1 - (1 - p_day) ** (window_h / 24).

Pure: no clock, no I/O, so the TUI, the CLI and the tests compute the same
numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rankscope.contract.errors import RankscopeError

DEFAULT_PERCENTILE = 0.99
DEFAULT_WINDOW_HOURS = 24.0
# Cumulative probabilities are sums of floats; a CDF that reaches the target
# up to rounding must count as reaching it, or an exact 0.99 would tip one up.
_CDF_SLACK = 1e-12


@dataclass(frozen=True, slots=True)
class StandbySizing:
    """The pool size and the facts behind it, as the TUI shows them.

    ``cdf`` holds ``(k, P(at most k machines fail in the window))`` from k = 0
    up to one past ``count``, so a reader sees how quickly the tail falls.
    """

    machines: int
    daily_failure_rate: float
    window_hours: float
    percentile: float
    window_failure_probability: float  # q: one machine fails within the window
    count: int  # standbys to keep: the smallest k with P(X <= k) >= percentile
    expected_failures: float  # N * q
    probability_covered: float  # P(X <= count)
    probability_short: float  # P(X > count): the pool runs out within a window
    cdf: tuple[tuple[int, float], ...]

    def summary(self) -> str:
        return (
            f"{self.count} warm standby machine(s) for {self.machines} machines: P{self.percentile * 100:g} of "
            f"simultaneous failures within {self.window_hours:g} h at {self.daily_failure_rate:g}/machine/day "
            f"(expected {self.expected_failures:.3g}, pool short with probability {self.probability_short:.2g})"
        )


def window_failure_probability(daily_failure_rate: float, window_hours: float = DEFAULT_WINDOW_HOURS) -> float:
    """Probability that one machine fails within ``window_hours``, from its daily rate.

    Constant hazard: surviving the window is surviving a day to the power of
    the window's length in days.
    """
    _check_rate(daily_failure_rate)
    _check_window(window_hours)
    if daily_failure_rate >= 1.0:
        return 1.0
    return -math.expm1(math.log1p(-daily_failure_rate) * window_hours / 24.0)


def binomial_pmf(n: int, q: float, k: int) -> float:
    """P(X = k) for X ~ Binomial(n, q), computed in log space so large n cannot underflow the mode."""
    if k < 0 or k > n:
        return 0.0
    if q <= 0.0:
        return 1.0 if k == 0 else 0.0
    if q >= 1.0:
        return 1.0 if k == n else 0.0
    log_pmf = (math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
               + k * math.log(q) + (n - k) * math.log1p(-q))
    return math.exp(log_pmf)


def size_standby_pool(
    machines: int,
    daily_failure_rate: float,
    window_hours: float = DEFAULT_WINDOW_HOURS,
    percentile: float = DEFAULT_PERCENTILE,
) -> StandbySizing:
    """The P99 (or ``percentile``) of simultaneous machine failures within the window."""
    if isinstance(machines, bool) or not isinstance(machines, int) or machines < 1:
        raise RankscopeError(f"the job needs at least one machine, got {machines!r}",
                             "pass the number of training machines (e.g. --machines 128)")
    if not 0.0 < percentile < 1.0:
        raise RankscopeError(f"percentile must lie strictly between 0 and 1, got {percentile!r}",
                             "use 0.99 for the P99 of ByteRobust §6.2")
    q = window_failure_probability(daily_failure_rate, window_hours)
    cdf: list[tuple[int, float]] = []
    total = 0.0
    count: int | None = None
    for k in range(machines + 1):
        total = min(1.0, total + binomial_pmf(machines, q, k))
        cdf.append((k, total))
        if count is None and total + _CDF_SLACK >= percentile:
            count = k
        if count is not None and k >= count + 1:
            break
    if count is None:  # only reachable through rounding: the sum of all pmfs is 1
        count = machines
    covered = dict(cdf)[count]
    return StandbySizing(
        machines=machines,
        daily_failure_rate=daily_failure_rate,
        window_hours=window_hours,
        percentile=percentile,
        window_failure_probability=q,
        count=count,
        expected_failures=machines * q,
        probability_covered=covered,
        probability_short=max(0.0, 1.0 - covered),
        cdf=tuple(cdf),
    )


def _check_rate(rate: float) -> None:
    if not isinstance(rate, int | float) or isinstance(rate, bool) or not math.isfinite(rate) \
            or not 0.0 <= rate <= 1.0:
        raise RankscopeError(
            f"the daily failure rate is a probability per machine per day, got {rate!r}",
            "estimate it from the cluster's history (failed machines per day / machines), e.g. 0.001",
        )


def _check_window(window_hours: float) -> None:
    if not isinstance(window_hours, int | float) or isinstance(window_hours, bool) \
            or not math.isfinite(window_hours) or window_hours <= 0:
        raise RankscopeError(f"the window must be a positive number of hours, got {window_hours!r}",
                             "use 24 (the pool is replenished within a day)")
