"""Composition in stages (:mod:`dpoptim.accounting.staged`) for long runs of one pair.

Each piece is checked for what its proof needs: the block of stage one dominates the
direct composition of its steps, the move onto the coarse grid dominates what it moves,
the transform's error bound holds against an exact reference, and the end result lies
between a rigorous lower bound and 1% above it, monotone on fine sweeps.
"""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dpoptim.accounting import epsilon, staged
from dpoptim.accounting import pld as pld_module
from dpoptim.accounting.pld import pld_epsilon_lower_bound

REMOVE, ADD = "remove", "add"


def profile(losses, masses, p_inf, eps):
    """delta(eps) of a measure with P-masses at losses and p_inf at +infinity."""
    above = losses > eps
    return float((masses[above] * -np.expm1(eps - losses[above])).sum()) + p_inf


def block_measure(block, spacing, tilt):
    """A block's untilted P-masses and their losses."""
    losses = (block.first + np.arange(block.masses.size)) * spacing
    return losses, block.masses * np.exp(block.log_scale - tilt * losses)


@settings(max_examples=10, deadline=None)
@given(sigma=st.floats(0.6, 4.0), q=st.floats(0.02, 0.5), tilt=st.sampled_from([0.0, 0.3, 2.0]),
       R=st.sampled_from([2, 4]), length=st.integers(1, 12), direction=st.sampled_from([REMOVE, ADD]),
       budget=st.sampled_from([1e-30, 1e-3, 0.1]))
def test_a_block_dominates_the_direct_composition_of_its_steps(sigma, q, tilt, R, length, direction, budget):
    # stage one (transform, its error bound, the window's tails, the coarse grid) against
    # the same steps convolved directly in float64: its profile is never below; with a
    # large budget the window is narrow and much wraps around (from below, the tilt
    # shrinks it: it must be counted at +inf)
    h = 2.0**-7
    step = staged._step(sigma, q, direction, h, 1e-24)
    first, masses, p_inf = step
    direct = np.array([1.0])
    for _ in range(length):
        direct = np.convolve(direct, masses)
    direct_losses = (length * first + np.arange(direct.size)) * h
    direct_inf = -math.expm1(length * math.log1p(-p_inf))
    plan = staged._Plan(h, R, tilt)
    made = staged._blocks(step, pld_module._log_mgf(first, masses, h, staged._LAMBDAS), plan, [length, 1], budget, 2)
    assert made is not None
    block = made[0]
    losses, block_masses = block_measure(block, R * h, tilt)
    # every eps, negative ones too: composition reads the whole profile
    bottom, top = (float(direct_losses[i]) for i in direct.nonzero()[0][[0, -1]])
    for eps in np.linspace(bottom, top, 61):
        exact = profile(direct_losses, direct, direct_inf, eps)
        assert profile(losses, block_masses, block.p_inf, eps) >= exact * (1 - 1e-9), (eps, exact)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31), R=st.sampled_from([2, 3, 8, 32]), tilt=st.floats(-1.0, 5.0),
       low=st.integers(-300, 300))
def test_moving_onto_the_coarse_grid_never_lowers_a_profile(seed, R, tilt, low):
    # connect-the-dots of atoms onto every R-th point: a mean-preserving spread of e^-L
    # (and rounding up), so every delta(eps) is at least the fine measure's
    rng = np.random.default_rng(seed)
    h = 2.0**-6
    fine = rng.random(200) * (rng.random(200) < 0.5)
    fine_losses = (low + np.arange(fine.size)) * h
    tilted = fine * np.exp(tilt * fine_losses)
    first, coarse = staged._coarsened(low, tilted, staged._Plan(h, R, tilt))
    coarse_losses = (first + np.arange(coarse.size)) * R * h
    untilted = coarse * np.exp(-tilt * coarse_losses)
    assert untilted.sum() >= fine.sum() * (1 - 1e-12)
    for eps in np.linspace(fine_losses[0] - 1.0, fine_losses[-1] + 0.1, 61):
        assert profile(coarse_losses, untilted, 0.0, eps) >= profile(fine_losses, fine, 0.0, eps) * (1 - 1e-12)


