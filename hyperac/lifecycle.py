"""Which ops a sharding stack runs to gather, release or prefetch a layer's parameters: not the layer's program.

NOTE [Parameter lifecycles are not the layer's program]
A sharding stack (DeepSpeed ZeRO-3, FSDP2 on a layer's sub-modules, whatever comes next) keeps each
parameter in shards and gathers it in a module's forward pre-hook, then releases it in the forward
hook; ZeRO-3 also attaches autograd functions to the module's inputs and outputs there, to gather
again in backward. Which parameters a hook gathers, and with which ops, depends on the stack's own
bookkeeping, not on the layer: in a layer's replay ZeRO-3 finds some parameters still gathered (or
prefetched by its coordinator's trace) and runs other ops than in the forward (``aten.slice`` of a
flat buffer in one, none in the other). Recorded, those ops would make the selective replay diverge
from its tape on the first layer that prefetches differently; kept, a parameter all-gather would pin
the gathered parameters until backward. So the recording and replay modes do not see them: they run
as the stack runs them, each time the stack runs them, and take no place on the tape.

They are told from the layer's own ops by what runs them, not by their names (which no list keeps up with:
``fsdp::all_gather_copy_in``, DeepSpeed's ``slice`` and ``detach``, the next stack's own ops): an op run by a
module hook (the code that ``nn.Module.__call__`` runs before or after the module's ``forward``) with autograd
off or on nothing autograd tracks (FSDP2 builds its unsharded parameters' views with autograd on); or an op
run while a module's attribute is looked up (``nn.Module.__getattr__``, which runs no op of its own: ZeRO-3
replaces a module's parameter dict with one that gathers a parameter a forward reads outside its own module,
PEFT's LoRA layer reading its adapter's ``weight.dtype``). A layer's program is what its ``forward`` runs, its
sub-modules' forwards included; a hook's op on what autograd tracks (one that changes the module's output, a
tensor-parallel hook redistributing its input) is part of it, and so is everything under ``torch.no_grad()``
inside a forward. A view a hook takes of a leaf is not, with autograd on or off: it computes nothing, runs
again in the replay wherever the hook runs again, and a hook may take it in the forward only (torch's
``ModuleTracker``, which ``FlopCounterMode`` runs, registers a multi-grad hook on a module's inputs in forward
and not in backward, and finds a leaf input's gradient accumulator through ``view_as``, which shifted the tape
by one op). Nor is any view of a parameter or of a view of one, whoever takes it: FSDP1
(``FullyShardedDataParallel``) takes ``flat_param.expand_as(flat_param)`` for its gradient hook in its wrapper's
own ``forward`` (no hook), in the first forward only, and builds a unit's parameters as views of its flat
parameter where it gathers them, which a replay may find gathered already. A layer given a parameter's view
(DETR's query position embeddings) gets the same view in its replay (NOTE [Inputs written in place] in
recompute.py), so its views of it are on neither tape. A collective that a wrapper's ``forward`` runs on the
storage of its module's parameters into buffers it is given (FSDP1's all-gather of a flat parameter's shard,
around the wrapped module's call; not a matmul fused with a collective that reads a weight and returns its
product) is the stack's too: recorded, it would be kept, and pin the gathered parameters until backward; the
views of its gather buffer that FSDP1 takes around it, with autograd tracking nothing, a replay may skip (NOTE
[Views a replay may skip] in policy.py). A collective in a forward (Megatron's sequence-parallel all-gather of
activations, ``c10d::_allgather_base_`` inside an ``autograd.Function``) is the layer's and kept like every collective
(NOTE [Collectives by their schema] in op_identity.py), and so is one a hook runs on the module's inputs or
output (a tensor-parallel plan's hooks redistributing activations, ``DTensor.redistribute`` with autograd
off); the same op run by a ZeRO-3 pre-hook on parameter shards, which are neither, is not seen. What a hook
derives from the module's inputs and output (a chunked, concatenated copy to reduce-scatter) counts as them.

The hook is found on the Python stack: the innermost ``nn.Module.__call__`` frame (``_call_impl``, or the
``inner`` function it runs when hooks are registered) tells by its current line whether it is calling the
module's ``forward`` or a hook, unless a ``__getattr__`` frame comes first. The look stops where the region's
forward is called (:func:`region_entry`): above it, the forward has the layer's own ``nn.Module.__call__`` and
the replay the backward's frames, and an op directly in the layer's ``forward`` (a matmul fused with an
all-reduce that reads the layer's weight) would be told apart in the two. Ops with an argument autograd
tracks (most of a layer's, on its activations and parameters) are the layer's without the look, views of a
leaf input excepted; the others pay for a few frames up (under a microsecond). The package whose code the hook
runs names the stack in the error of a replay that still diverges (:func:`stacks_note`): a hook's op on
tracked tensors that the replay does not run again, which no rule here can tell from the layer's own. The
Python state a stack keeps on modules about which parameters they gather is not the layer's either: replays
and profiling leave it as the stack left it (NOTE [Parameter bookkeeping is the stack's] in
replay/python_state.py).
"""

