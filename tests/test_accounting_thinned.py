"""Thinned step distributions: connect-the-dots on fewer grid points where little mass lies.

The PLD's grids are sized for the body of the loss; at small q a step's rare large losses
stretch its support over hundreds of thousands of bins that hold almost no mass. Built on
every ``2^j``-th point there (:func:`dpoptim.accounting.pld._thinned_points`), a step's
distribution still dominates it (connect-the-dots on any points does), so thinning is a
matter of tightness, which these tests hold to its budget, and of speed.
"""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dpoptim.accounting import pld as pld_module
from dpoptim.accounting import rare
from dpoptim.accounting.pld import pld_epsilon


def fresh_caches():
    """Forget every cached distribution, transform and value: thinning changes none of their keys."""
    pld_module._noted_pld_epsilon.cache_clear()
    pld_module._grid_distribution.cache_clear()
    pld_module._prefix_cache.clear()
    pld_module._tail_cache.clear()
    pld_module._head_cache.clear()
    rare._split_epsilon.cache_clear()


def spy_on_thinning(monkeypatch) -> list:
    """A list that gets ``(points kept, points spanned)`` of each thinned step from now on."""
    thinned, thin = [], pld_module._thinned_points

    def spy(sigma, q, direction, spacing, lo, hi, tilt):
        points = thin(sigma, q, direction, spacing, lo, hi, tilt)
        thinned.append((points.size, hi - lo + 1))
        return points

    monkeypatch.setattr(pld_module, "_thinned_points", spy)
    return thinned


def profile(first, masses, p_inf, spacing, epsilons):
    losses = (first + np.arange(masses.size)) * spacing
    return np.array([p_inf + float(masses @ np.maximum(-np.expm1(e - losses), 0.0)) for e in epsilons])


@st.composite
def steps(draw):
    """``(sigma, q, direction, spacing, tilt, lo, hi)``: a step on a grid that holds its
    whole support in 2^11 to 2^20 points (``lo .. hi``), and a tilt to serve."""
    sigma, q = draw(st.floats(0.3, 3.0)), 10.0 ** draw(st.floats(-6.0, -0.5))
    direction = draw(st.sampled_from(["remove", "add"]))
    ends = [float(pld_module._loss_of_z(z, sigma, q, direction))
            for z in (-pld_module._GAUSS_TAIL * sigma, 1.0 + pld_module._GAUSS_TAIL * sigma)]
    spacing = 2.0 ** math.ceil(math.log2((ends[1] - ends[0]) / 2.0 ** draw(st.integers(11, 19))))
    lo, hi = pld_module._support(sigma, q, direction, spacing, -2**40, 2**40)
    return sigma, q, direction, spacing, 2.0 ** draw(st.integers(0, 10)), lo, hi


@settings(max_examples=40, deadline=None)
@given(steps())
def test_a_thinned_step_keeps_its_ends_and_spreads_the_loss_within_its_budget(step):
    sigma, q, direction, spacing, tilt, lo, hi = step
    points = pld_module._thinned_points(sigma, q, direction, spacing, lo, hi, tilt)
    assert points[0] == lo and points[-1] == hi
    gaps = np.diff(points)
    assert np.all(gaps >= 1)
    # no bin wider than the kink allows at the tilt served
    assert np.all((gaps == 1) | (gaps * spacing <= pld_module._THIN_KINK / tilt))
    # the bins skipped spread the loss by at most the budget: each bin's P-mass times
    # its width squared over four, beyond what the full grid's bins would
    masses = np.exp(pld_module._bin_log_masses(sigma, q, direction, points * spacing)[3][1:-1])
    extra = float(masses @ ((gaps * spacing) ** 2 - spacing**2)) / 4.0
    absolute = pld_module._mean_absolute_loss(sigma, q, direction)
    assert extra <= pld_module._THIN_SHARE * spacing * min(absolute, spacing / 4.0) * 1.001 + 1e-300


def mass_above(first, masses, spacing, epsilons):
    losses = (first + np.arange(masses.size)) * spacing
    return np.array([float(masses[losses > e].sum()) for e in epsilons])


