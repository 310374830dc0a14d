"""The ``hyperac`` command line.

``hyperac demo`` trains a built-in tiny Llama-style model (built from a config, nothing
downloaded) for a few steps under each mode, and under ``auto`` at half the activation memory,
and prints one table: activation memory kept for backward, the extra FLOPs spent recomputing,
step time, and whether loss and gradients match the model without hyperac.

``hyperac plan`` estimates a model from a local HF config file or a preset geometry on the
``meta`` device (nothing is allocated) and prints the cheapest plan that fits a budget.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from . import api
from .errors import HyperACError
from .measure import measure_step
from .planner import ESTIMATE_MODES, choose_modes, parse_budget
from .presets import PRESETS

MODES = ("off", "full", "selective", "auto")
DEMO_BUDGET = 0.5


def _tiny_llama(args: argparse.Namespace) -> torch.nn.Module:
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        raise SystemExit("hyperac demo needs transformers: pip install 'hyperac[hf]'") from None
    config = LlamaConfig(
        hidden_size=args.hidden, intermediate_size=args.hidden * 4, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=512, max_position_embeddings=args.seq,
        attention_dropout=0.1,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _step(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


def _same(a: tuple[torch.Tensor, list[torch.Tensor]], b: tuple[torch.Tensor, list[torch.Tensor]]) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def demo(args: argparse.Namespace) -> int:
    """Train the tiny model under each mode and print the comparison table."""
    base = _tiny_llama(args)
    base.train()
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    reference = _step(base, ids)
    rows = []
    for position, mode in enumerate(MODES, start=1):
        print(f"[{position}/{len(MODES)}] {mode}: measuring, then {args.steps} timed steps",
              file=sys.stderr, flush=True)
        model = copy.deepcopy(base)
        options = dict(budget=DEMO_BUDGET, sample={"input_ids": ids, "labels": ids}) if mode == "auto" else {}
        api.apply(model, mode=mode, backend="cpu", **options)
        torch.manual_seed(1)
        activation_bytes, flops = measure_step(model, lambda m: m(input_ids=ids, labels=ids).loss)
        matches = _same(reference, _step(model, ids))
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            _step(model, ids)
            times.append(time.perf_counter() - start)
        api.remove(model)
        label = f"auto {DEMO_BUDGET:.0%}" if mode == "auto" else mode
        rows.append((label, activation_bytes, flops, statistics.median(times), matches))
    off_flops = rows[0][2]
    print(f"\nhyperac demo: tiny Llama, {args.layers} layers, hidden {args.hidden}, "
          f"batch {args.batch} x seq {args.seq}")
    print(f"{'mode':<10} {'activations MiB':>16} {'recompute FLOPs':>16} {'step ms':>9}  loss+grads == off")
    for mode, activation_bytes, flops, seconds, matches in rows:
        overhead = 100.0 * (flops - off_flops) / off_flops
        print(f"{mode:<10} {activation_bytes / 2**20:>16.2f} {overhead:>15.1f}% {seconds * 1e3:>9.1f}  "
              f"{'yes' if matches else 'NO'}")
    if args.plot:
        _plot(base, ids, args.plot)
    return 0 if all(row[4] for row in rows) else 1


def _plot(model: torch.nn.Module, ids: torch.Tensor, path: str) -> None:
    """Draw activation memory against replayed FLOPs for every mode and a sweep of auto budgets."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("--plot needs matplotlib: pip install 'hyperac[plot]'") from None
    estimate = api.estimate(model, {"input_ids": ids, "labels": ids}, backend="cpu")
    count = len(estimate.layers)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    for mode in ESTIMATE_MODES:
        modes = [mode] * count
        axes.scatter(estimate.total_bytes(modes) / 2**20, estimate.total_recompute_flops(modes) / 1e9, s=60,
                     label=f"all {mode}", zorder=3)
    off = estimate.total_bytes(["off"] * count)
    points = []
    for percent in range(30, 101, 5):
        try:
            modes = choose_modes(estimate, int(off * percent / 100))
        except HyperACError:
            continue
        points.append((estimate.total_bytes(modes) / 2**20, estimate.total_recompute_flops(modes) / 1e9))
    axes.plot(*zip(*points), "-o", color="black", markersize=3, label="auto, budget 30-100%", zorder=2)
    axes.set_xlabel("activation memory kept for backward (MiB)")
    axes.set_ylabel("FLOPs replayed in backward (GFLOP)")
    axes.set_title("hyperac: memory / recompute trade-off (tiny Llama)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


def _load_config(args: argparse.Namespace) -> Any:
    from transformers import AutoConfig

    if args.preset is not None:
        if args.preset not in PRESETS:
            raise HyperACError(f"unknown preset {args.preset!r}; choose one of {', '.join(sorted(PRESETS))}.")
        settings = dict(PRESETS[args.preset])
    else:
        try:
            with open(args.config, encoding="utf-8") as handle:
                settings = json.load(handle)
        except OSError as error:
            raise HyperACError(f"cannot read config file {args.config!r}: {error.strerror}.") from None
        except json.JSONDecodeError as error:
            raise HyperACError(f"config file {args.config!r} is not JSON: {error}.") from None
        if "model_type" not in settings:
            raise HyperACError(f"config file {args.config!r} has no 'model_type' (an HF config.json has one).")
    model_type = settings.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **settings)
    except ValueError as error:  # an unknown model_type: transformers lists every known one
        raise HyperACError(f"transformers cannot build a config for model_type {model_type!r}: "
                           f"{str(error).split('. Should contain')[0][:200]}.") from None


