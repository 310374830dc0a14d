"""Install recompute (and swap) on modules by overriding the instance's ``forward``.

The module object, its class, its parameters' names and its ``state_dict`` keys stay as they
were; only ``module.forward`` (an instance attribute) changes, to an override object that holds
plain data (state.py, NOTE [Applied state is data]); ``hyperac.remove`` restores the original.
Outside training with grad enabled an override calls the module's own forward, untouched.
Like HF's ``GradientCheckpointingLayer``, the override sits inside ``__call__``, so
module hooks (FSDP2's unshard and reshard among them) stay outside the region and do not fire
again in the replay.

Recompute uses PyTorch's non-reentrant ``torch.utils.checkpoint``: gradients reach frozen
layers' inputs and LoRA adapters, keyword arguments work, and the RNG state is replayed so
dropout masks match. Each eager replay also starts from the Python state its forward started from
(NOTE [Python state in the replay] in replay/python_state.py), under the forward's torch settings (NOTE [The
forward's context in the replay] in replay/replay_context.py), with the buffers of modules the layer runs but
does not own as the forward read them (NOTE [Buffers in the replay] in replay/buffers.py); and every replay is
checked against its forward, ``full`` included (NOTE [Every replay is checked] in replay/replay_check.py).

NOTE [Excluded modules]
A region may exclude sub-modules from its replay (an attention that publishes state, a module
with collectives). In forward the excluded module runs once, with real saved tensors (an inner
``saved_tensors_hooks`` pair that keeps them, overriding the region's recompute hooks) and with
its ops invisible to the selective replay accounting (``policy.bypass_replay``). Its output is
queued on the region invocation's frame, with the RNG states as the module left them. In the replay
the module does not run: the queued output is returned, detached and with its ``requires_grad``
flag, so the replay saves the same tensors, and the RNG states are set to the queued ones, so a
dropout after the excluded module draws the same mask as in forward even when the excluded module
itself drew random numbers (the replay runs inside the recompute's ``fork_rng``). Every replay
returns the queued outputs (a second backward through a retained graph replays the region again),
so they live as long as the region's graph does, not only until the first replay.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
import functools
import sys
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as torch_recompute
from torch.utils._pytree import tree_leaves, tree_map_only

from ._compat import SAC_CHECKPOINT_KWARGS, side_effects_once
from ._hf import CACHE_KWARGS
from .backends import Backend
from .config import KNAPSACK_MODES, SELECTIVE_MODES
from .errors import InputWrittenError, UnsupportedModelError, warn_once
from .lifecycle import region_entry
from .policy import (
    OpSets,
    bypass_replay,
    compile_context_fn,
    forced_recompute,
    resolve_op_sets,
    routing_ops,
    selective_contexts,
)
from .replay.buffers import BufferSnapshots, buffers_as_before
from .replay.freed_saves import FreedSaves
from .replay.python_state import Snapshots
from .replay.random_sources import TrackerReplay, rng_states, set_rng_states
from .replay.region_saves import RegionSaves
from .replay.replay_check import full_replay_contexts
from .replay.replay_context import ForwardContext
from .replay.routing import RoutesSeen, routes_in_full
from .state import AppliedState, Override
from .swap import LayerSwap, current_group

__all__ = [
    "RecomputeContext", "build_context_fn", "install_exclusion", "install_forced_recompute", "install_knapsack",
    "install_recompute", "install_swap",
]


def _training(module: nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()


class _RegionFrame:
    """Outputs of the excluded modules of one region invocation, in call order per module, and how
    many of each the running replay has returned (every replay returns them all: a second backward
    replays the region again)."""

    def __init__(self) -> None:
        self.outputs: dict[int, list] = collections.defaultdict(list)
        self.returned: collections.Counter = collections.Counter()
        self.replaying = False


_current_frame: contextvars.ContextVar[_RegionFrame | None] = contextvars.ContextVar(
    "hyperac_region_frame", default=None
)


class _FrameScope:
    """Makes ``frame`` the current region frame while entered, marked as replaying or not; entered
    once per forward and once per replay (a second backward replays again)."""

    def __init__(self, frame: _RegionFrame, replaying: bool) -> None:
        self.frame, self.replaying = frame, replaying
        self.tokens: list[contextvars.Token] = []

    def __enter__(self) -> None:
        self.frame.replaying = self.replaying
        self.frame.returned.clear()
        self.tokens.append(_current_frame.set(self.frame))

    def __exit__(self, *exc: Any) -> None:
        _current_frame.reset(self.tokens.pop())


class _Both:
    """Enter two context managers as one (the order of exit is the reverse of entry)."""

    def __init__(self, first: Any, second: Any) -> None:
        self.stack = contextlib.ExitStack()
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.stack.enter_context(self.first)
        self.stack.enter_context(self.second)

    def __exit__(self, *exc: Any) -> bool:
        return self.stack.__exit__(*exc)


class RecomputeContext:
    """How the regions of one apply replay: the ``context_fn`` of ``torch.utils.checkpoint``.

    Calling it gives a fresh (forward, replay) context pair per region invocation; this is the one
    place those contexts are built. Plain data: the op sets are resolved from the backend when first
    needed, again in a copy (resolved op handles cannot be pickled).
    """

    def __init__(
        self, mode: str, backend: Backend, ops: OpSets | None, *, compile: bool, has_exclusions: bool,
        swap_outputs: bool, layer: str, index: int | None,
    ) -> None:
        self.mode = mode
        self.backend_type = type(backend)
        self.compile = compile
        self.has_exclusions = has_exclusions
        self.swap_outputs = swap_outputs
        self.layer, self.index = layer, index
        self._ops = ops
        self.save_ops = None if ops is None else ops.save_ops
        self.routes_seen = RoutesSeen()  # NOTE [Routing is kept] in replay/routing.py
        # Built here, not in the traced frame (NOTE [One graph per layer plan]).
        self._compiled = compile_context_fn(self.backend_type, mode, swap_outputs, self.save_ops) if compile else None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_ops": None}

    @property
    def ops(self) -> OpSets:
        if self._ops is None:
            self._ops = resolve_op_sets(self.backend_type(), self.save_ops)
        return self._ops

    def context_fn(self) -> Callable[[], tuple[Any, Any]] | None:
        """What to pass as ``context_fn``: under ``torch.compile`` a function the compiler accepts, or
        nothing where the contexts only check the replay (:attr:`checks_only`)."""
        if self.checks_only and torch.compiler.is_compiling():
            return None
        return self._compiled if self.compile else self

    @property
    def checks_only(self) -> bool:
        """Whether the contexts only check the replay (an eager ``full`` region without exclusions, NOTE
        [Every replay is checked] in replay/replay_check.py): a traced region goes without them (the compiler
        replays its own graph)."""
        return self.mode == "full" and not self.compile and not self.has_exclusions

    def __call__(self) -> tuple[Any, Any]:
        if self.mode in SELECTIVE_MODES:
            group = current_group() if self.swap_outputs else None
            forward_ctx, replay_ctx = selective_contexts(self.ops, group, self.mode, self.layer, self.index)
        elif self.mode == "full" and not self.compile:
            forward_ctx, replay_ctx = full_replay_contexts(self.layer, self.index, self.has_exclusions)
            if self.routes_seen.routes is not False:  # NOTE [Routing is kept]: a layer that routed nothing pays nothing
                routing = routes_in_full(self.routes_seen, self._ops or _routing_only(), self.layer, self.index)
                if routing is not None:
                    forward_ctx, replay_ctx = _Both(forward_ctx, routing[0]), _Both(replay_ctx, routing[1])
        else:
            forward_ctx, replay_ctx = contextlib.nullcontext(), contextlib.nullcontext()
        if not self.has_exclusions:
            return forward_ctx, replay_ctx
        frame = _RegionFrame()
        return _Both(_FrameScope(frame, False), forward_ctx), _Both(_FrameScope(frame, True), replay_ctx)


@functools.cache
def _routing_only() -> OpSets:
    """The op sets a ``full`` region reads: the routing ops only (NOTE [Routing is kept] in replay/routing.py),
    resolved once per process (aten's overloads), not per layer as a selective region's full sets are."""
    empty: frozenset = frozenset()
    return OpSets(matmul=empty, keep=empty, routing=routing_ops(), ignored=empty)


def build_context_fn(
    mode: str,
    backend: Backend,
    ops: OpSets | None,
    *,
    compile: bool,
    has_exclusions: bool,
    swap_outputs: bool = False,
    layer: str = "?",
    index: int | None = None,
) -> RecomputeContext | None:
    """The context of regions of ``mode``, or ``None`` for PyTorch's default (a compiled ``swap`` region that
    does not offload).

    ``layer`` and ``index`` (fqn and flat index of the layer the region belongs to) name it in errors.
    Under ``compile``, ``swap_outputs`` offloads what the layer keeps (``mode="swap"``: everything it
    saves; NOTE [Swap under torch.compile] in compiled.py).
    """
    if compile and mode not in (*SELECTIVE_MODES, "full") and not (mode == "swap" and swap_outputs):
        return None
    return RecomputeContext(
        mode, backend, ops, compile=compile, has_exclusions=has_exclusions, swap_outputs=swap_outputs,
        layer=layer, index=index,
    )


# ---------------------------------------------------------------------------------------------
# NOTE [KV caches in replays]
# A KV cache argument (``cache``, ``past_key_values``, ``past_key_value``, ``layer_past``) is part of
# what a layer computes whenever the layer reads it: a decoder attending to the cache its encoder
# wrote (HF's diffusion_gemma), a prefix (prefix tuning). So the layer's forward gets the cache as
# given, reads it and appends to it once, exactly as without hyperac. Its replay in backward must
# see the cache as the forward saw it, without the keys the forward itself appended (a selective
# replay would fail, "not found in storage"; a full recompute would attend to them twice). Before
# the forward, the region takes a structural copy of each cache argument: lists, tuples, dicts and
# plain objects are copied, tensors are shared (caches grow by rebinding, ``torch.cat``, not by
# writing into the tensors they hold). Each replay gets a fresh copy of that, so what a replay
# appends goes nowhere, and a second replay (``retain_graph``) sees the same. A shared tensor
# changed in place since (a static cache's ``index_copy_``) cannot be seen as it was: the replay
# raises rather than compute something else. Nothing is dropped. HF's activation checkpointing
# instead sets ``cache=None`` unless the layer class declares ``_can_checkpoint_with_cache``, which
# changes the loss of a layer that reads a cache it did not write.

_SHARED_TYPES = (torch.Tensor, nn.Module, type, types.FunctionType, types.MethodType, types.ModuleType)


def _structure_copy(value: Any, memo: dict[int, Any], tensors: list[tuple[torch.Tensor, int]]) -> Any:
    """``value`` with its containers and plain objects copied, its tensors (and torch objects) shared;
    each tensor met is listed with its version in ``tensors``."""
    if isinstance(value, torch.Tensor):
        tensors.append((value, value._version))
        return value
    if id(value) in memo:
        return memo[id(value)]
    kind = type(value)
    if kind in (list, dict):
        copied = kind()
        memo[id(value)] = copied
        if kind is list:
            copied.extend(_structure_copy(item, memo, tensors) for item in value)
        else:
            copied.update((key, _structure_copy(item, memo, tensors)) for key, item in value.items())
        return copied
    if kind is tuple:
        return tuple(_structure_copy(item, memo, tensors) for item in value)
    if (not hasattr(value, "__dict__") or isinstance(value, _SHARED_TYPES)
            or kind.__module__.partition(".")[0] == "torch"):
        return value
    copied = copy.copy(value)
    memo[id(value)] = copied
    copied.__dict__.update((name, _structure_copy(item, memo, tensors)) for name, item in vars(value).items())
    return copied


class _CacheAsBefore:
    """A cache argument as it was when the layer's forward began (NOTE [KV caches in replays])."""

    def __init__(self, name: str, cache: Any) -> None:
        self.name = name
        self.tensors: list[tuple[torch.Tensor, int]] = []
        self.frozen = _structure_copy(cache, {}, self.tensors)

    def for_replay(self, fqn: str) -> Any:
        for tensor, version in self.tensors:
            if tensor._version != version:
                raise UnsupportedModelError(
                    f"the KV cache passed to recomputed layer {fqn} as {self.name}= (a {type(self.frozen).__name__}) "
                    f"was written in place after the layer's forward (a tensor of shape {list(tensor.shape)} went "
                    f"from version {version} to {tensor._version}, as a StaticCache writes), so the layer's replay "
                    "cannot see the cache as its forward did. Use a DynamicCache or no cache in training, or leave "
                    "this layer out of recompute with layers={<its index>: 'off'}."
                )
        return _structure_copy(self.frozen, {}, [])


