"""``mode="auto"`` with ``compile=True``: plan for what the compiled layers keep.

The eager profile (:mod:`.profile`) measures what eager layers keep and how long they take; a
compiled layer keeps less (the partitioner saves only what backward reads, and recomputes cheap
ops even in ``off``) and runs at another speed, so a plan made from the eager profile spends its
budget on the wrong layers. Here every mode is applied with ``compile=True`` and each layer's
forward compiled (:data:`PROFILE_BACKEND`), and per layer and mode the profile reads:

* the bytes the compiled step saves for backward: ``saved_tensors_hooks`` around the step, each
  storage counted once, for the layer whose forward saved it first (parameters excluded; saves
  outside the layers, embeddings and loss, are ``outside_bytes``);
* the seconds, from timed compiled steps (the eager profile's interleaved rounds, NOTE [Timing on
  a drifting host] in :mod:`.profile`);
* the FLOPs replayed: the step's FLOPs over ``off``'s, shared evenly by the layers.

The solver is the eager one, bounding the bytes kept for backward (``bound="kept"``): a budget is
a fraction of compiled ``off``'s saved bytes (or bytes), which is what a compiled graph's memory
knob (``activation_memory_budget``) is a fraction of too. Swap options are not offered: a compiled
swap offloads what the layer keeps (NOTE [Swap under torch.compile] in compiled.py), which this
profile does not price. Timing uses :data:`PROFILE_BACKEND`, which partitions as Inductor does but
generates no code: seconds compare modes, they are not Inductor's.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ..budget import parse_budget
from ..discovery import Layer
from ..measure import flop_counter
from .cost import ESTIMATE_MODES, Estimate, LayerEstimate
from .profile import _loss, _timed_rounds, _watch
from .restore import side_effects_undone
from .solver import choose_modes

__all__ = ["PROFILE_BACKEND", "compiled_auto_modes", "compiled_estimate"]

PROFILE_BACKEND = "aot_eager_decomp_partition"
"""AOTAutograd with Inductor's decompositions and min-cut partitioner, without code generation."""


class _Compiled:
    """``run_mode`` for the profile: apply the mode (``compile=True``), compile each layer's forward;
    calling the result undoes both."""

    def __init__(self, run_mode: Callable[[str], Callable[[], None]], layer_modules: Sequence[nn.Module]) -> None:
        self.run_mode, self.layer_modules = run_mode, layer_modules
        self.undo: Callable[[], None] | None = None
        self.forwards: list[Any] = []

    def __call__(self, mode: str) -> _Compiled:
        self.undo = self.run_mode(mode)
        self.forwards = [module.__dict__.get("forward") for module in self.layer_modules]
        for module in self.layer_modules:
            module.forward = torch.compile(module.forward, backend=PROFILE_BACKEND)
        return self

    def restore(self) -> None:
        for module, forward in zip(self.layer_modules, self.forwards):
            if forward is None:
                del module.__dict__["forward"]
            else:
                module.forward = forward
        self.undo()


class _Restore:
    """The undo ``_timed_rounds`` calls after each step of one mode."""

    def __init__(self, compiled: _Compiled) -> None:
        self.compiled = compiled

    def __call__(self) -> None:
        self.compiled.restore()


class _SavedBytes:
    """Saved-tensor pack hook that attributes each saved storage to the layer running (layer
    boundaries from :func:`~.profile._watch`); each storage once, parameters excluded."""

    def __init__(self, parameters: Sequence[torch.Tensor]) -> None:
        self.excluded = {p.untyped_storage().data_ptr() for p in parameters}
        self.position: int | None = None
        self.owners: dict[int, tuple[int | None, int]] = {}

    def boundary(self, position: int, kind: str) -> None:
        if kind == "forward-start":
            self.position = position
        elif kind == "forward-end":
            self.position = None

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self.excluded and storage.nbytes():
            self.owners.setdefault(pointer, (self.position, storage.nbytes()))
        return tensor

    def by_layer(self) -> dict[int | None, int]:
        kept: dict[int | None, int] = {}
        for position, nbytes in self.owners.values():
            kept[position] = kept.get(position, 0) + nbytes
        return kept


def _saved_step(model: nn.Module, sample: Any, layer_modules: Sequence[nn.Module]) -> dict[int | None, int]:
    """One compiled step: the bytes it saves for backward, by layer. No dispatch mode is active: one
    (a FLOP counter) changes what the compiled step saves."""
    saved = _SavedBytes(list(model.parameters()))
    handles = _watch(saved, layer_modules)
    try:
        torch.manual_seed(0)
        with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
            loss, output = _loss(model, sample)
            del output
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    model.zero_grad(set_to_none=True)
    return saved.by_layer()


def _step_flops(model: nn.Module, sample: Any) -> int:
    torch.manual_seed(0)
    with flop_counter() as flops:
        loss, output = _loss(model, sample)
        del output
        loss.backward()
    model.zero_grad(set_to_none=True)
    return flops.get_total_flops()


def compiled_estimate(model: nn.Module, sample: Any, layers: Sequence[Layer], run_mode: Callable,
                      backend: Any, rounds: int) -> Estimate:
    """The cost model of compiled layers (module docstring); ``run_mode(mode)`` applies ``mode``
    with ``compile=True`` to every layer and returns the undo."""
    modules = [layer.module for layer in layers]
    compiled = _Compiled(run_mode, modules)
    kept, flops = {}, {}
    with side_effects_undone(model, backend.device_type):
        model.train()
        for mode in ESTIMATE_MODES:
            compiled(mode)
            try:
                kept[mode] = _saved_step(model, sample, modules)  # compiles first
                flops[mode] = _step_flops(model, sample)
            finally:
                compiled.restore()
        seconds = _timed_rounds(model, sample, modules, ESTIMATE_MODES, lambda mode: _Restore(compiled(mode)),
                                rounds, backend.synchronize)
    count = len(layers)
    estimates = tuple(
        LayerEstimate(
            index=layer.index, fqn=layer.fqn,
            kept_bytes={m: kept[m].get(position, 0) for m in ESTIMATE_MODES},
            recompute_flops={m: max(flops[m] - flops["off"], 0) // count for m in ESTIMATE_MODES},
            seconds={m: seconds[m][position] for m in ESTIMATE_MODES},
        )
        for position, layer in enumerate(layers)
    )
    return Estimate(estimates, kept["off"].get(None, 0), flops["off"],
                    outside_seconds=statistics.median(seconds[m][None] for m in ESTIMATE_MODES),
                    timing=f"compiled steps ({PROFILE_BACKEND}) on {backend.name}")


def compiled_auto_modes(model: nn.Module, layers: Sequence[Layer], budget: Any, sample: Any, run_mode: Callable,
                        backend: Any, rounds: int) -> tuple[list[str], list[bool], dict[str, Any]]:
    """``mode="auto"`` under ``compile=True``: per-layer modes (no swap) and the plan's predictions;
    the budget bounds the bytes the compiled step saves for backward."""
    estimate = compiled_estimate(model, sample, layers, run_mode, backend, rounds)
    budget_bytes = parse_budget(budget, estimate.total_bytes(["off"] * len(layers)))
    chosen = choose_modes(estimate, budget_bytes, ESTIMATE_MODES, bound="kept")
    return chosen, [False] * len(chosen), {
        "predicted_bytes": estimate.total_bytes(chosen),
        "predicted_step_seconds": estimate.step_seconds(chosen),
        "predicted_recompute_flops": estimate.total_recompute_flops(chosen),
        "predicted_swap_bytes": 0,
        "budget_bytes": budget_bytes,
    }

