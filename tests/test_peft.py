"""hyperac on a frozen base with LoRA adapters (the ``peft`` package).

Gradients must reach the adapters in every mode, equal (bitwise) to those of the same PEFT model
without hyperac, with LoRA dropout on (the replay draws the same masks) and no
``enable_input_require_grads`` (the recompute is non-reentrant: the frozen embedding's output
needs no ``requires_grad``). The applied model is found through ``PeftModel`` and keeps its
adapter state_dict keys.
"""

from __future__ import annotations

import copy

import pytest
import torch
from hyperac_testing import assert_parity, tiny_llama, train_step

import hyperac

peft = pytest.importorskip("peft", reason="pip install '.[test]' (peft)")
# peft asks the base model the deprecated `is_gradient_checkpointing`; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")

TARGETS = ["q_proj", "v_proj", "gate_proj", "down_proj"]


@pytest.fixture(scope="module")
def lora_model():
    base = tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64)
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.1, target_modules=TARGETS, task_type="CAUSAL_LM",
                             init_lora_weights=False)  # B != 0: every adapter matrix gets a nonzero gradient
    torch.manual_seed(0)
    return peft.get_peft_model(base, config)


@pytest.fixture(scope="module")
def reference(lora_model, loss_fn):
    return train_step(copy.deepcopy(lora_model), loss_fn)


SIM_SWAP = dict(backend="sim", min_swap_bytes=0)


@pytest.mark.parametrize("options", [
    dict(mode="full"),
    dict(mode="selective"),
    dict(mode="off", layers={0: "full", 1: "selective"}),
    dict(mode="swap", **SIM_SWAP),
    dict(mode="full", swap_inputs=True, **SIM_SWAP),
], ids=["full", "selective", "plan", "swap", "full+swap_inputs"])
def test_adapter_gradients_equal_without_hyperac(lora_model, loss_fn, reference, options):
    model = copy.deepcopy(lora_model)
    keys = list(peft.get_peft_model_state_dict(model))
    plan = hyperac.apply(model, **options)
    assert [layer.fqn for layer in plan.layers] == [f"base_model.model.model.layers.{i}" for i in range(2)]
    loss, grads = train_step(model, loss_fn)
    assert grads and all("lora_" in name for name in grads), "a frozen base weight got a gradient"
    assert len(grads) == 2 * len(TARGETS) * 2  # A and B of every target in both layers
    assert all(grad.abs().sum() > 0 for grad in grads.values()), "an adapter got a zero gradient"
    assert_parity(reference, (loss, grads))
    if options.get("backend") == "sim":
        assert hyperac.swap_stats(model).offloaded_tensors > 0
    assert list(peft.get_peft_model_state_dict(model)) == keys
    hyperac.remove(model)
    assert_parity(reference, train_step(model, loss_fn))


def test_trainer_with_lora_and_the_callback(tmp_path):
    """A LoRA fine-tune in the Trainer: the callback (turning the activation_checkpointing flag into a plan)
    trains the adapters exactly as the run without recompute."""
    pytest.importorskip("accelerate")
    from test_trainer import dataset
    from transformers import Trainer, TrainingArguments

    from hyperac.integrations.transformers import HyperACCallback

    def run(name, callbacks, **overrides):
        base = tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64)
        model = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                          task_type="CAUSAL_LM"))
        settings = dict(output_dir=str(tmp_path / name), max_steps=3, per_device_train_batch_size=2,
                        learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to="none", use_cpu=True,
                        seed=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=TrainingArguments(**{**settings, **overrides}), train_dataset=dataset(),
                          callbacks=callbacks)
        trainer.train()
        adapters = {k: v.clone() for k, v in peft.get_peft_model_state_dict(model).items()}
        return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry], adapters

    reference_losses, reference_adapters = run("reference", [])
    callback = HyperACCallback(mode="selective")
    losses, adapters = run("applied", [callback], activation_checkpointing=True)
    assert callback.plan.count("selective") == 2
    assert losses == reference_losses
    assert adapters.keys() == reference_adapters.keys()
    assert all(torch.equal(adapters[k], reference_adapters[k]) for k in adapters)
