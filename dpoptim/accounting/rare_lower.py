r"""Rigorous lower bounds on the epsilon of rare large losses, for tests and benchmarks:
the mirror of the split of :mod:`.rare`.

Both cut each step's outcomes at the loss ``a`` of :mod:`.rare` (the terms with two tail
steps or more hold at most ``delta / 1024`` of mass, and dropping them, as every bound
here does, only lowers the profile
:math:`\delta(\varepsilon) = \mathbb E_P[(1 - e^{\varepsilon - L})_+]`, a positive linear
functional of the composed P-measure). Each tail outcome above ``a`` is binned by its
loss and placed at its bin's lowest loss: rounding a loss down lowers every composed
profile, pointwise in each step's loss.

**The bulk merged** (:func:`split_lower_bound`). Merging every outcome whose loss is at
most ``a`` into one outcome is a post-processing, so the merged pair's profile is at most
the true one (data processing). Its bulk is then a point mass at the exact merged loss
:math:`\log(P(L \le a) / Q(L \le a))`, and the two kept terms need no transform at all:
a point mass, and one step's tail shifted by the other steps' merged losses. What the
merge gives up is the bulk's spread: small for a few steps, but at tiny q over 10^8
steps the bulk's composed spread moves epsilon by several percent.

**The bulk kept** (:func:`spread_lower_bound`). The bulk's bins are instead merged onto a
fine grid by the post-processing of :func:`~dpoptim.accounting.pld._dominated_masses`
(consecutive bins, and a share of the next, merged into outcomes whose losses are the
grid values: the dominated counterpart of connect-the-dots, Doroshenko et al. 2022,
which loses only the loss variance within about a bin). The bulks are composed by one
transform on a window as :mod:`.rare` composes them, and the profile is read *less*
the transform's rounding allowance, the sums' rounding and Chernoff bounds on the mass
that wraps in from below the window and from above it (landing at lower losses, but
untilted too heavy by the tilt's factor across the window); entries the tilt leaves
uncertifiable count as 0. The term with one tail step is :math:`\sum_r c_r \sum_j
t_{r,j} D_r(\varepsilon - l_{r,j})` with :math:`D_r` so bounded for the bulks without
one step of run ``r``. Mass below the bulk's floor (a lower tail) is dropped.
"""

from __future__ import annotations

import math

import numpy as np

from . import pld as _pld
from . import rare

#: Bins of a tail's loss per unit of the lower bound's scale (finer bins lose less).
_LOWER_BINS = 2**12

#: The largest window of :func:`spread_lower_bound`'s bulk.
_MAX_POINTS = 2**21


def split_lower_bound(steps: tuple, direction: str, delta: float, scale: float) -> float:
    """A rigorous lower bound on the epsilon of one direction of ``steps`` at ``delta``:
    the bulk merged into one outcome, the terms with one tail step or none (0.0 where it
    finds none). ``scale``: a lower estimate of epsilon, which sizes the tail's bins."""
    if not (0.0 < scale < math.inf) or not steps:
        return 0.0
    a = rare._cuts(tuple(steps), direction, delta)[1]  # dropping the terms beyond loses at most delta / 1024
    merged = [_merged_step(sigma, q, direction, a) for sigma, q, _ in steps]
    counts = [count for _, _, count in steps]
    shift = math.fsum(c * loss for c, (loss, _) in zip(counts, merged))
    shift -= 1e-12 * math.fsum(c * abs(loss) for c, (loss, _) in zip(counts, merged)) + 1e-300
    log_all = math.fsum(c * log_mass for c, (_, log_mass) in zip(counts, merged)) * (1.0 + 1e-12)
    losses, masses = [np.array([shift])], [np.array([math.exp(log_all)])]
    for (sigma, q, count), (loss, log_mass) in zip(steps, merged):
        edges, tail = _tail_bins(sigma, q, direction, a, scale + abs(shift), scale)
        losses.append(shift - loss - 1e-12 * abs(loss) + edges)
        masses.append(tail * math.exp(math.log(count) + log_all - log_mass) * (1.0 - 1e-12))
    losses, masses = np.concatenate(losses), np.concatenate(masses)
    order = np.argsort(losses)
    return _lower_epsilon(losses[order], masses[order], delta)


