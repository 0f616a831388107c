"""Each direction's own window where epsilon lies far above the loss's spread.

Where epsilon is in the hundreds of thousands, a direction's composed loss is a narrow
body far from 0. One window holding both directions and 0 then spreads the bins over
the whole range from 0 (2 apart on 2^20 points), while the body needs a tenth of it.
The windows of :func:`dpoptim.accounting.pld._narrow_grid` start near each direction's
own body there. Judged against the rigorous lower bound, and against the exact Gaussian
of a full batch (composed without a grid), which a run at q just below 1 may not exceed.
"""

import collections
import math
import threading
import warnings

import numpy as np
import pytest
import scipy.stats

from dpoptim.accounting import epsilon_of_ledger
from dpoptim.accounting import pld as pld_module
from dpoptim.accounting.gaussian import gaussian_epsilon
from dpoptim.accounting.ledger import Ledger
from dpoptim.accounting.pld import pld_epsilon, pld_epsilon_lower_bound

#: Two runs at q just below 1: sigma 0.063 over 5,938 steps (epsilon about 7.7*10^5) and
#: sigma 1.88 over 93,352. On one window from 0 the grid lay 0.43% above the lower bound
#: and 0.17% above the same ledger at q = 1.
FAR = [(0.063, 0.997, 5938), (1.88, 0.997, 93352)]
FAR_DELTA = 5.6e-8


def _at_rate(runs, q):
    return [(sigma, q, count) for sigma, _, count in runs]


def test_epsilon_far_above_the_spread_is_bracketed_within_a_tenth_of_a_percent():
    upper = pld_epsilon(FAR, FAR_DELTA)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no step's dominated distribution left empty
        lower = pld_epsilon_lower_bound(FAR, FAR_DELTA)
    assert lower <= upper <= lower * 1.001, (upper, lower)


@pytest.mark.parametrize("q", [0.99, 0.997, 0.999, 0.9999, 1.0 - 1e-6])
def test_a_full_batch_turned_subsampled_does_not_raise_epsilon(q):
    # At q = 1 the runs compose exactly, as one Gaussian; just below, on the grid, which
    # lies within 0.03% of the truth here: from 1 - 1e-3 down, the truth falls by more.
    # Closer to 1 the grid alone may not, and the bound with every q raised to 1 holds it.
    assert pld_epsilon(_at_rate(FAR, q), FAR_DELTA) <= pld_epsilon(_at_rate(FAR, 1.0), FAR_DELTA)


@pytest.mark.parametrize("runs, delta", [
    ([(1.413, 1.0, 53993)], 1.1e-11),
    ([(0.869, 1.0, 197185)], 0.002),
    ([(0.9222, 1.0, 365), (7.7186, 1.0, 4)], 3.17e-8),
    ([(0.1312, 1.0, 9), (8.3123, 1.0, 118), (7.1174, 1.0, 12218), (1.1172, 1.0, 2), (0.3291, 1.0, 8)], 1.58e-7),
])
def test_epsilon_never_rises_as_q_nears_one(runs, delta):
    # q = 1 is composed exactly. Just below it the Gaussian mixture's rounding put the first
    # two 2e-11 and 4e-11 of epsilon above it, and the grid the last two up to 1.3e-4 and
    # 5.3e-4 (from q = 0.9999 on); the bound with every q raised to 1 keeps them at or
    # below it (and above the rigorous lower bound).
    values = [pld_epsilon(_at_rate(runs, q), delta) for q in (0.9999, 1.0 - 1e-5, 1.0 - 1e-6, 1.0 - 1e-7, 1.0)]
    assert all(a <= b for a, b in zip(values, values[1:])), values
    near = _at_rate(runs, 1.0 - 1e-6)
    assert pld_epsilon_lower_bound(near, delta) <= values[2]


@pytest.mark.parametrize("runs, delta", [
    ([(5.281, 0.002123, 3), (0.2934, 1.0, 20), (1.142, 0.02478, 2748), (5.583, 4.595e-06, 9550)], 2.18e-6),
    ([(3.055, 0.01869, 20858), (0.9371, 1.0, 1052), (0.07102, 0.0164, 6515), (7.965, 0.007872, 720),
      (0.06797, 1.346e-06, 2539)], 2.25e-10),
])
def test_a_full_batch_beside_subsampled_runs_never_rises_as_its_q_nears_one(runs, delta):
    # The full batch joins one Gaussian step at q = 1; just below, it went on the grid,
    # whose bins put epsilon 4e-5 and 1.3e-5 above q = 1 at q 0.9999. The same ledger with
    # that run raised to q = 1 bounds it (a second composition, from q 0.9 on).
    values = [pld_epsilon([(sigma, q if q < 1.0 else near, count) for sigma, q, count in runs], delta)
              for near in (0.9, 0.99, 0.999, 0.9999, 1.0)]
    assert all(a <= b for a, b in zip(values, values[1:])), values


