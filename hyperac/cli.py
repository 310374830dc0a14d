"""The ``hyperac`` command line.

``hyperac demo`` trains a built-in tiny Llama-style model (built from a config, nothing
downloaded) under each mode, and under ``auto`` at half the peak activation memory, and prints
one table: measured peak activation memory, the extra FLOPs spent recomputing, step time (and
its ratio to ``off``, timed in interleaved rounds: NOTE [Demo timing]), whether loss and
gradients match the model without hyperac, and auto's chosen plan. ``--plot`` adds auto at other
budgets, every-n-layers full plans and the peers of :mod:`hyperac.peers` (HF's and torchtitan's
checkpointing), and draws step time against peak memory.

``hyperac plan`` estimates a model from a local HF config file or a preset geometry on the
``meta`` device (nothing is allocated), costs its steps on a device profile (``--device``), and
prints the fastest plan whose predicted peak fits a budget.

Every bad input exits with status 2 and one line ``hyperac: error: ...`` on stderr that names
the argument and what it allows; missing optional packages are found before any work starts.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import importlib.util
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from . import api, peers
from .budget import parse_budget
from .errors import HyperACError
from .measure import flop_counter, step_peak
from .planner import DEVICES, choose_modes
from .presets import PRESETS

MODES = ("off", "full", "selective", "auto")
DEMO_BUDGET = 0.5
SWEEP_BUDGETS = (0.6, 0.7, 0.8, 0.9)
"""``--plot``: auto's plans at these budgets too, besides :data:`DEMO_BUDGET`."""
EVERY_N = (2, 3)
"""``--plot``: hyperac's every-n-layers full plans (layers 0, n, 2n... full, the rest off)."""
PEERS = {
    "HF checkpointing": peers.apply_hf_checkpointing,
    "HF checkpointing every 2": functools.partial(peers.apply_hf_checkpointing, every_n_layers=2),
    "torchtitan full": peers.apply_titan_full,
    "torchtitan selective": peers.apply_titan_selective,
}
"""``--plot``: the peers drawn next to hyperac (:mod:`hyperac.peers`)."""
_LETTERS = {"off": "o", "full": "F", "selective": "s", "selective-even": "e", "pointwise": "p", "swap": "w"}

# NOTE [Demo timing]
# On a shared CPU the machine's speed drifts by 1.4-1.7x from one step to the next (thread CPU
# time varies as much as wall time): more than the differences between modes, so a median of a
# few steps per mode, one mode after another, cannot rank them. The demo times in rounds: each
# round runs one step of every configuration, in a fresh shuffled order, and the first round is a
# warm-up that is dropped. Each configuration's step time is compared with off's in the same
# round, and the median of these per-round ratios is what the table reports (``x off``). The
# whole demo runs on one thread, so that auto's profile is taken under the conditions the demo
# times; the caller's thread count is restored afterwards.


@dataclasses.dataclass
class _Point:
    """One configuration the demo measures: its model and what was measured of it."""

    model: torch.nn.Module
    kind: str
    """``mode`` (a row of the table), ``auto``, ``every-n`` or ``peer``."""
    plan: str = ""
    """One letter per layer (:data:`_LETTERS`), for hyperac's plans other than uniform modes."""
    budget: float | None = None
    matches: bool = False
    peak: int = 0
    flops: int = 0
    times: list[float] = dataclasses.field(default_factory=list)
    ratio: float = 0.0
    """Median over the rounds of this step time / off's (NOTE [Demo timing])."""


