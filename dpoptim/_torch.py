"""Every private PyTorch internal dpoptim relies on, each behind one small function.

PyTorch promises nothing about names that start with an underscore, about the class names
of its autograd nodes or about the byte layout of a generator's state. dpoptim uses a few
of them where no public door exists. Each one lives here, and only here, with what it is
and what would break if PyTorch changed it; ``tests/test_torch_internals.py`` exercises
every one against the installed PyTorch, and each function raises
:class:`TorchInternalChanged` (naming the internal and the PyTorch version) when it finds
the internal gone or changed, rather than letting a wrong value through.

The rule for new code: a private torch attribute, class or layout is used through a
function of this module, with a docstring and a test, or not at all.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch import nn

__all__ = [
    "TorchInternalChanged",
    "graph_task_id",
    "in_backward",
    "queue_end_of_backward",
    "is_compiled_wrapper",
    "version_counter",
    "is_batch_norm",
    "is_dropout",
    "own_parameters",
    "no_batch_dim",
    "conv_explicit_padding",
    "mha_packed_projection",
    "grad_scaler_scale",
    "grad_scaler_report_no_overflow",
    "is_fused_attention_node",
    "fused_attention_output",
    "FUSED_ATTENTION_GRAD_ORDER",
    "saved_tensor_hooks_active",
    "CPU_GENERATOR_STATE_BYTES",
    "set_cpu_generator_words",
    "cudnn_disabled",
    "tree_flatten",
    "tree_unflatten",
    "torch_function_subclass_disabled",
    "foreach_div_",
]


class TorchInternalChanged(RuntimeError):
    """A private PyTorch internal that dpoptim relies on is gone or behaves differently in
    this PyTorch: dpoptim refuses rather than compute something silently wrong."""


def _changed(what: str, breaks: str) -> TorchInternalChanged:
    return TorchInternalChanged(
        f"PyTorch {torch.__version__} changed {what}, which dpoptim relies on ({breaks}). "
        "Use a PyTorch version dpoptim supports (see its pyproject.toml), or report this."
    )


def _require(obj, name: str, what: str, breaks: str):
    value = getattr(obj, name, None)
    if value is None:
        raise _changed(what, breaks)
    return value


# ---------------------------------------------------------------------------- autograd engine
def graph_task_id() -> int:
    """``torch._C._current_graph_task_id()``: an id of the ``backward()`` call this thread is
    running, -1 outside a backward. Tells one ``backward()`` from the next, so that two DP
    optimizers reached by one backward are refused and reentrant checkpointing's nested
    backwards are clipped with their outer one. If it changed, those checks would be lost."""
    fn = _require(torch._C, "_current_graph_task_id", "torch._C._current_graph_task_id",
                  "telling one backward() call from another")
    value = fn()
    if not isinstance(value, int):
        raise _changed("torch._C._current_graph_task_id (no longer an int)", "telling one backward() call from another")
    return value


def in_backward() -> bool:
    """Whether this thread is running a backward pass (see :func:`graph_task_id`)."""
    return graph_task_id() != -1


def queue_end_of_backward(callback) -> None:
    """``Variable._execution_engine.queue_callback``: run ``callback`` once the running
    ``backward()`` has finished. It is where a backward's per-example norms and clipped sums
    are computed; without it nothing would be clipped, so its absence raises."""
    engine = _require(torch.autograd.Variable, "_execution_engine", "torch.autograd.Variable._execution_engine",
                      "computing the clipped sums at the end of each backward()")
    _require(engine, "queue_callback", "the autograd engine's queue_callback",
             "computing the clipped sums at the end of each backward()")(callback)


# ---------------------------------------------------------------------------- modules
def is_compiled_wrapper(module) -> bool:
    """Whether ``module`` is what ``torch.compile(model)`` returns: the class
    ``OptimizedModule`` of ``torch._dynamo``, whose compiled forward hides the layers from
    module hooks. If the name moved, that wrapper would no longer be refused with a clear
    message (its layers would not be seen and backward would report unclipped gradients
    instead)."""
    cls = type(module)
    return cls.__name__ == "OptimizedModule" and cls.__module__.startswith("torch._dynamo")


def is_batch_norm(module) -> bool:
    """``isinstance(module, nn.modules.batchnorm._BatchNorm)``: BatchNorm1d/2d/3d,
    SyncBatchNorm and the lazy variants. :func:`dpoptim.replace_batchnorm` and the
    automatic rules rely on it; the refusal of batch statistics itself lives in
    ``BatchNormRule``."""
    return isinstance(module, _require(nn.modules.batchnorm, "_BatchNorm", "nn.modules.batchnorm._BatchNorm",
                                       "finding BatchNorm layers"))


def is_dropout(module) -> bool:
    """``isinstance(module, nn.modules.dropout._DropoutNd)``: every dropout module (the
    gradient check turns their probability to 0)."""
    return isinstance(module, _require(nn.modules.dropout, "_DropoutNd", "nn.modules.dropout._DropoutNd",
                                       "finding dropout layers"))


def own_parameters(module: nn.Module) -> dict:
    """``module._parameters``: the module's own parameters by name (``None`` entries
    included), the dict its forward reads ``self.weight`` from. Ghost differentiation swaps
    entries of it for the forward; the rules read it to know what a module owns. If it
    stopped being a dict or stopped being what ``self.weight`` reads, both would break."""
    params = getattr(module, "_parameters", None)
    if not isinstance(params, dict):
        raise _changed("nn.Module._parameters", "reading and swapping a module's own parameters")
    return params


def no_batch_dim(module: nn.Module) -> int:
    """``InstanceNorm._get_no_batch_dim()``: the number of dims of an unbatched input."""
    return _require(module, "_get_no_batch_dim", "InstanceNorm._get_no_batch_dim",
                    "telling a batched input from an unbatched one")()


def conv_explicit_padding(module: nn.Module) -> list[int]:
    """``_reversed_padding_repeated_twice`` of a convolution: the ``F.pad`` list its
    forward uses for the non-zero padding modes (reflect, replicate, circular). A wrong
    value would give wrong per-example gradients, which the first step's comparison with
    autograd reports; a missing one raises here."""
    pads = getattr(module, "_reversed_padding_repeated_twice", None)
    if pads is None or len(pads) != 2 * len(module.kernel_size):
        raise _changed("ConvNd._reversed_padding_repeated_twice", "the padding of non-zero padding modes")
    return list(pads)


def mha_packed_projection(module: nn.Module) -> bool:
    """``MultiheadAttention._qkv_same_embed_dim``: whether query, key and value share one
    packed ``in_proj_weight`` (else ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``)."""
    packed = getattr(module, "_qkv_same_embed_dim", None)
    if not isinstance(packed, bool):
        raise _changed("MultiheadAttention._qkv_same_embed_dim", "reading the attention's projection weights")
    if packed != (getattr(module, "in_proj_weight", None) is not None):
        raise _changed("MultiheadAttention._qkv_same_embed_dim (disagrees with in_proj_weight)",
                       "reading the attention's projection weights")
    return packed


def version_counter(t: torch.Tensor) -> int:
    """``Tensor._version``: bumped by every in-place change of the tensor. dpoptim tells a
    ``.grad`` that ``model.zero_grad(set_to_none=False)`` zeroed from one it left alone;
    if it stopped counting, a cleared batch would be charged together with the next."""
    version = getattr(t, "_version", None)
    if not isinstance(version, int):
        raise _changed("Tensor._version", "noticing gradients cleared between backward() calls")
    return version


# ---------------------------------------------------------------------------- GradScaler
def _unknown_scaler(scaler) -> TorchInternalChanged:
    return TorchInternalChanged(
        f"dpoptim does not know how this {type(scaler).__name__} records overflows (it relies on "
        f"torch.amp.GradScaler's private _scale and _per_optimizer_states, as in PyTorch "
        f"{torch.__version__}), so it cannot keep the loss scale independent of the data. Use "
        "torch.amp.GradScaler with a PyTorch version dpoptim supports."
    )


def grad_scaler_scale(scaler):
    """``GradScaler._scale``: the scale tensor, None before the first ``scale()``."""
    if not hasattr(scaler, "_scale"):
        raise _unknown_scaler(scaler)
    return scaler._scale


def grad_scaler_report_no_overflow(scaler, optimizer) -> None:
    """Record "no overflow" for ``optimizer`` in ``scaler._per_optimizer_states`` (the entry
    ``found_inf_per_device`` that ``GradScaler.update()`` reads to back the scale off).

    dpoptim drops an overflowing example itself; the scale must not react to it, or the
    scale (which decides which examples overflow next) would depend on the data. If torch
    stopped reading this entry, ``update()`` would fail or back off: either is loud (a
    KeyError, or the scale test in tests/test_torch_internals.py)."""
    scale = grad_scaler_scale(scaler)
    if scale is None:
        return  # the scaler has not scaled anything yet
    states = getattr(scaler, "_per_optimizer_states", None)
    if not isinstance(states, dict):
        raise _unknown_scaler(scaler)
    zero = torch.zeros((), dtype=torch.float32, device=scale.device)
    states[id(optimizer)]["found_inf_per_device"] = {scale.device: zero}


# ---------------------------------------------------------------------------- fused attention
#: The order of the gradients a fused attention node's backward returns first: the
#: gradients of query, key and value. tests/test_torch_internals.py checks it against
#: autograd on distinct q, k, v; a swap there would be silent on self-attention shapes.
FUSED_ATTENTION_GRAD_ORDER = ("query", "key", "value")

_checked_attention: dict = {}


def is_fused_attention_node(node) -> bool:
    """Whether the autograd node ``node`` is one of ``scaled_dot_product_attention``'s fused
    kernels (class names ``ScaledDotProduct...Backward``). A rename makes the attention rule
    replay instead of tap: slower, still exact."""
    return type(node).__name__.startswith("ScaledDotProduct")


def fused_attention_output(node) -> torch.Tensor | None:
    """The attention output ``A`` a fused attention node saved for its backward
    (``node._saved_output``), or None when it has none (the rule replays then).

    The first call in a process also checks, on a tiny attention of its own, that this
    PyTorch's node keeps its output there and returns the gradients of query, key and value
    in that order (:data:`FUSED_ATTENTION_GRAD_ORDER`), and raises
    :class:`TorchInternalChanged` otherwise: the rule would read wrong tensors silently."""
    output = getattr(node, "_saved_output", None)
    if not isinstance(output, torch.Tensor):
        return None
    key = type(node).__name__
    if key not in _checked_attention:
        _checked_attention[key] = _probe_fused_attention(key)
    if not _checked_attention[key]:
        raise _changed(f"the autograd node {key} (its _saved_output or the order of its gradients)",
                       "reading the attention output and q, k, v gradients from the fused kernel")
    return output


def _probe_fused_attention(name: str) -> bool:
    """Run a small attention with distinct q, k, v through the kernel and compare the node's
    saved output and gradient order with autograd's own answer. A kernel this probe cannot
    reach (another device) is trusted, since the first-step check and the tests cover it."""
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 3, 4, generator=generator, requires_grad=True) for _ in range(3))
    with torch.enable_grad():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    node = out.grad_fn
    if type(node).__name__ != name:
        return True  # a kernel of another device or dtype: not reachable here
    saved = getattr(node, "_saved_output", None)
    if not (isinstance(saved, torch.Tensor) and torch.equal(saved, out)):
        return False
    box = {}
    node.register_hook(lambda grad_inputs, grad_outputs: box.setdefault("grads", grad_inputs))
    d_out = torch.randn(out.shape, generator=generator)
    expected = torch.autograd.grad(out, (q, k, v), d_out)
    got = box.get("grads")
    if got is None or len(got) < 3:
        return False
    return all(g is not None and torch.allclose(g, e, atol=1e-5) for g, e in zip(got[:3], expected))


def saved_tensor_hooks_active() -> bool:
    """Whether tensors saved for backward now go through hooks (activation checkpointing,
    ``save_on_cpu``), read from ``torch._C._autograd._top_saved_tensors_default_hooks``.
    Assumed so when PyTorch cannot tell: the attention rule then replays (always exact)."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    try:
        return top is None or top(False) is not None
    except TypeError:
        return True


