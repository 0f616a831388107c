"""The engine's side of FSDP2 (``fully_shard``): sharded parameters seen through their
unsharded stand-ins, and clipped sums kept as shards.

FSDP2 puts an unsharded copy of each sharded parameter into the module's slot for the
forward. The engine notes which sharded parameter each slot holds before an FSDP module's
forward (:meth:`ShardingMixin._remember_slots`) and recognises the unsharded copy as its
stand-in (:meth:`ShardingMixin._alias`), hooked as the sharded one would be. Rules that read
weight values in the clipping get the released weights gathered again
(:meth:`ShardingMixin._gather_released`), and each backward's clipped sums are
reduce-scattered block by block as soon as a block's are complete
(:meth:`ShardingMixin._shard_stream`, :class:`dpoptim.fsdp.ShardStream`). The layout
arithmetic and the refusals live in :mod:`dpoptim.fsdp`.
"""

from __future__ import annotations

import functools
import weakref

import torch

from . import _torch, fsdp, paths
from .capture import _accumulated_hook, _param_grad_hook

__all__ = ["ShardingMixin"]


class ShardingMixin:
    """FSDP2 methods of :class:`dpoptim.engine.GradEngine` (see the module docstring)."""

    def _owned(self, p):
        """The optimizer's parameter ``p`` is or stands in for (FSDP2's unsharded copy of a
        sharded one), or None."""
        if p is None:
            return None
        if id(p) in self._params:
            return p
        alias = self._aliases.get(id(p))
        return alias[1] if alias is not None and alias[0]() is p else None

    def _remember_slots(self, module) -> None:
        """Before an FSDP module's forward its slots hold the sharded parameters: note which
        slot holds which, so the unsharded ones FSDP puts there are recognised."""
        for sub, name, p in fsdp.sharded_slots(module, self._params):
            self._slots[(id(sub), name)] = p
            # the innermost FSDP module around a parameter manages it: it is seen last
            self._fsdp_owner[id(p)] = (weakref.ref(module), sub, name)

    def _gather_released(self, records) -> list:
        """Under FSDP2: gather again the weights of the FSDP modules that FSDP has already
        released (resharded) and whose records' rules read weight values in the clipping
        (``Rule.reads_weights``). Returns the modules to release again afterwards. A
        collective: every rank processes the same records in the same order."""
        gathered = []
        for record in records:
            if not record.rule.reads_weights:
                continue
            for _, p in record.params:
                owner = self._fsdp_owner.get(id(p))
                module = None if owner is None else owner[0]()
                if module is None or module in gathered or _torch.own_parameters(owner[1]).get(owner[2]) is not p:
                    continue  # not sharded, already gathered, or its slot holds the gathered one
                module.unshard()
                gathered.append(module)
        return gathered

    def _alias(self, module, name, p):
        """Recognise ``p`` in ``module``'s slot ``name`` as FSDP2's unsharded stand-in for
        a sharded parameter of this optimizer; hook it as the sharded one is hooked."""
        sharded = self._slots.get((id(module), name))
        if sharded is None or p is None or id(p) in self._params:
            return
        if self._owned(p) is not sharded:
            fsdp.check_unsharded(p, sharded, f"parameter '{name}' of {paths.describe(module)}")
            self._aliases[id(p)] = (weakref.ref(p), sharded)
        # FSDP copies requires_grad from the sharded parameter at every gathering: one
        # frozen when first seen is hooked once it is unfrozen.
        if p.requires_grad and id(p) not in self._alias_hooked:
            self._alias_hooked.add(id(p))
            self._handles.append(p.register_post_accumulate_grad_hook(functools.partial(_accumulated_hook, self._ref, sharded)))
            if self._verify:
                self._verify_handles.append(p.register_hook(functools.partial(_param_grad_hook, self._ref, id(sharded))))

    def _owned_in(self, module, name, p):
        """:meth:`_owned` for ``p`` found at ``name`` (maybe a child's) of ``module``."""
        if self._slots and id(p) not in self._params:
            owner, _, leaf = name.rpartition(".")
            self._alias(module.get_submodule(owner) if owner else module, leaf, p)
        return self._owned(p)

    def _blocks(self) -> list[list]:
        """FSDP2: the trainable sharded parameters of each FSDP module, modules and
        parameters in the optimizer's order (the same on every rank); parameters whose
        module is not known come last, as a block of their own."""
        blocks: dict = {}
        for pid, p in self._params.items():
            if p.requires_grad and fsdp.is_sharded(p):
                owner = self._fsdp_owner.get(pid)
                blocks.setdefault(None if owner is None else id(owner[0]()), []).append(p)
        unowned = blocks.pop(None, None)
        return list(blocks.values()) + ([unowned] if unowned else [])

    def _blocks_of(self, record) -> set:
        return {self._block_index[id(p)] for _, p in record.params if id(p) in self._block_index}

    def _shard_stream(self, uses, counts):
        """The uses in the order that lets FSDP blocks be reduced early, and the
        :class:`~dpoptim.fsdp.ShardStream` that reduces them."""
        blocks = self._blocks()
        self._block_index = {id(p): j for j, block in enumerate(blocks) for p in block}
        touched = [self._blocks_of(record) for record, _ in uses]
        uses = [uses[i] for i in fsdp.ShardStream.order(touched)]
        late = {self._block_index[pid] for pid, n in counts.items() if n > 1 and pid in self._block_index}
        return uses, fsdp.ShardStream(blocks, [self._blocks_of(r) for r, _ in uses], late, self._reduce_sharded)

    def _reduce_sharded(self, params) -> None:
        """FSDP2: reduce-scatter this backward's full-shape clipped sums of ``params``
        (sharded), so that only shards are kept until ``step()``. A collective per
        parameter, in the same order on every rank (a rank none of whose examples reached
        a parameter sends zeros)."""
        for p in params:
            pid = id(p)
            full = self._sums.pop(pid, None)
            if full is None:
                full = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
            shard = fsdp.reduce_to_shard(full, p)
            del full
            current = self._shards.get(pid)
            self._shards[pid] = shard if current is None else current.add_(shard)
