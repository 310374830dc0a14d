"""The ``hyperac`` command line.

``hyperac demo`` compares the modes on a built-in tiny Llama (:mod:`hyperac.demo`).

``hyperac plan`` estimates a model from a local HF config file or a preset geometry on the
``meta`` device (nothing is allocated), costs its steps on a device profile (``--device``), and
prints the fastest plan whose predicted peak fits a budget. On an accelerator profile the plan may
swap layers to host memory over the profile's host link, within ``--host-budget`` of pinned host
memory (``--no-swap``: recompute only); ``cpu`` has nothing to swap.

Every bad input exits with status 2 and one line ``hyperac: error: ...`` on stderr that names
the argument and what it allows; missing optional packages are found before any work starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from . import api, demo
from .budget import parse_budget
from .errors import HyperACError
from .planner import DEVICES, ESTIMATE_MODES, SWAP_OPTIONS, choose_modes
from .planner.cost import split_option
from .presets import PRESETS
from .swap import default_host_budget


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


def _host_budget_bytes(args: argparse.Namespace) -> int | None:
    """The pinned host bytes a plan may swap into; ``None`` where the plan does not swap."""
    swaps = args.device in DEVICES and not args.no_swap
    for option, value in (("--host-budget", args.host_budget), ("--min-swap-bytes", args.min_swap_bytes)):
        if value is not None and not swaps:
            why = "--no-swap is given" if args.no_swap else f"--device {args.device} has no host link to swap over"
            raise HyperACError(f"{option}: the plan does not swap ({why}); leave out {option}, or plan for one of "
                               f"{', '.join(DEVICES)} without --no-swap.")
    if not swaps:
        return None
    return args.host_budget if args.host_budget is not None else default_host_budget()


def _print_plan(estimate: Any, chosen: list[str], host_budget: int | None, why_not: str) -> None:
    """The plan per layer (mode, and what it swaps: bytes and copy time not hidden by compute), and
    the swap totals."""
    print(f"{'#':>4}  {'layer':<28}  {'mode':<14}  swap to host")
    for position, (layer, option) in enumerate(zip(estimate.layers, chosen)):
        mode, swaps = split_option(option)
        moved = (f"{estimate.offload_bytes(position, option) / 2**20:.2f} MiB, "
                 f"{estimate.exposed_copy_seconds(position, option) * 1e3:.3f} ms exposed") if swaps else "-"
        print(f"{layer.index:>4}  {layer.fqn:<28}  {'swap' if option == 'swap' else mode:<14}  {moved}")
    if host_budget is None:
        print(f"swap: not offered ({why_not})")
        return
    swapping = [p for p, option in enumerate(chosen) if split_option(option)[1]]
    print(f"swap: {len(swapping)} layers move {sum(estimate.offload_bytes(p, chosen[p]) for p in swapping) / 2**30:.2f}"
          f" GiB to host at {estimate.link_bandwidth / 1e9:.0f} GB/s, "
          f"{sum(estimate.exposed_copy_seconds(p, chosen[p]) for p in swapping) * 1e3:.3f} ms of copies exposed; "
          f"pinned host {estimate.host_bytes(chosen) / 2**30:.2f} GiB of a {host_budget / 2**30:.2f} GiB host budget")


def plan(args: argparse.Namespace) -> int:
    """Estimate a model geometry on the meta device and print the plan that fits the budget."""
    host_budget = _host_budget_bytes(args)
    config = _load_config(args)
    dtype = getattr(torch, args.dtype)
    source = "--preset" if args.preset is not None else "--config"
    model = _build_on_meta(config, dtype, source)
    print(f"estimating {config.model_type}, {config.num_hidden_layers} layers, batch {args.batch} x seq {args.seq}, "
          f"{args.dtype}, on the meta device, costed on {args.device}...", file=sys.stderr, flush=True)
    ids = torch.zeros(args.batch, args.seq, dtype=torch.long, device="meta")
    swap_options = {} if args.min_swap_bytes is None else {"min_swap_bytes": args.min_swap_bytes}
    estimate = api.estimate(model, {"input_ids": ids, "labels": ids}, backend="cpu", device=args.device,
                            **swap_options)
    count = len(estimate.layers)
    off = estimate.peak_bytes(["off"] * count)
    budget_bytes = parse_budget(args.budget, off)
    options = ESTIMATE_MODES if host_budget is None else ESTIMATE_MODES + SWAP_OPTIONS
    modes = choose_modes(estimate, budget_bytes, options, host_budget_bytes=host_budget)
    print(estimate)
    print(f"\nplan for a budget of {budget_bytes / 2**30:.2f} GiB:")
    _print_plan(estimate, modes, host_budget, "--no-swap" if args.no_swap else "the cpu profile has no host link")
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


def _size(text: str) -> int:
    """``--host-budget``: bytes or a size like ``64GiB``, read as ``--budget`` reads sizes."""
    try:
        value = parse_budget(text)
    except HyperACError:
        value = -1
    if value < 0:  # a fraction: of nothing here
        raise argparse.ArgumentTypeError(f"must be a positive byte count or a size like '64GiB' or '512MB', "
                                         f"got {text!r}")
    return value


def _byte_count(text: str) -> int:
    """``--min-swap-bytes``: a byte count (0 allowed) or a size like ``256KiB``."""
    if text.isdigit():
        return int(text)
    try:
        return _size(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"must be a byte count >= 0 or a size like '256KiB', got {text!r}") from None


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
    demo_parser.add_argument("--rounds", type=_positive_int, default=20,
                             help="timed rounds, each one timed training step (after an untimed one) of every "
                                  "configuration in a shuffled order")
    demo_parser.add_argument("--layers", type=_positive_int, default=4)
    demo_parser.add_argument("--hidden", type=_positive_int, default=128, help="a multiple of 8")
    demo_parser.add_argument("--seq", type=_positive_int, default=128)
    demo_parser.add_argument("--batch", type=_positive_int, default=2)
    demo_parser.add_argument("--plot", metavar="FILE.png", action=_PlotAvailable,
                             help="also draw measured step time against measured peak memory (needs matplotlib)")
    demo_parser.set_defaults(run=demo.run)
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
                             help="device profile that costs the step (data-sheet peaks; cpu: measured here); on the "
                             "accelerators the plan may swap layers to host memory over the profile's host link")
    plan_parser.add_argument("--host-budget", type=_size, metavar="SIZE",
                             help="pinned host memory the plan's swaps may hold, e.g. 64GiB (default: what apply "
                                  "would use on this machine, half its physical memory divided by LOCAL_WORLD_SIZE)")
    plan_parser.add_argument("--min-swap-bytes", type=_byte_count, metavar="SIZE",
                             help="storages smaller than this stay on the device, as min_swap_bytes= in the API "
                                  "(default 1MiB; 0 lets every saved tensor go)")
    plan_parser.add_argument("--no-swap", action="store_true", help="plan recompute only, no swap to host memory")
    plan_parser.set_defaults(run=plan)
    return parser


_VALUE_OPTIONS = ("--budget", "--host-budget", "--min-swap-bytes", "--seq", "--batch", "--rounds", "--layers",
                  "--hidden")


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
