"""Data-parallel DP-SGD with ``DistributedDataParallel`` on CPU (the gloo backend).

    torchrun --nproc_per_node 2 examples/ddp_torchrun.py            # about 94% at epsilon 3, under a minute
    torchrun --nproc_per_node 2 examples/ddp_torchrun.py --quick    # a few seconds

What changes from one process:

* ``poisson_loader`` draws one global Poisson batch per step (the same on every rank: the
  ranks agree on the sampling seed) and hands each rank a disjoint share of it;
  ``sample_rate`` and ``expected_batch_size`` stay global, which is what the accountant
  and the divisor need.
* ``DPSGD(ddp_model.parameters(), ...)``: each rank clips its own examples, rank 0 alone
  adds the noise, and the clipped sums are added up over the ranks inside ``step()``, so
  the noise enters once and every replica takes the same step. DDP's own gradient
  all-reduce is not needed, so the backward runs under ``ddp_model.no_sync()``.

The script ends by checking that the replicas still hold identical weights, and leaves
with ``os._exit`` (see the note at its end).
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import dpoptim
from dpoptim.data import poisson_loader, privacy_kwargs
from dpoptim.datasets import load_digits, train_test_split


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two epochs: a smoke test")
    parser.add_argument("--epsilon", type=float, default=3.0)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=256, help="expected global batch size (all ranks)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        print("launch this script with torchrun, e.g.: torchrun --nproc_per_node 2 examples/ddp_torchrun.py",
              file=sys.stderr)
        return 2
    epochs = 2 if args.quick else args.epochs

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        X_train, y_train, X_test, y_test = train_test_split(*load_digits())
        train_set = TensorDataset(X_train, y_train)

        torch.manual_seed(args.seed)  # the same initial weights on every rank
        model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))
        ddp_model = nn.parallel.DistributedDataParallel(model)

        loader = poisson_loader(train_set, sample_rate=args.batch_size / len(train_set))
        optimizer = dpoptim.DPSGD(
            ddp_model.parameters(),
            lr=2.0,
            max_grad_norm=1.0,
            target_epsilon=args.epsilon,
            steps=epochs * len(loader),
            **privacy_kwargs(loader),
        )
        if rank == 0:
            print(f"{world} ranks, global expected batch {optimizer.expected_batch_size:g}, "
                  f"noise multiplier {optimizer.noise_multiplier:.3f} for epsilon {args.epsilon:g}")

        for epoch in range(1, epochs + 1):
            examples = 0
            for images, labels in loader:  # this rank's share of the global batch
                optimizer.zero_grad()
                # DDP's own all-reduce of the unclipped gradients would be overwritten in
                # step(), which all-reduces the clipped sums itself: skip it.
                with ddp_model.no_sync():
                    F.cross_entropy(ddp_model(images), labels).backward()
                optimizer.step()
                examples += len(labels)
            if rank == 0:
                with torch.no_grad():
                    accuracy = (model(X_test).argmax(1) == y_test).float().mean().item()
                epsilon, delta = optimizer.privacy_spent()
                print(f"epoch {epoch:2d}: rank 0 saw {examples} examples, test accuracy {accuracy:6.1%}, "
                      f"epsilon {epsilon:.2f} (delta = {delta:g})", flush=True)

        # Every rank applied the same noisy gradient, so the replicas agree exactly.
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        gathered = [torch.empty_like(weights) for _ in range(world)]
        dist.all_gather(gathered, weights)
        if not all(torch.equal(gathered[0], w) for w in gathered):
            raise RuntimeError("the replicas diverged")
        if rank == 0:
            print(f"the {world} replicas hold identical weights")
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    status = main()
    # Leave without tearing the interpreter down. DDP keeps the gloo group alive until
    # shutdown, and a gloo worker thread that is late in releasing the last collective's
    # tensors then needs the interpreter as it is being finalized: the process aborts
    # ("terminate called without an active exception") after all the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
