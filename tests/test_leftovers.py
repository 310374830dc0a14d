"""Regression tests for small defects: an excluded module under a second backward."""

from __future__ import annotations

import pytest
import torch
from hyperac_testing import applied_copy, lm_loss, tiny_llama

from hyperac import Adapter

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
