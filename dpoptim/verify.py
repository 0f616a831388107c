"""Checking the rules against autograd: the verifier.

Two checks, both comparing a rule's *unclipped* sum ``sum_i g_i(p)`` with the gradient
autograd computes for the same loss:

* **The first step** (:func:`compare_sums`, run by the engine): every parameter's summed
  rule gradient against autograd's own ``p.grad`` contribution for that step. It catches
  a parameter also used where no rule sees it and a rule that is wrong for the model.
* **Every dynamically chosen path, the first time it is taken** (:func:`check_route`),
  of two kinds:

  - *The rules' own routes*: rules whose computation depends on what PyTorch did at run
    time (the attention rule reading a fused kernel's saved tensors or replaying the
    attention, the LSTM cell rule telling whether ``c'`` already carries the gradient
    through ``h'``) name the path of a use (:meth:`dpoptim.Rule.route`). The use is
    recomputed by autograd from its saved inputs (:meth:`dpoptim.Rule.reference`, with
    :func:`autograd_sum`) and the rule's unclipped sum compared with autograd's.
  - *The engine's accelerations* (:mod:`dpoptim.accelerate`), off during the checked
    first step and chosen per call after it: ghost differentiation keeping one parameter
    attached, ghost differentiation with every parameter detached (``detach_all``), and
    the stand-in for a layer's backward (``Rule.inputs`` / ``Rule.input_gradients``). A
    call that takes one of them first (per rule type, device and dtype) keeps its
    arguments and the state of the random generator and of autocast from before its
    forward (:func:`first_use`); at the end of the backward the module's ``forward`` is
    run again on them, called directly (no hooks), inside the rule's ``check`` and
    context, and autograd's gradients of this call alone are compared with the rule's
    unclipped sum and, for a stand-in, with the input gradients it handed upstream.

  Either way the first use of each path in a process, on any step, is checked, every
  use of a path already checked costs one set lookup, and a mismatch is an error at
  ``step()``, never a silent wrong gradient. A use with no example or a non-finite
  gradient proves nothing: its path stays unchecked until a later use.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Callable

import torch

from . import _torch, paths
from .nested import map_tensors
from .registry import begin_call, end_call

__all__ = ["tolerance", "mismatch", "compare_sums", "autograd_sum", "check_route", "first_use", "FirstUse"]

# (type of the rule, its route key) of every path already checked in this process.
_VERIFIED: set = set()
# Calls that took an acceleration's route for the first time: record -> FirstUse.
_FIRST_USES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Route -> the backward (group id) whose check of it failed: one error per route there.
_FAILED: dict = {}
# Per thread: how many recomputations (_autograd_grads) are running. Their forwards take no
# acceleration: the children of a module run as autograd runs them, for the reference.
_RECOMPUTING = threading.local()


def recomputing() -> bool:
    """Whether this thread is running a module's forward again for a check."""
    return getattr(_RECOMPUTING, "depth", 0) > 0


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
    return _autograd_grads(module, names, forward, grad_outputs, [])[0]


def _autograd_grads(module, names, forward, grad_outputs, inputs) -> tuple[dict, list]:
    """:func:`autograd_sum`, and the gradients of ``inputs`` (leaves ``forward`` reads)."""
    params = _torch.own_parameters(module)
    swapped = {}
    for name in names:
        owner, _, leaf = name.rpartition(".")
        holder = _torch.own_parameters(module.get_submodule(owner)) if owner else params
        swapped[name] = (holder, leaf, holder[leaf])
        holder[leaf] = holder[leaf].detach().requires_grad_()
    _RECOMPUTING.depth = getattr(_RECOMPUTING, "depth", 0) + 1
    try:
        with torch.enable_grad():
            outputs = forward()
            pairs = [(o, g) for o, g in zip(outputs, grad_outputs)
                     if isinstance(o, torch.Tensor) and o.requires_grad and g is not None]
            leaves = [holder[leaf] for holder, leaf, _ in swapped.values()] + list(inputs)
            grads = torch.autograd.grad([o for o, _ in pairs], leaves, [g.to(o.dtype) for o, g in pairs],
                                        allow_unused=True) if pairs else [None] * len(leaves)
    finally:
        _RECOMPUTING.depth -= 1
        for holder, leaf, original in swapped.values():
            holder[leaf] = original
    params = {name: (torch.zeros_like(swapped[name][2]) if g is None else g) for name, g in zip(names, grads)}
    given = [torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads[len(names):])]
    return params, given


def check_route(record, use, names: list[str], n: int, autocast: bool) -> str | None:
    """At the end of a backward, for each use: the first time it takes its rule's route
    (``rule.route(use)``) or one of the engine's accelerations (:func:`first_use`) in this
    process, compare with autograd for this use alone; return what is wrong, or None."""
    problems = [problem for problem in (_check_rule_route(record, use, names, n, autocast),
                                        _check_first_use(record, use, names, n, autocast)) if problem]
    return "\n".join(problems) if problems else None


