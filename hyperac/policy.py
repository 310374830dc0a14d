"""Selective recompute policies: which op outputs a layer keeps for backward.

A policy answers, for each op a layer runs in forward, "keep its output or recompute it in
backward". hyperac keeps what is expensive to recompute or must not run twice, and recomputes
the rest:

* matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``, grouped and scaled variants, treated alike)
  alternate: the 1st, 3rd, 5th ... of each region are kept, the others recomputed
  (``selective-even`` keeps the 2nd, 4th ... instead; ``pointwise`` keeps them all and recomputes
  only cheap ops);
* other compute-intensive ops (convolutions, bilinear upsampling), attention ops, collectives
  and ``max`` (FP8 scaling reads it) are kept; the attention and collective overloads come from the backend, resolved
  when the policy is built, so kernels registered after import (a vendor extension, custom kernels)
  count;
* ``topk`` is always recomputed: models (MoE routers) change its outputs in place;
* profiler markers and FSDP parameter-lifecycle ops run as usual but stay out of the replay
  accounting, so an FSDP unshard that happens outside the region in forward and inside it in
  recompute does not shift the op stream. The ignore list belongs to each policy; PyTorch's
  process-wide ``SAC_IGNORED_OPS`` is left as it is.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import importlib
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import checkpoint as torch_recompute
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import CheckpointPolicy

from .backends import Backend, resolve_ops

__all__ = ["OpSets", "SelectivePolicy", "resolve_op_sets"]

_MATMUL_OPS = (
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul",
    "aten::_grouped_mm", "aten::_scaled_mm", "aten::_scaled_grouped_mm",
)
_ALWAYS_KEEP_OPS = ("aten::max.default", "aten::convolution", "aten::upsample_bilinear2d")
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
        _all_overloads(_ALWAYS_KEEP_OPS)
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

    def __init__(
        self, ops: OpSets, on_save: Callable[[torch.Tensor], None] | None = None, mode: str = "selective"
    ) -> None:
        self.ops = ops
        self.num_matmuls = 0
        self.on_save = on_save
        self.keep_every_matmul = mode == "pointwise"
        self.kept_parity = 0 if mode == "selective-even" else 1

    def decide(self, op: Any) -> CheckpointPolicy:
        if op in self.ops.recompute:
            return CheckpointPolicy.MUST_RECOMPUTE
        if op in self.ops.matmul:
            self.num_matmuls += 1
            keep = self.keep_every_matmul or self.num_matmuls % 2 == self.kept_parity
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        if op in self.ops.keep:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        decision = self.decide(op)
        if self.on_save is not None and decision is CheckpointPolicy.MUST_SAVE:
            for value in tree_leaves(ctx.op_output):
                if isinstance(value, torch.Tensor):
                    self.on_save(value)
        return decision


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


_storage_key = getattr(torch_recompute, "_sac_storage_key", lambda func, args: func)


def _written_tensors(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors ``func`` writes to (in-place and ``out=`` arguments)."""
    schema = func._schema
    if not schema.is_mutable:
        return []
    written = []
    for position, argument in enumerate(schema.arguments):
        if argument.alias_info is not None and argument.alias_info.is_write:
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            written.extend(t for t in tree_leaves(value) if isinstance(t, torch.Tensor))
    return written


class _RecordingMode(torch_recompute._CachingTorchDispatchMode):
    """PyTorch's recording mode, with a per-policy ignore list and protection of kept outputs.

    NOTE [Writes into kept outputs]
    PyTorch detects an in-place change to a kept op output by its version counter. A write through
    a tensor that shares the storage but not the version counter (``matmul`` on 3-d inputs returns
    ``_unsafe_view(mm(...))``; ``y += x`` then changes the kept ``mm`` output) goes unnoticed, and
    the replay would apply the write twice: wrong gradients, no error. So before an op writes to
    the storage of a kept output, the output is copied. Version counters move after the op returns
    through the dispatcher, so the copies are settled at the next op (or when the region ends): if
    the write left the kept tensor's version unchanged, the copy replaces it in the cache. Writes
    PyTorch does see keep its behaviour (an error, or ``allow_cache_entry_mutation``).
    """

    def __init__(self, policy: Callable, storage: Any, ignored: frozenset) -> None:
        super().__init__(policy, storage)
        self.ignored = ignored
        self.kept_storages: dict[int, list[Any]] = {}
        self.backups: list[tuple[Any, int, torch.Tensor]] = []

    def _settle_backups(self) -> None:
        for wrapper, version, backup in self.backups:
            if wrapper.val._version == version:
                wrapper.val, wrapper.version = backup, backup._version
        self.backups = []

    def __exit__(self, *exc: Any) -> Any:
        self._settle_backups()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._settle_backups()
        if func in self.ignored or bypass_replay.get():
            return func(*args, **kwargs)
        if self.kept_storages:
            for tensor in _written_tensors(func, args, kwargs):
                for wrapper in self.kept_storages.get(tensor.untyped_storage()._cdata, ()):
                    self.backups.append((wrapper, wrapper.val._version, wrapper.val.clone()))
        key = _storage_key(func, args)
        index = self.func_counter[key]
        out = super().__torch_dispatch__(func, types, args, kwargs)
        entry = self.storage[key].get(index)
        if entry is not None and entry is not torch_recompute._RECOMPUTE:
            for wrapper in tree_leaves(entry):
                if isinstance(getattr(wrapper, "val", None), torch.Tensor):
                    self.kept_storages.setdefault(wrapper.val.untyped_storage()._cdata, []).append(wrapper)
        return out


class _ReplayMode(torch_recompute._CachedTorchDispatchMode):
    def __init__(
        self, storage: Any, allow_cache_entry_mutation: bool, ignored: frozenset, before_replay: Callable | None
    ) -> None:
        super().__init__(None, storage, allow_cache_entry_mutation)
        self.ignored = ignored
        self.before_replay = before_replay

    def __enter__(self):
        if self.before_replay is not None:
            self.before_replay()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.ignored or bypass_replay.get():
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)


def selective_contexts(
    ops: OpSets, allow_cache_entry_mutation: bool, swap_group: Any = None, mode: str = "selective"
) -> tuple[Any, Any]:
    """A fresh (forward, recompute) context pair for one region invocation (eager mode).

    ``mode``: ``selective`` keeps the odd-numbered matmuls of the region, ``selective-even`` the
    even-numbered ones, ``pointwise`` all of them (only cheap ops are recomputed).

    With ``swap_group``, the kept op outputs go to host memory after the layer's forward and
    come back before the replay (NOTE [Swapping selective outputs] in swap.py).
    """
    storage: Any = defaultdict(dict)
    on_save = None if swap_group is None else swap_group.register_cached
    before_replay = None if swap_group is None else swap_group.ensure_loaded
    return (
        _RecordingMode(SelectivePolicy(ops, on_save, mode), storage, ops.ignored),
        _ReplayMode(storage, allow_cache_entry_mutation, ops.ignored, before_replay),
    )


def compile_context_fn(ops: OpSets) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` for layers that run under ``torch.compile`` (PyTorch's own SAC modes)."""
    return functools.partial(
        torch_recompute.create_selective_checkpoint_contexts, functools.partial(stateless_policy, ops)
    )
