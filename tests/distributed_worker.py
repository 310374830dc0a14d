"""Multi-process scenarios for tests/test_distributed.py: FSDP2, FSDP1, expert parallelism and DDP on CPU
with gloo.

Run under torchrun (two ranks); rank 0 writes one JSON object with a result per case of
:data:`CASES` (``python tests/distributed_worker.py --list`` prints their keys)::

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/distributed_worker.py OUT.json [GROUP...]

(groups: ``fsdp``, ``fsdp1``, ``ep``, ``ddp``; all of them where none is named).

Every case trains one step of a tiny model (2 layers, width 32, 16 tokens, 2 sequences per rank)
and is compared with two references computed in the same processes: the un-applied model on the
global batch in one process (``max_diff``: the largest absolute difference of the loss and of any
full gradient, gathered with ``DTensor.full_tensor()`` under FSDP2), and the same parallel wrapper
without hyperac (``bitwise``). A case that raises records ``error`` and the others still run (both
ranks run the same code on the same model, so they fail alike).
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import types
from typing import Any

import torch
import torch.distributed as dist
from hyperac_testing import Stack, tiny_llama, tiny_qwen2_moe
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from worker_driver import Step, main, record

import hyperac

SEQ, PER_RANK, WORLD = 16, 2, 2
SIM_SWAP = dict(backend="sim", min_swap_bytes=0)  # tiny tensors: swap them all
OPTIONS: dict[str, dict[str, Any] | None] = {
    "off": None,  # the wrapper alone: the bitwise baseline of the other cases
    "full": dict(mode="full"),
    "selective": dict(mode="selective"),
    "plan": dict(mode="off", layers={0: "full", 1: "selective"}),
    "swap": dict(mode="swap", **SIM_SWAP),
    "full_swap_inputs": dict(mode="full", swap_inputs=True, **SIM_SWAP),
    # The chunked head (hyperac/head.py) in one chunk: bitwise, so the case holds it to the wrapper alone.
    "full_head_chunked": dict(mode="full", head="chunked", head_chunk=1 << 20),
}


FSDP1_OPTIONS: dict[str, dict[str, Any] | None] = {
    "off": None,
    **{mode: dict(mode=mode) for mode in ("full", "selective", "selective-even", "pointwise")},
    "auto": dict(mode="auto", budget=0.75),  # sample= is the rank's batch
}


@dataclasses.dataclass(frozen=True)
class Case:
    wrapper: str
    """``fsdp`` (``fully_shard`` on each layer, then on the model), ``fsdp1`` (``FullyShardedDataParallel``
    with an ``auto_wrap_policy``: units inside the layers), ``ep`` (expert parallelism: each rank holds some
    experts of each layer) or ``ddp``."""
    model: str
    """``llama``, ``qwen2_moe`` or ``reused`` (a Llama running ``layers[0]`` twice)."""
    variant: str
    """A key of :data:`OPTIONS`, or one of those with a suffix naming what else differs."""
    options: dict[str, Any] | None
    order: str = "apply_first"
    """``apply_first`` (hyperac, then the wrapper), ``shard_first`` / ``wrap_first`` (the other order)."""
    find_unused: bool = False
    static_graph: bool = False
    reentrant: bool = False
    """Instead of hyperac: torch's reentrant checkpoint around each layer (the failure hyperac avoids)."""
    hf_recompute: bool = False
    """Instead of hyperac: HF's ``activation_checkpointing_enable()`` (all-gather counts to compare)."""
    inner: bool = False
    """``fully_shard`` on each Linear inside the layers too: their unshard and reshard hooks run inside the
    recompute regions (NOTE [Parameter lifecycles are not the layer's program] in hyperac/lifecycle.py)."""
    expect_error: str | None = None
    units: str = ""
    """FSDP1's wrap units (``fsdp1``): ``linear`` (each Linear and each layer), ``mlp_attn`` (each MLP,
    attention and layer), ``linear_only`` (each Linear, not the layer), ``layer`` (each layer)."""
    orig_params: bool = True
    """FSDP1's ``use_orig_params``."""

    @property
    def key(self) -> str:
        suffix = f"/find_unused={self.find_unused}" if self.wrapper == "ddp" else ""
        if self.wrapper == "fsdp1":
            suffix = f"/{self.units}/orig_params={self.orig_params}"
        return f"{self.wrapper}/{self.model}/{self.variant}{suffix}"

    @property
    def baseline(self) -> str:
        return dataclasses.replace(self, variant="inner_off" if self.inner else "off").key


