"""Questions asked of an accountant: what epsilon, what noise, how many more steps.

* :func:`epsilon` and :func:`epsilon_of_ledger` read epsilon off one run or a ledger.
* :func:`calibrate_noise` finds the noise multiplier for a target epsilon.
* :func:`max_steps` finds how many more steps a budget allows. An optimizer enforcing a
  ``max_epsilon`` budget calls it once per change of ``(sigma, q)`` and then only counts
  steps, instead of computing epsilon after every step.

Every search keeps a bracket of *evaluated* points, so what it returns has been checked
with the same accountant that a later :func:`epsilon` call uses (or, in a calibration's
search, a sound bound at least as large: :func:`_searched`): the calibrated noise never
gives more than the target, and the step count never overshoots the budget.
"""

from __future__ import annotations

import functools
import math
import sys

import numpy as np

from .ledger import (
    Accountant,
    Ledger,
    check_count,
    check_delta,
    check_epsilon,
    check_noise_multiplier,
    check_sample_rate,
)
from .gaussian import central_limit_mu, gaussian_delta, gaussian_epsilon
from .pld import PLDAccountant, coarse_epsilon, model_epsilon, pld_epsilon, search_epsilon, steering_epsilon
from .rdp import DEFAULT_ORDERS, RDPAccountant, conversion_terms, ledger_rdp, rdp_subsampled_gaussian

__all__ = [
    "ACCOUNTANTS",
    "UNLIMITED_STEPS",
    "make_accountant",
    "epsilon",
    "epsilon_of_ledger",
    "calibrate_noise",
    "max_steps",
]

#: Accountant names and classes. ``pld`` is tight; ``rdp`` is the classic, looser bound.
ACCOUNTANTS: dict[str, type[Accountant]] = {"pld": PLDAccountant, "rdp": RDPAccountant}

#: What :func:`max_steps` returns when the budget is never exhausted (infinite noise or
#: an infinite budget) or lasts beyond 2**62 steps.
UNLIMITED_STEPS = sys.maxsize

_CALIBRATION_TOLERANCE = 0.002  # calibrated sigma reaches at least 99.8% of the target


def make_accountant(name: str = "pld") -> Accountant:
    """A fresh accountant by name: ``'pld'`` or ``'rdp'``."""
    return ACCOUNTANTS[_check_accountant(name)]()


def _check_accountant(name) -> str:
    if name not in ACCOUNTANTS:
        choices = " or ".join(repr(key) for key in ACCOUNTANTS)
        raise ValueError(f"accountant must be {choices}, got {name!r}")
    return name


def epsilon(noise_multiplier, sample_rate, steps, delta, accountant: str = "pld") -> float:
    """Epsilon after ``steps`` steps of the Poisson-subsampled Gaussian mechanism.

    >>> round(epsilon(10.0, 1.0, 100, 1e-5), 4)  # full batch: the analytic Gaussian
    4.3772
    """
    run = (
        check_noise_multiplier(noise_multiplier),
        check_sample_rate(sample_rate),
        check_count(steps, "steps"),
    )
    return epsilon_of_ledger([run], delta, accountant)


def epsilon_of_ledger(runs, delta, accountant: str = "pld") -> float:
    """Epsilon of a ledger: an iterable of ``(noise_multiplier, sample_rate, count)``."""
    name = _check_accountant(accountant)
    delta = check_delta(delta)
    ledger = Ledger(runs)
    if name == "pld":
        return pld_epsilon(ledger, delta)
    return RDPAccountant.from_ledger(ledger).get_epsilon(delta)


def calibrate_noise(target_epsilon, delta, sample_rate, steps, accountant: str = "pld") -> float:
    """The noise multiplier that spends ``target_epsilon`` over ``steps`` steps.

    The result ``sigma`` satisfies ``epsilon(sigma, ...) <= target_epsilon`` and, up to a
    relative 0.2%, equals it: no noise is wasted. (Where the accountant's epsilon jumps
    over that band as its grid changes with sigma, no sigma meets it: the result is then
    within a relative 2e-4 above the sigma of the jump. The search leaves out grid stages
    of the accountant that did not help at a nearby point, :func:`_searched`: where one
    would have helped after all, epsilon lies further below the target, never above.) Zero steps need no noise
    (returns 0), and neither does a run so short that even noiseless steps meet the target
    (``1 - (1 - q)^steps <= delta``: the run is ``(0, delta)``-DP without noise).

    Any positive target is met by a large enough sigma under the PLD accountant: a tiny
    target asks for a large sigma, not an error. The RDP bound never falls below a floor
    set by its conversion to ``(epsilon, delta)``; a target below that floor raises
    ``ValueError`` naming ``target_epsilon`` and pointing to ``accountant='pld'``.

    The search works on log epsilon against log sigma, which is monotone: a bracket of
    evaluated points (epsilon above the target at ``low``, at most the target at
    ``high``) narrowed by the Illinois variant of regula falsi. For the PLD, the RDP answer
    (an upper bound, so feasible) starts the bracket a few percent from the answer; where
    the answer is a large sigma, the central limit theorem's sigma starts it within about
    1% (:func:`_clt_start`). Either way only sigmas the accountant evaluated are returned.
    """
    name = _check_accountant(accountant)
    target = check_epsilon(target_epsilon, "target_epsilon", positive=True)
    delta = check_delta(delta)
    q = check_sample_rate(sample_rate)
    steps = check_count(steps, "steps")
    if steps == 0 or math.isinf(target):
        return 0.0
    if name == "pld" and epsilon_of_ledger([(0.0, q, steps)], delta, "pld") <= target:
        return 0.0  # noiseless steps already meet it

    def rdp(sigma: float) -> float:
        return epsilon_of_ledger([(sigma, q, steps)], delta, "rdp")

    start = _gdp_guess(target, delta, q, steps)
    rdp_floor = rdp(_SIGMA_MAX)
    reachable = rdp_floor < target * (1.0 - _CALIBRATION_TOLERANCE)
    if name == "rdp":
        if reachable:
            return _solve(rdp, target, start)
        raise ValueError(
            f"target_epsilon {target!r} is below what the RDP accountant can certify at delta={delta!r} "
            f"(its bound never falls below {rdp_floor:.3g} for any noise multiplier); "
            f"use accountant='pld', which meets any positive target"
        )
    searched = _searched(q, steps, delta)
    first = _clt_start(searched, target, delta, q, steps)
    if first is not None:
        return _finish(searched, target, first[0], q, steps, delta, first=first)
    if reachable:  # only a start for the PLD: ten RDP evaluations land close enough
        start = _solve(rdp, target, start, max_evaluations=10, tolerance=_STEERING_TOLERANCE)
    # A PLD on a fixed coarse grid (an upper bound too, a little looser) brings the start
    # to within a few percent cheaply; the accountant itself finishes.
    coarse = _solve(lambda sigma: coarse_epsilon([(sigma, q, steps)], delta, _COARSE_GRID), target, start,
                    close=reachable, max_evaluations=_STEERING_EVALUATIONS, tolerance=_STEERING_TOLERANCE,
                    resolution=_STEERING_RESOLUTION)
    return _finish(searched, target, coarse, q, steps, delta)


def _searched(q: float, steps: int, delta: float):
    """The PLD accountant's epsilon at each sigma of one calibration's search: its own
    answer (:func:`~dpoptim.accounting.pld.search_epsilon`), but with as many of the
    stages it composes after its refinement left out (a third to a half of an
    evaluation at tiny q) as could have been at the nearest sigma evaluated within
    :data:`_LATER_REACH` for the same answer there. Each answer is a sound bound at least
    the accountant's, so a sigma whose answer meets the target meets it for the
    accountant too. At the nearby sigmas of a search those stages help or not alike:
    over 300 calibrations every sigma returned was the same (see docs/accounting.md)."""
    notes: dict[float, int] = {}  # sigma -> how many stages could have been left out there

    def epsilon_at(sigma: float) -> float:
        near = [s for s in notes if abs(math.log(sigma / s)) <= _LATER_REACH]
        nearest = min(near, key=lambda s: abs(math.log(sigma / s)), default=None)
        value, skippable = search_epsilon([(sigma, q, steps)], delta, 0 if nearest is None else notes[nearest])
        if skippable is not None:
            notes[sigma] = skippable
        return value
    return epsilon_at


#: How far (in log sigma) what the later stages did at one sigma stands for another in a
#: calibration's search (:func:`_searched`).
_LATER_REACH = 0.01


#: Grid of the PLD that steers a calibration before the accountant's own grid finishes it.
_COARSE_GRID = 2**14

