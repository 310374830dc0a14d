"""Choose one mode per layer: the fastest predicted step whose predicted peak fits the budget.

The peak of a plan (NOTE [Peak phases], :mod:`.profile`) is a maximum over the layers of the
kept bytes of the layers before one plus that layer's residual, so it is checked layer by layer
while walking the layers in order. :func:`choose_modes` is a dynamic program over the bytes kept
by the layers walked so far: on a byte grid, exactly when the byte counts' common divisor makes a
fine enough grid, else with each layer's bytes rounded up (a chosen plan never exceeds the budget).
The objective is predicted seconds; ``objective="flops"`` minimises replayed FLOPs instead, and
``bound="kept"`` bounds only the bytes kept when backward starts (hyperac's earlier meaning of a
budget, which lets the recompute transients of backward exceed it).

Swap options (:data:`~hyperac.planner.cost.SWAP_OPTIONS`, in ``modes`` where the backend can
swap) enter the program with their device bytes and seconds, exposed copy time included. Two of
their costs are not per layer, so the program's answer is checked and, if need be, solved again:
the bytes in flight to the next swapping layer (NOTE [Swap in the plan]) by the exact peak, with
the budget lowered by the excess; the pinned host budget by dropping the swap option of the
layer with the most host bytes until the plan fits.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import ConfigError
from .cost import ESTIMATE_MODES, Estimate, split_option

__all__ = ["choose_modes"]


def _cost(estimate: Estimate, position: int, mode: str, objective: str) -> float:
    if objective == "flops":
        return estimate.layers[position].recompute_flops[split_option(mode)[0]]
    return estimate.option_seconds(position, mode)


def choose_modes(estimate: Estimate, budget_bytes: int, modes: Sequence[str] = ESTIMATE_MODES, grid: int = 1 << 16,
                 *, bound: str = "peak", objective: str = "seconds", host_budget_bytes: int | None = None) -> list[str]:
    """The per-layer modes with the smallest predicted cost whose predicted bytes fit the budget.

    Args:
        modes: the choices per layer: modes, and swap options where the backend can swap (the
            model's last layer never offloads, NOTE [Swap in the plan]).
        bound: ``"peak"``: :meth:`Estimate.peak_bytes` <= budget; ``"kept"``:
            :meth:`Estimate.total_bytes` <= budget.
        objective: ``"seconds"`` (:meth:`Estimate.step_seconds`) or ``"flops"`` (replayed FLOPs).
        host_budget_bytes: the most :meth:`Estimate.host_bytes` a plan may hold (``None``: no bound).

    Raises:
        ConfigError: no plan fits (even every layer in full recompute is over the budget).
    """
    count = len(estimate.layers)
    allowed = [[m for m in modes if not (split_option(m)[1] and position == count - 1)] for position in range(count)]
    measure = estimate.peak_bytes if bound == "peak" else estimate.total_bytes
    target = budget_bytes
    while True:
        chosen = _solve(estimate, budget_bytes, target, allowed, grid, bound, objective)
        if host_budget_bytes is not None and estimate.host_bytes(chosen) > host_budget_bytes:
            heaviest = max(range(count), key=lambda p: estimate.layer_host_bytes(p, chosen[p]))
            allowed[heaviest] = [m for m in allowed[heaviest] if not split_option(m)[1]]
            continue
        excess = measure(chosen) - budget_bytes
        if excess <= 0 or not any(split_option(m)[1] for m in chosen):
            return chosen
        target -= excess  # bytes in flight between swapping layers (NOTE [Swap in the plan])
        if measure(["full"] * count) > target:
            allowed = [[m for m in options if not split_option(m)[1]] for options in allowed]
            target = budget_bytes


def _solve(estimate: Estimate, budget_bytes: int, target: int, allowed: list[list[str]], grid: int, bound: str,
           objective: str) -> list[str]:
    """The dynamic program: the cheapest per-layer choices whose per-layer bytes fit ``target``."""
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

    if all("off" in options for options in allowed) and measure(["off"] * count) <= budget_bytes:
        return ["off"] * count  # nothing recomputed: nothing to gain

    def residual(position: int, option: str) -> int:
        if bound == "kept":
            return 0
        layer, mode = estimate.layers[position], split_option(option)[0]
        return max(layer.forward_peak_bytes[mode], layer.backward_peak_bytes[mode], estimate._outside(position))

    final = estimate._outside(count) if bound == "peak" else estimate.outside_bytes
    capacity = target - final  # the bytes all layers may keep together
    weights = [{m: estimate.kept_on_device(p, m) for m in options} for p, options in enumerate(allowed)]
    divisor = math.gcd(*(w for per_layer in weights for w in per_layer.values())) or 1
    unit = divisor * max(1, math.ceil(max(budget_bytes, 1) / (divisor * grid)))
    slots = max(capacity, 0) // unit + 1
    best = torch.full((slots,), math.inf, dtype=torch.float64)
    best[0] = 0.0
    choices = []
    for position, options in enumerate(allowed):
        candidates = torch.full((len(options), slots), math.inf, dtype=torch.float64)
        for row, option in enumerate(options):
            weight = math.ceil(weights[position][option] / unit)
            # Slots (rounded-up kept bytes of the layers before) at which this layer's residual fits.
            fits = (target - residual(position, option)) // unit + 1
            usable = min(fits, slots - weight)
            if usable > 0:
                candidates[row, weight:weight + usable] = best[:usable] + _cost(estimate, position, option, objective)
        best, choice = candidates.min(dim=0)
        choices.append(choice.to(torch.int8))
    if math.isinf(best.min().item()):
        return ["full"] * count
    slot = int(best.argmin())
    chosen: list[str] = []
    for position, choice in zip(reversed(range(count)), reversed(choices)):
        option = allowed[position][int(choice[slot])]
        chosen.append(option)
        slot -= math.ceil(weights[position][option] / unit)
    return list(reversed(chosen))
