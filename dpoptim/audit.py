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

:func:`audit_model` runs such an attack on the user's own model, loss and optimizer
settings: many trainings with and without a canary example, a score per trained model, a
threshold chosen on one half of the runs and the bound computed on the other half, next to
the accountant's epsilon and a positive control without noise.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from .nested import map_structure

__all__ = ["clopper_pearson", "epsilon_lower_bound", "AuditBound", "choose_threshold", "held_out_bound",
           "audit_model", "ModelAudit"]


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


# False-positive rates a threshold may aim for, as long as that means at least 5 false
# positives among the runs that choose it. Trying every observed score instead lets the
# choosing runs' noise pick thresholds deep in the tail that the held-out runs do not
# confirm: on Gaussian scores the grid gives about the same mean bound and a far better
# worst case.
FPR_GRID = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


def choose_threshold(positives, negatives, delta: float, confidence: float = 0.95) -> float:
    """Among thresholds at the :data:`FPR_GRID` quantiles of the ``negatives``' scores, the
    one whose rule "canary present iff score > t" has the highest bound on these scores.

    Use it on runs kept apart from those the bound is computed on (:func:`held_out_bound`):
    a threshold tuned on the same runs would make the bound optimistic.
    """
    pos, neg = np.asarray(positives, dtype=float), np.asarray(negatives, dtype=float)
    if not len(pos) or not len(neg):
        raise ValueError("choose_threshold needs scores of runs with and without the canary")
    best, best_t = -1.0, math.inf
    rates = [f for f in FPR_GRID if f * len(neg) >= 5] or [FPR_GRID[-1]]
    for fpr in rates:
        t = float(np.quantile(neg, 1 - fpr, method="higher"))
        bound = epsilon_lower_bound(int((pos > t).sum()), len(pos), int((neg > t).sum()), len(neg), delta,
                                    confidence).epsilon
        if bound > best:
            best, best_t = bound, t
    return best_t


def held_out_bound(positives, negatives, delta: float, confidence: float = 0.95) -> tuple[AuditBound, float]:
    """The threshold from the first half of each world's scores, the bound from the second
    half (so that choosing the threshold does not bias the bound); returns both."""
    pos, neg = np.asarray(positives, dtype=float), np.asarray(negatives, dtype=float)
    half_pos, half_neg = len(pos) // 2, len(neg) // 2
    if min(half_pos, half_neg) < 1:
        raise ValueError("held_out_bound needs at least 2 runs with and 2 without the canary")
    t = choose_threshold(pos[:half_pos], neg[:half_neg], delta, confidence)
    held_pos, held_neg = pos[half_pos:], neg[half_neg:]
    bound = epsilon_lower_bound(int((held_pos > t).sum()), len(held_pos), int((held_neg > t).sum()),
                                len(held_neg), delta, confidence)
    return bound, t


# ---------------------------------------------------------------------- an audit of the user's model
# Keyword arguments the positive control sets itself: noise off, so no budget to calibrate to.
_NOISE_SETTINGS = ("noise_multiplier", "target_epsilon", "steps", "epochs", "max_epsilon")


@dataclass
class ModelAudit:
    """What :func:`audit_model` found. ``bool(audit)`` is ``audit.passed``."""

    bound: AuditBound  # the attack on the private runs: a lower bound on epsilon
    accountant_epsilon: float  # what the optimizer's accountant reports for one run
    control: AuditBound | None  # the same attack with noise_multiplier=0 (None if skipped)
    delta: float
    confidence: float
    runs: int  # trainings per world (with and without the canary), half of them held out
    steps: int
    score: str
    threshold: float
    scores_in: np.ndarray  # the private runs' scores, with the canary
    scores_out: np.ndarray  # and without

    @property
    def epsilon_lower_bound(self) -> float:
        return self.bound.epsilon

    @property
    def has_power(self) -> bool | None:
        """The positive control proved some privacy loss (None when it was skipped)."""
        return None if self.control is None else self.control.epsilon > 0

    @property
    def passed(self) -> bool:
        """The attack proved no more than the accountant reports, and it was shown to work."""
        return self.bound.epsilon <= self.accountant_epsilon and self.has_power is not False

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        held = self.runs - self.runs // 2
        lines = [
            f"dpoptim audit: {'passed' if self.passed else 'FAILED'}",
            f"  {self.runs} trainings with and {self.runs} without the canary, {self.steps} step(s) each, score "
            f"'{self.score}'; threshold from {self.runs // 2} of each, bound from the other {held}",
            f"  lower bound on epsilon ({self.confidence:.0%} confidence, delta {self.delta:g}): "
            f"{self.bound.epsilon:.3f} (TPR {self.bound.tpr:.3f}, FPR {self.bound.fpr:.3f})",
            f"  accountant's epsilon for these settings: {self.accountant_epsilon:.3f}",
        ]
        if self.control is not None:
            lines.append(f"  positive control, noise off: lower bound {self.control.epsilon:.3f} "
                         f"(TPR {self.control.tpr:.3f}, FPR {self.control.fpr:.3f})")
        if self.bound.epsilon > self.accountant_epsilon:
            lines.append("  the attack proves more privacy loss than the accountant reports: the training "
                         "leaks beyond its epsilon (run dpoptim.check on the model and loss), unless a "
                         f"{1 - self.confidence:.0%} chance came up")
        if self.has_power is False:
            lines.append("  the positive control proved nothing: this canary and score cannot see the canary "
                         "even without noise, so the private bound says nothing. Use a canary far from the "
                         "data (an outlier input with a wrong label), more steps or more runs")
        elif self.bound.epsilon <= self.accountant_epsilon:
            lines.append("  a bound below the accountant's epsilon shows what this attack could not rule out, "
                         "not that the model is more private than reported")
        return "\n".join(lines)