#: Evaluations a steering search may spend (its answer only starts the next search): the
#: coarse PLD jumps by up to a quarter where its power-of-two spacing changes, so closing
#: in on its own answer further gains nothing.
_STEERING_EVALUATIONS = 12

#: A steering search stops within this share of the target: the coarse PLD itself is a
#: few percent (at tiny q, tens of percent) off the accountant, so closer is wasted.
_STEERING_TOLERANCE = 0.02

#: ... and once its bracket on sigma is this narrow (relative): where the coarse PLD
#: jumps, it may never land within the tolerance, and narrower brackets tell nothing more.
_STEERING_RESOLUTION = 0.005

#: Largest noise multiplier a calibration tries before giving up.
_SIGMA_MAX = 1e15


def _gdp_guess(target: float, delta: float, q: float, steps: int) -> float:
    """A rough sigma for ``target``, only a starting point: the large-sigma limit of the
    subsampled Gaussian is about ``q sqrt(T) / sigma``-GDP (Dong, Roth & Su 2019, Thm. 6),
    and a small ``mu``-GDP has epsilon about ``mu sqrt(2 log(1/delta))``."""
    mu = target / math.sqrt(2.0 * math.log(1.0 / delta))
    return min(max(q * math.sqrt(steps) / mu, 1e-2), 1e12)


def _clt_sigma(target: float, delta: float, q: float, steps: int) -> float | None:
    """The sigma at which the central limit theorem puts epsilon at ``target``: the mu
    whose mu-GDP profile (:func:`~dpoptim.accounting.gaussian.gaussian_delta`) is
    ``delta`` at ``target``, by bisection on log mu, turned into sigma by inverting
    :func:`~dpoptim.accounting.gaussian.central_limit_mu`. A steering only: not a bound of
    either side. None where it has no answer."""
    low, high = 1e-300, 1e300
    if not (0.0 < q < 1.0 and gaussian_delta(target, high) > delta >= gaussian_delta(target, low)):
        return None
    for _ in range(64):
        middle = math.sqrt(low * high)
        if gaussian_delta(target, middle) > delta:
            high = middle
        else:
            low = middle
        if high <= low * (1.0 + 1e-9):
            break
    ratio = low / q
    spread = math.log1p(ratio * ratio / steps)  # 1 / sigma^2 (0 where it underflows, inf where mu / q overflows)
    return 1.0 / math.sqrt(spread) if spread > 0.0 else None


def _clt_start(accountant, target: float, delta: float, q: float, steps: int) -> tuple | None:
    """``(sigma, slope, epsilon)``: the central limit theorem's sigma for ``target``
    (:func:`_clt_sigma`), its slope there and the ``accountant``'s epsilon there, where
    that sigma is large (:data:`_CLT_SIGMA`): every step's loss is then near Gaussian, and
    the theorem alone lands within about 1%, where a coarse grid cannot resolve a small
    target. None where it is not, or where the accountant there is not within a factor of
    2 of the target (an epsilon of 0 near the sigma where it reaches 0, or a target out of
    reach): the steered search takes over from scratch."""
    sigma = _clt_sigma(target, delta, q, steps)
    if sigma is None or sigma < _CLT_SIGMA:
        return None
    value = accountant(sigma)
    if not (0.0 < value < math.inf and abs(math.log(value / target)) <= math.log(2.0)):
        return None
    return sigma, _clt_slope(sigma, delta, q, steps), value


def _clt_slope(sigma: float, delta: float, q: float, steps: int) -> float:
    """-d log epsilon / d log sigma of the central limit theorem's epsilon at ``sigma``
    (a first slope for :func:`_finish`), clipped to 1..50 as its secant slopes are."""
    upper, lower = (gaussian_epsilon(delta, central_limit_mu(sigma * factor, q, steps)) for factor in (0.99, 1.01))
    if not (0.0 < lower < upper < math.inf):
        return 1.0
    return min(max(math.log(upper / lower) / math.log(1.01 / 0.99), 1.0), 50.0)


#: From this sigma on, :func:`calibrate_noise` starts at the central limit theorem's
#: answer (:func:`_clt_sigma`): measured within 1.2% of the accountant's answer for every
#: sigma above 3 in 155 random calibrations (q from 1e-6 to 0.6, 2 to 10^8 steps, delta
#: from 1e-12 to 0.06), where the coarse PLD can be off by half or more.
_CLT_SIGMA = 4.0


def _finish(eps_of, target: float, start: float, q: float, steps: int, delta: float,
            first: tuple | None = None) -> float:
    """The accountant's own search from the coarse answer ``start``: at the answer of a model
    (:class:`_Model`, smooth in sigma where the accountant's grid moves), then at the model
    moved to that value (:func:`_modelled_start`), once at it times its drifting ratio
    (:meth:`_Model.drifting`), then secant steps on log epsilon against log sigma. Near
    epsilon's zero (:func:`_near_zero_rate`, or a 0 at the model's answer) secants on epsilon
    itself (:func:`_linear_step`, up to eight; from one point, :func:`_offset_step`).
    :func:`_illinois` narrows a bracket (to :data:`_JUMP_RESOLUTION`). ``first``: ``(sigma,
    slope, value)`` (:func:`_clt_start`), no model. Only evaluated points are returned."""
    known: dict[float, float] = {}
    model: _Model | None = None

    def accountant(sigma: float) -> float:
        if sigma not in known:
            known[sigma] = eps_of(sigma)
        return known[sigma]

    floor, aim = target * (1.0 - _CALIBRATION_TOLERANCE), target * (1.0 - _CALIBRATION_TOLERANCE / 2)
    rate = None if first is not None else _near_zero_rate(start, q, steps, delta)  # near zero: -d eps / d log sigma
    offset = functools.partial(_offset_step, aim=aim, q=q, steps=steps, delta=delta)
    if first is not None:  # the accountant's first point, slope and value are given
        (sigma, slope, known[sigma]), previous = first, None
    elif rate is not None:  # the model's scaling suits a relative error, not the additive one here
        start, rate = _near_zero_start(start, aim, rate, q, steps, delta)
        if floor <= accountant(start) <= target:
            return start
        (sigma, rate), previous, slope = _linear_step(known, start, None, aim, rate, offset), start, _STEEP
    else:
        model = _Model(start, coarse_epsilon([(start, q, steps)], delta, _COARSE_GRID), aim, q, steps, delta)
        sigma, slope, previous = _modelled_start(accountant, start, (floor, target), model)
        if previous is None and floor <= known[sigma] <= target:
            return sigma
        if previous is None and known[sigma] == 0.0:  # the accountant's 0 at the model's answer: near zero
            model, (sigma, rate, previous, slope) = None, _zero_side_step(known, sigma, aim, q, steps, delta)
    for _ in range(4 if rate is None else 8):
        value = accountant(sigma)
        if floor <= value <= target:
            return sigma
        bracket = _bracket(known, target)  # an epsilon of 0 (q T near delta) ends a bracket too
        stepped = model.drifting(known, bracket) if model is not None else None
        if stepped is not None:  # once: the model times its drifting ratio to the accountant
            model, previous, (sigma, slope) = None, sigma, stepped
            continue
        if bracket is not None:
            earlier = list(known)
            return _illinois(accountant, target, floor, *bracket, earlier, _JUMP_RESOLUTION, rate, offset)
        if rate is not None:  # near zero, epsilon is about linear in sigma: secant steps on it
            previous, (sigma, rate) = sigma, _linear_step(known, sigma, previous, aim, rate, offset)
            if sigma in known:
                break
            continue
        if not 0 < value < math.inf:
            break
        previous, sigma, slope = _secant_step(known, sigma, previous, slope, aim)
        if sigma in known:
            break
    feasible = [s for s, v in known.items() if v <= target]
    return _solve(accountant, target, min(feasible) if feasible else max(known), close=True, slope=slope,
                  resolution=_JUMP_RESOLUTION)


def _secant_step(known: dict, sigma: float, previous: float | None, slope: float, aim: float) -> tuple:
    """``(sigma, next sigma, slope)`` of :func:`_finish`'s secant step on log epsilon against
    log sigma from the accountant's ``known`` points, ``sigma`` the last: the slope from the
    last two (clipped to 1..50; ``slope`` without them), or the parabola through the last
    three where it lands near."""
    value = known[sigma]
    if previous is not None and 0 < known[previous] < math.inf and known[previous] != value:
        slope = min(max(math.log(value / known[previous]) / math.log(previous / sigma), 1.0), 50.0)
    step = min(max((value / aim) ** (1.0 / slope), 0.5), 2.0)
    curve = _inverse_quadratic([(math.log(s), math.log(known[s] / aim)) for s in list(known)[-3:]])
    if math.isfinite(curve) and abs(curve - math.log(sigma)) <= math.log(2.0):  # (exp(curve) may overflow)
        return sigma, math.exp(curve), slope
    return sigma, sigma * step, slope


