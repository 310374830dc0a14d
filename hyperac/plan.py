"""What :func:`hyperac.apply` did to each layer: the returned :class:`Plan`."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from .errors import ConfigError

__all__ = ["MODE_LETTERS", "LayerPlan", "LengthBucket", "Plan", "mode_letters"]

MODE_LETTERS = {"off": "o", "pointwise": "p", "selective": "s", "selective-even": "e", "full": "F", "swap": "w",
                "knapsack-0.25": "2", "knapsack-0.5": "5", "knapsack-0.75": "7"}
"""One letter per mode, for writing a plan in a line: ``FFoo`` is full recompute on layers 0-1; a
knapsack mode is the first digit of its budget (``55oo``: budget 0.5 on layers 0-1)."""


def mode_letters(modes: Sequence[str]) -> str:
    """A plan's per-layer modes as one letter each (:data:`MODE_LETTERS`)."""
    return "".join(MODE_LETTERS[mode] for mode in modes)

_PREDICTIONS = ("predicted_bytes", "predicted_peak_bytes", "predicted_step_seconds", "predicted_recompute_flops",
                "predicted_swap_bytes", "budget_bytes", "max_seq_len")


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One layer's treatment."""

    index: int
    """Flat index across containers."""
    fqn: str
    """Dotted name of the layer."""
    mode: str
    """One of :data:`hyperac.config.MODES`: ``off``, ``full``, ``selective``, ``selective-even``,
    ``pointwise``, ``swap``, or under ``compile=True`` ``knapsack-0.25/0.5/0.75`` (``mode="auto"``
    resolves to these per layer)."""
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
class LengthBucket:
    """``mode="auto"`` with ``max_seq_len=``: the plan a training batch of up to ``max_len``
    positions runs (and longer than the bucket before; NOTE [Plans per length bucket] in
    hyperac/length_switch.py)."""

    max_len: int
    modes: tuple[str, ...]
    """One mode per layer. Modes equal to the plan's own (its layers') run the plan as it is, its
    swaps included; any other bucket recomputes only (no layer swaps)."""
    predicted_peak_bytes: int | None = None
    """The predicted peak of live activation bytes of a step at ``max_len`` positions."""
    predicted_step_seconds: float | None = None
    """The predicted seconds of one forward and backward at ``max_len`` positions."""
    predicted_bytes: int | None = None
    """The activation bytes predicted alive when backward starts, at ``max_len`` positions."""
    predicted_recompute_flops: int | None = None
    """The FLOPs predicted replayed in backward, at ``max_len`` positions."""

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "modes": list(self.modes)}


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
    max_seq_len: int | None = None
    """``mode="auto"`` with ``max_seq_len=``: the sequence length the predictions are for (every
    shorter batch keeps less)."""
    batch_shape: tuple[int, ...] | None = None
    """``mode="auto"`` with ``max_seq_len=``: the shape of the sample's first tensor with
    ``max_seq_len`` positions: the fit models the length only, so a training batch larger in
    another dimension (a bigger batch) runs ``full`` on every layer, as a longer one does."""
    seq_dim: int | None = None
    """``mode="auto"`` with ``max_seq_len=``: the dimension of each training batch's first tensor
    read as its length, to pick its bucket (``Config.seq_dim``; ``None`` in plans written before it
    was kept: 1)."""
    head: str = "off"
    """What apply did to the language-model head and its loss: ``"off"`` (as the model computes them) or
    ``"chunked"`` (``Config.head``; NOTE [The head and the loss in chunks] in hyperac/head.py)."""
    buckets: tuple[LengthBucket, ...] = ()
    """``mode="auto"`` with ``max_seq_len=``: the plan per length bucket, shortest first; the last
    (up to ``max_seq_len``) is the plan's own layers, the default. Each training forward runs the
    bucket that holds its length; a longer batch runs ``full`` on every layer (with the default's
    swaps)."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Rebuild a plan from :meth:`to_dict` output (e.g. read back from JSON or YAML).

        Raises:
            ConfigError: naming the first key or layer entry that is missing or wrong.
        """
        shape = "as Plan.to_dict() or `hyperac plan --output` writes it: {'backend': ..., 'layers': [{'index': 0, " \
                "'fqn': 'model.layers.0', 'mode': 'full', ...}, ...]}"
        for key, kind, name in (("backend", str, "string"), ("layers", (list, tuple), "list")):
            if not isinstance(data.get(key), kind):
                raise ConfigError(f"Config.plan is not a plan dict: {key!r} is missing or not a {name} (keys: "
                                  f"{sorted(map(str, data))}); give one {shape}.")
        layers = tuple(_layer_from_dict(position, layer, shape) for position, layer in enumerate(data["layers"]))
        fields = {k: data[k] for k in _PREDICTIONS if k in data}
        buckets = tuple(_bucket_from_dict(position, bucket, len(layers), fields.get("max_seq_len"))
                        for position, bucket in enumerate(data.get("buckets", ())))
        bounds = [bucket.max_len for bucket in buckets]
        if buckets and (any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in bounds)
                        or bounds != sorted(set(bounds)) or bounds[-1] != fields["max_seq_len"]):
            raise ConfigError(f"Config.plan['buckets'] have max_len {bounds!r}; give ints >= 1 in ascending order, "
                              f"the last one max_seq_len ({fields['max_seq_len']!r}).")
        batch, seq_dim = data.get("batch_shape"), data.get("seq_dim")
        if seq_dim is not None and (isinstance(seq_dim, bool) or not isinstance(seq_dim, int) or seq_dim < 0):
            raise ConfigError(f"Config.plan['seq_dim'] is {seq_dim!r}; give the sequence dimension as an int >= 0 "
                              "(1 for (batch, seq)), or None.")
        return cls(backend=data["backend"], adapter=data.get("adapter", "none"), layers=layers,
                   notes=tuple(data.get("notes", ())), buckets=buckets, head=_head_from_dict(data.get("head", "off")),
                   batch_shape=None if batch is None else tuple(batch), seq_dim=seq_dim, **fields)

    def count(self, mode: str) -> int:
        return sum(1 for layer in self.layers if layer.mode == mode)

    def summary(self) -> str:
        """One line: backend, adapter and how many layers got each mode."""
        counts = ", ".join(
            f"{n} {mode}" for mode in ("full", "selective", "selective-even", "pointwise", "knapsack-0.25",
                                       "knapsack-0.5", "knapsack-0.75", "swap", "off")
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
            "batch_shape": None if self.batch_shape is None else list(self.batch_shape),
            "seq_dim": self.seq_dim,
            "head": self.head,
            "buckets": [bucket.to_dict() for bucket in self.buckets],
        }

    def __str__(self) -> str:
        width = max([len("layer")] + [len(layer.fqn) for layer in self.layers])
        found = max([len("found by")] + [len(layer.found_by) for layer in self.layers])
        modes = max([9] + [len(layer.mode) for layer in self.layers])  # knapsack-0.25 is longer than the rest
        lines = [
            self.summary(),
            f"{'#':>4}  {'layer':<{width}}  {'found by':<{found}}  {'mode':<{modes}}  {'swap':<4}  recomputed",
        ]
        for layer in self.layers:
            swap = "yes" if layer.swap else "-"
            lines.append(
                f"{layer.index:>4}  {layer.fqn:<{width}}  {layer.found_by:<{found}}  {layer.mode:<{modes}}  {swap:<4}  "
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
                + (f", at sequence length {self.max_seq_len} (shorter batches keep less)" if self.max_seq_len else "")
            )
        lines.extend(self._bucket_lines())
        if self.head == "chunked":
            lines.append("head: chunked (the head and the loss computed per chunk of tokens, again in backward)")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)

    def _bucket_lines(self) -> list[str]:
        if not self.buckets:
            return []
        default = self.buckets[-1]
        width = len(str(default.max_len))
        lines = ["plans per length bucket (chosen at each training forward by the batch's length, dimension "
                 f"{1 if self.seq_dim is None else self.seq_dim} of its first tensor):"]
        for bucket in self.buckets:
            lines.append(
                f"  up to {bucket.max_len:>{width}}: {mode_letters(bucket.modes)}  peak "
                f"{(bucket.predicted_peak_bytes or 0) / 2**20:.2f} MiB, "
                f"{(bucket.predicted_step_seconds or 0) * 1e3:.1f} ms per step"
                + ("  (default)" if bucket is default else "")
            )
        swaps = " with the default's swaps" if any(layer.swap for layer in self.layers) else ""
        lines.append(f"  longer than {default.max_len}: {'F' * len(self.layers)} (full on every layer{swaps}), "
                     "after a warning")
        return lines


