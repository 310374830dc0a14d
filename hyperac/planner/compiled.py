"""``mode="auto"`` with ``compile=True``: plan for what the compiled layers keep.

The eager profile (:mod:`.profile`) measures what eager layers keep and how long they take; a
compiled layer keeps less (the partitioner saves only what backward reads, and recomputes cheap
ops even in ``off``) and runs at another speed, so a plan made from the eager profile spends its
budget on the wrong layers. Here every mode is applied uniformly with ``compile=True``, each
layer compiled as a user compiles it (``layer.compile()``, with the backend ``Config.compile``
names: :func:`compile_backend`), and per mode the profile reads, from whole compiled steps:

* the bytes the step saves for backward: ``saved_tensors_hooks`` around it, distinct storages,
  parameters excluded. No module hook or dispatch mode may be active (either changes the compiled
  layers' graphs), so the bytes are not attributed per layer: the layers share them evenly and
  what lies outside the layers (embeddings, loss) is counted in theirs, which keeps every plan's
  total exact for a stack of identical layers. Layers that differ (a MoE layer among dense ones)
  are priced at the stack's mean;
* the seconds of a step, in interleaved rounds, relative to ``off`` per round (NOTE [Timing on a
  drifting host] in :mod:`.profile`), shared evenly by the layers;
* the FLOPs replayed: the step's FLOPs over ``off``'s, shared evenly by the layers, counted on an
  eager step of the same mode (the compiled menu replays what the eager one does).

The options are :data:`~hyperac.planner.cost.ESTIMATE_MODES`. The knapsack modes (NOTE [Knapsack
layers] in compiled.py) are not among them: a knapsack layer splits a whole-model graph (a graph
break before it), which ``fullgraph=True`` refuses, per layer too (torchtitan compiles each block
so), and on the benchmark's hidden-512 Llama they ran no faster than the five at the same bytes
(every layer ``knapsack-0.75``: 0.997x torch's budget 0.75; ``pointwise``: 0.993x; 30 interleaved
rounds). A user names them with ``layers=`` or ``plan=``.

The solver is the eager one, bounding the bytes kept for backward (``bound="kept"``): a budget is
a fraction of compiled ``off``'s saved bytes (or bytes), which is what a compiled graph's memory
knob (``activation_memory_budget``) is a fraction of too. Its choice is kept only when it beats the
fastest uniform plan that fits by more than the timing noise (NOTE [A mixed plan must beat the
noise]). Swap options are not offered: a compiled swap offloads what the layer keeps (NOTE [Swap
under torch.compile] in compiled.py), which this profile does not price.

NOTE [A mixed plan must beat the noise]
A mixed plan's seconds are predicted, summed from per-layer shares of uniform steps; a uniform
plan's are measured, a whole step each. The solver takes the minimum over many mixed plans, so
where the modes lie within the timing noise of each other it picks whichever noise favoured, and
the plan it returns is slower than predicted (the winner's curse). On the hidden-512 Llama
(``benchmarks/compiled_peers.py``, Inductor, CPU) the per-round step ratios spread by +-5%, and
plans chosen that way ran 1.02-1.09x torch's budget at the same bytes (``eeep``, ``Fspp``), where
the uniform plans that fit ran 0.98-1.02x. So the solver's plan replaces the fastest uniform plan
that fits only when predicted faster than it by more than the noise of the profile: the standard
error of the difference of two medians of per-round ratios to ``off``, from their median absolute
deviation pooled over the modes, at least :data:`NOISE_FLOOR`. The noise falls with the square
root of the rounds, and rounds are cheap where steps are short, so the profile times at least
:data:`COMPILED_ROUNDS` rounds and then more until its timed rounds have taken
:data:`TIMING_SECONDS` (at most :data:`MAX_COMPILED_ROUNDS`): the same however much of the
compiling a warm cache saved. On the demo model (CPU, one thread) that was 45 rounds and a noise
of 2.8% (the minimum of 4 rounds: about 7.6%), in 21 s of planning; on the hidden-512 layer, whose
step takes 1.7 s, the 4 rounds, with a noise of 2.3%, in 71 s.

NOTE [Timing with the user's backend]
The modes are timed compiled with the backend the layers will run under (``Config.compile``), not
a cheaper stand-in. AOTAutograd without code generation (``aot_eager_decomp_partition``)
partitions as Inductor does, but runs every recomputed pointwise op as a kernel of its own, where
Inductor fuses them into the backward's kernels, so it ranks the modes differently: on the demo
model (benchmarks/compiled_peers.py) its seconds had ``pointwise`` 1.047x ``off``'s step and
``selective`` 1.095x, Inductor's 1.006x and 1.059x, and under the bytes of torch's budget 0.75
auto chose ``ssso`` (1.056x torch's step) from the first and ``pppp`` (0.958x) from the second.
The price is compiling the five modes with that backend while planning: on the demo model
(then with 7 timed rounds, CPU) about 21 s with Inductor against 9 s with ``aot_eager_decomp_partition``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..budget import parse_budget
from ..discovery import Layer
from ..measure import flop_counter
from ..plan import mode_letters
from .cost import ESTIMATE_MODES, Estimate, LayerEstimate
from .group import ALONE, PlanGroup, agree_on_options, slowest
from .head import choose_head, fallback_message, head_note
from .profile import _loss
from .restore import side_effects_undone
from .solver import choose_modes

__all__ = ["COMPILED_ROUNDS", "MAX_COMPILED_ROUNDS", "NOISE_FLOOR", "TIMING_SECONDS", "compile_backend",
           "compiled_auto_modes", "compiled_estimate", "more_rounds", "timing_noise"]

COMPILED_ROUNDS = 4
"""The fewest timed rounds of the compiled profile, after the round that compiles and counts (NOTE
[A mixed plan must beat the noise])."""
MAX_COMPILED_ROUNDS = 64
"""The most timed rounds of the compiled profile."""
TIMING_SECONDS = 10.0
"""Past :data:`COMPILED_ROUNDS`, the profile times more rounds until its timed rounds have taken this long."""
NOISE_FLOOR = 0.01
"""The least fraction by which a mixed plan must beat the fastest uniform plan that fits."""


def compile_backend(compile: bool | str) -> str:
    """The ``torch.compile`` backend ``Config.compile`` names: ``True`` is torch.compile's default."""
    return "inductor" if compile is True else compile


