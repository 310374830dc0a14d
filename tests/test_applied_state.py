"""Applied state is data the model owns (issue 9 items 1, 3 and the process-wide side effects):
copies, pickles and saves are independent applied models; overlapping applies are refused; any
sequence of applies and removes ends bit-identical to never-applied."""

from __future__ import annotations

import copy
import gc
import io
import os
import pickle
import threading

import pytest
import torch
from hyperac_testing import assert_parity, tiny_llama, train_step
from torch import nn

import hyperac
from hyperac import ConfigError
from hyperac.backends import get_backend
from hyperac.measure import flop_counter
from hyperac.swap import HostPool, _Entry, default_host_budget

OPTIONS = [dict(backend="cpu", mode="full"), dict(backend="cpu", mode="selective"),
           dict(backend="cpu", layers={"0": "full", "1-": "pointwise"}),
           dict(backend="sim", mode="swap", min_swap_bytes=0),
           dict(backend="sim", mode="full", swap_inputs=True, min_swap_bytes=0)]


@pytest.fixture(scope="module")
def base_model():
    return tiny_llama(num_layers=3)


def _value(value, identities):
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return value
    if isinstance(value, dict):
        return [(key, _value(item, identities)) for key, item in value.items()]
    if isinstance(value, (set, frozenset)):
        return sorted(map(repr, value))
    return id(value) if identities else type(value)


def snapshot(model, identities=True):
    """Every module's instance ``__dict__`` (hook dicts, parameters, instance forward included, by
    identity) and every config's ``__dict__`` and ``to_dict()``: what never-applied means."""
    modules = {name: {key: _value(value, identities) for key, value in vars(module).items()}
               for name, module in model.named_modules()}
    configs = {name: (module.config.to_dict(), {k: _value(v, identities) for k, v in vars(module.config).items()})
               for name, module in model.named_modules() if "config" in vars(module)}
    return modules, configs


def step_flops(model, loss_fn):
    with flop_counter() as counter:
        result = train_step(model, loss_fn)
    return result, counter.get_total_flops()


@pytest.fixture(scope="module")
def reference(base_model, loss_fn):
    return step_flops(copy.deepcopy(base_model), loss_fn)


# ---------------------------------------------------------------------------------------------
# item 1: copies


@pytest.mark.parametrize("options", OPTIONS, ids=str)
@pytest.mark.parametrize("remove_first", ["copy", "original"])
def test_deepcopy_is_an_independent_applied_model(base_model, loss_fn, reference, options, remove_first):
    (ref_result, plain_flops) = reference
    original = copy.deepcopy(base_model)
    never, never_shape = snapshot(original), snapshot(original, identities=False)
    plan = hyperac.apply(original, **options)
    clone = copy.deepcopy(original)
    assert hyperac.applied_plan(clone) == plan and hyperac.applied_plan(clone) is not plan
    result, applied_flops = step_flops(original, loss_fn)
    assert_parity(ref_result, result)
    assert_parity(ref_result, step_flops(clone, loss_fn)[0])
    if options["backend"] == "sim":
        assert hyperac.swap_stats(clone) is not hyperac.swap_stats(original)
        assert hyperac.swap_stats(clone).offloaded_bytes == hyperac.swap_stats(original).offloaded_bytes > 0
        hyperac.swap_stats(clone).reset()
        assert hyperac.swap_stats(original).offloaded_bytes > 0
    first, second = (clone, original) if remove_first == "copy" else (original, clone)
    hyperac.remove(first)
    assert hyperac.applied_plan(second) == plan  # the other one is still applied, and still recomputes
    assert_parity(ref_result, (result := step_flops(second, loss_fn))[0])
    assert result[1] == applied_flops
    assert step_flops(first, loss_fn)[1] == plain_flops  # the removed one is plain again
    hyperac.remove(second)
    assert snapshot(original) == never  # bit-identical to never-applied
    assert snapshot(clone, identities=False) == never_shape


@pytest.mark.parametrize(("options", "how"), [(options, "pickle") for options in OPTIONS]
                         + [(OPTIONS[1], "torch.save"), (OPTIONS[4], "torch.save")], ids=str)
