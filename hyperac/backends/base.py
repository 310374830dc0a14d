"""The backend interface: the few device operations hyperac's core needs.

A backend is an accelerator family named by its torch device type (``cuda``, ``npu``, ``cpu``).
The core asks its backend for streams, events, host buffers, memory statistics and the
dispatcher ops the selective policy must keep; it never names a vendor module itself.

Streams and events come from the backend's torch device module (``torch.cuda``, ``torch.npu``),
looked up when first needed, so importing hyperac initialises no device and imports no vendor
package. Op handles are resolved when asked for, never at import, so ops registered later (by
``torch_npu`` or a custom kernel library) are seen.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from typing import Any, ClassVar

import torch

from ..errors import ConfigError

__all__ = ["HOST_LINK_ENV", "Backend", "DeviceModuleBackend", "NullEvent", "NullStream", "host_link_override",
           "resolve_ops"]

HOST_LINK_ENV = "HYPERAC_HOST_LINK_BANDWIDTH"
"""Environment variable: the host link's bytes/s, one way (``25e9``), instead of a measurement."""


def host_link_override() -> float | None:
    """The bytes/s set by :data:`HOST_LINK_ENV`, or ``None`` when it is unset."""
    raw = os.environ.get(HOST_LINK_ENV)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ConfigError(f"{HOST_LINK_ENV}={raw!r} must be a positive number of bytes per second, e.g. 25e9; "
                          "unset it to measure the link.")
    return value


def resolve_ops(qualified_names: Iterable[str]) -> frozenset:
    """Return the dispatcher overloads named ``namespace::op.overload`` that exist right now.

    Names whose namespace or op is not registered (a vendor library not imported, an op added in
    a later torch) are left out without error. A higher-order op (``higher_order::flex_attention``)
    has no overloads: its name without one is the op.
    """
    found = set()
    for qualified in qualified_names:
        namespace, _, op_and_overload = qualified.partition("::")
        op_name, _, overload = op_and_overload.partition(".")
        try:
            packet = getattr(getattr(torch.ops, namespace), op_name)
            if isinstance(packet, torch._ops.HigherOrderOperator) and not overload:
                found.add(packet)
            else:
                found.add(getattr(packet, overload or "default"))
        except (AttributeError, RuntimeError):
            continue
    return frozenset(found)


_GENERIC_ATTENTION_OPS = (
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_fused_attention_overrideable",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "aten::_flex_attention",
    # The composite, where a backend registers a kernel for it rather than decomposing it (torch_npu).
    "aten::scaled_dot_product_attention",
    # torch.nn.attention.varlen.varlen_attn (packed documents; torchtitan's varlen backend).
    "torch_attn::_varlen_attn",
    # FFPA's CuTeDSL forward kernels, dense and packed.
    "ffpa_attn::_fwd_cute",
    "ffpa_attn::_varlen_fwd_cute",
)

# The functional collectives (what DTensor's redistributions and expert dispatch call; the autograd-aware
# ``all_to_all_single_autograd`` runs ``_c10d_functional::all_to_all_single`` below autograd, where a
# dispatch mode sees it) and the in-place c10d collectives behind ``torch.distributed``'s API. The policy
# also finds these by their schema (NOTE [Collectives by their schema] in op_identity.py); only the ones
# whose schema names no group depend on this list.
_GENERIC_COMMUNICATION_OPS = (
    "_c10d_functional::all_to_all_single",
    "_c10d_functional::reduce_scatter_tensor",
    "_c10d_functional::reduce_scatter_tensor_coalesced",
    "_c10d_functional::all_reduce",
    "_c10d_functional::all_reduce_coalesced",
    "_c10d_functional::all_gather_into_tensor",
    "_c10d_functional::all_gather_into_tensor_coalesced",
    "_c10d_functional::broadcast",
    "_dtensor::shard_dim_alltoall",
    "c10d::alltoall_base_",
    "c10d::_reduce_scatter_base_",
    "c10d::reduce_scatter_tensor_coalesced_",
    "c10d::allreduce_",
    # Expert-parallel dispatchers that keep their group in a buffer built beforehand: their schemas name no
    # group (torchtitan's DeepEP ops; HybridEP's combine takes only a handle), so they are named here.
    "deepep::dispatch",
    "deepep::combine",
    "hybridep::dispatch",
    "hybridep::combine",
)


