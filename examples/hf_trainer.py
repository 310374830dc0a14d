"""Fine-tune a tiny Llama with HF's Trainer and hyperac's callback, then reload the checkpoint without hyperac.

    python examples/hf_trainer.py                          # selective recompute, 10 steps on the CPU
    python examples/hf_trainer.py --mode full --steps 20
    python examples/hf_trainer.py --activation-checkpointing   # HF's flag, turned into a hyperac plan

``HyperACCallback`` applies hyperac when training begins and removes it when training ends;
options it is not given come from the TrainingArguments (``activation_checkpointing`` becomes a
plan, ``torch_compile`` sets ``compile=True``, the model's device picks the backend). The model is
built from a config and the data is random token ids (nothing is downloaded); about 10 s on 2 CPU
cores.
"""

from __future__ import annotations

import argparse
import logging
import pathlib
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from hyperac.integrations.transformers import HyperACCallback


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default=None, choices=["off", "full", "selective", "pointwise", "swap"],
                        help="hyperac mode (default: selective, or what --activation-checkpointing asks for)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--activation-checkpointing", action="store_true",
                        help="set TrainingArguments.activation_checkpointing=True (hyperac replaces HF's)")
    parser.add_argument("--output-dir", default=None, help="where checkpoints go (default: a temporary folder)")
    options = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("hyperac").setLevel(logging.INFO)  # one line when applied, one when removed

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    model = LlamaForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (64, 32), generator=generator)]

    with tempfile.TemporaryDirectory() as scratch:
        output_dir = pathlib.Path(options.output_dir or scratch)
        args = TrainingArguments(
            output_dir=str(output_dir), max_steps=options.steps, per_device_train_batch_size=4, learning_rate=1e-3,
            logging_steps=1, save_strategy="steps", save_steps=options.steps, report_to="none", use_cpu=True,
            disable_tqdm=True, activation_checkpointing=options.activation_checkpointing,
        )
        hyperac_options = {"mode": options.mode} if options.mode else {}
        if not options.mode and not options.activation_checkpointing:
            hyperac_options["mode"] = "selective"
        callback = HyperACCallback(**hyperac_options)
        trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
        trainer.train()
        print(callback.plan)
        losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
        print("losses:", " ".join(f"{loss:.4f}" for loss in losses))

        # The checkpoint loads into a model that never saw hyperac: same keys, same values.
        checkpoint = output_dir / f"checkpoint-{options.steps}"
        reloaded = LlamaForCausalLM.from_pretrained(checkpoint)
        trained = model.state_dict()
        assert list(reloaded.state_dict()) == list(trained)
        assert all(torch.equal(value, trained[name]) for name, value in reloaded.state_dict().items())
        print(f"reloaded {checkpoint.name} without hyperac: {len(trained)} tensors, keys and values equal")


if __name__ == "__main__":
    main()
