"""``hyperac demo``: the modes side by side on a built-in tiny Llama, and, with ``--plot``, the peers.

It trains a tiny Llama-style model (built from a config, nothing downloaded) under each mode,
and under ``auto`` at half the peak activation memory, and prints one table: measured peak
activation memory, the extra FLOPs spent recomputing, step time and its ratio to ``off`` (timed in
interleaved rounds: NOTE [Demo timing]), whether loss and gradients match the model without
hyperac, and auto's chosen plan. ``--plot`` adds auto at other budgets, every-n-layers full plans
and the peers of :mod:`hyperac.peers` (HF's and torchtitan's checkpointing) to the same rounds,
and draws step time against peak memory, the trade-off a user chooses on.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import functools
import random
import statistics
import sys
import time
from typing import Any

import torch

from . import api, peers
from .errors import HyperACError
from .measure import flop_counter, step_peak
from .plan import mode_letters

__all__ = ["run"]

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

# NOTE [Demo timing]
# On a shared CPU the machine's speed drifts by 1.4-1.7x from one step to the next (thread CPU
# time varies as much as wall time): more than the differences between modes, so a median of a
# few steps per mode, one mode after another, cannot rank them. The demo times in rounds: each
# round runs one step of every configuration, in a fresh shuffled order, and the first round is a
# warm-up that is dropped. Each timed step follows an untimed one of the same configuration, so
# it runs with that model's tensors in cache, as in training (the step right after another
# model's pays for a cold cache, and not equally in every mode). Each configuration's step time
# is compared with off's in the same round, and the median of these per-round ratios is what the
# table reports (``x off``). The
# whole demo runs on one thread, so that auto's profile is taken under the conditions the demo
# times; the caller's thread count is restored afterwards.


@dataclasses.dataclass
class _Point:
    """One configuration the demo measures: its model and what was measured of it."""

    model: torch.nn.Module
    kind: str
    """``mode`` (a row of the table), ``auto``, ``every-n`` or ``peer``."""
    plan: str = ""
    """One letter per layer (:data:`hyperac.plan.MODE_LETTERS`), for hyperac's plans other than uniform modes."""
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
    return mode_letters([layer.mode for layer in plan.layers])


def run(args: argparse.Namespace) -> int:
    """Train the tiny model under each mode and print the comparison table (NOTE [Demo timing]).
    ``args``: the ``hyperac demo`` options (layers, hidden, seq, batch, rounds, plot)."""
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
            notes.append(f"auto {budget:.0%}: not drawn: {error}")
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
            notes.append(f"{label}: not drawn: {error}")
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
            _timed_step(points[label].model, ids)  # untimed: the timed step runs with warm caches
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
