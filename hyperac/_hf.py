"""What hyperac must know about HuggingFace transformers models, found by duck typing.

Nothing here imports transformers: a model that does not come from it simply has none of these
attributes.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from .errors import warn_once
from .state import AppliedState, Installed, install_hook

__all__ = [
    "CACHE_KWARGS",
    "TrainingCacheDefault",
    "configs",
    "has_kv_sharing",
    "install_training_cache_defaults",
    "recompute_already_enabled",
    "sub_module_targets",
]

CACHE_KWARGS = ("cache", "past_key_values", "past_key_value", "layer_past")
"""Keyword arguments that carry a KV cache (NOTE [KV caches in replays] in recompute.py)."""

Modules = list[tuple[str, nn.Module]]

# Sub-modules recomputed on their own when a layer's attention must not be replayed (KV sharing):
# one attribute per group, the first present wins.
_SUB_MODULE_GROUPS = (
    ("mlp", "feed_forward", "ffn"),
    ("input_layernorm", "attention_norm", "layer_norm1", "norm1"),
    ("post_attention_layernorm", "ffn_norm", "layer_norm2", "norm2"),
)


def configs(modules: Modules) -> list[Any]:
    """Every distinct config object of the model and of its sub-models, with their sub-configs."""
    found: list[Any] = []
    seen: set[int] = set()
    pending = [m.__dict__.get("config") for _, m in modules]
    while pending:
        config = pending.pop()
        if config is None or id(config) in seen or not hasattr(config, "to_dict"):
            continue
        seen.add(id(config))
        found.append(config)
        sub_configs = getattr(type(config), "sub_configs", None) or {}
        pending.extend(getattr(config, name, None) for name in sub_configs)
    return found


def has_kv_sharing(all_configs: list[Any]) -> bool:
    """Whether later layers reuse keys and values an earlier layer's attention publishes."""
    return any((getattr(config, "num_kv_shared_layers", 0) or 0) > 0 for config in all_configs)


def recompute_already_enabled(modules: Modules) -> str | None:
    """The name of a module whose HF activation checkpointing is on, if any."""
    for name, module in modules:
        if module.__dict__.get("gradient_checkpointing") is True:
            return name or type(module).__name__
    return None


def sub_module_targets(layer_fqn: str, layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """The MLP and norms of a layer, each recomputed as its own region."""
    targets = []
    for group in _SUB_MODULE_GROUPS:
        for name in group:
            child = layer._modules.get(name)
            if child is not None:
                targets.append((f"{layer_fqn}.{name}", child))
                break
    return targets


# NOTE [KV caches in training]
# hyperac never changes a config: ``use_cache`` stays what the user set, so eval, ``no_grad``,
# ``inference_mode``, ``generate`` and hand-written decoding loops build and return caches exactly
# as without hyperac, and ``save_pretrained`` writes the config unchanged. Only a training forward
# (training mode, grad enabled) of a model with recomputed layers, or planned by ``mode="auto"``
# (its profiles run without a cache, so its predicted peaks hold; except a plan that only swaps,
# which keeps the cache as before: its predicted peak is that of the step with the cache, and the
# step without one peaks 5% lower on tests/test_swap_plan.py's model), differs, as under HF's
# activation checkpointing (``merge_with_config_defaults``): a ``use_cache`` left to the config
# default becomes ``False``, so no cache is built that would keep every layer's keys and values alive
# through the step; an explicit ``use_cache=True`` becomes ``False`` too, with one warning. A cache
# object passed in is kept, with one warning: the layers read and extend it as without hyperac
# (recompute.py, NOTE [KV caches in replays]). Each HF model module whose forward takes
# ``use_cache`` or a cache gets a :class:`TrainingCacheDefault` forward pre-hook for this.

_USE_CACHE_TRUE = (
    "use_cache=True in a training forward of a model with recomputed layers (or planned by mode='auto'): hyperac "
    "sets use_cache=False for it, as HF activation checkpointing does (a cache built while training only holds every "
    "layer's keys and values in memory); eval, no_grad and generate keep caching."
)
_CACHE_GIVEN = (
    "a KV cache was passed to a training forward of a model with recomputed layers; hyperac keeps it: the layers read "
    "it and append to it once, as without hyperac, and each replay in backward sees it as it was before that layer "
    "ran. The keys and values the cache holds stay in memory until it is dropped."
)


class TrainingCacheDefault(Installed):
    """Forward pre-hook of an HF model module: its cache arguments in training (NOTE [KV caches in training]).

    Only the outermost model warns about a cache passed in: inner models get caches from their parent.
    """

    def __init__(self, owner: AppliedState, fqn: str, parameters: list[str], outermost: bool) -> None:
        self.owner, self.fqn, self.outermost = owner, fqn, outermost
        self.use_cache_at = parameters.index("use_cache") if "use_cache" in parameters else None
        self.caches_at = {name: parameters.index(name) for name in CACHE_KWARGS if name in parameters}

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        if not (module.training and torch.is_grad_enabled()):
            return None
        if self.outermost and any(_given(args, kwargs, name, at) is not None for name, at in self.caches_at.items()):
            warn_once(_CACHE_GIVEN, self.owner.warned, stacklevel=6)
        if self.use_cache_at is None:
            return None
        use_cache = _given(args, kwargs, "use_cache", self.use_cache_at)
        if use_cache is None and not getattr(module.config, "use_cache", None):
            return None
        if use_cache:
            warn_once(_USE_CACHE_TRUE, self.owner.warned, stacklevel=6)
        if self.use_cache_at < len(args):
            args = (*args[: self.use_cache_at], False, *args[self.use_cache_at + 1:])
        else:
            kwargs["use_cache"] = False
        return args, kwargs


def _given(args: tuple, kwargs: dict[str, Any], name: str, at: int) -> Any:
    return args[at] if at < len(args) else kwargs.get(name)


def install_training_cache_defaults(modules: Modules, owner: AppliedState) -> None:
    """Register a :class:`TrainingCacheDefault` on every HF model (``PreTrainedModel``) module whose
    forward takes ``use_cache`` or a cache argument."""
    models = [(name, module) for name, module in modules
              if hasattr(type(module), "config_class") and hasattr(module.__dict__.get("config"), "to_dict")]
    for name, module in models:
        parameters = list(inspect.signature(type(module).forward).parameters)[1:]
        if "use_cache" in parameters or any(cache in parameters for cache in CACHE_KWARGS):
            outermost = not any(other != name and (not other or name.startswith(other + ".")) for other, _ in models)
            install_hook(module, TrainingCacheDefault(owner, name, parameters, outermost), pre=True, with_kwargs=True)
