r"""Composition in stages: one long run of a ``(sigma, q)`` pair on two small grids.

**Why.** Connect-the-dots (Doroshenko, Ghazi, Kamath, Kumar & Manurangsi 2022) raises the
mean of each composed loss by about :math:`h^2/8` on a grid of spacing ``h``, so after
``T`` steps epsilon moves up by about :math:`T h^2 / 8`; the window must hold a loss
spread over :math:`\sqrt T` times a step's. One grid for :math:`10^8` steps needs 2^20
points and still ends a few percent high where a step's loss is wide (sigma 4.4, q 0.033:
3,460 against a lower bound of 3,307). Here ``B`` steps are composed first on a fine grid
``h``, the block's distribution is moved once onto a coarse grid ``H = R h``, and the
``K = T // B`` blocks (and one of the ``T - K B`` left) are composed there. The mean
rises by about :math:`T h^2/8 + K H^2/8`; a block's window is :math:`\sqrt{T/B}` times
narrower than the run's, and with :math:`B = R^2 \approx \sqrt T` both grids hold a few
ten thousand points.

**Never optimistic.** ``delta(eps) = E[(1 - e^{eps - L})_+]``, losses of :math:`+\infty`
counting fully, is a positive linear functional of the loss measure and is non-increasing
in :math:`Y = e^{-L}` and convex in it. Composition convolves measures, i.e. multiplies
independent :math:`Y`s. Each operation below gives a measure whose composed ``delta`` is
at least the true one, for every epsilon (negative ones too, which further composition
reads):

1. *Raising masses pointwise* (the transform's error bound added to every entry, made
   non-negative): convolution of non-negative measures is monotone, and so is ``delta``.
2. *Moving mass to higher losses*, or to :math:`+\infty`: the sum of independent losses
   then only rises (first-order stochastic dominance), and ``delta`` is non-decreasing in
   the loss. The window is circular: mass above it (bounded by Chernoff) lands at its
   bottom and is counted at :math:`+\infty` besides; mass below it lands at its top,
   but read back through a positive tilt ``t`` it is multiplied by :math:`e^{-tW}`
   (``W`` the window's width), so its Chernoff bound is counted at :math:`+\infty` too.
3. *Connect-the-dots onto the coarse grid*: each atom at ``l`` between grid points
   ``a < l < b`` is split between them keeping its :math:`P`-mass and its
   :math:`E_P[Y]`, a mean-preserving spread of :math:`Y`. Conditioned on the other
   factors, the composed ``delta`` is the expectation of a convex function of this
   factor's :math:`Y` (a convex function of :math:`y c` for :math:`c > 0` is convex in
   ``y``), so by Jensen's inequality it does not fall; the share sent up is rounded up,
   which only adds move 2.

The steps themselves are the dominating connect-the-dots distributions of :mod:`.pld`
(their tails beyond ``delta / 2^18`` of the run cut: below, rounded up; above, sent to
:math:`+\infty`). The transforms run in extended precision on exponentially tilted
measures (tilting commutes with convolution, see :mod:`.pld`), so the error bound of
move 1 is small where ``delta`` is read. Only the add/remove pair of one direction is
composed here; the caller takes the larger direction and the minimum with the other
sound bounds. Where addition's stages do not fit, a Chernoff bound on its composed loss
(:func:`_chernoff_epsilon`) answers for it if it is below removal's answer.

**Tightness.** Each stage's mean shift is kept to :data:`_SHIFT_SHARE` of the RDP guess
and its bins to :data:`_BIN_OF_SPREAD` of the step's spread (its body's, which rare large
losses do not widen, and its tilted one's); the tilt minimises the Chernoff bound at the
guess, and each window is wide enough that what wraps around from above, multiplied by
:math:`e^{tW}` when read back, costs at most ``2^-10`` of delta or of a block's mass.
An answer far below the guess is planned again for itself. Where four times every error
bound would move the answer (a tilt far steeper than where delta is read: tiny q, whose
RDP guess can be five times epsilon), or the plan for the answer does not fit, the
answer does not settle it (:class:`Staged`): the caller composes on one grid too and
keeps each direction's smaller value, so that epsilon stays continuous where the stages
stop settling it. Where the stages do not fit at all (a step whose body is far narrower
than its tail is long, the split of :mod:`.rare`'s regime; epsilon above
:data:`_MAX_GUESS`), the caller's one grid answers, beside the stages of the nearest run
that dominates the one refused (:func:`dominating_runs`), so that epsilon does not fall
where the stages start to fit. Where only the second stage's window is too wide, its
blocks move onto a grid two or four times coarser (move 3 again).

**Floating point.** A radix-2 transform of ``n`` points errs by at most
:math:`\log_2(n)\,\eta\,\|y\|_2` in 2-norm, :math:`\eta \approx 6.7u` (Higham 2002,
"Accuracy and Stability of Numerical Algorithms", Theorem 24.2); :data:`_ETA_OF_U` takes
:math:`16u` and two more levels for the real transform. Spectra of measures of total
mass at most 1 have modulus at most 1, so a power ``k`` multiplies an entry's error by at
most :math:`e\,k` (while :math:`k \cdot` that error is below 1), and the polar power
itself errs by at most :math:`8 k u` per entry. The inverse transform divides the
2-norm by :math:`\sqrt n`, and an entry's error is at most the 2-norm (:func:`_fft_error`).
The first stage runs in extended precision (its error bounds add up over every block);
the second in double precision first, six times faster, and where four times its error
bounds would move the answer by more than :data:`_DOUBLE_SHARE` of it, again in extended
precision (the bound is the same with the smaller ``u``). Platforms whose ``longdouble``
is double precision get None (the one grid answers).
"""

from __future__ import annotations

import functools
import math
import threading
from typing import NamedTuple

import numpy as np

from . import pld as _pld
from .gaussian import central_limit_mu, gaussian_epsilon

#: Runs shorter than this are left to the one-grid composition of :mod:`.pld`.
MIN_STEPS = 2**20

#: Above this RDP guess (sigma near 0.3 over 10^8 steps) the stages' windows rarely fit,
#: and the one grid answers quickly.
_MAX_GUESS = 1e5

#: Four times the transform's error bound may move the answer by at most this share of
#: it, and the blocks' error bounds may multiply delta by at most one plus it.
_ERROR_SHARE = 2.0**-10

#: The second stage in double precision answers where four times its error bounds move
#: the answer by at most this share of it (an eighth of what extended precision may
#: leave; one error bound then moves it by about 4e-5 of it at most).
_DOUBLE_SHARE = _ERROR_SHARE / 8

