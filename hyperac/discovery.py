"""Find a model's repeated layers without model-specific paths.

Layers live in containers (``ModuleList``, ``ModuleDict``, ``Sequential``); a model may have
several (a vision tower and a text tower, an encoder and a decoder). Discovery walks the model
from the top and takes the first container on each path that holds layers; it never looks inside
a layer. Each layer records how it was found (``Layer.found_by``, a column of ``print(plan)``):

* ``declared class``: the model declares its layer classes (HF ``GradientCheckpointingLayer``
  subclasses, class names in ``_no_split_modules``) and the container holds at least one of them,
  every other child being a block too (mobilevit mixes declared and undeclared blocks);
* ``HF marker``: older remote code declares nothing, but the container's parent carries HF's
  ``gradient_checkpointing`` attribute; every child with children is a layer;
* ``structure``: plain PyTorch (torchtitan's ``layers`` ``ModuleDict``, nanoGPT's
  ``transformer.h``, timm's ``blocks``) and HF classes that declare nothing: a container of
  blocks (children that have children) at least two of which share a class. Where every such
  block is a stage whose own container of blocks holds most of its parameters (timm's
  ``stages[i].blocks``), the inner blocks are the layers. A container of ``ModuleList``s (funnel,
  pvt) holds its lists' children. Repeated blocks found this way before any declared one win
  (rt_detr declares small conv layers inside its backbone's bottlenecks: the bottlenecks are the
  layers); containers holding under a tenth of the largest one's parameters are left out, unless
  their block class is one the kept containers hold (a CNN's small early stages) or they are a stage
  of kept stages (efficientnet's first stage, one block of its own class, at the highest resolution,
  so holding much of the activation memory). A model with no
  repeated block but one block used several times (ALBERT's shared layer group) gets that block;
* ``user path``: ``layers="encoder.blocks"`` names the container.

NOTE [Reversible layers]
Reversible layers (HF reformer) run their forward without autograd and rebuild their inputs from
their outputs in backward: recompute has nothing to save there. Such a layer (its class has a
``backward_pass`` method) is marked ``reversible``; the plan leaves it ``off`` and says why.
"""

from __future__ import annotations

import dataclasses
import sys
from collections import Counter
from collections.abc import Iterator

from torch import nn

from .errors import ConfigError, UnsupportedModelError

__all__ = ["Layer", "discover_layers"]

_CONTAINER_TYPES = (nn.ModuleList, nn.ModuleDict, nn.Sequential)
# Attributes under which wrappers (torch's CheckpointWrapper, FSDP1, HF/accelerate) keep the wrapped module.
_WRAPPED_ATTRIBUTES = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_wrapped_module")
_SHARDING_ATTRIBUTE = "_fsdp_wrapped_module"
"""FSDP1's: it shards the module and leaves its activations alone, so hyperac recomputes the module inside it,
as inside FSDP2's ``fully_shard`` (docs/stacks/fsdp2-ddp.md)."""


FOUND_BY = ("declared class", "HF marker", "structure", "user path")
"""How a layer was found (:attr:`Layer.found_by`); the module docstring states each rule."""
# A container found by structure alone is kept only if it holds at least this share of the
# parameters of the largest container found (NOTE in the module docstring).
_MIN_SHARE = 0.1
# A block is a stage (its inner blocks are the layers) when its own container of blocks holds at
# least this share of its parameters.
_STAGE_SHARE = 0.5


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
    """An activation-recompute wrapper around the block, if it already has one (FSDP1's, which shards it, is
    none)."""
    found_by: str = "user path"
    """Which rule found it: one of :data:`FOUND_BY`."""
    reversible: bool = False
    """The block rebuilds its inputs in backward itself (NOTE [Reversible layers])."""


