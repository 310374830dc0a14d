"""Per-step cost of keeping routes in ``full`` mode (NOTE [Routing is kept] in hyperac/replay/routing.py).

``full`` keeps, on a layer whose first training forward ran a routing op (an MoE router's ``topk``), a
copy of each routing op's output, watched for by a dispatch mode over the layer's forward and replay; a
layer that routed nothing runs without it from its second step on. This times one training step
(forward + backward) of a tiny Mixtral (2 layers, hidden 32, 4 experts top-2, grouped experts, batch 4,
64 tokens, 1 thread) and a tiny Qwen2 of the same size without experts, each in two configurations:

* ``recomputed``  hyperac ``full`` with routes recomputed, as before routes were kept (every layer
                  marked as routing nothing, so no mode runs);
* ``kept``        hyperac ``full`` as shipped.

Rounds are interleaved (each round runs one step of every configuration, in a shuffled order, after an
untimed step of the same configuration); the report is the median over rounds of ``kept``'s step time
over ``recomputed``'s in the same round. Times are the thread's CPU time. Run with
``OMP_NUM_THREADS=1``; the numbers are ratios of one process and one run, not targets.

    OMP_NUM_THREADS=1 python benchmarks/routing_overhead.py [--rounds 30]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import hyperac
from hyperac.recompute import RecomputedForward
from hyperac.replay.buffers import BufferSnapshots

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hyperac_testing import lm_loss, tiny_mixtral, tiny_qwen2, train_step  # noqa: E402


def _step(model: torch.nn.Module, routes: bool) -> Callable[[], float]:
    """A timed training step of ``model`` applied in ``full``, its routes kept or recomputed."""
    hyperac.apply(model, mode="full", backend="cpu")
    if not routes:
        for module in model.modules():
            if isinstance(module.forward, RecomputedForward):  # its context, inside a buffer snapshot if any
                context = module.forward.context
                context = context.context_fn if isinstance(context, BufferSnapshots) else context
                context.routes_seen.routes = False
    loss = lm_loss(batch=4, seq=64)

    def run() -> float:
        train_step(model, loss)
        start = time.thread_time()
        train_step(model, loss)
        return time.thread_time() - start

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    options = parser.parse_args()
    torch.set_num_threads(1)
    for name, build in (("mixtral", lambda: tiny_mixtral(num_layers=2, experts_implementation="grouped_mm")),
                        ("qwen2", lambda: tiny_qwen2(num_layers=2))):
        steps = {"recomputed": _step(build(), False), "kept": _step(build(), True)}
        ratios = []
        for _ in range(options.rounds):
            order = list(steps)
            random.shuffle(order)
            seconds = {config: steps[config]() for config in order}
            ratios.append(seconds["kept"] / seconds["recomputed"])
        print(f"{name}: full with routes kept / recomputed: x{statistics.median(ratios):.3f} "
              f"(median of {options.rounds} rounds; quartiles {statistics.quantiles(ratios, n=4)[0]:.3f}-"
              f"{statistics.quantiles(ratios, n=4)[2]:.3f})")


if __name__ == "__main__":
    main()
