"""Backends: the registry, ``backend="auto"``, and what each backend gives the core.

This machine has a CPU-only torch and no ``torch_npu`` (installing it without Ascend CANN breaks
``import torch``). So, stated plainly per test:

* the CPU backend and the registry are tested for real;
* the NPU backend is tested against a *stand-in* ``torch_npu`` module and a recording ``torch.npu``
  device module, and against stand-in ``npu::`` ops registered with ``torch.library`` that run on
  CPU tensors: this checks that hyperac calls the right device-module functions and resolves the
  right op handles, not that any Ascend kernel behaves;
* the CUDA backend is checked for what needs no GPU (probe messages, module surface, op handles);
  the tests that move data on a GPU are marked ``cuda`` and skipped without one. Likewise ``npu``.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.abc
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch
from torch import nn

import hyperac
from hyperac.backends import NullEvent, NullStream, registry
from hyperac.backends.cpu import CpuBackend
from hyperac.backends.cuda import CudaBackend
from hyperac.backends.npu import NpuBackend
from hyperac.errors import HyperACWarning
from hyperac.measure import PeakMeter
from hyperac.policy import resolve_op_sets
from hyperac.swap import SwapGroup, SwapManager

requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device (this torch build or machine has none)"
)


# ---------------------------------------------------------------------------------------------
# Tiny models
# ---------------------------------------------------------------------------------------------


class _MlpBlock(nn.Module):
    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(dim, 2 * dim)
        self.down = nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Stack(nn.Module):
    """Plain PyTorch: the layers are named with ``layers="blocks"``."""

    def __init__(self, make_block, num_layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([make_block() for _ in range(num_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.train()
    model.zero_grad(set_to_none=True)
    loss = model(x).square().mean()
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _assert_untouched(model: nn.Module, state_before: dict[str, torch.Tensor]) -> None:
    assert hyperac.applied_plan(model) is None
    for module in model.modules():
        assert "forward" not in module.__dict__, f"{type(module).__name__}.forward was overridden"
    state_after = model.state_dict()
    assert state_after.keys() == state_before.keys()
    for name, value in state_before.items():
        assert torch.equal(state_after[name], value)


# ---------------------------------------------------------------------------------------------
# Registry fixture and stand-ins
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def clean_registry():
    """Restore ``hyperac.backends.registry._BACKENDS`` after a test that registers backends."""
    saved = dict(registry._BACKENDS)
    yield registry._BACKENDS
    registry._BACKENDS.clear()
    registry._BACKENDS.update(saved)


class _FakeStream:
    def __init__(self, log: list, label: str) -> None:
        self.log, self.label = log, label

    def wait_event(self, event: _FakeEvent) -> None:
        self.log.append(("wait_event", self.label, event.label))

    def __repr__(self) -> str:
        return f"_FakeStream({self.label})"


class _FakeEvent:
    def __init__(self, log: list, label: str) -> None:
        self.log, self.label = log, label

    def record(self, stream: _FakeStream | None = None) -> None:
        self.log.append(("record", self.label, None if stream is None else stream.label))


class _FakeNpuDeviceModule(types.ModuleType):
    """Stand-in for ``torch_npu.npu`` (installed as ``torch.npu``): records every call."""

    def __init__(self, available: bool) -> None:
        super().__init__("torch_npu.npu")
        self.available = available
        self.calls: list[tuple] = []
        self.default_stream = _FakeStream(self.calls, "default")
        self._current = self.default_stream
        self._count = 0
        self.allocated, self.peak = 1 << 20, 3 << 20

    def is_available(self) -> bool:
        self.calls.append(("is_available",))
        return self.available

    def Stream(self, device=None) -> _FakeStream:  # noqa: N802  (torch.npu.Stream)
        self._count += 1
        self.calls.append(("Stream",) if device is None else ("Stream", str(device)))
        return _FakeStream(self.calls, f"side{self._count}")

    def Event(self) -> _FakeEvent:  # noqa: N802  (torch.npu.Event)
        self._count += 1
        self.calls.append(("Event",))
        return _FakeEvent(self.calls, f"event{self._count}")

    def current_stream(self, device=None) -> _FakeStream:
        self.calls.append(("current_stream",) if device is None else ("current_stream", str(device)))
        return self._current

    @contextlib.contextmanager
    def stream(self, stream: _FakeStream):
        self.calls.append(("stream.enter", stream.label))
        previous, self._current = self._current, stream
        try:
            yield
        finally:
            self._current = previous
            self.calls.append(("stream.exit", stream.label))

    def synchronize(self, device=None) -> None:
        self.calls.append(("synchronize",) if device is None else ("synchronize", str(device)))

    def memory_allocated(self, device=None) -> int:
        self.calls.append(("memory_allocated",) if device is None else ("memory_allocated", str(device)))
        return self.allocated

    def max_memory_allocated(self, device=None) -> int:
        self.calls.append(("max_memory_allocated",) if device is None else ("max_memory_allocated", str(device)))
        return self.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self.calls.append(("reset_peak_memory_stats",) if device is None else ("reset_peak_memory_stats", str(device)))
        self.peak = self.allocated

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]


def _install_stand_in_npu(monkeypatch, available: bool) -> _FakeNpuDeviceModule:
    """Put a stand-in ``torch_npu`` in ``sys.modules`` (with a spec, so ``find_spec`` finds it)
    and its recording device module at ``torch.npu``; ``monkeypatch`` undoes both."""
    if "torch_npu" in sys.modules:
        pytest.skip("the real torch_npu is imported here; the stand-in is for machines without it")
    device_module = _FakeNpuDeviceModule(available)
    torch_npu = types.ModuleType("torch_npu")
    torch_npu.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    torch_npu.npu = device_module
    monkeypatch.setitem(sys.modules, "torch_npu", torch_npu)
    monkeypatch.setattr(torch, "npu", device_module, raising=False)
    assert importlib.util.find_spec("torch_npu") is torch_npu.__spec__
    return device_module


@pytest.fixture
def stand_in_npu(monkeypatch) -> _FakeNpuDeviceModule:
    """A stand-in torch_npu with one visible NPU (torch_npu cannot be installed here)."""
    return _install_stand_in_npu(monkeypatch, available=True)


class _BrokenTorchNpuFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch_npu`` but fails to import it, like a torch-npu wheel without Ascend CANN."""

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "torch_npu" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")


