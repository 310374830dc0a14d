"""Model adapters: recompute regions inside layers, exclusions, the registry and its errors."""

from __future__ import annotations

import collections
import copy
import dataclasses
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from hyperac_testing import applied_copy, assert_parity, counting_pre_hook, tiny_llama, train_step

import hyperac
from hyperac import Adapter, ConfigError
from hyperac.measure import flop_counter

NUM_LAYERS = 3
LAYERS = [f"model.layers.{i}" for i in range(NUM_LAYERS)]
WHOLE_LAYER = Adapter(region_patterns=("model.layers.*",))
MLP_ONLY = Adapter(region_patterns=("*.mlp",))
NO_ATTENTION = Adapter(region_patterns=("model.layers.*",), exclude_patterns=("*.self_attn",))


@pytest.fixture(scope="module")
def base_model():
    return tiny_llama(num_layers=NUM_LAYERS)


@pytest.fixture
def register():
    """``register(names, adapter)``; everything registered is unregistered after the test."""
    registered = []

    def do(names, adapter):
        result = hyperac.register_adapter(names, adapter)
        registered.append(names)
        return result

    yield do
    for names in registered:
        hyperac.unregister_adapter(names)


@pytest.fixture(autouse=True)
def registry_left_clean():
    import hyperac.adapters

    before = dict(hyperac.adapters._ADAPTERS)  # private: only to prove each test cleans up
    yield
    assert dict(hyperac.adapters._ADAPTERS) == before, "a test left an adapter registered"


def snapshot(model):
    return {
        "module_dicts": {name: sorted(m.__dict__) for name, m in model.named_modules()},
        "config": model.config.to_dict(),
        "use_cache": model.config.use_cache,
        "state_dict": list(model.state_dict()),
    }


def assert_untouched(model, before):
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == []
    assert hyperac.applied_plan(model) is None
    assert snapshot(model) == before


def counters(model):
    """Per layer, how often the MLP's and the attention's own forward ran: pre-hooks on their first
    sub-module (a region root's own hooks stay outside its recompute and fire once)."""
    counts = collections.Counter()
    for index, layer in enumerate(model.model.layers):
        layer.mlp.gate_proj.register_forward_pre_hook(counting_pre_hook(counts, ("mlp", index)))
        layer.self_attn.q_proj.register_forward_pre_hook(counting_pre_hook(counts, ("attn", index)))
    return counts


def step_flops(model, loss_fn):
    model.train()
    torch.manual_seed(1)
    with flop_counter() as counter:
        loss_fn(model).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def linear_flops(module, tokens):
    return sum(2 * tokens * m.in_features * m.out_features for m in module.modules() if isinstance(m, torch.nn.Linear))


# ---------------------------------------------------------------------------------------------
# the Adapter dataclass


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(region_patterns=()), r"Adapter\.region_patterns is empty"),
        (dict(region_patterns=[]), r"Adapter\.region_patterns is empty"),
        (dict(region_patterns="model.layers.*"), r"Adapter\.region_patterns must be a tuple .*got 'model\.layers\.\*'"),
        (dict(region_patterns=None), r"Adapter\.region_patterns must be a tuple .*got None"),
        (dict(region_patterns=("*.mlp", "")), r"Adapter\.region_patterns holds ''"),
        (dict(region_patterns=("*.mlp", 3)), r"Adapter\.region_patterns holds 3"),
        (dict(region_patterns=("*.mlp",), exclude_patterns="*.self_attn"),
         r"Adapter\.exclude_patterns must be a tuple .*got '\*\.self_attn'"),
        (dict(region_patterns=("*.mlp",), exclude_patterns=(None,)), r"Adapter\.exclude_patterns holds None"),
        (dict(region_patterns=("*.mlp",), exclude_predicate="self_attn"),
         r"Adapter\.exclude_predicate must be callable or None, got 'self_attn'"),
        (dict(region_patterns=("*.mlp",), on_applied=1), r"Adapter\.on_applied must be callable or None, got 1"),
    ],
    ids=repr,
)
def test_adapter_validation(options, match):
    with pytest.raises(ConfigError, match=match):
        Adapter(**options)


