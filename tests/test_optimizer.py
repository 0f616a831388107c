"""The DP optimizers: torch-twin equivalence, noise, reproducibility, the step contract."""

import copy
import gc
import math

import pytest
import torch
from hypothesis import assume, given, strategies as st
from torch import nn

import dpoptim
from oracle import check_rule_case, clipped_sum, per_example_gradients


def mlp(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).to(dtype)


def batch(n=10, seed=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g, dtype=dtype), torch.randint(0, 3, (n,), generator=g)


TWINS = [
    (dpoptim.DPSGD, torch.optim.SGD, dict(lr=0.1)),
    (dpoptim.DPSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    (dpoptim.DPSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.5, dampening=0.1, maximize=True)),
    (dpoptim.DPAdam, torch.optim.Adam, dict(lr=0.01)),
    (dpoptim.DPAdam, torch.optim.Adam, dict(lr=0.01, betas=(0.8, 0.99), amsgrad=True, weight_decay=0.1)),
    (dpoptim.DPRMSProp, torch.optim.RMSprop, dict(lr=0.01)),
    (dpoptim.DPRMSProp, torch.optim.RMSprop, dict(lr=0.01, alpha=0.9, centered=True, momentum=0.5)),
    (dpoptim.make_private(torch.optim.AdamW), torch.optim.AdamW, dict(lr=0.01, weight_decay=0.1)),
    (dpoptim.make_private(torch.optim.Adagrad), torch.optim.Adagrad, dict(lr=0.1)),
]


@pytest.mark.parametrize("dp_cls, torch_cls, kwargs", TWINS)
def test_without_noise_and_clipping_equals_torch_twin(dp_cls, torch_cls, kwargs):
    model, twin = mlp(), mlp()
    n = 10
    dp = dp_cls(model.parameters(), **kwargs, noise_multiplier=0.0, max_grad_norm=1e9,
                expected_batch_size=n, sample_rate=0.1)
    ref = torch_cls(twin.parameters(), **kwargs)
    for step in range(4):
        x, y = batch(n, seed=step)
        for m, opt in ((model, dp), (twin, ref)):
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)


def test_param_groups_are_honoured():
    model, twin = mlp(), mlp()
    groups = lambda m: [{"params": m[0].parameters(), "lr": 0.5}, {"params": m[2].parameters()}]
    dp = dpoptim.DPSGD(groups(model), lr=0.1, momentum=0.9, noise_multiplier=0.0, max_grad_norm=1e9,
                       expected_batch_size=10, sample_rate=0.1)
    ref = torch.optim.SGD(groups(twin), lr=0.1, momentum=0.9)
    x, y = batch()
    for m, opt in ((model, dp), (twin, ref)):
        for _ in range(2):
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def test_clipping_uses_the_global_norm_over_all_parameters():
    x, y = batch(7)
    loss = lambda out, t: nn.functional.cross_entropy(out, t, reduction="none")
    check_rule_case(mlp, (x,), y, lambda m, x: m(x), loss)


def zero_loss_model(size=20000):
    """A model whose gradient is exactly zero, so the step is pure noise."""
    model = nn.Linear(size, 1, bias=False).double()
    nn.init.zeros_(model.weight)
    return model


def test_noise_has_standard_deviation_sigma_c_over_b():
    sigma, clip, b = 1.3, 0.7, 4.0
    model = zero_loss_model()
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=sigma, max_grad_norm=clip,
                        expected_batch_size=b, sample_rate=0.01)
    opt.zero_grad()
    model(torch.zeros(3, 20000, dtype=torch.float64)).sum().backward()
    opt.step()
    noise = -model.weight.detach().flatten()
    n = noise.numel()
    expected = sigma * clip / b
    # The sample variance of n normals has relative standard error sqrt(2/n) (~1% here):
    # 6 standard errors cannot fail by chance in practice, and a wrong scale is far outside.
    assert abs(noise.var().item() / expected**2 - 1) < 6 * math.sqrt(2 / n)
    assert abs(noise.mean().item()) < 6 * expected / math.sqrt(n)


