"""Step time of every mode of one workload, in one process, taking turns step by step.

Each mode is built (same initial weights, same batches), takes its first step (timed on
its own: dpoptim's first step also checks its rules against autograd and skips ghost
differentiation, so it is slower by design), then ``warmup`` more steps. Then ``rounds``
rounds follow; in each, every mode takes one step, in an order rotated from round to
round. A round's steps run back to back, so the ratio ``mode / non-private`` within one
round sees nearly the same machine load; the reported ratio is the median over rounds
(a shared, noisy machine slows whole stretches of time, which this cancels), the step
time the median over steps.

Run by the suite as ``python -m benchmarks.timing --job mlp:256 ...``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

from . import child
from .workloads import MODES, WORKLOADS, build, first_line, opacus_available, quiet

__all__ = ["measure"]


def _quantiles(values):
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return v, v, v
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def measure(workload, modes, batch_size: int, device: str = "cpu", warmup: int = 5, rounds: int = 30) -> dict:
    import torch

    modes = list(modes)
    results: dict[str, dict] = {}
    trainers = {}
    for mode in modes:
        if mode.startswith("opacus") and not opacus_available():
            results[mode] = {"status": "skipped", "error": "Opacus is not installed (pip install '.[bench]')"}
            continue
        try:
            trainers[mode] = build(workload, mode, batch_size, device)
        except Exception as exc:  # a mode that cannot be set up is a result, not a crash
            results[mode] = {"status": "failed", "error": "setup: " + first_line(exc)}
    for trainer in trainers.values():
        trainer.pause_global_hooks()

    def step(mode) -> float | None:
        trainer = trainers[mode]
        trainer.resume_global_hooks()
        try:
            trainer.synchronize()
            start = time.perf_counter()
            trainer.step()
            trainer.synchronize()
            return time.perf_counter() - start
        except Exception as exc:
            results[mode] = {"status": "failed", "error": f"step {trainer.steps}: " + first_line(exc)}
            del trainers[mode]
            return None
        finally:
            trainer.pause_global_hooks()

    first = {}
    for mode in list(trainers):
        first[mode] = step(mode)
    for _ in range(warmup):
        for mode in list(trainers):
            step(mode)
    gc.collect()

    times: dict[str, list[float]] = {mode: [] for mode in trainers}
    ratios: dict[str, list[float]] = {mode: [] for mode in trainers}
    for r in range(rounds):
        order = list(trainers)
        order = order[r % len(order):] + order[: r % len(order)] if order else order
        this_round = {}
        for mode in order:
            if mode in trainers:
                dt = step(mode)
                if dt is not None:
                    this_round[mode] = dt
        baseline = this_round.get("non-private")
        for mode, dt in this_round.items():
            if mode in trainers:
                times[mode].append(dt)
                if baseline:
                    ratios[mode].append(dt / baseline)

    for mode in modes:
        if mode in trainers and times[mode]:
            q1, med, q3 = _quantiles(times[mode])
            entry = {"status": "ok", "median_ms": med * 1e3, "q1_ms": q1 * 1e3, "q3_ms": q3 * 1e3,
                     "first_step_ms": first[mode] * 1e3, "steps": len(times[mode])}
            if ratios[mode]:
                r1, rmed, r3 = _quantiles(ratios[mode])
                entry.update(ratio=rmed, ratio_q1=r1, ratio_q3=r3)
            results[mode] = entry
    return {
        "workload": workload.name, "batch_size": batch_size, "device": device,
        "threads": torch.get_num_threads(), "warmup": warmup, "rounds": rounds,
        "modes": {mode: results[mode] for mode in modes if mode in results},
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", action="append", required=True, metavar="WORKLOAD:BATCH[:MODE+MODE]",
                        help="a workload, its batch size and optionally its modes (default --modes); "
                             "repeat to time several, one after the other")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    child.pin_threads(args.threads)
    quiet()
    results = []
    for job in args.job:
        name, batch, *modes = job.split(":")
        modes = modes[0].split("+") if modes else args.modes.split(",")
        results.append(measure(WORKLOADS[name], modes, int(batch), args.device, args.warmup, args.rounds))
        gc.collect()
    child.emit({"jobs": results})


if __name__ == "__main__":
    main()
