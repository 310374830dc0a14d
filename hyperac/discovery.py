"""Find a model's repeated layers without model-specific paths.

Layers live in containers (``ModuleList``, ``ModuleDict``, ``Sequential``); a model may have
several (a vision tower and a text tower, an encoder and a decoder). A container counts when
every child is a layer:

* where the model declares its layer classes (HF ``GradientCheckpointingLayer`` subclasses, or
  class names in ``_no_split_modules``), a child is a layer when it is one of them, so a norm
  list, a patch embedding or a merger is never taken for a layer container;
* otherwise (older remote code), the container must be a child of a module carrying HF's
  ``gradient_checkpointing`` marker, and a layer is any child that has children.

Plain PyTorch models name their containers (``layers="model.blocks"``).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator

from torch import nn

from .errors import ConfigError, UnsupportedModelError

__all__ = ["Layer", "discover_layers"]

_CONTAINER_TYPES = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
# Attributes under which recompute wrappers (torch's CheckpointWrapper, FSDP1, HF/accelerate) keep
# the wrapped module.
_WRAPPED_ATTRIBUTES = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_wrapped_module")


@dataclasses.dataclass(frozen=True)
class Layer:
    """One repeated block of a model."""

    index: int
    """Flat index across all containers, in registration order."""
    fqn: str
    """Dotted name of the block in the model (the wrapper's name if it is wrapped)."""
    container: str
    """Dotted name of the container holding it."""
    module: nn.Module
    """The block itself (seen through any wrapper)."""
    wrapper: nn.Module | None
    """An activation-recompute wrapper around the block, if it already has one."""


def _unwrap(module: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    outer = module
    for attribute in _WRAPPED_ATTRIBUTES:
        inner = getattr(module, "_modules", {}).get(attribute)
        if inner is not None:
            inner, _ = _unwrap(inner)
            return inner, outer
    return module, None


def _declared_layer_names(modules: list[nn.Module]) -> set[str]:
    names: set[str] = set()
    for module in modules:
        declared = getattr(type(module), "_no_split_modules", None)
        if declared:
            names.update(n for n in declared if isinstance(n, str))
    return names


def _hf_layer_base() -> type | None:
    module = sys.modules.get("transformers.modeling_layers")
    return getattr(module, "GradientCheckpointingLayer", None)


class _LayerTest:
    """Decides whether a module is a layer, from what the model declares."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.names = _declared_layer_names(modules)
        self.base = _hf_layer_base()
        self.declared = any(self.is_declared(m) for m in modules)

    def is_declared(self, module: nn.Module) -> bool:
        if self.base is not None and isinstance(module, self.base):
            return True
        # Through the class hierarchy: FSDP2 turns a sharded layer's class into FSDP<Layer>.
        return any(cls.__name__ in self.names for cls in type(module).__mro__)

    def is_container(self, parent: nn.Module, container: nn.Module) -> bool:
        if not isinstance(container, _CONTAINER_TYPES) or len(container) == 0:
            return False
        blocks = [_unwrap(child)[0] for child in container.children()]
        if self.declared:
            return all(self.is_declared(b) for b in blocks)
        return hasattr(parent, "gradient_checkpointing") and all(
            next(b.children(), None) is not None for b in blocks
        )


def _walk(module: nn.Module, prefix: str, test: _LayerTest, seen: set[int]) -> Iterator[tuple[str, nn.Module]]:
    """Yield (fqn, container) in registration order; never look inside a layer."""
    for name, child in module.named_children():
        if id(child) in seen:
            continue
        seen.add(id(child))
        fqn = f"{prefix}{name}"
        if test.is_container(module, child):
            yield fqn, child
        else:
            yield from _walk(child, f"{fqn}.", test, seen)


def _layers_of(containers: list[tuple[str, nn.Module]]) -> list[Layer]:
    layers: list[Layer] = []
    seen: set[int] = set()
    for container_fqn, container in containers:
        for name, child in container.named_children():
            block, wrapper = _unwrap(child)
            if id(block) in seen:
                continue
            seen.add(id(block))
            layers.append(Layer(len(layers), f"{container_fqn}.{name}", container_fqn, block, wrapper))
    return layers


def _candidate_paths(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, _CONTAINER_TYPES) and len(m) > 1][:5]


def _named_containers(model: nn.Module, paths: tuple[str, ...]) -> list[tuple[str, nn.Module]]:
    containers = []
    for path in paths:
        try:
            container = model.get_submodule(path)
        except AttributeError:
            raise ConfigError(
                f"Config.layers names {path!r}, but {type(model).__name__} has no such submodule; "
                f"containers it has: {_candidate_paths(model)!r}."
            ) from None
        if not isinstance(container, _CONTAINER_TYPES) or len(container) == 0:
            raise ConfigError(
                f"Config.layers names {path!r}, a {type(container).__name__}, not a non-empty ModuleList, "
                f"ModuleDict or Sequential of layers; containers it has: {_candidate_paths(model)!r}."
            )
        containers.append((path, container))
    return containers


def discover_layers(
    model: nn.Module, container_paths: tuple[str, ...] | None = None, modules: list[nn.Module] | None = None
) -> list[Layer]:
    """Return the model's layers in registration order, each block once.

    ``modules`` (``list(model.modules())``) saves a walk over the model when the caller has it.

    Raises:
        UnsupportedModelError: nothing was found and no container path was given.
        ConfigError: a given container path does not name a container of layers.
    """
    if container_paths is not None:
        return _layers_of(_named_containers(model, container_paths))
    test = _LayerTest(list(model.modules()) if modules is None else modules)
    containers = list(_walk(model, "", test, {id(model)}))
    if not containers:
        raise UnsupportedModelError(
            f"found no repeated layers in {type(model).__name__}: it declares no layer classes "
            "(GradientCheckpointingLayer, _no_split_modules) and has no container under a module with a "
            "'gradient_checkpointing' attribute; name the container, e.g. "
            f"hyperac.apply(model, layers='model.blocks') (candidates: {_candidate_paths(model)!r})."
        )
    return _layers_of(containers)
