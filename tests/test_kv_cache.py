"""KV caches and configs (issue 9 item 2): hyperac never changes a config; outside recomputed
training forwards the model behaves exactly as un-applied; inside them a cache the forward reads
is part of the computation (recompute.py, NOTE [KV caches in replays]; _hf.py, NOTE [KV caches in
training])."""

from __future__ import annotations

import collections
import copy
import json
import warnings

import pytest
import torch
from hyperac_testing import applied_copy, assert_parity, train_step
from torch import nn

import hyperac
from hyperac import HyperACWarning, UnsupportedModelError

PLAN = {"0-1": "full", 2: "off", "3-": "selective"}
PLAN_MODES = ["full", "full", "off", "selective"]
APPLIED = [dict(mode="off"), dict(mode="full"), dict(mode="selective"), dict(layers=PLAN)]


def _ids(seed, shape=(2, 8)):
    return torch.randint(0, 128, shape, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# the config is the user's


@pytest.mark.parametrize("options", APPLIED + [dict(mode="swap")], ids=str)
def test_config_and_save_pretrained_never_show_hyperac(model, options, tmp_path):
    model.save_pretrained(tmp_path / "before")
    before = json.loads((tmp_path / "before" / "config.json").read_text())
    config = model.config.to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HyperACWarning)  # swap has no effect on cpu
        hyperac.apply(model, backend="cpu", **options)
    assert model.config.to_dict() == config
    assert model.config.use_cache is True
    model.save_pretrained(tmp_path / "applied")
    assert json.loads((tmp_path / "applied" / "config.json").read_text()) == before
    hyperac.remove(model)
    assert model.config.to_dict() == config


# ---------------------------------------------------------------------------------------------
# inference: exactly as un-applied


@pytest.mark.parametrize("options", APPLIED, ids=str)
@pytest.mark.parametrize("context", ["eval", "no_grad", "inference_mode"])
def test_inference_returns_the_cache_and_logits_of_the_unapplied_model(base_model, options, context):
    ids = _ids(3)
    outputs = []
    for applied in (False, True):
        model = copy.deepcopy(base_model)
        if applied:
            hyperac.apply(model, backend="cpu", **options)
        if context == "eval":
            model.eval()
            out = model(input_ids=ids)  # grad enabled, eval mode: no recompute either
        else:
            model.train()
            with torch.no_grad() if context == "no_grad" else torch.inference_mode():
                out = model(input_ids=ids)
        assert out.cache is not None and out.cache.get_seq_length() == 8  # config.use_cache=True, the default
        outputs.append(out)
    reference, result = outputs
    assert torch.equal(result.logits, reference.logits)
    for layer in range(4):
        assert torch.equal(result.cache.layers[layer].keys, reference.cache.layers[layer].keys)


def _greedy_by_hand(model, ids, steps):
    """A hand-written decoding loop that feeds the cache back (what ``generate`` does inside)."""
    tokens, logits, cache = ids, [], None
    with torch.no_grad():
        out = model(input_ids=ids)
        for _ in range(steps):
            cache = out.cache
            logits.append(out.logits[:, -1])
            next_token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], dim=1)
            out = model(input_ids=next_token, cache=cache)
    return tokens, torch.stack(logits), cache.get_seq_length()


