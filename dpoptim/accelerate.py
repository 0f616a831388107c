"""Autograd accelerations: optional ways to make autograd do less, which change no result.

* **Ghost differentiation** (:meth:`AccelerationMixin._detach`): for the duration of a
  module's forward, its parameters are swapped for detached aliases (all but one), so
  autograd skips weight gradients the rule computes anyway.
* **Stand-ins** (:class:`_StandIn`): a rule that replays the layer's backward anyway
  (``Rule.inputs`` / ``Rule.input_gradients``) takes the place of the layer's own backward.

Both are off until the first step has been checked against autograd, and wherever
:meth:`AccelerationMixin._accelerate` says (DistributedDataParallel forwards that
all-reduce, FSDP2's sharded parameters). The clipping math (:mod:`dpoptim.clipping`) does
not depend on them: with them off, every result is the same.

Being off on the first step, they are not part of its check. So each route (ghost
differentiation keeping one parameter, or ``detach_all``; a stand-in), per rule type,
device and dtype, is checked against autograd the first time a call takes it, on
whatever step (:func:`dpoptim.verify.first_use`): that call keeps what its check needs
(:class:`dpoptim.verify.FirstUse`) in its ``Rule.call_state`` from before its forward to
the end of it, and in the verifier after. A route already checked costs a set lookup.
"""

from __future__ import annotations

import torch

from . import _torch, verify
from .capture import _twice
from .registry import Acceleration, Rule, Use

__all__ = ["AccelerationMixin"]

# Rule.call_state key: the FirstUse of a call that takes a route not yet checked.
_FIRST = "dpoptim.first_use"


def _stands_in(rule) -> bool:
    """Whether ``rule`` may stand in for its layer's backward (it overrides ``inputs``)."""
    return type(rule).inputs is not Acceleration.inputs


class _StandIn(torch.autograd.Function):
    """The backward of one module call, computed by its rule (:meth:`Rule.input_gradients`)
    instead of autograd's kernels. Inputs: the call's record, the number of input tensors,
    the input tensors, an anchor parameter (or None) and the outputs' values; it returns
    those values, now with this node as their ``grad_fn``. The anchor gets a zero gradient:
    it is there so that a backward through the module still accumulates into a parameter
    of the optimizer when nothing upstream does (how ``backward()`` is told from
    ``torch.autograd.grad``)."""

    @staticmethod
    def forward(ctx, record, n_inputs, *tensors):
        ctx.record, ctx.n_inputs = record, n_inputs
        anchor = tensors[n_inputs]
        ctx.anchor = None if anchor is None else (anchor.shape, anchor.dtype, anchor.device)
        values = tensors[n_inputs + 1:]
        # The rule replays from these inputs and outputs: saving them makes autograd refuse
        # a backward after either was modified in place, as the layer's own backward would.
        ctx.save_for_backward(*tensors[:n_inputs], *values)
        return tuple(t.detach() for t in values)  # new tensors, not views of the inputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        ctx.saved_tensors  # noqa: B018  (the version check)
        record = ctx.record
        if record.released:
            raise RuntimeError(_twice(record))
        use = Use(record.module, record.saved, list(grads), record.cache)
        inputs = list(record.rule.input_gradients(use))
        if len(inputs) != ctx.n_inputs:
            raise RuntimeError(
                f"{type(record.rule).__name__}.input_gradients returned {len(inputs)} gradients for "
                f"{ctx.n_inputs} inputs of {type(record.module).__name__}"
            )
        verify.note_input_gradients(record, inputs)  # the first stand-in of its kind is checked
        anchor = None if ctx.anchor is None else torch.zeros(ctx.anchor[0], dtype=ctx.anchor[1], device=ctx.anchor[2])
        return (None, None, *inputs, anchor) + (None,) * len(grads)


