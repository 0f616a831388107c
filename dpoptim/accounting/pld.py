r"""Privacy loss distribution (PLD) accounting for the Poisson-subsampled Gaussian.

**The quantity.** For a pair of output distributions :math:`(P, Q)` the privacy loss is
:math:`L = \log(P/Q)` with :math:`z \sim P`, and the tight privacy profile is

.. math::
    \delta(\varepsilon) = \mathbb E_P\big[(1 - e^{\varepsilon - L})_+\big],

with losses of :math:`+\infty` counting fully. Composition adds independent losses, so
the profile of a ledger is that of the *convolution* of the per-step loss distributions
(Sommer, Meiser & Mohammadi 2019; Koskela, Jälkö & Honkela 2020, "Computing Tight
Differential Privacy Guarantees Using FFT"). Under add/remove adjacency one step is
either of the pairs (Mironov, Talwar & Zhang 2019 notation)

* remove: :math:`P = (1-q)\mathcal N(0,\sigma^2) + q\mathcal N(1,\sigma^2)`,
  :math:`Q = \mathcal N(0,\sigma^2)`, loss :math:`\log(1 - q + q\,r(z))`;
* add: :math:`P = \mathcal N(0,\sigma^2)`, :math:`Q` the mixture, loss
  :math:`-\log(1 - q + q\,r(z))`,

with :math:`r(z) = e^{(2z-1)/(2\sigma^2)}`. A neighbouring pair stays in one direction for
the whole run, so each direction is composed over the whole ledger and the reported
epsilon is the larger of the two.

**Discretisation (never optimistic).** Losses live on the grid :math:`\ell_i = i h`. Each
bin :math:`(\ell_i, \ell_{i+1}]` keeps its exact :math:`P`- and :math:`Q`-mass and moves
them to its two end points (the "connect-the-dots" construction of Doroshenko, Ghazi,
Kamath, Kumar & Manurangsi 2022, "Connect the Dots: Tighter Discrete Approximations of
Privacy Loss Distributions"). The result is the loss distribution of a genuine pair that
*dominates* the true one: its profile interpolates the true :math:`\delta` at every grid
point linearly in :math:`e^\varepsilon` and so lies above it (the profile is convex in
:math:`e^\varepsilon`). Domination survives composition, so every :math:`\delta` computed
here is an upper bound. Mass below the window moves up to its lowest point (rounding a
loss up never helps); mass above it goes to :math:`+\infty`.

**Composition.** Runs of identical steps are composed at once: the FFT of the step's
distribution on a circular grid of ``n`` points is raised to the power ``count`` and
multiplied over runs, then transformed back: ``O(n log n)`` whatever the number of
steps. The transform works on exponentially *tilted* distributions
(:math:`m_k e^{\theta \ell_k}`, the Esscher transform; tilting commutes with
convolution), which moves the composed mass to the losses that decide :math:`\delta`, so
the transform's rounding noise is small relative to what is read there even for
:math:`\delta = 10^{-10}` after a million steps.
After many steps the composed transform lives on a few hundred low frequencies: each
step's transform is kept (and cached between calls, keyed by the pair and the grid) only
up to the frequency past which its power is below the smallest float64, which changes no
computed value (:func:`_step_prefixes`). The transforms not found in the cache run
together, as one 2-D transform per batch. Grid bottoms snap to a 64th of the window, so
a ledger that grows by a step usually keeps its grid and re-uses every cached transform.
Each step keeps only the grid points between where its loss reaches
:math:`z = -k\sigma` and :math:`z = 1 + k\sigma` (:func:`_tail_ends`), with ``k`` set so
that the mass beyond, over the whole ledger, is at most ``delta / 131072``: above, it
goes to :math:`+\infty` (counted in full), below, it is rounded up.

**Many pairs.** Beyond the group limit, a ledger's pairs are grouped
(:func:`~dpoptim.accounting.ledger.coarsen_runs`) and each group is composed either at
its corner (smallest sigma, largest q: one transform) or, where the grouping's proxy
says it costs less, as rows of mixtures of its four corners (:mod:`.mixture`: four
transforms, mixed per row on the few frequencies where the composed transform lives,
:func:`_mixture_product`).

**The window.** The grid is a window :math:`[a, b)` of ``n`` points of spacing ``h``
(a power of two). Its edges come from Chernoff bounds,
:math:`\Pr[S \ge b] \le \min_\lambda e^{-\lambda b}\,\mathbb E[e^{\lambda S}]`, with
:math:`\log\mathbb E_P[e^{\lambda L}] = \lambda D_{\lambda+1}(P\|Q)` read off the RDP curve
of :mod:`.rdp` (which bounds both directions, MTZ19 Theorem 5) and a factor for the
within-bin spread of connect-the-dots. When rare large losses make that window far
wider than the distribution (tiny ``q``, or few steps), a narrower window is guessed from
the moments and its top certified with the exact moment generating function of the
grid distributions actually composed.

**Error bound.** The reported epsilon is never below the exact one: besides the
dominating discretisation, three terms are *added* to :math:`\delta`, each an upper bound
on what it stands for:

1. wrap-around: the certified Chernoff bound on the composed mass at or above the
   window top (placed so that it is at most ``delta / 65536``), which would otherwise
   alias back into the window (mass wrapping from below can only raise :math:`\delta`);
2. the mass sent to :math:`+\infty` (single-step tails beyond the window);
3. floating point: an entrywise bound on the rounding error of the composed
   distribution (:func:`_rounding_allowance`: the transform's :math:`O(u\log_2 n)`
   forward error, Higham 2002, Sec. 24.1, amplified by the power), multiplied back
   through the tilt. Against an extended-precision computation it exceeds the measured
   error 60 to 200 times for 10^3 to 10^6 steps. Where this allowance is a noticeable
   part of :math:`\delta` (tiny ``q`` with tiny :math:`\delta`, whose heavy loss tail
   forbids a strong tilt), the composition is redone in extended precision.

The grid masses themselves are bounded before they are composed: each step's
connect-the-dots distribution is built from bounds on its bins' masses and cuts that
hold whatever the rounding of the Gaussian tails (:func:`_bin_bounds`), and biased by
them in the accountant's favour (:func:`_connect_the_dots`).

How far above the exact epsilon the answer lies is set by the grid spacing ``h``.
Connect-the-dots keeps each bin's :math:`P`- and :math:`Q`-mass, so composing spreads
the loss by the within-bin variance (at most :math:`h^2/4` per step) and raises its mean
a little, and the reserved ``delta / 65536`` moves epsilon by about a ten-thousandth. The window, hence
``h``, grows like :math:`\sqrt T`, so that spread grows like ``T`` relative to the
loss's own variance, and the mean loss rises by about :math:`T h^2 / 8`. By default the
grid is chosen per ledger, from 2^14 to 2^20 points, until the spread is at most 0.2%
(:func:`_spread_share`) and the mean shift at most 0.1% of epsilon
(:func:`_shift_fine`), which keeps 10^8 steps within about 0.5%; an explicit
``grid_points`` is refined up to 4 times by the spread alone. No
a-priori bound that tight is claimed: the tests and ``benchmarks/bench_accounting.py``
bracket the answer with :func:`pld_epsilon_lower_bound`, a rigorous lower bound: the same
composition of a pair that each step's true one *dominates*, its bins merged onto the
grid by a post-processing (:func:`_dominated_masses`); rounding every loss down instead
(Koskela, Jälkö & Honkela 2020) loses half a bin per step.

The reported epsilon is the smallest of this PLD value, the RDP bound, the
Gaussian-mixture bound of :mod:`.gaussian` (tight for tiny sigma) and the same ledger with
its runs near q = 1 raised to 1 (:func:`_raised_bound`), all sound. Ledgers with
more than 64 distinct ``(sigma, q)`` pairs are grouped pessimistically first, by cost
(:func:`~dpoptim.accounting.ledger.coarsen_runs`). Noiseless steps are exact (see
:func:`_noted_pld_epsilon`).

Full-batch runs (``q = 1``) are exact Gaussian mechanisms: a ledger of only such runs
goes to the analytic Gaussian mechanism (:mod:`.gaussian`), and in a mixed ledger they
are merged into one Gaussian step first.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import threading
from typing import NamedTuple

import numpy as np

from .. import background
from . import ledger as ledger_module
from . import lowfreq, rare, rare_lower, staged, staged_lower
from .gaussian import (
    gaussian_deltas_below,
    gaussian_epsilon,
    gaussian_mu,
    ledger_mixture_epsilon,
    mixture_delta_lower_bound,
    mixture_delta_lower_bound_ceiling,
    mixture_epsilon,
    mixture_epsilon_lower_bound,
)
from .ledger import MAX_DISTINCT_RUNS, Accountant, Ledger, Run, check_count, check_delta, coarsen_runs, member_groups
from .mixture import MixtureGroup, better_than_corners, grouping_blend, mixture_groups, mixture_rdp
from .rdp import DEFAULT_ORDERS, conversion_terms, epsilon_from_rdp, ledger_rdp, rdp_subsampled_gaussian
from .special import finite_abs, log_ndtr, ndtri

__all__ = ["PLDAccountant", "AUTO_GRID_POINTS", "DEFAULT_GRID_POINTS", "pld_epsilon", "pld_epsilon_lower_bound"]

#: Points of the circular loss grid of :func:`pld_epsilon_lower_bound` by default. The
#: accountant itself chooses its grid from :data:`AUTO_GRID_POINTS` unless told.
DEFAULT_GRID_POINTS = 2**18


_U = float(np.finfo(np.float64).eps) / 2  # unit round-off
_EXTENDED_U = float(np.finfo(np.longdouble).eps) / 2  # the same in extended precision
_TAIL_FRACTION = 2.0**-16  # share of delta given to each wrap-around bound
_GAUSS_TAIL = 13.0  # Gaussian components are cut 13 standard deviations out (mass < 1e-38)

_REMOVE, _ADD = "remove", "add"


def pld_epsilon(runs, delta, grid_points: int | None = None, max_groups: int | None = None) -> float:
    """Epsilon of a ledger of ``(sigma, q, count)`` runs by the PLD accountant (``grid_points``
    and ``max_groups``: see :class:`PLDAccountant`)."""
    delta = check_delta(delta)
    grid_points = _check_grid_points(grid_points)
    return _pld_epsilon(Ledger(runs).runs, delta, grid_points, max_groups=_check_max_groups(max_groups))


def search_epsilon(runs, delta, skip: int = 0) -> tuple[float, int | None]:
    """``(epsilon, skippable)`` for a calibration's search: :func:`pld_epsilon` with the last
    ``skip`` (0, 1 or 2) of the two stages of grids composed after its refinement left
    out (:func:`_later_grids`), and with none left out, how many could have been for the
    same answer (None where those stages composed nothing). Each stage only keeps the
    smaller of two sound answers, so what is left out can only raise epsilon: the
    answer is sound, at least :func:`pld_epsilon`'s, and equal to it wherever the stages
    left out would lower nothing."""
    delta = check_delta(delta)
    if skip not in (0, 1, 2):
        raise ValueError(f"skip must be 0, 1 or 2, got {skip!r}")
    return _noted_pld_epsilon(Ledger(runs).runs, delta, None, False, None, True, skip)


def coarse_epsilon(runs, delta, grid_points: int) -> float:
    """:func:`pld_epsilon` on a grid of ``grid_points`` points alone: no split of a rare
    loss (:mod:`.rare`) on a grid of its own. Sound, looser where rounding decides, and
    cheap: what steers a calibration before the accountant finishes it."""
    delta = check_delta(delta)
    return _pld_epsilon(Ledger(runs).runs, delta, _check_grid_points(grid_points), rare_split=False)


def pld_epsilon_lower_bound(runs, delta, grid_points: int | None = None, max_groups: int | None = None) -> float:
    """A rigorous *lower* bound on the exact epsilon of a ledger (never reported as a guarantee).

    The same machinery as :func:`pld_epsilon` run the other way round: groups of pairs
    take their largest sigma and smallest q (:func:`~dpoptim.accounting.ledger.coarsen_runs`
    with ``optimistic=True``), each step's bins are merged into a *dominated* pair on the
    grid (:func:`_dominated_masses`), mass beyond the window is dropped, and the
    wrap-around and floating-point bounds are *subtracted* from delta. Every one of these
    can only lower delta, so the epsilon read off is at most the exact one. The grid is
    chosen per ledger as for :func:`pld_epsilon` but sized for a tenth of epsilon, from
    2^20 to 2^22 points (merging bins loses more than splitting them where a heavy step's
    tail decides); an explicit ``grid_points`` is refined up to 4 times where the spread
    asks. Tests and benchmarks bracket the reported epsilon between the two.

    A ledger of several runs is also bounded by its heaviest runs alone (by RDP, the
    heaviest one, two, ...: :func:`_heaviest_runs_bound`): dropping the other runs'
    outputs is a post-processing, so a sub-ledger's epsilon is at most the ledger's. One
    grid rarely fits a run at tiny sigma (losses in the thousands) beside runs that need
    fine bins, and the whole ledger's bound can then fall far below its heaviest run's
    (1525 against 9082 for sigma 0.0197, q 6e-5, 1988 steps beside sigma 11.2, q 0.0027,
    4 million steps, delta 1e-11). It also takes the bounds of :func:`_many_runs_lower`;
    with full batches, the other runs read against their Gaussian (:func:`_batches_lower`).

    One run is also bounded by the shifted Gaussian mixture's lower twin
    (:func:`~dpoptim.accounting.gaussian.mixture_epsilon_lower_bound`, tight for tiny
    sigma, where one grid cannot follow losses that steep: sigma 0.063, q 0.60, 433,147
    steps, delta 4.2e-10, 249 on the grid, 3.25e7 by the twin, against the reported
    3.28e7). One run of :data:`.staged.MIN_STEPS` steps or more is also bounded in stages
    (:func:`~dpoptim.accounting.staged_lower.staged_lower_epsilon`, the mirror of the
    stages that report it), where one grid cannot follow each step's loss finely enough.
    Where one run's bound is still more than 1% below the reported epsilon, it is also
    bounded with its rare large losses split off and its bulk kept on a fine grid
    (:func:`~dpoptim.accounting.rare_lower.spread_lower_bound`: tiny q over long runs,
    where merging the bulk into one outcome gives up its spread: sigma 0.661, q 1e-6,
    10^8 steps, delta 1e-12, 0.2102 merged, 0.2246 kept, against the reported 0.2249),
    then on :data:`_LOOSE_GRID` points (refined where the spread asks): the grid
    chosen for a tenth of epsilon can be too coarse for a rare heavy loss (sigma 0.23,
    q 1.2e-6, 266,131 steps, delta 2e-9: 19.57 at 2^20 points, 24.159 at 2^21, against
    the reported 24.175).
    """
    delta = check_delta(delta)
    grid_points = _check_grid_points(grid_points)
    runs = Ledger(runs).runs
    bound = _pld_epsilon(runs, delta, grid_points, lower=True, max_groups=_check_max_groups(max_groups))
    if len(runs) == 1 and grid_points is None:
        bound = _one_run_lower(runs[0], delta, bound)
    pairs: dict = {}
    for sigma, q, count in runs:
        if 0.0 < sigma < math.inf and count:
            pairs[sigma, q] = pairs.get((sigma, q), 0) + count
    if 1 < len(pairs) <= MAX_DISTINCT_RUNS:
        ceilings = {pair: epsilon_from_rdp(ledger_rdp(((*pair, count),)), DEFAULT_ORDERS, delta)[0]
                    for pair, count in pairs.items()}
        heaviest = sorted(ceilings, key=ceilings.get, reverse=True)
        if ceilings[heaviest[0]] > bound:  # else its exact epsilon, at most its RDP bound, cannot help
            bound = max(bound, _heaviest_runs_bound(heaviest, pairs, delta, grid_points))
    if len(runs) > 1 and grid_points is None:
        bound = _many_runs_lower(runs, delta, bound, max_groups)
    return bound


def _one_run_lower(run: Run, delta: float, bound: float) -> float:
    """The larger of ``bound`` (one grid's, for the single ``run``) and the other lower
    bounds of one run (see :func:`pld_epsilon_lower_bound`)."""
    sigma, q, count = run
    subsampled = 0.0 < sigma < math.inf and 0.0 < q < 1.0
    if subsampled:
        bound = max(bound, mixture_epsilon_lower_bound(sigma, q, count, delta))
    if count >= staged.MIN_STEPS:
        bound = max(bound, staged_lower.staged_lower_epsilon(sigma, q, count, delta) or 0.0)
    reported = _pld_epsilon((run,), delta, None)
    for direction in (_REMOVE, _ADD):
        if bound < _LOOSE_SHARE * reported and subsampled:
            bound = max(bound, rare_lower.spread_lower_bound((run,), direction, delta, reported))
    if bound < _LOOSE_SHARE * reported:
        bound = max(bound, _pld_epsilon((run,), delta, _LOOSE_GRID, lower=True))
    return bound


#: A ledger of more pairs than the group limit is also bounded with up to this many
#: groups, on :data:`_MANY_GROUPS_GRID` points (refined where the spread asks), where
#: grouping rather than the grid is what its bound loses.
_MANY_GROUPS = 256
_MANY_GROUPS_GRID = 2**18

#: ... and not bounded with its bulk kept on the limit's groups where that raised its
#: bound by more than this factor: grouping, not the grid, loses there.
_GROUPING_LOSES = 1.001


def _many_runs_lower(runs: tuple, delta: float, bound: float, max_groups: int | None) -> float:
    """The larger of ``bound`` (the dominated PLD's, for a ledger of several ``runs``) and
    the other lower bounds of such a ledger.

    A ledger of more distinct pairs than the group limit (no ``max_groups`` asked) is also
    bounded with up to :data:`_MANY_GROUPS` groups on :data:`_MANY_GROUPS_GRID` points:
    there the 64 groups lose more than a coarser grid does (6,536 pairs of 4 steps, sigma
    2.78 to 0.57 while q falls from 5.3e-3 to 3.6e-5, delta 3.1e-10: 0.7964 on 64 groups,
    0.8216 on 256 groups and 2^18 points in 35 s more, against the reported 0.8830
    (0.8662 before the blend of orders) and 0.8339 on 1,024 transforms).

    Where the bound is then still more than 1% below the reported epsilon, and more
    groups did not raise it, the ledger is also bounded with its bulk kept
    (:func:`~dpoptim.accounting.rare_lower.spread_lower_bound`), on its groups at their
    largest sigma and smallest q where it has more pairs than the limit (215 pairs of 780
    steps from sigma 2.87 at q 4.5e-6 to sigma 0.66 at q 3.1e-4, delta 9e-11: 2.2822 on
    the grid, with every pair its own group too, and 2.3034 so, against the reported
    2.3061). Where more groups raised the bound, grouping is what it loses, and the bulk
    kept on the limit's groups loses as much (the 6,536 pairs: 0.7963, in 5 minutes)."""
    counted = tuple(run for run in runs if run.count)
    distinct = len({run[:2] for run in counted})
    limit, grouped = _limit(max_groups), bound
    if distinct > limit and max_groups is None:
        bound = max(bound, _pld_epsilon(runs, delta, _MANY_GROUPS_GRID, lower=True,
                                        max_groups=min(distinct, _MANY_GROUPS)))
    if bound > grouped * _GROUPING_LOSES or not all(0.0 < sigma < math.inf and 0.0 < q < 1.0
                                                    for sigma, q, _ in counted):
        return bound
    reported = _pld_epsilon(runs, delta, None)
    if not bound < _LOOSE_SHARE * reported < math.inf:
        return bound
    bound = max(bound, _rare_runs_lower(counted, delta, reported) if distinct <= limit else 0.0)
    if not bound < _LOOSE_SHARE * reported:
        return bound
    order = _grouping_proxy(counted) if distinct > limit else 2
    steps = tuple(coarsen_runs(counted, limit, optimistic=True, order=order))
    for direction in (_REMOVE, _ADD):
        bound = max(bound, rare_lower.spread_lower_bound(steps, direction, delta, reported))
    return bound


def _rare_runs_lower(runs: tuple, delta: float, cap: float) -> float:
    r"""A lower bound for a ledger of several subsampled ``runs`` (removal), from its runs
    whose sampled steps lose far more than ``cap`` (an upper bound on epsilon), read
    against the other runs' own lower bound; 0 where none applies.

    Under :math:`P` the loss is :math:`L_A + L_B`, independent, for the heavy runs
    :math:`A` and the others :math:`B`, so :math:`\delta(\varepsilon) = \mathbb
    E[\delta_B(\varepsilon - L_A)]`, and :math:`\delta_B` falls with its argument. A step
    loses at least :math:`\log(1 - q)`, so :math:`L_A \ge \ell_0 = \sum c \log(1 - q)`;
    where one sampled step loses :math:`t = \ell - \ell_0` or more, :math:`L_A \ge \ell`,
    and there :math:`\delta_B(\varepsilon - \ell) \ge 1 - e^{\varepsilon - \ell}`. With
    :math:`p` at most that event's chance,

    .. math::
        \delta(\varepsilon) \ge p\,(1 - e^{\varepsilon - \ell})
            + (1 - p)\,\delta_B(\varepsilon - \ell_0),

    which exceeds delta wherever :math:`\delta_B(\varepsilon - \ell_0) > \delta'' =
    (\delta - p (1 - e^{\text{cap} - \ell})) / (1 - p)` and :math:`\varepsilon \le`
    ``cap``: below :math:`B`'s removal lower bound at :math:`\delta''` plus
    :math:`\ell_0`. :func:`pld_epsilon_lower_bound` of :math:`B` bounds the larger
    direction; it is removal's where it lies above addition's upper bound. One grid must
    hold such runs' losses (hundreds) beside bins fine for the others: sigma 0.061 at q
    1.9e-3 over 3 steps and 0.028 at q 1e-5 over 147, beside three runs at sigma 0.40
    to 6.7, delta 0.0171, were bounded at 0.4239 against the reported 0.4327."""
    far = cap + _RARE_MARGIN
    floor_all = math.fsum(count * math.log1p(-q) for _, q, count in runs)
    heavy = [run for run in runs if _sampled_beyond(run, far - floor_all) >= 0.5]
    rest = tuple(run for run in runs if run not in heavy)
    if not heavy or not rest:
        return 0.0
    floor = math.fsum(count * math.log1p(-q) for _, q, count in heavy)
    chance = -math.expm1(math.fsum(count * math.log1p(-q * _sampled_beyond((sigma, q, count), far - floor))
                                   for sigma, q, count in heavy)) * (1.0 - 1e-12)
    rest_delta = (delta - chance * -math.expm1(cap - far)) / (1.0 - chance) * (1.0 + 1e-12)
    if not (chance > delta * 2.0**-10 and 0.0 < rest_delta < 1.0):
        return 0.0
    value = pld_epsilon_lower_bound(rest, rest_delta)
    addition = _compose_and_invert(tuple(tuple(run) for run in rest), {_REMOVE: rest_delta, _ADD: rest_delta}, None)
    if not value > addition[_ADD]:
        return 0.0  # (it may be addition's)
    return min(cap, value + floor)


#: :func:`_rare_runs_lower` takes runs whose sampled steps lose this much more than the cap.
_RARE_MARGIN = 20.0


def _sampled_beyond(run, loss: float) -> float:
    """The chance that a sampled step of ``run`` (removal: its noise centred on 1) loses at
    least ``loss``, rounded down."""
    sigma, q, _ = run
    if loss <= math.log1p(-q):
        return 1.0 - 1e-12
    # log of e^{(2x - 1) / (2 sigma^2)} at that loss: (e^loss - (1 - q)) / q
    exponent = loss + math.log1p(-(1.0 - q) * math.exp(-loss)) - math.log(q)
    x = sigma * sigma * exponent + 0.5
    return float(np.exp(log_ndtr((1.0 - x) / sigma))) * (1.0 - 1e-12)


#: :func:`pld_epsilon_lower_bound` of one run below this share of the reported epsilon
#: is also computed on :data:`_LOOSE_GRID` points.
_LOOSE_SHARE = 0.99
_LOOSE_GRID = 2**21

#: At most this many of a ledger's heaviest runs are bounded as sub-ledgers.
_SUB_LEDGER_RUNS = 4


def _heaviest_runs_bound(heaviest: list, pairs: dict, delta: float, grid_points: int | None) -> float:
    """The largest lower bound of the sub-ledgers of the 1, 2, ... heaviest pairs (by RDP),
    up to :data:`_SUB_LEDGER_RUNS` and short of the whole ledger, while each adds to the
    last (a run that lowers it is one the grid fits badly: the next would too)."""
    best = 0.0
    for size in range(1, min(_SUB_LEDGER_RUNS, len(heaviest) - 1) + 1):
        runs = tuple(Run(*pair, pairs[pair]) for pair in heaviest[:size])
        found = _pld_epsilon(runs, delta, grid_points, lower=True)
        if size == 1 and grid_points is None:
            found = _one_run_lower(runs[0], delta, found)
        if not found > best:
            break
        best = found
    return best


def _check_grid_points(grid_points) -> int | None:
    if grid_points is None:
        return None
    grid_points = check_count(grid_points, "grid_points")
    if grid_points < 2**10:
        raise ValueError(f"grid_points must be >= 1024, got {grid_points}")
    return grid_points


def _check_max_groups(max_groups) -> int | None:
    if max_groups is None:
        return None
    max_groups = check_count(max_groups, "max_groups")
    if max_groups < 1:
        raise ValueError(f"max_groups must be at least 1 (or None for the default {MAX_DISTINCT_RUNS}), got {max_groups}")
    return max_groups


def _blind_share(runs) -> float:
    """1 - prod_r (1 - q_r)^{T_r}, rounded up: the chance that a noiseless step saw the example."""
    log_clean = sum(run.count * math.log1p(-run.sample_rate) if run.sample_rate < 1 else -math.inf
                    for run in runs)
    return min(1.0, -math.expm1(log_clean) * (1.0 + 1e-12))


def _total_variation(runs) -> float:
    r"""The bound :math:`\sum_r T_r q_r (2\Phi(1/(2\sigma_r)) - 1)` on the total variation
    distance between what noisy ``runs`` release with and without the example (computed
    to a few units of rounding, which the caller's margin covers).

    One subsampled Gaussian step is at q times the distance of :math:`\mathcal N(1,
    \sigma^2)` from :math:`\mathcal N(0, \sigma^2)`, :math:`2\Phi(1/(2\sigma)) - 1`; a
    step at distance ``t`` is (0, t)-DP in both directions, and (0, t)-DP steps compose
    to (0, sum of t), adaptively too (basic composition, Dwork et al. 2006). Where that,
    plus the noiseless steps' ``p0``, is at most delta, epsilon is 0 exactly."""
    return math.fsum(run.count * run.sample_rate * math.erf(0.5 / (math.sqrt(2.0) * run.noise_multiplier))
                     for run in runs)


def _hellinger_variation(runs) -> float:
    r"""A bound on the total variation distance between what noisy ``runs`` release with
    and without the example, through the Bhattacharyya coefficient ``BC``: far below
    :func:`_total_variation` over many steps, where the losses average out (computed to a
    few units of rounding, which the caller's margin covers; 1 where it gives nothing).

    The composition, adaptive too, is dominated by the product of the steps' pairs
    (Zhu, Dong and Wang 2022, "Optimal accounting of differential privacy via
    characteristic function", Theorem 10), whose delta at epsilon 0 is their total
    variation, at most :math:`\sqrt{1 - BC^2}` (Le Cam 1986, "Asymptotic methods in
    statistical decision theory"). ``BC`` of a product is the product of the steps',
    each bounded below by :func:`_hellinger_step` (a full-batch step's is
    :math:`e^{-1/(8\sigma^2)}` exactly), and it is symmetric in the pair: one bound
    serves both directions."""
    log_bc = []
    for sigma, q, count in runs:
        if q == 1.0:
            log_bc.append(-count / (8.0 * sigma * sigma))
            continue
        loss = _hellinger_step(sigma, q)
        if not loss < 1.0:
            return 1.0
        log_bc.append(count * math.log1p(-loss))
    return min(1.0, math.sqrt(max(-math.expm1(2.0 * math.fsum(log_bc)), 0.0)))


def _hellinger_step(sigma: float, q: float) -> float:
    r"""A bound on :math:`1 - BC` of one subsampled Gaussian step at q < 1 (inf where
    :math:`1/\sigma^2` is beyond 700): :math:`(1-q)^{-3/2} q^2 (e^{1/\sigma^2} - 1) / 8`.

    Removal's pair :math:`P = (1-q)\mathcal N(0, \sigma^2) + q\,\mathcal N(1, \sigma^2)`,
    :math:`Q = \mathcal N(0, \sigma^2)` has :math:`P/Q = 1 + u` with :math:`u = q(L - 1)
    \ge -q`, ``L`` the Gaussians' likelihood ratio, so :math:`\mathbb E_Q u = 0` and
    :math:`\mathbb E_Q u^2 = q^2(e^{1/\sigma^2} - 1)`. On :math:`u \ge -q`,
    :math:`\sqrt{1+u} \ge 1 + u/2 - k u^2/8` with :math:`k = (1-q)^{-3/2}`: the two sides
    and their slopes agree at 0, and the difference is convex there (its second
    derivative is :math:`k/4 - (1+u)^{-3/2}/4 \ge 0`). So :math:`BC = \mathbb E_Q
    \sqrt{1+u} \ge 1 - k\,\mathbb E_Q u^2 / 8`: for tiny q and large sigma, where
    :math:`qL` stays small, that is the squared Hellinger distance itself."""
    if 1.0 / (sigma * sigma) > 700.0:
        return math.inf
    return (1.0 - q) ** -1.5 * q * q * math.expm1(1.0 / (sigma * sigma)) / 8.0


def _pld_epsilon(runs: tuple, delta: float, grid_points: int | None, lower: bool = False,
                 max_groups: int | None = None, rare_split: bool = True) -> float:
    """The PLD epsilon of validated, merged runs (:func:`_noted_pld_epsilon`)."""
    return _noted_pld_epsilon(runs, delta, grid_points, lower, max_groups, rare_split, 0)[0]


@functools.lru_cache(maxsize=256)
def _noted_pld_epsilon(runs: tuple, delta: float, grid_points: int | None, lower: bool = False,
                       max_groups: int | None = None, rare_split: bool = True, skip: int = 0) -> tuple:
    r"""The PLD epsilon of validated, merged runs, never above the other sound bounds, and
    the later grids' note (``skip``: :func:`search_epsilon`).

    **Noiseless steps** (``sigma = 0``) are exact, not infinite. Such a step releases the
    clipped sum itself, so the worst-case pair is :math:`P = (1-q)\,\delta_0 + q\,\delta_1`
    against :math:`Q = \delta_0`. Over all of them the example was used with probability
    :math:`p_0 = 1 - \prod_r (1 - q_r)^{T_r}`, so (removal) the privacy loss is
    :math:`+\infty` with probability :math:`p_0` and 0 otherwise; (addition) it is the
    constant :math:`c = -\log(1 - p_0)`. Composed with the noisy rest, whose profile is
    :math:`\delta_r(\varepsilon)`, that gives exactly

    .. math::
        \delta_{\text{remove}}(\varepsilon) = p_0 + (1 - p_0)\,\delta_r(\varepsilon), \qquad
        \delta_{\text{add}}(\varepsilon) = \delta_r(\varepsilon - c),

    so epsilon is the noisy rest's at :math:`(\delta - p_0) / (1 - p_0)` (removal) and
    its epsilon plus ``c`` (addition); 0 where :math:`p_0` plus a bound on the rest's total
    variation (:func:`_total_variation`, :func:`_hellinger_variation`) is at most delta,
    infinite when :math:`p_0 \ge \delta` with a noisy rest. The other bounds (RDP, the
    Gaussian mixture) take the noiseless steps by basic composition, at :math:`\delta - p_0`.

    **The minimum of sound bounds**: the PLD's, RDP's (:mod:`.rdp`, at delta without noiseless
    steps: never above the RDP accountant, not even by an ulp), the Gaussian mixture's
    (:func:`~dpoptim.accounting.gaussian.mixture_epsilon`) and with q near 1 raised to 1 (:func:`_raised_bound`)."""
    runs = tuple(run for run in runs if not math.isinf(run.noise_multiplier))
    blind = [run for run in runs if run.noise_multiplier == 0.0]
    noisy = tuple(run for run in runs if run.noise_multiplier > 0.0)
    p0 = _blind_share(blind) if blind else 0.0
    if not noisy or p0 >= delta:
        return (0.0 if not noisy and p0 <= delta else math.inf), None
    if (p0 + min(_total_variation(noisy), _hellinger_variation(noisy))) * (1.0 + 1e-12) <= delta:
        return 0.0, None
    deltas, shift = _noisy_rest(delta, p0, lower)
    if not lower and not blind and len(noisy) == 1 and noisy[0].sample_rate < 1.0:
        if (mixture := _certified_mixture(*noisy[0], delta)) is not None:
            return min(mixture, _full_batch_bound(noisy, deltas, shift)), None
    subsampled = [run for run in noisy if run.sample_rate < 1.0]
    mu = gaussian_mu([run for run in noisy if run.sample_rate == 1.0])  # full batches: one Gaussian of noise 1/mu
    if not subsampled:
        return _shifted_max({d: _gaussian_epsilon_bound(deltas[d], mu, lower) for d in deltas}, shift), None
    rest_delta = (delta - p0) * (1.0 - 1e-12)
    steps, mixture = _grouped(subsampled, max_groups, mu, lower, rest_delta)
    # many pairs: the other bounds on the groups' corners (they dominate it), cheaper and only a ceiling there
    bounded = tuple(Run(*step) for step in steps) if mixture else noisy
    rdp_delta = delta if p0 == 0.0 else rest_delta  # (no difference to round: as the RDP accountant)
    ceiling = math.inf if lower else _other_bounds(bounded, rdp_delta)
    notes: dict = {}
    try:
        early, hint = _ungrouped_split(subsampled, deltas, shift, rare_split and not (lower or mu), steps, max_groups)
        pld = _shifted_max(early or _pld_answer(steps, deltas, grid_points, lower, ceiling, mixture, shift,
                                                rare_split, hint, (skip, notes)), shift)
    except (OverflowError, FloatingPointError, MemoryError):  # pragma: no cover - defensive
        pld = 0.0 if lower else math.inf  # no PLD answer here: the other bounds stand
    if lower:
        return max(pld, _split_lower(tuple(steps), deltas, shift, pld), _batches_lower(steps, mu, deltas, shift)), None
    raised = _raised_bound(runs, delta, deltas, shift, (grid_points, False, max_groups, rare_split))
    best = _costly_rdp_bounds(min(pld, ceiling, raised), bounded, mixture, rdp_delta)
    return best, notes.get(_LATER)


def _pld_answer(steps: list, deltas: dict, grid_points, lower: bool, ceiling: float, mixture, shift: float,
                rare_split: bool, hint: tuple = (math.inf, {}), later: tuple = (0, None)) -> dict:
    """Each direction's PLD epsilon: the stages' (:func:`_staged`) where they settle it,
    else the grid's (:func:`_compose_and_invert`), or each direction's smaller of the two
    where the stages answered unsettled (both are sound upper bounds; taking the smaller
    keeps epsilon continuous where the stages stop settling it). ``hint``: ``(sizing,
    bounds)`` of :func:`_ungrouped_split`, a guess sizing the first grid (see
    :func:`_compose_and_invert`) and sound upper bounds on some directions' epsilons,
    each kept where smaller. ``later``: see :func:`_later_grids`."""
    sizing, bounds = hint
    found = _staged(steps, deltas, shift, ceiling, grid_points is None and not (lower or mixture))
    if found is not None and found.settled:
        return found.epsilons
    epsilons = _compose_and_invert(tuple(steps), deltas, grid_points, lower, ceiling, mixture, shift, rare_split,
                                   sizing, later)
    if found is not None:
        epsilons = _each_smaller(epsilons, found.epsilons)
    return _each_smaller(epsilons, bounds)


def _staged(steps: list, deltas: dict, shift: float, ceiling: float, allowed: bool):
    """Each direction's epsilon of one long run composed in stages (:mod:`.staged`), where
    that applies (``allowed``: an upper bound on the grid of its own choice), a
    :class:`~dpoptim.accounting.staged.Staged`: on two small grids it is tighter and
    quicker than one large grid. Not where another sound bound
    (``ceiling``) is below the RDP guess: the Gaussian mixture of tiny sigma, whose
    epsilon is in the hundred thousands, which the PLD rarely beats.

    Where the stages refuse a run (or it is a little shorter than they take), the runs
    of :func:`.staged.dominating_runs` are composed in stages instead, unsettled: each
    bounds this run too, and the caller keeps each direction's smaller value, so that
    epsilon does not fall where the stages take over (one grid at 2^20 - 1 steps was up
    to 0.37% above the stages at 2^20 steps).
    """
    if not allowed or len(steps) != 1:
        return None
    sigma, q, count = steps[0]
    delta = min(deltas.values())
    guess = _rdp_guess(tuple(steps), delta)
    if ceiling < guess:
        return None
    found = staged.staged_epsilons(sigma, q, count, deltas, guess, shift)
    if found is not None:
        return found
    answers = [staged.staged_epsilons(*run, deltas, _rdp_guess((run,), delta), shift)
               for run in staged.dominating_runs(sigma, q, count, deltas)]
    answers = [answer for answer in answers if answer is not None]
    if not answers:
        return None
    return staged.Staged({d: min(answer.epsilons[d] for answer in answers) for d in deltas}, False)


def _split_lower(steps: tuple, deltas: dict, shift: float, found: float) -> float:
    """The lower bound of :func:`~dpoptim.accounting.rare_lower.split_lower_bound` (each step's
    small losses merged into one outcome): far closer than the grid's where one rare loss
    decides epsilon. ``found``: the grid's lower bound, which sizes its bins (the RDP
    guess where that is 0)."""
    scale = found if found > 0 else _rdp_guess(steps, min(deltas.values()))
    return _shifted_max({d: rare_lower.split_lower_bound(steps, d, deltas[d], scale) for d in deltas}, shift)


def _batches_lower(steps: list, mu: float, deltas: dict, shift: float) -> float:
    r"""A lower bound for a ledger whose full batches make one Gaussian step of ``mu``
    (the last of ``steps``; 0 where ``mu`` is 0) beside the subsampled ones: those steps'
    dominated composition on a grid of their own, read against the Gaussian's exact
    profile (:func:`_kernel_answer`).

    The composed pair is a product, so under :math:`P` its loss is the subsampled
    steps' :math:`S` plus the Gaussian's, independent, and

    .. math::
        \delta(\varepsilon) = \mathbb E_{S}\big[\delta_\mu(\varepsilon - S)\big],
        \qquad \delta_\mu(x) = \Phi\big(\tfrac{\mu}{2} - \tfrac{x}{\mu}\big)
            - e^{x}\,\Phi\big(-\tfrac{\mu}{2} - \tfrac{x}{\mu}\big)

    (Balle & Wang 2018, Theorem 8, for the Gaussian's profile). A dominated pair for the
    subsampled steps (:func:`_dominated_masses`) gives a dominated composition, whose
    profile is the same expectation over its own loss: lowering each mass and rounding
    each loss down (:math:`\delta_\mu` rises with it) only lowers it. One grid cannot
    hold a Gaussian of :math:`\mu` near 50 (losses near :math:`\mu^2/2`, 1,300) beside
    the bins the other steps need, and on it the bound fell to the full batches' own
    epsilon: 1,541 against the reported 1,907 (:math:`\mu` 51, nine other runs, delta
    2.8e-6). Here the window is the subsampled steps' alone. It is composed untilted: the
    kernel reads every loss, also the low ones where mass beyond the window wraps around,
    and a tilt would magnify that mass (23 units of it at sigma 1, q 0.01, 1000 steps
    beside :math:`\mu` 3.16: 18.1046 against an exact epsilon of 18.0575). Untilted,
    what wraps from either side weighs at most its mass, which Chernoff bounds on the
    dominated steps bound (:func:`_below_window`); that is subtracted."""
    steps = tuple(steps[:-1])
    if not (mu > 0 and steps):
        return 0.0
    delta = min(deltas.values())
    last = AUTO_GRID_POINTS[1]
    try:
        grid = _choose_grid(steps, delta, last, 4 * last, _rdp_guess(steps, delta) / 10.0)
    except FloatingPointError:  # pragma: no cover - no window fits: no bound from here
        return 0.0
    kernel = functools.partial(_kernel_answer, mu=mu)
    return _shifted_max(_lower_on(steps, deltas, dataclasses.replace(grid, tilt=0.0), kernel), shift)


def _kernel_answer(masses: np.ndarray, losses: np.ndarray, constant: float, delta: float, mu: float) -> float:
    r"""The largest epsilon at which :math:`c + \sum_k m_k \delta_\mu(\varepsilon - l_k)`
    is certainly above ``delta`` (0 where it is not at 0): ``masses`` lowered by their
    rounding, ``losses`` rounded down, ``constant`` :math:`c \le 0`. The masses are first
    gathered onto at most :data:`_KERNEL_BINS` bins, each at its lowest loss (lowering the
    profile again); the sums are lowered by their rounding, and :math:`\delta_\mu` by a
    bound on the rounding of its logarithms (:func:`~dpoptim.accounting.gaussian.gaussian_deltas_below`)."""
    kept = masses > 0.0
    if not kept.any():
        return 0.0
    masses, losses = masses[kept], losses[kept]  # (losses increase)
    starts = np.arange(masses.size)
    if masses.size > _KERNEL_BINS:
        width = float(losses[-1] - losses[0]) / _KERNEL_BINS
        starts = np.flatnonzero(np.diff(np.floor((losses - losses[0]) / width), prepend=-1.0))
    gathered = np.add.reduceat(masses, starts) * (1.0 - 4.0 * (masses.size + starts.size) * _U)
    at = losses[starts]  # each bin at its lowest loss

    def profile(epsilon: float) -> float:
        return constant + float(np.sum(gathered * gaussian_deltas_below(epsilon - at, mu)))

    if not profile(0.0) > delta:
        return 0.0
    low, high = 0.0, float(at[-1]) + gaussian_epsilon(delta, mu) + 1.0  # there the profile is at most delta
    while high - low > 1e-12 * high:
        middle = 0.5 * (low + high)
        low, high = (middle, high) if profile(middle) > delta else (low, middle)
    return low


#: :func:`_kernel_answer` gathers the masses onto at most this many bins.
_KERNEL_BINS = 2**14


def _grouped(subsampled: list, max_groups: int | None, mu: float, lower: bool,
             delta: float) -> tuple[list, tuple | None]:
    """``(steps, mixture)``: the subsampled runs grouped (:func:`coarsen_runs`) with the
    full-batch Gaussian step of noise multiplier ``1/mu`` (if any) appended; or, for the
    upper bound of a ledger of more distinct pairs than the group limit, mixture groups
    (:mod:`.mixture`, the Gaussian step a group of its own) and their corners as steps.
    With the default limit, fewer mixture groups where they cost next to nothing
    (:func:`_fewest_groups`). Groups are formed by what they cost at the Renyi order that
    decides epsilon, blended with order 2 at small q (:func:`_grouping_proxy`)."""
    limit = _limit(max_groups)
    runs = tuple(subsampled)
    pairs = len({run[:2] for run in runs})
    order = _grouping_proxy(runs) if pairs > limit else 2
    many = not lower and pairs > limit
    fewest, mixture = _fewest_groups(runs, limit, delta, order) if many and max_groups is None else (limit, None)
    steps = coarsen_runs(runs, fewest, optimistic=lower, order=order)
    if many and mixture is None:
        mixture = _mixture(runs, fewest, steps, order)
    if mixture is None and fewest < limit:  # the counts moved since the choice was cached
        steps = coarsen_runs(runs, limit, order=order)
        mixture = _mixture(runs, limit, steps, order)
    if mixture is None:
        return steps + [(1.0 / mu, 1.0, 1)] if mu > 0 else steps, None
    if mu > 0:
        mixture += (MixtureGroup(((1.0 / mu, 1.0),), np.ones((1, 1)), (1,), (1.0 / mu, 1.0, 1)),)
    return [group.corner for group in mixture], mixture


def _limit(max_groups: int | None) -> int:
    """The group limit: ``max_groups``, or :data:`~dpoptim.accounting.ledger.MAX_DISTINCT_RUNS`."""
    return ledger_module.MAX_DISTINCT_RUNS if max_groups is None else max_groups


def _mixture(runs: tuple, limit: int, corners: list, order: int | tuple) -> tuple | None:
    """The mixture groups of ``runs`` within ``limit`` transforms, formed by what they cost
    at the Renyi ``order``, or None where their corners (``corners``, :func:`coarsen_runs`
    at that limit) cost less."""
    mixture = mixture_groups(member_groups(runs, limit, False, order)[1], limit, order)  # coarsen_runs' groups, cached
    anchors = len({anchor for group in mixture for anchor in group.anchors})
    if anchors > limit or not better_than_corners(mixture, corners):  # a limit below 4 fits no box
        return None
    return mixture


#: Fewer mixture groups tried under the default limit, fewest first (the first taken
#: ends the search), and only where every pair's q is at most :data:`_FEWER_GROUPS_RATE` ...
_FEWER_GROUPS = (16, 32)
_FEWER_GROUPS_RATE = 1e-3

#: ... and taken where their RDP curve lies at most this share above the limit's, at
#: every order whose epsilon is within :data:`_RELEVANT_ORDERS` of the best.
_FEWER_GROUPS_SHARE = 2.0**-10
_RELEVANT_ORDERS = 2.0


def _fewest_groups(runs: tuple, limit: int, delta: float, order: int | tuple) -> tuple[int, tuple | None]:
    """``(groups, mixture)``: the first of :data:`_FEWER_GROUPS` (below ``limit``) whose
    mixture costs next to nothing more than the one on ``limit`` groups, else
    ``limit``; and that mixture where it was computed here (None where the choice was
    kept from before, or no mixture beats the corners).

    Each group costs a transform per direction over the whole window, and on a schedule
    that changes slowly a quarter of the groups loses almost nothing: 10^4 runs from
    sigma 1 to 0.8 at q 1e-4 take 16 groups for 0.034% more epsilon in a third of the
    time. Only small q is worth it: there a step's body, about q wide, asks for bins so
    fine that each transform spans 2^18 to 2^20 points; above q 1e-3, 64 groups take a
    few tenths of a second at most (and one schedule there, with one sampled step
    expected and delta deep in its tail, rose by 2.6 times the prediction below).

    What fewer groups cost is predicted by the mixtures' RDP curves
    (:func:`~dpoptim.accounting.mixture.mixture_rdp`): at the orders whose epsilon
    (Canonne, Kamath & Steinke 2020, Prop. 12) is within twice the best, the fewer
    groups' curve may lie at most :data:`_FEWER_GROUPS_SHARE` above. Where measured,
    epsilon rose by 0.3 to 0.6 times the curves' rise, 0.04% at most
    (docs/accounting.md). Where the best order is the smallest (epsilon in the thousands
    and more, at small sigma), the curves predicted a thirtieth of the rise, so the limit
    is kept there. Any grouping is sound (each mixture dominates its steps): the
    prediction only steers the time. The choice is kept by the groups ``limit`` would
    form and ``delta``, so a ledger grown by a step re-uses it (and the transforms of
    its groups)."""
    members = member_groups(runs, limit, False, order)[1]
    key = (tuple((group[0][:2], group[-1][:2]) for group in members), limit, delta, order)
    with _prefix_lock:
        found = _fewest_cache.pop(key, None)
    mixture = None
    if found is None:
        found, mixture = _fewest_of(runs, limit, delta, order)
    return _kept(_fewest_cache, key, found, _FEWEST_CACHE_ENTRIES), mixture


def _fewest_of(runs: tuple, limit: int, delta: float, order: int | tuple) -> tuple[int, tuple | None]:
    """:func:`_fewest_groups`, computed."""
    chosen = limit, _mixture(runs, limit, coarsen_runs(runs, limit, order=order), order)
    if chosen[1] is None or max(run[1] for run in runs) > _FEWER_GROUPS_RATE:
        return chosen
    curve = mixture_rdp(chosen[1], _WINDOW_ORDERS, _window_rdp)
    epsilons = curve + conversion_terms(_WINDOW_ORDERS, delta)
    relevant = epsilons <= _RELEVANT_ORDERS * epsilons.min()
    if not 0.0 < epsilons.min() < math.inf or relevant[0]:
        return chosen
    for fewest in (count for count in _FEWER_GROUPS if count < limit):
        fewer = _mixture(runs, fewest, coarsen_runs(runs, fewest, order=order), order)
        if fewer is not None and np.all(mixture_rdp(fewer, _WINDOW_ORDERS, _window_rdp)[relevant]
                                        <= curve[relevant] * (1.0 + _FEWER_GROUPS_SHARE)):
            return fewest, fewer
    return chosen


#: Choices :func:`_fewest_groups` keeps, the least recently used first.
_FEWEST_CACHE_ENTRIES = 64
_fewest_cache: dict = {}


def _ungrouped_split(subsampled: list, deltas: dict, shift: float, tried: bool, corners: list,
                     max_groups: int | None = None) -> tuple[dict | None, tuple[float, dict]]:
    """Each direction's epsilon by the split of :mod:`.rare` of a ledger's own pairs (more
    than the group limit), or of more pairs than :data:`_UNGROUPED_SPLIT_PAIRS` grouped
    into that many (each group at its smallest sigma and largest q,
    :func:`~dpoptim.accounting.ledger.coarsen_runs`, which dominates its pairs), where a rare
    loss decides epsilon (:func:`_beyond_body`) and the split answers both directions
    without rounding deciding (:func:`_split_first`); else None (the groups' grids answer).
    With it, ``(sizing, bounds)``. ``sizing``: a hint for the mixture groups' first grid,
    where the split of the ledger's own pairs was tried but did not answer, removal's
    answer on the split's grid sized from the RDP guess (a sound upper bound; its own
    grid is cached), else inf. The RDP guess is several times too high there (0.43 for 2
    at q 1e-4), and the grid it sized was refined at once: 100 pairs of 1000 steps, sigma
    1.2 to 0.6, composed 2^17 points for nothing (0.4 s of 2.3 s). Grouped, that hint
    sized grids too fine: 321 runs of two steps took a first grid of 2^18 points, refined
    to 2^20 (6.2 s, against 2.9 s). ``bounds``: sound upper bounds ``{direction: epsilon}``
    that the caller keeps where smaller; where the split did not answer, removal's last
    answer before it stopped.
    ``tried``: whether the split may be tried at all (the split allowed, an upper bound);
    it is, beyond the group limit (``max_groups``, as :func:`_grouped`). ``corners``: the
    groups' corners, on which a ledger of more pairs is first checked (their RDP is at
    hand). A grouped split's answer is the answer under the default group limit; under a
    limit of the caller's choice it is only such a bound, as that many mixture transforms
    can be tighter than the 128 corners: 600 pairs of 43 steps, sigma 2.78 to 0.57 with q
    5.3e-3 to 3.6e-5, delta 3.1e-10, split grouped 0.8721, on 256 transforms 0.8487.

    There the mixture groups need bins far finer than the window the rare losses stretch:
    120 pairs at q 2.1e-5 took 13 s on 2^20 points, where the split of the pairs
    themselves (each run read against one profile of all the bulks) takes 1.5 s and is
    as tight (0.0050900 against 0.0050906). Beyond 128 pairs, grouped: 133 pairs of 165
    steps at q 1e-4 to 3.6e-5, delta 1.4e-11, 0.094927 (the groups: 0.099213; the rigorous
    lower bound 0.094894)."""
    steps = tuple(tuple(run) for run in subsampled)
    pairs, nothing = len({step[:2] for step in steps}), (math.inf, {})
    if not tried or pairs <= _limit(max_groups):
        return None, nothing
    delta = min(deltas.values())
    most = _split_pairs(max_groups)
    grouped = pairs > most
    # (the groups' corners only filter, with slack: the split's own groups decide below)
    if grouped and not (_GROUPED_SPLIT and _beyond_body(tuple(corners), _CORNERS_SLACK * _rdp_guess(tuple(corners),
                                                                                                     delta), delta)):
        return None, nothing
    if grouped:
        steps = tuple(coarsen_runs(subsampled, most, order=_grouping_proxy(tuple(subsampled))))
    guess = _rdp_guess(steps, delta)
    if not _beyond_body(steps, guess, delta):
        return None, nothing
    found = _split_first(steps, deltas, guess, shift=shift, points=_UNGROUPED_SPLIT_POINTS)
    if found is not None:
        return (found, nothing) if max_groups is None or not grouped else (None, (math.inf, found))
    # removal's last answer before its split stopped (its scales are cached): sound, and
    # where the next scale's window did not fit, tighter than the groups' (811 pairs of 9
    # steps at q 5.6e-4 to 2.2e-4: 0.060672 against 0.061103)
    last = rare.split_epsilon(steps, _REMOVE, deltas[_REMOVE], guess, True, _UNGROUPED_SPLIT_POINTS)
    removal = last[0] if last is not None else math.inf
    first = None if grouped else rare.split_epsilon(steps, _REMOVE, deltas[_REMOVE], guess, False,
                                                    _UNGROUPED_SPLIT_POINTS)
    return None, (first[0] if first is not None and first[0] > 0.0 else math.inf, {_REMOVE: removal})


#: :func:`_ungrouped_split` splits ledgers of at most this many pairs, on windows of at
#: most :data:`_UNGROUPED_SPLIT_POINTS`. Each pair's bulk is transformed on the split's
#: fine grid: at 128 pairs 0.3 to 0.6 GB, and 1.4 to 2.7 s (500 pairs: 4.4 GB and 42 s,
#: where the mixture groups take 3 s). Where the windows do not fit, the attempt costs
#: the less: 125 pairs at q 3.8e-5 to 9.2e-5 lost 3 s to it on 2^19 points, 0.4 s on 2^17.
_UNGROUPED_SPLIT_PAIRS = 128
_UNGROUPED_SPLIT_POINTS = 2**17


def _split_pairs(max_groups: int | None) -> int:
    """The most pairs :func:`_ungrouped_split` splits (a ledger of more, grouped into that
    many): :data:`_UNGROUPED_SPLIT_PAIRS` under the default group limit; under a larger
    limit of the caller's choice, twice that limit, up to :data:`_MOST_SPLIT_PAIRS`."""
    return min(max(_UNGROUPED_SPLIT_PAIRS, 2 * _limit(max_groups)), _MOST_SPLIT_PAIRS)


#: :func:`_split_pairs`' cap: 256 pairs' bulks took at most 1.0 GB (12 random ledgers of
#: 228 to 1,908 pairs at q 1.8e-6 to 6.2e-4; 1.75 GB for 250 pairs of 1000 steps at q
#: 1e-5 to 1e-4), 500 pairs up to 4.4 GB.
_MOST_SPLIT_PAIRS = 256

#: Whether a ledger of more pairs than :func:`_split_pairs` gives is split grouped into
#: that many (tests of the mixture groups' own mechanism turn it off).
_GROUPED_SPLIT = True

#: The slack of the cheap first test, on the mixture groups' corners, of whether a rare
#: loss decides: a ledger whose corners put the RDP guess within 2% of the test's edge
#: is grouped for the split and tested there (600 pairs of 43 steps, sigma 2.78 to 0.57
#: while q falls from 5.3e-3 to 3.6e-5, delta 3.1e-10: the guess 3.32243 against an edge
#: of 3.32248 on one grouping's corners, 3.32238 against 3.32090 on another's; the split
#: answers 0.87205, the mixture groups 0.87507).
_CORNERS_SLACK = 1.02


@functools.lru_cache(maxsize=8)
def _grouping_proxy(runs: tuple) -> int | tuple:
    """What a ledger of more pairs than the group limit weighs grouping by: the Renyi
    order that decides epsilon (:func:`~dpoptim.accounting.mixture.deciding_order`, on
    the groups the order-2 proxy forms), read at :data:`_DECIDING_DELTA`, blended with
    order 2 and the orders near it where some q is small
    (:func:`~dpoptim.accounting.mixture.grouping_blend`). Where rare
    losses decide, order 2 alone spreads the groups evenly along a schedule and leaves
    its costliest stretch coarse (6,536 pairs of 4 steps, sigma 2.78 to 0.57 with q
    5.3e-3 to 3.6e-5, delta 3.1e-10: epsilon 1.0259, 0.8662 with the groups formed at
    order 7).

    Not at the caller's delta: the order moves slowly with delta (the 6,536 pairs read
    order 7 at every delta from 1e-13 to 3e-4), but where it moves the groups change, and
    epsilon with them: 80 pairs of 50 steps from sigma 0.8 at q 1e-3 to sigma 1.2 at q
    1e-2 read order 9 below delta 7.48e-4 and 7 above, where epsilon rose by 0.0034
    against 0.0020 between its neighbours 1.7% apart. Where the other order's groups are
    the tighter, epsilon would fall as delta falls; one order per ledger keeps it monotone
    in delta."""
    members = member_groups(runs, ledger_module.MAX_DISTINCT_RUNS, False)[1]
    return grouping_blend(runs, members, _DECIDING_DELTA)


#: The delta at which :func:`_grouping_proxy` reads a ledger's best order (whatever delta
#: the caller asks epsilon at).
_DECIDING_DELTA = 1e-8


def _certified_mixture(sigma: float, q: float, count: int, delta: float) -> float | None:
    """The Gaussian mixture bound where its own lower bound certifies it within 0.1% of the
    exact epsilon (tiny sigma: no PLD grid can do noticeably better), else None. That lower
    bound is summed only where its cheap ceiling does not already rule it out
    (:func:`~dpoptim.accounting.gaussian.mixture_delta_lower_bound_ceiling`: the same
    answer either way)."""
    mixture = mixture_epsilon(sigma, q, count, delta)
    if (0.0 < mixture < math.inf and mixture_delta_lower_bound_ceiling(mixture / 1.001, sigma, q, count) > delta
            and mixture_delta_lower_bound(mixture / 1.001, sigma, q, count) > delta):
        return mixture
    return None


def _noisy_rest(delta: float, p0: float, lower: bool) -> tuple[dict, float]:
    """``(deltas, shift)``: the delta at which each direction of the noisy rest is read,
    and the shift of the add direction's epsilon, when noiseless steps expose the
    example with probability ``p0`` (see :func:`_noted_pld_epsilon`); rounded against the
    answer for the upper bound, exact for the lower one."""
    if p0 == 0.0:
        return {_REMOVE: delta, _ADD: delta}, 0.0
    if lower:
        return {_REMOVE: (delta - p0) / (1.0 - p0), _ADD: delta}, -math.log1p(-p0)
    return {_REMOVE: (delta - p0) / (1.0 - p0) * (1.0 - 1e-12), _ADD: delta}, -math.log1p(-p0) * (1.0 + 1e-12)


def _other_bounds(noisy: tuple, rest_delta: float) -> float:
    """The smallest of the cheap other sound upper bounds on the noisy runs' epsilon at
    ``rest_delta``: RDP on the window's orders (cached), and the Gaussian mixture where it
    can win. The mixture bound gives up the amplification by subsampling: it is above the
    exact epsilon by far more than the PLD's slack unless sigma is small or q large.
    Leaving out a sound bound is always sound.
    """
    best, _ = epsilon_from_rdp(ledger_rdp(Ledger._trusted(noisy), _WINDOW_ORDERS), _WINDOW_ORDERS, rest_delta)
    if min(run[0] for run in noisy) < 0.5 or max(run[1] for run in noisy) > 0.5:
        best = min(best, ledger_mixture_epsilon(noisy, rest_delta))
    return best


def _costly_rdp_bounds(best: float, noisy: tuple, groups, rest_delta: float) -> float:
    """The smaller of ``best`` and the RDP bounds computed only where they could win: on
    all orders (:func:`_all_orders_rdp`, of ``noisy``) and of the mixture ``groups``."""
    return _with_mixture_rdp(min(best, _all_orders_rdp(noisy, rest_delta, best)), groups, rest_delta)


def _with_mixture_rdp(best: float, groups, rest_delta: float) -> float:
    """The smaller of ``best`` and the RDP bound of mixture ``groups`` (None: none) on the
    window's orders, computed only where it could be the smaller. Every step is dominated
    by its row's revealed-coin mixture, whose RDP is the weighted log-mean-exp of its
    anchors' (:func:`~dpoptim.accounting.mixture.mixture_rdp`), and RDP composes by adding
    (Mironov 2017). It lies between the exact pairs' RDP and the groups' corners' (a
    row's weighted mean is at most its heaviest anchor's term), and can be far below the
    corners': where epsilon is in the hundreds of thousands the PLD's bins are coarse and
    RDP all but tight (10^4 runs of 1000 steps, sigma 1.25 to 1.0 and q 0.055 to 0.37:
    204,076 against 224,638 on the 16 groups' corners).

    The log-mean-exp costs 50 ms over 10^4 rows, and the PLD is usually far below it: by
    Jensen a row's log-mean-exp is at least the weighted mean of its anchors' RDP, whose
    sum over the rows is a group's total weight on each anchor times that anchor's curve.
    Where that curve's epsilon is not below ``best``, neither is the mixture's."""
    if not groups:
        return best
    jensen = np.zeros(_WINDOW_ORDERS.size)
    for group in groups:
        weights = (np.asarray(group.counts, dtype=float)[:, None] * group.weights).sum(axis=0)
        jensen += sum(weight * _window_rdp(*anchor) for weight, anchor in zip(weights, group.anchors))
    if not epsilon_from_rdp(jensen, _WINDOW_ORDERS, rest_delta)[0] < best:
        return best
    curve = mixture_rdp(groups, _WINDOW_ORDERS, _window_rdp)
    return min(best, epsilon_from_rdp(curve, _WINDOW_ORDERS, rest_delta)[0])


def _all_orders_rdp(noisy: tuple, rest_delta: float, best: float) -> float:
    """The RDP bound on all of :data:`~dpoptim.accounting.rdp.DEFAULT_ORDERS` where it could
    win: a few percent below the window orders' at most, so only within 10% of ``best``,
    and only on ledgers of a few distinct pairs (else ``inf``)."""
    ledger = Ledger._trusted(noisy)
    if len({run[:2] for run in noisy}) > 4:
        return math.inf
    if not epsilon_from_rdp(ledger_rdp(ledger, _WINDOW_ORDERS), _WINDOW_ORDERS, rest_delta)[0] < 1.1 * best:
        return math.inf
    return epsilon_from_rdp(ledger_rdp(ledger), DEFAULT_ORDERS, rest_delta)[0]


def steering_epsilon(base, sigma: float, q: float, count: int, delta: float, grid_count: int = 0,
                     grid_points: int = DEFAULT_GRID_POINTS) -> float | None:
    """A quick PLD epsilon of ``base`` plus ``count`` steps at ``(sigma, q)``, to steer a search.

    The base ledger's groups are fixed (the new steps stay a group of their own), so
    that every candidate ``count`` re-uses the cached transforms of the base and only
    the new pair's is raised to a new power; the grid is the one for ``grid_count`` new
    steps (when larger than ``count``), so that all candidates up to it share it. Not a
    reported value: callers confirm the answer with :func:`pld_epsilon`. ``None`` where
    the shortcut does not apply (noiseless or full-batch steps).
    """
    groups = _steering_groups(Ledger(base).runs)
    if groups is None or not 0.0 < sigma < math.inf or q >= 1.0:
        return None
    steps = groups + ((sigma, q, max(count, 1)),)
    try:
        grid = _steering_grid(groups, sigma, q, max(count, grid_count, 1), delta, grid_points)
        return max(_both_directions(lambda d: _direction_epsilon(steps, d, grid, delta, head=len(groups))).values())
    except (OverflowError, FloatingPointError, MemoryError):  # pragma: no cover - defensive
        return None


@functools.lru_cache(maxsize=32)
def model_epsilon(sigma: float, q: float, count: int, delta: float, anchor: float, guess: float) -> float | None:
    """A quick PLD epsilon of ``count`` steps at ``(sigma, q)``, to steer a calibration.

    Computed on one grid for every ``sigma``: the one chosen for ``anchor`` and an
    epsilon near ``guess``, of at most :data:`_MODEL_POINTS` points (or, beyond the body
    of the loss, the split's of :mod:`.rare` for ``guess``). The accountant
    chooses its grid for each ledger, and where its spacing halves, its epsilon moves by
    a little; on a fixed grid epsilon is smooth in sigma, so a search near ``anchor``
    converges in a few steps, and a coarser grid's constant offset from the accountant
    is measured and taken out (:func:`~dpoptim.accounting.calibrate.calibrate_noise`).
    Not a reported value, and not an upper bound away from the anchor (the steps' ends
    are the anchor's). ``None`` where there is no grid (q = 1, noiseless steps).

    Where rounding decides the grid's answer it is refined at other tilts and precisions,
    not by the split: the split answers far below the grid where one rare loss decides
    epsilon over many steps, so the model jumped where rounding started to decide (q
    2e-5, 8.3*10^7 steps, delta 1.6e-12: 3.145 at sigma 0.7484, 2.738 at 0.7491, where
    the accountant moves smoothly from 2.744 to 2.738), and its secant steps with it.
    The split is tried only where it answers at the anchor (:func:`_model_splits`), on at
    most :data:`_MODEL_SPLIT_POINTS`: where it fails there it fails nearby too, and trying
    it at every point tripled each evaluation's time (q 1.48e-6, 2,898 steps, delta
    1.6e-3: 0.25 s against 0.09 s).
    Answers are cached: a calibration asks the same points again when it measures the
    model's drift against the accountant.
    """
    if not (0.0 < sigma < math.inf and 0.0 < anchor < math.inf and 0.0 < q < 1.0 and count > 0):
        return None
    try:
        deltas = {_REMOVE: delta, _ADD: delta}
        steps = ((sigma, q, count),)
        if _beyond_body(steps, _rdp_guess(steps, delta), delta) and _model_splits(anchor, q, count, delta, guess):
            early = _split_first(steps, deltas, guess, again=False, points=_MODEL_SPLIT_POINTS)  # sized by ``guess``
            if early is not None:
                return max(early.values())
        grid = _model_grid(anchor, q, count, delta, guess)
        return _shifted_max(_compose_on(steps, deltas, grid, rare_split=False, settle_first=True), 0.0)
    except (OverflowError, FloatingPointError, MemoryError):  # pragma: no cover - defensive
        return None


@functools.lru_cache(maxsize=8)
def _model_splits(anchor: float, q: float, count: int, delta: float, guess: float) -> bool:
    """Whether :func:`model_epsilon` tries the split: where it answers at the ``anchor``."""
    steps = ((anchor, q, count),)
    return (_beyond_body(steps, _rdp_guess(steps, delta), delta)
            and _split_first(steps, {_REMOVE: delta, _ADD: delta}, guess, again=False,
                             points=_MODEL_SPLIT_POINTS) is not None)


#: The largest window of the split in :func:`model_epsilon`, half the accountant's
#: (:data:`_FIRST_SPLIT_POINTS`): near epsilon's zero a split whose bulk needs more (settled
#: on bins four and two times coarser than the asked ones, :func:`.rare._settled_coarser`)
#: cost 0.4 s a point of the model, whose grid costs 0.05 s (q 2.6e-6, 433 steps, delta
#: 3.8e-4: five points, 2.8 s a calibration instead of 2.6 s); at q 1e-6 over 10^6 steps
#: (delta 1e-12) the split it keeps costs 0.09 s and steers the first point into the band.
_MODEL_SPLIT_POINTS = 2**18

#: Largest grid of :func:`model_epsilon`: a quarter of the accountant's largest; where the
#: accountant needs its largest (tiny q), the model is within about 1.5% of its epsilon
#: and 3% of its slope in sigma (measured at q = 1e-6).
_MODEL_POINTS = 2**18


@functools.lru_cache(maxsize=8)
def _model_grid(anchor: float, q: float, count: int, delta: float, guess: float) -> _Grid:
    """The model's grid; where it is coarse for ``guess``, the narrower one of shorter cuts
    if finer (as the accountant then tries, :func:`_shorter_cut_grid`)."""
    steps = ((anchor, q, count),)
    grid = _choose_grid(steps, delta, AUTO_GRID_POINTS[0], _MODEL_POINTS, guess)
    if grid.spacing > _BIN_SHARE * guess:
        shorter = _choose_grid(steps, delta, grid.n, grid.n, guess, tail_fraction=_SHORT_CUT_FRACTION)
        if shorter.spacing < grid.spacing:
            return shorter
    return grid


@functools.lru_cache(maxsize=8)
def _steering_groups(runs: tuple) -> tuple | None:
    runs = [run for run in runs if not math.isinf(run[0])]
    if any(run[0] == 0.0 or run[1] >= 1.0 for run in runs):
        return None
    return tuple(coarsen_runs(runs))


@functools.lru_cache(maxsize=8)
def _steering_grid(groups: tuple, sigma: float, q: float, count: int, delta: float, grid_points: int) -> _Grid:
    return _choose_grid(groups + ((sigma, q, count),), delta, _fft_size(grid_points))


def _raised_bound(runs: tuple, delta: float, deltas: dict, shift: float, settings: tuple) -> float:
    """Epsilon of ``runs`` with its subsampled runs from q of :data:`_NEAR_FULL` on raised to
    q = 1 (each such step a post-processing of its full batch, see
    :func:`_full_batch_bound`), by the PLD accountant (``settings``: its grid points,
    lower, group limit and split), where such runs lie beside others; else with every q
    raised to 1 (:func:`_full_batch_bound`). A full batch joins the one Gaussian step of
    the others: just below q = 1 a run went on the grid instead, whose bins put epsilon
    up to 0.05% above the same ledger at q = 1 (docs/accounting.md).

    Where at most :data:`_RAISED_TIERS` distinct q lie from :data:`_NEAR_FULL` to 1, also
    with the runs from each of them on raised, and the least kept (each a sound bound):
    raising a run of the ledger's own near 1 beside a lowered full batch can cost more
    than it saves (a full batch of 4 steps lowered to q 0.99 beside a run at q 0.92:
    8.5e-5 of epsilon above q = 1, where raising the lowered batch alone gives q = 1's
    value). A ledger raised so holds no other such q, so each is composed once."""
    noisy = tuple(run for run in runs if run.noise_multiplier > 0.0)
    near = {run.sample_rate for run in noisy if _NEAR_FULL <= run.sample_rate < 1.0}
    if not near or all(run.sample_rate >= _NEAR_FULL for run in noisy):
        return _full_batch_bound(noisy, deltas, shift)
    best = math.inf
    for threshold in sorted(near) if len(near) <= _RAISED_TIERS else (_NEAR_FULL,):
        raised = [(s, 1.0 if s > 0.0 and q >= threshold else q, c) for s, q, c in runs]
        best = min(best, _noted_pld_epsilon(Ledger(raised).runs, delta, *settings, 0)[0])
    return best


#: :func:`_raised_bound` raises runs from this q on ...
_NEAR_FULL = 0.9

#: ... and from each q at or above it, where there are at most this many such q.
_RAISED_TIERS = 4


def _full_batch_bound(noisy: tuple, deltas: dict, shift: float) -> float:
    r"""Epsilon of the ``noisy`` runs with every q raised to 1: one Gaussian of
    :math:`\mu = \sqrt{\sum_r T_r / \sigma_r^2}` (Dong, Roth & Su 2019, Gaussian
    Differential Privacy: Gaussian mechanisms compose into one), read at each direction's
    delta and shifted as the noisy rest is (:func:`_noisy_rest`). A sound upper bound: a
    subsampled step's pair is its full-batch pair :math:`(\mathcal N(1,\sigma^2),
    \mathcal N(0,\sigma^2))` post-processed: keep the draw with probability q, else draw
    afresh from :math:`\mathcal N(0,\sigma^2)` (removal, :math:`((1-q)\,\mathcal
    N(0,\sigma^2) + q\,\mathcal N(1,\sigma^2), \mathcal N(0,\sigma^2))`) or from
    :math:`\mathcal N(1,\sigma^2)` (addition, :math:`(\mathcal N(1,\sigma^2),
    q\,\mathcal N(0,\sigma^2) + (1-q)\,\mathcal N(1,\sigma^2))`); post-processing
    never raises a privacy profile (the coupling of Balle, Barthe & Gaboardi 2018, Privacy
    Amplification by Subsampling). Exact at q = 1, so epsilon never rises as q nears 1:
    the mixtures' rounding put a run at q = 1 - 1e-6 2e-11 of epsilon above q = 1
    (sigma 1.41, 53,993 steps, delta 1.1e-11), and the grid five runs at q 0.9999 4.6e-4
    above (delta 1.6e-7)."""
    mu = gaussian_mu(noisy)
    return _shifted_max({d: _gaussian_epsilon_bound(deltas[d], mu, False) for d in deltas}, shift)


def _gaussian_epsilon_bound(delta: float, mu: float, lower: bool) -> float:
    epsilon = gaussian_epsilon(delta, mu)
    # gaussian_epsilon rounds up to within 1e-12 relative; undo that for a lower bound.
    return epsilon * (1.0 - 1e-9) if lower else epsilon


def _shifted_max(epsilons: dict, shift: float) -> float:
    return max(epsilons[_REMOVE], epsilons[_ADD] + shift)


@dataclasses.dataclass(frozen=True)
class _Grid:
    """Where and how finely the composed loss is represented.

    Losses are ``k * spacing``; the circular window holds indices ``i_low .. i_low + n - 1``.
    ``bottoms[direction][r]`` (``None``: ``i_low`` for all) is the lowest grid index kept
    for step ``r`` (its mass below is rounded up to it; it may lie below ``i_low``, the
    composition being circular, as long as the step's support is shorter than ``n``) and
    ``tops[direction][r]`` is the highest grid index kept for step ``r`` (its mass above goes
    to +inf), ``tail`` a certified bound on the composed mass beyond the window top and
    ``tilt`` the exponential tilt used in the transform (see :func:`_direction_epsilon`).
    ``thin[direction]`` (``None``: every point) is the tilt the steps' thinned
    distributions serve (:func:`_thinned_points`), on grids whose tail bound is computed
    from the distributions themselves (:func:`_certified_grid`, :func:`_grid_tail`).
    ``window_top``: where ``tail`` comes from the RDP curves, the loss it bounds the mass
    beyond and the order that bound is taken at (:func:`_grid_tail` checks it against
    the grid distributions, which the rounding bounds move a little). ``cut``: the share
    of delta the window was cut for (:func:`_choose_grid`'s ``tail_fraction``).
    ``lows`` (``None``: ``i_low`` for both) is each direction's own window bottom where
    they differ (:func:`_certified_grid`): every function composing or reading one
    direction reads the grid through :func:`_directed`.
    """

    spacing: float
    i_low: int
    n: int
    tops: dict
    tail: float
    tilt: float
    bottoms: dict | None = None
    thin: dict | None = None
    window_top: tuple | None = None  # (loss, order) where ``tail`` comes from the RDP curves
    cut: float = _TAIL_FRACTION
    lows: dict | None = None


def _directed(grid: _Grid, direction: str) -> _Grid:
    """``grid`` as ``direction`` reads it: with that direction's own window bottom as
    ``i_low`` where the directions' windows differ (``lows``), else unchanged."""
    if grid.lows is None:
        return grid
    return dataclasses.replace(grid, i_low=grid.lows[direction], lows=None)


def _thin_of(grid: _Grid, direction: str) -> float | None:
    """The tilt ``direction``'s thinned distributions serve on ``grid`` (None: not thinned)."""
    return None if grid.thin is None else grid.thin[direction]


def _compose_and_invert(steps: tuple, deltas: dict, grid_points: int | None, lower: bool = False,
                        ceiling: float = math.inf, mixture=None, shift: float = 0.0, rare_split: bool = True,
                        hint: float = math.inf, later: tuple = (0, None)) -> dict:
    """Epsilon of each direction, each at its own delta, on one grid.

    ``grid_points=None``: the grid is sized from the RDP guess of epsilon (see
    :func:`_choose_grid`), then checked on the PLD's own answer and refined once more
    where it fails, unless that answer is at or above ``ceiling``: another sound bound
    that the caller reports instead, so that a finer grid would not change the result.
    ``mixture``: mixture groups (:mod:`.mixture`) composed in place of ``steps``, their
    corners, which size the grid. ``shift``: added to the add direction's epsilon by the
    caller (:func:`_compose_on`). ``rare_split``: see :func:`_rounding_bound`. ``hint``: a guess
    (:func:`_ungrouped_split`) sizing the first grid where below the RDP guess. Cuts: :func:`_cut_checked`.
    The split tried first may leave sound answers of its own beside the grids' (``beside``).
    ``later``: see :func:`_later_grids`."""
    delta = min(deltas.values())
    bound: set = set()  # the directions whose answer rounding decided, even refined
    split: set = set()  # ... and of those, the ones the split of :mod:`.rare` answered
    cuts: dict = {}  # (direction, points, spacing) -> how far the window's cuts moved its answer
    compose_on = _lower_on if lower else functools.partial(_compose_on, mixture=mixture, shift=shift, bound=bound,
                                                            split=split, rare_split=rare_split, uncertified=set(),
                                                            cuts=cuts, ceiling=ceiling)
    if grid_points is not None:
        return compose_on(steps, deltas, _choose_grid(steps, delta, _fft_size(grid_points)))
    first, last = AUTO_GRID_POINTS
    # A lower bound (for tests and benchmarks) loses more to a coarse grid than the upper
    # one where a heavy step's tail decides: its grid is sized for a tenth of epsilon.
    strict, cut, first, last = (10.0, _TAIL_FRACTION, last, 4 * last) if lower else (1.0, _CHECKED_CUT, first, last)
    guess = min(_rdp_guess(steps, delta), hint) / strict
    # Where another bound is already below the RDP guess (the Gaussian mixture, for tiny
    # sigma), the PLD may not win at all: a first look on at most the usual grid says.
    shift_until = _fft_size(DEFAULT_GRID_POINTS) if ceiling < guess else None
    grid = _choose_grid(steps, delta, first, last, guess, shift_until, tail_fraction=cut)
    # Sized without the spread test (the RDP guess lies beyond the body of the loss), the
    # grid is checked on the PLD's answer even where another bound is below it.
    unspread, beside = _beyond_body(steps, guess, delta), {}
    early = _split_first(steps, deltas, guess, shift=shift, beside=beside) if (
        unspread and rare_split and not lower and mixture is None) else None
    if early is not None:
        return early
    epsilons = _first_grid(steps, deltas, grid, compose_on, (mixture, lower, ceiling, strict, last, shift))
    reported = _reported(epsilons, shift)
    if reported in split or (not lower and not any(epsilons.values())):
        return epsilons  # the split's grid answered (none does better), or a sound 0, exact (1000 pairs at q 4e-6: 5 s)
    guess, coarse = max(epsilons.values()) / strict, None
    if (grid.n < last and (guess < ceiling or unspread) and reported not in bound
            and not _fine_for(steps, grid.spacing, guess, delta, grid.tilt, points=grid.n)):
        coarse = (grid.spacing, _shifted_max(epsilons, shift))  # the guess was too high: refine on the answer
        grid, epsilons = _refined_grid(steps, deltas, epsilons, compose_on, (grid, last, cuts, split), guess,
                                       lower, shift)
    if not lower and mixture is None:
        grid, epsilons = _past_last(steps, deltas, epsilons, compose_on, grid, (last, shift, ceiling))
    return _later_grids(steps, deltas, epsilons, compose_on, grid, (cuts, split, shift, coarse, bound, beside),
                        (first, last, guess, ceiling, lower, rare_split and mixture is None), later)


def _past_last(steps: tuple, deltas: dict, epsilons: dict, compose_on, grid: _Grid, state: tuple) -> tuple:
    """``(grid, epsilons)``: where the largest automatic grid (``state``: its points
    ``last``, the add direction's shift and the other bounds' ``ceiling``) still moves the
    reported answer by more than :data:`_PAST_LAST_SHARE` of it (:func:`_mean_shift`), a
    grid of up to :data:`_MAX_REFINE` times as many points sized for the answer, and each
    direction's smaller answer of the two (both sound; a direction far below the reported
    one, :data:`_PAST_LAST_APART`, or below it by more than the refinement takes off,
    :data:`_PAST_LAST_MARGIN`, keeps its first answer); else the same. Only for at most
    :data:`_PAST_LAST_STEPS` distinct steps, where the answer is below the ceiling (else
    another bound is reported) and at least :data:`_PAST_LAST_EPSILON`: nearer 0 the
    narrower windows of :func:`_last_windows` follow, on as many points.

    A long run at huge epsilon, which the stages refuse (:mod:`.staged`: above an RDP
    guess of 10^5) and no mixture bound answers, spreads its loss over more than 2^20
    points at a fine enough spacing: sigma 0.3155, q 0.17, 1.58*10^7 steps, delta
    1.6e-12 read 7,998,136 on 2^20 points (a mean shift of 9.5*10^4 estimated at
    spacing 0.25, 9.3*10^4 measured), and 7,904,665 refined, against a rigorous lower
    bound of 7,900,091. Where the refinement starts as the run grows, epsilon falls by
    what the grids' shifts differ: 3.4e-4 of it at 3,122,160 steps (0.46% with a
    threshold of 0.4%), as where the automatic grid doubles."""
    last, shift, ceiling = state
    finer = _finer_past_last(steps, min(deltas.values()), grid, _shifted_max(epsilons, shift), (last, ceiling))
    if finer is None:
        return grid, epsilons
    larger = _reported(epsilons, shift)  # the other, far below it, keeps its answer (a sound bound)
    smaller, offsets = _other(larger), {_REMOVE: 0.0, _ADD: shift}
    low, high = epsilons[smaller] + offsets[smaller], epsilons[larger] + offsets[larger]
    if low <= _PAST_LAST_APART * high or high - low >= _PAST_LAST_MARGIN * _mean_shift(steps, grid.spacing, larger):
        compose_on = functools.partial(compose_on, kept={smaller: epsilons[smaller]})
    return finer, _smaller_with(steps, deltas, epsilons, compose_on, lambda: finer)


def _finer_past_last(steps: tuple, delta: float, grid: _Grid, answer: float, state: tuple) -> _Grid | None:
    """The grid :func:`_past_last` refines ``grid`` to for a reported ``answer`` (``state``:
    the largest automatic grid's points ``last`` and the other bounds' ``ceiling``), or
    None where it keeps ``grid``."""
    last, ceiling = state
    if (grid.n < last or len(steps) > _PAST_LAST_STEPS or not _PAST_LAST_EPSILON <= answer < ceiling
            or _mean_shift(steps, grid.spacing) <= _PAST_LAST_SHARE * answer):
        return None
    try:
        finer = _choose_grid(steps, delta, 2 * grid.n, _MAX_REFINE * last, answer, tail_fraction=grid.cut)
    except FloatingPointError:  # pragma: no cover - no window fits: the sound answers stand
        return None
    return finer if finer.spacing < grid.spacing else None


def _mean_shift(steps: tuple, spacing: float, direction: str = _REMOVE) -> float:
    """About how far connect-the-dots on bins ``spacing`` wide (grid points at its
    multiples) raises the mean of the composed loss of ``direction``: a loss ``l`` split
    between the ends ``a < l < b`` of its bin gains about :math:`(l - a)(b - l)/2` of mean, at
    most :math:`h^2/8`; each step adds its expectation under P (Gauss-Hermite, a guide
    only). The shift test's :math:`T h^2 / 8` (:func:`_shift_fine`) counts every step in
    full, where at tiny q the unsampled steps' loss all but sits on the grid point 0: for
    sigma 0.02 at q 1e-6 that is 10^5 times too much."""
    total = 0.0
    for sigma, q, count in steps:
        for weight, mean in _components(q, direction):
            losses = _loss_of_z(mean + sigma * _HERMITE_X, sigma, q, direction) / spacing
            within = losses - np.floor(losses)
            total += count * weight * spacing * spacing * float(_HERMITE_W @ (within * (1.0 - within))) / 2.0
    return total


#: :func:`_past_last` refines past the largest automatic grid where the mean shift
#: (:func:`_mean_shift`) is above this share of the answer ...
_PAST_LAST_SHARE = 1e-3  # (as the shift test's share, :data:`_SHIFT_SHARE`)

#: ... for ledgers of at most this many distinct steps, and answers of at least this.
_PAST_LAST_STEPS = 8
_PAST_LAST_EPSILON = 100.0

#: :func:`_past_last` composes only the reported direction on the finer grid where the
#: other's answer is at most this share of it: refining only lowers a direction's value,
#: and the finer grid lowers the reported one by a few percent at most (2.2% measured),
#: so the other stays below it. At huge epsilon addition's answer is a few thousandths of
#: removal's (sigma 0.014, q 5.1e-4, 10^8 steps: 4.1*10^5 against 1.3*10^8), and composing
#: it on 2^22 points took a third of the call.
_PAST_LAST_APART = 0.5

#: ... or where it lies below the reported one by at least this many times the reported
#: direction's mean shift on the first grid (:func:`_mean_shift`), about what the finer
#: grid takes off it. At q near 1 the two directions are close, and each took as long on
#: 2^22 points: sigma 3.606, q 0.86 over 10^8 steps (delta 0.003) reads 2,860,798 and
#: 2,834,400 on 2^20 points, removal's mean shift there 8,319, and removal refined
#: 2,853,159 (7,639 lower): 0.49 s instead of 0.67 s, the same value. Over 120 random
#: runs at q 0.2 to 1 (10^6 to 10^8 steps) and 735 other answers no value changed.
_PAST_LAST_MARGIN = 2.0


def _later_grids(steps: tuple, deltas: dict, epsilons: dict, compose_on, grid: _Grid, state: tuple, sizes: tuple,
                 later: tuple) -> dict:
    """:func:`_compose_and_invert`'s answers after its refinement (``epsilons``, on ``grid``):
    the grids that follow, each keeping every direction's smaller of two sound answers
    (the cut check and the split beside, :func:`_cut_checked`, :func:`_split_beside`; then
    the last windows, :func:`_last_windows`), and the sound answers ``beside`` them.
    ``state``: ``(cuts, split, shift, coarse, bound, beside)``; ``sizes``: ``(first, last,
    guess, ceiling, lower, splits)``: the fewest and most points, the guess and ceiling
    that size the grids, the lower bound's flag, and whether the split may be tried.

    ``later``: ``(skip, notes)``. ``skip`` leaves out the last 1 or 2 of those two stages:
    what they would lower then stands, at or above the answer with them (the stages left
    are a prefix, composed as they would be). With none left out, ``notes`` (a dict, or
    None) records under :data:`_LATER` how many could have been (:func:`_skippable`)."""
    cuts, split, shift, coarse, bound, beside = state
    first, last, guess, ceiling, lower, splits = sizes
    skip, notes = later
    answers = [epsilons]
    if skip < 2:
        grid, epsilons = _cut_checked(steps, deltas, epsilons, compose_on, (grid, cuts, split, shift, coarse))
        if (not lower and splits and grid.n >= last and guess < ceiling
                and _spread_share(steps, grid.spacing) > _SPREAD_SHARE):
            epsilons = _split_beside(steps, deltas, epsilons, grid, shift)
        answers.append(epsilons)
    if skip < 1:
        narrow = not lower and grid.n >= last and guess < ceiling and grid.spacing > _BIN_SHARE * guess
        epsilons = _last_windows(steps, deltas, epsilons, compose_on, grid,  # (a coarser grid helps only if below these)
                                 (shift, narrow, grid.n > first and guess < ceiling, first, bound))
        answers.append(epsilons)
    if notes is not None and skip == 0:
        notes[_LATER] = _skippable(answers, beside, shift)
    return _each_smaller(epsilons, beside)


def _skippable(answers: list, beside: dict, shift: float) -> int | None:
    """How many of :func:`_later_grids`' two stages, counted from the last, could be left out
    with the same reported answer (``answers``: after the refinement, after the first
    stage, after the second; a stage that composed a grid leaves a new dict): 2, 1 or 0,
    only stages that composed a grid counting; None where neither did."""
    settled, checked, final = answers
    if final is settled:
        return None
    reported = [_shifted_max(_each_smaller(answer, beside), shift) for answer in answers]
    if reported[0] == reported[2]:
        return 2
    return 1 if final is not checked and reported[1] == reported[2] else 0


def _each_smaller(epsilons: dict, others: dict) -> dict:
    """Each direction's smaller of ``epsilons`` and the sound answer ``others`` give it, if any."""
    return {direction: min(value, others.get(direction, math.inf)) for direction, value in epsilons.items()}


#: The share of delta the upper bound's windows are first cut for (:func:`_cut_checked`).
_CHECKED_CUT = 2.0**-10


def _cut_checked(steps: tuple, deltas: dict, epsilons: dict, compose_on, state: tuple) -> tuple:
    """``(grid, epsilons)`` after composing on ``grid`` (``state``: it, how far their cuts
    moved each direction's answer on each grid, :func:`_cut_move`, the directions the split
    of :mod:`.rare` answered, the add direction's ``shift``, and the first grid's spacing
    and reported answer where this grid refined it, else None): where the cuts moved the
    reported answer on this grid (not the split's) and the window was cut for more than
    :data:`_TAIL_FRACTION` of delta, the grid of as many points cut for that share, and
    each direction's smaller answer of the two (both sound); else the same. Not where
    that grid's coarser bins would raise the answer by at least as much as the cuts
    moved it (:func:`_bins_cost`). A refined grid keeps its first grid's cut
    (:class:`_Grid`), unless :func:`_refinement_cut` chose the shorter one first.

    The upper bound's first grid is cut for :data:`_CHECKED_CUT` of delta: cutting the
    tails where they fall below a 2^-10 share rather than 2^-16 narrows a window that
    rare large losses stretch (tiny q) about twice, so its bins are finer on as many
    points. What the cuts send to +inf counts in full in delta, so every answer
    stays a sound upper bound; where that moves epsilon noticeably (rare losses setting
    it) the window is cut shorter."""
    grid, cuts, split, shift, coarse = state
    reported = _reported(epsilons, shift)
    moved = cuts.get((reported, grid.n, grid.spacing), 0.0)
    if not (grid.cut > _TAIL_FRACTION and moved > _CUT_SHARE * epsilons[reported] and reported not in split):
        return grid, epsilons
    try:
        strict = _choose_grid(steps, min(deltas.values()), grid.n, grid.n, tail_fraction=_TAIL_FRACTION)
    except FloatingPointError:  # pragma: no cover - no window fits cut shorter: the sound answers stand
        return grid, epsilons
    if _bins_cost(coarse, (grid.spacing, _shifted_max(epsilons, shift)), strict.spacing, steps) >= moved:
        return grid, epsilons
    return strict, _smaller_with(steps, deltas, epsilons, compose_on, lambda: strict)


def _finer_of_cuts(firsts: tuple, refined: tuple, share: float) -> tuple:
    """``(first, refined)``: which cut a refinement keeps, where :func:`_refinement_cut`
    would cut it shorter (``firsts``: the first grid as cut and as cut shorter;
    ``refined``: the refined grid sized for each; ``share``: how far the first grid's cuts
    moved its reported answer, a share of it). The shorter cut widens the window, and
    where the most points allowed cannot hold it at the spacing the first cut gets, its
    bins stay coarser. The first grid's cut is then kept, with its finer bins, where the
    cuts moved the answer by less than :data:`_KEPT_CUT_SHARE`, or where the shorter cut
    would leave the bins no finer than the first grid's (that is no refinement);
    :func:`_cut_checked` composes the shorter cut beside it where the two grids' answers
    say its coarser bins cost less than the cuts moved. Both cuts give sound upper
    bounds; only tightness and time are at stake.

    Near epsilon's zero the body's bins decide more than the cuts: at sigma 0.440, q
    1.4e-5, 1,080,835 steps, delta 0.073 the first grid's cuts moved its answer, 1.63e-4,
    by 2.3e-5, and the shorter cut kept its bins on 2^20 points: 1.65e-4 after 0.45 s,
    before the narrower window of :func:`_last_windows` found 1.09e-4 on bins half as
    wide. Cut like the first, the refinement finds 1.09e-4 at once. Over 61 such
    refinements of 120 calibrations near the zero, those whose cuts moved the answer by
    less than 1% took 2 s less in all when cut like the first, none with a larger answer;
    beyond 1% the shorter cut was mostly the quicker."""
    (first, shorter), (kept, wide) = firsts, refined
    if kept.spacing < wide.spacing and (share < _KEPT_CUT_SHARE or wide.spacing >= first.spacing):
        return first, kept
    return shorter, wide


#: :func:`_finer_of_cuts` keeps the first grid's cut on finer bins where its cuts moved
#: the answer by less than this share of it.
_KEPT_CUT_SHARE = 1e-2


#: Where the first grid's cuts moved its reported answer by more than this share of it,
#: the refined grid is cut for :data:`_TAIL_FRACTION` of delta (:func:`_refinement_cut`).
_REFINE_CUT_SHARE = 1e-3


def _refinement_cut(grid: _Grid, epsilons: dict, state: tuple, sized) -> tuple[_Grid, _Grid]:
    """``(first, refined)``: the first ``grid`` as the refinement of :func:`_compose_and_invert`
    reads it, and the refined grid ``sized`` for its cut (a function of the cut). It is
    cut for :data:`_TAIL_FRACTION` of delta where the cuts of its window moved its
    reported answer (of ``epsilons``; ``state``: the cut moves, the directions the split of
    :mod:`.rare` answered, the add direction's ``shift``, as :func:`_cut_checked` takes
    them) by more than :data:`_REFINE_CUT_SHARE` of it, unless its finer bins decide
    (:func:`_finer_of_cuts`); else unchanged. :func:`_cut_checked` would
    compose the refined grid cut that way anyway, beside the one cut like the first
    grid: a second composition on the finest grid. A move that large is the rare losses'
    (q 1.7e-6, 69,539 steps at sigma 0.24, delta 0.03: 0.74% on 2^18 points), and the
    cuts move the finer grid's answer as much; both grids give sound upper bounds, only
    tightness is at stake: over 160 random runs at q 1e-6 to 1e-3 and 40 ledgers the
    answers were the same (at a 1e-4 share one was 0.2% looser: the wider window's
    coarser bins cost more than the cut moved), and that case took 0.7 s, not 1.4 s."""
    cuts, split, shift = state
    reported = _reported(epsilons, shift)
    moved = cuts.get((reported, grid.n, grid.spacing), 0.0)
    if grid.cut > _TAIL_FRACTION and moved > _REFINE_CUT_SHARE * epsilons[reported] and reported not in split:
        return _finer_of_cuts((grid, dataclasses.replace(grid, cut=_TAIL_FRACTION)),
                              (sized(grid.cut), sized(_TAIL_FRACTION)), moved / epsilons[reported])
    return grid, sized(grid.cut)


def _bins_cost(coarse: tuple | None, fine: tuple, spacing: float, steps: tuple) -> float:
    r"""About how much bins of ``spacing`` would raise the answer of a grid, ``fine``
    (``(spacing, answer)``), that refined a coarser one, ``coarse`` (the same, or None):
    connect-the-dots moves epsilon by about :math:`c h^2` (:func:`_checked_refinement`),
    and the two answers give ``c``. 0 where the refinement did not lower the answer, or
    for bins no coarser. Only which sound answer is kept depends on it: 133 pairs of 165
    steps at q 1e-4 to 3.6e-5, delta 1.4e-11 were refined to bins of 1.5e-5, where the
    cuts moved epsilon by 1.8e-5 and the window cut for 2^-16 of delta, on bins twice as
    wide, gave 8.6e-5 more (5.4e-5 estimated): 1.1 s for nothing.

    Without a refinement, the mean shift of :func:`_shift_fine`, :math:`T h^2 / 8` over
    the ``steps``' ``T`` steps, from this grid's bins to those: sigma 0.315, q 1.2e-6 over
    4.9*10^6 steps, delta 0.094 (the first grid already the largest, 2^20 points) moved
    epsilon 1.45e-3 by 5.1e-5, where bins twice as wide cost 4.3e-4 by that estimate and
    gave 2.4e-4 more (0.26 s for nothing). Over 300 random runs at q 1e-6 to 1e-2, five
    first grids' bins were twice as fine as the short cut's, with the estimate below the
    move (the short cut won in three), one with it above (it lost)."""
    if not spacing > fine[0]:
        return 0.0
    if coarse is None:
        return sum(count for _, _, count in steps) * (spacing * spacing - fine[0] * fine[0]) / 8.0
    (h0, v0), (h1, v1) = coarse, fine
    if not (h0 > h1 and v0 > v1):
        return 0.0
    return (v0 - v1) * (spacing * spacing - h1 * h1) / (h0 * h0 - h1 * h1)


#: :func:`_first_grid` leaves unrefined only first grids of at least this many points.
_UNREFINED_POINTS = 2**19


def _first_grid(steps: tuple, deltas: dict, grid: _Grid, compose_on, call: tuple) -> dict:
    """:func:`_compose_and_invert`'s answers on its first ``grid``: ``compose_on`` them, but
    for mixture groups (``call``: ``(mixture, lower, ceiling, strict, last, shift)`` of
    that call) their float64 answers alone where those already call for a finer grid
    (not fine for their own maximum, below ``ceiling``, on fewer than ``last`` points):
    refining them would only lower that maximum, and a lower guess asks for a finer grid
    still (:func:`_fine_for`), whose answers are taken beside these. 10^4 runs of 1000
    steps at q 1e-6, delta 6.7e-7: extended precision on 2^19 points lowered 0.0607 to
    0.0601 in 7 s, where 2^20 points then gave 0.0525. The split of :mod:`.rare`, which can
    settle a direction on the first grid, is not among a mixture's refinements. So too for
    a few distinct steps on the largest grid where their float64 answers ask for the grid
    past it (:func:`_finer_past_last`): sigma 0.041, q 8.6e-3 over 10^8 steps refined
    2.6345*10^8 to 2.6324*10^8 on 2^20 points in 0.36 s, before 2^22 gave 2.6014*10^8."""
    mixture, lower, ceiling, strict, last, shift = call
    delta = min(deltas.values())
    if mixture is None and not lower and grid.n >= last and len(steps) <= _PAST_LAST_STEPS:
        first = compose_on(steps, deltas, grid, refine=False, lows=(lows := {}))
        quick = {direction: value for direction, (value, _) in first.items()}
        if _finer_past_last(steps, delta, grid, _shifted_max(quick, shift), (last, ceiling)):
            return quick
        return compose_on(steps, deltas, grid, known=first, lows=lows)
    if mixture is None or lower or not _UNREFINED_POINTS <= grid.n < last:
        return compose_on(steps, deltas, grid)
    first = compose_on(steps, deltas, grid, refine=False)
    quick = {direction: value for direction, (value, _) in first.items()}
    guess = max(quick.values()) / strict
    if 0.0 < guess < ceiling and not _fine_for(steps, grid.spacing, guess, delta, grid.tilt, points=grid.n):
        return quick
    return compose_on(steps, deltas, grid, known=first)


def _reported(epsilons: dict, shift: float) -> str:
    """The direction whose epsilon is reported: the larger, addition's raised by ``shift``."""
    return max(epsilons, key=lambda d: epsilons[d] + (shift if d == _ADD else 0.0))


def _refined_grid(steps: tuple, deltas: dict, epsilons: dict, compose_on, grids: tuple, guess: float, lower: bool,
                  shift: float) -> tuple:
    """``(grid, epsilons)`` on a grid at least twice finer than the first (``grids``: it, the
    most points allowed, and the cut moves and split directions that choose the cut,
    :func:`_refinement_cut`), sized for ``guess`` from the first grid's answers
    ``epsilons``, which the upper bound keeps where smaller (both are sound; where rounding
    decides them the first can be the smaller). The upper bound's grid may be sized by
    the first grid's tilt (:func:`_fine_for`), then checked (:func:`_checked_refinement`)."""
    first, last, cuts, split = grids
    delta = min(deltas.values())

    def sized(cut: float) -> _Grid:
        return _choose_grid(steps, delta, 2 * first.n, last, guess, tilt=first.tilt,
                            order=None if lower else first.tilt, tail_fraction=cut)

    coarse, grid = _refinement_cut(first, epsilons, (cuts, split, shift), sized)
    if lower:
        return grid, compose_on(steps, deltas, grid)
    before = _shifted_max(epsilons, shift)
    epsilons = _smaller_with(steps, deltas, epsilons, compose_on, lambda: grid)
    return _checked_refinement(steps, deltas, epsilons, compose_on, (coarse, grid, last), before, guess, shift)


def _checked_refinement(steps: tuple, deltas: dict, epsilons: dict, compose_on, grids: tuple, before: float,
                        guess: float, shift: float) -> tuple:
    r"""``(grid, epsilons)`` after a refinement (:func:`_compose_and_invert`) whose grid the
    shift test at the first grid's tilt chose (``grids``: the first grid, that one, and
    the most points allowed), where the spread test alone would have asked for more
    points: that grid and its answers where they check, else the spread test's grid and
    the smaller answers of the two (both sound; only tightness is at stake).

    The check reads the grid's own error off the two answers: connect-the-dots moves
    epsilon by about :math:`c h^2` (the mean shift and the spread, :func:`_shift_fine`),
    so the first grid's reported value ``before`` (spacing :math:`h_0`) and this one's
    (:math:`h_1`) put this one's at :math:`(v_0 - v_1) h_1^2 / (h_0^2 - h_1^2)`, which may
    be at most :data:`_SHIFT_SHARE` of it. The tilt is a Chernoff order, and where a few
    rare losses set epsilon it can lie far below the order that tells how a spread moves
    it (488 runs of 70 steps at q 8.4e-5 to 1.5e-6: tilt 76, epsilon 0.0086, moved 0.14%
    by bins the order called fine); there the check asks for the spread test's grid."""
    coarse, grid, last = grids
    strict = _choose_grid(steps, min(deltas.values()), 2 * coarse.n, last, guess, tilt=coarse.tilt,
                          tail_fraction=coarse.cut)
    if strict.spacing >= grid.spacing:
        return grid, epsilons  # (the spread test chose that grid too)
    after = _shifted_max(epsilons, shift)
    narrowing = coarse.spacing**2 - grid.spacing**2
    error = max(before - after, 0.0) * grid.spacing**2 / narrowing if narrowing > 0.0 else math.inf
    if error <= _SHIFT_SHARE * after:
        return grid, epsilons
    return strict, _smaller_with(steps, deltas, epsilons, compose_on, lambda: strict)


#: The largest window of the split tried first (:func:`_split_first`): where the bulk's
#: spread asks for more (many sampled steps: q T = 4 at q 4.7e-6 over 876,109 steps), the
#: grids' answer is as tight (0.03% apart there) at a twentieth of the cost.
_FIRST_SPLIT_POINTS = 2**19


#: :func:`_split_first` first sizes addition's grid for this many times removal's answer,
_QUICK_ADDITION = 64.0

#: ... then, where that answer was within :data:`_NEAR_ENOUGH` times removal's, for this many.
_NEARER_ADDITION = 8.0
_NEAR_ENOUGH = 2.0

#: ... and, failing those, for this many times removal's answer: one scale of the split
#: above removal's own, where the bins are four times coarser. 10^4 one-step pairs from
#: sigma 1.2 at q 1e-4 to sigma 0.6 at q 1e-5 (delta 1e-5): addition 0.01463 on removal's
#: scale took 2.1 s, where removal's answer is 0.01596 and one scale above settles it.
_LAST_QUICK_ADDITION = 2.0


#: ... there on bins this many times coarser than the spread asks, first: addition's
#: answer need only lie below removal's, where it gives way to it, and coarser bins raise
#: it by far less than the gap between the two directions at tiny q (10^4 one-step pairs
#: from sigma 1.2 at q 1e-4 to sigma 0.6 at q 1e-5: 0.014732 against 0.014639 on the
#: asked bins, in 0.34 s against 0.53 s, below removal's 0.015956).
_COARSE_QUICK_ADDITION = 4.0


def _split_first(steps: tuple, deltas: dict, guess: float, again: bool = True, shift: float = 0.0,
                 points: int = _FIRST_SPLIT_POINTS, beside: dict | None = None) -> dict | None:
    """Each direction's epsilon by the split of :mod:`.rare`, sized from ``guess`` (an upper
    estimate; ``again``: see :func:`~dpoptim.accounting.rare.split_epsilon`), where it
    answers both without rounding deciding (else None): beyond the body of the loss,
    where rare losses decide epsilon, its grid is the finer one. Removal first, on the
    grid sized for its own answer (``strict``); addition is first sized for
    :data:`_QUICK_ADDITION` times removal's answer, which settles it where that answer
    (a sound upper bound on any grid) is at most removal's, then, where that answer was
    near, for :data:`_NEARER_ADDITION` times (1,134 pairs of 3 steps at q 3.9e-4 to
    6.8e-5, delta 1.6e-7: 0.107 at 64 times, 0.0475 at 8 times against removal's 0.0587,
    in 0.3 s where the grid sized for removal's answer took 1.9 s; where 64 times gave
    3.4 times removal's, 8 times did not settle it either), then, for one run, on grids
    of its own (:func:`_addition_below`), then (with ``again``) for :data:`_LAST_QUICK_ADDITION`
    times, on bins :data:`_COARSE_QUICK_ADDITION` times coarser than asked and then on the
    asked ones, then for removal's answer (with ``again``), and
    only sized for its own where it is above (``shift``: added to it by the caller), as
    only the larger is reported; without a tail of its own it is composed whole on the
    split's fine grid. Where removal has no rare tail, the grids answer. ``points``: the
    largest window. ``beside``: receives the split's sound answers that are not its own
    (``coarser`` of :func:`~dpoptim.accounting.rare.split_epsilon`), and removal's where
    addition is not answered (the grids then answer both directions)."""
    removal = rare.split_epsilon(steps, _REMOVE, deltas[_REMOVE], guess, again, points, strict=True, coarser=beside)
    if removal is None or removal[1]:
        return None
    # Addition only needs to stay below removal: a grid sized for far more than removal's
    # answer is coarse and quick, and often settles that (q 1e-6, 30 steps, sigma 0.339:
    # 0.008 s, where sized for removal's answer rounding decided it after 0.7 s).
    for factor in (_QUICK_ADDITION, _NEARER_ADDITION):
        quick = rare.split_epsilon(steps, _ADD, deltas[_ADD], max(removal[0], 1e-300) * factor, False,
                                   points, whole=True)
        if quick is not None and quick[0] + shift <= removal[0]:  # (sound where rounding decides it, too)
            return {_REMOVE: removal[0], _ADD: quick[0]}
        if quick is None or quick[0] + shift > _NEAR_ENOUGH * removal[0]:
            break  # far above removal's: a grid 8 times finer would rarely bring it below
    below = _addition_below(steps, deltas[_ADD], removal[0] - shift) if len(steps) == 1 else None
    if below is not None:
        return {_REMOVE: removal[0], _ADD: below}
    if again:  # one scale above removal's answer first: a half to a third of the cost
        last = _LAST_QUICK_ADDITION * max(removal[0], 1e-300)
        coarse = _COARSE_QUICK_ADDITION * rare.asked_spacing(steps, _ADD, deltas[_ADD], last)
        for spacings in ((coarse, math.inf), None):
            quick = rare.split_epsilon(steps, _ADD, deltas[_ADD], last, False, points, whole=True, spacings=spacings)
            if quick is not None and quick[0] + shift <= removal[0]:
                return {_REMOVE: removal[0], _ADD: quick[0]}
    addition = rare.split_epsilon(steps, _ADD, deltas[_ADD], max(removal[0], 1e-300) if again else guess, False,
                                  points, whole=True)
    if again and addition is not None and addition[0] + shift > removal[0]:
        addition = rare.split_epsilon(steps, _ADD, deltas[_ADD], addition[0], again, points, whole=True,
                                      strict=True, coarser=beside)
    if addition is None or addition[1]:
        if beside is not None:  # removal's answer stands beside the grids'
            beside[_REMOVE] = min(removal[0], beside.get(_REMOVE, math.inf))
        return None
    return {_REMOVE: removal[0], _ADD: addition[0]}


#: The most points :func:`_addition_below` composes addition on.
_ADDITION_BELOW_POINTS = 2**17


def _addition_below(steps: tuple, delta: float, bound: float) -> float | None:
    """Addition's epsilon on the grids of 2^14 points up to :data:`_ADDITION_BELOW_POINTS`,
    each sized for ``bound`` (removal's answer less the caller's shift), the first at or
    below ``bound``; None where none is. Near epsilon's zero the split of :mod:`.rare`
    leaves addition to rounding (q 5.8e-6, 263 steps, sigma 0.31, delta 6e-4: 4.6e-4 and
    more, removal 3.86e-4), and without these grids every grid of
    :func:`_compose_and_invert` followed, for both directions (0.45 s); addition alone on
    2^15 points gave 2.6e-4 in 6 ms. What is reported, removal's answer, is the same
    either way: addition only needs to stay below it, and each grid's answer is a sound
    upper bound (:func:`_compose_direction`; its cuts count in full). :func:`_split_first`
    asks it for one run only: over several, removal's split answer can lie above the
    grids' (50 one-step pairs: 0.46%, see :func:`.rare._settled_coarser`), which then
    answer."""
    if not 0.0 < bound < math.inf:
        return None
    n = AUTO_GRID_POINTS[0]
    while n <= _ADDITION_BELOW_POINTS:
        try:
            grid = _choose_grid(steps, delta, n, n, bound, tail_fraction=_CHECKED_CUT)
            found = _compose_direction(steps, _ADD, grid, delta, np.float64)[0]
        except (FloatingPointError, OverflowError, DroppedMass):  # pragma: no cover - the split's own grids answer
            return None
        if found <= bound:
            return found
        n *= 2
    return None


def _split_beside(steps: tuple, deltas: dict, epsilons: dict, grid: _Grid, shift: float) -> dict:
    """Each direction's smaller of ``epsilons`` (the largest ``grid``'s, which still spreads
    the loss: :func:`_spread_share`) and the split of :mod:`.rare` on at most as many
    points, on bins at least twice finer, for the directions that can set the reported
    ``max(remove, add + shift)`` (both side by side where both are near it).

    A rare loss far out stretches the grid's window while the body decides epsilon (tiny
    q at a large delta: sigma 0.501, q 1.52e-6, 5.5*10^7 steps, delta 9.8e-5 has a
    body about 0.08 wide and a window of 8), so the grid's bins spread every step's loss
    (0.2366 at 2^20 points, 0.2298 at 2^22). The split's bulk window ends where the
    tail is cut (0.17 there), so its bins are four times finer on as many points: 0.2298.
    Both are sound upper bounds, and so is the smaller; the split is taken beside the
    grid, not instead of it, so that where it starts to be tried epsilon can only fall,
    and only by what the grid still spread there."""
    offsets = {_REMOVE: 0.0, _ADD: shift}
    found = dict(epsilons)
    # bins no finer than spread the loss as little as the spread test asks (fewer points
    # where the grid only just fails it), and at least twice finer than the grid's
    needed = grid.spacing * 2.0 ** math.floor(0.5 * math.log2(_SPREAD_SHARE / _spread_share(steps, grid.spacing)))
    spacings = (min(needed, grid.spacing / 2.0), grid.spacing / 2.0)

    def smaller(direction: str, again: bool = True) -> float:
        if not found[direction] > 0.0:
            return found[direction]
        split = rare.split_epsilon(steps, direction, deltas[direction], found[direction], again, points=grid.n,
                                   spacings=spacings)
        return found[direction] if split is None else min(found[direction], split[0])

    larger, lesser = sorted((found[d] + offsets[d] for d in found), reverse=True)
    if _side_by_side() and lesser >= _SIDE_BY_SIDE_SHARE * larger:  # both likely to matter: side by side
        # on the grids sized for the answers above first; where both are sized anew, on to
        # the end side by side, else the one sized anew only where it can set the maximum
        first = _both_directions(lambda direction: smaller(direction, False))
        anew = [d for d in found if rare.sized_again(first[d], found[d])]
        if len(anew) == 2:
            return _both_directions(smaller)
        if not anew or first[anew[0]] + offsets[anew[0]] <= first[_other(anew[0])] + offsets[_other(anew[0])]:
            return first
        return {**first, anew[0]: smaller(anew[0])}
    for direction in sorted(found, key=lambda d: found[d] + offsets[d], reverse=True):
        if found[direction] + offsets[direction] >= found[_other(direction)] + offsets[_other(direction)]:
            found[direction] = smaller(direction)  # (below the other's final value, it cannot set the maximum)
    return found


def _smaller_with(steps: tuple, deltas: dict, epsilons: dict, compose_on, other) -> dict:
    """Each direction's smaller of ``epsilons`` and its epsilon on the grid ``other()``
    returns (None: there is none). Both are sound upper bounds, and so is the smaller;
    where the other grid cannot be had, the first answers stand."""
    try:
        grid = other()
        if grid is None:
            return epsilons
        values = compose_on(steps, deltas, grid, after=epsilons)
    except (OverflowError, FloatingPointError, MemoryError):  # pragma: no cover - defensive
        return epsilons
    return _each_smaller(epsilons, values)


def _coarser_grid(steps: tuple, delta: float, grid: _Grid, answer: float, first: int):
    """Where rounding decided an answer: the coarsest grid fine for it by :func:`_shift_fine`
    alone, if coarser than ``grid`` (a function for :func:`_smaller_with`).

    The rounding allowance is summed over the entries above the answer, so it grows with
    the points per unit of loss: where the largest grid is kept, its allowance can be most
    of delta even in extended precision. Sigma 0.575, q 1e-6, 1000 steps, delta 1e-12 (when
    the spread test still sized that grid): 0.1010 at 2^20 points, 0.0961 at 2^14, whose
    bins are 0.25% of epsilon; the rigorous lower bound is 0.0948."""
    def other():
        coarse = _choose_grid(steps, delta, first, grid.n // 4, answer, spread=False, tail_fraction=grid.cut)
        return coarse if coarse.n < grid.n and _shift_fine(steps, coarse.spacing, answer) else None
    return other


def _last_windows(steps: tuple, deltas: dict, epsilons: dict, compose_on, grid: _Grid, state: tuple) -> dict:
    """``epsilons`` after the last two windows, each direction's smaller answer kept
    (:func:`_smaller_with`): the narrower window of shorter cuts where a bin of ``grid``
    is coarse for epsilon (:func:`_shorter_cut_grid`), then the coarsest grid fine for
    the reported answer where rounding decided it (:func:`_coarser_grid`). ``state``:
    ``(shift, narrow, coarser, first, bound)``, the add direction's shift, whether each
    may help, the fewest points, and the directions rounding decided."""
    shift, narrow, coarser, first, bound = state
    delta = min(deltas.values())
    if narrow and any(epsilons.values()):
        epsilons = _smaller_with(steps, deltas, epsilons, compose_on,
                                 _shorter_cut_grid(steps, delta, grid, max(epsilons.values())))
    if coarser and _reported(epsilons, shift) in bound:
        epsilons = _smaller_with(steps, deltas, epsilons, compose_on,
                                 _coarser_grid(steps, delta, grid, max(epsilons.values()), first))
    return epsilons


#: What :func:`_later_grids` notes.
_LATER = "later"

#: The share of delta :func:`_shorter_cut_grid` lets the steps' cuts send to +inf.
_SHORT_CUT_FRACTION = 2.0**-10


def _shorter_cut_grid(steps: tuple, delta: float, grid: _Grid, guess: float):
    """Where a bin of the largest grid is coarse for epsilon: a narrower window, cut
    shorter, if finer than ``grid`` (a function for :func:`_smaller_with`).

    With tiny q over few steps epsilon can be 10^-4 of the window: a step's loss is
    10^-6 wide in its body, but its rare tail, cut where it falls below a 2^-16 share of
    delta, spans 2 (sigma 0.38, q 1e-6, 30 steps, epsilon 3e-5). At the largest grid a
    bin is then a fifth of epsilon, 7% above a rigorous lower bound. Cutting at a 2^-10
    share sends at most that share of delta to +inf, counted in full, and narrows the
    window about 4 times."""
    def other():
        shorter = _choose_grid(steps, delta, grid.n, grid.n, guess, tail_fraction=_SHORT_CUT_FRACTION)
        return shorter if shorter.spacing < grid.spacing else None
    return other


def _compose_on(steps: tuple, deltas: dict, grid: _Grid, mixture=None, shift: float = 0.0, bound: set | None = None,
                split: set | None = None, rare_split: bool = True, settle_first: bool = False,
                uncertified: set | None = None, refine: bool = True, known=None, cuts=None, kept=None,
                ceiling: float = math.inf, lows: dict | None = None, after: dict | None = None) -> dict:
    """Epsilon of each direction on ``grid``: both composed side by side in float64, then refined
    where rounding decides a direction's answer (:func:`_refined`), unless that direction cannot
    set the reported ``max(remove, add + shift)``. Refining only lowers a value (the smaller of
    sound answers is kept), so a direction already below the other's final value leaves the
    maximum as it is: the larger is refined first (on a tie, both), then the other if it is
    now at least as large. The result is the maximum that refining both would give (all but
    always: see :data:`_FIRST_SPLIT_SHARE`). Each direction refined is added to ``bound``
    where rounding may still decide it, or to ``split`` where the split of :mod:`.rare`
    alone answered it (with ``rare_split``). ``cuts``: see :func:`_compose_direction`; ``kept``
    and ``after``: :func:`_first_answers`.
    ``settle_first`` (the calibration's model, :func:`model_epsilon`): one after the other,
    the other's quickest candidate first (float64 at its own tilt where above the grid's),
    the rest only where still above the larger's final value (side by side, the other's
    split took 0.9 s for nothing at q 1.72e-6). Without ``refine``: the float64 answers
    ``{direction: (epsilon, rounding decides)}``, for ``known`` later. ``ceiling``: another
    sound bound, reported where smaller (:func:`_past_ceiling`; ``lows``: :func:`_composer`)."""
    compose, lows = _composer(steps, deltas, (mixture, cuts), lows)
    together = mixture is None or grid.n > _MIXTURE_APART_POINTS  # (_both_directions)
    first = known or _first_answers(lambda d: _first_answer(compose, d, grid, uncertified), together, kept, after, shift)
    if not refine:
        return first
    epsilons, offsets = {direction: value for direction, (value, _) in first.items()}, {_REMOVE: 0.0, _ADD: shift}
    if _past_ceiling(steps, deltas, first, (lows, offsets, ceiling, bound), mixture is None and rare_split):
        return epsilons
    order = sorted(epsilons, key=lambda d: epsilons[d] + offsets[d], reverse=True)
    refinable = {d: first[d][1] and not _unlowerable(epsilons[d], grid, d) for d in epsilons}
    grid_values = {direction: epsilons[direction] + offsets[direction] for direction in epsilons}

    def refine(direction: str, floor: float = 0.0) -> tuple[float, bool, bool]:
        # none sought below a share of the other's grid value or ``floor`` (its final value): it stays above
        enough = max(_ENOUGH_SHARE * grid_values[_other(direction)], floor) - offsets[direction]
        return _rounding_bound(steps, direction, grid, deltas[direction], epsilons[direction],
                               functools.partial(compose, direction), mixture is None, rare_split, enough,
                               first[direction])

    # both near each other: the second is usually refined too, side by side on two cores
    larger, smaller = (epsilons[d] + offsets[d] for d in order)
    both = not settle_first and all(refinable.values()) and smaller >= _SIDE_BY_SIDE_SHARE * larger
    if both and mixture is None:  # the quickest candidates first: one may settle far below the other
        order, both = _quick_first(steps, deltas, grid, epsilons, offsets, compose)
    floors = (_split_floors(steps, deltas, epsilons, offsets) if both and mixture is None and rare_split
              else {_REMOVE: 0.0, _ADD: 0.0})
    ahead = _both_directions(lambda d: refine(d, floors[_other(d)])) if both and _side_by_side() else {}
    for direction in order:
        other = _other(direction)
        if refinable[direction] and epsilons[direction] + offsets[direction] >= epsilons[other] + offsets[other]:
            second = settle_first and mixture is None and direction == order[1]  # (own tilts: plain steps)
            fast = _quick_refined(steps, direction, grid, deltas[direction], compose) if second else math.inf
            if fast + offsets[direction] <= epsilons[other] + offsets[other]:
                epsilons[direction], by_split, binding = fast, False, True  # settled below the larger's final value
            else:  # the second in order is refined knowing the first's final value
                floor = max(floors[other], epsilons[other] + offsets[other] if direction == order[1] else 0.0)
                epsilons[direction], by_split, binding = ahead.get(direction) or refine(direction, floor)
            if bound is not None and split is not None and (by_split or binding):
                (split if by_split else bound).add(direction)
    return epsilons


def _composer(steps: tuple, deltas: dict, mixture_cuts: tuple, lows: dict | None) -> tuple:
    """``(compose, lows)`` for :func:`_compose_on`: ``compose(direction, grid, dtype)``
    (:func:`_compose_direction`, each composition made once: :func:`_remembered`), with
    ``mixture_cuts``: its ``(mixture, cuts)``; ``lows`` (a new dict where None) maps each
    direction to the refinement floors of its compositions (:func:`_past_ceiling`), kept
    by a caller that composes first answers and refines them in a second call."""
    mixture, cuts = mixture_cuts
    lows = {} if lows is None else lows
    return _remembered(lambda direction, on, dtype: _compose_direction(
        steps, direction, on, deltas[direction], dtype, mixture=mixture, cuts=cuts,
        floors=lows.setdefault(direction, []))), lows


def _past_ceiling(steps: tuple, deltas: dict, first: dict, state: tuple, splits: bool) -> bool:
    """Whether no refinement on the grid can bring :func:`_compose_on`'s reported value
    below ``ceiling`` (``state``: ``(floors, offsets, ceiling, bound)``; where it cannot,
    the directions rounding decides are added to ``bound``, a set or None): some direction's
    ``first`` answer, where rounding does not decide it, or else its first
    :func:`_refinement_floor` (``floors``), plus its offset, is at or above the ceiling,
    and no split of :mod:`.rare` (tried where ``splits``) answers it instead. The reported
    value is at least that direction's, and the caller then reports the ceiling.

    At q 0.36 to 0.86 over 10^8 steps (epsilon near 10^6) the RDP and mixture bounds lie
    below the PLD's answers, and extended precision and other tilts composed seven
    times more on 2^20 points to find answers still above them (sigma 4.04, q 0.722,
    delta 2.1e-12: removal's floor 1,643,358 and its refined answer 1,648,413, against a
    ceiling of 1,617,730; 0.87 s). The floor reads this composition's grid distributions,
    which other tilts wrap around a little differently: only which sound bound is
    reported is at stake, not soundness."""
    floors, offsets, ceiling, bound = state
    if not ceiling < math.inf:
        return False
    for direction, (value, binding) in first.items():
        lowest = (floors.get(direction) or [0.0])[0] if binding else value
        if (lowest + offsets[direction] >= ceiling
                and not (binding and splits and rare.split_epsilon(steps, direction, deltas[direction], value))):
            if bound is not None:
                bound.update(d for d in first if first[d][1])
            return True
    return False


def _remembered(compose):
    """``compose(direction, grid, dtype)``, each grid, direction and precision composed once:
    :func:`_refined` asks again for the float64 answer at a direction's own tilt that
    :func:`_quick_first` composed (at sigma 0.103, q 2.2e-6 over 10^8 steps, 0.17 s of
    0.8 s). A composition is deterministic, so the answer is the same."""
    seen: dict = {}

    def remembered(direction: str, on: _Grid, dtype) -> tuple[float, bool]:
        key = (direction, np.dtype(dtype).str, repr(on))
        if key not in seen:
            seen[key] = compose(direction, on, dtype)
        return seen[key]
    return remembered


def _first_answers(answer, together: bool, kept: dict | None, after: dict | None = None, shift: float = 0.0) -> dict:
    """``{direction: answer(direction)}`` (:func:`_both_directions`), but a direction in
    ``kept`` (``{direction: epsilon}``, for one direction, not composed) keeps its epsilon,
    marked as not decided by rounding (so it is not refined).

    ``after``: each direction's sound answer on an earlier grid (or None); ``shift``: what
    the caller adds to addition's. Where the two directions would run one after
    the other anyway (``together`` False, or one core), the larger there is answered
    first; where rounding does not decide its answer (it is then final on this grid) and
    that is at least the other's earlier answer, the other keeps that answer, as if
    ``kept``: the caller keeps each direction's smaller answer of the two grids and
    reports the larger direction's, so composing the other could lower only a value that
    is not reported. 2,000 one-step pairs at q 1e-4 to 1e-5 (mixture groups on 2^17
    points): removal 0.0066839, addition 0.0058170 on the grid before, 0.46 s saved."""
    offsets = {_REMOVE: 0.0, _ADD: shift}
    if not kept and after is not None and not (together and _side_by_side()):
        larger = max((_REMOVE, _ADD), key=lambda d: after[d] + offsets[d])  # (removal on a tie)
        other, found = _other(larger), answer(larger)
        settled = not found[1] and found[0] + offsets[larger] >= after[other] + offsets[other]
        answers = {larger: found, other: (after[other], False) if settled else answer(other)}
        return {direction: answers[direction] for direction in (_REMOVE, _ADD)}
    if not kept:
        return _both_directions(answer, together)
    (held, value), = kept.items()
    return {held: (value, False), _other(held): answer(_other(held))}


def _first_answer(compose, direction: str, grid: _Grid, uncertified: set | None) -> tuple[float, bool]:
    """``direction``'s float64 answer on ``grid`` for :func:`_compose_on`: at the grid's
    tilt; or, where an earlier grid of the same call certified nothing for the direction
    at its tilt (``direction`` in ``uncertified``, kept by :func:`_compose_and_invert`),
    at a quarter of it first, which stands where rounding does not decide it. That is
    where :func:`_refined` would end, without composing again at a tilt that certifies
    nothing (120 pairs at q 2.1e-5: 13 s on the second grid's 2^20 points). A direction
    whose answer at the grid's tilt certifies nothing is added to ``uncertified``."""
    if uncertified is not None and direction in uncertified and grid.tilt > 0.0:
        quarter = compose(direction, dataclasses.replace(grid, tilt=grid.tilt / 4.0), np.float64)
        if not quarter[1]:
            return quarter
    found = compose(direction, grid, np.float64)
    if uncertified is not None and not _certifies(found[0], _directed(grid, direction)):
        uncertified.add(direction)
    return found


def _unlowerable(answer: float, grid: _Grid, direction: str) -> bool:
    """Whether ``direction``'s answer on ``grid`` is not worth refining in other
    precisions and tilts: an epsilon of 0, which none lowers, or one in the first bins
    of a window of its own (:func:`_narrow_windows`), where the exact epsilon may lie
    below the window and none lowers it by more than those bins (1.1e-5 of epsilon on a
    ledger of 29 runs at 3,592). Mixture groups size their grid by their corners, which
    dominate them, and the corners' body can lie above the mixtures' answer (3000 runs
    of 1000 steps, sigma 0.956 to 0.664, q 0.151 to 0.368, delta 1.3e-10: 241,920 at
    removal's window bottom, where extended precision spent 3.7 s to find it again; the
    other bounds answer 241,630)."""
    return not answer > 0.0 or (grid.lows is not None and answer <= (grid.lows[direction] + 2) * grid.spacing)


def _certifies(answer: float, grid: _Grid) -> bool:
    """Whether an answer on ``grid`` (as its direction reads it, :func:`_directed`) was
    certified below its window's last bins."""
    return answer <= (grid.i_low + grid.n - 3) * grid.spacing


def _quick_first(steps: tuple, deltas: dict, grid: _Grid, epsilons: dict, offsets: dict, compose) -> tuple:
    """``(order, both)`` for :func:`_compose_on` where both directions are refinable and
    near each other on ``grid``: each direction's quickest candidate (:func:`_quick_refined`,
    side by side) first. Where the smaller lies below :data:`_SETTLED_SHARE` of the other's
    grid value, it is kept (``epsilons`` updated: a sound answer), the directions are
    refined one after the other, the larger first, and the other only where still at least
    the larger's final value (``both`` False). Else as before (``both`` True).

    Side by side, each direction went on to its split and other tilts and precisions at
    once: at q 9.5e-5 over 5.1*10^7 steps, delta 2.8e-10, addition's split took 1.9 s to
    reach 668, where its own tilt gave 468 in float64 and removal's final value was 858."""
    quick = _both_directions(lambda d: _quick_refined(steps, d, grid, deltas[d], compose))
    lesser = min(quick, key=lambda d: quick[d] + offsets[d])
    if not quick[lesser] + offsets[lesser] < _SETTLED_SHARE * (epsilons[_other(lesser)] + offsets[_other(lesser)]):
        return sorted(epsilons, key=lambda d: epsilons[d] + offsets[d], reverse=True), True
    epsilons[lesser] = min(epsilons[lesser], quick[lesser])
    return sorted(epsilons, key=lambda d: epsilons[d] + offsets[d], reverse=True), False


#: :func:`_quick_first` keeps a direction's quickest candidate, refining it no further for
#: now, below this share of the other's grid value.
_SETTLED_SHARE = 0.75


def _split_floors(steps: tuple, deltas: dict, epsilons: dict, offsets: dict) -> dict:
    """Per direction, the value below which the *other* direction is not refined further
    (:func:`_compose_on`, where both are refinable and near each other): a share
    :data:`_FIRST_SPLIT_SHARE` of its split on the first grid it is refined on
    (:func:`_first_splits`, side by side), 0 where it has none."""
    firsts = _first_splits(steps, deltas, epsilons)
    return {d: _FIRST_SPLIT_SHARE * (firsts[d] + offsets[d]) if firsts[d] > 0.0 else 0.0 for d in firsts}


def _other(direction: str) -> str:
    return _ADD if direction == _REMOVE else _REMOVE


def _first_splits(steps: tuple, deltas: dict, epsilons: dict) -> dict:
    """Each direction's split of :mod:`.rare` on the grid it is first refined on (from its
    grid value in ``epsilons``; cached, so its refinement starts from it), side by side;
    0 where there is none or rounding decides it."""
    def first(direction: str) -> float:
        found = rare.split_epsilon(steps, direction, deltas[direction], epsilons[direction], again=False)
        return found[0] if found is not None and not found[1] else 0.0
    return _both_directions(first)


#: Where both directions are refined (:func:`_compose_on`), one whose first split is below
#: this share of the other's is not refined further: the other's refinement would have to
#: lower that by more than a tenth for the maximum to change, and then the maximum is still
#: sound (q 1e-6 over 10^8 steps, sigma 0.661: addition's 0.193 against removal's 0.226,
#: refined to 0.2249; refining addition too, to 0.186, doubled the work).
_FIRST_SPLIT_SHARE = 0.9


def _quick_refined(steps: tuple, direction: str, grid: _Grid, delta: float, compose) -> float:
    """``direction``'s float64 answer at its own tilt (:func:`_own_tilt`) where that is
    above the grid's, the quickest of :func:`_refined`'s candidates; inf where it is not."""
    own = _own_tilt(steps, direction, grid, delta)
    if own is None or not own > grid.tilt:
        return math.inf
    return compose(direction, dataclasses.replace(grid, tilt=own), np.float64)[0]


#: :func:`_compose_on` seeks no smaller split answer for a direction once it is below this
#: share of the other's float64 grid value (addition's refinement at q 1.6e-6 over 10^8
#: steps took 1.1 s to go from 0.84 to 0.79, where removal's was 3.81).
_ENOUGH_SHARE = 0.25

#: :func:`_compose_on` refines both directions side by side where the smaller is at least
#: this share of the larger.
_SIDE_BY_SIDE_SHARE = 0.9


def _rounding_bound(steps: tuple, direction: str, grid: _Grid, delta: float, value: float, compose,
                    plain: bool = True, rare_split: bool = True, enough: float = 0.0,
                    first: tuple | None = None) -> tuple[float, bool]:
    """The smallest of ``value`` (float64 on ``grid``, decided by rounding) and the other
    sound answers for ``direction``: where one rare loss may decide epsilon, the split
    of :mod:`.rare`, which stands alone where rounding does not decide it; otherwise
    :func:`_refined` (``compose(grid, dtype)`` at other tilts and precisions). ``plain``:
    ``steps`` are what is composed (not mixture groups' corners), so both apply (the
    split only with ``rare_split``; ``enough``: see :func:`~dpoptim.accounting.rare.split_epsilon`;
    ``first``: the float64 answer at the grid's tilt, see :func:`_refined`). Returns the value, whether the split alone gave it, and whether rounding may still
    decide it (False where some answer it is the smallest of was not decided by rounding)."""
    grid = _directed(grid, direction)
    split = rare.split_epsilon(steps, direction, delta, value, enough=enough) if plain and rare_split else None
    if split is not None and not split[1]:
        return min(value, split[0]), True, False
    if split is not None and split[0] < enough:
        return min(value, split[0]), False, True  # sound, and below what the caller needs
    own = _own_tilt(steps, direction, grid, delta) if plain else None
    value, binding = _refined(compose, grid, value, own, first, enough)
    return (value if split is None else min(value, split[0])), False, binding


def _refined(compose, grid: _Grid, value: float, own_tilt: float | None = None,
             first: tuple | None = None, enough: float = 0.0) -> tuple[float, bool]:
    """``(answer, binding)``: the smallest of ``value`` (float64 on ``grid``, rounding-bound)
    and the answers of ``compose(grid, dtype)`` at other tilts and precisions, while
    rounding still decides: at the direction's ``own_tilt`` where it is above the grid's
    (float64, then extended precision), at tilts climbing from there (:func:`_climbed`,
    small grids), at the grid's tilt in extended precision, then at a quarter and a
    sixteenth of it as long as a smaller tilt helps in float64 (first, where the grid's
    tilt certifies nothing: :func:`_smaller_tilts`).

    The rounding allowance grows with the untilting factor e^{cgf - tilt * loss} at the
    answer. The grid's tilt is Chernoff-optimal at delta for the larger of the two
    directions' log moment generating functions, that is for the heavier direction: for
    the other (adding, at tiny sigma: sigma 0.0437, q 1e-4, 10^5 steps, delta 1e-12) it
    can sit far below the answer, where 4 times the tilt takes its answer from 10148, in
    extended precision, to 5244 in float64, below the removal's 9980
    (:func:`_own_tilt`). The tilt can also sit far above the answer, for a few steps at
    tiny q (one step at q 3.8e-5: a tilt of 32 where 8 centres it), and no precision
    recovers from that. Where the tilt is not above the answer, a smaller one only
    loses: the first float64 answer that is no better ends the search. Any tilt is sound
    (what wraps around can only raise delta; :func:`_choose_tilt`): each answer is an
    upper bound, and so is their minimum. ``binding`` is False where one of the answers
    was not decided by rounding (the smallest is then at most that grid's value).
    ``first``: the float64 answer at the grid's tilt, where the caller has it (see
    :func:`_once`). ``enough``: no lower answer is sought once one is below it (see
    :func:`_compose_on`: the other direction's final value is all but sure to be above).
    """
    extended = _EXTENDED_U < _U
    seen = {} if first is None else {(grid.tilt, np.dtype(np.float64).str): first}
    top = grid if own_tilt is None or not own_tilt > grid.tilt else dataclasses.replace(grid, tilt=own_tilt)
    ahead: dict = {}  # (tilt, dtype) -> an answer composed ahead, used where the tries ask for it
    raw, compose = compose, _once(_ahead_or(compose, ahead), seen, enough)
    binding = True
    if top is not grid and extended and top.n >= _AHEAD_POINTS and _core_idle():
        (answer, binding), ahead[(top.tilt, np.dtype(np.longdouble).str)] = _beside(
            lambda: compose(top, np.float64), lambda: _attempted(raw, top, np.longdouble))
        value = min(value, answer)
    elif top is not grid:
        answer, binding = compose(top, np.float64)
        value = min(value, answer)
    elif not _certifies(value, grid):  # nothing certified at the grid's tilt: smaller tilts first
        value, binding = _smaller_tilts(compose, grid, value, False)
        if not binding:
            return value, False
    if binding and extended:
        answer, binding = compose(top, np.longdouble)
        value = min(value, answer)
    if not binding:
        return value, False  # rounding does not decide it there: other tilts read the same grid
    if extended and grid.n <= _CLIMB_POINTS:
        climbed, binding = _climbed(compose, top, value)
        if climbed < value:
            return climbed, binding  # a larger tilt helps, so a smaller one would not
    if top is not grid and extended:  # the grid's own tilt, in extended precision
        answer, binding = compose(grid, np.longdouble)
        value = min(value, answer)
    return _smaller_tilts(compose, grid, value, extended, binding)


def _smaller_tilts(compose, grid: _Grid, value: float, extended: bool, binding: bool = True) -> tuple[float, bool]:
    """For :func:`_refined`: ``(value, binding)`` after the answers at a quarter and a
    sixteenth of ``grid``'s tilt (float64, then with ``extended`` extended precision),
    while rounding decides (``binding``) and a smaller tilt helps.

    Where nothing is certified at the grid's tilt in float64 (an answer of inf, or in
    the window's last bins), these come first: a schedule of 2,000 pairs at q 1e-4 to
    1e-5 had removal's answer at 0.0066 under a tilt of 26.9, where extended precision,
    and larger tilts, certified nothing either (24 of its 34 s), and a quarter of the
    tilt answered without rounding deciding (120 pairs at q 2.1e-5: 6.2499, the window's
    top, at a tilt of 8, and 0.0051 at 2; 37 s of 43 saved). Where one does so, it
    stands: a grid's value is then read to within the rounding allowance, at most
    delta / 100 (:func:`_invert_profile`), at any tilt."""
    tilt = grid.tilt
    for _ in range(2):
        tilt /= 4.0
        if not (binding and tilt > 0.0):
            break
        on = dataclasses.replace(grid, tilt=tilt)
        answer, binding = compose(on, np.float64)
        if not answer < value:
            binding = True  # (no better: not an answer that stands)
            break  # a smaller tilt does not help here
        value = answer
        if binding and extended:
            answer, binding = compose(on, np.longdouble)
            value = min(value, answer)
    return value, binding


#: :func:`_refined` composes a direction's own tilt in extended precision on an idle core
#: beside the float64 answer there, which decides whether it is asked for, on grids of
#: this many points or more: sigma 0.276, q 7.5e-5, 10^8 steps, delta 3.1e-9 (2^22 points,
#: 0.2 s in float64, 0.58 s extended).
_AHEAD_POINTS = 2**21


def _ahead_or(compose, ahead: dict):
    """``compose(grid, dtype)``, or the answer for its ``(tilt, dtype.str)`` in ``ahead``,
    composed there ahead on the same grid (:func:`_refined`); None there: composed here."""
    def composed(on: _Grid, dtype) -> tuple[float, bool]:
        found = ahead.pop((on.tilt, np.dtype(dtype).str), None)
        return compose(on, dtype) if found is None else found
    return composed


def _attempted(compose, on: _Grid, dtype):
    """``compose(on, dtype)`` ahead of the tries (:func:`_refined`), or None where it fails
    in any way: the tries then compose it themselves where they ask for it (and fail as
    they would have), and where they do not, nothing failed."""
    try:
        return compose(on, dtype)
    except Exception:  # (raised again by the tries, where they ask for it)
        return None


def _once(compose, seen: dict, enough: float = 0.0):
    """``compose(grid, dtype)``, each ``(tilt, dtype)`` computed once (one grid otherwise;
    ``seen``: answers already had, by ``(tilt, dtype.str)``). Where no grid point's
    untilting factor was representable at a tilt in float64 (:data:`_UNTILTABLE`), none is
    in extended precision either (the factors, ``cgf - tilt * loss``, do not depend on
    it), and the float64 answer stands for it: 10^4 runs of 1000 steps at q 0.055 to
    0.37 composed 2^20 points in extended precision for 6 s a direction to find that.
    Once an answer is below ``enough``, later ones are ``(inf, True)`` without composing
    (no help, and rounding may decide: what :func:`_refined` has stands)."""
    float64 = np.dtype(np.float64).str

    def composed(on: _Grid, dtype) -> tuple[float, bool]:
        key = (on.tilt, np.dtype(dtype).str)
        if key not in seen and any(answer < enough for answer, _ in seen.values()):
            return math.inf, True
        if key not in seen:
            base = seen.get((on.tilt, float64))
            untiltable = key[1] != float64 and base is not None and base[1] == _UNTILTABLE
            seen[key] = base if untiltable else compose(on, dtype)
        return seen[key]
    return composed


#: Grids up to this size, where rounding decides even in extended precision, also try
#: tilts a quarter octave and more above the grid's (:func:`_climbed`): a few hundredths
#: of a second each there.
_CLIMB_POINTS = 2**17


def _climbed(compose, grid: _Grid, value: float) -> tuple[float, bool]:
    """The smallest of ``value`` and the extended-precision answers at tilts a quarter,
    a half and three quarters of an octave above ``grid``'s, while each helps, and
    whether rounding decided it (True for ``value``).

    The grid's tilt is capped so that what wraps around the window stays far below delta
    (:func:`_choose_tilt`), and set on a quarter-octave lattice. Where rounding decides
    even in extended precision, a larger tilt shrinks the untilting factor at the answer
    faster than the wrap grows, up to a cliff: q 1e-6, 911,178 steps, delta 1e-12, at
    2^16 points, 0.0923 at the grid's tilt of 26.9, 0.0898 at 32, 0.0882 at 38.1 and
    0.320 at 45.3. The grid's tilt moving on its lattice as the step count grows made
    epsilon jump (down 1.1% from 911,178 to 946,152 steps); the best tilt on the lattice
    keeps the answer rising with the count."""
    tilt, decided = grid.tilt, True
    for _ in range(3):
        tilt *= 2.0**0.25
        answer, binding = compose(dataclasses.replace(grid, tilt=tilt), np.longdouble)
        if not answer < value:
            break
        value, decided = answer, binding
        if not binding:
            break
    return value, decided


def _own_tilt(steps: tuple, direction: str, grid: _Grid, delta: float) -> float | None:
    """The tilt :func:`_choose_tilt` gives ``direction`` alone on ``grid``, from its own
    composed log moment generating function at 1 to 2^12 times the grid's tilt (None
    where the grid has none): the grid's tilt serves the heavier direction."""
    grid = _directed(grid, direction)
    if not grid.tilt > 0.0:
        return None
    lambdas = grid.tilt * 2.0 ** np.arange(0.0, 12.25, 0.25)
    bottoms = grid.bottoms[direction] if grid.bottoms else (grid.i_low,) * len(steps)
    cgf = np.zeros_like(lambdas)
    for (sigma, q, count), bottom, top in zip(steps, bottoms, grid.tops[direction]):
        first, masses, _ = _step_distribution(sigma, q, direction, grid.spacing, bottom, top,
                                              thin=_thin_of(grid, direction))
        cgf = cgf + count * _log_mgf(first, masses, grid.spacing, lambdas)
    wrap = _from_bottom(cgf, lambdas, grid.i_low * grid.spacing)
    return _choose_tilt(lambdas, cgf, grid.n * grid.spacing, delta, wrap)


def _lower_on(steps: tuple, deltas: dict, grid: _Grid, kernel=None) -> dict:
    """:func:`_compose_on` for the rigorous lower bound (see :func:`pld_epsilon_lower_bound`);
    ``kernel``: see :func:`_compose_direction`."""
    return _both_directions(lambda direction: _direction_lower(
        steps, direction, _lower_grid(steps, direction, grid), deltas[direction], kernel))


def _side_by_side() -> bool:
    """Whether :func:`_both_directions` would run its two directions at once."""
    return _usable_cores() >= 2 and not _on_accounting_thread()


#: Mixture compositions on at most this many points run their two directions one after
#: the other (:func:`_both_directions`).
_MIXTURE_APART_POINTS = 2**18


def _both_directions(compose, together: bool = True) -> dict:
    """``{direction: compose(direction)}`` for removal and addition, side by side.

    The two directions are independent compositions of the same cost. Where the process
    may use two cores or more, addition runs on the accounting's background thread while
    this one composes removal (numpy's transforms and array arithmetic release the
    interpreter lock, so they overlap); the values are the same either way.

    ``together=False``: one after the other, for work that holds the interpreter lock
    more than it releases it. Mixture groups on a small grid are mostly small arrays and
    Python, and side by side each thread waits for the lock: on 2^14 to 2^18 points
    (:data:`_MIXTURE_APART_POINTS`) the 10^4-run schedule took 0.46 s side by side and
    0.37 s one after the other, the 10^4 one-step pairs 0.53 and 0.45, the 100-run sigma
    and 80-run q schedules 0.46 and 0.37, 0.41 and 0.34 (medians of three, in one
    process). From 2^19 points on the transforms dominate: no clear difference either way.
    """
    if not (together and _side_by_side() and not _on_accounting_thread()):
        return {direction: compose(direction) for direction in (_REMOVE, _ADD)}
    _count_sides(2)
    try:
        added = background.executor(_THREAD_PURPOSE).submit(_counted, compose, _ADD)
    except BaseException:
        _count_sides(-2)
        raise
    removed = _counted(compose, _REMOVE)
    return {_REMOVE: removed, _ADD: background.wait(_THREAD_PURPOSE, added)}


def _beside(first, second, needed=None) -> tuple:
    """``(first(), second())``, the second on another thread while this one runs the first
    where one is free, else one after the other; ``needed``: where given, the second is
    needed only where ``needed(first())`` holds, else None stands for it (one after the
    other it is then not computed). From the caller's thread, the other is the
    accounting's background thread, where a core is idle (:func:`_core_idle`), and the
    two count as two sides, as :func:`_both_directions` counts its directions, so that
    neither hands work to the other's thread. From that thread, the second is offered to
    a caller waiting for it, now or later (:func:`~dpoptim.background.offer`: a caller
    busy with its own side takes it once that is done); if none has taken it once the
    first is done, it is computed here (or withdrawn, where not needed). It counts as a
    side while a caller runs it."""
    if _on_background_thread():
        offered = background.offer(_THREAD_PURPOSE, lambda: _taken(second))
        try:
            mine = first()
        except BaseException:
            offered.withdraw()
            raise
        if needed is not None and not needed(mine):
            offered.withdraw()
            return mine, None
        return mine, offered.result()
    if not _core_idle():
        mine = first()
        return mine, second() if needed is None or needed(mine) else None
    _count_sides(2)
    try:
        later = background.executor(_THREAD_PURPOSE).submit(_counted, lambda _: second(), None)
    except BaseException:
        _count_sides(-2)
        raise
    mine = _counted(lambda _: first(), None)
    theirs = background.wait(_THREAD_PURPOSE, later)
    return mine, theirs if needed is None or needed(mine) else None


def _taken(function):
    """``function()``, offered by the background thread (:func:`_beside`): counted as a side
    where a caller runs it, as that thread's own work where it does."""
    if _on_background_thread():
        return function()
    _count_sides(1)
    return _counted(lambda _: function(), None)


def _counted(compose, direction: str):
    """``compose(direction)``, one side fewer running once it ends."""
    try:
        return compose(direction)
    finally:
        _count_sides(-1)


#: How many sides of :func:`_both_directions` run now; while two do, a batch of
#: transforms keeps to its own thread (:func:`_transform_workers`).
_sides_running = [0]
_sides_lock = threading.Lock()


def _count_sides(change: int) -> None:
    with _sides_lock:
        _sides_running[0] += change


def _after_fork_in_child() -> None:
    """A forked child keeps only the thread that forked: a lock another thread held stays
    held there for good, and the sides it counted never end. Both start afresh, as the
    background threads do (:mod:`dpoptim.background`)."""
    global _prefix_lock, _sides_lock
    _prefix_lock, _sides_lock = threading.Lock(), threading.Lock()
    _sides_running[0] = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _spread(function, items: list) -> list:
    """``[function(item) for item in items]``, the second half on another thread where one
    is free (:func:`_beside`: a direction composed alone, as in an extended precision
    refinement, where mixing the groups' rows is most of the time): numpy's array
    arithmetic releases the interpreter lock, and each item is computed alone."""
    if len(items) < 2:
        return [function(item) for item in items]
    half = len(items) // 2
    first, second = _beside(lambda: [function(item) for item in items[:half]],
                            lambda: [function(item) for item in items[half:]])
    return first + second


def _core_idle() -> bool:
    """Whether work handed to :func:`_beside` now runs on another thread at once: no two
    sides run, and from a caller's thread the process may use two cores (the accounting
    thread takes it), from the accounting thread a caller waits for it (and takes what it
    offers: :func:`~dpoptim.background.offer`). Which thread this is, is checked here as
    well as in :func:`_side_by_side`, which tests replace, so that nothing on the
    accounting thread ever waits for work queued behind itself."""
    if _sides_running[0] > 1:
        return False
    if _on_background_thread():
        return background.waiting(_THREAD_PURPOSE)
    return _side_by_side() and not _on_accounting_thread()


def _on_accounting_thread() -> bool:
    """Whether this is the accounting's background thread, or a caller running work that
    thread offered it (:func:`~dpoptim.background.serving`)."""
    return _on_background_thread() or background.serving(_THREAD_PURPOSE)


def _on_background_thread() -> bool:
    """Whether this is the accounting's background thread itself."""
    return threading.current_thread().name.startswith(_THREAD_PREFIX)


def _transform_workers() -> int:
    """Threads for one batch of transforms (scipy splits the rows among them): every usable
    core unless two directions run side by side, such as a direction refined alone in
    extended precision (64 rows at 2^20 points: 3.7 s on one core); one otherwise."""
    return 1 if _sides_running[0] > 1 else _usable_cores()


_THREAD_PURPOSE = "accounting"
_THREAD_PREFIX = f"dpoptim-{_THREAD_PURPOSE}"


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - platforms without affinity
        return os.cpu_count() or 1


#: The grid sizes the accountant chooses from by default (``grid_points=None``).
AUTO_GRID_POINTS = (2**14, 2**20)

#: Default grids: the mean shift of connect-the-dots, about ``T h^2 / 8``, may be at
#: most this share of epsilon (see :func:`_shift_fine`).
_SHIFT_SHARE = 1e-3

#: ... and a bin at most this share of it (reading the profile between grid points can
#: cost up to a bin).
_BIN_SHARE = 5e-3


def _rdp_guess(steps: tuple, delta: float) -> float:
    """The RDP epsilon of ``steps`` on the window's orders: a cheap guess, above the PLD's."""
    rdp = sum(count * _window_rdp(sigma, q) for sigma, q, count in steps)
    return epsilon_from_rdp(rdp, _WINDOW_ORDERS, delta)[0]


def _shift_fine(steps: tuple, spacing: float, epsilon: float, tilt: float | None = None) -> bool:
    r"""Whether a grid of this spacing keeps the default accountant within about 0.1% of
    the exact epsilon, judged from a guess of epsilon.

    Splitting a bin's mass between its end points keeps its :math:`P`- and
    :math:`Q`-mass but raises the mean loss by up to about :math:`h^2/8` per step
    (measured), so ``T`` steps move epsilon up by about :math:`T h^2 / 8`; and reading
    the profile between grid points costs up to a bin, which matters for few steps.

    ``tilt``: epsilon lies far beyond the body of the composed loss (:func:`_beyond_body`),
    where it is set by the log moment generating function at about that tilt rather than
    by the mean. Splitting adds up to :math:`h^2/4` of variance per step, which raises
    that function by about :math:`\theta^2 T h^2 / 8` and epsilon by :math:`\theta T h^2
    / 8`; measured at tiny q the shift is up to four times that, so the test is
    :math:`\max(\theta, 1)\, T h^2 / 2`.

    This only steers the grid size, never soundness: a coarse grid gives a sound, less
    tight answer, and the tests bracket it against a rigorous lower bound.
    """
    if not 0.0 < epsilon < math.inf:
        return epsilon == 0.0
    total = sum(count for _, _, count in steps)
    shift = total * spacing * spacing * (1.0 / 8.0 if tilt is None else max(tilt, 1.0) / 2.0)
    return shift <= _SHIFT_SHARE * epsilon and spacing <= _BIN_SHARE * epsilon


def _choose_grid(steps: tuple, delta: float, n: int, last: int | None = None, guess: float | None = None,
                 shift_until: int | None = None, tail_fraction: float = _TAIL_FRACTION, spread: bool = True,
                 tilt: float = 1.0, order: float | None = None) -> _Grid:
    """The grid for ``steps``: the RDP window or a certified narrower one, from ``n``
    points refined (up to ``last``, default _MAX_REFINE times ``n``) until connect-the-dots
    spreads the loss little (unless ``spread`` is False, or ``guess`` lies beyond the
    body of the loss: :func:`_beyond_body`, where the shift test takes the transform's
    ``tilt``) and, given a ``guess`` of epsilon, shifts it little (that test only below
    ``shift_until`` points, when given; ``order``: see :func:`_fine_for`).
    ``tail_fraction``: the share of delta each wrap-around bound, and the mass the
    steps' cuts send to +inf, may take."""
    last = _MAX_REFINE * n if last is None else last
    tail = tail_fraction * delta

    def fine(spacing: float) -> bool:
        shift_matters = guess is not None and (shift_until is None or n < shift_until)
        return _fine_for(steps, spacing, guess if shift_matters else None, delta, tilt, spread, n, order)

    while True:
        at_last = n >= last
        try:  # a window usually fits at once or after one doubling; else try more points
            window = _window(steps, tail, n, 64 if at_last else 4)
        except FloatingPointError:  # the loss spread at this size outgrows any RDP window
            if at_last:  # a certified narrow one may still hold it (tiny sigma, 10^8 steps)
                narrow = _narrow_grid(steps, n, math.inf, tail, delta)
                if not isinstance(narrow, _Grid):
                    raise
                return dataclasses.replace(narrow, cut=tail_fraction)
            n *= 2
            continue
        # Not the last size: the narrow grid is only certified when it could end the
        # refinement (see _narrow_grid's ``fine``), the same grid at a fraction of the cost;
        # the RDP grid is only built when it is the one returned.
        narrow = _narrow_grid(steps, n, window[2], tail, delta, None if at_last else fine)
        if narrow is not _TOO_COARSE:
            spacing = window[2] if narrow is None else narrow.spacing
            if at_last or fine(spacing):
                return dataclasses.replace(narrow or _rdp_grid(steps, tail, delta, n, window), cut=tail_fraction)
        n *= 2


def _fine_for(steps: tuple, spacing: float, guess: float | None, delta: float, tilt: float,
              spread: bool = True, points: int = 0, order: float | None = None) -> bool:
    """Whether ``spacing`` is fine for ``steps``: the shift test for a ``guess`` of epsilon
    (none without one), with the transform's ``tilt`` where the guess lies beyond the body
    of the loss (:func:`_beyond_body`), and otherwise, unless ``spread`` is False, the
    spread test too, on a grid of ``points`` (:func:`_spread_allowed`), or in its place the
    shift test at ``order`` with bins at most :data:`_SHIFT_SHARE` of the guess (None:
    none; a grid chosen so is checked after, :func:`_checked_refinement`).

    The spread test bounds the shift of an epsilon set by the body of the loss, its mean
    plus ``z`` deviations, where the Chernoff order is about ``z`` over the deviation and
    the two tests agree. Where rare large losses set epsilon at a lower order, a
    composed grid's tilt may tell: 751 runs of 31 steps at q 1.8e-5 to 4.2e-4, sigma
    0.86, delta 1.5e-9 are composed at tilt 4.8, where the body's order would be 245; the
    spread test asked for 2^19 points (5.2 s) where 2^17 moved epsilon by 0.03%."""
    beyond = guess is not None and _beyond_body(steps, guess, delta)
    if guess is not None and not _shift_fine(steps, spacing, guess, tilt if beyond else None):
        return False
    if not spread or beyond or _spread_share(steps, spacing) <= _spread_allowed(points, len(steps)):
        return True
    return (guess is not None and order is not None and spacing <= _SHIFT_SHARE * guess
            and _shift_fine(steps, spacing, guess, order))


#: What :func:`_narrow_grid` returns when no grid it could return is fine enough.
_TOO_COARSE = object()


def _lower_grid(steps, direction, grid: _Grid) -> _Grid:
    """The window for the dominated distributions of a lower bound, in their indices.

    Their composed loss at index ``k`` is ``k h`` plus the steps' offsets
    (:func:`_dominated_offset`), so the window moves down by that many bins. Merging
    bins (:func:`_dominated_masses`) loses the loss variance within about a bin, which
    lowers each step's mean loss by about :math:`h^2/8` at most: the window moves down by
    twice that over the ledger too (at most a quarter of its width). Whatever still falls
    below is bounded and subtracted (:func:`_below_window`), so the placement only
    affects how tight the bound is; mass above the window wraps to low losses, which
    only lowers a profile.
    """
    grid = _directed(grid, direction)
    total = sum(count for _, _, count in steps)
    drift = min(math.ceil(total * grid.spacing / 4.0) + 1, grid.n // 4)
    shift = math.floor(_total_offset(steps, direction, grid.spacing) / grid.spacing)
    return dataclasses.replace(grid, i_low=grid.i_low - drift - shift)


def _total_offset(steps, direction, spacing: float) -> float:
    """The sum over the ledger of the steps' grid offsets (:func:`_dominated_offset`)."""
    return math.fsum(count * _dominated_offset(sigma, q, direction, spacing) for sigma, q, count in steps)


#: Long runs: the grid is refined (up to _MAX_REFINE times the points asked for) until
#: connect-the-dots adds at most this share to the variance of the composed loss ...
_SPREAD_SHARE = 2e-3
_MAX_REFINE = 4

#: ... or, for ledgers of :data:`_SCHEDULE_PAIRS` pairs or more on grids of
#: :data:`_SCHEDULE_POINTS` points or more, this share (see :func:`_spread_allowed`).
_SCHEDULE_SPREAD_SHARE = 8e-3
_SCHEDULE_POINTS = 2**19
_SCHEDULE_PAIRS = 8


def _spread_allowed(points: int, pairs: int) -> float:
    """The share of the loss's variance connect-the-dots may add on a grid of ``points``
    for a ledger of ``pairs`` distinct pairs (or mixture corners).

    A schedule at q of 1e-3 or less can need 2^19 to 2^20 points by the strict share,
    where each of its many transforms takes tens of milliseconds: there four times that
    share, one grid size fewer, raised epsilon by 0.009% to 0.1% (measured on such
    schedules) and took half the time or less. One run keeps the strict share: its one
    transform is cheap, and where a bin is a large part of a tiny epsilon the finest grid
    is the tighter (q 1e-6 over 30 steps: 3% above the lower bound on half the points).
    This only steers the grid size; soundness never depends on it."""
    return _SPREAD_SHARE if points < _SCHEDULE_POINTS or pairs < _SCHEDULE_PAIRS else _SCHEDULE_SPREAD_SHARE


def _spread_share(steps: tuple, spacing: float) -> float:
    r"""Upper estimate of the variance connect-the-dots adds, relative to the loss's own.

    Splitting a bin's mass between its end points adds at most :math:`h^2/4` of variance
    per step (Doroshenko et al. 2022), so a run of ``T`` steps gains up to
    :math:`T h^2 / 4` against its variance :math:`T v`. The window, hence ``h``, grows
    like :math:`\sqrt T`, so the share grows like ``T``: after 10^8 steps at the default
    grid it is about 15% and epsilon several percent too high. Not applied where epsilon
    lies far beyond the body of the loss (:func:`_beyond_body`). This only steers the
    grid size; soundness never depends on it.
    """
    total = sum(count for _, _, count in steps)
    variance = sum(count * _loss_moments(sigma, q, _REMOVE, math.inf)[1] for sigma, q, count in steps)
    if not variance > 0:
        return 0.0
    return total * spacing * spacing / 4.0 / variance


def _beyond_body(steps: tuple, guess: float, delta: float) -> bool:
    r"""Whether ``guess`` (an upper estimate of epsilon) lies far beyond the body of the
    composed loss: above its mean plus ``4 z`` standard deviations, ``z`` the Gaussian
    quantile at delta. There epsilon is set by rare large losses (tiny q over few steps:
    a body 10^-4 wide, epsilon 0.1 at delta 1e-12), and the variance that connect-the-dots
    adds to the body (:func:`_spread_share`) does not move it; the shift test alone sizes
    the grid. A long run's epsilon lies a few deviations out (10^8 steps at sigma 1, q
    1e-3: 4.3), where that variance does move it."""
    moments = [_loss_moments(sigma, q, _REMOVE, math.inf) for sigma, q, _ in steps]
    mean = sum(count * m for (_, _, count), (m, _) in zip(steps, moments))
    deviation = math.sqrt(sum(count * v for (_, _, count), (_, v) in zip(steps, moments)))
    return guess > mean + 4.0 * math.sqrt(2.0 * math.log(1.0 / delta)) * deviation


def _fft_size(grid_points: int) -> int:
    return 1 << max(10, (grid_points - 1).bit_length())


# --- window: where the composed loss lives ------------------------------------------


def _window_orders() -> np.ndarray:
    # 48 fractional orders geometric in alpha - 1 from 0.01 to 9, and 32 integers
    # geometric from 2 to 8192: a Chernoff bound holds at any order, so fewer orders only
    # widen the window a little, at a fifteenth of the cost of DEFAULT_ORDERS.
    fractional = 1.0 + np.geomspace(1e-2, 9.0, 48)
    integers = np.unique(np.round(np.geomspace(2, 8192, 32)))
    orders = np.unique(np.concatenate([fractional, integers]))
    orders.setflags(write=False)
    return orders


#: Orders of the RDP curves behind the window, the tilt, and the RDP bound of ledgers
#: with many distinct pairs.
_WINDOW_ORDERS = _window_orders()


@functools.lru_cache(maxsize=4096)
def _window_rdp(sigma: float, q: float) -> np.ndarray:
    return rdp_subsampled_gaussian(sigma, q, _WINDOW_ORDERS)


def _window(steps: tuple, tail: float, n: int, doublings: int = 64) -> tuple[float, float, float]:
    """(low, high, spacing): the composed loss is below ``low`` or at or above ``high``
    with probability at most ``tail`` each, in either direction; ``spacing`` is a power
    of two with ``high - low <= (n - 2) * spacing``. ``FloatingPointError`` where none
    fits within ``doublings`` doublings of the first spacing tried."""
    rdps = [_window_rdp(sigma, q) for sigma, q, _ in steps]
    counts = [count for _, _, count in steps]
    # The bounds widen slightly with the spacing (the spread factor), so settle the
    # spacing by doubling until the window it implies fits.
    low = _window_low(rdps, counts, tail, 0.0)
    high = _window_high(rdps, counts, tail, 0.0, low)
    room = n - 2 - _snap(n)  # the window's bottom may move down by up to _snap(n) bins
    spacing = 2.0 ** math.ceil(math.log2((high - low) / room))
    for _ in range(doublings):
        low = _window_low(rdps, counts, tail, spacing)
        high = _window_high(rdps, counts, tail, spacing, low)
        if high - low <= room * spacing:
            return low, high, spacing
        spacing *= 2.0
    raise FloatingPointError("no grid spacing fits the window")


def _snap(n: int) -> int:
    """Grid bottoms are multiples of this many bins (a 64th of the window)."""
    return max(1, n // 64)


def _rdp_grid(steps: tuple, tail: float, delta: float, n: int, window: tuple | None = None) -> _Grid:
    """The grid of ``n`` points on the RDP curves' ``window`` (:func:`_window`), its tilt
    capped against what wraps around (:func:`_choose_tilt`).

    Its steps are thinned (:func:`_thinned_points`) as a certified grid's are. The
    window's ``tail`` was certified for the full grid's bins, but the bound the profile
    adds is checked against the distributions composed, thinned or not
    (:func:`_grid_tail`), and what falls below the window only raises delta. At tiny q a
    step's rare losses fill most of such a window (q 4e-5, sigma 0.54: 688,134 of its
    2^20 points, 0.41 s of a 0.54 s composition), and thinned it keeps 309,694."""
    low, high, spacing = window or _window(steps, tail, n)
    # The bottom snaps to a multiple of _snap(n), so that nearby ledgers (one more step,
    # max_steps' candidates) share the grid and with it the cached transforms. Keeping
    # mass up to the window's end instead of ``high`` is sound: the wrap-around bound
    # ``tail`` covers everything at or above ``high`` of the uncut distribution, which
    # dominates the cut one.
    i_low = _snap(n) * math.floor(low / spacing / _snap(n))
    bottoms, tops = _tail_ends(steps, spacing, i_low, i_low + n - 1, tail)
    rdps = [_window_rdp(sigma, q) for sigma, q, _ in steps]
    lam = _WINDOW_ORDERS - 1.0
    spread = _log_spread(-lam, spacing)
    cgf = sum(count * (lam * r + spread) for r, (_, _, count) in zip(rdps, steps))
    order = float(lam[np.argmin(_window_high_exponents(rdps, [c for _, _, c in steps], tail, spacing, low))])
    return _Grid(spacing, i_low, n, tops, tail, _choose_tilt(lam, cgf, n * spacing, delta), bottoms,
                 _rdp_thin(steps, bottoms, tops, delta), window_top=(high, order))


def _rdp_thin(steps: tuple, bottoms: dict, tops: dict, delta: float) -> dict | None:
    """The tilts the thinned steps of :func:`_rdp_grid` serve, per direction (as a mixture's
    anchors', :func:`_anchor_thin`), or None where no step keeps enough points
    (``bottoms`` to ``tops``) for :func:`_thinned_points` to thin."""
    widest = max(top - bottom for direction in tops for bottom, top in zip(bottoms[direction], tops[direction]))
    if widest < 4 * _THIN_PROBE:
        return None
    return {direction: _anchor_thin(steps, direction, delta) for direction in (_REMOVE, _ADD)}


def _tail_ends(steps: tuple, spacing: float, i_low: int, i_top: int, tail: float) -> tuple[dict, dict]:
    r"""Per direction, the lowest and the highest grid index each step keeps.

    Every component of P is :math:`N(m, \sigma^2)` with :math:`0 \le m \le 1` and the
    loss increases with z, so P has mass at most :math:`\bar\Phi(k)` where the loss is
    above its value at :math:`z = 1 + k\sigma`, and as much where it is below its value
    at :math:`z = -k\sigma`. The mass above a step's top goes to :math:`+\infty`, where
    it counts in full in delta, and the mass below its bottom is rounded up to it (a
    loss rounded up never helps, :func:`_step_distribution`). ``k``
    (:func:`_sigmas_out`) is chosen so that either mass, over the whole ledger, is at
    most ``tail / 2`` (each run of ``c`` steps gets ``tail / (2 R c)`` per step, ``R`` the
    runs); the window's top (:func:`_window_high`) allows for the mass rounded up. ``k``
    is rounded up to a half so that a ledger grown by a step keeps its ends (and its
    cached transforms). This drops the bins that only hold mass far below delta: about
    half of a step's support.
    """
    per_run = tail / (2.0 * len(steps))
    bottoms, tops = {}, {}
    for direction in (_REMOVE, _ADD):
        ends = []
        for sigma, q, count in steps:
            k = _sigmas_out(per_run / count)
            low = float(_loss_of_z(-k * sigma, sigma, q, direction))
            high = float(_loss_of_z(1.0 + k * sigma, sigma, q, direction))
            ends.append((max(i_low, math.floor(low / spacing)), min(i_top, math.ceil(high / spacing))))
        bottoms[direction] = tuple(bottom for bottom, _ in ends)
        tops[direction] = tuple(top for _, top in ends)
    return bottoms, tops


def _sigmas_out(budget: float) -> float:
    """The smallest half-integer k <= _GAUSS_TAIL with Phibar(k) <= budget (or _GAUSS_TAIL)."""
    k = float(-ndtri(min(budget, 0.5)))
    return min(_GAUSS_TAIL, math.ceil(2.0 * k) / 2.0) if math.isfinite(k) else _GAUSS_TAIL


def _from_bottom(cgf: np.ndarray, lambdas: np.ndarray, bottom: float) -> np.ndarray:
    """A composed log moment generating function ``cgf`` at ``lambdas`` of the loss less
    its window's ``bottom`` where that is above 0: :func:`_choose_tilt`'s ``wrap`` reads
    a window from 0, and a window far above 0 wraps at its own top (windows from below 0
    are read from 0 as they always were)."""
    return cgf - lambdas * max(bottom, 0.0)


def _choose_tilt(lambdas: np.ndarray, cgf: np.ndarray, width: float, delta: float,
                 wrap: np.ndarray | None = None) -> float:
    """The exponential tilt for the transform, from a bound ``cgf`` on the composed log MGF.

    Ideally the Chernoff-optimal lambda at the level ``delta``, which centres the tilted
    distribution where delta is decided. But tilting also magnifies whatever wraps around
    the circular grid: mass at ``S >= width`` lands on losses ``>= 0`` multiplied by up to
    ``e^{tilt * width}``. That is harmless for soundness (it can only raise delta) but not
    for tightness, so the tilt is capped to keep ``e^{tilt * width} Pr[S >= width]`` below
    ``delta / 1024``. Tilts sit on a quarter-octave grid so nearby ledgers share caches.
    ``wrap`` (default ``cgf``): the same of the loss less its window's bottom, where
    that lies above 0 (:func:`_from_bottom`).
    """
    best = float(lambdas[np.argmin((cgf - math.log(delta)) / lambdas)])
    log_wrap = float(((cgf if wrap is None else wrap) - lambdas * width).min())
    cap = (math.log(delta / 1024.0) - log_wrap) / width
    tilt = min(best, cap)
    if not tilt > 0:
        return 0.0
    return 2.0 ** (math.floor(4.0 * math.log2(tilt)) / 4.0)


def _window_low(rdps, counts, tail, spacing) -> float:
    # Pr[S <= a] <= e^{lambda a} E[e^{-lambda S}]. For lambda = alpha on the order grid,
    # log E_P[e^{-alpha L}] = (alpha - 1) D_alpha(Q || P) <= (alpha - 1) rdp(alpha); for
    # lambda = 1 it is log Q(supp P) <= 0. The grid adds at most the spread factor.
    alpha = _WINDOW_ORDERS
    spread = _log_spread(alpha, spacing)
    log_mgf = sum(c * ((alpha - 1.0) * r + spread) for r, c in zip(rdps, counts))
    candidates = (math.log(tail) - log_mgf) / alpha
    return float(min(max(candidates.max(), math.log(tail)), 0.0))


def _window_high(rdps, counts, tail, spacing, low) -> float:
    # Pr[S >= b] <= e^{-lambda b} E[e^{lambda S}], log E_P[e^{lambda L}] = lambda
    # D_{lambda+1}(P || Q) <= lambda rdp(lambda + 1), times the spread factor, plus the
    # mass pushed up to the lowest grid point: below the window bottom, at most e^{low}
    # (Markov on e^{-L}); below a step's bottom (_tail_ends, or the cut-off of the
    # Gaussian components), at most max(tail / (2 R c), 1e-37) per step, and that mass
    # lands on a loss <= 0.
    return float(max(_window_high_exponents(rdps, counts, tail, spacing, low).min(), low + 1.0))


def _window_high_exponents(rdps, counts, tail, spacing, low) -> np.ndarray:
    """The loss above which :func:`_window_high`'s bound at each order leaves ``tail``."""
    lam = _WINDOW_ORDERS - 1.0
    per_run = tail / (2.0 * len(counts))  # at most what _tail_ends rounds up below a step's bottom
    spread = _log_spread(-lam, spacing)
    log_mgf = 0.0
    for r, c in zip(rdps, counts):
        pushed = np.logaddexp((1.0 + lam) * low, math.log(max(1e-37, per_run / c)))
        log_mgf = log_mgf + c * (lam * r + np.logaddexp(spread, pushed - lam * r))
    return (log_mgf - math.log(tail)) / lam


def _log_spread(gamma: np.ndarray, spacing: float) -> np.ndarray:
    r"""log of max over a bin of chord / function for x -> x^gamma on [1, e^h].

    Within a bin connect-the-dots keeps E[e^{-L}] and moves mass to the end points: for
    a convex function of x = e^{-L} that raises the mean by at most this factor. It is
    0 where x^gamma is concave (0 <= gamma <= 1), and never more than |gamma| h (the
    shift of one bin).
    """
    gamma = np.asarray(gamma, dtype=float)
    h = spacing
    if h == 0.0:
        return np.zeros_like(gamma)
    crude = np.abs(gamma) * h
    result = crude.copy()
    exact = (np.abs(gamma) * h < 30.0) & ((gamma < 0) | (gamma > 1)) & (h < 30.0)
    g = gamma[exact]
    slope = np.expm1(g * h) / math.expm1(min(h, 30.0))  # g is empty unless h < 30
    intercept = 1.0 - slope
    x = np.clip(g * intercept / (slope * (1.0 - g)), 1.0, math.exp(min(h, 30.0)))
    result[exact] = np.minimum(np.log(intercept + slope * x) - g * np.log(x), crude[exact])
    result[(gamma >= 0) & (gamma <= 1)] = 0.0
    return np.maximum(result, 0.0)


#: The narrow window is tried where the RDP window is more than this many times wider
#: than the narrow one's guess. (At 4, sigma 0.632, q 2.8e-6, delta 1.9e-12 kept the RDP
#: window up to 413,594 steps, 3.99 times wider: its tilt, capped against what wraps
#: around, was half the narrow window's, and epsilon fell by 0.85% from there to 425,640
#: steps, where rounding decides the answer.)
_NARROW_RATIO = 2.0


def _narrow_grid(steps: tuple, n: int, rdp_spacing: float, tail: float, delta: float, fine=None):
    """A narrower, finer grid for when the RDP-based window is far too wide.

    The RDP window is loose when rare, large losses dominate the high-order Rényi
    divergences (tiny q, or few steps at large sigma): the composed loss then occupies a
    small part of the window and the grid is too coarse for it. Here each step's loss is
    cut where its upper tail falls below ``tail / (2 * len(steps))`` per step run (that mass
    goes to +inf, exactly accounted); a window is guessed by Chernoff bounds on what is
    left, with moment generating functions by Gauss-Hermite quadrature; and its top is
    *certified* with the exact moment generating function of the grid distributions that
    will be composed: Pr[S >= top] <= min_lambda e^{-lambda top} prod_r M_r(lambda)^{c_r}.
    Returns None to keep the RDP grid (``n`` points of spacing ``rdp_spacing``).

    ``fine`` (a test of a spacing, ``True`` for fine enough, monotone: a coarser spacing
    never passes where a finer one fails) lets :func:`_choose_grid` skip certifying a
    grid it would refine anyway: :data:`_TOO_COARSE` is returned, without certifying
    anything, when the finest candidate spacing fails it. That changes no grid chosen:
    every candidate spacing is at least the first (the window only widens), and the RDP
    grid kept otherwise is coarser still (a candidate must be at most half its spacing),
    so whatever this function would have returned fails ``fine`` too.

    One window holds both directions and 0 (:func:`_narrow_windows`), unless windows of
    their own are far narrower, as where epsilon is large: a direction's composed loss
    is then a narrow body far from 0 (sigma 0.063 at q 0.997 over 5,938 steps beside 56
    other runs: removal's body between 1.55*10^6 and 1.67*10^6, addition's near
    6.2*10^4), and one window holding both and 0 spaced the bins 2 apart on 2^20 points,
    2.8% above the exact epsilon; on removal's own window they are 0.25 apart.
    """
    guess = _narrow_guess(steps, tail)
    if guess is None:
        return None
    edges, floors, cuts, lambdas = guess
    lows, width = _narrow_windows(edges, delta)
    if (n - 2) * rdp_spacing <= _NARROW_RATIO * width:
        return None
    finest = 2.0 ** math.ceil(math.log2(1.25 * width / (n - 2)))  # as below
    if fine is not None and not fine(finest) and not fine(rdp_spacing):
        return _TOO_COARSE
    for widen in (1.25, 2.0, 4.0):
        spacing = 2.0 ** math.ceil(math.log2(widen * width / (n - 2)))
        if spacing > rdp_spacing / 2:
            return None
        windows = {d: (low, low + widen * width) for d, low in lows.items()}
        narrow = _certified_grid(steps, n, spacing, windows, (floors, cuts), lambdas, tail, delta)
        if narrow is not None:
            return narrow
    return None


def _narrow_windows(edges: dict, delta: float) -> tuple[dict, float]:
    """``(lows, width)`` of :func:`_narrow_grid`'s windows from each direction's Chernoff
    ``edges`` ``(low, high)``: one window, from 0 or the lower edge below it, holding
    both; or, where a direction's edge lies more than :func:`_bottom_margin` above 0 and
    windows of their own are at least :data:`_OWN_WINDOWS` times narrower, each from
    that margin below its edge (or from 0), of one width, the wider direction's. Both
    are sound (each window is certified); only tightness and time are at stake. Where
    the bodies lie near 0 anyway, own windows are at most about twice narrower, and
    their tilt, capped against what wraps around, smaller: the rigorous lower bound at
    sigma 0.4464, q 1e-6, 100 steps, delta 1e-5 fell from 9.464e-5 to 9.333e-5 on them;
    and a body only a little narrower than one window (sigma 0.0201, q 1e-6, 10^8
    steps: 253,000 against 289,000) left the tilt a quarter of the shared window's, and
    rounding to decide (1.0 s instead of 0.45 s, for 3e-5 of epsilon)."""
    shared = min(0.0, *(low for low, _ in edges.values()))
    shared_width = max(high for _, high in edges.values()) - shared
    margin = _bottom_margin(delta)
    own = {d: min(low, max(0.0, low - margin)) for d, (low, _) in edges.items()}
    own_width = max(high - own[d] for d, (_, high) in edges.items())
    if max(own.values()) > 0.0 and _OWN_WINDOWS * own_width <= shared_width:
        return own, own_width
    return dict.fromkeys(edges, shared), shared_width


#: :func:`_narrow_windows` gives each direction its own window where that narrows the
#: window at least this many times.
_OWN_WINDOWS = 2.0


def _bottom_margin(delta: float) -> float:
    r"""How far below its direction's lower Chernoff edge ``low`` a narrow window starts
    (:func:`_narrow_grid`). With at most a share ``t`` of the loss below ``low``,
    :math:`\delta(\varepsilon) = \mathbb E (1 - e^{\varepsilon - L})_+ \ge (1 - t)(1 -
    e^{\varepsilon - low})` for :math:`\varepsilon < low`, so epsilon at ``delta`` is at
    least :math:`low + \log(1 - \delta / (1 - t))`: within :math:`-\log(1 - 2\delta)` of
    ``low`` for :math:`t \le 1/2`. A margin of 2 more keeps a few bins below the answer.
    (Only tightness is at stake: an answer below a window's first point reads as that
    point, a sound upper bound.)"""
    return 2.0 - math.log1p(-min(2.0 * delta, 0.5))


@functools.lru_cache(maxsize=16)
def _narrow_guess(steps: tuple, tail: float):
    """``(edges, floors, cuts, lambdas)`` of :func:`_narrow_grid`, whatever the grid
    size (kept between the sizes :func:`_choose_grid` tries), or None where the cut loss
    has no spread. Each step's loss is cut where its upper tail falls below ``tail / (2 *
    len(steps))`` per run and floored where its lower tail does; ``edges[direction]`` is
    ``(low, high)``, Chernoff edges of that direction's composed cut losses, by
    quadrature (a guess, certified later)."""
    z = math.sqrt(2.0 * math.log(1.0 / tail))
    per_run = tail / (2.0 * len(steps))
    cuts = {d: tuple(_loss_cut(sigma, q, d, per_run / count) for sigma, q, count in steps) for d in (_REMOVE, _ADD)}
    floors = {d: tuple(_loss_floor(sigma, q, d, per_run / count) for sigma, q, count in steps)
              for d in (_REMOVE, _ADD)}
    # The lambdas scale with each direction's spread; a direction whose loss has none at
    # the quadrature's nodes (adding, at tiny sigma and q: a constant near q with a rare
    # lower tail) sets no scale, its Chernoff edges hold at any lambda. Where the two
    # spreads differ by more than 4 times (tiny sigma over many steps), both ranges are
    # kept: the wider direction's edges need its own, smaller lambdas. Each scale is rounded
    # down to a quarter octave (any lambdas give sound certificates): a ledger grown by a
    # step then asks the same lambdas, and its certificates' moment generating functions
    # and the tilt chosen among them are found again (:func:`_step_log_mgf`, the transforms).
    spreads = [math.sqrt(sum(count * _loss_moments(sigma, q, direction, cut)[1]
                             for (sigma, q, count), cut in zip(steps, cuts[direction])))
               for direction in (_REMOVE, _ADD)]
    scales = sorted(spread for spread in spreads if spread > 0)
    if not scales:
        return None
    if scales[-1] > 4.0 * scales[0]:
        scales = [scales[0], scales[-1]]
    ranges = [np.geomspace(1e-3, 4.0, 28) * _quarter_octave(z / scale) for scale in scales[:2]]
    # A rare large loss (tiny q: the example's step, far out) can decide the edges where the
    # body's spread is tiny: lambdas near log(1/tail) / extent, the extent a step's largest
    # loss in size, bound what it adds.
    extent = max(max(abs(c), abs(f)) for d in (_REMOVE, _ADD) for c, f in zip(cuts[d], floors[d]))
    if 0 < extent < math.inf:
        ranges.append(np.geomspace(1.0 / 64.0, 2.0, 8) * _quarter_octave(z * z / 2.0 / extent))
    lambdas = np.unique(np.concatenate(ranges))
    lambdas.setflags(write=False)
    edges = {}
    for direction in (_REMOVE, _ADD):
        cgf_up = cgf_down = 0.0
        for (sigma, q, count), cut, floor in zip(steps, cuts[direction], floors[direction]):
            cgf_up = cgf_up + count * _loss_log_mgf(sigma, q, direction, floor, cut, lambdas)
            cgf_down = cgf_down + count * _loss_log_mgf(sigma, q, direction, floor, cut, -lambdas)
        edges[direction] = (float(((math.log(tail) - cgf_down) / lambdas).max()),
                            float(((cgf_up - math.log(tail)) / lambdas).min()))
    return edges, floors, cuts, lambdas


def _quarter_octave(x: float) -> float:
    """``x`` rounded down to a power of 2^(1/4)."""
    return 2.0 ** (math.floor(4.0 * math.log2(x)) / 4.0)


def _certified_grid(steps, n, spacing, windows, ends, lambdas, tail, delta):
    """The grid of :func:`_narrow_grid` for each direction's window ``windows[direction] =
    (low, top_guess)``, or None where the exact moment generating functions of the grid
    distributions do not certify it: in each direction at most ``tail`` composed mass at
    or beyond its window's top, and what wraps from below its bottom negligible after
    undoing the tilt.

    ``ends`` holds per direction each step's floor and cut losses: its mass below the
    floor is rounded up to the floor's grid point (a loss rounded up never helps), its
    mass above the cut goes to +inf. The certificates are computed from exactly the
    distributions that will be composed, so they hold whatever the floors. A floor below
    the window's bottom is kept: the composition is circular, and what the composed loss
    puts below the bottom is what the second certificate bounds. (Rounding it up to the
    bottom instead cost ``T log(1/(1-q))`` where the window starts at loss 0 above a
    removal floor of ``log(1-q)``: 470, or 0.27%, at sigma 0.0407, q 1e-4, 4.7e6 steps.)
    """
    floors, cuts = ends
    lows = {d: _snap(n) * math.floor(windows[d][0] / spacing / _snap(n)) for d in cuts}  # certified below
    i_tops = {d: min(math.floor(windows[d][1] / spacing), lows[d] + n - 1) for d in cuts}
    tops = {d: tuple(min(i_tops[d], math.ceil(c / spacing)) for c in cuts[d]) for d in cuts}
    bottoms = {d: tuple(min(max(top - n + 2, math.floor(f / spacing)), top) for f, top in zip(floors[d], tops[d]))
               for d in floors}
    thin = {d: _thin_tilt(steps, d, lambdas, delta, floors[d], cuts[d]) for d in cuts}

    def composed_log_mgfs(direction):  # each direction's distributions, computed side by side
        cgf_up = cgf_down = 0.0
        for step, ends in zip(steps, zip(bottoms[direction], tops[direction])):
            cgf_up = cgf_up + step[2] * _step_log_mgf(step, direction, spacing, ends, thin[direction], lambdas)
            cgf_down = cgf_down + step[2] * _step_log_mgf(step, direction, spacing, ends, thin[direction], -lambdas)
        return cgf_up, cgf_down

    log_up = log_down = -math.inf
    cgf_max = wrap_max = np.full(lambdas.shape, -np.inf)
    for direction, (cgf_up, cgf_down) in _both_directions(composed_log_mgfs).items():
        beyond = (lows[direction] + n) * spacing  # composed indices from here on would wrap
        log_up = max(log_up, float((cgf_up - lambdas * beyond).min()))
        log_down = max(log_down, float((cgf_down + lambdas * windows[direction][0]).min()))
        cgf_max = np.maximum(cgf_max, cgf_up)
        wrap_max = np.maximum(wrap_max, _from_bottom(cgf_up, lambdas, lows[direction] * spacing))
    # Mass below the window wraps to its top, where undoing the tilt shrinks it by
    # e^{-tilt * width}: it can only raise delta, and here by a negligible amount.
    tilt = _choose_tilt(lambdas, cgf_max, n * spacing, delta, wrap_max)
    if log_up <= math.log(tail) and log_down - tilt * n * spacing <= math.log(16.0 * tail):
        own = None if len(set(lows.values())) == 1 else lows
        return _Grid(spacing, min(lows.values()), n, tops, math.exp(log_up), tilt, bottoms, thin, lows=own)
    return None


def _thin_tilt(steps: tuple, direction: str, lambdas: np.ndarray, delta: float, floors: tuple | None = None,
               cuts: tuple | None = None) -> float:
    """The tilt :func:`_thinned_points` serves for ``direction``: twice its Chernoff-optimal
    lambda at ``delta`` (from moment generating functions by quadrature, of the losses
    between ``floors`` and ``cuts`` where given; the tilts the transforms use are at most
    about that), rounded up to a power of two."""
    floors = floors or (-math.inf,) * len(steps)
    cuts = cuts or (math.inf,) * len(steps)
    cgf = sum(count * _loss_log_mgf(sigma, q, direction, floor, cut, lambdas)
              for (sigma, q, count), floor, cut in zip(steps, floors, cuts))
    best = float(lambdas[np.argmin((cgf - math.log(delta)) / lambdas)])
    return 2.0 ** math.ceil(math.log2(2.0 * best))


def _loss_of_z(z, sigma: float, q: float, direction: str):
    """The privacy loss as a function of z (for add, in the reflected coordinate)."""
    log_r = (2.0 * np.asarray(z, dtype=float) - 1.0) / (2.0 * sigma * sigma)
    log_1mq = math.log1p(-q) if q < 1 else -math.inf
    if direction == _REMOVE:
        return np.logaddexp(log_1mq, math.log(q) + log_r)
    return -np.logaddexp(log_1mq, math.log(q) - log_r)


def _loss_cut(sigma: float, q: float, direction: str, budget: float) -> float:
    """A loss c with Pr_P[L > c] <= budget.

    The loss is increasing in z, and P is a mixture of N(m, sigma^2) components
    (:func:`_components`), so Pr_P[L > c] is the mixture's tail beyond the z where the
    loss is c (:func:`_mixture_z`). At tiny q the component at m = 1 weighs only q, and
    the cut sits several standard deviations lower than it would for that component
    alone; the window of :func:`_narrow_grid` narrows with it.
    """
    return float(_loss_of_z(_mixture_z(sigma, q, direction, budget, upper=True), sigma, q, direction))


def _loss_floor(sigma: float, q: float, direction: str, budget: float) -> float:
    """A loss f with Pr_P[L < f] <= budget (see :func:`_loss_cut`)."""
    return float(_loss_of_z(_mixture_z(sigma, q, direction, budget, upper=False), sigma, q, direction))


def _components(q: float, direction: str) -> tuple[tuple[float, float], ...]:
    """``(weight, mean)`` of the Gaussian components N(mean, sigma^2) of P (for add, in
    the reflected coordinate)."""
    return ((1.0 - q, 0.0), (q, 1.0)) if direction == _REMOVE else ((1.0, 1.0),)


def _mixture_z(sigma: float, q: float, direction: str, budget: float, upper: bool) -> float:
    """A z whose tail under P (above z if ``upper``, else below) is at most ``budget``.

    Every component's tail is at most the mixture's budget where each component alone
    is within it (the weights sum to 1): that z is feasible and starts a bisection toward
    the tightest one, which keeps only z whose mixture tail, from ``log_ndtr`` and
    summed with 1e-9 to spare, is within the budget.
    """
    budget = min(budget, 0.5)
    parts = _components(q, direction)
    reach = sigma * float(-ndtri(budget))
    sign = 1.0 if upper else -1.0
    means = [mean for _, mean in parts]
    feasible = (max(means) + reach) if upper else (min(means) - reach)  # each component within budget
    loose = (min(means) + reach) if upper else (max(means) - reach)  # the heaviest alone: not beyond

    def within(z: float) -> bool:
        tail = sum(weight * math.exp(log_ndtr(sign * (mean - z) / sigma)) for weight, mean in parts if weight > 0)
        return tail * (1.0 + 1e-9) <= budget

    return _bisected(within, feasible, loose, 60)


def _bisected(holds, inside: float, outside: float, rounds: int, relative: float = 0.0) -> float:
    """The last point found where ``holds`` is true, bisecting from ``inside`` (where it
    holds) towards ``outside`` (where it does not) for ``rounds`` halvings at most, or
    until the two are within ``relative`` of ``outside`` or adjacent floats."""
    for _ in range(rounds):
        if abs(outside - inside) <= relative * abs(outside):
            break
        middle = 0.5 * (inside + outside)
        if middle in (inside, outside):
            break
        if holds(middle):
            inside = middle
        else:
            outside = middle
    return inside


def _bisected_many(holds_at, inside: float, outside: float, rounds: int, depth: int = 6) -> float:
    """:func:`_bisected` (``relative`` 0) where ``holds_at`` answers for an array of points
    in one call: the midpoints of the next ``depth`` halvings, every way they can go, are
    asked together (each the very float the halvings compute), then walked as
    :func:`_bisected` would. Where one call costs about as much as a single point, that
    is ``depth`` times fewer calls for the same answer."""
    while rounds > 0:
        levels = min(depth, rounds)
        # node i: an interval; its children 2i + 1 (where its midpoint holds) and 2i + 2
        nodes = [(inside, outside)]
        for i in range((1 << (levels - 1)) - 1):
            low, high = nodes[i]
            middle = 0.5 * (low + high)
            nodes += [(middle, high), (low, middle)]
        middles = [0.5 * (low + high) for low, high in nodes]
        answers = holds_at(np.array(middles))
        i = 0
        for _ in range(levels):
            if middles[i] in (inside, outside):
                return inside
            if answers[i]:
                inside, i = middles[i], 2 * i + 1
            else:
                outside, i = middles[i], 2 * i + 2
        rounds -= levels
    return inside


_HERMITE_X, _HERMITE_W = np.polynomial.hermite_e.hermegauss(96)
_HERMITE_W = _HERMITE_W / math.sqrt(2.0 * math.pi)


@functools.lru_cache(maxsize=4096)
def _loss_moments(sigma: float, q: float, direction: str, cut: float) -> tuple[float, float]:
    """Mean and variance of the loss below ``cut`` (Gauss-Hermite; only used as a guide;
    cached: the grid's tests ask for each step's at every size they try)."""
    first = second = 0.0
    for weight, mean in _components(q, direction):
        losses = _loss_of_z(mean + sigma * _HERMITE_X, sigma, q, direction)
        kept = np.where(losses <= cut, losses, 0.0)
        first += weight * float(_HERMITE_W @ kept)
        second += weight * float(_HERMITE_W @ kept**2)
    return first, max(second - first * first, 0.0)


@functools.lru_cache(maxsize=4096)
def _mean_absolute_loss(sigma: float, q: float, direction: str, floor: float = -math.inf,
                        cut: float = math.inf) -> float:
    """E_P[|L|; floor <= L <= cut] by Gauss-Hermite quadrature (a guide for grids only:
    :func:`_thinned_points`, the split's bulk spacing)."""
    total = 0.0
    for weight, mean in _components(q, direction):
        losses = _loss_of_z(mean + sigma * _HERMITE_X, sigma, q, direction)
        kept = (losses >= floor) & (losses <= cut)
        total += weight * float(_HERMITE_W @ np.where(kept, np.abs(losses), 0.0))
    return total


def _loss_log_mgf(sigma, q, direction, floor: float, cut: float, lambdas: np.ndarray) -> np.ndarray:
    """log E_P[e^{lambda max(L, floor)}; L <= cut] for each lambda (Gauss-Hermite; a guide)."""
    log_terms = []
    for weight, mean in _components(q, direction):
        if weight > 0:
            losses = np.maximum(_loss_of_z(mean + sigma * _HERMITE_X, sigma, q, direction), floor)
            with np.errstate(divide="ignore"):
                log_w = np.log(weight * _HERMITE_W) + np.where(losses <= cut, 0.0, -np.inf)
            log_terms.append(lambdas[:, None] * losses[None, :] + log_w[None, :])
    stacked = np.concatenate(log_terms, axis=1)
    peak = stacked.max(axis=1, keepdims=True)
    return peak[:, 0] + np.log(np.exp(stacked - peak).sum(axis=1))


def _log_mgf(first: int, masses: np.ndarray, spacing: float, lambdas: np.ndarray) -> np.ndarray:
    r"""An upper bound on :math:`\log \sum_k m_k e^{\lambda l_k}` over the finite part, for
    each lambda (it certifies windows: :func:`_certified_grid`, :func:`_below_window`).

    The support is cut into blocks of :data:`_MGF_BLOCK` bins; within a block the sum is
    a product of the masses (scaled by the block's largest) with
    :math:`e^{\lambda h (j - c)}` (``c`` the block's centre), one matrix product for all
    blocks and lambdas, and the blocks are added in log space. Each block sum is a sum of
    positive terms, accurate to a relative ``_MGF_BLOCK`` unit round-offs, and the log-sum
    of the blocks to a few round-offs of its size: the result is raised by
    ``1e-12 (1 + |result|)`` to cover both. Lambdas whose factors could overflow
    (:math:`|\lambda| h c > 600`) are summed entry by entry in log space instead.
    """
    lambdas = np.asarray(lambdas, dtype=float)
    support = np.flatnonzero(masses > 0)
    if support.size == 0:
        return np.full(lambdas.shape, -np.inf)
    start = int(support[0])
    kept = masses[start:int(support[-1]) + 1]
    blocks = -(-kept.size // _MGF_BLOCK)
    padded = np.zeros(blocks * _MGF_BLOCK)
    padded[: kept.size] = kept
    padded = padded.reshape(blocks, _MGF_BLOCK)
    largest = padded.max(axis=1)
    rows = np.flatnonzero(largest > 0)
    centre = (_MGF_BLOCK - 1) / 2.0
    out = np.empty(lambdas.shape)
    blocked = np.abs(lambdas) * spacing * centre <= 600.0
    if blocked.any():
        rates = lambdas[blocked] * spacing
        factors = np.exp(np.outer(np.arange(_MGF_BLOCK) - centre, rates))
        sums = np.einsum("bi,il->bl", padded[rows] / largest[rows, None], factors)
        centres = first + start + rows * _MGF_BLOCK + centre
        with np.errstate(divide="ignore"):
            terms = np.log(sums) + np.log(largest[rows])[:, None] + np.outer(centres, rates)
        peak = terms.max(axis=0)
        out[blocked] = peak + np.log(np.exp(terms - peak).sum(axis=0))
    if not blocked.all():
        out[~blocked] = _steep_log_mgf(first + support, np.log(masses[support]), spacing, lambdas[~blocked])
    return out + 1e-12 * (1.0 + np.abs(out))


def _steep_log_mgf(indices: np.ndarray, log_masses: np.ndarray, spacing: float, lambdas: np.ndarray) -> np.ndarray:
    r""":math:`\log \sum_k m_k e^{\lambda l_k}` entry by entry in log space, for lambdas so
    steep that the support's far end decides it (:func:`_log_mgf`; ``indices`` increasing).

    Every term is at most :math:`\lambda l_k + \max \log m`, and the sum's largest term is
    at least the end term's (the last one for lambda > 0, the first below 0), so a term
    whose bound lies :data:`_UNDERFLOW` below that is exactly 0 in float64 once divided
    by the largest: only the entries near the end are summed, a few hundred bins at such
    rates instead of the whole support."""
    out = np.empty(lambdas.shape)
    top = float(log_masses.max())
    for k, rate in enumerate(lambdas):
        end = -1 if rate > 0.0 else 0
        floor = rate * indices[end] * spacing + log_masses[end] - _UNDERFLOW - top  # terms' bound below it: 0
        reach = floor / (rate * spacing)  # index past which (up, or down below 0) no term is 0
        kept = (slice(int(np.searchsorted(indices, math.floor(reach))), None) if rate > 0.0
                else slice(None, int(np.searchsorted(indices, math.ceil(reach), side="right"))))
        exponent = rate * indices[kept] * spacing + log_masses[kept]
        peak = exponent.max()
        out[k] = peak + math.log(np.exp(exponent - peak).sum())
    return out


#: exp of anything this far below 1 is exactly 0 in float64 (subnormals end near e^-745).
_UNDERFLOW = 800.0


def _step_log_mgf(step: tuple, direction: str, spacing: float, ends: tuple, thin: float | None,
                  lambdas: np.ndarray, distribution=None) -> np.ndarray:
    """:func:`_log_mgf` of the grid distribution of one step ``(sigma, q)`` on ``ends`` (its
    lowest and highest grid index; :func:`_step_distribution`, or ``distribution()`` where
    given, which returns the same), kept between calls.

    The windows' certificates (:func:`_certified_grid`) and the mixture groups' tail bound
    (:func:`_mixture_tail`) sum every point of every step's or anchor's distribution once
    per lambda: after a ledger grows by a step they ask the same distributions again (at
    q 1e-5 to 1e-4 most of a call for 100 to 10^4 pairs). The key is what determines the
    distribution (the pair, direction, spacing, support and thinning: see :func:`_support`)
    and the lambdas, so a hit returns the very floats a miss computes."""
    sigma, q = step[:2]
    thin = None if thin is None else float(thin)
    key = (sigma, q, direction, spacing, *_support(sigma, q, direction, spacing, *ends), thin, lambdas.tobytes())
    with _prefix_lock:
        found = _mgf_cache.pop(key, None)
    if found is None:
        first, masses, _ = (distribution or functools.partial(_step_distribution, sigma, q, direction, spacing,
                                                              *ends, thin=thin))()
        found = _log_mgf(first, masses, spacing, lambdas)
        found.setflags(write=False)
    return _kept(_mgf_cache, key, found, _MGF_CACHE_ENTRIES)


def _kept(cache: dict, key, value, limit: int):
    """``value``, stored under ``key`` as ``cache``'s most recently used entry (a dict in
    least recently used order), the oldest dropped beyond ``limit`` entries."""
    with _prefix_lock:
        cache[key] = value
        while len(cache) > limit:
            cache.pop(next(iter(cache)))
    return value


#: Log moment generating functions :func:`_step_log_mgf` keeps (a few hundred floats each),
#: the least recently used first.
_MGF_CACHE_ENTRIES = 4096
_mgf_cache: dict = {}


#: Bins per block of :func:`_log_mgf`.
_MGF_BLOCK = 128


# --- one step on the grid --------------------------------------------------------------


def _per_step(function, values):
    """``function`` (a float's, from :mod:`math`) of ``values``: a float, or an array
    holding one value per point, constant over each step's points where several steps'
    points lie side by side (:func:`_dots_of_steps`). Computed once per step, so that each
    point gets the bits it gets with its step alone: numpy's logarithms and math's
    differ in the last bit now and then."""
    if np.ndim(values) == 0:
        return function(values)
    starts = np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))
    return np.repeat(np.array([function(float(values[start])) for start in starts], dtype=np.float64),
                     np.diff(np.append(starts, values.size)))


def _log_rest(q: float) -> float:
    """log(1 - q), -inf at q = 1."""
    return math.log1p(-q) if q < 1 else -math.inf


def _log_rates(q) -> tuple:
    """``(log q, log(1 - q))`` of a rate or of one per point (:func:`_per_step`)."""
    return _per_step(math.log, q), _per_step(_log_rest, q)


def _of_bins(values):
    """Per-edge ``values`` (a float, or one per edge) at the bins between consecutive
    edges: a bin takes its lower edge's (a float stays)."""
    return values if np.ndim(values) == 0 else values[:-1]


def _log_r(losses: np.ndarray, q: float, direction: str) -> np.ndarray:
    """log r(z) at which the loss equals each grid value (the loss is increasing in z); ``q``
    a float, or one rate per loss (:func:`_per_step`)."""
    log_q, log_1mq = _log_rates(q)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        if direction == _REMOVE:
            # log(1 - q + q r) = l  <=>  r = e^l (1 - (1 - q) e^{-l}) / q; no z below log(1 - q).
            # (log1p keeps the loss of the edge within a few round-offs of l, even where
            # 1 - (1 - q) e^{-l} is tiny: see :func:`_edge_errors`.)
            out = losses + np.log1p(-np.exp(log_1mq - losses)) - log_q
            return np.where(np.isnan(out), -np.inf, out)
        # add, in the reflected coordinate z -> 1 - z, where P = N(1, s^2) and
        # Q = q N(0, s^2) + (1 - q) N(1, s^2): log(r / ((1 - q) r + q)) = l.
        out = log_q + losses - np.log(-np.expm1(losses + log_1mq))
        return np.where(np.isnan(out), np.inf, out)


def _split_log_masses(sigma: float, q: float, direction: str, losses: np.ndarray, bounded: bool = True,
                      owners: np.ndarray | None = None) -> tuple:
    """``(at_or_below, above)``: bounds above on the log P-masses of one step's loss at or
    below, and above, each of ``losses`` (any order), all at once: the edges ``-inf, z_k,
    +inf`` of every loss side by side, each side bounded as :func:`_bin_bounds` bounds a
    bin, plus the mass between the cut and where the loss is exactly ``losses[k]`` (the
    bins from one loss's +inf to the next one's -inf are dropped). ``bounded=False``:
    the rounded masses as they come, a third of the work, to search with. ``sigma`` and
    ``q`` may also be one per loss, with ``owners``, the step each loss is of
    (:func:`_split_log_masses_of_steps`)."""
    log_r = _log_r(losses, q, direction)
    z = sigma * sigma * log_r + 0.5
    ends = np.full(z.shape, np.inf)
    edges = np.stack([-ends, z, ends], axis=1).ravel()
    sigma_e, q_e = (sigma, q) if np.ndim(sigma) == 0 else (np.repeat(sigma, 3), np.repeat(q, 3))
    if not bounded:
        log_p = _edge_log_masses(sigma_e, q_e, direction, edges)[2]
        return log_p[0::3], log_p[1::3]
    steps = None if owners is None else np.repeat(owners, 3)[:-1]
    log_p, _, x0, x1, shift = _edge_bounds(sigma_e, q_e, direction, edges, steps)
    _, log_excess = _cut_errors(sigma, q, direction, losses, log_r, z, x0[1::3], x1[1::3], shift[1::3])
    with np.errstate(invalid="ignore"):
        return np.logaddexp(log_p[0::3], log_excess), np.logaddexp(log_p[1::3], log_excess)


def _split_log_masses_of_steps(steps: list, direction: str, losses: np.ndarray, bounded: bool = True) -> tuple:
    """:func:`_split_log_masses` of each of ``steps`` (``(sigma, q)`` each) at the same
    ``losses``, in one pass: ``(at_or_below, above)``, a row per step, the same values as
    one step at a time."""
    count = len(steps)
    sigma = np.repeat(np.array([float(sigma) for sigma, _ in steps]), losses.size)
    q = np.repeat(np.array([float(q) for _, q in steps]), losses.size)
    owners = np.repeat(np.arange(count), losses.size)
    sides = _split_log_masses(sigma, q, direction, np.tile(losses, count), bounded, owners)
    return tuple(side.reshape(count, losses.size) for side in sides)


def _log_gauss_bins(x: np.ndarray, tail: np.ndarray | None = None) -> np.ndarray:
    """log N(0,1)-mass of each bin (x[k], x[k+1]] for increasing edges x (may hold +-inf),
    from ``tail``, the log of the smaller tail beyond each edge (computed if not given)."""
    if tail is None:
        tail = log_ndtr(-np.abs(x))
    ta, tb = tail[:-1], tail[1:]
    # A bin on the right of 0 is Phibar(a) - Phibar(b), on the left Phi(b) - Phi(a): in
    # both cases the larger tail minus the smaller, computed without cancellation. The
    # edges increase, so the larger tail is the one nearer 0: max(ta, tb).
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.log(-np.expm1(-np.abs(tb - ta)))
        out += np.maximum(ta, tb)
    across = np.flatnonzero((x[:-1] < 0) & (x[1:] > 0))  # the bin holding 0, if any
    out[across] = np.log1p(-(np.exp(ta[across]) + np.exp(tb[across])))
    out[np.isnan(out)] = -np.inf
    return out


def _support(sigma: float, q: float, direction: str, spacing: float, i_low: int, i_high: int) -> tuple[int, int]:
    """The grid points ``lo..hi`` a step's distribution occupies in the window ``i_low..i_high``.

    The distribution depends on the window only through them: two windows holding the
    same support give the same distribution (and, placed at index mod n, the same
    transform), which lets grids that differ only in their edges share cached transforms.
    """
    z_min, z_max = -_GAUSS_TAIL * sigma, 1.0 + _GAUSS_TAIL * sigma
    lo = max(i_low, math.floor(float(_loss_of_z(z_min, sigma, q, direction)) / spacing))
    hi = min(i_high, max(lo + 1, math.ceil(float(_loss_of_z(z_max, sigma, q, direction)) / spacing)))
    return lo, hi


def _step_distribution(sigma: float, q: float, direction: str, spacing: float, i_low: int, i_high: int,
                       optimistic: bool = False, thin: float | None = None):
    """:func:`_grid_distribution`, cached under one key whichever way it is called (the
    windows certified in :func:`_certified_grid` are then not computed again to compose)."""
    return _grid_distribution(sigma, q, direction, spacing, i_low, i_high, bool(optimistic),
                              None if optimistic or thin is None else float(thin))


def _byte_bounded(entries: int, limit: int):
    """A least-recently-used cache of a function's results by its positional arguments,
    dropping the oldest only while it holds more than ``entries`` results and more than
    ``limit`` bytes of their arrays; ``cache_clear()`` empties it. (Never fewer results
    than ``entries``; many more where they are small.)"""
    def decorate(function):
        found, sizes, total, lock = {}, {}, [0], threading.Lock()

        @functools.wraps(function)
        def cached(*args):
            with lock:
                if args in found:
                    found[args] = found.pop(args)  # now the most recently used
                    return found[args]
            value = function(*args)
            with lock:
                total[0] -= sizes.pop(args, 0)  # (another thread may have stored it meanwhile)
                found.pop(args, None)
                found[args], sizes[args] = value, sum(item.nbytes for item in value if isinstance(item, np.ndarray))
                total[0] += sizes[args]
                while len(found) > entries and total[0] > limit:
                    oldest = next(iter(found))
                    del found[oldest]
                    total[0] -= sizes.pop(oldest)
            return value

        def cache_clear() -> None:
            with lock:
                found.clear()
                sizes.clear()
                total[0] = 0

        cached.cache_clear = cache_clear
        return cached
    return decorate


#: Steps' grid distributions kept (:func:`_grid_distribution`): a mixture's 64 anchors
#: per direction are asked for again by the extended-precision pass, which 32 entries did
#: not hold (a third of the distributions computed twice).
_DISTRIBUTION_ENTRIES = 32
_DISTRIBUTION_BYTES = 128 * 2**20


@_byte_bounded(_DISTRIBUTION_ENTRIES, _DISTRIBUTION_BYTES)
def _grid_distribution(sigma: float, q: float, direction: str, spacing: float, i_low: int, i_high: int,
                       optimistic: bool, thin: float | None = None):
    r"""Connect-the-dots loss distribution of one step on grid points i_low..i_high.

    Returns ``(first, masses, p_inf)``: ``masses[k]`` is the P-mass at loss
    ``(first + k) * spacing`` and ``p_inf`` the mass at ``+inf``.

    ``thin``: the tilt whose tilted distribution the points skipped in the tails may
    spread by little (:func:`_thinned_points`; None: every point is kept).

    ``optimistic=True`` builds a *dominated* distribution instead, used only for lower
    bounds: the same bins, merged by :func:`_dominated_masses` onto the grid shifted by
    :func:`_dominated_offset` (``masses[k]`` is at ``(first + k) * spacing + offset``).
    """
    # Keep to where the Gaussian components have mass; outside, bins are empty.
    lo, hi = _support(sigma, q, direction, spacing, i_low, i_high)
    points = np.arange(lo, hi + 1) if thin is None else _thinned_points(sigma, q, direction, spacing, lo, hi, thin)
    losses = points * spacing
    if optimistic:
        edges, log_n0, log_n1, log_p, log_qq = _bin_log_masses(sigma, q, direction, losses)
        errors = _bin_errors(sigma, q, direction, edges, log_n0, log_n1, log_p, log_qq)
        offset = _dominated_offset(sigma, q, direction, spacing)
        masses = _dominated_masses(np.exp(log_p), log_qq, errors, lo, spacing, offset)
        masses.setflags(write=False)
        return lo, masses, 0.0
    kept, p_inf = _dots(sigma, q, direction, losses)
    masses = np.zeros(hi - lo + 1)
    masses[points - lo] = kept
    masses.setflags(write=False)
    return lo, masses, p_inf


#: Where a step's support spans more than four probes of this many grid points, its
#: connect-the-dots distribution may skip points where little of its mass lies
#: (:func:`_thinned_points`).
_THIN_PROBE = 512

#: The points skipped may spread a step's loss by at most this share of what its bins
#: on the full grid spread it by.
_THIN_SHARE = 2.0**-6

#: :func:`_thinned_points` weighs the mass untilted and at this many tilts, halving down
#: from the one it serves.
_THIN_TILTS = 10

#: No bin of a thinned distribution is wider than this over the tilt it serves.
_THIN_KINK = 2.0**-5


def _thinned_points(sigma: float, q: float, direction: str, spacing: float, lo: int, hi: int,
                    tilt: float) -> np.ndarray:
    r"""The grid points (indices from ``lo`` to ``hi``, both kept) on which a step's
    connect-the-dots distribution is built: every point where its mass lies, every
    ``2^j``-th where little does.

    **Sound at any points.** Connect-the-dots on *any* increasing points dominates the
    step (each bin between two points keeps its P- and Q-mass, split between them: a
    mean-preserving spread of :math:`e^{-L}`, Doroshenko et al. 2022); on fewer points
    it is the full grid's distribution spread once more. Which points are kept is a
    matter of tightness only, and the grids that thin bound their windows' tails from the
    thinned distributions themselves (:func:`_certified_grid`, :func:`_grid_tail`).

    **Tight by a budget.** A bin of width ``H`` holding mass ``m`` spreads the loss by
    a variance of at most :math:`m H^2 / 4`; on the full grid a step spreads it by
    about :math:`h \min(\mathbb E_P|L|, h / 4)` (a loss far smaller than a bin becomes
    a whole bin with chance :math:`|L|/h`, a wide one costs a quarter bin squared). The
    support is cut into probes of :data:`_THIN_PROBE` points, and each keeps the widest
    power-of-two spacing whose bins spread the loss by at most an equal share of
    :data:`_THIN_SHARE` of that, at the probe's largest share of the mass untilted and
    at ``tilt`` and its halves down to 2^-9 of it (``tilt`` is twice the Chernoff
    tilt where delta is decided: a heavy tail that decides epsilon keeps its points).
    That bounds a spread where the composed loss is smooth on a bin's scale. Where one
    rare large loss decides epsilon, the composed loss near epsilon is that step's tail,
    falling as :math:`e^{-\theta l}` at the tilt :math:`\theta`, and a bin of width
    ``H`` across epsilon raises delta by about :math:`(\theta H)^2 / 8` of itself: no
    bin is wider than :data:`_THIN_KINK` over ``tilt`` (0.08% on a schedule at q 3e-4
    without that cap). At small q, whose rare large losses stretch the window while the
    bins are sized for the body, the tails keep one point in 32 to 512 and a step one
    in four to eight (q 1e-3 to 1e-5), whose distribution costs as many fewer
    evaluations of the Gaussian tails."""
    if hi - lo < 4 * _THIN_PROBE:
        return np.arange(lo, hi + 1)
    probes = np.append(np.arange(lo, hi, _THIN_PROBE), hi)
    log_masses = _bin_log_masses(sigma, q, direction, probes * spacing)[3][1:-1]
    tilts = np.concatenate([[0.0], tilt * 2.0 ** -np.arange(_THIN_TILTS)])
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        weighted = log_masses + np.outer(tilts, probes[1:] * spacing)  # (each probe at its top, the heavier end)
        share = np.exp((weighted - np.logaddexp.reduce(weighted, axis=1)[:, None]).max(axis=0))
        budget = _THIN_SHARE * spacing * min(_mean_absolute_loss(sigma, q, direction), spacing / 4.0) / share.size
        widest = np.nan_to_num(2.0 * np.sqrt(budget / share) / spacing, nan=1.0, posinf=_THIN_PROBE)
    widest = np.minimum(widest, _THIN_KINK / (tilt * spacing))
    strides = np.exp2(np.floor(np.log2(np.clip(widest, 1.0, _THIN_PROBE)))).astype(np.int64)
    counts = -(-np.diff(probes) // strides)
    before = np.cumsum(counts) - counts  # points kept in the probes before each
    offsets = np.arange(int(counts.sum())) - np.repeat(before, counts)
    return np.append(np.repeat(probes[:-1], counts) + offsets * np.repeat(strides, counts), hi)


def _connect_the_dots(log_p_high: np.ndarray, log_q_low: np.ndarray, rho: np.ndarray, log_excess: np.ndarray,
                      points: np.ndarray, closed: bool = False) -> tuple:
    r"""``(masses, p_inf)``: the P-mass at each of the increasing grid ``points`` (any gaps)
    and at +inf, from :func:`_bin_bounds` of the bins the points cut (the first below the
    grid, the last above it): bounds on their log P-mass (above) and log Q-mass (below),
    ``rho[j]`` on how far the loss at the cut for point ``j`` lies from it, and
    ``log_excess[j]`` on the log of the P-mass next below that cut whose loss may pass it.

    **The rule** (Doroshenko et al. 2022): each interior bin keeps its P- and Q-mass,
    split between its two end points (a mean-preserving spread of :math:`e^{-L}`); the
    bin below the grid is rounded up to its lowest point; the bin above keeps its Q-mass
    at the top point and sends the rest to +inf.

    **Sound whatever the rounding.** Take out of each bin the mass above its upper
    point's loss (at most the excess at that cut, all at a loss below the next point):
    what is left has its loss in :math:`[l_k - \rho_k, l_{k+1}]`, a post-processing of
    its two-point split at those ends, whose lower end rounds up to :math:`l_k`. The
    upper end's share falls as the Q-to-P ratio rises, and taking mass of the highest
    loss out raises it; so the whole bin's ratio, bounded below, lowered by the
    round-offs of the exponent (8u of its terms' sizes) and by :math:`\rho_k` for the
    wider split, bounds that share above once raised by 8u. The excess then moves from
    each point to the next (from the top point, or where the loss error is as wide as
    the gap above, to +inf; the bin's upper share there holds at least it), and the
    bottom bin's likewise. Masses are the P-bounds, raised
    by 8u against the products and sums after. What results is reached from the exact
    split by adding mass and moving mass to higher losses, and neither lowers a privacy
    profile, composed or not. The top bin keeps at most its ratio's bound, lowered the
    same way, and sends at least the rest to +inf. A bin whose P-bound is below
    :math:`e^{-690}` (its mass may underflow to 0) counts that much at +inf. ``closed``
    (the caller drops p_inf, another call holding what lies above the top point): raises
    :class:`DroppedMass` where any mass from below the top bin would go to +inf."""
    widths = np.diff(points)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        p = np.exp(log_p_high) * (1.0 + 8.0 * _U)
        exponent = _rounded_up((log_q_low - log_p_high)[1:-1] + points[:-1], log_q_low[1:-1], log_p_high[1:-1],
                               points[:-1], sign=-1.0) - rho[:-1]
        share = -np.expm1(exponent) / -np.expm1(-widths) * (1.0 + 8.0 * _U)
        top = _rounded_up(log_q_low[-1] - log_p_high[-1] + points[-1], log_q_low[-1], log_p_high[-1], points[-1],
                          sign=-1.0) - rho[-1]
        excess = np.exp(log_excess) * (1.0 + 8.0 * _U)
    share = np.fmin(np.fmax(share, 0.0), 1.0)  # (fmax drops a nan: an empty bin's share, 0)
    interior = p[1:-1]
    masses = np.zeros(points.size)
    masses[:-1] += interior * (1.0 - share)
    arriving = np.zeros(points.size)  # at each point as a bin's upper end: the bottom bin, each bin's upper share
    arriving[0] = p[0]
    arriving[1:] += interior * share
    moved = np.fmin(arriving, excess)  # (fmin drops a nan excess: all of it moves)
    masses += arriving - moved
    farther = rho[:-1] >= widths  # (a loss error as wide as the gap above: to +inf instead)
    masses[1:] += np.where(farther, 0.0, moved[:-1])
    kept = min(1.0, math.exp(min(float(top), 0.0))) if p[-1] > 0 and not math.isnan(top) else 0.0
    masses[-1] += p[-1] * kept
    lost = np.count_nonzero(log_p_high < -690.0) * math.exp(-690.0)  # bins whose mass may underflow
    below_top = log_p_high[:-1]
    if closed and (np.any(moved[:-1][farther] > 0.0) or np.any(np.isfinite(below_top) & (below_top < -690.0))):
        raise DroppedMass("connect-the-dots would send mass below the top point to +inf")
    beyond = float(moved[-1]) + float(moved[:-1][farther].sum()) + float(p[-1] * (1.0 - kept)) + lost
    p_inf = beyond * (1.0 + 4.0 * _U)
    return masses, min(p_inf, 1.0)


def _dots(sigma: float, q: float, direction: str, points: np.ndarray, closed: bool = False) -> tuple[np.ndarray, float]:
    """One step's connect-the-dots on increasing grid ``points`` (any gaps): ``(masses,
    p_inf)`` (:func:`_connect_the_dots`, ``closed`` there), from bounds that hold whatever
    the rounding (:func:`_bin_bounds`)."""
    return _connect_the_dots(*_bin_bounds(sigma, q, direction, points), points, closed)


#: :func:`_dots_of_steps` bounds steps together up to this many points at once: 128 steps
#: of 17,000 points took 0.32 s one by one or in batches of up to 2^15, 0.41 s in batches
#: of 2^17 and 0.58 s in one (the arrays no longer fit the caches), and 128 of 600 points
#: 0.039 s one by one, 0.019 s in batches of 2^15.
_BATCH_POINTS_OF_STEPS = 2**15


def _dots_of_steps(steps: list, direction: str) -> list:
    """:func:`_dots` of several steps, ``[(sigma, q, points, closed)]``, as ``[(masses,
    p_inf)]``: the same values as one by one, the bins of steps of few points bounded
    beside each other in one pass (:func:`_bounds_of_steps`), without the overhead of a
    call each (128 runs' bulks and tails of a few hundred points each, in a split of many
    runs), up to :data:`_BATCH_POINTS_OF_STEPS` points at once. Halved by steps on two
    threads where a core is idle and there are enough points (:data:`_HALVED_BOUNDS`)."""
    sizes = [points.size for _, _, points, _ in steps]
    total = sum(sizes)
    if 0 in sizes:  # (no grid: as one by one, whatever that does)
        return [_dots(sigma, q, direction, points, closed) for sigma, q, points, closed in steps]
    if len(steps) > 1 and total >= _HALVED_BOUNDS and _core_idle():
        m = min(max(int(np.searchsorted(np.cumsum(sizes), total / 2.0)) + 1, 1), len(steps) - 1)
        first, second = _beside(lambda: _dots_of_steps(steps[:m], direction),
                                lambda: _dots_of_steps(steps[m:], direction))
        return first + second
    found, start, points = [], 0, 0
    for end, size in enumerate(sizes + [math.inf]):
        if end > start and (points + size > _BATCH_POINTS_OF_STEPS or end == len(steps)):
            if end - start == 1:
                sigma, q, grid, closed = steps[start]
                found.append(_dots(sigma, q, direction, grid, closed))
            else:
                found.extend(_dots_batched(steps[start:end], direction))
            start, points = end, 0
        points += size
    return found


def _dots_batched(steps: list, direction: str) -> list:
    """:func:`_dots_of_steps` in one pass: :func:`_bounds_of_steps`, then
    :func:`_connect_the_dots_of_steps`."""
    return _connect_the_dots_of_steps(*_bounds_of_steps(steps, direction),
                                      [(points, closed) for _, _, points, closed in steps])


def _connect_the_dots_of_steps(log_p_high, log_q_low, rho, log_excess, grids: list) -> list:
    """:func:`_connect_the_dots` of several steps at once, from :func:`_bounds_of_steps`
    (each step's bins, then the bin to the next step's, which is not one of them; its
    cuts) and ``grids``, ``(points, closed)`` per step: ``[(masses, p_inf)]``, each
    element computed from the same inputs by the same operations in the same order as
    for its step alone (each step's scalars, its top bin's share and its sums, are its
    own). One step alone keeps :func:`_connect_the_dots`, on slices: through this
    function's gathered indices it took 80 us a call instead of 45 (single runs call it
    most), and the tests hold the two to the same bits on random steps."""
    sizes = np.array([points.size for points, _ in grids])
    points = np.concatenate([points for points, _ in grids])
    owner = np.repeat(np.arange(sizes.size), sizes)
    firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    lasts = firsts + sizes - 1
    inner = np.ones(points.size, dtype=bool)
    inner[lasts] = False
    below = np.flatnonzero(inner)  # points with another above them in their step
    above = below + 2 * owner[below] + 1  # the bin between each of those points and the next
    tops = lasts + 2 * np.arange(sizes.size) + 1  # each step's bin above its grid
    widths = points[below + 1] - points[below]
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        p = np.exp(log_p_high) * (1.0 + 8.0 * _U)
        exponent = _rounded_up((log_q_low - log_p_high)[above] + points[below], log_q_low[above], log_p_high[above],
                               points[below], sign=-1.0) - rho[below]
        share = -np.expm1(exponent) / -np.expm1(-widths) * (1.0 + 8.0 * _U)
        top = _rounded_up(log_q_low[tops] - log_p_high[tops] + points[lasts], log_q_low[tops], log_p_high[tops],
                          points[lasts], sign=-1.0) - rho[lasts]
        excess = np.exp(log_excess) * (1.0 + 8.0 * _U)
    share = np.fmin(np.fmax(share, 0.0), 1.0)  # (fmax drops a nan: an empty bin's share, 0)
    interior = p[above]
    masses = np.zeros(points.size)
    masses[below] += interior * (1.0 - share)
    arriving = np.zeros(points.size)  # at each point as a bin's upper end: the bottom bin, each bin's upper share
    arriving[firsts] = p[firsts + 2 * np.arange(sizes.size)]
    arriving[below + 1] += interior * share
    moved = np.fmin(arriving, excess)  # (fmin drops a nan excess: all of it moves)
    masses += arriving - moved
    farther = rho[below] >= widths  # (a loss error as wide as the gap above: to +inf instead)
    masses[below + 1] += np.where(farther, 0.0, moved[below])
    lost, floored, sent = _faint_bins(log_p_high, tops, sizes, below, (moved[below] > 0.0) & farther)
    found = []
    for k, (_, closed) in enumerate(grids):
        if closed and (sent[k] or floored[k]):
            raise DroppedMass("connect-the-dots would send mass below the top point to +inf")
        last, p_top = lasts[k], p[tops[k]]
        kept = min(1.0, math.exp(min(float(top[k]), 0.0))) if p_top > 0 and not math.isnan(top[k]) else 0.0
        own = masses[firsts[k]: last + 1]
        own[-1] += p_top * kept
        gaps = slice(firsts[k] - k, last - k)  # this step's entries of ``below``
        far = farther[gaps]
        beyond = (float(moved[last]) + (float(moved[below[gaps]][far].sum()) if far.any() else 0.0)
                  + float(p_top * (1.0 - kept)) + int(lost[k]) * math.exp(-690.0))
        found.append((own, min(beyond * (1.0 + 4.0 * _U), 1.0)))
    return found


def _faint_bins(log_p_high: np.ndarray, tops: np.ndarray, sizes: np.ndarray, below: np.ndarray,
                sent: np.ndarray) -> tuple:
    """For :func:`_connect_the_dots_of_steps`, per step: how many of its bins' P-bounds lie
    below e^-690, how many below its top bin do with a finite bound (where a closed
    step's mass would go to +inf), and how many of its points send mass on to +inf
    (``sent``, per point of ``below``). ``tops``: each step's top bin; ``sizes``: its
    points."""
    count = sizes.size
    firsts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    bins = np.ones(log_p_high.size + 1, dtype=bool)
    bins[tops + 1] = False  # (the bins between steps)
    starts = firsts + np.arange(count)  # each step's first bin, those between steps left out
    lost = np.add.reduceat((log_p_high < -690.0)[bins[:-1]], starts)
    floored = np.isfinite(log_p_high) & (log_p_high < -690.0)
    floored[tops] = False
    floored = np.add.reduceat(floored[bins[:-1]], starts)
    if not below.size:
        return lost, floored, np.zeros(count, dtype=int)
    # (a step of one point has none in ``below``: its count is 0)
    sent = np.add.reduceat(np.concatenate([sent, [False]]).astype(int), np.searchsorted(below, firsts))
    sent[sizes == 1] = 0
    return lost, floored, sent


def _bounds_of_steps(steps: list, direction: str) -> tuple:
    """:func:`_bounds_of_bins` of several steps' ``points`` at once (``steps``: ``(sigma, q,
    points, closed)`` each): each step's edges ``-inf``, its cuts, ``+inf`` side by side,
    and the bins' and cuts' bounds in that order (the bin from one step's ``+inf`` to the
    next one's ``-inf`` is not one of them)."""
    sizes = np.array([points.size for _, _, points, _ in steps])
    losses = np.concatenate([points for _, _, points, _ in steps])
    sigmas = np.array([float(sigma) for sigma, _, _, _ in steps])
    rates = np.array([float(q) for _, q, _, _ in steps])
    sigma, q = np.repeat(sigmas, sizes), np.repeat(rates, sizes)
    log_r = _log_r(losses, q, direction)
    z = sigma * sigma * log_r + 0.5
    owner = np.repeat(np.arange(len(steps)), sizes)
    at = np.arange(losses.size) + 2 * owner + 1  # each cut's place among the edges
    edges = np.full(losses.size + 2 * len(steps), np.inf)
    edges[np.concatenate([[0], np.cumsum(sizes + 2)[:-1]])] = -np.inf
    edges[at] = z
    spans = sizes + 2
    log_p_high, log_q_low, x0, x1, shift = _edge_bounds(np.repeat(sigmas, spans), np.repeat(rates, spans), direction,
                                                        edges, np.repeat(np.arange(len(steps)), spans)[:-1])
    rho, log_excess = _cut_errors(sigma, q, direction, losses, log_r, z, x0[at], x1[at], shift[at])
    return log_p_high, log_q_low, rho, log_excess


class DroppedMass(ArithmeticError):
    """A closed connect-the-dots (:func:`_connect_the_dots`) would lose mass: the caller
    answers by other means."""


def _bin_log_masses(sigma: float, q: float, direction: str, losses: np.ndarray) -> tuple:
    """``(edges, log_n0, log_n1, log_p, log_qq)`` of one step's bins of ``z`` cut where its
    loss crosses ``losses``: (-inf, l_0], (l_0, l_1], ..., (l_last, inf). ``edges`` in
    ``z``; the logs of the bins' masses under N(0, s^2), N(1, s^2), P and Q."""
    z = sigma * sigma * _log_r(losses, q, direction) + 0.5
    edges = np.concatenate([[-np.inf], z, [np.inf]])
    return (edges, *_edge_log_masses(sigma, q, direction, edges))


def _edge_log_masses(sigma: float, q: float, direction: str, edges: np.ndarray, tails: tuple | None = None) -> tuple:
    """``(log_n0, log_n1, log_p, log_qq)`` of the bins ``(edges[k], edges[k+1]]`` in ``z``
    (see :func:`_bin_log_masses`); ``tails``: ``(x0, t0, x1, t1)``, each component's edges
    in its standard deviations and the logs of their smaller tails, if already computed."""
    x0, t0, x1, t1 = tails or _edge_tails(sigma, edges)
    log_n0 = _log_gauss_bins(x0, t0)  # N(0, s^2)
    log_n1 = _log_gauss_bins(x1, t1)  # N(1, s^2)
    log_q, log_1mq = _log_rates(_of_bins(q))
    if direction == _REMOVE:
        return log_n0, log_n1, np.logaddexp(log_1mq + log_n0, log_q + log_n1), log_n0
    return log_n0, log_n1, log_n1, np.logaddexp(log_q + log_n0, log_1mq + log_n1)


def _edge_tails(sigma: float, edges: np.ndarray) -> tuple:
    """``(x0, t0, x1, t1)``: edges in z in the standard deviations of N(0, s^2) and of
    N(1, s^2), and the logs of the smaller Gaussian tail beyond each."""
    x0, x1 = edges / sigma, (edges - 1.0) / sigma
    return x0, log_ndtr(-np.abs(x0)), x1, log_ndtr(-np.abs(x1))


#: :func:`_bin_bounds` on this many losses or more bounds the two halves side by side where
#: a core is idle (:func:`_core_idle`): 40 ms became 20 ms on 2^18 losses, 180 ms 92 ms
#: on 2^20, and below 2^16 it gained next to nothing.
_HALVED_BOUNDS = 2**17


def _bin_bounds(sigma: float, q: float, direction: str, losses: np.ndarray) -> tuple:
    """:func:`_bounds_of_bins`, of the two halves of ``losses`` side by side where that is
    worth it (:data:`_HALVED_BOUNDS`). Every bound is computed elementwise from its own
    bin's edges or its own cut, so the halves give the same values: the first half's last
    bin (above its last cut) and the second's first (below its first, which repeats the
    first half's last) are the halves' own ends, and are dropped."""
    m = losses.size // 2
    if losses.size < _HALVED_BOUNDS or not _core_idle():
        return _bounds_of_bins(sigma, q, direction, losses)
    low, high = _beside(lambda: _bounds_of_bins(sigma, q, direction, losses[:m]),
                        lambda: _bounds_of_bins(sigma, q, direction, losses[m - 1:]))
    bins = [np.concatenate([below[:m], above[1:]]) for below, above in zip(low[:2], high[:2])]
    return (*bins, *(np.concatenate([below, above[1:]]) for below, above in zip(low[2:], high[2:])))


def _bounds_of_bins(sigma: float, q: float, direction: str, losses: np.ndarray) -> tuple:
    r"""``(log_p_high, log_q_low, rho, log_excess)`` of one step's bins cut where its loss crosses
    ``losses`` (as :func:`_bin_log_masses`), whatever the rounding: a bound above on the
    log P-mass and below on the log Q-mass of each bin of a *reference partition* of z,
    and ``rho[j]``, one on how far that partition's loss at cut ``j`` lies from
    ``losses[j]``.

    **The reference partition.** A computed log-tail is not exact, but it is the exact
    log-tail of an edge moved a little (:func:`_tail_shift`): the tail is monotone and
    continuous. Each component's computed masses are therefore the masses of bins with
    slightly moved edges, up to the arithmetic after the tails
    (:func:`_gauss_bins_slack`), however narrow a bin (taken as errors of the masses
    themselves they grow as 1/width, :func:`_gauss_bins_error`). The two components'
    edges move differently. The reference partition has the edges of the component P
    and Q share (N(0, s^2) for removal, N(1, s^2) for addition), and the other
    component's mass between its edge and that one at each cut (a sliver: at most
    their distance times the largest density there, weighted by q) counts against the
    accountant: added to the P-bound, taken from the Q-bound. The loss at a reference
    edge lies within ``rho`` of the grid's, and within ``width`` in z of where the
    loss is exactly the grid's (:func:`_edge_errors`): ``log_excess`` bounds the log of
    the P-mass between the two, the mass of a bin that may lie above its upper end
    (P's largest density there times that width)."""
    log_r = _log_r(losses, q, direction)
    z = sigma * sigma * log_r + 0.5
    log_p_high, log_q_low, x0, x1, shift = _edge_bounds(sigma, q, direction, np.concatenate([[-np.inf], z, [np.inf]]))
    rho, log_excess = _cut_errors(sigma, q, direction, losses, log_r, z, x0[1:-1], x1[1:-1], shift[1:-1])
    return log_p_high, log_q_low, rho, log_excess


def _edge_bounds(sigma: float, q: float, direction: str, edges: np.ndarray, steps: np.ndarray | None = None) -> tuple:
    """``(log_p_high, log_q_low, x0, x1, shift)``: the bounds of :func:`_bin_bounds` on the
    bins between consecutive ``edges`` in z, the edges in each component's standard
    deviations, and how far the shared component's edges move (:func:`_tail_shift`).
    ``sigma`` and ``q``: floats, or one per edge (:func:`_per_step`), with ``steps``, the
    step each bin belongs to (:func:`_across_bounds` redoes a step's bins only where
    that step needs it, as it would alone).

    A mixture of components that each err by at most a relative ``s`` errs by at most
    that too, and its logarithm adds round-offs of its terms' sizes; two slivers at a
    bin's cuts hold at most twice the larger."""
    tails = _edge_tails(sigma, edges)
    x0, t0, x1, t1 = tails
    log_n0, log_n1, log_p, log_qq = _edge_log_masses(sigma, q, direction, edges, tails)
    log_q, log_1mq = _log_rates(q)  # at each edge (for the slivers), then at each bin
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        slack0, slack1 = _gauss_bins_slack(x0, t0, log_n0), _gauss_bins_slack(x1, t1, log_n1)
        slack = np.maximum(slack0, slack1)
        shift0, shift1 = _tail_shift(x0, t0), _tail_shift(x1, t1)
        x_other, shift = (x1, shift0) if direction == _REMOVE else (x0, shift1)
        gap = shift0 + shift1
        log_sliver = log_q + np.log(gap) - 0.5 * x_other * x_other - _LOG_SQRT_2PI + np.abs(x_other) * gap
        log_sliver[~np.isfinite(x_other)] = -np.inf
        log_slivers = np.maximum(log_sliver[:-1], log_sliver[1:]) + _LOG_2  # at each bin's two cuts
        log_q, log_1mq = _of_bins(log_q), _of_bins(log_1mq)
        mixture, single = (log_p, log_qq) if direction == _REMOVE else (log_qq, log_p)
        mixed = slack + 4.0 * _U * (2.0 + finite_abs(mixture) + abs(log_q) + finite_abs(log_1mq)
                                    + finite_abs(log_n0) + finite_abs(log_n1))
        if direction == _REMOVE:  # P = (1 - q) N0 + q N1, Q = N0
            log_p_high = _rounded_up(np.logaddexp(mixture + mixed, log_slivers), mixture)
            log_q_low = _rounded_up(single - slack, single, sign=-1.0)
        else:  # P = N1, Q = q N0 + (1 - q) N1
            log_p_high = _rounded_up(single + slack, single)
            low = mixture - mixed
            log_q_low = _rounded_up(low + np.log1p(-np.exp(log_slivers - low)), mixture, sign=-1.0)
        infinite = ~np.isfinite(slack)
        if infinite.any():  # a bin holding 0 with next to no mass
            within = None if steps is None else np.isin(steps, steps[infinite])
            _across_bounds(log_p_high, log_q_low, direction, log_q, log_1mq,
                           ((x0, log_n0, slack0), (x1, log_n1, slack1)), log_slivers, within)
    log_q_low[np.isnan(log_q_low)] = -np.inf
    return log_p_high, log_q_low, x0, x1, shift


_LOG_2 = math.log(2.0)


def _across_bounds(log_p_high, log_q_low, direction, log_q, log_1mq, parts, log_slivers, within=None) -> None:
    """Redo :func:`_edge_bounds` in place for the bins holding 0 of either component
    (``parts``: each component's edges, log-masses and slacks), of those ``within`` where
    given: there a component's mass errs by 3.1u absolutely (:func:`_gauss_bins_slack`),
    which a relative slack only covers while the mass is above that. ``log_q`` and
    ``log_1mq``: floats, or one per bin."""
    masks = [(x[:-1] < 0) & (x[1:] > 0) for x, _, _ in parts]
    if within is not None:
        masks = [mask & within for mask in masks]
    k = np.flatnonzero(masks[0] | masks[1])
    if k.size == 0:
        return
    log_q, log_1mq = (log_q, log_1mq) if np.ndim(log_q) == 0 else (log_q[k], log_1mq[k])
    highs, lows = [], []
    for (_, log_n, slack), mask in zip(parts, masks):
        centre, across = log_n[k], mask[k]
        own = 2.1 * _U * finite_abs(centre)
        gone = 3.1 * _U * np.exp(np.minimum(-centre, 700.0))
        low = np.where(gone < 1.0, centre - own + np.log1p(-np.minimum(gone, 1.0)), -np.inf)
        highs.append(np.where(across, np.logaddexp(centre + own, math.log(3.1 * _U)), centre + slack[k]))
        lows.append(np.where(across, low, centre - slack[k]))
    sliver, scale = np.exp(log_slivers[k]), 1.0 + 8.0 * _U
    if direction == _REMOVE:  # P = (1 - q) N0 + q N1, Q = N0
        log_p_high[k] = _rounded_up(np.log((np.exp(log_1mq + highs[0]) + np.exp(log_q + highs[1]) + sliver) * scale))
        log_q_low[k] = lows[0] - 4.0 * _U * (1.0 + finite_abs(lows[0]))
    else:  # P = N1, Q = q N0 + (1 - q) N1
        log_p_high[k] = highs[1] + 4.0 * _U * (1.0 + finite_abs(highs[1]))
        q_low = (np.exp(log_q + lows[0]) + np.exp(log_1mq + lows[1]) - sliver) / scale
        log_q_low[k] = np.where(q_low > 0.0, _rounded_up(np.log(np.maximum(q_low, 1e-320)), sign=-1.0), -np.inf)


def _cut_errors(sigma, q, direction, losses, log_r, z, x0, x1, shift) -> tuple[np.ndarray, np.ndarray]:
    """``(rho, log_excess)`` of :func:`_bin_bounds` at cuts ``z`` for ``losses`` (``x0``,
    ``x1``: the cuts in each component's standard deviations; ``shift``: the shared
    component's move there)."""
    log_q, log_1mq = _log_rates(q)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore", under="ignore"):
        rho, width = _edge_errors(sigma, q, direction, losses, log_r, z, shift)
        reach = width / sigma  # P's largest density (per unit z) within ``width`` of each cut, times the width
        log_d0 = log_1mq - 0.5 * x0 * x0 + np.abs(x0) * reach
        log_d1 = -0.5 * x1 * x1 + np.abs(x1) * reach + (log_q if direction == _REMOVE else 0.0)
        log_density = (np.maximum(log_d0, log_d1) + _LOG_2 if direction == _REMOVE else log_d1) - _LOG_SQRT_2PI \
            - _per_step(math.log, sigma)
        log_excess = np.log(width) + log_density + 8.0 * _U * (2.0 + np.abs(log_density) + np.abs(reach))
        log_excess = np.where(np.isnan(log_excess), np.inf, log_excess)
    return rho, np.where(width == 0.0, -np.inf, log_excess)


_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def _rounded_up(value: np.ndarray, *terms, sign: float = 1.0) -> np.ndarray:
    """``value`` moved by 8u(2 + the sizes of ``value`` and ``terms``) up (``sign`` 1) or
    down (-1): more than the round-offs of a few sums, logarithms and exponentials of
    such terms (infinite ones count as 0; an infinite value stays)."""
    slack = 2.0 + finite_abs(value)
    for term in terms:
        slack = slack + finite_abs(term)
    return value + sign * 8.0 * _U * slack


def _gauss_bins_slack(x: np.ndarray, tail: np.ndarray, log_n: np.ndarray) -> np.ndarray:
    r"""Bound on how far each ``log_n = _log_gauss_bins(x, tail)`` lies from the log of
    the exact N(0,1)-mass between the edges whose exact log-tails are ``tail`` (see
    :func:`_bin_bounds`).

    Away from 0 a bin is :math:`\log(1 - e^{-d}) + t` with ``d`` the tails' difference
    and ``t`` the larger (the one nearer 0, however far the other edge lies in the
    tail): ``d``'s rounding and ``expm1`` err by 3.1u relative (the
    function's relative slope in ``d`` is at most 1), the logarithm and the sum by a
    round-off of their sizes: within :math:`4u(1 + |\log n| + |t|)`. The bin holding 0 is
    ``log1p(-(e^{ta} + e^{tb}))``: the exponentials and their sum err by 3u of the sum, at
    most 1, so its mass errs by 3.1u absolutely, and ``log1p`` by a round-off of its size:
    within :math:`-\log(1 - 3.1u/n) + 2.1u|\log n|` either way, while that is finite (a
    bin holding 0 with no more mass than 3.1u counts as infinite here, and
    :func:`_across_bounds` bounds it)."""
    out = 4.0 * _U * (1.0 + finite_abs(log_n) + finite_abs(np.maximum(tail[:-1], tail[1:])))
    across = np.flatnonzero((x[:-1] < 0) & (x[1:] > 0))
    if across.size:
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            share = 3.1 * _U * np.exp(np.minimum(-log_n[across], 700.0))
            out[across] = np.where(share < 1.0, -np.log1p(-np.minimum(share, 1.0)), np.inf) \
                + 2.1 * _U * finite_abs(log_n[across])
    return out


def _tail_shift(x: np.ndarray, tail: np.ndarray) -> np.ndarray:
    r"""Bound, in standard deviations, on how far from the exact edge lies the edge whose
    exact log-tail is ``tail``, the computed ``log_ndtr(-|x|)``: ``x`` itself errs by
    2u|x| (two round-offs from z); ``log_ndtr`` is within :math:`8u(1 + |t|)` (measured
    within half of that from -60 to 60 against 40-digit arithmetic, and checked by the
    tests), and the bin holding 0 exponentiates and sums the tails (3u more of the tail,
    :func:`_gauss_bins_slack`), over the slope of the log-tail, the hazard rate, at least
    :math:`\max(|x|, \sqrt{2/\pi})` (Mills' ratio; it rises from :math:`\sqrt{2/\pi}` at
    0). Infinite edges are exact."""
    size = np.where(np.isfinite(tail), np.abs(tail), 0.0)
    with np.errstate(invalid="ignore"):
        out = (8.0 * (1.0 + size) + 3.0) * _U / np.maximum(np.abs(x), math.sqrt(2.0 / math.pi)) + 2.0 * _U * np.abs(x)
    return np.where(np.isfinite(x), out, 0.0)


def _edge_errors(sigma: float, q: float, direction: str, losses: np.ndarray, log_r: np.ndarray, z: np.ndarray,
                 shift: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""``(rho, width)`` at each cut: a bound on how far the loss at the reference edge
    (the computed ``z`` moved by ``shift`` standard deviations, :func:`_bin_bounds`) lies
    from the grid loss it was cut for, and one on how far that edge lies from the exact
    one (in z; infinite where the loss is too flat to bound it).

    The loss rises in z with slope :math:`g/\sigma^2`, :math:`g = 1 - (1 - q)e^{-l}`
    for removal and :math:`1 - (1 - q)e^{l}` for addition, in [0, 1] (:func:`_log_r`).
    There, the exponential of :math:`\log(1-q) \mp l` errs relatively by
    :math:`u(2 + |l| + 2|\log(1-q)|)`, so :math:`g` by that times :math:`1 - g`
    absolutely, its logarithm by that over ``g``, and the loss by at most that however
    small ``g`` (exactly: :math:`\log(1 - x\theta)` for :math:`x = (1-q)e^{\mp l}` and
    a relative error :math:`\theta`, which leaves ``g`` below :math:`g + |\theta|`); the
    other sums and logarithms err by round-offs of their sizes, times that slope. ``z``
    errs by :math:`3u\sigma^2|\log r| + u|z|`, the loss by :math:`g/\sigma^2` times that,
    and the shift adds
    :math:`g/\sigma` times itself. Over such tiny moves ``g`` grows by at most
    :math:`e^{\text{move}/\sigma^2} \le 1 + 2\,\text{move}/\sigma^2` (where that is at
    most 1; beyond, ``g`` is taken as 1), which is applied. The computed edge lies within
    :math:`1.2\rho\sigma^2/g` of the exact one where the loss error is at most a tenth
    of ``g`` (the slope then stays above 0.88 of its value there), and the reference
    edge ``shift`` further. Where no z has the loss (an infinite edge) the loss next to
    it stops at its limit, :math:`\log(1-q)` below for removal and :math:`-\log(1-q)`
    above for addition: it passes the grid loss only by as much as that loss lies inside
    the limit (rounding put the edge at infinity), and the edge is exact otherwise."""
    log_q, log_1mq = _log_rates(q)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        slope = -np.expm1(log_1mq - losses) if direction == _REMOVE else -np.expm1(log_1mq + losses)
        inside = 8.0 * _U * (2.0 + 2.0 * finite_abs(losses) + abs(log_q) + 3.0 * finite_abs(log_r)
                             + finite_abs(z) / (sigma * sigma))
        move = shift / sigma + inside
        grow = 1.0 + 2.0 * move  # at least e^move where move <= 1 (and moves are about 1e-13)
        grow[move > 1.0] = np.inf
        g = np.clip(slope, 0.0, 1.0)
        outside = 8.0 * _U * (2.0 + finite_abs(losses) + 2.0 * finite_abs(log_1mq))
        steep = np.minimum(1.0, (g + outside) * grow)  # the slope's bound over the moves
        edge = outside + steep * inside
        rho = edge + steep * shift / sigma
        width = np.where(edge <= 0.1 * g, 1.2 * edge * sigma * sigma / g, np.inf) + sigma * shift
        limit = log_1mq if direction == _REMOVE else -log_1mq
        slack = 4.0 * _U * abs(limit)  # the limit's own round-off (the grid losses are exact)
        past = np.maximum(losses - limit + slack if direction == _REMOVE else limit + slack - losses, 0.0)
    finite = np.isfinite(z)
    return np.where(finite, rho, past), np.where(finite, width, np.where(past > 0.0, np.inf, 0.0))


def _dominated_masses(p: np.ndarray, log_q: np.ndarray, errors: np.ndarray, first: int, spacing: float,
                      offset: float = 0.0, points: int | None = None) -> np.ndarray:
    r"""P-masses at losses ``k * spacing + offset``, ``k = first .. first + p.size - 2``, of
    a pair *dominated* by the step's: a lower bound on every composed privacy profile.

    ``p`` and ``exp(log_q)`` are the P- and Q-masses of the bins of ``z`` cut at the grid
    losses (the first below the grid, the last above it), each within a relative
    ``errors`` of the exact masses; their losses :math:`\log(p_j/q_j)` increase with
    ``j``. Any randomised post-processing of the output gives a pair whose every
    hockey-stick divergence is at most the original's (data processing), and composition
    keeps that. The post-processing used here merges consecutive bins, and a fraction
    ``f`` of the next one, into one outcome whose loss :math:`\log\frac{P + f p_j}{Q + f
    q_j}` is the next grid value above the merged ones (``f`` solves a linear equation). Each
    outcome lies on the grid and only the loss variance within about a bin is lost: the
    dominated counterpart of connect-the-dots (Doroshenko et al. 2022), which splits bins.
    Rounding each bin down instead shifts the composed loss by half a bin per step; but
    where the next bin lies far above (a gap in the loss), lifting takes it far down, and
    the held bins are rounded down where that loses less (:func:`_rounds_down`).

    What is left unmerged at the end is placed at the grid point at or below its merged
    loss, at most the top: rounding a loss down, which lowers every profile (pointwise in
    the loss). Q-masses are compared *aimed*, :math:`e^{x} q_j` for the grid value ``x``
    aimed at, from logarithms (:func:`_aimed`): near ``x`` that is near the P-mass,
    however large the loss (beyond 709 at small sigma, where Q-masses underflow); some
    bins are dropped (:func:`_usable_bins`). Floating point: an outcome made of bins whose masses
    err by at most a relative :math:`\kappa` has a loss within :math:`2.5\kappa` of the
    computed one, so it is aimed that far above its grid point (plus a few round-offs)
    and its P-mass scaled down by as much; held sums are rounded against the answer (P
    down, Q up). Bins that err by 10% or more are dropped. ``points``: the grid's size,
    if not ``p.size - 1`` (outcomes that are not bins cut at it: :mod:`.staged_lower`)."""
    size = p.size - 1 if points is None else points
    margins = 2.5 * np.asarray(errors) + 8.0 * _U
    bottom = first * spacing + offset
    usable = _usable_bins(p, log_q, margins, bottom) if size > 0 else np.zeros(p.size, bool)
    p, log_q, margins = p[usable], log_q[usable], margins[usable]  # dropping a bin only lowers a profile
    exponents = ((first + np.arange(size)) * spacing + offset).tolist()
    return _merged_onto(p, log_q, margins, exponents, bottom, spacing)


def _merged_onto(p: np.ndarray, log_q: np.ndarray, margins: np.ndarray, exponents: list, bottom: float,
                 spacing: float) -> np.ndarray:
    """:func:`_dominated_masses`' merge of the usable bins (``p``, ``log_q``, ``margins``)
    onto the grid values ``exponents`` (the first ``bottom``), in order: bins are held
    until they, with a share of the next, reach the next grid value; or, where a bin
    lies a spacing or more above it, the held ones are rounded down instead where that
    loses less (:func:`_rounds_down`)."""
    size = len(exponents)
    out = [0.0] * size
    k = 0  # the grid point aimed at next
    held_p = held_a = held_margin = 0.0  # merged P-mass not yet placed, its aimed Q-mass, its margin
    held_from, held_share = -1, 1.0  # the held bins: this share of bin held_from, then all after it
    lifting, gap = False, math.exp(spacing)  # whether the held bins are to be lifted (chosen once)
    for j, (p_j, log_q_j, margin_j) in enumerate(zip(p.tolist(), log_q.tolist(), margins.tolist())):
        margin, share = max(held_margin, margin_j), 1.0
        a_j = _aimed(exponents[k], log_q_j) if k < size else math.inf
        while k < size and p_j > (1.0 + 2.0 * margin) * a_j:  # loss above the grid value + margin
            lift = 1.0 + 2.0 * margin
            f = max((lift * held_a - held_p) / (p_j - lift * a_j), 0.0)
            if not lifting and k > 0 and p_j > gap * lift * a_j:  # bin j lies a spacing above
                if _rounds_down((p, log_q, j), p_j, a_j, (held_p, held_a, held_margin), exponents[k - 1:k + 1], lift):
                    out[k - 1] += held_p * (1.0 - held_margin)  # the held loss, at or above the point below
                    held_p = held_a = held_margin = 0.0
                    held_from, margin = -1, margin_j
                    continue  # (bin j then passes this point whole)
                lifting = True
            if f > 1.0:
                break  # even all of it leaves the merged loss below that value
            out[k] += (held_p + f * p_j) * (1.0 - margin)
            p_j, share = p_j * (1.0 - f), share * (1.0 - f)
            held_p = held_a = held_margin = 0.0
            held_from, margin, lifting = -1, margin_j, False
            k += 1
            a_j = share * _aimed(exponents[k], log_q_j) * (1.0 + 2.0 * _U) if k < size else math.inf
        if held_from < 0:
            held_from, held_share = j, share
        held_p = (held_p + p_j) * (1.0 - 2.0 * _U)  # rounded down
        held_a = (held_a + a_j) * (1.0 + 2.0 * _U)  # rounded up
        held_margin = max(held_margin, margin_j)
    if held_p > 0.0:  # the rest
        _place_rest(out, held_p, _held_log_q(log_q, held_from, held_share, log_q.size), held_margin, bottom, spacing)
    return np.asarray(out)


def _rounds_down(bins: tuple, p_j: float, a_j: float, held: tuple, points: list, lift: float) -> bool:
    """Whether :func:`_merged_onto` places the held outcome at the grid point below
    rather than lifting it to the next with the bins above (``bins``: the arrays ``p``,
    ``log_q`` and the index ``j`` of the next bin, of P-mass ``p_j`` and Q-mass aimed at
    the next point ``a_j`` left; ``held``: P-mass, aimed Q-mass and margin held;
    ``points``: the grid values below and next). Lifting takes the bins above down to the
    next point, one after another, until the merged loss reaches it (a share of the
    last); rounding down loses at most the held P-mass times the spacing, so it is
    taken where the bins taken down lose more (P-mass times loss above the point).

    Where a step's loss has a gap (tiny sigma at q near 0.5: a spike near log(1 - q),
    the bulk of the sampled steps near 1 / (2 sigma^2)), lifting the spike by a fraction
    of a bin took part of the bulk down by about 1 / (2 sigma^2) (sigma 0.052, q 0.51:
    7% of the mean loss). Only where the held loss lies clear of the point below (by
    four times its margin and the round-off of the grid values): rounding a loss down
    lowers every profile."""
    held_p, held_a, margin = held
    below, above = points
    if held_p <= 0.0 or held_a <= 0.0:
        return False
    clear = above - below + math.log(held_p / held_a)  # the held loss minus the point below
    if not clear > 4.0 * margin + 64.0 * _U * (abs(above) + 1.0):
        return False
    budget, need = held_p * (above - below), lift * held_a - held_p  # need: the P-mass beyond lift * Q to bring
    gain = p_j - lift * a_j
    if gain >= need:
        return need / gain * p_j * math.log(p_j / a_j) > budget
    pulled, need = p_j * math.log(p_j / a_j), need - gain
    p, log_q, j = bins
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for start in range(j + 1, p.size, 256):
            mass = p[start:start + 256]
            above_point = np.where(mass > 0.0, np.log(mass) - log_q[start:start + 256] - above, 0.0)
            gains = np.maximum(mass * -np.expm1(math.log(lift) - above_point), 0.0)
            gained, lost = np.cumsum(gains), pulled + np.cumsum(mass * above_point)
            i = int(np.searchsorted(gained, need))
            if i < mass.size:  # bin start + i completes the lift, a share of it
                share = (need - (gained[i - 1] if i else 0.0)) / gains[i]
                return (lost[i - 1] if i else pulled) + share * mass[i] * above_point[i] > budget
            pulled, need = lost[-1], need - gained[-1]
            if pulled > budget:
                return True
    return True  # the bins above never lift it: the rest is rounded down at the end anyway


def _usable_bins(p: np.ndarray, log_q: np.ndarray, margins: np.ndarray, bottom: float) -> np.ndarray:
    """Which bins :func:`_dominated_masses` merges (dropping an outcome only lowers every
    profile): not those whose masses err by 10% or more, nor those of P-mass below
    :data:`_SMALLEST_MERGED`, nor those whose Q-mass aimed at the lowest grid value
    ``bottom`` overflows the float range (losses over 709 below it, next to no P-mass
    where a window lies far above 0: a full batch at sigma 9.4e-4 on a window from
    5.4*10^5 has P-mass e^-265 below it, and Q-mass 1)."""
    return (margins < 0.25) & (p >= _SMALLEST_MERGED) & (bottom + log_q <= _LARGEST_EXPONENT)


#: Bins of smaller P-mass are left out of the dominated distributions (see
#: :func:`_dominated_masses`): no aimed quantity is then subnormal.
_SMALLEST_MERGED = 1e-300

#: ... and bins whose aimed Q-mass ``e^{x + log q}`` would overflow at the lowest grid
#: value ``x`` (the float range's largest exponent).
_LARGEST_EXPONENT = math.log(float(np.finfo(np.float64).max))


def _aimed(x: float, log_q: float) -> float:
    r""":math:`e^{x + \log q}` rounded up (the grid value ``x`` and the sum each err by a
    round-off of their size), and at least :math:`e^{-700}`: never subnormal.
    ``OverflowError`` beyond the float range (the lower bound is then 0)."""
    return math.exp(max(x + log_q, -700.0)) * (1.0 + 4.0 * _U * (2.0 + abs(x) + abs(log_q)))


def _held_log_q(log_q: np.ndarray, start: int, share: float, end: int) -> float:
    """log of the Q-mass held by :func:`_dominated_masses`: ``share`` of bin ``start`` and
    all bins up to ``end`` (in logarithms: some may be below the smallest float)."""
    with np.errstate(divide="ignore"):
        return float(np.logaddexp(math.log(share) + log_q[start], np.logaddexp.reduce(log_q[start + 1:end])))


def _place_rest(out: list, held_p: float, held_log_q: float, margin: float, bottom: float, spacing: float) -> None:
    """Add what :func:`_dominated_masses` left unmerged to the grid point at or below its
    merged loss (at most the top; dropped below the bottom), its mass scaled down by the
    margin of its bins (and the loss by a few round-offs of the logarithms)."""
    log_p = math.log(held_p)
    loss = log_p - held_log_q - margin - 8.0 * _U * (1.0 + abs(log_p) + abs(held_log_q) + abs(bottom))
    at = len(out) - 1 if loss == math.inf else math.floor((loss - bottom) / spacing)
    if at >= 0:
        out[min(at, len(out) - 1)] += held_p * (1.0 - margin)


@functools.lru_cache(maxsize=1024)
def _dominated_offset(sigma: float, q: float, direction: str, spacing: float) -> float:
    r"""Where the grid of a step's dominated distribution sits: shifted by this much (in
    ``[0, spacing)``) so that a grid point falls just above the merged loss of the bins up
    to the heaviest one, where that one holds most of the mass (else 0).

    Merging can only place a block of bins at a grid point at or below its merged loss,
    and lifting a block to the next grid point takes the excess loss of the bins above
    it. When sigma or q is small the bulk of a step's mass lies within one bin, far
    more than the bins above could lift, so on the plain grid it would drop by up to a
    bin per step (at 10^5 steps, by more than epsilon itself). With a grid point at the
    bulk's own merged loss it is placed where it is. Any offset gives a valid lower
    bound; the composed loss is labelled with the sum of the steps' offsets
    (:func:`_compose_direction`).
    """
    # A bin holding half of P holds P's median: only the bins next to it are computed,
    # the first of them reaching down to -inf (the merged loss needs no more).
    middle = math.ceil(float(_loss_of_z(_mixture_z(sigma, q, direction, 0.5, upper=True), sigma, q, direction))
                       / spacing)
    _, _, _, log_p, log_qq = _bin_log_masses(sigma, q, direction, np.arange(middle - 2, middle + 3) * spacing)
    heaviest = 1 + int(np.argmax(log_p[1:-1]))
    if log_p[heaviest] < math.log(0.5):
        return 0.0  # the bulk spans bins: the plain grid does as well (measured: a little better)
    merged = float(np.logaddexp.reduce(log_p[: heaviest + 1]) - np.logaddexp.reduce(log_qq[: heaviest + 1]))
    aim = merged + 1e-6 * spacing  # just above: the next bin lifts the bulk to it
    return float(aim - spacing * math.floor(aim / spacing))


def _bin_errors(sigma, q, direction, edges, log_n0, log_n1, log_p, log_qq) -> np.ndarray:
    """Bound on the relative error of both computed masses (P and Q) of each bin: a
    mixture errs by the average of its components' errors, weighted by their shares,
    and the exponential adds a few round-offs of the logarithm's size."""
    error0, error1 = _gauss_bins_error(edges / sigma), _gauss_bins_error((edges - 1.0) / sigma)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        log_1mq = math.log1p(-q) if q < 1 else -math.inf
        log_mixture = log_p if direction == _REMOVE else log_qq
        first, second = (log_1mq, math.log(q)) if direction == _REMOVE else (math.log(q), log_1mq)
        share0, share1 = np.exp(first + log_n0 - log_mixture), np.exp(second + log_n1 - log_mixture)
        mixture = np.where(share0 > 0, share0 * error0, 0.0) + np.where(share1 > 0, share1 * error1, 0.0)
        single = error0 if direction == _REMOVE else error1
        out = np.maximum(mixture, single) + 4.0 * _U * (2.0 + np.abs(log_p) + np.abs(log_qq))
    return np.where(np.isnan(out), np.inf, out)


def _gauss_bins_error(x: np.ndarray) -> np.ndarray:
    r"""Bound on the relative error of each bin mass ``exp(_log_gauss_bins(x))``.

    A bin's log-mass is :math:`\log(1 - e^{-d}) + t` with ``t`` the larger log-tail and
    ``d`` the difference of the two log-tails (each accurate to a few round-offs of its
    size): the error of ``d`` is amplified by :math:`1/(e^d - 1)`, large for narrow bins
    far in a tail.
    """
    tail = log_ndtr(-np.abs(x))
    ta, tb = tail[:-1], tail[1:]
    size = np.where(np.isinf(tail), 0.0, np.abs(tail))  # an infinite edge's tail is exactly 0
    sa, sb = size[:-1], size[1:]
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        gap = np.abs(tb - ta)
        amplified = np.where(np.isinf(gap), 0.0, 8.0 * _U * (sa + sb) / np.expm1(gap))
        out = amplified + 8.0 * _U * (1.0 + np.maximum(sa, sb))
    across = (x[:-1] < 0) & (x[1:] > 0)
    out[across] = 8.0 * _U
    return np.where(np.isnan(out), np.inf, out)


def _tilted_step(sigma, q, direction, spacing, i_low, i_high, tilt, optimistic=False, thin=None):
    """One step's tilted grid distribution: ``(first, tilted, p_inf, log_mgf)``.

    ``tilted[k]`` is ``m_k e^{tilt l_k} / M`` at loss ``(first + k) * spacing``, with
    ``M = sum_k m_k e^{tilt l_k}`` over the finite part and ``log_mgf = log M``; ``p_inf``
    is the mass at +inf.
    """
    return _tilted(*_step_distribution(sigma, q, direction, spacing, i_low, i_high, optimistic, thin), spacing,
                   tilt)


def _tilted(first: int, masses: np.ndarray, p_inf: float, spacing: float, tilt: float) -> tuple:
    """:func:`_tilted_step` of a grid distribution ``(first, masses, p_inf)``."""
    support = np.flatnonzero(masses)  # (a thinned step holds mass at few of its points)
    if support.size == 0:  # no finite mass (a dominated step whose every bin was dropped)
        return first, np.zeros(masses.size), p_inf, -math.inf
    log_tilted = np.log(masses[support]) + tilt * (first + support) * spacing
    peak = log_tilted.max()
    kept = np.exp(log_tilted - peak)
    total = kept.sum()
    tilted = np.zeros(masses.size)
    tilted[support] = kept / total
    return first, tilted, p_inf, peak + math.log(total)


#: A power ``|F|^c`` at most e^-_DEAD is zero in float64 (its smallest positive number is
#: about e^-745): the composed spectrum is exactly zero wherever one factor is that small.
_DEAD = 800.0

#: Bytes of truncated step spectra kept between calls (see :func:`_step_prefixes`).
_PREFIX_CACHE_BYTES = 256 * 2**20
_prefix_cache: dict = {}  # insertion order = least recently used first
_prefix_lock = threading.Lock()

#: Grid points transformed at once: the transforms of a batch run as one 2-D transform,
#: about three times faster per row than one at a time (vectorised across rows).
_BATCH_POINTS = 2**22

#: Rows per call of scipy's rfft into the thread's buffers (scipy runs rows side by side
#: in SIMD lanes, about twice numpy's speed on float64, but writes a new array).
_FFT_ROWS = 8


def _step_prefixes(items, n: int, tilt: float, dtype, optimistic: bool) -> list:
    r"""Each step's spectrum up to the frequency beyond which its ``count``-th power is dead.

    ``items`` holds ``(sigma, q, direction, spacing, i_low, i_high, thin, count)`` per step.
    Returns, per step, ``(prefix, log_beyond, p_inf, log_mgf)``: the first entries of the
    rfft (in ``dtype``) of the step's tilted distribution (:func:`_tilted_step`) placed
    circularly at index mod ``n``, and a bound ``log_beyond`` on :math:`\log|F_j|` for
    every frequency ``j`` past the prefix, with ``count * log_beyond <= -_DEAD`` (or the
    whole spectrum and ``-inf``). After many steps the composed distribution is wide and
    its transform lives on a few hundred low frequencies out of ``n / 2``, so the prefix
    is short: caching prefixes (keyed by the pair and the grid, at most
    :data:`_PREFIX_CACHE_BYTES` in all) lets a ledger that grows by a step, or
    :func:`~dpoptim.accounting.max_steps`' search, re-use every transform it has seen.
    Truncation changes no computed value: every product past the prefix is below the
    smallest positive float64 (see :func:`_compose_direction` for the rounding bound).
    The steps not found in the cache are transformed together, in batches.
    """
    keys = [_prefix_key(item, n, tilt, dtype, optimistic) for item in items]
    with _prefix_lock:
        entries = [_prefix_cache.pop(key, None) for key in keys]
    for i, (entry, item) in enumerate(zip(entries, items)):
        if entry is not None and not item[-1] * entry[1] <= -_DEAD:
            entries[i] = None  # cut for a longer run: this count needs more of the spectrum
    missing = [i for i, entry in enumerate(entries) if entry is None]
    rows = max(1, _BATCH_POINTS // (n * np.dtype(dtype).itemsize // 8))
    for start in range(0, len(missing), rows):
        chunk = missing[start:start + rows]
        for i, entry in zip(chunk, _transform_batch([items[i] for i in chunk], n, tilt, dtype, optimistic)):
            entries[i] = entry
    _cache_put(keys, entries)
    return entries


def _cache_put(keys: list, entries: list) -> None:
    """Store ``entries`` (tuples whose first item is an array) in the transform cache, the
    least recently used out first beyond :data:`_PREFIX_CACHE_BYTES` (never these)."""
    with _prefix_lock:
        for key, entry in zip(keys, entries):
            _prefix_cache[key] = entry
        size = sum(item[0].nbytes for item in _prefix_cache.values())
        while size > _PREFIX_CACHE_BYTES and len(_prefix_cache) > len(keys):
            oldest = next(iter(_prefix_cache))
            size -= _prefix_cache.pop(oldest)[0].nbytes


def _prefix_key(item, n, tilt, dtype, optimistic) -> tuple:
    """The cache key of a step's prefix: by the support, not the window (see :func:`_support`)."""
    sigma, q, direction, spacing, i_low, i_high, thin, _ = item
    return (sigma, q, direction, spacing, *_support(sigma, q, direction, spacing, i_low, i_high), thin, n, tilt,
            np.dtype(dtype).str, optimistic)


def _transform_batch(items, n: int, tilt: float, dtype, optimistic: bool) -> list:
    """The entries of :func:`_step_prefixes` for ``items``, by one 2-D transform."""
    steps = [_tilted_step(sigma, q, direction, spacing, i_low, i_high, tilt, optimistic, thin)
             for sigma, q, direction, spacing, i_low, i_high, thin, _ in items]
    spectra = _placed_transform([step[:2] for step in steps], n, dtype)
    rest = [step[2:] for step in steps]
    counts = np.array([item[-1] for item in items])
    entries = []
    for row, (cut, log_beyond) in enumerate(_dead_cuts(spectra, counts)):
        prefix = spectra[row, : max(cut, 1)].copy()
        prefix.setflags(write=False)
        entries.append((prefix, log_beyond, *rest[row]))
    return entries


def _placed_transform(rows: list, n: int, dtype, fresh: bool = False) -> np.ndarray:
    """The rfft of each ``(first, masses)`` placed at index ``first`` mod ``n`` (a support
    longer than ``n`` is folded: the circular composition does that anyway, and the
    window's bounds cover what lands beyond it), as one 2-D transform into the thread's buffers (valid until the
    next call), or into a new array (``fresh``); the input buffer is all zeros again
    afterwards, whatever happened."""
    import scipy.fft  # (here: building an optimizer imports no scipy)

    placed, spectra = _buffers(len(rows), n, dtype)
    workers, where = _transform_workers(), []
    try:
        for row, (first, masses) in enumerate(rows):
            if masses.size > n:  # longer than the circle (a lower bound's lowered window): fold it
                masses = np.pad(masses, (0, -masses.size % n)).reshape(-1, n).sum(axis=0)
            where.append(_circular_slices(first % n, masses.size, n))
            for columns, part in where[-1]:
                placed[row, columns] = masses[part]
        if fresh:
            spectra = scipy.fft.rfft(placed, axis=1, workers=workers)
        else:
            for start in range(0, len(rows), _FFT_ROWS):
                part = slice(start, start + _FFT_ROWS)
                spectra[part] = scipy.fft.rfft(placed[part], axis=1, workers=workers)
    finally:
        for row, pieces in enumerate(where):
            for columns, _ in pieces:
                placed[row, columns] = 0.0
    return spectra


def _circular_slices(start: int, size: int, n: int) -> list[tuple[slice, slice]]:
    """``(columns, part)`` pairs placing ``size < n`` entries at ``start, start + 1, ...``
    modulo ``n``: one slice, or two where they wrap past the end."""
    if start + size <= n:
        return [(slice(start, start + size), slice(0, size))]
    head = n - start
    return [(slice(start, n), slice(0, head)), (slice(0, size - head), slice(head, size))]


_scratch = threading.local()


def _buffers(rows: int, n: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """Zeroed input rows and output rows for a batch of transforms, kept per thread.

    Fresh arrays of this size cost more in page faults than the transform itself; the
    input is left all zeros after each use (see :func:`_transform_batch`).
    """
    key = (n, np.dtype(dtype).str)
    held = getattr(_scratch, "buffers", None)
    if held is None or held[0] != key or held[1].shape[0] < rows:
        size = max(rows, _BATCH_POINTS // n)
        complex_type = np.result_type(dtype, np.complex64)
        held = (key, np.zeros((size, n), dtype=dtype), np.empty((size, n // 2 + 1), dtype=complex_type))
        _scratch.buffers = held
    return held[1][:rows], held[2][:rows]


def _dead_cuts(spectra: np.ndarray, counts: np.ndarray) -> list[tuple[int, float]]:
    r"""Per row ``F`` of ``spectra`` with its count ``c``: ``(cut, log_beyond)``, the first
    frequency past which :math:`c \log|F_j| \le -\_DEAD` for every ``j``, and the largest
    :math:`\log|F_j|` there (``-inf`` if none; the whole row and ``-inf`` for ``c < 2``).

    Moduli are compared with the threshold, so no logarithm of a whole row is taken; a
    rounding at the threshold keeps the whole row.
    """
    size = spectra.shape[1]
    modulus = np.empty(size, dtype=np.result_type(spectra.real.dtype, np.float64))
    out = []
    for row, count in enumerate(counts):
        count = int(count)
        if count < 2:
            out.append((size, -math.inf))
            continue
        np.abs(spectra[row], out=modulus)
        live = modulus > math.exp(-_DEAD / count)
        last = size - 1 - int(np.argmax(live[::-1]))  # the last live frequency, if any
        cut = last + 1 if live[last] else 0
        log_beyond = -math.inf
        if cut < size:
            largest = float(modulus[cut:].max())
            log_beyond = math.log(largest) if largest > 0 else -math.inf
            if not count * log_beyond <= -_DEAD:  # rounding at the threshold
                cut, log_beyond = size, -math.inf
        out.append((cut, log_beyond))
    return out


# --- composition and the privacy profile -------------------------------------------


def _direction_epsilon(steps, direction, grid: _Grid, delta, head: int = 0, mixture=None) -> float:
    """Epsilon of one direction, refined where rounding decides the answer (:func:`_refined`).

    Where the floating-point allowance makes up a noticeable part of delta at the answer
    (tiny q with tiny delta, or billions of steps), the composition is repeated in the
    platform's extended precision (80-bit on x86), whose allowance is ~2000 times smaller.
    All results are sound; the smallest is returned. ``head``: see :func:`_compose_direction`.
    """
    def compose(on: _Grid, dtype) -> tuple[float, bool]:
        return _compose_direction(steps, direction, on, delta, dtype, head=head, mixture=mixture)

    epsilon, binding = compose(grid, np.float64)
    return _refined(compose, grid, epsilon)[0] if binding else epsilon


def _direction_lower(steps, direction, grid: _Grid, delta, kernel=None) -> float:
    """A rigorous *lower* bound on the epsilon of one direction (for tests and benchmarks)."""
    epsilon, binding = _compose_direction(steps, direction, grid, delta, np.float64, lower=True, kernel=kernel)
    if binding and _EXTENDED_U < _U:
        epsilon = max(epsilon, _compose_direction(steps, direction, grid, delta, np.longdouble, lower=True,
                                                  kernel=kernel)[0])
    return epsilon


def _compose_direction(steps, direction, grid: _Grid, delta, dtype, lower: bool = False, head: int = 0,
                       mixture=None, cuts: dict | None = None, kernel=None, floors: list | None = None) -> tuple:
    r"""Compose by FFT, undo the tilt, invert the profile: ``(epsilon, rounding_binding)``.

    The transform works on the *tilted* distributions :math:`\tilde m_k \propto m_k
    e^{\theta l_k}` (Esscher transform): tilting commutes with convolution, and it moves
    the composed mass towards the losses that decide delta, where floating-point noise of
    the transform (absolute, of the order of the largest entry) is then small relative to
    what is read. Undoing the tilt multiplies entry ``k`` by :math:`e^{K - \theta l_k}`, with
    ``K`` the composed log moment generating function, and the noise with it; the profile
    adds that noise as an allowance, entry by entry (see :func:`_rounding_allowance`).

    ``head > 0``: the first ``head`` steps recur with this grid (the fixed groups of
    :func:`steering_epsilon`), their product kept between calls, the value the same.

    ``cuts``: where given and the window was cut for more than :data:`_TAIL_FRACTION` of
    delta, it maps ``(direction, n, spacing)`` of the grid to how far the cuts (or the
    rounding allowance) move the answer (:func:`_cut_move`).

    ``kernel`` (lower bounds only): where given, the lowered masses, their losses, the
    constant and delta go to it for the answer instead (:func:`_batches_lower`).
    ``floors``: see :func:`_invert_by_bisection`.
    """
    grid = _directed(grid, direction)
    n, spacing = grid.n, grid.spacing
    bottoms = _step_bottoms(grid, direction, len(steps), lower)
    thin = None if lower else _thin_of(grid, direction)
    items = [(sigma, q, direction, spacing, bottom, top, thin, count)
             for (sigma, q, count), bottom, top in zip(steps, bottoms, grid.tops[direction])]
    tail = grid.tail
    if mixture is not None:
        parts, tail = _mixture_product(mixture, direction, grid, delta, dtype)
    elif 0 < head < len(steps):
        parts = _joined(_head_product(tuple(items[:head]), grid, dtype, lower), _product(items[head:], grid, dtype, lower))
    else:
        parts = _product(items, grid, dtype, lower)
    composed = np.fft.irfft(parts.spectrum, n)
    # Position k mod n holds composed index k; read the window i_low .. i_low + n - 1.
    # Rounding to float64 from here on is relative, entry by entry: harmless.
    tilted = np.roll(composed, -(grid.i_low % n)).astype(np.float64)
    np.maximum(tilted, 0.0, out=tilted)  # negative rounding noise: covered by the allowance
    losses = (grid.i_low + np.arange(n)) * spacing
    log_untilt = parts.cgf - grid.tilt * losses
    unit = float(np.finfo(dtype).eps) / 2
    noise = _rounding_allowance(n, parts.total_steps, np.exp(parts.log_weight),
                                np.abs(parts.spectrum).astype(np.float64), unit, parts.dead_log_weight,
                                parts.step_error)
    if lower:
        if not parts.cgf > -math.inf:  # a step kept no mass on the window: the dominated pair bounds nothing
            return 0.0, False
        return _lower_read(steps, direction, grid, (tilted, log_untilt, losses, noise), delta, kernel)
    if mixture is None:
        tail = _grid_tail(items, grid, parts)
    constant = -math.expm1(parts.log_finite) + tail
    if constant > delta * (1.0 + 2.0**-20):
        return math.inf, _UNTILTABLE  # what lies at +inf or beyond the window: no precision certifies a point
    found = _invert_profile(tilted, log_untilt, losses, constant, noise, delta, floors=floors)
    if cuts is not None and grid.cut > _TAIL_FRACTION:
        cuts[direction, grid.n, grid.spacing] = _cut_move(found, (tilted, log_untilt, losses, noise), delta)
    return found


#: A window cut for more than :data:`_TAIL_FRACTION` of delta (:func:`_compose_and_invert`)
#: is kept where its cuts and rounding allowance move epsilon by at most this share of it.
_CUT_SHARE = 1e-4


def _lower_read(steps, direction, grid: _Grid, profile: tuple, delta: float, kernel) -> tuple[float, bool]:
    """:func:`_compose_direction`'s answer for a lower bound from ``profile`` (``(tilted,
    log_untilt, losses, noise)``): composed index k is at loss k h plus the steps'
    offsets, rounded down, and what wraps in from below is subtracted. So is what wraps
    in from above (:func:`_wrapped_from_above`): onto the whole window for a ``kernel``
    (an untilted composition read at every loss: :func:`_batches_lower`), else onto the
    losses above a point a little below the answer, the only ones the profile reads
    there. The answer stands where it lies at or above that point: between them, the
    profile less the bound at the point lies above delta, and the exact one with it. The
    point steps down twice where it does not; then the bound is 0."""
    tilted, log_untilt, losses, noise = profile
    offset = _total_offset(steps, direction, grid.spacing)
    labels = losses + offset - 4.0 * _U * (np.abs(losses) + offset)
    below = _below_window(steps, direction, grid)
    if kernel is not None:
        wrapped = below + _wrapped_from_above(steps, direction, grid, grid.i_low)
        return kernel(_lowered_masses(tilted, log_untilt, noise), labels, -wrapped, delta), False
    found = _invert_profile(tilted, log_untilt, labels, -below, noise, delta, lower=True)
    for _ in range(3):
        point = found[0] - 2.0 * grid.spacing
        wrapped = _wrapped_from_above(steps, direction, grid, math.floor((point - offset) / grid.spacing))
        if not wrapped > 0.0:
            return found
        found = _invert_profile(tilted, log_untilt, labels, -(below + wrapped), noise, delta, lower=True)
        if found[0] >= point:
            return found
    return 0.0, found[1]


def _cut_move(found: tuple, profile: tuple, delta: float) -> float:
    r"""How far an upper bound's answer (``found``: it and whether rounding decides it, from
    :func:`_compose_direction`) lies above the answer of the same ``profile`` (``(tilted,
    log_untilt, losses, noise)`` of :func:`_invert_profile`) without its constant (the mass
    the cuts sent to +inf and the bound on what lies beyond the window) and, where
    rounding does not decide it (else it is refined), without its rounding allowance; 0
    for an answer of 0 or inf. On the same bins a cut for a smaller share of delta keeps
    more of the same finite masses, so it could lower the answer by at most that. Where rare large losses set epsilon the profile is flat there (its
    slope is the mass beyond epsilon, each part weighted by :math:`e^{\varepsilon - l}`),
    and a 2^-10 share of delta can move it by far more than that share.

    The allowance counts too: a narrower window takes a larger tilt
    (:func:`_choose_tilt`), whose float64 allowance can hold a flat profile's answer high
    while below the delta / 100 that asks for a refinement (45 pairs at q 1.6e-6 over 226
    steps, delta 1.9e-5: 3.3756e-5 at tilt 55,109; the window cut for 2^-16 of delta,
    at tilt 38,968, gave 3.3606e-5, 0.25% above the rigorous lower bound)."""
    answer, binding = found
    if not 0.0 < answer < math.inf:
        return 0.0
    probe = answer * (1.0 - (_CUT_PROBE_BOUND if binding else _CUT_PROBE))
    kept = _allowance_at(profile, probe) if binding else 0.0  # (the free profile keeps it)
    if _profile_above(profile[:3], probe, delta - kept):  # the free answer lies above the probe
        return answer - probe
    free = _invert_profile(*profile[:3], 0.0, profile[3] if binding else (0.0, 0.0), delta, floors=False)[0]
    return answer - free


#: :func:`_cut_move` first tries whether the answer moved by less than this share of
#: itself (below :data:`_CUT_SHARE`, the least share any reader of the move compares it
#: with) before it inverts the profile again: over 218 ledgers, 306 inversions of that
#: kind took a fifth of the time, and 187 of them had moved by less.
_CUT_PROBE = 2.0**-14

#: ... where rounding decides the answer: the free profile then keeps its rounding
#: allowance, and the move is mostly 0 (q 0.72 over 10^8 steps: 8 of 9 compositions, whose
#: second inversions took 0.5 s of 1.3 s). Far finer, as the answer read may be refined
#: far below itself (a tenth of it or less) while the move is compared with 10^-4 of that.
_CUT_PROBE_BOUND = 2.0**-30


def _allowance_at(profile: tuple, epsilon: float) -> float:
    """The rounding allowance that :func:`_invert_profile` reads ``profile`` (``(tilted,
    log_untilt, losses, noise)``) with on the bin holding ``epsilon``: its lower point's
    (:func:`_allowances`), less 10^-6 of it (read low); 0 below the window."""
    log_untilt, losses, noise = profile[1:]
    k = int(np.searchsorted(losses, epsilon, side="right")) - 1
    if k < 0 or losses.size < 2:
        return 0.0
    decay = float(log_untilt[0] - log_untilt[1])
    value = _allowance_point(noise, log_untilt, decay, k)
    return value * (1.0 - 1e-6) if value == value else 0.0


def _profile_above(profile: tuple, epsilon: float, delta: float) -> bool:
    r"""Whether the profile of the masses in ``profile`` (``(tilted, log_untilt, losses)``
    of :func:`_invert_profile`), :math:`\sum_{l_k > \varepsilon} m_k (1 - e^{\varepsilon -
    l_k})` without constant or allowance, exceeds ``delta`` at ``epsilon``, read low. Each
    term is nonnegative; its gap :math:`\varepsilon - l_k` is moved towards 0 by a bound
    on its rounding, and the rest is computed to a few units of rounding plus ``|x| u``
    for the exponential of an argument ``x`` (Higham 2002, Sec. 4.2 for the sum): at most
    2^-20 of the value in all, as asked, which the value then gives up. The entries
    :func:`_invert_profile` leaves out (their untilting factor too large) count 0. An
    inversion of the same masses whose profile is at or above that one, as an upper
    bound's is, then answers above ``epsilon``: the profile does not increase."""
    tilted, log_untilt, losses = profile
    above = slice(int(np.searchsorted(losses, epsilon, side="right")), losses.size)
    arguments, highs = log_untilt[above], losses[above]
    if arguments.size == 0 or not arguments[0] <= 300.0:  # (non-increasing: the first is the largest)
        return False
    reach = max(float(np.max(np.abs(arguments))), abs(float(highs[-1])), abs(epsilon))
    if not (8.0 * reach + 4.0 * losses.size + 16.0) * _U <= 2.0**-20:
        return False
    gaps = np.minimum((epsilon - highs) + 4.0 * _U * (abs(epsilon) + np.abs(highs)), 0.0)
    with np.errstate(under="ignore"):
        value = float(np.sum(tilted[above] * np.exp(arguments) * -np.expm1(gaps)))
    return value * (1.0 - 2.0**-20) > delta


def _grid_tail(items, grid: _Grid, parts) -> float:
    """The bound on the composed grid distributions' mass at or above the window's top
    that the profile adds (:func:`_compose_direction`).

    Where it comes from the RDP curves (``grid.window_top``), ``grid.tail`` bounds that
    mass for the exact connect-the-dots distributions on every point. The grid's own
    differ from those by a little mass added and some moved up a point
    (:func:`_connect_the_dots`), and where thinned (:func:`_thinned_points`) by a further
    spread, so a Chernoff bound from their own moment generating functions checks it: at
    the transform's tilt, free (``parts.cgf``, raised by 2u per point and step for its
    sums), and where that is above ``grid.tail`` (mostly: the tilt is set for delta, the
    order for the window), at the window's order. Both bound the mass of the
    distributions composed, whatever their points; the larger of ``grid.tail`` and the
    smaller check is used, at least a bound that holds, and it keeps every value where a
    check passes (over 60 random ledgers the second always did; thinned, so did all 118
    compositions of 60 random ledgers and 90 single runs near epsilon's zero)."""
    if grid.window_top is None:
        return grid.tail
    top, order = grid.window_top
    steps = sum(item[-1] for item in items)
    slack = 2.0 * _U * grid.n * steps + 1e-12 * (1.0 + abs(parts.cgf))
    log_check = parts.cgf + slack - grid.tilt * top if grid.tilt > 0 else math.inf
    if log_check <= math.log(grid.tail):
        return grid.tail
    at = np.array([order])
    log_order = slack + sum(count * float(_step_log_mgf((sigma, q), direction, spacing, (bottom, high), thin, at)[0])
                            for sigma, q, direction, spacing, bottom, high, thin, count in items)
    return max(grid.tail, math.exp(min(log_check, log_order - order * top, 0.0)))


class _Product(NamedTuple):
    """The composed (tilted) transform of some steps, up to the frequency where it dies,
    with what the rounding allowance and the profile need of them."""

    spectrum: np.ndarray  # prod_r F_r^{c_r}
    log_weight: np.ndarray  # sum_r (c_r - 1) log|F_r|
    dead_log_weight: float  # bound on log of the weight at frequencies cut off
    log_finite: float  # log of the chance that no step's loss is +inf
    cgf: float  # sum_r c_r log M_r (the tilt's normalisations)
    total_steps: int
    step_error: float | None = None  # entrywise error of the steps' transforms (None: a full FFT's)


def _product(items, grid: _Grid, dtype, lower: bool) -> _Product:
    """:class:`_Product` of the steps in ``items`` (see :func:`_step_prefixes`), transformed
    and summed in chunks of at most :data:`_PRODUCT_BYTES` of prefixes: a lower bound of
    1,024 groups on 2^21 points held 16 GB of them at once. The sums are truncated to the
    shortest prefix seen so far, which gives the same floats as truncating every prefix
    to the shortest one first (each entry sums the same terms in the same order)."""
    log_finite = cgf = 0.0
    total_steps = 0
    dead_log_weight = -math.inf
    sums = None  # log-modulus sum, angle sum, log weight: up to the shortest prefix so far
    per_step = grid.n // 2 + 1
    chunk = max(1, _PRODUCT_BYTES // (per_step * 2 * np.dtype(dtype).itemsize))
    for start in range(0, len(items), chunk):
        part = items[start:start + chunk]
        for item, (prefix, log_beyond, p_inf, log_mgf) in zip(part, _step_prefixes(part, grid.n, grid.tilt, dtype,
                                                                                    lower)):
            count = item[-1]
            if log_beyond > -math.inf:
                dead_log_weight = max(dead_log_weight, (count - 1) * log_beyond)
            log_finite += count * math.log1p(-p_inf) if p_inf < 1 else -math.inf
            cgf += count * log_mgf
            total_steps += count
            # Past the shortest prefix some factor is below e^-_DEAD: the product is zero there.
            if sums is None:
                real = prefix.real.dtype
                sums = (np.zeros(prefix.size, dtype=real), np.zeros(prefix.size, dtype=real), np.zeros(prefix.size))
            alive = min(sums[0].size, prefix.size)
            sums = tuple(array[:alive] for array in sums)
            step = prefix[:alive]
            with np.errstate(divide="ignore"):
                log_modulus = np.log(np.abs(step))
            sums[0][:] += count * log_modulus
            sums[1][:] += _reduced_angles(step.real, step.imag, count)
            if count > 1:  # (one step adds no power's weight: 0 * log 0 would be NaN where it vanishes)
                sums[2][:] += (count - 1) * log_modulus.astype(np.float64)
    log_modulus_sum, angle_sum, log_weight = sums
    return _Product(_polar(log_modulus_sum, angle_sum), log_weight, dead_log_weight, log_finite, cgf, total_steps)


#: :func:`_product` transforms its steps in chunks of at most this many bytes of spectra.
_PRODUCT_BYTES = 2**30


def _reduced_angles(real: np.ndarray, imag: np.ndarray, counts) -> np.ndarray:
    """``counts * angle(real + i imag)`` reduced to within pi of 0, as an angle mod 2 pi:
    ``arctan2``, within a few unit round-offs of the exact angle (the allowance counts 8,
    see :func:`_rounding_allowance`; the angle of 0 is 0, and its modulus makes the
    product zero; measured within 3.1 units over 2*10^7 random points against extended
    precision, where the quotient's arctangent plus pi reached 10), times the counts and
    reduced where one is above 1. (That quotient's masked addition alone took longer than
    ``arctan2``: 30% more time for the mixing of 100 rows.)"""
    angle = np.arctan2(imag, real)
    if not np.all(counts == 1):
        angle *= counts
        two_pi = _two_pi(angle.dtype)
        angle -= two_pi * np.rint(angle / two_pi)
    return angle


def _two_pi(dtype) -> np.floating:
    """2 pi to the precision of ``dtype``. In extended precision float64's 2 pi, 2.4e-16
    short, would turn each reduced angle by that many times the turns taken off, far
    beyond the allowance's few extended round-offs (an extended transform of 32 steps at
    sigma 0.02, q 0.11 then erred by 1.2 times its allowance)."""
    return 8.0 * np.arctan(np.ones((), dtype=dtype))


def _joined(first: _Product, second: _Product) -> _Product:
    """The product of the steps of both, as :func:`_product` of all of them in order would
    compute it: past the shorter spectrum one factor is dead, so the product is too."""
    alive = min(first.spectrum.size, second.spectrum.size)
    return _Product(first.spectrum[:alive] * second.spectrum[:alive],
                    first.log_weight[:alive] + second.log_weight[:alive],
                    max(first.dead_log_weight, second.dead_log_weight), first.log_finite + second.log_finite,
                    first.cgf + second.cgf, first.total_steps + second.total_steps)


_head_cache: dict = {}  # (items, grid id, dtype, lower) -> (grid, _Product); 8 at most


def _head_product(items: tuple, grid: _Grid, dtype, lower: bool) -> _Product:
    """:func:`_product`, kept for the last few (items, grid) asked."""
    key = (items, id(grid), np.dtype(dtype).str, lower)
    with _prefix_lock:
        hit = _head_cache.get(key)
    if hit is not None and hit[0] is grid:
        return hit[1]
    product = _product(list(items), grid, dtype, lower)
    with _prefix_lock:
        _head_cache[key] = (grid, product)
        while len(_head_cache) > 8:
            _head_cache.pop(next(iter(_head_cache)))
    return product


# --- mixture groups: many pairs in few transforms (see :mod:`.mixture`) --------------


def _mixture_product(groups, direction, grid: _Grid, delta: float, dtype) -> tuple[_Product, float]:
    """:class:`_Product` of the rows of mixture ``groups``, and a certified bound on their
    composed mass at or beyond the window's top (it stands in for ``grid.tail``, which
    was certified for the groups' corners).

    Each anchor is discretised like a step (connect-the-dots, ends by :func:`_tail_ends`
    with the steps of every group using it) and transformed once
    (:func:`_group_spectra`); a row's distribution is the mixture of its anchors' with the
    row's weights, so its tilted transform is the mixture of theirs (:func:`_mixed_rows`)
    and its mass at +inf too.
    """
    grid = _directed(grid, direction)
    spacing, n = grid.spacing, grid.n
    ends = _anchor_ends(groups, direction, grid, delta)
    thin = grid.thin[direction] if grid.thin else _anchor_thin(tuple(g.corner for g in groups), direction, delta)
    distribution = _anchor_distributions(direction, spacing, ends, thin)  # (thin: the tail's bound is its own)
    spectra, alive = _group_spectra(groups, ends, direction, grid, dtype, (distribution, thin))
    real = np.empty(0, dtype=dtype).real.dtype
    sums = [np.zeros(alive, dtype=real), np.zeros(alive, dtype=real), np.zeros(alive)]
    cgf = log_finite = cgf_size = 0.0
    dead_log_weight = -math.inf if alive == n // 2 + 1 else 0.0
    keys, rows = _group_rows(groups, spectra, alive)
    for group, (_, _, dead, _, _), row in zip(groups, spectra, rows):
        for total, part in zip(sums, row[:3]):
            total += part
        cgf, cgf_size, log_finite = (a + b for a, b in zip((cgf, cgf_size, log_finite), row[3:]))
        if alive < n // 2 + 1:
            # Past ``alive`` every row's modulus is at most the bound (a mixture of the anchors').
            with np.errstate(divide="ignore"):
                beyond = (sum(group.counts) - len(group.counts)) * math.log(dead.at(alive))
                dead_log_weight = min(dead_log_weight, beyond)
    _cache_put(keys, rows)
    total = sum(sum(group.counts) for group in groups)
    top = (grid.i_low + n) * spacing
    # Chernoff at the tilt: the rows' normalisations are their moment generating
    # functions there, each a sum of positive terms (each logarithm raised by 1e-12 of
    # one plus its size, far more than its rounding).
    tail = math.exp(min(cgf + 1e-12 * cgf_size - grid.tilt * top, 0.0)) if grid.tilt > 0 else 1.0
    if tail > grid.tail:
        tail = min(tail, _cached_mixture_tail(groups, (direction, thin), ends, distribution, spacing, top))
    # The anchors' transforms err by at most ``transform`` each (an FFT's, or the block
    # moments' of :mod:`.lowfreq`); mixing adds at most 8 units to each entry (four
    # products and sums, weights summing to 1), its logarithm and angle 8 more; summing
    # the rows' logarithms (at most 745 in all where the product is not zero) and their
    # angles (each within pi of 0) pairwise, then the groups', adds at most what the last
    # term spreads over the steps.
    unit = float(np.finfo(dtype).eps) / 2
    transform = max(entry[4] for entry in spectra)
    count = sum(len(group.counts) for group in groups)
    summing = (745.0 + 2.0 * math.pi * count) * math.log2(count + len(groups) + 1) * unit / max(total, 1)
    spectrum, log_weight, dead_log_weight = _beyond_combined_end(_polar(sums[0], sums[1]), sums[2], dead_log_weight,
                                                                 groups, spectra, n)
    product = _Product(spectrum, log_weight, dead_log_weight, log_finite, cgf, total,
                       transform + 16.0 * unit + summing)
    return product, tail


def _group_rows(groups, spectra: list, alive: int) -> tuple[list, list]:
    """``(keys, rows)`` for :func:`_mixture_product`: each group's :func:`_mixed_rows` on the
    first ``alive`` frequencies, taken from the cache where a ledger grown by a step left
    them (under ``keys``: the rows depend on the group's weights and counts, which its
    transforms' key omits), the others computed (:func:`_spread`)."""
    keys = [("rows", key, alive, group.counts, group.weights.tobytes())
            for group, (key, _, _, _, _) in zip(groups, spectra)]
    with _prefix_lock:
        rows = [_prefix_cache.pop(key, None) for key in keys]
    missing = [index for index, row in enumerate(rows) if row is None]
    for index, row in zip(missing, _spread(lambda i: _mixed_rows(groups[i], spectra[i][3], spectra[i][1], alive),
                                           missing)):
        rows[index] = row
    return keys, rows


@functools.lru_cache(maxsize=16)
def _anchor_thin(corners: tuple, direction: str, delta: float) -> float:
    """:func:`_thin_tilt` of mixture groups' ``corners`` (each dominates its group's rows),
    or of the steps an RDP-sized grid composes (:func:`_rdp_thin`)."""
    return _thin_tilt(corners, direction, _THIN_LAMBDAS, delta)


#: The lambdas :func:`_anchor_thin` searches.
_THIN_LAMBDAS = np.geomspace(1e-3, 1e5, 65)


def _anchor_distributions(direction: str, spacing: float, ends: dict, thin: float | None):
    """A function giving each anchor's grid distribution (:func:`_step_distribution` on its
    ``ends``), each computed once: the transforms and the tail bound may both need it."""
    distributions: dict = {}

    def distribution(anchor: tuple):
        if anchor not in distributions:
            distributions[anchor] = _step_distribution(*anchor, direction, spacing, *ends[anchor], thin=thin)
        return distributions[anchor]
    return distribution


def _beyond_combined_end(spectrum: np.ndarray, log_weight: np.ndarray, dead_log_weight: float, groups,
                         spectra: list, n: int) -> tuple:
    r"""A mixture product's ``(spectrum, log_weight, dead_log_weight)``, where it is cut at
    the groups' combined end (:func:`_combined_end`, before any group's own), carried on
    over the whole half-spectrum: the spectrum is 0 there (below e^-_DEAD), and the
    weight, the product over the rows of :math:`|F_r|^{c_r - 1}`, at most
    :math:`\prod_g b_g(k)^{N_g - R_g}` from frequency ``k`` on (group ``g``'s
    :class:`~.lowfreq.DeadBound`, ``N_g`` steps in ``R_g`` rows), taken at the start of
    each segment of a quarter octave. The weight enters the rounding allowance at every
    frequency: one bound for all past the end, a group's own at the end, is near 1 where
    no group dies alone (a schedule that changes at every step), and over thousands of
    frequencies it added a part in 10^4 to epsilon."""
    alive, half = spectrum.size, n // 2 + 1
    if alive == half or alive >= min(dead.end for _, _, dead, _, _ in spectra):
        return spectrum, log_weight, dead_log_weight  # (cut where a group dies alone: its bound)
    starts = sorted({min(int(alive * 2.0 ** (j / 4.0)), half) for j in range(4 * int(math.log2(half / alive)) + 5)})
    starts = [start for start in starts if start < half] + [half]
    exponents = [sum(group.counts) - len(group.counts) for group in groups]
    with np.errstate(divide="ignore"):
        levels = [math.fsum(e * math.log(dead.at(start)) for e, (_, _, dead, _, _) in zip(exponents, spectra))
                  for start in starts[:-1]]
    lengths = np.diff(starts)
    return (np.concatenate([spectrum, np.zeros(half - alive, dtype=spectrum.dtype)]),
            np.concatenate([log_weight, np.repeat(np.array(levels, dtype=log_weight.dtype), lengths)]), -math.inf)


#: :func:`_anchor_ends` rounds the corners' highest top up to a multiple of this many bins.
_ANCHOR_SNAP = 64


def _anchor_ends(groups, direction: str, grid: _Grid, delta: float) -> dict:
    """Each anchor's lowest and highest grid index (:func:`_tail_ends`), its mass beyond
    them budgeted over the steps of every group that uses it, and its top no higher than
    the highest of the groups' corners on ``grid`` (their mass above goes to +inf),
    rounded up to :data:`_ANCHOR_SNAP` bins above the window's bottom: that highest top is
    a corner's cut, which moves with its count, and every anchor reaching it changed its
    support (and its cached transform) whenever a ledger grew by a step (at q 1e-4 most of
    the 0.9 s one more step cost after 10^4 pairs, 0.15 s now).

    The grid's window and tilt are certified for the corners' distributions (the tilt
    capped so that what wraps around the window stays far below delta). Each group's
    heaviest anchor is its corner, but cut with this smaller budget its top reached the
    window's: two such losses together wrap around, magnified by the untilting factor
    ``e^{tilt * width}`` (e^45 for 129 pairs at q 2.1e-5, whose epsilon came out at 0.263
    where 128 and 130 pairs give 0.0034 and 0.0037). Mass moved to +inf is counted in
    full (:func:`_mixture_product`), so the cut is sound at any height. ``grid`` as
    ``direction`` reads it (:func:`_directed`), as :func:`_mixture_product` passes it."""
    uses: dict[tuple[float, float], int] = {}
    for group in groups:
        for anchor in group.anchors:
            uses[anchor] = uses.get(anchor, 0) + group.corner[2]
    highest = max(grid.tops[direction]) if grid.tops and grid.tops.get(direction) else grid.i_low + grid.n - 1
    highest = min(grid.i_low + _ANCHOR_SNAP * -(-(highest - grid.i_low) // _ANCHOR_SNAP), grid.i_low + grid.n - 1)
    bottoms, tops = _tail_ends(tuple((sigma, q, count) for (sigma, q), count in uses.items()), grid.spacing,
                               _lowest_kept(grid, highest), highest, _TAIL_FRACTION * delta)
    return dict(zip(uses, zip(bottoms[direction], tops[direction])))


def _mixed_rows(group, parts: list, prefixes, alive: int) -> tuple:
    """A group's rows on the first ``alive`` frequencies of ``prefixes`` (the anchors'
    transforms: an array, or :class:`_SharedRows`):
    the sums over its rows of ``count * log|F|``, of ``count * angle F`` mod 2 pi and of
    ``(count - 1) * log|F|`` (as :func:`_product` forms them), and its terms of the
    composed log normalisation, of its rounding margin and of the log chance of finite
    losses. ``parts`` holds the anchors' ``(p_inf, log_mgf)`` of :func:`_tilted`. Row
    ``r`` mixes the anchors' finite masses with its weights ``w_c``, so its tilted
    transform mixes theirs with ``w_c M_c / sum_c w_c M_c`` (no BLAS call: see :mod:`.lowfreq`).

    Rows of equal count are multiplied first (:func:`_row_products`), and only their
    product's logarithm and angle are taken, once per count: a complex product costs a
    fifth of a logarithm and an angle in extended precision (6.5 against 100 ns), and
    errs by less. The frequencies are taken in blocks of about :data:`_MIX_BLOCK` entries
    (frequencies times rows), whose temporaries stay in the caches."""
    with np.errstate(divide="ignore"):
        log_terms = np.log(group.weights) + np.array([log_mgf for _, log_mgf in parts])
    peak = log_terms.max(axis=1, keepdims=True)
    log_norms = peak[:, 0] + np.log(np.exp(log_terms - peak).sum(axis=1))
    dtype = _anchor_block(prefixes, slice(0, 0)).dtype
    counts = np.array(group.counts, dtype=float)
    order = np.argsort(counts, kind="stable")
    distinct, starts = np.unique(counts[order], return_index=True)
    shares = np.exp(log_terms - log_norms[:, None])[order].astype(dtype)  # rows by anchors, equal counts together
    real = np.empty(0, dtype=dtype).real.dtype
    sums = (np.empty(alive, dtype=real), np.empty(alive, dtype=real), np.empty(alive))
    block = max(256, _MIX_BLOCK // len(counts))
    for start in range(0, alive, block):
        part = slice(start, min(start + block, alive))
        rows = np.einsum("ca,rc->ra", _anchor_block(prefixes, part), shares)  # at most four anchors
        log_modulus, angle = _row_products(rows, starts, distinct)
        (log_modulus * distinct[:, None].astype(real)).sum(axis=0, out=sums[0][part])
        angle.sum(axis=0, out=sums[1][part])
        (log_modulus.astype(np.float64) * (distinct - 1.0)[:, None]).sum(axis=0, out=sums[2][part])
    p_inf = group.weights @ np.array([p_inf for p_inf, _ in parts])
    return (*sums, float(counts @ log_norms), float(counts @ (1.0 + np.abs(log_norms))),
            float(counts @ np.log1p(-np.minimum(p_inf, 1.0))))


def _row_products(rows: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""``(log_modulus, angle)``, by count: ``log|P|`` and ``count * angle P`` mod 2 pi
    (:func:`_reduced_angles`) of the product ``P`` of the rows (frequencies along the second
    axis) from ``starts[j]`` to the next start, all of count ``counts[j]``.

    **Rounding.** A row is within 8 units of 1 of its exact mixture; a complex product
    errs by at most :math:`\sqrt 5` units of its modulus (Brent, Percival & Zimmermann 2007,
    "Error bounds on complex floating-point multiplication"), so the ``N`` rows' product by
    at most :math:`\sqrt 5 (N - 1)` units (every modulus is at most 1: no partial product is
    smaller than the whole), and its logarithm and angle by 8 more. Raised to the count
    ``c`` that is :math:`c (\sqrt 5 (N - 1) + 8) \le 8 c N` units: within the 8 per step
    that :func:`_rounding_allowance` counts for each row's own logarithm and angle. That
    needs normal partial products: where a product falls within 2^64 of the smallest
    normal number (a mixture that cancels, far below what the composition can read), its
    rows' logarithms and angles are summed instead, one by one."""
    tiny = np.finfo(rows.real.dtype).tiny * 2.0**64
    log_modulus = np.empty((counts.size, rows.shape[1]), dtype=rows.real.dtype)
    angle = np.empty_like(log_modulus)
    for j, (first, last) in enumerate(zip(starts, [*starts[1:], rows.shape[0]])):
        product = np.multiply.reduce(rows[first:last], axis=0)
        log_modulus[j] = _log_modulus(product.real, product.imag)
        angle[j] = _reduced_angles(product.real, product.imag, counts[j])
        small = np.flatnonzero(np.maximum(np.abs(product.real), np.abs(product.imag)) < tiny)
        if small.size:
            each = rows[first:last, small]
            log_modulus[j, small] = _log_modulus(each.real, each.imag).sum(axis=0)
            angle[j, small] = _reduced_angles(each.real, each.imag, counts[j]).sum(axis=0)
    return log_modulus, angle


def _log_modulus(real: np.ndarray, imag: np.ndarray) -> np.ndarray:
    """``log|real + i imag|`` as half the logarithm of the sum of squares, within a unit
    round-off of ``log(hypot(real, imag))`` (the squares and their sum are within two of
    the squared modulus, halved by the logarithm) at a tenth of its time in float64 (127
    rows on 1032 frequencies: 0.14 ms against 1.4 ms); ``hypot`` where that sum is below
    :data:`_SQUARES_FLOOR`, near the subnormals, where a square loses its relative precision."""
    squares = real * real
    squares += imag * imag
    with np.errstate(divide="ignore"):
        out = np.log(squares)
        out *= 0.5
        small = squares < _SQUARES_FLOOR
        if small.any():
            out[small] = np.log(np.hypot(real[small], imag[small]))
    return out


#: Sums of squares below this are not used by :func:`_log_modulus` (2^62 above float64's
#: smallest normal number: what a square loses below it stays far under a unit round-off).
_SQUARES_FLOOR = 2.0**-960


#: Entries (frequencies times rows) :func:`_mixed_rows` mixes at a time.
_MIX_BLOCK = 2**17


def _group_spectra(groups, ends: dict, direction: str, grid: _Grid, dtype, anchors: tuple) -> tuple[list, int]:
    """``(entries, alive)``: per group ``(key, transforms, dead, parts, error)``, its cache
    key, its anchors' transforms up to at least ``alive``, its
    :class:`~.lowfreq.DeadBound`, per anchor ``(p_inf, log_mgf)`` of :func:`_tilted` and
    the transforms' entrywise error bound; and ``alive``, the first frequency past which
    the composed transform is dead. ``ends`` maps each anchor to its lowest and highest
    grid index; ``anchors``: ``(distribution, thin)``, what gives its distribution there
    and the tilt those are thinned for (:func:`_thinned_points`).

    A row's modulus is at most its anchors' largest (a mixture with weights summing to
    1), so the group's ``N`` steps compose to a modulus at most ``bound^N``: past the
    first frequency where that is at most e^-_DEAD for one group, the composed transform
    is zero. Where the anchors are narrow, that frequency is certified from coarse
    samples and the anchors are summed directly up to the smallest over the groups
    (:mod:`.lowfreq`), else each group's anchors are transformed in full. Groups are
    cached like steps (:func:`_step_prefixes`): a ledger grown by a step usually changes
    one group, whose transforms alone are computed again.
    """
    distribution, thin = anchors
    keys = []
    for group in groups:
        supports = tuple(_support(sigma, q, direction, grid.spacing, *ends[(sigma, q)]) for sigma, q in group.anchors)
        keys.append(("mixture", group.anchors, group.corner[2], direction, grid.spacing, supports, grid.n,
                      grid.tilt, np.dtype(dtype).str, thin))
    with _prefix_lock:
        out = [_prefix_cache.pop(key, None) for key in keys]
    tilted: dict = {}

    def anchor(key):
        if key not in tilted:
            tilted[key] = _tilted(*distribution(key), grid.spacing, grid.tilt)
        return tilted[key]

    missing = [index for index, entry in enumerate(out) if entry is None]
    sampled = _sampled_groups([groups[index] for index in missing], anchor, grid.n, dtype)
    if sampled is None:
        _fft_groups(out, [(index, groups[index]) for index in missing], anchor, grid, dtype)
    else:
        for index, dead in zip(missing, sampled):
            out[index] = (np.empty((len(groups[index].anchors), 0), dtype=np.complex128), dead, None, 0.0)
    alive = _combined_end([entry[1] for entry in out], [group.corner[2] for group in groups], grid.n)
    short = [(index, groups[index]) for index, entry in enumerate(out) if entry[0].shape[1] < alive]
    if short:
        _low_groups(out, short, anchor, grid, dtype, alive)
        alive = _combined_end([entry[1] for entry in out], [group.corner[2] for group in groups], grid.n)
    _cache_put(keys, out)
    return [(key, *entry) for key, entry in zip(keys, out)], alive


def _combined_end(deads: list, counts: list, n: int) -> int:
    r"""The first frequency past which the groups' composed transform is dead: where one
    group is (the smallest of their :class:`~.lowfreq.DeadBound` ends), or earlier, where
    together they are: every row of group ``g`` has modulus at most ``b_g`` from there on
    (:meth:`~.lowfreq.DeadBound.at`), so the product of all ``N_g`` steps of every group
    at most :math:`\prod_g b_g^{N_g} \le e^{-\_DEAD}`, zero in float64. A schedule that
    changes at every step puts a hundred or so steps in each group: none dies alone (at
    q 0.01 a step's modulus stays near 1 for long), all of them together soon do."""
    end = min(dead.end for dead in deads)

    def log_product(k: int) -> float:
        return math.fsum(count * math.log(dead.at(k)) for dead, count in zip(deads, counts))

    if end <= 1 or not log_product(end - 1) <= -_DEAD:
        return end
    low, high = 0, end - 1  # dead from ``high`` on, not (yet) known at ``low``
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if log_product(middle) <= -_DEAD else (middle, high)
    return high


def _low_groups(out: list, short: list, anchor, grid: _Grid, dtype, alive: int) -> None:
    """Fill ``out[index]`` of :func:`_group_spectra` for ``(index, group)`` pairs whose
    transforms are needed up to ``alive``: by block moments (:func:`~.lowfreq.low_transform`)
    where that is cheaper, the group that ends at ``alive`` sharpened on them
    (:func:`~.lowfreq.refined`), else by full FFTs."""
    unique = list(dict.fromkeys(key for _, group in short for key in group.anchors))
    rows = [anchor(key)[:2] for key in unique]
    # A quarter more than needed, so that a ledger grown by a step (whose smallest group
    # may live a frequency longer) finds the other groups' transforms long enough.
    size = min(alive + alive // 4 + 16, grid.n // 2 + 1)
    if not lowfreq.direct_pays(rows, grid.n, size):
        _fft_groups(out, short, anchor, grid, dtype)
        return
    spectra, error = lowfreq.low_transform(rows, grid.n, size)
    for index, group in short:
        transforms = spectra[[unique.index(key) for key in group.anchors]]
        # sharpened on them: the samples' slack may have moved its end up, and the
        # groups together may die earlier on the sharper bounds (:func:`_combined_end`)
        dead = lowfreq.refined(out[index][1], transforms, group.corner[2], _DEAD, error)
        out[index] = (transforms, dead, _anchor_parts(group, anchor), error)


def _anchor_parts(group, anchor) -> list:
    """Per anchor of ``group``, ``(p_inf, log_mgf)`` of its tilted distribution."""
    return [anchor(key)[2:] for key in group.anchors]


def _sampled_groups(missing: list, anchor, n: int, dtype) -> list | None:
    """The :class:`~.lowfreq.DeadBound` of each group in ``missing`` from coarse samples
    (:func:`~.lowfreq.sampled_bounds`), or None where that cannot gain on full FFTs (or
    the transforms are in extended precision)."""
    if not missing or np.dtype(dtype) != np.float64:
        return None
    unique = list(dict.fromkeys(key for group in missing for key in group.anchors))
    return lowfreq.sampled_bounds([anchor(key)[:2] for key in unique],
                                  [tuple(unique.index(key) for key in group.anchors) for group in missing],
                                  [group.corner[2] for group in missing], n, _DEAD)


def _fft_groups(out: list, missing: list, anchor, grid: _Grid, dtype) -> None:
    """Fill ``out[index]`` of :func:`_group_spectra` for ``(index, group)`` pairs by full
    transforms of as many anchors at once as a batch holds, an anchor shared by groups of
    a batch once (``anchor`` gives an anchor's tilted distribution)."""
    n, rows = grid.n, max(4, _BATCH_POINTS // (grid.n * np.dtype(dtype).itemsize // 8))
    error = 4.0 * float(np.finfo(dtype).eps) / 2 * math.log2(n)
    batch: list = []
    for position, (index, group) in enumerate(missing):
        batch.append((index, group))
        unique = list(dict.fromkeys(key for _, g in batch for key in g.anchors))
        if position + 1 < len(missing) and len(unique) + len(missing[position + 1][1].anchors) <= rows:
            continue
        spectra = _placed_transform([anchor(key)[:2] for key in unique], n, dtype, fresh=True)
        spectra.setflags(write=False)
        moduli = np.abs(spectra)  # once per anchor, though groups share anchors
        for index, group in batch:
            members = [unique.index(key) for key in group.anchors]
            transforms, dead = _dead_prefix(spectra, members, group.corner[2], moduli)
            out[index] = (transforms, dead, _anchor_parts(group, anchor), error)
        batch = []


def _dead_prefix(spectra: np.ndarray, rows: list, steps: int, moduli: np.ndarray) -> tuple:
    """For :func:`_group_spectra`: the transforms in ``rows`` of ``spectra`` (a group's
    anchors, whole half-spectra of one batch; ``moduli`` their moduli) up to the cut, and
    their :class:`~.lowfreq.DeadBound`: :func:`~.lowfreq.refined` from the bound that
    holds everywhere (moduli at most 1), so both routes cut the same way (the whole
    spectrum is kept where nothing certifies). A short prefix is copied; a long one
    shares the batch (:class:`_SharedRows`)."""
    size = spectra.shape[1]
    everywhere = lowfreq.DeadBound(size, np.full(1, 1.0 + 1e-9), size)
    largest = functools.reduce(np.maximum, (moduli[row] for row in rows))
    dead = lowfreq.refined(everywhere, None, steps, _DEAD, 0.0, modulus=largest)
    if 2 * dead.end <= size:
        return spectra[rows, :dead.end], dead
    return _SharedRows(spectra[:, :dead.end], tuple(rows)), dead


class _SharedRows(NamedTuple):
    """A group's anchors' transforms as the rows ``rows`` of ``source``, one batch of
    :func:`_fft_groups`, which the groups of the batch share rather than each copy its
    own: at small q nothing dies early, and the copies (16 MB a group at 2^19 points,
    page faults mostly) took a quarter of the time of 2,000 one-step pairs at q 1e-4
    to 1e-5, and a fifth of the memory kept after the call."""

    source: np.ndarray
    rows: tuple

    @property
    def shape(self) -> tuple:
        return len(self.rows), self.source.shape[1]

    @property
    def nbytes(self) -> int:  # (counted by every group sharing it: the cache only evicts early)
        return self.source.nbytes


def _anchor_block(prefixes, part: slice) -> np.ndarray:
    """The anchors' transforms ``prefixes`` (an array, or :class:`_SharedRows`) on the
    frequencies ``part``, as an array of anchors by frequencies."""
    if isinstance(prefixes, _SharedRows):
        return prefixes.source[list(prefixes.rows), part]
    return prefixes[:, part]


#: Exponents of the Chernoff certificate of :func:`_mixture_tail` (narrow distributions
#: need large ones).
_TAIL_LAMBDAS = np.geomspace(1e-3, 1e9, 49)


def _cached_mixture_tail(groups, direction: tuple, ends: dict, distribution, spacing: float, top: float) -> float:
    """:func:`_mixture_tail` of the groups' anchors on their grid ``ends`` (``distribution``
    gives an anchor's; ``direction``: with the tilt its distributions are thinned for,
    which tells them apart), kept for the last few asked: it depends on neither the tilt nor
    the precision, which :func:`_refined` varies on one grid (at 2^19 points, 0.4 s a
    time for 21 groups)."""
    key = (direction, spacing, top, tuple((group.anchors, group.counts, group.weights.tobytes()) for group in groups),
           tuple(sorted(ends.items())))
    with _prefix_lock:
        hit = _tail_cache.pop(key, None)
    if hit is None:
        anchors = [anchor for group in groups for anchor in group.anchors]

        def log_mgfs(lambdas: np.ndarray) -> list:
            return [_step_log_mgf(anchor, direction[0], spacing, ends[anchor], direction[1], lambdas,
                                  functools.partial(distribution, anchor)) for anchor in anchors]
        hit = _mixture_tail(groups, log_mgfs, top)
    return _kept(_tail_cache, key, hit, 8)


_tail_cache: dict = {}  # see :func:`_cached_mixture_tail`; 8 at most, least recently used first


def _mixture_tail(groups, log_mgfs, top: float) -> float:
    r"""A bound on the composed mass of the mixture rows at or beyond ``top``:
    :math:`\min_\lambda e^{-\lambda\,top} \prod_r M_r(\lambda)^{n_r}`, each row's moment
    generating function the mixture of its anchors' (exact on the grid, rounded up:
    ``log_mgfs(lambdas)`` gives every anchor's, by :func:`_log_mgf`, in the groups' order).

    The exponent is convex in lambda (a sum of log moment generating functions less a
    linear term), so along :data:`_TAIL_LAMBDAS` it falls, then rises: every fourth
    lambda first, then the three on each side of the smallest, find the same minimum
    at two fifths of the cost (any lambda gives a sound bound)."""
    def exponents(lambdas: np.ndarray) -> np.ndarray:
        anchor_log_mgfs = log_mgfs(lambdas)
        cgf, start = np.zeros(lambdas.size), 0
        for group in groups:
            anchors = np.array(anchor_log_mgfs[start:start + len(group.anchors)])
            start += len(group.anchors)
            with np.errstate(divide="ignore"):
                terms = np.log(group.weights)[:, :, None] + anchors[None, :, :]
            peak = np.max(terms, axis=1)
            rows = peak + np.log(np.exp(terms - peak[:, None, :]).sum(axis=1))
            cgf = cgf + np.array(group.counts, dtype=float) @ rows
        exponent = cgf - lambdas * top
        return exponent + 1e-12 * (1.0 + np.abs(exponent))

    coarse = exponents(_TAIL_LAMBDAS[::4])
    middle = 4 * int(np.argmin(coarse))
    near = [i for i in range(max(middle - 3, 0), min(middle + 4, _TAIL_LAMBDAS.size)) if i % 4]
    best = min(float(coarse.min()), float(exponents(_TAIL_LAMBDAS[near]).min()) if near else math.inf)
    return math.exp(min(best, 0.0))


def _step_bottoms(grid: _Grid, direction: str, count: int, lower: bool = True) -> tuple:
    """Each of ``count`` steps' lowest index on ``grid`` (as ``direction`` reads it,
    :func:`_directed`). The upper bound's: the grid's own (``bottoms``), else the
    window's bottom. The lower bound's (a dominated step keeps no mass below it): the
    window's bottom where that is at or below 0; else, where the window lies far above 0
    (a direction's own, :func:`_narrow_grid`) and a step's losses below it, as low as
    keeps its support shorter than the window (the composition is circular, and what the
    composed loss puts below the window :func:`_below_window` bounds)."""
    if not lower:
        return grid.bottoms[direction] if grid.bottoms else (grid.i_low,) * count
    if not grid.tops or not grid.tops.get(direction):
        return (grid.i_low,) * count
    return tuple(_lowest_kept(grid, top) for top in grid.tops[direction])


def _lowest_kept(grid: _Grid, top: int) -> int:
    """The lowest index a step or anchor of highest index ``top`` keeps on ``grid`` (as
    its direction reads it): the window's bottom where that is at or below 0; where the
    window starts far above 0 (a direction's own, :func:`_narrow_grid`), as low as keeps
    the support shorter than the window, as a corner's is (the composition is circular)."""
    return grid.i_low if grid.i_low <= 0 else top - grid.n + 2


def _below_window(steps, direction, grid: _Grid) -> float:
    """For lower bounds: a Chernoff bound on the composed optimistic mass below the window.

    That mass (at most ``(i_low - 1) h`` on the lattice) wraps to the window's top, where
    it would raise delta: the lower bound subtracts this bound on it, from the exact
    moment generating function of the grid distributions composed (:func:`_window_log_mgf`).
    ``grid`` as ``direction`` reads it (:func:`_directed`), as :func:`_compose_direction`
    passes it.
    """
    lambdas = np.geomspace(1e-3, 1e9, 61)  # narrow loss distributions need large lambdas
    log_down = _window_log_mgf(steps, direction, grid, -lambdas)
    return math.exp(min(float((log_down + lambdas * (grid.i_low - 1) * grid.spacing).min()), 0.0))


def _wrapped_from_above(steps, direction, grid: _Grid, lowest: int) -> float:
    r"""For lower bounds: a bound on the untilted mass that wraps around from above the
    window onto its indices ``lowest`` and up (:func:`_lower_read`).

    Composed index :math:`K` at or beyond the window's top lands at :math:`K - jn`, and
    undoing the tilt :math:`\theta` weighs it :math:`e^{\theta j n h}` times: onto an
    index :math:`k \ge` ``lowest`` that is at most :math:`e^{\theta (K - \text{lowest}) h}`,
    and only :math:`K \ge \text{lowest} + n` land there. For any
    :math:`\lambda \ge \theta`, :math:`e^{\theta (K - l) h}\,1\{K \ge l + n\} \le
    e^{\lambda (K - l) h - (\lambda - \theta) n h}`, so the mass is at most
    :math:`\min_\lambda \mathbb E[e^{\lambda K h}]\, e^{-\lambda\, l h - (\lambda - \theta) n h}`,
    from the exact moment generating function of the grid distributions composed."""
    tilt = grid.tilt
    lambdas = tilt * 2.0 ** np.arange(0.0, 16.25, 0.25) if tilt > 0 else np.geomspace(1e-3, 1e9, 61)
    log_up = _window_log_mgf(steps, direction, grid, lambdas)
    exponents = log_up - lambdas * lowest * grid.spacing - (lambdas - tilt) * grid.n * grid.spacing
    return math.exp(min(float(exponents.min()), 700.0))  # not capped at 1: the untilting magnifies it


def _window_log_mgf(steps, direction, grid: _Grid, lambdas: np.ndarray) -> np.ndarray:
    """An upper bound on the log moment generating function, at ``lambdas``, of the
    composed grid index (times the spacing) of the dominated steps a lower bound composes
    (:func:`_log_mgf` of each, by their counts)."""
    log_mgf = np.zeros_like(lambdas)
    bottoms = _step_bottoms(grid, direction, len(steps))
    for (sigma, q, count), bottom, top in zip(steps, bottoms, grid.tops[direction]):
        first, masses, _ = _step_distribution(sigma, q, direction, grid.spacing, bottom, top, True)
        log_mgf = log_mgf + count * _log_mgf(first, masses, grid.spacing, lambdas)
    return log_mgf


def _rounding_allowance(n: int, total_steps: int, weight: np.ndarray, modulus: np.ndarray, unit: float,
                        dead_log_weight: float = -math.inf, step_error: float | None = None) -> tuple[float, float]:
    r"""Bounds on the floating-point error of the composed (tilted) distribution:
    ``(entry, norm)``, one on each entry's error and one on the Euclidean norm of the
    vector of errors.

    A radix-2 transform of a probability vector is accurate entrywise to about
    :math:`u \log_2 n` (Higham 2002, Sec. 24.1). Raising entry :math:`F_\omega` of the
    transform to the power ``T`` multiplies its error by at most
    :math:`T |F_\omega|^{T-1}`, which is only large at the few low frequencies where
    :math:`|F_\omega| \approx 1`, so frequency :math:`\omega` of the product errs by at most
    :math:`b_\omega = 4 u \log_2 n\, T \prod_r |F_{r,\omega}|^{c_r - 1}`, and the inverse
    transform adds its own :math:`4 u \log_2 n` relative to what it transforms. Each
    entry receives at most the average of the frequencies' errors:

    .. math::
        \text{entry} = \tfrac{1}{n} \textstyle\sum_\omega \big(b_\omega + 4 u \log_2 n\,
            |F_\omega|\big) + 10^{-290},

    the last term covering entries lost to underflow. By Parseval's identity the inverse
    transform divides Euclidean norms by :math:`\sqrt n`, and the inverse transform's own
    error is bounded in that norm (Higham 2002, Thm. 24.2), so

    .. math::
        \text{norm} = \big(\lVert b \rVert_2 + 4 u \log_2 n\, \lVert F \rVert_2\big) / \sqrt n
            + 10^{-290} \sqrt n .

    Where the transform is alive on few frequencies (a composed loss many bins wide) the
    norm is far below :math:`\sqrt n` times the entry bound, and read against the tail's
    untilting factors by Cauchy-Schwarz (:func:`_allowances`) it can be the smaller
    allowance. Against an extended-precision computation the measured error stays well
    below the entry bound for 10^3 to 10^6 steps.

    ``weight`` and ``modulus`` may stop short of the ``n / 2 + 1`` frequencies of the
    half-spectrum (see :func:`_step_prefixes`): beyond, the modulus of the product is below
    e^-_DEAD and the weight below ``e^dead_log_weight``, and both bounds enter the
    sums for every frequency cut off. Each step's entry also carries 8 more units for
    its logarithm and angle (:func:`_reduced_angles`). ``step_error`` replaces the first
    :math:`4 u \log_2 n + 8 u` where the steps' transforms were computed otherwise
    (mixtures of anchors, transforms of a prefix: :func:`_mixture_product`).
    """
    half_size = n // 2 + 1
    cut = half_size - weight.size

    def total(half, beyond):  # sum over the n frequencies of a real-input rfft half-spectrum
        full = 2.0 * half.sum() - half[0] - (half[-1] if n % 2 == 0 and cut == 0 else 0.0)
        return float(full) + 2.0 * cut * beyond

    weight_beyond = math.exp(min(dead_log_weight, 0.0)) if cut else 0.0
    modulus_beyond = math.exp(-_DEAD) if cut else 0.0
    transform = 4.0 * unit * math.log2(n)
    per_step = (transform + 8.0 * unit if step_error is None else step_error) * total_steps
    entry = (per_step * total(weight, weight_beyond) + transform * total(modulus, modulus_beyond)) / n + 1e-290
    norm = (per_step * math.sqrt(total(weight * weight, weight_beyond**2))
            + transform * math.sqrt(total(modulus * modulus, modulus_beyond**2))) / math.sqrt(n) + 1e-290 * math.sqrt(n)
    return entry, norm


def _allowances(noise: tuple[float, float], log_untilt, decay: float, remaining):
    r"""The rounding allowance at each grid point ``k`` given: a bound on
    :math:`\sum_{j > k} |e_j| e^{u_j}` (``e`` the composed entries' errors, ``u`` the
    untilting exponents ``log_untilt``, falling by ``decay`` per point; ``remaining``: the
    points above each), the smaller of the entry bound times :math:`\sum_{j>k} e^{u_j}` and
    (Cauchy-Schwarz) the norm bound times :math:`(\sum_{j>k} e^{2 u_j})^{1/2}`, both
    geometric series in closed form. Both hold, so their minimum does."""
    entry, norm = noise
    with np.errstate(over="ignore", invalid="ignore"):
        factor = np.exp(np.minimum(log_untilt, 700.0))
        if decay > 0:
            ones = np.exp(-decay) * -np.expm1(-decay * remaining) / -math.expm1(-decay)
            squares = np.exp(-2.0 * decay) * -np.expm1(-2.0 * decay * remaining) / -math.expm1(-2.0 * decay)
        else:
            ones, squares = remaining, remaining
        return factor * np.fmin(entry * ones, norm * np.sqrt(squares))


def _allowance_point(noise: tuple[float, float], log_untilt: np.ndarray, decay: float, k: int) -> float:
    """:func:`_allowances` at the one grid point ``k`` of ``log_untilt`` (the last is ``size - 1``)."""
    return float(_allowances(noise, log_untilt[k:k + 1], decay, np.array([log_untilt.size - 1.0 - k]))[0])


def _polar(log_modulus: np.ndarray, angle: np.ndarray) -> np.ndarray:
    """``exp(log_modulus + i angle)``: the product of the steps' powers, composed as the sum
    of their logarithms (one complex exponential in all, not one per step).

    Entries whose modulus underflows are set to zero without computing them: after many
    steps that is most of the spectrum.
    """
    out = np.zeros(log_modulus.shape, dtype=np.result_type(log_modulus.dtype, np.complex64))
    alive = np.flatnonzero(log_modulus > -745.0)
    out[alive] = np.exp(log_modulus[alive] + 1j * np.remainder(angle[alive], _two_pi(angle.dtype)))
    return out


def _invert_profile(tilted, log_untilt, losses, constant, noise, delta, lower: bool = False,
                    floors: list | bool | None = None) -> tuple[float, bool]:
    r"""Smallest epsilon >= 0 with delta(epsilon) <= delta, and whether the rounding
    allowance there exceeds delta / 100; with m_k the untilted masses
    ``tilted_k * e^{log_untilt_k}``, the profile is

    .. math::
        \delta(\varepsilon) = c + \sum_k m_k (1 - e^{\varepsilon - l_k})_+
            + \text{allowance}(\varepsilon),

    the allowance bounding the rounding of the entries above :math:`\varepsilon`
    (``noise``: the bounds of :func:`_rounding_allowance`, read by :func:`_allowances`).
    On :math:`(l_{k-1}, l_k]` this is :math:`c + N_{k-1} + A_{k-1} - e^{\varepsilon -
    l_{k-1}} B_{k-1}` with suffix sums over the entries above :math:`l_{k-1}`, so the
    inversion is exact for the discrete distribution. The profile does not increase with
    k, so the first grid point where it is at most ``delta`` brackets the answer. For
    the upper bound ``A`` is rounded up and ``B`` down by a bound on the sums' rounding
    and their terms' (:func:`_invert_by_bisection`), which the difference may magnify.
    """
    n = losses.size
    # Entries whose untilting factor would overflow sit far below the answer (a mass
    # there would exceed 1). They are left out of the sums, and every grid point at or
    # below them is marked uncertifiable, so leaving them out never lowers a delta.
    valid = log_untilt <= 300.0
    if not valid.any():  # no certificate: no upper bound, and 0 as a lower one
        return (0.0, False) if lower else (math.inf, _UNTILTABLE)
    first_valid = int(np.argmax(valid))  # log_untilt is non-increasing in k
    if not lower:
        return _invert_by_bisection(tilted, log_untilt, losses, constant, noise, delta, first_valid, floors)
    decay = float(log_untilt[0] - log_untilt[1])  # tilt * spacing
    remaining = (n - 1 - np.arange(n)).astype(float)
    # Each entry is at least its computed value less its rounding bound (and >= 0): the
    # lower bound takes that off each entry, so its allowance is the entry bound's.
    allowance = _allowances((noise[0], math.inf), log_untilt, decay, remaining)
    masses = _lowered_masses(tilted, log_untilt, noise)
    above = _suffix_sum(masses)
    weighted = _weighted_suffix_sum(masses, losses, first_valid)
    with np.errstate(over="ignore", invalid="ignore"):
        profile = constant + np.maximum(above - weighted, 0.0)
    return _lower_answer(profile, allowance, above, weighted, losses, constant, delta)


def _lowered_masses(tilted: np.ndarray, log_untilt: np.ndarray, noise: tuple) -> np.ndarray:
    """The untilted masses, each less its rounding bound (``noise[0]``, untilted) and at
    least 0: at most the exact ones. Entries whose untilting factor would overflow (far
    below any answer) are 0, which only lowers a profile."""
    valid = log_untilt <= 300.0
    masses = np.where(valid, tilted * np.exp(np.minimum(log_untilt, 300.0)), 0.0)
    with np.errstate(over="ignore"):
        return np.maximum(masses - noise[0] * np.exp(np.minimum(log_untilt, 700.0)), 0.0)


#: :func:`_invert_profile`'s ``binding`` where no grid point's untilting factor is
#: representable: true, as rounding decides (a smaller tilt may certify), but no other
#: precision can at that tilt (:func:`_once`). Not ``True`` (which equals 1). Also
#: :func:`_compose_direction`'s where the mass at +inf and the bound on what lies beyond
#: the window exceed delta by themselves (neither depends on the precision, up to far less
#: than the margin of 2^-20 of delta): 10^4 runs of 1000 steps at q 0.014 to 0.098, where
#: epsilon is 1.8*10^5, spent 5.6 s in extended precision on 2^20 points to find that.
_UNTILTABLE = 2


def _weighted_suffix_sum(masses: np.ndarray, losses: np.ndarray, first_valid: int) -> np.ndarray:
    """out[k] = sum over j > k of m_j e^{l_k - l_j}, without overflow."""
    if losses[-1] - losses[first_valid] < 600.0:
        reference = losses[first_valid]
        with np.errstate(under="ignore"):
            return _suffix_sum(masses * np.exp(reference - losses)) * np.exp(losses - reference)
    with np.errstate(divide="ignore"):  # very wide windows (epsilon in the hundreds): in log space
        inclusive = np.logaddexp.accumulate((np.log(masses) - losses)[::-1])[::-1]
    return np.exp(np.concatenate([inclusive[1:], [-np.inf]]) + losses)


def _within_bin(excess: float, weighted: float, losses: np.ndarray, k: int) -> float:
    r"""The epsilon in :math:`[l_{k-1}, l_k]` where the profile :math:`c + N + A -
    e^{\varepsilon - l_{k-1}} W` meets delta: ``excess`` is :math:`c + N + A - \delta`
    and ``weighted`` :math:`W`, both at :math:`l_{k-1}` (exact for the discrete
    distribution; rounded to the bin's ends when not finite)."""
    if not math.isfinite(excess) or weighted <= 0.0:
        epsilon = losses[k]
    elif excess <= 0.0:
        epsilon = losses[k - 1]
    else:
        with np.errstate(over="ignore"):
            ratio = float(excess / weighted)
        epsilon = losses[k - 1] + math.log(ratio) if ratio < math.inf else losses[k]
    return max(float(min(max(epsilon, losses[k - 1]), losses[k])), 0.0)


def _lower_answer(profile, allowance, above, weighted, losses, constant, delta) -> tuple[float, bool]:
    """:func:`_invert_profile`'s answer for a lower bound: the largest epsilon below which
    the (lowered) profile is certainly above ``delta``, and whether the rounding taken
    off there exceeds ``delta / 100``."""
    # Entries left out (below first_valid) only lower this profile: still a lower bound.
    profile[np.isnan(profile)] = 0.0
    certified = np.flatnonzero(profile <= delta)
    if certified.size == 0:
        return float(losses[-1]), False
    k = int(certified[0])
    binding = not allowance[max(k - 1, 0)] <= delta / 100.0
    if k == 0:
        return max(float(losses[0]), 0.0), binding
    # delta(eps) > delta below the crossing in (l_{k-1}, l_k], and the profile does not
    # increase, so the exact epsilon is at least that crossing.
    scale = abs(constant) + float(above[k - 1]) + delta
    return _within_bin_lower(constant + above[k - 1] - delta, scale, float(weighted[k - 1]), losses, k), binding


def _within_bin_lower(excess: float, scale: float, weighted: float, losses: np.ndarray, k: int) -> float:
    r""":func:`_within_bin` for a lower bound: the crossing moved down by a bound on its
    rounding error, never below :math:`l_{k-1}`. ``excess`` is a difference of terms of
    total size ``scale`` and ``weighted`` a sum, both of at most ``n`` terms, so their
    relative errors are at most :math:`n u\,\text{scale}/\text{excess}` and :math:`n u`;
    the crossing is the logarithm of their ratio."""
    if not (math.isfinite(excess) and excess > 0.0 and weighted > 0.0):
        return max(float(losses[k - 1]), 0.0)
    epsilon = _within_bin(excess, weighted, losses, k)
    error = 4.0 * losses.size * _U * (scale / excess + 1.0) + 4.0 * _U * abs(epsilon)
    return max(epsilon - error, float(losses[k - 1]), 0.0)


def _invert_by_bisection(tilted, log_untilt, losses, constant, noise, delta, first_valid,
                         floors: list | bool | None = None) -> tuple[float, bool]:
    r""":func:`_invert_profile` for the upper bound, reading the profile at ``O(log n)``
    grid points instead of all ``n``.

    The profile is :math:`c + \text{allowance}_k + A_k - W_k` with suffix sums
    :math:`A_k = \sum_{j > k} m_j` and :math:`W_k = \sum_{j > k} m_j e^{l_k - l_j}`, read
    at each point the bisection asks from sums over blocks (:func:`_suffix_reader`, ``W``
    discounted from the point read, so no factor grows however wide the window): full
    suffix sums (13 ms each at 2^20 points, against 0.5 ms) took a fifth of a calibration
    near epsilon's zero, and at huge epsilon a third of a composition on 2^22 points.
    ``A`` is rounded up and ``W`` down by a bound on their rounding: :math:`(d + 1) u` for
    a summation tree of depth ``d`` (Higham 2002, Sec. 4.2), and about ``|x| u`` for each
    exponential of an argument ``x`` that builds a term (two per term, the discounted
    ones a third; each argument at most twice the largest exponent). The bisection keeps
    a point certified at most ``delta`` as its upper end, so the answer is certified.
    Where rounding decides the answer, ``floors`` (a list) receives its
    :func:`_refinement_floor`; ``floors=False`` reads none (an answer alone is asked).
    """
    n, size = losses.size, losses.size - first_valid
    start, slope, spacing = _linear_rates(log_untilt, losses, first_valid)
    valid = tilted[first_valid:]  # m_j, and m_j e^{l_k - l_j} read at k:
    (above, depth, lost), (discounted, deeper, dropped) = (_suffix_reader(valid, start, slope, discount)
                                                           for discount in (0.0, spacing))
    decay = float(log_untilt[0] - log_untilt[1])  # tilt * spacing
    reach = max(abs(start), abs(start + slope * (size - 1)), abs(start + (slope - spacing) * (size - 1)),
                spacing * (size - 1))  # the largest exponent
    summing = (max(depth, deeper) + 4.0 * reach + 16.0) * _U  # sums, exponents, products

    def terms(k: int) -> tuple[float, float, float]:
        """(allowance, A_k, W_k) at grid point k, A rounded up and W down."""
        allowance = _allowance_point(noise, log_untilt, decay, k)
        weighted_k = max(discounted(k - first_valid) - dropped, 0.0)
        return allowance, above(k - first_valid) * (1.0 + summing) + lost, weighted_k * (1.0 - summing)

    def profile(k: int) -> float:
        allowance, a, w = terms(k)
        value = constant + allowance + max(a - w, 0.0)
        return value if value == value else math.inf

    low, high = first_valid, n - 1  # profile(low) is uncertifiable by definition
    if not profile(high) <= delta:
        return math.inf, True
    while high - low > 1:
        mid = (low + high) // 2
        if profile(mid) <= delta:
            high = mid
        else:
            low = mid
    allowance, a, weighted_at = terms(high - 1)
    answer = _within_bin(constant + allowance + a - delta, weighted_at, losses, high)
    if not allowance > delta / 100.0:
        return answer, False
    if floors is False:
        return answer, True
    seeds = (above(high - first_valid), discounted(high - first_valid))
    floor = _refinement_floor((tilted, log_untilt, losses, noise), (first_valid, high), seeds, delta)
    if floors is not None:
        floors.append(floor)
    return answer, answer - floor > _REFINE_SHARE * answer


def _linear_rates(log_untilt: np.ndarray, losses: np.ndarray, first_valid: int) -> tuple[float, float, float]:
    """``(start, slope, spacing)``: the untilting exponent at ``first_valid`` and its rate
    per point from there (``-tilt * spacing``), and the losses' spacing. Both are linear
    in the point, so their exponentials come in blocks (:func:`_suffix_reader`,
    :func:`_exp_linear`)."""
    points = max(losses.size - first_valid - 1, 1)
    return (float(log_untilt[first_valid]), float(log_untilt[-1] - log_untilt[first_valid]) / points,
            float(losses[-1] - losses[first_valid]) / points)


def _suffix_reader(tilted: np.ndarray, start: float, slope: float, discount: float = 0.0) -> tuple:
    """``(read, depth, lost)``: ``read(i)`` returns the sum over ``j > i`` of ``tilted[j]
    e^{start + slope j - discount (j - i)}`` (``start <= 300``, ``slope <= 0``,
    ``discount >= 0``), without forming those terms and with no factor above
    ``e^{start}``, however far apart ``i`` and ``j`` lie. Each block of at most
    :data:`_SUFFIX_BLOCK` entries (:func:`_block_length`) is one sum of products with
    ``e^{(slope - discount) k}`` within the block (``einsum``: no BLAS threads, no
    temporary array). A reading scales what lies above ``i`` in its own block by
    ``e^{start + slope (i + 1) - discount}``, and each block above by its first entry's
    factor: blocks whose factor underflows are left out. The same exponentials and at
    most ``depth`` (``B + blocks + 2``) sums deep, as :func:`_exp_linear` and a
    sequential pass would be; at 2^20 points 0.5 ms instead of 5 ms for the products.
    ``lost`` bounds what the reading errs by beyond that relative rounding: a factor,
    product or sum that is subnormal (or a term left out, below 2^-1100 of its block's
    sum) errs by up to 2^-1074, times the block's sum where it scales one."""
    size = tilted.size
    rate = slope - discount
    length = _block_length(rate, _SUFFIX_BLOCK)
    blocks, whole = -(-size // length), size // length * length
    with np.errstate(under="ignore"):
        inner = np.exp(rate * np.arange(length))
    totals = np.empty(blocks)
    totals[: whole // length] = np.einsum("ij,j->i", tilted[:whole].reshape(-1, length), inner)
    if whole < size:
        totals[-1] = np.einsum("i,i->", tilted[whole:], inner[: size - whole])
    bases = np.arange(blocks) * float(length)
    lost = 2.0**-1072 * (float(np.sum(tilted)) + blocks + 2.0)
    # a block's factor is at most e^{start + rate (base - i)}: below e^{-800} beyond this many entries
    reach = min((start + 800.0) / -rate, float(size)) if rate < 0.0 else float(size)

    def read(i: int) -> float:
        first = i + 1
        block = first // length
        stop = min((block + 1) * length, size)
        later = slice(block + 1, min(blocks, int((i + reach) // length) + 1))
        part = float(np.einsum("i,i->", tilted[first:stop], inner[: stop - first]))
        with np.errstate(under="ignore"):
            rest = float(np.exp(start + slope * bases[later] - discount * (bases[later] - i)) @ totals[later])
        return part * math.exp(start + slope * first - discount) + rest

    return read, length + blocks + 2.0, lost


def _block_length(slope: float, longest: int) -> int:
    """The longest block, at most ``longest``, over which ``e^{slope i}`` (``slope <= 0``)
    stays above ``e^{-700}``, a normal number (:func:`_suffix_reader`, :func:`_exp_linear`):
    a subnormal keeps a few bits, and scaled by a large block factor that error reaches
    values far above it. Gaussian losses of mean 300 on 202 points, delta 1e-20, tilted by
    0.4: blocks of 1024 read the profile at 525.91915410, below the distribution's own
    epsilon, 525.91915473."""
    if slope * (longest - 1) >= -700.0:
        return longest
    return max(1, int(700.0 / -slope) + 1)


#: Block length of :func:`_suffix_reader`.
_SUFFIX_BLOCK = 1024


#: Where rounding decides an answer, it is refined (other tilts and precisions on the same
#: grid: :func:`_refined`) only where that could lower it by more than this share of it.
_REFINE_SHARE = 2.0**-10


def _refinement_floor(profile: tuple, span: tuple, seeds: tuple, delta: float) -> float:
    r"""About the least epsilon a refinement on the same grid could certify (an answer
    rounding decided): :func:`_invert_by_bisection` refines only where that lies more than
    :data:`_REFINE_SHARE` of the answer below it, and :func:`_compose_on` not at all where
    it lies above another sound bound that the caller reports instead. ``profile``:
    ``(tilted, log_untilt, losses, noise)`` of :func:`_invert_profile`; ``span``: its first
    valid point and the answer's point ``high``; ``seeds``: the sums of the masses above
    ``high`` and of their :math:`m_j e^{l_{high} - l_j}`. Read from :data:`_FLOOR_SHARE` of
    the answer below it up at most; 0 where no point is reached there.

    Any tilt and precision composes the same grid distributions, whose exact profile is
    at least :math:`A_k - W_k - \text{allowance}_k` at each point (the allowance bounds
    the rounding of the sums, and the constant terms are at least 0) and does not
    increase with k: it is at least the largest of those from k on. Where that envelope
    first reaches delta (read within its bin as :func:`_within_bin` reads the answer),
    no refinement can certify a smaller epsilon. That is just above the highest point
    whose bound lies above delta, so the points are read from the answer down, in blocks
    (:func:`_floor_blocks`), up to the first block that holds one: at huge epsilon the
    window below the answer spans most of the grid (3.1 million of 2^22 points at
    sigma 0.022 over 10^8 steps, 0.45 s a reading), where the floor lay in the first
    block. At 2^20 points an answer refined in extended precision takes 4 s a direction,
    and rounding may decide an answer by a few parts in 10^5 of it (300 runs of 1000
    steps, q 0.055 to 0.37: 6594.24 against 6592.91). This only steers the work: the
    answer is sound either way."""
    losses, (first_valid, high) = profile[2], span
    lowest = float(losses[high]) - _FLOOR_SHARE * abs(float(losses[high]))
    bottom = max(first_valid + 1, int(np.searchsorted(losses, lowest, side="left")) - 1)
    for low, lowered, weighted in _floor_blocks(profile, (first_valid, bottom, high), seeds):
        above = np.flatnonzero(~(lowered <= delta))  # (NaN counts as above)
        if above.size:
            j, k = int(above[-1]), low + int(above[-1]) + 1 - bottom
            if k > high - bottom:
                return 0.0  # (not even the answer's point reached: other tilts validate other points)
            return _within_bin(float(lowered[j] + weighted[j]) - delta, float(weighted[j]), losses[bottom:high + 1], k)
    return 0.0  # (at the range's bottom or below: other tilts validate other points)


#: :func:`_floor_blocks`' first block, in points; each next one is twice as long.
_FLOOR_BLOCK = 2**12


def _floor_blocks(profile: tuple, span: tuple, seeds: tuple):
    """For :func:`_refinement_floor`: ``(low, lowered, weighted)`` over blocks of grid points
    ``low, low + 1, ...`` from ``high`` down to ``bottom`` (``span``: ``(first_valid,
    bottom, high)``), the first :data:`_FLOOR_BLOCK` long and each next twice as long:
    the bound :math:`(A_k - W_k)_+ - \text{allowance}_k` and :math:`W_k`. Each running
    sum goes on from the block above it in the same order as over the whole window at
    once, so every value is the same as there."""
    tilted, log_untilt, losses, noise = profile
    (first_valid, bottom, high), (above_high, weighted_high) = span, seeds
    start, slope, _ = _linear_rates(log_untilt, losses, first_valid)
    start, decay = start + slope * (bottom - first_valid), float(log_untilt[0] - log_untilt[1])
    with np.errstate(divide="ignore"):
        seed = math.log(weighted_high) - float(losses[high]) if weighted_high > 0.0 else -math.inf
    sums, logs, size, top = None, [seed], _FLOOR_BLOCK, high + 1  # (carries kept as arrays: their dtype stays)
    while top > bottom:
        low = max(bottom, top - size)
        masses = tilted[low:top] * _exp_linear(start, slope, top - low, low - bottom)  # (as from ``bottom`` on)
        with np.errstate(divide="ignore"):
            terms = np.log(masses) - losses[low:top]
            running = np.logaddexp.accumulate(np.concatenate([logs, terms[:0:-1]]))
        reversed_sums = np.cumsum(masses[::-1] if sums is None else np.concatenate([sums, masses[::-1]]))
        inclusive = (reversed_sums if sums is None else reversed_sums[1:])[::-1]
        suffix = np.concatenate([inclusive[1:], [0.0] if sums is None else sums])
        weighted = np.exp((running if sums is None else running[1:])[::-1] + losses[low:top])
        allowance = _allowances(noise, log_untilt[low:top], decay, log_untilt.size - 1.0 - np.arange(low, top))
        yield low, np.maximum(suffix + above_high - weighted, 0.0) - allowance, weighted
        sums, logs = inclusive[:1], np.concatenate([running[-1:], terms[:1]])
        top, size = low, 2 * size


#: :func:`_refinement_floor` reads the profile from this share of the answer below it: it
#: is compared with the answer less :data:`_REFINE_SHARE` of it, and with other bounds up
#: to a few percent below (q 0.72 over 10^8 steps: 1.9%).
_FLOOR_SHARE = 2.0**-5


#: Block length of :func:`_exp_linear`.
_EXP_BLOCK = 1024


def _exp_linear(start: float, slope: float, size: int, skip: int = 0) -> np.ndarray:
    """``exp(start + slope * k)`` for ``k = skip .. skip + size - 1`` (``start <= 300``,
    ``slope <= 0``), as the outer product of two short exponentials, over blocks and
    within a block (of :func:`_block_length`, whose factors are normal numbers, counted
    from ``k = 0`` whatever ``skip``, so that a part comes out as it does in the whole):
    as accurate as one exponential per entry (a few units of round-off relative to the
    exponent's size, and 2^-1074 where the entry itself is subnormal) at a small part of
    its cost."""
    length = _block_length(slope, _EXP_BLOCK)
    first, last = skip // length, -(-(skip + size) // length)
    with np.errstate(under="ignore"):
        outer = (np.exp(start + (slope * length) * np.arange(first, last))[:, None]
                 * np.exp(slope * np.arange(length)))
    return outer.ravel()[skip - first * length:skip - first * length + size]


def _suffix_sum(values: np.ndarray) -> np.ndarray:
    """out[k] = sum of values[j] over j > k."""
    inclusive = np.cumsum(values[::-1])[::-1]
    return np.concatenate([inclusive[1:], [0.0]])


class PLDAccountant(Accountant):
    """Accountant that composes privacy loss distributions: tight and never optimistic.

    Args:
        grid_points: size of the circular loss grid, rounded up to a power of two and
            refined up to 4 times where a long run needs it. ``None`` (the default)
            chooses it per ledger, from 2**14 to 2**20 points, as coarse as keeps epsilon
            within about 0.1% of what a finer grid gives. More points give a tighter
            epsilon at proportional cost.
        max_groups: most groups a ledger of many distinct ``(sigma, q)`` pairs is
            composed in (default ``None``: 64, see
            :func:`~dpoptim.accounting.ledger.coarsen_runs`, or 16 or 32 where a slowly
            changing schedule loses next to nothing by them: :func:`_fewest_groups`).
            Each group costs one transform per direction; more groups give a tighter
            epsilon for long schedules at proportional cost (``docs/accounting.md``
            measures it). A value given is used as it is; above 64, where a rare loss
            decides epsilon, the split of :mod:`.rare` also takes twice as many pairs,
            up to 256 (:func:`_split_pairs`).

    >>> acc = PLDAccountant().compose(1.1, 0.004, count=10_000)
    >>> round(acc.get_epsilon(1e-5), 2)
    1.84
    """

    name = "pld"

    def __init__(self, grid_points: int | None = None, max_groups: int | None = None):
        super().__init__()
        self.grid_points = _check_grid_points(grid_points)
        self.max_groups = _check_max_groups(max_groups)

    def get_epsilon(self, delta) -> float:
        delta = check_delta(delta)
        return _pld_epsilon(self.ledger, delta, self.grid_points, max_groups=self.max_groups)
