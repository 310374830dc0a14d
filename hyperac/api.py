"""``hyperac.apply`` and ``hyperac.remove``."""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Callable
from typing import Any

from torch import nn

from . import _hf
from .adapters import Adapter, find_adapter, resolve_regions
from .backends import get_backend
from .config import Config
from .discovery import Layer, discover_layers
from .errors import ConfigError, HyperACWarning, UnsupportedModelError
from .plan import LayerPlan, Plan, assign_modes
from .policy import resolve_op_sets
from .recompute import build_context_fn, install_exclusion, install_recompute, restore_forward

__all__ = ["apply", "applied_plan", "remove"]

logger = logging.getLogger(__name__)

_STATE = "_hyperac_state"
_UNSET: Any = object()


@dataclasses.dataclass
class _AppliedState:
    plan: Plan
    undo: list[Callable[[], None]]


def _resolve_config(config: Config | None, fields: dict[str, Any]) -> Config:
    given = {name: value for name, value in fields.items() if value is not _UNSET}
    if config is None:
        return Config(**given)
    if not isinstance(config, Config):
        raise ConfigError(f"config must be a hyperac.Config or None, got {config!r}.")
    if given:
        raise ConfigError(
            f"pass either config= or keyword options, not both (got config and {sorted(given)}); "
            f"use dataclasses.replace(config, {', '.join(f'{k}=...' for k in sorted(given))})."
        )
    return config


def _check_model(model: Any) -> None:
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"hyperac.apply needs a torch.nn.Module, got {type(model).__name__}.")
    if _STATE in model.__dict__:
        raise ConfigError(
            f"hyperac is already applied to this {type(model).__name__}; call hyperac.remove(model) first."
        )
    if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        raise UnsupportedModelError(
            "the model is already compiled (torch.compile); apply hyperac to the uncompiled module first, "
            "e.g. hyperac.apply(model._orig_mod), then compile."
        )
    enabled = _hf.recompute_already_enabled(model)
    if enabled is not None:
        raise UnsupportedModelError(
            f"HF activation checkpointing is already on ({enabled}.gradient_checkpointing=True); call "
            "model.activation_checkpointing_disable() (or gradient_checkpointing_disable()) first."
        )


def _regions_by_layer(
    model: nn.Module, layers: list[Layer], modes: list[str], adapter: Adapter | None, config: Config, notes: list[str]
) -> dict[str, tuple[tuple, tuple]]:
    """Per selected layer fqn: (recomputed (fqn, module) pairs, excluded pairs)."""
    selected = [layer for layer, mode in zip(layers, modes) if mode != "off"]
    if adapter is not None:
        if config.compile and adapter.declares_exclusions:
            raise ConfigError(
                "Config.compile=True cannot be combined with adapter exclusions (they need eager replay); "
                "use compile=False or an adapter without exclude_patterns/exclude_predicate."
            )
        modules = dict(model.named_modules())
        regions = resolve_regions(adapter, modules, [layer.fqn for layer in selected])
        return {fqn: (r.roots, r.excluded) for fqn, r in regions.items()}
    if selected and _hf.has_kv_sharing(model):
        message = (
            "the model shares keys and values across layers (num_kv_shared_layers > 0): replaying attention "
            "would publish them twice, so hyperac recomputes each selected layer's MLP and norms and leaves "
            "attention as it is."
        )
        warnings.warn(message, HyperACWarning, stacklevel=3)
        notes.append(message)
        return {layer.fqn: (tuple(_hf.sub_module_targets(layer.fqn, layer.module)), ()) for layer in selected}
    return {layer.fqn: (((layer.fqn, layer.module),), ()) for layer in selected}


def _check_wrapped(layers: list[Layer], modes: list[str]) -> None:
    for layer, mode in zip(layers, modes):
        if mode != "off" and layer.wrapper is not None:
            raise UnsupportedModelError(
                f"layer {layer.fqn} is already wrapped by {type(layer.wrapper).__name__}, which recomputes or "
                f"shards it itself; unwrap it, or leave it out with layers={{{layer.index}: 'off'}}."
            )


