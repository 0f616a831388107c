"""Peak memory of one training step of one mode, in a process of its own.

*Extra memory* is the peak during training steps minus what is resident once the model,
the data and the optimizer exist: gradients, saved activations, per-example quantities,
temporaries. On CPU it is read from the kernel (``VmHWM``/``VmRSS`` in
``/proc/self/status``; tracemalloc does not see torch's allocations). On CUDA it is
``torch.cuda.max_memory_allocated()`` minus ``memory_allocated()`` after setup.

What the process does, in order:

1. A throw-away run of the same mode on the same shapes (two steps), then deleted. It
   loads the code pages, thread pools and kernel caches that any first step touches, so
   that those one-off megabytes are not charged to the step. The parent sets glibc's
   ``MALLOC_MMAP_THRESHOLD_`` so that freed tensors go back to the system at once.
2. The measured trainer is built; ``baseline`` = resident memory now.
3. First step (dpoptim checks its rules against autograd in it): its peak is reported as
   ``first_step_extra``.
4. The peak is reset (``/proc/self/clear_refs``), ``steps`` more steps run: their peak
   minus ``baseline`` is ``extra``, the number compared across modes.
"""

from __future__ import annotations

import argparse
import gc
import re

from . import child
from .workloads import WORKLOADS, build, first_line, opacus_available, quiet

__all__ = ["measure", "MALLOC_ENV"]

# A fixed threshold also turns off glibc's sliding one, which would otherwise keep freed
# blocks of a size seen before in the heap, resident but unused.
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}

_MIB = 1024 * 1024


def _status_kib(*keys):
    text = open("/proc/self/status").read()
    return [int(re.search(rf"^{key}:\s+(\d+) kB", text, re.M).group(1)) for key in keys]


class _CpuMeter:
    kind = "rss"

    def current(self) -> float:
        return _status_kib("VmRSS")[0] * 1024 / _MIB

    def peak(self) -> float:
        return _status_kib("VmHWM")[0] * 1024 / _MIB

    def reset(self) -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current VmRSS (Linux >= 4.0)
            return True
        except OSError:
            return False


class _CudaMeter:
    kind = "cuda_allocated"

    def __init__(self, device):
        import torch

        self.torch, self.device = torch, torch.device(device)

    def current(self) -> float:
        self.torch.cuda.synchronize(self.device)
        return self.torch.cuda.memory_allocated(self.device) / _MIB

    def peak(self) -> float:
        self.torch.cuda.synchronize(self.device)
        return self.torch.cuda.max_memory_allocated(self.device) / _MIB

    def reset(self) -> bool:
        self.torch.cuda.synchronize(self.device)
        self.torch.cuda.reset_peak_memory_stats(self.device)
        return True


def measure(workload, mode: str, batch_size: int, device: str = "cpu", steps: int = 3) -> dict:
    if mode.startswith("opacus") and not opacus_available():
        return {"status": "skipped", "error": "Opacus is not installed (pip install '.[bench]')"}
    meter = _CudaMeter(device) if device.startswith("cuda") else _CpuMeter()
    try:
        warm = build(workload, mode, batch_size, device)
        for _ in range(2):
            warm.step()
        warm.synchronize()
    except Exception as exc:
        return {"status": "failed", "error": first_line(exc)}
    del warm
    gc.collect()

    trainer = build(workload, mode, batch_size, device)
    gc.collect()
    baseline = meter.current()
    resettable = meter.reset()
    try:
        trainer.step()
        first = meter.peak() - baseline
        if resettable:
            resettable = meter.reset()
        for _ in range(steps):
            trainer.step()
        extra = meter.peak() - baseline
    except Exception as exc:
        return {"status": "failed", "error": first_line(exc)}
    result = {"status": "ok", "meter": meter.kind, "baseline_mib": baseline, "extra_mib": extra,
              "first_step_extra_mib": first}
    if not resettable:
        result["note"] = "peak could not be reset after the first step: extra includes it"
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--mode", required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    child.pin_threads(args.threads)
    quiet()
    result = measure(WORKLOADS[args.workload], args.mode, args.batch, args.device, args.steps)
    result.update(workload=args.workload, mode=args.mode, batch_size=args.batch, device=args.device)
    child.emit(result)


if __name__ == "__main__":
    main()
