"""DP-SGD on models sharded with PyTorch's FSDP2 (``torch.distributed.fsdp.fully_shard``).

FSDP2 keeps each parameter as a :class:`~torch.distributed.tensor.DTensor` sharded on
dimension 0 over the ranks; the optimizer holds these sharded parameters. For each forward
it all-gathers a module's shards into an ordinary, *unsharded* parameter that the module
computes with, and frees it again afterwards. Every example lives on one rank, and that
rank runs it through the unsharded weights, so the per-example gradient, its norm over
all parameters and its clip factor ``c_i = min(1, C / ||g_i||)`` are complete on the rank
that holds the example: no per-layer norm exchange is needed. One logical step is then

.. math::

    \\hat g^{(r)} = \\frac{1}{B} \\Big( \\big[\\textstyle\\sum_{r'} \\sum_{i \\in r'} c_i g_i\\big]^{(r)}
                    + \\mathcal N(0, \\sigma^2 C^2 I)^{(r)} \\Big)

where ``[.]^{(r)}`` is rank ``r``'s shard: at the end of each backward, each rank's
full-shape clipped sum is reduce-scattered (one ``reduce_scatter`` per parameter, through
DTensor's own ``redistribute``), block by block as each FSDP block's sums are complete
(:class:`ShardStream`), and only the shard is kept; in ``step()`` each rank adds the
noise of its own shard. The noise is one draw
over the full parameter vector: with a user's generator (same seed on every rank) every
rank draws the whole vector and keeps its slice, which is exactly the noise of an
unsharded run; with the default generators each rank draws its slice from its own
generator seeded by the operating system, so the slices are independent. Either way each
coordinate gets ``N(0, sigma^2 C^2)`` once.

This module holds the layout arithmetic, the checks and the order of the reductions; the
engine maps each unsharded parameter to its sharded one (:func:`sharded_slots`) and calls
:func:`reduce_to_shard` through a :class:`ShardStream`, and the optimizer calls
:func:`local_slice` and :func:`as_grad` in ``step()``.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from . import _torch

__all__ = ["is_sharded", "local", "is_fsdp_module", "sharded_slots", "check_unsharded", "check_layout",
           "reduce_to_shard", "local_slice", "as_grad", "ShardStream"]


def _tensor_api():
    from torch.distributed import tensor

    return tensor


def _loaded_class(module_name: str, name: str):
    """``module_name.name`` if that module has been imported (by the user's FSDP code), else
    None: nothing can be an instance of a class that was never imported, and these checks
    run for every module call and every parameter, so they neither import nor pay for it."""
    module = sys.modules.get(module_name)
    return None if module is None else getattr(module, name, None)


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a DTensor (a parameter sharded by FSDP2 or another DTensor user)."""
    cls = _loaded_class("torch.distributed.tensor", "DTensor")
    return cls is not None and isinstance(p, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: its local shard if it is a DTensor, else ``t`` itself."""
    return t.to_local() if is_sharded(t) else t


def is_fsdp_module(module: nn.Module) -> bool:
    """Whether ``fully_shard`` was applied to ``module`` (it then subclasses ``FSDPModule``)."""
    cls = _loaded_class("torch.distributed.fsdp", "FSDPModule")
    return cls is not None and isinstance(module, cls)


def sharded_slots(module: nn.Module, owned) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """``(submodule, name, parameter)`` for every parameter slot under ``module`` that holds
    a parameter of ``owned`` (ids) now. Called on an FSDP module before its forward, when its
    slots hold the sharded parameters: the engine remembers each slot, so that the unsharded
    parameter FSDP puts in it for the forward is known as the sharded one's stand-in."""
    found = []
    for sub in module.modules():
        for name, p in _torch.own_parameters(sub).items():
            if p is not None and id(p) in owned:
                found.append((sub, name, p))
    return found


def check_unsharded(unsharded: torch.Tensor, sharded: torch.Tensor, where: str) -> None:
    """Refuse FSDP2 options under which the unsharded parameter differs from the sharded
    one in more than its layout."""
    if unsharded.dtype != sharded.dtype:
        raise RuntimeError(
            f"{where} computes in {unsharded.dtype} while its sharded parameter is {sharded.dtype}: "
            "fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype=...)) is not supported by "
            "dpoptim (the per-example gradients would be clipped in the low precision). Leave "
            "mp_policy at its default and use torch.autocast for mixed precision."
        )
    if unsharded.device != sharded.device:
        raise RuntimeError(
            f"{where} computes on {unsharded.device} while its sharded parameter lives on "
            f"{sharded.device}: fully_shard(..., offload_policy=CPUOffloadPolicy()) is not "
            "supported by dpoptim. Leave offload_policy at its default."
        )
    if tuple(unsharded.shape) != tuple(sharded.shape):
        raise RuntimeError(
            f"{where} has shape {tuple(unsharded.shape)} in the forward but its sharded parameter "
            f"has the global shape {tuple(sharded.shape)}: dpoptim cannot match them."
        )


def check_layout(p: torch.Tensor, group, describe) -> None:
    """Refuse a DTensor parameter whose layout dpoptim does not handle: anything but one
    mesh dimension over exactly the optimizer's ranks, sharded (not replicated) on one
    dimension."""
    api = _tensor_api()
    mesh = p.device_mesh
    if mesh.ndim != 1:
        raise RuntimeError(
            f"{describe(p)} is a DTensor on a {mesh.ndim}-dimensional device mesh (HSDP or tensor "
            "parallelism): dpoptim supports FSDP2 on a 1-dimensional mesh only. Shard with "
            "fully_shard(module, mesh=init_device_mesh(device, (world_size,)))."
        )
    (placement,) = p.placements
    if not isinstance(placement, api.Shard):
        raise RuntimeError(
            f"{describe(p)} is a DTensor placed as {placement}: dpoptim supports parameters "
            "sharded by fully_shard (Shard placements) only."
        )
    world = 1 if group is None else torch.distributed.get_world_size(group)
    if mesh.size() != world:
        raise RuntimeError(
            f"{describe(p)} is sharded over {mesh.size()} ranks but the optimizer's process group "
            f"has {world}: pass process_group= the group the model is sharded over."
        )


def _chunk(length: int, world: int, rank: int) -> tuple[int, int]:
    """Offset and size of rank ``rank``'s chunk of ``length`` rows cut the way
    ``torch.chunk`` cuts (and DTensor's ``Shard`` with it): ``ceil(length / world)`` rows
    each, the last ranks short or empty."""
    size = -(-length // world) if length else 0
    start = min(rank * size, length)
    return start, min(size, length - start)


def local_slice(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Rank's shard of ``full`` (a tensor of ``p``'s global shape) in ``p``'s layout."""
    (placement,) = p.placements
    mesh = p.device_mesh
    rank = mesh.get_local_rank()
    start, size = _chunk(full.shape[placement.dim], mesh.size(), rank)
    local = full.narrow(placement.dim, start, size)
    expected = p.to_local().shape
    if local.shape != expected:  # a layout other than torch.chunk's: fail loudly, never mix
        raise RuntimeError(
            f"the local shard of a parameter of global shape {tuple(p.shape)} has shape "
            f"{tuple(expected)}, not the {tuple(local.shape)} of an even chunking: dpoptim does "
            "not support this sharding (shard_placement_fn with uneven custom shards?)."
        )
    return local


def reduce_to_shard(full: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """The sum over the ranks of their full-shape ``full``, of which this rank keeps its
    shard (a reduce-scatter: the full sum is never formed on any rank)."""
    api = _tensor_api()
    partial = api.DTensor.from_local(full.contiguous(), p.device_mesh, [api.Partial()], run_check=False)
    return partial.redistribute(p.device_mesh, p.placements).to_local()


def as_grad(local: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``local`` (this rank's shard) as a DTensor gradient laid out like ``p``."""
    api = _tensor_api()
    return api.DTensor.from_local(local, p.device_mesh, p.placements, run_check=False,
                                  shape=p.shape, stride=p.stride())


class ShardStream:
    """Reduce-scatter the clipped sums of one backward block by block, as soon as a block's
    are complete, so that a rank holds full-size sums for about one FSDP block at a time
    rather than for the whole model.

    ``blocks`` is the list, in the same order on every rank, of the parameter lists of the
    FSDP modules (each the sharded parameters it manages, in the optimizer's order);
    ``records`` is, per record of the backward, the set of block indices its parameters
    belong to; ``late`` the block indices whose sums are completed only after every record
    (parameters summed from materialised per-example gradients). Blocks are reduced
    strictly in list order on every rank, each once all its records are done: ranks whose
    examples reach different layers still run the same collectives in the same order.
    ``reduce(params)`` does the collective for one block.
    """

    def __init__(self, blocks: list, records: list[set], late: set, reduce):
        self._blocks, self._reduce = blocks, reduce
        self._remaining = [0] * len(blocks)
        for touched in records:
            for j in touched:
                self._remaining[j] += 1
        for j in late:
            self._remaining[j] += 1
        self._late = late
        self._next = 0

    @staticmethod
    def order(records: list[set]) -> list[int]:
        """The order to clip the records in: by the last block each needs."""
        return sorted(range(len(records)), key=lambda i: max(records[i], default=-1))

    def done(self, touched: set) -> None:
        """One record's clipped sums are in."""
        for j in touched:
            self._remaining[j] -= 1
        self._flush()

    def finish(self) -> None:
        """The late sums are in: reduce every block not reduced yet."""
        for j in self._late:
            self._remaining[j] -= 1
        self._flush()
        if self._next != len(self._blocks):  # pragma: no cover - a bookkeeping error: fail loudly
            raise RuntimeError("dpoptim reduced the FSDP blocks' sums out of order")

    def _flush(self) -> None:
        while self._next < len(self._blocks) and self._remaining[self._next] == 0:
            self._reduce(self._blocks[self._next])
            self._next += 1
