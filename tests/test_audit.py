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
from dpoptim.audit import clopper_pearson, epsilon_lower_bound

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


# False-positive rates the threshold may aim for, as long as that means at least 5 false
# positives among the runs that choose it. Trying every observed score instead lets the
# first half's noise pick thresholds deep in the tail that the second half does not
# confirm: on Gaussian scores with mu = 1 the grid gives about the same mean bound and a
# far better worst case.
FPR_GRID = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


def best_threshold(pos: np.ndarray, neg: np.ndarray, delta: float) -> float:
    """Among thresholds at the FPR_GRID quantiles of ``neg``, the one whose rule "canary
    present iff score > t" has the highest bound on these scores."""
    best, best_t = -1.0, math.inf
    for fpr in [f for f in FPR_GRID if f * len(neg) >= 5]:
        t = float(np.quantile(neg, 1 - fpr, method="higher"))
        bound = epsilon_lower_bound(int((pos > t).sum()), len(pos), int((neg > t).sum()), len(neg), delta).epsilon
        if bound > best:
            best, best_t = bound, t
    return best_t


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
    half = len(pos) // 2
    t = best_threshold(pos[:half], neg[:half], delta)
    held_pos, held_neg = pos[half:], neg[half:]
    hits = lambda scores: int((scores > t).sum())
    return epsilon_lower_bound(hits(held_pos), len(held_pos), hits(held_neg), len(held_neg), delta), t


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
    # REFERENCE.md: sigma = 10, q = 1, T = 100 (mu = 1) at delta = 1e-5 gives 4.377178.
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
