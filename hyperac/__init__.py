"""hyperac: train PyTorch and HF transformers models in less accelerator memory.

One call recomputes activations in backward instead of keeping them (whole layers, or an
op-level selective policy), with gradients unchanged; one call undoes it::

    import hyperac
    plan = hyperac.apply(model, mode="selective")
    print(plan)
    hyperac.remove(model)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .adapters import Adapter, register_adapter, unregister_adapter
    from .api import applied_plan, apply, estimate, remove, swap_stats
    from .backends import Backend, available_backends, get_backend, register_backend
    from .config import Config
    from .errors import (
        BackendUnavailableError,
        ConfigError,
        HyperACError,
        HyperACWarning,
        InputWrittenError,
        RankFailedError,
        RecomputeMismatchError,
        TorchVersionError,
        UnsupportedModelError,
    )
    from .plan import LayerPlan, Plan
    from .replay.random_sources import RNGTracker, register_rng_tracker, unregister_rng_tracker
    from .swap import SwapStats

# NOTE [Lazy package]: `import hyperac` imports no torch. Each public name is imported from its
# module on first use (PEP 562), so the `hyperac` command parses its arguments (and answers
# `--help` or a bad argument) before torch and transformers load, which takes seconds of CPU.
_PUBLIC = {
    "adapters": ("Adapter", "register_adapter", "unregister_adapter"),
    "api": ("applied_plan", "apply", "estimate", "remove", "swap_stats"),
    "backends": ("Backend", "available_backends", "get_backend", "register_backend"),
    "config": ("Config",),
    "errors": ("BackendUnavailableError", "ConfigError", "HyperACError", "HyperACWarning", "InputWrittenError",
               "RankFailedError", "RecomputeMismatchError", "TorchVersionError", "UnsupportedModelError"),
    "plan": ("LayerPlan", "Plan"),
    "replay.random_sources": ("RNGTracker", "register_rng_tracker", "unregister_rng_tracker"),
    "swap": ("SwapStats",),
}
_MODULE_OF = {name: module for module, names in _PUBLIC.items() for name in names}


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    else:  # a submodule (hyperac.measure, hyperac.planner ...), as after a plain import of the package
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as error:
            if error.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})


__version__ = "0.1.0"

__all__ = [
    "Adapter",
    "Backend",
    "BackendUnavailableError",
    "Config",
    "ConfigError",
    "HyperACError",
    "HyperACWarning",
    "InputWrittenError",
    "LayerPlan",
    "Plan",
    "RNGTracker",
    "RankFailedError",
    "RecomputeMismatchError",
    "SwapStats",
    "TorchVersionError",
    "UnsupportedModelError",
    "applied_plan",
    "apply",
    "estimate",
    "available_backends",
    "get_backend",
    "register_adapter",
    "register_backend",
    "register_rng_tracker",
    "remove",
    "swap_stats",
    "unregister_adapter",
    "unregister_rng_tracker",
]
