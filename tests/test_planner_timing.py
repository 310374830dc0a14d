"""What planning costs and how it treats timing noise (NOTE [Identical layers measured once],
NOTE [Timing on a drifting host] in hyperac/planner/profile.py).

Planning cost is counted in steps, not seconds (CI machines differ 10x in speed); noise is
injected by replacing the layer clock's readings, so the tests do not depend on the machine.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from hyperac_testing import TinyBlocksModel, tiny_llama
from torch import nn

import hyperac
from hyperac.planner import ESTIMATE_MODES, profile


def lm_sample(batch=2, seq=16, vocab=128):
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))
    return {"input_ids": ids, "labels": ids}


@pytest.fixture
def step_counts(monkeypatch):
    """Counts of profiled and timed steps that ``estimate`` runs."""
    counts = {"profiled": 0, "timed": 0}
    profiled, timed = profile._profiled_step, profile._timed_step

    def count_profiled(*args, **kwargs):
        counts["profiled"] += 1
        return profiled(*args, **kwargs)

    def count_timed(*args, **kwargs):
        counts["timed"] += 1
        return timed(*args, **kwargs)

    monkeypatch.setattr(profile, "_profiled_step", count_profiled)
    monkeypatch.setattr(profile, "_timed_step", count_timed)
    return counts


def test_identical_layers_are_profiled_in_two_steps(step_counts):
    """Four identical decoder layers: ``off``, then the other four modes side by side (was five
    profiled steps and 15-45 timed ones); one to ``MAX_ROUNDS`` timed rounds of two steps each."""
    estimate = hyperac.estimate(tiny_llama(num_layers=4), lm_sample(), backend="cpu")
    assert step_counts["profiled"] == 2
    assert 2 <= step_counts["timed"] <= 2 * profile.MAX_ROUNDS
    first = estimate.layers[0]
    for layer in estimate.layers[1:]:  # each group's figures stand for all its members
        assert (layer.kept_bytes, layer.seconds, layer.recompute_flops) == (
            first.kept_bytes, first.seconds, first.recompute_flops)


class UnlikeLayers(TinyBlocksModel):
    """Three blocks of different widths (through adapters): nothing to share."""

    def __init__(self) -> None:
        super().__init__(num_layers=3)
        for position, block in enumerate(self.blocks):
            block.extra = nn.Linear(32, 32 + 8 * position)


def test_unlike_layers_get_a_step_per_mode(step_counts):
    hyperac.estimate(UnlikeLayers(), {"input_ids": lm_sample()["input_ids"]}, backend="cpu")
    assert step_counts["profiled"] == len(ESTIMATE_MODES)


def test_modes_the_noise_cannot_tell_apart_are_ranked_by_the_cost_model(monkeypatch):
    """Every reading pure noise (each mode's true cost the same, readings 0.5-1.5x): the off-vs-off
    control sees it, so every layer's seconds follow replayed FLOPs and dispatched ops; a mode that
    replays at least as much as another never looks faster. Without the control the noise ranks them."""
    noise = random.Random(3)

    def noisy_step(model, sample, layer_modules, synchronize):
        return {key: 0.01 * noise.uniform(0.5, 1.5) for key in [*range(len(layer_modules)), None]}

    monkeypatch.setattr(profile, "_timed_step", noisy_step)
    captured = {}
    real = profile._decide_within_noise

    def capture(measured, noise_seconds, mode_profiles, position):
        captured[position] = (measured, noise_seconds, mode_profiles)
        return real(measured, noise_seconds, mode_profiles, position)

    monkeypatch.setattr(profile, "_decide_within_noise", capture)
    estimate = hyperac.estimate(tiny_llama(num_layers=4), lm_sample(), backend="cpu")
    measured, noise_seconds, mode_profiles = captured[0]
    assert noise_seconds > 0
    off = mode_profiles["off"]

    def costs(position: int) -> dict[str, tuple[int, int]]:
        """Per mode, the layer's (replayed FLOPs, extra dispatched ops)."""
        return {mode: (estimate.layers[position].recompute_flops[mode],
                       mode_profiles[mode].forward_ops[position] + mode_profiles[mode].backward_ops[position]
                       - off.forward_ops[position] - off.backward_ops[position]) for mode in ESTIMATE_MODES}

    for position, layer in enumerate(estimate.layers):
        cost = costs(position)
        for a in ESTIMATE_MODES:
            for b in ESTIMATE_MODES:
                if cost[a][0] >= cost[b][0] and cost[a][1] >= cost[b][1]:
                    assert layer.seconds[a] >= layer.seconds[b] - 1e-12, (a, b, layer.seconds)
    cost = costs(0)  # the layer captured[0] measured
    assert any(measured[a] < measured[b] for a in ESTIMATE_MODES for b in ESTIMATE_MODES
               if cost[a][0] >= cost[b][0] and cost[a][1] >= cost[b][1] and a != b), "the noise alone misranks"


def test_measurements_beyond_the_noise_are_kept():
    """Readings far from the cost model (more than the noise) are what the layer costs."""
    off = profile.ModeProfile(kept={}, forward_peak={}, backward_peak={}, outside_peak={}, backward_flops={0: 0},
                              total_flops=0, forward_ops={0: 10}, backward_ops={0: 10}, work={})
    full = profile.ModeProfile(kept={}, forward_peak={}, backward_peak={}, outside_peak={}, backward_flops={0: 100},
                               total_flops=0, forward_ops={0: 10}, backward_ops={0: 20}, work={})
    sel = profile.ModeProfile(kept={}, forward_peak={}, backward_peak={}, outside_peak={}, backward_flops={0: 50},
                              total_flops=0, forward_ops={0: 10}, backward_ops={0: 20}, work={})
    profiles = {"off": off, "full": full, "selective": sel}
    measured = {"off": 1.0, "full": 2.0, "selective": 1.2}
    assert profile._decide_within_noise(measured, 0.01, profiles, 0) == measured
    decided = profile._decide_within_noise(measured, 1.0, profiles, 0)
    assert decided["off"] == 1.0 and decided["full"] > decided["selective"] > 1.0


def test_ranking_ties_modes_within_the_noise():
    ratios = {"off": 1.0, "pointwise": 1.02, "selective": 1.3, "full": 1.31}
    assert profile._ranking(ratios, 0.05) == [frozenset({"off", "pointwise"}), frozenset({"selective", "full"})]
    assert profile._ranking(ratios, 0.0) == [frozenset({m}) for m in ("off", "pointwise", "selective", "full")]


def _peak(model, ids):
    from hyperac.measure import PeakMeter

    with PeakMeter(model.parameters()) as meter:
        out = model(input_ids=ids, labels=ids)
        meter.release(out)
        out.loss.backward()
    model.zero_grad(set_to_none=True)
    return meter.peak_bytes


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_plan_for_max_seq_len_fits_every_shorter_batch(attention):
    """Profiled at 16 tokens, planned for 64: the measured peak at 16, 32, 48 and 64 tokens stays
    within the budget (x 1.03), and the predicted peak at 64 is within 5% of the measured one
    (eager attention: scores quadratic in the length)."""
    length = 64
    model = tiny_llama(num_layers=4, attn_implementation=attention)
    ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(0))
    off_peak = _peak(model, ids)
    plan = hyperac.apply(model, mode="auto", budget=int(0.5 * off_peak), sample=lm_sample(seq=16),
                         max_seq_len=length, backend="cpu")
    assert plan.max_seq_len == length and f"at sequence length {length}" in str(plan)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    peaks = {n: _peak(model, ids[:, :n]) for n in (16, 32, 48, 64)}
    assert all(peak <= 1.03 * plan.budget_bytes for peak in peaks.values()), (peaks, plan.budget_bytes)
    assert plan.predicted_peak_bytes == pytest.approx(peaks[length], rel=0.05)