# ---------------------------------------------------------------------------- generators
#: The size of a CPU generator's state (``torch.Generator().get_state()``): a 64-bit seed,
#: then the Mersenne Twister's 624 words, each stored as a uint64, then ``left``, ``seeded``,
#: ``next`` and the normal-distribution cache.
CPU_GENERATOR_STATE_BYTES = 5056
_MT_WORDS = 624
_MT_OFFSET = 24  # bytes before the first state word


def set_cpu_generator_words(generator: torch.Generator, words: torch.Tensor) -> None:
    """Give the CPU ``generator`` the 624 Mersenne Twister words ``words`` (int32 or int64,
    low 32 bits used), bypassing ``manual_seed``, which keeps only 32 bits of a seed.

    Relies on the byte layout of ``get_state()`` (:data:`CPU_GENERATOR_STATE_BYTES` bytes,
    words as little-endian uint64 from byte 24); tests/test_torch_internals.py rebuilds that
    layout from the Mersenne Twister's own seeding. A state of another size raises."""
    state = generator.get_state()
    if state.numel() != CPU_GENERATOR_STATE_BYTES or words.numel() != _MT_WORDS:
        raise _changed(f"the CPU generator's state layout ({state.numel()} bytes, "
                       f"expected {CPU_GENERATOR_STATE_BYTES})", "giving fresh generators a full random state")
    state = state.clone()
    # 'left' stays 1, so the next draw regenerates the twister from exactly these words.
    state[_MT_OFFSET:_MT_OFFSET + 8 * _MT_WORDS] = (words.to(torch.int64) & 0xFFFFFFFF).view(torch.uint8)
    generator.set_state(state)


