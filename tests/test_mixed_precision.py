"""Mixed precision: bfloat16 autocast (CPU, and CUDA when present) against a float32 oracle,
and torch.amp.GradScaler: the scale is divided out before clipping, an overflowing example
is dropped while the step is still taken and charged, and the scale never reacts to data."""

import copy
import warnings

import pytest
import torch
from torch import nn

import dpoptim
from oracle import clipped_sum, per_example_gradients

CUDA = torch.cuda.is_available()


def mse(out, y):
    return 0.5 * (out.float() - y).square().sum(1)


def setup(device="cpu", n=12, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4)).to(device)
    x, y = torch.randn(n, 16, device=device), torch.randn(n, 4, device=device)
    reference = copy.deepcopy(model)
    grads = per_example_gradients(reference, (x,), y, lambda m, x: m(x), mse)
    norms = sorted(float(torch.sqrt(sum(g.square().sum() for g in gs))) for gs in grads)
    bound = norms[n // 2]  # half the examples are clipped
    expected, _ = clipped_sum(grads, bound, list(reference.parameters()))
    return model, x, y, bound, expected


def dp(model, bound, **kw):
    kw = {"noise_multiplier": 0.0, **kw}
    return dpoptim.DPSGD(model.parameters(), lr=1.0, max_grad_norm=bound, expected_batch_size=1, sample_rate=0.5, **kw)


def update(model, before):
    return [b - p.detach() for b, p in zip(before, model.parameters())]


def assert_close(got, expected, rtol):
    for g, e in zip(got, expected):
        assert g.dtype == torch.float32 and torch.isfinite(g).all()
        assert (g - e).norm() <= rtol * e.norm(), f"relative error {float((g - e).norm() / e.norm()):.2e}"


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if CUDA else []))
def test_bfloat16_autocast_matches_the_float32_oracle(device):
    model, x, y, bound, expected = setup(device)
    opt = dp(model, bound)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast(device, dtype=torch.bfloat16):
        out = model(x)
    assert out.dtype == torch.bfloat16
    mse(out, y).mean().backward()
    opt.step()  # the first step also runs the engine's check against autograd
    assert_close(update(model, before), expected, rtol=2e-2)  # bf16 has 8 significant bits


def test_bfloat16_autocast_still_adds_the_noise():
    model, x, y, bound, _ = setup()
    clean, noisy = copy.deepcopy(model), copy.deepcopy(model)
    for m, sigma in ((clean, 0.0), (noisy, 3.0)):
        opt = dp(m, bound, noise_multiplier=sigma, generator=torch.Generator().manual_seed(0))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            mse(m(x), y).mean().backward()
        opt.step()
    diff = torch.cat([(a - b).flatten() for a, b in zip(clean.parameters(), noisy.parameters())])
    # the parameters are float32, so is the noise: N(0, (sigma C / B)^2) per coordinate
    assert torch.isfinite(diff).all()
    assert diff.std().item() == pytest.approx(3.0 * bound, rel=0.1)


def scaler_for(device, **kw):
    kw = {"init_scale": 2.0**10, "growth_interval": 2**31 - 1, **kw}
    return torch.amp.GradScaler(device, **kw)


def scaled_step(model, opt, scaler, x, y, dtype=None, device="cpu"):
    opt.zero_grad()
    with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
        loss = mse(model(x), y).mean()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("cls", [dpoptim.DPSGD, dpoptim.make_private(torch.optim.SGD)])
def test_grad_scaler_scale_is_divided_out_before_clipping(cls):
    model, x, y, bound, expected = setup()
    scaler = scaler_for("cpu")
    opt = cls(model.parameters(), lr=1.0, noise_multiplier=0.0, max_grad_norm=bound, expected_batch_size=1,
              sample_rate=0.5, grad_scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    scaled_step(model, opt, scaler, x, y)
    # with the scale left in, the clip bound would be 1024 times too small and the update 1024x off
    assert_close(update(model, before), expected, rtol=1e-5)
    assert opt.steps_taken == 1


def test_fused_optimizer_does_not_unscale_twice_or_skip():
    """GradScaler hands a fused optimizer grad_scale/found_inf to unscale and skip itself;
    the DP step has already unscaled, and must never skip."""
    results = []
    for use_scaler in (False, True):
        model, x, y, bound, _ = setup()
        model.train()
        scaler = scaler_for("cpu") if use_scaler else None
        opt = dpoptim.make_private(torch.optim.Adam)(
            model.parameters(), lr=0.01, fused=True, noise_multiplier=0.0, max_grad_norm=bound,
            expected_batch_size=4, sample_rate=0.5, grad_scaler=scaler)
        for _ in range(2):
            if scaler is None:
                opt.zero_grad()
                mse(model(x), y).mean().backward()
                opt.step()
            else:
                scaled_step(model, opt, scaler, x, y)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)


