r"""A rigorous *lower* bound composed in stages: the bracket's other side for long runs.

One grid bounds a run of :math:`10^8` steps from below only where a step's loss is narrow:
merging each step's bins onto a grid of spacing ``h`` (:func:`.pld._dominated_masses`)
gives up about :math:`h^2/12` of variance a step, and the window of :math:`2^{22}`
points sets ``h``. Where epsilon is in the ten thousands the bound fell 2% to 4% below
the reported value (sigma 0.598, q 0.0041, :math:`10^8` steps: 11,773 against 12,001),
though finer stages moved the reported value by under 0.01%. Here the run is bounded in
the two stages of :mod:`.staged`, each move its mirror:

1. Each step is the *dominated* pair of :func:`.pld._dominated_masses` on the fine grid
   (a randomised post-processing of the true outputs: by data processing every profile
   can only fall).
2. ``B = R^2`` steps are composed by one transform (extended precision, tilted as in
   :mod:`.staged`); from every entry the transform's error bound (:func:`.staged._fft_error`)
   and a Chernoff bound on all that the circular window folds in are *subtracted*, and
   negative entries set to 0. What the window leaves out is dropped. A smaller measure
   has a smaller profile at every epsilon, after any further composition (convolution of
   non-negative measures is monotone, and the profile is a positive linear functional).
3. The block's atoms, each a pair of P- and Q-masses :math:`(p, p e^{-\ell})`, are merged
   onto the coarse grid ``R h`` by the same post-processing as the steps: consecutive
   atoms, and a share of the next, into one outcome whose loss is exactly a grid value.
4. The ``T // B`` blocks and one of the ``T - K B`` left are composed on the coarse grid
   as in 2., and epsilon is read off rounding against it: the largest epsilon at which
   the lowered profile still exceeds delta (every smaller epsilon has a true profile
   above delta too).

The profile of a pair lowered this way is at most the true one at every epsilon, so the
epsilon read off is at most the true one (for each direction; the larger of the two is
reported). The spacings and the tilt are :func:`.staged._plan`'s, so the two sides of a
bracket lose alike: the mean falls by about as much as connect-the-dots raises it.
"""

from __future__ import annotations

import math

import numpy as np

from . import pld as _pld
from . import staged as _staged

#: Above this RDP guess the stages are not tried. The upper side stops at a hundredth of
#: it (:data:`.staged._MAX_GUESS`), where one grid answers as closely and faster, but one
#: grid's lower bound is loose there (sigma 4.2, q 0.44, 4*10^7 steps: 197,633 against
#: the reported 224,659; 224,343 in stages).
_MAX_GUESS = 1e7

#: Tilted mass each window may fold in (per block; the blocks' measures total at most 1):
#: subtracted from every entry.
_FOLD_SHARE = 2.0**-80


def staged_lower_epsilon(sigma: float, q: float, count: int, delta: float,
                         min_steps: int = _staged.MIN_STEPS) -> float | None:
    """A rigorous lower bound on the epsilon of ``count`` steps of ``(sigma, q)`` at
    ``delta``, composed in stages: the larger of the two directions' (see the module
    docstring); None where the stages do not fit removal (as for
    :func:`.staged.staged_epsilons`: addition alone, where removal's tail is too long for
    the grids, bounded 0.49 where epsilon is 0.73 at sigma 0.7, q 0.002, 2096 steps) or
    the run is shorter than ``min_steps``."""
    if count < min_steps or not 0.0 < q <= 1.0 or _staged._U > 1e-18:
        return None
    guess = _pld._rdp_guess(((sigma, q, count),), delta)
    guess = min(guess, 2.0 * _staged._central_limit_epsilon(sigma, q, count, delta)) or guess
    if not 0.0 < guess <= _MAX_GUESS:
        return None
    found = []
    for direction in (_pld._REMOVE, _pld._ADD):
        # a guess far above epsilon tilts the window past where delta is read (sigma
        # 0.26, q 0.46, 369,633 steps: RDP's 1.022e6, the window from 996,392, epsilon
        # near 994,000): nothing there exceeds delta, and lower guesses are tried
        for share in _GUESS_SHARES:
            value = _direction_lower(sigma, q, count, direction, delta, guess * share)
            if value != 0.0:
                break
        if value is None and direction == _pld._REMOVE:
            return None
        found.append(value)
    return max(value for value in found if value is not None)


#: The shares of the RDP guess the plan is tried at, in turn, while the bound is 0.
_GUESS_SHARES = (1.0, 0.97, 0.9, 0.75)


