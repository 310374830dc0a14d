"""One plan per job (design invariant 20, NOTE [One plan per job] in hyperac/planner/group.py):
``mode="auto"`` under ``torch.distributed`` is a collective, and every rank installs one plan.

Two real gloo ranks run every case of ``plan_group_worker.CASES`` in one torchrun launch; the
launch is bounded (the process group's timeout, and the subprocess's), so a rank left waiting
fails the test instead of hanging it. Seconds are injected per mode (as in test_planner_timing.py).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import hypothesis
import pytest
import torch
import torch.distributed as dist
from hypothesis import strategies as st

import hyperac

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo"
)

WORKER = pathlib.Path(__file__).with_name("plan_group_worker.py")


def launch(folder: pathlib.Path, *cases: str) -> dict:
    """Both ranks' outcomes of ``cases`` (none: the worker's default ones), by case."""
    output = folder / "results.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
               str(output), *cases]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=WORKER.parent)
    except subprocess.TimeoutExpired as expired:
        pytest.fail(f"the two ranks did not finish in 300 s (a rank waits on the other):\n{expired.stderr}")
    if done.returncode != 0 or not output.exists():
        pytest.fail(f"torchrun exited with {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}")
    return json.loads(output.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return launch(tmp_path_factory.mktemp("plan_group"))


def test_a_slower_rank_gets_the_plan_of_the_group(results):
    """Rank 1's selective replays are measured slower (3.0 against 1.4) and its first round misreads
    a mode: alone, rank 0 plans selective layers and rank 1 none, and they time a different number of
    steps. Together both install one plan, made on the slowest rank's costs, after as many timed
    steps each; the plan says whose it is, printed and written."""
    first, second = results["slowed"]
    assert "error" not in first and "error" not in second, (first, second)
    assert first["modes"] == second["modes"]
    assert "selective" not in first["modes"], first["plan"]  # rank 1's costs: its selective is the slowest
    assert first["timed_steps"] == second["timed_steps"]
    for rank in (first, second):
        assert rank["group_size"] == rank["written"] == 2
        assert "the plan of a group of 2 ranks" in rank["plan"]


def test_ranks_of_fsdp2_time_as_many_steps_as_each_other(results):
    """Under FSDP2 every profiling step all-gathers parameters: rank 1 wanting a second timed round,
    rank 0 times it too (else rank 1 waits in an all-gather rank 0 never joins), and both install one plan."""
    first, second = results["fsdp"]
    assert "error" not in first and "error" not in second, (first, second)
    assert first["modes"] == second["modes"]
    assert first["timed_steps"] == second["timed_steps"] == 4


@pytest.mark.dist
def test_compiled_layers_get_one_plan_after_as_many_rounds(tmp_path):
    """``compile="aot_eager"``: rank 1 wants a fifth timed round of its five modes; rank 0 times it too."""
    first, second = launch(tmp_path, "compiled")["compiled"]
    assert "error" not in first and "error" not in second, (first, second)
    assert first["modes"] == second["modes"] and first["group_size"] == second["group_size"] == 2
    assert first["timed_steps"] == second["timed_steps"] == 5 * 5


def test_a_rank_that_fails_inside_apply_makes_every_rank_raise(results):
    """Rank 1's profiled step raises; rank 0 raises too, naming it, and neither keeps anything applied."""
    first, second = results["failing"]
    assert second["error"] == "IndexError", second
    assert first["error"] == "RankFailedError", first
    assert first["message"].startswith("rank 1 of the 2 ranks planning mode='auto' together failed in a profiled "
                                       "step: IndexError: "), first["message"]
    assert not first["applied"] and not second["applied"]


def test_a_rank_that_fails_installing_makes_every_rank_undo_the_plan(results):
    """Rank 1 fails installing the agreed plan; rank 0, which installed it, removes it and raises."""
    first, second = results["failing_install"]
    assert second["error"] == "RuntimeError" and second["message"] == "no room for the first step's check", second
    assert first["error"] == "RankFailedError", first
    assert "failed installing the plan: RuntimeError: no room for the first step's check" in first["message"]
    for rank in (first, second):
        assert not rank["applied"] and rank["forwards"] == 0, rank


