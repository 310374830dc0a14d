"""Model adapters: where inside a layer it is safe to recompute, declared per model family.

Some layers must not be replayed whole: an attention that publishes state for later layers, a
module that launches collectives the other ranks do not repeat. An :class:`Adapter` names the
recompute regions inside each layer (glob patterns over module names, ``*`` also crossing dots;
the outermost match per layer is one region) and the sub-modules a region must not replay (they
run once in forward; the replay reuses their saved output).

Register one for a model family with :func:`register_adapter`, or pass it to
:func:`hyperac.apply` directly. The registry maps names to adapters and holds no models.

NOTE [The registry is asked, never implied]: ``apply`` consults the registry only when its
``adapter=`` option asks: a registered name, or ``"auto"`` (the adapter registered for the
model's ``model_type``, architecture or class). The default, ``None``, recomputes whole layers
whatever is registered, so a library that registers an adapter for ``"llama"`` changes only the
applies that ask for it, not every Llama in the process.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from .errors import ConfigError

__all__ = ["Adapter", "Regions", "find_adapter", "register_adapter", "resolve_regions"]


def _check_patterns(field: str, value: Any, allow_empty: bool) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence):
        raise ConfigError(
            f"Adapter.{field} must be a tuple of glob patterns like ('model.layers.*.mlp',), got {value!r}."
        )
    patterns = tuple(value)
    if not patterns and not allow_empty:
        raise ConfigError(f"Adapter.{field} is empty; give at least one glob pattern like 'model.layers.*'.")
    for pattern in patterns:
        if not isinstance(pattern, str) or not pattern:
            raise ConfigError(f"Adapter.{field} holds {pattern!r}; every pattern must be a non-empty string.")
    return patterns


@dataclasses.dataclass(frozen=True, kw_only=True)
class Adapter:
    """Recompute regions and exclusions for one model family."""

    region_patterns: tuple[str, ...]
    """Glob patterns over module names; the outermost match inside each selected layer is one
    recompute region (``"model.layers.*"`` is the whole layer, ``"*.mlp"`` only its MLP)."""
    exclude_patterns: tuple[str, ...] = ()
    """Modules inside a region that run once in forward and are not replayed."""
    exclude_predicate: Callable[[str, nn.Module], bool] | None = None
    """``(fqn, module) -> bool``: also exclude the modules it accepts."""
    on_applied: Callable[[nn.Module], None] | None = None
    """Called with the model once everything is in place (a failure undoes the whole apply)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "region_patterns", _check_patterns("region_patterns", self.region_patterns, False))
        object.__setattr__(self, "exclude_patterns", _check_patterns("exclude_patterns", self.exclude_patterns, True))
        for field in ("exclude_predicate", "on_applied"):
            value = getattr(self, field)
            if value is not None and not callable(value):
                raise ConfigError(f"Adapter.{field} must be callable or None, got {value!r}.")

    @property
    def declares_exclusions(self) -> bool:
        return bool(self.exclude_patterns) or self.exclude_predicate is not None


_SUFFIXES = re.compile(
    r"(forcausallm|forconditionalgeneration|forsequenceclassification|formaskedlm|lmheadmodel|model)$"
)
_ADAPTERS: dict[str, Adapter] = {}


def _normalize(name: str) -> str:
    key = re.sub(r"[_\-\s]", "", name.lower())
    return _SUFFIXES.sub("", key) or key


def register_adapter(names: str | Sequence[str], adapter: Adapter) -> Adapter:
    """Register ``adapter`` for model types or architectures (``"llama"``, ``"LlamaForCausalLM"``).

    Names are matched ignoring case, ``_``/``-`` and suffixes such as ``ForCausalLM``.
    Registering the same adapter again is a no-op; a different one under a taken name raises.
    """
    if not isinstance(adapter, Adapter):
        raise ConfigError(f"register_adapter needs a hyperac.Adapter, got {adapter!r}.")
    keys = [names] if isinstance(names, str) else list(names)
    if not keys or not all(isinstance(k, str) and k for k in keys):
        raise ConfigError(f"register_adapter needs one or more non-empty names, got {names!r}.")
    for key in keys:
        existing = _ADAPTERS.get(_normalize(key))
        if existing is not None and existing != adapter:
            raise ConfigError(f"an adapter is already registered for {key!r}; unregister it first.")
    for key in keys:
        _ADAPTERS[_normalize(key)] = adapter
    return adapter


def unregister_adapter(names: str | Sequence[str]) -> None:
    """Forget the adapters registered under ``names`` (unknown names are ignored)."""
    for key in [names] if isinstance(names, str) else names:
        _ADAPTERS.pop(_normalize(key), None)