def test_overflowing_example_is_dropped_step_taken_and_scale_unchanged():
    model, x, y, bound, _ = setup()
    y[3] = 1e37  # times the scale 2^10, its output gradient overflows float32
    keep = [i for i in range(len(x)) if i != 3]
    reference = copy.deepcopy(model)
    expected, _ = clipped_sum(per_example_gradients(reference, (x[keep],), y[keep], lambda m, x: m(x), mse), bound,
                              list(reference.parameters()))
    scaler = scaler_for("cpu")
    opt = dp(model, bound, grad_scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(dpoptim.PrivacyWarning, match="non-finite"):
        scaler.scale(mse(model(x), y).mean()).backward()
    assert not all(torch.isfinite(p.grad).all() for p in model.parameters())  # GradScaler sees the overflow
    scaler.step(opt)
    scaler.update()
    assert opt.steps_taken == 1  # GradScaler would have skipped this step
    assert scaler.get_scale() == 2.0**10  # and halved its scale: a bit of information about the data
    assert_close(update(model, before), expected, rtol=1e-5)


def test_overflow_still_gets_its_noise():
    model, x, y, bound, _ = setup()
    y[0] = 1e37
    scaler = scaler_for("cpu")
    opt = dp(model, bound, grad_scaler=scaler, noise_multiplier=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.warns(dpoptim.PrivacyWarning):
        for _ in range(2):
            scaled_step(model, opt, scaler, x, y)
    moved = update(model, before)
    assert all(torch.isfinite(m).all() and m.abs().sum() > 0 for m in moved)
    assert opt.ledger == ((1.0, 0.5, 2),)


def test_growing_scale_is_deterministic_and_warned():
    model, x, y, bound, expected = setup()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4, growth_interval=1)
    with pytest.warns(UserWarning, match="fixed scale"):
        opt = dp(model, bound, grad_scaler=scaler)
    y_bad = y.clone()
    y_bad[0] = 3e38  # overflows once scaled
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dpoptim.PrivacyWarning)
        for step in range(3):
            scaled_step(model, opt, scaler, x, y_bad if step == 1 else y)
            assert scaler.get_scale() == 2.0 ** (5 + step)  # grows every step, overflow or not


def test_scaler_unknown_to_the_optimizer_is_refused():
    model, x, y, bound, _ = setup()
    scaler = scaler_for("cpu")
    opt = dp(model, bound)
    with pytest.raises(RuntimeError, match="grad_scaler=scaler"):
        scaled_step(model, opt, scaler, x, y)
    assert opt.steps_taken == 0


@pytest.mark.parametrize("device", [
    "cpu",  # torch's CPU autocast has float16 too; CUDA is where it is used
    pytest.param("cuda", marks=pytest.mark.skipif(not CUDA, reason="needs CUDA")),
])
def test_float16_autocast_with_grad_scaler(device):
    model, x, y, bound, expected = setup(device)
    scaler = scaler_for(device, init_scale=2.0**12)
    opt = dp(model, bound, grad_scaler=scaler)
    before = [p.detach().clone() for p in model.parameters()]
    scaled_step(model, opt, scaler, x, y, dtype=torch.float16, device=device)
    assert_close(update(model, before), expected, rtol=1e-2)
    # an example whose float16 gradient overflows is dropped; the step and the scale go on
    y2 = y.clone()
    y2[5] = 1e4  # its output gradient, 1e4 / 12 unscaled, overflows float16 once scaled by 2^12
    model2, _, _, _, _ = setup(device)
    opt2 = dp(model2, bound, grad_scaler=scaler, noise_multiplier=1.0)
    with pytest.warns(dpoptim.PrivacyWarning, match="non-finite"):
        scaled_step(model2, opt2, scaler, x, y2, dtype=torch.float16, device=device)
    assert opt2.steps_taken == 1 and scaler.get_scale() == 2.0**12
    assert all(torch.isfinite(p).all() for p in model2.parameters())
