"""The ``hyperac`` command line.

``hyperac demo`` compares the modes on a built-in tiny Llama (:mod:`hyperac.demo`).

``hyperac plan`` estimates a model on the ``meta`` device (nothing is allocated): a local HF
config file (the architecture it names, else a causal LM), a preset geometry, or a Python entry
point ``module:factory`` returning any ``nn.Module`` that takes token ids. It costs the steps on a
device profile (``--device``), prints the fastest plan whose predicted peak fits a budget and, with
``--output plan.json``, writes it as :func:`hyperac.apply` reads it back (``plan=``). On an
accelerator profile the plan may swap layers to host memory over the profile's host link,
within ``--host-budget`` of pinned host memory (``--no-swap``: recompute only); ``cpu`` has
nothing to swap.

Every bad input exits with status 2 and one line ``hyperac: error: ...`` on stderr that names
the argument and what it allows; missing optional packages are found before any work starts.

NOTE [Parse first, import late]: ``hyperac --help``, ``hyperac plan --help`` and every bad
argument answer at once (tens of milliseconds of CPU, tests/test_cli.py bounds it): this module and
the ``hyperac`` package import neither torch nor transformers at the top (NOTE [Lazy package] in
``hyperac/__init__.py``). A command imports them once argparse has accepted its arguments. So the
device profile names are written out here (:data:`DEVICE_PROFILES`; a test holds them equal to
``hyperac.planner.DEVICES``).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from .budget import parse_budget
from .errors import HyperACError
from .presets import PRESETS

if TYPE_CHECKING:
    import torch

DEVICE_PROFILES = ("h100", "h200", "a100", "910b")
"""The accelerator profiles of :data:`hyperac.planner.DEVICES`, by name (``cpu`` is measured here)."""


def _load_config(args: argparse.Namespace) -> Any:
    from transformers import AutoConfig

    if args.preset is not None:
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
    """The model class the config names (``architectures``), else a causal LM, on ``meta``."""
    import torch
    import transformers

    named = [getattr(transformers, name, None) for name in getattr(config, "architectures", None) or ()]
    model_class = next((cls for cls in named if cls is not None), transformers.AutoModelForCausalLM)
    try:
        with torch.device("meta"):
            return model_class.from_config(config, dtype=dtype) if model_class is transformers.AutoModelForCausalLM \
                else model_class._from_config(config, dtype=dtype)
    except (ValueError, TypeError, AttributeError, KeyError, RuntimeError) as error:
        raise HyperACError(f"{source}: transformers cannot build this model: {_one_line(error)}") from None


def _model_from_entry_point(spec: str, dtype: torch.dtype) -> torch.nn.Module:
    """``--model module:factory``: ``factory()`` called on the ``meta`` device, in ``dtype``."""
    import torch

    module_name, _, attribute = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attribute)
    except ImportError as error:
        raise HyperACError(f"--model: cannot import {module_name!r}: {_one_line(error)}") from None
    except AttributeError:
        raise HyperACError(f"--model: module {module_name!r} has no {attribute!r}; give module:factory, a "
                           "function returning the model.") from None
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as error:  # noqa: BLE001 - the user's factory may raise anything
        raise HyperACError(f"--model: {spec}() raised {type(error).__name__}: {_one_line(error)}") from None
    if not isinstance(model, torch.nn.Module):
        raise HyperACError(f"--model: {spec}() returned a {type(model).__name__}, not a torch.nn.Module.")
    return model.to(dtype)


def _loss_of(output: Any) -> torch.Tensor:
    """A scalar to run backward from: the output's ``loss`` if it has one, else its (first) tensor summed."""
    import torch

    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    if isinstance(output, (tuple, list)):
        output = next(item for item in output if isinstance(item, torch.Tensor))
    logits = getattr(output, "logits", output)
    return logits.float().sum()


def _host_budget_bytes(args: argparse.Namespace) -> int | None:
    """The pinned host bytes a plan may swap into; ``None`` where the plan does not swap."""
    swaps = args.device in DEVICE_PROFILES and not args.no_swap
    for option, value in (("--host-budget", args.host_budget), ("--min-swap-bytes", args.min_swap_bytes)):
        if value is not None and not swaps:
            why = "--no-swap is given" if args.no_swap else f"--device {args.device} has no host link to swap over"
            raise HyperACError(f"{option}: the plan does not swap ({why}); leave out {option}, or plan for one of "
                               f"{', '.join(DEVICE_PROFILES)} without --no-swap.")
    if not swaps:
        return None
    from .swap import default_host_budget

    return args.host_budget if args.host_budget is not None else default_host_budget()