class _Compiled:
    """One mode applied with ``compile=True`` and each layer compiled as a user compiles it
    (``layer.compile()``); :meth:`restore` undoes both."""

    def __init__(self, run_mode: Callable[[str], Callable[[], None]], layer_modules: Sequence[nn.Module],
                 mode: str, compiler: str) -> None:
        self.layer_modules = layer_modules
        self.undo = run_mode(mode)
        for module in layer_modules:
            module.compile(backend=compiler)

    def restore(self) -> None:
        for module in self.layer_modules:
            module._compiled_call_impl = None
        self.undo()


@torch._disable_dynamo  # called from compiled layers: never a frame to compile
def _pack(saved: dict[int, int], excluded: set[int], tensor: torch.Tensor) -> torch.Tensor:
    storage = tensor.untyped_storage()
    if storage.data_ptr() not in excluded:
        saved[storage.data_ptr()] = storage.nbytes()
    return tensor


def _step(model: nn.Module, sample: Any, forward: contextlib.AbstractContextManager | None = None) -> None:
    """One training step; ``forward``: a context around its forward only."""
    torch.manual_seed(0)
    with forward or contextlib.nullcontext():
        loss, output = _loss(model, sample)
    del output
    loss.backward()
    model.zero_grad(set_to_none=True)


def _saved_bytes(model: nn.Module, sample: Any) -> int:
    """The bytes one compiled step's forward saves for backward: distinct storages, parameters
    excluded. Not what backward saves as it goes (the chunked head's recomputed chunks, one at a
    time: NOTE [The head and the loss in chunks] in head.py). No module hook and no dispatch mode
    is active: either changes what the compiled layers save."""
    saved: dict[int, int] = {}
    excluded = {p.untyped_storage().data_ptr() for p in model.parameters()}
    _step(model, sample, torch.autograd.graph.saved_tensors_hooks(functools.partial(_pack, saved, excluded), _unpack))
    return sum(saved.values())


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _step_flops(model: nn.Module, sample: Any, undo: Callable[[], None]) -> int:
    """The FLOPs of one step of the applied mode, run eagerly (the compiled menu replays what the
    eager one does), then ``undo()``. A dispatch mode around compiled layers would be traced into
    graphs that dynamo's guards do not tell from the plain ones, and reused for steps without it."""
    try:
        with flop_counter() as flops:
            _step(model, sample)
    finally:
        undo()
    return flops.get_total_flops()


