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

**Upper bound** (:func:`split_epsilon`). Each of the two kept terms is composed on its
own window and at its own tilt, with the certificates of :mod:`.pld`: the bulk alone,
light enough for a large tilt, and one tail step among bulk steps, whose answer lies in
the body of its own distribution. Their profiles, with the terms beyond and the mass at
:math:`+\infty` counted in full, add up to an upper bound on the profile of a pair that
dominates the true one (connect-the-dots, Doroshenko et al. 2022), so the epsilon read
off it is never below the truth. The bulk's own grid is finer than the accountant's:
connect-the-dots spreads a loss far smaller than a bin over the bin, adding about ``h``
times the mean absolute loss of the bulk to the composed variance.

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


def split_epsilon(steps: tuple, direction: str, delta: float, guess: float,
                  dtype=np.float64) -> tuple[float, bool] | None:
    """Epsilon of one direction of ``steps`` (``(sigma, q, count)`` each) by the split,
    and whether rounding decides it; None where no split applies (no rare tail, or a
    window too wide). ``guess``: an estimate of epsilon (an upper bound), which sizes the
    grid: a bin at most 2^-10 of it, finer where the bulk's spread asks
    (:func:`_bulk_spacing`)."""
    if not (0.0 < guess < math.inf) or not steps:
        return None
    answer = None
    for _ in range(2):  # once more on its own answer where the guess was more than twice that
        scale = 2.0 ** math.floor(math.log2(guess))  # the cache key holds the guess to within a factor of 2
        total = sum(count for _, _, count in steps)
        # at most 2^-10 of the scale, and a mean shift of connect-the-dots, T h^2 / 8, at most 10^-3 of it
        finest = min(scale * 2.0**-10, 2.0 ** math.floor(0.5 * math.log2(8e-3 * scale / total)))
        found = _split_epsilon(tuple(steps), direction, delta, finest, scale, np.dtype(dtype).str)
        if found is None:
            return answer
        if answer is None or found[0] < answer[0]:
            answer = found
        if not 0.0 < found[0] < scale / 2.0:
            break
        guess = found[0]
    return answer


@functools.lru_cache(maxsize=16)
def _split_epsilon(steps: tuple, direction: str, delta: float, spacing: float, scale: float, dtype: str):
    dtype = np.dtype(dtype)
    tail = _pld._TAIL_FRACTION * delta
    h = _bulk_spacing(steps, direction, spacing, scale, tail)
    while h <= spacing:
        parts = _split_parts(steps, direction, h, tail, delta)
        if parts is None:
            return None
        constant, terms = parts
        profiles = [_term_profile(term, h, delta, dtype) for term in terms]
        if all(profile is not None for profile in profiles):
            return _invert(profiles, constant, delta)
        h *= 2.0  # a window too wide for the finest grid: try a coarser one
    return None


def _bulk_spacing(steps: tuple, direction: str, spacing: float, scale: float, tail: float) -> float:
    r"""The coarsest power-of-two spacing, at most ``spacing``, for which connect-the-dots
    spreads the composed bulk by at most :data:`_SPREAD_SHARE` of ``scale``: a loss
    :math:`\ell` much smaller than a bin ``h`` becomes ``h`` with chance about
    :math:`\ell / h`, a variance of about :math:`h |\ell|`, so the composed variance grows
    by about :math:`h \sum_r c_r \mathbb E|L_r|` over the bulk (at most ``scale / 4``)."""
    bottoms, tops = _pld._tail_ends(steps, spacing, -(2**62), 2**62, tail)
    absolute = 0.0
    for (sigma, q, count), bottom, top in zip(steps, bottoms[direction], tops[direction]):
        if top - bottom > _MAX_POINTS:
            return math.inf
        first, masses, _ = _pld._step_distribution(sigma, q, direction, spacing, bottom, top)
        losses = (first + np.arange(masses.size)) * spacing
        absolute += count * float(masses @ np.where(np.abs(losses) <= scale / 4.0, np.abs(losses), 0.0))
    if not absolute > 0.0:
        return spacing
    return min(spacing, 2.0 ** math.floor(math.log2((_SPREAD_SHARE * scale) ** 2 / absolute)))


