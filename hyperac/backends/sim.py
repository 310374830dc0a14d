"""The ``sim`` backend: a CPU stand-in for an accelerator whose streams run asynchronously.

Tensors on the CPU play the memory of device ``sim:0``. Tests and diagnostics only:
``backend="auto"`` never picks it. What it models, so that a missing or misplaced wait shows as
wrong numbers or a named :class:`SimRaceError` in a CPU test instead of a rare race on a GPU:

- **Streams run on their own.** Each stream (the compute stream of each device included) has a
  position that advances as work is issued on it. A copy issued on a side stream is queued and
  lands only when a stream that runs on the host (compute) or the host itself waits on an event
  recorded after it, or the stream is synchronized. It reads its source and writes its
  destination when it lands.
- **Who waited on what.** A stream knows the position of another stream only through an event of
  that stream it waited on (``stream.wait_event``, ``event.wait(stream)``, ``wait_stream``); a wait
  on the wrong stream, or a stream waiting on its own event, orders nothing. Unlike on a GPU,
  ordering is not transitive (A waited on B, which waited on C, does not order A after C): the
  sim is stricter, and cheap with many streams alive. Device-side waits (a stream waits)
  and host-side completion (``event.synchronize``, ``synchronize``) are distinct.
- **Every access is checked.** A side-stream copy of device memory must be ordered after the
  compute work issued before it (the last event recorded on compute, or compute's last wait); a
  read of a buffer that a copy wrote, and a write of a buffer that a copy reads, must be ordered
  after that copy on the stream that does it. Compute's accesses are checked inside
  :meth:`SimBackend.computing` (a dispatch mode: wrap forward and backward) and by
  :meth:`SimBackend.check_read`. A violation raises :class:`SimRaceError` naming both ops.
- **The caching allocator.** A copy holds neither end alive, as a GPU copy does not keep memory
  from the caching allocator: memory freed on compute is reused at once by compute unless the
  free was ordered after every stream that used it (compute waited on the copy, which landed the
  copy first). So a copy whose source was freed before it landed reads garbage (all ones: NaN in
  floats), and one whose destination was freed writes into memory someone else owns: recorded in
  the stream's ``faults``, with the copy named.
- **Devices.** Streams and events belong to a device; ``SimBackend(current_device=1)`` makes
  ``sim:1`` current while tensors live on ``sim:0``, so code that takes the device from the current
  device instead of the tensor gets streams of the wrong device, and its copies raise.
- **Graph capture.** :meth:`SimBackend.capturing` marks a capture, as ``torch.cuda.graph`` does.

NOTE [The virtual clock]
Time on ``sim`` is virtual, so that no reading of it depends on how busy the host is. The host and
every stream have a time: where the host is, and when the work issued on the stream so far ends.
It is counted in integer ticks of 2**-40 s (about a picosecond), so that sums and differences of
readings are exact and the same whatever the clock read before.

- An op inside :meth:`SimBackend.computing` runs on the host: it starts when both the host and its
  stream are free and takes ``seconds_per_op`` plus its FLOPs (as ``FlopCounterMode`` counts them)
  over ``flops_per_second``; a copy issued on a compute stream does the same and takes
  ``n / link_bandwidth`` for ``n`` bytes. The host and the stream move to its end.
- A copy issued on a side stream starts when the host issues it or when the stream is free,
  whichever is later, and takes ``n / link_bandwidth``; only the stream moves.
- An event carries its stream's time when recorded. A stream that waits on it moves up to that
  time if it is behind; when the waiting stream runs on the host (compute, or the current stream:
  the copies land then), the host waits too. :meth:`SimBackend.wait` returns how far the waiting
  stream moved: copy time that compute did not hide, summed in ``SwapStats.wait_seconds``.
- Host synchronization (``event.synchronize``, ``stream.synchronize``, :meth:`SimBackend.synchronize`)
  moves the host to the end of what it waited for. :meth:`SimBackend.clock` reads the host after
  synchronizing; the planner times its steps on it.

Nothing else takes time: ops outside ``computing`` (wrap forward and backward together, as with any
dispatch mode) and hyperac's own bookkeeping are free. Copies hide behind compute exactly when there
is enough of it, as on an accelerator, and a test can assert the times exactly.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import math
import weakref
from collections.abc import Callable
from typing import ClassVar

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ..measure import StepMode
from .base import Backend, host_link_override
from .registry import register_backend

__all__ = ["SimBackend", "SimEvent", "SimRaceError", "SimStream"]

TENSOR_DEVICE = 0
"""The sim device every (CPU) tensor lives on."""
TICKS_PER_SECOND = 2**40
"""Ticks of the virtual clock in a second (NOTE [The virtual clock])."""


def _ticks(amount: float, rate: float | None) -> int:
    """How long ``amount`` (bytes, FLOPs) takes at ``rate`` of them per second (``None``: instant), in ticks."""
    return round(amount * TICKS_PER_SECOND / rate) if rate else 0


class _Host:
    """Where the host is on the virtual clock, in ticks."""

    def __init__(self) -> None:
        self.now = 0

    def reach(self, time: int) -> None:
        """The host waited until ``time``."""
        self.now = max(self.now, time)


_HOST = _Host()


class SimRaceError(RuntimeError):
    """Two accesses to one buffer that no wait orders (on a GPU: a race)."""


class SimStream:
    """One stream of one sim device: a position, the positions of other streams it is ordered
    after, (side streams) the copies queued on it, and its time (NOTE [The virtual clock])."""

    def __init__(self, device: int, name: str, compute: bool = False, bandwidth: float | None = None) -> None:
        self.device, self.name, self.compute, self.bandwidth = device, name, compute, bandwidth
        self.issued = 0  # position of the last op issued on this stream
        self.seen: weakref.WeakKeyDictionary[SimStream, int] = weakref.WeakKeyDictionary()
        # (position, the work, the side-stream positions it is ordered after)
        self.pending: collections.deque[tuple[int, Callable[[], None], list]] = collections.deque()
        self.now = 0  # virtual time (ticks) at which the work issued so far ends
        self.faults: list[str] = []

    def __repr__(self) -> str:
        return f"sim:{self.device} {self.name}"

    def knows(self, other: SimStream, position: int) -> bool:
        """Whether work on this stream is ordered after ``other``'s op at ``position``."""
        return other is self or self.seen.get(other, 0) >= position

    def issue(self) -> int:
        self.issued += 1
        return self.issued

    def run(self, ticks: int) -> None:
        """Account for work the host does on this stream, taking ``ticks``."""
        self.now = _HOST.now = max(self.now, _HOST.now) + ticks

    def enqueue(self, work: Callable[[], None], nbytes: int) -> int:
        ticket = self.issue()
        self.now = max(self.now, _HOST.now) + _ticks(nbytes, self.bandwidth)
        after = [(other, position) for other, position in self.seen.items()
                 if other.pending and other.pending[0][0] <= position]
        self.pending.append((ticket, work, after))
        return ticket

    def run_until(self, ticket: int) -> None:
        while self.pending and self.pending[0][0] <= ticket:
            _, work, after = self.pending.popleft()
            for other, position in after:  # what it was ordered after lands first
                other.run_until(position)
            work()

    def wait_event(self, event: SimEvent) -> None:
        event.wait(self)

    def wait_stream(self, stream: SimStream) -> None:
        event = SimEvent()
        event.record(stream)
        event.wait(self)

    def synchronize(self) -> None:
        self.run_until(self.issued)
        _HOST.reach(self.now)


