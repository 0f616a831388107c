"""Where a module sits in the model, for error messages: ``encoder.layer.0.norm`` and the
class's full name (``timm.layers.norm.LayerNorm``).

A module does not know its own name; its parent does. Two hooks, process-wide while a
clipping engine discovers its model (:func:`track`) and then on that model's modules
(:func:`hook_module`), note the outermost module call
of the forward pass running now (or last run), as a :class:`Root`, and a module's path is
looked up in that module's ``named_modules()`` when an error needs it. The engine also
reads the number of examples the model was called with from it.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch import nn

__all__ = ["Root", "class_name", "current_root", "path_of", "describe", "track", "hook_module"]

_state = threading.local()


class Root:
    """The outermost module call of a forward pass: the module (weakly) and the sizes of
    dimensions 0 and 1 of its first tensor argument, the number of examples every layer
    inside must see (None when the first argument is not a plain tensor)."""

    __slots__ = ("module", "sizes")

    def __init__(self, module, args):
        self.module = weakref.ref(module)
        self.sizes = _leading_sizes(args)

    def complete(self, kwargs) -> None:
        if self.sizes is None and kwargs:  # called with keywords only (model(**batch))
            self.sizes = _leading_sizes(tuple(v for v in kwargs.values() if isinstance(v, torch.Tensor))[:1])


def _leading_sizes(args):
    if not args or type(args[0]) not in (torch.Tensor, nn.Parameter) or args[0].dim() == 0:
        return None
    shape = args[0].shape
    return shape[0], (shape[1] if len(shape) > 1 else None)


def _enter(module, args):
    depth = getattr(_state, "depth", 0)
    if depth == 0:
        _state.root = Root(module, args)
    _state.depth = depth + 1


def _leave(module, args, *more):
    # (kwargs, output) after a forward; torch calls an always-called hook with (output)
    # alone, without kwargs, when the forward raised.
    _state.depth = max(getattr(_state, "depth", 1) - 1, 0)
    root = getattr(_state, "root", None)
    if len(more) == 2 and _state.depth == 0 and root is not None and root.module() is module:
        root.complete(more[0])


def current_root() -> Root | None:
    """The outermost module call in progress on this thread (or the last one)."""
    return getattr(_state, "root", None)


class _Claim:
    """One engine's claim on the hooks: they stay installed while any claim is held."""

    def __init__(self):
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            _claims[0] -= 1
            if _claims[0] == 0:
                for handle in _installed:
                    handle.remove()
                _installed.clear()


class _Handle:
    """Looks like the hook's ``RemovableHandle`` (code that pauses an engine's global hooks
    reads ``id`` and the dict references), but ``remove()`` gives up the engine's claim."""

    def __init__(self, handle, claim: _Claim):
        self._handle, self._claim = handle, claim

    def __getattr__(self, name):
        return getattr(self._handle, name)

    def remove(self) -> None:
        self._claim.release()


_installed: list = []  # the two hook handles while installed
_claims = [0]


def track() -> list:
    """Install the hooks (once for all engines); returns handles whose ``remove()`` gives up
    this claim. The hooks go when the last claim does."""
    if _claims[0] == 0:
        _state.depth = 0  # a forward cut short by removal mid-call leaves nothing behind
        _installed[:] = [
            nn.modules.module.register_module_forward_pre_hook(_enter),
            nn.modules.module.register_module_forward_hook(_leave, with_kwargs=True, always_call=True),
        ]
    _claims[0] += 1
    claim = _Claim()
    return [_Handle(handle, claim) for handle in _installed]


def hook_module(module) -> list:
    """The same two hooks on ``module`` alone (prepended: they run before the module's
    own), for an engine whose hooks are scoped to its model (:mod:`dpoptim.scope`).
    Returns their handles."""
    return [
        module.register_forward_hook(_leave, prepend=True, with_kwargs=True, always_call=True),
        module.register_forward_pre_hook(_enter, prepend=True),
    ]


def class_name(module_or_class) -> str:
    """``package.module.Class`` (``torch.nn`` classes as ``torch.nn.Linear``)."""
    cls = module_or_class if isinstance(module_or_class, type) else type(module_or_class)
    where = cls.__module__
    if where.startswith("torch.nn.modules"):
        where = "torch.nn"
    return f"{where}.{cls.__qualname__}"


def path_of(module) -> str | None:
    """The dotted name of ``module`` in the outermost module of the latest forward pass
    (``''`` for that module itself), or None when it is not found there."""
    found = getattr(_state, "root", None)
    root = found.module() if found is not None else None
    if root is None:
        return None
    for name, m in root.named_modules(remove_duplicate=False):
        if m is module:
            return name
    return None


def describe(module) -> str:
    """```path` (full.ClassName)``, or just the class when the path is unknown."""
    path = path_of(module)
    cls = class_name(module)
    if path is None:
        return cls
    return f"`{path or '(the model itself)'}` ({cls})"
