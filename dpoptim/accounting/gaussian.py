r"""Exact accounting for full-batch steps (q = 1): the analytic Gaussian mechanism.

With every example in every batch, ``T`` steps of noise multiplier :math:`\sigma` are
:math:`T` Gaussian mechanisms of sensitivity 1. Their composition is exactly one Gaussian
mechanism with :math:`\sigma_{\text{eff}} = \sigma / \sqrt T`, that is :math:`\mu`-GDP with
:math:`\mu = \sqrt T / \sigma` (Dong, Roth & Su 2019, "Gaussian Differential Privacy",
Corollary 3.3); runs with different :math:`\sigma` give
:math:`\mu^2 = \sum_r T_r / \sigma_r^2`. Its exact privacy profile is (Balle & Wang 2018,
"Improving the Gaussian Mechanism for Differential Privacy", Theorem 8)

.. math::
    \delta(\varepsilon) = \Phi\Big(-\frac{\varepsilon}{\mu} + \frac{\mu}{2}\Big)
        - e^{\varepsilon}\, \Phi\Big(-\frac{\varepsilon}{\mu} - \frac{\mu}{2}\Big).

:func:`gaussian_epsilon` inverts it numerically and always returns a point whose
:math:`\delta(\varepsilon)` is at most the target, so the answer never undershoots.
"""

from __future__ import annotations

import math

import numpy as np

from .ledger import check_delta, check_epsilon
from .special import binom, log_ndtr

__all__ = [
    "central_limit_mu",
    "gaussian_delta",
    "gaussian_epsilon",
    "gaussian_mu",
    "ledger_mixture_epsilon",
    "mixture_delta",
    "mixture_epsilon",
    "mixture_delta_lower_bound",
    "mixture_epsilon_lower_bound",
]


def gaussian_mu(runs) -> float:
    r"""GDP parameter :math:`\mu = \sqrt{\sum_r T_r / \sigma_r^2}` of full-batch runs."""
    total = 0.0
    for sigma, _q, count in runs:
        if count == 0:
            continue
        if sigma == 0.0:
            return math.inf
        total += count / (sigma * sigma)
    return math.sqrt(total)


def central_limit_mu(sigma: float, q: float, steps: int) -> float:
    """The mu of the central limit theorem for ``steps`` subsampled Gaussian steps,
    ``q sqrt(T (e^{1/sigma^2} - 1))`` (Dong, Roth & Su 2019, "Gaussian Differential
    Privacy", its central limit theorem for noisy SGD; the formula as Bu, Dong, Long & Su
    2020, "Deep Learning with Gaussian Differential Privacy", use it). A guide only: not a
    bound of either side."""
    exponent = 700.0 if sigma < 0.04 else min(sigma**-2, 700.0)  # (sigma**-2 overflows below 1e-154)
    return q * math.sqrt(steps * math.expm1(exponent))


def gaussian_delta(epsilon: float, mu: float) -> float:
    """delta(epsilon) of a mu-GDP mechanism (Balle & Wang 2018, Theorem 8)."""
    epsilon = check_epsilon(epsilon)
    if mu < 0 or math.isnan(mu):
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    if math.isinf(epsilon):
        return 0.0
    # Both terms in log space; their ratio exp(epsilon + log Phi(b) - log Phi(a)) is < 1.
    log_first = float(log_ndtr(-epsilon / mu + mu / 2.0))
    log_second = epsilon + float(log_ndtr(-epsilon / mu - mu / 2.0))
    if log_first == -math.inf:
        return 0.0
    return math.exp(log_first) * -math.expm1(min(log_second - log_first, 0.0))


def gaussian_epsilon(delta: float, mu: float) -> float:
    """Smallest epsilon with ``gaussian_delta(epsilon, mu) <= delta``, rounded up.

    Bisection on a bracket that always keeps a certified upper end, so the result
    satisfies ``gaussian_delta(result, mu) <= delta`` as computed.
    """
    delta = check_delta(delta)
    if mu < 0 or math.isnan(mu):
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    if math.isinf(mu):
        return math.inf
    if gaussian_delta(0.0, mu) <= delta:
        return 0.0
    low, high = 0.0, max(1.0, mu * mu)
    while gaussian_delta(high, mu) > delta:
        low, high = high, 2.0 * high
    # delta(epsilon) is smooth and convex in epsilon: a few secant steps refine the
    # bracket quickly, and bisection guarantees progress.
    for _ in range(200):
        if high - low <= 1e-12 * high:
            break
        d_low, d_high = gaussian_delta(low, mu), gaussian_delta(high, mu)
        guess = high - (d_high - delta) * (high - low) / (d_high - d_low) if d_high != d_low else low
        mid = 0.5 * (low + high)
        for candidate in (guess, mid):
            if low < candidate < high:
                if gaussian_delta(candidate, mu) > delta:
                    low = candidate
                else:
                    high = candidate
    return high


