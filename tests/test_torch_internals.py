"""Every private PyTorch internal dpoptim relies on (dpoptim._torch), checked against the
installed PyTorch: if one changes, a test here fails with its name, and the function
behind it raises TorchInternalChanged instead of returning something wrong."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpoptim import _torch


_PRIVATE = {"_version", "_BatchNorm", "_DropoutNd", "_parameters", "_saved_output", "_per_optimizer_states",
            "_scale", "_qkv_same_embed_dim", "_reversed_padding_repeated_twice", "_get_no_batch_dim",
            "_execution_engine", "_pytree", "_C", "_dynamo", "_foreach_div_"}


def test_every_internal_use_goes_through_the_module():
    """No other file of the package reaches for a private torch name directly (read from
    the syntax tree: attribute accesses, imports, and ``torch.backends.cudnn.enabled = ...``)."""
    import ast
    import pathlib

    root = pathlib.Path(_torch.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "_torch.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            bad = None
            if isinstance(node, ast.Attribute) and node.attr in _PRIVATE:
                bad = node.attr
            elif isinstance(node, ast.ImportFrom) and node.module and any(
                    part.startswith("_") for part in node.module.split(".")) and node.module.startswith("torch"):
                bad = node.module
            elif isinstance(node, ast.Assign) and any(
                    isinstance(t, ast.Attribute) and t.attr == "enabled" for t in node.targets):
                bad = "a process-wide flag"
            if bad:
                offenders.append(f"{path.relative_to(root)}:{node.lineno}: {bad}")
    assert not offenders, "private torch internals used outside dpoptim/_torch.py:\n" + "\n".join(offenders)


def test_graph_task_id_tells_backward_calls_apart():
    assert _torch.graph_task_id() == -1 and not _torch.in_backward()
    seen = []
    x = torch.ones(2, requires_grad=True)

    def hook(grad):
        seen.append((_torch.graph_task_id(), _torch.in_backward()))
        return grad

    for _ in range(2):
        y = (x * 2).sum()
        y.register_hook(hook)
        y.backward()
    (first, inside1), (second, inside2) = seen
    assert inside1 and inside2 and first != -1 and second != -1 and first != second


def test_queue_end_of_backward_runs_after_the_gradients():
    x = torch.ones(3, requires_grad=True)
    order = []

    def hook(grad):
        order.append("hook")
        _torch.queue_end_of_backward(lambda: order.append(("end", x.grad is not None)))
        return grad

    y = (x * 3).sum()
    y.register_hook(hook)
    y.backward()
    assert order == ["hook", ("end", True)]


def test_compiled_wrapper_is_recognised():
    pytest.importorskip("torch._dynamo")
    model = nn.Linear(2, 2)
    assert _torch.is_compiled_wrapper(torch.compile(model))
    assert not _torch.is_compiled_wrapper(model)


def test_version_counter_counts_in_place_changes():
    t = torch.zeros(3)
    before = _torch.version_counter(t)
    t.add_(1)
    assert _torch.version_counter(t) == before + 1
    t.zero_()
    assert _torch.version_counter(t) == before + 2


def test_batch_norm_and_dropout_bases():
    for cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LazyBatchNorm1d):
        assert _torch.is_batch_norm(cls(4) if cls is not nn.LazyBatchNorm1d else cls())
    assert not _torch.is_batch_norm(nn.GroupNorm(2, 4)) and not _torch.is_batch_norm(nn.InstanceNorm1d(4))
    for cls in (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout):
        assert _torch.is_dropout(cls(0.1))
    assert not _torch.is_dropout(nn.Linear(2, 2))


def test_own_parameters_is_what_forward_reads():
    layer = nn.Linear(3, 2)
    params = _torch.own_parameters(layer)
    assert set(params) == {"weight", "bias"} and params["weight"] is layer.weight
    x = torch.randn(4, 3)
    expected = layer(x)
    detached = layer.weight.detach()
    params["weight"] = detached  # what ghost differentiation does for one forward
    try:
        assert layer.weight is detached
        out = layer(x)
        assert torch.equal(out, expected.detach())
        out.sum().backward()
        assert layer.weight.grad is None and params["bias"].grad is not None
    finally:
        params["weight"] = nn.Parameter(expected.new_zeros(2, 3))


def test_module_internals_match_their_public_meaning():
    inorm = nn.InstanceNorm2d(3)
    assert _torch.no_batch_dim(inorm) == 3  # [C, H, W] is unbatched
    conv = nn.Conv2d(1, 1, (3, 5), padding=(1, 2), padding_mode="reflect")
    pads = _torch.conv_explicit_padding(conv)
    x = torch.randn(1, 1, 6, 7)
    expected = F.conv2d(F.pad(x, (2, 2, 1, 1), mode="reflect"), conv.weight, conv.bias)
    assert pads == [2, 2, 1, 1] and torch.allclose(conv(x), expected, atol=1e-6)
    assert _torch.mha_packed_projection(nn.MultiheadAttention(4, 2)) is True
    assert _torch.mha_packed_projection(nn.MultiheadAttention(4, 2, kdim=3, vdim=5)) is False


def test_grad_scaler_protocol():
    """Reporting no overflow keeps update() from backing off, on an optimizer whose
    gradients overflowed."""
    param = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2**31 - 1)
    (scaler.scale(param.sum()) * float("inf")).backward()
    scaler.unscale_(opt)
    assert _torch.grad_scaler_scale(scaler) is not None
    _torch.grad_scaler_report_no_overflow(scaler, opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**10
    # And without the report, torch backs off: the protocol is what keeps the scale fixed.
    param.grad = None
    (scaler.scale(param.sum()) * float("inf")).backward()
    scaler.unscale_(opt)
    scaler.update()
    assert scaler.get_scale() < 2.0**10


def test_grad_scaler_lookalike_is_refused():
    class Lookalike:
        pass

    with pytest.raises(_torch.TorchInternalChanged, match="does not know how this Lookalike records overflows"):
        _torch.grad_scaler_report_no_overflow(Lookalike(), object())


def test_fused_attention_node():
    q, k, v = (torch.randn(2, 3, 5, 4, requires_grad=True) for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v)
    node = out.grad_fn
    if not _torch.is_fused_attention_node(node):
        pytest.skip(f"no fused CPU attention kernel here ({type(node).__name__})")
    saved = _torch.fused_attention_output(node)
    assert saved is not None and torch.equal(saved, out)
    grads = {}
    node.register_hook(lambda grad_inputs, grad_outputs: grads.setdefault("g", grad_inputs))
    d_out = torch.randn_like(out)
    expected = torch.autograd.grad(out, (q, k, v), d_out)
    assert _torch.FUSED_ATTENTION_GRAD_ORDER == ("query", "key", "value")
    for got, want in zip(grads["g"][:3], expected):
        torch.testing.assert_close(got, want)


def test_fused_attention_probe_refuses_a_changed_node(monkeypatch):
    q = torch.randn(1, 1, 3, 4, requires_grad=True)
    out = F.scaled_dot_product_attention(q, q, q)
    if not _torch.is_fused_attention_node(out.grad_fn):
        pytest.skip("no fused CPU attention kernel here")
    monkeypatch.setattr(_torch, "_checked_attention", {type(out.grad_fn).__name__: False})
    with pytest.raises(_torch.TorchInternalChanged, match="order of its gradients"):
        _torch.fused_attention_output(out.grad_fn)


def test_saved_tensor_hooks_are_seen():
    assert _torch.saved_tensor_hooks_active() is False
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert _torch.saved_tensor_hooks_active() is True


def _mt19937_words(seed: int) -> list[int]:
    """The Mersenne Twister's initial state for ``seed`` (Matsumoto & Nishimura 1998)."""
    words = [seed & 0xFFFFFFFF]
    for i in range(1, 624):
        prev = words[-1]
        words.append((1812433253 * (prev ^ (prev >> 30)) + i) & 0xFFFFFFFF)
    return words


