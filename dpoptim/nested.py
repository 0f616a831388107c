"""Walking nested batches, inputs and saved values: the one walker dpoptim has.

Batches and module arguments nest tensors in mappings (dicts, ``BatchEncoding``-like
``Mapping`` types, kept as their own type), named tuples (``PackedSequence`` included),
lists and tuples. :func:`map_structure` rebuilds such a structure with a function applied
at every leaf, walking several structures of the same shape side by side when given more
than one. A list or tuple of plain values (strings, numbers: no tensors, no containers)
can be treated as one leaf (``values=``): a batch of strings is cut like a batch of rows.

:func:`flatten` and :func:`unflatten` are PyTorch's own pytree (``torch.utils._pytree``,
there being no public module in PyTorch 2.13; see :mod:`dpoptim._torch`), for an op's
arguments, where every leaf must come back in place; they treat an unknown ``Mapping``
type as a leaf, which is why batches go through :func:`map_structure` instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import torch

from ._torch import tree_flatten as flatten, tree_unflatten as unflatten

__all__ = ["map_structure", "map_tensors", "visit_tensors", "is_plain", "mapping_like", "flatten", "unflatten"]


def is_plain(x) -> bool:
    """A leaf that is no tensor and no container (a string, a number, None)."""
    return not isinstance(x, (torch.Tensor, Mapping, list, tuple))


def mapping_like(original: Mapping, items: dict) -> Mapping:
    """``items`` as the mapping type of ``original`` (a plain dict when that type cannot be
    built from a dict, as ``defaultdict``)."""
    try:
        return type(original)(items)
    except TypeError:
        return items


def map_structure(fn: Callable, obj: Any, *others: Any, values: Callable | None = None) -> Any:
    """``obj`` rebuilt with ``fn(leaf, *other_leaves)`` at every leaf (tensors and plain
    values alike), ``others`` walked alongside (same structure; mappings matched by key).

    ``values``: when given, a non-empty plain list or tuple (not a named tuple) whose items
    are all :func:`is_plain` is one leaf, replaced by ``values(seq, *other_seqs)``."""
    if isinstance(obj, Mapping):
        return mapping_like(obj, {k: map_structure(fn, v, *(o[k] for o in others), values=values)
                                  for k, v in obj.items()})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return obj._make(map_structure(fn, *items, values=values) for items in zip(obj, *others))
    if isinstance(obj, (list, tuple)):
        if values is not None and obj and all(is_plain(v) for v in obj):
            return values(obj, *others)
        return type(obj)(map_structure(fn, *items, values=values) for items in zip(obj, *others))
    return fn(obj, *others)


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor ``t`` replaced by ``fn(t)``; everything else kept."""
    return map_structure(lambda x: fn(x) if isinstance(x, torch.Tensor) else x, obj)


def visit_tensors(fn: Callable[[torch.Tensor], None], obj: Any) -> None:
    """Call ``fn`` on every tensor in ``obj``."""
    def leaf(x):
        if isinstance(x, torch.Tensor):
            fn(x)
        return x

    map_structure(leaf, obj)
