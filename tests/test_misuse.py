"""Careless-user patterns: each is either exact (the noise-free update moves by at most C/B
when one example is removed, and equals the brute-force clipped sum) or refused with an
error that names the fix."""

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import dpoptim
import oracle
from oracle import check_rule_case, mse

C = 1.0


def _opt(params, cls=dpoptim.DPSGD, **kwargs):
    settings = dict(lr=1.0, noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=1, sample_rate=0.5)
    settings.update(kwargs)
    return cls(params, **settings)


def _flat(params):
    return torch.cat([p.detach().flatten() for p in params])


def update(model, x, y, loss=mse, train_step=None):
    """Minus the noise-free DPSGD update (lr 1, B 1) of one step on (x, y), taken after a
    first step has been checked against autograd (later steps take other code paths).
    ``train_step(model, x, y)`` runs what comes between zero_grad() and step()."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    opt = _opt(params)
    start = [p.detach().clone() for p in params]
    train_step = train_step or (lambda m, x, y: loss(m(x), y).mean().backward())
    for _ in range(2):
        with torch.no_grad():
            for p, s in zip(params, start):
                p.copy_(s)
        opt.zero_grad()
        train_step(model, x, y)
        opt.step()
    return _flat(start) - _flat(params)


def sensitivity(model, x, y, loss=mse, train_step=None):
    """max over examples i of ||update(D) - update(D without i)|| in units of C/B (B = 1)."""
    full = update(model, x, y, loss, train_step)
    worst = 0.0
    for i in range(len(x)):
        keep = [j for j in range(len(x)) if j != i]
        worst = max(worst, float((full - update(model, x[keep], y[keep], loss, train_step)).norm()) / C)
    return worst


# ----------------------------------------------------------------------------- checkpointing
class Checkpointed(nn.Module):
    """``k`` Linear blocks under reentrant checkpointing, optionally a trainable layer before
    (outside any segment) and after: the placements a LoRA setup and a plain one use."""

    def __init__(self, k, before, after):
        super().__init__()
        self.before = nn.Linear(4, 4).double() if before else None
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(4, 4), nn.Tanh()).double() for _ in range(k))
        self.after = nn.Linear(4, 2).double() if after else None
        self.checkpointed = True

    def forward(self, x):
        x = self.before(x) if self.before is not None else x.detach().requires_grad_()
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=True) if self.checkpointed else block(x)
        return self.after(x) if self.after is not None else x


@pytest.mark.parametrize("k, before, after", [(1, False, False), (3, False, False), (2, True, False),
                                              (2, False, True), (2, True, True)])
def test_reentrant_checkpointing_is_exact(k, before, after):
    torch.manual_seed(k)
    x, y = 30 * torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 2 if after else 4, dtype=torch.float64)
    model = Checkpointed(k, before, after)
    # The oracle runs the same function without checkpointing: reentrant checkpointing
    # does not support torch.autograd.grad, which the per-example loop uses.
    plain = copy.deepcopy(model)
    plain.checkpointed = False
    params = list(plain.parameters())
    expected, norms = oracle.clipped_sum(
        oracle.per_example_gradients(plain, (x,), y, lambda m, x: m(x), mse), C, params)
    assert max(norms) > 2 * C  # some examples are clipped
    got = update(model, x, y)
    assert torch.allclose(got, _flat(expected), rtol=1e-9, atol=1e-12)
    assert sensitivity(model, x, y) <= 1 + 1e-9


# ----------------------------------------------------------------------------- gradients dpoptim did not make
def test_freezing_between_backward_and_step_still_applies_a_privatised_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = 50 * torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)

    def step_and_freeze(model, x, y):
        mse(model(x), y).mean().backward()
        model[0].weight.requires_grad_(False)  # a callback between backward() and step()

    def step_and_unfreeze(model, x, y):
        model[0].weight.requires_grad_(True)
        step_and_freeze(model, x, y)

    assert sensitivity(model, x, y, train_step=step_and_unfreeze) <= 1 + 1e-9
    # and what it applies is the clipped sum, not autograd's raw gradient (which is ~100x C)
    frozen, plain = update(model, x, y, train_step=step_and_unfreeze), update(model, x, y)
    assert torch.allclose(frozen, plain, rtol=1e-9, atol=1e-12)


def test_a_parameter_frozen_for_good_gets_no_fresh_noise():
    """Frozen after some steps while keeping its (zeroed) .grad: torch would apply that
    stale gradient, and so does dpoptim; it adds no noise to a parameter no backward reached."""
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = _opt(model.parameters(), noise_multiplier=1.0, lr=0.1)
    opt.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    model[0].requires_grad_(False)
    frozen = _flat(model[0].parameters())
    for _ in range(3):
        opt.zero_grad(set_to_none=False)
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    assert torch.equal(frozen, _flat(model[0].parameters()))


def test_a_gradient_set_by_hand_is_refused():
    model = nn.Linear(3, 2)
    opt = _opt(model.parameters())
    loss = model(torch.randn(4, 3)).square().mean()
    grads = torch.autograd.grad(loss, list(model.parameters()))
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    before = _flat(model.parameters())
    with pytest.raises(RuntimeError, match="holds a .grad that no backward"):
        opt.step()
    assert torch.equal(before, _flat(model.parameters()))


def test_a_gradient_from_before_the_optimizer_is_refused_and_a_stale_own_one_is_not():
    model = nn.Linear(3, 2)
    model(torch.randn(4, 3)).sum().backward()
    opt = _opt(model.parameters(), noise_multiplier=1.0)
    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.step()
    opt.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    opt.step()  # no backward since: the stale .grad is dpoptim's own, a noise-only step
    assert opt.steps_taken == 2


def test_clearing_with_model_zero_grad_and_skipping_a_step_forgets_that_batch():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    first, second = torch.randn(5, 3), torch.randn(3, 3)

    def copy_with_optimizer(warm):
        """A copy of ``model`` and its DPSGD; ``warm``: past the checked first step."""
        m = copy.deepcopy(model)
        opt = _opt(m.parameters())
        if warm:
            opt.zero_grad()
            m(first).sum().backward()
            opt.step()
            m.load_state_dict(model.state_dict())
        return m, opt

    for set_to_none in (True, False):
        for warm in (False, True):  # the checked first step, and a later one
            m, opt = copy_with_optimizer(warm)
            m.zero_grad(set_to_none=set_to_none)
            m(first).square().mean().backward()
            m.zero_grad(set_to_none=set_to_none)  # the loop skipped step() for that batch
            m(second).square().mean().backward()
            assert opt._engine.examples == len(second)
            opt.step()
            ref, opt2 = copy_with_optimizer(warm)
            opt2.zero_grad()
            ref(second).square().mean().backward()
            opt2.step()
            assert torch.allclose(_flat(m.parameters()), _flat(ref.parameters()), atol=1e-6)


def test_clearing_some_gradients_between_backwards_is_refused():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt = _opt(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    model[1].zero_grad()  # only part of the model
    model(torch.randn(4, 3)).sum().backward()
    with pytest.raises(dpoptim.UnsupportedLayerError, match="cleared"):
        opt.step()


def test_virtual_batches_still_accumulate():
    model = nn.Linear(3, 2)
    opt = _opt(model.parameters())
    for _ in range(2):
        opt.zero_grad()
        for n in (4, 3):
            model(torch.randn(n, 3)).sum().backward()
        assert opt._engine.examples == 7
        opt.step()


def test_two_dp_optimizers_in_one_backward_are_refused():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        first, second = _opt(model[0].parameters()), _opt(model[2].parameters())
    model(torch.randn(4, 3)).sum().backward()
    for opt in (first, second):
        with pytest.raises(dpoptim.UnsupportedLayerError, match="two DP optimizers"):
            opt.step()
    # separate backward passes (two models, or two losses) are not one mechanism twice
    for opt in (first, second):
        opt.zero_grad()
    model[2](torch.randn(4, 4)).sum().backward()
    model[0](torch.randn(4, 3)).sum().backward()
    first.step()
    second.step()


# ----------------------------------------------------------------------------- reshaped examples
class Flattened(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))

    def forward(self, x):
        n, t, d = x.shape
        return self.mlp(x.reshape(-1, d)).reshape(n, t, d)


class SequenceFirst(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x.transpose(0, 1)))).transpose(0, 1)


class Chunked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        return torch.cat([self.a(chunk) for chunk in x.split(2)])


@pytest.mark.parametrize("make, shape", [(Flattened, (3, 5, 4)), (SequenceFirst, (3, 5, 4)), (Chunked, (6, 4))])
def test_examples_reshaped_inside_the_model_are_refused(make, shape):
    model = make()
    opt = _opt(model.parameters())
    for _ in range(2):  # the checked first step and a later one (after a clean step)
        with pytest.raises(RuntimeError, match="reshaped on the way"):
            model(torch.randn(*shape)).square().mean().backward()
        opt.zero_grad()


class SequenceFirstRNN(nn.Module):
    """A legitimate sequence-first model: the recurrent layer knows its batch is dim 1."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(4, 5)
        self.head = nn.Linear(5, 2)

    def forward(self, x):  # x: [T, n, 4]
        out, _ = self.rnn(x)
        return self.head(out[-1])


