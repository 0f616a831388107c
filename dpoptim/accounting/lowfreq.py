r"""The live low frequencies of narrow distributions' transforms, without full FFTs.

After many steps the composed privacy loss distribution is wide and smooth: its transform
lives on a few hundred of the ``n / 2 + 1`` frequencies of the grid, and past them every
factor's power is below e^-800, zero in float64. A step's distribution is narrow (a few
thousand bins of the ``n``), so its transform on those frequencies can be had for a
tenth of a full FFT's work: for the anchors of a long schedule's mixture groups
(:mod:`.mixture`), where the full transforms were most of an evaluation's time.

Masses :math:`x_j \ge 0` summing to 1 at grid indices ``f + j`` (``j < m``), placed modulo
``n``, have the transform :math:`X_k = \sum_j x_j e^{-2\pi i (f + j) k / n}`.

**Where it dies, certified from coarse samples.** Folding the masses modulo ``L = n / s``
gives ``X`` exactly at every ``s``-th frequency, by one FFT of size ``L``:
:math:`X_{s i} = \sum_t y_t e^{-2\pi i t i / L}` with :math:`y_t = \sum_{(f + j) \equiv t}
x_j`. Between samples, for any centre ``c``, :math:`|X_k| = |\sum_j x_j e^{-2\pi i (j - c)
k / n}|` and :math:`|e^{i\alpha} - e^{i\beta}| \le |\alpha - \beta|` give

.. math::
    \big|\,|X_k| - |X_{k'}|\,\big| \le \frac{2\pi |k - k'|}{n} \sum_j x_j |j - c|,

and every frequency lies within ``s / 2`` of a sample: on sample ``i``'s interval,
:math:`|X_k| \le |X_{s i}| + \pi s A / n` with :math:`A = \sum_j x_j |j - c|` (``c`` the
median index). Past the last interval where that bound (largest over a group's rows)
exceeds the group's threshold, the group's transform is dead.

**The live frequencies, by block moments.** Cut the masses into blocks of ``b`` bins,
block ``beta`` centred at :math:`c_\beta = f + b\beta + (b-1)/2`, its bins at offsets
:math:`d \in \{-(b-1)/2, \dots, (b-1)/2\}`. Expanding :math:`e^{-2\pi i d k / n}` in
powers of ``d``,

.. math::
    X_k = e^{-2\pi i (f + (b-1)/2) k / n} \sum_{p \ge 0} \frac{(-2\pi i k / n)^p}{p!}
          \sum_\beta e^{-2\pi i \beta k / L} M_{\beta p}, \qquad
          M_{\beta p} = \sum_d x_{\beta d}\, d^p, \quad L = n / b:

for each ``p`` the sum over blocks is an FFT of ``L`` points (periodic in ``k``), and for
``k < K`` each term of the series is at most :math:`\theta^p / p!` with
:math:`\theta = \pi b K / n`. With ``b`` chosen so that :math:`\theta \le 1`, the terms
past ``P`` (:func:`_blocking`) add at most :math:`\sum_{p \ge P} \theta^p / p! < 2^{-64}`.
``P`` FFTs of ``n / b`` points replace one of ``n``: for a few hundred live frequencies
on 2^18 points, a tenth of the work, and no matrix product (OpenBLAS's threads, idle after
one, spin on the cores the other direction's composition needs).

**Rounding** (``u`` the unit round-off; Higham 2002, Sec. 3.1 and 24.1). The moment
:math:`M_{\beta p}` is ``b`` products of ``p + 1`` factors summed, within :math:`(p + b)
u` of its size, at most :math:`h^p` times the block's mass (:math:`h = (b-1)/2`); its FFT
adds :math:`4 u \log_2 L`; the factor :math:`(2\pi k/n)^p / p!` is accurate to ``3 p u``
(its ``(-i)^p`` is exact) and each term of the series, at most :math:`\theta^p/p!`,
carries these errors scaled by its size; summing ``P`` terms adds ``P u`` of their total
:math:`e^\theta`, and the final phase (reduced exactly in integers, ``n`` a power of two)
:data:`_TABLE_UNITS` more. With the masses summing to 1, every entry is within
:math:`e^\theta (4 \log_2 L + b + 6P + 32) u` plus the series' remainder of the exact one
(a few hundred ``u``, against :math:`4 u \log_2 n` for a full FFT). The coarse samples
are rounded up by their own bound (:func:`_coarse_error`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

#: Unit round-offs within which a computed phase ``e^{-2 pi i r / n}`` lies, each part:
#: about 2 pi for the angle's rounding (its product by 2 pi) and a few for the sine or
#: cosine (numpy's are accurate to a few units in the last place).
_TABLE_UNITS = 24.0

_UNIT = float(np.finfo(np.float64).eps) / 2


class SuffixMax:
    """``self[i]``: the largest of ``values[i:]`` and ``last`` (``last`` alone from
    ``values.size`` on), for ``i`` from 0 to ``size - 1 = values.size``.

    :class:`DeadBound` reads its suffix at a few dozen frequencies per group; a suffix
    array as long as the spectrum (2^18 entries at 2^19 points) cost two passes that
    write it, a third of the groups' bookkeeping at small q. Here one pass takes the
    maxima of blocks of :data:`_SUFFIX_BLOCK` entries and each read scans at most one
    block: the same floats (a maximum is exact)."""

    def __init__(self, values: np.ndarray, last: float):
        self.values, self.last, self.size = values, float(last), values.size + 1
        whole = values.size // _SUFFIX_BLOCK * _SUFFIX_BLOCK
        blocks = values[:whole].reshape(-1, _SUFFIX_BLOCK).max(axis=1) if whole else np.empty(0)
        if whole < values.size:
            blocks = np.append(blocks, values[whole:].max())
        self.blocks = np.maximum.accumulate(np.append(blocks, self.last)[::-1])[::-1]

    def __getitem__(self, i: int) -> float:
        i = int(i)
        if not 0 <= i < self.size:
            raise IndexError(i)
        block = i // _SUFFIX_BLOCK
        head = self.values[i:min((block + 1) * _SUFFIX_BLOCK, self.values.size)]
        rest = float(self.blocks[min(block + 1, self.blocks.size - 1)])
        return max(float(head.max()), rest) if head.size else rest


#: Entries per block of :class:`SuffixMax`.
_SUFFIX_BLOCK = 512


class DeadBound(NamedTuple):
    """Where a group's composed transform is dead, and how small its rows are beyond.

    Every row's modulus is at most the group's threshold :math:`e^{-dead/N}` at every
    frequency from ``end`` on, and at most ``suffix[i]`` at every frequency whose nearest
    sample (a multiple of ``step``) is ``i`` or later (:meth:`at`; ``suffix`` an array,
    or a :class:`SuffixMax`)."""

    end: int
    suffix: np.ndarray | SuffixMax
    step: int

    def at(self, k: int) -> float:
        """A bound on every row's modulus at frequencies ``k`` and above."""
        return float(self.suffix[min((k + self.step // 2) // self.step, self.suffix.size - 1)])


def sampled_bounds(rows: list, groups: list, counts: list, n: int, dead: float) -> list | None:
    """Each group's :class:`DeadBound`, from coarse samples of its rows' transforms.

    ``rows``: ``(first, masses)`` per distribution (non-negative masses summing to 1 at
    grid indices ``first + j``, modulo ``n``); ``groups``: tuples of row indices;
    ``counts``: each group's number of steps ``N``. A group of one step is never dead
    (its bound is 1 everywhere). Returns None where samples cannot gain on a full FFT
    (grids under 2^14 points, or no group of two steps or more).
    """
    cut = [count >= 2 for count in counts]
    if not rows or not any(cut):
        return None
    # Just below e^(-dead / N), so that N log(bound) <= -dead survives rounding.
    thresholds = [math.exp(-dead / count) * (1.0 - 1e-9) if ok else 1.0 for count, ok in zip(counts, cut)]
    spread = np.array([_first_moment(masses) for _, masses in rows])
    s = _sample_step(n, 1.0 - max(t for t, ok in zip(thresholds, cut) if ok), float(spread.max()))
    if s is None:
        return None
    coarse = _coarse_moduli(rows, n, s) + (math.pi * s / n) * spread[:, None] * (1.0 + 1e-9)
    out = []
    for group, threshold, ok in zip(groups, thresholds, cut):
        worst = coarse[list(group)].max(axis=0) if ok else np.full(n // (2 * s) + 1, 1.0 + 1e-9)
        failing = np.flatnonzero(worst > threshold)
        last = int(failing[-1]) if failing.size else 0
        suffix = np.maximum.accumulate(worst[::-1])[::-1]
        suffix.setflags(write=False)
        out.append(DeadBound(min(s * last + s // 2 + 1, n // 2 + 1), suffix, s))
    return out


def refined(bound: DeadBound, spectra: np.ndarray | None, count: int, dead: float, error: float,
            modulus: np.ndarray | None = None) -> DeadBound:
    """``bound`` sharpened by a group's rows' transforms ``spectra`` (each within ``error``)
    at the frequencies below its length: the group is dead past its last frequency there
    whose modulus may exceed the threshold, if ``bound`` holds everything beyond (else
    it ends where ``bound`` does); either way its suffix bounds are those moduli (the
    groups together may die where none does alone: ``pld._combined_end``). ``bound``
    itself for a group of one step. ``modulus``: the rows' largest modulus at each
    frequency, where the caller has it (``spectra`` is then not read)."""
    if count < 2 or (spectra.shape[1] if modulus is None else modulus.size) == 0:
        return bound
    if modulus is None:
        modulus = np.abs(spectra).max(axis=0)
    threshold = math.exp(-dead / count) * (1.0 - 1e-9)
    modulus = modulus + error
    live = np.flatnonzero(modulus > threshold)
    cut = int(live[-1]) + 1 if live.size else 1
    beyond = bound.at(modulus.size)  # past the transforms given: what ``bound`` says there
    if modulus.size >= bound.end:
        beyond = min(beyond, threshold)  # (``bound`` holds the threshold from its end on)
    suffix = SuffixMax(modulus, beyond)
    if cut >= bound.end or not suffix[cut] <= threshold:
        return DeadBound(bound.end, suffix, 1)
    return DeadBound(cut, suffix, 1)


def direct_pays(rows: list, n: int, size: int) -> bool:
    """Whether :func:`low_transform` of ``rows`` up to ``size`` costs at most a quarter of
    their full FFTs (its transforms move more memory per point, measured): per row ``P``
    transforms of the ``L = n / b`` blocks and ``P`` passes over its masses and over the
    ``size`` frequencies, against one transform of ``n`` points."""
    if not 0 < size < n // 2 + 1:
        return False
    b, terms = _blocking(n, size)
    length = n // b
    direct = sum(terms * (length * math.log2(length) + masses.size + size) for _, masses in rows)
    return b >= 2 and direct <= 0.25 * len(rows) * n * math.log2(n)


def _first_moment(masses: np.ndarray) -> float:
    r"""An upper bound on :math:`\sum_j x_j |j - c|` about the median index ``c``."""
    if masses.size == 0:
        return 0.0
    centre = int(np.searchsorted(np.cumsum(masses), 0.5 * masses.sum()))
    offsets = np.abs(np.arange(masses.size) - centre)
    return float((masses * offsets).sum()) * (1.0 + 1e-9) + 1e-300


def _sample_step(n: int, gap: float, spread: float) -> int | None:
    """The spacing ``s`` of coarse samples (a power of two): the largest whose slack
    ``pi s A / n`` stays within ``gap`` (between the threshold and 1), at most ``n / 1024``
    and at least 16 (None for grids too small to gain from samples)."""
    s = n // 1024
    while s > 16 and math.pi * s * spread / n > gap:
        s //= 2
    return s if s >= 16 else None


def _coarse_moduli(rows: list, n: int, s: int) -> np.ndarray:
    """Upper bounds on ``|X_{s i}|`` for ``i = 0 .. L / 2`` (``L = n / s``), per row: the
    rfft of the masses folded modulo ``L``, rounded up by its error bound."""
    size = n // s
    folded = np.zeros((len(rows), size))
    for row, (first, masses) in enumerate(rows):
        wraps = -(-masses.size // size)
        padded = np.zeros(wraps * size)
        padded[:masses.size] = masses
        folded[row] = np.roll(padded.reshape(wraps, size).sum(axis=0), first % size)
    moduli = np.abs(np.fft.rfft(folded, axis=1))
    return moduli + _coarse_error(size, max(masses.size for _, masses in rows))


def _coarse_error(size: int, longest: int) -> float:
    """The entrywise error of :func:`_coarse_moduli`: the fold adds at most
    ``ceil(longest / size)`` masses per entry, the FFT :math:`4 u \\log_2 L`, the modulus a
    few more."""
    return (4.0 * math.log2(size) + -(-longest // size) + 8.0) * _UNIT * (1.0 + 1e-6)


def low_transform(rows: list, n: int, size: int) -> tuple[np.ndarray, float]:
    """``(spectra, error)``: the first ``size`` entries of each row's rfft of length ``n``
    (masses placed at ``first`` modulo ``n``), by block moments (see the module
    docstring), and the bound on each entry's error (masses summing to at most 1). Rows
    go in chunks whose moments hold at most :data:`_CHUNK_POINTS` numbers."""
    b, terms = _blocking(n, size)
    theta = math.pi * b * size / n
    length = n // b
    k = np.arange(size)
    # (-2 pi i k / n)^p / p!: real magnitudes by recurrence, times (-i)^p exactly.
    scale = np.empty((terms, size))
    scale[0] = 1.0
    for p in range(1, terms):
        scale[p] = scale[p - 1] * (2.0 * math.pi * k / n) / p
    series = scale * np.array([1.0, -1j, -1.0, 1j])[np.arange(terms) % 4][:, None]
    folded = k % length
    mirrored = folded > length // 2
    index = np.where(mirrored, length - folded, folded)
    chunk = max(1, _CHUNK_POINTS // (terms * length))
    spectra = np.concatenate([_moment_sums(rows[start:start + chunk], b, terms, length, series, index, mirrored)
                              for start in range(0, len(rows), chunk)])
    # Each block's centre is first + beta b + (b - 1) / 2: the phase of first + (b - 1) / 2.
    centres = 2 * np.array([first for first, _ in rows], dtype=np.int64) + (b - 1)
    angles = _angles(centres % (2 * n), 1, size, 2 * n)
    spectra *= np.cos(angles) - 1j * np.sin(angles)
    error = math.exp(theta) * (4.0 * math.log2(length) + b + 6.0 * terms + _TABLE_UNITS + 8.0) * _UNIT
    return spectra, error * (1.0 + 1e-6) + _taylor_tail(theta, terms)


#: Numbers of block moments transformed at once by :func:`low_transform`.
_CHUNK_POINTS = 2**20


def _moment_sums(rows: list, b: int, terms: int, length: int, series: np.ndarray, index, mirrored) -> np.ndarray:
    """For :func:`low_transform`: per row, the series over ``p`` of ``series[p]`` times the
    transform along the blocks of its moments of order ``p``, at frequencies ``index``
    (conjugated where ``mirrored``), before the phase of the row's first block."""
    counts = [-(-masses.size // b) for _, masses in rows]
    stacked = np.zeros((sum(counts), b))
    flat = stacked.reshape(-1)
    start = 0
    for count, (_, masses) in zip(counts, rows):
        flat[start * b:start * b + masses.size] = masses
        start += count
    # Moments about each block's centre, sum_i x_i d_i^p: placed at their blocks (folded
    # modulo the L blocks of the circle) and transformed along the blocks.
    offsets = np.arange(b) - (b - 1) / 2.0
    moments = np.zeros((len(rows), terms, length))
    row_of = np.repeat(np.arange(len(rows)), counts)
    block_of = np.concatenate([np.arange(count) for count in counts]) % length
    for p in range(terms):
        np.add.at(moments[:, p, :], (row_of, block_of), stacked.sum(axis=1))
        stacked *= offsets
    taken = np.fft.rfft(moments, axis=2)[:, :, index]  # rows x terms x frequencies
    taken[:, :, mirrored] = np.conj(taken[:, :, mirrored])
    return np.einsum("pk,rpk->rk", series, taken)


def _blocking(n: int, size: int) -> tuple[int, int]:
    """``(b, P)``: the block size (a power of two, ``theta = pi b size / n`` at most 1, at
    most 1024) and the number of Taylor terms whose remainder is below 2^-64."""
    b = 1
    while b < 1024 and math.pi * 2 * b * size <= n:
        b *= 2
    theta = math.pi * b * size / n
    terms = 1
    while _taylor_tail(theta, terms) > 2.0**-64:
        terms += 1
    return b, terms


def _taylor_tail(theta: float, terms: int) -> float:
    r"""A bound on :math:`\sum_{p \ge P} \theta^p / p!` for ``P = terms`` and ``theta <= 1``."""
    first = theta**terms / math.factorial(terms)
    return first / (1.0 - theta / (terms + 1)) * (1.0 + 1e-12)


def _angles(offsets: np.ndarray, stride: int, columns: int, n: int) -> np.ndarray:
    """``2 pi ((offset * k) mod n) / n`` for each offset (rows) and ``k < columns``
    (``stride`` scales ``k``), reduced exactly in integers (``n`` below 2^31)."""
    k = np.arange(columns, dtype=np.int64) * stride
    return ((np.outer(offsets % n, k) % n) / n) * (2.0 * math.pi)