def _modelled_start(accountant, start: float, band: tuple, model: "_Model") -> tuple:
    """``(sigma, slope, previous)`` for :func:`_finish`'s secant steps away from zero:
    the accountant evaluated at the ``model``'s own answer (or ``start``), then the model
    scaled to it solved again (``previous``: the point evaluated). ``previous`` is None
    where the model gives no second point or the first is in the ``band`` (floor,
    target): ``sigma`` is then the point evaluated (with the coarse PLD's slope)."""
    own = model.solve(start, None, tolerance=1e-3)  # only a start: the model is a percent or so off
    sigma = own[0] if own is not None and abs(math.log(own[0] / start)) <= _reach(model) else start
    value = accountant(sigma)
    if band[0] <= value <= band[1]:
        return sigma, 1.0, None
    if own is not None and 0 < value < math.inf and abs(math.log(value / model.aim)) <= _SMALL_CORRECTION:
        # a small correction: the model's slope alone steps there (its curvature adds ~1e-5)
        return sigma * math.exp(math.log(value / model.aim) / own[1]), own[1], sigma
    modelled = model.solve_moved(sigma, value, own[1] if own is not None else None) if 0 < value < math.inf else None
    if modelled is None:
        return sigma, _coarse_slope(sigma, model.q, model.steps, model.delta), None
    return modelled[0], modelled[1], sigma


class _Model:
    """The model that steers :func:`_finish`, and how it is solved: the PLD on one grid
    chosen at ``anchor`` for an epsilon near ``guess`` (the coarse answer), of a quarter of
    the accountant's largest grid or less (:func:`~dpoptim.accounting.pld.model_epsilon`).
    On a fixed grid epsilon is smooth in sigma, where the accountant's moves by a little
    as its grid changes; the model's offset from the accountant is measured at the points
    the accountant evaluates and taken out (:meth:`solve_moved`, :meth:`drifting`)."""

    def __init__(self, anchor: float, guess: float, aim: float, q: float, steps: int, delta: float):
        self.anchor, self.guess, self.aim, self.q, self.steps, self.delta = anchor, guess, aim, q, steps, delta

    def __call__(self, sigma: float) -> float | None:
        return model_epsilon(sigma, self.q, self.steps, self.delta, self.anchor, self.guess)

    def solve(self, start: float, value: float | None, slope: float | None = None, tolerance: float = 1e-5,
              lean: float = 0.0):
        """:func:`_modelled` of this model."""
        return _modelled(self.anchor, self.guess, start, value, self.aim, self.q, self.steps, self.delta, slope,
                         tolerance, lean)

    def solve_moved(self, start: float, value: float, slope: float | None = None):
        """:meth:`solve` for the model moved by its difference from the accountant's
        ``value`` at ``start`` (scaled by their ratio where that difference would move
        the aim to 0 or below). Where the accountant's first point lies more than
        :data:`_SMALL_CORRECTION` off the aim, the model lies a few percent above it: near
        epsilon's zero, where the coarser bins add about a constant. Scaled by the ratio,
        the step then missed by the two shares' product (q 2.59e-6, 433 steps, delta
        3.84e-4: the model 6.1% above, the first point 5.8% below the aim, the second
        0.46% above it, outside the band); moved by the difference, by 0.1%. On 180
        calibrations near the zero, seven took this step: moved, five found the band
        with one evaluation fewer, and none took more."""
        at = self(start)
        if at is None or not 0 < at < math.inf or not self.aim + at - value > 0:
            return self.solve(start, value, slope)
        return _modelled(self.anchor, self.guess, start, None, self.aim + at - value, self.q, self.steps,
                         self.delta, slope)

    def drifting(self, known: dict, bracket: tuple | None) -> tuple | None:
        """``(sigma, slope)``: where the model times its ratio to the accountant, taken
        linear in log sigma through the accountant's last two ``known`` points, meets the
        aim; None where that is not a new point inside the ``bracket`` (where there is
        one) or within a factor of 2 of the last point.

        The model is a coarser grid than the accountant's, and where rounding or a rare
        loss decides their answers, their ratio drifts with sigma: at q 2e-5 over 8.3*10^7
        steps, delta 1.6e-12 it went from 0.858 to 0.892 over 8% of sigma. Scaled by one
        point, the model then stepped 3.8% past the target; secant steps on the
        accountant alone took two more evaluations of a second each."""
        points = [(sigma, value) for sigma, value in known.items() if 0 < value < math.inf][-2:]
        if len(points) < 2:
            return None
        (first, first_value), (last, last_value) = points
        models = self(first), self(last)
        if not all(model is not None and 0 < model < math.inf for model in models):
            return None
        drift = math.log(last_value / models[1]) - math.log(first_value / models[0])
        found = self.solve(last, last_value, lean=drift / math.log(last / first))
        if found is None or found[0] in known or abs(math.log(found[0] / last)) > math.log(2.0):
            return None
        if bracket is not None and not bracket[0] < found[0] < bracket[1]:
            return None
        return found


def _bracket(known: dict, target: float) -> tuple[float, float] | None:
    """``(low, high)``: the largest infeasible and the smallest feasible sigma evaluated,
    where both exist and the first is below the second; else None."""
    feasible = [sigma for sigma, value in known.items() if value <= target]
    infeasible = [sigma for sigma, value in known.items() if value > target]
    if feasible and infeasible and max(infeasible) < min(feasible):
        return max(infeasible), min(feasible)
    return None


#: The accountant's epsilon can jump where its grid changes with sigma, by up to its own
#: error (under a percent), and a jump may step over the accepted band: no sigma lands in
#: it. The search then ends once its bracket on log sigma is this narrow, with the
#: bracket's feasible end: at most this much more noise than at the jump.
_JUMP_RESOLUTION = 2e-4


def _modelled(anchor: float, guess: float, start: float, value: float | None, aim: float, q: float, steps: int,
              delta: float, slope: float | None = None, tolerance: float = 1e-5, lean: float = 0.0):
    """``(sigma, slope)``: where the model (:func:`~dpoptim.accounting.pld.model_epsilon`
    on the grid chosen at ``anchor`` for an epsilon near ``guess``), scaled to the
    accountant's ``value`` at ``start`` (None: unscaled), equals ``aim``, and the model's
    -d log epsilon / d log sigma between ``start`` and a probe 1% toward the answer
    (clipped to 1..50; ``slope``: known already, no probe); None where there is no model
    or it does not fall there. Chord steps on log epsilon against log sigma with that
    slope, at most :data:`_MODEL_EVALUATIONS` evaluations, until a step moves log sigma by
    under ``tolerance`` (1e-5 moves epsilon by well under the band's 0.1%): the slope of a
    wide baseline, because where the grid is coarse for the loss (tiny sigma) the model
    wobbles by a few tenths of a percent from point to point. ``lean``: the model's log is
    taken plus ``lean`` times log sigma over ``start`` (a ratio to the accountant that
    drifts with sigma, :meth:`_Model.drifting`)."""
    def log_model(x: float) -> float | None:
        model = model_epsilon(math.exp(x), q, steps, delta, anchor, guess)
        return math.log(model) + lean * (x - math.log(start)) if model is not None and 0 < model < math.inf else None

    x = math.log(start)
    anchored = log_model(x)
    if anchored is None or not (value is None or 0 < value < math.inf):
        return None
    shift = (anchored if value is None else math.log(value)) - anchored - math.log(aim)  # g = log model + shift
    g, evaluations = anchored + shift, 1
    if slope is None:
        probe = x + math.copysign(0.01, g)
        probed = log_model(probe)
        if probed is None or not (anchored - probed) / (probe - x) > 0:
            return None
        slope = (anchored - probed) / (probe - x)
        x, g, evaluations = probe, probed + shift, 2
    points = [(math.log(start), anchored + shift), (x, g)]
    for evaluations in range(evaluations, _MODEL_EVALUATIONS + 1):
        slope = _secant_slope(points, slope)
        step = min(max(g / slope, -math.log(2.0)), math.log(2.0))
        bracket = _model_bracket(points)
        if bracket is not None:  # the chords overshot: the secant inside the bracket, else false position
            (low, above), (high, below) = bracket
            if not low < x + step < high:
                slope = (above - below) / (high - low)
                step = low + above / slope - x
        x += step
        if abs(step) < tolerance or evaluations == _MODEL_EVALUATIONS:
            break
        log_value = log_model(x)
        if log_value is None:
            return None
        g = log_value + shift
        points.append((x, g))
    return math.exp(x), min(max(slope, 1.0), 50.0)