def _merged_step(sigma: float, q: float, direction: str, a: float) -> tuple[float, float]:
    """``(loss, log_mass)`` of one step's outcomes with loss at most ``a`` merged into one:
    its loss :math:`\\log(P(L \\le a) / Q(L \\le a))`, rounded down by the masses' error
    bounds, and the log of its P-mass, rounded down."""
    losses = np.array([a])
    edges, log_n0, log_n1, log_p, log_qq = _pld._bin_log_masses(sigma, q, direction, losses)
    error = float(_pld._bin_errors(sigma, q, direction, edges, log_n0, log_n1, log_p, log_qq)[0])
    log_p0, log_q0 = float(log_p[0]), float(log_qq[0])
    loss = log_p0 - log_q0 - 2.5 * error - 4.0 * _pld._U * (abs(log_p0) + abs(log_q0))
    return loss, log_p0 + math.log1p(-min(error, 0.5))


def _tail_bins(sigma: float, q: float, direction: str, a: float, reach: float, scale: float):
    """``(losses, masses)``: one step's P-mass above ``a`` in bins of its loss, each placed
    at its lowest loss (rounding a loss down lowers every profile) and rounded down by
    its error bound. Bins are ``scale / 4096`` wide up to ``a + reach + 2 scale``, then
    geometric: a bin ``g`` wide at ``d`` above epsilon loses at most ``g e^{-d}`` of
    its mass's share there. No mass above ``a`` where the step's losses all lie at or below
    it (addition at tiny q: at most ``-log(1 - q)``): a bin from ``a`` down to them held
    the whole bulk again, and a lower bound counted it twice (0.520 against an exact
    epsilon below 0.335, sigma 0.055 at q 3e-5 beside two other runs)."""
    top = float(_pld._loss_of_z(1.0 + _pld._GAUSS_TAIL * sigma, sigma, q, direction))
    if not top > a:
        return np.array([a]), np.zeros(1)
    width = scale / _LOWER_BINS
    fine_end = min(a + reach + 2.0 * scale, top)
    count = min(int(math.ceil((fine_end - a) / width)) + 1, 2**16)
    edges = a + (fine_end - a) * np.linspace(0.0, 1.0, max(count, 2))
    if top > fine_end:
        edges = np.concatenate([edges, fine_end + width * np.geomspace(1.0, (top - fine_end) / width + 1.0, 512)[1:]])
    bins = _pld._bin_log_masses(sigma, q, direction, edges)
    errors = _pld._bin_errors(sigma, q, direction, *bins)[1:]
    with np.errstate(under="ignore"):
        masses = np.where(errors < 0.1, np.exp(bins[3][1:]) * (1.0 - np.minimum(errors, 1.0)), 0.0)
    return edges, masses


def _lower_epsilon(losses: np.ndarray, masses: np.ndarray, delta: float) -> float:
    r"""The largest epsilon >= 0 (to a relative 1e-9) at which the profile of point masses
    ``masses`` at increasing ``losses``, less a bound on its rounding, is above ``delta``
    (0.0 where none is): a lower bound on the epsilon of any profile above it.

    The discounted sums :math:`\sum_{j \ge i} m_j e^{-l_j}` are kept as logarithms: losses
    often span more than the 745 that a float64 factor :math:`e^{-l}` can (a bulk near 0
    beside tail steps at 1479, sigma 0.02), and a discount that underflowed to 0 would
    raise the profile. Their rounding is a few round-offs per term of the logarithms'
    sizes, which the allowance covers."""
    above = np.concatenate([np.cumsum(masses[::-1])[::-1], [0.0]])
    with np.errstate(divide="ignore"):
        log_terms = np.log(masses) - losses
    log_discounted = np.concatenate([np.logaddexp.accumulate(log_terms[::-1])[::-1], [-np.inf]])
    reach = float(np.abs(log_terms[np.isfinite(log_terms)]).max(initial=0.0))

    def exceeds(epsilon: float) -> bool:  # the profile, less a bound on its rounding, above delta
        i = int(np.searchsorted(losses, epsilon, side="right"))  # entries with loss > epsilon
        if i >= losses.size:
            return False
        subtract = math.exp(epsilon + log_discounted[i]) if log_discounted[i] > -math.inf else 0.0
        error = 4.0 * (losses.size + 4) * _pld._U * (float(above[i]) + subtract * (2.0 + abs(epsilon) + reach))
        return float(above[i]) - subtract - error > delta

    if not exceeds(0.0):
        return 0.0
    high = max(float(losses[-1]), 0.0)
    if exceeds(high):
        return high
    return _pld._bisected(exceeds, 0.0, high, 2000, relative=1e-9)


