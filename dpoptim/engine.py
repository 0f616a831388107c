"""The clipping engine: hooks that watch one optimizer's parameters and turn each backward
pass into per-example clipped sums.

How a logical batch flows through it:

1. **Forward.** One process-wide forward hook per engine sees every module call. A module
   whose rule (see :mod:`dpoptim.registry`) claims trainable parameters of this optimizer
   gets a *record*: what its rule saves from the inputs, plus a gradient hook on each
   output. The record lives only in that hook, so a forward that is never backpropagated
   leaves nothing behind once its graph is freed, and under ``torch.no_grad()`` nothing
   is recorded at all.
2. **Backward.** Output hooks collect the gradients of the outputs; parameter hooks note
   which parameters autograd accumulated into. Everything one ``backward()`` call reaches
   is one *group*: its uses share one example axis. At the end of the backward the group
   is processed at once (book-keeping, Bu et al. 2023): per-example squared norms from
   every use, clip factors ``c_i = min(1, C / ||g_i||)``, and each parameter's clipped sum
   ``sum_i c_i g_i``, added to the running sums. The saved activations are then released,
   so memory is bounded by one micro-batch however many ``backward()`` calls a logical
   batch has.
3. **Step.** The optimizer takes the sums, adds noise and divides by the expected batch
   size (see :mod:`dpoptim.privatize`).

Examples in different ``backward()`` calls are different examples; uses inside one
backward that share a parameter (tied weights, a module called twice) are summed per
example before the norm, so their cross terms count.
"""

from __future__ import annotations

import functools
import itertools
import warnings
import weakref

import torch
from torch import nn

from .errors import PrivacyWarning, UnsupportedLayerError
from .privatize import clip_factors
from . import fsdp, paths
from .registry import Use, resolve_rule

__all__ = ["GradEngine"]

# Modules that mix examples through batch statistics: per-example gradients do not exist.
_BATCH_MIXING = (nn.modules.batchnorm._BatchNorm,)

_group_ids = itertools.count()

# id(parameter) -> (weakref to the parameter, weakref to the engine that clips it)
_CLAIMED: dict[int, tuple] = {}

# The last backward() call that reached a DP optimizer's parameters: [graph task id, the
# engines it reached]. Two engines in one backward are two mechanisms on the same examples.
_LAST_TASK: list = [None, []]


def _uses_batch_statistics(module: nn.Module) -> bool:
    return module.training or getattr(module, "running_mean", None) is None


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
        anchor = None if ctx.anchor is None else torch.zeros(ctx.anchor[0], dtype=ctx.anchor[1], device=ctx.anchor[2])
        return (None, None, *inputs, anchor) + (None,) * len(grads)


class _Group:
    """Everything one backward() call reached."""

    def __init__(self):
        self.id = next(_group_ids)
        self.task = torch._C._current_graph_task_id()  # the backward() call it belongs to
        self.uses: dict[int, tuple[_Record, list]] = {}
        self.accumulated: dict[int, torch.Tensor] = {}
        self.autograd: dict[int, torch.Tensor] = {}
        self.mixing: dict[int, nn.Module] = {}


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


def _mixing_hook(engine_ref, module, grad):
    engine = engine_ref()
    if engine is not None:
        engine._group().mixing[id(module)] = module


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


def _remove_all(handles):
    for handle in handles:
        handle.remove()
    handles.clear()


def _map_tensors(obj, fn):
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map_tensors(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map_tensors(v, fn) for v in obj)
    if isinstance(obj, dict):
        return {k: _map_tensors(v, fn) for k, v in obj.items()}
    return obj


def _finite_or_zero(t: torch.Tensor) -> torch.Tensor:
    return torch.nan_to_num(t, nan=0.0, posinf=0.0, neginf=0.0) if t.is_floating_point() else t


