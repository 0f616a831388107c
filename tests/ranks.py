"""Running a test's scenarios in several gloo processes: one process group per worker,
rendezvous on a free local port, results saved by each rank for the parent to check."""

import contextlib
import datetime
import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def process_group(rank: int, port: int, world: int):
    """This process as rank ``rank`` of a gloo group of ``world``, single-threaded, for the
    duration of the block; the environment is what torchrun would set."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_ranks(worker, args: tuple, world: int) -> None:
    """``worker(rank, port, *args)`` in ``world`` processes; raises what a rank raised.
    Forked where possible: the children inherit torch and the torch._dynamo that DDP and
    FSDP import (seconds per process otherwise)."""
    import torch._dynamo  # noqa: F401

    method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
    mp.start_processes(worker, args=(free_port(), *args), nprocs=world, join=True, start_method=method)


def run_scenarios(scenarios, out, world: int) -> list:
    """Each rank's ``scenarios(rank)`` (a dict of results), run in a gloo group of
    ``world`` processes, saved by each rank under ``out`` and returned by rank."""
    run_ranks(_save_scenarios, (scenarios, str(out), world), world)
    return [torch.load(os.path.join(str(out), f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _save_scenarios(rank, port, scenarios, out, world):
    with process_group(rank, port, world):
        results = scenarios(rank)
    torch.save(results, os.path.join(out, f"rank{rank}.pt"))


def error_of(action, kind=Exception):
    """The message of the ``kind`` error ``action()`` raises, or None if it raises none: a
    rank's refusal travels to the parent as text."""
    try:
        action()
    except kind as exc:
        return str(exc)
    return None
