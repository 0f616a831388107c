"""nn.Conv1d/2d/3d against the brute-force oracle over drawn shapes and options."""

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import dpoptim
import dpoptim.cost
import dpoptim.rules.conv as conv_rule
from oracle import assert_trains_with_noise, check_rule_case, mse

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}


def head(conv, example_shape):
    """conv -> tanh -> Linear, so the clipping norm spans two layers."""
    with torch.no_grad():
        features = conv(torch.zeros(1, *example_shape, dtype=torch.float64)).numel()
    return nn.Sequential(conv, nn.Tanh(), nn.Flatten(), nn.Linear(features, 2).double())


@st.composite
def conv_cases(draw):
    dims = draw(st.integers(1, 3))
    groups = draw(st.sampled_from([1, 2]))
    c_in, c_out = groups * draw(st.integers(1, 2)), groups * draw(st.integers(1, 3))
    kernel = tuple(draw(st.integers(1, 4 if dims < 3 else 3)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    mode = draw(st.sampled_from(["zeros", "reflect", "replicate", "circular"]))
    kind = draw(st.sampled_from(["int", "tuple", "valid", "same"]))
    if kind == "same":  # torch allows 'same' only with stride 1
        stride = (1,) * dims
        totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
        pads = [(t // 2, t - t // 2) for t in totals]
        padding = "same"
    else:
        stride = tuple(draw(st.integers(1, 3)) for _ in range(dims))
        if kind == "valid":
            per_dim, padding = [0] * dims, "valid"
        elif kind == "int":
            padding = draw(st.integers(0, 2))
            per_dim = [padding] * dims
        else:
            per_dim = [draw(st.integers(0, 2)) for _ in range(dims)]
            padding = tuple(per_dim)
        pads = [(q, q) for q in per_dim]
    sizes = []
    for (left, right), k, d in zip(pads, kernel, dilation):
        smallest = max(1, d * (k - 1) + 1 - left - right)
        if mode == "reflect":  # reflection needs each pad below the size
            smallest = max(smallest, max(left, right) + 1)
        if mode == "circular":
            smallest = max(smallest, left, right)
        sizes.append(draw(st.integers(smallest, smallest + (2 if dims == 3 else 3))))
    options = dict(
        kernel_size=kernel, stride=stride, padding=padding, dilation=dilation, groups=groups,
        bias=draw(st.booleans()), padding_mode=mode,
    )
    # int arguments take another parsing path in torch; exercise it where it is exact
    if len(set(stride)) == 1 and draw(st.booleans()):
        options["stride"] = stride[0]
    return CONV[dims], c_in, c_out, options, tuple(sizes)


@given(
    case=conv_cases(),
    n=st.integers(0, 4),
    reduction=st.sampled_from(["mean", "sum"]),
    clip=st.sampled_from([None, 1e6]),
)
def test_conv_matches_oracle(case, n, reduction, clip):
    cls, c_in, c_out, options, sizes = case
    g = torch.Generator().manual_seed(n * 131 + sum(sizes))
    x = torch.randn(n, c_in, *sizes, generator=g, dtype=torch.float64)
    y = torch.randn(n, 2, generator=g, dtype=torch.float64)

    def make():
        return head(cls(c_in, c_out, **options).double(), (c_in, *sizes))

    check_rule_case(make, (x,), y, lambda m, x: m(x), mse, max_grad_norm=clip, reduction=reduction)


@pytest.mark.parametrize("ghost", [True, False], ids=["ghost", "materialized"])
@pytest.mark.parametrize("groups", [1, 3])
@pytest.mark.parametrize("chunk_bytes", [conv_rule.CHUNK_BYTES, 1])
def test_both_norm_routes_match_oracle(monkeypatch, ghost, groups, chunk_bytes):
    # The cost model picks one route per shape; force each so both are always covered,
    # with the batch in one chunk and one example per chunk.
    monkeypatch.setattr(dpoptim.cost, "ghost_is_cheaper", lambda *shape, **kw: ghost)
    monkeypatch.setattr(conv_rule, "CHUNK_BYTES", chunk_bytes)
    g = torch.Generator().manual_seed(groups)
    x = torch.randn(5, 6, 7, 6, generator=g, dtype=torch.float64)
    y = torch.randn(5, 2, generator=g, dtype=torch.float64)
    make = lambda: head(nn.Conv2d(6, 3 * groups, (3, 2), stride=(2, 1), padding=1, groups=groups).double(), (6, 7, 6))
    check_rule_case(make, (x,), y, lambda m, x: m(x), mse)


@settings(max_examples=10)  # the engine's part, already drawn widely in test_rule_linear
@given(splits=st.lists(st.integers(0, 3), min_size=1, max_size=3))
def test_conv_accumulation_equals_one_batch(splits):
    g = torch.Generator().manual_seed(len(splits))
    x = torch.randn(sum(splits), 2, 5, 5, generator=g, dtype=torch.float64)
    y = torch.randn(sum(splits), 2, generator=g, dtype=torch.float64)
    make = lambda: head(nn.Conv2d(2, 4, 3, padding="same", groups=2).double(), (2, 5, 5))
    check_rule_case(make, (x,), y, lambda m, x: m(x), mse, splits=splits)


def test_shared_conv_called_twice_matches_oracle():
    # A module called twice in one forward: per-example gradients add up before the norm.
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv1d(3, 3, 3, padding="same", padding_mode="circular")
            self.out = nn.Linear(3 * 8, 2)

        def forward(self, x):
            return self.out(torch.tanh(self.conv(torch.tanh(self.conv(x)))).flatten(1))

    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, 3, 8, generator=g, dtype=torch.float64)
    y = torch.randn(4, 2, generator=g, dtype=torch.float64)
    check_rule_case(lambda: Twice().double(), (x,), y, lambda m, x: m(x), mse)


def test_unbatched_input_is_refused():
    conv = nn.Conv2d(2, 3, 3)
    opt = dpoptim.DPSGD(conv.parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0,  # noqa: F841
                        expected_batch_size=4, sample_rate=0.1)  # its engine lives as long as it does
    with pytest.raises(ValueError, match="Conv2d got an unbatched input"):
        conv(torch.randn(2, 5, 5))


class _MixedConvNet(nn.Module):
    """Conv3d -> Conv2d -> Conv1d -> Linear, so all three dimensionalities clip together."""

    def __init__(self):
        super().__init__()
        self.c3 = nn.Conv3d(1, 2, (2, 3, 3), padding=(0, 1, 1), padding_mode="replicate")
        self.c2 = nn.Conv2d(2, 4, 3, stride=2, padding="valid", bias=False)
        self.c1 = nn.Conv1d(4, 4, 2, padding="same", dilation=2, groups=2, padding_mode="circular")
        self.out = nn.Linear(4 * 9, 2)

    def forward(self, x):  # x: [n, 1, 2, 8, 8]
        h = torch.relu(self.c3(x)).squeeze(2)  # [n, 2, 8, 8]
        h = torch.relu(self.c2(h)).flatten(2)  # [n, 4, 9]
        return self.out(torch.relu(self.c1(h)).flatten(1))


@pytest.mark.filterwarnings("ignore::dpoptim.PrivacyWarning")  # fixed-size batches here
def test_conv_model_trains_with_noise():
    torch.manual_seed(0)
    x = torch.randn(32, 1, 2, 8, 8)
    y = (x.mean((1, 2, 3, 4)) > 0).long()
    model = _MixedConvNet()
    assert_trains_with_noise(model, x, y, lr=2.0)


class _TwoConvs(nn.Module):
    """conv -> GroupNorm -> tanh -> conv -> Linear: the second conv's input leads back to
    attached parameters, so after the first step it may detach all its parameters."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(2, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.c2 = nn.Conv2d(4, 3, 3, stride=2)
        self.out = nn.Linear(3 * 2 * 2, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.c2(torch.tanh(self.norm(self.c1(x))))).flatten(1))


@pytest.mark.parametrize("input_grad", [False, True])
def test_convs_detached_entirely_stay_exact(input_grad):
    g = torch.Generator().manual_seed(21)
    x = torch.randn(5, 2, 6, 6, generator=g, dtype=torch.float64).requires_grad_(input_grad)
    y = torch.randn(5, 2, generator=g, dtype=torch.float64)
    check_rule_case(lambda: _TwoConvs().double(), (x,), y, lambda m, x: m(x), mse)


def test_only_convs_whose_input_leads_to_an_attached_parameter_detach_everything():
    model = _TwoConvs()
    opt = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=4, sample_rate=0.1)
    x = torch.randn(4, 2, 6, 6)
    for _ in range(2):  # the first step is checked against autograd with nothing detached
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    ghosts = opt._engine._ghosts
    assert {id(model.c2.weight), id(model.c2.bias)} <= ghosts  # its input reaches c1's bias / the norm
    assert id(model.c1.weight) in ghosts and id(model.c1.bias) not in ghosts  # the data has no graph
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("ghost", [True, False], ids=["ghost", "materialized"])
def test_cuda_convs_match_oracle(monkeypatch, ghost):
    """Chunked patches, the conv kernel's clipped sum and detach_all on the GPU."""
    monkeypatch.setattr(dpoptim.cost, "ghost_is_cheaper", lambda *shape, **kw: ghost)
    monkeypatch.setattr(conv_rule, "CHUNK_BYTES", 512)
    g = torch.Generator().manual_seed(22)
    cuda = torch.device("cuda")
    x = torch.randn(5, 2, 6, 6, generator=g, dtype=torch.float64).to(cuda)
    y = torch.randn(5, 2, generator=g, dtype=torch.float64).to(cuda)
    check_rule_case(lambda: _TwoConvs().double().to(cuda), (x,), y, lambda m, x: m(x), mse)


def test_conv_detached_in_one_call_and_kept_in_another():
    """A bias-free conv called on features (detached entirely: its input leads to the
    Linear's parameters) and on the raw input (its weight must stay attached there): the
    weight accumulates through the second call, which is no use elsewhere. Found by fuzzing."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.conv = nn.Conv2d(1, 1, 1, bias=False)

        def forward(self, x):
            features = self.lin(x).view(-1, 1, 2, 2)
            return (self.conv(features) + self.conv(x.view(-1, 1, 2, 2))).flatten(1)

    g = torch.Generator().manual_seed(30)
    x = torch.randn(3, 4, generator=g, dtype=torch.float64)
    y = torch.randn(3, 4, generator=g, dtype=torch.float64)
    check_rule_case(lambda: Model().double(), (x,), y, lambda m, x: m(x), mse)
