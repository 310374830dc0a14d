"""What planning costs (issue 20): the timed rounds stop as soon as more could not change the
ranking (NOTE [When the rounds stop] in hyperac/planner/profile.py), the profiler flattens op
arguments without pytree, and ``hyperac plan`` on a deep ``meta`` model profiles a prefix of its
identical layers (NOTE [A prefix of a deep stack] in hyperac/planner/prefix.py).

Readings are injected through the layer clock where a test needs a known host (quiet, busy), so
that nothing here depends on this machine's speed; CPU time is bounded with a 10x margin.
"""

from __future__ import annotations

import collections
import itertools

import pytest
import torch
from hyperac_testing import TinyBlocksModel, tiny_llama
from torch.utils._pytree import tree_flatten

import hyperac
from hyperac.measure import op_tensors
from hyperac.planner import prefix, profile

FACTORS = {"off": 1.0, "full": 1.3, "pointwise": 1.6, "selective": 1.9, "selective-even": 2.2}
"""Per mode, a layer's seconds as a multiple of ``off``'s: every mode well apart from the next."""


def lm_sample(batch=2, seq=16, vocab=128):
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


def injected_clock(monkeypatch, factors, off_jitter=(0.0,)):
    """Replace the layer clock: each layer's reading is ``factors[its mode]`` (the mode applied to it
    in that step) times 10 ms, the ``k``-th ``off`` reading times ``1 + off_jitter[k % len]``.
    Returns the list of the timed steps' modes."""
    steps, offs = [], itertools.count()

    def clock(model, sample, layer_modules, synchronize):
        modes = [layer.mode for layer in hyperac.applied_plan(model).layers]
        steps.append(modes)
        readings = {position: 0.01 * factors[mode] for position, mode in enumerate(modes)}
        for position, mode in enumerate(modes):
            if mode == "off":
                readings[position] *= 1 + off_jitter[next(offs) % len(off_jitter)]
        return {**readings, None: 0.001}

    monkeypatch.setattr(profile, "_timed_step", clock)
    return steps


def test_a_quiet_host_with_a_clear_ranking_times_one_round(monkeypatch):
    """Identical readings for identical work (the control's spread is 0) and modes 30% apart: one
    round of two steps (four layers, five modes), where two rounds were the least before."""
    steps = injected_clock(monkeypatch, FACTORS)
    estimate = hyperac.estimate(tiny_llama(num_layers=4), lm_sample(), backend="cpu")
    assert len(steps) == 2
    seconds = estimate.layers[0].seconds
    assert sorted(seconds, key=seconds.get) == sorted(FACTORS, key=FACTORS.get)


def test_a_busy_host_times_one_round(monkeypatch):
    """The control's ``off`` readings 40% apart: the cost model decides what that noise ties, and a
    second round would not settle it."""
    steps = injected_clock(monkeypatch, FACTORS, off_jitter=(0.0, 0.4))
    hyperac.estimate(tiny_llama(num_layers=4), lm_sample(), backend="cpu")
    assert len(steps) == 2


def test_a_quiet_host_with_modes_close_together_times_until_the_ranking_repeats(monkeypatch):
    """Two modes 4% apart (more than the noise floor, less than twice it): a second round, after
    which the ranking repeats."""
    steps = injected_clock(monkeypatch, {**FACTORS, "selective": 1.64})
    hyperac.estimate(tiny_llama(num_layers=4), lm_sample(), backend="cpu")
    assert len(steps) == 4


def test_a_round_that_reads_a_mode_faster_than_off_is_not_the_last(monkeypatch):
    """``pointwise`` read at 0.93x ``off`` on a busy host: a misreading (it runs at least ``off``'s
    work), so a second round, after which the ranking repeats."""
    steps = injected_clock(monkeypatch, {**FACTORS, "pointwise": 0.93}, off_jitter=(0.0, 0.2))
    hyperac.estimate(tiny_llama(num_layers=4), lm_sample(), backend="cpu")
    assert len(steps) == 4


def test_settled_needs_a_control():
    ratios = {"off": 1.0, "full": 2.0}
    assert not profile._settled(ratios, None)
    assert profile._settled(ratios, 0.0)
    assert profile._settled({"off": 1.0, "full": 1.05}, 0.5)  # busy: tied, the cost model decides
    assert not profile._settled({"off": 1.0, "full": 1.05}, 0.02)  # quiet, between one and two noises
    assert not profile._settled({"off": 1.0, "full": 2.0, "pointwise": 0.93}, 0.5)  # misread: faster than off


Pair = collections.namedtuple("Pair", "first second")


@pytest.mark.parametrize("value", [
    (torch.ones(2), [torch.zeros(1), 3, None], {"out": torch.ones(3), "alpha": 2.0}),
    Pair(torch.ones(1), (torch.zeros(2), [torch.ones(3)])),
    torch.return_types.max((torch.ones(1), torch.zeros(1, dtype=torch.long))),
    [[], (), {}, "text", torch.float32],
    torch.ones(4),
])
def test_op_tensors_finds_what_pytree_finds(value):
    assert op_tensors(value) == [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]


def meta_llama(num_layers, **overrides):
    with torch.device("meta"):
        return tiny_llama(num_layers=num_layers, **overrides)


def meta_sample(seq=64):
    ids = torch.zeros(2, seq, dtype=torch.long, device="meta")
    return {"input_ids": ids, "labels": ids}


