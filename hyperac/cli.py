"""The ``hyperac`` command line.

``hyperac demo`` trains a built-in tiny Llama-style model (built from a config, nothing
downloaded) for a few steps under each mode and prints one table: activation memory kept for
backward, the extra FLOPs spent recomputing, step time, and whether loss and gradients match the
model without hyperac.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from . import api
from .errors import HyperACError
from .measure import measure_step

MODES = ("off", "full", "selective")


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
        api.apply(model, mode=mode, backend="cpu")
        torch.manual_seed(1)
        activation_bytes, flops = measure_step(model, lambda m: m(input_ids=ids, labels=ids).loss)
        matches = _same(reference, _step(model, ids))
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            _step(model, ids)
            times.append(time.perf_counter() - start)
        api.remove(model)
        rows.append((mode, activation_bytes, flops, statistics.median(times), matches))
    off_flops = rows[0][2]
    print(f"\nhyperac demo: tiny Llama, {args.layers} layers, hidden {args.hidden}, "
          f"batch {args.batch} x seq {args.seq}")
    print(f"{'mode':<10} {'activations MiB':>16} {'recompute FLOPs':>16} {'step ms':>9}  loss+grads == off")
    for mode, activation_bytes, flops, seconds, matches in rows:
        overhead = 100.0 * (flops - off_flops) / off_flops
        print(f"{mode:<10} {activation_bytes / 2**20:>16.2f} {overhead:>15.1f}% {seconds * 1e3:>9.1f}  "
              f"{'yes' if matches else 'NO'}")
    return 0 if all(row[4] for row in rows) else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hyperac", description="Activation recompute for PyTorch training.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="compare the modes on a built-in tiny Llama")
    demo_parser.add_argument("--steps", type=int, default=3, help="timed training steps per mode")
    demo_parser.add_argument("--layers", type=int, default=4)
    demo_parser.add_argument("--hidden", type=int, default=128)
    demo_parser.add_argument("--seq", type=int, default=128)
    demo_parser.add_argument("--batch", type=int, default=2)
    demo_parser.set_defaults(run=demo)
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
