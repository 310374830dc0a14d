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
from hyperac_testing import tiny_llama
from torch.utils._pytree import tree_flatten

import hyperac
from hyperac.measure import op_tensors
from hyperac.planner import profile

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


def test_settled_needs_a_control():
    ratios = {"off": 1.0, "full": 2.0}
    assert not profile._settled(ratios, None)
    assert profile._settled(ratios, 0.0)
    assert profile._settled({"off": 1.0, "full": 1.05}, 0.5)  # busy: tied, the cost model decides
    assert not profile._settled({"off": 1.0, "full": 1.05}, 0.02)  # quiet, between one and two noises


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
