"""One background thread per purpose and process, started on first use.

Two jobs run on a thread beside the caller's: the noise of the next step, drawn ahead
during the forward and backward passes (:mod:`dpoptim.noise`), and one of the two
directions of a privacy loss distribution, composed while the caller composes the other
(:mod:`dpoptim.accounting.pld`). Each purpose has its own single thread, so neither
queues behind the other.

A process forked from one that had started a thread inherits the executor object but not
its thread (and maybe a lock held by a thread that does not exist there): executors are
kept per process id, and a forked child drops its parent's.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading

__all__ = ["executor"]

_EXECUTORS: dict = {}  # (process id, purpose) -> its one thread, started on first use
_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    global _LOCK
    _LOCK = threading.Lock()
    _EXECUTORS.clear()


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
