"""Every option of :func:`hyperac.apply`, validated in one place."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist

from .budget import parse_budget
from .errors import ConfigError

__all__ = ["KNAPSACK_MODES", "MODES", "Config", "LayerRule", "LayerSpec"]

KNAPSACK_MODES = {"knapsack-0.25": 0.25, "knapsack-0.5": 0.5, "knapsack-0.75": 0.75}
"""Modes that exist only under ``compile=True``, by the activation budget they give the layer's
graph: torch's partitioner knapsack (NOTE [Knapsack layers] in compiled.py)."""
MODES = ("off", "full", "selective", "selective-even", "pointwise", "swap", *KNAPSACK_MODES)
SELECTIVE_MODES = ("selective", "selective-even", "pointwise")
RECOMPUTE_MODES = ("full", *SELECTIVE_MODES)
_RANGE = re.compile(r"^\s*(\d+)\s*(?:(-)\s*(\d*)\s*)?$")


class LayerRule(NamedTuple):
    """Mode for the flat layer indices ``first..last`` (inclusive; ``last=None``: to the end)."""

    first: int
    last: int | None
    mode: str


class LayerSpec(NamedTuple):
    """The parsed ``layers`` option.

    ``containers``: explicit container paths (``None``: discover them). ``rules``: per-layer
    modes keyed by container path (``""``: flat indices across all containers).
    """

    containers: tuple[str, ...] | None
    rules: Mapping[str, tuple[LayerRule, ...]]


def _op_name(op: Any) -> str | None:
    """``namespace::op[.overload]`` of an op object or name; ``None`` for anything else."""
    if isinstance(op, str):
        return op if "::" in op else None
    if isinstance(op, torch._ops.OpOverload):
        return str(op.name())
    if isinstance(op, torch._ops.OpOverloadPacket):
        return str(op._qualified_op_name)
    if isinstance(op, torch._ops.HigherOrderOperator):
        return f"higher_order::{op.name()}"
    return None


def _parse_save_ops(value: Any) -> tuple[str, ...] | None:
    """``Config.save_ops`` as sorted op names (names pickle; op objects do not)."""
    if value is None:
        return None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ConfigError(
            f"Config.save_ops must be None or a collection of ops, got {value!r}; e.g. save_ops=['aten::mm', "
            "'aten::_scaled_dot_product_flash_attention'] or {torch.ops.aten.mm.default}."
        )
    names = []
    for op in value:
        name = _op_name(op)
        if name is None:
            raise ConfigError(
                f"Config.save_ops holds {op!r}, which is not an op: name it as 'namespace::op' or "
                "'namespace::op.overload' (e.g. 'aten::mm'), or pass torch.ops.aten.mm.default."
            )
        names.append(name)
    return tuple(sorted(set(names)))


def _parse_names(field: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable) or not all(isinstance(name, str) and name for name in value):
        raise ConfigError(
            f"Config.{field} must be a list of module names or fnmatch patterns, got {value!r}; "
            "e.g. ['mlp.gate_proj', '*.router.*']."
        )
    return tuple(value)


def _is_strict_bool(value: Any) -> bool:
    return isinstance(value, bool)


def _check_bool(field: str, value: Any) -> None:
    if not _is_strict_bool(value):
        raise ConfigError(
            f"Config.{field} must be a bool (True or False), got {value!r} of type {type(value).__name__}."
        )


def _check_compile(value: Any) -> None:
    if _is_strict_bool(value):
        return
    if not isinstance(value, str) or value not in torch.compiler.list_backends(exclude_tags=()):
        raise ConfigError(
            f"Config.compile must be a bool or the name of a torch.compile backend "
            f"({', '.join(torch.compiler.list_backends())}), got "
            f"{value!r} of type {type(value).__name__}; e.g. compile=True (Inductor) or compile='aot_eager'."
        )


