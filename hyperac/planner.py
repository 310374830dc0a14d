"""Estimate what each mode costs per layer, and choose the cheapest plan that fits a budget.

:func:`estimate` runs the model once per mode on a sample (forward and backward) under a
profiling dispatch mode and attributes every activation byte kept for backward and every FLOP
replayed in backward to the layer that produced it. It works on real tensors and on models built
on the ``meta`` device, so a 70B-parameter geometry can be estimated on a laptop CPU without
allocating it (on ``meta``, data-dependent scalars such as "is there padding?" read as 1/True, and
attention is costed as the fused flash kernel an accelerator would run).

:func:`choose_modes` then picks a mode per layer (``off``, ``pointwise``, ``selective``,
``selective-even``, ``full``) minimising replayed FLOPs subject to the byte budget: a multiple-choice knapsack,
solved by dynamic programming over a byte grid: exactly when the byte counts' common divisor gives
a fine enough grid, else with each layer's bytes rounded up (a chosen plan never exceeds the budget).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from .errors import ConfigError
from .measure import created_storages, flop_counter

__all__ = ["ESTIMATE_MODES", "Estimate", "LayerEstimate", "choose_modes", "parse_budget"]

ESTIMATE_MODES = ("off", "pointwise", "selective", "selective-even", "full")
_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


@dataclasses.dataclass(frozen=True)
class LayerEstimate:
    """One layer's cost under each mode."""

    index: int
    fqn: str
    kept_bytes: dict[str, int]
    """Activation bytes this layer keeps between forward and backward, per mode."""
    recompute_flops: dict[str, int]
    """FLOPs this layer replays in backward, per mode."""
    swap_bytes: int
    """Bytes a swap of this layer would move each way (what it keeps with no recompute)."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Per-layer costs of every mode, plus what lives outside the layers."""

    layers: tuple[LayerEstimate, ...]
    outside_bytes: int
    """Activation bytes outside the layers: embeddings, final norm, logits, loss."""
    base_flops: int
    """Forward plus backward FLOPs with nothing recomputed."""

    def total_bytes(self, modes: Sequence[str]) -> int:
        """Predicted activation bytes kept for backward with these per-layer modes."""
        return self.outside_bytes + sum(layer.kept_bytes[m] for layer, m in zip(self.layers, modes))

    def total_recompute_flops(self, modes: Sequence[str]) -> int:
        """Predicted FLOPs replayed in backward with these per-layer modes."""
        return sum(layer.recompute_flops[m] for layer, m in zip(self.layers, modes))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def __str__(self) -> str:
        head = f"{'#':>4}  {'layer':<28}" + "".join(f"  {m + ' MiB':>18}  {m + ' GFLOP':>20}" for m in ESTIMATE_MODES)
        lines = [head]
        for layer in self.layers:
            row = f"{layer.index:>4}  {layer.fqn:<28}"
            for mode in ESTIMATE_MODES:
                row += f"  {layer.kept_bytes[mode] / 2**20:>18.2f}  {layer.recompute_flops[mode] / 1e9:>20.3f}"
            lines.append(row)
        for mode in ESTIMATE_MODES:
            modes = [mode] * len(self.layers)
            lines.append(
                f"all {mode:<14} {self.total_bytes(modes) / 2**20:>12.2f} MiB kept, "
                f"{self.total_recompute_flops(modes) / 1e9:>10.3f} GFLOP replayed"
            )
        lines.append(f"outside the layers (embeddings, logits, loss): {self.outside_bytes / 2**20:.2f} MiB; "
                     f"step without recompute: {self.base_flops / 1e9:.3f} GFLOP")
        return "\n".join(lines)


