"""hyperac ``mode="auto"`` + ``compile=True`` against torch's own compiled budget, at equal saved bytes.

Per geometry (``planner_targets.GEOMETRIES``: the demo model, and hidden 512 / seq 1024), one
seeded Llama is deep-copied per configuration and every decoder layer compiled torchtitan-style
(``layer.compile()``), all in one process:

* ``off`` and ``off-control``: no recompute, twice: their ratio is the noise floor of the run;
* ``torch B``: torch's ``activation_memory_budget = B`` (the min-cut partitioner's knapsack, one
  budget per layer graph) for B in {0.5, 0.75};
* ``hyperac B``: ``hyperac.apply(mode="auto", compile=<the backend>, budget=<torch B's saved
  bytes>)``: the planner times the modes compiled with the backend the layers then run under, and
  gets exactly the bytes torch's budget saved, so both are held to the same number;
* ``torchtitan B`` (where torchtitan imports): torchtitan's ``MemoryBudgetAC`` at ``memory_budget=B``,
  its own ``apply`` run while the configuration's backend compiles (it sets torch's global
  ``activation_memory_budget`` and turns dynamo's LRU cache off, process-wide; both are restored
  after). It is torch's budget through torchtitan's code path; the notes show hyperac against it.

Saved bytes: what a step saves for backward (``saved_tensors_hooks``, distinct storages,
parameters excluded), read after a first step (which compiles). Step time: interleaved rounds, one
step per configuration per round in shuffled order; reported as the median of per-round ratios.
PASS when hyperac B's step is <= 1.00x torch B's and its saved bytes <= torch B's (+1%), and when
the plan's predicted saved bytes are within 5% of the compiled step's.

Every configuration compiles through its own backend object (dynamo keys its cache by backend,
and ``activation_memory_budget`` is not part of dynamo's guards), so no configuration reuses
another's graphs; the recompile limit is raised for the many configurations of one process.
torchtitan needs torch 2.14 (``tox -e models`` builds such an env): the script says whether it
could import it and leaves it out otherwise.

``--frontier`` times instead every mode on every layer (the knapsack modes too: ``knapsack-B`` on
every layer is torch's budget B through a region budget) beside torch's budgets, and prints each
one's saved bytes and step against torch's budget 0.75, with no PASS/FAIL.

    OMP_NUM_THREADS=1 python benchmarks/compiled_peers.py [--backend inductor] [--only demo|large] [--rounds N]
                                                          [--frontier]
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from planner_targets import GEOMETRIES, build, step  # noqa: E402

import hyperac  # noqa: E402
from hyperac.plan import mode_letters  # noqa: E402

BUDGETS = (0.5, 0.75)
FRONTIER = ("off", "pointwise", "selective", "selective-even", "full", "knapsack-0.25", "knapsack-0.5",
            "knapsack-0.75")
"""The modes ``--frontier`` times on every layer."""
ROUNDS = {"demo": 31, "large": 24}
"""Timed rounds per geometry: a large step's per-round ratios spread by +-5% on a shared CPU."""


def median_interval(ratios: list[float], draws: int = 2000) -> str:
    """A 90% bootstrap interval of the median of per-round ratios, as ``low-high`` (seeded: the same
    rounds give the same interval)."""
    rng = random.Random(0)
    medians = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    low = int(0.05 * draws)
    return f"{medians[low]:.3f}-{medians[draws - 1 - low]:.3f}"


def inputs(geometry: dict[str, int]) -> tuple[nn.Module, torch.Tensor]:
    """The geometry's seeded Llama and its token batch."""
    ids = torch.randint(0, 512, (geometry["batch"], geometry["seq"]), generator=torch.Generator().manual_seed(1))
    return build(geometry), ids


class Backend:
    """A compile backend of its own (its own dynamo cache entries) with torch's budget set while it compiles."""

    def __init__(self, name: str, budget: float = 1.0) -> None:
        self.name, self.budget = name, budget

    def __call__(self, graph: torch.fx.GraphModule, inputs: Any) -> Callable:
        with torch._functorch.config.patch(activation_memory_budget=self.budget):
            return torch._dynamo.lookup_backend(self.name)(graph, inputs)


