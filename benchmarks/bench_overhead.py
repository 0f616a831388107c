"""The fixed cost of a DP step and the hook tax, on models small enough that Python
overhead, not arithmetic, decides the time.

    python -m benchmarks.bench_overhead            # both rows
    python -m benchmarks.bench_overhead --rounds 400

*Fixed cost*: a tiny MLP (the demo's, 64-32-10, batch 32): the median over interleaved
rounds of (DPSGD step / torch.optim.SGD step), each step being zero_grad, forward,
cross-entropy, backward and the optimizer step.

*Hook tax*: a non-private 13-layer MLP (64 wide, batch 32) stepping while a DP optimizer
exists for *another* model in the same process, against the same model stepping with no
DP optimizer alive: the median of (with / without) over interleaved rounds. A ratio of 1
means a model without a DP optimizer pays nothing.

*Noise ahead*: the MLP 784-512-512-10 at batch 256 (670k parameters), DPSGD with its noise
drawn a step ahead on a background thread (:mod:`dpoptim.noise`; the default in secure mode) against the
same optimizer drawing it inside ``step()``, each against a non-private step of the same
round; plain and secure mode.

Benchmarks are not tests: this reports ratios and never fails on them.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings

import torch
import torch.nn.functional as F
from torch import nn

import dpoptim


def _tiny() -> nn.Module:
    return nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))


def _deep() -> nn.Module:
    layers = []
    for _ in range(6):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(64, 10))  # 13 layers


def _dp(params, batch):
    return dpoptim.DPSGD(params, lr=0.05, noise_multiplier=1.0, max_grad_norm=1.0,
                         expected_batch_size=batch, sample_rate=batch / 50_000)


def _step(model, opt, x, y) -> float:
    start = time.perf_counter()
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    return time.perf_counter() - start


def fixed_cost(rounds: int, batch: int = 32) -> dict:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g)
    plain_model, dp_model = _tiny(), _tiny()
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.05)
    private = _dp(dp_model.parameters(), batch)
    for _ in range(20):
        _step(plain_model, plain, x, y), _step(dp_model, private, x, y)
    ratios, p_times, d_times = [], [], []
    for r in range(rounds):
        order = ((plain_model, plain), (dp_model, private)) if r % 2 else ((dp_model, private), (plain_model, plain))
        t = {id(o): _step(m, o, x, y) for m, o in order}
        p_times.append(t[id(plain)])
        d_times.append(t[id(private)])
        ratios.append(t[id(private)] / t[id(plain)])
    return {"ratio": statistics.median(ratios), "non_private_ms": statistics.median(p_times) * 1e3,
            "dpoptim_ms": statistics.median(d_times) * 1e3}


def hook_tax(rounds: int, batch: int = 32, steps: int = 10) -> dict:
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, 64, generator=g), torch.randint(0, 10, (batch,), generator=g)
    model = _deep()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    other = _tiny()
    for _ in range(20):
        _step(model, opt, x, y)
    ratios, with_times, without_times = [], [], []
    for r in range(rounds):
        times = {}
        for alive in ((True, False) if r % 2 else (False, True)):
            private = _dp(other.parameters(), batch) if alive else None
            if private is not None:  # the other model trains too, as it would in a real script
                private.zero_grad()
                F.cross_entropy(other(x), y).backward()
                private.step()
            times[alive] = statistics.median(_step(model, opt, x, y) for _ in range(steps))
            del private
            gc.collect()
        ratios.append(times[True] / times[False])
        with_times.append(times[True])
        without_times.append(times[False])
    return {"ratio": statistics.median(ratios), "without_ms": statistics.median(without_times) * 1e3,
            "with_ms": statistics.median(with_times) * 1e3}


def noise_ahead(rounds: int, batch: int = 256, secure: bool = False) -> dict:
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)

    def mlp():
        return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))

    plain_model = mlp()
    runs = {"plain": (plain_model, torch.optim.SGD(plain_model.parameters(), lr=0.05))}
    for ahead in (True, False):
        model = mlp()
        opt = dpoptim.DPSGD(model.parameters(), lr=0.05, noise_multiplier=1.0, max_grad_norm=1.0,
                            expected_batch_size=batch, sample_rate=batch / 50_000, secure_mode=secure)
        opt._predraw_noise = ahead
        runs[ahead] = (model, opt)
    for _ in range(5):
        for model, opt in runs.values():
            _step(model, opt, x, y)
    ratios = {True: [], False: []}
    keys = list(runs)
    for r in range(rounds):
        order = keys[r % 3:] + keys[:r % 3]
        t = {k: _step(*runs[k], x, y) for k in order}
        for ahead in (True, False):
            ratios[ahead].append(t[ahead] / t["plain"])
    return {"ahead": statistics.median(ratios[True]), "in_step": statistics.median(ratios[False])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")  # fixed batches: the Poisson-sampling warning is expected
    cost = fixed_cost(args.rounds)
    tax = hook_tax(max(args.rounds // 10, 5))
    ahead = {secure: noise_ahead(max(args.rounds // 10, 10), secure=secure) for secure in (False, True)}
    print(f"torch {torch.__version__}, {args.threads} thread(s)")
    print(f"fixed cost, tiny MLP 64-32-10, batch 32: dpoptim {cost['dpoptim_ms']:.3f} ms vs non-private "
          f"{cost['non_private_ms']:.3f} ms per step: {cost['ratio']:.2f}x")
    print(f"hook tax, non-private 13-layer MLP, batch 32, with a DP optimizer alive for another model: "
          f"{tax['with_ms']:.3f} ms vs {tax['without_ms']:.3f} ms per step: {tax['ratio']:.3f}x")
    for secure, r in ahead.items():
        print(f"noise ahead, MLP 784-512-512-10, batch 256{', secure mode' if secure else ''}: "
              f"{r['ahead']:.2f}x drawn ahead vs {r['in_step']:.2f}x drawn in step() (to non-private)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
