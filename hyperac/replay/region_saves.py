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
the unpack gives a kept fake back, or reads through checkpoint's unpack, replaying again for a second read,
and before a read that replays checks that the region's inputs were not written since its forward (NOTE
[Inputs written in place] in recompute.py).
The unpack, which autograd holds as long as the saved tensor, holds checkpoint's frame and the unpack below
only (not the pack below's owner: a swap group). The freed-saves watch (freed_saves.py) runs on a region's
first forward only and stays a pair of its own.

NOTE [Checkpoint's hooks in the region's pair]
Below the region's pair sits checkpoint's own, and each saved tensor went through both: in forward
checkpoint's pack makes a holder and, even with ``determinism_check="none"``, calls its metadata function
under ``no_grad``; in a replay its pack (behind a ``torch._dynamo.disable`` wrapper) files the replayed
tensor under the holder's handle; its unpack looks the handle up. That was about two thirds of the Python
calls per saved tensor, more than the peers' whole checkpoint (which has no pair of its own above it). So
where the pair below is checkpoint's own (its forward pack over the same frame as its unpack, or the replay
pack of that frame; not the freed-saves watch of a first forward, nor a swap group's), a ``full`` region's
pair does that work itself, in the same Python call that lists the fingerprint: the forward's pack makes
the holder and files its weak reference in the frame, the replay's files the detached tensor under a new
handle (and stops the replay where checkpoint would, its early stop), the unpack hands out a replayed value
and forgets it. Every other case (the first read of a backward, which runs the replay; a tensor read again;
a read outside a backward; a replay that saves more than its forward) goes through checkpoint's own hook,
as before. Checkpoint's check of the replay's saved tensors (their number, their metadata) is turned off on
such a frame (``ignore_saved_mismatch``): the fingerprint compares more (NOTE [Every replay is checked] in
replay_check.py). These are torch internals (the frame's fields, the hooks' closures and code): apply runs
:func:`probe_checkpoint_hooks` once per process (NOTE [Every private torch piece] in _compat.py), which
runs a region through both paths and compares; where a torch release lays them out otherwise, the pair
calls checkpoint's hooks as before, slower and the same.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils import checkpoint as torch_recompute
from torch.utils._python_dispatch import _disable_current_modes

from .replay_check import FIELDS, NODE_MAKERS, armed_check, full_replay_contexts, maker, node_maker
from .reread import checkpoint_frame, read_again

__all__ = ["RegionSaves", "probe_checkpoint_hooks"]

_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types that are never fake: most saved tensors, told apart without ``is_fake``'s checks."""


class _Fake:
    """A fake tensor saved inside the region, kept out of the hooks below (NOTE [Traces inside a region])."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _hook_codes() -> tuple[Any, Any, Any] | None:
    """The code of checkpoint's forward pack, its unpack and its replay pack (under the dynamo wrapper), or
    None where checkpoint's hooks are not built as NOTE [Checkpoint's hooks in the region's pair] expects."""
    try:
        forward = torch_recompute._checkpoint_hook(torch_recompute._CheckpointFrame(None, True, None, None))
        replay = torch_recompute._recomputation_hook(None, 0)  # type: ignore[arg-type]
        inner = replay.pack_hook.__wrapped__  # type: ignore[attr-defined]
        codes = forward.pack_hook.__code__, forward.unpack_hook.__code__, inner.__code__
    except (AttributeError, TypeError):
        return None
    if codes[0].co_freevars != ("frame",) or set(codes[2].co_freevars) != {"gid", "target_frame_ref"}:
        return None
    return codes


_CODES = _hook_codes()
_inline = False
"""Whether the pair does checkpoint's hooks' work itself (NOTE [Checkpoint's hooks in the region's pair]);
set by :func:`probe_checkpoint_hooks`, which apply runs."""


def _closure(function: Any, name: str) -> Any:
    return function.__closure__[function.__code__.co_freevars.index(name)].cell_contents


def _own_forward_frame(pack: Any, frame: Any) -> bool:
    """Whether ``pack`` is checkpoint's own forward pack over ``frame``, whose check of the replay's saved
    tensors hyperac's fingerprint stands in for."""
    return (_inline and frame is not None and getattr(pack, "__code__", None) is _CODES[0]  # type: ignore[index]
            and _closure(pack, "frame") is frame)


def _replay_target(pack: Any) -> tuple[Any, Any] | None:
    """The frame and backward key of checkpoint's replay pack ``pack``, or None for another hook."""
    inner = getattr(pack, "__wrapped__", None)
    if not _inline or getattr(inner, "__code__", None) is not _CODES[2]:  # type: ignore[index]
        return None
    frame = _closure(inner, "target_frame_ref")()
    return None if frame is None or not frame.ignore_saved_mismatch else (frame, _closure(inner, "gid"))


class RegionSaves:
    """While entered, the one hook pair of a region's forward (``replaying=False``) or replay (NOTE [One
    hook pair per region]); with no hooks in effect (no checkpoint around), nothing changes."""

    __slots__ = ("before_replay", "entries", "first", "frame", "gid", "pack", "pushed", "replaying")

    def __init__(self, replaying: bool, before_replay: Callable[[], None] | None = None) -> None:
        self.replaying = replaying
        self.before_replay = before_replay
        """Run by the forward's unpack before a read that replays the region (NOTE [Inputs written in place] in
        recompute.py)."""
        self.pushed = False
        self.entries: list[Any] = []
        self.first = 0
        self.pack: Callable[[torch.Tensor], Any] | None = None
        self.frame: Any = None
        self.gid: Any = None

    def __enter__(self) -> None:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if outer is None:
            return
        self.pack, unpack = outer
        check = armed_check()
        frame = None if self.replaying else checkpoint_frame(unpack)
        if check is not None:  # NOTE [Checkpoint's hooks in the region's pair]
            self.entries, self.first = check.entries, check.first
            if self.replaying:
                self.frame, self.gid = _replay_target(self.pack) or (None, None)
            elif _own_forward_frame(self.pack, frame):
                frame.ignore_saved_mismatch = True
                self.frame = frame
        pack = self._pack if check is None else self._fingerprinted
        inline = frame is not None and _inline and getattr(unpack, "__code__", None) is _CODES[1]  # type: ignore[index]
        torch._C._autograd._push_saved_tensors_default_hooks(
            pack, functools.partial(_unpack_inline if inline else _unpack, frame, unpack, self.before_replay))
        self.pushed = True

    def __exit__(self, *exc: Any) -> None:
        if self.pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.pushed = False
            self.pack = None
            self.entries = []
            self.frame = self.gid = None

    def _pack(self, tensor: torch.Tensor) -> Any:
        if type(tensor) not in _PLAIN and is_fake(tensor):
            return _Fake(tensor.detach())
        return self.pack(tensor)  # type: ignore[misc]

    def _fingerprinted(self, tensor: torch.Tensor) -> Any:
        """:meth:`_pack`, listing ``tensor``'s fingerprint first (replay_check.maker inlined), and where the pair
        below is checkpoint's own (:attr:`frame` set), doing its work: in forward a holder, whose weak reference
        the frame keeps; in a replay the tensor filed under a new handle of the forward's holder at the same
        position (NOTE [Checkpoint's hooks in the region's pair]). One Python call per tensor."""
        if type(tensor) not in _PLAIN and is_fake(tensor):
            return _Fake(tensor.detach())
        node = tensor.grad_fn
        if node is None or node._sequence_nr() < self.first:
            made_by = None
        else:
            made_by = NODE_MAKERS.get(type(node)) or node_maker(node)
            if made_by == "ToCopyBackward0":
                made_by = maker(tensor, self.first)
        self.entries += made_by, tensor.shape, tensor.dtype  # one fingerprint, flat (replay_check.FIELDS)
        frame = self.frame
        if frame is None:
            return self.pack(tensor)  # type: ignore[misc]
        if not self.replaying:
            holder = _new(_Holder)
            holder.handles = {}
            frame.weak_holders.append(weakref.ref(holder))
            return holder
        gid, holders = self.gid, frame.weak_holders
        position = frame.recomp_counter[gid]
        holder = holders[position]() if position < len(holders) else None
        if position >= len(holders) or (holder is not None and holder.handles.get(gid) is not None):
            return self.pack(tensor)  # type: ignore[misc]  # checkpoint's errors
        value = tensor.detach() if tensor.requires_grad else tensor
        frame.recomp_counter[gid] = position + 1
        if holder is not None:
            handle = holder.handles[gid] = _Handle()
            replayed = frame.recomputed[gid]
            replayed.data[weakref.ref(handle, replayed._remove)] = value
        if frame.early_stop and position + 1 == len(holders):
            raise _Stop
        return value


_new = object.__new__
_Holder = torch_recompute._Holder
_Handle = torch_recompute._Handle
_Stop = torch_recompute._StopRecomputationError
_UNREAD = object()


def _unpack(frame: Any, unpack: Callable[[Any], torch.Tensor], before_replay: Callable[[], None] | None,
            saved: Any) -> torch.Tensor:
    if type(saved) is _Fake:
        return saved.tensor
    if before_replay is not None:
        before_replay()
    if frame is None or None not in saved.handles.values():  # read by no backward yet: a first read
        return unpack(saved)
    return read_again(frame, unpack, saved)


def _unpack_inline(frame: Any, unpack: Callable[[Any], torch.Tensor], before_replay: Callable[[], None] | None,
                   saved: Any) -> torch.Tensor:
    """:func:`_unpack`, handing out a value the replay has filed itself (NOTE [Checkpoint's hooks in the
    region's pair]); the first read of a backward (which replays), a second read and a read outside a
    backward go through checkpoint's unpack."""
    if type(saved) is _Fake:
        return saved.tensor
    gid = _graph_exec_group()
    if gid is None:
        gid = torch._C._current_graph_task_id()
    handle = saved.handles.get(gid, _UNREAD)
    first = handle is _UNREAD or gid == -1 or not frame.is_recomputed.get(gid)
    if first or handle is None:  # a read that replays
        if before_replay is not None:
            before_replay()
        return unpack(saved) if first else read_again(frame, unpack, saved)
    value = frame.recomputed[gid].data[weakref.ref(handle)]
    saved.handles[gid] = None
    return value


_graph_exec_group = getattr(torch._C, "_get_graph_exec_group", lambda: None)


def probe_checkpoint_hooks(again: bool = False) -> str | None:
    """Run a ``full`` region through checkpoint with the pair doing checkpoint's hooks' work (NOTE
    [Checkpoint's hooks in the region's pair]), a second backward through it too, and compare with autograd;
    sets whether regions do so from now on (where not, they call checkpoint's hooks). Returns the problem
    found, or None. Run by apply once per process (again after a failure, or with ``again``)."""
    global _inline, _probed
    if _probed and not again:
        return None
    _inline = _CODES is not None
    try:
        with (torch.device("cpu"), torch.inference_mode(False), torch.enable_grad(), _disable_current_modes(),
              torch.autocast("cpu", enabled=False)):
            problem = "torch.utils.checkpoint's hooks are not built as hyperac expects" if _CODES is None else _probe()
    except Exception as error:  # any failure of the internals' contract: checkpoint's hooks are used instead
        problem = f"running a region through it raised {type(error).__name__}: {error}"
    _inline = _probed = problem is None
    return problem


_probed = False


def _probe() -> str | None:
    x = torch.linspace(0.1, 0.9, 4, requires_grad=True)
    expected = torch.autograd.grad(((x.exp() ** 2).sin() * x).sum(), x)[0]
    forward, replay = full_replay_contexts("probe", None, False)
    frames: list[Any] = []

    def region(value: torch.Tensor) -> torch.Tensor:
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
        frames.append(checkpoint_frame(hooks[1]) if hooks else None)
        with RegionSaves(replaying=len(frames) > 1):
            y = value.exp()
            return (y * y).sin() * value

    out = torch_recompute.checkpoint(region, x, use_reentrant=False, determinism_check="none",
                                     context_fn=lambda: (forward, replay)).sum()
    grad = torch.autograd.grad(out, x, retain_graph=True)[0]
    again = torch.autograd.grad(out, x)[0]
    frame = frames[0]
    if frame is None or not frame.ignore_saved_mismatch or len(frame.weak_holders) * FIELDS != len(forward.entries):
        return "checkpoint's frame was not found, or the region's pair did not hold its saved tensors"
    if not (torch.equal(grad, expected) and torch.equal(again, expected)):
        return "a region whose pair does checkpoint's hooks' work gave another gradient"
    return None
