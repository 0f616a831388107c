"""The Gaussian noise of a step: which generator it comes from, and when it is drawn.

Every coordinate of every noisy sum gets its own standard normal ``z``, scaled by
``sigma * C`` when it is added (:func:`dpoptim.privatize.add_noise_` has the law and secure
mode's four-draw sum). Two kinds of generator, drawn from differently:

* **A generator given by the user** (``generator=``): its noise is drawn in ``step()``,
  parameter by parameter in the order of the parameter groups, exactly as in every earlier
  version: the same seed gives the same values in the same order, and a checkpoint that
  carries the generator's state resumes bit for bit. Nothing is ever drawn ahead from it
  (the user may draw from it between steps).
* **The optimizer's own generators** (seeded from the operating system, one per device;
  in secure mode a fresh one for every draw, :func:`dpoptim.privatize.fresh_generator`):
  their values cannot be reproduced by anyone, so when they are drawn is free. On CPU in
  secure mode (see :attr:`NoiseMixin._predraw_noise`), when a step's noise is large (:data:`PREDRAW_MIN` normal draws or more), it is one flat
  buffer of standard normals per dtype, and the buffer of the *next* step is drawn ahead
  on a background thread as soon as a step has taken its own (:class:`_Pending`): the draw
  then overlaps the forward and backward passes instead of adding to ``step()``. Smaller
  draws, and draws on other devices (asynchronous there already), are made in ``step()``,
  parameter by parameter: handing them to a thread would cost more than it saves.

A pre-drawn buffer is used by one step at most: ``step()`` takes it out of the optimizer
before using it, and uses it only if it was drawn for the same parameters (their ids,
shapes and order), device, dtype, kind of generator (secure or not) and generator as the
step needs now; otherwise it is dropped, unused, and the noise drawn afresh. The buffer
holds standard normals, scaled by the ``sigma`` and ``C`` in force when it is added, so a
changed ``noise_multiplier`` or ``max_grad_norm`` needs no redraw. It lives only in memory:
``state_dict()`` never contains it (nor the optimizer's own generators), and a process
forked from the optimizer's drops it with the generators (:meth:`NoiseMixin._forget_parent_noise`).
Its cost is memory: one copy of the parameters, in float32 or wider, held from one step
to the next (:data:`PREDRAW_MAX` bounds it).
"""

from __future__ import annotations

import os

import torch

from . import background, fsdp
from .privatize import add_noise_, fresh_generator, standard_normal

__all__ = ["NoiseMixin"]

#: Smallest draw worth handing to the background thread, in normal draws (four per number
#: in secure mode): below it the hand-over costs more than the draw (measured on CPU: the
#: 64-32-10 MLP's 2,410 numbers are slower drawn ahead, the 784-512-512-10 MLP's 670k faster).
PREDRAW_MIN = 1 << 16
#: Largest buffer drawn ahead, in numbers (64 MiB in float32). The buffer is held through
#: the next forward and backward passes, so it adds one copy of the parameters to the peak
#: memory of a step: above this size (over 16M parameters) the noise is drawn in step().
PREDRAW_MAX = 1 << 24


class _Pending:
    """A buffer of standard normals drawn ahead for the next step (a future), and what it
    was drawn for (``key``; see :meth:`NoiseMixin._flat_noise`)."""

    __slots__ = ("key", "future")

    def __init__(self, key, future):
        self.key, self.future = key, future


def _draw(shape, dtype: torch.dtype, device: torch.device, generator, secure: bool) -> torch.Tensor:
    """Standard normals from the optimizer's own ``generator``, or in secure mode from a
    fresh one (a new seed from the operating system for every draw)."""
    return standard_normal(shape, dtype, fresh_generator(device) if secure else generator, secure)


