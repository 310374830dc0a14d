"""Multi-process scenarios for tests/test_parallel.py: tensor, sequence, expert and pipeline parallel.

Run under torchrun; rank 0 writes one JSON object with a result per case (``--list`` prints them)::

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/parallel_worker.py OUT.json tp ep pp
    python -m torch.distributed.run --standalone --nproc_per_node=4 tests/parallel_worker.py OUT.json fsdp_tp

Groups:

* ``tp``: a tiny HF Llama under DTensor tensor parallel (``ColwiseParallel`` q/k/v/gate/up,
  ``RowwiseParallel`` o/down) and tensor + sequence parallel (``SequenceParallel`` norms,
  ``PrepareModuleInput`` before attention and MLP, embedding and head sharded too), 2 ranks.
* ``fsdp_tp``: the same sequence-parallel plan on the ``tp`` dimension of a (2, 2) mesh, then
  ``fully_shard`` on ``dp``; 4 ranks.
* ``ep``: a MoE layer whose experts are spread over the ranks, tokens dispatched with
  ``all_to_all_single`` (the autograd-aware functional collective, as torchtitan does), 2 ranks.
* ``pp``: a block model split into two ``PipelineStage``s, GPipe and 1F1B, 4 micro-batches.

Every case records ``max_diff`` (loss and full gradients against the un-applied model in one process),
``bitwise`` (against the same parallel setup without hyperac) and, except under pipelining, the
collectives ``CommDebugMode`` counted in forward and in backward. A case that raises records
``error``; the other cases still run.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import re
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from hyperac_testing import tiny_llama
from torch import nn
from worker_driver import Step, main, record

import hyperac

SEQ, VOCAB = 16, 128
SIM_SWAP = dict(mode="swap", backend="sim", min_swap_bytes=0)
RECOMPUTE_MODES = ("full", "selective", "selective-even", "pointwise")


@dataclasses.dataclass(frozen=True)
class Case:
    group: str
    """``tp``, ``fsdp_tp``, ``ep`` or ``pp``."""
    variant: str
    """``tp`` / ``sp`` (tensor parallel alone or with sequence parallel), ``moe``, ``gpipe`` / ``1f1b``."""
    mode: str
    """``off`` (the parallel setup alone: the bitwise baseline) or the options' name."""
    options: dict[str, Any] | None
    apply_after: bool = False
    """Apply hyperac after ``parallelize_module`` instead of before."""

    @property
    def key(self) -> str:
        return f"{self.group}/{self.variant}/{self.mode}" + ("/apply_after" if self.apply_after else "")

    @property
    def baseline(self) -> str:
        return f"{self.group}/{self.variant}/off"


def _modes(group: str, variant: str, modes: tuple[str, ...] = RECOMPUTE_MODES, **options: Any) -> list[Case]:
    return [Case(group, variant, "off", None)] + [Case(group, variant, m, dict(mode=m, **options)) for m in modes]


def _cases() -> list[Case]:
    cases = []
    for variant in ("tp", "sp"):
        cases += _modes("tp", variant)
        cases.append(Case("tp", variant, "selective", dict(mode="selective"), apply_after=True))
    cases += _modes("fsdp_tp", "sp", ("full", "selective"))
    cases += _modes("ep", "moe", ("full", "selective", "pointwise"), layers="blocks")
    for schedule in ("gpipe", "1f1b"):
        cases += _modes("pp", schedule, ("full", "selective"), layers="blocks")
        cases.append(Case("pp", schedule, "swap", dict(SIM_SWAP, layers="blocks")))
    return cases


CASES = _cases()
WORLD = {"tp": 2, "ep": 2, "pp": 2, "fsdp_tp": 4}

def batch(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def full_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
            for n, p in model.named_parameters() if p.grad is not None}


