"""What the selective policy keeps, by what an op is: collectives by their schema (a process group or a
group's name), the expert-parallel dispatchers the reference system names, and attention kernels of
known layout under the attention cost rule (NOTE [Collectives by their schema] in op_identity.py, NOTE
[Attention kept by its cost per byte] in policy.py).

The kernels are stand-ins registered with ``torch.library`` under the schemas the real libraries
register (torch_npu 2.14's YAML, torchtitan 0.3's DeepEP and HybridEP wrappers, FFPA's CuTeDSL ops),
with CPU kernels that count their runs and an autograd formula that differentiates the same math.
torch's own ``varlen_attn`` runs for real, with stand-in CPU kernels for the flash-attention kernels it
calls (they exist only for CUDA). What a stand-in cannot show without the hardware: that the real
kernel's bytes cross the network once (here one rank, no network), that the real kernels' outputs
(FP8 scales, routing tables, philox states) are all tensors a replay may return, and their speed.
"""

from __future__ import annotations

import collections
import copy
import importlib
import types

import pytest
import torch
import torch.nn.functional as F
from hyperac_testing import Stack, assert_parity, train_step
from npu_stand_in import SCHEMAS, op_name
from torch import nn
from torch._library import opaque_object
from torch.library import Library

import hyperac
from hyperac.backends import get_backend
from hyperac.backends.npu import _NPU_COMMUNICATION_OPS
from hyperac.op_identity import communicates
from hyperac.policy import _ATTENTION, _COLLECTIVE, _KEEP, _MATMUL, _ROUTE, resolve_op_sets

DIM, TOKENS, EXPERTS = 16, 12, 4
RUNS: collections.Counter = collections.Counter()
"""Kernel runs by qualified op name (``namespace::op``)."""


# torch 2.13 names the base of opaque classes OpaqueBase; 2.14 (torchtitan's) CustomClassBase.
_OPAQUE_BASE = getattr(opaque_object, "CustomClassBase", None) or opaque_object.OpaqueBase


class DispatchHandle(_OPAQUE_BASE):
    """HybridEP's handle (torchtitan registers its own class of this name as an opaque reference type)."""

    def __init__(self, value: int = 0) -> None:
        self.value = value


opaque_object.register_opaque_type(DispatchHandle, typ="reference")
_HANDLE = opaque_object.get_opaque_type_name(DispatchHandle)


class _Differentiated(torch.autograd.Function):
    """The autograd kernel of a stand-in: runs the op below autograd, differentiates ``math`` in backward
    (``torch.library.register_autograd`` refuses the keyword-only tensors of torch_npu's schemas)."""

    @staticmethod
    def forward(ctx, op, math, kwargs, *args):
        ctx.math, ctx.args = math, args
        ctx.positions = [i for i, value in enumerate(args)
                         if isinstance(value, torch.Tensor) and value.is_floating_point()]
        ctx.save_for_backward(*(args[i] for i in ctx.positions))
        with torch._C._AutoDispatchBelowAutograd():
            return op(*args, **kwargs)

    @staticmethod
    def backward(ctx, *grads):
        leaves = [tensor.detach().requires_grad_() for tensor in ctx.saved_tensors]
        args = list(ctx.args)
        for position, leaf in zip(ctx.positions, leaves):
            args[position] = leaf
        with torch.enable_grad():
            outputs = ctx.math(*args)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        pairs = [(out, grad) for out, grad in zip(outputs, grads)
                 if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None]
        found = torch.autograd.grad([out for out, _ in pairs], leaves, [grad for _, grad in pairs], allow_unused=True)
        result = [None] * len(args)
        for position, grad in zip(ctx.positions, found):
            result[position] = grad
        return (None, None, None, *result)


