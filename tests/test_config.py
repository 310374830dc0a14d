"""Bad input to ``hyperac.apply``: every wrong option raises ``ConfigError`` that names the field
and echoes the value, and a failing ``apply`` leaves the model exactly as it was."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

import pytest

import hyperac
from hyperac import Config, ConfigError

# ---------------------------------------------------------------------------------------------
# helpers


def snapshot(model):
    """Everything a failed ``apply`` could have touched."""
    return {
        "module_dicts": {name: sorted(m.__dict__) for name, m in model.named_modules()},
        "use_cache": model.config.use_cache,
        "config": model.config.to_dict(),
        "state_dict_keys": list(model.state_dict()),
        "hooks": {
            name: (len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for name, m in model.named_modules()
        },
    }


def assert_untouched(model, before):
    overridden = [name for name, m in model.named_modules() if "forward" in m.__dict__]
    assert overridden == [], f"instance forward left on {overridden}"
    assert "_hyperac_state" not in model.__dict__
    assert hyperac.applied_plan(model) is None
    assert model.config.use_cache is before["use_cache"]
    assert snapshot(model) == before


def assert_apply_fails(model, match, exc=ConfigError, **options):
    before = snapshot(model)
    with pytest.raises(exc, match=match):
        hyperac.apply(model, **options)
    assert_untouched(model, before)
    # the model is still usable: a correct apply afterwards works and can be undone
    hyperac.apply(model, backend="cpu")
    hyperac.remove(model)
    assert_untouched(model, before)


# ---------------------------------------------------------------------------------------------
# options rejected by Config itself (and therefore by apply, before the model is touched)

CONFIG_ERRORS = [
    # mode
    (dict(mode="fast"),
     r"Config\.mode must be one of 'off', 'full', 'selective', 'selective-even', 'pointwise', 'swap', "
     r"'knapsack-0\.25', 'knapsack-0\.5', 'knapsack-0\.75', 'auto', got 'fast'"),
    (dict(mode="FULL"), r"Config\.mode .*got 'FULL'"),
    (dict(mode=True), r"Config\.mode .*got True"),
    (dict(mode=None), r"Config\.mode .*got None"),
    (dict(mode=1), r"Config\.mode .*got 1"),
    # bools must be real bools
    (dict(compile=1), r"Config\.compile must be a bool .*got 1 of type int"),
    (dict(compile="yes"), r"Config\.compile .*got 'yes' of type str"),
    (dict(compile=None), r"Config\.compile .*got None"),
    # backend of the wrong type
    (dict(backend=True), r"Config\.backend .*got True"),
    (dict(backend=None), r"Config\.backend .*got None"),
    (dict(backend=3), r"Config\.backend .*got 3"),
    # adapter of the wrong type
    (dict(adapter=True), r"Config\.adapter .*got True"),
    (dict(adapter=3), r"Config\.adapter .*got 3"),
    (dict(adapter={"region_patterns": ("*.mlp",)}), r"Config\.adapter .*got \{'region_patterns'"),
    # layers of the wrong type
    (dict(layers=True), r"Config\.layers must be None.*got True"),
    (dict(layers=3), r"Config\.layers must be None.*got 3"),
    (dict(layers=[]), r"Config\.layers must be None.*got \[\]"),
    (dict(layers=[1, 2]), r"Config\.layers must be None.*got \[1, 2\]"),
    (dict(layers=b"model.layers"), r"Config\.layers must be None.*got b'model\.layers'"),
    (dict(layers={}), r"Config\.layers is an empty mapping"),
    (dict(layers=["model.layers", "model.layers"]), r"Config\.layers lists a container path twice"),
    # per-layer mappings
    (dict(layers={"0-3": "full", "2-5": "off"}), r"Config\.layers entries overlap: layers 0-3 and 2-5"),
    (dict(layers={"0-1": "full", "1-2": "off"}), r"Config\.layers entries overlap: layers 0-1 and 1-2"),
    (dict(layers={"2-": "full", "5-6": "off", 3: "off"}), r"Config\.layers entries overlap: layers 2- and 5-6"),
    (dict(layers={"3": "off", 3: "full"}), r"Config\.layers entries overlap: layers 3 and 3"),
    (dict(layers={"5-2": "full"}), r"Config\.layers range '5-2' ends before it starts"),
    (dict(layers={-1: "off"}), r"Config\.layers key -1 is negative"),
    (dict(layers={True: "off"}), r"Config\.layers key True is a bool"),
    (dict(layers={False: "off"}), r"Config\.layers key False is a bool"),
    (dict(layers={0: "fast"}), r"Config\.layers\[0\] must be one of 'off', 'full', 'selective'.*got 'fast'"),
    (dict(layers={"1-2": "Full"}), r"Config\.layers\['1-2'\] must be one of .*got 'Full'"),
    (dict(layers={0: True}), r"Config\.layers\[0\] must be one of .*got True"),
    (dict(layers={0: None}), r"Config\.layers\[0\] must be one of .*got None"),
    (dict(layers={"model.layers": "fast"}), r"Config\.layers\['model\.layers'\] must be one of .*got 'fast'"),
    (dict(layers={"model.layers": {"0-1": "fast"}}), r"Config\.layers\['model\.layers'\]\['0-1'\] .*got 'fast'"),
    (dict(layers={"model.layers": {"3-1": "off"}}), r"Config\.layers\['model\.layers'\] range '3-1' ends before"),
    (dict(layers={"model.layers": "full", 0: "off"}), r"Config\.layers mixes layer indices \[0\] with container paths"),
    (dict(layers={"model.layers": "full", "1-2": "off"}), r"Config\.layers mixes layer indices \['1-2'\]"),
    # a key that is neither a layer index/range nor a container path
    (dict(layers={1.5: "off"}), r"Config\.layers key 1\.5"),
    (dict(layers={None: "off"}), r"Config\.layers key None"),
]


@pytest.mark.parametrize(("options", "match"), CONFIG_ERRORS, ids=[repr(o) for o, _ in CONFIG_ERRORS])
def test_bad_option_rejected_by_config(options, match):
    with pytest.raises(ConfigError, match=match):
        Config(**options)


@pytest.mark.parametrize(("options", "match"), CONFIG_ERRORS, ids=[repr(o) for o, _ in CONFIG_ERRORS])
def test_bad_option_rejected_by_apply_model_untouched(model, options, match):
    assert_apply_fails(model, match, **options)


# ---------------------------------------------------------------------------------------------
# options only checkable against the model (at apply)

APPLY_ERRORS = [
    (dict(layers={7: "off"}), r"Config\.layers names layer 7, but the model has 4 layers \(0-3\)"),
    (dict(layers={"2-9": "off"}), r"Config\.layers names layer 9, but the model has 4 layers"),
    (dict(layers={"4-": "selective"}), r"Config\.layers names layer 4, but the model has 4 layers"),
    (dict(layers={"model.layers": {7: "off"}}), r"Config\.layers\['model\.layers'\] names layer 7, .*has 4 layers"),
    (dict(layers="model.nothing"), r"Config\.layers names 'model\.nothing', but LlamaForCausalLM has no such"),
    (dict(layers=["model.layers", "nope"]), r"Config\.layers names 'nope'.*no such submodule"),
    (dict(layers="model.norm"), r"Config\.layers names 'model\.norm', a LlamaRMSNorm, not a non-empty ModuleList"),
    (dict(layers="model.layers.0"), r"Config\.layers names 'model\.layers\.0', a LlamaDecoderLayer, not a"),
    (dict(layers={"model.missing": "full"}), r"Config\.layers names 'model\.missing'.*no such submodule"),
    (dict(backend="tpu"), r"backend='tpu' is not a registered backend"),
    (dict(adapter="no-such-adapter"), r"Config\.adapter='no-such-adapter' is not registered"),
]


@pytest.mark.parametrize(("options", "match"), APPLY_ERRORS, ids=[repr(o) for o, _ in APPLY_ERRORS])
def test_bad_option_rejected_at_apply_model_untouched(model, options, match):
    Config(**options)  # valid on its own: only the model can tell
    assert_apply_fails(model, match, **options)


def test_config_and_keyword_together(model):
    assert_apply_fails(model, r"pass either config= or keyword options, not both .*\['mode'\]",
                       config=Config(), mode="full")
    assert_apply_fails(model, r"not both .*\['backend', 'layers'\]", config=Config(), backend="cpu", layers=None)


def test_config_of_wrong_type(model):
    assert_apply_fails(model, r"config must be a hyperac\.Config or None, got \{'mode': 'full'\}",
                       config={"mode": "full"})


def test_errors_are_value_errors():
    assert issubclass(ConfigError, ValueError)
    assert issubclass(ConfigError, hyperac.HyperACError)
    with pytest.raises(ValueError):
        Config(mode="fast")


# ---------------------------------------------------------------------------------------------
# accepted spellings


@pytest.mark.parametrize(
    ("layers", "modes"),
    [
        ({0: False}, ["off", "full", "full", "full"]),  # YAML reads a bare `off` as False
        ({"1-2": False, 3: "selective"}, ["full", "off", "off", "selective"]),
        ({"model.layers": False}, ["off"] * 4),
        ({"model.layers": {"0-1": False}}, ["off", "off", "full", "full"]),
        ({" 1 - 2 ": "off", "3": "selective"}, ["full", "off", "off", "selective"]),
        ({"0-0": "off", "1-": "selective"}, ["off", "selective", "selective", "selective"]),
        # a single index inside a range overrides it there (design.md section 3), whatever the key order
        ({"0-3": "selective", 2: "off"}, ["selective", "selective", "off", "selective"]),
        ({3: "off", "1-": "selective"}, ["full", "selective", "selective", "off"]),
        ({"0-1": "off", "2-": "selective", 0: "full", "3": "pointwise"}, ["full", "off", "selective", "pointwise"]),
        ("model.layers", ["full"] * 4),
        (["model.layers"], ["full"] * 4),
        (("model.layers",), ["full"] * 4),
    ],
)
def test_accepted_layer_specs(model, layers, modes):
    plan = hyperac.apply(model, backend="cpu", layers=layers)
    try:
        assert [layer.mode for layer in plan.layers] == modes
    finally:
        hyperac.remove(model)


def test_config_passed_whole(model):
    config = Config(mode="selective", backend="cpu", layers={0: "off"})
    plan = hyperac.apply(model, config)
    try:
        assert [layer.mode for layer in plan.layers] == ["off", "selective", "selective", "selective"]
    finally:
        hyperac.remove(model)


# ---------------------------------------------------------------------------------------------
# the Config dataclass


def test_config_is_frozen():
    config = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.mode = "selective"
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.layers = {0: "off"}
    assert config.mode == "full"


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        Config("selective")


def test_apply_keywords_are_exactly_config_fields():
    parameters = inspect.signature(hyperac.apply).parameters
    assert list(parameters)[:2] == ["model", "config"]
    keywords = [name for name, p in parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
    assert keywords == [field.name for field in dataclasses.fields(Config)]
    assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    assert all(p.kind is not inspect.Parameter.VAR_POSITIONAL for p in parameters.values())


def test_config_fields_have_docstrings():
    tree = ast.parse(textwrap.dedent(inspect.getsource(Config)))
    body = tree.body[0].body
    undocumented = []
    for statement, following in zip(body, body[1:] + [None]):
        if isinstance(statement, ast.AnnAssign):
            documented = (
                isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            )
            if not documented:
                undocumented.append(statement.target.id)
    assert undocumented == []


def test_config_equality():
    assert Config() == Config()
    assert Config() == Config(mode="full", backend="auto", layers=None, compile=False)
    assert Config(mode="selective", layers={"0-1": "off", 3: "full"}) == Config(
        mode="selective", layers={"0-1": "off", 3: "full"}
    )
    assert Config(mode="selective") != Config(mode="full")
    assert Config(layers={0: "off"}) != Config(layers={1: "off"})
    assert Config(compile=True) != Config()
    assert hash(Config()) == hash(Config())
    assert dataclasses.replace(Config(), mode="selective") == Config(mode="selective")


def test_replace_validates():
    with pytest.raises(ConfigError, match=r"Config\.compile .*got 'no'"):
        dataclasses.replace(Config(), compile="no")


# ---------------------------------------------------------------------------------------------
# messages a newcomer meets first


def test_signature_shows_the_real_defaults():
    """help(hyperac.apply) reads like the documentation: each keyword shows Config's default."""
    signature = inspect.signature(hyperac.apply)
    for field in dataclasses.fields(Config):
        assert repr(signature.parameters[field.name].default) == repr(field.default), field.name
    assert "object at 0x" not in str(signature)


