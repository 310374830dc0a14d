"""The language-model head and its token loss, computed and recomputed in chunks of tokens.

Trade-off: the head and the loss keep no logits for backward (one chunk's at a time, in forward and
again in backward) for one more head projection per step (``2 x tokens x hidden x vocabulary`` FLOPs,
3.5% of a Llama-3-8B step at 8,192 tokens by ``hyperac plan``'s count), and the gradients are within
float32 rounding of the un-chunked ones, not bitwise; the loss is bitwise on the CPU (NOTE [The head
and the loss in chunks]). Under ``torch.compile`` they run eagerly, between graphs: a whole-model
graph breaks before the head, and ``fullgraph=True`` of the whole model is refused (NOTE [The chunked
head under torch.compile]).

NOTE [The head and the loss in chunks]
A causal LM's logits are tokens x vocabulary: at 8,192 tokens and Llama-3's 128,256 entries they are
2 GiB in bf16, their float32 upcast for the loss 4 GiB, their gradient as much again, and no layer
plan reaches them. Where hyperac sees both the head and the loss it makes them one region:

* The head (``model.get_output_embeddings()``, a plain ``nn.Linear``) gets an instance forward
  (:class:`ChunkedHeadForward`) that, while grad is enabled, returns :class:`DeferredLogits`: a tensor
  with the logits' shape, dtype and device and no storage, that holds the head's input and weight.
  Element-wise ops with a number (Gemma's final-logit soft-capping ``logits / cap``, ``tanh``,
  ``* cap``; Cohere's and Granite's logit scales; ``.float()``) are recorded on it, not run. Any
  other use (the caller reading ``outputs.logits``, a model that slices its logits) computes the
  logits whole at that moment, with their graph, as without hyperac: that is what returned logits
  cost (one more head projection, and tokens x vocabulary elements held while the caller keeps them).
* The model's loss (``model.loss_function``, an instance attribute HF's property reads first) is
  replaced by :class:`ChunkedLoss`, which, given deferred logits, computes transformers'
  ``ForCausalLMLoss`` (label shift, ``ignore_index``, ``shift_labels``, ``num_items_in_batch``) by
  :class:`_HeadLoss`: per chunk of tokens the head, the recorded ops and the cross-entropy, keeping
  only the hidden states and the targets; in backward each chunk's logits are computed again, their
  gradient taken, and the hidden states' gradient and the head weight's gradient accumulated
  (``addmm`` into one vocabulary x hidden buffer). Given real logits, or labels that do not match
  them, it calls the original. The installed objects are data the model owns (NOTE [Applied state
  is data] in state.py); ``hyperac.remove`` puts the attributes back.

Exactness: each token's loss depends on that token's row only, so chunking keeps it bitwise; the
loss's sum over tokens reproduces ATen's order on the CPU (the cascade of ``nll_loss``'s reduction,
:func:`_cascade_sum`), so the loss is bitwise there too. The head weight's (and bias's) gradient is
a sum over tokens that the chunks split, and the hidden states' gradient a matmul whose blocking
follows the chunk's size: within float32 rounding of the un-chunked ones (bitwise with one chunk).
``Config.bitwise=True`` refuses the head chunked. docs/correctness.md states the measured bound.

Left as they are (``print(plan)`` says which and why): models whose loss is not ``ForCausalLMLoss``,
whose head is not a plain ``nn.Linear``, or whose head has forward hooks of others (an FSDP2
``fully_shard`` of the head alone: its unshard would not be around the chunked reads of its weight;
sharded with the model, as ``tests/distributed_worker.py`` runs it, the head is chunked).

NOTE [The chunked head under torch.compile]
The head, the loss and the tied lookup run eagerly, outside any compiled graph, whatever
``Config.compile`` says: the deferred logits are a wrapper subclass without ``__tensor_flatten__``
whose ops run Python (record, or compute whole), the loss's CPU sum is a numpy loop, and the tied
lookup hands a Python object from forward to backward; none of it traces. Dynamo left to itself
breaks the graph inside them with a warning about ``_make_wrapper_subclass`` and a graph break per
recorded op; so the pieces that make or read deferred logits (:meth:`ChunkedHeadForward.deferred`,
:meth:`ChunkedLoss.deferred`, :meth:`TiedLookupForward.lookup`, ``DeferredLogits.__torch_function__``)
are ``torch.compiler.disable``-d with hyperac's reason, and the decisions around them (grad
enabled? deferred logits?) stay traceable:

* compiled per layer (``layer.compile()``, torchtitan's ``torch.compile(block, fullgraph=True)``):
  the head and the loss are outside the layers' graphs anyway; nothing changes;
* the whole model (``model.compile()``, ``torch.compile(model)``, any backend): one graph break
  before the head (and one around a tied embedding's lookup, and one after the head where the model
  soft-caps its logits); the decoder stack between stays one graph, and the head's projection and
  cross-entropy run eagerly in chunks, as without compile: the loss and the gradients within the
  bound docs/correctness.md states (``tests/test_head_compile.py``). What the break costs: Inductor
  does not fuse the loss into the logits' matmul, which un-chunked it could only do by building the
  logits whole;
* ``fullgraph=True`` on the whole model refuses the break with dynamo's ``Unsupported``, whose
  message is hyperac's reason and fix (compile per layer, without ``fullgraph``, or ``head='off'``);
* without grad (evaluation, generation) the head is the model's own and traces; no break.

A traceable design (a custom op per chunk, the logits' graph output replaced by a stand-in) would
keep the whole model in one graph, but the model returns its logits, which a graph output must
materialise: the deferral is Python, and Python is what a graph break is for.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_map_only

from .errors import HyperACWarning
from .state import AppliedState, Attribute, Override

__all__ = [
    "COMPILED_HEAD_NOTE", "ChunkedHeadForward", "ChunkedLoss", "DeferredLogits", "chunk_tokens", "find_head",
    "install_head", "head_policy", "resolve_head", "unweighed_note",
]

_SELF = object()  # where the deferred tensor sits in a recorded op's arguments
Step = tuple[Callable[..., Any], tuple[Any, ...]]

_ELEMENTWISE = frozenset({
    torch.Tensor.__truediv__, torch.Tensor.div, torch.div, torch.Tensor.__mul__, torch.Tensor.__rmul__,
    torch.Tensor.mul, torch.mul, torch.Tensor.__add__, torch.Tensor.__radd__, torch.Tensor.add, torch.add,
    torch.Tensor.__sub__, torch.Tensor.sub, torch.tanh, torch.Tensor.tanh, torch.Tensor.float,
})
"""Ops recorded on deferred logits (with numbers as their other arguments) and replayed per chunk."""

_METADATA = frozenset({
    torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,  # type: ignore[attr-defined]
    torch.Tensor.ndim.__get__, torch.Tensor.requires_grad.__get__, torch.Tensor.layout.__get__,  # type: ignore[attr-defined]
    torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.is_floating_point,
    torch.Tensor.grad_fn.__get__,  # type: ignore[attr-defined]
}) | frozenset(  # is_leaf, is_meta, is_sparse, and which device type: every is_* property of a tensor
    descriptor.__get__ for name, descriptor in vars(torch._C.TensorBase).items()
    if name.startswith("is_") and inspect.isgetsetdescriptor(descriptor)
)


_outside_graph = torch.compiler.disable(reason=(
    "hyperac: the chunked LM head and its loss (Config.head='chunked') run outside the compiled graph (NOTE "
    "[The chunked head under torch.compile] in hyperac/head.py), so a model applied with them cannot be compiled "
    "with fullgraph=True; compile each decoder layer instead (layer.compile(fullgraph=True), as torchtitan does), "
    "compile the model without fullgraph=True, or apply with head='off'."))


class DeferredLogits(torch.Tensor):
    """The head's logits not computed yet: shape, dtype and device without storage, the head's input
    (``hidden``), ``weight`` and ``bias``, and the element-wise ``steps`` recorded after the head.
    Any use other than a recorded op computes them whole (:meth:`materialize`), once."""

    hidden: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None
    steps: tuple[Step, ...]
    lookup: TiedLookup | None
    value: torch.Tensor | None

    @staticmethod
    def __new__(cls, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                steps: tuple[Step, ...] = (), dtype: torch.dtype | None = None,
                lookup: TiedLookup | None = None) -> DeferredLogits:
        # It reads as not requiring grad, so that hooks which attach to outputs that do (a FLOP counter's
        # module tracker, FSDP's) pass it by instead of computing it; what it computes has its graph.
        self = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, (*hidden.shape[:-1], weight.shape[0]), dtype=dtype or hidden.dtype, device=hidden.device)
        self.hidden, self.weight, self.bias, self.steps, self.lookup = hidden, weight, bias, steps, lookup
        self.value = None
        return self

    def chunk(self, hidden: torch.Tensor) -> torch.Tensor:
        """The logits of the rows ``hidden`` (of this tensor's head input), the recorded ops applied."""
        logits = F.linear(hidden, self.weight, self.bias)
        return replay(self.steps, logits)

    def materialize(self) -> torch.Tensor:
        if self.value is None:
            self.value = self.chunk(self.hidden)
        return self.value

    @classmethod
    @_outside_graph
    def __torch_function__(cls, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        deferred = [a for a in args if isinstance(a, DeferredLogits)]
        if (func in _ELEMENTWISE and not kwargs and len(deferred) == 1 and deferred[0].value is None
                and all(a is deferred[0] or (isinstance(a, (int, float)) and not isinstance(a, bool)) for a in args)):
            source = deferred[0]
            template = tuple(_SELF if a is source else a for a in args)
            probe = func(*(torch.empty(0, dtype=source.dtype, device="meta") if a is _SELF else a for a in template))
            return DeferredLogits(source.hidden, source.weight, source.bias, (*source.steps, (func, template)),
                                  probe.dtype, source.lookup)
        real_args, real_kwargs = tree_map_only(DeferredLogits, lambda d: d.materialize(), (tuple(args), kwargs))
        return func(*real_args, **real_kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        # Reached only by ops that bypass __torch_function__ (every public op goes through it first).
        real_args, real_kwargs = tree_map_only(DeferredLogits, lambda d: d.materialize(), (tuple(args), kwargs or {}))
        return func(*real_args, **real_kwargs)


def replay(steps: tuple[Step, ...], logits: torch.Tensor) -> torch.Tensor:
    for func, template in steps:
        logits = func(*(logits if a is _SELF else a for a in template))
    return logits


MIN_CHUNK = 128
"""The fewest tokens of an automatic chunk: each chunk reads the head weight three times and writes its
gradient once more (vocabulary x hidden each), so chunks of a few tokens spend their time moving the
weight (a 1-token chunk made a step at Qwen2-0.5B's geometry 10x slower on the CPU) and add to the
rounding of its gradient's sum."""


def chunk_tokens(tokens: int, vocab: int, hidden: int, chunk: int | None) -> int:
    """Tokens per chunk: ``chunk`` as given, else a power of two that makes one chunk's logits about
    the size of all the hidden states (``tokens x hidden``), as Liger's fused linear cross-entropy does,
    and at least :data:`MIN_CHUNK`."""
    if chunk is not None:
        return max(1, min(chunk, tokens))
    pieces = max(1, math.ceil(vocab / max(hidden, 1)))
    rows = max(MIN_CHUNK, 1 << max(0, math.ceil(math.log2(max(1, math.ceil(tokens / pieces))))))
    return max(1, min(tokens, rows))


def _cascade_sum(rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """The sum of ``rows[keep]`` in the order of ATen's CPU ``nll_loss`` reduction (a cascade of
    eight levels of partial sums, flushed at multiples of 16 positions; a row it ignores flushes
    nothing), so that a loss summed per chunk is the un-chunked loss bit for bit."""
    import numpy as np  # float32 scalar sums; numpy comes with transformers, whose loss this is

    values = rows.detach().cpu().numpy()
    kept = keep.cpu().numpy()
    levels = 8
    power = max(4, (math.ceil(math.log2(len(values))) if len(values) > 1 else 0) // levels)
    mask = (1 << power) - 1
    partial = [np.float32(0)] * levels
    for b in np.flatnonzero(kept):
        partial[0] = np.float32(partial[0] + values[b])
        for j in range(levels - 1):
            if int(b) & (mask << (j * power)):
                break
            partial[j + 1] = np.float32(partial[j + 1] + partial[j])
            partial[j] = np.float32(0)
    total = np.float32(0)
    for value in partial:
        total = np.float32(total + value)
    return torch.tensor(total, dtype=rows.dtype, device=rows.device)


class _HeadLoss(torch.autograd.Function):
    """The summed token loss of ``chunk(hidden)`` against ``targets``, one chunk of rows at a time;
    backward computes each chunk's logits again (NOTE [The head and the loss in chunks])."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, steps: tuple[Step, ...], chunk: int, ignore_index: int,
                lookup: TiedLookup | None) -> torch.Tensor:
        rows = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            part = slice(start, start + chunk)
            logits = replay(steps, F.linear(hidden[part], weight, bias)).float()
            rows[part] = F.cross_entropy(logits, targets[part], reduction="none", ignore_index=ignore_index)
        # An ignored token's row is 0; elsewhere ATen's own order is not reproduced (within rounding).
        total = _cascade_sum(rows, targets != ignore_index) if hidden.device.type == "cpu" else rows.sum()
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.steps, ctx.chunk, ctx.ignore_index, ctx.lookup = steps, chunk, ignore_index, lookup
        return total

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets = ctx.saved_tensors
        wants_hidden, wants_weight, wants_bias = ctx.needs_input_grad[:3]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        grad_weight: torch.Tensor | None = None
        grad_bias: torch.Tensor | None = None
        for start in range(0, hidden.shape[0], ctx.chunk):
            part = slice(start, start + ctx.chunk)
            rows = hidden[part]
            with torch.no_grad():
                logits = F.linear(rows, weight, bias)
            with torch.enable_grad():
                leaf = logits.detach().requires_grad_()
                loss = F.cross_entropy(replay(ctx.steps, leaf).float(), targets[part], reduction="none",
                                       ignore_index=ctx.ignore_index)
                (grad_logits,) = torch.autograd.grad(loss, leaf, grad.expand(loss.shape))
            if grad_hidden is not None:
                torch.mm(grad_logits, weight, out=grad_hidden[part])
            if wants_weight:  # addmm with out= (not addmm_, which FLOP counters do not see)
                grad_weight = grad_logits.t().mm(rows) if grad_weight is None else torch.addmm(
                    grad_weight, grad_logits.t(), rows, out=grad_weight)
            if wants_bias:
                grad_bias = grad_logits.sum(0) if grad_bias is None else grad_bias.add_(grad_logits.sum(0))
        if ctx.lookup is not None:  # NOTE [The tied embedding's gradient]
            ctx.lookup.gradient = grad_weight
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def chunked_causal_loss(logits: DeferredLogits, labels: torch.Tensor, chunk: int | None,
                        num_items_in_batch: Any = None, ignore_index: int = -100,
                        shift_labels: torch.Tensor | None = None) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` of deferred logits, computed by chunks of ``chunk`` tokens."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    targets = shift_labels.reshape(-1).to(logits.device)
    hidden = logits.hidden.reshape(-1, logits.hidden.shape[-1])
    rows = chunk_tokens(hidden.shape[0], logits.weight.shape[0], hidden.shape[1], chunk)
    total = _HeadLoss.apply(hidden, logits.weight, logits.bias, targets, logits.steps, rows, ignore_index,
                            logits.lookup)
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum().to(total.dtype)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


class ChunkedHeadForward(Override):
    """The head's forward: deferred logits while grad is enabled (NOTE [The head and the loss in
    chunks]); otherwise the head's own forward. ``tied``: the input embedding's lookups, where it
    shares the head's weight."""

    def __init__(self, module: nn.Module, owner: AppliedState, fqn: str, tied: TiedLookups | None) -> None:
        super().__init__(module, owner, fqn)
        self.tied = tied

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        module, call = self.module_and_forward()
        if not torch.is_grad_enabled():
            return call(hidden)  # type: ignore[no-any-return]
        return self.deferred(module, hidden)

    @_outside_graph
    def deferred(self, module: nn.Module, hidden: torch.Tensor) -> DeferredLogits:
        lookup = None
        if self.tied is not None:
            lookup, self.tied.pending = self.tied.pending, None
        return DeferredLogits(hidden, module.weight, module.bias, lookup=lookup)


# NOTE [The tied embedding's gradient]
# An input embedding's backward builds a dense vocabulary x hidden gradient for the few rows it
# touched; where the head shares its weight, autograd then adds it to the head's gradient of the same
# size: two more vocabulary x hidden buffers at the end of backward (519 MiB each at Qwen2-0.5B's
# geometry). With the head chunked, the embedding's lookup (:class:`TiedLookupForward`) hands its
# forward's :class:`TiedLookup` to the head; the head's backward leaves its weight gradient there, and
# the lookup's backward, which autograd runs after it and before the weight's gradient is
# accumulated, adds the rows it touched into that gradient in place (duplicates summed first, in the
# order the dense backward sums them) and returns none of its own. A lookup whose head did not run
# chunked (logits read whole) returns the dense gradient, as without hyperac.


class TiedLookup:
    """One forward's embedding lookup: the head's weight gradient, once the head's backward has run."""

    __slots__ = ("gradient",)

    def __init__(self) -> None:
        self.gradient: torch.Tensor | None = None


class TiedLookups:
    """Shared by the embedding's and the head's forwards: the lookup of the forward running now."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: TiedLookup | None = None


class _TiedEmbedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None,
                lookup: TiedLookup) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.lookup, ctx.rows = padding_idx, lookup, weight.shape[0]
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (ids,) = ctx.saved_tensors
        gradient, ctx.lookup.gradient = ctx.lookup.gradient, None  # no reference left: autograd steals it
        if gradient is None or not ctx.needs_input_grad[1]:
            padding = -1 if ctx.padding_idx is None else ctx.padding_idx
            dense = torch.ops.aten.embedding_backward(grad, ids, ctx.rows, padding, False, False)
            return None, dense if ctx.needs_input_grad[1] else None, None, None
        flat, rows = ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:
            keep = flat != ctx.padding_idx
            flat, rows = flat[keep], rows[keep]
        if flat.device.type == "meta":  # no values to find the touched rows by
            gradient.index_add_(0, flat, rows.to(gradient.dtype))
            return None, None, None, None
        touched, where = torch.unique(flat, return_inverse=True)
        sums = rows.new_zeros(len(touched), rows.shape[1]).index_add_(0, where, rows)
        gradient.index_add_(0, touched, sums.to(gradient.dtype))
        return None, None, None, None


class TiedLookupForward(Override):
    """The tied input embedding's forward (NOTE [The tied embedding's gradient])."""

    def __init__(self, module: nn.Module, owner: AppliedState, fqn: str, tied: TiedLookups) -> None:
        super().__init__(module, owner, fqn)
        self.tied = tied

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        module, call = self.module_and_forward()
        if not (torch.is_grad_enabled() and module.weight.requires_grad):
            return call(ids)  # type: ignore[no-any-return]
        return self.lookup(module, ids)

    @_outside_graph
    def lookup(self, module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        self.tied.pending = TiedLookup()
        return _TiedEmbedding.apply(ids, module.weight, module.padding_idx, self.tied.pending)  # type: ignore[no-any-return]


class ChunkedLoss(Attribute):
    """The model's ``loss_function`` (an instance attribute): chunked for deferred logits, else the
    original (``original``: the attribute found at apply, or ``None`` for HF's own property)."""

    def __init__(self, model: nn.Module, owner: AppliedState, fqn: str, chunk: int | None) -> None:
        self.owner, self.fqn, self.chunk = owner, fqn, chunk
        self.original = model.__dict__.get("_loss_function")
        self.loss = model.loss_function

    def install(self, model: nn.Module) -> None:
        model.__dict__["_loss_function"] = self

    def restore(self, model: nn.Module) -> None:
        if self.original is None:
            del model.__dict__["_loss_function"]
        else:
            model.__dict__["_loss_function"] = self.original

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None,
                 num_items_in_batch: Any = None, ignore_index: int = -100, shift_labels: torch.Tensor | None = None,
                 **kwargs: Any) -> torch.Tensor:
        if isinstance(logits, DeferredLogits):
            return self.deferred(logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs)
        return self.loss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,  # type: ignore[no-any-return]
                         ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)

    @_outside_graph
    def deferred(self, logits: DeferredLogits, labels: torch.Tensor, vocab_size: int | None, num_items_in_batch: Any,
                 ignore_index: int, shift_labels: torch.Tensor | None, **kwargs: Any) -> torch.Tensor:
        targets = labels if shift_labels is None else shift_labels
        if logits.value is None and targets.shape == logits.shape[:-1]:
            return chunked_causal_loss(logits, labels, self.chunk, num_items_in_batch, ignore_index, shift_labels)
        return self.loss(logits, labels, vocab_size, num_items_in_batch=num_items_in_batch,  # type: ignore[no-any-return]
                         ignore_index=ignore_index, shift_labels=shift_labels, **kwargs)


