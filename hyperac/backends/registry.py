"""Backend registration and lookup by name (``"auto"`` picks the best available)."""

from __future__ import annotations

from typing import TypeVar

from ..errors import BackendUnavailableError, ConfigError
from .base import Backend

__all__ = ["available_backends", "get_backend", "register_backend"]

_BACKENDS: dict[str, type[Backend]] = {}

B = TypeVar("B", bound=type[Backend])


def register_backend(cls: B) -> B:
    """Class decorator: make ``cls`` selectable as ``backend=cls.name``.

    Registering a different class under a name that is taken raises :class:`ConfigError`.
    """
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"backend class {cls.__name__} needs a non-empty string `name`, got {name!r}.")
    existing = _BACKENDS.get(name)
    if existing is not None and existing is not cls:
        raise ConfigError(
            f"backend name {name!r} is already registered by {existing.__qualname__}; "
            f"choose another name for {cls.__qualname__}."
        )
    _BACKENDS[name] = cls
    return cls


def available_backends() -> list[str]:
    """Names of the registered backends usable on this machine, best first."""
    ranked = sorted(_BACKENDS.values(), key=lambda c: -(-1 if c.auto_priority is None else c.auto_priority))
    return [c.name for c in ranked if c.is_available()]


def get_backend(name: str | Backend = "auto") -> Backend:
    """Return a backend instance for ``name``; raise if it is unknown or cannot run here.

    ``"auto"`` probes the registered backends by ``auto_priority`` (NPU, then CUDA, then CPU)
    and returns the first available one.
    """
    if isinstance(name, Backend):
        return name
    if name == "auto":
        candidates = [c for c in _BACKENDS.values() if c.auto_priority is not None]
        for candidate in sorted(candidates, key=lambda c: -(c.auto_priority or 0)):
            if candidate.is_available():
                return candidate()
        raise BackendUnavailableError("no registered backend is available, not even 'cpu'.")
    cls = _BACKENDS.get(name)
    if cls is None:
        raise ConfigError(
            f"backend={name!r} is not a registered backend; choose one of "
            f"{sorted(_BACKENDS) + ['auto']} or register one with @hyperac.register_backend."
        )
    reason = cls.unavailable_reason()
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} was requested but {reason}; or pass backend='cpu'.")
    return cls()
