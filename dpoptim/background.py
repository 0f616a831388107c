"""One background thread per purpose and process, started on first use.

Two jobs run on a thread beside the caller's: the noise of the next step, drawn ahead
during the forward and backward passes (:mod:`dpoptim.noise`), and one of the two
directions of a privacy loss distribution, composed while the caller composes the other
(:mod:`dpoptim.accounting.pld`). Each purpose has its own single thread, so neither
queues behind the other.

A process forked from one that had started a thread inherits the executor object but not
its thread (and maybe a lock held by a thread that does not exist there): executors are
kept per process id, and a forked child drops its parent's.

A caller that waits for its thread (:func:`wait`) lends itself meanwhile: the thread may
offer it work (:func:`offer`), so that the two cores share what the thread alone would
compute while the caller idles; what no caller takes, the thread does itself. While a
caller runs such work it counts as that thread (:func:`serving`): it must not queue work
behind the thread that waits for it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import threading

__all__ = ["executor", "wait", "offer", "Offer", "waiting", "serving"]

_EXECUTORS: dict = {}  # (process id, purpose) -> its one thread, started on first use
_LOCK = threading.Lock()
_OFFERED = threading.Condition()  # guards the two below; notified on each offer and each end of a wait
_OFFERS: dict = {}  # purpose -> a deque of the Offers no thread has taken yet
_WAITERS: dict = {}  # purpose -> how many callers wait for its thread now
_SERVING = threading.local()  # .purposes: those whose offered work this thread runs now


def _after_fork_in_child() -> None:
    global _LOCK, _OFFERED
    _LOCK, _OFFERED = threading.Lock(), threading.Condition()
    _EXECUTORS.clear()
    _OFFERS.clear()
    _WAITERS.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def executor(purpose: str) -> concurrent.futures.ThreadPoolExecutor:
    """The single background thread of ``purpose`` in this process."""
    with _LOCK:
        key = (os.getpid(), purpose)
        if key not in _EXECUTORS:
            for stale in [k for k in _EXECUTORS if k[0] != key[0]]:
                del _EXECUTORS[stale]
            _EXECUTORS[key] = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"dpoptim-{purpose}")
        return _EXECUTORS[key]


class Offer:
    """``function()``, offered by ``purpose``'s thread to the callers waiting for it
    (:func:`offer`): run once, by whichever thread takes it first."""

    def __init__(self, purpose: str, function):
        self.purpose, self._function = purpose, function
        self._taken = threading.Lock()
        self._done: concurrent.futures.Future = concurrent.futures.Future()

    def result(self):
        """The function's value: computed here where no caller has taken it, else once the
        caller that did is done (its error, if any, raised here)."""
        self._unlist()
        self._run(serving=False)
        return self._done.result()

    def withdraw(self) -> None:
        """Take the offer back, where the thread needs its value no more: no caller takes
        it from now on, and one that has is waited for."""
        self._unlist()
        if not self._taken.acquire(blocking=False):
            concurrent.futures.wait([self._done])

    def _unlist(self) -> None:
        """No longer on offer to the callers (where still listed)."""
        with _OFFERED:
            offers = _OFFERS.get(self.purpose)
            if offers is not None and self in offers:
                offers.remove(self)

    def _run(self, serving: bool) -> None:
        """Run the function here unless another thread has taken it; ``serving``: this is a
        caller (:func:`serving` holds while it runs)."""
        if not self._taken.acquire(blocking=False):
            return
        before = getattr(_SERVING, "purposes", frozenset())
        if serving:
            _SERVING.purposes = before | {self.purpose}
        try:
            self._done.set_result(self._function())
        except BaseException as error:  # (raised again where the result is asked for)
            self._done.set_exception(error)
        finally:
            _SERVING.purposes = before


def offer(purpose: str, function) -> Offer:
    """On ``purpose``'s thread: ``function`` offered to the callers waiting for it, now or
    later (:func:`wait`). :meth:`Offer.result` gives its value, computing it there where
    no caller took it: nothing offered is lost or run twice."""
    offered = Offer(purpose, function)
    with _OFFERED:
        _OFFERS.setdefault(purpose, collections.deque()).append(offered)
        _OFFERED.notify_all()
    return offered


def wait(purpose: str, future: concurrent.futures.Future):
    """``future.result()``, for a future that ``purpose``'s thread runs; until it ends, this
    caller runs what that thread offers (:func:`offer`)."""
    if future.done():
        return future.result()

    def ended(_) -> None:
        with _OFFERED:
            _OFFERED.notify_all()

    future.add_done_callback(ended)
    with _OFFERED:
        _WAITERS[purpose] = _WAITERS.get(purpose, 0) + 1
    try:
        while True:
            with _OFFERED:
                while not future.done() and not _OFFERS.get(purpose):
                    _OFFERED.wait()
                if future.done():
                    break
                taken = _OFFERS[purpose].popleft()
            taken._run(serving=True)
    finally:
        with _OFFERED:
            _WAITERS[purpose] -= 1
    return future.result()


def waiting(purpose: str) -> bool:
    """Whether a caller waits for ``purpose``'s thread now (:func:`wait`). Asked on that
    thread, it stays true while the thread runs: what the caller waits for is done there."""
    with _OFFERED:
        return _WAITERS.get(purpose, 0) > 0


def serving(purpose: str) -> bool:
    """Whether this thread runs work that ``purpose``'s thread offered it."""
    return purpose in getattr(_SERVING, "purposes", frozenset())
