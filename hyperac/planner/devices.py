"""Device profiles: what a step costs on a device that is not here (``hyperac plan --device``).

A profile on ``meta`` has no clock, so each op's time is a roofline: the larger of its FLOPs over
the device's peak FLOP/s for the op's dtype and its bytes moved over the memory bandwidth. That
is the time the op needs when it is the only thing the device does; real kernels reach perhaps
50-80% of it, the same for every mode, so plans compare fairly although absolute times are low.
Host-side work per op (Python, dispatch, the recording and replay of selective recompute) is
measured on this host (:mod:`.dispatch`) and runs in parallel with an asynchronous device: a
layer costs the larger of its device time and its host time.

Figures are the vendors' data-sheet peaks for dense math (no 2:4 sparsity), SXM/OAM parts:
- H100 SXM5: NVIDIA H100 Tensor Core GPU datasheet (2023): BF16/FP16 989.4 TFLOPS, TF32 494.7,
  FP32 66.9; HBM3 3.35 TB/s; PCIe Gen5 x16 host link, 64 GB/s each way.
- H200 SXM: NVIDIA H200 Tensor Core GPU datasheet (2024): BF16/FP16 989 TFLOPS, TF32 494,
  FP32 67; HBM3e 4.8 TB/s; PCIe Gen5 x16, 64 GB/s each way.
- A100 SXM4 80GB: NVIDIA A100 Tensor Core GPU datasheet (2021): BF16/FP16 312 TFLOPS, TF32 156,
  FP32 19.5; HBM2e 2.039 TB/s; PCIe Gen4 x16, 32 GB/s each way.
- Ascend 910B: Huawei Atlas 800T A2 training server datasheet: FP16 313 TFLOPS per NPU
  (BF16 taken equal), HBM2e 1.6 TB/s, PCIe 5.0 x16 host link (64 GB/s each way). FP32 is not on
  the sheet; a quarter of FP16 is assumed.
- cpu: measured on this host at first use (a float32 matmul and a large copy), not a data sheet.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Iterable

import torch

from ..errors import ConfigError

__all__ = ["DEVICES", "DeviceProfile", "device_profile"]

TERA = 1e12


@dataclasses.dataclass(frozen=True)
class DeviceProfile:
    """Peak rates of one device, for the roofline."""

    name: str
    flops: dict[str, float]
    """Peak FLOP/s per dtype name (``bfloat16``, ``float16``, ``float32``)."""
    memory_bandwidth: float
    """Device memory bytes/s."""
    host_link_bandwidth: float
    """Host <-> device bytes/s, one direction (what a swap copy runs at)."""
    asynchronous: bool = True
    """The host queues work and goes on (GPUs, NPUs): host and device time overlap."""

    def op_seconds(self, flops: int, bytes_moved: int, dtype: torch.dtype | None) -> float:
        name = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
        rate = self.flops.get(name, self.flops["float32"])
        return max(flops / rate, bytes_moved / self.memory_bandwidth)

    def seconds(self, ops: Iterable[tuple[int, int, torch.dtype | None]]) -> float:
        return sum(self.op_seconds(*op) for op in ops)


DEVICES: dict[str, DeviceProfile] = {
    "h100": DeviceProfile("h100", {"bfloat16": 989.4 * TERA, "float16": 989.4 * TERA, "float32": 494.7 * TERA},
                          3.35e12, 64e9),
    "h200": DeviceProfile("h200", {"bfloat16": 989 * TERA, "float16": 989 * TERA, "float32": 494 * TERA},
                          4.8e12, 64e9),
    "a100": DeviceProfile("a100", {"bfloat16": 312 * TERA, "float16": 312 * TERA, "float32": 156 * TERA},
                          2.039e12, 32e9),
    "910b": DeviceProfile("910b", {"bfloat16": 313 * TERA, "float16": 313 * TERA, "float32": 313 * TERA / 4},
                          1.6e12, 64e9),
}
"""Accelerators by ``--device`` name. float32 matmuls are costed at the TF32 tensor-core rate
(torch's ``allow_tf32`` / NPU default); plain FP32 is 66.9 (H100), 67 (H200), 19.5 (A100)."""


@functools.lru_cache(maxsize=1)
def _this_cpu() -> DeviceProfile:
    """This host's CPU, measured once per process: float32 matmul FLOP/s and copy bandwidth."""
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    big = torch.empty(1 << 22)
    start = time.perf_counter()
    for _ in range(20):
        torch.mm(a, b)
    flops = 20 * 2 * 256**3 / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(5):
        big.clone()
    bandwidth = 5 * 2 * big.numel() * 4 / (time.perf_counter() - start)
    return DeviceProfile("cpu", {"float32": flops, "bfloat16": flops / 4, "float16": flops / 4},
                         bandwidth, bandwidth, asynchronous=False)


def device_profile(name: str) -> DeviceProfile:
    """The profile named ``name`` (``h100``, ``h200``, ``a100``, ``910b`` or ``cpu``)."""
    if name == "cpu":
        return _this_cpu()
    if name not in DEVICES:
        raise ConfigError(f"unknown device profile {name!r}; choose one of {', '.join([*DEVICES, 'cpu'])}.")
    return DEVICES[name]
