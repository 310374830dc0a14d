"""The process-wide torch settings a recomputed forward ran under, reproduced around each replay.

NOTE [The forward's context in the replay]
torch.utils.checkpoint replays a region under the forward's autocast state, grad mode and RNG state;
whatever else the forward ran under and the replay, which runs in backward, does not, changes what the
replay computes:

* ``torch.nn.utils.parametrize.cached()``: in forward a parametrized weight read three times is
  computed once (or not at all, when the cache was filled before the region); outside ``cached()`` the
  replay computes it at each read. Selective modes see other ops ("changes state that it branches
  on"); ``full`` saves shifted tensors, and where their metadata happen to match, wrong gradients.
  The replay runs with the cache as the forward's region found it: enabled or not, and holding the
  entries it held (the same tensors, whose graph is the forward's).
* the default dtype (``torch.set_default_dtype`` around a forward): a tensor the layer creates gets
  another dtype in the replay;
* deterministic algorithms (``torch.use_deterministic_algorithms``) and the scaled-dot-product
  attention kernels enabled (``torch.nn.attention.sdpa_kernel``): another kernel, other outputs.

Each is read as the region's forward starts (a few C calls, a shallow copy of the parametrize cache
while it is enabled) and set, where it differs, for the duration of each replay. The autocast weight-
cast cache cannot be reproduced (torch keeps it out of reach): a cast that one side served from it is
accounted for instead (NOTE [Autocast casts served from the cache] in replay_check.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import attention
from torch.nn.utils import parametrize

__all__ = ["ForwardContext"]


def _settings() -> tuple[Any, ...]:
    return (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(), _sdpa_state())


def _apply(settings: tuple[Any, ...]) -> None:
    dtype, deterministic, warn_only, sdpa = settings
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    attention._sdpa_kernel(_sdpa_backends(sdpa), set_priority=True)


# NOTE [SDPA kernels read as flags]
# ``torch.nn.attention._cur_sdpa_kernel_backends(True)`` builds the list of enabled attention kernels in
# priority order with a getattr, an f-string and a sort per call: most of this context's cost, twice per layer
# invocation. The same state is each kernel's enabled flag and the priority order, read here by the C getters
# that function calls (found once), and turned into its list only where a replay must set it back. Checked at
# import against the function itself; where a torch release names them otherwise, the function is called.


def _flag_getters() -> tuple[Any, ...] | None:
    """The C getters of each attention kernel's enabled flag, in ``_backend_names``' order, where turning
    them into ``_cur_sdpa_kernel_backends(True)``'s list gives that list; else None."""
    try:
        getters = tuple(getattr(torch._C, f"_get_{name}_sdp_enabled") for name in attention._backend_names)
        matches = _list_of(_flags_read(getters), _kernels()) == attention._cur_sdpa_kernel_backends(True)
    except (AttributeError, TypeError, ValueError):
        return None
    return getters if matches else None


def _flags_read(getters: tuple[Any, ...]) -> tuple[tuple[bool, ...], tuple[int, ...]]:
    """Each kernel's enabled flag (by ``getters``) and the priority order."""
    return tuple(getter() for getter in getters), tuple(torch._C._get_sdp_priority_order())


def _list_of(state: tuple[tuple[bool, ...], tuple[int, ...]], backends: list[Any]) -> list[Any]:
    """The enabled kernels of ``state`` (flags, priority order), in priority order."""
    flags, priority = state
    return sorted((backend for backend, flag in zip(backends, flags) if flag), key=lambda b: priority.index(int(b)))


def _kernels() -> list[Any]:
    """Every attention kernel, in ``_backend_names``' order."""
    return [getattr(attention.SDPBackend, kind) for kind in attention._backend_names.values()]


_FLAGS = _flag_getters()
_BACKENDS = None if _FLAGS is None else _kernels()


def _sdpa_state() -> Any:
    """The enabled attention kernels and their order (NOTE [SDPA kernels read as flags])."""
    if _FLAGS is None:
        return tuple(attention._cur_sdpa_kernel_backends(True))
    return _flags_read(_FLAGS)


def _sdpa_backends(state: Any) -> list[Any]:
    """:func:`_sdpa_state`'s state as ``_sdpa_kernel`` takes it."""
    return list(state) if _FLAGS is None else _list_of(state, _BACKENDS)  # type: ignore[arg-type]


def _parametrize_cache() -> tuple[int, dict | None]:
    return parametrize._cache_enabled, dict(parametrize._cache) if parametrize._cache else None


def _same_cache(first: tuple[int, dict | None], second: tuple[int, dict | None]) -> bool:
    """Equal states of the parametrize cache, its tensors compared by identity."""
    a, b = first[1] or {}, second[1] or {}
    return first[0] == second[0] and a.keys() == b.keys() and all(a[key] is b[key] for key in a)


def _set_parametrize_cache(state: tuple[int, dict | None]) -> None:
    enabled, cache = state
    parametrize._cache_enabled = enabled
    parametrize._cache.clear()
    if cache:
        parametrize._cache.update(cache)


class ForwardContext:
    """What the forward of one region invocation ran under (NOTE [The forward's context in the replay]);
    entered once per replay."""

    __slots__ = ("cache", "displaced", "settings")

    def __init__(self) -> None:
        self.settings = _settings()
        self.cache = _parametrize_cache()
        self.displaced: list[tuple[Any, Any]] = []

    def __enter__(self) -> None:
        settings, cache = _settings(), _parametrize_cache()
        settings_differ, cache_differs = settings != self.settings, not _same_cache(cache, self.cache)
        self.displaced.append((settings if settings_differ else None, cache if cache_differs else None))
        if settings_differ:
            _apply(self.settings)
        if cache_differs:
            _set_parametrize_cache(self.cache)

    def __exit__(self, *exc: Any) -> None:
        settings, cache = self.displaced.pop()
        if settings is not None:
            _apply(settings)
        if cache is not None:
            _set_parametrize_cache(cache)
