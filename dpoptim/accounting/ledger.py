"""The privacy ledger: what was run, as runs of identical steps.

Every step of DP training here is one *Poisson-subsampled Gaussian mechanism*: each
example joins the batch independently with probability ``q`` (the sample rate) and the
clipped gradient sum receives Gaussian noise of standard deviation ``sigma * C`` (``sigma``
is the noise multiplier, ``C`` the clipping norm). Neighbouring datasets differ by adding
or removing one example.

A training run is summarised by a ledger: a tuple of :class:`Run` ``(sigma, q, count)``
meaning ``count`` consecutive steps with the same ``sigma`` and ``q``. Consecutive identical
runs merge, so a run of 100,000 identical steps is one entry and every accountant composes
it at once. Ledgers are plain values: :meth:`Ledger.compose` returns a new ledger and never
changes the old one.

Arguments are validated by :mod:`dpoptim.validate` (re-exported here as ``check_*``),
the same functions the optimizers use: an error always names the argument.
"""

from __future__ import annotations

import abc
import functools
import heapq
import math
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from .. import validate
from .special import log_expm1

__all__ = [
    "Run",
    "Ledger",
    "Accountant",
    "check_noise_multiplier",
    "check_sample_rate",
    "check_delta",
    "check_count",
    "check_epsilon",
    "coarsen_runs",
    "MAX_DISTINCT_RUNS",
]


# The validators live in dpoptim.validate, shared with the optimizers; these names stay
# for the accounting modules and for code that imported them from here.
check_noise_multiplier = validate.noise_multiplier
check_sample_rate = validate.sample_rate
check_delta = validate.delta
check_epsilon = validate.epsilon
check_count = validate.count


class Run(NamedTuple):
    """``count`` consecutive steps of the Poisson-subsampled Gaussian mechanism."""

    noise_multiplier: float
    sample_rate: float
    count: int

    @classmethod
    def checked(cls, noise_multiplier, sample_rate, count=1) -> Run:
        """Build a run after validating every field (raises ValueError naming the field)."""
        if (type(noise_multiplier) is float and type(sample_rate) is float and type(count) is int
                and noise_multiplier >= 0.0 and 0.0 < sample_rate <= 1.0 and count >= 0):
            return cls(noise_multiplier, sample_rate, count)  # the common case, already valid
        return cls(
            check_noise_multiplier(noise_multiplier),
            check_sample_rate(sample_rate),
            check_count(count),
        )


class Ledger:
    """An immutable run-length record of the mechanisms applied so far.

    ``Ledger().compose(1.0, 0.01, 500).compose(1.0, 0.01, 500).runs`` is
    ``(Run(1.0, 0.01, 1000),)``: consecutive identical runs merge, runs of zero steps are
    dropped. Non-consecutive runs are kept apart (order is part of the record), although
    neither accountant's answer depends on the order.
    """

    __slots__ = ("_runs",)

    def __init__(self, runs: Iterable = ()):
        if isinstance(runs, Ledger):  # already validated and merged
            self._runs = runs._runs
            return
        self._runs = _merged_runs(runs)

    @classmethod
    def _trusted(cls, runs: tuple) -> Ledger:
        """A ledger of runs taken from validated ledgers, without checking them again."""
        result = cls.__new__(cls)
        result._runs = tuple(runs)
        return result

    @property
    def runs(self) -> tuple[Run, ...]:
        return self._runs

    @property
    def steps(self) -> int:
        return sum(run.count for run in self._runs)

    def compose(self, noise_multiplier, sample_rate, count=1) -> Ledger:
        """Return a new ledger with ``count`` more steps at ``(noise_multiplier, sample_rate)``."""
        run = Run.checked(noise_multiplier, sample_rate, count)
        merged = list(self._runs)
        _append(merged, run)
        result = Ledger.__new__(Ledger)
        result._runs = tuple(merged)
        return result

    def __iter__(self):
        return iter(self._runs)

    def __len__(self) -> int:
        return len(self._runs)

    def __eq__(self, other) -> bool:
        return isinstance(other, Ledger) and self._runs == other._runs

    def __hash__(self) -> int:
        return hash(self._runs)

    def __repr__(self) -> str:
        return f"Ledger({list(self._runs)!r})"


