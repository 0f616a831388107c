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

__all__ = ["measure", "measure_together"]


def _quantiles(values):
    if len(values) < 2:
        v = values[0] if values else float("nan")
        return v, v, v
    q = statistics.quantiles(values, n=4, method="inclusive")
    return q[0], statistics.median(values), q[2]


def measure(workload, modes, batch_size: int, device: str = "cpu", warmup: int = 5, rounds: int = 30) -> dict:
    """Step times of ``modes`` on one workload at one batch size."""
    return measure_together([(workload, batch_size, modes)], device, warmup, rounds)[0]


def measure_together(jobs, device: str = "cpu", warmup: int = 5, rounds: int = 30) -> list[dict]:
    """Step times of several ``(workload, batch_size, modes)`` jobs in one process, every
    mode of every job taking one step per round: load that drifts over time then reaches
    all of them alike (the scaling section compares absolute times across batch sizes)."""
    import torch

    results: list[dict[str, dict]] = [{} for _ in jobs]
    trainers = {}  # (job index, mode) -> Trainer
    for j, (workload, batch_size, modes) in enumerate(jobs):
        for mode in modes:
            if mode.startswith("opacus") and not opacus_available():
                results[j][mode] = {"status": "skipped", "error": "Opacus is not installed (pip install '.[bench]')"}
                continue
            try:
                trainers[j, mode] = build(workload, mode, batch_size, device)
            except Exception as exc:  # a mode that cannot be set up is a result, not a crash
                results[j][mode] = {"status": "failed", "error": "setup: " + first_line(exc)}
    for trainer in trainers.values():
        trainer.pause_global_hooks()

    def step(key) -> float | None:
        trainer = trainers[key]
        trainer.resume_global_hooks()
        try:
            trainer.synchronize()
            start = time.perf_counter()
            trainer.step()
            trainer.synchronize()
            return time.perf_counter() - start
        except Exception as exc:
            results[key[0]][key[1]] = {"status": "failed", "error": f"step {trainer.steps}: " + first_line(exc)}
            del trainers[key]
            return None
        finally:
            trainer.pause_global_hooks()

    first = {}
    for key in list(trainers):
        first[key] = step(key)
    for _ in range(warmup):
        for key in list(trainers):
            step(key)
    gc.collect()

    times: dict[tuple, list[float]] = {key: [] for key in trainers}
    ratios: dict[tuple, list[float]] = {key: [] for key in trainers}
    for r in range(rounds):
        order = list(trainers)
        order = order[r % len(order):] + order[: r % len(order)] if order else order
        this_round = {}
        for key in order:
            if key in trainers:
                dt = step(key)
                if dt is not None:
                    this_round[key] = dt
        for (j, mode), dt in this_round.items():
            if (j, mode) in trainers:
                times[j, mode].append(dt)
                baseline = this_round.get((j, "non-private"))
                if baseline:
                    ratios[j, mode].append(dt / baseline)

    out = []
    for j, (workload, batch_size, modes) in enumerate(jobs):
        for mode in modes:
            key = (j, mode)
            if key in trainers and times[key]:
                q1, med, q3 = _quantiles(times[key])
                entry = {"status": "ok", "median_ms": med * 1e3, "q1_ms": q1 * 1e3, "q3_ms": q3 * 1e3,
                         "first_step_ms": first[key] * 1e3, "steps": len(times[key])}
                if ratios[key]:
                    r1, rmed, r3 = _quantiles(ratios[key])
                    entry.update(ratio=rmed, ratio_q1=r1, ratio_q3=r3)
                results[j][mode] = entry
        out.append({
            "workload": workload.name, "batch_size": batch_size, "device": device,
            "threads": torch.get_num_threads(), "warmup": warmup, "rounds": rounds,
            "modes": {mode: results[j][mode] for mode in modes if mode in results[j]},
        })
    return out


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
    parser.add_argument("--together", action="store_true",
                        help="time the jobs in one rotation (round by round) instead of one after the other")
    args = parser.parse_args(argv)
    child.pin_threads(args.threads)
    quiet()
    jobs = []
    for job in args.job:
        name, batch, *modes = job.split(":")
        jobs.append((WORKLOADS[name], int(batch), modes[0].split("+") if modes else args.modes.split(",")))
    if args.together:
        results = measure_together(jobs, args.device, args.warmup, args.rounds)
    else:
        results = []
        for workload, batch, modes in jobs:
            results.append(measure(workload, modes, batch, args.device, args.warmup, args.rounds))
            gc.collect()
    child.emit({"jobs": results})


if __name__ == "__main__":
    main()
