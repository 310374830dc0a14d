"""What hyperac must know about HuggingFace transformers models, found by duck typing.

Nothing here imports transformers: a model that does not come from it simply has none of these
attributes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = ["configs", "disable_use_cache", "has_kv_sharing", "recompute_already_enabled", "sub_module_targets"]

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


def disable_use_cache(all_configs: list[Any], undo: list[Callable[[], None]]) -> None:
    """Set ``use_cache=False`` on every config that has it; push the restoring calls on ``undo``."""
    for config in all_configs:
        value = getattr(config, "use_cache", None)
        if value is None or value is False:
            continue
        config.use_cache = False
        undo.append(lambda config=config, value=value: setattr(config, "use_cache", value))


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
