"""Profiling runs real training steps; this puts back everything those steps change.

Gradients (backward accumulates into ``.grad`` in place), buffers (BatchNorm statistics,
counters), random-number generators (dropout draws), ``module.training`` flags and the Python state
the forward changes (counters, lists its forward hooks fill, tensors held as plain attributes, as far
as NOTE [Python state in the replay] in replay/python_state.py reaches) are as they were when profiling
ends, whether it ends normally or with an error. A sharding stack's bookkeeping of which parameters
a module gathers is left as the profiled steps left it, in step with the stack's own records
(NOTE [Parameter bookkeeping is the stack's] in replay/python_state.py).

NOTE [Rebound buffers]
A forward may update a buffer in place (``running_mean.mul_(...)``) or rebind it
(``self.count = self.count + 1`` puts a new tensor in the module's ``_buffers`` slot). So each slot
gets back the tensor object it held, and that tensor gets back its values: the model is
bit-identical, and whoever held a reference to the old buffer (an optimizer, a tied module) still
holds the model's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from ..replay.python_state import PythonState

__all__ = ["side_effects_undone"]


def _fork_rng(device_type: str) -> contextlib.AbstractContextManager:
    """Restore the CPU generator, and the backend's device generators, on exit."""
    if device_type in ("cpu", "meta"):
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(device_type=device_type)


@contextlib.contextmanager
def side_effects_undone(model: nn.Module, device_type: str) -> Iterator[None]:
    """Run the body with ``.grad`` cleared; on exit restore gradients, buffers, RNG, training flags and Python state.

    ``device_type``: where the model's tensors live, so that its generators are restored too."""
    grads = {p: p.grad for p in model.parameters()}
    slots = [(module, dict(module._buffers)) for module in model.modules()]
    buffers = {b: b.detach().clone() for b in model.buffers() if b.device.type != "meta"}
    training = {m: m.training for m in model.modules()}
    python_state = PythonState(model.modules(), (), {})
    with _fork_rng(device_type):
        try:
            for parameter in grads:  # backward would accumulate into the caller's grads in place
                parameter.grad = None
            yield
        finally:
            for parameter, grad in grads.items():
                parameter.grad = grad
            for module, held in slots:  # NOTE [Rebound buffers]
                module._buffers.clear()
                module._buffers.update(held)
            with torch.no_grad():
                for buffer, value in buffers.items():
                    buffer.copy_(value)
            for module, flag in training.items():
                module.training = flag
            python_state.put_back()