def spread_lower_bound(steps: tuple, direction: str, delta: float, guess: float, points: int = _MAX_POINTS) -> float:
    """A rigorous lower bound on the epsilon of one direction of ``steps`` at ``delta``,
    the bulk kept on a fine grid (see the module docstring); 0.0 where no window fits.
    ``guess``: an estimate of epsilon (the reported one), which sizes the bins as the
    split of :mod:`.rare` sizes its own for it; the finest bulk whose window fits in
    ``points`` points is taken."""
    if not (1e-100 < guess < math.inf) or not steps:
        return 0.0
    steps = tuple(steps)
    scale = 2.0 ** math.floor(math.log2(guess))
    floor, cut, bottom, reach = rare.split_ends(steps, direction, delta, scale)
    ends = (bottom if floor is None else floor, reach if cut is None else cut)
    total = sum(count for _, _, count in steps)
    if cut is None:
        # Without a tail, a step's loss below f = e - (T - 1) * top, at an epsilon e of
        # about the guess, leaves the composed loss at most e: dropping it changes no
        # profile above e, and spends the grid where epsilon is (a few steps of addition,
        # whose epsilon lies just below the top of its loss).
        ends = (max(ends[0], guess * (1.0 - 2.0**-6) - (total - 1) * max(ends[1], 0.0)), ends[1])
        if not ends[0] < ends[1]:
            return 0.0  # every composed loss lies below the guess: no bound near it here
    h = rare._bulk_spacing(steps, direction, rare.finest_spacing(scale, total), scale, *ends)
    found = None
    while found is None and h <= scale / 64.0:
        found = _spread_on(steps, direction, delta, h, ends, cut is not None, guess, points)
        h *= 2.0  # a window too wide: a coarser bulk
    if found is None:
        return 0.0
    h /= 2.0  # the spacing that fitted
    best, size = found
    # Merging onto the grid, unlike splitting, loses a step's loss variance within a bin,
    # and the mean with it where one bin holds a step's whole bulk (q 1e-6: losses within
    # 2e-6): a finer grid is tried while the window still fits, and the best bound kept.
    while 2 * size <= points:
        h /= 2.0
        found = _spread_on(steps, direction, delta, h, ends, cut is not None, guess, points)
        if found is None:
            break
        best, size = max(best, found[0]), found[1]
    return best