class KeywordsOnly(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, input_ids=None, attention_mask=None):
        return self.head((self.emb(input_ids) * attention_mask.unsqueeze(-1)).sum(1))


def test_models_that_keep_examples_apart_are_not_refused():
    torch.manual_seed(0)
    x, y = torch.randn(7, 3, 4, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    check_rule_case(lambda: SequenceFirstRNN().double(), (x,), y, lambda m, x: m(x), mse, batch_dims=(1,))
    ids, mask = torch.randint(0, 10, (3, 5)), torch.ones(3, 5, dtype=torch.float64)
    check_rule_case(lambda: KeywordsOnly().double(), (ids, mask), y,
                    lambda m, ids, mask: m(input_ids=ids, attention_mask=mask), mse)


# ----------------------------------------------------------------------------- checkpoints
def _trained(sample_rate=0.05, steps=3, **kwargs):
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=4, sample_rate=sample_rate, **kwargs)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    return model, opt


def _roundtrip(state):
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_resume_with_new_settings_keeps_the_constructors_and_says_so():
    model, opt = _trained(sample_rate=0.05, max_epsilon=50.0)
    state = _roundtrip(opt.state_dict())
    del opt  # as in a new process: one DP optimizer per parameter
    resumed = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0,
                            expected_batch_size=4, sample_rate=0.005, max_epsilon=20.0, delta=1e-6)
    with pytest.warns(dpoptim.PrivacyWarning, match="sample_rate=0.05 in the checkpoint, 0.005 now"):
        resumed.load_state_dict(state)
    assert (resumed.sample_rate, resumed.max_epsilon, resumed.delta) == (0.005, 20.0, 1e-6)
    resumed.zero_grad()
    model(torch.randn(4, 3)).sum().backward()
    resumed.step()
    assert resumed.ledger == ((1.0, 0.05, 3), (1.0, 0.005, 1))


