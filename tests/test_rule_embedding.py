"""nn.Embedding against the brute-force oracle over drawn shapes and options."""

import math
import warnings
from unittest import mock

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

import dpoptim
import dpoptim.cost
from dpoptim.rules import embedding
from oracle import assert_trains_with_noise, check_rule_case, mse


@given(
    n=st.integers(0, 4),
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    rows=st.integers(1, 6),
    dim=st.integers(1, 4),
    padding=st.one_of(st.none(), st.integers(-6, 5)),
    sparse=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
    clip=st.sampled_from([None, 1e6]),
    ghost=st.booleans(),
)
def test_embedding_matches_oracle(n, lead, rows, dim, padding, sparse, reduction, clip, ghost):
    """Both norm routes: the masked Gram matrix (ghost) and sorting."""
    padding_idx = None if padding is None else padding % rows - (rows if padding < 0 else 0)
    g = torch.Generator().manual_seed(n * 17 + rows * 5 + dim)
    # Few rows, so repeated indices (and padding positions) are common.
    x = torch.randint(0, rows, (n, *lead), generator=g)
    y = torch.randn(n, 2, generator=g, dtype=torch.float64)
    positions = math.prod(lead)

    def make():
        emb = nn.Embedding(rows, dim, padding_idx=padding_idx, sparse=sparse).double()
        return nn.Sequential(emb, nn.Tanh(), nn.Flatten(1), nn.Linear(positions * dim, 2).double())

    route = mock.patch.object(dpoptim.cost, "embedding_gram_is_cheaper", lambda T, p: ghost)
    with warnings.catch_warnings(), route:
        warnings.simplefilter("ignore", dpoptim.PrivacyWarning)  # eval-mode and loader warnings
        check_rule_case(make, (x,), y, lambda m, x: m(x), mse, max_grad_norm=clip, reduction=reduction)


@given(
    n=st.integers(0, 5),
    T=st.integers(2, 12),
    rows=st.integers(1, 6),
    dim=st.integers(1, 5),
    padding=st.booleans(),
    ghost=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_embedding_norm_routes_match_the_materialised_gradient(n, T, rows, dim, padding, ghost, seed):
    """Both norm routes against the squared norm of the per-example gradient formed row by
    row, over index tensors full of repeats (where the routes' cross terms matter)."""
    g = torch.Generator().manual_seed(seed)
    emb = nn.Embedding(rows, dim, padding_idx=0 if padding else None).double()
    indices = torch.randint(0, rows, (n, T), generator=g)
    use = dpoptim.Use(emb, indices, [torch.randn(n, T, dim, generator=g, dtype=torch.float64)])
    rule = dpoptim.rule_for(emb)
    with mock.patch.object(dpoptim.cost, "embedding_gram_is_cheaper", lambda T, p: ghost):
        got = rule.norms(use, ["weight"])["weight"]
    expected = rule.per_example(use, ["weight"])["weight"].square().sum((1, 2))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


class TiedLM(nn.Module):
    """Embedding and output layer share one weight: two rules contribute to one parameter."""

    def __init__(self, rows=5, dim=3, padding_idx=0):
        super().__init__()
        self.emb = nn.Embedding(rows, dim, padding_idx=padding_idx)
        self.mix = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, rows, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(torch.tanh(self.mix(self.emb(x))))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_tied_embedding_matches_oracle(reduction):
    g = torch.Generator().manual_seed(7)
    x = torch.randint(0, 5, (4, 6), generator=g)
    y = torch.randn(4, 6, 5, generator=g, dtype=torch.float64)
    check_rule_case(lambda: TiedLM().double(), (x,), y, lambda m, x: m(x), mse, reduction=reduction)


def _optimizer(module):
    return dpoptim.DPSGD(module.parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0,
                         expected_batch_size=4, sample_rate=0.1)


def test_scale_grad_by_freq_is_refused_at_forward():
    emb = nn.Embedding(5, 3, scale_grad_by_freq=True)
    opt = _optimizer(emb)  # noqa: F841 (its engine lives as long as it does)
    with pytest.raises(ValueError, match=r"Embedding\(5, 3, scale_grad_by_freq=True\).*scale_grad_by_freq=False"):
        emb(torch.tensor([[1, 2, 2]]))


@pytest.mark.parametrize("make", [lambda: nn.Embedding(5, 3, max_norm=1.0), lambda: nn.EmbeddingBag(5, 3, max_norm=1.0)])
def test_max_norm_is_refused_because_it_renormalises_the_batch_rows(make):
    emb = make()
    before = emb.weight.detach().clone()
    opt = _optimizer(emb)  # noqa: F841
    with pytest.raises(ValueError, match="max_norm=None"):
        emb(torch.tensor([[1, 2]]))
    assert torch.equal(emb.weight, before)


@pytest.mark.parametrize("bag", [False, True])
def test_max_norm_is_refused_on_a_frozen_table_too(bag):
    """A frozen table with max_norm still renormalises the rows the batch looks up, in place:
    its weights would reveal which indices were there. Refused before they change."""
    table = nn.EmbeddingBag(5, 3, max_norm=0.1) if bag else nn.Embedding(5, 3, max_norm=0.1)
    table.requires_grad_(False)
    model = nn.Sequential(table, nn.Linear(3, 1)) if bag else nn.Sequential(table, nn.Flatten(), nn.Linear(6, 1))
    opt = dpoptim.DPSGD([p for p in model.parameters() if p.requires_grad], lr=0.1, noise_multiplier=1.0,
                        max_grad_norm=1.0, expected_batch_size=2, sample_rate=0.1)
    before = table.weight.detach().clone()
    opt.zero_grad()
    with pytest.raises(ValueError, match="max_norm=None"):
        model(torch.tensor([[0, 1], [2, 3]]))
    assert torch.equal(table.weight, before)


def test_unbatched_index_is_refused():
    emb = nn.Embedding(5, 3)
    opt = _optimizer(emb)  # noqa: F841
    with pytest.raises(ValueError, match="unbatched"):
        emb(torch.tensor(1))


def test_padding_row_gets_nothing():
    # Noise off: the padding row must not move at all, even with every example using it.
    emb = nn.Embedding(4, 2, padding_idx=3)
    model = nn.Sequential(emb, nn.Flatten(1), nn.Linear(6, 1))
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=0.0, max_grad_norm=0.1,
                        expected_batch_size=3, sample_rate=0.1)
    before = emb.weight.detach().clone()
    model(torch.tensor([[3, 1, 3], [0, 3, 3], [3, 3, 3]])).sum().backward()
    opt.step()
    assert torch.equal(emb.weight[3], before[3])
    assert not torch.equal(emb.weight[:3], before[:3])