def test_a_keyword_equal_to_its_default_still_conflicts_with_config(model):
    assert_apply_fails(model, r"pass either config= or keyword options, not both .*\['mode'\]",
                       config=Config(), mode="full")


def test_mode_passed_positionally_says_mode_equals(model):
    assert_apply_fails(model, r"the second argument of apply is config=, got the mode 'full'; pass it by name: "
                              r"hyperac\.apply\(model, mode='full'\)", config="full")


@pytest.mark.parametrize(("budget", "expected"), [("50%", 500), ("12.5 %", 125), ("100%", 1000)])
def test_budget_as_a_percentage(budget, expected):
    from hyperac.budget import parse_budget

    assert parse_budget(budget, 1000) == expected
    Config(mode="auto", budget=budget, sample={"input_ids": None})


@pytest.mark.parametrize("budget", ["0%", "150%", "-5%", "%", "50%%"])
def test_budget_percentage_out_of_range(budget):
    with pytest.raises(ConfigError, match=r"Config\.budget must be .*percentage like '50%'.*got"):
        Config(mode="auto", budget=budget, sample={"input_ids": None})


PLAN_LAYER = {"index": 0, "fqn": "model.layers.0", "mode": "full"}


@pytest.mark.parametrize(("plan", "match"), [
    ({"backend": "cpu"}, r"^Config\.plan lacks \['layers'\]; a plan dict has \['adapter', 'backend', .*\] \(backend, "
                         r"layers required\), as Plan\.to_dict\(\) and `hyperac plan --output` write it\.$"),
    ({"layers": []}, r"^Config\.plan lacks \['backend'\]; a plan dict has"),
    ({"backend": "cpu", "layers": {"0": "full"}}, r"^Config\.plan\['layers'\] is \{'0': 'full'\}; give a list"),
    ({"backend": "cpu", "layers": ["full"]}, r"Config\.plan\['layers'\]\[0\] is a str, not a dict; give a layer dict "
                                            r"with \['fqn', 'index', 'mode'\] \(and optionally \['excluded', "),
    ({"backend": "cpu", "layers": [{"index": 0, "mode": "full"}]}, r"Config\.plan\['layers'\]\[0\] lacks \['fqn'\]"),
    ({"backend": "cpu", "layers": [{**PLAN_LAYER, "speed": 1}]}, r"\[0\] has unknown keys \['speed'\]"),
    ({"backend": "cpu", "layers": [{**PLAN_LAYER, "mode": "fast"}]}, r"\[0\]\['mode'\] is 'fast'; give one of \["),
])
def test_malformed_plan_dict(plan, match):
    with pytest.raises(ConfigError, match=match):
        Config(plan=plan)


