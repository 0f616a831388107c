r"""A group of steps as mixtures of its corner pairs: grouping that loses almost nothing.

Beyond :data:`~dpoptim.accounting.ledger.MAX_DISTINCT_RUNS` distinct ``(sigma, q)`` pairs,
steps are grouped. Accounting every step of a group as the group's smallest sigma with its
largest q is sound but loses the ranges: 4% of epsilon on a schedule that raises sigma and
q together over 10^4 runs. Here each step is instead replaced by a *mixture* of the
group's corner pairs, with weights that keep it dominated, and the mixture's privacy loss
distribution is the same mixture of the corners' distributions: four transforms per group
account for every step in it almost exactly.

**Mixtures.** A public coin picks pair ``c`` with probability ``w_c`` and the step runs
that pair, coin revealed. Its hockey-stick divergences are the average
:math:`\sum_c w_c \delta_c(\varepsilon)`, its privacy loss distribution the mixture of the
corners' (in each direction), and it composes like any pair. If its profile lies above a
step's at every :math:`\varepsilon \in \mathbb R`, the mixture *dominates* the step
(Blackwell; it then dominates in the other direction too, since
:math:`\delta_{Q,P}(\varepsilon) = 1 - e^\varepsilon + e^\varepsilon \delta_{P,Q}(-\varepsilon)`
is increasing in :math:`\delta_{P,Q}`), and domination survives composition.

**In q, exactly.** With sigma fixed, :math:`P_q = (1-q)\mathcal N(0,\sigma^2) + q\mathcal
N(1,\sigma^2)` is linear in q against the same :math:`Q`: the pair at ``q`` between
``q_lo`` and ``q_hi`` *is* the mixture with weight ``v = (q - q_lo) / (q_hi - q_lo)`` on
``q_hi``, coin hidden; revealing the coin only adds to what is released.

**In sigma, by a lemma.** With ``mu = 1/sigma`` the Gaussian mechanism's profile
:math:`\delta_\mu(\varepsilon) = \Phi(\mu/2 - \varepsilon/\mu) - e^\varepsilon
\Phi(-\mu/2 - \varepsilon/\mu)` has :math:`\partial_\mu \delta_\mu(\varepsilon) =
\varphi(\varepsilon/\mu - \mu/2) = g_\varepsilon(\mu)\, e^{-\mu^2/8}` with
:math:`g_\varepsilon(\mu) = e^{\varepsilon/2 - \varepsilon^2/(2\mu^2)}/\sqrt{2\pi}`
non-decreasing in ``mu``. For ``mu_lo < mu < mu_hi`` and every epsilon, then,

.. math::
    \frac{\delta_\mu - \delta_{\mu_{lo}}}{\delta_{\mu_{hi}} - \delta_\mu}
    = \frac{\int_{\mu_{lo}}^{\mu} g\, e^{-t^2/8}}{\int_{\mu}^{\mu_{hi}} g\, e^{-t^2/8}}
    \le \frac{\Psi(\mu) - \Psi(\mu_{lo})}{\Psi(\mu_{hi}) - \Psi(\mu)},
    \qquad \Psi(t) = \int_0^t e^{-s^2/8} ds \propto \Phi(t/2),

so the mixture with weight :math:`w = (\Phi(\mu/2) - \Phi(\mu_{lo}/2)) / (\Phi(\mu_{hi}/2) -
\Phi(\mu_{lo}/2))` on ``mu_hi`` (the group's smallest sigma) dominates the step at ``mu``;
the weight is exact at :math:`\varepsilon = 0`, where it cannot be smaller. The subsampled
pairs at a common ``q`` inherit this: their profile is :math:`1 - e^\varepsilon` (the same
for every sigma) where :math:`e^\varepsilon \le 1 - q`, and :math:`q\,\delta_\mu(\log(1 +
(e^\varepsilon - 1)/q))` above.

**Both.** A step ``(sigma, q)`` of a group spanning ``[sigma_lo, sigma_hi] x [q_lo, q_hi]``
is the q-mixture of ``(sigma, q_lo)`` and ``(sigma, q_hi)``, each dominated by the
sigma-mixture of the corners at its ``q``: the four corners with weights ``v w``, ``(1-v)
w``, ``v (1-w)``, ``(1-v)(1-w)``. The profile of that mixture grows with ``v`` and with ``w``
(each moves weight to a dominating corner), so rounding them *up* keeps it sound: they are
rounded up to multiples of ``1/levels``, and the steps of a group then share a hundred
weight rows or so. Rounding also covers the floating-point error of the weights. Any box
holding the step will do: neighbouring groups of a schedule stretch theirs to share a
corner (:func:`mixture_groups`).

Only the upper bound uses mixtures: a lower bound (``optimistic`` grouping) keeps the
corner that the group dominates.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import numpy as np

from .ledger import _nearest_quarter_octave, _step_costs
from .rdp import conversion_terms
from .special import log_ndtr

__all__ = ["MixtureGroup", "mixture_groups", "mixture_rdp", "better_than_corners", "sigma_weights", "rate_weights",
           "deciding_order", "grouping_blend"]

#: Weights are rounded up to multiples of 1 / LEVELS (a power of two: the four products
#: of two such weights are exact in floating point and sum to exactly 1).
LEVELS = 64


class MixtureGroup(NamedTuple):
    """Steps accounted as mixtures of up to four ``anchors`` (``(sigma, q)`` pairs): row ``r``
    of ``weights`` (a probability vector over the anchors) holds ``counts[r]`` steps.
    ``corner`` ``(sigma, q, steps)``, the group's smallest sigma with its largest q, is
    one pair that dominates every row (to size the grid)."""

    anchors: tuple
    weights: np.ndarray
    counts: tuple
    corner: tuple


def sigma_weights(sigmas, sigma_lo: float, sigma_hi: float) -> np.ndarray:
    """Upper bounds on the lemma's weight ``w`` on ``sigma_lo`` (the module docstring) for
    steps at ``sigmas`` in ``[sigma_lo, sigma_hi]``; 1 inside where it cannot be computed
    to within a 1000th (the corner alone then dominates)."""
    sigmas = np.asarray(sigmas, dtype=float)
    inside = (sigmas > sigma_lo) & (sigmas < sigma_hi)
    out = np.where(sigmas <= sigma_lo, 1.0, 0.0)
    if not inside.any():
        return out
    # Phi(mu/2) differences as differences of upper tails, in logs: no cancellation near 1.
    far, near = float(log_ndtr(-0.5 / sigma_hi)), float(log_ndtr(-0.5 / sigma_lo))
    span = -math.expm1(near - far)
    # log_ndtr is accurate to a few units in the last place of its value; the ratio then
    # to about this much (generously).
    error = 1e-13 * (1.0 + abs(far)) / span if span > 0.0 else math.inf
    if error > 1e-3:
        out[inside] = 1.0
        return out
    mid = log_ndtr(-0.5 / sigmas[inside])
    out[inside] = np.minimum(1.0, -np.expm1(mid - far) / span + error)
    return out


def rate_weights(rates, q_lo: float, q_hi: float) -> np.ndarray:
    """Upper bounds on ``v = (q - q_lo) / (q_hi - q_lo)``, the weight on ``q_hi``."""
    rates = np.asarray(rates, dtype=float)
    if not q_hi > q_lo:
        return np.ones(rates.shape)
    v = (rates - q_lo) / (q_hi - q_lo) + 1e-14 * q_hi / (q_hi - q_lo)
    return np.where(rates >= q_hi, 1.0, np.where(rates <= q_lo, 0.0, np.minimum(v, 1.0)))


def mixture_group(members, levels: int = LEVELS, box: tuple | None = None) -> MixtureGroup:
    """The :class:`MixtureGroup` of ``members`` (``(sigma, q, count)``, distinct pairs), on
    the corners of ``box`` ``(sigma_lo, sigma_hi, q_lo, q_hi)`` (default: the members'
    ranges; a box must hold every member)."""
    sigmas, rates, counts = (np.array(column) for column in zip(*members))
    sigma_lo, sigma_hi, q_lo, q_hi = box or (sigmas.min(), sigmas.max(), rates.min(), rates.max())
    if not (sigma_lo <= sigmas.min() and sigmas.max() <= sigma_hi and q_lo <= rates.min() and rates.max() <= q_hi):
        raise ValueError("the box must hold every member")  # pragma: no cover - internal
    # Weights rounded up to multiples of 1 / levels, as integers: a row per distinct pair.
    v = np.ceil(rate_weights(rates, q_lo, q_hi) * levels).astype(np.int64)
    w = np.ceil(sigma_weights(sigmas, sigma_lo, sigma_hi) * levels).astype(np.int64)
    keys, where = np.unique(v * (levels + 1) + w, return_inverse=True)
    row_counts = np.bincount(where.ravel(), weights=counts).astype(np.int64)
    v, w = (keys // (levels + 1)) / levels, (keys % (levels + 1)) / levels
    weights = _corner_weights(v, w)
    anchors = _corners((sigma_lo, sigma_hi, q_lo, q_hi))
    # An anchor no row uses, or one equal to another (a group of one sigma or one q), goes.
    kept: dict[tuple[float, float], int] = {}
    columns = []
    for c, anchor in enumerate(anchors):
        if weights[:, c].any():
            if anchor not in kept:
                kept[anchor] = len(columns)
                columns.append(weights[:, c].copy())
            else:
                columns[kept[anchor]] += weights[:, c]
    merged = np.stack(columns, axis=1)
    merged.setflags(write=False)
    corner = (float(sigma_lo), float(q_hi), int(counts.sum()))
    return MixtureGroup(tuple((float(s), float(q)) for s, q in kept), merged, tuple(int(c) for c in row_counts), corner)


def mixture_groups(members: tuple, max_transforms: int, order: int | tuple = 2) -> tuple[MixtureGroup, ...]:
    """``members``, the groups :func:`~dpoptim.accounting.ledger.member_groups` forms (in
    order, each a tuple of ``(sigma, q, count)``), merged further into mixture groups of
    at most ``max_transforms`` distinct corners in all: as many groups as fit, a quarter
    of the limit at least (a group has four corners at most). Neighbouring groups merge
    by what the mixtures cost (:func:`_merge_order`) at the Renyi ``order`` that decides
    epsilon (:func:`deciding_order`; 2 by default). Neighbouring boxes are stretched to
    share a corner (:func:`_boxes`), so a chain of them needs about three corners per
    group: where sigma rises with q, a box's top corner is the next one's lowest; where
    sigma falls as q rises, a box's strong corner is the next one's weak corner."""
    groups = max(1, max_transforms // 4)
    merges = _merge_order(members, order, groups)
    merged = _merged(members, merges, groups)
    boxes = _boxes(merged)
    for _ in range(3):
        corners = len({corner for box in boxes for corner in _corners(box)})
        more = int((max_transforms - 1) * len(merged) / max(corners - 1, 1))
        if len(merged) < groups or more <= groups:
            break  # every group stays whole, or no more fit
        candidate = _merged(members, merges, more)
        candidate_boxes = _boxes(candidate)
        if len({corner for box in candidate_boxes for corner in _corners(box)}) > max_transforms:
            break
        groups, merged, boxes = more, candidate, candidate_boxes
    return tuple(mixture_group(m, box=box) for m, box in zip(merged, boxes))


def _corner_weights(v: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Per step, the weights of the four corners of :func:`_corners` (in its order), from
    ``v`` on ``q_hi`` and ``w`` on ``sigma_lo``."""
    return np.stack([v * w, (1 - v) * w, v * (1 - w), (1 - v) * (1 - w)], axis=1)


