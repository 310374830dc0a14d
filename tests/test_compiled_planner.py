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
from hyperac.planner.compiled import (
    COMPILED_ROUNDS,
    MAX_COMPILED_ROUNDS,
    NOISE_FLOOR,
    TIMING_SECONDS,
    _mixed_or_uniform,
    more_rounds,
    timing_noise,
)
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


def test_noise_is_the_standard_error_of_a_difference_of_medians():
    assert timing_noise([[1.0] * 4, [1.1] * 4]) == NOISE_FLOOR  # no spread: the floor
    ratios = [[1.00, 1.10, 1.00, 1.10], [1.20, 1.30, 1.20, 1.30]]  # every deviation from its median 0.05
    spread = 1.4826 * 0.05
    assert timing_noise(ratios) == pytest.approx(1.2533 * spread * math.sqrt(2 / 4))
    assert timing_noise([r * 4 for r in ratios]) == pytest.approx(1.2533 * spread * math.sqrt(2 / 16))
    assert timing_noise([]) == NOISE_FLOOR


def test_rounds_go_on_for_short_steps_up_to_a_cap():
    assert all(more_rounds(done, COMPILED_ROUNDS, timing=1e9) for done in range(COMPILED_ROUNDS + 1))
    assert not more_rounds(COMPILED_ROUNDS + 1, COMPILED_ROUNDS, timing=TIMING_SECONDS)
    assert more_rounds(COMPILED_ROUNDS + 1, COMPILED_ROUNDS, timing=TIMING_SECONDS / 2)
    assert more_rounds(MAX_COMPILED_ROUNDS, COMPILED_ROUNDS, timing=0.0)
    assert not more_rounds(MAX_COMPILED_ROUNDS + 1, COMPILED_ROUNDS, timing=0.0)


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
    # A uniform plan slower than another that fits (the solver's fallback) gives way to it, silently.
    assert _mixed_or_uniform(estimate, ["full"] * 4, 4 * 30, noise=0.5) == (["pointwise"] * 4, [])
    # Only full fits uniformly, and the mixed plan is faster than it by more than the noise: kept.
    budget = 2 + 2 + 2 + 15
    mixed = choose_modes(estimate, budget, ESTIMATE_MODES, bound="kept")
    assert mixed.count("full") == 3 and len(set(mixed)) == 2, mixed
    assert _mixed_or_uniform(estimate, mixed, budget, noise=0.03) == (mixed, [])
    # Where no uniform plan fits (one layer keeps less in another mode than in full), the plan stands.
    estimate.layers[0].kept_bytes["selective"] = 1
    tight = 1 + 3 * 2
    mixed = choose_modes(estimate, tight, ESTIMATE_MODES, bound="kept")
    assert len(set(mixed)) == 2, mixed
    assert _mixed_or_uniform(estimate, mixed, tight, noise=0.5) == (mixed, [])


def test_a_mixed_plan_predicted_slower_than_a_uniform_one_gives_way_without_a_note():
    """The solver rounds bytes to a grid and can miss a uniform plan that fits exactly."""
    estimate = stack()
    slower = ["selective", "pointwise", "pointwise", "pointwise"]  # fits, but slower than pppp
    assert _mixed_or_uniform(estimate, slower, 4 * 26, noise=0.03) == (["pointwise"] * 4, [])
