"""torchvision's ResNet-18 (random weights) with GroupNorm, and with BatchNorm replaced by
dpoptim.replace_batchnorm, against the brute-force oracle. Skipped without torchvision."""

import pytest
import torch
from torch import nn

torchvision = pytest.importorskip("torchvision")

import dpoptim  # noqa: E402
from models_common import check_model, class_loss  # noqa: E402


def resnet18_groupnorm():
    return torchvision.models.resnet18(num_classes=3, norm_layer=lambda c: nn.GroupNorm(min(32, c // 2), c))


def resnet18_replaced():
    return dpoptim.replace_batchnorm(torchvision.models.resnet18(num_classes=3))


@pytest.mark.parametrize("make", [resnet18_groupnorm, resnet18_replaced], ids=["groupnorm", "replace_batchnorm"])
def test_resnet18_matches_oracle(make):
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    check_model(make, (x,), torch.tensor([0, 2]), lambda m, x: m(x), class_loss)