def _unclipped(rule, use, names: list[str], n: int) -> dict:
    return rule.clipped_sum(use, names, torch.ones(n, dtype=torch.float64)) if names else {}


def _differences(pairs, autocast: bool) -> list[str] | None:
    """``(what, raw, reference)`` of one use compared: what differs, or None when a side is
    not finite (a use with a non-finite gradient proves nothing either way). A gradient
    that is zero in truth (a norm layer's weight where an example's values are all equal)
    holds only roundoff on both sides, so errors are judged against the use's largest
    gradient too."""
    dense = [(what, raw.to_dense() if raw.is_sparse else raw, ref.to_dense() if ref.is_sparse else ref)
             for what, raw, ref in pairs]
    if not all(bool(torch.isfinite(raw).all()) and bool(torch.isfinite(ref).all()) for _, raw, ref in dense):
        return None
    largest = max((float(ref.norm()) for _, _, ref in dense), default=0.0)
    problems = []
    for what, raw, reference in dense:
        tol = tolerance(reference.dtype, autocast)
        error = float((raw.to(reference.dtype) - reference).norm())
        if error > tol * (float(reference.norm()) + float(raw.norm()) + largest) + 1e-30:
            problems.append(f"{what} (relative error {error / (float(reference.norm()) + 1e-30):.2e})")
    return problems


def _check_rule_route(record, use, names, n, autocast) -> str | None:
    rule = record.rule
    route = rule.route(use)
    if route is None or (type(rule), route) in _VERIFIED or not names or n == 0:
        return None
    reference = rule.reference(use, names)
    if reference is None:
        return None
    raw = _unclipped(rule, use, names, n)
    problems = _differences([(f"'{name}'", raw[name], reference[name]) for name in names], autocast)
    if problems is None:
        return None
    if problems:
        return (
            f"{type(rule).__name__} took the route {route!r} for {type(record.module).__name__} for the first "
            f"time, and its gradients differ from autograd's for {', '.join(problems)}: this PyTorch "
            "computes that layer differently from what the rule relies on. Please report it; meanwhile "
            "freeze the layer or use another configuration of it."
        )
    _VERIFIED.add((type(rule), route))
    return None


# ---------------------------------------------------------------- the engine's accelerations
_ROUTES = {
    "ghost": "ghost differentiation (every parameter but {kept!r} detached from autograd during the forward)",
    "ghost-all": "ghost differentiation with every parameter detached (detach_all: the input leads back to an "
                 "attached parameter)",
    "stand-in": "its stand-in for the layer's backward (Rule.inputs / Rule.input_gradients: autograd skips the "
                "layer's own backward, and the gradients of its inputs come from the rule)",
}
_FIXES = {
    "ghost": "the module's forward computes something else when its parameters are detached, or the rule does "
             "not match it: set detach_parameters = False on a rule of your own",
    "ghost-all": "the module's forward computes something else when its parameters are detached, or the rule "
                 "does not match it: set detach_all = False (or detach_parameters = False) on a rule of your own",
    "stand-in": "every layer upstream would get wrong per-example gradients: fix its input_gradients, or return "
                "None from inputs() so that autograd runs the layer's backward",
}

_FIXES_SHORT = "For a built-in rule, please report it; meanwhile freeze the layer or use another configuration of it."


def route_key(rule, kind: str, param: torch.Tensor, detail: str | None = None) -> tuple:
    """The key in the checked set of an acceleration route of ``rule``: its kind (``"ghost"``
    with the name of the parameter kept attached, ``"ghost-all"``, ``"stand-in"`` with
    ``"inputs"`` when some input needs a gradient, else ``"anchor"``), with the device type
    and dtype of the module's parameters."""
    return (type(rule), (kind, detail, param.device.type, param.dtype))


def unchecked(key: tuple) -> bool:
    return key not in _VERIFIED


