"""Every script in examples/ runs to the end with --quick (in a subprocess, as a user would)."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch.distributed as dist

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"

SINGLE_PROCESS = ["cnn_digits.py", "lstm_text.py", "transformer.py", "custom_rule.py"]
DISTRIBUTED = ["ddp_torchrun.py"]
HELPERS = ["keyword_data.py"]  # imported by the sequence examples, not run


#: What a rendezvous that lost its port to another process says (the tests run side by
#: side, and a free port found by one may be taken before it is bound): worth one retry.
PORT_RACE = ("Address already in use", "EADDRINUSE", "DistNetworkError", "RendezvousConnectionError",
             "Connection refused", "Connection reset by peer")


def _run(command, timeout=240, retry_port_race=False):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    # Small models: one thread per process is faster than two fighting over the cores.
    env["OMP_NUM_THREADS"] = "1"
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if retry_port_race and result.returncode != 0 and any(sign in result.stderr for sign in PORT_RACE):
        result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, (
        f"{' '.join(command[1:])} exited with {result.returncode}\n"
        f"--- stdout ---\n{result.stdout[-4000:]}\n--- stderr ---\n{result.stderr[-4000:]}"
    )
    return result.stdout


def test_every_example_is_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(SINGLE_PROCESS + DISTRIBUTED + HELPERS)


@pytest.mark.parametrize("script", SINGLE_PROCESS)
def test_example_runs(script):
    out = _run([sys.executable, str(EXAMPLES / script), "--quick"])
    assert "epsilon" in out


@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed with gloo")
def test_ddp_example_runs_under_torchrun():
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               str(EXAMPLES / "ddp_torchrun.py"), "--quick"]
    out = _run(command, retry_port_race=True)
    assert "the 2 replicas hold identical weights" in out
    assert "epsilon" in out
