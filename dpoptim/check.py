"""A privacy unit test to run once on a new model: :func:`check`.

dpoptim's hooks see each layer's inputs and output gradients and take row ``i`` of dim 0
for example ``i``. That is exact when example ``i``'s loss depends on example ``i`` alone.
When examples meet somewhere (statistics over the batch in the model, a loss that
compares examples, a loss normalised by a count over the batch, tensors whose dim 0 is
not the example axis), the gradient a hook attributes to example ``i`` also carries other
examples' data, the clip bound no longer bounds what one example can do, and the
accountant's epsilon is not the truth. The hooks cannot see this; a per-example loop can.

:func:`check` runs the user's own ``loss_fn`` on a real batch, on a copy of the model, and
compares what dpoptim does with the definition DP-SGD's guarantee rests on (Abadi et al.
2016): with ``g_i`` the gradient of ``loss_fn(model, batch[i:i+1])``, the noise-free
privatised gradient of a batch D of n examples with ``expected_batch_size = n`` is

.. math::

    u(D) = \\frac{1}{n} \\sum_{i \\in D} \\min\\Big(1, \\frac{C}{\\lVert g_i \\rVert}\\Big)\\, g_i,

and removing example ``i`` moves it by exactly ``clip_C(g_i) / n``, whose norm is at most
``C / n``: the add/remove sensitivity the accountant assumes.
"""

from __future__ import annotations

import copy
import math
import random
import warnings
from dataclasses import dataclass, field

import torch
from torch import nn

from . import _torch
from .data import _batch_sizes
from .nested import map_structure, map_tensors
from .errors import UnsupportedLayerError

__all__ = ["check", "CheckResult"]

# Relative tolerance by the dtype the check computed in. Errors are measured against the
# size of the clipped sum's terms (sum_i ||clip g_i|| / n), so cancellation between
# examples does not make a correct float32 model fail.
_TOLERANCE = {torch.float64: 1e-6, torch.float32: 2e-3}
_LOW_PRECISION_TOLERANCE = 5e-2

# Keyword arguments of a DP optimizer that the check sets itself: no noise, every example
# in the batch, this process alone.
_OVERRIDDEN = ("noise_multiplier", "target_epsilon", "steps", "epochs", "max_epsilon", "sample_rate",
               "expected_batch_size", "dataset_size", "generator", "secure_mode", "grad_scaler",
               "process_group", "delta", "accountant")

_COUPLING_CAUSES = (
    "Examples of the batch influence each other's gradients where dpoptim's hooks cannot see "
    "it. Usual causes: statistics over the batch in the model (x - x.mean(0), "
    "F.batch_norm, nn.BatchNorm in training mode); a loss that compares examples "
    "(contrastive/InfoNCE, ranking, in-batch negatives); a loss divided by a count over the "
    "whole batch (F.cross_entropy with ignore_index averaged over the batch's tokens, "
    "class-weighted F.cross_entropy with reduction='mean', which divides by the batch's "
    "weight sum); tensors whose dim 0 is not the example axis (sequence-first layouts, "
    "tokens flattened into dim 0 as x.reshape(-1, d)), or rows reordered across examples. "
    "Fix: make the loss a mean (or sum) over examples of each example's own loss (per-token "
    "losses summed per example and divided by that example's own token count, or by a "
    "constant); use GroupNorm or LayerNorm instead of batch statistics; keep the example "
    "axis at dim 0 in every layer"
)


