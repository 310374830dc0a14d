"""Selective recompute policies: which op outputs a layer keeps for backward.

A policy answers, for each op a layer runs in forward, "keep its output or recompute it in
backward". hyperac keeps what is expensive to recompute or must not run twice, and recomputes
the rest:

* matmuls (``mm``, ``addmm``, ``bmm``, ``baddbmm``, grouped and scaled variants, treated alike)
  alternate: the 1st, 3rd, 5th ... of each region are kept, the others recomputed
  (``selective-even`` keeps the 2nd, 4th ... instead; ``pointwise`` keeps them all and recomputes
  only cheap ops);
* other compute-intensive ops (convolutions, bilinear upsampling), collectives and ``max`` (FP8
  scaling reads it) are kept; attention ops are kept where recomputing them costs at least as many
  FLOPs per kept byte as the layer's matmuls (NOTE [Attention kept by its cost per byte]), in the
  place of the next matmuls the alternation would keep (NOTE [Attention kept in a matmul's place]);
  the attention and collective overloads come from the backend, resolved when the policy is built,
  so kernels registered after import (a vendor extension, custom kernels) count, and any op whose
  schema takes a process group or a group's name is a collective, found when first seen (NOTE
  [Collectives by their schema] in op_identity.py);
* what decides a data-dependent route (an MoE router's ``topk``, ``sort``, ``argmax``, ``nonzero``,
  ``bincount``, ``histc``, ``.item()``) is kept in every mode and never run again, so the replay routes
  as its forward did (NOTE [Routing is kept] in replay/routing.py), also in a compiled layer's graph; a
  router that writes into its ``topk`` output in place is given the value ``topk`` returned (NOTE
  [Writes into kept outputs]);
* higher-order ops (flex attention, a compiled region called from an eager layer, control flow, a
  user's own) reach the recording and replay modes as one op each, with a rule per op: flex attention
  is attention, compiled regions are kept, control flow is replayed, an unknown one is kept (NOTE
  [Higher-order operators] in higher_order.py);
* profiler markers run as usual but stay out of the replay accounting (the ignore list belongs to
  each policy; PyTorch's process-wide ``SAC_IGNORED_OPS`` is left as it is), and so do the ops a
  sharding stack's module hooks run to gather, release or prefetch parameters (ZeRO-3, FSDP2 on
  sub-modules), told apart by what runs them, not by name, so a gather that the forward runs and the
  replay does not (or the other way round) does not shift the op stream (NOTE [Parameter lifecycles
  are not the layer's program] in lifecycle.py).

In eager mode hyperac records and replays with its own dispatch modes (``_RecordingMode``,
``_ReplayMode``) on PyTorch's ``checkpoint(context_fn=...)``, rather than PyTorch's selective
checkpoint modes: a replay checks each op against the forward, survives a second backward, and
replays writes into kept outputs once (NOTE [Writes into kept outputs], NOTE [Replays that cannot
use the tape]); and it costs less per op. ``compile=True`` runs the same policy in PyTorch's modes,
which the compiler understands (NOTE [Selective recompute under torch.compile]). Private torch
internals used: ``_detach_helper``, ``SAC_IGNORED_OPS``, ``_sac_storage_key`` (for compiled regions
inside an eager region), ``torch._C._get_dispatch_mode`` (whether AOTAutograd traces a compiled region, as
``torch.utils.checkpoint`` itself asks).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import torch
from torch.utils import checkpoint as torch_recompute
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten
from torch.utils.checkpoint import CheckpointPolicy

from . import higher_order
from ._compat import FRAME_HOOK_AVAILABLE, pause_frame_compilation, resume_frame_compilation
from .backends import Backend, resolve_ops
from .errors import ConfigError, RecomputeMismatchError
from .lifecycle import HookOps, stacks_note
from .op_identity import communicates, fills_buffers, key_length
from .replay.random_sources import GeneratorStates, draws_since, restore_generators, watch_generators
from .replay.replay_check import cast_of_a_leaf, divergence

__all__ = ["OpInfo", "OpSets", "SelectivePolicy", "resolve_op_sets", "routing_ops", "weighing_attention_at"]

_MATMUL_OPS = (
    "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::linear", "aten::matmul",
    "aten::_grouped_mm", "aten::_scaled_mm", "aten::_scaled_grouped_mm",
)
_ALWAYS_KEEP_OPS = ("aten::max.default", "aten::convolution", "aten::upsample_bilinear2d")
_ROUTING_OPS = (
    "aten::topk", "aten::sort", "aten::argsort", "aten::argmax", "aten::argmin", "aten::max.dim", "aten::min.dim",
    "aten::kthvalue", "aten::nonzero", "aten::nonzero_static", "aten::bincount", "aten::histc", "aten::_unique2",
    "aten::unique_dim", "aten::unique_consecutive", "aten::_local_scalar_dense",
)
"""Ops whose output decides a data-dependent route: which experts a token goes to, in what order, how many
tokens each expert gets (the split sizes of an expert-parallel all-to-all), a value read to the host
(``.item()``; ``.tolist()`` reads memory without an op, so a count is kept where it is made). Kept in
every mode (NOTE [Routing is kept] in replay/routing.py)."""
_KEY_SEQUENCE_DIMS = {
    "aten::_scaled_dot_product_flash_attention": -2,
    "aten::_scaled_dot_product_flash_attention_for_cpu": -2,
    "aten::_scaled_dot_product_efficient_attention": -2,
    "aten::_scaled_dot_product_cudnn_attention": -2,
    "aten::_scaled_dot_product_fused_attention_overrideable": -2,
    "aten::_flash_attention_forward": -3,
    "aten::_efficient_attention_forward": -3,
    "aten::scaled_dot_product_attention": -2,
    "torch_attn::_varlen_attn": -3,
    "ffpa_attn::_fwd_cute": -3,
    "ffpa_attn::_varlen_fwd_cute": -3,
}
"""The dimension of ``key`` (the second argument) that is its sequence, for the attention kernels whose
layout is known (``(batch, heads, seq, dim)``, or ``(batch, seq, heads, dim)`` and packed ``(tokens,
heads, dim)``; packed kernels are weighed by their longest document, :func:`~hyperac.op_identity.key_length`).
The composite ``scaled_dot_product_attention`` reaches a dispatch mode where a backend registers its own
kernel for it instead of decomposing it (the Ascend NPU extension does, for its NPU and AutogradNPU
keys). FlexAttention's is ``-2`` too; other attention ops (a vendor's fused kernel with a layout
argument) are always kept."""
_ADDEND_FIRST_MATMULS = ("aten::addmm", "aten::baddbmm")
"""Matmuls whose first argument is the addend, not the left matrix."""
_UNANNOTATED_ALIAS_OPS = ("aten::_unsafe_view",)
"""aten ops whose output may share an input's storage although their schema does not say so."""
_PROFILER_OPS = (
    "profiler::_record_function_enter",
    "profiler::_record_function_enter_new",
    "profiler::_record_function_exit",
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
        if isinstance(packet, torch._ops.HigherOrderOperator):  # no overloads: the op itself
            names.append(qualified)
        else:
            names.extend(f"{qualified}.{overload}" for overload in packet.overloads())
    return resolve_ops(names)


# What an op is to a policy. The recording and replay modes look each op up once per call, in a
# per-OpSets table keyed by ``id(op)`` (hashing an OpOverload runs Python code; an int does not).
# ``_ROUTE``: kept unless inside a module of ``Config.force_recompute``, never pruned, handed to every
# replay (NOTE [Routing is kept] in replay/routing.py). ``_ONCE``: higher-order ops kept in every recording mode
# and never replayed, as collectives are, unless they wrote into their inputs (NOTE [Higher-order
# operators] in higher_order.py).
_OTHER, _IGNORED, _MATMUL, _KEEP, _ATTENTION, _ROUTE, _COLLECTIVE, _ONCE = range(8)


class OpInfo(NamedTuple):
    """What the recording and replay modes ask of an op on every call, answered once per op by
    :meth:`OpSets.classify` (all of it depends on the op alone: its sets, its schema, its type).

    NOTE [Per op, not per call]
    A dispatch mode runs its ``__torch_dispatch__`` for every op of every region invocation, forward and
    replay, and at a host-bound step that Python is the step (issue 33: torchtitan's selective modes do
    less per op). Everything a mode decides from the op alone (its kind, the arguments it writes,
    whether it is a view, whether it is a collective that fills the buffers it is given) is read once,
    when the op is first seen, and unpacked from one tuple per call; only what depends on the
    arguments (which tensors autograd tracks, the stack for a sharding stack's hooks) is asked per
    call."""

    kind: int
    writes: tuple[tuple[int, str], ...]
    """``(position, name)`` of each argument the schema says the op writes into."""
    keyed: bool
    """A higher-order op: keyed on the tape by ``_sac_storage_key``, not by the op."""
    unannotated: bool
    """Its output may share an input's storage with a version counter of its own (NOTE [Aliases with
    their own version counter])."""
    view: bool
    """An aten view (``OpOverload.is_view``): it returns an alias of its first argument and computes
    nothing (NOTE [Parameter lifecycles are not the layer's program] in lifecycle.py)."""
    fills: bool
    """A collective that writes into the tensors it is given (:func:`~hyperac.op_identity.fills_buffers`)."""
    run: Callable[..., Any]
    """What runs the op: an overload's ``_op``, the builtin its ``__call__`` forwards to (one Python frame less
    per op, a fifth of a microsecond), where :func:`calls_op_directly`; else the op itself."""


def _forwarding(self: Any, /, *args: Any, **kwargs: Any) -> Any:
    return self._op(*args, **kwargs)


def calls_op_directly() -> bool:
    """Whether ``OpOverload.__call__`` only forwards to the overload's ``_op`` (its bytecode is
    :func:`_forwarding`'s; torch-private: NOTE [Every private torch piece] in _compat.py), which the modes then
    call instead; where a torch release (or a patch) does more there, they call the overload, slower and the
    same. Asked once per :class:`OpSets`."""
    call = getattr(torch._ops.OpOverload.__call__, "__code__", None)
    return (call is not None and call.co_code == _forwarding.__code__.co_code and call.co_names == ("_op",)
            and callable(getattr(torch.ops.aten.mm.default, "_op", None)))


@dataclasses.dataclass(frozen=True)
class OpSets:
    """Dispatcher overloads, resolved once per :func:`hyperac.apply`. Immutable: the sets are
    frozensets, and :attr:`table` is a read-only view of a private cache of :meth:`classify`'s
    answers (which the sets alone decide)."""

    matmul: frozenset
    keep: frozenset
    routing: frozenset
    """The ops that decide a data-dependent route, kept in every mode (NOTE [Routing is kept] in replay/routing.py)."""
    ignored: frozenset
    communication: frozenset = frozenset()
    """The collectives the backend names (those whose schema takes no group); with every op whose
    schema takes one (NOTE [Collectives by their schema] in op_identity.py), their outputs are kept in
    every recording mode, with or without ``save_ops``, and never replayed."""
    save_ops: tuple[str, ...] | None = None
    """The ``Config.save_ops`` names the sets were resolved with (``None``: hyperac's own list)."""
    attention: frozenset = frozenset()
    """The attention ops among ``keep`` that the selective modes keep only where recomputing them costs
    as much per byte as a matmul (NOTE [Attention kept by its cost per byte]); empty with ``save_ops``."""

    def __post_init__(self) -> None:
        # ``id(op) -> (OpInfo, op)``, filled as ops are first seen; ids are stable because the cache
        # also holds the op (ops are never freed while it exists). The modes read the dict itself
        # (``lookup``: its ``get``, half the cost of the read-only view's).
        object.__setattr__(self, "_cache", {})
        object.__setattr__(self, "table", types.MappingProxyType(self._cache))
        object.__setattr__(self, "lookup", self._cache.get)
        object.__setattr__(self, "direct", calls_op_directly())
        # ``id`` of each routing op, for the ``full`` mode's routing modes (replay/routing.py); stable, as the
        # set holds the ops.
        object.__setattr__(self, "routing_ids", frozenset(id(op) for op in self.routing))

    def __reduce__(self) -> tuple:
        # The cache is keyed by ids of this process: a copy or an unpickled OpSets starts empty.
        return OpSets, (self.matmul, self.keep, self.routing, self.ignored, self.communication, self.save_ops,
                        self.attention)

    def classify(self, op: Any) -> OpInfo:
        """What ``op`` is to the recording and replay modes (NOTE [Per op, not per call]); cached."""
        entry = self._cache.get(id(op))
        if entry is not None:
            return entry[0]
        keyed = isinstance(op, torch._ops.HigherOrderOperator)
        if op in self.ignored or op in torch_recompute.SAC_IGNORED_OPS:
            kind = _IGNORED
        elif op in self.routing:
            kind = _ROUTE
        elif op in self.communication or communicates(op):
            kind = _COLLECTIVE
        elif keyed and higher_order.rule(op) == higher_order.ONCE:
            kind = _ONCE
        elif op in self.matmul:
            kind = _MATMUL
        elif op in self.attention:
            kind = _ATTENTION
        elif op in self.keep:
            kind = _KEEP
        else:
            kind = _OTHER
        schema = getattr(op, "_schema", None)
        writes = () if schema is None or not schema.is_mutable else tuple(
            (position, argument.name)
            for position, argument in enumerate(schema.arguments)
            if argument.alias_info is not None and argument.alias_info.is_write
        )
        if keyed:
            writes = higher_order.written_arguments(op)
        unannotated = (keyed or schema is None or schema.name in _UNANNOTATED_ALIAS_OPS
                       or not schema.name.startswith("aten::"))
        info = OpInfo(kind, writes, keyed, unannotated, view=bool(getattr(op, "is_view", False)),  # a HOP has none
                      fills=kind == _COLLECTIVE and fills_buffers(op),
                      run=op._op if self.direct and type(op) is torch._ops.OpOverload else op)  # not a subclass
        self._cache[id(op)] = (info, op)
        return info


def routing_ops() -> frozenset:
    """The overloads of the ops that decide a data-dependent route (NOTE [Routing is kept] in replay/routing.py)."""
    return _all_overloads(_ROUTING_OPS)


def resolve_op_sets(backend: Backend, save_ops: tuple[str, ...] | None = None) -> OpSets:
    """Resolve every op set from the ops registered now and the backend's own kernels; with
    ``save_ops`` (``Config.save_ops``), the kept ops and matmuls are those it names."""
    matmul = _all_overloads(_MATMUL_OPS)
    routing = routing_ops()
    if save_ops is None:
        keep = (
            _all_overloads(_ALWAYS_KEEP_OPS)
            | backend.attention_ops()
            | backend.communication_ops()
            | higher_order.ops_with_rule(higher_order.ATTENTION, higher_order.KEEP)
        )
    else:
        keep = _named_ops(save_ops)
        matmul = matmul & keep
    ignored = _all_overloads(_PROFILER_OPS)
    communication = backend.communication_ops() - ignored - routing
    keep = (keep | communication) - matmul - routing
    attention = frozenset() if save_ops is not None else frozenset(
        op for op in keep if _key_sequence_dim(op) is not None
    )
    return OpSets(matmul=matmul, keep=keep, routing=routing, ignored=ignored,
                  communication=communication, save_ops=save_ops, attention=attention)


def _key_sequence_dim(op: Any) -> int | None:
    """The sequence dimension of ``op``'s key argument, if ``op`` is an attention kernel of known layout."""
    if isinstance(op, torch._ops.HigherOrderOperator):
        return -2 if higher_order.rule(op) == higher_order.ATTENTION else None
    schema = getattr(op, "_schema", None)
    return None if schema is None else _KEY_SEQUENCE_DIMS.get(schema.name)


def _matmul_flops_per_byte(op: Any, args: tuple) -> Any:
    """FLOPs one output byte of a matmul costs to recompute: ``2 * K`` per element."""
    left = args[1] if op._schema.name in _ADDEND_FIRST_MATMULS else args[0]
    return 2 * left.shape[-1] / left.element_size()


def _matmul_output_bytes(op: Any, args: tuple) -> int:
    """The bytes of a matmul's output, from its operands: ``left``'s rows times ``right``'s columns
    (``linear``'s weight is ``(out, in)``)."""
    left, right = args[1:3] if op._schema.name in _ADDEND_FIRST_MATMULS else args[:2]
    columns = right.shape[0] if op._schema.name == "aten::linear" else right.shape[-1]
    return left.numel() // max(left.shape[-1], 1) * columns * left.element_size()


def _attention_output_bytes(args: tuple) -> int:
    """The bytes an attention kernel keeps: its output (one value vector per query) and, as the fused
    kernels keep for backward, one float32 statistic per query (the log-sum-exp)."""
    query, _, value = args[:3]
    rows = query.numel() // max(query.shape[-1], 1)
    return rows * (value.shape[-1] * query.element_size() + 4)


_planned_length: contextvars.ContextVar[int] = contextvars.ContextVar("hyperac_planned_length", default=0)


@contextlib.contextmanager
def weighing_attention_at(length: int) -> Iterator[None]:
    """Weigh attention (NOTE [Attention kept by its cost per byte]) as if its keys were at least
    ``length`` long while entered: a plan made for ``max_seq_len`` profiles shorter samples, whose
    kept bytes must grow with the length as they will up to ``max_seq_len``, not jump where attention
    becomes worth keeping."""
    token = _planned_length.set(length)
    try:
        yield
    finally:
        _planned_length.reset(token)


def _attention_flops_per_byte(op: Any, args: tuple) -> Any:
    """FLOPs one kept byte of attention costs to recompute: per query, the scores (``2 * key length *
    query channels``) and their product with the values (``2 * key length * value channels``), over
    the bytes kept per query (:func:`_attention_output_bytes`). Causal masks are not discounted, as in
    PyTorch's flop counter."""
    query, _, value = args[:3]
    keys = max(key_length(op, args, _key_sequence_dim(op)), _planned_length.get())
    rows = query.numel() // max(query.shape[-1], 1)
    return 2 * keys * (query.shape[-1] + value.shape[-1]) * rows / _attention_output_bytes(args)


def _named_ops(names: tuple[str, ...]) -> frozenset:
    """The overloads ``Config.save_ops`` names; :class:`ConfigError` for a name no op answers to."""
    found = set()
    for name in names:
        ops = _all_overloads((name,))
        if not ops:
            raise ConfigError(
                f"Config.save_ops names {name!r}, which is no registered op (import the library that registers it "
                "first); names read 'namespace::op' or 'namespace::op.overload', e.g. 'aten::mm'."
            )
        found |= ops
    return frozenset(found)


class SelectivePolicy:
    """The eager policy of one region invocation: its matmul counter starts at zero.

    The policy decides only in forward; the replay follows the decisions recorded then, so forward
    and replay always agree.

    NOTE [Attention kept by its cost per byte]
    Keeping an op's output trades its bytes, held until backward, for the FLOPs of running it again.
    A matmul's output element costs ``2 * K`` FLOPs (``K`` its inner dimension); an attention output
    element costs about ``4 * key length`` (the scores, then their product with the values). So
    attention is the better buy per byte at long sequences (Llama 8B at 8k tokens: 16k FLOPs per
    element against 8k for its matmuls) and the worse one at short ones: torchtitan's llama3 debug
    model at 64 tokens, 256 wide, spends 60 FLOPs per kept byte of attention against 128 for its
    projections. The selective modes therefore keep an attention output only where it costs at least
    as many FLOPs per byte as the cheapest matmul the region ran before it (the projections that made
    its queries, keys and values), and recompute it otherwise, as Megatron-LM's selective recompute
    does with attention that is cheap for its bytes. The rule reads only shapes, the same in eager
    and compiled regions and in forward and replay (the replay follows the tape). Attention with no
    matmul before it in the region is kept, and so is every attention output in ``pointwise``, which
    recomputes only cheap ops. ``Config.save_ops`` names what to keep, attention included, and no
    rule applies. A plan made for ``max_seq_len`` profiles shorter samples and fits its costs as
    smooth functions of the length (NOTE [Costs as functions of the length] in planner/lengths.py),
    so while it profiles attention is weighed at ``max_seq_len`` (:func:`weighing_attention_at`):
    the fit then holds at ``max_seq_len``, and a shorter training batch that recomputes its attention
    keeps less than planned, never more.

    NOTE [Attention kept in a matmul's place]
    Kept attention is not kept on top of the alternation: it takes the place of the matmuls the
    alternation would keep next, which are recomputed until their output bytes cover the attention's
    (its output and log-sum-exp). So a selective region keeps no more than the alternation alone
    (torchtitan's SelectiveAC on its own llama3, where attention on the CPU is not in its list and
    hyperac kept it on top: 1.09x). The attention is kept only where a byte of it costs at least as
    many FLOPs to recompute as a byte of the cheapest matmul before it; in a transformer block the
    matmul whose place it takes is the MLP's first projection (``w1``, ``gate_proj``), as cheap per
    byte as the QKV projections and wider than the attention output, so the layer keeps less, and at
    the lengths where attention is kept it mostly replays less too (the geometries of torchtitan's
    llama3 in tests/test_torchtitan.py: 0.88-0.89x the bytes, 0.91-1.01x the FLOPs). The rule is
    decided in forward order from shapes only, so eager and compiled regions agree; a region that
    ends after its attention with no kept matmul to take its place (an attention-only region) keeps
    that attention on top. ``pointwise`` keeps every matmul anyway.
    """

    def __init__(self, ops: OpSets, mode: str = "selective", offload: bool = False) -> None:
        self.ops = ops
        self.num_matmuls = 0
        self.keep_every_matmul = mode == "pointwise"
        self.kept_parity = 0 if mode == "selective-even" else 1
        self.cheapest_matmul: Any = None
        """Fewest FLOPs per output byte of the region's matmuls so far (NOTE [Attention kept by its cost per byte])."""
        self.attention_bytes = 0
        """Bytes of kept attention that no recomputed matmul has yet made room for (NOTE [Attention kept in
        a matmul's place])."""
        # Under compile, kept outputs of a swapping layer go to host memory (NOTE [Swap under torch.compile]).
        self.kept = CheckpointPolicy.MUST_CPU_OFFLOAD if offload else CheckpointPolicy.MUST_SAVE

    def keeps(self, kind: int, op: Any, args: tuple) -> bool:
        """Whether ``op(*args)``, of ``kind`` (see :meth:`OpSets.classify`), keeps its output."""
        if kind == _MATMUL:
            self.num_matmuls += 1
            cost = _matmul_flops_per_byte(op, args)
            self.cheapest_matmul = cost if self.cheapest_matmul is None else min(self.cheapest_matmul, cost)
            if self.keep_every_matmul or self.num_matmuls % 2 != self.kept_parity:
                return self.keep_every_matmul
            if self.attention_bytes > 0:  # its place goes to attention kept before it
                self.attention_bytes = max(0, self.attention_bytes - _matmul_output_bytes(op, args))
                return False
            return True
        if kind == _ATTENTION:
            if self.keep_every_matmul:
                return True
            if self.cheapest_matmul is not None and _attention_flops_per_byte(op, args) < self.cheapest_matmul:
                return False
            self.attention_bytes += _attention_output_bytes(args)
            return True
        return kind >= _KEEP

    def __call__(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        """The decision for ``op`` in PyTorch's policy-function form. Routes are saved where the compiler traces
        the region (a router's in-place write into ``topk``'s output is functionalized in the graph) and
        recomputed in a region it ran eagerly at a graph break, whose PyTorch selective checkpoint refuses that
        write into a cached output (NOTE [Routing is kept] in replay/routing.py)."""
        kind = self.ops.classify(op)[0]
        if kind == _ROUTE:
            return _route_policy()
        if self.keeps(kind, op, args):
            return self.kept
        return CheckpointPolicy.PREFER_RECOMPUTE


# Set while a module that a recompute region excludes runs its forward: its ops are neither
# recorded nor replayed (see recompute.py, NOTE [Excluded modules]).
bypass_replay: contextvars.ContextVar[bool] = contextvars.ContextVar("hyperac_bypass_replay", default=False)

# Set while a module named in ``Config.force_recompute`` runs its forward: its ops keep nothing, and
# its matmuls do not count in the alternation (see recompute.py, ForcedRecomputeForward).
forced_recompute: contextvars.ContextVar[bool] = contextvars.ContextVar("hyperac_forced_recompute", default=False)


_storage_key = getattr(torch_recompute, "_sac_storage_key", lambda func, args: func)
_TO_COPY = torch.ops.aten._to_copy.default
_CONSUMED = object()


class _Kept:
    """The output of one op that the policy keeps: detached tensors and the versions they had, and
    the aliases of their storages whose version counters are their own
    (NOTE [Aliases with their own version counter])."""

    __slots__ = ("aliases", "filled", "lasting", "leaves", "rng", "shapes", "spec", "versions", "written")

    def __init__(self, leaves: list[Any], spec: Any, rng: GeneratorStates | None,
                 written: dict[int, int] | None = None, shapes: tuple = (), lasting: bool = False,
                 filled: list[tuple[int, torch.Tensor]] | None = None) -> None:
        self.leaves = leaves
        self.shapes = shapes
        """The shapes of the op's tensor arguments in forward, which the replay's must equal
        (NOTE [Kept outputs that no longer fit])."""
        self.lasting = lasting
        """A route: handed to every replay, as a copy, rather than once (NOTE [Routing is kept] in
        replay/routing.py)."""
        self.written = written or {}
        """Output leaf position -> position among the op's argument leaves of the tensor it is (a
        collective that writes into its arguments; NOTE [Collectives that write into their arguments])."""
        self.filled = filled or []
        """``(argument leaf position, copy)`` per tensor a collective wrote into and did not return
        (``all_to_all_single``'s output; NOTE [Collectives that write into their arguments])."""
        self.spec = spec
        self.versions = [leaf._version if isinstance(leaf, torch.Tensor) else None for leaf in leaves]
        self.rng = rng
        """The generators the op moved, as it left them (NOTE [Kept ops that draw random numbers])."""
        self.aliases: list[tuple[int, torch.Tensor, int]] = []
        """``(leaf position, detached alias, its version)`` per alias met in the forward."""

    def intact(self) -> bool:
        """No write changed a kept tensor, through itself or any alias met in the forward, since it
        was kept (or last replaced by a copy)."""
        for leaf, version in zip(self.leaves, self.versions):  # loops, not all(): once per kept op in each replay
            if version is not None and leaf._version != version:
                return False
        for _, alias, version in self.aliases:
            if alias._version != version:
                return False
        return True

    def replace(self, position: int, copy: torch.Tensor) -> None:
        """Hold ``copy``, hyperac's own, instead of the leaf at ``position``: no alias reaches it."""
        self.leaves[position], self.versions[position] = copy, copy._version
        self.aliases = [entry for entry in self.aliases if entry[0] != position]

    def value(self, arguments: Any = None) -> Any:
        """The kept output; an op that wrote into its ``arguments`` (the replay's) writes the kept
        values into them and returns them, as it did in forward."""
        leaves = self.leaves
        for index, copy in self.filled:
            target = tree_leaves(arguments)[index]
            with torch.autograd._unsafe_preserve_version_counter(target):  # as the collective's write
                target.copy_(copy)
        if self.written:
            flat, leaves = tree_leaves(arguments), list(leaves)
            for position, index in self.written.items():
                with torch.autograd._unsafe_preserve_version_counter(flat[index]):  # as the collective's write
                    flat[index].copy_(leaves[position])
                leaves[position] = flat[index]
        if self.lasting:  # a replay may write into what it is given (a router's ``topk`` output)
            leaves = [leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
        return leaves[0] if self.spec is None else tree_unflatten(leaves, self.spec)


def _shapes(args: tuple) -> tuple:
    """The shapes of the tensors among an op's positional arguments."""
    shapes = []
    for arg in args:  # a loop, not a generator: twice per kept op (NOTE [Per op, not per call])
        if isinstance(arg, torch.Tensor):
            shapes.append(arg.shape)
    return tuple(shapes)


def _fills_first_argument(op: Any) -> bool:
    """A collective that writes into its first argument and returns none of it, only its ``Work``
    (``c10d::alltoall_base_``, which ``all_to_all_single`` runs; ``recv_``)."""
    return fills_buffers(op) and not any("Tensor" in str(value.type) for value in op._schema.returns)


def _written_arguments(leaves: list[Any], arguments: Any) -> dict[int, int]:
    """Output leaf position -> argument leaf position, for each output tensor that is one of the
    arguments (a collective returning the tensor it wrote into)."""
    flat = tree_leaves(arguments)
    found = {}
    for position, leaf in enumerate(leaves):
        for index, argument in enumerate(flat):
            if (isinstance(leaf, torch.Tensor) and isinstance(argument, torch.Tensor)
                    and leaf.untyped_storage()._cdata == argument.untyped_storage()._cdata
                    and leaf.data_ptr() == argument.data_ptr() and leaf.shape == argument.shape):
                found[position] = index
                break
    return found


# NOTE [Collectives that write into their arguments]
# A collective writes into a tensor it is given and returns it: ``all_reduce`` into its input,
# ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` into their output buffer (Megatron's
# tensor- and sequence-parallel layers), without declaring the write in its schema. The selective
# modes keep a collective's output and never run it again, but the replay's Python code reads the
# tensor it passed in (``all_reduce(x); return x``), not what the op returned. So a kept collective
# holds a copy of each output that is one of its arguments (the argument may be a buffer reused by
# the next layer: Megatron's sequence-parallel all-gather writes into one global buffer), and its
# replay writes that copy into the replay's argument and returns the argument, as the forward did
# (the version counter left as it was: a collective's write does not bump it). One that returns only its
# ``Work`` (``all_to_all_single``'s ``alltoall_base_``, an expert-parallel layer's token exchange; ``recv_``)
# writes into its first argument: that is kept as a copy and written back alike. The copy costs the
# collective's output bytes, what keeping its output costs anyway. The op returns before the
# collective is done (gloo runs it on a thread of its own, NCCL and HCCL on a stream of their own,
# until ``work.wait()``), so the copy waits for it first: an asynchronous collective in a selective
# region is complete when it returns, its overlap with the compute after it given up.


class _Tape:
    """What one region invocation ran in forward, op by op: the key of each op, and per op ``None``
    (replay runs it), a :class:`_Kept` (replay returns it) or ``_CONSUMED`` (an earlier replay
    returned it; a later one runs the op again)."""

    __slots__ = ("entries", "index", "keys", "layer", "stacks", "views")

    def __init__(self, layer: str, index: int | None) -> None:
        self.keys: list[Any] = []
        self.entries: list[Any] = []
        self.layer, self.index = layer, index
        self.stacks: set[str] = set()
        """The packages whose module hooks ran parameter lifecycle ops in the region (NOTE [Parameter
        lifecycles are not the layer's program] in lifecycle.py)."""
        self.views: set[int] = set()
        """Positions of views of untracked tensors that keep nothing, which a replay may skip (NOTE [Views a
        replay may skip])."""


def _mismatch(tape: _Tape, index: int, ran: Any) -> RecomputeMismatchError:
    recorded = tape.keys[index] if index < len(tape.keys) else "nothing more"
    return divergence(tape.layer, tape.index, f"op {index} of {len(tape.keys)}", f"ran {recorded}", f"ran {ran}",
                      stacks_note(tape.stacks))


def unfit(layer: str, index: int | None, where: str, kept: tuple, args: tuple) -> RecomputeMismatchError:
    """The error for a kept output, of the op at ``where`` in the replay of ``layer``, that the replay's
    arguments ``args`` no longer fit (NOTE [Kept outputs that no longer fit])."""
    def listed(shapes: tuple) -> str:
        return ", ".join(str(list(shape)) for shape in shapes)

    return divergence(
        layer, index, where, f"ran it on tensors of shapes {listed(kept)}",
        f"on {listed(_shapes(args))}, which the output the forward kept does not fit (a size that depends on the data "
        "came out otherwise: a route was recomputed, as in a module named in force_recompute= (leave the router out "
        "of it to keep its routes), or the replay was given other data)",
    )


class _EagerMode(TorchDispatchMode):
    """Base of the recording and replay modes: no per-op guard against torch.compile.

    NOTE [Dispatch modes and torch.compile]
    torch wraps every ``TorchDispatchMode`` subclass's ``__torch_dispatch__`` in
    ``torch._dynamo.disable``, so that torch.compile never compiles a dispatch frame; the wrapper
    costs a few microseconds per op, about a sixth of what pointwise recompute adds to a small
    layer (``benchmarks/recording_overhead.py``). These modes run only in eager regions, so they
    turn frame compilation off once instead, on entering, if torch.compile's frame hook is set at
    all (a compiled function that fell back to eager at a graph break is running the region), and
    back on when they exit (:func:`~hyperac._compat.pause_frame_compilation`): no frame under them
    is compiled, as with the wrapper, for two calls per region rather than two per op.

    Higher-order ops come to these modes as one op each (``supports_higher_order_operators``), with
    a rule per op (NOTE [Higher-order operators] in higher_order.py).

    NOTE [A backward inside a forward]
    A layer may run a backward in its forward (``torch.autograd.grad(energy, x, create_graph=True)``: forces
    from an energy, a MAML inner step, an input-saliency gate). The engine runs that backward's nodes in an
    order that depends on the graph, and the replay's graph is not the forward's (kept outputs come back
    without their ops), so the two may run independent nodes in another order. The modes neither record
    nor match the ops of a backward that started inside the region (its graph task is not the one the
    mode was entered in): they run plainly, in forward and in every replay, and keep nothing.
    """

    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.hook_ops = HookOps()
        """What sharding stacks' module hooks run in the region: not its program (NOTE [Parameter lifecycles
        are not the layer's program] in lifecycle.py)."""

    def _stack_op(self, run: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """Run (``run``: the op or what runs it) an op :meth:`HookOps.owns` says is a sharding stack's parameter
        lifecycle: as it is, seen by neither mode."""
        out = run(*args, **kwargs)
        self.hook_ops.ran(out)
        return out

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not FRAME_HOOK_AVAILABLE

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __enter__(self):
        self.task = torch._C._current_graph_task_id()  # NOTE [A backward inside a forward]
        self.paused_hook = pause_frame_compilation()
        try:
            return super().__enter__()
        except BaseException:
            resume_frame_compilation(self.paused_hook)
            raise

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            return super().__exit__(exc_type, exc_value, traceback)
        finally:
            resume_frame_compilation(self.paused_hook)

class _RecordingMode(_EagerMode):
    """Runs a region's forward, keeping the outputs the policy keeps (on a :class:`_Tape`).

    NOTE [Writes into kept outputs]
    An op may write into the output of an earlier kept op: an in-place activation after a
    convolution or Linear (``SiLU(inplace=True)``), ``x += bias`` after a matmul, or a write through a
    tensor that shares the storage but not the version counter (``matmul`` on 3-d inputs returns
    ``_unsafe_view(mm(...))``; ``y += x`` then changes the kept ``mm`` output without PyTorch
    noticing). The replay runs that write again on what it is given, so it must be given the value
    the op produced, not the written one. So before an op writes to the storage of a kept output,
    the kept output is copied and the copy replaces it on the tape (once: the copy is hyperac's own).
    The op is still not recomputed, and the write runs once per forward and once per replay, as in
    the un-applied model. A write this mode does not see (after the region returned, or inside an
    excluded module) changes the kept tensor's version: the replay then runs the op again instead
    of returning it (NOTE [Replays that cannot use the tape]). So no flag to allow cache mutation is
    needed, and none exists.

    NOTE [Aliases with their own version counter]
    The version check above sees writes through the kept tensor and its views, which share its
    version counter. Some ops return a tensor on the kept output's storage with a counter of its
    own: ``matmul`` on 3-d inputs returns ``_unsafe_view(mm(...))``, CPU attention's math path a
    view of a ``bmm``. A caller that writes into the layer's output after the region returned
    (``h.mul_(2)``, a residual ``h += x``, the next layer writing its input) bumps only that
    alias's counter. So each output of such an op that lies on a kept storage is watched too: a
    detached alias of it (sharing its counter, not holding its autograd graph) and its version go
    on the :class:`_Kept`, and the kept output is trusted only if no watched counter moved. Any
    later write reaches the storage through the kept tensor, one of these, or a view of one (a view
    shares its base's counter), so the check is exact; nothing is copied. Which ops can return such
    an alias comes from the schema: an aten op declares the outputs that alias an input (views,
    which share counters), except ``_unsafe_view``; an op of another namespace (a custom kernel) or
    a higher-order op is not trusted to declare it. Only those ops pay the storage lookup. Only an
    alias made without any op (``.data``, ``set_``) escapes the check.
    """

    def __init__(self, tape: _Tape, policy: SelectivePolicy, on_save: Callable[[torch.Tensor], None] | None,
                 on_watch: Callable[[torch.Tensor], None] | None = None) -> None:
        super().__init__()
        self.tape = tape
        self.hook_ops.stacks = tape.stacks  # named in the error of a replay that diverges
        self.policy = policy
        self.lookup = policy.ops.lookup
        self.on_save = on_save
        """Called with each tensor kept (a swap group moves it to host memory)."""
        self.on_watch = on_watch
        """Called with each alias held to watch writes into a kept storage (an expected holder of it)."""
        self.kept_storages: dict[int, list[tuple[_Kept, int]]] = {}
        self.saves: _AutogradSaves | None = None
        self.never_pruned: set[int] = set()
        """Tape positions of kept collective and higher-order op outputs, which :meth:`_AutogradSaves.prune`
        leaves kept (NOTE [Higher-order operators])."""

    def __enter__(self):
        # Outside checkpoint's saved-tensor hooks (none to look through) nothing is weighed.
        hooked = torch._C._autograd._top_saved_tensors_default_hooks(True) is not None
        self.saves = _AutogradSaves() if self.on_save is None and hooked else None
        try:
            return super().__enter__()
        except BaseException:
            if self.saves is not None:
                self.saves.close()
            raise

    def __exit__(self, exc_type, exc_value, traceback):
        try:
            return super().__exit__(exc_type, exc_value, traceback)
        finally:
            if self.saves is not None:
                self.saves.close()
                if exc_type is None:
                    self.saves.prune(self.tape, self.never_pruned)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        entry = self.lookup(id(func))
        kind, writes, keyed, unannotated, view, fills, run = (self.policy.ops.classify(func) if entry is None
                                                             else entry[0])
        if kind == _IGNORED or bypass_replay.get() or torch._C._current_graph_task_id() != self.task:
            return run(*args, **kwargs)
        if self.hook_ops.owns(args, kind == _COLLECTIVE, view, fills):
            return self._stack_op(run, args, kwargs)
        if writes and self.kept_storages:
            self._copy_before_write(writes, args, kwargs)
        versions = higher_order.tensor_versions(args, kwargs) if kind == _ONCE else None
        keeps = kind >= _COLLECTIVE or (kind >= _MATMUL and not forced_recompute.get()  # collectives, once-ops
                                         and self.policy.keeps(kind, func, args))
        generators = watch_generators(args, kwargs) if keeps else None  # NOTE [Kept ops that draw random numbers]
        out = run(*args, **kwargs)
        if unannotated and self.kept_storages:
            self._watch_aliases(out)
        self.tape.keys.append(_storage_key(func, args) if keyed else func)
        if keeps and versions is not None:  # one that wrote into its inputs is replayed (NOTE [Higher-order operators])
            keeps = not higher_order.wrote(versions)
        # a collective keeps its arguments, for what it wrote (NOTE [Collectives that write into their arguments])
        arguments = (args, kwargs) if kind == _COLLECTIVE else None
        self.tape.entries.append(self._keep(out, draws_since(generators), arguments, args, kind == _ROUTE, func)
                                 if keeps else None)
        if not keeps and view and not args[0].requires_grad:  # NOTE [Views a replay may skip]
            self.tape.views.add(len(self.tape.entries) - 1)
        if kind >= _ROUTE or keyed:  # routes, collectives and higher-order ops are never pruned
            self.never_pruned.add(len(self.tape.entries) - 1)
        return out

    def _keep(self, out: Any, rng: GeneratorStates | None, arguments: Any, args: tuple, lasting: bool,
              func: Any = None) -> _Kept:
        leaves, spec = ([out], None) if isinstance(out, torch.Tensor) else tree_flatten(out)
        written = {} if arguments is None else _written_arguments(leaves, arguments)
        fills = arguments is not None and not written and _fills_first_argument(func)
        if written or fills:  # wait for the write (NOTE [Collectives that write into their arguments])
            for leaf in leaves:
                if isinstance(leaf, torch.ScriptObject) and hasattr(leaf, "wait"):
                    leaf.wait()
        for position, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                if position in written:  # NOTE [Collectives that write into their arguments]
                    leaf = leaf.detach().clone()
                if self.on_save is not None:
                    self.on_save(leaf)
                leaves[position] = torch_recompute._detach_helper(leaf)
        filled = [(index, leaf.detach().clone()) for index, leaf in enumerate(tree_leaves(args[0]))
                  if isinstance(leaf, torch.Tensor)] if fills else None
        kept = _Kept(leaves, spec, rng, written, _shapes(args), lasting, filled)
        for position, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                self.kept_storages.setdefault(leaf.untyped_storage()._cdata, []).append((kept, position))
        return kept

    def _watch_aliases(self, out: Any) -> None:
        """Watch the outputs of an op that lie on a kept storage (NOTE [Aliases with their own version counter])."""
        for tensor in (out,) if isinstance(out, torch.Tensor) else tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            for kept, leaf in self.kept_storages.get(tensor.untyped_storage()._cdata, ()):
                alias = torch_recompute._detach_helper(tensor)
                kept.aliases.append((leaf, alias, alias._version))
                if self.on_watch is not None:
                    self.on_watch(alias)

    def _copy_before_write(self, writes: tuple[tuple[int, str], ...], args: tuple, kwargs: dict) -> None:
        for position, name in writes:
            value = args[position] if position < len(args) else kwargs.get(name)
            for tensor in tree_leaves(value):
                if not isinstance(tensor, torch.Tensor):
                    continue
                for kept, leaf in self.kept_storages.pop(tensor.untyped_storage()._cdata, ()):
                    copy = kept.leaves[leaf].clone()
                    kept.replace(leaf, copy)
                    if self.on_save is not None:
                        self.on_save(copy)


class _AutogradSaves:
    """The storages autograd saves for backward while one region records its forward.

    NOTE [Never keep more than off]
    A kept op output costs its bytes until backward; the un-applied layer pays for the same tensor
    only where autograd saves it (a convolution before a frozen BatchNorm, ``x * scale + bias``, is
    not saved; one before a GELU is). So when the region's forward is done, the kept outputs that
    autograd did not save are weighed against what the un-applied layer would keep that the
    checkpointed region freed (the saved storages now dead; the layer's output and inputs stay
    alive either way). Where they weigh more, the layer would keep more than ``off`` (HF DETR's
    ResNet backbone: 1.3-1.5x), and it keeps only the outputs autograd saves too; the replay
    recomputes the rest. Only the region's own tensors count (autograd nodes made after it
    started, by sequence number), not its inputs or parameters. Checkpoint's pack hook still
    replaces what is saved; this pair only looks at it on the way. Swapped kept outputs leave the
    device, so a region that swaps them is not weighed.
    """

    __slots__ = ("first", "pack", "saved", "sizes")

    def __init__(self) -> None:
        self.first = torch._C._autograd._get_sequence_nr()
        self.saved: dict[int, weakref.ref] = {}
        """Storage address -> the storage; an address can be reused once the storage is freed (a
        checkpointed region frees what it saves), hence the reference."""
        self.sizes: list[tuple[weakref.ref, int]] = []
        self.pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(True)
        torch._C._autograd._push_saved_tensors_default_hooks(self._pack, unpack)

    def _pack(self, tensor: torch.Tensor) -> Any:
        node = tensor.grad_fn
        if node is not None and node._sequence_nr() >= self.first:
            storage = tensor.untyped_storage()
            ref = self.saved.get(storage._cdata)
            if ref is None or ref() is not storage:  # not self._has(storage), without a call per saved tensor
                self.saved[storage._cdata] = ref = weakref.ref(storage)
                self.sizes.append((ref, storage.nbytes()))
        return self.pack(tensor)

    def _has(self, storage: torch.UntypedStorage) -> bool:
        ref = self.saved.get(storage._cdata)
        return ref is not None and ref() is storage

    def close(self) -> None:
        torch._C._autograd._pop_saved_tensors_default_hooks()

    def prune(self, tape: _Tape, never_pruned: set[int]) -> None:
        """Once the region's forward is done: forget the kept outputs autograd did not save, where
        they cost more than what the un-applied layer would keep and the region freed (NOTE [Never
        keep more than off]). Collectives and higher-order ops (tape positions ``never_pruned``) stay
        kept: collectives are never replayed, and a compiled region's saves have no autograd node here."""
        kept = {id(s): s for entry in tape.entries if isinstance(entry, _Kept) for s in _storages(entry)}
        unsaved = sum(s.nbytes() for s in kept.values() if not self._has(s))
        if unsaved <= sum(nbytes for ref, nbytes in self.sizes if ref() is None):
            return
        for position, entry in enumerate(tape.entries):
            if (isinstance(entry, _Kept) and position not in never_pruned
                    and not any(self._has(s) for s in _storages(entry))):
                tape.entries[position] = None


def _storages(kept: _Kept) -> list[torch.UntypedStorage]:
    return [leaf.untyped_storage() for leaf in kept.leaves if isinstance(leaf, torch.Tensor)]


_CONSTANT_OPS = ("aten::lift_fresh", "aten::lift_fresh_copy", "aten::scalar_tensor")


def _creates_constant(op: Any) -> bool:
    """``op`` makes a new tensor from Python values only (``torch.tensor(...)``, ``torch.zeros(...)``)."""
    schema = getattr(op, "_schema", None)
    if schema is None or torch.Tag.nondeterministic_seeded in op.tags:
        return False
    return schema.name in _CONSTANT_OPS or not any(
        isinstance(argument.type, (torch.TensorType, torch.ListType, torch.OptionalType))
        and "Tensor" in str(argument.type)
        for argument in schema.arguments
    )


class _ReplayMode(_EagerMode):
    """Runs a region's recompute: returns the kept outputs from the tape, runs every other op.

    NOTE [Replays that cannot use the tape]
    The replay walks the tape in order and checks that each op is the one the forward ran (else
    :class:`RecomputeMismatchError`: the forward depends on state it changes). A kept output is
    handed out once and then dropped, so its memory goes as soon as backward is done with it. A
    second replay of the same region (``backward(retain_graph=True)`` then another backward, or
    ``autograd.grad(create_graph=True)`` then a backward through the gradients) finds it consumed and
    runs the op again, as full recompute would; so does any replay of a kept output that a write
    hyperac did not see has changed (NOTE [Writes into kept outputs]). The op's inputs are the
    replayed ones, equal to the forward's, so the result is the forward's, bitwise where the op is
    deterministic. A route is the exception: it is handed, as a copy, to every replay (NOTE [Routing
    is kept] in replay/routing.py).

    NOTE [Kept outputs that no longer fit]
    A kept output is right only for the arguments its op had in forward. Where a size depends on the
    data (tokens per expert, after a route that was recomputed: a router named in ``force_recompute=``,
    or a replay fed other data), the replay reaches a kept op with arguments of other shapes, and the
    kept output would surface later as a raw shape error far from its cause ("The size of tensor a (58)
    must match the size of tensor b (57)"), or, where shapes happen to agree, as wrong gradients. So
    each kept output holds the shapes of its op's tensor arguments (a tuple per kept op, compared once
    in the replay), and a replay whose arguments differ raises :class:`RecomputeMismatchError` naming
    the layer, the op and both shapes.
    """

    def __init__(self, tape: _Tape, ops: OpSets, before_replay: Callable[[], None] | None) -> None:
        super().__init__()
        self.tape = tape
        self.hook_ops.stacks = tape.stacks  # named in the error of a replay that diverges
        self.ops = ops
        self.lookup = ops.lookup
        self.before_replay = before_replay
        self.cursor = 0

    def __enter__(self):
        if self.before_replay is not None:
            self.before_replay()
        self.cursor = 0
        return super().__enter__()

    def __exit__(self, exc_type, exc_value, traceback):
        super().__exit__(exc_type, exc_value, traceback)
        # A replay that stops early (checkpoint's early stop) raises out of the region; one that
        # ends normally must have run every op the forward ran.
        if exc_type is None and any(isinstance(kept, _Kept) for kept in self.tape.entries[self.cursor:]):
            raise _mismatch(self.tape, self.cursor, "nothing more")

    def _realign(self, key: Any, func: Any, args: tuple, kwargs: dict) -> int | None:
        """The tape position of ``key``, which is not the op at the cursor, or ``None`` where the op is
        run without one.

        A forward may run ops its replay does not: a lazily computed constant cached on the module
        (``if self.dim_sqrt is None: self.dim_sqrt = torch.tensor(...).sqrt()``, HF ibert). Such a
        run of ops starts from a new constant and keeps nothing, so the replay skips it. An autocast
        cast of a leaf (asked about whether or not the forward ran one here) is run without a tape
        entry, and the forward's casts that the replay does not run are skipped: either side may have
        served it from autocast's cache (NOTE [Autocast casts served from the cache] in
        replay/replay_check.py). Views of untracked tensors the forward took and the replay does not are
        skipped (NOTE [Views a replay may skip]). Anything else is a divergence.

        NOTE [Views a replay may skip]
        FSDP1 gathers a unit's flat parameter in its wrapper's own ``forward``: it splits its gather buffer
        into one view per rank, all-gathers into them (a collective on a parameter's storage: the stack's, NOTE
        [Parameter lifecycles are not the layer's program] in lifecycle.py) and takes the flat parameter as a
        view of the buffer, all with autograd tracking nothing; in backward it has gathered the unit before
        the layer's replay reaches it (its backward prefetch), and the replay runs none of these. Nothing
        tells these views from a layer's own view of an untracked tensor but that the replay does not run
        them, and a view computes nothing: so a forward's view of untracked tensors that keeps nothing is
        skipped where the replay runs another op. What else the replay runs is checked as before.
        """
        if cast_of_a_leaf(func, args, kwargs):
            return None
        tape, start = self.tape, self.cursor
        if start < len(tape.keys) and tape.keys[start] is key:
            return start
        if start in tape.views:  # NOTE [Views a replay may skip]
            for position in range(start, len(tape.keys)):
                if tape.keys[position] is key or tape.keys[position] == key:
                    return position
                if position not in tape.views:
                    break
        if start < len(tape.keys) and (_creates_constant(tape.keys[start]) or cast_of_a_leaf(tape.keys[start], ())):
            for position in range(start, len(tape.keys)):
                if tape.keys[position] is key or tape.keys[position] == key:
                    return position
                if tape.entries[position] is not None:  # only ops that keep nothing are skipped
                    break
        raise _mismatch(tape, start, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        entry = self.lookup(id(func))
        kind, _, keyed, _, view, fills, run = self.ops.classify(func) if entry is None else entry[0]
        if kind == _IGNORED or bypass_replay.get() or torch._C._current_graph_task_id() != self.task:
            return run(*args, **kwargs)
        if self.hook_ops.owns(args, kind == _COLLECTIVE, view, fills):
            return self._stack_op(run, args, kwargs)
        tape, index = self.tape, self.cursor
        key = _storage_key(func, args) if keyed else func
        if index >= len(tape.keys) or (tape.keys[index] is not key and tape.keys[index] != key) or func is _TO_COPY:
            index = self._realign(key, func, args, kwargs)
            if index is None:
                return run(*args, **kwargs)
        self.cursor = index + 1
        kept = tape.entries[index]
        if kept is None:
            return run(*args, **kwargs)
        if kept is _CONSUMED or not kept.lasting:
            tape.entries[index] = _CONSUMED
        if kept is _CONSUMED or not kept.intact():
            return run(*args, **kwargs)
        if kept.shapes != _shapes(args):  # NOTE [Kept outputs that no longer fit]
            raise unfit(tape.layer, tape.index, f"op {index} of {len(tape.keys)} ({func})", kept.shapes, args)
        if kept.rng is not None:
            restore_generators(kept.rng)  # NOTE [Kept ops that draw random numbers] in replay/random_sources.py
        return kept.value((args, kwargs))


def selective_contexts(
    ops: OpSets, swap_group: Any = None, mode: str = "selective", layer: str = "?", index: int | None = None
) -> tuple[Any, Any]:
    """A fresh (forward, recompute) context pair for one region invocation (eager mode).

    ``mode``: ``selective`` keeps the odd-numbered matmuls of the region, ``selective-even`` the
    even-numbered ones, ``pointwise`` all of them (only cheap ops are recomputed). ``layer`` and
    ``index`` (the layer's fqn and flat index) name the layer in errors.

    With ``swap_group``, the kept op outputs go to host memory after the layer's forward and
    come back before the replay (NOTE [Swapping selective outputs] in swap.py).
    """
    tape = _Tape(layer, index)
    if swap_group is None:
        recording = _RecordingMode(tape, SelectivePolicy(ops, mode), None)
    else:
        recording = _RecordingMode(tape, SelectivePolicy(ops, mode), swap_group.register_cached,
                                   swap_group.register_watcher)
    before_replay = None if swap_group is None else swap_group.ensure_loaded
    return (
        recording,
        _ReplayMode(tape, ops, before_replay),
    )


def _route_policy() -> CheckpointPolicy:
    """A route's decision under ``compile=True``: saved where AOTAutograd traces the region (its proxy mode is on),
    recomputed where the region runs eagerly at a graph break (NOTE [Routing is kept] in replay/routing.py)."""
    traced = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None
    return CheckpointPolicy.MUST_SAVE if traced else CheckpointPolicy.MUST_RECOMPUTE


def _routes_saved(ops: OpSets, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``compile=True`` policy of a ``full`` layer: torch's own for a checkpoint region (recompute every op),
    but for routes (NOTE [Routing is kept] in replay/routing.py)."""
    return _route_policy() if ops.classify(op)[0] == _ROUTE else CheckpointPolicy.PREFER_RECOMPUTE


def _offload_saved(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``compile=True`` policy of a ``swap`` layer: what the partitioner saves goes to host memory."""
    return CheckpointPolicy.PREFER_CPU_OFFLOAD


def compiled_contexts(backend_type: type[Backend], mode: str, offload: bool,
                      save_ops: tuple[str, ...] | None = None) -> tuple[Any, Any]:
    """PyTorch's selective checkpoint contexts around hyperac's policy for ``mode`` (``compile=True``): a fresh
    :class:`SelectivePolicy`; ``full``: :func:`_routes_saved`; ``swap``: :func:`_offload_saved`;
    ``offload``: the layer swaps (NOTE [Swap under torch.compile] in compiled.py). Called while the
    region is traced, not per step: the op sets are resolved then.

    NOTE [Selective recompute under torch.compile]
    Under ``torch.compile`` the policy runs while AOTAutograd traces the region's forward, once per
    op, and its decision becomes the op node's ``recompute`` tag, which the partitioner obeys:
    ``MUST_SAVE`` outputs are saved, the rest recomputed in the backward graph. So the counting
    policy of eager mode works unchanged: ``selective`` keeps the odd-numbered matmuls of each
    region, ``selective-even`` the even-numbered ones, ``pointwise`` all of them, and the compiled
    layer saves what the eager one does. The counter is fresh per trace (``context_fn`` is called
    per region invocation), and the policy is called at trace time only, except in a region dynamo runs
    eagerly at a graph break, where PyTorch's selective checkpoint calls it per op (routes are then
    recomputed: NOTE [Routing is kept] in replay/routing.py).
    """
    if mode == "swap":
        policy: Callable[..., CheckpointPolicy] = _offload_saved
    elif mode == "full":
        policy = functools.partial(_routes_saved, resolve_op_sets(backend_type(), save_ops))
    else:
        policy = SelectivePolicy(resolve_op_sets(backend_type(), save_ops), mode, offload)
    contexts = torch_recompute.create_selective_checkpoint_contexts(policy)
    # PyTorch's modes have rules for a few higher-order ops only; with this, every other one (a
    # ``torch.cond`` in the layer) comes to them as one op, which the policy decides as in eager mode
    # (NOTE [Higher-order operators] in higher_order.py). Those with rules keep them.
    for context in contexts:
        context.supports_higher_order_operators = True
    return contexts


def compile_context_fn(backend_type: type[Backend], mode: str, offload: bool = False,
                       save_ops: tuple[str, ...] | None = None) -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` for layers that run under ``torch.compile``: a ``functools.partial``, the
    form dynamo accepts, of constants only (a function, a class, a string, a bool, a tuple of op
    names: ``Config.save_ops``), which dynamo's
    guards compare: every layer of one mode shares one graph, in this apply and the next (NOTE [One
    graph per layer plan] in recompute.py)."""
    return functools.partial(compiled_contexts, backend_type, mode, offload, save_ops)
