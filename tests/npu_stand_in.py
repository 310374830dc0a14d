"""A stand-in for ``torch_npu`` 2.14, for the NPU tests of a machine without Ascend hardware.

``torch_npu`` cannot be installed here (without Ascend CANN it makes ``import torch`` fail), so
the tests model the three things hyperac meets of it, each after the real package:

* its ops: every ``npu::`` schema and tag of the real wheel (``npu_schemas.json``, written by
  ``scripts/npu_schemas.py``), defined with ``torch.library``, with CPU kernels for the few the
  tests run (fused attention, a matmul fused with an all-reduce, MoE dispatch and combine, the
  format query). The kernels compute something plausible with the real output structure; they show
  how hyperac classifies, keeps and replays these ops, never how an Ascend kernel behaves;
* its device module, ``torch.npu`` (:class:`NpuDeviceModule`): streams, events, memory statistics,
  RNG state, graph capture, as in ``torch_npu/npu/``, rejecting a device of another type the way
  ``torch_npu/npu/utils.py`` does;
* its autoload: a distribution with a ``[torch.backends]`` entry point (:func:`write_distribution`),
  which ``import torch`` imports, as it imports the real one.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import json
import math
import os
import sys
import types
from collections import Counter
from pathlib import Path
from typing import Any

import torch

SCHEMAS = json.loads((Path(__file__).parent / "npu_schemas.json").read_text())
"""``{"torch_npu": version, "ops": [{"schema", "tags", "source"}, ...]}`` of the real wheel."""

KERNEL_RUNS: Counter = Counter()
"""Runs of each stand-in CPU kernel, by op name (``npu_fusion_attention``, ...)."""

FORMATS: dict[int, int] = {}
"""The stand-in ``npu::get_npu_format``'s answer by storage address (``torch_npu.Format`` codes; ND
unless a test set another)."""


def op_name(schema: str) -> str:
    """``npu_format_cast.Tensor`` of ``npu_format_cast.Tensor(Tensor input, ...) -> Tensor``."""
    return schema.partition("(")[0]


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


def _to_bnsd(tensor: torch.Tensor, layout: str, heads: int) -> torch.Tensor:
    """``(batch, heads, seq, dim)`` view of a query, key or value in torch_npu's ``input_layout``."""
    if layout == "BNSD":
        return tensor
    if layout == "BSND":
        return tensor.transpose(1, 2)
    if layout in ("BSH", "SBH"):
        batch_first = tensor if layout == "BSH" else tensor.transpose(0, 1)
        return batch_first.unflatten(-1, (heads, -1)).transpose(1, 2)
    raise NotImplementedError(f"the stand-in npu_fusion_attention supports BNSD, BSND, BSH and SBH, not {layout!r}")


def _from_bnsd(tensor: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return tensor
    if layout == "BSND":
        return tensor.transpose(1, 2)
    batch_first = tensor.transpose(1, 2).flatten(-2)
    return batch_first if layout == "BSH" else batch_first.transpose(0, 1)


def _dropout_mask(shape: torch.Size, seed: int, keep_prob: float) -> torch.Tensor | None:
    """The kept positions, regenerated from ``seed`` as the real grad kernel regenerates its philox mask."""
    if keep_prob >= 1:
        return None
    return torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < keep_prob


def _probabilities(q, k, scale):
    scores = q @ k.transpose(-1, -2) * scale
    softmax_max = scores.amax(-1, keepdim=True)
    exp = (scores - softmax_max).exp()
    softmax_sum = exp.sum(-1, keepdim=True)
    return exp / softmax_sum, softmax_max, softmax_sum


def _attention(query, key, value, head_num, input_layout, scale, keep_prob):
    """Forward of the fused attention: ``(attention_out, softmax_max, softmax_sum, softmax_out, seed,
    numels)``. A dropout (``keep_prob < 1``) draws its seed from the default generator, so the op
    advances it once, like the real kernel its NPU generator's philox offset."""
    q, k, v = (_to_bnsd(t, input_layout, head_num) for t in (query, key, value))
    probs, softmax_max, softmax_sum = _probabilities(q, k, scale)
    seed = int(torch.randint(1 << 62, ())) if keep_prob < 1 else 0
    mask = _dropout_mask(probs.shape, seed, keep_prob)
    if mask is not None:
        probs = probs * mask / keep_prob
    out = _from_bnsd(probs @ v, input_layout).contiguous()  # the kernel writes its output in the input layout
    # the real kernel keeps each row's max and sum 8 times over, in float32
    stats = [s.float().expand(*s.shape[:-1], 8).contiguous() for s in (softmax_max, softmax_sum)]
    return out, *stats, query.new_empty(0), seed, math.prod(probs.shape)


def _attention_grad(query, key, value, grad_out, head_num, input_layout, scale, keep_prob, seed):
    q, k, v, g = (_to_bnsd(t, input_layout, head_num) for t in (query, key, value, grad_out))
    probs, _, _ = _probabilities(q, k, scale)
    mask = _dropout_mask(probs.shape, seed, keep_prob)
    dropped = probs if mask is None else probs * mask / keep_prob
    grad_probs = g @ v.transpose(-1, -2)
    if mask is not None:
        grad_probs = grad_probs * mask / keep_prob
    grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True))
    grads = (grad_scores @ k * scale, grad_scores.transpose(-1, -2) @ q * scale, dropped.transpose(-1, -2) @ g)
    return tuple(_from_bnsd(grad, input_layout).contiguous() for grad in grads)


