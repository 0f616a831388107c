"""Checking the rules against autograd: the verifier.

Two checks, both comparing a rule's *unclipped* sum ``sum_i g_i(p)`` with the gradient
autograd computes for the same loss:

* **The first step** (:func:`compare_sums`, run by the engine): every parameter's summed
  rule gradient against autograd's own ``p.grad`` contribution for that step. It catches
  a parameter also used where no rule sees it and a rule that is wrong for the model.
* **Every dynamically chosen path, the first time it is taken** (:func:`check_route`):
  rules whose computation depends on what PyTorch did at run time (the attention rule
  reading a fused kernel's saved tensors or replaying the attention, the LSTM cell rule
  telling whether ``c'`` already carries the gradient through ``h'``) name the path of a
  use (:meth:`dpoptim.Rule.route`). The first use of each path in a process, on any step,
  is recomputed by autograd from the use's saved inputs (:func:`autograd_sum`, calling
  the module's ``forward`` directly, without hooks) and compared. A mismatch is an error
  at ``step()``, never a silent wrong gradient.
"""

from __future__ import annotations

from typing import Callable

import torch

from . import _torch

__all__ = ["tolerance", "mismatch", "compare_sums", "autograd_sum", "check_route"]

# (type of the rule, its route key) of every path already checked in this process.
_VERIFIED: set = set()


def tolerance(dtype: torch.dtype, autocast: bool) -> float:
    """Relative tolerance of a comparison in ``dtype`` (half precision under autocast)."""
    if autocast:
        return 3e-2
    return {torch.float64: 1e-6, torch.float32: 1e-3}.get(dtype, 3e-2)


def mismatch(raw: torch.Tensor, reference: torch.Tensor, tol: float, scale: float = 0.0) -> float | None:
    """The relative error of ``raw`` against ``reference`` when it exceeds ``tol`` (judged
    against both norms and ``scale``, the largest gradient around, for gradients that are
    roundoff on both sides), else None."""
    raw, reference = raw.to(reference.dtype), reference
    error = (raw - reference).norm()
    if error > tol * (reference.norm() + raw.norm() + 1e-2 * scale) + 1e-30:
        return float(error / (reference.norm() + 1e-30))
    return None


def compare_sums(raw_sums: dict, autograd_sums: dict, params: dict, autocast: bool) -> list:
    """The first step's check: for every parameter (by ``id``) with both sums, the rules'
    unclipped sum against autograd's gradient. Returns ``(parameter, relative error)`` for
    each that differs. A parameter whose true gradient is exactly zero (a bias right before
    InstanceNorm, which removes it again) holds only roundoff on both sides, so errors are
    judged against the largest gradient of the model too."""
    largest = max((float(r.norm()) for r in autograd_sums.values()), default=0.0)
    problems = []
    for pid, raw in raw_sums.items():
        reference = autograd_sums.get(pid)
        if reference is None:
            continue
        p = params[pid]
        error = mismatch(raw, reference, tolerance(p.dtype, autocast), largest)
        if error is not None:
            problems.append((p, error))
    return problems


def autograd_sum(module, names: list[str], forward: Callable, grad_outputs: list) -> dict[str, torch.Tensor]:
    """Autograd's gradient of ``sum_k <out_k, grad_outputs[k]>`` with respect to the
    parameters ``names`` of ``module``, where ``forward()`` recomputes the outputs.

    The parameters are swapped, for the call only, for fresh leaves that require a
    gradient, and ``forward`` must call the module's ``forward`` method directly (not
    ``module(...)``), so that no hook of the engine sees this recomputation."""
    params = _torch.own_parameters(module)
    swapped = {}
    for name in names:
        owner, _, leaf = name.rpartition(".")
        holder = _torch.own_parameters(module.get_submodule(owner)) if owner else params
        swapped[name] = (holder, leaf, holder[leaf])
        holder[leaf] = holder[leaf].detach().requires_grad_()
    try:
        with torch.enable_grad():
            outputs = forward()
            pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                     if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            leaves = [holder[leaf] for holder, leaf, _ in swapped.values()]
            grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g.to(o.dtype) for o, g in pairs],
                                        allow_unused=True) if pairs else [None] * len(leaves)
    finally:
        for holder, leaf, original in swapped.values():
            holder[leaf] = original
    return {name: (torch.zeros_like(swapped[name][2]) if g is None else g) for name, g in zip(names, grads)}


def check_route(record, use, names: list[str], n: int, autocast: bool) -> str | None:
    """The first time a use takes its rule's route (``rule.route(use)``) in this process,
    compare the rule's unclipped sum with autograd's for this use alone; return what is
    wrong, or None (also when the route is known, or the rule names none)."""
    rule = record.rule
    route = rule.route(use)
    if route is None or (type(rule), route) in _VERIFIED or not names:
        return None
    reference = rule.reference(use, names)
    if reference is None:
        return None
    ones = torch.ones(n, dtype=torch.float64)
    raw = rule.clipped_sum(use, names, ones)
    problems = []
    for name in names:
        tol = tolerance(reference[name].dtype, autocast)
        error = mismatch(raw[name], reference[name], tol)
        if error is not None:
            problems.append(f"'{name}' (relative error {error:.2e})")
    if problems:
        return (
            f"{type(rule).__name__} took the route {route!r} for {type(record.module).__name__} for the first "
            f"time, and its gradients differ from autograd's for {', '.join(problems)}: this PyTorch "
            "computes that layer differently from what the rule relies on. Please report it; meanwhile "
            "freeze the layer or use another configuration of it."
        )
    _VERIFIED.add((type(rule), route))
    return None
