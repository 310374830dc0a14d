"""The LM head and its loss: un-chunked, torchtune-style chunked output, and hyperac's chunked head.

One head (hidden x vocabulary, float32 on the CPU) and a next-token loss over one sequence, three ways,
in the same process and on the same tensors:

* ``unchunked``: ``logits = linear(hidden, W)``, upcast, ``cross_entropy`` over every token, as
  transformers' ``ForCausalLMLoss`` does;
* ``torchtune``: torchtune's ``CEWithChunkedOutputLoss`` as its documentation describes it (written
  here from that description, not imported): the model returns its logits as ``num_output_chunks``
  (8) chunks of tokens, and the loss upcasts and reduces each chunk on its own, then divides the sum by
  the count of trained tokens; autograd keeps every chunk's graph until backward;
* ``hyperac``: ``hyperac.head`` (NOTE [The head and the loss in chunks]): per chunk in forward, each
  chunk's logits recomputed in backward (chunk size as ``Config.head_chunk=None`` picks).

Per way and sequence length: the peak of live activation bytes over forward and backward
(``PeakMeter``; the head weight's gradient, which every way ends with, is not counted), the median
step seconds over ``--rounds`` round-robin steps (info only: CPU, shared machine), and the loss and
gradients against ``unchunked`` (max abs difference over max abs value). Targets: hyperac's peak
below both others' at every length, its loss equal to ``unchunked``'s bit for bit, its gradients
within 1e-5 of their scale.

    OMP_NUM_THREADS=1 python benchmarks/head_chunked.py [--vocab 151936] [--hidden 896] [--seq 256 512 1024]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from hyperac.head import DeferredLogits, chunked_causal_loss
from hyperac.measure import PeakMeter

Way = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
TORCHTUNE_CHUNKS = 8


def unchunked(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = F.linear(hidden, weight).float()
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=-100)


def torchtune(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    chunks = [F.linear(part, weight) for part in hidden.chunk(TORCHTUNE_CHUNKS, dim=1)]
    targets = F.pad(labels, (0, 1), value=-100)[..., 1:]
    total = sum(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), part.reshape(-1), reduction="sum",
                                ignore_index=-100)
                for logits, part in zip(chunks, targets.chunk(TORCHTUNE_CHUNKS, dim=1)))
    return total / (targets != -100).sum()


def hyperac_chunked(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return chunked_causal_loss(DeferredLogits(hidden, weight, None), labels, None)


WAYS: dict[str, Way] = {"unchunked": unchunked, "torchtune": torchtune, "hyperac": hyperac_chunked}


def run(way: Way, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor
        ) -> tuple[int, float, torch.Tensor, torch.Tensor, torch.Tensor]:
    hidden.grad = weight.grad = None
    with PeakMeter([weight, hidden]) as meter:
        start = time.perf_counter()
        loss = way(hidden, weight, labels)
        loss.backward()
        seconds = time.perf_counter() - start
    return int(meter.peak_bytes or 0), seconds, loss.detach(), hidden.grad.clone(), weight.grad.clone()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--rounds", type=int, default=3)
    a = parser.parse_args()
    torch.manual_seed(0)
    weight = (torch.randn(a.vocab, a.hidden) * 0.02).requires_grad_()
    failures = 0
    print(f"vocab {a.vocab}, hidden {a.hidden}, float32, torch {torch.__version__}")
    print(f"{'seq':>6}  {'way':<10}  {'peak MiB':>9}  {'step ms':>9}  {'loss diff':>9}  {'grad err':>9}")
    for seq in a.seq:
        hidden = torch.randn(1, seq, a.hidden).requires_grad_()
        labels = torch.randint(0, a.vocab, (1, seq))
        labels[:, : seq // 8] = -100
        results = {name: run(way, hidden, weight, labels) for name, way in WAYS.items()}
        times: dict[str, list[float]] = {name: [] for name in WAYS}
        for _ in range(a.rounds):
            for name, way in WAYS.items():
                times[name].append(run(way, hidden, weight, labels)[1])
        _, _, loss, grad_hidden, grad_weight = results["unchunked"]
        errors = {}
        for name, (peak, _, other_loss, other_hidden, other_weight) in results.items():
            errors[name] = max((other_hidden - grad_hidden).abs().max() / grad_hidden.abs().max(),
                               (other_weight - grad_weight).abs().max() / grad_weight.abs().max()).item()
            print(f"{seq:>6}  {name:<10}  {peak / 2**20:>9.1f}  {statistics.median(times[name]) * 1e3:>9.1f}  "
                  f"{(other_loss - loss).abs().item():>9.2e}  {errors[name]:>9.2e}")
        ok = (results["hyperac"][0] < min(results["unchunked"][0], results["torchtune"][0])
              and torch.equal(results["hyperac"][2], loss) and errors["hyperac"] <= 1e-5)
        failures += not ok
        print(f"{seq:>6}  {'PASS' if ok else 'FAIL'}: hyperac's peak below both, loss bitwise, gradients within 1e-5")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
