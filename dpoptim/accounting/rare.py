r"""Rare large losses: the composition split by how many steps' losses are large.

With tiny ``q`` and ``delta`` one step's rare, large loss decides epsilon, while all the
other steps together move the loss by far less: sigma 0.661, q 1e-6, 10^6 steps, delta
1e-12 has epsilon 0.087, set by a single sampled step about 6.8 standard deviations out,
and the rest of the run spreads the loss by 0.003. One transform cannot serve both.
Its tilt (:mod:`.pld`) must stay small for the heavy tail not to wrap around the grid,
and untilting then multiplies the transform's rounding noise by more than delta can
absorb. This module composes the two apart.

**The split** (exact algebra on the grid distributions). Cut each step's discretised
loss distribution at a loss ``a``: its *bulk* ``b`` (losses at most ``a``), its *tail*
``t`` (finite losses above ``a``) and its mass at :math:`+\infty`. The finite parts
convolve, and for a run of ``T`` identical steps

.. math::
    (b + t)^{*T} = \sum_{k=0}^{T} \binom{T}{k}\, b^{*(T-k)} * t^{*k}

(for several runs, the product of such sums). The profile
:math:`\delta(\varepsilon) = \mathbb E_P[(1 - e^{\varepsilon - L})_+]` is linear in the
distribution, so it is the sum of the terms' profiles, and every term is a nonnegative
measure. The terms with two tail steps or more hold at most :math:`\Pr[\text{at least two
of independent events}] \le \sum_{i<j} p_i p_j \le (\sum_r c_r |t_r|)^2 / 2` of mass,
and ``a`` is the smallest loss that keeps this below ``delta / 1024``.

**Upper bound** (:func:`split_epsilon`). The bulk alone is light enough for a large
tilt: it is composed on its own window, with its own tilt and the certificates of
:mod:`.pld`. The term with one tail step, :math:`\sum_r c_r\, t_r * b_r^{*(c_r-1)} *
\prod_{s \ne r} b_s^{*c_s}`, is read as :math:`\sum_r c_r \sum_j t_{r,j}\,
D_r(\varepsilon - l_{r,j})` with :math:`D_r` the profile of the other steps' bulks: no
transform spans the tail. Where rare large *negative* losses stretch the bulk (addition,
at tiny q) a lower tail is split off the same way. The profiles, with the terms beyond
and the mass at :math:`+\infty` counted in full, add up to an upper bound on the profile
of a pair that dominates the true one (connect-the-dots, Doroshenko et al. 2022), so the
epsilon read off it is never below the truth. The bulk's own grid is finer than the
accountant's: connect-the-dots spreads a loss far smaller than a bin over the bin,
adding about ``h`` times the mean absolute loss of the bulk to the composed variance.

**Lower bound** (:func:`split_lower_bound`). Merging every outcome whose loss is at most
``a`` into one outcome is a post-processing, so the merged pair's profile is at most the
true one (data processing). Its bulk is then a point mass at the exact merged loss
:math:`\log(P(L \le a) / Q(L \le a))`, and the two kept terms need no transform at all:
a point mass, and one step's tail shifted by the other steps' merged losses. Dropping
the terms beyond and rounding the tail's losses down only lowers the profile. What the
merge gives up is the bulk's spread, small where this bound is meant to serve.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from . import pld as _pld

#: Share of delta the terms with two tail steps or more may take (upper bound).
_BEYOND_SHARE = 2.0**-10

#: Share of delta each term's wrap-around bound may take.
_WRAP_SHARE = 2.0**-16

#: Largest transform of a term; where a term's window needs more, no split is made.
_MAX_POINTS = 2**21

#: The bulk's grid is refined until connect-the-dots spreads its composed loss by at most
#: this share of epsilon (one standard deviation).
_SPREAD_SHARE = 0.04

#: Orders of the Chernoff bounds behind the terms' windows and tilts.
_LAMBDAS = np.geomspace(1e-2, 1e7, 73)


# --- upper bound ----------------------------------------------------------------------


def split_epsilon(steps: tuple, direction: str, delta: float, guess: float, again: bool = True,
                  points: int = _MAX_POINTS, whole: bool = False, dtype=np.float64,
                  strict: bool = False, enough: float = 0.0) -> tuple[float, bool] | None:
    """Epsilon of one direction of ``steps`` (``(sigma, q, count)`` each) by the split,
    and whether rounding decides it; None where no split applies (no rare tail, or a
    window too wide). ``guess``: an estimate of epsilon (an upper bound), which sizes the
    grid: a bin at most 2^-10 of it, finer where the bulk's spread asks
    (:func:`_bulk_spacing`). With ``again``, the grid is sized anew for the answer while
    that is below the power of two the guess was sized by, and the last answer is
    returned: the grid of the largest power of two at or below its own answer, whatever
    the guess above it, so that epsilon stays monotone in the ledger (``strict``: None
    where that grid's window is too wide, rather than the answer of a grid sized for
    more, which can be far looser: 0.0173 against 0.0113 at sigma 0.508, q 1.55e-6,
    949,724 steps, delta 8.1e-4, with bins of 2^-10 of 0.5). ``points``: the
    largest window; below :data:`_MAX_POINTS`, a bulk too wide for it at the spacing its
    spread asks for gives None (no coarser spacing is tried: the split would not be the
    tighter answer there, nor the cheaper). ``whole``: where no tail reaches epsilon's
    scale, compose the steps whole on the fine grid (else None). ``enough``: an answer
    below it is not sized anew (the caller needs no smaller one)."""
    if not (1e-100 < guess < math.inf) or not steps:
        return None  # (below 1e-100 the grid's squared scale would underflow)
    total = sum(count for _, _, count in steps)
    answer = None
    for _ in range(8):
        scale = 2.0 ** math.floor(math.log2(guess))  # the cache key holds the guess to within a factor of 2
        # at most 2^-10 of the scale, and a mean shift of connect-the-dots, T h^2 / 8, at most 10^-3 of it
        finest = min(scale * 2.0**-10, 2.0 ** math.floor(0.5 * math.log2(8e-3 * scale / total)))
        found = _split_epsilon(tuple(steps), direction, delta, finest, scale, np.dtype(dtype).str, points, whole)
        if found is None:
            return None if strict else answer
        answer = found
        if not (again and 0.0 < found[0] < scale) or found[0] < enough:
            break
        guess = found[0]
    return answer


@functools.lru_cache(maxsize=16)
def _split_epsilon(steps: tuple, direction: str, delta: float, spacing: float, scale: float, dtype: str,
                   points: int = _MAX_POINTS, whole: bool = False):
    """:func:`split_epsilon` for one grid scale, bins at most ``spacing``: the tails to split
    off (a side whose tail cannot matter is kept in the bulk), then the finest spacing the
    bulk's spread asks for, coarser while a window does not fit."""
    dtype = np.dtype(dtype)
    floor, cut = _cuts(steps, direction, delta)
    bottom = min(float(_pld._loss_of_z(-_pld._GAUSS_TAIL * sigma, sigma, q, direction)) for sigma, q, _ in steps)
    reach = max(float(_pld._loss_of_z(1.0 + _pld._GAUSS_TAIL * sigma, sigma, q, direction)) for sigma, q, _ in steps)
    if not reach > cut + scale / 4.0:
        cut = None  # no upper tail reaches epsilon's scale (addition, at tiny q)
    if not floor - bottom > (reach if cut is None else cut) - floor:
        floor = None  # a lower tail would not halve the bulk's support
    if floor is None and cut is None and not whole:
        return None
    h = _bulk_spacing(steps, direction, spacing, scale, bottom if floor is None else floor,
                      reach if cut is None else cut)
    while h <= scale / 64.0:
        found = _split_on(steps, direction, delta, h, (floor, cut), scale, dtype, points)
        if found is not _TOO_WIDE:
            return found
        if points < _MAX_POINTS:
            return None
        h *= 2.0  # a window too wide for the finest grid: try a coarser one
    return None