def test_adapter_dataclass():
    adapter = Adapter(region_patterns=["*.mlp"], exclude_patterns=["*.mlp.act_fn"])
    assert adapter.region_patterns == ("*.mlp",)
    assert adapter.exclude_patterns == ("*.mlp.act_fn",)
    assert adapter.declares_exclusions
    assert not MLP_ONLY.declares_exclusions
    assert Adapter(region_patterns=("*.mlp",), exclude_predicate=lambda f, m: False).declares_exclusions
    assert adapter == Adapter(region_patterns=("*.mlp",), exclude_patterns=("*.mlp.act_fn",))
    with pytest.raises(dataclasses.FrozenInstanceError):
        adapter.region_patterns = ("*",)
    with pytest.raises(TypeError):
        Adapter(("*.mlp",))


# ---------------------------------------------------------------------------------------------
# the registry


def test_register_validation():
    with pytest.raises(ConfigError, match=r"register_adapter needs a hyperac\.Adapter, got 'x'"):
        hyperac.register_adapter("family", "x")
    with pytest.raises(ConfigError, match=r"needs one or more non-empty names, got ''"):
        hyperac.register_adapter("", MLP_ONLY)
    with pytest.raises(ConfigError, match=r"needs one or more non-empty names, got \[\]"):
        hyperac.register_adapter([], MLP_ONLY)
    with pytest.raises(ConfigError, match=r"needs one or more non-empty names, got \['a', 3\]"):
        hyperac.register_adapter(["a", 3], MLP_ONLY)


def test_register_conflict_and_idempotence(model, register):
    assert register("toy_family", MLP_ONLY) is MLP_ONLY
    register("toy_family", MLP_ONLY)  # the same adapter again: no-op
    register("ToyFamilyForCausalLM", Adapter(region_patterns=("*.mlp",)))  # an equal one: no-op
    with pytest.raises(ConfigError, match=r"an adapter is already registered for 'TOY-FAMILY'; unregister it first"):
        hyperac.register_adapter("TOY-FAMILY", WHOLE_LAYER)
    # a conflicting name among several registers none of them
    with pytest.raises(ConfigError, match=r"already registered for 'toy_family'"):
        hyperac.register_adapter(["other_family", "toy_family"], WHOLE_LAYER)
    with pytest.raises(ConfigError, match=r"Config\.adapter='other_family' is not registered"):
        hyperac.apply(model, backend="cpu", adapter="other_family")
    hyperac.unregister_adapter("toy_family")
    register("toy_family", WHOLE_LAYER)  # after unregistering, another adapter may take the name


def test_unregister_unknown_is_ignored():
    hyperac.unregister_adapter("never-registered")
    hyperac.unregister_adapter(["never-registered", "nor-this"])


def _adapter_names(plan):
    return plan.adapter, [layer.recomputed for layer in plan.layers]


@pytest.mark.parametrize(
    "registered_as", ["toy_llama", "TOY_LLAMA", "toy-llama", "Toy Llama", "ToyLlamaForCausalLM", "toy_llama_model"]
)
def test_lookup_by_model_type_normalized(model, register, registered_as):
    model.config.model_type = "toy_llama"
    register(registered_as, MLP_ONLY)
    plan = hyperac.apply(model, backend="cpu", adapter="auto")
    assert plan.adapter == "toy_llama"
    assert [layer.recomputed for layer in plan.layers] == [(f"{fqn}.mlp",) for fqn in LAYERS]
    hyperac.remove(model)


def test_lookup_by_architecture(model, register):
    model.config.model_type = "toy_unregistered"
    model.config.architectures = ["ToyNetForCausalLM"]
    register("toy-net", MLP_ONLY)
    plan = hyperac.apply(model, backend="cpu", adapter="auto")
    assert plan.adapter == "ToyNetForCausalLM"
    assert plan.layers[0].recomputed == ("model.layers.0.mlp",)
    hyperac.remove(model)


def test_model_type_wins_over_architecture(model, register):
    model.config.model_type = "toy_a"
    model.config.architectures = ["ToyBForCausalLM"]
    register("toy_b", WHOLE_LAYER)
    register("toy_a", MLP_ONLY)
    plan = hyperac.apply(model, backend="cpu", adapter="auto")
    assert plan.adapter == "toy_a"
    assert plan.layers[0].recomputed == ("model.layers.0.mlp",)
    hyperac.remove(model)


