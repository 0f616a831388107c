"""Step time of DPSGD against torch.optim.SGD on the two sequence workloads.

* ``lstm``: Embedding 5000x64, LSTM 64->128, Linear head on the last state; T = 64, batch 64.
* ``transformer``: token + learned position embeddings (d = 128), a 2-layer post-norm
  encoder (4 heads, feed-forward 512, no dropout), mean pooling, Linear head; T = 64, batch 32.

Both optimizers train their own copy of the same model on the same batches, in one
process, taking turns step by step (so both see the same machine load); the printed ratio
is the median over rounds of ``DPSGD step / SGD step``, by wall-clock time and by this
process's CPU time (steadier on a shared machine; with several threads it adds them up).
dpoptim's first step also checks its rules against autograd and is timed apart. A
script, not a test::

    python -m benchmarks.bench_sequence [--steps 30] [--threads 2] [--only lstm]
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings

import torch
from torch import nn

import dpoptim

from .workloads import CLASSES, SEQ_LEN as T, VOCAB, LSTMClassifier, TransformerClassifier


WORKLOADS = {"lstm": (LSTMClassifier, 64), "transformer": (TransformerClassifier, 32)}


class _Paused:
    """Takes dpoptim's process-wide forward hooks out while the non-private model steps, so
    that it is timed as if it were alone in the process."""

    def __init__(self, optimizer):
        hooks = nn.modules.module._global_forward_hooks
        self.hooks = hooks
        self.saved = {}
        self.ids = [h.id for h in optimizer._engine._handles if h.id in hooks]

    def __enter__(self):
        self.saved = {i: self.hooks.pop(i) for i in self.ids if i in self.hooks}

    def __exit__(self, *exc):
        self.hooks.update(self.saved)


def measure(name, steps, device):
    make, batch = WORKLOADS[name]
    torch.manual_seed(0)
    model = make().to(device)
    private = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(VOCAB, (batch, T), generator=g).to(device),
                torch.randint(CLASSES, (batch,), generator=g).to(device)) for _ in range(4)]
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    dp = dpoptim.DPSGD(private.parameters(), lr=0.05, noise_multiplier=1.0, max_grad_norm=1.0,
                       expected_batch_size=batch, sample_rate=batch / 50_000)
    paused = _Paused(dp)

    def step(m, opt, i):
        x, y = batches[i % len(batches)]
        opt.zero_grad(set_to_none=True)
        nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed(m, opt, i):
        wall, cpu = time.perf_counter(), time.process_time()
        step(m, opt, i)
        return time.perf_counter() - wall, time.process_time() - cpu

    first = timed(private, dp, 0)[0]
    for i in range(3):  # warm-up
        with paused:
            step(model, sgd, i)
        step(private, dp, i)
    rounds = []
    for i in range(steps):
        if i % 2:  # alternate which goes first
            with paused:
                b = timed(model, sgd, i)
            p = timed(private, dp, i)
        else:
            p = timed(private, dp, i)
            with paused:
                b = timed(model, sgd, i)
        rounds.append((b, p))
    median = statistics.median
    result = {"first": first}
    for k, clock in enumerate(("wall", "cpu")):
        result[clock] = (median(b[k] for b, _ in rounds), median(p[k] for _, p in rounds),
                         median(p[k] / b[k] for b, p in rounds))
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--only", choices=sorted(WORKLOADS), default=None)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # fixed-size batches: the Poisson-sampling warning is expected
    device = torch.device(args.device)
    print(f"device {device}, {torch.get_num_threads()} threads, torch {torch.__version__}, {args.steps} rounds")
    for name in [args.only] if args.only else list(WORKLOADS):
        result = measure(name, args.steps, device)
        for clock in ("wall", "cpu"):
            base, priv, ratio = result[clock]
            print(f"{name:12s} {clock:4s}  SGD {base * 1e3:8.1f} ms   DPSGD {priv * 1e3:8.1f} ms   ratio {ratio:5.2f}x")
        print(f"{'':12s} DPSGD first step (checks the rules against autograd) {result['first'] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