def test_pickled_and_saved_applied_model_trains_with_equal_gradients(base_model, loss_fn, reference, options, how):
    ref_result, _ = reference
    model = copy.deepcopy(base_model)
    plan = hyperac.apply(model, **options)
    applied_flops = step_flops(copy.deepcopy(model), loss_fn)[1]
    if how == "pickle":
        loaded = pickle.loads(pickle.dumps(model))
    else:
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
    assert hyperac.applied_plan(loaded) == plan
    result, flops = step_flops(loaded, loss_fn)
    assert_parity(ref_result, result)
    assert flops == applied_flops  # it recomputes as the applied model does
    if options["backend"] == "sim":
        assert hyperac.swap_stats(loaded).offloaded_bytes > 0 and hyperac.swap_stats(model).offloaded_bytes == 0
    hyperac.remove(loaded)
    assert snapshot(loaded, identities=False) == snapshot(base_model, identities=False)
    assert hyperac.applied_plan(model) == plan


def test_copies_of_a_swap_model_have_their_own_manager_and_pool(base_model, loss_fn):
    model = copy.deepcopy(base_model)
    hyperac.apply(model, backend="sim", mode="swap", min_swap_bytes=0, host_budget_bytes=1 << 20)
    managers = [m.__dict__["_hyperac_state"].swap for m in (model, copy.deepcopy(model),
                                                            pickle.loads(pickle.dumps(model)))]
    assert len({id(m) for m in managers}) == 3 and len({id(m.pool) for m in managers}) == 3
    assert {(m.min_swap_bytes, m.pool.budget_bytes, type(m.backend).__name__) for m in managers} == {
        (0, 1 << 20, "SimBackend")}
    for layer in model.model.layers:  # each override's manager is the model's own
        assert layer.__dict__["forward"].swap.manager is managers[0]


# ---------------------------------------------------------------------------------------------
# item 3: overlapping applies


def test_child_then_parent_is_refused_naming_both(base_model):
    model = copy.deepcopy(base_model)
    never = snapshot(model)
    hyperac.apply(model.model, backend="cpu", mode="full")
    applied = snapshot(model)
    with pytest.raises(ConfigError, match=r"already applied to 'model' \(LlamaModel\) inside this LlamaForCausalLM"):
        hyperac.apply(model, backend="cpu", mode="selective")
    assert snapshot(model) == applied
    hyperac.remove(model.model)
    assert snapshot(model) == never


def test_parent_then_child_is_refused_naming_both(base_model):
    model = copy.deepcopy(base_model)
    never = snapshot(model)
    hyperac.apply(model, backend="cpu", mode="full")
    applied = snapshot(model)
    with pytest.raises(ConfigError, match=r"this LlamaModel shares a module with a LlamaForCausalLM that hyperac is "
                                          r"applied to: itself here is 'model' there"):
        hyperac.apply(model.model, backend="cpu", mode="full")
    assert snapshot(model) == applied
    hyperac.remove(model)
    assert snapshot(model) == never


def _mlp_only():
    return hyperac.Adapter(region_patterns=("model.layers.*.mlp",))


@pytest.mark.parametrize("first", [0, 1])
def test_two_models_sharing_a_layer_are_refused(first):
    models = [tiny_llama(num_layers=2), tiny_llama(num_layers=2)]
    models[1].model.layers[0].mlp = models[0].model.layers[0].mlp
    never = [snapshot(m) for m in models]
    hyperac.apply(models[first], backend="cpu", mode="full", adapter=_mlp_only())
    with pytest.raises(ConfigError, match=r"shares a module with a LlamaForCausalLM .*'model.layers.0.mlp' here"):
        hyperac.apply(models[1 - first], backend="cpu", mode="full", adapter=_mlp_only())
    assert hyperac.applied_plan(models[1 - first]) is None
    hyperac.remove(models[first])
    assert [snapshot(m) for m in models] == never
    # once the first is removed, the other may be applied, and undone
    hyperac.apply(models[1 - first], backend="cpu", mode="full", adapter=_mlp_only())
    hyperac.remove(models[1 - first])
    assert [snapshot(m) for m in models] == never