#: Where removal's answer is below this share of the guess, it is planned again.
_REPLAN_SHARE = 0.25

#: Each stage's connect-the-dots mean shift, as a share of the guessed epsilon.
_SHIFT_SHARE = 2.0**-11

#: The largest fine bin, as a share of the tilted step loss's standard deviation.
_BIN_OF_SPREAD = 2.0**-5

#: Where a step's tail is too long for the grid, bins up to 2^this times coarser are tried.
_COARSER = 2

#: The most points of either grid; beyond, the stages give way to one grid.
_MAX_POINTS = 2**19

#: The share of delta each direction lets the mass beyond a window cost (both stages).
_WINDOW_SHARE = 2.0**-18

_EXTENDED = np.longdouble
_U = float(np.finfo(_EXTENDED).eps) / 2
#: A transform level's relative 2-norm error in units of the round-off (Higham's 6.7,
#: with room to spare).
_ETA_OF_U = 16.0

#: Powered spectrum entries below this are left 0 (:func:`_powered`).
_DROPPED = 2.0**-120
_LAMBDAS = np.concatenate([-np.geomspace(1e7, 1e-4, 45), np.geomspace(1e-4, 1e7, 45)])


class _Plan(NamedTuple):
    """Fine spacing ``h``, coarse spacing ``R h`` (blocks of ``R^2`` steps), the
    exponential ``tilt`` and the transforms' floating-point type."""

    h: float
    R: int
    tilt: float
    dtype: type = _EXTENDED


class _Block(NamedTuple):
    """A block's tilted measure on the coarse grid: entry ``i`` is at loss
    ``(first + i) H`` and holds ``exp(log_scale) * masses[i] * e^{-tilt (first + i) H}``
    of P-mass (at least the block's); ``p_inf`` bounds its mass at :math:`+\\infty`;
    ``bound``: the part of ``masses`` that is the transform's error bound (moved alike)."""

    first: int
    masses: np.ndarray
    log_scale: float
    p_inf: float
    bound: np.ndarray


class Staged(NamedTuple):
    """Each direction's epsilon by the stages (each a sound upper bound), and whether it
    settles the answer; where not (the transforms' error bounds decide it, or the bins
    were sized for a guess far above it), the caller also composes on one grid and keeps
    each direction's smaller value, so that switching between the two is continuous."""

    epsilons: dict
    settled: bool


def staged_epsilons(sigma: float, q: float, count: int, deltas: dict, guess: float, shift: float = 0.0,
                    min_steps: int = MIN_STEPS) -> Staged | None:
    """Each direction's epsilon (``deltas``: removal's and addition's delta) of ``count``
    steps of ``(sigma, q)``, composed in stages (:class:`Staged`), or None where the
    stages do not fit (a window above :data:`_MAX_POINTS`, as where rare large losses
    widen a block's, or no extended precision). ``guess``: an upper estimate of epsilon
    (the RDP bound; twice :func:`_central_limit_epsilon` where that is smaller), which
    sizes the grids and chooses the tilt; spacings are powers of two keyed by it, so that
    epsilon stays monotone. Where addition's stages do not fit, its
    :func:`_chernoff_epsilon` stands in, settling it if that plus ``shift`` (what the
    caller adds to it) is at most removal's, as only the larger is reported.
    ``min_steps``: shorter runs give None (tests use shorter ones)."""
    if count < min_steps or not 0.0 < q < 1.0 or not 0.0 < guess <= _MAX_GUESS or _U > 1e-18:
        return None
    guide = min(guess, 2.0 * _central_limit_epsilon(sigma, q, count, min(deltas.values()))) or guess
    found = _both_directions(sigma, q, count, deltas, guide, shift)
    if found is None and guide < guess:  # (bins sized for the guide do not fit: for the guess)
        found = _both_directions(sigma, q, count, deltas, guess, shift)
    else:
        guess = guide
    removal = None if found is None else found.epsilons[_pld._REMOVE]
    if found is None or not found.settled or removal >= _REPLAN_SHARE * guess or removal <= 0.0:
        return found  # (0 is exact)
    # Far below the guess, whose scale sized the bins (a mean shift of 2^-10 of it can be
    # a fifth of epsilon: 1.04e-4 against a lower bound of 8.6e-5 at sigma 1.13, q 2.1e-5,
    # 1.9e7 steps, delta 0.04): planned again for the answer; unsettled where that fails.
    again = _both_directions(sigma, q, count, deltas, removal, shift)
    if again is not None and again.settled and again.epsilons[_pld._REMOVE] >= _REPLAN_SHARE * removal:
        return again
    both = [answer for answer in (found, again) if answer is not None]
    return Staged({d: min(answer.epsilons[d] for answer in both) for d in found.epsilons}, False)


def dominating_runs(sigma: float, q: float, count: int, deltas: dict) -> list:
    """Runs ``(sigma', q', count')`` near one the stages refuse (or too short for them),
    each of which dominates it (more steps, a larger q or a smaller sigma: the run is a
    post-processing of each), for the caller to bound it by their stages too, keeping
    each direction's smaller value.

    The stages are tighter than one grid, so where they start to fit as epsilon grows
    (q up, sigma down, the steps past :data:`MIN_STEPS`) epsilon would fall by the
    grid's excess (0.39% as q grew by 0.05% at sigma 1, 10^8 steps, delta 1e-10). The
    nearest run on that side whose stages plan fits, within :data:`_NEIGHBOUR_BAND`
    (its boundary found by bisection), bounds every run just before it: epsilon then
    meets the stages' value continuously. Farther away epsilon has grown by more than
    the grid's excess, and the grid's answer is the smaller. Where epsilon grows faster
    than sigma falls (small sigma), the band ends where the RDP guess has grown by
    :data:`_NEIGHBOUR_RISE` (:func:`_within_rise`): sigma 0.173, q 1.2e-5, 10^8 steps,
    delta 6.6e-9 searched 0.35 s for the plan's boundary 1.3% below, whose stages then
    answered 8,061 in 0.23 s, 6% above the grid's 7,575."""
    if count < MIN_STEPS:
        return [(sigma, q, MIN_STEPS)] if count >= _NEAR_MIN_STEPS * MIN_STEPS else []
    if _plans(sigma, q, count, deltas):
        return []  # refused past the plan: no boundary of the plan's to meet
    runs, delta = [], min(deltas.values())
    guess = _pld._rdp_guess(((sigma, q, count),), delta)
    top = min(q * _NEIGHBOUR_BAND, 0.5 * (1.0 + q))
    top = _within_rise(lambda x: _pld._rdp_guess(((sigma, x, count),), delta), q, top, guess)
    if q < 1.0 and _plans(sigma, top, count, deltas):
        runs.append((sigma, _boundary(lambda x: _plans(sigma, x, count, deltas), q, top), count))
    bottom = _within_rise(lambda x: _pld._rdp_guess(((x, q, count),), delta), sigma, sigma / _NEIGHBOUR_BAND, guess)
    if _plans(bottom, q, count, deltas):
        runs.append((_boundary(lambda x: _plans(x, q, count, deltas), sigma, bottom), q, count))
    return runs


