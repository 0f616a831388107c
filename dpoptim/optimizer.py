"""DP optimizers: one mixin in front of any ``torch.optim.Optimizer``.

``DPSGD``, ``DPAdam`` and ``DPRMSProp`` are ``torch.optim.SGD``, ``Adam`` and ``RMSprop``
with privatization as one step in front of their own, unchanged update:

.. math::

    \\hat g = \\frac{1}{B}\\Big(\\sum_{i} \\min\\big(1, \\tfrac{C}{\\lVert g_i\\rVert}\\big) g_i
              + \\mathcal N(0, \\sigma^2 C^2 I)\\Big)

where the sum runs over every example of the logical batch (all ``backward()`` calls since
the last ``step()`` or ``zero_grad()``), ``g_i`` is the gradient of example i's own loss over
all trainable parameters of the optimizer, ``C = max_grad_norm``, ``sigma =
noise_multiplier`` and ``B = expected_batch_size``. Each step is recorded as a
Poisson-subsampled Gaussian mechanism ``(sigma, q)`` in the optimizer's privacy ledger.

With ``loss_reduction='mean'`` (the default) the loss is taken to be the mean over each
physical batch passed to ``backward()``; per-example gradients are recovered by
multiplying by that batch's size. Use ``'sum'`` for losses summed over examples.

Under ``torch.distributed`` the sum runs over the examples of all ranks: each rank clips its
own, rank 0 adds the noise, the sums are all-reduced and every rank divides by the global
``B`` (see :mod:`dpoptim.distributed`). With a ``torch.amp.GradScaler`` the loss scale is
divided out of every per-example gradient before its norm is taken. docs/training.md shows
the training loops.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
import weakref
from typing import NamedTuple

import torch

from . import _torch, distributed, fsdp, validate
from .data import batches_per_epoch
from .engine import GradEngine
from .errors import PrivacyBudgetExceeded, PrivacyWarning
from .privatize import add_noise_, fresh_generator

__all__ = ["DPOptimizerMixin", "make_private", "DPSGD", "DPAdam", "DPRMSProp", "PrivacySpent"]

_LOSS_REDUCTIONS = ("mean", "sum")
_DEFAULT_DELTA = 1e-5
# Steps with the same batch size after which Poisson sampling is implausible (see _watch_batch_size).
_FIXED_SIZE_STEPS = 32


class PrivacySpent(NamedTuple):
    epsilon: float
    delta: float


class _SizeWatch:
    """State of :meth:`DPOptimizerMixin._watch_batch_size`: the last batch size, how many
    steps in a row had it, and whether the warning was given."""

    __slots__ = ("last", "run", "warned")

    def __init__(self):
        self.last, self.run, self.warned = None, 0, False


class _MeanWatch:
    """State of :meth:`DPOptimizerMixin._watch_mean_batch_size`: the expected size being
    watched, the steps and examples counted against it, and whether the warning was given."""

    __slots__ = ("expected", "steps", "examples", "warned")

    def __init__(self, expected=None):
        self.expected, self.steps, self.examples, self.warned = expected, 0, 0, False


def _check_noise_multiplier(value) -> float:
    # inf would mean "reveals nothing" to the accounting, but a step cannot draw it.
    return validate.noise_multiplier(value, finite=True)


def _check_max_grad_norm(value) -> float:
    return validate.max_grad_norm(value)


def _check_sample_rate(value) -> float:
    return validate.sample_rate(value)


class DPOptimizerMixin:
    """Makes the torch optimizer after it in the MRO differentially private.

    Keyword-only arguments (everything else goes to the torch optimizer unchanged):

    noise_multiplier
        sigma >= 0: noise standard deviation in units of ``max_grad_norm``. May be omitted
        when ``target_epsilon`` and ``steps`` (or ``epochs``) are given: it is then calibrated.
    max_grad_norm
        C > 0: each example's gradient is clipped to this L2 norm over all trainable
        parameters of the optimizer.
    expected_batch_size
        B: the constant the noisy sum is divided by. Default ``sample_rate * dataset_size``
        when both are known; otherwise it must be given. Never the size of the batch drawn.
    sample_rate, dataset_size
        q, the probability that an example is in a batch (Poisson sampling), for
        accounting. Given directly, or as ``expected_batch_size / dataset_size``.
    loss_reduction
        ``'mean'`` (default) or ``'sum'``: how the loss combines the examples of a
        physical batch.
    generator
        A ``torch.Generator`` for the noise, for reproducible runs. Default: a generator
        seeded from the operating system's entropy, never a fixed seed.
    delta, accountant
        Defaults for :meth:`privacy_spent`: delta (default 1e-5; a warning if it is not
        below 1/dataset_size) and ``'pld'`` (tight) or ``'rdp'``.
    grad_scaler
        The ``torch.amp.GradScaler`` whose scaled losses are backpropagated (float16 mixed
        precision). Its scale is divided out of each per-example gradient before clipping,
        and it never sees an overflow: an example whose gradient overflows is dropped
        (clip factor 0) and the step is still taken, noised and charged, so neither the
        step nor the scale depends on the data. Prefer a fixed scale
        (``growth_interval=2**31 - 1``): a growing one is never backed off.
    process_group
        Under ``torch.distributed``, the ranks that train this model together (default: the
        default group once initialized with more than one process; ``False``: this process
        alone). ``expected_batch_size`` and ``sample_rate`` are then global.
    secure_mode
        Reseed the noise generator from the operating system's entropy at every step and
        draw each noise coordinate as the mean of four normals scaled back to unit
        variance, which defeats floating-point attacks on the sampler (Mironov 2012; Haney
        et al. 2022). Costs three extra normal draws per coordinate.
    max_epsilon
        If set, :meth:`step` raises :class:`PrivacyBudgetExceeded` instead of taking a step
        that would spend more than this (at ``delta``). Defaults to ``target_epsilon``.
    target_epsilon, steps, epochs
        Calibrate ``noise_multiplier`` so that ``steps`` (or ``epochs * round(1 / sample_rate)``, the
        epoch of :func:`dpoptim.data.poisson_loader`) steps
        spend ``target_epsilon`` at ``delta``.
    """

    def __init__(
        self,
        params,
        *args,
        noise_multiplier: float | None = None,
        max_grad_norm: float,
        expected_batch_size: float | None = None,
        sample_rate: float | None = None,
        dataset_size: int | None = None,
        loss_reduction: str = "mean",
        generator: torch.Generator | None = None,
        delta: float | None = None,
        accountant: str = "pld",
        max_epsilon: float | None = None,
        target_epsilon: float | None = None,
        steps: int | None = None,
        epochs: float | None = None,
        grad_scaler=None,
        process_group=None,
        secure_mode: bool = False,
        **kwargs,
    ):
        _check_optimizer_class(type(self))
        if loss_reduction not in _LOSS_REDUCTIONS:
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        max_grad_norm = _check_max_grad_norm(max_grad_norm)
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
                stacklevel=3,
            )
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        if secure_mode and generator is not None:
            raise ValueError(
                "secure_mode=True reseeds the noise from the operating system at every step and "
                "cannot use a given generator: pass generator=None (or secure_mode=False for "
                "reproducible noise)"
            )
        _check_grad_scaler(grad_scaler)

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

        this = weakref.ref(self)  # the engine must not keep the optimizer alive
        self._grad_scaler = grad_scaler
        self._engine = GradEngine(lambda: this()._clip_bound_for_backward(), loss_reduction)
        super().__init__(params, *args, **kwargs)
        for group in self.param_groups:
            group.setdefault("noise_multiplier", noise_multiplier)
            group.setdefault("max_grad_norm", max_grad_norm)
        self.defaults.update(noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm)
        self.expected_batch_size = expected_batch_size
        self.sample_rate = sample_rate
        self.dataset_size = dataset_size
        self.loss_reduction = loss_reduction
        self.delta = float(delta)
        self.accountant = accountant
        self.max_epsilon = None if max_epsilon is None else float(max_epsilon)
        self._user_generator = generator
        self._written: dict[int, weakref.ref] = {}  # id(param) -> the .grad the last step() wrote
        self._checked_layouts: set[int] = set()  # FSDP2 parameters whose sharding was checked
        self.secure_mode = bool(secure_mode)
        self._generators: dict[torch.device, torch.Generator] = {}
        from .accounting.ledger import Ledger  # scipy is imported with accounting: not at import dpoptim

        self._composed = Ledger()  # the steps taken, as runs (sigma, q, count), but for the latest run:
        self._latest = (None, None, 0)  # (sigma, q, steps) of the latest run, composed when read (_ledger)
        self._budget_cache: tuple | None = None
        self._process_group = process_group
        self._size_watch = _SizeWatch()
        self._mean_watch = _MeanWatch()

    # ----------------------------------------------------------------- hyperparameters
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
        value = _check_noise_multiplier(value)
        for group in self.param_groups:
            group["noise_multiplier"] = value

    @property
    def max_grad_norm(self) -> float:
        return self._group_value("max_grad_norm", _check_max_grad_norm)

    @max_grad_norm.setter
    def max_grad_norm(self, value: float) -> None:
        value = _check_max_grad_norm(value)
        for group in self.param_groups:
            group["max_grad_norm"] = value

    # ----------------------------------------------------------------- the step
    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._engine.reset()

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if self._user_generator is not None:
            return self._user_generator
        if self.secure_mode:
            return fresh_generator(device)  # a new seed from the OS at every step
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = fresh_generator(device)
        return generator

    # torch.amp.GradScaler then hands step() to us instead of skipping it on overflow.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None):
        """Clip, add noise, divide by the expected batch size, then the torch update.

        Always takes the step: nothing here depends on the values of the gradients.
        """
        # GradScaler.step sets these for fused optimizers that unscale and skip themselves;
        # our gradients are already unscaled and a skip would depend on the data, so the
        # torch update below must not see them.
        amp_attributes = {k: self.__dict__.pop(k) for k in ("grad_scale", "found_inf") if k in self.__dict__}
        try:
            return self._dp_step(closure, called_by_scaler=bool(amp_attributes))
        finally:
            self.__dict__.update(amp_attributes)

    def _dp_step(self, closure, called_by_scaler: bool):
        if called_by_scaler and self._grad_scaler is None:
            raise RuntimeError(
                "GradScaler.step(optimizer) was called, but the optimizer does not know the scaler, "
                "so per-example gradients were clipped with the loss scale still in them. Pass "
                "grad_scaler=scaler when creating the optimizer."
            )
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sigma = self.noise_multiplier
        bound = self.max_grad_norm
        q = _check_sample_rate(self.sample_rate)
        batch = float(self.expected_batch_size)
        if not (batch > 0 and math.isfinite(batch)):
            raise ValueError(f"expected_batch_size must be a finite number > 0, got {batch}")
        self._check_budget(sigma, q)
        loss_scale = self._loss_scale()
        sums = self._engine.clipped_sums()  # in loss-scaled units; raises if C changed since backward
        examples = self._engine.examples
        process_group = distributed.resolve_group(self._process_group)
        rank, world = distributed.rank_and_size(process_group)

        by_device: dict[torch.device, list] = {}
        sharded = []
        for p in self._updated_params(sums):
            s = sums.get(id(p))
            if fsdp.is_sharded(p):
                sharded.append((p, s))
                continue
            if s is None:
                s = torch.zeros_like(p, memory_format=torch.preserve_format)
            by_device.setdefault(p.device, []).append((p, s))
        grads = [s for pairs in by_device.values() for _, s in pairs]
        if loss_scale != 1.0 and grads:
            _torch.foreach_div_(grads, loss_scale)
        if rank == 0:  # the noise enters once, before the sum over ranks
            for device, pairs in by_device.items():
                add_noise_([s for _, s in pairs], sigma, bound, self._generator_for(device), self.secure_mode)
        if process_group is not None:
            settings = {"noise_multiplier": sigma, "max_grad_norm": bound, "sample_rate": q,
                        "expected_batch_size": batch}
            distributed.all_reduce_sum_(grads, process_group, settings)
        _torch.foreach_div_(grads, batch)
        if sharded:
            self._sharded_step(sharded, process_group, loss_scale, sigma, bound, batch)
        for pairs in by_device.values():
            for p, g in pairs:
                p.grad = g
                self._written[id(p)] = weakref.ref(g)
        self._engine.reset()
        super().step()
        self._record(sigma, q)
        self._report_no_overflow()
        self._watch_batch_size(examples, q, batch / world)
        self._watch_mean_batch_size(examples, batch / world)
        return loss

    def _sharded_step(self, pairs, process_group, loss_scale, sigma, bound, batch) -> None:
        """The step of FSDP2's sharded parameters (see :mod:`dpoptim.fsdp`): the engine
        holds this rank's shard of the clipped sums over all ranks (reduce-scattered at the
        end of each backward); each rank noises its own shard."""
        for p, s in pairs:
            if id(p) not in self._checked_layouts:
                fsdp.check_layout(p, process_group, self._engine._describe)
                self._checked_layouts.add(id(p))
            local = torch.zeros_like(p.to_local()) if s is None else s
            if loss_scale != 1.0:
                local.div_(loss_scale)
            generator = self._generator_for(local.device)
            if self._user_generator is not None:
                # Every rank draws the whole vector and keeps its slice: the noise of an
                # unsharded run with this generator, one independent draw per coordinate.
                noise = add_noise_([torch.zeros(p.shape, dtype=local.dtype, device=local.device)],
                                   sigma, bound, generator, self.secure_mode)[0]
                local.add_(fsdp.local_slice(noise, p))
            else:  # each rank's own generator, seeded by the operating system
                add_noise_([local], sigma, bound, generator, self.secure_mode)
            local.div_(batch)
            g = fsdp.as_grad(local, p)
            p.grad = g
            self._written[id(p)] = weakref.ref(g)

    def _updated_params(self, sums: dict) -> list:
        """The parameters this step gives a privatised gradient.

        Every trainable parameter (a noise-only gradient if no example reached it), and a
        frozen one that a backward of this batch reached (frozen between ``backward()`` and
        ``step()``: torch's update would apply autograd's raw gradient, so it is replaced
        like any other). A ``.grad`` that neither a backward dpoptim saw nor the last
        ``step()`` produced (set by hand, from ``torch.autograd.grad``, or left from before
        the optimizer existed) is refused: it would otherwise silently become a noise-only
        step. A frozen parameter holding the last step's gradient keeps it, as in torch.
        """
        updated = []
        for group in self.param_groups:
            for p in group["params"]:
                reached = id(p) in sums or id(p) in self._engine.seen
                written = self._written.get(id(p))
                if p.grad is not None and not reached and (written is None or written() is not p.grad):
                    self._engine.reset()
                    raise RuntimeError(
                        f"{self._engine._describe(p)} holds a .grad that no backward() seen by dpoptim "
                        "produced (set by hand, from torch.autograd.grad, or from a backward before the "
                        "optimizer was built). dpoptim clips per example during loss.backward() and "
                        "cannot privatise a finished gradient: call optimizer.zero_grad(), then "
                        "loss.backward(), then step()."
                    )
                if p.requires_grad or reached:
                    updated.append(p)
        return updated

    # ----------------------------------------------------------------- mixed precision
    def _loss_scale(self) -> float:
        scaler = self._grad_scaler
        if scaler is None or not scaler.is_enabled():
            return 1.0
        scale = float(scaler.get_scale())
        if not (scale > 0 and math.isfinite(scale)):
            raise ValueError(f"the GradScaler's scale is {scale}; it must be a finite number > 0")
        return scale

    def _clip_bound_for_backward(self) -> float:
        """The bound the engine clips backward's gradients to: C in loss-scaled units.

        ``min(1, C S / ||S g_i||) = min(1, C / ||g_i||)``, so the factors are those of the
        unscaled gradients; :meth:`step` divides the sums by S before the noise. The engine
        reads this at the end of every backward and again in ``step``, so a scale changed in
        between (``scaler.update()`` before ``step``) is refused like a changed C.
        """
        return self.max_grad_norm * self._loss_scale()

    def _report_no_overflow(self) -> None:
        """Tell the GradScaler that nothing overflowed, whatever the data did.

        ``scaler.update()`` backs the scale off after an overflow it found in autograd's
        gradients; that would make the scale, which decides which examples overflow next,
        a function of the private data. The step has already dropped any overflowing
        example (clip factor 0), so there is nothing to back off from.
        """
        scaler = self._grad_scaler
        if scaler is None or not scaler.is_enabled():
            return
        _torch.grad_scaler_report_no_overflow(scaler, self)

    # ----------------------------------------------------------------- data loading
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

    # ----------------------------------------------------------------- accounting
    def _record(self, sigma: float, q: float) -> None:
        """One more step at ``(sigma, q)``. ``Ledger.compose`` validates its arguments and
        copies the runs, more than a step's book-keeping should cost: steps of the same
        setting are counted here and composed once, when the ledger is read."""
        latest_sigma, latest_q, count = self._latest
        if count and (latest_sigma, latest_q) != (sigma, q):
            self._composed = self._ledger
            count = 0
        self._latest = (sigma, q, count + 1)

    @property
    def _ledger(self):
        """The privacy ledger (a :class:`dpoptim.accounting.Ledger`) of every step taken."""
        sigma, q, count = self._latest
        if count:
            self._composed, self._latest = self._composed.compose(sigma, q, count), (None, None, 0)
        return self._composed

    @_ledger.setter
    def _ledger(self, ledger) -> None:
        """A Ledger, or runs ``(sigma, q, count)`` to build one from (validated)."""
        kind = type(self._composed)
        self._composed = ledger if isinstance(ledger, kind) else kind(ledger)
        self._latest = (None, None, 0)

    @property
    def ledger(self) -> tuple[tuple[float, float, int], ...]:
        """The steps taken, as runs ``(noise_multiplier, sample_rate, count)`` (plain tuples:
        they load with ``torch.load(weights_only=True)``), consecutive identical steps merged."""
        return tuple(tuple(run) for run in self._ledger.runs)

    @property
    def steps_taken(self) -> int:
        return self._ledger.steps

    def privacy_spent(self, delta: float | None = None, accountant: str | None = None) -> PrivacySpent:
        """``(epsilon, delta)`` spent so far: the Poisson-subsampled Gaussian mechanism
        composed over the ledger. ``delta`` defaults to the constructor's."""
        delta = self.delta if delta is None else float(delta)
        if self.dataset_size is not None and delta >= 1 / self.dataset_size:
            warnings.warn(
                f"delta={delta} is not below 1/dataset_size={1 / self.dataset_size:.3g}",
                PrivacyWarning,
                stacklevel=2,
            )
        from . import accounting

        eps = accounting.epsilon_of_ledger(self.ledger, delta, accountant=accountant or self.accountant)
        return PrivacySpent(float(eps), delta)

    def _check_budget(self, sigma: float, q: float) -> None:
        """Raise before a step that would exceed ``max_epsilon``. The number of steps the
        budget allows at (sigma, q) is computed once per change of settings, not per step."""
        if self.max_epsilon is None:
            return
        key = (sigma, q, self.delta, self.max_epsilon, self.accountant)
        if self._budget_cache is None or self._budget_cache[0] != key:
            from . import accounting

            allowed = accounting.max_steps(
                sigma, q, self.delta, self.max_epsilon, ledger=self.ledger, accountant=self.accountant
            )
            self._budget_cache = (key, self.steps_taken + allowed)
        if self.steps_taken >= self._budget_cache[1]:
            raise PrivacyBudgetExceeded(
                f"one more step at noise_multiplier={sigma}, sample_rate={q} would spend more than "
                f"max_epsilon={self.max_epsilon} at delta={self.delta} "
                f"(spent so far over {self.steps_taken} steps: {self.privacy_spent().epsilon:.4g})"
            )

    # ----------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict:
        state = super().state_dict()
        state["dpoptim"] = {
            "ledger": [list(run) for run in self._ledger.runs],
            "steps_taken": self.steps_taken,
            "expected_batch_size": self.expected_batch_size,
            "sample_rate": self.sample_rate,
            "max_epsilon": self.max_epsilon,
            "delta": self.delta,
            # Only a generator the user chose is saved: restoring a default one would let
            # anyone holding the checkpoint predict the noise of later steps.
            "generator": None if self._user_generator is None else self._user_generator.get_state(),
        }
        return state

    def load_state_dict(self, state_dict: dict, *, ledger: str | None = None) -> None:
        """Resume from :meth:`state_dict`, never lowering the privacy charged.

        The torch state (moments, step counts, the parameter groups with their
        ``noise_multiplier`` and ``max_grad_norm``) and a saved user generator come from the
        checkpoint. ``sample_rate``, ``expected_batch_size``, ``delta`` and ``max_epsilon``
        stay the constructor's, which describe how this run samples and what it may spend;
        a :class:`PrivacyWarning` names any the checkpoint had otherwise.

        The ledger: the checkpoint's when it continues this optimizer's (a fresh optimizer
        resuming), this optimizer's when it already contains the checkpoint's (rolling back
        to an earlier checkpoint of this run: the steps since were taken and stay charged).
        Ledgers that neither contains are refused unless ``ledger`` says what to do:
        ``'both'`` charges both (a sound upper bound), ``'checkpoint'`` replaces this
        optimizer's steps by the checkpoint's (only if nothing computed in those steps is
        ever released).
        """
        if ledger not in (None, "both", "checkpoint"):
            raise ValueError(f"ledger must be None, 'both' or 'checkpoint', got {ledger!r}")
        state_dict = dict(state_dict)
        dp = state_dict.pop("dpoptim", None)
        if dp is None:
            raise ValueError(
                "this state_dict has no 'dpoptim' entry (privacy ledger): it was not saved by a "
                "dpoptim optimizer, and resuming from it would under-report epsilon"
            )
        try:
            saved = type(self._ledger)(dp["ledger"])
        except (TypeError, ValueError) as exc:
            raise ValueError(f"this state_dict's privacy ledger is corrupted: {exc}") from None
        if "steps_taken" in dp and dp["steps_taken"] != saved.steps:
            raise ValueError("this state_dict's privacy ledger does not add up to its step count: it is corrupted")
        merged = _merge_ledgers(self._ledger, saved, ledger)
        super().load_state_dict(state_dict)
        self._ledger = merged
        self._budget_cache = None
        differ = [
            f"{name}={dp[name]} in the checkpoint, {getattr(self, name)} now"
            for name in ("sample_rate", "expected_batch_size", "delta", "max_epsilon")
            if name in dp and dp[name] != getattr(self, name)
        ]
        if differ:
            warnings.warn(
                "resuming with the constructor's privacy settings, not the checkpoint's ("
                + "; ".join(differ) + "): steps already taken stay charged at the rate they were taken "
                "with. Pass the checkpoint's values to the constructor to keep them.",
                PrivacyWarning,
                stacklevel=2,
            )
        if dp.get("generator") is not None and self._user_generator is not None:
            self._user_generator.set_state(dp["generator"])


