"""Swap as a choice of ``mode="auto"`` (NOTE [Swap in the plan] in hyperac/planner/cost.py).

On ``sim`` with per-op compute time, the planner costs each layer's swap by the device bytes it
frees, the copy time its host link cannot hide behind the neighbouring layer's compute, and the
pinned-host budget; what it predicts is measured on the same backend.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import pickle

import pytest
import torch
from hyperac_testing import assert_parity, kv_cache_disabled, lm_loss, loaded_host, measure, tiny_llama, train_step

import hyperac
from hyperac.backends import base
from hyperac.backends.base import HOST_LINK_ENV, DeviceModuleBackend
from hyperac.backends.sim import SimBackend
from hyperac.errors import ConfigError
from hyperac.measure import PeakMeter
from hyperac.planner import ESTIMATE_MODES, SWAP_OPTIONS, choose_modes
from hyperac.planner.cost import split_option
from hyperac.state import STATE_KEY

SECONDS_PER_OP = 50e-6
FAST_LINK = 1e12  # bytes/s: copies take nanoseconds
SLOW_LINK = 1e5  # bytes/s: a layer's saved tensors (about 0.5 MiB) take seconds, its compute milliseconds
BUDGET = 0.7  # of off's peak: full recompute fits, and so does swap of most layers' saved tensors


def swapping(plan):
    return [layer.index for layer in plan.layers if layer.swap]


@pytest.fixture(scope="module")
def loss_fn():
    return lm_loss(batch=2, seq=64)


@pytest.fixture(scope="module")
def model():
    return tiny_llama(num_layers=4)


@pytest.fixture(scope="module")
def fast_estimate(model, loss_fn):
    return hyperac.estimate(model, loss_fn, backend=SimBackend(FAST_LINK, SECONDS_PER_OP), min_swap_bytes=0)


@pytest.fixture(scope="module")
def fast_plan(model, loss_fn):
    """A copy of the model under auto on a fast link; its backend; the plan."""
    clone = copy.deepcopy(model)
    backend = SimBackend(FAST_LINK, SECONDS_PER_OP)
    plan = hyperac.apply(clone, mode="auto", budget=BUDGET, sample=loss_fn, backend=backend, min_swap_bytes=0)
    return clone, backend, plan


def test_auto_swaps_on_a_fast_link_and_the_device_saving_is_as_predicted(model, loss_fn, fast_plan):
    clone, backend, plan = fast_plan
    assert swapping(plan), str(plan)
    assert plan.predicted_swap_bytes > 0
    stats = hyperac.swap_stats(clone)
    stats.reset()
    with backend.computing():
        kept, _ = measure(clone, loss_fn)
    backend.synchronize()
    clone.zero_grad(set_to_none=True)
    # What left the device, by the swap machinery's own count and by the bytes alive at backward start.
    assert stats.offloaded_bytes == plan.predicted_swap_bytes  # storage by storage (NOTE [What a swap would move])
    assert stats.skipped["budget"] == 0
    assert kept == pytest.approx(plan.predicted_bytes, rel=0.02)
    unswapped = [layer.mode if layer.mode != "swap" else "off" for layer in plan.layers]
    plain = copy.deepcopy(model)
    hyperac.apply(plain, layers=dict(enumerate(unswapped)), backend="cpu")
    kept_without_swap, _ = measure(plain, loss_fn)
    assert kept_without_swap - kept == pytest.approx(plan.predicted_swap_bytes, rel=0.02)


def test_auto_plan_with_swap_keeps_gradients_bitwise(model, loss_fn, fast_plan):
    clone, backend, plan = fast_plan
    assert swapping(plan)
    reference = copy.deepcopy(model)
    with kv_cache_disabled(reference):
        expected = train_step(reference, loss_fn)
    assert_parity(expected, train_step(clone, loss_fn))


def test_swap_is_not_chosen_when_its_copies_cannot_hide(model, loss_fn, fast_estimate):
    slow = dataclasses.replace(fast_estimate, link_bandwidth=SLOW_LINK)
    exposed = slow.option_seconds(0, "swap") - slow.layers[0].seconds["off"]
    assert exposed > 1.0  # 0.5 MiB each way at 100 kB/s, against milliseconds of compute
    assert fast_estimate.option_seconds(0, "swap") == fast_estimate.layers[0].seconds["off"]
    plan = hyperac.apply(copy.deepcopy(model), mode="auto", budget=BUDGET, sample=loss_fn,
                         backend=SimBackend(SLOW_LINK, SECONDS_PER_OP), min_swap_bytes=0)
    assert not swapping(plan) and plan.count("swap") == 0, str(plan)


def test_swap_is_never_chosen_on_cpu(model, loss_fn):
    clone = copy.deepcopy(model)
    plan = hyperac.apply(clone, mode="auto", budget=BUDGET, sample=loss_fn, backend="cpu", min_swap_bytes=0)
    assert not swapping(plan) and plan.count("swap") == 0 and plan.predicted_swap_bytes == 0, str(plan)
    assert hyperac.swap_stats(clone) is None


def test_host_budget_bounds_the_plans_pinned_bytes(model, loss_fn, fast_estimate):
    options = ESTIMATE_MODES + SWAP_OPTIONS
    budget = hyperac.planner.parse_budget(BUDGET, fast_estimate.peak_bytes(["off"] * 4))
    unbounded = choose_modes(fast_estimate, budget, options)
    host = fast_estimate.host_bytes(unbounded)
    assert host > 0
    bounded = choose_modes(fast_estimate, budget, options, host_budget_bytes=host - 1)
    assert fast_estimate.host_bytes(bounded) <= host - 1
    assert fast_estimate.peak_bytes(bounded) <= budget
    # Applied with that host budget, the swaps fit the pool: nothing is kept on the device for lack of it.
    clone = copy.deepcopy(model)
    backend = SimBackend(FAST_LINK, SECONDS_PER_OP)
    plan = hyperac.apply(clone, mode="auto", budget=BUDGET, sample=loss_fn, backend=backend, min_swap_bytes=0,
                         host_budget_bytes=host - 1)
    stats = hyperac.swap_stats(clone)
    if stats is not None:
        with backend.computing():
            loss_fn(clone).backward()
        backend.synchronize()
        assert stats.skipped["budget"] == 0, str(plan)



def test_a_budget_only_swap_meets_names_the_host_budget_when_that_is_what_blocks(fast_estimate):
    """Below the all-full floor only swapping fits: with too little pinned host memory the error
    says so, and names the host budget to raise (not the device budget alone)."""
    options = ESTIMATE_MODES + SWAP_OPTIONS
    budget = fast_estimate.peak_bytes(["full"] * 4) - 1
    swapping = choose_modes(fast_estimate, budget, options)
    assert any(split_option(option)[1] for option in swapping)
    with pytest.raises(ConfigError, match=r"fits only with layers swapped to host memory: the plan needs \d+ bytes .* "
                                          r"over the host budget of 0 bytes .*raise host_budget_bytes="):
        choose_modes(fast_estimate, budget, options, host_budget_bytes=0)


def test_measured_peak_of_the_swap_plan_is_as_predicted(loss_fn, fast_plan):
    """The peak counts each swapped layer's tensors until the next swapping layer's forward ends
    (and from its backward's prefetch on): leaving them out would under-predict this plan by a third."""
    clone, backend, plan = fast_plan
    assert swapping(plan)
    with backend.computing(), PeakMeter(clone.parameters()) as meter:
        loss_fn(clone).backward()
    backend.synchronize()
    clone.zero_grad(set_to_none=True)
    assert meter.peak_bytes == pytest.approx(plan.predicted_peak_bytes, rel=1e-3)
    assert meter.peak_bytes <= plan.budget_bytes


def test_auto_does_not_count_on_swapping_storages_under_min_swap_bytes(model, loss_fn, fast_estimate):
    """Every storage of this model is under the default ``min_swap_bytes`` (1 MiB; a layer's input
    is 32 KiB), so ``SwapManager`` would move none of them: auto must not plan a saving from swap
    (it chose swap, and predicted half the measured peak, when it counted every kept byte as moved)."""
    assert dataclasses.replace(fast_estimate, min_swap_bytes=1 << 20).offload_bytes(0, "swap") == 0
    assert 0 < max(fast_estimate.layers[0].offload_storages["off"]) < 1 << 20
    clone = copy.deepcopy(model)
    backend = SimBackend(FAST_LINK, SECONDS_PER_OP)
    plan = hyperac.apply(clone, mode="auto", budget=BUDGET, sample=loss_fn, backend=backend)
    assert not swapping(plan) and plan.count("swap") == 0 and plan.predicted_swap_bytes == 0, str(plan)
    assert hyperac.swap_stats(clone) is None
    with backend.computing(), PeakMeter(clone.parameters()) as meter:
        loss_fn(clone).backward()
    clone.zero_grad(set_to_none=True)
    assert meter.peak_bytes == pytest.approx(plan.predicted_peak_bytes, rel=1e-3)
    assert meter.peak_bytes <= plan.budget_bytes


def test_min_swap_bytes_leaves_the_small_storages_of_a_layer_on_the_device(model, loss_fn, fast_estimate):
    """Between the two extremes: a threshold that keeps some of a ``swap`` layer's saved storages
    on the device; the planner's offload bytes are what ``SwapManager`` moves, storage by storage."""
    sizes = sorted(fast_estimate.layers[0].offload_storages["off"])
    threshold = sizes[len(sizes) // 2]
    estimate = dataclasses.replace(fast_estimate, min_swap_bytes=threshold)
    assert 0 < estimate.offload_bytes(0, "swap") < fast_estimate.offload_bytes(0, "swap")
    backend = SimBackend(FAST_LINK)
    clone = copy.deepcopy(model)
    hyperac.apply(clone, layers={0: "swap", 3: "swap"}, backend=backend, min_swap_bytes=threshold)
    loss_fn(clone).backward()
    backend.synchronize()
    assert hyperac.swap_stats(clone).offloaded_bytes == estimate.offload_bytes(0, "swap")


def test_a_copy_of_a_swapping_model_keeps_the_sim_backends_settings(model, loss_fn):
    """deepcopy and pickle of an applied model rebuild its swap state on a backend with the same
    link bandwidth and compute time, so that a step of the copy takes the virtual time (NOTE [The
    virtual clock]) a step of the original does, to the bit, waits on copies included."""
    settings = dict(link_bandwidth=2**21, seconds_per_op=2**-20, flops_per_second=2**30)  # 1/64 s a layer input
    original = copy.deepcopy(model)
    hyperac.apply(original, mode="full", swap_inputs=True, min_swap_bytes=0, backend=SimBackend(**settings))
    timings = []
    for applied in [original, copy.deepcopy(original), pickle.loads(pickle.dumps(original))]:
        backend = applied.__dict__[STATE_KEY].swap.backend
        assert type(backend) is SimBackend and {
            name: getattr(backend, name) for name in settings} == settings
        stats = hyperac.swap_stats(applied)
        start = backend.clock()
        with backend.computing():
            loss_fn(applied).backward()
        timings.append((backend.clock() - start, stats.wait_seconds, stats.offloaded_bytes))
        hyperac.remove(applied)
    step, waited, offloaded = timings[0]
    assert step >= 2 * offloaded / settings["link_bandwidth"] and waited > 0, timings  # one copy stream, both ways
    assert timings[1] == timings[2] == timings[0]


def test_the_planner_times_sim_steps_on_the_virtual_clock(model, loss_fn, fast_estimate):
    """``estimate`` on ``sim`` times its steps on the backend's virtual clock (``Backend.clock``): on
    a host as busy as a shared CI machine, every layer's seconds are the same, to the bit."""
    clone = copy.deepcopy(model)
    with loaded_host(clone):
        loaded = hyperac.estimate(clone, loss_fn, backend=SimBackend(FAST_LINK, SECONDS_PER_OP), min_swap_bytes=0)
    assert all(layer.seconds["off"] > 0 for layer in loaded.layers)
    assert [layer.seconds for layer in loaded.layers] == [layer.seconds for layer in fast_estimate.layers]
    assert loaded.outside_seconds == fast_estimate.outside_seconds


def test_a_swap_plan_round_trips_through_json(model, loss_fn, fast_plan):
    """``apply(plan=...)`` swaps the layers the plan marks ``swap``, not only those of ``swap`` mode."""
    _, _, plan = fast_plan
    data = json.loads(json.dumps(plan.to_dict()))
    assert data["predicted_swap_bytes"] == plan.predicted_swap_bytes
    backend = SimBackend(FAST_LINK)
    other = copy.deepcopy(model)
    replayed = hyperac.apply(other, plan=data, backend=backend, min_swap_bytes=0)
    assert [(p.mode, p.swap) for p in replayed.layers] == [(p.mode, p.swap) for p in plan.layers]
    loss_fn(other).backward()
    backend.synchronize()
    assert hyperac.swap_stats(other).offloaded_bytes == plan.predicted_swap_bytes


def test_a_plan_swapping_recomputed_inputs_round_trips(model, loss_fn):
    """Inputs swapped under full recompute (no ``swap`` mode to say so) survive the round trip."""
    backend = SimBackend(FAST_LINK)
    first = copy.deepcopy(model)
    plan = hyperac.apply(first, mode="full", swap_inputs=True, min_swap_bytes=0, backend=backend)
    other = copy.deepcopy(model)
    replayed = hyperac.apply(other, plan=plan.to_dict(), backend=backend, min_swap_bytes=0)
    assert [layer.swap for layer in replayed.layers] == [layer.swap for layer in plan.layers] == [True] * 3 + [False]
    offloaded = []
    for applied in (first, other):
        loss_fn(applied).backward()
        backend.synchronize()
        offloaded.append(hyperac.swap_stats(applied).offloaded_bytes)
    assert offloaded[0] == offloaded[1] > 0


def test_host_link_bandwidth_is_measured_once_per_device_and_overridable(model, loss_fn, monkeypatch):
    """A device-module backend measures its link once per process and device (here one whose device
    is the CPU, with pageable host memory: the CPU has no pinned memory in this torch build); the
    environment variable overrides every backend's figure, also in the plan's estimate."""

    class CpuLink(DeviceModuleBackend):
        name = "cpu"

        def supports_pinned_memory(self) -> bool:
            return False

    monkeypatch.delenv(HOST_LINK_ENV, raising=False)
    monkeypatch.setattr(base, "_MEASURED_LINKS", {})
    measured = CpuLink().host_link_bandwidth(torch.device("cpu"))
    assert 0 < measured < math.inf
    assert CpuLink().host_link_bandwidth(torch.device("cpu")) == measured  # not measured again
    assert list(base._MEASURED_LINKS) == [("cpu", None)]
    assert SimBackend(FAST_LINK).host_link_bandwidth() == FAST_LINK
    assert SimBackend().host_link_bandwidth() == math.inf
    monkeypatch.setenv(HOST_LINK_ENV, "2.5e9")
    assert CpuLink().host_link_bandwidth() == SimBackend(FAST_LINK).host_link_bandwidth() == 2.5e9
    assert hyperac.estimate(model, loss_fn, backend=SimBackend(FAST_LINK), min_swap_bytes=0).link_bandwidth == 2.5e9
    monkeypatch.setenv(HOST_LINK_ENV, "fast")
    with pytest.raises(ConfigError, match=r"HYPERAC_HOST_LINK_BANDWIDTH='fast' must be a positive number.*25e9"):
        SimBackend().host_link_bandwidth()

