r"""The split's bulk on two scales: the body of a long run composed in blocks on a fine grid.

**Why.** At tiny ``q`` over many steps (``q T`` in the tens to thousands) the split of
:mod:`.rare` composes a bulk whose steps have a body a few ``q`` wide, a spike near 0,
and losses out to the cut. Connect-the-dots (Doroshenko, Ghazi, Kamath, Kumar &
Manurangsi 2022) spreads each step's loss over a bin, adding about :math:`h\,
\mathbb E|L|` to the composed variance per step, so the bins must be tiny (2^-23 at
sigma 0.661, q 1e-6, 10^8 steps), while the window the deep Chernoff bounds ask for is
not (0.5 there): 2^21 points a transform. Composed in blocks of ``B`` steps first, the
spike is moved onto a coarse grid once per block, whose loss varies by about
:math:`\sqrt B` steps' worth instead of ``B`` steps' sum of absolute losses, so the coarse
bins may be many times wider (16 to 32 times where measured). But a block of the whole step has the same wide
window (a sampled step's loss reaches the cut), so only the body is blocked: its rare
large losses are composed on the coarse grid, where their spread is small.

**The bound.** Cut each step's bulk ``b`` into its body ``S`` (losses from ``a`` to
``A``, on the fine grid, P-mass ``s``) and the rest ``W`` (on the coarse grid), and let
:math:`\tilde S = S / s`. The profile :math:`\delta_X(x) = \sum_k X_k (1 - e^{x -
l_k})_+` of any measure ``X`` is convex in :math:`u = e^x`, so by Jensen, for
:math:`e^{-f} = \sum_j \tilde S_j e^{-l_j}`,

.. math::
    \delta_{X * \tilde S}(y) = \sum_j \tilde S_j\, \delta_X(y - l_j) \ge \delta_X(y - f),

and :math:`\delta_X(x) \le \delta_{X * \tilde S}(x + f') ` for any :math:`f' \le f`
(profiles never rise with their argument). In :math:`b^{*c} = \sum_k \binom{c}{k}
s^{c-k} \tilde S^{*(c-k)} * W^{*k}` each term is then at most the profile of
:math:`\tilde S^{*c} * \binom{c}{k} s^{c-k} W^{*k}` with each of its ``k`` steps of ``W``
moved up by :math:`|f'|`, :math:`f' = \min(f, 0)` less a margin: summed,

.. math::
    \delta_{b^{*c}} \le \delta_{\tilde S^{*c} * V^{*c}}, \qquad V = s\,\delta_0 + W_{\uparrow},

with :math:`W_\uparrow` each loss of ``W`` moved up by :math:`|f'|` and split between the
coarse points around it by connect-the-dots (a mean-preserving spread of :math:`e^{-L}`,
which only raises a profile). This gives up only the spread of as many extra steps of
the body as there are steps of ``W`` (about 16 of ``c``) and the shift of those by
:math:`|f'|` (the log of the body's Q-mass over its P-mass: 7e-11 at sigma 0.661, q
1e-6). For ``c - 1`` steps (the profile the split's tails read), the same bound holds
with the whole product moved up by :math:`|f'|` once more.
:math:`\tilde S^{*c}` is composed in blocks by :mod:`.staged` (``B`` steps on the fine
grid in extended precision, the transform's error bound added to every entry, the mass
beyond each block's window sent to :math:`+\infty`, moved onto the coarse grid by
connect-the-dots): each of those moves only raises every profile (see :mod:`.staged`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import pld as _pld
from . import staged as _staged

#: Runs shorter than this keep one grid for their bulk.
MIN_STEPS = 2**16

#: The body ends where this many of a run's steps are expected beyond it, either side.
_OUTSIDE = 8.0

#: Share of the fine grid's spread (variance and mean shift) the coarse grid may add.
_COARSE_SHARE = 0.25

#: The most fine points of the body itself, and of a block's window.
_MAX_BODY = 2**16
_MAX_FINE = 2**18

#: Blocks are used only where they need at most this share of one grid's points.
_WORTH = 0.25

#: The blocks' error bounds may raise their composed total by at most this share.
_EXCESS = 2.0**-12


class Plan(NamedTuple):
    """Fine spacing ``h``, coarse ``spacing = R h``, the body's ends as coarse indices
    ``(a, A)``, blocks of ``length`` steps, and the tilt of the fine transforms."""

    h: float
    spacing: float
    body: tuple
    length: int
    tilt: float


class Bulk(NamedTuple):
    """A run's bulk on the coarse grid: ``factors`` (``(first, masses, count)``) whose
    product's profile bounds that of every step's bulk, ``fewer`` the same for one step
    fewer, and ``infinite`` a bound on the mass the blocks send to :math:`+\\infty` in
    either product."""

    factors: list
    fewer: list
    infinite: float


def plan(run: tuple, direction: str, h: float, ends: tuple, scale: float, allowance: float,
         delta: float) -> Plan | None:
    """The two scales for one run's bulk on losses ``ends = (low, high)``, its fine bins
    ``h`` and ``allowance`` (the composed variance connect-the-dots may add); None where
    one grid is as cheap (:data:`_WORTH`) or a block does not fit."""
    sigma, q, count = run
    if count < MIN_STEPS:
        return None
    low, high = ends
    a, b = _body(sigma, q, direction, count, low, high)
    if not (a <= 0.0 <= b) or (b - a) / h > _MAX_BODY:
        return None
    lambdas = _staged._LAMBDAS
    whole = count * _pld._loss_log_mgf(sigma, q, direction, low, high, lambdas)
    width = _chernoff_width(whole, lambdas, _pld._TAIL_FRACTION * delta)
    tilt = _staged._chernoff_tilt(whole / count, count, scale)
    first, body = _body_masses(sigma, q, direction, h, a, b)
    if body is None:
        return None
    losses = (first + np.arange(body.size)) * h
    variance = float(body @ (losses - float(body @ losses)) ** 2)
    outside = (_pld._mean_absolute_loss(sigma, q, direction, b, high)
               + _pld._mean_absolute_loss(sigma, q, direction, low, a))
    # the coarse grid adds a share of what the fine one spreads (and of its mean shift, T h^2 / 8)
    spread = _COARSE_SHARE * min(allowance, h * count * _pld._mean_absolute_loss(sigma, q, direction, low, high))
    mean_shift = _COARSE_SHARE * max(count * h * h / 8.0, 1e-3 * scale)
    body_mgf = _pld._log_mgf(first, body, h, lambdas)
    best, best_cost = None, _WORTH * _cost(width / h)
    for length in (4**k for k in range(5, 16)):
        if 4 * length > count:
            break
        spacing = _coarse_spacing(h, count, length, variance, outside, (spread, mean_shift))
        block = _chernoff_width(length * body_mgf, lambdas, _staged._WINDOW_SHARE * delta * length / count)
        if spacing is None or block / h > _MAX_FINE:
            continue
        cost = _cost(block / h) / 3.0 + _cost(width / spacing)  # (the coarse grid is composed about thrice)
        if cost < best_cost:
            best, best_cost = Plan(h, spacing, (math.floor(a / spacing), math.ceil(b / spacing)), length, tilt), cost
    return best


def _cost(points: float) -> float:
    """About the work of a transform holding ``points``."""
    n = 2.0 ** max(10, math.ceil(math.log2(max(points, 2.0))))
    return n * math.log2(n)


def _chernoff_width(log_mgf: np.ndarray, lambdas: np.ndarray, budget: float) -> float:
    """The width of the window beyond which each side holds at most ``budget`` (Chernoff)."""
    up, down = lambdas > 0, lambdas < 0
    top = float(np.min((log_mgf[up] - math.log(budget)) / lambdas[up]))
    bottom = float(np.max((log_mgf[down] - math.log(budget)) / lambdas[down]))
    return max(top - bottom, 0.0)


def _body(sigma: float, q: float, direction: str, count: int, low: float, high: float) -> tuple[float, float]:
    """``(a, A)``: the losses beyond which about :data:`_OUTSIDE` of ``count`` steps lie,
    each side (within ``low .. high``)."""
    def beyond(x: float, side: int) -> float:
        return count * math.exp(float(_pld._bin_log_masses(sigma, q, direction, np.array([x]))[3][side]))

    a = _pld._bisected(lambda x: beyond(x, 0) <= _OUTSIDE, low, 0.0, 40) if beyond(low, 0) <= _OUTSIDE else low
    b = _pld._bisected(lambda x: beyond(x, 1) <= _OUTSIDE, high, 0.0, 40) if beyond(high, 1) <= _OUTSIDE else high
    return a, b


def _body_masses(sigma: float, q: float, direction: str, h: float, a: float, b: float) -> tuple:
    """``(first, masses)`` of a step's body on the fine grid between ``a`` and ``b``,
    normalised (a guide to its spread; the bulk's own are :func:`bulk`'s)."""
    first, last = math.floor(a / h), math.ceil(b / h)
    if last - first > _MAX_BODY:
        return first, None
    masses, _ = _pld._dots(sigma, q, direction, np.arange(first, last + 1) * h)
    masses = masses[1:-1]  # (the end points also hold what lies beyond them)
    total = float(masses.sum())
    return first + 1, (masses / total if total > 0 else None)


def _coarse_spacing(h: float, count: int, length: int, variance: float, outside: float,
                    allowance: tuple) -> float | None:
    """The widest power-of-two multiple of ``h`` whose connect-the-dots spreads the blocks
    (each about :math:`\\sqrt{B \\mathrm{Var}}` wide) and the steps beyond the body by at
    most ``allowance[0]`` in variance, and moves the mean of the blocks' losses by at most
    ``allowance[1]`` (``H^2 / 8`` a block); None where not even ``2 h`` does."""
    width = math.sqrt(length * variance)
    spread, shift = allowance
    spacing = None
    for k in range(1, 40):
        H = h * 2.0**k
        blocks = count / length
        if blocks * H * (width + H / 2.0) + count * H * outside > spread or blocks * H * H / 8.0 > shift:
            break
        spacing = H
    return spacing


def bulk(plan: Plan, run: tuple, direction: str, grid: tuple, step: float, delta: float) -> Bulk | None:
    """The run's bulk (module docstring) on the coarse grid between indices ``grid =
    (low, high, below, above)``, where its tails go on ``step`` below (``below``) and
    above (``above``), as in :func:`~dpoptim.accounting.rare._bulks`: one connect-the-dots
    on the fine points of the body and the coarse points beyond it; None where the blocks
    do not fit or their error bounds would raise delta by more than :data:`_EXCESS`."""
    sigma, q, count = run
    low, high, below, above = grid
    h, H = plan.h, plan.spacing
    ratio = round(H / h)
    a, b = max(plan.body[0], low), min(plan.body[1], high)
    if not a < b or plan.tilt * H >= 16.0:  # (a coarse bin of a steep tilt would overflow its re-tilting)
        return None
    fine = np.arange(a * ratio, b * ratio + 1) * h
    points = np.concatenate([[low * H - step] if below else [], np.arange(low, a) * H, fine,
                             np.arange(b + 1, high + 1) * H, [high * H + step] if above else []])
    masses, _ = _pld._dots(sigma, q, direction, points, closed=above)  # (as the split's own bulks)
    masses = masses[int(below): masses.size - int(above)]
    under, body, over = masses[: a - low], masses[a - low: a - low + fine.size], masses[a - low + fine.size:]
    s = math.fsum(body)
    if not s > 0.0:
        return None
    shape = body / s * (1.0 + 4.0 * _pld._U)  # at least the normalised body, entry by entry
    with np.errstate(under="ignore"):
        f = -math.log(math.fsum(body * np.exp(-fine)) / s)
    bins, moved = _moved(max(-f, 0.0) + 1e-9 * (1.0 + abs(f)), H)  # |f'|, on the coarse grid
    lowest = min(0, low + bins)
    v = np.zeros(max(0, high + bins + 1) - lowest + 1)
    for start, part in ((low, under), (b + 1, over)):
        at = np.arange(start, start + part.size) + bins - lowest
        v[at] += part * moved[0]
        v[at + 1] += part * moved[1]
    v[-lowest] += s * (1.0 + 2.0 * _pld._U)
    blocks = _blocks(plan, (a * ratio, shape), count, delta)
    if blocks is None:
        return None
    factors, infinite = blocks
    return Bulk(factors + [(lowest, v, count)], factors + [(lowest, v, count - 1), (bins, moved, 1)], infinite)


def _moved(shift: float, spacing: float) -> tuple[int, np.ndarray]:
    """``(k, [1 - r, r])``: a unit mass at loss ``shift`` split by connect-the-dots between
    the grid points ``k`` and ``k + 1`` below and above it, the share ``r`` sent up
    rounded up (mass moved to a higher loss only raises a profile)."""
    k = math.floor(shift / spacing)
    rest = shift - k * spacing
    up = min(1.0, -math.expm1(-rest) / -math.expm1(-spacing) * (1.0 + 8.0 * _pld._U) + 1e-15)
    return k, np.array([1.0 - up, up])


def _blocks(plan: Plan, body: tuple, count: int, delta: float) -> tuple | None:
    r"""``(factors, infinite)``: :math:`\tilde S^{*c}` as blocks of ``plan.length`` steps and
    one of the rest, composed on the fine grid by :mod:`.staged` (``body``: ``(first,
    masses)`` of :math:`\tilde S`) and untilted on the coarse one, each entry capped at 1
    (no P-mass exceeds it); and a bound on their product's mass at :math:`+\infty`. None
    where a block does not fit, or the error bounds raise the blocks' total by more than
    :data:`_EXCESS`."""
    h, H, tilt = plan.h, plan.spacing, plan.tilt
    first, shape = body
    K, rest = divmod(count, plan.length)
    lengths, times = [plan.length] + ([rest] if rest else []), [K] + ([1] if rest else [])
    log_mgf = _pld._log_mgf(first, shape, h, _staged._LAMBDAS)
    made = _staged._blocks((first, shape, 0.0), log_mgf, _staged._Plan(h, round(H / h), tilt), lengths,
                           _staged._WINDOW_SHARE * delta / (K + 1), K + 1)
    if made is None:
        return None
    factors, excess, spread, at_infinity = [], 0.0, 0.0, 0.0
    for block, n in zip(made, times):
        losses = (block.first + np.arange(block.masses.size)) * H
        with np.errstate(divide="ignore", under="ignore"):
            log_m = np.log(block.masses) + block.log_scale - tilt * losses
            untilted = np.minimum(np.exp(np.minimum(log_m, 0.0)) * (1.0 + 1e-12), 1.0)
        total = math.fsum(untilted) * (1.0 + untilted.size * _pld._U)
        excess += n * max(0.0, math.log(total))
        spread += n * max(0.0, math.log(total + block.p_inf))
        at_infinity += n * block.p_inf
        factors.append((block.first, untilted, n))
    if excess > _EXCESS:
        return None
    # prod (F + p) - prod F <= sum p prod max(1, F + p), the body's other factor's total at most 1
    return factors, at_infinity * math.exp(min(spread, 700.0)) * (1.0 + 1e-6)