def _corners(box: tuple) -> tuple:
    sigma_lo, sigma_hi, q_lo, q_hi = box
    return (sigma_lo, q_hi), (sigma_lo, q_lo), (sigma_hi, q_hi), (sigma_hi, q_lo)


def _boxes(merged: list) -> list[tuple]:
    """Each group's box ``(sigma_lo, sigma_hi, q_lo, q_hi)``: its members' ranges, the top
    stretched to the next group's lowest corner where that lies above and right of it;
    else, where the next box lies above and left of it (sigma falling as q rises), the
    next box's weak corner (largest sigma, smallest q) stretched onto this box's strong
    corner (smallest sigma, largest q). Groups come ordered by q, then sigma. Any box that
    holds its members is sound; sharing a corner saves a transform. 120 runs of 100
    steps, q rising from 0.005 by 0.6% a run while sigma falls from 1.6 by 0.005, delta
    1e-5: 21 groups on 64 corners instead of 16; 3,000 pairs of 10 steps, sigma 2 to 0.7
    while q rises from 1e-3 to 1e-2, delta 1e-8: epsilon 9.3300 to 9.3156 (512
    transforms: 9.2965)."""
    boxes = [(min(m[0] for m in group), max(m[0] for m in group), min(m[1] for m in group),
              max(m[1] for m in group)) for group in merged]
    for g in range(len(boxes) - 1):
        sigma_lo, sigma_hi, q_lo, q_hi = boxes[g]
        next_sigma, next_q = boxes[g + 1][0], boxes[g + 1][2]
        if next_sigma >= sigma_hi and next_q >= q_hi and (next_sigma, next_q) != (sigma_hi, q_hi):
            boxes[g] = (sigma_lo, next_sigma, q_lo, next_q)
        elif boxes[g + 1][1] <= sigma_lo and next_q >= q_hi and (boxes[g + 1][1], next_q) != (sigma_lo, q_hi):
            boxes[g + 1] = (next_sigma, sigma_lo, q_hi, boxes[g + 1][3])
    return boxes


