"""The PLD's per-step grid distributions bound the exact ones whatever the rounding.

Each step's connect-the-dots distribution is built from Gaussian log-tails computed in
float64. ``pld._bin_bounds`` turns their rounding into bounds (a P-mass bound above, a
Q-mass bound below, how far each cut's loss may lie from the grid's, and the mass that
may lie past it), and ``pld._connect_the_dots`` biases the split by them. Here the
result is judged against the same rule computed in 50-digit arithmetic from the exact
bins: its mass at or above every grid point (and at +inf) must be at least the exact
rule's, first-order stochastic dominance, which never lowers a privacy profile.
"""

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dpoptim.accounting import pld
from dpoptim.accounting.special import finite_abs, log_ndtr

mp = pytest.importorskip("mpmath")

DIGITS = 50
#: Sums below this are beyond what float64 holds; the code counts such bins at +inf.
NEGLIGIBLE = 1e-290


def exact_bins(sigma, q, direction, points):
    """The P- and Q-masses of the exact bins cut where the loss crosses ``points``: the
    first below them, the last above (as ``pld._bin_log_masses``, in the reflected
    coordinate for addition)."""
    s, qq, one = mp.mpf(sigma), mp.mpf(q), mp.mpf(1)
    cuts = []
    for loss in points:
        loss = mp.mpf(float(loss))
        if direction == pld._REMOVE:
            rest = mp.e**loss - (one - qq)
            cuts.append(mp.ninf if rest <= 0 else s * s * mp.log(rest / qq) + mp.mpf(0.5))
        else:
            rest = one - (one - qq) * mp.e**loss
            cuts.append(mp.inf if rest <= 0 else s * s * mp.log(qq * mp.e**loss / rest) + mp.mpf(0.5))
    edges = [mp.ninf, *cuts, mp.inf]

    def mass(a, b, mean):  # N(mean, s^2) mass of (a, b], from the smaller tails
        if a >= b:
            return mp.mpf(0)
        xa = mp.ninf if a == mp.ninf else (a - mean) / s
        xb = mp.inf if b == mp.inf else (b - mean) / s
        upper = lambda x: mp.mpf(0) if x == mp.inf else mp.ncdf(-x)  # noqa: E731
        lower = lambda x: mp.mpf(0) if x == mp.ninf else mp.ncdf(x)  # noqa: E731
        if xa >= 0:
            return upper(xa) - upper(xb)
        if xb <= 0:
            return lower(xb) - lower(xa)
        return one - lower(xa) - upper(xb)

    p, qm = [], []
    for a, b in zip(edges[:-1], edges[1:]):
        n0, n1 = mass(a, b, 0), mass(a, b, 1)
        if direction == pld._REMOVE:
            p.append((one - qq) * n0 + qq * n1)
            qm.append(n0)
        else:
            p.append(n1)
            qm.append(qq * n0 + (one - qq) * n1)
    return p, qm


def exact_split(sigma, q, direction, points):
    """Connect-the-dots (Doroshenko et al. 2022) of the exact bins: ``(masses, p_inf)``."""
    with mp.workdps(DIGITS):
        p, qm = exact_bins(sigma, q, direction, points)
        one, masses = mp.mpf(1), [mp.mpf(0)] * len(points)
        masses[0] += p[0]
        for k in range(len(points) - 1):
            if p[k + 1] == 0:
                continue
            low, high = mp.mpf(float(points[k])), mp.mpf(float(points[k + 1]))
            share = (one - mp.e**low * qm[k + 1] / p[k + 1]) / (one - mp.e ** (low - high))
            share = min(max(share, mp.mpf(0)), one)
            masses[k] += p[k + 1] * (one - share)
            masses[k + 1] += p[k + 1] * share
        kept = min(one, mp.e ** mp.mpf(float(points[-1])) * qm[-1] / p[-1]) if p[-1] > 0 else mp.mpf(0)
        masses[-1] += p[-1] * kept
        return masses, p[-1] * (one - kept)


def upper_sums(masses, p_inf):
    """Mass at or above each point, +inf included."""
    with mp.workdps(DIGITS):
        total, out = (p_inf if isinstance(p_inf, mp.mpf) else mp.mpf(float(p_inf))), []
        for mass in reversed(list(masses)):
            total += mp.mpf(mass) if isinstance(mass, mp.mpf) else mp.mpf(float(mass))
            out.append(total)
        return out[::-1]


def shortfalls(computed, exact):
    """The relative shortfalls of ``computed`` below ``exact``, where ``exact`` is
    representable."""
    with mp.workdps(DIGITS):
        return [float((e - c) / e) for c, e in zip(computed, exact) if e > NEGLIGIBLE and c < e]


