"""hyperac in HuggingFace's ``Trainer``: a callback, and a helper reading ``TrainingArguments``.

::

    from hyperac.integrations.transformers import HyperACCallback

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[HyperACCallback(mode="selective")])
    trainer.train()   # hyperac is applied when training begins and removed when it ends

The callback applies hyperac in ``on_train_begin``, after the Trainer has moved the model to its
device and wrapped it (DDP, FSDP2, ``torch.compile``: hyperac overrides the forward of the layers,
inside every wrapper's hooks, so this order works), and removes it in ``on_train_end``. Options
are those of :func:`hyperac.apply`; what they leave open is taken from the ``TrainingArguments``:

* ``activation_checkpointing=True`` (``gradient_checkpointing`` before transformers 5): HF's own
  recompute and hyperac's cannot both be on (``hyperac.apply`` refuses such a model), so HF's is
  turned off (and back on when training ends, as the Trainer leaves it) and its request becomes a
  hyperac plan: every layer ``full``; with
  ``activation_checkpointing_kwargs={"every_n_layers": n}`` layers 0, n, 2n ... ``full`` and the
  others ``off`` (the layers HF would pick); ``{"offload": True}`` adds ``swap_inputs=True``. Other
  keys (``use_reentrant`` ...) have no hyperac counterpart: hyperac's recompute is always
  non-reentrant. Explicit ``mode``/``layers``/``plan`` options win over the flag. One warning says so.
  Without that request a model with HF's flag already on (set by its ``__init__``) is refused, as
  :func:`hyperac.apply` refuses it.
* ``torch_compile=True``: ``compile=`` the ``torch_compile_backend`` (``True`` where it is unset):
  the selective policy ``torch.compile`` can trace, and ``mode="auto"`` times the layers compiled
  with the backend the Trainer compiles with.
* the device the model sits on picks the backend (``use_cpu=True`` on a GPU host gives ``cpu``).

Checkpoints saved while training load into a model without hyperac: parameter names and
``state_dict`` keys never change. (``config.json`` says ``use_cache: false`` with or without
hyperac: the Trainer sets ``model.config.use_cache = args.use_cache``, ``False`` by default.)

If ``train()`` raises, ``on_train_end`` does not run and the model stays applied; call
``hyperac.remove(trainer.model)`` to get it back (a later ``train()`` with the same callback
reuses what is applied).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import weakref
from collections.abc import Mapping
from typing import Any

from torch import nn
from transformers import TrainerCallback

from ..api import applied_plan, apply, remove, resolve_config
from ..backends import available_backends
from ..config import Config
from ..discovery import discover_layers
from ..errors import ConfigError, UnsupportedModelError
from ..plan import Plan

__all__ = ["HyperACCallback", "apply_from_training_args", "config_from_training_args"]

logger = logging.getLogger(__name__)

_FIELDS = tuple(field.name for field in dataclasses.fields(Config))
# Options that say what is recomputed: when the caller sets one, HF's flag does not.
_PLAN_FIELDS = {"mode", "layers", "plan"} & set(_FIELDS)


def _explicit_options(config: Config | None, options: Mapping[str, Any]) -> dict[str, Any]:
    """The options the caller chose; a whole ``Config`` counts as choosing every field."""
    unknown = sorted(set(options) - set(_FIELDS))
    if unknown:
        raise ConfigError(
            f"unknown hyperac option(s) {unknown}; the options are the fields of hyperac.Config: {', '.join(_FIELDS)}."
        )
    resolved = resolve_config(config, dict(options))  # validate now, not when training starts
    if config is None:
        return dict(options)
    return {field: getattr(resolved, field) for field in _FIELDS}


def _hf_recompute_request(args: Any) -> tuple[bool, dict[str, Any]]:
    """Whether ``args`` asks for HF activation checkpointing, and its keyword arguments."""
    enabled = getattr(args, "activation_checkpointing", None)
    if enabled is None:
        enabled = getattr(args, "gradient_checkpointing", None)
    kwargs = getattr(args, "activation_checkpointing_kwargs", None)
    if kwargs is None:
        kwargs = getattr(args, "gradient_checkpointing_kwargs", None)
    if isinstance(kwargs, str):
        kwargs = json.loads(kwargs)
    return bool(enabled), dict(kwargs or {})


def _model_backend(model: nn.Module) -> str:
    """The backend named like the device type of the model's parameters, if one is usable, else ``auto``."""
    parameter = next(model.parameters(), None)
    device_type = None if parameter is None else parameter.device.type
    return device_type if device_type in available_backends() else "auto"


def config_from_training_args(model: nn.Module, args: Any, config: Config | None = None, **options: Any) -> Config:
    """The :class:`hyperac.Config` that :func:`apply_from_training_args` applies.

    ``config`` or ``options`` (the fields of ``Config``) come first; what they leave open is taken
    from ``args`` (``TrainingArguments`` or any object with its attribute names) and from the model:
    see the module docstring. Logs one warning when ``args`` asks for HF activation checkpointing.
    """
    chosen = _explicit_options(config, options)
    derived: dict[str, Any] = {}
    hf_on, hf_kwargs = _hf_recompute_request(args)
    if hf_on:
        derived.update(_plan_for_hf_request(model, hf_kwargs, chosen))
    if getattr(args, "torch_compile", False) and "compile" not in chosen:
        derived["compile"] = getattr(args, "torch_compile_backend", None) or True  # what auto times with
    if "backend" not in chosen:
        derived["backend"] = _model_backend(model)
    return Config(**{**derived, **chosen})


