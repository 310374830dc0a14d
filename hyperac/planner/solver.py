"""Choose one mode per layer: the fastest predicted step whose predicted peak fits the budget.

The peak of a plan (NOTE [Peak phases], :mod:`.profile`) is a maximum over the layers of the
kept bytes of the layers before one plus that layer's residual, so it is checked layer by layer
while walking the layers in order. :func:`choose_modes` is a dynamic program over the bytes kept
by the layers walked so far: on a byte grid, exactly when the byte counts' common divisor makes a
fine enough grid, else with each layer's bytes rounded up (a chosen plan never exceeds the budget).
The objective is predicted seconds (modes within the timing's noise tied, NOTE [Ties within the
noise]); ``objective="flops"`` minimises replayed FLOPs instead, and
``bound="kept"`` bounds only the bytes kept when backward starts (hyperac's earlier meaning of a
budget, which lets the recompute transients of backward exceed it).

Swap options (:data:`~hyperac.planner.cost.SWAP_OPTIONS`, in ``modes`` where the backend can
swap) enter the program with their device bytes and seconds, exposed copy time included; one that
would move nothing is left out. Two of their costs are not per layer, and the program carries
both exactly (NOTE [Swap in the solver]): the bytes still in flight from the last swapping layer
(NOTE [Swap in the plan]), and, when the best plan without it is over the pinned host budget,
the host bytes used so far.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..errors import ConfigError
from .cost import ESTIMATE_MODES, Estimate, LayerEstimate, split_option

__all__ = ["choose_modes", "tied_seconds"]

# NOTE [Ties within the noise]
# The same job must get the same plan run to run, but a layer's measured seconds move with the
# host's load (NOTE [Timing on a drifting host] in profile.py): two modes closer than the noise of
# the layer's timing (``LayerEstimate.noise_seconds``: its off-vs-off control, and at least
# ``NOISE_FLOOR`` of its ``off`` seconds) rank one way in one run and the other way in the next, and
# the plan would follow. So the solver ties them. Per layer, the recompute modes sorted by seconds
# form classes, each mode within the noise of the class's fastest; every mode of a class costs the
# class's fastest seconds, plus steps of ``TIE_STEP`` of that (far below any difference the timing
# resolves, so they never trade against another layer's seconds) in a fixed order: fewer kept bytes
# first, then fewer replayed FLOPs, then the order of ``ESTIMATE_MODES``. Modes further apart than
# the noise keep their measured order. ``off`` ties with none: every mode runs at least its work
# (NOTE [When the rounds stop]), so where the timing cannot tell them apart ``off`` is no slower,
# and a busy host (noise as large as a whole replay) does not turn every plan into ``full``.
# Predictions (``Estimate.step_seconds``) stay the measured seconds.
TIE_STEP = 1e-9


def tied_seconds(layer: LayerEstimate) -> dict[str, float]:
    """The layer's seconds per mode as the solver weighs them (NOTE [Ties within the noise])."""
    classes: list[list[str]] = []
    tied = {mode: layer.seconds[mode] for mode in layer.seconds if mode == "off"}
    recompute = [mode for mode in layer.seconds if mode != "off"]
    for mode in sorted(recompute, key=lambda m: (layer.seconds[m], ESTIMATE_MODES.index(m))):
        if not classes or layer.seconds[mode] - layer.seconds[classes[-1][0]] > layer.noise_seconds:
            classes.append([])
        classes[-1].append(mode)
    for members in classes:
        fastest = layer.seconds[members[0]]
        ranked = sorted(members, key=lambda m: (layer.kept_bytes[m], layer.recompute_flops[m], ESTIMATE_MODES.index(m)))
        tied.update({mode: fastest * (1 + step * TIE_STEP) for step, mode in enumerate(ranked)})
    return tied


def _costs(estimate: Estimate, options: Sequence[str], position: int, objective: str) -> list[float]:
    layer = estimate.layers[position]
    if objective == "flops":
        return [layer.recompute_flops[split_option(option)[0]] for option in options]
    tied = tied_seconds(layer)
    return [tied[split_option(option)[0]] + estimate.exposed_copy_seconds(position, option) for option in options]


# NOTE [Swap in the solver]
# A plan's peak at layer p is the kept bytes behind it, plus the bytes in flight from the last
# swapping layer before it, plus its residual. The in-flight bytes are one of few values (0, or
# the offload of some swap option: the layers of a model are alike, so in practice two or three),
# so the program's state is (bytes kept behind, which in-flight value, host bytes used): a swap
# option moves the state to its own in-flight value, any other option keeps it. Each check is
# then the one Estimate.peak_bytes makes, and the answer is the optimum over all plans, up to the
# byte grid. More than MAX_IN_FLIGHT distinct values are rounded up to the next kept one (a plan
# then never exceeds the budget, but may be a little worse than the best). The host dimension is
# added only when the best plan without it holds more pinned bytes than the host budget, on a
# coarse grid (about HOST_GRID host units, chosen to round the layers' host bytes up least; the
# byte grid 64 times coarser): a plan never exceeds either budget, but on a large model it may
# leave part of the host budget unused and take about a second (128 layers, on this CPU).
MAX_IN_FLIGHT = 16
HOST_GRID = 128


