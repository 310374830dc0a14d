"""Buffers a recomputed forward updates are updated once per step, and the replay reads what the
forward read.

Recompute replays a layer's forward in backward. A forward that updates its buffers (BatchNorm's
running statistics and ``num_batches_tracked``, quantization ranges, counters) would update them
again in the replay: after one step ``num_batches_tracked`` is 2 and ``running_mean`` has moved
twice. Gradients are still right (BatchNorm normalizes with the batch's statistics in training), so
no gradient check notices; the evaluated model is wrong. A forward that also *branches* on its
buffers (HF ibert's ``QuantAct`` scales by its running range) would replay different ops, and a
forward that reads a buffer a later layer updates (a module shared by two layers) would replay
with the later value.

NOTE [Buffers in the replay]
Each invocation of a recomputed region copies, as its forward starts, every buffer slot of the
region's modules (``module._buffers``): which buffers a forward reads or writes is not learned
but taken to be all it can reach. Learning it from a first call misses updates that leave a value
numerically unchanged (a first batch whose mean is the running mean) and kernels that write
without bumping the version counter (CPU ``batch_norm``); a dispatch mode that records reads
would cost every op of full recompute. While a replay runs, each slot points at a fresh copy of
what it held when the forward started: the replay reads the values the forward read, whatever
happened to the real buffers since (an update by a later layer, the next step's forward), and
writes or rebinds (``self.count = self.count + 1``) throwaways. When the replay ends, each slot
points at the tensor it held before the replay, which the forward updated exactly once. A second
replay (``retain_graph``, ``create_graph``) gets fresh copies again. The cost is one copy of the
region's buffers per invocation, held until its backward: a few kilobytes for normalization
statistics and rotary tables. Buffers reached other than through a module's ``_buffers`` (a
tensor kept as a plain attribute) are not covered. Regions whose modules hold no buffers are left
alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["BufferSnapshots"]

_Slot = tuple[nn.Module, str]
"""A buffer slot: the module that owns it and the buffer's name."""


def _snapshot(region: nn.Module) -> dict[_Slot, torch.Tensor | None]:
    return {
        (owner, name): None if buffer is None else buffer.detach().clone()
        for owner in region.modules()
        for name, buffer in owner._buffers.items()
    }


class _BuffersAsBefore:
    """The replay context of one region invocation: the slots point at copies of the forward's
    snapshot while the wrapped replay context runs (NOTE [Buffers in the replay]). Entered once per
    replay."""

    def __init__(self, snapshot: dict[_Slot, torch.Tensor | None], inner: Any) -> None:
        self.snapshot = snapshot
        self.inner = inner
        self.real: list[tuple[_Slot, torch.Tensor | None]] = []

    def __enter__(self) -> None:
        self.real = [((owner, name), owner._buffers.get(name)) for owner, name in self.snapshot]
        for (owner, name), value in self.snapshot.items():
            owner._buffers[name] = None if value is None else value.clone()
        try:
            self.inner.__enter__()
        except BaseException:
            self._put_back()
            raise

    def __exit__(self, *exc: Any) -> bool | None:
        try:
            return self.inner.__exit__(*exc)
        finally:
            self._put_back()

    def _put_back(self) -> None:
        for (owner, name), buffer in self.real:
            owner._buffers[name] = buffer
        self.real = []


class BufferSnapshots:
    """A ``context_fn`` for ``torch.utils.checkpoint`` that keeps the region's buffer updates
    single and its replays reading the buffers its forward read (NOTE [Buffers in the replay]),
    around the contexts of ``context_fn`` (or none).

    Holds data only: the region and the wrapped ``context_fn``.
    """

    def __init__(self, region: nn.Module, context_fn: Callable[[], tuple[Any, Any]] | None) -> None:
        self.region = region
        self.context_fn = context_fn

    @classmethod
    def wrap(cls, region: nn.Module, context_fn: Callable[[], tuple[Any, Any]] | None) -> Any:
        """``context_fn`` wrapped for ``region``, or ``context_fn`` itself if the region has no buffers."""
        if next(region.buffers(), None) is None:
            return context_fn
        return cls(region, context_fn)

    def __call__(self) -> tuple[Any, Any]:
        # Called as the region's forward starts, outside the inner contexts: the copies made here
        # are no ops of the region.
        snapshot = _snapshot(self.region)
        inner_forward, inner_replay = (
            (contextlib.nullcontext(), contextlib.nullcontext()) if self.context_fn is None else self.context_fn()
        )
        return inner_forward, _BuffersAsBefore(snapshot, inner_replay)
