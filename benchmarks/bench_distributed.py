"""Step time with more than one process: DPSGD under DistributedDataParallel and under
FSDP2 (``fully_shard``) against non-private SGD under the same wrapper, 2 CPU processes
(gloo), one thread each.

Every process trains four copies of the same MLP on its share of the same global batches,
taking turns step by step: non-private DDP, dpoptim DDP (backward under ``no_sync()``, as
docs/training.md recommends: dpoptim's one all-reduce per step is then all the
communication), non-private FSDP and dpoptim FSDP. A step is zero_grad, forward, loss,
backward, optimizer step. The ratio is the median over rounds of (dpoptim's step /
non-private step of the same wrapper and round). A script, not a test::

    python -m benchmarks.bench_distributed [--rounds 20] [--batch 64] [--write]

``--write`` stores the result in docs/benchmarks_distributed.json and renders the section
between the markers in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import statistics
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import dpoptim

from . import report

WORLD = 2
WIDTHS = (256, 512, 512, 10)
_DOCS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs")
JSON_PATH = os.path.join(_DOCS, "benchmarks_distributed.json")
MD_PATH = os.path.join(_DOCS, "benchmarks.md")
START, END = "<!-- distributed:start -->", "<!-- distributed:end -->"
MODES = ("ddp non-private", "ddp dpoptim", "fsdp non-private", "fsdp dpoptim")


def _mlp():
    torch.manual_seed(0)
    layers = []
    for a, b in zip(WIDTHS[:-1], WIDTHS[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def _build(mode, batch):
    from torch.distributed.fsdp import fully_shard

    model = _mlp()
    if mode.startswith("ddp"):
        wrapped = nn.parallel.DistributedDataParallel(model)
    else:
        for layer in model[:-1:2]:
            fully_shard(layer)
        wrapped = fully_shard(model)
    if mode.endswith("non-private"):
        return wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.01), contextlib.nullcontext
    opt = dpoptim.DPSGD(wrapped.parameters(), lr=0.01, noise_multiplier=1.0, max_grad_norm=1.0,
                        expected_batch_size=float(batch), sample_rate=0.01)
    quiet = wrapped.no_sync if mode.startswith("ddp") else contextlib.nullcontext
    return wrapped, opt, quiet


def _worker(rank, rounds, batch, out):
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    store = "file://" + os.path.join(out, "rendezvous")  # a file in the run's own directory: no port to pick
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=WORLD)
    try:
        g = torch.Generator().manual_seed(1)
        local = batch // WORLD
        data = [(torch.randn(local, WIDTHS[0], generator=g), torch.randint(0, WIDTHS[-1], (local,), generator=g))
                for _ in range(4)]
        built = {mode: _build(mode, batch) for mode in MODES}
        times = {mode: [] for mode in MODES}
        first = {}
        for r in range(rounds + 2):  # 2 warm-up rounds, the first of them the checked first step
            x, y = data[r % len(data)]
            for mode, (model, opt, quiet) in built.items():
                dist.barrier()
                start = time.perf_counter()
                opt.zero_grad()
                with quiet():
                    F.cross_entropy(model(x), y).backward()
                opt.step()
                elapsed = time.perf_counter() - start
                if r == 0:
                    first[mode] = elapsed
                elif r >= 2:
                    times[mode].append(elapsed)
        if rank == 0:
            ratios = {}
            for kind in ("ddp", "fsdp"):
                base = times[f"{kind} non-private"]
                ratios[kind] = statistics.median(d / b for d, b in zip(times[f"{kind} dpoptim"], base))
            result = {
                "ms": {mode: 1e3 * statistics.median(t) for mode, t in times.items()},
                "first_ms": {mode: 1e3 * t for mode, t in first.items()},
                "ratio": ratios, "rounds": rounds, "batch": batch, "widths": list(WIDTHS),
                "env": f"torch {torch.__version__}, {WORLD} gloo processes x 1 thread",
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            }
            with open(os.path.join(out, "result.json"), "w") as f:
                json.dump(result, f)
        built.clear()  # the DDP reducers hold the group: let them go while it is alive
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure(rounds: int, batch: int) -> dict:
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(rounds, batch, out), nprocs=WORLD, join=True,
                           start_method="spawn")
        with open(os.path.join(out, "result.json")) as f:
            return json.load(f)


def render(r: dict) -> str:
    ms = r["ms"]
    lines = [
        START,
        "## More than one process",
        "",
        f"`python -m benchmarks.bench_distributed`: an MLP {'-'.join(map(str, r['widths']))}, global batch "
        f"{r['batch']}, {r['env']}, median of {r['rounds']} rounds taking turns, {r['date']}. dpoptim's DDP "
        "step runs its backward under `no_sync()`; its one all-reduce per step is all it communicates.",
        "",
        "| wrapper | non-private step | dpoptim step | dpoptim / non-private | dpoptim first step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for kind, name in (("ddp", "DistributedDataParallel"), ("fsdp", "FSDP2 (`fully_shard` per layer)")):
        lines.append(f"| {name} | {ms[f'{kind} non-private']:.2f} ms | {ms[f'{kind} dpoptim']:.2f} ms | "
                     f"{r['ratio'][kind]:.2f}x | {r['first_ms'][f'{kind} dpoptim']:.0f} ms |")
    lines += ["", END]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--write", action="store_true", help="update docs/benchmarks_distributed.json and benchmarks.md")
    parser.add_argument("--out", help="write the JSON here instead (and leave the docs alone)")
    args = parser.parse_args(argv)
    result = measure(args.rounds, args.batch)
    print(render(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
    if args.write:
        with open(JSON_PATH, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
        report.write_section(MD_PATH, render(result))


if __name__ == "__main__":
    main()