class _Differentiable(torch.autograd.Function):
    """The Autograd kernel of a stand-in op: runs the op below autograd (where a dispatch mode sees
    it) and differentiates its first output by ``grad(inputs, rest, kwargs, outputs, grad_out)``
    (``outputs`` without the first, which holding would close a cycle through this node)."""

    @staticmethod
    def forward(ctx, op, grad, rest, kwargs, *inputs):
        with torch._C._AutoDispatchBelowAutograd():
            outputs = op(*inputs, *rest, **kwargs)
        several = outputs if isinstance(outputs, tuple) else (outputs,)
        ctx.grad, ctx.rest, ctx.kwargs, ctx.outputs = grad, rest, kwargs, (None, *several[1:])
        ctx.save_for_backward(*inputs)
        ctx.mark_non_differentiable(*[o for o in several[1:] if isinstance(o, torch.Tensor)])
        return outputs

    @staticmethod
    def backward(ctx, grad_out, *_):
        return None, None, None, None, *ctx.grad(ctx.saved_tensors, ctx.rest, ctx.kwargs, ctx.outputs, grad_out)


def _fused_attention(name, query, key, value, head_num, input_layout, scale, keep_prob):
    """``(out, softmax_max, softmax_sum, softmax_out, seed, offset, numels)`` of op ``name``; counts the run."""
    KERNEL_RUNS[name] += 1
    out, softmax_max, softmax_sum, softmax_out, seed, numels = _attention(
        query, key, value, head_num, input_layout, scale, keep_prob)
    return out, softmax_max, softmax_sum, softmax_out, seed, 0, numels


def _fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                      scale=1.0, keep_prob=1.0, *rest):
    """``npu_fusion_attention``: 4 tensors and 3 ints (seed, offset, numels)."""
    return _fused_attention("npu_fusion_attention", query, key, value, head_num, input_layout, scale, keep_prob)


def _fusion_attention_v2(query, key, value, head_num, input_layout, *, scale=1.0, keep_prob=1.0, **kwargs):
    """``npu_fusion_attention_v2``: as v1, with everything after ``input_layout`` keyword-only."""
    return _fused_attention("npu_fusion_attention_v2", query, key, value, head_num, input_layout, scale, keep_prob)


def _fusion_attention_v3(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, *rest):
    """``npu_fusion_attention_v3``: 6 tensors, the philox seed and offset among them."""
    out, softmax_max, softmax_sum, softmax_out, seed, offset, _ = _fused_attention(
        "npu_fusion_attention_v3", query, key, value, head_num, input_layout, scale, keep_prob)
    return out, softmax_max, softmax_sum, softmax_out, torch.tensor([seed]), torch.tensor([offset])


def _fusion_attention_grad(inputs, rest, kwargs, outputs, grad_out):
    """v1 and v3 take ``scale`` and ``keep_prob`` positionally (the dispatcher drops trailing defaults),
    v2 keyword-only; the seed is an int output (v1, v2) or a one-element tensor (v3)."""
    head_num, input_layout = rest[:2]
    scale = rest[5] if len(rest) > 5 else kwargs.get("scale", 1.0)
    keep_prob = rest[6] if len(rest) > 6 else kwargs.get("keep_prob", 1.0)
    return _attention_grad(*inputs, grad_out, head_num, input_layout, scale, keep_prob, int(outputs[4]))


def _mm_all_reduce_base(x1, x2, hcom, reduce_op="sum", *rest):
    """``npu_mm_all_reduce_base`` on one rank: the matmul; the all-reduce over one rank is the identity."""
    KERNEL_RUNS["npu_mm_all_reduce_base"] += 1
    return x1 @ x2