def _direction_lower(sigma: float, q: float, count: int, direction: str, delta: float, guess: float) -> float | None:
    """One direction's lower bound at the plan :func:`.staged._plan` makes for ``guess``,
    its fine grid refined while merging loses more than :data:`_MERGE_SHARE` of ``guess``
    in mean over the run (:func:`_merge_loss`), or a coarse bin is above
    :data:`_COARSE_BIN_SHARE` of it (the coarsest grids where a finer one does not fit)."""
    plan = _staged._plan(sigma, q, count, direction, delta, guess)
    if plan is None:
        return None
    spacings = [plan.h / 2**k for k in range(_FINER + 1)]
    chosen = next((k for k, h in enumerate(spacings)
                   if plan.R * h <= _COARSE_BIN_SHARE * guess
                   and _merge_loss(sigma, q, count, direction, delta, h) <= _MERGE_SHARE * guess), _FINER)
    for h in spacings[chosen::-1]:
        found = _lower_on(sigma, q, count, direction, delta, plan._replace(h=h))
        if found is not None:
            return found
    return None


#: Share of the guessed epsilon the merge of the fine steps may lose in mean over the run.
_MERGE_SHARE = 2.0**-11

#: The largest coarse bin, as a share of the guessed epsilon: merging onto bins of 7.6% of
#: it lost 0.2% (q = 1, sigma 1713, 2048 steps, epsilon 1.6e-3), about quadratically.
_COARSE_BIN_SHARE = 2.0**-6

#: The fine grid of the lower bound is refined up to 2^this times the plan's.
_FINER = 3


def _merge_loss(sigma: float, q: float, count: int, direction: str, delta: float, h: float) -> float:
    """About how much the dominated steps on spacing ``h`` lower the run's mean loss: the
    connect-the-dots step's mean less the dominated one's (the first is within
    :math:`h^2/8` above the exact mean), times the steps."""
    lo, hi = _staged._step_window(sigma, q, direction, h, _staged._cut(delta, count))
    first, masses, _ = _pld._step_distribution(sigma, q, direction, h, lo, hi, optimistic=True)
    offset = _pld._dominated_offset(sigma, q, direction, h)
    up_first, up_masses, _ = _staged._step(sigma, q, direction, h, _staged._cut(delta, count))
    merged = float(masses @ ((first + np.arange(masses.size)) * h + offset))
    spread = float(up_masses @ ((up_first + np.arange(up_masses.size)) * h))
    return count * max(spread - merged, 0.0)


