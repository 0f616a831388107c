"""timm vision models, smallest variants shrunk further, random weights, against the
brute-force oracle: ViT (cls_token, pos_embed and layer scale as bare parameters, timm's
LayerNorm subclass) and ConvNeXt (LayerNorm2d, layer-scale gamma, channels-last convs).
Skipped without timm."""

import pytest
import torch

timm = pytest.importorskip("timm")

from models_common import adam_steps, check_model, class_loss, run_recipe  # noqa: E402


def vit():
    return timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=16, patch_size=8, embed_dim=16,
                             depth=2, num_heads=2, num_classes=3, init_values=0.5)


def convnext():
    return timm.create_model("convnext_atto", pretrained=False, depths=(1, 1, 1, 1), dims=(8, 8, 16, 16),
                             num_classes=3, ls_init_value=0.5)


def _images(n, size):
    return torch.randn(n, 3, size, size, generator=torch.Generator().manual_seed(n), dtype=torch.float64)


@pytest.mark.parametrize("n", [1, 3])
def test_vit_matches_oracle(n):
    check_model(vit, (_images(n, 16),), torch.arange(n) % 3, lambda m, x: m(x), class_loss)


@pytest.mark.parametrize("n", [1, 3])
def test_convnext_matches_oracle(n):
    check_model(convnext, (_images(n, 32),), torch.arange(n) % 3, lambda m, x: m(x), class_loss)


def test_dpadam_trains_vit():
    torch.manual_seed(0)
    adam_steps(vit(), ((_images(4, 16).float(),), torch.arange(4) % 3), lambda m, x: m(x), class_loss)


def test_recipe_runs():
    assert run_recipe("timm")["optimizer"].steps_taken == 1
