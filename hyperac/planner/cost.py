"""The cost model: per layer and mode, seconds and bytes; per plan, step time and peak memory.

:class:`Estimate` holds, per layer and per mode, the activation bytes kept for backward, the
residual peaks of NOTE [Peak phases] (in :mod:`.profile`), the FLOPs replayed, and the seconds
the layer's forward and backward take. For a plan (one mode per layer) it predicts:

- ``peak_bytes``: the peak of live activation memory over the step, what ``budget=`` bounds;
- ``total_bytes``: the bytes kept when backward starts (the smaller, older measure);
- ``step_seconds``: the step's time, the sum of the layers' times under their modes and the time
  outside the layers;
- ``host_bytes``: the pinned host memory its swaps hold.

A plan's entry per layer is a mode or a swap option (:data:`SWAP_OPTIONS`, NOTE [Swap in the plan]).

Seconds are measured on real tensors (the layers timed at their boundaries, without the profiler:
everything a mode costs, its dispatch overhead included). On ``meta`` they are a roofline on a
:class:`~hyperac.planner.devices.DeviceProfile` plus the host cost per op measured on this host
(:mod:`.dispatch`): eager ops, for selective modes each recorded and replayed op, and for every mode that
recomputes a constant per layer invocation.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from ..swap import host_buffer_bytes
from .devices import DeviceProfile
from .dispatch import HostCosts
from .profile import ModeProfile

__all__ = ["ESTIMATE_MODES", "SWAP_OPTIONS", "Estimate", "LayerEstimate", "build_estimate", "split_option"]

ESTIMATE_MODES = ("off", "pointwise", "selective", "selective-even", "full")
SWAP_OPTIONS = ("full+swap", "selective+swap", "swap")
"""Per-layer choices that swap: recompute with the layer inputs in host memory
(``Config.swap_inputs`` for that layer), and ``swap`` mode (its saved tensors in host memory)."""
_RECORDING_MODES = ("pointwise", "selective", "selective-even")
FORWARD_SHARE = 1 / 3
"""The share of a layer's measured forward-plus-backward seconds spent in forward (backward runs
about two matmuls per forward one): the compute a swap copy hides behind (NOTE [Swap in the plan])."""

# NOTE [Swap in the plan]
# A swapping layer i moves ``offload_bytes`` to host memory: the storages its profiled forward
# saved that a swap would free (NOTE [What a swap would move] in profile.py: its inputs when it
# recomputes, its saved tensors in ``swap`` mode), less those under ``min_swap_bytes``, which
# ``SwapManager`` keeps on the device. A swap option that would move nothing is never chosen. As
# ``SwapManager`` does (NOTE [Swap stream ordering] in swap.py), they leave the device at the end
# of the next swapping layer's forward and are prefetched when that layer's backward starts, so
# they stay on the device from layer i+1 to that next swapping layer: the peak adds them to those
# layers' residuals, and removes them from the kept bytes behind everything later. The model's
# last swapping layer keeps its tensors (its backward comes first), so the last layer never
# offloads: when any layer swaps, the solver puts the last layer in the chain (``plan_swaps``).
# The copy each way hides behind layer i+1: the device -> host copy behind its forward, the host
# -> device prefetch behind its backward, both taken as the ``off`` seconds of layer i+1 split by
# :data:`FORWARD_SHARE`; what does not hide is exposed, ``max(0, bytes / link bandwidth -
# compute)``, and added to layer i's seconds. Host memory is one pooled buffer per storage,
# rounded up to a power of two (``host_buffer_bytes``).


def split_option(option: str) -> tuple[str, bool]:
    """A plan entry as (mode, whether the layer offloads): ``"full+swap"`` -> ``("full", True)``."""
    if option == "swap":
        return "off", True
    mode, plus, _ = option.partition("+")
    return mode, bool(plus)


@dataclasses.dataclass(frozen=True)
class LayerEstimate:
    """One layer's cost under each mode."""

    index: int
    fqn: str
    kept_bytes: dict[str, int]
    """Activation bytes this layer keeps between forward and backward, per mode."""
    recompute_flops: dict[str, int]
    """FLOPs this layer replays in backward, per mode."""
    forward_peak_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    """Live bytes during its forward beyond the layers before it (NOTE [Peak phases])."""
    backward_peak_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    """Live bytes during its backward (replay and activation gradients included) beyond the
    layers before it."""
    seconds: dict[str, float] = dataclasses.field(default_factory=dict)
    """Forward plus backward seconds, per mode."""
    offload_storages: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    """Per mode, the bytes of each storage a swap of this layer would move to host memory (NOTE
    [What a swap would move] in profile.py), whatever their size."""
    noise_seconds: float = 0.0
    """Seconds apart that its timing cannot tell modes (NOTE [Ties within the noise] in solver.py)."""
    route_bytes: int = 0
    """The bytes of the routes this layer decides in forward, which every mode that replays keeps
    (counted in :attr:`kept_bytes`; NOTE [Routing is kept] in replay/routing.py)."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Per-layer costs of every mode, plus what lives outside the layers."""

    layers: tuple[LayerEstimate, ...]
    outside_bytes: int
    """Activation bytes outside the layers kept at backward start: embeddings, final norm, loss."""
    base_flops: int
    """Forward plus backward FLOPs with nothing recomputed."""
    outside_peak_bytes: tuple[int, ...] = ()
    """Live bytes of ops outside the layers beyond the kept bytes of the first ``k`` layers, for
    ``k = 0..len(layers)`` (embeddings: 0 layers behind; logits and loss: all of them)."""
    outside_seconds: float = 0.0
    """Seconds outside the layers: embeddings, head, loss, optimizer-free backward of those."""
    timing: str = ""
    """Where the seconds come from: measured on a backend, or a roofline on a device profile."""
    link_bandwidth: float = math.inf
    """Host link bytes/s, one direction, for swap copies (NOTE [Swap in the plan])."""
    min_swap_bytes: int = 0
    """Storages smaller than this stay on the device (``Config.min_swap_bytes``)."""

    def offloaded_storages(self, position: int, option: str) -> tuple[int, ...]:
        """The bytes of each storage layer ``position`` moves to host memory under ``option``."""
        mode, swaps = split_option(option)
        if not swaps:
            return ()
        return tuple(n for n in self.layers[position].offload_storages.get(mode, ()) if n >= self.min_swap_bytes)

    def offload_bytes(self, position: int, option: str) -> int:
        """Device bytes that layer ``position`` moves to host memory under ``option`` (0: no swap)."""
        return sum(self.offloaded_storages(position, option))

    def kept_on_device(self, position: int, option: str) -> int:
        """Bytes layer ``position`` keeps on the device between its forward and backward."""
        return self.layers[position].kept_bytes[split_option(option)[0]] - self.offload_bytes(position, option)

    def exposed_copy_seconds(self, position: int, option: str) -> float:
        """The seconds of layer ``position``'s swap copies that its neighbour's compute does not hide."""
        nbytes = self.offload_bytes(position, option)
        if not nbytes or position + 1 >= len(self.layers):
            return 0.0
        copy = nbytes / self.link_bandwidth
        behind = self.layers[position + 1].seconds["off"]
        return max(0.0, copy - FORWARD_SHARE * behind) + max(0.0, copy - (1 - FORWARD_SHARE) * behind)

    def option_seconds(self, position: int, option: str) -> float:
        """Layer ``position``'s seconds under ``option``, exposed swap copy time included."""
        return self.layers[position].seconds[split_option(option)[0]] + self.exposed_copy_seconds(position, option)

    def layer_host_bytes(self, position: int, option: str) -> int:
        """Pinned host bytes layer ``position``'s swap holds under ``option`` (NOTE [Swap in the plan])."""
        return sum(host_buffer_bytes(n) for n in self.offloaded_storages(position, option))

    def host_bytes(self, options: Sequence[str]) -> int:
        """Pinned host bytes the plan's swaps hold."""
        return sum(self.layer_host_bytes(p, o) for p, o in enumerate(options))

    def total_bytes(self, modes: Sequence[str]) -> int:
        """Predicted activation bytes kept on the device when backward starts, with these per-layer
        modes (or swap options)."""
        return self.outside_bytes + sum(self.kept_on_device(p, m) for p, m in enumerate(modes))

    def bounded_bytes(self, modes: Sequence[str], bound: str) -> int:
        """What a budget bounds (``bound`` as for :func:`~hyperac.planner.solver.choose_modes`): :meth:`peak_bytes`
        for ``"peak"``, :meth:`total_bytes` for ``"kept"``."""
        return self.peak_bytes(modes) if bound == "peak" else self.total_bytes(modes)

    def peak_bytes(self, modes: Sequence[str]) -> int:
        """Predicted peak of live activation bytes over the step (NOTE [Peak phases], NOTE [Swap in
        the plan])."""
        behind, peak, in_flight = 0, 0, 0
        for position, (layer, option) in enumerate(zip(self.layers, modes)):
            mode = split_option(option)[0]
            peak = max(peak, behind + self._outside(position),
                       behind + in_flight + layer.forward_peak_bytes[mode],
                       behind + in_flight + layer.backward_peak_bytes[mode])
            behind += self.kept_on_device(position, option)
            if split_option(option)[1]:  # the group before leaves the device as this layer's forward ends
                in_flight = self.offload_bytes(position, option)
        return max(peak, behind + self._outside(len(self.layers)))

    def _outside(self, behind: int) -> int:
        return self.outside_peak_bytes[behind] if self.outside_peak_bytes else 0

    def step_seconds(self, modes: Sequence[str]) -> float:
        """Predicted seconds of one forward and backward with these per-layer modes."""
        return self.outside_seconds + sum(self.option_seconds(p, m) for p, m in enumerate(modes))

    def total_recompute_flops(self, modes: Sequence[str]) -> int:
        """Predicted FLOPs replayed in backward with these per-layer modes."""
        return sum(layer.recompute_flops[split_option(m)[0]] for layer, m in zip(self.layers, modes))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        head = f"{'#':>4}  {'layer':<24}" + "".join(f"  {m + ' MiB/ms':>22}" for m in ESTIMATE_MODES)
        lines = [head]
        for layer in self.layers:
            row = f"{layer.index:>4}  {layer.fqn:<24}"
            for mode in ESTIMATE_MODES:
                cell = f"{layer.kept_bytes[mode] / 2**20:.2f}/{layer.seconds.get(mode, 0.0) * 1e3:.2f}"
                row += f"  {cell:>22}"
            lines.append(row)
        lines.append("(MiB kept for backward / ms forward+backward, per layer)")
        for mode in ESTIMATE_MODES:
            modes = [mode] * len(self.layers)
            lines.append(
                f"all {mode:<14} peak {self.peak_bytes(modes) / 2**20:>10.2f} MiB, "
                f"kept {self.total_bytes(modes) / 2**20:>10.2f} MiB, step {self.step_seconds(modes) * 1e3:>9.2f} ms, "
                f"{self.total_recompute_flops(modes) / 1e9:>10.3f} GFLOP replayed"
            )
        lines.append(f"outside the layers (embeddings, logits, loss): {self.outside_bytes / 2**20:.2f} MiB kept; "
                     f"step without recompute: {self.base_flops / 1e9:.3f} GFLOP; times: {self.timing}")
        return "\n".join(lines)


