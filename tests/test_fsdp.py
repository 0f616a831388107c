"""Two gloo processes training models sharded with FSDP2 (``fully_shard``) against one
process training the same models unsharded.

One pair of processes runs every scenario; the checks run here in the parent, on what each
rank saved: every rank saves the full parameters (``DTensor.full_tensor``) after training,
and the parent trains the unsharded model itself with the same data, settings and seed.
"""

import math
import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

import dpoptim
from dpoptim import fsdp as fsdp_module
from dpoptim.data import split_batch
from ranks import error_of, run_scenarios

fsdp_api = pytest.importorskip("torch.distributed.fsdp")
pytestmark = pytest.mark.skipif(
    not dist.is_available() or not dist.is_gloo_available() or not hasattr(fsdp_api, "fully_shard"),
    reason="needs gloo and FSDP2",
)

WORLD = 2
LR, CLIP, BATCH, Q, SIGMA = 0.5, 2.5, 8.0, 0.25, 1.0


# ----------------------------------------------------------------- models and data
def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)).double()


def shard_mlp(model):
    for block in (model[0], model[2]):
        fsdp_api.fully_shard(block)
    return fsdp_api.fully_shard(model)


def mse(out, y):
    return 0.5 * (out - y).square().sum(1)


def mlp_batches(steps=3):
    g = torch.Generator().manual_seed(1)
    return [((torch.randn(8, 4, generator=g, dtype=torch.float64),), torch.randn(8, 3, generator=g, dtype=torch.float64))
            for _ in range(steps)]


VOCAB, T = 24, 5


def llama(lora=False):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                                      tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(config).double()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    if lora:
        peft = pytest.importorskip("peft")
        spec = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        model = peft.get_peft_model(model, spec)
        for name, p in model.named_parameters():
            if "lora_B" in name:  # peft starts B at zero, which makes A's gradient zero
                nn.init.normal_(p)
    return model


def shard_llama(model):
    for layer in model.get_decoder().layers:
        fsdp_api.fully_shard(layer)
    return fsdp_api.fully_shard(model)


def token_loss(logits, ids):
    losses = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return losses.view(ids.shape[0], -1).mean(1)


def llama_batches(steps=2):
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, VOCAB, (8, T), generator=g) for _ in range(steps)]
    return [((x,), x) for x in ids]


def llama_forward(model, ids):
    return model(input_ids=ids).logits


def mlp_forward(model, x):
    return model(x)


