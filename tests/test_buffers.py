"""Invariant 8: buffers a recomputed forward updates are updated once per step, in every mode, and the
replay reads the values the forward read (NOTE [Buffers in the replay] in hyperac/replay/buffers.py).

Every test trains an applied copy and the un-applied model for three SGD steps from the same seeds and
compares the whole ``state_dict`` (parameters, running statistics, counters) and the last gradients,
bitwise.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from hyperac_testing import applied_copy
from torch import nn

import hyperac

MODES = ["full", "selective", "selective-even", "pointwise"]
Loss = Callable[[nn.Module], torch.Tensor]


def train(model: nn.Module, loss_fn: Loss, steps: int = 3) -> tuple[dict, dict]:
    """``steps`` SGD steps from fixed seeds; returns (state_dict copy, last gradients)."""
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        loss_fn(model).backward()
        optimizer.step()
    state = {name: value.clone() for name, value in model.state_dict().items()}
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return state, grads


def assert_same_training(reference: tuple[dict, dict], other: tuple[dict, dict]) -> None:
    for kind, expected, actual in (("state", reference[0], other[0]), ("gradient", reference[1], other[1])):
        assert actual.keys() == expected.keys()
        different = [name for name in expected if not torch.equal(actual[name], expected[name])]
        assert not different, f"{kind} differs from the un-applied model: {different[:5]}"


class ConvBlock(nn.Module):
    def __init__(self, channels: int, momentum: float | None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels, momentum=momentum)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels, momentum=momentum)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class BatchNormCNN(nn.Module):
    """A plain PyTorch CNN: stem, ``blocks = nn.ModuleList`` of residual conv/BatchNorm blocks, head."""

    def __init__(self, momentum: float | None = 0.1) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.blocks = nn.ModuleList(ConvBlock(8, momentum) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean((2, 3)))


def cnn_loss(model: nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    images, labels = torch.randn(4, 3, 8, 8, generator=generator), torch.tensor([0, 1, 2, 3])
    return nn.functional.cross_entropy(model(images), labels)


@pytest.mark.parametrize("momentum", [0.1, None], ids=["ema", "cumulative"])
@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_cnn_buffers_and_gradients_equal_after_three_steps(mode, momentum):
    torch.manual_seed(0)
    model = BatchNormCNN(momentum)
    reference = train(copy.deepcopy(model), cnn_loss)
    applied, plan = applied_copy(model, mode=mode, backend="cpu", layers="blocks")
    assert plan.count(mode) == 3
    result = train(applied, cnn_loss)
    assert int(result[0]["blocks.0.bn1.num_batches_tracked"]) == 3
    assert_same_training(reference, result)


class CountingBlock(nn.Module):
    """Scales by a step counter it updates in its forward: a replay that read the updated counter, or
    updated it again, would give other gradients and another count."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.linear(x)) * self.calls


class CountingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CountingBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


@pytest.mark.parametrize("mode", MODES)
def test_replay_reads_the_counter_the_forward_read(mode):
    torch.manual_seed(0)
    model = CountingModel()
    inputs = torch.randn(2, 8)
    reference = train(copy.deepcopy(model), lambda m: m(inputs))
    applied, _ = applied_copy(model, mode=mode, backend="cpu", layers="layers")
    result = train(applied, lambda m: m(inputs))
    assert int(result[0]["layers.0.calls"]) == 3
    assert_same_training(reference, result)


def test_buffers_outside_recomputed_layers_and_eval_forwards_untouched():
    torch.manual_seed(0)
    model = BatchNormCNN()
    applied, _ = applied_copy(model, mode="full", backend="cpu", layers={"blocks": {"0": "full", "1-": "off"}})
    reference = train(copy.deepcopy(model), cnn_loss)
    assert_same_training(reference, train(applied, cnn_loss))
    applied.eval()
    before = copy.deepcopy(applied.state_dict())
    with torch.no_grad():
        cnn_loss(applied)
    assert all(torch.equal(before[name], value) for name, value in applied.state_dict().items())


# --- transformers models -------------------------------------------------------------------------------


def _tiny_resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[2, 2], num_labels=3)
    return ResNetForImageClassification(config)


def _resnet_loss(model: nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return model(pixel_values=torch.randn(2, 3, 32, 32, generator=generator), labels=torch.tensor([0, 2])).loss


@pytest.mark.parametrize("mode", MODES)
def test_hf_resnet_buffers_and_gradients_equal_after_three_steps(mode):
    pytest.importorskip("transformers")
    model = _tiny_resnet()
    reference = train(copy.deepcopy(model), _resnet_loss)
    applied, plan = applied_copy(model, mode=mode, backend="cpu")
    assert plan.layers and all(layer.mode == mode for layer in plan.layers)
    assert_same_training(reference, train(applied, _resnet_loss))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_hf_ibert_quant_act_replays_the_ranges_its_forward_saw(mode):
    """ibert's ``QuantAct`` updates its activation range in training and scales by it: the replay must read
    the range before the update (else selective replays other ops and torch fails) and not move it again."""
    pytest.importorskip("transformers")
    from transformers import IBertConfig, IBertForMaskedLM

    torch.manual_seed(0)
    model = IBertForMaskedLM(IBertConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        quant_mode=True, max_position_embeddings=64,
    ))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_fn(m: nn.Module) -> torch.Tensor:
        return m(input_ids=ids, labels=ids).loss

    reference = train(copy.deepcopy(model), loss_fn)
    applied, plan = applied_copy(model, mode=mode, backend="cpu")
    assert [layer.fqn for layer in plan.layers] == ["ibert.encoder.layer.0", "ibert.encoder.layer.1"]
    assert_same_training(reference, train(applied, loss_fn))
    hyperac.remove(applied)


def _tiny_mobilenet_v2() -> tuple[nn.Module, Loss]:
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification

    torch.manual_seed(0)
    model = MobileNetV2ForImageClassification(MobileNetV2Config(
        image_size=32, depth_multiplier=0.25, num_labels=3, first_layer_is_expansion=True,
    ))
    return model, _resnet_loss


def _tiny_jetmoe() -> tuple[nn.Module, Loss]:
    from transformers import JetMoeConfig, JetMoeForCausalLM

    torch.manual_seed(0)
    model = JetMoeForCausalLM(JetMoeConfig(
        vocab_size=128, hidden_size=32, num_hidden_layers=2, num_key_value_heads=2, kv_channels=8,
        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    ))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    return model, lambda m: m(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("build", [_tiny_mobilenet_v2, _tiny_jetmoe], ids=["mobilenet_v2", "jetmoe"])
def test_models_hf_marks_without_checkpointing_support_train_as_unapplied(build, mode):
    """HF marks these ``supports_gradient_checkpointing=False``; hyperac does not refuse them for that, and
    their side effects (BatchNorm statistics in mobilenet_v2's blocks) still happen once per step."""
    pytest.importorskip("transformers")
    model, loss_fn = build()
    assert type(model).supports_gradient_checkpointing is False
    reference = train(copy.deepcopy(model), loss_fn)
    applied, plan = applied_copy(model, mode=mode, backend="cpu")
    assert len(plan.layers) >= 2 and all(layer.mode == mode for layer in plan.layers)
    assert_same_training(reference, train(applied, loss_fn))
    hyperac.remove(applied)
