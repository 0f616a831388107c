"""Soak: 10,000 DPSGD steps of a tiny model in one loop. Nothing may accumulate.

A per-step leak (a record, a hook, a tensor kept per backward) or per-step work that grows
with the number of steps taken (a ledger entry per step, a list scanned every step) is
invisible in a short test and ruins a long training run. Here:

* live Python objects (``gc.get_objects()``), resident memory, the process-wide module
  hooks and the parameters' own hooks stay flat after warm-up, and so does Python memory
  (``tracemalloc``, over 1,500 more steps after the timed ones: it slows Python down);
* no warning is raised (one per step would pile up);
* the engine holds no per-batch state after each step;
* the ledger is one run of all the steps;
* a step costs as much CPU at the end as at the start: the median of the last 1000 steps
  over the median of the first 1000 after warm-up is below 2 (or, if a burst of load on
  the machine inflated the medians, the 10th percentiles are). CPU time of this process,
  not wall time, so that other processes on the machine count less.
"""

import gc
import os
import statistics
import time
import tracemalloc
import warnings

import pytest
import torch
from torch import nn

import dpoptim

STEPS = 10_000
WARMUP = 1_000
WINDOW = 1_000
TRACED_STEPS, TRACED_WARMUP = 1_200, 300
SIGMA, Q, N = 1.0, 0.125, 64


def _global_hook_count():
    m = nn.modules.module
    return sum(len(getattr(m, name, {})) for name in
               ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                "_global_backward_pre_hooks", "_global_forward_hooks_always_called"))


def _param_hook_count(params):
    return sum(len(p._backward_hooks or {}) + len(getattr(p, "_post_accumulate_grad_hooks", None) or {})
               for p in params)


def _engine_is_idle(engine):
    """Everything the engine keeps for one logical batch is gone (or empty)."""
    leftovers = {
        name: getattr(engine, name)
        for name in ("_sums", "_raw_sums", "_autograd_sums", "_errors", "_clip_norms", "_detached")
        if getattr(engine, name, None)
    }
    if getattr(engine, "_open", None) is not None:
        leftovers["_open"] = engine._open
    if getattr(engine, "examples", 0):
        leftovers["examples"] = engine.examples
    return leftovers


def _resident_bytes():
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None  # not Linux: the check is skipped


@pytest.fixture
def one_thread():
    """Tiny tensors: a second intra-op thread only adds wake-ups, which on a busy machine
    cost more than the work and would drown the timing."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_ten_thousand_steps_leave_nothing_behind(one_thread):
    torch.manual_seed(0)
    data_gen = torch.Generator().manual_seed(1)
    x = torch.randn(N, 6, generator=data_gen)
    y = torch.randint(0, 3, (N,), generator=data_gen)
    layers = [nn.Linear(6, 8)]
    if nn.LayerNorm in dpoptim.registered_rules():
        layers.append(nn.LayerNorm(8))
    model = nn.Sequential(*layers, nn.Tanh(), nn.Linear(8, 3))
    params = list(model.parameters())
    opt = dpoptim.DPSGD(params, lr=0.05, momentum=0.9, noise_multiplier=SIGMA, max_grad_norm=1.0,
                        expected_batch_size=Q * N, sample_rate=Q, generator=torch.Generator().manual_seed(2))
    loss_fn = nn.CrossEntropyLoss()
    problems = []

    def one_step():
        take = torch.rand(N, generator=data_gen) < Q  # Poisson sampling; now and then empty
        t0 = time.process_time()
        opt.zero_grad()
        xb, yb = x[take], y[take]
        if len(xb):
            loss_fn(model(xb), yb).backward()
        opt.step()
        return time.process_time() - t0

    def counts():
        gc.collect()
        return len(gc.get_objects()), _resident_bytes(), _global_hook_count(), _param_hook_count(params)

    cpu = []
    with warnings.catch_warnings():
        # A warning per step would itself be a leak (and noise); none is expected here.
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*degrees of freedom is <= 0")  # torch, on an empty batch
        for step in range(STEPS):
            if step == WARMUP:
                start = counts()
            cpu.append(one_step())
            leftovers = _engine_is_idle(opt._engine)
            assert not leftovers, f"step {step}: the engine kept per-batch state {sorted(leftovers)}"
        end = counts()
        # tracemalloc slows Python down several times, so it watches a shorter run after
        # the timed one: bytes, where gc.get_objects() only counts containers.
        tracemalloc.start()
        try:
            for step in range(TRACED_STEPS):
                if step == TRACED_WARMUP:
                    gc.collect()
                    traced_start = tracemalloc.get_traced_memory()[0]
                one_step()
            gc.collect()
            traced = tracemalloc.get_traced_memory()[0] - traced_start
        finally:
            tracemalloc.stop()

    objects, hooks, param_hooks = end[0] - start[0], end[2] - start[2], end[3] - start[3]
    resident = None if start[1] is None else end[1] - start[1]
    first = statistics.median(cpu[WARMUP:WARMUP + WINDOW])
    last = statistics.median(cpu[-WINDOW:])
    # The fastest steps are the ones other processes disturbed least: a real slowdown
    # moves them too, contention on a busy machine mostly does not.
    first_fast = statistics.quantiles(cpu[WARMUP:WARMUP + WINDOW], n=10)[0]
    last_fast = statistics.quantiles(cpu[-WINDOW:], n=10)[0]
    steady = STEPS - WARMUP
    print(f"\nsoak: {STEPS} steps, {sum(cpu):.1f}s CPU; median step {first * 1e3:.3f} ms (steps "
          f"{WARMUP}-{WARMUP + WINDOW}) vs {last * 1e3:.3f} ms (last {WINDOW}); over {steady} steps: "
          f"{objects:+d} objects, {resident if resident is None else resident // 1024:+} KiB resident, "
          f"{hooks:+d} module hooks, {param_hooks:+d} parameter hooks; "
          f"{traced:+d} bytes traced over {TRACED_STEPS - TRACED_WARMUP} more steps")

    # A leak of one object per step would add about 9000; allow caches to settle a little.
    if objects > 200:
        problems.append(f"{objects} more live Python objects after {steady} more steps")
    if resident is not None and resident > 32 * 2**20:
        problems.append(f"resident memory grew by {resident // 2**20} MiB over {steady} steps")
    if traced > 32 * 1024:  # one 50-byte object per step would be 44 KiB
        problems.append(f"Python memory grew by {traced} bytes over {TRACED_STEPS - TRACED_WARMUP} steps")
    if hooks or param_hooks:
        problems.append(f"hooks grew: {hooks:+d} module-wide, {param_hooks:+d} on parameters")
    total = STEPS + TRACED_STEPS
    if opt.ledger != ((SIGMA, Q, total),):
        problems.append(f"ledger should be one run of {total} steps, got {opt.ledger[:3]}... ({len(opt.ledger)} runs)")
    if opt.steps_taken != total:
        problems.append(f"steps_taken {opt.steps_taken} != {total}")
    if not (last < 2 * first or last_fast < 2 * first_fast):
        problems.append(
            f"steps got slower: median {last * 1e3:.3f} ms at the end vs {first * 1e3:.3f} ms, 10th "
            f"percentile {last_fast * 1e3:.3f} ms vs {first_fast * 1e3:.3f} ms"
        )
    if not all(torch.isfinite(p).all() for p in params):
        problems.append("parameters are no longer finite")
    assert not problems, "\n".join(problems)