def _mm_all_reduce_grad(inputs, rest, kwargs, outputs, grad_out):
    x1, x2 = inputs
    return grad_out @ x2.transpose(-1, -2), x1.transpose(-1, -2) @ grad_out


def _moe_distribute_dispatch_v2(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *rest):
    """``npu_moe_distribute_dispatch_v2`` on one rank: the tokens, by expert; 7 tensors (expand_x,
    dynamic_scales, assist_info_for_combine, expert_token_nums, ep_recv_counts, tp_recv_counts,
    expand_scales)."""
    KERNEL_RUNS["npu_moe_distribute_dispatch_v2"] += 1
    order = expert_ids.flatten().argsort(stable=True)
    top_k = expert_ids.shape[-1]
    counts = torch.bincount(expert_ids.flatten(), minlength=moe_expert_num)
    empty = x.new_empty(0)
    return (x.repeat_interleave(top_k, 0)[order], x.new_ones(order.shape[0], dtype=torch.float32), order,
            counts, counts.clone(), torch.zeros(1, dtype=torch.int64), empty)


def _moe_distribute_combine_v2(expand_x, expert_ids, assist_info_for_combine, ep_send_counts, expert_scales,
                               group_ep, ep_world_size, ep_rank_id, moe_expert_num, *rest):
    """``npu_moe_distribute_combine_v2`` on one rank: each token's expert outputs, weighted and summed."""
    KERNEL_RUNS["npu_moe_distribute_combine_v2"] += 1
    unsorted = torch.empty_like(expand_x).index_copy_(0, assist_info_for_combine, expand_x)
    tokens, top_k = expert_ids.shape
    return (unsorted.view(tokens, top_k, -1) * expert_scales.unsqueeze(-1).to(unsorted.dtype)).sum(1)


def _moe_dispatch_grad(inputs, rest, kwargs, outputs, grad_out):
    x, expert_ids = inputs
    top_k = expert_ids.shape[-1]
    unsorted = torch.empty_like(grad_out).index_copy_(0, outputs[2], grad_out)
    return unsorted.view(x.shape[0], top_k, -1).sum(1), None


def _moe_combine_grad(inputs, rest, kwargs, outputs, grad_out):
    expand_x, expert_ids, assist, counts, expert_scales = inputs
    tokens, top_k = expert_ids.shape
    per_expert = (grad_out.unsqueeze(1) * expert_scales.unsqueeze(-1).to(grad_out.dtype)).flatten(0, 1)
    grad_scales = (expand_x.new_empty(expand_x.shape).index_copy_(0, assist, expand_x).view(tokens, top_k, -1)
                   * grad_out.unsqueeze(1)).sum(-1)
    return per_expert[assist], None, None, None, grad_scales.to(expert_scales.dtype)


def _get_npu_format(tensor):
    KERNEL_RUNS["get_npu_format"] += 1
    return FORMATS.get(tensor.untyped_storage().data_ptr(), 2)


_KERNELS = {
    "npu_fusion_attention": (_fusion_attention, _fusion_attention_grad, 3),
    "npu_fusion_attention_v2": (_fusion_attention_v2, _fusion_attention_grad, 3),
    "npu_fusion_attention_v3": (_fusion_attention_v3, _fusion_attention_grad, 3),
    "npu_mm_all_reduce_base": (_mm_all_reduce_base, _mm_all_reduce_grad, 2),
    "npu_moe_distribute_dispatch_v2": (_moe_distribute_dispatch_v2, _moe_dispatch_grad, 2),
    "npu_moe_distribute_combine_v2": (_moe_distribute_combine_v2, _moe_combine_grad, 5),
    "get_npu_format": (_get_npu_format, None, 1),
}
"""Stand-in CPU kernels: ``name -> (kernel, gradient or None, number of leading tensor inputs)``."""


def _autograd_kernel(op, grad, tensor_inputs):
    def kernel(*args, **kwargs):
        return _Differentiable.apply(op, grad, args[tensor_inputs:], kwargs, *args[:tensor_inputs])
    return kernel


def register_ops() -> torch.library.Library:
    """Define every ``npu::`` schema of the real wheel not registered yet, with its tags, and give the
    ops the tests run their CPU kernels and gradients. On a machine with the real torch_npu the
    schemas are its own and only the CPU kernels are added. Destroy the returned library to undo."""
    library = torch.library.Library("npu", "FRAGMENT")
    for entry in SCHEMAS["ops"]:
        name = op_name(entry["schema"])
        base, _, overload = name.partition(".")
        packet = getattr(torch.ops.npu, base, None)
        if packet is None or (overload or "default") not in packet.overloads():
            library.define(entry["schema"], tags=tuple(getattr(torch.Tag, tag) for tag in entry["tags"]))
    for name, (kernel, grad, tensor_inputs) in _KERNELS.items():
        library.impl(name, kernel, "CPU")
        if grad is not None:
            library.impl(name, _autograd_kernel(getattr(torch.ops.npu, name).default, grad, tensor_inputs), "Autograd")
    return library