# NOTE [One graph per layer plan]
# Under torch.compile, dynamo guards on every Python value the traced frame reads: a layer's name or
# index read there (``self.fqn``), an object built per layer (a ``context_fn`` made lazily on the
# first call) or per apply (resolved op sets) makes one graph per layer, and from the ninth layer
# on (``recompile_limit``) layers run uncompiled, silently. So the traced path of a ``compile=True``
# layer reads only values equal for every layer of one mode: the override's mode flags, and a
# ``context_fn`` built at apply from constants (policy.compile_context_fn). The layer's name is read
# only to word an error, off the traced path. Identical layer plans share one graph, in one model
# and across applies (the planner's profile compiles the same graphs the plan then uses).


# NOTE [Inputs written in place]
# ``torch.utils.checkpoint`` replays a layer on the very tensors its forward was given. A write into
# one of them, by the layer's own forward (``x.mul_(2)``) or by the caller after the layer returned
# (the layer returned its input or a view of it, and the caller wrote into that), makes the replay
# read the written value: wrong gradients, or torch's "modified by an inplace operation" error
# (checkpoint saves its positional inputs with their versions), which names neither the layer nor a
# fix. An un-applied layer has no replay, so the same program runs. Keeping a copy of every input
# against such writes would cost what recompute saves. So the region notes the version counter of
# each tensor argument as its forward starts; a counter that moved by the end of the forward, or by
# the start of a replay, raises :class:`InputWrittenError` naming the layer and ``layers={i: "off"}``,
# which leaves the layer's saved tensors to autograd. The replay's check runs in the region's unpack
# hook (NOTE [One hook pair per region] in replay/region_saves.py) before it calls checkpoint's, which
# replays the region after checking the versions of the inputs it saved: so hyperac's error comes
# first, and checkpoint is given the caller's tensors themselves (the layer's autograd graph is the
# un-applied one, node for node). Under swap the region lets go of its positional inputs after the
# forward, so swap can free or move them: there, only writes during the forward are caught, and a
# caller's later write meets torch's check. Checked only where the region runs eagerly (under
# torch.compile a traced region is the compiler's).

