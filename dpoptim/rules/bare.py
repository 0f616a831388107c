"""Bare parameters: a module's own ``nn.Parameter`` used directly in its ``forward``.

Applies to any module with trainable parameters of its own and no registered rule (a
``cls_token`` and ``pos_embed`` of a vision transformer, a layer-scale ``gamma``, a learned
temperature, the weight of a hand-written RMS norm, ``x + self.pos``, ``x * self.scale``).
During the module's forward a torch function mode follows each of its parameters
(see :mod:`dpoptim.rules.shared`): every place where a parameter meets the batch
element-wise reads an explicit per-example copy ``E``, so autograd's gradient of ``E``
keeps the example axis, and

    ``g_i(p) = J^T (dL/dE_i summed over the broadcast dims)``

for the steps ``J`` from ``p`` to the tensor that met the batch (none, a view, a cast,
``1 + p``...). The parameters are as small as activations at most, so ``g_i`` is
materialised and the base class's norm and clipped sum apply. Child modules are not
involved: each has its own rule, and only this module's own parameters are followed.

Refused, with an error naming the module and the parameter: a use where the parameter
meets the batch in an op that is not element-wise (a matrix product, a concatenation
without an expand first), a parameter whose own first dimension lands on the batch axis,
and a module that returns a tensor derived from its parameter without the batch (its use
would happen where this module's forward cannot see it).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn

from .. import _torch, paths
from ..registry import Rule, register_automatic
from .shared import SharedMode, SharedTensorError, Source, per_example_of_uses

__all__ = ["BareParameterRule"]


def batch_size(args, kwargs=None) -> int | None:
    """The first dimension of the first tensor argument with one, else None."""
    for a in list(args) + list((kwargs or {}).values()):
        if isinstance(a, torch.Tensor) and a.dim() >= 1:
            return a.shape[0]
    return None


def _label(name, module) -> str:
    return f"parameter '{name}' of {paths.describe(module)}"


class _Call:
    """One forward call of a module: its sources, mode and (after the forward) its uses."""

    __slots__ = ("module", "args", "sources", "mode", "outputs", "metas", "route")

    def __init__(self, module, args, lenient):
        self.module = module
        self.args = args
        self.sources = {
            name: Source(p, functools.partial(_label, name, module), lenient)
            for name, p in _torch.own_parameters(module).items()
            if p is not None and p.requires_grad
        }
        tracked = {id(_torch.own_parameters(module)[name]): (_torch.own_parameters(module)[name], s) for name, s in self.sources.items()}
        # The module's buffers carry no examples, whatever their first dimension.
        constants = frozenset(id(b) for b in module.buffers())
        self.mode = SharedMode(tracked, batch_size(args), constants)
        self.outputs = None
        self.metas = None
        self.route = None


class BareParameterRule(Rule):
    """The rule of a module whose own parameters are used directly in its forward."""

    lenient = False  # refuse at the op (True: collect refusals; a subclass decides later)

    def applies(self, module) -> bool:
        # Batch norms never get here: BatchStatisticsGuard (dpoptim.rules.norm) comes first.
        return any(p is not None for p in _torch.own_parameters(module).values())

    def enter(self, module, args):
        return self._context(module, args)

    @contextlib.contextmanager
    def _context(self, module, args):
        call = _Call(module, args, self.lenient)
        if not call.sources:  # all frozen: nothing to follow
            yield
            return
        self.call_state(module)["call"] = call
        with call.mode:
            yield

    def current(self, module) -> _Call | None:
        """The innermost open call of ``module`` (None: its forward began with gradients off)."""
        return self.call_state(module).get("call")

    def shared_outputs(self, call: _Call, output) -> list[torch.Tensor]:
        if call.mode.holds(output):
            names = ", ".join(f"'{n}'" for n in call.sources)
            raise SharedTensorError(
                f"{paths.describe(call.module)} returns a tensor computed from its own parameter(s) "
                f"{names} alone, without the batch: the place where it meets the examples lies "
                "outside this module's forward, where dpoptim cannot split it per example. Use the "
                "parameter inside this module's forward (x + self.p, x * self.p, "
                "self.p.expand(x.shape[0], ...)), or register a rule for the module that uses it."
            )
        outputs, metas = [], []
        for name, source in call.sources.items():
            for E, steps, padded in source.uses:
                if E.requires_grad:
                    outputs.append(E)
                    metas.append((name, steps, padded))
        call.outputs, call.metas = outputs, metas
        return outputs

    def outputs(self, module, output):
        call = self.current(module)
        return [] if call is None else self.shared_outputs(call, output)

    def save(self, module, args, kwargs, output):
        call = self.current(module)
        bases = {name: _torch.own_parameters(module)[name].detach() for name in call.sources}
        return {"metas": call.metas, "bases": bases}

    def per_example(self, use, names):
        return shared_per_example(use.module, use.saved, use.grad_outputs, names)


def shared_per_example(module, saved, grads, names) -> dict[str, torch.Tensor]:
    metas, bases = saved["metas"], saved["bases"]
    out, n = {}, None
    for name in names:
        picked = [(meta, g) for meta, g in zip(metas, grads) if meta[0] == name]
        g = per_example_of_uses(
            [(None, steps, padded) for _, steps, padded in (m for m, _ in picked)],
            [g for _, g in picked], bases[name], functools.partial(_label, name, module),
        )
        out[name] = g
        if g is not None:
            n = g.shape[0]
    if n is None:
        n = next((g.shape[0] for g in grads if g is not None), 0)
    for name in names:
        if out[name] is None:
            base = bases[name]
            out[name] = base.new_zeros(n, *base.shape, dtype=torch.promote_types(base.dtype, torch.float32))
    return out


register_automatic(BareParameterRule(), order=100)