class TitanBackend(Backend):
    """A :class:`Backend` that runs torchtitan's ``MemoryBudgetAC.apply`` while it compiles."""

    def __call__(self, graph: torch.fx.GraphModule, inputs: Any) -> Callable:
        from torchtitan.distributed.activation_checkpoint import MemoryBudgetAC

        config = torch._functorch.config
        before = config.activation_memory_budget
        try:
            MemoryBudgetAC(MemoryBudgetAC.Config(memory_budget=self.budget)).apply(graph)
            return torch._dynamo.lookup_backend(self.name)(graph, inputs)
        finally:
            config.activation_memory_budget = before
            torch._C._dynamo.eval_frame._set_lru_cache(True)  # dynamo's default, which MemoryBudgetAC turns off


def saved_bytes(model: nn.Module, ids: torch.Tensor) -> int:
    """Bytes of the distinct storages one step saves for backward, parameters excluded."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(storages.values())


def compiled(base: nn.Module, backend: Backend, ids: torch.Tensor, **options: Any) -> tuple[nn.Module, Any]:
    """A copy of ``base`` (hyperac applied with ``options`` if any), each layer compiled, warmed up."""
    model = copy.deepcopy(base)
    plan = hyperac.apply(model, compile=backend.name, backend="cpu", **options) if options else None
    for layer in model.model.layers:
        layer.compile(backend=backend)
    step(model, ids)
    return model, plan


def interleaved(models: dict[str, nn.Module], ids: torch.Tensor, rounds: int) -> dict[str, list[float]]:
    """Seconds of one step per model per round, the models in a fresh shuffled order each round."""
    times: dict[str, list[float]] = {label: [] for label in models}
    order = list(models)
    for _ in range(rounds):
        random.shuffle(order)
        for label in order:
            times[label].append(step(models[label], ids))
    return times


def frontier(name: str, geometry: dict[str, int], backend_name: str, rounds: int) -> list[str]:
    """``--frontier``: every mode on every layer (the knapsack modes too) beside torch's budgets and a
    control (``off`` without hyperac), each configuration's saved bytes and step against torch's
    budget at the last of ``BUDGETS``."""
    base, ids = inputs(geometry)
    models = {f"torch {budget}": compiled(base, Backend(backend_name, budget), ids)[0] for budget in BUDGETS}
    models["off-control"], _ = compiled(base, Backend(backend_name), ids)
    for mode in FRONTIER:
        models[mode], _ = compiled(base, Backend(backend_name), ids, mode=mode)
    saved = {label: saved_bytes(model, ids) for label, model in models.items()}
    times = interleaved(models, ids, rounds)
    peer = f"torch {BUDGETS[-1]}"
    lines = [f"## {name}: uniform plans, {backend_name}, per-layer compile, {rounds} rounds", "",
             f"| configuration | saved (x {peer}) | step (x {peer}, 90% interval) |", "|---|---|---|"]
    for label in models:
        per_round = [a / b for a, b in zip(times[label], times[peer])]
        lines.append(f"| {label} | {saved[label] / saved[peer]:.3f} | {statistics.median(per_round):.3f}x "
                     f"({median_interval(per_round)}) |")
    return lines


def run_geometry(name: str, geometry: dict[str, int], backend_name: str, rounds: int,
                 titan: bool) -> tuple[list[str], bool]:
    base, ids = inputs(geometry)
    sample = {"input_ids": ids, "labels": ids}
    models: dict[str, nn.Module] = {}
    plans: dict[str, Any] = {}
    saved: dict[str, int] = {}
    for label in ("off", "off-control"):
        models[label], _ = compiled(base, Backend(backend_name), ids)
    for budget in BUDGETS:
        models[f"torch {budget}"], _ = compiled(base, Backend(backend_name, budget), ids)
        if titan:
            models[f"torchtitan {budget}"], _ = compiled(base, TitanBackend(backend_name, budget), ids)
    for label, model in models.items():
        saved[label] = saved_bytes(model, ids)
    planning: dict[str, float] = {}
    for budget in BUDGETS:
        label = f"hyperac {budget}"
        start = time.perf_counter()
        models[label], plans[label] = compiled(base, Backend(backend_name), ids, mode="auto", sample=sample,
                                               budget=saved[f"torch {budget}"])
        planning[label] = time.perf_counter() - start
        saved[label] = saved_bytes(models[label], ids)
    times = interleaved(models, ids, rounds)

    def ratios(label: str, peer: str) -> list[float]:
        return [a / b for a, b in zip(times[label], times[peer])]

    def ratio(label: str, peer: str) -> float:
        return statistics.median(ratios(label, peer))

    off = saved["off"]
    lines = [f"## {name}: hidden {geometry['hidden']}, {geometry['layers']} layers, seq {geometry['seq']}, "
             f"batch {geometry['batch']}; {backend_name}, per-layer compile, {rounds} rounds", "",
             f"off-control / off step: {ratio('off-control', 'off'):.3f}x "
             f"({median_interval(ratios('off-control', 'off'))}, the noise floor); "
             "apply(mode='auto') "
             f"+ compile + first step: {', '.join(f'{seconds:.0f} s' for seconds in planning.values())} (wall, "
             f"load average {os.getloadavg()[0]:.1f})", "",
             "| budget | torch: saved (x off) | hyperac auto: plan | saved (x off) | predicted / saved | "
             "step hyperac / torch (90% interval) | result |", "|---|---|---|---|---|---|---|"]
    passed, notes = True, []
    for budget in BUDGETS:
        ours, theirs, plan = f"hyperac {budget}", f"torch {budget}", plans[f"hyperac {budget}"]
        step_ratio = ratio(ours, theirs)
        predicted = plan.predicted_bytes / saved[ours]
        ok = step_ratio <= 1.0 and saved[ours] <= 1.01 * saved[theirs] and abs(predicted - 1) <= 0.05
        passed &= ok
        lines.append(f"| {budget} | {saved[theirs] / off:.3f} | {mode_letters([lp.mode for lp in plan.layers])} | "
                     f"{saved[ours] / off:.3f} | {predicted:.3f} | {step_ratio:.3f}x "
                     f"({median_interval(ratios(ours, theirs))}) | "
                     f"{'PASS' if ok else 'FAIL'} |")
        titan = f"torchtitan {budget}"
        if titan in models:
            notes.append(f"torchtitan MemoryBudgetAC {budget}: saved {saved[titan] / off:.3f}x off; hyperac's step "
                         f"{ratio(ours, titan):.3f}x its step "
                         f"({median_interval(ratios(ours, titan))}), "
                         f"torch {budget}'s {ratio(theirs, titan):.3f}x")
        notes.extend(f"hyperac {budget}: {note}" for note in plan.notes)
    return lines + [""] + notes, passed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="inductor", help="compile backend (inductor, aot_eager_decomp_partition)")
    parser.add_argument("--only", choices=sorted(GEOMETRIES))
    parser.add_argument("--rounds", type=int, help="timed rounds (default: the geometry's)")
    parser.add_argument("--frontier", action="store_true",
                        help="instead: every mode on every layer beside torch's budgets (no PASS/FAIL)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    random.seed(0)
    torch._dynamo.config.recompile_limit = 64
    titan = importlib.util.find_spec("torchtitan") is not None and not args.frontier
    print(f"torch {torch.__version__}; torchtitan MemoryBudgetAC: "
          f"{'compared' if titan else 'not compared (--frontier, or not installed: it needs torch 2.14)'}")
    passed = True
    for name, geometry in GEOMETRIES.items():
        if args.only and name != args.only:
            continue
        rounds = args.rounds or ROUNDS[name]
        lines, ok = (frontier(name, geometry, args.backend, rounds), True) if args.frontier else \
            run_geometry(name, geometry, args.backend, rounds, titan)
        passed &= ok
        print("\n".join(lines), flush=True)
    if not args.frontier:
        print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
