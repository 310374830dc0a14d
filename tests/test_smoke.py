"""The core promise on the smallest real model: same gradients, less memory, one call to undo."""

import pytest
from hyperac_testing import applied_copy, assert_parity, lm_loss, measure, tiny_llama, train_step

import hyperac


@pytest.mark.parametrize("mode", ["off", "full", "selective"])
def test_llama_gradients_bitwise_equal_with_dropout(mode):
    model = tiny_llama(attention_dropout=0.2)
    loss_fn = lm_loss()
    reference = train_step(model, loss_fn)
    applied, _ = applied_copy(model, mode=mode, backend="cpu")
    assert_parity(reference, train_step(applied, loss_fn))
    hyperac.remove(applied)
    assert_parity(reference, train_step(applied, loss_fn))


def test_recompute_trades_bytes_for_flops():
    model = tiny_llama()
    loss_fn = lm_loss()
    results = {}
    for mode in ("off", "selective", "full"):
        applied, _ = applied_copy(model, mode=mode, backend="cpu")
        results[mode] = measure(applied, loss_fn)
    assert results["full"][0] < results["selective"][0] < results["off"][0]
    assert results["full"][1] > results["selective"][1] > results["off"][1]
