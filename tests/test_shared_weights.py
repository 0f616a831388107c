"""Shared parameters: tied weights and modules called several times in one forward pass.

Example i's gradient of a shared parameter is the sum over its uses, ``g_i = sum_u g_i^u``,
so ``||g_i||^2 = sum_u ||g_i^u||^2 + sum_{u != v} <g_i^u, g_i^v>``: the cross terms count.
Every case here is checked against the per-example oracle, which knows nothing of uses.
"""

import contextlib

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn

import dpoptim
import dpoptim.rules.attention  # noqa: F401  (registers the rules until dpoptim.rules imports them)
import dpoptim.rules.rnn  # noqa: F401
from dpoptim import cost as dp_cost, engine as dp_engine
from oracle import check_rule_case, mse, per_example_gradients

F64 = torch.float64
ROUTES = pytest.mark.parametrize("route", ["terms", "materialized"])


@contextlib.contextmanager
def shared_route(route):
    """Force how shared parameters get their cross terms: from the rules' factored terms
    whatever the cost ('terms'), or from materialised per-example gradients."""
    limit, shared_terms = dp_cost.MATERIALIZE_LIMIT, dp_engine.GradEngine._shared_terms
    try:
        if route == "terms":
            dp_cost.MATERIALIZE_LIMIT = -1
        else:
            dp_engine.GradEngine._shared_terms = lambda self, uses, counts: {}
        yield
    finally:
        dp_cost.MATERIALIZE_LIMIT, dp_engine.GradEngine._shared_terms = limit, shared_terms


def _randn(g, *shape):
    return torch.randn(*shape, generator=g, dtype=F64)


@given(n=st.integers(0, 4), rows=st.integers(1, 3), calls=st.integers(2, 3), d=st.integers(1, 4),
       bias=st.booleans(), reduction=st.sampled_from(["mean", "sum"]), seed=st.integers(0, 2**16))
@ROUTES
def test_linear_called_several_times(route, n, rows, calls, d, bias, reduction, seed):
    g = torch.Generator().manual_seed(seed)
    x = _randn(g, n, rows, d)
    y = _randn(g, n, rows * d)

    def forward(m, x):
        for _ in range(calls):
            x = torch.tanh(m(x))
        return x.flatten(1)

    with shared_route(route):
        check_rule_case(lambda: nn.Linear(d, d, bias=bias).double(), (x,), y, forward, mse, reduction=reduction)


def test_cancelling_uses_give_zero_gradient():
    """``W x - W x``: each use has a large gradient, their sum is zero. Without the cross
    terms the norm would be large and the example clipped; with them nothing is clipped."""
    g = torch.Generator().manual_seed(0)
    x = _randn(g, 3, 4)
    y = _randn(g, 3, 2)
    model = nn.Linear(4, 2, bias=False).double()
    before = model.weight.detach().clone()
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=0.0, max_grad_norm=1e-3,
                        expected_batch_size=1, sample_rate=0.5)
    loss = mse(model(x) - model(x) + 0 * y, y).sum()
    loss.backward()
    opt.step()
    assert torch.equal(model.weight.detach(), before)


class TiedLanguageModel(nn.Module):
    """Embedding reused as the output projection (Press & Wolf 2017, "Using the output
    embedding to improve language models"), with a sequence layer in between."""

    def __init__(self, vocab, d, body, padding_idx=None):
        super().__init__()
        self.embed = nn.Embedding(vocab, d, padding_idx=padding_idx)
        self.body = body
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.embed(tokens)
        if isinstance(self.body, nn.LSTM):
            h, _ = self.body(h)
        elif isinstance(self.body, nn.MultiheadAttention):
            h, _ = self.body(h, h, h, need_weights=False)
        else:
            h = self.body(h)
        return self.head(h)


needs_embedding_rule = pytest.mark.skipif(
    dpoptim.rule_for(nn.Embedding(2, 2)) is None, reason="no rule for nn.Embedding is registered"
)


@needs_embedding_rule
@given(
    body=st.sampled_from(["tanh", "lstm", "attention"]),
    n=st.integers(0, 3),
    T=st.integers(1, 4),
    padding=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
@ROUTES
def test_tied_embedding_and_output_projection(route, body, n, T, padding, reduction, seed):
    vocab, d = 7, 4
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab, (n, T), generator=g)
    y = _randn(g, n, T * vocab)

    def make():
        layer = {"tanh": lambda: nn.Tanh(),
                 "lstm": lambda: nn.LSTM(d, d, batch_first=True),
                 "attention": lambda: nn.MultiheadAttention(d, 2, batch_first=True)}[body]()
        return TiedLanguageModel(vocab, d, layer, padding_idx=0 if padding else None).double()

    with shared_route(route):
        check_rule_case(make, (tokens,), y, lambda m, t: m(t).flatten(1), mse, reduction=reduction)