def _stand_in(library: Library, schema: str, math) -> None:
    """Define ``schema`` in ``library`` with a CPU kernel that counts its runs and returns
    ``math(*positional arguments)``, and an autograd kernel that differentiates ``math``."""
    name = schema.partition("(")[0]
    qualname = f"{library.ns}::{name}"
    library.define(schema)

    def kernel(*args, **kwargs):
        RUNS[qualname] += 1
        return math(*args)

    def autograd_kernel(*args, **kwargs):
        return _Differentiated.apply(getattr(getattr(torch.ops, library.ns), name).default, math, kwargs, *args)

    library.impl(name, kernel, "CPU")
    library.impl(name, autograd_kernel, "Autograd")


def _counts(expert_ids: torch.Tensor) -> torch.Tensor:
    return torch.bincount(expert_ids.flatten(), minlength=EXPERTS)


# torch_npu 2.14.0's schemas, from the file tests/npu_stand_in.py reads (the wheel's YAML), registered
# under a namespace of the test's own: the rule reads the schema, whatever library registered it.
_NPU_FILE = {op_name(entry["schema"]): entry["schema"] for entry in SCHEMAS["ops"]}
_NPU_MATH = {
    "npu_moe_distribute_dispatch": lambda x, ids, *_: (
        x.flip(0), x.new_ones(x.shape[0]), ids.flatten().argsort(), _counts(ids), _counts(ids), _counts(ids),
        x.new_ones(x.shape[0])),
    "npu_moe_distribute_combine": lambda x, ids, idx, counts, scales, *_: x.flip(0) * scales.unsqueeze(-1),
    "npu_all_to_all_matmul": lambda x1, x2, *_: (x1.flip(0) @ x2, x1.flip(0)),
    "npu_matmul_all_to_all": lambda x1, x2, *_: (x1 @ x2).flip(0),
    "npu_quant_mm_reduce_scatter": lambda x1, x2, *_: (x1 @ x2, (x1 @ x2).abs().amax()),
    "npu_alltoallv_gmm": lambda x, w, *_: (x.flip(0) @ w[0], x.new_empty(0), x.flip(0)),
    "npu_all_gather_quant_mm": lambda x1, x2, *_: (x1 @ x2, x1.clone(), (x1 @ x2).abs().amax()),
    "_npu_distribute_barrier": lambda x, *_: x.clone(),
}

# torchtitan 0.3's torchtitan/distributed/deepep/{deepep,hybridep}.py: DeepEP's schemas name no group
# (the group lives in the buffer), HybridEP's dispatch names it and its combine takes only the handle.
_EP_SCHEMAS = {
    "deepep": {
        "dispatch": (
            "dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, int num_tokens_per_rank, "
            "bool cudagraphable) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
            lambda x, idx, weights, *_: (x.flip(0), idx.clone(), weights.flip(0), _counts(idx), idx.new_ones(1)),
        ),
        "combine": (
            "combine(Tensor x, Tensor handle_id, bool will_backward) -> Tensor",
            lambda x, *_: x.flip(0),
        ),
    },
    "hybridep": {
        "dispatch": (
            "dispatch(Tensor x, Tensor topk_idx, Tensor topk_weights, int num_experts, int ep_size, str group_name, "
            "bool non_blocking=False, float? moe_expert_capacity_factor=None, int? pad_multiple=None) "
            f"-> (Tensor, Tensor, Tensor, {_HANDLE})",
            lambda x, idx, weights, *_: (x.flip(0), weights.flip(0), _counts(idx), DispatchHandle(x.shape[0])),
        ),
        "combine": (
            f"combine(Tensor x, {_HANDLE} handle, int num_tokens, int? pad_multiple=None) -> Tensor",
            lambda x, handle, num_tokens, *_: x.flip(0)[:num_tokens],
        ),
    },
}


