"""Two gloo ranks of Megatron-Core tensor parallel (and sequence parallel) for tests/test_megatron.py::
test_two_tensor_parallel_ranks_bitwise. Run under torchrun; rank 0 writes one JSON object, a result per
``{tp|sp}/{mode}`` key::

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/megatron_worker.py OUT.json

Each case trains the tiny GPT of megatron_testing for two steps with hyperac (or Megatron's own
recompute) and compares each rank's gradients with the un-applied model's on the same ranks
(``bitwise``, both ranks agreeing); a case that raises records ``error``. The ranks use the
megatron_shims stand-ins for the rest of the process, ``torch.cuda.current_device`` included.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

import megatron_shims
import megatron_testing
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from worker_driver import compare

import hyperac
from hyperac.integrations import megatron as hyperac_megatron

MEGATRON = {
    "megatron-full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "megatron-selective": dict(recompute_granularity="selective"),
}


def run_case(mode: str, sequence_parallel: bool, reference: list) -> dict:
    rank = parallel_state.get_tensor_model_parallel_rank()
    model = megatron_testing.tiny_gpt(tp=2, sequence_parallel=sequence_parallel, **MEGATRON.get(mode, {}))
    if mode not in MEGATRON:
        hyperac_megatron.apply(model, mode=mode, backend="cpu")
    got, all_reduces = counted(model, rank)
    diffs, equal = zip(*(compare(one, other) for one, other in zip(got, reference)))
    both = torch.tensor([float(all(equal)), max(diffs)])
    dist.all_reduce(both[:1], op=dist.ReduceOp.MIN)
    dist.all_reduce(both[1:], op=dist.ReduceOp.MAX)
    return {"bitwise": bool(both[0].item()), "max_diff": both[1].item(), "all_reduces": all_reduces}


def counted(model: torch.nn.Module, rank: int) -> tuple[list, int]:
    """The two steps, and how many all-reduces gloo ran in them (a profiler event per run)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        got = megatron_testing.steps(model, tp_rank=rank)
    return got, sum(event.name == "gloo:all_reduce" for event in profile.events())


def main() -> None:
    output = sys.argv[1]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    megatron_shims.install()
    parallel_state.initialize_model_parallel(2)
    results = {}
    try:
        for sequence_parallel in (False, True):
            rank = parallel_state.get_tensor_model_parallel_rank()
            reference, all_reduces = counted(megatron_testing.tiny_gpt(tp=2, sequence_parallel=sequence_parallel),
                                             rank)
            results[f"{'sp' if sequence_parallel else 'tp'}/off"] = {"all_reduces": all_reduces}
            for mode in ("full", "selective", "pointwise", *MEGATRON):
                key = f"{'sp' if sequence_parallel else 'tp'}/{mode}"
                try:
                    results[key] = run_case(mode, sequence_parallel, reference)
                except Exception as error:  # recorded; the test reports it
                    results[key] = {"error": f"{type(error).__name__}: {error}",
                                    "traceback": traceback.format_exc()[-4000:]}
        if dist.get_rank() == 0:
            with open(output + ".tmp", "w") as handle:
                json.dump(results, handle, indent=1, sort_keys=True)
            os.replace(output + ".tmp", output)
    finally:
        hyperac.unregister_rng_tracker(hyperac_megatron.TRACKER_NAME)
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