class _Profiler(TorchDispatchMode):
    """Attributes forward-created storages and backward FLOPs to the layer that ran them."""

    def __init__(self, owner_of: dict[int, int]) -> None:
        super().__init__()
        self.owner_of = owner_of
        self.stack: list[int] = []
        self.backward = False
        self.storages: dict[int, tuple[weakref.ref, int | None]] = {}
        self.flops: dict[int | None, int] = defaultdict(int)
        self.total_flops = 0
        self.registry = flop_counter().flop_registry

    @contextlib.contextmanager
    def tracking(self) -> Iterator[None]:
        """Follow which layer runs, through global module hooks (removed on exit)."""
        def enter(module: nn.Module, args: Any) -> None:
            owner = self.owner_of.get(id(module))
            if owner is not None:
                self.stack.append(owner)

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if self.owner_of.get(id(module)) is not None and self.stack:
                self.stack.pop()

        hooks = [nn.modules.module.register_module_forward_pre_hook(enter),
                 nn.modules.module.register_module_forward_hook(leave, always_call=True)]
        try:
            with self:
                yield
        finally:
            for hook in hooks:
                hook.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return True if args[0].dtype is torch.bool else 1
        out = func(*args, **kwargs)
        owner = self.stack[-1] if self.stack else None
        formula = self.registry.get(func._overloadpacket)
        if formula is not None:
            flops = int(formula(*args, **kwargs, out_val=out))
            self.total_flops += flops
            if self.backward:
                self.flops[owner] += flops
        if not self.backward:
            for storage in created_storages((args, kwargs), out):
                self.storages[storage._cdata] = (weakref.ref(storage), owner)
        return out

    def kept_bytes(self) -> dict[int | None, int]:
        kept: dict[int | None, int] = defaultdict(int)
        for ref, owner in self.storages.values():
            storage = ref()
            if storage is not None:
                kept[owner] += storage.nbytes()
        return kept


@contextlib.contextmanager
def _fused_attention_on_meta() -> Iterator[None]:
    """While profiling, send SDPA on ``meta`` tensors to the fused CPU flash kernel.

    On ``meta`` SDPA takes its math path and keeps the seq x seq attention matrix, which no
    accelerator run keeps; the flash kernel's meta functions give the shapes, saved tensors and
    FLOPs of fused attention. The function is swapped (not a torch-function mode) because the
    recompute in backward must take the same path as the forward. Side effect: for the duration,
    ``torch.nn.functional.scaled_dot_product_attention`` is this wrapper.
    """
    original = F.scaled_dot_product_attention

    def fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type != "meta":
            return original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            repeats = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
        )[0]

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def _loss(model: nn.Module, sample: Any) -> torch.Tensor:
    if callable(sample):
        return sample(model)
    output = model(**sample)
    loss = getattr(output, "loss", None)
    if loss is None:
        first = output if isinstance(output, torch.Tensor) else next(
            v for v in tree_flatten(output)[0] if isinstance(v, torch.Tensor)
        )
        loss = first.float().mean()
    return loss


def _fork_rng(device_type: str) -> contextlib.AbstractContextManager:
    """Restore the CPU generator, and the backend's device generators, on exit."""
    if device_type in ("cpu", "meta"):
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(device_type=device_type)


@contextlib.contextmanager
def _side_effects_undone(model: nn.Module, device_type: str) -> Iterator[None]:
    """Gradients, buffers, RNG and training flags are as they were after the profiling steps."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = {b: b.detach().clone() for b in model.buffers() if b.device.type != "meta"}
    training = {m: m.training for m in model.modules()}
    with _fork_rng(device_type):
        try:
            for parameter in grads:  # backward would accumulate into the caller's grads in place
                parameter.grad = None
            yield
        finally:
            for parameter, grad in grads.items():
                parameter.grad = grad
            with torch.no_grad():
                for buffer, value in buffers.items():
                    buffer.copy_(value)
            for module, flag in training.items():
                module.training = flag


def profile(
    model: nn.Module, sample: Any, layers: Sequence[Any], run_mode: Callable[[str], Any], device_type: str = "cpu"
) -> Estimate:
    """Run one step per mode (``run_mode(mode)`` applies it and returns an undo callable).

    ``device_type``: where the model's tensors live, so that its RNG is restored afterwards."""
    owner_of: dict[int, int] = {}
    for layer in layers:
        for module in layer.module.modules():
            owner_of.setdefault(id(module), layer.index)
    kept: dict[str, dict[int | None, int]] = {}
    replayed: dict[str, dict[int | None, int]] = {}
    base_flops = 0
    with _side_effects_undone(model, device_type), _fused_attention_on_meta():
        model.train()
        for mode in ESTIMATE_MODES:
            undo = run_mode(mode)
            try:
                profiler = _Profiler(owner_of)
                torch.manual_seed(0)
                with profiler.tracking():
                    loss = _loss(model, sample)
                    kept[mode] = profiler.kept_bytes()
                    profiler.backward = True
                    loss.backward()
                    del loss
                replayed[mode] = dict(profiler.flops)
                if mode == "off":
                    base_flops = profiler.total_flops
            finally:
                undo()
            model.zero_grad(set_to_none=True)
    estimates = tuple(
        LayerEstimate(
            index=layer.index, fqn=layer.fqn,
            kept_bytes={m: kept[m].get(layer.index, 0) for m in ESTIMATE_MODES},
            recompute_flops={m: replayed[m].get(layer.index, 0) for m in ESTIMATE_MODES},
            swap_bytes=kept["off"].get(layer.index, 0),
        )
        for layer in layers
    )
    return Estimate(estimates, kept["off"].get(None, 0), base_flops)


