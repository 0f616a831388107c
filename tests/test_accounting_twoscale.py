"""The split's bulk on two scales (:mod:`dpoptim.accounting.twoscale`).

A long run at tiny q has a body a few q wide and a window the deep Chernoff bounds make
wide: one grid fine enough for the body needs 2^21 points. The body is composed in
blocks on a fine grid and the rest on a coarse one, which must bound the one fine grid's
profile from above (the Jensen step of the module docstring) and stay close to it.
"""

import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from dpoptim.accounting import pld as pld_module
from dpoptim.accounting import rare, rare_lower, twoscale
from dpoptim.accounting.pld import pld_epsilon


def fresh_caches():
    pld_module._noted_pld_epsilon.cache_clear()
    rare._split_epsilon.cache_clear()
    rare._cuts.cache_clear()


@st.composite
def long_runs(draw):
    """``(sigma, q, count, delta, direction)``: runs long enough for blocks, at q small
    enough that the body is far narrower than the window."""
    sigma = draw(st.floats(0.45, 1.5))
    q = 10.0 ** draw(st.floats(-6.0, -4.0))
    count = int(2.0 ** draw(st.floats(16.5, 19.0)))
    delta = 10.0 ** draw(st.floats(-12.0, -6.0))
    return sigma, q, count, delta, draw(st.sampled_from(["remove", "add"]))


def both_grids(sigma, q, count, delta, direction):
    """The whole step's bulk (no tail split off) on two scales and on the one fine grid,
    over the same losses, or None where blocks are not planned there."""
    steps = ((sigma, q, count),)
    scale = 2.0 ** math.floor(math.log2(pld_epsilon([(sigma, q, count)], delta)))
    bottom, top = (float(pld_module._loss_of_z(z, sigma, q, direction))
                   for z in (-pld_module._GAUSS_TAIL * sigma, 1.0 + pld_module._GAUSS_TAIL * sigma))
    h = rare._bulk_spacing(steps, direction, rare.finest_spacing(scale, count), scale, bottom, top)
    plan = twoscale.plan((sigma, q, count), direction, h, (bottom, top), scale, (rare._SPREAD_SHARE * scale) ** 2,
                         delta)
    if plan is None:
        return None
    H, ratio = plan.spacing, round(plan.spacing / h)
    bottoms, tops = pld_module._tail_ends(steps, H, -(2**62), 2**62, pld_module._TAIL_FRACTION * delta)
    low, high = bottoms[direction][0], tops[direction][0]
    if (high - low) * ratio > 2**21:
        return None
    blocks = twoscale.bulk(plan, (sigma, q, count), direction, (low, high, False, False), 0.0, delta)
    if blocks is None:
        return None
    ends = ((low * ratio,), (low * ratio,), (high * ratio,), (high * ratio,))  # (no tails)
    _, fine, _ = rare._bulks(((sigma, q, count),), direction, h, ends, 0.0)[0]
    return plan, blocks, (low * ratio, fine), h


@settings(max_examples=4, deadline=None)
@given(long_runs())
def test_the_two_scale_bulk_bounds_the_one_fine_grid_and_stays_close(run):
    sigma, q, count, delta, direction = run
    made = both_grids(sigma, q, count, delta, direction)
    assume(made is not None)
    plan, blocks, (first, fine), h = made
    for factors, fine_count in ((blocks.factors, count), (blocks.fewer, count - 1)):
        two = rare._term_profile(factors, plan.spacing, delta, np.float64, 0.0)
        one = rare._term_profile([(first, fine, fine_count)], h, delta, np.float64, 0.0, points=2**22)
        assert two is not None and one is not None
        # read where the one grid's profile runs from 1e-3 down to delta
        values = one.floor_at(one.losses)
        inside = one.losses[(values < 1e-3) & (values > delta)]
        assert inside.size > 10
        points = np.linspace(inside[0], inside[-1], 200)
        value, allowance = two.at(points)
        upper = value + blocks.infinite
        lower = one.floor_at(points)
        # never below what the fine grid's distribution certainly has ...
        assert np.all(upper >= lower), (points[upper < lower][:3], upper[upper < lower][:3])
        # ... and at most a little above it: an epsilon shift of a thousandth, plus a
        # coarse bin (read between the coarse points, a profile costs up to one: at sigma
        # 0.5625, q 1e-6, 2^17 steps, delta 1e-10, bins of 2.4e-4 read up to 1.7% above
        # a shift of 2.8e-5 alone, and at most 0.9 of the bound with the bin). (Untilted,
        # each profile's rounding allowance reaches a few 1e-9 deep down, more on two
        # scales' many factors than on one grid's one: the distributions are compared.)
        shifted = one.at(points - 1e-3 * max(abs(points[-1]), 1e-3) - plan.spacing)[0]
        assert np.all(upper - allowance <= shifted * 1.001 + 1e-3 * delta)


