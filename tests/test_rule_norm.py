"""Normalization layers against the brute-force oracle, driven by one table of cases."""

import math
import warnings

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

import dpoptim
from oracle import assert_trains_with_noise, check_rule_case, mse


# Each case draws (layer factory, shape of one example). Factories must be deterministic:
# the oracle builds the model twice.
def _layer_norm(draw):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    if math.prod(shape) == 1:
        # One element normalises to exactly 0, so the weight's true gradient is 0 and the
        # engine's first-step check would compare roundoff with roundoff.
        shape = (2,)
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=1)))
    bias = draw(st.booleans())
    eps = draw(st.sampled_from([1e-5, 0.1]))
    return lambda: nn.LayerNorm(shape, eps=eps, bias=bias), lead + shape


def _rms_norm(draw):
    shape = tuple(draw(st.lists(st.integers(1, 4), min_size=1, max_size=2)))
    lead = tuple(draw(st.lists(st.integers(1, 3), max_size=1)))
    eps = draw(st.sampled_from([None, 1e-3]))
    return lambda: nn.RMSNorm(shape, eps=eps), lead + shape


def _group_norm(draw):
    groups = draw(st.integers(1, 3))
    channels = groups * draw(st.integers(1, 2))
    spatial = tuple(draw(st.lists(st.integers(1, 3), max_size=2)))
    if channels // groups * math.prod(spatial) == 1:
        spatial = (2,)  # torch refuses groups of a single value
    return lambda: nn.GroupNorm(groups, channels, eps=1e-5), (channels, *spatial)


def _instance_norm(draw):
    dims = draw(st.integers(1, 3))
    cls = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)[dims - 1]
    channels = draw(st.integers(1, 3))
    # Instance statistics need more than one position (torch refuses a single one in training).
    spatial = tuple(draw(st.integers(2, 3)) for _ in range(dims))
    running = draw(st.booleans())
    # Training while tracking running statistics is refused (tested below).
    train = draw(st.booleans()) and not running

    def make():
        layer = cls(channels, affine=True, track_running_stats=running)
        return layer.train(train)

    return make, (channels, *spatial)


def _batch_norm(draw):
    dims = draw(st.integers(0, 3))  # 0: BatchNorm1d on [C], 1: BatchNorm1d on [C, L]
    cls = (nn.BatchNorm1d, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d)[dims]
    channels = draw(st.integers(1, 3))
    spatial = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    # Only eval mode with running statistics has per-example gradients.
    return lambda: cls(channels).eval(), (channels, *spatial)


CASES = {
    "LayerNorm": _layer_norm,
    "RMSNorm": _rms_norm,
    "GroupNorm": _group_norm,
    "InstanceNorm": _instance_norm,
    "BatchNorm(eval)": _batch_norm,
}


def in_model(make_layer, example_shape):
    """layer -> tanh -> Linear, with the layer's parameters and running statistics moved
    away from their defaults so every term of x_hat matters."""

    def make():
        layer = make_layer().double()
        with torch.no_grad():
            for p in layer.parameters():
                p.add_(0.5 * torch.randn_like(p))
            if getattr(layer, "running_mean", None) is not None:
                layer.running_mean.normal_()
                layer.running_var.uniform_(0.5, 2.0)
        head = nn.Linear(math.prod(example_shape), 2).double()
        return nn.Sequential(layer, nn.Tanh(), nn.Flatten(), head)

    return make


@given(
    data=st.data(),
    case=st.sampled_from(sorted(CASES)),
    n=st.integers(0, 4),
    reduction=st.sampled_from(["mean", "sum"]),
    clip=st.sampled_from([None, 1e6]),
)
def test_norm_matches_oracle(data, case, n, reduction, clip):
    make_layer, shape = CASES[case](data.draw)
    if n == 0 and case == "InstanceNorm":
        n = 1  # torch's instance_norm indexes the first example and fails on an empty batch
    g = torch.Generator().manual_seed(n * 7 + math.prod(shape))
    x = 1.5 * torch.randn(n, *shape, generator=g, dtype=torch.float64) + 0.5
    y = torch.randn(n, 2, generator=g, dtype=torch.float64)
    with warnings.catch_warnings():
        # the engine warns about eval-mode layers
        warnings.simplefilter("ignore")
        check_rule_case(in_model(make_layer, shape), (x,), y, lambda m, x: m(x), mse,
                        max_grad_norm=clip, reduction=reduction)


def _optimizer(module, **kw):
    return dpoptim.DPSGD(module.parameters(), lr=0.1, noise_multiplier=0.0, max_grad_norm=1.0,
                         expected_batch_size=4, sample_rate=0.1, **kw)


@pytest.mark.parametrize("make", [
    lambda: nn.BatchNorm2d(3),
    lambda: nn.BatchNorm2d(3, track_running_stats=False).eval(),
], ids=["training", "no-running-stats"])
def test_batchnorm_with_batch_statistics_is_reported_not_crashed(make):
    # The engine refuses it; the rule must not add a crash of its own on top.
    model = nn.Sequential(make(), nn.Flatten(), nn.Linear(12, 1))
    opt = _optimizer(model)
    model(torch.randn(4, 3, 2, 2)).sum().backward()
    with pytest.raises(dpoptim.UnsupportedLayerError) as info:
        opt.step()
    assert "batch statistics" in str(info.value)
    assert "clipping failed" not in str(info.value)


