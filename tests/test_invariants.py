"""design.md §4 invariants 2-5 and the rest of the apply/remove contract."""

from __future__ import annotations

import collections
import copy
import gc
import json
import logging
import pathlib
import re
import types
import weakref

import pytest
import torch
from hyperac_testing import applied_copy, assert_parity, counting_pre_hook, train_step
from torch import nn

import hyperac
from hyperac import ConfigError, UnsupportedModelError
from hyperac.measure import flop_counter

MODES = ["full", "selective"]
PLAN = {"0-1": "full", 2: "off", "3-": "selective"}
PLAN_MODES = ["full", "full", "off", "selective"]


def structure(model):
    """Names, types and keys that apply must not change (invariant 2)."""
    return {
        "modules": [(name, type(m)) for name, m in model.named_modules()],
        "parameters": [name for name, _ in model.named_parameters()],
        "buffers": [name for name, _ in model.named_buffers()],
        "state_dict": list(model.state_dict()),
    }


def full_state(model):
    """Structure, flags and config that remove must give back (invariant 3)."""
    return {
        **structure(model),
        "module_dicts": {name: sorted(m.__dict__) for name, m in model.named_modules()},
        "training": {name: m.training for name, m in model.named_modules()},
        "hf_flags": {
            name: (m.__dict__.get("gradient_checkpointing"), "_gradient_checkpointing_func" in m.__dict__)
            for name, m in model.named_modules()
        },
        "hooks": {
            name: (list(m._forward_hooks), list(m._forward_pre_hooks), list(m._backward_hooks))
            for name, m in model.named_modules()
        },
        "config": model.config.to_dict(),
        "use_cache": model.config.use_cache,
        "requires_grad": {name: p.requires_grad for name, p in model.named_parameters()},
    }


def assert_pristine(model, before):
    overridden = [name for name, m in model.named_modules() if "forward" in m.__dict__]
    assert overridden == [], f"instance forward left on {overridden}"
    assert "_hyperac_state" not in model.__dict__
    assert hyperac.applied_plan(model) is None
    assert full_state(model) == before


def count_child_calls(model, child="mlp"):
    """Per layer, how often ``layer.<child>`` was entered (its hooks are inside the layer's recompute).

    A pre-hook, not a forward hook: the replay stops early once it has recomputed every saved
    tensor, so a post-hook of the last sub-module may not fire in it."""
    counts = collections.Counter()
    for index, layer in enumerate(model.model.layers):
        getattr(layer, child).register_forward_pre_hook(counting_pre_hook(counts, index))
    return counts


def count_layer_calls(model):
    """Per layer, how often the layer's own pre-hook fired (hooks stay outside the recompute)."""
    counts = collections.Counter()
    for index, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda module, args, index=index: counts.update([index]))
    return counts


# ---------------------------------------------------------------------------------------------
# invariant 2: names, keys and types unchanged


@pytest.mark.parametrize("options", [dict(mode="full"), dict(mode="selective"), dict(layers=PLAN)], ids=str)
def test_apply_keeps_names_keys_and_types(model, options):
    before = structure(model)
    originals = dict(model.named_modules())
    state = copy.deepcopy(model.state_dict())
    hyperac.apply(model, backend="cpu", **options)
    after = structure(model)
    assert after == before
    for name, module in model.named_modules():
        assert module is originals[name]
        assert isinstance(module, type(originals[name]))
    assert not any("_checkpoint_wrapped_module" in name for name in after["state_dict"])
    assert not any("checkpoint" in name for name, _ in model.named_modules())
    model.load_state_dict(state, strict=True)  # the original checkpoint still loads into it


# ---------------------------------------------------------------------------------------------
# invariant 3: remove gives back the model


@pytest.mark.parametrize("options", [dict(mode="full"), dict(mode="selective"), dict(layers=PLAN)], ids=str)
def test_remove_restores_structure_flags_and_config(model, loss_fn, options):
    assert model.config.use_cache is True
    before = full_state(model)
    config = model.config.to_dict()
    hyperac.apply(model, backend="cpu", **options)
    assert model.config.to_dict() == config  # the config is never changed, not even while applied
    train_step(model, loss_fn)
    model.zero_grad(set_to_none=True)
    hyperac.remove(model)
    assert_pristine(model, before)
    assert model.config.use_cache is True
    # and it can be applied again
    hyperac.apply(model, backend="cpu", **options)
    hyperac.remove(model)
    assert_pristine(model, before)