def _spread_on(steps: tuple, direction: str, delta: float, h: float, ends: tuple, tails: bool, guess: float,
               points: int) -> float | None:
    """``(bound, points used)`` of :func:`spread_lower_bound` with bulks on spacing ``h``
    between the losses ``ends`` (with an upper tail above the second where ``tails``);
    None where a window needs more than ``points`` points."""
    scale = 2.0 ** math.floor(math.log2(guess))
    bulks = [_dominated_bulk(sigma, q, direction, h, *ends, points) for sigma, q, _ in steps]
    if any(bulk is None for bulk in bulks):
        return None
    factors = [(first, masses, count) for (first, masses, _), (_, _, count) in zip(bulks, steps)]
    offsets = [offset for _, _, offset in bulks]
    transforms: dict = {}
    alone = rare._term_profile(factors, h, delta, np.float64, transforms=transforms, points=points,
                               offset=_labelled(offsets, [count for _, _, count in steps], factors, h), aim=guess)
    if alone is None:
        return None
    terms = []
    for r, (sigma, q, count) in enumerate(steps if tails else ()):
        counts = [c - (s == r) for s, (_, _, c) in enumerate(steps)]
        others = [(first, masses, c) for (first, masses, _), c in zip(factors, counts) if c]
        profile = rare._term_profile(others or [(0, rare._NOTHING, 1)], h, delta, np.float64, 0.0, transforms,
                                     points, _labelled(offsets, counts, factors, h))
        if profile is None:
            return None
        span = float(profile.losses[-1] - profile.losses[0]) + 2.0 * scale
        losses, masses = _tail_bins(sigma, q, direction, ends[1], span, scale)
        terms.append((count, losses, masses, profile))

    def exceeds(epsilon: float) -> bool:  # the bounded profile above delta
        parts = [float(alone.floor_at(np.array([epsilon]))[0])]
        parts += [count * float(masses @ profile.floor_at(epsilon - losses)) for count, losses, masses, profile in terms]
        return math.fsum(parts) * (1.0 - 1e-9) > delta

    # Below the tilt's reach the allowance swamps the bounded profile, so it need not
    # hold at 0: a point where it holds is sought down from the guess (any is sound).
    high = max([float(alone.losses[-1])] + [float(losses[-1] + profile.losses[-1]) for _, losses, _, profile in terms])
    for share in _SHARES:
        inside = share * guess
        if inside < high and exceeds(inside):
            return _pld._bisected(exceeds, inside, max(high, inside), 2000, relative=1e-9), alone.losses.size
        high = min(high, inside)
    return 0.0, alone.losses.size


#: Where :func:`_spread_on` looks for a point at which its bound holds, as shares of the guess.
_SHARES = (1.0, 0.999, 0.99, 0.97, 0.9, 0.75, 0.5, 0.25, 0.1, 0.0)


def _dominated_bulk(sigma: float, q: float, direction: str, h: float, low: float, high: float,
                    points: float = math.inf) -> tuple | None:
    """``(first, masses, offset)``: one step's outcomes with loss in ``(low, high]`` merged
    onto the grid ``k h + offset``, ``k = first ..`` (:func:`~dpoptim.accounting.pld._dominated_masses`,
    its grid shifted by :func:`~dpoptim.accounting.pld._dominated_offset`); the outcomes
    below and above are dropped from it. None where that takes more than ``points``
    points (checked before any is built: at q 4.6e-6, delta 0.04, epsilon 3e-4 the bulk
    would have asked for 5.8*10^9)."""
    offset = _pld._dominated_offset(sigma, q, direction, h)
    first = math.floor((low - offset) / h)  # the bin below the grid holds no more than what lies below low
    last = max(math.floor((high - offset) / h), first + 1)
    if last - first + 1 > points:
        return None
    losses = np.arange(first, last + 1) * h + offset
    if high > losses[-1]:
        losses = np.append(losses, high)  # the bin up to the cut is merged like the others
    edges, log_n0, log_n1, log_p, log_qq = _pld._bin_log_masses(sigma, q, direction, losses)
    errors = _pld._bin_errors(sigma, q, direction, edges, log_n0, log_n1, log_p, log_qq)
    p = np.exp(log_p)
    p[0] = p[-1] = 0.0  # below the grid and above the cut: not the bulk's (dropped, or the tail's)
    masses = _pld._dominated_masses(p, log_qq, errors, first, h, offset, points=last - first + 1)
    return first, masses, offset


def _labelled(offsets: list, counts: list, factors: list, h: float) -> float:
    """The composed grid's offset, ``sum_r c_r offset_r``, rounded down by more than the
    float64 sums of it and of the composed losses err."""
    total = math.fsum(c * offset for c, offset in zip(counts, offsets))
    size = math.fsum(c * (abs(first) + masses.size) * h for c, (first, masses, _) in zip(counts, factors))
    return total - 1e-12 * (abs(total) + size) - 1e-300
