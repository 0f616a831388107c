"""``nn.Conv1d``, ``nn.Conv2d``, ``nn.Conv3d``: a Linear layer over unfolded patches.

A convolution with G groups is, in each group g, the same Linear map applied at every
output position (the im2col view; Goodfellow 2015, "Efficient per-example gradient
computations"; Rochette et al. 2019, "Efficient per-example gradient computations in
convolutional neural networks"). For example i let

* ``a_t`` be the patch of the padded input that output position t sees, restricted to the
  group's input channels: width ``d = C_in/G * prod(k)``, laid out (channel, k_1, ..., k_D)
  like the group's slice of ``weight``;
* ``b_t`` the output gradient at t for the group's output channels: width ``p = C_out/G``;
* ``T = prod(L)`` the number of output positions.

Then, per group,

* weight: ``g_i = sum_t b_t a_t^T`` (shape ``p x d``). Its squared norm is the ghost form
  ``sum_{t,s} (a_t . a_s)(b_t . b_s)`` (cost ~ T^2 (d + p)) or the materialised
  ``||g_i||^2`` (cost ~ T d p), whichever is cheaper: the "mixed ghost clipping" of Bu,
  Mao & Xu 2022 (NeurIPS), who found that neither route wins for every conv layer. The
  squared norm of the whole weight is the sum over groups.
* bias: ``g_i = sum_t b_t``.

The clipped sum ``sum_i c_i g_i`` is a contraction of the materialised ``g_i``, or, on the
ghost route, the convolution's own weight-gradient kernel applied to the scaled output
gradients ``c_i b_i`` (book-keeping, Bu et al. 2023): no patch matrix is needed for it.

Patches are unfolded a few examples at a time (about ``CHUNK_BYTES`` of patches each):
the per-example quantities do not mix examples, and one patch matrix for the whole batch
would be a temporary many times the size of the activations, which on CPU costs more to
allocate (fresh pages) than to fill.

Padding is reproduced exactly as the forward does it, including 'same' with even kernels
(the extra zero goes to the right, as in ATen) and the reflect / replicate / circular
modes, so the patches are the ones the kernel really multiplied.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import _torch, cost
from ..registry import Rule, Use, register_rule
from ._common import batched, common_dtype

__all__ = ["ConvRule", "conv_padding", "unfold_patches"]

CHUNK_BYTES = 4 << 20  # patches unfolded per chunk of examples


def conv_padding(module: nn.Module) -> list[int]:
    """The ``F.pad`` list (last spatial dimension first) equivalent to ``module``'s padding.

    The non-zero modes pad with ``_reversed_padding_repeated_twice`` in their forward, so
    that is the truth for them. Zero padding passes ``module.padding`` to the convolution
    itself, so it is read from there (it may have been changed after construction).
    """
    if module.padding_mode != "zeros":
        return _torch.conv_explicit_padding(module)
    padding = module.padding
    dims = len(module.kernel_size)
    if padding == "valid":
        return [0, 0] * dims
    pads = []
    for j in reversed(range(dims)):
        if padding == "same":
            # ATen's 'same': total dilation*(k-1), the odd one out on the right.
            total = module.dilation[j] * (module.kernel_size[j] - 1)
            pads += [total // 2, total - total // 2]
        else:
            pads += [padding[j], padding[j]]
    return pads


def unfold_patches(x: torch.Tensor, kernel_size, stride, dilation) -> torch.Tensor:
    """``[n, C, *S]`` (already padded) to the view ``[n, C, *L, *k]`` of the patches the
    kernel sees: ``out[..., l, j] = x[..., l * stride + j * dilation]`` per spatial dim.

    One ``Tensor.unfold`` per spatial dimension over the dilated span, then every
    ``dilation``-th element of each window, so any number of dimensions shares one path.
    No copy is made here.
    """
    spatial = len(kernel_size)
    for j in range(spatial):
        span = dilation[j] * (kernel_size[j] - 1) + 1
        x = x.unfold(2 + j, span, stride[j])
    keep = (slice(None),) * (2 + spatial) + tuple(slice(None, None, d) for d in dilation)
    return x[keep]


@register_rule(nn.Conv1d)
@register_rule(nn.Conv2d)
@register_rule(nn.Conv3d)
class ConvRule(Rule):
    detach_parameters = True  # the forward reads self.weight / self.bias at call time
    detach_all = True  # oneDNN computes the weight gradient whenever the bias gradient is asked for
    reads_weights = True

    def save(self, module, args, kwargs, output):
        x = args[0] if args else kwargs["input"]
        return batched(x, module, "input", min_dim=len(module.kernel_size) + 2)

    def _prepared(self, use: Use):
        """The padded input ``[n, C_in, *S]`` and output gradient ``[n, C_out, *L]`` in the
        common dtype, and the per-example bias gradients ``[n, C_out]``."""
        if "x" in use.cache:
            return use.cache["x"], use.cache["grad"]
        module, x, grad = use.module, use.saved, use.grad_outputs[0]
        dtype = common_dtype(x) if grad is None else common_dtype(x, grad)
        pads = conv_padding(module)
        x = x.detach().to(dtype)
        if any(pads):
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            x = F.pad(x, pads, mode=mode)
        if grad is None:
            positions = unfold_patches(x[:0], module.kernel_size, module.stride, module.dilation).shape[2:2 + len(module.kernel_size)]
            grad = x.new_zeros(x.shape[0], module.out_channels, *positions)
        grad = grad.to(dtype)
        use.cache["x"], use.cache["grad"] = x, grad
        use.cache["bias"] = grad.flatten(2).sum(2)
        return x, grad

    def _shapes(self, module, x, grad):
        groups = module.groups
        T = math.prod(grad.shape[2:])
        d = (x.shape[1] // groups) * math.prod(module.kernel_size)
        return groups, T, d, module.out_channels // groups

    def _chunks(self, module, x, grad, square: bool):
        """``(start, stop, a, b)`` over chunks of examples: patches ``a: [m*G, d, T]`` and
        output gradients ``b: [m*G, p, T]``, group-major within each example, columns of
        ``a`` in the flattened ``(C_in/G, *k)`` layout of a group's weight slice.
        ``square``: the ghost route's ``T x T`` Gram matrices count towards the chunk size."""
        n, spatial = x.shape[0], len(module.kernel_size)
        groups, T, d, p = self._shapes(module, x, grad)
        per_example = groups * (d * T + (2 * T * T if square else 0)) * x.element_size()
        step = max(1, CHUNK_BYTES // max(per_example, 1))
        for start in range(0, n, step):
            stop = min(n, start + step)
            m = stop - start
            patches = unfold_patches(x[start:stop], module.kernel_size, module.stride, module.dilation)
            # [m, C, *L, *k] -> [m, G, C/G, *k, *L] -> [m*G, d, T]
            patches = patches.reshape(m, groups, x.shape[1] // groups, *patches.shape[2:])
            order = (0, 1, 2, *range(3 + spatial, 3 + 2 * spatial), *range(3, 3 + spatial))
            a = patches.permute(order).reshape(m * groups, d, T)
            b = grad[start:stop].reshape(m * groups, p, T)
            yield start, stop, a, b

    def _materialize(self, use: Use) -> torch.Tensor:
        """Per-example weight gradients ``[n, G, p, d]`` (``g_i = sum_t b_t a_t^T`` per group)."""
        if "materialized" not in use.cache:
            module = use.module
            x, grad = self._prepared(use)
            groups, T, d, p = self._shapes(module, x, grad)
            g = x.new_empty(x.shape[0] * groups, p, d)
            for start, stop, a, b in self._chunks(module, x, grad, square=False):
                torch.bmm(b, a.transpose(1, 2), out=g[start * groups:stop * groups])
            use.cache["materialized"] = g.view(x.shape[0], groups, p, d)
        return use.cache["materialized"]

    def per_example(self, use, names):
        out = {}
        if "weight" in names:
            g = self._materialize(use)
            out["weight"] = g.reshape(g.shape[0], *use.module.weight.shape)
        if "bias" in names:
            self._prepared(use)
            out["bias"] = use.cache["bias"]
        return out

    def norms(self, use, names):
        module = use.module
        x, grad = self._prepared(use)
        out = {}
        if "weight" in names:
            groups, T, d, p = self._shapes(module, x, grad)
            if "materialized" in use.cache or not cost.ghost_is_cheaper(T, d, p):
                out["weight"] = torch.linalg.vector_norm(self._materialize(use).flatten(1), dim=1).square()
            else:
                norms = x.new_empty(x.shape[0])
                for start, stop, a, b in self._chunks(module, x, grad, square=True):
                    gram_a = torch.bmm(a.transpose(1, 2), a)
                    gram_b = torch.bmm(b.transpose(1, 2), b)
                    norms[start:stop] = (gram_a * gram_b).sum((1, 2)).view(stop - start, groups).sum(1)
                out["weight"] = norms
        if "bias" in names:
            out["bias"] = use.cache["bias"].square().sum(1)
        return out

    def clipped_sum(self, use, names, factors):
        module = use.module
        x, grad = self._prepared(use)
        out = {}
        if "weight" in names:
            g = use.cache.get("materialized")
            if g is not None:
                out["weight"] = (factors.to(g.dtype) @ g.flatten(1)).view(module.weight.shape)
            else:  # the convolution's weight gradient of the scaled output gradients
                scaled = grad * factors.to(grad.dtype).view(-1, *([1] * (grad.dim() - 1)))
                zeros = [0] * len(module.kernel_size)
                out["weight"] = torch.ops.aten.convolution_backward(
                    scaled, x, module.weight.detach().to(x.dtype), None, list(module.stride), zeros,
                    list(module.dilation), False, zeros, module.groups, [False, True, False],
                )[1]
        if "bias" in names:
            bias = use.cache["bias"]
            out["bias"] = factors.to(bias.dtype) @ bias
        return out