class GradEngine:
    """Per-example clipping for one set of parameters. Owned by a DP optimizer.

    ``max_grad_norm`` is a callable returning the clipping bound C in force; it is read at
    the end of each backward pass.
    """

    def __init__(self, max_grad_norm, loss_reduction: str = "mean"):
        self._max_grad_norm = max_grad_norm
        self.loss_reduction = loss_reduction
        self._params: dict[int, torch.Tensor] = {}
        self._names: dict[int, str] = {}
        self._owners: dict[int, tuple] = {}  # id(param) -> (weakref to its module, its name there)
        self._decisions = weakref.WeakKeyDictionary()
        self._open: _Group | None = None
        self._handles: list = []
        self._verify_handles: list = []
        self._ref = weakref.ref(self)
        self._verify = True
        self._autocast_seen = False
        self._hooked: set[int] = set()
        self._warned_eval = False
        self.reset()
        self.detach_parameters = True
        self._detached: dict[int, list] = {}
        self._contexts: dict[int, list] = {}  # module -> the rule's forward contexts now entered
        self._ghosts: set[int] = set()  # parameters autograd no longer reaches through their module
        self._kept: set[int] = set()  # parameters some call left attached: autograd reaches them
        # FSDP2: (id(module), name) -> the sharded parameter that slot holds between forwards,
        # and id(unsharded parameter) -> (weakref to it, the sharded one it stands in for).
        self._slots: dict[tuple[int, str], torch.Tensor] = {}
        self._sharded = False  # whether some parameter is a DTensor
        self._ddp_syncing = None  # in a DistributedDataParallel forward: whether it all-reduces
        self._fsdp_owner: dict[int, tuple] = {}  # id(sharded) -> (weakref to its FSDP module, its slot)
        self._aliases: dict[int, tuple] = {}
        self._handles += paths.track()  # module paths for error messages; first, so they know the root
        self._handles += [
            nn.modules.module.register_module_forward_pre_hook(functools.partial(_forward_pre_hook, self._ref)),
            nn.modules.module.register_module_forward_hook(
                functools.partial(_forward_hook, self._ref), with_kwargs=True
            ),
            nn.modules.module.register_module_forward_hook(
                functools.partial(_restore_hook, self._ref), always_call=True
            ),
        ]
        weakref.finalize(self, _remove_all, self._handles)
        weakref.finalize(self, _remove_all, self._verify_handles)

    # ----------------------------------------------------------------- parameters
    def add_params(self, params, names=None) -> None:
        for i, p in enumerate(params):
            if id(p) in self._params:
                continue
            self._params[id(p)] = p
            if names is not None:
                self._names[id(p)] = names[i]
            self._claim(p)
            self._sharded = self._sharded or fsdp.is_sharded(p)
        self._decisions = weakref.WeakKeyDictionary()
        self._hook_params()

    def _claim(self, p) -> None:
        claimed = _CLAIMED.get(id(p))
        if claimed is not None and claimed[0]() is p and claimed[1]() not in (None, self):
            warnings.warn(
                f"{self._describe(p)} is already in another DP optimizer: each would clip and noise it "
                "on its own and each ledger would show only part of the privacy cost. Give every "
                "parameter to exactly one DP optimizer (use parameter groups for different settings).",
                PrivacyWarning,
                stacklevel=5,
            )
        _CLAIMED[id(p)] = (weakref.ref(p), self._ref)

    def _hook_params(self) -> None:
        """Hook every trainable parameter (a frozen one is hooked once it is unfrozen)."""
        for pid, p in self._params.items():
            # An FSDP2-sharded parameter is hooked through its unsharded stand-in (_alias):
            # FSDP writes the sharded .grad itself, after the backward.
            if p.requires_grad and pid not in self._hooked and not fsdp.is_sharded(p):
                self._hooked.add(pid)
                self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(_accumulated_hook, self._ref)))
                if self._verify:
                    self._verify_handles.append(p.register_hook(functools.partial(_param_grad_hook, self._ref, pid)))

    def close(self) -> None:
        """Remove every hook this engine installed."""
        _remove_all(self._handles)
        _remove_all(self._verify_handles)

    # ----------------------------------------------------------------- state per logical batch
    def reset(self) -> None:
        """Start a new logical batch."""
        self._sums: dict[int, torch.Tensor] = {}
        self._shards: dict[int, torch.Tensor] = {}  # FSDP2: this rank's shard of the sums over all ranks
        self._raw_sums: dict[int, torch.Tensor] = {}
        self._autograd_sums: dict[int, torch.Tensor] = {}
        self._errors: list[str] = []
        self._clip_norms: set[float] = set()
        self.examples = 0
        self.backward_calls = 0
        self.seen: set[int] = set()  # parameters backward accumulated into in this logical batch
        self._marks: dict[int, tuple] = {}  # id(param) -> (its .grad, that tensor's version)

    def clipped_sums(self) -> dict[int, torch.Tensor]:
        """The clipped sums of the logical batch, by ``id(param)``; raises what went wrong."""
        self._hook_params()
        if self._errors:
            errors = list(dict.fromkeys(self._errors))
            self.reset()
            raise UnsupportedLayerError("\n".join(errors))
        current = float(self._max_grad_norm())
        if any(c != current for c in self._clip_norms):
            used = sorted(self._clip_norms)
            self.reset()
            raise ValueError(
                f"max_grad_norm changed from {used} to {current} between backward() and step(): "
                "the noise must match the bound the gradients were clipped to. Change it "
                "after step() (or before the first backward() of a batch)."
            )
        if self._verify and self._raw_sums:
            self._check_against_autograd()
        return {**self._sums, **self._shards}

    # ----------------------------------------------------------------- hooks
    def _owned(self, p):
        """The optimizer's parameter ``p`` is or stands in for (FSDP2's unsharded copy of a
        sharded one), or None."""
        if p is None:
            return None
        if id(p) in self._params:
            return p
        alias = self._aliases.get(id(p))
        return alias[1] if alias is not None and alias[0]() is p else None

    def _remember_slots(self, module) -> None:
        """Before an FSDP module's forward its slots hold the sharded parameters: note which
        slot holds which, so the unsharded ones FSDP puts there are recognised."""
        for sub, name, p in fsdp.sharded_slots(module, self._params):
            self._slots[(id(sub), name)] = p
            # the innermost FSDP module around a parameter manages it: it is seen last
            self._fsdp_owner[id(p)] = (weakref.ref(module), sub, name)

    def _gather_released(self, records) -> list:
        """Under FSDP2: gather again the weights of the FSDP modules that FSDP has already
        released (resharded) and whose records' rules read weight values in the clipping
        (``Rule.reads_weights``). Returns the modules to release again afterwards. A
        collective: every rank processes the same records in the same order."""
        gathered = []
        for record in records:
            if not record.rule.reads_weights:
                continue
            for _, p in record.params:
                owner = self._fsdp_owner.get(id(p))
                module = None if owner is None else owner[0]()
                if module is None or module in gathered or owner[1]._parameters.get(owner[2]) is not p:
                    continue  # not sharded, already gathered, or its slot holds the gathered one
                module.unshard()
                gathered.append(module)
        return gathered

    def _alias(self, module, name, p):
        """Recognise ``p`` in ``module``'s slot ``name`` as FSDP2's unsharded stand-in for
        a sharded parameter of this optimizer; hook it as the sharded one is hooked."""
        sharded = self._slots.get((id(module), name))
        if sharded is None or p is None or id(p) in self._params or self._owned(p) is sharded:
            return
        fsdp.check_unsharded(p, sharded, f"parameter '{name}' of {paths.describe(module)}")
        self._aliases[id(p)] = (weakref.ref(p), sharded)
        if p.requires_grad:
            self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(_accumulated_hook, self._ref, sharded)))
            if self._verify:
                self._verify_handles.append(p.register_hook(functools.partial(_param_grad_hook, self._ref, id(sharded))))

    def _owned_in(self, module, name, p):
        """:meth:`_owned` for ``p`` found at ``name`` (maybe a child's) of ``module``."""
        if self._slots and id(p) not in self._params:
            owner, _, leaf = name.rpartition(".")
            self._alias(module.get_submodule(owner) if owner else module, leaf, p)
        return self._owned(p)

    def _decide(self, module):
        if self._slots:
            for name, p in module._parameters.items():
                self._alias(module, name, p)
        key = tuple(id(p if self._owned(p) is None else self._owned(p)) for p in module._parameters.values())
        cached = self._decisions.get(module)
        if cached is not None and cached[0] == key:
            return cached[1]
        if cached is not None and cached[1] is not None:
            self._warn_replaced(module, cached[1][1])
        for name, p in module._parameters.items():
            if self._owned(p) is not None:
                self._owners.setdefault(id(self._owned(p)), (weakref.ref(module), name))
        decision = None
        rule = resolve_rule(module)
        if rule is not None:
            claimed = [(n, self._owned_in(module, n, p)) for n, p in rule.parameters(module).items()]
            claimed = [(n, p) for n, p in claimed if p is not None]
            if claimed:
                decision = (rule, claimed)
        self._decisions[module] = (key, decision)
        return decision

    def _on_forward_pre(self, module, args) -> None:
        if _is_compiled_wrapper(module) and any(id(p) in self._params for p in module.parameters()):
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
        if decision is None:
            return
        decision[0].check(module)
        context = decision[0].enter(module, args)
        if context is not None:
            context.__enter__()
            self._contexts.setdefault(id(module), []).append(context)
        if self.detach_parameters and not self._verify and decision[0].detach_parameters:
            self._detach(module, decision, args)

    def _detach(self, module, decision, args) -> None:
        """Ghost differentiation: for the duration of the forward, replace the module's
        parameters with detached aliases, so autograd skips weight gradients that the rule
        computes anyway. One parameter (the smallest) stays attached, so the output has a
        graph and every backward through the module accumulates into some ``.grad``
        (which is how a ``backward()`` is told from ``torch.autograd.grad``). A rule with
        ``detach_all`` gives up that one too when the module's input already leads back to
        an attached parameter of this optimizer: both needs are then met upstream. Off
        until the first step has been checked against autograd, and off where
        :meth:`_accelerate` says."""
        live = [(n, p) for n, p in decision[1] if p.requires_grad]
        if not live:
            return
        if not self._accelerate():  # this call leaves them all attached: autograd reaches them
            self._keep(p for _, p in live)
            return
        if decision[0].detach_all and self._reaches_attached(args):
            keep = None
        else:
            chosen = dict(live).get(decision[0].attached(module, [n for n, _ in live]))
            keep = chosen if chosen is not None else min(live, key=lambda item: item[1].numel())[1]
            # One call may keep a parameter that another call (of a shared module, or of a
            # later forward whose input has no graph) detached: autograd reaches it then.
            self._kept.add(id(keep))
            self._ghosts.discard(id(keep))
            if len(live) < 2:
                return
        swapped = []
        for name, p in live:
            if p is not keep:
                owner, _, leaf = name.rpartition(".")
                owner = module.get_submodule(owner) if owner else module
                owner._parameters[leaf] = p.detach()
                swapped.append((owner, leaf, p))
                if id(p) not in self._kept:
                    self._ghosts.add(id(p))
        self._detached[id(module)] = swapped

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
                owner._parameters[leaf] = p

    def _leave_context(self, module) -> None:
        contexts = self._contexts.get(id(module))
        if contexts:  # the innermost call's (a module may call itself)
            contexts.pop().__exit__(None, None, None)

    def _warn_replaced(self, module, claimed) -> None:
        for name, p in claimed:
            owner, _, leaf = name.rpartition(".")  # a rule may claim a child's parameter
            if self._owned(module.get_submodule(owner)._parameters.get(leaf)) is not p:
                warnings.warn(
                    f"parameter '{name}' of {type(module).__name__} was replaced after the optimizer was "
                    "built; the new one is not in the optimizer and will not be trained. Build the "
                    "optimizer after changing the model.",
                    PrivacyWarning,
                    stacklevel=4,
                )

    def _on_forward(self, module, args, kwargs, output):
        if isinstance(module, _BATCH_MIXING) and _uses_batch_statistics(module):
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(functools.partial(_mixing_hook, self._ref, module))
        decision = self._decide(module)
        if decision is None:
            return
        rule, claimed = decision
        params = [(n, p) for n, p in claimed if p.requires_grad]
        if not params:
            return
        if self._sharded:
            _refuse_sharded_compute(module, rule)
        outputs = rule.outputs(module, output)
        if not any(t.requires_grad for t in outputs):
            return
        if self._verify and _autocast_enabled():
            self._autocast_seen = True
        root = paths.current_root()
        root = root if root is not None and root.module() is not module else None
        record = _Record(module, rule, params, rule.save(module, args, kwargs, output), len(outputs), root)
        replaced = None
        if self.detach_parameters and not self._verify and not self._accelerate():
            self._keep(p for _, p in params)
        elif self.detach_parameters and not self._verify:
            replaced = self._stand_in(record, args, kwargs, output, outputs)
            if replaced is not None:
                outputs = rule.outputs(module, replaced)
        if replaced is None:
            replaced = rule.replace_output(module, record.saved, output)
        for index, t in enumerate(outputs):
            if t.requires_grad:
                t.register_hook(functools.partial(_output_grad_hook, self._ref, record, index))
        if _in_backward():
            # A forward run by a backward: reentrant checkpointing recomputes its segment
            # here and backpropagates it in a nested backward() of its own. Opening the
            # group now ties its end to the outer backward, so every segment's uses are
            # clipped together, once per example, instead of segment by segment.
            self._group()
        return replaced

    def _stand_in(self, record, args, kwargs, output, outputs):
        """Rewire the call's outputs through :class:`_StandIn` when its rule computes the
        gradients of the inputs itself: autograd then skips the layer's own backward (for a
        fused recurrent kernel, most of its cost), while the rule, which replays that
        backward anyway, returns the input gradients. Returns the new output, or None.
        Like ghost differentiation, off until the first step has been checked against
        autograd, and off where :meth:`_accelerate` says."""
        rule, module = record.rule, record.module
        inputs = rule.inputs(module, args, kwargs)
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

    def _group(self, arriving: int | None = None) -> _Group:
        if self._open is None:
            self._follow_cleared_grads(arriving)
            self._open = _Group()
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(_close_group, self._ref))
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
            if grad is None or ((grad is not ref() or grad._version != version) and not bool(grad.any())):
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

    def _blocks(self) -> list[list]:
        """FSDP2: the trainable sharded parameters of each FSDP module, modules and
        parameters in the optimizer's order (the same on every rank); parameters whose
        module is not known come last, as a block of their own."""
        blocks: dict = {}
        for pid, p in self._params.items():
            if p.requires_grad and fsdp.is_sharded(p):
                owner = self._fsdp_owner.get(pid)
                blocks.setdefault(None if owner is None else id(owner[0]()), []).append(p)
        unowned = blocks.pop(None, None)
        return list(blocks.values()) + ([unowned] if unowned else [])

    def _blocks_of(self, record) -> set:
        return {self._block_index[id(p)] for _, p in record.params if id(p) in self._block_index}

    def _shard_stream(self, uses, counts):
        """The uses in the order that lets FSDP blocks be reduced early, and the
        :class:`~dpoptim.fsdp.ShardStream` that reduces them."""
        blocks = self._blocks()
        self._block_index = {id(p): j for j, block in enumerate(blocks) for p in block}
        touched = [self._blocks_of(record) for record, _ in uses]
        uses = [uses[i] for i in fsdp.ShardStream.order(touched)]
        late = {self._block_index[pid] for pid, n in counts.items() if n > 1 and pid in self._block_index}
        return uses, fsdp.ShardStream(blocks, [self._blocks_of(r) for r, _ in uses], late, self._reduce_sharded)

    def _reduce_sharded(self, params) -> None:
        """FSDP2: reduce-scatter this backward's full-shape clipped sums of ``params``
        (sharded), so that only shards are kept until ``step()``. A collective per
        parameter, in the same order on every rank (a rank none of whose examples reached
        a parameter sends zeros)."""
        for p in params:
            pid = id(p)
            full = self._sums.pop(pid, None)
            if full is None:
                full = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
            shard = fsdp.reduce_to_shard(full, p)
            del full
            current = self._shards.get(pid)
            self._shards[pid] = shard if current is None else current.add_(shard)

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

    # ----------------------------------------------------------------- the math of one group
    def _process(self, group: _Group) -> None:
        self.backward_calls += 1
        self.seen.update(group.accumulated)
        for module in group.mixing.values():
            self._errors.append(
                f"{type(module).__name__} uses batch statistics, which mix examples: per-example "
                "gradients do not exist and DP-SGD's guarantee would not hold. Replace it with "
                "GroupNorm (dpoptim.replace_batchnorm(model)) or put it in eval mode."
            )
        counts: dict[int, int] = {}
        for record, _ in group.uses.values():
            for _, p in record.params:
                counts[id(p)] = counts.get(id(p), 0) + 1
        for pid, p in group.accumulated.items():
            if pid not in counts:
                self._errors.append(self._uncovered_message(p))
            elif pid in self._ghosts:
                self._errors.append(f"{self._describe(p)}: {_USED_ELSEWHERE}")
        if not group.uses:
            return

        if not self._warned_eval:
            idle = sorted({type(r.module).__name__ for r, _ in group.uses.values() if not r.module.training})
            if idle:
                self._warned_eval = True
                warnings.warn(
                    f"backward() ran through modules in eval mode ({', '.join(idle)}) while training: "
                    "did you forget model.train()? Dropout and similar layers behave differently.",
                    PrivacyWarning,
                    stacklevel=2,
                )
        uses = [(record, Use(record.module, record.saved, grads, record.cache)) for record, grads in group.uses.values()]
        gathered = self._gather_released([record for record, _ in uses]) if self._fsdp_owner else []
        stream = None
        if self._fsdp_owner:
            uses, stream = self._shard_stream(uses, counts)
        try:
            with _no_autocast():
                self._process_uses(group, uses, counts, stream)
        finally:
            for module in gathered:
                module.reshard()

    def _process_uses(self, group, uses, counts, stream=None):
        # A parameter of several uses (tied weights, a module called twice) needs the cross
        # terms between its uses: from the rules' factored terms when all offer them and
        # that is cheaper, else from materialised per-example gradients.
        factored = self._shared_terms(uses, counts)
        by_terms = set(factored)

        def own(record):  # the rule computes these norms itself
            return [n for n, p in record.params if counts[id(p)] == 1]

        def summed(record):  # the rule computes these clipped sums itself
            return [n for n, p in record.params if counts[id(p)] == 1 or id(p) in by_terms]

        squared = []
        sizes = set()
        for record, use in uses:
            names = own(record)
            if names:
                norms = self._checked_norms(record, use, names)
                sizes.add((record.module, norms[0].shape[0]))  # described only if the sizes disagree
                squared.extend(norms)
        squared.extend(_norms_of_terms(terms) for terms in factored.values())
        shared = self._shared_per_example(uses, counts, skip=by_terms)
        squared.extend(g.flatten(1).square().sum(1) for g in shared.values())
        if len({s.shape[0] for s in squared}) > 1:
            found = ", ".join(sorted(f"{paths.describe(module)}: {n}" for module, n in sizes))
            raise RuntimeError(
                f"the layers of one backward() disagree on the number of examples ({found}): a "
                "layer received a tensor whose first dimension is not the batch, such as a sequence-first "
                "[T, n, d] output, or indices without the batch dimension (a lookup shared by all examples "
                "needs a first dimension of 1, as position ids [1, T] have). Per-example rules read "
                "examples from dimension 0: use batch_first=True, transpose, or give shared indices a "
                "leading dimension of 1."
            )
        total = functools.reduce(torch.add, (_wide(s) for s in squared))

        n = total.shape[0]
        _check_examples_against_model(uses, n)
        scale = float(n) if self.loss_reduction == "mean" else 1.0
        total = total * (scale * scale)
        bound = float(self._max_grad_norm())
        factors = clip_factors(total, bound)
        if n and not bool(torch.isfinite(total).all()):
            warnings.warn(
                f"{int((~torch.isfinite(total)).sum())} example(s) had a non-finite gradient; their "
                "contribution was dropped (clip factor 0). The step still adds noise and is charged.",
                PrivacyWarning,
                stacklevel=2,
            )
            uses = [(r, Use(u.module, _map_tensors(u.saved, _finite_or_zero), _map_tensors(u.grad_outputs, _finite_or_zero))) for r, u in uses]
            shared = {pid: _finite_or_zero(g) for pid, g in shared.items()}
        weights = factors * scale

        # Off the checked first step nothing needs a use after its clipped sum: let its saved
        # inputs, output gradients and rule cache go at once, so that the last clipped sums
        # run with the earlier layers' activations already freed.
        del factored  # their tensors belong to the uses, released below
        release = not self._verify
        for i, (record, use) in enumerate(uses):
            names = summed(record)
            if names:
                self._accumulate(self._sums, record, record.rule.clipped_sum(use, names, weights.to(total.dtype)))
            if stream is not None:
                stream.done(self._blocks_of(record))
            if release:
                uses[i] = None
                group.uses.pop(id(record), None)
                record.saved, record.cache, record.released = None, {}, True
                del record, use
        for pid, g in shared.items():
            _add_into(self._sums, self._params[pid], torch.tensordot(weights.to(g.dtype), g, dims=1))
        if stream is not None:
            stream.finish()

        if self._verify:
            ones = torch.ones_like(total)
            for record, use in uses:
                names = summed(record)
                if names:
                    self._accumulate(self._raw_sums, record, record.rule.clipped_sum(use, names, ones))
            for pid, g in shared.items():
                _add_into(self._raw_sums, self._params[pid], g.sum(0))
            for pid, g in group.autograd.items():
                _add_into(self._autograd_sums, self._params[pid], g)
            for record, _ in uses:  # the record outlives this backward: its cache need not
                record.cache = {}

        self.examples += n
        self._clip_norms.add(bound)
        self._mark_grads(group.accumulated)

    def _mark_grads(self, accumulated: dict) -> None:
        """Remember what backward left in ``.grad`` (see :meth:`_follow_cleared_grads`). An
        all-zero gradient is no evidence either way (zeroing it changes nothing), so only
        non-zero ones are marked: one device sync for all of them."""
        grads = [(pid, p.grad) for pid, p in accumulated.items() if p.grad is not None and not p.grad.is_sparse]
        grads = [(pid, fsdp.local(g)) for pid, g in grads]  # an FSDP2 gradient: this rank's shard
        if not grads:
            return
        nonzero = torch.stack([g.ne(0).any().to(grads[0][1].device) for _, g in grads]).tolist()
        for (pid, g), keep in zip(grads, nonzero):
            if keep:
                self._marks[pid] = (weakref.ref(g), g._version)

    def _checked_norms(self, record, use, names):
        norms = record.rule.norms(use, names)
        for name in names:
            if name not in norms or norms[name].dim() != 1:
                raise RuntimeError(
                    f"{type(record.rule).__name__}.norms must return a 1-D tensor for '{name}' "
                    f"of {type(record.module).__name__}"
                )
        return [norms[name] for name in names]

    def _shared_terms(self, uses, counts) -> dict[int, list]:
        """Factored terms of every shared parameter whose uses all offer them and whose
        ghost norm (a Gram matrix over all its rows) costs less than materialising."""
        terms: dict[int, list] = {}
        refused: set[int] = set()
        for record, use in uses:
            for name, p in record.params:
                if counts[id(p)] > 1 and id(p) not in refused:
                    found = record.rule.terms(use, name)
                    if found is None:
                        refused.add(id(p))
                    else:
                        terms.setdefault(id(p), []).extend(found)
        out = {}
        for pid, found in terms.items():
            if pid in refused:
                continue
            p = self._params[pid]
            n = found[0][0].shape[0]
            rows = sum(out_side.shape[1] for out_side, _ in found)
            width = p.shape[0] + (p[0].numel() if p.dim() > 1 else 1)
            # Ghost ~ rows^2 (p + d) per example; materialising ~ rows p d, and n p d memory.
            if rows * width <= p.numel() or n * p.numel() > _MATERIALIZE_LIMIT:
                out[pid] = found
        return out

    def _shared_per_example(self, uses, counts, skip=()):
        shared: dict[int, torch.Tensor] = {}
        for record, use in uses:
            for name, p in record.params:
                if counts[id(p)] > 1 and id(p) not in skip:
                    g = record.rule.per_example(use, [name])[name]
                    shared[id(p)] = g if id(p) not in shared else shared[id(p)] + g
        return shared

    def _accumulate(self, sums, record, values):
        for name, p in record.params:
            if name not in values:
                continue
            value = values[name]
            if value.shape != p.shape:
                raise RuntimeError(
                    f"{type(record.rule).__name__}.clipped_sum returned shape {tuple(value.shape)} for "
                    f"'{name}' of {type(record.module).__name__}, expected {tuple(p.shape)}"
                )
            _add_into(sums, p, value)

    # ----------------------------------------------------------------- checks
    def _describe(self, p) -> str:
        if id(p) in self._names:
            return f"parameter '{self._names[id(p)]}' (shape {tuple(p.shape)})"
        if id(p) in self._owners:
            return f"parameter '{self._owners[id(p)][1]}' of {self._owner_name(p)} (shape {tuple(p.shape)})"
        return f"a parameter of shape {tuple(p.shape)}"

    def _owner_name(self, p) -> str:
        module = self._owners[id(p)][0]()
        return "a deleted module" if module is None else paths.describe(module)

    def _uncovered_message(self, p) -> str:
        what = self._describe(p)
        if id(p) in self._owners:
            how = (
                f"no rule saw the call that used it: it is read outside {self._owner_name(p)}'s own "
                "forward (a parent module or a function using it directly), where its examples cannot "
                "be told apart. Use it inside its own module's forward, or register a rule for the "
                "module whose forward uses it (@dpoptim.register_rule, see docs/rules.md)"
            )
        else:
            how = "it was used outside any module call dpoptim can see (a raw tensor in a functional call?)"
        return (
            f"{what} received a gradient that dpoptim cannot clip per example: {how}, "
            "or freeze it with requires_grad_(False)."
        )

    def _check_against_autograd(self):
        """Once, on the first step: the rules' unclipped sum must equal autograd's gradient.

        This catches a parameter that is also used where no rule sees it (a module's weight
        reused in a functional call, a loss term on the weights) and a rule that is wrong.
        """
        problems = []
        # A parameter whose true gradient is exactly zero (a bias right before InstanceNorm,
        # which removes it again) holds only roundoff on both sides: judge errors against
        # the largest gradient of the model too.
        largest = max((float(r.norm()) for r in self._autograd_sums.values()), default=0.0)
        for pid, raw in self._raw_sums.items():
            reference = self._autograd_sums.get(pid)
            p = self._params[pid]
            if reference is None:
                continue
            if self._autocast_seen:
                tol = 3e-2  # autograd itself computed in half precision
            else:
                tol = {torch.float64: 1e-6, torch.float32: 1e-3}.get(p.dtype, 3e-2)
            error = (raw - reference).norm()
            if error > tol * (reference.norm() + raw.norm() + 1e-2 * largest) + 1e-30:
                problems.append(
                    f"{self._describe(p)}: the gradient its rule sees differs from autograd's "
                    f"(relative error {float(error / (reference.norm() + 1e-30)):.2e}). {_USED_ELSEWHERE}"
                )
        if problems:
            self.reset()
            raise UnsupportedLayerError("\n".join(problems))
        self._verify = False
        _remove_all(self._verify_handles)


