"""Poisson loading, empty batches, physical chunks of a logical batch, and the
fixed-batch-size warning."""

import collections
import copy
import math
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import dpoptim
from dpoptim.data import PoissonBatchSampler, poisson_indices, poisson_loader, privacy_kwargs, split_batch
from oracle import clipped_sum, per_example_gradients


# ----------------------------------------------------------------- the draw itself
def test_poisson_indices_have_the_bernoulli_law():
    """Each index is in a draw with probability q, independently of the others: inclusion
    frequencies, pair frequencies and the batch-size mean and variance of Binomial(N, q)."""
    n, q, draws = 200, 0.1, 3000
    g = torch.Generator().manual_seed(0)
    counts = torch.zeros(n)
    pair = 0
    sizes = []
    for _ in range(draws):
        idx = poisson_indices(n, q, g)
        assert idx.dtype == torch.int64
        assert torch.equal(idx, torch.unique(idx)), "indices must be sorted and distinct"
        assert idx.numel() == 0 or (idx.min() >= 0 and idx.max() < n)
        mask = torch.zeros(n, dtype=torch.bool)
        mask[idx] = True
        counts += mask
        pair += int(mask[0] and mask[n - 1])
        sizes.append(idx.numel())
    sizes = torch.tensor(sizes, dtype=torch.float64)
    # batch size ~ Binomial(n, q): mean 20, variance 18; 5-sigma bounds on the estimates
    assert abs(sizes.mean().item() - n * q) < 5 * math.sqrt(n * q * (1 - q) / draws)
    assert abs(sizes.var().item() / (n * q * (1 - q)) - 1) < 5 * math.sqrt(2 / draws)
    # each index: frequency ~ q within 5 sigma (the per-index sd is sqrt(q(1-q)/draws))
    sd = math.sqrt(q * (1 - q) / draws)
    assert (counts / draws - q).abs().max().item() < 5 * sd
    # the first and last index together: q^2 (independent), not q (or 0)
    assert abs(pair / draws - q * q) < 5 * math.sqrt(q * q / draws)


def test_the_loader_samples_at_the_rate_it_reports_to_the_accountant():
    """What the loader draws is what privacy_kwargs reports: the accountant's q is the
    chance that an example joins a batch of the loader itself, not of poisson_indices alone
    (a loader drawing at 1.2 q would make every reported epsilon too small)."""
    n, q = 200, 0.05
    loader = poisson_loader(TensorDataset(torch.arange(n)), sample_rate=q, generator=torch.Generator().manual_seed(3))
    reported = privacy_kwargs(loader)["sample_rate"]
    assert reported == q
    counts, batches = torch.zeros(n), 0
    for _ in range(40):  # 40 epochs of round(1/q) batches
        for (indices,) in loader:
            counts[indices] += 1
            batches += 1
    # n * batches Bernoulli(q) draws: the overall rate within 5 standard errors (about 5% of q
    # here, a quarter of the 20% a loader drawing at 1.2 q would be off by)
    rate = counts.sum().item() / (n * batches)
    assert abs(rate - reported) < 5 * math.sqrt(q * (1 - q) / (n * batches))
    assert counts.min() > 0  # about 40 draws each: none left out


def test_poisson_indices_edge_rates():
    g = torch.Generator().manual_seed(1)
    assert torch.equal(poisson_indices(7, 1.0, g), torch.arange(7))
    sizes = [poisson_indices(5, 1e-4, g).numel() for _ in range(200)]
    assert sum(sizes) <= 2  # expected 0.1
    # a long draw that needs more than one chunk of gaps stays exact and in range
    idx = poisson_indices(100_000, 0.5, g)
    assert idx.max() < 100_000 and torch.equal(idx, torch.unique(idx))
    assert abs(idx.numel() - 50_000) < 5 * math.sqrt(25_000)