def _lower_on(sigma: float, q: float, count: int, direction: str, delta: float, plan) -> float | None:
    """One direction's lower bound on ``plan``'s grids; None where they do not fit."""
    h = plan.h
    lo, hi = _staged._step_window(sigma, q, direction, h, _staged._cut(delta, count))
    first, masses, _ = _pld._step_distribution(sigma, q, direction, h, lo, hi, optimistic=True)
    offset = _pld._dominated_offset(sigma, q, direction, h)  # masses[k] at (first + k) h + offset
    for R in (plan.R, plan.R // 2, plan.R // 4):
        if R < 2 or plan.tilt * R * h >= 16:
            continue
        K, rest = divmod(count, R * R)
        counts = [(R * R, K)] + ([(rest, 1)] if rest else [])
        sized = plan._replace(R=R)
        blocks = [_block(first, masses, offset, length, sized) for length, _ in counts]
        if all(block is not None for block in blocks):
            return _composed_lower([(block, times) for block, (_, times) in zip(blocks, counts)], sized, delta)
    return None


def _folded_bound(log_mgf: np.ndarray, low: float, high: float) -> float:
    """A Chernoff bound on a tilted measure's mass outside ``[low, high)`` (its log moment
    generating function ``log_mgf`` at :data:`.staged._LAMBDAS`): all a circular window
    from ``low`` to ``high`` can fold onto any one entry."""
    return _staged._mass_above(log_mgf, _staged._LAMBDAS, high) + _staged._mass_below(log_mgf, _staged._LAMBDAS, low)


def _lowered(composed: np.ndarray, bound: float) -> np.ndarray:
    """``composed`` less ``bound``, in float64 rounded down, never negative."""
    return np.maximum((composed - bound).astype(float), 0.0) * (1.0 - 2.0**-50)


def _block(first: int, masses: np.ndarray, offset: float, length: int, plan) -> tuple | None:
    """``(first, masses)``: ``length`` dominated steps composed on the fine grid, lowered
    (move 2) and merged onto the coarse grid ``R h`` at losses ``(first + k) R h`` (move
    3); None where its window does not fit."""
    h, tilt = plan.h, plan.tilt
    tilted, log_norm = _staged._tilted_step(first, masses, h, tilt, offset, up=False)
    # the tilted step's log moment generating function (losses without the offset)
    log_mgf = length * _pld._log_mgf(first, tilted, h, _staged._LAMBDAS)
    low, high = _staged._window(log_mgf, _staged._LAMBDAS, _FOLD_SHARE, h, 0.0, _FOLD_SHARE)
    n = _staged._fft_size(max(high - low + 1, masses.size))
    if n is None:
        return None
    placed = np.zeros(n, dtype=_staged._EXTENDED)
    placed[: masses.size] = tilted
    powered = _staged._powered(np.fft.rfft(placed), length)
    composed = np.roll(np.fft.irfft(powered, n), (length * first - low) % n)
    error = _staged._fft_error(n, [(length, _staged._norm(tilted))], int(np.count_nonzero(powered)))
    block = _lowered(composed, error + _folded_bound(log_mgf, low * h, (low + n) * h))
    losses = (low + np.arange(n)) * h + length * offset
    return _merged(block, losses, length * log_norm, plan)


def _merged(tilted: np.ndarray, losses: np.ndarray, log_scale: float, plan) -> tuple:
    """Move 3: the block's atoms (P-masses ``tilted e^{log_scale - tilt l}`` at ``losses``)
    merged onto the coarse grid by :func:`.pld._dominated_masses`; ``(first, masses)``."""
    H, tilt = plan.R * plan.h, plan.tilt
    live = np.flatnonzero(tilted > 0.0)
    if live.size == 0:
        return 0, np.zeros(1)
    tilted, losses = tilted[live[0]: live[-1] + 1], losses[live[0]: live[-1] + 1]
    with np.errstate(divide="ignore"):
        log_p = np.log(tilted) + log_scale - tilt * losses
    slack = 8.0 * _pld._U * (np.abs(log_p) + abs(log_scale) + np.abs(tilt * losses) + 2.0)
    log_p = log_p - slack  # rounded down: a smaller atom (its Q-mass in proportion)
    p = np.exp(log_p)
    log_q = log_p - losses
    errors = 4.0 * _pld._U * (np.abs(log_p) + np.abs(losses) + 2.0)  # of q from log p - l
    first = math.floor(float(losses[0]) / H)
    points = math.ceil(float(losses[-1]) / H) - first + 1
    return first, _pld._dominated_masses(p, log_q, errors, first, H, 0.0, points)


def _composed_lower(parts: list, plan, delta: float) -> float | None:
    """Move 4: the blocks (``((first, masses), times)``) composed on the coarse grid,
    lowered, and the largest epsilon whose lowered profile exceeds ``delta``."""
    H, tilt = plan.R * plan.h, plan.tilt
    tilted_parts, log_scale, start, total_log_mgf = [], 0.0, 0, 0.0
    for (first, masses), times in parts:
        tilted, log_norm = _staged._tilted_step(first, masses, H, tilt, up=False)
        tilted_parts.append((tilted, times))
        log_scale += times * log_norm
        start += times * first
        total_log_mgf = total_log_mgf + times * _pld._log_mgf(first, tilted, H, _staged._LAMBDAS)
    low, high = _staged._window(total_log_mgf, _staged._LAMBDAS, _FOLD_SHARE, H, 0.0, _FOLD_SHARE)
    n = _staged._fft_size(max(high - low + 1, max(t.size for t, _ in tilted_parts)))
    if n is None:
        return None
    spectrum, norms = 1.0, []
    for tilted, times in tilted_parts:
        placed = np.zeros(n, dtype=_staged._EXTENDED)
        placed[: tilted.size] = tilted
        spectrum = spectrum * _staged._powered(np.fft.rfft(placed), times)
        norms.append((times, _staged._norm(tilted)))
    composed = np.roll(np.fft.irfft(spectrum, n), (start - low) % n)
    error = _staged._fft_error(n, norms, int(np.count_nonzero(spectrum)))
    lowered = _lowered(composed, error + _folded_bound(total_log_mgf, low * H, (low + n) * H))
    losses = (low + np.arange(n)) * H
    with np.errstate(divide="ignore"):
        log_w = np.log(lowered) + log_scale - tilt * losses
    log_w = log_w - 8.0 * _pld._U * (np.abs(log_w) + abs(log_scale) + np.abs(tilt * losses) + 2.0)
    return _read_lower(log_w, losses, delta)


def _read_lower(log_w: np.ndarray, losses: np.ndarray, delta: float) -> float:
    r"""The largest epsilon at which :math:`\sum_i w_i (1 - e^{\varepsilon - \ell_i})_+`
    (``w = exp(log_w)`` at the increasing ``losses``; sums rounded down) exceeds ``delta``
    (0 where it does not at epsilon 0 or below the window)."""
    slack = 1e-9
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        w = np.exp(log_w)

        def profile(k: int) -> float:
            return float(np.nan_to_num((w[k + 1:] * -np.expm1(losses[k] - losses[k + 1:])).sum())) * (1.0 - slack)

        if not profile(0) > delta:
            return 0.0
        low, high = 0, losses.size - 1  # profile(low) > delta >= profile(high) (0 at the top)
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if profile(middle) > delta else (low, middle)
        # between the two: profile(x) = s1 - e^{x - l_high} s2 with the entries above low
        s1 = float(w[high:].sum()) * (1.0 - slack)
        s2 = float((w[high:] * np.exp(losses[high] - losses[high:])).sum()) * (1.0 + slack)
    epsilon = float(losses[low])
    if s1 > delta and s2 > 0.0:
        epsilon = max(epsilon, min(float(losses[high]), float(losses[high]) + math.log((s1 - delta) / s2)))
    return max(0.0, epsilon - 1e-12 * abs(epsilon) - 1e-15)