def test_a_full_batch_beside_a_run_of_its_own_near_one_never_rises_as_its_q_nears_one():
    # A run at q 0.92 of the ledger's own: raising every run from q 0.9 on raised it too,
    # and the grid put the full batch lowered to q 0.999 and 0.9999 1.6e-7 and 7.2e-7 of
    # epsilon above q = 1. The same ledger with only the runs from q 0.999 (0.9999) on
    # raised is the ledger at q = 1.
    runs = [(0.5851, 1.0, 4), (0.158, 0.6006, 1375), (0.2189, 0.9213, 49)]
    values = [pld_epsilon([(sigma, q if q < 1.0 else near, count) for sigma, q, count in runs], 1.58e-6)
              for near in (0.999, 0.9999, 1.0)]
    assert all(a <= b for a, b in zip(values, values[1:])), values


def test_three_runs_beside_a_heavy_one_stay_below_their_full_batch():
    # A run at q 0.33 beside the two: 1,624,413 on one window from 0, 1.6% above the
    # same ledger with q 0.997 raised to 1 (1,598,965); now below it.
    runs = [(0.066, 0.33, 21193), (0.063, 0.997, 5938), (1.88, 0.997, 93352)]
    raised = [(sigma, 1.0 if q > 0.99 else q, count) for sigma, q, count in runs]
    assert pld_epsilon(runs, FAR_DELTA) <= pld_epsilon(raised, FAR_DELTA)


def test_each_direction_reads_its_own_window():
    steps = tuple(tuple(run) for run in Ledger(FAR).runs)
    grid = pld_module._choose_grid(steps, FAR_DELTA, 2**14, 2**20, pld_module._rdp_guess(steps, FAR_DELTA),
                                   tail_fraction=pld_module._CHECKED_CUT)
    assert grid.lows is not None and grid.lows["remove"] > 0 and grid.lows["remove"] != grid.lows["add"]
    removal = pld_module._directed(grid, "remove")
    assert removal.i_low == grid.lows["remove"] and removal.lows is None
    answer = pld_epsilon(FAR, FAR_DELTA)
    assert removal.i_low * grid.spacing < answer < (removal.i_low + grid.n) * grid.spacing


def test_windows_that_reach_zero_stay_one_window():
    # An epsilon near the loss's spread: both directions' edges lie near 0, and one window
    # holds both, as always.
    steps = ((1.0, 0.01, 1000),)
    grid = pld_module._narrow_grid(steps, 2**16, math.inf, pld_module._CHECKED_CUT * 1e-5, 1e-5)
    assert grid is None or grid.lows is None


@pytest.mark.parametrize("mu", [3.0, 30.0, 1000.0])
@pytest.mark.parametrize("delta", [1e-10, 1e-3, 0.1, 0.24])
def test_the_margin_keeps_the_answer_inside_the_window(mu, delta):
    # The mu-Gaussian loss is N(mu^2 / 2, mu^2): its lower edge at the share t of delta the
    # windows are cut for, and its exact epsilon, which may lie below that edge by at most
    # -log(1 - 2 delta), never by the margin.
    t = pld_module._CHECKED_CUT * delta
    low = mu * mu / 2.0 - mu * float(scipy.stats.norm.isf(t))
    assert gaussian_epsilon(delta, mu) >= low - pld_module._bottom_margin(delta) + 1.0


def test_a_full_batch_far_above_zero_keeps_the_lower_bound():
    # A full batch at sigma 0.002 (losses near 1.25*10^5) beside a run at q 0.5: on a
    # window far above 0 the full batch's dominated distribution aimed its Q-mass, all of
    # it below the window, at e^{1.2*10^5}, which overflowed and left the grid's lower
    # bound to the other bounds (1.5% below the reported epsilon). Such bins are dropped
    # (next to no P-mass: dropping an outcome only lowers a profile): within 0.2% now.
    runs, delta = [(0.1, 0.5, 3000), (0.002, 1.0, 1)], 1e-9
    upper = pld_epsilon(runs, delta)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        lower = pld_epsilon_lower_bound(runs, delta)
    assert lower <= upper <= lower * 1.002, (upper, lower)


def test_an_answer_at_its_own_windows_bottom_is_not_refined(monkeypatch):
    # 3000 mixture-grouped runs: the grid is sized by the groups' corners, whose body lies
    # above the mixtures' answer, and removal's answer sat at its window's bottom. No
    # precision lowers it there (extended precision spent 3.7 s to find it again); the
    # other bounds answer below it.
    runs = [(0.956 * (0.664 / 0.956) ** (i / 2999), 0.151 * (0.368 / 0.151) ** (i / 2999), 1000) for i in range(3000)]
    dtypes = []
    compose = pld_module._compose_direction

    def recording(steps, direction, grid, delta, dtype, *args, **kwargs):
        dtypes.append(np.dtype(dtype))
        return compose(steps, direction, grid, delta, dtype, *args, **kwargs)

    monkeypatch.setattr(pld_module, "_compose_direction", recording)
    reported = pld_epsilon(runs, 1.3e-10)
    assert dtypes and all(dtype == np.float64 for dtype in dtypes), dtypes
    assert reported <= epsilon_of_ledger(runs, 1.3e-10, accountant="rdp")


