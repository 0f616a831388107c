"""scipy's special functions and the binomial distribution, imported at first use.

scipy takes over a second to import. An optimizer given a noise multiplier needs no
accounting until the first ``privacy_spent()``, so ``import dpoptim`` and building an
optimizer must not pay for it: the accounting modules call these thin wrappers, which
import scipy the first time one of them runs. ``log_expm1`` needs numpy only.
"""

from __future__ import annotations

import numpy as np


def log_expm1(x):
    """log(exp(x) - 1) for x >= 0, without overflow for large x or cancellation for small x."""
    with np.errstate(divide="ignore"):
        return x + np.log(-np.expm1(-x))


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
    """The frozen binomial distribution ``Binomial(n, p)`` (``sf``, ``pmf``, ``cdf``, ...)."""
    from scipy.stats import binom as distribution

    return distribution(n, p)
