"""Normalization layers: ``LayerNorm``, ``RMSNorm``, ``GroupNorm``, ``InstanceNorm1d/2d/3d``
and ``BatchNorm1d/2d/3d`` in eval mode.

Each computes ``y = x_hat * w + bias`` where ``x_hat`` is the input normalised per example
(or with fixed running statistics) and ``w``, ``bias`` are broadcast over the remaining
dimensions. Because ``x_hat`` of one example does not depend on the others, the
per-example gradients are

    ``g_i(w) = sum_r x_hat[i, r] * b[i, r]``,   ``g_i(bias) = sum_r b[i, r]``

with r running over every position of example i that shares one element of ``w`` (all
dimensions other than the batch and the parameter's own). They are as small as the
parameters, so they are materialised and the base class's norms and clipped sum apply.
``x_hat`` is recomputed from the saved input in float32 or wider, with the layer's own
statistics:

=======================  ======================================  ==========================
layer                    statistics over                         parameter dims
=======================  ======================================  ==========================
LayerNorm                the last ``len(normalized_shape)`` dims  the same trailing dims
RMSNorm (no centering)   the last ``len(normalized_shape)`` dims  the same trailing dims
GroupNorm                channels of one group and all positions  channel (dim 1)
InstanceNorm, training   all positions of one channel             channel (dim 1)
InstanceNorm / BatchNorm running mean and variance (eval mode)   channel (dim 1)
=======================  ======================================  ==========================

BatchNorm in training mode (or without running statistics) normalises with statistics of
the whole batch: per-example gradients do not exist. ``BatchNormRule.mixes_examples`` says
so, and the engine refuses every backward that reaches such a call, frozen or not; a
BatchNorm-derived module with a forward of its own (no registered rule) gets the same
refusal from :class:`BatchStatisticsGuard`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import _torch
from ..registry import Rule, register_automatic, register_rule
from ._common import batched, common_dtype

__all__ = ["NormRule", "BatchNormRule", "BatchStatisticsGuard", "affine_per_example"]


def affine_per_example(x_hat: torch.Tensor, b: torch.Tensor, param_dims: tuple[int, ...], names) -> dict:
    """Per-example gradients of ``y = x_hat * w + bias`` for ``w``, ``bias`` laid along
    ``param_dims`` of ``x_hat: [n, ...]`` and broadcast over every other non-batch dim.

    Returns ``{"weight": [n, *w.shape], "bias": [n, *w.shape]}`` for the names asked.
    ``x_hat`` is a temporary and is overwritten (with ``x_hat * b``), which saves a copy
    as large as the layer's input.
    """
    reduced = [d for d in range(1, x_hat.dim()) if d not in param_dims]

    def total(t):
        return t.sum(reduced) if reduced else t  # sum over an empty list would sum everything

    out = {}
    if "weight" in names:
        out["weight"] = total(x_hat.mul_(b))
    if "bias" in names:
        out["bias"] = total(b)
    return out


def _standardize(x: torch.Tensor, dims, eps: float) -> torch.Tensor:
    # Mean and biased variance by hand: var_mean warns on the empty tensors of a batch of 0.
    mean = x.mean(dims, keepdim=True)
    var = (x - mean).square().mean(dims, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps)


def _with_running(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, eps: float) -> torch.Tensor:
    shape = (1, -1) + (1,) * (x.dim() - 2)
    return (x - mean.to(x.dtype).reshape(shape)) * torch.rsqrt(var.to(x.dtype).reshape(shape) + eps)


class NormRule(Rule):
    """Shared by every normalization layer: subclasses say how to recompute ``x_hat`` and
    along which dims the affine parameters lie (the channel dim unless they say otherwise)."""

    detach_parameters = True  # every norm forward reads self.weight / self.bias at call time

    def save(self, module, args, kwargs, output):
        x = args[0] if args else kwargs["input"]
        batched(x, module, "input", min_dim=self.min_input_dim(module))
        return x, self.fixed_statistics(module)

    def min_input_dim(self, module) -> int:
        return 2

    def fixed_statistics(self, module):
        """Running statistics the forward used, copied (a training-mode forward before this
        backward would update them in place), or None when it used input statistics."""
        return None

    def param_dims(self, module, x: torch.Tensor) -> tuple[int, ...]:
        return (1,)

    def normalized(self, module, x: torch.Tensor, stats) -> torch.Tensor:
        raise NotImplementedError

    def per_example(self, use, names):
        (x, stats), grad = use.saved, use.grad_outputs[0]
        dtype = common_dtype(x) if grad is None else common_dtype(x, grad)
        x = x.detach().to(dtype)
        b = torch.zeros_like(x) if grad is None else grad.to(dtype)
        x_hat = self.normalized(use.module, x, stats)
        return affine_per_example(x_hat, b, self.param_dims(use.module, x), names)


class _TrailingNormRule(NormRule):
    """Statistics and parameters both over the last ``len(normalized_shape)`` dims."""

    def min_input_dim(self, module):
        return len(module.normalized_shape) + 1

    def param_dims(self, module, x):
        return tuple(range(x.dim() - len(module.normalized_shape), x.dim()))


@register_rule(nn.LayerNorm)
class LayerNormRule(_TrailingNormRule):
    def normalized(self, module, x, stats):
        # ATen's own kernel (no affine): one pass, where mean, sub, square, mean, rsqrt and mul take six.
        return F.layer_norm(x, module.normalized_shape, None, None, module.eps)


@register_rule(nn.RMSNorm)
class RMSNormRule(_TrailingNormRule):
    def normalized(self, module, x, stats):
        eps = module.eps
        if eps is None:
            # ATen takes the epsilon of the type it computes in: float32 for half types.
            eps = torch.finfo(torch.promote_types(x.dtype, torch.float32)).eps
        dims = self.param_dims(module, x)
        return x * torch.rsqrt(x.square().mean(dims, keepdim=True) + eps)


@register_rule(nn.GroupNorm)
class GroupNormRule(NormRule):
    def normalized(self, module, x, stats):
        return F.group_norm(x, module.num_groups, None, None, module.eps)  # ATen's kernel, no affine


class _RunningStatsRule(NormRule):
    """InstanceNorm and BatchNorm: running statistics in eval mode when they are tracked."""

    def uses_running(self, module) -> bool:
        # BatchNorm's forward: eval mode with the buffers present.
        return not module.training and module.running_mean is not None

    def fixed_statistics(self, module):
        if self.uses_running(module):
            return module.running_mean.detach().clone(), module.running_var.detach().clone()
        return None

    def input_statistics_dims(self, x):
        raise NotImplementedError

    def normalized(self, module, x, stats):
        if stats is not None:
            return _with_running(x, *stats, module.eps)
        return _standardize(x, self.input_statistics_dims(x), module.eps)


class InstanceNormRule(_RunningStatsRule):
    def min_input_dim(self, module):
        return _torch.no_batch_dim(module) + 1

    def uses_running(self, module) -> bool:
        # InstanceNorm's forward: use_input_stats = training or not track_running_stats.
        return not module.training and module.track_running_stats and module.running_mean is not None

    def changes_state(self, module):
        if module.training and module.track_running_stats:
            return (
                f"{module!r} updates its running statistics from the training data, outside the "
                "optimizer and without noise, whether its own parameters train or not: they would "
                "leak information DP-SGD does not account for. Build it with track_running_stats=False."
            )
        return None

    def input_statistics_dims(self, x):
        return tuple(range(2, x.dim()))


def _batch_statistics(module) -> str | None:
    """BatchNorm's forward normalises with the batch's own statistics in training mode and
    whenever it has no running statistics."""
    if not module.training and getattr(module, "running_mean", None) is not None:
        return None
    return (
        f"{type(module).__name__} uses batch statistics, which mix examples: per-example "
        "gradients do not exist and DP-SGD's guarantee would not hold. Replace it with "
        "GroupNorm (dpoptim.replace_batchnorm(model)) or put it in eval mode."
    )


class BatchNormRule(_RunningStatsRule):
    """BatchNorm1d/2d/3d and SyncBatchNorm with running statistics (eval mode); refuses
    batch statistics (:meth:`mixes_examples`)."""

    def mixes_examples(self, module):
        return _batch_statistics(module)

    def normalized(self, module, x, stats):
        if stats is None:  # the engine refuses such a backward before any rule runs
            raise RuntimeError(_batch_statistics(module) or "BatchNorm without running statistics")
        return _with_running(x, *stats, module.eps)


class BatchStatisticsGuard(Rule):
    """Any other BatchNorm-derived module (one with its own forward): claims none of its
    parameters (they are reported as uncovered) and refuses batch statistics."""

    def applies(self, module) -> bool:
        return _torch.is_batch_norm(module)

    def parameters(self, module):
        return {}

    def mixes_examples(self, module):
        return _batch_statistics(module)

    def per_example(self, use, names):
        return {}


for _cls in (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d):
    register_rule(_cls, InstanceNormRule)
for _cls in (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm):
    register_rule(_cls, BatchNormRule)
register_automatic(BatchStatisticsGuard(), order=0)  # before any rule that would claim its parameters