_USED_ELSEWHERE = (
    "It is used somewhere dpoptim cannot see (a functional call on the weight, a loss term on "
    "the parameters), or its module's rule is wrong. Route every use through a module with a "
    "rule; put weight penalties in the optimizer's weight_decay."
)


# Above this many numbers, a shared parameter's per-example gradients are not materialised
# when its rules offer factored terms, even where that would be the cheaper route.
_MATERIALIZE_LIMIT = 1 << 24


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


def _check_examples_against_model(uses, n: int) -> None:
    """Refuse a backward whose layers saw ``n`` examples while the model they ran in was
    called with another number: the examples were reshaped on the way (tokens flattened
    into the batch dimension, a sequence-first tensor through Linear layers, the batch cut
    into chunks), and each row a layer sees would be clipped as an example of its own."""
    seq_first = any(getattr(record.module, "batch_first", True) is False for record, _ in uses)
    for record, _ in uses:
        root = record.root
        if root is None or root.sizes is None:
            continue
        first, second = root.sizes
        model = root.module()
        if n == first or (seq_first and n == second):
            continue
        raise RuntimeError(
            f"{type(record.module).__name__} saw {n} examples, but the model around it "
            f"({type(model).__name__}) was called with a batch of {first} (the first dimension of "
            "its first argument): the examples were reshaped on the way, so each row a layer sees "
            "would be clipped as an example of its own. Keep dimension 0 the example in every layer "
            "(reshape [n, T, d] -> [n * T, d] and back is not allowed; Linear and Embedding take "
            "[n, T, d] as they are; pass batch_first=True to recurrent and attention layers), and "
            "pass the batch as the model's first argument."
        )