# ----------------------------------------------------------------- the loader
class Structured(Dataset):
    """Examples with nested structure and mixed dtypes."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        x = torch.full((3, 4), float(i))
        return x, i, {"mask": torch.tensor([True, i % 2 == 0]), "name": f"ex{i}", "w": torch.tensor(i, dtype=torch.float64)}


def test_loader_len_attributes_and_batches():
    data = TensorDataset(torch.arange(50.0).unsqueeze(1), torch.arange(50))
    g = torch.Generator().manual_seed(3)
    loader = poisson_loader(data, sample_rate=0.08, generator=g)
    assert len(loader) == round(1 / 0.08) == 12
    assert loader.sample_rate == 0.08
    assert loader.expected_batch_size == pytest.approx(0.08 * 50)
    batches = list(loader)
    assert len(batches) == 12
    for x, y in batches:
        assert torch.equal(x.squeeze(1).long(), y)  # the example's fields stay together
        assert torch.equal(y, torch.unique(y))
    assert privacy_kwargs(loader) == {"sample_rate": 0.08, "expected_batch_size": pytest.approx(4.0), "dataset_size": 50}


def test_empty_batches_keep_structure_shapes_and_dtypes():
    data = Structured()
    loader = poisson_loader(data, sample_rate=0.02, generator=torch.Generator().manual_seed(0))
    full = next(iter(DataLoader(data, batch_size=2)))
    empties = [b for b in loader if b[0].shape[0] == 0]
    assert len(empties) > 30  # about (1 - 0.02)^6 = 89% of the 50 batches
    x, y, extra = empties[0]
    assert x.shape == (0, 3, 4) and x.dtype == full[0].dtype
    assert y.shape == (0,) and y.dtype == full[1].dtype
    assert set(extra) == {"mask", "name", "w"}
    assert extra["mask"].shape == (0, 2) and extra["mask"].dtype == torch.bool
    assert extra["w"].shape == (0,) and extra["w"].dtype == torch.float64
    assert extra["name"] == []
    # the empty batch flows through a model and a loss like any other
    out = nn.Linear(4, 2)(x).sum((1, 2))
    assert out.shape == (0,)


def test_empty_batch_from_a_collate_that_puts_the_batch_second():
    class Seqs(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.ones(5, 3) * i

    def time_major(examples):
        return torch.stack(examples, dim=1)  # [T, n, d]

    loader = poisson_loader(Seqs(), sample_rate=0.01, generator=torch.Generator().manual_seed(0), collate_fn=time_major)
    shapes = {tuple(b.shape) for b in loader}
    assert (5, 0, 3) in shapes


def test_loader_passes_dataloader_options_through():
    data = TensorDataset(torch.randn(20, 2))
    loader = poisson_loader(data, sample_rate=0.25, generator=torch.Generator().manual_seed(0), num_workers=1)
    batches = list(loader)
    assert len(batches) == 4 and all(b[0].shape[1:] == (2,) for b in batches)
    with pytest.raises(TypeError, match="batch_size"):
        poisson_loader(data, sample_rate=0.25, batch_size=4)
    with pytest.raises(TypeError, match="shuffle"):
        poisson_loader(data, sample_rate=0.25, shuffle=True)
    with pytest.raises(ValueError, match="sample_rate"):
        poisson_loader(data, sample_rate=0.0)
    with pytest.raises(TypeError, match="Poisson"):
        privacy_kwargs(DataLoader(data, batch_size=4))


def test_same_generator_same_batches_default_generator_is_not_the_global_seed():
    data = TensorDataset(torch.arange(100))

    def draw(loader):
        return [b[0].tolist() for b in loader]

    assert draw(poisson_loader(data, 0.1, torch.Generator().manual_seed(5))) == draw(
        poisson_loader(data, 0.1, torch.Generator().manual_seed(5))
    )
    torch.manual_seed(0)
    first = draw(poisson_loader(data, 0.1))
    torch.manual_seed(0)
    second = draw(poisson_loader(data, 0.1))
    assert first != second  # seeded from the OS, not from torch's global seed


def test_sampler_validates():
    with pytest.raises(ValueError):
        PoissonBatchSampler(0, 0.5)
    with pytest.raises(ValueError):
        PoissonBatchSampler(10, 1.5)
    with pytest.raises(TypeError):
        PoissonBatchSampler(10, 0.5, generator=3)


# ----------------------------------------------------------------- physical chunks
def test_split_batch_cuts_nested_structures():
    Pair = collections.namedtuple("Pair", "a b")
    batch = {
        "x": torch.arange(7 * 2).view(7, 2),
        "pair": Pair(torch.arange(7), [f"s{i}" for i in range(7)]),
        "meta": "constant",
        "lists": [torch.arange(7.0), torch.zeros(7, 1)],
        "scale": torch.tensor(2.0),
    }
    chunks = list(split_batch(batch, 3))
    assert [c["x"].shape[0] for c in chunks] == [3, 3, 1]
    assert torch.equal(torch.cat([c["x"] for c in chunks]), batch["x"])
    assert sum((c["pair"].b for c in chunks), []) == batch["pair"].b
    assert all(isinstance(c["pair"], Pair) and c["meta"] == "constant" and c["scale"] == 2.0 for c in chunks)
    assert torch.equal(torch.cat([c["lists"][1] for c in chunks]), batch["lists"][1])
    assert list(split_batch((torch.zeros(0, 3), torch.zeros(0)), 4)) == []
    assert len(list(split_batch(torch.zeros(4, 1), 4))) == 1
    with pytest.raises(ValueError, match="share"):
        list(split_batch((torch.zeros(3), torch.zeros(4)), 2))
    with pytest.raises(ValueError):
        list(split_batch(torch.zeros(3), 0))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_virtual_batches_of_a_poisson_batch_equal_the_oracle(reduction):
    """A Poisson batch split into physical chunks, one backward each, one step: the
    brute-force clipped sum over the whole batch, whatever the chunk sizes."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(40, 5, dtype=torch.float64), torch.randn(40, 2, dtype=torch.float64))
    loader = poisson_loader(data, sample_rate=0.3, generator=torch.Generator().manual_seed(2))
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 2)).double()
    reference = copy.deepcopy(model)
    mse = lambda out, y: 0.5 * (out - y).square().sum(1)
    params = list(model.parameters())
    opt = dpoptim.DPSGD(params, lr=1.0, noise_multiplier=0.0, max_grad_norm=0.2, expected_batch_size=1,
                        sample_rate=0.3, loss_reduction=reduction)
    for step, (x, y) in enumerate(loader):
        if step == 2:
            break
        ref_params = list(reference.parameters())
        expected, _ = clipped_sum(per_example_gradients(reference, (x,), y, lambda m, x: m(x), mse), 0.2, ref_params)
        before = [p.detach().clone() for p in params]
        for cx, cy in split_batch((x, y), 4):
            losses = mse(model(cx), cy)
            (losses.mean() if reduction == "mean" else losses.sum()).backward()
        opt.step()
        opt.zero_grad()
        for b, p, e, r in zip(before, params, expected, ref_params):
            assert torch.allclose(b - p.detach(), e, atol=1e-12, rtol=1e-10)
            with torch.no_grad():
                r.sub_(e)


# ----------------------------------------------------------------- fixed-size batches
def _train(loader, steps):
    model = nn.Linear(3, 1)
    opt = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=8, sample_rate=8 / 256)
    done = 0
    while done < steps:
        for x, y in loader:
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            done += 1
            if done == steps:
                break


def test_fixed_size_loader_warns_once_poisson_loader_does_not():
    data = TensorDataset(torch.randn(256, 3), torch.randn(256, 1))
    with pytest.warns(dpoptim.PrivacyWarning, match="Poisson") as record:
        _train(DataLoader(data, batch_size=8, shuffle=True), 80)
    assert sum("Poisson" in str(w.message) for w in record) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", dpoptim.PrivacyWarning)
        _train(poisson_loader(data, sample_rate=8 / 256, generator=torch.Generator().manual_seed(0)), 80)