def _print_plan(estimate: Any, chosen: list[str], layers: tuple[Any, ...], host_budget: int | None,
                why_not: str) -> None:
    """The plan per layer as ``--output`` writes it (``layers``: its :class:`~hyperac.LayerPlan` entries,
    mode and swap), what each swapping layer moves (bytes, and copy time not hidden by compute) under
    the solver's option ``chosen``, and the swap totals."""
    print(f"{'#':>4}  {'layer':<28}  {'mode':<14}  swap to host")
    for position, layer in enumerate(layers):
        moved = (f"{estimate.offload_bytes(position, chosen[position]) / 2**20:.2f} MiB, "
                 f"{estimate.exposed_copy_seconds(position, chosen[position]) * 1e3:.3f} ms exposed"
                 ) if layer.swap else "-"
        print(f"{layer.index:>4}  {layer.fqn:<28}  {layer.mode:<14}  {moved}")
    if host_budget is None:
        print(f"swap: not offered ({why_not})")
        return
    swapping = [p for p, layer in enumerate(layers) if layer.swap]
    print(f"swap: {len(swapping)} layers move {sum(estimate.offload_bytes(p, chosen[p]) for p in swapping) / 2**30:.2f}"
          f" GiB to host at {estimate.link_bandwidth / 1e9:.0f} GB/s, "
          f"{sum(estimate.exposed_copy_seconds(p, chosen[p]) for p in swapping) * 1e3:.3f} ms of copies exposed; "
          f"pinned host {estimate.host_bytes(chosen) / 2**30:.2f} GiB of a {host_budget / 2**30:.2f} GiB host budget")
    if any(layer.mode == "swap" and not layer.swap for layer in layers):
        print("note: a swap layer that moves nothing (-) is the last of the swap chain: its backward comes first, so "
              "its tensors stay on the device")


def _model_and_samples(args: argparse.Namespace) -> tuple[torch.nn.Module, Callable[[int], Any], str]:
    """The model on ``meta``, the sample one step runs (token ids) at a given sequence length, and a
    line describing them."""
    import torch

    dtype = getattr(torch, args.dtype)
    shape = f"batch {args.batch} x seq {args.seq}, {args.dtype}"

    def ids(length: int) -> torch.Tensor:
        return torch.zeros(args.batch, length, dtype=torch.long, device="meta")

    if args.model is not None:
        model = _model_from_entry_point(args.model, dtype)
        return model, lambda length: lambda model: _loss_of(model(ids(length))), f"{args.model}, {shape}"
    config = _load_config(args)
    model = _build_on_meta(config, dtype, "--preset" if args.preset is not None else "--config")
    described = f"{config.model_type}, {getattr(config, 'num_hidden_layers', '?')} layers, {shape}"
    return model, lambda length: {"input_ids": ids(length), "labels": ids(length)}, described


def _estimates(args: argparse.Namespace, model: torch.nn.Module, sample_at: Callable[[int], Any],
               head: str = "off") -> list[Any]:
    """The estimate at ``--seq``; with ``--max-seq-len``, fitted from ``--seq`` and half of it to each
    length bucket's bound, the last that length, as ``apply(mode="auto", max_seq_len=)`` plans
    (:mod:`hyperac.planner.lengths`); the head and the loss as ``head`` says."""
    from . import api
    from .planner.lengths import bucket_bounds, fitted_estimates

    swap_options = {} if args.min_swap_bytes is None else {"min_swap_bytes": args.min_swap_bytes}

    def estimate_at(length: int, timed: bool = True) -> Any:  # on meta nothing is timed
        return api.estimate(model, sample_at(length), backend="cpu", device_profile=args.device, head=head,
                            **swap_options)

    if args.max_seq_len is None:
        return [estimate_at(args.seq)]
    return fitted_estimates(estimate_at, args.seq, bucket_bounds(args.max_seq_len, args.length_buckets))


