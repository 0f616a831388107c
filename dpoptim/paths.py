"""Where a module sits in the model, for error messages: ``encoder.layer.0.norm`` and the
class's full name (``timm.layers.norm.LayerNorm``).

A module does not know its own name; its parent does. Two process-wide hooks, installed
by each clipping engine for its lifetime (:func:`track`), note the outermost module of the
forward pass running now (or last run), and a module's path is looked up in that module's
``named_modules()`` when an error needs it.
"""

from __future__ import annotations

import threading
import weakref

from torch import nn

__all__ = ["class_name", "path_of", "describe", "track"]

_state = threading.local()


def _enter(module, args):
    depth = getattr(_state, "depth", 0)
    if depth == 0:
        _state.root = weakref.ref(module)
    _state.depth = depth + 1


def _leave(module, args, output):
    _state.depth = max(getattr(_state, "depth", 1) - 1, 0)


def track() -> list:
    """Install the hooks; returns their handles (remove them to stop). Several pairs may be
    installed at once: each pair counts the same depth up and down."""
    return [
        nn.modules.module.register_module_forward_pre_hook(_enter),
        nn.modules.module.register_module_forward_hook(_leave, always_call=True),
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
    ref = getattr(_state, "root", None)
    root = ref() if ref is not None else None
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
