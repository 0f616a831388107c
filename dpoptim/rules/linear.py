"""``nn.Linear``: ``y = x W^T + b`` over any number of leading dimensions.

For example i with T rows (all dimensions between the batch and the features),
input rows ``a_t`` (width d) and output gradients ``b_t`` (width p):

* weight: ``g_i = sum_t b_t a_t^T``. Its squared norm is ``||a||^2 ||b||^2`` when T = 1,
  and otherwise either the "ghost" form ``sum_{t,s} (a_t . a_s)(b_t . b_s)`` (Li et al.
  2022, cost ~ T^2 (d + p)) or the materialised ``||g_i||^2`` (cost ~ T d p), whichever
  is cheaper.
* bias: ``g_i = sum_t b_t``.

The clipped sum is one matrix product, ``(c . b)^T a`` (Bu et al. 2023), or a contraction
of the already materialised per-example gradients.
"""

from __future__ import annotations

import torch
from torch import nn

from ..registry import Rule, Use, register_rule
from ._common import batched, ghost_or_materialize, rows_by_example, scaled_product, squared_norms


@register_rule(nn.Linear)
class LinearRule(Rule):
    detach_parameters = True

    def save(self, module, args, kwargs, output):
        return batched(args[0], module, "input")

    def _rows(self, use: Use):
        if "rows" not in use.cache:
            a = use.saved
            b = use.grad_outputs[0]
            if b is None:
                b = torch.zeros(*a.shape[:-1], use.module.out_features, dtype=a.dtype, device=a.device)
            use.cache["rows"] = rows_by_example(a, b)
        return use.cache["rows"]

    def terms(self, use, name):
        a, b = self._rows(use)
        return [(b, a)] if name == "weight" else [(b, None)]

    def per_example(self, use, names):
        a, b = self._rows(use)
        out = {}
        if "weight" in names:
            out["weight"] = torch.bmm(b.transpose(1, 2), a)
        if "bias" in names:
            out["bias"] = b.sum(1)
        return out

    def norms(self, use, names):
        a, b = self._rows(use)
        out = {}
        if b.shape[1] == 1 and "bias" in names:
            # T = 1: the per-example bias gradient is b itself (a view, not an [n, p] copy),
            # and ||b||^2 serves the weight's ||a||^2 ||b||^2 too.
            bias = use.cache["bias"] = b[:, 0]
            out["bias"] = squared_norms(bias)
            if "weight" in names:
                out["weight"] = squared_norms(a) * out["bias"]
            return out
        if "weight" in names:
            out["weight"] = ghost_or_materialize(a, b, use.cache)
        if "bias" in names:
            bias = use.cache["bias"] = b.sum(1)
            out["bias"] = squared_norms(bias)
        return out

    def clipped_sum(self, use, names, factors):
        a, b = self._rows(use)
        out = {}
        if "weight" in names:
            g = use.cache.get("materialized")
            if g is not None:
                out["weight"] = torch.tensordot(factors.to(g.dtype), g, dims=1)
            else:
                out["weight"] = scaled_product(b, a, factors)
        if "bias" in names:
            bias = use.cache.get("bias")
            if bias is None:
                bias = b.sum(1)
            out["bias"] = factors.to(bias.dtype) @ bias
        return out
