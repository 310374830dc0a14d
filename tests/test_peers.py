"""hyperac.peers: the torchtitan and HF reference configurations keep the model's loss and
gradients (bitwise, CPU fp32, no dropout: NOTE [Peers and RNG]), recompute what they claim
(FLOPs over the un-applied model, proven with hyperac.measure.flop_counter, and fewer bytes kept
for backward), and refuse a model they cannot change before changing it."""

from __future__ import annotations

import copy

import pytest
from hyperac_testing import (
    assert_parity,
    lm_loss,
    measure,
    next_token_loss,
    tiny_blocks_model,
    tiny_llama,
    train_step,
)

from hyperac import peers
from hyperac.errors import UnsupportedModelError

PEERS = {
    "titan full": peers.apply_titan_full,
    "titan selective": peers.apply_titan_selective,
    "hf": peers.apply_hf_checkpointing,
    "hf every 2": lambda model: peers.apply_hf_checkpointing(model, every_n_layers=2),
}


def unwrapped(result):
    """Gradients by parameter name without checkpoint_wrapper's segment, to compare by name."""
    loss, grads = result
    return loss, {name.replace("._checkpoint_wrapped_module", ""): grad for name, grad in grads.items()}


@pytest.fixture(scope="module")
def llama():
    model = tiny_llama(num_layers=4)
    model.train()
    loss_fn = lm_loss()
    return model, loss_fn, train_step(copy.deepcopy(model), loss_fn), measure(copy.deepcopy(model), loss_fn)


@pytest.fixture(scope="module")
def applied(llama):
    model, loss_fn, _, _ = llama
    results = {}
    for name, setup in PEERS.items():
        clone = copy.deepcopy(model)
        setup(clone)
        results[name] = (unwrapped(train_step(clone, loss_fn)), measure(clone, loss_fn))
    return results


@pytest.mark.parametrize("name", PEERS)
def test_peer_keeps_loss_and_gradients_bitwise(llama, applied, name):
    _, _, reference, _ = llama
    assert_parity(reference, applied[name][0])


@pytest.mark.parametrize("name", PEERS)
def test_peer_recomputes(llama, applied, name):
    _, _, _, (off_bytes, off_flops) = llama
    kept, flops = applied[name][1]
    assert flops > off_flops
    assert kept < off_bytes


def test_peers_recompute_what_they_claim(applied):
    """Selective and every-second-layer recompute less than full; full is the same work either way."""
    flops = {name: result[1][1] for name, result in applied.items()}
    assert flops["titan selective"] < flops["titan full"] == flops["hf"]
    assert flops["hf every 2"] < flops["hf"]


def test_titan_peers_on_a_plain_torch_model():
    """The layers come from hyperac's discovery (ModuleList ``blocks``), not a Llama path."""
    model = tiny_blocks_model(dropout=0.0)
    model.train()
    loss_fn = next_token_loss()
    reference = train_step(copy.deepcopy(model), loss_fn)
    _, off_flops = measure(copy.deepcopy(model), loss_fn)
    for setup in (peers.apply_titan_full, peers.apply_titan_selective):
        clone = copy.deepcopy(model)
        setup(clone)
        assert type(clone.blocks[0]).__name__ == "CheckpointWrapper"
        assert_parity(reference, unwrapped(train_step(clone, loss_fn)))
        assert measure(clone, loss_fn)[1] > off_flops


def test_hf_peer_refuses_a_model_without_hf_checkpointing():
    model = tiny_blocks_model()
    with pytest.raises(UnsupportedModelError, match=r"TinyBlocksModel has no activation_checkpointing_enable\(\)"):
        peers.apply_hf_checkpointing(model)


def test_titan_peer_refuses_wrapped_layers_and_models_without_layers():
    model = tiny_llama(num_layers=2)
    peers.apply_titan_full(model)
    with pytest.raises(UnsupportedModelError, match=r"already has recompute wrappers around \['model\.layers\.0'"):
        peers.apply_titan_selective(model)
    with pytest.raises(UnsupportedModelError, match="found no repeated layers"):
        peers.apply_titan_full(copy.deepcopy(model.lm_head))