# ---------------------------------------------------------------------------- cuDNN
_cudnn_lock = threading.Lock()
_cudnn_holders = [0, None]  # how many forwards hold cuDNN off, and the flag before the first


@contextlib.contextmanager
def cudnn_disabled():
    """cuDNN off for the body (``torch.backends.cudnn.enabled``), for the recurrent rule's
    stacked-dropout forwards on CUDA, whose dropout masks cuDNN draws where nothing can
    replay them.

    The flag is process-wide: other threads see cuDNN off while the body runs (their
    results stay correct; their kernels are PyTorch's own instead of cuDNN's). Concurrent
    holders are counted under a lock, so the flag comes back to what it was before the
    first of them however they interleave. If anyone turns cuDNN back on while a holder
    runs, the masks of that forward may be cuDNN's and could not be replayed: the holder
    raises instead of returning gradients computed with other masks."""
    with _cudnn_lock:
        if _cudnn_holders[0] == 0:
            _cudnn_holders[1] = torch.backends.cudnn.enabled
        _cudnn_holders[0] += 1
        torch.backends.cudnn.enabled = False
    try:
        yield
        still_off = not torch.backends.cudnn.enabled
    finally:
        with _cudnn_lock:
            _cudnn_holders[0] -= 1
            if _cudnn_holders[0] == 0:
                torch.backends.cudnn.enabled = _cudnn_holders[1]
    if not still_off:
        raise RuntimeError(
            "torch.backends.cudnn.enabled was turned back on (by another thread?) while a recurrent "
            "layer with dropout between its stacked layers ran with cuDNN off: cuDNN's dropout masks "
            "cannot be replayed, so per-example gradients cannot be computed. Do not toggle cuDNN "
            "while such a layer runs, or use single-layer modules with nn.Dropout between them."
        )


