"""hyperac's budget planner (``mode="auto"``) side by side with peer recompute setups, on CPU.

For each architecture (a tiny Llama and a tiny MoE by default), one seeded model is deep-copied
per configuration, all in one process:

* peers: ``none`` (no recompute), ``hf-full`` (HF ``activation_checkpointing_enable()``),
  ``hf-every2`` (``activation_checkpointing_enable(every_n_layers=2)``), ``titan-sel`` (the
  torchtitan-style op-level selective policy of ``hyperac.peers``);
* hyperac's uniform modes: ``off``, ``pointwise``, ``selective``, ``full``;
* hyperac's planner under its kept-bytes bound and FLOPs objective
  (``choose_modes(hyperac.estimate(...), B, bound="kept", objective="flops")``, what
  ``mode="auto"`` did before budgets bounded the peak) for each budget ``B`` = a fraction
  {0.25, 0.35, 0.5, 0.65, 0.75, 0.9} of the *measured* no-recompute activation bytes (passed to
  hyperac as a byte count, so hyperac and the peers are held to the same number).

Per configuration, one step through ``hyperac.measure.measure_step``: activation bytes
(``ActivationMeter``) and forward+backward FLOPs (``flop_counter``); recompute overhead = FLOPs
over ``none``'s, as a fraction of ``none``'s. Loss and gradients are compared with ``none``'s.
CPU step time is the median of round-robin steps (info only).

Model-state storages: an ``ActivationMeter`` that records every storage a forward op returns also
counts the parameters behind views such as ``t(weight)`` (every linear) or
``experts.gate_up_proj[e]`` (eager MoE experts): the same bytes in every configuration, but up to
~40% of the raw count for these tiny models. The script checks whether the meter counts such
views; if it does, it measures those bytes once per architecture and subtracts them, so budgets
are fractions of the real no-recompute activation bytes. Whatever the planner counts beyond the
measured no-recompute bytes (``hyperac.estimate``) is added to the budget hyperac is given, so both
sides are held to the same number.

    python benchmarks/peers.py                   # llama and qwen2moe
    python benchmarks/peers.py --arch mixtral    # one architecture (repeatable)
    python benchmarks/peers.py --quick           # fewer timed steps
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import os
import random
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from recompute_modes import fmt_bytes, geometry, timed_step  # noqa: E402

import hyperac  # noqa: E402
from hyperac.errors import ConfigError  # noqa: E402
from hyperac.measure import ActivationMeter, measure_step  # noqa: E402
from hyperac.peers import apply_hf_checkpointing, apply_titan_selective  # noqa: E402
from hyperac.plan import mode_letters  # noqa: E402
from hyperac.planner import choose_modes  # noqa: E402

BUDGETS = (0.25, 0.35, 0.5, 0.65, 0.75, 0.9)
FIT_SLACK = 0.02
PEERS = ("none", "hf-full", "hf-every2", "titan-sel")
HYPERAC_MODES = ("off", "pointwise", "selective", "full")


def moe_kwargs_qwen2(a: argparse.Namespace) -> dict[str, Any]:
    return dict(
        num_experts=a.experts,
        num_experts_per_tok=a.top_k,
        moe_intermediate_size=a.expert_intermediate,
        shared_expert_intermediate_size=a.shared_intermediate,
        decoder_sparse_step=1,
    )


def moe_kwargs_mixtral(a: argparse.Namespace) -> dict[str, Any]:
    # Mixtral's intermediate_size is the size of one expert.
    return dict(num_local_experts=a.experts, num_experts_per_tok=a.top_k, intermediate_size=a.expert_intermediate)


ARCHITECTURES: dict[str, tuple[str, str, Callable[[argparse.Namespace], dict[str, Any]] | None]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", None),
    "qwen2moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", moe_kwargs_qwen2),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", moe_kwargs_mixtral),
}


def build_model(arch: str, a: argparse.Namespace) -> nn.Module:
    import transformers

    config_name, model_name, extra = ARCHITECTURES[arch]
    kwargs: dict[str, Any] = geometry(a)
    if extra is not None:
        kwargs.update(extra(a), experts_implementation=a.experts_impl)
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(a.seed)
    model = getattr(transformers, model_name)(config).float()
    model.train()
    return model


def describe(arch: str, model: nn.Module, a: argparse.Namespace) -> str:
    text = (
        f"{ARCHITECTURES[arch][1]} float32 CPU, hidden {a.hidden}, {a.layers} layers, heads "
        f"{a.heads}/{a.kv_heads}, vocab {a.vocab}, seq {a.seq}, batch {a.batch}, seed {a.seed}, sdpa"
    )
    if ARCHITECTURES[arch][2] is None:
        return text + f", intermediate {a.intermediate}"
    shared = f", shared expert {a.shared_intermediate}" if arch == "qwen2moe" else ""
    impl = getattr(model.config, "_experts_implementation_internal", None) or a.experts_impl
    return text + f", {a.experts} experts top-{a.top_k} of {a.expert_intermediate}{shared}, experts {impl}"


# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
    """One configuration: its model and what one measured step gave."""

    name: str
    model: nn.Module
    modes: tuple[str, ...] | None = None  # hyperac's per-layer modes
    bytes: int = 0
    flops: int = 0
    loss: torch.Tensor | None = None
    grads: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    times: list[float] = dataclasses.field(default_factory=list)

    @property
    def time(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")


class _StateViews(TorchDispatchMode):
    """Records which parameter and buffer storages forward ops return (views such as t(weight))."""

    def __init__(self, state: dict[int, int]) -> None:
        super().__init__()
        self.state = state
        self.seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in self.state:
                self.seen.add(value.untyped_storage().data_ptr())
        return out


def model_state_bytes(model: nn.Module, loss_fn: Callable[[nn.Module], torch.Tensor]) -> int:
    """Bytes of the parameter and buffer storages that ActivationMeter counts as activations: those
    a forward op returns (a view of), since they are alive when backward starts."""
    state = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in [*model.parameters(), *model.buffers()]
        if t.untyped_storage().nbytes()
    }
    views = _StateViews(state)
    with views:
        loss_fn(model)
    return sum(state[ptr] for ptr in views.seen)


def meter_counts_views() -> bool:
    """Whether ActivationMeter counts the storage behind a view of a parameter as an activation."""
    weight = nn.Parameter(torch.ones(64, 64))
    with ActivationMeter() as meter:
        weight.t()
        meter.mark_backward()
    return bool(meter.activation_bytes)


def measure(run: Run, loss_fn: Callable[[nn.Module], torch.Tensor], offset: int) -> None:
    """One step through hyperac.measure.measure_step; keep bytes (less ``offset``, the model-state
    bytes the meter counts), FLOPs, loss and gradients."""
    run.model.zero_grad(set_to_none=True)
    losses = []

    def step(model: nn.Module) -> torch.Tensor:
        loss = loss_fn(model)
        losses.append(loss.detach())
        return loss

    torch.manual_seed(1234)
    run.bytes, run.flops = measure_step(run.model, step)
    run.bytes -= offset
    run.loss = losses[0]
    # Parameter names without wrapper segments, so every configuration compares by the same names.
    run.grads = {
        n.replace("._checkpoint_wrapped_module", ""): p.grad.detach().clone()
        for n, p in run.model.named_parameters()
        if p.grad is not None
    }
    run.model.zero_grad(set_to_none=True)


def parity(run: Run, ref: Run) -> tuple[bool, float]:
    same = run.loss is not None and torch.equal(run.loss, ref.loss)
    if run.grads.keys() != ref.grads.keys():
        return False, float("nan")
    diff = max((g - ref.grads[n]).abs().max().item() for n, g in run.grads.items())
    return same and diff <= 1e-5, diff


def plan_code(modes: tuple[str, ...] | None) -> str:
    return mode_letters(modes) if modes else "-"


# --------------------------------------------------------------------------------------------


def run_arch(arch: str, a: argparse.Namespace) -> tuple[bool, dict[str, Any]]:
    began = time.perf_counter()
    base = build_model(arch, a)
    generator = torch.Generator().manual_seed(a.seed + 1)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=generator)
    sample = {"input_ids": ids, "labels": ids, "use_cache": False}

    def loss_fn(model: nn.Module) -> torch.Tensor:
        return model(**sample).loss

    print(f"\n{'=' * 100}\n{arch}: {describe(arch, base, a)}")
    state_bytes = model_state_bytes(copy.deepcopy(base), loss_fn)
    counted = meter_counts_views()
    offset = state_bytes if counted else 0  # what measure() subtracts

    runs: dict[str, Run] = {}

    def add(name: str, setup: Callable[[nn.Module], Any]) -> Run:
        model = copy.deepcopy(base)
        result = setup(model)
        model.train()
        run = Run(name, model, tuple(layer.mode for layer in result.layers) if hasattr(result, "layers") else None)
        measure(run, loss_fn, offset)
        runs[name] = run
        return run

    add("none", lambda m: None)
    add("hf-full", apply_hf_checkpointing)
    add("hf-every2", lambda m: m.activation_checkpointing_enable(every_n_layers=2))
    add("titan-sel", apply_titan_selective)
    every2 = [i for i, layer in enumerate(runs["hf-every2"].model.model.layers) if layer.gradient_checkpointing]
    for mode in HYPERAC_MODES:
        add(f"hyperac-{mode}", lambda m, mode=mode: hyperac.apply(m, mode=mode, backend="cpu"))
    none = runs["none"]

    # The planner's view: its no-recompute bytes and its floor (every layer in full recompute plus
    # what lives outside the layers). Whatever it counts beyond the measured bytes (model-state
    # storages, if its profiler counts them) is added to the budget it is given.
    est = hyperac.estimate(copy.deepcopy(base), sample, backend="cpu")
    n = len(est.layers)
    planner_extra = est.total_bytes(["off"] * n) - none.bytes
    floor = est.total_bytes(["full"] * n) - planner_extra
    print(f"hf-every2 checkpoints layers {every2}; titan-sel: checkpoint_wrapper(layer, context_fn=SAC policy)")
    print(
        f"model-state storages that forward ops return views of (t(weight), experts.gate_up_proj[e]): "
        f"{fmt_bytes(state_bytes)}; hyperac.measure counts them as activations: {'yes' if counted else 'no'}"
        + (" (subtracted below)" if counted else "")
    )
    print(
        f"hyperac's planner, for no recompute: {planner_extra / 2**20:+.2f} MiB against the measured bytes"
        + (" (added to the budget it is given)" if planner_extra else "")
    )
    print(
        f"no-recompute activation bytes: {fmt_bytes(none.bytes)}; hyperac floor (every layer full + outside the "
        f"layers): {fmt_bytes(floor)} = {floor / none.bytes:.3f} of no-recompute"
    )
    if a.detail:
        print(f"hyperac.estimate (its own counts):\n{est}")

    # hyperac auto, once per budget. Identical plans share one measured model.
    auto: dict[float, dict[str, Any]] = {}
    by_modes = {r.modes: r for r in runs.values() if r.modes is not None}
    for fraction in a.budgets:
        budget = int(fraction * none.bytes)
        model = copy.deepcopy(base)
        start = time.perf_counter()
        try:  # the kept-bytes budget and FLOPs objective this benchmark compares peers on
            modes = tuple(choose_modes(est, budget + planner_extra, bound="kept", objective="flops"))
        except ConfigError as error:
            auto[fraction] = dict(budget=budget, run=None, error=str(error), plan_s=time.perf_counter() - start)
            continue
        predicted = est.total_bytes(modes)
        hyperac.apply(model, layers=dict(enumerate(modes)), backend="cpu")
        run = by_modes.get(modes)
        if run is None:
            model.train()
            run = Run(f"auto@{fraction:g}", model, modes)
            measure(run, loss_fn, offset)
            runs[run.name] = by_modes[modes] = run
        auto[fraction] = dict(budget=budget, run=run, predicted=predicted, plan_s=time.perf_counter() - start)

    # Parity of every measured configuration against no recompute.
    parity_ok = True
    checks = {}
    for name, run in runs.items():
        ok, diff = parity(run, none)
        checks[name] = (ok, diff)
        parity_ok &= ok

    # Step time: round-robin in a fresh random order each round (drift hits all alike).
    order = list(runs)
    shuffle = random.Random(a.seed)
    for step in range(a.warmup + a.steps):
        shuffle.shuffle(order)
        for name in order:
            elapsed = timed_step(runs[name].model, loss_fn)
            if step >= a.warmup:
                runs[name].times.append(elapsed)

    def overhead(run: Run) -> float:
        return (run.flops - none.flops) / none.flops

    header = (
        f"{'config':<18} {'plan':>6} {'act bytes':>11} {'/none':>6} {'GFLOP':>8} {'overhead':>9} "
        f"{'step ms':>8} {'/none':>6}  {'loss==none':>10} {'max|dgrad|':>10}"
    )
    print("\n" + header + "\n" + "-" * len(header))
    for name, run in runs.items():
        ok, diff = checks[name]
        print(
            f"{name:<18} {plan_code(run.modes):>6} {fmt_bytes(run.bytes):>11} {run.bytes / none.bytes:>6.3f} "
            f"{run.flops / 1e9:>8.3f} {overhead(run):>9.1%} {run.time * 1e3:>8.1f} {run.time / none.time:>6.3f}  "
            f"{('yes' if torch.equal(run.loss, none.loss) else 'NO'):>10} {diff:>10.2e}"
        )
    print(
        "(plan: one letter per layer, o=off p=pointwise s=selective e=selective-even F=full; "
        f"overhead = recompute FLOPs / no-recompute FLOPs; step ms: median of {a.steps} round-robin steps "
        f"after {a.warmup} warm-up)"
    )

    # Per budget: hyperac auto against the best peer that fits.
    print(
        f"\n{'budget':>6} {'MiB':>7} {'auto plan':>9} {'auto/budget':>11} {'pred/meas':>9}  "
        f"{'best fitting peer':<17} {'bytes x':>7} {'auto ovh':>8} {'peer ovh':>8} {'ovh x':>6} {'time x':>6}  "
        f"{'(1)':>4} {'(2)':>4}"
    )
    fit_ok = never_worse_ok = True
    losses: list[str] = []  # budgets where a peer beats auto (target 2)
    curve: list[tuple[float, float, float]] = []  # (budget, auto overhead, best-peer overhead)
    for fraction, entry in auto.items():
        budget, run = entry["budget"], entry["run"]
        fitting = [runs[p] for p in PEERS if runs[p].bytes <= budget]
        best = min(fitting, key=lambda r: (r.flops, r.bytes)) if fitting else None
        head = f"{fraction:>6.2f} {budget / 2**20:>7.2f}"
        if run is None:
            ok = best is None
            never_worse_ok &= ok
            if not ok:
                losses.append(f"{fraction:g}: {best.name} fits, hyperac has no plan")
            peer = "none fits" if best is None else f"{best.name} FITS"
            print(
                f"{head} {'infeasible for hyperac (below its floor)':<31}  {peer:<17} "
                f"{'':>7} {'':>8} {'':>8} {'':>6} {'':>6}  {'n/a':>4} {'PASS' if ok else 'FAIL':>4}"
            )
            continue
        fits = run.bytes <= budget * (1 + FIT_SLACK)
        fit_ok &= fits
        predicted = entry["predicted"] - planner_extra
        left = f"{head} {plan_code(run.modes):>9} {run.bytes / budget:>11.3f} {predicted / run.bytes:>9.3f}  "
        if best is None:
            print(
                f"{left}{'no peer fits':<17} {'':>7} {overhead(run):>8.1%} {'':>8} {'':>6} {'':>6}  "
                f"{'PASS' if fits else 'FAIL':>4} {'n/a':>4}"
            )
            continue
        worse = overhead(run) > overhead(best) + 1e-12
        never_worse_ok &= not worse
        if worse:
            losses.append(
                f"{fraction:g}: {best.name} {overhead(best):.1%} in {fmt_bytes(best.bytes)} < auto "
                f"{plan_code(run.modes)} {overhead(run):.1%} in {fmt_bytes(run.bytes)}"
            )
        curve.append((fraction, overhead(run), overhead(best)))
        ratio = overhead(run) / overhead(best) if overhead(best) > 0 else float("nan")
        print(
            f"{left}{best.name:<17} {run.bytes / best.bytes:>7.3f} {overhead(run):>8.1%} {overhead(best):>8.1%} "
            f"{ratio:>6.3f} {run.time / best.time:>6.3f}  {'PASS' if fits else 'FAIL':>4} "
            f"{'FAIL' if worse else 'PASS':>4}"
        )
    print(
        "(bytes x, ovh x, time x: auto / best fitting peer; a peer fits when its measured bytes <= the budget; "
        f"auto fits within +{FIT_SLACK:.0%}; pred/meas: the plan's predicted bytes / measured)"
    )

    # Targets.
    verdicts = {}
    worst = max((e["run"].bytes / e["budget"] for e in auto.values() if e["run"] is not None), default=float("nan"))
    verdicts["(1) every auto plan fits its budget (+2%)"] = (fit_ok, f"worst measured/budget {worst:.3f}")
    verdicts["(2) never worse than the best fitting peer"] = (never_worse_ok, "; ".join(losses))
    if curve:
        mean_auto = statistics.fmean(c[1] for c in curve)
        mean_peer = statistics.fmean(c[2] for c in curve)
        used = ", ".join(f"{c[0]:g}" for c in curve)
        skipped = [f"{f:g}" for f in auto if f not in {c[0] for c in curve}]
        note = (
            f"mean auto {mean_auto:.1%} vs mean best peer {mean_peer:.1%} = {mean_auto / mean_peer:.3f}x "
            f"(target <= 0.5x), over budgets {used}" + (f"; no peer fits {', '.join(skipped)}" if skipped else "")
        )
        verdicts["(3) mean overhead <= half the best-peer mean"] = (mean_auto <= 0.5 * mean_peer + 1e-12, note)
    else:
        verdicts["(3) mean overhead <= half the best-peer mean"] = (True, "no budget has a fitting peer: n/a")
    verdicts["(5) parity: loss bitwise, grads within 1e-5"] = (
        parity_ok,
        "" if parity_ok else "failing: " + ", ".join(n for n, (ok, _) in checks.items() if not ok),
    )
    print(f"\ntargets, {arch}:")
    for label, (ok, note) in verdicts.items():
        print(f"  {label:<46} {'PASS' if ok else 'FAIL'}  {note}")
    print(
        f"  (4) step time vs best fitting peer: info only (column 'time x'); load average now {os.getloadavg()[0]:.2f}"
    )
    plan_s = sum(e["plan_s"] for e in auto.values())
    print(
        f"  {arch} took {time.perf_counter() - began:.1f} s ({plan_s:.1f} s in {len(auto)} "
        "hyperac.apply(mode='auto') calls)"
    )
    return all(ok for ok, _ in verdicts.values()), verdicts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--arch", choices=sorted(ARCHITECTURES), action="append", help="repeatable; default: llama and qwen2moe"
    )
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1024, help="dense MLP (Llama; Qwen2-MoE's dense layers)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-intermediate", type=int, default=512)
    parser.add_argument("--shared-intermediate", type=int, default=512, help="Qwen2-MoE shared expert")
    parser.add_argument(
        "--experts-impl",
        default="eager",
        choices=("eager", "grouped_mm", "batched_mm"),
        help="transformers experts_implementation (default eager: FlopCounterMode does not count "
        "aten._grouped_mm, so with grouped_mm expert FLOPs read as 0)",
    )
    parser.add_argument(
        "--budgets",
        type=lambda s: tuple(float(x) for x in s.split(",")),
        default=BUDGETS,
        help="comma-separated fractions of the measured no-recompute activation bytes",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration (median)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="untimed steps per configuration before timing (the measured step already ran one)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (0: torch's default)")
    parser.add_argument("--quick", action="store_true", help="1 timed step")
    parser.add_argument("--detail", action="store_true", help="print hyperac.estimate's per-layer table")
    a = parser.parse_args()
    archs = a.arch or ["llama", "qwen2moe"]
    if a.quick:
        a.steps = 1
    if a.threads:
        torch.set_num_threads(a.threads)
    warnings.simplefilter("ignore")
    began = time.perf_counter()
    print(
        f"torch {torch.__version__}, hyperac {hyperac.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start"
    )
    print(
        f"budgets (fractions of measured no-recompute activation bytes): {', '.join(f'{b:g}' for b in a.budgets)}; "
        f"peers: {', '.join(PEERS)}"
    )
    results = {arch: run_arch(arch, a) for arch in archs}
    print(f"\n{'=' * 100}\nsummary:")
    for arch, (ok, verdicts) in results.items():
        failed = [label.split(")")[0] + ")" for label, (v, _) in verdicts.items() if not v]
        print(f"  {arch:<10} {'PASS' if ok else 'FAIL'}" + (f" (failed: {' '.join(failed)})" if failed else ""))
    all_ok = all(ok for ok, _ in results.values())
    print(f"overall: {'PASS' if all_ok else 'FAIL'}; total {time.perf_counter() - began:.1f} s")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
