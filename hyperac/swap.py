"""Swap: keep tensors saved for backward in host memory between forward and backward.

A :class:`SwapManager` belongs to one applied model (it lives in the model's hyperac state and
holds no reference to the model or its layers). Each layer invocation that swaps gets a
:class:`SwapGroup`: tensors saved for backward inside it go through the group's
``saved_tensors_hooks``; tensors kept by a selective policy are registered by the policy's
recording mode.

Copies move whole storages, once per storage: views, slices, transposes and expanded (stride-0)
tensors of one storage are rebuilt on the reloaded storage with their own offset, shape and
strides, so aliasing is preserved and nothing is copied twice.

NOTE [Swap stream ordering]
Streams and events are those of the tensors' device, never the current device's. Each group
records the compute stream current when its layer ends (``compute``): every wait it needs later
(its drop, its load) is made by that stream, named explicitly, so a wait issued while another
stream is current (a garbage collection inside a copy-stream block, a second backward stream)
still orders the right stream.
Forward, layer i ends (``SwapGroup.close``):
  1. record event C on the compute stream; the copy stream waits on C;
  2. on the copy stream: device -> host copy of each storage into a pooled (pinned) buffer;
     record the group's offload event O.
Forward, layer i+1 ends: the compute stream waits on O_i (a device-side wait), then group i drops
its device references. The device memory is free once no one else holds it; the allocator may
reuse it only for work ordered after O_i, so the copy always reads valid data. The last swapping
layer of the model is not offloaded: its backward comes first.
Backward, first unpack in group i (``SwapGroup.unpack``, ``ensure_loaded``):
  1. if group i is not loaded yet: allocate device storage on the compute stream, record event C,
     the copy stream waits on C, host -> device copy, record load event L_i;
  2. start the same load for group i-1 (prefetch: it overlaps layer i's backward);
  3. the stream that unpacks waits on L_i, then the saved tensors are rebuilt on the new storage;
     an unpack on another stream later makes that stream wait on L_i too.
Host buffers go back to the pool once the group's load has been waited on (a buffer dropped
earlier, by a pool that ``release`` closed, could be freed under the copy still reading it).
A group dropped with copies in flight (a forward never backwarded, a backward that stopped early)
makes the compute stream wait on its event first, so its device memory is reused only after
the copy. A forward that raises ends the chain: the next layer invocation has no previous group,
so no backward prefetches a group whose graph never runs backward.

NOTE [Tensors that outlive the layer]
Saved tensors are never resized: when group i drops its references (the end of layer i+1), the
device memory is freed only if nothing else holds the storage. A storage that outlives the layer
(a rotary table or mask every layer reads, a hidden state the model returns to the user) stays
valid on the device. The group keeps a weak reference to it; if the storage is still alive when
the group loads, the saved tensors are rebuilt on it and the host copy is dropped, without a
host -> device copy or a second device allocation. Such tensors count as kept (``shared``), not
as offloaded.

NOTE [Swapping selective outputs]
PyTorch's selective cache keeps op outputs outside ``saved_tensors_hooks``, so those tensors are
swapped in place: the storage is copied out and resized to zero bytes; before the replay of the
region it is re-grown and the data copied back. The tensor objects the cache holds stay valid.
A storage someone else may still read is never resized; such tensors stay on the device
(``shared``): one shared with the layer's inputs or outputs, and one referenced outside the
cache when the layer ends (a hook that recorded the op output, as HF output recorders do with
router logits; an attribute; a view or alias kept by the model). The group holds the op outputs
only weakly, so one still alive then is held elsewhere; other aliases are found by the storage's
use count, less the cache's own detached alias of each kept output.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import enum
import os
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes as _quiet
from torch.utils._pytree import tree_flatten

from ._compat import storage_use_count
from .backends import Backend
from .errors import ConfigError, warn_once
from .higher_order import FakeTensorsKept

__all__ = ["LayerSwap", "SwapManager", "SwapStats", "container_memory_limit", "current_group", "default_host_budget",
           "host_buffer_bytes", "live_group_count", "swap_ineligible"]

_LIVE_GROUPS: weakref.WeakSet = weakref.WeakSet()


def live_group_count() -> int:
    """How many swap groups exist in this process (diagnostics and leak tests)."""
    return len(_LIVE_GROUPS)


@dataclasses.dataclass
class SwapStats:
    """Swap activity of one applied model since ``apply`` (or the last :meth:`reset`)."""

    offloaded_bytes: int = 0
    reloaded_bytes: int = 0
    offloaded_tensors: int = 0
    skipped: Counter = dataclasses.field(default_factory=Counter)
    """Tensors kept on the device, by reason: ``small``, ``parameter``, ``not_on_device``,
    ``subclass``, ``layout`` (sparse, nested, quantized, or a lazy conjugate/negative view: a
    rebuilt plain tensor would lose that), ``format`` (storage in a device-private layout, such
    as an NPU's FRACTAL_NZ: NOTE [NPU internal formats]), ``last_layer``, ``budget``,
    ``modified``, ``shared`` (still held outside the layer: a kept op output found so when the
    layer ends, or a saved storage found still alive when its group loads; those leave
    ``offloaded_*`` then)."""
    waits: int = 0
    wait_seconds: float | None = None
    """Time the compute stream waited on copies, where the backend can time it."""

    def reset(self) -> None:
        timed = self.wait_seconds is not None
        for field in dataclasses.fields(self):
            setattr(self, field.name, field.default_factory() if field.default_factory is not dataclasses.MISSING
                    else field.default)
        self.wait_seconds = 0.0 if timed else None

    def __str__(self) -> str:
        skipped = ", ".join(f"{reason} {n}" for reason, n in sorted(self.skipped.items())) or "none"
        waited = "n/a" if self.wait_seconds is None else f"{self.wait_seconds * 1e3:.1f} ms"
        return (
            f"swap: offloaded {self.offloaded_tensors} tensors / {self.offloaded_bytes / 2**20:.2f} MiB, "
            f"reloaded {self.reloaded_bytes / 2**20:.2f} MiB, kept on device: {skipped}, "
            f"{self.waits} waits ({waited})"
        )


def container_memory_limit(cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """The memory limit of this process's cgroup and its ancestors (cgroup v2 ``memory.max``, v1
    ``memory/memory.limit_in_bytes``), in bytes, or ``None`` where there is none or it is unreadable."""
    try:
        with open("/proc/self/cgroup") as lines:
            entries = [line.rstrip("\n").split(":", 2) for line in lines]
    except OSError:
        entries = []
    paths = {("memory.max", ""): "/", ("memory.limit_in_bytes", "memory"): "/"}
    for _, controllers, path in (e for e in entries if len(e) == 3):
        if controllers == "":
            paths[("memory.max", "")] = path
        elif "memory" in controllers.split(","):
            paths[("memory.limit_in_bytes", "memory")] = path
    limits = []
    for (name, mount), path in paths.items():
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts) + 1):
            try:
                with open(os.path.join(cgroup_root, mount, *parts[:depth], name)) as file:
                    value = file.read().strip()
            except OSError:
                continue
            if value.isdigit() and int(value) < 1 << 60:  # "max" (v2) or a huge number (v1): no limit
                limits.append(int(value))
    return min(limits, default=None)


def default_host_budget(cgroup_root: str = "/sys/fs/cgroup") -> int:
    """Half of the host memory this process may use, shared by the processes on this node: the
    smaller of physical memory and the container's limit (:func:`container_memory_limit`; pinned
    memory counts against it, and a container past it is killed before any budget check runs),
    divided by ``LOCAL_WORLD_SIZE`` (torchrun sets it; 1 when unset)."""
    raw = os.environ.get("LOCAL_WORLD_SIZE", "1")
    local = int(raw) if raw.strip().isdigit() else 0
    if local < 1:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE={raw!r} must be a positive integer (torchrun sets it to the number of processes on "
            "this node; hyperac divides the default swap host budget by it); unset it or pass host_budget_bytes=."
        )
    try:
        physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        physical = 16 << 30
    limit = container_memory_limit(cgroup_root)
    return min(physical, limit if limit is not None else physical) // 2 // local


def host_buffer_bytes(nbytes: int) -> int:
    """The host bytes a storage of ``nbytes`` takes in the pool: a buffer rounded up to a power of two."""
    return 1 << max(nbytes - 1, 1).bit_length()


def swap_ineligible(tensor: torch.Tensor, device_type: str) -> str | None:
    """Why ``tensor`` must stay on a ``device_type`` device whatever its size (a reason of
    :attr:`SwapStats.skipped`), or ``None`` if swap can move it."""
    if type(tensor) is not torch.Tensor and type(tensor) is not nn.Parameter:
        return "subclass"
    if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter) or (
        tensor.is_leaf and tensor.requires_grad
    ):
        return "parameter"
    if tensor.device.type != device_type:
        return "not_on_device"
    if (tensor.layout is not torch.strided or tensor.is_nested or tensor.is_quantized or tensor.is_conj()
            or tensor.is_neg()):
        return "layout"
    return None


class HostPool:
    """Reusable host buffers (pinned where the backend supports it) under a byte budget.

    A copy (deepcopy, pickle) is a fresh, empty pool with the same budget and a copy of the backend.

    NOTE [Host pool size classes]
    Buffers are powers of two (``host_buffer_bytes``), kept free by size. A request takes the
    smallest free buffer that holds it, of its own size class or a larger one, so a step with
    shorter sequences reuses the buffers of a longer one instead of allocating its own; a pinned
    allocation (slow, and synchronizing on some drivers) then happens only in the first steps that
    meet a new largest size. When nothing free fits and a new buffer would pass the budget, free
    buffers are evicted, smallest first, until it fits (none when that would not make room): idle
    buffers of sizes no longer asked for never keep the budget from the tensors of the current
    step. A free buffer is never read by a copy (it returns to the pool once its load was waited
    on), so evicting it is safe.

    NOTE [Pool lock and garbage collection]
    A host buffer returns to the pool when its entry dies (``_Entry.__del__``), and the garbage
    collector can run that inside any allocation, including one made while this thread holds the
    pool's lock. The lock is reentrant so that such a return cannot deadlock; each method leaves
    the pool consistent at every point where an allocation can happen.
    """

    def __init__(self, backend: Backend, budget_bytes: int) -> None:
        self.backend = backend
        self.budget_bytes = budget_bytes
        self.allocated_bytes = 0
        self.allocations = 0
        """Host buffers allocated so far (pinned where supported)."""
        self._free: dict[int, list[torch.Tensor]] = {}
        self._closed = False
        self._lock = threading.RLock()

    def __reduce__(self) -> tuple:
        return HostPool, (self.backend, self.budget_bytes)

    def acquire(self, nbytes: int) -> torch.Tensor | None:
        """A host byte buffer of at least ``nbytes``, or ``None`` when the budget is spent
        (NOTE [Host pool size classes])."""
        size = host_buffer_bytes(nbytes)
        with self._lock:
            fits = [n for n, buffers in self._free.items() if n >= size and buffers]
            if fits:
                return self._free[min(fits)].pop()
            idle = sum(n * len(buffers) for n, buffers in self._free.items())
            if self.allocated_bytes - idle + size > self.budget_bytes:
                return None  # evicting everything idle would not make room
            for n in sorted(self._free):
                while self._free[n] and self.allocated_bytes + size > self.budget_bytes:
                    self._free[n].pop()
                    self.allocated_bytes -= n
            self.allocated_bytes += size
            self.allocations += 1
        return self.backend.host_empty(torch.empty(size, dtype=torch.uint8, device="meta"), pinned=True)

    def release(self, buffer: torch.Tensor) -> None:
        with self._lock:
            if not self._closed:
                self._free.setdefault(buffer.numel(), []).append(buffer)

    def clear(self) -> None:
        """Drop every buffer; those still in use are dropped when their groups return them."""
        with self._lock:
            self._closed = True
            self._free.clear()
            self.allocated_bytes = 0


def _flat_bytes(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


class _Entry:
    """One storage of a group: its device bytes, host copy and reloaded bytes."""

    __slots__ = ("nbytes", "device", "device_bytes", "storage_ref", "host", "cached", "watchers", "in_place", "pool",
                 "__weakref__")

    def __init__(self, storage: torch.UntypedStorage, device: torch.device, pool: HostPool, in_place: bool):
        self.nbytes = storage.nbytes()
        self.device = device
        self.device_bytes: torch.Tensor | None = _flat_bytes(storage, device)
        # Dies with the storage: alive at reload, the storage is still on the device.
        self.storage_ref = weakref.ref(storage)
        self.host: torch.Tensor | None = None
        # Op outputs a selective policy keeps, held weakly: one still alive after the layer ended
        # is held by someone besides the cache (NOTE [Swapping selective outputs]).
        self.cached: list[weakref.ref] = []
        self.watchers: list[weakref.ref] = []
        """Aliases the selective cache holds to watch writes (NOTE [Aliases with their own version
        counter] in policy.py): expected holders, like the cache's own alias of each kept output."""
        self.in_place = in_place
        self.pool = pool

    def escaped(self) -> bool:
        """Whether a kept op output of this storage is referenced outside the selective cache."""
        if any(ref() is not None for ref in self.cached):
            return True
        # Expected holders: the cache's detached alias of each kept output and each watched alias,
        # device_bytes, and the storage's Python object. A view or alias kept anywhere else adds one.
        storage = self.device_bytes.untyped_storage()
        return storage_use_count(storage._cdata) > len(self.cached) + sum(
            ref() is not None for ref in self.watchers) + 2

    def release_host(self) -> None:
        if self.host is not None:
            self.pool.release(self.host)
            self.host = None

    def __del__(self) -> None:
        self.release_host()