def _cases() -> list[Case]:
    cases = []
    for model in ("llama", "qwen2_moe"):
        cases += [Case("fsdp", model, name, options) for name, options in OPTIONS.items()]
        cases += [Case("fsdp", model, f"{name}_shard_first", OPTIONS[name], order="shard_first")
                  for name in ("full", "selective")]
    cases.append(Case("fsdp", "llama", "hf_activation_checkpointing", None, hf_recompute=True))
    cases += [Case("fsdp", "llama", f"inner_{name}", OPTIONS[name], inner=True)
              for name in ("off", "full", "selective", "swap")]
    cases.append(Case("fsdp", "llama", "inner_pointwise_shard_first", dict(mode="pointwise"), order="shard_first",
                      inner=True))
    # FSDP1 units inside each layer: its wrapper's forward gathers and releases the unit's flat parameter
    # around the unit's own (NOTE [Parameter lifecycles are not the layer's program] in hyperac/lifecycle.py).
    every_mode = ("off", "full", "selective", "selective-even", "pointwise", "auto")
    for orig_params in (True, False):
        cases += [Case("fsdp1", "llama", mode, FSDP1_OPTIONS[mode], units="linear", orig_params=orig_params)
                  for mode in every_mode]
    cases += [Case("fsdp1", "llama", mode, FSDP1_OPTIONS[mode], units="mlp_attn") for mode in ("off", "selective")]
    cases += [Case("fsdp1", "llama", mode, FSDP1_OPTIONS[mode], units="linear_only", orig_params=False,
                   order="shard_first" if mode != "off" else "apply_first") for mode in ("off", "pointwise")]
    # hyperac applied to the wrapped model: FSDP1 shards the layers too, and hyperac recomputes inside its units
    cases += [Case("fsdp1", "llama", "selective_shard_first", FSDP1_OPTIONS["selective"], units="linear",
                   orig_params=orig_params, order="shard_first") for orig_params in (True, False)]
    cases += [Case("fsdp1", "llama", name, FSDP1_OPTIONS[name.removesuffix("_shard_first")], units="layer",
                   order="shard_first") for name in ("off", "selective_shard_first")]
    # A layer whose replay runs other ops than its forward (state out of hyperac's reach): the error names FSDP1
    cases.append(Case("fsdp1", "llama", "selective_diverging", FSDP1_OPTIONS["selective"], units="linear",
                      expect_error="parameter hooks of torch.distributed.fsdp"))
    # Expert parallelism under router noise hyperac cannot replay: the replay's split sizes must be the forward's.
    cases += [Case("ep", "moe", mode, None if mode == "off" else dict(mode=mode), units="experts")
              for mode in ("off", "full", "selective", "selective-even", "pointwise", "auto")]
    double_use = "mark a variable ready only once"
    for model in ("llama", "reused"):
        for find_unused in (False, True):
            cases += [Case("ddp", model, name, OPTIONS[name], find_unused=find_unused)
                      for name in ("off", "full", "selective", "plan", "swap")]
            cases.append(Case("ddp", model, "full_wrap_first", OPTIONS["full"], order="wrap_first",
                              find_unused=find_unused))
            # Reentrant recompute runs one backward per region: a parameter reached by two of them
            # (a layer called twice), or any parameter once find_unused_parameters traverses the graph,
            # is marked ready twice.
            fails = model == "reused" or find_unused
            cases.append(Case("ddp", model, "reentrant_checkpoint", None, find_unused=find_unused, reentrant=True,
                              expect_error=double_use if fails else None))
        cases.append(Case("ddp", model, "full_static_graph", OPTIONS["full"], static_graph=True))
    return cases


CASES = _cases()


# --- models and references -----------------------------------------------------------------------


def reused_llama() -> nn.Module:
    """A tiny Llama whose decoder runs ``layers[0]`` twice: ``layers = [l0, l1, l0]``."""
    model = tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64)
    first, second = model.model.layers
    model.model.layers = nn.ModuleList([first, second, first])
    model.config.num_hidden_layers = 3
    # With a KV cache the second call of layers[0] would attend to the keys its first call appended;
    # train without one, as hyperac does, the reference included.
    model.config.use_cache = False
    return model