@pytest.mark.parametrize("power", [1, 7, 200])
def test_the_transform_error_bound_holds_in_double_precision(power):
    # The bound with double precision's unit round-off (the stages' first try), against
    # the same powers taken in extended precision (a thousand times more accurate here).
    if np.finfo(np.longdouble).eps > 1e-18:
        pytest.skip("no extended precision on this platform")
    u = float(np.finfo(np.float64).eps) / 2
    rng = np.random.default_rng(power)
    n = 1024
    x = np.zeros(n)
    x[:300] = rng.random(300) ** 4
    x /= x.sum() * (1 + 1e-9)
    powered = staged._powered(np.fft.rfft(x), power)
    computed = np.fft.irfft(powered, n)
    exact = np.fft.irfft(np.fft.rfft(x.astype(np.longdouble)) ** power, n)
    error = float(np.max(np.abs(computed - exact)))
    # with every entry counted, and with only the live ones (entries left 0 counted apart)
    for live in (None, int(np.count_nonzero(powered))):
        bound = staged._fft_error(n, [(power, staged._norm(x))], live, u)
        assert 0.0 < error <= bound, (error, bound, live)


@settings(max_examples=8, deadline=None)
@given(sigma=st.floats(0.7, 12.0), q=st.floats(2e-3, 0.3), steps=st.integers(2**11, 2**14),
       delta=st.floats(1e-12, 1e-3))
def test_the_stages_lie_between_a_rigorous_lower_bound_and_1_percent_above(sigma, q, steps, delta):
    # forced onto shorter runs, where the lower bound is quick and tight
    guess = pld_module._rdp_guess(((sigma, q, steps),), delta)
    found = staged.staged_epsilons(sigma, q, steps, {REMOVE: delta, ADD: delta}, guess, 0.0, min_steps=1)
    assume(found is not None)
    reported = max(found.epsilons.values())  # settled or not, each is a sound upper bound
    lower = pld_epsilon_lower_bound([(sigma, q, steps)], delta)
    assert lower <= reported * (1 + 1e-12), (reported, lower)
    if 0.05 <= lower <= 500 and found.settled:  # (unsettled, the one grid is kept beside)
        assert reported <= lower * 1.01, (reported, lower)


def test_a_body_narrower_than_a_bin_is_left_to_the_split():
    # tiny q: rare large losses widen the tilted spread, the body lies in one bin; staged
    # there, connect-the-dots of the body gave 4.73 against 4.08
    sigma, q, steps, delta = 0.474971, 8.10588e-06, 2823772, 3.52192e-10
    guess = pld_module._rdp_guess(((sigma, q, steps),), delta)
    assert staged.staged_epsilons(sigma, q, steps, {REMOVE: delta, ADD: delta}, guess) is None
    assert epsilon(sigma, q, steps, delta) <= 4.09


def test_a_body_within_a_bin_lets_the_stages_answer_where_the_sampled_steps_spread_the_loss():
    # sigma 0.3, q 1e-3 over 2^21 steps, delta 1e-9: the step's body lies within a bin and
    # cannot size them, but its loss's variance comes from the steps sampled (2,000 on
    # average), which bins at the mean shift's spacing spread by far less than 2^-12 of
    # it. The stages answer, within 0.1% of the rigorous lower bound (the one grid they
    # were refused for read 0.13% to 1.5% above it on runs of 10^8 steps).
    sigma, q, steps, delta = 0.3, 1e-3, 2**21, 1e-9
    guess = pld_module._rdp_guess(((sigma, q, steps),), delta)
    h, cut = staged._shift_spacing(guess, steps), staged._cut(delta, steps)
    body = staged._body_deviation(staged._step(sigma, q, REMOVE, h, cut)[1], h)
    assert staged._finer(sigma, q, REMOVE, h, h, cut, body) is None  # the body alone refuses them
    assert staged._spread_within(sigma, q, REMOVE, h, cut)
    found = staged.staged_epsilons(sigma, q, steps, {REMOVE: delta, ADD: delta}, guess)
    assert found is not None and found.settled
    lower = pld_epsilon_lower_bound([(sigma, q, steps)], delta)
    assert lower <= epsilon(sigma, q, steps, delta) == max(found.epsilons.values()) <= lower * 1.001