def _merged(members: tuple, merges: tuple, groups: int) -> list:
    """Consecutive ``members`` joined into at most ``groups`` by the first of ``merges``
    (:func:`_merge_order`; ``groups`` no fewer than it was run down to)."""
    out = list(members)
    for first in merges[:max(0, len(members) - groups)]:
        out[first:first + 2] = [out[first] + out[first + 1]]
    return out


@functools.lru_cache(maxsize=16)
def _merge_order(members: tuple, order: int | tuple, fewest: int) -> tuple:
    """Which neighbouring groups of ``members`` merge, in turn, down to ``fewest`` groups:
    the index of the first of the two at each merge (in the groups left by the merges
    before). Greedy: each time the merge that adds least to the mixtures' summed RDP at
    ``order`` (:func:`_mixture_cost`). Any partition is sound (each group's mixture
    dominates its steps); this one only decides how tight.

    The grouping's own proxy (order 2, accounting each group at a corner) spread the
    mixture groups evenly along a schedule, and where rare losses decide, one group
    can cost far more than all the others: 1000 pairs from sigma 0.7 at q 1e-4 to
    sigma 1.2 at q 1e-3, 20 steps each, delta 1e-9, had 2.6 times its steps' RDP at
    order 9 in the group of sigma 0.7 to 0.737 and 0.1% to 3% in the other twenty
    (epsilon 0.5359; grouped and merged at order 9, 0.5225)."""
    groups = [np.array(group, dtype=float) for group in members]
    for group in groups:  # counts rounded to quarter octaves (see _mixture_cost)
        group[:, 2] = np.exp2(np.round(4.0 * np.log2(group[:, 2])) / 4.0)
    costs = [_mixture_cost(group, order) for group in groups]
    added = [_mixture_cost(np.concatenate(pair), order) - costs[i] - costs[i + 1]
             for i, pair in enumerate(zip(groups, groups[1:]))]
    merges = []
    while len(groups) > fewest:
        first = int(np.argmin(added))
        merges.append(first)
        groups[first:first + 2] = [np.concatenate(groups[first:first + 2])]
        costs[first:first + 2] = [costs[first] + costs[first + 1] + added[first]]
        del added[first]
        for i in (first - 1, first):
            if 0 <= i < len(added):
                added[i] = _mixture_cost(np.concatenate(groups[i:i + 2]), order) - costs[i] - costs[i + 1]
    return tuple(merges)


