"""The ``sim`` backend: a CPU stand-in for an accelerator with asynchronous copies.

Tensors on the CPU play the device. A copy issued on a side stream does not happen when it is
issued: it is queued on that stream and lands only when an event recorded after it is waited on
(or the stream is synchronized). A missing wait therefore yields wrong numbers in a test, where on
a GPU it would be a rare race. Tests and diagnostics only: ``backend="auto"`` never picks it.
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

from .base import Backend
from .registry import register_backend


class SimStream:
    """A queue of copies, run in order when an event behind them is waited on."""

    def __init__(self, immediate: bool = False) -> None:
        self.immediate = immediate
        self.pending: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        self.issued = 0

    def enqueue(self, work: Callable[[], None]) -> None:
        if self.immediate:
            work()
            return
        self.issued += 1
        self.pending.append((self.issued, work))

    def run_until(self, ticket: int) -> None:
        while self.pending and self.pending[0][0] <= ticket:
            self.pending.popleft()[1]()

    def wait_event(self, event: SimEvent) -> None:
        event.synchronize()

    def wait_stream(self, stream: SimStream) -> None:
        stream.synchronize()

    def synchronize(self) -> None:
        self.run_until(self.issued)


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

    def __init__(self) -> None:
        self._streams: weakref.WeakSet[SimStream] = weakref.WeakSet()

    def new_stream(self) -> SimStream:
        stream = SimStream()
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
        _current.get().enqueue(lambda: destination.copy_(source))

    def synchronize(self) -> None:
        """Land every copy queued on the streams this backend made."""
        for stream in list(self._streams):
            stream.synchronize()
