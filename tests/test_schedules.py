"""noise_multiplier, max_grad_norm, sample_rate and lr changed between steps are honoured
by the next step and recorded step by step in the ledger."""

import copy
import sys
import types

import pytest
import torch
from torch import nn

import dpoptim
from oracle import clipped_sum, per_example_gradients


def big_model():
    return nn.Linear(100, 100, bias=False)  # 10^4 coordinates to measure the noise on


def noise_std(opt, model):
    """The standard deviation of one step's update without data (noise only)."""
    before = model.weight.detach().clone()
    opt.zero_grad()
    opt.step()
    return (model.weight.detach() - before).std().item()


def test_noise_schedule_is_applied_and_in_the_ledger():
    model = big_model()
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=1.0, max_grad_norm=2.0,
                        expected_batch_size=4, sample_rate=0.01, generator=torch.Generator().manual_seed(0))
    schedule = [1.0, 1.0, 3.0, 3.0, 3.0, 0.5]
    for step, sigma in enumerate(schedule):
        if step % 2:  # by attribute and by param group
            opt.noise_multiplier = sigma
        else:
            for group in opt.param_groups:
                group["noise_multiplier"] = sigma
        # the update is lr * N(0, sigma^2 C^2) / B per coordinate; 10^4 draws: sd of the
        # estimated std is about 0.7%
        assert noise_std(opt, model) == pytest.approx(sigma * 2.0 / 4, rel=0.04)
    assert opt.ledger == ((1.0, 0.01, 2), (3.0, 0.01, 3), (0.5, 0.01, 1))
    assert opt.steps_taken == 6
    opt.sample_rate = 0.02
    noise_std(opt, model)
    assert opt.ledger[-1] == (0.5, 0.02, 1)


def test_groups_must_agree_on_noise_but_not_on_lr():
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    opt = dpoptim.DPSGD([{"params": a.parameters(), "lr": 0.1}, {"params": b.parameters(), "lr": 1.0}],
                        noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=2, sample_rate=0.5)
    opt.step()
    opt.param_groups[0]["noise_multiplier"] = 2.0
    with pytest.raises(ValueError, match="differs between parameter groups"):
        opt.step()
    assert opt.steps_taken == 1


def mse(out, y):
    return 0.5 * (out - y).square().sum(1)


def test_clip_bound_schedule_and_step_lr_against_the_oracle():
    """Between steps: C changes (clipping uses the new C) and StepLR halves lr."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    reference = copy.deepcopy(model)
    opt = dpoptim.DPSGD(model.parameters(), lr=0.8, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=3, sample_rate=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    bounds = [1.0, 0.3, 0.3, 0.05, 2.0]
    lrs = [0.8, 0.8, 0.4, 0.4, 0.2]
    g = torch.Generator().manual_seed(1)
    for step, (bound, lr) in enumerate(zip(bounds, lrs)):
        x, y = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, 2, generator=g, dtype=torch.float64)
        opt.max_grad_norm = bound
        assert opt.param_groups[0]["lr"] == pytest.approx(lr)
        params = list(reference.parameters())
        expected, norms = clipped_sum(per_example_gradients(reference, (x,), y, lambda m, x: m(x), mse), bound, params)
        if step == 3:
            assert sum(n > bound for n in norms) >= 3  # the small bound really clips
        opt.zero_grad()
        mse(model(x), y).mean().backward()
        opt.step()
        scheduler.step()
        with torch.no_grad():
            for p, e in zip(params, expected):
                p.sub_(lr * e / 3)
        for p, r in zip(model.parameters(), params):
            assert torch.allclose(p, r, atol=1e-12, rtol=1e-10), f"step {step}"
    assert opt.ledger == ((0.0, 0.1, 5),)


def test_clip_bound_changed_between_backward_and_step_still_raises():
    model = nn.Linear(3, 1)
    opt = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=2, sample_rate=0.5)
    model(torch.randn(2, 3)).sum().backward()
    opt.max_grad_norm = 0.5
    with pytest.raises(ValueError, match="max_grad_norm changed"):
        opt.step()
    assert opt.steps_taken == 0


def test_privacy_spent_composes_the_schedule_run_by_run(monkeypatch):
    """The accountant receives the ledger of the schedule, and a budget is re-evaluated
    when sigma changes (stub accountant: dpoptim.accounting is tested on its own)."""
    calls = []

    def epsilon_of_ledger(ledger, delta, accountant="pld"):
        calls.append(("eps", tuple(ledger)))
        return sum(count / sigma for sigma, _, count in ledger)

    def max_steps(sigma, q, delta, max_epsilon, ledger=(), accountant="pld", limit=None):
        calls.append(("max", sigma, tuple(ledger)))
        spent = sum(count / s for s, _, count in ledger)
        return min(int((max_epsilon - spent) * sigma + 1e-9), limit)

    import dpoptim.accounting.ledger  # noqa: F401  (the optimizer's ledger type stays real)

    stub = types.ModuleType("dpoptim.accounting")
    stub.epsilon_of_ledger, stub.max_steps = epsilon_of_ledger, max_steps
    monkeypatch.setitem(sys.modules, "dpoptim.accounting", stub)
    monkeypatch.setattr(dpoptim, "accounting", stub, raising=False)

    opt = dpoptim.DPSGD(nn.Linear(2, 2).parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=2, sample_rate=0.5, max_epsilon=3.0)
    opt.step()
    opt.step()
    opt.noise_multiplier = 2.0
    opt.step()
    opt.step()  # spent: 2/1 + 2/2 = 3
    with pytest.raises(dpoptim.PrivacyBudgetExceeded):
        opt.step()
    assert opt.ledger == ((1.0, 0.5, 2), (2.0, 0.5, 2))
    assert opt.privacy_spent().epsilon == pytest.approx(3.0)
    assert ("eps", ((1.0, 0.5, 2), (2.0, 0.5, 2))) in calls
    assert ("max", 2.0, ((1.0, 0.5, 2),)) in calls  # re-evaluated at the new sigma
