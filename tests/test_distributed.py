"""Two gloo processes with DistributedDataParallel against one process and the oracle.

One pair of processes (torch.multiprocessing, gloo over a free local port) runs every
scenario; the checks run here in the parent on what each rank saved.
"""

import contextlib
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset

import dpoptim
from dpoptim.data import poisson_loader, split_batch
from oracle import clipped_sum, per_example_gradients
from ranks import error_of, run_scenarios

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

WORLD = 2
LR, CLIP, BATCH, Q = 0.5, 0.3, 8.0, 0.25


def model_():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).double()


def global_batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 4, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g, dtype=torch.float64))
            for _ in range(3)]


def mse(out, y):
    return 0.5 * (out - y).square().sum(1)


def dataset():
    g = torch.Generator().manual_seed(2)
    return TensorDataset(torch.randn(24, 4, generator=g, dtype=torch.float64),
                         torch.randn(24, 2, generator=g, dtype=torch.float64), torch.arange(24))


# ----------------------------------------------------------------- on each rank
def train_ddp(rank, sigma=0.0, bucket_view=False, alternate=False):
    """``alternate``: every other backward under no_sync(), where dpoptim's ghost
    differentiation runs (DDP's reducer waits for no gradient there), the others not."""
    model = model_()
    ddp = nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    generator = torch.Generator().manual_seed(7)  # the same seed everywhere; only rank 0 draws
    opt = dpoptim.DPSGD(ddp.parameters(), lr=LR, noise_multiplier=sigma, max_grad_norm=CLIP,
                        expected_batch_size=BATCH, sample_rate=Q, generator=generator)
    for step, (x, y) in enumerate(global_batches()):
        opt.zero_grad()
        with ddp.no_sync() if alternate and step % 2 else contextlib.nullcontext():
            mse(ddp(x[rank::WORLD]), y[rank::WORLD]).mean().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], opt.ledger


def train_virtual(rank):
    """Poisson batches shared out by the loader, cut into chunks of 2 (ranks run different
    numbers of backward calls, so DDP's own all-reduce is switched off with no_sync)."""
    model = model_()
    ddp = nn.parallel.DistributedDataParallel(model)
    loader = poisson_loader(dataset(), sample_rate=0.5, generator=torch.Generator().manual_seed(14))
    opt = dpoptim.DPSGD(ddp.parameters(), lr=LR, noise_multiplier=0.0, max_grad_norm=CLIP,
                        **dpoptim.data.privacy_kwargs(loader))
    seen = []
    for step, (x, y, index) in enumerate(loader):
        if step == 2:
            break
        seen.append(index.tolist())
        with ddp.no_sync():
            for cx, cy, _ in split_batch((x, y, index), 2):
                mse(ddp(cx), cy).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], seen


def count_all_reduces(rank):
    """Virtual batches under no_sync (ranks with different numbers of backward calls):
    the sizes of the all-reduces dpoptim runs in each logical step, backward included."""
    model = model_()
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = dpoptim.DPSGD(ddp.parameters(), lr=LR, noise_multiplier=1.0, max_grad_norm=CLIP,
                        expected_batch_size=BATCH, sample_rate=Q)
    calls, original = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    per_step = []
    dist.all_reduce = counting
    try:
        for x, y in global_batches():
            start = len(calls)
            opt.zero_grad()
            with ddp.no_sync():
                for cx, cy in split_batch((x[rank::WORLD], y[rank::WORLD]), 1 + rank):
                    mse(ddp(cx), cy).mean().backward()
            opt.step()
            per_step.append(calls[start:])
    finally:
        dist.all_reduce = original
    return per_step, sum(p.numel() for p in model.parameters())


def poisson_shares():
    seeded = poisson_loader(TensorDataset(torch.arange(40)), sample_rate=Q, generator=torch.Generator().manual_seed(5))
    default = poisson_loader(TensorDataset(torch.arange(40)), sample_rate=Q)
    return {
        "seeded": [b[0].tolist() for b in seeded],
        "default": [b[0].tolist() for b in default],
        "attributes": (len(seeded), seeded.sample_rate, seeded.expected_batch_size),
        "default_state": default.batch_sampler.generator.get_state(),
    }


def sampling_seeded_per_rank(rank):
    """The habit of seeding by rank: each rank would draw its own Poisson batch, and an
    example could sit in the batch on both ranks at once."""
    generator = torch.Generator().manual_seed(100 + rank)
    return error_of(lambda: poisson_loader(TensorDataset(torch.arange(40)), sample_rate=Q, generator=generator),
                    ValueError)


def mismatched_settings(rank, dtype=torch.float32, agree=False):
    """With bfloat16 parameters the settings travel in an all-reduce of their own."""
    model = nn.Linear(2, 1).to(dtype)
    opt = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=4.0 if rank == 0 or agree else 8.0, sample_rate=0.5)
    return error_of(opt.step, ValueError)


def scenarios(rank):
    """Every scenario on this rank, in one gloo group."""
    results = {
        "plain": train_ddp(rank),
        "bucket_view": train_ddp(rank, bucket_view=True),
        "alternate": train_ddp(rank, alternate=True),
        "noisy": train_ddp(rank, sigma=1.0),
        "virtual": train_virtual(rank),
        "poisson": poisson_shares(),
        "seeded_per_rank": sampling_seeded_per_rank(rank),
        "all_reduces": count_all_reduces(rank),
        "mismatch": mismatched_settings(rank),
        "mismatch_bf16": mismatched_settings(rank, torch.bfloat16),
        "agree_bf16": mismatched_settings(rank, torch.bfloat16, agree=True),
    }
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_scenarios(scenarios, tmp_path_factory.mktemp("ranks"), WORLD)