def _mixture_cost(group: np.ndarray, order: int | tuple) -> float:
    """The RDP at ``order`` of the steps of ``group`` (rows ``(sigma, q, count)``, counts
    rounded to quarter octaves so that a ledger grown by a step keeps its groups) as
    mixtures of the corners of the group's box (unrounded weights: only a guide); of a
    blend ``((order, weight), ...)``, the weighted sum of each order's RDP times
    ``order - 1`` (on the scale of :func:`~dpoptim.accounting.ledger._step_costs`)."""
    sigmas, rates, counts = group[:, 0], group[:, 1], group[:, 2]
    box = (sigmas.min(), sigmas.max(), rates.min(), rates.max())
    v, w = rate_weights(rates, box[2], box[3]), sigma_weights(sigmas, box[0], box[1])
    anchors = np.array(_corners(box))
    with np.errstate(divide="ignore"):
        log_weights = np.log(_corner_weights(v, w))
    total = 0.0
    for part, scale in order if isinstance(order, tuple) else ((order, 1.0 / (order - 1)),):
        terms = log_weights + _step_costs(anchors[:, 0], anchors[:, 1], part)
        peak = terms.max(axis=1)
        total += scale * float(counts @ (peak + np.log(np.exp(terms - peak[:, None]).sum(axis=1))))
    return total


