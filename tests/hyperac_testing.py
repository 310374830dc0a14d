"""Shared helpers for the test suite: tiny models, one training step, parity checks."""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import os
import random
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import hyperac
from hyperac.measure import measure_step

LossFn = Callable[[nn.Module], torch.Tensor]


def tiny_llama(num_layers: int = 4, **overrides: Any) -> nn.Module:
    """A Llama with hidden size 64, built from a config (nothing downloaded); seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=128, max_position_embeddings=128,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**settings))


def lm_loss(batch: int = 2, seq: int = 32, vocab: int = 128, seed: int = 0) -> LossFn:
    """A loss function feeding fixed random token ids (labels = inputs) to a causal LM."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    return lambda model: model(input_ids=ids, labels=ids).loss


def train_step(model: nn.Module, loss_fn: LossFn, seed: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward from a fixed RNG seed; returns (loss, grads by parameter name)."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = loss_fn(model)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_parity(
    reference: tuple[torch.Tensor, dict[str, torch.Tensor]],
    other: tuple[torch.Tensor, dict[str, torch.Tensor]],
    exact: bool = True,
) -> None:
    """Loss and every gradient equal (bitwise when ``exact``, else tight float32 tolerance)."""
    def check(actual: torch.Tensor, expected: torch.Tensor, message: str) -> None:
        tolerance = dict(rtol=0.0, atol=0.0) if exact else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(actual, expected, **tolerance, msg=message)

    check(other[0], reference[0], "loss differs")
    assert other[1].keys() == reference[1].keys(), "a different set of parameters got gradients"
    for name, grad in reference[1].items():
        check(other[1][name], grad, f"gradient of {name} differs")


def applied_copy(model: nn.Module, **options: Any) -> tuple[nn.Module, hyperac.Plan]:
    """A deep copy of ``model`` with hyperac applied (the original is untouched)."""
    clone = copy.deepcopy(model)
    return clone, hyperac.apply(clone, **options)


def measure(model: nn.Module, loss_fn: LossFn, seed: int = 1) -> tuple[int, int]:
    """(activation bytes alive when backward starts, forward+backward FLOPs) of one step."""
    model.train()
    torch.manual_seed(seed)
    return measure_step(model, loss_fn)


# --- Small stacks of blocks, for counting what a policy keeps and replays. ---


class Stack(nn.Module):
    """``num_blocks`` seeded instances of ``block``, run in order."""

    def __init__(self, block: type[nn.Module], num_blocks: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList(block() for _ in range(num_blocks))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class BiasedMlp(nn.Module):
    """Three matmuls a layer: two `addmm` (biased) and one `mm` (bias-free)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)
        self.down = nn.Linear(width, width, bias=False)

    def forward(self, x):
        return x + self.down(self.up(x).relu() * self.gate(x).sigmoid())


# --- Model families for tests/test_models.py: tiny, built from configs (nothing downloaded), seeded. ---

_F = torch.nn.functional


def _seeded(model_class: Any, config: Any) -> nn.Module:
    torch.manual_seed(0)
    return model_class(config)


def tiny_qwen2(num_layers: int = 3, **overrides: Any) -> nn.Module:
    """A Qwen2 (biased q/k/v projections), hidden size 32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64,
    )
    settings.update(overrides)
    return _seeded(Qwen2ForCausalLM, Qwen2Config(**settings))


def tiny_qwen2_moe(num_layers: int = 3, **overrides: Any) -> nn.Module:
    """A Qwen2-MoE: 4 experts with top-2 routing plus a shared expert in every layer, hidden size 32."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    settings = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    settings.update(overrides)
    return _seeded(Qwen2MoeForCausalLM, Qwen2MoeConfig(**settings))


def tiny_mixtral(num_layers: int = 3, **overrides: Any) -> nn.Module:
    """A Mixtral: 4 experts with top-2 routing (weights renormalized after top-k), hidden size 32."""
    from transformers import MixtralConfig, MixtralForCausalLM

    settings = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    settings.update(overrides)
    return _seeded(MixtralForCausalLM, MixtralConfig(**settings))


def tiny_qwen3_moe(num_layers: int = 3, **overrides: Any) -> nn.Module:
    """A Qwen3-MoE: 4 experts with top-2 routing (weights renormalized after top-k), hidden size 32."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    settings = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
    )
    settings.update(overrides)
    return _seeded(Qwen3MoeForCausalLM, Qwen3MoeConfig(**settings))