#: How far :func:`dominating_runs` looks (a factor on q or sigma): epsilon grows by at
#: least about as much, more than one grid's excess over the stages.
_NEIGHBOUR_BAND = 1.02

#: ... and no farther than where the RDP guess has grown by this factor (:func:`_within_rise`).
_NEIGHBOUR_RISE = 1.04


def _within_rise(guess_at, start: float, edge: float, guess: float) -> float:
    """``edge``, or where the RDP guess (``guess_at``) has grown by :data:`_NEIGHBOUR_RISE`
    from ``guess`` at ``start`` on the way there, if nearer (interpolated geometrically:
    the guess grows about as a power there). Any band is sound; it only decides which
    nearby runs bound this one, and it holds every run near enough to the plan's
    boundary, where epsilon meets the stages' value."""
    if not 0.0 < guess < math.inf:
        return edge
    rise = guess_at(edge) / guess
    if not rise > _NEIGHBOUR_RISE:
        return edge
    return start * (edge / start) ** (math.log(_NEIGHBOUR_RISE) / math.log(rise))


#: Runs from this share of :data:`MIN_STEPS` on are also bounded by that many steps.
_NEAR_MIN_STEPS = 0.9


def _plans(sigma: float, q: float, count: int, deltas: dict) -> bool:
    """Whether :func:`staged_epsilons` finds a plan for removal (its first check)."""
    delta = deltas[_pld._REMOVE]
    guess = _pld._rdp_guess(((sigma, q, count),), min(deltas.values()))
    if not 0.0 < guess <= _MAX_GUESS:
        return False
    guide = min(guess, 2.0 * _central_limit_epsilon(sigma, q, count, min(deltas.values()))) or guess
    return any(_plan(sigma, q, count, _pld._REMOVE, delta, g) is not None for g in {guide, guess})


def _boundary(fits, refused: float, fitting: float) -> float:
    """A point within a part in 10^7 of where ``fits`` turns true between ``refused``
    (false) and ``fitting`` (true), on the fitting side, the same for every such pair
    around one change: it is bisected within the cell of a fixed geometric lattice
    (:data:`_LATTICE` points an octave) where ``fits`` changes, found by bisection over
    the lattice points from beyond ``refused`` to beyond ``fitting``. Bisected from the
    pair itself, it moved by a part in 10^7 with the run asked about, and epsilon with it
    where the nearest dominating run answers (:func:`dominating_runs`): it rose by 6e-8 of
    itself as sigma grew by 0.1% past 0.566 (q 8.45e-4, 10^8 steps, delta 3.6e-9). Where
    the lattice point beyond ``fitting`` does not fit, or the one beyond ``refused`` does,
    the pair itself is bisected."""
    up = 1.0 if fitting > refused else -1.0  # the direction from refused to fitting, in log2 units
    low = math.floor(up * math.log2(refused) * _LATTICE)  # (lattice indices along that direction)
    high = math.ceil(up * math.log2(fitting) * _LATTICE)

    def point(k: int) -> float:
        return 2.0 ** (up * k / _LATTICE)

    if fits(point(high)) and not fits(point(low)):
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (low, middle) if fits(point(middle)) else (middle, high)
        refused, fitting = point(low), point(high)
    for _ in range(40):
        if abs(math.log(fitting / refused)) < 1e-7:
            break
        middle = math.sqrt(refused * fitting)
        refused, fitting = (refused, middle) if fits(middle) else (middle, fitting)
    return fitting


#: Points an octave of the lattice :func:`_boundary` first bisects over.
_LATTICE = 4096


def _central_limit_epsilon(sigma: float, q: float, count: int, delta: float) -> float:
    r"""Epsilon by the central limit theorem (:func:`~.gaussian.central_limit_mu`): only a
    guide. Where the RDP guess lies far above epsilon (large sigma with a tiny epsilon:
    1.6e-3 against 1.0e-4 at sigma 3936, q 3.2e-5, 8.9e6 steps, delta 1.1e-10), twice
    this sizes the grids and chooses the tilt instead (infinite where mu is 0 or 50 and
    more)."""
    mu = central_limit_mu(sigma, q, count)
    return gaussian_epsilon(delta, mu) if 0.0 < mu < 50.0 else math.inf


def _both_directions(sigma: float, q: float, count: int, deltas: dict, guess: float, shift: float) -> Staged | None:
    """:func:`staged_epsilons` planned for ``guess``. Each direction plans on its own side;
    addition goes on only where removal has a plan (its stages are of no use without
    removal's), and does not plan at all where removal is known to have none. (Removal
    planned first, alone: σ 0.63, q 0.0044 over 10^8 steps, delta 3.9e-11, 0.04 s before
    addition, the longer side, began.)"""
    remove = _pld._REMOVE
    removal_planned, removal_plan, finals = threading.Event(), [], _Finals(shift)

    def refused() -> bool:  # removal's plan ended with none (or failed)
        return removal_planned.is_set() and (not removal_plan or removal_plan[0] is None)

    def compose(direction: str) -> tuple:
        """``(epsilon, precise, a bound only)``; epsilon None where nothing answers."""
        if direction == remove:
            try:
                removal_plan.append(_plan(sigma, q, count, direction, deltas[direction], guess))
            finally:  # (set however it ends: addition waits for it)
                removal_planned.set()
            plan = removal_plan[0]
        else:
            if refused():
                return None, False, False
            plan = _plan(sigma, q, count, direction, deltas[direction], guess)
            removal_planned.wait(_PLAN_WAIT)  # (removal sets it; bounded should removal never start)
            if refused():
                return None, False, False
        found = None
        try:
            found = None if plan is None else _staged_answer(sigma, q, count, direction, deltas[direction], plan,
                                                             _Side(finals, direction))
        finally:  # (however it ends: the other side may wait for it)
            finals.done(direction, found)
        if found is not None or direction == remove:
            return (None, False, False) if found is None else (*found, False)
        return _chernoff_epsilon(sigma, q, count, direction, deltas[direction], guess), True, True

    answers = _pld._both_directions(compose)  # side by side where two cores are free
    (removal, removal_precise, _), (addition, addition_precise, bound_only) = answers[remove], answers[_pld._ADD]
    if removal is None or addition is None:
        return None
    settled = removal_precise and addition_precise and not (bound_only and addition + shift > removal)
    return Staged({remove: removal, _pld._ADD: addition}, settled)


