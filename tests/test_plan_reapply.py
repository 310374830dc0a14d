"""``apply(plan=...)`` applies the recorded plan again, also where the swap chain ends before the
model's last layer (found by tests/test_plan_fuzz.py)."""

from __future__ import annotations

import copy

from hyperac_testing import assert_parity, lm_loss, tiny_llama, train_step

import hyperac
from hyperac.backends.sim import SimBackend

SWAPPING = dict(min_swap_bytes=0, swap_inputs=True)


def test_a_user_plan_whose_swap_chain_ends_early_applies_again_as_it_was():
    """Layers 0-1 in full recompute with their inputs swapped, layer 2 off: layer 0 offloads and
    layer 1, the chain's last, keeps its input (it is recorded as not swapping). Applied again with
    the same options, layer 1 stays the chain's last and layer 2 stays off; before, the model's last
    layer was made the chain's last (as for ``mode="auto"`` plans): layer 1 offloaded too and layer 2
    became ``swap``."""
    model, loss_fn = tiny_llama(num_layers=3), lm_loss(batch=1, seq=8)
    reference = train_step(copy.deepcopy(model), loss_fn)
    first = copy.deepcopy(model)
    plan = hyperac.apply(first, layers={"0-1": "full", "2-": "off"}, backend=SimBackend(), **SWAPPING)
    assert [(layer.mode, layer.swap) for layer in plan.layers] == [("full", True), ("full", False), ("off", False)]
    again = copy.deepcopy(model)
    replayed = hyperac.apply(again, plan=plan.to_dict(), backend=SimBackend(), **SWAPPING)
    assert replayed.layers == plan.layers
    offloaded = []
    for applied in (first, again):
        assert_parity(reference, train_step(applied, loss_fn))
        offloaded.append(hyperac.swap_stats(applied).offloaded_bytes)
    assert offloaded[0] == offloaded[1] > 0