def _merged_runs(runs: Iterable) -> tuple[Run, ...]:
    """Validated runs, consecutive identical ones merged and empty ones dropped.

    Plain ``(float, float, int)`` triples that are already valid skip the validators:
    a ledger of 10^4 runs builds in a few milliseconds.
    """
    make = tuple.__new__
    merged: list[Run] = []
    last = None
    for item in runs:
        sigma, q, count = _unpack(item)
        if not (type(sigma) is float and type(q) is float and type(count) is int
                and sigma >= 0.0 and 0.0 < q <= 1.0 and count >= 0):
            sigma, q, count = Run.checked(sigma, q, count)
        if count == 0:
            continue
        if last == (sigma, q):
            merged[-1] = make(Run, (sigma, q, merged[-1][2] + count))
        else:
            merged.append(make(Run, (sigma, q, count)))
            last = (sigma, q)
    return tuple(merged)


def _unpack(item) -> tuple:
    try:
        noise_multiplier, sample_rate, count = item
    except (TypeError, ValueError):
        raise ValueError(
            f"a ledger entry must be a (noise_multiplier, sample_rate, count) triple, got {item!r}"
        ) from None
    return noise_multiplier, sample_rate, count


def _append(runs: list, run: Run) -> None:
    if run.count == 0:
        return
    if runs and runs[-1][:2] == run[:2]:
        runs[-1] = runs[-1]._replace(count=runs[-1].count + run.count)
    else:
        runs.append(run)


#: Most groups of ``(sigma, q)`` pairs an accountant composes; see :func:`coarsen_runs`.
MAX_DISTINCT_RUNS = 64

#: Share of the ledger's privacy cost (the proxy of :func:`_step_cost`) that grouping may
#: add without being forced to by :data:`MAX_DISTINCT_RUNS`: merges this cheap are taken
#: even below the limit, because every group costs composition time.
FREE_MERGE_SHARE = 2e-4


def coarsen_runs(runs, max_distinct: int | None = None, *, optimistic: bool = False,
                 order: int | tuple = 2) -> list[tuple[float, float, int]]:
    r"""``(sigma, q, count)`` per group of ``(sigma, q)`` pairs, at most ``max_distinct``
    groups (default :data:`MAX_DISTINCT_RUNS`).

    Composition does not depend on the order of the steps, so equal pairs anywhere in the
    ledger merge exactly. Beyond that, pairs are *grouped*, and every step of a group is
    accounted as the group's smallest sigma with its largest q. That can only cost more
    privacy. The accountants work with the pair of output distributions that dominates
    one step, :math:`P = (1-q)\mathcal N(0, \sigma^2) + q\mathcal N(1, \sigma^2)` against
    :math:`Q = \mathcal N(0, \sigma^2)` (and the reverse), and that pair is a
    post-processing of the one for ``sigma' <= sigma`` and ``q' >= q``: add noise of
    variance ``sigma^2 - sigma'^2``, and keep the output with probability ``q / q'``,
    else replace it by a fresh draw from Q (this maps P' to P and Q to Q). So every bound
    computed from the grouped ledger holds for the original (post-processing, Blackwell
    order; it survives composition).

    Which pairs share a group is decided by cost, not by a uniform rounding: pairs are
    ordered by ``(q, sigma)`` and neighbouring groups merged greedily, cheapest first,
    where the cost of a group is what rounding adds to a proxy of its privacy loss
    (:func:`_step_costs`: by default the order-2 Renyi divergence of one step, which grows
    like the variance of the privacy loss; at a higher integer ``order``, or a blend of
    orders, where the caller knows which orders decide epsilon). Merging stops once at
    most ``max_distinct`` groups are left and the next merge would cost more than
    :data:`FREE_MERGE_SHARE` of the whole ledger's cost, by this proxy or by the one for
    orders near 1 (:func:`_near_one_costs`).
    A step of negligible cost (one step at sigma = 100 after 50,000 at sigma = 1) is
    merged for free; a schedule that changes at every step loses only what the limit
    forces. The proxy only steers *which* pairs merge: soundness does not
    depend on it.

    ``optimistic=True`` returns the same groups with the largest sigma and the smallest q
    instead: a ledger that the original dominates, for lower bounds in tests and
    benchmarks (never for reporting).

    The PLD accountant may account a group as mixtures of its four corners instead
    (:mod:`.mixture`), where that costs less by the same proxy.
    """
    max_distinct = MAX_DISTINCT_RUNS if max_distinct is None else max_distinct
    if isinstance(runs, Ledger):
        runs = runs.runs
    if isinstance(runs, tuple) and all(type(run) is Run for run in runs):
        key = runs  # validated: floats and ints already
    else:
        key = tuple((float(sigma), float(q), int(count)) for sigma, q, count in runs)
    return list(_coarsen(key, max_distinct, optimistic, order))


