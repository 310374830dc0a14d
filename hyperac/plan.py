"""What :func:`hyperac.apply` did to each layer: the returned :class:`Plan`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .errors import ConfigError

__all__ = ["MODE_LETTERS", "PLAN_FORMAT", "LayerPlan", "LengthBucket", "Plan", "mode_letters"]

MODE_LETTERS = {"off": "o", "pointwise": "p", "selective": "s", "selective-even": "e", "full": "F", "swap": "w",
                "knapsack-0.25": "2", "knapsack-0.5": "5", "knapsack-0.75": "7"}
"""One letter per mode, for writing a plan in a line: ``FFoo`` is full recompute on layers 0-1; a
knapsack mode is the first digit of its budget (``55oo``: budget 0.5 on layers 0-1)."""


def mode_letters(modes: Sequence[str]) -> str:
    """A plan's per-layer modes as one letter each (:data:`MODE_LETTERS`)."""
    return "".join(MODE_LETTERS[mode] for mode in modes)

PLAN_FORMAT = 1
"""The format version :meth:`Plan.to_dict` writes, as ``format_version``: :meth:`Plan.from_dict`
reads it and every older one (a dict without it was written before versions were kept) and refuses a
newer one (NOTE [Plan files])."""

_PREDICTIONS = ("predicted_bytes", "predicted_peak_bytes", "predicted_step_seconds", "predicted_recompute_flops",
                "predicted_swap_bytes", "budget_bytes", "max_seq_len", "group_size")


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
    group_size: int | None = None
    """``mode="auto"`` under ``torch.distributed``: the number of ranks of ``Config.group`` that made
    this plan together, each of which installed it (from the slowest rank's costs; NOTE [One plan
    per job] in hyperac/planner/group.py). ``None``: one process planned it alone."""

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """Rebuild a plan from :meth:`to_dict` output (e.g. read back from JSON or YAML), every field
        checked (NOTE [Plan files]).

        Raises:
            ConfigError: naming the first field that is missing, unknown or wrong, with its value and
                what is allowed; or the plan was written by a newer hyperac.
        """
        version = data.get("format_version") if isinstance(data, Mapping) else None
        if isinstance(version, int) and not isinstance(version, bool) and version > PLAN_FORMAT:
            raise ConfigError(f"Config.plan['format_version'] is {version}: the plan was written by a newer hyperac "
                              f"(this one reads plan formats up to {PLAN_FORMAT}); upgrade hyperac (pip install -U "
                              "hyperac), or write the plan again with this one.")
        _check_fields(data, _PLAN_FIELDS, "Config.plan", "a plan dict")
        layers = tuple(_layer_from_dict(position, layer) for position, layer in enumerate(data["layers"]))
        fields = {k: data[k] for k in _PREDICTIONS if k in data}
        buckets = tuple(_bucket_from_dict(position, bucket, len(layers), fields.get("max_seq_len"))
                        for position, bucket in enumerate(data.get("buckets", ())))
        bounds = [bucket.max_len for bucket in buckets]
        if buckets and (bounds != sorted(set(bounds)) or bounds[-1] != fields["max_seq_len"]):
            raise ConfigError(f"Config.plan['buckets'] have max_len {bounds!r}; give ints >= 1 in ascending order, "
                              f"the last one Config.plan['max_seq_len'] ({fields['max_seq_len']!r}).")
        batch = data.get("batch_shape")
        return cls(backend=data["backend"], adapter=data.get("adapter", "none"), layers=layers,
                   notes=tuple(data.get("notes", ())), buckets=buckets, head=data.get("head", "off"),
                   batch_shape=None if batch is None else tuple(batch), seq_dim=data.get("seq_dim"), **fields)

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
            "format_version": PLAN_FORMAT,
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
        if self.group_size is not None:
            lines.append(f"the plan of a group of {self.group_size} ranks: each installed it, planned on the slowest "
                         "rank's costs per layer and mode, within a budget per process")
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


def _layer_from_dict(position: int, layer: Mapping[str, Any]) -> LayerPlan:
    _check_fields(layer, _LAYER_FIELDS, f"Config.plan['layers'][{position}]", "a layer dict")
    return LayerPlan(**{**layer, "recomputed": tuple(layer.get("recomputed", ())),
                        "excluded": tuple(layer.get("excluded", ()))})


def _bucket_from_dict(position: int, bucket: Mapping[str, Any], count: int, max_seq_len: int | None) -> LengthBucket:
    where = f"Config.plan['buckets'][{position}]"
    _check_fields(bucket, _BUCKET_FIELDS, where, "a bucket dict")
    modes = tuple(bucket["modes"])
    if len(modes) != count:
        raise ConfigError(f"{where}['modes'] is {_shown(list(modes))}; give one mode per layer of "
                          f"Config.plan['layers'] ({count}).")
    if max_seq_len is None:
        raise ConfigError(f"{where}: a plan with length buckets needs 'max_seq_len' (the last bucket's max_len).")
    return LengthBucket(**{**bucket, "modes": modes})


# NOTE [Plan files]: a plan dict is what users keep, edit and load back (``hyperac plan --output``,
# ``apply(plan=json.load(...))``), so every field of it, of its layers and of its length buckets is
# checked as it is read, from one table per level below: a field's row says whether it is required,
# what its value may be (a named check) and that in words. A wrong field is a ConfigError naming it,
# its value and what is allowed, raised before the model is touched; a key no row has is refused
# (a misspelt field would otherwise be dropped silently). Adding a field is one row (and the
# dataclass field it fills). ``format_version`` (PLAN_FORMAT) is read first: a plan written by a newer
# hyperac, whose fields this one may not know, is refused as such; one without it is older and reads.