def test_lookup_by_name_normalized(model, register):
    register("toy_mlp_regions", MLP_ONLY)
    plan = hyperac.apply(model, backend="cpu", adapter="Toy-MLP-Regions")
    assert plan.adapter == "Toy-MLP-Regions"
    assert plan.layers[0].recomputed == ("model.layers.0.mlp",)
    hyperac.remove(model)


def test_a_registered_adapter_is_used_only_when_asked_for(model, register):
    """NOTE [The registry is asked, never implied]: another library registering "toy_llama" does not
    change an apply that does not ask for the registry."""
    model.config.model_type = "toy_llama"
    register("toy_llama", MLP_ONLY)
    plan = hyperac.apply(model, backend="cpu")
    assert plan.adapter == "none"
    assert [layer.recomputed for layer in plan.layers] == [(fqn,) for fqn in LAYERS]
    hyperac.remove(model)


def test_adapter_none_opts_out(model, register):
    model.config.model_type = "toy_llama"
    register("toy_llama", MLP_ONLY)
    plan = hyperac.apply(model, backend="cpu", adapter="none")
    assert plan.adapter == "none"
    assert [layer.recomputed for layer in plan.layers] == [(fqn,) for fqn in LAYERS]
    hyperac.remove(model)


def test_unregistered_model_gets_whole_layers(model):
    model.config.model_type = "toy_nothing_registered"
    plan = hyperac.apply(model, backend="cpu", adapter="auto")
    assert plan.adapter == "none"
    assert [layer.recomputed for layer in plan.layers] == [(fqn,) for fqn in LAYERS]
    hyperac.remove(model)


def test_registry_holds_no_model(base_model, loss_fn, register):
    register("toy_llama", NO_ATTENTION)
    model = copy.deepcopy(base_model)
    model.config.model_type = "toy_llama"
    hyperac.apply(model, backend="cpu", mode="selective", adapter="auto")
    train_step(model, loss_fn)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


# ---------------------------------------------------------------------------------------------
# regions


def test_whole_layer_region_is_plain_full(base_model, loss_fn, reference):
    plain, _ = applied_copy(base_model, backend="cpu", mode="full", adapter="none")
    model, plan = applied_copy(base_model, backend="cpu", mode="full", adapter=WHOLE_LAYER)
    assert plan.adapter == "custom"
    assert [layer.recomputed for layer in plan.layers] == [(fqn,) for fqn in LAYERS]
    assert [layer.excluded for layer in plan.layers] == [()] * NUM_LAYERS
    assert "whole layer" in str(plan)
    assert step_flops(model, loss_fn) == step_flops(plain, loss_fn)
    assert_parity(reference, train_step(model, loss_fn))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_mlp_region_recomputes_only_the_mlp(base_model, loss_fn, reference, mode):
    off = copy.deepcopy(base_model)
    model, plan = applied_copy(base_model, backend="cpu", mode=mode, adapter=MLP_ONLY)
    assert [layer.recomputed for layer in plan.layers] == [(f"{fqn}.mlp",) for fqn in LAYERS]
    assert str(plan).splitlines()[2].split()[-1] == "mlp"
    counts = counters(model)
    assert_parity(reference, train_step(model, loss_fn))
    assert counts == collections.Counter({**{("mlp", i): 2 for i in range(3)}, **{("attn", i): 1 for i in range(3)}})
    extra = step_flops(model, loss_fn) - step_flops(off, loss_fn)
    tokens = 2 * 16
    mlp_forward = sum(linear_flops(layer.mlp, tokens) for layer in base_model.model.layers)
    down_proj = sum(linear_flops(layer.mlp.down_proj, tokens) for layer in base_model.model.layers)
    if mode == "full":
        # at most one more MLP forward per layer, and nothing of attention; torch's early stop may
        # skip down_proj, whose output backward does not need
        assert mlp_forward - down_proj <= extra <= mlp_forward
    else:
        assert 0 < extra < mlp_forward  # selective keeps every other matmul
    whole, _ = applied_copy(base_model, backend="cpu", mode=mode, adapter="none")
    assert step_flops(whole, loss_fn) - step_flops(off, loss_fn) > extra  # a whole layer costs more


