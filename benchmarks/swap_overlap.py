"""Swap on a GPU: does moving the kept layer inputs to host memory cost step time, and how does it
compare with the offloading peers? One ~1B-parameter Llama, all configurations in one process.

Configurations (each a copy of one seeded model, alone on the device while it runs):

* ``none``           no recompute;
* ``full``           ``hyperac.apply(model, mode="full")``;
* ``full+swap``      ``hyperac.apply(model, mode="full", swap_inputs=True)``: the layer inputs the
                     recompute keeps live in host memory (copies on a side stream);
* ``hf-offload``     HF ``model.activation_checkpointing_enable(offload=True)`` (recompute, inputs
                     held on the host with ``save_on_cpu`` on the compute stream);
* ``torch-offload``  ``offload_wrapper(checkpoint_wrapper(layer))`` per decoder layer
                     (``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``);
* ``swap``           ``hyperac.apply(model, mode="swap")``: no recompute, every layer's saved
                     tensors live in host memory (run last).

Per configuration: step time (forward + backward, median of ``--steps`` after ``--warmup``, with a
device synchronize around each step), peak device memory (``max_memory_allocated`` after a reset,
per step), device memory alive between forward and backward (``memory_allocated`` right after
forward), and loss and per-parameter gradient norms against ``none``.

Targets (PASS/FAIL each; the exit status is non-zero when one fails):

* full+swap step time / full step time <= 1.03 (the copies overlap compute);
* fraction of layer-input bytes freed by swap_inputs >= 0.90: the drop in memory alive after
  forward from full to full+swap, over (layers - 1) x batch x seq x hidden x dtype bytes (the
  model's last layer keeps its input: its backward comes first);
* hf-offload step time / full+swap step time >= 1.2, at an equal or lower peak for full+swap;
* loss and gradients match ``none`` (bf16: within tolerance).

    python benchmarks/swap_overlap.py                                   # H200: ~1B Llama, bf16, seq 4096
    python benchmarks/swap_overlap.py --device cpu --backend sim --quick  # CPU dry run, tiny model

On CPU there are no device statistics: memory alive after forward comes from
``hyperac.measure.ActivationMeter`` (one extra measured step), peak memory is not reported, and
the step-time targets are printed for information only (the ``sim`` backend's copies are not
asynchronous, so times there say nothing about overlap).
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import hyperac
from hyperac.measure import ActivationMeter

TARGET_SWAP_TIME = 1.03  # full+swap / full step time, at most
TARGET_FREED = 0.90  # fraction of the analytic layer-input bytes freed by swap_inputs, at least
TARGET_HF_SPEEDUP = 1.2  # hf-offload / full+swap step time, at least
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


# --------------------------------------------------------------------------------------------
# Configurations


def apply_hf_offload(model: nn.Module) -> str:
    """HF activation checkpointing with ``offload=True``: ``activation_checkpointing_enable``
    (transformers 5.24), or ``gradient_checkpointing_enable``, its name before the rename, which
    takes the same ``offload`` argument in earlier 5.x releases.

    Emulated the way transformers implements it (``save_on_cpu(pin_memory=True)`` around each
    layer's ``checkpoint``) where neither method takes ``offload``, and on a CPU-only torch, where
    transformers' own call asks for pinned memory that cannot be allocated (the emulation then
    holds unpinned host copies).
    """
    name = "activation_checkpointing_enable"
    if not hasattr(model, name):
        name = "gradient_checkpointing_enable"
    enable = getattr(model, name)
    has_offload = "offload" in inspect.signature(enable).parameters
    device_type = next(model.parameters()).device.type
    pinnable = device_type != "cpu" or torch.cuda.is_available()
    if has_offload and pinnable:
        enable(offload=True)
        return f"model.{name}(offload=True)"
    import functools

    from torch.autograd.graph import save_on_cpu
    from torch.utils.checkpoint import checkpoint

    def checkpoint_func(function: Any, *args: Any, **kwargs: Any) -> Any:
        with save_on_cpu(pin_memory=pinnable, device_type=device_type):
            return checkpoint(function, *args, **kwargs)

    enable()  # use_reentrant=False by default in transformers 5
    replaced = 0
    for module in model.modules():
        if getattr(module, "gradient_checkpointing", False) and hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = functools.partial(checkpoint_func, use_reentrant=False)
            replaced += 1
    if not replaced:
        raise RuntimeError(f"could not emulate HF offload=True: no module has gradient_checkpointing set by {name}")
    why = (f"model.{name} has no offload= argument" if not has_offload
           else "CPU-only torch: transformers' offload=True asks for pinned memory, none can be allocated")
    return (f"EMULATED ({why}): model.{name}() + save_on_cpu(pin_memory={pinnable}) around each layer's "
            f"checkpoint, as transformers does for offload=True (set on {replaced} modules)")


def apply_torch_offload(model: nn.Module) -> str:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper

    layers = model.model.layers
    for i in range(len(layers)):
        layers[i] = offload_wrapper(checkpoint_wrapper(layers[i]))
    return f"model.model.layers[i] = offload_wrapper(checkpoint_wrapper(layers[i])) for {len(layers)} layers"


def configurations(args: argparse.Namespace) -> dict[str, Callable[[nn.Module], str]]:
    extra: dict[str, Any] = {"backend": args.backend}
    if args.min_swap_bytes is not None:
        extra["min_swap_bytes"] = args.min_swap_bytes

    def hyperac_setup(**options: Any) -> Callable[[nn.Module], str]:
        def setup(model: nn.Module) -> str:
            plan = hyperac.apply(model, **options, **extra)
            swaps = sum(1 for layer in plan.layers if layer.swap)
            return f"hyperac.apply({', '.join(f'{k}={v!r}' for k, v in {**options, **extra}.items())}); " \
                   f"{len(plan.layers)} layers, {swaps} offloading" + (f"; notes: {plan.notes}" if plan.notes else "")
        return setup

    # Run order; ``swap`` last: its first step pins the most host memory, and if the run is cut
    # short the comparisons the targets need are already done (results are saved after each).
    return {
        "none": lambda model: "no recompute",
        "full": hyperac_setup(mode="full"),
        "full+swap": hyperac_setup(mode="full", swap_inputs=True),
        "hf-offload": apply_hf_offload,
        "torch-offload": apply_torch_offload,
        "swap": hyperac_setup(mode="swap"),
    }


# --------------------------------------------------------------------------------------------
# Model and steps


def build_base(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """The seeded base model, built on ``device`` (fast init), cast, and parked in host memory."""
    from recompute_modes import geometry
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**geometry(args), use_cache=False)
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = LlamaForCausalLM(config)
    model = model.to(dtype)
    model.train()
    # Only the configuration under test holds device memory: the base waits in host memory.
    return model.to("cpu")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_step(model: nn.Module, ids: torch.Tensor, device: torch.device, meter: bool = False) -> dict[str, Any]:
    """One forward + backward; device memory statistics where the device has them."""
    cuda = device.type == "cuda"
    model.zero_grad(set_to_none=True)
    synchronize(device)
    start_bytes = None
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        start_bytes = torch.cuda.memory_allocated(device)
    begin = time.perf_counter()
    if meter:
        with ActivationMeter() as activation_meter:
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            after_forward = activation_meter.mark_backward()
            loss.backward()
    else:
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        after_forward = torch.cuda.memory_allocated(device) if cuda else None
        loss.backward()
    synchronize(device)
    elapsed = time.perf_counter() - begin
    return dict(
        time=elapsed,
        loss=loss.detach().float().item(),
        after_forward=after_forward,
        peak=torch.cuda.max_memory_allocated(device) if cuda else None,
        start=start_bytes,
    )


def grad_norms(model: nn.Module) -> dict[str, float]:
    """Per-parameter gradient norms, by name without wrapper segments."""
    names, norms = [], []
    for name, param in model.named_parameters():
        if param.grad is not None:
            names.append(name.replace("._checkpoint_wrapped_module", ""))
            norms.append(param.grad.detach().float().norm())
    values = torch.stack(norms).cpu().tolist() if norms else []
    return dict(zip(names, values))


def swap_stats_dict(model: nn.Module, steps: int) -> dict[str, Any] | None:
    stats = hyperac.swap_stats(model)
    if stats is None:
        return None
    return dict(
        text=str(stats),
        steps=steps,
        offloaded_bytes=stats.offloaded_bytes,
        reloaded_bytes=stats.reloaded_bytes,
        offloaded_tensors=stats.offloaded_tensors,
        skipped=dict(stats.skipped),
        waits=stats.waits,
        wait_seconds=stats.wait_seconds,
    )


def run_config(
    name: str, setup: Callable[[nn.Module], str], base: nn.Module, ids: torch.Tensor,
    device: torch.device, args: argparse.Namespace,
) -> dict[str, Any]:
    result: dict[str, Any] = dict(name=name)
    began = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = copy.deepcopy(base).to(device)
        model.train()
        result["how"] = setup(model)
        steps: list[dict[str, Any]] = []
        measured = None
        if device.type != "cuda":
            # No device statistics: one extra step under the ActivationMeter gives the bytes alive
            # after forward (it slows the step, so it is not timed).
            measured = run_step(model, ids, device, meter=True)
        for i in range(args.warmup + args.steps):
            stats = hyperac.swap_stats(model)
            if i == args.warmup and stats is not None:  # count the timed steps only
                timed_waits = stats.wait_seconds is not None
                stats.reset()
                if timed_waits:  # SwapStats.reset() sets wait_seconds to None ("cannot time")
                    stats.wait_seconds = 0.0
            step = run_step(model, ids, device)
            if i >= args.warmup:
                steps.append(step)
    messages = {f"{w.category.__name__}: {w.message}": "hyperac" in (w.category.__module__ or "")
                or "hyperac" in str(w.message).lower() for w in caught}
    notes = sorted(m for m, ours in messages.items() if ours)
    others = sorted(m for m, ours in messages.items() if not ours)
    times = [s["time"] for s in steps]
    result.update(
        time=statistics.median(times),
        times=times,
        loss=(measured or steps[0])["loss"],
        losses=[s["loss"] for s in steps],
        after_forward=(measured["after_forward"] if measured is not None
                       else statistics.median(s["after_forward"] for s in steps)),
        peak=max(s["peak"] for s in steps) if device.type == "cuda" else None,
        start=min(s["start"] for s in steps) if device.type == "cuda" else None,
        grad_norms=grad_norms(model),
        swap=swap_stats_dict(model, len(steps)),
        warnings=notes,
        other_warnings=others,
    )
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    result["wall"] = time.perf_counter() - began
    return result


# --------------------------------------------------------------------------------------------
# Report


def mib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.1f}"


def parity(result: dict[str, Any], ref: dict[str, Any], loss_rtol: float, grad_rtol: float) -> dict[str, Any]:
    loss_diff = abs(result["loss"] - ref["loss"])
    loss_ok = loss_diff <= loss_rtol * max(1.0, abs(ref["loss"]))
    a, b = result["grad_norms"], ref["grad_norms"]
    if a.keys() != b.keys():
        grad_diff = float("inf")
    else:
        grad_diff = max((abs(a[n] - b[n]) / max(abs(b[n]), 1e-12) for n in b), default=0.0)
    grad_ok = grad_diff <= grad_rtol
    steady = max(result["losses"]) - min(result["losses"]) <= loss_rtol * max(1.0, abs(ref["loss"]))
    return dict(loss_diff=loss_diff, bitwise=result["loss"] == ref["loss"], grad_rel_diff=grad_diff,
                steady=steady, ok=bool(loss_ok and grad_ok and steady))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--backend", default=None, help="hyperac backend: cuda, sim or cpu (default: --device)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default bf16 (fp32 with --quick)")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per configuration (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--min-swap-bytes", type=int, default=None,
                        help="hyperac min_swap_bytes (default: hyperac's, 1 MiB; 0 with --quick)")
    parser.add_argument("--configs", default=None,
                        help="comma-separated subset of: none,full,full+swap,swap,hf-offload,torch-offload")
    parser.add_argument("--peak-slack-mib", type=float, default=0.0,
                        help="full+swap peak may exceed hf-offload's by this much and still pass (default 0)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--json", default=None,
                        help="write results here (default: $OUT/swap_overlap.json if OUT is set, else nowhere)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny dry-run model: hidden 128, 4 layers, seq 128, fp32, 1 warm-up + 3 timed steps")
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads = 128, 512, 4, 4, 2
        args.vocab, args.seq = 1024, 128
        args.warmup, args.steps = 1, 3
        args.dtype = args.dtype or "fp32"
        if args.min_swap_bytes is None:
            args.min_swap_bytes = 0  # the tiny model's tensors are all below hyperac's 1 MiB default
    args.dtype = args.dtype or "bf16"
    args.backend = args.backend or args.device
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        print("--device cuda, but torch sees no CUDA device (torch.cuda.is_available() is False)")
        return 2
    began = time.perf_counter()

    import transformers

    gpu = torch.cuda.get_device_name(device) if cuda else "none"
    print(
        f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}, "
        f"hyperac {hyperac.__version__}, python {sys.version.split()[0]}, device {device} ({gpu}), "
        f"hyperac backend {args.backend!r}"
    )
    base = build_base(args, device, dtype)
    params = sum(p.numel() for p in base.parameters())
    itemsize = torch.empty(0, dtype=dtype).element_size()
    layer_input_bytes = args.batch * args.seq * args.hidden * itemsize
    analytic = (args.layers - 1) * layer_input_bytes
    print(
        f"model: LlamaForCausalLM {params / 1e9:.3f} B params, {args.dtype}, hidden {args.hidden}, intermediate "
        f"{args.intermediate}, {args.layers} layers, heads {args.heads}/{args.kv_heads}, vocab {args.vocab}, seq "
        f"{args.seq}, batch {args.batch}, sdpa, random ids (seed {args.seed}); "
        f"built in {time.perf_counter() - began:.1f} s"
    )
    print(f"steps: {args.warmup} warm-up + {args.steps} timed per configuration; min_swap_bytes "
          f"{'hyperac default' if args.min_swap_bytes is None else args.min_swap_bytes}\n")

    generator = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator).to(device)

    setups = configurations(args)
    if args.configs:
        wanted = [c.strip() for c in args.configs.split(",") if c.strip()]
        unknown = [c for c in wanted if c not in setups]
        if unknown:
            parser.error(f"unknown --configs {unknown}; choose from {list(setups)}")
        setups = {name: setups[name] for name in setups if name in wanted}

    path = args.json or (os.path.join(os.environ["OUT"], "swap_overlap.json") if os.environ.get("OUT") else None)
    meta = dict(
        args=vars(args), torch=torch.__version__, cuda=torch.version.cuda, transformers=transformers.__version__,
        hyperac=hyperac.__version__, device=str(device), gpu=gpu, params=params,
        layer_input_bytes=layer_input_bytes, analytic_freed_bytes=analytic,
    )

    def save(payload: dict[str, Any]) -> None:
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w") as f:
                json.dump({**meta, **payload}, f, indent=1, default=str)

    results: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    for name, setup in setups.items():
        try:
            results[name] = run_config(name, setup, base, ids, device, args)
            r = results[name]
            print(f"[{name}] {r['how']}")
            print(f"    step {r['time'] * 1e3:.1f} ms (median), peak {mib(r['peak'])} MiB, after forward "
                  f"{mib(r['after_forward'])} MiB, loss {r['loss']:.5f}; {r['wall']:.1f} s with setup", flush=True)
            for note in r["warnings"]:
                print(f"    warning: {note}")
            for note in r["other_warnings"][:3]:
                print(f"    other warning: {note[:300]}")
        except Exception as error:  # one failing peer must not lose the other numbers
            errors[name] = f"{type(error).__name__}: {error}"
            print(f"[{name}] FAILED: {errors[name]}")
            traceback.print_exc()
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
        save(dict(results=results, errors=errors, complete=False))
    print()

    # ---- table
    ref = results.get("none")
    loss_rtol, grad_rtol = (1e-3, 2e-2) if dtype != torch.float32 else (1e-6, 1e-4)
    header = (f"{'config':<14} {'step ms':>9} {'vs none':>8} {'peak MiB':>9} {'peak-start':>10} "
              f"{'after-fwd MiB':>13} {'loss':>10} {'|dloss|':>9} {'grad rel':>9}")
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        r["parity"] = parity(r, ref, loss_rtol, grad_rtol) if ref is not None else None
        p = r["parity"]
        vs = f"{r['time'] / ref['time']:.3f}x" if ref is not None else "n/a"
        over = None if r["peak"] is None else r["peak"] - r["start"]
        print(f"{name:<14} {r['time'] * 1e3:>9.1f} {vs:>8} {mib(r['peak']):>9} {mib(over):>10} "
              f"{mib(r['after_forward']):>13} {r['loss']:>10.5f} "
              f"{(p['loss_diff'] if p else float('nan')):>9.2e} {(p['grad_rel_diff'] if p else float('nan')):>9.2e}")
    for name, error in errors.items():
        print(f"{name:<14} FAILED: {error}")
    memory_source = ("torch.cuda.memory_allocated right after forward" if cuda
                     else "hyperac.measure.ActivationMeter (forward storages alive at backward)")
    print(f"(step ms: median of {args.steps} after {args.warmup} warm-up; peak: max_memory_allocated per step, "
          f"'peak-start' over the step's starting allocation; after-fwd: {memory_source}; grad rel: max over "
          f"parameters of the relative difference of gradient norms vs none)\n")

    for name, r in results.items():
        if r["swap"] is not None:
            s = r["swap"]
            print(f"hyperac.swap_stats, {name} ({s['steps']} timed steps): {s['text']}")
            print(f"    per step: offloaded {mib(s['offloaded_bytes'] / s['steps'])} MiB, "
                  f"reloaded {mib(s['reloaded_bytes'] / s['steps'])} MiB")
    print()

    # ---- targets
    checks: list[dict[str, Any]] = []

    def check(label: str, value: float | None, op: str, target: float, enforced: bool, detail: str = "") -> None:
        if value is None:
            ok = False
            shown = "n/a (configuration missing)"
        else:
            ok = value <= target + 1e-12 if op == "<=" else value >= target - 1e-12
            shown = f"{value:.3f}"
        verdict = ("PASS" if ok else "FAIL") if enforced else f"info ({'would pass' if ok else 'would fail'})"
        checks.append(dict(label=label, value=value, op=op, target=target, ok=ok, enforced=enforced, detail=detail))
        print(f"  {label:<58} {shown:>10}  target {op} {target:g}  {verdict}" + (f"   [{detail}]" if detail else ""))

    def get(name: str, key: str) -> Any:
        return results[name][key] if name in results else None

    timing_enforced = cuda  # sim copies are not asynchronous: CPU times say nothing about overlap
    print("targets" + ("" if cuda else " (CPU dry run: step-time and peak targets are information only)") + ":")
    full_t, swap_t, hf_t = get("full", "time"), get("full+swap", "time"), get("hf-offload", "time")
    check("step time full+swap / full", swap_t / full_t if full_t and swap_t else None, "<=", TARGET_SWAP_TIME,
          timing_enforced)
    full_m, swap_m = get("full", "after_forward"), get("full+swap", "after_forward")
    freed = (full_m - swap_m) / analytic if full_m is not None and swap_m is not None and analytic else None
    check("layer-input bytes freed by swap_inputs (fraction)", freed, ">=", TARGET_FREED, True,
          f"{mib(None if freed is None else full_m - swap_m)} MiB of {mib(analytic)} MiB = "
          f"({args.layers}-1) x {args.batch} x {args.seq} x {args.hidden} x {itemsize} B")
    check("step time hf-offload / full+swap (speed-up)", hf_t / swap_t if hf_t and swap_t else None, ">=",
          TARGET_HF_SPEEDUP, timing_enforced)
    if cuda:
        swap_p, hf_p = get("full+swap", "peak"), get("hf-offload", "peak")
        slack = args.peak_slack_mib * 2**20
        check("peak full+swap / hf-offload", swap_p / hf_p if swap_p and hf_p else None, "<=",
              1.0 + (slack / hf_p if hf_p else 0.0), True,
              f"{mib(swap_p)} vs {mib(hf_p)} MiB, difference {mib(None if not swap_p or not hf_p else swap_p - hf_p)} "
              f"MiB" + (f", slack {args.peak_slack_mib:g} MiB" if slack else ""))
    else:
        hf_m = get("hf-offload", "after_forward")
        check("after-fwd bytes full+swap / hf-offload (peak stand-in)",
              swap_m / hf_m if swap_m is not None and hf_m else None, "<=", 1.0, False,
              "on CPU save_on_cpu's host copies count as alive")
    parity_ok = ref is not None and all(r["parity"]["ok"] for r in results.values())
    bad = [n for n, r in results.items() if r.get("parity") and not r["parity"]["ok"]]
    print(f"  {'loss and gradients match none':<58} {'':>10}  loss rtol {loss_rtol:g}, grad-norm rtol {grad_rtol:g}  "
          f"{'PASS' if parity_ok else 'FAIL'}" + (f"   [mismatch: {', '.join(bad)}]" if bad else ""))
    info = [("step time full / none", get("full", "time"), get("none", "time")),
            ("step time swap / none", get("swap", "time"), get("none", "time")),
            ("step time torch-offload / full+swap", get("torch-offload", "time"), swap_t),
            ("after-fwd bytes swap / none", get("swap", "after_forward"), get("none", "after_forward"))]
    for label, a, b in info:
        if a is not None and b:
            print(f"  {label:<58} {a / b:>10.3f}  (info)")

    enforced = [c for c in checks if c["enforced"]]
    all_ok = not errors and parity_ok and all(c["ok"] for c in enforced)
    total = time.perf_counter() - began
    print(f"\noverall: {'PASS' if all_ok else 'FAIL'} ({sum(c['ok'] for c in enforced)}/{len(enforced)} targets, "
          f"parity {'ok' if parity_ok else 'FAILED'}, {len(errors)} configurations failed); total {total:.1f} s")

    save(dict(results=results, errors=errors, complete=True, checks=checks, parity_ok=parity_ok, overall=all_ok,
              total_seconds=total))
    if path:
        print(f"results written to {path}")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