_FIELD_CHECKS: dict[str, Callable[[Any], bool]] = {
    "string": lambda value: isinstance(value, str),
    "bool": lambda value: isinstance(value, bool),
    "checked apart": lambda value: True,  # a layer or bucket dict: checked against its own table
    "mode": lambda value: isinstance(value, str) and value in MODE_LETTERS,
    "int >= 0": lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 0,
    "int >= 1": lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 1,
    "int >= 2": lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 2,
    "head": lambda value: value in ("off", "chunked"),
    "number >= 0": lambda value: (isinstance(value, (int, float)) and not isinstance(value, bool)
                                  and math.isfinite(value) and value >= 0),
}


@dataclasses.dataclass(frozen=True)
class _Field:
    """One key of a plan dict (NOTE [Plan files]): its value passes ``check`` (a key of
    :data:`_FIELD_CHECKS`), each item of it for ``sequence``, ``None`` too for ``optional``."""

    check: str
    allowed: str
    sequence: bool = False
    optional: bool = False
    required: bool = False

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.optional
        if not self.sequence:
            return _FIELD_CHECKS[self.check](value)
        return isinstance(value, (list, tuple)) and all(_FIELD_CHECKS[self.check](item) for item in value)


_COUNT = _Field("int >= 0", "an int >= 0, or None", optional=True)
_SECONDS = _Field("number >= 0", "a finite number >= 0, or None", optional=True)
_NAMES = _Field("string", "a list of strings (dotted module names)", sequence=True)

_PLAN_FIELDS = {
    "format_version": _Field("int >= 1", f"an int >= 1 (this hyperac writes {PLAN_FORMAT})"),
    "backend": _Field("string", "a string (the backend it was made on, e.g. 'cpu')", required=True),
    "adapter": _Field("string", "a string (the adapter's name)"),
    "layers": _Field("checked apart", "a list of layer dicts, one per layer", sequence=True, required=True),
    "notes": _Field("string", "a list of strings", sequence=True),
    "predicted_bytes": _COUNT,
    "predicted_peak_bytes": _COUNT,
    "predicted_step_seconds": _SECONDS,
    "predicted_recompute_flops": _COUNT,
    "predicted_swap_bytes": _COUNT,
    "budget_bytes": _COUNT,
    "max_seq_len": _Field("int >= 1", "an int >= 1, or None", optional=True),
    "batch_shape": _Field("int >= 1", "a list of ints >= 1 (the shape of the sample's first tensor at max_seq_len), "
                          "or None", sequence=True, optional=True),
    "seq_dim": _Field("int >= 0", "the sequence dimension as an int >= 0 (1 for (batch, seq)), or None",
                      optional=True),
    "buckets": _Field("checked apart", "a list of bucket dicts, shortest first", sequence=True),
    "head": _Field("head", "'off' (as the model computes it) or 'chunked' (hyperac/head.py)"),
    "group_size": _Field("int >= 2", "an int >= 2 (the ranks that made the plan together), or None", optional=True),
}
_LAYER_FIELDS = {
    "index": _Field("int >= 0", "an int >= 0 (the layer's flat index)", required=True),
    "fqn": _Field("string", "a string (the layer's dotted name)", required=True),
    "mode": _Field("mode", f"one of {sorted(MODE_LETTERS)}", required=True),
    "recomputed": _NAMES,
    "excluded": _NAMES,
    "swap": _Field("bool", "true or false"),
    "found_by": _Field("string", "a string (how discovery found the layer)"),
}
_BUCKET_FIELDS = {
    "max_len": _Field("int >= 1", "an int >= 1", required=True),
    "modes": _Field("mode", f"a list of modes, each one of {sorted(MODE_LETTERS)}", sequence=True, required=True),
    "predicted_peak_bytes": _COUNT,
    "predicted_step_seconds": _SECONDS,
    "predicted_bytes": _COUNT,
    "predicted_recompute_flops": _COUNT,
}


_WRITTEN = "as Plan.to_dict() and `hyperac plan --output` write it"


def _shown(value: Any) -> str:
    """``repr(value)``, cut after 100 characters (a list of 80 layers)."""
    text = repr(value)
    return text if len(text) <= 100 else text[:100] + "..."


def _check_fields(data: Any, fields: Mapping[str, _Field], where: str, what: str) -> None:
    """Raise ConfigError unless ``data`` is a dict whose keys are ``fields``' (the required ones
    included) and whose values each row accepts (NOTE [Plan files])."""
    required = sorted(name for name, field in fields.items() if field.required)
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} is a {type(data).__name__}, not a dict; give {what} with {required} (and "
                          f"optionally {sorted(set(fields) - set(required))}), {_WRITTEN}.")
    missing = [name for name in required if name not in data]
    unknown = sorted(str(key) for key in data if key not in fields)
    if missing or unknown:
        wrong = f"lacks {missing}" if missing else f"has unknown keys {unknown}"
        raise ConfigError(f"{where} {wrong}; {what} has {sorted(fields)} ({', '.join(required)} required), "
                          f"{_WRITTEN}.")
    for name, value in data.items():
        if not fields[name].accepts(value):
            raise ConfigError(f"{where}[{name!r}] is {_shown(value)}; give {fields[name].allowed}.")


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
