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


def test_a_changed_clip_bound_scales_the_noise_with_it():
    """The clipped sums use the bound of the step, and so must the noise: N(0, sigma^2 C^2)
    with the new C, not the one the optimizer was built with (a larger C under the old
    noise would be a smaller effective noise multiplier)."""
    model = big_model()
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=4, sample_rate=0.01, generator=torch.Generator().manual_seed(0))
    for step, bound in enumerate([1.0, 4.0, 0.25, 2.0]):
        if step % 2:  # by attribute and by param group
            opt.max_grad_norm = bound
        else:
            for group in opt.param_groups:
                group["max_grad_norm"] = bound
        assert noise_std(opt, model) == pytest.approx(1.0 * bound / 4, rel=0.04)


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
    _stub_accounting(monkeypatch, calls)

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
    # re-evaluated at the new sigma: a change two steps after the last is a schedule, so the
    # ledger with one step at it is evaluated (no search)
    assert ("eps", ((1.0, 0.5, 2), (2.0, 0.5, 1))) in calls


def _stub_accounting(monkeypatch, calls: list):
    """A stub accountant, epsilon = sum of count / sigma (monotone, exact), that records its
    calls in ``calls``."""
    def epsilon_of_ledger(ledger, delta, accountant="pld"):
        calls.append(("eps", tuple(ledger)))
        return sum(count / sigma for sigma, _, count in ledger)

    def max_steps(sigma, q, delta, max_epsilon, ledger=(), accountant="pld", limit=None):
        calls.append(("max", sigma, q, max_epsilon, len(ledger)))
        spent = sum(count / s for s, _, count in ledger)
        return max(0, min(int((max_epsilon - spent) * sigma + 1e-9), limit))

    import dpoptim.accounting.ledger  # noqa: F401  (the optimizer's ledger type stays real)

    stub = types.ModuleType("dpoptim.accounting")
    stub.epsilon_of_ledger, stub.max_steps = epsilon_of_ledger, max_steps
    monkeypatch.setitem(sys.modules, "dpoptim.accounting", stub)
    monkeypatch.setattr(dpoptim, "accounting", stub, raising=False)


def _run_schedule(opt, sigma_at) -> int:
    """Steps with sigma_at(k) at step k until the budget stop refuses one; returns the
    steps taken."""
    k = 0
    while True:
        opt.noise_multiplier = sigma_at(k)
        try:
            opt.step()
        except dpoptim.PrivacyBudgetExceeded:
            return k
        k += 1


def _stub_schedule_to_budget(monkeypatch, budget: float, sigma_at) -> tuple:
    """``(calls, taken, opt)``: a schedule run on the stub accountant until the budget stop
    refuses a step, which must be exactly the first whose ledger exceeds ``budget``."""
    calls = []
    _stub_accounting(monkeypatch, calls)
    opt = dpoptim.DPSGD(nn.Linear(2, 2).parameters(), lr=0.1, noise_multiplier=sigma_at(0), max_grad_norm=1.0,
                        expected_batch_size=2, sample_rate=0.5, max_epsilon=budget)
    taken = _run_schedule(opt, sigma_at)
    spent = [1.0 / sigma_at(k) for k in range(taken + 1)]
    assert sum(spent[:taken]) <= budget < sum(spent)  # exactly the first step that does not fit is refused
    return calls, taken, opt


def test_a_schedule_that_changes_every_step_is_not_evaluated_every_step(monkeypatch):
    """Where sigma changes at every step, the budget stop asks whether spans of steps fit
    at a worse setting and takes the steps it dominates without asking; near the budget it
    evaluates each step, and it refuses exactly the first step that does not fit."""
    from dpoptim.spending import SCHEDULE_MARGIN

    budget = 100.0

    def sigma_at(k):
        return 2.0 - 0.002 * k

    calls, taken, opt = _stub_schedule_to_budget(monkeypatch, budget, sigma_at)
    assert taken > 150
    assert len(calls) < taken / 3  # far fewer questions than steps
    # one search, at the first step's own settings; then each question is about a span of
    # steps at a worse setting than the step that asked, against a lower budget
    assert [call[:4] for call in calls if call[0] == "max"] == [("max", 2.0, 0.5, budget)]
    spans = [call[1] for call in calls if call[0] == "eps" and call[1][-1][2] > 1]
    assert len(spans) >= 3
    for ledger in spans:
        sigma, q, _ = ledger[-1]
        assert q == pytest.approx(0.5 * (1 + SCHEDULE_MARGIN))
        assert sigma == pytest.approx(sigma_at(len(ledger) - 1) * (1 - SCHEDULE_MARGIN))
    # the refusal came from one evaluation of the ledger with the refused step itself (the
    # error message's privacy_spent() evaluates the ledger after it)
    assert calls[-2] == ("eps", opt.ledger + ((sigma_at(taken), 0.5, 1),))


