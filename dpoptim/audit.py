"""Empirical privacy auditing: turn a membership attack's hits and misses into a lower
bound on epsilon.

An (epsilon, delta)-DP mechanism M limits every test that tries to tell from M's output
whether a dataset was D or its neighbour D' (one example, the *canary*, added). Call a
"positive" a run on D' and let the test say "canary present" with true-positive rate TPR
and false-positive rate FPR. Applying the DP inequality to the event "the test says
present" and to its complement (Kairouz, Oh & Viswanath 2015):

.. math::

    \\mathrm{TPR} \\le e^{\\varepsilon}\\,\\mathrm{FPR} + \\delta, \\qquad
    1 - \\mathrm{FPR} \\le e^{\\varepsilon}\\,(1 - \\mathrm{TPR}) + \\delta

so any mechanism that lets an attack reach (TPR, FPR) has

.. math::

    \\varepsilon \\ge \\max\\Big(\\log\\frac{\\mathrm{TPR} - \\delta}{\\mathrm{FPR}},\\;
                             \\log\\frac{1 - \\delta - \\mathrm{FPR}}{1 - \\mathrm{TPR}}\\Big).

An audit only sees rates estimated from a finite number of training runs. Replacing TPR
by a lower and FPR by an upper Clopper-Pearson confidence bound makes the right-hand side
a lower bound on epsilon that holds with the stated confidence. This is the audit of
Jagielski, Ullman & Oprea, "Auditing Differentially Private Machine Learning: How Private
is Private SGD?" (NeurIPS 2020), and of Nasr, Song, Thakurta, Papernot & Carlini,
"Adversary Instantiation: Lower Bounds for Differentially Private Machine Learning"
(IEEE S&P 2021), who show that a white-box adversary inserting a gradient ("Dirac")
canary makes it tight for DP-SGD.

If the bound exceeds the epsilon an accountant reports for the same mechanism, the
implementation (or the accountant) is broken, unless one chance in ``1 - confidence``
came up. A bound below the accountant's epsilon proves nothing about privacy: it only
shows what this attack, with this many runs, could not rule out.
"""

from __future__ import annotations

import math
from typing import NamedTuple

__all__ = ["clopper_pearson", "epsilon_lower_bound", "AuditBound"]


def _check_counts(successes, trials, name: str) -> tuple[int, int]:
    if int(successes) != successes or int(trials) != trials:
        raise ValueError(f"{name}: counts must be integers, got {successes} of {trials}")
    successes, trials = int(successes), int(trials)
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"{name}: need 0 <= successes <= trials and trials >= 1, got {successes} of {trials}")
    return successes, trials


def _check_level(value: float, name: str) -> float:
    value = float(value)
    if not 0 < value < 1:
        raise ValueError(f"{name} must be in (0, 1), got {value}")
    return value


def clopper_pearson(successes: int, trials: int, confidence: float = 0.95,
                    side: str = "two-sided") -> tuple[float, float]:
    """Clopper-Pearson ("exact") confidence interval for a binomial proportion.

    With ``k`` successes in ``n`` trials and ``alpha = 1 - confidence``, the bounds are
    quantiles of Beta distributions (Clopper & Pearson 1934):

    ==============  =======================================  =======================================
    ``side``        lower                                    upper
    ==============  =======================================  =======================================
    ``two-sided``   ``Beta(alpha/2; k, n-k+1)``               ``Beta(1-alpha/2; k+1, n-k)``
    ``lower``       ``Beta(alpha; k, n-k+1)``                 1
    ``upper``       0                                        ``Beta(1-alpha; k+1, n-k)``
    ==============  =======================================  =======================================

    with the lower bound 0 when ``k = 0`` and the upper bound 1 when ``k = n``. The
    interval covers the true proportion with probability at least ``confidence``
    whatever it is (conservative, never anti-conservative).
    """
    from scipy.stats import beta

    k, n = _check_counts(successes, trials, "clopper_pearson")
    alpha = 1.0 - _check_level(confidence, "confidence")
    if side == "two-sided":
        tail_lo = tail_hi = alpha / 2
    elif side == "lower":
        tail_lo, tail_hi = alpha, 0.0
    elif side == "upper":
        tail_lo, tail_hi = 0.0, alpha
    else:
        raise ValueError(f"side must be 'two-sided', 'lower' or 'upper', got {side!r}")
    lower = 0.0 if k == 0 or tail_lo == 0 else float(beta.ppf(tail_lo, k, n - k + 1))
    upper = 1.0 if k == n or tail_hi == 0 else float(beta.ppf(1 - tail_hi, k + 1, n - k))
    return lower, upper


class AuditBound(NamedTuple):
    """What :func:`epsilon_lower_bound` found: the bound and the rates it came from."""

    epsilon: float  # lower bound on epsilon, >= 0
    tpr: float  # observed true-positive rate
    fpr: float  # observed false-positive rate
    tpr_lower: float  # one-sided Clopper-Pearson lower bound on the TPR
    fpr_upper: float  # one-sided Clopper-Pearson upper bound on the FPR


def epsilon_lower_bound(true_positives: int, positives: int, false_positives: int, negatives: int,
                        delta: float, confidence: float = 0.95) -> AuditBound:
    """A lower bound on epsilon that holds with probability ``>= confidence``.

    ``positives`` runs had the canary and the attack flagged ``true_positives`` of them;
    ``negatives`` runs did not and it flagged ``false_positives``. With ``TPR_lo`` a
    one-sided lower and ``FPR_hi`` a one-sided upper Clopper-Pearson bound, each at level
    ``1 - (1 - confidence) / 2`` so that both hold together with probability at least
    ``confidence`` (union bound),

    .. math::

        \\varepsilon \\ge \\max\\Big(\\log\\frac{\\mathrm{TPR_{lo}} - \\delta}{\\mathrm{FPR_{hi}}},\\;
                                 \\log\\frac{1 - \\delta - \\mathrm{FPR_{hi}}}{1 - \\mathrm{TPR_{lo}}}\\Big)

    (Jagielski et al. 2020; Nasr et al. 2021), floored at 0. Both terms fall as TPR falls
    and FPR rises, so the worst case of the interval is at (TPR_lo, FPR_hi).
    """
    tp, pos = _check_counts(true_positives, positives, "true positives")
    fp, neg = _check_counts(false_positives, negatives, "false positives")
    if not 0 <= float(delta) < 1:
        raise ValueError(f"delta must be in [0, 1), got {delta}")
    level = 1.0 - (1.0 - _check_level(confidence, "confidence")) / 2
    tpr_lo, _ = clopper_pearson(tp, pos, level, side="lower")
    _, fpr_hi = clopper_pearson(fp, neg, level, side="upper")
    terms = [0.0]
    if tpr_lo - delta > 0:  # fpr_hi > 0 always: its upper bound is positive even with 0 hits
        terms.append(math.log((tpr_lo - delta) / fpr_hi))
    if 1 - delta - fpr_hi > 0:  # likewise 1 - tpr_lo > 0
        terms.append(math.log((1 - delta - fpr_hi) / (1 - tpr_lo)))
    return AuditBound(max(terms), tp / pos, fp / neg, tpr_lo, fpr_hi)