def plain_split(sigma, q, direction, points):
    """The same rule on the rounded bin masses as they come, with no bounds: what the
    grid did before its rounding was bounded."""
    _, _, _, log_p, log_q = pld._bin_log_masses(sigma, q, direction, points)
    with np.errstate(all="ignore"):
        p = np.exp(log_p)
        masses = np.zeros(points.size)
        masses[0] += p[0]
        share = -np.expm1(log_q[1:-1] + points[:-1] - log_p[1:-1]) / -np.expm1(-np.diff(points))
        share = np.clip(np.nan_to_num(share, nan=0.0), 0.0, 1.0)
        masses[:-1] += p[1:-1] * (1.0 - share)
        masses[1:] += p[1:-1] * share
        kept = min(1.0, math.exp(min(log_q[-1] + points[-1] - log_p[-1], 0.0))) if p[-1] > 0 else 0.0
        masses[-1] += p[-1] * kept
    return masses, p[-1] * (1.0 - kept)


@st.composite
def steps_on_grids(draw):
    """A step (sigma 0.005 to 50, q 1e-8 to 1), a direction and a run of grid points
    (spacing 2^4 to 2^-22, some thinned) around a loss the step reaches."""
    sigma = math.exp(draw(st.floats(math.log(0.005), math.log(50.0))))
    q = 1.0 if draw(st.booleans()) and draw(st.booleans()) else math.exp(draw(st.floats(math.log(1e-8), 0.0)))
    q = min(q, 1.0)
    direction = draw(st.sampled_from([pld._REMOVE, pld._ADD]))
    h = 2.0 ** -draw(st.integers(-4, 22))
    z = draw(st.floats(-4.0, 4.0)) * sigma + draw(st.sampled_from([0.0, 1.0]))
    centre = float(pld._loss_of_z(z, sigma, q, direction))
    first = math.floor(centre / h) - draw(st.integers(0, 20))
    steps = draw(st.lists(st.integers(1, 3), min_size=2, max_size=40))
    points = (first + np.cumsum([0, *steps[1:]])) * h
    return sigma, q, direction, points


@settings(max_examples=60, deadline=None)
@given(steps_on_grids())
def test_each_step_dominates_its_exact_split_whatever_the_rounding(case):
    sigma, q, direction, points = case
    masses, p_inf = pld._dots(sigma, q, direction, points)
    exact = upper_sums(*exact_split(sigma, q, direction, points))
    computed = upper_sums(masses, p_inf)
    assert shortfalls(computed, exact) == []
    # and stays tight: the whole mass within 1e-9 of the exact one
    with mp.workdps(DIGITS):
        assert computed[0] <= exact[0] * (1 + mp.mpf("1e-9")) + NEGLIGIBLE * points.size


@settings(max_examples=60, deadline=None)
@given(steps_on_grids())
def test_bounds_of_two_halves_side_by_side_are_the_bounds_of_the_whole(case):
    # Long grids are bounded in two halves on two threads (the second half on the
    # accounting's thread), sharing one cut: every value is the one of the whole grid,
    # to the last bit, nan and infinities included.
    sigma, q, direction, points = case
    whole = pld._bounds_of_bins(sigma, q, direction, points)
    saved = pld._HALVED_BOUNDS, pld._core_idle
    pld._HALVED_BOUNDS, pld._core_idle = 2, lambda: True
    try:
        halves = pld._bin_bounds(sigma, q, direction, points)
    finally:
        pld._HALVED_BOUNDS, pld._core_idle = saved
    assert [part.shape for part in halves] == [part.shape for part in whole]
    for half, part in zip(halves, whole):
        np.testing.assert_array_equal(half, part)


def test_the_rounded_masses_split_as_they_come_fall_below_the_exact_split():
    """The check has teeth: splitting the rounded masses without bounds puts less mass
    above a point than the exact split does (by 6.5e-7 of it), where the bounded split
    does not."""
    sigma, q, direction, points = 3.4954209692771667, 2.596861021606032e-06, pld._ADD, np.arange(-16, 24) * 2.0**-21
    exact = upper_sums(*exact_split(sigma, q, direction, points))
    assert max(shortfalls(upper_sums(*plain_split(sigma, q, direction, points)), exact)) > 1e-7
    assert shortfalls(upper_sums(*pld._dots(sigma, q, direction, points)), exact) == []


@settings(max_examples=40, deadline=None)
@given(steps_on_grids())
def test_tail_masses_bound_the_exact_tails(case):
    sigma, q, direction, points = case
    below, above = pld._split_log_masses(sigma, q, direction, points)
    for loss, low, high in zip(points, below, above):
        with mp.workdps(DIGITS):
            p, _ = exact_bins(sigma, q, direction, [loss])
            assert mp.e ** mp.mpf(float(low)) >= p[0] or p[0] < NEGLIGIBLE
            assert mp.e ** mp.mpf(float(high)) >= p[1] or p[1] < NEGLIGIBLE


