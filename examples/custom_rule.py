"""Teaching dpoptim a layer of your own with ``@dpoptim.register_rule``.

``FeatureScale`` multiplies each feature by a learned scale and adds a learned shift:
``y = x * weight + bias`` over the last dimension. dpoptim has no rule for it, so training
with it would stop with an error naming the layer. A rule says what one example's
gradient is, given what the layer saw:

* ``use.saved``: what ``Rule.save`` kept at forward time (by default the positional
  inputs, here ``(x,)`` with ``x`` of shape ``[n, ..., d]``);
* ``use.grad_outputs[0]``: the gradient ``b`` of the loss with respect to the output,
  same shape as ``y`` (or ``None`` if no gradient reached it).

For example i, summing over every position r between the batch and feature dimensions:
``g_i(weight) = sum_r x[i, r] * b[i, r]`` and ``g_i(bias) = sum_r b[i, r]``, both of
shape ``[d]``. ``per_example`` returns them stacked, ``[n, d]``; dpoptim derives norms and
clipped sums from that. (Override ``norms`` and ``clipped_sum`` too when a cheaper route
exists, as the built-in Linear rule does.)

The script checks the rule against a brute-force per-example loop, then trains a small
model that uses the layer on the digits.

    python examples/custom_rule.py            # about 94% test accuracy at epsilon 4, seconds
    python examples/custom_rule.py --quick
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F

import dpoptim
from dpoptim.data import PoissonBatchSampler
from dpoptim.datasets import load_digits, train_test_split


class FeatureScale(nn.Module):
    """``y = x * weight + bias``, with ``weight`` and ``bias`` of shape ``[features]``."""

    def __init__(self, features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))
        self.bias = nn.Parameter(torch.zeros(features))

    def forward(self, x):
        return x * self.weight + self.bias


@dpoptim.register_rule(FeatureScale)
class FeatureScaleRule(dpoptim.Rule):
    def per_example(self, use, names):
        (x,) = use.saved
        b = use.grad_outputs[0]
        if b is None:
            b = torch.zeros_like(x)
        n, d = x.shape[0], x.shape[-1]
        grads = {}
        if "weight" in names:
            grads["weight"] = (x * b).reshape(n, -1, d).sum(1)
        if "bias" in names:
            grads["bias"] = b.reshape(n, -1, d).sum(1)
        return grads


def check_rule_against_loop() -> None:
    """The rule's per-example gradients equal those of a loop over single examples."""
    torch.manual_seed(0)
    layer = FeatureScale(5).double()
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()
    x = torch.randn(4, 3, 5, dtype=torch.float64)  # 4 examples, 3 positions each
    target = torch.randn(4, 3, 5, dtype=torch.float64)

    def loss_of(y, t):
        return (y - t).square().sum()

    # What the rule computes from the layer's input and its output gradient.
    y = layer(x)
    (b,) = torch.autograd.grad(loss_of(y, target), y)
    rule = dpoptim.rule_for(layer)
    fast = rule.per_example(dpoptim.Use(layer, (x,), [b]), ["weight", "bias"])

    # Brute force: one backward per example.
    for i in range(len(x)):
        slow = torch.autograd.grad(loss_of(layer(x[i : i + 1]), target[i : i + 1]), [layer.weight, layer.bias])
        torch.testing.assert_close(fast["weight"][i], slow[0])
        torch.testing.assert_close(fast["bias"][i], slow[1])
    print("FeatureScaleRule matches the per-example loop")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="two epochs: a smoke test")
    parser.add_argument("--epsilon", type=float, default=4.0)
    parser.add_argument("--epochs", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0, help="seeds the initial weights")
    args = parser.parse_args()
    epochs = 2 if args.quick else args.epochs

    check_rule_against_loop()

    X_train, y_train, X_test, y_test = train_test_split(*load_digits())
    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(64, 32), FeatureScale(32), nn.Tanh(), nn.Linear(32, 10))

    # Poisson batches over tensors held in memory: index them directly.
    batches = PoissonBatchSampler(len(y_train), sample_rate=256 / len(y_train))
    optimizer = dpoptim.DPSGD(
        model.parameters(),
        lr=2.0,
        max_grad_norm=1.0,
        target_epsilon=args.epsilon,
        steps=epochs * len(batches),
        sample_rate=batches.sample_rate,
        expected_batch_size=batches.expected_batch_size,
        dataset_size=len(y_train),
    )
    for epoch in range(1, epochs + 1):
        for indices in batches:
            optimizer.zero_grad()
            F.cross_entropy(model(X_train[indices]), y_train[indices]).backward()
            optimizer.step()
    with torch.no_grad():
        accuracy = (model(X_test).argmax(1) == y_test).float().mean().item()
    epsilon, delta = optimizer.privacy_spent()
    print(f"after {epochs} epochs: test accuracy {accuracy:.1%} at epsilon {epsilon:.2f} (delta = {delta:g})")


if __name__ == "__main__":
    main()