def summary(model: nn.Module, plan: hyperac.Plan | None) -> dict[str, Any]:
    if plan is None:
        return {}
    stats = hyperac.swap_stats(model)
    info: dict[str, Any] = {"plan": [[layer.fqn, layer.mode, layer.swap] for layer in plan.layers]}
    if stats is not None:
        info.update(offloaded_tensors=stats.offloaded_tensors, offloaded_bytes=stats.offloaded_bytes,
                    reloaded_bytes=stats.reloaded_bytes)
    return info


class Collectives:
    """``CommDebugMode`` over forward and backward, split where backward starts.

    One mode spans both phases: its module tracker needs the forward to know the modules backward
    runs through, and a dispatch mode entered only for backward would change the op stream a
    selective recompute replays. ``layer_forward``: the collectives each decoder layer ran in forward.
    """

    def __init__(self) -> None:
        from torch.distributed.tensor.debug import CommDebugMode

        self.mode = CommDebugMode()
        self.forward: dict[str, int] = {}

    def __enter__(self) -> Collectives:
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.mode.__exit__(*exc)

    def forward_done(self) -> None:
        self.forward = _named(self.mode.get_comm_counts())

    def result(self) -> dict[str, Any]:
        total = _named(self.mode.get_comm_counts())
        backward = {op: n - self.forward.get(op, 0) for op, n in total.items() if n - self.forward.get(op, 0)}
        layers = {}
        for name, counts in self.mode.comm_module_counts.items():  # names like "LlamaForCausalLM.model.layers.0"
            if (layer := re.search(r"layers\.\d+$", name)) is not None:
                layers[layer.group()] = _named(counts["forward"])
        return {"forward": self.forward, "backward": backward, "layer_forward": layers}


def track_only_the_module_tree() -> None:
    """Make ``CommDebugMode``'s module tracker skip modules outside the model's tree, in this process.

    torch's tracker registers a forward hook on a module at each of its calls and pops the module
    stack in it. transformers 5.25's ``kernels`` hub functions are modules outside the model's tree
    (one ``apply_rotary_pos_emb`` module called by every attention layer, which calls a private copy
    per layer, all named ``Func``): called more than once per forward, each gains a hook per call and
    pops the stack that many times, so on torch 2.13 and 2.14 ``CommDebugMode`` raises ``IndexError``
    from ``parent_list[-1]`` in the un-applied model too. Skipped, such a module counts as part of the
    module that called it (it runs no collective of its own). Patched on torch's class, not a
    subclass: hyperac leaves torch's objects as they are in a replay (NOTE [Python state in the
    replay]), and would restore a test-defined tracker's bookkeeping.
    """
    from torch.distributed.tensor.debug._comm_mode import _CommModeModuleTracker

    pre, post = _CommModeModuleTracker._fw_pre_hook, _CommModeModuleTracker._fw_post_hook

    def outside(tracker: Any, mod: nn.Module) -> bool:
        return bool(tracker._known_modules) and mod not in tracker._known_modules

    def fw_pre_hook(tracker: Any, mod: nn.Module, input: Any) -> None:
        if not outside(tracker, mod):
            pre(tracker, mod, input)

    def fw_post_hook(tracker: Any, mod: nn.Module, input: Any, output: Any) -> None:
        if not outside(tracker, mod):
            post(tracker, mod, input, output)

    _CommModeModuleTracker._fw_pre_hook, _CommModeModuleTracker._fw_post_hook = fw_pre_hook, fw_post_hook


def _named(counts: dict[Any, int]) -> dict[str, int]:
    return {str(op).rsplit(".", 1)[-1]: n for op, n in counts.items() if n}


# --- tensor and sequence parallel (and 2-D with FSDP2) ------------------------------------------------------


def tiny_tp_llama() -> nn.Module:
    """Two layers, 4 query heads and 2 key/value heads: each splits evenly over two ranks."""
    return tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, vocab_size=VOCAB)