class SimEvent:
    """Marks a position of a :class:`SimStream`, and its time then."""

    def __init__(self) -> None:
        self.stream: SimStream | None = None
        self.ticket = 0
        self.time = 0

    def record(self, stream: SimStream | None = None) -> None:
        self.stream = stream if stream is not None else _current_stream(TENSOR_DEVICE)
        self.ticket = self.stream.issue() if self.stream.compute else self.stream.issued
        self.time = self.stream.now

    def wait(self, stream: SimStream | None = None) -> None:
        """Order ``stream``'s later work (default: the current stream of the event's device) after
        this event, and move its time up to the event's. A stream that runs on the host (compute)
        gets the copies landed now, and the host waits with it (NOTE [The virtual clock])."""
        if self.stream is None:
            return
        waiter = stream if stream is not None else _current_stream(self.stream.device)
        if waiter is self.stream:
            return  # a stream waiting on its own event: orders nothing
        waiter.seen[self.stream] = max(waiter.seen.get(self.stream, 0), self.ticket)
        waiter.now = max(waiter.now, self.time)
        if waiter.compute:
            waiter.issue()  # what compute issues from now on comes after the wait
        if waiter.compute or waiter is _current_stream(waiter.device):  # it runs on the host: land now
            self.stream.run_until(self.ticket)
            _HOST.reach(self.time)

    def query(self) -> bool:
        return self.stream is None or not self.stream.pending or self.stream.pending[0][0] > self.ticket

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.ticket)
            _HOST.reach(self.time)


