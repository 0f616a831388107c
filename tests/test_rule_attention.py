"""nn.MultiheadAttention and the Transformer layers built on it against the brute-force oracle.

The rule has two routes to the attention's internals: it reads them from the fused
attention kernel's autograd node when PyTorch ran one (``tapped``), and replays the
attention otherwise (``replayed``). The oracle tests run both."""

import contextlib
import copy
from unittest import mock

import pytest
import torch
from hypothesis import assume, given, strategies as st
from torch import nn
from torch.utils.checkpoint import checkpoint

import dpoptim
from dpoptim.rules import attention
from oracle import assert_loss_falls, check_rule_case, clipped_sum, dp_clipped_sum, generator_states, mse, per_example_gradients

F64 = torch.float64
ROUTES = st.sampled_from(["tapped", "replayed"])


@contextlib.contextmanager
def attention_route(route):
    """``replayed``: the rule never taps the fused kernel, so it recomputes the attention."""
    if route == "tapped":
        yield
        return
    with mock.patch.object(attention, "_tap_attention_kernel", lambda *args: None):
        yield


def _randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=F64)


attention_configs = st.fixed_dictionaries({
    "shape": st.sampled_from([(4, 1), (4, 2), (6, 3), (8, 2)]),  # (embed_dim, num_heads)
    "inputs": st.sampled_from(["self", "shared_kv", "cross", "kdim_vdim"]),
    "bias": st.booleans(),
    "add_bias_kv": st.booleans(),
    "add_zero_attn": st.booleans(),
    "batch_first": st.booleans(),
    "padding_mask": st.sampled_from([None, "bool", "float"]),
    "attn_mask": st.sampled_from([None, "2d", "3d", "bool", "causal"]),
    "need_weights": st.booleans(),
    "average": st.booleans(),
    "weights_in_loss": st.booleans(),
    "n": st.integers(0, 3),
    "L": st.integers(1, 4),
    "S": st.integers(1, 4),
    "reduction": st.sampled_from(["mean", "sum"]),
    "dropout": st.sampled_from([0.0, 0.0, 0.4]),
})


@given(cfg=attention_configs, seed=st.integers(0, 2**16), route=ROUTES)
def test_multihead_attention_matches_oracle(cfg, seed, route):
    E, heads = cfg["shape"]
    g = torch.Generator().manual_seed(seed)
    n, L = cfg["n"], cfg["L"]
    S = cfg["S"] if cfg["inputs"] in ("cross", "kdim_vdim") else L
    kdim, vdim = (3, 5) if cfg["inputs"] == "kdim_vdim" else (None, None)
    bf = cfg["batch_first"]
    causal = cfg["attn_mask"] == "causal"
    padding, mask_kind = cfg["padding_mask"], cfg["attn_mask"]
    if mask_kind in ("bool", "causal") and padding == "float" or mask_kind in ("2d", "3d") and padding == "bool":
        padding = None  # PyTorch wants both masks of one kind

    def make():
        return nn.MultiheadAttention(E, heads, bias=cfg["bias"], add_bias_kv=cfg["add_bias_kv"],
                                     add_zero_attn=cfg["add_zero_attn"], kdim=kdim, vdim=vdim,
                                     batch_first=bf, dropout=cfg["dropout"]).double()

    # Inputs in the order forward() takes them, each with its batch dimension.
    seq = lambda T, d: _randn(g, n, T, d) if bf else _randn(g, T, n, d)  # noqa: E731
    inputs, dims = [seq(L, E)], [0 if bf else 1]
    if cfg["inputs"] == "shared_kv":
        inputs.append(seq(S, E)), dims.append(0 if bf else 1)
    elif cfg["inputs"] in ("cross", "kdim_vdim"):
        inputs += [seq(S, kdim or E), seq(S, vdim or E)]
        dims += [0 if bf else 1] * 2
    if padding is not None:
        ignored = torch.rand(n, S, generator=g) < 0.4
        ignored[:, 0] = False  # every query keeps a key: no all -inf row
        inputs.append(ignored if padding == "bool" else torch.where(ignored, -1e9, 0.0).double() + _randn(g, n, S))
        dims.append(0)
    shared_mask = None
    if mask_kind == "3d":
        inputs.append(_randn(g, n, heads, L, S)), dims.append(0)
    elif mask_kind == "2d":
        shared_mask = _randn(g, L, S)
    elif mask_kind in ("bool", "causal"):
        shared_mask = torch.ones(L, S, dtype=torch.bool).triu(1)  # key 0 is always allowed

    def forward(m, query, *rest):
        rest = list(rest)
        key = value = query
        if cfg["inputs"] == "shared_kv":
            key = value = rest.pop(0)
        elif cfg["inputs"] in ("cross", "kdim_vdim"):
            key, value = rest.pop(0), rest.pop(0)
        key_padding_mask = rest.pop(0) if padding is not None else None
        attn_mask = shared_mask
        if mask_kind == "3d":
            attn_mask = rest.pop(0).flatten(0, 1)  # [n * heads, L, S]
        out, weights = m(query, key, value, key_padding_mask=key_padding_mask, need_weights=cfg["need_weights"],
                         attn_mask=attn_mask, average_attn_weights=cfg["average"], is_causal=causal)
        parts = [(out if bf else out.transpose(0, 1)).flatten(1)]
        if cfg["need_weights"] and cfg["weights_in_loss"]:
            parts.append(weights.flatten(1))
        return torch.cat(parts, 1)

    try:
        width = forward(make(), *inputs).shape[1]
    except RuntimeError:
        assume(n > 0)  # PyTorch itself cannot run some masks on an empty batch
        raise
    y = _randn(g, n, width)
    with attention_route(route):
        check_rule_case(make, tuple(inputs), y, forward, mse, batch_dims=tuple(dims), reduction=cfg["reduction"],
                        random=cfg["dropout"] > 0)