@pytest.mark.parametrize("layer, x", [
    (nn.InstanceNorm1d(3, affine=True), torch.randn(3, 4)),
    (nn.LayerNorm((2, 4)), torch.randn(2, 4)),
], ids=["InstanceNorm1d", "LayerNorm"])
def test_unbatched_input_is_refused(layer, x):
    opt = _optimizer(layer)  # noqa: F841 (its engine lives as long as it does)
    with pytest.raises(ValueError, match="unbatched"):
        layer(x)


def test_instance_norm_tracking_running_stats_is_refused_in_training():
    layer = nn.InstanceNorm1d(3, affine=True, track_running_stats=True)
    opt = _optimizer(layer)  # noqa: F841
    before = layer.running_mean.clone()
    with pytest.raises(ValueError, match="running statistics.*track_running_stats=False"):
        layer(torch.randn(2, 3, 4))
    assert torch.equal(layer.running_mean, before)


@pytest.mark.parametrize("affine, frozen", [(False, False), (True, True)])
def test_instance_norm_tracking_running_stats_is_refused_even_with_nothing_to_train(affine, frozen):
    """Its running statistics are updated from the batch whether or not its own parameters
    train, and they are published with the model: refused before the forward changes them."""
    norm = nn.InstanceNorm1d(2, affine=affine, track_running_stats=True)
    norm.requires_grad_(not frozen)
    model = nn.Sequential(nn.Linear(4, 6), nn.Unflatten(1, (2, 3)), norm, nn.Flatten(), nn.Linear(6, 1))
    opt = dpoptim.DPSGD([p for p in model.parameters() if p.requires_grad], lr=0.1, noise_multiplier=1.0,
                        max_grad_norm=1.0, expected_batch_size=4, sample_rate=0.1)
    opt.zero_grad()
    with pytest.raises(ValueError, match="running statistics.*track_running_stats=False"):
        model(torch.randn(4, 4))
    assert torch.equal(norm.running_mean, torch.zeros(2)) and torch.equal(norm.running_var, torch.ones(2))


class _NormNet(nn.Module):
    """Every normalization family in one model, so they clip together. ReLUs sit between
    the norms, and the conv has no bias: a per-channel shift right before InstanceNorm has
    an exactly zero gradient, which float32 roundoff turns into noise on both sides of the
    engine's first-step check against autograd."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1, bias=False)
        self.gn = nn.GroupNorm(2, 4)
        self.inorm = nn.InstanceNorm2d(4, affine=True)
        self.bn = nn.BatchNorm2d(4).eval()  # frozen statistics: per-example gradients exist
        self.fc = nn.Linear(4 * 16, 8)
        self.ln = nn.LayerNorm(8, bias=False)
        self.rms = nn.RMSNorm(8)
        self.out = nn.Linear(8, 2)

    def train(self, mode=True):
        super().train(mode)
        self.bn.eval()
        return self

    def forward(self, x):  # x: [n, 1, 4, 4]
        h = torch.relu(self.gn(torch.relu(self.inorm(self.conv(x)))))
        h = torch.relu(self.bn(h))
        h = self.rms(torch.relu(self.ln(self.fc(h.flatten(1)))))
        return self.out(h)


@pytest.mark.filterwarnings("ignore::dpoptim.PrivacyWarning")
def test_norm_model_trains_with_noise():
    torch.manual_seed(0)
    x = torch.randn(32, 1, 4, 4)
    y = (x.mean((1, 2, 3)) > 0).long()
    model = _NormNet()
    assert_trains_with_noise(model, x, y, lr=1.0)


def test_batchnorm_rule_itself_refuses_batch_statistics():
    """The refusal lives in the rule: it names the mixing, and it never hands out a
    batch-statistics gradient as if it were per example."""
    from dpoptim.registry import Use, resolve_rule

    bn = nn.BatchNorm1d(3)
    rule = resolve_rule(bn)
    assert "batch statistics" in rule.mixes_examples(bn)
    assert rule.mixes_examples(bn.eval()) is None
    x = torch.randn(4, 3)
    with pytest.raises(RuntimeError, match="batch statistics"):
        rule.per_example(Use(bn.train(), (x, None), [torch.randn(4, 3)]), ["weight"])


def test_batchnorm_subclass_with_its_own_forward_is_refused():
    class Scaled(nn.BatchNorm1d):
        def forward(self, x):
            return super().forward(x) * 2

    model = nn.Sequential(nn.Linear(4, 3), Scaled(3), nn.Linear(3, 1))
    model[1].requires_grad_(False)
    opt = _optimizer(nn.ModuleList([model[0], model[2]]))
    model(torch.randn(5, 4)).sum().backward()
    with pytest.raises(dpoptim.UnsupportedLayerError, match="Scaled uses batch statistics"):
        opt.step()
