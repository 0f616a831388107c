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
Over one long run at tiny q that asks for bins far finer than the window is wide, and
the bulk is composed on two scales (:mod:`.twoscale`) where that is cheaper.

Lower bounds on the same split are in :mod:`.rare_lower`.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from . import pld as _pld
from . import twoscale as _twoscale

#: Share of delta the terms with two tail steps or more may take (upper bound).
_BEYOND_SHARE = 2.0**-10

#: Share of delta each term's wrap-around bound may take.
_WRAP_SHARE = 2.0**-16

#: Largest transform of a term; where a term's window needs more, no split is made.
_MAX_POINTS = 2**21

#: The bulk's grid is refined until connect-the-dots spreads its composed loss by at most
#: this share of epsilon (one standard deviation).
_SPREAD_SHARE = 0.04

#: A split on fewer than :data:`_MAX_POINTS` points whose coarser scale's window needs over
#: this many times the points allowed at the finer bins is not composed (:func:`_split_on`).
#: Where :func:`split_epsilon` sizes the grid again for its answer, bins several times finer
#: (32 below) hold the same bulks, whose window barely narrows (the coarser bins spread by a
#: few percent of epsilon at most: :func:`_bulk_spacing`), so it is refused before any bulk
#: is discretised: 100 pairs of 1000 steps at q 1e-4 spent 0.35 s a call on bulks and sums
#: that ended 1.36 times too wide (1.41 predicted). Only which answer is tried depends on it.
_WIDE_MARGIN = 1.25

#: :func:`_split_on` gives no answer where the bound on the terms with two tail steps or
#: more, :math:`(\sum_r c_r |t_r|)^2 / 2`, exceeds this share of delta. The cut keeps the
#: true tails' share at 2^-10, but on bins far wider than the bulk (spacing 0.0625 for a
#: bulk 0.0035 wide) connect-the-dots sends part of every step's bulk to the grid point
#: above the cut, where it counts as tail: 83 steps at sigma 1.19, q 1.5e-4 beside 13 at
#: sigma 0.041, q 5.5e-6 (delta 2.2e-3) weighed 0.066, whose square took 0.975 of delta,
#: and the split reported 261.8 where the grids give 0.006 (revealing which steps were
#: sampled bounds it by 0.50).
_SPILL_SHARE = 0.25

#: Orders of the Chernoff bounds behind the terms' windows and tilts.
_LAMBDAS = np.geomspace(1e-2, 1e7, 73)


# --- upper bound ----------------------------------------------------------------------


def split_epsilon(steps: tuple, direction: str, delta: float, guess: float, again: bool = True,
                  points: int = _MAX_POINTS, whole: bool = False, dtype=np.float64,
                  strict: bool = False, enough: float = 0.0, spacings: tuple | None = None,
                  coarser: dict | None = None) -> tuple[float, bool] | None:
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
    tighter answer there, nor the cheaper), unless coarser bins settle it
    (:func:`_settled_coarser`). ``spacings``: ``(finest, coarsest)``, where
    given: spacings are tried from ``finest`` up (none finer: the caller needs none),
    coarser while a window does not fit, up to ``coarsest`` and none above it, whatever
    ``points``. ``whole``: where no tail reaches epsilon's
    scale, compose the steps whole on the fine grid (else None). ``enough``: an answer
    below it is not sized anew (the caller needs no smaller one). ``coarser``: receives,
    under ``direction``, the sound answer on bins coarser than the spread asks where
    those did not settle it and the asked ones do not fit (:class:`_Unsettled`). On
    :data:`_MAX_POINTS` points the bulk of one run may be put on two scales
    (:mod:`.twoscale`); not for a first look on fewer, where the grids answered quickly
    without it (sigma 0.95, q 2.9e-5, 301,604 steps: 0.07 s, against 0.6 s with it)."""
    if not (1e-100 < guess < math.inf) or not steps:
        return None  # (below 1e-100 the grid's squared scale would underflow)
    total = sum(count for _, _, count in steps)
    answer = window = None
    for _ in range(8):
        scale = 2.0 ** math.floor(math.log2(guess))  # the cache key holds the guess to within a factor of 2
        finest = finest_spacing(scale, total)
        try:
            found = _split_epsilon(tuple(steps), direction, delta, finest, scale, np.dtype(dtype).str, points, whole,
                                   spacings, points >= _MAX_POINTS, window, None if answer is None else answer[0])
        except _pld.DroppedMass:  # (never seen: a loss error as wide as the split's bins)
            found = None
        if isinstance(found, _Unsettled):  # sound, but no answer of the split's: kept aside where asked
            if coarser is not None:
                coarser[direction] = min(found.epsilon, coarser.get(direction, math.inf))
            found = None
        if found is None:
            return None if strict else answer
        answer, window = found[:2], found[2] if len(found) > 2 else None
        if not (again and sized_again(found[0], guess)) or found[0] < enough:
            break
        guess = found[0]
    return answer


def asked_spacing(steps: tuple, direction: str, delta: float, guess: float) -> float:
    """The bins :func:`split_epsilon` composes the bulk on, on the grid sized for ``guess``
    (the first one the spread asks for, :func:`_bulk_spacing`)."""
    scale = 2.0 ** math.floor(math.log2(guess))
    return _asked_spacing(tuple(steps), direction, delta, finest_spacing(scale, sum(step[2] for step in steps)), scale)


def _asked_spacing(steps: tuple, direction: str, delta: float, spacing: float, scale: float) -> float:
    """:func:`_bulk_spacing` of the bulk :func:`split_ends` leaves, bins at most ``spacing``."""
    floor, cut, bottom, reach = split_ends(steps, direction, delta, scale)
    return _bulk_spacing(steps, direction, spacing, scale, bottom if floor is None else floor,
                         reach if cut is None else cut)


def sized_again(answer: float, guess: float) -> bool:
    """Whether :func:`split_epsilon` sizes its grid anew for ``answer``, found on the grid
    sized for ``guess``: where it lies below the power of two the guess was sized by (and
    both are finite and above 0; no split answers an infinite guess)."""
    return 0.0 < answer < math.inf and 0.0 < guess < math.inf and answer < 2.0 ** math.floor(math.log2(guess))


@functools.lru_cache(maxsize=16)
def _split_epsilon(steps: tuple, direction: str, delta: float, spacing: float, scale: float, dtype: str,
                   points: int = _MAX_POINTS, whole: bool = False, spacings: tuple | None = None,
                   blocks: bool = True, window: tuple | None = None, prior: float | None = None):
    """:func:`split_epsilon` for one grid scale, bins at most ``spacing``: the tails to split
    off (a side whose tail cannot matter is kept in the bulk), then the finest spacing the
    bulk's spread asks for (at least ``spacings[0]``, where given), coarser while a window
    does not fit (up to ``spacings[1]``, where given), or far coarser bins where they
    settle it (:func:`_settled_coarser`). Returns ``(epsilon, rounding decides,
    window)`` (the last for the next scale: see :func:`_split_on`), or None. ``window``:
    the previous scale's, where there was one."""
    dtype = np.dtype(dtype)
    floor, cut, bottom, reach = split_ends(steps, direction, delta, scale)
    if floor is None and cut is None and not whole:
        return None
    h = _asked_spacing(steps, direction, delta, spacing, scale)
    h = h if spacings is None else max(h, spacings[0])
    # a long run's body in blocks, where worth it and allowed (``blocks``)
    if blocks and spacings is None and len(steps) == 1 and h <= scale / 64.0:
        span = (bottom if floor is None else floor, reach if cut is None else cut)
        found = _split_on(steps, direction, delta, h, (floor, cut), scale, dtype, points, blocks=span)
        if found is not _TOO_WIDE:
            return found
    coarsest = scale / 64.0 if spacings is None else min(scale / 64.0, spacings[1])
    tried: dict = {}  # spacing -> the split's answer there
    settled = _settled_coarser(steps, direction, delta, (h, min(spacing, coarsest)), (floor, cut), scale, dtype,
                               (points, window, spacings is None and points < _MAX_POINTS), tried)
    if settled is not None:
        return settled
    hopeless = [found for found in tried.values() if found not in (None, _TOO_WIDE) and found[1]
                and found[0] > _HOPELESS * scale]
    if hopeless:  # rounding decides far above the scale: finer bins only add to it
        return min(hopeless, key=lambda found: found[0])
    across = _settled_across(steps, direction, delta, (h, coarsest), (floor, cut), scale, dtype,
                             (points, window, prior), tried)
    if across is not None:
        return across
    while h <= coarsest:
        found = tried[h] if h in tried else _split_on(steps, direction, delta, h, (floor, cut), scale, dtype, points,
                                                      before=window)
        if found is not _TOO_WIDE:
            return found
        if spacings is None and points < _MAX_POINTS:
            return _unsettled(tried)
        h *= 2.0  # a window too wide for the finest grid: try a coarser one
    return _unsettled(tried)