def _split_parts(steps: tuple, direction: str, h: float, tail: float, delta: float):
    """``(constant, terms)`` of the split on spacing ``h``, or None without a rare tail.

    ``constant`` counts in full the mass at +inf and the terms beyond; each term is a
    list of ``(log_weight, factors)`` products, a factor ``(first, masses, count)``."""
    bottoms, tops = _pld._tail_ends(steps, h, -(2**62), 2**62, tail)
    if sum(top - bottom for top, bottom in zip(tops[direction], bottoms[direction])) > 2 * _MAX_POINTS:
        return None
    distributions = [_pld._step_distribution(sigma, q, direction, h, bottom, top)
                     for (sigma, q, _), bottom, top in zip(steps, bottoms[direction], tops[direction])]
    counts = [count for _, _, count in steps]
    cut = _cut_index(distributions, counts, math.sqrt(2.0 * _BEYOND_SHARE * delta))
    if cut is None:
        return None
    bulks, tails = [], []
    for first, masses, _ in distributions:
        keep = min(max(cut - first + 1, 0), masses.size)
        if keep == 0:
            return None
        bulks.append((first, masses[:keep]))
        tails.append((first + keep, masses[keep:]))
    tail_total = math.fsum(c * float(t.sum()) for c, (_, t) in zip(counts, tails))
    # The tails' far ends count in full: one tail step's window ends where they start.
    end = _cut_index(tails, counts, _BEYOND_SHARE * delta)
    far = 0.0
    if end is not None:
        for r, (first, masses) in enumerate(tails):
            keep = min(max(end - first + 1, 0), masses.size)
            far += counts[r] * float(masses[keep:].sum())
            tails[r] = (first, masses[:keep])
    log_finite = sum(c * math.log1p(-p_inf) for c, (_, _, p_inf) in zip(counts, distributions))
    constant = -math.expm1(log_finite) + tail_total * tail_total / 2.0 + far
    alone = [(0.0, [(first, masses, c) for (first, masses), c in zip(bulks, counts) if masses.size])]
    one = []
    for r, (t_first, t_masses) in enumerate(tails):
        if not t_masses.size or not t_masses.any():
            continue
        factors = [(t_first, t_masses, 1)]
        for s, ((first, masses), c) in enumerate(zip(bulks, counts)):
            c -= s == r
            if c > 0 and masses.size:
                factors.append((first, masses, c))
        one.append((math.log(counts[r]), factors))
    return constant * (1.0 + 1e-12), [alone, one]


def _cut_index(distributions: list, counts: list, allowed: float) -> int | None:
    """The smallest grid index with :math:`\\sum_r c_r |t_r| \\le` ``allowed``, ``t_r`` the
    masses of ``distributions`` (``(first, masses, ...)`` each) above it; None where only
    the last index of all (nothing above) fits."""
    low = min(first for first, *_ in distributions)
    high = max(first + masses.size - 1 for first, masses, *_ in distributions)
    total = np.zeros(high - low + 2)  # total[i]: the weight above index low + i - 1
    for (first, masses, *_), count in zip(distributions, counts):
        above = np.concatenate([np.cumsum(masses[::-1])[::-1], [0.0]])
        start = first - low
        total[start:start + above.size] += count * above
        total[:start] += count * above[0]
    fits = np.flatnonzero(total <= allowed * (1.0 - 1e-9))
    index = int(fits[0]) if fits.size else total.size
    if index >= total.size - 1:
        return None
    return low + index - 1