def test_resume_with_the_same_settings_is_silent():
    model, opt = _trained()
    state, ledger = _roundtrip(opt.state_dict()), opt.ledger
    del opt
    fresh = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0,
                          expected_batch_size=4, sample_rate=0.05)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fresh.load_state_dict(state)
    assert fresh.ledger == ledger


def test_loading_never_lowers_the_charge_without_being_asked():
    model, opt = _trained(steps=3)
    early = _roundtrip(opt.state_dict())
    blank = dpoptim.DPSGD(nn.Linear(3, 2).parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0,
                          expected_batch_size=4, sample_rate=0.05).state_dict()
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    # a fresh optimizer's state, or an earlier checkpoint of this run: the 5 steps stay charged
    for state in (blank, early):
        opt.load_state_dict(state)
        assert opt.ledger == ((1.0, 0.05, 5),)
    # a history this run does not contain: refused unless told how
    _, other = _trained(sample_rate=0.1, steps=2)
    foreign = other.state_dict()
    del other
    with pytest.raises(ValueError, match="lower the privacy"):
        opt.load_state_dict(foreign)
    assert opt.ledger == ((1.0, 0.05, 5),)
    with pytest.warns(dpoptim.PrivacyWarning, match="constructor's privacy settings"):
        opt.load_state_dict(foreign, ledger="both")
    assert opt.ledger == ((1.0, 0.05, 5), (1.0, 0.1, 2))
    with pytest.warns(dpoptim.PrivacyWarning):
        opt.load_state_dict(foreign, ledger="checkpoint")
    assert opt.ledger == ((1.0, 0.1, 2),)


