"""The suite's outputs: ``benchmarks.json`` (every number), ``benchmarks.md`` (tables,
targets, scaling, profiles) and ``benchmarks.png`` (matplotlib; skipped with a note when
it is missing).

Results are kept per device: a ``--device cuda`` run replaces only the CUDA entry of an
existing ``benchmarks.json`` and the Markdown shows both, labelled.
"""

from __future__ import annotations

import json
import math
import os
import re

__all__ = ["write", "targets", "markdown", "scaling_fit"]

# Issue targets, on the reference machine (2 CPU threads).
TIME_TARGETS = {"mlp": 1.25, "cnn": 1.25, "lstm": 2.0, "transformer": 1.25}
MEMORY_TARGETS = {"mlp": 1.3, "transformer": 1.3}
# Memory "does not grow with parameters x batch": extra bytes per example below this share
# of one per-example gradient (4 bytes per float32 parameter).
PER_EXAMPLE_GRADIENT_SHARE = 0.1
LINEAR_R2 = 0.98

MODE_LABELS = {"non-private": "non-private", "dpoptim": "dpoptim", "opacus-hooks": "Opacus hooks",
               "opacus-ghost": "Opacus ghost"}
DEVICE_LABELS = {"cpu": "CPU", "cuda": "CUDA"}
PARAMETERS = {"mlp": 784 * 512 + 512 + 512 * 512 + 512 + 512 * 10 + 10}


# ---------------------------------------------------------------------------- analysis
def _ok(entry) -> bool:
    return isinstance(entry, dict) and entry.get("status") == "ok"


def memory_ratio(modes: dict, mode: str) -> float | None:
    base, this = modes.get("non-private"), modes.get(mode)
    if not (_ok(base) and _ok(this)) or base["extra_mib"] <= 0:
        return None
    return this["extra_mib"] / base["extra_mib"]


def _fit(xs, ys):
    """Least squares ``y = a + b x``; returns (a, b, R^2)."""
    n = len(xs)
    if n < 2:
        return float("nan"), float("nan"), float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx if sxx else float("nan")
    a = my - b * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - a - b * x) ** 2 for x, y in zip(xs, ys))
    return a, b, (1 - ss_res / ss_tot) if ss_tot else 1.0


def scaling_fit(scaling: dict) -> dict:
    """Per mode: step time and extra memory against batch size, with linear fits."""
    out = {}
    for mode in scaling.get("modes", []):
        rows = []
        for job in scaling.get("timing", []):
            entry = job["modes"].get(mode)
            mem = next((m for m in scaling.get("memory", [])
                        if m.get("mode") == mode and m.get("batch_size") == job["batch_size"]), None)
            rows.append({
                "batch": job["batch_size"],
                "ms": entry["median_ms"] if _ok(entry) else None,
                "ratio": entry.get("ratio") if _ok(entry) else None,
                "extra_mib": mem["extra_mib"] if _ok(mem) else None,
                "time_status": (entry or {}).get("status", "not run"),
                "memory_status": (mem or {}).get("status", "not run"),
            })
        timed = [(r["batch"], r["ms"]) for r in rows if r["ms"] is not None]
        sized = [(r["batch"], r["extra_mib"]) for r in rows if r["extra_mib"] is not None]
        a, b, r2 = _fit(*zip(*timed)) if len(timed) > 1 else (float("nan"),) * 3
        ma, mb, mr2 = _fit(*zip(*sized)) if len(sized) > 1 else (float("nan"),) * 3
        out[mode] = {"rows": rows, "time_intercept_ms": a, "time_per_example_ms": b, "time_r2": r2,
                     "memory_intercept_mib": ma, "memory_per_example_kib": mb * 1024, "memory_r2": mr2}
    return out


