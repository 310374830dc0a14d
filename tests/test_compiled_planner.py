"""``mode="auto"`` under ``compile=True`` keeps a mixed plan only when it beats the noise.

NOTE [A mixed plan must beat the noise] in hyperac/planner/compiled.py: the solver's mixed plan
replaces the fastest uniform plan that fits only when predicted faster than it by more than the
timing noise of the compiled profile. These tests drive the rule on cost models whose numbers are
chosen here (the compiled profile itself is exercised in test_compile.py).
"""

from __future__ import annotations

import math

import pytest

from hyperac.planner import ESTIMATE_MODES, Estimate, LayerEstimate
from hyperac.planner.compiled import NOISE_FLOOR, _mixed_or_uniform, timing_noise
from hyperac.planner.solver import choose_modes

# Shaped like a layer of the hidden-512 Llama compiled (MiB saved as measured there, seconds per
# step rounded): pointwise and selective lie between off and full, and no uniform plan sits at
# half of off's bytes.
KEPT = {"off": 40, "pointwise": 26, "selective": 15, "selective-even": 15, "full": 2}
SECONDS = {"off": 1.00, "pointwise": 1.02, "selective": 1.06, "selective-even": 1.07, "full": 1.30}


def stack(layers=4, seconds=SECONDS):
    return Estimate(tuple(
        LayerEstimate(index=i, fqn=f"layers.{i}", kept_bytes=dict(KEPT), recompute_flops=dict.fromkeys(KEPT, 0),
                      seconds=dict(seconds))
        for i in range(layers)
    ), outside_bytes=0, base_flops=0)


def test_noise_is_the_spread_of_the_ratios_over_the_root_of_the_rounds():
    assert timing_noise([[1.0] * 4, [1.1] * 4]) == NOISE_FLOOR  # no spread: the floor
    ratios = [[1.00, 1.10, 1.00, 1.10], [1.20, 1.30, 1.20, 1.30]]  # every deviation from its median 0.05
    assert timing_noise(ratios) == pytest.approx(1.4826 * 0.05 / math.sqrt(4))
    assert timing_noise([r * 4 for r in ratios]) == pytest.approx(1.4826 * 0.05 / math.sqrt(16))
    assert timing_noise([]) == NOISE_FLOOR


def test_a_mixed_plan_within_the_noise_gives_way_to_the_best_uniform_plan():
    estimate = stack()
    budget = 4 * 21  # between selective (15) and pointwise (26) per layer
    mixed = choose_modes(estimate, budget, ESTIMATE_MODES, bound="kept")
    assert len(set(mixed)) > 1 and estimate.total_bytes(mixed) <= budget, mixed
    gain = 1 - estimate.step_seconds(mixed) / estimate.step_seconds(["selective"] * 4)
    assert 0.005 < gain < 0.03, gain

    chosen, notes = _mixed_or_uniform(estimate, mixed, budget, noise=0.03)
    assert chosen == ["selective"] * 4  # the fastest uniform plan that fits (selective-even is slower)
    assert len(notes) == 1 and notes[0].startswith("auto chose every layer selective: the best mixed plan (")
    assert f"was predicted {100 * gain:.1f}% faster, within the timing noise of the compiled profile (3.0%)" in notes[0]

    assert _mixed_or_uniform(estimate, mixed, budget, noise=gain / 2) == (mixed, [])


def test_uniform_plans_and_clear_gains_stand():
    estimate = stack()
    assert _mixed_or_uniform(estimate, ["pointwise"] * 4, 4 * 30, noise=0.5) == (["pointwise"] * 4, [])
    # Only full fits uniformly, and the mixed plan is faster than it by more than the noise: kept.
    budget = 2 + 2 + 2 + 15
    mixed = choose_modes(estimate, budget, ESTIMATE_MODES, bound="kept")
    assert mixed.count("full") == 3, mixed
    assert _mixed_or_uniform(estimate, mixed, budget, noise=0.03) == (mixed, [])
    # Where even full does not fit uniformly (a layer keeps less in another mode), the plan stands.
    cheaper = stack(seconds=SECONDS)
    for layer in cheaper.layers[:1]:
        layer.kept_bytes["selective"] = 1
    tight = 1 + 3 * 2
    mixed = choose_modes(cheaper, tight, ESTIMATE_MODES, bound="kept")
    assert _mixed_or_uniform(cheaper, mixed, tight, noise=0.5) == (mixed, [])