def choose_modes(estimate: Estimate, budget_bytes: int, modes: Sequence[str] = ESTIMATE_MODES, grid: int = 1 << 16,
                 *, bound: str = "peak", objective: str = "seconds", host_budget_bytes: int | None = None) -> list[str]:
    """The per-layer modes with the smallest predicted cost whose predicted bytes fit the budget.

    Args:
        modes: the choices per layer: modes, and swap options where the backend can swap (the
            model's last layer never offloads, NOTE [Swap in the plan]; an option that would
            offload nothing is never chosen).
        bound: ``"peak"``: :meth:`Estimate.peak_bytes` <= budget; ``"kept"``:
            :meth:`Estimate.total_bytes` <= budget.
        objective: ``"seconds"`` (:meth:`Estimate.step_seconds`) or ``"flops"`` (replayed FLOPs).
        host_budget_bytes: the most :meth:`Estimate.host_bytes` a plan may hold (``None``: no bound).

    Raises:
        ConfigError: no plan fits (even every layer in full recompute is over the budget).
    """
    count = len(estimate.layers)
    allowed = [[m for m in modes if not split_option(m)[1] or (position < count - 1 and estimate.offload_bytes(
        position, m) > 0)] for position in range(count)]
    if all("off" in options for options in allowed) and estimate.bounded_bytes(["off"] * count, bound) <= budget_bytes:
        return ["off"] * count  # nothing recomputed: nothing to gain
    program = _Program(estimate, budget_bytes, allowed, bound, objective)
    unbounded = program.solve(grid)
    chosen = unbounded
    if unbounded is not None and host_budget_bytes is not None and estimate.host_bytes(unbounded) > host_budget_bytes:
        chosen = program.solve(max(grid // 64, 1), host_budget_bytes, max(HOST_GRID, grid // 512))
    floor = estimate.bounded_bytes(["full"] * count, bound)
    if chosen is not None:
        return chosen
    if floor <= budget_bytes:
        return ["full"] * count  # the grid's rounding lost it
    if unbounded is not None:
        needed = estimate.host_bytes(unbounded)
        raise ConfigError(
            f"budget of {budget_bytes} bytes ({budget_bytes / 2**20:.1f} MiB) fits only with layers swapped to host "
            f"memory: the plan needs {needed} bytes ({needed / 2**20:.1f} MiB) of pinned host memory, over the host "
            f"budget of {host_budget_bytes} bytes ({host_budget_bytes / 2**20:.1f} MiB); raise host_budget_bytes= "
            "(hyperac plan: --host-budget) or the device budget."
        )
    what = "peak" if bound == "peak" else "bytes kept for backward"
    swaps = " (nor with any swap option)" if any(split_option(m)[1] for options in allowed for m in options) else ""
    raise ConfigError(
        f"budget of {budget_bytes} bytes ({budget_bytes / 2**20:.1f} MiB) is below the smallest plan: "
        f"{floor} bytes ({floor / 2**20:.1f} MiB, {what}) with every layer in full recompute{swaps}; raise the "
        "budget or shrink the batch or sequence."
    )


def _unit(values: Sequence[int], limit: int, grid: int) -> int:
    """A grid step that divides every value where ``limit / grid`` allows, else a multiple of their divisor."""
    divisor = math.gcd(*values) or 1
    return divisor * max(1, math.ceil(max(limit, 1) / (divisor * grid)))


def _host_unit(values: Sequence[int], budget: int, grid: int) -> int:
    """The host grid step: :func:`_unit`'s where it divides every value, else, among steps that
    cut the budget into ``grid / 2`` to ``grid`` parts, the one that wastes the smallest share of
    the values' rounded-up sizes (summed over the distinct values)."""
    unit = _unit(values, budget, grid)
    distinct = {v for v in values if v}
    if not distinct or all(v % unit == 0 for v in distinct):
        return unit
    steps = {math.ceil(max(budget, 1) / parts) for parts in range(max(grid // 2, 1), grid + 1)}
    return min(steps, key=lambda step: (sum(1 - v / (math.ceil(v / step) * step) for v in distinct), step))


class _Program:
    """The dynamic program of NOTE [Swap in the solver] for one estimate, budget and choice set."""

    def __init__(self, estimate: Estimate, budget_bytes: int, allowed: list[list[str]], bound: str,
                 objective: str) -> None:
        self.estimate, self.budget, self.allowed = estimate, budget_bytes, allowed
        self.peak = bound == "peak"
        count = len(estimate.layers)
        self.weights = [[estimate.kept_on_device(p, m) for m in options] for p, options in enumerate(allowed)]
        self.hosts = [[estimate.layer_host_bytes(p, m) for m in options] for p, options in enumerate(allowed)]
        self.costs = [_costs(estimate, options, p, objective) for p, options in enumerate(allowed)]
        offloads = sorted({estimate.offload_bytes(p, m) for p, options in enumerate(allowed) for m in options
                           if split_option(m)[1]}) if self.peak else []
        if len(offloads) > MAX_IN_FLIGHT - 1:  # keep evenly spaced ones, the largest among them
            kept = MAX_IN_FLIGHT - 1
            offloads = [offloads[round(i * (len(offloads) - 1) / (kept - 1))] for i in range(kept)]
        self.in_flight = [0, *offloads]
        self.final = estimate._outside(count) if self.peak else estimate.outside_bytes

    def _state_of(self, offload: int) -> int:
        """The in-flight state of an offload: the smallest kept value at least as large."""
        return next(i for i, value in enumerate(self.in_flight) if value >= offload) if self.peak else 0

    def _residual(self, position: int, option: str) -> int:
        layer, mode = self.estimate.layers[position], split_option(option)[0]
        return max(layer.forward_peak_bytes[mode], layer.backward_peak_bytes[mode])

    def solve(self, grid: int, host_budget: int | None = None, host_grid: int = HOST_GRID) -> list[str] | None:
        """The cheapest plan on a grid of about ``grid`` byte units (and ``host_grid`` host units
        under ``host_budget``), or ``None`` if none fits."""
        estimate, allowed, budget = self.estimate, self.allowed, self.budget
        if budget < 0:
            return None
        # The cells (slots per in-flight state) stay about ``grid``: as fast with swap as without.
        unit = _unit([abs(w) for per_layer in self.weights for w in per_layer], budget,
                     max(grid // len(self.in_flight), 1))
        steps = [[math.ceil(w / unit) for w in per_layer] for per_layer in self.weights]
        offset = -sum(min(0, *per_layer) for per_layer in steps)
        slots = offset + budget // unit + 1
        if host_budget is None:
            host_slots, host_steps = 1, [[0] * len(options) for options in allowed]
        else:
            host_unit = _host_unit([h for per_layer in self.hosts for h in per_layer], host_budget, host_grid)
            host_slots = host_budget // host_unit + 1
            host_steps = [[math.ceil(h / host_unit) for h in per_layer] for per_layer in self.hosts]
        states = len(self.in_flight)
        best = torch.full((states, host_slots, slots), math.inf, dtype=torch.float64)
        best[0, 0, offset] = 0.0
        backs: list[tuple[torch.Tensor, dict[int, torch.Tensor]]] = []
        rows = torch.empty((max(map(len, allowed)), *best.shape), dtype=torch.float64)
        for position, options in enumerate(allowed):
            outside = estimate._outside(position) if self.peak else 0
            candidates = rows[: len(options)].fill_(math.inf)
            came: dict[int, torch.Tensor] = {}
            for row, option in enumerate(options):
                step, host_step, cost = steps[position][row], host_steps[position][row], self.costs[position][row]
                if host_step >= host_slots:
                    continue
                # Per in-flight state, the last slot (kept bytes behind, rounded up) where this option fits.
                residual = self._residual(position, option) if self.peak else 0
                last = [slots - 1 if not self.peak else min(slots - 1, offset + (
                    budget - max(outside, flight + residual)) // unit) for flight in self.in_flight]
                low = max(0, -step)
                if split_option(option)[1]:
                    # From the cheapest state it fits in, to the in-flight state of its own offload.
                    masked = best.clone()
                    for state, end in enumerate(last):
                        masked[state, :, max(end + 1, 0):] = math.inf
                    value, source = masked.min(dim=0)
                    state = self._state_of(estimate.offload_bytes(position, option))
                    end = slots - max(step, 0)
                    if low < end:
                        target = (slice(host_step, None), slice(low + step, end + step))
                        torch.add(value[: host_slots - host_step, low:end], cost, out=candidates[row, state][target])
                        came[row] = torch.zeros((host_slots, slots), dtype=torch.int8)
                        came[row][target] = source[: host_slots - host_step, low:end]
                    continue
                for state, end in enumerate(last):
                    end = min(end, slots - 1 - step)
                    if low <= end:
                        torch.add(best[state, :, low:end + 1], cost,
                                  out=candidates[row, state, :, low + step:end + step + 1])
            best, choice = candidates.min(dim=0)
            backs.append((choice.to(torch.int8), came))
        last = min(slots - 1, offset + (budget - self.final) // unit)
        if last < 0 or math.isinf(best[..., : last + 1].min().item()):
            return None
        flat = int(best[..., : last + 1].reshape(-1).argmin())
        state, host, slot = flat // (host_slots * (last + 1)), flat // (last + 1) % host_slots, flat % (last + 1)
        chosen: list[str] = []
        for position in reversed(range(len(allowed))):
            choice, came = backs[position]
            row = int(choice[state, host, slot])
            if row in came:
                state = int(came[row][host, slot])
            chosen.append(allowed[position][row])
            slot -= steps[position][row]
            host -= host_steps[position][row]
        return list(reversed(chosen))
