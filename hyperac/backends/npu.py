"""The Ascend NPU backend, through ``torch_npu``.

``torch_npu`` is imported only when this backend is probed or used, never when hyperac is
imported; if that import fails (the wheel without Ascend CANN), the backend is unavailable and
says why, so ``backend="auto"`` moves on. ``torch_npu`` installs the ``torch.npu`` device module
(streams, events, memory statistics: the same surface as ``torch.cuda``) and registers its kernels
under ``torch.ops.npu``.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import ClassVar

import torch

from .base import _GENERIC_COMMUNICATION_OPS, DeviceModuleBackend, resolve_ops
from .registry import register_backend

_NPU_ATTENTION_OPS = (
    "npu::npu_fusion_attention",
    "npu::npu_fusion_attention_v3",
)

# Matmul kernels fused with a collective (Ascend "MC2"): their outputs carry communication.
_NPU_COMMUNICATION_OPS = (
    "npu::npu_mm_all_reduce_base",
    "npu::npu_all_gather_base_mm",
    "npu::npu_mm_reduce_scatter_base",
)


# ``torch_npu.Format`` codes whose storage is the plain layout; every other one is an internal format.
_NPU_PLAIN_FORMATS = {-1: "UNDEFINED", 0: "NCHW", 1: "NHWC", 2: "ND", 30: "NCDHW"}
_NPU_INTERNAL_FORMATS = {3: "NC1HWC0", 4: "FRACTAL_Z", 29: "FRACTAL_NZ", 32: "NDC1HWC0", 33: "FRACTAL_Z_3D"}
# Where torch_npu registers its format query (``aten::`` in older releases).
_NPU_FORMAT_QUERY = ("npu::get_npu_format", "aten::get_npu_format")


@register_backend
class NpuBackend(DeviceModuleBackend):
    """Ascend NPUs through ``torch_npu``; probed before CUDA by ``backend="auto"`` because
    ``torch_npu`` can make ``torch.cuda.is_available()`` report true."""

    name: ClassVar[str] = "npu"
    auto_priority: ClassVar[int | None] = 30

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if importlib.util.find_spec("torch_npu") is None:
            return "the torch_npu package is not installed; install torch-npu matching your torch version"
        try:
            importlib.import_module("torch_npu")
        except Exception as error:  # without Ascend CANN: "libhccl.so: cannot open shared object file"
            return f"the torch_npu package is installed but failed to import ({type(error).__name__}: {error})"
        module = getattr(torch, "npu", None)
        if module is None or not module.is_available():
            return "torch_npu is installed but no NPU device is visible (check ASCEND_RT_VISIBLE_DEVICES)"
        return None

    def attention_ops(self) -> frozenset:
        return super().attention_ops() | resolve_ops(_NPU_ATTENTION_OPS)

    def communication_ops(self) -> frozenset:
        return resolve_ops(_GENERIC_COMMUNICATION_OPS + _NPU_COMMUNICATION_OPS)

    plain_format_cast = "torch_npu.npu_format_cast(t, 2)"

    def internal_format(self, tensor: torch.Tensor) -> str | None:
        """NOTE [NPU internal formats]
        torch_npu may keep a tensor's storage in a private layout (FRACTAL_NZ for matmul
        operands, NC1HWC0 for convolutions) while its sizes and strides describe the plain one.
        Swap copies raw storage bytes and rebuilds tensors from sizes and strides, so such a
        tensor would come back read as plain layout: it stays on the device instead."""
        query = next(iter(resolve_ops(_NPU_FORMAT_QUERY)), None)
        if query is None:
            return None
        code = int(query(tensor))
        return None if code in _NPU_PLAIN_FORMATS else _NPU_INTERNAL_FORMATS.get(code, f"code {code}")
