"""Per-step cost of checking every replay in ``full`` mode, and of replaying under the forward's state.

``full`` checks its replay with a fingerprint of the tensors its forward saves (replay_check.py, NOTE
[Every replay is checked]) and replays under the forward's Python state (python_state.py) and torch
settings (replay_context.py). This times one training step (forward + backward) of a tiny Llama (4
layers, hidden 64, batch 2, 64 tokens, 1 thread) in four configurations:

* ``torch``      torchtitan-style full recompute (``torch.utils.checkpoint`` per layer, no checks:
                 :func:`hyperac.peers.apply_titan_full`);
* ``bare``       hyperac ``full`` with the three additions switched off (patched out for the step);
* ``+check``     hyperac ``full`` with the fingerprint only;
* ``hyperac``    hyperac ``full`` as shipped (fingerprint, Python state, forward context).

Rounds are interleaved (each round runs one step of every configuration, in a shuffled order, after an
untimed step of the same configuration); the report is the median over rounds of each configuration's
step time over ``bare``'s in the same round. Times are the thread's CPU time. Run with
``OMP_NUM_THREADS=1``; the numbers are ratios of one process and one run, not targets.

    OMP_NUM_THREADS=1 python benchmarks/replay_check_overhead.py [--rounds 40] [--seq 64]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

import hyperac
from hyperac import peers, recompute


class _Nothing:
    """Stands in for the checks while ``bare`` or ``+check`` runs."""

    def __init__(self, *args: Any) -> None:
        self.borrowed: list = []

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


@contextlib.contextmanager
def _patched(check: bool, state: bool) -> Iterator[None]:
    saved = recompute.full_replay_contexts, recompute.PythonState, recompute.ForwardContext
    if not check:
        recompute.full_replay_contexts = lambda *args: (_Nothing(), _Nothing())
    if not state:
        recompute.PythonState, recompute.ForwardContext = _Nothing, _Nothing
    try:
        yield
    finally:
        recompute.full_replay_contexts, recompute.PythonState, recompute.ForwardContext = saved


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                        max_position_embeddings=256, use_cache=False))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--seq", type=int, default=64)
    a = parser.parse_args()
    torch.set_num_threads(1)
    base = _model()
    ids = torch.randint(0, 128, (2, a.seq), generator=torch.Generator().manual_seed(0))
    models = {"torch": copy.deepcopy(base)}
    peers.apply_titan_full(models["torch"])
    for name in ("bare", "+check", "hyperac"):
        models[name] = copy.deepcopy(base)
        hyperac.apply(models[name], mode="full", backend="cpu")
    patches = {"torch": (True, True), "bare": (False, False), "+check": (True, False), "hyperac": (True, True)}

    def step(name: str) -> Callable[[], float]:
        model = models[name]

        def run() -> float:
            with _patched(*patches[name]):
                model.zero_grad(set_to_none=True)
                start = time.thread_time_ns()
                model(input_ids=ids, labels=ids).loss.backward()
                return (time.thread_time_ns() - start) / 1e6
        return run

    runs = {name: step(name) for name in models}
    samples: dict[str, list[float]] = {name: [] for name in models}
    rng = random.Random(0)
    for round_number in range(a.rounds + 1):
        order = list(runs)
        rng.shuffle(order)
        for name in order:
            runs[name]()  # untimed: the model's tensors in cache, as in training
            elapsed = runs[name]()
            if round_number:
                samples[name].append(elapsed)
    bare = statistics.median(samples["bare"])
    print(f"tiny Llama, 4 layers, hidden 64, batch 2 x {a.seq} tokens, full recompute: bare hyperac step "
          f"{bare:.1f} ms, {a.rounds} rounds, threads={torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
    for name in models:
        ratios = [value / base_value for value, base_value in zip(samples[name], samples["bare"])]
        print(f"  {name:8s} {statistics.median(samples[name]):7.1f} ms   x{statistics.median(ratios):.3f} bare")
    return 0


if __name__ == "__main__":
    sys.exit(main())
