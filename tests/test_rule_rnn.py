"""nn.RNN / nn.LSTM / nn.GRU and their cells against the brute-force oracle."""

import copy
import types

import pytest
import torch
from hypothesis import given, strategies as st
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pack_sequence, pad_packed_sequence

import dpoptim
import dpoptim.rules.rnn  # noqa: F401  (registers the rules until dpoptim.rules imports them)
from oracle import assert_loss_falls, check_rule_case, clipped_sum, dp_clipped_sum, generator_states, mse, per_example_gradients

F64 = torch.float64


def make_module(kind, d, H, **kw):
    if kind == "lstm":
        return nn.LSTM(d, H, **kw)
    if kind == "gru":
        kw.pop("proj_size", None)
        return nn.GRU(d, H, **kw)
    kw.pop("proj_size", None)
    return nn.RNN(d, H, nonlinearity="relu" if kind == "relu" else "tanh", **kw)


def features(out, hidden, batch_first, use, total_length=None):
    """Output sequence and final states as one ``[n, F]`` tensor per example, keeping only
    the parts ``use`` names, so that some outputs receive no gradient at all."""
    if isinstance(out, torch.nn.utils.rnn.PackedSequence):
        out, _ = pad_packed_sequence(out, batch_first=True, total_length=total_length)
    elif not batch_first:
        out = out.transpose(0, 1)
    states = hidden if isinstance(hidden, tuple) else (hidden,)
    parts = [out.flatten(1)] if "out" in use else []
    for name, state in zip(("h", "c"), states):
        if name in use:
            parts.append(state.transpose(0, 1).flatten(1))
    return torch.cat(parts, 1)


class Upstream(nn.Module):
    """Linear layers in front of a recurrent module: one maps the input sequence, two more
    add a learned function of each example's first input to the initial states (or make
    them, when none are given). The oracle then also checks the gradients the module passes
    back to its inputs, which dpoptim computes itself after the first step (Rule.inputs)."""

    def __init__(self, rnn, d, states, H_out, H_cell, batch_first):
        super().__init__()
        self.rnn, self.states, self.batch_first = rnn, states, batch_first
        self.pre = nn.Linear(d, d)
        self.h = nn.Linear(d, H_out)
        self.c = nn.Linear(d, H_cell) if H_cell else None

    def forward(self, x, hx=None):
        xb = x if self.batch_first else x.transpose(0, 1)  # Linear takes examples from dim 0
        first = xb[:, 0]
        xb = self.pre(xb)
        x = xb if self.batch_first else xb.transpose(0, 1)

        def initial(layer, given):
            made = layer(first).unsqueeze(0).expand(self.states, *first.shape[:1], layer.out_features)
            return made.contiguous() if given is None else given + made

        if self.c is None:
            hx = initial(self.h, hx)
        else:
            h0, c0 = hx if hx is not None else (None, None)
            hx = initial(self.h, h0), initial(self.c, c0)
        return self.rnn(x, hx)


sequence_configs = st.fixed_dictionaries({
    "kind": st.sampled_from(["tanh", "relu", "lstm", "gru"]),
    "layers": st.integers(1, 3),
    "bidirectional": st.booleans(),
    "batch_first": st.booleans(),
    "bias": st.booleans(),
    "proj": st.booleans(),
    "dropout": st.sampled_from([0.0, 0.5]),
    "initial_state": st.booleans(),
    "use": st.sampled_from([("out",), ("h",), ("c",), ("out", "h"), ("out", "h", "c")]),
    "n": st.integers(0, 4),
    "T": st.integers(1, 4),
    "d": st.integers(1, 3),
    "H": st.integers(2, 4),
    "reduction": st.sampled_from(["mean", "sum"]),
    "upstream": st.booleans(),
})