# ----------------------------------------------------------------- references, in this process
def oracle_training(batches, batch_size=BATCH):
    """Plain DP-SGD without noise, by per-example autograd: no dpoptim involved."""
    model = model_()
    params = list(model.parameters())
    for x, y in batches:
        total, _ = clipped_sum(per_example_gradients(model, (x,), y, lambda m, x: m(x), mse), CLIP, params)
        with torch.no_grad():
            for p, t in zip(params, total):
                p.sub_(LR * t / batch_size)
    return [p.detach() for p in params]


def one_process(sigma):
    model = model_()
    opt = dpoptim.DPSGD(model.parameters(), lr=LR, noise_multiplier=sigma, max_grad_norm=CLIP,
                        expected_batch_size=BATCH, sample_rate=Q, generator=torch.Generator().manual_seed(7))
    for x, y in global_batches():
        opt.zero_grad()
        mse(model(x), y).mean().backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def assert_all_close(a, b, tol=1e-12):
    for u, v in zip(a, b):
        assert torch.allclose(u, v, rtol=tol, atol=tol), (u - v).abs().max()


# ----------------------------------------------------------------- the checks
@pytest.mark.parametrize("scenario", ["plain", "bucket_view", "alternate"])
def test_two_ranks_without_noise_equal_the_oracle(ranks, scenario):
    expected = oracle_training(global_batches())
    for r in range(WORLD):
        params, ledger = ranks[r][scenario]
        assert_all_close(params, expected)
        assert ledger == ((0.0, Q, 3),)


def test_noise_is_added_once_and_replicas_agree(ranks):
    params0, ledger0 = ranks[0]["noisy"]
    params1, ledger1 = ranks[1]["noisy"]
    for a, b in zip(params0, params1):
        assert torch.equal(a, b)  # bit for bit: replicas never diverge
    assert ledger0 == ledger1 == ((1.0, Q, 3),)
    # one process with the same noise seed: the same result, so the noise entered once
    # (twice, or not at all, would move the parameters by another N(0, (sigma C / B)^2 lr^2))
    assert_all_close(params0, one_process(sigma=1.0))
    noise_free = ranks[0]["plain"][0]
    assert max((a - b).abs().max().item() for a, b in zip(params0, noise_free)) > 10 * 1e-12


def test_virtual_batches_with_no_sync_equal_the_oracle(ranks):
    (params0, seen0), (params1, seen1) = ranks[0]["virtual"], ranks[1]["virtual"]
    assert_all_close(params0, params1, tol=0)
    data = dataset()
    batches = []
    for a, b in zip(seen0, seen1):
        assert not set(a) & set(b)  # the ranks' shares are disjoint
        index = torch.tensor(sorted(a + b), dtype=torch.long)
        batches.append((data.tensors[0][index], data.tensors[1][index]))
    # the ranks ran different numbers of backward calls in some step
    assert any(math.ceil(len(a) / 2) != math.ceil(len(b) / 2) for a, b in zip(seen0, seen1))
    assert_all_close(params0, oracle_training(batches, batch_size=0.5 * 24))


def test_a_sampling_generator_seeded_per_rank_is_refused(ranks):
    for r in range(WORLD):
        assert ranks[r]["seeded_per_rank"] is not None and "differs between ranks" in ranks[r]["seeded_per_rank"]


def test_poisson_loader_shares_one_global_draw(ranks):
    shares = [ranks[r]["poisson"] for r in range(WORLD)]
    single = poisson_loader(TensorDataset(torch.arange(40)), sample_rate=Q, generator=torch.Generator().manual_seed(5))
    global_draw = [b[0].tolist() for b in single]
    for step, whole in enumerate(global_draw):
        parts = [shares[r]["seeded"][step] for r in range(WORLD)]
        assert sorted(parts[0] + parts[1]) == whole
        assert not set(parts[0]) & set(parts[1])
    # the default generator is seeded on rank 0 and agreed on: one draw, disjoint shares
    assert torch.equal(shares[0]["default_state"], shares[1]["default_state"])
    for a, b in zip(shares[0]["default"], shares[1]["default"]):
        assert not set(a) & set(b)
    assert sum(map(len, shares[0]["default"] + shares[1]["default"])) > 0
    # the accounting sees the global rate and batch size
    assert shares[0]["attributes"] == (round(1 / Q), Q, Q * 40)


def test_ranks_that_disagree_about_settings_raise(ranks):
    for r in range(WORLD):
        for scenario in ("mismatch", "mismatch_bf16"):
            assert ranks[r][scenario] is not None and "expected_batch_size" in ranks[r][scenario]
        assert ranks[r]["agree_bf16"] is None


def test_one_all_reduce_per_step_and_no_norm_exchange(ranks):
    """dpoptim's communication per logical step is one all-reduce of the clipped sums (the
    four settings ride along), whatever the number of backward calls; no per-example norm
    ever leaves its rank."""
    for r in range(WORLD):
        per_step, numel = ranks[r]["all_reduces"]
        assert per_step == [[numel + 4]] * len(global_batches())