def test_epsilon_stays_monotone_where_the_stages_stop_fitting_as_sigma_grows():
    # sigma 0.566 at q 8.45e-4 over 10^8 steps, delta 3.6e-9: past it the stages do not
    # fit, and the nearest run they fit (a smaller sigma) answers beside the one grid. Its
    # sigma was bisected from each run's own bracket and moved by a part in 10^7 with it:
    # epsilon rose by 6e-8 of itself twice over 0.2% of sigma.
    values = [epsilon(float(sigma), 8.45e-4, 10**8, 3.6e-9) for sigma in np.geomspace(0.5655, 0.5685, 8)]
    assert all(b <= a for a, b in zip(values, values[1:])), values


def test_the_band_of_dominating_runs_ends_where_the_rdp_guess_has_grown_by_four_percent(monkeypatch):
    # sigma 0.173, q 1.17e-5 over 10^8 steps, delta 6.6e-9: the stages fit 1.3% below that
    # sigma, where epsilon is 6% above the one grid's answer here, and searching for that
    # boundary and composing its stages cost 0.58 s for nothing. The band now ends where
    # the RDP guess has grown by 4% (at sigma 0.1723), and holds no such run.
    sigma, q, steps, delta = 0.173363353660052, 1.167882915275472e-05, 10**8, 6.6e-9
    deltas = {REMOVE: delta, ADD: delta}
    assert staged.dominating_runs(sigma, q, steps, deltas) == []
    # where the guess grows slowly the band is 2% (q up), where fast the 4% rise ends it
    assert staged._within_rise(lambda x: x, 1e-3, 1.02e-3, 1e-3) == 1.02e-3
    edge = staged._within_rise(lambda x: x**-8, 0.5, 0.5 / 1.02, 0.5**-8)
    assert edge == pytest.approx(0.5 * 1.04 ** (-1 / 8), rel=1e-12)
    monkeypatch.setattr(staged, "_NEIGHBOUR_RISE", math.inf)  # the band of 2% alone
    (neighbour,) = staged.dominating_runs(sigma, q, steps, deltas)
    assert sigma / 1.02 < neighbour[0] < sigma / 1.01 and neighbour[1:] == (q, steps)


@pytest.mark.parametrize("edge, up", [(1.2345678, True), (0.7654321, False)])
def test_the_boundary_of_the_stages_plan_is_the_same_from_every_run_beside_it(edge, up):
    # q grows toward the plan (up), or sigma falls toward it: from every run refused within
    # 2% of the change, the same point, within a part in 10^7 of it, on the fitting side
    fits = (lambda x: x >= edge) if up else (lambda x: x <= edge)
    found = set()
    for start in (np.geomspace(0.981, 0.9999, 7) if up else np.geomspace(1.0001, 1.019, 7)):
        refused = edge * float(start)
        found.add(staged._boundary(fits, refused, refused * 1.02 if up else refused / 1.02))
    assert len(found) == 1
    point = found.pop()
    assert fits(point) and abs(math.log(point / edge)) < 1e-7


def test_addition_s_cruder_bound_answers_only_below_removal(monkeypatch):
    # sigma 0.684, q 0.0749 over 1.8e6 steps, addition's stages made not to fit (they
    # did not until the second stage could move onto a coarser grid): its Chernoff bound
    # stands in, as it is below removal's answer
    sigma, q, steps, delta = 0.6844316674398595, 0.07485066144312785, 1837913, 1.6183946303364354e-05
    answer = staged._staged_answer
    monkeypatch.setattr(staged, "_staged_answer",
                        lambda *args: None if args[3] == ADD else answer(*args))
    guess = pld_module._rdp_guess(((sigma, q, steps),), delta)
    found = staged.staged_epsilons(sigma, q, steps, {REMOVE: delta, ADD: delta}, guess)
    assert found is not None and found.settled and found.epsilons[ADD] < found.epsilons[REMOVE]
    bound = staged._chernoff_epsilon(sigma, q, steps, ADD, delta, guess)
    assert found.epsilons[ADD] == bound
    # ... and does not settle it where it is not: with shift, addition is reported above
    # removal (the one grid is then composed too)
    shifted = staged.staged_epsilons(sigma, q, steps, {REMOVE: delta, ADD: delta}, guess,
                                     found.epsilons[REMOVE] - bound + 1.0)
    assert shifted is not None and not shifted.settled


