"""When a load test sends its requests: an open-loop arrival process, and a test of how Poisson it was.

As ``vllm bench serve`` defines them: at ``rate`` requests/s the gaps between arrivals are
exponential with mean ``1/rate`` (a Poisson process), or, with a ``burstiness`` other than 1, gamma
with shape ``burstiness`` and the same mean (below 1: burstier; above 1: more regular). The first
request goes at once (offset 0); request ``i`` goes after the first ``i`` gaps.

:func:`ks_exponential` tells how well realised gaps fit the exponential distribution (the tests use
it on the generator; a run's summary on the send times it achieved).
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Sequence

from pdrouter.core.errors import ConfigError


def _check_rate(rate: float) -> None:
    if not rate > 0:  # also refuses NaN
        raise ConfigError(f"--rate must be > 0 requests/s, got {rate}")


def _check_n(n: int) -> None:
    if n < 0:
        raise ConfigError(f"--num-requests must be >= 0, got {n}")


def _check_burstiness(burstiness: float) -> None:
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ConfigError(f"--burstiness must be a finite number > 0, got {burstiness}")


def poisson_gaps(rate: float, n: int, rng: random.Random) -> list[float]:
    """``n`` exponential gaps with mean ``1/rate`` seconds (the gaps of a Poisson process)."""
    _check_rate(rate)
    _check_n(n)
    return [rng.expovariate(rate) for _ in range(n)]


def gamma_gaps(rate: float, burstiness: float, n: int, rng: random.Random) -> list[float]:
    """``n`` gamma gaps with shape ``burstiness`` and mean ``1/rate`` seconds (scale
    ``1/(rate·burstiness)``): ``vllm bench serve``'s ``--burstiness``. Burstiness 1 is Poisson; the
    coefficient of variation is ``1/sqrt(burstiness)``, so below 1 arrivals come in bursts."""
    _check_rate(rate)
    _check_burstiness(burstiness)
    _check_n(n)
    scale = 1.0 / (rate * burstiness)
    return [rng.gammavariate(burstiness, scale) for _ in range(n)]


def arrival_times(rate: float | None, n: int, *, burstiness: float = 1.0, seed: int) -> list[float] | None:
    """The ``n`` send offsets in seconds after the start, non-decreasing, the first at 0 (sent at once,
    as ``vllm bench serve`` does), then the cumulative sums of ``n - 1`` gaps (Poisson when
    ``burstiness`` is 1, else gamma). None when ``rate`` is None or infinite: everything at once or a
    closed loop, as the runner decides. Deterministic in ``seed``; a longer run extends a shorter one.
    """
    _check_n(n)
    _check_burstiness(burstiness)
    if rate is None or rate == math.inf:
        return None
    _check_rate(rate)
    rng = random.Random(seed)
    count = max(n - 1, 0)
    gaps = poisson_gaps(rate, count, rng) if burstiness == 1.0 else gamma_gaps(rate, burstiness, count, rng)
    return [0.0, *itertools.accumulate(gaps)] if n else []


def kolmogorov_sf(x: float) -> float:
    """``P(K > x)`` for the Kolmogorov distribution (the limit of ``sqrt(n)·D``), by its two series:
    ``1 - sqrt(2π)/x · Σ exp(-(2k-1)²π²/(8x²))`` for small ``x``, ``2 Σ (-1)^(k-1) exp(-2k²x²)``
    otherwise (both converge in a handful of terms where they are used)."""
    if x <= 0:
        return 1.0
    if x < 1.18:
        y = -math.pi**2 / (8 * x * x)
        cdf = math.sqrt(2 * math.pi) / x * sum(math.exp((2 * k - 1) ** 2 * y) for k in range(1, 8))
        return min(1.0, max(0.0, 1.0 - cdf))
    sf = 2 * sum((-1) ** (k - 1) * math.exp(-2 * k * k * x * x) for k in range(1, 101))
    return min(1.0, max(0.0, sf))


def ks_exponential(gaps: Sequence[float], rate: float) -> tuple[float, float]:
    """The Kolmogorov–Smirnov statistic ``D`` of ``gaps`` against ``Exp(rate)`` and its asymptotic
    p-value ``P(K > sqrt(n)·D)`` (the Kolmogorov distribution, as ``scipy.stats.kstest`` with
    ``method="asymp"``). A small p-value: the gaps are unlikely to be Poisson at that rate.
    ``(nan, nan)`` for no gaps."""
    _check_rate(rate)
    n = len(gaps)
    if n == 0:
        return math.nan, math.nan
    d = 0.0
    for i, x in enumerate(sorted(gaps)):
        cdf = -math.expm1(-rate * x) if x > 0 else 0.0
        d = max(d, (i + 1) / n - cdf, cdf - i / n)
    return d, kolmogorov_sf(math.sqrt(n) * d)