def _plan_layers(model: torch.nn.Module, modes: list[str], swaps: list[bool]) -> tuple[Any, ...]:
    """The plan's :class:`~hyperac.LayerPlan` entries, as ``apply`` records them, from
    :func:`~hyperac.planner.auto.resolve_choice`'s modes and swap flags: what the table prints and
    ``--output`` writes."""
    from .discovery import discover_layers
    from .plan import LayerPlan
    from .planner.auto import last_swap

    end = last_swap(swaps)  # the chain's last layer keeps its tensors: apply records it as not swapping
    return tuple(LayerPlan(layer.index, layer.fqn, mode, () if mode in ("off", "swap") else (layer.fqn,), (),
                           swap and i != end, layer.found_by)
                 for i, (layer, mode, swap) in enumerate(zip(discover_layers(model), modes, swaps)))


def _write_plan(path: str, layers: tuple[Any, ...], predictions: dict[str, Any], args: argparse.Namespace,
                buckets: tuple) -> None:
    """``--output``: the plan as :meth:`hyperac.Plan.to_dict` writes it, for ``apply(model, plan=...)``;
    ``predictions``: :func:`~hyperac.planner.auto.resolve_choice`'s."""
    from .plan import Plan

    predictions = dict(predictions)
    notes = (f"planned by hyperac plan for {args.device}", *predictions.pop("notes"))
    shape = None if args.max_seq_len is None else (args.batch, args.max_seq_len)
    plan_ = Plan(backend=args.device, adapter="none", layers=layers, notes=notes, buckets=buckets, batch_shape=shape,
                 seq_dim=None if args.max_seq_len is None else 1, **predictions)
    try:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(plan_.to_dict(), handle, indent=1)
    except OSError as error:
        raise HyperACError(f"--output: cannot write {path!r}: {error.strerror}.") from None


def _as_config(args: argparse.Namespace) -> argparse.Namespace:
    """The options of ``apply(mode="auto")`` that decide how it plans the head, as ``hyperac plan``'s say."""
    return argparse.Namespace(head=None if args.head == "default" else args.head, bitwise=args.head == "off",
                              max_seq_len=args.max_seq_len, compile=False)


def _head_policy(args: argparse.Namespace, model: torch.nn.Module) -> str | None:
    """How the plan weighs the head (NOTE [The head in the plan]), as ``apply(mode="auto")`` with ``head=``
    as ``--head`` says."""
    from .head import head_policy

    return head_policy(_as_config(args), list(model.named_modules()))


def _sees_head(model: torch.nn.Module) -> bool:
    from .head import find_head

    return not isinstance(find_head(list(model.named_modules())), str)


def _unweighed_note(args: argparse.Namespace, model: torch.nn.Module) -> str | None:
    from .head import unweighed_note

    return unweighed_note(_as_config(args), list(model.named_modules()))


