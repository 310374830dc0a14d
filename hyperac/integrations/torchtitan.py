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
``_checkpoint_wrapped_module.``, so checkpoints load with or without it. The fields it inherits
from ``ActivationCheckpointing.Config`` (``preserve_rng_state``, ``determinism_check``, ``debug``)
have no hyperac counterpart: hyperac always replays the RNG state and checks every replayed op, so
a value other than the default is refused (``ConfigError``) rather than ignored.

torchtitan 0.3 is built against torch 2.14; importing this module under an older torch raises
:class:`hyperac.TorchVersionError` before torchtitan is imported (it would fail deep inside, or
worse, half work). Install the pair in a venv of its own (``tox -e torchtitan`` does)::

    pip install 'torch==2.14.1' 'torchtitan==0.3.0' -e .
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from typing import Any

import torch
from torch import nn

from ..api import apply
from ..errors import ConfigError, TorchVersionError

_TORCHTITAN_TORCH = (2, 14)
"""The oldest torch torchtitan 0.3 runs on (it uses torch 2.14 APIs)."""


def check_torch(version: str) -> None:
    """Raise :class:`TorchVersionError` when ``version`` (a ``torch.__version__``) is older than
    torchtitan 0.3 needs."""
    release = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    if release < _TORCHTITAN_TORCH:
        raise TorchVersionError(
            f"hyperac.integrations.torchtitan: torch {version} is older than the torch 2.14 that torchtitan 0.3 "
            "needs. Install the pair in a venv of their own (next to torch 2.13, `pip install torchtitan` also "
            "changes huggingface_hub and datasets): pip install 'torch==2.14.1' 'torchtitan==0.3.0'."
        )


check_torch(torch.__version__)  # before torchtitan is imported, which fails obscurely on an older torch

from torchtitan.distributed.activation_checkpoint import ActivationCheckpointing  # noqa: E402

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

        save_ops: list[str] | None = None
        """Selective modes: the ops whose outputs are kept, by name (``"aten::mm"``), in place of
        hyperac's list (:attr:`hyperac.Config.save_ops`); ``None``: hyperac's. Or override
        :meth:`HyperACRecompute.get_save_ops`, as with torchtitan's ``SelectiveAC``."""

        force_recompute: list[str] = dataclasses.field(default_factory=list)
        """Selective modes: modules inside each block whose ops keep nothing, named relative to the
        block (``"moe.router.gate"``) or by an fnmatch pattern (:attr:`hyperac.Config.force_recompute`).
        torchtitan's ``force_recompute_mm_shapes_by_fqns`` by module: a matmul of the same shape
        elsewhere is still kept. A name that matches no module is an error (torchtitan's default,
        ``["moe.router.gate"]``, would be one on a dense model, so the default here is empty)."""

    def get_save_ops(self) -> Collection[Any] | None:
        """The ops whose outputs selective blocks keep (``None``: hyperac's list). Override it to
        return op objects (``torch.ops.aten.mm.default``) as torchtitan's ``SelectiveAC.get_save_ops``;
        by default, ``Config.save_ops``."""
        return self.config.save_ops

    def apply(self, model: nn.Module) -> None:
        """Apply hyperac to every block of ``model.layers`` (a ``ModuleDict`` in torchtitan's models)."""
        config = self.config
        _refuse_inherited_settings(config)
        apply(model, layers="layers", mode=config.mode, backend=config.backend, swap_inputs=config.swap_inputs,
              save_ops=self.get_save_ops(), force_recompute=config.force_recompute)


def _default(field: dataclasses.Field) -> Any:
    return field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default


def _refuse_inherited_settings(config: Any) -> None:
    """Raise :class:`ConfigError` for an inherited ``ActivationCheckpointing.Config`` field set to
    anything but its default: hyperac has no counterpart, and ignoring it would mislead."""
    for field in dataclasses.fields(ActivationCheckpointing.Config):
        value = getattr(config, field.name)
        if value != _default(field):
            raise ConfigError(
                f"HyperACRecompute.Config.{field.name}={value!r} has no effect in hyperac (it always replays the RNG "
                f"state and checks every replayed op); leave it at its default, {_default(field)!r}."
            )
