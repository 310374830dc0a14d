"""Device-neutral measurements: peak activation memory, bytes kept for backward, and FLOPs.

Device memory cannot be read on every machine, so hyperac measures what does not depend on the
device: the peak of live activation storage over a whole training step (:class:`PeakMeter`: what
a ``budget=`` bounds; on CUDA/NPU it can read the allocator's own peak instead), the bytes of
storages created during forward that are still alive when backward starts
(:class:`ActivationMeter`, which also sees selective-recompute caches that ``saved_tensors_hooks``
miss), and the FLOPs of forward plus backward (:func:`flop_counter`, which counts the CPU
flash-attention kernels that torch's own table leaves at zero).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import FlopCounterMode, sdpa_backward_flop_count, sdpa_flop_count

__all__ = [
    "ActivationMeter", "OpCounter", "PeakMeter", "StepMode", "StorageTimeline", "created_storages", "flop_counter",
    "op_tensors", "step_peak",
]


def op_tensors(value: Any, found: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """The tensors in an op's arguments or result: nested tuples, lists and dicts, what aten ops
    take and return. The dispatch modes here call it on every op, where pytree's general
    ``tree_flatten`` (registered node types, namedtuple checks) was most of their cost."""
    found = [] if found is None else found
    if isinstance(value, torch.Tensor):
        found.append(value)
        return found
    for item in value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ():
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (tuple, list, dict)):
            op_tensors(item, found)
    return found


def created_storages(inputs: Any, out: Any) -> list[torch.UntypedStorage]:
    """Storages of an op's output tensors that none of its inputs already had.

    Views (``aten.t(weight)``, reshapes) and in-place results share an input's storage: that
    storage was made elsewhere (a parameter, an earlier op), so the op did not create it.
    """
    seen = {t.untyped_storage()._cdata for t in op_tensors(inputs)}
    created = []
    for value in op_tensors(out):
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


class StepMode(TorchDispatchMode):
    """Base of the modes that watch a training step: they see the step as it trains.

    A higher-order op counts as one op (NOTE [Higher-order operators] in higher_order.py), and compiled
    code a layer calls (a compiled flex attention) runs compiled, as in training, rather than eagerly,
    which dynamo otherwise does under a dispatch mode (and which ``flex_attention``'s ``fullgraph``
    compile refuses): a compiled region's ops are then seen as its compiled code issues them.
    """

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True


class ActivationMeter(StepMode):
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

    def release(self, outputs: Any) -> None:
        """Stop counting the storages of the tensors in ``outputs`` (the caller's, such as logits)."""
        for value in tree_flatten(outputs)[0]:
            if isinstance(value, torch.Tensor):
                self._storages.pop(value.untyped_storage()._cdata, None)

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


class StorageTimeline:
    """When each storage created during a step was born and died, in op counts.

    NOTE [Peak from a timeline]
    A storage is born at the op that created it and dies when its last reference goes (a weakref
    callback records the op count at that moment, so it was alive during that op and not after).
    The peak is computed afterwards from the births and deaths, so that storages whose role is
    only known later can be left out: a weight-gradient ``mm`` output becomes ``param.grad``
    (parameters and their gradients are not activations), and the tensors a model returns are the
    caller's from the moment it returns them. Storages resized in place (swap frees device memory
    that way) are counted at their size when created; use the allocator's statistics there.
    """

    def __init__(self) -> None:
        self.now = 0
        self.births: list[tuple[int, int, weakref.ref]] = []
        """Per storage id: (op index it was born at, bytes, weak reference)."""
        self.deaths: dict[int, int] = {}
        self.released: dict[int, int] = {}
        self._ids: dict[int, int] = {}  # storage._cdata -> id; an address is reused once freed

    def tick(self) -> int:
        """Start the next op; returns its index."""
        self.now += 1
        return self.now

    def id_of(self, storage: torch.UntypedStorage) -> int | None:
        """The id of a storage recorded here and still alive, else ``None``."""
        found = self._ids.get(storage._cdata)
        return found if found is not None and self.births[found][2]() is storage else None

    def add(self, storage: torch.UntypedStorage) -> int:
        """Record a storage born now (once); returns its id."""
        found = self.id_of(storage)
        if found is not None:
            return found
        new = len(self.births)
        deaths = self.deaths

        def died(_: Any, new: int = new) -> None:
            deaths[new] = self.now

        self.births.append((self.now, storage.nbytes(), weakref.ref(storage, died)))
        self._ids[storage._cdata] = new
        return new

    def ids(self, tensors: Any) -> set[int]:
        """Ids of the recorded, alive storages of the tensors in ``tensors``."""
        found = (self.id_of(t.untyped_storage()) for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor))
        return {i for i in found if i is not None}

    def release(self, tensors: Any) -> None:
        """From now on, don't count the storages of these tensors (they belong to the caller)."""
        for key in self.ids(tensors):
            self.released.setdefault(key, self.now)

    def alive_until(self, key: int) -> int:
        """The last op index during which storage ``key`` counts."""
        return min(self.deaths.get(key, self.now), self.released.get(key, self.now))

    def live_bytes(self, excluded: Iterable[int] = ()) -> list[int]:
        """Live bytes during each op ``0..now``, leaving out the storage ids in ``excluded``."""
        skip = set(excluded)
        delta = [0] * (self.now + 2)
        for key, (born, nbytes, _) in enumerate(self.births):
            end = self.alive_until(key)
            if key not in skip and end >= born:
                delta[born] += nbytes
                delta[end + 1] -= nbytes
        live, total = [], 0
        for change in delta[:-1]:
            total += change
            live.append(total)
        return live