def _settled_across(steps: tuple, direction: str, delta: float, spacings: tuple, ends: tuple, scale: float, dtype,
                    state: tuple, tried: dict):
    """The split's answer on bins half as wide as the scale above composed, where it
    settles this scale's; else None. ``spacings``: ``(asked, coarsest)``, the bins the
    spread asks for (:func:`_bulk_spacing`) and the coarsest the scale allows; ``state``:
    ``(points, window, prior)``, the largest window, and the window and answer of the
    scale above (:func:`split_epsilon` sized this grid anew for that answer). ``tried``
    receives the answer on those bins.

    Halving epsilon's scale quarters the bins the spread asks for (its variance is about
    linear in the bin), and halving it twice divides them by 16, while where a rare tail
    decides, the answer moves by far less (:func:`_settled_coarser`): the scale above,
    read on bins twice as wide, gives about the same answer on its own grid. So the
    bins half as wide as its are tried first, where they are 2 to 8 times the asked ones,
    and kept where the scale above lay at most :data:`_ACROSS_RISE` above them (both are
    sound upper bounds). Only where the asked bins would fit their window (the scale
    above's window, of the same bulk, said so to within :data:`_WIDE_MARGIN`): where
    they do not, the caller answers None and the grids answer, which can be tighter
    (2,000 one-step pairs at q 1e-4 to 1e-5, delta 1e-5: 0.0066839 on the grids, 0.0067412
    on bins 8 times the asked ones)."""
    asked, coarsest = spacings
    points, window, prior = state
    if prior is None or window is None:
        return None
    before_ends, width, before_h = window
    wider = before_h / 2.0
    if not (2.0 * asked <= wider <= min(8.0 * asked, coarsest) and before_ends == ends
            and 0.0 < width * _WIDE_MARGIN <= points * asked
            and _widest_bulk(steps, direction, delta, asked, ends) <= points):
        return None
    if wider not in tried:
        tried[wider] = _split_on(steps, direction, delta, wider, ends, scale, dtype, points, before=window)
    found = tried[wider]
    if found is None or found is _TOO_WIDE or found[1]:
        return None
    return found if prior - found[0] <= _ACROSS_RISE * found[0] else None


#: :func:`_settled_across` keeps the answer on bins half as wide as the scale above's where
#: that scale's answer lies at most this share above it. The answer falls about with the
#: square of the bin where a rare tail decides (each halving quarters the step), so what
#: finer bins could still take off is about a third of that rise. 10^4 one-step pairs
#: from sigma 1.2 at q 1e-4 to sigma 0.6 at q 1e-5, delta 1e-5: removal's last scale asks
#: bins 4 times finer than the one above, whose 0.0159608 lies 2.6e-4 above the
#: 0.0159567 of bins twice the asked ones (0.70 s); the asked bins give 0.0159556 (1.25 s).
#: 200 such pairs: 0.0019256 on bins 8 times the asked ones, 6.3e-5 above the asked
#: bins' answer, the call 1.0 s instead of 2.3 s.
_ACROSS_RISE = 2.0**-11


@dataclasses.dataclass(frozen=True)
class _Unsettled:
    """:func:`_split_epsilon`'s sound answer on bins coarser than the spread asks, where
    those did not settle it (:func:`_settled_coarser`) and the asked ones do not fit."""

    epsilon: float


def _unsettled(tried: dict) -> _Unsettled | None:
    """The smallest answer in ``tried`` (spacing -> :func:`_split_on`'s result) that
    rounding does not decide, as :class:`_Unsettled`; None where there is none."""
    answers = [found[0] for found in tried.values() if found not in (None, _TOO_WIDE) and not found[1]]
    return _Unsettled(min(answers)) if answers else None


#: Where bins coarser than the spread asks (:func:`_settled_coarser`) give an answer that
#: rounding decides above this many times epsilon's scale, :func:`_split_epsilon` keeps it
#: rather than composing the finer bins: their rounding allowance sums over more entries.
#: One step at sigma 268, q 1.8e-3, delta 2.7e-6 (epsilon 1.8e-7, on the grids): 2.17e-5
#: on the coarser bins, 2.19e-5 on the asked ones, 1.5 to 3.7 s each time; addition of 168
#: steps at sigma 9.87, q 2.6e-6, delta 1.4e-6: 1.42e-6 and 1.46e-6 (24 times the scale).
_HOPELESS = 16.0

#: :func:`_settled_coarser` tries bins this many times coarser than the spread asks, or more.
_COARSER_RATIO = 4

#: :func:`_settled_coarser` is tried only where a step's bulk spans this many bins at the
#: spacing asked for, or more: below, a split's cost is mostly its tails' and profiles'
#: readings, whatever its bins (100 runs of 100 steps at q 2e-5, bulks of 2^16 bins: 0.3
#: s a split on bins 16 times coarser or on the asked ones), and trying coarser bins first
#: doubled it where the spread moved epsilon.
_COARSER_BINS = 2**18

#: :func:`_settled_coarser` takes the coarser bins' answer where doubling them raised it by
#: at most this share.
_SETTLED_RISE = 2.0**-12


def _settled_coarser(steps: tuple, direction: str, delta: float, spacings: tuple, ends: tuple, scale: float, dtype,
                     window: tuple, tried: dict):
    """The split's answer on coarser bins than the spread asks for, where they settle it;
    else None. ``spacings``: ``(asked, coarse)``, the spread's spacing (:func:`_bulk_spacing`)
    and the coarsest the scale allows; ``window``: ``(points, before, none)``, ``points``
    and ``before`` of :func:`_split_on`, and whether the caller answers None where the
    asked bins do not fit (else it goes on to coarser ones). Tried only where a bulk spans
    :data:`_COARSER_BINS` bins or more at ``asked``, and ``coarse`` is at least
    :data:`_COARSER_RATIO` times the spacing the caller would compose at. ``tried``
    receives each spacing's answer (the pair above found ahead: :func:`_ahead_worth_it`).

    The spread test bounds how far connect-the-dots spreads the bulk, not how much that
    moves epsilon: where a rare tail step decides it, the tails read the bulk's profile
    far below its body, where only the bulk's mean of :math:`e^{-L}` counts, which
    connect-the-dots keeps. The answers on bins ``2 coarse`` and ``coarse`` then agree, and
    the spread's share of the answer, about linear in the bin (its variance is), is about
    their difference: where that is at most :data:`_SETTLED_RISE` of the answer, the
    smaller answer is taken (both are sound upper bounds). 100 one-step runs at q 6.4e-6
    to 4.3e-6, delta 1.1e-5: bins 8 times coarser than asked give 4.56334e-5 in 1.8 s,
    the asked ones 4.56361e-5 in 23 s. Where the asked bins do not fit and the caller
    would answer None, a settled answer on coarser bins is as tight (it spared that
    ledger a split on 2^21 points). Where bins ``coarse`` do not fit either, for one
    run, bins ``4 coarse`` and ``2 coarse`` are compared: near epsilon's zero (sigma 0.31,
    q 5.8e-6, 263 steps, delta 6e-4) they agreed to 1.5e-5 of epsilon, as the scale above
    had, and the grids answered the same 0.45 s later. Not for several runs: 50 one-step
    pairs at q 1.9e-4 to 6.4e-5 (delta 2.8e-4) reported 0.46% more than the grids."""
    asked, coarse = spacings
    points, before, none = window
    widest = _widest_bulk(steps, direction, delta, asked, ends)
    if widest < _COARSER_BINS:
        return None
    while not none and asked < coarse and widest > points:  # (the caller's next spacing: about half the bins)
        asked, widest = 2.0 * asked, widest / 2.0
    if not coarse >= _COARSER_RATIO * asked:
        return None

    known: dict = {}  # spacing -> the split there, found ahead

    def split(h: float):
        return _split_on(steps, direction, delta, h, ends, scale, dtype, points, before=before)

    def answer(h: float):
        found = tried[h] = known[h] if h in known else split(h)
        return found if found is not None and found is not _TOO_WIDE and not found[1] else None

    def pair() -> tuple:  # the coarser pair, one after the other
        wider = answer(2.0 * coarse)
        return wider, None if wider is None else answer(coarse)

    if len(steps) == 1 and _ahead_worth_it(steps, direction, delta, 2.0 * coarse, ends, window):
        (wider, finer), known[4.0 * coarse] = _pld._beside(pair, lambda: split(4.0 * coarse))
    else:
        wider, finer = pair()
    if wider is not None and tried[coarse] is _TOO_WIDE and len(steps) == 1:  # the next coarser pair (one run)
        wider, finer = answer(4.0 * coarse), wider
    if wider is None or finer is None:
        return None  # (no answer, or rounding decides: the asked bins may do better)
    if not wider[0] - finer[0] <= _SETTLED_RISE * finer[0]:
        return None
    return min(wider, finer, key=lambda found: found[0])