@pytest.fixture(scope="module")
def stand_ins():
    """The stand-in kernels, registered after hyperac was imported; unregistered afterwards."""
    for namespace in ("deepep", "hybridep", "hyperac_vendor"):
        if hasattr(torch.ops, namespace) and any(hasattr(getattr(torch.ops, namespace), name)
                                                 for name in ("dispatch", *_NPU_MATH)):
            pytest.skip(f"torch.ops.{namespace} is already registered (the real library is installed)")
    libraries = [Library(namespace, "FRAGMENT") for namespace in ("deepep", "hybridep", "hyperac_vendor")]
    for library in libraries[:2]:
        for schema, math in _EP_SCHEMAS[library.ns].values():
            _stand_in(library, schema, math)
    for name, math in _NPU_MATH.items():
        _stand_in(libraries[2], _NPU_FILE[name], math)
    yield
    for library in libraries:
        library._destroy()


def _routing(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return torch.randint(0, EXPERTS, (tokens, 1), generator=generator), torch.rand(tokens, 1, generator=generator)


def _exchange(kind: str, h: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``h`` (tokens, DIM) through the collectives of ``kind``, as the library's callers call them."""
    vendor, ids_weights = torch.ops.hyperac_vendor, _routing(h.shape[0])
    if kind == "deepep":
        received, _, scores, _, handle = torch.ops.deepep.dispatch(h, *ids_weights, EXPERTS, h.shape[0], False)
        return torch.ops.deepep.combine(received * scores, handle, True)
    if kind == "hybridep":
        received, scores, _, handle = torch.ops.hybridep.dispatch(h, *ids_weights, EXPERTS, 1, "ep0")
        return torch.ops.hybridep.combine(received * scores, handle, h.shape[0])
    if kind == "npu_moe_distribute":
        ids = ids_weights[0]
        expand_x, _, expand_idx, ep_counts, *_ = vendor.npu_moe_distribute_dispatch(h, ids, "ep0", 1, 0, EXPERTS)
        return vendor.npu_moe_distribute_combine(expand_x @ weight, ids, expand_idx, ep_counts,
                                                 ids_weights[1].flatten(), "ep0", 1, 0, EXPERTS)
    if kind == "npu_all_to_all_matmul":
        return vendor.npu_all_to_all_matmul(h, weight, "hcom0", 1)[0]
    if kind == "npu_matmul_all_to_all":
        return vendor.npu_matmul_all_to_all(h, weight, "hcom0", 1)
    if kind == "npu_quant_mm_reduce_scatter":
        out, amax = vendor.npu_quant_mm_reduce_scatter(h, weight, "hcom0", 1)
        return out / amax
    if kind == "npu_alltoallv_gmm":
        return vendor.npu_alltoallv_gmm(h, weight.unsqueeze(0), "hcom0", 1, [h.shape[0]], [h.shape[0]])[0]
    if kind == "npu_all_gather_quant_mm":
        return vendor.npu_all_gather_quant_mm(h, weight, "hcom0", 1)[0]
    if kind == "late":
        return torch.ops.hyperac_late.all_gather_matmul(h, weight, 0, "tp0")
    if kind == "plain":
        return torch.ops.hyperac_plain.scatter_scale(h @ weight, 0, ids_weights[0])
    return vendor._npu_distribute_barrier(h, "ep0", 1) * h


_COLLECTIVE_OPS = {
    "deepep": ("deepep::dispatch", "deepep::combine"),
    "hybridep": ("hybridep::dispatch", "hybridep::combine"),
    "npu_moe_distribute": ("hyperac_vendor::npu_moe_distribute_dispatch", "hyperac_vendor::npu_moe_distribute_combine"),
    **{name: (f"hyperac_vendor::{name}",) for name in (
        "npu_all_to_all_matmul", "npu_matmul_all_to_all", "npu_quant_mm_reduce_scatter", "npu_alltoallv_gmm",
        "npu_all_gather_quant_mm", "_npu_distribute_barrier")},
}


class _Exchange(nn.Module):
    """The layer's collectives (a module of its own, so ``force_recompute`` can name it)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return _exchange(self.kind, h, self.weight)


class _MoeBlock(nn.Module):
    """Pre-norm block: norm, projection, the collectives, projection, residual; tokens flattened."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, DIM)
        self.exchange = _Exchange(kind)
        self.down = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.exchange(self.up(self.norm(x)))))


