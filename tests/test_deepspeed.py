"""hyperac under DeepSpeed ZeRO-2 and ZeRO-3: two CPU ranks over gloo (``DS_ACCELERATOR=cpu``), ``tox -e deepspeed``.

One torchrun launch runs every case of ``deepspeed_worker.CASES`` (a few minutes on 2 cores); each test
below checks one case's result. Every mode, ``auto`` included, applied before ``deepspeed.initialize``
or to the engine's module after it (and under ``zero.Init``), full fine-tuning and LoRA, gives the
losses and gradients of the same DeepSpeed run without hyperac, bitwise; HF's ``Trainer(deepspeed=...)``
with ``HyperACCallback`` trains to the same losses and weights as without it. ZeRO-3's module hooks
gather and release parameters inside each layer, with ops that differ between a layer's forward and its
replay; they are not part of the layer's program (NOTE [Parameter lifecycles are not the layer's
program] in hyperac/lifecycle.py). Skipped where DeepSpeed is not installed (the default ``cpu`` env).
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch.distributed as dist

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed: tox -e deepspeed runs these")
pytest.importorskip("peft", reason="the LoRA cases need peft: tox -e deepspeed runs these")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

from deepspeed_worker import CASES, Case  # noqa: E402

WORKER = pathlib.Path(__file__).with_name("deepspeed_worker.py")
TOLERANCE = 1e-5  # the reference without DeepSpeed averages the ranks' gradients in another order


def launch(tmp_path_factory, groups: list[str]) -> dict:
    output = tmp_path_factory.mktemp("deepspeed") / "results.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
               str(output), *groups]
    environment = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800, cwd=WORKER.parent, env=environment)
    if done.returncode != 0 or not output.exists():
        pytest.fail(f"torchrun exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(output.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(tmp_path_factory, ["engine", "trainer"])


@pytest.fixture(scope="module")
def planned_results(tmp_path_factory):
    return launch(tmp_path_factory, ["planned"])


def succeeded(results: dict, case: Case) -> dict:
    assert case.key in results, f"the worker wrote no result for {case.key}"
    result = results[case.key]
    assert "error" not in result, f"{case.key} raised:\n{result.get('traceback', result['error'])}"
    if case.key != case.baseline:
        assert result["bitwise"], f"{case.key}: not bitwise equal to {case.baseline}"
    return result


ENGINE_CASES = [case for case in CASES if case.launch == "engine"]
TRAINER_CASES = [case for case in CASES if case.launch == "trainer"]
PLANNED_CASES = [case for case in CASES if case.launch == "planned"]


@pytest.mark.parametrize("case", ENGINE_CASES, ids=lambda case: case.key)
def test_engine(results, case):
    """Two steps through ``deepspeed.initialize``: losses and full gradients equal the run without hyperac,
    bitwise, and the run without DeepSpeed within float32 reordering; the plan is the mode asked for."""
    result = succeeded(results, case)
    assert result["max_diff"] <= TOLERANCE, f"{case.key}: loss or a gradient differs by {result['max_diff']}"
    if case.variant not in ("off", "auto"):
        assert {mode for _, mode in result["plan"]} == {case.options["mode"]}, result["plan"]


@pytest.mark.parametrize("case", TRAINER_CASES, ids=lambda case: case.key)
def test_trainer(results, case):
    """``Trainer(deepspeed=...)`` with ``HyperACCallback``: two optimizer steps give the losses and the weights
    of the Trainer without the callback, bitwise; the callback removes hyperac when training ends."""
    result = succeeded(results, case)
    assert len(result["losses"]) == 2
    assert not result["applied_after_train"]


@pytest.mark.parametrize("case", PLANNED_CASES, ids=lambda case: case.key)
def test_auto_on_a_zero3_engine(planned_results, case):
    """``auto`` applied to a ZeRO-3 engine's module (directly, and by the Trainer's callback): its profiled
    steps gather parameters with collectives, so the ranks must profile alike and install one plan (issue
    34's one plan per job); then the steps are bitwise those without hyperac."""
    result = succeeded(planned_results, case)
    if case.group == "trainer":
        assert not result["applied_after_train"]
    else:
        assert result["max_diff"] <= TOLERANCE, f"{case.key}: loss or a gradient differs by {result['max_diff']}"
