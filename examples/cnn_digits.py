"""A small CNN with GroupNorm, trained with DP-SGD on the 8x8 digits shipped with dpoptim.

Shows the whole recipe for an image model:

* batches drawn by Poisson sampling (``dpoptim.data.poisson_loader``), the sampling the
  accountant assumes, and the optimizer's accounting arguments taken from the loader;
* GroupNorm instead of BatchNorm (batch statistics mix examples; ``replace_batchnorm``
  does the swap for an existing model);
* the noise calibrated to a target epsilon over the planned number of steps, and the
  privacy spent read back after training.

    python examples/cnn_digits.py            # about 96% test accuracy at epsilon 4, under a minute
    python examples/cnn_digits.py --quick    # a few seconds: a smoke test
"""

import argparse
import time

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

import dpoptim
from dpoptim.data import poisson_loader, privacy_kwargs
from dpoptim.datasets import load_digits, train_test_split


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, kernel_size=3, padding=1),      # 16 x 8 x 8
        nn.GroupNorm(4, 16),
        nn.ReLU(),
        nn.Conv2d(16, 32, kernel_size=3, padding=1, stride=2),  # 32 x 4 x 4
        nn.GroupNorm(8, 32),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(32 * 4 * 4, 10),
    )


@torch.no_grad()
def accuracy(model, X, y) -> float:
    model.eval()
    correct = (model(X).argmax(1) == y).float().mean().item()
    model.train()
    return correct


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two epochs: a smoke test")
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=256, help="expected batch size")
    parser.add_argument("--lr", type=float, default=0.25)
    parser.add_argument("--max-grad-norm", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights")
    args = parser.parse_args()
    epochs = 2 if args.quick else args.epochs

    torch.manual_seed(args.seed)
    X_train, y_train, X_test, y_test = train_test_split(*load_digits(images=True))
    train_set = TensorDataset(X_train, y_train)

    # Every example joins each batch independently with probability q.
    loader = poisson_loader(train_set, sample_rate=args.batch_size / len(train_set))
    model = make_model()
    optimizer = dpoptim.DPSGD(
        model.parameters(),
        lr=args.lr,
        momentum=0.9,
        max_grad_norm=args.max_grad_norm,
        target_epsilon=args.epsilon,       # calibrate the noise multiplier ...
        steps=epochs * len(loader),        # ... for exactly the steps we will take
        **privacy_kwargs(loader),          # sample_rate, expected_batch_size, dataset_size
    )
    print(f"{len(train_set)} training images, q = {optimizer.sample_rate:.4f}, "
          f"noise multiplier {optimizer.noise_multiplier:.3f} for epsilon {args.epsilon:g}")

    start = time.perf_counter()
    for epoch in range(1, epochs + 1):
        for images, labels in loader:
            optimizer.zero_grad()
            F.cross_entropy(model(images), labels).backward()
            optimizer.step()
        epsilon, delta = optimizer.privacy_spent()
        print(f"epoch {epoch:2d}: test accuracy {accuracy(model, X_test, y_test):6.1%}, "
              f"epsilon {epsilon:.2f} (delta = {delta:g})")
    print(f"{optimizer.steps_taken} steps in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