def _loss(x: torch.Tensor):
    return lambda model: model(x).square().mean()


def _runs_per_layer(model: nn.Module, x: torch.Tensor, names: tuple[str, ...]) -> tuple[list[float], tuple]:
    """Kernel runs of each of ``names`` per layer in one training step, and the step's (loss, grads)."""
    RUNS.clear()
    result = train_step(model, _loss(x))
    return [RUNS[name] / len(model.blocks) for name in names], result


@pytest.mark.parametrize("kind", list(_COLLECTIVE_OPS))
@pytest.mark.parametrize(("options", "runs"), [
    (dict(mode="selective"), 1),
    (dict(mode="selective-even"), 1),
    (dict(mode="pointwise"), 1),
    (dict(mode="selective", save_ops=["aten::mm"]), 1),  # the save list leaves collectives kept
    (dict(mode="selective", force_recompute=["exchange"]), 1),  # so does a module forced to recompute
    (dict(mode="full"), 2),  # the count can fail: full recompute replays the layer's collectives
], ids=lambda value: ",".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else str(value))
def test_collectives_run_once_per_layer_and_step(stand_ins, kind, options, runs):
    """Each collective (a stand-in with the real schema) runs once per layer per step in every
    selective mode, also where the save list does not name it or a forced module runs it: its
    output is kept, never replayed. Gradients are bitwise those of the un-applied model. Without
    the hardware this cannot show the real kernel's traffic, only that hyperac does not call it
    again."""
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(1))
    model = Stack(lambda: _MoeBlock(kind))
    reference = train_step(copy.deepcopy(model), _loss(x))
    hyperac.apply(model, layers="blocks", backend="cpu", **options)
    for _ in range(2):  # the second step replays from a fresh tape, too
        counted, result = _runs_per_layer(model, x, _COLLECTIVE_OPS[kind])
        assert counted == [runs] * len(_COLLECTIVE_OPS[kind])
        assert_parity(reference, result)


def test_collectives_registered_after_apply_are_recognised():
    """An op registered after ``hyperac.apply`` (torch_npu's, a custom kernel library's) is classified
    at first sight: a group-name argument (here typed ``Any``, as torch 2.13's functional collectives
    declare it) makes it a collective, kept and not replayed. One rank, a stand-in kernel: what
    crosses a network is not shown."""
    x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(1))
    model = Stack(lambda: _MoeBlock("late"))
    reference_model = copy.deepcopy(model)
    hyperac.apply(model, layers="blocks", backend="cpu", mode="selective")
    library = Library("hyperac_late", "FRAGMENT")
    try:
        _stand_in(library, "all_gather_matmul(Tensor x, Tensor w, int gather_dim, Any group_name) -> Tensor",
                  lambda h, w, *_: h.flip(0) @ w)
        reference = train_step(reference_model, _loss(x))
        counted, result = _runs_per_layer(model, x, ("hyperac_late::all_gather_matmul",))
    finally:
        library._destroy()
    assert counted == [1]
    assert_parity(reference, result)


# --- Negative: strings that name no group. ---


def test_no_aten_op_is_a_collective():
    """Every aten overload registered now (``str reduce``, ``str approximate``, ``str mode``, ``int groups``
    ...) is no collective: the rule reads argument names and types, not just "has a string"."""
    flagged = []
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith("aten::"):
            overload = getattr(getattr(torch.ops.aten, schema.name[6:]), schema.overload_name or "default")
            if communicates(overload):
                flagged.append(str(schema))
    assert flagged == []


# torch_npu schemas that take strings or groups of another kind and communicate nothing.
_NOT_COLLECTIVES = ("npu_fusion_attention", "npu_dynamic_quant", "npu_group_norm_silu", "npu_moe_gating_top_k")


