"""dpoptim.check: it must flag every way examples of a batch can meet that the hooks cannot
see, and pass models in which they do not.

Each coupling below is one small model and loss written the way a user would write it.
The clean models are the families dpoptim has rules for. The numbers check reports are
compared with the per-example loop of tests/oracle.py, which shares no code with it.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
import torch.nn.functional as F
from torch import nn

import dpoptim
from oracle import clipped_sum, per_example_gradients

N, D, K = 6, 5, 3  # examples, input width, classes


def _data(seed=0, n=N, d=D, k=K):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g)


def ce(model, batch):
    x, y = batch
    return F.cross_entropy(model(x), y)


def _check(model, batch, loss_fn=ce, **kwargs):
    kwargs.setdefault("max_grad_norm", 0.5)
    return dpoptim.check(model, batch, loss_fn, **kwargs)


def assert_flagged(result, *needles):
    assert not result.passed and not bool(result) and result.failures, str(result)
    text = "\n".join(result.failures)
    for needle in needles:
        assert needle in text, f"{needle!r} not in:\n{result}"


def assert_flagged_or_refused(result, *needles):
    """For layouts dpoptim itself may come to refuse: its error, reported as a failure, is as
    good as the check's own finding."""
    assert not result.passed, str(result)
    refused = [f for f in result.failures if f.startswith(("(1) dpoptim cannot clip", "dpoptim raised an error"))]
    if not refused:
        assert_flagged(result, *needles)


def assert_clean(result):
    assert result.passed and bool(result) and not result.failures, str(result)
    assert result.step_error <= result.tolerance
    assert result.sensitivity <= 1 + 1e-6
    assert result.removal_error <= 1e-6 * N
    assert "passed" in str(result)


# ---------------------------------------------------------------------- couplings it must flag
class Centred(nn.Module):
    """Batch centring: x - x.mean(0) couples every example with every other."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(D, K)

    def forward(self, x):
        return self.fc(x - x.mean(0))


class FunctionalBatchNorm(nn.Module):
    """Parameter-free batch normalisation of sequences between two Linear layers: the
    statistics run over the examples and the time steps, so one example alone still works."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, 4), nn.Linear(4, K)

    def forward(self, x):  # [n, T, D]
        h = F.batch_norm(self.a(x).transpose(1, 2), None, None, training=True).transpose(1, 2)
        return self.b(h).mean(1)


class Flattened(nn.Module):
    """Tokens flattened into the batch dimension: every token is taken for an example."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, 4), nn.Linear(4, K)

    def forward(self, x):  # [n, T, D]
        n, t, d = x.shape
        h = self.b(torch.tanh(self.a(x.reshape(n * t, d))))
        return h.reshape(n, t, K).mean(1)


class SequenceFirst(nn.Module):
    """Linear layers applied to a sequence-first tensor: dim 0 holds time steps."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(D, 4), nn.Linear(4, K)

    def forward(self, x):  # [n, T, D] in, [T, n, D] inside
        h = self.b(torch.tanh(self.a(x.transpose(0, 1))))
        return h.mean(0)


def _sequences(seed=0, t=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, t, D, generator=g), torch.randint(0, K, (N,), generator=g)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, 8), nn.Tanh(), nn.Linear(8, K))


def test_flags_batch_centring():
    torch.manual_seed(0)
    result = _check(Centred(), _data())
    assert_flagged(result, "(2)", "(3)", "x - x.mean(0)")
    assert "agrees with the loop" in result.failures[0]  # the diagnosis: the batch couples the examples


def test_flags_functional_batch_norm():
    torch.manual_seed(0)
    result = _check(FunctionalBatchNorm(), _sequences())
    assert_flagged_or_refused(result, "(2)", "(3)")
    assert result.sensitivity is None or result.sensitivity > 1


def test_flags_batchnorm_module_in_training():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 4), nn.BatchNorm1d(4), nn.Linear(4, K))
    result = _check(model, _data(), optimizer_class=dpoptim.DPAdam, lr=0.1)
    assert_flagged(result, "example 0 alone", "(1)", "BatchNorm1d", "replace_batchnorm")