# ----------------------------------------------------------------------------- seeds
def _is_32_bit_seeded(generator):
    """Whether a CPU generator's Mersenne Twister words follow manual_seed's initialisation
    recurrence ``w[i] = 1812433253 * (w[i-1] ^ (w[i-1] >> 30)) + i`` (mod 2^32)."""
    words = generator.get_state()[24:24 + 8 * 624].view(torch.int64).tolist()
    return all(words[i] == (1812433253 * (words[i - 1] ^ (words[i - 1] >> 30)) + i) & 0xFFFFFFFF
               for i in range(1, 624))


def test_default_sampler_state_comes_whole_from_the_os():
    assert _is_32_bit_seeded(torch.Generator().manual_seed(12345))  # the test can fail
    a, b = dpoptim.data.PoissonBatchSampler(100, 0.1), dpoptim.data.PoissonBatchSampler(100, 0.1)
    assert not _is_32_bit_seeded(a.generator) and not _is_32_bit_seeded(b.generator)
    assert not torch.equal(a.generator.get_state(), b.generator.get_state())


# ----------------------------------------------------------------------------- refused at construction
@pytest.mark.parametrize("cls", [torch.optim.LBFGS, torch.optim.SparseAdam])
def test_optimizers_that_cannot_be_private_are_refused_at_construction(cls):
    with pytest.raises(TypeError, match=cls.__name__):
        dpoptim.make_private(cls)
    subclass = type("Mine", (dpoptim.DPOptimizerMixin, cls), {})
    with pytest.raises(TypeError, match=cls.__name__):
        subclass(nn.Linear(2, 2).parameters(), noise_multiplier=1.0, max_grad_norm=1.0,
                 expected_batch_size=4, sample_rate=0.1)


def test_torch_compile_wrapper_is_refused_with_the_fix():
    model = nn.Linear(3, 2)
    opt = _opt(model.parameters())  # noqa: F841
    compiled = torch.compile(model)
    with pytest.raises(RuntimeError, match=r"model\.compile\(\)"):
        compiled(torch.randn(4, 3))
    with torch.no_grad():
        model(torch.randn(4, 3))  # the engine's bookkeeping survived the refusal
    F.mse_loss(model(torch.randn(4, 3)), torch.zeros(4, 2)).backward()
    opt.step()


# ----------------------------------------------------------------------------- couplings no hook sees
# Each pattern makes the per-example gradients depend on the rest of the batch. No error is
# possible (docs/privacy.md says so, and dpoptim.check finds them); these tests show that the
# hazard is real (sensitivity above 1 at some scale of the data) and that the per-example
# form docs/privacy.md gives for each is safe (at most 1 at every scale).
SCALES = (0.1, 0.3, 1.0, 3.0, 10.0)


def _token_batch(n=4, t=6, d=3, vocab=5):
    x = torch.randn(n, t, d, dtype=torch.float64)
    y = torch.randint(0, vocab, (n, t))
    y[1:, 1:] = -100  # one long example, the rest one token each
    return x, y


