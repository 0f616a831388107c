"""Warnings about how the batches are drawn, from what a DP optimizer sees at each step:
batch sizes that look fixed while the accounting assumes Poisson sampling, and a mean
batch size far from ``expected_batch_size``. Neither changes what is computed."""

from __future__ import annotations

import math
import os
import sys
import warnings

import torch

from .errors import PrivacyWarning

__all__ = ["BatchSizeWatchMixin"]

# Steps with the same batch size after which Poisson sampling is implausible (see _watch_batch_size).
_FIXED_SIZE_STEPS = 32


class _SizeWatch:
    """State of :meth:`BatchSizeWatchMixin._watch_batch_size`: the last batch size, how many
    steps in a row had it, and whether the warning was given."""

    __slots__ = ("last", "run", "warned")

    def __init__(self):
        self.last, self.run, self.warned = None, 0, False


class _MeanWatch:
    """State of :meth:`BatchSizeWatchMixin._watch_mean_batch_size`: the expected size being
    watched, the steps and examples counted against it, and whether the warning was given."""

    __slots__ = ("expected", "steps", "examples", "warned")

    def __init__(self, expected=None):
        self.expected, self.steps, self.examples, self.warned = expected, 0, 0, False


class BatchSizeWatchMixin:
    """The batch-size warnings of a DP optimizer (``self._size_watch``, ``self._mean_watch``)."""

    def _init_watches(self) -> None:
        self._size_watch = _SizeWatch()
        self._mean_watch = _MeanWatch()

    def _watch_batch_size(self, examples: int, q: float, local_expected: float) -> None:
        """Warn once if the batch size looks fixed while the accounting assumes Poisson sampling.

        Under Poisson sampling with variance ``B (1 - q) >= 1`` two batches have the same
        size with probability below about 0.4, so 32 equal sizes in a row happen by chance
        with probability below 1e-12: the batches come from a fixed-size loader.
        """
        watch = self._size_watch
        if watch.warned or q >= 1 or examples == 0:
            return
        watch.run = watch.run + 1 if examples == watch.last else 1
        watch.last, run = examples, watch.run
        if run >= _FIXED_SIZE_STEPS and local_expected * (1 - q) >= 1:
            watch.warned = True
            warnings.warn(
                f"the last {run} batches all had {examples} examples, but the privacy accounting "
                f"assumes Poisson sampling (sample_rate={q}), whose batch sizes vary. A shuffled "
                "fixed-size DataLoader is a different mechanism and the reported epsilon does not "
                "apply to it. Use dpoptim.data.poisson_loader(dataset, sample_rate=q).",
                PrivacyWarning,
                stacklevel=_caller_stacklevel(),
            )

    def _watch_mean_batch_size(self, examples: int, local_expected: float) -> None:
        """Warn once if the mean batch size is far from ``expected_batch_size``.

        The divisor B only scales the update, so privacy holds either way, but a B far from
        the real mean batch size (a wrong sample_rate or dataset_size) makes the update too
        small or too large and suggests the accounting uses the wrong rate. Under Poisson
        sampling the mean of k batch sizes has standard deviation below sqrt(B / k): the
        bound below (5 of those plus 5%) is practically never crossed by chance.
        """
        watch = self._mean_watch
        if watch.warned:
            return
        if watch.expected != local_expected:
            watch = self._mean_watch = _MeanWatch(local_expected)
        watch.steps, watch.examples = watch.steps + 1, watch.examples + examples
        expected, steps, mean = watch.expected, watch.steps, watch.examples / watch.steps
        if steps >= 50 and abs(mean - expected) > 5 * math.sqrt(expected / steps) + 0.05 * expected:
            watch.warned = True
            warnings.warn(
                f"expected_batch_size is {expected:g} (per process) but the last {steps} batches held "
                f"{mean:.1f} examples on average: check sample_rate and dataset_size (with "
                "dpoptim.data.poisson_loader, pass **dpoptim.data.privacy_kwargs(loader)).",
                PrivacyWarning,
                stacklevel=_caller_stacklevel(),
            )


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside dpoptim and torch (the user's step() call,
    however many wrappers torch and LR schedulers put around it)."""
    skip = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    return level