# ---------------------------------------------------------------------------------------------
# Device module
# ---------------------------------------------------------------------------------------------


class NpuStream:
    """``torch_npu.npu.Stream``: a wrapper of a stream id; two wrappers of one stream are ``==``."""

    def __init__(self, module: NpuDeviceModule, stream_id: int, device_index: int) -> None:
        self.module, self.stream_id, self.device_index = module, stream_id, device_index

    @property
    def label(self) -> str:
        return "default" if self.stream_id == 0 else f"side{self.stream_id}"

    def wait_event(self, event: NpuEvent) -> None:
        event.wait(self)

    def wait_stream(self, stream: NpuStream) -> None:
        self.wait_event(stream.record_event())

    def record_event(self, event: NpuEvent | None = None) -> NpuEvent:
        event = self.module.Event() if event is None else event
        event.record(self)
        return event

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.module.calls.append(("stream.synchronize", self.label))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NpuStream) and (other.stream_id, other.device_index) == (
            self.stream_id, self.device_index)

    def __hash__(self) -> int:
        return hash((self.stream_id, self.device_index))

    def __repr__(self) -> str:
        return f"<stand-in torch_npu.npu.Stream {self.label} device={self.device_index}>"


class NpuEvent:
    """``torch_npu.npu.Event``: recorded on, and waited by, the current stream unless one is given."""

    def __init__(self, module: NpuDeviceModule, label: str) -> None:
        self.module, self.label = module, label

    def record(self, stream: NpuStream | None = None) -> None:
        stream = self.module.current_stream() if stream is None else stream
        self.module.calls.append(("record", self.label, stream.label))

    def wait(self, stream: NpuStream | None = None) -> None:
        stream = self.module.current_stream() if stream is None else stream
        self.module.calls.append(("wait", stream.label, self.label))

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        self.module.calls.append(("event.synchronize", self.label))


class NpuDeviceModule(types.ModuleType):
    """Stand-in for ``torch_npu.npu``, installed as ``torch.npu``; records the calls that reach it.

    ``device_type`` is the type of its devices: ``"npu"`` where the stand-in autoloads (it renames
    torch's private-use backend to ``npu``, as torch_npu does); ``"cpu"`` where CPU tensors stand in
    for NPU tensors. A device of any other type raises ``ValueError('Expected a npu device, but got:
    ...')``, as ``torch_npu.npu.utils._get_device_index`` does.
    """

    def __init__(self, available: bool = True, device_type: str = "npu", device_count: int = 2) -> None:
        super().__init__("torch_npu.npu")
        self.available, self.device_type, self.count = available, device_type, device_count
        self.calls: list[tuple] = []
        self.device_index = 0
        self._current = dict.fromkeys(range(device_count), 0)
        self._streams = 0
        self._events = 0
        self.capturing = False
        self.allocated, self.peak = 1 << 20, 3 << 20
        self.generators = [torch.Generator().manual_seed(1000 + index) for index in range(device_count)]

    def _index(self, device: Any) -> int:
        if device is None:
            return self.device_index
        if isinstance(device, int):
            return device
        if isinstance(device, str):
            kind, _, index = device.partition(":")
        else:
            kind, index = device.type, device.index
        if kind != self.device_type:
            raise ValueError(f"Expected a npu device, but got: {device}")
        return self.device_index if index in (None, "") else int(index)

    def _log(self, name: str, device: Any = None) -> int:
        index = self._index(device)
        self.calls.append((name,) if device is None else (name, index))
        return index

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]

    def is_available(self) -> bool:
        self.calls.append(("is_available",))
        return self.available

    def is_initialized(self) -> bool:
        """Whether anything called this module yet (the stand-in's lazy initialisation)."""
        return bool(self.calls)

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        self.calls.append(("current_device",))
        return self.device_index

    def Stream(self, device: Any = None, priority: int = 0, **kwargs: Any) -> NpuStream:  # noqa: N802
        index = self._log("Stream", device)
        self._streams += 1
        return NpuStream(self, self._streams, index)

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> NpuEvent:  # noqa: N802
        self._events += 1
        self.calls.append(("Event",))
        return NpuEvent(self, f"event{self._events}")

    def current_stream(self, device: Any = None) -> NpuStream:
        """A new wrapper on every call, as torch_npu's (``utils.py``): compare streams with ``==``."""
        index = self._index(device)
        return NpuStream(self, self._current[index], index)

    def set_stream(self, stream: NpuStream | None) -> None:
        if stream is not None:
            self._current[stream.device_index] = stream.stream_id

    @contextlib.contextmanager
    def stream(self, stream: NpuStream | None):
        if stream is None:
            yield
            return
        self.calls.append(("stream.enter", stream.label))
        previous = self.current_stream(stream.device_index)
        self.set_stream(stream)
        try:
            yield
        finally:
            self.set_stream(previous)
            self.calls.append(("stream.exit", stream.label))

    def synchronize(self, device: Any = None) -> None:
        self._log("synchronize", device)

    def is_current_stream_capturing(self) -> bool:
        """No argument, as ``torch_npu/npu/graphs.py``."""
        self.calls.append(("is_current_stream_capturing",))
        return self.capturing

    def memory_allocated(self, device: Any = None) -> int:
        self._log("memory_allocated", device)
        return self.allocated

    def max_memory_allocated(self, device: Any = None) -> int:
        self._log("max_memory_allocated", device)
        return self.peak

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._log("reset_peak_memory_stats", device)
        self.peak = self.allocated

    def get_rng_state(self, device: Any = "npu") -> torch.Tensor:
        return self.generators[self._log("get_rng_state", device)].get_state()

    def set_rng_state(self, new_state: torch.Tensor, device: Any = "npu") -> None:
        self.generators[self._log("set_rng_state", device)].set_state(new_state)


