"""Plan files as users keep them: written by ``hyperac plan --output`` or ``Plan.to_dict()``, edited,
and loaded back with ``apply(model, plan=json.load(...))``. Every field of the plan dict, of its
layers and of its length buckets is checked when it is read (NOTE [Plan files] in hyperac/plan.py):
a bad one is a ``ConfigError`` naming the field, its value and what is allowed, never a raw
``TypeError``, and the model stays as it was. The property test corrupts valid plans at random (a
field set to a value of another type, removed, or duplicated, in a list or under another key).
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from hyperac_testing import Stack, hook_count
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import hyperac
from hyperac import ConfigError
from hyperac.plan import PLAN_FORMAT, LayerPlan, LengthBucket, Plan

EXAMPLES = int(os.environ.get("HYPERAC_PLAN_FILE_EXAMPLES", "150"))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


def written_plan() -> dict:
    """A plan file as a user keeps it: three layers (full, selective, off), two length buckets and
    the predictions, through JSON."""
    plan = hyperac.apply(model := Stack(Block, 3), layers={0: "full", 1: "selective", 2: "off"})
    hyperac.remove(model)
    data = plan.to_dict()
    data.update(max_seq_len=16, seq_dim=1, batch_shape=[2, 16], predicted_bytes=4096, predicted_peak_bytes=8192,
                predicted_step_seconds=0.002, predicted_recompute_flops=10**6, predicted_swap_bytes=0,
                budget_bytes=10**4, buckets=[LengthBucket(8, ("off", "full", "off"), 1024, 0.001, 512, 100).to_dict(),
                                             LengthBucket(16, ("full", "selective", "off")).to_dict()])
    return json.loads(json.dumps(data))


PLAN = written_plan()
FIELD_NAMES = sorted({*PLAN, *PLAN["layers"][0], *PLAN["buckets"][0]})
WRONG_VALUES = st.sampled_from([None, True, False, 7, -1, 2.5, float("nan"), "x", "", [], ["x"], [1], [None], {},
                                {"mode": "full"}])


def locations(data, path=()):
    """Every ``(path, container, key)`` of ``data``: dict keys and list positions, at every depth."""
    items = data.items() if isinstance(data, dict) else enumerate(data)
    for key, value in items:
        yield (*path, key), data, key
        if isinstance(value, (dict, list)):
            yield from locations(value, (*path, key))


@st.composite
def corrupted(draw):
    """``(plan dict, the field a refusal must name)``: one random change to :data:`PLAN`."""
    data = copy.deepcopy(PLAN)
    path, container, key = draw(st.sampled_from(list(locations(data))))
    field = [step for step in path if isinstance(step, str)][-1]
    change = draw(st.sampled_from(["set", "remove", "duplicate"]))
    if change == "set":
        container[key] = draw(WRONG_VALUES)
    elif change == "remove":
        del container[key]
    elif isinstance(container, list):
        container.insert(key, copy.deepcopy(container[key]))
    else:
        field = draw(st.sampled_from([name for name in FIELD_NAMES if name not in container] + [f"{key}_again"]))
        container[field] = copy.deepcopy(container[key])
    return data, field


def untouched(model):
    """What apply changes and remove restores: parameters and buffers (values and identity), module
    classes, instance ``forward`` overrides and hooks."""
    return ([(name, id(tensor), tensor.clone()) for name, tensor in model.state_dict(keep_vars=True).items()],
            [(name, type(module), module.__dict__.get("forward")) for name, module in model.named_modules()],
            hook_count(model))


def assert_same(before, after):
    (tensors, modules, hooks), (tensors_now, modules_now, hooks_now) = before, after
    assert [entry[:2] for entry in tensors] == [entry[:2] for entry in tensors_now]
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(tensors, tensors_now))
    assert modules == modules_now and hooks == hooks_now


@pytest.mark.filterwarnings("ignore::hyperac.HyperACWarning")
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(case=corrupted())
def test_a_corrupted_plan_file_applies_or_names_its_field(case):
    """Either the changed plan applies (and ``remove`` restores the model), or ``apply`` raises a
    ``ConfigError`` that names the changed field, and the model is as it was."""
    data, field = case
    model = Stack(Block, 3)
    before = untouched(model)
    try:
        hyperac.apply(model, plan=data)
    except ConfigError as error:
        assert repr(field) in str(error), (field, str(error))
        assert hyperac.applied_plan(model) is None
    else:
        model(torch.randn(2, 8, 8)).sum().backward()
        model.zero_grad(set_to_none=True)
        hyperac.remove(model)
    assert_same(before, untouched(model))


def test_the_written_plan_applies_as_it_was_made():
    model = Stack(Block, 3)
    applied = hyperac.apply(model, plan=PLAN)
    assert [layer.mode for layer in applied.layers] == ["full", "selective", "off"]
    assert [bucket.max_len for bucket in applied.buckets] == [8, 16]


def test_a_plan_dict_carries_its_format_version():
    assert PLAN["format_version"] == PLAN_FORMAT == 1
    unversioned = {key: value for key, value in PLAN.items() if key != "format_version"}  # written before 1
    assert Plan.from_dict(unversioned) == Plan.from_dict(PLAN)


@pytest.mark.parametrize("version", [PLAN_FORMAT + 1, 99])
def test_a_plan_from_a_newer_hyperac_is_refused(version):
    """A newer format is refused before its fields are read (a field it added would read as unknown)."""
    newer = {**PLAN, "format_version": version, "field_of_the_future": 1}
    model = Stack(Block, 3)
    before = untouched(model)
    with pytest.raises(ConfigError, match=(
            rf"^Config\.plan\['format_version'\] is {version}: the plan was written by a newer hyperac \(this one "
            rf"reads plan formats up to {PLAN_FORMAT}\); upgrade hyperac \(pip install -U hyperac\), or write the plan "
            r"again with this one\.$")):
        hyperac.apply(model, plan=newer)
    assert_same(before, untouched(model))


def layer(**changes):
    return {**PLAN, "layers": [{**PLAN["layers"][0], **changes}, *PLAN["layers"][1:]]}


def bucket(**changes):
    return {**PLAN, "buckets": [{**PLAN["buckets"][0], **changes}, PLAN["buckets"][1]]}


@pytest.mark.parametrize(("data", "match"), [
    ({**PLAN, "batch_shape": True}, r"^Config\.plan\['batch_shape'\] is True; give a list of ints >= 1 \(the shape of "
                                    r"the sample's first tensor at max_seq_len\), or None\.$"),
    (layer(recomputed=3), r"^Config\.plan\['layers'\]\[0\]\['recomputed'\] is 3; give a list of strings \(dotted "
                          r"module names\)\.$"),
    (layer(recomputed=None), r"^Config\.plan\['layers'\]\[0\]\['recomputed'\] is None; give a list of strings"),
    (layer(swap="yes"), r"^Config\.plan\['layers'\]\[0\]\['swap'\] is 'yes'; give true or false\.$"),
    (layer(index=-1), r"^Config\.plan\['layers'\]\[0\]\['index'\] is -1; give an int >= 0"),
    (layer(mode=["full"]), r"^Config\.plan\['layers'\]\[0\]\['mode'\] is \['full'\]; give one of \['full', "),
    ({**PLAN, "notes": "x"}, r"^Config\.plan\['notes'\] is 'x'; give a list of strings\.$"),
    ({**PLAN, "predicted_step_seconds": float("nan")}, r"\['predicted_step_seconds'\] is nan; give a finite number "
                                                       r">= 0, or None\.$"),
    ({**PLAN, "budget_bytes": 1.5}, r"^Config\.plan\['budget_bytes'\] is 1\.5; give an int >= 0, or None\.$"),
    ({**PLAN, "max_seq_len": 0}, r"^Config\.plan\['max_seq_len'\] is 0; give an int >= 1, or None\.$"),
    (bucket(max_len="8"), r"^Config\.plan\['buckets'\]\[0\]\['max_len'\] is '8'; give an int >= 1\.$"),
    (bucket(modes="off"), r"^Config\.plan\['buckets'\]\[0\]\['modes'\] is 'off'; give a list of modes, each one of "),
    (bucket(predicted_bytes=True), r"^Config\.plan\['buckets'\]\[0\]\['predicted_bytes'\] is True; give an int >= 0"),
    ({**PLAN, "buckets": [PLAN["buckets"][0], ["x"]]}, r"^Config\.plan\['buckets'\]\[1\] is a list, not a dict"),
    ({**PLAN, "layers": {"0": "full"}}, r"^Config\.plan\['layers'\] is \{'0': 'full'\}; give a list of layer dicts"),
    ({**PLAN, "plan": PLAN["layers"]}, r"^Config\.plan has unknown keys \['plan'\]; a plan dict has \['adapter', "),
    ({**PLAN, "max_seq_len": 32}, r"Config\.plan\['buckets'\] have max_len \[8, 16\]; give ints >= 1 in ascending "
                                  r"order, the last one Config\.plan\['max_seq_len'\] \(32\)\.$"),
    ({**PLAN, "format_version": "1"}, r"^Config\.plan\['format_version'\] is '1'; give an int >= 1"),
])
def test_a_bad_field_is_named_with_its_value_and_what_is_allowed(data, match):
    with pytest.raises(ConfigError, match=match):
        Plan.from_dict(data)


def test_a_plan_for_other_layers_names_their_fqn():
    model = Stack(Block, 3)
    with pytest.raises(ConfigError, match=(r"^Config\.plan\['layers'\] have 'fqn' \['x', 'blocks\.1', 'blocks\.2'\]"
                                           r"\.\.\. \(3 in all\), but this model has \['blocks\.0', 'blocks\.1', "
                                           r"'blocks\.2'\]")):
        hyperac.apply(model, plan=layer(fqn="x"))


def test_the_tables_cover_every_field():
    """Each dataclass field of a plan, a layer and a bucket has a row in its table, and no row more."""
    from hyperac.plan import _BUCKET_FIELDS, _LAYER_FIELDS, _PLAN_FIELDS

    assert set(_PLAN_FIELDS) == set(Plan.from_dict(PLAN).to_dict()) == set(PLAN)
    assert set(_LAYER_FIELDS) == set(LayerPlan.__dataclass_fields__)
    assert set(_BUCKET_FIELDS) == set(LengthBucket.__dataclass_fields__)
