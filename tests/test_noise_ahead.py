"""Noise drawn a step ahead (dpoptim.noise): every buffer is used once at most, only for
the parameters, dtype and generator it was drawn for; a seeded generator is never drawn
from ahead, so its runs keep their values and order."""

import pytest
import torch
from torch import nn

import dpoptim
from dpoptim import noise

SIGMA, CLIP = 1.0, 1.0

#: A later step's noise is read back as the difference of two weights, exact to a few
#: units in the last place of the weight (about 1), not of the noise: a draw near 0 would
#: fail a purely relative test now and then (secure mode draws unseeded).
EXACT = {"rtol": 1e-12, "atol": 1e-12}


@pytest.fixture
def drawn(monkeypatch):
    """Every buffer drawn for the optimizers' own generators, in the order drawn (the
    threshold lowered so that small models draw ahead too)."""
    monkeypatch.setattr(noise, "PREDRAW_MIN", 1)
    monkeypatch.setattr(noise.NoiseMixin, "_predraw_noise", True)  # plain mode too
    buffers = []
    real = noise._draw

    def spy(*args):
        z = real(*args)
        buffers.append(z.clone())
        return z

    monkeypatch.setattr(noise, "_draw", spy)
    return buffers


def zero_gradient_model(size=40, bias=False, dtype=torch.float64):
    """Zero weights and a loss with zero gradient: a step with lr=1 and B=1 moves each
    parameter by minus its noise exactly."""
    model = nn.Linear(size, 3, bias=bias).to(dtype)
    for p in model.parameters():
        nn.init.zeros_(p)
    return model


def optimizer(params, **kwargs):
    return dpoptim.DPSGD(params, lr=1.0, noise_multiplier=SIGMA, max_grad_norm=CLIP, expected_batch_size=1,
                         sample_rate=0.01, **kwargs)


def noise_of_step(model, opt) -> list:
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    x = torch.zeros(2, model.in_features, dtype=next(model.parameters()).dtype)
    (model(x) * 0).sum().backward()
    opt.step()
    return [(b - p.detach()).flatten() for b, p in zip(before, model.parameters())]


def flat(noises) -> torch.Tensor:
    return torch.cat(noises)


def settle(opt) -> None:
    """Wait for the draws running ahead, so that ``drawn`` holds them."""
    for pending in opt._pending.values():
        pending.future.result()


def test_each_buffer_drawn_ahead_serves_one_step_and_no_other(drawn):
    model = zero_gradient_model(bias=True)
    opt = optimizer(model.parameters())
    steps = [flat(noise_of_step(model, opt)) for _ in range(4)]
    settle(opt)
    # the first step draws in step(); each step then draws the next one's ahead
    assert len(drawn) == len(steps) + 1
    for i, z in enumerate(steps):
        assert torch.allclose(z, SIGMA * CLIP * drawn[i], **EXACT)
    for i in range(len(steps)):
        for j in range(i + 1, len(steps)):
            assert not torch.allclose(steps[i], steps[j])
    assert len(opt._pending) == 1  # the fifth buffer waits for a fifth step


def test_a_changed_noise_multiplier_scales_the_next_buffer_without_reusing_one(drawn):
    model = zero_gradient_model()
    opt = optimizer(model.parameters())
    first = flat(noise_of_step(model, opt))
    opt.noise_multiplier = 3.0
    second = flat(noise_of_step(model, opt))
    assert torch.allclose(first, SIGMA * CLIP * drawn[0], **EXACT)
    assert torch.allclose(second, 3.0 * CLIP * drawn[1], **EXACT)
    assert not torch.allclose(second / 3.0, first)


def test_new_parameters_drop_the_buffer_drawn_for_the_old_ones(drawn):
    model = zero_gradient_model()
    opt = optimizer(model.parameters())
    noise_of_step(model, opt)
    extra = nn.Parameter(torch.zeros(5, dtype=torch.float64))
    opt.add_param_group({"params": [extra]})
    opt.zero_grad()
    (model(torch.zeros(2, model.in_features, dtype=torch.float64)) * 0).sum().backward()
    before = model.weight.detach().clone()
    opt.step()
    second = (before - model.weight.detach()).flatten()
    settle(opt)
    # drawn[1] was drawn ahead for the weight alone: dropped; drawn[2] covers weight and extra
    assert len(drawn) == 4 and drawn[1].numel() == second.numel() and drawn[2].numel() == second.numel() + 5
    assert not torch.allclose(second, drawn[1][: second.numel()])
    assert torch.allclose(second, drawn[2][: second.numel()], **EXACT)
    assert torch.allclose(-extra.detach(), drawn[2][second.numel():], **EXACT)


