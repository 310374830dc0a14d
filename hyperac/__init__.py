"""hyperac: train PyTorch and HF transformers models in less accelerator memory.

One call recomputes activations in backward instead of keeping them (whole layers, or an
op-level selective policy), with gradients unchanged; one call undoes it::

    import hyperac
    plan = hyperac.apply(model, mode="selective")
    print(plan)
    hyperac.remove(model)
"""

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
    RecomputeMismatchError,
    TorchVersionError,
    UnsupportedModelError,
)
from .plan import LayerPlan, Plan
from .swap import SwapStats

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
    "remove",
    "swap_stats",
    "unregister_adapter",
]
