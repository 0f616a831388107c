"""Bare parameters used in a module's own forward, and lookups made once for the whole
batch, against the brute-force oracle; and the uses that must be refused."""

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

import dpoptim
from oracle import check_rule_case, mse

D, T = 3, 2

# Each use: (name, parameter shape, how the forward applies it to h [n, T, D]).
USES = {
    "add pos [1,T,D]": ((1, T, D), lambda h, p: h + p),
    "add pos [T,D]": ((T, D), lambda h, p: p + h),
    "mul scale [D]": ((D,), lambda h, p: h * p),
    "layer scale via reshape": ((D,), lambda h, p: h.mul(p.reshape(1, 1, D))),
    "temperature exp": ((), lambda h, p: h / p.exp()),
    "gemma 1 + w": ((D,), lambda h, p: (1.0 + p.float().double()) * h),
    "in-place add": ((D,), lambda h, p: h.clone().add_(p)),
    "sliced pos": ((1, T + 2, D), lambda h, p: h + p[:, 1:T + 1]),
    "transposed": ((D, 1), lambda h, p: h * p.t()),
    "where": ((D,), lambda h, p: torch.where(h > 0, h, p)),
    "cls token": ((1, 1, D), lambda h, p: torch.cat([p.expand(h.shape[0], -1, -1), h], 1)[:, 1:] + h),
    "functional layer_norm": ((D,), lambda h, p: nn.functional.layer_norm(h, (D,), p, p * 0.5)),
}


class Bare(nn.Module):
    """A Linear (ruled) feeding this module's own parameters, used as drawn."""

    def __init__(self, uses):
        super().__init__()
        self.lin = nn.Linear(D, D)
        self.uses = uses
        for i, name in enumerate(uses):
            shape, _ = USES[name]
            self.register_parameter(f"p{i}", nn.Parameter(torch.randn(shape) * 0.5 + 1.0))

    def forward(self, x):
        h = self.lin(x)
        for i, name in enumerate(self.uses):
            h = torch.tanh(USES[name][1](h, getattr(self, f"p{i}")))
        return h