def profiled_positions(monkeypatch):
    """The layer positions the profiled steps ran ops in, per step."""
    seen = []
    real = profile._profiled_step

    def recording(model, sample, layer_modules):
        result = real(model, sample, layer_modules)
        seen.append(sorted(p for p in result.forward_ops if p is not None))
        return result

    monkeypatch.setattr(profile, "_profiled_step", recording)
    return seen


def test_a_deep_meta_stack_is_profiled_on_a_prefix_with_the_full_profiles_figures(monkeypatch):
    """Ten identical layers on meta: the profiled steps run six, and the estimate is the one the
    ten-layer profile gives, for every layer and mode, outside the layers, and for mixed plans."""
    model, sample = meta_llama(10), meta_sample()
    seen = profiled_positions(monkeypatch)
    monkeypatch.setattr(prefix, "PREFIX_LAYERS", 10)
    full = hyperac.estimate(model, sample, backend="cpu", device_profile="h100")
    monkeypatch.setattr(prefix, "PREFIX_LAYERS", 6)
    short = hyperac.estimate(model, sample, backend="cpu", device_profile="h100")
    assert seen == [list(range(10))] * 2 + [list(range(6))] * 2 + [list(range(7))] * 2  # the check: seven
    assert len(model.model.layers) == 10 and [n for n, _ in model.model.layers.named_children()] == [
        str(i) for i in range(10)]
    assert short.layers == full.layers
    assert (short.outside_peak_bytes, short.outside_seconds, short.base_flops, short.outside_bytes) == (
        full.outside_peak_bytes, full.outside_seconds, full.base_flops, full.outside_bytes)
    for plan in (["off"] * 10, ["full"] * 10, ["full", "selective", "off", "pointwise", "selective-even"] * 2):
        assert short.peak_bytes(plan) == full.peak_bytes(plan)
        assert short.step_seconds(plan) == full.step_seconds(plan)


class SiluInTwoOps(torch.nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


def test_a_prefix_that_does_not_predict_a_longer_one_is_not_used(monkeypatch):
    """Layer 6 of ten runs its activation in two ops (same parameters): the six-layer prefix's
    extension misses the seven-layer one, so every layer is profiled and costed as it runs."""
    model, sample = meta_llama(10), meta_sample()
    model.model.layers[6].mlp.act_fn = SiluInTwoOps()
    monkeypatch.setattr(prefix, "PREFIX_LAYERS", 6)
    seen = profiled_positions(monkeypatch)
    estimate = hyperac.estimate(model, sample, backend="cpu", device_profile="h100")
    assert [len(positions) for positions in seen[:2]] == [6, 6] and seen[-1] == list(range(10))
    assert 7 in [len(positions) for positions in seen]
    assert estimate.layers[6].seconds != estimate.layers[5].seconds


class CountedBlocks(TinyBlocksModel):
    """Runs ``blocks[i]`` for ``i`` up to the count it was built with: fails without every layer."""

    def forward(self, input_ids):
        x = self.embed(input_ids)
        for index in range(self.count):
            x = self.blocks[index](x)
        return self.head(self.norm(x))


def test_a_forward_that_needs_every_layer_is_profiled_whole(monkeypatch):
    with torch.device("meta"):
        model = CountedBlocks(num_layers=8, dropout=0.0)
    model.count = 8
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    seen = profiled_positions(monkeypatch)
    estimate = hyperac.estimate(model, lambda m: m(ids).float().mean(), backend="cpu", device_profile="h100")
    assert len(estimate.layers) == 8 and seen[-1] == list(range(8))
    assert len(model.blocks) == 8


def test_layers_of_different_structure_are_all_profiled(monkeypatch):
    """Eight layers, one of them wider: no prefix stands for them all."""
    model = meta_llama(8)
    with torch.device("meta"):
        model.model.layers[5].mlp.down_proj = torch.nn.Linear(256, 64, bias=False)
        model.model.layers[5].mlp.up_proj = torch.nn.Linear(64, 256, bias=False)
        model.model.layers[5].mlp.gate_proj = torch.nn.Linear(64, 256, bias=False)
    seen = profiled_positions(monkeypatch)
    hyperac.estimate(model, meta_sample(), backend="cpu", device_profile="h100")
    assert seen[0] == list(range(8))


def test_real_tensors_profile_every_layer(monkeypatch):
    seen = profiled_positions(monkeypatch)
    hyperac.estimate(tiny_llama(num_layers=8), lm_sample(), backend="cpu")
    assert seen[0] == list(range(8))


def test_plan_for_llama_3_70b_profiles_a_prefix_of_its_80_layers(capsys, monkeypatch):
    """``hyperac plan --preset llama-3-70b``: 80 layers on meta, every profiled step on a prefix of
    them (NOTE [A prefix of a deep stack]), so that planning costs what a short stack does. Counted
    in layers, not seconds (2.3-3.8 s of CPU after the imports, measured and bounded by
    ``benchmarks/planner_targets.py --plan-cost``)."""
    from hyperac.cli import main

    seen = profiled_positions(monkeypatch)
    assert main(["plan", "--preset", "llama-3-70b", "--budget", "0.5"]) == 0
    assert seen and all(positions == list(range(len(positions))) for positions in seen), seen
    assert max(len(positions) for positions in seen) <= prefix.PREFIX_LAYERS + 1 < 80
    assert "model.layers.79" in capsys.readouterr().out
