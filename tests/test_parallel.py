"""hyperac under tensor, sequence, expert and pipeline parallel, on CPU ranks with gloo.

One torchrun launch with two ranks runs the ``tp``, ``ep`` and ``pp`` cases of ``parallel_worker``;
the 2-D FSDP2 x TP cases need four ranks (slow on two cores) and run under ``tox -e dist``
(``-m dist``). Every case compares one training step with the un-applied model in one process (loss
and full gradients) and, bitwise, with the same parallel setup without hyperac; ``CommDebugMode``
counts the collectives of forward and backward.

Collective accounting (what the README states):

* selective, selective-even and pointwise keep every collective's output, so backward runs exactly
  the collectives it runs without hyperac;
* full recompute replays each layer's forward up to the last tensor backward needs (PyTorch's
  non-reentrant recompute stops there), so backward repeats the layer's forward collectives except
  the one that ends the layer: the all-reduce (tensor parallel) or reduce-scatter (sequence
  parallel) of ``down_proj``'s output, which no op of the layer consumes.
"""

from __future__ import annotations

import collections
import json
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from parallel_worker import CASES, MICRO_BATCHES, Case

import hyperac
from hyperac.backends.npu import NpuBackend

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

WORKER = pathlib.Path(__file__).with_name("parallel_worker.py")
TOLERANCE = 1e-5  # the single-process reference reduces in another order
LAYERS = 2
SELECTIVE = ("selective", "selective-even", "pointwise")
# The collective that ends a decoder layer (down_proj's output), by variant: never replayed by full.
LAYER_END = {"tp": "all_reduce", "sp": "reduce_scatter_tensor"}