def test_seeded_generator_reproduces_the_noise_and_default_does_not():
    def run(generator):
        model = zero_loss_model(1000)
        opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=1.0, max_grad_norm=1.0,
                            expected_batch_size=1, sample_rate=0.01, generator=generator)
        for _ in range(2):
            opt.zero_grad()
            model(torch.zeros(2, 1000, dtype=torch.float64)).sum().backward()
            opt.step()
        return model.weight.detach().clone()

    a = run(torch.Generator().manual_seed(7))
    b = run(torch.Generator().manual_seed(7))
    assert torch.equal(a, b)
    assert not torch.equal(run(None), run(None))


@pytest.mark.parametrize("secure", [False, True])
def test_each_step_draws_fresh_noise(secure):
    """Two steps of one optimizer with its own generator draw independent noise: the same
    vector twice would cancel in the difference of two updates and add nothing to privacy."""
    model = zero_loss_model(10_000)
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=1, sample_rate=0.01, secure_mode=secure)
    draws = []
    for _ in range(2):
        before = model.weight.detach().clone()
        opt.zero_grad()
        opt.step()
        draws.append((model.weight.detach() - before).flatten())
    # the correlation of two independent normal vectors of 10^4 entries has sd 0.01
    assert abs(torch.corrcoef(torch.stack(draws))[0, 1].item()) < 0.06


def test_empty_batch_is_a_noise_only_step_and_is_recorded():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=4, sample_rate=0.1)
    opt.zero_grad()
    opt.step()  # no backward at all
    x, y = batch(0)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()  # an empty batch
    opt.step()
    assert opt.ledger == ((1.0, 0.1, 2),)
    assert all(not torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_step_ends_the_batch_it_was_given():
    """A step takes the backward() calls since the last step or zero_grad() and no others:
    a step with none since is noise only, and a batch after it without zero_grad() is
    clipped and summed on its own (the batch before must not count twice)."""
    model, clip, b = mlp(), 0.05, 4.0
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=0.0, max_grad_norm=clip,
                        expected_batch_size=b, sample_rate=0.1)
    loss = lambda out, t: nn.functional.cross_entropy(out, t, reduction="none")
    x, y = batch(4, seed=1)
    opt.zero_grad()
    loss(model(x), y).mean().backward()
    opt.step()
    after_first = [p.detach().clone() for p in model.parameters()]
    opt.step()  # nothing since the last step: noise only (none here)
    assert all(torch.equal(a, p) for a, p in zip(after_first, model.parameters()))
    reference = copy.deepcopy(model)
    x, y = batch(3, seed=2)
    loss(model(x), y).mean().backward()  # no zero_grad() in between
    opt.step()
    expected, _ = clipped_sum(per_example_gradients(reference, (x,), y, lambda m, x: m(x), loss), clip,
                              list(reference.parameters()))
    for p, a, e in zip(model.parameters(), after_first, expected):
        torch.testing.assert_close(p, a - e / b)
    assert opt.steps_taken == 3


def test_frozen_parameters_are_ignored():
    model = mlp()
    model[0].weight.requires_grad_(False)
    frozen = model[0].weight.detach().clone()
    x, y = batch(5)
    loss = lambda out, t: nn.functional.cross_entropy(out, t, reduction="none")
    check_rule_case(lambda: model, (x,), y, lambda m, x: m(x), loss)
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=4, sample_rate=0.1)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    assert torch.equal(model[0].weight, frozen)


def test_forward_without_backward_does_not_disturb_the_next_step():
    x, y = batch(6)
    loss = lambda out, t: nn.functional.cross_entropy(out, t, reduction="none")

    def forward(m, x):
        m(torch.randn(9, 6, dtype=torch.float64)).sum()  # evaluation with grad enabled, never backpropagated
        with torch.no_grad():
            m(x)
        return m(x)

    check_rule_case(mlp, (x,), y, forward, loss)


def test_no_grad_forward_keeps_nothing():
    model = mlp()
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=4, sample_rate=0.1)
    with torch.no_grad():
        out = model(batch(5)[0])
    assert out.grad_fn is None
    assert opt._engine.examples == 0