def _norms_of_terms(terms) -> torch.Tensor:
    """``||sum_u g_i^u||^2`` per example from factored terms (see ``Rule.terms``): with all
    rows of all uses stacked, ``sum_{t,s} (out_t . out_s)(inp_t . inp_s)``, cross terms
    between uses included. Index rows (one-hot) and dense rows are stacked separately."""
    dtype = functools.reduce(torch.promote_types, (t.dtype for pair in terms for t in pair
                                                   if t is not None and t.is_floating_point()), torch.float32)

    def stack(group):
        out = torch.cat([o if not o.is_floating_point() else o.to(dtype) for o, _ in group], dim=1)
        inp = None if group[0][1] is None else torch.cat([i.to(dtype) for _, i in group], dim=1)
        return out, inp

    dense = [pair for pair in terms if pair[0].is_floating_point()]
    index = [pair for pair in terms if not pair[0].is_floating_point()]
    groups = [stack(g) for g in (dense, index) if g]
    total = None
    for a in range(len(groups)):
        for b in range(a, len(groups)):
            value = _term_inner(groups[a], groups[b], dtype)
            value = value if a == b else 2 * value
            total = value if total is None else total + value
    return total


def _term_inner(x, y, dtype) -> torch.Tensor:
    """``sum_{t,s} (out^x_t . out^y_s)(inp^x_t . inp^y_s)`` per example."""
    (ox, ix), (oy, iy) = x, y
    if ox.is_floating_point() and oy.is_floating_point():
        outer = torch.bmm(ox, oy.transpose(1, 2))
    elif ox.is_floating_point():  # rows of ox read at y's indices
        outer = ox.gather(2, oy.long().unsqueeze(1).expand(-1, ox.shape[1], -1))
    elif oy.is_floating_point():
        outer = oy.gather(2, ox.long().unsqueeze(1).expand(-1, oy.shape[1], -1)).transpose(1, 2)
    else:
        outer = (ox.unsqueeze(2) == oy.unsqueeze(1)).to(dtype)
    if ix is None:
        return outer.sum((1, 2))
    return (outer * torch.bmm(ix, iy.transpose(1, 2))).sum((1, 2))


def _autocast_enabled() -> bool:
    return torch.is_autocast_enabled("cpu") or (torch.cuda.is_available() and torch.is_autocast_enabled("cuda"))


def _is_compiled_wrapper(module) -> bool:
    """Whether ``module`` is what ``torch.compile(model)`` returns (a wrapper, not the model)."""
    cls = type(module)
    return cls.__name__ == "OptimizedModule" and cls.__module__.startswith("torch._dynamo")


def _in_backward() -> bool:
    """Whether this thread is running a backward pass (the autograd engine's graph task)."""
    return torch._C._current_graph_task_id() != -1


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype in (torch.float32, torch.float64) else t.float()


def _add_into(sums, p, value):
    value = value.to(p.dtype)
    current = sums.get(id(p))
    sums[id(p)] = value if current is None else current.add_(value)


class _no_autocast:
    """Rules run with autocast off: norms and factors in float32 or wider."""

    def __enter__(self):
        self._contexts = [torch.autocast("cpu", enabled=False)]
        if torch.cuda.is_available():
            self._contexts.append(torch.autocast("cuda", enabled=False))
        for c in self._contexts:
            c.__enter__()

    def __exit__(self, *exc):
        for c in reversed(self._contexts):
            c.__exit__(*exc)