def build(name: str) -> nn.Module:
    if name == "llama":
        return tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64)
    if name == "qwen2_moe":
        return tiny_qwen2_moe(num_layers=2)
    if name == "reused":
        return reused_llama()
    if name == "moe":
        return Stack(ExpertParallelMoe)
    raise ValueError(name)


def distinct_layers(model: nn.Module) -> list[nn.Module]:
    return list({id(m): m for m in model.model.layers}.values())


def global_batch() -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, 128, (PER_RANK * WORLD, SEQ), generator=generator)


def local_batch() -> torch.Tensor:
    rank = dist.get_rank()
    return global_batch()[rank * PER_RANK:(rank + 1) * PER_RANK]


def reference(base: nn.Module) -> Step:
    """One step of the un-applied model on the global batch, in this process alone."""
    model = copy.deepcopy(base)
    model.train()
    torch.manual_seed(1)
    ids = global_batch()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def averaged_loss(loss: torch.Tensor) -> torch.Tensor:
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / dist.get_world_size()


def applied_summary(model: nn.Module, plan: hyperac.Plan | None) -> dict[str, Any]:
    if plan is None:
        return {}
    stats = hyperac.swap_stats(model)
    return {"plan": [[layer.fqn, layer.mode, layer.swap] for layer in plan.layers],
            "offloaded_tensors": 0 if stats is None else stats.offloaded_tensors}


# --- FSDP2 ---------------------------------------------------------------------------------------


class GatherCounter:
    """Counts FSDP2 all-gathers per sharded module, split into forward and backward.

    Wraps ``FSDPParamGroup.unshard`` and counts the calls that start an all-gather (those that find
    the parameters sharded and no all-gather pending).
    """

    def __init__(self) -> None:
        self.phase = "forward"
        self.counts = {"forward": collections.Counter(), "backward": collections.Counter()}

    @contextlib.contextmanager
    def installed(self):
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        original = FSDPParamGroup.unshard

        def unshard(group: Any, async_op: bool = False) -> None:
            before = group._all_gather_result
            original(group, async_op)
            if before is None and group._all_gather_result is not None:
                self.counts[self.phase][group._module_fqn or "<root>"] += 1

        FSDPParamGroup.unshard = unshard
        try:
            yield self
        finally:
            FSDPParamGroup.unshard = original

    def summary(self) -> dict[str, dict[str, int]]:
        return {phase: dict(sorted(counts.items())) for phase, counts in self.counts.items()}


def run_fsdp(case: Case, base: nn.Module) -> tuple[Step, dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = copy.deepcopy(base)
    if case.hf_recompute:
        model.activation_checkpointing_enable()
    plan = None
    if case.options is not None and case.order == "apply_first":
        plan = hyperac.apply(model, **case.options)
    for layer in distinct_layers(model):
        for module in layer.modules() if case.inner else ():
            if isinstance(module, nn.Linear):
                fully_shard(module, mesh=mesh)
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if case.options is not None and case.order == "shard_first":
        plan = hyperac.apply(model, **case.options)  # the layers' classes are FSDP<Layer> by now
    model.train()
    torch.manual_seed(1)
    ids = local_batch()
    with GatherCounter().installed() as gathers:
        loss = model(input_ids=ids, labels=ids).loss
        gathers.phase = "backward"
        loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None}
    info = {
        "gathers": gathers.summary(),
        "layer_classes": sorted({type(layer).__name__ for layer in distinct_layers(model)}),
        "sharded": all(isinstance(layer, FSDPModule) for layer in distinct_layers(model)),
        **applied_summary(model, plan),
    }
    if plan is not None:
        hyperac.remove(model)
        info["forward_restored"] = all("forward" not in m.__dict__ for m in model.modules())
    return (averaged_loss(loss), grads), info


# --- FSDP1 ---------------------------------------------------------------------------------------


def fsdp1_units(units: str) -> Any:
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    return ModuleWrapPolicy({"linear": {nn.Linear, LlamaDecoderLayer}, "linear_only": {nn.Linear},
                             "mlp_attn": {LlamaMLP, LlamaAttention, LlamaDecoderLayer},
                             "layer": {LlamaDecoderLayer}}[units])