@given(cfg=sequence_configs, seed=st.integers(0, 2**16))
def test_sequence_layer_matches_oracle(cfg, seed):
    kind, L, D = cfg["kind"], cfg["layers"], 2 if cfg["bidirectional"] else 1
    n, T, d, H = cfg["n"], cfg["T"], cfg["d"], cfg["H"]
    proj = H - 1 if cfg["proj"] and kind == "lstm" else 0
    use = cfg["use"] if kind == "lstm" or "c" not in cfg["use"] else ("out",)
    dropout = cfg["dropout"] if L > 1 else 0.0
    bf = cfg["batch_first"]
    g = torch.Generator().manual_seed(seed)

    def make():
        rnn = make_module(kind, d, H, num_layers=L, bidirectional=cfg["bidirectional"], batch_first=bf,
                          bias=cfg["bias"], dropout=dropout, proj_size=proj)
        if cfg["upstream"]:
            rnn = Upstream(rnn, d, L * D, proj or H, H if kind == "lstm" else 0, bf)
        return rnn.double()

    x = torch.randn(*((n, T) if bf else (T, n)), d, generator=g, dtype=F64)
    inputs, dims = (x,), (0 if bf else 1,)
    if cfg["initial_state"]:
        h0 = torch.randn(L * D, n, proj or H, generator=g, dtype=F64)
        inputs, dims = inputs + (h0,), dims + (1,)
        if kind == "lstm":
            inputs, dims = inputs + (torch.randn(L * D, n, H, generator=g, dtype=F64),), dims + (1,)

    def forward(m, x, *state):
        hx = None if not state else (tuple(state) if kind == "lstm" else state[0])
        return features(*m(x, hx), bf, use)

    width = features(*make()(x[:1] if bf else x[:, :1]), bf, use).shape[1] if n else 1
    y = torch.randn(n, width, generator=g, dtype=F64)
    check_rule_case(make, inputs, y, forward, mse, batch_dims=dims, reduction=cfg["reduction"], random=dropout > 0)


class PackedUpstream(nn.Module):
    """A Linear over the padded batch, then packing, then the recurrent module; the initial
    states get a learned function of each example's first input added. Without
    ``upstream`` the recurrent module alone."""

    def __init__(self, rnn, d, upstream):
        super().__init__()
        self.rnn = rnn
        self.pre = nn.Linear(d, d) if upstream else None
        self.h = nn.Linear(d, rnn.proj_size or rnn.hidden_size) if upstream else None
        self.c = nn.Linear(d, rnn.hidden_size) if upstream and isinstance(rnn, nn.LSTM) else None

    def forward(self, padded, lengths, enforce_sorted, hx):
        if self.pre is not None:
            first = padded[:, 0]
            padded = self.pre(padded)
            if hx is not None:
                shift = lambda layer, state: state + layer(first).unsqueeze(0)  # noqa: E731
                hx = (shift(self.h, hx[0]), shift(self.c, hx[1])) if self.c is not None else shift(self.h, hx)
        packed = pack_padded_sequence(padded, lengths, batch_first=True, enforce_sorted=enforce_sorted)
        return self.rnn(packed, hx)


