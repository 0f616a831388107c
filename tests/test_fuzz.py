"""Fuzzing: Hypothesis assembles models from every layer family that has a registered
rule and checks the two properties DP-SGD rests on, through the real optimizer.

(a) Sensitivity. With ``noise_multiplier=0``, ``expected_batch_size=1`` and ``lr=1`` a
    DPSGD step moves the parameters by exactly the clipped sum. For a few examples i:
    the step on the batch {i} alone moves them by ``min(C, ||g_i||)`` (``||g_i||`` from
    a float64 per-example autograd loop), and the full batch's step minus the step
    without i is that same move: adding or removing one example changes the update by at
    most C, whatever the others are.
(b) Exactness. In float64 the clipped sum equals the brute-force oracle's
    (``tests/oracle.py``), on the first step (checked against autograd by the engine)
    and on a later one (ghost differentiation).

Models are a chain of blocks over a ``[n, T, d]`` sequence (batch first) with ``tanh``
between them and a ``Linear`` head on the mean over T. Families whose rule is not
registered (``dpoptim.registered_rules()``) are left out, so the test grows as rules land.
A second, deterministic test puts every available family into one model.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st
from torch import nn

import dpoptim
from oracle import check_rule_case, mse, per_example_gradients

F64 = torch.float64
# Cheap per example (tiny models, one thread): draw more than the profile's default.
FUZZ = settings(max_examples=max(100, settings.default.max_examples))


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny steps: see conftest.py


# ----------------------------------------------------------------- blocks
# A block is (kind, options). ``shape_after`` says what [T, d] it leaves; ``build`` makes
# its module; ``apply`` runs it on a [n, T, d] tensor. Options are drawn with every
# constraint torch imposes already met, so each drawn model runs.


def _conv_len(length, k, stride, pad, dil):
    return (length + 2 * pad - dil * (k - 1) - 1) // stride + 1


def _divisors(d):
    return [g for g in range(1, d + 1) if d % g == 0]


def draw_block(draw, kind, T, d):
    """Options for ``kind`` on input [T, d], or None when it cannot follow that shape."""
    if kind == "linear":
        return {"out": draw(st.integers(1, 6)), "bias": draw(st.booleans())}
    if kind == "linear_twice":  # one module called twice: the per-example gradient is the sum over uses
        return {"bias": draw(st.booleans())}
    if kind == "conv1d":
        k, stride, dil = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 2))
        pad = draw(st.integers(0, k // 2 + 1))
        groups = draw(st.sampled_from(_divisors(d)))
        out = groups * draw(st.integers(1, 3))
        mode = draw(st.sampled_from(["zeros", "replicate"]))
        if _conv_len(T, k, stride, pad, dil) < 1:
            return None
        return {"out": out, "k": k, "stride": stride, "pad": pad, "dil": dil, "groups": groups,
                "bias": draw(st.booleans()), "mode": mode}
    if kind in ("conv2d", "conv3d"):
        # [n, 1, T, d] (Conv3d: a trailing size-1 dim), channels folded into the features after.
        kt, kd = draw(st.integers(1, 3)), draw(st.integers(1, 3))
        st_t, st_d = draw(st.integers(1, 2)), draw(st.integers(1, 2))
        pt, pd = kt // 2, kd // 2
        if _conv_len(T, kt, st_t, pt, 1) < 1 or _conv_len(d, kd, st_d, pd, 1) < 1:
            return None
        return {"channels": draw(st.integers(1, 2)), "k": (kt, kd), "stride": (st_t, st_d), "pad": (pt, pd),
                "bias": draw(st.booleans())}
    if kind == "layernorm":
        if d == 1:
            return None  # one element normalises to 0: the weight's true gradient is 0
        return {"bias": draw(st.booleans()), "eps": draw(st.sampled_from([1e-5, 0.1]))}
    if kind == "rmsnorm":
        return {"eps": draw(st.sampled_from([None, 1e-3]))}
    if kind == "groupnorm":
        groups = draw(st.sampled_from(_divisors(d)))
        if d // groups * T == 1:
            return None  # torch refuses groups of one value
        return {"groups": groups}
    if kind == "instancenorm":
        if T < 2:
            return None  # instance statistics need two positions
        return {"running": False}  # running statistics in training leak (dpoptim warns)
    if kind in ("rnn", "lstm", "gru"):
        return {"hidden": draw(st.integers(1, 4)), "layers": draw(st.integers(1, 2)),
                "bidirectional": draw(st.booleans()), "bias": draw(st.booleans())}
    if kind == "mha":
        return {"heads": draw(st.sampled_from(_divisors(d))), "bias": draw(st.booleans())}
    raise AssertionError(kind)


def shape_after(kind, o, T, d):
    if kind == "linear":
        return T, o["out"]
    if kind == "conv1d":
        return _conv_len(T, o["k"], o["stride"], o["pad"], o["dil"]), o["out"]
    if kind in ("conv2d", "conv3d"):
        (kt, kd), (st_t, st_d), (pt, pd) = o["k"], o["stride"], o["pad"]
        return _conv_len(T, kt, st_t, pt, 1), o["channels"] * _conv_len(d, kd, st_d, pd, 1)
    if kind in ("rnn", "lstm", "gru"):
        return T, o["hidden"] * (2 if o["bidirectional"] else 1)
    return T, d


def build(kind, o, T, d):
    if kind == "linear":
        return nn.Linear(d, o["out"], bias=o["bias"])
    if kind == "linear_twice":
        return nn.Linear(d, d, bias=o["bias"])
    if kind == "conv1d":
        return nn.Conv1d(d, o["out"], o["k"], stride=o["stride"], padding=o["pad"], dilation=o["dil"],
                         groups=o["groups"], bias=o["bias"], padding_mode=o["mode"])
    if kind == "conv2d":
        return nn.Conv2d(1, o["channels"], o["k"], stride=o["stride"], padding=o["pad"], bias=o["bias"])
    if kind == "conv3d":
        return nn.Conv3d(1, o["channels"], (*o["k"], 1), stride=(*o["stride"], 1), padding=(*o["pad"], 0),
                         bias=o["bias"])
    if kind == "layernorm":
        return nn.LayerNorm(d, eps=o["eps"], bias=o["bias"])
    if kind == "rmsnorm":
        return nn.RMSNorm(d, eps=o["eps"])
    if kind == "groupnorm":
        return nn.GroupNorm(o["groups"], d)
    if kind == "instancenorm":
        return nn.InstanceNorm1d(d, affine=True, track_running_stats=o["running"])
    if kind in ("rnn", "lstm", "gru"):
        cls = {"rnn": nn.RNN, "lstm": nn.LSTM, "gru": nn.GRU}[kind]
        return cls(d, o["hidden"], num_layers=o["layers"], bidirectional=o["bidirectional"], bias=o["bias"],
                   batch_first=True)
    if kind == "mha":
        return nn.MultiheadAttention(d, o["heads"], bias=o["bias"], batch_first=True)
    raise AssertionError(kind)


def apply(kind, module, x):
    if kind == "linear_twice":
        return module(torch.tanh(module(x)))
    if kind in ("conv1d", "groupnorm"):
        return module(x.transpose(1, 2)).transpose(1, 2)
    if kind == "instancenorm":
        if x.shape[0] == 0:
            return x  # torch's instance_norm fails on an empty batch
        return module(x.transpose(1, 2)).transpose(1, 2)
    if kind == "conv2d":
        return module(x.unsqueeze(1)).permute(0, 2, 1, 3).flatten(2)
    if kind == "conv3d":
        return module(x.unsqueeze(1).unsqueeze(-1)).squeeze(-1).permute(0, 2, 1, 3).flatten(2)
    if kind in ("rnn", "lstm", "gru"):
        return module(x)[0]
    if kind == "mha":
        return module(x, x, x, need_weights=False)[0]
    return module(x)


# The layer type whose registered rule each kind needs (and the stem types).
NEEDS = {
    "linear": nn.Linear, "linear_twice": nn.Linear, "conv1d": nn.Conv1d, "conv2d": nn.Conv2d,
    "conv3d": nn.Conv3d, "layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm, "groupnorm": nn.GroupNorm,
    "instancenorm": nn.InstanceNorm1d, "rnn": nn.RNN, "lstm": nn.LSTM, "gru": nn.GRU,
    "mha": nn.MultiheadAttention,
}
STEMS = {"features": None, "embedding": nn.Embedding, "embedding_bag": nn.EmbeddingBag}


def available(table):
    registered = dpoptim.registered_rules()
    return [k for k, cls in table.items() if cls is None or cls in registered]


class Net(nn.Module):
    """stem -> blocks (tanh between) -> mean over T -> Linear head. Holds no parameters of
    its own, so it needs no rule."""

    def __init__(self, spec):
        super().__init__()
        self.spec = spec
        stem, so = spec["stem"]
        T, d = spec["T"], spec["d"]
        if stem == "embedding":
            self.stem = nn.Embedding(so["vocab"], so["dim"], padding_idx=so["padding_idx"])
            d = so["dim"]
        elif stem == "embedding_bag":
            self.stem = nn.EmbeddingBag(so["vocab"], so["dim"], mode=so["mode"])
            T, d = 1, so["dim"]
        self.blocks = nn.ModuleList()
        for kind, o in spec["blocks"]:
            self.blocks.append(build(kind, o, T, d))
            T, d = shape_after(kind, o, T, d)
        self.head = nn.Linear(d, spec["out"])
        # Norm layers start at weight 1, bias 0, where symmetric inputs (two values per group)
        # can give a weight gradient that is exactly 0, so that the engine's first-step
        # comparison with autograd compares roundoff with roundoff. Draw both that and
        # weights as training leaves them.
        if not spec.get("trained_norms", True):
            return
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.InstanceNorm1d)):
                    for name, p in m.named_parameters(recurse=False):
                        p.uniform_(0.5, 1.5) if name == "weight" else p.uniform_(-0.5, 0.5)

    def forward(self, x):
        stem = self.spec["stem"][0]
        if stem == "embedding":
            x = self.stem(x)
        elif stem == "embedding_bag":
            x = self.stem(x).unsqueeze(1)
        for (kind, _), module in zip(self.spec["blocks"], self.blocks):
            x = torch.tanh(apply(kind, module, x))
        return self.head(x.mean(1))


@st.composite
def specs(draw, max_blocks=3):
    stems, kinds = available(STEMS), available(NEEDS)
    stem = draw(st.sampled_from(stems))
    T, d = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    so = {}
    if stem != "features":
        so = {"vocab": draw(st.integers(2, 6)), "dim": draw(st.integers(1, 4))}
        if stem == "embedding":
            so["padding_idx"] = draw(st.sampled_from([None, 0]))
        else:
            so["mode"] = draw(st.sampled_from(["sum", "mean"]))
    spec = {"stem": (stem, so), "T": T, "d": d, "blocks": [], "out": draw(st.integers(1, 3)),
            "trained_norms": draw(st.booleans())}
    cur_T, cur_d = (1, so["dim"]) if stem == "embedding_bag" else (T, so.get("dim", d))
    for kind in draw(st.lists(st.sampled_from(kinds), min_size=0 if stem != "features" else 1, max_size=max_blocks)):
        o = draw_block(draw, kind, cur_T, cur_d)
        if o is not None:
            spec["blocks"].append((kind, o))
            cur_T, cur_d = shape_after(kind, o, cur_T, cur_d)
    return spec


def inputs_for(spec, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    stem, so = spec["stem"]
    if stem == "features":
        x = torch.randn(n, spec["T"], spec["d"], generator=g, dtype=dtype)
    else:
        x = torch.randint(0, so["vocab"], (n, spec["T"]), generator=g)
    y = torch.randn(n, spec["out"], generator=g, dtype=dtype)
    return x, y


def make_model(spec, dtype):
    def make():
        return Net(spec).to(dtype)
    return make


# ----------------------------------------------------------------- (a) sensitivity
def check_sensitivity(spec, dtype, n, C, reduction, picks):
    torch.manual_seed(0)
    model = make_model(spec, dtype)()
    reference = copy.deepcopy(model).double()
    x, y = inputs_for(spec, n, dtype)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = dpoptim.DPSGD(params, lr=1.0, noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=1,
                        sample_rate=0.5, loss_reduction=reduction)
    start = [p.detach().clone() for p in params]

    def move(index):
        """The parameter change of one step on the examples ``index`` (flat, float64)."""
        opt.zero_grad()
        losses = mse(model(x[index]), y[index])
        (losses.mean() if reduction == "mean" else losses.sum()).backward()
        opt.step()
        with torch.no_grad():
            change = torch.cat([(s - p).flatten().double() for s, p in zip(start, params)])
            for p, s in zip(params, start):
                p.copy_(s)
        return change

    everyone = torch.arange(n)
    full = move(everyone)
    # Changes are read off as start - end, so each coordinate carries the rounding of the
    # parameter itself: about eps * (|p| + |change|).
    eps = torch.finfo(dtype).eps
    size = max(sum(p.numel() for p in params), 1)
    slack = 4 * eps * math.sqrt(size) * (max((float(s.abs().max()) for s in start if s.numel()), default=0.0) + C)
    rel = 1e-9 if dtype == F64 else 2e-5
    problems = []
    if not full.norm() <= n * C * (1 + rel) + n * slack + 1e-30:
        problems.append(f"batch of {n}: moved by {float(full.norm()):.6g} > n C = {n * C:.6g}")
    x64 = x if not x.is_floating_point() else x.double()
    for i in picks:
        alone = move(torch.tensor([i]))
        others = move(everyone[everyone != i])
        grads = per_example_gradients(reference, (x64[i:i + 1],), y[i:i + 1].double(), lambda m, v: m(v), mse)[0]
        expected = min(C, float(torch.sqrt(sum(g.square().sum() for g in grads))))
        got = float(alone.norm())
        if not got <= C * (1 + rel) + slack:
            problems.append(f"example {i} alone moved the parameters by {got:.9g} > C = {C}")
        if not abs(got - expected) <= slack + (1e-3 if dtype != F64 else 1e-7) * expected:
            problems.append(f"example {i} alone moved the parameters by {got:.9g}, expected min(C, ||g_i||) = {expected:.9g}")
        # Removing i from the batch changes the update by exactly i's own clipped gradient.
        loo = float((full - others - alone).norm())
        scale = float(full.norm() + others.norm()) + C
        if not loo <= rel * scale + 3 * slack:
            problems.append(f"example {i}: (full batch) - (batch without it) differs from its own move by {loo:.3g}")
    assert not problems, f"{spec}\n" + "\n".join(problems)


@FUZZ
@given(
    spec=specs(),
    dtype=st.sampled_from([torch.float32, F64]),
    n=st.sampled_from([0, 1, 2, 5, 64]),
    C=st.sampled_from([1e-3, 0.1, 1.0, 100.0]),
    reduction=st.sampled_from(["mean", "sum"]),
    data=st.data(),
)
def test_fuzz_each_example_moves_at_most_C(spec, dtype, n, C, reduction, data):
    picks = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=2, unique=True)) if n else []
    check_sensitivity(spec, dtype, n, C, reduction, picks)


# ----------------------------------------------------------------- (b) exactness
@FUZZ
@given(
    spec=specs(),
    n=st.sampled_from([0, 1, 2, 5, 64]),
    reduction=st.sampled_from(["mean", "sum"]),
    clip=st.sampled_from([None, 1e6]),
)
def test_fuzz_matches_oracle(spec, n, reduction, clip):
    x, y = inputs_for(spec, n, F64)
    check_rule_case(make_model(spec, F64), (x,), y, lambda m, v: m(v), mse, max_grad_norm=clip, reduction=reduction)


# ----------------------------------------------------------------- every family at once
def kitchen_sink():
    """Every available family once, in an order whose shapes always fit."""
    kinds = available(NEEDS)
    stems = available(STEMS)
    order = ["linear", "conv1d", "groupnorm", "layernorm", "mha", "rnn", "lstm", "gru", "instancenorm",
             "rmsnorm", "conv2d", "conv3d", "linear_twice"]
    options = {
        "linear": {"out": 4, "bias": True},
        "conv1d": {"out": 4, "k": 3, "stride": 1, "pad": 1, "dil": 1, "groups": 2, "bias": True, "mode": "zeros"},
        "groupnorm": {"groups": 2},
        "layernorm": {"bias": True, "eps": 1e-5},
        "mha": {"heads": 2, "bias": True},
        "rnn": {"hidden": 4, "layers": 1, "bidirectional": False, "bias": True},
        "lstm": {"hidden": 2, "layers": 1, "bidirectional": True, "bias": True},
        "gru": {"hidden": 4, "layers": 2, "bidirectional": False, "bias": True},
        "instancenorm": {"running": False},
        "rmsnorm": {"eps": None},
        "conv2d": {"channels": 1, "k": (3, 1), "stride": (1, 1), "pad": (1, 0), "bias": True},
        "conv3d": {"channels": 1, "k": (3, 1), "stride": (1, 1), "pad": (1, 0), "bias": True},
        "linear_twice": {"bias": True},
    }
    stem = "embedding" if "embedding" in stems else "features"
    so = {"vocab": 5, "dim": 4, "padding_idx": 0} if stem == "embedding" else {}
    spec = {"stem": (stem, so), "T": 3, "d": 4, "blocks": [(k, options[k]) for k in order if k in kinds], "out": 2}
    T, d = 3, 4
    for kind, o in spec["blocks"]:
        T, d = shape_after(kind, o, T, d)
        assert (T, d) == (3, 4), kind  # every block keeps [3, 4]
    return spec


@pytest.mark.parametrize("n", [0, 1, 64])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_every_family_in_one_model(n, dtype):
    spec = kitchen_sink()
    check_sensitivity(spec, dtype, n, C=0.05, reduction="mean", picks=[0, n - 1] if n > 1 else list(range(n)))
    if dtype == F64:
        x, y = inputs_for(spec, n, F64)
        check_rule_case(make_model(spec, F64), (x,), y, lambda m, v: m(v), mse)


def test_generators_cover_the_required_families():
    """The families the fuzzer must reach, whenever their rules are registered."""
    registered = dpoptim.registered_rules()
    required = [nn.Linear, nn.Conv1d, nn.Conv2d, nn.Embedding, nn.LayerNorm, nn.GroupNorm, nn.RMSNorm,
                nn.RNN, nn.LSTM, nn.GRU, nn.MultiheadAttention]
    covered = set(NEEDS.values()) | {cls for cls in STEMS.values() if cls is not None}
    assert not [cls for cls in required if cls not in covered]
    spec = kitchen_sink()
    built = {type(m) for m in Net(spec).modules()}
    missing = [cls.__name__ for cls in required if cls in registered and cls not in built]
    assert not missing, f"registered but not in the every-family model: {missing}"