#: The loss distribution of no step at all: loss 0 for sure.
_NOTHING = np.ones(1)
_NOTHING.setflags(write=False)

#: What :func:`_split_on` returns where a window needs more points than allowed.
_TOO_WIDE = object()


def _bulk_spacing(steps: tuple, direction: str, spacing: float, scale: float, floor: float, cut: float) -> float:
    r"""The coarsest power-of-two spacing, at most ``spacing``, for which connect-the-dots
    spreads the composed bulk by at most :data:`_SPREAD_SHARE` of ``scale``: a loss
    :math:`\ell` much smaller than a bin ``h`` becomes ``h`` with chance about
    :math:`\ell / h`, a variance of about :math:`h |\ell|`, so the composed variance grows
    by about :math:`h \sum_r c_r \mathbb E|L_r|` over the bulk (losses from ``floor`` to ``cut``)."""
    absolute = math.fsum(count * _mean_absolute(sigma, q, direction, floor, cut) for sigma, q, count in steps)
    ratio = (_SPREAD_SHARE * scale) ** 2 / absolute if absolute > 0.0 else math.inf
    if not ratio > 0.0:
        return spacing
    return min(spacing, 2.0 ** math.floor(math.log2(ratio)))


def _mean_absolute(sigma: float, q: float, direction: str, floor: float, cut: float) -> float:
    """E_P[|L|; floor <= L <= cut] by Gauss-Hermite quadrature (a guide for the grid only)."""
    total = 0.0
    for weight, mean in _pld._components(q, direction):
        losses = _pld._loss_of_z(mean + sigma * _pld._HERMITE_X, sigma, q, direction)
        kept = (losses >= floor) & (losses <= cut)
        total += weight * float(_pld._HERMITE_W @ np.where(kept, np.abs(losses), 0.0))
    return total