@dataclass
class CheckResult:
    """What :func:`check` found. ``bool(result)`` is ``result.passed``.

    Measured numbers (``None`` when the check could not get that far):

    step_error
        Largest difference between dpoptim's privatised gradient and the brute-force one,
        ``||u_dpoptim - u_loop|| / (sum_i ||clip(g_i)|| / n)``, over the first step and a
        later step (dpoptim takes a faster path after its first step).
    sensitivity
        Largest ``||u(D) - u(D without i)||`` over the removed examples, in units of
        ``C / B`` (``B = n``). DP-SGD and its accountant need it to be at most 1.
    removal_error
        Largest ``||u(D) - u(D without i) - clip(g_i) / n||`` in units of ``C / B``: how
        far removing one example moved the update beyond that example's own clipped
        gradient (0 when examples do not interact and dpoptim clips exactly).
    optimizer_error
        ``step_error`` of the user's DP optimizer (``optimizer_class``), if one was given.
    """

    passed: bool
    failures: list[str]
    examples: int
    max_grad_norm: float
    dtype: torch.dtype | None = None
    step_error: float | None = None
    sensitivity: float | None = None
    removal_error: float | None = None
    optimizer_error: float | None = None
    tolerance: float | None = None
    removed: list[int] = field(default_factory=list)
    gradient_norms: list[float] = field(default_factory=list)  # ||g_i|| of the per-example loop
    trainable: list[str] = field(default_factory=list)  # names of the parameters checked
    dropout_disabled: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # warnings raised during the check, and remarks
    micro_batch_size: int | None = None
    optimizer: str | None = None

    def __bool__(self) -> bool:
        return self.passed

    def __str__(self) -> str:
        c = self.max_grad_norm
        head = "passed" if self.passed else f"FAILED ({len(self.failures)} problem{'s' * (len(self.failures) != 1)})"
        lines = [f"dpoptim.check: {head}"]
        where = f"{self.examples} examples, max_grad_norm C = {c:g}"
        if self.dtype is not None:
            where += f", computed in {str(self.dtype).replace('torch.', '')}"
        if self.micro_batch_size:
            where += f", micro-batches of {self.micro_batch_size}"
        lines.append(f"  {where}")
        if self.trainable:
            lines.append(f"  trainable parameters checked: {len(self.trainable)} tensors")
        if self.gradient_norms:
            clipped = sum(g > c for g in self.gradient_norms)
            lines.append(
                f"  per-example gradient norms: {min(self.gradient_norms) / c:.3g} to "
                f"{max(self.gradient_norms) / c:.3g} C ({clipped} of {len(self.gradient_norms)} clipped)"
            )
        if self.step_error is not None:
            lines.append(f"  (2) clipped step vs per-example loop: relative error {self.step_error:.2e} "
                         f"(tolerance {self.tolerance:.0e})")
        if self.sensitivity is not None:
            lines.append(
                f"  (3) removing example(s) {', '.join(map(str, self.removed))}: the update moved by at most "
                f"{self.sensitivity:.4g} C/B (must be <= 1), beyond the example's own clipped gradient by "
                f"{self.removal_error:.2e} C/B"
            )
        if self.optimizer_error is not None:
            lines.append(f"  {self.optimizer}: privatised gradient vs per-example loop: relative error "
                         f"{self.optimizer_error:.2e}")
        if self.dropout_disabled:
            lines.append(f"  dropout switched off on the copy: {', '.join(self.dropout_disabled)}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        for i, failure in enumerate(self.failures, 1):
            lines.append(f"problem {i}: {failure}")
        return "\n".join(lines)


def check(model: nn.Module, batch, loss_fn, *, max_grad_norm: float = 1.0, loss_reduction: str = "mean",
          micro_batch_size: int | None = None, removals: int = 3, optimizer_class: type | None = None,
          **optimizer_kwargs) -> CheckResult:
    """Verify on a real batch that dpoptim clips this model and loss exactly per example.

    ``batch`` is what the training loop gets from its loader: a tensor or any nesting of
    tuples, lists and dicts (a Hugging Face batch dict, say) whose tensors all have the
    example axis at dim 0. ``loss_fn(model, batch)`` returns the scalar loss the training
    loop calls ``backward()`` on, with its normalisation, checkpointing and everything
    else. ``max_grad_norm``, ``loss_reduction`` and ``micro_batch_size`` (several
    ``backward()`` calls per step, as with :func:`dpoptim.data.split_batch`) are those of
    the training run.

    The check works on a deep copy of the model, in float64 when the model and batch
    allow it (else float32, then the model's own dtype, with looser tolerances), with
    dropout switched off on the copy so that a per-example loop is deterministic;
    BatchNorm and everything else stay in the mode the model is in. The model, its
    gradients and the global random number generators are left as they were. It verifies:

    1. every trainable parameter is covered by a layer rule;
    2. dpoptim's privatised gradient (no noise, ``expected_batch_size = n``) equals
       ``(1/n) sum_i clip_C(g_i)``, with ``g_i`` the gradient of
       ``loss_fn(model, batch[i:i+1])``, at the first step and at a later one;
    3. removing one example ``i`` (``removals`` of them: the first, the last, then others
       at random) moves that gradient by exactly ``clip_C(g_i) / n``, so by at most
       ``C / n``, and leaves every other example's contribution unchanged;
    4. all of it with the given micro-batches and whatever checkpointing the model does;
       and with ``optimizer_class`` (``dpoptim.DPAdam``, say, with its other keyword
       arguments), that this optimizer builds on the model and leaves the same privatised
       gradient in ``.grad`` (its noise switched off). Optimizer keyword arguments without
       ``optimizer_class`` are checked on :class:`dpoptim.DPSGD`.

    Any error dpoptim raises on the way is reported as a failure with its message.
    Returns a :class:`CheckResult`; ``print(result)`` explains it.
    """
    max_grad_norm, n = _validated(model, batch, max_grad_norm, loss_reduction, micro_batch_size, removals)
    if optimizer_class is None and optimizer_kwargs:
        from .optimizer import DPSGD

        optimizer_class = DPSGD  # arguments given for the training optimizer: check them on DPSGD
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    checker = _Checker(model, batch, loss_fn, n, max_grad_norm, loss_reduction,
                       None if micro_batch_size is None else int(micro_batch_size), int(removals),
                       optimizer_class, optimizer_kwargs, devices)
    with torch.random.fork_rng(devices=devices), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checker.run()
    for w in caught:
        text = f"{w.category.__name__}: {w.message}"
        if text not in checker.result.notes:
            checker.result.notes.append(text)
    result = checker.result
    result.passed = not result.failures
    return result


def _validated(model, batch, max_grad_norm, loss_reduction, micro_batch_size, removals) -> tuple[float, int]:
    """:func:`check`'s arguments refused early with what to pass instead; returns ``C`` as a
    float and the number of examples in ``batch``."""
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    max_grad_norm = float(max_grad_norm)
    if not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
        raise ValueError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm}")
    if micro_batch_size is not None and (int(micro_batch_size) != micro_batch_size or micro_batch_size < 1):
        raise ValueError(f"micro_batch_size must be a positive integer or None, got {micro_batch_size}")
    if int(removals) != removals or removals < 1:
        raise ValueError(f"removals must be a positive integer, got {removals}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    n = example_count(batch)
    if n < 2:
        raise ValueError(
            f"check needs a batch of at least 2 examples to see how examples interact, got {n}; "
            "pass a real batch from the training data (8 to 64 examples is plenty)"
        )
    return max_grad_norm, n


class _Stop(Exception):
    """Raised inside the checker once a failure makes the remaining checks meaningless."""


class _Reference:
    """The model's copy and the definition DP-SGD rests on: the per-example loop."""

    def __init__(self, model, batch, loss_fn, n, max_grad_norm, loss_reduction, micro_batch_size, removals,
                 optimizer_class, optimizer_kwargs, devices):
        self.model, self.batch, self.loss_fn, self.n = model, batch, loss_fn, n
        self.devices = devices
        self.c, self.reduction, self.micro, self.removals = max_grad_norm, loss_reduction, micro_batch_size, removals
        self.optimizer_class, self.optimizer_kwargs = optimizer_class, optimizer_kwargs
        self.causes_at = None  # the problem that lists the causes of a coupling
        self.result = CheckResult(False, [], n, max_grad_norm, micro_batch_size=micro_batch_size,
                                  optimizer=None if optimizer_class is None else optimizer_class.__name__)

    def fail(self, text: str) -> None:
        self.result.failures.append(text)

    def _causes(self) -> str:
        """The usual causes of a coupling between examples, in full the first time."""
        if self.causes_at is None:
            self.causes_at = len(self.result.failures) + 1
            return _COUPLING_CAUSES + "."
        return f"Causes and fixes: see problem {self.causes_at}."

    # ------------------------------------------------------------------ the copy
    def _prepare(self) -> None:
        errors = []
        for dtype in (torch.float64, torch.float32, None):
            ref = copy.deepcopy(self.model)
            batch = self.batch
            if dtype is not None:
                ref.to(dtype)
                batch = map_tensors(lambda t: t.to(dtype) if t.is_floating_point() else t, batch)
            disabled = _disable_dropout(ref)
            for p in ref.parameters():
                p.grad = None
            try:
                first = self._loss(ref, batch, seed=1)
                second = self._loss(ref, batch, seed=2)
            except Exception as exc:  # a model or loss that insists on its own dtype
                errors.append(f"{'as is' if dtype is None else dtype}: {type(exc).__name__}: {exc}")
                continue
            break
        else:
            self.fail(
                "loss_fn(model, batch) raised on a copy of the model, so nothing could be checked "
                f"({'; '.join(errors)}). It must run the model on the batch and return the scalar loss "
                "the training loop calls backward() on."
            )
            raise _Stop
        self.dtype = dtype if dtype is not None else _floating_dtype(ref)
        self.tol = _TOLERANCE.get(self.dtype, _LOW_PRECISION_TOLERANCE)
        self.ref, self.data = ref, batch
        self.batch_loss = float(first.detach())
        self.result.dtype, self.result.tolerance = self.dtype, self.tol
        self.result.dropout_disabled = disabled
        self.params = [(name, p) for name, p in ref.named_parameters() if p.requires_grad]
        self.result.trainable = [name for name, _ in self.params]
        if not self.params:
            self.fail("the model has no trainable parameter (requires_grad=True): there is nothing to train or check.")
            raise _Stop
        if not _close(first.detach(), second.detach(), self.tol):
            self.fail(
                f"loss_fn(model, batch) is random even with dropout switched off ({float(first.detach()):.6g} then "
                f"{float(second.detach()):.6g} on the same batch), so dpoptim cannot be compared with a per-example "
                "loop. Random augmentation or noise inside the model or the loss? Switch it off for the "
                "check (a flag of your model), then run the check again."
            )
            raise _Stop

    def _loss(self, model, batch, seed: int = 0) -> torch.Tensor:
        # Inside fork_rng: the caller's generators are restored afterwards. (Not
        # torch.manual_seed, whose first call imports the compiler stack.)
        torch.default_generator.manual_seed(seed)
        for device in self.devices:  # only the CUDA generators fork_rng restores
            torch.cuda.default_generators[device].manual_seed(seed)
        loss = self.loss_fn(model, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise TypeError(f"loss_fn must return a scalar loss tensor (what backward() is called on), got {shape}")
        return loss.reshape(())

    # ------------------------------------------------------------------ the definition
    def _brute_force(self) -> None:
        """``g_i`` from one backward of ``loss_fn(model, batch[i:i+1])`` per example."""
        self.clipped_sum = [torch.zeros_like(p) for _, p in self.params]
        self.removed = _removal_order(self.n, self.removals)
        self.clipped: dict[int, list[torch.Tensor]] = {}
        norms, losses = [], []
        self.losses = losses
        for i in range(self.n):
            for _, p in self.params:
                p.grad = None
            try:
                loss = self._loss(self.ref, take(self.data, [i]))
                losses.append(float(loss.detach()))
                loss.backward()
            except Exception as exc:
                self.fail(
                    f"loss_fn failed on example {i} alone (batch[{i}:{i + 1}]): {type(exc).__name__}: {exc}. "
                    "DP-SGD clips the gradient of each example's own loss, so that loss must exist; a model "
                    "or loss that cannot run on one example mixes the examples of a batch. "
                    + self._causes()
                )
                self.expected = None  # still run dpoptim once, for the error it raises itself
                return
            grads = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone() for _, p in self.params]
            norm = float(_norm(grads))
            norms.append(norm)
            factor = min(1.0, self.c / norm) if norm > 0 else 1.0
            grads = [g * factor for g in grads]
            self.clipped_sum = [s + g for s, g in zip(self.clipped_sum, grads)]
            if i in self.removed:
                self.clipped[i] = grads
        for _, p in self.params:
            p.grad = None
        if not all(math.isfinite(v) for v in norms):
            bad = [i for i, v in enumerate(norms) if not math.isfinite(v)]
            self.fail(f"the per-example gradients of examples {bad[:10]} are not finite; fix the model or the "
                      "batch before checking privacy.")
            raise _Stop
        self.result.gradient_norms = norms
        self.expected = [s / self.n for s in self.clipped_sum]
        # The scale errors are measured against: the largest norm the clipped terms could sum to.
        self.scale = sum(min(v, self.c) for v in norms) / self.n
        if self.scale == 0:
            self.result.notes.append("every per-example gradient is zero on this batch: nothing was compared")
            self.scale = self.c / self.n

    # ------------------------------------------------------------------ measures
    def _error(self, got) -> float:
        return float(_norm([g - e for g, e in zip(got, self.expected)])) / self.scale

    def _worst_parameters(self, got, count: int = 3) -> str:
        errors = [(float((g - e).norm()) / self.scale, name)
                  for (name, _), g, e in zip(self.params, got, self.expected)]
        errors.sort(reverse=True)
        return ", ".join(f"'{name}' ({error:.2g})" for error, name in errors[:count] if error > self.tol) or "no single tensor"


class _Checker(_Reference):
    """What dpoptim does on the same copy, against the definition (:func:`check`)."""

    def run(self) -> None:
        try:
            self._prepare()
            self._brute_force()
            self._with_dpoptim()
            if self.optimizer_class is not None and self.expected is not None:
                self._with_user_optimizer()
        except _Stop:
            pass

    def _build(self, optimizer_class, model, **kwargs):
        params = [p for p in model.parameters() if p.requires_grad]
        return optimizer_class(params, max_grad_norm=self.c, loss_reduction=self.reduction, noise_multiplier=0.0,
                               expected_batch_size=self.n, sample_rate=1.0, process_group=False, **kwargs)

    def _update(self, optimizer, model, indices) -> list[torch.Tensor]:
        """The privatised gradient ``step()`` leaves in ``.grad`` for these examples."""
        optimizer.zero_grad()
        chunk = self.micro or len(indices)
        for start in range(0, len(indices), chunk):
            self._loss(model, take(self.data, indices[start:start + chunk])).backward()
        # How many examples dpoptim's hooks counted (rows of dim 0) and in how many backward
        # passes, if the engine says.
        engine = getattr(optimizer, "_engine", None)
        self.counted = getattr(engine, "examples", None), getattr(engine, "backward_calls", None)
        self.backwards = -(-len(indices) // chunk)
        optimizer.step()
        return [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                for p in model.parameters() if p.requires_grad]

    def _refused(self, exc: Exception, doing: str) -> None:
        text = f"{type(exc).__name__}: {exc}"
        if isinstance(exc, UnsupportedLayerError):
            self.fail(f"(1) dpoptim cannot clip every trainable parameter of this model per example; it refused "
                      f"{doing}: {text}")
        else:
            self.fail(f"dpoptim raised an error {doing} (in loss_fn, backward() or step()): {text}")

    def _with_dpoptim(self) -> None:
        from .optimizer import DPSGD

        steps, sensitivities, errors, counted = self._dpoptim_updates(DPSGD)
        if self.expected is None or not steps:
            return
        self._judge_steps(steps, DPSGD, counted)
        if len(sensitivities) < len(self.removed):
            return  # dpoptim raised during the removals: reported above
        self._judge_removals(sensitivities, errors)

    def _dpoptim_updates(self, optimizer_class):
        """DPSGD's privatised gradients on the copy: the full batch at the first and at a
        later step, then without each removed example. Returns those steps by label, the
        removals' sensitivities and errors (in C/B), and what the engine counted."""
        model = copy.deepcopy(self.ref)
        optimizer = None
        everything = list(range(self.n))
        doing = "building a DPSGD optimizer on the model"
        steps, sensitivities, errors, counted = {}, [], [], None
        try:
            optimizer = self._build(optimizer_class, model, lr=0.0)
            doing = "on the full batch (first step)"
            steps["first step"] = self._update(optimizer, model, everything)
            counted = self.counted
            if self.expected is None:  # the per-example loop failed: nothing to compare with
                return steps, sensitivities, errors, counted
            doing = "on the full batch (second step)"
            steps["later step"] = full = self._update(optimizer, model, everything)
            for i in self.removed:
                doing = f"on the batch without example {i}"
                rest = [j for j in everything if j != i]
                without = self._update(optimizer, model, rest)
                diff = [a - b for a, b in zip(full, without)]
                sensitivities.append(float(_norm(diff)) * self.n / self.c)
                moved = [d - g / self.n for d, g in zip(diff, self.clipped[i])]
                errors.append(float(_norm(moved)) * self.n / self.c)
        except Exception as exc:
            self._refused(exc, doing)
        finally:
            _close_optimizer(optimizer)  # before _diagnose builds another
        return steps, sensitivities, errors, counted

    def _judge_steps(self, steps, optimizer_class, counted) -> None:
        """(2): each step against the per-example loop."""
        self.result.step_error = max(self._error(got) for got in steps.values())
        worst = {label: (self._error(got), self._worst_parameters(got))
                 for label, got in steps.items() if self._error(got) > self.tol}
        if worst:
            error, names = max(worst.values(), key=lambda item: item[0])
            self.fail(
                f"(2) dpoptim's clipped step differs from the per-example loop ({' and '.join(worst)}): relative "
                f"error {error:.3g} (tolerance {self.tol:.0e}), largest in {names}. "
                + self._diagnose(optimizer_class, counted)
            )

    def _judge_removals(self, sensitivities, errors) -> None:
        """(3): removing an example moves the update by its own clipped gradient / n."""
        self.result.removed = list(self.removed)
        self.result.sensitivity = max(sensitivities)
        self.result.removal_error = max(errors)
        # In units of C/B the terms of the clipped sum add up to at most scale * n / C.
        slack = self.tol * max(1.0, self.scale * self.n / self.c)
        if self.result.sensitivity > 1 + slack or self.result.removal_error > slack:
            worst = max(range(len(self.removed)), key=lambda k: max(sensitivities[k] - 1, errors[k]))
            self.fail(
                f"(3) removing example {self.removed[worst]} moved the update by {sensitivities[worst]:.3g} C/B "
                f"(at most 1 allowed), and that change differs from the example's own clipped gradient / n by "
                f"{errors[worst]:.3g} C/B (0 allowed, up to rounding: {slack:.1e}). "
                + ("One example can move the model by more than the clip bound that DP-SGD's noise and the "
                   "accountant's epsilon assume, so the reported epsilon is below the truth. "
                   if sensitivities[worst] > 1 + slack else
                   "It stays within C/B on this batch, but the step is not the clipped sum of per-example "
                   "gradients, so other batches or examples can exceed the bound. ")
                + self._causes()
            )

    def _diagnose(self, optimizer_class, counted) -> str:
        """Tell a coupling between examples from a gradient dpoptim attributes wrongly: run
        the per-example loop through dpoptim itself, one backward() per example."""
        counted, passes = counted
        mean, total = sum(self.losses) / self.n, sum(self.losses)
        found = self.batch_loss
        if self.reduction == "mean" and _close_values(found, total, self.tol) and not _close_values(found, mean, self.tol):
            return (f"loss_fn(model, batch) = {found:.6g} is the sum of the examples' own losses, not their mean "
                    f"({mean:.6g}), but loss_reduction='mean': each example's gradient is taken n times too large. "
                    "Pass loss_reduction='sum' (to the optimizer and to check), or average the loss.")
        if self.reduction == "sum" and _close_values(found, mean, self.tol) and not _close_values(found, total, self.tol):
            return (f"loss_fn(model, batch) = {found:.6g} is the mean of the examples' own losses, not their sum "
                    f"({total:.6g}), but loss_reduction='sum'. Pass loss_reduction='mean' (to the optimizer and to "
                    "check), or sum the loss.")
        decomposes = _close_values(found, mean if self.reduction == "mean" else total, self.tol)
        if passes is not None and passes > self.backwards:
            return (
                f"dpoptim saw {passes} backward passes for {self.backwards} backward() call(s): the model or "
                "the loss runs backward passes of its own (a backward() inside forward or inside an autograd "
                "function) and each was clipped on its own, so one example can move the update by more than "
                "C/B. Compute the loss with one backward() per batch."
            )
        if counted is not None and counted != self.n:
            return (
                f"dpoptim's layer rules found {counted} examples in this batch of {self.n}: inside the model a "
                "tensor with parameters applied to it has something other than the examples at dim 0, so its "
                "rows, not the examples, were clipped one by one. Usual causes: tokens flattened into "
                "dim 0 (x.reshape(-1, d) or x.view(-1, d) before a Linear layer, which applies to the last "
                "dim anyway: drop the reshape) or a sequence-first layout (x.transpose(0, 1), "
                "batch_first=False): keep the example axis at dim 0 in every layer with parameters."
            )
        model = copy.deepcopy(self.ref)
        optimizer = None
        try:
            optimizer = self._build(optimizer_class, model, lr=0.0)
            optimizer.zero_grad()
            for i in range(self.n):
                self._loss(model, take(self.data, [i])).backward()
            optimizer.step()
            alone = [torch.zeros_like(p) if p.grad is None else p.grad.detach().clone()
                     for p in model.parameters() if p.requires_grad]
        except Exception as exc:
            return f"With one backward() per example dpoptim raised {type(exc).__name__}: {exc}"
        finally:
            _close_optimizer(optimizer)
        if self._error(alone) <= self.tol:
            how = "" if decomposes else (
                f" The batch's loss is not made of the examples' own losses either: loss_fn(model, batch) = "
                f"{found:.6g}, while the {self.reduction} of loss_fn(model, batch[i:i+1]) over the examples is "
                f"{mean if self.reduction == 'mean' else total:.6g}.")
            return ("With one backward() per example dpoptim agrees with the loop, so the batch itself "
                    "couples the examples." + how + " " + self._causes())
        return ("dpoptim differs from the loop even with one backward() per example: inside the model a "
                "layer with parameters sees something other than the examples at dim 0 (a sequence-first "
                "tensor, tokens flattened into dim 0), a parameter is used where no layer rule sees all of "
                "it (a weight in a functional call), or a layer rule is wrong. Keep the example axis at "
                "dim 0 and route every use of each parameter through its module; if it still fails, "
                "report it with this model.")

    def _with_user_optimizer(self) -> None:
        from .optimizer import DPOptimizerMixin

        cls = self.optimizer_class
        if not (isinstance(cls, type) and issubclass(cls, DPOptimizerMixin)):
            self.fail(
                f"optimizer_class={getattr(cls, '__name__', cls)!r} is not a dpoptim optimizer: it would apply "
                "raw gradients with no clipping and no noise. Use dpoptim.DPSGD, DPAdam, DPRMSProp or "
                f"dpoptim.make_private({getattr(cls, '__name__', 'YourOptimizer')})."
            )
            return
        kwargs = {k: v for k, v in self.optimizer_kwargs.items() if k not in _OVERRIDDEN}
        model = copy.deepcopy(self.ref)
        optimizer = None
        try:
            optimizer = self._build(cls, model, **kwargs)
            got = self._update(optimizer, model, list(range(self.n)))
        except Exception as exc:
            self._refused(exc, f"with {cls.__name__}({', '.join(sorted(kwargs))})")
            return
        finally:
            _close_optimizer(optimizer)
        self.result.optimizer_error = self._error(got)
        if self.result.optimizer_error > self.tol:
            self.fail(
                f"{cls.__name__} with your settings left a privatised gradient that differs from the "
                f"per-example loop: relative error {self.result.optimizer_error:.3g}, largest in "
                f"{self._worst_parameters(got)}, while DPSGD on the same model "
                + ("agrees." if self.result.step_error is not None and self.result.step_error <= self.tol
                   else "differs too.")
            )


# ---------------------------------------------------------------------- helpers
def example_count(batch) -> int:
    """The size of dim 0 shared by every tensor of ``batch``; raises if they disagree."""
    sizes: set[int] = set()
    _batch_sizes(batch, sizes)
    if len(sizes) != 1:
        raise ValueError(
            "batch must hold tensors that all have the example axis at dim 0; found dim-0 sizes "
            f"{sorted(sizes) if sizes else 'none'}. Pass the batch as the model sees it (a tensor, or tuples, "
            "lists and dicts of tensors), with sequence-first tensors transposed to batch-first."
        )
    return sizes.pop()


def take(batch, indices):
    """The examples ``indices`` of ``batch`` (rows of dim 0 of every tensor; lists of plain
    values of the batch's length are indexed too; other leaves are kept as they are)."""
    n = example_count(batch)
    return _take(batch, list(indices), n)


def _take(obj, indices, n):
    def tensor(x):
        if not isinstance(x, torch.Tensor) or x.dim() == 0:
            return x
        return x[torch.as_tensor(indices, dtype=torch.long, device=x.device)]

    return map_structure(tensor, obj, values=lambda seq: type(seq)(seq[i] for i in indices) if len(seq) == n else seq)


def _disable_dropout(model: nn.Module) -> list[str]:
    """Set every dropout probability of ``model`` to 0, leaving the training mode (and with
    it BatchNorm's batch statistics) alone. Returns what was changed."""
    changed = []
    for name, module in model.named_modules():
        where = name or type(module).__name__
        if _torch.is_dropout(module):
            if module.p > 0:
                changed.append(f"{where} (p={module.p:g})")
                module.p = 0.0
            continue
        # nn.MultiheadAttention.dropout, nn.LSTM.dropout, and the float attention or hidden
        # dropout rates other libraries keep on their modules
        for attribute, value in list(vars(module).items()):
            if "drop" in attribute.lower() and isinstance(value, float) and not isinstance(value, bool) and value > 0:
                changed.append(f"{where}.{attribute} ({value:g})")
                setattr(module, attribute, 0.0)
    return changed


def _removal_order(n: int, count: int) -> list[int]:
    """The first, the last, then others drawn at random (fixed seed: the check repeats)."""
    order = [0, n - 1]
    rest = list(range(1, n - 1))
    random.Random(0).shuffle(rest)
    return (order + rest)[:min(count, n)]


def _floating_dtype(model: nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.get_default_dtype()


def _norm(tensors) -> torch.Tensor:
    total = torch.zeros((), dtype=torch.float64)
    for t in tensors:
        total = total + t.detach().double().square().sum().cpu()
    return total.sqrt()


def _close(a: torch.Tensor, b: torch.Tensor, tol: float) -> bool:
    a, b = float(a), float(b)
    return abs(a - b) <= tol * max(abs(a), abs(b), 1e-12) or (math.isnan(a) and math.isnan(b))


def _close_values(a: float, b: float, tol: float) -> bool:
    return abs(a - b) <= 10 * tol * max(abs(a), abs(b), 1e-12)


def _close_optimizer(optimizer) -> None:
    engine = getattr(optimizer, "_engine", None)
    if engine is not None:
        engine.close()
