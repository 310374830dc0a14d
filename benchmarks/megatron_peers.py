"""hyperac against Megatron-Core's own recompute on a tiny GPTModel, on CPU.

One gloo rank, megatron-core 0.16.1 (``tox -e megatron``'s pins), the tiny GPT of
tests/megatron_testing.py (4 layers, hidden 64, 4 heads, sequence 16, batch 2, Megatron's local
layer spec, attention and hidden dropout 0.1) and the CPU stand-ins of tests/megatron_shims.py.
Configurations:

* ``off``: no recompute;
* ``megatron-full``: ``recompute_granularity="full"``, ``recompute_method="uniform"``,
  ``recompute_num_layers=1`` (every layer's input kept, the layer recomputed);
* ``megatron-selective``: ``recompute_granularity="selective"`` (Megatron's default
  ``recompute_modules=["core_attn"]``: the attention core recomputed);
* ``hyperac-full``, ``hyperac-selective``, ``hyperac-pointwise``: ``hyperac.integrations.megatron.apply``
  with that mode.

Per configuration, one step through ``hyperac.measure.measure_step``: the bytes alive when backward
starts of the storages the forward made (parameters and their views not counted), and the FLOPs of
forward and backward; both as ratios to ``off``. ``grads`` says whether the step's loss and gradients
equal ``off``'s bitwise.

    OMP_NUM_THREADS=1 python benchmarks/megatron_peers.py [--dropout 0.1]
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "tests"))

import megatron_shims  # noqa: E402
import megatron_testing  # noqa: E402
from megatron.core import parallel_state  # noqa: E402

import hyperac  # noqa: E402
from hyperac.integrations import megatron as hyperac_megatron  # noqa: E402
from hyperac.measure import measure_step  # noqa: E402

CONFIGURATIONS = {
    "off": ({}, None),
    "megatron-full": (dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1), None),
    "megatron-selective": (dict(recompute_granularity="selective"), None),
    "hyperac-full": ({}, "full"),
    "hyperac-selective": ({}, "selective"),
    "hyperac-pointwise": ({}, "pointwise"),
}


def _loss(model: torch.nn.Module) -> torch.Tensor:
    ids, positions = megatron_testing.batch(0)
    return model(ids, positions, megatron_shims.causal_mask(megatron_testing.SEQ), labels=ids).float().mean()


def run(name: str, dropout: float) -> tuple[int, int, torch.Tensor, dict[str, torch.Tensor]]:
    recompute, mode = CONFIGURATIONS[name]
    model = megatron_testing.tiny_gpt(dropout=dropout, **recompute)
    if mode is not None:
        hyperac_megatron.apply(model, mode=mode, backend="cpu")
    model.train()
    megatron_shims.seed_tracker(megatron_testing.SEED)
    kept, flops = measure_step(model, _loss)
    model.zero_grad(set_to_none=True)
    megatron_shims.seed_tracker(megatron_testing.SEED)
    loss = _loss(model)
    loss.backward()
    return kept, flops, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dropout", type=float, default=0.1, help="attention and hidden dropout (default 0.1)")
    dropout = parser.parse_args().dropout
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as directory:
        torch.distributed.init_process_group("gloo", init_method=f"file://{directory}/store", rank=0, world_size=1)
        megatron_shims.install()
        parallel_state.initialize_model_parallel(1)
        try:
            results = {name: run(name, dropout) for name in CONFIGURATIONS}
        finally:
            hyperac.unregister_rng_tracker(hyperac_megatron.TRACKER_NAME)
            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
    off_bytes, off_flops, off_loss, off_grads = results["off"]
    print(f"tiny GPTModel: {megatron_testing.LAYERS} layers, hidden {megatron_testing.HIDDEN}, seq "
          f"{megatron_testing.SEQ}, batch {megatron_testing.BATCH}, dropout {dropout}, 1 rank (gloo), "
          f"torch {torch.__version__}")
    print(f"{'configuration':<20}{'kept bytes':>12}{'x off':>8}{'FLOPs x off':>13}  grads")
    for name, (kept, flops, loss, grads) in results.items():
        same = torch.equal(loss, off_loss) and all(torch.equal(grads[k], off_grads[k]) for k in off_grads)
        verdict = "bitwise" if same else "DIFFER"
        print(f"{name:<20}{kept:>12,}{kept / off_bytes:>8.3f}{flops / off_flops:>13.3f}  {verdict}")


if __name__ == "__main__":
    main()
