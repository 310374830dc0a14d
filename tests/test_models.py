"""Invariants 1-3 across model families: same loss and gradients (bitwise on CPU float32, dropout on),
less activation memory for more FLOPs, nothing renamed, and an exact undo.

Every family is a tiny model built from a config, once per module (the ``family`` fixture), and is
checked in every mode (``off``, ``full``, ``selective``) and under a per-layer plan. Families: Llama,
Qwen2 (biased projections), two MoEs with top-k routing (Qwen2-MoE, Mixtral), Gemma-3n text with
KV sharing (sub-module recompute), two encoder-decoders (BART, T5), a vision-language model with two
towers (Qwen2-VL), GPT-2 and a plain PyTorch model named by ``layers="blocks"``.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hyperac_testing import (
    LossFn,
    applied_copy,
    assert_parity,
    hf_configs,
    kv_cache_disabled,
    lm_loss,
    measure,
    next_token_loss,
    qwen2_vl_loss,
    seq2seq_loss,
    tiny_bart,
    tiny_blocks_model,
    tiny_gemma3n_text,
    tiny_gpt2,
    tiny_llama,
    tiny_mixtral,
    tiny_qwen2,
    tiny_qwen2_moe,
    tiny_qwen2_vl,
    tiny_t5,
    train_step,
)
from torch import nn

import hyperac

pytest.importorskip("transformers")


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], nn.Module]
    loss: Callable[[], LossFn]
    containers: tuple[tuple[str, int], ...]
    """The layer containers discovery must find, in order, with their number of layers."""
    container_option: str | None = None
    """``layers=`` naming the container, for models that declare no layer classes."""
    cache_changes_bits: bool = False
    """``use_cache=True`` changes the float32 bits of the un-applied model's gradients (its cache
    concatenates keys and values, so attention sees contiguous copies instead of strided views).
    A training forward of a model with recomputed layers builds no cache, as under HF's own
    activation checkpointing, so the bitwise reference of a recomputing plan is the un-applied
    model with ``use_cache=False``; the default-config model then agrees to float32 rounding only.
    ``mode="off"`` changes nothing: its reference is the model as built."""
    kv_sharing: bool = False
    """Layers publish keys and values for later layers: hyperac recomputes only MLP and norms."""

    def fqns(self) -> list[str]:
        return [f"{container}.{i}" for container, count in self.containers for i in range(count)]

    def options(self, mode: str) -> dict[str, Any]:
        """``apply`` keywords for ``mode``; ``"plan"`` is the per-layer plan: layer 0 full, the rest selective."""
        if mode != "plan":
            return dict(mode=mode, layers=self.container_option)
        rules = {"0": "full", "1-": "selective"}
        return dict(layers=rules if self.container_option is None else {self.container_option: rules})

    def expected_modes(self, mode: str) -> list[str]:
        count = len(self.fqns())
        return ["full"] + ["selective"] * (count - 1) if mode == "plan" else [mode] * count


FAMILIES = [
    Family("llama", lambda: tiny_llama(2, hidden_size=32, intermediate_size=64, attention_dropout=0.1),
           lambda: lm_loss(seq=16), (("model.layers", 2),)),
    Family("qwen2", lambda: tiny_qwen2(attention_dropout=0.1), lambda: lm_loss(seq=16), (("model.layers", 3),)),
    Family("qwen2_moe", lambda: tiny_qwen2_moe(attention_dropout=0.1), lambda: lm_loss(seq=16),
           (("model.layers", 3),)),
    Family("mixtral", lambda: tiny_mixtral(attention_dropout=0.1), lambda: lm_loss(seq=16), (("model.layers", 3),)),
    Family("gemma3n_kv_sharing", lambda: tiny_gemma3n_text(attention_dropout=0.1), lambda: lm_loss(seq=16),
           (("model.layers", 4),), kv_sharing=True),
    Family("bart", lambda: tiny_bart(dropout=0.1, attention_dropout=0.1, activation_dropout=0.1), seq2seq_loss,
           (("model.encoder.layers", 2), ("model.decoder.layers", 2))),
    Family("t5", lambda: tiny_t5(dropout_rate=0.1), seq2seq_loss, (("encoder.block", 2), ("decoder.block", 2)),
           cache_changes_bits=True),
    Family("qwen2_vl", lambda: tiny_qwen2_vl(attention_dropout=0.1), qwen2_vl_loss,
           (("model.visual.blocks", 2), ("model.language_model.layers", 2))),
    Family("gpt2", tiny_gpt2, lambda: lm_loss(seq=16), (("transformer.h", 3),), cache_changes_bits=True),
    Family("plain_blocks", tiny_blocks_model, next_token_loss, (("blocks", 3),), container_option="blocks"),
]

MODES = ["off", "full", "selective", "plan"]


@dataclasses.dataclass
class Built:
    family: Family
    model: nn.Module
    loss_fn: LossFn
    reference: tuple
    """One training step of the un-applied model as built."""
    reference_without_cache: tuple
    """The same step with ``use_cache=False`` on every config, as a recomputing training forward runs."""

    def applied(self, mode: str) -> tuple[nn.Module, hyperac.Plan]:
        """A copy of the model with hyperac applied in ``mode`` (or ``"plan"``)."""
        with warnings.catch_warnings():
            if self.family.kv_sharing:  # asserted in test_kv_sharing_recomputes_mlp_and_norms_only
                warnings.simplefilter("ignore", hyperac.HyperACWarning)
            return applied_copy(self.model, backend="cpu", **self.family.options(mode))


_BUILT: dict[str, Built] = {}


def _built(spec: Family) -> Built:
    """Build ``spec``'s model and its reference steps once per module."""
    if spec.name not in _BUILT:
        model, loss_fn = spec.build(), spec.loss()
        reference = train_step(model, loss_fn)
        with kv_cache_disabled(model):
            reference_without_cache = train_step(model, loss_fn)
        _BUILT[spec.name] = Built(spec, model, loss_fn, reference, reference_without_cache)
    return _BUILT[spec.name]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models run ops on a few KiB each: OpenMP worker threads only spin, several times slower
    when other processes share the cores. Parity is always compared within one thread count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    _BUILT.clear()


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda spec: spec.name)
def family(request) -> Built:
    return _built(request.param)


