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

The ``check_*`` helpers validate one argument each and raise :class:`ValueError` naming
it, so an error always says which argument was wrong and what it was.
"""

from __future__ import annotations

import abc
import math
import numbers
from collections.abc import Iterable
from typing import NamedTuple

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


def check_noise_multiplier(value, name: str = "noise_multiplier") -> float:
    """Return ``value`` as a float after checking ``value >= 0`` (``inf`` allowed).

    ``0`` means no noise (epsilon is infinite as soon as a step is taken); ``inf`` means a
    step that reveals nothing.
    """
    value = _as_real(value, name)
    if math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def check_sample_rate(value, name: str = "sample_rate") -> float:
    """Return ``value`` as a float after checking ``0 < value <= 1``."""
    value = _as_real(value, name)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return value


def check_delta(value, name: str = "delta") -> float:
    """Return ``value`` as a float after checking ``0 < value < 1``."""
    value = _as_real(value, name)
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return value


def check_epsilon(value, name: str = "epsilon", *, positive: bool = False) -> float:
    """Return ``value`` as a float after checking ``value >= 0`` (``> 0`` if ``positive``)."""
    value = _as_real(value, name)
    if math.isnan(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


def check_count(value, name: str = "count") -> int:
    """Return ``value`` as an int after checking it is a non-negative integer.

    Integral floats such as ``1e4`` are accepted; ``1.5``, ``nan``, ``True`` and negative
    numbers are not.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if isinstance(value, numbers.Integral):
        result = int(value)
    else:
        as_float = float(value)
        if not (math.isfinite(as_float) and as_float.is_integer()):
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        result = int(as_float)
    if result < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return result


def _as_real(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    return float(value)


class Run(NamedTuple):
    """``count`` consecutive steps of the Poisson-subsampled Gaussian mechanism."""

    noise_multiplier: float
    sample_rate: float
    count: int

    @classmethod
    def checked(cls, noise_multiplier, sample_rate, count=1) -> Run:
        """Build a run after validating every field (raises ValueError naming the field)."""
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
        merged: list[Run] = []
        for item in runs:
            _append(merged, Run.checked(*_unpack(item)))
        self._runs = tuple(merged)

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


#: Distinct (sigma, q) pairs an accountant composes exactly; see :func:`coarsen_runs`.
MAX_DISTINCT_RUNS = 64


def coarsen_runs(runs, max_distinct: int | None = None) -> list[tuple[float, float, int]]:
    r"""``(sigma, q, count)`` per distinct ``(sigma, q)``, at most ``max_distinct`` of them
    (default :data:`MAX_DISTINCT_RUNS`).

    Composition does not depend on the order of the steps, so equal pairs anywhere in the
    ledger merge exactly. A ledger with more distinct pairs than ``max_distinct`` (a
    schedule that changes at every step, say) is coarsened *pessimistically*: each sigma
    is rounded down and each q up to a common geometric grid, as fine as the limit
    allows. That can only cost more privacy. The accountants work with the pair of
    output distributions that dominates one step, :math:`P = (1-q)\mathcal N(0, \sigma^2)
    + q\mathcal N(1, \sigma^2)` against :math:`Q = \mathcal N(0, \sigma^2)` (and the
    reverse), and that pair is a post-processing of the one for ``sigma' <= sigma`` and
    ``q' >= q``: add noise of variance ``sigma^2 - sigma'^2``, and keep the output with
    probability ``q / q'``, else replace it by a fresh draw from Q (this maps P' to P and
    Q to Q). So every bound computed from the coarsened ledger holds for the original.
    """
    max_distinct = MAX_DISTINCT_RUNS if max_distinct is None else max_distinct
    runs = [(float(sigma), float(q), int(count)) for sigma, q, count in runs if count]
    ratio = 1.0
    while True:
        merged: dict[tuple[float, float], int] = {}
        for sigma, q, count in runs:
            if ratio > 1.0 and 0.0 < sigma < math.inf:
                sigma = _round_down(sigma, ratio)
            if ratio > 1.0:
                q = min(1.0, _round_up(q, ratio))
            merged[(sigma, q)] = merged.get((sigma, q), 0) + count
        if len(merged) <= max_distinct:
            return [(sigma, q, count) for (sigma, q), count in merged.items()]
        ratio = 1.001 if ratio == 1.0 else ratio**1.5


def _round_down(value: float, ratio: float) -> float:
    rounded = ratio ** math.floor(math.log(value, ratio))
    return rounded if rounded <= value else rounded / ratio


def _round_up(value: float, ratio: float) -> float:
    rounded = ratio ** math.ceil(math.log(value, ratio))
    return rounded if rounded >= value else rounded * ratio


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