def apply(
    model: nn.Module,
    config: Config | None = None,
    *,
    mode: str = _UNSET,
    backend: Any = _UNSET,
    layers: Any = _UNSET,
    compile: bool = _UNSET,
    allow_cache_entry_mutation: bool = _UNSET,
    adapter: Any = _UNSET,
) -> Plan:
    """Make ``model`` keep fewer activations for backward by recomputing them. Modifies ``model``
    in place; gradients are unchanged.

    Keyword options are the fields of :class:`hyperac.Config` (documented there); pass either
    ``config=`` or keywords. The change is atomic: if anything fails, the model is left exactly as
    it was. :func:`hyperac.remove` undoes it.

    Args:
        model: the model to change, e.g. a transformers ``PreTrainedModel``.

    Returns:
        The :class:`Plan` that was applied; ``print(plan)`` shows it per layer.

    Raises:
        ConfigError: an option has the wrong type or value, or the model is already applied.
        BackendUnavailableError: an explicitly requested backend cannot run here.
        UnsupportedModelError: no layers were found, or HF activation checkpointing is already on.
    """
    config = _resolve_config(
        config,
        dict(mode=mode, backend=backend, layers=layers, compile=compile,
             allow_cache_entry_mutation=allow_cache_entry_mutation, adapter=adapter),
    )
    _check_model(model)
    chosen_backend = get_backend(config.backend)
    found = discover_layers(model, config.layer_spec.containers)
    modes = assign_modes(found, config)
    _check_wrapped(found, modes)
    adapter_name, adapter_spec = find_adapter(model, config.adapter)
    notes: list[str] = []
    regions = _regions_by_layer(model, found, modes, adapter_spec, config, notes)
    plan = Plan(
        backend=chosen_backend.name,
        adapter=adapter_name,
        layers=tuple(
            LayerPlan(layer.index, layer.fqn, mode,
                      tuple(f for f, _ in regions.get(layer.fqn, ((), ()))[0]),
                      tuple(f for f, _ in regions.get(layer.fqn, ((), ()))[1]))
            for layer, mode in zip(found, modes)
        ),
        notes=tuple(notes),
    )
    ops = resolve_op_sets(chosen_backend)
    undo: list[Callable[[], None]] = []
    try:
        _hf.disable_use_cache(model, undo)
        _install(found, modes, regions, ops, config, undo)
        model.__dict__[_STATE] = _AppliedState(plan, undo)
        undo.append(lambda: model.__dict__.pop(_STATE, None))
        if adapter_spec is not None and adapter_spec.on_applied is not None:
            adapter_spec.on_applied(model)
    except BaseException:
        for step in reversed(undo):
            step()
        raise
    logger.info("%s", plan.summary())
    return plan


def _install(
    found: list[Layer], modes: list[str], regions: dict, ops: Any, config: Config, undo: list[Callable[[], None]]
) -> None:
    installed: set[int] = set()

    def track(module: nn.Module, original: Any) -> None:
        installed.add(id(module))
        undo.append(lambda: restore_forward(module, original))

    for layer, mode in zip(found, modes):
        if mode == "off":
            continue
        roots, excluded = regions[layer.fqn]
        context_fn = build_context_fn(
            mode, ops, compile=config.compile,
            allow_cache_entry_mutation=config.allow_cache_entry_mutation, has_exclusions=bool(excluded),
        )
        for _, module in excluded:
            if id(module) not in installed:
                track(module, install_exclusion(module))
        for _, module in roots:
            if id(module) not in installed:
                track(module, install_recompute(module, context_fn))


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan applied to ``model``, or ``None`` if hyperac is not applied to it."""
    state = model.__dict__.get(_STATE)
    return None if state is None else state.plan


def remove(model: nn.Module) -> None:
    """Undo :func:`apply`: restore every forward, ``use_cache`` and all other state. Modifies
    ``model`` in place.

    Raises:
        ConfigError: hyperac is not applied to ``model``.
    """
    state = model.__dict__.get(_STATE) if isinstance(model, nn.Module) else None
    if state is None:
        raise ConfigError(
            f"hyperac is not applied to this {type(model).__name__}; nothing to remove "
            "(hyperac.applied_plan(model) tells whether it is)."
        )
    for step in reversed(state.undo):
        step()
    logger.info("hyperac: removed from %s (%d layers restored)", type(model).__name__, len(state.plan.layers))
