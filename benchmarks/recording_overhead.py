"""Python cost per op of selective recompute's dispatch modes: hyperac's against torchtitan's policy.

Every selective-style recompute runs each aten op of a layer through a Python
``TorchDispatchMode``: once to record (keep or drop the op's output) in forward, once to replay in
backward. On tiny tensors that costs more than the op itself. This times one tiny Llama decoder
layer's forward (hidden 64, seq 16, batch 2, 1 thread) in four ways:

* ``bare``         no dispatch mode (the ops' own cost);
* ``hyperac-rec``  under hyperac's recording context (``mode="selective"``);
* ``titan-rec``    under torch's ``create_selective_checkpoint_contexts`` with the torchtitan-style
                   policy of ``hyperac.peers`` (the same torch SAC machinery torchtitan uses);
* ``hyperac-rep`` / ``titan-rep``   the replay context of a pair that just recorded the forward.

Rounds are interleaved (each round runs every configuration once, in a shuffled order), and the
report is the median over rounds of (time under the mode - bare time) / number of ops, in µs/op.
Times are the thread's CPU time (``time.thread_time_ns``), so a loaded machine that takes the CPU
away between ops inflates them less than wall time.
Run with ``OMP_NUM_THREADS=1``; the numbers are ratios of one process and one run, not targets.

    OMP_NUM_THREADS=1 python benchmarks/recording_overhead.py [--rounds 30] [--repeats 20]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from hyperac.backends import get_backend
from hyperac.measure import OpCounter
from hyperac.peers import titan_context_fn
from hyperac.policy import resolve_op_sets, selective_contexts


def _layer_and_inputs() -> tuple[torch.nn.Module, tuple, dict]:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64,
                         attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    captured: dict[str, Any] = {}

    def grab(module, args, kwargs):
        captured["args"], captured["kwargs"] = args, dict(kwargs)

    handle = model.model.layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        model(input_ids=torch.randint(0, 128, (2, 16)), use_cache=False)
    handle.remove()
    hidden = captured["args"][0].detach().requires_grad_(True)
    return model.model.layers[0], (hidden, *captured["args"][1:]), captured["kwargs"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=20, help="forwards per timed sample")
    a = parser.parse_args()
    torch.set_num_threads(1)
    layer, args, kwargs = _layer_and_inputs()
    ops = resolve_op_sets(get_backend("cpu"))
    titan = titan_context_fn()

    def forward() -> None:
        layer(*args, **kwargs)

    counter = OpCounter()
    with counter:
        forward()
    num_ops = counter.count

    def recording(make: Callable[[], tuple[Any, Any]]) -> Callable[[], None]:
        def run() -> None:
            record, _ = make()
            with record:
                forward()
        return run

    def replaying(make: Callable[[], tuple[Any, Any]]) -> Callable[[], tuple[Any, Any]]:
        def prepare() -> Any:
            record, replay = make()
            with record:
                forward()
            return replay
        return prepare

    def hyperac_make() -> tuple[Any, Any]:
        return selective_contexts(ops)

    configs: dict[str, Callable[[], float]] = {}

    def timed(run: Callable[[], None]) -> Callable[[], float]:
        def sample() -> float:
            start = time.thread_time_ns()
            for _ in range(a.repeats):
                run()
            return (time.thread_time_ns() - start) / a.repeats / 1e3
        return sample

    def timed_replay(prepare: Callable[[], Any]) -> Callable[[], float]:
        def sample() -> float:
            total = 0
            for _ in range(a.repeats):
                replay = prepare()
                start = time.thread_time_ns()
                with replay:
                    forward()
                total += time.thread_time_ns() - start
            return total / a.repeats / 1e3
        return sample

    configs["bare"] = timed(forward)
    configs["hyperac-rec"] = timed(recording(hyperac_make))
    configs["titan-rec"] = timed(recording(titan))
    configs["hyperac-rep"] = timed_replay(replaying(hyperac_make))
    configs["titan-rep"] = timed_replay(replaying(titan))
    samples: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(3):
        for sample in configs.values():
            sample()
    rng = random.Random(0)
    for _ in range(a.rounds):
        order = list(configs)
        rng.shuffle(order)
        for name in order:
            samples[name].append(configs[name]())
    bare = statistics.median(samples["bare"])
    print(f"tiny Llama layer forward: {num_ops} ops, bare {bare:.0f} µs "
          f"({bare / num_ops:.2f} µs/op), {a.rounds} rounds x {a.repeats} forwards, "
          f"threads={torch.get_num_threads()}, load {os.getloadavg()[0]:.1f}")
    per_op = Counter()
    for name in configs:
        if name == "bare":
            continue
        extra = [(value - base) / num_ops for value, base in zip(samples[name], samples["bare"])]
        per_op[name] = statistics.median(extra)
        print(f"  {name:12s} {statistics.median(samples[name]):8.0f} µs   +{per_op[name]:5.2f} µs/op over bare")
    for phase, ours, theirs in (("recording", "hyperac-rec", "titan-rec"), ("replay", "hyperac-rep", "titan-rep")):
        print(f"{phase}: hyperac - titan = {per_op[ours] - per_op[theirs]:+.2f} µs/op "
              f"({per_op[ours] / per_op[theirs]:.2f}x titan's overhead)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