@functools.lru_cache(maxsize=64)
def _coarsen(runs: tuple, max_distinct: int, optimistic: bool, order: int | tuple = 2) -> tuple:
    special, groups = member_groups(runs, max_distinct, optimistic, order)
    out = list(special)
    for members in groups:
        sigmas = [sigma for sigma, _, _ in members]
        rates = [q for _, q, _ in members]
        count = sum(c for _, _, c in members)
        if optimistic:
            out.append((max(sigmas), min(rates), count))
        else:
            out.append((min(sigmas), max(rates), count))
    return tuple(out)


@functools.lru_cache(maxsize=64)
def member_groups(runs: tuple, max_distinct: int, optimistic: bool = False,
                  order: int | tuple = 2) -> tuple[tuple, tuple]:
    """``(special, groups)``: the runs of ``sigma = 0`` or ``inf`` (kept as they are), and
    the groups :func:`coarsen_runs` forms of the others (at the proxy's ``order``), each
    a tuple of its distinct ``(sigma, q, count)`` members (equal pairs merged), at most
    ``max_distinct`` groups in all. ``runs`` holds ``(sigma, q, count)`` floats and ints."""
    special, items, rounded = _ordered_pairs(runs)
    # The partition depends on the pairs and the rounded counts only: a ledger grown by a
    # step usually finds it cached. The merges it takes for free are cheap pessimistically
    # (a few steps at a group's smallest sigma), not optimistically: a lower bound keeps
    # every pair it has room for.
    limit = max(1, max_distinct - len(special))
    if len(items) <= 1 or (optimistic and len(items) <= limit):
        sizes = (1,) * len(items)
    else:
        sizes = _partition(rounded, limit, order)
    groups, start = [], 0
    for size in sizes:
        groups.append(tuple((sigma, q, count) for (sigma, q), count in items[start:start + size]))
        start += size
    return special, tuple(groups)


@functools.lru_cache(maxsize=8)
def _ordered_pairs(runs: tuple) -> tuple[tuple, tuple, tuple]:
    """For :func:`member_groups` (which asks it at several limits for one ledger):
    ``(special, items, rounded)``, the runs of ``sigma = 0`` or ``inf``, the other distinct
    pairs with their summed counts (``((sigma, q), count)``, ordered by ``(q, sigma)``), and
    the same with counts rounded to quarter octaves (the partition's key)."""
    merged: dict[tuple[float, float], int] = {}
    for sigma, q, count in runs:
        if count:
            key = (float(sigma), float(q))
            merged[key] = merged.get(key, 0) + int(count)
    # sigma = 0 (no guarantee) and sigma = inf (nothing revealed) stay as they are.
    special = tuple((sigma, q, count) for (sigma, q), count in merged.items() if sigma == 0.0 or math.isinf(sigma))
    items = tuple(sorted(
        ((key, count) for key, count in merged.items() if 0.0 < key[0] < math.inf),
        key=lambda item: (item[0][1], item[0][0]),
    ))
    return special, items, tuple((key, _nearest_quarter_octave(count)) for key, count in items)


def _step_cost(sigma: float, q: float, order: int | tuple = 2) -> float:
    """:func:`_step_costs` of one pair, in scalar arithmetic at order 2 (the greedy merge's
    inner loop calls it a few thousand times; numpy's per-call cost would dominate)."""
    if isinstance(order, tuple):  # a blend: see _step_costs
        return sum(weight * _step_cost(sigma, q, part) for part, weight in order)
    if order != 2:
        return _step_cost_at(float(sigma), float(q), order)
    square = float(sigma) * float(sigma)
    exponent = 1.0 / square if square > 1.0 / _LARGEST_EXPONENT else _LARGEST_EXPONENT
    if q <= 0.0:
        return 0.0
    log_chi_square = 2.0 * math.log(q) + exponent + math.log(-math.expm1(-exponent))
    if log_chi_square > 0.0:
        return log_chi_square + math.log1p(math.exp(-log_chi_square))
    return math.log1p(math.exp(log_chi_square))


@functools.lru_cache(maxsize=4096)
def _step_cost_at(sigma: float, q: float, order: int) -> float:
    """:func:`_step_costs` of one pair at an order other than 2 (pairs recur in the greedy)."""
    return float(_step_costs(np.array([sigma]), np.array([q]), order)[0])