def _check_byte_count(field: str, value: Any, allow_none: bool) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        allowed = "a byte count >= 0" + (" or None" if allow_none else "")
        raise ConfigError(f"Config.{field} must be {allowed}, got {value!r}; e.g. {field}=1 << 20 (1 MiB).")


def _parse_mode(where: str, value: Any) -> str:
    if value is False:  # YAML reads a bare `off` as False
        return "off"
    if isinstance(value, str) and value in MODES:
        return value
    raise ConfigError(
        f"{where} must be one of {', '.join(repr(m) for m in MODES)} (or False for 'off'), got {value!r}."
    )


def _parse_rules(where: str, mapping: Mapping[Any, Any]) -> tuple[LayerRule, ...]:
    rules = []
    for key, value in mapping.items():
        mode = _parse_mode(f"{where}[{key!r}]", value)
        if isinstance(key, bool):
            raise ConfigError(f"{where} key {key!r} is a bool; use a layer index like 3 or a range like '0-3'.")
        if isinstance(key, int):
            if key < 0:
                raise ConfigError(f"{where} key {key!r} is negative; layer indices start at 0.")
            rules.append(LayerRule(key, key, mode))
            continue
        match = _RANGE.match(key) if isinstance(key, str) else None
        if match is None:
            raise ConfigError(
                f"{where} key {key!r} is not a layer index or range; use 3, '3', '0-3' or '4-' (to the end)."
            )
        first = int(match.group(1))
        last = None if match.group(2) and not match.group(3) else int(match.group(3) or first)
        if last is not None and last < first:
            raise ConfigError(f"{where} range {key!r} ends before it starts; write it as '{last}-{first}'.")
        rules.append(LayerRule(first, last, mode))
    # NOTE [A single index overrides its range]: `{"4-": "selective", 7: "off"}` reads "a range,
    # then an exception": the more specific entry wins. Ranges may not overlap each other, nor may
    # two entries name the same single index; the rules are ordered ranges first, so that applying
    # them in order (hyperac.layer_modes) lets each single index have the last word.
    ranges = sorted((r for r in rules if not _is_single(r)), key=lambda r: r.first)
    singles = sorted((r for r in rules if _is_single(r)), key=lambda r: r.first)
    for group in (ranges, singles):
        for before, after in zip(group, group[1:]):
            if before.last is None or before.last >= after.first:
                raise ConfigError(
                    f"{where} entries overlap: layers {_describe(before)} and {_describe(after)}; give each layer "
                    "one mode (a single index may sit inside a range: it overrides the range there)."
                )
    return (*ranges, *singles)


def _is_single(rule: LayerRule) -> bool:
    return rule.last == rule.first


def _describe(rule: LayerRule) -> str:
    if _is_single(rule):
        return str(rule.first)
    return f"{rule.first}-{'' if rule.last is None else rule.last}"


def _is_index_key(key: Any) -> bool:
    return isinstance(key, int) or (isinstance(key, str) and _RANGE.match(key) is not None)


