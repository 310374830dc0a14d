"""What :func:`hyperac.apply` did to each layer: the returned :class:`Plan`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .config import Config, LayerRule
from .discovery import Layer
from .errors import ConfigError

__all__ = ["MODE_LETTERS", "LayerPlan", "Plan", "assign_modes", "mode_letters", "reversible_note"]

MODE_LETTERS = {"off": "o", "pointwise": "p", "selective": "s", "selective-even": "e", "full": "F", "swap": "w"}
"""One letter per mode, for writing a plan in a line: ``FFoo`` is full recompute on layers 0-1."""


def mode_letters(modes: Sequence[str]) -> str:
    """A plan's per-layer modes as one letter each (:data:`MODE_LETTERS`)."""
    return "".join(MODE_LETTERS[mode] for mode in modes)

_PREDICTIONS = ("predicted_bytes", "predicted_peak_bytes", "predicted_step_seconds", "predicted_recompute_flops",
                "predicted_swap_bytes", "budget_bytes")


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One layer's treatment."""

    index: int
    """Flat index across containers."""
    fqn: str
    """Dotted name of the layer."""
    mode: str
    """``off``, ``full`` or ``selective``."""
    recomputed: tuple[str, ...] = ()
    """Dotted names of the modules replayed in backward: the layer itself, or regions inside it."""
    excluded: tuple[str, ...] = ()
    """Modules inside those regions that run once and are not replayed."""
    swap: bool = False
    """Whether the tensors this layer keeps for backward live in host memory in between (its
    inputs when it recomputes, everything it saves in ``swap`` mode)."""
    found_by: str = "user path"
    """How discovery found the layer: ``declared class``, ``HF marker``, ``structure`` or ``user path``
    (hyperac.discovery)."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Plan:
    """The applied plan: backend, adapter and per-layer modes. ``str(plan)`` is a short table."""

    backend: str
    adapter: str
    layers: tuple[LayerPlan, ...]
    notes: tuple[str, ...] = ()
    predicted_bytes: int | None = None
    """``mode="auto"``: the activation bytes the estimate predicts alive when backward starts."""
    predicted_peak_bytes: int | None = None
    """``mode="auto"``: the predicted peak of live activation bytes over a step (what the budget bounds)."""
    predicted_step_seconds: float | None = None
    """``mode="auto"``: the predicted seconds of one forward and backward."""
    predicted_recompute_flops: int | None = None
    """``mode="auto"``: the FLOPs the estimate predicts it replays in backward per step."""
    predicted_swap_bytes: int | None = None
    """``mode="auto"``: the device bytes its swaps move to host memory per step."""
    budget_bytes: int | None = None
    """``mode="auto"``: the budget it was chosen for."""

    @classmethod
    def from_dict(cls, data: Any) -> Plan:
        """Rebuild a plan from :meth:`to_dict` output (e.g. read back from JSON or YAML)."""
        try:
            layers = tuple(
                LayerPlan(**{**layer, "recomputed": tuple(layer.get("recomputed", ())),
                             "excluded": tuple(layer.get("excluded", ()))})
                for layer in data["layers"]
            )
            fields = {k: data[k] for k in _PREDICTIONS if k in data}
            return cls(backend=data["backend"], adapter=data.get("adapter", "none"), layers=layers,
                       notes=tuple(data.get("notes", ())), **fields)
        except (KeyError, TypeError) as error:
            raise ConfigError(f"Config.plan is not a plan dict (as Plan.to_dict() writes it): {error}") from None

    def count(self, mode: str) -> int:
        return sum(1 for layer in self.layers if layer.mode == mode)

    def summary(self) -> str:
        """One line: backend, adapter and how many layers got each mode."""
        counts = ", ".join(
            f"{n} {mode}" for mode in ("full", "selective", "selective-even", "pointwise", "swap", "off")
            if (n := self.count(mode))
        )
        swapping = sum(1 for layer in self.layers if layer.swap)
        if swapping:
            counts += f"; {swapping} swap to host"
        return f"hyperac: backend {self.backend}, adapter {self.adapter}, {len(self.layers)} layers: {counts}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "adapter": self.adapter,
            "layers": [layer.to_dict() for layer in self.layers],
            "notes": list(self.notes),
            **{name: getattr(self, name) for name in _PREDICTIONS},
        }

    def __str__(self) -> str:
        width = max([len("layer")] + [len(layer.fqn) for layer in self.layers])
        found = max([len("found by")] + [len(layer.found_by) for layer in self.layers])
        lines = [
            self.summary(),
            f"{'#':>4}  {'layer':<{width}}  {'found by':<{found}}  {'mode':<9}  {'swap':<4}  recomputed",
        ]
        for layer in self.layers:
            swap = "yes" if layer.swap else "-"
            lines.append(
                f"{layer.index:>4}  {layer.fqn:<{width}}  {layer.found_by:<{found}}  {layer.mode:<9}  {swap:<4}  "
                f"{_describe_targets(layer)}"
            )
        if self.predicted_bytes is not None and self.predicted_peak_bytes is None:  # compiled: saved bytes
            lines.append(
                f"predicted: {self.predicted_bytes / 2**20:.2f} MiB saved for backward by the compiled layers "
                f"(budget {(self.budget_bytes or 0) / 2**20:.2f} MiB), {(self.predicted_step_seconds or 0) * 1e3:.1f} "
                f"ms per step, {(self.predicted_recompute_flops or 0) / 1e9:.3f} GFLOP replayed"
            )
        elif self.predicted_bytes is not None:
            lines.append(
                f"predicted: peak {(self.predicted_peak_bytes or 0) / 2**20:.2f} MiB (budget "
                f"{(self.budget_bytes or 0) / 2**20:.2f} MiB), {self.predicted_bytes / 2**20:.2f} MiB kept for "
                f"backward, {(self.predicted_step_seconds or 0) * 1e3:.1f} ms per step, "
                f"{(self.predicted_recompute_flops or 0) / 1e9:.3f} GFLOP replayed, "
                f"{(self.predicted_swap_bytes or 0) / 2**20:.2f} MiB swapped to host"
            )
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


def _describe_targets(layer: LayerPlan) -> str:
    if not layer.recomputed:
        return "-"
    if layer.recomputed == (layer.fqn,):
        text = "whole layer"
    else:
        text = ", ".join(t[len(layer.fqn) + 1:] or t for t in layer.recomputed)
    if layer.excluded:
        text += " (not replayed: " + ", ".join(e[len(layer.fqn) + 1:] for e in layer.excluded) + ")"
    return text


def _apply_rules(modes: list[str], rules: Sequence[LayerRule], where: str, names: str) -> None:
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