def _freeze_norms_without_rule(model):
    """LayerNorm has its own rule (rules/norm.py); without it, freeze the norms so the test
    still isolates attention."""
    if dpoptim.rule_for(nn.LayerNorm(2)) is None:
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.requires_grad_(False)
    return model


transformer_configs = st.fixed_dictionaries({
    "layer": st.sampled_from(["encoder", "decoder", "transformer"]),
    "norm_first": st.booleans(),
    "activation": st.sampled_from(["relu", "gelu"]),
    "bias": st.booleans(),
    "masks": st.booleans(),
    "dropout": st.sampled_from([0.0, 0.3]),
    "n": st.integers(1, 3),
    "T": st.integers(1, 3),
})


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@given(cfg=transformer_configs, seed=st.integers(0, 2**16), route=ROUTES)
def test_transformer_layers_match_oracle(cfg, seed, route):
    """Batch-first only: the layers' Linear and LayerNorm rules read examples from dim 0."""
    d, heads, T, n, bf = 4, 2, cfg["T"], cfg["n"], True
    g = torch.Generator().manual_seed(seed)
    common = dict(dim_feedforward=6, dropout=cfg["dropout"], activation=cfg["activation"], batch_first=bf,
                  norm_first=cfg["norm_first"], bias=cfg["bias"])

    def make():
        if cfg["layer"] == "encoder":
            layer = nn.TransformerEncoderLayer(d, heads, **common)
        elif cfg["layer"] == "decoder":
            layer = nn.TransformerDecoderLayer(d, heads, **common)
        else:
            layer = nn.Transformer(d, heads, num_encoder_layers=1, num_decoder_layers=1, **common)
        return _freeze_norms_without_rule(layer.double())

    seq = lambda: _randn(g, n, T, d) if bf else _randn(g, T, n, d)  # noqa: E731
    inputs, dims = (seq(), seq()), (0 if bf else 1,) * 2
    causal = nn.Transformer.generate_square_subsequent_mask(T, dtype=F64) if cfg["masks"] else None
    padding = torch.zeros(n, T, dtype=torch.bool)
    if cfg["masks"] and T > 1:
        padding[:, -1] = torch.rand(n, generator=g) < 0.5

    def forward(m, src, tgt, pad):
        pad = pad if cfg["masks"] else None
        if cfg["layer"] == "encoder":
            out = m(src, src_mask=causal, src_key_padding_mask=pad, is_causal=cfg["masks"])
        elif cfg["layer"] == "decoder":
            out = m(tgt, src, tgt_mask=causal, memory_key_padding_mask=pad, tgt_is_causal=cfg["masks"])
        else:
            out = m(src, tgt, tgt_mask=causal, src_key_padding_mask=pad, memory_key_padding_mask=pad)
        return (out if bf else out.transpose(0, 1)).flatten(1)

    inputs, dims = inputs + (padding,), dims + (0,)
    y = _randn(g, n, T * d)
    with attention_route(route):
        check_rule_case(make, inputs, y, forward, mse, batch_dims=dims, random=cfg["dropout"] > 0)


def _encoder_layer():
    return nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True).double()