def _head_from_dict(head: Any) -> str:
    if head not in ("off", "chunked"):
        raise ConfigError(f"Config.plan['head'] is {head!r}; a plan's head is 'off' or 'chunked'.")
    return str(head)


def _layer_from_dict(position: int, layer: Any, shape: str) -> LayerPlan:
    where = f"Config.plan['layers'][{position}]"
    if not isinstance(layer, Mapping):
        raise ConfigError(f"{where} is a {type(layer).__name__}, not a dict; give a plan dict {shape}.")
    known = {field.name for field in dataclasses.fields(LayerPlan)}
    missing = sorted({"index", "fqn", "mode"} - set(layer))
    unknown = sorted(set(map(str, layer)) - known)
    if missing or unknown:
        wrong = f"lacks {missing}" if missing else f"has unknown keys {unknown}"
        raise ConfigError(f"{where} {wrong}; each layer has {sorted(known)} (index, fqn and mode required).")
    if layer["mode"] not in MODE_LETTERS:
        raise ConfigError(f"{where}['mode'] is {layer['mode']!r}; a layer's mode is one of {sorted(MODE_LETTERS)}.")
    return LayerPlan(**{**layer, "recomputed": tuple(layer.get("recomputed", ())),
                        "excluded": tuple(layer.get("excluded", ()))})