def targets(results: dict) -> list[dict]:
    """Every target of the issue with its measured value and whether it is met."""
    out = []
    timing = results.get("timing", {})
    for name, limit in TIME_TARGETS.items():
        entry = timing.get(name, {}).get("modes", {}).get("dpoptim")
        value = entry.get("ratio") if _ok(entry) else None
        out.append({"target": f"step time <= {limit}x non-private", "workload": name, "limit": limit,
                    "value": value, "met": None if value is None else value <= limit,
                    "note": None if value is not None else _failure(entry)})
    for name in TIME_TARGETS:
        modes = timing.get(name, {}).get("modes", {})
        ours = modes.get("dpoptim")
        peers = {m: modes[m] for m in ("opacus-hooks", "opacus-ghost") if _ok(modes.get(m))}
        if not _ok(ours) or not peers:
            note = "dpoptim " + _failure(ours) if not _ok(ours) else "no Opacus mode ran"
            out.append({"target": "faster than Opacus' best mode", "workload": name, "limit": None,
                        "value": None, "met": None, "note": note})
            continue
        best = min(peers, key=lambda m: peers[m]["median_ms"])
        speedup = peers[best]["median_ms"] / ours["median_ms"]
        out.append({"target": "faster than Opacus' best mode", "workload": name, "limit": 1.0,
                    "value": speedup, "met": speedup > 1.0, "note": f"best Opacus mode: {MODE_LABELS[best]}"})
    for name, limit in MEMORY_TARGETS.items():
        modes = results.get("memory", {}).get(name, {}).get("modes", {})
        value = memory_ratio(modes, "dpoptim")
        out.append({"target": f"extra memory <= {limit}x non-private", "workload": name, "limit": limit,
                    "value": value, "met": None if value is None else value <= limit,
                    "note": None if value is not None else _failure(modes.get("dpoptim"))})
    fits = scaling_fit(results.get("scaling", {}))
    ours = fits.get("dpoptim")
    if ours:
        r2 = ours["time_r2"]
        out.append({"target": f"step time linear in batch (R^2 >= {LINEAR_R2})", "workload": "mlp",
                    "limit": LINEAR_R2, "value": r2, "met": None if math.isnan(r2) else r2 >= LINEAR_R2,
                    "note": None})
        share = ours["memory_per_example_kib"] * 1024 / (4 * PARAMETERS["mlp"])
        out.append({"target": f"extra memory per example < {PER_EXAMPLE_GRADIENT_SHARE:g} x one "
                              "per-example gradient", "workload": "mlp", "limit": PER_EXAMPLE_GRADIENT_SHARE,
                    "value": share, "met": None if math.isnan(share) else share < PER_EXAMPLE_GRADIENT_SHARE,
                    "note": None})
    return out


def _failure(entry) -> str:
    if entry is None:
        return "not run"
    error = str(entry.get("error", ""))
    return f"{entry.get('status', 'failed')}: {error[:150] + '...' if len(error) > 150 else error}"


# ---------------------------------------------------------------------------- markdown
def _cell_time(entry) -> str:
    if not _ok(entry):
        return "skipped" if entry and entry.get("status") == "skipped" else "**failed**"
    ratio = entry.get("ratio")
    ms = f"{entry['median_ms']:.1f} ms"
    return ms if ratio is None else f"{ratio:.2f}x ({ms})"


def _cell_memory(modes, mode) -> str:
    entry = modes.get(mode)
    if not _ok(entry):
        return "skipped" if entry and entry.get("status") == "skipped" else "**failed**"
    ratio = memory_ratio(modes, mode)
    mib = f"{entry['extra_mib']:.1f} MiB"
    return mib if mode == "non-private" or ratio is None else f"{ratio:.2f}x ({mib})"


def _mark(met) -> str:
    return {True: "met", False: "**missed**", None: "n/a"}[met]


def _devices_in_order(devices: dict) -> list[str]:
    return [d for d in ("cpu", "cuda") if d in devices] + [d for d in devices if d not in ("cpu", "cuda")]


