"""Discovery without ``layers=``: each pattern of issue 11 §2 on a tiny model, how each layer was found, and
the paths that name containers of lists. Gradients are compared with the un-applied model, bitwise."""

from __future__ import annotations

import copy

import pytest
import torch
from hyperac_testing import TinyBlock, applied_copy, assert_parity, lm_loss, next_token_loss, train_step
from torch import nn

import hyperac
from hyperac.measure import flop_counter


class NanoGPT(nn.Module):
    """nanoGPT's layout: ``transformer = ModuleDict(wte, h=ModuleList, ln_f)``."""

    def __init__(self, width: int = 32, vocab: int = 128) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, width), h=nn.ModuleList(TinyBlock(width, 4, 0.1) for _ in range(3)),
            ln_f=nn.LayerNorm(width),
        ))
        self.lm_head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(ids)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class Titan(nn.Module):
    """torchtitan's layout: ``layers`` is a ``ModuleDict`` keyed "0", "1", ..."""

    def __init__(self, width: int = 32, vocab: int = 128) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, width)
        self.layers = nn.ModuleDict({str(i): TinyBlock(width, 4, 0.1) for i in range(3)})
        self.output = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(ids)
        for layer in self.layers.values():
            x = layer(x)
        return self.output(x)


class Stage(nn.Module):
    """timm's stage: a downsample and ``blocks``, a ``Sequential`` holding most of its parameters."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.downsample = nn.Linear(width, width)
        self.blocks = nn.Sequential(*(TinyBlock(width, 4, 0.1) for _ in range(2)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


class StagedModel(nn.Module):
    """timm's ``stages`` of stages (ConvNeXt, Swin), on tokens."""

    def __init__(self, width: int = 32, vocab: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.stages = nn.Sequential(Stage(width), Stage(width))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.stages(self.embed(ids)))


