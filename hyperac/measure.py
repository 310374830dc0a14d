"""Device-neutral measurements: activation bytes kept for backward, and FLOPs.

Device memory cannot be read on every machine, so hyperac measures what does not depend on the
device: the bytes of storages created during forward that are still alive when backward starts
(:class:`ActivationMeter`, which also sees selective-recompute caches that ``saved_tensors_hooks``
miss), and the FLOPs of forward plus backward (:func:`flop_counter`, which counts the CPU
flash-attention kernels that torch's own table leaves at zero).
"""

from __future__ import annotations

import math
import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["ActivationMeter", "created_storages", "flop_counter"]


def created_storages(inputs: Any, out: Any) -> list[torch.UntypedStorage]:
    """Storages of an op's output tensors that none of its inputs already had.

    Views (``aten.t(weight)``, reshapes) and in-place results share an input's storage: that
    storage was made elsewhere (a parameter, an earlier op), so the op did not create it.
    """
    seen = {t.untyped_storage()._cdata for t in tree_flatten(inputs)[0] if isinstance(t, torch.Tensor)}
    created = []
    for value in tree_flatten(out)[0]:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            if storage._cdata not in seen:
                seen.add(storage._cdata)
                created.append(storage)
    return created


def _cpu_attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward_flops(grad_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs):
    return sdpa_backward_flop_count(grad_shape, query_shape, key_shape, value_shape)


def _grouped_matmul_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """``(M, K) x (G, K, N)`` with group offsets, or batched ``(G, M, K) x (G, K, N)``."""
    return 2 * math.prod(out_shape) * a_shape[-1]


def flop_counter(display: bool = False) -> FlopCounterMode:
    """A ``FlopCounterMode`` that also counts what torch 2.13's table leaves at zero: the CPU
    flash-attention kernel and its backward, and grouped matmuls (MoE experts); wrap forward and
    backward together in it."""
    aten = torch.ops.aten
    formulas = {
        "_scaled_dot_product_flash_attention_for_cpu": _cpu_attention_flops,
        "_scaled_dot_product_flash_attention_for_cpu_backward": _cpu_attention_backward_flops,
        "_grouped_mm": _grouped_matmul_flops,
        "_scaled_grouped_mm": _grouped_matmul_flops,
    }
    mapping = {getattr(aten, name): formula for name, formula in formulas.items() if hasattr(aten, name)}
    return FlopCounterMode(display=display, custom_mapping=mapping)


class ActivationMeter(TorchDispatchMode):
    """Counts the bytes of storages created during forward that are alive when backward starts.

    Views of parameters (``aten.t(weight)``) are not activations and are not counted. Enter it
    around forward *and* backward (a mode present only in forward would change the op stream a
    selective replay sees); call :meth:`mark_backward` between them::

        with ActivationMeter() as meter:
            loss = model(**batch).loss
            meter.mark_backward()
            loss.backward()
        meter.activation_bytes
    """

    def __init__(self) -> None:
        super().__init__()
        self._storages: dict[int, tuple[weakref.ref, int]] = {}
        self._recording = True
        self.activation_bytes: int | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._recording:
            for storage in created_storages((args, kwargs), out):
                self._storages[storage._cdata] = (weakref.ref(storage), storage.nbytes())
        return out

    def alive_bytes(self) -> int:
        """Bytes of the recorded storages that are still alive (and not resized away) now."""
        total = 0
        for ref, _ in self._storages.values():
            storage = ref()
            if storage is not None:
                total += storage.nbytes()
        return total

    def mark_backward(self) -> int:
        """Stop recording and count what forward left alive; returns that byte count."""
        self._recording = False
        self.activation_bytes = self.alive_bytes()
        return self.activation_bytes


def measure_step(model: Any, loss_fn: Any) -> tuple[int, int]:
    """Run ``loss_fn(model)`` and its backward once; return (activation bytes, total FLOPs)."""
    with flop_counter() as flops, ActivationMeter() as meter:
        loss = loss_fn(model)
        meter.mark_backward()
        loss.backward()
    return int(meter.activation_bytes or 0), int(flops.get_total_flops())