def _secant_slope(points: list, slope: float) -> float:
    """The model's slope through its last two ``points`` (log sigma, log epsilon over the
    aim) where they differ by at least :data:`_SECANT_RISE` in log epsilon and the slope
    lies within a factor of 3 of ``slope`` (the probe's, or the last one taken); else
    ``slope``. A fixed slope converges only linearly: where the probe's is 2.86 and the
    secant's 1.92 (q 1.13e-6, 7.8*10^7 steps, delta 6.4e-7), each chord step closed two
    thirds of the gap, and six steps were spent on what a secant closes in two."""
    (x0, g0), (x1, g1) = points[-2:]
    if x0 == x1 or abs(g1 - g0) < _SECANT_RISE:
        return slope
    secant = (g0 - g1) / (x1 - x0)
    return secant if slope / 3.0 <= secant <= 3.0 * slope else slope


#: Across less rise than this (log epsilon) the model's wobble (a few tenths of a percent
#: where its grid is coarse for the loss) could spoil a secant's slope.
_SECANT_RISE = 0.01


def _model_bracket(points: list) -> tuple | None:
    """``((x, g), (x, g))``: of the model's points (log sigma, log epsilon over the aim),
    the largest sigma still above the aim and the smallest below it, where the first is
    the smaller; else None. Where epsilon falls much faster than the probe's slope says
    (one rare loss deciding it), chord steps with that slope overshoot both ways (q 3.75e-6,
    10^7 steps, delta 4.9e-11: epsilon from 0.77 to 0.16 between sigma 0.60 and 0.73,
    probe slope 2.5); false position between the two converges."""
    above = [point for point in points if point[1] > 0.0]
    below = [point for point in points if point[1] < 0.0]
    if not above or not below:
        return None
    low, high = max(above), min(below)
    return (low, high) if low[0] < high[0] else None


def _reach(model: "_Model") -> float:
    """How far (in log sigma) from the coarse answer the ``model``'s own answer is trusted
    as the accountant's first point: :data:`_MODEL_REACH`, or :data:`_MODEL_FAR_REACH`
    where the coarse PLD at that answer is more than :data:`_COARSE_DISAGREES` off the
    model. The coarse answer is then no better a start than the model's own (q 1.13e-6,
    7.8*10^7 steps, delta 6.4e-7: the coarse PLD 58% above the model, which lies within
    4% of the accountant; its answer, 31% below the coarse one, was set aside, and the
    accountant evaluated at the coarse answer first, 0.4 s for nothing). Where both
    agree the short reach stands: a model far from the accountant (a test's stand-in)
    then costs no evaluations."""
    anchored = model(model.anchor)
    if anchored is None or not 0 < anchored < math.inf or not 0 < model.guess < math.inf:
        return _MODEL_REACH
    return _MODEL_FAR_REACH if abs(math.log(model.guess / anchored)) > _COARSE_DISAGREES else _MODEL_REACH


#: How far (in log sigma) from the coarse answer the model's own answer is trusted as the
#: accountant's first point: at tiny q the coarse PLD is 10% off, the model 1% or so.
_MODEL_REACH = 0.25

#: ... and where the coarse PLD is more than this (in log epsilon) off the model.
_COARSE_DISAGREES = math.log(1.25)

#: ... then the model's answer is trusted this far.
_MODEL_FAR_REACH = 0.7

#: Within this distance (log epsilon) of the aim, the accountant's first point is
#: corrected along the model's slope without solving the model again.
_SMALL_CORRECTION = 0.02

#: Model evaluations :func:`_modelled` may spend (each on a quarter of the accountant's
#: largest grid, or less).
_MODEL_EVALUATIONS = 5