def find_head(modules: list[tuple[str, nn.Module]]) -> tuple[str, nn.Module, str, nn.Module] | str:
    """The first causal LM whose head and loss hyperac can chunk: (its name, it, the head's name, the
    head); else why none can be (for ``print(plan)``)."""
    reasons = []
    for name, module in modules:
        label = name or type(module).__name__
        loss_type = getattr(module, "loss_type", None)
        if not isinstance(loss_type, str) or not hasattr(module, "get_output_embeddings"):
            continue
        head = module.get_output_embeddings()
        loss = module.loss_function if loss_type == "ForCausalLM" else None
        if getattr(loss, "__name__", None) != "ForCausalLMLoss" or not _forward_calls_loss(module):
            reasons.append(f"{label} computes a {loss_type} loss, not transformers' ForCausalLMLoss through "
                           "self.loss_function")
        elif type(head) is not nn.Linear:
            reasons.append(f"{label}'s head is a {type(head).__name__}, not a plain nn.Linear")
        elif head._forward_hooks or head._forward_pre_hooks or "forward" in head.__dict__:
            reasons.append(f"{label}'s head has hooks or a forward of its own (FSDP2?), which chunked reads of its "
                           "weight would bypass")
        else:
            return name, module, next(n for n, m in modules if m is head), head
    return "; ".join(reasons) or "no module computes its loss from labels inside forward (an HF model's loss_function)"