def test_max_seq_len_needs_a_sample_it_can_cut():
    with pytest.raises(hyperac.ConfigError, match="max_seq_len= needs sample= as a dict"):
        hyperac.apply(tiny_llama(num_layers=2), mode="auto", budget=0.5, sample=lambda m: m(torch.ones(1, 4)).sum(),
                      max_seq_len=64, backend="cpu")
    with pytest.raises(hyperac.ConfigError, match="max_seq_len=64 only applies to mode='auto'"):
        hyperac.apply(tiny_llama(num_layers=2), mode="full", max_seq_len=64)
    with pytest.raises(hyperac.ConfigError, match="max_seq_len=64 is not supported with compile=True"):
        hyperac.apply(tiny_llama(num_layers=2), mode="auto", budget=0.5, sample=lm_sample(seq=8), max_seq_len=64,
                      compile=True, backend="cpu")


def test_a_batch_longer_than_max_seq_len_warns_once_per_shape():
    model = tiny_llama(num_layers=2)
    hyperac.apply(model, mode="auto", budget=0.9, sample=lm_sample(seq=8), max_seq_len=16, backend="cpu")
    longer = torch.randint(0, 128, (2, 24))
    with pytest.warns(hyperac.HyperACWarning, match=r"shape \[2, 24\] has 24 positions in dimension 1, more than "
                                                     r"the max_seq_len=16 the plan was made for"):
        model(input_ids=longer, labels=longer).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(input_ids=longer, labels=longer).loss.backward()  # the same shape: once
        model(input_ids=longer[:, :16], labels=longer[:, :16]).loss.backward()  # within: quiet
    hyperac.remove(model)
    assert not model._forward_pre_hooks