def audit_model(make_model, data, loss_fn, *, canary, optimizer_class=None, optimizer_kwargs: dict,
                steps: int = 1, runs: int = 200, delta: float = 1e-5, confidence: float = 0.95,
                score: str = "gradient", control: bool = True) -> ModelAudit:
    """A membership attack on the user's own model, loss and DP optimizer settings.

    ``make_model()`` builds the model; ``data`` is the training set as one batch (a tensor,
    or tuples, lists and dicts of tensors with the example axis at dim 0), ``canary`` one
    more example in the same form, and ``loss_fn(model, batch)`` the training loop's scalar
    loss. ``optimizer_class`` (default :class:`dpoptim.DPSGD`) is built as
    ``optimizer_class(trainable parameters, **optimizer_kwargs)``; ``sample_rate`` in
    ``optimizer_kwargs`` (default 1: every example in every step) is the Poisson rate the
    audit samples with, the canary included, and ``expected_batch_size`` defaults to
    ``sample_rate * len(data)``, the same in both worlds.

    Each of ``2 * runs`` trainings starts from the same initial weights (one
    ``make_model()`` call, copied: the adversary of DP-SGD may know them) and runs
    ``steps`` steps with fresh noise and fresh sampling; ``runs`` of them have the canary in
    the training set. Each trained model gets a score, larger meaning "canary present":

    - ``'gradient'``: the parameter change projected on minus the canary's gradient
      direction at the initial weights (a white-box, gradient-canary attack, Nasr et al.
      2021); with DP-SGD the canary's clipped contribution moves the weights along it;
    - ``'loss'``: how much the canary's loss fell during training (black-box).

    The threshold is chosen on the first half of each world's runs and the bound,
    :func:`epsilon_lower_bound` at ``delta`` and ``confidence``, computed on the other half.
    With ``control=True`` the same attack runs again with ``noise_multiplier=0``: its bound
    must be clearly positive, or the attack could not have seen a leak. The result holds
    the bound, the accountant's epsilon for one run and the control's bound; it passes when
    the bound does not exceed the accountant's epsilon and the control proved something.

    A strong canary makes a tighter audit: an input unlike the data with a wrong label has a
    large gradient, which clipping caps at C, so each step moves the weights by the most one
    example can. Cost: ``2 * runs`` trainings (``4 * runs`` with the control).
    """
    from .check import example_count
    from .optimizer import DPSGD

    _check_audit_arguments(score, runs, steps, canary)
    kwargs = dict(optimizer_kwargs)
    q = float(kwargs.setdefault("sample_rate", 1.0))
    kwargs.setdefault("expected_batch_size", q * example_count(data))
    initial = make_model()
    direction = _canary_direction(initial, canary, loss_fn) if score == "gradient" else None
    attack = _Attack(initial, data, canary, loss_fn, DPSGD if optimizer_class is None else optimizer_class,
                     int(steps), q, score, direction)
    bound, threshold, pos, neg, optimizer = attack.run(kwargs, int(runs), delta, confidence)
    reported = float(optimizer.privacy_spent(delta).epsilon)
    control_bound = None
    if control:
        quiet = {k: v for k, v in kwargs.items() if k not in _NOISE_SETTINGS}
        control_bound = attack.run({**quiet, "noise_multiplier": 0.0}, int(runs), delta, confidence)[0]
    return ModelAudit(bound, reported, control_bound, delta, confidence, int(runs), int(steps), score, threshold,
                      pos, neg)