def _tiny_llama(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

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


def _timed_step(model: torch.nn.Module, ids: torch.Tensor) -> float:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    start = time.perf_counter()
    model(input_ids=ids, labels=ids).loss.backward()
    return time.perf_counter() - start


def _same(a: tuple[torch.Tensor, list[torch.Tensor]], b: tuple[torch.Tensor, list[torch.Tensor]]) -> bool:
    return torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


def _measure(point: _Point, ids: torch.Tensor, reference: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    """Parity with the model without hyperac, peak activation bytes and FLOPs of a training step,
    each from its own step (FlopCounterMode tracks modules and holds tensors of its own while it runs)."""
    model = point.model
    point.matches = _same(reference, _step(model, ids))
    torch.manual_seed(1)
    point.peak = step_peak(model, {"input_ids": ids, "labels": ids})
    torch.manual_seed(1)
    with flop_counter() as flops:
        model(input_ids=ids, labels=ids).loss.backward()
    model.zero_grad(set_to_none=True)
    point.flops = int(flops.get_total_flops())


def _short(plan: Any) -> str:
    return "".join(_LETTERS[layer.mode] for layer in plan.layers)


def demo(args: argparse.Namespace) -> int:
    """Train the tiny model under each mode and print the comparison table (NOTE [Demo timing])."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _demo(args)
    finally:
        torch.set_num_threads(threads)


def _demo(args: argparse.Namespace) -> int:
    base = _tiny_llama(args)
    base.train()
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "labels": ids}
    points: dict[str, _Point] = {}
    for position, mode in enumerate(MODES, start=1):
        print(f"[{position}/{len(MODES)}] {mode}: applying", file=sys.stderr, flush=True)
        model = copy.deepcopy(base)
        if mode == "auto":
            plan = api.apply(model, mode=mode, budget=DEMO_BUDGET, sample=sample, backend="cpu")
            points[f"auto {DEMO_BUDGET:.0%}"] = _Point(model, "mode", _short(plan), DEMO_BUDGET)
        else:
            api.apply(model, mode=mode, backend="cpu")
            points[mode] = _Point(model, "mode")
    notes: list[str] = []
    if args.plot:
        print("[plot] auto at other budgets, every-n plans, peers: applying", file=sys.stderr, flush=True)
        points.update(_auto_sweep(base, sample, notes))
        points.update(_every_n(base, args.layers))
        points.update(_peers(base, notes))
    print(f"measuring parity, peak and FLOPs of {len(points)} configurations", file=sys.stderr, flush=True)
    reference = _step(base, ids)
    for point in points.values():
        _measure(point, ids, reference)
    print(f"timing {args.rounds} rounds of {len(points)} configurations, interleaved", file=sys.stderr, flush=True)
    _time_rounds(points, ids, args.rounds)
    _print_table(points, args)
    for note in notes:
        print(note)
    if args.plot:
        _plot(points, args)
    for point in points.values():
        if point.kind != "peer":
            api.remove(point.model)
    return 0 if all(point.matches for point in points.values() if point.kind != "peer") else 1


def _auto_sweep(base: torch.nn.Module, sample: dict[str, torch.Tensor], notes: list[str]) -> dict[str, _Point]:
    points = {}
    for budget in SWEEP_BUDGETS:
        model = copy.deepcopy(base)
        try:
            plan = api.apply(model, mode="auto", budget=budget, sample=sample, backend="cpu")
        except HyperACError as error:
            notes.append(f"auto {budget:.0%}: not drawn: {_one_line(error)}")
            continue
        points[f"auto {budget:.0%}"] = _Point(model, "auto", _short(plan), budget)
    return points


def _every_n(base: torch.nn.Module, count: int) -> dict[str, _Point]:
    points = {}
    for n in EVERY_N:
        model = copy.deepcopy(base)
        plan = api.apply(model, layers={i: "full" if i % n == 0 else "off" for i in range(count)}, backend="cpu")
        points[f"full every {n}"] = _Point(model, "every-n", _short(plan))
    return points


def _peers(base: torch.nn.Module, notes: list[str]) -> dict[str, _Point]:
    """:data:`PEERS` applied to copies of ``base``; a peer that cannot be applied to it is left out
    with a note in ``notes``."""
    points = {}
    for label, setup in PEERS.items():
        model = copy.deepcopy(base)
        try:
            setup(model)
        except HyperACError as error:
            notes.append(f"{label}: not drawn: {_one_line(error)}")
            continue
        points[label] = _Point(model, "peer")
    return points


def _time_rounds(points: dict[str, _Point], ids: torch.Tensor, rounds: int) -> None:
    """Each point's step time in each of ``rounds`` rounds, and its ratio to off (NOTE [Demo timing])."""
    order = list(points)
    shuffle = random.Random(0)
    for round_ in range(rounds + 1):  # round 0 warms up and is dropped
        shuffle.shuffle(order)
        for label in order:
            seconds = _timed_step(points[label].model, ids)
            if round_:
                points[label].times.append(seconds)
    off = points["off"].times
    for point in points.values():
        point.ratio = statistics.median(t / o for t, o in zip(point.times, off))


def _print_table(points: dict[str, _Point], args: argparse.Namespace) -> None:
    width = max(len(label) for label in points) + 1
    off_flops = points["off"].flops
    print(f"\nhyperac demo: tiny Llama, {args.layers} layers, hidden {args.hidden}, batch {args.batch} x seq "
          f"{args.seq}; CPU, 1 thread, {args.rounds} interleaved rounds")
    print(f"{'mode':<{width}} {'peak MiB':>9} {'recompute FLOPs':>16} {'step ms':>8} {'x off':>6}  "
          f"loss+grads == off  plan")
    rows = {"": [label for label, point in points.items() if point.kind == "mode"],
            "--plot: also drawn": [label for label, point in points.items() if point.kind != "mode"]}
    for heading, labels in rows.items():
        if heading and labels:
            print(heading)
        for label in labels:
            point = points[label]
            overhead = 100.0 * (point.flops - off_flops) / off_flops
            print(f"{label:<{width}} {point.peak / 2**20:>9.2f} {overhead:>15.1f}% "
                  f"{statistics.median(point.times) * 1e3:>8.1f} {point.ratio:>6.2f}  "
                  f"{'yes' if point.matches else 'NO':<17}  {point.plan}".rstrip())
    print("peak MiB: the most activation memory alive at once over forward and backward\n"
          "  (hyperac.measure.PeakMeter; parameters and their gradients are not counted)")
    print("x off: median of the per-round ratios to off, the column to compare (each round runs one step\n"
          "  of every configuration, in a shuffled order); step ms: median over the rounds")
    print("plan: one letter per layer: o off, p pointwise, s selective, e selective-even, F full")
    if any(not point.matches for point in points.values() if point.kind == "peer"):
        print("NO for a peer: its recompute does not replay the RNG state (torchtitan: preserve_rng_state=False),\n"
              "  so the model's attention dropout draws other masks in backward")


def _plot(points: dict[str, _Point], args: argparse.Namespace) -> None:
    """Draw measured step time (x off) against measured peak memory: hyperac's modes, its auto plans
    over budgets and every-n plans, and the peers."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(8, 5))
    axes = figure.subplots()
    markers = iter("x+^v<>*")
    for label, point in points.items():
        x, y = point.peak / 2**20, point.ratio
        if point.kind == "mode" and point.budget is None:
            axes.scatter(x, y, s=60, marker="o", label=f"hyperac {label}", zorder=3)
        elif point.kind == "every-n":
            axes.scatter(x, y, s=50, marker="s", label=f"hyperac {label} ({point.plan})", zorder=3)
        elif point.kind == "peer":
            axes.scatter(x, y, s=70, marker=next(markers), label=label, zorder=3)
    auto = sorted((point for point in points.values() if point.budget is not None), key=lambda p: p.budget)
    budgets = f"{auto[0].budget:.0%}" + (f"-{auto[-1].budget:.0%}" if len(auto) > 1 else "")
    axes.plot([p.peak / 2**20 for p in auto], [p.ratio for p in auto], "-o", color="black", markersize=4,
              label=f"hyperac auto, budget {budgets} (plan per point)", zorder=2)
    for point in auto:
        axes.annotate(f"{point.budget:.0%} {point.plan}", (point.peak / 2**20, point.ratio), fontsize=7,
                      xytext=(4, 4), textcoords="offset points")
    axes.set_xlabel("measured peak activation memory (MiB; parameters and their gradients not counted)")
    axes.set_ylabel("measured step time (x off, median of per-round ratios)")
    axes.set_title(f"step time against peak memory: tiny Llama, {args.layers} layers, hidden {args.hidden}, "
                   f"seq {args.seq}; CPU, 1 thread", fontsize=9)
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")


def _load_config(args: argparse.Namespace) -> Any:
    from transformers import AutoConfig

    if args.preset is not None:
        if args.preset not in PRESETS:
            raise HyperACError(f"--preset: unknown preset {args.preset!r}; choose one of {', '.join(sorted(PRESETS))}.")
        settings = dict(PRESETS[args.preset])
    else:
        settings = _read_config_file(args.config)
    model_type = settings.pop("model_type")
    try:
        return AutoConfig.for_model(model_type, **settings)
    except ValueError as error:
        if model_type not in _known_model_types():
            raise HyperACError(f"--config: transformers cannot build a config for model_type {model_type!r}: "
                               f"{str(error).split('. Should contain')[0][:200]}.") from None
        raise HyperACError(f"--config: transformers rejects {args.config!r}: {_one_line(error)}") from None
    except Exception as error:  # noqa: BLE001 - HF's validators raise their own types (StrictDataclass...)
        raise HyperACError(f"--config: transformers rejects {args.config!r}: {_one_line(error)}") from None


def _known_model_types() -> Any:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING


def _one_line(error: BaseException) -> str:
    return " ".join(str(error).split())[:300]


def _read_config_file(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as handle:
            settings = json.load(handle)
    except OSError as error:
        raise HyperACError(f"--config: cannot read config file {path!r}: {error.strerror}.") from None
    except UnicodeDecodeError:
        raise HyperACError(f"--config: config file {path!r} is not UTF-8 text; give an HF config.json.") from None
    except json.JSONDecodeError as error:
        raise HyperACError(f"--config: config file {path!r} is not JSON: {error}.") from None
    if not isinstance(settings, dict):
        raise HyperACError(f"--config: config file {path!r} holds a JSON {type(settings).__name__}, not an object "
                           "like an HF config.json ({\"model_type\": ...}).")
    if "model_type" not in settings:
        raise HyperACError(f"--config: config file {path!r} has no 'model_type' (an HF config.json has one).")
    return settings


def _build_on_meta(config: Any, dtype: torch.dtype, source: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, TypeError, AttributeError, KeyError, RuntimeError) as error:
        raise HyperACError(f"{source}: transformers cannot build this model: {_one_line(error)}") from None


def plan(args: argparse.Namespace) -> int:
    """Estimate a model geometry on the meta device and print the plan that fits the budget."""
    config = _load_config(args)
    dtype = getattr(torch, args.dtype)
    source = "--preset" if args.preset is not None else "--config"
    model = _build_on_meta(config, dtype, source)
    print(f"estimating {config.model_type}, {config.num_hidden_layers} layers, batch {args.batch} x seq {args.seq}, "
          f"{args.dtype}, on the meta device, costed on {args.device}...", file=sys.stderr, flush=True)
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    estimate = api.estimate(model, {"input_ids": ids, "labels": ids}, backend="cpu", device=args.device)
    count = len(estimate.layers)
    off = estimate.peak_bytes(["off"] * count)
    budget_bytes = parse_budget(args.budget, off)
    modes = choose_modes(estimate, budget_bytes)
    print(estimate)
    print(f"\nplan for a budget of {budget_bytes / 2**30:.2f} GiB:")
    for layer, mode in zip(estimate.layers, modes):
        print(f"{layer.index:>4}  {layer.fqn:<28}  {mode}")
    print(f"predicted: peak {estimate.peak_bytes(modes) / 2**30:.2f} GiB (no recompute: {off / 2**30:.2f} GiB), "
          f"{estimate.total_bytes(modes) / 2**30:.2f} GiB kept for backward, step "
          f"{estimate.step_seconds(modes) * 1e3:.1f} ms on {args.device} (no recompute: "
          f"{estimate.step_seconds(['off'] * count) * 1e3:.1f} ms), {estimate.total_recompute_flops(modes) / 1e12:.2f}"
          f" TFLOP replayed ({100 * estimate.total_recompute_flops(modes) / estimate.base_flops:.1f}% of the step)")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 1, got {text!r}")
    return value


def _budget(text: str) -> str:
    """The budget as the API reads it: validated now, resolved once the no-recompute peak is known."""
    try:
        parse_budget(text)
    except HyperACError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


class _Parser(argparse.ArgumentParser):
    """argparse, with each error as one line ``hyperac: error: ...`` and exit status 2."""

    def error(self, message: str) -> Any:
        self.exit(2, f"hyperac: error: {message} (see '{self.prog} --help')\n")


class _PlotAvailable(argparse.Action):
    """``--plot FILE``: fails at parse time, before the demo runs, when matplotlib is missing."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: Any, value: Any, option: Any = None) -> None:
        if importlib.util.find_spec("matplotlib") is None:
            parser.error("argument --plot: needs matplotlib, which is not installed: pip install 'hyperac[plot]'")
        setattr(namespace, self.dest, value)


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hyperac", description="Activation recompute for PyTorch training.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo_parser = commands.add_parser("demo", help="compare the modes on a built-in tiny Llama")
    demo_parser.add_argument("--rounds", type=_positive_int, default=40,
                             help="timed rounds, each one training step of every configuration in a shuffled order")
    demo_parser.add_argument("--layers", type=_positive_int, default=4)
    demo_parser.add_argument("--hidden", type=_positive_int, default=128, help="a multiple of 8")
    demo_parser.add_argument("--seq", type=_positive_int, default=128)
    demo_parser.add_argument("--batch", type=_positive_int, default=2)
    demo_parser.add_argument("--plot", metavar="FILE.png", action=_PlotAvailable,
                             help="also draw measured step time against measured peak memory (needs matplotlib)")
    demo_parser.set_defaults(run=demo)
    plan_parser = commands.add_parser("plan", help="estimate a model geometry and print the plan for a budget")
    source = plan_parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", metavar="CONFIG.json", help="a local HF config.json")
    source.add_argument("--preset", help=f"one of: {', '.join(sorted(PRESETS))}")
    plan_parser.add_argument("--seq", type=_positive_int, default=4096, help="sequence length")
    plan_parser.add_argument("--batch", type=_positive_int, default=1, help="batch size")
    plan_parser.add_argument("--budget", required=True, type=_budget,
                             help="peak activation memory: bytes, a size like 24GiB, or a fraction like 0.5 of the "
                                  "no-recompute peak (as budget= in the API)")
    plan_parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    plan_parser.add_argument("--device", default="h100", choices=(*DEVICES, "cpu"),
                             help="device profile that costs the step (data-sheet peaks; cpu: measured here)")
    plan_parser.set_defaults(run=plan)
    return parser


_VALUE_OPTIONS = ("--budget", "--seq", "--batch", "--rounds", "--layers", "--hidden")


def _join_negative_values(argv: list[str]) -> list[str]:
    """``--budget -1GiB`` -> ``--budget=-1GiB``: argparse takes a value starting with '-' for an
    option and reports a missing value; joined, the value reaches its type check and its message."""
    joined: list[str] = []
    for arg in argv:
        if joined and joined[-1] in _VALUE_OPTIONS and arg.startswith("-") and arg not in _VALUE_OPTIONS:
            joined[-1] = f"{joined[-1]}={arg}"
        else:
            joined.append(arg)
    return joined


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``hyperac`` command."""
    try:
        args = _parser().parse_args(_join_negative_values(list(sys.argv[1:] if argv is None else argv)))
    except SystemExit as exit_:  # a bad argument (status 2, its one line already printed), or --help
        return int(exit_.code or 0)
    try:
        return args.run(args)
    except HyperACError as error:
        print(f"hyperac: error: {_one_line(error)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