def _ahead_worth_it(steps: tuple, direction: str, delta: float, h: float, ends: tuple, window: tuple) -> bool:
    """For :func:`_settled_coarser` (one run): whether to split on the bins above the pair
    (``2 h``), which it asks for where the finer of the pair does not fit, on the
    accounting thread while this one splits on the pair: where a core is idle and the
    first of the pair (``h``) may fit its window (where it surely does not, it answers at
    once and nothing else is asked for). Twice coarser than the pair, they cost less than
    its first, and where they are not asked for only the idle core's time is lost; the
    answer is split as the tries one after the other would split it. The finer of the
    pair is not split ahead: where the first answers nothing (rounding decides it, as
    for one step at sigma 268, q 1.8e-3), it is not asked for, and it costs the most."""
    points, before, _ = window
    return (_pld._core_idle() and _widest_bulk(steps, direction, delta, h, ends) <= points
            and not _known_too_wide(before, ends, h, points))


def _widest_bulk(steps: tuple, direction: str, delta: float, h: float, ends: tuple) -> int:
    """The most bins of ``h`` any step's bulk between the losses ``ends`` spans."""
    lows, highs = _bulk_span(steps, direction, delta, h, ends)[1:3]
    return max(high - low for low, high in zip(lows, highs))


def _bulk_span(steps: tuple, direction: str, delta: float, h: float, ends: tuple) -> tuple:
    """``(bottoms, lows, highs, tops)``: each step's lowest and highest grid index kept at
    spacing ``h`` (:func:`~dpoptim.accounting.pld._tail_ends`), and its bulk's, between
    the losses ``ends = (floor, cut)`` (None: the step's own end)."""
    bottoms, tops = _pld._tail_ends(steps, h, -(2**62), 2**62, _pld._TAIL_FRACTION * delta)
    bottoms, tops = bottoms[direction], tops[direction]
    floor, cut = ends
    lows = [bottom if floor is None else max(bottom, math.ceil(floor / h)) for bottom in bottoms]
    highs = [top if cut is None else min(top, math.floor(cut / h)) for top in tops]
    return bottoms, lows, highs, tops


def split_ends(steps: tuple, direction: str, delta: float, scale: float) -> tuple:
    """``(floor, cut, bottom, reach)``: where the bulk ends below and above (:func:`_cuts`;
    None: that side has no tail of its own), and the steps' lowest and highest losses
    kept at all. An upper tail is split off where it reaches ``scale`` (epsilon's), a
    lower one where it would halve the bulk's support."""
    floor, cut = _cuts(steps, direction, delta)
    bottom = min(float(_pld._loss_of_z(-_pld._GAUSS_TAIL * sigma, sigma, q, direction)) for sigma, q, _ in steps)
    reach = max(float(_pld._loss_of_z(1.0 + _pld._GAUSS_TAIL * sigma, sigma, q, direction)) for sigma, q, _ in steps)
    if not reach > cut + scale / 4.0:
        cut = None  # no upper tail reaches epsilon's scale (addition, at tiny q)
    if not floor - bottom > (reach if cut is None else cut) - floor:
        floor = None  # a lower tail would not halve the bulk's support
    return floor, cut, bottom, reach


def finest_spacing(scale: float, total: int) -> float:
    """The bulk's finest bin for an epsilon of ``scale`` over ``total`` steps: at most 2^-10
    of it, and a mean shift of connect-the-dots, T h^2 / 8, at most 10^-3 of it."""
    return min(scale * 2.0**-10, 2.0 ** math.floor(0.5 * math.log2(8e-3 * scale / total)))


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
    absolute = math.fsum(count * _pld._mean_absolute_loss(sigma, q, direction, floor, cut) for sigma, q, count in steps)
    ratio = (_SPREAD_SHARE * scale) ** 2 / absolute if absolute > 0.0 else math.inf
    if not 0.0 < ratio < math.inf:
        return spacing
    return min(spacing, 2.0 ** math.floor(math.log2(ratio)))


@functools.lru_cache(maxsize=16)
def _cuts(steps: tuple, direction: str, delta: float) -> tuple[float, float]:
    """``(floor, cut)``: the largest loss ``f`` and the smallest ``a`` (each to a part in
    2^32 of the range, searched on the rounded tails and checked on their bounds,
    :func:`~dpoptim.accounting.pld._split_log_masses`) whose exact tails below ``f`` and above ``a``,
    :math:`\\sum_r c_r \\Pr_P[L_r \\le f]` and :math:`\\sum_r c_r \\Pr_P[L_r > a]`, are each at
    most half of ``w`` with :math:`w^2 / 2` = ``delta / 1024``: the terms with two tail
    steps or more hold at most that."""
    allowed = math.sqrt(2.0 * _BEYOND_SHARE * delta) / 2.0

    def weights(xs: np.ndarray, side: int, bounded: bool = True) -> np.ndarray:
        rows = _pld._split_log_masses_of_steps([step[:2] for step in steps], direction, xs, bounded)[side].tolist()
        return np.array([math.fsum(count * math.exp(row[k]) for (_, _, count), row in zip(steps, rows))
                         for k in range(xs.size)])

    low = min(float(_pld._loss_of_z(-_pld._GAUSS_TAIL * sigma, sigma, q, direction)) for sigma, q, _ in steps)
    high = max(float(_pld._loss_of_z(1.0 + _pld._GAUSS_TAIL * sigma, sigma, q, direction)) for sigma, q, _ in steps)
    ends = []
    for side in (0, 1):  # 0: the mass at or below x, to stay within; 1: the mass above x
        inside, outside = (low, high) if side == 0 else (high, low)
        # searched on the rounded masses, a little inside the allowance, then checked on their bounds
        within = allowed * (1.0 - 2.0**-20)
        if weights(np.array([outside]), side, False)[0] <= within and weights(np.array([outside]), side)[0] <= allowed:
            ends.append(outside)
            continue
        end = _pld._bisected_many(lambda xs, side=side: weights(xs, side, False) <= within, inside, outside, 32)
        if not weights(np.array([end]), side)[0] <= allowed:
            end = _pld._bisected_many(lambda xs, side=side: weights(xs, side) <= allowed, inside, outside, 32)
        ends.append(end)
    return ends[0], ends[1]


