"""``nn.Embedding``: a lookup ``y_t = W[idx_t]`` at every position t of an example.

For example i with positions t (every dimension of the index tensor after the batch) and
output gradients ``b_t`` (width p), the weight gradient is

    ``g_i = sum_t e_{idx_t} b_t^T``,   so row v of ``g_i`` is ``sum_{t: idx_t = v} b_t``,

leaving out positions whose index is ``padding_idx``: autograd gives that row no gradient,
so neither do we (Opacus' per-sample gradient includes it).

Squared norm. The ghost form is ``sum_{t,s} [idx_t = idx_s] (b_t . b_s)`` (Li et al. 2022),
which costs T^2 p per example, in one batched product. For long sequences we compute the
same number exactly in ~T log T + T p instead: sort each example's indices, add up the
``b_t`` of each run of equal indices (one row of ``g_i`` each), and sum the squares of
those rows. Sorting, gathering and scattering move memory, while the product runs at the
speed of a matrix multiply, so the ghost form is the faster one up to T ~ min(128, 2p).

Clipped sum: ``sum_i c_i g_i`` is one ``index_add_`` of the rows ``c_i b_t`` into a dense
``[num_embeddings, p]`` tensor (book-keeping, Bu et al. 2023). With ``sparse=True``
autograd would hand back a sparse gradient; the noise that follows is dense anyway, so
the clipped sum is dense.

``nn.EmbeddingBag``: each bag is an example (a row of a 2-D input, or a span of a 1-D
input given by ``offsets``) with one output ``y_i`` and its gradient ``b_i``. In 'sum' and
'mean' mode ``y_i = sum_j w_j W[idx_j]`` over the bag's entries, with ``w_j`` the
per-sample weight (sum), ``1/count_i`` (mean, count of non-padding entries) and 0 at
``padding_idx``, so the per-example gradient has rank one:

    ``g_i = u_i b_i^T``,  ``u_i = sum_j w_j e_{idx_j}``,  ``||g_i||^2 = ||u_i||^2 ||b_i||^2``,

with ``||u_i||^2`` summed over runs of equal indices after one sort. In 'max' mode feature k
of ``y_i`` is copied from one row, ``m_ik``, which torch's own kernel picks (recomputed at
forward time, so ties resolve exactly as autograd resolves them):
``g_i[v, k] = b_ik [m_ik = v]`` and ``||g_i||^2 = ||b_i||^2`` over non-empty bags.

``scale_grad_by_freq=True`` divides each row's gradient by how often its index occurs in
the whole batch, so one example's gradient depends on the others: refused. ``max_norm``
renormalises looked-up rows in place, which reveals the batch: refused.

Indices with a batch dimension of 1 (Hugging Face's ``position_ids`` of shape ``[1, T]``)
look up rows once for the whole batch; the output ``[1, T, p]`` is then broadcast against
the batch (``inputs_embeds + position_embeds``). Every example uses the same rows: an
ordinary shared use, whose per-example output gradients autograd would add up at the
broadcast. The output is handed on as an alias that, where it meets the batch, reads one
explicit copy per example (see :mod:`dpoptim.rules.shared`); the rule then sees output
gradients ``[n, T, p]`` and the indices expanded to ``[n, T]``, and everything above applies.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..registry import Rule, Use, register_rule
from .. import cost, paths
from ._common import batched, batched_dot, common_dtype, squared_norms
from .shared import SharedTensorError, broadcast_alias, per_example_of_uses

__all__ = ["EmbeddingRule", "EmbeddingBagRule"]


def _check_options(module) -> None:
    if module.scale_grad_by_freq:
        raise ValueError(
            f"{module!r} has scale_grad_by_freq=True: it scales gradients by how often each "
            "index occurs in the whole batch, which mixes examples, so per-example gradients "
            f"do not exist. Build the {type(module).__name__} with scale_grad_by_freq=False."
        )


def _renormalised_rows(module) -> str | None:
    """Why the forward of ``module`` changes its weights from the batch (frozen or not)."""
    if module.max_norm is None:
        return None
    return (
        f"{module!r} has max_norm set: its forward renormalises, in place and outside the "
        "optimizer, exactly the rows the batch looks up, so the weights would reveal which "
        "indices were in the batch; DP-SGD's noise does not cover that, frozen or not. Build it "
        "with max_norm=None; to bound the rows, renormalise every row after each step "
        "(with torch.no_grad(): emb.weight.renorm_(2, 0, max_norm))."
    )


def _runs(keys: torch.Tensor):
    """Sort ``keys`` along its last dim; return the order and, per sorted position, the
    number of its run of equal keys (0, 1, ...). Fixed-size outputs: no host sync on GPUs."""
    ordered, order = keys.sort(dim=-1)
    starts = torch.ones_like(ordered, dtype=torch.long)
    starts[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    return order, starts.cumsum(-1) - 1


@register_rule(nn.Embedding)
class EmbeddingRule(Rule):
    detach_parameters = True  # the forward reads self.weight at call time

    def check(self, module):
        _check_options(module)

    def changes_state(self, module):
        return _renormalised_rows(module)

    def save(self, module, args, kwargs, output):
        indices = args[0] if args else kwargs["input"]
        return [batched(indices, module, "input", min_dim=1), None]

    def replace_output(self, module, saved, output):
        indices = saved[0]
        if indices.dim() < 2 or indices.shape[0] != 1 or not output.requires_grad:
            return None
        # One lookup for the whole batch: split it per example where it meets the batch.
        alias, saved[1] = broadcast_alias(output, lambda: f"the output of {paths.describe(module)}")
        return alias

    def _rows(self, use: Use):
        """Indices ``[n, T]`` and output gradients ``[n, T, p]``, zero at padding positions."""
        if "rows" in use.cache:
            return use.cache["rows"]
        module, saved, grad = use.module, use.saved, use.grad_outputs[0]
        # saved: [indices, shared-lookup source or None], or the indices alone (a Use built by hand)
        indices, source = (saved, None) if isinstance(saved, torch.Tensor) else (saved[0], saved[1])
        if source is not None and source.grads:
            split = self._split(module, indices, source)
            if split is not None:
                grad, indices = split, indices.expand(split.shape[0], *indices.shape[1:])
        n, p = indices.shape[0], module.embedding_dim
        indices = indices.reshape(n, math.prod(indices.shape[1:]))
        if grad is None:
            grad = module.weight.new_zeros(*indices.shape, p)
        b = grad.reshape(*indices.shape, p).to(common_dtype(grad))
        if module.padding_idx is not None:
            b = b.masked_fill((indices == module.padding_idx).unsqueeze(-1), 0)
        use.cache["rows"] = (indices, b)
        return use.cache["rows"]

    @staticmethod
    def _split(module, indices, source):
        """Per-example output gradients ``[n, *indices.shape[1:], p]`` of a lookup made
        once for the batch, from the per-example copies where it met the batch (None: the
        batch has one example, and the output's own gradient is its)."""
        grads = [source.grads.get(k) for k in range(len(source.uses))]
        g = per_example_of_uses(source.uses, grads, source.base, lambda: source.label)
        if source.plain is not None and g.shape[0] != 1:
            raise SharedTensorError(
                f"{source.label} (indices of shape {tuple(indices.shape)}, one lookup for the whole batch) "
                f"is broadcast against the batch in one place but also used in `{source.plain}`, "
                "which is not element-wise, where its examples cannot be told apart. Expand the "
                "indices to the batch first (ids.expand(batch_size, -1))."
            )
        if source.plain is not None:
            return None  # a batch of one: the output's own gradient is that example's
        return g.reshape(g.shape[0], *g.shape[2:])

    def terms(self, use, name):
        indices, b = self._rows(use)  # padding positions already have b = 0
        return [(indices, b)]

    def per_example(self, use, names):
        indices, b = self._rows(use)
        n, p = b.shape[0], b.shape[2]
        rows = use.module.num_embeddings
        # Example i's rows live at i * num_embeddings + idx of one flat [n * V, p] tensor.
        where = (torch.arange(n, device=indices.device).unsqueeze(1) * rows + indices).flatten()
        g = b.new_zeros(n * rows, p).index_add_(0, where, b.flatten(0, 1))
        return {"weight": g.reshape(n, rows, p)}

    def norms(self, use, names):
        indices, b = self._rows(use)
        n, T, p = b.shape
        if T <= 1:
            return {"weight": squared_norms(b)}
        if cost.embedding_gram_is_cheaper(T, p):  # the Gram matrix of b, masked to equal indices
            same = indices.unsqueeze(2) == indices.unsqueeze(1)
            return {"weight": batched_dot(torch.bmm(b, b.transpose(1, 2)), same.to(b.dtype))}
        # Sorting puts equal indices next to each other; a run of equal indices is one row of g_i.
        order, run = _runs(indices)
        run = run.unsqueeze(-1).expand(n, T, p)
        b_sorted = b.gather(1, order.unsqueeze(-1).expand(n, T, p))
        rows = torch.zeros_like(b).scatter_add_(1, run, b_sorted)
        return {"weight": squared_norms(rows)}

    def clipped_sum(self, use, names, factors):
        indices, b = self._rows(use)
        weight = use.module.weight
        scaled = b * factors.to(b.dtype)[:, None, None]
        summed = b.new_zeros(weight.shape).index_add_(0, indices.flatten(), scaled.flatten(0, 1))
        return {"weight": summed}


_BAG_MODES = {"sum": 0, "mean": 1, "max": 2}


@register_rule(nn.EmbeddingBag)
class EmbeddingBagRule(Rule):
    detach_parameters = True  # the forward reads self.weight at call time

    def check(self, module):
        _check_options(module)

    def changes_state(self, module):
        return _renormalised_rows(module)

    def save(self, module, args, kwargs, output):
        names = ("input", "offsets", "per_sample_weights")
        given = dict(zip(names, args), **kwargs)
        indices, offsets, weights = (given.get(name) for name in names)
        if indices.is_nested:
            raise ValueError(
                f"{type(module).__name__} got a nested-tensor input; pass the flat indices and "
                "their offsets instead"
            )
        include_last = module.include_last_offset
        if indices.dim() == 2:  # a batch of equal-length bags, read as F.embedding_bag reads it
            offsets = torch.arange(0, indices.numel(), indices.shape[1], dtype=indices.dtype, device=indices.device)
            indices, include_last = indices.reshape(-1), False
            weights = None if weights is None else weights.reshape(-1)
        chosen = None
        if module.mode == "max":
            # The row each output feature was copied from, exactly as autograd will route it.
            with torch.no_grad():
                chosen = torch.embedding_bag(
                    module.weight, indices, offsets, False, _BAG_MODES["max"], False, None,
                    include_last, module.padding_idx,
                )[3]
        return indices, offsets, include_last, weights, chosen

    def _bags(self, use: Use):
        """Per entry: its bag and its coefficient ``w_j`` (sum/mean); output gradients
        ``[n, p]`` in a wide dtype."""
        if "bags" in use.cache:
            return use.cache["bags"]
        module = use.module
        indices, offsets, include_last, weights, chosen = use.saved
        grad = use.grad_outputs[0]
        if grad is None:
            bags = offsets.shape[0] - (1 if include_last else 0)
            grad = module.weight.new_zeros(bags, module.embedding_dim)
        b = grad.to(common_dtype(grad))
        n = b.shape[0]
        entries = torch.arange(indices.shape[0], device=indices.device, dtype=offsets.dtype)
        bag = torch.searchsorted(offsets, entries, right=True) - 1
        counted = (bag < n) & (bag >= 0)  # entries past the last bag take no part
        if module.padding_idx is not None:
            counted &= indices != module.padding_idx
        bag = bag.clamp(0, max(n - 1, 0)).long()
        coef = counted.to(b.dtype)
        sizes = torch.zeros(n, dtype=b.dtype, device=b.device).index_add_(0, bag, coef)
        if weights is not None:
            coef = coef * weights.detach().to(b.dtype)
        if module.mode == "mean":
            coef = coef / sizes.clamp(min=1)[bag]
        elif module.mode == "max":
            # An empty (or all-padding) bag outputs zeros and sends no gradient anywhere.
            b = b * (sizes > 0).unsqueeze(1).to(b.dtype)
            chosen = chosen.clamp(min=0).long()
        use.cache["bags"] = (indices, bag, coef, b, chosen)
        return use.cache["bags"]

    def per_example(self, use, names):
        indices, bag, coef, b, chosen = self._bags(use)
        n, p = b.shape
        rows = use.module.num_embeddings
        g = b.new_zeros(n, rows, p)
        if use.module.mode == "max":
            return {"weight": g.scatter_add_(1, chosen.unsqueeze(1), b.unsqueeze(1))}
        where = bag * rows + indices.long()
        g.view(n * rows, p).index_add_(0, where, coef.unsqueeze(1) * b[bag])
        return {"weight": g}

    def norms(self, use, names):
        indices, bag, coef, b, chosen = self._bags(use)
        n = b.shape[0]
        if use.module.mode == "max":
            return {"weight": b.square().sum(1)}
        # ||u_i||^2: add the coefficients of each run of equal (bag, index) pairs, then square.
        order, run = _runs(bag * use.module.num_embeddings + indices.long())
        per_run = torch.zeros_like(coef).index_add_(0, run, coef[order])
        run_bag = torch.zeros_like(bag).scatter_(0, run, bag[order])
        u = torch.zeros(n, dtype=coef.dtype, device=coef.device).index_add_(0, run_bag, per_run.square())
        return {"weight": u * b.square().sum(1)}

    def clipped_sum(self, use, names, factors):
        indices, bag, coef, b, chosen = self._bags(use)
        weight = use.module.weight
        scaled = b * factors.to(b.dtype).unsqueeze(1)
        summed = b.new_zeros(weight.shape)
        if use.module.mode == "max":
            return {"weight": summed.scatter_add_(0, chosen, scaled)}
        return {"weight": summed.index_add_(0, indices.long(), coef.unsqueeze(1) * scaled[bag])}