class _Profile:
    """One term's composed profile on its window, read at any epsilon: the exact profile
    of its grid distribution plus the rounding allowance of the entries above epsilon."""

    def __init__(self, tilted: np.ndarray, log_untilt: np.ndarray, losses: np.ndarray, noise: tuple,
                 constant: float):
        self.losses, self.log_untilt, self.noise, self.constant = losses, log_untilt, noise, constant
        n = losses.size
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
        self.above = _pld._suffix_sum(masses)  # sum over j > i of m_j
        self.discounted = _pld._suffix_sum(weighted)  # ... of m_j e^{r - l_j}, r the first valid loss
        self.reference = float(losses[min(self.first_valid, n - 1)])
        self.decay = float(log_untilt[0] - log_untilt[1]) if n > 1 else 0.0

    def at(self, epsilon: float) -> tuple[float, float]:
        """``(profile, allowance)`` at ``epsilon``: the sum over entries above it of
        ``m_j (1 - e^{epsilon - l_j})``, plus the wrap-around bound and the rounding
        allowance of those entries; and that allowance."""
        n = self.losses.size
        i = int(np.searchsorted(self.losses, epsilon, side="left")) - 1  # l_i < epsilon <= l_{i+1}
        if i >= n - 1:
            return self.constant, 0.0
        if i < self.first_valid:
            return math.inf, math.inf
        allowance = float(_pld._allowances(self.noise, np.array([self.log_untilt[i]]), self.decay,
                                           np.array([n - 1.0 - i]))[0])
        discounted = float(self.discounted[i])
        with np.errstate(over="ignore"):
            subtract = math.exp(epsilon - self.reference + math.log(discounted)) if discounted > 0 else 0.0
        above = float(self.above[i])
        summing = 4.0 * (n + 4) * _pld._U * (above + subtract)  # the sums' own rounding
        value = self.constant + allowance + max(above - subtract, 0.0) + summing
        return (value if value == value else math.inf), allowance


def _term_profile(term: list, h: float, delta: float, dtype) -> _Profile | None:
    """The profile of one term (a sum of products of factors, see :func:`_split_parts`),
    composed on its own window at its own tilt, or None where the window needs more than
    :data:`_MAX_POINTS` points."""
    lambdas = np.concatenate([-_LAMBDAS[::-1], [0.0], _LAMBDAS])
    log_mgfs = {}
    cgfs = []
    for log_weight, factors in term:
        cgf = np.full(lambdas.shape, log_weight)
        for first, masses, count in factors:
            key = id(masses)
            if key not in log_mgfs:
                log_mgfs[key] = _pld._log_mgf(first, masses, h, lambdas)
            cgf = cgf + count * log_mgfs[key]
        cgfs.append(cgf)
    cgf = np.logaddexp.reduce(np.array(cgfs), axis=0)
    up, down = cgf[_LAMBDAS.size + 1:], cgf[:_LAMBDAS.size][::-1]
    log_share = math.log(_WRAP_SHARE * delta)
    lowest = min(sum(count * first for first, _, count in factors) for _, factors in term)
    highest = max(sum(count * (first + masses.size - 1) for first, masses, count in factors) for _, factors in term)
    i_low = max(lowest, math.floor(float(((log_share - down) / _LAMBDAS).max()) / h))
    i_top = min(highest, math.ceil(float(((up - log_share) / _LAMBDAS).min()) / h))
    n = 1 << max(10, (i_top - i_low + 2).bit_length())
    if n > _MAX_POINTS:
        return None
    beyond = (i_low + n) * h  # composed indices from here on wrap around
    wrap = 0.0 if i_low + n > highest else math.exp(min(float((up - _LAMBDAS * beyond).min()), 0.0))
    log_mass = float(cgf[_LAMBDAS.size])
    tilt = _pld._choose_tilt(_LAMBDAS, up - log_mass, n * h, min(delta * math.exp(-log_mass), 0.5))
    tilted, log_untilt, noise = _composed(term, h, i_low, n, tilt, dtype)
    return _Profile(tilted, log_untilt, (i_low + np.arange(n)) * h, noise, wrap)