# --- the Gaussian mixture bound: subsampling by conditioning on how often -------------

_MIXTURE_TAIL = 1e-7  # share of delta left to the binomial tail beyond the last bin
_MIXTURE_RATIO = 2.0**-12  # relative width of the bins of the sampling count


def mixture_delta(epsilon: float, sigma: float, q: float, steps: int) -> float:
    r"""Upper bound on delta(epsilon) of ``steps`` subsampled Gaussian steps, by convexity.

    Condition on the set :math:`S` of steps that used the example (``K = |S|`` is
    Binomial(steps, q)). Given :math:`S` the two outputs are Gaussian mechanisms composed
    ``K`` times, exactly :math:`\sqrt K / \sigma`-GDP (Dong, Roth & Su 2019, Cor. 3.3),
    whose profile :math:`\delta_G` is that of :func:`gaussian_delta` in either direction.
    The hockey-stick divergence is jointly convex, so for both removal (mixture against
    a fixed Q) and addition (fixed P against a mixture, written as the same mixture of
    pairs)

    .. math::
        \delta(\varepsilon) \le \mathbb E_K\big[\delta_G(\varepsilon; \sqrt K / \sigma)\big].

    It gives up the amplification by subsampling, so it is loose for moderate sigma, but
    when sigma is tiny a step that used the example is unmistakable and the bound is
    nearly exact (it loses only ``log(1/q)`` per use against the exact loss of about
    ``1 / (2 sigma^2)``); for q = 1 it *is* exact. Evaluation is an upper bound too: the
    counts are binned geometrically (relative width 2^-12) and each bin takes the value
    at its largest count (:math:`\delta_G` grows with the count), the mass below the first
    bin joins the first, the mass beyond the last counts in full, bin masses come from
    the survival function in the upper tail (no cancellation) and are rounded up, and the
    sum is rounded up.
    """
    return _mixture_deltas(np.asarray([float(epsilon)]), sigma, q, steps)[0]


def _mixture_bins(sigma: float, q: float, steps: int, tail: float):
    """(mu of each bin, mass of each bin, mass beyond the last bin)."""
    if q == 1.0:
        return np.asarray([math.sqrt(steps) / sigma]), np.asarray([1.0]), 0.0
    dist = binom(steps, q)
    mean, std = steps * q, math.sqrt(steps * q * (1.0 - q))
    # The smallest count whose upper tail is at most ``tail``, by galloping and bisection
    # on the survival function (its inverse is unreliable this far out).
    low, top = int(mean), min(steps, int(mean + 8.0 * std) + 16)
    while top < steps and dist.sf(top) > tail:
        low, top = top, min(steps, top + 2 * (top - int(mean)) + 16)
    while top - low > 1:
        mid = (low + top) // 2
        if dist.sf(mid) > tail:
            low = mid
        else:
            top = mid
    beyond = float(dist.sf(top)) if top < steps else 0.0
    # Counts below ``bottom`` join the first bin (sound for any bottom); 40 standard
    # deviations below the mean their mass is far below anything that matters.
    bottom = max(int(mean - 40.0 * std), 0)
    edges = _count_lattice(bottom, top)  # bin j holds counts edges[j] .. edges[j+1] - 1
    # Bin masses as differences of the distribution function below the mean and of the
    # survival function above it, so that no tail mass is lost to cancellation near 1;
    # each is rounded up by 1e-13 of the larger term it came from (scipy's incomplete
    # beta is accurate to about 1e-14 relative, the subtraction to 2^-52).
    cdf = dist.cdf(edges - 1)
    sf = dist.sf(edges - 1)
    from_cdf = np.diff(cdf) + 1e-13 * cdf[1:]
    from_cdf[0] = cdf[1] * (1.0 + 1e-13)  # the first bin takes all counts below it
    from_sf = sf[:-1] - sf[1:] + 1e-13 * sf[:-1]
    masses = np.where(edges[:-1] > mean, from_sf, from_cdf)
    mu = np.sqrt((edges[1:] - 1).astype(float)) / sigma
    return mu, np.maximum(masses, 0.0), beyond


def _count_lattice(bottom: int, top: int) -> np.ndarray:
    """Integer edges from ``bottom`` to ``top + 1``: every count below 4096, then relative
    steps of 2^-12 on a fixed lattice (so nearby parameters share edges)."""
    small = np.arange(bottom, min(top, 4095) + 1) if bottom < 4096 else np.asarray([bottom])
    if top < 4096:
        return np.concatenate([small, [top + 1]]).astype(np.int64)
    j0 = max(0, math.floor(math.log(max(bottom, 4096) / 4096.0) / math.log1p(_MIXTURE_RATIO)))
    j1 = math.ceil(math.log((top + 1) / 4096.0) / math.log1p(_MIXTURE_RATIO)) + 1
    large = np.unique(np.floor(4096.0 * np.exp(np.arange(j0, j1 + 1) * math.log1p(_MIXTURE_RATIO))).astype(np.int64))
    large = large[(large > max(bottom, 4095)) & (large <= top)]
    return np.concatenate([small, large, [top + 1]]).astype(np.int64)


