"""The selective modes keep attention only where it costs at least as many FLOPs per kept byte as the
layer's matmuls (NOTE [Attention kept by its cost per byte] in policy.py).

A tiny HF Llama (hidden 64, 4 heads of 16 channels): an attention output element costs about
``4 * seq`` FLOPs, a projection's ``2 * 64``. At 16 tokens attention is the cheaper buy and is
recomputed; at 64 it is kept. The reference keeps attention by naming it in ``save_ops`` with the
matmuls, which hyperac's list otherwise equals on this model. ``compile=True`` layers decide alike.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hyperac_testing import applied_copy, assert_parity, lm_loss, measure, tiny_llama, train_step

import hyperac
from hyperac.measure import flop_counter
from hyperac.planner.lengths import fitted_estimates, truncated

LAYERS, BATCH, HEADS, HEAD_DIM = 2, 2, 4, 16
KEEPS_ATTENTION = ("aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu")


def attention_flops(seq: int) -> int:
    """FLOPs of one causal attention forward of the model's shape, as the flop counter counts them."""
    query = torch.randn(BATCH, HEADS, seq, HEAD_DIM)
    with flop_counter() as counter:
        F.scaled_dot_product_attention(query, query, query, is_causal=True)
    return counter.get_total_flops()


@pytest.mark.parametrize("mode", ["selective", "selective-even"])
def test_short_sequences_recompute_attention_and_keep_less(mode):
    seq = 16
    model, loss = tiny_llama(num_layers=LAYERS), lm_loss(batch=BATCH, seq=seq)
    reference = train_step(model, loss)
    applied, _ = applied_copy(model, mode=mode, backend="cpu")
    keeping, _ = applied_copy(model, mode=mode, backend="cpu", save_ops=KEEPS_ATTENTION)
    kept, flops = measure(applied, loss)
    kept_with_attention, flops_with_attention = measure(keeping, loss)
    output_and_logsumexp = BATCH * HEADS * seq * (HEAD_DIM + 1) * 4
    assert kept_with_attention - kept == LAYERS * output_and_logsumexp
    assert flops - flops_with_attention == LAYERS * attention_flops(seq) > 0
    assert_parity(reference, train_step(applied, loss))


def test_long_sequences_keep_attention_in_a_projections_place():
    """At 64 tokens attention is kept, in the place of the next projection the alternation keeps
    (``gate_proj``, the 5th matmul: NOTE [Attention kept in a matmul's place]): the layer keeps less
    than the alternation alone and than the alternation with attention on top, and replays exactly
    ``gate_proj`` more than the latter."""
    seq, intermediate = 64, 128
    model, loss = tiny_llama(num_layers=LAYERS), lm_loss(batch=BATCH, seq=seq)
    reference = train_step(model, loss)
    applied, _ = applied_copy(model, mode="selective", backend="cpu")
    keeping, _ = applied_copy(model, mode="selective", backend="cpu", save_ops=KEEPS_ATTENTION)
    alternating, _ = applied_copy(model, mode="selective", backend="cpu", save_ops=["aten::mm"])
    kept, flops = measure(applied, loss)
    kept_with_attention, flops_with_attention = measure(keeping, loss)
    gate_bytes, gate_flops = BATCH * seq * intermediate * 4, 2 * BATCH * seq * HEADS * HEAD_DIM * intermediate
    assert kept_with_attention - kept == LAYERS * gate_bytes
    assert flops - flops_with_attention == LAYERS * gate_flops
    assert kept < measure(alternating, loss)[0]
    assert_parity(reference, train_step(applied, loss))


def test_pointwise_keeps_attention_at_any_length():
    model, loss = tiny_llama(num_layers=LAYERS), lm_loss(batch=BATCH, seq=16)
    applied, _ = applied_copy(model, mode="pointwise", backend="cpu")
    keeping, _ = applied_copy(model, mode="pointwise", backend="cpu",
                              save_ops=KEEPS_ATTENTION)
    assert measure(applied, loss) == measure(keeping, loss)


def test_compiled_layers_recompute_attention_as_eager_ones_do():
    """The rule reads only shapes, so ``compile=True`` layers decide as eager ones (FLOPs equal)."""
    model, loss = tiny_llama(num_layers=LAYERS), lm_loss(batch=BATCH, seq=16)
    eager, _ = applied_copy(model, mode="selective", backend="cpu")
    compiled, _ = applied_copy(model, mode="selective", backend="cpu", compile=True)
    for layer in compiled.model.layers:
        layer.compile(backend="aot_eager")
    keeping, _ = applied_copy(model, mode="selective", backend="cpu", save_ops=KEEPS_ATTENTION)
    flops = measure(eager, loss)[1]
    assert measure(compiled, loss)[1] == flops == measure(keeping, loss)[1] + LAYERS * attention_flops(16)


def test_a_plan_for_a_longer_length_weighs_attention_at_that_length():
    """``max_seq_len=128`` planned from a 16-token sample (profiled at 8 and 16 tokens, where attention
    alone would be recomputed): each layer's selective bytes at 128 are those estimated at 128
    directly, where attention is kept, not a fit that leaves its output out."""
    model = tiny_llama(num_layers=LAYERS)
    ids = torch.randint(0, 128, (BATCH, 128), generator=torch.Generator().manual_seed(0))

    def estimate_at(length, timed=False):
        sample = truncated({"input_ids": ids, "labels": ids}, 1, length)
        return hyperac.estimate(model, sample, backend="cpu")

    (fitted,) = fitted_estimates(estimate_at, 16, [128])
    direct = estimate_at(128)
    for mode in ("selective", "selective-even"):
        assert [fit.kept_bytes[mode] for fit in fitted.layers] == [at.kept_bytes[mode] for at in direct.layers]
