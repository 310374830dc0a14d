"""Two ranks planning ``mode="auto"`` together, for tests/test_plan_group.py (NOTE [One plan per job]
in hyperac/planner/group.py). Run under torchrun (two ranks, gloo)::

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/plan_group_worker.py OUT.json [CASE...]

(``python tests/plan_group_worker.py --list`` prints the cases.)
Each case runs on both ranks; rank 0 writes, per case, the list of both ranks' outcomes (what
``apply`` returned or raised, and what the case measured). Seconds are injected, as in
tests/test_planner_timing.py: each timed step runs for real, and its per-layer readings are
replaced by fixed figures per mode, so that "rank 1 is slower" holds however busy the host is.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from hyperac_testing import tiny_llama
from worker_driver import main

import hyperac
from hyperac.planner import profile
from hyperac.state import STATE_KEY

SEQ, LAYERS = 16, 4
SECONDS = {"off": 1.0, "pointwise": 1.2, "selective": 1.4, "selective-even": 1.6, "full": 1.8}
"""Each mode's injected seconds per layer, in hundredths, on every rank..."""
SLOWED = {**SECONDS, "selective": 3.0}
"""...but on rank 1 of the ``slowed`` case, whose selective replays run slower."""


@dataclasses.dataclass(frozen=True)
class Case:
    key: str


DEFAULT = ("slowed", "fsdp", "failing", "failing_install", "budgets", "shapes", "stages", "buckets")
"""The cases run when none is named; ``compiled`` (compiles five modes on each rank) is run by name, under
``tox -e dist``."""
CASES = [Case(key) for key in (*DEFAULT, "compiled")]


def batch(length: int = SEQ, vocab: int = 128) -> dict[str, torch.Tensor]:
    """This rank's batch: other tokens on each rank, the same shape."""
    ids = torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(dist.get_rank()))
    return {"input_ids": ids, "labels": ids}


class InjectedSeconds:
    """Replaces ``profile._timed_step``: runs the step, then reads ``seconds[mode]`` for each layer (in
    hundredths) from the modes the profiling runner installed; counts the timed steps. ``faster_once``:
    the first step reads ``pointwise`` faster than ``off``, which makes that rank want more rounds
    (NOTE [When the rounds stop])."""

    def __init__(self, seconds: dict[str, float], faster_once: bool = False) -> None:
        self.seconds, self.faster_once, self.steps = seconds, faster_once, 0
        self.real = profile._timed_step

    def __call__(self, model, sample, layer_modules, clock) -> dict[int | None, float]:
        self.real(model, sample, layer_modules, clock)
        self.steps += 1
        seconds = dict(self.seconds, pointwise=0.5) if self.faster_once and self.steps == 1 else self.seconds
        modes = [layer.mode for layer in hyperac.applied_plan(model).layers]
        return {**{position: seconds[mode] / 100 for position, mode in enumerate(modes)}, None: 0.001}


def outcome(run: Callable[[], hyperac.Plan]) -> dict[str, Any]:
    try:
        plan = run()
    except Exception as error:  # the test reads each rank's error
        return {"error": type(error).__name__, "message": str(error)}
    return {"modes": [layer.mode for layer in plan.layers], "plan": str(plan), "group_size": plan.group_size,
            "written": plan.to_dict().get("group_size")}


def selective_budget(model: torch.nn.Module) -> int:
    """A budget that all-``selective`` fits and all-``pointwise`` does not: layers must recompute."""
    estimate = hyperac.estimate(model, batch(), backend="cpu")
    return estimate.peak_bytes(["selective"] * LAYERS)


def slowed() -> dict[str, Any]:
    """Rank 1's selective replays take 3.0 where rank 0's take 1.4, and rank 1 reads one mode faster
    than ``off`` in its first round: alone, each rank would plan (and time) differently."""
    rank = dist.get_rank()
    timer = InjectedSeconds(SLOWED if rank == 1 else SECONDS, faster_once=rank == 1)
    profile._timed_step = timer
    try:
        model = tiny_llama(num_layers=LAYERS)
        budget = selective_budget(model)
        timer.steps = 0
        result = outcome(lambda: hyperac.apply(model, mode="auto", budget=budget, sample=batch(), backend="cpu"))
    finally:
        profile._timed_step = timer.real
    return {**result, "timed_steps": timer.steps}