def _gaussian_deltas(epsilons: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """gaussian_delta on arrays (epsilons[:, None] against mu[None, :]), mu > 0 finite."""
    e, m = epsilons[:, None], mu[None, :]
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_first = log_ndtr(-e / m + m / 2.0)
        log_second = e + log_ndtr(-e / m - m / 2.0)
        out = np.exp(log_first) * -np.expm1(np.minimum(log_second - log_first, 0.0))
    out = np.where(m == 0.0, 0.0, out)
    return np.where(np.isnan(out), 1.0, out)


def gaussian_deltas_below(x: np.ndarray, mu: float) -> np.ndarray:
    r""":func:`gaussian_delta` at each ``x``, :math:`\delta_\mu(x) = \Phi(\mu/2 - x/\mu)
    - e^x \Phi(-\mu/2 - x/\mu)`, lowered by a bound on its rounding, for lower bounds
    (:func:`~dpoptim.accounting.pld.pld_epsilon_lower_bound`): both terms in log space
    (their ratio is below 1), each logarithm taken as off by :math:`10^{-12}` of its size."""
    first = log_ndtr(mu / 2.0 - x / mu)
    ratio = x + log_ndtr(-mu / 2.0 - x / mu) - first
    slack = 1e-12 * (1.0 + np.abs(x) + np.abs(ratio) + 2.0 * np.abs(first))
    with np.errstate(under="ignore"):
        return np.exp(first - slack) * -np.expm1(np.minimum(ratio + slack, 0.0))


def _mixture_deltas(epsilons: np.ndarray, sigma: float, q: float, steps: int, tail: float = 0.0) -> np.ndarray:
    mu, masses, beyond = _mixture_bins(sigma, q, steps, tail or 1e-300)
    values = _gaussian_deltas(epsilons, mu) @ masses
    return np.minimum(1.0, values * (1.0 + 1e-9) + beyond + 1e-300)


def mixture_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    """Smallest epsilon whose :func:`mixture_delta` is at most ``delta`` (rounded up)."""
    delta = check_delta(delta)
    if steps == 0 or math.isinf(sigma):
        return 0.0
    if sigma == 0.0:
        return math.inf
    tail = _MIXTURE_TAIL * delta
    mu, masses, beyond = _mixture_bins(sigma, q, steps, tail)

    def profile(eps: float) -> float:
        values = _gaussian_deltas(np.asarray([eps]), mu) @ masses
        return min(1.0, float(values[0]) * (1.0 + 1e-9) + beyond + 1e-300)

    if profile(0.0) <= delta:
        return 0.0
    return _bracket(profile, delta, max(1.0, float(mu.max()) ** 2))[1]


def _bracket(profile, delta: float, start: float) -> tuple[float, float]:
    """``(low, high)`` with ``profile(low) > delta >= profile(high)`` and ``high - low`` within
    1e-10 relative, for a decreasing ``profile`` (delta as a function of epsilon): doubling
    from ``start``, then bisection. ``high`` is then a sound upper bound on the epsilon of
    ``profile`` at ``delta``, ``low`` a lower one; ``(low, inf)`` past 1e300."""
    low, high = 0.0, start
    while profile(high) > delta:
        low, high = high, 2.0 * high
        if high > 1e300:
            return low, math.inf
    for _ in range(200):
        if high - low <= 1e-10 * high:
            break
        mid = 0.5 * (low + high)
        if profile(mid) > delta:
            low = mid
        else:
            high = mid
    return low, high


def ledger_mixture_epsilon(runs, delta: float) -> float:
    """:func:`mixture_epsilon` of a ledger, through the single run that dominates it.

    Every step of the ledger is dominated by a step at the smallest sigma and the largest
    q (post-processing, see :func:`~dpoptim.accounting.ledger.coarsen_runs`), so the
    ledger is dominated by ``steps`` such steps. For one run that is the run itself.
    """
    runs = [run for run in runs if run[2] and not math.isinf(run[0])]
    if not runs:
        return 0.0
    sigma = min(run[0] for run in runs)
    q = max(run[1] for run in runs)
    return mixture_epsilon(sigma, q, sum(run[2] for run in runs), delta)


def mixture_epsilon_lower_bound(sigma: float, q: float, steps: int, delta: float) -> float:
    r"""A rigorous *lower* bound on the exact epsilon of ``steps`` subsampled Gaussian steps.

    Under removal the privacy loss of a step is :math:`\log(1 - q + q\,r(z))`, at least
    :math:`\log(1-q)` and at least :math:`\log q + (2z - 1)/(2\sigma^2)`. On the event
    that the step used the example take the second, otherwise the first: a loss below the
    true one at every outcome, so :math:`\delta(\varepsilon) = \mathbb E_P[(1 -
    e^{\varepsilon - L})_+]`, which grows with ``L``, can only fall. Given ``K = k`` uses
    the lowered loss is :math:`c_k + \mathcal N(\mu^2/2, \mu^2)` with :math:`\mu^2 =
    k/\sigma^2` and :math:`c_k = k \log q + (T - k) \log(1 - q)`, whose profile is the
    Gaussian one shifted, so

    .. math::
        \delta(\varepsilon) \ge \sum_k \Pr[K = k]\, \delta_G(\varepsilon - c_k; \sqrt k / \sigma).

    It differs from :func:`mixture_delta` only by the shift :math:`c_k`, about ``k
    log(1/q)`` against an epsilon of about ``k / (2 sigma^2)``: the two bracket the exact
    epsilon within ``2 sigma^2 log(1/q)`` relative, tight for tiny sigma. Every count is
    summed exactly (no bins), the binomial mass beyond 60 standard deviations is dropped
    and the sum rounded down, all of which only lowers it.
    """
    delta = check_delta(delta)
    if steps == 0 or math.isinf(sigma):
        return 0.0
    if sigma == 0.0:
        return math.inf
    profile = _lower_profile(sigma, q, steps)
    if profile(0.0) <= delta:
        return 0.0
    return _bracket(profile, delta, 1.0)[0]


def mixture_delta_lower_bound(epsilon: float, sigma: float, q: float, steps: int) -> float:
    """The lower bound on delta(epsilon) of :func:`mixture_epsilon_lower_bound`."""
    return _lower_profile(sigma, q, steps)(float(epsilon))


def mixture_delta_lower_bound_ceiling(epsilon: float, sigma: float, q: float, steps: int) -> float:
    r"""An upper bound on :func:`mixture_delta_lower_bound` at ``epsilon``, at a small part of
    its cost where many steps are sampled: it says where that bound cannot exceed a
    delta, without summing it over every count (10^8 steps at q 2e-3 sum 53,000 binomial
    masses, 9 ms).

    The lower bound sums :math:`\Pr[K = k]\, \delta_G(\varepsilon - c_k; \sqrt k / \sigma)`
    over the counts :math:`k \ge 1`, with :math:`c_k = k \log q + (T - k) \log(1 - q)`,
    which falls with ``k`` for q below 1/2. Below a count :math:`k_0` (12 standard
    deviations below the mean) each term is at most :math:`\Pr[K = k]`; from it on,
    :math:`\delta_G` falls with its first argument, so each term is at most its value at
    :math:`c_{k_0}`, and their sum at most the Gaussian mixture bound
    :func:`mixture_delta` at :math:`\varepsilon - c_{k_0}`, which bounds that sum over
    every count. So the lower bound is at most :math:`\Pr[1 \le K < k_0] +` that, here
    rounded up by a part in 10^6 (far above the rounding of either sum). Infinite (no
    bound) at q of 1/2 or more, where the shifts grow with the count."""
    if not 0.0 < q < 0.5 or steps == 0:
        return math.inf
    mean, std = steps * q, math.sqrt(steps * q * (1.0 - q))
    first = max(1, int(mean - 12.0 * std))
    log_1mq = math.log1p(-q)
    shift = first * (math.log(q) - log_1mq) + steps * log_1mq  # c_k at the first count kept
    below = float(binom(steps, q).cdf(first - 1)) if first > 1 else 0.0
    return (below + float(mixture_delta(float(epsilon) - shift, sigma, q, steps))) * (1.0 + 1e-6)


def _lower_profile(sigma: float, q: float, steps: int):
    dist = binom(steps, q)
    mean, std = steps * q, math.sqrt(steps * q * (1.0 - q))
    k = np.arange(max(0, int(mean - 60 * std) - 1), min(steps, int(mean + 60 * std) + 60) + 1)
    k = k[k > 0]
    weights = dist.pmf(k)
    log_1mq = math.log1p(-q) if q < 1 else 0.0
    shift = k * (math.log(q) - log_1mq) + steps * log_1mq  # c_k <= 0
    mu = np.sqrt(k) / sigma

    def profile(eps: float) -> float:
        e = eps - shift
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            log_first = log_ndtr(-e / mu + mu / 2.0)
            log_second = e + log_ndtr(-e / mu - mu / 2.0)
            values = np.exp(log_first) * -np.expm1(np.minimum(log_second - log_first, 0.0))
        values = np.where(np.isfinite(values), np.maximum(values, 0.0), 0.0)
        return float(values @ weights) * (1.0 - 1e-9)

    return profile