def parse_layers(value: Any) -> LayerSpec:
    """Parse ``Config.layers``; raise :class:`ConfigError` naming the bad part."""
    if value is None:
        return LayerSpec(None, {})
    if isinstance(value, str):
        value = [value]
    if isinstance(value, Mapping):
        if not value:
            raise ConfigError("Config.layers is an empty mapping; pass None to recompute every layer.")
        index_keys = [k for k in value if _is_index_key(k) or isinstance(k, bool)]
        if len(index_keys) == len(value):
            return LayerSpec(None, {"": _parse_rules("Config.layers", value)})
        if index_keys:
            raise ConfigError(
                f"Config.layers mixes layer indices {index_keys!r} with container paths; use flat indices "
                "only, or container paths only (each mapped to a mode or to its own index mapping)."
            )
        for path in value:
            if not isinstance(path, str) or not path:
                raise ConfigError(
                    f"Config.layers key {path!r} is neither a layer index or range (3, '0-3', '4-') nor a "
                    "container path like 'model.layers'."
                )
        rules = {}
        for path, sub in value.items():
            where = f"Config.layers[{path!r}]"
            if isinstance(sub, Mapping):
                rules[path] = _parse_rules(where, sub)
            else:
                rules[path] = (LayerRule(0, None, _parse_mode(where, sub)),)
        return LayerSpec(tuple(value), rules)
    if isinstance(value, Sequence) and value and all(isinstance(p, str) and p for p in value):
        if len(set(value)) != len(value):
            raise ConfigError(f"Config.layers lists a container path twice: {list(value)!r}.")
        return LayerSpec(tuple(value), {})
    raise ConfigError(
        f"Config.layers must be None, a container path like 'model.blocks', a list of paths, or a mapping "
        f"of layer index/range to mode like {{'0-3': 'full', 7: 'off'}}; got {value!r}."
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    """How :func:`hyperac.apply` changes a model. Every field is validated on construction."""

    mode: str = "full"
    """Default mode of each layer: ``"off"`` keeps every activation (``False``, YAML's reading of a
    bare ``off``, means the same), ``"full"`` keeps only the layer input and recomputes the layer in
    backward, ``"selective"`` keeps the outputs of expensive ops (every other matmul, attention
    where it costs as many FLOPs per byte as a matmul, collectives) and recomputes the rest
    (``"selective-even"``: the other half of the matmuls),
    ``"pointwise"`` keeps every matmul's output too and
    recomputes only cheap ops (norms, activations, pointwise), ``"swap"`` recomputes nothing but keeps the tensors the
    layer saves for backward (those of at least ``min_swap_bytes``) in host memory. ``"knapsack-0.25"``,
    ``"knapsack-0.5"`` and ``"knapsack-0.75"`` (with ``compile``) keep what torch's partitioner knapsack keeps at
    that budget; ``"auto"`` chooses one mode per layer to fit ``budget`` (with ``sample``)."""

    backend: Any = "auto"
    """``"auto"`` (NPU, then CUDA, then CPU), a registered backend name, or a Backend instance."""

    layers: Any = None
    """Which layers, and per-layer modes. ``None``: discover the repeated layers. A container path
    (``"model.blocks"``) or a list of them: those containers' children. A mapping of flat layer
    index or inclusive range to mode (``{"0-3": "full", "4-": "selective", 7: "off"}``); layers it
    does not name get ``mode``. A single index inside a range overrides the range there (layer 7 is
    ``off`` above); ranges that overlap each other are an error. A mapping of container path to a
    mode or to such an index mapping."""

    compile: bool | str = False
    """The layers will run under ``torch.compile``: each mode becomes a mechanism the compiler
    traces (checkpoint regions, selective-checkpoint tags, activation offloading for swap; see
    hyperac/compiled.py), and ``mode="auto"`` plans for compiled layers, timing them compiled with
    the backend they will be compiled with: ``True`` is torch.compile's default (``"inductor"``), a
    string names another (``"aot_eager"``: ``torch.compiler.list_backends(exclude_tags=())``)."""

    swap_inputs: bool = False
    """Layers that recompute keep their inputs in host memory between forward and backward (copies
    overlap compute; the model's last swapping layer keeps them, its backward comes first)."""

    swap_selective_outputs: bool = False
    """Selective layers also keep the op outputs their policy saves in host memory (moved out after
    the layer's forward, back before its replay)."""

    min_swap_bytes: int = 1 << 20
    """Tensors whose storage is smaller than this stay on the device (copies of tiny tensors cost
    more than they free)."""

    host_budget_bytes: int | None = None
    """Most host memory the swap buffers may take. ``None``: half of the host's physical memory
    divided by ``LOCAL_WORLD_SIZE`` (set by torchrun; 1 when unset), so the processes on one node
    share half of it. When it is spent, further tensors stay on the device, with one warning."""

    budget: Any = None
    """``mode="auto"``: the activation bytes a step may keep, as a byte count, a size string like
    ``"24GiB"``, or a fraction in (0, 1] of what the model keeps with nothing recomputed."""

    sample: Any = None
    """``mode="auto"``: a dict of model keyword arguments for one step (``input_ids``, ``labels``...),
    or a callable ``model -> loss``; profiled once per mode to estimate each layer's costs."""

    max_seq_len: int | None = None
    """``mode="auto"``: plan for batches up to this sequence length (the sample profiled at its own
    length and at half of it, the costs fitted as functions of the length); ``None``: the sample's."""

    seq_dim: int | None = None
    """``max_seq_len=``: the dimension of the sample's tensors that is the sequence length, and of
    each training batch's first tensor that picks its length bucket. ``None``: a ``plan``'s own
    (kept with its buckets), else 1."""

    length_buckets: int = 4
    """``max_seq_len=``: how many length buckets get a plan each, with bounds evenly spaced up to
    ``max_seq_len`` (4: L/4, L/2, 3L/4, L); each training forward runs the plan of the smallest
    bucket that holds its length. 1: the plan for ``max_seq_len`` on every batch up to it."""

    plan: Any = None
    """A :class:`hyperac.Plan` (or its ``to_dict()``) to apply again: its per-layer modes, and its
    plans per length bucket where it has them (switched by length again, along its ``seq_dim``). Swap of
    recomputed layers still follows ``swap_inputs``/``swap_selective_outputs`` (``swap`` layers swap)."""

    adapter: Any = None
    """Recompute regions inside layers. ``None`` (or ``"none"``): whole layers, whatever is
    registered. An :class:`hyperac.Adapter`; a registered name; or ``"auto"``: the adapter
    registered for the model's ``model_type``, architecture or class, if any (the registry is
    consulted only when asked: NOTE [The registry is asked, never implied] in adapters.py)."""

    save_ops: Any = None
    """Selective modes: the ops whose outputs are kept, in place of hyperac's list (torchtitan's
    ``SelectiveAC.get_save_ops`` override). ``None``: hyperac's. Otherwise a collection of ops:
    names (``"aten::mm"``: every overload; ``"aten::mm.default"``: one) or op objects
    (``torch.ops.aten.mm.default``, ``torch.ops.aten.mm``, a higher-order op like flex attention).
    Listed matmuls alternate as usual (``pointwise``: all kept), unlisted ones are recomputed, as
    is every other unlisted op but collectives, which are kept listed or not (a replayed collective
    would run on one rank only: NOTE [Collectives by their schema] in op_identity.py), and routes,
    kept unlisted too (NOTE [Routing is kept] in replay/routing.py)."""

    force_recompute: Any = ()
    """Selective modes: modules inside each layer whose ops keep nothing, named relative to the
    layer (``"mlp.gate_proj"``) or by an ``fnmatch`` pattern (``"*.router.*"``); their matmuls do
    not count in the alternation (torchtitan's ``force_recompute_mm_shapes_by_fqns``, by module
    rather than by weight shape, so a matmul of the same shape elsewhere is not affected). A name
    that matches no module inside a selective layer is an error. A router named here gives up
    routes taken from the forward (NOTE [Routing is kept] in replay/routing.py): its ``topk`` runs again."""

    group: Any = None
    """``mode="auto"`` where ``torch.distributed`` is initialised: the process group that plans
    together, and whose ranks all install the one plan decided from all their measurements (the
    slowest rank's cost per layer and mode; NOTE [One plan per job] in hyperac/planner/group.py).
    ``apply`` is then a collective over it: call it on every rank of the group, with the same
    ``budget``, sample shapes and length options. ``None``: the default group. A pipeline stage
    passes its stage's group (stages hold other layers under the same names). With ``plan``: the
    ranks whose training forwards agree on the length bucket (default: the default group where the
    plan was a group's)."""

    head: str | None = None
    """The language-model head and its token loss, where hyperac sees both (an HF ``*ForCausalLM``
    computing ``ForCausalLMLoss`` from ``labels=``; NOTE [The head and the loss in chunks] in
    hyperac/head.py). ``"off"``: as the model computes them. ``"chunked"``: per chunk of tokens, the
    logits computed again in backward, so no step keeps more than one chunk's logits (one more head
    projection per step; the loss bitwise on the CPU, the gradients within float32 rounding).
    ``"auto"`` (with ``mode="auto"``): the planner weighs both, like a layer mode, and keeps the faster
    plan that fits. ``None``: ``"off"`` for a fixed mode; ``mode="auto"`` keeps the head as it is unless
    only chunking it meets the budget (then with a warning), and never with ``bitwise=True``. A model
    whose loss hyperac cannot see keeps its head, and ``print(plan)`` says why. With ``compile`` the
    head and the loss run eagerly between the compiled graphs (NOTE [The chunked head under
    torch.compile] in hyperac/head.py); with ``max_seq_len`` the plan does not weigh the head
    (``"auto"`` keeps it, and says so)."""

    head_chunk: int | None = None
    """Tokens per chunk of the chunked head. ``None``: a power of two that makes one chunk's logits
    about the size of all the hidden states (tokens x hidden), as Liger's fused loss does, and at least
    128 tokens (fewer spend their time reading the head weight again)."""

    bitwise: bool = False
    """Whether every result must be bitwise that of the un-applied model (CPU float32). The layer modes
    are, either way; ``True`` also refuses what changes a sum's order (``head="chunked"``), and keeps
    ``mode="auto"`` from choosing it. ``False`` accepts float32 rounding there."""

    def __post_init__(self) -> None:
        if cast(object, self.mode) is False:  # YAML reads a bare `off` as False
            object.__setattr__(self, "mode", "off")
        if not isinstance(self.mode, str) or self.mode not in (*MODES, "auto"):
            raise ConfigError(
                f"Config.mode must be one of {', '.join(repr(m) for m in (*MODES, 'auto'))}, got {self.mode!r}; "
                "e.g. mode='selective'."
            )
        for field in ("swap_inputs", "swap_selective_outputs"):
            _check_bool(field, getattr(self, field))
        _check_compile(self.compile)
        _check_byte_count("min_swap_bytes", self.min_swap_bytes, allow_none=False)
        _check_byte_count("host_budget_bytes", self.host_budget_bytes, allow_none=True)
        from .adapters import Adapter
        from .backends import Backend

        if not isinstance(self.backend, (str, Backend)):
            raise ConfigError(
                f"Config.backend must be 'auto', a backend name like 'cuda', or a Backend instance; "
                f"got {self.backend!r}."
            )
        if not (self.adapter is None or isinstance(self.adapter, (str, Adapter))):
            raise ConfigError(
                f"Config.adapter must be None, 'none', 'auto', a registered adapter name or a hyperac.Adapter; "
                f"got {self.adapter!r}."
            )
        object.__setattr__(self, "_layer_spec", parse_layers(self.layers))
        object.__setattr__(self, "save_ops", _parse_save_ops(self.save_ops))
        object.__setattr__(self, "force_recompute", _parse_names("force_recompute", self.force_recompute))
        self._check_auto()
        self._check_head()
        self._check_policy_options()
        self._check_swap_needs()

    def _check_auto(self) -> None:
        from .plan import Plan

        if self.mode == "auto":
            if self.budget is None or self.sample is None:
                raise ConfigError(
                    f"Config.mode='auto' needs budget= and sample= (got budget={self.budget!r}, "
                    f"sample={type(self.sample).__name__}); e.g. budget='24GiB', sample={{'input_ids': ids}}."
                )
            parse_budget(self.budget)
            if self.layer_spec.rules:
                raise ConfigError(
                    "Config.mode='auto' chooses each layer's mode itself; pass no per-layer modes "
                    "(Config.layers may name containers, as a path or a list of paths)."
                )
        elif self.budget is not None:
            raise ConfigError(f"Config.budget={self.budget!r} only applies to mode='auto', not {self.mode!r}.")
        elif self.max_seq_len is not None:
            raise ConfigError(
                f"Config.max_seq_len={self.max_seq_len!r} only applies to mode='auto', not {self.mode!r}."
            )
        if self.max_seq_len is not None and self.compile:
            raise ConfigError(
                f"Config.max_seq_len={self.max_seq_len!r} is not supported with compile=True yet (the compiled "
                "planner measures the sample's length only); pass a sample at the longest length instead."
            )
        if self.max_seq_len is not None and (isinstance(self.max_seq_len, bool) or not isinstance(
                self.max_seq_len, int) or self.max_seq_len < 1):
            raise ConfigError(f"Config.max_seq_len must be a positive int, got {self.max_seq_len!r}; e.g. 4096.")
        if isinstance(self.length_buckets, bool) or not isinstance(self.length_buckets, int) or self.length_buckets < 1:
            raise ConfigError(f"Config.length_buckets must be an int >= 1, got {self.length_buckets!r}; e.g. 4.")
        if self.seq_dim is not None and (isinstance(self.seq_dim, bool) or not isinstance(self.seq_dim, int)
                                         or self.seq_dim < 0):
            raise ConfigError(f"Config.seq_dim must be an int >= 0, got {self.seq_dim!r}; e.g. 1 for (batch, seq).")
        if self.group is not None and self.mode != "auto" and self.plan is None:
            raise ConfigError(f"Config.group={self.group!r} only applies to mode='auto' or plan= (the ranks that plan, "
                              f"or switch length buckets, together), not mode={self.mode!r} alone; drop group=.")
        if self.group is not None and not (dist.is_available() and isinstance(self.group, dist.ProcessGroup)):
            raise ConfigError(f"Config.group must be None or a torch.distributed ProcessGroup, got {self.group!r}; "
                              "e.g. group=torch.distributed.new_group([0, 1]).")
        if self.sample is not None and not (isinstance(self.sample, Mapping) or callable(self.sample)):
            raise ConfigError(
                f"Config.sample must be a dict of model keyword arguments or a callable model -> loss, "
                f"got {type(self.sample).__name__}."
            )
        if self.plan is not None:
            if not isinstance(self.plan, (Plan, Mapping)):
                raise ConfigError(
                    f"Config.plan must be a hyperac.Plan or its to_dict(), got {type(self.plan).__name__}."
                )
            plan = Plan.from_dict(self.plan) if isinstance(self.plan, Mapping) else self.plan
            object.__setattr__(self, "plan", plan)
            if plan.buckets and self.compile:
                raise ConfigError(
                    f"Config.plan has length buckets (max_seq_len={plan.max_seq_len}), which are not supported "
                    "with compile=True yet (each bucket's plan would be another graph); apply it with compile=False."
                )
        planned = self.plan.seq_dim if isinstance(self.plan, Plan) else None
        if planned is not None and self.seq_dim not in (None, planned):
            raise ConfigError(
                f"Config.seq_dim={self.seq_dim!r} contradicts the plan's seq_dim={planned!r}, the dimension its length "
                f"buckets were planned along; drop seq_dim= (the plan switches along dimension {planned})."
            )

    def _check_head(self) -> None:
        if cast(object, self.head) is False:  # YAML reads a bare `off` as False
            object.__setattr__(self, "head", "off")
        if self.head not in (None, "off", "chunked", "auto"):
            raise ConfigError(f"Config.head must be None, 'off', 'chunked' or 'auto', got {self.head!r}; e.g. "
                              "head='chunked'.")
        if self.head == "auto" and (self.mode != "auto" or self.bitwise):
            raise ConfigError(
                f"Config.head='auto' lets mode='auto' weigh the chunked head, but mode={self.mode!r} and "
                f"bitwise={self.bitwise!r}; use mode='auto' with bitwise=False, or head='off' or 'chunked'."
            )
        _check_bool("bitwise", self.bitwise)
        if self.head_chunk is not None and (isinstance(self.head_chunk, bool) or not isinstance(self.head_chunk, int)
                                            or self.head_chunk < 1):
            raise ConfigError(f"Config.head_chunk must be None or an int >= 1 (tokens per chunk), got "
                              f"{self.head_chunk!r}; e.g. head_chunk=1024.")
        # A plan applied with head=None installs the head as the plan has it (api._apply_modes).
        planned = self.head is None and getattr(self.plan, "head", "off") == "chunked"
        chunked = "Config.plan's head 'chunked'" if planned else "Config.head='chunked'"
        if (self.head == "chunked" or planned) and self.bitwise:
            raise ConfigError(
                f"{chunked} with bitwise=True: the chunked head sums its weight's gradient chunk by chunk, "
                "within float32 rounding of the un-chunked sum, not bitwise. Drop one: head='off' keeps "
                "results bitwise, bitwise=False accepts the rounding."
            )

    @property
    def sequence_dim(self) -> int:
        """``seq_dim`` resolved: as given, else the plan's, else 1."""
        if self.seq_dim is not None:
            return self.seq_dim
        return 1 if self.plan is None or self.plan.seq_dim is None else self.plan.seq_dim

    def _check_policy_options(self) -> None:
        given = [field for field, value in (("save_ops", self.save_ops is not None),
                                            ("force_recompute", bool(self.force_recompute))) if value]
        if not given:
            return
        if self.mode == "auto":
            raise ConfigError(
                f"Config.{given[0]}= does not combine with mode='auto': the planner profiles hyperac's own selective "
                "policy, so its costs would not be those of the policy applied. Apply a fixed mode (or plan=) with it."
            )
        modes = {self.mode} | {rule.mode for rules in self.layer_spec.rules.values() for rule in rules}
        if self.plan is None and not modes & set(SELECTIVE_MODES):
            raise ConfigError(
                f"Config.{given[0]}= tunes the selective modes, but the modes are {sorted(modes)}; use "
                "mode='selective' (or name selective layers in Config.layers)."
            )
        if self.compile and self.force_recompute:
            raise ConfigError(
                f"Config.force_recompute={list(self.force_recompute)!r} does not combine with compile=True: the "
                "compiled policy sees ops, not the modules running them. Use compile=False, or save_ops= to recompute "
                "by op."
            )

    def _check_swap_needs(self) -> None:
        modes = {self.mode} | {rule.mode for rules in self.layer_spec.rules.values() for rule in rules}
        forced = [field for field in ("swap_inputs", "swap_selective_outputs") if getattr(self, field)]
        if self.mode == "auto" and forced:
            raise ConfigError(
                f"Config.{forced[0]}=True does not combine with mode='auto': the planner chooses which layers swap "
                "(and costs them, against budget= and host_budget_bytes=), and a swap it did not choose would make "
                "its predicted peak and host bytes wrong. Drop the flag, or apply a fixed plan with it: "
                "hyperac.apply(model, plan=<the auto plan>, ...)."
            )
        if self.mode == "auto" or self.plan is not None:
            return
        if self.swap_inputs and not modes & set(RECOMPUTE_MODES):
            raise ConfigError(
                f"Config.swap_inputs=True needs layers that recompute, but every layer's mode is in {sorted(modes)}; "
                "to keep a layer's saved tensors in host memory without recomputing it, use mode='swap'."
            )
        if self.swap_selective_outputs and not modes & set(SELECTIVE_MODES):
            raise ConfigError(
                f"Config.swap_selective_outputs=True needs selective layers, but the modes are {sorted(modes)}; "
                "use mode='selective' (or name selective layers in Config.layers)."
            )

    @property
    def layer_spec(self) -> LayerSpec:
        """The parsed ``layers`` option."""
        spec: LayerSpec = self._layer_spec  # type: ignore[attr-defined]
        return spec
