"""Checkpoints carry the privacy ledger, the step count and a seeded noise generator, so a
resumed run continues bit for bit; a default generator's state is never saved."""

import io

import pytest
import torch
from torch import nn

import dpoptim


def make(seed_noise, cls=dpoptim.DPAdam):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    generator = None if seed_noise is None else torch.Generator().manual_seed(seed_noise)
    opt = cls(model.parameters(), lr=0.05, noise_multiplier=1.3, max_grad_norm=0.7, expected_batch_size=5,
              sample_rate=0.1, generator=generator)
    return model, opt


def batches(count, seed):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(int(torch.randint(0, 9, (), generator=g)), 6, generator=g), None) for _ in range(count)]


def train(model, opt, data, noise_at=None):
    for step, (x, _) in enumerate(data):
        if noise_at is not None and step in noise_at:
            opt.noise_multiplier = noise_at[step]
        opt.zero_grad()
        model(x).square().sum(1).mean().backward()
        opt.step()


def save(model, opt):
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.parametrize("cls", [dpoptim.DPAdam, dpoptim.DPSGD])
def test_resume_continues_bit_for_bit(cls):
    data = batches(7, seed=1)
    k = 4
    # uninterrupted: k steps, checkpoint, m more steps
    model, opt = make(11, cls)
    train(model, opt, data[:k], noise_at={2: 0.9})
    checkpoint = save(model, opt)
    train(model, opt, data[k:])
    # resumed: fresh objects (another seed, another sigma), load, the same m steps
    model2, opt2 = make(999, cls)
    opt2.noise_multiplier = 5.0
    state = torch.load(checkpoint, weights_only=True)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optimizer"])
    assert opt2.steps_taken == k
    assert opt2.noise_multiplier == 0.9  # the schedule's value in force at the checkpoint
    train(model2, opt2, data[k:])
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)
    assert opt2.ledger == opt.ledger == ((1.3, 0.1, 2), (0.9, 0.1, 5))
    assert opt2.steps_taken == opt.steps_taken == 7


def test_noise_really_comes_from_the_saved_generator_state():
    """Without the generator state the continuation differs (the test above can fail)."""
    data = batches(4, seed=2)
    model, opt = make(11)
    train(model, opt, data[:2])
    checkpoint = torch.load(save(model, opt), weights_only=True)
    train(model, opt, data[2:])
    model2, opt2 = make(999)
    model2.load_state_dict(checkpoint["model"])
    checkpoint["optimizer"]["dpoptim"]["generator"] = None
    opt2.load_state_dict(checkpoint["optimizer"])
    train(model2, opt2, data[2:])
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def test_default_generator_state_is_not_saved():
    data = batches(2, seed=3)
    model, opt = make(None)
    train(model, opt, data)
    state = opt.state_dict()
    assert state["dpoptim"]["generator"] is None
    assert state["dpoptim"]["steps_taken"] == 2
    # two resumptions from one checkpoint draw different noise: nothing predicts it
    results = []
    for _ in range(2):
        m, o = make(None)
        m.load_state_dict(model.state_dict())
        o.load_state_dict(torch.load(save(model, opt), weights_only=True)["optimizer"])
        train(m, o, data[:1])
        results.append([p.detach().clone() for p in m.parameters()])
    assert not torch.equal(results[0][0], results[1][0])


def test_checkpoint_without_ledger_or_with_a_broken_one_is_refused():
    model, opt = make(1)
    train(model, opt, batches(1, seed=4))
    plain = torch.optim.Adam(model.parameters()).state_dict()
    with pytest.raises(ValueError, match="ledger"):
        opt.load_state_dict(plain)
    broken = opt.state_dict()
    broken["dpoptim"]["steps_taken"] = 5
    with pytest.raises(ValueError, match="ledger"):
        opt.load_state_dict(broken)