def test_flags_infonce_loss():
    """A contrastive loss: each example's loss has every other example as a negative."""
    torch.manual_seed(0)
    model = nn.Linear(D, 4)
    g = torch.Generator().manual_seed(1)
    views = (torch.randn(N, D, generator=g), torch.randn(N, D, generator=g))

    def info_nce(m, batch):
        a, b = F.normalize(m(batch[0]), dim=1), F.normalize(m(batch[1]), dim=1)
        logits = a @ b.T / 0.1
        return F.cross_entropy(logits, torch.arange(len(a)))

    assert_flagged(_check(model, views, info_nce), "(2)")


def _lm_batch():
    """Token ids with padding (id 0) at the end of sequences of different lengths."""
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, 7, (N, 5), generator=g)
    for i, length in enumerate([5, 1, 3, 2, 5, 4]):
        ids[i, length:] = 0
    return {"input_ids": ids, "labels": ids.clone()}


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.out = nn.Embedding(7, 4), nn.Linear(4, 7)

    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))


def test_flags_token_mean_lm_loss():
    """cross_entropy with ignore_index averages over the batch's tokens: example i's weight
    is 1 / (tokens in the batch), a count that depends on the other examples."""
    torch.manual_seed(0)

    def token_mean(m, batch):
        logits = m(batch["input_ids"])
        return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=0)

    result = _check(TinyLM(), _lm_batch(), token_mean)
    assert_flagged(result, "(2)", "ignore_index", "not made of the examples' own losses")


def test_passes_per_example_token_mean():
    """The fix check proposes: each example's token mean, then the mean over examples."""
    torch.manual_seed(0)

    def per_example_mean(m, batch):
        logits = m(batch["input_ids"])
        labels = batch["labels"]
        token = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=0, reduction="none")
        counts = (labels != 0).sum(1).clamp(min=1)
        return (token.sum(1) / counts).mean()

    assert_clean(_check(TinyLM(), _lm_batch(), per_example_mean))


def test_flags_class_weighted_cross_entropy():
    """reduction='mean' with class weights divides by the batch's weight sum."""
    weight = torch.tensor([1.0, 5.0, 0.2])

    def weighted(m, batch):
        x, y = batch
        return F.cross_entropy(m(x), y, weight=weight.to(m(x).dtype))

    assert_flagged(_check(_mlp(), _data(), weighted), "(2)")


def test_flags_tokens_flattened_into_batch():
    torch.manual_seed(0)
    assert_flagged_or_refused(_check(Flattened(), _sequences()), "(2)", "found 24 examples in this batch of 6")


def test_flags_sequence_first_linear_layers():
    torch.manual_seed(0)
    assert_flagged_or_refused(_check(SequenceFirst(), _sequences(t=3)), "(2)", "found 3 examples in this batch of 6")


def test_flags_reordered_rows():
    """Outputs paired with the wrong targets: example i's loss uses example i-1's input."""

    def shifted(m, batch):
        x, y = batch
        return F.cross_entropy(m(x).roll(1, 0), y)

    assert_flagged(_check(_mlp(), _data(), shifted), "(2)")


class _OwnParameter(nn.Module):
    """A module using its own parameter directly: element-wise (exact per example) or as a
    matrix against the batch (which dpoptim refuses)."""

    def __init__(self, matrix: bool):
        super().__init__()
        self.fc = nn.Linear(D, K)
        self.matrix = matrix
        self.mix = nn.Parameter(torch.eye(K) + 0.1 * torch.randn(K, K)) if matrix else nn.Parameter(torch.ones(K))

    def forward(self, x):
        h = self.fc(x)
        return h @ self.mix if self.matrix else h * self.mix


def test_flags_parameter_no_rule_can_split():
    """(1): a parameter in a matrix product with the batch, outside any layer with a rule."""
    torch.manual_seed(0)
    assert_flagged(_check(_OwnParameter(matrix=True), _data()), "mix")


def test_passes_parameter_used_element_wise():
    torch.manual_seed(0)
    assert_clean(_check(_OwnParameter(matrix=False), _data()))


