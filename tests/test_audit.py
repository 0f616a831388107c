"""Empirical privacy audit of DPSGD: a white-box canary attack whose success must never
prove more privacy loss than the accountant reports.

The attack (the "Dirac canary" of Nasr et al. 2021, in the spirit of Jagielski et al.
2020). A linear regression model ``Linear(d, 1)`` with bias is trained with the real
``dpoptim.DPSGD`` (real hooks, Linear rule, clipping, noise and ledger) for a few
full-batch steps on ``n`` random examples whose last input coordinate ``k`` is always 0.
In half of the runs the training set also holds a canary ``x = M e_k`` with a target far
away, so its gradient is huge and points (almost) along ``+w_k``: after clipping it moves
``w_k`` by ``lr C M / sqrt(M^2 + 1) / B`` per step, and no other example ever moves
``w_k``. The adversary sees the initial and final model and scores a run by how far
``w_k`` moved. That is the strongest attack on this mechanism: the score is the Gaussian
mechanism's output itself, ``N(T s, T (lr sigma C / B)^2)`` with or without the shift.

Each setting runs ``4N`` independent trainings (fresh model, data, optimizer and seeded
noise generator). ``N`` with and ``N`` without the canary choose the threshold (among
the no-canary scores' quantiles for a grid of false-positive rates, the one with the
highest bound); the other ``2N`` are scored with it, and
:func:`dpoptim.audit.epsilon_lower_bound` turns their TPR/FPR into a 95% lower bound on
epsilon. With full batches (q = 1) the exact epsilon is the analytic Gaussian mechanism's
(Balle & Wang 2018) with ``mu = sqrt(T) / sigma``, computed below from its formula; the
accountant must report at least the bound, and so must the formula.

The bound is checked at delta = 1e-5 and at 1e-2. Audits are loose at small delta (with
2000 held-out runs per world the best possible bound is about 6.3), so at 1e-5 the test
catches gross failures: noise or clipping missing. At 1e-2 it gets within a factor of
about two of the truth and also catches noise too small by a factor of two
(mutation-tested: noise sigma/2 or clipping to 2C give bounds of about 2.9 against the
true 2.32; no clipping gives 6.3).

``DPOPTIM_LONG_AUDIT=1`` runs more trials, more settings and a Poisson-sampled one.
"""

import math
import os
import time

import numpy as np
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm
from torch import nn

import dpoptim
from dpoptim.audit import audit_model, clopper_pearson, epsilon_lower_bound, held_out_bound

LONG = os.environ.get("DPOPTIM_LONG_AUDIT") == "1"
D = 4  # input width; the last coordinate belongs to the canary
N_OTHERS = 8  # examples besides the canary, also the expected batch size
C = 1.0
LR = 1.0
M = 1e3  # canary input magnitude: its gradient is ~M * 1e6, far above C
CANARY_TARGET = 1e6  # far enough that w_k never gets near it


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny steps: see conftest.py


# ----------------------------------------------------------------- the mechanism and the attack
def train_once(seed: int, with_canary: bool, sigma: float, steps: int, sample_rate: float = 1.0):
    """One training run; returns (score, optimizer). Score = how far w_k moved."""
    data_gen = torch.Generator().manual_seed(2 * seed + 1)
    noise_gen = torch.Generator().manual_seed(2 * seed)
    model = nn.Linear(D, 1).double()  # its initial weights do not affect the score
    opt = dpoptim.DPSGD(
        model.parameters(), lr=LR, noise_multiplier=sigma, max_grad_norm=C,
        expected_batch_size=N_OTHERS * sample_rate, sample_rate=sample_rate, generator=noise_gen,
    )
    x = torch.randn(N_OTHERS, D, generator=data_gen, dtype=torch.float64)
    x[:, -1] = 0.0
    y = torch.randn(N_OTHERS, 1, generator=data_gen, dtype=torch.float64)
    if with_canary:
        canary = torch.zeros(1, D, dtype=torch.float64)
        canary[0, -1] = M
        x = torch.cat([x, canary])
        y = torch.cat([y, torch.full((1, 1), CANARY_TARGET, dtype=torch.float64)])
    w_k = model.weight[0, -1].item()
    for _ in range(steps):
        keep = torch.ones(len(x), dtype=torch.bool)
        if sample_rate < 1:  # Poisson sampling, canary included
            keep = torch.rand(len(x), generator=data_gen) < sample_rate
        opt.zero_grad()
        xb, yb = x[keep], y[keep]
        if len(xb):
            (0.5 * (model(xb) - yb).square().sum(1)).mean().backward()
        opt.step()  # an empty batch is still a (noise-only) step
    return model.weight[0, -1].item() - w_k, opt