# ---------------------------------------------------------------------------------------------
# Stand-in npu:: ops, registered once per process after hyperac is imported
# ---------------------------------------------------------------------------------------------

_ATTENTION_CALLS = [0]


def _define_stand_in_npu_ops() -> None:
    """``npu::npu_fusion_attention`` (simplified signature: q, k, v in BNSD, head_num,
    input_layout, scale -> attention_out, softmax_max, softmax_sum) with a CPU kernel that counts
    its runs and an autograd formula that, like the real grad kernel, recomputes the softmax from
    q and k; and ``npu::npu_mm_all_reduce_base`` (an MC2 matmul+collective; here a plain matmul)."""

    @torch.library.custom_op("npu::npu_fusion_attention", mutates_args=())
    def npu_fusion_attention(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, head_num: int, input_layout: str,
        scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _ATTENTION_CALLS[0] += 1
        scores = query @ key.transpose(-1, -2) * scale
        softmax_max = scores.amax(-1, keepdim=True)
        exp = (scores - softmax_max).exp()
        softmax_sum = exp.sum(-1, keepdim=True)
        return (exp / softmax_sum) @ value, softmax_max, softmax_sum

    @npu_fusion_attention.register_fake
    def _(query, key, value, head_num, input_layout, scale=1.0):
        stats = query.new_empty(query.shape[:-1] + (1,))
        return torch.empty_like(query), stats, stats.clone()

    def setup_context(ctx, inputs, output):
        query, key, value, _, _, scale = inputs
        ctx.scale = scale
        ctx.save_for_backward(query, key, value)

    def backward(ctx, grad_out, _grad_max, _grad_sum):
        query, key, value = ctx.saved_tensors
        probs = torch.softmax(query @ key.transpose(-1, -2) * ctx.scale, dim=-1)
        grad_probs = grad_out @ value.transpose(-1, -2)
        grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True))
        return (
            grad_scores @ key * ctx.scale,
            grad_scores.transpose(-1, -2) @ query * ctx.scale,
            probs.transpose(-1, -2) @ grad_out,
            None, None, None,
        )

    npu_fusion_attention.register_autograd(backward, setup_context=setup_context)

    @torch.library.custom_op("npu::npu_mm_all_reduce_base", mutates_args=())
    def npu_mm_all_reduce_base(x1: torch.Tensor, x2: torch.Tensor, hcom: str) -> torch.Tensor:
        return x1 @ x2

    @torch.library.custom_op("npu::get_npu_format", mutates_args=())
    def get_npu_format(tensor: torch.Tensor) -> int:
        return _NPU_FORMATS.get(tensor.untyped_storage().data_ptr(), 2)  # ND unless a test set another