def token_mean(m, x, y):
    F.cross_entropy(m(x).flatten(0, 1), y.flatten(), ignore_index=-100).backward()


def token_mean_per_example(m, x, y):
    per_token = F.cross_entropy(m(x).transpose(1, 2), y, ignore_index=-100, reduction="none")
    (per_token.sum(1) / (y != -100).sum(1).clamp(min=1)).mean().backward()


def _class_batch(n=5, d=3):
    return torch.randn(n, d, dtype=torch.float64), torch.tensor([1] + [0] * (n - 1))


WEIGHTS = torch.tensor([1.0, 20.0], dtype=torch.float64)


def class_weighted(m, x, y):
    F.cross_entropy(m(x), y, weight=WEIGHTS).backward()


def class_weighted_per_example(m, x, y):
    F.cross_entropy(m(x), y, weight=WEIGHTS, reduction="none").mean().backward()


class Normalised(nn.Module):
    def __init__(self, how):
        super().__init__()
        self.a, self.b, self.how = nn.Linear(3, 4).double(), nn.Linear(4, 2).double(), how

    def forward(self, x):
        h = self.a(x)
        if self.how == "centre":
            h = h - h.mean(0)
        elif self.how == "batch_norm":
            h = F.batch_norm(h, None, None, training=True)
        else:  # the per-example form
            h = F.layer_norm(h, h.shape[1:])
        return self.b(h)


def regress(m, x, y):
    mse(m(x), y).mean().backward()


def summed_with_mean_reduction(m, x, y):
    mse(m(x), y).sum().backward()


def info_nce(m, x, y):
    anchors, positives = F.normalize(m(x[:, 0]), dim=1), F.normalize(m(x[:, 1]), dim=1)
    F.cross_entropy(anchors @ positives.T / 0.1, torch.arange(len(x))).backward()


PUBLIC = torch.randn(6, 3, dtype=torch.float64)


def info_nce_public_negatives(m, x, y):
    anchors, positives = F.normalize(m(x[:, 0]), dim=1), F.normalize(m(x[:, 1]), dim=1)
    with torch.no_grad():
        negatives = F.normalize(m(PUBLIC), dim=1)
    logits = torch.cat([(anchors * positives).sum(1, keepdim=True), anchors @ negatives.T], 1) / 0.1
    F.cross_entropy(logits, torch.zeros(len(x), dtype=torch.long)).backward()


COUPLINGS = {
    "token-mean loss": (lambda: nn.Linear(3, 5).double(), _token_batch, token_mean, token_mean_per_example),
    "class-weighted loss": (lambda: nn.Linear(3, 2).double(), _class_batch, class_weighted, class_weighted_per_example),
    "batch centring": (lambda: Normalised("centre"), lambda: (torch.randn(5, 3, dtype=torch.float64),
                                                              torch.randn(5, 2, dtype=torch.float64)),
                       regress, None),
    "parameter-free batch_norm": (lambda: Normalised("batch_norm"), lambda: (torch.randn(5, 3, dtype=torch.float64),
                                                                             torch.randn(5, 2, dtype=torch.float64)),
                                  regress, None),
    "contrastive loss": (lambda: nn.Linear(3, 4).double(), lambda: (torch.randn(5, 2, 3, dtype=torch.float64),
                                                                    torch.zeros(5)),
                         info_nce, info_nce_public_negatives),
    # identical examples: their gradients align, so the rescaling of the others adds up
    "loss_reduction mismatch": (lambda: nn.Linear(3, 2, bias=False).double(),
                                lambda: (torch.randn(1, 3, dtype=torch.float64).expand(5, 3).clone(),
                                         torch.zeros(5, 2, dtype=torch.float64)),
                                summed_with_mean_reduction, regress),
}


