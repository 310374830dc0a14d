"""timm and diffusers models found with no paths, with the un-applied gradients and buffers.

Each model is built from a tiny config (nothing downloaded), trained three SGD steps un-applied and applied,
and compared bitwise: every parameter, every buffer (BatchNorm running statistics, ``num_batches_tracked``)
and the last gradients. Skipped where the libraries are missing: timm needs torchvision, which next to CPU
torch 2.13 breaks ``import transformers``, so these run in their own env (``tox -e models``: torch 2.14.1 +
torchvision + timm + diffusers).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from test_buffers import assert_same_training, train

import hyperac


def _diffusers():
    return pytest.importorskip("diffusers")


def _unet():
    torch.manual_seed(0)
    return _diffusers().UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, block_out_channels=(16, 32), layers_per_block=1,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8,
    )


def _unet_loss(model):
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 3, 16, 16, generator=generator)
    return model(sample, torch.tensor([1, 10])).sample.square().mean()


def _sd3_transformer():
    """SD3's MMDiT: joint image/text transformer blocks."""
    torch.manual_seed(0)
    return _diffusers().SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16, pooled_projection_dim=8,
        pos_embed_max_size=8,
    )


def _sd3_loss(model):
    generator = torch.Generator().manual_seed(0)
    latents, text = torch.randn(2, 4, 8, 8, generator=generator), torch.randn(2, 5, 16, generator=generator)
    pooled = torch.randn(2, 8, generator=generator)
    output = model(latents, encoder_hidden_states=text, pooled_projections=pooled, timestep=torch.tensor([1, 10]))
    return output.sample.square().mean()


def _timm(name: str, **options):
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    return timm.create_model(name, pretrained=False, num_classes=4, **options)


def _image_loss(size: int):
    def loss(model):
        generator = torch.Generator().manual_seed(0)
        images = torch.randn(2, 3, size, size, generator=generator)
        return torch.nn.functional.cross_entropy(model(images), torch.tensor([0, 3]))

    return loss


def _timm_wrapper():
    """A timm model inside HF's ``TimmWrapperForImageClassification``."""
    pytest.importorskip("timm")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.TimmWrapperConfig(architecture="resnet18", num_labels=4)
    return transformers.TimmWrapperForImageClassification(config)


def _hf_image_loss(model):
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(2, 3, 32, 32, generator=generator)
    return model(pixel_values=images, labels=torch.tensor([0, 3])).loss


# name: (build, loss, the layers discovery must find as a regular expression over their dotted names)
CASES = {
    "diffusers_unet": (
        _unet, _unet_loss, r"((down|up)_blocks\.\d|mid_block)\.(resnets|attentions|downsamplers|upsamplers)\.\d",
    ),
    "diffusers_sd3_transformer": (_sd3_transformer, _sd3_loss, r"transformer_blocks\.[01]"),
    "timm_vit": (lambda: _timm("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2), _image_loss(32),
                 r"blocks\.[01]"),
    "timm_resnet_batchnorm": (lambda: _timm("resnet18"), _image_loss(32), r"layer[1-4]\.[01]"),
    "timm_efficientnet_batchnorm": (lambda: _timm("efficientnet_b0"), _image_loss(32), r"blocks\.\d\.\d"),
    "timm_maxvit_batchnorm": (lambda: _timm("maxvit_pico_rw_256", img_size=64), _image_loss(64),
                              r"stages\.\d\.blocks\.\d"),
    "timm_levit_batchnorm": (lambda: _timm("levit_128s", img_size=64), _image_loss(64), r"stages\.\d\.blocks\.\d"),
    "hf_timm_wrapper": (_timm_wrapper, _hf_image_loss, r"timm_model\.layer[1-4]\.[01]"),
}


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_found_without_paths_and_training_equal(case, mode):
    """Selective covers squeeze-excite's SiLU(inplace=True) on a kept conv output (efficientnet, maxvit)."""
    build, loss_fn, layers = CASES[case]
    model = build()
    reference = train(copy.deepcopy(model), loss_fn)
    applied = copy.deepcopy(model)
    plan = hyperac.apply(applied, mode=mode, backend="cpu")
    fqns = [layer.fqn for layer in plan.layers]
    assert len(fqns) >= 2 and all(re.fullmatch(layers, fqn) for fqn in fqns), fqns
    assert plan.count(mode) == len(fqns)
    assert_same_training(reference, train(applied, loss_fn))
