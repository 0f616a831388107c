"""scipy's special functions and the binomial distribution, imported at first use.

scipy takes over a second to import. An optimizer given a noise multiplier needs no
accounting until the first ``privacy_spent()``, so ``import dpoptim`` and building an
optimizer must not pay for it: the accounting modules call these thin wrappers, which
import scipy the first time one of them runs. ``log_expm1`` and ``finite_abs`` need numpy
only.
"""

from __future__ import annotations

import math

import numpy as np


def log_expm1(x):
    """log(exp(x) - 1) for x >= 0, without overflow for large x or cancellation for small x."""
    with np.errstate(divide="ignore"):
        return x + np.log(-np.expm1(-x))


def finite_abs(x):
    """``|x|``, with infinities (and nan) counting 0: the size of a term in a round-off
    bound, where an infinite term is exact (a scalar or an array)."""
    if not isinstance(x, np.ndarray) or x.ndim == 0:
        return abs(float(x)) if math.isfinite(x) else 0.0
    out = np.abs(x)
    np.putmask(out, ~(out < np.inf), 0.0)  # one mask for both: nan compares False too
    return out


def log_ndtr(x):
    """log of the standard normal CDF, accurate far into the lower tail."""
    from scipy.special import log_ndtr as function

    return function(x)


def ndtri(p):
    """Inverse of the standard normal CDF."""
    from scipy.special import ndtri as function

    return function(p)


def gammaln(x):
    """log |Gamma(x)|."""
    from scipy.special import gammaln as function

    return function(x)


def gammasgn(x):
    """The sign of Gamma(x)."""
    from scipy.special import gammasgn as function

    return function(x)


def binom(n, p):
    """The binomial distribution ``Binomial(n, p)``: its ``pmf``, ``cdf`` and ``sf`` at integer
    counts, from the special functions ``scipy.stats.binom`` itself calls (importing
    ``scipy.stats`` costs another 0.7 s or so), or from ``scipy.stats`` where a scipy does
    not have them."""
    try:
        from scipy.special._ufuncs import _binom_cdf, _binom_pmf, _binom_sf
    except ImportError:  # pragma: no cover - older scipy
        from scipy.stats import binom as distribution

        return distribution(n, p)
    return _Binomial(n, p, _binom_pmf, _binom_cdf, _binom_sf)


class _Binomial:
    """``Binomial(n, p)`` with scipy.stats' values, its support's ends included (there the
    special functions give nan)."""

    def __init__(self, n, p, pmf, cdf, sf):
        self.n, self.p, self._pmf, self._cdf, self._sf = n, p, pmf, cdf, sf

    def _at(self, function, k, below: float, above: float):
        k = np.asarray(k, dtype=float)
        inside = np.clip(k, 0, self.n)
        with np.errstate(invalid="ignore"):
            value = function(inside, self.n, self.p)
        return np.where(k < 0, below, np.where(k > self.n, above, value))[()]

    def pmf(self, k):
        return self._at(self._pmf, k, 0.0, 0.0)

    def cdf(self, k):
        return self._at(self._cdf, k, 0.0, 1.0)

    def sf(self, k):
        return self._at(self._sf, k, 1.0, 0.0)
