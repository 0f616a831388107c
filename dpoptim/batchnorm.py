"""Replacing batch normalization, which mixes examples, with group normalization."""

from __future__ import annotations

import math

from torch import nn

from ._torch import is_batch_norm

__all__ = ["replace_batchnorm"]


def _groups_for(channels: int, preferred: int) -> int:
    return math.gcd(channels, preferred) or 1


def replace_batchnorm(model: nn.Module, num_groups: int = 32) -> nn.Module:
    """Swap every ``BatchNorm1d/2d/3d`` and ``SyncBatchNorm`` in ``model`` for a ``GroupNorm``
    over the same channels, in place, and return ``model``.

    The group count is the largest divisor of the channel count that also divides
    ``num_groups`` (so 32 groups for 64 channels, 1 group for 3). Affine flags carry over;
    weights start fresh (ones and zeros), as they would for a new layer. Build the optimizer
    after calling this, since the parameters are new.
    """
    if is_batch_norm(model):
        raise TypeError("replace_batchnorm works on a model that contains BatchNorm layers; wrap it in a module")
    for name, child in model.named_children():
        if is_batch_norm(child):
            replacement = nn.GroupNorm(
                _groups_for(child.num_features, num_groups),
                child.num_features,
                eps=child.eps,
                affine=child.affine,
            )
            if child.affine:
                replacement = replacement.to(device=child.weight.device, dtype=child.weight.dtype)
            setattr(model, name, replacement)
        else:
            replace_batchnorm(child, num_groups)
    return model