@settings(max_examples=60, deadline=None)
@given(steps_on_grids())
def test_each_cut_lies_within_its_bounds(case):
    """The computed cut z lies within ``width`` of the exact one, and the loss there
    within ``rho`` of the grid's (the shared component's own move is zero here)."""
    sigma, q, direction, points = case
    log_r = pld._log_r(points, q, direction)
    z = sigma * sigma * log_r + 0.5
    rho, width = pld._edge_errors(sigma, q, direction, points, log_r, z, np.zeros(points.size))
    with mp.workdps(DIGITS):
        s, qq, one = mp.mpf(sigma), mp.mpf(q), mp.mpf(1)
        for loss, cut, bound, room in zip(points, z, rho, width):
            if not math.isfinite(cut):
                continue
            log_ratio = (mp.mpf(float(cut)) - mp.mpf(0.5)) / (s * s)
            if direction == pld._REMOVE:
                exact_loss = mp.log(one - qq + qq * mp.e**log_ratio)
            else:
                exact_loss = -mp.log(one - qq + qq * mp.e**-log_ratio)
            assert abs(exact_loss - mp.mpf(float(loss))) <= mp.mpf(float(bound))
            if math.isfinite(room):
                rest = mp.e ** mp.mpf(float(loss)) - (one - qq) if direction == pld._REMOVE else \
                    one - (one - qq) * mp.e ** mp.mpf(float(loss))
                if rest > 0:
                    ratio = rest / qq if direction == pld._REMOVE else qq * mp.e ** mp.mpf(float(loss)) / rest
                    assert abs(s * s * mp.log(ratio) + mp.mpf(0.5) - mp.mpf(float(cut))) <= mp.mpf(float(room))


def test_log_ndtr_is_within_the_bound_the_grid_assumes():
    """``_tail_shift`` takes the Gaussian log-tail accurate to 8u(1 + |t|)."""
    unit = 2.0**-53
    xs = np.concatenate([np.linspace(-60.0, 8.0, 1361), -np.geomspace(1e-9, 60.0, 200), [-300.0, -1e3, -3e4]])
    with mp.workdps(40):
        for x in xs:
            exact = mp.log(mp.ncdf(float(x)))
            assert abs(mp.mpf(float(log_ndtr(float(x)))) - exact) <= 8 * unit * (1 + abs(exact))


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([math.inf, -math.inf])),
                max_size=40), st.sampled_from([np.float64, np.longdouble, np.float32]))
def test_finite_abs_is_the_size_of_every_finite_term_and_zero_elsewhere(values, dtype):
    """Round-off bounds count an infinite (exact) term as 0: nan and both infinities."""
    with np.errstate(over="ignore"):  # large doubles become infinite float32s: terms like any other
        x = np.array(values, dtype=dtype)
    out = finite_abs(x)
    assert out.dtype == x.dtype and out.shape == x.shape
    for value, size in zip(x, out):
        assert size == (abs(value) if np.isfinite(value) else 0.0)
    assert finite_abs(-math.inf) == 0.0 and finite_abs(math.nan) == 0.0 and finite_abs(-2.5) == 2.5


def test_a_window_top_from_the_rdp_curves_is_checked_on_the_grid_distributions():
    """The RDP curves bound the exact connect-the-dots distributions' tails; the profile
    adds ``_grid_tail``, a bound from the grid distributions themselves, at least the
    composed mass at or above the window's top (composed here by direct convolution),
    and raised above a budget too small for it."""
    steps, delta = ((1.0, 0.05, 3), (0.8, 0.02, 2)), 1e-6
    grid = pld._rdp_grid(steps, delta / 65536, delta, 2**12)
    top, _ = grid.window_top
    aboves = {}
    for direction in (pld._REMOVE, pld._ADD):
        items = [(sigma, q, direction, grid.spacing, bottom, high, None, count)
                 for (sigma, q, count), bottom, high in zip(steps, grid.bottoms[direction], grid.tops[direction])]
        parts = pld._product(items, grid, np.float64, False)
        composed, first = np.array([1.0]), 0
        for sigma, q, _, spacing, bottom, high, _, count in items:
            start, masses, _ = pld._step_distribution(sigma, q, direction, spacing, bottom, high)
            for _ in range(count):
                composed, first = np.convolve(composed, masses), first + start
        above = float(composed[(first + np.arange(composed.size)) * grid.spacing >= top].sum())
        assert pld._grid_tail(items, grid, parts) >= max(above, grid.tail)
        starved = dataclasses.replace(grid, tail=1e-300)
        assert pld._grid_tail(items, starved, parts) >= above
        aboves[direction] = above
    assert aboves[pld._REMOVE] > 0  # (removal's tail is not empty: the check has something to bound)