class Table(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding, self.layer, self.group = nn.Embedding(10, 4), nn.LayerNorm(4), nn.GroupNorm(2, 4)

    def forward(self, indices, h):
        return self.group(self.layer(self.embedding(indices).mean(1) + h))


class Zoo(nn.Module):
    """One FSDP block per kind of rule, each behind a trainable layer (so FSDP releases the
    block's weights during the backward, before the clipping at its end)."""

    def __init__(self):
        super().__init__()
        self.pre = nn.Linear(24, 24)
        self.conv = nn.Conv1d(3, 4, 3)
        self.attention = nn.MultiheadAttention(6, 2, batch_first=True)
        self.lstm = nn.LSTM(6, 5, batch_first=True)
        self.table = Table()
        self.head = nn.Linear(24 + 5 + 4, 3)

    def forward(self, x):
        h = torch.tanh(self.pre(x))
        c = torch.tanh(self.conv(h.view(-1, 3, 8))).flatten(1)
        s = h.view(-1, 4, 6)
        a = self.attention(s, s, s, need_weights=False)[0]
        r = self.lstm(a)[0][:, -1]
        e = self.table((x[:, :3].abs() * 3).long().clamp(max=9), h[:, :4])
        return self.head(torch.cat([c, r, e], 1))


def zoo():
    torch.manual_seed(0)
    return Zoo().double()


def shard_zoo(model):
    for block in (model.conv, model.attention, model.lstm, model.table):
        fsdp_api.fully_shard(block)
    return fsdp_api.fully_shard(model)


def zoo_batches(steps=2):
    g = torch.Generator().manual_seed(4)
    return [((torch.randn(8, 24, generator=g, dtype=torch.float64),), torch.randn(8, 3, generator=g, dtype=torch.float64))
            for _ in range(steps)]


CASES = {
    "zoo": (zoo, shard_zoo, zoo_batches, mlp_forward, mse),
    "mlp": (mlp, shard_mlp, mlp_batches, mlp_forward, mse),
    "llama_tied": (llama, shard_llama, llama_batches, llama_forward, token_loss),
    "lora": (lambda: llama(lora=True), shard_llama, llama_batches, llama_forward, token_loss),
}


def share(rank, world, how):
    """This rank's examples of a global batch: every world-th ("strided"), or all on
    rank 0 and none elsewhere ("lopsided")."""
    if how == "strided":
        return lambda t: t[rank::world]
    return lambda t: t if rank == 0 else t[:0]


def train(case, rank, world, optimizer="sgd", sigma=0.0, sharded=True, how="strided", chunk=None, cleared=False,
          frozen_first=False):
    """``frozen_first``: the first layer is frozen for the first step, trained after."""
    make, shard, batches, forward, loss = CASES[case]
    model = make()
    if sharded:
        shard(model)
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(noise_multiplier=sigma, max_grad_norm=CLIP, expected_batch_size=BATCH, sample_rate=Q,
                  generator=torch.Generator().manual_seed(7))
    opt = (dpoptim.DPSGD(params, lr=LR, **kwargs) if optimizer == "sgd"
           else dpoptim.DPAdam(params, lr=0.05, **kwargs))
    mine = share(rank, world, how)
    for step, (inputs, target) in enumerate(batches()):
        if frozen_first:
            model[0].requires_grad_(step > 0)
        opt.zero_grad()
        if cleared:  # a batch backpropagated, then cleared with the model: torch forgets it
            loss(forward(model, *(3 * mine(t) for t in inputs)), mine(target)).mean().backward()
            model.zero_grad()
        batch = (tuple(mine(t) for t in inputs), mine(target))
        chunks = [batch] if chunk is None else split_batch(batch, chunk, synchronize_ranks=True)
        for chunk_inputs, chunk_target in chunks:
            loss(forward(model, *chunk_inputs), chunk_target).mean().backward()
        opt.step()
    return full(model), opt.ledger


def full(model):
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.named_parameters()}


# ----------------------------------------------------------------- scenarios on each rank
def noise_law(rank):
    """Zero gradients (no examples on any rank): each shard holds noise / B only. Default
    generators, so each rank draws its own slice."""
    torch.manual_seed(0)
    model = nn.Linear(64, 48, bias=False).double()
    fsdp_api.fully_shard(model)
    opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=SIGMA, max_grad_norm=CLIP,
                        expected_batch_size=BATCH, sample_rate=Q)
    before = full(model)["weight"]
    opt.zero_grad()
    model(torch.zeros(0, 64, dtype=torch.float64)).sum().backward()  # an empty share on every rank
    opt.step()
    return before - full(model)["weight"]  # lr 1: the privatised gradient


def sensitivity(rank, scaled=False):
    """One noise-free DPSGD step (lr 1) on a batch D and on D without its first example
    (which rank 0 holds): the updates' difference, in units of C / B, and the update of D.
    ``scaled``: under a GradScaler of 2^10, which the sharded sums must divide out."""
    updates = []
    for drop in (False, True):
        model = mlp()
        shard_mlp(model)
        before = full(model)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2**31 - 1) if scaled else None
        opt = dpoptim.DPSGD(model.parameters(), lr=1.0, noise_multiplier=0.0, max_grad_norm=CLIP,
                            expected_batch_size=BATCH, sample_rate=Q, grad_scaler=scaler)
        (x,), y = mlp_batches(1)[0]
        x, y = 10 * x[int(drop):], 10 * y[int(drop):]  # large gradients: every example is clipped
        opt.zero_grad()
        loss = mse(model(x[rank::WORLD]), y[rank::WORLD]).mean()
        (loss if scaler is None else scaler.scale(loss)).backward()
        opt.step()
        after = full(model)
        updates.append(torch.cat([(before[n] - after[n]).flatten() for n in before]))
    return float((updates[0] - updates[1]).norm() / (CLIP / BATCH)), updates[0]


