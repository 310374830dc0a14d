"""The ``sim`` backend: a CPU stand-in for an accelerator with asynchronous copies.

Tensors on the CPU play the device. A copy issued on a side stream does not happen when it is
issued: it is queued on that stream and lands only when an event recorded after it is waited on
(or the stream is synchronized). It reads its source and writes its destination when it lands,
and holds neither alive, as a GPU copy does not keep memory from the caching allocator: a source
freed (or resized away) before the copy lands yields garbage bytes (all ones: NaN in floats), and a
destination freed before it lands is a write into freed memory, recorded in the stream's
``faults``. A missing wait therefore yields wrong numbers or a fault in a test, where on a GPU it
would be a rare race. Tests and diagnostics only: ``backend="auto"`` never picks it.

NOTE [Simulated link and compute time]
``SimBackend(link_bandwidth=B)`` gives copies a duration: a copy of ``n`` bytes occupies its stream
for ``n / B`` seconds from when it is issued (or from when the copy before it ends), and a wait on
it blocks the host until then. ``seconds_per_op=T`` makes every op take at least ``T`` while
:meth:`SimBackend.computing` is active (wrap forward and backward together, as with any dispatch
mode). Copies then hide behind compute exactly when there is enough of it, and the time a step
waits on copies (``SwapStats.wait_seconds``) is real and measurable, as on an accelerator.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import time
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .base import Backend
from .registry import register_backend


class SimStream:
    """A queue of copies, run in order when an event behind them is waited on."""

    def __init__(self, immediate: bool = False, bandwidth: float | None = None) -> None:
        self.immediate = immediate
        self.bandwidth = bandwidth
        self.pending: collections.deque[tuple[int, float, Callable[[], None]]] = collections.deque()
        self.issued = 0
        self.busy_until = 0.0
        self.faults: list[str] = []

    def enqueue(self, work: Callable[[], None], nbytes: int = 0) -> None:
        if self.immediate:
            work()
            return
        self.issued += 1
        done = 0.0
        if self.bandwidth:
            done = self.busy_until = max(time.perf_counter(), self.busy_until) + nbytes / self.bandwidth
        self.pending.append((self.issued, done, work))

    def run_until(self, ticket: int) -> None:
        while self.pending and self.pending[0][0] <= ticket:
            _, done, work = self.pending.popleft()
            _busy_wait(done)
            work()

    def wait_event(self, event: SimEvent) -> None:
        event.synchronize()

    def wait_stream(self, stream: SimStream) -> None:
        stream.synchronize()

    def synchronize(self) -> None:
        self.run_until(self.issued)


def _busy_wait(until: float) -> None:
    """Block until ``perf_counter() >= until`` (``time.sleep`` is too coarse for microseconds)."""
    while time.perf_counter() < until:
        pass


class _Computing(TorchDispatchMode):
    """Every op takes at least ``seconds`` (NOTE [Simulated link and compute time])."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        start = time.perf_counter()
        out = func(*args, **(kwargs or {}))
        _busy_wait(start + self.seconds)
        return out


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

    def __call__(self) -> None:
        destination = self.destination.get()
        if destination is None:
            self.stream.faults.append(
                f"a copy of {self.source.nbytes} bytes landed in memory freed before it landed (a missing wait)"
            )
            return
        source = self.source.get()
        if source is not None:
            destination.copy_(source)
        elif destination.is_contiguous() and destination.numel():
            destination.reshape(-1).view(torch.uint8).fill_(255)  # the freed memory's new contents
        else:
            destination.fill_(float("nan") if destination.is_floating_point() else -1)


class SimEvent:
    """Marks a point in a :class:`SimStream`; waiting on it runs the copies queued before it."""

    def __init__(self) -> None:
        self.stream: SimStream | None = None
        self.ticket = 0

    def record(self, stream: SimStream | None = None) -> None:
        self.stream = stream if stream is not None else _current.get()
        self.ticket = self.stream.issued

    def wait(self, stream: Any = None) -> None:
        self.synchronize()

    def query(self) -> bool:
        return self.stream is None or not self.stream.pending or self.stream.pending[0][0] > self.ticket

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.ticket)


_COMPUTE = SimStream(immediate=True)
_current: contextvars.ContextVar[SimStream] = contextvars.ContextVar("hyperac_sim_stream", default=_COMPUTE)


@register_backend
class SimBackend(Backend):
    """Asynchronous-copy simulation on the CPU; the swap test suite runs on it."""

    name: ClassVar[str] = "sim"
    can_swap: ClassVar[bool] = True
    can_time_waits: ClassVar[bool] = True

    @property
    def device_type(self) -> str:
        return "cpu"

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def __init__(self, link_bandwidth: float | None = None, seconds_per_op: float = 0.0) -> None:
        """``link_bandwidth``: bytes/s of host copies (``None``: instant); ``seconds_per_op``: the
        least time an op takes inside :meth:`computing` (NOTE [Simulated link and compute time])."""
        self._streams: weakref.WeakSet[SimStream] = weakref.WeakSet()
        self.link_bandwidth = link_bandwidth
        self.seconds_per_op = seconds_per_op

    def __reduce__(self) -> tuple:
        """A copy (deepcopy, pickle, a copied applied model's swap state) has the same settings and
        none of this backend's streams."""
        return SimBackend, (self.link_bandwidth, self.seconds_per_op)

    def computing(self) -> contextlib.AbstractContextManager:
        """Ops take at least ``seconds_per_op`` while this is active."""
        return _Computing(self.seconds_per_op) if self.seconds_per_op else contextlib.nullcontext()

    def new_stream(self) -> SimStream:
        stream = SimStream(bandwidth=self.link_bandwidth)
        self._streams.add(stream)
        return stream

    def current_stream(self) -> SimStream:
        return _current.get()

    @contextlib.contextmanager
    def use_stream(self, stream: SimStream):
        token = _current.set(stream)
        try:
            yield
        finally:
            _current.reset(token)

    def new_event(self) -> SimEvent:
        return SimEvent()

    def wait(self, event: SimEvent) -> float:
        start = time.perf_counter()
        event.synchronize()
        return time.perf_counter() - start

    def copy_(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        stream = _current.get()
        if stream.immediate:
            destination.copy_(source)
        else:
            stream.enqueue(_DeferredCopy(stream, destination, source), source.numel() * source.element_size())

    def synchronize(self) -> None:
        """Land every copy queued on the streams this backend made."""
        for stream in list(self._streams):
            stream.synchronize()