def markdown(doc: dict) -> str:
    devices = doc["devices"]
    order = _devices_in_order(devices)
    lines = ["# Benchmarks", ""]
    lines += ["Generated by the suite in `benchmarks/`; do not edit by hand. Reproduce with:", ""]
    for d in order:
        r = devices[d]
        lines.append(f"    {r['command']}    # {DEVICE_LABELS.get(d, d)}, {r['date']}, {r['runtime_s']:.0f} s")
    lines.append("")
    lines.append("(`pip install -e '.[bench]'` first for Opacus and matplotlib; both are optional.)")
    lines.append("")
    for d in order:
        r = devices[d]
        m = r["machine"]
        hw = m.get("gpu") or m["cpu"]
        load = r.get("load_average") or {}
        before = load.get("before")
        lines.append(
            f"- **{DEVICE_LABELS.get(d, d)}**: {hw}, {m['cores']} cores, {m['threads']} torch threads per "
            f"process, torch {m['torch']}, Opacus {m.get('opacus') or 'not installed'}, Python {m['python']}"
            + (f"; load average {before[0]:.1f} at the start, {load['after'][0]:.1f} at the end" if before else "")
            + (" — **quick mode: too few steps to quote**" if r.get("quick") else "")
        )
    if "cuda" not in devices:
        lines.append("- **CUDA**: not measured — this machine has no GPU. `python -m benchmarks --device cuda` "
                     "adds CUDA rows beside the CPU ones (that path is written but has not been run).")
    lines.append("")

    # ---- step time
    lines += ["## Step time", "",
              "Median step time (zero_grad, forward, loss, backward, optimizer step) as a ratio to non-private "
              "`torch.optim.SGD` on the same model and batches, lower is better. All modes of a workload run "
              "in one process and take turns step by step; the ratio is the median over rounds of "
              "(mode's step / non-private step of the same round). Warm-up excluded (dpoptim's first step, "
              "which checks every rule against autograd, is shown separately).", ""]
    header = "| workload | device | batch | non-private | " + " | ".join(MODE_LABELS[m] for m in _modes(devices)[1:]) \
        + " | dpoptim first step | target |"
    lines += [header, "|" + " --- |" * (header.count("|") - 1)]
    for name in _workloads(devices, "timing"):
        for d in order:
            t = devices[d].get("timing", {}).get(name)
            if t is None:
                continue
            modes = t["modes"]
            np_ = modes.get("non-private")
            cells = [f"{np_['median_ms']:.1f} ms" if _ok(np_) else "**failed**"]
            cells += [_cell_time(modes.get(m)) for m in _modes(devices)[1:]]
            ours = modes.get("dpoptim")
            cells.append(f"{ours['first_step_ms']:.0f} ms" if _ok(ours) else "")
            cells.append(f"<= {TIME_TARGETS[name]}x" if name in TIME_TARGETS else "")
            lines.append(f"| {_title(devices, name)} | {DEVICE_LABELS.get(d, d)} | {t['batch_size']} | " + " | ".join(cells) + " |")
    lines.append("")

    # ---- memory
    if any("memory" in devices[d] for d in order):
        lines += ["## Memory", "",
                  "Extra memory of a training step: peak minus what is resident once model, data and optimizer "
                  "exist (CPU: `VmHWM` vs `VmRSS`; CUDA: `max_memory_allocated` vs `memory_allocated`), each "
                  "mode in its own process, after a throw-away run of the same shapes so that one-off library "
                  "initialisation is not charged to the step. Ratios are to non-private's extra memory.", ""]
        header = "| workload | device | batch | non-private | " + " | ".join(MODE_LABELS[m] for m in _modes(devices)[1:]) \
            + " | dpoptim first step | target |"
        lines += [header, "|" + " --- |" * (header.count("|") - 1)]
        for name in _workloads(devices, "memory"):
            for d in order:
                mem = devices[d].get("memory", {}).get(name)
                if mem is None:
                    continue
                modes = mem["modes"]
                cells = [_cell_memory(modes, m) for m in _modes(devices)]
                ours = modes.get("dpoptim")
                cells.append(f"{ours['first_step_extra_mib']:.1f} MiB" if _ok(ours) else "")
                cells.append(f"<= {MEMORY_TARGETS[name]}x" if name in MEMORY_TARGETS else "")
                lines.append(f"| {_title(devices, name)} | {DEVICE_LABELS.get(d, d)} | {mem['batch_size']} | " + " | ".join(cells) + " |")
        lines.append("")

    # ---- targets
    lines += ["## Targets", ""]
    for d in order:
        lines += [f"{DEVICE_LABELS.get(d, d)} (the targets were set for 2 CPU threads):", "",
                  "| target | workload | measured | |", "| --- | --- | --- | --- |"]
        for t in targets(devices[d]):
            value = "" if t["value"] is None else (f"{t['value']:.3f}" if "R^2" in t["target"] or "share" in t["target"]
                                                    or "per example" in t["target"] else f"{t['value']:.2f}x")
            if t["target"].startswith("faster") and t["value"] is not None:
                value = f"{t['value']:.2f}x faster"
            note = f" ({_escape(t['note'])})" if t.get("note") else ""
            lines.append(f"| {t['target']} | {t['workload']} | {value}{note} | {_mark(t['met'])} |")
        lines.append("")

    # ---- scaling
    for d in order:
        scaling = devices[d].get("scaling")
        if not scaling:
            continue
        fits = scaling_fit(scaling)
        lines += [f"## Scaling ({DEVICE_LABELS.get(d, d)}): MLP, batch {scaling['batches'][0]} to {scaling['batches'][-1]}", "",
                  "Step time (median, ms; every batch size and mode of this section in one process, taking "
                  "turns round by round, so that the machine's load reaches all alike) and extra memory (MiB) "
                  "per batch size, with least-squares lines "
                  "`time = a + b n` and `memory = a + b n`. One per-example gradient of this MLP is "
                  f"{4 * PARAMETERS['mlp'] / 1024:.0f} KiB: memory that grew with parameters x batch would "
                  "have a slope of that size.", ""]
        modes = scaling["modes"]
        lines.append("| batch | " + " | ".join(f"{MODE_LABELS[m]} ms | {MODE_LABELS[m]} MiB" for m in modes) + " |")
        lines.append("|" + " --- |" * (1 + 2 * len(modes)))
        for i, b in enumerate(scaling["batches"]):
            cells = []
            for m in modes:
                row = fits[m]["rows"][i] if i < len(fits[m]["rows"]) else {}
                cells.append(row.get("time_status", "not run") if row.get("ms") is None else f"{row['ms']:.1f}")
                cells.append(row.get("memory_status", "not run") if row.get("extra_mib") is None
                             else f"{row['extra_mib']:.1f}")
            lines.append(f"| {b} | " + " | ".join(cells) + " |")
        lines.append("")
        lines += ["| mode | ms per example | time R^2 | KiB per example | share of one per-example gradient |",
                  "| --- | --- | --- | --- | --- |"]
        for m in modes:
            f = fits[m]
            if all(r["ms"] is None and r["extra_mib"] is None for r in f["rows"]):
                continue
            lines.append(f"| {MODE_LABELS[m]} | {f['time_per_example_ms']:.3f} | {f['time_r2']:.3f} | "
                         f"{f['memory_per_example_kib']:.1f} | "
                         f"{f['memory_per_example_kib'] * 1024 / (4 * PARAMETERS['mlp']):.4f} |")
        lines.append("")

    # ---- plot
    lines += ["## Plot", ""]
    note = doc.get("plot_note")
    lines += [note if note else "![step time, memory and scaling](benchmarks.png)", ""]

    # ---- profiles
    for d in order:
        profiles = devices[d].get("profile")
        if profiles:
            lines += _profile_section(profiles, DEVICE_LABELS.get(d, d))

    # ---- failures
    failures = []
    for d in order:
        r = devices[d]
        for section in ("timing", "memory"):
            for name, entry in r.get(section, {}).items():
                for mode, e in entry.get("modes", {}).items():
                    if e.get("status") in ("failed", "skipped"):
                        failures.append(f"| {DEVICE_LABELS.get(d, d)} | {section} | {name} | {MODE_LABELS.get(mode, mode)} "
                                        f"| {e['status']}: {_escape(e.get('error', ''))} |")
    if failures:
        lines += ["## Failed and skipped modes", "", "| device | section | workload | mode | first line of the error |",
                  "| --- | --- | --- | --- | --- |", *failures, ""]

    lines += ["## Method", "",
              "- Workloads (`benchmarks/workloads.py`): " + "; ".join(
                  f"{_title(devices, n)} at batch {devices[order[0]]['timing'][n]['batch_size']}"
                  for n in _workloads(devices, "timing")) + ". Synthetic data, cross-entropy loss, SGD with lr 0.05, "
              "4 fixed batches in rotation; DP modes use noise multiplier 1.0 and clipping bound 1.0.",
              "- Modes: non-private `torch.optim.SGD`; `dpoptim.DPSGD`; Opacus `PrivacyEngine` with "
              "`grad_sample_mode='hooks'` and `'ghost'` (`ModuleValidator.fix` swaps in DPLSTM and "
              "DPMultiheadAttention for Opacus only). Transformer dropout is 0 for every mode.",
              "- dpoptim's engine uses process-wide module hooks until its first step has been checked, then "
              "hooks only its own model's modules; while another mode of the same process steps, any "
              "process-wide ones are paused, so no mode pays for another's hooks (the profile section measures "
              "what is left, the hook tax).",
              "- Each process pins torch to the stated number of threads (`torch.set_num_threads`, "
              "`OMP_NUM_THREADS`). On a shared machine, compare ratios, not milliseconds.",
              ""]
    return "\n".join(lines)


