"""The two directions of a PLD composed side by side on a background thread."""

import multiprocessing
import threading
import time

import numpy as np
import pytest

from dpoptim import background
from dpoptim.accounting import epsilon, max_steps
from dpoptim.accounting import pld as pld_module
from dpoptim.accounting import rare

DELTA = 1e-5
LEDGERS = [
    [(1.1, 0.004, 10_000)],
    [(1.0 + 0.01 * i, 0.01, 100) for i in range(70)],  # grouped
    [(0.0, 1e-7, 30), (1.0, 0.01, 1000)],  # noiseless steps shift the add direction
]


def fresh(monkeypatch, cores):
    monkeypatch.setattr(pld_module, "_usable_cores", lambda: cores)
    pld_module._noted_pld_epsilon.cache_clear()
    pld_module._prefix_cache.clear()
    rare._split_epsilon.cache_clear()


def spied_threads(monkeypatch, module, name) -> list:
    """The names of the threads that run ``module.name`` from now on."""
    threads, function = [], getattr(module, name)

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return function(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return threads


def assert_same_side_by_side(monkeypatch, runs, delta, spied):
    """pld_epsilon on one core and on two is the same, and on two the function ``spied``
    of pld.py ran both on this thread and on the accounting thread."""
    fresh(monkeypatch, 1)
    alone = pld_module.pld_epsilon(runs, delta)
    fresh(monkeypatch, 2)
    threads = []
    function = getattr(pld_module, spied)

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return function(*args, **kwargs)

    monkeypatch.setattr(pld_module, spied, spy)
    assert pld_module.pld_epsilon(runs, delta) == alone
    assert any(name.startswith("dpoptim-accounting") for name in threads)  # it did run beside
    assert threading.current_thread().name in threads


@pytest.mark.parametrize("runs", LEDGERS, ids=["one run", "schedule", "noiseless first"])
def test_side_by_side_gives_the_same_epsilon_as_one_after_the_other(runs, monkeypatch):
    monkeypatch.setattr(pld_module, "_MIXTURE_APART_POINTS", 0)  # (mixture groups beside each other too)
    assert_same_side_by_side(monkeypatch, runs, DELTA, "_compose_direction")


def test_mixture_groups_on_a_small_grid_compose_one_direction_after_the_other(monkeypatch):
    # Mostly small arrays and Python: side by side each thread would wait for the
    # interpreter lock. Both directions run on this thread, and the value is the same.
    runs = LEDGERS[1]
    fresh(monkeypatch, 1)
    alone = pld_module.pld_epsilon(runs, DELTA)
    fresh(monkeypatch, 2)
    threads, compose = [], pld_module._compose_direction

    def spy(steps, direction, grid, *args, **kwargs):
        threads.append((threading.current_thread().name, direction, grid.n, kwargs.get("mixture") is not None))
        return compose(steps, direction, grid, *args, **kwargs)

    monkeypatch.setattr(pld_module, "_compose_direction", spy)
    assert pld_module.pld_epsilon(runs, DELTA) == alone
    assert {direction for _, direction, _, _ in threads} == {"remove", "add"}
    assert all(mixture and points <= pld_module._MIXTURE_APART_POINTS for _, _, points, mixture in threads)
    assert {name for name, _, _, _ in threads} == {threading.current_thread().name}


@pytest.mark.parametrize("larger, apart, composed", [
    ((0.95, False), True, ["remove"]),  # final on this grid, above addition's earlier answer: addition keeps it
    ((0.85, False), True, ["remove", "add"]),  # now below addition's earlier answer: addition may set the value
    ((0.95, True), True, ["remove", "add"]),  # rounding decides: refining may bring it below
    ((0.95, False), False, ["remove", "add"]),  # side by side: both, as before
])
def test_a_direction_below_the_others_earlier_answer_is_composed_only_where_it_may_set_epsilon(
        monkeypatch, larger, apart, composed):
    monkeypatch.setattr(pld_module, "_usable_cores", lambda: 2)
    composed_here, after = [], {"remove": 1.0, "add": 0.9}
    answers = {"remove": larger, "add": (0.8, False)}

    def answer(direction):
        composed_here.append(direction)
        return answers[direction]

    found = pld_module._first_answers(answer, not apart, None, after, 0.0)
    assert sorted(composed_here) == sorted(composed)
    assert not apart or composed_here[0] == "remove"  # one after the other: the larger one before first
    assert found == {"remove": larger, "add": answers["add"] if "add" in composed else (0.9, False)}


def test_the_add_directions_shift_counts_when_it_keeps_its_earlier_answer():
    # addition 0.9 + shift 0.1 lies above removal's 0.95: it may set the value, so it is composed
    composed_here = []

    def answer(direction):
        composed_here.append(direction)
        return {"remove": (0.95, False), "add": (0.8, False)}[direction]

    pld_module._first_answers(answer, False, None, {"remove": 1.0, "add": 0.9}, 0.1)
    assert composed_here == ["remove", "add"]


def test_a_later_mixture_grid_composes_the_smaller_direction_only_where_needed_with_the_same_epsilon(monkeypatch):
    # 126 pairs of 3 steps: mixture groups on a small grid, whose directions run one after
    # the other. The first grid composes both; on the grid after it (cut shorter),
    # removal's answer lies above addition's first one, which then stands.
    sigmas, rates = np.geomspace(0.6, 2.0, 126), np.geomspace(1.1e-3, 0.067, 126)
    runs = [(float(sigma), float(q), 3) for sigma, q in zip(sigmas, rates)]
    delta = 1.8e-11
    composed, compose = [], pld_module._compose_direction

    def spy(steps, direction, grid, *args, **kwargs):
        composed.append(direction)
        return compose(steps, direction, grid, *args, **kwargs)

    fresh(monkeypatch, 2)
    monkeypatch.setattr(pld_module, "_compose_direction", spy)
    found = pld_module.pld_epsilon(runs, delta)
    assert sorted(composed[:2]) == ["add", "remove"] and composed[2:] == ["remove"]
    fresh(monkeypatch, 2)
    first_answers = pld_module._first_answers
    monkeypatch.setattr(pld_module, "_first_answers",
                        lambda answer, together, kept, *ignored: first_answers(answer, together, kept))
    composed.clear()
    assert pld_module.pld_epsilon(runs, delta) == found  # composing both gives the same
    assert sorted(composed[2:]) == ["add", "remove"]


def test_both_directions_refined_side_by_side_give_the_same_epsilon(monkeypatch):
    # Large sigma over 2e7 steps on one grid (the stages of staged.py, which now answer
    # there, left out): rounding decides both directions on 2^20 points, and they nearly
    # tie, so both are refined at once (extended precision, 0.2 to 0.3 s each).
    monkeypatch.setattr(pld_module, "_staged", lambda *args: None)
    assert_same_side_by_side(monkeypatch, [(2648.43, 2e-5, 21_417_213)], 1.19e-9, "_rounding_bound")


def test_a_direction_refined_alone_spreads_its_groups_and_transforms_over_both_threads(monkeypatch):
    # 160 pairs (mixture groups) at q 5.4e-6 to 2.9e-5, delta 3.5e-12: removal is refined in
    # extended precision alone, its groups' rows mixed half on each thread and its anchors
    # transformed by two workers; the value is the one of one core. (300 pairs from sigma
    # 0.648 take the same path in 31 s instead of 13 s.)
    runs = [(0.75 + (3.67 - 0.75) * t / 159, 5.4e-6 * (2.9e-5 / 5.4e-6) ** (t / 159), 1000) for t in range(160)]
    monkeypatch.setattr(pld_module, "_GROUPED_SPLIT", False)  # (the mixture groups answer, not the split)
    fresh(monkeypatch, 1)
    alone = pld_module.pld_epsilon(runs, 3.5e-12)
    fresh(monkeypatch, 2)
    spreads, workers = [], []
    spread, count = pld_module._spread, pld_module._transform_workers

    def spied_spread(function, items):
        ran = set()  # the threads this one spread's rows ran on
        spreads.append(ran)

        def traced(item):
            ran.add("accounting" if threading.current_thread().name.startswith("dpoptim-accounting")
                    else threading.current_thread().name)
            return function(item)

        return spread(traced, items)

    monkeypatch.setattr(pld_module, "_spread", spied_spread)
    monkeypatch.setattr(pld_module, "_transform_workers", lambda: workers.append(count()) or workers[-1])
    assert pld_module.pld_epsilon(runs, 3.5e-12) == alone
    assert {threading.current_thread().name, "accounting"} in spreads  # one spread's rows on both threads
    assert 1 in workers and 2 in workers
    assert pld_module._sides_running[0] == 0


def test_the_stages_side_by_side_give_the_same_epsilon(monkeypatch):
    from dpoptim.accounting import staged

    runs, delta = [(4.4, 0.033, 10**7)], 1e-8
    fresh(monkeypatch, 1)
    alone = pld_module.pld_epsilon(runs, delta)
    fresh(monkeypatch, 2)
    threads = []
    answer = staged._staged_answer

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return answer(*args, **kwargs)

    monkeypatch.setattr(staged, "_staged_answer", spy)
    assert pld_module.pld_epsilon(runs, delta) == alone
    assert any(name.startswith("dpoptim-accounting") for name in threads)
    assert threading.current_thread().name in threads


@pytest.mark.parametrize("cores", [1, 2])
def test_a_direction_below_the_others_settled_stages_needs_no_extended_precision(monkeypatch, cores):
    # sigma 0.656, q 0.0162 over 10^8 steps, delta 2.5e-11: removal's second stage settles
    # 98,363 in double precision; addition's 88,145 does not, but lies below it. Addition
    # goes on to extended precision only where removal's answer is not known to be above.
    from dpoptim.accounting import staged

    runs, delta = [(0.6561, 0.0162, 10**8)], 2.5e-11
    stages, composed = [], staged._composed_epsilon

    def spy(parts, plan, *args):
        found = composed(parts, plan, *args)
        if found is not None:
            stages.append(np.dtype(plan.dtype).itemsize)
        return found

    fresh(monkeypatch, cores)
    monkeypatch.setattr(staged, "_composed_epsilon", spy)
    found = pld_module.pld_epsilon(runs, delta)
    extended = np.dtype(np.longdouble).itemsize
    # each direction once, in double precision (side by side, addition asks after removal
    # settled, or while it composes its double-precision stage: unless a loaded machine
    # held removal back in its first stage, when addition went on as before)
    assert sorted(stages) == [8, 8] if cores == 1 else sorted(stages) in ([8, 8], [8, 8, extended])
    fresh(monkeypatch, cores)
    monkeypatch.setattr(staged._Side, "below", lambda *args: False)
    stages.clear()
    assert pld_module.pld_epsilon(runs, delta) == found  # composed in extended precision too: the same
    assert sorted(stages) == [8, 8, extended]


def _asking_beside_the_other(shift: float, direction: str, epsilon: float) -> tuple:
    """``(finals, thread, answers)``: both directions composing their double-precision
    stage, and ``direction`` asking on a thread of its own whether ``epsilon`` lies below."""
    from dpoptim.accounting import staged

    finals, answers = staged._Finals(shift=shift), []
    finals.stage("remove", True)
    finals.stage("add", True)
    thread = threading.Thread(target=lambda: answers.append(finals.below(direction, epsilon)))
    thread.start()
    time.sleep(0.2)
    return finals, thread, answers


def test_a_direction_waits_for_the_others_double_precision_stage_and_for_nothing_else():
    from dpoptim.accounting import staged

    finals, waiter, asked = _asking_beside_the_other(0.5, "add", 2.0)
    assert waiter.is_alive()  # removal composes its double-precision stage: addition waits for it
    finals.done("remove", (2.5, True))
    waiter.join(10.0)
    assert asked == [True]  # 2.0 + 0.5 (the shift) is at most 2.5
    assert not finals.below("add", 2.1)
    # an unsettled answer, or one in extended precision, is not waited for nor taken
    other = staged._Finals(shift=0.0)
    other.stage("remove", False)
    assert not other.below("add", 0.0)
    other.done("remove", (9.0, False))
    assert not other.below("add", 0.0)
    # both unsettled at once: asking ends the other's wait, and neither waits for the other
    both, first, answers = _asking_beside_the_other(0.0, "remove", 1.0)
    answers.append(both.below("add", 1.0))
    first.join(10.0)
    assert not first.is_alive() and answers == [False, False]


def test_a_split_near_epsilons_zero_finds_its_bins_on_both_threads_with_the_same_epsilon(monkeypatch):
    # A calibration's point near epsilon's zero (q 2.6e-6 over 433 steps, delta 3.8e-4):
    # removal's split tries bins coarser than its spread asks for (rare._settled_coarser),
    # the finer of them found on the accounting thread beside the first, and bounds its
    # bulks' bins in two halves, one on each thread (pld._bin_bounds). Alone, both run
    # on one thread; the value is the same.
    runs, delta = [(0.3101554, 2.586212085889697e-06, 433)], 3.839131344258445e-4
    fresh(monkeypatch, 1)
    alone = pld_module.pld_epsilon(runs, delta)
    fresh(monkeypatch, 2)
    splits = spied_threads(monkeypatch, rare, "_split_on")
    bounds = spied_threads(monkeypatch, pld_module, "_bounds_of_bins")
    assert pld_module.pld_epsilon(runs, delta) == alone
    for threads in (splits, bounds):
        assert any(name.startswith("dpoptim-accounting") for name in threads)
        assert threading.current_thread().name in threads
    assert pld_module._sides_running[0] == 0


def test_a_direction_split_beside_the_grid_is_sized_anew_only_where_it_can_set_epsilon(monkeypatch):
    # sigma 0.41, q 2e-6 over 3*10^7 steps, delta 0.077: both directions are split
    # beside the grid's answers, side by side. Addition's split, on the grid sized for
    # the grid's answer, lies below removal's, which needs no other: it is not sized anew
    # for its own answer (a quarter of a second more, for a value that cannot be reported).
    # On one core, one direction after the other, the value is the same.
    runs, delta = [(0.4106191, 1.983911397450213e-06, 29658712)], 0.07662193397685944
    fresh(monkeypatch, 1)
    alone = pld_module.pld_epsilon(runs, delta)
    fresh(monkeypatch, 2)
    beside, calls, split, split_beside = [], [], rare.split_epsilon, pld_module._split_beside

    def spied_split(steps, direction, delta, guess, again=True, *args, **kwargs):
        calls.append((direction, again, bool(beside)))
        return split(steps, direction, delta, guess, again, *args, **kwargs)
    monkeypatch.setattr(rare, "split_epsilon", spied_split)

    def spied_beside(*args):
        beside.append(1)
        try:
            return split_beside(*args)
        finally:
            beside.pop()
    monkeypatch.setattr(pld_module, "_split_beside", spied_beside)
    assert pld_module.pld_epsilon(runs, delta) == alone
    assert {(direction, again) for direction, again, inside in calls if inside} == {("remove", False), ("add", False)}


def test_a_split_on_the_accounting_thread_offers_its_tails_to_the_waiting_caller(monkeypatch):
    # sigma 0.565, q 1.4e-5 over 10^8 steps, delta 8.9e-11: removal's split ends first, and
    # this thread waits while addition's split composes the bulks' profile on the
    # accounting thread. Meanwhile it reads the tails against the other steps' profile,
    # offered to it (dpoptim.background.offer). On one core, the same value. (The
    # accounting thread's profiles start once this thread waits, as they do on an idle
    # machine, so that what this thread takes does not depend on the machine's load.)
    runs, delta = [(0.5647371207289111, 1.436606182644857e-05, 10**8)], 8.927578148887865e-11
    fresh(monkeypatch, 1)
    alone = pld_module.pld_epsilon(runs, delta)
    fresh(monkeypatch, 2)
    seen, tail_terms, term_profile = [], rare._tail_terms, rare._term_profile

    def spied_tails(*args, **kwargs):
        seen.append((threading.current_thread().name, background.serving(pld_module._THREAD_PURPOSE)))
        return tail_terms(*args, **kwargs)

    def gated_profile(*args, **kwargs):
        deadline = time.monotonic() + 10
        while (pld_module._on_background_thread() and not background.waiting(pld_module._THREAD_PURPOSE)
               and time.monotonic() < deadline):
            time.sleep(0.001)
        return term_profile(*args, **kwargs)

    monkeypatch.setattr(rare, "_tail_terms", spied_tails)
    monkeypatch.setattr(rare, "_term_profile", gated_profile)  # (the tails are offered before it starts)
    assert pld_module.pld_epsilon(runs, delta) == alone
    assert (threading.current_thread().name, True) in seen  # offered, and run here
    assert pld_module._sides_running[0] == 0
    assert not background.serving(pld_module._THREAD_PURPOSE)


def test_a_refinement_composes_its_own_tilt_in_extended_precision_ahead_with_the_same_epsilon(monkeypatch):
    # sigma 0.103, q 2.2e-6 over 10^8 steps, delta 2.1e-12 (epsilon 11,226): removal is
    # refined at its own tilt, in float64 and then, where rounding decides that, in
    # extended precision. On an idle core the extended composition starts beside the
    # float64 one (on 2^20 points here, the threshold lowered to reach them) and is used
    # where the tries ask for it; on one core, one after the other, the same value.
    monkeypatch.setattr(pld_module, "_AHEAD_POINTS", 2**20)
    runs, delta = [(0.103, 2.2e-6, 10**8)], 2.1e-12
    fresh(monkeypatch, 1)
    alone = pld_module.pld_epsilon(runs, delta)
    fresh(monkeypatch, 2)
    ahead = spied_threads(monkeypatch, pld_module, "_attempted")
    found, composed_here, ahead_or = [], [], pld_module._ahead_or

    def spied_ahead_or(compose, known):
        def counted(on, dtype):  # what the tries compose themselves
            composed_here.append((on.tilt, np.dtype(dtype).str))
            return compose(on, dtype)
        answer = ahead_or(counted, known)

        def spy(on, dtype):
            key = (on.tilt, np.dtype(dtype).str)
            if key in known:
                found.append(key)
            return answer(on, dtype)
        return spy

    monkeypatch.setattr(pld_module, "_ahead_or", spied_ahead_or)
    assert pld_module.pld_epsilon(runs, delta) == alone
    assert ahead and all(name.startswith("dpoptim-accounting") for name in ahead)
    assert found and not set(found) & set(composed_here)  # asked for, and not composed again
    assert pld_module._sides_running[0] == 0


@pytest.mark.parametrize("cores", [1, 2])
def test_the_stages_plan_addition_only_where_removal_has_a_plan(monkeypatch, cores):
    # Both directions plan on their own sides; where removal has no plan, addition's
    # stages are never composed (and, one after the other, never planned): no answer.
    from dpoptim.accounting import staged

    fresh(monkeypatch, cores)
    planned, answered, plan = [], [], staged._plan
    monkeypatch.setattr(staged, "_plan", lambda sigma, q, count, direction, *args: planned.append(direction) or (
        None if direction == pld_module._REMOVE else plan(sigma, q, count, direction, *args)))
    monkeypatch.setattr(staged, "_staged_answer", lambda *args: answered.append(args) or (1.0, True))
    deltas = {pld_module._REMOVE: 1e-8, pld_module._ADD: 1e-8}
    assert staged._both_directions(4.4, 0.033, 10**7, deltas, 1.0, 0.0) is None
    assert answered == []
    if cores == 1:
        assert planned == ["remove"]
    else:  # (addition may have planned before it learnt of removal's)
        assert "remove" in planned and set(planned) <= {"remove", "add"}
    assert pld_module._sides_running[0] == 0


def test_an_error_in_removals_plan_reaches_the_caller_and_frees_the_accounting_thread(monkeypatch):
    from dpoptim.accounting import staged

    fresh(monkeypatch, 2)
    plan = staged._plan

    def failing(sigma, q, count, direction, *args):
        if direction == pld_module._REMOVE:
            raise FloatingPointError("removal's plan failed")
        return plan(sigma, q, count, direction, *args)

    monkeypatch.setattr(staged, "_plan", failing)
    deltas = {pld_module._REMOVE: 1e-8, pld_module._ADD: 1e-8}
    with pytest.raises(FloatingPointError, match="removal's plan failed"):
        staged._both_directions(4.4, 0.033, 10**7, deltas, 1.0, 0.0)
    # addition learns that removal ended without a plan and stops: the thread is free
    assert background.executor(pld_module._THREAD_PURPOSE).submit(lambda: "free").result(timeout=30) == "free"
    assert pld_module._sides_running[0] == 0


def on_the_accounting_thread(function):
    """``function()`` run on the accounting thread while this caller waits for it."""
    purpose = pld_module._THREAD_PURPOSE
    return background.wait(purpose, background.executor(purpose).submit(function))


def test_a_caller_running_offered_work_counts_as_the_accounting_thread(monkeypatch):
    # Work the accounting thread offers its waiting caller must not queue more work
    # behind that thread, which waits for it: on the caller it counts as that thread.
    fresh(monkeypatch, 2)
    seen = []

    def offered():
        seen.append((threading.current_thread().name, pld_module._on_accounting_thread(), pld_module._core_idle(),
                     pld_module._sides_running[0]))
        return pld_module._both_directions(lambda direction: threading.current_thread().name)

    def until_taken():
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            time.sleep(0.001)

    def work():
        while not background.waiting(pld_module._THREAD_PURPOSE):
            time.sleep(0.001)
        return pld_module._beside(until_taken, offered)

    pld_module._count_sides(1)  # (as while one direction runs there)
    try:
        _, directions = on_the_accounting_thread(work)
    finally:
        pld_module._count_sides(-1)
    here = threading.current_thread().name
    assert seen == [(here, True, False, 2)]  # taken by this caller, as a second side
    assert directions == {"remove": here, "add": here}  # both directions here, one after the other
    assert pld_module._sides_running[0] == 0


def test_work_beside_that_is_not_needed_is_not_computed(monkeypatch):
    # _beside's second is needed only where the first's answer asks for it. One after the
    # other it is then never run; offered from the accounting thread, it is withdrawn
    # before anyone takes it; started on the accounting thread, its answer is dropped.
    fresh(monkeypatch, 2)
    ran = []

    def second():
        ran.append(threading.current_thread().name)
        return 2

    def needed(first):
        return first is not None

    here = threading.current_thread().name
    future = background.executor(pld_module._THREAD_PURPOSE).submit(  # no caller waits: offered, then withdrawn
        pld_module._beside, lambda: None, second, needed)
    assert future.result(timeout=60) == (None, None)
    assert on_the_accounting_thread(lambda: "still serving") == "still serving"  # the withdrawn offer is gone
    assert ran == []
    assert pld_module._beside(lambda: None, second, needed) == (None, None)  # begun on the accounting thread
    assert len(ran) == 1 and ran[0].startswith("dpoptim-accounting")
    monkeypatch.setattr(pld_module, "_core_idle", lambda: False)  # one after the other
    assert pld_module._beside(lambda: None, second, needed) == (None, None)
    assert pld_module._beside(lambda: 1, second, needed) == (1, 2)
    assert ran[1:] == [here]  # only where it was needed
    assert pld_module._sides_running[0] == 0


def test_max_steps_is_the_same_side_by_side(monkeypatch):
    spent = [(1.0 + 0.02 * i, 0.01, 20) for i in range(70)]
    fresh(monkeypatch, 1)
    alone = max_steps(1.5, 0.02, DELTA, 3.0, ledger=spent)
    fresh(monkeypatch, 2)
    assert max_steps(1.5, 0.02, DELTA, 3.0, ledger=spent) == alone


def test_an_error_in_the_background_direction_reaches_the_caller(monkeypatch):
    fresh(monkeypatch, 2)

    def failing(direction):
        if direction == pld_module._ADD:
            raise FloatingPointError("add failed")
        return 1.0

    with pytest.raises(FloatingPointError, match="add failed"):
        pld_module._both_directions(failing)
    assert pld_module._sides_running[0] == 0  # both sides counted out: transforms use every core again


def _child(queue):
    queue.put(epsilon(1.3, 0.01, 500, DELTA))


def _forked(target, timeout: float):
    """``(hung, queue)``: run ``target(queue)`` in a forked child, killed if still running
    after ``timeout`` seconds."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=target, args=(queue,))
    child.start()
    child.join(timeout=timeout)
    hung = child.is_alive()
    if hung:
        child.kill()
    return hung, queue


def test_a_forked_process_starts_its_own_accounting_thread():
    # The parent's thread does not exist in a forked child: the child must not wait on it.
    epsilon(1.2, 0.01, 500, DELTA)  # the parent's thread is running now
    hung, queue = _forked(_child, 60)
    assert not hung, "the forked child hung on its parent's accounting thread"
    assert queue.get(timeout=5) == epsilon(1.3, 0.01, 500, DELTA)


def _child_fresh(queue):
    queue.put(epsilon(1.37, 0.011, 700, DELTA))  # new to the caches the child inherits


def test_a_forked_child_does_not_inherit_accounting_locks_another_thread_held():
    # Another thread of the parent holds the caches' lock and counts two sides running
    # when the process forks: the child, which has no such thread, must not wait on them.
    held, release = threading.Event(), threading.Event()

    def hold():
        with pld_module._prefix_lock, pld_module._sides_lock:
            pld_module._sides_running[0] += 2
            held.set()
            release.wait(60)
            pld_module._sides_running[0] -= 2

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(10)
        hung, queue = _forked(_child_fresh, 30)
    finally:
        release.set()
        holder.join()
    assert not hung, "the forked child waited on a lock its parent's other thread held"
    assert queue.get(timeout=5) == epsilon(1.37, 0.011, 700, DELTA)
