"""The benchmark suite runs and writes its outputs (a smoke test: no timing assertions)."""

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from benchmarks import report, timing
from benchmarks.workloads import MODES, WORKLOADS, Workload, _images

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_mode_writes_table_json_and_plot(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    doc = json.loads((tmp_path / "benchmarks.json").read_text())
    cpu = doc["devices"]["cpu"]
    assert cpu["quick"] and set(cpu["timing"]) == set(WORKLOADS)
    for workload in cpu["timing"].values():
        assert set(workload["modes"]) == set(MODES)
        for entry in workload["modes"].values():
            assert entry["status"] in ("ok", "failed", "skipped")
            assert entry["status"] == "ok" or entry["error"]
    mlp = cpu["timing"]["mlp"]["modes"]
    assert mlp["non-private"]["status"] == "ok" and mlp["dpoptim"]["status"] == "ok"
    assert mlp["dpoptim"]["ratio"] > 0 and mlp["dpoptim"]["first_step_ms"] > 0
    assert cpu["memory"]["mlp"]["modes"]["dpoptim"]["extra_mib"] >= 0
    assert [job["batch_size"] for job in cpu["scaling"]["timing"]] == cpu["scaling"]["batches"]
    assert "parts_ms" in cpu["profile"]["mlp"]["dpoptim"]
    assert cpu["targets"]

    md = (tmp_path / "benchmarks.md").read_text()
    assert "python -m benchmarks --quick" in md
    for section in ("## Step time", "## Memory", "## Targets", "## Scaling", "## Profile"):
        assert section in md
    assert (tmp_path / "benchmarks.png").exists() or "matplotlib is not installed" in md


def test_a_mode_that_fails_is_reported_not_raised():
    # nn.Bilinear has no dpoptim rule: dpoptim's first step raises, the others time normally.
    def model():
        return nn.Sequential(nn.Flatten(), nn.Linear(4, 3), nn.Unflatten(1, (3,)), BilinearHead())

    workload = Workload("bilinear", "Bilinear", model, _images((4,)), 4, None, 4)
    result = timing.measure(workload, ["non-private", "dpoptim"], batch_size=4, warmup=0, rounds=2)
    assert result["modes"]["non-private"]["status"] == "ok"
    failed = result["modes"]["dpoptim"]
    assert failed["status"] == "failed" and "Bilinear" in failed["error"] and "\n" not in failed["error"]


class BilinearHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.bilinear = nn.Bilinear(3, 3, 10)

    def forward(self, x):
        return self.bilinear(x, x)


def test_report_marks_targets_and_failures(tmp_path):
    ok = lambda ms, ratio=None: {"status": "ok", "median_ms": ms, "first_step_ms": 2 * ms,  # noqa: E731
                                 **({"ratio": ratio} if ratio else {})}
    results = {
        "command": "python -m benchmarks", "quick": False, "date": "today", "runtime_s": 1.0,
        "machine": {"cpu": "test", "cores": 2, "threads": 2, "torch": torch.__version__, "python": "3"},
        "timing": {"mlp": {"batch_size": 256, "modes": {
            "non-private": ok(10.0), "dpoptim": ok(11.0, 1.1), "opacus-hooks": ok(30.0, 3.0),
            "opacus-ghost": {"status": "failed", "error": "RuntimeError: boom"}}}},
        "memory": {"mlp": {"batch_size": 1024, "modes": {
            "non-private": {"status": "ok", "extra_mib": 10.0},
            "dpoptim": {"status": "ok", "extra_mib": 20.0, "first_step_extra_mib": 25.0}}}},
    }
    paths = report.write(results, str(tmp_path))
    assert all(os.path.exists(p) for p in paths)
    by_target = {(t["target"], t["workload"]): t for t in json.loads((tmp_path / "benchmarks.json").read_text())
                 ["devices"]["cpu"]["targets"]}
    assert by_target[("step time <= 1.25x non-private", "mlp")]["met"] is True
    assert by_target[("extra memory <= 1.3x non-private", "mlp")]["met"] is False
    assert by_target[("faster than Opacus' best mode", "mlp")]["value"] == pytest.approx(30 / 11)
    md = (tmp_path / "benchmarks.md").read_text()
    assert "RuntimeError: boom" in md and "**missed**" in md


def test_distributed_benchmark_runs(tmp_path):
    """Two gloo processes, four modes, one round: a smoke run (no timing assertions)."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("needs gloo")
    out = tmp_path / "distributed.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.bench_distributed", "--rounds", "1", "--batch", "8", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["ms"]) == {"ddp non-private", "ddp dpoptim", "fsdp non-private", "fsdp dpoptim"}
    assert all(v > 0 for v in result["ratio"].values())
    assert "<!-- distributed:start -->" in proc.stdout and "FSDP2" in proc.stdout


def test_near_zero_draws_put_the_uses_of_an_example_near_delta():
    from benchmarks.bench_accounting import near_zero_draws

    draws = near_zero_draws(200, seed=7)
    assert draws == near_zero_draws(200, seed=7) and draws != near_zero_draws(200, seed=8)
    for target, delta, q, steps in draws:
        assert 1e-4 <= target <= 1e-2 and 1e-5 <= delta <= 0.1 and 1e-6 <= q <= 1e-2
        # q T / delta from 1 to 1000, but for rounding to whole steps (by a quarter at 2 steps)
        assert steps == 1 or 0.75 <= q * steps / delta <= 1250


def _accounting_bench(*args) -> str:
    """The output of ``python -m benchmarks.bench_accounting`` with ``args`` (which must succeed)."""
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_accounting", *args],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _rows_of_draw(output: str, draw: int) -> list:
    """The table rows of ``output`` for draw number ``draw``, split on ``|``."""
    return [line.split("|") for line in output.splitlines() if line.startswith(f"| {draw} |")]


def test_near_zero_survey_checks_each_answer_against_the_accountant():
    """Two calibrations of the survey (seed 3: the cheapest two), each answer in the band."""
    output = _accounting_bench("--survey", "2", "--seed", "3")
    rows = _rows_of_draw(output, 0) + _rows_of_draw(output, 1)
    assert len(rows) == 2 and all(-0.2 <= float(row[7].strip().rstrip("%")) <= 0.0 for row in rows)
    evaluations = [int(row[8]) for row in rows]
    assert all(count >= 1 for count in evaluations)  # the answer itself is one
    assert "2 calls:" in output and "0 outside the band" in output
    assert f"{sum(evaluations)} evaluations of the accountant" in output


def test_schedule_draws_move_sigma_and_q_geometrically_within_their_ranges():
    from benchmarks.bench_accounting import schedule_draws

    draws = schedule_draws(100, seed=5)
    assert draws == schedule_draws(100, seed=5) and draws != schedule_draws(100, seed=6)
    for runs, delta, lengths in draws:
        assert 8 <= len(runs) < 400 and 1e-12 <= delta <= 1e-3
        assert all(2 <= length < len(runs) for length in lengths)
        assert {count for _, _, count in runs} <= {1, 3, 100} and len({count for _, _, count in runs}) == 1
        for column, low, high in ((0, 10**-0.3, 10**0.5), (1, 1e-5, 0.1)):
            values = [run[column] for run in runs]
            assert all(low * (1 - 1e-12) <= v <= high * (1 + 1e-12) for v in values)
            ratios = [b / a for a, b in zip(values, values[1:])]
            assert max(ratios) - min(ratios) <= 1e-9 * max(ratios)  # one ratio from pair to pair


def test_append_survey_reports_the_accountants_epsilon_before_and_after_one_more_pair():
    """One schedule of the survey (seed 3: a cheap one), its first row checked here."""
    from benchmarks.bench_accounting import schedule_draws
    from dpoptim.accounting import epsilon_of_ledger

    output = _accounting_bench("--appends", "1", "--seed", "3")
    rows = _rows_of_draw(output, 0)
    assert len(rows) == 3 and "3 appends:" in output
    runs, delta, lengths = schedule_draws(1, seed=3)[0]
    length, before, after = int(rows[0][2]), float(rows[0][5]), float(rows[0][6])
    assert length == lengths[0]
    assert before == pytest.approx(epsilon_of_ledger(runs[:length], delta), rel=1e-5)
    assert after == pytest.approx(epsilon_of_ledger(runs[:length + 1], delta), rel=1e-5)


def test_sweep_points_lie_in_the_stated_range_and_move_up_on_each_axis():
    from benchmarks.bench_accounting import SWEEP_FACTORS, _swept, sweep_points

    points = sweep_points(200, seed=42)
    assert points == sweep_points(200, seed=42) and points != sweep_points(200, seed=43)
    for sigma, q, steps, delta in points:
        assert 1e-3 <= sigma <= 30.0 and 1e-6 <= q <= 1.0 and 1 <= steps <= 1e8 and 1e-12 <= delta <= 0.1
    point = (0.5, 0.999, 10, 0.0995)
    for axis in range(4):
        moved = [_swept(point, axis, factor) for factor in SWEEP_FACTORS]
        assert moved[0] == point and all(m[:axis] + m[axis + 1:] == point[:axis] + point[axis + 1:] for m in moved)
        assert all(a[axis] <= b[axis] for a, b in zip(moved, moved[1:]))
    assert [m[2] for m in (_swept(point, 2, factor) for factor in SWEEP_FACTORS)] == [10, 11, 12, 15, 20]
    assert _swept(point, 1, 1.02)[1] == 1.0 and _swept(point, 3, 1.02)[3] == pytest.approx(0.10149)


def test_long_run_survey_times_runs_of_10_to_the_8_steps_in_the_stated_range():
    """One run of the survey (seed 6: a quick one), its epsilon the accountant's."""
    from benchmarks.bench_accounting import long_run_points
    from dpoptim.accounting import epsilon_of_ledger

    points = long_run_points(200, seed=6)
    assert points == long_run_points(200, seed=6) and points != long_run_points(200, seed=7)
    assert all(1e-3 <= sigma <= 30.0 and 1e-6 <= q <= 1.0 and 1e-12 <= delta <= 0.1 for sigma, q, delta in points)
    output = _accounting_bench("--long", "1", "--seed", "6")
    rows = _rows_of_draw(output, 0)
    assert len(rows) == 1 and "1 run:" in output and "above 0.5 s" in output
    sigma, q, delta = points[0]
    assert float(rows[0][5]) == pytest.approx(epsilon_of_ledger([(sigma, q, 10**8)], delta), rel=1e-5)


def test_sweep_survey_reports_no_dip_on_its_first_point():
    """One point of the survey (seed 42: a cheap one), epsilon moved on every axis."""
    from benchmarks.bench_accounting import sweep_points
    from dpoptim.accounting import epsilon_of_ledger

    output = _accounting_bench("--sweeps", "1", "--seed", "42")
    rows = _rows_of_draw(output, 0)
    assert len(rows) == 1 and "1 point, 16 neighbours: 0 against the trend" in output
    sigma, q, steps, delta = sweep_points(1, seed=42)[0]
    assert int(rows[0][4].replace(",", "")) == steps and rows[0][7].strip() == "0"
    assert float(rows[0][6]) == pytest.approx(epsilon_of_ledger([(sigma, q, steps)], delta), rel=1e-5)


def test_audit_draws_cover_their_three_kinds_within_their_ranges():
    from benchmarks.bench_accounting import audit_draws

    draws = audit_draws(300, seed=5)
    assert draws == audit_draws(300, seed=5) and draws != audit_draws(300, seed=6)
    sizes = {len(runs) for runs, _ in draws}
    assert 1 in sizes and 11 in sizes and not sizes - set(range(1, 12))
    runs = [run for ledger, _ in draws for run in ledger]
    assert all(1e-3 <= sigma <= 100 and 1e-6 <= q <= 1 and 1 <= count <= 1e8 for sigma, q, count in runs)
    assert any(sigma < 0.2 and q < 1e-3 for sigma, q, _ in runs) and any(q == 1.0 for _, q, _ in runs)
    assert all(1e-12 <= delta <= 0.1 for _, delta in draws)


def test_audit_reports_the_lower_bound_beside_the_accountants_epsilon():
    """One ledger of the audit (seed 2: a cheap one), its row checked here."""
    from benchmarks.bench_accounting import audit_draws
    from dpoptim.accounting import epsilon_of_ledger

    output = _accounting_bench("--audit", "1", "--seed", "2")
    rows = _rows_of_draw(output, 0)
    assert len(rows) == 1 and "1 ledger: 0 with the lower bound above epsilon" in output
    runs, delta = audit_draws(1, seed=2)[0]
    upper, lower = float(rows[0][4]), float(rows[0][5])
    assert upper == pytest.approx(epsilon_of_ledger(runs, delta), rel=1e-5)
    assert 0.99 * upper <= lower <= upper


def test_budget_stop_rows_stop_at_the_same_step_either_way():
    """The schedule run to a small budget: as the stop asks by default and at every step,
    the same step refused, the first the accountant puts above the budget."""
    output = _accounting_bench("--budget-stop", "0.15")
    rows = [line.split("|") for line in output.splitlines() if line.startswith("| 0.15 |")]
    assert [row[2].strip() for row in rows] == ["spans at a worse setting", "every step"]
    assert rows[0][3:6] == rows[1][3:6]
    taken, at, beyond = int(rows[0][3].replace(",", "")), float(rows[0][4]), float(rows[0][5])
    assert taken > 8 and at <= 0.15 < beyond
