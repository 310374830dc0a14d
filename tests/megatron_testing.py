"""A tiny Megatron-Core ``GPTModel`` and its training step, for tests/test_megatron.py and
tests/megatron_worker.py (the 2-rank tensor-parallel runs). Needs megatron-core (``tox -e megatron``)
and :mod:`megatron_shims` installed."""

from __future__ import annotations

from typing import Any

import megatron_shims
import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.pipeline_parallel.schedules import custom_backward, deallocate_output_tensor
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, BATCH = 4, 64, 4, 128, 16, 2
SEED = 1234

Step = tuple[torch.Tensor, dict[str, torch.Tensor]]


def tiny_gpt(tp: int = 1, sequence_parallel: bool = False, post_process: bool = True, dropout: float = 0.1,
             **recompute: Any) -> GPTModel:
    """4 layers, hidden 64, Megatron's local (no Transformer Engine) layer spec, attention and hidden
    ``dropout``, seeded; ``recompute``: Megatron's own recompute fields of ``TransformerConfig``.
    ``post_process=False``: a first pipeline stage (embedding and layers, no output layer)."""
    config = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS, use_cpu_initialization=True,
        attention_dropout=dropout, hidden_dropout=dropout, tensor_model_parallel_size=tp,
        sequence_parallel=sequence_parallel,
        masked_softmax_fusion=False, bias_dropout_fusion=False, bias_activation_fusion=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False, persist_layer_norm=False, **recompute,
    )
    spec = get_gpt_layer_local_spec()
    if sequence_parallel:  # NOTE in megatron_shims: the local spec's norm refuses sequence parallel
        norm = megatron_shims.SequenceParallelLayerNorm
        spec.submodules.input_layernorm = spec.submodules.pre_mlp_layernorm = norm
        spec = TransformerBlockSubmodules(layer_specs=[spec] * LAYERS, layer_norm=norm)
    torch.manual_seed(0)
    return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="learned_absolute", post_process=post_process)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(step))
    return ids, torch.arange(SEQ).expand(BATCH, SEQ)


def steps(model: GPTModel, count: int = 2, tp_rank: int = 0) -> list[Step]:
    """``count`` training steps from Megatron's seeding (the tracker's states and the default
    generator); each returns the loss and every gradient. A first pipeline stage (no output layer)
    sends its output on and frees its data (``deallocate_output_tensor``), then runs backward from
    the next stage's gradient through the C++ engine, as Megatron's schedule does."""
    megatron_shims.seed_tracker(SEED, tp_rank)
    model.train()
    results = []
    for step in range(count):
        model.zero_grad(set_to_none=True)
        ids, positions = batch(step)
        output = model(ids, positions, megatron_shims.causal_mask(SEQ), labels=ids if model.post_process else None)
        if model.post_process:
            loss = output.float().mean()
            loss.backward()
        else:
            loss = output.detach().float().mean()
            grad = torch.randn(output.shape, generator=torch.Generator().manual_seed(100 + step))
            deallocate_output_tensor(output, deallocate_pipeline_outputs=True)
            custom_backward(output, grad)
        results.append((loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()
                                        if p.grad is not None}))
    return results
