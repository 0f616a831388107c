"""Data loading for DP-SGD: Poisson-sampled batches and physical chunks of a logical batch.

The accountant (:mod:`dpoptim.accounting`) charges each step as a *Poisson-subsampled*
Gaussian mechanism: every example of the dataset joins a batch independently with
probability ``q``, so batch sizes vary (Binomial(N, q), mean ``q N``) and a batch may be
empty. :func:`poisson_loader` draws batches exactly that way; a shuffled
``DataLoader(batch_size=B)`` draws a fixed-size batch without replacement, which is a
different mechanism than the one accounted for.

.. code-block:: python

    loader = dpoptim.data.poisson_loader(train_set, sample_rate=256 / len(train_set))
    optimizer = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=1.1,
                              max_grad_norm=1.0, **dpoptim.data.privacy_kwargs(loader))

A logical batch larger than memory allows is split into physical chunks with
:func:`split_batch`; each chunk gets its own ``backward()`` and the logical batch one
``step()`` (the engine clips each chunk's examples at the end of its backward and sums).
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import DataLoader, IterableDataset, Sampler, default_collate

from . import distributed
from .nested import map_structure, map_tensors, visit_tensors
from .privatize import fresh_generator

__all__ = [
    "PoissonBatchSampler", "PoissonDataLoader", "batches_per_epoch", "poisson_loader", "poisson_indices",
    "privacy_kwargs", "split_batch",
]


def poisson_indices(num_samples: int, sample_rate: float, generator: torch.Generator) -> torch.Tensor:
    """Indices of ``range(num_samples)``, each included independently with probability q.

    Drawn as the positions of the successes of ``num_samples`` Bernoulli(q) trials, with
    the gaps between successes i.i.d. Geometric(q): the same distribution as
    ``torch.rand(N) < q``, at a cost proportional to the batch size instead of N.
    """
    if sample_rate >= 1:
        return torch.arange(num_samples)
    expected = num_samples * sample_rate
    chunk = int(expected + 4 * math.sqrt(expected) + 16)
    parts, last = [], -1.0
    while True:
        gaps = torch.empty(chunk, dtype=torch.float64).geometric_(sample_rate, generator=generator)
        positions = torch.cumsum(gaps, 0).add_(last)  # float64 holds these integers exactly
        inside = positions[positions < num_samples]
        parts.append(inside)
        if inside.numel() < chunk:
            return torch.cat(parts).to(torch.int64)
        last = float(positions[-1])


def batches_per_epoch(sample_rate: float) -> int:
    """Batches in one epoch of Poisson sampling at rate q: ``max(1, round(1 / q))``.

    This is what ``len(poisson_loader(...))`` returns and how ``epochs`` is turned into a
    number of steps everywhere in dpoptim."""
    return max(1, round(1 / sample_rate))


class PoissonBatchSampler(Sampler[list[int]]):
    """Batches of dataset indices by Poisson sampling: each index joins each batch
    independently with probability ``sample_rate``; ``round(1 / sample_rate)`` batches
    make an epoch.

    Under ``torch.distributed`` (or with ``rank``/``world_size`` given) every rank draws
    the same global batch (the generator must be seeded alike everywhere; the default one
    is seeded on rank 0 from the operating system's entropy and broadcast) and keeps every
    ``world_size``-th index from position ``rank``: the ranks' shares are disjoint and
    together form the global Poisson batch that the accountant's ``sample_rate`` models.

    The default generator is seeded from the operating system's entropy. Subsampling only
    amplifies privacy while the choice of batches stays secret: do not publish a seed.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        *,
        generator: torch.Generator | None = None,
        process_group=None,
    ):
        if not (int(num_samples) == num_samples and num_samples >= 1):
            raise ValueError(f"num_samples must be a positive integer, got {num_samples}")
        sample_rate = float(sample_rate)
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if generator is not None and generator.device.type != "cpu":
            raise ValueError("the sampling generator must be a CPU torch.Generator")
        self.num_samples = int(num_samples)
        self.sample_rate = sample_rate
        self.num_batches = batches_per_epoch(sample_rate)
        group = distributed.resolve_group(process_group)
        self.rank, self.world_size = distributed.rank_and_size(group)
        if generator is None:
            # The whole Mersenne Twister state from the OS (manual_seed would keep 32 bits, and
            # the batches could be found by trying every seed), then rank 0's state everywhere.
            generator = distributed.same_generator_everywhere(fresh_generator("cpu"), group)
        else:
            distributed.check_same_generator(generator, group)
        self.generator = generator

    @property
    def expected_batch_size(self) -> float:
        """``q N``: the mean size of the global batch (all ranks together)."""
        return self.sample_rate * self.num_samples

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self):
        for _ in range(self.num_batches):
            indices = poisson_indices(self.num_samples, self.sample_rate, self.generator)
            yield indices[self.rank :: self.world_size].tolist()