def resume(rank):
    """DPAdam with noise: 2 steps, a sharded checkpoint (each rank saves its own shards),
    then 2 more steps in a fresh model and optimizer loaded from it."""
    def build():
        model = mlp()
        shard_mlp(model)
        opt = dpoptim.DPAdam(model.parameters(), lr=0.05, noise_multiplier=SIGMA, max_grad_norm=CLIP,
                             expected_batch_size=BATCH, sample_rate=Q, generator=torch.Generator().manual_seed(7))
        return model, opt

    def steps(model, opt, batches):
        for (x,), y in batches:
            opt.zero_grad()
            mse(model(x[rank::WORLD]), y[rank::WORLD]).mean().backward()
            opt.step()

    batches = mlp_batches(4)
    model, opt = build()
    steps(model, opt, batches[:2])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, f"checkpoint{rank}.pt")  # this rank's shards
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
        steps(model, opt, batches[2:])
        straight = full(model)

        model, opt = build()
        saved = torch.load(path, weights_only=False)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    steps(model, opt, batches[2:])
    return straight, full(model), opt.ledger


def held_at_full_size(rank):
    """The most numbers of full-size clipped sums of sharded parameters a rank holds at
    once during one backward, against all its sharded parameters' numbers."""
    model = mlp()
    shard_mlp(model)
    opt = dpoptim.DPSGD(model.parameters(), lr=LR, noise_multiplier=0.0, max_grad_norm=CLIP,
                        expected_batch_size=BATCH, sample_rate=Q)
    engine, held = opt._engine, []
    reduce = engine._reduce_sharded

    def watching(params):
        held.append(sum(t.numel() for pid, t in engine._sums.items() if fsdp_module.is_sharded(engine._params[pid])))
        reduce(params)

    engine._reduce_sharded = watching
    for (x,), y in mlp_batches(2):
        opt.zero_grad()
        mse(model(x[rank::WORLD]), y[rank::WORLD]).mean().backward()
        opt.step()
    return max(held), sum(p.numel() for p in model.parameters())


