"""Reference configurations hyperac is measured against: torchtitan's and HF's activation checkpointing.

These are not hyperac features. They reproduce what the peers do to a model, from torch's and
transformers' public pieces, so that ``hyperac demo --plot`` and ``benchmarks/`` can time and
measure hyperac against them on the same model, in the same process:

* :func:`apply_titan_full`: torchtitan's full AC. Each decoder layer is wrapped in
  ``checkpoint_wrapper(layer, preserve_rng_state=False)`` (non-reentrant ``torch.utils.checkpoint``),
  keeping only the layer's input.
* :func:`apply_titan_selective`: torchtitan's op-level selective AC. The same wrapper, with a
  ``context_fn`` from torch's ``create_selective_checkpoint_contexts`` and torchtitan's policy
  (:func:`titan_policy`): save the outputs of the ops in :func:`titan_save_list` except every
  second ``mm`` of a layer, recompute the rest.
* :func:`apply_hf_checkpointing`: HF's ``model.activation_checkpointing_enable(every_n_layers=n)``.

torchtitan's AC policy is ``torchtitan/distributed/activation_checkpoint.py`` (``_apply_ac_to_transformer_block``,
``_apply_op_sac`` and its ``_custom_policy``) with the save list ``_op_sac_save_list`` of
``torchtitan/models/llama3/infra/parallelize.py`` (2025). Newer torchtitan also saves ``topk``,
``aten.linear`` and device-to-host copies; none of them runs in a dense Llama on CPU, so the
kept bytes and the recomputed ops here are the same.

NOTE [Peers and RNG]
torchtitan passes ``preserve_rng_state=False``: the recompute draws random numbers from whatever
state the generator has in backward. On a model with dropout its dropout masks then differ from
the forward's, and so do its gradients (torchtitan's models have no dropout). HF's wrapper and
hyperac replay the RNG state, which costs a little time: compare step times knowing this.

Each ``apply_*`` changes the model in place and has no undo; apply it to a copy. A model it
cannot change raises :class:`~hyperac.errors.UnsupportedModelError` before changing anything.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .discovery import discover_layers
from .errors import UnsupportedModelError

__all__ = [
    "apply_hf_checkpointing", "apply_titan_full", "apply_titan_selective", "titan_context_fn", "titan_policy",
    "titan_save_list",
]

_TITAN_SAVE_NAMES = (
    "aten::mm",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_attention_math",
    "aten::_scaled_dot_product_fused_attention_overrideable",
    # Not in torchtitan's list (it targets CUDA): the CPU kernel SDPA dispatches to here. Without
    # it the peer would recompute attention on CPU, which torchtitan never does on its devices.
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::all_to_all_single",
    # for low precision training torchtitan always saves the result of max (the amax scale)
    "aten::max",
)


def _op(qualified_name: str) -> Any:
    namespace, _, name = qualified_name.partition("::")
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None


def titan_save_list() -> set[Any]:
    """The ops whose outputs torchtitan's selective policy saves (those this torch build has)."""
    ops = {_op(name) for name in _TITAN_SAVE_NAMES}
    ops.add(getattr(torch._higher_order_ops, "flex_attention", None))
    ops.discard(None)
    return ops


def titan_policy(save_list: set[Any], meta: defaultdict) -> Callable[..., CheckpointPolicy]:
    """torchtitan's ``_custom_policy``: save the ops in ``save_list`` except every second ``mm``.
    ``meta`` holds the mm counters of one region invocation, counted apart in forward and recompute."""
    mm = torch.ops.aten.mm.default

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        key = f"{'recompute' if ctx.is_recompute else 'forward'}_mm_count"
        if func == mm:
            meta[key] += 1
        to_save = func in save_list and not (func == mm and meta[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if to_save else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def titan_context_fn() -> Callable[[], tuple[Any, Any]]:
    """The ``context_fn`` torchtitan gives each layer's wrapper: a fresh mm counter per call."""
    save_list = titan_save_list()

    def context_fn() -> tuple[Any, Any]:
        return create_selective_checkpoint_contexts(titan_policy(save_list, defaultdict(int)))

    return context_fn


def _wrap_layers(model: nn.Module, **wrapper_options: Any) -> None:
    """Wrap each decoder layer (as :func:`hyperac.discovery.discover_layers` finds them) in torch's
    ``checkpoint_wrapper`` with torchtitan's options, in place of the layer in its container.
    An HF model's ``config.use_cache`` is turned off, as HF's own checkpointing does in training: a
    KV cache filled in forward and again in the recompute is state the recompute would change."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = discover_layers(model)
    wrapped = [layer.fqn for layer in layers if layer.wrapper is not None]
    if wrapped:
        raise UnsupportedModelError(
            f"{type(model).__name__} already has recompute wrappers around {wrapped[:3]}; apply a peer to a model "
            "without activation checkpointing."
        )
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False):
        config.use_cache = False
    for layer in layers:
        container = model.get_submodule(layer.container)
        name = layer.fqn.rpartition(".")[2]
        container.register_module(name, checkpoint_wrapper(layer.module, preserve_rng_state=False,
                                                           **wrapper_options))


def apply_titan_full(model: nn.Module) -> None:
    """torchtitan's full AC: every decoder layer recomputed whole in backward (NOTE [Peers and RNG])."""
    _wrap_layers(model)


def apply_titan_selective(model: nn.Module) -> None:
    """torchtitan's op-level selective AC on every decoder layer (NOTE [Peers and RNG])."""
    _wrap_layers(model, context_fn=titan_context_fn())


def apply_hf_checkpointing(model: nn.Module, every_n_layers: int = 1) -> None:
    """HF's own: ``model.activation_checkpointing_enable(every_n_layers=every_n_layers)``
    (non-reentrant ``torch.utils.checkpoint`` around every n-th decoder layer, RNG state replayed)."""
    if not hasattr(model, "activation_checkpointing_enable"):
        raise UnsupportedModelError(
            f"{type(model).__name__} has no activation_checkpointing_enable(): HF's checkpointing needs a "
            "transformers>=5 PreTrainedModel."
        )
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise UnsupportedModelError(f"{type(model).__name__} does not support HF activation checkpointing "
                                    "(supports_gradient_checkpointing is False).")
    model.activation_checkpointing_enable(every_n_layers=every_n_layers)