def test_remove_keeps_use_cache_false(model):
    model.config.use_cache = False
    before = full_state(model)
    hyperac.apply(model, backend="cpu")
    hyperac.remove(model)
    assert_pristine(model, before)
    assert model.config.use_cache is False


def test_remove_restores_a_forward_set_by_someone_else(model, loss_fn):
    layer = model.model.layers[1]
    calls = []
    inner = layer.forward

    def patched(self, *args, **kwargs):
        calls.append(1)
        return inner(*args, **kwargs)

    layer.forward = types.MethodType(patched, layer)
    theirs = layer.__dict__["forward"]
    hyperac.apply(model, backend="cpu", mode="full")
    assert layer.__dict__["forward"] is not theirs
    train_step(model, loss_fn)
    assert len(calls) == 2  # their forward is what gets recomputed
    hyperac.remove(model)
    assert layer.__dict__["forward"] is theirs


def test_apply_twice_raises_and_keeps_first_apply(model):
    plan = hyperac.apply(model, backend="cpu", mode="selective")
    with pytest.raises(ConfigError, match=r"already applied .*call hyperac\.remove\(model\) first"):
        hyperac.apply(model, backend="cpu", mode="full")
    assert hyperac.applied_plan(model) is plan
    hyperac.remove(model)


def test_remove_not_applied_raises(model):
    with pytest.raises(ConfigError, match=r"hyperac is not applied to this LlamaForCausalLM; nothing to remove"):
        hyperac.remove(model)
    hyperac.apply(model, backend="cpu")
    hyperac.remove(model)
    with pytest.raises(ConfigError, match=r"not applied"):
        hyperac.remove(model)


def test_applied_plan(model):
    assert hyperac.applied_plan(model) is None
    plan = hyperac.apply(model, backend="cpu", layers=PLAN)
    assert hyperac.applied_plan(model) is plan
    hyperac.remove(model)
    assert hyperac.applied_plan(model) is None


# ---------------------------------------------------------------------------------------------
# models hyperac must refuse


@pytest.mark.parametrize("enable", ["activation", "activation_every_2", "gradient"])
def test_hf_activation_checkpointing_already_on(model, enable):
    if enable == "activation":
        model.activation_checkpointing_enable()
    elif enable == "activation_every_2":
        model.activation_checkpointing_enable(every_n_layers=2)
    else:
        with pytest.warns(FutureWarning):
            model.gradient_checkpointing_enable()
    before = full_state(model)
    with pytest.raises(UnsupportedModelError, match=r"HF activation checkpointing is already on.*disable"):
        hyperac.apply(model, backend="cpu")
    assert_pristine(model, before)
    assert isinstance(UnsupportedModelError("x"), TypeError)
    # after disabling it, apply works
    model.activation_checkpointing_disable()
    hyperac.apply(model, backend="cpu")
    hyperac.remove(model)


def test_compiled_model_refused(model):
    compiled = torch.compile(model)
    before = full_state(model)
    with pytest.raises(UnsupportedModelError, match=r"already compiled.*hyperac\.apply\(model\._orig_mod\)"):
        hyperac.apply(compiled, backend="cpu")
    assert "_hyperac_state" not in compiled.__dict__
    assert_pristine(model, before)


def test_not_a_module_refused():
    with pytest.raises(UnsupportedModelError, match=r"needs a torch\.nn\.Module, got dict"):
        hyperac.apply({"weights": 1}, backend="cpu")


def test_model_without_layers_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(UnsupportedModelError, match=r"found no repeated layers in Sequential.*layers="):
        hyperac.apply(model, backend="cpu")
    assert not any("forward" in m.__dict__ for m in model.modules())


# ---------------------------------------------------------------------------------------------
# invariant 4: nothing global holds the model


@pytest.mark.parametrize(
    ("options", "step"),
    [
        (dict(mode="full"), "none"),
        (dict(mode="full"), "train"),
        (dict(mode="selective"), "train"),
        (dict(layers=PLAN), "forward_only"),
    ],
    ids=str,
)
def test_dropping_the_model_frees_it(base_model, loss_fn, options, step):
    model = copy.deepcopy(base_model)
    plan = hyperac.apply(model, backend="cpu", **options)
    if step == "train":
        train_step(model, loss_fn)
    elif step == "forward_only":  # a forward whose backward never runs
        model.train()
        loss = loss_fn(model)
        del loss
    ref = weakref.ref(model)
    layer_ref = weakref.ref(model.model.layers[0])
    del model
    gc.collect()
    assert ref() is None, "something still holds the applied model"
    assert layer_ref() is None
    assert plan.layers  # the plan outlives the model without keeping it


