"""Running one measurement in a process of its own.

Every measurement (the step times of one workload, the memory of one mode) runs in a fresh
Python process: threads are pinned before torch starts its pools, nothing one measurement
allocates or caches is seen by the next, and a mode that crashes the interpreter (a
segfault, running out of memory) is reported as failed instead of ending the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

__all__ = ["MARKER", "emit", "pin_threads", "run"]

MARKER = "BENCHMARK-RESULT "
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pin_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass  # already set by an earlier parallel region


def emit(result: dict) -> None:
    """Hand ``result`` to the parent: one marked JSON line on stdout."""
    sys.stdout.write(MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()


def run(module: str, args: list[str], threads: int, timeout: float, env: dict | None = None) -> dict:
    """Run ``python -m module *args`` and return the dict it emitted, or
    ``{"error": ...}`` with the first line of what went wrong."""
    environment = dict(os.environ)
    environment.update(
        OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
        PYTHONPATH=os.pathsep.join(filter(None, [_REPO, environment.get("PYTHONPATH")])),
    )
    environment.update(env or {})
    try:
        proc = subprocess.run(
            [sys.executable, "-m", module, *args, "--threads", str(threads)],
            cwd=_REPO, env=environment, capture_output=True, text=True, timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith(MARKER):
            return json.loads(line[len(MARKER):])
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    error = lines[-1] if lines else f"exit status {proc.returncode}"
    if proc.returncode < 0:
        error = f"killed by signal {-proc.returncode} ({error})"
    return {"error": error}
