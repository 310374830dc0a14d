"""``mode="auto"`` and ``hyperac.estimate``: profile the model, build the cost model, choose.

``apply`` and ``estimate`` hand this module the layers they found and a *runner*: a function that
applies one uniform mode to a model and returns its undo (``apply``'s own machinery, passed in so
that the planner does not import the API that imports it).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..backends.base import host_link_override
from ..budget import parse_budget
from ..discovery import Layer
from .attention import fused_attention_on_meta
from .cost import ESTIMATE_MODES, SWAP_OPTIONS, Estimate, build_estimate, split_option
from .devices import DEVICES, device_profile
from .dispatch import describe, host_costs
from .group import ALONE, PlanGroup, agree_on_options, slowest
from .lengths import batch_shape, bucket_bounds, fitted_estimates, length_buckets, sequence_length, truncated
from .prefix import profiled_stack
from .profile import profile_modes
from .restore import side_effects_undone
from .solver import choose_modes

__all__ = ["auto_modes", "estimate_layers"]

Runner = Callable[[nn.Module, Sequence[str] | None], Callable[[str], Callable[[], None]]]
"""``runner(model, containers)(mode)`` applies ``mode`` to every layer of those containers (``None``:
discovered) and returns the undo."""
TIMED_ROUNDS = 2
"""The fewest timed rounds after the profiled steps, on real tensors (NOTE [Timing on a drifting
host] in :mod:`.profile`)."""


def _device_type(model: nn.Module) -> str:
    first = next(iter(model.parameters()), None)
    return "cpu" if first is None else first.device.type


def estimate_layers(model: nn.Module, sample: Any, layers: Sequence[Layer], runner: Runner, backend: Any,
                    device: str | None = None, timed: bool = True, group: PlanGroup = ALONE) -> Estimate:
    """Profile one step of ``model`` per uniform mode and return the cost model.

    On real tensors the layers' seconds are measured on ``backend``. On ``meta`` they are a
    roofline on the device profile ``device`` (default ``"cpu"``: this host) plus host costs per
    op measured once per process (``timed=False``: no seconds). Gradients, buffers, RNG and training
    flags are left as they were. With a ``group`` of ranks, every rank profiles and the cost model
    is the slowest rank's (NOTE [One plan per job] in group.py).
    """
    on_meta = _device_type(model) == "meta"
    # The sim backend's per-op compute time (NOTE [The virtual clock]) is part of what is timed.
    computing = getattr(backend, "computing", contextlib.nullcontext)
    with side_effects_undone(model, backend.device_type), fused_attention_on_meta(on_meta), computing():
        model.train()  # on meta, maybe a prefix of the layers: NOTE [A prefix of a deep stack]
        profiles = profiled_stack(model, layers, on_meta, lambda profiled: profile_modes(
            model, sample, [layer.module for layer in profiled], ESTIMATE_MODES, _mixed_runner(model, profiled, runner),
            rounds=TIMED_ROUNDS if timed and not on_meta else 0,
            clock=lambda: backend.clock(getattr(next(model.parameters(), None), "device", None)), group=group,
        ))
    if not on_meta:
        estimate = build_estimate(layers, profiles, timing=f"measured on {backend.name}",
                                  link_bandwidth=link_bandwidth(backend, model))
    else:
        profile = device_profile(device or "cpu")
        host = host_costs(torch.device("cpu"), runner)
        estimate = build_estimate(layers, profiles, profile, host,
                                  timing=f"roofline on {profile.name}, host {describe(host)}",
                                  link_bandwidth=host_link_override() or profile.host_link_bandwidth)
    return slowest(group.gather(lambda: estimate, "sharing its measurements"), group.size)


def _mixed_runner(model: nn.Module, layers: Sequence[Layer], runner: Runner) -> Callable[[Any], Callable[[], None]]:
    """``run(mode)`` for :func:`profile_modes`: one mode on every layer, or a tuple of per-layer modes."""
    run = runner(model, list(dict.fromkeys(layer.container for layer in layers)))

    def run_mode(modes: str | tuple[str, ...]) -> Callable[[], None]:
        if isinstance(modes, str):
            return run(modes)
        per_container: dict[str, dict[int, str]] = {}
        for layer, mode in zip(layers, modes):
            local = per_container.setdefault(layer.container, {})
            local[len(local)] = mode
        return run(per_container)

    return run_mode


def link_bandwidth(backend: Any, model: nn.Module) -> float:
    """The host link's bytes/s for ``model``'s swap copies: the backend's figure for the device of
    its parameters where it has one (measured once per process and device;
    ``HYPERAC_HOST_LINK_BANDWIDTH`` overrides it), else the slowest link of the device profiles."""
    first = next(model.parameters(), None)
    measured = backend.host_link_bandwidth(None if first is None else first.device) if backend.can_swap else None
    return measured if measured is not None else min(profile.host_link_bandwidth for profile in DEVICES.values())


def last_swap(swaps: Sequence[bool]) -> int | None:
    """The last swapping layer: it keeps its tensors (its backward comes first) but stays in the chain
    (NOTE [Swap in the plan]), and a plan records it as not swapping."""
    return max((i for i, flag in enumerate(swaps) if flag), default=None)


def plan_swaps(modes: Sequence[str], offloads: Sequence[bool]) -> tuple[list[str], list[bool]]:
    """Per-layer modes and swap flags (``apply``'s meaning) for layers that offload. When any does,
    the last layer joins the swap chain without offloading (NOTE [Swap in the plan]); ``off``
    there becomes ``swap``, which keeps its tensors on the device as the chain's last layer."""
    modes, swaps = list(modes), list(offloads)
    if any(swaps):
        swaps[-1] = True
        modes[-1] = "swap" if modes[-1] == "off" else modes[-1]
    return modes, swaps


def auto_modes(model: nn.Module, layers: Sequence[Layer], budget: Any, sample: Any, runner: Runner,
               backend: Any, host_budget_bytes: int, min_swap_bytes: int = 0, max_seq_len: int | None = None,
               seq_dim: int = 1, buckets: int = 1, group: PlanGroup = ALONE,
               ) -> tuple[list[str], list[bool], dict[str, Any]]:
    """The per-layer modes and swap flags ``mode="auto"`` applies, and the plan's predictions.
    Swap is a choice where ``backend.can_swap``, within ``host_budget_bytes`` of pinned memory,
    moving the storages of at least ``min_swap_bytes`` (NOTE [Swap in the plan]). With
    ``max_seq_len``, the plan is made for that sequence length (dimension ``seq_dim`` of the
    sample's tensors), so that every batch up to it fits, and one more per length bucket
    (``buckets`` of them, from the same profiles; :mod:`.lengths`). With a ``group`` of ranks, one
    plan for all of them (NOTE [One plan per job] in group.py)."""
    agree_on_options(group, budget, sample, [layer.fqn for layer in layers], {
        "max_seq_len=": max_seq_len, "seq_dim=": seq_dim, "length_buckets=": buckets, "min_swap_bytes=": min_swap_bytes,
        "backend": backend.name})
    # Swap needs pinned host memory on every rank: the job's is the least any rank has.
    host_budget_bytes = min(group.gather(lambda: host_budget_bytes, "sharing its host budget"))
    if max_seq_len is None:
        estimates = [estimate_layers(model, sample, layers, runner, backend, group=group)]
    else:
        bounds = bucket_bounds(max_seq_len, buckets)
        estimates = fitted_estimates(lambda length, timed: estimate_layers(
            model, truncated(sample, seq_dim, length), layers, runner, backend, timed=timed, group=group),
            sequence_length(sample, seq_dim), bounds)
    estimates = [dataclasses.replace(estimate, min_swap_bytes=min_swap_bytes) for estimate in estimates]
    estimate = estimates[-1]
    off = ["off"] * len(layers)
    budget_bytes = parse_budget(budget, estimate.peak_bytes(off))
    options = ESTIMATE_MODES + SWAP_OPTIONS if backend.can_swap else ESTIMATE_MODES
    chosen = choose_modes(estimate, budget_bytes, options, host_budget_bytes=host_budget_bytes)
    modes, swaps, prediction = resolve_choice(estimate, chosen, budget_bytes, max_seq_len)
    if max_seq_len is not None:
        prediction["buckets"] = length_buckets(bounds, estimates, chosen, modes, budget_bytes)
        prediction["batch_shape"] = batch_shape(sample, seq_dim, max_seq_len)
        prediction["seq_dim"] = seq_dim
    if group.size > 1:
        prediction["group_size"] = group.size
    return modes, swaps, prediction


def resolve_choice(estimate: Estimate, chosen: Sequence[str], budget_bytes: int, max_seq_len: int | None = None
                   ) -> tuple[list[str], list[bool], dict[str, Any]]:
    """The solver's per-layer options as ``apply``'s modes and swap flags, with the plan's predictions
    (``mode="auto"``, and ``hyperac plan --output``)."""
    modes, swaps = plan_swaps([split_option(o)[0] if o != "swap" else o for o in chosen],
                              [split_option(o)[1] for o in chosen])
    return modes, swaps, {
        "predicted_bytes": estimate.total_bytes(chosen),
        "predicted_peak_bytes": estimate.peak_bytes(chosen),
        "predicted_step_seconds": estimate.step_seconds(chosen),
        "predicted_recompute_flops": estimate.total_recompute_flops(chosen),
        "predicted_swap_bytes": sum(estimate.offload_bytes(p, o) for p, o in enumerate(chosen)),
        "budget_bytes": budget_bytes,
        "max_seq_len": max_seq_len,
        "notes": _saves_nothing_note(estimate) + _routes_note(estimate, modes),
    }


def _routes_note(estimate: Estimate, modes: Sequence[str]) -> list[str]:
    """The plan's note on the layers that route data-dependently and replay: what their kept routes cost
    (NOTE [Routing is kept] in replay/routing.py)."""
    layers = [layer for layer, mode in zip(estimate.layers, modes) if layer.route_bytes and mode not in ("off", "swap")]
    if not layers:
        return []
    names = ", ".join(layer.fqn for layer in layers[:3]) + (", ..." if len(layers) > 3 else "")
    total = sum(layer.route_bytes for layer in layers)
    return [
        f"{len(layers)} recomputed layer(s) route data-dependently ({names}): their replays take the forward's routes, "
        f"kept for backward, {total / 2**10:.1f} KiB per step, counted in the prediction (NOTE [Routing is kept])."
    ]


def _saves_nothing_note(estimate: Estimate) -> list[str]:
    """The plan's note on layers where the recording modes keep no less than ``full`` (NOTE [Never
    keep more than off] in policy.py): there they only add recording time."""
    recording = ("pointwise", "selective", "selective-even")
    layers = [layer for layer in estimate.layers
              if all(layer.kept_bytes[mode] >= layer.kept_bytes["full"] for mode in recording)]
    if not layers:
        return []
    return [
        f"pointwise and selective save no memory over full on {len(layers)} layer(s) ({layers[0].fqn}, ...), "
        "and cost recording time there; a layer whose kept op outputs are tensors the un-applied layer does not "
        "keep (a convolution before a frozen BatchNorm) keeps only those it does (NOTE [Never keep more than off])."
    ]