@functools.lru_cache(maxsize=16)
def _cuts(steps: tuple, direction: str, delta: float) -> tuple[float, float]:
    """``(floor, cut)``: the largest loss ``f`` and the smallest ``a`` (each to a part in
    2^32 of the range) whose exact tails below ``f`` and above ``a``,
    :math:`\\sum_r c_r \\Pr_P[L_r \\le f]` and :math:`\\sum_r c_r \\Pr_P[L_r > a]`, are each at
    most half of ``w`` with :math:`w^2 / 2` = ``delta / 1024``: the terms with two tail
    steps or more hold at most that."""
    allowed = math.sqrt(2.0 * _BEYOND_SHARE * delta) / 2.0

    def weight(x: float, side: int) -> float:
        return math.fsum(count * math.exp(float(_pld._bin_log_masses(sigma, q, direction, np.array([x]))[3][side]))
                         for sigma, q, count in steps)

    low = min(float(_pld._loss_of_z(-_pld._GAUSS_TAIL * sigma, sigma, q, direction)) for sigma, q, _ in steps)
    high = max(float(_pld._loss_of_z(1.0 + _pld._GAUSS_TAIL * sigma, sigma, q, direction)) for sigma, q, _ in steps)
    ends = []
    for side in (0, 1):  # 0: the mass at or below x, to stay within; 1: the mass above x
        inside, outside = (low, high) if side == 0 else (high, low)
        if weight(outside, side) <= allowed:
            ends.append(outside)
            continue
        ends.append(_pld._bisected(lambda x, side=side: weight(x, side) <= allowed, inside, outside, 32))
    return ends[0], ends[1]