def test_string_arguments_that_name_no_group_are_replayed():
    """An op with ``str reduce="sum"``, ``str input_layout``, an ``int group`` or ``int[]? group_sizes`` and
    ``str? comm_mode`` is an ordinary op: selective replays it (it runs twice per layer), with bitwise
    gradients. torch_npu's attention, quantization, group norm and gating schemas are no collectives."""
    library = Library("hyperac_plain", "FRAGMENT")
    try:
        for name in _NOT_COLLECTIVES:
            library.define(_NPU_FILE[name])
        _stand_in(library, "scatter_scale(Tensor self, int dim, Tensor index, str reduce=\"sum\", "
                           "str input_layout=\"BSND\", int group=1, int[]? group_sizes=None, str? comm_mode=None) "
                           "-> Tensor", lambda h, *_: h * 1.5)
        ops = resolve_op_sets(get_backend("cpu"))
        for name in (*_NOT_COLLECTIVES, "scatter_scale"):
            op = getattr(torch.ops.hyperac_plain, name).default
            assert not communicates(op) and op not in ops.communication, name
        x = torch.randn(TOKENS, DIM, generator=torch.Generator().manual_seed(1))
        model = Stack(lambda: _MoeBlock("plain"))
        reference = train_step(copy.deepcopy(model), _loss(x))
        hyperac.apply(model, layers="blocks", backend="cpu", mode="selective")
        counted, result = _runs_per_layer(model, x, ("hyperac_plain::scatter_scale",))
    finally:
        library._destroy()
    assert counted == [2]
    assert_parity(reference, result)


# --- Attention kernels of known layout, under the attention cost rule. ---
#
# The blocks project with a 16-wide matmul: 8 FLOPs per kept float32 byte. Attention with 8-wide heads
# costs ``key length`` FLOPs per kept byte, so the selective modes keep it from 8 keys per query on
# (NOTE [Attention kept by its cost per byte]); ``pointwise`` always keeps it.

HEADS = 2


def _attention(q, k, v, mask=None):
    """``(..., heads, length, dim)`` attention and its log-sum-exp."""
    scores = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def _same_document(cu_q, cu_k):
    """``(queries, keys)``: whether query and key lie in the same packed document."""
    documents = torch.arange(cu_q.numel() - 1)
    return (torch.repeat_interleave(documents, cu_q.diff())[:, None]
            == torch.repeat_interleave(documents, cu_k.diff())[None, :])


def _packed_attention(q, k, v, cu_q, cu_k):
    """Packed ``(tokens, heads, dim)`` attention within each document; log-sum-exp ``(heads, tokens)``."""
    out, lse = _attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), _same_document(cu_q, cu_k))
    return out.transpose(0, 1).contiguous(), lse


def _bnhd_attention(q, k, v, *_):
    out, lse = _attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).contiguous(), lse


