"""Shared helpers for the test suite: tiny models, one training step, parity checks."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import hyperac
from hyperac.measure import measure_step

LossFn = Callable[[nn.Module], torch.Tensor]


def tiny_llama(num_layers: int = 4, **overrides: Any) -> nn.Module:
    """A Llama with hidden size 64, built from a config (nothing downloaded); seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**settings))


def lm_loss(batch: int = 2, seq: int = 32, vocab: int = 128, seed: int = 0) -> LossFn:
    """A loss function feeding fixed random token ids (labels = inputs) to a causal LM."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    return lambda model: model(input_ids=ids, labels=ids).loss


def train_step(model: nn.Module, loss_fn: LossFn, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward from a fixed RNG seed; returns (loss, grads by parameter name)."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(model)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_parity(
    reference: tuple[torch.Tensor, dict[str, torch.Tensor]],
    other: tuple[torch.Tensor, dict[str, torch.Tensor]],
    exact: bool = True,
) -> None:
    """Loss and every gradient equal (bitwise when ``exact``, else tight float32 tolerance)."""
    check = torch.testing.assert_close if not exact else (lambda a, b, **_: torch.testing.assert_close(a, b, rtol=0, atol=0))
    check(other[0], reference[0], rtol=1e-6, atol=1e-6)
    assert other[1].keys() == reference[1].keys(), "a different set of parameters got gradients"
    for name, grad in reference[1].items():
        check(other[1][name], grad, rtol=1e-5, atol=1e-6)


def applied_copy(model: nn.Module, **options: Any) -> tuple[nn.Module, hyperac.Plan]:
    """A deep copy of ``model`` with hyperac applied (the original is untouched)."""
    clone = copy.deepcopy(model)
    return clone, hyperac.apply(clone, **options)


def measure(model: nn.Module, loss_fn: LossFn, seed: int = 1) -> tuple[int, int]:
    """(activation bytes alive when backward starts, forward+backward FLOPs) of one step."""
    model.train()
    torch.manual_seed(seed)
    return measure_step(model, loss_fn)
