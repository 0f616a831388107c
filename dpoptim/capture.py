"""The capture layer: what the engine's hooks see of forward and backward passes.

A forward call of a module whose rule claims trainable parameters of the optimizer
becomes a :class:`_Record` (what the rule saved, plus a gradient hook on each output it
named); the output gradients and parameter accumulations of one ``backward()`` call are
collected into a :class:`_Group`, which :mod:`dpoptim.clipping` processes once at the end
of that backward. This module holds those structures, the hook functions (which hold the
engine weakly, so dropping the optimizer frees it and its hooks) and :class:`CaptureMixin`,
the engine's side of the hooks: deciding what a module call is, recording it, grouping
gradients by backward call, and refusing what cannot be clipped (a call that mixes
examples, two DP optimizers in one backward, gradients cleared behind the optimizer's back).
Where the hooks live (process-wide, or on the model's modules) is :mod:`dpoptim.scope`'s job.
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref

import torch
from torch import nn

from . import _torch, fsdp, paths
from .errors import PrivacyWarning
from .registry import begin_call, end_call, resolve_rule

__all__ = ["CaptureMixin"]

_group_ids = itertools.count()

# The last backward() call that reached a DP optimizer's parameters: [graph task id, the
# engines it reached]. Two engines in one backward are two mechanisms on the same examples.
_LAST_TASK: list = [None, []]


class _Decision:
    """What the engine does with a module: its rule (None: no rule), and the trainable
    parameters of this optimizer that the rule claims, as ``(name, parameter)``. Cached per
    module and valid while ``key`` (the ids of the module's own parameters) holds."""

    __slots__ = ("key", "rule", "claimed")

    def __init__(self, key, rule, claimed):
        self.key, self.rule, self.claimed = key, rule, claimed


class _Record:
    """One forward call of one module."""

    __slots__ = ("module", "rule", "params", "saved", "n_outputs", "group_id", "cache", "released", "root",
                 "__weakref__")

    def __init__(self, module, rule, params, saved, n_outputs, root=None):
        self.module = module
        self.root = root  # the outermost module call it ran inside (a paths.Root), if another
        self.rule = rule
        self.params = params  # list of (name, parameter)
        self.saved = saved
        self.n_outputs = n_outputs
        self.group_id = None
        self.cache = {}  # the rule's work from a stand-in backward, handed on to its Use
        self.released = False  # its saved inputs were let go after its clipped sums


def _twice(record) -> str:
    return (
        f"{type(record.module).__name__} was backpropagated twice from one forward pass "
        "(backward with retain_graph=True): its examples would be clipped twice. "
        "Run a fresh forward pass for each backward()."
    )


class _Group:
    """Everything one backward() call reached."""

    def __init__(self):
        self.id = next(_group_ids)
        self.task = _torch.graph_task_id()  # the backward() call it belongs to
        self.uses: dict[int, tuple[_Record, list]] = {}
        self.accumulated: dict[int, torch.Tensor] = {}
        self.autograd: dict[int, torch.Tensor] = {}
        self.mixing: dict[int, str] = {}  # id(module) -> why it mixes examples (Rule.mixes_examples)


# Hooks hold the engine weakly, so dropping the optimizer frees it and its hooks.
def _forward_pre_hook(engine_ref, module, args):
    engine = engine_ref()
    if engine is not None and torch.is_grad_enabled():
        engine._on_forward_pre(module, args)


def _forward_hook(engine_ref, module, args, kwargs, output):
    engine = engine_ref()
    if engine is not None:
        engine._restore(module)
        if torch.is_grad_enabled():
            return engine._on_forward(module, args, kwargs, output)
    return None


def _restore_hook(engine_ref, module, args, output):
    engine = engine_ref()  # runs once per call, even when forward raised
    if engine is not None:
        engine._restore(module)
        engine._leave_context(module)
        if engine._ddp_syncing is not None and isinstance(module, nn.parallel.DistributedDataParallel):
            engine._ddp_syncing = None


def _output_grad_hook(engine_ref, record, index, grad):
    engine = engine_ref()
    if engine is not None:
        engine._on_output_grad(record, index, grad)


def _mixing_hook(engine_ref, module, reason, grad):
    engine = engine_ref()
    if engine is not None:
        engine._group().mixing[id(module)] = reason


def _accumulated_hook(engine_ref, param, tensor=None):
    engine = engine_ref()  # param: the optimizer's; tensor: what autograd accumulated into
    if engine is not None:
        engine._group(arriving=id(param)).accumulated[id(param)] = param


def _param_grad_hook(engine_ref, param_id, grad):
    engine = engine_ref()
    if engine is not None:
        group = engine._group()
        previous = group.autograd.get(param_id)
        group.autograd[param_id] = grad.detach().clone() if previous is None else previous + grad


def _close_group(engine_ref):
    engine = engine_ref()
    if engine is not None:
        engine._close()


def _refuse_sharded_compute(module, rule) -> None:
    """A module that computed with a DTensor parameter itself (tensor parallelism) rather
    than with FSDP2's gathered copy: each rank would see only part of every example's
    gradient, and its norm would be a partial sum."""
    for name, p in rule.parameters(module).items():
        if fsdp.is_sharded(p):
            raise RuntimeError(
                f"{paths.describe(module)} computed with its parameter '{name}' as a DTensor "
                f"(placements {tuple(p.placements)}): tensor parallelism (parallelize_module, "
                "distribute_tensor) is not supported by dpoptim, only FSDP2's fully_shard, "
                "whose modules compute with gathered weights."
            )


def _autocast_enabled() -> bool:
    return torch.is_autocast_enabled("cpu") or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda"))


class CaptureMixin:
    """The engine's methods that its forward and backward hooks call (see the module
    docstring); :class:`dpoptim.engine.GradEngine` holds the state they share."""

    def _decide(self, module) -> _Decision:
        params = _torch.own_parameters(module)
        if self._slots:
            for name, p in params.items():
                self._alias(module, name, p)
        if self._aliases:  # FSDP2: an unsharded stand-in counts as the sharded parameter
            key = tuple(id(p if (owned := self._owned(p)) is None else owned) for p in params.values())
        else:
            key = tuple(map(id, params.values()))
        cached = self._decisions.get(module)
        if cached is not None and cached.key == key:
            return cached
        if cached is not None and cached.claimed:
            self._warn_replaced(module, cached.claimed)
        for name, p in params.items():
            if self._owned(p) is not None:
                self._owners.setdefault(id(self._owned(p)), (weakref.ref(module), name))
        rule = resolve_rule(module)
        claimed = []
        if rule is not None:
            claimed = [(n, self._owned_in(module, n, p)) for n, p in rule.parameters(module).items()]
            claimed = [(n, p) for n, p in claimed if p is not None]
        decision = self._decisions[module] = _Decision(key, rule, claimed)
        return decision

    def _on_forward_pre(self, module, args) -> None:
        if _torch.is_compiled_wrapper(module) and any(id(p) in self._params for p in module.parameters()):
            raise RuntimeError(
                f"torch.compile(model) returned a wrapper ({type(module).__name__}) whose compiled "
                "forward hides the layers from dpoptim's hooks. Compile the model in place instead: "
                "model.compile(), then call model as usual."
            )
        if fsdp.is_fsdp_module(module):
            self._remember_slots(module)
        elif isinstance(module, nn.parallel.DistributedDataParallel):
            self._ddp_syncing = bool(module.require_backward_grad_sync)  # False under no_sync()
        decision = self._decide(module)
        changing = None if decision.rule is None else decision.rule.changes_state(module)
        if changing is not None and (decision.claimed or self._in_a_trained_model(module)):
            raise ValueError(changing)
        if not decision.claimed:
            return
        begin_call(module)  # the rule's per-call state (Rule.call_state), until _leave_context
        self._calls[id(module)] = self._calls.get(id(module), 0) + 1
        decision.rule.check(module)
        context = decision.rule.enter(module, args)
        if context is not None:
            context.__enter__()
            self._contexts.setdefault(id(module), []).append(context)
        if not self._verify:  # accelerate.py: ghost differentiation, first uses of its routes
            self._before_forward(module, decision, args)

    def _in_a_trained_model(self, module) -> bool:
        """Whether the outermost module call now running (``module`` itself, outside any)
        holds parameters of this optimizer: while the hooks are process-wide, the state of
        another model's layers (a non-private baseline beside it) is none of its business."""
        root = paths.current_root()
        outermost = root.module() if root is not None else None
        return any(id(p) in self._params for p in (module if outermost is None else outermost).parameters())

    def _leave_context(self, module) -> None:
        contexts = self._contexts.get(id(module))
        if contexts:  # the innermost call's (a module may call itself)
            contexts.pop().__exit__(None, None, None)
        open_calls = self._calls.get(id(module))
        if open_calls:
            end_call(module)
            if open_calls == 1:
                del self._calls[id(module)]
            else:
                self._calls[id(module)] = open_calls - 1

    def _warn_replaced(self, module, claimed) -> None:
        for name, p in claimed:
            owner, _, leaf = name.rpartition(".")  # a rule may claim a child's parameter
            if self._owned(_torch.own_parameters(module.get_submodule(owner)).get(leaf)) is not p:
                warnings.warn(
                    f"parameter '{name}' of {type(module).__name__} was replaced after the optimizer was "
                    "built; the new one is not in the optimizer and will not be trained. Build the "
                    "optimizer after changing the model.",
                    PrivacyWarning,
                    stacklevel=4,
                )

    def _on_forward(self, module, args, kwargs, output):
        decision = self._decide(module)
        rule = decision.rule
        if rule is None:
            return
        mixing = rule.mixes_examples(module)
        if mixing is not None:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                # Refused at the end of the backward that reaches it, whatever it owns.
                output.register_hook(functools.partial(_mixing_hook, self._ref, module, mixing))
            else:
                # No gradient flows back into it (a frozen BatchNorm on the input, or a frozen
                # backbone's), yet the layers after it read mixed examples: the next backward is
                # refused, whatever it reaches. (While the hooks are process-wide, that includes
                # another model's such layer: which model it feeds, no hook can tell.)
                self._mixed_before[id(module)] = mixing
        params = [(n, p) for n, p in decision.claimed if p.requires_grad]
        if not params:
            return
        if self._sharded:
            _refuse_sharded_compute(module, rule)
        outputs = rule.outputs(module, output)
        if not any(t.requires_grad for t in outputs):
            return
        if not self._autocast_seen and _autocast_enabled():
            self._autocast_seen = True  # tolerances of the checks against autograd
        root = paths.current_root()
        outermost = root.module() if root is not None else None
        self._scope.note_root(module if outermost is None else outermost)
        root = root if outermost is not None and outermost is not module else None
        record = _Record(module, rule, params, rule.save(module, args, kwargs, output), len(outputs), root)
        replaced = None
        if not self._verify and not self._accelerate():
            self._keep(p for _, p in params)
        elif not self._verify:
            replaced = self._stand_in(record, args, kwargs, output, outputs)
            if replaced is not None:
                outputs = rule.outputs(module, replaced)
        if replaced is None:
            replaced = rule.replace_output(module, record.saved, output)
        for index, t in enumerate(outputs):
            if t.requires_grad:
                t.register_hook(functools.partial(_output_grad_hook, self._ref, record, index))
        if _torch.in_backward():
            # A forward run by a backward: reentrant checkpointing recomputes its segment
            # here and backpropagates it in a nested backward() of its own. Opening the
            # group now ties its end to the outer backward, so every segment's uses are
            # clipped together, once per example, instead of segment by segment.
            self._group()
        return replaced

    def _group(self, arriving: int | None = None) -> _Group:
        if self._open is None:
            self._follow_cleared_grads(arriving)
            self._open = _Group()
            self._open.mixing.update(self._mixed_before)
            self._mixed_before.clear()
            _torch.queue_end_of_backward(functools.partial(_close_group, self._ref))
        return self._open

    def _follow_cleared_grads(self, arriving: int | None) -> None:
        """Drop the logical batch so far if the user cleared the gradients since its last
        backward without ``optimizer.zero_grad()`` (``model.zero_grad()``, ``p.grad = None``).

        torch would forget those examples, so dpoptim does too: otherwise a loop that clears
        with the model and skips a ``step()`` gets two batches charged as one step. Checked
        when the next backward starts, on the gradients autograd left in ``.grad`` (all but
        ``arriving``, which that backward has just accumulated into).
        """
        if not self._marks:
            return
        cleared = []
        for pid, (ref, version) in self._marks.items():
            if pid == arriving:
                continue
            grad = self._params[pid].grad
            grad = None if grad is None else fsdp.local(grad)
            if grad is None or ((grad is not ref() or _torch.version_counter(grad) != version) and not bool(grad.any())):
                cleared.append(pid)
        if not cleared:
            return
        if len(cleared) < len(self._marks) - (arriving in self._marks):
            names = ", ".join(self._describe(self._params[pid]) for pid in cleared[:3])
            self._errors.append(
                f"the gradients of some parameters ({names}) were cleared between two backward() calls "
                "but not those of the others: dpoptim cannot tell which examples to forget. Clear "
                "with optimizer.zero_grad() (or model.zero_grad() for the whole model)."
            )
            return
        self.reset()

    def _on_output_grad(self, record, index, grad):
        group = self._group()
        entry = group.uses.get(id(record))
        if entry is None:
            if record.group_id is not None:
                self._errors.append(_twice(record))
                if record.released:  # nothing left to clip it with; step() raises the error
                    return
            record.group_id = group.id
            entry = group.uses[id(record)] = (record, [None] * record.n_outputs)
        grads = entry[1]
        grads[index] = grad if grads[index] is None else grads[index] + grad

    def _close(self):
        group, self._open = self._open, None
        if group is None or not group.accumulated:
            return  # torch.autograd.grad, or a backward that never reached our parameters
        self._refuse_second_engine(group.task)
        try:
            self._process(group)
        except Exception as exc:
            self._errors.append(f"clipping failed during backward(): {exc}")
            raise

    def _refuse_second_engine(self, task: int) -> None:
        """One backward() that reaches the parameters of two DP optimizers runs two Gaussian
        mechanisms on the same examples: each ledger would show only its own share of the
        cost. Refused in both optimizers' next step."""
        if _LAST_TASK[0] != task:
            _LAST_TASK[:] = [task, []]
        others = [engine for engine in (ref() for ref in _LAST_TASK[1]) if engine is not None and engine is not self]
        _LAST_TASK[1].append(self._ref)
        for engine in [self, *others] if others else []:
            engine._errors.append(
                "one backward() reached the parameters of two DP optimizers: each clips and noises "
                "the same examples on its own and each reports only its own epsilon, while the run "
                "costs both together. Give all parameters to one DP optimizer (use parameter groups "
                "for different learning rates)."
            )