def distributed_checkpoint_helpers(rank):
    """torch.distributed.checkpoint's state_dict helpers drop the ledger: both ways refused."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def trained():
        model = mlp()
        shard_mlp(model)
        opt = dpoptim.DPAdam(model.parameters(), lr=0.05, noise_multiplier=SIGMA, max_grad_norm=CLIP,
                             expected_batch_size=BATCH, sample_rate=Q)
        (x,), y = mlp_batches(1)[0]
        opt.zero_grad()
        mse(model(x[rank::WORLD]), y[rank::WORLD]).mean().backward()
        opt.step()
        return model, opt

    model, opt = trained()
    _, saved = get_state_dict(model, opt)
    fresh = mlp()
    shard_mlp(fresh)
    fresh_opt = dpoptim.DPAdam(fresh.parameters(), lr=0.05, noise_multiplier=SIGMA, max_grad_norm=CLIP,
                               expected_batch_size=BATCH, sample_rate=Q)
    other, other_opt = trained()
    return (
        "dpoptim" in saved,
        error_of(lambda: get_state_dict(fresh, fresh_opt), RuntimeError),  # its init step()
        error_of(lambda: set_state_dict(other, other_opt, model_state_dict={}, optim_state_dict=saved), ValueError),
        other_opt.ledger,
    )


def refused(rank, what):
    model = mlp()
    if what == "mp_policy":
        policy = fsdp_api.MixedPrecisionPolicy(param_dtype=torch.float32)
        fsdp_api.fully_shard(model, mp_policy=policy)
    elif what == "hsdp":  # a 2-D mesh
        from torch.distributed.device_mesh import init_device_mesh

        fsdp_api.fully_shard(model, mesh=init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("replicate", "shard")))
    else:  # tensor parallelism: the layer computes with the DTensor itself
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        parallelize_module(model, init_device_mesh("cpu", (WORLD,)), {"0": ColwiseParallel()})
    opt = dpoptim.DPSGD(model.parameters(), lr=LR, noise_multiplier=0.0, max_grad_norm=CLIP,
                        expected_batch_size=BATCH, sample_rate=Q)
    x = torch.randn(4, 4, dtype=torch.float64)

    def step():
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    return error_of(step, RuntimeError)


def scenarios(rank):
    """Every scenario on this rank, in one gloo group."""
    results = {
        "mlp": train("mlp", rank, WORLD),
        "mlp_lopsided": train("mlp", rank, WORLD, how="lopsided"),
        "mlp_chunks": train("mlp", rank, WORLD, how="lopsided", chunk=3),
        "mlp_cleared": train("mlp", rank, WORLD, cleared=True),
        "mlp_frozen": train("mlp", rank, WORLD, frozen_first=True),
        "zoo": train("zoo", rank, WORLD),
        "sensitivity": sensitivity(rank),
        "sensitivity_scaled": sensitivity(rank, scaled=True),
        "mlp_adam_noise": train("mlp", rank, WORLD, optimizer="adam", sigma=SIGMA),
        "noise_law": noise_law(rank),
        "resume": resume(rank),
        "mp_policy": refused(rank, "mp_policy"),
        "hsdp": refused(rank, "hsdp"),
        "tensor_parallel": refused(rank, "tensor_parallel"),
        "dcp_helpers": distributed_checkpoint_helpers(rank),
        "held": held_at_full_size(rank),
    }
    try:
        import peft  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        pass
    else:
        results["llama_tied"] = train("llama_tied", rank, WORLD)
        results["lora"] = train("lora", rank, WORLD, optimizer="adam")
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_scenarios(scenarios, tmp_path_factory.mktemp("fsdp"), WORLD)


def assert_same(got, expected, rtol=1e-6):
    assert got.keys() == expected.keys()
    for name in expected:
        error = (got[name] - expected[name]).norm() / expected[name].norm().clamp_min(1e-300)
        assert error <= rtol, (name, float(error))


# ----------------------------------------------------------------- the checks
@pytest.mark.parametrize("case,optimizer,sigma", [
    ("mlp", "sgd", 0.0),
    ("mlp_lopsided", "sgd", 0.0),
    ("mlp_chunks", "sgd", 0.0),
    ("mlp_cleared", "sgd", 0.0),
    ("mlp_frozen", "sgd", 0.0),
    ("mlp_adam_noise", "adam", SIGMA),
    ("zoo", "sgd", 0.0),
    ("llama_tied", "sgd", 0.0),
    ("lora", "adam", 0.0),
])
def test_sharded_training_equals_unsharded(ranks, case, optimizer, sigma):
    """Noise 0: the clipping over all shards is the unsharded clipping, however the
    examples are shared out (an empty share, chunks padded to the same count). With noise
    and a seeded generator: every rank adds its slice of the one draw an unsharded run
    makes, so the noise is added exactly once, over the full parameter vector."""
    if case not in ranks[0]:
        pytest.skip("needs transformers and peft")
    model_case = case.split("_")[0] if case.startswith("mlp") else case
    expected, expected_ledger = train(model_case, 0, 1, optimizer=optimizer, sigma=sigma, sharded=False,
                                      frozen_first=case == "mlp_frozen")
    for r in range(WORLD):
        params, ledger = ranks[r][case]
        assert_same(params, expected)
        assert ledger == expected_ledger
    if case == "mlp":  # the step moved the weights: the comparison is not of two untouched models
        assert any((expected[n] - v).norm() > 1e-3 for n, v in full(mlp()).items())


def test_clipping_is_active_and_mixed_in_the_mlp_case():
    """The equivalence above tests the norm over all shards only if some examples are
    clipped and some are not: a norm over one rank's shards would clip differently."""
    model = mlp()
    (x,), y = mlp_batches(1)[0]
    norms = []
    for i in range(len(x)):
        model.zero_grad()
        mse(model(x[i:i + 1]), y[i:i + 1]).sum().backward()
        norms.append(float(torch.cat([p.grad.flatten() for p in model.parameters()]).norm()))
    assert min(norms) < CLIP < max(norms)


def test_removing_one_example_moves_the_update_by_at_most_c_over_b(ranks):
    for r in range(WORLD):
        assert 0.99 <= ranks[r]["sensitivity"][0] <= 1.0 + 1e-9  # clipped: exactly C / B


def test_a_grad_scaler_is_divided_out_of_the_sharded_sums(ranks):
    """Under a loss scale of 2^10 the sharded sums are clipped and noised in the loss's own
    units: the same update as without a scaler, and the same sensitivity (left in, the
    scale would move the update by 2^10 C / B)."""
    for r in range(WORLD):
        moved, update = ranks[r]["sensitivity_scaled"]
        assert 0.99 <= moved <= 1.0 + 1e-6
        torch.testing.assert_close(update, ranks[r]["sensitivity"][1], rtol=1e-5, atol=1e-7)


