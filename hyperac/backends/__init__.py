"""Backends: the only place in hyperac that names accelerator vendors."""

from . import cpu, cuda, npu, sim  # noqa: F401  (importing them registers the built-in backends)
from .base import Backend, DeviceModuleBackend, NullEvent, NullStream, resolve_ops
from .registry import available_backends, get_backend, register_backend

__all__ = [
    "Backend",
    "DeviceModuleBackend",
    "NullEvent",
    "NullStream",
    "available_backends",
    "get_backend",
    "register_backend",
    "resolve_ops",
]
