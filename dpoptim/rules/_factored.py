"""Per-example gradients kept as factors, for weights that a layer applies to many rows.

A recurrent layer applies ``W_ih`` and ``W_hh`` at every time step, attention applies its
projections at every token. For one example i, such a weight's gradient is that of a
Linear layer with T rows (a weight used T times, :mod:`dpoptim.rules.linear`):

    ``g_i = sum_t b_t a_t^T``   (``a_t``: the row the weight multiplied, ``b_t``: the
                                 gradient of the product);   bias: ``g_i = sum_t b_t``

A rule that can produce ``a`` and ``b`` never needs ``g_i`` itself. The squared norm goes
the ghost route ``||g_i||^2 = sum_{t,s} (a_t . a_s)(b_t . b_s)`` (Li et al. 2022, "Large
language models can be strong differentially private learners", Sec. 4), costing
``T^2 (d + p)``, or the materialised one, ``T d p``, whichever is cheaper; and the clipped
sum is one matrix product ``(c . b)^T a`` (book-keeping, Bu et al. 2023, "Differentially
private optimization on large model at the cost of one").

Blocks of one use that share a gradient ``b`` share its Gram matrix ``b b^T``: an LSTM's
``W_ih`` and ``W_hh`` both multiply the gate gradients, so after the first the second
costs only ``T^2 d``. A parameter may also be made of row blocks with different inputs
(attention's ``in_proj_weight`` stacks the query, key and value projections); the
blocks' squared norms add.
"""

from __future__ import annotations

import torch

from .. import cost
from ..registry import Rule, Use
from ._common import batched_dot, scaled_product, squared_norms

__all__ = ["Factored", "FactoredRule", "weight_block", "bias_block"]


class _Block:
    """``g_i = sum_t b_t a_t^T`` (``a`` given) or ``g_i = sum_t b_t`` (``a`` is None), with
    ``a: [n, T, d]`` and ``b: [n, T, p]``, or ``[T, n, .]`` with ``batch_dim=1``."""

    __slots__ = ("a", "b", "batch_dim", "joint", "ghost", "materialized", "clipped")

    def __init__(self, a, b, batch_dim, joint=None):
        self.a, self.b, self.batch_dim, self.joint = a, b, batch_dim, joint
        self.ghost = None  # decided by _plan
        self.materialized = None
        self.clipped = None  # set by _clip_shared

    @property
    def rows(self) -> int:
        return self.b.shape[1 - self.batch_dim]

    def _batch_major(self, x):
        return x if self.batch_dim == 0 else x.transpose(0, 1)

    def per_example(self) -> torch.Tensor:
        if self.a is None:
            return self.b.sum(1 - self.batch_dim)
        if self.materialized is None:
            self.materialized = torch.bmm(self._batch_major(self.b).transpose(1, 2), self._batch_major(self.a))
        return self.materialized

    def norms(self, grams: dict) -> torch.Tensor:
        if self.a is None:
            return squared_norms(self.per_example())
        if self.rows == 1:  # ||a||^2 ||b||^2
            return squared_norms(self._batch_major(self.a)) * squared_norms(self._batch_major(self.b))
        if self.ghost:
            return batched_dot(self._gram(self.a, grams), self._gram(self.b, grams))
        return squared_norms(self.per_example())

    def _gram(self, x: torch.Tensor, grams: dict) -> torch.Tensor:
        """``x x^T`` per example, ``[n, T, T]``, computed once per tensor."""
        key = id(x)
        if key not in grams:
            xb = self._batch_major(x)
            grams[key] = (x, torch.bmm(xb, xb.transpose(1, 2)))  # holding x keeps its id unique
        return grams[key][1]

    def clipped_sum(self, factors: torch.Tensor) -> torch.Tensor:
        c = factors.to(self.b.dtype)
        if self.a is None:
            return c @ self.per_example()
        if self.materialized is not None:
            return torch.tensordot(c, self.materialized, dims=1)
        if self.clipped is not None:
            return self.clipped
        return scaled_product(self.b, self.a, c, self.batch_dim)


def weight_block(a: torch.Tensor, b: torch.Tensor, batch_dim: int = 0, joint=None) -> _Block:
    """A weight block ``sum_t b_t a_t^T`` from rows ``a: [n, T, d]`` and gradients
    ``b: [n, T, p]`` (``[T, n, .]`` with ``batch_dim=1``: no copy of time-major tensors).

    ``joint=(rows, start)`` says that ``a`` is ``rows[..., start:start + d]``: blocks
    sharing ``b`` whose ``a`` lie side by side in one tensor clip with one product, no copy.
    """
    return _Block(a, b, batch_dim, joint)


