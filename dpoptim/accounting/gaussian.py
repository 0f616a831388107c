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

from scipy.special import log_ndtr

from .ledger import check_delta, check_epsilon

__all__ = ["gaussian_delta", "gaussian_epsilon", "gaussian_mu"]


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
