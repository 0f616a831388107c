"""Validation of the privacy parameters, shared by the optimizers and the accounting.

Each function checks one argument, returns it in canonical form (a ``float`` or an
``int``) and otherwise raises :class:`ValueError` whose message starts with the argument's
name, says what was expected and repeats what was given, e.g.
``noise_multiplier must be >= 0, got -1.0``. The ``name`` argument lets a caller report
the name its user typed (``steps``, ``max_epsilon``, ``target_epsilon``).

What the values mean, everywhere in dpoptim:

* ``noise_multiplier`` (sigma) is a real number ``>= 0``. ``0`` is no noise (accounted
  exactly: epsilon is infinite unless the steps are so rare that ``1 - (1 - q)^T <=
  delta``). ``inf`` is a step that reveals nothing: it costs no privacy (epsilon 0, and
  a budget never runs out at it). An optimizer cannot *draw* infinite noise, so it asks
  for ``finite=True`` when the value is a setting for its steps.
* ``sample_rate`` (q) is in ``(0, 1]``; ``delta`` in ``(0, 1)``; epsilons ``>= 0`` (or
  ``> 0``), ``inf`` allowed; step counts are non-negative integers, integral floats such
  as ``1e4`` included.

Booleans and strings are refused although Python can turn them into numbers: ``True``
as a noise multiplier is a bug, not a 1. Other objects that convert with ``float()``
(NumPy scalars, zero-dimensional tensors) are accepted.
"""

from __future__ import annotations

import math
import numbers

__all__ = [
    "real",
    "noise_multiplier",
    "sample_rate",
    "delta",
    "epsilon",
    "count",
    "max_grad_norm",
]


def real(value, name: str) -> float:
    """``value`` as a float; refuses booleans, strings and what ``float()`` cannot take."""
    if type(value) is float or type(value) is int:  # the common case, without ABC checks
        return float(value)
    if isinstance(value, (bool, str, bytes)) or not (isinstance(value, numbers.Real) or hasattr(value, "__float__")):
        raise ValueError(f"{name} must be a real number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):  # e.g. a tensor of more than one element
        raise ValueError(f"{name} must be a real number, got {value!r}") from None


def noise_multiplier(value, name: str = "noise_multiplier", *, finite: bool = False) -> float:
    """``value >= 0``; ``inf`` (nothing revealed) unless ``finite``."""
    value = real(value, name)
    if math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    if finite and math.isinf(value):
        raise ValueError(
            f"{name} must be finite to take steps, got {value!r}: infinite noise reveals nothing "
            "(the accounting charges it no privacy) but would overwrite every parameter with "
            "inf or nan; use a large finite value, or skip the step"
        )
    return value


def sample_rate(value, name: str = "sample_rate") -> float:
    """``0 < value <= 1``."""
    value = real(value, name)
    if not 0.0 < value <= 1.0:
        raise ValueError(f"{name} must be in (0, 1], got {value!r}")
    return value


def delta(value, name: str = "delta") -> float:
    """``0 < value < 1``."""
    value = real(value, name)
    if not 0.0 < value < 1.0:
        raise ValueError(f"{name} must be in (0, 1), got {value!r}")
    return value


def epsilon(value, name: str = "epsilon", *, positive: bool = False) -> float:
    """``value >= 0`` (``> 0`` if ``positive``); ``inf`` allowed (no budget)."""
    value = real(value, name)
    if math.isnan(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be {bound}, got {value!r}")
    return value


def count(value, name: str = "count") -> int:
    """A non-negative integer; integral floats such as ``1e4`` are accepted, ``1.5``,
    ``nan``, ``inf``, ``True`` and negative numbers are not."""
    if type(value) is int and value >= 0:  # the common case
        return value
    message = f"{name} must be a non-negative integer, got {value!r}"
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        result = int(value)
    else:
        try:
            as_float = real(value, name)
        except ValueError:
            raise ValueError(message) from None
        if not (math.isfinite(as_float) and as_float.is_integer()):
            raise ValueError(message)
        result = int(as_float)
    if result < 0:
        raise ValueError(message)
    return result


def max_grad_norm(value, name: str = "max_grad_norm") -> float:
    """The clipping norm: finite and ``> 0``."""
    value = real(value, name)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return value
