"""The registry of per-layer rules: one table from module type to the rule that clips it.

The rule contract
-----------------
A rule turns what one call of a module saw (its inputs at forward time, the gradients of
its outputs at backward time) into per-example quantities for the parameters it owns.

For one call ("use") of a module on a batch of ``n`` examples, let ``L`` be the loss that
was backpropagated and ``g_i(p)`` the gradient of ``L`` with respect to parameter ``p``
restricted to example ``i`` (so that autograd's ``p.grad`` is ``sum_i g_i(p)``). A rule
provides, for a list of parameter names it is asked about:

=================  ===================================  ==================================
method             returns (per name)                   meaning
=================  ===================================  ==================================
``per_example``    tensor ``[n, *p.shape]``             ``g_i(p)`` for every example
``norms``          tensor ``[n]``                       ``||g_i(p)||^2``
``clipped_sum``    tensor ``p.shape``                   ``sum_i f_i g_i(p)`` for factors f
=================  ===================================  ==================================

Only ``per_example`` is required: the base class derives ``norms`` and ``clipped_sum``
from it. Rules override the other two when a cheaper route exists (the "ghost" norm of
Goodfellow 2015 / Li et al. 2022, or the book-keeping clipped sum of Bu et al. 2023).

Loss scaling never reaches a rule: rules see autograd's raw output gradients. The engine
turns ``'mean'`` reduction back into per-example losses by multiplying norms by ``n^2``
and factors by ``n``.

Factors may be exactly zero for examples whose gradient is not finite; the engine zeroes
such examples' non-finite inputs before calling ``clipped_sum``, so a rule needs no
special case for them.

Register a rule with :func:`register_rule`; built-in rules use the same door.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from typing import Any, Callable

import torch
from torch import nn

from ._torch import own_parameters

__all__ = ["Rule", "RuleMath", "Capture", "Acceleration", "Verification", "Use", "register_rule", "rule_for", "registered_rules", "resolve_rule"]


@dataclasses.dataclass
class Use:
    """One call of a module, as seen by its rule.

    ``saved`` is whatever :meth:`Rule.save` kept at forward time; ``grad_outputs`` holds
    the gradients of the tensors :meth:`Rule.outputs` returned, in order (``None`` where
    no gradient arrived); ``cache`` lets a rule share work between its methods.
    """

    module: nn.Module
    saved: Any
    grad_outputs: list
    cache: dict = dataclasses.field(default_factory=dict)


class RuleMath:
    """The math of a rule: per-example quantities of one use. Only :meth:`per_example` is
    required; :meth:`norms` and :meth:`clipped_sum` default to it, :meth:`terms` to None."""

    # Whether norms / clipped sums read the module's parameter values (a replayed backward,
    # not only the saved inputs and output gradients). Under FSDP2, which releases a
    # block's gathered weights after its backward, the engine gathers them again for the
    # clipping at the end of the backward.
    reads_weights = False

    def per_example(self, use: Use, names: list[str]) -> dict[str, torch.Tensor]:
        """Per-example gradients ``g_i(p)``, shape ``[n, *p.shape]``."""
        raise NotImplementedError(f"{type(self).__name__} must implement per_example")

    def norms(self, use: Use, names: list[str]) -> dict[str, torch.Tensor]:
        """Per-example squared norms ``||g_i(p)||^2``, shape ``[n]``."""
        grads = self._per_example_cached(use, names)
        # reshape, not flatten(1): a scalar parameter's gradients are [n], and n may be 0
        return {name: g.reshape(g.shape[0], math.prod(g.shape[1:])).square().sum(1)
                for name, g in ((name, grads[name]) for name in names)}

    def clipped_sum(self, use: Use, names: list[str], factors: torch.Tensor) -> dict[str, torch.Tensor]:
        """``sum_i factors_i g_i(p)``, shape ``p.shape``."""
        grads = self._per_example_cached(use, names)
        return {name: torch.tensordot(factors.to(grads[name].dtype), grads[name], dims=1) for name in names}

    def terms(self, use: Use, name: str) -> list[tuple[torch.Tensor, torch.Tensor | None]] | None:
        """Optional: ``g_i(p)`` as a sum of outer products over rows, for parameters shared
        by several uses, whose norm then needs the cross terms between uses without
        materialising ``g_i``.

        Each term ``(out, inp)`` means ``g_i = sum_t out_it inp_it^T`` over the weight viewed
        as ``[p.shape[0], -1]``: ``out`` is ``[n, T, p.shape[0]]``, or an integer tensor
        ``[n, T]`` of row indices (one-hot rows, as an embedding); ``inp`` is ``[n, T, d]``, or
        None for a bias (``g_i = sum_t out_it``). None (the default): the engine
        materialises ``per_example`` instead.
        """
        return None

    def _per_example_cached(self, use: Use, names: list[str]) -> dict[str, torch.Tensor]:
        cached = use.cache.setdefault("per_example", {})
        missing = [name for name in names if name not in cached]
        if missing:
            cached.update(self.per_example(use, missing))
        return cached


class Capture:
    """How a rule sees a call of its module: which parameters it accounts for, what it
    keeps from the forward, which output gradients it needs. The defaults fit a module
    whose forward takes the batch as its first argument and returns tensors."""

    def parameters(self, module: nn.Module) -> dict[str, nn.Parameter]:
        """The parameters this rule accounts for, by name relative to ``module``."""
        return {name: p for name, p in own_parameters(module).items() if p is not None}

    def check(self, module: nn.Module) -> None:
        """Called before each forward pass with gradients on of a module that owns parameters
        of the optimizer: raise here to refuse a configuration before the forward changes
        anything (a frozen layer whose forward changes the model: :meth:`changes_state`)."""

    def changes_state(self, module: nn.Module) -> str | None:
        """Why this call of ``module`` would change the model from the batch outside the
        optimizer and without noise (running statistics, rows renormalised in place), or None
        (the default). Asked before every forward pass with gradients on of a module inside
        the trained model, whether or not it owns parameters of the optimizer (a frozen
        layer's buffers and weights are published with the model all the same), and raised
        at once, before the forward changes anything."""
        return None

    def mixes_examples(self, module: nn.Module) -> str | None:
        """Why this call of ``module`` mixes the examples of its batch (so that per-example
        gradients do not exist), or None (the default). Asked after every forward pass with
        gradients on, whether or not the module owns parameters of the optimizer (a frozen
        BatchNorm still mixes); a backward that reaches such a call is refused at ``step()``
        with this text."""
        return None

    def forward_context(self, module: nn.Module):
        """Optional: a context manager the module's forward runs in (entered after
        :meth:`check`, left when the forward returns or raises), or None. For a kernel
        setting that makes the forward replayable."""
        return None

    def enter(self, module: nn.Module, args: tuple):
        """Optional: like :meth:`forward_context`, but given the call's positional inputs.
        By default :meth:`forward_context`."""
        return self.forward_context(module)

    def save(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        """What to keep from the forward call (by default its positional inputs)."""
        return args

    def outputs(self, module: nn.Module, output: Any) -> list[torch.Tensor]:
        """The output tensors whose gradients the rule needs (by default all of them)."""
        if isinstance(output, torch.Tensor):
            return [output]
        if isinstance(output, (tuple, list)):
            return [t for t in output if isinstance(t, torch.Tensor)]
        raise TypeError(
            f"{type(self).__name__} cannot find the output tensors of {type(module).__name__}; "
            "override Rule.outputs"
        )

    def replace_output(self, module: nn.Module, saved: Any, output: Any) -> Any:
        """Optional: a replacement for the module's output (an alias of it that carries
        something on), or None to keep it. Called after :meth:`save`; the gradients the
        rule receives are still those of the tensors :meth:`outputs` returned."""
        return None

    @staticmethod
    def call_state(module: nn.Module) -> dict:
        """Scratch space of ``module``'s call now running on this thread (from :meth:`check`
        to :meth:`save` and :meth:`outputs`): rules are shared by every module of their type,
        so state of one call lives here, never on the rule. Empty outside a call. Keys
        beginning with ``"dpoptim."`` are the engine's."""
        stack = getattr(_calls, "stacks", {}).get(id(module))
        return stack[-1] if stack else {}


