"""Buffers a recomputed forward updates are updated once per step, and the replay reads what the
forward read.

Recompute replays a layer's forward in backward. A forward that updates its buffers (BatchNorm's
running statistics and ``num_batches_tracked``, quantization ranges, counters) would update them
again in the replay: after one step ``num_batches_tracked`` is 2 and ``running_mean`` has moved
twice. Gradients are still right (BatchNorm normalizes with the batch's statistics in training), so
no gradient check notices; the evaluated model is wrong. A forward that also *branches* on its
buffers (HF ibert's ``QuantAct`` scales by its running range) would replay different ops.

NOTE [Buffers in the replay]
Each invocation of a recomputed region snapshots, as its forward starts, the buffers that forward
will update. While the replay runs, the module's buffer slots point at copies of those snapshots:
the replay reads the values the forward read and writes into throwaways; when it ends, the slots
point at the real buffers again, which the forward updated exactly once. Which buffers a forward
updates is learned on its first invocation, by comparing every buffer of the region (identity,
version counter and value) before and after; later invocations snapshot only those. A buffer that
starts changing later is caught by its identity or version counter (kernels such as CPU
``batch_norm`` update running statistics without bumping the version, which is why the first
invocation compares values); its replay then reads the updated value but still writes into a
throwaway, so the update stays single. Regions whose modules hold no buffers are left alone.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["BufferSnapshots"]

_Key = tuple[int, str]
"""A buffer slot: (position of its owner in ``region.modules()``, buffer name)."""


def _slots(region: nn.Module) -> Iterator[tuple[_Key, nn.Module, str, torch.Tensor]]:
    for position, owner in enumerate(region.modules()):
        for name, buffer in owner._buffers.items():
            if buffer is not None:
                yield (position, name), owner, name, buffer


class BufferSnapshots:
    """A ``context_fn`` for ``torch.utils.checkpoint`` that keeps the region's buffer updates
    single (NOTE [Buffers in the replay]), around the contexts of ``context_fn`` (or none).

    Holds data only: the region, the wrapped ``context_fn`` and the learned buffer slots.
    """

    def __init__(self, region: nn.Module, context_fn: Callable[[], tuple[Any, Any]] | None) -> None:
        self.region = region
        self.context_fn = context_fn
        self.updated: frozenset[_Key] | None = None
        """Slots the forward updates, learned on the first invocation (``None`` until then)."""

    @classmethod
    def wrap(cls, region: nn.Module, context_fn: Callable[[], tuple[Any, Any]] | None) -> Any:
        """``context_fn`` wrapped for ``region``, or ``context_fn`` itself if the region has no buffers."""
        if next(region.buffers(), None) is None:
            return context_fn
        return cls(region, context_fn)

    def __call__(self) -> tuple[Any, Any]:
        inner_forward, inner_replay = (
            (contextlib.nullcontext(), contextlib.nullcontext()) if self.context_fn is None else self.context_fn()
        )
        snapshots: dict[_Key, torch.Tensor] = {}
        # Entered outside the inner contexts: the copies made here are no ops of the region.
        return self._forward(inner_forward, snapshots), self._replay(inner_replay, snapshots)

    @contextlib.contextmanager
    def _forward(self, inner: Any, snapshots: dict[_Key, torch.Tensor]) -> Iterator[None]:
        learning = self.updated is None
        before = {key: (buffer, buffer._version) for key, _, _, buffer in _slots(self.region)}
        taken = {
            key: buffer.detach().clone() for key, (buffer, _) in before.items() if learning or key in self.updated
        }
        with inner:
            yield
        for key, _, _, buffer in _slots(self.region):
            old, version = before.get(key, (None, -1))
            changed = buffer is not old or buffer._version != version
            if key in taken and (not learning or changed or not torch.equal(buffer, taken[key])):
                snapshots[key] = taken[key]
            elif changed:
                snapshots[key] = buffer.detach().clone()
        self.updated = frozenset(snapshots) | (self.updated or frozenset())

    @contextlib.contextmanager
    def _replay(self, inner: Any, snapshots: dict[_Key, torch.Tensor]) -> Iterator[None]:
        real = []
        for key, owner, name, buffer in _slots(self.region):
            if key in snapshots:
                real.append((owner, name, buffer))
                owner._buffers[name] = snapshots[key].clone()
        try:
            with inner:
                yield
        finally:
            for owner, name, buffer in real:
                owner._buffers[name] = buffer