def _forward_calls_loss(module: nn.Module) -> bool:
    try:
        return "self.loss_function(" in inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False



def resolve_head(wanted: str, modules: list[tuple[str, nn.Module]], notes: list[str]
                 ) -> tuple[str, tuple[str, nn.Module, str, nn.Module] | None]:
    """``wanted`` (``"off"``, ``"chunked"``, or ``"auto"`` where the planner kept the head as it is) as
    it can be applied: ``"off"`` with a note where no loss is visible to hyperac."""
    if wanted not in ("chunked", "auto"):
        return "off", None
    found = find_head(modules)
    if isinstance(found, str):
        message = f"Config.head={wanted!r} left the head and the loss as they are: {found}."
        warnings.warn(message, HyperACWarning, stacklevel=4)
        notes.append(message)
        return "off", None
    return ("chunked", found) if wanted == "chunked" else ("off", None)


COMPILED_HEAD_NOTE = ("under torch.compile: the chunked head and loss run eagerly between the compiled graphs (a "
                      "whole-model graph breaks before the head; NOTE [The chunked head under torch.compile])")
"""The plan note of a ``compile=True`` apply with the head chunked."""


def head_policy(config: Any, modules: list[tuple[str, nn.Module]]) -> str | None:
    """How ``mode="auto"`` plans the head (NOTE [The head in the plan] in planner/head.py): ``None``, as
    without a head option (the head ``"off"``, results bitwise, plans per length bucket, or
    a loss hyperac cannot see); ``"chunked"`` where the user named it; ``"weigh"`` for ``head="auto"``;
    else ``"fallback"``: the head as it is unless only chunking it meets the budget."""
    if (config.head == "off" or config.bitwise or config.max_seq_len is not None
            or isinstance(find_head(modules), str)):
        return None
    return {"chunked": "chunked", "auto": "weigh"}.get(config.head, "fallback")