def _bucket_from_dict(position: int, bucket: Any, count: int, max_seq_len: Any) -> LengthBucket:
    where = f"Config.plan['buckets'][{position}]"
    known = {field.name for field in dataclasses.fields(LengthBucket)}
    if not isinstance(bucket, Mapping) or not {"max_len", "modes"} <= set(bucket) or set(map(str, bucket)) - known:
        raise ConfigError(f"{where} is {bucket!r}; each bucket is a dict with 'max_len' and 'modes' (one per layer) "
                          f"and optionally {sorted(known - {'max_len', 'modes'})}.")
    modes = tuple(bucket["modes"])
    if len(modes) != count or any(mode not in MODE_LETTERS for mode in modes):
        raise ConfigError(f"{where}['modes'] is {list(modes)!r}; give one mode per layer ({count}), each one of "
                          f"{sorted(MODE_LETTERS)}.")
    if max_seq_len is None:
        raise ConfigError(f"{where}: a plan with length buckets needs 'max_seq_len' (the last bucket's max_len).")
    return LengthBucket(**{**bucket, "modes": modes})


def _describe_targets(layer: LayerPlan) -> str:
    if layer.mode.startswith("knapsack-"):
        return "what torch's partitioner picks (compiled)"
    if not layer.recomputed:
        return "-"
    if layer.recomputed == (layer.fqn,):
        text = "whole layer"
    else:
        text = ", ".join(t[len(layer.fqn) + 1:] or t for t in layer.recomputed)
    if layer.excluded:
        text += " (not replayed: " + ", ".join(e[len(layer.fqn) + 1:] for e in layer.excluded) + ")"
    return text