def launch(tmp_path_factory, ranks: int, groups: list[str]) -> dict:
    output = tmp_path_factory.mktemp("parallel") / "results.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               str(WORKER), str(output), *groups]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=WORKER.parent)
    if done.returncode != 0 or not output.exists():
        pytest.fail(f"torchrun exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(output.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(tmp_path_factory, 2, ["tp", "ep", "pp"])


@pytest.fixture(scope="module")
def results_2d(tmp_path_factory):
    return launch(tmp_path_factory, 4, ["fsdp_tp"])


def succeeded(results: dict, case: Case) -> dict:
    assert case.key in results, f"the worker wrote no result for {case.key}"
    result = results[case.key]
    assert "error" not in result, f"{case.key} raised:\n{result.get('traceback', result['error'])}"
    assert result["max_diff"] <= TOLERANCE, f"{case.key}: loss or a gradient differs by {result['max_diff']}"
    if case.options is not None:
        assert result["bitwise"], f"{case.key}: not bitwise equal to {case.baseline}"
        modes = {mode for _, mode, _ in result["plan"]}
        assert modes == {case.options["mode"]} and len(result["plan"]) == LAYERS, result["plan"]
    return result


def replayed_by_full(baseline: dict, variant: str) -> collections.Counter:
    """Each layer's forward collectives, less the one that ends it."""
    replayed: collections.Counter = collections.Counter()
    layers = baseline["collectives"]["layer_forward"]
    assert sorted(layers) == [f"layers.{i}" for i in range(LAYERS)], layers
    for counts in layers.values():
        replayed.update({op: n for op, n in counts.items() if not op.startswith("_")})  # FSDP's own: not replayed
        replayed[LAYER_END[variant]] -= 1
    return replayed


def check_collectives(results: dict, case: Case) -> None:
    result, baseline = results[case.key]["collectives"], results[case.baseline]["collectives"]
    assert result["forward"] == baseline["forward"], "hyperac changed the forward's collectives"
    if case.mode in SELECTIVE:
        assert result["backward"] == baseline["backward"], "a selective replay repeated a collective"
    elif case.mode == "full":
        extra = collections.Counter(result["backward"])
        extra.subtract(baseline["backward"])
        assert +extra == +replayed_by_full(results[case.baseline], case.variant), dict(extra)


TP_CASES = [case for case in CASES if case.group == "tp"]
FSDP_TP_CASES = [case for case in CASES if case.group == "fsdp_tp"]
EP_CASES = [case for case in CASES if case.group == "ep"]
PP_CASES = [case for case in CASES if case.group == "pp"]


@pytest.mark.parametrize("case", TP_CASES, ids=lambda case: case.key)
def test_tensor_and_sequence_parallel(results, case):
    """DTensor TP (and TP + SP) Llama: gradients equal one process's in every mode, applied before or after
    parallelize_module; selective modes add no collective to backward, full exactly the ones it replays."""
    succeeded(results, case)
    check_collectives(results, case)


def test_full_recompute_replays_collectives(results):
    """The accounting is not vacuous: full recompute does repeat collectives in backward (the counter sees
    replays), and selective keeps the all-gathers sequence parallel runs before attention and MLP."""
    for variant in ("tp", "sp"):
        off, full = (results[f"tp/{variant}/{mode}"]["collectives"]["backward"] for mode in ("off", "full"))
        assert sum(full.values()) > sum(off.values()), (off, full)
    layer = results["tp/sp/off"]["collectives"]["layer_forward"]["layers.0"]
    assert layer == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, layer


@pytest.mark.dist
@pytest.mark.parametrize("case", FSDP_TP_CASES, ids=lambda case: case.key)
def test_fsdp2_with_tensor_parallel(results_2d, case):
    """(dp=2, tp=2) mesh: sequence-parallel plan on tp, fully_shard on dp; parity and the same accounting
    (FSDP2's all-gathers and reduce-scatters are unchanged by hyperac)."""
    succeeded(results_2d, case)
    check_collectives(results_2d, case)


@pytest.mark.parametrize("case", EP_CASES, ids=lambda case: case.key)
def test_expert_parallel(results, case):
    """Tokens dispatched to the experts' ranks with all_to_all_single: selective keeps the all-to-all outputs
    (backward runs only all-to-all's own backward), full repeats every all-to-all of each layer."""
    result = succeeded(results, case)
    backward = result["collectives"]["backward"]
    forward = results[case.baseline]["collectives"]["forward"]
    assert forward == {"all_to_all_single": 3 * LAYERS}  # counts, tokens out, tokens back
    baseline = results[case.baseline]["collectives"]["backward"]
    if case.mode in SELECTIVE:
        assert backward == baseline, "a selective replay repeated an all-to-all"
    elif case.mode == "full":
        # The combine's output feeds the routing-weight product, so every all-to-all is replayed.
        assert backward == {"all_to_all_single": baseline["all_to_all_single"] + 3 * LAYERS}


@pytest.mark.parametrize("case", PP_CASES, ids=lambda case: case.key)
def test_pipeline_parallel(results, case):
    """PipelineStage per rank (2 stages), GPipe and 1F1B, 4 micro-batches, hyperac applied to each stage's
    module: the unsplit model's gradients; swap on ``sim`` keeps each micro-batch's tensors apart (a
    mix-up gives wrong gradients there) and brings back all it moved out."""
    result = succeeded(results, case)
    if case.mode == "swap":
        for offloaded_tensors, offloaded, reloaded in result["stage_swap"]:
            assert offloaded_tensors > 0 and offloaded_tensors % MICRO_BATCHES == 0, result["stage_swap"]
            assert offloaded == reloaded, result["stage_swap"]


def test_backends_keep_every_functional_collective():
    """The collectives DTensor's redistributions and expert dispatch call are kept by every backend's
    selective policy (NPU adds its fused matmul+collective kernels on top, tested with its stand-in)."""
    functional = torch.ops._c10d_functional
    expected = {functional.all_gather_into_tensor.default, functional.all_gather_into_tensor_coalesced.default,
                functional.reduce_scatter_tensor.default, functional.reduce_scatter_tensor_coalesced.default,
                functional.all_reduce.default, functional.all_reduce_coalesced.default,
                functional.all_to_all_single.default, functional.broadcast.default,
                torch.ops._dtensor.shard_dim_alltoall.default}
    for backend in (hyperac.get_backend("cpu"), NpuBackend()):
        assert expected <= backend.communication_ops(), expected - backend.communication_ops()


EXAMPLES = WORKER.parents[1] / "examples"


def run_example(command: list[str]) -> str:
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout


@pytest.mark.dist
def test_accelerate_example():
    """examples/accelerate_fsdp2.py under torchrun, two CPU ranks: hyperac applied before prepare, the same
    losses as without hyperac. On the CPU accelerate runs its DDP path (MULTI_CPU): it enables the FSDP
    plugin only for accelerator devices."""
    output = run_example([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(EXAMPLES / "accelerate_fsdp2.py"), "--cpu", "--steps", "2", "--check"])
    assert "4 layers: 4 selective" in output and "step 1: loss" in output, output
    assert "max loss difference without hyperac: 0.0" in output, output
    assert "distributed: MULTI_CPU, 2 process(es)" in output, output  # really two ranks, as the README says


@pytest.mark.dist
def test_trl_sft_example():
    """examples/trl_sft.py: SFTTrainer with HyperACCallback (TRL turns HF's recompute on by default; the
    callback replaces it), the same losses as SFTTrainer without hyperac."""
    pytest.importorskip("trl")
    output = run_example([sys.executable, str(EXAMPLES / "trl_sft.py"), "--steps", "3", "--check"])
    assert "2 layers: 2 selective" in output and "step 2: loss" in output, output
    assert "max loss difference without hyperac: 0.0" in output, output


def test_torchtitan_llama3_debug_model():
    """examples/torchtitan_llama3.py: HyperACRecompute as torchtitan's ac_config inside its parallelize_llama
    (before fully_shard; blocks keep their class, nothing is wrapped) gives the losses of torchtitan's own
    SelectiveAC and of no AC, bitwise. Needs torchtitan (tox -e torchtitan: torch 2.14)."""
    pytest.importorskip("torchtitan")
    output = run_example([sys.executable, str(EXAMPLES / "torchtitan_llama3.py"), "--steps", "2", "--check"])
    assert "6 layers: 6 selective | FSDPLlama3TransformerBlock" in output, output
    assert "max loss difference: 0.0" in output, output
