"""``mode="auto"`` and ``hyperac.estimate``: profile the model, build the cost model, choose.

``apply`` and ``estimate`` hand this module the layers they found and a *runner*: a function that
applies one uniform mode to a model and returns its undo (``apply``'s own machinery, passed in so
that the planner does not import the API that imports it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..budget import parse_budget
from ..discovery import Layer
from .attention import fused_attention_on_meta
from .cost import ESTIMATE_MODES, Estimate, build_estimate
from .devices import device_profile
from .dispatch import describe, host_costs
from .profile import profile_modes
from .restore import side_effects_undone
from .solver import choose_modes

__all__ = ["auto_modes", "estimate_layers"]

Runner = Callable[[nn.Module, Sequence[str] | None], Callable[[str], Callable[[], None]]]
"""``runner(model, containers)(mode)`` applies ``mode`` to every layer of those containers (``None``:
discovered) and returns the undo."""
TIMED_STEPS = 2
"""Timed steps per mode after the profiled one, on real tensors (the fastest per layer is used)."""


def _device_type(model: nn.Module) -> str:
    first = next(iter(model.parameters()), None)
    return "cpu" if first is None else first.device.type


def estimate_layers(model: nn.Module, sample: Any, layers: Sequence[Layer], runner: Runner, backend: Any,
                    device: str | None = None) -> Estimate:
    """Profile one step of ``model`` per uniform mode and return the cost model.

    On real tensors the layers' seconds are measured on ``backend``. On ``meta`` they are a
    roofline on the device profile ``device`` (default ``"cpu"``: this host) plus host costs per
    op measured once per process. Gradients, buffers, RNG and training flags are left as they were.
    """
    on_meta = _device_type(model) == "meta"
    with side_effects_undone(model, backend.device_type), fused_attention_on_meta(on_meta):
        model.train()
        profiles = profile_modes(
            model, sample, [layer.module for layer in layers], ESTIMATE_MODES,
            runner(model, list(dict.fromkeys(layer.container for layer in layers))),
            timed_steps=0 if on_meta else TIMED_STEPS, synchronize=backend.synchronize,
        )
    if not on_meta:
        return build_estimate(layers, profiles, timing=f"measured on {backend.name}")
    profile = device_profile(device or "cpu")
    host = host_costs(torch.device("cpu"), runner)
    return build_estimate(layers, profiles, profile, host,
                          timing=f"roofline on {profile.name}, host {describe(host)}")


def auto_modes(model: nn.Module, layers: Sequence[Layer], budget: Any, sample: Any, runner: Runner,
               backend: Any) -> tuple[list[str], dict[str, Any]]:
    """The per-layer modes ``mode="auto"`` applies, and the plan's predictions."""
    estimate = estimate_layers(model, sample, layers, runner, backend)
    off = ["off"] * len(layers)
    budget_bytes = parse_budget(budget, estimate.peak_bytes(off))
    modes = choose_modes(estimate, budget_bytes)
    return modes, {
        "predicted_bytes": estimate.total_bytes(modes),
        "predicted_peak_bytes": estimate.peak_bytes(modes),
        "predicted_step_seconds": estimate.step_seconds(modes),
        "predicted_recompute_flops": estimate.total_recompute_flops(modes),
        "budget_bytes": budget_bytes,
    }
