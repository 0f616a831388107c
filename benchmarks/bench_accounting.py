"""Accounting: time and tightness against speed targets and peers (not a test).

    python -m benchmarks.bench_accounting              # timings and epsilons
    python -m benchmarks.bench_accounting --bracket    # also rigorous lower bounds (slow)
    python -m benchmarks.bench_accounting --repeat 5   # more repetitions per timed row
    python -m benchmarks.bench_accounting --groups     # the schedule at several group limits
    python -m benchmarks.bench_accounting --survey 60 --seed 3   # random calibrations near epsilon's zero
    python -m benchmarks.bench_accounting --appends 25 --seed 1  # one pair more on random schedules
    python -m benchmarks.bench_accounting --audit 40 --seed 41   # the upper against the lower bound
    python -m benchmarks.bench_accounting --sweeps 100 --seed 42 # fine monotonicity sweeps of single runs
    python -m benchmarks.bench_accounting --long 200 --seed 6    # random single runs of 10^8 steps, timed
    python -m benchmarks.bench_accounting --budget-stop 1.0      # a schedule run to its budget, two ways

Timed rows use a noise multiplier no cache has seen (a tiny offset). Wall and CPU time are
both shown: on a busy machine the wall time of a single-threaded computation grows with
the load while its CPU time does not. ``--bracket`` adds an independent rigorous lower
bound to each epsilon row (the dominated PLD, or the shifted Gaussian mixture for tiny
sigma, or the analytic Gaussian for q = 1) and the gap to it: the exact epsilon lies in
``[lower, reported]``. Google's ``dp_accounting`` (PLD, and RDP) and Opacus' PRV
accountant are shown beside dpoptim when installed; neither is required.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import random
import statistics
import time

from dpoptim.accounting import calibrate as calibrate_module
from dpoptim.accounting import calibrate_noise, epsilon_of_ledger
from dpoptim.accounting.gaussian import mixture_epsilon_lower_bound
from dpoptim.accounting.pld import pld_epsilon_lower_bound

_offsets = itertools.count(1)


def _fresh(sigma: float) -> float:
    """sigma nudged to a value no cache has seen."""
    return sigma * (1.0 + 1e-9 * next(_offsets))


def _fresh_ledger(ledger: list) -> list:
    """``ledger`` with every noise multiplier nudged by one factor no cache has seen. (A
    nudge per run drifted a long ledger by up to 10^-4 of sigma, pair against pair, far
    from its label: the 2,000 tiny-q pairs reported 0.006698 for 0.006684.)"""
    factor = 1.0 + 1e-9 * next(_offsets)
    return [(sigma * factor if 0 < sigma < math.inf else sigma, q, count) for sigma, q, count in ledger]


def _time(call, repeat: int):
    walls, cpus, value = [], [], None
    for _ in range(repeat):
        wall, cpu = time.perf_counter(), time.process_time()
        value = call()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
    return value, statistics.median(walls), statistics.median(cpus)


def schedule_ledger(runs: int = 10_000) -> list:
    """A per-step style schedule: sigma from 0.8 to 2.0 and q from 0.002 to 0.02 over
    ``runs`` runs of 100 steps (10^6 steps in all)."""
    return [(0.8 + 1.2 * i / (runs - 1), 0.002 * 10 ** (i / (runs - 1)), 100) for i in range(runs)]


def step_schedule_ledger(steps: int = 10_000) -> list:
    """A schedule that changes at every step: sigma from 1.5 down to 0.8 at q 0.01, one
    step per pair (what a per-step noise schedule records)."""
    return [(1.5 - 0.7 * t / steps, 0.01, 1) for t in range(steps)]


def tiny_q_schedule_ledger(pairs: int, sigmas: tuple, rates: tuple) -> list:
    """One step per pair, sigma moving linearly and q geometrically between the two given:
    a schedule at tiny q, where one rare loss decides epsilon."""
    return [(sigmas[0] + (sigmas[1] - sigmas[0]) * t / pairs, rates[0] * (rates[1] / rates[0]) ** (t / pairs), 1)
            for t in range(pairs)]


def rate_schedule_ledger(runs: int, steps: int, sigmas: tuple, rates: tuple) -> list:
    """``runs`` runs of ``steps`` steps, sigma moving linearly and q geometrically between
    the two given."""
    return [(sigmas[0] + (sigmas[1] - sigmas[0]) * t / (runs - 1), rates[0] * (rates[1] / rates[0]) ** (t / (runs - 1)),
             steps) for t in range(runs)]


def _ledgers():
    """(label, ledger, delta, target seconds or None)."""
    return [
        ("10^4-run schedule, delta 1e-5", schedule_ledger(), 1e-5, 0.5),
        ("10^4 one-step pairs (sigma 1.5 -> 0.8, q 0.01)", step_schedule_ledger(), 1e-5, 0.5),
        ("T = 10^8 (sigma 1, q 1e-3)", [(1.0, 1e-3, 10**8)], 1e-5, 0.5),
        ("tiny q: 2,000 one-step pairs (sigma 1.2 -> 0.6, q 1e-4 -> 1e-5)",
         tiny_q_schedule_ledger(2000, (1.2, 0.6), (1e-4, 1e-5)), 1e-5, None),
        ("tiny q: 10^4 one-step pairs (sigma 1.2 -> 0.6, q 1e-4 -> 1e-5)",
         tiny_q_schedule_ledger(10_000, (1.2, 0.6), (1e-4, 1e-5)), 1e-5, 0.5),
        ("tiny q: 120 one-step pairs (sigma 0.95 -> 0.48, q 2.1e-5), delta 7.5e-6",
         tiny_q_schedule_ledger(120, (0.9547, 0.4768), (2.0857e-5, 2.0857e-5)), 7.4614e-6, None),
        ("small q: 10^4-run sigma schedule (sigma 1 -> 0.8, q 1e-4, 100 steps each)",
         [(0.8 ** (i / 9_999), 1e-4, 100) for i in range(10_000)], 1e-5, None),
        ("small q: 100-run sigma schedule (sigma 1 -> 0.8, q 1e-5, 10^5 steps each)",
         [(0.8 ** (i / 99), 1e-5, 100_000) for i in range(100)], 1e-5, None),
        ("tiny q: 1,000 runs of 1000 steps (sigma 0.648 -> 3.67, q 5.4e-6 -> 2.9e-5), delta 3.5e-12",
         rate_schedule_ledger(1000, 1000, (0.648, 3.67), (5.4e-6, 2.9e-5)), 3.5e-12, None),
        ("100 runs of 3000 steps (sigma 1.25 -> 1, q 0.055 -> 0.37), delta 1e-9 (rounding decides, by little)",
         rate_schedule_ledger(100, 3000, (1.25, 1.0), (0.055, 0.37)), 1e-9, None),
        ("10^4 runs of 1000 steps (sigma 1.25 -> 1, q 0.055 -> 0.37), delta 2.9e-10 (the mixtures' RDP answers)",
         rate_schedule_ledger(10_000, 1000, (1.2467, 0.99642), (0.055327, 0.37285)), 2.852e-10, None),
        ("sigma 0.661, q 1e-6, 10^8 steps, delta 1e-12 (one rare loss decides)", [(0.661, 1e-6, 10**8)], 1e-12, None),
        ("sigma 0.4773, q 4.6e-6, 6.2x10^6 steps, delta 0.04 (epsilon near 0: the tails of a wide profile)",
         [(0.47731, 4.6256e-6, 6_168_826)], 0.040257, None),
        ("one step at sigma 268, q 1.8e-3, delta 2.7e-6 (epsilon 1.8e-7: rounding decides)",
         [(267.92, 1.839e-3, 1)], 2.651e-6, None),
        ("T = 10^7 (sigma 1, q 1e-3)", [(1.0, 1e-3, 10**7)], 1e-5, None),
        ("T = 5x10^6 (sigma 1, q 1e-3)", [(1.0, 1e-3, 5 * 10**6)], 1e-5, None),
        ("sigma 4.4, q 0.033, 10^8 steps, delta 4.2e-8 (one grid: +1.5%)", [(4.40371, 0.0332264, 10**8)],
         4.23556e-08, 0.5),
        ("100-run sigma schedule (1..1.99, q 0.01)", [(1.0 + 0.01 * i, 0.01, 100) for i in range(100)], 1e-5, None),
        ("80-run q schedule (sigma 1), delta 1e-9", [(1.0, 0.001 * 1.05**i, 100) for i in range(80)], 1e-9, None),
        ("sigma 1.1, q 0.004, 10^4 steps", [(1.1, 0.004, 10_000)], 1e-5, None),
        ("sigma 0.0049, q 0.01, 1000 steps", [(0.0049, 0.01, 1000)], 1e-5, None),
        ("sigma 0.0051, q 0.01, 1000 steps", [(0.0051, 0.01, 1000)], 1e-5, None),
        ("sigma 0.02, q 1e-6, 10^8 steps, delta 1e-12", [(0.02, 1e-6, 10**8)], 1e-12, None),
        ("sigma 0.661, q 1e-6, 10^6 steps, delta 1e-12 (one rare loss decides)", [(0.661, 1e-6, 10**6)], 1e-12, None),
        ("sigma 0 then sigma 1, q 1e-7 then 0.01", [(0.0, 1e-7, 30), (1.0, 0.01, 1000)], 1e-5, None),
        ("sigma 0, q 1e-6 < delta, 10 steps", [(0.0, 1e-6, 10)], 1e-5, None),
    ]


def _lower_bound(ledger, delta):
    """A rigorous lower bound: the largest of the dominated PLD (merged bins, any number
    of steps; up to 1024 groups, each at its largest sigma and smallest q) and, for a
    single run, the shifted Gaussian mixture (tight for tiny sigma)."""
    noisy = [run for run in ledger if run[0] > 0]
    mixture = 0.0
    if len(noisy) == len(ledger) == 1:
        sigma, q, steps = ledger[0]
        mixture = mixture_epsilon_lower_bound(sigma, q, steps, delta)
        if sigma < 0.1 or q == 1.0:
            return mixture
    pairs = len({(sigma, q) for sigma, q, _ in noisy})
    return max(mixture, pld_epsilon_lower_bound(ledger, delta, max_groups=min(max(pairs, 1), 1024)))


_PEER_MEMORY = 6 * 2**30  # bytes of address space a peer may use
_PEER_SECONDS = 300


def _peers(ledger, delta) -> dict:
    """Each peer in a child process with a memory and time limit: at 10^8 steps a PRV or
    PLD peer can take tens of GB, and a peer failing is a result, not a crash."""
    if len(ledger) > 200:  # both compose one event per run: minutes for 10^4 runs
        return {"peers": ("not run: one composition per run", math.nan)}
    import multiprocessing

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_peers_child, args=(ledger, delta, queue))
    child.start()
    child.join(_PEER_SECONDS)
    if child.is_alive():
        child.kill()
        child.join()
        return {"peers": (f"not run: over {_PEER_SECONDS} s", math.nan)}
    if queue.empty():
        return {"peers": (f"failed: exit {child.exitcode} (memory limit {_PEER_MEMORY / 2**30:g} GiB?)", math.nan)}
    return queue.get()


def _peers_child(ledger, delta, queue) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (_PEER_MEMORY, _PEER_MEMORY))
    queue.put(_peer_values(ledger, delta))


def _peer_values(ledger, delta) -> dict:
    out = {}
    try:
        import dp_accounting

        def event():
            parts = [
                dp_accounting.SelfComposedDpEvent(
                    dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), count)
                for sigma, q, count in ledger
            ]
            return dp_accounting.ComposedDpEvent(parts)

        start = time.process_time()
        pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-3)
        pld.compose(event())
        out["dp_accounting PLD"] = (pld.get_epsilon(delta), time.process_time() - start)
        start = time.process_time()
        rdp = dp_accounting.rdp.RdpAccountant()
        rdp.compose(event())
        out["dp_accounting RDP"] = (rdp.get_epsilon(delta), time.process_time() - start)
    except ImportError:
        pass
    except Exception as error:  # a peer failing is a result, not a crash
        out["dp_accounting"] = (f"failed: {type(error).__name__}", math.nan)
    try:
        from opacus.accountants import PRVAccountant

        start = time.process_time()
        prv = PRVAccountant()
        prv.history = [(sigma, q, count) for sigma, q, count in ledger]
        out["Opacus PRV"] = (prv.get_epsilon(delta=delta, eps_error=0.01), time.process_time() - start)
    except ImportError:
        pass
    except Exception as error:
        out["Opacus PRV"] = (f"failed: {type(error).__name__}", math.nan)
    return out


def _growing_and_max_steps(repeat: int) -> None:
    """What training asks: privacy_spent() after each step of a long schedule (the ledger
    grows by one step, the transforms of its groups are re-used), and max_steps on a
    ledger of many distinct pairs (once per change of (sigma, q) when a budget is set)."""
    from dpoptim.accounting import max_steps

    print()
    print("| training-time question | answer | wall s | cpu s | target s |")
    print("| --- | --- | --- | --- | --- |")
    for label, ledger in (("10^4-run schedule", schedule_ledger()),
                          ("100-run sigma schedule", [(1.0 + 0.01 * i, 0.01, 100) for i in range(100)]),
                          ("10^4 one-step pairs", step_schedule_ledger()),
                          ("small q: 10^4-run sigma schedule (q 1e-4)",
                           [(0.8 ** (i / 9_999), 1e-4, 100) for i in range(10_000)]),
                          ("small q: 100-run sigma schedule (q 1e-5)",
                           [(0.8 ** (i / 99), 1e-5, 100_000) for i in range(100)])):
        ledger = _fresh_ledger(ledger)
        epsilon_of_ledger(ledger, 1e-5)  # what the previous privacy_spent() computed
        sigma, q, count = ledger[-1]
        # the next step: one more of the last pair, or (changing every step) a new pair
        grown = [*ledger, (sigma * 0.99995, q, 1)] if count == 1 else [*ledger[:-1], (sigma, q, count + 1)]
        value, wall, cpu = _time(lambda: epsilon_of_ledger(grown, 1e-5), 1)
        print(f"| {label}: one more step, privacy_spent() | {_show(value)} | {wall:.2f} | {cpu:.2f} | 0.5 |")
        budget = epsilon_of_ledger(ledger, 1e-5) * 1.02
        value, wall, cpu = _time(lambda: max_steps(sigma * 1.01, q, 1e-5, budget, ledger=ledger), 1)
        print(f"| {label}: max_steps within +2% of the budget | {value} | {wall:.2f} | {cpu:.2f} | |", flush=True)


def _grouping_tradeoff() -> None:
    """The 10^4-run schedule at several ``max_groups``: epsilon and the CPU time of a first
    evaluation (no cache has seen the ledger)."""
    from dpoptim.accounting.ledger import MAX_DISTINCT_RUNS
    from dpoptim.accounting.pld import pld_epsilon

    print()
    print("| 10^4-run schedule, max_groups | epsilon | wall s | cpu s |")
    print("| --- | --- | --- | --- |")
    for limit in (16, 32, 64, 128, 256, 512):
        ledger = _fresh_ledger(schedule_ledger())
        value, wall, cpu = _time(lambda: pld_epsilon(ledger, 1e-5, max_groups=limit), 1)
        print(f"| {limit}{' (default)' if limit == MAX_DISTINCT_RUNS else ''} | {_show(value)} | {wall:.2f} | {cpu:.2f} |",
              flush=True)


def _show(value) -> str:
    if isinstance(value, str):
        return value
    return f"{value:.6g}" if math.isfinite(value) else "inf"


def near_zero_draws(count: int, seed: int) -> list:
    """``count`` random calibrations ``(target, delta, q, steps)`` where epsilon nears its
    zero: target 1e-4 to 1e-2, q 1e-6 to 1e-2 and delta 1e-5 to 0.1 (each log-uniform),
    and as many steps as put the expected number of uses of an example, q T, at 1 to
    1000 times delta. There epsilon falls to 0 at a finite sigma (where the chance that
    the example is used at all nears delta), and a small target lies just below it."""
    rng = random.Random(seed)
    draws = []
    for _ in range(count):
        target = 10 ** rng.uniform(-4, -2)
        q = 10 ** rng.uniform(-6, -2)
        delta = 10 ** rng.uniform(-5, -1)
        steps = max(1, round(10 ** rng.uniform(0, 3) * delta / q))
        draws.append((target, delta, q, steps))
    return draws


def _near_zero_survey(count: int, seed: int) -> None:
    """Times :func:`calibrate_noise` on :func:`near_zero_draws` (each draw new to the
    caches), counts its evaluations of the accountant, and checks every answer against
    the accountant: epsilon at most the target and within the band of 0.2% below it (or
    within 2e-4 of sigma above a jump, which the band column cannot tell apart: it shows
    the share below the target)."""
    print(f"| near-zero survey, seed {seed} | target | delta | q | steps | sigma | epsilon / target - 1 "
          "| evaluations | wall s | cpu s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    walls, evaluations, above, outside = [], 0, 0, 0
    for k, (target, delta, q, steps) in enumerate(near_zero_draws(count, seed)):
        with _counted_evaluations() as calls:
            sigma, wall, cpu = _time(lambda: calibrate_noise(target, delta, q, steps), 1)
        share = epsilon_of_ledger([(sigma, q, steps)], delta) / target - 1.0
        walls.append(wall)
        evaluations += len(calls)
        above += wall > 2.0
        outside += not -0.002 <= share <= 0.0
        print(f"| {k} | {target:.4g} | {delta:.3g} | {q:.3g} | {steps:,} | {_show(sigma)} | {share:+.3%} "
              f"| {len(calls)} | {wall:.2f} | {cpu:.2f} |", flush=True)
    print(f"\n{count} calls: {sum(walls):.1f} s in all, {evaluations} evaluations of the accountant, "
          f"median {statistics.median(walls):.2f} s, longest {max(walls):.2f} s, {above} above 2 s; "
          f"{outside} outside the band")


@contextlib.contextmanager
def _counted_evaluations():
    """The noise multipliers :func:`calibrate_noise` evaluates the accountant at while
    the block runs (a list that grows)."""
    searched, calls = calibrate_module.search_epsilon, []

    def counted(runs, delta, skip=0):
        calls.append(runs[0][0])
        return searched(runs, delta, skip)

    calibrate_module.search_epsilon = counted
    try:
        yield calls
    finally:
        calibrate_module.search_epsilon = searched


def schedule_draws(count: int, seed: int) -> list:
    """``count`` random schedules ``(runs, delta, lengths)``: 8 to 399 pairs whose sigma and
    q move geometrically from end to end (sigma 0.5 to 3.2, q 1e-5 to 0.1, each end
    log-uniform), 1, 3 or 100 steps a pair, delta 1e-12 to 1e-3; ``lengths``: three
    prefix lengths, each short of the whole schedule."""
    rng = random.Random(seed)
    draws = []
    for _ in range(count):
        pairs = rng.randrange(8, 400)
        sigmas = [10 ** rng.uniform(-0.3, 0.5) for _ in range(2)]
        rates = [10 ** rng.uniform(-5, -1) for _ in range(2)]
        per_pair = rng.choice((1, 1, 3, 100))
        delta = 10 ** rng.uniform(-12, -3)
        runs = [(_between(sigmas, k / (pairs - 1)), _between(rates, k / (pairs - 1)), per_pair) for k in range(pairs)]
        draws.append((runs, delta, tuple(rng.randrange(2, pairs) for _ in range(3))))
    return draws


def _between(ends, share: float) -> float:
    """The point ``share`` of the way from ``ends[0]`` to ``ends[1]`` on a log scale."""
    return ends[0] * (ends[1] / ends[0]) ** share


def _append_survey(count: int, seed: int) -> None:
    """Epsilon before and after one more pair on :func:`schedule_draws`: composing more
    steps never lowers the exact epsilon, but the accountant's choices (its grid, the
    split of a rare loss, and past 64 distinct pairs its groups) may change with the pair
    appended (``docs/accounting.md``, "Monotone in σ across groupings, and in the steps
    of a schedule"). Counts the appends that lowered it and the largest share."""
    print(f"| append survey, seed {seed} | pairs | steps a pair | delta | epsilon | one pair more | change |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    lowered, worst, total = 0, 0.0, 0
    for k, (runs, delta, lengths) in enumerate(schedule_draws(count, seed)):
        for length in lengths:
            before = epsilon_of_ledger(runs[:length], delta)
            after = epsilon_of_ledger(runs[:length + 1], delta)
            change = after / before - 1.0 if before > 0.0 else (0.0 if after == 0.0 else math.inf)
            total += 1
            lowered += change < 0.0
            worst = min(worst, change)
            print(f"| {k} | {length} | {runs[0][2]} | {delta:.3g} | {_show(before)} | {_show(after)} "
                  f"| {change:+.2e} |", flush=True)
    print(f"\n{total} appends: {lowered} lowered epsilon" + (f", by {-worst:.2e} of it at most" if lowered else ""))


def audit_draws(count: int, seed: int) -> list:
    """``count`` random ledgers ``(runs, delta)`` for :func:`_audit_survey`, each of one of
    three kinds: 1 to 11 runs (sigma 0.05 to 10; q at 1 for a tenth of them, 0.89 to 1
    for a sixth, else 1e-6 to 1; 1 to 10^4 steps; delta 1e-12 to 0.1); 2 to 6 runs where
    tiny sigma meets tiny q (sigma 0.02 to 0.2 for two in five, else 0.3 to 10; q 1e-6 to
    1e-3 for three in five, else 1e-3 to 1; delta 1e-9 to 0.1); or one run anywhere in
    the stated range (sigma 0.001 to 100, q 1e-6 to 1, 1 to 10^8 steps)."""
    rng = random.Random(seed)

    def between(low: float, high: float) -> float:  # log-uniform
        return 10 ** rng.uniform(low, high)

    draws = []
    for _ in range(count):
        kind = rng.choice(("runs", "tiny", "one"))
        if kind == "runs":
            runs = [(between(-1.3, 1), rng.choice((1.0, between(-0.05, 0), between(-6, 0), between(-6, 0),
                                                    between(-6, 0), between(-6, 0))), round(between(0, 4)))
                    for _ in range(rng.randrange(1, 12))]
            delta = between(-12, -1)
        elif kind == "tiny":
            runs = [(between(-1.7, -0.7) if rng.random() < 0.4 else between(-0.5, 1),
                     between(-6, -3) if rng.random() < 0.6 else between(-3, 0), round(between(0, 4)))
                    for _ in range(rng.randrange(2, 7))]
            delta = between(-9, -1)
        else:
            runs = [(between(-3, 2), 1.0 if rng.random() < 0.1 else between(-6, 0), round(between(0, 8)))]
            delta = between(-12, -1)
        draws.append((runs, delta))
    return draws


def _audit_survey(count: int, seed: int) -> None:
    """The reported epsilon against the rigorous lower bound on :func:`audit_draws`: the
    exact epsilon lies between them, so a lower bound above the reported value means one
    of the two is wrong (a leak, where it is the reported one). Counts those and the
    brackets wider than 1%."""
    print(f"| audit, seed {seed} | runs | delta | epsilon | lower bound | gap | wall s | lower bound s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    crossed, wide = [], 0
    for k, (runs, delta) in enumerate(audit_draws(count, seed)):
        start = time.perf_counter()
        upper = epsilon_of_ledger(runs, delta)
        middle = time.perf_counter()
        lower = pld_epsilon_lower_bound(runs, delta)
        end = time.perf_counter()
        gap = upper / lower - 1.0 if lower > 0.0 else (0.0 if upper == 0.0 else math.inf)
        if lower > upper * (1.0 + 1e-9):
            crossed.append(k)
        wide += gap > 0.01
        print(f"| {k} | {len(runs)} | {delta:.3g} | {_show(upper)} | {_show(lower)} | {gap:+.2e} "
              f"| {middle - start:.2f} | {end - middle:.2f} |", flush=True)
    print(f"\n{count} ledger{'s' if count != 1 else ''}: {len(crossed)} with the lower bound above epsilon"
          + (f" (draws {', '.join(map(str, crossed))})" if crossed else "") + f", {wide} bracketed wider than 1%")


def _log_uniform(rng: random.Random, low: float, high: float) -> float:
    """A draw of ``rng`` log-uniform between ``low`` and ``high``."""
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def sweep_points(count: int, seed: int) -> list:
    """``count`` random single runs ``(sigma, q, steps, delta)`` anywhere in the stated range
    (each log-uniform: sigma 0.001 to 30, q 1e-6 to 1, 1 to 10^8 steps, delta 1e-12 to 0.1)."""
    rng = random.Random(seed)
    return [(_log_uniform(rng, 1e-3, 30.0), _log_uniform(rng, 1e-6, 1.0), int(_log_uniform(rng, 1.0, 1e8)),
             _log_uniform(rng, 1e-12, 0.1)) for _ in range(count)]


def long_run_points(count: int, seed: int) -> list:
    """``count`` random single runs ``(sigma, q, delta)`` of 10^8 steps anywhere in the stated
    range (each log-uniform: sigma 0.001 to 30, q 1e-6 to 1, delta 1e-12 to 0.1)."""
    rng = random.Random(seed)
    return [(_log_uniform(rng, 1e-3, 30.0), _log_uniform(rng, 1e-6, 1.0), _log_uniform(rng, 1e-12, 0.1))
            for _ in range(count)]


def _long_run_survey(count: int, seed: int) -> None:
    """Times ``privacy_spent()``'s accountant on :func:`long_run_points` (each sigma new to
    the caches) against the 0.5 s target for 10^8 steps, and counts the runs above it."""
    print(f"| 10^8 steps, seed {seed} | sigma | q | delta | epsilon | wall s | cpu s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    walls = []
    for k, (sigma, q, delta) in enumerate(long_run_points(count, seed)):
        value, wall, cpu = _time(lambda: epsilon_of_ledger([(sigma, q, 10**8)], delta), 1)
        walls.append(wall)
        print(f"| {k} | {sigma:.4g} | {q:.3g} | {delta:.2g} | {_show(value)} | {wall:.2f} | {cpu:.2f} |", flush=True)
    print(f"\n{count} run{'s' if count != 1 else ''}: {sum(walls):.1f} s in all, "
          f"{sum(wall > 0.5 for wall in walls)} above 0.5 s, longest {max(walls):.2f} s")


#: The factors :func:`_sweep_survey` moves each axis by, from the point itself.
SWEEP_FACTORS = (1.0, 1.002, 1.005, 1.01, 1.02)


def _swept(point: tuple, axis: int, factor: float) -> tuple:
    """``point`` with its ``axis`` (0 sigma, 1 q, 2 steps, 3 delta) moved up by ``factor``:
    q at most 1 and delta at most 0.999; a count of steps by at least one step per 0.2%."""
    moved = list(point)
    if axis == 2:
        moved[2] = max(int(point[2] * factor), point[2] + round((factor - 1.0) / 0.002))
    else:
        moved[axis] = min(point[axis] * factor, 1.0 if axis == 1 else 0.999)
    return tuple(moved)


def _sweep_survey(count: int, seed: int) -> None:
    """Epsilon of one run on :func:`sweep_points`, each axis moved up by :data:`SWEEP_FACTORS`:
    it must fall with sigma and delta and grow with q and the steps. Counts the dips."""
    print(f"| sweeps, seed {seed} | sigma | q | steps | delta | epsilon | dips | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    dips = 0
    for k, point in enumerate(sweep_points(count, seed)):
        start, found = time.perf_counter(), []
        for axis, name in enumerate(("sigma", "q", "steps", "delta")):
            moved = [_swept(point, axis, factor) for factor in SWEEP_FACTORS]
            values = [epsilon_of_ledger([run[:3]], run[3]) for run in moved]
            falling = axis in (0, 3)
            found += [f"{name} x{SWEEP_FACTORS[i + 1]:g}" for i, (a, b) in enumerate(zip(values, values[1:]))
                      if not ((b <= a) if falling else (b >= a))]
        dips += len(found)
        sigma, q, steps, delta = point
        print(f"| {k} | {sigma:.4g} | {q:.4g} | {steps:,} | {delta:.3g} | {_show(epsilon_of_ledger([point[:3]], delta))} "
              f"| {', '.join(found) or 0} | {time.perf_counter() - start:.2f} |", flush=True)
    print(f"\n{count} point{'s' if count != 1 else ''}, {4 * (len(SWEEP_FACTORS) - 1) * count} neighbours: "
          f"{dips} against the trend")


def _budget_stop_rows(budget: float) -> None:
    """A noise schedule that changes at every step (sigma from 1.5 down by 10^-4 a step,
    q 0.01, delta 1e-5), run with ``DPSGD`` until its budget stop refuses a step: as the
    stop asks by default (spans of steps at a slightly worse setting) and as it would if
    it evaluated the ledger at every step (``SCHEDULE_SERVED`` out of reach). Both must
    stop at the same step, the first whose ledger the accountant puts above the budget;
    the loop's wall time is nearly all the stop's accounting (a model of two weights)."""
    import warnings

    import torch

    import dpoptim
    from dpoptim import spending

    print(f"| budget stop, budget {budget:g} | how it asks | steps taken | epsilon there | with the refused step "
          "| loop wall s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for how, served in (("spans at a worse setting", spending.SCHEDULE_SERVED), ("every step", 2**62)):
        model = torch.nn.Linear(1, 1, bias=False)
        opt = dpoptim.DPSGD(model.parameters(), lr=0.0, noise_multiplier=1.5, max_grad_norm=1.0,
                            expected_batch_size=1, sample_rate=0.01, max_epsilon=budget)
        default, spending.SCHEDULE_SERVED = spending.SCHEDULE_SERVED, served
        taken, start = 0, time.perf_counter()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", dpoptim.PrivacyWarning)  # (no data: every batch is empty)
                while True:
                    opt.noise_multiplier = 1.5 - 1e-4 * taken
                    opt.step()
                    taken += 1
        except dpoptim.PrivacyBudgetExceeded:
            wall = time.perf_counter() - start
        finally:
            spending.SCHEDULE_SERVED = default
        runs = list(opt.ledger)
        at, beyond = epsilon_of_ledger(runs, 1e-5), epsilon_of_ledger([*runs, (1.5 - 1e-4 * taken, 0.01, 1)], 1e-5)
        print(f"| {budget:g} | {how} | {taken:,} | {at:.6f} | {beyond:.6f} | {wall:.1f} |", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=1, help="repetitions per timed row (median shown)")
    parser.add_argument("--bracket", action="store_true", help="add rigorous lower bounds (slow)")
    parser.add_argument("--peers", action="store_true", help="add dp_accounting and Opacus PRV if installed")
    parser.add_argument("--only", default="", help="run only rows whose label contains this text")
    parser.add_argument("--groups", action="store_true", help="only: the schedule at several group limits")
    parser.add_argument("--survey", type=int, default=0, metavar="N",
                        help="only: N random calibrations near epsilon's zero (first calls, checked)")
    parser.add_argument("--appends", type=int, default=0, metavar="N",
                        help="only: one pair more on N random schedules (3 appends each)")
    parser.add_argument("--audit", type=int, default=0, metavar="N",
                        help="only: epsilon against its rigorous lower bound on N random ledgers")
    parser.add_argument("--long", type=int, default=0, metavar="N",
                        help="only: N random single runs of 10^8 steps, timed against 0.5 s")
    parser.add_argument("--sweeps", type=int, default=0, metavar="N",
                        help="only: fine monotonicity sweeps of N random single runs")
    parser.add_argument("--budget-stop", type=float, default=0.0, metavar="EPS",
                        help="only: a schedule run to a budget of EPS with the optimizer, two ways")
    parser.add_argument("--seed", type=int, default=0, help="the surveys' draws")
    args = parser.parse_args(argv)
    # Warm up as a training run would have by then: imports, FFT plans, the order layout,
    # and the accounting thread with its memory (two pairs, so both directions compose).
    epsilon_of_ledger([(1.0, 0.01, 1000)], 1e-5)
    epsilon_of_ledger([(1.0, 0.01, 1000), (1.2, 0.02, 1000)], 1e-5)
    if args.groups:
        _grouping_tradeoff()
        return 0
    surveys = ((args.survey, _near_zero_survey), (args.appends, _append_survey), (args.audit, _audit_survey),
               (args.long, _long_run_survey), (args.sweeps, _sweep_survey))
    for count, survey in surveys:  # each of N random draws of the seed's
        if count:
            survey(count, args.seed)
            return 0
    if args.budget_stop:
        _budget_stop_rows(args.budget_stop)
        return 0

    print("| case | epsilon | wall s | cpu s | target s | lower bound | gap |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for label, ledger, delta, target in _ledgers():
        if args.only not in label:
            continue
        def fresh_ledger():  # a new one for every repetition: no cache has seen it
            return _fresh_ledger(ledger)

        fresh = fresh_ledger()
        value, wall, cpu = _time(lambda: epsilon_of_ledger(fresh_ledger(), delta), args.repeat)
        goal = f"{target:g}" if target else ""
        lower = gap = ""
        if args.bracket:
            bound = _lower_bound(fresh, delta)
            lower = _show(bound)
            gap = (f"{value / bound - 1:+.3%}" if bound > 0 and math.isfinite(value)
                   else ("exact" if value == bound else ""))
        print(f"| {label} | {_show(value)} | {wall:.2f} | {cpu:.2f} | {goal} | {lower} | {gap} |", flush=True)
        if args.peers:
            for name, (peer, seconds) in _peers(ledger, delta).items():
                print(f"| - {name} | {_show(peer)} | | {seconds:.2f} | | | |", flush=True)

    if not args.only or args.only in "growing max_steps":
        _growing_and_max_steps(args.repeat)

    print()
    print("| calibrate_noise (q 0.01, 1000 steps, delta 1e-5) | sigma | epsilon | wall s | cpu s | target s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for target in (1e-4, 1e-2, 1.0, 1e2, 1e4, 1e-6, 1e6):
        if args.only and args.only not in "calibrate":
            continue
        sigma, wall, cpu = _time(lambda: calibrate_noise(_fresh(target), 1e-5, 0.01, 1000), args.repeat)
        spent = epsilon_of_ledger([(sigma, 0.01, 1000)], 1e-5)
        goal = "2" if 1e-4 <= target <= 1e4 else ""
        print(f"| target {target:g} | {_show(sigma)} | {_show(spent)} | {wall:.2f} | {cpu:.2f} | {goal} |", flush=True)
    for target in (1e-4, 1e-3, 1e-2, 1.0, 1e2, 1e4):  # tiny q: the slowest PLD evaluations
        if args.only and args.only not in "calibrate":
            continue
        sigma, wall, cpu = _time(lambda: calibrate_noise(_fresh(target), 1e-5, 1e-6, 1000), args.repeat)
        spent = epsilon_of_ledger([(sigma, 1e-6, 1000)], 1e-5)
        print(f"| target {target:g}, q 1e-6 | {_show(sigma)} | {_show(spent)} | {wall:.2f} | {cpu:.2f} | 2 |", flush=True)
    for target in (1e-2, 3e-2, 1e-1, 1.0):  # one rare loss decides: the split, in the model too
        if args.only and args.only not in "calibrate":
            continue
        sigma, wall, cpu = _time(lambda: calibrate_noise(_fresh(target), 1e-12, 1e-6, 10**6), args.repeat)
        spent = epsilon_of_ledger([(sigma, 1e-6, 10**6)], 1e-12)
        print(f"| target {target:g}, q 1e-6, 10^6 steps, delta 1e-12 | {_show(sigma)} | {_show(spent)} | {wall:.2f} "
              f"| {cpu:.2f} | 2 |", flush=True)
    for target, delta, q, steps in ((1.273e-4, 1.19e-9, 2e-5, 21_417_213),  # large sigma: the CLT starts
                                    (1.602e-4, 1.39e-8, 8.13e-5, 88_936_800),
                                    (1e-4, 1e-5, 1e-6, 30),  # tiny q, few steps: addition settled coarse
                                    (8.857e-4, 0.0191, 8.9027e-6, 3399),  # near where epsilon reaches 0
                                    (4.1624e-4, 2.5064e-3, 2.0318e-6, 1532),  # ... stepped from its first point
                                    (2.7272e-4, 0.040257, 4.6256e-6, 6_168_826),  # ... with wide tails
                                    (2.96, 1.6e-12, 2e-5, 83_000_000)):  # a rare loss over 10^8 steps: two scales
        if args.only and args.only not in "calibrate":
            continue
        sigma, wall, cpu = _time(lambda: calibrate_noise(_fresh(target), delta, q, steps), args.repeat)
        spent = epsilon_of_ledger([(sigma, q, steps)], delta)
        print(f"| target {target:g}, q {q:g}, {steps:,} steps, delta {delta:g} | {_show(sigma)} | {_show(spent)} "
              f"| {wall:.2f} | {cpu:.2f} | 2 |", flush=True)
    sigma, wall, cpu = _time(lambda: calibrate_noise(1.0, 1e-5, 1e-9, 1000), args.repeat)
    print(f"| target 1, q 1e-9 (noiseless meets it) | {_show(sigma)} | 0 | {wall:.2f} | {cpu:.2f} | 2 |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
