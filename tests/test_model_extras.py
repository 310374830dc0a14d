"""timm and diffusers models found with no paths, with the un-applied gradients and buffers.

Skipped where the libraries are missing: timm needs torchvision, which next to CPU torch 2.13 breaks
``import transformers``, so these run in their own env (``tox -e models``: torch 2.14.1 + torchvision).
"""

from __future__ import annotations

import copy

import pytest
import torch
from test_buffers import assert_same_training, train

import hyperac


def _unet():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
    )


def _unet_loss(model):
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 3, 16, 16, generator=generator)
    return model(sample, torch.tensor([1, 10])).sample.square().mean()


def _timm(name: str, **options):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=4, **options)


def _image_loss(model):
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, 32, 32, generator=generator)
    return torch.nn.functional.cross_entropy(model(images), torch.tensor([0, 3]))


CASES = {
    "diffusers_unet": (_unet, _unet_loss),
    "timm_vit": (lambda: _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2), _image_loss),
    "timm_resnet_batchnorm": (lambda: _timm("resnet18"), _image_loss),
}


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_found_without_paths_and_training_equal(case, mode):
    build, loss_fn = CASES[case]
    model = build()
    reference = train(copy.deepcopy(model), loss_fn)
    applied = copy.deepcopy(model)
    plan = hyperac.apply(applied, mode=mode, backend="cpu")
    assert plan.count(mode) >= 2
    assert_same_training(reference, train(applied, loss_fn))