def fsdp() -> dict[str, Any]:
    """FSDP2 (``fully_shard`` on each layer, then on the model) before apply: every profiled and timed
    step all-gathers each layer's parameters, and rank 1 wants a second round of timed steps."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = tiny_llama(num_layers=LAYERS)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    timer = InjectedSeconds(SECONDS, faster_once=dist.get_rank() == 1)
    profile._timed_step = timer
    try:
        result = outcome(lambda: hyperac.apply(model, mode="auto", budget=0.9, sample=batch(), backend="cpu"))
    finally:
        profile._timed_step = timer.real
    if "error" not in result:
        ids = batch()["input_ids"]
        model(input_ids=ids, labels=ids).loss.backward()
    return {**result, "timed_steps": timer.steps}


def compiled() -> dict[str, Any]:
    """``compile="aot_eager"``: rank 1 wants one timed round more than the fewest (rank 0 stops there)."""
    from hyperac.planner import compiled as planner

    rank = dist.get_rank()
    real_rounds, real_step = planner.more_rounds, planner._timed_step
    steps = []

    def more_rounds(done: int, least: int, timing: float) -> bool:
        return done <= least + (rank == 1)

    def timed_step(*args: Any) -> float:
        steps.append(real_step(*args))
        return steps[-1]

    planner.more_rounds, planner._timed_step = more_rounds, timed_step
    try:
        result = outcome(lambda: hyperac.apply(tiny_llama(num_layers=2), mode="auto", budget=0.9, sample=batch(),
                                               backend="cpu", compile="aot_eager"))
    finally:
        planner.more_rounds, planner._timed_step = real_rounds, real_step
    return {**result, "timed_steps": len(steps)}


def failing() -> dict[str, Any]:
    """Rank 1's sample holds a token past the vocabulary: its first profiled step raises."""
    model = tiny_llama(num_layers=2)
    sample = batch()
    if dist.get_rank() == 1:
        sample["input_ids"] = sample["input_ids"].clone()
        sample["input_ids"][0, 0] = 1000
    result = outcome(lambda: hyperac.apply(model, mode="auto", budget=0.9, sample=sample, backend="cpu"))
    ids = batch()["input_ids"]
    model(input_ids=ids, labels=ids).loss.backward()  # the model still trains, as it was
    return {**result, "applied": hyperac.applied_plan(model) is not None}


def failing_install() -> dict[str, Any]:
    """Rank 1 fails as it installs the agreed plan (its first-step check raises), after rank 0 installed it."""
    import hyperac.api

    model = tiny_llama(num_layers=2)
    real = hyperac.api.install_first_step_check

    def failing(*args: Any) -> None:
        raise RuntimeError("no room for the first step's check")

    if dist.get_rank() == 1:
        hyperac.api.install_first_step_check = failing
    try:
        result = outcome(lambda: hyperac.apply(model, mode="auto", budget=0.9, sample=batch(), backend="cpu"))
    finally:
        hyperac.api.install_first_step_check = real
    return {**result, "applied": hyperac.applied_plan(model) is not None,
            "forwards": sum("forward" in module.__dict__ for module in model.modules())}


def budgets() -> dict[str, Any]:
    budget = "90%" if dist.get_rank() == 0 else 0.8
    return outcome(lambda: hyperac.apply(tiny_llama(num_layers=2), mode="auto", budget=budget, sample=batch(),
                                         backend="cpu"))


def shapes() -> dict[str, Any]:
    sample = batch(SEQ if dist.get_rank() == 0 else SEQ // 2)
    return outcome(lambda: hyperac.apply(tiny_llama(num_layers=2), mode="auto", budget=0.9, sample=sample,
                                         backend="cpu"))


def stages() -> dict[str, Any]:
    """Two pipeline stages, one per rank, whose layers (2 and 3 of them) share names: over the default
    group they are refused; each over its stage's group plans alone."""
    stage_groups = [dist.new_group([0]), dist.new_group([1])]  # every rank makes every group
    rank = dist.get_rank()
    model = tiny_llama(num_layers=2 + rank)
    whole = outcome(lambda: hyperac.apply(model, mode="auto", budget=0.9, sample=batch(), backend="cpu"))
    own = outcome(lambda: hyperac.apply(model, mode="auto", budget=0.9, sample=batch(), backend="cpu",
                                        group=stage_groups[rank]))
    return {"whole": whole, "own": own}


def buckets() -> dict[str, Any]:
    """Planned for up to 32 tokens in two buckets; rank 0 trains on 8 tokens, rank 1 on 32."""
    model = tiny_llama(num_layers=2)
    result = outcome(lambda: hyperac.apply(model, mode="auto", budget=0.9, sample=batch(), max_seq_len=2 * SEQ,
                                           length_buckets=2, backend="cpu"))
    if "error" in result:
        return result
    ids = batch(SEQ // 2 if dist.get_rank() == 0 else 2 * SEQ)["input_ids"]
    model(input_ids=ids, labels=ids).loss.backward()
    bucket = model.__dict__[STATE_KEY].bucket
    written = json.loads(json.dumps(hyperac.applied_plan(model).to_dict()))  # the plan file, applied again
    hyperac.remove(model)
    again = hyperac.apply(model, plan=written, backend="cpu")
    model(input_ids=ids, labels=ids).loss.backward()
    return {**result, "bucket": bucket, "bucket_again": model.__dict__[STATE_KEY].bucket,
            "group_size_again": again.group_size}


def run_groups(groups: list[str]) -> dict[str, Any]:
    if dist.get_world_size() != 2:
        raise SystemExit("run with --nproc_per_node=2")
    results = {}
    for key in groups or DEFAULT:
        mine = globals()[key]()
        both: list[Any] = [None, None]
        dist.all_gather_object(both, mine)
        results[key] = both
    return results


if __name__ == "__main__":
    main(CASES, run_groups)