class Acceleration:
    """Optional ways to make autograd do less for a module; none changes a result. The
    engine uses them only after the first step has been checked against autograd, and not
    under torch.distributed; each route they open is checked against autograd the first
    time a call takes it (:mod:`dpoptim.verify`).

    ``detach_parameters = True`` lets the engine hide all but one of the module's
    parameters from autograd during the forward pass, so autograd does not compute weight
    gradients the rule computes anyway ("ghost differentiation"). Set it only when the
    module's forward reads its parameters through ``module._parameters`` at call time
    (true for layers calling ``F.linear``/``F.conv*`` on ``self.weight``; false for fused
    RNNs, which keep their own list of weight references). A rule that replays the layer's
    backward anyway can stand in for it (:meth:`inputs`, :meth:`input_gradients`).
    """

    detach_parameters = False
    # With detach_parameters: may the engine detach *every* parameter when the module's
    # input already has a graph leading to an attached parameter? Worth it when autograd
    # would do costly work for the one kept attached (a convolution's bias gradient makes
    # oneDNN compute the weight gradient too).
    detach_all = False


    def attached(self, module: nn.Module, names: list[str]) -> str | None:
        """With ``detach_parameters``: the one parameter (of ``names``) to leave attached
        during the forward, so that every output still has a graph. None: the smallest."""
        return None

    def inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
        """Optional, with :meth:`input_gradients`: the tensors of this call that its outputs
        depend on, besides the parameters. A rule that returns them computes their gradients
        itself, so the engine stands in for the module's own backward after the first step:
        it routes the outputs through one autograd node whose backward asks
        :meth:`input_gradients`, and autograd no longer runs the layer's backward kernels,
        weight gradients included. Worth it for rules that replay the layer's backward
        anyway (fused recurrent layers). None (the default): autograd's backward runs."""
        return None

    def input_gradients(self, use: Use) -> list[torch.Tensor | None]:
        """The gradients of the tensors :meth:`inputs` returned, in order, given the output
        gradients ``use.grad_outputs`` (None where no gradient is needed). Work kept in
        ``use.cache`` is there again when the engine asks for norms and clipped sums."""
        raise NotImplementedError(f"{type(self).__name__} must implement input_gradients to use inputs()")

    def with_outputs(self, module: nn.Module, output: Any, tensors: list[torch.Tensor]) -> Any:
        """``output`` with the tensors :meth:`outputs` found replaced by ``tensors``, in
        order (used with :meth:`inputs`)."""
        if isinstance(output, torch.Tensor):
            return tensors[0]
        replacements = iter(tensors)
        values = [next(replacements) if isinstance(t, torch.Tensor) else t for t in output]
        return type(output)(*values) if hasattr(output, "_fields") else type(output)(values)