_NPU_FORMATS: dict[int, int] = {}
"""The stand-in ``npu::get_npu_format``'s answer by storage address (``torch_npu.Format`` codes)."""


@pytest.fixture(scope="module")
def npu_ops():
    """The stand-in ``npu::`` ops; returns the NPU backend's attention ops seen just before."""
    if hasattr(torch.ops.npu, "npu_fusion_attention"):
        pytest.skip("npu::npu_fusion_attention is already registered (real torch_npu); no stand-in needed")
    before = NpuBackend().attention_ops() | NpuBackend().communication_ops()
    _define_stand_in_npu_ops()
    return before


class _AttentionBlock(nn.Module):
    """Pre-norm attention block calling ``torch.ops.npu.npu_fusion_attention`` on CPU tensors."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        head_dim = dim // self.heads
        q, k, v = self.qkv(self.norm(x)).view(batch, seq, 3, self.heads, head_dim).permute(2, 0, 3, 1, 4)
        attn = torch.ops.npu.npu_fusion_attention(q, k, v, self.heads, "BNSD", head_dim**-0.5)[0]
        return x + self.out(attn.transpose(1, 2).reshape(batch, seq, dim))


def test_npu_device_of_the_tensor_reaches_the_device_module(stand_in_npu):
    """torch_npu is a stand-in (it cannot be installed here): streams, waits, synchronize and the
    statistics a PeakMeter reads are asked for the tensors' device, not the current one."""
    backend = hyperac.get_backend("npu")
    stand_in_npu.calls.clear()
    other = torch.device("cpu", 1)  # "npu" is not a device type without torch_npu
    backend.new_stream(other)
    backend.current_stream(other)
    parameter = torch.zeros(1)  # a stand-in NPU tensor lives on the CPU
    with PeakMeter([parameter], backend=backend):
        pass
    assert stand_in_npu.calls == [
        ("Stream", "cpu:1"), ("current_stream", "cpu:1"),
        ("synchronize", "cpu"), ("reset_peak_memory_stats", "cpu"), ("memory_allocated", "cpu"),
        ("synchronize", "cpu"), ("max_memory_allocated", "cpu"),
    ]


class _NpuOnCpu(NpuBackend):
    """The NPU backend whose device tensors are the stand-in's CPU tensors (no NPU here)."""

    @property
    def device_type(self) -> str:
        return "cpu"


