"""hyperac as torchtitan's activation-recompute step.

torchtitan's ``parallelize`` functions apply activation checkpointing between tensor parallel and
``fully_shard``, through the ``activation_checkpoint`` entry of the trainer's config (an
``ActivationCheckpointing`` configurable: ``SelectiveAC``, ``FullAC`` ...). :class:`HyperACRecompute`
is one more such entry: it applies hyperac to the model's ``layers`` there, so the order of calls
is torchtitan's own (after ``parallelize_module``, before ``fully_shard``; per stage under pipeline
parallel)::

    from hyperac.integrations.torchtitan import HyperACRecompute

    config = llama3_debugmodel()                  # a torchtitan Trainer.Config
    config.activation_checkpoint = HyperACRecompute.Config(mode="selective")

Unlike torchtitan's own entries, it wraps nothing: parameter and ``state_dict`` names keep no
``_checkpoint_wrapped_module.``, so checkpoints load with or without it. The inherited
``preserve_rng_state``, ``determinism_check`` and ``debug`` fields have no effect: hyperac always
replays the RNG state and uses PyTorch's default determinism check.
"""

from __future__ import annotations

import dataclasses

from torch import nn
from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing

from ..api import apply

__all__ = ["HyperACRecompute"]


class HyperACRecompute(ActivationCheckpointing):
    """Recompute (and optionally swap) torchtitan's transformer blocks with :func:`hyperac.apply`."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(ActivationCheckpointing.Config):
        mode: str = "selective"
        """hyperac's mode of every block: ``full``, ``selective``, ``selective-even``, ``pointwise``,
        ``swap`` or ``off`` (see :class:`hyperac.Config`)."""

        backend: str = "auto"
        """hyperac's backend; ``auto`` picks the accelerator of this host."""

        swap_inputs: bool = False
        """Keep the inputs of recomputed blocks in host memory between forward and backward."""

    def apply(self, model: nn.Module) -> None:
        """Apply hyperac to every block of ``model.layers`` (a ``ModuleDict`` in torchtitan's models)."""
        config = self.config
        apply(model, layers="layers", mode=config.mode, backend=config.backend, swap_inputs=config.swap_inputs)
