"""Where a dpoptim step spends its time, next to a non-private step (``torch.profiler``).

For one workload, in one process:

* the top operators (self CPU time per step; on CUDA, kernel time) of a non-private step and of a steady-state
  dpoptim step, from ``torch.profiler`` over several steps each;
* dpoptim's extra time by part: the engine's forward hooks (``_detach``/``_restore``/
  ``_on_forward``, i.e. rule ``save``), its backward hooks (output-gradient and
  accumulation hooks), per-example norms (including any replay a rule does, shown on its
  own), clip factors, clipped sums, the rest of the end-of-backward processing, noise,
  the torch update and the rest of ``step()`` (host time: on CUDA, where kernels run
  asynchronously, a part's time is what the CPU spends issuing it). These parts are labelled by wrapping
  dpoptim's functions with ``torch.profiler.record_function`` *in this process only*;
  dpoptim itself is unchanged;
* the first step (rules checked against autograd, no ghost differentiation) profiled
  on its own, with the check labelled;
* the *hook tax*: what a model that is not in any DP optimizer pays while one exists.
  dpoptim's engine hooks every module call in the process only until its first step has
  been checked (dpoptim.scope), then only its own model's modules, so the tax is measured
  after one private step. Measured without the profiler, by timing non-private steps with
  any process-wide hooks live and paused, interleaved.

Run by the suite as ``python -m benchmarks.profiling --workload mlp --batch 256 ...``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

from . import child
from .workloads import WORKLOADS, build, first_line, quiet

__all__ = ["profile_workload", "PARTS"]

# (label, what it covers). Labels nest: "recompute" is inside "norms", and everything from
# "norms" to "process other" is inside the end-of-backward processing.
PARTS = (
    ("forward hooks", "engine hooks around every module call: parameter detach/restore, rule.save"),
    ("backward hooks", "output-gradient and accumulation hooks during backward"),
    ("norms", "per-example squared norms (rule.norms), excluding recompute"),
    ("recompute", "what rules rebuild from saved inputs: LSTM/attention replay, normalised inputs, "
                  "materialised per-example gradients"),
    ("clip factors", "c_i = min(1, C/||g_i||)"),
    ("clipped sums", "rule.clipped_sum: sum_i c_i g_i"),
    ("process other", "rest of the end-of-backward processing"),
    ("first-step check", "rules vs autograd (first step only)"),
    ("noise", "Gaussian noise added to the sums"),
    ("torch update", "torch.optim.SGD.step"),
    ("step other", "rest of DPSGD.step (checks, division by B, ledger)"),
)


def _labelled(fn, label):
    import torch

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with torch.profiler.record_function("dp::" + label):
            return fn(*args, **kwargs)

    wrapper.__wrapped_by_benchmark__ = True
    return wrapper


def install_labels() -> None:
    """Wrap dpoptim's internals (and torch's SGD.step) with profiler labels. Must run
    before any dpoptim optimizer is built: hooks bind their functions when registered.

    The engine is private API and changes; a name that is not there is skipped, so a
    renamed function shows up as unlabelled time rather than as a crash."""
    import torch
    import dpoptim
    from dpoptim import engine, optimizer, registry

    E = engine.GradEngine
    if getattr(E._process, "__wrapped_by_benchmark__", False):
        return
    targets = [
        *((E, name, "forward hooks") for name in ("_on_forward_pre", "_detach", "_restore", "_on_forward")),
        (E, "_on_output_grad", "backward hooks"),
        (engine, "_accumulated_hook", "backward hooks"),
        (engine, "_param_grad_hook", "first-step check"),
        (E, "_process", "process"),
        (E, "_checked_norms", "norms"),
        (E, "_shared_per_example", "norms"),
        (engine, "clip_factors", "clip factors"),
        (E, "_check_against_autograd", "first-step check"),
        (optimizer, "add_noise_", "noise"),
        (optimizer.DPOptimizerMixin, "_dp_step", "step"),
        (torch.optim.SGD, "step", "torch update"),
        (registry.Rule, "_per_example_cached", "recompute"),
    ]
    seen = set()
    for rule in dpoptim.registered_rules().values():
        cls = type(rule)
        if cls not in seen:
            seen.add(cls)
            targets.append((cls, "clipped_sum", "clipped sums"))
            targets.append((cls, "_factors", "recompute"))  # FactoredRule: LSTM, attention replay
    for owner, name, label in targets:
        fn = getattr(owner, name, None)
        if callable(fn) and not getattr(fn, "__wrapped_by_benchmark__", False):
            setattr(owner, name, _labelled(fn, label))


def _parts_per_step(events, steps: int) -> dict[str, float]:
    """Inclusive CPU ms per step of every dp:: label, then nesting removed."""
    incl: dict[str, float] = {}
    for e in events:
        if e.key.startswith("dp::"):
            incl[e.key[4:]] = incl.get(e.key[4:], 0.0) + e.cpu_time_total / 1e3 / steps
    get = incl.get
    parts = {
        "forward hooks": get("forward hooks", 0.0),
        "backward hooks": get("backward hooks", 0.0),
        "norms": get("norms", 0.0) - get("recompute", 0.0),
        "recompute": get("recompute", 0.0),
        "clip factors": get("clip factors", 0.0),
        "clipped sums": get("clipped sums", 0.0),
        "first-step check": get("first-step check", 0.0),
        "noise": get("noise", 0.0),
        "torch update": get("torch update", 0.0),
    }
    parts["process other"] = max(0.0, get("process", 0.0) - parts["norms"] - parts["recompute"]
                                 - parts["clip factors"] - parts["clipped sums"])
    parts["step other"] = max(0.0, get("step", 0.0) - parts["noise"] - parts["torch update"])
    return {label: parts[label] for label, _ in PARTS}


def _top_ops(events, steps: int, top: int, device: str = "cpu") -> list[dict]:
    """Operators by self time per step: CPU time, or on CUDA the kernels' device time."""
    attr = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    ops = [e for e in events if not e.key.startswith(("dp::", "ProfilerStep", "Optimizer."))]
    ops.sort(key=lambda e: getattr(e, attr, 0), reverse=True)
    return [{"op": e.key, "self_ms": getattr(e, attr, 0) / 1e3 / steps, "calls": e.count / steps}
            for e in ops[:top]]


