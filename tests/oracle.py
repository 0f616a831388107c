"""The brute-force reference every rule is tested against.

For each example on its own: forward, its loss, autograd gradients of all trainable
parameters, clip to C in the global L2 norm, sum. No dpoptim code is involved.
"""

from __future__ import annotations

import copy

import torch

import dpoptim


def generator_states():
    """The states of the default generators (CPU, and every CUDA device if any)."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)


def set_generator_states(states) -> None:
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)


def _slice(x, i, dim):
    if isinstance(x, torch.Tensor):
        return x.narrow(dim, i, 1)
    if isinstance(x, (tuple, list)):
        return type(x)(_slice(v, i, dim) for v in x)
    return x


def per_example_gradients(model, inputs, targets, forward, loss, batch_dims=None, rng=None):
    """List over examples of [grad per trainable parameter] (zeros where unused).

    ``inputs`` is a tuple of model inputs; ``batch_dims`` gives each one's batch dimension
    (default 0). ``forward(model, *inputs) -> output``, ``loss(output, targets) -> [n]``.

    With ``rng`` (from :func:`generator_states`) the model draws random numbers (dropout): example
    ``i``'s gradient is then that of its own loss term in a forward of the whole batch with
    the generator set to ``rng``, so every example sees the masks the batch saw. Valid for
    models in which examples do not interact.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    batch_dims = batch_dims or (0,) * len(inputs)
    n = inputs[0].shape[batch_dims[0]] if isinstance(inputs[0], torch.Tensor) else len(targets)
    grads = []
    for i in range(n):
        if rng is None:
            xs = tuple(_slice(x, i, d) for x, d in zip(inputs, batch_dims))
            li = loss(forward(model, *xs), _slice(targets, i, 0)).sum()
        else:
            set_generator_states(rng)
            li = loss(forward(model, *inputs), targets)[i]
        g = torch.autograd.grad(li, params, allow_unused=True)
        grads.append([torch.zeros_like(p) if gi is None else gi for p, gi in zip(params, g)])
    return grads


def clipped_sum(per_example, max_grad_norm, params):
    total = [torch.zeros_like(p) for p in params]
    norms = []
    for grads in per_example:
        norm = torch.sqrt(sum(g.square().sum() for g in grads))
        norms.append(float(norm))
        factor = min(1.0, max_grad_norm / float(norm)) if float(norm) > 0 else 1.0
        total = [t + factor * g for t, g in zip(total, grads)]
    return total, norms


def dp_clipped_sum(model, batches, max_grad_norm, forward, loss, reduction="mean", optimizer=None, rng=None):
    """What a DPSGD step does to the parameters with lr=1, no noise, expected batch 1:
    minus the clipped sum over all examples of all ``batches`` (one backward each).
    ``rng``: the generator states (:func:`generator_states`) to start every forward from."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = optimizer or dpoptim.DPSGD(
        params, lr=1.0, noise_multiplier=0.0, max_grad_norm=max_grad_norm,
        expected_batch_size=1, sample_rate=0.5, loss_reduction=reduction,
    )
    before = [p.detach().clone() for p in params]
    opt.zero_grad()
    for inputs, targets in batches:
        if rng is not None:
            set_generator_states(rng)
        losses = loss(forward(model, *inputs), targets)
        (losses.mean() if reduction == "mean" else losses.sum()).backward()
    opt.step()
    return [b - p.detach() for b, p in zip(before, params)]


def check_rule_case(make_model, inputs, targets, forward, loss, max_grad_norm=None, batch_dims=None,
                    reduction="mean", splits=None, rtol=1e-7, random=False):
    """Compare dpoptim's clipped sum with the brute-force one; raise listing every mismatch.

    ``max_grad_norm=None`` picks the median per-example norm, so some examples are clipped
    and some are not. ``splits`` cuts the batch into micro-batches (one backward each).
    ``random=True``: the model draws random numbers (dropout in training); every forward
    then starts from one generator state (see :func:`per_example_gradients`).
    """
    torch.manual_seed(0)
    model = make_model()
    reference = copy.deepcopy(model)
    params = [p for p in reference.parameters() if p.requires_grad]
    rng = generator_states() if random else None
    assert not (random and splits), "micro-batches draw their own masks"
    grads = per_example_gradients(reference, inputs, targets, forward, loss, batch_dims, rng)
    if max_grad_norm is None:
        norms = sorted(float(torch.sqrt(sum(g.square().sum() for g in gs))) for gs in grads)
        max_grad_norm = norms[len(norms) // 2] if norms and norms[len(norms) // 2] > 0 else 1.0
    expected, _ = clipped_sum(grads, max_grad_norm, params)

    batches = [(inputs, targets)]
    if splits:
        batches, start = [], 0
        dims = batch_dims or (0,) * len(inputs)
        for size in splits:
            batches.append((tuple(x.narrow(d, start, size) for x, d in zip(inputs, dims)), targets[start:start + size]))
            start += size
    params = [p for p in model.parameters() if p.requires_grad]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    opt = dpoptim.DPSGD(
        params, lr=1.0, noise_multiplier=0.0, max_grad_norm=max_grad_norm,
        expected_batch_size=1, sample_rate=0.5, loss_reduction=reduction,
    )
    start = [p.detach().clone() for p in params]
    problems = []
    # The first step is also checked against autograd by the engine; later steps let the
    # engine skip autograd's weight gradients. Both must match the oracle.
    for attempt in ("first step", "later step"):
        got = dp_clipped_sum(model, batches, max_grad_norm, forward, loss, reduction, optimizer=opt, rng=rng)
        for name, e, g in zip(names, expected, got):
            if e.shape != g.shape:
                problems.append(f"{attempt}, {name}: shape {tuple(g.shape)} != {tuple(e.shape)}")
                continue
            scale = e.abs().max().item() if e.numel() else 0.0
            err = (e - g).abs().max().item() if e.numel() else 0.0
            if not err <= rtol * max(scale, 1e-12) + 1e-12:
                problems.append(f"{attempt}, {name}: max error {err:.3e} (scale {scale:.3e})")
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
    assert not problems, "dpoptim differs from the per-example oracle:\n" + "\n".join(problems)
    return max_grad_norm


def assert_trains_with_noise(model, x, y, lr=2.0, steps=20, factor=0.7):
    """A few noisy full-batch DPSGD steps must cut the cross-entropy to ``factor`` of its start."""
    opt = dpoptim.DPSGD(model.parameters(), lr=lr, noise_multiplier=0.5, max_grad_norm=1.0,
                        expected_batch_size=len(x), sample_rate=0.5, generator=torch.Generator().manual_seed(1))
    loss_fn = torch.nn.CrossEntropyLoss()
    with torch.no_grad():
        first = float(loss_fn(model(x), y))
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    with torch.no_grad():
        assert float(loss_fn(model(x), y)) < factor * first


def assert_loss_falls(model, optimizer, batch, loss_fn, steps, factor=0.8):
    """``steps`` minibatch steps (``batch() -> (x, y)``): the mean loss of the last ten must
    fall below ``factor`` times that of the first five."""
    losses = []
    for _ in range(steps):
        x, y = batch()
        loss = loss_fn(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert last < factor * first, f"loss {first:.3f} -> {last:.3f}"


def mse(out, target):
    """Per-example squared error, ``[n]``: the loss most rule tests use."""
    return 0.5 * (out - target).flatten(1).square().sum(1)