def plan(args: argparse.Namespace) -> int:
    """Estimate a model geometry on the meta device and print the plan that fits the budget."""
    from transformers import AutoModelForCausalLM

    budget = _parse_budget_argument(args.budget)
    parse_budget(budget)  # a bad budget fails before the estimate, not after it
    config = _load_config(args)
    dtype = getattr(torch, args.dtype)
    print(f"estimating {config.model_type}, {config.num_hidden_layers} layers, batch {args.batch} x seq {args.seq}, "
          f"{args.dtype}, on the meta device...", file=sys.stderr, flush=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    estimate = api.estimate(model, {"input_ids": ids, "labels": ids}, backend="cpu")
    off = estimate.total_bytes(["off"] * len(estimate.layers))
    budget_bytes = parse_budget(budget, off)
    modes = choose_modes(estimate, budget_bytes)
    print(estimate)
    print(f"\nplan for a budget of {budget_bytes / 2**30:.2f} GiB:")
    for layer, mode in zip(estimate.layers, modes):
        print(f"{layer.index:>4}  {layer.fqn:<28}  {mode}")
    print(f"predicted: {estimate.total_bytes(modes) / 2**30:.2f} GiB kept for backward "
          f"(no recompute: {off / 2**30:.2f} GiB), {estimate.total_recompute_flops(modes) / 1e12:.2f} TFLOP "
          f"replayed per step ({100 * estimate.total_recompute_flops(modes) / estimate.base_flops:.1f}% of the step)")
    return 0


def _parse_budget_argument(text: str) -> Any:
    try:
        value = float(text)
    except ValueError:
        return text
    # Whole numbers above 1 are byte counts; anything else (2.5, nan, inf) is left for parse_budget to refuse.
    return int(value) if value > 1 and value.is_integer() else value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyperac", description="Activation recompute for PyTorch training.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="compare the modes on a built-in tiny Llama")
    demo_parser.add_argument("--steps", type=int, default=3, help="timed training steps per mode")
    demo_parser.add_argument("--layers", type=int, default=4)
    demo_parser.add_argument("--hidden", type=int, default=128)
    demo_parser.add_argument("--seq", type=int, default=128)
    demo_parser.add_argument("--batch", type=int, default=2)
    demo_parser.add_argument("--plot", metavar="FILE.png", help="also draw the memory / recompute trade-off")
    demo_parser.set_defaults(run=demo)
    plan_parser = commands.add_parser("plan", help="estimate a model geometry and print the plan for a budget")
    source = plan_parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", metavar="CONFIG.json", help="a local HF config.json")
    source.add_argument("--preset", help=f"one of: {', '.join(sorted(PRESETS))}")
    plan_parser.add_argument("--seq", type=int, default=4096, help="sequence length")
    plan_parser.add_argument("--batch", type=int, default=1, help="batch size")
    plan_parser.add_argument("--budget", required=True, help="bytes, a size like 24GiB, or a fraction like 0.5")
    plan_parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    plan_parser.set_defaults(run=plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hyperac`` command."""
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except HyperACError as error:
        print(f"hyperac: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
