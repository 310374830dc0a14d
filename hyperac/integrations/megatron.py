"""hyperac in a Megatron-Core (or MindSpeed) training script.

Megatron-Core recomputes through its config (``recompute_granularity``, ``recompute_method``,
``recompute_num_layers``, ``recompute_modules``), read when the model is built. hyperac takes their
place: build the model with ``recompute_granularity=None``, then apply hyperac to it, per pipeline
stage (each model chunk ``get_model`` returns), before Megatron's ``DistributedDataParallel`` wraps it::

    from hyperac.integrations import megatron as hyperac_megatron

    model = GPTModel(config, transformer_layer_spec, vocab_size, max_sequence_length, ...)
    hyperac_megatron.apply(model, mode="selective")   # the decoder's layers, decoder.layers.N

:func:`apply` is :func:`hyperac.apply` plus Megatron's RNG tracker: Megatron draws its
tensor-parallel dropout masks (attention dropout) inside ``get_cuda_rng_tracker().fork()``, whose
states live in Python, and its own ``CheckpointFunction`` saves and restores them for its replay;
hyperac does the same once the tracker is registered (:func:`hyperac.register_rng_tracker`), which
:func:`apply` does. A plain ``hyperac.apply`` on a Megatron model whose tracker is seeded raises
:class:`hyperac.UnsupportedModelError` naming this fix, and any apply to a model built with Megatron's
recompute on raises too (its layers would be recomputed twice).

Megatron's collectives run inside its ``autograd.Function`` s, where hyperac's selective modes see
them as ``c10d`` ops: the tensor-parallel all-reduce and the sequence parallel all-gather and
reduce-scatter are kept and not run again in backward (NOTE [Collectives that write into their
arguments] in policy.py; a parameter all-gather run by a sharding stack's module hook is not the
layer's, NOTE [Parameter lifecycles are not the layer's program] in lifecycle.py). The pipeline's
``deallocate_output_tensor`` frees a stage's output data after sending it, which hyperac's regions do
not read again (the layer's output is not one of its saved inputs). Megatron's output-discarding
``CheckpointWithoutOutput`` inside a recomputed layer is refused on the layer's first forward (NOTE
[Saved tensors freed in forward] in replay/freed_saves.py).

megatron-core 0.16.1 is the newest release with a wheel for Python 3.11 (0.17 needs 3.12);
``tox -e megatron`` tests this module with it.
"""

from __future__ import annotations

from typing import Any

from megatron.core import tensor_parallel
from torch import nn

from ..api import apply as hyperac_apply
from ..config import Config
from ..plan import Plan
from ..replay.random_sources import register_rng_tracker

__all__ = ["TRACKER_NAME", "apply"]

TRACKER_NAME = "megatron"
"""The name Megatron-Core's RNG tracker is registered under (:func:`hyperac.unregister_rng_tracker`)."""


def apply(model: nn.Module, config: Config | None = None, **options: Any) -> Plan:
    """:func:`hyperac.apply` on a Megatron-Core model (a ``GPTModel``, a ``TransformerBlock``, one
    pipeline stage's chunk), with Megatron's RNG tracker registered for the replays.

    ``options`` are :func:`hyperac.apply`'s (``mode``, ``layers`` ...). The tracker is registered as
    ``get_cuda_rng_tracker``, the function, so the tracker of the moment is replayed (Megatron
    replaces it when reseeded with ``force_reset_rng``); it stays registered after
    :func:`hyperac.remove`, harmlessly (saving and setting a tracker's states around a replay is what
    Megatron's own checkpoint does); :func:`hyperac.unregister_rng_tracker` with :data:`TRACKER_NAME`
    removes it.
    """
    register_rng_tracker(TRACKER_NAME, tensor_parallel.get_cuda_rng_tracker)
    return hyperac_apply(model, config, **options)