#: The most seconds addition waits for removal's plan (:func:`_both_directions`).
_PLAN_WAIT = 60.0


class _Finals:
    """Each direction's stages' answer, as :func:`_both_directions` learns it, for the other
    side (``shift``: what the caller adds to addition's). Only the larger direction's
    answer is reported, so a direction whose second stage in double precision gives a
    sound answer at or below the other's settled one (each with its offset) needs no
    extended precision, whatever rounding decides (:func:`_second_stage`): sigma 0.656,
    q 0.0162 over 10^8 steps, delta 2.5e-11, removal settled 98,363 in double precision
    while addition's 88,145 was not, and went on for 0.21 s to reach 88,069. A direction
    that asks while the other composes its own double-precision stage waits for that
    (sigma 0.632, q 0.00436: addition asked 0.04 s before removal settled 10,372); not
    where the other is in extended precision or waits itself, so that neither waits long
    nor on the other."""

    def __init__(self, shift: float):
        self._offsets = {_pld._REMOVE: 0.0, _pld._ADD: shift}
        self._states: dict = {}  # direction -> "double" while it composes its double-precision stage
        self._settled: dict = {}
        self._changed = threading.Condition()

    def stage(self, direction: str, double: bool) -> None:
        """Note that ``direction`` composes its second stage, in double precision or not."""
        with self._changed:
            self._states[direction] = "double" if double else "extended"
            self._changed.notify_all()

    def done(self, direction: str, found: tuple | None) -> None:
        """Note ``direction``'s answer ``(epsilon, settled)`` (None: none): it is done."""
        with self._changed:
            self._states[direction] = "done"
            if found is not None and found[1]:
                self._settled[direction] = found[0]
            self._changed.notify_all()

    def below(self, direction: str, epsilon: float) -> bool:
        """Whether ``epsilon`` of ``direction`` lies at or below the other's settled answer
        (waiting for it where the other composes its double-precision stage)."""
        other = _pld._other(direction)
        with self._changed:
            self._states[direction] = "waiting"  # (no longer in double precision: one waiting for it goes on)
            self._changed.notify_all()
            self._changed.wait_for(lambda: self._states.get(other) != "double", _PLAN_WAIT)
            settled = self._settled.get(other)
        return settled is not None and epsilon + self._offsets[direction] <= settled + self._offsets[other]


class _Side(NamedTuple):
    """One direction's view of :class:`_Finals`, for :func:`_second_stage`."""

    finals: _Finals
    direction: str

    def stage(self, double: bool) -> None:
        self.finals.stage(self.direction, double)

    def below(self, epsilon: float) -> bool:
        return self.finals.below(self.direction, epsilon)


def _chernoff_epsilon(sigma: float, q: float, count: int, direction: str, delta: float, guess: float) -> float | None:
    r"""A cruder sound epsilon of one direction, for addition where its stages do not fit:
    it need only stay below removal's. With the step's distribution on the grid of
    :func:`_plan`'s first spacing, :math:`(1 - e^{\varepsilon - L})_+ \le c_\lambda
    e^{\lambda (L - \varepsilon)}` for every :math:`\lambda > 0`, with
    :math:`c_\lambda = \frac{1}{1+\lambda} (\frac{\lambda}{1+\lambda})^\lambda` its
    maximum over the loss (the constant of the conversion of Rényi DP in Canonne, Kamath &
    Steinke 2020, Proposition 12, with order lambda + 1), so :math:`\delta(\varepsilon) \le p_\infty + c_\lambda
    e^{T \log M(\lambda) - \lambda \varepsilon}` (``p_inf``: the composed mass at
    :math:`+\infty`)."""
    cut = _cut(delta, count)
    h = _shift_spacing(guess, count)
    if not _fits(sigma, q, direction, h, cut):
        return None
    p_inf = _step(sigma, q, direction, h, cut)[2]
    rest = delta - -math.expm1(count * math.log1p(-p_inf)) * (1.0 + 1e-9)
    if rest <= 0.0:
        return None
    up = _LAMBDAS > 0
    lambdas = _LAMBDAS[up]
    log_c = -np.log1p(lambdas) + lambdas * (np.log(lambdas) - np.log1p(lambdas))
    epsilons = (count * _step_log_mgf(sigma, q, direction, h, cut)[up] + log_c - math.log(rest)) / lambdas
    return max(0.0, float(epsilons.min()) * (1.0 + 1e-12))


def _fits(sigma: float, q: float, direction: str, h: float, cut: float) -> bool:
    """Whether a step's window (:func:`_step_window`) takes at most a quarter of the
    largest grid at spacing ``h``: where rare large losses make it wider, so is a block's."""
    lo, hi = _step_window(sigma, q, direction, h, cut)
    return hi - lo < _MAX_POINTS // 4


def _plan(sigma: float, q: float, count: int, direction: str, delta: float, guess: float) -> _Plan | None:
    """Spacings for a mean shift of about :data:`_SHIFT_SHARE` of ``guess`` per stage and
    bins at most :data:`_BIN_OF_SPREAD` of the spread of the step's body and of its tilted
    standard deviation (the variance connect-the-dots adds, up to :math:`h^2/4` a step,
    then stays below 0.03% of the loss's own, and so does the block's on the coarse grid), ``B = R^2`` with ``R``
    about :math:`T^{1/4}` (equal shifts and windows), and the tilt that minimises the
    Chernoff bound at ``guess`` (where ``delta`` is read). Spacings are powers of two.
    None where a step's support is too wide for the grids (:func:`_fits`)."""
    h = coarsest = _shift_spacing(guess, count)
    cut = _cut(delta, count)
    if not _fits(sigma, q, direction, h, cut):
        return None
    # the body's spread first (cheap): where rare large losses set the tilted one,
    # connect-the-dots of a body narrower than a bin adds T h E|L| of variance, not T h^2 / 4
    body = _finer(sigma, q, direction, h, coarsest, cut, _body_deviation(_step(sigma, q, direction, h, cut)[1], h))
    if body is None and not _spread_within(sigma, q, direction, h, cut):
        return None  # a body far narrower than the tail is long: the split of .rare's regime
    h = h if body is None else body
    first, masses, _ = _step(sigma, q, direction, h, cut)
    tilt = _chernoff_tilt(_step_log_mgf(sigma, q, direction, h, cut), count, guess)
    h = _finer(sigma, q, direction, h, coarsest, cut, _tilted_deviation(first, masses, h, tilt))
    if h is None:
        return None
    return _Plan(h, max(2, 2 ** round(0.25 * math.log2(count))), tilt)