def test_several_regions_and_outermost_match(model):
    plan = hyperac.apply(model, backend="cpu", adapter=Adapter(region_patterns=("*.input_layernorm", "*.mlp")))
    assert plan.layers[1].recomputed == ("model.layers.1.mlp", "model.layers.1.input_layernorm")
    assert "mlp, input_layernorm" in str(plan)
    hyperac.remove(model)
    plan = hyperac.apply(model, backend="cpu", adapter=Adapter(region_patterns=("*.mlp", "model.layers.*")))
    assert [layer.recomputed for layer in plan.layers] == [(fqn,) for fqn in LAYERS]
    hyperac.remove(model)


def test_regions_only_in_selected_layers(model):
    plan = hyperac.apply(model, backend="cpu", layers={0: "off"}, adapter=NO_ATTENTION)
    assert plan.layers[0].mode == "off"
    assert plan.layers[0].recomputed == () and plan.layers[0].excluded == ()
    assert plan.layers[1].recomputed == ("model.layers.1",)
    assert plan.layers[1].excluded == ("model.layers.1.self_attn",)
    layer0 = model.model.layers[0]
    assert "forward" not in layer0.__dict__ and "forward" not in layer0.self_attn.__dict__
    hyperac.remove(model)


# ---------------------------------------------------------------------------------------------
# exclusions


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize(
    "adapter",
    [
        NO_ATTENTION,
        Adapter(region_patterns=("model.layers.*",),
                exclude_predicate=lambda fqn, module: type(module).__name__ == "LlamaAttention"),
    ],
    ids=["patterns", "predicate"],
)
def test_excluded_attention_runs_once_and_gradients_match(base_model, loss_fn, reference, mode, adapter):
    model, plan = applied_copy(base_model, backend="cpu", mode=mode, adapter=adapter)
    assert [layer.recomputed for layer in plan.layers] == [(fqn,) for fqn in LAYERS]
    assert [layer.excluded for layer in plan.layers] == [(f"{fqn}.self_attn",) for fqn in LAYERS]
    assert "whole layer (not replayed: self_attn)" in str(plan)
    counts = counters(model)
    result = train_step(model, loss_fn)
    assert_parity(reference, result)  # bitwise, through the real backward of the excluded attention
    assert [counts[("attn", i)] for i in range(3)] == [1, 1, 1]
    assert [counts[("mlp", i)] for i in range(3)] == [2, 2, 2]
    # again: nothing of the first step leaks into the second
    counts.clear()
    assert_parity(reference, train_step(model, loss_fn))
    assert [counts[("attn", i)] for i in range(3)] == [1, 1, 1]


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_exclusion_with_dropout_before_and_after(mode, loss_fn):
    """The excluded attention draws dropout masks once; the MLP after it draws its own mask in
    forward and must draw the same one in the replay."""
    base = tiny_llama(num_layers=2, attention_dropout=0.3)
    for layer in base.model.layers:
        layer.mlp.register_forward_hook(lambda module, args, output: F.dropout(output, 0.3, module.training))
    reference = train_step(copy.deepcopy(base), loss_fn)
    model, _ = applied_copy(base, backend="cpu", mode=mode, adapter=NO_ATTENTION)
    assert_parity(reference, train_step(model, loss_fn))


def test_forward_without_backward_then_step(base_model, loss_fn, reference):
    model, _ = applied_copy(base_model, backend="cpu", mode="selective", adapter=NO_ATTENTION)
    model.train()
    loss_fn(model)  # a forward whose backward never runs
    assert_parity(reference, train_step(model, loss_fn))


def test_exclusions_idle_in_eval_and_removed(base_model, loss_fn):
    ids = torch.randint(0, 128, (1, 8))
    model, _ = applied_copy(base_model, backend="cpu", mode="full", adapter=NO_ATTENTION)
    counts = counters(model)
    model.eval()
    with torch.no_grad():
        expected = base_model.eval()(input_ids=ids).logits
        torch.testing.assert_close(model(input_ids=ids).logits, expected, rtol=0, atol=0)
    assert set(counts.values()) == {1}
    hyperac.remove(model)
    assert [n for n, m in model.named_modules() if "forward" in m.__dict__] == []
    base_model.train()


