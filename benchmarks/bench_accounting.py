"""Timing of the privacy accountants against their speed targets (not a test).

    python -m benchmarks.bench_accounting            # the table
    python -m benchmarks.bench_accounting --repeat 9 # more repetitions per row

Every repetition uses a noise multiplier not seen before (a tiny offset), so nothing is
served from the accountants' caches unless the row says "cached". Wall and CPU time are
both shown: on a busy machine the wall time of a single-threaded computation grows with
the load while its CPU time does not.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from dpoptim.accounting import calibrate_noise, epsilon, epsilon_of_ledger, max_steps

_offsets = itertools.count(1)


def _fresh(sigma: float) -> float:
    """sigma nudged to a value no cache has seen."""
    return sigma * (1.0 + 1e-9 * next(_offsets))


def _time(call, repeat: int) -> tuple[float, float]:
    walls, cpus = [], []
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        call()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return statistics.median(walls), statistics.median(cpus)


def _rows():
    """(label, call, target seconds or None)."""
    schedule = [(1.0 + 0.05 * i, 0.004, 10_000) for i in range(10)]
    return [
        ("PLD epsilon, 100,000 steps", lambda: epsilon(_fresh(1.1), 0.004, 100_000, 1e-5), 0.5),
        ("PLD epsilon, 1,000,000 steps", lambda: epsilon(_fresh(1.1), 0.004, 10**6, 1e-5), None),
        ("PLD epsilon, 100,000 steps, delta 1e-10", lambda: epsilon(_fresh(1.1), 0.004, 100_000, 1e-10), None),
        ("PLD epsilon, q = 1e-6", lambda: epsilon(_fresh(1.0), 1e-6, 100_000, 1e-5), None),
        ("PLD epsilon, 10-run schedule", lambda: epsilon_of_ledger(
            [(_fresh(s), q, c) for s, q, c in schedule], 1e-5), None),
        ("PLD calibration (eps 3, q 0.01, 10,000 steps)",
         lambda: calibrate_noise(_fresh(3.0), 1e-5, 0.01, 10_000), 3.0),
        ("PLD max_steps (budget 3, q 0.01)", lambda: max_steps(_fresh(1.0), 0.01, 1e-5, 3.0), None),
        ("RDP epsilon, 100,000 steps", lambda: epsilon(_fresh(1.1), 0.004, 100_000, 1e-5, "rdp"), 0.02),
        ("RDP epsilon, 100,000 steps, cached", lambda: epsilon(1.1, 0.004, 100_000, 1e-5, "rdp"), None),
        ("RDP calibration", lambda: calibrate_noise(_fresh(3.0), 1e-5, 0.01, 10_000, "rdp"), None),
    ]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="repetitions per row (median shown)")
    args = parser.parse_args(argv)
    # Warm up: imports, FFT plans, the RDP order layout.
    epsilon(1.0, 0.01, 1000, 1e-5)
    epsilon(1.0, 0.01, 1000, 1e-5, "rdp")
    rows = [(label, *_time(call, args.repeat), target) for label, call, target in _rows()]
    width = max(len(label) for label, *_ in rows)
    print(f"{'':<{width}}  {'wall ms':>9}  {'cpu ms':>9}  {'target ms':>9}  ")
    for label, wall, cpu, target in rows:
        goal = f"{target * 1e3:9.0f}" if target else f"{'':>9}"
        verdict = "" if target is None else ("ok" if min(wall, cpu) <= target else "SLOW")
        print(f"{label:<{width}}  {wall * 1e3:9.1f}  {cpu * 1e3:9.1f}  {goal}  {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
