"""The engine's accelerations (ghost differentiation keeping one parameter, ``detach_all``,
the stand-in for a layer's backward) are off on the checked first step and chosen per call
after it: each is checked against autograd the first time a call takes it, on whatever
step, once per route (dpoptim/verify.py)."""

import pytest
import torch
from torch import nn

import dpoptim
from dpoptim import verify

F64 = torch.float64


@pytest.fixture(autouse=True)
def fresh_routes(monkeypatch):
    """Every test starts with no route checked, and counts the recomputations."""
    monkeypatch.setattr(verify, "_VERIFIED", set())
    calls = []
    original = verify._recompute

    def counted(record, *args, **kwargs):
        calls.append(type(record.module).__name__)
        return original(record, *args, **kwargs)

    monkeypatch.setattr(verify, "_recompute", counted)
    return calls


def _gate(*, detach=False, detach_all=False, stand_in=False, wrong=None):
    """A fresh layer type ``y = x * weight + bias`` over ``[n, d]`` with its own rule, which
    may take each acceleration, and may be wrong: ``wrong="weight"`` scales the weight's
    per-example gradients, ``wrong="input"`` the input gradients of its stand-in."""

    class Gate(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(d, dtype=F64))
            self.bias = nn.Parameter(torch.randn(d, dtype=F64))

        def forward(self, x):
            return x * self.weight + self.bias

    class GateRule(dpoptim.Rule):
        detach_parameters = detach

        def save(self, module, args, kwargs, output):
            return args[0].detach(), args[0].requires_grad

        def per_example(self, use, names):
            (x, _), b = use.saved, use.grad_outputs[0]
            grads = {"weight": x * b * (1.5 if wrong == "weight" else 1.0), "bias": b}
            return {name: grads[name] for name in names}

        if stand_in:
            def inputs(self, module, args, kwargs):
                return [args[0]] if args[0].requires_grad else []

            def input_gradients(self, use):
                scale = 2.0 if wrong == "input" else 1.0
                return [use.grad_outputs[0] * use.module.weight.detach() * scale] if use.saved[1] else []

    GateRule.detach_all = detach_all
    dpoptim.register_rule(Gate, GateRule)
    return Gate


def _train(model, steps, x, y, first=1, before_step=None):
    opt = dpoptim.DPSGD(model.parameters(), lr=0.05, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=x.shape[0], sample_rate=0.5)
    for step in range(first, first + steps):
        if before_step is not None:
            before_step(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y, reduction="sum").backward()
        opt.step()
    return opt


def _data(n=4, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=F64), torch.randn(n, 2, generator=g, dtype=F64)


def _routes(kind):
    return {key for key in verify._VERIFIED if key[1][0] == kind}


def test_a_wrong_stand_in_is_caught_when_first_used_after_the_first_step():
    """The rule's input gradients are wrong (every layer upstream would get wrong
    per-example gradients): the checked first step cannot see it (no stand-in then); the
    first stand-in, on step 2, is an error at step()."""
    torch.manual_seed(0)
    Gate = _gate(stand_in=True, wrong="input")
    model = nn.Sequential(nn.Linear(3, 3).double(), Gate(3), nn.Linear(3, 2).double())
    x, y = _data()
    opt = _train(model, 1, x, y)  # step 1: no error, the stand-in is off
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y, reduction="sum").backward()
    with pytest.raises(dpoptim.UnsupportedLayerError, match=r"stand-in.*gradient of its input 0.*input_gradients"):
        opt.step()
    assert not _routes("stand-in")


def test_a_right_stand_in_is_checked_once(fresh_routes):
    torch.manual_seed(0)
    Gate = _gate(stand_in=True)
    model = nn.Sequential(nn.Linear(3, 3).double(), Gate(3), nn.Linear(3, 2).double())
    x, y = _data()
    seen = []
    _train(model, 4, x, y, before_step=lambda step: seen.append(list(fresh_routes)))
    seen.append(list(fresh_routes))
    assert [s.count("Gate") for s in seen] == [0, 0, 1, 1, 1]  # before steps 1..4, after step 4
    assert len(_routes("stand-in")) == 1


