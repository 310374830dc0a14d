"""Serve a recomputed region's saved tensor to a second read in the same backward by replaying again.

NOTE [A saved tensor read twice in one backward]
Non-reentrant ``torch.utils.checkpoint`` hands each saved tensor's replayed value to the first read in a
backward and then drops it, so that the replayed activations live only until their node has run. A
second read of the same saved tensor in the same backward raises torch's "Unpack is being triggered
for a tensor that was already unpacked once" (pytorch/pytorch#82156). Without recompute autograd
allows it, and valid programs do it:

* a gradient penalty (``autograd.grad(..., create_graph=True)``, then a backward through the
  gradients) over an in-place op that saves its output (``sigmoid_``, ``exp_``, ``tanh_``,
  ``relu_``: ``nn.ReLU(inplace=True)``) applied to a view (``y.t()[0]``, a slice, a ``chunk``).
  Autograd saves such an output with a weak reference to the view's node; the view is gone after
  forward, so the gradient made with ``create_graph`` hangs off the in-place op's node itself, and the
  second backward runs that node twice: once inside its ``CopySlices`` and once on its own, each time
  reading the saved output. The un-applied model's gradients are those of that graph, and so are
  hyperac's;
* an ``autograd.Function`` whose backward reads ``ctx.saved_tensors`` twice.

So each recomputed region's forward reads its saved tensors through :func:`read_again`, in front of
checkpoint's unpack hook (the region's one hook pair, NOTE [One hook pair per region] in region_saves.py):
when a saved tensor is read again in a backward
that already took its value, the region's replay for that backward is forgotten, and checkpoint
replays the region again, handing out the same values (the replay starts from the same RNG, Python
and buffer states and is checked against the forward like any other). The price, paid only by a
region that is read twice, is one more replay of it in that backward. The second replay's values for
saved tensors that backward had read already (those a ``retain_graph`` or ``create_graph`` backward still
holds; the others were released with their nodes) are let go once the node that read twice has run, which
may read them again (``ctx.saved_tensors`` reads them all): no replayed value outlives its backward. The
check is a dictionary lookup per read. Checkpoint's frame is reached through its unpack hook's closure (NOTE
[Every private torch piece] in _compat.py); where a torch release changes that, the hook is not put in
front and the second read raises torch's error, as before.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import checkpoint as torch_recompute

__all__ = ["checkpoint_frame", "read_again"]


def checkpoint_frame(unpack: Callable[[Any], torch.Tensor]) -> Any:
    """The ``_CheckpointFrame`` whose saved tensors ``unpack`` (checkpoint's unpack hook) reads, or None
    if ``unpack`` is no such hook."""
    code = getattr(unpack, "__code__", None)
    names = () if code is None else code.co_freevars
    if "frame" not in names:
        return None
    frame = unpack.__closure__[names.index("frame")].cell_contents  # type: ignore[attr-defined]
    return frame if isinstance(frame, torch_recompute._CheckpointFrame) else None


def read_again(frame: Any, unpack: Callable[[Any], torch.Tensor], holder: Any) -> torch.Tensor:
    """Checkpoint's ``unpack(holder)``, with ``frame``'s region replayed again first where this backward has
    read ``holder`` already."""
    backward = _current_backward()
    if backward is None or holder.handles.get(backward, _UNREAD) is not None:  # not read in this backward yet
        return unpack(holder)
    read = _forget_replay(frame, backward)
    value = unpack(holder)
    node = torch._C._current_autograd_node()
    if node is None:
        _let_go(read, backward)
    else:  # the node may read them again (ctx.saved_tensors reads all): let go once it has run
        handle: list[Any] = []
        handle.append(node.register_hook(functools.partial(_let_go_after_node, read, backward, handle)))
    return value


def _let_go(read: list[Any], backward: Any) -> None:
    """Drop the second replay's values of the saved tensors in ``read`` not read again in ``backward``."""
    for holder in read:
        if backward in holder.handles:
            holder.handles[backward] = None


def _let_go_after_node(read: list[Any], backward: Any, handle: list[Any], *grads: Any) -> None:
    _let_go(read, backward)
    handle[0].remove()


_UNREAD = object()


def _current_backward() -> Any:
    """The key checkpoint files this backward's replay under, or None outside a backward (where
    checkpoint takes a fresh key per read)."""
    group = torch_recompute.GraphExecGroup._get_current_group()
    if group is not None:
        return group
    task = torch._C._current_graph_task_id()
    return None if task == -1 else task


def _forget_replay(frame: Any, backward: Any) -> list[Any]:
    """Make checkpoint replay ``frame``'s region again for ``backward`` on the next read; returns the
    live saved tensors' holders that ``backward`` has read already."""
    frame.is_recomputed[backward] = False
    frame.recomp_counter[backward] = 0
    frame.recomputed.pop(backward, None)
    read = []
    for ref in frame.weak_holders:
        holder = ref()
        if holder is not None:
            if holder.handles.pop(backward, _UNREAD) is None:
                read.append(holder)
    return read