class _EmptyAwareCollate:
    """``collate_fn`` that turns an empty list of examples into an empty batch.

    The empty batch has the structure of a real one with a batch dimension of size 0: it is
    built once by collating one example and two copies of it, and cutting each tensor to
    length 0 along the dimension that grew from 1 to 2 (dimension 0 for the default collate,
    another one for a collate that puts the batch elsewhere).
    """

    def __init__(self, dataset, collate_fn):
        self.dataset = dataset
        self.collate_fn = collate_fn
        self._template = None

    def __call__(self, examples):
        if isinstance(examples, (list, tuple)) and len(examples) == 0:
            if self._template is None:
                example = self.dataset[0]
                self._template = _cut_to_empty(self.collate_fn([example]), self.collate_fn([example, example]))
            return _fresh(self._template)
        return self.collate_fn(examples)


def _cut_to_empty(one, two):
    def tensor(a, b):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim():
            for dim, (x, y) in enumerate(zip(a.shape, b.shape)):
                if x == 1 and y == 2:
                    return a.narrow(dim, 0, 0).clone()
        return a

    def plain(a, b):  # a batch of strings or other plain values
        return type(a)() if len(a) == 1 and len(b) == 2 else a

    return map_structure(tensor, one, two, values=plain)


def _fresh(template):
    return map_tensors(torch.Tensor.clone, template)


class PoissonDataLoader(DataLoader):
    """A ``DataLoader`` over a :class:`PoissonBatchSampler`; made by :func:`poisson_loader`."""

    @property
    def sample_rate(self) -> float:
        """q: the probability that an example is in a batch (global, all ranks)."""
        return self.batch_sampler.sample_rate

    @property
    def expected_batch_size(self) -> float:
        """``q * len(dataset)``: the mean global batch size, the optimizer's divisor."""
        return self.batch_sampler.expected_batch_size

    @property
    def dataset_size(self) -> int:
        return self.batch_sampler.num_samples


_FORBIDDEN = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


def poisson_loader(
    dataset,
    sample_rate: float,
    generator: torch.Generator | None = None,
    *,
    process_group=None,
    **dataloader_kwargs,
) -> PoissonDataLoader:
    """A ``DataLoader`` whose batches are Poisson samples of ``dataset`` at rate q.

    Each example joins each batch independently with probability ``sample_rate``; an epoch
    is ``round(1 / sample_rate)`` batches (``len(loader)``). A batch may be empty: it is
    yielded as the usual structure with a batch dimension of 0, so the training loop needs
    no special case (the step still adds noise and is charged, as the accountant assumes).

    Other keyword arguments (``num_workers``, ``collate_fn``, ``pin_memory``, ...) go to
    ``torch.utils.data.DataLoader``; ``batch_size``, ``shuffle``, ``sampler``,
    ``batch_sampler`` and ``drop_last`` are decided by the sampling and refused.

    Under ``torch.distributed`` each rank gets its share of one global draw (see
    :class:`PoissonBatchSampler`); ``sample_rate`` and ``expected_batch_size`` stay global,
    which is what the optimizer wants. Every rank must call this function (the default
    seed is agreed on collectively). ``process_group=False`` samples for this process
    alone.
    """
    bad = [k for k in _FORBIDDEN if k in dataloader_kwargs]
    if bad:
        raise TypeError(f"poisson_loader decides {', '.join(bad)} itself (Poisson sampling); do not pass them")
    if isinstance(dataset, IterableDataset):
        raise TypeError("Poisson sampling needs a map-style dataset (with __len__ and __getitem__)")
    collate_fn = dataloader_kwargs.pop("collate_fn", None) or default_collate
    sampler = PoissonBatchSampler(len(dataset), sample_rate, generator=generator, process_group=process_group)
    return PoissonDataLoader(
        dataset, batch_sampler=sampler, collate_fn=_EmptyAwareCollate(dataset, collate_fn), **dataloader_kwargs
    )