def _spread_within(sigma: float, q: float, direction: str, h: float, cut: float) -> bool:
    r"""Whether bins ``h`` spread a step's loss by at most the variance bins of
    :data:`_BIN_OF_SPREAD` of its own deviation would (:math:`h^2/4` at most, a 2^-12
    share of its variance), where its body lies within a bin and so cannot size them
    (:func:`_plan`). A loss :math:`\ell` in a bin ``h`` wide is spread by at most
    :math:`\min(h|\ell|, h^2/4)`, so by at most :math:`\min(h\,\mathbb E|L|, h^2/4)` on
    average (Gauss-Hermite moments of the loss below the step's window top: a guide,
    as bins only decide tightness). Where the sampled steps, not the body, make the loss's
    variance, that can hold on bins far wider than the body: sigma 0.276, q 7.5e-5 over
    10^8 steps (7,500 steps sampled on average), delta 3.1e-9, whose body asked for bins
    64 times finer than the window allows, were refused and composed on one grid of
    2^22 points in 1.2 s (3,566.61); in stages they take 0.23 s (3,564.20)."""
    top = _pld._loss_cut(sigma, q, direction, cut)
    spread = min(h * _pld._mean_absolute_loss(sigma, q, direction, -math.inf, top), h * h / 4.0)
    return spread <= _BIN_OF_SPREAD**2 / 4.0 * _pld._loss_moments(sigma, q, direction, top)[1]


def _finer(sigma: float, q: float, direction: str, h: float, coarsest: float, cut: float,
           spread: float) -> float | None:
    """``h``, or the power of two at most :data:`_BIN_OF_SPREAD` of ``spread`` if finer;
    where a heavy tail does not fit at that, up to 2^:data:`_COARSER` times coarser (at
    most ``coarsest``); None where none fits."""
    if spread > 0.0:
        h = min(h, 2.0 ** math.floor(math.log2(_BIN_OF_SPREAD * spread)))
    for _ in range(_COARSER):
        if _fits(sigma, q, direction, h, cut) or h >= coarsest:
            break
        h *= 2.0
    return h if _fits(sigma, q, direction, h, cut) else None


def _shift_spacing(guess: float, count: int) -> float:
    """The power of two ``h`` with :math:`T h^2 / 8` at most :data:`_SHIFT_SHARE` of the
    power of two at or below ``guess``."""
    scale = 2.0 ** math.floor(math.log2(guess))
    return 2.0 ** math.floor(0.5 * math.log2(8.0 * _SHIFT_SHARE * scale / count))


def _body_deviation(masses: np.ndarray, spacing: float) -> float:
    """The standard deviation of a normal law with the step's interquartile range: the
    spread of its body, which a rare large loss does not widen (at most a bin where the
    body lies within one)."""
    cumulative = np.cumsum(masses) / float(masses.sum())
    low, high = np.searchsorted(cumulative, [0.25, 0.75])
    return max(int(high) - int(low), 1) * spacing / 1.349


def _tilted_deviation(first: int, masses: np.ndarray, spacing: float, tilt: float) -> float:
    """The standard deviation of the step's loss under its tilted measure."""
    with np.errstate(divide="ignore"):
        log_tilted = np.log(np.asarray(masses, dtype=float)) + tilt * (first + np.arange(masses.size)) * spacing
    weights = np.exp(log_tilted - log_tilted.max())
    index = np.arange(masses.size)
    mean = float(weights @ index) / float(weights.sum())
    return math.sqrt(max(float(weights @ (index - mean) ** 2) / float(weights.sum()), 0.0)) * spacing


def _step_window(sigma: float, q: float, direction: str, h: float, cut: float) -> tuple[int, int]:
    """The grid indices of a step's distribution: its support, less where the loss lies
    beyond tails of mass ``cut`` (below, rounded up to the bottom; above, sent to
    :math:`+\\infty` and counted in ``p_inf``)."""
    low = math.floor(_pld._loss_floor(sigma, q, direction, cut) / h)
    high = math.ceil(_pld._loss_cut(sigma, q, direction, cut) / h)
    return _pld._support(sigma, q, direction, h, low, max(high, low + 1))


def _step(sigma: float, q: float, direction: str, h: float, cut: float) -> tuple:
    """``(first, masses, p_inf)``: the step's dominating distribution on the grid ``h``
    (:func:`.pld._grid_distribution`) in its window (:func:`_step_window`)."""
    return _pld._step_distribution(sigma, q, direction, h, *_step_window(sigma, q, direction, h, cut))


@functools.lru_cache(maxsize=8)
def _step_log_mgf(sigma: float, q: float, direction: str, h: float, cut: float) -> np.ndarray:
    """The step's log moment generating function (finite part) at :data:`_LAMBDAS`."""
    first, masses, _ = _step(sigma, q, direction, h, cut)
    return _pld._log_mgf(first, masses, h, _LAMBDAS)


def _window(log_mgf: np.ndarray, lambdas: np.ndarray, budget: float, spacing: float, tilt: float,
            wrap_budget: float) -> tuple[int, int]:
    """Grid indices ``(low, high)`` with the measure's mass below ``low`` and above ``high``
    each at most ``budget`` by Chernoff (``log_mgf`` at ``lambdas``, of either sign), and
    the mass above ``high`` at most ``wrap_budget`` once multiplied by ``e^{tilt W}``,
    ``W`` the window's width: what wraps around to its bottom is multiplied by that much
    when read back through the tilt (:func:`_mass_above`, ``e^{log M(l) - l top + t
    (top - bottom)}``, minimised over ``l`` above the tilt)."""
    up, down = lambdas > 0, lambdas < 0
    bottom = float(np.max((log_mgf[down] - math.log(budget)) / lambdas[down]))
    top = float(np.min((log_mgf[up] - math.log(budget)) / lambdas[up]))
    steep = lambdas > tilt
    if steep.any():
        wrapped = (log_mgf[steep] - math.log(wrap_budget) - tilt * bottom) / (lambdas[steep] - tilt)
        top = max(top, float(np.min(wrapped)))
    else:
        top = math.inf
    if not math.isfinite(top) or top - bottom > _MAX_POINTS * spacing:
        return 0, _MAX_POINTS + 1  # (too wide: the caller's size check refuses it)
    return math.floor(bottom / spacing), math.ceil(top / spacing)


