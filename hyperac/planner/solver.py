"""Choose one mode per layer: the fastest predicted step whose predicted peak fits the budget.

The peak of a plan (NOTE [Peak phases], :mod:`.profile`) is a maximum over the layers of the
kept bytes of the layers before one plus that layer's residual, so it is checked layer by layer
while walking the layers in order. :func:`choose_modes` is a dynamic program over the bytes kept
by the layers walked so far: on a byte grid, exactly when the byte counts' common divisor makes a
fine enough grid, else with each layer's bytes rounded up (a chosen plan never exceeds the budget).
The objective is predicted seconds; ``objective="flops"`` minimises replayed FLOPs instead, and
``bound="kept"`` bounds only the bytes kept when backward starts (hyperac's earlier meaning of a
budget, which lets the recompute transients of backward exceed it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import ConfigError
from .cost import ESTIMATE_MODES, Estimate

__all__ = ["choose_modes"]


def _cost(estimate: Estimate, position: int, mode: str, objective: str) -> float:
    layer = estimate.layers[position]
    return layer.recompute_flops[mode] if objective == "flops" else layer.seconds[mode]


def choose_modes(estimate: Estimate, budget_bytes: int, modes: Sequence[str] = ESTIMATE_MODES, grid: int = 1 << 16,
                 *, bound: str = "peak", objective: str = "seconds") -> list[str]:
    """The per-layer modes with the smallest predicted cost whose predicted bytes fit the budget.

    Args:
        bound: ``"peak"``: :meth:`Estimate.peak_bytes` <= budget; ``"kept"``:
            :meth:`Estimate.total_bytes` <= budget.
        objective: ``"seconds"`` (:meth:`Estimate.step_seconds`) or ``"flops"`` (replayed FLOPs).

    Raises:
        ConfigError: no plan fits (even every layer in full recompute is over the budget).
    """
    count = len(estimate.layers)
    measure = estimate.peak_bytes if bound == "peak" else estimate.total_bytes
    floor = measure(["full"] * count)
    if floor > budget_bytes:
        what = "peak" if bound == "peak" else "bytes kept for backward"
        raise ConfigError(
            f"budget of {budget_bytes} bytes ({budget_bytes / 2**20:.1f} MiB) is below the smallest plan: "
            f"{floor} bytes ({floor / 2**20:.1f} MiB, {what}) with every layer in full recompute; raise the budget "
            "or shrink the batch or sequence."
        )

    if "off" in modes and measure(["off"] * count) <= budget_bytes:
        return ["off"] * count  # nothing recomputed: nothing to gain

    def residual(position: int, mode: str) -> int:
        if bound == "kept":
            return 0
        layer = estimate.layers[position]
        return max(layer.forward_peak_bytes[mode], layer.backward_peak_bytes[mode], estimate._outside(position))

    final = estimate._outside(count) if bound == "peak" else estimate.outside_bytes
    capacity = budget_bytes - final  # the bytes all layers may keep together
    divisor = math.gcd(*(layer.kept_bytes[m] for layer in estimate.layers for m in modes)) or 1
    unit = divisor * max(1, math.ceil(max(budget_bytes, 1) / (divisor * grid)))
    slots = max(capacity, 0) // unit + 1
    best = torch.full((slots,), math.inf, dtype=torch.float64)
    best[0] = 0.0
    choices = []
    for position, layer in enumerate(estimate.layers):
        candidates = torch.full((len(modes), slots), math.inf, dtype=torch.float64)
        for row, mode in enumerate(modes):
            weight = math.ceil(layer.kept_bytes[mode] / unit)
            # Slots (rounded-up kept bytes of the layers before) at which this layer's residual fits.
            fits = (budget_bytes - residual(position, mode)) // unit + 1
            usable = min(fits, slots - weight)
            if usable > 0:
                candidates[row, weight:weight + usable] = best[:usable] + _cost(estimate, position, mode, objective)
        best, choice = candidates.min(dim=0)
        choices.append(choice.to(torch.int8))
    if math.isinf(best.min().item()):
        return ["full"] * count
    slot = int(best.argmin())
    chosen: list[str] = []
    for position, choice in zip(reversed(range(count)), reversed(choices)):
        mode = modes[int(choice[slot])]
        chosen.append(mode)
        slot -= math.ceil(estimate.layers[position].kept_bytes[mode] / unit)
    return list(reversed(chosen))