def test_npu_internal_format_stays_on_device_and_is_named(npu_ops):
    """The stand-in ``npu::get_npu_format`` (a ``torch.library`` op; torch_npu cannot be installed
    here) reports FRACTAL_NZ for one tensor: swap keeps it on the device, says why once, and
    swaps the plain one."""
    manager = SwapManager(_NpuOnCpu(), min_swap_bytes=0, host_budget_bytes=1 << 20)
    nz, plain, odd = torch.randn(16, 16), torch.randn(16, 16), torch.randn(4)
    _NPU_FORMATS[nz.untyped_storage().data_ptr()] = 29
    _NPU_FORMATS[odd.untyped_storage().data_ptr()] = 41
    try:
        with pytest.warns(HyperACWarning, match=r"\[16, 16\] tensor .* npu internal format FRACTAL_NZ.*stays on the "
                          r"device.*npu_format_cast\(t, 2\)"):
            assert manager.ineligible(nz) == "format"
        assert manager.ineligible(plain) is None
        with pytest.warns(HyperACWarning, match="internal format code 41"):
            assert manager.ineligible(odd) == "format"
        assert _NpuOnCpu().internal_format(odd) == "code 41"
        group = SwapGroup(manager, None, offload=True)
        assert group.pack(nz).entry is None and group.pack(plain).entry is not None
        assert manager.stats.skipped == {"format": 1}
    finally:
        _NPU_FORMATS.clear()


# ---------------------------------------------------------------------------------------------
# Registry and backend="auto"
# ---------------------------------------------------------------------------------------------


def test_get_backend_cpu_and_instances_pass_through():
    backend = hyperac.get_backend("cpu")
    assert isinstance(backend, CpuBackend) and backend.name == "cpu"
    assert hyperac.get_backend(backend) is backend
    assert backend.device() == torch.device("cpu")


def test_unknown_backend_is_config_error_listing_names():
    with pytest.raises(hyperac.ConfigError) as info:
        hyperac.get_backend("tpu")
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    for name in ("'tpu'", "'auto'", "'cpu'", "'cuda'", "'npu'", "register_backend"):
        assert name in message
    with pytest.raises(hyperac.ConfigError, match="tpu"):
        hyperac.apply(_Stack(_MlpBlock), layers="blocks", backend="tpu")


def test_third_party_backend_is_one_class_and_one_decorator(clean_registry):
    seen = []

    @hyperac.register_backend
    class MyBackend(hyperac.Backend):
        name = "mybackend"

        def attention_ops(self):
            seen.append("attention_ops")
            return super().attention_ops()

    assert clean_registry["mybackend"] is MyBackend
    assert isinstance(hyperac.get_backend("mybackend"), MyBackend)
    assert "mybackend" in hyperac.available_backends()

    model = _Stack(_MlpBlock)
    x = torch.randn(4, 8)
    reference = _step(copy.deepcopy(model), x)
    plan = hyperac.apply(model, layers="blocks", mode="selective", backend="mybackend")
    assert plan.backend == "mybackend"
    assert seen == ["attention_ops"], "the selective policy is built from the chosen backend's op handles"
    loss, grads = _step(model, x)
    torch.testing.assert_close(loss, reference[0], rtol=0, atol=0)
    for name, grad in reference[1].items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0)
    hyperac.remove(model)


def test_registering_taken_name_errors_but_same_class_is_idempotent(clean_registry):
    class Another(hyperac.Backend):
        name = "cpu"

    with pytest.raises(hyperac.ConfigError, match=r"'cpu' is already registered by CpuBackend"):
        hyperac.register_backend(Another)
    assert clean_registry["cpu"] is CpuBackend
    assert hyperac.register_backend(CpuBackend) is CpuBackend

    class Nameless(hyperac.Backend):
        pass

    with pytest.raises(hyperac.ConfigError, match="non-empty string `name`"):
        hyperac.register_backend(Nameless)
    assert set(clean_registry) == {"cpu", "cuda", "npu", "sim"}


def _probe(monkeypatch, probed: list[str], **reasons: str | None) -> None:
    """Make each named backend class report ``reasons[name]`` and log that it was probed."""
    for cls in (NpuBackend, CudaBackend, CpuBackend):
        reason = reasons.get(cls.name)

        def unavailable_reason(cls, reason=reason):
            probed.append(cls.name)
            return reason

        monkeypatch.setattr(cls, "unavailable_reason", classmethod(unavailable_reason))