def fsdp1_full_grads(model: nn.Module, orig_params: bool) -> dict[str, torch.Tensor]:
    """Every parameter's full gradient, by its name in the un-wrapped model: from ``summon_full_params`` with
    ``use_orig_params``, else gathered from the flat parameters' shards (which FSDP1 cannot summon)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp._common_utils import clean_tensor_name

    if orig_params:
        with FullyShardedDataParallel.summon_full_params(model, with_grads=True):
            return {clean_tensor_name(n): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads = {}
    for name, flat in model.named_parameters():
        shards = [torch.empty_like(flat.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(shards, flat.grad)
        pieces = torch.cat(shards)[:sum(flat._numels)].split(flat._numels)
        prefix = clean_tensor_name(name).removesuffix("_flat_param")
        grads.update((prefix + fqn, piece.view(shape)) for fqn, piece, shape in zip(flat._fqns, pieces, flat._shapes))
    return grads


FIRST_CALL = [True]
"""Whether ``diverge``'s module runs its first call (module level: out of the replay's Python-state snapshot)."""


def diverge(module: nn.Module) -> None:
    """Make ``module``'s first call run one op more than its later ones (its replay)."""
    def forward(x: torch.Tensor, _original: Any = module.forward) -> torch.Tensor:
        if FIRST_CALL[0]:
            FIRST_CALL[0] = False
            x = x * 1
        return _original(x)

    FIRST_CALL[0] = True
    module.forward = forward


def run_fsdp1(case: Case, base: nn.Module) -> tuple[Step, dict[str, Any]]:
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = copy.deepcopy(base)
    ids = local_batch()
    options = case.options
    if options is not None and options["mode"] == "auto":
        options = dict(options, sample=dict(input_ids=ids, labels=ids))
    plan = None
    if case.expect_error is not None:
        diverge(model.model.layers[0].mlp)
    if options is not None and case.order == "apply_first":
        plan = hyperac.apply(model, **options)
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=fsdp1_units(case.units),
                                       use_orig_params=case.orig_params, device_id=torch.device("cpu"))
    if options is not None and case.order == "shard_first":
        plan = hyperac.apply(wrapped, **options)
    wrapped.train()
    torch.manual_seed(1)
    with AllGathers() as gathers:
        loss = wrapped(input_ids=ids, labels=ids).loss
        gathers.phase = "backward"
        loss.backward()
    info = {"gathers": gathers.counts, **applied_summary(model, plan)}
    return (averaged_loss(loss), fsdp1_full_grads(wrapped, case.orig_params)), info


