"""Selective recompute policies: which op outputs a layer keeps for backward.

A policy answers, for each op a layer runs in forward, "keep its output or recompute it in
backward". hyperac keeps what is expensive to recompute or must not run twice, and recomputes
the rest:

* matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``, grouped and scaled variants, treated alike)
  alternate: the 1st, 3rd, 5th ... of each region are kept, the others recomputed;
* compute-intensive ops (convolutions, PyTorch partitioner's list), attention ops, collectives
  and ``max`` are kept; the attention and collective overloads come from the backend, resolved
  when the policy is built, so kernels registered after import (``torch_npu``, custom kernels)
  count;
* ``topk`` is always recomputed: models (MoE routers) change its outputs in place;
* profiler markers and FSDP parameter-lifecycle ops run as usual but stay out of the replay
  accounting, so an FSDP unshard that happens outside the region in forward and inside it in
  recompute does not shift the op stream. The ignore list belongs to each policy; PyTorch's
  process-wide ``SAC_IGNORED_OPS`` is left as it is.
"""

from __future__ import annotations

import contextvars
import importlib
import dataclasses
from collections import defaultdict
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import checkpoint as torch_recompute
from torch.utils.checkpoint import CheckpointPolicy

from .backends import Backend, resolve_ops

__all__ = ["OpSets", "SelectivePolicy", "resolve_op_sets"]

_MATMUL_OPS = (
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul",
    "aten::_grouped_mm", "aten::_scaled_mm", "aten::_scaled_grouped_mm",
)
_ALWAYS_KEEP_OPS = ("aten::max", "aten::convolution", "aten::upsample_bilinear2d")
_ALWAYS_RECOMPUTE_OPS = ("aten::topk",)
_PROFILER_OPS = (
    "profiler::_record_function_enter",
    "profiler::_record_function_enter_new",
    "profiler::_record_function_exit",
)
_FSDP_LIFECYCLE_OPS = (
    "fsdp::all_gather_copy_in",
    "fsdp::split_with_sizes_copy",
    "fsdp::chunk_cat",
    "fsdp::copy_",
    "c10d::_allgather_base_",
    "aten::empty.memory_format",
    "aten::empty_like",
    "aten::view",
)


def _all_overloads(qualified_names: tuple[str, ...]) -> frozenset:
    names = []
    for qualified in qualified_names:
        namespace, _, op_name = qualified.partition("::")
        if "." in op_name:
            names.append(qualified)
            continue
        try:
            packet = getattr(getattr(torch.ops, namespace), op_name)
        except (AttributeError, RuntimeError):
            continue
        names.extend(f"{qualified}.{overload}" for overload in packet.overloads())
    return resolve_ops(names)


def _partitioner_compute_intensive_ops() -> frozenset:
    """PyTorch's own list of compute-intensive ops (a private API: empty if it moved)."""
    try:
        from torch._functorch.partitioners import get_default_op_list

        packets = get_default_op_list().compute_intensive_ops
    except (ImportError, AttributeError):
        return frozenset()
    return frozenset(p.default for p in packets if hasattr(p, "default"))


def _import_fsdp_ops() -> None:
    """FSDP2 registers its ``fsdp::`` ops when imported; import it so they can be ignored."""
    if torch.distributed.is_available():
        importlib.import_module("torch.distributed.fsdp")


@dataclasses.dataclass(frozen=True)
class OpSets:
    """Dispatcher overloads, resolved once per :func:`hyperac.apply`."""

    matmul: frozenset
    keep: frozenset
    recompute: frozenset
    ignored: frozenset


def resolve_op_sets(backend: Backend) -> OpSets:
    """Resolve every op set from the ops registered now and the backend's own kernels."""
    _import_fsdp_ops()
    matmul = _all_overloads(_MATMUL_OPS)
    recompute = _all_overloads(_ALWAYS_RECOMPUTE_OPS)
    keep = (
        _partitioner_compute_intensive_ops()
        | _all_overloads(_ALWAYS_KEEP_OPS)
        | backend.attention_ops()
        | backend.communication_ops()
        | resolve_ops(["higher_order::flex_attention"])
    ) - matmul - recompute
    ignored = _all_overloads(_PROFILER_OPS + _FSDP_LIFECYCLE_OPS)
    return OpSets(matmul=matmul, keep=keep, recompute=recompute, ignored=ignored)


class SelectivePolicy:
    """The eager policy of one region invocation: its matmul counter starts at zero.

    torch calls the policy only in forward; the recompute replays the decisions stored then, so
    forward and replay always agree.
    """

    def __init__(self, ops: OpSets) -> None:
        self.ops = ops
        self.num_matmuls = 0

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if op in self.ops.recompute:
            return CheckpointPolicy.MUST_RECOMPUTE
        if op in self.ops.matmul:
            self.num_matmuls += 1
            return CheckpointPolicy.MUST_SAVE if self.num_matmuls % 2 == 1 else CheckpointPolicy.PREFER_RECOMPUTE
        if op in self.ops.keep:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


def stateless_policy(ops: OpSets, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``compile=True`` policy: no counters, so it keeps every matmul."""
    if op in ops.recompute:
        return CheckpointPolicy.MUST_RECOMPUTE
    if op in ops.matmul or op in ops.keep:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


# Set while a module that a recompute region excludes runs its forward: its ops are neither
# recorded nor replayed (see recompute.py, NOTE [Excluded modules]).
bypass_replay: contextvars.ContextVar[bool] = contextvars.ContextVar("hyperac_bypass_replay", default=False)


class _RecordingMode(torch_recompute._CachingTorchDispatchMode):
    def __init__(self, policy: Callable, storage: Any, ignored: frozenset) -> None:
        super().__init__(policy, storage)
        self.ignored = ignored

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ignored or bypass_replay.get():
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


class _ReplayMode(torch_recompute._CachedTorchDispatchMode):
    def __init__(self, storage: Any, allow_cache_entry_mutation: bool, ignored: frozenset) -> None:
        super().__init__(None, storage, allow_cache_entry_mutation)
        self.ignored = ignored

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ignored or bypass_replay.get():
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def selective_contexts(ops: OpSets, allow_cache_entry_mutation: bool) -> tuple[Any, Any]:
    """A fresh (forward, recompute) context pair for one region invocation (eager mode)."""
    storage: Any = defaultdict(dict)
    return (
        _RecordingMode(SelectivePolicy(ops), storage, ops.ignored),
        _ReplayMode(storage, allow_cache_entry_mutation, ops.ignored),
    )


def compile_context_fn(ops: OpSets) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` for layers that run under ``torch.compile`` (PyTorch's own SAC modes)."""
    return functools.partial(
        torch_recompute.create_selective_checkpoint_contexts, functools.partial(stateless_policy, ops)
    )
