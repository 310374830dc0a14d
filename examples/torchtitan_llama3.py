"""Train torchtitan's llama3 debug model with hyperac as its activation-recompute step, on the CPU.

    pip install 'torch==2.14.1' 'torchtitan==0.3.0' -e .   # in a venv of their own (tox -e torchtitan)
    python examples/torchtitan_llama3.py                       # hyperac selective, 4 steps
    python examples/torchtitan_llama3.py --check               # and torchtitan's SelectiveAC, and no AC

torchtitan's ``parallelize_llama`` (the model's ``parallelize_fn``) applies tensor parallel, then
the ``ac_config`` it is given, then ``fully_shard``; ``HyperACRecompute.Config`` is such an
``ac_config``, so in a torchtitan training config it goes where ``SelectiveAC.Config()`` goes::

    config.activation_checkpoint = HyperACRecompute.Config(mode="selective")

torchtitan's ``Trainer`` itself needs an accelerator (it falls back to ``"cuda"`` as its device
type), so this script runs what the trainer runs around the model by hand: the debug model built
on the meta device, ``parallelize_llama`` on a one-rank gloo mesh (the mesh's device type set to
``cpu``), ``init_weights``, AdamW steps on random tokens. FlexAttention has no backward on the
CPU, so the script swaps each block's inner attention for torchtitan's causal SDPA module (the
same for every run it compares). Sequence length 64 keeps it to seconds.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchtitan.distributed.parallel_dims as parallel_dims_module
from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import SelectiveAC
from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry
from torchtitan.protocols.model_spec import ModelSpec

import hyperac
from hyperac.integrations.torchtitan import HyperACRecompute

SEQ, BATCH = 64, 2


def cpu_debug_model() -> ModelSpec:
    """The llama3 debug model with causal SDPA in place of FlexAttention (no backward on the CPU)."""
    spec = model_registry("debugmodel")
    for _, _, parent, field in list(spec.model.traverse(FlexAttention.Config)):
        setattr(parent, field, ScaledDotProductAttention.Config())
    return spec


def train(ac_config, steps: int) -> list[float]:
    spec = cpu_debug_model()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = spec.model.build()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=dist.get_world_size())
    model = spec.parallelize_fn(model, parallel_dims=dims, training=TrainingConfig(), parallelism=ParallelismConfig(),
                                compile_config=CompileConfig(), ac_config=ac_config, dump_folder="")
    if ac_config is not None and hyperac.applied_plan(model) is not None:
        print(hyperac.applied_plan(model).summary(), "|", type(model.layers["0"]).__name__)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=8e-4)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, spec.model.vocab_size, (BATCH, SEQ + 1), generator=generator)
        logits = model(tokens[:, :-1], positions=torch.arange(SEQ).expand(BATCH, SEQ))
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="selective", choices=["full", "selective", "pointwise", "swap"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--check", action="store_true", help="also train with torchtitan's SelectiveAC and no AC")
    options = parser.parse_args()

    parallel_dims_module.device_type = "cpu"  # torchtitan falls back to "cuda" where no accelerator is
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # torchtitan builds meshes
    try:
        runs = {f"hyperac {options.mode}": HyperACRecompute.Config(mode=options.mode, backend="cpu")}
        if options.check:
            runs.update({"torchtitan SelectiveAC": SelectiveAC.Config(), "no AC": None})
        results = {name: train(ac_config, options.steps) for name, ac_config in runs.items()}
        for name, losses in results.items():
            print(f"{name:24s} " + " ".join(f"{loss:.6f}" for loss in losses))
        if options.check:
            reference = results["no AC"]
            difference = max(abs(a - b) for losses in results.values() for a, b in zip(losses, reference))
            print(f"max loss difference: {difference}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