@settings(max_examples=40, deadline=None)
@example(step=(2.75, 1e-06, "remove", 2.9802322387695312e-08, 1.0, -34, 4017))
@given(steps())
def test_a_thinned_step_dominates_the_step_on_every_point(step):
    # Connect-the-dots onto fewer points is connect-the-dots of the full grid's
    # distribution again (each atom's P- and Q-mass kept, split between the two points
    # around it): a mean-preserving spread of e^-L, so every privacy profile rises.
    # Below the first skipped point both profiles are equal, up to rounding: a bin's split
    # between points h apart is set by its loss less the lower point's, a difference of
    # logarithms that errs by a few units of their size (30 or so), so each atom above
    # epsilon moves its Q-mass by about 1e-14 of its P-mass. At bins of 3e-8 that was 2.6e-9
    # of a profile of 7.7e-21, itself 1e-6 of the mass above epsilon: the slack is 2^-40 of
    # that mass, times e^epsilon. Each grid's split is also biased up by its own rounding
    # bounds (pld._connect_the_dots), by a share about 1e-13 over the bin's width, which
    # differs between the two grids: 1e-7 of the profile covers that (measured at most
    # 6.7e-9 over 150 examples). Each distribution bounds the exact one on its own
    # (test_accounting_grid_rounding.py, thinned points included).
    sigma, q, direction, spacing, tilt, lo, hi = step
    full = pld_module._grid_distribution(sigma, q, direction, spacing, lo, hi, False, None)
    thinned = pld_module._grid_distribution(sigma, q, direction, spacing, lo, hi, False, tilt)
    assert thinned[0] == full[0] and thinned[1].size == full[1].size
    assert thinned[2] == full[2]  # the mass at +inf: the top bin is the same
    assert math.isclose(thinned[1].sum(), full[1].sum(), rel_tol=1e-9)
    epsilons = np.concatenate([[-1.0, 0.0], (lo + (hi - lo) * np.linspace(0.0, 1.0, 25)) * spacing])
    slack = 2.0**-40 * np.exp(np.maximum(epsilons, 0.0)) * mass_above(*full[:2], spacing, epsilons)
    assert np.all(profile(*thinned, spacing, epsilons) >= profile(*full, spacing, epsilons) * (1 - 1e-7) - slack - 1e-300)


@settings(max_examples=25, deadline=None)
@given(steps())
def test_the_log_mgf_of_a_thinned_step_is_an_upper_bound_on_its_sum(step):
    sigma, q, direction, spacing, tilt, lo, hi = step
    first, masses, _ = pld_module._grid_distribution(sigma, q, direction, spacing, lo, hi, False, tilt)
    lambdas = np.concatenate([-np.geomspace(1e-2, 1e6, 30)[::-1], [0.0], np.geomspace(1e-2, 1e6, 30)])
    support = np.flatnonzero(masses)
    exponents = np.outer(lambdas, (first + support) * spacing) + np.log(masses[support])
    peak = exponents.max(axis=1)
    exact = peak + np.log(np.exp(exponents - peak[:, None]).sum(axis=1))
    bound = pld_module._log_mgf(first, masses, spacing, lambdas)
    assert np.all(bound >= exact)
    assert np.all(bound - exact <= 1e-11 * (1.0 + np.abs(exact)))


LEDGERS = [
    # sigma schedules at q 1e-4 and 1e-5: the tails thinned hundreds of times
    ([(float(s), 1e-4, 12_500) for s in np.geomspace(1.0, 0.8, 8)], 1e-5, True),
    ([(float(s), 1e-5, 30_000) for s in np.geomspace(1.0, 0.8, 8)], 1e-6, True),
    # one rare loss decides: without the cap on bins at the tilt it rose by 0.08%
    ([(float(s), float(q), 2) for s, q in zip(np.geomspace(1.9106, 0.98176, 533), np.geomspace(6.217e-4, 2.957e-4, 533))],
     2.6466e-9, True),
    # few steps at a tiny delta: the heavy tail decides epsilon and keeps its points
    ([(0.9, 0.02, 60), (1.5, 0.04, 40)], 1e-8, False),
]


