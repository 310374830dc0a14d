"""``mode="auto"`` and ``hyperac plan`` weigh the chunked head like a layer mode.

NOTE [The head in the plan]
The head and the loss live outside the layers, so chunking them (NOTE [The head and the loss in
chunks] in hyperac/head.py) changes only an estimate's outside costs: the peak of the logits and
their gradient (``outside_peak_bytes``), the bytes kept (``outside_bytes``), the seconds of the head's
second projection (``outside_seconds``, and ``base_flops``). The planner profiles the step twice, with
the head as the model computes it and chunked, solves the layer modes against the budget under
each, and keeps the faster plan that fits (the head as it is where both are equally fast):
``Config.head="auto"``. By default (``head=None``) the chunked head's gradients, within float32
rounding and not bitwise, are taken only where nothing else meets the budget: the step is profiled
with the head as it is first, and chunked only where that plan is refused, with a warning. A
fractional budget is of the un-chunked step's no-recompute peak, what the model needs as it is.
Where the user asked for bitwise results (``Config.bitwise=True``) or ``head="off"``, the head is not
planned; with ``head="chunked"`` only the chunked head is (the other profiled for the note's share).

Under ``compile=`` the compiled planner (planner/compiled.py) weighs the head the same way, on its
own cost model: the bytes the compiled step's forward saves for backward (not the chunks the head's
backward recomputes one at a time, which it frees as it goes), each head profiled in compiled steps
of its own, so the two heads' seconds are compared across profiles. Plans per length bucket
(``max_seq_len=``) do not weigh it yet: every length is profiled with the head as ``head=`` installs
it (``"chunked"``, or as the model computes it), a fractional budget is of that step, and
``head="auto"`` keeps the head with a note and a warning saying so.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from ..budget import parse_budget
from ..discovery import Layer
from ..errors import ConfigError, HyperACWarning
from .auto import Runner, estimate_layers, resolve_choice
from .cost import ESTIMATE_MODES, SWAP_OPTIONS, Estimate
from .group import ALONE, PlanGroup, agree_on_options
from .solver import choose_modes

__all__ = ["choose_head", "choose_with_head", "fallback_message", "head_auto_modes", "head_note"]


def choose_with_head(estimates: Mapping[str, Estimate], budget_bytes: int, options: Sequence[str],
                     host_budget_bytes: int | None = None, bound: str = "peak") -> tuple[str, list[str]]:
    """The head (a key of ``estimates``: ``"off"`` or ``"chunked"``) and per-layer options that fit
    ``budget_bytes`` (``bound`` as for :func:`choose_modes`) fastest; where none fits, the refusal of the
    last head tried (the lowest floor)."""
    fits, refusal = [], None
    for head, estimate in estimates.items():
        try:
            chosen = choose_modes(estimate, budget_bytes, options, host_budget_bytes=host_budget_bytes, bound=bound)
        except ConfigError as error:
            refusal = error
            continue
        fits.append((estimate.step_seconds(chosen), len(fits), head, chosen))
    if not fits:
        assert refusal is not None
        raise refusal
    _, _, head, chosen = min(fits)
    return head, chosen


def head_note(estimates: Mapping[str, Estimate], bound: str = "peak") -> str:
    """The head's share of the step, as the model computes it and chunked (for ``print(plan)``):
    of its peak, or (``bound="kept"``, compiled) of its bytes saved for backward."""
    plain, chunked = estimates["off"], estimates["chunked"]
    off_plain, off_chunked = (e.bounded_bytes(["off"] * len(e.layers), bound) for e in (plain, chunked))
    full_plain, full_chunked = (e.bounded_bytes(["full"] * len(e.layers), bound) for e in (plain, chunked))
    what = "peak" if bound == "peak" else "saved for backward"
    return (f"the head and the loss (NOTE [The head in the plan]): {what} with no recompute "
            f"{off_plain / 2**20:.1f} MiB as the model computes them, {off_chunked / 2**20:.1f} MiB chunked; with "
            f"every layer full {full_plain / 2**20:.1f} MiB, {full_chunked / 2**20:.1f} MiB chunked; chunking costs "
            f"{(chunked.base_flops - plain.base_flops) / 1e9:.3f} GFLOP "
            f"({100 * (chunked.base_flops - plain.base_flops) / max(plain.base_flops, 1):.1f}% of the step).")


def choose_head(policy: str, estimate_of: Callable[[str], Estimate], budget: Any, options: Sequence[str],
                host_budget_bytes: int | None = None, bound: str = "peak",
                ) -> tuple[str, dict[str, Estimate], list[str], int]:
    """The head, the estimates profiled (``"off"``, and ``"chunked"`` where it was), the per-layer
    options and the budget in bytes, by ``policy`` (``"chunked"``, ``"weigh"`` or ``"fallback"``:
    :func:`hyperac.head.head_policy`); ``estimate_of(head)`` profiles the step with that head. ``bound``:
    what the budget bounds, as for :func:`choose_modes` (``"kept"``: the compiled planner's saved bytes),
    a fraction of it with no recompute and the head as the model computes it."""
    estimates = {"off": estimate_of("off")}
    budget_bytes = parse_budget(budget, estimates["off"].bounded_bytes(["off"] * len(estimates["off"].layers), bound))
    if policy == "fallback":
        try:
            return "off", estimates, choose_modes(estimates["off"], budget_bytes, options,
                                                  host_budget_bytes=host_budget_bytes, bound=bound), budget_bytes
        except ConfigError:
            pass
    estimates["chunked"] = estimate_of("chunked")
    heads = ("off", "chunked") if policy == "weigh" else ("chunked",)
    head, chosen = choose_with_head({h: estimates[h] for h in heads}, budget_bytes, options, host_budget_bytes, bound)
    if policy == "fallback":
        warnings.warn(fallback_message(budget_bytes), HyperACWarning, stacklevel=4)  # apply's caller
    return head, estimates, chosen, budget_bytes


def fallback_message(budget_bytes: int) -> str:
    return (f"mode='auto' chunked the LM head and its loss to meet the budget of {budget_bytes / 2**20:.1f} MiB, "
            "which no plan meets with the head as the model computes it: its gradients are within float32 rounding "
            "of the un-chunked ones, not bitwise (docs/correctness.md). bitwise=True keeps results bitwise (and "
            "refuses this budget); head='off' keeps the head as it is.")


def head_auto_modes(model: nn.Module, layers: Sequence[Layer], budget: Any, sample: Any,
                    runners: Mapping[str, Runner], policy: str, backend: Any, host_budget_bytes: int,
                    min_swap_bytes: int = 0, group: PlanGroup = ALONE,
                    ) -> tuple[list[str], list[bool], dict[str, Any]]:
    """``mode="auto"`` with the head in the plan (NOTE [The head in the plan]): ``runners`` applies a
    uniform mode with the head ``"off"`` and ``"chunked"``; ``policy`` as for :func:`choose_head`. With a
    ``group`` of ranks, one plan for all of them, the head's choice included (NOTE [One plan per job] in
    group.py)."""
    agree_on_options(group, budget, sample, [layer.fqn for layer in layers], {
        "min_swap_bytes=": min_swap_bytes, "backend": backend.name, "head=": policy})
    host_budget_bytes = min(group.gather(lambda: host_budget_bytes, "sharing its host budget"))

    def estimate_of(head: str) -> Estimate:
        return dataclasses.replace(estimate_layers(model, sample, layers, runners[head], backend, group=group),
                                   min_swap_bytes=min_swap_bytes)

    options = ESTIMATE_MODES + SWAP_OPTIONS if backend.can_swap else ESTIMATE_MODES
    head, estimates, chosen, budget_bytes = choose_head(policy, estimate_of, budget, options, host_budget_bytes)
    modes, swaps, prediction = resolve_choice(estimates[head], chosen, budget_bytes)
    if "chunked" in estimates:
        prediction["head"] = head
        prediction["notes"] = [*prediction["notes"], head_note(estimates)]
        if policy == "fallback":
            prediction["notes"].append(fallback_message(budget_bytes))
    if group.size > 1:
        prediction["group_size"] = group.size
    return modes, swaps, prediction