@given(
    kind=st.sampled_from(["tanh", "relu", "lstm", "gru"]),
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    enforce_sorted=st.booleans(),
    layers=st.integers(1, 2),
    bidirectional=st.booleans(),
    proj=st.booleans(),
    initial_state=st.booleans(),
    upstream=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_packed_sequences_match_oracle(kind, lengths, enforce_sorted, layers, bidirectional, proj, initial_state,
                                       upstream, seed):
    """Sequences of different lengths in one PackedSequence; the oracle runs each alone."""
    if enforce_sorted:
        lengths = sorted(lengths, reverse=True)
    g = torch.Generator().manual_seed(seed)
    d, H, D, n = 2, 3, 2 if bidirectional else 1, len(lengths)
    proj_size = 2 if proj and kind == "lstm" else 0
    T = max(lengths)
    padded = torch.zeros(n, T, d, dtype=F64)
    for i, t in enumerate(lengths):
        padded[i, :t] = torch.randn(t, d, generator=g, dtype=F64)
    h0 = torch.randn(layers * D, n, proj_size or H, generator=g, dtype=F64)
    c0 = torch.randn(layers * D, n, H, generator=g, dtype=F64)
    torch.manual_seed(seed)
    rnn = make_module(kind, d, H, num_layers=layers, bidirectional=bidirectional, proj_size=proj_size)
    model = PackedUpstream(rnn, d, upstream).double()
    reference = copy.deepcopy(model)

    def forward(m, x, lengths, h, c):
        hx = None if not initial_state else ((h, c) if kind == "lstm" else h)
        out, hidden = m(x, lengths, enforce_sorted, hx)
        return features(out, hidden, True, ("out", "h", "c") if kind == "lstm" else ("out", "h"), total_length=T)

    def example(i):
        return padded[i:i + 1, :lengths[i]], [lengths[i]], h0[:, i:i + 1], c0[:, i:i + 1]

    width = forward(reference, *example(0)).shape[1]
    y = torch.randn(n, width, generator=g, dtype=F64)

    params = list(reference.parameters())
    per_example = []
    for i in range(n):
        out = forward(reference, *example(i))
        per_example.append([torch.zeros_like(p) if gp is None else gp for p, gp in
                            zip(params, torch.autograd.grad(mse(out, y[i:i + 1]).sum(), params, allow_unused=True))])
    norms = sorted(float(torch.sqrt(sum(g.square().sum() for g in gs))) for gs in per_example)
    bound = norms[n // 2] if norms[n // 2] > 0 else 1.0
    expected, _ = clipped_sum(per_example, bound, params)

    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=0.0, max_grad_norm=bound,
                        expected_batch_size=1, sample_rate=0.5)
    start = [p.detach().clone() for p in model.parameters()]
    for attempt in ("first step", "later step"):  # the later one stands in for the kernel's backward
        got = dp_clipped_sum(model, [((padded, lengths, h0, c0), y)], bound, forward, mse, optimizer=opt)
        for (name, _), e, r in zip(model.named_parameters(), expected, got):
            assert torch.allclose(e, r, rtol=1e-7, atol=1e-10), f"{attempt}, {name}: max error {(e - r).abs().max():.3e}"
        with torch.no_grad():
            for p, s in zip(model.parameters(), start):
                p.copy_(s)


@given(
    kind=st.sampled_from(["tanh", "relu", "lstm", "gru"]),
    n=st.integers(0, 4),
    steps=st.integers(1, 4),
    bias=st.booleans(),
    initial_state=st.booleans(),
    use_c=st.booleans(),
    reduction=st.sampled_from(["mean", "sum"]),
    seed=st.integers(0, 2**16),
)
def test_cell_in_a_user_loop_matches_oracle(kind, n, steps, bias, initial_state, use_c, reduction, seed):
    """A cell called once per step: `steps` uses of one module in one backward."""
    g = torch.Generator().manual_seed(seed)
    d, H = 3, 4
    x = torch.randn(n, steps, d, generator=g, dtype=F64)
    h0 = torch.randn(n, H, generator=g, dtype=F64)
    c0 = torch.randn(n, H, generator=g, dtype=F64)

    def make():
        head = nn.Linear(H, 2).double()
        if kind == "lstm":
            cell = nn.LSTMCell(d, H, bias=bias)
        elif kind == "gru":
            cell = nn.GRUCell(d, H, bias=bias)
        else:
            cell = nn.RNNCell(d, H, bias=bias, nonlinearity=kind)
        return nn.ModuleDict({"cell": cell.double(), "head": head})

    def forward(m, x, h0, c0):
        state = None
        if initial_state:
            state = (h0, c0) if kind == "lstm" else h0
        outs = []
        for t in range(steps):
            state = m["cell"](x[:, t], state)
            h = state[0] if kind == "lstm" else state
            outs.append(m["head"](h))
        last = [state[1]] if kind == "lstm" and use_c else []
        return torch.cat(outs + last, 1)

    width = 2 * steps + (H if kind == "lstm" and use_c else 0)
    y = torch.randn(n, width, generator=g, dtype=F64)
    check_rule_case(make, (x, h0, c0), y, forward, mse, reduction=reduction)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_single_cell_use_and_accumulation(kind):
    """One use per backward (the cheap, non-shared path) over several micro-batches."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, generator=g, dtype=F64)
    y = torch.randn(7, 4, generator=g, dtype=F64)
    cell_type = nn.LSTMCell if kind == "lstm" else nn.GRUCell

    def forward(m, x):
        out = m(x)
        return out[0] if kind == "lstm" else out

    check_rule_case(lambda: cell_type(3, 4).double(), (x,), y, forward, mse, splits=[3, 0, 4])


def test_sequence_accumulation_over_micro_batches():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 3, 2, generator=g, dtype=F64)
    y = torch.randn(6, 4, generator=g, dtype=F64)

    def forward(m, x):
        out, (h, c) = m(x)
        return h[-1]

    make = lambda: nn.LSTM(2, 4, num_layers=2, batch_first=True).double()
    check_rule_case(make, (x,), y, forward, mse, splits=[2, 1, 3])


def test_lstm_cell_with_separate_output_gradients():
    """On CUDA, LSTMCell runs a fused kernel that returns h' and c' from one autograd node,
    so the gradient a hook sees on c' leaves out the path through h'. The rule must then
    add that path itself; on CPU (h' computed from c') it must not. Both cases, by hand:
    the loss <a, h'> + <b, c'> has external gradients a and b."""
    from dpoptim.registry import Use

    g = torch.Generator().manual_seed(6)
    cell = nn.LSTMCell(3, 4).double()
    x, h, c = (torch.randn(5, k, generator=g, dtype=F64) for k in (3, 4, 4))
    a, b = torch.randn(5, 4, generator=g, dtype=F64), torch.randn(5, 4, generator=g, dtype=F64)
    expected = []
    for i in range(5):
        h1, c1 = cell(x[i:i + 1], (h[i:i + 1], c[i:i + 1]))
        loss = (a[i:i + 1] * h1).sum() + (b[i:i + 1] * c1).sum()
        expected.append(torch.autograd.grad(loss, [cell.weight_ih, cell.weight_hh, cell.bias_ih, cell.bias_hh]))
    rule = dpoptim.rule_for(cell)
    names = ["weight_ih", "weight_hh", "bias_ih", "bias_hh"]
    h1, c1 = cell(x, (h, c))
    total_c = torch.autograd.grad((a * h1).sum() + (b * c1).sum(), c1)[0]  # what a CPU hook sees
    for dc, dc_is_total in ((b, False), (total_c, True)):
        use = Use(cell, (x, (h, c), dc_is_total), [a, dc])
        got = rule.per_example(use, names)
        for k, name in enumerate(names):
            want = torch.stack([e[k] for e in expected])
            assert torch.allclose(got[name], want, rtol=1e-10, atol=1e-12), (name, dc_is_total)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["lstm", "gru", "lstm_cell", "packed"])
def test_cuda_kernels_match_oracle(kind):
    """cuDNN sequence kernels and the fused LSTM cell, in float64 on the GPU."""
    g = torch.Generator().manual_seed(7)
    cuda = torch.device("cuda")
    if kind == "lstm_cell":
        x = torch.randn(4, 3, 3, generator=g, dtype=F64).to(cuda)
        y = torch.randn(4, 4, generator=g, dtype=F64).to(cuda)

        def forward(m, x):
            state = None
            for t in range(x.shape[1]):
                state = m(x[:, t], state)
            return state[0] + state[1]

        check_rule_case(lambda: nn.LSTMCell(3, 4).double().to(cuda), (x,), y, forward, mse)
        return
    if kind == "packed":
        seqs = [torch.randn(t, 2, generator=g, dtype=F64).to(cuda) for t in (3, 1, 2)]
        model = nn.LSTM(2, 3, bidirectional=True).double().to(cuda)
        opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=0.0, max_grad_norm=1e6,
                            expected_batch_size=1, sample_rate=0.5, loss_reduction="sum")
        out, _ = model(pack_sequence(seqs, enforce_sorted=False))
        pad_packed_sequence(out)[0].square().sum().backward()
        reference = [p.grad.clone() for p in model.parameters()]
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()  # unclipped (huge bound): the step is minus the summed gradient
        for p, b, r in zip(model.parameters(), before, reference):
            assert torch.allclose(b - p.detach(), r, rtol=1e-9, atol=1e-12)
        return
    cls = nn.LSTM if kind == "lstm" else nn.GRU
    x = torch.randn(4, 3, 2, generator=g, dtype=F64).to(cuda)
    y = torch.randn(4, 2 * 3 * 3, generator=g, dtype=F64).to(cuda)

    def make():  # with layers upstream: the later step's input gradients come from the rule
        rnn = cls(2, 3, num_layers=2, bidirectional=True, batch_first=True)
        return Upstream(rnn, 2, 4, 3, 3 if kind == "lstm" else 0, True).double().to(cuda)

    check_rule_case(make, (x,), y, lambda m, x: m(x)[0].flatten(1), mse)


def _embedded_lstm():
    torch.manual_seed(0)
    return nn.ModuleDict({"embed": nn.Embedding(10, 3), "lstm": nn.LSTM(3, 4, batch_first=True)})


def test_fused_backward_is_replaced_after_the_first_step():
    """The first step is checked against autograd's own backward; later ones route the
    outputs through the rule's stand-in, so the fused kernel's backward never runs."""
    model = _embedded_lstm()
    opt = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=4, sample_rate=0.5)
    tokens = torch.randint(10, (4, 5), generator=torch.Generator().manual_seed(1))
    kinds = []
    for _ in range(3):
        out, (h, c) = model["lstm"](model["embed"](tokens))
        kinds.append({type(t.grad_fn).__name__ for t in (out, h, c)})
        (out.square().sum() + h.sum()).backward()
        opt.step()
        opt.zero_grad()
    assert "_StandInBackward" not in kinds[0]
    assert kinds[1] == kinds[2] == {"_StandInBackward"}


def test_in_place_change_of_the_output_is_refused():
    """The rule replays from the output it saw at forward time, as autograd's kernel would:
    a change in place before backward() is an error, not a silently wrong gradient."""
    model = _embedded_lstm()
    opt = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=4, sample_rate=0.5)
    tokens = torch.randint(10, (4, 5), generator=torch.Generator().manual_seed(1))
    model["lstm"](model["embed"](tokens))[0].sum().backward()
    opt.step()
    out, _ = model["lstm"](model["embed"](tokens))
    out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_partly_frozen_stack():
    """The engine asks only for the trainable parameters; the replay still runs through the
    frozen ones."""
    g = torch.Generator().manual_seed(9)
    x = torch.randn(4, 3, 4, generator=g, dtype=F64)
    y = torch.randn(4, 12, generator=g, dtype=F64)

    def make():
        m = nn.LSTM(4, 4, num_layers=2, batch_first=True).double()
        m.weight_hh_l0.requires_grad_(False)
        m.bias_ih_l1.requires_grad_(False)
        return m

    check_rule_case(make, (x,), y, lambda m, x: m(x)[0].flatten(1), mse)


def _dropout_forward(packed):
    """Five sequences of up to 6 steps (lengths 6, 2, 5, 1, 3 when packed), 8 features each."""
    lengths = torch.tensor([6, 2, 5, 1, 3])

    def forward(m, x):
        if packed:
            out, _ = m(pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False))
            out, _ = pad_packed_sequence(out, batch_first=True, total_length=6)
        else:
            out, _ = m(x)
        return out[:, :, :4].flatten(1)[:, :8]

    return forward


@pytest.mark.parametrize("kind", ["tanh", "lstm", "gru"])
@pytest.mark.parametrize("packed", [False, True])
def test_stacked_dropout_masks_are_the_forwards(kind, packed):
    """Three layers with dropout 0.5, float32 (oneDNN's kernel on CPU) and float64, against
    the same-randomness oracle; a control shows the masks matter."""
    g = torch.Generator().manual_seed(4)
    for dtype in (torch.float32, F64):
        x = torch.randn(5, 6, 3, generator=g, dtype=dtype)
        y = torch.randn(5, 8, generator=g, dtype=dtype)
        forward = _dropout_forward(packed)
        make = lambda: make_module(kind, 3, 4, num_layers=3, dropout=0.5, batch_first=True).to(dtype)  # noqa: E731
        clip = check_rule_case(make, (x,), y, forward, mse, random=True, rtol=1e-7 if dtype == F64 else 1e-4)
        if dtype == F64:
            torch.manual_seed(0)
            rng = generator_states()
            reference = make()
            expected, _ = clipped_sum(per_example_gradients(reference, (x,), y, forward, mse, rng=rng), clip,
                                      list(reference.parameters()))
            no_dropout = make()
            no_dropout.dropout = 0.0
            got = dp_clipped_sum(no_dropout, [((x,), y)], clip, forward, mse, rng=rng)
            assert not all(torch.allclose(e, v) for e, v in zip(expected, got))


def test_stacked_dropout_on_cuda_runs_without_cudnn():
    """cuDNN's dropout state cannot be replayed, so the rule has the forward of a CUDA
    module with stacked dropout run on PyTorch's own implementation, whose masks it can
    draw again. The context reads only these attributes: a stand-in shows it without a GPU."""
    class OnCuda:
        training, dropout, num_layers = True, 0.3, 2
        weight_ih_l0 = types.SimpleNamespace(device=torch.device("cuda"))

    rule = dpoptim.rule_for(nn.LSTM(3, 4))
    before = torch.backends.cudnn.enabled
    context = rule.forward_context(OnCuda())
    with context:
        assert torch.backends.cudnn.enabled is False
    assert torch.backends.cudnn.enabled == before
    OnCuda.training = False
    assert rule.forward_context(OnCuda()) is None  # eval mode keeps cuDNN
    assert rule.forward_context(nn.LSTM(3, 4, num_layers=2, dropout=0.3)) is None  # CPU


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("packed", [False, True])
def test_cuda_stacked_dropout_matches_oracle(packed):
    """The oracle's reference runs without cuDNN too (with cuDNN its masks would be cuDNN's)."""
    g = torch.Generator().manual_seed(5)
    cuda = torch.device("cuda")
    x = torch.randn(5, 6, 3, generator=g, dtype=F64).to(cuda)
    y = torch.randn(5, 8, generator=g, dtype=F64).to(cuda)
    forward = _dropout_forward(packed)
    make = lambda: nn.LSTM(3, 4, num_layers=3, dropout=0.5, batch_first=True).double().to(cuda)  # noqa: E731
    with torch.backends.cudnn.flags(enabled=False):
        check_rule_case(make, (x,), y, forward, mse, random=True)


@pytest.mark.parametrize("module", [nn.LSTM(3, 4), nn.GRUCell(3, 4)])
def test_unbatched_input_is_refused(module):
    opt = dpoptim.DPSGD(module.parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=2, sample_rate=0.1)
    x = torch.randn(5, 3) if isinstance(module, nn.LSTM) else torch.randn(3)
    with pytest.raises(ValueError, match="batch dimension"):
        module(x)
    del opt


# ---------------------------------------------------------------------------- training
def _sequence_task(n, T, generator):
    """Label: is the sum of the last three inputs positive?"""
    x = torch.randn(n, T, 1, generator=generator)
    return x, (x[:, -3:, 0].sum(1) > 0).long()


class _Classifier(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        if kind == "cell":
            self.rnn = nn.GRUCell(1, 16)
        else:
            self.rnn = make_module(kind, 1, 16, batch_first=True, bidirectional=kind == "gru")
        self.head = nn.Linear(32 if kind == "gru" else 16, 2)

    def forward(self, x):
        if self.kind == "cell":
            h = None
            for t in range(x.shape[1]):
                h = self.rnn(x[:, t], h)
            return self.head(h)
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


@pytest.mark.filterwarnings("ignore::dpoptim.PrivacyWarning")  # fixed-size batches, not Poisson
@pytest.mark.parametrize("kind", ["lstm", "gru", "tanh", "cell"])
def test_training_with_noise_lowers_the_loss(kind):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    model = _Classifier(kind)
    opt = dpoptim.DPAdam(model.parameters(), lr=0.01, noise_multiplier=0.3, max_grad_norm=1.0,
                         expected_batch_size=64, sample_rate=0.01, generator=torch.Generator().manual_seed(1))
    assert_loss_falls(model, opt, lambda: _sequence_task(64, 6, g), nn.functional.cross_entropy, steps=60)


@given(
    kind=st.sampled_from(["tanh", "relu", "lstm", "gru"]),
    layers=st.integers(1, 2),
    bidirectional=st.booleans(),
    batch_first=st.booleans(),
    proj=st.booleans(),
    packed=st.booleans(),
    grads_for=st.sampled_from([("x",), ("h",), ("c",), ("x", "h"), ("x", "h", "c")]),
    seed=st.integers(0, 2**16),
)
def test_stand_in_input_gradients_are_autograds(kind, layers, bidirectional, batch_first, proj, packed, grads_for,
                                                seed):
    """After the first step the rule computes the gradients of the input sequence and the
    initial states itself; they must be the ones autograd's kernel gives, for any subset of
    those inputs that asks for them."""
    g = torch.Generator().manual_seed(seed)
    D, n, T, d, H = 2 if bidirectional else 1, 3, 4, 2, 3
    proj_size = 2 if proj and kind == "lstm" else 0
    torch.manual_seed(seed)
    module = make_module(kind, d, H, num_layers=layers, bidirectional=bidirectional, batch_first=batch_first,
                         proj_size=proj_size).double()
    reference = copy.deepcopy(module)
    opt = dpoptim.DPSGD(module.parameters(), lr=0.0, noise_multiplier=0.0, max_grad_norm=1.0,
                        expected_batch_size=n, sample_rate=0.5)
    lengths = torch.tensor([4, 1, 3])
    x = torch.randn(*((n, T) if batch_first else (T, n)), d, generator=g, dtype=F64, requires_grad="x" in grads_for)
    h0 = torch.randn(layers * D, n, proj_size or H, generator=g, dtype=F64, requires_grad="h" in grads_for)
    c0 = torch.randn(layers * D, n, H, generator=g, dtype=F64, requires_grad="c" in grads_for and kind == "lstm")
    weights = torch.randn(n, T, D * (proj_size or H), generator=g, dtype=F64)

    def loss(m):
        inp = pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=False) if packed else x
        out, hidden = m(inp, (h0, c0) if kind == "lstm" else h0)
        if packed:
            out, _ = pad_packed_sequence(out, batch_first=True, total_length=T)
        elif not batch_first:
            out = out.transpose(0, 1)
        states = hidden if isinstance(hidden, tuple) else (hidden,)
        return (out * weights).sum() + sum(s.square().sum() for s in states)

    loss(module).backward()  # the first step: checked against autograd, no stand-in yet
    opt.step()
    wanted = [t for t in (x, h0, c0) if t.requires_grad]
    if not wanted:
        return
    got = torch.autograd.grad(loss(module), wanted)
    expected = torch.autograd.grad(loss(reference), wanted)
    for name, e, r in zip(grads_for, expected, got):
        torch.testing.assert_close(r, e, rtol=1e-9, atol=1e-12, msg=name)
