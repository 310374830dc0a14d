"""Plans per length bucket at the edges of what apply installs (NOTE [Plans per length bucket] in
hyperac/length_switch.py): a module a region excludes, a layer already wrapped by another
checkpoint, ``force_recompute`` with buckets that have no selective layer, malformed buckets, and the
container a prefix profile (planner/prefix.py) cuts short. Each plan is written by hand, so the
buckets are known without the planner's timing."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hyperac_testing import Stack
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

import hyperac
from hyperac.adapters import Adapter
from hyperac.discovery import Layer
from hyperac.plan import LengthBucket, Plan
from hyperac.planner.prefix import prefix_only
from hyperac.recompute import RecomputedForward


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.d = nn.Linear(8, 8), nn.Linear(8, 8), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.d(torch.relu(self.a(x))))


def bucketed(plan: Plan, *modes: tuple[str, ...]) -> Plan:
    """``plan`` with buckets at 8, 16, ... running ``modes`` (the last also its layers')."""
    layers = tuple(dataclasses.replace(layer, mode=mode) for layer, mode in zip(plan.layers, modes[-1]))
    return dataclasses.replace(plan, layers=layers, max_seq_len=8 * len(modes), seq_dim=1,
                               buckets=tuple(LengthBucket(8 * (k + 1), m) for k, m in enumerate(modes)))


def test_an_excluded_module_replays_from_its_record_after_a_switch():
    """A full layer whose dropout the adapter excludes runs a long batch; a short batch then switches
    every layer to off before the one backward. The replay still takes the dropout's recorded output
    (its override stays in every bucket), so gradients equal the un-applied model's, bitwise."""
    adapter = Adapter(region_patterns=("*",), exclude_patterns=("*.d",))
    model, reference = Stack(Block, 2), Stack(Block, 2)
    plan = hyperac.apply(model, mode="full", adapter=adapter)
    hyperac.remove(model)
    hyperac.apply(model, plan=bucketed(plan, ("off", "off"), ("full", "full")), adapter=adapter)
    long, short = torch.randn(2, 12, 8), torch.randn(2, 4, 8)

    def grads(module):
        torch.manual_seed(1)
        first = module(long).square().sum()
        torch.manual_seed(2)
        (first + module(short).square().sum()).backward()
        return [p.grad for p in module.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(grads(model), grads(reference)))


def test_a_wrapped_layer_stays_off_in_every_bucket():
    """A layer wrapped by another checkpoint is refused in any mode but off, in every bucket, and the
    plan for batches longer than max_seq_len leaves it off."""
    model = Stack(Block, 3)
    model.blocks[1] = checkpoint_wrapper(model.blocks[1])
    plan = hyperac.apply(model, mode="off")
    hyperac.remove(model)
    hyperac.apply(model, plan=bucketed(plan, ("full", "off", "full"), ("full", "off", "full")))
    assert "forward" not in model.blocks[1].__dict__
    switched = [module.__dict__["forward"] for module in model.blocks if "forward" in module.__dict__]
    assert len(switched) == 2 and all(isinstance(v, RecomputedForward) for s in switched for v in s.variants)
    hyperac.remove(model)
    with pytest.raises(hyperac.UnsupportedModelError, match=r"layer blocks\.1 is already wrapped"):
        hyperac.apply(model, plan=bucketed(plan, ("full", "full", "full"), ("full", "off", "full")))
    assert hyperac.applied_plan(model) is None and "forward" not in model.blocks[0].__dict__


def test_force_recompute_names_modules_of_the_default_plan():
    """``force_recompute`` is checked against the default plan's selective layers: buckets (and the
    longer batches' full plan) with none apply; a name the default's layers lack is refused."""
    model = Stack(Block, 2)
    plan = hyperac.apply(model, mode="selective")
    hyperac.remove(model)
    hyperac.apply(model, plan=bucketed(plan, ("off", "off"), ("selective", "selective")), force_recompute=["a"])
    hyperac.remove(model)
    with pytest.raises(hyperac.ConfigError, match=r"force_recompute=\['nope'\] matches no module"):
        hyperac.apply(model, plan=bucketed(plan, ("off", "off"), ("selective", "selective")), force_recompute=["nope"])
    assert hyperac.applied_plan(model) is None


@pytest.mark.parametrize(("bounds", "match"), [
    *[(bounds, r"ascending order, the last one Config\.plan\['max_seq_len'\] \(16\)")
      for bounds in [(16, 8), (8, 8), (8, 12)]],
    (("8", 16), r"Config\.plan\['buckets'\]\[0\]\['max_len'\] is '8'; give an int >= 1\."),
])
def test_malformed_bucket_bounds_are_refused(bounds, match):
    plan = hyperac.apply(Stack(Block, 2), mode="full").to_dict()
    plan.update(max_seq_len=16, buckets=[{"max_len": n, "modes": ["full", "full"]} for n in bounds])
    with pytest.raises(hyperac.ConfigError, match=match):
        Plan.from_dict(plan)


def test_a_knapsack_mode_in_any_bucket_needs_compile():
    model = Stack(Block, 2)
    plan = hyperac.apply(model, mode="full")
    hyperac.remove(model)
    with pytest.raises(hyperac.ConfigError, match=r"knapsack-0\.5.*Config\.compile is False"):
        hyperac.apply(model, plan=bucketed(plan, ("knapsack-0.5", "off"), ("full", "full")))
    assert hyperac.applied_plan(model) is None


def test_a_prefix_profile_puts_the_container_back_in_order():
    """Cutting a stack to its first layers for the profile (planner/prefix.py) leaves a child after
    the layers (a final norm) after them again."""
    body = nn.Sequential(*[Block() for _ in range(10)], nn.LayerNorm(8))
    model = nn.Module()
    model.body = body
    layers = [Layer(index=i, fqn=f"body.{i}", container="body", module=body[i], wrapper=None, found_by="test",
                    reversible=False) for i in range(10)]
    order = list(body._modules)
    with prefix_only(model, layers, 6):
        assert list(body._modules) == [*order[:6], "10"]
    assert list(body._modules) == order