@pytest.mark.parametrize(
    ("reasons", "chosen", "probed"),
    [
        ({}, NpuBackend, ["npu"]),
        ({"npu": "no NPU"}, CudaBackend, ["npu", "cuda"]),
        ({"npu": "no NPU", "cuda": "no GPU"}, CpuBackend, ["npu", "cuda", "cpu"]),
    ],
)
def test_auto_probes_npu_then_cuda_then_cpu(monkeypatch, reasons, chosen, probed):
    """NPU comes first because torch_npu's transfer_to_npu can make torch.cuda report a device."""
    log: list[str] = []
    _probe(monkeypatch, log, **reasons)
    assert type(hyperac.get_backend("auto")) is chosen
    assert log == probed


def test_auto_respects_third_party_priority_and_never_picks_none(monkeypatch, clean_registry):
    log: list[str] = []
    _probe(monkeypatch, log, npu="no NPU", cuda="no GPU")

    @hyperac.register_backend
    class Manual(hyperac.Backend):
        name = "manual"  # auto_priority None: only by name

    assert type(hyperac.get_backend("auto")) is CpuBackend

    @hyperac.register_backend
    class Preferred(hyperac.Backend):
        name = "preferred"
        auto_priority = 10

    assert type(hyperac.get_backend("auto")) is Preferred
    assert hyperac.available_backends() == ["preferred", "cpu", "sim", "manual"]


def test_auto_with_nothing_available_raises(monkeypatch):
    _probe(monkeypatch, [], npu="no NPU", cuda="no GPU", cpu="no CPU")
    with pytest.raises(hyperac.BackendUnavailableError, match="not even 'cpu'"):
        hyperac.get_backend("auto")
    assert hyperac.available_backends() == ["sim"]  # the simulator needs nothing, but auto never picks it


def test_auto_on_this_machine():
    """What ``auto`` and ``available_backends()`` really find here (no mocks)."""
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("torch_npu is installed here; this test describes machines without it")
    expected = ["cuda", "cpu"] if torch.cuda.is_available() else ["cpu"]
    assert hyperac.available_backends() == [*expected, "sim"]
    assert hyperac.get_backend("auto").name == expected[0]
    plan = hyperac.apply(_Stack(_MlpBlock), layers="blocks")
    assert plan.backend == expected[0]


def test_available_backends_best_first(monkeypatch):
    _probe(monkeypatch, [])
    assert hyperac.available_backends() == ["npu", "cuda", "cpu", "sim"]


# ---------------------------------------------------------------------------------------------
# Explicitly requested backends that cannot run here
# ---------------------------------------------------------------------------------------------


