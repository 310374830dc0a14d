"""hyperac.integrations.torchtitan: the torch it refuses, the inherited torchtitan AC fields it
refuses rather than ignores, torchtitan's save-list override and per-module force-recompute.
(Training through torchtitan's parallelize_llama is
tests/test_parallel.py::test_torchtitan_llama3_debug_model, in ``tox -e torchtitan``.)"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import hyperac
from hyperac import ConfigError, TorchVersionError
from hyperac.measure import flop_counter, measure_step

OLD_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14)


@pytest.mark.skipif(not OLD_TORCH, reason="this torch is one torchtitan 0.3 runs on")
def test_import_refuses_a_torch_older_than_torchtitan_needs():
    """On torch 2.13 (the CPU env) the integration says so before torchtitan is imported at all."""
    pattern = (rf"torch {re.escape(torch.__version__)} is older than the torch 2\.14 that torchtitan 0\.3 needs.*"
               r"pip install 'torch==2\.14\.1' 'torchtitan==0\.3\.0'")
    with pytest.raises(TorchVersionError, match=pattern):
        importlib.import_module("hyperac.integrations.torchtitan")


@pytest.fixture
def integration():
    if OLD_TORCH:
        pytest.skip("torchtitan 0.3 needs torch 2.14 (tox -e torchtitan)")
    pytest.importorskip("torchtitan")
    return importlib.import_module("hyperac.integrations.torchtitan")


def test_check_torch_reads_local_versions(integration):
    integration.check_torch("2.14.1+cu130")
    integration.check_torch("2.15.0.dev20260101")
    with pytest.raises(TorchVersionError, match=r"torch 2\.13\.0\+cpu is older"):
        integration.check_torch("2.13.0+cpu")


@pytest.mark.parametrize(("field", "value", "default"), [
    ("preserve_rng_state", False, "True"), ("determinism_check", "none", "'default'"), ("debug", True, "False"),
])
def test_inherited_fields_other_than_their_default_are_refused(integration, field, value, default):
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Sequential(nn.Linear(4, 4)), "1": nn.Sequential(nn.Linear(4, 4))})
    recompute = integration.HyperACRecompute(integration.HyperACRecompute.Config(**{field: value}))
    with pytest.raises(ConfigError, match=rf"HyperACRecompute\.Config\.{field}={value!r} has no effect in hyperac.*"
                                          rf"leave it at its default, {default}"):
        recompute.apply(model)
    assert "forward" not in model.layers["0"].__dict__  # nothing applied


@pytest.fixture(scope="module")
def debug_model():
    """torchtitan's llama3 debug model (causal SDPA: FlexAttention has no CPU backward), built on
    the CPU, and one step's loss function."""
    if OLD_TORCH:
        pytest.skip("torchtitan 0.3 needs torch 2.14 (tox -e torchtitan)")
    pytest.importorskip("torchtitan")
    sys.path.insert(0, str(Path(__file__).parents[1] / "examples"))
    from torchtitan_llama3 import BATCH, SEQ, cpu_debug_model

    spec = cpu_debug_model()
    torch.manual_seed(0)
    model = spec.model.build()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    tokens = torch.randint(0, spec.model.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    return model.train(), lambda model: model(tokens, positions=positions).float().pow(2).mean(), tokens.numel()


def _step(model, loss_fn):
    """(FLOPs of one forward and backward, gradients by parameter name)."""
    model.zero_grad(set_to_none=True)
    with flop_counter() as counter:
        loss_fn(model).backward()
    return counter.get_total_flops(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _applied(recompute, model):
    clone = copy.deepcopy(model)
    recompute.apply(clone)
    return clone


def test_get_save_ops_override_replays_what_torchtitans_selective_ac_replays(integration, debug_model):
    """A subclass returning torchtitan's own save list (as one would subclass SelectiveAC) replays
    exactly the FLOPs of torchtitan's SelectiveAC on the debug model (which also saves every other
    matmul); gradients stay bitwise those of the model without recompute. hyperac's own list replays
    the same here: at 64 tokens attention costs fewer FLOPs per kept byte than the projections, so it
    is recomputed (NOTE [Attention kept by its cost per byte]), as torchtitan's list, which names no
    CPU attention kernel, does on the CPU."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC, _get_default_save_ops

    class TorchtitanSaveList(integration.HyperACRecompute):
        def get_save_ops(self):
            return _get_default_save_ops()

    model, loss_fn, _ = debug_model
    flops, grads = _step(model, loss_fn)
    torchtitan_flops, _ = _step(_applied(SelectiveAC(SelectiveAC.Config(force_recompute_mm_shapes_by_fqns=[])), model),
                                loss_fn)
    config = integration.HyperACRecompute.Config(backend="cpu")
    ours_flops, ours_grads = _step(_applied(TorchtitanSaveList(config), model), loss_fn)
    hyperacs_flops, _ = _step(_applied(integration.HyperACRecompute(config), model), loss_fn)
    assert ours_flops == torchtitan_flops == hyperacs_flops > flops
    for name, grad in grads.items():
        torch.testing.assert_close(ours_grads[name], grad, rtol=0, atol=0, msg=name)


def test_selective_keeps_no_more_than_torchtitans_selective_ac(integration, debug_model):
    """hyperac's selective keeps at most the bytes torchtitan's SelectiveAC keeps on torchtitan's own
    model, with bitwise gradients. Before attention was weighed by its cost per byte, hyperac kept
    CPU attention's output and log-sum-exp on top: 835,584 B more."""
    model, loss_fn, _ = debug_model
    _assert_keeps_no_more_than_selective_ac(integration, model, loss_fn)


def _assert_keeps_no_more_than_selective_ac(integration, model, loss_fn) -> None:
    """hyperac's selective keeps at most SelectiveAC's bytes on ``model``; its gradients are bitwise."""
    from torchtitan.distributed.activation_checkpoint import SelectiveAC

    _, grads = _step(model, loss_fn)
    titan = _applied(SelectiveAC(SelectiveAC.Config(force_recompute_mm_shapes_by_fqns=[])), model)
    torchtitan_kept, _ = measure_step(titan, loss_fn)
    ours = _applied(integration.HyperACRecompute(integration.HyperACRecompute.Config(backend="cpu")), model)
    ours_kept, _ = measure_step(ours, loss_fn)
    assert ours_kept <= torchtitan_kept
    _, ours_grads = _step(ours, loss_fn)
    for name, grad in grads.items():
        torch.testing.assert_close(ours_grads[name], grad, rtol=0, atol=0, msg=name)


def test_force_recompute_replays_the_named_modules_only(integration, debug_model):
    """``force_recompute=["feed_forward.w[13]"]``: w1 and w3 keep nothing and leave the matmul count,
    so the block replays wo (the 2nd of wqkv, wo, w2) and both: one 256x768 matmul per block more
    than replaying wo and w3. By module, not by shape: wqkv, also 256x768, is still kept (torchtitan's
    force_recompute_mm_shapes_by_fqns would force it too)."""
    model, loss_fn, tokens = debug_model
    base = integration.HyperACRecompute.Config(backend="cpu", save_ops=["aten::mm"])
    plain, _ = _step(_applied(integration.HyperACRecompute(base), model), loss_fn)
    forced_config = dataclasses.replace(base, force_recompute=["feed_forward.w[13]"])
    forced_model = _applied(integration.HyperACRecompute(forced_config), model)
    forced, grads = _step(forced_model, loss_fn)
    block = model.layers["0"]
    one_matmul = 2 * tokens * block.feed_forward.w1.in_features * block.feed_forward.w1.out_features
    assert block.attention.qkv_linear.wqkv.weight.shape == block.feed_forward.w1.weight.shape
    assert forced - plain == one_matmul * len(model.layers)
    assert hyperac.applied_plan(forced_model).layers[0].mode == "selective"
    _, reference = _step(model, loss_fn)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def test_torchtitans_default_force_list_on_a_dense_model_is_an_error(integration, debug_model):
    model, _, _ = debug_model
    config = integration.HyperACRecompute.Config(backend="cpu", force_recompute=["moe.router.gate"])
    clone = copy.deepcopy(model)
    with pytest.raises(ConfigError, match=r"force_recompute=\['moe\.router\.gate'\] matches no module inside the "
                                          r"selective layers.*'attention', 'attention\.rope'"):
        integration.HyperACRecompute(config).apply(clone)
    assert hyperac.applied_plan(clone) is None


# (dim, heads, KV heads, MLP hidden, fused QKV, batch, sequence): short sequences, where attention is
# recomputed, and long ones, where it is kept in a projection's place (NOTE [Attention kept in a
# matmul's place]); fused and separate QKV, grouped and full KV heads. The first is the one where
# hyperac kept 1.09x SelectiveAC's bytes before: attention on top of the alternation.
GEOMETRIES = [
    (32, 2, 1, 64, True, 2, 16), (32, 2, 1, 64, False, 2, 16), (32, 2, 2, 64, True, 2, 24),
    (32, 2, 1, 64, True, 1, 64), (32, 2, 1, 64, False, 1, 128), (64, 4, 2, 128, True, 2, 32),
    (64, 4, 2, 128, False, 1, 96), (48, 6, 3, 96, True, 2, 40), (64, 8, 8, 192, True, 1, 256),
]


@pytest.mark.parametrize(("dim", "heads", "kv_heads", "hidden", "fused", "batch", "seq"), GEOMETRIES, ids=str)
def test_selective_keeps_no_more_than_selective_ac_on_any_geometry(integration, dim, heads, kv_heads, hidden,
                                                                     fused, batch, seq):
    """torchtitan's llama3 (two layers, causal SDPA) built at several geometries: hyperac's selective
    keeps at most the bytes torchtitan's SelectiveAC keeps, with bitwise gradients."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers

    vocab = 64
    config = Llama3Model.Config(
        dim=dim, vocab_size=vocab, tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim),
        norm=RMSNorm.Config(normalized_shape=dim), lm_head=Linear.Config(in_features=dim, out_features=vocab),
        layers=_build_llama3_layers(  # what torchtitan's own flavors are built with
            fuse_qkv=fused, n_layers=2, dim=dim, n_heads=heads, n_kv_heads=kv_heads, hidden_dim=hidden,
            rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=1024, theta=500000), attn_backend="flex"),
    )
    for _, _, parent, field in list(config.traverse(FlexAttention.Config)):  # no FlexAttention backward on CPU
        setattr(parent, field, ScaledDotProductAttention.Config())
    torch.manual_seed(0)
    model = config.build()
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    tokens = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(seq).expand(batch, seq)

    def loss_fn(model):
        return model(tokens, positions=positions).float().pow(2).mean()

    _assert_keeps_no_more_than_selective_ac(integration, model.train(), loss_fn)