def _profile_section(profiles: dict, device_label: str) -> list[str]:
    from .profiling import PARTS

    lines = [f"## Profile ({device_label}): where dpoptim's time goes", "",
             "`torch.profiler` over several steady-state steps of each mode (profiler overhead included, "
             "so milliseconds are higher than in the step-time table). dpoptim's parts are labelled by "
             "wrapping its functions with `record_function` in the profiling process only.", ""]
    for name, p in profiles.items():
        if "error" in p and "non-private" not in p:
            lines += [f"### {name}", "", f"profile failed: {_escape(p['error'])}", ""]
            continue
        lines += [f"### {name} (batch {p['batch_size']})", ""]
        tax = p.get("hook_tax", {})
        if "ratio" in tax:
            lines += [f"Hook tax: a non-private step of this model takes {tax['ratio']:.3f}x as long while a "
                      f"dpoptim optimizer (of another model) exists in the process "
                      f"({tax['ms_per_step']:+.2f} ms per step, {tax['module_calls']} modules).", ""]
        dp = p.get("dpoptim", {})
        if "error" in dp:
            lines += [f"dpoptim step failed: {_escape(dp['error'])}", ""]
        np_ms = p["non-private"]["step_ms"]
        if "parts_ms" in dp:
            first = p.get("first_step", {})
            lines += [f"Profiled step: non-private {np_ms:.1f} ms, dpoptim {dp['step_ms']:.1f} ms "
                      f"(first step {first.get('step_ms', float('nan')):.1f} ms).", "",
                      "| dpoptim part | ms per step | first step, ms | what |", "| --- | --- | --- | --- |"]
            for label, what in PARTS:
                lines.append(f"| {label} | {dp['parts_ms'].get(label, 0):.2f} | "
                             f"{first.get('parts_ms', {}).get(label, 0):.2f} | {what} |")
            lines.append("")
        lines += ["| non-private op | ms/step | calls | dpoptim op | ms/step | calls |", "| --- | --- | --- | --- | --- | --- |"]
        a, b = p["non-private"]["top_ops"], dp.get("top_ops", [])
        for i in range(max(len(a), len(b))):
            left = f"`{a[i]['op']}` | {a[i]['self_ms']:.2f} | {a[i]['calls']:.0f}" if i < len(a) else " | | "
            right = f"`{b[i]['op']}` | {b[i]['self_ms']:.2f} | {b[i]['calls']:.0f}" if i < len(b) else " | | "
            lines.append(f"| {left} | {right} |")
        lines.append("")
    return lines