def test_two_optimizers_on_two_models_do_not_interfere():
    x, y = batch(6)
    loss = lambda out, t: nn.functional.cross_entropy(out, t, reduction="none")
    other = mlp(seed=3)
    other_opt = dpoptim.DPAdam(other.parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=0.1,
                               expected_batch_size=2, sample_rate=0.5)

    xo, yo = batch(6, seed=9)

    def forward(m, x):
        other_opt.zero_grad()
        nn.functional.cross_entropy(other(xo), yo).backward()  # the other model's backward
        return m(x)

    check_rule_case(mlp, (x,), y, forward, loss)
    assert other_opt._engine.examples == 6  # its own last backward, nothing of the other model


def test_dropping_the_optimizer_removes_its_hooks():
    model = mlp()
    def global_hooks():
        return len(nn.modules.module._global_forward_hooks) + len(nn.modules.module._global_forward_pre_hooks)

    gc.collect()  # optimizers dropped by earlier tests must not go away during this one
    hooks_before = global_hooks()
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=4, sample_rate=0.1)
    assert global_hooks() > hooks_before
    del opt
    gc.collect()
    assert global_hooks() == hooks_before
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())


def test_gradient_accumulation_over_micro_batches_equals_one_batch():
    x, y = batch(9)
    loss = lambda out, t: nn.functional.cross_entropy(out, t, reduction="none")
    check_rule_case(mlp, (x,), y, lambda m, x: m(x), loss, splits=[4, 0, 1, 4])
    check_rule_case(mlp, (x,), y, lambda m, x: m(x), loss, splits=[2, 7], reduction="sum")


def test_closure_is_supported():
    model, twin = mlp(), mlp()
    x, y = batch()
    dp = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=0.0, max_grad_norm=1e9,
                       expected_batch_size=10, sample_rate=0.1)
    ref = torch.optim.SGD(twin.parameters(), lr=0.1)

    def closure_for(m, opt):
        def closure():
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            return loss
        return closure

    assert torch.equal(dp.step(closure_for(model, dp)), ref.step(closure_for(twin, ref)))
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


def test_divisor_is_the_expected_batch_size_not_the_drawn_one():
    model, twin = mlp(), mlp()
    x, y = batch(3)
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=0.0, max_grad_norm=1e9,
                        expected_batch_size=12, sample_rate=0.1, loss_reduction="sum")
    opt.zero_grad()
    nn.functional.cross_entropy(model(x), y, reduction="sum").backward()
    opt.step()
    ref = torch.optim.SGD(twin.parameters(), lr=1.0)
    nn.functional.cross_entropy(twin(x), y, reduction="sum").div(12).backward()
    ref.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q)


@given(n=st.integers(1, 6), scale=st.floats(0.01, 100))
def test_every_example_contributes_at_most_c(n, scale):
    """With clipping, the noiseless update has norm at most n * C / B."""
    model = mlp()
    x, y = batch(n)
    before = [p.detach().clone() for p in model.parameters()]
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=0.0, max_grad_norm=0.05,
                        expected_batch_size=1, sample_rate=0.1)
    opt.zero_grad()
    nn.functional.cross_entropy(model(x * scale), y).backward()
    opt.step()
    delta = torch.sqrt(sum((b - p).square().sum() for b, p in zip(before, model.parameters())))
    assert delta <= n * 0.05 * (1 + 1e-9)


@given(n=st.integers(1, 6), drop=st.integers(0, 5), scale=st.floats(0.1, 100),
       reduction=st.sampled_from(["mean", "sum"]), micro=st.booleans())
