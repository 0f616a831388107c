"""Clip factors c_i = min(1, C / ||g_i||), 0 for a non-finite norm: the in-place
computation in dpoptim.privatize against the formula written out, bit for bit."""

import math

import torch
from hypothesis import given, strategies as st

from dpoptim.privatize import clip_factors

_SPECIAL = [0.0, -0.0, 1e-45, 1e-30, 0.25, 1.0, 4.0, 1e30, 3e38, math.inf, -math.inf, math.nan]


def _formula(squared, bound):
    return torch.where(torch.isfinite(squared), (bound / squared.sqrt()).clamp(max=1.0), torch.zeros_like(squared))


@given(
    values=st.lists(st.one_of(st.floats(min_value=0.0, allow_infinity=False, allow_nan=False),
                              st.sampled_from(_SPECIAL)), min_size=0, max_size=40),
    bound=st.floats(min_value=1e-6, max_value=1e6),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]),
)
def test_clip_factors_are_the_formula_bit_for_bit(values, bound, dtype):
    squared = torch.tensor(values, dtype=torch.float64).to(dtype)
    got, want = clip_factors(squared, bound), _formula(squared, bound)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got, want)
    # For a squared norm >= 0 (and not -0.0, which the rules' sums of squares do not give):
    # a factor in [0, 1], 0 for a non-finite norm, 1 for a norm within the bound.
    normal = ~torch.signbit(squared)
    finite = torch.isfinite(squared)
    assert not bool(got[normal].isnan().any())
    assert bool(((got[normal] >= 0) & (got[normal] <= 1)).all())
    assert bool((got[~finite] == 0).all())
    assert bool((got[normal & finite & (squared.double() <= bound * bound * 0.9)] == 1).all())


def test_clip_factors_leave_the_squared_norms_alone():
    squared = torch.tensor([0.0, 4.0, math.inf, math.nan])
    before = squared.clone()
    clip_factors(squared, 1.0)
    assert torch.equal(squared.nan_to_num(5.0), before.nan_to_num(5.0))