def bias_block(b: torch.Tensor, batch_dim: int = 0) -> _Block:
    """A bias block ``sum_t b_t`` from gradients ``b: [n, T, p]`` (or ``[T, n, p]``)."""
    return _Block(None, b, batch_dim)


class Factored:
    """The per-example gradient of one parameter as row blocks stacked along its first
    dimension (a bias's blocks are stacked along its only dimension)."""

    __slots__ = ("blocks", "shape")

    def __init__(self, blocks: list, shape: torch.Size):
        self.blocks, self.shape = blocks, torch.Size(shape)

    def per_example(self) -> torch.Tensor:
        parts = [block.per_example() for block in self.blocks]
        g = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return g.reshape(g.shape[0], *self.shape)

    def norms(self, grams: dict) -> torch.Tensor:
        total = None
        for block in self.blocks:
            s = block.norms(grams)
            total = s if total is None else total + s
        return total

    def clipped_sum(self, factors: torch.Tensor) -> torch.Tensor:
        parts = [block.clipped_sum(factors) for block in self.blocks]
        g = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return g.reshape(self.shape)


def _plan(factored: dict) -> None:
    """Choose ghost or materialised for every weight block, by cost: blocks that share a
    gradient ``b`` go ghost together when that beats each one's own best route."""
    groups: dict[int, list] = {}
    for f in factored.values():
        for block in f.blocks:
            if block.a is not None and block.ghost is None:
                groups.setdefault(id(block.b), []).append(block)
    for blocks in groups.values():
        T, p = blocks[0].rows, blocks[0].b.shape[2]
        together = cost.ghost_together_is_cheaper(T, p, [blk.a.shape[2] for blk in blocks])
        for blk in blocks:
            blk.ghost = together or cost.ghost_is_cheaper(T, blk.a.shape[2], p)


class FactoredRule(Rule):
    """A rule whose per-example gradients come as :class:`Factored` parameters.

    Subclasses implement :meth:`factors`, which runs once per use (the result is cached
    in ``use.cache``), and get ``per_example``, ``norms`` and ``clipped_sum`` from it.
    """

    def factors(self, use: Use) -> dict[str, Factored]:
        raise NotImplementedError(f"{type(self).__name__} must implement factors")

    def _factors(self, use: Use) -> dict[str, Factored]:
        if "factors" not in use.cache:
            use.cache["factors"] = self.factors(use)
        return use.cache["factors"]

    def terms(self, use, name):
        factored = self._factors(use)[name]
        if len(factored.blocks) != 1:
            return None  # row blocks of one parameter: materialised instead
        block = factored.blocks[0]
        b = block._batch_major(block.b)
        return [(b, None if block.a is None else block._batch_major(block.a))]

    def per_example(self, use, names):
        factors = self._factors(use)
        return {name: factors[name].per_example() for name in names}

    def norms(self, use, names):
        factors = self._factors(use)
        _plan(factors)
        grams: dict = {}  # shared by this call's blocks, then freed: the clipped sums need none
        return {name: factors[name].norms(grams) for name in names}

    def clipped_sum(self, use, names, factors):
        factored = self._factors(use)
        _clip_shared(factored, names, factors)
        return {name: factored[name].clipped_sum(factors) for name in names}


def _clip_shared(factored: dict, names, factors) -> None:
    """Weight blocks that share ``b`` (an LSTM's ``W_ih`` and ``W_hh``) take their clipped
    sums from one product ``(c . b)^T [a_1 | a_2 | ...]``, left in ``block.clipped``."""
    groups: dict[int, list] = {}
    for name in names:
        for block in factored[name].blocks:
            block.clipped = None
            if block.a is not None and block.materialized is None:
                groups.setdefault(id(block.b), []).append(block)
    for blocks in groups.values():
        if len(blocks) < 2 or len({blk.batch_dim for blk in blocks}) > 1:
            continue
        first = blocks[0]
        rows = _side_by_side(blocks)
        if rows is None:
            rows = torch.cat([blk.a for blk in blocks], dim=-1)
        else:
            blocks = sorted(blocks, key=lambda blk: blk.joint[1])
        summed = scaled_product(first.b, rows, factors, first.batch_dim)
        for blk, part in zip(blocks, summed.split([blk.a.shape[-1] for blk in blocks], dim=1)):
            blk.clipped = part


def _side_by_side(blocks):
    """The one tensor whose last dimension the blocks' ``a`` tile, or None."""
    if any(blk.joint is None for blk in blocks) or len({id(blk.joint[0]) for blk in blocks}) > 1:
        return None
    rows = blocks[0].joint[0]
    start = 0
    for blk in sorted(blocks, key=lambda blk: blk.joint[1]):
        if blk.joint[1] != start:
            return None
        start += blk.a.shape[-1]
    return rows if start == rows.shape[-1] else None
