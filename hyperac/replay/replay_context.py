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
* deterministic algorithms (``torch.use_deterministic_algorithms``, and whether they fill uninitialized
  memory), the scaled-dot-product attention kernels enabled (``torch.nn.attention.sdpa_kernel``) and
  whether the math kernel may reduce in half precision (``allow_fp16_bf16_reduction_math_sdp``): another
  kernel, other outputs.

Each is read as the region's forward starts (most in one C call, NOTE [Torch's flags read as memory], and
a shallow copy of the parametrize cache while it is enabled) and set, where it differs, for the duration
of each replay. The autocast weight-cast cache cannot be reproduced (torch keeps it out of reach): a cast
that one side served from it is accounted for instead (NOTE [Autocast casts served from the cache] in
replay_check.py).
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import sys
from typing import Any, NamedTuple

import torch
from torch.nn import attention
from torch.nn.utils import parametrize

from .memory import MEMORY, reader

__all__ = ["ForwardContext"]


def _settings() -> tuple[Any, ...]:
    """The default dtype and the flags (NOTE [Torch's flags read as memory]): compared with ``==``, and, where that
    finds them different, each turned into :func:`_flags` by :func:`_decoded` and compared again."""
    if _WORDS is None:
        return torch.get_default_dtype(), _flags()
    return torch.get_default_dtype(), _WORDS.read(MEMORY)


def _decoded(settings: tuple[Any, ...]) -> tuple[Any, ...]:
    dtype, flags = settings
    return dtype, (flags if _WORDS is None else _WORDS.decode(flags))


def _flags() -> tuple[Any, ...]:
    """Deterministic algorithms (and warn only), the other switches (:data:`_SWITCHES`) and the attention kernels'
    state, through their getters."""
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            tuple(getter() for getter, _ in _SWITCHES), _sdpa_state())


def _apply(settings: tuple[Any, ...]) -> None:
    dtype, (deterministic, warn_only, switches, sdpa) = _decoded(settings)
    torch.set_default_dtype(dtype)
    torch.use_deterministic_algorithms(deterministic, warn_only=warn_only)
    for (_, setter), value in zip(_SWITCHES, switches):
        setter(value)
    attention._sdpa_kernel(_sdpa_backends(sdpa), set_priority=True)


_SWITCHES = tuple((getattr(torch._C, f"_get_{name}"), getattr(torch._C, f"_set_{name}")) for name in (
    "deterministic_fill_uninitialized_memory", "math_sdp_allow_fp16_bf16_reduction")
    if hasattr(torch._C, f"_get_{name}") and hasattr(torch._C, f"_set_{name}"))
"""The getter and setter of each other switch a replay runs under, where this torch has it: whether deterministic
algorithms fill uninitialized memory, whether the math attention kernel may reduce in half precision."""


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


# NOTE [Torch's flags read as memory]
# Even as flags (NOTE [SDPA kernels read as flags]), the settings are eleven getter calls (deterministic
# algorithms, warn only, filling uninitialized memory, the math kernel's half-precision reductions, five kernels'
# flags, the priority order), twice per layer invocation. Nine of them cost about 15 us per layer in a
# host-bound step (benchmarks/host_overhead.py), though each getter returns a byte: every call's code has
# left the caches since the last layer. All of them are fields of one C++ object next to one another
# (``at::globalContext()``, ATen/Context.h). So where a probe finds them there, the context reads the few 8-byte
# words that hold them (memory.py) in one C call, and compares those words. Words that differ (a flag changed,
# or a neighbour in the same words did) are decoded into the flags and compared again, and set back through
# torch's setters, as before. The probe runs once, at import: it takes the object's address from libtorch
# (``at::globalContext()``, exported), flips each flag and the priority order through its setter, one at a
# time, finds the one byte (the priority order: five 4-byte entries) that moves, and sets each back as it was;
# what it found must decode to what the getters return, in every state it went through. Where the symbol
# is not exported under that name (another platform), the memory around the object is not mapped as expected,
# or any flag moves other bytes, the getters are called.


_WINDOW = 4096
"""At most how many bytes from ``at::globalContext()`` the probe looks through for the flags."""


class _Words(NamedTuple):
    """Where the flags lie (NOTE [Torch's flags read as memory]): the words :attr:`read` reads, and the byte
    offsets in them of the deterministic flags, the other switches (:data:`_SWITCHES`), each kernel's flag (in
    :data:`_FLAGS`' order) and the first priority entry."""

    read: Any
    deterministic: int
    warn_only: int
    switches: tuple[int, ...]
    kernels: tuple[int, ...]
    priority: int
    length: int
    """How many priority entries."""

    def decode(self, words: tuple[int, ...]) -> tuple[Any, ...]:
        """:func:`_flags`' value, from the words read."""
        raw = struct.pack(f"={len(words)}Q", *words)
        return (raw[self.deterministic] != 0, raw[self.warn_only] != 0, tuple(raw[at] != 0 for at in self.switches),
                (tuple(raw[at] != 0 for at in self.kernels),
                 struct.unpack_from(f"={self.length}i", raw, self.priority)))


