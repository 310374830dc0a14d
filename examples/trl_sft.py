"""Supervised fine-tuning with TRL's ``SFTTrainer`` and hyperac's callback (``pip install trl``).

    python examples/trl_sft.py                     # selective recompute, a few steps on the CPU
    python examples/trl_sft.py --mode full --check  # also train without hyperac and compare the losses

``SFTConfig`` turns HF's activation checkpointing on by default (``gradient_checkpointing=True``);
``HyperACCallback`` switches it off when training begins and recomputes with hyperac instead (one
warning says so; pass ``activation_checkpointing=False`` to ``SFTConfig`` to silence it). The model
is built from a config and the tokenizer from a word list; the data is random words (nothing is
downloaded).
"""

from __future__ import annotations

import argparse
import copy
import tempfile

import datasets
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import SFTConfig, SFTTrainer

from hyperac.integrations.transformers import HyperACCallback

WORDS = 120


def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"w{i}": i for i in range(WORDS)} | {"<pad>": WORDS, "<eos>": WORDS + 1, "<unk>": WORDS + 2}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=word_level, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def dataset() -> datasets.Dataset:
    generator = torch.Generator().manual_seed(0)
    texts = [" ".join(f"w{int(t)}" for t in torch.randint(0, WORDS, (24,), generator=generator)) for _ in range(32)]
    return datasets.Dataset.from_dict({"text": texts})


def train(model: torch.nn.Module, steps: int, callbacks: list) -> list[float]:
    with tempfile.TemporaryDirectory() as output_dir:
        args = SFTConfig(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=4, max_length=32,
                         use_cpu=True, report_to=[], logging_steps=1, save_strategy="no", seed=0)
        trainer = SFTTrainer(model=model, args=args, train_dataset=dataset(), processing_class=tokenizer(),
                             callbacks=callbacks)
        trainer.train()
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="selective", choices=["off", "full", "selective", "pointwise"])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--check", action="store_true", help="also train without hyperac and compare losses")
    options = parser.parse_args()

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
                         pad_token_id=WORDS, eos_token_id=WORDS + 1, bos_token_id=None)
    model = LlamaForCausalLM(config)
    reference = copy.deepcopy(model) if options.check else None
    callback = HyperACCallback(mode=options.mode)
    losses = train(model, options.steps, [callback])
    print(callback.plan)
    for step, loss in enumerate(losses):
        print(f"step {step}: loss {loss:.4f}")
    if reference is not None:
        expected = train(reference, options.steps, [])
        print(f"max loss difference without hyperac: {max(abs(a - b) for a, b in zip(losses, expected))}")


if __name__ == "__main__":
    main()