class Verification:
    """For a rule whose computation depends on what PyTorch did at run time: the name of
    the path a use took, and autograd's answer for that use, so that each path is checked
    against autograd the first time it is taken (:mod:`dpoptim.verify`), not only on the
    first step."""

    def route(self, use: Use):
        """A hashable name of the path this use took (with what decides its correctness:
        device type, dtype), or None (the default) when the rule has one path."""
        return None

    def reference(self, use: Use, names: list[str]) -> dict[str, torch.Tensor] | None:
        """Autograd's ``sum_i g_i(p)`` for this use alone, recomputed from ``use.saved``
        (see :func:`dpoptim.verify.autograd_sum`), or None when it cannot be recomputed."""
        return None


class Rule(RuleMath, Capture, Acceleration, Verification):
    """Base class for per-layer rules: the math (:class:`RuleMath`), capture
    (:class:`Capture`), acceleration (:class:`Acceleration`) and run-time path checks
    (:class:`Verification`), each with defaults. Subclass it, implement
    :meth:`per_example` (or a cheaper route) and decorate with :func:`register_rule`."""


# Per thread: id(module) -> a stack of per-call dicts (Capture.call_state), one per call
# of the module now running (a module may call itself).
_calls = threading.local()


def begin_call(module: nn.Module) -> None:
    """A call of ``module`` begins (the engine, before the rule's ``check``)."""
    stacks = getattr(_calls, "stacks", None)
    if stacks is None:
        stacks = _calls.stacks = {}
    stacks.setdefault(id(module), []).append({})