def test_a_wide_profile_is_read_at_a_few_points_as_the_whole_window_reads_it(monkeypatch):
    # A profile spanning 600 or more of loss (epsilon in the hundreds and more) is read by
    # bisection at a few dozen points, each weighted sum discounted from the point read
    # (pld._suffix_reader). Its answer is the one the whole window gives, every point's
    # sums formed in extended precision and the weighted ones in log space.
    ledgers = [([(0.5, 0.2, 10_000)], 1e-10), ([(0.05, 0.001, 10**6)], 1e-9), ([(1.0, 0.5, 100_000)], 1e-12),
               ([(0.6, 0.05, 100_000), (0.3, 0.01, 1000)], 1e-8), ([(0.02, 6.7e-4, 10**8)], 9.2e-5)]
    # Addition and removal are inverted on two threads at once: reads are counted by thread.
    inverted, reads = [], collections.Counter()
    invert, reader = pld_module._invert_profile, pld_module._suffix_reader

    def recording(*args, **kwargs):
        before = reads[threading.get_ident()]
        found = invert(*args, **kwargs)
        if not kwargs.get("lower", False):
            inverted.append((args, found, reads[threading.get_ident()] - before))
        return found

    def counting(*args):
        read, depth, lost = reader(*args)
        return (lambda i: reads.update((threading.get_ident(),)) or read(i)), depth, lost

    monkeypatch.setattr(pld_module, "_invert_profile", recording)
    monkeypatch.setattr(pld_module, "_suffix_reader", counting)
    pld_module._noted_pld_epsilon.cache_clear()
    for runs, delta in ledgers:
        pld_epsilon(runs, delta)
    pld_module._noted_pld_epsilon.cache_clear()
    wide = []
    for args, found, count in inverted:
        losses = args[2]
        if losses[-1] - losses[np.argmax(args[1] <= 300.0)] >= 600.0 and math.isfinite(found[0]):
            wide.append((args, found[0], count))
    assert len(wide) >= 5
    for (tilted, log_untilt, losses, constant, noise, delta), answer, count in wide:
        assert count <= 4 * math.log2(losses.size) + 8  # (a few reads a bisection step, two readers)
        whole = _whole_window_answer(tilted, log_untilt, losses, constant, noise, delta)
        assert whole <= answer <= whole + 1e-9 * abs(whole) + 1e-12, (answer, whole)


def test_the_refinement_floor_read_below_the_answer_is_the_whole_windows(monkeypatch):
    # Where rounding decides an answer, the inversion reads how low a refinement could go
    # (pld._refinement_floor), from 2^-5 of the answer below it up, seeded with the sums
    # above the answer. Where the floor lies in that range it is the one the whole window
    # gives, every point's sums formed in extended precision; else 0 is read, and the
    # whole window's floor lies below the range.
    read, floor = [], pld_module._refinement_floor
    monkeypatch.setattr(pld_module, "_refinement_floor", lambda *args: read.append((args, floor(*args))) or read[-1][1])
    pld_module._noted_pld_epsilon.cache_clear()
    for runs, delta in (([(267.92, 1.839e-3, 1)], 2.651e-6), ([(0.3, 0.3, 1000)], 1e-10),
                        ([(4.04, 0.722, 10**8)], 2.1e-12)):
        pld_epsilon(runs, delta)
    pld_module._noted_pld_epsilon.cache_clear()
    assert len(read) >= 3 and any(value > 0.0 for _, value in read)
    for ((tilted, log_untilt, losses, noise), (first, high), _, delta), value in read:
        whole = _whole_window_floor(tilted, log_untilt, losses, noise, (first, high), delta)
        if value > 0.0:
            assert abs(value - whole) <= 1e-9 * abs(whole) + 1e-12, (value, whole)
        else:
            assert whole <= losses[high] - pld_module._FLOOR_SHARE * abs(losses[high]) + (losses[1] - losses[0])


