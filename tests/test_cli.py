"""The command line: both commands, text and JSON output, exit status 2 on bad input."""

import json
import os
import subprocess
import sys

import pytest

from dpoptim import cli
from dpoptim.accounting import calibrate_noise, epsilon

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EPSILON_ARGS = ["epsilon", "--noise-multiplier", "1.1", "--sample-rate", "0.004", "--steps", "10000", "--delta", "1e-5"]


def run_json(argv, capsys):
    assert cli.main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_epsilon_shows_both_accountants_side_by_side(capsys):
    assert cli.main(EPSILON_ARGS) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.strip().startswith(("pld", "rdp"))}
    assert set(rows) == {"pld", "rdp"}
    for name, shown in rows.items():
        assert float(shown) == pytest.approx(epsilon(1.1, 0.004, 10_000, 1e-5, accountant=name), rel=1e-5)
    assert "add/remove" in out and "10000" in out


def test_epsilon_json(capsys):
    doc = run_json(EPSILON_ARGS, capsys)
    assert doc["command"] == "epsilon" and doc["steps"] == 10_000 and doc["delta"] == 1e-5
    assert doc["epsilon"]["pld"] == epsilon(1.1, 0.004, 10_000, 1e-5)
    assert doc["epsilon"]["rdp"] == epsilon(1.1, 0.004, 10_000, 1e-5, accountant="rdp")
    assert doc["epsilon"]["pld"] < doc["epsilon"]["rdp"]


def test_single_accountant_and_infinite_epsilon_as_null(capsys):
    doc = run_json(["epsilon", "--noise-multiplier", "0", "--sample-rate", "0.1", "--steps", "5",
                    "--delta", "1e-5", "--accountant", "rdp"], capsys)
    assert doc["epsilon"] == {"rdp": None}


def test_noise_with_epochs(capsys):
    doc = run_json(["noise", "--target-epsilon", "3", "--delta", "1e-5", "--sample-rate", "0.004",
                    "--epochs", "3", "--accountant", "rdp"], capsys)
    assert doc["steps"] == 750  # 3 epochs of round(1 / 0.004) = 250 batches
    sigma = doc["noise_multiplier"]["rdp"]
    assert sigma == calibrate_noise(3, 1e-5, 0.004, 750, accountant="rdp")
    assert 2.97 <= doc["epsilon"]["rdp"] <= 3.0


def test_epochs_count_poisson_loader_epochs():
    args = cli.build_parser().parse_args(["noise", "--target-epsilon", "1", "--delta", "1e-5",
                                          "--sample-rate", "0.003", "--epochs", "2"])
    assert cli._steps(args) == 666  # 2 epochs of round(1 / 0.003) = 333 batches, as poisson_loader
    # a part of an epoch is a step more, never fewer: 2.5 epochs of 3 batches take 8 steps
    args = cli.build_parser().parse_args(["epsilon", "--noise-multiplier", "1", "--delta", "1e-5",
                                          "--sample-rate", "0.3", "--epochs", "2.5"])
    assert cli._steps(args) == 8


def test_noise_text_output_both_accountants(capsys):
    argv = ["noise", "--target-epsilon", "2", "--delta", "1e-5", "--sample-rate", "0.01", "--steps", "1000"]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip().startswith(("pld", "rdp"))}
    assert set(rows) == {"pld", "rdp"}
    assert float(rows["pld"][0]) < float(rows["rdp"][0])  # PLD needs less noise
    assert all(float(eps) <= 2.0 for _, eps in rows.values())


@pytest.mark.parametrize("argv, message", [
    (["epsilon", "--noise-multiplier", "-1", "--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5"],
     "argument --noise-multiplier: noise_multiplier must be >= 0"),
    (["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "10", "--delta", "0"],
     "argument --delta:"),
    (["noise", "--target-epsilon", "0", "--delta", "1e-5", "--sample-rate", "0.1", "--steps", "10"],
     "argument --target-epsilon:"),
    (["epsilon", "--noise-multiplier", "1", "--sample-rate", "0", "--steps", "10", "--delta", "1e-5"],
     "sample_rate"),
    (["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "-3", "--delta", "1e-5"], "steps"),
    (["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "10", "--delta", "2"], "delta"),
    (["noise", "--target-epsilon", "-1", "--delta", "1e-5", "--sample-rate", "0.1", "--steps", "10"],
     "target_epsilon"),
    (["noise", "--target-epsilon", "1", "--delta", "1e-5", "--sample-rate", "0", "--epochs", "1"], "sample_rate"),
    (["noise", "--target-epsilon", "1", "--delta", "1e-5", "--sample-rate", "0.1", "--epochs", "-1"], "epochs"),
])
def test_library_errors_exit_2_with_a_message(argv, message, capsys):
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""


@pytest.mark.parametrize("argv", [
    [],
    ["bogus"],
    ["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.1", "--delta", "1e-5"],  # no length
    ["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "10", "--epochs", "1", "--delta", "1e-5"],
    ["epsilon", "--noise-multiplier", "x", "--sample-rate", "0.1", "--steps", "10", "--delta", "1e-5"],
    ["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", "1.5", "--delta", "1e-5"],
    [*EPSILON_ARGS, "--accountant", "moments"],
])
def test_parser_errors_exit_2(argv, capsys):
    assert cli.main(argv) == 2
    assert "error" in capsys.readouterr().err


@pytest.mark.parametrize("text, steps", [("1e3", 1000), ("1000", 1000), ("1000.0", 1000), ("0", 0)])
def test_steps_accepts_what_the_library_accepts(text, steps, capsys):
    doc = run_json(["epsilon", "--noise-multiplier", "1.1", "--sample-rate", "0.004", "--steps", text,
                    "--delta", "1e-5", "--accountant", "rdp"], capsys)
    assert doc["steps"] == steps
    assert doc["epsilon"]["rdp"] == epsilon(1.1, 0.004, steps, 1e-5, accountant="rdp")


@pytest.mark.parametrize("text", ["1.5", "-3", "1e400", "nan", "ten"])
def test_bad_steps_name_the_flag(text, capsys):
    assert cli.main(["epsilon", "--noise-multiplier", "1", "--sample-rate", "0.1", "--steps", text,
                     "--delta", "1e-5"]) == 2
    assert "argument --steps:" in capsys.readouterr().err


def test_help_exits_0(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "epsilon" in out and "noise" in out


def test_a_command_is_one_registry_entry(monkeypatch, capsys):
    def add_arguments(parser):
        parser.add_argument("--name", default="world")

    def run(args):
        print(f"hello {args.name}")
        return 0

    monkeypatch.setitem(cli.COMMANDS, "hello", cli.Command("say hello", add_arguments, run))
    assert cli.main(["hello", "--name", "dp"]) == 0
    assert capsys.readouterr().out.strip() == "hello dp"


def test_python_dash_m_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "dpoptim", *EPSILON_ARGS, "--accountant", "rdp", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["epsilon"]["rdp"] == pytest.approx(epsilon(1.1, 0.004, 10_000, 1e-5, "rdp"))


def test_infinite_noise_is_accepted_and_costs_nothing_as_in_the_library(capsys):
    argv = ["epsilon", "--noise-multiplier", "inf", "--sample-rate", "0.01", "--steps", "1e3", "--delta", "1e-5"]
    doc = run_json(argv, capsys)
    assert doc["epsilon"] == {"pld": 0.0, "rdp": 0.0} == {
        name: epsilon(float("inf"), 0.01, 1000, 1e-5, accountant=name) for name in ("pld", "rdp")}