def _coarse_slope(sigma: float, q: float, steps: int, delta: float) -> float:
    """A first guess of the accountant's -d log epsilon / d log sigma near ``sigma``: the
    median of the coarse PLD's over 0.98..1, 1..1.02 and 0.95..1.05 times ``sigma``
    (clipped to 1..50; 2 where none is defined). A jump of the coarse PLD (where its
    spacing changes) spoils at most one of the two narrow baselines and little of the
    wide one, so the median is one that it does not spoil much."""
    factors = (0.95, 0.98, 1.0, 1.02, 1.05)
    values = dict(zip(factors, (coarse_epsilon([(sigma * f, q, steps)], delta, _COARSE_GRID) for f in factors)))
    slopes = []
    for low, high in ((0.98, 1.0), (1.0, 1.02), (0.95, 1.05)):
        if 0 < values[high] < values[low] < math.inf:
            slopes.append(min(max(math.log(values[low] / values[high]) / math.log(high / low), 1.0), 50.0))
    return sorted(slopes)[(len(slopes) - 1) // 2] if slopes else 2.0


def _near_zero_rate(sigma: float, q: float, steps: int, delta: float) -> float | None:
    """Where epsilon reaches 0 within 2% above ``sigma`` (the coarse PLD, an upper bound,
    is 0 at 1.02 ``sigma``; see :func:`_near_zero`), a first guess of the accountant's
    -d epsilon / d log sigma there: :func:`_coarse_chord_rate` (else None). The coarse
    PLD is off by about a constant there (its rounding), which leaves the rate; epsilon
    being convex, the chord's rate is a little above the rate at ``sigma``."""
    if coarse_epsilon([(sigma * 1.02, q, steps)], delta, _COARSE_GRID) > 0:
        return None
    return _coarse_chord_rate(sigma, q, steps, delta)


def _coarse_chord_rate(sigma: float, q: float, steps: int, delta: float) -> float | None:
    """The coarse PLD's -d epsilon / d log sigma over 0.995..1 times ``sigma``, where
    positive and finite; else None."""
    below, at = (coarse_epsilon([(sigma * f, q, steps)], delta, _COARSE_GRID) for f in (0.995, 1.0))
    rate = (below - at) / -math.log(0.995)
    return rate if 0 < rate < math.inf else None


def _zero_side_step(known: dict, sigma: float, aim: float, q: float, steps: int, delta: float) -> tuple:
    """``(next sigma, rate, sigma, slope)`` for :func:`_finish` from ``sigma``, where the
    accountant's epsilon is 0: where the extrapolated coarse PLD meets ``aim`` below it
    (:func:`_extrapolated_sigma`, first stepping at the rate :func:`_zero_side_rate`
    guesses) and its rate there, else :func:`_linear_step` at that guess; and the slope
    of log epsilon there (:data:`_STEEP`). Stepping at the guess alone, the search took
    six evaluations where it now takes three (the case of :func:`_zero_side_rate`)."""
    rate = _zero_side_rate(sigma, aim, q, steps, delta)
    found = _extrapolated_sigma(sigma, aim, rate, q, steps, delta) if q * steps < _MANY_SAMPLED else None
    if found is None or not found[0] < sigma:
        found = _linear_step(known, sigma, None, aim, rate)
    return (*found, sigma, _STEEP)


def _zero_side_rate(sigma: float, aim: float, q: float, steps: int, delta: float) -> float:
    """A first guess of -d epsilon / d log sigma where the accountant's epsilon is 0 at
    ``sigma`` though the coarse PLD put the target near it: :func:`_coarse_chord_rate`,
    else ``aim`` times the coarse log-log slope (:func:`_coarse_slope`). Without it the
    search stepped down from the 0 by halving and bisecting towards it (q 1.5e-6,
    3.9*10^6 steps, delta 6.5e-3, target 1.5e-3: nine evaluations, from sigma 0.539
    through 0.270 to the answer 0.522)."""
    return _coarse_chord_rate(sigma, q, steps, delta) or aim * _coarse_slope(sigma, q, steps, delta)


def _near_zero_start(start: float, aim: float, rate: float, q: float, steps: int, delta: float) -> tuple:
    """``(sigma, rate)``: the first point near zero and -d epsilon / d log sigma there
    (``rate``: a first guess). The central limit theorem's sigma for ``aim``
    (:func:`_clt_sigma`) where it lies within :data:`_NEAR_ZERO_REACH` below the coarse
    answer ``start`` and the extrapolated coarse PLD there (:func:`_extrapolated_epsilon`)
    is at least :data:`_CLT_SHORT` of ``aim`` and at most :data:`_CLT_AGREES` times ``aim``
    above it; else where that
    extrapolation meets ``aim`` (:func:`_extrapolated_sigma`), searched from the
    theorem's sigma where within reach, else from ``start``.

    Where epsilon reaches 0 the composed loss's body decides it, not its tail, and there
    the coarse PLD, an upper bound, lies above the accountant by about a constant: it
    reaches 0 further up (q 2.1e-5 over 1.9e7 steps, delta 0.04: at sigma 1.289 on the
    coarse grid, 1.131 by the accountant). The theorem can be close (1.1293 at the target
    1.49e-4, where the accountant's answer is 1.12926) or off by 0.5% to 1.3% of sigma, a
    span in which epsilon falls from 10 or 20 times the target to 0 (q 3.4e-6 to
    8.2e-6, 1.4*10^6 to 3.7*10^6 steps); the extrapolation tells the two apart where
    fewer than :data:`_MANY_SAMPLED` steps are sampled on average."""
    clt = _clt_sigma(aim, delta, q, steps)
    begin = clt if clt is not None and start * _NEAR_ZERO_REACH < clt < start else start
    if q * steps >= _MANY_SAMPLED or (begin == clt and _CLT_SHORT * aim <= _extrapolated_epsilon(clt, q, steps, delta)
                                      <= (1.0 + _CLT_AGREES) * aim):
        return begin, rate
    return _extrapolated_sigma(begin, aim, rate, q, steps, delta) or (begin, rate)


#: :func:`_near_zero_start` takes the central limit theorem's sigma where the extrapolated
#: coarse PLD there is positive and at most this many times the aim above it (a 0 says
#: only that the theorem's sigma lies past the zero, where it can be far off). The
#: extrapolation came within 0.9 times the target of the accountant in 15 of 16
#: calibrations near zero (3.4 in one), and 1.6 times at the theorem's sigma over
#: 1.9*10^7 steps (that docstring's case), where the theorem is within 2e-6 of the answer.
_CLT_AGREES = 2.0

#: ... and at least this share of the aim: further below, the theorem's sigma lies too far
#: past the answer (q 1.98e-6 over 2.97*10^7 steps, delta 0.0766: the extrapolation read
#: a sixth of the target there and the accountant a quarter; four evaluations from there,
#: three from where the extrapolation meets the aim). Over 240 calibrations near zero
#: (four seeds of the survey) three took one evaluation fewer and none more.
_CLT_SHORT = 0.5


#: From this many sampled steps on average (q T), the search near zero does without
#: :func:`_extrapolated_epsilon`: over long runs the coarse grids' offsets from the
#: accountant do not shrink geometrically (at q 1.9e-5 over 2.5*10^7 steps the
#: extrapolation lay 15 times the target below the accountant, and 30 calibrations at q
#: T of 30 to 3,000 took 83 evaluations with it, 76 without), while the central limit
#: theorem is close (within 2.4e-4 of sigma there).
_MANY_SAMPLED = 100.0


#: The grids of :func:`_extrapolated_epsilon`, each with twice the points of the one before.
_EXTRAPOLATION_GRIDS = (2**14, 2**15, 2**16)


@functools.lru_cache(maxsize=64)
def _extrapolated_epsilon(sigma: float, q: float, steps: int, delta: float) -> float:
    """A steering guess of the accountant's epsilon near the sigma where it reaches 0: the
    coarse PLD on :data:`_EXTRAPOLATION_GRIDS`, extrapolated to fine bins by Aitken's
    delta-squared process, ``c2 - d2^2 / (d1 - d2)`` for the values ``c0, c1, c2`` and
    their differences ``d1 = c0 - c1``, ``d2 = c1 - c2``. There each grid lies above the
    accountant by about a constant in sigma (its bins spread the body of the loss), which
    shrinks 2.1 to 2.3 times with each halving of the bins (q 2.7e-6 to 7.5e-6, delta
    7e-4 to 0.04): near geometric, whose limit that is. Neither bound, and below 0 past
    the zero (where it still tells how far); the finest grid's value where that is 0 or
    infinite, or the differences do not shrink. A grid at 0 ends it at 0 without
    composing the finer ones: their offsets being smaller, they lie at 0 too (a search
    stepping back from past the zero meets such points)."""
    values = []
    for points in _EXTRAPOLATION_GRIDS:
        values.append(coarse_epsilon([(sigma, q, steps)], delta, points))
        if values[-1] == 0.0:
            return 0.0
    c0, c1, c2 = values
    d1, d2 = c0 - c1, c1 - c2
    if not (0.0 < c2 < math.inf and 0.0 < d2 < d1):
        return c2
    return c2 - d2 * d2 / (d1 - d2)


def _extrapolated_sigma(start: float, aim: float, rate: float, q: float, steps: int, delta: float) -> tuple | None:
    """``(sigma, rate)``: where :func:`_extrapolated_epsilon` meets ``aim`` (to within
    :data:`_EXTRAPOLATED_TOLERANCE` of it), searched from ``start`` by secant steps on
    epsilon against log sigma (the first at ``rate``, -d epsilon / d log sigma, as past a
    0: :func:`_epsilon_step`; each at most 0.05 in log sigma, bisecting a bracket where
    one falls outside), up to :data:`_EXTRAPOLATED_EVALUATIONS`; the rate between its
    last two points (``rate`` without two). Its point nearest ``aim`` once out of
    evaluations; None where it found no finite nonzero value."""
    x, zeros, points, low, high = math.log(start), 0, [], -math.inf, math.inf  # value above aim at low, below at high
    for _ in range(_EXTRAPOLATED_EVALUATIONS):
        value = _extrapolated_epsilon(math.exp(x), q, steps, delta)
        low, high = (max(low, x), high) if value > aim else (low, min(high, x))
        if value != 0.0 and value < math.inf:
            points.append((x, value - aim))
            if abs(value - aim) <= _EXTRAPOLATED_TOLERANCE * aim:
                break
        zeros += value == 0.0
        if len(points) >= 2 and points[-1][1] != points[-2][1]:
            (x0, g0), (x1, g1) = points[-2:]
            step = x1 - g1 * (x1 - x0) / (g1 - g0) - x
        else:
            step = _epsilon_step(value, aim, zeros, rate)
        x = x + min(max(step, -0.05), 0.05)
        if not low < x < high and -math.inf < low and high < math.inf:
            x = 0.5 * (low + high)
    if not points:
        return None
    best = min(points, key=lambda point: abs(point[1]))
    if len(points) >= 2:
        (x0, g0), (x1, g1) = sorted(points[-2:])
        rate = (g0 - g1) / (x1 - x0) if x1 > x0 and g0 > g1 else rate
    return math.exp(best[0]), rate


#: :func:`_extrapolated_sigma`'s tolerance, a share of the aim: the extrapolation is
#: rarely closer to the accountant than a tenth of it.
_EXTRAPOLATED_TOLERANCE = 0.02

#: :func:`_extrapolated_sigma`'s most evaluations.
_EXTRAPOLATED_EVALUATIONS = 8


#: How far below the coarse answer :func:`_near_zero_start` takes the central limit
#: theorem's sigma.
_NEAR_ZERO_REACH = 0.7


def _linear_step(known: dict, sigma: float, previous: float | None, aim: float, rate: float, offset=None) -> tuple:
    """``(next sigma, rate)``: a secant step of :func:`_finish` near zero, on epsilon
    itself against log sigma. ``rate`` (-d epsilon / d log sigma) is re-measured between
    ``previous`` and ``sigma`` where both have a finite positive epsilon; from a single
    such point, ``offset`` (:func:`_offset_step`, with ``aim`` and the run) steps instead
    where it finds a point. At epsilon 0 the step aims at twice ``aim`` above 0, four
    times further with each point at 0 (how far below the accountant's 0 lies is
    unknown; the next point likely brackets the answer, and points at 0 cost little).
    Steps are at most 0.05 in log sigma: epsilon
    is near linear only within 2% of where it reaches 0."""
    value = known[sigma]
    if previous is not None and 0 < known[previous] < math.inf and 0 < value < math.inf:
        measured = (known[previous] - value) / math.log(sigma / previous)
        if measured > 0:
            rate = measured
    elif offset is not None and 0 < value < math.inf:
        found = offset(sigma, value, rate)
        if found is not None:
            return found
    zeros = sum(1 for epsilon in known.values() if epsilon == 0)
    return sigma * math.exp(min(max(_epsilon_step(value, aim, zeros, rate), -0.05), 0.05)), rate


def _offset_step(sigma: float, value: float, rate: float, aim: float, q: float, steps: int,
                 delta: float) -> tuple | None:
    """``(sigma, rate)``: where the accountant's epsilon, ``value`` at ``sigma``, meets
    ``aim`` near its zero, by the coarse PLD on the finest of
    :data:`_EXTRAPOLATION_GRIDS` moved by its offset from the accountant at ``sigma``
    (secant steps from ``rate``, -d epsilon / d log sigma, to within
    :data:`_OFFSET_TOLERANCE` of ``aim``, up to :data:`_OFFSET_EVALUATIONS`), and that
    PLD's rate over its last step; None where its value is 0 or infinite, or its rate
    more than :data:`_OFFSET_RATES` times off ``rate`` (a jump of its grid).

    Near the zero each grid lies above the accountant by about a constant
    (:func:`_extrapolated_epsilon`), so its rate is the accountant's, measured across the
    step itself: ``rate`` is a guess from afar. At q 2.03e-6 over 1532 steps (delta
    2.51e-3, target 4.16e-4, 4% below the first point) the accountant's rate across the
    step was 0.0621; the search's guess, 0.0558 (from the extrapolation's last points),
    landed 0.5% below the aim, outside the band, and a third evaluation followed. The
    grid of 2^16 points gives 0.0626 across the step and lands 0.03% from the aim."""
    def grid(x: float) -> float:
        return coarse_epsilon([(math.exp(x), q, steps)], delta, _EXTRAPOLATION_GRIDS[-1])

    x = math.log(sigma)
    at = grid(x)
    wanted = at + aim - value  # the grid's value where the accountant's is aim
    if not 0.0 < at < math.inf or wanted <= 0.0:
        return None
    measured = rate
    for _ in range(_OFFSET_EVALUATIONS):
        step = min(max((at - wanted) / measured, -0.05), 0.05)
        there = grid(x + step)
        if step == 0.0 or not 0.0 < there < math.inf:
            return None
        x, at, measured = x + step, there, (at - there) / step
        if not 1.0 / _OFFSET_RATES < measured / rate < _OFFSET_RATES:
            return None
        if abs(at - wanted) <= _OFFSET_TOLERANCE * aim:
            break
    return math.exp(x), measured


#: :func:`_offset_step`'s tolerance, a share of the aim: a tenth of the band's half width.
_OFFSET_TOLERANCE = 1e-4

#: :func:`_offset_step`'s most evaluations.
_OFFSET_EVALUATIONS = 4

#: :func:`_offset_step` gives up where the grid's rate is more than this many times off the guess.
_OFFSET_RATES = 3.0


def _epsilon_step(value: float, aim: float, zeros: int, rate: float) -> float:
    """The step in log sigma near zero from a point with epsilon ``value`` towards
    ``aim`` at ``rate`` (-d epsilon / d log sigma); from a 0 (the ``zeros``-th point at
    0), towards 2, 8, 32... times ``aim`` above 0. Callers clip it to 0.05."""
    return (value - aim if value != 0.0 else -aim * 2.0 ** (2 * zeros - 1)) / rate


def _solve(eps_of, target: float, start: float, close: bool = False, max_evaluations: int = 0,
           slope: float = 2.0, tolerance: float = _CALIBRATION_TOLERANCE, resolution: float = 1e-12) -> float:
    """A sigma with ``target (1 - tolerance) <= eps_of(sigma) <= target``, or else the
    smallest evaluated feasible sigma once the bracket cannot shrink further.

    Every returned sigma has been evaluated and found feasible, so the answer never
    overshoots the target whatever the shape of ``eps_of``. ``close`` says the answer is
    known to lie a few percent below ``start`` (the PLD below the RDP answer).
    ``max_evaluations`` (0: no limit) is for steering searches, whose answer only
    starts another: past it, the smallest feasible sigma seen (or the largest tried).
    ``tolerance``: the share below the target that is close enough; ``resolution``: the
    relative width of a bracket on sigma at which the search stops (with its feasible end).
    """
    floor = target * (1.0 - tolerance)
    known: dict[float, float] = {}

    class _Enough(Exception):
        pass

    def f(sigma: float) -> float:
        if sigma not in known:
            if max_evaluations and len(known) >= max_evaluations:
                raise _Enough
            known[sigma] = eps_of(sigma)
        return known[sigma]

    try:
        return _solve_with(f, target, floor, start, close, slope, resolution)
    except _Enough:  # a steering search out of evaluations: its point nearest the target
        return _nearest(known, target, tolerance)


def _nearest(known: dict, target: float, tolerance: float) -> float:
    """Of a steering search's ``known`` points, the one whose epsilon lies nearest the
    target in log where that is within ``tolerance`` of it, on either side (a start a
    little above the target steers as well as one below); else the smallest feasible
    sigma (else the largest tried). Near the sigma where epsilon reaches 0 the feasible
    end of the bracket may be a zero, which gives the steering model nothing to scale
    (q 8.9e-6, 3,399 steps, delta 0.019, target 8.86e-4: the coarse PLD 0 at sigma
    0.2223, 8.90e-4 at 0.2198, and from the zero the accountant bisected ten times)."""
    near = {sigma: abs(math.log(value / target)) for sigma, value in known.items() if 0 < value < math.inf}
    best = min(near, key=near.get, default=None)
    if best is not None and near[best] <= tolerance:
        return best
    feasible = [sigma for sigma, value in known.items() if value <= target]
    return min(feasible) if feasible else max(known)


def _solve_with(f, target: float, floor: float, start: float, close: bool, slope: float,
                resolution: float = 1e-12) -> float:
    """:func:`_solve` on the memoised ``f``: a feasible point up from ``start``, steps
    down along a power law to an infeasible one, then :func:`_illinois`."""
    # Bracket: high feasible (eps <= target), low infeasible (eps > target).
    high = start
    while f(high) > target:
        high *= 1.02 if close else 4.0
        if high > _SIGMA_MAX:
            raise ValueError(
                f"target_epsilon {target!r} cannot be met: even noise_multiplier {_SIGMA_MAX:g} "
                f"gives epsilon {f(high / 4.0):.3g}"
            )
    if f(high) >= floor:
        return high
    # Step down to an infeasible point, aiming at the target along a power law: epsilon
    # ~ sigma^-k with k from the last two feasible points (2 before there are two), each
    # step a factor between 0.5 and 0.9995 (0.25 and 0.5 without a close start).
    def step_down(sigma: float, previous: float | None) -> float:
        value = max(f(sigma), 1e-300)
        k = slope
        if previous is not None and f(previous) > 0 and previous != sigma:
            k = min(max(math.log(value / f(previous)) / math.log(previous / sigma), 1.0), 50.0)
        # aimed at the middle of the accepted band, so that a good step lands in it
        factor = (value / (target * (1.0 - _CALIBRATION_TOLERANCE / 2))) ** (1.0 / k)
        return sigma * min(max(factor, 0.5 if close else 0.25), 0.9995 if close else 0.5)

    low, previous = step_down(high, None), None
    while f(low) <= target:
        if f(low) >= floor:
            return low
        previous, high = high, low
        low = step_down(high, previous)
        if low < 1e-9:
            return high
    return _illinois(f, target, floor, low, high, resolution=resolution)


def _illinois(f, target: float, floor: float, low: float, high: float, earlier=(),
              resolution: float = 1e-12, rate: float | None = None, offset=None) -> float:
    """Illinois regula falsi on a decreasing g(x) that is 0 in the middle of the accepted
    band, x = log sigma, from the bracket ``low`` (infeasible) .. ``high`` (feasible), so
    that a hit lands inside the band; returns a feasible evaluated sigma. From three
    points on, the step is inverse quadratic through the last three where it falls inside
    (as in Brent's method): regula falsi alone creeps in from one side (:func:`_bracket_step`).

    g is log epsilon - log aim, except near the sigma where epsilon reaches 0
    (:func:`_near_zero`), where g is epsilon / aim - 1: epsilon is near linear there, its
    logarithm not. ``resolution``: the search ends with the feasible end once the bracket is
    this narrow in log sigma, after one more interpolated point (a steep slope, not a jump,
    may hold the band); near zero, where a tiny step in sigma moves epsilon a lot, this
    divided by half the least slope of g seen across the bracket. ``rate`` (-d epsilon / d
    log sigma, for :func:`_bracket_step`, with ``offset``, :func:`_offset_step`): the
    bracket lies there (too narrow for :func:`_near_zero`: 1.4e-5 in log sigma at q 2.1e-5,
    1.9e7 steps, delta 0.04)."""
    aim, linear = target * (1.0 - _CALIBRATION_TOLERANCE / 2), [False]
    single = offset and rate and (lambda x, value: offset(math.exp(x), aim * (value + 1.0), rate))

    def g(sigma: float) -> float:
        value = f(sigma)
        if linear[0]:
            return value / aim - 1.0 if value < math.inf else 745.0
        return (math.log(value / aim) if 0 < value < math.inf else (-745.0 if value == 0 else 745.0))

    ends = [low, high]  # the evaluated sigmas at the bracket's ends
    history = [sigma for sigma in earlier if sigma not in (low, high)] + [low, high]  # all evaluated, oldest first
    side, slope, g_low, g_high, last_try = 0, math.inf, 0.0, 0.0, False
    for _ in range(200):
        x_low, x_high = math.log(ends[0]), math.log(ends[1])
        near = rate is not None or _near_zero(history, f, *ends)
        if side == 0 or near != linear[0]:
            linear[0] = near
            g_low, g_high, side = g(ends[0]), g(ends[1]), 0  # no Illinois halving carried over
        if linear[0]:  # epsilon's slope here, per unit of log sigma: the smallest seen
            slope = min(slope, (g(ends[0]) - g(ends[1])) / (x_high - x_low))
        narrow = x_high - x_low < resolution / max(1.0, slope / 2.0 if linear[0] else 1.0)
        if narrow and last_try:
            break
        last_try = last_try or narrow  # once more (q 0.091, delta 0.061: 1% over 1.1e-4, the band inside)
        # Near zero, points at epsilon 0 say only that sigma_0 lies below them.
        usable = [sigma for sigma in history if not linear[0] or 0 < f(sigma) < math.inf]
        x = _bracket_step([(math.log(sigma), g(sigma)) for sigma in usable[-3:]], (x_low, g_low), (x_high, g_high),
                          linear[0], math.isinf(f(ends[0])) or f(ends[1]) == 0, rate and rate / aim, single)
        sigma = math.exp(x)
        history.append(sigma)
        if f(sigma) > target:
            ends[0], g_low = sigma, g(sigma)
            if side == -1:
                g_high /= 2.0
            side = -1
        else:
            ends[1], g_high = sigma, g(sigma)
            if f(sigma) >= floor:
                return sigma
            if side == 1:
                g_low /= 2.0
            side = 1
    return ends[1]  # evaluated and feasible (exp(log(sigma)) may differ from sigma in the last bit)


#: Log epsilon falling faster than this per unit of log sigma marks the approach to the
#: sigma where epsilon reaches 0 (see :func:`_near_zero`).
_STEEP = 50.0

#: ... measured over at least this much log sigma: across a narrower baseline a jump of
#: the accountant (at most a few percent, where its grid changes) could look as steep.
_STEEP_BASELINE = 2e-3


def _near_zero(evaluated, f, low: float, high: float) -> bool:
    """Whether the bracket ``low`` (infeasible) .. ``high`` (feasible) lies where epsilon
    nears 0 and is close to linear in sigma: epsilon is 0 at ``high``, or log epsilon
    falls faster than :data:`_STEEP` per unit log sigma from the nearest ``evaluated``
    sigma at least :data:`_STEEP_BASELINE` below ``high`` with a finite positive epsilon.

    At epsilon 0 the hockey-stick divergence is the total variation distance, smooth in
    sigma, and its slope in epsilon is minus the chance of a positive loss, so near the
    sigma where it equals delta epsilon is about linear in sigma, a(sigma_0 - sigma),
    while log epsilon runs off to minus infinity: its log-log slope sigma / (sigma_0 -
    sigma) exceeds :data:`_STEEP` within 2% of sigma_0."""
    if f(high) == 0.0:
        return 0.0 < f(low) < math.inf
    edge = math.log(high) - _STEEP_BASELINE
    below = [sigma for sigma in evaluated if math.log(sigma) <= edge and 0.0 < f(sigma) < math.inf]
    if not below or not 0.0 < f(high) < math.inf:
        return False
    sigma = max(below)
    return _falls_steeply(f(sigma), f(high), math.log(high / sigma))


def _falls_steeply(larger: float, smaller: float, width: float) -> bool:
    """Whether epsilon falling from ``larger`` to ``smaller`` (both positive) over
    ``width`` in log sigma falls faster than :data:`_STEEP` in log epsilon."""
    return width > 0 and math.log(larger / smaller) > _STEEP * width


def _bracket_step(points: list, low: tuple, high: tuple, linear: bool, open_end: bool,
                  rate: float | None = None, single=None) -> float:
    """:func:`_illinois`' next x inside the bracket ``low`` .. ``high`` (``(x, g)`` at its
    ends, g halved by Illinois where an end got stale).

    Near zero (``linear``) the secant through the last two ``points``, those with a
    positive epsilon, left of the root, where log epsilon falls steeply between them:
    the convex epsilon's secants land a little short of it, so each step stays
    infeasible or lands in the band, closing in superlinearly (a parabola through three
    can overshoot far into the zeros); from a single such point, the step ``single``
    finds from it (``(x, g) -> (sigma, rate)`` or None, :func:`_offset_step`), else a
    step at ``rate`` (-dg / dx, where given: bisecting towards a 0 from 1.09 times the
    target, 1% of sigma above the answer, landed at 0.45 times it). Elsewhere the
    parabola through the last three points where it falls inside. Failing that, regula
    falsi on the ends, or a bisection where an end's epsilon is 0 or infinite
    (``open_end``: it says little of the slope). Steps keep a margin of 1e-3 of the
    bracket from its ends (a secant near zero only from the low end: a feasible end at 0
    may lie far off)."""
    (x_low, g_low), (x_high, g_high) = low, high
    margin = 1e-3 * (x_high - x_low)
    if linear and len(points) >= 2:
        (x0, g0), (x1, g1) = points[-2:]
        # Far from the zero (log epsilon falls less than _STEEP between them) epsilon is
        # strongly convex and its secants creep: bisect towards the zero instead.
        steep = _falls_steeply(g0 + 1.0, g1 + 1.0, abs(x1 - x0))  # g + 1: epsilon / aim
        x = x1 - g1 * (x1 - x0) / (g1 - g0) if g1 != g0 and steep else math.nan
        if x_low < x <= x_high - margin:
            return x
    if linear and len(points) == 1 and rate:
        found = single(*points[0]) if single else None  # (x, rate) or None
        x = math.log(found[0]) if found else points[0][0] + points[0][1] / rate
        if x_low < x <= x_high - margin:
            return x
    x = _inverse_quadratic(points) if not linear else math.nan
    if x_low + margin <= x <= x_high - margin:
        return x
    if open_end or g_high == g_low:
        return 0.5 * (x_low + x_high)
    x = x_high - g_high * (x_high - x_low) / (g_high - g_low)
    return min(max(x, x_low + margin), x_high - margin)


def _inverse_quadratic(points) -> float:
    """The x where the parabola x(g) through three ``(x, g)`` points has g = 0 (NaN
    unless there are three points with distinct, finite, unclamped g)."""
    if len(points) < 3:
        return math.nan
    (x0, g0), (x1, g1), (x2, g2) = points
    gs = (g0, g1, g2)
    if len(set(gs)) < 3 or not all(abs(g) < 700.0 for g in gs):
        return math.nan
    return (x0 * g1 * g2 / ((g0 - g1) * (g0 - g2)) + x1 * g0 * g2 / ((g1 - g0) * (g1 - g2))
            + x2 * g0 * g1 / ((g2 - g0) * (g2 - g1)))


def max_steps(
    noise_multiplier,
    sample_rate,
    delta,
    max_epsilon,
    ledger=(),
    accountant: str = "pld",
    limit=None,
) -> int:
    """The largest ``k`` such that ``ledger`` plus ``k`` steps at ``(sigma, q)`` has epsilon
    at most ``max_epsilon``.

    Returns 0 if the ledger alone already exceeds the budget, and
    :data:`UNLIMITED_STEPS` if the budget is never exhausted (``sigma = inf`` or
    ``max_epsilon = inf``) or lasts beyond 2**62 steps. Uses ``O(log k)`` epsilon
    evaluations: the RDP bound in closed form gives a starting point (PLD never exceeds
    RDP, so it is within budget), a gallop finds a point beyond the budget, and a
    bracketed interpolation search on the accountant itself finishes.

    ``limit`` (a step count): the answer is at most ``limit``, exactly ``min(k, limit)``,
    and the search goes no further. Far beyond the 10^8 steps the accounting is tuned
    for, it takes seconds to minutes (sigma 10, q 1e-4, a budget of 8: 2.8*10^10 steps
    in about 30 s), where asking whether ``limit`` steps fit takes one evaluation or
    none (RDP's closed form often says so already). The optimizers' budget stop asks
    for :data:`~dpoptim.spending.BUDGET_HORIZON` steps at a time.
    """
    name = _check_accountant(accountant)
    sigma = check_noise_multiplier(noise_multiplier)
    q = check_sample_rate(sample_rate)
    delta = check_delta(delta)
    budget = check_epsilon(max_epsilon, "max_epsilon")
    top = _SEARCH_END if limit is None else min(check_count(limit, "limit"), _SEARCH_END)
    base = Ledger(ledger)

    def eps(k: int) -> float:
        return epsilon_of_ledger(base.compose(sigma, q, k), delta, name)

    if eps(0) > budget:
        return 0
    if math.isinf(budget) or math.isinf(sigma) or top == 0:
        return UNLIMITED_STEPS if limit is None else top
    # RDP in closed form: the exact answer for the RDP accountant up to rounding, and a
    # lower bound for PLD, which never exceeds RDP.
    low = _max_steps_rdp(sigma, q, delta, budget, base, top)
    if low >= top:
        return UNLIMITED_STEPS if limit is None else top
    if low == 0 and eps(1) > budget:
        return 0  # not one more step fits: no search (where RDP allows none, often so)
    # The search runs on a quick PLD that keeps the ledger's groups fixed, on a grid 8
    # times coarser than the accountant's and held fixed over the candidates (so each
    # candidate costs one power of one cached transform). Its bias is then measured at
    # its answer against the accountant and divided out, the search repeated, and the
    # answer settled on the accountant itself: k fits and k + 1 does not.
    if name != "pld" or steering_epsilon(base, sigma, q, 0, delta, grid_points=_STEERING_GRID) is None:
        found = _search_steps(eps, budget, low, top)
    else:
        found = _steered_search(eps, sigma, q, delta, budget, base, low, top)
    if found < top:
        return found
    return UNLIMITED_STEPS if limit is None else _settle_limit(eps, budget, low, top)


def _settle_limit(eps, budget: float, low: int, top: int) -> int:
    """:func:`max_steps` where its search reached a ``limit`` of ``top`` steps: the searches
    end there without checking that it fits (the steering is a few percent off the
    accountant), so the accountant settles it; ``low``: RDP's answer (fits, up to
    rounding)."""
    if eps(top) <= budget:
        return top
    return _last_feasible(eps, budget, low if eps(low) <= budget else 0, top)


def _steered_search(eps, sigma, q, delta, budget: float, base: Ledger, low: int, limit: int) -> int:
    """:func:`max_steps` for the PLD: a search on :func:`steering_epsilon` (the ledger's
    groups and a grid fixed over the candidates), its bias measured at its answer and
    divided out, the search repeated, and the answer settled on ``eps`` itself."""
    # One grid for all candidates up to a cap, raised fourfold when passed. The cap starts
    # at four times a guess: the RDP count at the budget scaled by how much RDP
    # over-reports the ledger so far.
    ratio = epsilon_of_ledger(base, delta, "rdp") / max(eps(0), 1e-300) if base.steps else 1.0
    guess = _max_steps_rdp(sigma, q, delta, budget * min(max(ratio, 1.0), 4.0), base, limit)
    cap = [4 * max(low, guess, 16)]
    bias = [1.0]

    def steer(k: int) -> float:
        if k > cap[0]:
            cap[0] = 4 * k
        value = steering_epsilon(base, sigma, q, k, delta, grid_count=cap[0], grid_points=_STEERING_GRID)
        # No grid fits so many steps: steer as if over budget (the settle below decides).
        return math.inf if value is None else value * bias[0]

    if base.steps:
        # The steering keeps the ledger's groups at their corners, which the accountant
        # may account closer (as mixtures, see mixture.py): start from its ratio at k = 0
        # (where there is one: a ledger whose epsilon is still 0 has none).
        spent, steered = eps(0), steer(0)
        if 0.0 < spent < math.inf and 0.0 < steered < math.inf:
            bias[0] = spent / steered
    found = _search_steps(steer, budget, low, limit)
    if found >= limit:
        return limit
    if found > 0:
        first, first_value = found, eps(found)
        steered = steer(found)
        if not (0.0 < first_value < math.inf and 0.0 < steered < math.inf):
            # No ratio to divide out (an epsilon of 0 where q T is near delta, or a step
            # count beyond every grid): search from the first answer, galloping by a
            # part in 4096 of it (about the steering's own error, measured there).
            return _search_steps(eps, budget, found, limit, first_step=max(1, found // 4096))
        bias[0] *= first_value / steered
        found = _search_steps(steer, budget, found, limit, first_step=max(1, found // 64))
        if found >= limit:
            return limit
        # The bias still drifts with k (the accountant regroups the ledger with the new
        # pair): a secant through its values at both answers lands within a step or two.
        value = eps(found)
        if found != first and value != first_value and math.isfinite(value) and math.isfinite(first_value):
            guess = found + (budget - value) * (first - found) / (first_value - value)
            spread = abs(first - found)
            found = min(max(int(guess), found - spread, 0), found + spread)
    return _settle(eps, budget, found, limit)


#: Where :func:`max_steps` stops searching: a budget that lasts longer is unlimited.
_SEARCH_END = 2**62

#: Grid of the quick PLD that steers max_steps' search.
_STEERING_GRID = 2**15


def _search_steps(eps, budget: float, low: int, limit: int, first_step: int = 0) -> int:
    """Largest k with eps(k) <= budget, from a start ``low`` that usually fits, galloping
    up from ``low`` by ``first_step`` (default ``low / 8``), then twice that, ..."""
    if low > 0 and eps(low) > budget:  # rounding, or a coarsened long ledger
        low = _last_feasible(eps, budget, 0, low)
    # Gallop up for a point over budget, then narrow the bracket (low in, high out).
    step = first_step or max(1, low // 8)
    high = low + step
    while eps(high) <= budget:
        low, step = high, 2 * step
        high = low + step
        if high >= limit:
            return limit
    return _last_feasible(eps, budget, low, high)


def _settle(eps, budget: float, k: int, limit: int) -> int:
    """From a guess ``k``, the nearest ``k'`` with ``eps(k') <= budget < eps(k' + 1)``,
    galloping from ``k`` in steps of 1, 2, 4, ... (the caller has checked ``eps(0)``)."""
    if eps(k) <= budget:
        step, low = 1, k
        while eps(low + step) <= budget:
            low, step = low + step, 2 * step
            if low + step >= limit:
                return limit
        return _last_feasible(eps, budget, low, low + step)
    step, high = 1, k
    low = max(high - step, 0)
    while low > 0 and eps(low) > budget:
        high, step = low, 2 * step
        low = max(high - step, 0)
    return _last_feasible(eps, budget, low, high)


def _max_steps_rdp(sigma, q, delta, budget, base: Ledger, limit: int) -> int:
    """Largest k with RDP epsilon of base + k steps <= budget, in closed form.

    epsilon(k) = min over orders of R_base + k r + c (c the conversion term), so
    k <= (budget - c - R_base) / r at the best order.
    """
    per_step = np.asarray(rdp_subsampled_gaussian(sigma, q))
    base_rdp = ledger_rdp(base.runs) if base.steps else np.zeros_like(per_step)
    room = budget - conversion_terms(DEFAULT_ORDERS, delta) - base_rdp
    with np.errstate(divide="ignore", invalid="ignore"):
        counts = np.where(per_step > 0, room / per_step, np.where(room >= 0, np.inf, -np.inf))
    counts = counts[~np.isnan(counts)]
    best = float(counts.max()) if counts.size else 0.0
    if best >= limit:
        return limit
    # -inf (or NaN) where the ledger or the new steps are noiseless: RDP has no guarantee
    # for them, the PLD accounts them exactly, and the search starts from 0.
    return math.floor(best) if best > 0.0 else 0


def _last_feasible(eps_of, budget: float, low: int, high: int) -> int:
    """Given eps_of(low) <= budget < eps_of(high), the largest feasible k in between.

    Interpolation on epsilon (smooth in k) proposes the next point; a round that fails
    to halve the bracket is followed by a bisection, so the count of evaluations stays
    O(log(high - low)) and is usually a handful. After two such rounds only bisection
    is left: epsilon is then no line there (it jumps from 0 where ``q T`` crosses delta
    at tiny sigma), and interpolating would only take one step off an end each time.
    """
    values = {low: eps_of(low), high: eps_of(high)}
    bisect, failed = False, 0
    while high - low > 1:
        width = high - low
        if bisect or failed >= 2 or not math.isfinite(values[high]):
            k = (low + high) // 2
        else:
            fraction = (budget - values[low]) / (values[high] - values[low])
            k = min(max(low + int(round(fraction * width)), low + 1), high - 1)
        values[k] = eps_of(k)
        if values[k] <= budget:
            low = k
        else:
            high = k
        bisect = not bisect and 2 * (high - low) > width
        failed += bisect
    return low