def _split_on(steps: tuple, direction: str, delta: float, h: float, ends: tuple, scale: float, dtype,
              points: int = _MAX_POINTS):
    """The split's ``(epsilon, rounding decides)`` with bulks on spacing ``h`` between the
    losses ``ends = (floor, cut)`` (None: no tail on that side; neither: each step whole
    is its bulk), or None where no bulk is left, or :data:`_TOO_WIDE` where a window
    needs more than ``points`` points.

    The term with no tail step is composed on its own window (:func:`_term_profile`).
    The term with one, :math:`\\sum_r c_r\\, t_r * b_r^{*(c_r-1)} * \\prod_{s \\ne r}
    b_s^{*c_s}`, is read as :math:`\\sum_r c_r \\sum_j t_{r,j} D_r(\\varepsilon - l_{r,j})`,
    ``D_r`` the profile of the bulks without one step of run ``r`` (composed untilted:
    what it is read at lies in its body, and near it, where the tail is heavy), ``t_r``
    run ``r``'s tails at losses :math:`l_{r,j}`: exact for the discrete distributions,
    and no transform spans a tail."""
    tail_share = _pld._TAIL_FRACTION * delta
    bottoms, tops = _pld._tail_ends(steps, h, -(2**62), 2**62, tail_share)
    bottoms, tops = bottoms[direction], tops[direction]
    if ends == (None, None):
        return _whole(steps, direction, delta, h, bottoms, tops, dtype, points)
    floor, cut = ends
    step = scale * 2.0**-12  # the tails' finest bin
    lows = [bottom if floor is None else max(bottom, math.ceil(floor / h)) for bottom in bottoms]
    highs = [top if cut is None else min(top, math.floor(cut / h)) for top in tops]
    if any(high <= low for low, high in zip(lows, highs)):
        return None
    if any(high - low > points for low, high in zip(lows, highs)):
        return _TOO_WIDE
    bulks = [(low, _bulk(sigma, q, direction, h, low, high, low > bottom, high < top, step), count)
             for (sigma, q, count), low, high, bottom, top in zip(steps, lows, highs, bottoms, tops)]
    transforms: dict = {}
    alone = _term_profile(bulks, h, delta, dtype, transforms=transforms, points=points)
    if alone is None:
        return _TOO_WIDE
    readers, log_finite, weight = [], 0.0, 0.0
    for r, (sigma, q, count) in enumerate(steps):
        if lows[r] == bottoms[r] and highs[r] == tops[r]:  # the run lies wholly in the bulk: no term of its own
            log_finite += count * math.log1p(-_dots(sigma, q, direction, np.arange(lows[r], highs[r] + 1) * h)[1])
            continue
        others = [(first, masses, c - (s == r)) for s, (first, masses, c) in enumerate(bulks) if c - (s == r)]
        others = others or [(0, _NOTHING, 1)]  # one step in all: its tail alone
        profile = _term_profile(others, h, delta, dtype, 0.0, transforms, points)
        if profile is None:
            return _TOO_WIDE
        reach = float(profile.losses[-1] - profile.losses[0]) + 2.0 * scale
        start = 2.0 * scale - float(profile.losses[0])
        losses, masses, p_inf = _tails(sigma, q, direction, h, (bottoms[r], lows[r], highs[r], tops[r]), step,
                                       (reach, start))
        readers.append(_Tail(count, masses, losses, profile))
        weight += count * float(masses.sum())
        log_finite += count * math.log1p(-p_inf)
    constant = (-math.expm1(log_finite) + weight * weight / 2.0) * (1.0 + 1e-12)
    return _invert(alone, readers, constant, delta)


def _bulk(sigma, q, direction, h, low: int, high: int, below: bool, above: bool, step: float) -> np.ndarray:
    """One step's bulk: its connect-the-dots masses at grid points ``low .. high`` (of
    spacing ``h``) where the grid goes on ``step`` below (``below``) and above (``above``)
    into the tails, whose points those are; a side without a tail ends the grid there,
    as :func:`~dpoptim.accounting.pld._grid_distribution` does (its mass at +inf is the
    tail's, :func:`_tails`, or where there is no upper tail, accounted there too)."""
    points = np.arange(low, high + 1) * h
    points = np.concatenate([[low * h - step] if below else [], points, [high * h + step] if above else []])
    masses, _ = _dots(sigma, q, direction, points)
    return masses[int(below): masses.size - int(above)]


def _tails(sigma, q, direction, h, grid: tuple, step: float, reach: tuple) -> tuple:
    """``(losses, masses, p_inf)``: one step's tails below grid point ``low`` and above
    ``high`` (``grid = (bottom, low, high, top)``, the step's own ends ``bottom`` and
    ``top``), on points ``step`` apart near the bulk, then farther apart
    (:func:`_tail_points`), and its mass at +inf. ``reach = (below, above)``: how far
    below the floor the points stay ``step`` apart (the bulk profile's width), and up to
    which loss above the cut."""
    bottom, low, high, top = grid
    losses, masses, p_inf = [], [], 0.0
    if low > bottom:
        points = low * h - _tail_points(0.0, step, reach[0], (low - bottom) * h)[::-1]
        part, _ = _dots(sigma, q, direction, points)
        losses.append(points[:-1])
        masses.append(part[:-1])
    if high < top:
        points = _tail_points(high * h, step, max(reach[1], high * h + step), top * h)
        part, p_inf = _dots(sigma, q, direction, points)
        losses.append(points[1:])
        masses.append(part[1:])
    else:
        p_inf = _dots(sigma, q, direction, np.arange(low, high + 1) * h)[1]
    return np.concatenate(losses), np.concatenate(masses), p_inf


