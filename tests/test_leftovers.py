"""Regression tests for small defects: an excluded module under a second backward, the device the
planner synchronizes."""

from __future__ import annotations

import pytest
import torch
from hyperac_testing import applied_copy, lm_loss, tiny_llama

import hyperac
from hyperac import Adapter
from hyperac.backends.cpu import CpuBackend

NO_ATTENTION = Adapter(region_patterns=("model.layers.*",), exclude_patterns=("*.self_attn",))


def backward_twice(model, loss_fn):
    """Gradients after ``backward(retain_graph=True)`` and a second backward through the same graph."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = loss_fn(model)
    loss.backward(retain_graph=True)
    loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_excluded_module_survives_a_second_backward(mode):
    """An excluded module's queued output is returned by every replay of its region, not the first
    only: the second backward replays the region again (its kept outputs were handed out once)."""
    model, loss_fn = tiny_llama(num_layers=2), lm_loss(seq=16)
    reference = backward_twice(model, loss_fn)
    applied, _ = applied_copy(model, backend="cpu", mode=mode, adapter=NO_ATTENTION)
    grads = backward_twice(applied, loss_fn)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


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
