"""hyperac in HF's Trainer: ``hyperac.integrations.transformers`` (callback and TrainingArguments helper).

End to end: three Trainer steps on CPU of a tiny Llama with the callback give the same loss at
every step and the same weights as the run without hyperac; the checkpoint it saves loads into a
model without hyperac, keys and values alike. The helpers are checked without a Trainer.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch
from hyperac_testing import tiny_llama

import hyperac

pytest.importorskip("accelerate", reason="HF Trainer needs accelerate (pip install '.[test]')")
from transformers import LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from hyperac.integrations.transformers import (  # noqa: E402
    HyperACCallback,
    apply_from_training_args,
    config_from_training_args,
)

LOGGER = "hyperac.integrations.transformers"


def small_llama(num_layers: int = 2):
    return tiny_llama(num_layers=num_layers, hidden_size=32, intermediate_size=64)


def dataset(count: int = 12, seq: int = 16):
    generator = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 128, (count, seq), generator=generator)]


def train(tmp_path, name, callbacks=(), **overrides):
    """Three Trainer steps; returns (losses per step, trained model, checkpoint folder, trainer)."""
    model = small_llama()
    settings = dict(
        output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-2,
        logging_steps=1, save_strategy="steps", save_steps=3, report_to="none", use_cpu=True, seed=0,
        disable_tqdm=True, dataloader_num_workers=0,
    )
    settings.update(overrides)
    trainer = Trainer(model=model, args=TrainingArguments(**settings), train_dataset=dataset(),
                      callbacks=list(callbacks))
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return losses, model, tmp_path / name / "checkpoint-3", trainer


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("trainer"), "reference")


def assert_same_run(reference, run):
    losses, model, checkpoint, _ = run
    assert len(losses) == 3 and losses == reference[0], "per-step losses differ from the run without hyperac"
    expected = dict(reference[1].named_parameters())
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, expected[name]), f"{name} differs after training"
    reloaded = LlamaForCausalLM.from_pretrained(checkpoint)
    assert list(reloaded.state_dict()) == list(small_llama().state_dict()), "checkpoint keys differ"
    for name, tensor in model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], tensor), f"checkpoint value of {name} differs"
    saved = json.loads((checkpoint / "config.json").read_text())
    assert saved == json.loads((reference[2] / "config.json").read_text())


def assert_removed(model):
    assert hyperac.applied_plan(model) is None
    assert not [name for name, module in model.named_modules() if "forward" in module.__dict__]


@pytest.mark.parametrize("options, modes", [
    (dict(mode="full"), ["full", "full"]),
    (dict(mode="selective"), ["selective", "selective"]),
    (dict(layers={0: "full", 1: "off"}, mode="selective"), ["full", "off"]),
], ids=["full", "selective", "plan"])
def test_callback_trains_like_the_model_without_hyperac(tmp_path, reference, options, modes):
    callback = HyperACCallback(**options)
    run = train(tmp_path, "applied", [callback])
    assert [layer.mode for layer in callback.plan.layers] == modes
    assert callback.plan.backend == "cpu"  # from the device the Trainer put the model on
    assert_same_run(reference, run)
    assert_removed(run[1])


def test_activation_checkpointing_flag_becomes_a_plan(tmp_path, reference, caplog):
    """The Trainer turns HF's recompute on before on_train_begin; the callback turns it into hyperac's."""
    callback = HyperACCallback()
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        run = train(tmp_path, "flag", [callback], activation_checkpointing=True,
                    activation_checkpointing_kwargs={"every_n_layers": 2, "use_reentrant": True})
    assert [layer.mode for layer in callback.plan.layers] == ["full", "off"]
    text = caplog.text
    assert "cannot both be on" in text and "layers [0] of 2" in text and "['use_reentrant']" in text
    assert len(caplog.records) == 1, caplog.text  # one warning, not two that contradict each other
    assert_same_run(reference, run)
    assert_removed(run[1])
    assert run[1].model.layers[0].gradient_checkpointing is True  # HF's flags as the Trainer left them


def test_torch_compile_flag(tmp_path, reference):
    """TrainingArguments.torch_compile=True: the Trainer compiles the model, the callback applies compile= its
    torch_compile_backend."""
    callback = HyperACCallback(mode="selective")
    losses, model, _, _ = train(tmp_path, "compiled", [callback], torch_compile=True,
                                torch_compile_backend="aot_eager", save_strategy="no")
    torch._dynamo.reset()
    assert callback.applied_config.compile == "aot_eager"
    assert losses == reference[0]
    assert_removed(model)


# --- the helpers, without a Trainer ----------------------------------------------------------------


def args(**fields):
    defaults = dict(activation_checkpointing=False, activation_checkpointing_kwargs=None, torch_compile=False)
    return types.SimpleNamespace(**{**defaults, **fields})


@pytest.mark.parametrize("fields, options, expected", [
    ({}, {}, dict(mode="full", layers=None, swap_inputs=False, compile=False)),
    (dict(activation_checkpointing=True), {}, dict(mode="full", layers=None)),
    (dict(activation_checkpointing=True, activation_checkpointing_kwargs={"every_n_layers": 2}), {},
     dict(mode="off", layers={0: "full", 2: "full"})),
    (dict(activation_checkpointing=True, activation_checkpointing_kwargs={"offload": True}), {},
     dict(mode="full", swap_inputs=True)),
    (dict(activation_checkpointing=True, activation_checkpointing_kwargs={"every_n_layers": 3}),
     dict(mode="selective"), dict(mode="selective", layers=None, swap_inputs=False)),
    (dict(gradient_checkpointing=True, activation_checkpointing=None), {}, dict(mode="full")),  # transformers 4
    (dict(torch_compile=True), dict(mode="selective"), dict(mode="selective", compile=True)),
    (dict(torch_compile=True), dict(compile=False), dict(compile=False)),
    (dict(torch_compile=True, torch_compile_backend="aot_eager"), {}, dict(compile="aot_eager")),
], ids=["none", "flag", "every-2", "offload", "options-win", "gradient_checkpointing", "torch_compile",
        "compile-explicit", "torch_compile_backend"])
def test_config_from_training_args(fields, options, expected):
    config = config_from_training_args(small_llama(num_layers=4), args(**fields), **options)
    assert config.backend == "cpu"
    for field, value in expected.items():
        assert getattr(config, field) == value, field


def test_real_training_arguments_map_too():
    training_args = TrainingArguments(output_dir="unused", use_cpu=True, report_to="none",
                                      activation_checkpointing=True,
                                      activation_checkpointing_kwargs={"every_n_layers": 2})
    config = config_from_training_args(small_llama(num_layers=4), training_args)
    assert (config.mode, config.layers) == ("off", {0: "full", 2: "full"})


def test_helper_turns_hf_recompute_off_and_is_atomic():
    model = small_llama()
    model.activation_checkpointing_enable()
    with pytest.raises(hyperac.UnsupportedModelError, match="HF activation checkpointing is already on"):
        hyperac.apply(model)  # what the helper saves the user from
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(hyperac.ConfigError, match="names layer 5"):
        apply_from_training_args(model, args(activation_checkpointing=True), layers={5: "full"})
    assert model.is_activation_checkpointing and hyperac.applied_plan(model) is None  # put back as it was
    plan = apply_from_training_args(model, args(activation_checkpointing=True))
    assert plan.count("full") == 2 and not model.is_activation_checkpointing
    hyperac.remove(model)
    model.activation_checkpointing_enable()  # on without the request (as a model's __init__ may set it): refused
    with pytest.raises(hyperac.UnsupportedModelError, match="HF activation checkpointing is already on"):
        apply_from_training_args(model, args(), mode="selective")
    assert model.is_activation_checkpointing and hyperac.applied_plan(model) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("options, match", [
    (dict(modes="full"), r"unknown hyperac option\(s\) \['modes'\]"),
    (dict(mode="fast"), r"Config\.mode must be one of"),
    (dict(config=hyperac.Config(), mode="full"), "either config= or keyword options"),
])
def test_callback_checks_options_when_created(options, match):
    with pytest.raises(hyperac.ConfigError, match=match):
        HyperACCallback(**options)


def test_callback_leaves_a_model_applied_by_the_user_alone(caplog):
    model = small_llama()
    hyperac.apply(model, mode="selective")
    callback = HyperACCallback(mode="full")
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        callback.on_train_begin(args(), None, None, model=model)
    assert "leaves it as it is" in caplog.text
    callback.on_train_end(args(), None, None, model=model)
    assert hyperac.applied_plan(model).count("selective") == 2


def test_example_script(tmp_path):
    """examples/hf_trainer.py runs as documented (3 steps, checkpoint reloaded without hyperac)."""
    script = pathlib.Path(__file__).parents[1] / "examples" / "hf_trainer.py"
    done = subprocess.run([sys.executable, str(script), "--steps", "3", "--output-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "4 layers: 4 selective" in done.stdout
    assert "reloaded checkpoint-3 without hyperac" in done.stdout