def test_the_refinement_floor_is_the_same_whatever_its_blocks(monkeypatch):
    # pld._refinement_floor reads the window from the answer down in blocks and stops at
    # the first that holds a point above delta; its running sums go on from block to block
    # in the order of one pass over the whole window, so blocks of any length, one point
    # or the whole window, give the same floor to the last bit (float64 and extended).
    read, floor = [], pld_module._refinement_floor
    monkeypatch.setattr(pld_module, "_refinement_floor", lambda *args: read.append(args) or floor(*args))
    pld_module._noted_pld_epsilon.cache_clear()
    for runs, delta in (([(267.92, 1.839e-3, 1)], 2.651e-6), ([(0.3, 0.3, 1000)], 1e-10),
                        ([(4.04, 0.722, 10**8)], 2.1e-12)):
        pld_epsilon(runs, delta)
    pld_module._noted_pld_epsilon.cache_clear()
    assert len(read) >= 3
    spans = [high - np.searchsorted(losses, losses[high] * (1.0 - pld_module._FLOOR_SHARE)) for
             (_, _, losses, _), (_, high), _, _ in read]
    assert max(spans) > 64  # (several blocks of 1 to 64 points)
    for (tilted, log_untilt, losses, noise), span, seeds, delta in read:
        for dtype in (np.float64, np.longdouble):
            args = ((tilted.astype(dtype), log_untilt, losses, noise), span, seeds, delta)
            values = []
            for block in (1, 7, 64, 2**40):
                monkeypatch.setattr(pld_module, "_FLOOR_BLOCK", block)
                values.append(floor(*args))
            assert values[:-1] == values[1:], values


@pytest.mark.parametrize("slope", [-1e-3, -0.7, -2.0, 0.0])
def test_a_part_of_the_block_exponentials_is_that_part_of_the_whole(slope):
    # pld._exp_linear counts its blocks from k = 0 whatever part is asked for, so the
    # refinement floor's blocks get the very values one pass over the window gets.
    whole = pld_module._exp_linear(3.0, slope, 10_000)
    assert np.allclose(whole, np.exp(3.0 + slope * np.arange(10_000)), rtol=1e-12, atol=1e-300)  # (subnormal: absolute)
    for skip, size in ((0, 10_000), (1, 5_000), (1_023, 2), (1_024, 4_000), (5_000, 5_000), (9_999, 1), (3_000, 0)):
        assert np.array_equal(pld_module._exp_linear(3.0, slope, size, skip), whole[skip:skip + size])


def _whole_window_floor(tilted, log_untilt, losses, noise, span, delta) -> float:
    """The least epsilon where every point from it up to the answer's has its sums less
    their allowance at most delta, from every point above the first valid one, the sums
    formed in extended precision (0 where none is reached above it)."""
    first, high = span
    above, weighted, allowance = _whole_window_terms(tilted, log_untilt, losses, noise)
    lowered = (np.maximum(above - weighted, 0.0) - allowance)[first + 1:high + 1]
    reached = np.flatnonzero(np.maximum.accumulate(lowered[::-1])[::-1] <= delta)
    if reached.size == 0 or reached[0] == 0:
        return 0.0
    k = int(reached[0]) + first + 1
    excess = float(lowered[k - first - 2] + weighted[k - 1]) - delta
    return float(min(max(losses[k - 1] + math.log(excess / float(weighted[k - 1])), losses[k - 1]), losses[k]))


def _whole_window_terms(tilted, log_untilt, losses, noise) -> tuple:
    """``(above, weighted, allowance)`` at every point: the sums of the valid masses above
    it and of their ``m_j e^{l_k - l_j}`` (extended precision, the second in log space),
    and its rounding allowance."""
    valid = log_untilt <= 300.0
    masses = np.where(valid, tilted.astype(np.longdouble) * np.exp(np.minimum(log_untilt, 300.0).astype(np.longdouble)),
                      0.0)
    above = np.concatenate([np.cumsum(masses[::-1])[::-1][1:], [0.0]])
    with np.errstate(divide="ignore"):
        inclusive = np.logaddexp.accumulate((np.log(masses) - losses)[::-1])[::-1]
    weighted = np.exp(np.concatenate([inclusive[1:], [-np.inf]]) + losses)
    decay = float(log_untilt[0] - log_untilt[1])
    return above, weighted, pld_module._allowances(noise, log_untilt, decay, losses.size - 1.0 - np.arange(losses.size))


def _whole_window_answer(tilted, log_untilt, losses, constant, noise, delta) -> float:
    """The first grid point whose profile is at most delta, read within its bin, with every
    point's suffix sums formed in extended precision (no rounding bound added)."""
    first = int(np.argmax(log_untilt <= 300.0))
    above, weighted, allowance = _whole_window_terms(tilted, log_untilt, losses, noise)
    profile = constant + allowance + np.maximum(above - weighted, 0.0)
    profile[: first + 1] = np.inf
    k = int(np.argmax(profile <= delta))
    excess = float(constant + allowance[k - 1] + above[k - 1] - delta)
    return float(min(max(losses[k - 1] + math.log(excess / float(weighted[k - 1])), losses[k - 1]), losses[k]))