@pytest.fixture
def gemma3n() -> Built:
    return _built(next(spec for spec in FAMILIES if spec.kv_sharing))


@pytest.fixture
def qwen2_vl() -> Built:
    return _built(next(spec for spec in FAMILIES if spec.name == "qwen2_vl"))


def test_dropout_is_live(family):
    """The parity tests below replay dropout masks only if dropout really draws: another seed, another loss."""
    assert not torch.equal(train_step(family.model, family.loss_fn, seed=2)[0], family.reference[0])


def test_discovers_exactly_the_layer_containers(family):
    model, plan = family.applied("full")
    assert [layer.fqn for layer in plan.layers] == family.family.fqns()
    assert [layer.index for layer in plan.layers] == list(range(len(plan.layers)))
    if not family.family.kv_sharing:
        assert all(layer.recomputed == (layer.fqn,) for layer in plan.layers)


def test_vision_language_model_finds_both_towers_and_nothing_else(qwen2_vl):
    model, plan = qwen2_vl.applied("full")
    towers = {layer.fqn.rsplit(".", 1)[0] for layer in plan.layers}
    assert towers == {"model.visual.blocks", "model.language_model.layers"}
    # Non-layer children around the blocks, including the merger's Sequential MLP, are no layers.
    non_layers = ("model.visual.patch_embed", "model.visual.merger", "model.visual.rotary_pos_emb",
                  "model.language_model.embed_tokens", "model.language_model.norm", "lm_head")
    assert all(isinstance(model.get_submodule(name), nn.Module) for name in non_layers)
    for layer in plan.layers:
        assert not layer.fqn.startswith(non_layers)
        assert not any(target.startswith(non_layers) for target in layer.recomputed)
    block_types = {type(model.get_submodule(layer.fqn)).__name__ for layer in plan.layers}
    assert block_types == {"Qwen2VLVisionBlock", "Qwen2VLDecoderLayer"}


@pytest.mark.parametrize("mode", MODES)
def test_loss_and_gradients_bitwise_equal_and_remove_restores_them(family, mode):
    model, plan = family.applied(mode)
    assert [layer.mode for layer in plan.layers] == family.family.expected_modes(mode)
    result = train_step(model, family.loss_fn)
    unchanged = mode == "off"
    assert_parity(family.reference if unchanged else family.reference_without_cache, result)
    # A cache-sensitive model differs from its default-config self in float32 rounding only (Family.cache_changes_bits).
    assert_parity(family.reference, result, exact=unchanged or not family.family.cache_changes_bits)
    hyperac.remove(model)
    assert_parity(family.reference, train_step(model, family.loss_fn))


def test_recompute_trades_activation_bytes_for_flops(family):
    results = {}
    for mode in ("off", "selective", "full"):
        model, _ = family.applied(mode)
        results[mode] = measure(model, family.loss_fn)
    (off_bytes, off_flops), (sel_bytes, sel_flops), (full_bytes, full_flops) = (
        results["off"], results["selective"], results["full"]
    )
    if family.family.kv_sharing:  # only MLP and norms are recomputed; attention keeps its activations
        assert full_bytes < off_bytes and full_flops > off_flops, results
    else:
        assert full_bytes < sel_bytes < off_bytes, results
        assert full_flops > sel_flops > off_flops, results


def _use_cache_values(model: nn.Module) -> dict[str, Any]:
    """``use_cache`` of every HF config object that has the attribute."""
    values = {}
    for config in hf_configs(model):
        if hasattr(config, "use_cache"):
            values[f"{type(config).__name__}@{id(config)}"] = config.use_cache
    return values