class _Bag(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8, padding_idx=0, sparse=True)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.emb(x)).mean(1))


@pytest.mark.filterwarnings("ignore::dpoptim.PrivacyWarning")  # fixed-size batches here
def test_embedding_model_trains_with_noise():
    torch.manual_seed(0)
    x = torch.randint(0, 20, (32, 6))
    y = (x >= 10).sum(1).gt(3).long()
    model = _Bag()
    assert_trains_with_noise(model, x, y, lr=2.0)


class BagModel(nn.Module):
    """EmbeddingBag -> tanh -> Linear, fed either a 2-D batch of equal-length bags or, from
    the same padded batch, a flat 1-D input with offsets (ragged bags, some empty)."""

    def __init__(self, rows, dim, offsets, include_last, **options):
        super().__init__()
        self.bag = nn.EmbeddingBag(rows, dim, include_last_offset=include_last, **options)
        self.head = nn.Linear(dim, 2)
        self.offsets = offsets

    def forward(self, x, lengths, weights):
        with_weights = self.bag.mode == "sum" and weights is not None
        if not self.offsets:
            return self.head(torch.tanh(self.bag(x, per_sample_weights=weights if with_weights else None)))
        keep = torch.arange(x.shape[1]) < lengths.unsqueeze(1)
        ends = lengths.cumsum(0)
        # one offset per bag (plus the end with include_last_offset): none for an empty batch
        starts = torch.cat([ends.new_zeros(1), ends])[: len(lengths) + self.bag.include_last_offset]
        out = self.bag(x[keep], starts, per_sample_weights=weights[keep] if with_weights else None)
        return self.head(torch.tanh(out))


@given(
    n=st.integers(0, 4),
    length=st.integers(1, 4),
    rows=st.integers(1, 6),
    dim=st.integers(1, 4),
    mode=st.sampled_from(["sum", "mean", "max"]),
    padding=st.one_of(st.none(), st.integers(0, 5)),
    offsets=st.booleans(),
    include_last=st.booleans(),
    weighted=st.booleans(),
    sparse=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
    clip=st.sampled_from([None, 1e6]),
)
def test_embedding_bag_matches_oracle(n, length, rows, dim, mode, padding, offsets, include_last, weighted,
                                      sparse, reduction, clip):
    g = torch.Generator().manual_seed(n * 19 + rows * 3 + length)
    x = torch.randint(0, rows, (n, length), generator=g)
    lengths = torch.randint(0, length + 1, (n,), generator=g) if offsets else torch.full((n,), length)
    weights = torch.randn(n, length, generator=g, dtype=torch.float64) if weighted else torch.ones(n, length, dtype=torch.float64)
    y = torch.randn(n, 2, generator=g, dtype=torch.float64)
    options = dict(mode=mode, padding_idx=None if padding is None else padding % rows,
                   sparse=sparse and mode != "max")  # torch has no sparse gradient for 'max'

    def make():
        model = BagModel(rows, dim, offsets, include_last and offsets, **options).double()
        return model

    def forward(model, x, lengths, weights):
        return model(x, lengths, weights if weighted else None)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpoptim.PrivacyWarning)
        check_rule_case(make, (x, lengths, weights), y, forward, mse, max_grad_norm=clip, reduction=reduction)


def test_embedding_bag_scale_grad_by_freq_is_refused():
    bag = nn.EmbeddingBag(5, 3, scale_grad_by_freq=True)
    opt = _optimizer(bag)  # noqa: F841
    with pytest.raises(ValueError, match="scale_grad_by_freq=False"):
        bag(torch.tensor([[1, 2, 2]]))


class TiedBag(nn.Module):
    """EmbeddingBag whose weight is also the output layer's: exercises per_example."""

    def __init__(self, mode):
        super().__init__()
        self.bag = nn.EmbeddingBag(6, 3, mode=mode, padding_idx=2)
        self.out = nn.Linear(3, 6, bias=False)
        self.out.weight = self.bag.weight

    def forward(self, x, lengths):
        keep = torch.arange(x.shape[1]) < lengths.unsqueeze(1)
        starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
        return self.out(torch.tanh(self.bag(x[keep], starts)))


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_tied_embedding_bag_matches_oracle(mode):
    g = torch.Generator().manual_seed(11)
    x = torch.randint(0, 6, (5, 4), generator=g)
    lengths = torch.tensor([4, 0, 2, 3, 1])
    y = torch.randn(5, 6, generator=g, dtype=torch.float64)
    check_rule_case(lambda: TiedBag(mode).double(), (x, lengths), y, lambda m, x, lengths: m(x, lengths), mse)
