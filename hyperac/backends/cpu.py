"""The CPU backend: no streams, no pinned memory; recompute works as everywhere else."""

from __future__ import annotations

from typing import ClassVar

from .base import Backend
from .registry import register_backend


@register_backend
class CpuBackend(Backend):
    """Activations already live in host memory, so swapping them is meaningless here."""

    name: ClassVar[str] = "cpu"
    auto_priority: ClassVar[int | None] = 0