def test_a_long_run_at_tiny_q_is_split_on_two_scales_and_bracketed():
    # sigma 0.6613, q 1e-6, 10^8 steps, delta 1e-12: the bulk took three transforms of
    # 2^21 points; its coarse bins are now 32 times wider (2^-18)
    runs, delta = [(0.6613, 1e-6, 10**8)], 1e-12
    planned = []
    original = twoscale.bulk

    def spy(plan, *args):
        made = original(plan, *args)
        planned.append((plan, made is not None))
        return made

    fresh_caches()
    try:
        twoscale.bulk = spy
        reported = pld_epsilon(runs, delta)
    finally:
        twoscale.bulk = original
        fresh_caches()
    assert any(used for _, used in planned)
    assert all(plan.spacing >= 2**4 * plan.h for plan, _ in planned)
    # the rigorous lower bound that keeps the bulk's spread on one fine grid (0.2234)
    lower = rare_lower.spread_lower_bound(((0.6613, 1e-6, 10**8),), "remove", delta, reported, points=2**21)
    assert lower <= reported <= lower * 1.003, (lower, reported)


def test_epsilon_is_monotone_where_the_bulk_is_on_two_scales():
    # sigma and steps 1% apart at q 1e-6 over 10^8 steps, delta 1e-12
    fresh_caches()
    values = [pld_epsilon([(0.6613 * (1 + 0.01 * k), 1e-6, 10**8)], 1e-12) for k in range(3)]
    assert values[0] > values[1] > values[2], values
    values = [pld_epsilon([(0.6613, 1e-6, int(10**8 * (1 - 0.01 * k)))], 1e-12) for k in range(3)]
    assert values[0] > values[1] > values[2], values
    fresh_caches()


@pytest.mark.parametrize("run, delta", [((0.6613, 1e-6, 10**8), 1e-12), ((0.725, 2e-5, 83_000_000), 1.6e-12),
                                        ((0.39, 1.3e-6, 30_002_325), 2.1e-8)])
def test_two_scales_move_epsilon_by_less_than_a_thousandth(monkeypatch, run, delta):
    fresh_caches()
    blocked = pld_epsilon([run], delta)
    monkeypatch.setattr(twoscale, "plan", lambda *args: None)
    fresh_caches()
    one_grid = pld_epsilon([run], delta)
    fresh_caches()
    assert abs(blocked - one_grid) <= 1e-3 * one_grid, (blocked, one_grid)


def test_moving_by_a_fraction_of_a_bin_keeps_both_masses():
    # a unit mass at loss 0.3 H: split between 0 and H keeping its E[e^{-L}], the upper
    # share rounded up
    spacing = 2.0**-10
    bins, moved = twoscale._moved(0.3 * spacing, spacing)
    assert bins == 0 and moved.sum() == pytest.approx(1.0, abs=1e-14)
    exact = math.exp(-0.3 * spacing)
    assert moved[0] + moved[1] * math.exp(-spacing) <= exact + 1e-15  # (Q-mass at most kept: moved up)
    assert moved[0] + moved[1] * math.exp(-spacing) >= exact - 1e-13
    bins, moved = twoscale._moved(2.5 * spacing, spacing)
    assert bins == 2 and moved[1] == pytest.approx(0.5, abs=1e-3)
