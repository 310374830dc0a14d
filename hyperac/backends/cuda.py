"""The CUDA backend (also serves ROCm builds of torch, which expose ``torch.cuda``)."""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import DeviceModuleBackend
from .registry import register_backend


@register_backend
class CudaBackend(DeviceModuleBackend):
    """NVIDIA GPUs through ``torch.cuda``."""

    name: ClassVar[str] = "cuda"
    auto_priority: ClassVar[int | None] = 20

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not torch.backends.cuda.is_built():
            return "this torch build has no CUDA support (a CPU-only wheel); install a CUDA build of torch"
        if not torch.cuda.is_available():
            return "torch was built with CUDA but no CUDA device is visible (check CUDA_VISIBLE_DEVICES)"
        return None
