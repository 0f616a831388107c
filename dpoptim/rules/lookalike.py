"""Look-alikes of stock layers, proved on their own inputs.

**nn.Linear.** Modules with no registered rule whose parameters are a 2-D
``weight`` and an optional 1-D ``bias``, and whose forward computes a linear layer, in
``nn.Linear``'s layout (``y = x W^T + b``, weight ``[out, in]``: a subclass of ``nn.Linear``
that overrides ``forward``) or transposed (``y = x W + b``, weight ``[in, out]``: Hugging
Face's GPT-2 ``Conv1D``, which flattens the batch into the rows of one ``addmm``).

Nothing is taken on trust from the class or its parents. The candidate is chosen by
structure (the parameters' shapes against the input's and the output's last dimensions)
and then **proved** on the call's own input: the module's output must equal
``F.linear(x, W, b)`` (or ``F.linear(x, W^T, b)``) to the precision of its dtype, once for
each input shape, dtype and train/eval mode; the engine's first step then compares the
rule's summed gradient with autograd's. Once proved, the call is clipped by the Linear rule
(ghost norms, book-keeping clipped sum; see :mod:`dpoptim.rules.linear`), with the
weight's gradient transposed for the ``[in, out]`` layout.

A module that fails the proof is not refused for that alone: its parameters were followed
during the forward as bare parameters (:mod:`dpoptim.rules.bare`), and if every use was
element-wise, that rule's per-example gradients apply. Otherwise the error says both why
the module is not a Linear layer and where its parameters met the batch.

**nn.Embedding subclasses** that override ``forward`` (scaled word embeddings: Gemma's,
BART's ``super().forward(ids) * embed_scale``): proved, on each call, to output
``c * F.embedding(ids, W, padding_idx)`` for one constant ``c`` (fitted by least squares,
checked on every element); then ``g_i = c * (the lookup's g_i)`` with the output gradient
scaled by ``c``, and everything of :mod:`dpoptim.rules.embedding` applies. A ``c`` that
depends on ``W`` itself would pass this check but not the engine's first-step comparison
with autograd.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import nn

from .. import _torch, paths
from ..registry import Use, register_automatic
from .bare import BareParameterRule, shared_per_example
from .embedding import EmbeddingRule
from .linear import LinearRule
from .shared import SharedTensorError

__all__ = ["LinearLookalikeRule", "EmbeddingLookalikeRule"]

_LINEAR = LinearRule()


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float64: 1e-10, torch.float32: 1e-4}.get(dtype, 2e-2)


class _Width:
    """What LinearRule reads from its module besides the saved tensors."""

    def __init__(self, out_features):
        self.out_features = out_features


class LinearLookalikeRule(BareParameterRule):
    lenient = True  # a failed proof falls back on the bare-parameter route

    def __init__(self):
        super().__init__()
        self._proved = weakref.WeakKeyDictionary()  # module -> {(shape, dtype, training): layout}

    def applies(self, module) -> bool:
        params = {n: p for n, p in _torch.own_parameters(module).items() if p is not None}
        weight, bias = params.get("weight"), params.get("bias")
        if weight is None or weight.dim() != 2 or set(params) - {"weight", "bias"}:
            return False
        return bias is None or (bias.dim() == 1 and bias.shape[0] in weight.shape)

    def _layout(self, module, x, output) -> tuple[str | None, str]:
        """('linear' | 'transposed' | None, why not)."""
        weight, bias = _torch.own_parameters(module)["weight"], _torch.own_parameters(module).get("bias")
        if not isinstance(x, torch.Tensor) or not isinstance(output, torch.Tensor) or x.dim() < 2:
            return None, "its call is not one batched tensor in, one tensor out"
        key = (tuple(x.shape), x.dtype, module.training)
        known = self._proved.setdefault(module, {})
        if key in known:
            return known[key], ""
        why = "its parameters' shapes do not match its input and output as a linear layer's would"
        for layout, w in (("linear", weight), ("transposed", weight.t())):
            if w.shape[1] != x.shape[-1] or tuple(output.shape) != (*x.shape[:-1], w.shape[0]):
                continue
            if bias is not None and bias.shape[0] != w.shape[0]:
                continue
            with torch.no_grad():
                expected = F.linear(x.to(w.dtype), w, bias).to(output.dtype)
                scale = float(expected.abs().max()) if expected.numel() else 0.0
                error = float((expected - output).abs().max()) if expected.numel() else 0.0
            if error <= _tolerance(output.dtype) * max(scale, 1.0):
                known[key] = layout
                return layout, ""
            why = f"its output differs from F.linear's on the same input (max difference {error:.2e})"
        known[key] = None
        return None, why

    def outputs(self, module, output):
        call = self.current(module)
        if call is None:
            return []
        layout, why = self._layout(module, call.args[0] if call.args else None, output)
        call.route = layout
        if layout is not None:
            return [output]
        refused = [m for s in call.sources.values() for m in s.refused]
        if refused:
            raise SharedTensorError(
                f"{paths.describe(module)} has a 2-D weight like nn.Linear but is not one: {why}, so "
                "nn.Linear's rule cannot be used (a subclass that overrides forward may compute "
                "something else). Nor can its parameters be split as bare parameters: "
                f"{refused[0]} Register a rule for it: @dpoptim.register_rule("
                f"{type(module).__qualname__}) (see docs/rules.md)."
            )
        return self.shared_outputs(call, output)

    def save(self, module, args, kwargs, output):
        call = self.current(module)
        if call.route is None:
            return ("bare", super().save(module, args, kwargs, output))
        return (call.route, args[0].detach(), _torch.own_parameters(module)["weight"].shape)

    # ----------------------------------------------------------------- per route
    def _as_linear(self, use):
        route, x, shape = use.saved
        out_features = shape[0] if route == "linear" else shape[1]
        return route, Use(_Width(out_features), x, use.grad_outputs, use.cache)

    def per_example(self, use, names):
        if use.saved[0] == "bare":
            return shared_per_example(use.module, use.saved[1], use.grad_outputs, names)
        route, inner = self._as_linear(use)
        out = _LINEAR.per_example(inner, names)
        if route == "transposed" and "weight" in out:
            out["weight"] = out["weight"].transpose(1, 2)
        return out

    def norms(self, use, names):
        if use.saved[0] == "bare":
            return super().norms(use, names)
        return _LINEAR.norms(self._as_linear(use)[1], names)

    def clipped_sum(self, use, names, factors):
        if use.saved[0] == "bare":
            return super().clipped_sum(use, names, factors)
        route, inner = self._as_linear(use)
        out = _LINEAR.clipped_sum(inner, names, factors)
        if route == "transposed" and "weight" in out:
            out["weight"] = out["weight"].t()
        return out

    def terms(self, use, name):
        if use.saved[0] == "bare":
            return None
        route, inner = self._as_linear(use)
        found = _LINEAR.terms(inner, name)
        if route == "transposed" and name == "weight":
            return [(a, b) for b, a in found]
        return found


register_automatic(LinearLookalikeRule(), order=20)


class EmbeddingLookalikeRule(EmbeddingRule):
    """A subclass of nn.Embedding with its own forward, proved to scale the lookup."""

    def applies(self, module) -> bool:
        params = {n for n, p in _torch.own_parameters(module).items() if p is not None}
        return isinstance(module, nn.Embedding) and params == {"weight"}

    def save(self, module, args, kwargs, output):
        indices = args[0] if args else next(iter(kwargs.values()), None)
        saved = super().save(module, (indices,), {}, output)
        why = "its output is not a tensor of the lookup's shape"
        if isinstance(output, torch.Tensor):
            with torch.no_grad():
                lookup = F.embedding(indices, module.weight, module.padding_idx).to(output.dtype)
                if lookup.shape == output.shape:
                    wide = torch.promote_types(output.dtype, torch.float32)
                    lk, out = lookup.to(wide), output.detach().to(wide)
                    denominator = float(lk.square().sum())
                    c = float((lk * out).sum()) / denominator if denominator > 0 else 1.0
                    error = float((out - c * lk).abs().max()) if out.numel() else 0.0
                    scale = float(out.abs().max()) if out.numel() else 0.0
                    if error <= _tolerance(output.dtype) * max(scale, 1e-30):
                        return [*saved, c]
                    why = f"its output is not a constant times nn.Embedding's (max difference {error:.2e})"
        raise SharedTensorError(
            f"{paths.describe(module)} is a subclass of nn.Embedding that overrides forward, and "
            f"{why}, so nn.Embedding's rule cannot be used. Register a rule for it: "
            f"@dpoptim.register_rule({type(module).__qualname__}) (see docs/rules.md)."
        )

    def _rows(self, use):
        if "rows" not in use.cache:
            indices, b = super()._rows(use)
            use.cache["rows"] = (indices, b * use.saved[2])
        return use.cache["rows"]


register_automatic(EmbeddingLookalikeRule(), order=10)
