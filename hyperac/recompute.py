"""Install and remove recompute on modules by overriding the instance's ``forward``.

The module object, its class, its parameters' names and its ``state_dict`` keys stay as they
were; only ``module.forward`` (an instance attribute) changes, and removing it restores the
original. Like HF's ``GradientCheckpointingLayer``, the override sits inside ``__call__``, so
module hooks (FSDP2's unshard and reshard among them) stay outside the region and do not fire
again in the replay.

Recompute uses PyTorch's non-reentrant ``torch.utils.checkpoint``: gradients reach frozen
layers' inputs and LoRA adapters, keyword arguments work, and the RNG state is replayed so
dropout masks match.

NOTE [Excluded modules]
A region may exclude sub-modules from its replay (an attention that publishes state, a module
with collectives). In forward the excluded module runs once, with real saved tensors (an inner
``saved_tensors_hooks`` pair that keeps them, overriding the region's recompute hooks) and with
its ops invisible to the selective replay accounting (``policy.bypass_replay``). Its output is
queued on the region invocation's frame, with the RNG states as the module left them. In the replay
the module does not run: the queued output is returned, detached and with its ``requires_grad``
flag, so the replay saves the same tensors, and the RNG states are set to the queued ones, so a
dropout after the excluded module draws the same mask as in forward even when the excluded module
itself drew random numbers (the replay runs inside the recompute's ``fork_rng``).
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils import checkpoint as torch_recompute
from torch.utils._pytree import tree_map_only

from .config import SELECTIVE_MODES
from .policy import OpSets, bypass_replay, compile_context_fn, rng_states, selective_contexts, set_rng_states
from .swap import LayerSwap, current_group

__all__ = ["build_context_fn", "install_exclusion", "install_recompute", "install_swap", "restore_forward"]

# Keyword arguments that carry a KV cache; a replay must not see a cache its forward appended to.
_CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
_ABSENT = object()


def _without_cache(kwargs: dict[str, Any]) -> dict[str, Any]:
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    for name in _CACHE_KWARGS:
        if kwargs.get(name) is not None:
            kwargs[name] = None
    return kwargs


def _original_call(module: nn.Module, original: Any) -> Callable[..., Any]:
    if original is _ABSENT:
        return type(module).forward.__get__(module)
    return original


class _RegionFrame:
    """Outputs of the excluded modules of one region invocation, in call order per module."""

    def __init__(self) -> None:
        self.outputs: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        self.replaying = False


_current_frame: contextvars.ContextVar[_RegionFrame | None] = contextvars.ContextVar(
    "hyperac_region_frame", default=None
)


@contextlib.contextmanager
def _frame_scope(frame: _RegionFrame, replaying: bool):
    frame.replaying = replaying
    token = _current_frame.set(frame)
    try:
        yield
    finally:
        _current_frame.reset(token)


def _context_fn(mode: str, ops: OpSets, has_exclusions: bool, swap_outputs: bool, layer: str, index: int | None):
    """A ``context_fn`` for ``torch.utils.checkpoint``: fresh contexts per region invocation."""

    def make() -> tuple[Any, Any]:
        if mode in SELECTIVE_MODES:
            group = current_group() if swap_outputs else None
            forward_ctx, replay_ctx = selective_contexts(ops, group, mode, layer, index)
        else:
            forward_ctx, replay_ctx = contextlib.nullcontext(), contextlib.nullcontext()
        if not has_exclusions:
            return forward_ctx, replay_ctx
        frame = _RegionFrame()
        return _Both(_frame_scope(frame, False), forward_ctx), _Both(_frame_scope(frame, True), replay_ctx)

    return make


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


def build_context_fn(
    mode: str,
    ops: OpSets | None,
    *,
    compile: bool,
    has_exclusions: bool,
    swap_outputs: bool = False,
    layer: str = "?",
    index: int | None = None,
) -> Callable[[], tuple[Any, Any]] | None:
    """The ``context_fn`` a region of ``mode`` uses, or ``None`` for PyTorch's default.

    ``layer`` and ``index`` (fqn and flat index of the layer the region belongs to) name it in errors.
    """
    if compile:
        return compile_context_fn(ops) if mode in SELECTIVE_MODES else None
    if mode == "full" and not has_exclusions:
        return None
    return _context_fn(mode, ops, has_exclusions, swap_outputs, layer, index)


def _training(module: nn.Module) -> bool:
    return module.training and torch.is_grad_enabled()


def install_recompute(
    module: nn.Module, context_fn: Callable[[], tuple[Any, Any]] | None, swap: LayerSwap | None = None
) -> Any:
    """Make ``module`` recompute its forward in backward; return what :func:`restore_forward` needs.

    Side effect: sets ``module.forward``. Recompute runs only while the module is in training mode
    with grad enabled; then KV-cache arguments are dropped (``use_cache=False``, cache ``None``).
    With ``swap``, the inputs the recompute keeps (and, in selective mode, the kept op outputs the
    context asks for) live in host memory between forward and backward.
    """
    original = module.__dict__.get("forward", _ABSENT)
    extra = {} if context_fn is None else {"context_fn": context_fn}

    def recomputed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = _original_call(self, original)
        if not _training(self):
            return call(*args, **kwargs)
        region = functools.partial(call, **_without_cache(kwargs))
        if swap is None:
            return torch_recompute.checkpoint(region, *args, use_reentrant=False, **extra)
        return swap.manager.run_layer(
            swap.offload, functools.partial(torch_recompute.checkpoint, region, use_reentrant=False, **extra),
            args, kwargs, swap.saved_tensors,
        )

    module.forward = types.MethodType(recomputed_forward, module)
    return original


def install_swap(module: nn.Module, swap: LayerSwap) -> Any:
    """Keep the tensors ``module`` saves for backward in host memory (no recompute).

    Side effect: sets ``module.forward``; returns what :func:`restore_forward` needs.
    """
    original = module.__dict__.get("forward", _ABSENT)

    def swapped_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = _original_call(self, original)
        if not _training(self):
            return call(*args, **kwargs)
        return swap.manager.run_layer(swap.offload, call, args, kwargs)

    module.forward = types.MethodType(swapped_forward, module)
    return original


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _replayed(value: Any) -> Any:
    return tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.requires_grad), value)


def install_exclusion(module: nn.Module) -> Any:
    """Keep ``module`` out of the replay of the region around it (NOTE [Excluded modules]).

    Side effect: sets ``module.forward``; returns what :func:`restore_forward` needs.
    """
    original = module.__dict__.get("forward", _ABSENT)

    def excluded_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        call = _original_call(self, original)
        frame = _current_frame.get()
        if frame is None:
            return call(*args, **kwargs)
        queue = frame.outputs[id(self)]
        if frame.replaying:
            output, states = queue.popleft()
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

    module.forward = types.MethodType(excluded_forward, module)
    return original


def restore_forward(module: nn.Module, original: Any) -> None:
    """Undo :func:`install_recompute` / :func:`install_exclusion`."""
    if original is _ABSENT:
        module.__dict__.pop("forward", None)
    else:
        module.forward = original
