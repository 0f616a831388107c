"""A caller waiting for a background thread runs the work that thread offers it."""

import concurrent.futures
import threading
import time

import pytest

from dpoptim import background

PURPOSE = "test-offers"


def on_the_thread(function):
    """``function()`` run on the test's background thread, waited for by this caller."""
    return background.wait(PURPOSE, background.executor(PURPOSE).submit(function))


def until(condition, what: str) -> None:
    """Wait (at most 10 s) for ``condition()``."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.001)


def test_the_waiting_caller_runs_what_the_thread_offers():
    here = threading.current_thread().name
    seen = []

    def offered():
        seen.append((threading.current_thread().name, background.serving(PURPOSE), background.serving("other")))
        return 6

    def work():
        until(lambda: background.waiting(PURPOSE), "the caller never waited")
        later = background.offer(PURPOSE, offered)
        until(lambda: seen, "the caller never took the offer")
        return 7 * later.result(), threading.current_thread().name

    value, thread = on_the_thread(work)
    assert value == 42
    assert thread.startswith("dpoptim-" + PURPOSE)
    assert seen == [(here, True, False)]  # on this thread, serving that purpose only
    assert not background.serving(PURPOSE)  # and no longer once it is done
    assert not background.waiting(PURPOSE)


def test_what_no_caller_takes_the_thread_computes_itself():
    def work():
        later = background.offer(PURPOSE, lambda: threading.current_thread().name)
        return later.result()

    # the caller blocks on the future without waiting through background.wait: it takes nothing
    name = background.executor(PURPOSE).submit(work).result(timeout=60)
    assert name.startswith("dpoptim-" + PURPOSE)
    assert not background.waiting(PURPOSE)


def test_an_error_in_offered_work_reaches_the_thread_and_then_the_caller():
    def failing():
        raise FloatingPointError("offered and failed")

    def work():
        until(lambda: background.waiting(PURPOSE), "the caller never waited")
        return background.offer(PURPOSE, failing).result()

    with pytest.raises(FloatingPointError, match="offered and failed"):
        on_the_thread(work)
    assert not background.serving(PURPOSE)
    assert on_the_thread(lambda: 3) == 3  # the thread still serves


def test_a_withdrawn_offer_is_run_by_no_one():
    ran = []

    def work():
        offered = background.offer(PURPOSE, lambda: ran.append(1))
        offered.withdraw()
        return "done"

    assert background.executor(PURPOSE).submit(work).result(timeout=60) == "done"
    assert on_the_thread(lambda: "still serving") == "still serving"  # the withdrawn offer is not taken
    assert ran == []


def test_a_done_future_is_returned_without_waiting():
    future = concurrent.futures.Future()
    future.set_result(5)
    assert background.wait(PURPOSE, future) == 5


def test_an_offer_made_before_the_caller_waits_is_taken_once_it_does():
    # The thread offers, then keeps busy until the caller takes it: a caller that starts
    # waiting later still finds what was offered.
    started, seen = threading.Event(), []

    def work():
        later = background.offer(PURPOSE, lambda: seen.append(threading.current_thread().name) or 2)
        started.set()
        until(lambda: seen, "the caller never took the offer")
        return later.result()

    future = background.executor(PURPOSE).submit(work)
    started.wait(10)
    assert background.wait(PURPOSE, future) == 2
    assert seen == [threading.current_thread().name]


def test_two_callers_waiting_at_once_run_every_offer_once():
    # Jobs of two callers queue on the one thread; an offer may go to either caller, or
    # stay with the thread. Every offer runs once and no caller hangs.
    ran, errors = [], []

    def work_of(name, k):
        offers = [background.offer(PURPOSE, lambda j=j: ran.append((name, k, j)) or j) for j in range(3)]
        return [offered.result() for offered in offers]

    def caller_collecting(name):
        try:
            for k in range(100):
                assert on_the_thread(lambda k=k: work_of(name, k)) == [0, 1, 2]
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=caller_collecting, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert not any(thread.is_alive() for thread in threads), "a caller hung"
    assert not errors
    assert sorted(ran) == [(name, k, j) for name in "ab" for k in range(100) for j in range(3)]


def test_an_offer_after_an_interrupted_caller_left_is_computed_by_the_thread(monkeypatch):
    # The caller is interrupted (KeyboardInterrupt) while it waits, and leaves; what the
    # thread offers from then on no caller takes, and the thread computes it itself
    # rather than wait for it.
    left, ran = threading.Event(), []

    class Interrupted(type(background._OFFERED)):
        def wait(self, *args, **kwargs):
            raise KeyboardInterrupt

    monkeypatch.setattr(background, "_OFFERED", Interrupted())

    def work():
        left.wait(10)
        return background.offer(PURPOSE, lambda: ran.append(threading.current_thread().name) or 4).result()

    future = background.executor(PURPOSE).submit(work)
    with pytest.raises(KeyboardInterrupt):
        background.wait(PURPOSE, future)
    assert not background.waiting(PURPOSE)
    left.set()
    assert future.result(timeout=60) == 4
    assert len(ran) == 1 and ran[0].startswith("dpoptim-" + PURPOSE)