def _escape(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def _modes(devices) -> list[str]:
    from .workloads import MODES

    return list(MODES)


def _workloads(devices, section) -> list[str]:
    from .workloads import WORKLOADS

    present = {n for r in devices.values() for n in r.get(section, {})}
    return [n for n in WORKLOADS if n in present]


def _title(devices, name) -> str:
    from .workloads import WORKLOADS

    return WORKLOADS[name].title if name in WORKLOADS else name


# ---------------------------------------------------------------------------- plot
def plot(doc: dict, path: str) -> str | None:
    """Write the PNG; return a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "(plot skipped: matplotlib is not installed; `pip install -e '.[bench]'`)"
    from .workloads import MODES

    devices = doc["devices"]
    order = _devices_in_order(devices)
    fig, axes = plt.subplots(2, 2, figsize=(12, 8.5))
    colors = {"non-private": "#999999", "dpoptim": "#1f77b4", "opacus-hooks": "#d62728", "opacus-ghost": "#ff7f0e"}
    hatches = {"cpu": "", "cuda": "//"}

    ax = axes[0][0]
    names = _workloads(devices, "timing")
    width = 0.8 / max(1, (len(MODES) - 1) * len(order))
    for j, (d, mode) in enumerate((d, m) for d in order for m in MODES[1:]):
        ys = []
        for name in names:
            e = devices[d].get("timing", {}).get(name, {}).get("modes", {}).get(mode)
            ys.append(e["ratio"] if _ok(e) and "ratio" in e else 0)
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(names))]
        ax.bar(xs, ys, width, color=colors[mode], hatch=hatches.get(d, ""),
               label=f"{MODE_LABELS[mode]} ({DEVICE_LABELS.get(d, d)})")
    for i, name in enumerate(names):
        if name in TIME_TARGETS:
            ax.hlines(TIME_TARGETS[name], i - 0.45, i + 0.45, colors="black", linestyles="dashed")
    ax.axhline(1, color="#999999", lw=0.8)
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("step time / non-private (log)")
    ax.set_title("Step time (dashed: target; missing bar: failed)")
    ax.legend(fontsize=7)

    ax = axes[0][1]
    names = _workloads(devices, "memory")
    width = 0.8 / max(1, len(MODES) * len(order))
    for j, (d, mode) in enumerate((d, m) for d in order for m in MODES):
        ys = []
        for name in names:
            e = devices[d].get("memory", {}).get(name, {}).get("modes", {}).get(mode)
            ys.append(e["extra_mib"] if _ok(e) else 0)
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(names))]
        ax.bar(xs, ys, width, color=colors[mode], hatch=hatches.get(d, ""),
               label=f"{MODE_LABELS[mode]} ({DEVICE_LABELS.get(d, d)})")
    ax.set_yscale("log")
    ax.set_xticks(range(len(names)), [f"{n} (batch {devices[order[0]].get('memory', {}).get(n, {}).get('batch_size', '?')})"
                                      for n in names])
    ax.set_ylabel("extra memory, MiB (log)")
    ax.set_title("Extra memory of a step")
    ax.legend(fontsize=7)

    for d in order[:1]:
        fits = scaling_fit(devices[d].get("scaling", {}))
        for mode, f in fits.items():
            rows = [r for r in f["rows"] if r["ms"] is not None]
            axes[1][0].plot([r["batch"] for r in rows], [r["ms"] for r in rows], "o-", color=colors[mode],
                            label=MODE_LABELS[mode])
            rows = [r for r in f["rows"] if r["extra_mib"] is not None]
            axes[1][1].plot([r["batch"] for r in rows], [r["extra_mib"] for r in rows], "o-", color=colors[mode],
                            label=MODE_LABELS[mode])
        if fits:
            batches = devices[d]["scaling"]["batches"]
            axes[1][1].plot(batches, [b * 4 * PARAMETERS["mlp"] / 2**20 for b in batches], ":", color="black",
                            label="batch x one per-example gradient")
    for ax, what in ((axes[1][0], "step time, ms"), (axes[1][1], "extra memory, MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel(what)
        ax.legend(fontsize=7)
    axes[1][0].set_title(f"Scaling, MLP ({DEVICE_LABELS.get(order[0], order[0])})")
    axes[1][1].set_title(f"Scaling, MLP ({DEVICE_LABELS.get(order[0], order[0])})")
    fig.suptitle("dpoptim benchmarks (" + ", ".join(DEVICE_LABELS.get(d, d) for d in order) + ")")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ---------------------------------------------------------------------------- files
def write(results: dict, out: str, device: str = "cpu") -> list[str]:
    """Merge ``results`` into ``out/benchmarks.json`` under ``device`` and rewrite the
    Markdown and the plot from everything in it. Returns the paths written."""
    json_path = os.path.join(out, "benchmarks.json")
    doc = {"devices": {}}
    if os.path.exists(json_path):
        try:
            with open(json_path) as f:
                doc = json.load(f)
        except (OSError, ValueError):
            doc = {"devices": {}}
    doc.setdefault("devices", {})[device] = results
    # A quick run never sits beside a full one: their numbers are not comparable.
    doc["devices"] = {d: r for d, r in doc["devices"].items() if r.get("quick") == results.get("quick")}
    for d, r in doc["devices"].items():
        r["targets"] = targets(r)
    png_path = os.path.join(out, "benchmarks.png")
    doc["plot_note"] = plot(doc, png_path)
    md_path = os.path.join(out, "benchmarks.md")
    kept = _kept_sections(md_path)
    with open(json_path, "w") as f:
        json.dump(_clean(doc), f, indent=1)
        f.write("\n")
    with open(md_path, "w") as f:
        f.write(markdown(doc))
        f.write("\n")
        f.write(kept)
    return [md_path, json_path] + ([] if doc["plot_note"] else [png_path])


def write_section(md_path: str, section: str) -> None:
    """Put ``section`` (which starts with ``<!-- NAME:start -->`` and ends with
    ``<!-- NAME:end -->``) into ``md_path`` in place of the old one, or at its end."""
    start, end = section.split("\n", 1)[0], section.rstrip().rsplit("\n", 1)[-1]
    with open(md_path) as f:
        text = f.read()
    if start in text:
        text = text[: text.index(start)] + section + text[text.index(end) + len(end):]
    else:
        text = text.rstrip() + "\n\n" + section + "\n"
    with open(md_path, "w") as f:
        f.write(text)


def _kept_sections(md_path: str) -> str:
    """The sections other scripts write into ``benchmarks.md`` between ``<!-- NAME:start -->``
    and ``<!-- NAME:end -->`` (the real-model table of ``benchmarks.bench_models``): kept
    when the suite rewrites the rest."""
    if not os.path.exists(md_path):
        return ""
    with open(md_path) as f:
        text = f.read()
    found = re.findall(r"\n(<!-- (\w+):start -->.*?<!-- \2:end -->\n)", text, flags=re.S)
    return "".join("\n" + block for block, _ in found)


def _clean(value):
    """Strict JSON: NaN and infinities become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value
