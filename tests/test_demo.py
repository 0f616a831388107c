"""The demo (``python -m dpoptim demo``): its output, and the claim it makes with its defaults."""

import argparse
import re

import pytest
import torch

from dpoptim import demo


def run_demo(capsys, *argv):
    parser = demo.add_arguments(argparse.ArgumentParser())
    code = demo.run(parser.parse_args(list(argv)))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def final_table(out):
    """The numbers of the closing table: accuracies (fractions), epsilon, step times (ms)."""
    accuracy = re.search(r"^test accuracy\s+([\d.]+)%\s+([\d.]+)%$", out, re.M)
    epsilon = re.search(r"^epsilon \(delta = 1e-5\)\s+infinite\s+([\d.]+)$", out, re.M)
    timing = re.search(r"^time per step \(median\)\s+([\d.]+) ms\s+([\d.]+) ms$", out, re.M)
    assert accuracy and epsilon and timing, f"the final table is missing or malformed:\n{out}"
    return {
        "accuracy": (float(accuracy.group(1)) / 100, float(accuracy.group(2)) / 100),
        "epsilon": float(epsilon.group(1)),
        "ms_per_step": (float(timing.group(1)), float(timing.group(2))),
    }


def epoch_lines(out):
    return re.findall(r"^\s*(\d+)\s+[\d.]+\s+[\d.]+%\s+[\d.]+\s+[\d.]+%\s+([\d.]+)$", out, re.M)


def test_short_run_prints_progress_and_the_table(capsys):
    threads, rng = torch.get_num_threads(), torch.get_rng_state()
    code, out, err = run_demo(capsys, "--epochs", "2", "--epsilon", "2", "--seed", "3")
    assert code == 0, err
    assert torch.get_num_threads() == threads  # the demo restores what it changes
    assert torch.equal(torch.get_rng_state(), rng)
    lines = epoch_lines(out)
    assert [int(epoch) for epoch, _ in lines] == [1, 2]
    epsilons = [float(eps) for _, eps in lines]
    assert 0 < epsilons[0] < epsilons[1]
    table = final_table(out)
    assert table["epsilon"] == pytest.approx(epsilons[-1], abs=0.006)
    assert 1.9 <= table["epsilon"] <= 2.0 + 1e-6  # calibrated to the target, never above it
    assert all(0 <= a <= 1 for a in table["accuracy"])
    assert all(ms > 0 for ms in table["ms_per_step"])
    assert "noise multiplier" in out


def test_defaults_reach_90_percent_within_epsilon_8(capsys):
    """The claim in the demo's help and in the docs, with the real defaults."""
    code, out, err = run_demo(capsys)
    assert code == 0, err
    table = final_table(out)
    private, nonprivate = table["accuracy"][1], table["accuracy"][0]
    assert private >= 0.90, out
    assert nonprivate >= 0.93, out
    assert table["epsilon"] <= 8
    assert len(epoch_lines(out)) == demo.add_arguments(argparse.ArgumentParser()).parse_args([]).epochs


def test_same_seed_same_result(capsys):
    first = final_table(run_demo(capsys, "--epochs", "1", "--seed", "5")[1])
    second = final_table(run_demo(capsys, "--epochs", "1", "--seed", "5")[1])
    assert first["accuracy"] == second["accuracy"]
    assert first["epsilon"] == second["epsilon"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--epochs", "0"], "--epochs"),
        (["--epsilon", "-1"], "--epsilon"),
        (["--batch-size", "0"], "--batch-size"),
        (["--lr", "nan"], "--lr"),
        (["--max-grad-norm", "0"], "--max-grad-norm"),
    ],
)
def test_bad_options_are_refused(capsys, argv, message):
    code, out, err = run_demo(capsys, *argv)
    assert code == 2
    assert message in err and out == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is missing")
def test_cuda_without_a_gpu_is_a_clear_error(capsys):
    code, out, err = run_demo(capsys, "--cuda")
    assert code == 2
    assert "--cuda" in err and "CUDA" in err and out == ""