def parse_budget(budget: Any, off_bytes: int | None = None) -> int:
    """Bytes from an int, a string like ``"24GiB"``, or a fraction (0, 1] of ``off_bytes``."""
    if isinstance(budget, bool):
        raise ConfigError(f"Config.budget must be bytes, a size like '24GiB' or a fraction in (0, 1]; got {budget!r}.")
    if isinstance(budget, int) and budget > 0:
        return budget
    if isinstance(budget, float) and 0 < budget <= 1:
        if off_bytes is None:
            return -1
        return int(budget * off_bytes)
    if isinstance(budget, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", budget)
        unit = match.group(2).lower() if match else None
        if match and unit in _UNITS and int(float(match.group(1)) * _UNITS[unit]) > 0:
            return int(float(match.group(1)) * _UNITS[unit])
    raise ConfigError(
        f"Config.budget must be a positive byte count, a size like '24GiB' or '512MB', or a fraction in (0, 1] "
        f"of the no-recompute activation bytes; got {budget!r}."
    )


def choose_modes(estimate: Estimate, budget_bytes: int, modes: Sequence[str] = ESTIMATE_MODES,
                 grid: int = 1 << 16) -> list[str]:
    """The per-layer modes with the fewest replayed FLOPs whose predicted bytes fit the budget.

    Raises:
        ConfigError: even recomputing every layer in full does not fit.
    """
    capacity = budget_bytes - estimate.outside_bytes
    floor = estimate.total_bytes(["full"] * len(estimate.layers))
    if capacity < 0 or floor > budget_bytes:
        raise ConfigError(
            f"budget of {budget_bytes} bytes ({budget_bytes / 2**20:.1f} MiB) is below the smallest plan: "
            f"{floor} bytes ({floor / 2**20:.1f} MiB) with every layer in full recompute; raise the budget or "
            "shrink the batch or sequence."
        )
    if "off" in modes and estimate.total_bytes(["off"] * len(estimate.layers)) <= budget_bytes:
        return ["off"] * len(estimate.layers)
    # A multiple of the byte counts' common divisor: exact (no rounding) when the grid allows it.
    divisor = math.gcd(*(layer.kept_bytes[mode] for layer in estimate.layers for mode in modes)) or 1
    unit = divisor * max(1, math.ceil(capacity / (divisor * grid)))
    slots = capacity // unit + 1
    best = torch.zeros(slots, dtype=torch.float64)
    choices = []
    for layer in estimate.layers:
        candidates = torch.full((len(modes), slots), math.inf, dtype=torch.float64)
        for row, mode in enumerate(modes):
            weight = math.ceil(layer.kept_bytes[mode] / unit)
            if weight < slots:
                candidates[row, weight:] = best[: slots - weight] + layer.recompute_flops[mode]
        best, choice = candidates.min(dim=0)
        choices.append(choice.to(torch.int8))
    if math.isinf(best[-1].item()):
        return ["full"] * len(estimate.layers)
    chosen: list[str] = []
    slot = slots - 1
    for layer, choice in zip(reversed(estimate.layers), reversed(choices)):
        mode = modes[int(choice[slot])]
        chosen.append(mode)
        slot -= math.ceil(layer.kept_bytes[mode] / unit)
    return list(reversed(chosen))
