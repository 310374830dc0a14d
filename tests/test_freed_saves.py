"""A recompute inside a recomputed region: torch's own checkpoint works; a forward that frees the data of
a tensor autograd saved (Megatron-Core's ``CheckpointWithoutOutput``) is refused before backward
(NOTE [Saved tensors freed in forward])."""

import copy

import pytest
import torch
from hyperac_testing import Stack, assert_parity, train_step
from torch import nn

import hyperac

RECOMPUTING = ("full", "selective", "pointwise")


class InnerCheckpointBlock(nn.Module):
    def __init__(self, width: int = 16, reentrant: bool = False) -> None:
        super().__init__()
        self.up, self.down, self.reentrant = nn.Linear(width, width), nn.Linear(width, width), reentrant

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: self.up(t).relu(), x, use_reentrant=self.reentrant)
        return x + self.down(h)


class OutputFreeingBlock(nn.Module):
    """What ``CheckpointWithoutOutput.discard_output_and_register_recompute`` does: the activation's
    output, saved by the next matmul, has its storage freed once the matmul ran (Megatron refills it
    from a hook on the matmul's output in backward)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        with torch.no_grad():
            h = torch.nn.functional.gelu(self.up(x).detach())
        h.requires_grad_()
        out = self.down(h)
        h.untyped_storage().resize_(0)
        return x + out


def _loss():
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    return lambda model: model(x).pow(2).sum()


@pytest.mark.parametrize("reentrant", [False, True])
@pytest.mark.parametrize("mode", RECOMPUTING)
def test_inner_torch_checkpoint_in_a_region_is_bitwise(mode, reentrant):
    model = Stack(lambda: InnerCheckpointBlock(reentrant=reentrant))
    reference = copy.deepcopy(model)
    hyperac.apply(model, mode=mode, layers="blocks", backend="cpu")
    for seed in (1, 2):
        assert_parity(train_step(reference, _loss(), seed), train_step(model, _loss(), seed))


@pytest.mark.parametrize("mode", RECOMPUTING)
def test_forward_freeing_a_saved_tensor_is_refused_before_backward(mode):
    model = Stack(OutputFreeingBlock)
    hyperac.apply(model, mode=mode, layers="blocks", backend="cpu")
    with pytest.raises(hyperac.UnsupportedModelError,
                       match=r"recomputed layer 'blocks.0' frees, in its forward, the data of a tensor of shape \[4, "
                             r"16\] that autograd saved.*CheckpointWithoutOutput.*layers=\{0: 'off'\}"):
        _loss()(model)
    hyperac.remove(model)
    hyperac.apply(model, mode="off", layers="blocks", backend="cpu")
    _loss()(model)  # nothing replays: the layer's own forward runs