#: Integer orders :func:`deciding_order` chooses from.
DECIDING_ORDERS = np.unique(np.round(np.geomspace(2, 256, 24)))


def deciding_order(members: tuple, delta: float) -> int:
    """The order of :data:`DECIDING_ORDERS` whose epsilon (Canonne, Kamath & Steinke 2020,
    Prop. 12) is the smallest for ``members`` (groups of ``(sigma, q, count)``) each
    accounted at its corner (smallest sigma, largest q): the order at which the grouping
    weighs what it costs (:func:`mixture_groups`,
    :func:`~dpoptim.accounting.ledger.coarsen_runs`)."""
    return int(DECIDING_ORDERS[np.argmin(_corners_epsilons(members, delta))])


def _corners_epsilons(members: tuple, delta: float) -> np.ndarray:
    """The RDP epsilon at each of :data:`DECIDING_ORDERS` of ``members``' corners."""
    corners = np.array([(min(m[0] for m in group), max(m[1] for m in group), sum(m[2] for m in group))
                        for group in members], dtype=float)
    curve = np.array([corners[:, 2] @ _step_costs(corners[:, 0], corners[:, 1], int(order)) / (order - 1)
                      for order in DECIDING_ORDERS])
    return curve + conversion_terms(DECIDING_ORDERS, delta)


#: :func:`grouping_blend` blends orders only for ledgers with some q at most this ...
BLENDED_RATE = 1e-3

#: ... and takes each order whose corners' epsilon is within this share of the best,
#: weighed the more the closer it is.
BLENDED_SPREAD = 0.2


