"""Modules that imitate or subclass stock layers, written as libraries write them (no
library needed): exact against the oracle with no rule registered, and refused with a
teaching error when they only look like one."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, strategies as st
from torch import nn

import dpoptim
from oracle import check_rule_case, mse


class Conv1D(nn.Module):
    """GPT-2's linear layer: weight [in, out], the batch flattened into one addmm."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.5)
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        size_out = x.size()[:-1] + (self.nf,)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


class LoggingLinear(nn.Linear):
    """A subclass that overrides forward but still computes nn.Linear's function."""

    calls = 0

    def forward(self, x):
        type(self).calls += 1
        return F.linear(x, self.weight, self.bias)


class MatmulNoBias(nn.Module):
    def __init__(self, d, k):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, k))

    def forward(self, x):
        return x @ self.weight


class LlamaStyleRMSNorm(nn.Module):
    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d) + 0.3 * torch.randn(d))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GemmaStyleRMSNorm(nn.Module):
    """Weight stored as an offset from one: ``x_hat * (1 + w)``."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(0.3 * torch.randn(d))

    def forward(self, x):
        output = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return output * (1.0 + self.weight)


class TimmLayerNorm(nn.LayerNorm):
    """timm's pattern: a subclass of nn.LayerNorm with its own forward."""

    def forward(self, x):
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class TimmLayerNorm2d(nn.LayerNorm):
    """LayerNorm over the channels of [n, C, H, W]."""

    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


def _perturbed(layer):
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return layer


D = 4
CASES = {
    "Conv1D": lambda: Conv1D(D, D),
    "Linear subclass, same function": lambda: LoggingLinear(D, D),
    "x @ weight": lambda: MatmulNoBias(D, D),
    "Llama RMSNorm": lambda: LlamaStyleRMSNorm(D),
    "Gemma RMSNorm": lambda: GemmaStyleRMSNorm(D),
    "timm LayerNorm": lambda: _perturbed(TimmLayerNorm(D)),
}


@given(case=st.sampled_from(sorted(CASES)), n=st.integers(0, 4), lead=st.integers(1, 3),
       reduction=st.sampled_from(["mean", "sum"]), clip=st.sampled_from([None, 1e6]))
def test_lookalikes_match_oracle(case, n, lead, reduction, clip):
    g = torch.Generator().manual_seed(n + 5 * lead)
    x = torch.randn(n, lead, D, generator=g, dtype=torch.float64)
    y = torch.randn(n, lead, 2, generator=g, dtype=torch.float64)

    def make():
        # the look-alike twice: the second call of one module shares its parameters' examples
        return nn.Sequential(nn.Linear(D, D), CASES[case](), nn.Tanh(), nn.Linear(D, 2)).double()

    check_rule_case(make, (x,), y, lambda m, x: m(x), mse, max_grad_norm=clip, reduction=reduction)


@pytest.mark.parametrize("n", [0, 1, 3])
def test_channels_first_layer_norm_matches_oracle(n):
    x = torch.randn(n, 2, 3, 3, dtype=torch.float64)
    y = torch.randn(n, 2, dtype=torch.float64)

    def make():
        return nn.Sequential(nn.Conv2d(2, 3, 1), _perturbed(TimmLayerNorm2d(3)), nn.Tanh(),
                             nn.Flatten(), nn.Linear(27, 2)).double()

    check_rule_case(make, (x,), y, lambda m, x: m(x), mse)


def test_conv1d_weight_tied_twice_matches_oracle():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.c = Conv1D(D, D)
            self.out = nn.Linear(D, 2)

        def forward(self, x):
            return self.out(torch.tanh(self.c(torch.tanh(self.c(x)))))

    x = torch.randn(3, 2, D, dtype=torch.float64)
    check_rule_case(lambda: Twice().double(), (x,), torch.randn(3, 2, 2, dtype=torch.float64),
                    lambda m, x: m(x), mse)


def test_linear_subclass_is_proved_not_trusted():
    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    model = nn.Sequential(nn.Linear(3, 3), Doubled(3, 2))
    opt = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=4, sample_rate=0.1)  # noqa: F841
    with pytest.raises(ValueError) as info:
        model(torch.randn(4, 3)).sum().backward()
    text = str(info.value)
    assert "`1` (test_lookalikes." in text and "Doubled)" in text  # where, and the full class name
    assert "differs from F.linear" in text  # why
    assert "overrides forward" in text
    assert "@dpoptim.register_rule(" in text  # the fix


def test_a_rule_registered_for_a_lookalike_wins():
    class Custom(Conv1D):
        pass

    seen = []

    @dpoptim.register_rule(Custom)
    class CustomRule(dpoptim.Rule):
        def per_example(self, use, names):
            seen.append(True)
            x, b = use.saved[0], use.grad_outputs[0]
            out = {}
            if "weight" in names:
                out["weight"] = torch.einsum("nti,nto->nio", x, b)
            if "bias" in names:
                out["bias"] = b.sum(1)
            return out

    x = torch.randn(3, 2, D, dtype=torch.float64)
    check_rule_case(lambda: nn.Sequential(Custom(D, D), nn.Tanh()).double(), (x,),
                    torch.randn(3, 2, D, dtype=torch.float64), lambda m, x: m(x), mse)
    assert seen


class ScaledEmbedding(nn.Embedding):
    """Gemma's and BART's word embedding: the lookup times a constant buffer."""

    def __init__(self, *args, scale=2.5, **kwargs):
        super().__init__(*args, **kwargs)
        self.register_buffer("embed_scale", torch.tensor(scale), persistent=False)

    def forward(self, ids):
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


class TiedScaled(nn.Module):
    def __init__(self, padding_idx):
        super().__init__()
        self.emb = ScaledEmbedding(6, D, padding_idx=padding_idx)
        self.out = nn.Linear(D, 6, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


@given(n=st.integers(0, 4), length=st.integers(1, 3), padding=st.sampled_from([None, 0]),
       reduction=st.sampled_from(["mean", "sum"]))
def test_scaled_embedding_subclass_matches_oracle(n, length, padding, reduction):
    g = torch.Generator().manual_seed(n * 3 + length)
    ids = torch.randint(0, 6, (n, length), generator=g)
    y = torch.randn(n, length, 6, generator=g, dtype=torch.float64)
    check_rule_case(lambda: TiedScaled(padding).double(), (ids,), y, lambda m, x: m(x), mse, reduction=reduction)


def test_embedding_subclass_that_is_not_a_scaled_lookup_is_refused():
    class Squared(nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) ** 2

    model = nn.Sequential(Squared(5, 3), nn.Linear(3, 1))
    opt = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=4, sample_rate=0.1)  # noqa: F841
    with torch.no_grad():
        model[0].weight.normal_()
    with pytest.raises(ValueError, match=r"`0` \(test_lookalikes\..*Squared\) is a subclass of nn.Embedding that "
                                         r"overrides forward.*not a constant times.*register_rule"):
        model(torch.randint(0, 5, (4, 2)))