def test_on_applied_called_once_with_model(model, loss_fn):
    calls = []

    def on_applied(applied):
        calls.append(applied)
        assert hyperac.applied_plan(applied) is not None  # called once everything is in place
        assert "forward" in applied.model.layers[0].__dict__
        assert "forward" in applied.model.layers[0].self_attn.__dict__

    adapter = Adapter(region_patterns=("model.layers.*",), exclude_patterns=("*.self_attn",), on_applied=on_applied)
    hyperac.apply(model, backend="cpu", adapter=adapter)
    assert calls == [model] and calls[0] is model
    train_step(model, loss_fn)
    hyperac.remove(model)
    assert len(calls) == 1


def test_compile_without_exclusions_is_allowed(model):
    plan = hyperac.apply(model, backend="cpu", mode="selective", compile=True, adapter=MLP_ONLY)
    assert plan.layers[0].recomputed == ("model.layers.0.mlp",)
    hyperac.remove(model)


# ---------------------------------------------------------------------------------------------
# errors at apply, model untouched


@pytest.mark.parametrize(
    ("adapter", "options", "match"),
    [
        (Adapter(region_patterns=("*.nothing",)), {},
         r"Adapter\.region_patterns \('\*\.nothing',\) matched no module inside the selected layers"),
        (Adapter(region_patterns=("model.norm",)), {}, r"region_patterns \('model\.norm',\) matched no module"),
        (Adapter(region_patterns=("model.layers.0.mlp",)), {"layers": {0: "off"}}, r"matched no module"),
        (Adapter(region_patterns=("model.layers.*",), exclude_patterns=("*.nothing",)), {},
         r"Adapter exclusions \('\*\.nothing',\) matched no module inside the recompute regions"),
        (Adapter(region_patterns=("*.mlp",), exclude_patterns=("*.self_attn",)), {},
         r"exclusions \('\*\.self_attn',\) matched no module inside the recompute regions"),
        (Adapter(region_patterns=("*.mlp",), exclude_predicate=lambda fqn, module: False), {},
         r"Adapter exclusions \(\) matched no module"),
        (Adapter(region_patterns=("*.mlp",), exclude_patterns=("*.mlp",)), {},
         r"recompute region root 'model\.layers\.0\.mlp' is also excluded"),
        (Adapter(region_patterns=("model.layers.*",), exclude_patterns=("model.layers.1",)), {},
         r"recompute region root 'model\.layers\.1' is also excluded"),
        (Adapter(region_patterns=("*.mlp",), exclude_patterns=("*.layers.0",)), {},
         r"recompute region root 'model\.layers\.0\.mlp' lies inside excluded module 'model\.layers\.0'"),
        (Adapter(region_patterns=("model.layers.*",), exclude_patterns=("*.self_attn", "*.self_attn.q_proj")), {},
         r"excluded module 'model\.layers\.0\.self_attn\.q_proj' lies inside excluded module "
         r"'model\.layers\.0\.self_attn'; nested exclusions are not supported"),
        (NO_ATTENTION, {"compile": True},
         r"Config\.compile=True cannot be combined with adapter exclusions"),
        (NO_ATTENTION, {"compile": True, "mode": "selective"}, r"compile=True cannot be combined"),
    ],
    ids=[
        "matches-nothing", "outside-layers", "only-in-unselected-layer", "exclusion-matches-nothing",
        "exclusion-outside-region", "predicate-matches-nothing", "root-excluded", "layer-root-excluded",
        "exclusion-contains-root", "nested-exclusions", "compile-full", "compile-selective",
    ],
)
def test_region_errors_leave_model_untouched(model, adapter, options, match):
    calls = []
    adapter = dataclasses.replace(adapter, on_applied=calls.append)
    before = snapshot(model)
    with pytest.raises(ConfigError, match=match):
        hyperac.apply(model, backend="cpu", adapter=adapter, **options)
    assert_untouched(model, before)
    assert calls == []


def test_registered_adapter_errors_name_the_problem(model, register):
    model.config.model_type = "toy_broken"
    register("toy_broken", Adapter(region_patterns=("*.feed_forward",)))
    before = snapshot(model)
    with pytest.raises(ConfigError, match=r"region_patterns \('\*\.feed_forward',\) matched no module"):
        hyperac.apply(model, backend="cpu", adapter="auto")
    assert_untouched(model, before)
    hyperac.apply(model, backend="cpu")  # the way out: the registry is not asked
    hyperac.remove(model)
