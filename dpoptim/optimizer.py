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
import weakref

import torch

from . import _torch, distributed, fsdp, validate
from .amp import MixedPrecisionMixin
from .engine import GradEngine
from .noise import NoiseMixin
from .settings import HyperparameterMixin, resolve_settings
from .spending import PrivacySpent, SpendingMixin
from .watches import BatchSizeWatchMixin

__all__ = ["DPOptimizerMixin", "make_private", "DPSGD", "DPAdam", "DPRMSProp", "PrivacySpent"]


class DPOptimizerMixin(HyperparameterMixin, NoiseMixin, SpendingMixin, BatchSizeWatchMixin, MixedPrecisionMixin):
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
        settings = resolve_settings(
            noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, expected_batch_size=expected_batch_size,
            sample_rate=sample_rate, dataset_size=dataset_size, loss_reduction=loss_reduction, generator=generator,
            delta=delta, accountant=accountant, max_epsilon=max_epsilon, target_epsilon=target_epsilon, steps=steps,
            epochs=epochs, grad_scaler=grad_scaler, secure_mode=secure_mode,
        )
        noise_multiplier, max_grad_norm = settings.noise_multiplier, settings.max_grad_norm
        this = weakref.ref(self)  # the engine must not keep the optimizer alive
        self._grad_scaler = grad_scaler
        self._engine = GradEngine(lambda: this()._clip_bound_for_backward(), loss_reduction)
        super().__init__(params, *args, **kwargs)
        for group in self.param_groups:
            group.setdefault("noise_multiplier", noise_multiplier)
            group.setdefault("max_grad_norm", max_grad_norm)
        self.defaults.update(noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm)
        self.expected_batch_size = settings.expected_batch_size
        self.sample_rate = settings.sample_rate
        self.dataset_size = dataset_size
        self.loss_reduction = loss_reduction
        self.delta = settings.delta
        self.accountant = accountant
        self.max_epsilon = settings.max_epsilon
        self._init_noise(generator, secure_mode)
        self._written: dict[int, weakref.ref] = {}  # id(param) -> the .grad the last step() wrote
        self._checked_layouts: set[int] = set()  # FSDP2 parameters whose sharding was checked
        from .accounting.ledger import Ledger  # scipy is imported with accounting: not at import dpoptim

        self._composed = Ledger()  # the steps taken, as runs (sigma, q, count), but for the latest run:
        self._latest = (None, None, 0)  # (sigma, q, steps) of the latest run, composed when read (_ledger)
        self._budget_cache = None  # spending._BudgetAnswer, once the budget stop has computed one
        self._reported: dict = {}  # (delta, accountant) -> (ledger, epsilon) privacy_spent() last reported
        self._process_group = process_group
        self._init_watches()

    # ----------------------------------------------------------------- the step
    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self._engine.reset()

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
        sigma, bound, q, batch = self._step_settings()
        self._check_budget(sigma, q)
        loss_scale = self._loss_scale()
        sums = self._engine.clipped_sums()  # in loss-scaled units; raises if C changed since backward
        examples = self._engine.examples
        process_group = distributed.resolve_group(self._process_group)
        rank, world = distributed.rank_and_size(process_group)
        by_device, sharded = self._sums_to_write(sums)
        grads = [s for pairs in by_device.values() for _, s in pairs]
        if loss_scale != 1.0 and grads:
            _torch.foreach_div_(grads, loss_scale)
        if rank == 0:  # the noise enters once, before the sum over ranks
            self._add_noise(by_device, sigma, bound)
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

    def _step_settings(self) -> tuple[float, float, float, float]:
        """``(sigma, C, q, B)`` in force, checked (they are attributes a user may set)."""
        q = validate.sample_rate(self.sample_rate)
        batch = float(self.expected_batch_size)
        if not (batch > 0 and math.isfinite(batch)):
            raise ValueError(f"expected_batch_size must be a finite number > 0, got {batch}")
        return self.noise_multiplier, self.max_grad_norm, q, batch

    def _sums_to_write(self, sums: dict) -> tuple[dict, list]:
        """The ``(parameter, clipped sum)`` pairs this step writes, by device in the order
        of the parameter groups (a zero sum for a parameter no example reached), and the
        FSDP2-sharded ones apart."""
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
        return by_device, sharded

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
            self._add_shard_noise(local, p, sigma, bound)
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