def _check_audit_arguments(score: str, runs, steps, canary) -> None:
    from .check import example_count

    if score not in ("gradient", "loss"):
        raise ValueError(f"score must be 'gradient' or 'loss', got {score!r}")
    if int(runs) != runs or runs < 4:
        raise ValueError(f"runs must be an integer >= 4 (half choose the threshold, half give the bound), got {runs}")
    if int(steps) != steps or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps}")
    if example_count(canary) != 1:
        raise ValueError(f"canary must be one example (the example axis of size 1), got {example_count(canary)}")


class _Attack:
    """The trainings of :func:`audit_model`: each from the same initial weights, with or
    without the canary, scored, and the bound from the scores."""

    def __init__(self, initial, data, canary, loss_fn, optimizer_class, steps: int, q: float, score: str, direction):
        from .check import example_count

        self.initial, self.data, self.canary, self.loss_fn = initial, data, canary, loss_fn
        self.optimizer_class, self.steps, self.q, self.score, self.direction = optimizer_class, steps, q, score, direction
        self.n = example_count(data)
        self.with_canary = _concat(data, canary)

    def one_world(self, settings, present: bool):
        """One training, with the canary in the training set or not: its score and optimizer."""
        from .check import take
        from .data import poisson_indices
        from .privatize import fresh_generator

        model = copy.deepcopy(self.initial)
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = self.optimizer_class(params, **settings)
        batch = self.with_canary if present else self.data
        size = self.n + 1 if present else self.n
        sampler = fresh_generator() if self.q < 1 else None  # q = 1: every example, nothing to draw
        for _ in range(self.steps):
            optimizer.zero_grad()
            idx = poisson_indices(size, self.q, sampler).tolist()
            if idx:
                self.loss_fn(model, take(batch, idx)).backward()
            optimizer.step()  # an empty batch is a step too: noise only, and charged
        engine = getattr(optimizer, "_engine", None)
        if engine is not None:
            engine.close()
        return _score(self.score, self.initial, model, self.canary, self.loss_fn, self.direction), optimizer

    def run(self, settings, runs: int, delta: float, confidence: float):
        """``runs`` trainings in each world: the bound, the threshold, both worlds' scores
        and the last optimizer (for the accountant's epsilon)."""
        scores = {True: [], False: []}
        last = None
        for k in range(2 * runs):  # interleaved, so that both worlds see the same conditions
            value, last = self.one_world(settings, k % 2 == 0)
            scores[k % 2 == 0].append(value)
        pos, neg = np.array(scores[True]), np.array(scores[False])
        bound, t = held_out_bound(pos, neg, delta, confidence)
        return bound, t, pos, neg, last


def _canary_direction(model, canary, loss_fn) -> list[torch.Tensor]:
    """Minus the canary's gradient at the initial weights, as a unit vector: the way its
    own (clipped) gradient step moves the model."""
    probe = copy.deepcopy(model)
    params = [p for p in probe.parameters() if p.requires_grad]
    loss_fn(probe, canary).backward()
    grads = [torch.zeros_like(p) if p.grad is None else -p.grad.detach() for p in params]
    norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
    if not norm > 0 or not math.isfinite(norm):
        raise ValueError(f"the canary's gradient at the initial weights has norm {norm}: it cannot move the "
                         "model. Choose a canary unlike the training data, with a wrong label")
    return [g / norm for g in grads]


def _score(kind, initial, model, canary, loss_fn, direction) -> float:
    if kind == "gradient":
        moved = [p.detach() - p0.detach() for p, p0 in zip(model.parameters(), initial.parameters()) if p0.requires_grad]
        return float(sum(float((m.double() * d.double()).sum()) for m, d in zip(moved, direction)))
    with torch.no_grad():
        return float(loss_fn(initial, canary)) - float(loss_fn(model, canary))


def _concat(a, b):
    """Two batches of the same structure, one after the other along dim 0."""
    def tensor(x, y):
        return torch.cat([x, y.to(x.device)]) if isinstance(x, torch.Tensor) and x.dim() else x

    return map_structure(tensor, a, b, values=lambda x, y: type(x)(list(x) + list(y)))