class AccelerationMixin:
    """The engine's ghost differentiation and stand-ins (see the module docstring)."""

    def _before_forward(self, module, decision, args) -> None:
        """After the first step, before the forward of a module with claimed parameters:
        ghost differentiation, and the start of a first use's check (module docstring)."""
        if verify.recomputing():  # a child of a module run again for a check: as autograd runs it
            return
        rule, routes = decision.rule, []
        if rule.detach_parameters:
            route = self._detach(module, decision, args)
            if route is not None and verify.unchecked(route):
                routes.append(route)
        if _stands_in(rule) and self._accelerate():
            live = [p for _, p in decision.claimed if p.requires_grad]
            # With inputs that need a gradient, or with the anchor alone: one check each.
            for detail in ("inputs", "anchor") if live else ():
                route = verify.route_key(rule, "stand-in", live[0], detail)
                if verify.unchecked(route):
                    routes.append(route)
        if routes:
            device = next(p for _, p in decision.claimed if p.requires_grad).device
            Rule.call_state(module)[_FIRST] = verify.FirstUse(routes, device)

    def _detach(self, module, decision, args) -> tuple | None:
        """Ghost differentiation: for the duration of the forward, replace the module's
        parameters with detached aliases, so autograd skips weight gradients that the rule
        computes anyway. One parameter (the smallest) stays attached, so the output has a
        graph and every backward through the module accumulates into some ``.grad``
        (which is how a ``backward()`` is told from ``torch.autograd.grad``). A rule with
        ``detach_all`` gives up that one too when the module's input already leads back to
        an attached parameter of this optimizer: both needs are then met upstream. Off
        until the first step has been checked against autograd, and off where
        :meth:`_accelerate` says. Returns the route taken (:func:`dpoptim.verify.route_key`),
        or None when nothing was detached."""
        live = [(n, p) for n, p in decision.claimed if p.requires_grad]
        if not live:
            return None
        if not self._accelerate():  # this call leaves them all attached: autograd reaches them
            self._keep(p for _, p in live)
            return None
        if decision.rule.detach_all and self._reaches_attached(args):
            keep = None
            route = verify.route_key(decision.rule, "ghost-all", live[0][1])
        else:
            chosen = dict(live).get(decision.rule.attached(module, [n for n, _ in live]))
            keep = chosen if chosen is not None else min(live, key=lambda item: item[1].numel())[1]
            # One call may keep a parameter that another call (of a shared module, or of a
            # later forward whose input has no graph) detached: autograd reaches it then.
            self._kept.add(id(keep))
            self._ghosts.discard(id(keep))
            if len(live) < 2:
                return None
            route = verify.route_key(decision.rule, "ghost", keep, next(n for n, p in live if p is keep))
        swapped = []
        for name, p in live:
            if p is not keep:
                owner, _, leaf = name.rpartition(".")
                owner = module.get_submodule(owner) if owner else module
                _torch.own_parameters(owner)[leaf] = p.detach()
                swapped.append((owner, leaf, p))
                if id(p) not in self._kept:
                    self._ghosts.add(id(p))
        self._detached[id(module)] = swapped
        return route

    def _keep(self, params) -> None:
        for p in params:
            self._kept.add(id(p))
            self._ghosts.discard(id(p))

    def _accelerate(self) -> bool:
        """Whether ghost differentiation and stand-ins may run now: not inside a forward of
        DistributedDataParallel that will all-reduce (its reducer waits for every
        parameter's gradient; under ``no_sync()`` it does not), and not for FSDP2's
        sharded parameters (FSDP swaps the module's parameters itself)."""
        return not self._sharded and not self._ddp_syncing

    def _reaches_attached(self, args, budget: int = 64) -> bool:
        """Whether the autograd graph of a tensor in ``args`` reaches, within ``budget``
        nodes, a parameter of this optimizer that autograd accumulates into: then every
        backward through the module accumulates into it."""
        frontier = [t.grad_fn for t in args if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen = set()
        while frontier and budget > 0:
            node = frontier.pop(0)
            if id(node) in seen:
                continue
            seen.add(id(node))
            budget -= 1
            variable = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf
            if variable is not None:
                if id(variable) in self._params:
                    return True
                continue
            frontier.extend(fn for fn, _ in node.next_functions if fn is not None)
        return False

    def _restore(self, module) -> None:
        swapped = self._detached.pop(id(module), None)
        if swapped:
            for owner, leaf, p in swapped:
                _torch.own_parameters(owner)[leaf] = p

    def _stand_in(self, record, args, kwargs, output, outputs):
        """Rewire the call's outputs through :class:`_StandIn` when its rule computes the
        gradients of the inputs itself: autograd then skips the layer's own backward (for a
        fused recurrent kernel, most of its cost), while the rule, which replays that
        backward anyway, returns the input gradients. Returns the new output, or None.
        Like ghost differentiation, off until the first step has been checked against
        autograd, and off where :meth:`_accelerate` says. Also where a call that takes a
        route for the first time hands its check to the verifier (module docstring)."""
        rule, module = record.rule, record.module
        if verify.recomputing():
            return None
        first = Rule.call_state(module).pop(_FIRST, None)
        inputs = rule.inputs(module, args, kwargs) if _stands_in(rule) else None
        if first is not None:
            taken = None if inputs is None else ("inputs" if inputs else "anchor")
            first.routes = [key for key in first.routes if key[1][0] != "stand-in" or key[1][1] == taken]
            if first.routes:
                first.after(args, kwargs)
                verify.first_use(record, first)
        if inputs is None:
            return None
        anchor = None
        if not self._reaches_attached(inputs):
            anchor = min((p for _, p in record.params), key=lambda p: p.numel())
        values = [t.detach() for t in outputs]
        new = _StandIn.apply(record, len(inputs), *inputs, anchor, *values)
        # Autograd no longer reaches this module's parameters through it (the anchor aside):
        # if one is accumulated, another path did (see _detach).
        for _, p in record.params:
            if p is anchor:
                self._kept.add(id(p))
                self._ghosts.discard(id(p))
            elif id(p) not in self._kept:
                self._ghosts.add(id(p))
        return rule.with_outputs(module, output, list(new))