class _Access:
    """The last copy that wrote, and the copies that read, one storage."""

    __slots__ = ("storage", "write", "reads")

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = weakref.ref(storage)
        self.write: tuple[SimStream, int, str] | None = None
        self.reads: list[tuple[SimStream, int, str]] = []


class _Ledger:
    """Accesses by copies, per storage: what every later access must be ordered after."""

    def __init__(self) -> None:
        self.accesses: dict[int, _Access] = {}

    def get(self, tensor: torch.Tensor, create: bool = False) -> _Access | None:
        storage = tensor.untyped_storage()
        access = self.accesses.get(storage._cdata)
        if access is not None and access.storage() is not storage:
            access = None  # a freed storage's address, reused
        if access is None and create:
            if len(self.accesses) > 4096:
                self.accesses = {k: a for k, a in self.accesses.items() if a.storage() is not None}
            access = self.accesses[storage._cdata] = _Access(storage)
        return access

    def check(self, stream: SimStream, tensor: torch.Tensor, what: str, write: bool) -> None:
        access = self.get(tensor)
        if access is None:
            return
        earlier = ([access.write] if access.write else []) + (access.reads if write else [])
        for other, position, label in earlier:
            if not stream.knows(other, position):
                raise SimRaceError(
                    f"{what} on {stream!r} {'writes' if write else 'reads'} a buffer that {label} on {other!r} "
                    f"{'writes' if (other, position, label) == access.write else 'reads'}, and {stream!r} never "
                    f"waited on an event recorded after it; make {stream!r} wait on that event first."
                )

    def copied(self, stream: SimStream, ticket: int, destination: torch.Tensor, source: torch.Tensor) -> None:
        label = f"copy #{ticket}"
        written = self.get(destination, create=True)
        written.write, written.reads = (stream, ticket, label), []
        self.get(source, create=True).reads.append((stream, ticket, label))


_LEDGER = _Ledger()
_STREAMS: dict[int, SimStream] = {}
_current: contextvars.ContextVar[dict[int, SimStream] | None] = contextvars.ContextVar(
    "hyperac_sim_streams", default=None)
_device: contextvars.ContextVar[int | None] = contextvars.ContextVar("hyperac_sim_device", default=None)
_CAPTURING: contextvars.ContextVar[bool] = contextvars.ContextVar("hyperac_sim_capturing", default=False)


def compute_stream(device: int = TENSOR_DEVICE) -> SimStream:
    """The compute (default) stream of sim device ``device``."""
    if device not in _STREAMS:
        _STREAMS[device] = SimStream(device, "compute", compute=True)
    return _STREAMS[device]


def _current_stream(device: int) -> SimStream:
    streams = _current.get()
    return streams[device] if streams and device in streams else compute_stream(device)