def _model_names(model: nn.Module) -> list[str]:
    config = getattr(model, "config", None)
    names = [getattr(config, "model_type", None), *(getattr(config, "architectures", None) or ())]
    names.append(type(model).__name__)
    return [n for n in names if isinstance(n, str) and n]


def find_adapter(model: nn.Module, requested: Adapter | str | None) -> tuple[str, Adapter | None]:
    """Return ``(name, adapter)`` for the ``adapter`` option; ``(..., None)`` means whole layers
    (NOTE [The registry is asked, never implied])."""
    if isinstance(requested, Adapter):
        return "custom", requested
    if requested is None or requested == "none":
        return "none", None
    if requested == "auto":
        for name in _model_names(model):
            adapter = _ADAPTERS.get(_normalize(name))
            if adapter is not None:
                return name, adapter
        return "none", None
    adapter = _ADAPTERS.get(_normalize(requested))
    if adapter is None:
        raise ConfigError(
            f"Config.adapter={requested!r} is not registered; registered: {sorted(_ADAPTERS)!r}. Register it with "
            "hyperac.register_adapter, pass a hyperac.Adapter, or adapter='auto' for the one registered for the model."
        )
    return requested, adapter


@dataclasses.dataclass(frozen=True)
class Regions:
    """Region roots and exclusions inside one layer (fqn, module), outermost first."""

    roots: tuple[tuple[str, nn.Module], ...]
    excluded: tuple[tuple[str, nn.Module], ...]


def _under(fqn: str, root: str) -> bool:
    return fqn == root or fqn.startswith(root + ".")


def _outermost(fqns: list[str]) -> list[str]:
    kept: list[str] = []
    for fqn in sorted(fqns, key=lambda f: f.count(".")):
        if not any(_under(fqn, k) for k in kept):
            kept.append(fqn)
    return sorted(kept, key=fqns.index)


def resolve_regions(
    adapter: Adapter, modules: dict[str, nn.Module], layer_fqns: list[str]
) -> dict[str, Regions]:
    """Match the adapter against ``modules`` (fqn -> module) inside the selected layers.

    Raises:
        ConfigError: patterns match nothing, an exclusion matches nothing, a region root is also
            excluded, an exclusion contains a region root, or exclusions nest.
    """
    result: dict[str, Regions] = {}
    all_excluded: list[str] = []
    for layer_fqn in layer_fqns:
        inside = [f for f in modules if _under(f, layer_fqn)]
        roots = _outermost([f for f in inside if any(fnmatch.fnmatchcase(f, p) for p in adapter.region_patterns)])
        # Match exclusions against the whole layer, so that one containing a region root is reported
        # as such; only those inside a region take effect.
        matched = [
            f for f in inside
            if any(fnmatch.fnmatchcase(f, p) for p in adapter.exclude_patterns)
            or (adapter.exclude_predicate is not None and adapter.exclude_predicate(f, modules[f]))
        ]
        for fqn in matched:
            for root in roots:
                if _under(root, fqn):
                    relation = "is also excluded" if root == fqn else f"lies inside excluded module {fqn!r}"
                    raise ConfigError(
                        f"recompute region root {root!r} {relation}; a region must be replayed, so narrow "
                        "Adapter.exclude_patterns to modules strictly inside the region."
                    )
        excluded = [f for f in matched if any(_under(f, r) for r in roots)]
        for fqn in excluded:
            outer = [o for o in excluded if o != fqn and _under(fqn, o)]
            if outer:
                raise ConfigError(
                    f"excluded module {fqn!r} lies inside excluded module {outer[0]!r}; nested exclusions are "
                    "not supported, exclude only the outer one."
                )
        all_excluded += excluded
        result[layer_fqn] = Regions(
            tuple((r, modules[r]) for r in roots), tuple((e, modules[e]) for e in excluded)
        )
    if layer_fqns and not any(r.roots for r in result.values()):
        raise ConfigError(
            f"Adapter.region_patterns {adapter.region_patterns!r} matched no module inside the selected layers "
            f"(e.g. {layer_fqns[0]!r}); patterns match full dotted names, like '{layer_fqns[0]}.mlp' or '*.mlp'."
        )
    if layer_fqns and adapter.declares_exclusions and not all_excluded:
        raise ConfigError(
            f"Adapter exclusions {adapter.exclude_patterns!r} matched no module inside the recompute regions; "
            "fix the patterns or drop them."
        )
    return result
