"""Tensors every example shares, met by the batch inside a forward: bare parameters
(``cls_token``, ``pos_embed``, a layer-scale ``gamma``, a learned temperature, the weight
of an RMS norm written by hand) and lookups made once for the whole batch (an embedding
of position ids ``[1, T]``).

Such a tensor ``q`` has no example axis. The forward broadcasts it against a batched
tensor ``x`` (``x + q``, ``x * q``), or expands it to the batch (``q.expand(n, ...)``).
Both are the same thing: each example ``i`` reads its own copy ``E_i = q``. So the use is
made to read an explicit copy,

    ``E = q.reshape(1, ..., *q.shape).expand(n, ...)``,   the op computes ``f(x, E)``,

which is the same op with the same output (broadcasting would have made that copy
anyway), and the gradient autograd hands to ``E`` keeps the example axis: example i's
gradient of ``q`` is ``dL/dE_i`` summed over the dims that ``q`` had as 1 (broadcast
dims). From ``q`` back to the parameter ``p`` (``q`` may be ``p`` itself, a view,
a cast, ``1 + p``, ``p.exp()``...): the same vector-Jacobian product per example, a
reshape for views and casts, a multiplication by ``dq/dp`` for element-wise steps, and
otherwise one small backward per example of the (parameter-sized) steps from ``p``
to ``q``.

What finds the uses. For a module's own parameters, a torch function mode is active
during that module's forward; it follows each parameter through the ops that involve only
it (views, casts, slices, element-wise maths with constants) and rewrites the op where it
meets the batch. For an embedding looked up with a batch of one, its output is handed on as
a tensor subclass that does the same wherever it goes.

A use is refused (never guessed) when a shared tensor meets the batch in an op that is not
element-wise (a matrix product, a concatenation without an expand, a convolution): there
the example axis cannot be restored by copying, and a parameter applied across the batch
axis mixes examples.

``layer_norm``, ``rms_norm`` and ``group_norm`` with a shared weight and bias are
decomposed into the normalisation without affine parameters, then ``* weight + bias``
(the affine step is element-wise): that covers norms that subclass or imitate the stock
ones (timm's ``LayerNorm``, ``LayerNorm2d``).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .._torch import torch_function_subclass_disabled
from ..nested import flatten as tree_flatten, unflatten as tree_unflatten
from ._common import common_dtype

__all__ = ["SharedTensorError", "SharedMode", "Source", "broadcast_alias", "per_example_of_uses"]


class SharedTensorError(ValueError):
    """A tensor shared by all examples meets the batch where it cannot be made per-example."""


# Ops that broadcast their tensor operands element-wise (by ``func.__name__``; torch's
# Tensor methods and functions share names).
_POINTWISE = frozenset("""
add add_ sub sub_ subtract mul mul_ multiply div div_ divide true_divide true_divide_ rsub
__rsub__ __rtruediv__ __rdiv__ __rpow__ __radd__ __rmul__ __iadd__ __isub__ __imul__ __idiv__
__itruediv__ where addcmul addcmul_ addcdiv addcdiv_ lerp lerp_ maximum minimum fmax fmin
pow pow_ atan2 hypot copysign xlogy clamp clamp_ clip clip_ masked_fill masked_fill_
""".split())
# Ops whose result is the shared tensor copied along new or size-1 dims.
_EXPANDS = frozenset({"expand", "expand_as", "broadcast_to"})
# Ops that keep every element in its place (views, casts): a gradient maps back by reshape.
_IN_PLACE_ORDER = frozenset("""
view view_as reshape reshape_as flatten unflatten unsqueeze squeeze contiguous clone to float
double half bfloat16 type type_as detach_ requires_grad_
""".split())
# Element-wise functions of one tensor (with constant operands): a diagonal Jacobian.
_DIAGONAL = _POINTWISE | _IN_PLACE_ORDER | frozenset("""
neg exp exp_ expm1 log log1p sigmoid tanh abs sqrt rsqrt square reciprocal softplus sin cos
relu gelu silu float_power
""".split())
_NORMS = frozenset({"layer_norm", "rms_norm", "group_norm"})
_PROPERTIES = frozenset({"__get__"})

_HERE = object()  # where the shared tensor goes when a recorded step is replayed


def _name(func) -> str:
    return getattr(func, "__name__", "") or ""


class Source:
    """One shared tensor (a parameter, or an embedding's output) and its uses in one call."""

    def __init__(self, base: torch.Tensor, label, lenient: bool = False):
        self.base = base
        self._label = label  # "parameter 'pos' of `encoder` (mypkg.Encoder)", or a function making it
        self.lenient = lenient
        self.uses: list = []  # (E, steps, padded shape or None for a batch of one)
        self.refused: list[str] = []  # with lenient: what would have been refused
        self.plain: str | None = None  # an op that read it as batched with a batch of one
        self.grads: dict[int, torch.Tensor] = {}  # filled by hooks on E (the subclass route)

    @property
    def label(self) -> str:
        """For error messages only: finding a module's path walks the model."""
        return self._label if isinstance(self._label, str) else self._label()

    def refuse(self, message: str):
        if self.lenient:
            self.refused.append(message)
            return
        raise SharedTensorError(message)


class _Info:
    """A tensor derived from a source by ``steps`` (ops that involve only it)."""

    __slots__ = ("source", "steps")

    def __init__(self, source: Source, steps: tuple = ()):
        self.source = source
        self.steps = steps


def _padded(shape, dims: int) -> tuple:
    return (1,) * (dims - len(shape)) + tuple(shape)


class _Splitter:
    """Runs one op that involves tracked (shared) tensors: rewrites uses against the batch,
    follows ops on the shared tensor alone, refuses the rest. ``n`` is the batch size when
    known (the first tensor argument of the module's call), else None."""

    def __init__(self, n: int | None, constants: frozenset = frozenset()):
        self.n = n
        self.constants = constants  # ids of tensors known to carry no examples (the module's buffers)

    # The two front ends (mode, subclass) differ in how they mark and find tracked tensors.
    def info(self, t) -> _Info | None:
        raise NotImplementedError

    def track(self, t: torch.Tensor, info: _Info) -> torch.Tensor:
        raise NotImplementedError

    def record(self, source: Source, E: torch.Tensor, steps, padded) -> None:
        source.uses.append((E, steps, padded))

    def plain_use(self, source: Source, func) -> None:
        """Where a shared tensor meets the batch in an op that cannot be split."""
        source.refuse(
            f"{source.label} meets the batch in `{_name(func) or func}`, which is not element-wise: "
            "dpoptim cannot tell each example's part of its gradient there (a parameter applied "
            "across examples would mix them). Use it in an element-wise op against the batch "
            "(x + p, x * p), expand it to the batch first (p.expand(x.shape[0], ...)), or give "
            "this computation a module with its own rule (@dpoptim.register_rule)."
        )

    def combined(self, func, tracked) -> None:
        """Where two shared tensors meet before either meets the batch."""
        for _, info in tracked:
            info.source.refuse(
                f"{info.source.label} is combined with another shared tensor in "
                f"`{_name(func) or func}` before it meets the batch; dpoptim follows one shared "
                "tensor at a time. Combine them inside a module of their own with a rule."
            )

    def is_batch(self, size: int) -> bool:
        return size == self.n if self.n is not None else size != 1

    def batched(self, t: torch.Tensor, out_dims: int, out_first: int) -> bool:
        """Whether a plain (untracked) operand carries the example axis in front."""
        if t.dim() != out_dims or out_dims == 0 or t.shape[0] != out_first or id(t) in self.constants:
            return False
        return self.n is None or out_first == self.n

    def run(self, func, args, kwargs):
        flat, spec = tree_flatten((args, kwargs))
        where = [(k, self.info(x)) for k, x in enumerate(flat) if isinstance(x, torch.Tensor)]
        tracked = [(k, i) for k, i in where if i is not None]
        name = _name(func)
        if name in _NORMS and where and where[0][1] is None:  # a shared weight or bias
            return self.norm(func, name, args, kwargs)
        plain = [flat[k] for k, i in where if i is None]
        if name in _POINTWISE:
            shapes = [flat[k].shape for k, _ in where]
            try:
                out_shape = torch.broadcast_shapes(*shapes)
            except RuntimeError:
                return func(*args, **kwargs)  # torch raises its own error
            dims = len(out_shape)
            if dims and any(self.batched(t, dims, out_shape[0]) for t in plain):
                for k, info in tracked:
                    flat[k] = self.copy_per_example(flat[k], info, dims, out_shape[0])
                a, kw = tree_unflatten(flat, spec)
                return func(*a, **kw)
            return self.follow(func, flat, spec, tracked)
        if name in _EXPANDS and tracked and tracked[0][0] == 0 and len(tracked) == 1:
            out = func(*args, **kwargs)
            info = tracked[0][1]
            q = flat[0]
            padded = _padded(q.shape, out.dim())
            if out.dim() and padded[0] == 1 and self.is_batch(out.shape[0]):
                self.record(info.source, out, info.steps, padded)
                return out
            return self.follow(func, flat, spec, tracked, result=out)
        plain = [t for t in plain if id(t) not in self.constants]
        if self.n is not None:
            batch = [t for t in plain if t.dim() and t.shape[0] == self.n]
        else:
            batch = [t for t in plain if t.dim()]
        if not batch or name in _PROPERTIES:
            return self.follow(func, flat, spec, tracked)
        if self.n == 1:  # one example: every use is that example's
            for k, info in tracked:
                E = flat[k].view_as(flat[k])
                self.record(info.source, E, info.steps, None)
                flat[k] = E
            a, kw = tree_unflatten(flat, spec)
            return func(*a, **kw)
        for _, info in tracked:
            self.plain_use(info.source, func)
        return func(*args, **kwargs)

    def copy_per_example(self, q, info: _Info, dims: int, n: int) -> torch.Tensor:
        padded = _padded(q.shape, dims)
        if padded[0] != 1 and n != 1:
            info.source.refuse(
                f"{info.source.label} is broadcast so that its own first dimension "
                f"(size {padded[0]}) lies on the batch axis: each example would read a different "
                "slice of it, which dpoptim does not split. Give it a leading dimension of 1 "
                "(or none) so that it is shared by every example."
            )
            return q
        E = q.reshape(padded).expand(n, *padded[1:])
        self.record(info.source, E, info.steps, padded)
        return E

    def follow(self, func, flat, spec, tracked, result=None):
        """An op on shared tensors alone: its result is shared too, one step further."""
        if result is None:
            a, kw = tree_unflatten(flat, spec)
            result = func(*a, **kw)
        if not tracked:
            return result
        if len(tracked) > 1:
            self.combined(func, tracked)
            return result
        k, info = tracked[0]
        template = list(flat)
        for j, _ in tracked:
            template[j] = _HERE
        step_args = (func, tuple(template), spec)
        if isinstance(result, torch.Tensor):
            if result.requires_grad:
                return self.track(result, _Info(info.source, info.steps + ((step_args, None, tuple(result.shape)),)))
            return result
        if isinstance(result, (tuple, list)) and all(isinstance(r, torch.Tensor) for r in result):
            out = [self.track(r, _Info(info.source, info.steps + ((step_args, j, tuple(r.shape)),)))
                   if r.requires_grad else r for j, r in enumerate(result)]
            return type(result)(out) if not hasattr(result, "_fields") else type(result)(*out)
        return result

    def norm(self, func, name, args, kwargs):
        """``*_norm(x, ..., weight, bias)`` = the norm without affine parameters, then
        ``* weight + bias``: the affine step is element-wise, so shared weights split."""
        if name == "layer_norm":
            names = ("input", "normalized_shape", "weight", "bias", "eps")
        elif name == "rms_norm":
            names = ("input", "normalized_shape", "weight", "eps")
        else:
            names = ("input", "num_groups", "weight", "bias", "eps")
        bound = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
        weight, bias = bound.pop("weight", None), bound.pop("bias", None)
        x = bound["input"]
        extra = {k: v for k, v in bound.items() if k != "input"}
        y = getattr(F, name)(x, **extra)
        if weight is not None:
            if name == "group_norm":
                shape = (-1,) + (1,) * (x.dim() - 2)
                weight = self.run(torch.Tensor.reshape, (weight, shape), {})
                bias = None if bias is None else self.run(torch.Tensor.reshape, (bias, shape), {})
            y = self.run(torch.mul, (y, weight), {})
        if bias is not None:
            y = self.run(torch.add, (y, bias), {})
        return y


class SharedMode(TorchFunctionMode):
    """Active during one call of a module: follows that module's own parameters."""

    def __init__(self, sources: dict[int, tuple[torch.Tensor, Source]], n: int | None, constants=frozenset()):
        super().__init__()
        self.tracked: dict[int, tuple[torch.Tensor, _Info]] = {
            pid: (p, _Info(source)) for pid, (p, source) in sources.items()
        }
        splitter = _Splitter(n, constants)
        splitter.info = self._info
        splitter.track = self._track
        self.splitter = splitter

    def _info(self, t):
        entry = self.tracked.get(id(t))
        return entry[1] if entry is not None and entry[0] is t else None

    def _track(self, t, info):
        self.tracked[id(t)] = (t, info)
        return t

    def _involved(self, args, kwargs) -> bool:
        tracked = self.tracked
        for a in args:
            if isinstance(a, torch.Tensor):
                if id(a) in tracked:
                    return True
            elif isinstance(a, (list, tuple)):
                if any(isinstance(b, torch.Tensor) and id(b) in tracked for b in a):
                    return True
        return any(isinstance(v, torch.Tensor) and id(v) in tracked for v in kwargs.values())

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._involved(args, kwargs):
            return func(*args, **kwargs)
        return self.splitter.run(func, args, kwargs)

    def holds(self, obj) -> bool:
        """Whether ``obj`` (a module's output) contains a tracked tensor."""
        flat, _ = tree_flatten(obj)
        return any(isinstance(t, torch.Tensor) and self._info(t) is not None for t in flat)


# ----------------------------------------------------------------- the subclass route
class _Broadcast(torch.Tensor):
    """A lookup made once for the whole batch (an embedding of ``[1, T]`` position ids),
    handed on by its module: wherever it meets the batch element-wise, each example gets
    its own copy, whose gradient goes to :class:`Source`."""

    _dp_info: _Info

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch_function_subclass_disabled():
            return _SUBCLASS.run(func, args, kwargs)


def _collect(source: Source, index: int, grad: torch.Tensor):
    previous = source.grads.get(index)
    source.grads[index] = grad if previous is None else previous + grad


class _SubclassSplitter(_Splitter):
    def info(self, t):
        return t.__dict__.get("_dp_info") if isinstance(t, _Broadcast) else None

    def track(self, t, info):
        t = t.as_subclass(_Broadcast)
        t._dp_info = info
        return t

    def record(self, source, E, steps, padded):
        source.uses.append((E, steps, padded))
        if E.requires_grad:
            E.register_hook(functools.partial(_collect, source, len(source.uses) - 1))

    def plain_use(self, source, func):
        # A batch of one: the lookup is that example's own. With more, the rule refuses.
        source.plain = source.plain or (_name(func) or str(func))

    def combined(self, func, tracked):
        # Two lookups with a first dim of 1 meeting: a batch of one (or the rule refuses).
        for _, info in tracked:
            self.plain_use(info.source, func)


_SUBCLASS = _SubclassSplitter(None)


def broadcast_alias(output: torch.Tensor, label: str) -> tuple[torch.Tensor, Source]:
    """``output`` (first dim 1, a lookup for the whole batch) as a tensor that splits per
    example where it meets the batch; the :class:`Source` collects those uses."""
    source = Source(output, label)
    with torch_function_subclass_disabled():
        alias = output.as_subclass(_Broadcast)
    alias._dp_info = _Info(source)
    return alias, source


# ----------------------------------------------------------------- back to the source
def _replay(steps, leaf):
    t = leaf
    for (func, template, spec), item, _ in steps:
        flat = [t if x is _HERE else x for x in template]
        a, kw = tree_unflatten(flat, spec)
        t = func(*a, **kw)
        if item is not None:
            t = t[item]
    return t


def _to_base(grad: torch.Tensor, steps, base: torch.Tensor) -> torch.Tensor:
    """Per-example gradients of a derived tensor ``q`` (``[n, *q.shape]``) to per-example
    gradients of the source ``base`` it came from by ``steps``: ``J^T g_i`` for each i."""
    n = grad.shape[0]
    if not steps:
        return grad
    funcs = [_name(step[0][0]) for step in steps]
    if all(f in _IN_PLACE_ORDER for f in funcs) and math.prod(grad.shape[1:]) == base.numel():
        return grad.reshape(n, *base.shape)
    leaf = base.detach().requires_grad_()
    with torch.enable_grad():
        q = _replay(steps, leaf)
    if all(f in _DIAGONAL for f in funcs) and all(s[2] == tuple(base.shape) for s in steps):
        (slope,) = torch.autograd.grad(q, leaf, torch.ones_like(q))
        return grad * slope.to(grad.dtype)
    if n == 0:
        return grad.new_zeros(0, *base.shape)
    # One small backward per example through the parameter-sized steps p -> q.
    rows = [torch.autograd.grad(q, leaf, grad[i].to(q.dtype), retain_graph=i < n - 1, allow_unused=True)[0]
            for i in range(n)]
    return torch.stack([torch.zeros_like(base) if r is None else r for r in rows]).to(grad.dtype)


def per_example_of_uses(uses, grads, base: torch.Tensor, label: str) -> torch.Tensor | None:
    """``g_i(base)`` ``[n, *base.shape]`` from the uses of one source and the gradients of
    their copies ``E`` (None where no gradient arrived). None when no use carried one."""
    total = None
    sizes = set()
    for (E, steps, padded), grad in zip(uses, grads):
        if grad is None:
            continue
        wide = grad.to(common_dtype(grad, base))
        if padded is None:  # a batch of one read it as is
            g = wide.unsqueeze(0)
        else:
            dims = [d for d in range(1, len(padded)) if padded[d] == 1 and wide.shape[d] != 1]
            if dims:
                wide = wide.sum(dims, keepdim=True)
            q_shape = padded[len(padded) - len(_q_shape(steps, base)):]
            g = wide.reshape(wide.shape[0], *q_shape)
        g = _to_base(g, steps, base)
        sizes.add(g.shape[0])
        total = g if total is None else (total + g if total.shape == g.shape else None)
        if total is None:
            raise SharedTensorError(
                f"{label() if callable(label) else label} was used with different batch sizes ({sorted(sizes)}) in one forward: "
                "it is broadcast against tensors whose first dimension is not the batch."
            )
    return total


def _q_shape(steps, base) -> tuple:
    return steps[-1][2] if steps else tuple(base.shape)
