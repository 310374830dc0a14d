"""The planner: what each mode costs per layer, and which plan fits a memory budget fastest.

- :mod:`.profile`: one profiled (and, on real tensors, timed) training step per uniform mode;
- :mod:`.cost`: the cost model built from it, :class:`Estimate` (peak bytes, kept bytes, seconds);
- :mod:`.devices` and :mod:`.dispatch`: rooflines for ``meta`` profiles, host cost per op;
- :mod:`.solver`: :func:`choose_modes`, budget -> per-layer modes;
- :mod:`.auto`: the entry points ``apply(mode="auto")`` and ``estimate`` call;
- :mod:`.group`: one plan for the ranks of a process group (NOTE [One plan per job]);
- :mod:`.attention`, :mod:`.restore`: SDPA routing on ``meta``, undoing a profile's side effects;
- :mod:`.verify`: the one-shot check of the first training step.

``hyperac.config`` never imports this package (budgets are parsed by :mod:`hyperac.budget`).
"""

from ..budget import parse_budget
from .auto import auto_modes, estimate_layers, plan_swaps
from .cost import ESTIMATE_MODES, SWAP_OPTIONS, Estimate, LayerEstimate
from .devices import DEVICES, DeviceProfile, device_profile
from .solver import choose_modes
from .verify import install_first_step_check, remove_first_step_check

__all__ = [
    "DEVICES",
    "ESTIMATE_MODES",
    "SWAP_OPTIONS",
    "DeviceProfile",
    "Estimate",
    "LayerEstimate",
    "auto_modes",
    "choose_modes",
    "device_profile",
    "estimate_layers",
    "install_first_step_check",
    "parse_budget",
    "plan_swaps",
    "remove_first_step_check",
]