def _whole(steps: tuple, direction: str, delta: float, h: float, bottoms: tuple, tops: tuple, dtype,
           points: int = _MAX_POINTS):
    """:func:`_split_on` without a tail: the steps' whole distributions (connect-the-dots,
    :func:`~dpoptim.accounting.pld._step_distribution`) composed on the fine grid."""
    if any(top - bottom > points for bottom, top in zip(bottoms, tops)):
        return _TOO_WIDE
    factors, log_finite = [], 0.0
    for (sigma, q, count), bottom, top in zip(steps, bottoms, tops):
        first, masses, p_inf = _pld._step_distribution(sigma, q, direction, h, bottom, top)
        factors.append((first, masses, count))
        log_finite += count * math.log1p(-p_inf)
    alone = _term_profile(factors, h, delta, dtype, points=points)
    if alone is None:
        return _TOO_WIDE
    return _invert(alone, [], -math.expm1(log_finite) * (1.0 + 1e-12), delta)


def _tail_points(a: float, step: float, start: float, top: float) -> np.ndarray:
    """A tail's grid: ``a``, then points ``step`` apart up to ``start``, then gaps growing by
    a 2^-11 share of the distance beyond ``start``, up to ``top``. Above ``start`` a tail
    loss ``d`` beyond where it could matter (epsilon less the bulk's lowest loss) costs at
    most its gap times :math:`e^{-d}`: a 2^-11 share at most."""
    fine = a + step * np.arange(0.0, max(math.ceil((min(start, top) - a) / step), 1) + 1)
    if fine[-1] >= top:
        return np.append(fine[fine < top], top)
    ratio = 1.0 + 2.0**-11
    count = math.ceil(math.log1p((top - fine[-1]) / step * (ratio - 1.0)) / math.log(ratio))
    far = fine[-1] + step * np.expm1(np.arange(1, count + 1) * math.log(ratio)) / (ratio - 1.0)
    return np.concatenate([fine, far[far < top], [top]])


def _dots(sigma: float, q: float, direction: str, points: np.ndarray) -> tuple[np.ndarray, float]:
    """Connect-the-dots on increasing grid ``points`` (any gaps): ``(masses, p_inf)``
    (:func:`~dpoptim.accounting.pld._connect_the_dots`)."""
    _, _, _, log_p, log_qq = _pld._bin_log_masses(sigma, q, direction, points)
    return _pld._connect_the_dots(np.exp(log_p), log_p, log_qq, points)


