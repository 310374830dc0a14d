"""What the torchrun workers (``distributed_worker.py``, ``parallel_worker.py``) share: comparing a
step with its reference, recording each case's outcome, and the launch-and-write driver.

A case that raises records ``error`` and the others still run (every rank runs the same code on the
same model, so the ranks fail alike); rank 0 writes one JSON object with a result per case.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

Step = tuple[torch.Tensor, dict[str, torch.Tensor]]
"""One training step's outcome: the loss and the full gradient of every parameter, by name."""


def compare(result: Step, expected: Step) -> tuple[float, bool]:
    """(largest absolute difference, bitwise equal) of loss and gradients."""
    (loss, grads), (expected_loss, expected_grads) = result, expected
    if grads.keys() != expected_grads.keys():
        different = sorted(set(expected_grads) ^ set(grads))
        raise AssertionError(f"a different set of parameters got gradients: {different[:4]}")
    diffs = [(loss - expected_loss).abs().max().item()]
    equal = torch.equal(loss, expected_loss)
    for name, grad in expected_grads.items():
        diffs.append((grads[name] - grad).abs().max().item())
        equal = equal and torch.equal(grads[name], grad)
    return max(diffs), equal


def record(results: dict[str, Any], steps: dict[str, Step], case: Any,
           run: Callable[[], tuple[Step, dict[str, Any], Step]]) -> None:
    """Run one case (``run() -> (step, info, reference)``) and record its result under ``case.key``:
    ``max_diff`` against the reference, ``bitwise`` against ``case.baseline``'s step, or ``error``."""
    try:
        step, info, reference = run()
    except Exception as error:  # recorded; the test reports it
        dist.barrier()
        results[case.key] = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()[-4000:]}
        return
    steps[case.key] = step
    info["max_diff"], _ = compare(step, reference)
    if case.baseline in steps and case.key != case.baseline:
        info["bitwise"] = compare(step, steps[case.baseline])[1]
    info["loss"] = step[0].tolist()  # a float, or one per step
    results[case.key] = info


def main(cases: Sequence[Any], run_groups: Callable[[list[str]], dict[str, Any]]) -> None:
    """``worker.py --list`` prints the case keys; ``worker.py OUT.json GROUP...`` runs
    ``run_groups(groups)`` under gloo and writes its results to OUT.json from rank 0."""
    if sys.argv[1:] == ["--list"]:
        print("\n".join(case.key for case in cases))
        return
    output, groups = sys.argv[1], sys.argv[2:]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    try:
        results = run_groups(groups)
        if dist.get_rank() == 0:
            with open(output + ".tmp", "w") as handle:
                json.dump(results, handle, indent=1, sort_keys=True)
            os.replace(output + ".tmp", output)
        dist.barrier()  # no rank tears gloo down while another still uses it (a rank aborted at exit under load)
    finally:
        dist.destroy_process_group()
    # A rank that got here skips the interpreter's teardown: gloo's threads may still hold work objects
    # whose tensors Python frees while the interpreter is torn down, which aborts the process ("terminate
    # called without an active exception", pytorch/pytorch#179291; seen once under load in test_distributed).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
