"""hyperac's recompute modes against their peers, on a tiny Llama on CPU, in one process.

Configurations (each a deep copy of one seeded model):

* ``none``          no recompute;
* ``hf-full``       HF ``model.activation_checkpointing_enable()`` (the HF full peer);
* ``titan-sel``     torchtitan's op-level selective policy (``hyperac.peers.apply_titan_selective``:
                    torch's ``create_selective_checkpoint_contexts``, each decoder layer wrapped by
                    ``checkpoint_wrapper(..., context_fn=...)`` as torchtitan does);
* ``hyperac-off``, ``hyperac-full``, ``hyperac-sel``   ``hyperac.apply(model, mode=...)``.

Per configuration: activation bytes (storages created in forward still alive when backward
starts, ``hyperac.measure.ActivationMeter``), FLOPs of forward+backward (``hyperac.measure.
flop_counter``, which counts CPU flash attention) and the recompute overhead over ``none``, and
the median CPU step time (forward+backward, timed round-robin across configurations after
warm-up, so drift hits all alike). It also checks that every configuration's loss (and
gradients) equal the no-recompute ones, and prints, per decoder layer, which ops each selective
policy keeps.

Targets: hyperac full <= 1.00x HF full bytes and FLOPs; hyperac selective <= 1.00x
torchtitan-style bytes and FLOPs. Step time is reported as a ratio only (no target).

    python benchmarks/recompute_modes.py            # hidden 256, 4 layers, seq 256, batch 2
    python benchmarks/recompute_modes.py --quick    # fewer timed steps
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import time
import types
import warnings
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

import hyperac
from hyperac.measure import ActivationMeter, flop_counter
from hyperac.peers import apply_hf_checkpointing, apply_titan_selective, titan_policy, titan_save_list

LossFn = Callable[[nn.Module], torch.Tensor]

ARCHITECTURES = {
    # name: (config class, model class) in transformers; both keep their layers at model.model.layers
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    # Qwen2 has biases on q/k/v: those projections run as aten.addmm, not aten.mm
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
}


def geometry(args: argparse.Namespace) -> dict:
    """Config keyword arguments for a decoder of the sizes given on the command line."""
    return dict(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        vocab_size=args.vocab,
        max_position_embeddings=max(args.seq, 128),
        attn_implementation="sdpa",
    )


def build_model(args: argparse.Namespace) -> nn.Module:
    import transformers

    config_name, model_name = ARCHITECTURES[args.arch]
    config = getattr(transformers, config_name)(**geometry(args))
    torch.manual_seed(args.seed)
    model = getattr(transformers, model_name)(config).float()
    model.train()
    return model


def make_loss_fn(args: argparse.Namespace) -> LossFn:
    generator = torch.Generator().manual_seed(args.seed + 1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    # use_cache=False everywhere: no configuration keeps a KV cache alive into backward.
    return lambda model: model(input_ids=ids, labels=ids, use_cache=False).loss


def measure(model: nn.Module, loss_fn: LossFn) -> dict[str, Any]:
    """One measured step: activation bytes, forward+backward FLOPs (total and per op), the loss
    and the gradients (the measuring modes only observe, so these are the step's real values)."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1234)
    with flop_counter() as flops, ActivationMeter() as meter:
        loss = loss_fn(model)
        meter.mark_backward()
        loss.backward()
    per_op = Counter({str(op): n for op, n in flops.get_flop_counts().get("Global", {}).items()})
    # Parameter names without wrapper segments, so every configuration compares by the same names.
    grads = {
        n.replace("._checkpoint_wrapped_module", ""): p.grad.detach().clone()
        for n, p in model.named_parameters()
        if p.grad is not None
    }
    return dict(
        bytes=int(meter.activation_bytes or 0),
        flops=int(flops.get_total_flops()),
        per_op=per_op,
        loss=loss.detach(),
        grads=grads,
    )


def timed_step(model: nn.Module, loss_fn: LossFn) -> float:
    model.zero_grad(set_to_none=True)
    start = time.perf_counter()
    loss_fn(model).backward()
    return time.perf_counter() - start


# --------------------------------------------------------------------------------------------
# What each selective policy keeps inside one decoder layer, from the layer's real op stream.


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        nbytes = sum(
            t.untyped_storage().nbytes()
            for t in torch.utils._pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor)
        )
        self.ops.append((func, nbytes))
        return out