class AllGathers(TorchDispatchMode):
    """Counts the all-gathers a step runs, in forward and in backward (a replay that returned a kept all-gather
    instead of running it runs fewer)."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.counts = {"forward": 0, "backward": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "allgather" in func.name():
            self.counts[self.phase] += 1
        return func(*args, **(kwargs or {}))


# --- expert parallelism --------------------------------------------------------------------------

EP_NOISE = torch.Generator()
"""The routers' noise: module level, so no replay restores it, as a GPU's replay computes other last bits
(tests/test_routing.py)."""
EP_SPLITS: dict[int, list[list[int]]] = {}
"""Layer id -> the split sizes it sent per call, forward then replays (module level, as ``EP_NOISE``)."""
EP_TOKENS, EP_WIDTH, EP_LOCAL = 32, 16, 2  # tokens per rank, width, experts per rank


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with autograd: the gradient goes back with the split sizes swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        ctx.splits = send, receive
        out = x.new_empty(sum(receive), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), receive, send)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        send, receive = ctx.splits
        out = grad.new_empty(sum(send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), send, receive)
        return out, None, None


class ExpertParallelMoe(nn.Module):
    """A top-1 MoE layer with ``EP_LOCAL`` experts on each rank: noisy router scores (``EP_NOISE``), ``argmax``,
    tokens sorted by expert (``argsort``), counts per expert (``bincount``) exchanged with ``all_to_all_single``,
    and the tokens sent to their experts' ranks and back with split sizes from ``.tolist()`` of the counts."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(EP_WIDTH)
        self.router = nn.Linear(EP_WIDTH, EP_LOCAL * WORLD)
        self.experts = nn.ModuleList(nn.Linear(EP_WIDTH, EP_WIDTH) for _ in range(EP_LOCAL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        scores = self.router(h)
        expert = (scores + 0.5 * torch.randn(scores.shape, generator=EP_NOISE)).argmax(-1)  # noise decides routes only
        order = expert.argsort(stable=True)
        counts = torch.bincount(expert, minlength=EP_LOCAL * WORLD)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts)  # per source rank, the counts of this rank's experts
        send = counts.view(WORLD, EP_LOCAL).sum(1).tolist()
        receive = received_counts.view(WORLD, EP_LOCAL).sum(1).tolist()
        EP_SPLITS.setdefault(id(self), []).append(send + receive)
        tokens = _AllToAll.apply(h[order], send, receive)
        pieces = tokens.split(received_counts.tolist())  # source rank by source rank, expert by expert
        done = torch.cat([self.experts[i % EP_LOCAL](piece) for i, piece in enumerate(pieces)])
        back = _AllToAll.apply(done, receive, send)
        out = torch.empty_like(back).index_copy(0, order, back)
        gate = scores.softmax(-1).gather(-1, expert[:, None])
        return x + out * gate


def run_ep(case: Case, base: nn.Module) -> tuple[Step, dict[str, Any]]:
    model = copy.deepcopy(base)
    x = torch.randn(EP_TOKENS, EP_WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    plan = None
    if case.options is not None:
        sample = (lambda model: model(x).sum()) if case.options["mode"] == "auto" else None
        plan = hyperac.apply(model, **case.options, layers="blocks", backend="cpu", sample=sample,
                             **({"budget": 0.75} if sample else {}))
    EP_SPLITS.clear()
    EP_NOISE.manual_seed(dist.get_rank())
    loss = model(x.requires_grad_()).sum()
    loss.backward()
    grads = {}
    for name, parameter in model.named_parameters():  # every rank's, so rank 0 compares them all
        shards = [torch.empty_like(parameter.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(shards, parameter.grad)
        grads.update((f"{name}@{rank}", shard) for rank, shard in enumerate(shards))
    splits = list(EP_SPLITS.values())
    info = {"calls": [len(calls) for calls in splits],
            "splits_match": all(sent == calls[0] for calls in splits for sent in calls), **applied_summary(model, plan)}
    return (averaged_loss(loss), grads), info


# --- DDP -----------------------------------------------------------------------------------------


def reentrant_recompute(model: nn.Module) -> None:
    """Wrap each distinct layer's forward in torch's reentrant checkpoint (``use_reentrant=True``)."""
    from torch.utils.checkpoint import checkpoint

    model.config.use_cache = False  # a replay must not see the keys its forward appended to a KV cache
    for layer in distinct_layers(model):
        def forward(self, *args, _original=layer.forward, **kwargs):
            return checkpoint(functools.partial(_original, **kwargs), *args, use_reentrant=True)

        layer.forward = types.MethodType(forward, layer)


def run_ddp(case: Case, base: nn.Module) -> tuple[Step, dict[str, Any]]:
    from torch.nn.parallel import DistributedDataParallel

    model = copy.deepcopy(base)
    plan = None
    if case.options is not None and case.order == "apply_first":
        plan = hyperac.apply(model, **case.options)
    if case.reentrant:
        reentrant_recompute(model)
    ddp = DistributedDataParallel(model, find_unused_parameters=case.find_unused, static_graph=case.static_graph)
    if case.options is not None and case.order == "wrap_first":
        plan = hyperac.apply(ddp.module, **case.options)
    ddp.train()
    ids = local_batch()
    for _ in range(2 if case.static_graph else 1):  # static_graph records the graph in its first step
        ddp.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return (averaged_loss(loss), grads), applied_summary(model, plan)


# --- driver --------------------------------------------------------------------------------------


def run_cases(cases: list[Case]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    steps: dict[str, Step] = {}
    references: dict[str, Step] = {}
    bases: dict[str, nn.Module] = {}
    for case in cases:
        if case.model not in bases:
            bases[case.model] = build(case.model)
            # expert parallelism runs on every rank: its reference is the step without hyperac
            references[case.model] = (run_ep(dataclasses.replace(case, options=None), bases[case.model])[0]
                                       if case.wrapper == "ep" else reference(bases[case.model]))
        run = {"fsdp": run_fsdp, "fsdp1": run_fsdp1, "ddp": run_ddp, "ep": run_ep}[case.wrapper]
        record(results, steps, case, lambda case=case, run=run: (*run(case, bases[case.model]), references[case.model]))
    return results


def run_groups(groups: list[str]) -> dict[str, Any]:
    if dist.get_world_size() != WORLD:
        raise SystemExit(f"run with --nproc_per_node={WORLD}")
    wrappers = set(groups or ("fsdp", "fsdp1", "ep", "ddp"))
    return run_cases([case for case in CASES if case.wrapper in wrappers])


if __name__ == "__main__":
    main(CASES, run_groups)
