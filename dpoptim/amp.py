"""Float16 training with a ``torch.amp.GradScaler`` under DP-SGD: the loss scale ``S`` is
divided out of every per-example gradient before clipping, and the scaler is never told of
an overflow.

``min(1, C S / ||S g_i||) = min(1, C / ||g_i||)``: clipping the scaled gradients to ``C S``
gives the factors of the unscaled ones, and ``step()`` divides the sums by ``S`` before
the noise. An example whose gradient overflows gets clip factor 0; the step is still taken,
noised and charged, so neither the step nor the scale depends on the data.
"""

from __future__ import annotations

import math
import warnings

from . import _torch

__all__ = ["MixedPrecisionMixin", "check_grad_scaler"]


class MixedPrecisionMixin:
    """The GradScaler side of a DP optimizer (which sets ``self._grad_scaler``)."""

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


def check_grad_scaler(scaler, stacklevel: int = 3) -> None:
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
            stacklevel=stacklevel,
        )
