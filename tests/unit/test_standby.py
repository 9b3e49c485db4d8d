"""Warm standby sizing (ByteRobust §6.2) against hand-computed and directly summed binomial CDFs."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from rankscope.analyzers.standby import (
    binomial_pmf,
    size_standby_pool,
    window_failure_probability,
)
from rankscope.contract.errors import RankscopeError


def _direct_quantile(n: int, q: float, percentile: float) -> int:
    """The textbook definition, summed with exact binomial coefficients."""
    total = 0.0
    for k in range(n + 1):
        total += math.comb(n, k) * q**k * (1 - q) ** (n - k)
        if total >= percentile - 1e-12:
            return k
    return n


def test_ten_machines_at_ten_percent_needs_four_standbys_by_hand() -> None:
    # P(X<=k) for Bin(10, 0.1): 0.3487, 0.7361, 0.9298, 0.9872, 0.9984 -> k=3 is short of 0.99, k=4 is not.
    sizing = size_standby_pool(10, 0.1)
    assert sizing.count == 4
    cdf = dict(sizing.cdf)
    assert cdf[0] == pytest.approx(0.9**10)
    assert cdf[1] == pytest.approx(0.9**10 + 10 * 0.1 * 0.9**9)
    assert cdf[3] == pytest.approx(0.98720480, abs=1e-8)
    assert cdf[4] == pytest.approx(0.99836506, abs=1e-8)
    assert sizing.probability_covered == pytest.approx(0.99836506, abs=1e-8)
    assert sizing.probability_short == pytest.approx(1 - 0.99836506, abs=1e-8)
    assert sizing.expected_failures == pytest.approx(1.0)
    assert max(k for k, _ in sizing.cdf) == 5  # one past the count, for the TUI's tail


def test_fair_coin_machines_need_every_machine_covered() -> None:
    # Bin(4, 1/2): CDF 1/16, 5/16, 11/16, 15/16, 1 -> 15/16 < 0.99, so all 4.
    sizing = size_standby_pool(4, 0.5)
    exact = [Fraction(1, 16), Fraction(5, 16), Fraction(11, 16), Fraction(15, 16), Fraction(1)]
    assert [k for k, _ in sizing.cdf] == [0, 1, 2, 3, 4]
    for (_, got), want in zip(sizing.cdf, exact, strict=True):
        assert got == pytest.approx(float(want))
    assert sizing.count == 4


@pytest.mark.parametrize(("n", "rate", "window"), [
    (16, 0.01, 24.0), (128, 0.0012, 24.0), (1024, 0.0012, 24.0), (1000, 0.003, 6.0), (200, 0.05, 72.0),
])
def test_count_matches_a_direct_binomial_sum(n: int, rate: float, window: float) -> None:
    sizing = size_standby_pool(n, rate, window_hours=window)
    q = 1 - (1 - rate) ** (window / 24)
    assert sizing.window_failure_probability == pytest.approx(q, rel=1e-12)
    assert sizing.count == _direct_quantile(n, q, 0.99)
    for k, cdf in sizing.cdf:
        direct = sum(math.comb(n, i) * q**i * (1 - q) ** (n - i) for i in range(k + 1))
        assert cdf == pytest.approx(direct, rel=1e-9, abs=1e-15)


def test_a_daily_rate_reproduces_the_pool_sizes_of_table_5() -> None:
    # ByteRobust Table 5 keeps 2, 2, 3, 4 standbys for 128, 256, 512, 1024 machines. The paper does not print
    # the rate; 0.12 % of machines failing per day reproduces all four sizes at P99 over a day.
    assert [size_standby_pool(n, 0.0012).count for n in (128, 256, 512, 1024)] == [2, 2, 3, 4]


def test_shorter_window_needs_fewer_standbys() -> None:
    day = size_standby_pool(1024, 0.002)
    hour = size_standby_pool(1024, 0.002, window_hours=1.0)
    assert hour.count < day.count
    assert window_failure_probability(0.002, 1.0) == pytest.approx(1 - 0.998 ** (1 / 24))


def test_huge_jobs_do_not_underflow() -> None:
    # (1 - q) ** n underflows to 0.0 here; the log-space pmf must still find the quantile near the mean (1000).
    sizing = size_standby_pool(100_000, 0.01)
    assert 1000 < sizing.count < 1100
    assert sizing.probability_covered >= 0.99
    assert binomial_pmf(100_000, 0.01, 1000) == pytest.approx(0.0126, rel=0.02)


def test_no_failures_no_standbys_and_certain_failure_covers_everything() -> None:
    assert size_standby_pool(64, 0.0).count == 0
    assert size_standby_pool(64, 1.0).count == 64


@pytest.mark.parametrize(("n", "rate", "window", "pct"), [
    (0, 0.01, 24.0, 0.99), (10, -0.1, 24.0, 0.99), (10, 1.5, 24.0, 0.99), (10, float("nan"), 24.0, 0.99),
    (10, 0.01, 0.0, 0.99), (10, 0.01, 24.0, 1.0),
])
def test_bad_inputs_raise_with_a_fix(n: int, rate: float, window: float, pct: float) -> None:
    with pytest.raises(RankscopeError) as err:
        size_standby_pool(n, rate, window_hours=window, percentile=pct)
    assert err.value.fix