def _mass_above(log_mgf: np.ndarray, lambdas: np.ndarray, edge: float) -> float:
    """A Chernoff bound on the measure's mass at or above the loss ``edge``."""
    up = lambdas > 0
    return math.exp(min(0.0, float(np.min(log_mgf[up] - lambdas[up] * edge)))) * (1.0 + 1e-9)


def _mass_below(log_mgf: np.ndarray, lambdas: np.ndarray, edge: float) -> float:
    """A Chernoff bound on the measure's mass below the loss ``edge``: it wraps around to
    the window's top, where read back through a positive tilt it is multiplied by
    ``e^{-tilt W}``, so it is counted at :math:`+\\infty` in full."""
    down = lambdas < 0
    return math.exp(min(0.0, float(np.min(log_mgf[down] - lambdas[down] * edge)))) * (1.0 + 1e-9)


def _fft_size(points: int) -> int | None:
    """The power of two holding ``points`` (radix-2 error bound), None above the limit."""
    n = 2 ** max(4, math.ceil(math.log2(max(points, 2))))
    return n if n <= _MAX_POINTS else None


def _fft_error(n: int, parts: list, live: int | None = None, u: float = _U) -> float:
    r"""A bound on every entry's error of ``irfft(prod rfft(x_j)^p_j)`` for measures
    ``x_j`` of total mass at most 1, ``parts``: ``(p_j, b_j)`` with ``b_j`` at least
    :math:`\|x_j\|_2` (see the module docstring). A transform's 2-norm error is at most
    ``level`` times its result's, :math:`\sqrt n \|x_j\|_2`; the powers multiply an
    entry's by at most :math:`e\,p_j` and their polar evaluation and products add
    :math:`(8 e p_j + 4) u` of it. An output entry is :math:`1/n` times a sum over the
    spectrum, so its error is at most :math:`1/n` times the spectrum's error summed over
    the ``live`` entries kept (of the ``n / 2 + 1`` of ``rfft``; twice as many in the
    whole spectrum), at most :math:`\sqrt{2\,live}` times its 2-norm (Cauchy-Schwarz),
    and, from the entries left 0 (:func:`_powered`), at most :math:`e^2` times
    :data:`_DROPPED` for each factor (a true entry's power exceeds its computed one by at
    most a factor :math:`e^{p |d| / |x|}`, near 1 wherever that power is not far below
    the smallest float, and the other factors' by at most ``e``). The inverse adds
    ``level`` times :math:`\|y\|_2 \le \min_j \|x_j\|_2` (Young's inequality). ``u``: the
    unit round-off of the transforms' type."""
    level = (math.log2(n) + 2.0) * _ETA_OF_U * u
    if sum(power * norm for power, norm in parts) * level * math.sqrt(n) > 0.1:
        return math.inf
    share = 1.0 if live is None else min(1.0, math.sqrt(2.0 * (live + 1) / n))
    spread = sum(norm * (power * (math.e * level + 8.0 * math.e * u) + 4.0 * u) for power, norm in parts)
    return share * spread + level * min(norm for _, norm in parts) + len(parts) * 8.0 * _DROPPED


def _round_off(dtype: type) -> float:
    """The unit round-off of a floating-point type."""
    return float(np.finfo(dtype).eps) / 2


def _norm(x: np.ndarray) -> float:
    """An upper bound on the 2-norm of ``x``."""
    return math.sqrt(float(np.dot(x, x))) * (1.0 + 1e-9) + 1e-300


def _powered(spectrum: np.ndarray, power: int) -> np.ndarray:
    """``spectrum ** power`` in polar form (extended precision; the squared modulus errs
    by at most 3u, its logarithm's half by 2.5u, within the module docstring's 8ku);
    entries whose power is below :data:`_DROPPED` are left 0 (:func:`_fft_error`)."""
    if power == 1:
        return spectrum
    squared = spectrum.real * spectrum.real + spectrum.imag * spectrum.imag
    live = np.flatnonzero(squared > _DROPPED ** (2.0 / power))
    out = np.zeros_like(spectrum)
    kept = spectrum[live]
    angle = np.arctan2(kept.imag, kept.real) * power
    out[live] = np.exp(0.5 * power * np.log(squared[live])) * (np.cos(angle) + 1j * np.sin(angle))
    return out


def _chernoff_tilt(step_log_mgf: np.ndarray, count: int, epsilon: float) -> float:
    """The positive lambda of :data:`_LAMBDAS` minimising the Chernoff bound at ``epsilon``."""
    up = _LAMBDAS > 0
    return float(_LAMBDAS[up][int(np.argmin(count * step_log_mgf[up] - _LAMBDAS[up] * epsilon))])