def test_a_closed_split_of_bins_raises_rather_than_drop_mass_at_infinity():
    # The split's lower tails and bulks keep only their points' masses: mass that
    # connect-the-dots sends to +inf from below the top bin would be lost with the +inf
    # mass they drop. A loss error as wide as the gap above moves an excess there.
    points = np.array([0.0, 1.0, 1.0 + 1e-15, 2.0])
    log_p = np.log(np.full(points.size + 1, 0.2))
    log_q = log_p - 0.5
    rho = np.array([0.0, 1e-12, 0.0, 0.0])  # the cut at 1.0: wider than the gap above it
    log_excess = np.array([-np.inf, math.log(1e-3), -np.inf, -np.inf])
    with np.errstate(divide="ignore"):
        masses, p_inf = pld._connect_the_dots(log_p, log_q, rho, log_excess, points)
        assert p_inf >= 1e-3  # open: counted at +inf
        with pytest.raises(pld.DroppedMass):
            pld._connect_the_dots(log_p, log_q, rho, log_excess, points, closed=True)
        rho[1] = 0.0  # no such move, no underflowing bin: the same masses
        closed, _ = pld._connect_the_dots(log_p, log_q, rho, log_excess, points, closed=True)
        assert np.array_equal(closed, pld._connect_the_dots(log_p, log_q, rho, log_excess, points)[0])
        log_p[0] = -np.inf  # an empty bin loses nothing ...
        pld._connect_the_dots(log_p, log_q, rho, log_excess, points, closed=True)
        log_p[2] = -700.0  # ... one whose mass may underflow does
        with pytest.raises(pld.DroppedMass):
            pld._connect_the_dots(log_p, log_q, rho, log_excess, points, closed=True)


def test_the_split_answers_none_where_a_closed_split_would_drop_mass(monkeypatch):
    from dpoptim.accounting import rare

    steps = ((0.7, 1e-4, 1),)  # one step: a lower tail, a bulk and an upper tail
    rare._split_epsilon.cache_clear()
    assert rare.split_epsilon(steps, "remove", 1e-10, 1.0) is not None
    dots = pld._dots

    def refusing(sigma, q, direction, points, closed=False):
        if closed:
            raise pld.DroppedMass("test")
        return dots(sigma, q, direction, points)

    monkeypatch.setattr(pld, "_dots", refusing)
    rare._split_epsilon.cache_clear()
    assert rare.split_epsilon(steps, "remove", 1e-10, 1.0) is None
    rare._split_epsilon.cache_clear()


def _extended(value) -> "mp.mpf":
    """An extended-precision float as an mpmath number (its shortest round-tripping digits)."""
    return mp.mpf(np.format_float_positional(value, unique=True))


def test_extended_angles_are_reduced_by_an_extended_two_pi():
    # A product's angle is count * arctan2, taken mod 2 pi. Float64's 2 pi is 2.4e-16
    # short: in extended precision 159 turns taken off turned the angle by 3.9e-14, far
    # beyond the transform's allowance of a few extended round-offs (a transform of 32
    # steps at sigma 0.02 and q 0.11 erred by 1.2 times its allowance, and a lower bound
    # rose above the exact epsilon). What is left is the product's own rounding.
    mp.mp.dps = DIGITS
    theta = np.longdouble(1)
    real, imag = np.array([np.cos(theta)]), np.array([np.sin(theta)])
    reduced = pld._reduced_angles(real, imag, np.array([1000]))
    angle = np.arctan2(imag, real)[0]
    exact = 1000 * _extended(angle)
    exact -= 2 * mp.pi * mp.nint(exact / (2 * mp.pi))
    assert reduced.dtype == np.longdouble
    assert abs(_extended(reduced[0]) - exact) < 1e-15
    # and the polar form takes negative angles mod an extended 2 pi too
    out = pld._polar(np.zeros(1, dtype=np.longdouble), np.array([-theta]))
    assert abs(_extended(out[0].real) - mp.cos(-1)) < 1e-18 and abs(_extended(out[0].imag) - mp.sin(-1)) < 1e-18


def test_an_extended_transform_at_tiny_sigma_keeps_the_lower_bound_below_the_exact_epsilon():
    # 32 steps at sigma 0.02, q 0.11 on 2^10 points, composed in extended precision: with
    # its angles reduced by float64's 2 pi the lower bound read 23,548, against an exact
    # epsilon below 19,850 (revealing which steps sampled the example).
    from test_accounting_rare_lower import revealed_count_epsilon

    sigma, q, delta = 0.020140012847086528, 0.11461693058194451, 3.017612380248321e-08
    above = revealed_count_epsilon(sigma, q, 32, delta)
    assert pld.pld_epsilon_lower_bound([(sigma, q, 32)], delta, grid_points=2**10) <= above