@given(
    uses=st.lists(st.sampled_from(sorted(USES)), min_size=1, max_size=3),
    n=st.integers(0, 4),
    reduction=st.sampled_from(["mean", "sum"]),
    clip=st.sampled_from([None, 1e6]),
)
def test_bare_parameters_match_oracle(uses, n, reduction, clip):
    g = torch.Generator().manual_seed(n + 10 * len(uses))
    x = torch.randn(n, T, D, generator=g, dtype=torch.float64)
    y = torch.randn(n, T, D, generator=g, dtype=torch.float64)
    check_rule_case(lambda: Bare(uses).double(), (x,), y, lambda m, x: m(x), mse,
                    max_grad_norm=clip, reduction=reduction, splits=[n // 2, n - n // 2] if n > 1 else None)


class Nested(nn.Module):
    """A module with its own parameters around children that have theirs (a ViT around
    its blocks, a block around its layer scale)."""

    def __init__(self):
        super().__init__()
        self.pos = nn.Parameter(torch.randn(1, T, D))
        self.inner = Bare(["mul scale [D]", "add pos [T,D]"])
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        return self.norm(self.inner(x + self.pos) * self.pos)


@pytest.mark.parametrize("n", [1, 3])
def test_nested_modules_with_bare_parameters(n):
    x = torch.randn(n, T, D, dtype=torch.float64)
    check_rule_case(lambda: Nested().double(), (x,), torch.randn(n, T, D, dtype=torch.float64),
                    lambda m, x: m(x), mse)


class Positions(nn.Module):
    """Hugging Face's pattern: position ids of shape [1, T] shared by the whole batch."""

    def __init__(self, tied=False):
        super().__init__()
        self.tok = nn.Embedding(7, D)
        self.pos = nn.Embedding(5, D)
        self.out = nn.Linear(D, 7)
        if tied:
            self.out.weight = self.tok.weight

    def forward(self, ids):
        position_ids = torch.arange(ids.shape[1]).unsqueeze(0)
        h = self.tok(ids) + self.pos(position_ids).to(ids.device)
        return self.out(torch.tanh(h))


@given(n=st.integers(0, 4), length=st.integers(1, 4), tied=st.booleans(), reduction=st.sampled_from(["mean", "sum"]))
def test_broadcast_position_ids_match_oracle(n, length, tied, reduction):
    g = torch.Generator().manual_seed(n * 5 + length)
    ids = torch.randint(0, 7, (n, length), generator=g)
    y = torch.randn(n, length, 7, generator=g, dtype=torch.float64)
    check_rule_case(lambda: Positions(tied).double(), (ids,), y, lambda m, x: m(x), mse, reduction=reduction)


def _opt(model):
    return dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=0.0, max_grad_norm=1.0,
                         expected_batch_size=4, sample_rate=0.1)


class Mixer(nn.Module):
    """A parameter applied across the batch axis: example i's output reads every example."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return self.mix @ x


class SpansBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.rows = nn.Parameter(torch.randn(4, D))

    def forward(self, x):
        return x + self.rows  # [4, D] against [4, D]: row i would belong to example i


class Leaks(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D))

    def forward(self):
        return self.scale.exp()


class UsesLeak(nn.Module):
    def __init__(self):
        super().__init__()
        self.source = Leaks()

    def forward(self, x):
        return x * self.source()


@pytest.mark.parametrize("make, message", [
    (lambda: nn.Sequential(nn.Linear(D, D), Mixer()), r"'mix' of `1` \(test_bare_parameters.Mixer\) meets the batch in `matmul`"),
    (lambda: nn.Sequential(nn.Linear(D, D), SpansBatch()), r"'rows' of `1` .*lies on the batch axis"),
    (lambda: UsesLeak(), r"`source` \(test_bare_parameters.Leaks\) returns a tensor computed from its own parameter"),
], ids=["mixes examples", "spans the batch axis", "leaves its module"])
def test_uses_that_cannot_be_split_are_refused(make, message):
    model = make().double()
    opt = _opt(model)  # noqa: F841 (its engine lives as long as it does)
    with pytest.raises(ValueError, match=message):
        model(torch.randn(4, D, dtype=torch.float64)).sum().backward()


def test_frozen_bare_parameters_need_nothing():
    model = Bare(["add pos [1,T,D]"]).double()
    model.p0.requires_grad_(False)
    opt = _opt(model)
    model(torch.randn(3, T, D, dtype=torch.float64)).sum().backward()
    opt.step()
    assert model.p0.grad is None


def test_without_gradients_the_forward_is_untouched():
    model = Mixer()
    opt = _opt(model)  # noqa: F841
    with torch.no_grad():
        out = model(torch.randn(4, 2))
    assert out.shape == (4, 2)


def test_position_lookup_used_other_than_elementwise_with_a_batch_is_refused():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.pos = nn.Embedding(5, D)
            self.lin = nn.Linear(D, D)

        def forward(self, x):
            p = self.pos(torch.arange(x.shape[1]).unsqueeze(0))  # [1, T, D], one lookup for the batch
            return x + p + self.lin(p)  # broadcast once, and once read as a batch of one

    model = Odd().double()
    opt = _opt(model)
    with pytest.raises(Exception, match=r"the output of `pos` \(torch.nn.Embedding\).*Expand the indices"):
        model(torch.randn(3, T, D, dtype=torch.float64)).sum().backward()
        opt.step()


class WithTable(nn.Module):
    """A buffer whose first dim happens to equal the batch size: it carries no examples."""

    def __init__(self):
        super().__init__()
        self.register_buffer("table", torch.randn(4, D))
        self.scale = nn.Parameter(torch.randn(D))

    def forward(self, x):
        return x + (self.scale * self.table).mean(0)


def test_buffer_the_size_of_the_batch_is_not_taken_for_the_batch():
    x = torch.randn(4, D, dtype=torch.float64)
    check_rule_case(lambda: nn.Sequential(nn.Linear(D, D), WithTable(), nn.Tanh()).double(), (x,),
                    torch.randn(4, D, dtype=torch.float64), lambda m, x: m(x), mse)
