"""``hyperac.apply`` and ``hyperac.remove``."""

from __future__ import annotations

import dataclasses
import fnmatch
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from . import _compat, _hf
from .adapters import Adapter, find_adapter, resolve_regions
from .backends import Backend, get_backend
from .compiled import mechanism_note, require_knapsack, require_offloading
from .config import KNAPSACK_MODES, MODES, RECOMPUTE_MODES, SELECTIVE_MODES, Config
from .discovery import Layer, discover_layers
from .errors import ConfigError, HyperACWarning, RankFailedError, UnsupportedModelError
from .head import COMPILED_HEAD_NOTE, head_policy, install_head, resolve_head, unweighed_note
from .layer_modes import assign_modes, reversible_note
from .length_switch import LengthSwitch, install_switched
from .plan import LayerPlan, LengthBucket, Plan
from .planner import (
    Estimate,
    auto_modes,
    estimate_layers,
    install_first_step_check,
    plan_swaps,
    remove_first_step_check,
)
from .planner.auto import last_swap, link_bandwidth
from .planner.compiled import compiled_auto_modes
from .planner.group import ALONE, PlanGroup, plan_group
from .planner.head import head_auto_modes
from .policy import OpSets, resolve_op_sets
from .recompute import (
    build_context_fn,
    install_exclusion,
    install_forced_recompute,
    install_knapsack,
    install_recompute,
    install_swap,
)
from .replay.random_sources import check_trackers_registered
from .state import STATE_KEY, AppliedState, find_owned, install_hook, undo
from .swap import LayerSwap, SwapManager, SwapStats, default_host_budget

__all__ = ["applied_plan", "apply", "estimate", "remove", "swap_stats"]

logger = logging.getLogger(__name__)