def tiny_gemma3n_text(num_layers: int = 4, num_kv_shared_layers: int = 2, **overrides: Any) -> nn.Module:
    """A Gemma-3n text model (AltUp, LAuReL, per-layer inputs) whose last ``num_kv_shared_layers``
    layers reuse the keys and values of earlier layers; hidden size 32."""
    from transformers import Gemma3nForCausalLM, Gemma3nTextConfig

    settings = dict(
        vocab_size=128, vocab_size_per_layer_input=128, hidden_size=32, hidden_size_per_layer_input=8,
        intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, num_kv_shared_layers=num_kv_shared_layers, laurel_rank=4, altup_num_inputs=2,
        layer_types=["sliding_attention", "full_attention"] * (num_layers // 2), sliding_window=8,
        activation_sparsity_pattern=[0.0] * num_layers, max_position_embeddings=64,
    )
    settings.update(overrides)
    return _seeded(Gemma3nForCausalLM, Gemma3nTextConfig(**settings))


def tiny_bart(num_layers: int = 2, **overrides: Any) -> nn.Module:
    """A BART encoder-decoder, ``num_layers`` on each side, hidden size 32."""
    from transformers import BartConfig, BartForConditionalGeneration

    settings = dict(
        vocab_size=128, d_model=32, encoder_layers=num_layers, decoder_layers=num_layers, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
    )
    settings.update(overrides)
    return _seeded(BartForConditionalGeneration, BartConfig(**settings))


def tiny_t5(num_layers: int = 2, **overrides: Any) -> nn.Module:
    """A T5 encoder-decoder (relative position bias shared from the first block), hidden size 32."""
    from transformers import T5Config, T5ForConditionalGeneration

    settings = dict(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=num_layers, num_decoder_layers=num_layers,
        num_heads=4, relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0,
    )
    settings.update(overrides)
    return _seeded(T5ForConditionalGeneration, T5Config(**settings))


def seq2seq_loss(batch: int = 2, source: int = 24, target: int = 16, vocab: int = 128, seed: int = 0) -> LossFn:
    """A loss function feeding fixed random source ids and labels to an encoder-decoder."""
    generator = torch.Generator().manual_seed(seed)
    source_ids = torch.randint(3, vocab, (batch, source), generator=generator)
    labels = torch.randint(3, vocab, (batch, target), generator=generator)
    return lambda model: model(input_ids=source_ids, labels=labels).loss


def tiny_gpt2(num_layers: int = 3, **overrides: Any) -> nn.Module:
    """A GPT-2 (tied embeddings; embd/attn/resid dropout 0.1 by default), hidden size 32."""
    from transformers import GPT2Config, GPT2LMHeadModel

    settings = dict(vocab_size=128, n_embd=32, n_layer=num_layers, n_head=4, n_positions=64, bos_token_id=0,
                    eos_token_id=0)
    settings.update(overrides)
    return _seeded(GPT2LMHeadModel, GPT2Config(**settings))


QWEN2_VL_IMAGE_TOKEN = 120


def tiny_qwen2_vl(num_layers: int = 2, **text_overrides: Any) -> nn.Module:
    """A Qwen2-VL with two towers: vision blocks (``model.visual.blocks``, between ``patch_embed`` and
    ``merger``) and text layers (``model.language_model.layers``), ``num_layers`` each, width 32."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]},
    )
    text.update(text_overrides)
    vision = dict(depth=num_layers, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=4,
                  spatial_merge_size=2, temporal_patch_size=2, in_channels=3)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=QWEN2_VL_IMAGE_TOKEN,
                           video_token_id=121, vision_start_token_id=122, vision_end_token_id=123)
    return _seeded(Qwen2VLForConditionalGeneration, config)


def qwen2_vl_loss(batch: int = 2, seq: int = 24, seed: int = 0) -> LossFn:
    """A loss function for :func:`tiny_qwen2_vl`: one 16x16 image (16 patches, 4 merged image tokens)
    per sequence, labels = inputs."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 110, (batch, seq), generator=generator)
    ids[:, 2], ids[:, 3:7], ids[:, 7] = 122, QWEN2_VL_IMAGE_TOKEN, 123
    grid = torch.tensor([[1, 4, 4]] * batch)
    pixels = torch.randn(batch * 16, 3 * 2 * 4 * 4, generator=generator)
    token_types = (ids == QWEN2_VL_IMAGE_TOKEN).int()
    return lambda model: model(
        input_ids=ids, labels=ids, pixel_values=pixels, image_grid_thw=grid, mm_token_type_ids=token_types
    ).loss


class TinyBlock(nn.Module):
    """Pre-norm causal self-attention (SDPA with dropout) and a GELU MLP, in plain PyTorch."""

    def __init__(self, width: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attention = _F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        x = x + self.drop(self.proj(attention.transpose(1, 2).reshape(batch, seq, width)))
        return x + self.drop(self.fc2(_F.gelu(self.fc1(self.norm2(x)))))


class TinyBlocksModel(nn.Module):
    """A plain PyTorch language model: embedding, ``self.blocks = nn.ModuleList(...)``, head."""

    def __init__(self, num_layers: int = 3, width: int = 32, heads: int = 4, vocab: int = 128,
                 dropout: float = 0.1) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(TinyBlock(width, heads, dropout) for _ in range(num_layers))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tiny_blocks_model(**options: Any) -> TinyBlocksModel:
    """A seeded :class:`TinyBlocksModel`."""
    torch.manual_seed(0)
    return TinyBlocksModel(**options)


def next_token_loss(batch: int = 2, seq: int = 32, vocab: int = 128, seed: int = 0) -> LossFn:
    """Next-token cross-entropy of a model that maps ids to logits (:class:`TinyBlocksModel`)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=generator)
    return lambda model: _F.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())


def hf_configs(model: nn.Module) -> list[Any]:
    """Every distinct HF config object of ``model`` (``module.config`` of any module) and their
    sub-configs (``text_config``, ``vision_config`` ...), found independently of hyperac."""
    found: dict[int, Any] = {}
    pending = [getattr(module, "config", None) for module in model.modules()]
    while pending:
        config = pending.pop()
        if config is None or id(config) in found or not hasattr(config, "to_dict"):
            continue
        found[id(config)] = config
        pending.extend(getattr(config, name, None) for name in getattr(config, "sub_configs", None) or {})
    return list(found.values())


class kv_cache_disabled:
    """``with kv_cache_disabled(model):`` sets ``use_cache=False`` on every HF config of ``model`` (what
    ``hyperac.apply`` and HF's own activation checkpointing set) and restores it afterwards."""

    def __init__(self, model: nn.Module) -> None:
        self.saved = [(c, c.use_cache) for c in hf_configs(model) if getattr(c, "use_cache", None)]

    def __enter__(self) -> None:
        for config, _ in self.saved:
            config.use_cache = False

    def __exit__(self, *exc: Any) -> None:
        for config, value in self.saved:
            config.use_cache = value


# --- Swap tests (tests/test_swap.py) ---

_HOOK_DICTS = (
    "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
    "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks",
)


def hook_count(model: nn.Module) -> int:
    """Module hooks of every kind on ``model`` and its sub-modules, plus instance ``forward``
    overrides, plus the process-wide module hooks (0 for a model nothing is applied to)."""
    from torch.nn.modules import module as module_globals

    count = sum(len(getattr(m, name, None) or {}) for m in model.modules() for name in _HOOK_DICTS)
    count += sum("forward" in m.__dict__ for m in model.modules())
    global_dicts = ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                    "_global_backward_pre_hooks")
    return count + sum(len(getattr(module_globals, name, None) or {}) for name in global_dicts)


def freed_storage_tensors() -> list[torch.Tensor]:
    """Every live tensor whose storage is smaller than its view needs (resized away, e.g. by swap),
    found by a full garbage-collector scan (about 0.3 s)."""
    import gc

    found = []
    for obj in gc.get_objects():
        if type(obj) not in (torch.Tensor, nn.Parameter) or obj.device.type == "meta" or not obj.numel():
            continue
        if obj.layout is not torch.strided or obj.is_nested:
            continue
        extent = obj.storage_offset() + sum((n - 1) * s for n, s in zip(obj.shape, obj.stride())) + 1
        if obj.untyped_storage().nbytes() < extent * obj.element_size():
            found.append(obj)
    return found


def saved_for_backward(fn: Callable[[], Any]) -> tuple[Any, list[torch.Tensor]]:
    """Run ``fn`` and return (its result, every tensor autograd saved for backward meanwhile)."""
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = fn()
    return result, saved


@contextlib.contextmanager
def loaded_host(model: nn.Module, seed: int = 0) -> Iterator[None]:
    """A host as busy as a shared CI machine while ``model`` runs: another thread spins on the CPU
    (and the interpreter lock), and every module's forward starts after a random sleep of up to a
    millisecond. What a virtual clock reads must not change under it."""
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    delays = random.Random(seed)
    handles = [module.register_forward_pre_hook(lambda *_: time.sleep(delays.uniform(0, 1e-3)))
               for module in model.modules()]
    thread = threading.Thread(target=spin, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def hyperac_lines(counts: collections.Counter, key: object) -> Iterator[None]:
    """Count the lines of hyperac's own code that run inside, under ``counts[key]``: work counted
    rather than timed (CI machines are shared and 10x slower)."""
    root = os.path.dirname(hyperac.__file__)

    def line(frame: Any, event: str, arg: Any) -> Any:
        counts[key] += event == "line"
        return line

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: line if frame.f_code.co_filename.startswith(root) else None)
    try:
        yield
    finally:
        sys.settrace(previous)


_COUNTERS: dict[int, collections.Counter] = {}
"""The counters of :func:`counting_pre_hook`, module-level: hyperac puts back what a replay changes in the
state a hook's closure holds (NOTE [Python state in the replay]), so a counter held there would count each
forward once; a test that counts replays keeps its counter where hyperac does not reach."""


def counting_pre_hook(counts: collections.Counter, key: Any) -> Callable[..., None]:
    """A forward pre-hook that adds one to ``counts[key]`` each time the module runs, replays included."""
    _COUNTERS[id(counts)] = counts
    return functools.partial(_count, id(counts), key)


def _count(table: int, key: Any, module: nn.Module, args: Any) -> None:
    _COUNTERS[table].update([key])


class CpuRNGStatesTracker:
    """A stand-in for DeepSpeed's ``CudaRNGStatesTracker`` (the same interface as DeepSpeed's and
    Megatron-Core's: ``get_states``, ``set_states``, ``add``, ``fork``, ``reset``) that swaps its named
    states into the CPU generator where DeepSpeed's swaps them into the CUDA one. What it cannot show
    without a GPU: the device generator's swap itself, which torch's checkpoint and hyperac's watch
    treat the same as the CPU one's."""

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        self.states_, self.seeds_ = {}, set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        if seed in self.seeds_ or name in self.states_:
            raise ValueError(f"seed {seed} or state {name!r} already exists")
        self.seeds_.add(seed)
        outside = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outside)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        outside = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outside)