def test_the_stages_are_monotone_on_fine_sweeps():
    # 1% apart on each axis, where the stages answer
    base = {"sigma": 4.4, "q": 0.033, "steps": 10**7, "delta": 1e-8}
    calls = []
    original = pld_module._staged
    pld_module._noted_pld_epsilon.cache_clear()
    for axis, falling in (("sigma", True), ("q", False), ("steps", False), ("delta", True)):
        values = []
        for factor in (1.0, 1.01, 1.02):
            p = dict(base)
            p[axis] = int(p[axis] * factor) if axis == "steps" else p[axis] * factor
            found = original(((p["sigma"], p["q"], p["steps"]),), {REMOVE: p["delta"], ADD: p["delta"]}, 0.0,
                             math.inf, True)
            calls.append(found is not None and found.settled)
            values.append(epsilon(p["sigma"], p["q"], p["steps"], p["delta"]))
        for a, b in zip(values, values[1:]):
            assert (b <= a) if falling else (b >= a), (axis, values)
    assert all(calls)


def test_epsilon_stays_monotone_where_the_stages_stop_settling_it():
    # q 2.1e-5 over 1.9e7 steps, delta 0.04: epsilon reaches 0 near sigma 1.1308; nearing
    # it the stages' bins, sized for a guess above epsilon, stop settling it. Handing over
    # to the one grid alone jumped up (9.65e-5 at sigma 1.12975, 1.17e-4 at 1.13); the
    # smaller of the two keeps it falling.
    values = [epsilon(float(sigma), 2.14e-05, 18798428, 0.0403) for sigma in np.linspace(1.1295, 1.1310, 7)]
    assert all(b <= a for a, b in zip(values, values[1:])), values
    assert values[0] > 0.0 == values[-1]


@settings(max_examples=6, deadline=None)
@given(sigma=st.floats(0.7, 8.0), q=st.floats(2e-3, 0.2), steps=st.integers(2**12, 2**15),
       delta=st.floats(1e-12, 1e-3), direction=st.sampled_from([REMOVE, ADD]))
def test_the_second_stage_answers_in_double_precision_only_within_its_share(sigma, q, steps, delta, direction):
    # the same blocks composed in double and in extended precision: where double settles
    # the answer it lies within its share of extended's, and either is sound
    if np.finfo(np.longdouble).eps > 1e-18:
        pytest.skip("no extended precision on this platform")
    guess = pld_module._rdp_guess(((sigma, q, steps),), delta)
    plan = staged._plan(sigma, q, steps, direction, delta, guess)
    assume(plan is not None)
    budget, cut = delta * staged._WINDOW_SHARE, staged._cut(delta, steps)
    step = staged._step(sigma, q, direction, plan.h, cut)
    K, rest = divmod(steps, plan.R**2)
    counts = [(plan.R**2, K)] + ([(rest, 1)] if rest else [])
    made = staged._blocks(step, staged._step_log_mgf(sigma, q, direction, plan.h, cut), plan,
                          [length for length, _ in counts], budget / (K + 1), K + 1)
    assume(made is not None)
    parts = [(block, times) for block, (_, times) in zip(made, counts)]
    extended = staged._composed_epsilon(parts, plan._replace(dtype=np.longdouble), delta, budget)
    double = staged._composed_epsilon(parts, plan._replace(dtype=np.float64), delta, budget, staged._DOUBLE_SHARE)
    assume(extended is not None and double is not None and extended[1])
    if double[1]:
        assert abs(double[0] - extended[0]) <= 2 * staged._DOUBLE_SHARE * extended[0] + 1e-12, (double, extended)
    lower = pld_epsilon_lower_bound([(sigma, q, steps)], delta) if direction == REMOVE else 0.0
    assert min(double[0], extended[0]) >= lower * (1 - 1e-12)


