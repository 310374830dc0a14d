"""The first training step after ``mode="auto"`` checks the plan's prediction, once.

NOTE [First-step check]
The plan predicts the activation bytes alive when backward starts from one profiled step of the
sample; a training batch that differs (longer sequences, another shape) can miss it. The first
training forward after ``apply`` runs under an :class:`~hyperac.measure.ActivationMeter`; when it
returns, the tensors it returned are released (they are the caller's: an HF user keeps ``out``,
logits included, alive across ``out.loss.backward()``, and the profile does not count them
either), and when backward starts the live bytes are compared with the prediction: a miss of more
than 10% warns once. Then the hooks remove themselves. They are instances of module-level classes
(:class:`CheckStart`, :class:`CheckEnd`), so a copied or pickled model carries its own pending
check, and :func:`remove_first_step_check` finds them by scanning the model's hook tables and
removes them by the handles their registration returned (NOTE [Hook handles in copies] in state.py).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten
from torch.utils.hooks import RemovableHandle

from ..errors import HyperACWarning
from ..measure import ActivationMeter

__all__ = ["CheckEnd", "CheckStart", "install_first_step_check", "remove_first_step_check"]


class CheckStart:
    """Forward pre-hook: the first training forward starts recording."""

    def __init__(self, predicted: int) -> None:
        self.predicted = predicted
        self.meter: ActivationMeter | None = None
        self.handles: tuple[RemovableHandle, ...] = ()
        """Of this hook and its :class:`CheckEnd`."""

    def __call__(self, module: nn.Module, args: Any) -> None:
        if module.training and torch.is_grad_enabled() and self.meter is None:
            self.meter = ActivationMeter()
            self.meter.__enter__()

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "meter": None}


class CheckEnd:
    """Forward hook (always called): stop recording, release the outputs, compare at backward start."""

    def __init__(self, start: CheckStart) -> None:
        self.start = start

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        meter = self.start.meter
        if meter is None or not meter._recording:
            return
        meter.__exit__(None, None, None)
        meter._recording = False
        remove_first_step_check(module)
        meter.release(output)
        grad_fn = _first_grad_fn(output)
        if grad_fn is not None:
            grad_fn.register_prehook(_Compare(meter, self.start.predicted))


class _Compare:
    """Autograd pre-hook on the loss: backward starts; compare once."""

    def __init__(self, meter: ActivationMeter, predicted: int) -> None:
        self.meter, self.predicted, self.done = meter, predicted, False

    def __call__(self, grad_outputs: Any) -> None:
        if self.done:
            return
        self.done = True
        measured, predicted = self.meter.alive_bytes(), self.predicted
        if abs(measured - predicted) > 0.1 * predicted:
            warnings.warn(
                f"the first step kept {measured} activation bytes ({measured / 2**20:.1f} MiB) but the plan "
                f"predicted {predicted} ({predicted / 2**20:.1f} MiB), a miss of more than 10%; the sample given "
                "to mode='auto' may not match the training batches.",
                HyperACWarning, stacklevel=2,
            )


def _first_grad_fn(output: Any) -> Any:
    loss = getattr(output, "loss", None)
    candidates = [loss] if isinstance(loss, torch.Tensor) else []
    candidates += [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
    return next((t.grad_fn for t in candidates if t.grad_fn is not None), None)


def install_first_step_check(model: nn.Module, predicted: int) -> None:
    """Check the first training step of ``model`` against ``predicted`` kept bytes (NOTE [First-step check])."""
    start = CheckStart(predicted)
    start.handles = (model.register_forward_pre_hook(start),
                     model.register_forward_hook(CheckEnd(start), always_call=True))


def remove_first_step_check(model: nn.Module) -> None:
    """Remove a pending first-step check from ``model`` (nothing if there is none)."""
    for start in [hook for hook in model._forward_pre_hooks.values() if isinstance(hook, CheckStart)]:
        for handle in start.handles:
            handle.remove()