def _staged_answer(sigma: float, q: float, count: int, direction: str, delta: float,
                   plan: _Plan, enough=None) -> tuple[float, bool] | None:
    """One direction's epsilon by the two stages at the plan's tilt, and whether the error
    bound is small there (:func:`_composed_epsilon`); the second stage in double precision
    where that suffices (:data:`_DOUBLE_SHARE`), or where ``enough`` (a :class:`_Side`)
    says the other direction is reported."""
    budget, cut = delta * _WINDOW_SHARE, _cut(delta, count)
    step = _step(sigma, q, direction, plan.h, cut)
    log_mgf = _step_log_mgf(sigma, q, direction, plan.h, cut)
    for R in (plan.R, plan.R // 2, plan.R // 4):  # where a block's window is too wide, shorter blocks
        # (a coarse bin of a steep tilt would overflow its re-tilting factors)
        if R < 2 or plan.tilt * R * plan.h >= 16:
            continue
        K, rest = divmod(count, R * R)
        counts = [(R * R, K)] + ([(rest, 1)] if rest else [])
        made = _blocks(step, log_mgf, plan._replace(R=R), [length for length, _ in counts], budget / (K + 1), K + 1)
        if made is None:
            continue
        parts = [(block, times) for block, (_, times) in zip(made, counts)]
        return _second_stage(parts, plan._replace(R=R), delta, budget, enough)
    return None


def _second_stage(parts: list, plan: _Plan, delta: float, budget: float, enough=None) -> tuple[float, bool] | None:
    """:func:`_composed_epsilon` in double precision, then in extended where that does
    not settle it, nor ``enough`` (a :class:`_Side`) finds its sound answer below the other
    direction's, where it counts as settled; where the window does not fit, on a grid twice or four times coarser
    (each block moved there by connect-the-dots, move 3). Refusing there made epsilon
    fall as q grew past where the window fits (the one grid is looser); a coarser grid
    only loosens the stages' answer, by up to :math:`3 T h^2 / 8` and :math:`15 T h^2 / 8`."""
    for widen in (1, 2, 4):
        wide = plan._replace(R=plan.R * widen)
        if wide.tilt * wide.R * wide.h >= 16:
            return None
        widened = parts if widen == 1 else [(_widened(block, plan, widen), times) for block, times in parts]
        for dtype, share in ((np.float64, _DOUBLE_SHARE), (_EXTENDED, _ERROR_SHARE)):
            if enough is not None:
                enough.stage(dtype is np.float64)
            found = _composed_epsilon(widened, wide._replace(dtype=dtype), delta, budget, share)
            if (found is not None and not found[1] and dtype is np.float64 and enough is not None
                    and enough.below(found[0])):
                found = found[0], True  # (the other direction is reported: see _Finals)
            if found is not None and found[1]:
                break
        if found is not None:
            return found
    return None


def _widened(block: _Block, plan: _Plan, factor: int) -> _Block:
    """``block`` (on the coarse grid of ``plan``) moved onto one ``factor`` times coarser."""
    onto = _Plan(plan.R * plan.h, factor, plan.tilt)
    first, masses = _coarsened(block.first, block.masses, onto)
    return block._replace(first=first, masses=masses, bound=_coarsened(block.first, block.bound, onto)[1])


def _cut(delta: float, count: int) -> float:
    """Each step's tail mass left out of its window (:func:`_step_window`)."""
    return delta * _WINDOW_SHARE / count


def _blocks(step: tuple, step_log_mgf: np.ndarray, plan: _Plan, lengths: list, budget: float,
            pieces: int) -> list | None:
    """Blocks of each of ``lengths`` steps composed on the fine grid, on one window and
    from one transform of the step, moved onto the coarse grid (moves 1 to 3 of the
    module docstring); None where the window is too wide. ``budget``: the tail mass each
    block's window may leave out; ``pieces``: how many blocks are composed in all."""
    first, masses, p_inf = step
    h, tilt = plan.h, plan.tilt
    # what wraps around from above raises a block's total: at most 2^-10 over all blocks
    windows = [_window(length * step_log_mgf, _LAMBDAS, budget, h, tilt, _ERROR_SHARE / pieces)
               for length in lengths]
    low, high = min(w[0] for w in windows), max(w[1] for w in windows)
    n = _fft_size(max(high - low + 1, masses.size))
    if n is None:
        return None
    tilted, log_norm = _tilted_step(first, masses, h, tilt)
    placed = np.zeros(n, dtype=_EXTENDED)
    placed[: masses.size] = tilted
    spectrum = np.fft.rfft(placed)
    unit_bound = _coarsened(low, np.ones(n), plan)[1]
    made = []
    for length in lengths:
        log_mgf = length * step_log_mgf
        # wrapped around: from above, counted at +inf; from below, shrunk by the tilt, also
        outside = _mass_above(log_mgf, _LAMBDAS, (low + n) * h) + _mass_below(log_mgf, _LAMBDAS, low * h)
        powered = _powered(spectrum, length)
        # entry m holds the loss index length * first + m, read in the window low .. low + n - 1
        composed = np.roll(np.fft.irfft(powered, n), (length * first - low) % n)
        error = _fft_error(n, [(length, _norm(tilted))], int(np.count_nonzero(powered)))
        raised = np.maximum(composed + error, 0.0).astype(float) * (1.0 + 2.0**-50)
        p_inf_block = -math.expm1(length * math.log1p(-p_inf)) * (1.0 + 1e-12) + outside
        coarse_first, coarse = _coarsened(low, raised, plan)
        made.append(_Block(coarse_first, coarse, length * log_norm, p_inf_block, unit_bound * min(error, 1.0)))
    return made


def _tilted_step(first: int, masses: np.ndarray, h: float, tilt: float, offset: float = 0.0,
                 up: bool = True) -> tuple[np.ndarray, float]:
    """``(tilted, log_norm)``: masses at losses ``(first + k) h + offset`` times
    ``e^{tilt l - log_norm}``, rounded up (``up``; else down, for :mod:`.staged_lower`),
    with ``log_norm`` such that they total at most 1 (then so does every spectrum
    entry's modulus)."""
    with np.errstate(divide="ignore"):
        log_m = np.log(np.asarray(masses, dtype=float))
    exponents = tilt * ((first + np.arange(masses.size)) * h + offset)
    log_tilted = log_m + exponents
    # (any log_norm is exact bookkeeping: the margin only keeps the total below 1)
    log_norm = float(np.logaddexp.reduce(log_tilted)) + 1e-9 * (1.0 + abs(float(log_tilted.max())))
    # log m + tilt l - log_norm errs by a few units of its terms
    with np.errstate(invalid="ignore"):
        slack = 4.0 * _pld._U * (np.abs(log_m) + np.abs(exponents) + abs(log_norm) + 2.0) + 1e-15
        return np.nan_to_num(np.exp(log_tilted - log_norm) * (1.0 + (slack if up else -slack)), nan=0.0), log_norm


def _coarsened(low: int, tilted: np.ndarray, plan: _Plan) -> tuple[int, np.ndarray]:
    """Connect-the-dots from fine index ``low + i`` (tilted masses) onto the coarse grid.

    An atom ``r`` fine points above coarse point ``a`` sends the share
    :math:`(1 - e^{-r h}) / (1 - e^{-R h})` of its P-mass to ``a + 1`` (keeping
    :math:`E_P[e^{-L}]`), rounded up; re-tilted to the coarse points, every factor is
    rounded up."""
    R, h, tilt = plan.R, plan.h, plan.tilt
    offset = low % R
    padded = np.concatenate([np.zeros(offset), tilted])
    padded = np.concatenate([padded, np.zeros(-padded.size % R)]).reshape(-1, R)
    r = np.arange(R)
    up = np.minimum(1.0, -np.expm1(-r * h) / -math.expm1(-R * h) * (1.0 + 8.0 * _pld._U))
    stay = (1.0 - up) * np.exp(-tilt * r * h) * (1.0 + 8.0 * _pld._U)
    move = up * np.exp(tilt * (R - r) * h) * (1.0 + 8.0 * _pld._U)
    coarse = np.zeros(padded.shape[0] + 1)
    coarse[:-1] += (padded * stay).sum(axis=1)  # no matrix product: see the BLAS note in pld's docs
    coarse[1:] += (padded * move).sum(axis=1)
    return (low - offset) // R, coarse * (1.0 + 2.0 * R * _pld._U)


def _composed_epsilon(parts: list, plan: _Plan, delta: float, budget: float,
                      share: float = _ERROR_SHARE) -> tuple[float, bool] | None:
    """Epsilon of the blocks composed (``parts``: ``(block, times)``) on the coarse grid,
    and whether the transforms' error bounds leave it be (``share``; else the tilt was too
    steep for where delta is read, or the precision too low)."""
    H, tilt = plan.R * plan.h, plan.tilt
    total_log_mgf = sum(times * _block_log_mgf(block, H, tilt, _LAMBDAS) for block, times in parts)
    # what wraps around from above, multiplied by the tilt, may cost 2^-10 of delta
    low, high = _window(total_log_mgf, _LAMBDAS, budget, H, tilt, delta * 2.0**-10)
    n = _fft_size(high - low + 1)
    if n is None:
        return None
    outside = _mass_above(total_log_mgf, _LAMBDAS, (low + n) * H) + _mass_below(total_log_mgf, _LAMBDAS, low * H)
    rest = delta - outside - _infinite_mass(parts, H, tilt)
    if rest <= 0:
        return None
    # Whether the error bounds decide the answer: with four times each it would move. (A
    # bound's part of the profile falls off within 1/tilt above where it decides, so its
    # share of delta at the answer says little; a block's, flat in tilted units, makes a
    # tail far above the block's own where the tilt is steep.) Their raising of the blocks'
    # totals above 1 multiplies delta by as much. Both on two threads, where a core is idle.
    def answer_with(bounds: float) -> float | None:
        return _inverted(*_composed_profile(parts, plan, low, n, bounds), rest)

    answer, answer4 = _pld._beside(lambda: answer_with(1.0), lambda: answer_with(4.0),
                                   lambda answer: answer is not None)
    if answer is None:
        return None
    excess = sum(times * max(0.0, float(_block_log_mgf(block, H, tilt, np.zeros(1))[0])) for block, times in parts)
    moved = answer4 is None or answer4 > answer + share * abs(answer) + 1e-12
    return answer, not moved and excess <= share


def _composed_profile(parts: list, plan: _Plan, low: int, n: int, bounds: float) -> tuple:
    """``(log_w, losses)``: the log P-masses of the composed blocks on the window of ``n``
    points from ``low`` of the coarse grid, each error bound taken ``bounds`` times (1:
    the sound answer)."""
    H, tilt = plan.R * plan.h, plan.tilt
    spectrum, log_scale, start, norms = 1.0, 0.0, 0, []
    for block, times in parts:
        masses = block.masses + (bounds - 1.0) * block.bound
        # the total rounded up past the rounding of the division and the folding below
        total = float(masses.sum()) * (1.0 + masses.size * _pld._U + 1e-11)
        folded = np.bincount(np.arange(masses.size) % n, masses / total, minlength=n) * (1.0 + 1e-12)
        spectrum = spectrum * _powered(np.fft.rfft(folded.astype(plan.dtype)), times)
        norms.append((times, _norm(folded)))
        log_scale += times * (block.log_scale + math.log(total))
        start += times * block.first
    composed = np.roll(np.fft.irfft(spectrum, n), (start - low) % n)
    error = _fft_error(n, norms, int(np.count_nonzero(spectrum)), _round_off(plan.dtype))
    raised = np.maximum(composed + bounds * error, 0.0).astype(float) * (1.0 + 2.0**-50)
    losses = (low + np.arange(n)) * H
    with np.errstate(divide="ignore"):
        return np.log(raised) + log_scale - tilt * losses, losses


def _block_log_mgf(block: _Block, spacing: float, tilt: float, lambdas: np.ndarray) -> np.ndarray:
    """The log moment generating function of a block's (untilted) finite measure."""
    return _pld._log_mgf(block.first, block.masses, spacing, lambdas - tilt) + block.log_scale


def _infinite_mass(parts: list, spacing: float, tilt: float) -> float:
    r"""A bound on the composed mass at :math:`+\infty`: with finite totals :math:`F_b`
    and masses :math:`p_b` at infinity, :math:`\prod (F_b + p_b) - \prod F_b \le \sum
    p_b \prod \max(1, F_b + p_b)`."""
    spread = 0.0
    for block, times in parts:
        log_total = float(_block_log_mgf(block, spacing, tilt, np.zeros(1))[0])
        spread += times * max(0.0, math.log(math.exp(min(log_total, 700.0)) + block.p_inf))
    return sum(times * block.p_inf for block, times in parts) * math.exp(min(spread, 700.0)) * (1.0 + 1e-9)


def _inverted(log_w: np.ndarray, losses: np.ndarray, delta: float) -> float | None:
    r"""The smallest epsilon with :math:`\sum_i w_i (1 - e^{\varepsilon - \ell_i})_+ \le`
    ``delta`` (``w = exp(log_w)`` at ``losses``; sums rounded against the answer), or None
    where it lies at or below the window's bottom."""
    slack = 1e-9
    with np.errstate(over="ignore", invalid="ignore"):
        w = np.exp(log_w)

        def profile(k: int) -> float:
            terms = w[k + 1:] * -np.expm1(losses[k] - losses[k + 1:])
            return float(np.nan_to_num(terms.sum(), nan=math.inf)) * (1.0 + slack)

        if profile(0) <= delta:
            return None
        low, high = 0, losses.size - 1  # profile(low) > delta >= profile(high)
        if profile(high) > delta:
            return None
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if profile(mid) > delta else (low, mid)
        s1 = float(w[high:].sum()) * (1.0 + slack)
        s2 = float((w[high:] * np.exp(losses[high] - losses[high:])).sum()) * (1.0 - slack)  # times e^{l_high}
    if not (math.isfinite(s1) and s2 > 0.0):
        return None
    epsilon = losses[high] + math.log(max(s1 - delta, 1e-300) / s2)
    epsilon = epsilon + 1e-12 * abs(epsilon) + 1e-15
    return max(0.0, min(max(epsilon, losses[low]), losses[high]))
