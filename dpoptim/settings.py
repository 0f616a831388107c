"""The constructor's privacy settings of a DP optimizer, checked, with what is derived from
them (``q`` from ``B`` and the dataset size, ``B`` from ``q``, ``sigma`` calibrated for a
target epsilon), and the two settings that live in the parameter groups
(``noise_multiplier`` and ``max_grad_norm``: torch's schedulers and ``state_dict`` handle
them there)."""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from . import validate
from .amp import check_grad_scaler
from .data import batches_per_epoch
from .errors import PrivacyWarning

__all__ = ["HyperparameterMixin", "resolve_settings"]

_LOSS_REDUCTIONS = ("mean", "sum")
_DEFAULT_DELTA = 1e-5


def _check_noise_multiplier(value) -> float:
    # inf would mean "reveals nothing" to the accounting, but a step cannot draw it.
    return validate.noise_multiplier(value, finite=True)


def _check_max_grad_norm(value) -> float:
    return validate.max_grad_norm(value)


def _check_sample_rate(value) -> float:
    return validate.sample_rate(value)


class _Settings(NamedTuple):
    noise_multiplier: float
    max_grad_norm: float
    expected_batch_size: float
    sample_rate: float
    delta: float
    max_epsilon: float | None


def resolve_settings(*, noise_multiplier, max_grad_norm, expected_batch_size, sample_rate, dataset_size,
                      loss_reduction, generator, delta, accountant, max_epsilon, target_epsilon, steps, epochs,
                      grad_scaler, secure_mode) -> _Settings:
    """The constructor's privacy settings, checked, with what is derived from them (q from
    B and the dataset size, B from q, σ calibrated for a target ε). Warnings point at the
    optimizer's construction (stacklevel 4: the caller of ``__init__``)."""
    if loss_reduction not in _LOSS_REDUCTIONS:
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    max_grad_norm = _check_max_grad_norm(max_grad_norm)
    expected_batch_size, sample_rate = _resolve_sampling(expected_batch_size, sample_rate, dataset_size)
    if accountant not in ("pld", "rdp"):
        raise ValueError(f"accountant must be 'pld' or 'rdp', got {accountant!r}")
    if delta is None:
        delta = _DEFAULT_DELTA
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if dataset_size is not None and delta >= 1 / dataset_size:
        warnings.warn(
            f"delta={delta} is not below 1/dataset_size={1 / dataset_size:.3g}: a mechanism that "
            "publishes one example outright meets such a delta. Use delta < 1/dataset_size.",
            PrivacyWarning,
            stacklevel=4,
        )
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if secure_mode and generator is not None:
        raise ValueError(
            "secure_mode=True reseeds the noise from the operating system at every step and "
            "cannot use a given generator: pass generator=None (or secure_mode=False for "
            "reproducible noise)"
        )
    check_grad_scaler(grad_scaler, stacklevel=5)
    noise_multiplier, max_epsilon = _resolve_noise(noise_multiplier, target_epsilon, steps, epochs, max_epsilon,
                                                   delta, sample_rate, accountant)
    return _Settings(noise_multiplier, max_grad_norm, expected_batch_size, sample_rate, float(delta), max_epsilon)


def _resolve_sampling(expected_batch_size, sample_rate, dataset_size) -> tuple[float, float]:
    """``(B, q)``, each given or derived from the other and the dataset size."""
    if dataset_size is not None and not (int(dataset_size) == dataset_size and dataset_size >= 1):
        raise ValueError(f"dataset_size must be a positive integer, got {dataset_size}")
    if sample_rate is None and dataset_size is not None and expected_batch_size is not None:
        sample_rate = float(expected_batch_size) / dataset_size
    if sample_rate is None:
        raise ValueError(
            "sample_rate is needed for privacy accounting: pass sample_rate=q (the probability "
            "that an example is in a batch), or dataset_size together with expected_batch_size"
        )
    sample_rate = _check_sample_rate(sample_rate)
    if expected_batch_size is None:
        if dataset_size is None:
            raise ValueError(
                "expected_batch_size is needed: pass it (the mean batch size, e.g. "
                "sample_rate * len(dataset)) or pass dataset_size so it can be derived"
            )
        expected_batch_size = sample_rate * dataset_size
    expected_batch_size = float(expected_batch_size)
    if not (expected_batch_size > 0 and math.isfinite(expected_batch_size)):
        raise ValueError(f"expected_batch_size must be a finite number > 0, got {expected_batch_size}")
    return expected_batch_size, sample_rate


def _resolve_noise(noise_multiplier, target_epsilon, steps, epochs, max_epsilon, delta, sample_rate,
                   accountant) -> tuple[float, float | None]:
    """``(σ, max_epsilon)``: σ given, or calibrated so that the run spends ``target_epsilon``
    (which is then the default budget)."""
    if noise_multiplier is None:
        if target_epsilon is None:
            raise ValueError("noise_multiplier is required (or pass target_epsilon with steps or epochs)")
        if (steps is None) == (epochs is None):
            raise ValueError("with target_epsilon, pass exactly one of steps or epochs")
        total = int(steps) if steps is not None else math.ceil(float(epochs) * batches_per_epoch(sample_rate))
        from . import accounting  # scipy is imported only when accounting is used

        noise_multiplier = accounting.calibrate_noise(target_epsilon, delta, sample_rate, total, accountant=accountant)
        if max_epsilon is None:
            max_epsilon = float(target_epsilon)
    elif target_epsilon is not None:
        raise ValueError("pass either noise_multiplier or target_epsilon, not both")
    noise_multiplier = _check_noise_multiplier(noise_multiplier)
    if max_epsilon is not None and not max_epsilon > 0:
        raise ValueError(f"max_epsilon must be > 0, got {max_epsilon}")
    return noise_multiplier, None if max_epsilon is None else float(max_epsilon)


class HyperparameterMixin:
    """``noise_multiplier`` and ``max_grad_norm`` as properties over the parameter groups,
    which must agree: DP-SGD clips and noises all parameters together. A group added later
    gets the constructor's values and its parameters go to the clipping engine."""

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if getattr(self, "defaults", None) is not None and "noise_multiplier" in self.defaults:
            group.setdefault("noise_multiplier", self.defaults["noise_multiplier"])
            group.setdefault("max_grad_norm", self.defaults["max_grad_norm"])
        self._engine.add_params(group["params"], group.get("param_names"))

    def _group_value(self, key: str, check) -> float:
        values = {float(group[key]) for group in self.param_groups}
        if len(values) != 1:
            raise ValueError(
                f"{key} differs between parameter groups ({sorted(values)}): DP-SGD clips and noises "
                "all parameters together, so every group must use the same value"
            )
        return check(values.pop())

    @property
    def noise_multiplier(self) -> float:
        return self._group_value("noise_multiplier", _check_noise_multiplier)

    @noise_multiplier.setter
    def noise_multiplier(self, value: float) -> None:
        self._set_group_value("noise_multiplier", _check_noise_multiplier(value))

    @property
    def max_grad_norm(self) -> float:
        return self._group_value("max_grad_norm", _check_max_grad_norm)

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        self._set_group_value("max_grad_norm", _check_max_grad_norm(value))

    def _set_group_value(self, key: str, value: float) -> None:
        """Set ``key`` to the (checked) ``value`` in every parameter group."""
        for group in self.param_groups:
            group[key] = value