def _plan_for_hf_request(model: nn.Module, hf_kwargs: dict[str, Any], chosen: dict[str, Any]) -> dict[str, Any]:
    """The options that stand for HF's activation checkpointing request (none if ``chosen`` sets the plan)."""
    every_n = int(hf_kwargs.pop("every_n_layers", 1) or 1)
    offload = bool(hf_kwargs.pop("offload", False))
    derived: dict[str, Any] = {}
    if _PLAN_FIELDS & set(chosen):
        what = f"your hyperac options ({', '.join(sorted(_PLAN_FIELDS & set(chosen)))}) decide what is recomputed"
    else:
        if every_n > 1:
            count = len(discover_layers(model))
            derived["mode"], derived["layers"] = "off", {index: "full" for index in range(0, count, every_n)}
            chosen_layers = sorted(derived["layers"])
            what = f"hyperac recomputes layers {chosen_layers} of {count} in full (every_n_layers={every_n})"
        else:
            derived["mode"] = "full"
            what = "hyperac recomputes every layer in full"
        if offload and "swap_inputs" not in chosen:
            derived["swap_inputs"] = True
            what += ", their inputs kept in host memory (offload=True)"
    ignored = ""
    if hf_kwargs:
        ignored = f"; {sorted(hf_kwargs)} in activation_checkpointing_kwargs have no hyperac counterpart (its " \
            "recompute is always non-reentrant)"
    logger.warning(
        "TrainingArguments.activation_checkpointing=True: HF's activation checkpointing and hyperac cannot both be "
        "on, so hyperac turns HF's off while it is applied (back on when training ends) and %s%s. Set "
        "activation_checkpointing=False to silence this.", what, ignored,
    )
    return derived


def _turn_off_hf_recompute(model: nn.Module) -> list[nn.Module]:
    """Turn HF activation checkpointing off where it is on; return the modules changed.

    Sets ``gradient_checkpointing = False`` on them, which is how HF's layers are switched (what
    ``activation_checkpointing_disable()`` does per module), so it can be undone exactly.
    """
    changed = [module for module in model.modules() if module.__dict__.get("gradient_checkpointing") is True]
    for module in changed:
        module.gradient_checkpointing = False
    return changed


# NOTE [HF's flag: one rule]: hyperac turns HF's activation checkpointing off only where the
# TrainingArguments ask for it (activation_checkpointing=True: the Trainer has just turned it on,
# and config_from_training_args warns once, saying what hyperac does instead). A flag that is on
# without that request (set by hand, or by a model's __init__ from its config, as HF Evolla does
# for config.gradient_checkpointing=True) is the model's own: the Trainer path refuses it exactly
# as hyperac.apply does (UnsupportedModelError: call activation_checkpointing_disable() first).
def _apply(model: nn.Module, args: Any, config: Config | None, options: dict[str, Any]) -> tuple[Plan, Config, list]:
    chosen = config_from_training_args(model, args, config, **options)
    changed = _turn_off_hf_recompute(model) if _hf_recompute_request(args)[0] else []
    try:
        return apply(model, chosen), chosen, changed
    except BaseException:
        _turn_on(changed)
        raise


def _turn_on(modules: list[nn.Module]) -> None:
    for module in modules:
        module.gradient_checkpointing = True


def _alive(refs: list[weakref.ref]) -> list[nn.Module]:
    return [module for ref in refs if (module := ref()) is not None]


def apply_from_training_args(model: nn.Module, args: Any, config: Config | None = None, **options: Any) -> Plan:
    """Apply hyperac to ``model`` as :func:`config_from_training_args` says, turning HF's own activation
    checkpointing off first if it is on. Atomic: if applying fails, HF's flags are put back.

    Returns:
        The applied :class:`hyperac.Plan`; ``hyperac.remove(model)`` undoes it (HF's flags stay off).
    """
    return _apply(model, args, config, options)[0]


class HyperACCallback(TrainerCallback):
    """Apply hyperac when ``Trainer.train()`` begins and remove it when training ends.

    Args:
        config: a :class:`hyperac.Config`, or ``None`` to use ``options``.
        **options: fields of :class:`hyperac.Config` (``mode``, ``layers``, ``swap_inputs`` ...),
            validated here; what they leave open comes from the ``TrainingArguments``
            (:func:`config_from_training_args`).

    After ``on_train_begin``, :attr:`plan` is the applied :class:`hyperac.Plan` and
    :attr:`applied_config` the :class:`hyperac.Config` it came from.
    """

    def __init__(self, config: Config | None = None, **options: Any) -> None:
        _explicit_options(config, options)
        self.config = config
        self.options = options
        self.plan: Plan | None = None
        self.applied_config: Config | None = None
        self._model: weakref.ref | None = None
        self._hf_modules: list[weakref.ref] = []

    def _applied_model(self) -> nn.Module | None:
        model = self._model() if self._model is not None else None
        return model if model is not None and applied_plan(model) is not None else None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise UnsupportedModelError("HyperACCallback.on_train_begin got no model; use it with a Trainer.")
        if applied_plan(model) is not None:
            if self._applied_model() is model:  # still applied from a train() that raised
                self._hf_modules += [weakref.ref(module) for module in _turn_off_hf_recompute(model)]
            else:
                logger.warning(
                    "hyperac is already applied to %s; HyperACCallback leaves it as it is and will not remove it.",
                    type(model).__name__,
                )
            return
        self.plan, self.applied_config, changed = _apply(model, args, self.config, self.options)
        self._hf_modules = [weakref.ref(module) for module in changed]
        self._model = weakref.ref(model)

    def on_train_end(self, args, state, control, **kwargs):
        model = self._applied_model()
        if model is not None:
            remove(model)
            _turn_on(_alive(self._hf_modules))  # as the Trainer left them: HF's recompute on, if it had turned it on
        self._model, self._hf_modules = None, []