def _timed_step(model: nn.Module, sample: Any, synchronize: Callable[[], None]) -> float:
    synchronize()
    start = time.perf_counter()
    _step(model, sample)
    synchronize()
    return time.perf_counter() - start


def compiled_estimate(model: nn.Module, sample: Any, layers: Sequence[Layer], run_mode: Callable,
                      backend: Any, rounds: int, compiler: str, group: PlanGroup = ALONE) -> tuple[Estimate, float]:
    """The cost model of compiled layers (module docstring) and the noise of its seconds, as a
    fraction of a step (:func:`timing_noise`); ``run_mode(mode)`` applies ``mode`` with
    ``compile=True`` to every layer and returns the undo; ``compiler``: the torch.compile backend
    the layers are compiled with (NOTE [Timing with the user's backend]). With a ``group`` of ranks,
    every step and the number of rounds are agreed, and the cost model is the slowest rank's (NOTE
    [One plan per job] in group.py)."""
    modules = [layer.module for layer in layers]
    saved, flops, readings = {}, {}, {mode: [] for mode in ESTIMATE_MODES}
    order = list(ESTIMATE_MODES)
    with side_effects_undone(model, backend.device_type):
        model.train()
        round_, timing_since = 0, math.inf
        while group.any(more_rounds(round_, rounds, time.perf_counter() - timing_since), "choosing its rounds"):
            if round_ == 1:
                timing_since = time.perf_counter()
            random.Random(round_).shuffle(order)
            for mode in order:
                group.run(functools.partial(_profile_step, model, sample, modules, run_mode, mode, compiler, backend,
                                            round_, (saved, flops, readings)), "in a profiled step")
            round_ += 1
    # NOTE [Timing on a drifting host] in profile.py: per round, each mode relative to off.
    ratios = {m: [t / o for t, o in zip(readings[m], readings["off"])] for m in ESTIMATE_MODES}
    off_seconds = statistics.median(readings["off"])
    seconds = {m: off_seconds * statistics.median(ratios[m]) for m in ESTIMATE_MODES}
    count = len(layers)
    estimates = tuple(
        LayerEstimate(
            index=layer.index, fqn=layer.fqn,
            kept_bytes={m: saved[m] // count for m in ESTIMATE_MODES},
            recompute_flops={m: max(flops[m] - flops["off"], 0) // count for m in ESTIMATE_MODES},
            seconds={m: seconds[m] / count for m in ESTIMATE_MODES},
        )
        for layer in layers
    )
    estimate = Estimate(estimates, 0, flops["off"], timing=f"compiled steps ({compiler}) on {backend.name}")
    noise = timing_noise([ratios[m] for m in ESTIMATE_MODES if m != "off"])
    everyone = group.gather(lambda: (estimate, noise), "sharing its measurements")
    return slowest([mine for mine, _ in everyone], group.size), max(theirs for _, theirs in everyone)


def _profile_step(model: nn.Module, sample: Any, modules: Sequence[nn.Module], run_mode: Callable, mode: str,
                  compiler: str, backend: Any, round_: int, tables: tuple[dict, dict, dict]) -> None:
    """One step of round ``round_`` under ``mode``: round 0 counts FLOPs, compiles and measures the
    saved bytes; later rounds time it; into ``tables``, (saved bytes, FLOPs, readings) by mode."""
    saved, flops, readings = tables
    if round_ == 0:
        flops[mode] = _step_flops(model, sample, run_mode(mode))
    compiled = _Compiled(run_mode, modules, mode, compiler)
    try:
        if round_ == 0:
            _step(model, sample)  # compiles
            saved[mode] = _saved_bytes(model, sample)
        else:
            readings[mode].append(_timed_step(model, sample, backend.synchronize))
    finally:
        compiled.restore()


def more_rounds(done: int, least: int, timing: float) -> bool:
    """Whether the compiled profile times another round after ``done`` (round 0 compiles): always up
    to ``least`` timed rounds, then while the timed rounds have taken under :data:`TIMING_SECONDS`
    (``timing``), at most :data:`MAX_COMPILED_ROUNDS`."""
    return done <= least or (done <= MAX_COMPILED_ROUNDS and timing < TIMING_SECONDS)


def timing_noise(ratios: Sequence[Sequence[float]]) -> float:
    """The standard error of the difference of two medians of per-round step ratios (NOTE [A mixed
    plan must beat the noise]): the median absolute deviation of each mode's ratios from their
    median, pooled over the modes, as a standard deviation (x1.4826); a median's standard error is
    1.2533 of it over the square root of the rounds, a difference's sqrt(2) of that. At least
    :data:`NOISE_FLOOR`."""
    deviations = [abs(r - statistics.median(mode)) for mode in ratios for r in mode]
    if not deviations:
        return NOISE_FLOOR
    rounds = max(len(mode) for mode in ratios)
    spread = 1.4826 * statistics.median(deviations)
    return max(NOISE_FLOOR, 1.2533 * spread * math.sqrt(2 / rounds))


def _mixed_or_uniform(estimate: Estimate, chosen: list[str], budget_bytes: int,
                      noise: float) -> tuple[list[str], list[str]]:
    """The solver's plan, or the fastest uniform plan that fits where that is predicted no slower or
    the solver's mixed plan is not predicted faster by more than ``noise`` (NOTE [A mixed plan must
    beat the noise]); and the plan's note, where a mixed plan gave way within the noise."""
    count = len(chosen)
    fitting = [[m] * count for m in ESTIMATE_MODES if estimate.total_bytes([m] * count) <= budget_bytes]
    if not fitting:
        return chosen, []
    uniform = min(fitting, key=estimate.step_seconds)
    gain = 1 - estimate.step_seconds(chosen) / estimate.step_seconds(uniform)
    if gain <= 0 or len(set(chosen)) <= 1:
        return (uniform if gain <= 0 else chosen), []
    if gain > noise:
        return chosen, []
    return uniform, [
        f"auto chose every layer {uniform[0]}: the best mixed plan ({mode_letters(chosen)}) was predicted "
        f"{100 * gain:.1f}% faster, within the timing noise of the compiled profile ({100 * noise:.1f}%)"
    ]


def compiled_auto_modes(model: nn.Module, layers: Sequence[Layer], budget: Any, sample: Any,
                        run_modes: Mapping[str, Callable], backend: Any, compile: bool | str, group: PlanGroup = ALONE,
                        head_policy: str | None = None) -> tuple[list[str], list[bool], dict[str, Any]]:
    """``mode="auto"`` under ``compile=True``: per-layer modes (no swap) and the plan's predictions;
    the budget bounds the bytes the compiled step saves for backward; ``run_modes``: by the head
    (``"off"``, ``"chunked"``), ``run_mode`` as for :func:`compiled_estimate`; ``head_policy``: how the
    head is planned (NOTE [The head in the plan] in planner/head.py), ``None`` for the head ``"off"``;
    ``compile``: ``Config.compile``; ``group``: the ranks that plan together (NOTE [One plan per job] in
    group.py)."""
    agree_on_options(group, budget, sample, [layer.fqn for layer in layers], {"compile=": compile,
                                                                              "backend": backend.name,
                                                                              "head=": head_policy})
    profiles: dict[str, tuple[Estimate, float]] = {}

    def estimate_of(head: str) -> Estimate:
        profiles[head] = compiled_estimate(model, sample, layers, run_modes[head], backend, COMPILED_ROUNDS,
                                           compile_backend(compile), group)
        return profiles[head][0]

    head, chosen, head_notes = "off", None, []
    if head_policy is None:
        budget_bytes = parse_budget(budget, estimate_of("off").total_bytes(["off"] * len(layers)))
        chosen = choose_modes(profiles["off"][0], budget_bytes, ESTIMATE_MODES, bound="kept")
    else:
        head, estimates, chosen, budget_bytes = choose_head(head_policy, estimate_of, budget, ESTIMATE_MODES,
                                                            bound="kept")
        if "chunked" in estimates:
            head_notes = [head_note(estimates, bound="kept")] + (
                [fallback_message(budget_bytes)] if head_policy == "fallback" else [])
    estimate, noise = profiles[head]
    chosen, notes = _mixed_or_uniform(estimate, chosen, budget_bytes, noise)
    return chosen, [False] * len(chosen), {
        **({"head": head} if head_policy is not None else {}),
        "notes": notes + head_notes,
        "predicted_bytes": estimate.total_bytes(chosen),
        "predicted_step_seconds": estimate.step_seconds(chosen),
        "predicted_recompute_flops": estimate.total_recompute_flops(chosen),
        "predicted_swap_bytes": 0,
        "budget_bytes": budget_bytes,
        **({"group_size": group.size} if group.size > 1 else {}),
    }