@pytest.fixture(scope="module")
def attention_kernels():
    """FFPA's forward ops (stand-ins with its schemas), CPU kernels for the flash-attention kernels torch's
    ``varlen_attn`` calls, and CPU kernels for the composite ``scaled_dot_product_attention`` registered
    at the CPU and AutogradCPU keys, as torch_npu registers its own for NPU and AutogradNPU; all undone after."""
    if hasattr(torch.ops.ffpa_attn, "_fwd_cute"):
        pytest.skip("ffpa_attn is installed: its ops are already registered")
    importlib.import_module("torch.nn.attention.varlen")  # registers torch_attn::_varlen_attn

    ffpa, aten = Library("ffpa_attn", "FRAGMENT"), Library("aten", "IMPL")
    _stand_in(ffpa, "_fwd_cute(Tensor q, Tensor k, Tensor v, float softmax_scale, int causal, int return_lse) "
                    "-> (Tensor o, Tensor lse)", _bnhd_attention)
    _stand_in(ffpa, "_varlen_fwd_cute(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                    "SymInt max_seqlen_q, SymInt max_seqlen_k, float softmax_scale, bool causal, "
                    "SymInt window_size_left, SymInt window_size_right, float softcap, bool pack_gqa) "
                    "-> (Tensor, Tensor)", lambda q, k, v, cu_q, cu_k, *_: _packed_attention(q, k, v, cu_q, cu_k))

    def flash_forward(query, key, value, cu_q, cu_k, *args, **kwargs):
        RUNS["aten::_flash_attention_forward"] += 1
        out, lse = _packed_attention(query, key, value, cu_q, cu_k)
        empty = query.new_empty(0)
        return out, lse, empty, empty.clone(), empty.clone()

    def flash_backward(grad_out, query, key, value, out, lse, cu_q, cu_k, *args, **kwargs):
        # Runs below autograd (inside torch_attn::_varlen_attn_backward): the gradient by hand.
        q, k, v, grad = (tensor.transpose(0, 1) for tensor in (query, key, value, grad_out))
        scale = q.shape[-1] ** -0.5
        scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~_same_document(cu_q, cu_k), float("-inf"))
        probs = torch.exp(scores - lse.unsqueeze(-1))
        grad_probs = grad @ v.transpose(-1, -2)
        grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True)) * scale
        return tuple(tensor.transpose(0, 1).contiguous()
                     for tensor in (grad_scores @ k, grad_scores.transpose(-1, -2) @ q, probs.transpose(-1, -2) @ grad))

    def sdpa(query, key, value, *args, **kwargs):
        RUNS["aten::scaled_dot_product_attention"] += 1
        return _attention(query, key, value)[0]

    def sdpa_autograd(*args, **kwargs):
        return _Differentiated.apply(torch.ops.aten.scaled_dot_product_attention.default,
                                     lambda q, k, v, *_: _attention(q, k, v)[0], kwargs, *args)

    aten.impl("_flash_attention_forward", flash_forward, "CPU")
    aten.impl("_flash_attention_backward", flash_backward, "CPU")
    aten.impl("scaled_dot_product_attention", sdpa, "CPU")
    aten.impl("scaled_dot_product_attention", sdpa_autograd, "AutogradCPU")
    yield
    aten._destroy()
    ffpa._destroy()


