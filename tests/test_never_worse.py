"""No recompute mode keeps more than ``off`` (design.md invariant 11, NOTE [Never keep more than off]).

HF's DETR family (tiny configs, a ResNet backbone with frozen BatchNorm) and a conv net with
in-place activations and training BatchNorm: every mode's bytes kept at backward start and step
peak are at most the un-applied model's, with bitwise-equal gradients. HF DETR freezes its whole
HF-ResNet backbone by name; the tests train it (a fine-tuned backbone), which is where the
convolutions' outputs are at stake. The Hungarian-matching loss needs scipy, so the loss here is
one on the logits and boxes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from hyperac_testing import assert_parity, measure, train_step
from torch import nn

import hyperac
from hyperac.measure import PeakMeter

MODES = ("pointwise", "selective", "selective-even", "full")
DETR_FAMILY = {
    "detr": ("DetrConfig", "DetrForObjectDetection"),
    "conditional_detr": ("ConditionalDetrConfig", "ConditionalDetrForObjectDetection"),
    "deformable_detr": ("DeformableDetrConfig", "DeformableDetrForObjectDetection"),
    "table_transformer": ("TableTransformerConfig", "TableTransformerForObjectDetection"),
}


def tiny_detector(family: str) -> nn.Module:
    config_name, model_name = DETR_FAMILY[family]
    deformable = family == "deformable_detr"
    backbone = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[16, 32, 32, 32], depths=[2, 1, 1, 1], layer_type="bottleneck",
        out_features=["stage2", "stage3", "stage4"] if deformable else ["stage4"],
    )
    options = dict(
        use_timm_backbone=False, use_pretrained_backbone=False, backbone_config=backbone, d_model=32,
        encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
        encoder_ffn_dim=32, decoder_ffn_dim=32, num_queries=4,
    )
    if deformable:
        options.update(num_feature_levels=3, encoder_n_points=2, decoder_n_points=2, decoder_layers=2)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**options))
    return model.train().requires_grad_(True)


def detection_loss(model: nn.Module) -> torch.Tensor:
    pixels = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    out = model(pixel_values=pixels)
    return out.logits.square().mean() + out.pred_boxes.sum()


class ConvBlock(nn.Module):
    """A ResNet basic block with in-place ReLUs and training BatchNorm (torchvision's and timm's shape)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.norm2 = nn.Conv2d(width, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.act(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        y += x
        return self.act(y)


class ConvNet(nn.Module):
    def __init__(self, width: int = 8, num_blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1)
        self.blocks = nn.ModuleList(ConvBlock(width) for _ in range(num_blocks))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def conv_loss(model: nn.Module) -> torch.Tensor:
    return model(torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))).square().mean()


def step_peak(model: nn.Module, loss_fn) -> int:
    with PeakMeter(model.parameters()) as meter:
        loss_fn(model).backward()
    model.zero_grad(set_to_none=True)
    return meter.peak_bytes


def _check_never_worse(model: nn.Module, loss_fn, **options) -> None:
    """Every mode: fewer bytes kept at backward start than ``off``, a step peak no higher, the same gradients."""
    off_kept, off_peak = measure(copy.deepcopy(model), loss_fn)[0], step_peak(copy.deepcopy(model), loss_fn)
    reference = train_step(copy.deepcopy(model), loss_fn)
    for mode in MODES:
        applied = copy.deepcopy(model)
        hyperac.apply(applied, mode=mode, backend="cpu", **options)
        kept = measure(applied, loss_fn)[0]
        applied.zero_grad(set_to_none=True)  # else the next step's gradient accumulation counts
        peak = step_peak(applied, loss_fn)
        assert kept < off_kept, f"{mode} keeps {kept} B at backward start, off {off_kept} B"
        assert peak <= off_peak, f"{mode} step peak {peak} B, off {off_peak} B"
        assert_parity(reference, train_step(applied, loss_fn))


@pytest.mark.parametrize("family", list(DETR_FAMILY))
def test_detr_family_keeps_less_than_off_in_every_mode(family):
    _check_never_worse(tiny_detector(family), detection_loss)


def test_conv_net_with_in_place_activations_keeps_less_than_off():
    torch.manual_seed(0)
    _check_never_worse(ConvNet(), conv_loss, layers="blocks")


@pytest.mark.parametrize("name", ["resnet10t", "convnext_atto"])
def test_timm_conv_nets_keep_less_than_off(name):
    """timm's ResNet (in-place ReLU after training BatchNorm) and ConvNeXt. Needs timm (tox -e models)."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    model = timm.create_model(name, pretrained=False, num_classes=4).train()
    _check_never_worse(model, lambda m: m(torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0)))
                       .square().mean())


def test_torchtitan_llama3_keeps_less_than_off():
    """torchtitan's llama3 debug model (causal SDPA), hyperac applied as its ac_config. Needs
    torchtitan (tox -e torchtitan). The bound by torchtitan's own SelectiveAC is
    tests/test_torchtitan.py::test_selective_keeps_no_more_than_torchtitans_selective_ac."""
    pytest.importorskip("torchtitan")
    import sys
    from pathlib import Path

    import torch.distributed as dist
    import torch.nn.functional as F
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims

    from hyperac.integrations.torchtitan import HyperACRecompute

    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from torchtitan_llama3 import BATCH, SEQ, cpu_debug_model

    parallel_dims_module.device_type = "cpu"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def build(ac_config):
        spec = cpu_debug_model()
        with torch.device("meta"):
            model = spec.model.build()
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=1)
        model = spec.parallelize_fn(model, parallel_dims=dims, training=TrainingConfig(),
                                    parallelism=ParallelismConfig(), compile_config=CompileConfig(),
                                    ac_config=ac_config, dump_folder="")
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        return model.train()

    def loss_fn(model):
        tokens = torch.randint(0, 2000, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(1))
        logits = model(tokens[:, :-1], positions=torch.arange(SEQ).expand(BATCH, SEQ))
        return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())

    try:
        kept, peak = {}, {}
        for mode in ("off", *MODES):
            model = build(None if mode == "off" else HyperACRecompute.Config(mode=mode, backend="cpu"))
            kept[mode] = measure(model, loss_fn)[0]
            model.zero_grad(set_to_none=True)  # FSDP's unsharded gradients count as activations: alike for all
            peak[mode] = step_peak(model, loss_fn)
        assert all(kept[mode] < kept["off"] and peak[mode] <= peak["off"] for mode in MODES), (kept, peak)
    finally:
        dist.destroy_process_group()


def test_auto_plan_notes_layers_where_selective_saves_nothing_over_full():
    model = tiny_detector("detr")
    plan = hyperac.apply(model, mode="auto", budget=0.97, sample=detection_loss, backend="cpu")
    note = next(note for note in plan.notes if note.startswith("pointwise and selective save no memory over full"))
    assert "model.backbone.model.encoder.stages.0.layers.0" in note and note in str(plan)