def grouping_blend(runs: tuple, members: tuple, delta: float) -> int | tuple:
    """What groups the pairs of ``runs`` (``(sigma, q, count)``, every pair of the ledger):
    where some q is at most :data:`BLENDED_RATE` and the corners of ``members`` are
    best bounded at an order above 2, a blend ``((2, 1), (order, weight), ...)`` of the
    order-2 proxy and the orders that decide epsilon (:func:`deciding_order`, at
    ``delta``), each weighed by the inverse of the ledger's whole cost at its order,
    times a share that falls linearly from the best order's to 0 where its corners'
    epsilon is :data:`BLENDED_SPREAD` above the best (the shares sum to 1; weights
    rounded to quarter octaves, so that a ledger grown by a step keeps its groups). A
    merge then costs its share of the ledger's cost at order 2 plus its share at the
    deciding orders. Else the deciding order alone.

    The deciding order alone keeps fine the steps that decide the corners' RDP bound,
    where rare large losses decide; but the PLD's epsilon also follows the body, which
    order 2 weighs (the variance of the loss), and a schedule whose two ends weigh
    differently at the two orders lost the other end: 2,000 one-step pairs from sigma
    1.2 at q 1e-4 to sigma 0.6 at q 1e-5, delta 1e-5, 0.0071660 grouped at order 9 (the
    deciding order), 0.0066165 at order 2, 0.0066839 blended. Where the deciding order
    moved (7 to 9 as every sigma of that ledger shrank by 0.2%) epsilon jumped by 10%
    against the trend with it, by 0.16% blended. Not every ledger gains: 6,536 pairs of
    4 steps, delta 3.1e-10, 0.8662 at order 7 and 0.8830 blended, within that ledger's
    own jitter of about 2% as its sigmas move by 0.1%; over 60 random ledgers epsilon
    moved by -0.21% to +0.59% (docs/accounting.md). Above BLENDED_RATE no step's loss
    is rare and the orders agree (10^4 one-step pairs at q 0.01: 5.6037 at orders 2 to
    5), while the blend costs 15 to 20 ms more grouping on 10^4 pairs."""
    epsilons = _corners_epsilons(members, delta)
    order = int(DECIDING_ORDERS[np.argmin(epsilons)])
    if order == 2 or min(run[1] for run in runs) > BLENDED_RATE or not 0.0 < epsilons.min() < math.inf:
        return order
    pairs = np.array([run[:3] for run in runs], dtype=float)
    shares = np.clip(1.0 - (epsilons / epsilons.min() - 1.0) / BLENDED_SPREAD, 0.0, 1.0)
    shares /= shares.sum()
    whole = pairs[:, 2] @ _step_costs(pairs[:, 0], pairs[:, 1], 2)
    parts = {2: _nearest_quarter_octave(1.0 + float(shares[0]))}  # (DECIDING_ORDERS starts at 2)
    for part, share in zip(DECIDING_ORDERS[1:].astype(int), shares[1:]):
        if share > 0.0:
            with np.errstate(divide="ignore", invalid="ignore"):
                weight = share * whole / (pairs[:, 2] @ _step_costs(pairs[:, 0], pairs[:, 1], int(part)))
            if not 0.0 < weight < math.inf:
                return order
            parts[int(part)] = _nearest_quarter_octave(weight)
    return tuple(parts.items())


def mixture_rdp(groups: tuple, orders: np.ndarray, curve) -> np.ndarray:
    r"""The RDP curve at ``orders`` (above 1) of every step of ``groups`` composed, with
    ``curve(sigma, q)`` giving each anchor's. A step is a revealed-coin mixture, and the
    coin is part of what it releases, so its :math:`e^{(\alpha - 1) D_\alpha}` is the
    weighted mean of its anchors' (Mironov 2017, Renyi differential privacy: RDP
    composes by adding). :mod:`.pld` uses it to predict what fewer groups cost, and
    :func:`better_than_corners` at order 2."""
    orders = np.asarray(orders, dtype=float)
    total = np.zeros(orders.size)
    for group in groups:
        scaled = np.array([curve(sigma, q) for sigma, q in group.anchors]) * (orders - 1.0)
        with np.errstate(divide="ignore"):
            terms = np.log(group.weights)[:, :, None] + scaled[None, :, :]  # rows x anchors x orders
        peak = terms.max(axis=1)
        rows = peak + np.log(np.exp(terms - peak[:, None, :]).sum(axis=1))
        total += np.array(group.counts, dtype=float) @ rows / (orders - 1.0)
    return total


def better_than_corners(groups: tuple, corners: list) -> bool:
    """Whether ``groups`` cost less than ``corners`` (each of its own group's steps at its
    smallest sigma and largest q), by the grouping's default proxy: the order-2 Renyi
    divergence per step (a revealed-coin mixture's is ``log sum_c w_c e^{D_c}``). The
    corners win where the pairs beyond the limit are negligible steps merged for free,
    and on scattered ledgers, whose few mixture groups span wide ranges. (At the order
    that forms the groups, the corners won where the mixtures were tighter: 186 pairs of
    349 steps at q 6.7e-4 to 3.6e-4, delta 1.5e-5, 0.2706 against 0.2681 at order 13.)"""
    corners = np.array(corners, dtype=float)
    corner_cost = float(corners[:, 2] @ _step_costs(corners[:, 0], corners[:, 1]))
    order_two = mixture_rdp(groups, np.array([2.0]), lambda sigma, q: _step_costs(np.array([sigma]), np.array([q])))
    return float(order_two[0]) < corner_cost
