"""Several steps discretised in one pass give each step the bits it gets alone."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpoptim.accounting import pld


@st.composite
def steps_on_grids(draw):
    """A direction and 1 to 8 steps, each ``(sigma, q, points, closed)``: sigma from 0.02 to
    20, q from 1e-6 to 1 (1 itself now and then), increasing points of any gaps (some far
    below a bin's loss error, some far out in the tails, where bins hold next to nothing)."""
    direction = draw(st.sampled_from([pld._REMOVE, pld._ADD]))
    steps = []
    for _ in range(draw(st.integers(1, 8))):
        sigma = 10.0 ** draw(st.floats(-1.7, 1.3))
        q = 1.0 if draw(st.integers(0, 9)) == 0 else 10.0 ** draw(st.floats(-6.0, -1e-3))
        start = draw(st.floats(-3.0, 1.0))
        smallest, largest = draw(st.sampled_from([-4.0, -15.0])), draw(st.sampled_from([-1.0, 0.7]))
        gaps = 10.0 ** np.array(draw(st.lists(st.floats(smallest, largest), min_size=1, max_size=200)))
        steps.append((sigma, q, np.unique(start + np.cumsum(gaps)), draw(st.booleans())))
    return direction, steps


def assert_as_alone(direction, steps):
    alone = []
    for sigma, q, points, closed in steps:
        try:
            alone.append(pld._dots(sigma, q, direction, points, closed))
        except pld.DroppedMass:
            with pytest.raises(pld.DroppedMass):
                pld._dots_of_steps(steps, direction)
            return
    together = pld._dots_of_steps(steps, direction)
    assert len(together) == len(steps)
    for (masses, p_inf), (own, own_inf) in zip(together, alone):
        assert np.array_equal(masses, own) and p_inf == own_inf


@settings(max_examples=60, deadline=None)
@given(steps_on_grids(), st.sampled_from([2**15, 64, 1]))
def test_steps_discretised_together_get_the_bits_they_get_alone(case, batch):
    # In one batch, in batches of 64 points (a step above that alone), one by one.
    direction, steps = case
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pld, "_BATCH_POINTS_OF_STEPS", batch)
        assert_as_alone(direction, steps)


def test_steps_discretised_together_on_two_threads_get_the_bits_they_get_alone(monkeypatch):
    # Enough points to halve the steps between two threads (the threshold lowered).
    rng = np.random.default_rng(3)
    steps = [(float(rng.uniform(0.3, 3.0)), float(10.0 ** rng.uniform(-6, -1)), np.sort(rng.uniform(-2, 2, size)),
              False) for size in (10, 5000, 300, 20000, 7, 900)]
    halves = []
    beside = pld._beside
    monkeypatch.setattr(pld, "_HALVED_BOUNDS", 2**12)
    monkeypatch.setattr(pld, "_beside", lambda first, second, *a: halves.append(1) or beside(first, second, *a))
    assert_as_alone(pld._REMOVE, steps)
    assert halves


@pytest.mark.parametrize("direction", [pld._REMOVE, pld._ADD])
def test_a_bin_holding_zero_is_redone_only_for_its_own_step(direction):
    # A bin a few ulps wide around z = 0 (or 1) holds next to no mass, and its step's
    # bounds are redone there (pld._across_bounds); a step beside it keeps its own.
    redone = 0
    for sigma in (0.05, 0.2, 1.0, 3.0):
        for q in (1e-3, 0.3, 1.0):
            for centre in (0.0, 1.0):
                loss = float(pld._loss_of_z(np.array([centre]), sigma, q, direction)[0])
                points = np.unique([loss - 0.5, loss - 1e-16, loss + 1e-16, loss + 0.5])
                edges = np.concatenate([[-np.inf], sigma * sigma * pld._log_r(points, q, direction) + 0.5, [np.inf]])
                with np.errstate(all="ignore"):
                    x0, t0, x1, t1 = pld._edge_tails(sigma, edges)
                    slacks = [pld._gauss_bins_slack(x, t, pld._log_gauss_bins(x, t)) for x, t in ((x0, t0), (x1, t1))]
                if all(np.isfinite(slack).all() for slack in slacks):
                    continue
                redone += 1
                other = (0.7, 0.01, np.linspace(-0.1, 0.5, 50), False)
                with np.errstate(divide="ignore"):
                    assert_as_alone(direction, [(sigma, q, points, False), other])
                    assert_as_alone(direction, [other, (sigma, q, points, False)])
    assert redone


@settings(max_examples=40, deadline=None)
@given(steps_on_grids(), st.lists(st.floats(-3.0, 3.0), min_size=1, max_size=40), st.booleans())
def test_split_masses_of_several_steps_are_those_of_each_alone(case, losses, bounded):
    direction, steps = case
    losses = np.array(losses)
    rows = pld._split_log_masses_of_steps([step[:2] for step in steps], direction, losses, bounded)
    for row, (sigma, q, _, _) in enumerate(steps):
        alone = pld._split_log_masses(sigma, q, direction, losses, bounded)
        for side in (0, 1):
            assert np.array_equal(rows[side][row], alone[side], equal_nan=True)