def layer_op_stream(base: nn.Module, loss_fn: LossFn) -> list[tuple[Any, int]]:
    model = copy.deepcopy(base)
    layer = model.model.layers[0]
    recorder = _OpRecorder()
    original = layer.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with recorder:
            return original(*args, **kwargs)

    layer.forward = forward
    with torch.no_grad():
        loss_fn(model)
    return recorder.ops


def kept_ops(stream: list[tuple[Any, int]]) -> dict[str, list[tuple[str, int]]]:
    """Per selective configuration: the (op, output bytes) a layer keeps, in forward order."""
    from hyperac.backends import get_backend
    from hyperac.policy import SelectivePolicy, resolve_op_sets  # internals, for this report only

    result: dict[str, list[tuple[str, int]]] = {}
    forward_ctx = types.SimpleNamespace(is_recompute=False)
    policy = titan_policy(titan_save_list(), defaultdict(int))
    kept = [(str(f), n) for f, n in stream if policy(forward_ctx, f) == CheckpointPolicy.MUST_SAVE]
    result["titan-sel"] = kept

    ops = resolve_op_sets(get_backend("cpu"))
    # hyperac's recording mode runs its ignored ops (views, FSDP lifecycle) without asking the policy.
    policy = SelectivePolicy(ops)
    kept = [
        (str(f), n)
        for f, n in stream
        if f not in ops.ignored and policy(forward_ctx, f) == CheckpointPolicy.MUST_SAVE
    ]
    result["hyperac-sel"] = kept
    return result


# --------------------------------------------------------------------------------------------