class NoiseMixin:
    """The noise side of a DP optimizer: its generators and the draws (see the module
    docstring). The optimizer calls :meth:`_init_noise` in its constructor."""

    #: Whether CPU noise from the optimizer's own generators is drawn a step ahead. None
    #: (the default): in secure mode only, where a number costs four normal draws and
    #: drawing ahead saves most (784-512-512-10 MLP: about 2.4x non-private's step time
    #: drawn in ``step()``, 1.4x drawn ahead). Plain draws stay in ``step()``: there the
    #: gain is smaller (about 1.5x to 1.4x) and the buffer held from one step to the next
    #: would add a copy of the parameters to the step's peak memory (1.25x to about 1.55x
    #: non-private's extra memory on that MLP). True: always; False: never.
    _predraw_noise: bool | None = None

    def _init_noise(self, generator: torch.Generator | None, secure_mode: bool) -> None:
        self._user_generator = generator
        self.secure_mode = bool(secure_mode)
        self._generators: dict[torch.device, torch.Generator] = {}
        self._pending: dict[tuple, _Pending] = {}  # (device, dtype) -> the buffer drawn ahead
        self._noise_pid = os.getpid()

    def _forget_parent_noise(self) -> None:
        """In a process forked from the one that built the optimizer: drop the generators
        and buffers copied from the parent, which would give both processes the same
        noise (and a buffer whose draw ran in the parent's thread would never arrive)."""
        pid = os.getpid()
        if pid != self._noise_pid:
            self._noise_pid = pid
            self._generators.clear()
            self._pending.clear()

    def _generator_for(self, device: torch.device) -> torch.Generator:
        if self._user_generator is not None:
            return self._user_generator
        if self.secure_mode:
            return fresh_generator(device)  # a new seed from the OS at every draw
        generator = self._generators.get(device)
        if generator is None:
            generator = self._generators[device] = fresh_generator(device)
        return generator

    def _add_noise(self, pairs_by_device: dict, sigma: float, bound: float) -> None:
        """``S + N(0, sigma^2 C^2 I)`` for every clipped sum S, in place.
        ``pairs_by_device`` maps each device to its ``(parameter, sum)`` pairs, in the order
        of the parameter groups."""
        std = sigma * bound
        self._forget_parent_noise()
        stale = set(self._pending)
        for device, pairs in pairs_by_device.items():
            sums = [s for _, s in pairs]
            if not (std > 0 and self._draws_ahead(device, sums)):
                add_noise_(sums, sigma, bound, self._generator_for(device), self.secure_mode)
                continue
            by_dtype: dict[torch.dtype, list] = {}
            for p, s in pairs:
                by_dtype.setdefault(torch.promote_types(s.dtype, torch.float32), []).append((p, s))
            for dtype, group in by_dtype.items():
                stale.discard((device, dtype))
                z = self._flat_noise(device, dtype, group)
                offset = 0
                for _, s in group:
                    n = s.numel()
                    s.add_(z[offset:offset + n].view(s.shape), alpha=std)
                    offset += n
        for slot in stale:  # drawn for a step that no longer comes: dropped unused
            self._pending.pop(slot).future.exception()

    def _draws_ahead(self, device: torch.device, sums: list) -> bool:
        """Whether the noise of ``sums`` is drawn a step ahead (see the module docstring):
        the optimizer's own generator on CPU, and a draw large enough to be worth it."""
        wanted = self.secure_mode if self._predraw_noise is None else self._predraw_noise
        if not wanted or self._user_generator is not None or device.type != "cpu":
            return False
        numel = sum(s.numel() for s in sums)
        return PREDRAW_MIN <= numel * (4 if self.secure_mode else 1) and numel <= PREDRAW_MAX

    def _flat_noise(self, device: torch.device, dtype: torch.dtype, pairs: list) -> torch.Tensor:
        """Standard normals for the sums of ``pairs`` laid end to end: the buffer drawn
        ahead for exactly these parameters, else a fresh draw; then the next step's buffer
        is drawn ahead, on the background thread."""
        numel = sum(s.numel() for _, s in pairs)
        generator = None if self.secure_mode else self._generator_for(device)
        key = (tuple((id(p), s.shape) for p, s in pairs), id(generator), self.secure_mode)
        pending = self._pending.pop((device, dtype), None)  # taken out: it is used once at most
        z = None
        if pending is not None and pending.key == key:
            z = pending.future.result()
        elif pending is not None:  # dropped unused, once its draw is over: one draw at a time
            pending.future.exception()
        if z is None:
            z = _draw(numel, dtype, device, generator, self.secure_mode)
        future = background.executor("noise").submit(_draw, numel, dtype, device, generator, self.secure_mode)
        self._pending[device, dtype] = _Pending(key, future)
        return z

    def _add_shard_noise(self, local: torch.Tensor, p, sigma: float, bound: float) -> None:
        """Noise for this rank's shard ``local`` of an FSDP2-sharded parameter ``p`` (see
        :mod:`dpoptim.fsdp`), in place."""
        self._forget_parent_noise()
        if self._user_generator is not None:
            # Every rank draws the whole vector and keeps its slice: the noise of an
            # unsharded run with this generator, one independent draw per coordinate.
            noise = add_noise_([torch.zeros(p.shape, dtype=local.dtype, device=local.device)],
                               sigma, bound, self._user_generator, self.secure_mode)[0]
            local.add_(fsdp.local_slice(noise, p))
        else:  # each rank's own generator, seeded by the operating system
            add_noise_([local], sigma, bound, self._generator_for(local.device), self.secure_mode)
