"""``apply`` on a model built on the ``meta`` device, the way a model too large for one device is
applied before it is sharded (docs/stacks/fsdp2-ddp.md, Large models): build on meta, apply, then
``to_empty``, fill the buffers that are no weights (``init_weights``: the rotary frequencies) and load
the weights. It trains bit for bit as the un-applied model, in ``full`` and ``selective`` and from a
plan file, with attention dropout on (the replay draws the forward's masks)."""

from __future__ import annotations

import json

import pytest
import torch
from hyperac_testing import assert_parity, lm_loss, tiny_llama, train_step

import hyperac
from hyperac.measure import flop_counter

DROPOUT = dict(attention_dropout=0.1)


@pytest.fixture(scope="module")
def weights():
    return tiny_llama(**DROPOUT).state_dict()


@pytest.fixture(scope="module")
def reference(weights, loss_fn):
    model = tiny_llama(**DROPOUT)
    model.load_state_dict(weights)
    return train_step(model, loss_fn)


@pytest.fixture(scope="module")
def loss_fn():
    return lm_loss()


def built_on_meta():
    with torch.device("meta"):
        return tiny_llama(**DROPOUT)


def loaded(model, weights):
    model.to_empty(device="cpu")
    model.init_weights()  # the non-persistent buffers: no checkpoint holds them
    model.load_state_dict(weights)
    return model


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_applied_on_meta_then_loaded_trains_as_the_unapplied_model(weights, reference, loss_fn, mode):
    model = built_on_meta()
    plan = hyperac.apply(model, mode=mode)
    assert next(model.parameters()).device.type == "meta" and plan.count(mode) == 4
    loaded(model, weights)
    assert_parity(reference, train_step(model, loss_fn))
    with flop_counter() as replayed:  # counted apart: attention under a dispatch mode differs in the last bits
        train_step(model, loss_fn)
    hyperac.remove(model)
    assert_parity(reference, train_step(model, loss_fn))
    with flop_counter() as bare:
        train_step(model, loss_fn)
    assert replayed.get_total_flops() > bare.get_total_flops()  # the layers recompute in backward


def test_a_plan_file_applies_on_meta(weights, reference, loss_fn, tmp_path):
    model = tiny_llama(**DROPOUT)
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(hyperac.apply(model, mode="off", layers={"0-1": "full", "2-": "selective"}).to_dict()))
    hyperac.remove(model)
    meta = built_on_meta()
    plan = hyperac.apply(meta, plan=json.loads(path.read_text()))
    assert [layer.mode for layer in plan.layers] == ["full", "full", "selective", "selective"]
    assert_parity(reference, train_step(loaded(meta, weights), loss_fn))
