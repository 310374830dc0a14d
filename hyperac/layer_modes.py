"""Each layer's mode: ``Config.mode``, overridden per layer by the rules of ``Config.layers``.

This is the step of :func:`hyperac.apply` between discovery (the layers) and installation; it
lives apart from :mod:`hyperac.plan`, which holds only the resulting data.
"""

from __future__ import annotations

from collections.abc import Sequence

from .config import Config, LayerRule
from .discovery import Layer
from .errors import ConfigError

__all__ = ["assign_modes", "reversible_note"]


def _apply_rules(modes: list[str], rules: Sequence[LayerRule], where: str, names: str) -> None:
    """Apply ``rules`` in order (ranges first, then single indices: NOTE [A single index overrides its range]
    in config.py), checking each against the number of layers."""
    for rule in rules:
        last = len(modes) - 1 if rule.last is None else rule.last
        if rule.first > len(modes) - 1 or last > len(modes) - 1:
            bad = rule.first if rule.first > len(modes) - 1 else last
            raise ConfigError(
                f"{where} names layer {bad}, but {names} has {len(modes)} layers (0-{len(modes) - 1}); "
                f"use indices in that range (an open range like '{min(rule.first, len(modes) - 1)}-' runs to the end)."
            )
        modes[rule.first:last + 1] = [rule.mode] * (last + 1 - rule.first)


def reversible_note(layers: Sequence[Layer]) -> list[str]:
    """The plan's note on reversible layers, which stay ``off`` (NOTE [Reversible layers] in discovery.py)."""
    reversible = [layer.fqn for layer in layers if layer.reversible]
    if not reversible:
        return []
    return [
        f"{len(reversible)} reversible layer(s) ({reversible[0]}, ...) rebuild their inputs from their outputs in "
        "backward and keep no activations: recompute gains nothing there, so they stay off."
    ]


def assign_modes(layers: Sequence[Layer], config: Config) -> list[str]:
    """Each layer's mode: ``config.mode``, overridden by the per-layer rules of ``config.layers``;
    reversible layers stay ``off``."""
    modes = [config.mode] * len(layers)
    for container, rules in config.layer_spec.rules.items():
        if container == "":
            _apply_rules(modes, rules, "Config.layers", "the model")
            continue
        positions = [i for i, layer in enumerate(layers) if layer.container == container]
        local = [modes[i] for i in positions]
        _apply_rules(local, rules, f"Config.layers[{container!r}]", repr(container))
        for position, mode in zip(positions, local):
            modes[position] = mode
    return [("off" if layer.reversible else mode) for layer, mode in zip(layers, modes)]