def _merge_ledgers(current, saved, how: str | None):
    """The ledger after loading ``saved`` into an optimizer holding ``current`` (both
    :class:`dpoptim.accounting.Ledger`; see :meth:`DPOptimizerMixin.load_state_dict`)."""
    if how == "checkpoint" or _starts_with(saved, current):
        return saved
    if _starts_with(current, saved):
        return current
    if how == "both":
        return type(current)(current.runs + saved.runs)
    raise ValueError(
        f"this optimizer has taken {current.steps} steps that the checkpoint's ledger "
        f"({saved.steps} steps) does not contain, and loading it would lower the privacy "
        "charged. Load checkpoints into a freshly built optimizer, or pass ledger='both' to "
        "charge both histories (ledger='checkpoint' replaces this optimizer's steps: only if "
        "nothing computed in them is ever released)."
    )


def _starts_with(ledger, prefix) -> bool:
    """Whether the steps of ``ledger`` begin with the steps of ``prefix`` (both ledgers:
    adjacent identical runs merged, empty runs dropped)."""
    a, b = ledger.runs, prefix.runs
    if not b:
        return True
    if len(b) > len(a) or a[: len(b) - 1] != b[:-1]:
        return False
    last, there = b[-1], a[len(b) - 1]
    return last[:2] == there[:2] and last.count <= there.count