@pytest.mark.parametrize("runs, delta, thins", LEDGERS)
def test_thinning_moves_epsilon_by_little(monkeypatch, runs, delta, thins):
    fresh_caches()
    monkeypatch.setattr(pld_module, "_THIN_SHARE", 0.0)  # every point kept
    monkeypatch.setattr(pld_module, "_GROUPED_SPLIT", False)  # (the mixture groups answer, not the split)
    full = pld_epsilon(runs, delta)
    monkeypatch.undo()
    monkeypatch.setattr(pld_module, "_GROUPED_SPLIT", False)  # (the mixture groups answer, not the split)
    fresh_caches()
    thinned_points = spy_on_thinning(monkeypatch)
    thinned = pld_epsilon(runs, delta)
    fresh_caches()
    assert any(kept < size for kept, size in thinned_points) == thins
    assert abs(thinned / full - 1.0) <= 1e-4, (thinned, full)


def test_the_rdp_sized_grid_thins_a_tiny_q_step_by_little(monkeypatch):
    # At tiny q the RDP curves' window holds a step's rare losses: here 688,134 of its
    # 2^20 points, each once a Gaussian tail or two to bound. Thinned, the grid composes
    # under half of them; each direction's epsilon on it moves by at most 1e-4 of itself
    # against the same grid with every point kept (up to rounding, only ever up: the
    # thinned steps dominate the full ones, and the tail bound is the same or larger).
    sigma, q, steps, delta = 0.53959426, 4.039839004229273e-05, 292_963, 0.0469699580550083
    runs = ((sigma, q, steps),)
    grid = pld_module._choose_grid(runs, delta, 2**20, 2**20, tail_fraction=pld_module._TAIL_FRACTION)
    assert grid.window_top is not None and grid.thin is not None  # the RDP-sized window, thinned
    kept = spy_on_thinning(monkeypatch)
    for direction in ("remove", "add"):
        fresh_caches()
        thinned = pld_module._compose_direction(runs, direction, grid, delta, np.float64)[0]
        full = pld_module._compose_direction(runs, direction, dataclasses.replace(grid, thin=None), delta,
                                             np.float64)[0]
        assert full * (1 - 1e-9) <= thinned <= full * (1 + 1e-4), (direction, thinned, full)
    assert kept and all(points < size / 2 for points, size in kept)
    fresh_caches()


def test_the_tail_an_rdp_sized_grid_adds_bounds_its_thinned_steps():
    # The RDP curves bound the window's tail for the full grid's bins; thinned steps
    # spread the loss further, which raises every moment generating function at a
    # positive lambda. The tail the profile adds is checked against the distributions
    # composed (pld._grid_tail): with the curves' bound taken as nothing, it must be at
    # least the Chernoff bound of the thinned steps at the transform's tilt and the
    # window's order, summed here from their masses, which lies above the full grid's.
    (sigma, q, steps), delta, n = (0.6, 1e-3, 30), 1e-6, 2**14
    grid = pld_module._choose_grid(((sigma, q, steps),), delta, n, n)
    assert grid.window_top is not None and grid.thin is not None
    grid = dataclasses.replace(grid, tail=1e-300)
    top, order = grid.window_top

    def chernoff(direction, thin):
        first, masses, _ = pld_module._step_distribution(sigma, q, direction, grid.spacing, grid.bottoms[direction][0],
                                                         grid.tops[direction][0], thin=thin)
        support = np.flatnonzero(masses)
        losses = (first + support) * grid.spacing
        bounds = []
        for lam in (grid.tilt, order):
            exponents = np.log(masses[support]) + lam * losses
            peak = exponents.max()
            bounds.append(math.exp(min(steps * (peak + math.log(np.exp(exponents - peak).sum())) - lam * top, 0.0)))
        return min(bounds)

    for direction in ("remove", "add"):
        items = [(sigma, q, direction, grid.spacing, grid.bottoms[direction][0], grid.tops[direction][0],
                  grid.thin[direction], steps)]
        added = pld_module._grid_tail(items, grid, pld_module._product(items, grid, np.float64, False))
        thinned, full = chernoff(direction, grid.thin[direction]), chernoff(direction, None)
        assert added >= thinned * (1 - 1e-12), direction
        assert thinned >= full * (1 - 1e-12)
        if direction == "remove":  # its rare losses' tail is thinned: a check on the full steps falls short
            assert thinned > full * (1 + 1e-8)