def _step_costs(sigma: np.ndarray, q: np.ndarray, order: int | tuple = 2) -> np.ndarray:
    r"""Proxy of one step's privacy cost, per pair: its Renyi divergence at ``order`` times
    ``order - 1``, the log of the moment :math:`A_\alpha` of the subsampled Gaussian
    (Mironov, Talwar & Zhang 2019), computed in logs so that it keeps growing as sigma
    shrinks. At order 2, log(1 + q^2 (e^{1/sigma^2} - 1)) from the chi-square divergence
    (about 1/sigma^2 + 2 log q once that is large).

    For moderate sigma this is the chi-square itself, which grows like the variance of
    the privacy loss. The chi-square alone grows like e^{1/sigma^2}: a few steps at sigma
    0.2 would outweigh thousands at sigma 1.7 by a factor of 10^4, and merges that moved
    epsilon by 28% looked free next to them. A cap on the exponent has the opposite
    fault: every sigma below the cap costs the same, so merging them looks free.

    Other integer orders take the binomial expansion :math:`A_\alpha = \sum_k
    \binom{\alpha}{k} (1-q)^{\alpha-k} q^k e^{k(k-1)/(2\sigma^2)}` (their Sec. 3.3), in logs;
    its rounding is not bounded, as the proxy only steers the grouping.

    ``order`` may also be a blend, ``((order, weight), ...)``: the weighted sum of those
    orders' proxies (:func:`~dpoptim.accounting.mixture.grouping_blend`)."""
    if isinstance(order, tuple):
        return sum(weight * _step_costs(sigma, q, part) for part, weight in order)
    with np.errstate(divide="ignore", over="ignore"):
        exponent = np.minimum(1.0 / (sigma * sigma), _LARGEST_EXPONENT)
        if order == 2:
            return np.logaddexp(0.0, 2.0 * np.log(q) + log_expm1(exponent))
    k = np.arange(order + 1, dtype=float)
    log_factorials = np.concatenate([[0.0], np.cumsum(np.log(k[1:]))])  # (no scipy import for a proxy)
    log_binom = log_factorials[order] - log_factorials - log_factorials[::-1]
    rates = np.asarray(q, dtype=float)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = (log_binom + np.where(k < order, (order - k) * np.log1p(-rates), 0.0) + k * np.log(rates)
                 + 0.5 * k * (k - 1.0) * np.asarray(exponent, dtype=float)[:, None])
    peak = terms.max(axis=1)
    return peak + np.log(np.exp(terms - peak[:, None]).sum(axis=1))


#: 1/sigma^2 beyond this (sigma below 1e-125, no privacy at all) counts as this much, so
#: that counts times costs stay finite.
_LARGEST_EXPONENT = 1e250


@functools.lru_cache(maxsize=64)
def _partition(items: tuple, max_distinct: int, order: int | tuple = 2) -> tuple:
    """Sizes of the consecutive groups :func:`_merge_groups` forms from ``items``."""
    return tuple(_merge_groups(list(items), max_distinct, order))


def _nearest_quarter_octave(value: float) -> float:
    """``value`` (positive) rounded to the nearest power of 2^(1/4)."""
    return 2.0 ** (round(4.0 * math.log2(value)) / 4.0)


class _Groups:
    """Consecutive groups of ordered pairs: per group its size, step count, summed own
    cost ``sum c_r w_r``, smallest sigma and largest q."""

    def __init__(self, items: list, order: int | tuple = 2):
        self.order = order
        self.sizes = np.ones(len(items), dtype=np.int64)
        self.counts = np.array([count for _, count in items], dtype=float)
        self.sigmas = np.array([key[0] for key, _ in items], dtype=float)
        self.rates = np.array([key[1] for key, _ in items], dtype=float)
        self.weights = self.counts * _step_costs(self.sigmas, self.rates, order)

    def own_costs(self) -> np.ndarray:
        """What accounting each group at its smallest sigma and largest q adds to the proxy."""
        return self.counts * _step_costs(self.sigmas, self.rates, self.order) - self.weights


