"""What an op costs the host, measured once per process and backend.

Eager PyTorch spends a few microseconds of host time per op (Python, the dispatcher, autograd);
selective recompute adds a Python dispatch mode that records every op of a layer in forward and
replays it in backward, several microseconds more per op. FLOPs see none of this, and on small
layers it is most of the step. Every recomputed layer also costs a constant per invocation, whatever
its ops: the Python-state snapshot and its put-backs, the forward's context, checkpoint's frame, the
region's saved-tensor hooks (hyperac/replay/, benchmarks/host_overhead.py), which on a layer of tens of
ops is as much as the ops' own dispatch. :func:`host_costs` measures all three on a tiny chain of
pointwise layers (each op does almost no work, so what is timed is the overhead), through the same
``apply``/``remove`` a plan uses, and keeps the result for the process. The region's constant is measured
on layers with no attributes or sub-modules: a floor (a layer of many modules snapshots more).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..measure import OpCounter

__all__ = ["HostCosts", "host_costs"]

_STEPS = 5
_ITERATIONS = 64
_cache: dict[tuple[str, int, str], HostCosts] = {}
"""Measured host costs by (device, intra-op threads, torch version): what a measurement depends on."""


@dataclasses.dataclass(frozen=True)
class HostCosts:
    """Host seconds per op."""

    per_op: float
    """An eager op, forward or backward (launch and dispatch, no work)."""
    per_recorded_op: float
    """Extra for an op that selective recompute records in forward and replays in backward."""
    per_region: float
    """A recomputed layer's invocation, forward and replay, beyond its ops (the same in every mode that
    recomputes)."""


class _Block(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(_ITERATIONS):
            x = x * 1.0001 + 0.0001
        return x


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(), _Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sum()


def _step(model: nn.Module, x: torch.Tensor) -> None:
    model(x).backward()


def host_costs(device: torch.device, runner: Callable[..., Callable[[str], Callable[[], None]]]) -> HostCosts:
    """Host cost per op on ``device``, measured on first use (``runner(model, ["blocks"])(mode)`` applies a
    uniform mode to a model and returns its undo; see ``auto.Runner``)."""
    key = (str(device), torch.get_num_threads(), torch.__version__)
    if key in _cache:
        return _cache[key]
    model = _Chain()
    x = torch.ones(1, 8, device=device, requires_grad=True)
    run = runner(model, ["blocks"])
    times: dict[str, list[float]] = {"off": [], "full": [], "selective": []}
    for _ in range(_STEPS):
        for mode, readings in times.items():
            undo = run(mode)
            try:
                _step(model, x)  # warm
                start = time.perf_counter()
                _step(model, x)
                readings.append(time.perf_counter() - start)
            finally:
                undo()
    ops = {mode: _ops(model, x, run, mode) for mode in ("off", "full")}
    recorded = 2 * 2 * _ITERATIONS  # blocks x ops per iteration x iterations
    # The fastest reading: on a shared machine the slower ones include other processes' work.
    seconds = {mode: min(readings) for mode, readings in times.items()}
    per_op = seconds["off"] / ops["off"]
    _cache[key] = HostCosts(per_op=per_op,
                            per_recorded_op=max(seconds["selective"] - seconds["full"], 0.0) / recorded,
                            per_region=max(seconds["full"] - ops["full"] * per_op, 0.0) / len(model.blocks))
    return _cache[key]


def _ops(model: nn.Module, x: torch.Tensor, run: Callable[[str], Callable[[], None]], mode: str) -> int:
    """The ops of one step of ``model`` under ``mode`` (a replay's included)."""
    undo = run(mode)
    try:
        counter = OpCounter()
        with counter:
            _step(model, x)
    finally:
        undo()
    return counter.count


def describe(costs: Any) -> str:
    return (f"{costs.per_op * 1e6:.1f} us per op, +{costs.per_recorded_op * 1e6:.1f} us per recorded op, "
            f"+{costs.per_region * 1e6:.0f} us per recomputed layer")