# Optimizers that cannot take a privatised gradient: why, and what to use instead.
_UNSUPPORTED = {
    torch.optim.LBFGS: "re-evaluates the loss and reads .grad several times inside one step(), so "
                       "each step would spend privacy many times; use DPSGD, DPAdam or make_private(AdamW)",
    torch.optim.SparseAdam: "needs sparse gradients, and the noise makes every gradient dense; use DPAdam",
}


def _check_optimizer_class(cls: type) -> None:
    for unsupported, why in _UNSUPPORTED.items():
        if issubclass(cls, unsupported):
            raise TypeError(f"dpoptim cannot make {unsupported.__name__} private: it {why}.")


def _caller_stacklevel() -> int:
    """The ``stacklevel`` of the first frame outside dpoptim and torch (the user's step() call,
    however many wrappers torch and LR schedulers put around it)."""
    skip = tuple(os.path.dirname(os.path.abspath(f)) + os.sep for f in (__file__, torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    return level


def _check_grad_scaler(scaler) -> None:
    if scaler is None:
        return
    if not all(hasattr(scaler, name) for name in ("scale", "get_scale", "is_enabled", "update")):
        raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
    if scaler.is_enabled() and scaler.get_growth_interval() < 2**31 - 1:
        warnings.warn(
            f"this GradScaler multiplies its scale by {scaler.get_growth_factor()} every "
            f"{scaler.get_growth_interval()} steps and, under "
            "dpoptim, never backs off (backing off on overflow would make the scale depend on the "
            "data): after enough steps every example overflows and is dropped. Use a fixed scale: "
            "GradScaler(init_scale=2.0**12, growth_interval=2**31 - 1).",
            UserWarning,
            stacklevel=3,
        )


_CACHE: dict[type, type] = {}


def make_private(optimizer_class: type) -> type:
    """A DP version of any ``torch.optim.Optimizer`` subclass, e.g. ``make_private(torch.optim.AdamW)``.

    The returned class takes the optimizer's own arguments plus the keyword-only arguments
    of :class:`DPOptimizerMixin`.
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"make_private needs a torch.optim.Optimizer subclass, got {optimizer_class!r}")
    if issubclass(optimizer_class, DPOptimizerMixin):
        return optimizer_class
    _check_optimizer_class(optimizer_class)
    if optimizer_class not in _CACHE:
        _CACHE[optimizer_class] = type(
            f"DP{optimizer_class.__name__}",
            (DPOptimizerMixin, optimizer_class),
            {"__doc__": f"Differentially private {optimizer_class.__name__}. {DPOptimizerMixin.__doc__}",
             "__module__": __name__},
        )
    return _CACHE[optimizer_class]


class DPSGD(DPOptimizerMixin, torch.optim.SGD):
    """Differentially private ``torch.optim.SGD`` (momentum, nesterov, weight decay as usual).

    >>> opt = DPSGD(model.parameters(), lr=0.1, noise_multiplier=1.1, max_grad_norm=1.0,
    ...             expected_batch_size=256, sample_rate=256 / 60000)  # doctest: +SKIP
    """


class DPAdam(DPOptimizerMixin, torch.optim.Adam):
    """Differentially private ``torch.optim.Adam`` (betas, amsgrad, weight decay as usual)."""


class DPRMSProp(DPOptimizerMixin, torch.optim.RMSprop):
    """Differentially private ``torch.optim.RMSprop`` (alpha, centered, momentum as usual)."""


_CACHE.update({torch.optim.SGD: DPSGD, torch.optim.Adam: DPAdam, torch.optim.RMSprop: DPRMSProp})