class _Default:
    """A keyword left out: reads as the ``Config`` default it stands for (``help(hyperac.apply)`` shows
    ``mode: str = 'full'``), yet is told apart from the same value passed, so that ``config=`` and a
    keyword together are refused even when the keyword repeats a default."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value

    def __repr__(self) -> str:
        return repr(self.value)


_D: dict[str, Any] = {field.name: _Default(field.default) for field in dataclasses.fields(Config)}
_Pairs = tuple[tuple[str, nn.Module], ...]
_Regions = tuple[_Pairs, _Pairs]  # a layer's recomputed (fqn, module) pairs and its excluded ones


def resolve_config(config: Config | None, fields: dict[str, Any]) -> Config:
    """One Config from ``config=`` or keyword options (those left out are ``_Default``), never both."""
    given = {name: value for name, value in fields.items() if not isinstance(value, _Default)}
    if config is None:
        return Config(**given)
    if isinstance(config, str) and config in (*MODES, "auto"):
        raise ConfigError(f"the second argument of apply is config=, got the mode {config!r}; "
                          f"pass it by name: hyperac.apply(model, mode={config!r}).")
    if not isinstance(config, Config):
        raise ConfigError(f"config must be a hyperac.Config or None, got {config!r}.")
    if given:
        raise ConfigError(
            f"pass either config= or keyword options, not both (got config and {sorted(given)}); "
            f"use dataclasses.replace(config, {', '.join(f'{k}=...' for k in sorted(given))})."
        )
    return config


def _check_model(model: Any) -> list[tuple[str, nn.Module]]:
    """Refuse models hyperac must not touch; return ``model.named_modules()`` as a list."""
    if not isinstance(model, nn.Module):
        raise UnsupportedModelError(f"hyperac.apply needs a torch.nn.Module, got {type(model).__name__}.")
    if STATE_KEY in model.__dict__:
        raise ConfigError(
            f"hyperac is already applied to this {type(model).__name__}; call hyperac.remove(model) first."
        )
    if hasattr(model, "_orig_mod") and type(model).__name__ == "OptimizedModule":
        raise UnsupportedModelError(
            "the model is already compiled (torch.compile); apply hyperac to the uncompiled module first, "
            "e.g. hyperac.apply(model._orig_mod), then compile."
        )
    modules = list(model.named_modules())
    _refuse_overlap(model, modules)
    enabled = _hf.recompute_already_enabled(modules)
    if enabled is not None:
        raise UnsupportedModelError(
            f"HF activation checkpointing is already on ({enabled}.gradient_checkpointing=True); call "
            "model.activation_checkpointing_disable() (or gradient_checkpointing_disable()) first."
        )
    _refuse_stack_recompute(modules)
    return modules


def _refuse_stack_recompute(modules: list[tuple[str, nn.Module]]) -> None:
    """Refuse a model whose training stack recomputes already: a module's ``config.recompute_granularity``
    is set (Megatron-Core's ``TransformerConfig``, as under MindSpeed and NeMo). Its blocks would
    checkpoint inside hyperac's regions and run three times per step (issue 27: 1.64x the FLOPs of no
    recompute against Megatron full's 1.32x); its flags are read when the modules are built, so hyperac
    cannot turn them off afterwards."""
    for name, module in modules:
        granularity = getattr(getattr(module, "config", None), "recompute_granularity", None)
        if isinstance(granularity, str):
            raise UnsupportedModelError(
                f"the model recomputes already: {name or type(module).__name__}.config.recompute_granularity="
                f"{granularity!r}, so its layers would be recomputed twice. Build the model with "
                "recompute_granularity=None (drop --recompute-granularity, --recompute-method, --recompute-num-layers "
                "and --recompute-modules); hyperac's mode takes their place, e.g. mode='full' or mode='selective'."
            )


def _refuse_overlap(model: nn.Module, modules: list[tuple[str, nn.Module]]) -> None:
    """Refuse an apply that would reach modules another apply owns (NOTE [Applied state is data])."""
    owned = find_owned(modules)
    if owned is None:
        return
    name, other, there = owned
    here = f"'{name}'" if name else "itself"
    if not there:
        raise ConfigError(
            f"hyperac is already applied to {here} ({other.owner}) inside this {type(model).__name__}; applies that "
            f"overlap cannot be undone independently. Call hyperac.remove(model.{name}) first, or apply to only one "
            "of them."
        )
    raise ConfigError(
        f"this {type(model).__name__} shares a module with a {other.owner} that hyperac is applied to: {here} here is "
        f"'{there}' there. Applies that overlap cannot be undone independently; call hyperac.remove on that "
        f"{other.owner} first, or apply to only one of the two."
    )


def _regions_by_layer(
    modules: dict[str, nn.Module], layers: list[Layer], modes: list[str], adapter: Adapter | None,
    config: Config, kv_sharing: bool, notes: list[str],
) -> dict[str, _Regions]:
    """Per recomputed layer fqn: (recomputed (fqn, module) pairs, excluded pairs)."""
    selected = [layer for layer, mode in zip(layers, modes) if mode in RECOMPUTE_MODES]
    if adapter is not None:
        if config.compile and adapter.declares_exclusions:
            raise ConfigError(
                "Config.compile=True cannot be combined with adapter exclusions (they need eager replay); "
                "use compile=False or an adapter without exclude_patterns/exclude_predicate."
            )
        regions = resolve_regions(adapter, modules, [layer.fqn for layer in selected])
        empty = [fqn for fqn, r in regions.items() if not r.roots]
        if empty:
            message = (
                f"Adapter.region_patterns matched nothing in {len(empty)} selected layer(s) (e.g. {empty[0]}); "
                "they run without recompute."
            )
            warnings.warn(message, HyperACWarning, stacklevel=3)
            notes.append(message)
        return {fqn: (r.roots, r.excluded) for fqn, r in regions.items()}
    if selected and kv_sharing:
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
                f"layer {layer.fqn} is already wrapped by {type(layer.wrapper).__name__}, which recomputes it "
                f"itself; unwrap it, or leave it out with layers={{{layer.index}: 'off'}}."
            )


def _swaps_by_option(config: Config, mode: str) -> bool:
    """Whether a layer in ``mode`` takes part in swap by the swap options alone."""
    return mode == "swap" or (config.swap_inputs and mode in RECOMPUTE_MODES) or (
        config.swap_selective_outputs and mode in SELECTIVE_MODES)


def _swap_flags(config: Config, backend: Backend, modes: list[str], notes: list[str],
                planned: list[bool] | None) -> list[bool]:
    """Which layers take part in swap (``planned``: as ``mode="auto"`` chose, or as ``Config.plan``
    records). Swap is dropped, with a warning, where it cannot work."""
    wanted = [_swaps_by_option(config, mode) or (planned is not None and planned[i]) for i, mode in enumerate(modes)]
    if not any(wanted):
        return wanted
    if not backend.can_swap:
        message = (f"swap has no effect on the {backend.name!r} backend (activations already live in host memory); "
                   "tensors stay on the device and 'swap' layers behave as 'off'.")
        warnings.warn(message, HyperACWarning, stacklevel=3)
        notes.append(message)
        return [False] * len(modes)
    if config.compile:
        # A compiled layer offloads only what it keeps (NOTE [Swap under torch.compile]): its input is
        # the previous graph's output, so swap_inputs, and a planned swap of a full layer, do nothing.
        offloads = [mode == "swap" or (mode in SELECTIVE_MODES and (config.swap_selective_outputs or (
            planned is not None and planned[i]))) for i, mode in enumerate(modes)]
        if any(w and not o for w, o in zip(wanted, offloads)):
            message = ("under compile=True a layer's input cannot be offloaded (it is the previous graph's output): "
                       "recomputed layers keep their input on the device, and swap_inputs is ignored (what "
                       "mode='swap' and swap_selective_outputs=True layers keep is still offloaded).")
            warnings.warn(message, HyperACWarning, stacklevel=3)
            notes.append(message)
            wanted = [w and o for w, o in zip(wanted, offloads)]
    return wanted


def _host_budget(config: Config) -> int:
    return config.host_budget_bytes if config.host_budget_bytes is not None else default_host_budget()


def apply(
    model: nn.Module,
    config: Config | None = None,
    *,
    mode: str = _D["mode"],
    backend: Any = _D["backend"],
    layers: Any = _D["layers"],
    compile: bool | str = _D["compile"],
    swap_inputs: bool = _D["swap_inputs"],
    swap_selective_outputs: bool = _D["swap_selective_outputs"],
    min_swap_bytes: int = _D["min_swap_bytes"],
    host_budget_bytes: int | None = _D["host_budget_bytes"],
    budget: Any = _D["budget"],
    sample: Any = _D["sample"],
    max_seq_len: int | None = _D["max_seq_len"],
    seq_dim: int | None = _D["seq_dim"],
    length_buckets: int = _D["length_buckets"],
    plan: Any = _D["plan"],
    adapter: Any = _D["adapter"],
    save_ops: Any = _D["save_ops"],
    force_recompute: Any = _D["force_recompute"],
    group: Any = _D["group"],
    head: str | None = _D["head"],
    head_chunk: int | None = _D["head_chunk"],
    bitwise: bool = _D["bitwise"],
) -> Plan:
    """Make ``model`` keep fewer activations on the device, by recomputing them in backward or by
    holding them in host memory. Modifies ``model`` in place; gradients are unchanged.

    Keyword options are the fields of :class:`hyperac.Config` (documented there); pass either
    ``config=`` or keywords. The change is atomic: if anything fails, the model is left exactly as
    it was. :func:`hyperac.remove` undoes it. Where ``torch.distributed`` is initialised,
    ``mode="auto"`` is a collective over ``group`` (default: the default group): call it on every
    rank of it; every rank installs the same plan.

    Args:
        model: the model to change, e.g. a transformers ``PreTrainedModel``.

    Returns:
        The :class:`Plan` that was applied; ``print(plan)`` shows it per layer.

    Raises:
        ConfigError: an option has the wrong type or value, or the model is already applied.
        BackendUnavailableError: an explicitly requested backend cannot run here.
        UnsupportedModelError: no layers were found, or HF activation checkpointing is already on.
        RankFailedError: ``mode="auto"`` over a process group, and another rank of it failed.
    """
    config = resolve_config(
        config,
        dict(mode=mode, backend=backend, layers=layers, compile=compile, swap_inputs=swap_inputs,
             swap_selective_outputs=swap_selective_outputs, min_swap_bytes=min_swap_bytes,
             host_budget_bytes=host_budget_bytes, budget=budget, sample=sample, plan=plan, adapter=adapter,
             max_seq_len=max_seq_len, seq_dim=seq_dim, length_buckets=length_buckets, save_ops=save_ops,
             force_recompute=force_recompute, group=group, head=head, head_chunk=head_chunk, bitwise=bitwise),
    )
    _compat.warn_if_untested(torch.__version__)
    named_modules = _check_model(model)
    chosen_backend = get_backend(config.backend)
    found = discover_layers(model, config.layer_spec.containers, [m for _, m in named_modules])
    prediction: dict[str, Any] = {}
    planned_swaps = None
    group = ALONE
    if config.plan is not None:
        modes = _modes_from_plan(config.plan, found)
        offloads = [layer.swap for layer in config.plan.layers]
        if any(offloads):  # the layers that offloaded offload again
            # The chain's last layer keeps its tensors and so is recorded as not swapping: a later layer
            # the swap options put in the chain (a user plan with swap_inputs) was it; else, as in
            # mode="auto" plans, the model's last layer is (NOTE [Swap in the plan]).
            last_offload = max(i for i, offload in enumerate(offloads) if offload)
            if any(_swaps_by_option(config, mode) for mode in modes[last_offload + 1:]):
                planned_swaps = offloads
            else:
                modes, planned_swaps = plan_swaps(modes, offloads)
        if config.plan.group_size is not None:  # still the plan of the group that made it
            prediction["group_size"] = config.plan.group_size
        if config.plan.buckets:  # switched by length again (NOTE [Plans per length bucket])
            prediction.update(max_seq_len=config.plan.max_seq_len, buckets=config.plan.buckets,
                              batch_shape=config.plan.batch_shape, seq_dim=config.sequence_dim)
            if config.group is not None or config.plan.group_size is not None:  # the group's buckets agree again
                group = plan_group(config.group)
    elif config.mode == "auto":
        group = plan_group(config.group)
        policy = head_policy(config, named_modules)  # NOTE [The head in the plan] in planner/head.py
        if config.compile:  # plan for compiled layers (planner/compiled.py)
            run_modes = {head: _uniform_runner(chosen_backend, config.adapter, compile=True, head=head,
                                               head_chunk=config.head_chunk)(model, _containers(found))
                         for head in ("off", "chunked")}
            modes, planned_swaps, prediction = compiled_auto_modes(
                model, found, config.budget, config.sample, run_modes, chosen_backend, config.compile, group, policy)
        elif policy:
            runners = {head: _uniform_runner(chosen_backend, config.adapter, head=head, head_chunk=config.head_chunk)
                       for head in ("off", "chunked")}
            modes, planned_swaps, prediction = head_auto_modes(
                model, found, config.budget, config.sample, runners, policy, chosen_backend, _host_budget(config),
                config.min_swap_bytes, group)
        else:
            # Plans per length bucket do not weigh the head: every length is profiled with it as installed.
            fixed_head = "chunked" if config.head == "chunked" else "off"
            modes, planned_swaps, prediction = auto_modes(
                model, found, config.budget, config.sample,
                _uniform_runner(chosen_backend, config.adapter, head=fixed_head, head_chunk=config.head_chunk),
                chosen_backend, _host_budget(config), config.min_swap_bytes, config.max_seq_len,
                config.sequence_dim, config.length_buckets, group)
        if note := unweighed_note(config, named_modules):
            warnings.warn(note, HyperACWarning, stacklevel=2)
            prediction["notes"] = [*prediction.get("notes", []), note]
    else:
        modes = assign_modes(found, config)
    try:  # NOTE [One plan per job] in planner/group.py
        installed: Plan = group.run(lambda: _apply_modes(model, named_modules, found, modes, config, chosen_backend,
                                                         planned_swaps, prediction, planned=config.mode == "auto",
                                                         group=group), "installing the plan")
    except RankFailedError:
        if STATE_KEY in model.__dict__:
            remove(model)
        raise
    return installed


# NOTE [One installation path]: apply() decides each layer's mode (from a plan, the planner or
# Config.layers), then _apply_modes installs them. The planner's profiling runner installs a uniform
# mode through _apply_modes too, so apply() never runs inside itself while `mode="auto"` plans.
def _apply_modes(model: nn.Module, named_modules: list[tuple[str, nn.Module]], found: list[Layer], modes: list[str],
                 config: Config, chosen_backend: Backend, planned_swaps: list[bool] | None,
                 prediction: dict[str, Any], planned: bool = False, group: PlanGroup = ALONE) -> Plan:
    """Install ``modes`` (one per layer of ``found``) on ``model`` atomically; return the plan.
    ``planned``: by or for ``mode="auto"``, so training forwards build no KV cache unless a layer
    swaps (NOTE [KV caches in training] in _hf.py). ``group``: the ranks whose training forwards
    agree on the length bucket (NOTE [Plans per length bucket] in length_switch.py)."""
    adapter_name, adapter_spec = find_adapter(model, config.adapter)
    configs = _hf.configs(named_modules)
    notes: list[str] = reversible_note(found) + prediction.pop("notes", [])
    buckets = prediction.get("buckets", ())
    # With buckets, longer batches recompute every layer not wrapped already (NOTE [Plans per length bucket]).
    longer = ["off" if layer.wrapper is not None else "full" for layer in found]
    regions = _regions_by_layer(
        dict(named_modules), found, longer if buckets else modes, adapter_spec, config,
        _hf.has_kv_sharing(configs), notes
    )
    swaps = _swap_flags(config, chosen_backend, modes, notes, planned_swaps)
    variants = _bucket_variants(config, chosen_backend, modes, swaps, planned_swaps, buckets, longer)
    last_swap = variants[-1][2]  # the default's, which longer batches keep
    layer_plans = []
    for i, (layer, mode, swap) in enumerate(zip(found, modes, swaps)):
        roots, excluded = regions.get(layer.fqn, ((), ())) if mode in RECOMPUTE_MODES else ((), ())
        layer_plans.append(LayerPlan(layer.index, layer.fqn, mode, tuple(f for f, _ in roots),
                                     tuple(f for f, _ in excluded), swap and i != last_swap, layer.found_by))
    if config.compile:
        notes.append(mechanism_note(modes, [layer.swap for layer in layer_plans]))
    head, head_target = resolve_head(  # NOTE [The head and the loss in chunks] in head.py
        prediction.pop("head", None) or config.head or (config.plan.head if config.plan else "off"), named_modules,
        notes)
    if config.compile and head == "chunked":
        notes.append(COMPILED_HEAD_NOTE)
    result = Plan(backend=chosen_backend.name, adapter=adapter_name, layers=tuple(layer_plans), notes=tuple(notes),
                  head=head, **prediction)
    for variant_modes, variant_swaps, *_ in variants:  # every plan a bucket may run
        _check_wrapped(found, variant_modes)
        require_knapsack(variant_modes, config.compile)
        _compat.require_for(variant_modes, variant_swaps, config)
    every_mode = {mode for variant in variants for mode in variant[0]}
    if every_mode & set(RECOMPUTE_MODES):
        check_trackers_registered(bool(config.compile))
    ops = resolve_op_sets(chosen_backend, config.save_ops) if every_mode & set(SELECTIVE_MODES) else None
    eager_swap = any(any(variant[1]) for variant in variants) and not config.compile
    manager = SwapManager(chosen_backend, config.min_swap_bytes, _host_budget(config)) if eager_swap else None
    state = AppliedState(result, type(model).__name__, manager, bucket=max(len(buckets) - 1, 0))

    def install_variant(k: int) -> None:
        variant_modes, variant_swaps, variant_last, variant_planned = variants[k]
        _install(found, variant_modes, variant_swaps, variant_last, regions, chosen_backend, ops, config, state,
                 variant_planned, check_forced=k == state.bucket)  # force_recompute names modules of the default

    try:
        if config.compile and any(layer.swap for layer in layer_plans):
            state.offload = require_offloading(link_bandwidth(chosen_backend, model),
                                               separate_stream=chosen_backend.device_type != "cpu")
        if buckets:  # NOTE [Plans per length bucket] in length_switch.py
            switched = install_switched(named_modules, state, len(variants), install_variant)
            switch = LengthSwitch(state, tuple(b.max_len for b in buckets), config.sequence_dim, result.batch_shape,
                                  switched, group)
            install_hook(model, switch, pre=True, with_kwargs=True)
        else:
            install_variant(0)
        if head_target is not None:
            install_head(head_target, state, config.head_chunk)
        if buckets or any(layer.recomputed for layer in layer_plans) or (planned and not any(swaps)):
            _hf.install_training_cache_defaults(named_modules, state)
        model.__dict__[STATE_KEY] = state
        if result.predicted_bytes is not None and result.max_seq_len is None and not config.compile:
            # compiled: saved bytes, not eager ones; max_seq_len: shorter steps keep less
            install_first_step_check(model, result.predicted_bytes)
        if adapter_spec is not None and adapter_spec.on_applied is not None:
            adapter_spec.on_applied(model)
    except BaseException:
        remove_first_step_check(model)
        undo(model, state)
        raise
    logger.info("%s", result.summary())
    return result


Variant = tuple[list[str], list[bool], int | None, list[bool] | None]
"""A plan to install: per-layer modes and swap flags, the swap chain's last layer, the planned swaps."""


def _bucket_variants(config: Config, backend: Backend, modes: list[str], swaps: list[bool],
                     planned_swaps: list[bool] | None, buckets: tuple[LengthBucket, ...],
                     longer: list[str]) -> list[Variant]:
    """The plan per length bucket, then ``longer`` (``full`` on every layer not wrapped already) with
    the default's swaps for longer batches (NOTE [Plans per length bucket]); without buckets, the
    plan alone. A bucket whose modes are the default's runs the default, swaps included; the others
    swap only as ``Config`` asks."""
    default = (modes, swaps, last_swap(swaps), planned_swaps)
    if not buckets:
        return [default]
    variants = []
    for bucket in buckets:
        bucket_modes = list(bucket.modes)
        if bucket_modes == modes:
            variants.append(default)
            continue
        with warnings.catch_warnings():  # given for the default plan already
            warnings.simplefilter("ignore", HyperACWarning)
            bucket_swaps = _swap_flags(config, backend, bucket_modes, [], None)
        variants.append((bucket_modes, bucket_swaps, last_swap(bucket_swaps), None))
    return [*variants, (longer, *default[1:])]


def _install(
    found: list[Layer], modes: list[str], swaps: list[bool], last_swap: int | None, regions: dict[str, _Regions],
    backend: Backend, ops: OpSets | None, config: Config, state: AppliedState, planned_swaps: list[bool] | None,
    check_forced: bool = True,
) -> None:
    installed: set[int] = set()
    forced = _forced_modules(found, modes, regions, config.force_recompute, check_forced)

    def claim(module: nn.Module) -> bool:
        if id(module) in installed:
            return False
        installed.add(id(module))
        return True

    for index, (layer, mode, swap) in enumerate(zip(found, modes, swaps)):
        if mode == "off" or (mode == "swap" and not swap) or id(layer.module) in installed:
            continue
        if mode in KNAPSACK_MODES:  # NOTE [Knapsack layers] in compiled.py
            claim(layer.module)
            install_knapsack(layer.module, state, layer.fqn, mode)
            continue
        if config.compile:  # NOTE [Swap under torch.compile] in compiled.py
            _install_compiled(layer, mode, swap and index != last_swap, regions, backend, ops, state, claim)
            continue
        saved_tensors = mode == "swap" or config.swap_inputs or bool(planned_swaps and planned_swaps[index])
        layer_swap = None
        if swap:
            assert state.swap is not None, "an eager swap plan has a SwapManager"
            layer_swap = LayerSwap(state.swap, index != last_swap, saved_tensors)
        if mode == "swap" and layer_swap is not None:  # a 'swap' layer that does not swap was skipped above
            claim(layer.module)
            install_swap(layer.module, state, layer.fqn, layer_swap)
            continue
        roots, excluded = regions[layer.fqn]
        context = build_context_fn(
            mode, backend, ops, compile=False, has_exclusions=bool(excluded),
            swap_outputs=swap and config.swap_selective_outputs, layer=layer.fqn, index=index,
        )
        for fqn, module in excluded:
            if claim(module):
                install_exclusion(module, state, fqn)
        if mode in SELECTIVE_MODES:
            for fqn, module in forced.get(layer.fqn, ()):
                if claim(module):
                    install_forced_recompute(module, state, fqn)
        for fqn, module in roots:
            if claim(module):
                install_recompute(module, state, fqn, context, layer_swap, index)


def _install_compiled(layer: Layer, mode: str, offloads: bool, regions: dict[str, _Regions], backend: Backend,
                      ops: OpSets | None,
                      state: AppliedState, claim: Callable[[nn.Module], bool]) -> None:
    """Install one ``compile=True`` layer: a region the compiler traces, its swap as offload tags."""
    if mode == "swap" and not offloads:
        return  # the last layer of a swap chain keeps its tensors: as 'off'
    roots = regions[layer.fqn][0] if layer.fqn in regions else ((layer.fqn, layer.module),)
    context = build_context_fn(mode, backend, ops, compile=True, has_exclusions=False, swap_outputs=offloads)
    for fqn, module in roots:
        if claim(module):
            install_recompute(module, state, fqn, context)


def _forced_modules(found: list[Layer], modes: list[str], regions: dict[str, _Regions], patterns: tuple[str, ...],
                    check: bool = True) -> dict[str, list[tuple[str, nn.Module]]]:
    """Per selective layer, the modules inside its regions that ``Config.force_recompute`` names
    (relative to the layer); with ``check``, :class:`ConfigError` for a name that matches none."""
    forced: dict[str, list[tuple[str, nn.Module]]] = {}
    matched: set[str] = set()
    for layer, mode in zip(found, modes):
        if mode not in SELECTIVE_MODES or not patterns:
            continue
        for root_fqn, root in regions[layer.fqn][0]:
            for name, module in root.named_modules(prefix=root_fqn):
                relative = name[len(layer.fqn) + 1:]
                hits = [p for p in patterns if name != root_fqn and fnmatch.fnmatchcase(relative, p)]
                if hits:
                    matched.update(hits)
                    forced.setdefault(layer.fqn, []).append((name, module))
    unmatched = [p for p in patterns if p not in matched]
    if unmatched and check:
        selective = [layer.fqn for layer, mode in zip(found, modes) if mode in SELECTIVE_MODES]
        raise ConfigError(
            f"Config.force_recompute={unmatched!r} matches no module inside the selective layers "
            f"({selective[:3]}{'...' if len(selective) > 3 else ''}); name modules relative to a layer, "
            f"as in {_example_names(found, modes)!r}."
        )
    return forced


def _example_names(found: list[Layer], modes: list[str]) -> list[str]:
    for layer, mode in zip(found, modes):
        if mode in SELECTIVE_MODES:
            return [name for name, _ in layer.module.named_modules() if name][:4]
    return []


def _modes_from_plan(plan: Plan, found: list[Layer]) -> list[str]:
    if [layer.fqn for layer in plan.layers] != [layer.fqn for layer in found]:
        raise ConfigError(
            f"Config.plan['layers'] have 'fqn' {[layer.fqn for layer in plan.layers][:3]}... ({len(plan.layers)} in "
            f"all), but this model has {[layer.fqn for layer in found][:3]}... ({len(found)}); apply a plan to the "
            "model (or an identical one) it was made for."
        )
    return [layer.mode for layer in plan.layers]


def _containers(found: list[Layer]) -> list[str]:
    return list(dict.fromkeys(layer.container for layer in found))


def _uniform_runner(backend: Backend, adapter: Any, compile: bool = False, head: str = "off",
                    head_chunk: int | None = None) -> Callable[..., Any]:
    """``runner(model, containers)(mode) -> undo``: apply one mode to every layer, or
    ``{container: {index: mode}}`` (for profiling), with the head as ``head`` says."""

    def for_model(model: nn.Module, containers: list[str] | None) -> Callable[[str], Callable[[], None]]:
        def run(mode: Any) -> Callable[[], None]:
            # A mode, or per-container layer modes (NOTE [Identical layers measured once] in planner/profile.py).
            layers, mode = (containers, mode) if isinstance(mode, str) else (mode, "off")
            config = Config(mode=mode, backend=backend, layers=layers, adapter=adapter, compile=compile, head=head,
                            head_chunk=head_chunk)
            named_modules = _check_model(model)
            found = discover_layers(model, config.layer_spec.containers, [m for _, m in named_modules])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", HyperACWarning)
                _apply_modes(model, named_modules, found, assign_modes(found, config), config, backend, None, {},
                             planned=True)
            return lambda: remove(model)

        return run

    return for_model


def estimate(model: nn.Module, sample: Any, *, backend: Any = "auto", layers: Any = None,
             device_profile: str | None = None, min_swap_bytes: int = _D["min_swap_bytes"],
             head: str | None = _D["head"], head_chunk: int | None = _D["head_chunk"]) -> Estimate:
    """Profile one step of ``model`` per mode and report, per layer and mode, the activation bytes
    kept for backward, the step's peak, the seconds and the FLOPs replayed, of steps run as an
    applied model trains: an HF model builds no KV cache (NOTE [KV caches in training] in _hf.py).
    The model is left as it was (gradients, buffers, RNG state).

    Args:
        model: works on real tensors and on a model built on the ``meta`` device.
        sample: a dict of model keyword arguments for one step, or a callable ``model -> loss``.
        backend: as for :func:`apply`.
        layers: as for :func:`apply`, but naming containers only, not modes.
        device_profile: for a model on ``meta`` only, the device whose roofline gives the seconds
            (``"h100"``, ``"h200"``, ``"a100"``, ``"910b"``, ``"cpu"``; see ``hyperac.planner.DEVICES``;
            default ``"cpu"``, this host). A model with real tensors is timed where it runs, so a
            profile there is an error.
        min_swap_bytes: as for :func:`apply`: the swap costs count only storages of at least this
            many bytes (default ``Config``'s, 1 MiB).
        head: as for :func:`apply`: ``"chunked"`` profiles every step with the head and the loss chunked
            (NOTE [The head in the plan]); ``None`` and ``"off"``, as the model computes them; not
            ``"auto"`` (an estimate profiles one head: estimate each to compare).
        head_chunk: as for :func:`apply`: tokens per chunk of the chunked head.

    Returns:
        An :class:`hyperac.planner.Estimate`; ``print()`` it for a table.
    """
    if head == "auto":  # Config would name the mode estimate() profiles with, not one the caller chose
        raise ConfigError("estimate(head='auto'): an estimate profiles the head one way; give head='off' or "
                          "head='chunked' (an estimate of each shows the head's share), or let "
                          "apply(mode='auto', head='auto') weigh both.")
    config = resolve_config(None, dict(mode="full", backend=backend, layers=layers, sample=sample,
                                       min_swap_bytes=min_swap_bytes, head=head, head_chunk=head_chunk))
    if config.layer_spec.rules:
        raise ConfigError("estimate() takes container paths in layers=, not per-layer modes.")
    named_modules = _check_model(model)
    first = next(model.parameters(), None)
    if device_profile is not None and (first is None or first.device.type != "meta"):
        where = "has no parameters" if first is None else f"is on {first.device.type!r}"
        raise ConfigError(f"estimate(device_profile={device_profile!r}) costs a model on the meta device by a "
                          f"roofline, but this model {where} and is timed where it runs; drop device_profile=, or "
                          "build the model under torch.device('meta').")
    chosen = get_backend(config.backend)
    found = discover_layers(model, config.layer_spec.containers, [m for _, m in named_modules])
    runner = _uniform_runner(chosen, None, head=config.head or "off", head_chunk=config.head_chunk)
    return dataclasses.replace(estimate_layers(model, sample, found, runner, chosen, device_profile),
                               min_swap_bytes=config.min_swap_bytes)


def applied_plan(model: nn.Module) -> Plan | None:
    """The plan applied to ``model``, or ``None`` if hyperac is not applied to it."""
    state = model.__dict__.get(STATE_KEY)
    return None if state is None else state.plan


def swap_stats(model: nn.Module) -> SwapStats | None:
    """What swap moved for ``model`` since ``apply`` (``None`` if nothing of it swaps)."""
    state = model.__dict__.get(STATE_KEY)
    return None if state is None or state.swap is None else state.swap.stats


def remove(model: nn.Module) -> None:
    """Undo :func:`apply`: restore every forward, remove every hook hyperac registered, free the swap
    buffers. Touches only what this model's apply installed (not a copy's, not another model's).
    Modifies ``model`` in place.

    Raises:
        ConfigError: hyperac is not applied to ``model``.
    """
    state = model.__dict__.get(STATE_KEY) if isinstance(model, nn.Module) else None
    if state is None:
        raise ConfigError(
            f"hyperac is not applied to this {type(model).__name__}; nothing to remove "
            "(hyperac.applied_plan(model) tells whether it is)."
        )
    remove_first_step_check(model)
    undo(model, state)
    logger.info("hyperac: removed from %s (%d layers restored)", type(model).__name__, len(state.plan.layers))