class _Profile:
    """A composed product of bulks on its window, read at any losses: the exact profile of
    its grid distribution, plus the rounding allowance of the entries above the point and
    the wrap-around bound, and never above its total mass (which bounds any profile)."""

    def __init__(self, tilted: np.ndarray, log_untilt: np.ndarray, losses: np.ndarray, noise: tuple,
                 wrap: float, mass: float):
        self.losses, self.noise, self.wrap, self.mass = losses, noise, wrap, mass
        n = losses.size
        self.spacing = float(losses[-1] - losses[0]) / (n - 1)
        valid = log_untilt <= 300.0  # beyond, a mass would exceed 1: uncertifiable there
        self.first_valid = int(np.argmax(valid)) if valid.any() else n
        size = n - self.first_valid
        masses = np.zeros(n)
        weighted = np.zeros(n)
        if size:
            start = float(log_untilt[self.first_valid])
            slope = float(log_untilt[-1] - start) / max(size - 1, 1)
            spacing = float(losses[-1] - losses[self.first_valid]) / max(size - 1, 1)
            masses[self.first_valid:] = tilted[self.first_valid:] * _pld._exp_linear(start, slope, size)
            weighted[self.first_valid:] = tilted[self.first_valid:] * _pld._exp_linear(start, slope - spacing, size)
        self.decay = float(log_untilt[0] - log_untilt[1]) if n > 1 else 0.0
        # Position i + 1 holds the sums over entries j > i, for i = -1 .. n - 1.
        self.above = np.concatenate([[masses.sum()], _pld._suffix_sum(masses)])
        self.discounted = np.concatenate([[weighted.sum()], _pld._suffix_sum(weighted)])  # m_j e^{r - l_j}
        self.log_untilt = np.concatenate([[log_untilt[0] + self.decay], log_untilt])
        self.reference = float(losses[min(self.first_valid, n - 1)])

    def at(self, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(profile, allowance)`` at each of ``points``: the sum over entries above it of
        ``m_j (1 - e^{x - l_j})`` with the bounds above (at most the total mass), and the
        rounding allowance in it."""
        n = self.losses.size
        # l_i < x <= l_{i+1} on the uniform grid (at x on a grid point either side will do:
        # that entry adds 0 there)
        with np.errstate(invalid="ignore"):
            i = np.clip(np.ceil((points - self.losses[0]) / self.spacing), 0, n).astype(np.int64) - 1
        allowance = _pld._allowances(self.noise, self.log_untilt[i + 1], self.decay, (n - 1 - i).astype(float))
        discounted, above = self.discounted[i + 1], self.above[i + 1]
        with np.errstate(over="ignore", divide="ignore"):
            subtract = np.where(discounted > 0, np.exp(points - self.reference + np.log(discounted)), 0.0)
        summing = 4.0 * (n + 4) * _pld._U * (above + subtract)  # the sums' own rounding
        value = self.wrap + allowance + np.maximum(above - subtract, 0.0) + summing
        valid = (i >= self.first_valid) | ((i == -1) & (self.first_valid == 0))
        value = np.where(valid & (value == value), value, math.inf)
        value = np.where(i >= n - 1, self.wrap, value)
        capped = value >= self.mass
        return np.where(capped, self.mass, value), np.where(capped | (i >= n - 1), 0.0, allowance)


def _term_profile(factors: list, h: float, delta: float, dtype, tilt: float | None = None,
                  transforms: dict | None = None, points: int = _MAX_POINTS) -> _Profile | None:
    """The profile of the product of ``factors`` (``(first, masses, count)`` each, on
    spacing ``h``), composed on a window certified by Chernoff bounds from their exact
    moment generating functions (at most a 2^-16 share of ``delta`` beyond it), at
    ``tilt`` (None: the Chernoff-optimal one at ``delta``, capped against wrap-around),
    or None where the window needs more than ``points`` points."""
    lambdas = np.concatenate([-_LAMBDAS[::-1], [0.0], _LAMBDAS])
    cgf = sum(count * _pld._log_mgf(first, masses, h, lambdas) for first, masses, count in factors)
    up, down = cgf[_LAMBDAS.size + 1:], cgf[:_LAMBDAS.size][::-1]
    log_share = math.log(_WRAP_SHARE * delta)
    lowest = sum(count * first for first, _, count in factors)
    highest = sum(count * (first + masses.size - 1) for first, masses, count in factors)
    i_low = max(lowest, math.floor(float(((log_share - down) / _LAMBDAS).max()) / h))
    i_top = min(highest, math.ceil(float(((up - log_share) / _LAMBDAS).min()) / h))
    n = 1 << max(10, (i_top - i_low + 2).bit_length())
    if n > points:
        return None
    beyond = (i_low + n) * h  # composed indices from here on wrap around
    wrap = 0.0 if i_low + n > highest else math.exp(min(float((up - _LAMBDAS * beyond).min()), 0.0))
    log_mass = float(cgf[_LAMBDAS.size])
    if tilt is None:
        tilt = _pld._choose_tilt(_LAMBDAS, up - log_mass, n * h, min(delta * math.exp(-log_mass), 0.5))
    tilted, log_untilt, noise = _composed(factors, h, i_low, n, tilt, dtype, {} if transforms is None else transforms)
    return _Profile(tilted, log_untilt, (i_low + np.arange(n)) * h, noise, wrap, math.exp(log_mass))


def _composed(factors: list, h: float, i_low: int, n: int, tilt: float, dtype, transforms: dict) -> tuple:
    """``(tilted, log_untilt, noise)`` of a product on the window ``i_low .. i_low + n - 1``:
    the composed tilted masses, the exponents that undo the tilt, and the bounds of
    :func:`~dpoptim.accounting.pld._rounding_allowance` (weights: the product of all factors
    but one of each, as there). ``transforms`` keeps the factors' transforms for the
    other products of the same split."""
    log_modulus = angle = 0.0
    log_scale, log_weight = 0.0, 0.0
    for first, masses, count in factors:
        key = (id(masses), first, tilt, n)  # the factors' arrays live as long as ``transforms``
        if key not in transforms:
            start, values, _, log_mgf = _pld._tilted(first, masses, 0.0, h, tilt)
            spectrum = _pld._placed_transform([(start, values)], n, dtype)[0].copy()
            with np.errstate(divide="ignore"):
                transforms[key] = (spectrum, np.log(np.abs(spectrum)), log_mgf)
        spectrum, log_abs, log_mgf = transforms[key]
        log_modulus = log_modulus + count * log_abs
        angle = angle + _pld._reduced_angles(spectrum.real, spectrum.imag, count)
        log_weight = log_weight + (count - 1) * log_abs.astype(np.float64)
        log_scale += count * log_mgf
    spectrum = _pld._polar(log_modulus, angle)
    composed = np.fft.irfft(spectrum, n)
    tilted = np.maximum(np.roll(composed, -(i_low % n)).astype(np.float64), 0.0)
    log_untilt = log_scale - tilt * (i_low + np.arange(n)) * h
    unit = float(np.finfo(dtype).eps) / 2
    total_steps = sum(count for _, _, count in factors)
    with np.errstate(under="ignore"):
        noise = _pld._rounding_allowance(n, total_steps, np.exp(log_weight), np.abs(spectrum).astype(np.float64),
                                         unit)
    return tilted, log_untilt, noise


class _Tail:
    """One run's tails, read against the untilted profile ``D`` of the other steps' bulks:
    :math:`c \\sum_j t_j D(\\varepsilon - l_j)`. Only the tail points whose ``epsilon - l_j``
    falls in D's window are read one by one; below it ``D`` has a closed form (every entry
    counts), summed at once from suffix sums over the tail, and above it only the
    wrap-around bound is left."""

    def __init__(self, count: int, masses: np.ndarray, losses: np.ndarray, profile: _Profile):
        self.count, self.masses, self.losses, self.profile = count, masses, losses, profile
        self.low, self.high = float(profile.losses[0]), float(profile.losses[-1])
        self.offset = float(losses[0]) if losses.size else 0.0
        self.after = np.concatenate([np.cumsum(masses[::-1])[::-1], [0.0]])  # sum over j >= k of t_j
        with np.errstate(under="ignore"):
            scaled = masses * np.exp(self.offset - losses)  # t_j e^{-(l_j - offset)}, at most t_j
        self.after_scaled = np.concatenate([np.cumsum(scaled[::-1])[::-1], [0.0]])
        self.whole = profile if profile.first_valid == 0 else None  # untilted: every entry valid

    def read(self, epsilon: float) -> tuple[float, float]:
        """``(value, allowance)`` of this run's term at ``epsilon``."""
        below = int(np.searchsorted(self.losses, epsilon - self.low, side="left")) if self.whole else self.losses.size
        beyond = min(int(np.searchsorted(self.losses, epsilon - self.high, side="left")), below)
        middle = slice(beyond, below)
        values, allowances = self.profile.at(epsilon - self.losses[middle])
        value = float(self.masses[middle] @ values)
        allowance = float(self.masses[middle] @ allowances)
        value += self.profile.wrap * float(self.after[0] - self.after[beyond])
        if below < self.losses.size:
            d = self.whole
            n = d.losses.size
            everything = float(_pld._allowances(d.noise, d.log_untilt[:1], d.decay, np.array([float(n)]))[0])
            product = float(d.discounted[0]) * float(self.after_scaled[below])  # 0 (underflow): none taken off
            with np.errstate(over="ignore"):
                subtract = math.exp(epsilon - d.reference - self.offset + math.log(product)) if product > 0 else 0.0
            mass = float(self.after[below])
            summing = 4.0 * (n + 4) * _pld._U
            value += (d.wrap + everything + float(d.above[0]) * (1.0 + summing)) * mass - (1.0 - summing) * subtract
            allowance += everything * mass
        return self.count * value, self.count * allowance