def test_no_repeated_layers_names_a_real_container_or_what_to_change():
    from torch import nn

    from hyperac import UnsupportedModelError

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stack = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))

        def forward(self, x):
            return self.stack(x)

    with pytest.raises(UnsupportedModelError, match=r"name the container: hyperac\.apply\(model, layers='stack'\) "
                                                    r"\(containers it has: \['stack'\]\)\.$"):
        hyperac.apply(Net())
    with pytest.raises(UnsupportedModelError, match=r"the model itself is the Sequential of layers, which layers= "
                                                    r"cannot name: hold it in a module"):
        hyperac.apply(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
    with pytest.raises(UnsupportedModelError, match=r"it holds no ModuleList, ModuleDict or Sequential of two or "
                                                    r"more modules") as raised:
        hyperac.apply(nn.Linear(4, 4))
    assert "candidates" not in str(raised.value)


def test_estimate_device_profile_only_for_meta_models(model):
    import torch

    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(ConfigError, match=r"estimate\(device_profile='h100'\) costs a model on the meta device by a "
                                          r"roofline, but this model is on 'cpu' and is timed where it runs"):
        hyperac.estimate(model, {"input_ids": ids, "labels": ids}, backend="cpu", device_profile="h100")


def test_auto_plans_without_apply_calling_itself(model, monkeypatch):
    """NOTE [One installation path] in api.py: the planner's profiling installs each uniform mode through the
    same function apply uses, not through apply (which would re-enter itself while it plans)."""
    import torch

    from hyperac import api

    calls = []
    real_apply = api.apply
    monkeypatch.setattr(api, "apply", lambda *args, **kwargs: calls.append(kwargs.get("mode")) or real_apply(
        *args, **kwargs))
    ids = torch.zeros(1, 8, dtype=torch.long)
    plan = api.apply(model, mode="auto", budget=0.9, sample={"input_ids": ids, "labels": ids}, backend="cpu")
    try:
        assert calls == ["auto"] and len(plan.layers) == 4
    finally:
        hyperac.remove(model)
