"""One saved-tensor hook pair per recomputed region invocation, doing in one Python call per tensor what
the region's checks need of what autograd saves.

NOTE [One hook pair per region]
Three of a recomputed region's guarantees look at each tensor autograd saves: fake tensors saved by a trace
inside the region stay out of checkpoint's hooks (NOTE [Traces inside a region] in higher_order.py),
``full``'s replay is checked tensor by tensor against the forward's fingerprint (NOTE [Every replay is
checked] in replay_check.py), and a saved tensor read twice in one backward replays the region again (NOTE
[A saved tensor read twice in one backward] in reread.py). Each was a ``saved_tensors_hooks`` pair of its
own stacked on checkpoint's, so a tensor went through three Python calls on its way in and two on its way
out, in forward and again in each replay: at tens of saved tensors per layer, more host time than the
recompute of a small layer (benchmarks/host_overhead.py). So the region pushes one pair, innermost, as its
forward or replay starts: the pack keeps a fake tensor (a detached alias), or lists the tensor's
fingerprint (in the same call, no comparison yet) in the list of the ``full`` context entered for this
invocation (``armed_check``; a nested region, whose checkpoint gives it contexts of its own, takes none),
which compares the replay's list with the forward's as the replay ends, then hands it to the hooks below;
the unpack gives a kept fake back, or reads through checkpoint's unpack, replaying again for a second read.
The unpack, which autograd holds as long as the saved tensor, holds checkpoint's frame and the unpack below
only (not the pack below's owner: a swap group). The freed-saves watch (freed_saves.py) runs on a region's
first forward only and stays a pair of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

from .replay_check import RESHAPES, armed_check, maker
from .reread import checkpoint_frame, read_again

__all__ = ["RegionSaves"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types that are never fake: most saved tensors, told apart without ``is_fake``'s checks."""


class _Fake:
    """A fake tensor saved inside the region, kept out of the hooks below (NOTE [Traces inside a region])."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class RegionSaves:
    """While entered, the one hook pair of a region's forward (``replaying=False``) or replay (NOTE [One
    hook pair per region]); with no hooks in effect (no checkpoint around), nothing changes."""

    __slots__ = ("entries", "first", "pack", "pushed", "replaying")

    def __init__(self, replaying: bool) -> None:
        self.replaying = replaying
        self.pushed = False
        self.entries: list[Any] = []
        self.first = 0
        self.pack: Callable[[torch.Tensor], Any] | None = None

    def __enter__(self) -> None:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if outer is None:
            return
        self.pack, unpack = outer
        check = armed_check()
        if check is not None:
            self.entries, self.first = check.entries, check.first
        frame = None if self.replaying else checkpoint_frame(unpack)
        pack = self._pack if check is None else self._fingerprinted
        torch._C._autograd._push_saved_tensors_default_hooks(pack, functools.partial(_unpack, frame, unpack))
        self.pushed = True

    def __exit__(self, *exc: Any) -> None:
        if self.pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.pushed = False
            self.pack = None
            self.entries = []

    def _pack(self, tensor: torch.Tensor) -> Any:
        if type(tensor) not in _PLAIN and is_fake(tensor):
            return _Fake(tensor.detach())
        return self.pack(tensor)  # type: ignore[misc]

    def _fingerprinted(self, tensor: torch.Tensor) -> Any:
        """:meth:`_pack`, listing ``tensor``'s fingerprint first (replay_check.maker inlined: one Python call per
        tensor)."""
        if type(tensor) not in _PLAIN and is_fake(tensor):
            return _Fake(tensor.detach())
        node = tensor.grad_fn
        if node is None or node._sequence_nr() < self.first:
            made_by = None
        else:
            made_by = node.name()
            if made_by in RESHAPES:
                made_by = "a reshape"
            elif made_by == "ToCopyBackward0":
                made_by = maker(tensor, self.first)
        self.entries.append((made_by, tensor.shape, tensor.dtype))
        return self.pack(tensor)  # type: ignore[misc]


def _unpack(frame: Any, unpack: Callable[[Any], torch.Tensor], saved: Any) -> torch.Tensor:
    if type(saved) is _Fake:
        return saved.tensor
    if frame is None or None not in saved.handles.values():  # read by no backward yet: a first read
        return unpack(saved)
    return read_again(frame, unpack, saved)
