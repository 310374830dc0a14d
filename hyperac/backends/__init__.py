"""Backends: the only place in hyperac that names accelerator vendors."""

from .base import Backend, DeviceModuleBackend, NullEvent, NullStream, resolve_ops
from .registry import available_backends, get_backend, register_backend
from . import cpu, cuda, npu  # noqa: E402,F401  (registers the built-in backends)

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