def unweighed_note(config: Any, modules: list[tuple[str, nn.Module]]) -> str | None:
    """Why ``head="auto"`` keeps the head as the model computes it where ``mode="auto"`` plans without
    weighing it (with ``max_seq_len``; NOTE [The head in the plan] in planner/head.py), for
    ``print(plan)``; ``None`` elsewhere."""
    if config.head != "auto" or config.max_seq_len is None or isinstance(find_head(modules), str):
        return None
    return ("Config.head='auto' kept the head and the loss as the model computes them: mode='auto' with "
            "max_seq_len= (plans per length bucket) does not weigh the chunked head yet; head='chunked' plans the "
            "layers with them chunked.")


def install_head(found: tuple[str, nn.Module, str, nn.Module], state: AppliedState, chunk: int | None) -> None:
    """Install the chunked head and loss on the causal LM ``found`` (from :func:`find_head`)."""
    name, model, head_name, head = found
    ChunkedLoss(model, state, name, chunk).install(model)
    embedding = model.get_input_embeddings()
    tied = None
    if (type(embedding) is nn.Embedding and embedding.weight is head.weight and embedding.max_norm is None
            and not embedding.scale_grad_by_freq and not embedding.sparse and "forward" not in embedding.__dict__
            and not (embedding._forward_hooks or embedding._forward_pre_hooks)):
        tied = TiedLookups()
        fqn = next(n for n, m in model.named_modules() if m is embedding)
        TiedLookupForward(embedding, state, f"{name}.{fqn}" if name else fqn, tied).install()
    ChunkedHeadForward(head, state, head_name, tied).install()
