"""The Ascend NPU backend, through ``torch_npu``.

NOTE [torch_npu is loaded by torch]
``torch_npu`` registers a ``torch.backends`` entry point, so ``import torch`` imports it (torch's
device-backend autoload): on a machine with torch-npu installed, torch_npu is loaded, its
``torch.npu`` device module installed (streams, events, memory statistics, RNG state: the surface of
``torch.cuda``) and its kernels registered under ``torch.ops.npu`` before hyperac is imported.
hyperac imports nothing of its own at import time; this backend's probe reads what torch loaded.

A torch_npu that cannot load (the wheel without Ascend CANN: ``libhccl.so: cannot open shared
object file``; a CUDA build of torch beside it) therefore makes ``import torch`` itself fail, with
``RuntimeError: Failed to load the backend extension: torch_npu``, before hyperac can say anything.
Only with ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` (autoload off) does ``import torch`` succeed with a
broken torch_npu installed; then this backend's probe imports it, and a failure makes the backend
unavailable with the reason, so ``backend="auto"`` moves on and ``backend="npu"`` says why.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import ClassVar

import torch

from .base import _GENERIC_COMMUNICATION_OPS, DeviceModuleBackend, resolve_ops
from .registry import register_backend

AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"
"""torch's switch for importing device backends (``torch_npu``) during ``import torch``; ``0`` turns it off."""

# torch_npu's fused attention (``v2`` adds rotary inputs; ``v3`` returns the dropout's philox seed and
# offset as tensors) is kept whole, not under the attention cost rule (NOTE [Attention kept by its cost
# per byte] in policy.py): where the key length lies in ``key`` depends on the ``input_layout``
# argument (BSH, SBH, BSND, BNSD), and in the packed "TND" layout it is no dimension at all
# (``actual_seq_kvlen`` holds each sequence's). These kernels serve long sequences, where attention is
# the better buy per kept byte anyway; the reference system keeps ``v3`` the same way. torch_npu also
# registers its own ``aten::scaled_dot_product_attention`` kernels for the NPU and AutogradNPU keys, so
# on an NPU a dispatch mode sees that composite op, not the ``_scaled_dot_product_*`` kernels.
_NPU_ATTENTION_OPS = (
    "npu::npu_fusion_attention",
    "npu::npu_fusion_attention_v2",
    "npu::npu_fusion_attention_v3",
    "aten::scaled_dot_product_attention",
)

# Every npu:: op of torch_npu 2.14.0 whose schema takes an HCCL communicator (``str hcom``) or group
# name (``str group``, ``str group_ep``, ``str group_tp``): matmuls and MoE routing fused with a
# collective. Their outputs carry communication, so they are never replayed; tests check this list
# against the wheel's schemas (tests/npu_schemas.json, written by scripts/npu_schemas.py). The
# ``npu_custom_dist::`` ops take an HCCL process group: the uneven collectives torch_npu's
# ``torch.distributed`` backend issues (read from ``libtorch_npu.so``).
_NPU_COMMUNICATION_OPS = (
    "npu::_npu_distribute_barrier",
    "npu::npu_all_gather_base_mm",
    "npu::npu_all_gather_quant_mm",
    "npu::npu_all_to_all_matmul",
    "npu::npu_all_to_all_quant_matmul",
    "npu::npu_alltoallv_gmm",
    "npu::npu_alltoallv_quant_gmm",
    "npu::npu_attention_to_ffn",
    "npu::npu_ffn_to_attention",
    "npu::npu_gmm_alltoallv",
    "npu::npu_matmul_all_to_all",
    "npu::npu_mm_all_reduce_base",
    "npu::npu_mm_reduce_scatter_base",
    "npu::npu_moe_distribute_combine",
    "npu::npu_moe_distribute_combine_add_rms_norm",
    "npu::npu_moe_distribute_combine_v2",
    "npu::npu_moe_distribute_dispatch",
    "npu::npu_moe_distribute_dispatch_v2",
    "npu::npu_quant_gmm_alltoallv",
    "npu::npu_quant_matmul_all_to_all",
    "npu::npu_quant_mm_reduce_scatter",
    "npu_custom_dist::wrap_allgather_base_uneven_inner",
    "npu_custom_dist::wrap_alltoallvc_inner",
    "npu_custom_dist::wrap_batch_isend_irecv_inner",
    "npu_custom_dist::wrap_reduce_scatter_base_uneven_inner",
)


# ``torch_npu.Format`` codes whose storage is the plain layout; every other one is an internal format.
_NPU_PLAIN_FORMATS = {-1: "UNDEFINED", 0: "NCHW", 1: "NHWC", 2: "ND", 30: "NCDHW"}
_NPU_INTERNAL_FORMATS = {3: "NC1HWC0", 4: "FRACTAL_Z", 29: "FRACTAL_NZ", 32: "NDC1HWC0", 33: "FRACTAL_Z_3D"}
# torch_npu's format query (``npu::`` only, in 2.1 through 2.14).
_NPU_FORMAT_QUERY = ("npu::get_npu_format",)


@register_backend
class NpuBackend(DeviceModuleBackend):
    """Ascend NPUs through ``torch_npu``; probed before CUDA by ``backend="auto"`` because
    ``torch_npu`` can make ``torch.cuda.is_available()`` report true."""

    name: ClassVar[str] = "npu"
    auto_priority: ClassVar[int | None] = 30

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """NOTE [torch_npu is loaded by torch]: usually torch has imported torch_npu already."""
        if sys.modules.get("torch_npu") is None:  # not imported, or marked not importable
            if importlib.util.find_spec("torch_npu") is None:
                return "the torch_npu package is not installed; install torch-npu matching your torch version"
            autoload_off = os.environ.get(AUTOLOAD_ENV, "1") != "1"
            failure = _import_torch_npu()
            if failure is not None:
                how = (f"{AUTOLOAD_ENV}=0 kept `import torch` from importing it, which otherwise fails the same way"
                       if autoload_off else "this torch_npu registers no autoload entry point")
                return (f"the torch_npu package is installed but failed to import ({failure}); {how}. Install Ascend "
                        "CANN and source its set_env.sh, or uninstall torch-npu")
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


def _import_torch_npu() -> str | None:
    """Import torch_npu (reached with autoload off: NOTE [torch_npu is loaded by torch]); the error, or ``None``.

    torch_npu sets ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` while it imports and restores the value only
    when its import completes, so a failed import would leave autoload off for every subprocess this
    one starts; the value is put back here.
    """
    autoload = os.environ.get(AUTOLOAD_ENV)
    try:
        importlib.import_module("torch_npu")
    except Exception as error:  # without Ascend CANN: "libhccl.so: cannot open shared object file"
        if autoload is None:
            os.environ.pop(AUTOLOAD_ENV, None)
        else:
            os.environ[AUTOLOAD_ENV] = autoload
        return f"{type(error).__name__}: {error}"
    return None