@pytest.mark.parametrize(("case", "what", "fix"), [
    ("budgets", "budget= must be the same on each, but rank {rank} has {mine} and rank {other} {theirs}",
     "give every rank the same budget="),
    ("shapes", "sample= shapes must be the same on each", "give every rank the same sample="),
])
def test_ranks_with_other_options_are_refused_on_every_rank(results, case, what, fix):
    values = {"budgets": ("'90% of the no-recompute peak'", "'80% of the no-recompute peak'")}
    for rank, result in enumerate(results[case]):
        assert result["error"] == "ConfigError", result
        assert "mode='auto' plans one plan for the 2 ranks of its group" in result["message"]
        if case in values:
            mine, theirs = values[case][rank], values[case][1 - rank]
            assert what.format(rank=rank, mine=mine, other=1 - rank, theirs=theirs) in result["message"], result
        else:
            assert what in result["message"], result
        assert fix in result["message"]


def test_pipeline_stages_plan_over_their_stage_group(results):
    for rank, result in enumerate(results["stages"]):
        refused, own = result["whole"], result["own"]
        assert refused["error"] == "ConfigError", refused
        assert "so the layers found must be the same on each" in refused["message"]
        assert "pass group= the ranks that hold the same layers (a pipeline stage's group)" in refused["message"]
        assert "error" not in own and len(own["modes"]) == 2 + rank and own["group_size"] is None, own


def test_every_rank_runs_the_bucket_of_the_longest_batch(results):
    """Rank 0 trains on 8 tokens (bucket 0 alone), rank 1 on 32 (bucket 1): both run bucket 1, and
    again with the plan file applied again (``plan=``)."""
    first, second = results["buckets"]
    assert "error" not in first and "error" not in second, (first, second)
    assert first["bucket"] == second["bucket"] == 1
    assert first["bucket_again"] == second["bucket_again"] == 1
    assert first["group_size_again"] == second["group_size_again"] == 2


def test_group_outside_auto_and_without_distributed_is_refused():
    with pytest.raises(hyperac.ConfigError, match=r"Config.group=.* only applies to mode='auto' or plan="):
        hyperac.Config(mode="full", group=object())
    with pytest.raises(hyperac.ConfigError, match="Config.group must be None or a torch.distributed ProcessGroup"):
        hyperac.Config(mode="auto", budget=0.5, sample={"input_ids": torch.ones(1, 4, dtype=torch.long)},
                       group="world")


MODES = ("off", "pointwise", "selective", "selective-even", "full")


@st.composite
def rank_estimates(draw):
    """Two to three ranks' cost models of the same three layers, every figure drawn per rank."""
    from hyperac.planner import Estimate, LayerEstimate

    def per_mode(high):
        return {mode: draw(st.integers(0, high)) for mode in MODES}

    ranks = draw(st.integers(2, 3))
    return [Estimate(tuple(
        LayerEstimate(index=i, fqn=f"layers.{i}", kept_bytes=per_mode(1000), recompute_flops=per_mode(1000),
                      forward_peak_bytes=per_mode(1000), backward_peak_bytes=per_mode(1000),
                      seconds={mode: float(s) for mode, s in per_mode(100).items()},
                      noise_seconds=float(draw(st.integers(0, 10))))
        for i in range(3)), outside_bytes=draw(st.integers(0, 1000)), base_flops=draw(st.integers(0, 1000)),
        outside_peak_bytes=tuple(draw(st.integers(0, 1000)) for _ in range(4)),
        outside_seconds=float(draw(st.integers(0, 10)))) for _ in range(ranks)]


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(rank_estimates(), st.lists(st.sampled_from(MODES), min_size=3, max_size=3))
def test_the_slowest_ranks_costs_bound_every_ranks(estimates, plan):
    """Whatever each rank measured, a plan's predicted peak, kept bytes, seconds and replayed FLOPs on
    the job's cost model are at least each rank's: a plan within the budget there fits every rank."""
    from hyperac.planner.group import slowest

    job = slowest(estimates, len(estimates))
    for measure in ("peak_bytes", "total_bytes", "step_seconds", "total_recompute_flops"):
        assert all(getattr(job, measure)(plan) >= getattr(e, measure)(plan) for e in estimates), measure
    assert all(layer.noise_seconds == max(e.layers[p].noise_seconds for e in estimates)
               for p, layer in enumerate(job.layers))