class NullStream:
    """A stream that does nothing: work is already ordered on a backend without streams."""

    def wait_event(self, event: Any) -> None:
        """Nothing to wait for."""

    def wait_stream(self, stream: Any) -> None:
        """Nothing to wait for."""

    def synchronize(self) -> None:
        """Nothing is in flight."""


class NullEvent:
    """An event that is always complete."""

    def record(self, stream: Any = None) -> None:
        """Nothing to record."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        """Nothing is in flight."""


class Backend:
    """What the core needs from an accelerator family. Subclass and register with
    :func:`hyperac.register_backend`; override only what differs from the defaults here.

    The defaults describe a backend without streams (copies are synchronous, events complete at
    once, no pinned memory, no memory statistics).
    """

    name: ClassVar[str]
    """The torch device type, so that ``torch.device(backend.name)`` works."""
    auto_priority: ClassVar[int | None] = None
    """Order in which ``backend="auto"`` probes backends (highest first); ``None`` never picks it."""
    can_swap: ClassVar[bool] = False
    """Whether moving saved tensors to host memory frees anything (False where they live there)."""
    can_time_waits: ClassVar[bool] = False
    """Whether :meth:`wait` reports how long it waited."""
    has_memory_stats: ClassVar[bool] = False
    """Whether :meth:`max_memory_allocated` and friends report the device allocator's real figures."""

    @property
    def device_type(self) -> str:
        """The ``tensor.device.type`` of tensors that live on this backend's device."""
        return self.name

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this backend cannot run here (package missing, no device visible), or ``None``.

        Cheap and side-effect free apart from importing the vendor package when it is installed.
        """
        return None

    @classmethod
    def is_available(cls) -> bool:
        return cls.unavailable_reason() is None

    def device(self, index: int | None = None) -> torch.device:
        """The device tensors of this backend live on."""
        return torch.device(self.device_type, index) if index is not None else torch.device(self.device_type)

    def new_stream(self, device: torch.device | None = None) -> Any:
        """A side stream of ``device`` (default: the current device) for copies (a
        :class:`NullStream` where there are no streams)."""
        return NullStream()

    def current_stream(self, device: torch.device | None = None) -> Any:
        """The stream compute is issued on, on ``device`` (default: the current device)."""
        return NullStream()

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """A context manager that issues work on ``stream``."""
        return contextlib.nullcontext()

    def new_event(self) -> Any:
        """An event that can be recorded on a stream and waited on."""
        return NullEvent()

    def wait(self, event: Any, stream: Any = None) -> float | None:
        """Make ``stream`` (default: the current stream) wait for ``event`` (a device-side wait, not
        a host sync).

        Returns the seconds waited where the backend can tell (``can_time_waits``), else ``None``.
        """
        (stream if stream is not None else self.current_stream()).wait_event(event)
        return None

    def is_capturing(self, device: torch.device | None = None) -> bool:
        """Whether the current stream of ``device`` is capturing a graph (CUDA graphs)."""
        return False

    def copy_(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        """Copy ``source`` into ``destination`` on the current stream, without blocking the host."""
        destination.copy_(source, non_blocking=True)

    def supports_pinned_memory(self) -> bool:
        return False

    def host_link_bandwidth(self, device: torch.device | None = None) -> float | None:
        """Bytes/s, one way, between pinned host memory and ``device``, for costing swap copies;
        ``None`` where unknown. :data:`HOST_LINK_ENV` overrides it."""
        return host_link_override()

    plain_format_cast = "a copy in the plain format"
    """How a user casts a tensor out of an :meth:`internal_format`, for messages."""

    def internal_format(self, tensor: torch.Tensor) -> str | None:
        """The name of the device-private layout ``tensor``'s storage bytes are in (an NPU's
        FRACTAL_NZ), or ``None`` when they are the plain strided layout a copy of them keeps."""
        return None

    def host_empty(self, like: torch.Tensor, pinned: bool = True) -> torch.Tensor:
        """An uninitialised host tensor shaped like ``like``; pinned when asked and supported."""
        pin = pinned and self.supports_pinned_memory()
        return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pin)

    def synchronize(self, device: torch.device | None = None) -> None:
        """Wait for all work on ``device`` (default: the current device)."""

    def clock(self, device: torch.device | None = None) -> float:
        """Wait for all work on ``device``, then read the clock that step time is measured on
        (seconds from an arbitrary origin): the host's ``perf_counter``, or a simulator's virtual
        time (the ``sim`` backend: NOTE [The virtual clock])."""
        self.synchronize(device)
        return time.perf_counter()

    def memory_allocated(self, device: torch.device | None = None) -> int:
        """Bytes currently allocated on ``device`` (0 where not measurable)."""
        return 0

    def max_memory_allocated(self, device: torch.device | None = None) -> int:
        """Peak bytes allocated on ``device`` since the last reset (0 where not measurable)."""
        return 0

    def reset_peak_memory_stats(self, device: torch.device | None = None) -> None:
        """Start a new peak measurement on ``device``."""

    def attention_ops(self) -> frozenset:
        """Attention overloads whose outputs the selective policy keeps."""
        return resolve_ops(_GENERIC_ATTENTION_OPS)

    def communication_ops(self) -> frozenset:
        """Collective overloads whose outputs the selective policy keeps (never replayed), besides every op
        whose schema takes a process group or a group's name, which it finds itself: name here the
        collectives whose schema names no group (a dispatcher holding its group in a buffer)."""
        return resolve_ops(_GENERIC_COMMUNICATION_OPS)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


_MEASURED_LINKS: dict[tuple[str, int | None], float] = {}
"""Host link bytes/s by (backend name, device index): a property of the machine, measured once."""


class DeviceModuleBackend(Backend):
    """A backend whose streams, events and statistics come from ``torch.<name>``.

    ``torch.cuda`` and the ``torch.npu`` module that ``torch_npu`` installs share this surface, so
    the CUDA and NPU backends differ only in how they are probed and in their op handles.
    """

    def _module(self) -> Any:
        return getattr(torch, self.name)

    def _own(self, device: torch.device | None) -> torch.device | None:
        """``device`` where it is one of this backend's, else ``None`` (the current device): the device
        modules raise ``ValueError('Expected a npu device, but got: cpu')`` for a device of another type,
        which a caller meets with a model whose parameters are still on the host or on ``meta``."""
        return device if device is not None and device.type == self.device_type else None

    def new_stream(self, device: torch.device | None = None) -> Any:
        return self._module().Stream(device=self._own(device))

    def current_stream(self, device: torch.device | None = None) -> Any:
        return self._module().current_stream(self._own(device))

    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return self._module().stream(stream)

    def new_event(self) -> Any:
        return self._module().Event()

    can_swap: ClassVar[bool] = True
    has_memory_stats: ClassVar[bool] = True

    def supports_pinned_memory(self) -> bool:
        return True

    def is_capturing(self, device: torch.device | None = None) -> bool:
        return bool(self._module().is_current_stream_capturing())

    def host_link_bandwidth(self, device: torch.device | None = None) -> float | None:
        """Measured once per process and device: 32 MiB copied to the device and back from
        pinned memory, three times after a warm-up (about 10 ms on PCIe Gen4)."""
        override = host_link_override()
        if override is not None:
            return override
        device = self._own(device) or self.device(self._module().current_device())
        key = (self.name, device.index)
        if key not in _MEASURED_LINKS:
            host = self.host_empty(torch.empty(32 << 20, dtype=torch.uint8, device="meta"), pinned=True)
            on_device = torch.empty_like(host, device=device)
            times = []
            for _ in range(4):
                start = time.perf_counter()
                on_device.copy_(host, non_blocking=True)
                host.copy_(on_device, non_blocking=True)
                self.synchronize(device)
                times.append(time.perf_counter() - start)
            _MEASURED_LINKS[key] = 2 * host.numel() / min(times[1:])
        return _MEASURED_LINKS[key]

    def synchronize(self, device: torch.device | None = None) -> None:
        self._module().synchronize(self._own(device))

    def memory_allocated(self, device: torch.device | None = None) -> int:
        return int(self._module().memory_allocated(self._own(device)))

    def max_memory_allocated(self, device: torch.device | None = None) -> int:
        return int(self._module().max_memory_allocated(self._own(device)))

    def reset_peak_memory_stats(self, device: torch.device | None = None) -> None:
        self._module().reset_peak_memory_stats(self._own(device))