def _layer_seconds(position: int, mode: str, profiles: dict[str, ModeProfile], device: DeviceProfile | None,
                   host: HostCosts | None) -> float:
    profile = profiles[mode]
    if device is None:
        return profile.seconds.get(position, 0.0)
    ops = profile.forward_ops.get(position, 0) + profile.backward_ops.get(position, 0)
    host_seconds = ops * host.per_op
    if mode != "off":
        host_seconds += host.per_region
    if mode in _RECORDING_MODES:
        host_seconds += profile.forward_ops.get(position, 0) * host.per_recorded_op
    device_seconds = device.seconds(profile.work.get(position, ()))
    return max(device_seconds, host_seconds) if device.asynchronous else device_seconds + host_seconds


def build_estimate(layers: Sequence[Any], profiles: dict[str, ModeProfile], device: DeviceProfile | None = None,
                   host: HostCosts | None = None, timing: str = "", link_bandwidth: float = math.inf) -> Estimate:
    """An :class:`Estimate` from uniform-mode profiles; seconds measured (``device=None``) or a
    roofline on ``device`` with ``host`` costs per op; swap copies at ``link_bandwidth`` bytes/s."""
    modes = list(profiles)
    off = profiles["off"]
    estimates = tuple(
        LayerEstimate(
            index=layer.index, fqn=layer.fqn,
            kept_bytes={m: profiles[m].kept.get(position, 0) for m in modes},
            recompute_flops={m: max(profiles[m].backward_flops.get(position, 0) - off.backward_flops.get(position, 0),
                                    0) for m in modes},
            forward_peak_bytes={m: profiles[m].forward_peak.get(position, 0) for m in modes},
            backward_peak_bytes={m: profiles[m].backward_peak.get(position, 0) for m in modes},
            seconds={m: _layer_seconds(position, m, profiles, device, host) for m in modes},
            offload_storages={m: tuple(profiles[m].offloadable.get(position, ())) for m in modes},
            noise_seconds=off.noise.get(position, 0.0) if device is None else 0.0,
            route_bytes=off.routes.get(position, 0),
        )
        for position, layer in enumerate(layers)
    )
    outside_peak = tuple(max(p.outside_peak.get(k, 0) for p in profiles.values()) for k in range(len(layers) + 1))
    if device is None:
        outside_seconds = min(p.seconds.get(None, 0.0) for p in profiles.values())
    else:
        outside_seconds = device.seconds(off.work.get(None, ())) + (
            off.forward_ops.get(None, 0) + off.backward_ops.get(None, 0)) * host.per_op
    return Estimate(estimates, off.kept.get(None, 0), off.total_flops, outside_peak, outside_seconds, timing,
                    link_bandwidth)
