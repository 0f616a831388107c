"""dpoptim.scope: process-wide hooks only until the first checked step, then hooks on the
optimizer's own model, so that another model in the same process pays nothing."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import dpoptim


def _global_hooks() -> int:
    module = nn.modules.module
    return len(module._global_forward_pre_hooks) + len(module._global_forward_hooks)


def _opt(params, max_grad_norm=1.0):
    return dpoptim.DPSGD(params, lr=0.1, noise_multiplier=0.0, max_grad_norm=max_grad_norm,
                         expected_batch_size=4, sample_rate=0.5)


def _step(model, opt, x):
    opt.zero_grad()
    model(x).square().sum().backward()
    opt.step()


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpoptim.PrivacyWarning)
        yield


def test_after_the_first_step_no_process_wide_hook_is_left():
    before = _global_hooks()
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = _opt(model.parameters())
    assert _global_hooks() > before
    _step(model, opt, torch.randn(4, 3))
    assert _global_hooks() == before
    other = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1))
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in other.modules())
    _step(model, opt, torch.randn(4, 3))  # its own model is still clipped


def test_a_module_added_after_the_switch_is_hooked_and_clipped():
    """A layer swapped in after the first step is found at the model's next call; its
    per-example gradients are clipped like the others' (a tiny clip bound C: the privatised
    gradient of 4 examples with B = 4 has norm at most C)."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = _opt(model.parameters(), max_grad_norm=1e-3)
    _step(model, opt, torch.randn(4, 3))
    new = nn.Linear(4, 2)
    model[2] = new
    opt.add_param_group({"params": new.parameters()})
    x = 10 * torch.randn(4, 3)
    _step(model, opt, x)
    total = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert new.weight.grad is not None and float(new.weight.grad.norm()) > 0
    assert float(total) <= 1e-3 * 1.0001


def test_a_parameter_outside_the_hooked_model_is_refused_not_missed():
    model = nn.Sequential(nn.Linear(3, 2))
    stray = nn.Linear(2, 1)
    opt = _opt([*model.parameters(), *stray.parameters()])
    x = torch.randn(4, 3)
    opt.zero_grad()
    model(x).square().sum().backward()  # the stray layer is not used on the first step
    opt.step()
    opt.zero_grad()
    (stray.weight.sum() * model(x).sum()).backward()  # used outside any module call
    with pytest.raises(dpoptim.UnsupportedLayerError):
        opt.step()


def test_a_new_module_holding_the_old_parameters_is_found_at_the_next_call():
    """No new parameters, so no widening: the model's next call hooks the new layer."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    opt = _opt(model.parameters(), max_grad_norm=1e-3)
    _step(model, opt, torch.randn(4, 3))
    old = model[2]
    new = nn.Linear(4, 2)
    new.weight, new.bias = old.weight, old.bias
    model[2] = new
    _step(model, opt, 10 * torch.randn(4, 3))
    total = torch.cat([p.grad.flatten() for p in model.parameters()]).norm()
    assert float(old.weight.grad.norm()) > 0 and float(total) <= 1e-3 * 1.0001



def test_leaves_without_parameters_or_rule_are_left_unhooked_and_steps_stay_exact():
    """Once narrowed, an activation or a dropout (no parameter, no child, no rule) carries
    no hook; layers with parameters, containers, and a parameter-free layer with a rule
    (LayerNorm without affine parameters) keep theirs. The next clipped step still matches
    the per-example oracle."""
    from oracle import clipped_sum, dp_clipped_sum, per_example_gradients

    def make():
        return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.LayerNorm(4, elementwise_affine=False),
                             nn.Dropout(0.0), nn.Linear(4, 2)).double()

    torch.manual_seed(0)
    model, twin = make(), make()  # the oracle runs on a twin: the model's hooks now ghost-detach
    x, y = torch.randn(5, 3, dtype=torch.float64), torch.zeros(5)
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=0.0, max_grad_norm=0.05,
                        expected_batch_size=1, sample_rate=0.5, loss_reduction="sum")

    def forward(m, inputs):
        return m(inputs)

    def loss(out, _):
        return out.square().sum(1)

    dp_clipped_sum(model, [((x,), y)], 0.05, forward, loss, reduction="sum", optimizer=opt)  # checked step
    hooked = {type(m).__name__ for m in model.modules() if m._forward_pre_hooks}
    assert hooked == {"Sequential", "Linear", "LayerNorm"}
    twin.load_state_dict(model.state_dict())
    expected, norms = clipped_sum(per_example_gradients(twin, (x,), y, forward, loss), 0.05, list(twin.parameters()))
    assert max(norms) > 0.05  # some examples are clipped
    update = dp_clipped_sum(model, [((x,), y)], 0.05, forward, loss, reduction="sum", optimizer=opt)
    for got, want in zip(update, expected):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
