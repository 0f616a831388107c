"""Helpers shared by the optional test modules that build real models from their libraries
(tiny configurations, random weights) and judge them against the brute-force oracle."""

import torch
import torch.nn.functional as F

import dpoptim
from oracle import check_rule_case

# The bar: float64, relative error 1e-6 against the per-example loop.
RTOL = 1e-6


def token_mean_loss(logits, ids):
    """Next-token cross-entropy, each example's mean over its own tokens: ``[n]``."""
    losses = F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="none")
    return losses.view(ids.shape[0], -1).mean(1)


def class_loss(logits, labels):
    return F.cross_entropy(logits, labels, reduction="none")


def check_model(make, inputs, targets, forward, loss):
    """dpoptim's clipped sum (first and later step) against the oracle's, float64."""
    check_rule_case(lambda: make().double(), inputs, targets, forward, loss, rtol=RTOL)


def adam_steps(model, batch, forward, loss, steps=2):
    """A few noisy DPAdam steps on the unmodified model: they run and the loss stays finite."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = dpoptim.DPAdam(params, lr=1e-3, noise_multiplier=1.0, max_grad_norm=1.0,
                         expected_batch_size=len(batch[1]), sample_rate=0.01)
    for _ in range(steps):
        opt.zero_grad()
        value = loss(forward(model, *batch[0]), batch[1]).mean()
        value.backward()
        opt.step()
    assert torch.isfinite(value)
    assert opt.privacy_spent().epsilon > 0


def run_recipe(name):
    """Run the block of docs/recipes.md that starts with ``# recipe: name``, after the
    blocks that define the helpers it uses (the untagged ones)."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "recipes.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    helpers = [b for b in blocks if not b.startswith("# recipe:")]
    (chosen,) = [b for b in blocks if b.startswith(f"# recipe: {name} ")]
    namespace = {"__name__": "__recipe__"}
    for source in helpers + [chosen]:
        exec(compile(source, f"docs/recipes.md ({name})", "exec"), namespace)  # noqa: S102
    return namespace
