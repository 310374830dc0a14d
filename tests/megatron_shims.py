"""CPU stand-ins for the CUDA-only calls of Megatron-Core 0.16, so a tiny ``GPTModel`` trains on CPU in
the tests (``tox -e megatron``). Test fixtures only: nothing here is part of hyperac.

Megatron-Core assumes a CUDA device in a few places a CPU training step reaches. Each stand-in below
replaces one of them, does on CPU what the original does on the GPU, and says what it cannot show:

* ``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` (tensor_parallel/random.py): the RNG tracker's
  ``fork()`` swaps its named states into the CUDA generator through these; here they read and set the
  CPU generator, which the tracker's states then are. The tracker's logic (``fork``, ``get_states``,
  ``set_states``) runs unchanged. Not shown: the device generator's own swap (torch's checkpoint and
  hyperac's generator watch treat a CUDA generator as they treat the CPU one).
* :func:`seed_tracker`: ``model_parallel_cuda_manual_seed`` seeds the CUDA generator and adds the
  tracker's three states from it; this adds the same three states (same seeds, same names) from the
  CPU generator.
* ``GlobalMemoryBuffer.get_tensor`` (utils.py): sequence parallel's all-gather buffer is allocated on
  ``torch.cuda.current_device()``; here on CPU.
* ``torch.cuda.current_device`` (only in the spawned ranks of the 2-rank tests, never in the pytest
  process): the sequence-parallel backward of ``ColumnParallelLinear`` allocates its reduce-scatter
  output there; here it answers ``"cpu"``.
* :class:`SequenceParallelLayerNorm`: the local layer spec's norm without Apex (``WrappedTorchNorm``)
  refuses sequence parallel, and Apex's ``FusedLayerNorm`` is CUDA-only; this is torch's LayerNorm
  with its parameters marked ``sequence_parallel``, as ``FusedLayerNorm`` marks them (their gradients
  are each rank's partial sums, which Megatron's gradient finalization all-reduces).
* :func:`causal_mask`: Megatron's default causal mask is made with ``device="cuda"``; the tests pass
  the same mask explicitly (``True`` where a query may not attend).

Positions are learned (``position_embedding_type="learned_absolute"``): RoPE's ``inv_freq`` is made on
the CUDA device at construction.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import random as megatron_random
from megatron.core.utils import GlobalMemoryBuffer


def _get_rng_state_on_cpu(device="cuda", clone=False, graph_safe=False):
    return torch.get_rng_state()


def _set_rng_state_on_cpu(new_state, device=-1, graph_safe=False):
    torch.set_rng_state(new_state)


def _buffer_on_cpu(self, tensor_shape, dtype, name, mem_alloc_context=None):
    required = 1
    for size in tensor_shape:
        required *= size
    buffer = self.buffer.get((name, dtype))
    if buffer is None or buffer.numel() < required:
        buffer = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype)
    return buffer[:required].view(*tensor_shape)


class SequenceParallelLayerNorm(torch.nn.LayerNorm):
    """torch's LayerNorm built as Megatron builds its norms, its parameters marked ``sequence_parallel``."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **_: object) -> None:
        super().__init__(hidden_size, eps=eps)
        for parameter in self.parameters():
            parameter.sequence_parallel = config.sequence_parallel


def install(monkeypatch=None) -> None:
    """Put the stand-ins in place: through ``monkeypatch`` (undone after the test), or for the rest of
    the process (a spawned rank), where ``torch.cuda.current_device`` is replaced too."""
    patches = [
        (megatron_random, "_get_cuda_rng_state", _get_rng_state_on_cpu),
        (megatron_random, "_set_cuda_rng_state", _set_rng_state_on_cpu),
        (GlobalMemoryBuffer, "get_tensor", _buffer_on_cpu),
    ]
    if monkeypatch is None:
        patches.append((torch.cuda, "current_device", lambda: "cpu"))
    for owner, name, value in patches:
        if monkeypatch is None:
            setattr(owner, name, value)
        else:
            monkeypatch.setattr(owner, name, value)


def seed_tracker(seed: int, tp_rank: int = 0) -> None:
    """``model_parallel_cuda_manual_seed(seed)`` on the CPU generator: the tracker's data-parallel,
    model-parallel and expert-parallel states, seeded as Megatron seeds them."""
    tracker = megatron_random.get_cuda_rng_tracker()
    tracker.reset()
    torch.manual_seed(seed)
    tracker.set_states({
        name: torch.Generator().manual_seed(state_seed).get_state()
        for name, state_seed in (
            (megatron_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed),
            (megatron_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank),
            (megatron_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024),
        )
    })


def causal_mask(seq: int) -> torch.Tensor:
    """Megatron's causal mask, ``[1, 1, seq, seq]``, ``True`` above the diagonal (masked)."""
    return torch.triu(torch.ones(seq, seq, dtype=torch.bool), diagonal=1)[None, None]