def _apply_fails(backend: str) -> str:
    model = _Stack(_MlpBlock)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(hyperac.BackendUnavailableError) as info:
        hyperac.apply(model, layers="blocks", mode="selective", backend=backend)
    assert isinstance(info.value, RuntimeError)
    _assert_untouched(model, before)
    return str(info.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is visible here")
def test_cuda_requested_without_cuda_says_why():
    message = _apply_fails("cuda")
    assert message.startswith("backend 'cuda' was requested but ")
    if not torch.backends.cuda.is_built():
        assert "this torch build has no CUDA support (a CPU-only wheel)" in message
    else:
        assert "no CUDA device is visible" in message
    assert "backend='cpu'" in message


def test_cuda_reason_when_built_but_no_device(monkeypatch):
    """The second branch of the probe, reached by pretending the build has CUDA."""
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device is visible (check CUDA_VISIBLE_DEVICES)" in CudaBackend.unavailable_reason()


def test_npu_requested_without_torch_npu_says_not_installed(monkeypatch):
    """``sys.modules["torch_npu"] = None`` is Python's own "not importable" mark, so this holds
    on every machine; here torch_npu really is absent (it cannot be installed without CANN)."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)
    message = _apply_fails("npu")
    assert "the torch_npu package is not installed" in message
    assert "npu" not in hyperac.available_backends()


def test_npu_requested_with_torch_npu_but_no_device_says_no_device(monkeypatch):
    """torch_npu is a stand-in (it cannot be installed here) whose ``torch.npu.is_available()``
    returns False, as on a machine with the package but no visible NPU."""
    device_module = _install_stand_in_npu(monkeypatch, available=False)
    message = _apply_fails("npu")
    assert "torch_npu is installed but no NPU device is visible" in message
    assert "ASCEND_RT_VISIBLE_DEVICES" in message
    assert device_module.names() == ["is_available"]
    assert hyperac.get_backend("auto").name != "npu"


def test_npu_import_failure_is_a_reason_not_a_crash(monkeypatch):
    """A torch-npu wheel without Ascend CANN fails to import (missing libhccl.so): ``auto`` must
    fall back, and ``backend="npu"`` must say why. The wheel is simulated by an import finder."""
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenTorchNpuFinder(), *sys.meta_path])
    reason = NpuBackend.unavailable_reason()
    assert "torch_npu package is installed but failed to import" in reason and "libhccl.so" in reason
    assert hyperac.get_backend("auto").name != "npu"
    assert "libhccl.so" in _apply_fails("npu")


# ---------------------------------------------------------------------------------------------
# NPU backend against a stand-in torch_npu
# ---------------------------------------------------------------------------------------------


def test_npu_probe_and_auto_with_stand_in(stand_in_npu):
    """torch_npu is a stand-in (it cannot be installed here): with a visible NPU the real probe
    succeeds and ``auto`` picks NPU over CUDA and CPU."""
    assert NpuBackend.unavailable_reason() is None
    assert type(hyperac.get_backend("npu")) is NpuBackend
    assert type(hyperac.get_backend("auto")) is NpuBackend
    assert hyperac.available_backends()[0] == "npu"
    assert NpuBackend()._module() is stand_in_npu


def test_npu_streams_and_events_go_to_device_module(stand_in_npu):
    """torch_npu is a stand-in (it cannot be installed here): streams, events, waits and
    synchronize are the device module's own, called through ``torch.npu``."""
    backend = hyperac.get_backend("npu")
    stand_in_npu.calls.clear()

    side = backend.new_stream()
    assert isinstance(side, _FakeStream) and side.label == "side1"
    event = backend.new_event()
    assert isinstance(event, _FakeEvent) and event.label == "event2"
    assert backend.current_stream() is stand_in_npu.default_stream

    with backend.use_stream(side):
        assert backend.current_stream() is side
        event.record()
        backend.wait(event)  # the side stream is current: it waits
    assert backend.current_stream() is stand_in_npu.default_stream
    backend.wait(event)  # back on the default stream: it waits
    backend.synchronize()

    # current_stream() is asked whenever a wait needs the stream that is current at that point
    assert [c for c in stand_in_npu.calls if c != ("current_stream",)] == [
        ("Stream",),
        ("Event",),
        ("stream.enter", "side1"),
        ("record", "event2", None),
        ("wait_event", "side1", "event2"),
        ("stream.exit", "side1"),
        ("wait_event", "default", "event2"),
        ("synchronize",),
    ]


def test_npu_memory_stats_and_host_buffers(stand_in_npu):
    """torch_npu is a stand-in (it cannot be installed here): memory statistics come from
    ``torch.npu``; host buffers are asked pinned (torch_npu's host allocator serves them)."""
    backend = hyperac.get_backend("npu")
    stand_in_npu.calls.clear()
    assert backend.memory_allocated() == 1 << 20
    assert backend.max_memory_allocated() == 3 << 20
    backend.reset_peak_memory_stats()
    assert backend.max_memory_allocated() == 1 << 20
    assert stand_in_npu.names() == [
        "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "max_memory_allocated",
    ]
    assert backend.supports_pinned_memory()
    like = torch.zeros(3, 5, dtype=torch.bfloat16)
    host = backend.host_empty(like, pinned=False)
    assert host.shape == like.shape and host.dtype == like.dtype and host.device.type == "cpu"


def test_npu_op_handles_resolve_lazily(npu_ops):
    """The ``npu::`` ops are stand-ins registered with torch.library after hyperac was imported
    (torch_npu cannot be installed here); the backend resolves them when asked."""
    attention = torch.ops.npu.npu_fusion_attention.default
    mc2 = torch.ops.npu.npu_mm_all_reduce_base.default
    assert attention not in npu_ops and mc2 not in npu_ops
    backend = NpuBackend()
    assert attention in backend.attention_ops()
    assert mc2 in backend.communication_ops()
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in backend.attention_ops()

    ops = resolve_op_sets(backend)
    assert attention in ops.keep and mc2 in ops.keep
    assert attention not in ops.matmul and attention not in ops.recompute
    cpu_ops = resolve_op_sets(CpuBackend())
    assert attention not in cpu_ops.keep and mc2 not in cpu_ops.keep


@pytest.mark.parametrize(
    ("backend", "mode", "runs_per_layer"),
    [("npu", "selective", 1), ("npu", "full", 2), ("cpu", "selective", 2), ("npu", "off", 1)],
)
def test_selective_saves_npu_attention_output(stand_in_npu, npu_ops, backend, mode, runs_per_layer):
    """torch_npu and ``npu::npu_fusion_attention`` are stand-ins (torch_npu cannot be installed
    here; the op runs a counting CPU kernel). With ``backend="npu"`` the selective policy keeps
    the attention output, so backward does not run the kernel again; full recompute runs it
    twice, and so does selective on a backend that does not know the op. Gradients are equal."""
    model = _Stack(_AttentionBlock, num_layers=2)
    x = torch.randn(2, 6, 16)
    reference = _step(copy.deepcopy(model), x)
    plan = hyperac.apply(model, layers="blocks", mode=mode, backend=backend)
    assert plan.backend == backend
    for _ in range(2):
        _ATTENTION_CALLS[0] = 0
        loss, grads = _step(model, x)
        assert _ATTENTION_CALLS[0] == runs_per_layer * len(model.blocks)
        torch.testing.assert_close(loss, reference[0], rtol=0, atol=0)
        for name, grad in reference[1].items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0)
    hyperac.remove(model)