# ---------------------------------------------------------------------------------------------
# atomic apply


def test_failure_in_on_applied_leaves_model_as_before(model):
    before = full_state(model)
    calls = []

    def fail(applied):
        calls.append(applied)
        # by now everything is installed
        assert any("forward" in m.__dict__ for m in applied.modules())
        raise RuntimeError("adapter refuses")

    adapter = hyperac.Adapter(region_patterns=("model.layers.*",), on_applied=fail)
    with pytest.raises(RuntimeError, match="adapter refuses"):
        hyperac.apply(model, backend="cpu", adapter=adapter)
    assert calls == [model]
    assert_pristine(model, before)


def test_failure_mid_install_leaves_model_as_before(model, monkeypatch):
    import hyperac.api

    real = hyperac.api.install_recompute
    calls = []

    def flaky(module, *args):
        calls.append(module)
        if len(calls) == 3:
            raise RuntimeError("install failed on the third layer")
        return real(module, *args)

    monkeypatch.setattr(hyperac.api, "install_recompute", flaky)
    before = full_state(model)
    with pytest.raises(RuntimeError, match="third layer"):
        hyperac.apply(model, backend="cpu", mode="selective")
    assert len(calls) == 3
    assert_pristine(model, before)
    monkeypatch.undo()
    hyperac.apply(model, backend="cpu")
    hyperac.remove(model)


# ---------------------------------------------------------------------------------------------
# per-layer plans


def test_per_layer_plan_modes_and_forward_counts(base_model, loss_fn):
    reference = train_step(copy.deepcopy(base_model), loss_fn)
    model, plan = applied_copy(base_model, backend="cpu", layers=PLAN)
    assert [layer.mode for layer in plan.layers] == PLAN_MODES
    assert [layer.index for layer in plan.layers] == [0, 1, 2, 3]
    assert [layer.fqn for layer in plan.layers] == [f"model.layers.{i}" for i in range(4)]
    assert plan.count("full") == 2 and plan.count("off") == 1 and plan.count("selective") == 1
    inner = count_child_calls(model, "mlp")
    outer = count_layer_calls(model)
    result = train_step(model, loss_fn)
    # a kept layer runs once per step, a recomputed one twice (forward and replay)
    assert [inner[i] for i in range(4)] == [2, 2, 1, 2]
    # the layer's own hooks stay outside the recompute and fire once
    assert [outer[i] for i in range(4)] == [1, 1, 1, 1]
    assert_parity(reference, result)


def test_plan_printing_and_dict(model):
    plan = hyperac.apply(model, backend="cpu", layers=PLAN)
    text = str(plan)
    lines = text.splitlines()
    assert lines[0] == "hyperac: backend cpu, adapter none, 4 layers: 2 full, 1 selective, 1 off"
    assert plan.summary() == lines[0]
    assert len(lines) == 2 + 4
    assert re.search(r"#\s+layer\s+found by\s+mode\s+swap\s+recomputed", lines[1])
    for index, mode in enumerate(PLAN_MODES):
        row = lines[2 + index].split()
        target = ["-"] if mode == "off" else ["whole", "layer"]
        assert row == [str(index), f"model.layers.{index}", "declared", "class", mode, "-", *target]
    as_dict = plan.to_dict()
    assert as_dict["backend"] == "cpu"
    assert as_dict["adapter"] == "none"
    assert as_dict["notes"] == []
    assert [entry["mode"] for entry in as_dict["layers"]] == PLAN_MODES
    assert as_dict["layers"][0] == {
        "index": 0, "fqn": "model.layers.0", "mode": "full",
        "recomputed": ("model.layers.0",), "excluded": (), "swap": False, "found_by": "declared class",
    }
    assert as_dict["layers"][2]["recomputed"] == ()
    assert json.loads(json.dumps(as_dict))["layers"][3]["recomputed"] == ["model.layers.3"]
    assert plan.layers[3] == hyperac.LayerPlan(
        3, "model.layers.3", "selective", ("model.layers.3",), (), found_by="declared class"
    )
    hyperac.remove(model)


