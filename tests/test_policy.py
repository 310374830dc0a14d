"""The selective policy's decisions, proven by what runs again in backward."""

import pytest
import torch
from hyperac_testing import assert_parity, train_step
from torch import nn

import hyperac
from hyperac.measure import flop_counter


class WriteThroughView(nn.Module):
    """`torch.matmul` on 3-d input returns `_unsafe_view(mm)`: the in-place add writes into the kept
    `mm` output through a tensor that does not share its version counter."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x):
        y = torch.matmul(x, self.weight)
        y += x
        return y.tanh()


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module], num_blocks: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(block() for _ in range(num_blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def _loss_fn():
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    return lambda model: model(x).pow(2).sum()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_write_into_kept_output_through_unsafe_view_keeps_gradients_exact(mode):
    model, loss_fn = Stack(WriteThroughView), _loss_fn()
    reference = train_step(model, loss_fn)
    hyperac.apply(model, mode=mode, layers="blocks", backend="cpu")
    assert_parity(reference, train_step(model, loss_fn))


class BiasedMlp(nn.Module):
    """Three matmuls a layer: two `addmm` (biased) and one `mm` (bias-free)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)
        self.down = nn.Linear(width, width, bias=False)

    def forward(self, x):
        return x + self.down(self.up(x).relu() * self.gate(x).sigmoid())


def _flops(model, loss_fn) -> int:
    with flop_counter() as counter:
        loss_fn(model).backward()
    return counter.get_total_flops()


def test_mm_and_addmm_alternate_alike():
    """Selective keeps the 1st and 3rd matmul of each layer whatever their kind, recomputes the 2nd:
    the recompute costs exactly one forward matmul per layer."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    loss_fn = lambda model: model(x).sum()  # noqa: E731
    model = Stack(BiasedMlp, num_blocks=3)
    base = _flops(model, loss_fn)
    hyperac.apply(model, mode="selective", layers="blocks", backend="cpu")
    one_matmul = 2 * 4 * 32 * 32
    assert _flops(model, loss_fn) - base == 3 * one_matmul


def test_flop_counter_counts_grouped_matmuls():
    """torch 2.13 counts no FLOPs for `_grouped_mm` (MoE experts); hyperac's counter does."""
    a = torch.randn(16, 16, dtype=torch.bfloat16)
    b = torch.randn(2, 16, 16, dtype=torch.bfloat16)
    offsets = torch.tensor([8, 16], dtype=torch.int32)
    with flop_counter() as counter:
        torch._grouped_mm(a, b, offs=offsets)
    assert counter.get_total_flops() == 2 * 16 * 16 * 16