# ---------------------------------------------------------------------------------------------
# CUDA backend without a GPU
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="this torch build has CUDA")
def test_cuda_reason_on_cpu_build():
    reason = CudaBackend.unavailable_reason()
    assert reason.startswith("this torch build has no CUDA support (a CPU-only wheel)")
    assert not CudaBackend.is_available()


def test_cuda_backend_surface_and_op_handles():
    backend = CudaBackend()  # constructing touches no device; only get_backend probes
    assert backend._module() is torch.cuda
    assert backend.device(1) == torch.device("cuda", 1)
    assert backend.supports_pinned_memory()
    ops = backend.attention_ops()
    for overload in (
        torch.ops.aten._scaled_dot_product_flash_attention.default,
        torch.ops.aten._scaled_dot_product_efficient_attention.default,
        torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    ):
        assert overload in ops and overload in resolve_op_sets(backend).keep
    assert NpuBackend.auto_priority > CudaBackend.auto_priority > CpuBackend.auto_priority


# ---------------------------------------------------------------------------------------------
# CPU backend
# ---------------------------------------------------------------------------------------------


def test_cpu_streams_and_events_are_null_objects():
    backend = CpuBackend()
    stream, current, event = backend.new_stream(), backend.current_stream(), backend.new_event()
    assert isinstance(stream, NullStream) and isinstance(current, NullStream)
    assert isinstance(event, NullEvent)
    with backend.use_stream(stream):
        event.record(stream)
        event.record()
        stream.wait_event(event)
        stream.wait_stream(current)
        backend.wait(event)
    assert event.query() is True
    event.wait()
    event.synchronize()
    stream.synchronize()
    backend.synchronize()


