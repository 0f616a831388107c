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

The clipped sum ``sum_i c_i g_i = (c . b)^T a`` is one batched matrix product over the
groups (book-keeping, Bu et al. 2023), or a contraction of the materialised ``g_i``.

Padding is reproduced exactly as the forward does it, including 'same' with even kernels
(the extra zero goes to the right, as in ATen) and the reflect / replicate / circular
modes, so the patches are the ones the kernel really multiplied.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..registry import Rule, Use, register_rule
from ._common import batched, common_dtype, ghost_or_materialize

__all__ = ["ConvRule", "conv_padding", "unfold_patches"]


def conv_padding(module: nn.Module) -> list[int]:
    """The ``F.pad`` list (last spatial dimension first) equivalent to ``module``'s padding.

    The non-zero modes pad with ``_reversed_padding_repeated_twice`` in their forward, so
    that is the truth for them. Zero padding passes ``module.padding`` to the convolution
    itself, so it is read from there (it may have been changed after construction).
    """
    if module.padding_mode != "zeros":
        return list(module._reversed_padding_repeated_twice)
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

    def save(self, module, args, kwargs, output):
        x = args[0] if args else kwargs["input"]
        return batched(x, module, "input", min_dim=len(module.kernel_size) + 2)

    def _rows(self, use: Use):
        """Patches ``a: [G*n, T, d]`` and output gradients ``b: [G*n, T, p]``, group-major so
        that each group's rows are a view; also caches the per-example bias gradients."""
        if "rows" in use.cache:
            return use.cache["rows"]
        module, x, grad = use.module, use.saved, use.grad_outputs[0]
        dtype = common_dtype(x) if grad is None else common_dtype(x, grad)
        n, groups = x.shape[0], module.groups
        spatial = len(module.kernel_size)

        pads = conv_padding(module)
        x = x.detach().to(dtype)
        if any(pads):
            mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
            x = F.pad(x, pads, mode=mode)
        patches = unfold_patches(x, module.kernel_size, module.stride, module.dilation)
        positions = patches.shape[2 : 2 + spatial]
        T = math.prod(positions)
        # [n, C, *L, *k] -> [G, n, *L, C/G, *k]: rows are output positions, columns follow
        # the flattened (C_in/G, *k) layout of a group's weight slice.
        patches = patches.reshape(n, groups, x.shape[1] // groups, *patches.shape[2:])
        order = (1, 0, *range(3, 3 + spatial), 2, *range(3 + spatial, 3 + 2 * spatial))
        d = (x.shape[1] // groups) * math.prod(module.kernel_size)
        a = patches.permute(order).reshape(groups * n, T, d)

        if grad is None:
            grad = x.new_zeros(n, module.out_channels, *positions)
        grad = grad.to(dtype)
        p = module.out_channels // groups
        b = grad.reshape(n, groups, p, T).permute(1, 0, 3, 2).reshape(groups * n, T, p)
        use.cache["bias"] = grad.reshape(n, module.out_channels, T).sum(2)
        use.cache["rows"] = (a, b)
        return a, b

    def _bias(self, use: Use) -> torch.Tensor:
        if "bias" not in use.cache:
            self._rows(use)
        return use.cache["bias"]

    def _to_weight(self, g: torch.Tensor, module, n: int | None = None) -> torch.Tensor:
        """``[G, p, d]`` to the weight's ``(C_out, C_in/G, *k)`` layout, or ``[G*n, p, d]``
        to ``[n, C_out, C_in/G, *k]``."""
        if n is None:
            return g.reshape(module.weight.shape)
        g = g.reshape(module.groups, n, *g.shape[1:]).transpose(0, 1)
        return g.reshape(n, *module.weight.shape)

    def per_example(self, use, names):
        n = use.saved.shape[0]
        out = {}
        if "weight" in names:
            g = use.cache.get("materialized")
            if g is None:
                a, b = self._rows(use)
                g = torch.bmm(b.transpose(1, 2), a)
            out["weight"] = self._to_weight(g, use.module, n)
        if "bias" in names:
            out["bias"] = self._bias(use)
        return out

    def norms(self, use, names):
        n = use.saved.shape[0]
        out = {}
        if "weight" in names:
            a, b = self._rows(use)
            # Every group has the same shapes, so one cost comparison decides for all.
            per_group = ghost_or_materialize(a, b, use.cache)
            out["weight"] = per_group.reshape(use.module.groups, n).sum(0)
            if "materialized" in use.cache:
                # The clipped sum needs only g_i now. The engine keeps every layer's cache
                # until the last clipped sum, so holding on to the im2col matrix here would
                # stack up all conv layers' patches at once.
                del use.cache["rows"]
        if "bias" in names:
            out["bias"] = self._bias(use).square().sum(1)
        return out

    def clipped_sum(self, use, names, factors):
        groups, n = use.module.groups, use.saved.shape[0]
        out = {}
        if "weight" in names:
            g = use.cache.get("materialized")
            if g is not None:
                g = g.reshape(groups, n, *g.shape[1:])
                summed = torch.einsum("i,gipd->gpd", factors.to(g.dtype), g)
            else:
                a, b = self._rows(use)
                T, p, d = b.shape[1], b.shape[2], a.shape[2]
                scaled = b.reshape(groups, n, T, p) * factors.to(b.dtype)[None, :, None, None]
                summed = torch.bmm(scaled.reshape(groups, n * T, p).transpose(1, 2), a.reshape(groups, n * T, d))
            out["weight"] = self._to_weight(summed, use.module)
        if "bias" in names:
            bias = self._bias(use)
            out["bias"] = factors.to(bias.dtype) @ bias
        return out
