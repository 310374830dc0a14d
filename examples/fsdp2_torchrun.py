"""Train a tiny Llama with FSDP2 (``fully_shard``) and hyperac, one process per device.

    torchrun --nproc_per_node=2 examples/fsdp2_torchrun.py                  # CPU (gloo) works too
    torchrun --nproc_per_node=2 examples/fsdp2_torchrun.py --mode full --steps 10

The order matters only for readability, not for correctness: apply hyperac first, then shard.
hyperac overrides each layer's ``forward`` inside the module's ``__call__``, so FSDP2's
unshard/reshard hooks stay outside the recompute and the replay in backward repeats no
all-gather. (Sharding first works too: ``fully_shard`` swaps each layer's class to
``FSDP<Layer>``, a subclass, and hyperac still finds the layers.)

The model is built from a config (nothing is downloaded); about 15 s on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import hyperac


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="selective", choices=["off", "full", "selective", "pointwise", "swap"])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--cpu", action="store_true", help="stay on the CPU (gloo) even where an accelerator is")
    options = parser.parse_args()

    use_accelerator = torch.accelerator.is_available() and not options.cpu
    device = torch.accelerator.current_accelerator() if use_accelerator else torch.device("cpu")
    if use_accelerator:
        torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group()  # picks gloo for CPU and the accelerator's collective library otherwise
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    model = LlamaForCausalLM(config).to(device)

    # 1. hyperac first: it changes each layer's forward in place (names and keys stay as they are).
    plan = hyperac.apply(model, mode=options.mode, backend="cpu" if device.type == "cpu" else "auto")
    # 2. then shard: every decoder layer, then the root.
    mesh = init_device_mesh(device.type, (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if rank == 0:
        print(plan, flush=True)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1 + rank)  # each rank its own data
    for step in range(options.steps):
        ids = torch.randint(0, config.vocab_size, (2, 32), generator=generator).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"step {step}: loss {total.item() / world:.4f}", flush=True)

    hyperac.remove(model)  # the model trains on exactly as before
    # Free what holds the collectives' work objects (FSDP2's state, the optimizer's sharded tensors)
    # while the group is alive, and leave together: a gloo rank that exits while its peer still
    # finishes its last collective, or whose work objects die with the interpreter, can abort at exit.
    del model, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
