"""Reading epsilon off a composed profile (``pld._invert_profile``): the suffix sums
read in blocks, and the answer never below the discrete distribution's own.

The oracle sums the profile of the discrete distribution with ``math.fsum`` (each sum
correctly rounded) at every grid point and bisects on epsilon in the crossing's bin:
nothing in it shares code with the accountant's inversion."""

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from dpoptim.accounting import pld as pld_module


@settings(max_examples=60, deadline=None)
@given(size=st.integers(0, 3000), block=st.sampled_from([1, 3, 64, 1024]), seed=st.integers(0, 2**32 - 1),
       start=st.floats(-50.0, 300.0), slope=st.one_of(st.just(0.0), st.floats(-1.0, 0.0)),
       discount=st.one_of(st.just(0.0), st.floats(0.0, 3.0)))
@example(size=0, block=64, seed=0, start=0.0, slope=0.0, discount=0.0)
@example(size=1, block=64, seed=0, start=0.0, slope=0.0, discount=0.0)
@example(size=2048, block=1024, seed=1, start=0.0, slope=0.0, discount=0.0)  # whole blocks only
@example(size=2439, block=1024, seed=1, start=51.0, slope=-0.875, discount=0.0)  # within-block factors subnormal
@example(size=3000, block=64, seed=2, start=300.0, slope=-0.5, discount=2.0)  # a window thousands wide
@example(size=3000, block=3, seed=3, start=-20.0, slope=0.0, discount=0.3)  # blocks far above left out
def test_suffix_reader_sums_what_lies_above_each_index(size, block, seed, start, slope, discount):
    tilted = np.random.default_rng(seed).exponential(size=size) ** 3  # (nonnegative, spread over decades)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pld_module, "_SUFFIX_BLOCK", block)
        read, _, lost = pld_module._suffix_reader(tilted, start, slope, discount)
    assert 0.0 < lost < 1e-300
    for i in sorted({0, block - 1, block, size // 3, size // 2, size - 2, size - 1} & set(range(size))):
        # each term discounted from i: e^{start + slope j - discount (j - i)}
        exact = math.fsum(_term(float(t), start + slope * j - discount * (j - i)) for j, t in enumerate(tilted)
                          if j > i)
        # the reader's own bound, and half a subnormal unit for each of the oracle's terms
        assert abs(read(i) - exact) <= 1e-12 * exact + lost + 2.0**-1075 * size, (read(i), exact)


def _term(mass: float, exponent: float) -> float:
    """``mass e^exponent``, rounded once where it is subnormal (an exponential that is
    itself subnormal keeps a few bits, which ``mass`` would then scale)."""
    if exponent > -700.0:
        return mass * math.exp(exponent)
    return mass * math.exp(exponent + 700.0) * math.exp(-700.0)


def _gaussian_profile(mu: float, spacing: float, tilt: float):
    """The privacy loss of a Gaussian mechanism (normal, mean mu, variance 2 mu) on a grid
    of ``spacing``, as ``_invert_profile`` takes it: the masses tilted by ``e^{tilt l}``
    and normalised (as a transform returns them), with the untilting exponents."""
    low, high = mu - 12.0 * math.sqrt(2.0 * mu), mu + 12.0 * math.sqrt(2.0 * mu)
    losses = np.arange(math.floor(low / spacing), math.ceil(high / spacing) + 1) * spacing
    log_masses = -0.5 * (losses - mu) ** 2 / (2.0 * mu)
    log_masses -= np.logaddexp.reduce(log_masses)
    log_tilted = log_masses + tilt * losses
    cumulant = float(np.logaddexp.reduce(log_tilted))
    return np.exp(log_tilted - cumulant), cumulant - tilt * losses, losses, np.exp(log_masses)


def _discrete_epsilon(masses: np.ndarray, losses: np.ndarray, delta: float) -> float:
    """The smallest epsilon >= 0 with sum of m_k (1 - e^{eps - l_k})_+ <= delta, summed
    exactly (``math.fsum``) and bisected to the last bit in the crossing's bin."""
    def profile(epsilon: float) -> float:
        above = losses > epsilon
        return math.fsum(masses[above] * -np.expm1(epsilon - losses[above]))

    if profile(0.0) <= delta:
        return 0.0
    k = int(np.argmax([profile(float(loss)) <= delta for loss in losses]))  # first grid point certified
    low, high = max(float(losses[k - 1]), 0.0), float(losses[k])
    while high > np.nextafter(low, math.inf):
        middle = 0.5 * (low + high)
        low, high = (low, middle) if profile(middle) <= delta else (middle, high)
    return high


@settings(max_examples=30, deadline=None)
@given(mu=st.one_of(st.floats(0.05, 3.0), st.floats(300.0, 3000.0)), points=st.integers(300, 4000),
       share=st.floats(0.0, 1.0), delta=st.one_of(st.floats(1e-10, 0.3), st.sampled_from([1e-20, 1e-40, 1e-150])),
       block=st.sampled_from([16, 1024]))
@example(mu=0.5, points=2000, share=0.25, delta=1e-6, block=16)
@example(mu=1000.0, points=3000, share=0.5, delta=1e-9, block=16)  # a window over 600 wide: every point summed
@example(mu=300.0, points=300, share=1.0, delta=1e-10, block=16)
@example(mu=300.0, points=200, share=0.8, delta=1e-20, block=1024)  # e^{-4.1 j} within a block: subnormal
@example(mu=200.0, points=300, share=0.8, delta=1e-150, block=1024)
def test_the_profile_is_read_at_or_above_the_discrete_epsilon(mu, points, share, delta, block):
    spacing = 24.0 * math.sqrt(2.0 * mu) / points
    tilt = share * min(8.0, 0.5 * math.sqrt(300.0 / mu))  # (every untilting exponent representable: at most 300)
    tilted, log_untilt, losses, masses = _gaussian_profile(mu, spacing, tilt)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pld_module, "_SUFFIX_BLOCK", block)
        answer, _ = pld_module._invert_profile(tilted, log_untilt, losses, 0.0, (0.0, 0.0), delta)
    exact = _discrete_epsilon(masses, losses, delta)
    # never below the distribution's own epsilon; above it by the rounding bounds alone
    assert exact <= answer <= exact * (1.0 + 1e-6) + 1e-12