def test_stock_encoder_layer_reads_the_fused_kernel():
    """A Transformer layer (attention without returned weights or CPU dropout) runs one of
    PyTorch's fused attention kernels; the rule takes A, dq, dk, dv from it and never
    replays, on the first (checked) step and the later (ghost) ones alike."""
    g = torch.Generator().manual_seed(14)
    x, y = _randn(g, 4, 5, 8), _randn(g, 4, 40)
    replay = mock.patch.object(attention.MultiheadAttentionRule, "_replay", side_effect=AssertionError("replayed"))
    with replay:
        check_rule_case(_encoder_layer, (x,), y, lambda m, x: m(x).flatten(1), mse)


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_is_exact(reentrant):
    """torch.utils.checkpoint recomputes the forward (hooks and all) in the backward; the
    clipped sums stay the oracle's. The oracle runs without checkpointing: the reentrant
    variant supports backward() only, not the oracle's torch.autograd.grad."""
    g = torch.Generator().manual_seed(15)
    x, y = _randn(g, 4, 5, 8), _randn(g, 4, 40)
    torch.manual_seed(0)
    model = _encoder_layer()
    reference = [p.detach().clone() for p in model.parameters()]
    grads = per_example_gradients(copy.deepcopy(model), (x,), y, lambda m, x: m(x).flatten(1), mse)
    expected, _ = clipped_sum(grads, 0.5, list(model.parameters()))

    def forward(m, x):
        return checkpoint(m, x.detach().requires_grad_(), use_reentrant=reentrant).flatten(1)

    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=0.0, max_grad_norm=0.5,
                        expected_batch_size=1, sample_rate=0.5)
    for attempt in ("first step", "later step"):
        got = dp_clipped_sum(model, [((x,), y)], 0.5, forward, mse, optimizer=opt)
        for e, g_ in zip(expected, got):
            torch.testing.assert_close(g_, e, rtol=1e-7, atol=1e-12, msg=attempt)
        with torch.no_grad():
            for p, r in zip(model.parameters(), reference):
                p.copy_(r)


@pytest.mark.parametrize("layer", ["encoder", "decoder"])
def test_sequence_first_transformer_layers_are_refused(layer):
    cls = nn.TransformerEncoderLayer if layer == "encoder" else nn.TransformerDecoderLayer
    model = cls(4, 2, dim_feedforward=8, dropout=0.0)
    opt = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=2, sample_rate=0.1)
    x = torch.randn(3, 2, 4)
    with pytest.raises(ValueError, match="batch_first=True"):
        model(x) if layer == "encoder" else model(x, x)
    del opt


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("need_weights", [False, True])
def test_cuda_attention_matches_oracle(need_weights):
    g = torch.Generator().manual_seed(8)
    cuda = torch.device("cuda")
    x = _randn(g, 3, 4, 8).to(cuda)
    y = _randn(g, 3, 32).to(cuda)
    mask = torch.ones(4, 4, dtype=torch.bool, device=cuda).triu(1)

    def forward(m, x):
        return m(x, x, x, attn_mask=mask, need_weights=need_weights, is_causal=True)[0].flatten(1)

    make = lambda: nn.MultiheadAttention(8, 2, batch_first=True).double().to(cuda)  # noqa: E731
    check_rule_case(make, (x,), y, forward, mse)


def test_attention_called_twice_with_accumulation():
    """Splits into micro-batches; the module is also used twice per forward (shared)."""
    g = torch.Generator().manual_seed(3)
    x = _randn(g, 5, 3, 4)
    y = _randn(g, 5, 12)

    def forward(m, x):
        h, _ = m(x, x, x, need_weights=False)
        h, _ = m(h, x, x)
        return h.flatten(1)

    make = lambda: nn.MultiheadAttention(4, 2, batch_first=True, add_bias_kv=True).double()  # noqa: E731
    check_rule_case(make, (x,), y, forward, mse, splits=[2, 0, 3])


@pytest.mark.parametrize("frozen", ["in_proj_weight", "out_proj"])
def test_partly_frozen_attention(frozen):
    g = torch.Generator().manual_seed(10)
    x = _randn(g, 4, 3, 4)
    y = _randn(g, 4, 12)

    def make():
        m = nn.MultiheadAttention(4, 2, batch_first=True).double()
        if frozen == "out_proj":
            m.out_proj.requires_grad_(False)
        else:
            m.in_proj_weight.requires_grad_(False)
        return m

    check_rule_case(make, (x,), y, lambda m, x: m(x, x, x)[0].flatten(1), mse)