def _invert(alone: _Profile, tails: list, constant: float, delta: float) -> tuple[float, bool] | None:
    """The smallest epsilon >= 0 (to a relative 1e-8) where ``constant``, the term with no
    tail step (``alone``) and the terms with one (``tails``, :class:`_Tail`) are certified
    at most ``delta`` together; and whether their rounding allowance there exceeds
    ``delta / 100``. None where no epsilon is. The profile falls smoothly in epsilon: the
    Illinois variant of regula falsi on its logarithm narrows a bracket whose upper end
    is always certified, in about ten readings."""
    def total(epsilon: float) -> tuple[float, float]:
        value, allowance = alone.at(np.array([epsilon]))
        read = [tail.read(epsilon) for tail in tails]
        parts = [constant, float(value[0])] + [v for v, _ in read]
        # 1e-9: the tails' suffix sums err by a round-off per entry at most
        return math.fsum(parts) * (1.0 + 1e-9), float(allowance[0]) + math.fsum(a for _, a in read)

    def excess(epsilon: float) -> float:  # log(profile / delta): at most 0 where certified
        value = total(epsilon)[0]
        return math.log(value / delta) if value > 0 else -math.inf

    # beyond every window (the tail's losses added to its profile's), only the wrap-around bounds are left
    high = max([float(alone.losses[-1])] + [tail.high + float(tail.losses[-1]) for tail in tails if tail.losses.size])
    low, at_high, at_low = 0.0, excess(high), excess(0.0)
    if not at_high <= 0.0:
        return None
    if at_low <= 0.0:
        return 0.0, not total(0.0)[1] <= delta / 100.0
    kept = 0  # which end the last two steps kept (Illinois: halve the other's weight)
    while high - low > 1e-8 * high:
        middle = 0.5 * (low + high)
        if math.isfinite(at_low) and math.isfinite(at_high) and at_low > at_high:
            middle = high - at_high * (high - low) / (at_high - at_low)
            middle = min(max(middle, low + 1e-3 * (high - low)), high - 1e-3 * (high - low))
        at_middle = excess(middle)
        if at_middle <= 0.0:
            high, at_high = middle, at_middle
            at_low = at_low / 2.0 if kept == 1 else at_low
            kept = 1
        else:
            low, at_low = middle, at_middle
            at_high = at_high / 2.0 if kept == -1 else at_high
            kept = -1
    return high, not total(high)[1] <= delta / 100.0