def test_noise_law_over_the_full_parameter_vector(ranks):
    """Each rank drew its own shard (default generators): together N(0, (σC/B)^2) per
    coordinate, once, and the two shards independent."""
    g0, g1 = ranks[0]["noise_law"], ranks[1]["noise_law"]
    assert torch.equal(g0, g1)  # both ranks hold the same full update
    std = SIGMA * CLIP / BATCH
    z = (g0 / std).flatten()
    n = z.numel()
    assert abs(float(z.mean())) < 5 / math.sqrt(n)
    assert abs(float(z.var()) - 1.0) < 5 * math.sqrt(2 / n)
    top, bottom = (g0[:24] / std).flatten(), (g0[24:] / std).flatten()  # rank 0's rows, rank 1's rows
    assert not torch.equal(top, bottom)
    correlation = float((top * bottom).mean())
    assert abs(correlation) < 5 / math.sqrt(top.numel())


def test_sharded_checkpoint_resumes_bit_exact(ranks):
    for r in range(WORLD):
        straight, resumed, ledger = ranks[r]["resume"]
        for name in straight:
            assert torch.equal(straight[name], resumed[name]), name
        assert ledger == ((SIGMA, Q, 4),)


@pytest.mark.parametrize("what,named", [("mp_policy", "mp_policy"), ("hsdp", "mesh"),
                                        ("tensor_parallel", "tensor parallelism")])
def test_unsupported_fsdp_options_are_refused(ranks, what, named):
    for r in range(WORLD):
        message = ranks[r][what]
        assert message is not None and named in message


def test_cpu_offload_is_refused_by_name():
    """CPU offload cannot run on a CPU-only machine; the check it meets is the device."""
    from dpoptim import fsdp

    with pytest.raises(RuntimeError, match="offload_policy"):
        fsdp.check_unsharded(torch.empty(3, device="meta"), torch.empty(3), "parameter 'weight' of `0`")
    with pytest.raises(RuntimeError, match="mp_policy"):
        fsdp.check_unsharded(torch.empty(3, dtype=torch.bfloat16), torch.empty(3), "parameter 'weight' of `0`")


@pytest.mark.parametrize("length", [0, 1, 2, 3, 5, 8, 13])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_offsets_follow_torch_chunk(length, world):
    from dpoptim.fsdp import _chunk

    rows = torch.arange(length)
    pieces = list(torch.chunk(rows, world)) if length else []
    for rank in range(world):
        start, size = _chunk(length, world, rank)
        expected = pieces[rank] if rank < len(pieces) else rows[:0]
        assert torch.equal(rows[start:start + size], expected)


def test_distributed_checkpoint_helpers_that_drop_the_ledger_are_refused(ranks):
    for r in range(WORLD):
        kept, init_step, load, ledger = ranks[r]["dcp_helpers"]
        assert not kept  # the helpers keep torch's part of the state only
        assert init_step is not None and "holds a .grad that no backward()" in init_step
        assert load is not None and "no 'dpoptim' entry" in load
        assert ledger == ((SIGMA, Q, 1),)  # the refused load left the optimizer as it was


def test_full_size_sums_are_reduced_block_by_block(ranks):
    """The MLP has three FSDP blocks (two layers, and the root with the last one): a rank
    never holds the full-size sums of more than one layer's parameters at once."""
    largest_layer = sum(p.numel() for p in mlp()[2].parameters())
    for r in range(WORLD):
        held, total = ranks[r]["held"]
        assert 0 < held <= largest_layer < total


def test_shard_stream_reduces_blocks_in_order_as_soon_as_complete():
    from dpoptim.fsdp import ShardStream

    reduced = []
    records = [{2}, {0}, {0, 1}, set(), {1}]
    order = ShardStream.order(records)
    assert [max(records[i], default=-1) for i in order] == sorted(max(r, default=-1) for r in records)
    stream = ShardStream(["a", "b", "c", "d"], [records[i] for i in order], late={1}, reduce=reduced.append)
    log = []
    for i in order:
        stream.done(records[i])
        log.append(list(reduced))
    # after the record-free one nothing; after {0}: nothing ({0, 1} is pending);
    # after {0, 1}: a; after {1}: nothing (b is late); after {2}: still b first
    assert log == [[], [], ["a"], ["a"], ["a"]]
    stream.finish()
    assert reduced == ["a", "b", "c", "d"]  # d has no record: reduced in its turn, never skipped