def _tensor_arguments(args: tuple, kwargs: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    for position, value in enumerate(args):
        for tensor in _leaves(value):
            if isinstance(tensor, torch.Tensor):
                yield f"positional argument {position}", tensor
    for name, value in kwargs.items():
        for tensor in _leaves(value) if name not in CACHE_KWARGS else ():
            if isinstance(tensor, torch.Tensor):
                yield f"argument {name}=", tensor


def _leaves(value: Any) -> Any:
    """``tree_leaves(value)`` where it may hold tensors; a tensor, ``None``, a number, a string or a tuple of plain
    tensors (the usual arguments: ``use_cache=False``, rotary embeddings' ``(cos, sin)``) told apart without
    pytree's cost."""
    kind = type(value)
    if value is None or kind in _PLAIN_TENSORS:
        return (value,)
    if kind in _SCALARS:
        return ()
    if kind is tuple and all(type(item) in _PLAIN_TENSORS for item in value):
        return value
    return tree_leaves(value)


_PLAIN_TENSORS = (torch.Tensor, nn.Parameter)
_SCALARS = frozenset({bool, int, float, str})


class _Region:
    """One recomputed call of a module's forward: ``torch.utils.checkpoint`` runs it once in forward
    and again for each replay (keyword arguments bound here, so none clash with checkpoint's own).
    ``override`` names the layer in errors; it is read only then (NOTE [One graph per layer plan])."""

    def __init__(self, call: Callable[..., Any], kwargs: dict[str, Any], override: RecomputedForward) -> None:
        self.call, self.kwargs, self.override = call, kwargs, override
        self.caches = [_CacheAsBefore(name, kwargs[name]) for name in CACHE_KWARGS if kwargs.get(name) is not None]
        self.watched = False
        self.inputs: list[tuple[str, torch.Tensor, int]] = []
        """``(argument, tensor, version)`` of each tensor argument to check."""
        self.forward_done = False
        self.as_in_forward: _AsInForward | None = None
        """What each replay enters to run as the forward did."""

    def run_watched(self, start: Callable[[tuple], Callable[[], Any]], args: tuple, swapped: bool) -> Any:
        """The region's forward, ``start(...)()``, with its tensor inputs watched (NOTE [Inputs written in place])."""
        self.watched = True
        module = self.override.module_and_forward()[0]
        plain_kwargs = {name: value for name, value in self.kwargs.items() if name not in CACHE_KWARGS}
        state = self.override.snapshots.take(module, args, plain_kwargs)
        buffers = buffers_as_before(state.borrowed, self.override.fqn, self.override.index) if state.borrowed else None
        self.as_in_forward = _AsInForward(state, ForwardContext(), buffers)
        keywords = [(name, tensor, tensor._version) for name, tensor in _tensor_arguments((), self.kwargs)]
        self.inputs = [(name, tensor, tensor._version) for name, tensor in _tensor_arguments(args, {})] + keywords
        output = start(args)()
        self._check_inputs("by the layer's own forward")
        if swapped:  # let go of the positional inputs, which swap may free or move
            self.inputs = keywords
        return output

    def _unwritten(self) -> None:
        """Raise where an input was written since the forward (NOTE [Inputs written in place]): run before each
        replay starts."""
        self._check_inputs("after the layer returned")

    def _check_inputs(self, when: str) -> None:
        for name, tensor, version in self.inputs:
            if tensor._version != version:
                raise InputWrittenError(
                    f"hyperac: the input of recomputed layer {self.override.fqn!r} ({name}, a tensor of shape "
                    f"{list(tensor.shape)}) was written in place {when} (its version went from {version} to "
                    f"{tensor._version}), so the layer's replay in backward would read the written value instead "
                    "of the one its forward read. Leave the layer out of recompute: hyperac.apply(model, ..., "
                    f"layers={{{'<its index>' if self.override.index is None else self.override.index}: 'off'}}), "
                    "or write into a copy (x = x.clone()) instead."
                )

    @region_entry  # where lifecycle.HookOps stops looking up the stack
    def __call__(self, *args: Any) -> Any:
        if not self.caches and not self.watched:  # traced: NOTE [Python side effects in a compiled region]
            return side_effects_once(self.call, *args, **self.kwargs)
        if not self.forward_done:
            self.forward_done = True
            # NOTE [One hook pair per region] in replay/region_saves.py
            with RegionSaves(replaying=False, before_replay=self._unwritten if self.watched else None):
                return self.call(*args, **self.kwargs)
        replay_kwargs = {**self.kwargs, **{cache.name: cache.for_replay(self.override.fqn) for cache in self.caches}}
        with self.as_in_forward or contextlib.nullcontext(), RegionSaves(replaying=True):
            return self.call(*args, **replay_kwargs)


class _AsInForward:
    """What a replay enters to run as its region's forward did: the Python state (NOTE [Python state in the
    replay]), the forward's torch settings (NOTE [The forward's context in the replay]) and the buffers of
    modules the region borrows (NOTE [Buffers in the replay]), entered in that order and left in the other;
    what a context entered before one that raises is left again. One object, without an ``ExitStack``'s
    wrapper per context: it runs at every replay."""

    __slots__ = ("buffers", "context", "state")

    def __init__(self, state: Any, context: Any, buffers: Any) -> None:
        self.state, self.context, self.buffers = state, context, buffers

    def __enter__(self) -> None:
        token = bypass_replay.set(True)  # copies of buffers are no ops of the region
        try:
            self.state.__enter__()
            try:
                self.context.__enter__()
                try:
                    if self.buffers is not None:
                        self.buffers.__enter__()
                except BaseException:
                    self.context.__exit__(*sys.exc_info())
                    raise
            except BaseException:
                self.state.__exit__(*sys.exc_info())
                raise
        finally:
            bypass_replay.reset(token)

    def __exit__(self, *exc: Any) -> None:
        try:
            try:
                if self.buffers is not None:
                    self.buffers.__exit__(*exc)
            finally:
                self.context.__exit__(*exc)
        finally:
            self.state.__exit__(*exc)


class RecomputedForward(Override):
    """Recompute the module's forward in backward, while it trains with grad enabled; otherwise its
    own forward runs untouched. With ``swap``, the inputs the recompute keeps (and, in selective
    mode, the op outputs the context asks for) live in host memory between forward and backward."""

    def __init__(
        self, module: nn.Module, owner: AppliedState, fqn: str, context: RecomputeContext | None,
        swap: LayerSwap | None, index: int | None = None,
    ) -> None:
        super().__init__(module, owner, fqn)
        self.swap = swap
        self.index = index
        self.saves_checked = False
        """Whether a forward of the region was watched for saved tensors it frees (done once)."""
        self.snapshots = Snapshots()
        """The Python state each invocation's forward starts from (NOTE [A snapshot taken again] in
        replay/python_state.py)."""
        # Eager regions keep their buffer updates single (NOTE [Buffers in the replay] in replay/buffers.py).
        compiled = context is not None and context.compile
        self.checked = context is not None and not compiled
        """Whether hyperac checks each replay of the region itself (NOTE [Every replay is checked] in
        replay/replay_check.py), so torch's coarser check of saved tensors' metadata is not run on top."""
        self.context = context if compiled else BufferSnapshots.wrap(module, context, fqn, index)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, call = self.module_and_forward()
        if not _training(module):
            return call(*args, **kwargs)
        if torch.compiler.is_compiling() and not self._untraceable():
            cached = [name for name in CACHE_KWARGS if kwargs.get(name) is not None]
            if not cached:
                return self._start(_Region(call, kwargs, self), kwargs, args)()
            return _eager_region(functools.partial(_cache_under_compile, self, cached[0], call, args, kwargs))
        # Outside the graph even when not tracing: a compiled model that fell back to eager at a
        # graph break would otherwise compile this frame (NOTE [Eager regions under torch.compile]).
        return _eager_region(functools.partial(self.run_eagerly, call, args, kwargs))

    def run_eagerly(self, call: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """The region, run eagerly, with its inputs watched (NOTE [Inputs written in place])."""
        region = _Region(call, kwargs, self)
        output = region.run_watched(functools.partial(self._start, region, kwargs), args, self.swap is not None)
        self.saves_checked = True
        return output

    def _start(self, region: _Region, kwargs: dict[str, Any], args: tuple) -> Callable[[], Any]:
        """What runs the region's forward on ``args``: the recompute, within the swap if any."""
        context_fn = self.context.context_fn() if isinstance(self.context, RecomputeContext) else self.context
        if not torch.compiler.is_compiling():  # NOTE [RNG trackers] in replay/random_sources.py
            context_fn = TrackerReplay.wrap(context_fn)
            if not self.saves_checked:  # NOTE [Saved tensors freed in forward] in replay/freed_saves.py
                context_fn = FreedSaves(context_fn, self.fqn, self.index)
        extra = {} if context_fn is None else {"context_fn": context_fn, **SAC_CHECKPOINT_KWARGS}
        if self.checked and not torch.compiler.is_compiling():
            extra["determinism_check"] = "none"
        run = functools.partial(torch_recompute.checkpoint, region, *args, use_reentrant=False, **extra)
        if self.swap is not None:
            run = functools.partial(self.swap.manager.run_layer, self.swap.offload, run, (args, kwargs),
                                    self.swap.saved_tensors)
        return run

    def _untraceable(self) -> bool:
        """Whether torch.compile cannot trace this region (NOTE [Eager regions under torch.compile])."""
        traced = isinstance(self.context, RecomputeContext) and (self.context.compile or self.context.checks_only)
        return self.swap is not None or (self.context is not None and not traced)


class SwappedForward(Override):
    """Keep the tensors the module saves for backward in host memory (no recompute)."""

    def __init__(self, module: nn.Module, owner: AppliedState, fqn: str, swap: LayerSwap) -> None:
        super().__init__(module, owner, fqn)
        self.swap = swap

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, call = self.module_and_forward()
        if not _training(module):
            return call(*args, **kwargs)
        layer = functools.partial(call, *args, **kwargs)
        run = functools.partial(self.swap.manager.run_layer, self.swap.offload, layer, (args, kwargs))
        return _eager_region(run) if torch.compiler.is_compiling() else run()


class KnapsackForward(Override):
    """Give the module's compiled graph torch's partitioner knapsack at the budget of ``mode`` (NOTE [Knapsack
    layers] in compiled.py); run eagerly, or not training, its own forward runs untouched."""

    def __init__(self, module: nn.Module, owner: AppliedState, fqn: str, mode: str) -> None:
        super().__init__(module, owner, fqn)
        self.mode = mode  # a string, which dynamo guards as a constant (a float attribute turns symbolic)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, call = self.module_and_forward()
        if not (_training(module) and torch.compiler.is_compiling()):
            return call(*args, **kwargs)
        return self._in_region(*args, **kwargs)

    def _in_region(self, *args: Any, **kwargs: Any) -> Any:
        # The budget must cover a whole graph: the layer's own. Dynamo shows the message (a keyword
        # literal) when fullgraph=True refuses the break.
        torch._dynamo.graph_break(msg=(
            "hyperac: a knapsack-* layer starts a graph of its own (torch applies a region budget only to a "
            "whole graph), so it cannot be compiled with fullgraph=True; compile without fullgraph, or give the "
            "layer a mode that compiles in one graph, such as 'pointwise' or 'selective'."
        ))
        _, call = self.module_and_forward()
        with torch.autograd.graph.region_activation_memory_budget(KNAPSACK_MODES[self.mode]):
            return call(*args, **kwargs)


class ExcludedForward(Override):
    """Keep the module out of the replay of the region around it (NOTE [Excluded modules])."""

    inert_outside_regions = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, call = self.module_and_forward()
        frame = _current_frame.get()
        if frame is None:
            return call(*args, **kwargs)
        queue = frame.outputs[id(module)]
        if frame.replaying:
            output, states = queue[frame.returned[id(module)]]
            frame.returned[id(module)] += 1
            set_rng_states(states)
            return _replayed(output)
        token = bypass_replay.set(True)
        try:
            with torch.autograd.graph.saved_tensors_hooks(_keep, _keep):
                output = call(*args, **kwargs)
        finally:
            bypass_replay.reset(token)
        queue.append((output, rng_states(args, kwargs, output)))
        return output


class ForcedRecomputeForward(Override):
    """Keep nothing of the module's ops in the selective region around it (``Config.force_recompute``)."""

    inert_outside_regions = True

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        _, call = self.module_and_forward()
        token = forced_recompute.set(True)
        try:
            return call(*args, **kwargs)
        finally:
            forced_recompute.reset(token)


def install_recompute(
    module: nn.Module, owner: AppliedState, fqn: str, context: RecomputeContext | None, swap: LayerSwap | None = None,
    index: int | None = None,
) -> None:
    """Make ``module`` recompute its forward in backward (sets ``module.forward``); ``index``, the
    flat index of its layer, names the fix in errors."""
    RecomputedForward(module, owner, fqn, context, swap, index).install()


def install_swap(module: nn.Module, owner: AppliedState, fqn: str, swap: LayerSwap) -> None:
    """Keep the tensors ``module`` saves for backward in host memory (sets ``module.forward``)."""
    SwappedForward(module, owner, fqn, swap).install()


def install_knapsack(module: nn.Module, owner: AppliedState, fqn: str, mode: str) -> None:
    """Give ``module``'s compiled graph torch's knapsack at the budget of ``mode``, one of
    :data:`~hyperac.config.KNAPSACK_MODES` (sets ``module.forward``)."""
    KnapsackForward(module, owner, fqn, mode).install()


def install_exclusion(module: nn.Module, owner: AppliedState, fqn: str) -> None:
    """Keep ``module`` out of the replay of the region around it (sets ``module.forward``)."""
    ExcludedForward(module, owner, fqn).install()


def install_forced_recompute(module: nn.Module, owner: AppliedState, fqn: str) -> None:
    """Make the selective region around ``module`` keep none of its ops (sets ``module.forward``)."""
    ForcedRecomputeForward(module, owner, fqn).install()


# NOTE [Eager regions under torch.compile]
# A layer applied with ``compile=False`` whose model the user then compiles: its region's
# context (hyperac's recording and replay modes, swap hooks; a ``swap`` mode layer's saved-tensor
# hooks alike) is Python that torch.compile cannot trace into a graph, and
# ``torch.utils.checkpoint`` under dynamo accepts only traceable contexts.
# So the region runs outside the graph, eagerly (a graph break before and after the layer), as
# everything the compiler cannot trace does; the rest of the model is compiled. Full recompute
# without swap or buffers has no context and is traced, as are ``compile=True`` layers (see
# ``policy.compile_context_fn``).


# NOTE [Python side effects in a compiled region]
# Dynamo traces a ``compile=True`` region's forward into torch.utils.checkpoint's higher-order op, and
# by default refuses any write to a Python object from outside the region there (eager checkpoint would
# make it again in the replay): the whole region then leaves the graph and its layer compiles as
# several frames, silently. transformers 5.25's ``kernels`` layers make such a write in every layer:
# the wrapper ``use_kernelized_func`` puts on attention sets a module-level context variable of the
# ``kernels`` package for the call and resets it after (under compile a plain attribute of a global
# object, ``CompileableContextVar.global_var``). hyperac's contract is the forward's side effects happen
# once and the replay reads what the forward read (NOTE [Python state in the replay] in replay/python_state.py),
# which is what a traced region gives when the writes are kept: dynamo applies them once after the
# forward graph, and the backward graph replays tensor ops only, on the values traced in forward. So
# the region's forward runs through dynamo's switch for exactly that
# (``_disable_side_effect_safety_checks_for_current_subtracer``, :func:`hyperac._compat.side_effects_once`),
# scoped to hyperac's own regions: torch's process-wide ``skip_fwd_side_effects_in_bwd_under_checkpoint``
# stays the user's, and module classes stay as they are. A set-and-reset like kernels' leaves nothing
# behind; a layer with a lasting write (a call counter) counts once per step, as eagerly.


# NOTE [KV caches under torch.compile]
# A ``compile=True`` layer called with a KV cache in a training forward (a cache passed in; HF's
# ``use_cache=True`` is already turned off in training, NOTE [KV caches in training] in _hf.py)
# cannot be traced: its region keeps the cache as it was for the replay (NOTE [KV caches in
# replays]), a side effect dynamo refuses inside ``torch.utils.checkpoint``, and dynamo would give up
# on the whole region, silently. So such a region runs eagerly outside the graph, with one warning
# per model naming the layer and the fix: it still keeps what its mode keeps (PyTorch's selective
# checkpoint contexts work eagerly too), but the layer is not compiled.


def _cache_under_compile(override: RecomputedForward, cache: str, call: Callable[..., Any], args: tuple,
                         kwargs: dict[str, Any]) -> Any:
    """Run a compiled layer's region that got a KV cache eagerly, warning once per model (NOTE [KV
    caches under torch.compile])."""
    warn_once(
        f"compile=True layer {override.fqn!r} was called with a KV cache ({cache}=) in a training forward: "
        "a region holding a cache cannot be traced, so such layers run eagerly, outside the compiled graph. Train "
        "without a cache: use_cache=False (or model.config.use_cache = False) and no past_key_values/cache argument.",
        override.owner.warned, stacklevel=5, key="kv cache under compile",
    )
    return override.run_eagerly(call, args, kwargs)


@torch._disable_dynamo
def _eager_region(run: Callable[[], Any]) -> Any:
    """Run a recomputed region outside torch.compile's graph (NOTE [Eager regions under torch.compile])."""
    return run()


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _replayed(value: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), value)