from __future__ import annotations

import dis
import sys
import types
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

__all__ = ["HookOps", "region_entry", "stacks_note"]


def _call_frames() -> tuple[dict[int, types.CodeType], frozenset[tuple[int, int]]]:
    """The code of ``nn.Module.__call__``'s frames (by ``id``), and the (code ``id``, line) pairs where they call
    ``forward``.

    By ``id``, not by the code object: a code object hashes its bytecode and constants on every lookup (``hash``
    of ``_call_impl``'s takes 0.4 us), and the look up the stack asks once or twice per frame. The dict holds
    the code objects, so their ids stay theirs."""
    outer = nn.Module._call_impl.__code__
    codes = [outer, *(const for const in outer.co_consts if isinstance(const, types.CodeType))]
    forward_lines = frozenset(
        (id(code), instruction.positions.lineno)
        for code in codes
        for instruction in dis.get_instructions(code)
        if instruction.argval == "forward_call" and instruction.opname.startswith("LOAD")
        and instruction.positions is not None and instruction.positions.lineno is not None
    )
    return {id(code): code for code in codes}, forward_lines


_CALL_CODES, _FORWARD_LINES = _call_frames()
_REGION_CODES: dict[int, types.CodeType] = {}
"""The code (by ``id``, holding it) that calls a region's forward, in forward and in each replay
(:func:`region_entry`)."""
_GETATTR = nn.Module.__getattr__.__code__
_WRAPPERS = ("torch._", "torch.utils.", "torch.compiler", "contextlib", "functools")
"""Modules of the decorators a hook may be wrapped in (``torch.no_grad()``, ``torch.compiler.disable``):
the stack is named by the first frame below the hook that is none of these."""


class HookOps:
    """Tells, op by op, what a sharding stack runs to gather, release or prefetch parameters (NOTE [Parameter
    lifecycles are not the layer's program]); one per recording or replay mode. Plain data: the stacks
    met, and the storages the module hook now running holds of the module's inputs and output
    (``activations``), with those its ops derived from them (a tensor-parallel hook's ``cat`` of chunks
    of the output before it reduce-scatters them)."""

    __slots__ = ("activations", "call", "derives", "stacks")

    def __init__(self) -> None:
        self.stacks: set[str] = set()
        """The packages whose hooks ran such ops (named in the error of a replay that still diverges)."""
        self.call: tuple[int, object] | None = None
        self.activations: set[int] = set()
        self.derives = False

    def owns(self, args: tuple, collective: bool, alias: bool = False, fills: bool = False) -> bool:
        """Whether the op being dispatched (called with ``args``; ``collective``: it communicates; ``alias``: it
        returns a view of its input and computes nothing, so a view of a parameter or of a parameter's view is
        on no tape; ``fills``: a collective that writes into buffers it is given, as a parameter all-gather
        does) is a stack's, not the layer's. Call it from a dispatch mode's ``__torch_dispatch__`` itself (it
        looks up the stack from that method's caller), and :meth:`ran` with the op's output where it answers
        ``True``. Most ops answer in a few statements (NOTE [Per op, not per call] in policy.py): a view of a
        parameter is the stack's, an op on what autograd tracks the layer's; only the others look up the
        stack."""
        if alias:  # an aten view: its first argument is the tensor it views
            viewed = args[0] if args[0]._base is None else args[0]._base
            if issubclass(type(viewed), nn.Parameter):  # not isinstance: Parameter's metaclass asks in Python
                self.derives = False
                return True  # a view of a parameter computes nothing: on no tape (FSDP1's, of its flat parameter)
        if torch.is_grad_enabled():
            for arg in args:  # a loop, not any() over a generator: a third of the cost, on every op
                if isinstance(arg, torch.Tensor) and arg.requires_grad and not (alias and arg.is_leaf):
                    return False  # computes on what autograd tracks: the layer's own (no look up the stack)
        frame = sys._getframe(2)  # the op's caller (past this and the mode's __torch_dispatch__)
        walked: list[types.FrameType] = []
        while frame is not None:
            code = frame.f_code
            if id(code) in _REGION_CODES:
                return False  # what runs the region differs between its forward and its replay: not looked at
            if code is _GETATTR:
                if not walked:
                    return False
                self.stacks.add(_package(walked))
                self.derives = False
                return True
            if id(code) in _CALL_CODES:
                if not walked:
                    return False
                if (id(code), frame.f_lineno) in _FORWARD_LINES:
                    if not (collective and fills and _reads_parameters(frame, args)):
                        return False
                    self.stacks.add(_package(walked))  # a wrapper's forward gathering its parameters (FSDP1)
                    self.derives = False
                    return True
                reads_activations = any(storage in self._activations_of(frame) for storage in _storages(args))
                if collective and reads_activations:
                    return False
                self.stacks.add(_package(walked))
                self.derives = reads_activations
                return True
            walked.append(frame)
            frame = frame.f_back
        return False

    def ran(self, out: object) -> None:
        """The stack's op returned ``out``: derived from the module's activations, it is one of them."""
        if self.derives:
            self.activations.update(_storages(out))

    def _activations_of(self, call: types.FrameType) -> set[int]:
        """The storages of the module's inputs and output as ``nn.Module.__call__``'s frame ``call`` holds them
        (``args``, ``kwargs``, ``result``), and what the hook derived from them so far."""
        held = call.f_locals
        key = (id(call), held.get("args"))
        if self.call is None or self.call[0] != key[0] or self.call[1] is not key[1]:
            self.call = key
            self.activations = set(_storages((held.get("args"), held.get("kwargs"), held.get("result"))))
        return self.activations