def test_cpu_generator_byte_layout():
    generator = torch.Generator().manual_seed(12345)
    state = generator.get_state()
    assert state.numel() == _torch.CPU_GENERATOR_STATE_BYTES
    stored = state[24:24 + 8 * 624].view(torch.int64).tolist()
    assert stored == _mt19937_words(12345)
    # Writing the words back through the helper gives exactly the manually seeded stream.
    fresh = torch.Generator()
    _torch.set_cpu_generator_words(fresh, torch.tensor(_mt19937_words(12345), dtype=torch.int64))
    reference = torch.Generator().manual_seed(12345)
    assert torch.equal(torch.randn(100, generator=fresh), torch.randn(100, generator=reference))


def test_cpu_generator_layout_change_is_refused():
    with pytest.raises(_torch.TorchInternalChanged, match="state layout"):
        _torch.set_cpu_generator_words(torch.Generator(), torch.zeros(10, dtype=torch.int32))


def test_cudnn_disabled_restores_the_flag_under_concurrency():
    before = torch.backends.cudnn.enabled
    barrier = threading.Barrier(4)
    errors = []

    def worker():
        try:
            for _ in range(50):
                with _torch.cudnn_disabled():
                    barrier.wait(timeout=5) if _ == 0 else None
                    assert torch.backends.cudnn.enabled is False
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert torch.backends.cudnn.enabled == before


def test_cudnn_turned_on_meanwhile_is_refused():
    before = torch.backends.cudnn.enabled
    with pytest.raises(RuntimeError, match="turned back on"):
        with _torch.cudnn_disabled():
            torch.backends.cudnn.enabled = True  # what another thread might do
    assert torch.backends.cudnn.enabled == before


def test_pytree_round_trip():
    from collections import OrderedDict, namedtuple

    Pair = namedtuple("Pair", "a b")
    obj = ((torch.ones(1), [2, {"x": torch.zeros(2)}]), {"k": Pair(torch.ones(3), "s"), "o": OrderedDict(z=1)})
    leaves, spec = _torch.tree_flatten(obj)
    assert sum(isinstance(x, torch.Tensor) for x in leaves) == 3
    rebuilt = _torch.tree_unflatten(leaves, spec)
    assert type(rebuilt[1]["k"]) is Pair and rebuilt[1]["k"].b == "s" and rebuilt[0][1][0] == 2


def test_torch_function_subclass_disabled():
    calls = []

    class Sub(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    t = torch.ones(2).as_subclass(Sub)
    with _torch.torch_function_subclass_disabled():
        t + 1
    assert not calls
    t + 1
    assert calls


def test_foreach_div():
    a, b = torch.full((2,), 6.0), torch.full((3,), 9.0)
    _torch.foreach_div_([a, b], 3.0)
    assert torch.equal(a, torch.full((2,), 2.0)) and torch.equal(b, torch.full((3,), 3.0))
    _torch.foreach_div_([], 3.0)  # nothing to do