def end_call(module: nn.Module) -> None:
    """The innermost call of ``module`` ended (returned or raised)."""
    stacks = getattr(_calls, "stacks", None)
    stack = None if stacks is None else stacks.get(id(module))
    if stack:
        stack.pop()
        if not stack:
            del stacks[id(module)]


_RULES: dict[type, Rule] = {}


def register_rule(layer_type: type, rule: Rule | type | None = None, *, replace: bool = False) -> Callable | Rule:
    """Register ``rule`` for modules of exactly ``layer_type`` (and its subclasses that
    keep its ``forward``).

    Use as a decorator on a :class:`Rule` subclass::

        @dpoptim.register_rule(MyLayer)
        class MyLayerRule(dpoptim.Rule):
            def per_example(self, use, names): ...

    Registering a second rule for the same type raises unless ``replace=True``.
    """
    if not (isinstance(layer_type, type) and issubclass(layer_type, nn.Module)):
        raise TypeError(f"register_rule: layer_type must be an nn.Module subclass, got {layer_type!r}")

    def add(r):
        instance = r() if isinstance(r, type) else r
        if not isinstance(instance, Rule):
            raise TypeError(f"register_rule: a rule must subclass dpoptim.Rule, got {r!r}")
        if layer_type in _RULES and not replace:
            raise ValueError(
                f"a rule for {layer_type.__name__} is already registered "
                f"({type(_RULES[layer_type]).__name__}); pass replace=True to override it"
            )
        _RULES[layer_type] = instance
        return r

    return add if rule is None else add(rule)


def rule_for(module: nn.Module) -> Rule | None:
    """The rule for ``module``: its exact type's, else the nearest base class's, but only
    when the subclass does not override ``forward`` (otherwise the base rule could be wrong)."""
    cls = type(module)
    rule = _RULES.get(cls)
    if rule is not None:
        return rule
    for base in cls.__mro__[1:]:
        if base in _RULES:
            return _RULES[base] if cls.forward is base.forward else None
    return None


# Rules that apply without registration, tried in order when no rule is registered for a
# module: each has ``applies(module) -> bool`` (see dpoptim.rules.lookalike, .bare).
_AUTOMATIC: list[tuple[int, Rule]] = []


def register_automatic(rule: Rule, order: int) -> Rule:
    """Add a rule that decides by itself which modules it covers (``rule.applies``);
    lower ``order`` is tried first."""
    _AUTOMATIC.append((order, rule))
    _AUTOMATIC.sort(key=lambda item: item[0])
    return rule


def resolve_rule(module: nn.Module) -> Rule | None:
    """The rule the engine uses for ``module``: the registered one (:func:`rule_for`), else
    the first automatic rule that applies: a look-alike of a stock layer, proved on the
    call's own inputs (:mod:`dpoptim.rules.lookalike`), or the bare-parameter rule for a
    module that uses its own parameters directly (:mod:`dpoptim.rules.bare`)."""
    rule = rule_for(module)
    if rule is not None:
        return rule
    for _, candidate in _AUTOMATIC:
        if candidate.applies(module):
            return candidate
    return None


def registered_rules() -> dict[type, Rule]:
    """A copy of the registry table."""
    return dict(_RULES)