@pytest.mark.parametrize("options", APPLIED, ids=str)
def test_generate_and_hand_written_decoding_match_unapplied(base_model, options):
    ids = _ids(5, (1, 6))
    results = []
    for applied in (False, True):
        model = copy.deepcopy(base_model)
        if applied:
            hyperac.apply(model, backend="cpu", **options)
        model.eval()
        generated = model.generate(input_ids=ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        model.train()  # a hand loop under no_grad, left in training mode (no dropout in this model)
        results.append((generated, *_greedy_by_hand(model, ids, 6)))
    (generated, tokens, logits, length), (generated_a, tokens_a, logits_a, length_a) = results
    assert torch.equal(generated_a, generated)
    assert torch.equal(tokens_a, tokens)
    assert torch.equal(logits_a, logits)
    assert length_a == length == 12


# ---------------------------------------------------------------------------------------------
# training forwards


_SEEN: collections.defaultdict = collections.defaultdict(list)
"""The cache arguments each attention got, forward and replays: module-level, so that hyperac does not put
back what a replay appends (NOTE [Python state in the replay] restores what hooks hold, not globals)."""


def _record_cache_args(model):
    _SEEN.clear()
    for index, layer in enumerate(model.model.layers):
        layer.self_attn.register_forward_pre_hook(
            lambda module, args, kwargs, index=index: _SEEN[index].append(kwargs.get("cache")), with_kwargs=True
        )
    return _SEEN


def _prefix_cache(model, prefix_len=4, seed=11):
    """A prefix-tuning style cache: trainable keys and values per layer (leaves that require grad)."""
    from transformers import DynamicCache

    config = model.config
    shape = (2, config.num_key_value_heads, prefix_len, config.hidden_size // config.num_attention_heads)
    generator = torch.Generator().manual_seed(seed)
    prefix = [(torch.randn(shape, generator=generator).requires_grad_(),
               torch.randn(shape, generator=generator).requires_grad_()) for _ in range(config.num_hidden_layers)]
    cache = DynamicCache(config=config)
    for layer, (keys, values) in enumerate(prefix):
        cache.update(keys, values, layer)
    return cache, prefix


def _prefix_step(model, options):
    """One step on a model fed a prefix cache; loss, grads (prefix included), cache lengths."""
    cache, prefix = _prefix_cache(model)
    ids = _ids(3)
    if options is not None:
        hyperac.apply(model, backend="cpu", **options)
    loss, grads = train_step(model, lambda m: m(input_ids=ids, labels=ids, cache=cache).loss)
    for layer, (keys, values) in enumerate(prefix):
        grads[f"prefix.{layer}.keys"], grads[f"prefix.{layer}.values"] = keys.grad, values.grad
    return (loss, grads), [cache.get_seq_length(layer) for layer in range(4)]


@pytest.mark.parametrize("options", [dict(mode="full"), dict(mode="selective"), dict(mode="pointwise"),
                                     dict(layers=PLAN)], ids=str)
def test_prefix_cache_in_training_gives_unapplied_loss_and_gradients(base_model, options):
    reference, lengths = _prefix_step(copy.deepcopy(base_model), None)
    assert lengths == [12] * 4  # 4 prefix + 8 new keys per layer
    with pytest.warns(HyperACWarning, match=r"a KV cache was passed to a training forward.*hyperac keeps it"):
        result, lengths_applied = _prefix_step(copy.deepcopy(base_model), options)
    assert_parity(reference, result)  # prefix gradients included
    assert lengths_applied == lengths  # each layer appended once, not again in its replay


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_second_backward_replays_from_the_same_cache(base_model, mode):
    """``backward(retain_graph=True)`` twice: each replay gets its own copy of the cache as it was."""
    ids = _ids(3)
    results = []
    for options in (None, dict(backend="cpu", mode=mode)):
        model = copy.deepcopy(base_model).train()
        cache, _ = _prefix_cache(model)
        if options is not None:
            hyperac.apply(model, **options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", HyperACWarning)
            loss = model(input_ids=ids, labels=ids, cache=cache).loss
        loss.backward(retain_graph=True)
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        assert cache.get_seq_length() == 12
    assert_parity(*results)


def test_replay_reads_the_cache_as_the_forward_did(base_model):
    cache, _ = _prefix_cache(base_model)
    model, _ = applied_copy(base_model, backend="cpu", layers=PLAN)
    seen = _record_cache_args(model)
    ids = _ids(3)
    with pytest.warns(HyperACWarning):
        train_step(model, lambda m: m(input_ids=ids, labels=ids, cache=cache).loss)
    for index, mode in enumerate(PLAN_MODES):
        assert seen[index][0] is cache  # the forward gets the caller's cache
        if mode == "off":
            assert len(seen[index]) == 1
        else:  # the replay gets a copy of the cache as it was before the layer appended, and appends to that
            replayed = seen[index][1]
            assert replayed is not cache and type(replayed) is type(cache)
            assert cache.get_seq_length(index) == replayed.get_seq_length(index) == 12  # 4 + 8, not 20
            assert replayed.layers[index].keys is not cache.layers[index].keys
            assert torch.equal(replayed.layers[index].keys, cache.layers[index].keys)


def test_training_forward_builds_no_cache_and_warns_once_per_model(base_model):
    ids = _ids(3)
    unapplied = copy.deepcopy(base_model).train()
    assert unapplied(input_ids=ids).cache is not None  # HF builds one in training by default
    first, _ = applied_copy(base_model, backend="cpu", mode="full")
    second, _ = applied_copy(base_model, backend="cpu", mode="full")
    first.train(), second.train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert first(input_ids=ids).cache is None  # as under HF activation checkpointing, silently
    for model in (first, second):  # a warning about one model does not silence it for another
        with pytest.warns(HyperACWarning, match=r"use_cache=True in a training forward.*use_cache=False") as caught:
            assert model(input_ids=ids, use_cache=True).cache is None
            model(input_ids=ids, use_cache=True)
        assert len([w for w in caught if issubclass(w.category, HyperACWarning)]) == 1
        assert str(caught[0].filename) == __file__  # points at the caller


def test_static_cache_written_in_place_raises_in_backward(base_model):
    from transformers import StaticCache

    model, _ = applied_copy(base_model, backend="cpu", mode="full")
    model.train()
    ids = _ids(3)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with pytest.warns(HyperACWarning, match="KV cache"):
        loss = model(input_ids=ids, labels=ids, cache=cache).loss
    message = r"\(a StaticCache\) was written in place after the layer's forward.*Use a DynamicCache"
    with pytest.raises(UnsupportedModelError, match=message):
        loss.backward()


# ---------------------------------------------------------------------------------------------
# a cache the forward reads: an encoder feeding its decoder (generic, then HF diffusion_gemma)


class _ReadingLayer(nn.Module):
    """Attends over an encoder memory read from ``cache`` plus its own keys, which it appends."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(width, width), nn.Linear(width, width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x, cache=None):
        keys, values = self.k(x), self.v(x)
        if cache is not None:
            cache["keys"].append(keys)  # a writer too: its replay must not see this
            keys = torch.cat([cache["memory_keys"], *cache["keys"]], dim=1)
            values = torch.cat([cache["memory_values"], values], dim=1)
            keys = keys[:, : values.shape[1]]
        attention = torch.softmax(self.q(x) @ keys.transpose(1, 2) / x.shape[-1] ** 0.5, dim=-1) @ values
        return x + self.mlp(x + attention)


class _EncoderFedModel(nn.Module):
    def __init__(self, width: int = 32, num_layers: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(128, width)
        self.encoder = nn.Linear(width, width)
        self.memory_k, self.memory_v = nn.Linear(width, width), nn.Linear(width, width)
        self.layers = nn.ModuleList(_ReadingLayer(width) for _ in range(num_layers))
        self.head = nn.Linear(width, 128)

    def forward(self, prompt, canvas):
        memory = torch.tanh(self.encoder(self.embed(prompt)))
        # written outside the layer calls; every layer reads it
        cache = {"memory_keys": self.memory_k(memory), "memory_values": self.memory_v(memory), "keys": []}
        x = self.embed(canvas)
        for layer in self.layers:
            x = layer(x, cache=cache)
        return nn.functional.cross_entropy(self.head(x).flatten(0, 1), canvas.flatten())


@pytest.mark.parametrize("mode", ["full", "selective", "pointwise"])
def test_encoder_feeding_a_read_only_cache_keeps_loss_and_gradients(mode):
    prompt, canvas = _ids(1, (2, 6)), _ids(2, (2, 5))
    base = _EncoderFedModel()
    reference = train_step(copy.deepcopy(base), lambda m: m(prompt, canvas))
    model, plan = applied_copy(base, backend="cpu", mode=mode, layers="layers")
    assert [layer.fqn for layer in plan.layers] == ["layers.0", "layers.1", "layers.2"]
    assert_parity(reference, train_step(model, lambda m: m(prompt, canvas)))


def _tiny_diffusion_gemma():
    from transformers import DiffusionGemmaConfig, DiffusionGemmaForBlockDiffusion

    text = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, global_head_dim=8, max_position_embeddings=128, sliding_window=8,
        num_experts=4, top_k_experts=2, moe_intermediate_size=16, layer_types=["sliding_attention", "full_attention"],
    )
    vision = dict(model_type="gemma4_vision", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, head_dim=8)
    config = DiffusionGemmaConfig(text_config=text, vision_config=vision, canvas_length=8)
    torch.manual_seed(0)
    return DiffusionGemmaForBlockDiffusion(config)


def _diffusion_loss(model):
    prompt, canvas = _ids(1, (2, 12)), _ids(2, (2, 8))
    logits = model(input_ids=prompt, decoder_input_ids=canvas).logits
    return nn.functional.cross_entropy(logits.flatten(0, 1), canvas.flatten())


@pytest.fixture(scope="module")
def diffusion_gemma():
    model = _tiny_diffusion_gemma()
    return model, train_step(copy.deepcopy(model), _diffusion_loss)


def test_diffusion_gemma_hf_checkpointing_matches(diffusion_gemma):
    """HF's own test_gradient_checkpointing_matches_no_checkpointing, in spirit: the bar hyperac meets."""
    base, reference = diffusion_gemma
    model = copy.deepcopy(base)
    model.activation_checkpointing_enable()
    assert_parity(reference, train_step(model, _diffusion_loss))


@pytest.mark.parametrize("mode", ["full", "selective", "pointwise"])
def test_diffusion_gemma_loss_and_gradients_unchanged(diffusion_gemma, mode):
    base, reference = diffusion_gemma
    model, plan = applied_copy(base, backend="cpu", mode=mode)
    warnings.simplefilter("error", HyperACWarning)  # its caches are internal: nothing to warn about
    assert {layer.fqn.rsplit(".", 1)[0] for layer in plan.layers} >= {
        "model.encoder.language_model.layers", "model.decoder.layers"}  # the cache's writers and readers
    assert_parity(reference, train_step(model, _diffusion_loss))