@given(
    kind=st.sampled_from(["lstm", "gru", "rnn"]),
    batch_first=st.booleans(),
    n=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
@ROUTES
def test_recurrent_module_called_twice(route, kind, batch_first, n, seed):
    """One LSTM reads two segments, the second starting from the first's final state."""
    g = torch.Generator().manual_seed(seed)
    T, d, H = 3, 2, 3
    shape = (n, T, d) if batch_first else (T, n, d)
    a, b = _randn(g, *shape), _randn(g, *shape)
    y = _randn(g, n, 2 * H)
    cls = {"lstm": nn.LSTM, "gru": nn.GRU, "rnn": nn.RNN}[kind]

    def forward(m, a, b):
        _, state = m(a)
        _, state = m(b, state)
        h = state[0] if kind == "lstm" else state
        c = state[1] if kind == "lstm" else state
        return torch.cat([h[0], c[0]], 1)

    dims = (0, 0) if batch_first else (1, 1)
    with shared_route(route):
        check_rule_case(lambda: cls(d, H, batch_first=batch_first).double(), (a, b), y, forward, mse, batch_dims=dims)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@ROUTES
def test_transformer_layer_shared_across_depth(route):
    """ALBERT-style: one encoder layer applied three times."""
    g = torch.Generator().manual_seed(4)
    x = _randn(g, 4, 3, 4)
    y = _randn(g, 4, 12)

    def make():
        layer = nn.TransformerEncoderLayer(4, 2, dim_feedforward=6, dropout=0.0, batch_first=True).double()
        if dpoptim.rule_for(nn.LayerNorm(2)) is None:
            layer.norm1.requires_grad_(False)
            layer.norm2.requires_grad_(False)
        return layer

    def forward(m, x):
        for _ in range(3):
            x = m(x)
        return x.flatten(1)

    with shared_route(route):
        check_rule_case(make, (x,), y, forward, mse, splits=[1, 3])


def test_cross_terms_change_the_norm():
    """Guard against a vacuous test: for a twice-used layer, the squared norm of the summed
    gradient differs from the sum of the uses' squared norms."""
    import copy

    g = torch.Generator().manual_seed(5)
    x = _randn(g, 3, 4)
    y = _randn(g, 3, 4)
    first = nn.Linear(4, 4).double()
    model = nn.Sequential(first, nn.Tanh(), copy.deepcopy(first))  # two copies: one per use
    grads = per_example_gradients(model, (x,), y, lambda m, x: m(x), mse)
    for g1w, g1b, g2w, g2b in grads:
        summed = (g1w + g2w).square().sum() + (g1b + g2b).square().sum()
        separate = sum(t.square().sum() for t in (g1w, g1b, g2w, g2b))
        assert abs(float(summed - separate)) > 1e-3 * float(separate)


@needs_embedding_rule
def test_tied_embedding_is_never_materialised(monkeypatch):
    """A tied vocabulary matrix per example is [n, V, d]: the factored route gets the norm
    (cross term: the output gradient read at the input tokens) without it."""
    from dpoptim.rules.embedding import EmbeddingRule
    from dpoptim.rules.linear import LinearRule

    def refuse(*args, **kwargs):
        raise AssertionError("per-example gradients were materialised")

    monkeypatch.setattr(EmbeddingRule, "per_example", refuse)
    monkeypatch.setattr(LinearRule, "per_example", refuse)
    monkeypatch.setattr(dp_cost, "MATERIALIZE_LIMIT", 0)
    g = torch.Generator().manual_seed(9)
    tokens = torch.randint(50, (4, 6), generator=g, dtype=torch.int32)  # int32 indices work too
    y = _randn(g, 4, 6 * 50)
    check_rule_case(lambda: TiedLanguageModel(50, 8, nn.Tanh(), padding_idx=0).double(), (tokens,), y,
                    lambda m, t: m(t).flatten(1), mse)


@needs_embedding_rule
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@ROUTES
def test_cuda_tied_embedding(route):
    g = torch.Generator().manual_seed(23)
    cuda = torch.device("cuda")
    tokens = torch.randint(30, (4, 5), generator=g).to(cuda)
    y = _randn(g, 4, 5 * 30).to(cuda)
    with shared_route(route):
        check_rule_case(lambda: TiedLanguageModel(30, 6, nn.Tanh(), padding_idx=0).double().to(cuda), (tokens,), y,
                        lambda m, t: m(t).flatten(1), mse)