def test_configs_untouched_by_apply_and_remove(family):
    model = copy.deepcopy(family.model)
    before = _use_cache_values(model)
    if family.family.container_option is not None:
        assert before == {}  # plain PyTorch: no config
    else:
        assert True in before.values(), before  # T5's encoder config has use_cache=False of its own
    configs = [config.to_dict() for config in hf_configs(model)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hyperac.HyperACWarning)
        hyperac.apply(model, backend="cpu", **family.family.options("full"))
    assert _use_cache_values(model) == before  # sub-configs (a VLM's text_config) included
    assert [config.to_dict() for config in hf_configs(model)] == configs
    hyperac.remove(model)
    assert _use_cache_values(model) == before


@pytest.mark.parametrize("mode", ["selective", "plan"])
def test_names_types_and_forwards_unchanged_by_apply_and_remove(family, mode):
    model = copy.deepcopy(family.model)

    def structure() -> tuple:
        return (
            list(model.state_dict()),
            [(name, type(module)) for name, module in model.named_modules()],
            [name for name, _ in model.named_parameters()],
            [name for name, _ in model.named_buffers()],
        )

    def instance_forwards() -> list[str]:
        return [name for name, module in model.named_modules() if "forward" in module.__dict__]

    before, forwards_before = structure(), instance_forwards()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hyperac.HyperACWarning)
        plan = hyperac.apply(model, backend="cpu", **family.family.options(mode))
    assert structure() == before
    assert not any("_checkpoint_wrapped_module" in key for key in model.state_dict())
    assert hyperac.applied_plan(model) == plan
    hyperac.remove(model)
    assert structure() == before
    assert instance_forwards() == forwards_before
    assert hyperac.applied_plan(model) is None


# --- KV sharing (Gemma-3n) ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "selective", "plan"])
def test_kv_sharing_recomputes_mlp_and_norms_only(gemma3n, mode):
    model = copy.deepcopy(gemma3n.model)
    assert model.config.num_kv_shared_layers > 0
    options = gemma3n.family.options(mode)
    if mode == "plan":
        options["layers"] = {"0": "full", "1-2": "selective", "3": "off"}
    with pytest.warns(hyperac.HyperACWarning, match="num_kv_shared_layers") as record:
        plan = hyperac.apply(model, backend="cpu", **options)
    assert sum(issubclass(w.category, hyperac.HyperACWarning) for w in record) == 1  # once per apply
    assert plan.notes and "num_kv_shared_layers" in plan.notes[0]
    for layer in plan.layers:
        if layer.mode == "off":
            assert layer.recomputed == ()
            continue
        assert layer.fqn not in layer.recomputed
        assert layer.recomputed == tuple(
            f"{layer.fqn}.{name}" for name in ("mlp", "input_layernorm", "post_attention_layernorm")
        )
        attention = f"{layer.fqn}.self_attn"
        assert not any(target == attention or target.startswith(attention + ".") for target in layer.recomputed)
        assert "forward" not in model.get_submodule(layer.fqn).__dict__  # the layer itself is left alone
        assert "forward" not in model.get_submodule(attention).__dict__
    assert_parity(gemma3n.reference, train_step(model, gemma3n.loss_fn))


def test_without_kv_sharing_gemma3n_recomputes_whole_layers_silently():
    model = tiny_gemma3n_text(num_kv_shared_layers=0, attention_dropout=0.1)
    loss_fn = lm_loss(seq=16)
    reference = train_step(model, loss_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error", hyperac.HyperACWarning)
        applied, plan = applied_copy(model, mode="full", backend="cpu")
    assert all(layer.recomputed == (layer.fqn,) for layer in plan.layers)
    assert not plan.notes
    assert_parity(reference, train_step(applied, loss_fn))


def test_selective_gemma3n_whole_layers_gradients_equal():
    """Gemma-3n's AltUp does `p = torch.matmul(4-d, 4-d); p += h`: the kept matmul output is written
    through an `_unsafe_view` that PyTorch's version check misses (NOTE [Writes into kept outputs])."""
    model = tiny_gemma3n_text(num_kv_shared_layers=0)
    loss_fn = lm_loss(seq=16)
    reference = train_step(model, loss_fn)
    applied, _ = applied_copy(model, mode="selective", backend="cpu")
    assert_parity(reference, train_step(applied, loss_fn))


# --- Vision-language: one plan per tower -------------------------------------------------------------------


def test_vision_language_plan_per_tower(qwen2_vl):
    layers = {"model.visual.blocks": "full", "model.language_model.layers": {"0": "selective", "1-": "off"}}
    model, plan = applied_copy(qwen2_vl.model, backend="cpu", layers=layers)
    assert [(layer.fqn, layer.mode) for layer in plan.layers] == [
        ("model.visual.blocks.0", "full"), ("model.visual.blocks.1", "full"),
        ("model.language_model.layers.0", "selective"), ("model.language_model.layers.1", "off"),
    ]
    assert_parity(qwen2_vl.reference, train_step(model, qwen2_vl.loss_fn))


# --- Plain PyTorch ----------------------------------------------------------------------------------------


def test_plain_model_found_without_container_option():
    model = tiny_blocks_model()
    plan = hyperac.apply(model, backend="cpu")
    assert [(layer.fqn, layer.found_by) for layer in plan.layers] == [(f"blocks.{i}", "structure") for i in range(3)]