def test_flags_a_clipping_bug_in_dpoptim(monkeypatch):
    """The check compares with its own loop, not with dpoptim: an engine that forgot to clip
    is caught."""
    import dpoptim.clipping

    monkeypatch.setattr(dpoptim.clipping, "clip_factors", lambda sq, bound: torch.ones_like(sq))
    result = _check(_mlp(), _data(), max_grad_norm=0.01)
    assert_flagged(result, "(2)", "(3)")
    assert result.sensitivity > 10


class _LouderOnOneFewer(nn.Module):
    """Doubles its output on a batch of N - 1 examples only: the full batch and the
    per-example loop see the plain layer, the batch without one example does not."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(D, K)

    def forward(self, x):
        out = self.lin(x)
        return out * 2.0 if x.shape[0] == N - 1 else out


def test_flags_a_removal_that_is_not_the_examples_own_clipped_gradient():
    """Check (3) on its own: the update without one example must be the full update less
    that example's clipped gradient / n. Here it is not, though the full batch matches the
    per-example loop and the move stays within C / B (C large)."""
    result = _check(_LouderOnOneFewer(), _data(), max_grad_norm=100.0)
    assert result.step_error <= result.tolerance and result.sensitivity <= 1.0
    assert result.removal_error > 1e-3
    assert_flagged(result, "(3)")


def test_flags_random_loss():
    """Noise the check cannot switch off: it says so instead of comparing noise."""

    class Noisy(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(D, K)

        def forward(self, x):
            return self.fc(x + torch.randn_like(x))

    assert_flagged(_check(Noisy(), _data()), "random")


def test_optimizer_arguments_without_a_class_build_dpsgd():
    result = _check(_mlp(), _data(), momentum=0.9, lr=0.1)
    assert_clean(result)
    assert result.optimizer == "DPSGD" and result.optimizer_error <= result.tolerance
    assert_flagged(_check(_mlp(), _data(), momentun=0.9), "DPSGD", "momentun")  # a typo is not ignored


def test_flags_an_optimizer_that_is_not_private():
    result = _check(_mlp(), _data(), optimizer_class=torch.optim.Adam, lr=1e-3)
    assert_flagged(result, "make_private(Adam)")
    assert result.step_error <= result.tolerance  # the model itself is fine


# ---------------------------------------------------------------------- clean models it must pass
def test_passes_mlp_with_dropout_and_its_numbers_match_the_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.ReLU(), nn.Dropout(0.5), nn.Linear(8, K))
    x, y = _data()
    c = 0.3
    result = dpoptim.check(model, (x, y), ce, max_grad_norm=c, removals=N)
    assert_clean(result)
    assert result.dtype == torch.float64
    assert result.removed[:2] == [0, N - 1] and sorted(result.removed) == list(range(N))
    assert result.dropout_disabled == ["2 (p=0.5)"]
    # The sensitivity is the largest clipped per-example norm over C, by the oracle's loop.
    reference = copy.deepcopy(model).double()
    reference[2].p = 0.0
    params = list(reference.parameters())
    grads = per_example_gradients(reference, (x.double(),), y, lambda m, v: m(v),
                                  lambda out, t: F.cross_entropy(out, t, reduction="none"))
    _, norms = clipped_sum(grads, c, params)
    assert result.gradient_norms == pytest.approx(norms, rel=1e-9)
    assert result.sensitivity == pytest.approx(max(min(v, c) for v in norms) / c, rel=1e-6)


@settings(max_examples=6)  # each example is a whole check: keep the test near 2 s
@given(n=st.integers(2, 7), width=st.integers(1, 6), c=st.floats(0.05, 5.0), micro=st.one_of(st.none(), st.integers(1, 4)),
       reduction=st.sampled_from(["mean", "sum"]), seed=st.integers(0, 2**16))
def test_sensitivity_is_the_largest_clipped_norm_by_the_oracle(n, width, c, micro, reduction, seed):
    """Over drawn shapes, clip bounds, micro-batches and reductions: a clean model passes, and
    the sensitivity check reports is max_i min(||g_i||, C) / C over the removed examples,
    with g_i from the oracle's own per-example loop."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(D, width), nn.Tanh(), nn.Linear(width, K))
    x, y = _data(seed, n=n)

    def loss(m, batch):
        return F.cross_entropy(m(batch[0]), batch[1], reduction=reduction)

    result = dpoptim.check(model, (x, y), loss, max_grad_norm=c, loss_reduction=reduction, micro_batch_size=micro,
                           removals=n)
    assert_clean(result)
    reference = copy.deepcopy(model).double()
    grads = per_example_gradients(reference, (x.double(),), y, lambda m, v: m(v),
                                  lambda out, t: F.cross_entropy(out, t, reduction="none"))
    _, norms = clipped_sum(grads, c, list(reference.parameters()))
    assert result.gradient_norms == pytest.approx(norms, rel=1e-9, abs=1e-12)
    assert result.sensitivity == pytest.approx(max(min(v, c) for v in norms) / c, rel=1e-6, abs=1e-9)


