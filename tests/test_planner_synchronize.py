"""The planner synchronizes the device the model is on."""

from __future__ import annotations

import torch
from hyperac_testing import lm_loss, tiny_llama

import hyperac
from hyperac.backends.cpu import CpuBackend


class SynchronizeRecorder(CpuBackend):
    """The CPU backend, noting the device of each ``synchronize`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.synchronized: list = []

    def synchronize(self, device=None) -> None:
        self.synchronized.append(device)
        super().synchronize(device)


def test_auto_synchronizes_the_models_device():
    """The planner's timed rounds wait on the device the model is on (design.md section 5: the device
    comes from the tensors), not on whatever device is current."""
    model, loss_fn = tiny_llama(num_layers=2), lm_loss(seq=16)
    backend = SynchronizeRecorder()
    hyperac.apply(model, mode="auto", budget=0.6, sample=loss_fn, backend=backend)
    assert backend.synchronized and set(backend.synchronized) == {torch.device("cpu")}