def test_the_same_job_gets_one_plan_under_timing_jitter(monkeypatch):
    """Every recompute mode costs the same (1.5x ``off``), each reading jittered by up to 10%: the
    modes are tied within the noise (NOTE [Ties within the noise]), the tie goes to fewer kept bytes,
    and five plans with five draws of the jitter are one plan. Without ties, the jitter picks."""
    draws = random.Random()
    real = profile._timed_step

    def jittered_step(model, sample, layer_modules, clock):
        real(model, sample, layer_modules, clock)
        modes = [layer.mode for layer in hyperac.applied_plan(model).layers]
        return {**{p: 0.01 * (1.0 if m == "off" else 1.5) * draws.uniform(0.9, 1.1) for p, m in enumerate(modes)},
                None: 0.001}

    monkeypatch.setattr(profile, "_timed_step", jittered_step)
    model = tiny_llama(num_layers=4)
    budget = hyperac.estimate(model, lm_sample(), backend="cpu").peak_bytes(["selective-even"] * 4)
    plans = set()
    for seed in range(5):
        draws.seed(seed)
        plans.add(tuple(layer.mode for layer in hyperac.apply(model, mode="auto", budget=budget, sample=lm_sample(),
                                                              backend="cpu").layers))
        hyperac.remove(model)
    assert len(plans) == 1, plans


def test_ties_go_to_fewer_kept_bytes_then_fewer_replayed_flops():
    """Within the noise (0.1 s) of the class's fastest recompute mode, each costs the fastest's
    seconds plus a step far below the noise, ordered by kept bytes, then replayed FLOPs; a mode
    further away, and ``off`` (never slower than a mode that runs its work and more), keep their own."""
    from hyperac.planner.cost import LayerEstimate
    from hyperac.planner.solver import TIE_STEP, tied_seconds

    layer = LayerEstimate(
        index=0, fqn="layers.0", noise_seconds=0.1,
        seconds={"off": 1.02, "pointwise": 1.08, "selective": 1.05, "selective-even": 1.09, "full": 1.5},
        kept_bytes={"off": 100, "pointwise": 60, "selective": 40, "selective-even": 40, "full": 10},
        recompute_flops={"off": 0, "pointwise": 5, "selective": 30, "selective-even": 20, "full": 90},
    )
    tied = tied_seconds(layer)
    order = ["selective-even", "selective", "pointwise"]  # 40 bytes (20 FLOPs before 30), then 60
    assert tied == {**{mode: 1.05 * (1 + step * TIE_STEP) for step, mode in enumerate(order)}, "off": 1.02,
                    "full": 1.5}