def _profile(trainer, steps: int):
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            trainer.step()
        trainer.synchronize()
        wall = (time.perf_counter() - start) / steps
    return prof.key_averages(), wall * 1e3


def _hook_tax(workload, batch_size, device, rounds):
    """Non-private step time with a dpoptim optimizer's global hooks live vs paused."""
    plain = build(workload, "non-private", batch_size, device)
    private = build(workload, "dpoptim", batch_size, device)  # only its hooks matter here
    private.step()  # the checked first step: the engine's hooks move onto its own model
    ratios, live_times, paused_times = [], [], []
    private.pause_global_hooks()
    for _ in range(3):
        plain.step()
    for r in range(rounds):
        pair = {}
        for state in (("live", "paused") if r % 2 else ("paused", "live")):
            if state == "live":
                private.resume_global_hooks()
            start = time.perf_counter()
            plain.step()
            plain.synchronize()
            pair[state] = time.perf_counter() - start
            private.pause_global_hooks()
        ratios.append(pair["live"] / pair["paused"])
        live_times.append(pair["live"])
        paused_times.append(pair["paused"])
    modules = sum(1 for _ in plain.model.modules())
    return {"ratio": statistics.median(ratios),
            "ms_per_step": (statistics.median(live_times) - statistics.median(paused_times)) * 1e3,
            "module_calls": modules}


def profile_workload(workload, batch_size: int, device: str = "cpu", steps: int = 10, warmup: int = 3,
                     top: int = 12, tax_rounds: int = 20) -> dict:
    install_labels()
    result = {"workload": workload.name, "batch_size": batch_size, "device": device, "steps": steps}
    try:
        result["hook_tax"] = _hook_tax(workload, batch_size, device, tax_rounds)
    except Exception as exc:
        result["hook_tax"] = {"error": first_line(exc)}

    plain = build(workload, "non-private", batch_size, device)
    for _ in range(warmup):
        plain.step()
    events, wall = _profile(plain, steps)
    result["non-private"] = {"step_ms": wall, "top_ops": _top_ops(events, steps, top, device)}

    try:
        private = build(workload, "dpoptim", batch_size, device)
        events, wall = _profile(private, 1)
        result["first_step"] = {"step_ms": wall, "parts_ms": _parts_per_step(events, 1),
                                "top_ops": _top_ops(events, 1, top, device)}
        for _ in range(warmup):
            private.step()
        events, wall = _profile(private, steps)
        result["dpoptim"] = {"step_ms": wall, "parts_ms": _parts_per_step(events, steps),
                             "top_ops": _top_ops(events, steps, top, device)}
    except Exception as exc:
        result["dpoptim"] = {"error": first_line(exc)}
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--tax-rounds", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    child.pin_threads(args.threads)
    quiet()
    child.emit(profile_workload(WORKLOADS[args.workload], args.batch, args.device, args.steps, args.warmup,
                                args.top, args.tax_rounds))


if __name__ == "__main__":
    main()