def plan(args: argparse.Namespace) -> int:
    """Estimate a model on the meta device and print (and with ``--output`` write) the plan that fits the budget."""
    from .plan import mode_letters
    from .planner import ESTIMATE_MODES, SWAP_OPTIONS, choose_modes
    from .planner.auto import resolve_choice
    from .planner.head import choose_head, head_note
    from .planner.lengths import bucket_bounds, length_buckets

    host_budget = _host_budget_bytes(args)
    model, sample_at, described = _model_and_samples(args)
    print(f"estimating {described}, on the meta device, costed on {args.device}...", file=sys.stderr, flush=True)
    policy = _head_policy(args, model)
    # Not weighed (--max-seq-len): the head as --head says, as apply(mode="auto", max_seq_len=) plans it.
    fixed = "chunked" if policy is None and args.head == "chunked" and _sees_head(model) else "off"
    by_lengths = {fixed: _estimates(args, model, sample_at, fixed)}
    count = len(by_lengths[fixed][-1].layers)
    off = by_lengths[fixed][-1].peak_bytes(["off"] * count)
    budget_bytes = parse_budget(args.budget, off)
    options = ESTIMATE_MODES if host_budget is None else ESTIMATE_MODES + SWAP_OPTIONS
    by_head = {fixed: by_lengths[fixed][-1]}

    def estimate_of(h: str) -> Any:
        if h not in by_lengths:
            by_lengths[h] = _estimates(args, model, sample_at, h)
        return by_lengths[h][-1]

    if policy is not None:  # NOTE [The head in the plan]
        head, by_head, modes, _ = choose_head(policy, estimate_of, budget_bytes, options, host_budget)
    else:
        head, modes = fixed, choose_modes(by_head[fixed], budget_bytes, options, host_budget_bytes=host_budget)
    estimates, estimate = by_lengths[head], by_head[head]
    resolved = resolve_choice(estimate, modes, budget_bytes, args.max_seq_len)
    resolved[2]["head"] = head
    unweighed = _unweighed_note(args, model)
    if unweighed is not None:
        resolved[2]["notes"] = [*resolved[2]["notes"], unweighed]
    buckets = () if args.max_seq_len is None else length_buckets(
        bucket_bounds(args.max_seq_len, args.length_buckets), estimates, modes, resolved[0], budget_bytes)
    layers = _plan_layers(model, resolved[0], resolved[1])
    if args.output is not None:
        _write_plan(args.output, layers, resolved[2], args, buckets)
    print(estimate)
    length = "" if args.max_seq_len is None else (
        f", for batches up to sequence length {args.max_seq_len} (costs fitted from lengths {max(args.seq // 2, 1)} "
        f"and {args.seq})")
    print(f"\nplan for a budget of {budget_bytes / 2**30:.2f} GiB{length}:")
    why_not = "--no-swap" if args.no_swap else "the cpu profile has no host link"
    _print_plan(estimate, modes, layers, host_budget, why_not)
    print(f"predicted: peak {estimate.peak_bytes(modes) / 2**30:.2f} GiB (no recompute: {off / 2**30:.2f} GiB), "
          f"{estimate.total_bytes(modes) / 2**30:.2f} GiB kept for backward, step "
          f"{estimate.step_seconds(modes) * 1e3:.1f} ms on {args.device} (no recompute: "
          f"{estimate.step_seconds(['off'] * count) * 1e3:.1f} ms), {estimate.total_recompute_flops(modes) / 1e12:.2f}"
          f" TFLOP replayed ({100 * estimate.total_recompute_flops(modes) / estimate.base_flops:.1f}% of the step)")
    for bucket in buckets:
        print(f"  batches up to {bucket.max_len}: {mode_letters(bucket.modes)}, peak "
              f"{bucket.predicted_peak_bytes / 2**30:.2f} GiB, step {bucket.predicted_step_seconds * 1e3:.1f} ms")
    if "chunked" in by_head and "off" in by_head:
        print(f"head: {head}; {head_note(by_head)}")
    elif unweighed is not None:
        print(f"head: {head}; {unweighed}")
    elif head == "chunked":
        print("head: chunked, as --head says (every length profiled with it chunked; plans per length bucket do not "
              "weigh it against the head as the model computes it)")
    if args.output is not None:
        print(f"wrote the plan to {args.output}: hyperac.apply(model, plan=json.load(open({args.output!r})))")
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


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Help that shows each option's default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _run_demo(args: argparse.Namespace) -> int:
    from . import demo

    return demo.run(args)


def _preset(text: str) -> str:
    """``--preset``: a known name (checked at parse time, before torch and transformers are imported)."""
    if text not in PRESETS:
        raise argparse.ArgumentTypeError(f"unknown preset {text!r}; choose one of {', '.join(sorted(PRESETS))}")
    return text


def _entry_point(text: str) -> str:
    """``--model``: ``module:factory`` (checked for its shape here, imported when the plan runs)."""
    module, colon, attribute = text.partition(":")
    if not (colon and module and attribute.isidentifier()):
        raise argparse.ArgumentTypeError(f"must be module:factory, e.g. mypackage.models:build_model, got {text!r}")
    return text


