"""DeepSpeed ZeRO-2 and ZeRO-3 with hyperac, two CPU ranks over gloo, for tests/test_deepspeed.py.

Run under torchrun (two ranks, ``DS_ACCELERATOR=cpu``, which this file sets); rank 0 writes one JSON
object with a result per case of :data:`CASES` (``python tests/deepspeed_worker.py --list`` prints their keys)::

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/deepspeed_worker.py OUT.json [engine] \
        [trainer] [planned]

``engine`` cases train two steps of a tiny Llama (full fine-tuning, or LoRA through peft) with
``deepspeed.initialize`` and SGD, ZeRO-3 partitioning every parameter (``stage3_param_persistence_threshold=0``)
so every sub-module's hooks gather and release; the second step runs with the coordinator's prefetching
trace. Each case's losses and second-step full gradients (``safe_get_full_grad``) are compared with the
same steps of the un-applied model without DeepSpeed in one process (``max_diff``, gradients averaged
over the ranks) and, bitwise, with the same DeepSpeed setup without hyperac. hyperac is applied to the
model before ``initialize`` or to the engine's module after it; ``zero_init`` builds the model under
``deepspeed.zero.Init``. ``trainer`` cases train the same model with HF's ``Trainer(deepspeed=...)`` and
``HyperACCallback``, compared bitwise (losses and the gathered weights after training) with the Trainer
run without the callback.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402
from hyperac_testing import tiny_llama  # noqa: E402
from torch import nn  # noqa: E402
from worker_driver import Step, main, record  # noqa: E402

import hyperac  # noqa: E402

SEQ, PER_RANK, WORLD, LR = 16, 2, 2, 0.1
ENGINE_LR = 0.0
"""The engine cases' SGD learning rate: both steps see the same weights (DeepSpeed's SGD step is not torch's to
the bit), while ZeRO-3's second step still prefetches from the trace its first recorded."""
MODES: dict[str, dict[str, Any]] = {
    "full": dict(mode="full"),
    "selective": dict(mode="selective"),
    "selective-even": dict(mode="selective-even"),
    "pointwise": dict(mode="pointwise"),
    "swap": dict(mode="swap", backend="sim", min_swap_bytes=0),  # tiny tensors: swap them all
    "auto": dict(mode="auto", budget=0.75),  # sample= is the rank's batch
}


@dataclasses.dataclass(frozen=True)
class Case:
    group: str
    """``engine`` (``deepspeed.initialize``) or ``trainer`` (HF ``Trainer(deepspeed=...)``)."""
    stage: int
    tuning: str
    """``full`` (every parameter trained) or ``lora`` (peft adapters on a frozen model)."""
    variant: str
    """``off`` (DeepSpeed alone: the bitwise baseline) or a key of :data:`MODES`."""
    order: str = "before"
    """``before`` (hyperac, then ``deepspeed.initialize``) or ``after`` (hyperac on ``engine.module``)."""
    zero_init: bool = False
    """The model is built under ``deepspeed.zero.Init`` (partitioned as it is built)."""

    @property
    def planned_by_ranks(self) -> bool:
        """``auto`` profiling a ZeRO-3 engine's module (after ``initialize``, as the Trainer's callback does):
        its profiled steps run ZeRO-3's all-gathers, so every rank must profile as many steps as the others
        (issue 34's one plan per job). Run in a launch of their own (``planned``): a rank that profiles a
        step fewer leaves the other waiting in a collective until gloo's timeout."""
        return self.stage == 3 and self.variant == "auto" and self.order == "after"

    @property
    def launch(self) -> str:
        return "planned" if self.planned_by_ranks else self.group

    @property
    def options(self) -> dict[str, Any] | None:
        return None if self.variant == "off" else MODES[self.variant]

    @property
    def key(self) -> str:
        setup = f"zero{self.stage}" + ("-init" if self.zero_init else "")
        suffix = "" if self.variant == "off" else f"/{self.order}"
        return f"{self.group}/{setup}/{self.tuning}/{self.variant}{suffix}"

    @property
    def baseline(self) -> str:
        return dataclasses.replace(self, variant="off", order="before").key


def _cases() -> list[Case]:
    cases = []
    for stage in (2, 3):
        for tuning in ("full", "lora"):
            cases.append(Case("engine", stage, tuning, "off"))
            cases += [Case("engine", stage, tuning, variant, order)
                      for order in ("before", "after") for variant in MODES]
    cases.append(Case("engine", 3, "full", "off", zero_init=True))
    cases += [Case("engine", 3, "full", variant, order, zero_init=True)
              for order in ("before", "after") for variant in ("full", "selective")]
    cases.append(Case("engine", 3, "full", "auto", "after", zero_init=True))  # a zero.Init model runs once initialized
    for stage in (2, 3):
        cases.append(Case("trainer", stage, "full", "off"))
        cases += [Case("trainer", stage, "full", variant, "after") for variant in ("selective", "auto")]
    cases.append(Case("trainer", 3, "lora", "off"))
    cases.append(Case("trainer", 3, "lora", "selective", "after"))  # the callback applies to the engine's module
    return cases


CASES = _cases()


# --- models and references -----------------------------------------------------------------------


def build(tuning: str) -> nn.Module:
    model = tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64)
    if tuning == "lora":
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(0)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1,
                                                 target_modules=["q_proj", "v_proj", "gate_proj"]))
    return model


def batch(rank: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 128, (PER_RANK, SEQ), generator=torch.Generator().manual_seed(rank))
    return {"input_ids": ids, "labels": ids}