class _Saved:
    """What autograd stores for a tensor saved in a swap group: a detached alias while the tensor is
    on the device, its entry and how to rebuild it once it is not (``entry`` is ``None`` for a
    tensor that is never swapped).

    NOTE [Saved tensors under hooks]
    The pack hook never returns the tensor it is given: an op that saves its own output (``tanh``,
    ``exp``) would close a cycle output -> grad_fn -> saved -> output that the garbage collector
    cannot see through, and the graph of a forward never run backward would never be freed. It
    returns this object, which holds a detached alias (same storage and version counter).
    Autograd checks a saved tensor's version only when no hooks are installed, so ``unpack`` makes
    that check itself: against the alias while it is held, and against the caller's tensor while it
    lives (a weak reference), so an in-place change after the save still raises autograd's error.
    """

    __slots__ = ("group", "entry", "tensor", "original", "version", "changed", "offset", "size", "stride", "dtype",
                 "device", "rebuilt", "__weakref__")

    def __init__(self, group: SwapGroup, entry: _Entry | None, tensor: torch.Tensor) -> None:
        with _quiet():
            self.tensor: torch.Tensor | None = tensor.detach()
        self.group, self.entry, self.original = group, entry, weakref.ref(tensor)
        self.version = tensor._version
        self.changed: int | None = None  # the version seen when the alias was dropped, if it moved
        self.dtype, self.size, self.device = tensor.dtype, tensor.size(), tensor.device
        if entry is not None:  # only strided tensors have the geometry to rebuild
            self.offset, self.stride = tensor.storage_offset(), tensor.stride()
        self.rebuilt: torch.Tensor | None = None

    def drop_alias(self) -> None:
        if self.tensor._version != self.version:
            self.changed = self.tensor._version
        self.tensor = None

    def check_version(self) -> None:
        original = self.original()
        current = self.changed if self.changed is not None else next(
            (t._version for t in (self.tensor, original) if t is not None and t._version != self.version), None
        )
        if current is not None:
            with _quiet():  # the type name autograd's message shows: torch.FloatTensor
                kind = torch.empty(0, dtype=self.dtype, device=self.device).type()
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an inplace operation: "
                f"[{kind} {list(self.size)}] is at version {current}; expected version {self.version} instead. "
                "(hyperac swap checks this for autograd, which cannot while saved-tensor hooks are installed.) "
                "Hint: enable anomaly detection to find the operation that failed to compute its gradient, with "
                "torch.autograd.set_detect_anomaly(True)."
            )


