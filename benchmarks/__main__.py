"""dpoptim's benchmark suite: step time, memory and scaling against non-private training
and Opacus.

    pip install -e '.[bench]'          # Opacus and matplotlib; both optional
    python -m benchmarks                # full run, writes docs/benchmarks.{md,json,png}
    python -m benchmarks --quick        # smoke run, writes to a temporary directory
    python -m benchmarks --device cuda  # GPU numbers, added beside the CPU ones

Each measurement runs in a process of its own (:mod:`benchmarks.child`): step times of all
modes of one workload together, taking turns (:mod:`benchmarks.timing`); peak memory one
mode per process (:mod:`benchmarks.memory`); profiles (:mod:`benchmarks.profiling`).
:mod:`benchmarks.report` turns the results into the table, the JSON and the plot.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shlex
import sys
import tempfile
import time

from . import child, report
from .memory import MALLOC_ENV
from .workloads import MODES, WORKLOADS, opacus_available

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Batch sizes of the scaling section (MLP), full and --quick.
SCALING_BATCHES = (32, 64, 128, 256, 512, 1024)
QUICK_SCALING_BATCHES = (16, 32)
SCALING_MODES = ("non-private", "dpoptim", "opacus-ghost")


class Settings:
    """How much of everything to measure: the full suite, or --quick."""

    def __init__(self, quick: bool):
        self.quick = quick
        self.warmup, self.rounds = (1, 3) if quick else (5, 40)
        self.memory_steps = 1 if quick else 3
        self.scaling_batches = QUICK_SCALING_BATCHES if quick else SCALING_BATCHES
        self.scaling_rounds = 3 if quick else 25
        self.profile_steps, self.tax_rounds = (2, 2) if quick else (10, 30)
        self.profile_workloads = ("mlp",) if quick else tuple(WORKLOADS)
        self.parallel = 2 if quick else 1  # memory runs measure their own process only
        self.timeout = 600 if quick else 3600

    def batch(self, workload) -> int:
        return workload.quick_batch_size if self.quick else workload.batch_size

    def memory_batch(self, workload) -> int | None:
        if workload.memory_batch_size is None:
            return None
        return max(4, workload.memory_batch_size // 16) if self.quick else workload.memory_batch_size


_START = time.perf_counter()


def _log(message: str) -> None:
    print(f"[{time.perf_counter() - _START:6.1f} s] {message}", file=sys.stderr, flush=True)


def _available_modes(requested) -> list[str]:
    return [m for m in requested if m in MODES]


def run_timing(workloads, modes, settings, device, threads, extra_jobs=(), rounds=None,
               together=False) -> tuple[dict, list]:
    """Step times of every workload (and of ``extra_jobs``: (workload, batch, modes)).

    The full suite gives every workload a fresh process; --quick times everything in one
    process, which starts faster. ``together``: all jobs in one process, taking turns
    round by round (for comparing absolute times across jobs)."""
    out, extra = {}, []
    jobs = [(w.name, settings.batch(w), modes, False) for w in workloads]
    jobs += [(name, batch, job_modes, True) for name, batch, job_modes in extra_jobs]
    groups = [jobs] if settings.quick or together else [[job] for job in jobs]
    for group in groups:
        _log("timing " + ", ".join(f"{name} at batch {batch}" for name, batch, _, _ in group) + " ...")
        args = [a for name, batch, job_modes, _ in group for a in ("--job", f"{name}:{batch}:{'+'.join(job_modes)}")]
        args += ["--device", device, "--warmup", str(settings.warmup), "--rounds", str(rounds or settings.rounds)]
        if together:
            args.append("--together")
        result = child.run("benchmarks.timing", args, threads, settings.timeout)
        if "error" in result:
            results = [{"workload": name, "batch_size": batch, "device": device,
                        "modes": {m: {"status": "failed", "error": "process: " + result["error"]} for m in job_modes}}
                       for name, batch, job_modes, _ in group]
        else:
            results = result["jobs"]
        for (name, _, _, is_extra), r in zip(group, results):
            if is_extra:
                extra.append(r)
            else:
                out[name] = r
    return out, extra


def _memory_jobs(jobs, settings, device, threads) -> list[dict]:
    def one(job):
        name, mode, batch = job
        if mode.startswith("opacus") and not opacus_available():
            return {"status": "skipped", "error": "Opacus is not installed (pip install '.[bench]')",
                    "workload": name, "mode": mode, "batch_size": batch}
        args = ["--workload", name, "--mode", mode, "--batch", str(batch), "--device", device,
                "--steps", str(settings.memory_steps)]
        result = child.run("benchmarks.memory", args, threads, settings.timeout, env=MALLOC_ENV)
        if "error" in result and "status" not in result:
            result = {"status": "failed", "error": "process: " + result["error"]}
        result.update(workload=name, mode=mode, batch_size=batch)
        return result

    with concurrent.futures.ThreadPoolExecutor(settings.parallel) as pool:
        return list(pool.map(one, jobs))


def run_memory(workloads, modes, settings, device, threads) -> dict:
    jobs = [(w.name, m, settings.memory_batch(w)) for w in workloads if settings.memory_batch(w) for m in modes]
    _log(f"memory: {len(jobs)} processes ...")
    out: dict = {}
    for r in _memory_jobs(jobs, settings, device, threads):
        entry = out.setdefault(r["workload"], {"workload": r["workload"], "batch_size": r["batch_size"], "modes": {}})
        entry["modes"][r["mode"]] = r
    return out


def scaling_jobs(modes, settings) -> list[tuple]:
    modes = [m for m in SCALING_MODES if m in modes]
    return [("mlp", b, modes) for b in settings.scaling_batches]


def run_scaling(modes, settings, device, threads, timing=None) -> dict:
    """MLP step time and memory from batch 32 to 1024. ``timing``: the step times, when
    they were measured together with the workloads' (--quick)."""
    jobs = scaling_jobs(modes, settings)
    modes = jobs[0][2] if jobs else []
    batches = [b for _, b, _ in jobs]
    _log(f"scaling: MLP at batches {batches} ...")
    if timing is None:
        # One process, all batch sizes taking turns: the fit compares absolute times, and
        # separate processes would each see the machine's load at their own moment.
        _, timing = run_timing([], modes, settings, device, threads, extra_jobs=jobs, rounds=settings.scaling_rounds,
                               together=True)
    memory = _memory_jobs([("mlp", m, b) for b in batches for m in modes], settings, device, threads)
    return {"workload": "mlp", "batches": batches, "modes": modes, "timing": timing, "memory": memory}


