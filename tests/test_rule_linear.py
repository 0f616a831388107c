"""nn.Linear against the brute-force oracle over drawn shapes."""

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

from oracle import check_rule_case, mse


@given(
    n=st.integers(0, 5),
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    d=st.integers(1, 6),
    p=st.integers(1, 6),
    bias=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
    clip=st.sampled_from([None, 1e6]),
)
def test_linear_matches_oracle(n, lead, d, p, bias, reduction, clip):
    g = torch.Generator().manual_seed(n * 31 + d)
    x = torch.randn(n, *lead, d, generator=g, dtype=torch.float64)
    y = torch.randn(n, *lead, p, generator=g, dtype=torch.float64)

    def make():
        return nn.Sequential(nn.Linear(d, 5), nn.Tanh(), nn.Linear(5, p, bias=bias)).double()

    check_rule_case(make, (x,), y, lambda m, x: m(x), mse, max_grad_norm=clip, reduction=reduction)


@pytest.mark.parametrize("rows, d, p", [(2, 8, 8), (3, 2, 3)], ids=["ghost", "materialised"])
def test_linear_over_sequences_matches_oracle_on_either_norm_route(rows, d, p):
    """The drawn shapes above rarely reach the ghost route (it needs rows (d + p) < d p):
    each route once, on purpose, so that a norm missing the cross terms between rows
    fails here and not only by chance."""
    from dpoptim import cost

    assert cost.ghost_is_cheaper(rows, d, p) == (rows == 2)
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(5, rows, d, generator=g, dtype=torch.float64)
    y = torch.randn(5, rows, p, generator=g, dtype=torch.float64)
    check_rule_case(lambda: nn.Linear(d, p).double(), (x,), y, lambda m, x: m(x), mse)


@given(splits=st.lists(st.integers(0, 3), min_size=1, max_size=4))
def test_linear_accumulation_equals_one_batch(splits):
    n = sum(splits)
    g = torch.Generator().manual_seed(len(splits))
    x = torch.randn(n, 3, 4, generator=g, dtype=torch.float64)
    y = torch.randn(n, 3, 2, generator=g, dtype=torch.float64)
    make = lambda: nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2)).double()
    check_rule_case(make, (x,), y, lambda m, x: m(x), mse, splits=splits)


def test_one_cost_rule_decides_every_norm_route():
    """The ghost-versus-materialise decision lives in dpoptim.cost alone: ghost when
    T^2 (d + p) < T d p, or when materialising n d p numbers would pass the limit."""
    from dpoptim import cost

    assert cost.ghost_is_cheaper(4, 64, 64) and not cost.ghost_is_cheaper(64, 4, 4)
    assert cost.ghost_is_cheaper(64, 4, 4, examples=cost.MATERIALIZE_LIMIT)
    assert cost.ghost_together_is_cheaper(16, 32, [32, 32]) and not cost.ghost_together_is_cheaper(16, 32, [32])
    assert cost.embedding_gram_is_cheaper(16, 64) and not cost.embedding_gram_is_cheaper(256, 1024)
