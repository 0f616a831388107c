"""The torchrun scripts of docs/training.md ("More than one device") run as written: each
is executed in 2 gloo processes with the environment torchrun would give them."""

import os
import pathlib
import re
import sys

import pytest
import torch
import torch.distributed as dist

from ranks import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")

ROOT = pathlib.Path(__file__).resolve().parent.parent
WORLD = 2


def script(marker: str) -> str:
    """The python block of docs/training.md that defines main() and contains ``marker``."""
    text = (ROOT / "docs" / "training.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, flags=re.S) if "def main():" in b and marker in b]
    assert len(blocks) == 1, f"expected one torchrun script using {marker} in docs/training.md"
    return blocks[0]


def _worker(rank, port, source, out):
    """What torchrun gives each process: its environment; the script makes the group."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    namespace = {"__name__": "__torchrun_example__"}
    exec(compile(source, "docs/training.md", "exec"), namespace)  # noqa: S102 - our own documentation
    # The script ends with destroy_process_group() while its DDP model, whose reducer holds
    # the group, is still alive; freeing that reducer then tears the gloo group down from a
    # destructor, which can wait forever for a peer that has already exited. The group is
    # left to the process's end instead, and the process ends without running destructors.
    dist.destroy_process_group = lambda *args, **kwargs: None
    namespace["main"]()
    (pathlib.Path(out) / f"done{rank}").write_text("ok")
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.parametrize("marker,reported", [
    ("DistributedDataParallel(", r"^(\d+) \(\(1\.0, 0\.032, \1\),\)$"),  # steps, the ledger
    ("fully_shard(", r"^(\d+) PrivacySpent\(epsilon=\d"),
])
def test_torchrun_script_runs(marker, reported, tmp_path, capfd):
    run_ranks(_worker, (script(marker), str(tmp_path)), WORLD)
    assert all((tmp_path / f"done{r}").exists() for r in range(WORLD))
    printed = capfd.readouterr().out
    assert re.search(reported, printed, flags=re.M), printed  # rank 0, once, after all the steps
    assert int(re.search(reported, printed, flags=re.M).group(1)) > 10