class FirstUse:
    """What the check of a call's first-taken acceleration routes needs: the routes, the
    state of the random generator and of autocast before the forward (read when it is
    built, before the forward), the call's arguments (:meth:`after`) and, for a stand-in,
    the input gradients the rule returned in the backward."""

    __slots__ = ("routes", "device", "rng", "autocast", "args", "kwargs", "input_grads")

    def __init__(self, routes: list, device: torch.device):
        self.routes, self.device = list(routes), device
        self.args = self.kwargs = self.input_grads = None
        self.rng = None
        try:
            from .rules._common import rng_state  # here: the rules import this module
            self.rng = rng_state(device)
        except ValueError:  # no replayable generator on this device: the forward must not draw
            pass
        kind = device.type
        self.autocast = (torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None)

    def after(self, args: tuple, kwargs: dict) -> None:
        """Keep the call's arguments, detached (a tensor that required a gradient becomes a
        leaf that does: its gradient is the reference for a stand-in's)."""
        leaves: dict[int, torch.Tensor] = {}

        def leaf(t):
            if id(t) not in leaves:  # one leaf per tensor: `query is key` holds again
                leaves[id(t)] = t.detach().requires_grad_() if t.requires_grad else t.detach()
            return leaves[id(t)]

        self.args, self.kwargs = map_tensors(leaf, (tuple(args), dict(kwargs)))

    @contextlib.contextmanager
    def replayed(self):
        """The generator as it was before the forward (the user's stream comes back after),
        and autocast as it was then."""
        with contextlib.ExitStack() as stack:
            if self.rng is not None:
                from .rules._common import rng_replayed
                stack.enter_context(rng_replayed(self.device, self.rng))
            if self.autocast is not None:
                stack.enter_context(torch.autocast(self.device.type, dtype=self.autocast))
            yield


def first_use(record, first: FirstUse) -> None:
    """Register the first use of ``first.routes`` by ``record``'s call, checked at the end
    of its backward (:func:`check_route`)."""
    _FIRST_USES[record] = first


def note_input_gradients(record, grads: list) -> None:
    """The stand-in's backward: keep what the rule returned for the inputs, for the check."""
    first = _FIRST_USES.get(record)
    if first is not None and any(key[1][0] == "stand-in" for key in first.routes):
        first.input_grads = [None if g is None else g.detach().clone() for g in grads]


def _recompute(record, first: FirstUse, names: list[str], grad_outputs: list) -> tuple[dict, list]:
    """Autograd's gradients of this call alone, for the parameters ``names`` and the inputs
    the rule stands in for: the module's ``forward`` run again on the kept arguments, as the
    engine ran it (the rule's ``check`` and context), without hooks."""
    module, rule = record.module, record.rule
    args, kwargs = first.args, first.kwargs
    inputs = rule.inputs(module, args, kwargs) if first.input_grads is not None else None

    def forward():
        with first.replayed():
            begin_call(module)
            try:
                rule.check(module)
                context = rule.enter(module, args)
                with context if context is not None else contextlib.nullcontext():
                    return rule.outputs(module, type(module).forward(module, *args, **kwargs))
            finally:
                end_call(module)

    return _autograd_grads(module, names, forward, grad_outputs, inputs or [])


def _check_first_use(record, use, names, n, autocast) -> str | None:
    first = _FIRST_USES.pop(record, None)
    if first is None or n == 0:
        return None
    routes = [key for key in first.routes if key not in _VERIFIED and _FAILED.get(key) != record.group_id]
    if first.input_grads is None:  # the stand-in's backward did not run: nothing of it to check
        routes = [key for key in routes if key[1][0] != "stand-in"]
    if not routes:
        return None
    if not any(key[1][0] == "stand-in" for key in routes):
        first.input_grads = None
    # The rule's own recomputation where it has one (it knows how its outputs nest: an
    # LSTM cell's h' computed from its c'); the module's forward again otherwise, and for
    # the gradients of a stand-in's inputs.
    try:
        reference, inputs = record.rule.reference(use, names) if names else {}, []
        if reference is None or first.input_grads is not None:
            recomputed, inputs = _recompute(record, first, names, use.grad_outputs)
            reference = recomputed if reference is None else reference
    except Exception as exc:  # a route left unchecked is an error too, at step()
        return (f"{type(record.rule).__name__} took {_taken(routes)} for {paths.describe(record.module)} for the "
                f"first time, and recomputing that call to check it against autograd failed: {exc!r}. "
                f"{_FIXES_SHORT}")
    raw = _unclipped(record.rule, use, names, n)
    pairs = [(f"'{name}'", raw[name], reference[name]) for name in names]
    if first.input_grads is not None:
        pairs += [(f"the gradient of its input {i}", torch.zeros_like(r) if g is None else g, r)
                  for i, (g, r) in enumerate(zip(first.input_grads, inputs))]
    problems = _differences(pairs, autocast)
    if problems is None:
        return None
    if not problems:
        _VERIFIED.update(routes)
        return None
    for key in routes:
        _FAILED[key] = record.group_id
    fixes = "; ".join(dict.fromkeys(_FIXES[key[1][0]] for key in routes))
    return (
        f"{type(record.rule).__name__} took {_taken(routes)} for {paths.describe(record.module)} for the first "
        f"time, and autograd's gradients of that call differ for {', '.join(problems)}: {fixes}. {_FIXES_SHORT}"
    )


def _taken(routes) -> str:
    return " and ".join(_ROUTES[kind].format(kept=detail) for kind, detail, *_ in (key[1] for key in routes))