def test_passes_cnn_with_groupnorm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.GroupNorm(2, 4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 4 * 4, K))
    g = torch.Generator().manual_seed(3)
    batch = (torch.randn(N, 1, 6, 6, generator=g), torch.randint(0, K, (N,), generator=g))
    assert_clean(_check(model, batch))


class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.lstm = nn.LSTM(4, 6, num_layers=2, dropout=0.3, batch_first=True)
        self.out = nn.Linear(6, K)

    def forward(self, ids):
        h, _ = self.lstm(self.emb(ids))
        return self.out(h[:, -1])


def test_passes_lstm():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(4)
    batch = (torch.randint(0, 10, (N, 5), generator=g), torch.randint(0, K, (N,), generator=g))
    result = _check(LSTMClassifier(), batch)
    assert_clean(result)
    assert "lstm.dropout (0.3)" in result.dropout_disabled


def test_passes_transformer_encoder_layer_with_dropout():
    torch.manual_seed(0)

    class Encoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(10, 8)
            self.layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16, dropout=0.1, batch_first=True)
            self.out = nn.Linear(8, K)

        def forward(self, batch):
            h = self.layer(self.emb(batch["input_ids"]), src_key_padding_mask=batch["attention_mask"] == 0)
            return self.out(h[:, 0])

    g = torch.Generator().manual_seed(5)
    mask = torch.ones(N, 5, dtype=torch.long)
    mask[1, 3:] = 0
    batch = {"input_ids": torch.randint(0, 10, (N, 5), generator=g), "attention_mask": mask,
             "labels": torch.randint(0, K, (N,), generator=g)}
    model = Encoder()
    result = dpoptim.check(model, batch, lambda m, b: F.cross_entropy(m(b), b["labels"]), max_grad_norm=0.5)
    assert_clean(result)
    assert any("dropout" in d for d in result.dropout_disabled)
    assert model.layer.dropout.p == 0.1 and model.layer.self_attn.dropout == 0.1  # the user's model untouched


def test_passes_tied_weights():
    """An embedding shared with the output layer: per-example gradients sum both uses."""

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(7, 4)
            self.out = nn.Linear(4, 7, bias=False)
            self.out.weight = self.emb.weight

        def forward(self, ids):
            return self.out(torch.tanh(self.emb(ids)))

    def loss(m, batch):
        logits = m(batch["input_ids"])
        return F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none").mean(1).mean()

    torch.manual_seed(0)
    assert_clean(_check(Tied(), _lm_batch(), loss))


def test_passes_with_micro_batches_and_the_users_optimizer():
    result = _check(_mlp(), _data(), micro_batch_size=4, optimizer_class=dpoptim.DPAdam,
                    lr=1e-3, target_epsilon=3.0, steps=100, sample_rate=0.01)
    assert_clean(result)
    assert result.micro_batch_size == 4 and result.optimizer == "DPAdam"
    assert result.optimizer_error <= result.tolerance


class CheckpointedAdapters(nn.Module):
    """The usual LoRA layout: a frozen embedding and head, trainable layers only inside two
    checkpointed blocks, none after them."""

    def __init__(self, reentrant: bool):
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(10, 8).requires_grad_(False)
        self.b1, self.b2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.head = nn.Linear(8, K).requires_grad_(False)

    def forward(self, ids):
        from torch.utils.checkpoint import checkpoint

        h = self.emb(ids).requires_grad_(True)  # as Hugging Face's enable_input_require_grads
        h = checkpoint(lambda t: torch.tanh(self.b1(t)), h, use_reentrant=self.reentrant)
        h = checkpoint(lambda t: torch.tanh(self.b2(t)), h, use_reentrant=self.reentrant)
        return self.head(h.mean(1))