@pytest.mark.parametrize("route", ["ghost", "ghost-all"])
def test_a_wrong_rule_first_used_on_step_3_is_caught(route, fresh_routes):
    """A layer called only from step 3 on takes ghost differentiation there for the first
    time: its wrong rule, never seen by the checked first step, is an error at step 3."""
    torch.manual_seed(1)
    Gate = _gate(detach=True, detach_all=True, wrong="weight")
    first, gate, head = nn.Linear(3, 3).double(), Gate(3), nn.Linear(3, 2).double()
    if route == "ghost":
        first.requires_grad_(False)  # the gate's input leads to no attached parameter: keep one
    on = {"gate": False}

    def forward(x):
        h = first(x)
        return head(gate(h) if on["gate"] else h)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.gate, self.head = first, gate, head

        def forward(self, x):
            return forward(x)

    model = Model()
    x, y = _data()
    opt = _train(model, 2, x, y)
    on["gate"] = True
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y, reduction="sum").backward()
    taken = "every parameter detached" if route == "ghost-all" else "every parameter but 'weight' detached"
    with pytest.raises(dpoptim.UnsupportedLayerError, match=rf"{taken}.*'weight' \(relative error"):
        opt.step()
    assert fresh_routes.count("Gate") == 1
    assert not any(key[0].__name__ == "GateRule" for key in verify._VERIFIED)


def test_a_route_first_taken_on_step_3_is_checked_once(fresh_routes):
    """A LayerNorm first called on step 3 takes ghost differentiation there: checked on
    step 3 (one recomputation), not again on step 4."""
    torch.manual_seed(2)
    lin, norm, head = nn.Linear(3, 3).double(), nn.LayerNorm(3).double(), nn.Linear(3, 2).double()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.norm, self.head = lin, norm, head
            self.use_norm = False

        def forward(self, x):
            h = self.lin(x)
            return self.head(self.norm(h) if self.use_norm else h)

    model = Model()
    x, y = _data()
    counts = []

    def before(step):
        counts.append(fresh_routes.count("LayerNorm"))
        model.use_norm = step >= 3

    _train(model, 4, x, y, before_step=before)
    counts.append(fresh_routes.count("LayerNorm"))
    assert counts == [0, 0, 0, 1, 1]  # before steps 1..4, after step 4
    assert any(key[0].__name__ == "LayerNormRule" and key[1][0] == "ghost" for key in verify._VERIFIED)