def install_device_module(monkeypatch: Any, available: bool = True, device_type: str = "cpu") -> NpuDeviceModule:
    """Make ``torch.npu`` a :class:`NpuDeviceModule` for one test (``monkeypatch`` undoes it). Where
    torch has not imported a real torch_npu, a stand-in ``torch_npu`` module (with a spec, so
    ``find_spec`` finds it) goes into ``sys.modules`` too; where it has, the real one stays."""
    module = NpuDeviceModule(available, device_type)
    if sys.modules.get("torch_npu") is None:
        package = types.ModuleType("torch_npu")
        package.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
        package.npu = module
        monkeypatch.setitem(sys.modules, "torch_npu", package)
    monkeypatch.setattr(torch, "npu", module, raising=False)
    return module


# ---------------------------------------------------------------------------------------------
# Autoload
# ---------------------------------------------------------------------------------------------

_INIT = '''\
"""Stand-in torch_npu (tests/npu_stand_in.py): {what}."""
import os

ORG_AUTOLOAD = os.getenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # as the real __init__, before it imports torch
import torch
{body}

def _autoload():
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = ORG_AUTOLOAD


_autoload()
'''

_WORKING = '''
import npu_stand_in

torch.utils.rename_privateuse1_backend("npu")
npu = npu_stand_in.NpuDeviceModule()
torch._register_device_module("npu", npu)
_library = npu_stand_in.register_ops()
'''

_BROKEN = '''
raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")
'''


def write_distribution(root: Path, broken: bool = False, entry_point: bool = True) -> Path:
    """Write a stand-in ``torch_npu`` distribution under ``root`` (put it and this directory on
    ``PYTHONPATH``): with ``entry_point``, a ``[torch.backends]`` entry point as torch_npu 2.14's,
    so ``import torch`` imports it; ``broken``, it fails to import like the wheel without CANN."""
    package = root / "torch_npu"
    package.mkdir(parents=True)
    what = "fails to import, like the wheel without Ascend CANN" if broken else "ops, device module, npu device type"
    (package / "__init__.py").write_text(_INIT.format(what=what, body=_BROKEN if broken else _WORKING))
    info = root / f"torch_npu-{SCHEMAS['torch_npu']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch_npu\nVersion: {SCHEMAS['torch_npu']}\n")
    if entry_point:
        (info / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")
    return root


def stand_in_environment(root: Path, **env: str) -> dict[str, str]:
    """``os.environ`` with ``root`` and this directory first on ``PYTHONPATH``."""
    path = os.pathsep.join(filter(None, [str(root), str(Path(__file__).parent), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, **env}


__all__ = ["FORMATS", "KERNEL_RUNS", "SCHEMAS", "NpuDeviceModule", "NpuEvent", "NpuStream", "install_device_module",
           "op_name", "register_ops", "stand_in_environment", "write_distribution"]