def test_any_sequence_of_applies_and_removes_ends_bit_identical(base_model, loss_fn):
    model = copy.deepcopy(base_model)
    never = snapshot(model)
    steps = [
        (model.model, dict(mode="full")), (model, dict(mode="selective")), ("remove", model.model),
        (model, dict(mode="pointwise")), (model.model, dict(mode="full")), ("remove", model),
        (model, dict(layers={"0": "full", "1-": "swap"}, backend="sim", min_swap_bytes=0)), ("train", model),
        ("copy", model), ("remove", model),
    ]
    copies = []
    for target, options in steps:
        if target == "remove":
            hyperac.remove(options)
        elif target == "train":
            train_step(options, loss_fn)
            options.zero_grad(set_to_none=True)
        elif target == "copy":
            copies.append(copy.deepcopy(options))
        else:
            try:
                hyperac.apply(target, **{"backend": "cpu", **options})
            except ConfigError as error:
                assert "overlap" in str(error) or "shares a module" in str(error)
    assert snapshot(model) == never
    hyperac.remove(copies[0])
    assert snapshot(copies[0], identities=False) == snapshot(base_model, identities=False)


# ---------------------------------------------------------------------------------------------
# process-wide side effects: host budget, pool lock


def test_default_host_budget_is_shared_by_the_local_processes(base_model, monkeypatch):
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert default_host_budget() == physical // 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert default_host_budget() == physical // 2 // 8
    model = copy.deepcopy(base_model)
    hyperac.apply(model, backend="sim", mode="swap")
    assert model.__dict__["_hyperac_state"].swap.pool.budget_bytes == physical // 16
    hyperac.remove(model)
    for bad in ("0", "four", "-2"):
        monkeypatch.setenv("LOCAL_WORLD_SIZE", bad)
        with pytest.raises(ConfigError, match=rf"LOCAL_WORLD_SIZE='{bad}' must be a positive integer.*host_budget"):
            hyperac.apply(model, backend="sim", mode="swap")
        assert hyperac.applied_plan(model) is None
    hyperac.apply(model, backend="sim", mode="swap", host_budget_bytes=4096)  # an explicit budget needs no env
    hyperac.remove(model)


class _CollectingDict(dict):
    """A pool's free lists that run the garbage collector while the pool's lock is held."""

    def setdefault(self, key, default=None):
        gc.collect()
        return super().setdefault(key, default)


def test_gc_inside_release_returning_a_buffer_does_not_deadlock():
    pool = HostPool(get_backend("sim"), 1 << 20)
    pool._free = _CollectingDict()
    held = pool.acquire(64)
    entry = _Entry(torch.empty(64, dtype=torch.uint8).untyped_storage(), torch.device("cpu"), pool, in_place=False)
    entry.host = pool.acquire(64)
    entry.cached = [entry]  # a cycle: only the collector frees it, calling __del__ -> pool.release
    del entry
    done = threading.Event()

    def release():
        pool.release(held)  # collects inside the lock; the entry's __del__ returns its buffer
        done.set()

    threading.Thread(target=release, daemon=True).start()
    assert done.wait(10), "HostPool.release deadlocked on its own lock when a collection ran inside it"
    assert sorted(len(buffers) for buffers in pool._free.values()) == [2]


# ---------------------------------------------------------------------------------------------
# the override is data


def test_overrides_and_hooks_are_module_level_objects(base_model):
    model = copy.deepcopy(base_model)
    hyperac.apply(model, backend="cpu", mode="full")
    forward = model.model.layers[0].__dict__["forward"]
    assert type(forward).__module__ == "hyperac.recompute" and forward.fqn == "model.layers.0"
    hooks = [hook for m in model.modules() for hook in m._forward_pre_hooks.values()]
    assert {type(hook).__qualname__ for hook in hooks} == {"TrainingCacheDefault"}
    assert all(not isinstance(hook, type(lambda: 0)) for hook in hooks)
    assert isinstance(pickle.loads(pickle.dumps(forward.owner)).plan, hyperac.Plan)
    hyperac.remove(model)
    assert isinstance(model.model.layers[0].forward.__self__, nn.Module)