def _storages(value: object) -> Iterator[int]:
    """The storages (addresses) of the tensors in ``value``, those inside tensor subclasses (a DTensor's local
    shard) too."""
    for leaf in tree_leaves(value):
        if not isinstance(leaf, torch.Tensor):
            continue
        if is_traceable_wrapper_subclass(leaf):
            names, _ = leaf.__tensor_flatten__()
            yield from _storages([getattr(leaf, name) for name in names])
        else:
            yield leaf.untyped_storage()._cdata


def region_entry(function: Callable[..., object]) -> Callable[..., object]:
    """Mark ``function`` as what calls a recompute region's forward: :class:`HookOps` looks up the stack no further.
    Above it the forward has the layer's own ``nn.Module.__call__`` and its caller, the replay the backward's
    frames: a module found there would tell the forward's op from the replay's."""
    _REGION_CODES[id(function.__code__)] = function.__code__
    return function


def _reads_parameters(call: types.FrameType, args: tuple) -> bool:
    """Whether a collective called with ``args`` reads or writes the storage of a parameter of the module
    whose ``forward`` ``nn.Module.__call__``'s frame ``call`` is running (its sub-modules' included): FSDP1
    all-gathering a flat parameter's shard in its wrapper's forward."""
    module = call.f_locals.get("self")
    if not isinstance(module, nn.Module):
        return False
    touched = set(_storages(args))
    return any(parameter.untyped_storage()._cdata in touched for parameter in module.parameters())


def _package(walked: list[types.FrameType]) -> str:
    """The package whose code a module hook runs, from the frames between the op (first) and
    ``nn.Module.__call__`` (last, the hook itself): the first that is no wrapper, from the hook down
    (``deepspeed``, ``torch.distributed.fsdp``)."""
    for frame in reversed(walked):
        name = frame.f_globals.get("__name__", "?")
        if not name.startswith(_WRAPPERS):
            parts = name.split(".")
            return ".".join(parts[:3]) if parts[0] == "torch" else parts[0]
    return "?"


def stacks_note(stacks: Iterable[str]) -> str:
    """What a divergence error adds where the layer ran a sharding stack's parameter hooks: the stack, and
    ``mode="full"``, whose replay is not checked op by op."""
    names = sorted(set(stacks))
    if not names:
        return ""
    return (
        f" The layer's modules run parameter hooks of {', '.join(names)} (a sharding stack gathering and releasing "
        "parameters), whose ops hyperac leaves out of the replay; where they still change what the layer runs, "
        "every layer diverges alike: apply hyperac with mode='full' to this model instead of turning layers off."
    )