def test_attention_dropout_masks_are_the_forwards():
    """A stock encoder layer (attention dropout 0.1) against the same-randomness oracle, and
    a control: the masks matter, so a rule that ignored them could not pass."""
    g = torch.Generator().manual_seed(12)
    x, y = _randn(g, 6, 5, 8), _randn(g, 6, 40)
    make = lambda: nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True).double()  # noqa: E731
    forward = lambda m, x: m(x).flatten(1)  # noqa: E731
    clip = check_rule_case(make, (x,), y, forward, mse, random=True)

    def without_attention_dropout():
        layer = make()
        layer.self_attn.dropout = 0.0
        return layer

    with pytest.raises(AssertionError, match="differs from the per-example oracle"):
        # the oracle draws attention masks; this model does not: they must disagree
        torch.manual_seed(0)
        rng = generator_states()
        reference = make()
        grads = per_example_gradients(reference, (x,), y, forward, mse, rng=rng)
        expected, _ = clipped_sum(grads, clip, list(reference.parameters()))
        got = dp_clipped_sum(without_attention_dropout(), [((x,), y)], clip, forward, mse, rng=rng)
        assert all(torch.allclose(e, g_) for e, g_ in zip(expected, got)), "differs from the per-example oracle"


def test_unbatched_attention_is_refused():
    mha = nn.MultiheadAttention(4, 2)
    opt = dpoptim.DPSGD(mha.parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=2, sample_rate=0.1)
    with pytest.raises(ValueError, match="batch dimension"):
        mha(torch.randn(3, 4), torch.randn(3, 4), torch.randn(3, 4))
    del opt


@pytest.mark.filterwarnings("ignore::dpoptim.PrivacyWarning")  # fixed-size batches, not Poisson
def test_transformer_training_with_noise_lowers_the_loss():
    """Copy task: predict each token of a random sequence from a causal encoder."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    vocab, d, T = 8, 16, 6

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.position = nn.Embedding(T, d)
            layer = nn.TransformerEncoderLayer(d, 2, dim_feedforward=32, dropout=0.1, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 1, enable_nested_tensor=False)
            self.head = nn.Linear(d, vocab)

        def forward(self, tokens):
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)  # per example, so its rule sees the batch
            h = self.embed(tokens) + self.position(positions)
            return self.head(self.encoder(h))

    model = _freeze_norms_without_rule(Model())
    if dpoptim.rule_for(model.embed) is None:
        model.embed.requires_grad_(False)
        model.position.requires_grad_(False)
    opt = dpoptim.DPAdam([p for p in model.parameters() if p.requires_grad], lr=0.01, noise_multiplier=0.3,
                         max_grad_norm=1.0, expected_batch_size=64, sample_rate=0.01,
                         generator=torch.Generator().manual_seed(1))
    def batch():
        tokens = torch.randint(vocab, (64, T), generator=g)
        return tokens, tokens

    def copy_loss(logits, tokens):
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten())

    assert_loss_falls(model, opt, batch, copy_loss, steps=40)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("route", ["tapped", "replayed"])
def test_cuda_attention_dropout_matches_oracle(dtype, route):
    """Tapped, the fused kernel's backward regenerates its own mask. Replayed, the rule calls
    the kernel the forward called, from the CUDA generator's state before the forward."""
    g = torch.Generator().manual_seed(13)
    cuda = torch.device("cuda")
    x, y = _randn(g, 5, 6, 8).to(cuda, dtype), _randn(g, 5, 48).to(cuda, dtype)
    make = lambda: nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, batch_first=True).to(cuda, dtype)  # noqa: E731
    with attention_route(route):
        check_rule_case(make, (x,), y, lambda m, x: m(x).flatten(1), mse, random=True,
                        rtol=1e-7 if dtype == torch.float64 else 1e-3)


def test_a_route_first_taken_after_the_first_step_is_checked_against_autograd(monkeypatch):
    """The replayed attention first taken on step 2 (weights returned from then on) is
    compared with autograd there: a wrong replay is an error, not a silent gradient."""
    from dpoptim import verify
    from dpoptim.rules.attention import MultiheadAttentionRule

    monkeypatch.setattr(verify, "_VERIFIED", set())
    attn = nn.MultiheadAttention(4, 2, batch_first=True).double()
    opt = dpoptim.DPSGD(attn.parameters(), lr=0.1, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=3, sample_rate=0.5)
    x = torch.randn(3, 5, 4, dtype=torch.float64)

    def step(need_weights):
        opt.zero_grad()
        out, weights = attn(x, x, x, need_weights=need_weights)
        (out.square().sum() + (0 if weights is None else weights.sum())).backward()
        opt.step()

    step(False)
    step(False)
    routes = {route for _, route in verify._VERIFIED}
    original = MultiheadAttentionRule._replay

    def wrong(self, *args, **kwargs):
        A, d_heads = original(self, *args, **kwargs)
        return A * 1.5, d_heads

    monkeypatch.setattr(MultiheadAttentionRule, "_replay", wrong)
    with pytest.raises(dpoptim.UnsupportedLayerError, match="for the first time"):
        step(True)
    monkeypatch.setattr(MultiheadAttentionRule, "_replay", original)
    step(True)  # the right replay passes, and its route is known from then on
    assert len({route for _, route in verify._VERIFIED}) > len(routes)
