"""Questions asked of an accountant: what epsilon, what noise, how many more steps.

* :func:`epsilon` and :func:`epsilon_of_ledger` read epsilon off one run or a ledger.
* :func:`calibrate_noise` finds the noise multiplier for a target epsilon.
* :func:`max_steps` finds how many more steps a budget allows. An optimizer enforcing a
  ``max_epsilon`` budget calls it once per change of ``(sigma, q)`` and then only counts
  steps, instead of computing epsilon after every step.

Every search keeps a bracket of *evaluated* points, so what it returns has been checked
with the same accountant that a later :func:`epsilon` call uses: the calibrated noise
never gives more than the target, and the step count never overshoots the budget.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from .ledger import (
    Accountant,
    Ledger,
    check_count,
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_sample_rate,
)
from .pld import PLDAccountant, pld_epsilon
from .rdp import DEFAULT_ORDERS, RDPAccountant, conversion_terms, ledger_rdp, rdp_subsampled_gaussian

__all__ = [
    "ACCOUNTANTS",
    "UNLIMITED_STEPS",
    "make_accountant",
    "epsilon",
    "epsilon_of_ledger",
    "calibrate_noise",
    "max_steps",
]

#: Accountant names and classes. ``pld`` is tight; ``rdp`` is the classic, looser bound.
ACCOUNTANTS: dict[str, type[Accountant]] = {"pld": PLDAccountant, "rdp": RDPAccountant}

#: What :func:`max_steps` returns when the budget is never exhausted (infinite noise or
#: an infinite budget) or lasts beyond 2**62 steps.
UNLIMITED_STEPS = sys.maxsize

_CALIBRATION_TOLERANCE = 0.002  # calibrated sigma reaches at least 99.8% of the target


def make_accountant(name: str = "pld") -> Accountant:
    """A fresh accountant by name: ``'pld'`` or ``'rdp'``."""
    return ACCOUNTANTS[_check_accountant(name)]()


def _check_accountant(name) -> str:
    if name not in ACCOUNTANTS:
        choices = " or ".join(repr(key) for key in ACCOUNTANTS)
        raise ValueError(f"accountant must be {choices}, got {name!r}")
    return name


def epsilon(noise_multiplier, sample_rate, steps, delta, accountant: str = "pld") -> float:
    """Epsilon after ``steps`` steps of the Poisson-subsampled Gaussian mechanism.

    >>> round(epsilon(10.0, 1.0, 100, 1e-5), 4)  # full batch: the analytic Gaussian
    4.3772
    """
    run = (
        check_noise_multiplier(noise_multiplier),
        check_sample_rate(sample_rate),
        check_count(steps, "steps"),
    )
    return epsilon_of_ledger([run], delta, accountant)


def epsilon_of_ledger(runs, delta, accountant: str = "pld") -> float:
    """Epsilon of a ledger: an iterable of ``(noise_multiplier, sample_rate, count)``."""
    name = _check_accountant(accountant)
    delta = check_delta(delta)
    ledger = Ledger(runs)
    if name == "pld":
        return pld_epsilon(ledger.runs, delta)
    return RDPAccountant.from_ledger(ledger).get_epsilon(delta)


def calibrate_noise(target_epsilon, delta, sample_rate, steps, accountant: str = "pld") -> float:
    """The noise multiplier that spends ``target_epsilon`` over ``steps`` steps.

    The result ``sigma`` satisfies ``epsilon(sigma, ...) <= target_epsilon`` and, up to a
    relative 0.2%, equals it: no noise is wasted. Zero steps need no noise (returns 0).
    """
    name = _check_accountant(accountant)
    target = check_epsilon(target_epsilon, "target_epsilon", positive=True)
    delta = check_delta(delta)
    q = check_sample_rate(sample_rate)
    steps = check_count(steps, "steps")
    if steps == 0 or math.isinf(target):
        return 0.0

    def eps(sigma: float, accountant_name: str) -> float:
        return epsilon_of_ledger([(sigma, q, steps)], delta, accountant_name)

    # RDP bounds PLD from above, so the RDP answer is feasible for both and a good start.
    sigma_rdp = _calibrate(lambda sigma: eps(sigma, "rdp"), target, start=1.0)
    if name == "rdp":
        return sigma_rdp
    return _calibrate(lambda sigma: eps(sigma, "pld"), target, start=sigma_rdp, close=True)


def _calibrate(eps_of, target: float, start: float, close: bool = False) -> float:
    """A sigma with target (1 - tolerance) <= eps_of(sigma) <= target.

    Keeps ``low`` (epsilon above target) and ``high`` (epsilon at most target), both
    evaluated, and narrows them by regula falsi on log epsilon against log sigma.
    ``close`` says the answer is known to lie a few percent below ``start``.
    """
    floor = target * (1.0 - _CALIBRATION_TOLERANCE)
    known: dict[float, float] = {}

    def f(sigma: float) -> float:
        if sigma not in known:
            known[sigma] = eps_of(sigma)
        return known[sigma]

    high = start
    while f(high) > target:
        high *= 2.0
        if high > 1e12:
            raise ValueError(f"target_epsilon {target!r} is out of reach: even sigma = 1e12 exceeds it")
    if f(high) >= floor:
        return high
    # Step down from high: PLD needs a few percent less noise than RDP, so begin close.
    low = high * (0.93 if close else 0.5)
    while f(low) <= target:
        if f(low) >= floor:
            return low
        high, low = low, low * (0.8 if close else 0.5)
        if low < 1e-6:
            return high
    for _ in range(100):
        # Interpolate log epsilon linearly in log sigma between the bracket ends.
        x_low, x_high = math.log(low), math.log(high)
        y_low, y_high = (math.log(v) if v > 0 else -math.inf for v in (f(low), f(high)))
        y_target = math.log(target * (1.0 - _CALIBRATION_TOLERANCE / 2))
        if math.isfinite(y_low) and math.isfinite(y_high) and y_low != y_high:
            x = x_low + (y_target - y_low) * (x_high - x_low) / (y_high - y_low)
        else:
            x = 0.5 * (x_low + x_high)
        # Stay strictly inside, and away from the ends, so the bracket always shrinks.
        margin = 0.05 * (x_high - x_low)
        x = min(max(x, x_low + margin), x_high - margin)
        sigma = math.exp(x)
        if f(sigma) > target:
            low = sigma
        else:
            high = sigma
            if f(sigma) >= floor:
                return sigma
        if x_high - x_low < 1e-12:
            break
    return high


def max_steps(
    noise_multiplier,
    sample_rate,
    delta,
    max_epsilon,
    ledger=(),
    accountant: str = "pld",
) -> int:
    """The largest ``k`` such that ``ledger`` plus ``k`` steps at ``(sigma, q)`` has epsilon
    at most ``max_epsilon``.

    Returns 0 if the ledger alone already exceeds the budget, and
    :data:`UNLIMITED_STEPS` if the budget is never exhausted (``sigma = inf`` or
    ``max_epsilon = inf``) or lasts beyond 2**62 steps. Uses ``O(log k)`` epsilon
    evaluations: the RDP bound in closed form gives a starting point (PLD never exceeds
    RDP, so it is within budget), a gallop finds a point beyond the budget, and a
    bracketed interpolation search on the accountant itself finishes.
    """
    name = _check_accountant(accountant)
    sigma = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    delta = check_delta(delta)
    budget = check_epsilon(max_epsilon, "max_epsilon")
    base = Ledger(ledger)

    def eps(k: int) -> float:
        return epsilon_of_ledger(base.compose(sigma, q, k).runs, delta, name)

    if eps(0) > budget:
        return 0
    if math.isinf(budget) or math.isinf(sigma):
        return UNLIMITED_STEPS
    if sigma == 0.0:
        return 0
    limit = 2**62
    # RDP in closed form: the exact answer for the RDP accountant up to rounding, and a
    # lower bound for PLD, which never exceeds RDP.
    low = _max_steps_rdp(sigma, q, delta, budget, base, limit)
    if low >= limit:
        return UNLIMITED_STEPS
    if low > 0 and eps(low) > budget:  # rounding, or a coarsened long ledger
        low = _last_feasible(eps, budget, 0, low)
    # Gallop up for a point over budget, then narrow the bracket (low in, high out).
    step = max(1, low // 8)
    high = low + step
    while eps(high) <= budget:
        low, step = high, 2 * step
        high = low + step
        if high >= limit:
            return UNLIMITED_STEPS
    return _last_feasible(eps, budget, low, high)


def _max_steps_rdp(sigma, q, delta, budget, base: Ledger, limit: int) -> int:
    """Largest k with RDP epsilon of base + k steps <= budget, in closed form.

    epsilon(k) = min over orders of R_base + k r + c (c the conversion term), so
    k <= (budget - c - R_base) / r at the best order.
    """
    per_step = np.asarray(rdp_subsampled_gaussian(sigma, q))
    base_rdp = ledger_rdp(base.runs) if base.steps else np.zeros_like(per_step)
    room = budget - conversion_terms(DEFAULT_ORDERS, delta) - base_rdp
    with np.errstate(divide="ignore", invalid="ignore"):
        counts = np.where(per_step > 0, room / per_step, np.where(room >= 0, np.inf, -np.inf))
    best = float(np.nanmax(counts))
    if best >= limit:
        return limit
    return max(0, math.floor(best))


def _last_feasible(eps_of, budget: float, low: int, high: int) -> int:
    """Given eps_of(low) <= budget < eps_of(high), the largest feasible k in between.

    Interpolation on epsilon (smooth in k) proposes the next point; a round that fails
    to halve the bracket is followed by a bisection, so the count of evaluations stays
    O(log(high - low)) and is usually a handful.
    """
    values = {low: eps_of(low), high: eps_of(high)}
    bisect = False
    while high - low > 1:
        width = high - low
        if bisect or not math.isfinite(values[high]):
            k = (low + high) // 2
        else:
            fraction = (budget - values[low]) / (values[high] - values[low])
            k = min(max(low + int(round(fraction * width)), low + 1), high - 1)
        values[k] = eps_of(k)
        if values[k] <= budget:
            low = k
        else:
            high = k
        bisect = not bisect and 2 * (high - low) > width
    return low