class Pointwise(nn.Module):
    """A small block of its own class (efficientnet's ``DepthwiseSeparableConv`` in its first stage)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.act = nn.LayerNorm(width), nn.GELU()
        self.fc1, self.fc2 = nn.Linear(width, 4), nn.Linear(4, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class EfficientNetLayout(nn.Module):
    """timm efficientnet's ``blocks``: a ``Sequential`` of stage ``Sequential``s, the first holding one small
    block of another class (under a tenth of the parameters of the largest stage)."""

    def __init__(self, width: int = 32, vocab: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        stages = (nn.Sequential(*(TinyBlock(width, 4, 0.1) for _ in range(2))) for _ in range(2))
        self.blocks = nn.Sequential(nn.Sequential(Pointwise(width)), *stages)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(ids)))


@pytest.mark.parametrize(("build", "expected"), [
    (NanoGPT, [f"transformer.h.{i}" for i in range(3)]),
    (Titan, [f"layers.{i}" for i in range(3)]),
    (StagedModel, [f"stages.{s}.blocks.{b}" for s in range(2) for b in range(2)]),
    (EfficientNetLayout, ["blocks.0.0", *(f"blocks.{s}.{b}" for s in (1, 2) for b in range(2))]),
], ids=["nanogpt", "torchtitan", "timm_stages", "timm_small_first_stage"])
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_plain_pytorch_layouts_found_and_gradients_equal(build, expected, mode):
    torch.manual_seed(0)
    model = build()
    loss_fn = next_token_loss()
    reference = train_step(model, loss_fn)
    applied, plan = applied_copy(model, mode=mode, backend="cpu")
    assert [layer.fqn for layer in plan.layers] == expected
    assert {layer.found_by for layer in plan.layers} == {"structure"}
    assert_parity(reference, train_step(applied, loss_fn))


def test_print_plan_says_how_each_layer_was_found():
    plan = hyperac.apply(NanoGPT(), backend="cpu")
    lines = str(plan).splitlines()
    assert "found by" in lines[1]
    assert all(" structure " in line for line in lines[2:5])
    assert hyperac.apply(Titan(), backend="cpu", layers="layers").layers[0].found_by == "user path"


def test_stem_sequential_of_leaves_is_no_layer_container():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(hyperac.UnsupportedModelError, match=r"two blocks of one class.*pass layers='blocks'"):
        hyperac.apply(model, backend="cpu")


# --- transformers classes that declare no layer class ---------------------------------------------------


def _hf(config_name: str, model_name: str, **settings) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    return getattr(transformers, model_name)(getattr(transformers, config_name)(**settings))


_TEXT = dict(vocab_size=128, max_position_embeddings=64)


@pytest.mark.parametrize(("build", "expected"), [
    (lambda: _hf("CTRLConfig", "CTRLLMHeadModel", vocab_size=128, n_positions=64, n_embd=32, dff=64, n_layer=2,
                 n_head=2), ["transformer.h.0", "transformer.h.1"]),
    (lambda: _hf("OpenAIGPTConfig", "OpenAIGPTLMHeadModel", vocab_size=128, n_positions=64, n_embd=32, n_layer=2,
                 n_head=2), ["transformer.h.0", "transformer.h.1"]),
    (lambda: _hf("XLMConfig", "XLMWithLMHeadModel", vocab_size=128, emb_dim=32, n_layers=2, n_heads=2,
                 max_position_embeddings=64),
     ["transformer.attentions.0", "transformer.attentions.1", "transformer.ffns.0", "transformer.ffns.1"]),
    (lambda: _hf("AlbertConfig", "AlbertForMaskedLM", **_TEXT, embedding_size=16, hidden_size=32,
                 num_hidden_layers=3, num_attention_heads=2, intermediate_size=64),
     ["albert.encoder.albert_layer_groups.0.albert_layers.0"]),
], ids=["ctrl", "openai_gpt", "xlm_parallel_lists", "albert_reused_group"])
def test_hf_models_without_declared_layers_found_and_gradients_equal(build, expected):
    pytest.importorskip("transformers")
    model = build()
    loss_fn = lm_loss(seq=16)
    reference = train_step(model, loss_fn)
    applied, plan = applied_copy(model, mode="full", backend="cpu")
    assert [layer.fqn for layer in plan.layers] == expected
    assert_parity(reference, train_step(applied, loss_fn))


def test_rt_detr_backbone_bottlenecks_not_their_conv_sequentials():
    pytest.importorskip("transformers")
    model = _hf("RTDetrConfig", "RTDetrForObjectDetection", backbone_config=dict(
        model_type="rt_detr_resnet", hidden_sizes=[16, 32, 32, 32], embedding_size=16, depths=[1, 2, 1, 1],
    ), d_model=32, encoder_hidden_dim=32, encoder_ffn_dim=64, decoder_ffn_dim=64, decoder_layers=2,
        num_queries=10)
    plan = hyperac.apply(model, backend="cpu")
    fqns = [layer.fqn for layer in plan.layers]
    assert not any(fqn.split(".")[-2] == "layer" for fqn in fqns), fqns  # a bottleneck's conv/norm/act triples
    assert "model.decoder.layers.0" in fqns


# --- paths to containers of lists ----------------------------------------------------------------------


def test_funnel_path_to_container_of_module_lists_recomputes_their_children():
    pytest.importorskip("transformers")
    model = _hf("FunnelConfig", "FunnelForMaskedLM", **_TEXT, block_sizes=[1, 2], d_model=32, n_head=2, d_head=16,
                d_inner=64)
    loss_fn = lm_loss(seq=16)
    reference = train_step(model, loss_fn)
    applied, plan = applied_copy(model, mode="full", backend="cpu", layers="funnel.encoder.blocks")
    assert [layer.fqn for layer in plan.layers] == [
        "funnel.encoder.blocks.0.0", "funnel.encoder.blocks.1.0", "funnel.encoder.blocks.1.1",
    ]
    assert_parity(reference, train_step(applied, loss_fn))
    with flop_counter() as off_counter:
        loss_fn(copy.deepcopy(model)).backward()
    with flop_counter() as full_counter:
        loss_fn(applied).backward()
    assert full_counter.get_total_flops() > off_counter.get_total_flops()  # the blocks really replay


def test_path_to_empty_container_raises_saying_what_it_holds():
    model = Titan()
    model.empty = nn.ModuleList([nn.ModuleList()])
    with pytest.raises(hyperac.ConfigError, match=r"names 'empty', a ModuleList, not a non-empty.*nor of such lists"):
        hyperac.apply(model, backend="cpu", layers="empty")


# --- reversible layers ----------------------------------------------------------------------------------


def test_reformer_reversible_layers_stay_off_with_a_note():
    pytest.importorskip("transformers")
    model = _hf("ReformerConfig", "ReformerModelWithLMHead", **_TEXT, is_decoder=True, hidden_size=32,
                num_attention_heads=2, attention_head_size=16, feed_forward_size=64, axial_pos_embds=False,
                attn_layers=["local", "local"], local_attn_chunk_length=8, num_buckets=4)
    plan = hyperac.apply(model, mode="full", backend="cpu")
    assert plan.layers and all(layer.mode == "off" for layer in plan.layers)
    assert any("reversible" in note and "gains nothing" in note for note in plan.notes)
    assert "note: " in str(plan)