def run_trainings(sigma: float, steps: int, trials: int, sample_rate: float = 1.0):
    """``2 * trials`` runs with and ``2 * trials`` without the canary; returns their scores
    and the last run's optimizer, after checking that every run's ledger is the same."""
    scores = {True: [], False: []}
    ledgers = set()
    for seed in range(4 * trials):
        present = seed % 2 == 0
        score, opt = train_once(seed, present, sigma, steps, sample_rate)
        scores[present].append(score)
        ledgers.add(opt.ledger)
    assert ledgers == {((sigma, sample_rate, steps),)}, f"each run's ledger must be one run of {steps} steps: {ledgers}"
    return np.array(scores[True]), np.array(scores[False]), opt


def audit_bound(pos: np.ndarray, neg: np.ndarray, delta: float):
    """Threshold from the first half of each world's runs, bound from the second half."""
    return held_out_bound(pos, neg, delta)


def analytic_gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon of mu-GDP at delta (Balle & Wang 2018, Theorem 8):
    delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2)."""
    f = lambda e: norm.cdf(-e / mu + mu / 2) - math.exp(e) * norm.cdf(-e / mu - mu / 2) - delta
    return brentq(f, 0.0, 200.0, xtol=1e-12)


def accountant_epsilon(sigma, q, steps, delta):
    from dpoptim import accounting

    return float(accounting.epsilon(sigma, q, steps, delta, accountant="pld"))


# ----------------------------------------------------------------- the helpers themselves
def test_clopper_pearson_against_binomial_tails():
    """The bounds are where the binomial tail probabilities equal alpha (or alpha/2)."""
    from scipy.stats import binom

    for k, n in [(0, 10), (3, 10), (10, 10), (37, 200), (500, 1000)]:
        lo, hi = clopper_pearson(k, n, 0.95)
        if k > 0:
            assert binom.sf(k - 1, n, lo) == pytest.approx(0.025, rel=1e-6)  # P(X >= k | lo)
        else:
            assert lo == 0.0
        if k < n:
            assert binom.cdf(k, n, hi) == pytest.approx(0.025, rel=1e-6)  # P(X <= k | hi)
        else:
            assert hi == 1.0
        lo1, _ = clopper_pearson(k, n, 0.95, side="lower")
        _, hi1 = clopper_pearson(k, n, 0.95, side="upper")
        assert lo1 >= lo and hi1 <= hi
    # A closed form: 0 successes in n, one-sided upper bound = 1 - alpha^(1/n).
    assert clopper_pearson(0, 50, 0.9, side="upper")[1] == pytest.approx(1 - 0.1 ** (1 / 50), rel=1e-9)
    with pytest.raises(ValueError):
        clopper_pearson(5, 4)
    with pytest.raises(ValueError):
        clopper_pearson(1, 4, side="left")


def test_clopper_pearson_covers():
    """Coverage over many simulated binomials is at least the confidence."""
    rng = np.random.default_rng(0)
    for p in (0.01, 0.3, 0.97):
        ks = rng.binomial(40, p, size=400)
        covered = [lo <= p <= hi for lo, hi in (clopper_pearson(int(k), 40, 0.9) for k in ks)]
        assert np.mean(covered) >= 0.9 - 0.03  # 0.03: sampling slack of 400 draws


def test_epsilon_lower_bound_by_hand():
    # Perfect separation of 1000 vs 1000: each one-sided bound at 97.5% is alpha^(1/n).
    a = 0.025 ** (1 / 1000)
    b = epsilon_lower_bound(1000, 1000, 0, 1000, delta=0.0)
    assert b.tpr_lower == pytest.approx(a, rel=1e-9)
    assert b.fpr_upper == pytest.approx(1 - a, rel=1e-9)
    assert b.epsilon == pytest.approx(math.log(a / (1 - a)), rel=1e-9)
    # The second inequality decides when the attack mostly says "absent" correctly.
    b = epsilon_lower_bound(500, 1000, 0, 1000, delta=1e-5)
    lo = b.tpr_lower
    assert b.epsilon == pytest.approx(max(math.log((lo - 1e-5) / b.fpr_upper), math.log((1 - 1e-5 - b.fpr_upper) / (1 - lo))))
    # A coin flip proves nothing; neither does a huge delta.
    assert epsilon_lower_bound(500, 1000, 500, 1000, delta=1e-5).epsilon == 0.0
    assert epsilon_lower_bound(1000, 1000, 0, 1000, delta=0.999).epsilon == 0.0
    # More trials, same rates: a tighter (larger) bound.
    assert epsilon_lower_bound(90, 100, 10, 100, 1e-5).epsilon < epsilon_lower_bound(900, 1000, 100, 1000, 1e-5).epsilon


def test_analytic_gaussian_reference_value():
    # sigma = 10, q = 1, T = 100 steps compose to mu = 1 Gaussian DP (Dong, Roth & Su 2019),
    # whose exact epsilon at delta = 1e-5 is 4.377178.
    assert analytic_gaussian_epsilon(1.0, 1e-5) == pytest.approx(4.377178, abs=1e-5)


# ----------------------------------------------------------------- the audit
# (sigma, steps) with mu = sqrt(steps) / sigma = 1: epsilon is 4.38 at delta = 1e-5 and 2.32
# at delta = 1e-2. The audit is checked at both: at 1e-5, the delta people use, it catches
# missing noise or clipping; at 1e-2, where 2000 held-out runs per world get within a factor
# of two of the truth, it also catches noise too small by a factor of 2 (mu = 2 gives an
# expected bound of about 3.3 > 2.32).
DEFAULT_TRIALS = 2000
SETTINGS = [(1.0, 1)]
LONG_TRIALS = 5000
LONG_SETTINGS = [(1.0, 1), (2.0, 4), (0.7, 1), (0.5, 2)]
DELTAS = (1e-5, 1e-2)


@pytest.mark.parametrize("sigma,steps", LONG_SETTINGS if LONG else SETTINGS)
def test_audit_lower_bound_below_accountant(sigma, steps):
    trials = LONG_TRIALS if LONG else DEFAULT_TRIALS
    start = time.perf_counter()
    pos, neg, opt = run_trainings(sigma, steps, trials)
    elapsed = time.perf_counter() - start
    problems = []
    for delta in DELTAS:
        bound, t = audit_bound(pos, neg, delta)
        exact = analytic_gaussian_epsilon(math.sqrt(steps) / sigma, delta)
        reported = accountant_epsilon(sigma, 1.0, steps, delta)
        spent = opt.privacy_spent(delta).epsilon
        print(
            f"\naudit sigma={sigma} steps={steps} q=1 delta={delta:g}, {4 * trials} runs in {elapsed:.1f}s: "
            f"lower bound {bound.epsilon:.3f} (TPR {bound.tpr:.4f}, FPR {bound.fpr:.4f}, threshold {t / (LR * sigma * C * math.sqrt(steps) / N_OTHERS):.2f} noise sd); "
            f"accountant {reported:.4f}, privacy_spent {spent:.4f}, exact {exact:.4f}"
        )
        if spent != pytest.approx(reported, rel=1e-9):
            problems.append(f"delta={delta}: privacy_spent() {spent} differs from the accountant's {reported}")
        if not bound.epsilon <= min(reported, exact):
            problems.append(
                f"delta={delta}: the audit proves epsilon >= {bound.epsilon:.3f} with 95% confidence, above "
                f"the accountant's {reported:.4f} (exact: {exact:.4f})"
            )
        if delta == DELTAS[0] and not bound.epsilon > 0.5:
            problems.append(f"the attack is idle: bound {bound.epsilon:.3f} (expected about 1.4 at these settings)")
    assert not problems, "\n".join(problems)


def test_audit_detects_canary_without_noise():
    """noise_multiplier=0: the same attack must separate the worlds, or the audit above
    could not have failed."""
    pos, neg, _ = run_trainings(0.0, steps=1, trials=250)
    bound, t = audit_bound(pos, neg, DELTAS[0])
    print(f"\naudit sigma=0: lower bound {bound.epsilon:.3f} (TPR {bound.tpr:.3f}, FPR {bound.fpr:.3f})")
    assert bound.tpr == 1.0 and bound.fpr == 0.0
    assert bound.epsilon > 1.0
    # The canary's clipped contribution is exactly C along (w_k, bias) = (M, 1) / sqrt(M^2 + 1),
    # and no other example ever moves w_k.
    assert pos == pytest.approx(np.full(len(pos), LR * C * M / math.sqrt(M * M + 1) / N_OTHERS), rel=1e-9)
    assert np.all(neg == 0.0) and t == 0.0


@pytest.mark.skipif(not LONG, reason="set DPOPTIM_LONG_AUDIT=1")
@pytest.mark.slow
def test_audit_poisson_sampling():
    """Poisson sampling done here (the canary too); the accountant is the subsampled one."""
    sigma, q, steps = 1.0, 0.5, 2  # epsilon 4.85 at delta 1e-5, 2.11 at 1e-2
    pos, neg, opt = run_trainings(sigma, steps, LONG_TRIALS, sample_rate=q)
    problems = []
    for delta in DELTAS:
        bound, _ = audit_bound(pos, neg, delta)
        reported = accountant_epsilon(sigma, q, steps, delta)
        spent = opt.privacy_spent(delta).epsilon
        print(f"\naudit Poisson sigma={sigma} q={q} steps={steps} delta={delta:g}: lower bound {bound.epsilon:.3f}, "
              f"accountant {reported:.4f}, privacy_spent {spent:.4f}")
        if spent != pytest.approx(reported, rel=1e-9) or not bound.epsilon <= reported:
            problems.append(f"delta={delta}: bound {bound.epsilon:.3f}, accountant {reported:.4f}, privacy_spent {spent:.4f}")
    assert not problems, "\n".join(problems)


# ----------------------------------------------------------------- audit_model on a user's model
# The same mechanism through the public entry point: the user's model factory, data, canary
# and loss. 100 runs per world (50 held out) keep each test at a few seconds; with perfect
# separation 50 held-out runs prove at most about 2.57 at delta = 1e-5.
def _user_setup():
    g = torch.Generator().manual_seed(11)
    x = torch.randn(N_OTHERS, D, generator=g, dtype=torch.float64)
    x[:, -1] = 0.0
    y = torch.randn(N_OTHERS, 1, generator=g, dtype=torch.float64)
    canary = torch.zeros(1, D, dtype=torch.float64)
    canary[0, -1] = M
    target = torch.full((1, 1), CANARY_TARGET, dtype=torch.float64)
    loss = lambda model, batch: (0.5 * (model(batch[0]) - batch[1]).square().sum(1)).mean()
    return (lambda: nn.Linear(D, 1).double()), (x, y), (canary, target), loss


def test_audit_model_bound_below_accountant_and_control_has_power():
    make_model, data, canary, loss = _user_setup()
    audit = audit_model(make_model, data, loss, canary=canary, runs=100, steps=2,
                        optimizer_kwargs=dict(lr=LR, noise_multiplier=1.0, max_grad_norm=C))
    print(f"\n{audit}")
    assert audit.accountant_epsilon == pytest.approx(accountant_epsilon(1.0, 1.0, 2, 1e-5), rel=1e-9)
    assert audit.control.epsilon > 2.0 and audit.control.tpr == 1.0 and audit.control.fpr == 0.0
    assert audit.has_power and audit.bound.epsilon <= audit.accountant_epsilon
    assert audit.passed and bool(audit) and "passed" in str(audit)
    assert len(audit.scores_in) == len(audit.scores_out) == 100


def test_audit_model_catches_an_optimizer_that_understates_its_noise():
    """A DP optimizer that adds noise sigma = 0.2 but charges sigma = 20: the attack on the
    user's model must prove more privacy loss than that optimizer's accountant reports."""

    class Understated(dpoptim.DPSGD):
        def _record(self, sigma, q):
            super()._record(sigma * 100, q)

    make_model, data, canary, loss = _user_setup()
    audit = audit_model(make_model, data, loss, canary=canary, runs=100, optimizer_class=Understated,
                        optimizer_kwargs=dict(lr=LR, noise_multiplier=0.2, max_grad_norm=C), control=False)
    print(f"\n{audit}")
    assert audit.accountant_epsilon < 0.2  # what sigma = 20 costs for one step
    assert audit.bound.epsilon > audit.accountant_epsilon
    assert not audit.passed and "proves more privacy loss" in str(audit)


def test_audit_model_loss_score():
    """The black-box score, the fall of the canary's loss: without noise it too separates
    the worlds."""
    make_model, data, canary, loss = _user_setup()
    audit = audit_model(make_model, data, loss, canary=canary, runs=100, score="loss",
                        optimizer_kwargs=dict(lr=LR, noise_multiplier=1.0, max_grad_norm=C))
    print(f"\n{audit}")
    assert audit.control.epsilon > 2.0 and audit.passed


def test_audit_model_poisson_sampling():
    """sample_rate < 1: the audit samples the data and the canary itself, and the accountant's
    epsilon is that of the subsampled mechanism."""
    make_model, data, canary, loss = _user_setup()
    audit = audit_model(make_model, data, loss, canary=canary, runs=60, control=False,
                        optimizer_kwargs=dict(lr=LR, noise_multiplier=2.0, max_grad_norm=C, sample_rate=0.5))
    assert audit.accountant_epsilon == pytest.approx(accountant_epsilon(2.0, 0.5, 1, 1e-5), rel=1e-9)
    assert audit.bound.epsilon <= audit.accountant_epsilon and audit.has_power is None


def test_audit_model_arguments():
    make_model, data, canary, loss = _user_setup()
    kwargs = dict(lr=LR, noise_multiplier=1.0, max_grad_norm=C)
    with pytest.raises(ValueError, match="one example"):
        audit_model(make_model, data, loss, canary=data, optimizer_kwargs=kwargs)
    with pytest.raises(ValueError, match="runs"):
        audit_model(make_model, data, loss, canary=canary, optimizer_kwargs=kwargs, runs=2)
    with pytest.raises(ValueError, match="score"):
        audit_model(make_model, data, loss, canary=canary, optimizer_kwargs=kwargs, score="auc")
    zero = (torch.zeros(1, D, dtype=torch.float64), torch.zeros(1, 1, dtype=torch.float64))
    flat = lambda: nn.Linear(D, 1, bias=False).double().requires_grad_(True)

    def zero_init():
        model = flat()
        torch.nn.init.zeros_(model.weight)
        return model

    with pytest.raises(ValueError, match="canary's gradient"):
        audit_model(zero_init, data, loss, canary=zero, optimizer_kwargs=kwargs)