def _split_heads(qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(..., 3 * DIM)`` to q, k, v of ``(..., HEADS, DIM // HEADS)``."""
    return qkv.unflatten(-1, (3, HEADS, DIM // HEADS)).unbind(-3)


class _AttentionBlock(nn.Module):
    """Pre-norm attention block; ``kind`` picks the kernel, ``documents`` the packed lengths."""

    def __init__(self, kind: str, documents: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.kind = kind
        self.cu = torch.tensor((0, *documents), dtype=torch.int32).cumsum(0, dtype=torch.int32)
        self.longest = max(documents, default=0)
        self.norm = nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = _split_heads(self.qkv(self.norm(x)))
        if self.kind == "ffpa_dense":  # (batch, seq, heads, dim), as FFPA's wrapper hands it over
            attended = torch.ops.ffpa_attn._fwd_cute(q, k, v, 0.25, 0, 1)[0]
        elif self.kind == "ffpa_varlen":  # (tokens, heads, dim)
            attended = torch.ops.ffpa_attn._varlen_fwd_cute(q, k, v, self.cu, self.cu, self.longest, self.longest,
                                                            0.25, False, -1, -1, 0.0, False)[0]
        elif self.kind == "varlen_attn":
            from torch.nn.attention.varlen import varlen_attn

            attended = varlen_attn(q, k, v, self.cu, self.cu, self.longest, self.longest)
        else:  # the composite, reaching the dispatch mode undecomposed
            attended = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                      v.transpose(1, 2)).transpose(1, 2)
        return x + self.out(attended.flatten(-2))


_ATTENTION_KERNELS = {
    "ffpa_dense": "ffpa_attn::_fwd_cute",
    "ffpa_varlen": "ffpa_attn::_varlen_fwd_cute",
    "varlen_attn": "aten::_flash_attention_forward",
    "composite_sdpa": "aten::scaled_dot_product_attention",
}


@pytest.mark.parametrize(("kind", "shape", "selective_runs"), [
    ("ffpa_dense", (2, 12), 1),  # 12 keys per query: kept
    ("ffpa_dense", (2, 6), 2),  # 6: recomputing costs less per byte than the projection
    ("composite_sdpa", (2, 12), 1),
    ("composite_sdpa", (2, 6), 2),
    ("ffpa_varlen", (3, 9), 1),  # the longest document has 9 keys: kept
    ("ffpa_varlen", (6, 6), 2),  # 12 packed tokens, but no query attends to more than 6 keys
    ("varlen_attn", (3, 9), 1),
    ("varlen_attn", (6, 6), 2),
], ids=str)
@pytest.mark.parametrize("mode", ["selective", "selective-even", "pointwise", "full"])
def test_attention_kernels_are_kept_by_their_cost(attention_kernels, kind, shape, selective_runs, mode):
    """Each attention kernel runs once per layer per step where the attention rule keeps it, twice
    where it does not (and always in ``full``, once in ``pointwise``); the packed kernels are weighed by
    their longest document, not by the batch's token count. Gradients are bitwise those of the
    un-applied model. Without a GPU (or an NPU, for the composite) this cannot show the real kernels'
    outputs being returned by a replay, only that hyperac does not call them again."""
    packed = kind in ("ffpa_varlen", "varlen_attn")
    block = (lambda: _AttentionBlock(kind, shape)) if packed else (lambda: _AttentionBlock(kind))
    x = torch.randn(*((sum(shape),) if packed else shape), DIM, generator=torch.Generator().manual_seed(1))
    model = Stack(block)
    reference = train_step(copy.deepcopy(model), _loss(x))
    hyperac.apply(model, layers="blocks", backend="cpu", mode=mode)
    runs = {"full": 2, "pointwise": 1}.get(mode, selective_runs)
    for _ in range(2):
        counted, result = _runs_per_layer(model, x, (_ATTENTION_KERNELS[kind],))
        assert counted == [runs]
        assert_parity(reference, result)


# --- The reference system's op sets (seed-behaviour.md, A.1), op by op. ---

_REFERENCE_TREATMENT = {
    # Its matmuls alternate (aten.mm/matmul/linear/_grouped_mm/_scaled_grouped_mm) or are always kept
    # (addmm, bmm, _scaled_mm: a biased Linear kept, a bias-free one alternated); hyperac alternates all
    # alike, the documented better treatment.
    _MATMUL: ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul", "aten::_scaled_mm",
              "aten::_grouped_mm", "aten::_scaled_grouped_mm"),
    # The partitioner's other compute-intensive ops and the FP8 amax.
    _KEEP: ("aten::convolution", "aten::upsample_bilinear2d", "aten::max"),
    # Always kept there; here kept where worth their bytes (NOTE [Attention kept by its cost per byte]).
    _ATTENTION: ("aten::_scaled_dot_product_flash_attention", "aten::_scaled_dot_product_efficient_attention",
                 "aten::_scaled_dot_product_cudnn_attention", "aten::_scaled_dot_product_flash_attention_for_cpu",
                 "aten::_scaled_dot_product_fused_attention_overrideable", "aten::scaled_dot_product_attention",
                 "aten::_flash_attention_forward", "aten::_efficient_attention_forward", "torch_attn::_varlen_attn",
                 "ffpa_attn::_fwd_cute", "ffpa_attn::_varlen_fwd_cute"),
    _COLLECTIVE: ("_c10d_functional::all_to_all_single", "_c10d_functional::reduce_scatter_tensor",
                  "c10d::allreduce_", "deepep::dispatch", "deepep::combine", "hybridep::dispatch", "hybridep::combine"),
    _ROUTE: ("aten::topk",),
}


def test_the_reference_systems_op_sets_are_covered(stand_ins, attention_kernels):
    """Every op the reference system's selective policy names (its compute, attention and communication
    sets; its higher-order ops and torch_npu's attention are another module's) is classified as it keeps
    it, or as the documented better rule: alternated matmuls, attention by its cost. Its partitioner's
    ``convolution_backward`` runs only in backward, which records nothing."""
    ops = resolve_op_sets(get_backend("cpu"))
    for kind, names in _REFERENCE_TREATMENT.items():
        for name in names:
            namespace, _, op_name = name.partition("::")
            packet = getattr(getattr(torch.ops, namespace), op_name)
            overload = packet.default if "default" in packet.overloads() else getattr(packet, packet.overloads()[0])
            assert ops.classify(overload)[0] == kind, name


# torch_npu 2.14.0's distributed ops registered in C++ only (schema strings of lib/libtorch_npu.so), whose
# group is an object of its own TorchScript class.
_NPU_CUSTOM_DIST = tuple(
    f"npu_custom_dist::{schema}" for schema in (
        "wrap_allgather_base_uneven_inner(Tensor output_tensor, Tensor input_tensor, int[] output_split_sizes, "
        "__torch__.torch.classes.npu_custom_dist.ProcessGroupHCCL process_group_hccl, int timeout) "
        "-> __torch__.torch.classes.c10d.Work",
        "wrap_reduce_scatter_base_uneven_inner(Tensor output_tensor, Tensor input_tensor, int[] input_split_sizes, "
        "__torch__.torch.classes.npu_custom_dist.ProcessGroupHCCL process_group_hccl, "
        "__torch__.torch.classes.c10d.ReduceOp reduce_op, int timeout) -> __torch__.torch.classes.c10d.Work",
        "wrap_batch_isend_irecv_inner(Tensor[] tensors, str[] op_type, int[] remote_rank_list, "
        "__torch__.torch.classes.npu_custom_dist.ProcessGroupHCCL process_group_hccl) "
        "-> __torch__.torch.classes.c10d.Work",
        "wrap_alltoallvc_inner(Tensor output_tensor, Tensor input_tensor, int[] send_count_matrix, "
        "__torch__.torch.classes.npu_custom_dist.ProcessGroupHCCL process_group_hccl, int timeout) "
        "-> __torch__.torch.classes.c10d.Work",
    )
)


def test_the_rule_finds_exactly_the_npu_backends_collectives():
    """Over every schema of torch_npu 2.14.0 (the checked-in file, and its C++-only distributed ops), the
    schema rule finds exactly the collectives the NPU backend lists by name (each takes ``str hcom``, a
    group's name or its ``ProcessGroupHCCL``), and nothing else: no attention, quantization, norm or
    MoE-routing kernel is taken for one."""
    schemas = [f"npu::{entry['schema']}" for entry in SCHEMAS["ops"]] + list(_NPU_CUSTOM_DIST)
    found = set()
    for text in schemas:
        schema = _parse_schema(text)
        if communicates(types.SimpleNamespace(_schema=schema)):
            found.add(schema.name)
    assert found == set(_NPU_COMMUNICATION_OPS)


def _parse_schema(text: str) -> torch.FunctionSchema:
    """``text`` parsed. The parser needs every class a schema names to be registered, and only torch_npu's
    C++ registers ``npu_custom_dist.ProcessGroupHCCL``: here it is read as ``c10d.ProcessGroup``, which the
    rule takes for the same reason (the class name starts with ``ProcessGroup``)."""
    try:
        return torch._C.parse_schema(text)
    except RuntimeError:
        return torch._C.parse_schema(text.replace("npu_custom_dist.ProcessGroupHCCL", "c10d.ProcessGroup"))