def _context_address() -> tuple[int, int] | None:
    """``at::globalContext()``'s address, where the libtorch this process loaded exports it (Linux's name for it),
    and how many bytes from it (up to :data:`_WINDOW`) are mapped readable in this process."""
    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    if not sys.platform.startswith("linux") or not os.path.exists(library):
        return None
    try:  # only the library this process has loaded (never a second copy of it)
        function = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_LOCAL)._ZN2at13globalContextEv
    except (OSError, AttributeError):
        return None
    function.restype, function.argtypes = ctypes.c_void_p, []
    address = end = function()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:  # in order of address: the readable mappings from the object's on, while contiguous
                span, permissions = line.split()[:2]
                start, stop = (int(part, 16) for part in span.split("-"))
                if start <= end < stop and permissions.startswith("r"):
                    end = stop
    except (OSError, ValueError):
        return None
    return (address, min(end - address, _WINDOW)) if end > address else None


def _moved(address: int, window: int, flip: Any, back: Any) -> list[int]:
    """The offsets of the bytes in ``window`` bytes from ``address`` that ``flip()`` moves and ``back()`` moves
    back."""
    before = ctypes.string_at(address, window)
    flip()
    try:
        after = ctypes.string_at(address, window)
    finally:
        back()
    if ctypes.string_at(address, window) != before:
        return []
    return [at for at in range(window) if before[at] != after[at]]


def _context_words() -> _Words | None:
    """Where the flags lie in ``at::globalContext()``, found and checked (NOTE [Torch's flags read as memory]),
    or None."""
    found_at = _context_address() if _FLAGS is not None else None
    if found_at is None:
        return None
    address, window = found_at
    C = torch._C
    try:
        deterministic, warn_only = C._get_deterministic_algorithms(), C._get_deterministic_algorithms_warn_only()
        order = list(C._get_sdp_priority_order())
        flips = [(lambda: C._set_deterministic_algorithms(not deterministic, warn_only=warn_only),
                  lambda: C._set_deterministic_algorithms(deterministic, warn_only=warn_only)),
                 (lambda: C._set_deterministic_algorithms(deterministic, warn_only=not warn_only),
                  lambda: C._set_deterministic_algorithms(deterministic, warn_only=warn_only))]
        kernels = [(getter, getattr(C, f"_set_sdp_use_{name}"))
                   for name, getter in zip(attention._backend_names, _FLAGS)]  # type: ignore[arg-type]
        for getter, setter in [*_SWITCHES, *kernels]:
            value = getter()
            flips.append((functools.partial(setter, not value), functools.partial(setter, value)))
        set_order = C._set_sdp_priority_order
        orders = [(functools.partial(set_order, other), functools.partial(set_order, order))
                  for other in (order[1:] + order[:1], order[::-1])]
        found = [_moved(address, window, flip, back) for flip, back in flips]
        moved = _moved(address, window, *orders[0])  # a rotation: every entry moves
        if any(len(offsets) != 1 for offsets in found) or not moved:
            return None
        singles = [address + offsets[0] for offsets in found]
        priority = address + moved[0] // 4 * 4
        first, last = min(*singles, priority) // 8, max(*singles, priority + 4 * len(order) - 1) // 8
        offsets = [at - 8 * first for at in singles]
        switches = 2 + len(_SWITCHES)
        words = _Words(reader(range(first, last + 1)), offsets[0], offsets[1], tuple(offsets[2:switches]),
                       tuple(offsets[switches:]), priority - 8 * first, len(order))
        return words if all(_decodes(words, flip, back) for flip, back in [(_none, _none), *flips, *orders]) else None
    except (AttributeError, TypeError, RuntimeError, struct.error):
        return None


def _none() -> None:
    return None


def _decodes(words: _Words, flip: Any, back: Any) -> bool:
    """Whether the words decode to what the getters give, after ``flip()`` (then undone by ``back()``)."""
    flip()
    try:
        return words.decode(words.read(MEMORY)) == _flags()
    finally:
        back()


_WORDS = _context_words()


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
        settings_differ = settings != self.settings and _decoded(settings) != _decoded(self.settings)
        cache_differs = not _same_cache(cache, self.cache)
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