def _premerge(groups: _Groups, target: int) -> float:
    """Consecutive groups joined into ``target`` runs of about equal length, by position
    alone, except that a heavy group stays apart: one with more than a ``target``-th of
    the ledger's steps, or more than :data:`_HEAVY_SHARE` of its summed proxy. Returns
    the cost the joins added (each run at its smallest sigma and largest q, less its
    members' own weights).

    It only makes the greedy of :func:`_merge_groups` fast on long ledgers, which then
    chooses by cost among those runs. By position, so that a small change of the
    ledger keeps them: rounds of the cheapest merges (those below the median cost,
    alternating parity) chose anew with every sigma, and on a schedule of many similar
    pairs the groups changed with them, where epsilon then moved either way by up to a
    few percent between neighbouring ledgers (6,536 pairs of 4 steps from sigma 2.78 at
    q 5.3e-3 to sigma 0.57 at q 3.6e-5, every sigma 0.05% larger at each step, delta
    3.1e-10: at 4 of 9 steps it rose, by up to 4.8%; now it falls by 0.373% at every
    step, docs/accounting.md). A heavy group keeps its own cost: joined to its
    neighbours by position, its steps would take their smallest sigma and largest q, or
    theirs its own."""
    n = groups.sizes.size
    heavy = np.flatnonzero((groups.counts > float(groups.counts.sum()) / target)
                           | (groups.weights > _HEAVY_SHARE * float(groups.weights.sum())))
    cuts = np.unique(np.concatenate([np.arange(1, target) * n // target, heavy, heavy + 1]))
    starts = np.concatenate([[0], cuts[(cuts > 0) & (cuts < n)]])
    groups.sizes = np.add.reduceat(groups.sizes, starts)
    groups.counts = np.add.reduceat(groups.counts, starts)
    groups.weights = np.add.reduceat(groups.weights, starts)
    groups.sigmas = np.minimum.reduceat(groups.sigmas, starts)
    groups.rates = np.maximum.reduceat(groups.rates, starts)
    return float(np.maximum(groups.own_costs(), 0.0).sum())


#: :func:`_premerge` keeps apart a group whose weight is above this share of the ledger's:
#: one step at sigma 0.2 among 10^4 one-step pairs from sigma 1.2 to 0.8 (q about 1e-3,
#: delta 1e-5) joined by position to its neighbours read 21.67, kept apart 16.57.
_HEAVY_SHARE = 1.0 / 16.0

#: Ledgers of more pairs than this many times the group limit are first pre-merged by
#: :func:`_premerge` down to that many groups.
_PREMERGE_FACTOR = 4


def _merge_groups(items: list, max_distinct: int, order: int | tuple = 2) -> list[int]:
    """Sizes of the groups formed by greedy agglomeration of neighbours in ``items``
    (``((sigma, q), count)``, ordered): a heap of neighbour merges by cost, stale
    entries skipped by version numbers; long ledgers are pre-merged by :func:`_premerge`.

    Costs use counts rounded to quarter octaves (by the caller, see :func:`_partition`):
    a ledger that grows by a step (or max_steps' next candidate) then keeps its groups,
    and the transforms cached for them.
    """
    groups = _Groups(items, order)
    free = FREE_MERGE_SHARE * float(groups.weights.sum())
    free_near_one = FREE_MERGE_SHARE * float((groups.counts * _near_one_costs(groups.sigmas, groups.rates)).sum())
    spent = _premerge(groups, _PREMERGE_FACTOR * max_distinct) if len(items) > _PREMERGE_FACTOR * max_distinct else 0.0
    return _greedy(groups, max_distinct, spent, (free, free_near_one))


def _near_one_costs(sigma: np.ndarray, q: np.ndarray) -> np.ndarray:
    r"""A second proxy of one step's cost, for orders near 1 (the KL divergence): at most
    :math:`q / (2\sigma^2)` (joint convexity: a share q of the Gaussian's KL) and at most
    the order-2 proxy (:func:`_step_costs`; Renyi divergences grow with the order).

    Large epsilon at tiny sigma is read at orders near 1 (1.09 for epsilon 450), where a
    step at sigma 0.156 and q 2.4e-5 costs 5e-4 rather than the order-2 proxy's 20: by
    order 2 alone, accounting 16 steps at sigma 1.41 as sigma 0.492 looked free beside
    such a run, and raised epsilon from 423.6 to 448.1."""
    with np.errstate(divide="ignore"):
        return np.minimum(q / (2.0 * sigma * sigma), _step_costs(sigma, q))


def _near_one_cost(sigma: float, q: float) -> float:
    """:func:`_near_one_costs` of one pair, in scalar arithmetic."""
    square = sigma * sigma
    return min(q / (2.0 * square), _step_cost(sigma, q)) if square > 0.0 else _step_cost(sigma, q)


def _greedy(groups: _Groups, max_distinct: int, spent: float, free: tuple) -> list[int]:
    """The cheapest neighbour merge first, until at most ``max_distinct`` groups are left
    and the next merge would bring the cost added (``spent`` so far) past ``free[0]``,
    or the cost those free merges add by :func:`_near_one_costs` past ``free[1]``."""
    n = groups.sizes.size
    sizes = groups.sizes.tolist()
    counts, weights = groups.counts.tolist(), groups.weights.tolist()
    sig_min, q_max = groups.sigmas.tolist(), groups.rates.tolist()
    right, left = list(range(1, n + 1)), list(range(-1, n - 1))  # neighbours
    alive, version = [True] * n, [0] * n

    def own_cost(i):
        return counts[i] * _step_cost(sig_min[i], q_max[i], groups.order) - weights[i]

    costs = [own_cost(i) for i in range(n)]

    def pair_cost(i, j):
        rep = _step_cost(min(sig_min[i], sig_min[j]), max(q_max[i], q_max[j]), groups.order)
        return (counts[i] + counts[j]) * rep - weights[i] - weights[j] - costs[i] - costs[j]

    def near_one_cost(i, j):  # what the merge adds to the accounted groups, by the second proxy
        return (_near_one_cost(min(sig_min[i], sig_min[j]), max(q_max[i], q_max[j])) * (counts[i] + counts[j])
                - _near_one_cost(sig_min[i], q_max[i]) * counts[i] - _near_one_cost(sig_min[j], q_max[j]) * counts[j])

    heap = [(pair_cost(i, i + 1), i, i + 1, 0, 0) for i in range(n - 1)]
    heapq.heapify(heap)
    remaining, spent_near_one = n, 0.0
    while heap and remaining > 1:
        cost, i, j, vi, vj = heap[0]
        if not (alive[i] and alive[j] and version[i] == vi and version[j] == vj and right[i] == j):
            heapq.heappop(heap)
            continue
        if remaining <= max_distinct:
            near_one = near_one_cost(i, j)
            if not (spent + cost <= free[0] and spent_near_one + near_one <= free[1]):
                break  # (a NaN cost is not free either)
            spent_near_one += max(near_one, 0.0)
        heapq.heappop(heap)
        # merge j into i
        sizes[i] += sizes[j]
        counts[i] += counts[j]
        weights[i] += weights[j]
        sig_min[i] = min(sig_min[i], sig_min[j])
        q_max[i] = max(q_max[i], q_max[j])
        costs[i] = own_cost(i)
        spent += max(cost, 0.0)
        alive[j] = False
        version[i] += 1
        right[i] = right[j]
        if right[j] < n:
            left[right[j]] = i
        remaining -= 1
        if left[i] >= 0:
            a = left[i]
            heapq.heappush(heap, (pair_cost(a, i), a, i, version[a], version[i]))
        if right[i] < n:
            b = right[i]
            heapq.heappush(heap, (pair_cost(i, b), i, b, version[i], version[b]))
    return [sizes[i] for i in range(n) if alive[i]]


class Accountant(abc.ABC):
    """Common shape of the accountants: a :class:`Ledger` plus a way to read epsilon off it.

    ``compose`` validates its arguments before touching the ledger, so a rejected call
    leaves the accountant exactly as it was. Subclasses implement :meth:`get_epsilon`.
    """

    #: Short name used by :func:`dpoptim.accounting.make_accountant` and the command line.
    name: str = ""

    def __init__(self) -> None:
        self._ledger = Ledger()

    @classmethod
    def from_ledger(cls, runs, **kwargs) -> Accountant:
        """An accountant holding ``runs`` (``(sigma, q, count)`` triples), e.g. from a checkpoint."""
        accountant = cls(**kwargs)
        accountant._ledger = Ledger(runs)
        return accountant

    def compose(self, noise_multiplier, sample_rate, count=1) -> Accountant:
        """Record ``count`` steps at ``(noise_multiplier, sample_rate)``; returns ``self``."""
        self._ledger = self._ledger.compose(noise_multiplier, sample_rate, count)
        return self

    @property
    def ledger(self) -> tuple[Run, ...]:
        """The runs recorded so far, consecutive identical runs merged."""
        return self._ledger.runs

    @property
    def steps(self) -> int:
        """Total number of steps recorded."""
        return self._ledger.steps

    @abc.abstractmethod
    def get_epsilon(self, delta: float) -> float:
        """The smallest epsilon this accountant can certify at ``delta`` for the ledger."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(ledger={list(self.ledger)!r})"
