"""``nn.MultiheadAttention``, and with it ``nn.TransformerEncoderLayer``,
``nn.TransformerDecoderLayer`` and ``nn.Transformer``.

Attention (Vaswani et al. 2017, "Attention is all you need") for one example, per head:

    ``q = X_q W_q^T + b_q``, ``k = X_k W_k^T + b_k``, ``v = X_v W_v^T + b_v``,
    ``P = softmax(q k^T / sqrt(d_head) + mask)``, ``A = P v``,
    ``Y = A W_o^T + b_o``      (heads concatenated in ``A``)

Every weight is a Linear map applied to every token, so its per-example gradient is the
Linear one with a row per token (:mod:`._factored`): ``g_i(W_q) = sum_t dq_t x_t^T`` and so
on, ``g_i(W_o) = sum_t dY_t A_t^T``. ``dY`` arrives from autograd; ``A``, ``dq``, ``dk``,
``dv`` do not, because ``F.multi_head_attention_forward`` keeps them inside. The rule
has two ways to get them.

*Tapped* (the common case: Transformer layers, attention weights not returned). The
attention is then one ``scaled_dot_product_attention`` call, and when PyTorch runs a fused
kernel for it, that call is one autograd node. It saves ``A`` for its backward, and its
backward computes ``dq, dk, dv`` for the user's own backward pass. The rule hooks that
node at forward time and keeps both: nothing is recomputed.

*Replayed* (attention weights returned, the math fallback, attention dropout on CPU,
activation checkpointing). The rule saves the module's inputs and masks at forward time
and, at the end of the backward pass, recomputes ``q, k, v, P, A`` with the weights
detached and backpropagates ``dY`` through the attention by hand:

    ``dA = dY W_o``, ``dv = P^T dA``, ``dP = dA v^T``,
    ``dS = P . (dP - rowsum(P . dP))``, ``dq = dS k / sqrt(d_head)``,
    ``dk = dS^T q / sqrt(d_head)``.

When the attention weights are returned and used in the loss, their gradient joins
``dP``. ``add_bias_kv`` appends one learned key/value token: its per-example gradient is
that token's row of ``dk``/``dv``. ``add_zero_attn`` appends a zero token (no parameter).
Masks are applied as PyTorch does: boolean masks become ``-inf``, ``key_padding_mask``
is added to ``attn_mask``, and ``is_causal`` (without a padding mask, without
``need_weights``) means the lower-triangular mask of ``scaled_dot_product_attention``.

The module calls ``F.multi_head_attention_forward`` with ``out_proj.weight`` directly,
so the ``out_proj`` Linear's own hooks never fire: this rule claims ``out_proj.weight``
and ``out_proj.bias``.

Cost: ghost or materialised norms per weight and one product per weight for the clipped
sum; replayed, also the projections and the attention once more forward and once
backward without weight gradients (about the attention's own forward and backward).

``nn.TransformerEncoderLayer``/``DecoderLayer`` get a guard, not a rule: with
``batch_first=False`` their Linear and LayerNorm children would see ``[T, n, d]`` and
read positions as examples, so that layout is refused before the forward.

Attention dropout (``dropout > 0`` in training) drops entries of ``P`` with a mask drawn
inside the attention kernel, where no hook can see it. Tapped, the kernel's own backward
applies its mask. Replayed, the rule keeps the random
generator's state from just before the forward and runs the attention kernel
once more exactly as the forward did (same function, shapes and dtype) from that state, so
it draws the same mask, and differentiates that replay with autograd. Activation
checkpointing rests on the same property. The first step's comparison with autograd
confirms it on the user's own device and kernels. Unbatched inputs are refused.
"""

from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn.functional as F
from torch import nn

from .. import _torch
from ..registry import Rule, register_rule
from ..verify import autograd_sum
from ._common import common_dtype, rng_replayed, rng_state
from ._factored import Factored, FactoredRule, bias_block, weight_block

__all__ = ["MultiheadAttentionRule", "TransformerLayerGuard"]

_SIGNATURE = inspect.signature(nn.MultiheadAttention.forward)


