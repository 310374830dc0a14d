"""hyperac on Megatron-Core (``hyperac.integrations.megatron``), with attention and hidden dropout on:
every mode bitwise against the un-applied model and Megatron's own recompute over two steps, one rank
and two tensor-parallel ranks (with and without sequence parallel), and a first pipeline stage.
Runs in ``tox -e megatron`` (megatron-core 0.16.1); skipped where megatron-core is not installed.

Megatron-Core assumes CUDA in a few places; the CPU stand-ins are tests/megatron_shims.py (what each
replaces and what it cannot show). What no CPU test shows: the CUDA generator's own state swaps inside
the RNG tracker, and NCCL; the gloo ranks run the same Megatron code paths.
"""

from __future__ import annotations

import functools
import json
import pathlib
import subprocess
import sys

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (tox -e megatron)")

import megatron_shims  # noqa: E402
import megatron_testing  # noqa: E402
from hyperac_testing import assert_parity  # noqa: E402
from megatron.core import parallel_state, tensor_parallel  # noqa: E402
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput  # noqa: E402

import hyperac  # noqa: E402
from hyperac.integrations import megatron as hyperac_megatron  # noqa: E402

MODES = ("off", "full", "selective", "selective-even", "pointwise", "swap", "auto")
WORKER = pathlib.Path(__file__).with_name("megatron_worker.py")


@pytest.fixture(scope="module", autouse=True)
def one_rank(tmp_path_factory):
    """A gloo world of one rank and Megatron's parallel state for it; Megatron's RNG tracker left
    unseeded after (a seeded one makes every later apply in the process refuse until it is registered)."""
    store = tmp_path_factory.mktemp("megatron") / "store"
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1)
    yield
    tensor_parallel.get_cuda_rng_tracker().reset()
    parallel_state.destroy_model_parallel()
    torch.distributed.destroy_process_group()


@pytest.fixture(autouse=True)
def shims(monkeypatch):
    megatron_shims.install(monkeypatch)
    yield
    hyperac.unregister_rng_tracker(hyperac_megatron.TRACKER_NAME)


@pytest.fixture(scope="module")
def reference():
    with pytest.MonkeyPatch.context() as monkeypatch:
        megatron_shims.install(monkeypatch)
        return megatron_testing.steps(megatron_testing.tiny_gpt())


def _options(mode: str) -> dict:
    if mode == "swap":
        return dict(mode="swap", backend="sim", min_swap_bytes=0)  # the CPU backend would not swap
    if mode == "auto":
        ids, positions = megatron_testing.batch(0)
        mask = megatron_shims.causal_mask(megatron_testing.SEQ)
        return dict(mode="auto", budget=0.5, backend="cpu",
                    sample=lambda model: model(ids, positions, mask, labels=ids).float().mean())
    return dict(mode=mode, backend="cpu")


def _assert_steps_equal(expected, got):
    assert len(expected) == len(got)
    for one, other in zip(expected, got):
        assert_parity(one, other)


@pytest.mark.parametrize("mode", MODES)
def test_every_mode_bitwise_with_dropout_over_two_steps(reference, mode):
    """Attention dropout draws inside Megatron's RNG tracker's fork(); without the tracker replayed,
    full keeps 4 of 53 gradients equal (issue 27)."""
    model = megatron_testing.tiny_gpt()
    plan = hyperac_megatron.apply(model, **_options(mode))
    assert [layer.fqn for layer in plan.layers] == [f"decoder.layers.{i}" for i in range(megatron_testing.LAYERS)]
    if mode != "auto":
        assert {layer.mode for layer in plan.layers} == {mode}
    _assert_steps_equal(reference, megatron_testing.steps(model))
    hyperac.remove(model)
    assert model.decoder.layers[0].forward.__self__ is model.decoder.layers[0]


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_megatron_own_recompute_gives_the_same_gradients(reference, granularity):
    """hyperac's gradients (above) equal the un-applied model's, and so do Megatron's own recompute's:
    the three agree bitwise."""
    recompute = dict(recompute_granularity=granularity)
    if granularity == "full":
        recompute.update(recompute_method="uniform", recompute_num_layers=1)
    _assert_steps_equal(reference, megatron_testing.steps(megatron_testing.tiny_gpt(**recompute)))


@pytest.mark.parametrize("recompute", [
    dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(recompute_granularity="selective"),
    dict(recompute_granularity="selective", recompute_modules=["layernorm", "core_attn"]),
])
def test_model_with_megatron_recompute_is_refused(recompute):
    """Never recomputed twice; Megatron's ``CheckpointWithoutOutput`` (``recompute_modules=["layernorm"]``)
    only runs with its recompute on, so it never runs inside a hyperac region."""
    model = megatron_testing.tiny_gpt(**recompute)
    granularity = recompute["recompute_granularity"]
    with pytest.raises(hyperac.UnsupportedModelError,
                       match=rf"the model recomputes already: GPTModel.config.recompute_granularity='{granularity}'.*"
                             r"Build the model with recompute_granularity=None \(drop --recompute-granularity"):
        hyperac_megatron.apply(model, mode="selective", backend="cpu")
    assert not hasattr(model, "_hyperac")


