"""The clipping engine: per-example clipping for the parameters of one DP optimizer.

:class:`GradEngine` holds the state of one optimizer's clipping and puts together four
parts, one file each:

* :mod:`dpoptim.capture` — the hooks' side: module calls become records, the gradients of
  one ``backward()`` call become a group (:mod:`dpoptim.scope` decides where the hooks live);
* :mod:`dpoptim.clipping` — the math of one group: per-example norms, clip factors
  ``c_i = min(1, C / ||g_i||)``, clipped sums ``sum_i c_i g_i`` added to the running sums
  (book-keeping, Bu et al. 2023), the activations released at once;
* :mod:`dpoptim.accelerate` — optional ways to make autograd do less (ghost
  differentiation, stand-ins for a layer's backward), off on the first step;
* :mod:`dpoptim.verify` — the first step's comparison with autograd, and the first use of
  every run-time route.

FSDP2's stand-ins and sharded sums are :mod:`dpoptim.sharding`'s. This file keeps the
parameters (claiming, hooking), the state of a
logical batch (:meth:`GradEngine.reset`) and what ``step()`` reads
(:meth:`GradEngine.clipped_sums`). Examples in different ``backward()`` calls are
different examples; uses inside one backward that share a parameter (tied weights, a
module called twice) are summed per example before the norm, so their cross terms count.
docs/architecture.md follows one step through these files.
"""

from __future__ import annotations

import functools
import warnings
import weakref

import torch

from . import fsdp, paths, verify
from .accelerate import AccelerationMixin
from .capture import (CaptureMixin, _accumulated_hook, _forward_hook, _forward_pre_hook, _Group, _param_grad_hook,
                      _restore_hook)
from .clipping import _USED_ELSEWHERE, ClippingMixin
from .errors import PrivacyWarning, UnsupportedLayerError
from .registry import resolve_rule
from .scope import HookScope
from .sharding import ShardingMixin

__all__ = ["GradEngine"]

# id(parameter) -> (weakref to the parameter, weakref to the engine that clips it)
_CLAIMED: dict[int, tuple] = {}

def _remove_all(handles):
    for handle in handles:
        handle.remove()
    handles.clear()

class GradEngine(CaptureMixin, AccelerationMixin, ClippingMixin, ShardingMixin):
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
        # id(module) -> why its call mixed the examples, where no output gradient can carry it
        # to a backward (CaptureMixin._on_forward): the next backward of this engine is refused
        self._mixed_before: dict[int, str] = {}
        self._handles: list = []
        self._verify_handles: list = []
        self._ref = weakref.ref(self)
        self._verify = True
        self._autocast_seen = False
        self._hooked: set[int] = set()
        self._warned_eval = False
        self.reset()
        self._detached: dict[int, list] = {}
        self._contexts: dict[int, list] = {}  # module -> the rule's forward contexts now entered
        self._calls: dict[int, int] = {}  # module -> calls with a Rule.call_state now open
        self._ghosts: set[int] = set()  # parameters autograd no longer reaches through their module
        self._kept: set[int] = set()  # parameters some call left attached: autograd reaches them
        # FSDP2: (id(module), name) -> the sharded parameter that slot holds between forwards,
        # and id(unsharded parameter) -> (weakref to it, the sharded one it stands in for).
        self._slots: dict[tuple[int, str], torch.Tensor] = {}
        self._sharded = False  # whether some parameter is a DTensor
        self._ddp_syncing = None  # in a DistributedDataParallel forward: whether it all-reduces
        self._fsdp_owner: dict[int, tuple] = {}  # id(sharded) -> (weakref to its FSDP module, its slot)
        self._aliases: dict[int, tuple] = {}
        self._alias_hooked: set[int] = set()  # unsharded stand-ins already hooked
        # Process-wide forward hooks until a checked step, then only on the model's modules.
        self._scope = HookScope(functools.partial(_forward_pre_hook, self._ref),
                                functools.partial(_forward_hook, self._ref),
                                functools.partial(_restore_hook, self._ref),
                                needs=lambda module: resolve_rule(module) is not None)
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
            self._scope.widen()  # a new parameter may be used by a model not hooked yet
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
        self._scope.close()
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
        self.backward_calls = 0  # backward passes clipped (dpoptim.check's diagnosis reads it)
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
        if not self._verify:
            self._scope.narrow()
        return {**self._sums, **self._shards}

    # ----------------------------------------------------------------- hooks

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
        """Once, on the first step: the rules' unclipped sums must equal autograd's gradients
        (:func:`dpoptim.verify.compare_sums`); then the check's hooks go."""
        problems = verify.compare_sums(self._raw_sums, self._autograd_sums, self._params, self._autocast_seen)
        if problems:
            self.reset()
            raise UnsupportedLayerError("\n".join(
                f"{self._describe(p)}: the gradient its rule sees differs from autograd's (relative error "
                f"{error:.2e}). {_USED_ELSEWHERE}" for p, error in problems))
        self._verify = False
        _remove_all(self._verify_handles)