@pytest.mark.parametrize("pinned", [True, False])
def test_cpu_host_empty_never_pins(pinned):
    backend = CpuBackend()
    assert not backend.supports_pinned_memory()
    like = torch.zeros(2, 3, 4, dtype=torch.float16)
    host = backend.host_empty(like, pinned=pinned)
    assert host.shape == (2, 3, 4) and host.dtype == torch.float16 and host.device == torch.device("cpu")
    assert not host.is_pinned()
    assert host.untyped_storage().data_ptr() != like.untyped_storage().data_ptr()


def test_cpu_memory_stats_are_zero():
    backend = CpuBackend()
    backend.reset_peak_memory_stats()
    assert backend.memory_allocated() == 0 and backend.max_memory_allocated() == 0


# ---------------------------------------------------------------------------------------------
# Import hygiene
# ---------------------------------------------------------------------------------------------


def test_import_touches_no_vendor_package_or_device(tmp_path):
    """A ``torch_npu`` on the path that fails to import (like the wheel without CANN) is neither
    imported by ``import hyperac`` nor fatal to ``backend="auto"``; CUDA is not initialised."""
    broken = 'raise ImportError("libhccl.so: cannot open shared object file")\n'
    (tmp_path / "torch_npu.py").write_text(broken)
    script = textwrap.dedent("""
        import sys
        import hyperac, torch
        print("torch_npu" in sys.modules, torch.cuda.is_initialized())
        print(hyperac.get_backend("auto").name, torch.cuda.is_initialized())
    """)
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    first, second = result.stdout.split("\n")[:2]
    assert first == "False False"
    assert second.split()[0] in ("cuda", "cpu")


# ---------------------------------------------------------------------------------------------
# On hardware (skipped here)
# ---------------------------------------------------------------------------------------------


def _device_round_trip(backend: hyperac.Backend) -> None:
    """Device -> pinned host on a side stream -> device, ordered by an event wait only."""
    device = backend.device()
    source = torch.randn(1 << 20, device=device)
    host = backend.host_empty(source, pinned=True)
    assert host.is_pinned() and host.device.type == "cpu"
    side, done = backend.new_stream(), backend.new_event()
    side.wait_stream(backend.current_stream())
    with backend.use_stream(side):
        host.copy_(source, non_blocking=True)
        done.record()
    backend.wait(done)
    back = torch.empty_like(source)
    back.copy_(host, non_blocking=True)
    backend.synchronize()
    assert torch.equal(back, source)

    backend.reset_peak_memory_stats()
    before = backend.memory_allocated()
    extra = torch.empty(1 << 22, device=device)
    assert backend.memory_allocated() >= before + extra.nbytes
    assert backend.max_memory_allocated() >= backend.memory_allocated()


def _parity_on(backend_name: str, device: str) -> None:
    x = torch.randn(4, 8, device=device)
    model = _Stack(_MlpBlock, num_layers=3).to(device)
    reference = _step(copy.deepcopy(model), x)
    for mode in ("full", "selective"):
        applied = copy.deepcopy(model)
        plan = hyperac.apply(applied, layers="blocks", mode=mode, backend=backend_name)
        assert plan.backend == backend_name
        loss, grads = _step(applied, x)
        torch.testing.assert_close(loss, reference[0])
        for name, grad in reference[1].items():
            torch.testing.assert_close(grads[name], grad)


@pytest.mark.cuda
@requires_cuda
def test_cuda_stream_event_pinned_round_trip():
    _device_round_trip(hyperac.get_backend("cuda"))


@pytest.mark.cuda
@requires_cuda
def test_cuda_apply_parity():
    _parity_on("cuda", "cuda")


@pytest.mark.npu
def test_npu_round_trip_and_parity_on_hardware():
    """Needs a real Ascend NPU with torch_npu; probed in the test, so collection imports nothing."""
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
        pytest.skip("needs torch_npu and an Ascend NPU (torch_npu is not installed here)")
    reason = NpuBackend.unavailable_reason()
    if reason is not None:
        pytest.skip(f"needs an Ascend NPU: {reason}")
    backend = hyperac.get_backend("npu")
    assert torch.ops.npu.npu_fusion_attention.default in backend.attention_ops()
    _device_round_trip(backend)
    _parity_on("npu", "npu")