class _Mixed(nn.Module):
    """Every acceleration and a random forward: ghost (Linear, LayerNorm, the attention and
    the LSTM cell), detach_all (a convolution after a Linear), a stand-in (a two-layer LSTM
    with dropout, whose recomputation must draw the same masks)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.lin = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.att = nn.MultiheadAttention(8, 2, batch_first=True, dropout=0.2)
        self.lstm = nn.LSTM(8, 6, num_layers=2, dropout=0.3, batch_first=True)
        self.cell = nn.LSTMCell(6, 5)
        self.conv = nn.Conv1d(5, 3, 2)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        h = self.norm(self.lin(self.emb(x)))
        h, _ = self.att(h, h, h, need_weights=False)
        h, _ = self.lstm(h)
        c = self.cell(h[:, -1])[0]
        return self.head(self.conv(c.unsqueeze(-1).expand(-1, -1, 3)).mean(-1))


def test_a_right_model_takes_every_route_without_error(fresh_routes):
    torch.manual_seed(3)
    model = _Mixed().double()
    x = torch.randint(0, 10, (4, 5))
    y = torch.randn(4, 2, dtype=F64)
    counts = []
    _train(model, 3, x, y, before_step=lambda step: counts.append(len(fresh_routes)))
    counts.append(len(fresh_routes))
    assert counts[:2] == [0, 0] and counts[2] > 0 and counts[3] == counts[2]  # on step 2 only
    assert _routes("ghost") and _routes("ghost-all") and _routes("stand-in")
    assert all(key[1][0] != "stand-in" or key[0].__name__ == "RecurrentRule" for key in verify._VERIFIED)


def test_an_empty_batch_proves_nothing(fresh_routes):
    """A route first taken by a batch of no example stays unchecked until a real one."""
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(3, 3).double(), nn.Tanh(), nn.Linear(3, 2).double())
    x, y = _data()
    opt = _train(model, 1, x, y)
    for batch in (0, 4):
        opt.zero_grad()
        nn.functional.mse_loss(model(x[:batch]), y[:batch], reduction="sum").backward()
        opt.step()
        assert bool(_routes("ghost")) == (batch > 0)


def test_a_wrong_recurrent_stand_in_is_caught_for_the_initial_state(monkeypatch):
    """The built-in recurrent rule's stand-in, with a wrong gradient for ``h0`` only (the
    second of its inputs): caught on step 2, its first stand-in."""
    from dpoptim.rules.rnn import RecurrentRule

    torch.manual_seed(5)
    g = torch.Generator().manual_seed(5)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.init = nn.Linear(3, 3).double(), nn.Linear(3, 4).double()
            self.gru, self.head = nn.GRU(3, 4, batch_first=True).double(), nn.Linear(4, 2).double()

        def forward(self, x):
            out, _ = self.gru(self.lin(x), self.init(x[:, 0]).unsqueeze(0))  # h0 from the first step
            return self.head(out[:, -1])

    original = RecurrentRule.input_gradients

    def wrong(self, use):
        dx, dh0 = original(self, use)
        return [dx, dh0 * 2]

    monkeypatch.setattr(RecurrentRule, "input_gradients", wrong)
    model = Model()
    x, y = torch.randn(4, 5, 3, generator=g, dtype=F64), torch.randn(4, 2, generator=g, dtype=F64)
    with pytest.raises(dpoptim.UnsupportedLayerError, match=r"RecurrentRule took its stand-in.*input 1 "):
        _train(model, 2, x, y)


def test_a_module_with_a_child_module_is_recomputed_as_autograd_runs_it(fresh_routes):
    """The first use of ghost differentiation by a module whose forward calls a child module
    (with a rule and accelerations of its own): the recomputation runs the child as
    autograd runs it, its hooks' records of that recomputation are ignored, and the steps
    match a per-example loop."""
    from oracle import check_rule_case, mse

    torch.manual_seed(6)

    class Affine(nn.Module):
        def __init__(self, d):
            super().__init__()
            self.scale = nn.Parameter(torch.randn(d, dtype=F64))
            self.shift = nn.Parameter(torch.randn(d, dtype=F64))
            self.inner = nn.Linear(d, d).double()

        def forward(self, x):
            return self.inner(x) * self.scale + self.shift

    @dpoptim.register_rule(Affine)
    class AffineRule(dpoptim.Rule):
        detach_parameters = True

        def parameters(self, module):
            return {"scale": module.scale, "shift": module.shift}

        def save(self, module, args, kwargs, output):
            return (output.detach() - module.shift.detach()) / module.scale.detach()  # inner(x)

        def per_example(self, use, names):
            grads = {"scale": use.saved * use.grad_outputs[0], "shift": use.grad_outputs[0]}
            return {name: grads[name] for name in names}

    x, y = _data(n=5, d=3, seed=6)
    make = lambda: nn.Sequential(nn.Linear(3, 3).double(), Affine(3), nn.Tanh(), nn.Linear(3, 2).double())  # noqa: E731
    check_rule_case(make, (x,), y, lambda m, x: m(x), mse)
    model = make()
    _train(model, 3, x, y)
    assert fresh_routes.count("Affine") == 1
    assert any(key[0] is AffineRule for key in verify._VERIFIED)


def test_roundoff_of_a_gradient_zero_in_truth_is_no_error(fresh_routes):
    """A GroupNorm whose one example holds a single repeated value: its weight's true
    gradient is zero, and autograd's float32 answer is roundoff. The first ghost route,
    taken by that example, is no error (errors are judged against the use's largest
    gradient too), and the route is checked."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(3, 4), nn.Unflatten(1, (4, 1)), nn.GroupNorm(1, 4), nn.Flatten(),
                          nn.Linear(4, 2))
    opt = _train(model, 1, torch.randn(4, 3), torch.randn(4, 2))
    lin = model[0]
    with torch.no_grad():  # every output of the first layer equal for this input: x_hat = 0
        lin.weight.zero_()
        lin.bias.fill_(0.3)
    opt.zero_grad()
    nn.functional.mse_loss(model(torch.randn(1, 3)), torch.randn(1, 2), reduction="sum").backward()
    opt.step()
    assert fresh_routes.count("GroupNorm") == 1
    assert any(key[0].__name__ == "GroupNormRule" for key in verify._VERIFIED)
