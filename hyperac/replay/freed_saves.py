"""Refuse a recomputed layer whose forward frees the data of a tensor that autograd saved.

NOTE [Saved tensors freed in forward]
Megatron-Core's ``CheckpointWithoutOutput`` (its ``recompute_modules=["layernorm", "moe_act",
"mla_up_proj"]``, MindSpeed's activation-function recompute) runs a function without saving its
internals, lets the next op save the function's output, then frees that output's storage
(``untyped_storage().resize_(0)``) and refills it from a hook when backward reaches the next op. Inside
a recomputed region the replay runs the layer again: the function's output is freed again, but the
hook that would refill it sits on the replay's graph, which backward never runs, and the next op's
backward fails on the freed tensor ("The tensor has a non-zero number of elements, but its data is
not allocated yet"), with no word of the layer or a fix. hyperac cannot refill a storage it did not
see freed (a storage's resize is no dispatcher op), so the first forward of each recomputed region
watches what autograd saves and, when the forward is done, refuses the layer if one of those
storages lost its data. The watch is one Python call per saved tensor, on the first training forward
of each region only: the freeing is a property of the layer's code, the same every step. Parameters and
their views are not watched: a sharding stack frees a gathered parameter's storage after its module's forward (FSDP2's
reshard on a sub-module of the layer) and gathers it again before that module's backward, in the
replay as without hyperac (NOTE [Parameter lifecycles are not the layer's program] in lifecycle.py).
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch

from .._compat import SAC_CHECKPOINT_KWARGS
from ..errors import UnsupportedModelError

__all__ = ["FreedSaves"]


class FreedSaves:
    """A ``context_fn`` for ``torch.utils.checkpoint`` around ``context_fn`` (or none) whose forward
    context refuses a forward that frees a saved tensor's data (NOTE [Saved tensors freed in forward]).
    Holds data only: the wrapped function and the layer's name and flat index, for the error."""

    def __init__(self, context_fn: Callable[[], tuple[Any, Any]] | None, layer: str, index: int | None) -> None:
        self.context_fn = context_fn
        self.layer, self.index = layer, index

    def __call__(self) -> tuple[Any, Any]:
        forward, replay = (
            (contextlib.nullcontext(), contextlib.nullcontext()) if self.context_fn is None else self.context_fn()
        )
        if hasattr(forward, "respect_saved_tensors_hooks"):
            # torch (2.14) gives its selective caching mode checkpoint's choice only when the mode is the forward
            # context itself, not wrapped: give it hyperac's (NOTE [Probed torch internals] in _compat.py).
            forward.respect_saved_tensors_hooks = SAC_CHECKPOINT_KWARGS.get("respect_saved_tensors_hooks", False)
        return _WatchSaves(forward, self.layer, self.index), replay


class _WatchSaves:
    """Looks at each tensor saved for backward on its way to the region's pack hook while ``inner``
    runs inside; on a clean exit, raises if one of their storages lost its data."""

    def __init__(self, inner: Any, layer: str, index: int | None) -> None:
        self.inner, self.layer, self.index = inner, layer, index
        self.saved: list[tuple[weakref.ref, torch.Size]] = []
        self.pack: Any = None

    def __enter__(self) -> None:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if hooks is not None:  # outside checkpoint's hooks nothing is saved on the region's behalf
            self.pack, unpack = hooks
            # Autograd holds the hook until backward: it holds the list and the region's own pack
            # hook, not this context (which holds the inner one, a recording mode and what it kept).
            watch = functools.partial(_watch, self.saved, self.pack)
            torch._C._autograd._push_saved_tensors_default_hooks(watch, unpack)
        try:
            self.inner.__enter__()
        except BaseException:
            self._pop()
            raise

    def _pop(self) -> None:
        if self.pack is not None:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.pack = None

    def __exit__(self, exc_type: Any, *exc: Any) -> Any:
        try:
            result = self.inner.__exit__(exc_type, *exc)
        finally:
            self._pop()
        if exc_type is None:
            for ref, shape in self.saved:
                storage = ref()
                if storage is not None and storage.nbytes() == 0:
                    raise _freed(self.layer, self.index, shape)
        self.saved.clear()
        return result


def _watch(saved: list[tuple[weakref.ref, torch.Size]], pack: Callable[[torch.Tensor], Any],
           tensor: torch.Tensor) -> Any:
    base = tensor if tensor._base is None else tensor._base  # a weight is saved as its view (``t``) too
    if tensor.numel() and not isinstance(base, torch.nn.Parameter):
        saved.append((weakref.ref(tensor.untyped_storage()), tensor.shape))
    return pack(tensor)


def _freed(layer: str, index: int | None, shape: torch.Size) -> UnsupportedModelError:
    fix = f"layers={{{'<its index>' if index is None else index}: 'off'}}"
    return UnsupportedModelError(
        f"hyperac: recomputed layer {layer!r} frees, in its forward, the data of a tensor of shape {list(shape)} "
        "that autograd saved for backward (Megatron-Core's CheckpointWithoutOutput, its recompute_modules="
        "['layernorm', 'moe_act', 'mla_up_proj'] or MindSpeed's activation-function recompute do this); the "
        "layer's replay would free it again where nothing refills it. Turn that recompute off (hyperac's selective "
        f"and pointwise modes recompute those ops), or leave the layer out of recompute: {fix}."
    )