def test_one_example_more_or_less_moves_the_update_by_at_most_c_over_b(n, drop, scale, reduction, micro):
    """The add/remove sensitivity of the noiseless update: D and D without one example give
    updates at most C / B apart, whatever the loss's reduction, however the batch is cut
    into backward calls, across parameter groups."""
    assume(reduction == "sum" or n > 1)  # (the mean of an empty batch is not a loss)
    clip, b = 0.05, 4.0
    x, y = batch(n)
    x = x * scale

    def update(keep):
        model = mlp()
        before = torch.cat([p.detach().flatten() for p in model.parameters()])
        groups = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]
        opt = dpoptim.DPSGD(groups, lr=1.0, noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=b,
                            sample_rate=0.1, loss_reduction=reduction)
        opt.zero_grad()
        parts = [keep[: len(keep) // 2], keep[len(keep) // 2:]] if micro and len(keep) > 1 else [keep]
        for part in parts:
            nn.functional.cross_entropy(model(x[part]), y[part], reduction=reduction).backward()
        opt.step()
        return torch.cat([p.detach().flatten() for p in model.parameters()]) - before

    everyone = list(range(n))
    fewer = everyone[: drop % n] + everyone[drop % n + 1:]
    moved = float((update(everyone) - update(fewer)).norm())
    assert moved <= clip / b * (1 + 1e-9)


def test_secure_mode_keeps_the_noise_scale_and_refuses_a_fixed_generator():
    sigma, clip, b = 0.9, 1.5, 3.0
    model = zero_loss_model()
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=sigma, max_grad_norm=clip,
                        expected_batch_size=b, sample_rate=0.01, secure_mode=True)
    opt.zero_grad()
    model(torch.zeros(2, 20000, dtype=torch.float64)).sum().backward()
    opt.step()
    noise = -model.weight.detach().flatten()
    n = noise.numel()
    assert abs(noise.var().item() / (sigma * clip / b) ** 2 - 1) < 6 * math.sqrt(2 / n)
    with pytest.raises(ValueError, match="secure_mode"):
        dpoptim.DPSGD(nn.Linear(2, 2).parameters(), lr=1.0, noise_multiplier=1.0, max_grad_norm=1.0,
                      expected_batch_size=1, sample_rate=0.1, secure_mode=True, generator=torch.Generator())


def test_expected_batch_size_far_from_the_observed_mean_warns_once():
    model = mlp()
    opt = dpoptim.DPSGD(model.parameters(), lr=0.0, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=40, sample_rate=0.5)
    sizes = torch.Generator().manual_seed(0)
    with pytest.warns(dpoptim.PrivacyWarning, match="expected_batch_size is 40") as record:
        for _ in range(60):
            n = int(torch.randint(8, 13, (1,), generator=sizes))  # varying sizes around 10
            x, y = batch(n)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert sum("expected_batch_size is" in str(w.message) for w in record) == 1


def test_privacy_spent_equals_the_accountant_and_the_budget_stops_before_overspending():
    from dpoptim import accounting

    model = zero_loss_model(10)
    budget = accounting.epsilon(1.0, 0.2, 5, 1e-5)
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=2, sample_rate=0.2, max_epsilon=budget * (1 + 1e-9))
    for step in range(5):
        opt.zero_grad()
        opt.step()
    assert opt.privacy_spent() == (pytest.approx(budget, rel=1e-12), 1e-5)
    assert opt.privacy_spent(accountant="rdp").epsilon == pytest.approx(accounting.epsilon(1.0, 0.2, 5, 1e-5, accountant="rdp"))
    before = model.weight.detach().clone()
    with pytest.raises(dpoptim.PrivacyBudgetExceeded, match="max_epsilon"):
        opt.step()
    assert torch.equal(model.weight, before) and opt.steps_taken == 5


def test_target_epsilon_calibrates_the_noise_and_sets_the_budget():
    from dpoptim import accounting

    opt = dpoptim.DPSGD(nn.Linear(2, 2).parameters(), lr=0.1, max_grad_norm=1.0, expected_batch_size=10,
                        sample_rate=0.01, target_epsilon=2.0, epochs=3)
    steps = 3 * 100
    assert opt.max_epsilon == 2.0
    eps = accounting.epsilon(opt.noise_multiplier, 0.01, steps, 1e-5)
    assert 1.98 <= eps <= 2.0
    # a part of an epoch is calibrated for as a whole step: 2.5 epochs of 3 batches are 8 steps
    opt = dpoptim.DPSGD(nn.Linear(2, 2).parameters(), lr=0.1, max_grad_norm=1.0, expected_batch_size=3,
                        sample_rate=0.3, target_epsilon=2.0, epochs=2.5)
    assert 1.98 <= accounting.epsilon(opt.noise_multiplier, 0.3, 8, 1e-5) <= 2.0