def ds_config(stage: int) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:  # partition every parameter, however small, so every sub-module gathers and releases
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=2048,
                    stage3_max_live_parameters=4096)
    return {"train_micro_batch_size_per_gpu": PER_RANK, "gradient_accumulation_steps": 1,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 1000}


def reference(base: nn.Module) -> Step:
    """The two steps of the un-applied model without DeepSpeed: this rank's losses, and the second step's
    gradients averaged over the ranks, as data parallel averages them."""
    model = copy.deepcopy(base)
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=ENGINE_LR)
    losses = []
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        torch.manual_seed(1 + step)
        loss = model(**batch(dist.get_rank())).loss
        loss.backward()
        for param in model.parameters():
            if param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad /= dist.get_world_size()
        losses.append(loss.detach())
        if step == 0:
            optimizer.step()
    return torch.stack(losses), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def plan_summary(plan: hyperac.Plan | None) -> dict[str, Any]:
    return {} if plan is None else {"plan": [[layer.fqn, layer.mode] for layer in plan.layers]}


def options_for(case: Case) -> dict[str, Any]:
    options = dict(case.options or {})
    if options.get("mode") == "auto":
        options["sample"] = batch(dist.get_rank())
    return options


# --- deepspeed.initialize ------------------------------------------------------------------------


def built_under_zero_init(case: Case, base: nn.Module) -> nn.Module:
    """The model built under ``zero.Init`` (partitioned as each module is built), then given ``base``'s weights."""
    with deepspeed.zero.Init(config_dict_or_path=ds_config(case.stage)):
        model = build(case.tuning)
    weights = dict(base.named_parameters())
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            if dist.get_rank() == 0:
                param.data.copy_(weights[name].data)
    return model


def run_engine(case: Case, base: nn.Module) -> tuple[Step, dict[str, Any]]:
    model = built_under_zero_init(case, base) if case.zero_init else copy.deepcopy(base)
    plan = None
    if case.options is not None and case.order == "before":
        plan = hyperac.apply(model, **options_for(case))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=ENGINE_LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(case.stage))
    if case.options is not None and case.order == "after":
        plan = hyperac.apply(engine.module, **options_for(case))
    engine.train()
    losses = []
    for step in range(2):
        torch.manual_seed(1 + step)
        loss = engine(**batch(dist.get_rank())).loss
        engine.backward(loss)
        losses.append(loss.detach())
        if step == 0:
            engine.step()
    grads = {name: safe_get_full_grad(param).clone() for name, param in engine.module.named_parameters()
             if param.requires_grad}
    engine.destroy()
    return (torch.stack(losses), grads), plan_summary(plan)


# --- HF Trainer ----------------------------------------------------------------------------------


def run_trainer(case: Case, base: nn.Module) -> tuple[Step, dict[str, Any]]:
    from transformers import Trainer, TrainingArguments

    from hyperac.integrations.transformers import HyperACCallback

    model = copy.deepcopy(base)
    callbacks = [] if case.options is None else [HyperACCallback(**options_for(case))]
    data = [batch(rank) for rank in range(WORLD)]
    dataset = [{"input_ids": ids, "labels": ids} for sample in data for ids in sample["input_ids"]]
    with tempfile.TemporaryDirectory() as folder:
        args = TrainingArguments(
            output_dir=folder, max_steps=2, per_device_train_batch_size=PER_RANK, learning_rate=LR,
            logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, seed=0, disable_tqdm=True,
            dataloader_num_workers=0, deepspeed=ds_config(case.stage), optim="sgd",
        )
        trainer = Trainer(model=model, args=args, train_dataset=dataset, callbacks=callbacks)
        trainer.train()
    losses = torch.tensor([entry["loss"] for entry in trainer.state.log_history if "loss" in entry])
    engine = trainer.model_wrapped
    params = [param for param in engine.module.parameters()]
    with deepspeed.zero.GatheredParameters(params):
        weights = {name: param.detach().clone() for name, param in engine.module.named_parameters()}
    applied = hyperac.applied_plan(engine.module)
    info = {"applied_after_train": applied is not None, "losses": losses.tolist()}
    engine.destroy()
    return (losses, weights), info


# --- driver --------------------------------------------------------------------------------------


def run_cases(cases: list[Case]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    steps: dict[str, Step] = {}
    bases: dict[str, nn.Module] = {}
    references: dict[str, Step] = {}
    for case in cases:
        if case.tuning not in bases:
            bases[case.tuning] = build(case.tuning)
            references[case.tuning] = reference(bases[case.tuning])

        def run(case: Case = case) -> tuple[Step, dict[str, Any], Step]:
            if case.group == "engine":
                return (*run_engine(case, bases[case.tuning]), references[case.tuning])
            step, info = run_trainer(case, bases[case.tuning])
            return step, info, steps.get(case.baseline, step)

        record(results, steps, case, run)
    return results


def run_groups(groups: list[str]) -> dict[str, Any]:
    if dist.get_world_size() != WORLD:
        raise SystemExit(f"run with --nproc_per_node={WORLD}")
    chosen = set(groups or ("engine", "trainer", "planned"))
    selected = {case.key for case in CASES if case.launch in chosen or case.key in chosen}
    selected |= {case.baseline for case in CASES if case.key in selected}
    return run_cases([case for case in CASES if case.key in selected])


if __name__ == "__main__":
    main(CASES, run_groups)