# ---------------------------------------------------------------------------------------------
# no recompute where there is no backward


def _step_flops(model, loss_fn, train, grad):
    model.train(train)
    torch.manual_seed(1)
    with flop_counter() as counter:
        with torch.set_grad_enabled(grad):
            loss = loss_fn(model)
        if grad:
            loss.backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


@pytest.mark.parametrize("mode", MODES)
def test_eval_and_no_grad_do_not_recompute(base_model, loss_fn, mode, monkeypatch):
    off_model = copy.deepcopy(base_model)
    model, _ = applied_copy(base_model, backend="cpu", mode=mode)
    calls = []
    real = torch.utils.checkpoint.checkpoint

    def spy(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.utils.checkpoint, "checkpoint", spy)
    # training step: recompute costs FLOPs
    assert _step_flops(model, loss_fn, train=True, grad=True) > _step_flops(off_model, loss_fn, True, True)
    assert len(calls) == 4
    calls.clear()
    # eval mode with grad (e.g. computing input gradients): no recompute
    counts = count_child_calls(model)
    assert _step_flops(model, loss_fn, train=False, grad=True) == _step_flops(off_model, loss_fn, False, True)
    assert dict(counts) == {i: 1 for i in range(4)}
    # training mode under no_grad: no recompute
    counts.clear()
    assert _step_flops(model, loss_fn, train=True, grad=False) == _step_flops(off_model, loss_fn, True, False)
    assert dict(counts) == {i: 1 for i in range(4)}
    assert calls == []


# ---------------------------------------------------------------------------------------------
# LoRA-style frozen base


def _add_lora(model, rank=4):
    torch.manual_seed(7)
    for parameter in model.parameters():
        parameter.requires_grad_(False)
    hidden = model.config.hidden_size
    for layer in model.model.layers:
        lora = nn.Sequential(nn.Linear(hidden, rank, bias=False), nn.Linear(rank, hidden, bias=False))
        layer.mlp.add_module("lora", lora)
        layer.mlp.register_forward_hook(lambda module, args, output: output + module.lora(args[0]))
    return model


@pytest.mark.parametrize("mode", ["off", *MODES])
def test_lora_frozen_base_gradients_match(base_model, loss_fn, mode):
    lora_model = _add_lora(copy.deepcopy(base_model))
    reference = train_step(lora_model, loss_fn)
    assert reference[1], "the LoRA weights got no gradients"
    assert all(".lora." in name for name in reference[1])
    assert len(reference[1]) == 2 * 4
    model, _ = applied_copy(lora_model, backend="cpu", mode=mode)
    assert_parity(reference, train_step(model, loss_fn))


# ---------------------------------------------------------------------------------------------
# invariant 5: the core names no vendor module

_VENDOR = re.compile(r"torch\.cuda|torch\.npu|torch_npu|\.cuda\(|\.is_cuda")


def test_core_names_no_vendor_module():
    package = pathlib.Path(hyperac.__file__).parent
    backends = package / "backends"
    offenders = []
    files = sorted(package.rglob("*.py"))
    assert len(files) > 5
    for path in files:
        if backends in path.parents:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _VENDOR.search(line):
                offenders.append(f"{path.relative_to(package.parent)}:{number}: {line.strip()}")
    assert offenders == [], "vendor names in the backend-neutral core:\n" + "\n".join(offenders)


# ---------------------------------------------------------------------------------------------
# logging: one INFO line per apply and per remove, nothing per step


def test_logging_once_per_apply_and_remove(model, loss_fn, caplog):
    def ours():
        return [r for r in caplog.records if r.name.startswith("hyperac")]

    with caplog.at_level(logging.DEBUG, logger="hyperac"):
        plan = hyperac.apply(model, backend="cpu", layers=PLAN)
        records = ours()
        assert [(r.levelno, r.getMessage()) for r in records] == [(logging.INFO, plan.summary())]
        caplog.clear()
        train_step(model, loss_fn)
        train_step(model, loss_fn)
        assert ours() == []
        hyperac.remove(model)
        records = ours()
        assert len(records) == 1 and records[0].levelno == logging.INFO
        assert "removed" in records[0].getMessage() and "\n" not in records[0].getMessage()