def _split_on(steps: tuple, direction: str, delta: float, h: float, ends: tuple, scale: float, dtype,
              points: int = _MAX_POINTS, blocks: tuple | None = None, before: tuple | None = None):
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
    and no transform spans a tail.

    ``blocks`` (one run): the losses its bulk spans, put on two scales (:mod:`.twoscale`),
    the split on the coarse grid; :data:`_TOO_WIDE` where that is not worth it or does
    not fit. An answer comes with the window of the term with no tail step, ``(ends,
    width, h)`` (width 0 on two scales); ``before``: a coarser scale's
    (:func:`_known_too_wide`)."""
    two = _two_scales(steps, direction, delta, h, ends, scale, blocks) if blocks else None
    if blocks and two is None:
        return _TOO_WIDE
    h = h if two is None else two.spacing
    bottoms, lows, highs, tops = _bulk_span(steps, direction, delta, h, ends)
    if ends == (None, None):
        return _whole(steps, direction, delta, h, bottoms, tops, dtype, points)  # (no window for the next scale)
    step = scale * _TAIL_STEP  # the tails' finest bin
    if any(high <= low for low, high in zip(lows, highs)):
        return None
    if any(high - low > points for low, high in zip(lows, highs)) or (
            two is None and _known_too_wide(before, ends, h, points)):
        return _TOO_WIDE
    bulks = (_bulks(steps, direction, h, (bottoms, lows, highs, tops), step) if two is None
             else [_twoscale.bulk(two, steps[0], direction, (lows[0], highs[0], lows[0] > bottoms[0], highs[0] < tops[0]),
                                  step, delta)])
    if any(bulk is None for bulk in bulks):
        return _TOO_WIDE
    transforms: dict = {}
    alone, terms = _alone_and_tails(steps, direction, bulks, (bottoms, lows, highs, tops),
                                    (h, delta, dtype, transforms, points), scale)
    if alone is None or terms is None:
        return _TOO_WIDE
    readers, log_finite, weight = terms
    if weight * weight / 2.0 > _SPILL_SHARE * delta:
        return None  # the bins spill the bulk into the tails: see _SPILL_SHARE
    # (blocks: what their windows send to +inf, in the product alone and in each tail's profile)
    infinite = math.fsum(bulk.infinite for bulk in bulks if isinstance(bulk, _twoscale.Bulk)) * (1.0 + weight)
    constant = (-math.expm1(log_finite) + weight * weight / 2.0 + infinite) * (1.0 + 1e-12)
    found = _invert(alone, readers, constant, delta)
    if found is not None and (found[1] or two is not None) and readers:  # (on two scales the retilt is cheap)
        found = _retilted(found, alone, readers, constant, delta, (h, dtype, transforms, points))
    return None if found is None else (*found, (ends, alone.width if two is None else 0.0, h))


#: :func:`_alone_and_tails` composes many runs' profile and reads their tails side by side
#: from this many bulk points on.
_BESIDE_BULK_POINTS = 2**20


def _alone_and_tails(steps: tuple, direction: str, bulks: list, ends: tuple, grid: tuple, scale: float) -> tuple:
    """For :func:`_split_on`: ``(alone, terms)``, the profile of the term with no tail step
    (:func:`_term_profile`) and :func:`_tail_terms`, side by side where another thread is
    free (:func:`~dpoptim.accounting.pld._beside`): neither needs the other (the tails are
    not read where ``alone`` is None: its window does not fit). They share
    ``transforms``, where a transform both ask for at once is computed twice, to the same
    values. ``ends``: ``(bottoms, lows, highs, tops)``, grid indices per run; ``grid``:
    ``(h, delta, dtype, transforms, points)``.

    Where one direction's split runs on the accounting thread while the caller, done with
    the other, waits for it (sigma 0.565, q 1.4e-5 over 10^8 steps, delta 8.9e-11: two
    profiles of 0.15 to 0.19 s each), the caller reads the tails meanwhile. For many
    runs only where their bulks hold :data:`_BESIDE_BULK_POINTS` points or more: on
    fewer, the profiles are sums over many small arrays, mostly Python, and side by side
    each thread waits for the interpreter lock (a schedule of 245 pairs, split in 128
    groups: 1.34 s against 1.10 s one after the other), while 128 bulks of 17,000 points
    (10^4 one-step pairs at tiny q, on their finest bins) took 0.97 s against 1.06 s."""
    h, delta, dtype, transforms, points = grid
    bottoms, lows, highs, tops = ends
    tailed = sum(1 for r in range(len(steps)) if lows[r] > bottoms[r] or highs[r] < tops[r])

    def tails():
        shared = (_term_profile(_factors(bulks), h, delta, dtype, 0.0, transforms, points)
                  if tailed > _OWN_PROFILES else None)
        return _tail_terms(steps, direction, bulks, ends, grid, shared, scale)

    def alone():
        return _term_profile(_factors(bulks), h, delta, dtype, transforms=transforms, points=points)

    if len(steps) > 1 and sum(bulk[1].size for bulk in bulks) < _BESIDE_BULK_POINTS:  # (see above)
        first = alone()
        return first, None if first is None else tails()
    return _pld._beside(alone, tails, lambda first: first is not None)


def _known_too_wide(before: tuple | None, ends: tuple, h: float, points: int) -> bool:
    """Whether the window ``before`` (``(ends, width, h)``, a coarser scale's) of the same bulk
    ``ends`` would need over :data:`_WIDE_MARGIN` times ``points`` at bins ``h``, where that
    is below :data:`_MAX_POINTS`."""
    return before is not None and before[0] == ends and points < _MAX_POINTS and before[1] > _WIDE_MARGIN * points * h


def _tail_terms(steps: tuple, direction: str, bulks: list, ends: tuple, grid: tuple, shared, scale: float):
    """For :func:`_split_on`: ``(readers, log_finite, weight)``, the tailed runs' :class:`_Tail`
    (each run's read against its profile of the other steps, or, where ``shared`` (all
    the bulks' profile) is given, all of them in one reader against its bound), the log
    of the chance that no step's loss is infinite, and the tails' weight :math:`\\sum_r
    c_r |t_r|`; None where a profile's window is too wide. ``ends``: ``(bottoms, lows,
    highs, tops)``, grid indices per run; ``grid``: ``(h, delta, dtype, transforms, points)``.
    Every run's tails are discretised at once (:func:`~dpoptim.accounting.pld._dots_of_steps`)."""
    bottoms, lows, highs, tops = ends
    h, step = grid[0], scale * _TAIL_STEP
    planned, asked = [], []
    for r, (sigma, q, count) in enumerate(steps):
        if lows[r] <= bottoms[r] and highs[r] >= tops[r]:  # the run lies wholly in the bulk: no term of its own
            planned.append((r, None, None))
            asked.append((sigma, q, np.arange(lows[r], highs[r] + 1) * h, False))
            continue
        reader = _others_profile(bulks, r, shared, grid)
        others, profile, shift, _ = reader
        if profile is None:
            return None
        bottom = float(profile.losses[0]) if shift is None else float(profile.losses[0] - shift)
        reach = float(profile.losses[-1] - profile.losses[0]) + 2.0 * scale
        points = _tail_grids(h, (bottoms[r], lows[r], highs[r], tops[r]), step, (reach, 2.0 * scale - bottom),
                             grid[4] * _TAIL_POINTS)
        planned.append((r, reader, points))
        asked.extend([(sigma, q, points[0], True)] if points[0] is not None else [])
        asked.append((sigma, q, points[1], False))
    found = iter(_pld._dots_of_steps(asked, direction) if asked else [])
    readers, parts, log_finite, weight = [], [], 0.0, 0.0
    for r, reader, points in planned:
        count = steps[r][2]
        if reader is None:
            log_finite += count * math.log1p(-next(found)[1])
            continue
        others, profile, shift, share = reader
        losses, masses, p_inf = _tails(points, [next(found) for _ in range(1 + (points[0] is not None))],
                                       highs[r] < tops[r])
        if shift is None:
            readers.append(_Tail([(count, masses, losses, None)], profile, others))
        else:
            parts.append((count / share, masses, losses, shift))
        weight += count * float(masses.sum())
        log_finite += count * math.log1p(-p_inf)
    if parts:
        readers.append(_Tail(parts, shared, bulks))
    return readers, log_finite, weight


def _others_profile(bulks: list, r: int, shared: _Profile | None, grid: tuple) -> tuple:
    """For :func:`_split_on`: ``(others, profile, shift, share)``, the factors of the other
    steps of run ``r`` and their untilted profile ``D`` (None: the window is too wide;
    ``shift`` None), or, where ``shared`` (all the bulks' profile) is given, the bound on
    ``D`` it gives: all the bulks and their profile, read ``shift`` higher and ``1 / share``
    times (:func:`_jensen_shift`). ``grid``: ``(h, delta, dtype, transforms, points)``."""
    h, delta, dtype, transforms, points = grid
    if shared is not None:
        shift, share = _jensen_shift(bulks[r], h)
        return bulks, shared, shift, share
    others = _factors(bulks, r)
    others = others or [(0, _NOTHING, 1)]  # one step in all: its tail alone
    return others, _term_profile(others, h, delta, dtype, 0.0, transforms, points), None, 1.0


def _factors(bulks: list, r: int | None = None) -> list:
    """The factors ``(first, masses, count)`` of the product of ``bulks`` (each a factor or a
    :class:`~dpoptim.accounting.twoscale.Bulk`), with one step of run ``r`` fewer where given."""
    out = []
    for s, bulk in enumerate(bulks):
        if isinstance(bulk, _twoscale.Bulk):
            out.extend(bulk.fewer if s == r else bulk.factors)
        elif bulk[2] - (s == r):
            out.append((bulk[0], bulk[1], bulk[2] - (s == r)))
    return out


def _two_scales(steps: tuple, direction: str, delta: float, h: float, ends: tuple, scale: float, span: tuple):
    """The plan of :mod:`.twoscale` for the bulk of a ledger of one run on fine bins ``h``,
    spanning the losses ``span``, or None (also where ``ends``, ``(floor, cut)``, split
    off no tail)."""
    if len(steps) != 1 or ends == (None, None):
        return None
    return _twoscale.plan(steps[0], direction, h, span, scale, (_SPREAD_SHARE * scale) ** 2, delta)


def _retilted(found: tuple, alone: _Profile, readers: list, constant: float, delta: float, grid: tuple) -> tuple:
    """:func:`_split_on`'s answer ``found``, where rounding decides it, or the answer with
    each tail's profile D also composed at a tilt, if smaller.

    The tails read D from its body up into its upper tail, where the untilted
    transform's rounding can be most of delta (sigma 0.661, q 1e-6, 10^8 steps, delta
    1e-12: 0.2268 against 0.2249). Composed again on the window of the level it is read
    at there, delta over the tail's mass (the wrap-around share of that window, times
    the mass, is the same share of delta), at the tilt of the term with no tail step
    (whose steps' transforms it shares where the windows agree: the level's own Chernoff
    tilt gave the same values over 20 random runs of 10^8 steps, a fifth slower), it
    bounds the same profile: each reading takes the smaller of the two bounds. ``grid``:
    ``(h, dtype, transforms, points)`` of the split."""
    h, dtype, transforms, points = grid
    for reader in readers:
        # the level of its heaviest run: for runs read against one profile of all the bulks,
        # the widest window (what wraps around is then the smallest share of each run's)
        level = delta / reader.heaviest if reader.heaviest > 0.0 else math.inf
        if level < 0.5:
            reader.tilted = _term_profile(reader.others, h, level, dtype, alone.tilt, transforms, points)
    again = _invert(alone, readers, constant, delta)
    return found if again is None or not again[0] < found[0] else again


def _bulks(steps: tuple, direction: str, h: float, ends: tuple, step: float) -> list:
    """Each run's bulk factor ``(low, masses, count)``: one step's connect-the-dots masses at
    grid points ``low .. high`` (of spacing ``h``; ``ends``: ``(bottoms, lows, highs,
    tops)``, grid indices per run) where the grid goes on ``step`` below and above into
    the tails where the run has them, whose points those are; a side without a tail ends
    the grid there, as :func:`~dpoptim.accounting.pld._grid_distribution` does (its mass
    at +inf is the tail's, :func:`_tails`, or where there is no upper tail, accounted
    there too). All runs discretised at once (:func:`~dpoptim.accounting.pld._dots_of_steps`)."""
    asked = []
    for (sigma, q, _), bottom, low, high, top in zip(steps, *ends):
        below, above = low > bottom, high < top
        points = np.arange(low, high + 1) * h
        points = np.concatenate([[low * h - step] if below else [], points, [high * h + step] if above else []])
        asked.append((sigma, q, points, above))  # (no tail above: :func:`_tails` counts its +inf)
    found = _pld._dots_of_steps(asked, direction)
    return [(low, masses[int(low > bottom): masses.size - int(high < top)], count)
            for (_, _, count), (masses, _), bottom, low, high, top in zip(steps, found, *ends)]


def _tail_grids(h: float, grid: tuple, step: float, reach: tuple, most: float = math.inf) -> tuple:
    """``(below, above)``: the points :func:`_tails` discretises one step on for its tails
    below grid point ``low`` and above ``high`` (``grid = (bottom, low, high, top)``, the
    step's own ends ``bottom`` and ``top``): below, the lower tail's points and ``low``
    (None without a lower tail); above, ``high`` and the upper tail's points, or without
    an upper tail the bulk's points, which give the mass at +inf. The points lie ``step``
    apart near the bulk, then farther apart (:func:`_tail_points`); ``reach = (below,
    above)``: how far below the floor the points stay ``step`` apart (the bulk profile's
    width), and up to which loss above the cut."""
    bottom, low, high, top = grid
    below = low * h - _tail_points(0.0, step, reach[0], (low - bottom) * h, most)[::-1] if low > bottom else None
    if high < top:
        return below, _tail_points(high * h, step, max(reach[1], high * h + step), top * h, most)
    return below, np.arange(low, high + 1) * h


def _tails(points: tuple, found: list, upper: bool) -> tuple:
    """``(losses, masses, p_inf)``: one step's tails and its mass at +inf, from the points of
    :func:`_tail_grids` and their connect-the-dots ``found`` (the lower tail's first, where
    it has one; ``upper``: whether it has an upper tail)."""
    below, _ = points
    losses, masses = [], []
    if below is not None:
        losses.append(below[:-1])
        masses.append(found[0][0][:-1])
    part, p_inf = found[-1]
    if upper:
        losses.append(points[1][1:])
        masses.append(part[1:])
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


#: The tails' finest bin (:func:`_tail_points`), as a share of epsilon's scale: no finer
#: than the bulk's coarsest bin (:func:`finest_spacing`). Connect-the-dots raises a tail
#: loss by less than a bin, so epsilon by less than this share of its scale; over 210
#: ledgers (30 schedules of 20 to 2,000 pairs at q 1e-6 to 1e-3, and 180 of the audit's
#: draws) bins of 2^-10 moved 40 values by 2e-5 of themselves at most, either way, against
#: bins of 2^-12, and the schedules took 40 s instead of 49 s (10^4 one-step pairs at q
#: 1e-4 to 1e-5: 4.0 s instead of 5.4 s), each tail a quarter of the points to bound and read.
_TAIL_STEP = 2.0**-10

#: A tail's points near the bulk (:func:`_tail_points`) number at most this share of the
#: split's window: at a quarter, the tails' bounds and readings cost no more than the
#: bulk's composition.
_TAIL_POINTS = 0.25


#: Beyond the points ``step`` apart, each gap of a tail's grid (:func:`_tail_points`) is
#: this share of the distance past them wider than the one before. There a tail loss is
#: read where the profile of the other steps takes every entry, and its position only
#: weighs through :math:`e^{\varepsilon - l}`: over 271 ledgers (the benchmark's, 60 audit
#: draws of seed 2, 40 single runs where a rare loss decides, six tiny-q schedules, and
#: 140 where tiny sigma meets tiny q) gaps doubling from one point to the next moved no
#: epsilon by more than 1e-8 of itself, either way (the readings' rounding allowance
#: counts the points). At 2^-11 the far points outnumbered the near ones (2.4 of 3.0
#: million for 200 one-step pairs at q 1e-4 to 1e-5); at 2^-8 they are a fifth as many,
#: and 150 such pairs take 1.5 to 1.8 s instead of 2.1 to 2.5 s.
_FAR_GROWTH = 2.0**-8


def _tail_points(a: float, step: float, start: float, top: float, most: float = math.inf) -> np.ndarray:
    """A tail's grid: ``a``, then points ``step`` apart up to ``start``, then gaps growing by
    a :data:`_FAR_GROWTH` share of the distance beyond ``start``, up to ``top``. Above
    ``start`` a tail loss ``d`` beyond where it could matter (epsilon less the bulk's lowest
    loss) costs at most its gap times :math:`e^{-d}`: a :data:`_FAR_GROWTH` share at most.

    Where more than ``most`` points ``step`` apart would reach ``start``, the gaps after
    the first (the bulk's, :func:`_bulks`) are the smallest power-of-two multiple of
    ``step`` that reaches it in at most ``most``, and the far gaps grow from that.
    Connect-the-dots on any increasing points dominates the step (Doroshenko et al. 2022,
    :func:`~dpoptim.accounting.pld._thinned_points`): only tightness depends on them.
    Where the profile a lower tail is read against is wide (addition at tiny q and a
    large delta: sigma 0.476, q 4.6e-6, 6.2*10^6 steps, delta 0.04), bins of 2^-12 of
    epsilon across it took 8.4*10^6 to 3.4*10^7 points, and an evaluation 15 to 115 s."""
    wide, span = step, min(start, top) - a
    while wide < span and math.ceil((span - step) / wide) + 1 > most:
        wide *= 2.0
    count = max(math.ceil((span - step) / wide), 0)
    fine = a + np.concatenate([[0.0], step + wide * np.arange(0.0, count + 1)])
    if fine[-1] >= top:
        return np.append(fine[fine < top], top)
    ratio = 1.0 + _FAR_GROWTH
    count = math.ceil(math.log1p((top - fine[-1]) / wide * (ratio - 1.0)) / math.log(ratio))
    far = fine[-1] + wide * np.expm1(np.arange(1, count + 1) * math.log(ratio)) / (ratio - 1.0)
    return np.concatenate([fine, far[far < top], [top]])


class _Profile:
    """A composed product of bulks on its window, read at any losses: the exact profile of
    its grid distribution, plus the rounding allowance of the entries above the point and
    the wrap-around bound, and never above its total mass (which bounds any profile)
    (:meth:`at`); or, for lower bounds, less all of those (:meth:`floor_at`). ``below``:
    a bound on the composed mass below the window, which wraps to its top."""

    def __init__(self, tilted: np.ndarray, log_untilt: np.ndarray, losses: np.ndarray, noise: tuple,
                 wrap: float, mass: float, below: float = 0.0, tilt: float = 0.0, wrapped_in: tuple | None = None,
                 width: float = 0.0):
        self.losses, self.noise, self.wrap, self.mass, self.below = losses, noise, wrap, mass, below
        self.width = width  # the Chernoff window's, before it is rounded up to a power of two
        self.tilt, self.wrapped_in = tilt, wrapped_in  # wrapped_in: see _wrapped_in
        n = losses.size
        self.spacing = float(losses[-1] - losses[0]) / (n - 1)
        valid = log_untilt <= 300.0  # beyond, a mass would exceed 1: uncertifiable there
        self.first_valid = int(np.argmax(valid)) if valid.any() else n
        size = n - self.first_valid
        masses = np.zeros(n)
        if size:
            start = float(log_untilt[self.first_valid])
            slope = float(log_untilt[-1] - start) / max(size - 1, 1)
            masses[self.first_valid:] = tilted[self.first_valid:] * _pld._exp_linear(start, slope, size)
        self.decay = float(log_untilt[0] - log_untilt[1]) if n > 1 else 0.0
        # Position i + 1 holds the sums over entries j > i, for i = -1 .. n - 1.
        self.above = _sums_from(masses)
        self.discounted, self.reference = _discounted(masses, losses, self.first_valid)
        self.log_untilt = np.concatenate([[log_untilt[0] + self.decay], log_untilt])

    def log_discounted(self, index) -> np.ndarray:
        """log of the sums over ``j >= index`` of ``m_j e^{-l_j}`` (-inf where none is above
        0), for ``index`` from 0 to n (:func:`_discounted`)."""
        values = self.discounted[index]
        if self.reference is None:
            return values
        with np.errstate(divide="ignore"):
            return np.log(values) - self.reference

    def at(self, points: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(profile, allowance)`` at each of ``points``: the sum over entries above it of
        ``m_j (1 - e^{x - l_j})`` with the bounds above (at most the total mass), and the
        rounding allowance in it."""
        n = self.losses.size
        i = self._below(points)
        allowance, above, subtract, summing = self._sums(points, i)
        value = self.wrap + allowance + np.maximum(above - subtract, 0.0) + summing
        valid = (i >= self.first_valid) | ((i == -1) & (self.first_valid == 0))
        value = np.where(valid & (value == value), value, math.inf)
        value = np.where(i >= n - 1, self.wrap, value)
        capped = value >= self.mass
        return np.where(capped, self.mass, value), np.where(capped | (i >= n - 1), 0.0, allowance)

    def floor_at(self, points: np.ndarray) -> np.ndarray:
        """A lower bound on the exact profile at each of ``points``, for
        :mod:`.rare_lower`: the computed sum over the entries above the point less their
        rounding allowance, the sums' own rounding, the mass wrapped in from below the
        window and a bound on what wraps in from above it (:meth:`_wrapped_in`), and 0
        from the window's top on. Entries the tilt leaves uncertifiable count as 0, which
        only lowers it."""
        i = np.maximum(self._below(points), self.first_valid - 1)
        allowance, above, subtract, summing = self._sums(points, i)
        value = above - subtract - allowance - summing - self.below - self._wrapped_in(points)
        return np.where((i >= self.losses.size - 1) | ~(value > 0.0), 0.0, value)

    def _below(self, points: np.ndarray) -> np.ndarray:
        """The entry ``i`` with ``l_i < x <= l_{i+1}`` for each of ``points`` (-1 below the
        window, n - 1 above it; at ``x`` on a grid point either side will do: that entry
        adds 0 there)."""
        n = self.losses.size
        with np.errstate(invalid="ignore"):
            return np.clip(np.ceil((points - self.losses[0]) / self.spacing), 0, n).astype(np.int64) - 1

    def _sums(self, points: np.ndarray, i: np.ndarray) -> tuple:
        """``(allowance, above, subtract, summing)`` over the entries ``j > i``: their
        rounding allowance, the sums of ``m_j`` and of ``m_j e^{x - l_j}`` at ``x =
        points``, and a bound on those sums' own rounding."""
        n = self.losses.size
        allowance = _pld._allowances(self.noise, self.log_untilt[i + 1], self.decay, (n - 1 - i).astype(float))
        above, log_discounted = self.above[i + 1], self.log_discounted(i + 1)
        with np.errstate(over="ignore", invalid="ignore"):
            subtract = np.where(log_discounted > -np.inf, np.exp(points + log_discounted), 0.0)
        return allowance, above, subtract, 4.0 * (n + 4) * _pld._U * (above + subtract) + _SUBNORMAL

    def _wrapped_in(self, points: np.ndarray) -> np.ndarray:
        r"""A bound on the mass that wraps in from above the window and lands above each of
        ``points``. What lands ``k`` window widths ``w`` lower came from losses above ``x +
        k w``, and the tilt ``t`` untilts it :math:`e^{t k w}` times too heavy, so by
        Chernoff at any order :math:`\lambda > t` it is at most :math:`\sum_{k \ge 1}
        e^{K(\lambda) - \lambda (x + k w) + t k w} = e^{K(\lambda) - \lambda x}\, g /
        (1 - g)` with :math:`g = e^{-(\lambda - t) w}`; ``x`` no lower than the window's
        bottom (all of it lands above that). Not capped at 1: untilted, the wrapped mass
        can outweigh any true one (a tilted body beyond the window, as at sigma 0.035, q
        0.0126 over 2000 steps: 10^126), and orders at or below the tilt bound nothing."""
        if self.wrapped_in is None:
            return np.zeros_like(points)
        tilt, width, lambdas, cgf = self.wrapped_in
        lowest = np.maximum(np.atleast_1d(points), self.losses[0])
        gaps = (lambdas - tilt) * width
        useful = gaps > 0.0
        if not useful.any():
            return np.full(np.shape(points), math.inf)
        log_series = -gaps[useful] - np.log(-np.expm1(-gaps[useful]))
        exponents = (cgf[useful, None] + log_series[:, None] - lambdas[useful, None] * lowest[None, :]).min(axis=0)
        with np.errstate(over="ignore"):
            return (np.exp(exponents) * (1.0 + 1e-9)).reshape(np.shape(points))


#: Covers the sums' subnormal terms (each off by at most 2^-1074 times e^300, see
#: :func:`_discounted`) over any window, in the profile's rounding allowance.
_SUBNORMAL = 1e-150


def _sums_from(values: np.ndarray) -> np.ndarray:
    """``out[k]``: the sum of ``values[j]`` over ``j >= k``, for ``k = 0 .. n`` (one pass)."""
    out = np.empty(values.size + 1)
    out[-1] = 0.0
    np.cumsum(values[::-1], out=out[-2::-1])
    return out


def _discounted(masses: np.ndarray, losses: np.ndarray, first_valid: int) -> tuple:
    """``(sums, reference)``: the sums over ``j >= k`` of ``m_j e^{-l_j}``, for ``k = 0 ..
    n``, as ``e^{-reference}`` times ``sums[k]`` (their logarithm, with ``reference``
    None). Within 300 of the lowest valid loss they are summed as ``m_j e^{r - l_j}`` (a
    subnormal term errs by at most 2^-1074, e^300 times that once scaled back); over a
    wider window in log space, where those terms would underflow wholly or to a few bits
    (q = 1 at sigma 0.5 over 1076 steps: a window 1024 wide, whose sums underflowed to
    1e-319 and lost a part in 10^5 of the profile). Only the entries from ``first_valid``
    on hold mass."""
    n = losses.size
    start = min(first_valid, n - 1)
    reference = float(losses[start])
    with np.errstate(under="ignore", divide="ignore"):
        if float(losses[-1]) - reference <= 300.0:
            weighted = np.zeros(n)
            spacing = float(losses[-1] - losses[0]) / max(n - 1, 1)
            weighted[start:] = masses[start:] * _pld._exp_linear(0.0, -spacing, n - start)
            return _sums_from(weighted), reference
        inclusive = np.logaddexp.accumulate((np.log(masses) - losses)[::-1])[::-1]
    return np.concatenate([inclusive, [-np.inf]]), None


def _term_profile(factors: list, h: float, delta: float, dtype, tilt: float | None = None,
                  transforms: dict | None = None, points: int = _MAX_POINTS, offset: float = 0.0,
                  aim: float | None = None) -> _Profile | None:
    """The profile of the product of ``factors`` (``(first, masses, count)`` each, on
    spacing ``h``), composed on a window certified by Chernoff bounds from their exact
    moment generating functions (at most a 2^-16 share of ``delta`` beyond it), at
    ``tilt`` (None: the Chernoff-optimal one at ``delta``, capped against wrap-around;
    or, given the loss ``aim`` it will be read at, the one that centres the tilted
    distribution there), or None where the window needs more than ``points`` points.
    ``offset``: added to the composed losses (the factors' grids sit that far above
    ``k h`` in all)."""
    kept = {} if transforms is None else transforms
    cgf = sum(count * _factor_log_mgf(first, masses, h, kept) for first, masses, count in factors)
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
    if tilt is None and aim is not None:  # argmin of cgf(lambda) - lambda x, on the quarter-octave lattice
        tilt = 2.0 ** (math.floor(4.0 * math.log2(float(_LAMBDAS[np.argmin(up - _LAMBDAS * (aim - offset))]))) / 4.0)
    if tilt is None:
        tilt = _pld._choose_tilt(_LAMBDAS, up - log_mass, n * h, min(delta * math.exp(-log_mass), 0.5))
    tilted, log_untilt, noise = _composed(factors, h, i_low, n, tilt, dtype, kept)
    # composed mass at or below (i_low - 1) h, by the same Chernoff bounds
    below = 0.0 if i_low <= lowest else math.exp(min(float((down + _LAMBDAS * (i_low - 1) * h).min()), 0.0))
    # what lies above the window, for the lower bounds (none where the window holds it all)
    above_window = (tilt, n * h, _LAMBDAS, up + _LAMBDAS * offset) if i_low + n <= highest else None
    return _Profile(tilted, log_untilt, (i_low + np.arange(n)) * h + offset, noise, wrap, math.exp(log_mass), below,
                    tilt, above_window, (i_top - i_low + 2) * h)


#: The orders of :func:`_term_profile`'s Chernoff bounds, both signs and 0 (in the middle).
_SIGNED_LAMBDAS = np.concatenate([-_LAMBDAS[::-1], [0.0], _LAMBDAS])


def _factor_log_mgf(first: int, masses: np.ndarray, h: float, kept: dict) -> np.ndarray:
    """:func:`~dpoptim.accounting.pld._log_mgf` of one factor at :data:`_SIGNED_LAMBDAS`,
    kept in ``kept`` (a split's ``transforms``) beside its masses, so that their ``id`` is
    not reused while the entry lives. Each tailed run's profile of the other steps sums
    the same factors again: 100 runs of one step spent 0.9 s of a 1.2 s call on them."""
    key = ("log_mgf", id(masses), first, h)
    if key not in kept:
        kept[key] = (masses, _pld._log_mgf(first, masses, h, _SIGNED_LAMBDAS))
    return kept[key][1]


def _composed(factors: list, h: float, i_low: int, n: int, tilt: float, dtype, transforms: dict) -> tuple:
    """``(tilted, log_untilt, noise)`` of a product on the window ``i_low .. i_low + n - 1``:
    the composed tilted masses, the exponents that undo the tilt, and the bounds of
    :func:`~dpoptim.accounting.pld._rounding_allowance` (weights: the product of all factors
    but one of each, as there). ``transforms`` keeps the factors' transforms for the
    other products of the same split."""
    log_modulus = angle = 0.0
    log_scale, log_weight = 0.0, 0.0
    _transform_missing(factors, h, n, tilt, dtype, transforms)
    for first, masses, count in factors:
        spectrum, log_abs, log_mgf = transforms[(id(masses), first, tilt, n)]
        log_modulus = log_modulus + count * log_abs
        angle = angle + _pld._reduced_angles(spectrum.real, spectrum.imag, count)
        # (a factor taken once adds nothing: 0 times a log of 0 would be nan)
        log_weight = log_weight + ((count - 1) * log_abs.astype(np.float64) if count > 1 else np.zeros(log_abs.shape))
        log_scale += count * log_mgf
    spectrum = _pld._polar(log_modulus, angle)
    composed = np.fft.irfft(spectrum, n)
    tilted, shift = np.empty(n), i_low % n  # rolled to start at i_low, in float64, negatives set to 0
    tilted[: n - shift], tilted[n - shift:] = composed[shift:], composed[:shift]
    np.maximum(tilted, 0.0, out=tilted)
    log_untilt = log_scale - tilt * (i_low + np.arange(n)) * h
    unit = float(np.finfo(dtype).eps) / 2
    total_steps = sum(count for _, _, count in factors)
    with np.errstate(under="ignore"):
        noise = _pld._rounding_allowance(n, total_steps, np.exp(log_weight), np.abs(spectrum).astype(np.float64),
                                         unit)
    return tilted, log_untilt, noise


def _transform_missing(factors: list, h: float, n: int, tilt: float, dtype, transforms: dict) -> None:
    """Put into ``transforms`` the tilted spectrum, its log modulus and the log MGF of each
    factor not there yet, keyed by its array's ``id`` (the arrays live as long as
    ``transforms``), the grid size and the tilt; in batches of rows, one 2-D transform each
    (a run's profile of the other steps has a factor per run: 100 runs of one step
    spent 1.7 s of 2.7 s transforming them one by one)."""
    missing, seen = [], set()
    for first, masses, _ in factors:
        key = (id(masses), first, tilt, n)
        if key not in transforms and key not in seen:
            seen.add(key)
            missing.append((key, _pld._tilted(first, masses, 0.0, h, tilt)))
    rows = max(1, _pld._BATCH_POINTS // n)
    for start in range(0, len(missing), rows):
        batch = missing[start:start + rows]
        # (a new array per batch, whose rows are kept: copying each row out of the thread's
        # buffers took as long as the transforms)
        spectra = _pld._placed_transform([(first, values) for _, (first, values, _, _) in batch], n, dtype,
                                         fresh=True)
        with np.errstate(divide="ignore"):
            log_abs = np.log(np.abs(spectra))
        for (key, (_, _, _, log_mgf)), spectrum, row in zip(batch, spectra, log_abs):
            transforms[key] = (spectrum, row, log_mgf)


#: Above this many runs with tails of their own, the split bounds each run's profile of
#: the other steps by one profile of all the bulks (:func:`_jensen_shift`), not one of its own.
_OWN_PROFILES = 8


def _jensen_shift(bulk: tuple, h: float) -> tuple[float, float]:
    r"""``(f, m)`` for one step's ``bulk`` ``(first, masses, count)`` on spacing ``h``: a lower
    bound ``m`` on its mass and ``f`` at most :math:`-\log(\sum_j b_j e^{-l_j} / m)`, so
    that every run's profile of the other steps is bounded by one profile of all the bulks:
    :math:`\delta_D(x) \le \delta_B(x + f) / m`.

    With ``B`` the product of all the bulks and ``D`` that of all but one step of the
    run, ``B = D * b``. The profile :math:`\delta_D(x) = \sum_k D_k (1 - u e^{-l_k})_+`
    with :math:`u = e^x` is convex in ``u`` (a sum of maxima of affine functions), so by
    Jensen, with the bulk normalised to mass 1,
    :math:`\delta_B(y) = m \sum_j (b_j / m)\, \delta_D(y - l_j) \ge m\, \delta_D(y - f)`
    for :math:`e^{-f} = \sum_j b_j e^{-l_j} / m`; a smaller ``f`` only raises
    :math:`\delta_B(x + f)`, which never rises with its argument. For a step's bulk
    ``f`` is near 0 (the bulk's Q-mass over its P-mass), where the step's lowest loss
    (about ``-q``) shifted the profile by as much again as the answer's bin at q 5e-5.
    Composing one ``D`` per run instead cost a transform of the whole bulk each (64 runs
    at q 2.1e-5: 7.4 s, now 1.1 s)."""
    first, masses, _ = bulk
    losses = (first + np.arange(masses.size)) * h
    mass = float(np.sum(masses))
    reference = float(losses[0])
    discounted = float(np.sum(masses * np.exp(reference - losses)))  # sum_j b_j e^{-(l_j - l_0)}
    shift = reference - math.log(discounted / mass)
    # sums of n nonnegative terms, in any order, err by at most (n - 1) round-offs of the
    # sum; each term by a few more, the quotient and its logarithm by one each
    rounding = 1e-12 + 4.0 * (masses.size + 4) * _pld._U
    return shift - rounding * (1.0 + abs(shift)), mass * (1.0 - rounding)


class _Tail:
    """Tails read against one untilted profile ``D``: :math:`\\sum_j t_j D(\\varepsilon - l_j)`.
    Either one run's, against its profile of the other steps' bulks (its ``count`` times),
    or those of every tailed run at once, against one profile of all the bulks that bounds
    each run's (:func:`_jensen_shift`): run ``r``'s losses are then read ``f_r`` higher
    (its shift, taken off its losses) and its masses ``c_r / m_r`` times, so that one
    reading of the merged, sorted losses serves all the runs (128 runs read one by one
    spent 0.55 s of a 3.9 s call on Python around small arrays). Only the tail points
    whose ``epsilon - l_j`` falls in D's window are read one by one; below it ``D`` has a
    closed form (every entry counts), summed at once from suffix sums over the tail, and
    above it only the wrap-around bound is left. ``parts``: ``(count, masses, losses,
    shift)`` per run (``shift`` None: ``profile`` is the run's own ``D``; one part then);
    ``others``: the factors of ``profile``, where it is composed again at a tilt
    (:func:`_retilted`)."""

    def __init__(self, parts: list, profile: _Profile, others: list):
        self.profile, self.others = profile, others
        self.tilted: _Profile | None = None  # D composed again at a tilt, where rounding decides (:func:`_retilted`)
        # the heaviest run's weight c_r |t_r|, which sets the level D is composed again at
        self.heaviest = max(count * float(masses.sum()) for count, masses, _, _ in parts)
        if len(parts) == 1 and parts[0][3] is None:
            self.count, masses, losses, _ = parts[0]
        else:
            self.count = 1.0
            losses = np.concatenate([losses - shift for _, _, losses, shift in parts])
            order = np.argsort(losses, kind="stable")
            losses, masses = losses[order], np.concatenate([count * masses for count, masses, _, _ in parts])[order]
        self.masses, self.losses = masses, losses
        self.low, self.high = float(profile.losses[0]), float(profile.losses[-1])
        self.offset = float(losses[0]) if losses.size else 0.0
        self.after = np.concatenate([np.cumsum(masses[::-1])[::-1], [0.0]])  # sum over j >= k of t_j
        with np.errstate(under="ignore"):
            scaled = masses * np.exp(self.offset - losses)  # t_j e^{-(l_j - offset)}, at most t_j
        self.after_scaled = np.concatenate([np.cumsum(scaled[::-1])[::-1], [0.0]])
        self.whole = profile if profile.first_valid == 0 else None  # untilted: every entry valid
        # the suffix sums and the sums over the points read, of nonnegative entries, err by
        # at most a round-off per entry
        self.rounding = 2.0 * (losses.size + 2) * _pld._U

    def read(self, epsilon: float) -> tuple[float, float]:
        """``(value, allowance)`` of these tails' term at ``epsilon``."""
        below = int(np.searchsorted(self.losses, epsilon - self.low, side="left")) if self.whole else self.losses.size
        beyond = min(int(np.searchsorted(self.losses, epsilon - self.high, side="left")), below)
        middle = slice(beyond, below)
        values, allowances = self.profile.at(epsilon - self.losses[middle])
        if self.tilted is not None:  # both bound the same profile: the smaller, point by point
            other, other_allowances = self.tilted.at(epsilon - self.losses[middle])
            smaller = other < values
            values, allowances = np.where(smaller, other, values), np.where(smaller, other_allowances, allowances)
        value = float(self.masses[middle] @ values)
        allowance = float(self.masses[middle] @ allowances)
        total = float(self.after[0])
        value += self.profile.wrap * (float(total - self.after[beyond]) + self.rounding * total)
        if below < self.losses.size:
            d = self.whole
            n = d.losses.size
            everything = float(_pld._allowances(d.noise, d.log_untilt[:1], d.decay, np.array([float(n)]))[0])
            scaled = float(self.after_scaled[below])  # 0 (underflow): none taken off
            log_discounted = float(d.log_discounted(0))
            with np.errstate(over="ignore"):
                subtract = (math.exp(epsilon - self.offset + log_discounted + math.log(scaled))
                            if scaled > 0 and log_discounted > -math.inf else 0.0)
            mass = float(self.after[below])
            summing = 4.0 * (n + 4) * _pld._U + _SUBNORMAL
            value += ((d.wrap + everything + float(d.above[0]) * (1.0 + summing)) * mass
                      - (1.0 - summing - self.rounding) * subtract)
            allowance += everything * mass
        return self.count * value * (1.0 + self.rounding), self.count * allowance


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
        # (1e-9: generously, beyond the readings' own rounding, :class:`_Tail`)
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
