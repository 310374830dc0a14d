"""Ordinary programs that once gave wrong results or crashed applied (issue 16), each in its minimal
form: bitwise parity with the un-applied model over two SGD steps (losses, gradients, parameters,
buffers), or the documented hyperac error.

NOTE [Aliases with their own version counter] (policy.py), NOTE [Buffers in the replay]
(buffers.py), NOTE [Rebound buffers] (planner/restore.py), NOTE [Inputs written in place]
(recompute.py) and NOTE [No hooks on the user's tensors] (planner/profile.py) say how each is met.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from program_fuzzer import differences, train
from torch import nn

import hyperac
from hyperac.measure import measure_step

MODES = ["full", "selective", "selective-even", "pointwise"]


def assert_parity(model: nn.Module, loss_fn, backward: str = "plain", **options) -> nn.Module:
    """Train ``model`` un-applied and an applied copy; everything recorded is equal bit for bit."""
    expected = train(copy.deepcopy(model), backward, loss_fn)
    applied = copy.deepcopy(model)
    hyperac.apply(applied, backend="cpu", layers="layers", **options)
    assert differences(expected, train(applied, backward, loss_fn)) == []
    return applied


class Layers(nn.Module):
    """``layers`` in a list; ``between(out, x)`` is what the caller does with each layer's output."""

    def __init__(self, *layers: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def between(self, out, x):
        return out

    def forward(self, x):
        for layer in self.layers:
            x = self.between(layer(x), x)
        return x.square().mean()


# --- 1. A write into a returned matmul output after the layer returned ------------------------------


class MatmulAndExp(nn.Module):
    """Returns ``h = x @ w`` (3-d ``x``: ``mm`` then ``_unsafe_view``, or a ``bmm`` by hand-written
    attention) and ``h.exp()``, whose backward reads its result: a replay from a written ``h`` differs."""

    def __init__(self, attention: bool) -> None:
        super().__init__()
        self.attention = attention
        self.w = nn.Parameter(torch.randn(8, 8) / 3)

    def forward(self, x):
        q = x.tanh()
        h = (q @ q.transpose(-1, -2)).softmax(-1) @ (q @ self.w) if self.attention else q @ self.w
        return h, h.exp()


class WritesAfterReturn(Layers):
    def between(self, out, x):
        h, e = out
        h.mul_(0.5)
        return h + e


@pytest.mark.parametrize("attention", [False, True], ids=["matmul", "attention"])
@pytest.mark.parametrize("mode", MODES)
def test_write_into_a_returned_matmul_output_after_the_layer_returned(mode, attention):
    torch.manual_seed(0)
    model, x = WritesAfterReturn(MatmulAndExp(attention), MatmulAndExp(attention)), torch.randn(2, 3, 8)
    assert_parity(model, lambda m: m(x), mode=mode)


# --- 2. BatchNorm statistics that the first batch leaves unchanged --------------------------------


class LinearBatchNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm = nn.Linear(4, 4), nn.BatchNorm1d(4)

    def forward(self, x):
        return self.norm(self.linear(x))


def _mirrored_then_random(model):
    """Step 0: rows ``a`` and ``-a`` through an identity Linear, whose mean, 0, is the running mean."""
    a = torch.randn(1, 4)
    return model(torch.cat([a, -a]) if torch.initial_seed() == 0 else torch.randn(4, 4))


@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_statistics_update_once_when_the_first_batch_leaves_them_unchanged(mode):
    model = Layers(LinearBatchNorm())
    with torch.no_grad():
        model.layers[0].linear.weight.copy_(torch.eye(4))
        model.layers[0].linear.bias.zero_()
    applied = assert_parity(model, _mirrored_then_random, mode=mode)
    assert int(applied.layers[0].norm.num_batches_tracked) == 2


# --- 3. auto's profiling and a rebound buffer -----------------------------------------------------


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count = self.count + 1  # rebinds the buffer slot to a new tensor
        return self.linear(x).tanh() * self.count


def test_auto_profiling_leaves_a_rebound_buffer_as_it_was():
    torch.manual_seed(0)
    model, x = Layers(Counting(), Counting()), torch.randn(2, 8)
    held = [layer.count for layer in model.layers]
    applied = copy.deepcopy(model)
    hyperac.apply(model, mode="auto", backend="cpu", layers="layers", budget="1GiB", sample=lambda m: m(x))
    assert [layer.count for layer in model.layers] == held  # the same tensor objects, each still 0
    assert [float(count) for count in held] == [0.0, 0.0]
    hyperac.remove(model)
    assert_parity(applied, lambda m: m(x), mode="auto", budget="1GiB", sample=lambda m: m(x))


# --- 4. A buffer layer 0 reads and layer 1 later updates ------------------------------------------


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("value", torch.ones(8))


class ReadsThenUpdates(nn.Module):
    def __init__(self, scale: Scale, updates: bool) -> None:
        super().__init__()
        self.linear, self.scale, self.updates = nn.Linear(8, 8), scale, updates

    def forward(self, x):
        y = self.linear(x + self.scale.value).tanh()  # the Linear saves x + value for its weight gradient
        if self.updates:
            self.scale.value.add_(1.0)
        return y


@pytest.mark.parametrize("mode", MODES)
def test_replay_reads_a_shared_buffer_as_the_forward_did_after_a_later_layer_updated_it(mode):
    torch.manual_seed(0)
    scale = Scale()
    model, x = Layers(ReadsThenUpdates(scale, False), ReadsThenUpdates(scale, True)), torch.randn(2, 8)
    applied = assert_parity(model, lambda m: m(x), mode=mode)
    assert applied.layers[0].scale.value[0] == 3.0  # updated once per step


# --- 5. A second backward through a layer with buffers ---------------------------------------------


@pytest.mark.parametrize("backward", ["retain_graph", "create_graph"])
@pytest.mark.parametrize("mode", MODES)
def test_second_backward_through_a_layer_with_buffers(mode, backward):
    torch.manual_seed(0)
    model = Layers(LinearBatchNorm(), LinearBatchNorm())
    assert_parity(model, lambda m: m(torch.randn(4, 4)), backward, mode=mode)


# --- 6. An input written in place -------------------------------------------------------------------


class WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        x.mul_(2)
        return self.linear(x) + 0.5


class ReturnsItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        return self.linear(x + 0).tanh().sum(-1, keepdim=True), x[:, :4]


class WritesReturnedInput(Layers):
    def between(self, out, x):
        scores, view = out
        view.mul_(2)  # writes into the layer's input, after the layer returned
        return x + scores


@pytest.mark.parametrize("where", ["by the layer's own forward", "after the layer returned"])
@pytest.mark.parametrize("mode", MODES)
def test_input_written_in_place_raises_naming_the_layer_and_the_fix(mode, where):
    torch.manual_seed(0)
    if where.startswith("by"):
        model = Layers(nn.Linear(8, 8), WritesItsInput(), WritesItsInput())
        model.layers[0].register_forward_hook(lambda module, args, out: out + 0)  # the write is allowed un-applied
    else:
        model = WritesReturnedInput(ReturnsItsInput(), ReturnsItsInput())
    x = torch.randn(2, 8)

    def loss_fn(model):
        return model(x.clone())  # a fresh input: the program writes into it

    expected = train(copy.deepcopy(model), "plain", loss_fn)  # runs un-applied
    applied = copy.deepcopy(model)
    layers = {0: "off", "1-": mode} if where.startswith("by") else {"0-": mode}
    hyperac.apply(applied, mode=mode, backend="cpu", layers={"layers": layers})
    # The forward raises at layer 1, the first to write its input; the backward at layer 1, the
    # first to replay.
    with pytest.raises(hyperac.InputWrittenError, match=rf"layer 'layers\.1'.*{where}.*layers=\{{1: 'off'\}}"):
        train(applied, "plain", loss_fn)
    assert isinstance(hyperac.InputWrittenError("x"), RuntimeError)
    fixed = copy.deepcopy(model)
    also_off = 2 if where.startswith("by") else 0
    hyperac.apply(fixed, mode=mode, backend="cpu", layers={"layers": {1: "off", also_off: "off"}})
    assert differences(expected, train(fixed, "plain", loss_fn)) == []


# --- 7. auto's profiler and a view written through a further view -----------------------------------


class ReturnsAView(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 12)

    def forward(self, x):
        return self.linear(x)[:, :8]


class WritesThroughAFurtherView(Layers):
    def between(self, out, x):
        out.unsqueeze(0).squeeze(0).sub_(0.1)
        return F.gelu(out)


def test_auto_profiling_registers_no_hook_on_user_tensors(monkeypatch):
    """``Tensor.register_hook`` on such an output can segfault (PyTorch 2.13): the profiler must not call it."""
    torch.manual_seed(0)
    model, x = WritesThroughAFurtherView(ReturnsAView(), ReturnsAView()), torch.randn(2, 8)
    calls = []
    register_hook = torch.Tensor.register_hook
    monkeypatch.setattr(torch.Tensor, "register_hook", lambda t, hook: calls.append(t.shape) or register_hook(t, hook))
    assert_parity(model, lambda m: m(x), mode="auto", budget="1GiB", sample=lambda m: m(x))
    assert calls == []


class _RotaryBlock(nn.Module):
    """A layer holding a large non-persistent table (as torchtitan's llama3 holds its rotary table)."""

    def __init__(self, width: int = 8, table_rows: int = 4096) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.register_buffer("table", torch.randn(table_rows, width), persistent=False)

    def forward(self, x):
        return torch.tanh(self.linear(x) * self.table[: x.shape[-2]])


class _RotaryStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(_RotaryBlock() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_non_persistent_buffers_are_held_not_copied(mode):
    """NOTE [Non-persistent buffers are held, not copied]: a large derived table costs no copy per
    layer (bytes kept at backward start stay below off's), and the gradients are off's."""
    x = torch.randn(2, 16, 8, requires_grad=True)
    reference = _RotaryStack()
    model = copy.deepcopy(reference)
    hyperac.apply(model, mode=mode, layers="blocks", backend="cpu")
    kept = {name: measure_step(net, lambda net: net(x).sum())[0] for name, net in (("off", reference), (mode, model))}
    assert kept[mode] < kept["off"], kept
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters()):
        assert torch.equal(expected.grad, actual.grad), name


def test_non_persistent_buffer_written_after_the_forward_raises_naming_the_layer():
    model = _RotaryStack()
    hyperac.apply(model, mode="full", layers="blocks", backend="cpu")
    loss = model(torch.randn(2, 16, 8, requires_grad=True)).sum()
    model.blocks[1].table.mul_(2)
    with pytest.raises(hyperac.InputWrittenError, match=r"non-persistent buffer 'table' of _RotaryBlock in recomputed "
                                                        r"layer 'blocks.1' .* layers=\{1: 'off'\}"):
        loss.backward()