def test_a_changed_dtype_drops_the_buffer_of_the_old_dtype(drawn):
    model = zero_gradient_model()
    opt = optimizer(model.parameters())
    noise_of_step(model, opt)
    settle(opt)
    model.float()  # the same parameters, now float32
    second = flat(noise_of_step(model, opt))
    settle(opt)
    assert drawn[1].dtype == torch.float64 and drawn[2].dtype == torch.float32
    assert torch.allclose(second, drawn[2], rtol=0, atol=1e-5)  # float32 differences of parameters
    assert not torch.allclose(second, drawn[1].float(), rtol=0, atol=1e-2)
    assert list(opt._pending) == [(torch.device("cpu"), torch.float32)]  # the float64 buffer is gone


def test_secure_mode_draws_ahead_from_a_fresh_generator_every_time(drawn, monkeypatch):
    fresh = []
    real = noise.fresh_generator
    monkeypatch.setattr(noise, "fresh_generator", lambda device: fresh.append(real(device)) or fresh[-1])
    model = zero_gradient_model()
    opt = optimizer(model.parameters(), secure_mode=True)
    steps = [flat(noise_of_step(model, opt)) for _ in range(3)]
    settle(opt)
    assert len(fresh) == len(drawn) == 4 and len({id(g) for g in fresh}) == 4
    for i, z in enumerate(steps):
        assert torch.allclose(z, drawn[i], **EXACT)
    assert not opt._generators  # no generator is kept between draws


def test_a_seeded_generator_is_never_drawn_from_ahead(drawn):
    """The noise of a seeded run is the per-parameter draws of that generator, in the order
    of the parameter groups, and nothing else is drawn from it."""
    model = zero_gradient_model(bias=True)
    generator, twin = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    opt = optimizer(model.parameters(), generator=generator)
    for _ in range(2):
        noises = noise_of_step(model, opt)
        expected = [torch.randn(p.shape, generator=twin, dtype=p.dtype).flatten() for p in model.parameters()]
        for got, want in zip(noises, expected):
            assert torch.allclose(got, SIGMA * CLIP * want, **EXACT)
        assert torch.equal(generator.get_state(), twin.get_state())
    assert drawn == [] and not opt._pending


def test_a_checkpoint_never_holds_the_buffer_drawn_ahead(drawn):
    model = zero_gradient_model()
    opt = optimizer(model.parameters())
    noise_of_step(model, opt)
    settle(opt)
    pending = drawn[-1]
    state = opt.state_dict()
    tensors = [v for v in _leaves(state) if isinstance(v, torch.Tensor)]
    assert not any(t.numel() == pending.numel() for t in tensors)
    assert state["dpoptim"]["generator"] is None
    resumed = optimizer(zero_gradient_model().parameters())
    resumed.load_state_dict(state)
    assert not resumed._pending


def _leaves(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _leaves(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _leaves(v)
    else:
        yield obj


@pytest.mark.parametrize("secure", [False, True])
def test_large_secure_cpu_draws_go_ahead_and_others_stay_in_step(secure):
    """By default only secure mode draws ahead: plain draws are cheap enough that holding a
    copy of the parameters from one step to the next is not worth it."""
    small, large = nn.Linear(10, 10), nn.Linear(300, 300)
    for model in (small, large):
        opt = optimizer(model.parameters(), secure_mode=secure)
        opt.zero_grad()
        model(torch.randn(2, model.in_features)).sum().backward()
        opt.step()
        assert bool(opt._pending) == (secure and model is large)


def test_a_forked_process_never_continues_the_parents_noise(drawn, monkeypatch):
    """A child forked after a step holds copies of the optimizer's generator and of the
    buffer drawn ahead: using either would give parent and child the same noise."""
    model = zero_gradient_model()
    opt = optimizer(model.parameters())
    noise_of_step(model, opt)
    settle(opt)
    parents = dict(opt._generators)
    parent_pid = noise.os.getpid()
    monkeypatch.setattr(noise.os, "getpid", lambda: parent_pid + 1)  # now "in the child"
    child = flat(noise_of_step(model, opt))
    settle(opt)
    assert len(drawn) == 4  # drawn[1], the parent's buffer, was dropped: drawn[2] is the child's
    assert torch.allclose(child, drawn[2], **EXACT)
    assert not torch.allclose(child, drawn[1])
    assert all(opt._generators[d] is not g for d, g in parents.items())