def privacy_kwargs(loader) -> dict:
    """The optimizer's accounting arguments taken from a Poisson loader:
    ``sample_rate``, ``expected_batch_size`` and ``dataset_size``.

    >>> opt = dpoptim.DPSGD(model.parameters(), lr=0.1, noise_multiplier=1.0,
    ...                     max_grad_norm=1.0, **privacy_kwargs(loader))  # doctest: +SKIP
    """
    sampler = getattr(loader, "batch_sampler", loader)
    if not isinstance(sampler, PoissonBatchSampler):
        raise TypeError(
            f"{type(loader).__name__} does not draw Poisson batches, so there is no sample rate "
            "that makes the accountant's guarantee hold. Use dpoptim.data.poisson_loader(dataset, "
            "sample_rate=...)."
        )
    return {
        "sample_rate": sampler.sample_rate,
        "expected_batch_size": sampler.expected_batch_size,
        "dataset_size": sampler.num_samples,
    }


def split_batch(batch, max_physical_batch_size: int, *, synchronize_ranks: bool = False):
    """Yield consecutive chunks of ``batch`` with at most ``max_physical_batch_size`` examples.

    ``batch`` is any nesting of tuples, lists, dicts and named tuples whose tensors share
    their first (batch) dimension; lists of plain values (strings, numbers) of that length
    are cut too, other leaves (and 0-dimensional tensors) are repeated in every chunk. An
    empty batch yields no chunk.

    Run forward and ``backward()`` on each chunk and call ``step()`` once after the last:
    the chunks form one logical batch, clipped per example exactly as if it had been one
    backward, with memory bounded by one chunk.

    ``synchronize_ranks=True`` (under ``torch.distributed``; a collective, every rank must
    call it) makes every rank yield as many chunks as the rank with the most, the extra
    ones empty. FSDP needs it: every forward and backward of a sharded model gathers
    parameters from all ranks, so all ranks must run the same number of them, while the
    shares of a Poisson batch differ in size.
    """
    size = int(max_physical_batch_size)
    if size != max_physical_batch_size or size < 1:
        raise ValueError(f"max_physical_batch_size must be a positive integer, got {max_physical_batch_size}")
    sizes = set()
    _batch_sizes(batch, sizes)
    if len(sizes) != 1:
        raise ValueError(
            "split_batch needs tensors that share their first (batch) dimension; found sizes "
            f"{sorted(sizes) if sizes else 'none'}"
        )
    n = sizes.pop()
    chunks = -(-n // size)
    if synchronize_ranks:
        chunks = distributed.max_over_ranks(chunks, distributed.resolve_group(None))
    for i in range(chunks):
        start = min(i * size, n)
        yield _cut(batch, start, min(start + size, n), n)


def _batch_sizes(obj, sizes) -> None:
    def add(t):
        if t.dim() > 0:  # a 0-dimensional tensor has no batch dimension: repeated
            sizes.add(t.shape[0])

    visit_tensors(add, obj)  # plain values are cut if their count matches, checked in _cut


def _cut(obj, start, stop, n):
    return map_structure(lambda x: x[start:stop] if isinstance(x, torch.Tensor) and x.dim() > 0 else x, obj,
                         values=lambda seq: seq[start:stop] if len(seq) == n else seq)
