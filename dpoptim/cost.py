"""Which route computes a per-example squared norm: the one place that decides.

A weight used at ``T`` rows per example (tokens, positions, time steps) has the per-example
gradient ``g_i = sum_t b_t a_t^T`` (``a_t`` of width ``d``, ``b_t`` of width ``p``). Its
squared norm has two exact routes:

* **ghost** (Goodfellow 2015; Li et al. 2022, "Large language models can be strong
  differentially private learners"): ``||g_i||^2 = sum_{t,s} (a_t . a_s)(b_t . b_s)``,
  two Gram matrices, about ``T^2 (d + p)`` multiply-adds per example;
* **materialised**: form ``g_i`` (``T d p``) and square it; ``g_i`` is then reused for the
  clipped sum.

Bu et al. 2022 ("Scalable and efficient training of large convolutional neural networks
with differential privacy", mixed ghost clipping) choose per layer by this count, and so
does dpoptim: :func:`ghost_is_cheaper` is used by the Linear, convolution, recurrent and
attention rules and, for a weight shared by several uses, by the engine.
:func:`ghost_together_is_cheaper` decides for weights whose blocks share one ``b``, and
:func:`embedding_gram_is_cheaper` for an embedding, whose alternative to the Gram matrix is
a sort. Every route is exact; the choice only changes time and memory.
"""

from __future__ import annotations

__all__ = ["MATERIALIZE_LIMIT", "ghost_is_cheaper", "ghost_together_is_cheaper", "embedding_gram_is_cheaper"]

#: Above this many numbers (``n d p``) per-example gradients are not materialised where the
#: ghost route exists, even where materialising would take fewer operations.
MATERIALIZE_LIMIT = 1 << 24


def ghost_is_cheaper(rows: int, d: int, p: int, examples: int | None = None) -> bool:
    """Whether the ghost norm (``rows^2 (d + p)`` per example) beats materialising
    (``rows d p``); with ``examples``, also when materialising ``examples * d * p`` numbers
    would exceed :data:`MATERIALIZE_LIMIT`."""
    if examples is not None and examples * d * p > MATERIALIZE_LIMIT:
        return True
    return rows * (d + p) < d * p


def ghost_together_is_cheaper(rows: int, p: int, widths: list[int]) -> bool:
    """Several weight blocks that share the output gradient ``b`` (width ``p``) with inputs
    of ``widths``: whether their ghost norms together (one Gram matrix of ``b``,
    ``rows^2 (p + sum d)``) beat each block taking its own cheaper route."""
    alone = sum(min(rows * rows * (d + p), rows * d * p) for d in widths)
    return len(widths) > 1 and rows * rows * (p + sum(widths)) <= alone


def embedding_gram_is_cheaper(rows: int, p: int) -> bool:
    """An embedding's norm: the Gram matrix of its ``rows`` output gradients masked to equal
    indices (``rows^2 p``) against sorting the indices and summing runs (``rows log rows +
    rows p``, but memory-bound). Measured on CPU: the Gram matrix wins up to about here."""
    return rows <= 128 and rows < 2 * p