def gradients(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters' ``.grad`` tensors that exist now."""
    return [p.grad for p in parameters if p.grad is not None]


class PeakMeter(StepMode):
    """The peak of live activation storage over a training step, forward and backward together.

    Counts storages created by ops while it is active (so parameters, their views such as
    ``aten.t(weight)``, and the inputs given to it are not counted) and leaves out storages that
    end up as a parameter's ``.grad``. Activation gradients and recompute transients count: this
    is the memory a ``budget=`` bounds. :meth:`release` marks the tensors a model returned as the
    caller's from then on (the logits a user keeps alive across backward are not activations)::

        with PeakMeter(model.parameters()) as meter:
            out = model(**batch)
            meter.release(out)
            out.loss.backward()
        meter.peak_bytes

    With ``backend=`` a backend that reports allocator statistics (CUDA, NPU), the peak is read
    from the allocator instead (reset on entry, minus what was allocated on entry); that figure
    also includes parameter gradients allocated during the step (zero them with
    ``set_to_none=False`` beforehand to keep them out) and allocator rounding.
    """

    def __init__(self, parameters: Iterable[torch.Tensor] = (), backend: Any = None) -> None:
        super().__init__()
        self.parameters = list(parameters)
        self.backend = backend if backend is not None and getattr(backend, "has_memory_stats", False) else None
        # The allocator statistics of the parameters' device, not of whichever device is current.
        self.device = self.parameters[0].device if self.parameters else None
        self.timeline = StorageTimeline()
        self.peak_bytes: int | None = None
        self._baseline = 0

    def __enter__(self) -> PeakMeter:
        if self.backend is not None:
            self.backend.synchronize(self.device)
            self.backend.reset_peak_memory_stats(self.device)
            self._baseline = self.backend.memory_allocated(self.device)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        result = super().__exit__(*exc)
        if self.backend is not None:
            self.backend.synchronize(self.device)
            self.peak_bytes = self.backend.max_memory_allocated(self.device) - self._baseline
        else:
            self.peak_bytes = max(self.timeline.live_bytes(self.timeline.ids(gradients(self.parameters))), default=0)
        return result

    def release(self, outputs: Any) -> None:
        """The tensors in ``outputs`` are the caller's from now on: stop counting their storages."""
        self.timeline.release(outputs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.timeline.tick()
        out = func(*args, **(kwargs or {}))
        for storage in created_storages((args, kwargs), out):
            self.timeline.add(storage)
        return out


def step_peak(model: Any, batch: dict[str, Any]) -> int:
    """Peak activation bytes of one step ``model(**batch).loss.backward()`` (:class:`PeakMeter`; the
    returned outputs are released as the caller's). Clears the parameters' gradients afterwards."""
    with PeakMeter(model.parameters()) as meter:
        output = model(**batch)
        meter.release(output)
        output.loss.backward()
    del output
    model.zero_grad(set_to_none=True)
    return int(meter.peak_bytes)


class OpCounter(StepMode):
    """Counts the aten ops dispatched while it is active (``count``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))
