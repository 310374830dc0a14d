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
region's persistent buffers per invocation, held until its backward: a few kilobytes for
normalization statistics. The region's modules are its own and those its forward is given or holds
without registering them (a BatchNorm its parent owns, passed as an argument; ``PythonState.borrowed``
in python_state.py), found per invocation. A tensor kept as a plain attribute is no buffer: a rebinding
of it is undone around the replay (NOTE [Python state in the replay]), a write into it is not. Regions
whose modules hold no buffers are left alone.

NOTE [Non-persistent buffers are held, not copied]
Non-persistent buffers (``register_buffer(..., persistent=False)``) are derived tables: rotary
frequencies, causal masks, position ids. They can be large (torchtitan's llama3 keeps its rotary
table in every layer: copying it per invocation kept 4x the activation bytes of the un-applied
model), and a training forward reads them without writing. So the snapshot holds such a buffer
itself, with its version, and the replay reads that same tensor: a rebinding since (HF's dynamic
rotary embeddings) leaves it as the forward read it. A write into it in place since the forward
read it (its version moved) cannot be undone without a copy: the replay raises
:class:`~hyperac.InputWrittenError` naming the layer and the fix instead of reading the new values.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..errors import InputWrittenError

__all__ = ["BufferSnapshots", "buffers_as_before"]

_Slot = tuple[nn.Module, str]
"""A buffer slot: the module that owns it and the buffer's name."""


class _Held:
    """A non-persistent buffer as the forward read it: the tensor itself and its version (NOTE
    [Non-persistent buffers are held, not copied])."""

    __slots__ = ("tensor", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor, self.version = tensor, tensor._version


def _snapshot(modules: Iterable[nn.Module]) -> dict[_Slot, torch.Tensor | _Held | None]:
    return {
        (owner, name): None if buffer is None else _Held(buffer) if name in owner._non_persistent_buffers_set
        else buffer.detach().clone()
        for owner in modules
        for name, buffer in owner._buffers.items()
    }


class _BuffersAsBefore:
    """The replay context of one region invocation: the slots point at copies of the forward's
    snapshot while the wrapped replay context runs (NOTE [Buffers in the replay]). Entered once per
    replay."""

    def __init__(self, snapshot: dict[_Slot, torch.Tensor | _Held | None], inner: Any, layer: str,
                 index: int | None) -> None:
        self.snapshot = snapshot
        self.inner = inner
        self.layer, self.index = layer, index
        self.real: list[tuple[_Slot, torch.Tensor | None]] = []

    def __enter__(self) -> None:
        for (owner, name), value in self.snapshot.items():
            if isinstance(value, _Held) and value.tensor._version != value.version:
                fix = f"layers={{{'<its index>' if self.index is None else self.index}: 'off'}}"
                raise InputWrittenError(
                    f"hyperac: the non-persistent buffer {name!r} of {type(owner).__name__} in recomputed layer "
                    f"{self.layer!r} was written in place after the layer's forward read it (its version went from "
                    f"{value.version} to {value.tensor._version}), so the replay in backward would read the new "
                    "values. Register it with persistent=True (hyperac then keeps a copy for the replay), rebind "
                    f"it instead of writing into it, or leave the layer out of recompute: {fix}."
                )
        self.real = [((owner, name), owner._buffers.get(name)) for owner, name in self.snapshot]
        for (owner, name), value in self.snapshot.items():
            held = isinstance(value, _Held)
            owner._buffers[name] = value.tensor if held else None if value is None else value.clone()
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
    around the contexts of ``context_fn`` (or none). Modules the region runs but does not own get
theirs from :func:`buffers_as_before`, per invocation.

    Holds data only: the region and the wrapped ``context_fn``.
    """

    def __init__(self, region: nn.Module, context_fn: Callable[[], tuple[Any, Any]] | None, layer: str,
                 index: int | None) -> None:
        self.region = region
        self.context_fn = context_fn
        self.layer, self.index = layer, index
        """The layer's fqn and flat index, for errors."""

    @classmethod
    def wrap(cls, region: nn.Module, context_fn: Callable[[], tuple[Any, Any]] | None, layer: str,
             index: int | None) -> Any:
        """``context_fn`` wrapped for ``region`` (the layer ``layer``, flat index ``index``), or
        ``context_fn`` itself if the region has no buffers."""
        if next(region.buffers(), None) is None:
            return context_fn
        return cls(region, context_fn, layer, index)

    def __call__(self) -> tuple[Any, Any]:
        # Called as the region's forward starts, outside the inner contexts: the copies made here
        # are no ops of the region.
        snapshot = _snapshot(self.region.modules())
        inner_forward, inner_replay = (
            (contextlib.nullcontext(), contextlib.nullcontext()) if self.context_fn is None else self.context_fn()
        )
        return inner_forward, _BuffersAsBefore(snapshot, inner_replay, self.layer, self.index)


def buffers_as_before(modules: list[nn.Module], layer: str, index: int | None) -> _BuffersAsBefore | None:
    """The replay context that keeps the buffer updates of ``modules``, which a region runs but does not
    own (a BatchNorm its parent passes in), single (NOTE [Buffers in the replay]): their snapshot is
    taken now, as the region's forward starts; ``None`` if they hold no buffers."""
    snapshot = _snapshot(modules)
    return _BuffersAsBefore(snapshot, contextlib.nullcontext(), layer, index) if snapshot else None