def _composed(term: list, h: float, i_low: int, n: int, tilt: float, dtype) -> tuple:
    """``(tilted, log_untilt, noise)`` of a term on the window ``i_low .. i_low + n - 1``:
    the composed tilted masses, the exponents that undo the tilt, and the rounding bounds
    of :func:`~dpoptim.accounting.pld._rounding_allowance` for a sum of products (each
    product's error weighted as in the sum; the sum itself adds a round-off per product)."""
    transforms = {}
    for _, factors in term:
        for first, masses, _ in factors:
            if id(masses) not in transforms:
                start, values, _, log_mgf = _pld._tilted(first, masses, 0.0, h, tilt)
                spectrum = _pld._placed_transform([(start, values)], n, dtype)[0].copy()
                with np.errstate(divide="ignore"):
                    transforms[id(masses)] = (spectrum, np.log(np.abs(spectrum)), log_mgf)
    products = []
    for log_weight, factors in term:
        log_modulus = angle = 0.0
        log_scale, log_all_but_one = log_weight, 0.0
        for first, masses, count in factors:
            spectrum, log_abs, log_mgf = transforms[id(masses)]
            log_modulus = log_modulus + count * log_abs
            angle = angle + _pld._reduced_angles(spectrum.real, spectrum.imag, count)
            log_all_but_one = log_all_but_one + (count - 1) * log_abs.astype(np.float64)
            log_scale += count * log_mgf
        products.append((log_scale, log_modulus, angle, log_all_but_one))
    top = max(log_scale for log_scale, _, _, _ in products)
    spectrum = 0.0
    weight = modulus = 0.0
    for log_scale, log_modulus, angle, log_all_but_one in products:
        share = math.exp(log_scale - top)
        spectrum = spectrum + share * _pld._polar(log_modulus, angle)
        with np.errstate(under="ignore"):
            weight = weight + share * np.exp(log_all_but_one)
            modulus = modulus + share * np.exp(np.asarray(log_modulus, dtype=np.float64))
    composed = np.fft.irfft(spectrum, n)
    tilted = np.maximum(np.roll(composed, -(i_low % n)).astype(np.float64), 0.0)
    log_untilt = top - tilt * (i_low + np.arange(n)) * h
    unit = float(np.finfo(dtype).eps) / 2
    total_steps = sum(count for _, _, count in term[0][1])
    modulus = modulus * (1.0 + (len(products) + 1) / (4.0 * math.log2(n)))
    noise = _pld._rounding_allowance(n, total_steps, weight, modulus, unit)
    return tilted, log_untilt, noise


def _invert(profiles: list, constant: float, delta: float) -> tuple[float, bool] | None:
    """The smallest epsilon >= 0 (to a relative 1e-9) where ``constant`` plus the terms'
    profiles is certified at most ``delta``, and whether their rounding allowance there
    exceeds ``delta / 100``; None where none is."""
    def total(epsilon: float) -> tuple[float, float]:
        values = [profile.at(epsilon) for profile in profiles]
        return constant + math.fsum(v for v, _ in values), math.fsum(a for _, a in values)

    def fits(epsilon: float) -> bool:
        return total(epsilon)[0] * (1.0 + 1e-9) <= delta

    high = max(float(profile.losses[-1]) for profile in profiles)
    if not fits(high):
        return None
    low = 0.0
    if fits(low):
        high = low
    while high - low > 1e-9 * high:
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        if fits(middle):
            high = middle
        else:
            low = middle
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
    a = _lower_cut(steps, direction, delta)
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


def _lower_cut(steps: tuple, direction: str, delta: float) -> float:
    """The smallest loss ``a`` (to a part in 2^40 of the range) whose tails above it keep the
    terms with two tail steps or more below ``delta / 1024``: dropping them then loses
    at most that."""
    allowed = math.sqrt(2.0 * _BEYOND_SHARE * delta)

    def weight(a: float) -> float:
        return math.fsum(count * math.exp(float(_pld._bin_log_masses(sigma, q, direction, np.array([a]))[3][1]))
                         for sigma, q, count in steps)

    low = min(float(_pld._loss_of_z(-_pld._GAUSS_TAIL * sigma, sigma, q, direction)) for sigma, q, _ in steps)
    high = max(float(_pld._loss_of_z(1.0 + _pld._GAUSS_TAIL * sigma, sigma, q, direction)) for sigma, q, _ in steps)
    if weight(low) <= allowed:
        return low
    for _ in range(40):
        middle = 0.5 * (low + high)
        if weight(middle) <= allowed:
            high = middle
        else:
            low = middle
    return high


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
    low, high = 0.0, max(float(losses[-1]), 0.0)
    if exceeds(high):
        return high
    while high - low > 1e-9 * high:
        middle = 0.5 * (low + high)
        if middle in (low, high):
            break
        if exceeds(middle):
            low = middle
        else:
            high = middle
    return low