def _unwrap(module: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """The block inside any wrappers, and the outermost wrapper that recomputes it (``None`` where none does:
    no wrapper, or only FSDP1's)."""
    for attribute in _WRAPPED_ATTRIBUTES:
        inner = getattr(module, "_modules", {}).get(attribute)
        if inner is not None:
            inner, wrapper = _unwrap(inner)
            return inner, wrapper if attribute == _SHARDING_ATTRIBUTE else module
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


def _parameter_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


Blocks = list[tuple[str, nn.Module]]
"""(name relative to the container, child as registered, possibly wrapped) of a container's layers."""


def _blocks(container: nn.Module, keep_leaves: bool = False) -> Blocks:
    """The container's children, the children of ``ModuleList``/``ModuleDict`` children in their place
    (those have no forward: funnel's ``blocks``, pvt's ``block``). Without ``keep_leaves``, a child with
    no children of its own (a ``Linear``, a norm) makes the container hold no layers: ``[]``."""
    found: Blocks = []
    for name, child in container.named_children():
        inner = _unwrap(child)[0]
        if isinstance(inner, (nn.ModuleList, nn.ModuleDict)):
            nested = _blocks(inner, keep_leaves)
            if not nested and not keep_leaves:
                return []
            found.extend((f"{name}.{sub}", module) for sub, module in nested)
        elif not keep_leaves and next(inner.children(), None) is None:
            return []
        else:
            found.append((name, child))
    return found


@dataclasses.dataclass
class _Container:
    fqn: str
    blocks: Blocks
    found_by: str
    fully_declared: bool = False
    stages_of: str | None = None
    """The container of stages this one is a stage's inner container of (timm's ``stages``)."""

    def classes(self) -> set[type]:
        return {type(_unwrap(module)[0]) for _, module in self.blocks}

    def parameters(self) -> int:
        return sum(_parameter_count(module) for _, module in self.blocks)


class _Rules:
    """Decides whether a container holds layers, from what the model declares and its structure."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.names = _declared_layer_names(modules)
        self.base = _hf_layer_base()
        self.declared = any(self.is_declared(m) for m in modules)

    def is_declared(self, module: nn.Module) -> bool:
        if self.base is not None and isinstance(module, self.base):
            return True
        # Through the class hierarchy: FSDP2 turns a sharded layer's class into FSDP<Layer>.
        return any(cls.__name__ in self.names for cls in type(module).__mro__)

    def classify(self, parent: nn.Module, fqn: str, container: nn.Module, single: bool) -> _Container | None:
        """The container's layers and the rule that found them, or ``None``. ``single`` accepts one block."""
        if not isinstance(container, _CONTAINER_TYPES):
            return None
        blocks = _blocks(container)
        if not blocks:
            return None
        declared = [self.is_declared(_unwrap(module)[0]) for _, module in blocks]
        if any(declared):
            return _Container(fqn, blocks, "declared class", all(declared))
        if not self.declared and hasattr(parent, "gradient_checkpointing"):
            return _Container(fqn, blocks, "HF marker")
        counts = Counter(type(_unwrap(module)[0]) for _, module in blocks)
        if max(counts.values()) >= 2 or single:
            return _Container(fqn, blocks, "structure")
        return None

    def stage_of(self, block: nn.Module) -> tuple[str, _Container] | None:
        """(relative name, inner container) when ``block`` is a stage: itself a container of blocks, or holding
        one with most of its parameters (timm's ``stages[i].blocks``), whose blocks are more than a
        convolution, a norm and an activation (HF resnet's bottleneck holds a ``Sequential`` of those)."""
        total = _parameter_count(block)
        children = [("", block)] if isinstance(block, _CONTAINER_TYPES) else list(block.named_children())
        for name, child in children:
            inner = self.classify(block, name, child, single=True)
            if (
                inner is not None and inner.parameters() >= _STAGE_SHARE * total > 0
                and not any(_unit(_unwrap(module)[0]) for _, module in inner.blocks)
            ):
                return name, inner
        return None


def _unit(module: nn.Module) -> bool:
    """A convolution, norm and activation (or fewer) with nothing inside: too small to be a layer of its own."""
    children = list(module.children())
    return len(children) <= 3 and all(next(child.children(), None) is None for child in children)


def _walk(
    module: nn.Module, prefix: str, rules: _Rules, seen: set[int], single: bool
) -> Iterator[_Container]:
    """Yield the containers of layers in registration order; never look inside a layer."""
    for name, child in module.named_children():
        if id(child) in seen:
            continue
        seen.add(id(child))
        fqn = f"{prefix}{name}"
        found = rules.classify(module, fqn, child, single)
        if found is None:
            yield from _walk(child, f"{fqn}.", rules, seen, single)
            continue
        stages = [rules.stage_of(_unwrap(m)[0]) for _, m in found.blocks] if found.found_by == "structure" else []
        if stages and all(stages):
            for (block_name, _), (inner_name, inner) in zip(found.blocks, stages):
                inner.fqn = ".".join(part for part in (fqn, block_name, inner_name) if part)
                inner.stages_of = fqn
                yield inner
        else:
            yield found


def _without_small(containers: list[_Container]) -> list[_Container]:
    """The containers, less the small ones found by structure alone (NOTE in the module docstring)."""
    exempt = [c for c in containers if c.fully_declared or c.found_by == "HF marker"]
    largest = max(c.parameters() for c in containers)
    kept = [c for c in containers if c in exempt or c.parameters() >= _MIN_SHARE * largest]
    classes = set().union(*(c.classes() for c in kept))
    stages = {c.stages_of for c in kept} - {None}
    return [c for c in containers if c in kept or c.classes() <= classes or c.stages_of in stages]


def _layers_of(containers: list[_Container]) -> list[Layer]:
    layers: list[Layer] = []
    seen: set[int] = set()
    for container in containers:
        for name, child in container.blocks:
            block, wrapper = _unwrap(child)
            if id(block) in seen:
                continue
            seen.add(id(block))
            layers.append(Layer(
                len(layers), f"{container.fqn}.{name}", container.fqn, block, wrapper, container.found_by,
                callable(getattr(type(block), "backward_pass", None)),
            ))
    return layers


def _candidate_paths(model: nn.Module) -> list[str]:
    """Up to five paths ``layers=`` could name: containers of two or more modules below the root."""
    return [n for n, m in model.named_modules() if n and isinstance(m, _CONTAINER_TYPES) and len(m) > 1][:5]


def _name_a_container(model: nn.Module) -> str:
    """The fix for a model whose layers discovery cannot find: a real path to pass, or what to change."""
    candidates = _candidate_paths(model)
    if candidates:
        return f"name the container: hyperac.apply(model, layers={candidates[0]!r}) (containers it has: {candidates!r})"
    kind = type(model).__name__
    if isinstance(model, _CONTAINER_TYPES):
        return (f"the model itself is the {kind} of layers, which layers= cannot name: hold it in a module "
                f"(self.blocks = the {kind}) and pass layers='blocks'")
    return ("it holds no ModuleList, ModuleDict or Sequential of two or more modules: keep the repeated layers in "
            "one (self.blocks = nn.ModuleList(...)) and pass layers='blocks'")


def _named_containers(model: nn.Module, paths: tuple[str, ...]) -> list[_Container]:
    containers = []
    for path in paths:
        try:
            container = model.get_submodule(path)
        except AttributeError:
            raise ConfigError(
                f"Config.layers names {path!r}, but {type(model).__name__} has no such submodule; "
                f"containers it has: {_candidate_paths(model)!r}."
            ) from None
        blocks = _blocks(container, keep_leaves=True) if isinstance(container, _CONTAINER_TYPES) else []
        if not blocks:
            raise ConfigError(
                f"Config.layers names {path!r}, a {type(container).__name__}, not a non-empty ModuleList, "
                f"ModuleDict or Sequential of layers (nor of such lists); containers it has: "
                f"{_candidate_paths(model)!r}."
            )
        containers.append(_Container(path, blocks, "user path"))
    return containers


def discover_layers(
    model: nn.Module, container_paths: tuple[str, ...] | None = None, modules: list[nn.Module] | None = None
) -> list[Layer]:
    """Return the model's layers in registration order, each block once.

    A container whose children are ``ModuleList``s (funnel's ``blocks``) holds their children.
    ``modules`` (``list(model.modules())``) saves a walk over the model when the caller has it.

    Raises:
        UnsupportedModelError: nothing was found and no container path was given.
        ConfigError: a given container path does not name a container of layers.
    """
    if container_paths is not None:
        return _layers_of(_named_containers(model, container_paths))
    rules = _Rules(list(model.modules()) if modules is None else modules)
    containers = list(_walk(model, "", rules, {id(model)}, single=False))
    if not containers:  # one block reused several times (ALBERT)
        containers = list(_walk(model, "", rules, {id(model)}, single=True))
    if not containers:
        raise UnsupportedModelError(
            f"found no repeated layers in {type(model).__name__}: no container holds blocks of a declared "
            "layer class (GradientCheckpointingLayer, _no_split_modules) or two blocks of one class; "
            f"{_name_a_container(model)}."
        )
    return _layers_of(_without_small(containers))