def _as_float_mask(mask: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """PyTorch's canonical mask: booleans become 0 / -inf, floats are added as they are."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[n, T, E] -> [n * heads, T, E / heads]``, contiguous for ``bmm``."""
    n, T, E = t.shape
    return t.reshape(n, T, heads, E // heads).transpose(1, 2).reshape(n * heads, T, E // heads)


def _merge(t: torch.Tensor, heads: int) -> torch.Tensor:
    """``[n * heads, T, d] -> [n, T, heads * d]``."""
    nh, T, d = t.shape
    return t.view(nh // heads, heads, T, d).transpose(1, 2).reshape(nh // heads, T, heads * d)


def _tap_attention_kernel(out: torch.Tensor, inputs, budget: int = 32) -> dict | None:
    """Hook the autograd node of the fused attention kernel that produced ``out``.

    Without attention weights to return, ``F.multi_head_attention_forward`` computes the
    attention with one ``scaled_dot_product_attention`` call. When PyTorch ran one of its
    fused kernels for it, that call is a single autograd node (``ScaledDotProduct...Backward``)
    between the module's output and its inputs; it keeps the attention output ``A``, and
    in the backward it computes exactly the ``dq, dk, dv`` the rule needs. The returned box
    holds ``A`` now and receives the kernel's input gradients when its backward runs, so
    the replay is skipped. None when there is no single such node within ``budget`` nodes
    (the math fallback, attention dropout on CPU, a graph PyTorch builds differently):
    the rule replays then.
    """
    if out.grad_fn is None or _torch.saved_tensor_hooks_active():
        return None
    stop = {t.grad_fn for t in inputs if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    found, seen, frontier = [], set(), [out.grad_fn]
    while frontier:
        node = frontier.pop()
        if node is None or node in seen or node in stop:
            continue
        seen.add(node)  # holds the node, so its Python object (and id) stays the same
        if len(seen) > budget:
            return None
        if _torch.is_fused_attention_node(node):
            found.append(node)
            continue
        frontier.extend(fn for fn, _ in node.next_functions)
    if len(found) != 1:
        return None
    output = _torch.fused_attention_output(found[0])
    if output is None:
        return None
    box = {"output": output.detach()}
    found[0].register_hook(functools.partial(_keep_input_grads, box))
    return box


def _keep_input_grads(box, grad_inputs, grad_outputs):
    # Detached: under create_graph=True they would lead back to this node, which holds the hook.
    box["grads"] = tuple(None if g is None else g.detach() for g in grad_inputs)


@register_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(FactoredRule):
    """Reads ``A`` and ``dq, dk, dv`` from the fused attention kernel, or replays the attention
    from the saved inputs and backpropagates through it by hand (module docstring)."""

    # Ghost differentiation (the engine detaches every parameter but one during the
    # forward) needs the attached one to reach *both* outputs: the attention weights depend
    # on the query and key projections only, so with out_proj.bias, the engine's default
    # pick, they would come back without a graph and a loss on them would lose its
    # gradient, so the rule picks it (Rule.attached).
    detach_parameters = True
    reads_weights = True

    def attached(self, module, names):
        """The parameter to leave attached: the smallest one both outputs depend on."""
        for name in ("bias_k", "in_proj_bias", "k_proj_weight", "in_proj_weight"):
            if name in names:
                return name
        return None

    def check(self, module):
        # Attention dropout draws its mask inside the attention kernel. Keep the state the
        # generator had before the forward, so the rule can draw the same mask again.
        if module.training and module.dropout > 0:
            device = module.out_proj.weight.device
            self.call_state(module)["rng_before"] = (device, rng_state(device))

    def parameters(self, module):
        params = super().parameters(module)
        params["out_proj.weight"] = module.out_proj.weight
        if module.out_proj.bias is not None:
            params["out_proj.bias"] = module.out_proj.bias
        return params

    def save(self, module, args, kwargs, output):
        bound = _SIGNATURE.bind(module, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        query, key, value = a["query"], a["key"], a["value"]
        if query.dim() != 3:
            raise ValueError(
                f"MultiheadAttention got an unbatched query of shape {tuple(query.shape)}: per-example "
                "clipping needs a batch dimension to tell examples apart. Add one with "
                f"query.unsqueeze({0 if module.batch_first else 1}) (and to key, value and the masks)."
            )

        def batch_major(t):
            return t.detach() if module.batch_first else t.detach().transpose(0, 1)

        detach = lambda m: None if m is None else m.detach()  # noqa: E731
        dropout = None
        if module.training and module.dropout > 0:
            device, state = self.call_state(module)["rng_before"]
            dropout = (module.dropout, device, state, output[0].dtype)
        return {
            "query": batch_major(query), "key": batch_major(key), "value": batch_major(value),
            "same_qk": query is key, "same_kv": key is value,
            "key_padding_mask": detach(a["key_padding_mask"]), "attn_mask": detach(a["attn_mask"]),
            "need_weights": a["need_weights"], "average": a["average_attn_weights"],
            "is_causal": a["is_causal"], "dropout": dropout,
            "kernel": None if a["need_weights"] else _tap_attention_kernel(
                output[0], (query, key, value, a["key_padding_mask"], a["attn_mask"])),
        }

    def factors(self, use):
        m, s = use.module, use.saved
        E, heads = m.embed_dim, m.num_heads
        packed = _torch.mha_packed_projection(m)
        weights = [m.in_proj_weight] if packed else [m.q_proj_weight, m.k_proj_weight, m.v_proj_weight]
        dtype = common_dtype(s["query"], *weights)
        xq, xk, xv = (s[name].to(dtype) for name in ("query", "key", "value"))
        n, L, S = xq.shape[0], xq.shape[1], xk.shape[1]
        # One projection when query, key and value are one tensor (self-attention).
        fused = packed and s["same_qk"] and s["same_kv"] and m.bias_k is None and not m.add_zero_attn
        dY = use.grad_outputs[0]
        dY = torch.zeros(n, L, E, dtype=dtype, device=xq.device) if dY is None else dY.to(dtype)
        if not m.batch_first:
            dY = dY.transpose(0, 1)

        routed = self._tapped(use, n, L, dtype)
        use.cache["route"] = "tapped" if routed is not None else "replayed"
        A, d_heads = routed if routed is not None else self._replay(use, xq, xk, xv, dY, fused, dtype)
        if fused:  # dq, dk, dv in one copy: [n, L, (q|k|v), heads, d_head]
            dqkv = d_heads[0].new_empty(n, L, 3, heads, E // heads)
            for i, d in enumerate(d_heads):
                dqkv[:, :, i].copy_(d.transpose(1, 2))
            dqkv = dqkv.view(n, L, 3 * E)
            dq, dk, dv = dqkv.split(E, dim=-1)
        else:
            dq, dk, dv = (d.transpose(1, 2).reshape(n, d.shape[2], E) for d in d_heads)  # [n, T, E]

        factors = {"out_proj.weight": Factored([weight_block(A, dY)], m.out_proj.weight.shape)}
        if m.out_proj.bias is not None:
            factors["out_proj.bias"] = Factored([bias_block(dY)], m.out_proj.bias.shape)
        if m.bias_k is not None:
            factors["bias_k"] = Factored([bias_block(dk[:, S:S + 1])], m.bias_k.shape)
            factors["bias_v"] = Factored([bias_block(dv[:, S:S + 1])], m.bias_v.shape)
        dk, dv = dk[:, :S], dv[:, :S]
        if packed:
            if fused:  # self-attention: one input, one block
                blocks = [weight_block(xq, dqkv)]
            elif s["same_qk"] and s["same_kv"]:
                blocks = [weight_block(xq, torch.cat([dq, dk, dv], dim=-1))]
            elif s["same_kv"]:
                blocks = [weight_block(xq, dq), weight_block(xk, torch.cat([dk, dv], dim=-1))]
            else:
                blocks = [weight_block(xq, dq), weight_block(xk, dk), weight_block(xv, dv)]
            factors["in_proj_weight"] = Factored(blocks, m.in_proj_weight.shape)
        else:
            for name, x, d in (("q_proj_weight", xq, dq), ("k_proj_weight", xk, dk), ("v_proj_weight", xv, dv)):
                factors[name] = Factored([weight_block(x, d)], getattr(m, name).shape)
        if m.in_proj_bias is not None:
            blocks = [bias_block(dqkv)] if fused else [bias_block(dq), bias_block(dk), bias_block(dv)]
            factors["in_proj_bias"] = Factored(blocks, m.in_proj_bias.shape)
        return factors

    def route(self, use):
        """Tapped or replayed (with dropout, returning weights or not), on which device and
        dtype: each checked against autograd the first time it is taken."""
        taken = use.cache.get("route")
        if taken is None:
            return None
        s = use.saved
        return (taken, s["dropout"] is not None, bool(s["need_weights"]), s["query"].device.type, s["query"].dtype)

    def reference(self, use, names):
        m, s = use.module, use.saved
        layout = (lambda t: t) if m.batch_first else (lambda t: t.transpose(0, 1))
        q = layout(s["query"])
        k = q if s["same_qk"] else layout(s["key"])
        v = k if s["same_kv"] else layout(s["value"])
        kwargs = {"key_padding_mask": s["key_padding_mask"], "need_weights": s["need_weights"],
                  "attn_mask": s["attn_mask"], "average_attn_weights": s["average"], "is_causal": s["is_causal"]}

        def forward():
            if s["dropout"] is None:
                return list(type(m).forward(m, q, k, v, **kwargs))
            _, device, state, _ = s["dropout"]
            with rng_replayed(device, state):  # the forward's own dropout mask
                return list(type(m).forward(m, q, k, v, **kwargs))

        return autograd_sum(m, names, forward, use.grad_outputs)

    @staticmethod
    def _tapped(use, n, L, dtype):
        """``A`` ``[n, L, E]`` and ``(dq, dk, dv)`` ``[n, heads, T, d_head]`` as the forward's
        fused attention kernel and its backward computed them (:func:`_tap_attention_kernel`),
        or None when the kernel was not tapped, its backward did not run or the shapes are
        not the ones the replay would produce."""
        m, box = use.module, use.saved["kernel"]
        grads = None if box is None else box.get("grads")
        if grads is None or len(grads) < 3 or any(g is None for g in grads[:3]):
            return None
        out, (dq, dk, dv) = box["output"], grads[:3]
        heads, d = m.num_heads, m.embed_dim // m.num_heads
        S = use.saved["key"].shape[1] + int(m.bias_k is not None) + int(m.add_zero_attn)
        if not (out.shape == dq.shape == (n, heads, L, d) and dk.shape == dv.shape == (n, heads, S, d)):
            return None
        return out.transpose(1, 2).reshape(n, L, heads * d).to(dtype), (dq.to(dtype), dk.to(dtype), dv.to(dtype))

    def _replay(self, use, xq, xk, xv, dY, fused, dtype):
        """``A`` ``[n, L, E]`` and ``(dq, dk, dv)`` ``[n, heads, T, d_head]`` recomputed from the
        saved inputs, the backward through the attention by hand (module docstring)."""
        m, s = use.module, use.saved
        E, heads = m.embed_dim, m.num_heads
        n, L, S = xq.shape[0], xq.shape[1], xk.shape[1]
        detach = lambda p: None if p is None else p.detach().to(dtype)  # noqa: E731
        if fused:
            qkv = F.linear(xq, detach(m.in_proj_weight), detach(m.in_proj_bias))
            q, k, v = qkv.view(n, L, 3, heads, E // heads).permute(2, 0, 3, 1, 4).reshape(3, n * heads, L, E // heads)
        else:
            packed = _torch.mha_packed_projection(m)
            if packed:
                w_q, w_k, w_v = detach(m.in_proj_weight).chunk(3)
            else:
                w_q, w_k, w_v = (detach(w) for w in (m.q_proj_weight, m.k_proj_weight, m.v_proj_weight))
            b_q, b_k, b_v = detach(m.in_proj_bias).chunk(3) if m.in_proj_bias is not None else (None,) * 3
            q, k, v = F.linear(xq, w_q, b_q), F.linear(xk, w_k, b_k), F.linear(xv, w_v, b_v)
            if m.bias_k is not None:
                k = torch.cat([k, detach(m.bias_k).expand(n, 1, E)], dim=1)
                v = torch.cat([v, detach(m.bias_v).expand(n, 1, E)], dim=1)
            q, k, v = _heads(q, heads), _heads(k, heads), _heads(v, heads)  # [n * heads, T, d_head]
            if m.add_zero_attn:
                k = torch.cat([k, k.new_zeros(n * heads, 1, k.shape[-1])], dim=1)
                v = torch.cat([v, v.new_zeros(n * heads, 1, v.shape[-1])], dim=1)
        S_total = k.shape[1]
        mask = _attention_mask(s, n, heads, L, S_total, m, dtype, q.device)

        scale = 1.0 / math.sqrt(E // heads)
        dA = _heads(torch.matmul(dY, detach(m.out_proj.weight)), heads)
        dW = None  # gradient of the returned attention weights, per head: [n * heads, L, S']
        if len(use.grad_outputs) > 1 and use.grad_outputs[1] is not None:
            dW = use.grad_outputs[1].to(dtype)  # [n, L, S'] averaged over heads, else [n, heads, L, S']
            dW = (dW.unsqueeze(1).expand(n, heads, L, S_total) / heads if s["average"] else dW).reshape(n * heads, L, S_total)

        if s["dropout"] is not None:
            A, d_heads = _replay_with_dropout(q, k, v, mask, dA, dW, s, n, heads, scale)
        else:
            scores = torch.bmm(q, k.transpose(1, 2)).mul_(scale)
            if mask is not None:
                scores = (scores.view(n, heads, L, S_total) + mask).view(n * heads, L, S_total)
            P = torch.softmax(scores, dim=-1)
            A = _merge(torch.bmm(P, v), heads)  # [n, L, E]
            dP = torch.bmm(dA, v.transpose(1, 2))
            if dW is not None:
                dP += dW
            dS = P * (dP - (P * dP).sum(-1, keepdim=True))
            dS *= scale
            d_heads = torch.bmm(dS, k), torch.bmm(dS.transpose(1, 2), q), torch.bmm(P.transpose(1, 2), dA)
        return A, tuple(d.reshape(n, heads, d.shape[1], d.shape[2]) for d in d_heads)


def _replay_with_dropout(q, k, v, mask, dA, dW, saved, n, heads, scale):
    """``A`` and ``(dq, dk, dv)`` per head when the forward dropped attention weights.

    The attention is run again exactly as ``F.multi_head_attention_forward`` ran it (the
    same kernel, in the same dtype, with the random generator set back to its state
    before the forward, so the kernel draws the same dropout mask) and differentiated
    with autograd: a backward over this attention alone, not the model."""
    p, device, state, attn_dtype = saved["dropout"]
    n_heads, L, d = q.shape
    S = k.shape[1]
    with rng_replayed(device, state), torch.enable_grad():
        leaves = [t.detach().to(attn_dtype).requires_grad_() for t in (q, k, v)]
        q_, k_, v_ = leaves
        if saved["need_weights"]:  # softmax, dropout, then the weighted sum of values
            scores = torch.bmm(q_ * scale, k_.transpose(1, 2))
            if mask is not None:
                scores = (scores.view(n, heads, L, S) + mask.to(attn_dtype)).view(n_heads, L, S)
            weights = F.dropout(torch.softmax(scores, dim=-1), p)
            out = torch.bmm(weights, v_)
            pairs = [(out, dA)] + ([(weights, dW)] if dW is not None else [])
        else:  # the fused kernel, called as PyTorch calls it
            causal = saved["is_causal"] and saved["key_padding_mask"] is None
            out = F.scaled_dot_product_attention(
                q_.view(n, heads, L, d), k_.view(n, heads, S, d), v_.view(n, heads, S, d),
                attn_mask=None if causal or mask is None else mask.to(attn_dtype),
                dropout_p=p, is_causal=causal,
            ).view(n_heads, L, d)
            pairs = [(out, dA)]
        grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g.to(attn_dtype) for _, g in pairs])
    dtype = q.dtype
    return _merge(out.detach().to(dtype), heads), tuple(g.to(dtype) for g in grads)

def _attention_mask(saved, n, heads, L, S_total, module, dtype, device):
    """The additive mask ``[n or 1, heads or 1, L, S_total]`` that
    ``F.multi_head_attention_forward`` applies, or None."""
    padding = _as_float_mask(saved["key_padding_mask"], dtype)
    if saved["is_causal"] and padding is None and not saved["need_weights"]:
        # PyTorch drops attn_mask here and asks scaled_dot_product_attention for its
        # own causal mask (top-left aligned over the keys, extra tokens included).
        allowed = torch.ones(L, S_total, dtype=torch.bool, device=device).tril()
        return _as_float_mask(~allowed, dtype)
    mask = _as_float_mask(saved["attn_mask"], dtype)
    extra = int(module.bias_k is not None) + int(module.add_zero_attn)
    if mask is not None:
        mask = mask.unsqueeze(0).unsqueeze(0) if mask.dim() == 2 else mask.reshape(n, heads, L, mask.shape[-1])
        mask = F.pad(mask, (0, extra))
    if padding is not None:
        padding = F.pad(padding, (0, extra)).reshape(n, 1, 1, S_total)
        mask = padding if mask is None else mask + padding
    return mask


@register_rule(nn.TransformerEncoderLayer)
@register_rule(nn.TransformerDecoderLayer)
class TransformerLayerGuard(Rule):
    """Owns no parameters (its children's rules do); refuses the sequence-first layout.

    With ``batch_first=False`` a Transformer layer hands ``[T, n, d]`` activations to its
    ``Linear`` and ``LayerNorm`` children, whose rules take the examples from the first
    dimension: positions would be clipped as if they were examples, silently wrong when
    ``T == n``. The attention rule itself handles either layout.
    """

    def parameters(self, module):
        if not module.self_attn.batch_first and any(p.requires_grad for p in module.parameters()):
            raise ValueError(
                f"nn.{type(module).__name__}(batch_first=False) passes [T, n, d] activations to its "
                "Linear and LayerNorm layers, whose per-example rules take the batch from the first "
                "dimension, so positions would be clipped as if they were examples. Build it (or the "
                "nn.Transformer) with batch_first=True and feed [n, T, d] inputs (x.transpose(0, 1))."
            )
        return {}

    def per_example(self, use, names):
        return {}