def _ids_batch():
    g = torch.Generator().manual_seed(6)
    return torch.randint(0, 10, (N, 4), generator=g), torch.randint(0, K, (N,), generator=g)


def test_passes_non_reentrant_checkpointing():
    torch.manual_seed(0)
    assert_clean(_check(CheckpointedAdapters(reentrant=False), _ids_batch(), max_grad_norm=0.01))


def test_passes_reentrant_checkpointing():
    """Reentrant checkpointing runs one nested backward pass per block; dpoptim clips them
    together (clipped per block, one example would move the update by sqrt(2) C/B here)."""
    torch.manual_seed(0)
    assert_clean(_check(CheckpointedAdapters(reentrant=True), _ids_batch(), max_grad_norm=0.01))


def test_passes_sum_reduction():
    def summed(m, batch):
        x, y = batch
        return F.cross_entropy(m(x), y, reduction="sum")

    assert_clean(_check(_mlp(), _data(), summed, loss_reduction="sum"))


def test_sum_loss_declared_as_mean_is_flagged():
    """A summed loss with the default loss_reduction='mean': each example counted n times."""

    def summed(m, batch):
        x, y = batch
        return F.cross_entropy(m(x), y, reduction="sum")

    assert_flagged(_check(_mlp(), _data(), summed, max_grad_norm=100.0), "(2)", "Pass loss_reduction='sum'")


def test_float32_fallback_when_the_loss_insists_on_float32():
    mix = torch.eye(K)  # a float32 constant: a float64 output cannot be multiplied with it

    def loss(m, batch):
        x, y = batch
        return F.cross_entropy(m(x) @ mix, y)

    result = _check(_mlp(), _data(), loss)
    assert_clean(result)
    assert result.dtype == torch.float32 and result.tolerance > 1e-6


# ---------------------------------------------------------------------- the user's model and state
def test_leaves_the_model_gradients_mode_and_generators_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 8), nn.Dropout(0.2), nn.Linear(8, K))
    model[0].weight.grad = torch.full_like(model[0].weight, 7.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    result = _check(model, _data())
    assert result.passed
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.training and model[1].p == 0.2 and model[0].weight.dtype == torch.float32
    assert torch.equal(model[0].weight.grad, torch.full_like(model[0].weight, 7.0)) and model[2].weight.grad is None


def test_eval_mode_batchnorm_passes():
    """BatchNorm in eval mode uses its running statistics: no coupling. The check keeps the
    model's mode, so it passes (and notes dpoptim's eval-mode warning)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(D, 4), nn.BatchNorm1d(4), nn.Linear(4, K))
    model[1].eval()
    assert_clean(_check(model, _data()))


def test_arguments_are_checked():
    model, batch = _mlp(), _data()
    with pytest.raises(ValueError, match="at least 2 examples"):
        dpoptim.check(model, (batch[0][:1], batch[1][:1]), ce)
    with pytest.raises(ValueError, match="example axis at dim 0"):
        dpoptim.check(model, (batch[0], batch[1][:3]), ce)
    with pytest.raises(ValueError, match="loss_reduction"):
        dpoptim.check(model, batch, ce, loss_reduction="none")
    with pytest.raises(ValueError, match="micro_batch_size"):
        dpoptim.check(model, batch, ce, micro_batch_size=0)
    result = dpoptim.check(model, batch, lambda m, b: F.cross_entropy(m(b[0]), b[1], reduction="none"))
    assert_flagged(result, "scalar")


def test_report_reads_as_a_list_of_problems():
    torch.manual_seed(0)
    text = str(_check(Centred(), _data()))
    assert text.startswith("dpoptim.check: FAILED")
    assert "problem 1:" in text and "C/B" in text
    assert math.isfinite(_check(Centred(), _data()).sensitivity)