def test_the_job_swaps_over_the_slowest_ranks_link():
    from hyperac.planner import Estimate, LayerEstimate
    from hyperac.planner.group import slowest

    layer = LayerEstimate(index=0, fqn="layers.0", kept_bytes={"off": 1}, recompute_flops={"off": 0},
                          forward_peak_bytes={"off": 1}, backward_peak_bytes={"off": 1}, seconds={"off": 1.0})
    ranks = [Estimate((layer,), outside_bytes=0, base_flops=0, outside_peak_bytes=(0, 0, 0, 0),
                      link_bandwidth=bandwidth) for bandwidth in (32e9, 8e9)]
    assert slowest(ranks, 2).link_bandwidth == 8e9


def test_a_rank_on_another_planning_path_is_refused_not_a_key_error():
    """A rank that plans the LM head (or compiles) sends an option the others do not: on the default group of
    a pipeline, only the last stage holds the head. Every rank raises ConfigError naming it (a KeyError before)."""
    import dataclasses

    from hyperac.planner.group import PlanGroup, agree_on_options

    @dataclasses.dataclass(frozen=True)
    class WithoutTheHead(PlanGroup):  # rank 1 took the path without the head
        def gather(self, compute, what):
            mine = compute()
            return [mine, {name: value for name, value in mine.items() if name != "head="}]

    with pytest.raises(hyperac.ConfigError, match=r"head= must be the same on each, but rank 0 has 'fallback' and "
                                                  r"rank 1 'not given'"):
        agree_on_options(WithoutTheHead(size=2), 0.5, {"x": torch.ones(2)}, ["layers.0"], {"head=": "fallback"})


def test_layers_are_alike_where_they_are_alike_on_every_rank():
    from hyperac.planner.profile import _common_groups

    rank0 = [(0, 1, 2, 3)] * 4
    rank1 = [(0, 1), (0, 1), (2, 3), (2, 3)]  # an MoE layer routed otherwise on rank 1
    assert _common_groups([rank0, rank1]) == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert _common_groups([rank0]) == rank0


def test_a_group_plan_applied_again_without_buckets_is_still_the_groups():
    """``plan=`` with a group's plan file (no length buckets): ``print(plan)`` and the file written again
    still say the plan is the group's (the record of who made it; applying it runs no collective)."""
    from hyperac_testing import tiny_llama

    model = tiny_llama(num_layers=2)
    written = hyperac.apply(model, mode="full", backend="cpu").to_dict()
    hyperac.remove(model)
    again = hyperac.apply(model, plan={**written, "group_size": 2}, backend="cpu")
    assert again.group_size == 2 and again.to_dict()["group_size"] == 2
    assert "the plan of a group of 2 ranks" in str(again)


def test_a_plan_made_alone_stays_alone_when_loaded_in_a_distributed_job(tmp_path):
    """A length-bucketed model planned by one process, pickled and loaded where torch.distributed is
    initialised: its bucket switch runs no collective there (a pipeline stage loading it would wait on ranks
    that never switch); a group's plan agrees over the loading process's default group."""
    import pickle

    from hyperac.planner.group import ALONE, PlanGroup

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert pickle.loads(pickle.dumps(ALONE)).group is None
        assert pickle.loads(pickle.dumps(PlanGroup(object(), 2, 1))).group is dist.group.WORLD
    finally:
        dist.destroy_process_group()
