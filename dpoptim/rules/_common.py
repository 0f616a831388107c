"""Helpers shared by the built-in rules."""

from __future__ import annotations

import contextlib
import math

import torch

from .. import cost


def batched(x: torch.Tensor, module, what: str, min_dim: int = 2) -> torch.Tensor:
    """Check that ``x`` has a batch dimension in front."""
    if x.dim() < min_dim:
        raise ValueError(
            f"{type(module).__name__} got an unbatched {what} of shape {tuple(x.shape)}: per-example "
            "clipping needs the batch as the first dimension. Add one with x.unsqueeze(0)."
        )
    return x


def common_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The dtype rules compute in: the widest of the inputs, and at least float32."""
    dtype = torch.float32
    for t in tensors:
        dtype = torch.promote_types(dtype, t.dtype)
    return dtype


def rows_by_example(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reshape activations ``[n, ..., d]`` and output gradients ``[n, ..., p]`` to
    ``[n, T, d]`` and ``[n, T, p]`` in a common dtype."""
    dtype = common_dtype(a, b)
    n, rows = a.shape[0], math.prod(a.shape[1:-1])
    a, b = a.reshape(n, rows, a.shape[-1]), b.reshape(n, rows, b.shape[-1])
    return (a if a.dtype == dtype else a.to(dtype)), (b if b.dtype == dtype else b.to(dtype))


def squared_norms(x: torch.Tensor) -> torch.Tensor:
    """``||x_i||^2`` over all but the first dimension, without an ``x.square()`` copy
    (one reduction pass; that copy is as large as the activations)."""
    return torch.linalg.vector_norm(x.flatten(1), dim=1).square()


def batched_dot(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``sum(x_i * y_i)`` over all but the first dimension, as one batched matrix-vector
    product: no temporary as large as ``x``."""
    n, k = x.shape[0], math.prod(x.shape[1:])
    return torch.bmm(x.reshape(n, 1, k), y.reshape(n, k, 1)).view(n)


def scaled_product(b: torch.Tensor, a: torch.Tensor, factors: torch.Tensor, batch_dim: int = 0) -> torch.Tensor:
    """``sum_i factors_i sum_t b_t a_t^T`` for rows ``a: [n, T, d]``, ``b: [n, T, p]`` (``[T, n, .]``
    with ``batch_dim=1``): one matrix product, the factors applied to the smaller operand."""
    c = factors.to(b.dtype)
    c = c[:, None, None] if batch_dim == 0 else c[None, :, None]
    if a.numel() < b.numel():
        a = a * c
    else:
        b = b * c
    return b.reshape(-1, b.shape[-1]).t().mm(a.reshape(-1, a.shape[-1]))


def ghost_or_materialize(a: torch.Tensor, b: torch.Tensor, cache: dict) -> torch.Tensor:
    """``||sum_t b_t a_t^T||^2`` per example for ``a: [n, T, d]``, ``b: [n, T, p]``.

    T = 1: ``||a||^2 ||b||^2``. Otherwise the cheaper of the ghost route (Gram matrices,
    ~T^2 (d + p) per example) and materialising ``g_i`` (~T d p, kept in ``cache`` for
    the clipped sum).
    """
    n, T, d = a.shape
    p = b.shape[-1]
    if T == 1:
        return squared_norms(a) * squared_norms(b)
    if cost.ghost_is_cheaper(T, d, p):
        return batched_dot(torch.bmm(a, a.transpose(1, 2)), torch.bmm(b, b.transpose(1, 2)))
    g = cache["materialized"] = torch.bmm(b.transpose(1, 2), a)
    return squared_norms(g)


def rng_state(device: torch.device) -> torch.Tensor:
    """The state of the default random generator that kernels on ``device`` draw from."""
    if device.type == "cpu":
        return torch.get_rng_state()
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    raise ValueError(
        f"replaying a dropout mask drawn on a {device.type} device is not supported (CPU and CUDA "
        "are); set the module's dropout to 0 for private training there."
    )


@contextlib.contextmanager
def rng_replayed(device: torch.device, state: torch.Tensor):
    """Run the body with the generator of ``device`` set to ``state``: the same kernels with
    the same shapes draw the same numbers they drew then (what activation checkpointing
    relies on). The generator's current state comes back afterwards, so the user's random
    stream is untouched."""
    forked = {"devices": [device], "device_type": "cuda"} if device.type == "cuda" else {"devices": []}
    with torch.random.fork_rng(**forked):
        if device.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.cuda.set_rng_state(state, device)
        yield