# ---------------------------------------------------------------------------- pytree
def tree_flatten(obj):
    """``torch.utils._pytree.tree_flatten``: leaves and a spec (no public pytree module
    exists in PyTorch 2.13). Used to rebuild an op's arguments with some tensors replaced."""
    from torch.utils import _pytree

    return _require(_pytree, "tree_flatten", "torch.utils._pytree.tree_flatten", "walking nested arguments")(obj)


def tree_unflatten(leaves, spec):
    """``torch.utils._pytree.tree_unflatten``, the inverse of :func:`tree_flatten`."""
    from torch.utils import _pytree

    return _require(_pytree, "tree_unflatten", "torch.utils._pytree.tree_unflatten",
                    "walking nested arguments")(leaves, spec)


def torch_function_subclass_disabled():
    """``torch._C.DisableTorchFunctionSubclass()``: run torch functions on a tensor subclass
    without dispatching to its ``__torch_function__`` (how the subclass itself computes)."""
    return _require(torch._C, "DisableTorchFunctionSubclass", "torch._C.DisableTorchFunctionSubclass",
                    "tracking lookups shared by the whole batch")()


def foreach_div_(tensors: list, value: float) -> None:
    """``torch._foreach_div_``: divide each tensor in place by ``value`` in one call."""
    if tensors:
        _require(torch, "_foreach_div_", "torch._foreach_div_", "dividing the noisy sums")(tensors, value)