@pytest.mark.parametrize("name", COUPLINGS)
def test_couplings_no_hook_sees_break_the_bound_and_their_per_example_forms_do_not(name):
    make, data, pattern, per_example = COUPLINGS[name]
    torch.manual_seed(0)
    model, (x, y) = make(), data()
    scales = [10 ** (k / 8) for k in range(-16, 9)] if name == "loss_reduction mismatch" else SCALES
    worst = max(sensitivity(model, s * x, y, train_step=pattern) for s in scales)
    assert worst > 1.2, f"{name}: the pattern stayed within the bound ({worst:.3f})"
    if per_example is None:  # the per-example form is another model
        model, per_example = Normalised("layer_norm"), regress
    safe = max(sensitivity(model, s * x, y, train_step=per_example) for s in SCALES)
    assert safe <= 1 + 1e-9, f"{name}: the per-example form moved the update by {safe:.3f} C/B"


def test_no_doc_or_example_teaches_a_fixed_noise_or_sampling_seed():
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    files = [root / "README.md", *(root / "docs").glob("*.md"), *(root / "examples").glob("*.py")]
    seeded = re.compile(r"generator\s*=\s*torch\.Generator\([^)]*\)\s*\.manual_seed")
    found = [f"{path.name}:{text.count(chr(10), 0, m.start()) + 1}"
             for path in files for text in [path.read_text()] for m in seeded.finditer(text)]
    assert not found, f"a fixed seed for noise or sampling is taught in {found}"


def test_model_compile_in_place_trains_exactly():
    """docs/privacy.md: model.compile() works where torch.compile(model) is refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = 20 * torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    plain = update(model, x, y)
    compiled = copy.deepcopy(model)
    compiled.compile()
    assert torch.allclose(update(compiled, x, y), plain, rtol=1e-9, atol=1e-12)


class OutsideUse(nn.Module):
    """An embedding whose weight is also read outside its module (an output layer written
    as a matrix product): its gradient there is invisible to the hooks."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4)

    def forward(self, ids):
        return self.emb(ids).mean(1) @ self.emb.weight.T


def test_check_reports_a_parameter_used_outside_its_module():
    """docs/privacy.md sends users to dpoptim.check for uses outside a module that the
    engine stops seeing after its first step."""
    torch.manual_seed(0)
    ids, y = torch.randint(0, 7, (6, 3)), torch.randint(0, 7, (6,))
    result = dpoptim.check(OutsideUse(), (ids, y), lambda m, b: F.cross_entropy(m(b[0]), b[1]))
    assert not result.passed
    assert "weight" in "\n".join(result.failures)


def test_a_forward_that_raised_leaves_no_stale_model_call_behind():
    """The outermost call is tracked per forward; one that raised must not be taken for the
    model around the next forward's layers (they would seem to see a wrong batch size)."""

    class Fails(nn.Module):
        def forward(self, x):
            raise ValueError("inside the model")

    model, broken = nn.Linear(3, 2), nn.Sequential(nn.Linear(3, 3), Fails())
    opt = _opt(model.parameters())
    with pytest.raises(ValueError, match="inside the model"):
        broken(torch.randn(5, 3))
    model(torch.randn(4, 3)).sum().backward()
    opt.step()


def test_torch_compile_wrapper_after_the_first_step_is_exact_or_refused():
    """After the first step the hooks sit on the model's own modules, not process-wide, so
    the wrapper torch.compile(model) returns is no longer seen being called. Whatever the
    compiled forward does with those hooks, the step must be the exact clipped one or be
    refused."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    x, y = 20 * torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    plain = update(model, x, y)
    calls = []

    def step(m, x, y):
        calls.append(m)
        forward = m if len(calls) == 1 else torch.compile(m)  # compiled from the second step on
        mse(forward(x), y).mean().backward()

    try:
        compiled = update(model, x, y, train_step=step)
    except (RuntimeError, dpoptim.UnsupportedLayerError) as exc:
        assert "compile" in str(exc)
        return
    assert torch.allclose(compiled, plain, rtol=1e-9, atol=1e-12)
