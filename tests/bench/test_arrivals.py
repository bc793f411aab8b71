"""Arrival processes: Poisson and gamma gaps, send offsets, and the KS test that checks them."""

from __future__ import annotations

import itertools
import math
import random
import statistics

import pytest

from pdrouter.bench.arrivals import arrival_times, gamma_gaps, kolmogorov_sf, ks_exponential, poisson_gaps
from pdrouter.core.errors import ConfigError


def test_poisson_gaps_have_mean_one_over_rate_and_pass_ks() -> None:
    gaps = poisson_gaps(10, 2000, random.Random(0))
    assert len(gaps) == 2000
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.03)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.05)
    d, p = ks_exponential(gaps, 10)
    assert d < 0.03
    assert p > 0.01


def test_gamma_burstiness_half_is_burstier_and_fails_ks() -> None:
    gaps = gamma_gaps(10, 0.5, 2000, random.Random(0))
    assert statistics.fmean(gaps) == pytest.approx(0.1, rel=0.05)
    cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
    assert cv == pytest.approx(math.sqrt(2), rel=0.06)
    _, p = ks_exponential(gaps, 10)
    assert p < 0.01


def test_gamma_burstiness_one_is_poisson() -> None:
    gamma = gamma_gaps(10, 1.0, 2000, random.Random(4))
    poisson = poisson_gaps(10, 2000, random.Random(4))
    assert gamma == pytest.approx(poisson, rel=1e-12)  # the same draws: shape 1 is the exponential
    assert ks_exponential(gamma, 10)[1] > 0.01


def test_gamma_burstiness_above_one_is_more_regular() -> None:
    gaps = gamma_gaps(5, 4.0, 4000, random.Random(1))
    assert statistics.fmean(gaps) == pytest.approx(0.2, rel=0.03)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(0.5, rel=0.05)


def test_arrival_times_start_at_zero_then_add_the_gaps() -> None:
    times = arrival_times(10, 5, seed=0)
    gaps = poisson_gaps(10, 4, random.Random(0))
    assert times is not None and len(times) == 5
    assert times[0] == 0.0
    assert times[1:] == pytest.approx([sum(gaps[:i]) for i in range(1, 5)], rel=1e-12)


def test_arrival_times_are_deterministic_and_a_longer_run_extends_a_shorter_one() -> None:
    short = arrival_times(3.0, 50, burstiness=0.7, seed=9)
    long = arrival_times(3.0, 80, burstiness=0.7, seed=9)
    assert short is not None and long is not None
    assert short == arrival_times(3.0, 50, burstiness=0.7, seed=9)
    assert long[:50] == short
    assert all(b >= a for a, b in itertools.pairwise(long))
    assert arrival_times(3.0, 50, burstiness=0.7, seed=10) != short


def test_arrival_times_mean_rate() -> None:
    times = arrival_times(20, 3001, seed=3)
    assert times is not None
    assert 3000 / times[-1] == pytest.approx(20, rel=0.05)


def test_arrival_times_burstiness_changes_the_process() -> None:
    times = arrival_times(10, 2001, burstiness=0.5, seed=0)
    assert times is not None
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps == pytest.approx(gamma_gaps(10, 0.5, 2000, random.Random(0)), rel=1e-9)


def test_arrival_times_edge_cases() -> None:
    assert arrival_times(None, 10, seed=0) is None
    assert arrival_times(math.inf, 10, seed=0) is None
    assert arrival_times(5, 0, seed=0) == []
    assert arrival_times(5, 1, seed=0) == [0.0]


@pytest.mark.parametrize("rate", [0.0, -1.0, math.nan])
def test_a_non_positive_rate_names_the_flag(rate: float) -> None:
    for call in (lambda: poisson_gaps(rate, 3, random.Random(0)),
                 lambda: gamma_gaps(rate, 1.0, 3, random.Random(0)),
                 lambda: arrival_times(rate, 3, seed=0),
                 lambda: ks_exponential([1.0], rate)):
        with pytest.raises(ConfigError, match=r"^--rate must be > 0 requests/s"):
            call()


@pytest.mark.parametrize("burstiness", [0.0, -0.5, math.inf, math.nan])
def test_a_bad_burstiness_names_the_flag(burstiness: float) -> None:
    with pytest.raises(ConfigError, match=r"^--burstiness must be a finite number > 0"):
        gamma_gaps(1.0, burstiness, 3, random.Random(0))
    with pytest.raises(ConfigError, match=r"^--burstiness"):
        arrival_times(1.0, 3, burstiness=burstiness, seed=0)
    with pytest.raises(ConfigError, match=r"^--burstiness"):
        arrival_times(None, 3, burstiness=burstiness, seed=0)  # checked even without a rate


def test_a_negative_count_names_the_flag() -> None:
    with pytest.raises(ConfigError, match=r"^--num-requests must be >= 0, got -1"):
        poisson_gaps(1.0, -1, random.Random(0))
    with pytest.raises(ConfigError, match=r"^--num-requests"):
        gamma_gaps(1.0, 2.0, -1, random.Random(0))
    with pytest.raises(ConfigError, match=r"^--num-requests"):
        arrival_times(None, -1, seed=0)


def test_ks_on_a_hand_computed_example() -> None:
    # Exp(1) CDF at 0.5, 1, 2: 0.39347, 0.63212, 0.86466. Against the steps 0, 1/3, 2/3, 1 the largest
    # gap is below the first point: F(0.5) - 0 = 1 - e^-0.5.
    d, p = ks_exponential([2.0, 0.5, 1.0], 1.0)
    assert d == pytest.approx(1 - math.exp(-0.5), abs=1e-15)
    lam = math.sqrt(3) * d
    assert p == pytest.approx(2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * lam * lam) for k in range(1, 50)),
                              abs=1e-12)
    assert p == pytest.approx(0.7417, abs=1e-4)


def test_ks_of_perfect_quantiles_is_half_a_step() -> None:
    n, rate = 100, 4.0
    gaps = [-math.log(1 - (i + 0.5) / n) / rate for i in range(n)]
    d, p = ks_exponential(gaps, rate)
    assert d == pytest.approx(0.5 / n, abs=1e-12)
    assert p == pytest.approx(1.0)


def test_ks_of_nothing_is_nan() -> None:
    d, p = ks_exponential([], 1.0)
    assert math.isnan(d) and math.isnan(p)


@pytest.mark.parametrize(("x", "sf"), [
    (0.0, 1.0), (0.5, 0.9639452436648751), (1.0, 0.2699996716773546), (1.36, 0.0494858767553779),
    (2.0, 6.709252557796953e-4),
])
def test_kolmogorov_sf_known_values(x: float, sf: float) -> None:
    assert kolmogorov_sf(x) == pytest.approx(sf, rel=1e-9)


def test_kolmogorov_sf_two_series_agree_where_they_switch() -> None:
    assert kolmogorov_sf(1.18 - 1e-12) == pytest.approx(kolmogorov_sf(1.18), rel=1e-9)
    xs = [0.05 * i for i in range(1, 80)]
    values = [kolmogorov_sf(x) for x in xs]
    assert all(b <= a for a, b in itertools.pairwise(values))
