"""The DP-SGD step as small pure functions over tensors (Abadi et al., 2016).

.. math::

    c_i = \\min(1, C / \\lVert g_i \\rVert), \\qquad
    \\hat g = \\frac{1}{B} \\Big( \\sum_i c_i g_i + \\mathcal N(0, \\sigma^2 C^2 I) \\Big)

``B`` is the expected batch size: a constant, never the number of examples drawn, so the
divisor carries no information about the data.

Generators
----------
PyTorch's CPU generator is a Mersenne Twister whose ``manual_seed`` keeps only the low 32
bits of a seed. Generators seeded afresh at every step (``secure_mode``) would therefore,
over some 10^5 steps, probably repeat a seed and with it a whole noise vector, and two
steps with the same noise leak what the noise should hide. :func:`fresh_generator` instead
fills all 624 words of the state (19,968 bits) from the operating system, so that fresh
generators never coincide in practice.
"""

from __future__ import annotations

import secrets

import torch

from ._torch import set_cpu_generator_words

__all__ = ["clip_factors", "add_noise_", "standard_normal", "fresh_generator"]

_MT_WORDS = 624  # 32-bit words of Mersenne Twister state


def clip_factors(squared_norms: torch.Tensor, max_grad_norm: float) -> torch.Tensor:
    """``c_i = min(1, C / ||g_i||)``; a zero gradient gets 1, a non-finite one gets 0.

    The non-finite case drops that example's contribution instead of letting NaN reach the
    weights; the step itself still happens (and is charged), so whether a step is taken
    never depends on the data.
    """
    # C / ||g_i|| as torch computes a scalar over a tensor (reciprocal, then the product),
    # in place: the same values with fewer temporaries.
    factors = squared_norms.sqrt().reciprocal_().mul_(max_grad_norm).clamp_(max=1.0)
    # x - x is 0 for a finite x and NaN for an infinite or NaN one: isfinite in two kernels.
    return factors.masked_fill_((squared_norms - squared_norms).ne(0), 0.0)


def add_noise_(
    clipped_sums: list[torch.Tensor],
    noise_multiplier: float,
    max_grad_norm: float,
    generator: torch.Generator,
    secure: bool = False,
) -> list[torch.Tensor]:
    """``S + N(0, sigma^2 C^2 I)`` for each clipped sum S, in place.

    Noise is drawn on the generator's device, in float32 or wider, and moved if needed, so
    a seeded generator gives the same noise wherever the parameters live.

    ``secure=True`` draws each coordinate as ``(z_1 + z_2 + z_3 + z_4) / 2`` with four
    independent standard normals: the same N(0, 1) law, but the floating-point values a
    single sampler can produce (sparse and revealing near the tails, Mironov 2012; Haney et
    al. 2022) are smeared over a far denser set, which defeats the known precision attacks.
    """
    std = noise_multiplier * max_grad_norm
    if std > 0:
        for s in clipped_sums:
            z = standard_normal(s.shape, torch.promote_types(s.dtype, torch.float32), generator, secure)
            s.add_(z if z.device == s.device else z.to(s.device, non_blocking=True), alpha=std)
    return clipped_sums


def standard_normal(shape, dtype: torch.dtype, generator: torch.Generator, secure: bool = False) -> torch.Tensor:
    """Independent N(0, 1) numbers of ``shape`` on the generator's device: one draw, or with
    ``secure`` the sum of four halved (see :func:`add_noise_`)."""
    z = torch.randn(shape, generator=generator, device=generator.device, dtype=dtype)
    if secure:
        for _ in range(3):
            z.add_(torch.randn(shape, generator=generator, device=generator.device, dtype=dtype))
        z.mul_(0.5)
    return z


def fresh_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A generator whose state comes from the operating system's entropy pool (never a
    fixed seed): all 624 state words on CPU, a 64-bit Philox seed on CUDA."""
    device = torch.device(device)
    generator = torch.Generator(device=device)
    if device.type != "cpu":
        generator.manual_seed(secrets.randbits(64))
        return generator
    words = torch.frombuffer(bytearray(secrets.token_bytes(4 * _MT_WORDS)), dtype=torch.int32)
    set_cpu_generator_words(generator, words)  # the state's byte layout is a torch internal
    return generator
