"""Data-parallel DP-SGD over ``torch.distributed`` (gloo on CPU, nccl on CUDA).

Each rank clips its own examples; one logical step is then

.. math::

    \\hat g = \\frac{1}{B} \\Big( \\mathcal N(0, \\sigma^2 C^2 I)
              + \\sum_{r} \\sum_{i \\in \\text{rank } r} c_i g_i \\Big)

with the noise drawn by rank 0 alone and added to its local sum before the all-reduce
(SUM). Every example lives on exactly one rank, so the sum's sensitivity is C as in one
process; the noise enters once, and every rank receives the same result, so replicas never
diverge. ``B`` and the sample rate are global: the whole batch over all ranks.

These helpers return ``None`` for "no group" when ``torch.distributed`` is not initialized
or has a single process, so callers take the one-process path.
"""

from __future__ import annotations

import hashlib

import torch

__all__ = ["resolve_group", "rank_and_size", "same_generator_everywhere", "check_same_generator", "all_reduce_sum_",
           "max_over_ranks"]


def _dist():
    import torch.distributed as dist

    return dist


def resolve_group(spec):
    """The process group to work with, or None for one process.

    ``spec``: None (torch.distributed's default group when initialized with more than one
    process), a process group, or False (this process alone).
    """
    if spec is False:
        return None
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()):
        if spec is not None:
            raise ValueError("a process_group was given but torch.distributed is not initialized")
        return None
    group = dist.group.WORLD if spec is None else spec
    return group if dist.get_world_size(group) > 1 else None


def rank_and_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    dist = _dist()
    return dist.get_rank(group), dist.get_world_size(group)


def _src(group) -> int:
    return _dist().get_global_rank(group, 0)


def same_generator_everywhere(generator: torch.Generator, group) -> torch.Generator:
    """``generator`` set to rank 0's state on every rank (a collective: all ranks must call it)."""
    if group is None:
        return generator
    box = [generator.get_state()]
    _dist().broadcast_object_list(box, src=_src(group), group=group)
    generator.set_state(box[0])
    return generator


def check_same_generator(generator: torch.Generator, group) -> None:
    """Raise unless ``generator`` is in the same state on every rank (a collective)."""
    if group is None:
        return
    digest = hashlib.sha256(generator.get_state().numpy().tobytes()).hexdigest()
    digests = [None] * _dist().get_world_size(group)
    _dist().all_gather_object(digests, digest, group=group)
    if len(set(digests)) != 1:
        raise ValueError(
            "the sampling generator differs between ranks: every rank must draw the same global "
            "Poisson batch. Seed it identically on all ranks, or pass generator=None."
        )


def max_over_ranks(value: int, group) -> int:
    """The largest ``value`` over the ranks of ``group`` (a collective), or ``value`` alone."""
    if group is None:
        return value
    cuda = _dist().get_backend(group) == "nccl"  # NCCL reduces CUDA tensors only
    box = torch.tensor([value], dtype=torch.int64, device=torch.cuda.current_device() if cuda else "cpu")
    _dist().all_reduce(box, op=_dist().ReduceOp.MAX, group=group)
    return int(box.item())


def all_reduce_sum_(tensors: list[torch.Tensor], group, settings: dict | None = None) -> None:
    """Sum ``tensors`` over the ranks of ``group``, in place: one all-reduce per (device, dtype).

    ``settings`` (name -> number) ride along in the first float32/float64 all-reduce (in one
    of their own only if every tensor is half precision): each rank checks that its own value
    equals the mean over the ranks, so ranks that disagree (a per-rank
    ``expected_batch_size``, a schedule applied on one rank only) raise instead of silently
    mixing settings.
    """
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        buckets.setdefault((t.device, t.dtype), []).append(t)
    names = list(settings or ())
    carrier = next((key for key in buckets if key[1] in (torch.float32, torch.float64)), None)
    if names and carrier is None and buckets:
        carrier = (next(iter(buckets))[0], torch.float64)
        buckets[carrier] = []
    dist = _dist()
    world = dist.get_world_size(group)
    for key, ts in buckets.items():
        device, dtype = key
        pieces = [t.reshape(-1) for t in ts]
        if names and key == carrier:
            pieces.append(torch.tensor([float(settings[k]) for k in names], dtype=dtype, device=device))
        flat = torch.cat(pieces)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        numels = [t.numel() for t in ts]
        for t, piece in zip(ts, flat[: sum(numels)].split(numels)):
            t.copy_(piece.view(t.shape))
        if names and key == carrier:
            _check_settings(names, settings, (flat[sum(numels):] / world).tolist(), 4 * world * torch.finfo(dtype).eps)


def _check_settings(names, settings, means, tol) -> None:
    differ = [
        f"{name}={settings[name]} here, {mean:.6g} on average"
        for name, mean in zip(names, means)
        if abs(mean - float(settings[name])) > tol * abs(float(settings[name]))
    ]
    if differ:
        raise ValueError(
            "the ranks disagree about " + "; ".join(differ) + ". Every rank must use the same "
            "settings; sample_rate and expected_batch_size are global (all ranks together), e.g. "
            "taken from dpoptim.data.poisson_loader on every rank."
        )