def tensor_parallel(model: nn.Module, mesh: Any, sequence_parallel: bool) -> None:
    """torchtitan's Llama plan on HF's module names.

    With sequence parallel the residual stream between layers is sharded on the sequence dimension
    (``Shard(1)``); HF derives positions from the local length then, so the caller passes
    ``position_ids`` for the whole sequence.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    if sequence_parallel:
        parallelize_module(model, mesh, {
            "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "model.norm": SequenceParallel(),
            "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
        })
    for layer in model.model.layers:
        rowwise = RowwiseParallel(output_layouts=Shard(1)) if sequence_parallel else RowwiseParallel()
        plan: dict[str, Any] = {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": rowwise,
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": rowwise,
        }
        if sequence_parallel:
            plan.update({
                "input_layernorm": SequenceParallel(),
                "post_attention_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                                desired_input_kwarg_layouts={"hidden_states": Replicate()}),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(layer, mesh, plan)


def llama_step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(1)
    return model(input_ids=ids, labels=ids, position_ids=torch.arange(SEQ)[None]).loss


def llama_reference(base: nn.Module, ids: torch.Tensor) -> Step:
    model = copy.deepcopy(base).train()
    loss = llama_step(model, ids)
    loss.backward()
    return loss.detach(), full_grads(model)


def run_tp(case: Case, base: nn.Module, mesh: Any) -> tuple[Step, dict[str, Any]]:
    """Tensor (+ sequence) parallel on a 1-D mesh, or on the ``tp`` dimension of a (dp, tp) mesh and
    ``fully_shard`` on ``dp``. Order: hyperac, parallelize_module, fully_shard (or hyperac after
    parallelize_module with ``apply_after``)."""
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(base)
    two_d = case.group == "fsdp_tp"
    plan = None
    if case.options is not None and not case.apply_after:
        plan = hyperac.apply(model, **case.options)
    tensor_parallel(model, mesh["tp"] if two_d else mesh, case.variant == "sp")
    if case.options is not None and case.apply_after:
        plan = hyperac.apply(model, **case.options)
    if two_d:
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    ids = data_parallel_slice(mesh) if two_d else batch(2)
    model.train()
    with Collectives() as collectives:
        loss = llama_step(model, ids)
        collectives.forward_done()
        loss.backward()
    if two_d:
        loss = loss.detach().clone()
        dist.all_reduce(loss)
        loss /= dist.get_world_size()  # each dp rank's loss appears on its two tp ranks
    info = {"collectives": collectives.result(), **summary(model, plan)}
    return (loss.detach(), full_grads(model)), info


def data_parallel_slice(mesh: Any) -> torch.Tensor:
    rank, size = mesh["dp"].get_local_rank(), mesh["dp"].size()
    return batch(2 * size)[2 * rank:2 * (rank + 1)]


# --- expert parallel -------------------------------------------------------------------------------------


class ExpertParallelMoE(nn.Module):
    """Top-1 mixture of experts; with ``group``, this rank holds ``experts / world`` of them.

    Tokens are sorted by expert, their counts exchanged with ``all_to_all_single``, the tokens sent
    to the rank holding their expert with the autograd-aware ``all_to_all_single_autograd``, run
    through it, and sent back the same way (torchtitan's token dispatch, without its padding).
    """

    def __init__(self, width: int, hidden: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, width, hidden) * width ** -0.5)
        self.w2 = nn.Parameter(torch.randn(experts, hidden, width) * hidden ** -0.5)
        self.experts, self.group = experts, None

    def shard_experts(self, group: Any) -> None:
        """Keep only this rank's experts."""
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        local = self.experts // world
        for name in ("w1", "w2"):
            full = getattr(self, name)
            setattr(self, name, nn.Parameter(full.detach()[rank * local:(rank + 1) * local].clone()))
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.distributed._functional_collectives import all_to_all_single, all_to_all_single_autograd

        tokens = x.reshape(-1, x.shape[-1])
        weight, expert = self.router(tokens).softmax(-1).topk(1, dim=-1)
        expert = expert.squeeze(-1)
        order = expert.argsort(stable=True)
        counts = torch.bincount(expert, minlength=self.experts)
        world = 1 if self.group is None else dist.get_world_size(self.group)
        local = self.experts // world
        if self.group is None:
            received, from_ranks = tokens[order], counts.view(1, local)
        else:
            from_ranks = all_to_all_single(counts, None, None, self.group).view(world, local)
            sent, got = counts.view(world, local).sum(1).tolist(), from_ranks.sum(1).tolist()
            received = all_to_all_single_autograd(tokens[order], got, sent, self.group)
        chunks = received.split(from_ranks.flatten().tolist())
        outputs = [F.gelu(chunk @ self.w1[i % local]) @ self.w2[i % local] for i, chunk in enumerate(chunks)]
        combined = torch.cat(outputs)
        if self.group is not None:
            combined = all_to_all_single_autograd(combined, sent, got, self.group)
        restored = torch.zeros_like(combined).index_copy(0, order, combined)
        return (restored * weight).view_as(x)


class MoEBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.moe = ExpertParallelMoE(width, 2 * width, experts=4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.fc2(F.gelu(self.fc1(self.norm1(x))))
        return x + self.moe(self.norm2(x))


class BlocksModel(nn.Module):
    """Embedding, ``blocks``, norm and head; ``blocks`` is what hyperac finds as the layers."""

    def __init__(self, blocks: list[nn.Module], width: int = 32, embed: bool = True, head: bool = True) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width) if embed else None
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(width) if head else None
        self.head = nn.Linear(width, VOCAB) if head else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def next_token_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def moe_model() -> BlocksModel:
    torch.manual_seed(0)
    return BlocksModel([MoEBlock(32) for _ in range(2)])


def moe_reference(base: nn.Module) -> Step:
    model = copy.deepcopy(base).train()
    ids = batch(4)
    loss = next_token_loss(model(ids), ids)
    loss.backward()
    return loss.detach(), full_grads(model)


def run_ep(case: Case, base: nn.Module) -> tuple[Step, dict[str, Any]]:
    """Experts sharded over the ranks, everything else replicated (its gradients averaged as DDP would);
    each rank trains on its half of the batch."""
    model = copy.deepcopy(base)
    for block in model.blocks:
        block.moe.shard_experts(dist.group.WORLD)
    plan = hyperac.apply(model, **case.options) if case.options is not None else None
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = batch(4)[2 * rank:2 * (rank + 1)]
    model.train()
    with Collectives() as collectives:
        loss = next_token_loss(model(ids), ids) / world  # the global mean is the sum of these
        collectives.forward_done()
        loss.backward()
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad.detach().clone()
        if name.endswith(("moe.w1", "moe.w2")):  # this rank's experts: gather them all
            parts = [torch.empty_like(grad) for _ in range(world)]
            dist.all_gather(parts, grad)
            grad = torch.cat(parts)
        else:
            dist.all_reduce(grad)
        grads[name] = grad
    dist.all_reduce(total := loss.detach().clone())
    return (total, grads), {"collectives": collectives.result(), **summary(model, plan)}


# --- pipeline parallel -----------------------------------------------------------------------------------


MICRO_BATCHES = 4


def pipeline_model() -> BlocksModel:
    from hyperac_testing import TinyBlock

    torch.manual_seed(0)
    return BlocksModel([TinyBlock(32, 4, dropout=0.0) for _ in range(4)])


def pipeline_stage_module(model: BlocksModel, stage: int) -> BlocksModel:
    """Stage 0: embedding and the first two blocks; stage 1: the last two, norm and head."""
    part = BlocksModel([], embed=stage == 0, head=stage == 1)
    if stage == 0:
        part.embed = model.embed
    else:
        part.norm, part.head = model.norm, model.head
    part.blocks = nn.ModuleList(list(model.blocks)[2 * stage:2 * stage + 2])
    return part


def pipeline_ids() -> torch.Tensor:
    return batch(2 * MICRO_BATCHES)


def pipeline_reference(base: nn.Module) -> Step:
    """The unsplit model; with ``scale_grads=False`` a schedule sums the micro-batches' losses."""
    model = copy.deepcopy(base).train()
    loss = sum(next_token_loss(model(ids), ids) for ids in pipeline_ids().chunk(MICRO_BATCHES))
    loss.backward()
    return loss.detach(), full_grads(model)


def run_pp(case: Case, base: nn.Module) -> tuple[Step, dict[str, Any]]:
    """hyperac applied to each stage's own module (its two blocks), then the stage and schedule built."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    rank = dist.get_rank()
    stage_module = pipeline_stage_module(copy.deepcopy(base), rank)
    plan = hyperac.apply(stage_module, **case.options) if case.options is not None else None
    stage_module.train()
    stage = PipelineStage(stage_module, rank, num_stages=2, device=torch.device("cpu"))
    schedule_class = ScheduleGPipe if case.variant == "gpipe" else Schedule1F1B
    schedule = schedule_class(stage, n_microbatches=MICRO_BATCHES, loss_fn=next_token_loss, scale_grads=False)
    ids = pipeline_ids()
    # The first step also runs the stage's metadata inference (a forward of its own); measure the second.
    for _ in range(2):
        stage_module.zero_grad(set_to_none=True)
        if hyperac.swap_stats(stage_module) is not None:
            hyperac.swap_stats(stage_module).reset()
        losses: list[torch.Tensor] = []
        if rank == 0:
            schedule.step(ids)
        else:
            schedule.step(target=ids, losses=losses)
    total = torch.stack(losses).sum() if rank == 1 else torch.zeros(())
    dist.broadcast(total, src=1)
    own = {f"blocks.{2 * rank + int(n.split('.')[1])}.{n.split('.', 2)[2]}" if n.startswith("blocks.") else n: g
           for n, g in full_grads(stage_module).items()}
    parts: list[Any] = [None, None]
    dist.all_gather_object(parts, own)
    grads = dict(sorted({**parts[0], **parts[1]}.items()))
    info = summary(stage_module, plan)
    if plan is not None and info.get("offloaded_tensors"):
        stats = [None, None]
        dist.all_gather_object(stats, [info["offloaded_tensors"], info["offloaded_bytes"], info["reloaded_bytes"]])
        info["stage_swap"] = stats
    return (total, grads), info


# --- driver ----------------------------------------------------------------------------------------------


def run_cases(cases: list[Case]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    results: dict[str, Any] = {}
    steps: dict[str, Step] = {}
    references: dict[str, Step] = {}
    llama = tiny_tp_llama()
    moe, pipeline = moe_model(), pipeline_model()
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")) if world == 4 else init_device_mesh(
        "cpu", (world,))
    reference_of = {
        "tp": lambda: llama_reference(llama, batch(2)), "fsdp_tp": lambda: llama_reference(llama, batch(4)),
        "ep": lambda: moe_reference(moe), "pp": lambda: pipeline_reference(pipeline),
    }
    run_of = {
        "tp": lambda case: run_tp(case, llama, mesh), "fsdp_tp": lambda case: run_tp(case, llama, mesh),
        "ep": lambda case: run_ep(case, moe), "pp": lambda case: run_pp(case, pipeline),
    }

    def run(case: Case) -> tuple[Step, dict[str, Any], Step]:
        if case.group not in references:  # once per group: the references draw no global random numbers
            references[case.group] = reference_of[case.group]()
        return (*run_of[case.group](case), references[case.group])

    for case in cases:
        record(results, steps, case, functools.partial(run, case))
    return results


def run_groups(groups: list[str]) -> dict[str, Any]:
    wrong = sorted({g for g in groups if WORLD[g] != dist.get_world_size()})
    if wrong:
        raise SystemExit(f"groups {wrong} need --nproc_per_node={WORLD[wrong[0]]}")
    return run_cases([case for case in CASES if case.group in groups])


if __name__ == "__main__":
    track_only_the_module_tree()
    main(CASES, run_groups)