def fmt_bytes(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def ratio_line(label: str, value: float, peer: float, target: float | None) -> tuple[str, bool | None]:
    r = value / peer if peer else float("nan")
    if target is None:
        return f"  {label:<44} {r:>7.3f}x", None
    ok = r <= target + 1e-12
    return f"  {label:<44} {r:>7.3f}x   target <= {target:.2f}x  {'PASS' if ok else 'FAIL'}", ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(ARCHITECTURES), default="llama")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--steps", type=int, default=8, help="timed steps per configuration (median reported)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="3 timed steps, 1 warm-up")
    parser.add_argument("--detail", action="store_true", help="print the recompute FLOPs per op")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.warmup = 3, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    began = time.perf_counter()

    base = build_model(args)
    loss_fn = make_loss_fn(args)
    print(
        f"torch {torch.__version__}, hyperac {hyperac.__version__}, {torch.get_num_threads()} threads, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start"
    )
    print(
        f"model: {ARCHITECTURES[args.arch][1]} float32 CPU, hidden {args.hidden}, "
        f"intermediate {args.intermediate}, {args.layers} layers, heads {args.heads}/{args.kv_heads}, "
        f"vocab {args.vocab}, seq {args.seq}, batch {args.batch}, seed {args.seed}, sdpa"
    )

    setups: dict[str, Callable[[nn.Module], Any]] = {
        "none": lambda m: None,
        "hf-full": apply_hf_checkpointing,
        "titan-sel": apply_titan_selective,
        "hyperac-off": lambda m: hyperac.apply(m, mode="off", backend="cpu"),
        "hyperac-full": lambda m: hyperac.apply(m, mode="full", backend="cpu"),
        "hyperac-sel": lambda m: hyperac.apply(m, mode="selective", backend="cpu"),
    }
    models: dict[str, nn.Module] = {}
    for name, setup in setups.items():
        models[name] = copy.deepcopy(base)
        setup(models[name])
        models[name].train()
    print(
        "hf-full: model.activation_checkpointing_enable(); "
        "titan-sel: checkpoint_wrapper(layer, context_fn=SAC policy) per layer\n"
    )

    # Bytes, FLOPs, and parity of loss and gradients against no recompute.
    results = {name: measure(model, loss_fn) for name, model in models.items()}
    ref = results["none"]
    parity_ok = True
    print(f"{'config':<13} {'loss':>12} {'loss == none':>13} {'max |grad diff|':>16}")
    for name, r in results.items():
        same = torch.equal(r["loss"], ref["loss"])
        same_set = r["grads"].keys() == ref["grads"].keys()
        diff = (
            max((g - ref["grads"][n]).abs().max().item() for n, g in r["grads"].items())
            if same_set
            else float("nan")
        )
        parity_ok &= same and same_set and diff <= 1e-5
        print(f"{name:<13} {r['loss'].item():>12.8f} {('yes' if same else 'NO'):>13} {diff:>16.3e}")
    print(f"parity (loss bitwise equal, grads within 1e-5): {'PASS' if parity_ok else 'FAIL'}\n")

    # Step time: round-robin, in a fresh random order each round so no configuration always
    # runs right after the same other one.
    times: dict[str, list[float]] = {name: [] for name in models}
    order = list(models)
    shuffle = random.Random(args.seed)
    for step in range(args.warmup + args.steps):
        shuffle.shuffle(order)
        for name in order:
            model = models[name]
            elapsed = timed_step(model, loss_fn)
            if step >= args.warmup:
                times[name].append(elapsed)
    for name in models:
        results[name]["time"] = statistics.median(times[name])

    none = results["none"]
    header = (
        f"{'config':<13} {'act bytes':>11} {'vs none':>8} {'GFLOP fwd+bwd':>14} {'recompute GFLOP':>16} "
        f"{'overhead':>9} {'step ms':>9} {'vs none':>8}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        over = r["flops"] - none["flops"]
        size = f"{fmt_bytes(r['bytes']):>11} {r['bytes'] / none['bytes']:>7.3f}x"
        work = f"{r['flops'] / 1e9:>14.4f} {over / 1e9:>16.4f} {over / none['flops']:>8.1%}"
        speed = f"{r['time'] * 1e3:>9.1f} {r['time'] / none['time']:>7.3f}x"
        print(f"{name:<13} {size} {work} {speed}")
    print(
        f"(act bytes: forward-created storages alive when backward starts; step ms: median of {args.steps} "
        f"round-robin steps after {args.warmup} warm-up; load average now {os.getloadavg()[0]:.2f})\n"
    )

    verdicts: list[bool] = []
    lines = []
    pairs = (
        ("hyperac-full", "hf-full", "hyperac full vs HF full"),
        ("hyperac-sel", "titan-sel", "hyperac selective vs torchtitan-style"),
    )
    for ours, peer, title in pairs:
        a, b = results[ours], results[peer]
        lines.append(title + ":")
        for label, value, ref, target in (
            ("activation bytes", a["bytes"], b["bytes"], 1.0),
            ("fwd+bwd FLOPs", a["flops"], b["flops"], 1.0),
            ("recompute FLOPs (over none)", a["flops"] - none["flops"], b["flops"] - none["flops"], None),
            ("step time (info, no target)", a["time"], b["time"], None),
        ):
            text, ok = ratio_line(label, value, ref, target)
            lines.append(text)
            if ok is not None:
                verdicts.append(ok)
    off = results["hyperac-off"]
    lines.append("hyperac off vs none:")
    lines.append(ratio_line("activation bytes", off["bytes"], none["bytes"], None)[0])
    lines.append(ratio_line("fwd+bwd FLOPs", off["flops"], none["flops"], None)[0])
    lines.append(ratio_line("step time (same work: the timing noise)", off["time"], none["time"], None)[0])
    print("\n".join(lines))

    # What the selective policies keep per layer.
    stream = layer_op_stream(base, loss_fn)
    print("\nops kept per decoder layer (forward order; output bytes, layer 0):")
    for name, kept in kept_ops(stream).items():
        total = sum(n for _, n in kept)
        print(f"  {name:<12} {fmt_bytes(total):>10}: " + ", ".join(f"{op} {fmt_bytes(n)}" for op, n in kept))

    if args.detail:
        for name in ("hf-full", "hyperac-full", "titan-sel", "hyperac-sel"):
            extra = results[name]["per_op"] - none["per_op"]
            print(
                f"\nrecompute FLOPs by op, {name}: "
                + ", ".join(f"{op} {n / 1e9:.4f} G" for op, n in extra.most_common())
            )

    all_ok = all(verdicts) and parity_ok
    print(
        f"\noverall: {'PASS' if all_ok else 'FAIL'} ({sum(verdicts)}/{len(verdicts)} targets, parity "
        f"{'ok' if parity_ok else 'FAILED'}); total {time.perf_counter() - began:.1f} s"
    )
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