def _mlp_with(model, kind: str):
    """Each layer's MLP with a recompute of its own inside: torch's checkpoint around the MLP, or
    Megatron's ``CheckpointWithoutOutput`` around the activation (what ``recompute_modules=["moe_act"]``
    and MindSpeed's activation-function recompute do), its output freed once ``linear_fc2`` saved it."""
    for layer in model.decoder.layers:
        mlp, forward = layer.mlp, layer.mlp.forward
        if kind == "torch":
            mlp.forward = functools.partial(torch.utils.checkpoint.checkpoint, forward, use_reentrant=False)
        else:
            mlp.forward = functools.partial(_activation_without_output, mlp)
    return model


def _activation_without_output(mlp, hidden, **_):
    intermediate, bias = mlp.linear_fc1(hidden)
    recompute = CheckpointWithoutOutput(fp8=None)  # fp8=False would mean "on" (`fp8 is not None`) in 0.16.1
    activation = recompute.checkpoint(lambda x, b: torch.nn.functional.gelu(x + b), intermediate, bias)
    output, output_bias = mlp.linear_fc2(activation)
    recompute.discard_output_and_register_recompute(output)
    return output, output_bias


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_torch_checkpoint_inside_a_layer_is_bitwise(mode):
    expected = megatron_testing.steps(_mlp_with(megatron_testing.tiny_gpt(), "torch"))
    model = _mlp_with(megatron_testing.tiny_gpt(), "torch")
    hyperac_megatron.apply(model, mode=mode, backend="cpu")
    _assert_steps_equal(expected, megatron_testing.steps(model))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_checkpoint_without_output_inside_a_layer_is_refused(mode):
    """Issue 27: backward failed with "The tensor has a non-zero number of elements, but its data is not
    allocated yet"; now the first forward refuses the layer, naming it and the fix."""
    model = _mlp_with(megatron_testing.tiny_gpt(), "without-output")
    megatron_testing.steps(model, count=1)  # un-applied, Megatron's own output-discarding recompute works
    hyperac_megatron.apply(model, mode=mode, backend="cpu")
    with pytest.raises(hyperac.UnsupportedModelError,
                       match=r"recomputed layer 'decoder.layers.0' frees, in its forward, the data of a tensor.*"
                             r"CheckpointWithoutOutput.*layers=\{0: 'off'\}"):
        megatron_testing.steps(model, count=1)


def test_plain_apply_without_the_tracker_is_refused_before_the_first_step():
    megatron_shims.seed_tracker(megatron_testing.SEED)
    model = megatron_testing.tiny_gpt()
    with pytest.raises(hyperac.UnsupportedModelError,
                       match=r"Megatron-Core's RNG tracker .* holds generator states.*"
                             r"hyperac.integrations.megatron.apply\(model, ...\) registers it"):
        hyperac.apply(model, mode="full", backend="cpu")
    hyperac.register_rng_tracker("megatron", tensor_parallel.get_cuda_rng_tracker)
    hyperac.apply(model, mode="full", backend="cpu")


@pytest.mark.parametrize("mode", ["full", "selective", "pointwise"])
def test_first_pipeline_stage_with_deallocated_output(mode):
    """A first stage frees its output's data once sent (``deallocate_output_tensor``) and runs backward
    through the C++ engine from the next stage's gradient."""
    expected = megatron_testing.steps(megatron_testing.tiny_gpt(post_process=False))
    model = megatron_testing.tiny_gpt(post_process=False)
    hyperac_megatron.apply(model, mode=mode, backend="cpu")
    _assert_steps_equal(expected, megatron_testing.steps(model))


@pytest.fixture(scope="module")
def tensor_parallel_results(tmp_path_factory):
    output = tmp_path_factory.mktemp("megatron_tp") / "results.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
               str(output)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=WORKER.parent)
    if done.returncode != 0 or not output.exists():
        pytest.fail(f"torchrun exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(output.read_text())


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp2", "tp2-sp"])
@pytest.mark.parametrize("mode", ["full", "selective", "pointwise", "megatron-full", "megatron-selective"])
def test_two_tensor_parallel_ranks_bitwise(tensor_parallel_results, sequence_parallel, mode):
    """Two gloo ranks, tensor parallel (and sequence parallel): each rank's gradients equal those of
    the un-applied model on the same ranks, bitwise, over two steps. The selective modes keep the
    outputs of Megatron's all-reduces and reduce-scatters (never run again: gloo runs as many
    all-reduces as without hyperac); full recompute runs them again in backward, as Megatron's own
    full recompute does; sequence parallel's all-gather (``c10d::_allgather_base_``) is kept too."""
    parallel = "sp" if sequence_parallel else "tp"
    result = tensor_parallel_results[f"{parallel}/{mode}"]
    assert "error" not in result, result.get("traceback", result.get("error"))
    assert result["bitwise"], f"rank gradients differ from the un-applied model's by {result['max_diff']}"
    if mode in ("selective", "pointwise"):
        assert result["all_reduces"] == tensor_parallel_results[f"{parallel}/off"]["all_reduces"]