def _output_path(text: str) -> str:
    """``--output``: a file in a folder that exists (checked before the estimate runs)."""
    import os

    folder = os.path.dirname(text) or "."
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"folder {folder!r} does not exist, got {text!r}")
    return text


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hyperac", description="Activation recompute for PyTorch training.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    demo_parser = commands.add_parser("demo", help="compare the modes on a built-in tiny Llama",
                                      formatter_class=_Help)
    demo_parser.add_argument("--rounds", type=_positive_int, default=20,
                             help="timed rounds, each one timed training step (after an untimed one) of every "
                                  "configuration in a shuffled order")
    demo_parser.add_argument("--layers", type=_positive_int, default=4, help="decoder layers of the tiny Llama")
    demo_parser.add_argument("--hidden", type=_positive_int, default=128, help="hidden size, a multiple of 8")
    demo_parser.add_argument("--seq", type=_positive_int, default=128, help="sequence length of each training batch")
    demo_parser.add_argument("--batch", type=_positive_int, default=2, help="sequences per training batch")
    demo_parser.add_argument("--plot", metavar="FILE.png", action=_PlotAvailable,
                             help="also draw measured step time against measured peak memory (needs matplotlib: "
                                  "pip install 'hyperac[plot]')")
    demo_parser.set_defaults(run=_run_demo)
    plan_parser = commands.add_parser("plan", help="estimate a model geometry and print the plan for a budget",
                                      formatter_class=_Help)
    source = plan_parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", metavar="CONFIG.json",
                        help="a local HF config.json (builds the architecture it names, else a causal LM)")
    source.add_argument("--preset", type=_preset, help=f"one of: {', '.join(sorted(PRESETS))}")
    source.add_argument("--model", metavar="MODULE:FACTORY", type=_entry_point,
                        help="a Python entry point: FACTORY() returns an nn.Module taking token ids (plain PyTorch, "
                             "torchtitan); it is called on the meta device")
    plan_parser.add_argument("--seq", type=_positive_int, default=4096, help="sequence length")
    plan_parser.add_argument("--max-seq-len", type=_positive_int, metavar="L",
                             help="plan for batches up to this sequence length, as max_seq_len= in the API: the step "
                                  "is estimated at --seq and half of it and the costs fitted to L (the ids are "
                                  "(batch, seq): the sequence dimension is 1); with --output the plan holds one "
                                  "plan per length bucket, as apply makes")
    plan_parser.add_argument("--length-buckets", type=_positive_int, default=4, metavar="N",
                             help="with --max-seq-len: how many length buckets get a plan each (bounds evenly spaced "
                                  "up to L), as length_buckets= in the API")
    plan_parser.add_argument("--batch", type=_positive_int, default=1, help="batch size")
    plan_parser.add_argument("--budget", required=True, type=_budget,
                             help="peak activation memory: bytes, a size like 24GiB, or a fraction like 0.5 of the "
                                  "no-recompute peak (as budget= in the API)")
    plan_parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                             help="dtype of the parameters and activations")
    plan_parser.add_argument("--device", default="h100", choices=(*DEVICE_PROFILES, "cpu"),
                             help="device profile that costs the step (data-sheet peaks; cpu: measured here); on the "
                             "accelerators the plan may swap layers to host memory over the profile's host link")
    plan_parser.add_argument("--host-budget", type=_size, metavar="SIZE",
                             help="pinned host memory the plan's swaps may hold, e.g. 64GiB (default: what apply "
                                  "would use on this machine, half its physical memory divided by LOCAL_WORLD_SIZE)")
    plan_parser.add_argument("--min-swap-bytes", type=_byte_count, metavar="SIZE",
                             help="storages smaller than this stay on the device, as min_swap_bytes= in the API "
                                  "(default 1MiB; 0 lets every saved tensor go)")
    plan_parser.add_argument("--no-swap", action="store_true", help="plan recompute only, no swap to host memory")
    plan_parser.add_argument("--head", choices=("default", "auto", "off", "chunked"), default="default",
                             help="the LM head and its loss, as head= in the API: default chunks them (recomputed "
                                  "in backward) only where no plan fits otherwise, auto weighs both by time, off "
                                  "keeps them as the model computes them (results bitwise), chunked always")
    plan_parser.add_argument("--output", metavar="PLAN.json", type=_output_path,
                             help="also write the plan as JSON, for hyperac.apply(model, plan=json.load(...))")
    plan_parser.set_defaults(run=plan)
    return parser


_VALUE_OPTIONS = ("--budget", "--host-budget", "--min-swap-bytes", "--seq", "--max-seq-len", "--batch", "--rounds",
                  "--layers", "--hidden")


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
