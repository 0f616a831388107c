r"""Rényi differential privacy (RDP) of the Poisson-subsampled Gaussian mechanism.

One step releases :math:`M(D) = \sum_{x \in B} g(x) + \mathcal N(0, \sigma^2 C^2 I)`, each
example joining the batch :math:`B` independently with probability :math:`q`. Scaling by
the clipping norm :math:`C` reduces every add/remove neighbour pair to the one-dimensional
pair (Mironov, Talwar & Zhang 2019, "Rényi Differential Privacy of the Sampled Gaussian
Mechanism", arXiv:1908.10530, Section 3)

.. math::
    \mu_0 = \mathcal N(0, \sigma^2), \qquad \mu = (1 - q)\,\mu_0 + q\,\mathcal N(1, \sigma^2),

and the RDP of order :math:`\alpha > 1` is
:math:`\varepsilon(\alpha) = \frac{1}{\alpha - 1} \log A_\alpha` with
:math:`A_\alpha = \mathbb E_{z \sim \mu_0}[(\mu(z) / \mu_0(z))^\alpha]`. The same paper
(Theorem 5) shows that this direction dominates the other one,
:math:`D_\alpha(\mu_0 \| \mu) \le D_\alpha(\mu \| \mu_0)`, so :math:`\varepsilon(\alpha)`
covers both adding and removing an example.

* Integer orders use the binomial expansion (MTZ19, Section 3.2)
  :math:`A_\alpha = \sum_{k=0}^{\alpha} \binom{\alpha}{k} (1-q)^{\alpha-k} q^k
  e^{(k^2 - k) / (2\sigma^2)}`, rewritten as
  :math:`A_\alpha - 1 = \sum_{k \ge 2} \binom{\alpha}{k} (1-q)^{\alpha-k} q^k
  \operatorname{expm1}((k^2-k)/(2\sigma^2))` (the plain binomial terms sum to one), whose
  terms are all positive. It is summed in log space with log binomials from ``lgamma``,
  so orders in the tens of thousands neither overflow nor lose the tiny
  :math:`A_\alpha - 1` of a large :math:`\sigma` to rounding.
* Fractional orders use the two-sided series of MTZ19, Section 3.3, with
  :math:`z_0 = \sigma^2 \log(1/q - 1) + 1/2`:

  .. math::
      A_\alpha = \sum_{i \ge 0} \binom{\alpha}{i} \Big[
          q^i (1-q)^{\alpha-i} e^{(i^2-i)/(2\sigma^2)} \Phi\big(\tfrac{z_0 - i}{\sigma}\big)
        + q^{\alpha-i} (1-q)^i e^{(j^2-j)/(2\sigma^2)} \Phi\big(\tfrac{j - z_0}{\sigma}\big)
      \Big], \quad j = \alpha - i.

  The binomial coefficients keep their signs (summing absolute values would be sound but
  loose). From :math:`i = \lfloor\alpha\rfloor + 1` on the terms alternate in sign and
  shrink in magnitude, so stopping at term :math:`N` and adding that term when it is
  positive is a rigorous upper bound on :math:`A_\alpha` (alternating series remainder).

Conversion to :math:`(\varepsilon, \delta)` uses the bound of Canonne, Kamath & Steinke 2020
("The Discrete Gaussian for Differential Privacy", Proposition 12; also Balle et al. 2020,
"Hypothesis Testing Interpretations and Renyi Differential Privacy", Theorem 21):

.. math::
    \varepsilon = \min_\alpha \; \varepsilon_{\text{RDP}}(\alpha)
        + \log\frac{\alpha - 1}{\alpha} - \frac{\log\delta + \log\alpha}{\alpha - 1},

which is tighter than Mironov's original :math:`\varepsilon(\alpha) + \log(1/\delta)/(\alpha-1)`.
RDP composes additively over steps, so a run of ``count`` identical steps costs one
multiplication.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from .special import finite_abs, gammaln, gammasgn, log_expm1, log_ndtr

from .ledger import (
    Accountant,
    Ledger,
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_sample_rate,
    coarsen_runs,
)

__all__ = [
    "DEFAULT_ORDERS",
    "RDPAccountant",
    "rdp_subsampled_gaussian",
    "ledger_rdp",
    "epsilon_from_rdp",
    "delta_from_rdp",
]

# Machine epsilon, used for explicit rounding allowances that keep results upper bounds.
_EPS = float(np.finfo(np.float64).eps)

# Terms of the fractional series beyond floor(alpha) + 1. The remainder bound makes any
# number sound; with 64 the slack it leaves is below 1e-6 relative even in the slowest
# converging case (q near 1/2, large sigma, alpha near 1).
_FRACTIONAL_EXTRA_TERMS = 64


def _default_orders() -> np.ndarray:
    # Fine fractional steps where the optimum sits for moderate and large epsilon,
    # every integer to 256, then a geometric grid to 8192 for large sigma and few steps.
    fractional = 1.0 + np.arange(1, 900) / 100.0
    fractional = fractional[fractional != np.round(fractional)]
    integers = np.arange(2, 257, dtype=float)
    geometric = np.unique(np.round(np.geomspace(256, 8192, 70)))
    orders = np.unique(np.concatenate([fractional, integers, geometric]))
    orders.setflags(write=False)
    return orders


#: Orders used when none are given: 891 fractional orders in (1, 10), every integer from
#: 2 to 256 and 69 geometrically spaced integers up to 8192 (1215 orders in all).
DEFAULT_ORDERS = _default_orders()


def rdp_subsampled_gaussian(noise_multiplier, sample_rate, orders=None) -> np.ndarray:
    """RDP of one step of the Poisson-subsampled Gaussian, at each order in ``orders``.

    Args:
        noise_multiplier: sigma, the noise standard deviation over the clipping norm.
        sample_rate: q, the probability that an example joins a batch.
        orders: orders alpha > 1 (default :data:`DEFAULT_ORDERS`).

    Returns:
        A float array like ``orders``: ``inf`` where sigma is 0, zeros where sigma is inf.
        Never NaN; every entry is an upper bound on the true RDP (rounding included).
    """
    sigma = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    if orders is None:
        return _default_rdp(sigma, q)
    orders = _check_orders(orders)
    if orders.size <= 256:  # small order sets (the PLD's window) are cached too
        return _cached_rdp(sigma, q, orders.tobytes())
    return _rdp(sigma, q, orders)


def _check_orders(orders) -> np.ndarray:
    orders = np.atleast_1d(np.asarray(orders, dtype=float))
    if orders.ndim != 1 or orders.size == 0 or not np.all(orders > 1) or not np.all(np.isfinite(orders)):
        raise ValueError(f"orders must be finite numbers > 1, got {orders!r}")
    return orders


@functools.lru_cache(maxsize=1024)
def _default_rdp(sigma: float, q: float) -> np.ndarray:
    rdp = _rdp(sigma, q, DEFAULT_ORDERS)
    rdp.setflags(write=False)
    return rdp


@functools.lru_cache(maxsize=4096)
def _cached_rdp(sigma: float, q: float, orders: bytes) -> np.ndarray:
    rdp = _rdp(sigma, q, np.frombuffer(orders, dtype=float))
    rdp.setflags(write=False)
    return rdp


def _rdp(sigma: float, q: float, orders: np.ndarray) -> np.ndarray:
    if sigma == 0.0 or math.isinf(0.5 / sigma / sigma):
        # No noise, or so little that 1 / (2 sigma^2) overflows: report no guarantee.
        return np.full(orders.shape, math.inf)
    if math.isinf(sigma * sigma):
        # Infinite noise, or so much that sigma^2 overflows: the RDP underflows to zero.
        return np.zeros(orders.shape)
    if q == 1.0:
        # Plain Gaussian mechanism: D_alpha = alpha / (2 sigma^2) (Mironov 2017, Prop. 7).
        return orders / (2.0 * sigma * sigma)
    rdp = np.empty(orders.shape)
    integral = orders == np.round(orders)
    if integral.any():
        alphas = orders[integral]
        log_a_minus_1 = _log_a_minus_1_integer(tuple(int(a) for a in alphas), sigma, q)
        rdp[integral] = np.logaddexp(0.0, log_a_minus_1) / (alphas - 1.0)
    if (~integral).any():
        alphas = orders[~integral]
        rdp[~integral] = _log_a_fractional(tuple(alphas), sigma, q) / (alphas - 1.0)
    # NaN can only come from inf - inf after an overflow, i.e. from an RDP too large to
    # represent: report it as infinite (no guarantee) rather than drop the order.
    return np.where(np.isnan(rdp), math.inf, rdp)


@functools.lru_cache(maxsize=8)
def _integer_layout(alphas: tuple) -> tuple:
    """The (alpha, k) pairs with 2 <= k <= alpha, flattened, and log binom(alpha, k) for each."""
    alpha = np.asarray(alphas, dtype=np.int64)
    lengths = alpha - 1
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    alpha_flat = np.repeat(alpha, lengths)
    k_flat = np.arange(lengths.sum()) - np.repeat(starts, lengths) + 2
    log_factorial = gammaln(np.arange(alpha.max() + 1) + 1.0)
    log_binom = log_factorial[alpha_flat] - log_factorial[k_flat] - log_factorial[alpha_flat - k_flat]
    return alpha.astype(float), k_flat, log_binom, starts, lengths


def _log_a_minus_1_integer(alphas: tuple, sigma: float, q: float) -> np.ndarray:
    """log(A_alpha - 1) for integer alpha >= 2 (MTZ19, Sec. 3.2), all terms positive."""
    alpha, k_flat, log_binom, starts, lengths = _integer_layout(alphas)
    log_q, log_1mq = math.log(q), math.log1p(-q)
    k = np.arange(int(alpha.max()) + 1, dtype=float)
    log_excess = log_expm1(k * (k - 1.0) / (2.0 * sigma * sigma))
    # log of binom(alpha, k) q^k (1-q)^(alpha-k) expm1(k(k-1)/(2 sigma^2)), with the
    # alpha log(1-q) part added per order after the sum.
    per_k = k * (log_q - log_1mq) + log_excess
    log_terms = log_binom + per_k[k_flat]
    peak = np.maximum.reduceat(log_terms, starts)
    finite_peak = np.where(np.isfinite(peak), peak, 0.0)
    with np.errstate(invalid="ignore"):
        total = np.add.reduceat(np.exp(log_terms - np.repeat(finite_peak, lengths)), starts)
    # Rounding allowance: every log term adds five rounded quantities, each at most as
    # large as the bounds below; the sum of n positive terms adds (n + 2) eps relative.
    magnitude = alpha * (math.log(2.0) + abs(log_q) + 2.0 * abs(log_1mq)) + np.maximum(
        abs(log_excess[2]), finite_abs(log_excess[alpha.astype(np.int64)])
    )
    allowance = 8.0 * _EPS * magnitude + 4.0 * (alpha + 2.0) * _EPS
    with np.errstate(divide="ignore"):
        return finite_peak + np.log(total) + alpha * log_1mq + allowance


@functools.lru_cache(maxsize=8)
def _fractional_layout(alphas: tuple) -> tuple:
    """Everything in the fractional series that depends on the orders only."""
    alpha = np.asarray(alphas, dtype=float)[:, None]
    n_last = int(np.floor(alpha.max())) + 1 + _FRACTIONAL_EXTRA_TERMS
    i = np.arange(n_last + 2, dtype=float)[None, :]  # terms 0 .. N+1
    j = alpha - i
    log_abs_binom = gammaln(alpha + 1.0) - gammaln(i + 1.0) - gammaln(j + 1.0)
    # Terms 0 .. N-1 enter with their signs; terms N and N+1 bound the tail.
    weight = gammasgn(j + 1.0)
    # j = alpha - i takes few distinct values on a regular grid of orders: evaluate the
    # j-only factors once per distinct value.
    j_values, j_index = np.unique(j, return_inverse=True)
    return alpha, i, log_abs_binom, weight, j_values, j_index.reshape(j.shape), n_last


def _alternating_tail_bound(sign: np.ndarray, first: np.ndarray, second: np.ndarray) -> np.ndarray:
    r"""Upper bound on :math:`R = \sum_{n \ge N} t_n` from its first two terms.

    From term :math:`\lfloor\alpha\rfloor + 1` on, :math:`t_n = \pm a_n` alternates in sign
    and :math:`a_n` is completely monotone in ``n`` (a product of moment sequences:
    :math:`|\binom{\alpha}{n}| \propto \int_0^1 t^{n-\alpha-1}(1-t)^\alpha dt`, and each
    half of the term is a moment of a ratio at most 1), hence decreasing and convex.
    Pairing terms then gives :math:`|R| \in [a_N / 2, (a_N + a_N - a_{N+1}) / 2]` with the
    sign of :math:`t_N` (a far tighter tail than the usual :math:`|R| \le a_N`).
    """
    return np.where(sign > 0, (2.0 * first - second) / 2.0, -first / 2.0)


def _log_a_fractional(alphas: tuple, sigma: float, q: float) -> np.ndarray:
    """log A_alpha for non-integer alpha by the signed two-sided series of MTZ19, Sec. 3.3."""
    alpha, i, log_abs_binom, weight, j_values, j_index, n_last = _fractional_layout(alphas)
    log_q, log_1mq = math.log(q), math.log1p(-q)
    z0 = sigma * sigma * (log_1mq - log_q) + 0.5
    two_var = 2.0 * sigma * sigma
    # First half: binom(alpha, i) q^i (1-q)^(alpha-i) e^{(i^2-i)/(2 s^2)} Phi((z0-i)/s).
    i_parts = (i * (log_q - log_1mq), (i * i - i) / two_var, log_ndtr((z0 - i) / sigma))
    row = alpha * log_1mq
    log_s0 = sum(i_parts) + row
    # Second half: binom(alpha, i) q^j (1-q)^i e^{(j^2-j)/(2 s^2)} Phi((j-z0)/s), j = alpha - i.
    j_parts = (j_values * log_q, (j_values**2 - j_values) / two_var, log_ndtr((j_values - z0) / sigma))
    log_s1 = sum(j_parts)[j_index] + i * log_1mq
    log_halves = np.logaddexp(log_s0, log_s1)
    log_terms = log_abs_binom + log_halves
    peak = log_terms.max(axis=1, keepdims=True)
    scaled = np.exp(log_terms - peak)
    total = (weight[:, :-2] * scaled[:, :-2]).sum(axis=1) + _alternating_tail_bound(
        weight[:, -2], scaled[:, -2], scaled[:, -1]
    )
    # Rounding allowance, term by term: 8 eps of the magnitudes added in its log (large
    # for small sigma, where the quadratic exponent and the Gaussian log tail nearly
    # cancel), each half weighted by its share of the term, plus the summation error.
    share0 = np.exp(log_s0 - log_halves)
    magnitude = (
        np.abs(log_abs_binom)
        + share0 * (sum(finite_abs(p) for p in i_parts) + np.abs(row))
        + (1.0 - share0) * (sum(finite_abs(p) for p in j_parts)[j_index] + np.abs(i * log_1mq))
    )
    rounding = (scaled * (8.0 * _EPS * magnitude)).sum(axis=1) + (n_last + 3) * _EPS * scaled.sum(axis=1)
    return peak[:, 0] + np.log(total + rounding)


def ledger_rdp(runs, orders=None) -> np.ndarray:
    """Total RDP of a ledger of ``(sigma, q, count)`` runs: the per-step RDPs times counts.

    Equal ``(sigma, q)`` pairs are merged; beyond
    :data:`~dpoptim.accounting.ledger.MAX_DISTINCT_RUNS` distinct pairs the ledger is
    coarsened pessimistically (:func:`~dpoptim.accounting.ledger.coarsen_runs`).
    """
    total = np.zeros(DEFAULT_ORDERS.shape if orders is None else np.shape(_check_orders(orders)))
    for sigma, q, count in coarsen_runs(Ledger(runs).runs):
        total = total + count * rdp_subsampled_gaussian(sigma, q, orders)
    return total


def conversion_terms(orders: np.ndarray, delta: float) -> np.ndarray:
    """epsilon(alpha) - RDP(alpha) in the conversion of Canonne, Kamath & Steinke 2020,
    Prop. 12: log((alpha - 1) / alpha) - (log delta + log alpha) / (alpha - 1)."""
    return np.log1p(-1.0 / orders) - (math.log(delta) + np.log(orders)) / (orders - 1.0)


def epsilon_from_rdp(rdp, orders, delta) -> tuple[float, float]:
    """Best (epsilon, order) from an RDP curve (Canonne, Kamath & Steinke 2020, Prop. 12).

    Returns ``(inf, nan)`` when every order is infinite. Raises if any order is NaN, so
    no order is ever silently dropped.
    """
    delta = check_delta(delta)
    rdp = np.asarray(rdp, dtype=float)
    orders = _check_orders(orders)
    if rdp.shape != orders.shape:
        raise ValueError(f"rdp and orders must have the same shape, got {rdp.shape} and {orders.shape}")
    if np.isnan(rdp).any():
        raise ValueError("rdp contains NaN")
    eps = rdp + conversion_terms(orders, delta)
    best = int(np.argmin(eps))
    if math.isinf(eps[best]):
        return math.inf, math.nan
    return max(float(eps[best]), 0.0), float(orders[best])


def delta_from_rdp(rdp, orders, epsilon) -> float:
    """Smallest delta the RDP curve certifies at ``epsilon`` (the inverse of the conversion)."""
    epsilon = check_epsilon(epsilon)
    rdp = np.asarray(rdp, dtype=float)
    orders = _check_orders(orders)
    with np.errstate(invalid="ignore"):
        log_delta = (orders - 1.0) * (rdp - epsilon + np.log1p(-1.0 / orders)) - np.log(orders)
    log_delta = np.where(np.isnan(log_delta), math.inf, log_delta)
    return float(min(1.0, math.exp(min(0.0, float(log_delta.min())))))


class RDPAccountant(Accountant):
    """Accountant that composes RDP over the ledger and converts once to (epsilon, delta).

    >>> acc = RDPAccountant().compose(1.1, 0.004, count=10_000)
    >>> round(acc.get_epsilon(1e-5), 2)
    2.01
    """

    name = "rdp"

    def __init__(self, orders=None):
        super().__init__()
        self._orders = None if orders is None else _check_orders(orders)

    @property
    def orders(self) -> np.ndarray:
        return DEFAULT_ORDERS if self._orders is None else self._orders

    def get_rdp(self) -> np.ndarray:
        """Total RDP of the ledger at each of :attr:`orders`."""
        return ledger_rdp(self.ledger, self._orders)

    def get_epsilon_and_order(self, delta) -> tuple[float, float]:
        """(epsilon, the order that attains it); epsilon is 0 for an empty ledger."""
        delta = check_delta(delta)
        rdp = self.get_rdp() if self.steps else None
        if rdp is None or not np.any(rdp > 0):
            return 0.0, math.nan  # nothing revealed: P = Q at every step
        return epsilon_from_rdp(rdp, self.orders, delta)

    def get_epsilon(self, delta) -> float:
        return self.get_epsilon_and_order(delta)[0]

    def get_delta(self, epsilon) -> float:
        """Smallest delta certified at ``epsilon`` (0 for an empty ledger)."""
        epsilon = check_epsilon(epsilon)
        if self.steps == 0:
            return 0.0
        return delta_from_rdp(self.get_rdp(), self.orders, epsilon)