class _WeakView:
    """A tensor's geometry and a weak reference to its storage: the view, rebuilt while the storage
    is alive and still large enough."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.storage = weakref.ref(tensor.untyped_storage())
        self.dtype, self.offset = tensor.dtype, tensor.storage_offset()
        self.size, self.stride = tensor.size(), tensor.stride()
        extent = self.offset + sum((n - 1) * s for n, s in zip(self.size, self.stride)) + 1
        self.nbytes = extent * tensor.element_size() if tensor.numel() else 0

    def get(self) -> torch.Tensor | None:
        storage = self.storage()
        if storage is None or storage.nbytes() < self.nbytes:
            return None
        view = torch.empty(0, dtype=self.dtype, device=storage.device)
        return view.set_(storage, self.offset, self.size, self.stride)


class _DeferredCopy:
    """A copy queued on a side stream (see the module docstring for what it does when it lands)."""

    def __init__(self, stream: SimStream, destination: torch.Tensor, source: torch.Tensor) -> None:
        self.stream, self.destination, self.source = stream, _WeakView(destination), _WeakView(source)
        self.label = ""

    def __call__(self) -> None:
        with _disable_current_modes():
            destination = self.destination.get()
            if destination is None:
                self.stream.faults.append(
                    f"{self.label} on {self.stream!r} ({self.source.nbytes} bytes) landed in memory freed before it "
                    "landed (freed on a stream that never waited for it)"
                )
                return
            source = self.source.get()
            if source is not None:
                destination.copy_(source)
            elif destination.is_contiguous() and destination.numel():
                destination.reshape(-1).view(torch.uint8).fill_(255)  # the freed memory's new contents
            else:
                destination.fill_(float("nan") if destination.is_floating_point() else -1)


class _Computing(StepMode):
    """Compute's accesses, checked against the copies'; every op takes virtual time (``ticks``, plus
    its FLOPs over ``flops_per_second``). A higher-order op is one op, whose tensor arguments it reads."""

    def __init__(self, ticks: int, flops_per_second: float | None) -> None:
        super().__init__()
        self.ticks, self.flops_per_second = ticks, flops_per_second

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        stream = _current_stream(TENSOR_DEVICE)
        arguments = func._schema.arguments if hasattr(func, "_schema") else ()
        mutable = {a.name for a in arguments if a.alias_info is not None and a.alias_info.is_write}
        names = [a.name for a in arguments] if arguments else [None] * len(args)
        for name, value in [*zip(names, args), *(kwargs or {}).items()]:
            for tensor in tree_flatten(value)[0]:
                if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.layout == torch.strided:
                    _LEDGER.check(stream, tensor, f"{func} (compute)", write=name in mutable)
        out = func(*args, **(kwargs or {}))
        formula = flop_registry.get(getattr(func, "_overloadpacket", func)) if self.flops_per_second else None
        flops = formula(*args, **(kwargs or {}), out_val=out) if formula is not None else 0
        stream.run(self.ticks + _ticks(flops, self.flops_per_second))
        return out


@register_backend
class SimBackend(Backend):
    """Asynchronous-stream simulation on the CPU; the swap test suite runs on it."""

    name: ClassVar[str] = "sim"
    can_swap: ClassVar[bool] = True
    can_time_waits: ClassVar[bool] = True

    @property
    def device_type(self) -> str:
        return "cpu"

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def __init__(self, link_bandwidth: float | None = None, seconds_per_op: float = 0.0,
                 current_device: int = TENSOR_DEVICE, flops_per_second: float | None = None) -> None:
        """``link_bandwidth``: bytes/s of host copies (``None``: instant); ``seconds_per_op`` and
        ``flops_per_second`` (``None``: FLOPs are free): the time an op takes inside
        :meth:`computing` (NOTE [The virtual clock]);
        ``current_device``: the sim device that is current (tensors live on ``sim:0``)."""
        self._streams: weakref.WeakSet[SimStream] = weakref.WeakSet()
        self._host: weakref.WeakValueDictionary[int, torch.UntypedStorage] = weakref.WeakValueDictionary()
        self.link_bandwidth = link_bandwidth
        self.seconds_per_op = seconds_per_op
        self.current_device = current_device
        self.flops_per_second = flops_per_second

    def __reduce__(self) -> tuple:
        """A copy (deepcopy, pickle, a copied applied model's swap state) has the same settings and
        none of this backend's streams."""
        return SimBackend, (self.link_bandwidth, self.seconds_per_op, self.current_device, self.flops_per_second)

    def _index(self, device: torch.device | None) -> int:
        """The sim device of ``device`` (every tensor's), or the current one for ``None``."""
        if device is not None:
            return TENSOR_DEVICE
        current = _device.get()
        return self.current_device if current is None else current

    def computing(self) -> contextlib.AbstractContextManager:
        """Check compute's accesses while this is active; ops take virtual time (``seconds_per_op``
        each, plus their FLOPs over ``flops_per_second``)."""
        return _Computing(round(self.seconds_per_op * TICKS_PER_SECOND), self.flops_per_second)

    @contextlib.contextmanager
    def capturing(self):
        """Mark a graph capture on this thread (``is_capturing`` is true inside)."""
        token = _CAPTURING.set(True)
        try:
            yield
        finally:
            _CAPTURING.reset(token)

    def is_capturing(self, device: torch.device | None = None) -> bool:
        return _CAPTURING.get()

    def host_link_bandwidth(self, device: torch.device | None = None) -> float:
        """``link_bandwidth`` (instant: infinite) unless ``HYPERAC_HOST_LINK_BANDWIDTH`` is set."""
        override = host_link_override()
        return override if override is not None else self.link_bandwidth or math.inf

    def new_stream(self, device: torch.device | None = None) -> SimStream:
        stream = SimStream(self._index(device), f"side stream {len(self._streams) + 1}", bandwidth=self.link_bandwidth)
        self._streams.add(stream)
        return stream

    def current_stream(self, device: torch.device | None = None) -> SimStream:
        return _current_stream(self._index(device))

    @contextlib.contextmanager
    def use_stream(self, stream: SimStream):
        # As torch.cuda.stream: the stream's device becomes current too.
        token = _current.set({**(_current.get() or {}), stream.device: stream})
        device_token = _device.set(stream.device)
        try:
            yield
        finally:
            _device.reset(device_token)
            _current.reset(token)

    def new_event(self) -> SimEvent:
        return SimEvent()

    def wait(self, event: SimEvent, stream: SimStream | None = None) -> float:
        """Returns the virtual seconds ``stream`` waited (NOTE [The virtual clock])."""
        waiter = stream if stream is not None else self.current_stream()
        before = waiter.now
        event.wait(waiter)
        return (waiter.now - before) / TICKS_PER_SECOND

    def check_read(self, tensor: torch.Tensor, what: str = "a read") -> None:
        """Raise :class:`SimRaceError` unless a read of ``tensor`` on the current stream is ordered
        after the copy that wrote it."""
        _LEDGER.check(_current_stream(TENSOR_DEVICE), tensor, what, write=False)

    def host_empty(self, like: torch.Tensor, pinned: bool = True) -> torch.Tensor:
        host = super().host_empty(like, pinned)
        self._host[host.untyped_storage()._cdata] = host.untyped_storage()
        return host

    def _is_host(self, tensor: torch.Tensor) -> bool:
        return self._host.get(tensor.untyped_storage()._cdata) is tensor.untyped_storage()

    def copy_(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        stream = self.current_stream()
        what = f"copy #{stream.issued + 1}"
        if stream.device != TENSOR_DEVICE:
            raise SimRaceError(
                f"{what} of a tensor on sim:{TENSOR_DEVICE} was issued on {stream!r}, a stream of another device "
                f"(sim:{stream.device} is current); take streams from the tensor's device."
            )
        compute = compute_stream(TENSOR_DEVICE)
        if not stream.compute and not stream.knows(compute, compute.issued):
            device_end = source if self._is_host(destination) else destination
            raise SimRaceError(
                f"{what} on {stream!r} touches device memory ({tuple(device_end.shape)}) that compute op "
                f"#{compute.issued} on {compute!r} may still use; {stream!r} never waited on an event recorded "
                "there after it. Record an event on the compute stream and make the copy stream wait on it."
            )
        _LEDGER.check(stream, source, what, write=False)
        _LEDGER.check(stream, destination, what, write=True)
        nbytes = source.numel() * source.element_size()
        if stream.compute:
            destination.copy_(source)
            stream.run(_ticks(nbytes, self.link_bandwidth))
            _LEDGER.copied(stream, stream.issue(), destination, source)
            return
        work = _DeferredCopy(stream, destination, source)
        ticket = stream.enqueue(work, nbytes)
        work.label = f"copy #{ticket}"
        _LEDGER.copied(stream, ticket, destination, source)

    def synchronize(self, device: torch.device | None = None) -> None:
        """Land every copy queued on the streams this backend made."""
        for stream in list(self._streams):
            stream.synchronize()

    def clock(self, device: torch.device | None = None) -> float:
        """The host's virtual time after :meth:`synchronize`, in seconds (NOTE [The virtual clock])."""
        self.synchronize(device)
        return _HOST.now / TICKS_PER_SECOND