@pytest.mark.parametrize("sigma, q, delta", [(1.015, 0.002733, 1.17e-8), (0.9348, 0.2102, 6.28e-8)])
def test_epsilon_does_not_fall_where_the_stages_take_over(sigma, q, delta):
    # one grid at 2^20 - 1 steps was 0.05% and 0.37% above the stages at 2^20 steps (where
    # they take over); a bound for more steps bounds fewer, so a little below 2^20 the
    # stages' answer for 2^20 steps stands beside the grid's
    steps = [int(0.9 * staged.MIN_STEPS) - 1, int(0.9 * staged.MIN_STEPS), staged.MIN_STEPS - 1, staged.MIN_STEPS]
    values = [epsilon(sigma, q, count, delta) for count in steps]
    assert all(b >= a for a, b in zip(values, values[1:])), values


def test_epsilon_does_not_fall_where_the_stages_start_to_fit():
    # sigma 1 over 10^8 steps, delta 1e-10: the stages' plan fits from q 9.9548e-5 on, and
    # their answer there was 0.39% below one grid's at q 9.95e-5; a run the stages refuse
    # is now also bounded by the nearest one they fit that dominates it
    values = [epsilon(1.0, q, 10**8, 1e-10) for q in (9.9e-5, 9.95e-5, 9.954e-5, 9.955e-5)]
    assert all(b >= a for a, b in zip(values, values[1:])), values
    # ... and as sigma grows past where the plan stops fitting (near 1.0015 at q 9.96e-5)
    values = [epsilon(sigma, 9.96e-5, 10**8, 1e-10) for sigma in (1.0012, 1.0016, 1.002, 1.0022)]
    assert all(b <= a for a, b in zip(values, values[1:])), values


def test_a_second_stage_too_wide_for_its_grid_moves_onto_a_coarser_one():
    # q 2.6e-4 over 2.9e6 steps at delta 1.95e-12: the second stage's window needed 2
    # points more than 2^19, and the stages refused, though just above q they answered
    sigma, q, steps, delta = 1.11166832815286, 0.0002598738992775487, 2880158, 1.95e-12
    guess = pld_module._rdp_guess(((sigma, q, steps),), delta)
    assert staged.staged_epsilons(sigma, q, steps, {REMOVE: delta, ADD: delta}, guess) is not None
    values = [epsilon(sigma, q * f, steps, delta) for f in (1 - 1e-7, 1.0, 1 + 1e-7, 1.001)]
    assert all(b >= a for a, b in zip(values, values[1:])), values


@settings(max_examples=6, deadline=None)
@given(sigma=st.floats(0.7, 12.0), q=st.floats(2e-3, 0.3), steps=st.integers(2**11, 2**14),
       delta=st.floats(1e-12, 1e-3), widen=st.sampled_from([2, 4]))
def test_a_second_stage_on_a_coarser_grid_stays_above_the_lower_bound(sigma, q, steps, delta, widen):
    # made to refuse the planned coarse grid, the second stage moves the blocks onto one
    # two or four times coarser: a mean-preserving spread, still never below the truth
    composed, planned, widened = staged._composed_epsilon, [], []

    def refusing(parts, plan, *args):
        planned.append(plan.R) if not planned else None
        if plan.R < planned[0] * widen:
            return None
        widened.append(plan.R)
        return composed(parts, plan, *args)

    staged._composed_epsilon = refusing
    try:
        guess = pld_module._rdp_guess(((sigma, q, steps),), delta)
        found = staged.staged_epsilons(sigma, q, steps, {REMOVE: delta, ADD: delta}, guess, 0.0, min_steps=1)
    finally:
        staged._composed_epsilon = composed
    assume(found is not None and widened)
    lower = pld_epsilon_lower_bound([(sigma, q, steps)], delta)
    assert max(found.epsilons.values()) >= lower * (1 - 1e-12), (found, lower)