def test_a_schedule_that_changes_every_few_steps_is_not_searched_at_every_change(monkeypatch):
    """Sigma changing every third step: no max_steps search at each change, and still
    exactly the first step that does not fit is refused."""
    calls, taken, _ = _stub_schedule_to_budget(monkeypatch, 200.0, lambda k: 2.0 - 0.001 * (k // 3))
    assert taken > 300 and len(calls) < taken / 8  # (one evaluation a step over the budget's last share)
    assert len([call for call in calls if call[0] == "max"]) == 1  # the first step's own search only


def test_a_schedule_step_that_leaves_the_covered_setting_is_asked_about(monkeypatch):
    """A step noisier than the covered setting is taken without asking; one less noisy (or
    at a higher q) is asked about before it is taken, never refused on the other's answer."""
    calls = []
    _stub_accounting(monkeypatch, calls)
    opt = dpoptim.DPSGD(nn.Linear(2, 2).parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=2, sample_rate=0.5, max_epsilon=50.0)
    for sigma in (1.0, 1.001, 1.002, 1.5):  # a schedule; the last step noisier still
        opt.noise_multiplier = sigma
        opt.step()
    before = len(calls)
    opt.noise_multiplier = 1.003
    opt.step()
    assert len(calls) == before  # covered: at least as noisy as the worse setting asked about
    opt.sample_rate = 0.6  # as noisy, but sampled more often: asked about before it is taken
    opt.step()
    assert len(calls) > before
    opt.sample_rate = 0.5
    before = len(calls)
    opt.noise_multiplier = 0.5  # far below it: asked again, and it fits
    opt.step()
    assert len(calls) > before
    opt.sample_rate = 0.9
    opt.noise_multiplier = 0.51
    before = len(calls)
    opt.step()
    assert len(calls) > before
    assert opt.steps_taken == 8


def test_the_budget_stop_asks_again_where_q_rises_on_a_covered_schedule():
    """The real accountant: sigma changes at every step, so spans of steps are covered by
    one answer at a worse setting; then q jumps far above the covered q. Every step taken
    must stay within the budget, whatever the earlier answer covered."""
    budget = 3.0
    opt = dpoptim.DPSGD(nn.Linear(2, 2).parameters(), lr=0.0, noise_multiplier=2.0, max_grad_norm=1.0,
                        expected_batch_size=2, sample_rate=0.01, max_epsilon=budget)
    taken = 0
    with pytest.raises(dpoptim.PrivacyBudgetExceeded):
        for k in range(400):
            opt.noise_multiplier = 2.0 - 0.001 * k
            opt.sample_rate = 0.01 if k < 4 else 0.5
            opt.step()
            taken += 1
            assert opt.privacy_spent().epsilon <= budget, (taken, opt.ledger)
    assert 4 < taken < 400


def test_the_budget_stop_on_a_schedule_stops_where_the_accountant_says(monkeypatch):
    """The real accountant: a sigma schedule that changes at every step runs to the budget;
    every prefix taken is within it by the accountant, the refused step is not, and the
    accountant was asked fewer times than there were steps."""
    from dpoptim import accounting

    asked = []
    for name in ("epsilon_of_ledger", "max_steps"):
        real = getattr(accounting, name)
        monkeypatch.setattr(accounting, name, lambda *a, real=real, **k: asked.append(a) or real(*a, **k))
    budget, q = 2.0, 0.05
    opt = dpoptim.DPSGD(nn.Linear(2, 2).parameters(), lr=0.1, noise_multiplier=1.2, max_grad_norm=1.0,
                        expected_batch_size=2, sample_rate=q, max_epsilon=budget)

    def sigma_at(k):
        return 1.2 - 0.002 * k

    with pytest.warns(dpoptim.PrivacyWarning):  # (no data: the batches hold no examples)
        taken = _run_schedule(opt, sigma_at)
    assert 30 < taken and len(asked) < taken / 2
    monkeypatch.undo()
    runs = [(sigma_at(k), q, 1) for k in range(taken + 1)]
    assert all(accounting.epsilon_of_ledger(runs[:n], 1e-5) <= budget for n in range(1, taken + 1, 7))
    assert accounting.epsilon_of_ledger(runs[:taken], 1e-5) <= budget < accounting.epsilon_of_ledger(runs, 1e-5)


def test_a_raised_budget_starts_the_schedule_questions_afresh(monkeypatch):
    """Near a budget every step is evaluated; after max_epsilon is raised the stop asks
    about spans again, and still refuses exactly where the new budget runs out."""
    def sigma_at(k):
        return 2.0 - 0.001 * k

    calls, taken, opt = _stub_schedule_to_budget(monkeypatch, 30.0, sigma_at)
    opt.max_epsilon = 150.0
    before, start = len(calls), taken
    k = taken
    while True:
        opt.noise_multiplier = sigma_at(k)
        try:
            opt.step()
        except dpoptim.PrivacyBudgetExceeded:
            break
        k += 1
    spent = [1.0 / sigma_at(j) for j in range(k + 1)]
    assert sum(spent[:k]) <= 150.0 < sum(spent)
    assert k - start > 200 and len(calls) - before < (k - start) / 8
