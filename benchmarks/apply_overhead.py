"""How long ``hyperac.apply`` and ``hyperac.remove`` take on a deep model.

The model is a Llama with Llama-3-8B layer dimensions (hidden 4096, intermediate 14336, 32 heads,
8 KV heads, vocab 128256) but 128 layers, built on the ``meta`` device: no memory is allocated
and no kernel runs, so what is timed is hyperac's own Python work (layer discovery, plan,
policy op sets, installing and restoring ``forward``).

For each plan (``mode="full"``, ``mode="selective"``, a per-layer plan naming every layer) the
script reports the first (cold) call and the median of ``--repeats`` warm calls, for apply and
for remove, and PASS/FAIL against ``--target-ms`` (default 50 ms) on the warm median. With
``--profile`` (or whenever a target fails) it prints the cProfile of one apply and one remove,
restricted to hyperac's own functions and to the callees that cost most.

    python benchmarks/apply_overhead.py            # 128 layers
    python benchmarks/apply_overhead.py --quick    # 32 layers, fewer repeats
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch

import hyperac


def build_model(
    layers: int, hidden: int, intermediate: int, heads: int, kv_heads: int, vocab: int
) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=8192,
        rope_theta=500000.0,
    )
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model.train()
    return model


def per_layer_plan(layers: int) -> dict[int, str]:
    """One entry per layer, cycling full / selective / off (the longest plan a user writes)."""
    cycle = ("full", "selective", "off")
    return {i: cycle[i % 3] for i in range(layers)}


def time_ms(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def snapshot(model: torch.nn.Module) -> tuple:
    """What apply must change and remove must restore: instance forwards and use_cache."""
    forwards = tuple(sorted(n for n, m in model.named_modules() if "forward" in m.__dict__))
    return forwards, model.config.use_cache


def profiled(fn: Callable[[], Any]) -> pstats.Stats:
    profiler = cProfile.Profile()
    profiler.enable()
    fn()
    profiler.disable()
    return pstats.Stats(profiler, stream=io.StringIO())


def breakdown(stats: pstats.Stats, entry: str) -> str:
    """The direct callees of hyperac's ``entry`` function (``api.py:apply``), by cumulative time.

    Times are under the profiler (inflated, so read the shares, not the milliseconds).
    """
    top = next((k for k in stats.stats if k[0].endswith("hyperac/api.py") and k[2] == entry), None)
    if top is None:
        return f"(no hyperac.{entry} in the profile)"
    total = stats.stats[top][3]
    rows = []
    for func, (_, _, _, _, callers) in stats.stats.items():
        if top in callers:
            rows.append((callers[top][3], func))
    rows.sort(reverse=True)
    lines = [f"  {'callee of hyperac.' + entry:<58} {'cum ms':>8} {'share':>6}"]
    for cumtime, (path, line, name) in rows:
        if cumtime < 0.005 * total:
            continue
        where = (
            f"{path.split('/hyperac/')[-1] if '/hyperac/' in path else path.rsplit('/', 1)[-1]}:{line} {name}"
        )
        lines.append(f"  {where[:58]:<58} {cumtime * 1e3:>8.2f} {cumtime / total:>6.0%}")
    lines.append(f"  {'total (under the profiler)':<58} {total * 1e3:>8.2f}")
    return "\n".join(lines)


def profile_text(stats: pstats.Stats, limit: int) -> str:
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("cumulative").print_stats("hyperac", limit)
    stats.sort_stats("tottime").print_stats(limit)
    return out.getvalue()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--repeats", type=int, default=9, help="warm calls per plan (median reported)")
    parser.add_argument("--target-ms", type=float, default=50.0)
    parser.add_argument(
        "--profile", action="store_true", help="print a cProfile of apply/remove for every plan"
    )
    parser.add_argument("--profile-lines", type=int, default=25)
    parser.add_argument("--quick", action="store_true", help="32 layers, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.repeats = min(args.layers, 32), 3

    warnings.simplefilter("ignore")
    start = time.perf_counter()
    model = build_model(args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads, args.vocab)
    build_s = time.perf_counter() - start
    modules = sum(1 for _ in model.modules())
    print(
        f"torch {torch.__version__}, hyperac {hyperac.__version__}, python {sys.version.split()[0]}, "
        f"{torch.get_num_threads()} threads, load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"model: LlamaForCausalLM on meta, {args.layers} layers, hidden {args.hidden}, intermediate "
        f"{args.intermediate}, heads {args.heads}/{args.kv_heads}, vocab {args.vocab}; {modules} modules "
        f"(built in {build_s:.1f} s)"
    )
    print(f"target: apply and remove each < {args.target_ms:g} ms (warm median of {args.repeats})\n")

    plans: dict[str, dict[str, Any]] = {
        "full": dict(mode="full"),
        "selective": dict(mode="selective"),
        "per-layer": dict(mode="full", layers=per_layer_plan(args.layers)),
    }
    pristine = snapshot(model)
    if args.profile:
        # The first apply in a process pays one-time imports; show where, then time the rest.
        stats = profiled(lambda: hyperac.apply(model, backend="cpu", mode="full"))
        print("===== cProfile: first (cold) hyperac.apply in this process, plan full =====")
        print(breakdown(stats, "apply"))
        print(profile_text(stats, args.profile_lines))
        hyperac.remove(model)
        print("(the 'cold' column below is therefore the second call in this process)\n")
    rows, failed = [], []
    for name, options in plans.items():
        applies, removes = [], []
        for _ in range(args.repeats + 1):
            applies.append(time_ms(lambda options=options: hyperac.apply(model, backend="cpu", **options)))
            removes.append(time_ms(lambda: hyperac.remove(model)))
            if snapshot(model) != pristine:
                raise SystemExit(f"hyperac.remove did not restore the model after plan {name!r}")
        plan = hyperac.apply(model, backend="cpu", **options)
        summary = plan.summary()
        hyperac.remove(model)
        for what, times in (("apply", applies), ("remove", removes)):
            warm = statistics.median(times[1:])
            ok = warm < args.target_ms
            if not ok:
                failed.append((name, what))
            rows.append(
                (name, what, times[0], warm, min(times[1:]), max(times[1:]), "PASS" if ok else "FAIL")
            )
        print(f"{name:<10} {summary}")

    print()
    header = f"{'plan':<10} {'call':<7} {'cold ms':>9} {'median ms':>10} {'min ms':>8} {'max ms':>8}  result"
    print(header)
    print("-" * len(header))
    for name, what, cold, warm, low, high, result in rows:
        print(f"{name:<10} {what:<7} {cold:>9.2f} {warm:>10.2f} {low:>8.2f} {high:>8.2f}  {result}")
    print()
    print("overall:", "PASS" if not failed else "FAIL (" + ", ".join(f"{p} {c}" for p, c in failed) + ")")

    failed_plans = list(dict.fromkeys(p for p, _ in failed))
    for name in plans:
        options = plans[name]
        stats = profiled(lambda options=options: hyperac.apply(model, backend="cpu", **options))
        remove_stats = profiled(lambda: hyperac.remove(model))
        if name == "full" or args.profile or name in failed_plans:
            print(f"\nwhere a warm hyperac.apply spends its time, plan {name}:")
            print(breakdown(stats, "apply"))
        if args.profile or name in failed_plans:
            print(f"\n===== cProfile: warm hyperac.apply, plan {name} =====")
            print(profile_text(stats, args.profile_lines))
            print(f"===== cProfile: warm hyperac.remove, plan {name} =====")
            print(profile_text(remove_stats, args.profile_lines))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