def test_privacy_spent_never_dips_below_an_earlier_report_of_the_same_run(monkeypatch):
    """The accountant may bound a longer ledger slightly lower (its grid and groups are
    chosen per ledger); the earlier bound holds for the longer ledger too and is kept."""
    import dpoptim.accounting as accounting

    bounds = {1: 2.0, 2: 1.9, 3: 2.1}  # by steps taken: the second bound dips
    monkeypatch.setattr(accounting, "epsilon_of_ledger",
                        lambda ledger, delta, accountant: bounds[sum(run[2] for run in ledger)] * (1e-5 / delta))
    model, opt = make(3)
    reported = []
    for x, _ in batches(3, seed=2):
        train(model, opt, [(x, None)])
        reported.append(opt.privacy_spent().epsilon)
    assert reported == [2.0, 2.0, 2.1]
    assert opt.privacy_spent(delta=1e-6).epsilon == pytest.approx(21.0)  # each delta on its own
    # A ledger that no longer begins with the earlier one (a checkpoint's replacing it) starts afresh.
    fresh_model, fresh = make(4)
    train(fresh_model, fresh, batches(2, seed=3), noise_at={1: 0.9})
    opt.load_state_dict(fresh.state_dict(), ledger="checkpoint")
    assert opt.ledger == fresh.ledger and opt.privacy_spent().epsilon == 1.9


def test_privacy_spent_keeps_the_larger_bound_where_the_accountant_dips_on_one_more_pair():
    """The dip docs/accounting.md reports: 79 pairs of a sigma and q schedule, then 80."""
    from dpoptim.accounting import epsilon_of_ledger

    ends = ((0.7479678101221281, 1.307943823202928), (0.0007204642648023441, 0.00017334219174971498))
    runs = [tuple(a * (b / a) ** (k / 122) for a, b in ends) + (100,) for k in range(80)]
    delta = 8.166720227646929e-11
    _, opt = make(5)
    opt._ledger = runs[:79]
    first = opt.privacy_spent(delta).epsilon
    assert first == epsilon_of_ledger(runs[:79], delta)
    opt._ledger = runs
    assert opt.privacy_spent(delta).epsilon == max(first, epsilon_of_ledger(runs, delta))


@pytest.mark.parametrize("how", ["continued", "both"])
def test_the_budget_stop_follows_a_ledger_that_loading_made_longer(how):
    """The budget stop keeps its answer between steps; a load that adds steps to the ledger
    (a fresh run resuming a longer one of its own, or another run's history charged too)
    must make it ask again: every step taken after it stays within max_epsilon, and it stops
    exactly where the accountant says."""
    from dpoptim import accounting

    def optimizer(model, q, **kwargs):
        return dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0,
                             expected_batch_size=4, sample_rate=q, **kwargs)

    def step(model, opt):
        opt.zero_grad()
        model(torch.randn(int(torch.randint(1, 8, ())), 3)).sum().backward()  # (Poisson-like sizes)
        opt.step()

    torch.manual_seed(0)
    earlier = nn.Linear(3, 2)
    earlier_opt = optimizer(earlier, 0.05 if how == "continued" else 0.2)
    for _ in range(2 if how == "both" else 40):
        step(earlier, earlier_opt)
    saved = earlier_opt.state_dict()
    model = nn.Linear(3, 2)
    opt = optimizer(model, 0.05, max_epsilon=3.0)
    step(model, opt)  # the budget stop answers for a ledger of one step
    with pytest.warns(dpoptim.PrivacyWarning, match="constructor's privacy settings"):
        opt.load_state_dict(saved, ledger="both" if how == "both" else None)
    loaded = opt.ledger
    assert sum(count for _, _, count in loaded) > 1
    taken = 0
    with pytest.raises(dpoptim.PrivacyBudgetExceeded):
        for _ in range(500):
            step(model, opt)
            taken += 1
            assert opt.privacy_spent().epsilon <= 3.0
    assert taken == accounting.max_steps(1.0, 0.05, 1e-5, 3.0, ledger=list(loaded))