# --- lower bound ----------------------------------------------------------------------

#: Bins of a tail's loss per unit of the lower bound's scale (finer bins lose less).
_LOWER_BINS = 2**12


def split_lower_bound(steps: tuple, direction: str, delta: float, scale: float) -> float:
    """A rigorous lower bound on the epsilon of one direction of ``steps`` at ``delta``:
    the bulk merged into one outcome, the terms with one tail step or none (0.0 where it
    finds none). ``scale``: a lower estimate of epsilon, which sizes the tail's bins."""
    if not (0.0 < scale < math.inf) or not steps:
        return 0.0
    a = _cuts(tuple(steps), direction, delta)[1]  # dropping the terms beyond loses at most delta / 1024
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
    its mass's share there."""
    top = float(_pld._loss_of_z(1.0 + _pld._GAUSS_TAIL * sigma, sigma, q, direction))
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
    """The largest epsilon >= 0 (to a relative 1e-9) at which the profile of point masses
    ``masses`` at increasing ``losses``, less a bound on its rounding (a few round-offs
    per term of its sums), is above ``delta`` (0.0 where none is): a lower bound on the
    epsilon of any profile above it."""
    above = np.concatenate([np.cumsum(masses[::-1])[::-1], [0.0]])
    reference = float(losses[-1])
    offset = float((reference - losses).max())  # m_j e^{r - l_j - offset}: no exponent above 0
    with np.errstate(under="ignore"):
        weighted = masses * np.exp(reference - losses - offset)
    discounted = np.concatenate([np.cumsum(weighted[::-1])[::-1], [0.0]])

    def exceeds(epsilon: float) -> bool:  # the profile, less a bound on its rounding, above delta
        i = int(np.searchsorted(losses, epsilon, side="right"))  # entries with loss > epsilon
        if i >= losses.size:
            return False
        with np.errstate(over="ignore"):
            subtract = math.exp(epsilon - reference + offset + math.log(discounted[i])) if discounted[i] > 0 else 0.0
        error = 4.0 * (losses.size + 4) * _pld._U * (float(above[i]) + subtract)
        return float(above[i]) - subtract - error > delta

    if not exceeds(0.0):
        return 0.0
    high = max(float(losses[-1]), 0.0)
    if exceeds(high):
        return high
    return _pld._bisected(exceeds, 0.0, high, 2000, relative=1e-9)
