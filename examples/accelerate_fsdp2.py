"""Train a tiny Llama with accelerate's FSDP2 plugin and hyperac, one process per device.

    accelerate launch --num_processes 2 examples/accelerate_fsdp2.py            # 2 accelerators
    torchrun --nproc_per_node=2 examples/accelerate_fsdp2.py --cpu --mode full   # 2 processes on the CPU

Order: ``hyperac.apply`` on the model first, then ``accelerator.prepare``, which calls
``fully_shard`` on each decoder layer and on the root (hyperac's override sits inside FSDP2's
hooks, so the replay repeats no all-gather). Leave the plugin's ``activation_checkpointing`` off:
hyperac does that part. On the CPU accelerate (1.15) ignores the FSDP plugin and runs its DDP path
(``MULTI_CPU``: it enables FSDP only for accelerator devices); the order of calls is the same.
On a machine without accelerators ``accelerate launch --num_processes 2`` starts one process
(accelerate 1.15 launches several only for GPUs, or for CPUs through an MPI config): use the
torchrun line there. The last line says how many processes ran.
``--check`` also trains an un-applied copy and prints the largest loss difference (0 expected).
The model is built from a config (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import copy

import torch
from accelerate import Accelerator
from accelerate.utils import FullyShardedDataParallelPlugin
from transformers import LlamaConfig, LlamaForCausalLM

import hyperac


def train(model: torch.nn.Module, accelerator: Accelerator, vocab: int, steps: int) -> list[float]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(1 + accelerator.process_index)  # each rank its own data
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (2, 32), generator=generator).to(accelerator.device)
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), reduction="mean").item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="selective", choices=["off", "full", "selective", "pointwise"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU (gloo) even where an accelerator is")
    parser.add_argument("--check", action="store_true", help="also train without hyperac and compare losses")
    options = parser.parse_args()

    plugin = FullyShardedDataParallelPlugin(
        fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["LlamaDecoderLayer"], reshard_after_forward=True,
    )
    accelerator = Accelerator(cpu=options.cpu, fsdp_plugin=plugin)
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    reference = copy.deepcopy(model) if options.check else None

    plan = hyperac.apply(model, mode=options.mode, backend="cpu" if accelerator.device.type == "cpu" else "auto")
    accelerator.print(plan)
    losses = train(model, accelerator, config.vocab_size, options.steps)
    for step, loss in enumerate(losses):
        accelerator.print(f"step {step}: loss {loss:.4f}")
    layer = type(model.model.layers[0]).__name__
    accelerator.print(f"distributed: {accelerator.distributed_type.value}, {accelerator.num_processes} process(es), "
                      f"layers: {layer}")
    if reference is not None:
        expected = train(reference, accelerator, config.vocab_size, options.steps)
        accelerator.print(f"max loss difference without hyperac: {max(abs(a - b) for a, b in zip(losses, expected))}")
    accelerator.end_training()


if __name__ == "__main__":
    main()