class GroupState(enum.Enum):
    """Where a :class:`SwapGroup`'s tensors are: ``FORWARD`` (the layer runs; tensors are
    registered) -> ``COPYING`` (device-to-host copies in flight) -> ``HOST`` (on the host, device
    memory freed) -> ``LOADING`` (host-to-device copies in flight) -> ``LOADED``; or, when the
    forward ends, ``KEPT``: everything stays on the device (the last swapping layer, whose backward
    comes first, or a group with nothing to move)."""

    FORWARD = enum.auto()
    COPYING = enum.auto()
    HOST = enum.auto()
    LOADING = enum.auto()
    LOADED = enum.auto()
    KEPT = enum.auto()


class SwapGroup:
    """The tensors one layer invocation keeps in host memory (NOTE [Swap stream ordering])."""

    def __init__(self, manager: SwapManager, previous: SwapGroup | None, offload: bool) -> None:
        self.manager = manager
        self.previous = weakref.ref(previous) if previous is not None else None
        self.offload = offload
        self.entries: dict[int, _Entry] = {}
        # Weak: each _Saved holds its group, and autograd holds the _Saved (no cycle to collect).
        self.saved: list[weakref.ref] = []
        self.state = GroupState.FORWARD
        self.offload_event: Any = None
        self.load_event: Any = None
        self.device: torch.device | None = None
        self.compute: Any = None  # the compute stream when the layer ended: it makes every wait
        self.load_waiters: list[Any] = []  # the streams that waited on load_event
        self.backward_started = False
        _LIVE_GROUPS.add(self)

    def __del__(self) -> None:
        # Dropped with copies in flight (a forward never backwarded, a backward that stopped early):
        # the compute stream waits for them, so the allocator reuses this group's device memory
        # only after the copy stream is done with it.
        state = getattr(self, "state", None)
        event = {GroupState.COPYING: self.offload_event, GroupState.LOADING: self.load_event}.get(state)
        if event is not None and not sys.is_finalizing():
            with _quiet():
                self.manager.wait(event, self.compute)

    def _entry(self, storage: torch.UntypedStorage, device: torch.device, in_place: bool) -> _Entry:
        key = storage._cdata
        entry = self.entries.get(key)
        if entry is None:
            entry = self.entries[key] = _Entry(storage, device, self.manager.pool, in_place)
        return entry

    def pack(self, tensor: torch.Tensor) -> Any:
        """NOTE [Saved tensors under hooks]."""
        reason = self.manager.ineligible(tensor)
        if reason is not None:
            self.manager.stats.skipped[reason] += 1
            return _Saved(self, None, tensor)
        with _quiet():
            entry = self._entry(tensor.untyped_storage(), tensor.device, in_place=False)
        saved = _Saved(self, entry, tensor)
        self.saved.append(weakref.ref(saved))
        return saved

    def _live_saved(self) -> list[_Saved]:
        return [saved for ref in self.saved if (saved := ref()) is not None]

    def register_cached(self, tensor: torch.Tensor) -> None:
        """Swap a tensor a selective policy keeps (NOTE [Swapping selective outputs])."""
        reason = self.manager.ineligible(tensor)
        if reason is not None:
            self.manager.stats.skipped[reason] += 1
            return
        with _quiet():
            self._entry(tensor.untyped_storage(), tensor.device, in_place=True).cached.append(weakref.ref(tensor))

    def register_watcher(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``, an alias the selective cache holds of a kept storage to watch writes into
        it, as an expected holder of that storage, not a sign that the storage escaped."""
        entry = self.entries.get(tensor.untyped_storage()._cdata)
        if entry is not None:
            entry.watchers.append(weakref.ref(tensor))

    def close(self, protected: set[int]) -> None:
        """The layer's forward ended: start the device -> host copies (or keep everything)."""
        stats, backend = self.manager.stats, self.manager.backend
        saved = self._live_saved()
        if not self.offload:
            stats.skipped["last_layer"] += len(saved) + sum(len(e.cached) for e in self.entries.values())
            self.state = GroupState.KEPT
            return
        modified = {id(s.entry) for s in saved if s.tensor._version != s.version}
        copying = []
        for key, entry in list(self.entries.items()):
            count = len(entry.cached) + sum(1 for s in saved if s.entry is entry)
            reason = "modified" if id(entry) in modified else None
            if reason is None and entry.in_place and (key in protected or entry.escaped()):
                reason = "shared"
            if reason is None:
                entry.host = self.manager.pool.acquire(entry.nbytes)
                if entry.host is None:
                    reason = "budget"
                    warn_once(
                        f"swap host budget of {self.manager.pool.budget_bytes} bytes is spent; further tensors "
                        "stay on the device. Raise host_budget_bytes to swap more.", self.manager.warned,
                    )
            if reason is not None:
                stats.skipped[reason] += count
                del self.entries[key]
                continue
            copying.append(entry)
            stats.offloaded_tensors += count
            stats.offloaded_bytes += entry.nbytes
        self.saved = [weakref.ref(s) for s in saved if s.entry.host is not None]
        if not copying:
            self.state = GroupState.KEPT
            return
        self.device = copying[0].device
        self.compute = backend.current_stream(self.device)
        self.offload_event = self._copy([(entry.host[: entry.nbytes], entry.device_bytes) for entry in copying])
        self.state = GroupState.COPYING

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
        """Issue ``(destination, source)`` copies on the copy stream, ordered after the work issued
        so far on this group's compute stream; return the event that marks their end."""
        backend, stream = self.manager.backend, self.manager.copy_stream(self.device)
        ready = backend.new_event()
        ready.record(self.compute)
        stream.wait_event(ready)
        with backend.use_stream(stream):
            for destination, source in pairs:
                backend.copy_(destination, source)
            done = backend.new_event()
            done.record(stream)
        return done

    def finish_offload(self) -> None:
        """Wait for the device -> host copies, then free the device memory this group holds."""
        if self.state is not GroupState.COPYING:
            return
        self.manager.wait(self.offload_event, self.compute)
        for entry in self.entries.values():
            if entry.in_place:
                # Keep the (now empty) view: it is how start_load regrows the same storage.
                entry.device_bytes.untyped_storage().resize_(0)
            else:
                entry.device_bytes = None
        for saved in self._live_saved():
            saved.drop_alias()
        self.state = GroupState.HOST

    def start_load(self) -> None:
        """Issue the host -> device copies (on the copy stream, after a compute-stream event)."""
        if self.state is GroupState.COPYING:
            self.finish_offload()
        if self.state is not GroupState.HOST:
            return
        manager = self.manager
        saved = self._live_saved()
        for key, entry in list(self.entries.items()):
            if entry.in_place:
                entry.device_bytes.untyped_storage().resize_(entry.nbytes)
                continue
            storage = entry.storage_ref()
            if storage is not None and storage.nbytes() == entry.nbytes:
                # Still on the device (NOTE [Tensors that outlive the layer]): rebuild on it.
                entry.device_bytes = _flat_bytes(storage, entry.device)
                entry.release_host()
                del self.entries[key]
                count = sum(1 for s in saved if s.entry is entry)
                manager.stats.offloaded_tensors -= count
                manager.stats.offloaded_bytes -= entry.nbytes
                manager.stats.skipped["shared"] += count
                continue
            entry.device_bytes = torch.empty(entry.nbytes, dtype=torch.uint8, device=entry.device)
        if not self.entries:
            self.state = GroupState.LOADED
            return
        entries = list(self.entries.values())
        self.load_event = self._copy([(entry.device_bytes, entry.host[: entry.nbytes]) for entry in entries])
        manager.stats.reloaded_bytes += sum(entry.nbytes for entry in entries)
        self.state = GroupState.LOADING

    def ensure_loaded(self) -> None:
        """Make every tensor of this group usable on the device; prefetch the previous group."""
        with _quiet():
            self._ensure_loaded()

    def _ensure_loaded(self) -> None:
        self._start_backward()
        if self.state not in (GroupState.HOST, GroupState.LOADING, GroupState.LOADED):
            return  # still on the device
        self.start_load()
        if self.load_event is None:
            return
        stream = self.manager.backend.current_stream(self.device)
        if not any(stream == waiter for waiter in self.load_waiters):
            self.manager.wait(self.load_event, stream)
            self.load_waiters.append(stream)
        if self.state is GroupState.LOADING:
            self.state = GroupState.LOADED
            for entry in self.entries.values():
                entry.release_host()

    def _start_backward(self) -> None:
        """This group's backward begins: prefetch the previous group's tensors."""
        if self.backward_started:
            return
        self.backward_started = True
        previous = self.previous() if self.previous is not None else None
        if previous is not None:
            previous.start_load()

    def unpack(self, saved: _Saved) -> torch.Tensor:
        saved.check_version()
        if saved.tensor is not None:
            if not self.backward_started:
                with _quiet():
                    self._start_backward()
            return saved.tensor
        with _quiet():
            self._ensure_loaded()  # on every unpack: a stream that has not waited for the load waits
            if saved.rebuilt is None:
                storage = saved.entry.device_bytes.untyped_storage()
                saved.rebuilt = torch.empty(0, dtype=saved.dtype, device=storage.device).set_(
                    storage, saved.offset, saved.size, saved.stride
                )
        return saved.rebuilt


_current_group: contextvars.ContextVar[SwapGroup | None] = contextvars.ContextVar("hyperac_swap_group", default=None)


def current_group() -> SwapGroup | None:
    """The swap group of the layer whose forward is running, if it swaps."""
    return _current_group.get()


def _storage_keys(values: Any) -> set[int]:
    return {
        v.untyped_storage()._cdata for v in tree_flatten(values)[0]
        if type(v) in (torch.Tensor, nn.Parameter) and v.layout is torch.strided and not v.is_nested
    }


@dataclasses.dataclass(frozen=True)
class LayerSwap:
    """How one layer swaps: through which manager, whether it offloads at all, and whether the
    tensors autograd saves (its inputs, when it recomputes) go too, or only selective outputs."""

    manager: SwapManager
    offload: bool
    saved_tensors: bool = True


def _unpack(value: Any) -> Any:
    if isinstance(value, _Saved):
        return value.group.unpack(value)
    return value


class SwapManager:
    """Swap state of one applied model: copy stream, host pool, statistics, the group chain.

    Holds no reference to the model or its layers; :meth:`release` frees the host buffers (called
    by ``hyperac.remove`` and when the model's applied state is dropped). A copy (deepcopy, pickle)
    is a fresh manager with the same settings (the backend's too, e.g. ``sim``'s link bandwidth): its
    own pool, statistics and stream.
    """

    def __init__(self, backend: Backend, min_swap_bytes: int, host_budget_bytes: int) -> None:
        self.backend = backend
        self.min_swap_bytes = min_swap_bytes
        self.pool = HostPool(backend, host_budget_bytes)
        self.stats = SwapStats(wait_seconds=0.0 if backend.can_time_waits else None)
        self.warned: set[str] = set()
        self._copy_streams: dict[torch.device | None, Any] = {}
        self._device: torch.device | None = None
        self._last: weakref.ref | None = None
        self._pending: weakref.ref | None = None

    def __reduce__(self) -> tuple:
        return SwapManager, (self.backend, self.min_swap_bytes, self.pool.budget_bytes)

    def copy_stream(self, device: torch.device | None = None) -> Any:
        """The copy stream of ``device`` (default: the device this manager copied from last)."""
        self._device = device = device if device is not None else self._device
        if device not in self._copy_streams:
            self._copy_streams[device] = self.backend.new_stream(device)
        return self._copy_streams[device]

    def wait(self, event: Any, stream: Any) -> None:
        """Make ``stream`` wait for ``event`` (device-side), counted in the statistics."""
        waited = self.backend.wait(event, stream)
        self.stats.waits += 1
        if waited is not None and self.stats.wait_seconds is not None:
            self.stats.wait_seconds += waited

    def ineligible(self, tensor: torch.Tensor) -> str | None:
        """Why ``tensor`` must stay on the device, or ``None`` if it can be swapped."""
        reason = swap_ineligible(tensor, self.backend.device_type)
        if reason is None and tensor.untyped_storage().nbytes() < self.min_swap_bytes:
            return "small"
        with _quiet():  # the backend may ask a dispatcher op (the NPU's format query)
            layout = self.backend.internal_format(tensor) if reason is None else None
        if layout is not None:
            warn_once(
                f"a {list(tensor.shape)} tensor saved for backward is in the {self.backend.name} internal format "
                f"{layout}; swap copies raw storage bytes, which would come back read as plain layout, so it stays "
                f"on the device (skipped as 'format'). Cast it to the plain format ({self.backend.plain_format_cast}) "
                "before it is saved to swap it.", self.warned,
            )
            return "format"
        return reason

    def run_layer(
        self, offload: bool, call: Callable[[], Any], inputs: tuple[tuple, dict], saved_tensors: bool = True
    ) -> Any:
        """Run one layer invocation, ``call()``, with its saved tensors swapped (NOTE [Swap stream
        ordering]); ``inputs`` are its (args, kwargs), whose storages a selective swap never resizes.

        ``offload=False`` (the model's last swapping layer) keeps them on the device;
        ``saved_tensors=False`` swaps only what a selective policy registers with the group.
        """
        if self.backend.is_capturing():
            # A graph replays device work only: the pinned allocations, events and Python
            # bookkeeping of a swap would not happen again at replay.
            raise ConfigError(
                f"swap cannot run while the {self.backend.name} stream is capturing a graph (CUDA graphs, "
                "torch.compile mode='reduce-overhead'): a replay would not redo its host copies. Capture a model "
                "applied without swap (mode='full' or 'selective', swap_inputs=False)."
            )
        previous = self._last() if self._last is not None else None
        group = SwapGroup(self, previous, offload)
        token = _current_group.set(group)
        hooks = (torch.autograd.graph.saved_tensors_hooks(group.pack, _unpack) if saved_tensors
                 else contextlib.nullcontext())
        try:
            with hooks, FakeTensorsKept():  # NOTE [Traces inside a region] in higher_order.py
                output = call()
        except BaseException:
            # This forward is abandoned: the next layer invocation starts a new chain, so no later
            # backward prefetches groups of a graph that never runs backward.
            self._last = None
            raise
        finally:
            _current_group.reset(token)
        with _quiet():
            protected = _storage_keys((inputs, output)) if any(
                e.in_place for e in group.entries.values()) else set()
            group.close(protected)
            pending = self._pending() if self._pending is not None else None
            if pending is not None:
                pending.finish_offload()
        self._pending = weakref.ref(group) if group.state is GroupState.COPYING else None
        self._last = weakref.ref(group)
        return output

    def release(self) -> None:
        """Free the host buffers; in-flight groups return theirs when autograd drops them."""
        self.pool.clear()