def run_profiles(workloads, settings, device, threads) -> dict:
    out = {}
    for w in workloads:
        if w.name not in settings.profile_workloads:
            continue
        _log(f"profiling {w.name} ...")
        args = ["--workload", w.name, "--batch", str(settings.batch(w)), "--device", device,
                "--steps", str(settings.profile_steps), "--warmup", str(settings.warmup),
                "--tax-rounds", str(settings.tax_rounds)]
        out[w.name] = child.run("benchmarks.profiling", args, threads, settings.timeout)
    return out


def machine(device: str, threads: int) -> dict:
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count(), "threads": threads, "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}
    try:
        import importlib.metadata as md

        info["opacus"] = md.version("opacus")
    except Exception:
        info["opacus"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    return info


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Step time, memory, scaling and profiles of dpoptim against non-private training and Opacus.",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: few steps, small batches")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--out", help="output directory (default: docs/, or a temporary one with --quick)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset of " + ", ".join(WORKLOADS))
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ", ".join(MODES))
    parser.add_argument("--threads", type=int, default=2, help="torch threads per process (default 2)")
    for part in ("memory", "scaling", "profile"):
        parser.add_argument(f"--no-{part}", action="store_true", help=f"skip the {part} section")
    args = parser.parse_args(argv)

    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device")
    unknown = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {list(WORKLOADS)}")
    settings = Settings(args.quick)
    workloads = [WORKLOADS[w] for w in args.workloads.split(",")]
    modes = _available_modes(args.modes.split(","))
    if "non-private" not in modes:
        modes.insert(0, "non-private")  # every ratio is taken against it
    out = args.out or (os.path.join(tempfile.gettempdir(), "dpoptim-benchmarks-quick") if args.quick
                       else os.path.join(_REPO, "docs"))
    os.makedirs(out, exist_ok=True)

    started = time.perf_counter()
    load_before = os.getloadavg() if hasattr(os, "getloadavg") else None
    results = {
        "command": "python -m benchmarks " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])),
        "quick": settings.quick,
        "date": time.strftime("%Y-%m-%d %H:%M %Z"),
        "machine": machine(args.device, args.threads),
        "opacus": opacus_available(),
        "settings": {k: v for k, v in vars(settings).items() if isinstance(v, (int, float, bool, str, tuple))},
    }
    together = settings.quick and not args.no_scaling
    results["timing"], scaling_timing = run_timing(
        workloads, modes, settings, args.device, args.threads,
        extra_jobs=scaling_jobs(modes, settings) if together else ())
    if not args.no_memory:
        results["memory"] = run_memory(workloads, modes, settings, args.device, args.threads)
    if not args.no_scaling:
        results["scaling"] = run_scaling(modes, settings, args.device, args.threads,
                                         timing=scaling_timing if together else None)
    if not args.no_profile:
        results["profile"] = run_profiles(workloads, settings, args.device, args.threads)
    results["load_average"] = {"before": load_before, "after": os.getloadavg() if load_before else None}
    results["runtime_s"] = time.perf_counter() - started

    paths = report.write(results, out, device="cuda" if args.device.startswith("cuda") else "cpu")
    _log(f"done in {results['runtime_s']:.0f} s: " + ", ".join(paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
