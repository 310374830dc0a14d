"""Backends: the registry, ``backend="auto"``, and what each backend gives the core.

This machine has a CPU-only torch and no ``torch_npu`` (installing it without Ascend CANN breaks
``import torch``). So, stated plainly per test:

* the CPU backend and the registry are tested for real;
* the NPU backend's probe is tested against a stand-in ``torch.npu`` device module and a stand-in
  torch_npu distribution that torch autoloads (tests/npu_stand_in.py); the rest of the NPU path is
  in tests/test_npu.py, against the same stand-in;
* the CUDA backend is checked for what needs no GPU (probe messages, module surface, op handles);
  the tests that move data on a GPU are marked ``cuda`` and skipped without one. Likewise ``npu``.
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from npu_stand_in import install_device_module, stand_in_environment, write_distribution
from torch import nn

import hyperac
from hyperac.backends import NullEvent, NullStream, registry
from hyperac.backends.cpu import CpuBackend
from hyperac.backends.cuda import CudaBackend
from hyperac.backends.npu import AUTOLOAD_ENV, NpuBackend
from hyperac.policy import resolve_op_sets

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
# Registry fixture
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def clean_registry():
    """Restore ``hyperac.backends.registry._BACKENDS`` after a test that registers backends."""
    saved = dict(registry._BACKENDS)
    yield registry._BACKENDS
    registry._BACKENDS.clear()
    registry._BACKENDS.update(saved)


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
    """``torch.npu`` is a stand-in (tests/npu_stand_in.py) whose ``is_available()`` returns False, as
    on a machine with torch_npu but no visible NPU."""
    device_module = install_device_module(monkeypatch, available=False)
    message = _apply_fails("npu")
    assert "torch_npu is installed but no NPU device is visible" in message
    assert "ASCEND_RT_VISIBLE_DEVICES" in message
    assert device_module.names() == ["is_available"]
    assert hyperac.get_backend("auto").name != "npu"


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
    """``import hyperac`` imports nothing of torch_npu beyond what ``import torch`` did, and initialises
    no device. torch imports torch_npu itself (its ``torch.backends`` entry point): the real one where
    it is installed, else a stand-in distribution (tests/npu_stand_in.py). So torch_npu is loaded
    before hyperac on an Ascend machine and here alike, and the test checks what hyperac adds."""
    real = any(entry.name == "torch_npu" for entry in importlib.metadata.entry_points(group="torch.backends"))
    env = dict(os.environ) if real else stand_in_environment(write_distribution(tmp_path))
    script = textwrap.dedent("""
        import json, sys
        import torch
        npu = getattr(torch, "npu", None)
        def state():
            loaded = sorted(name for name in sys.modules if name.partition(".")[0] == "torch_npu")
            return [loaded, torch.cuda.is_initialized(), npu is not None and npu.is_initialized()]
        before = state()
        import hyperac
        after = state()
        auto = hyperac.get_backend("auto").name
        print(json.dumps([before, after, auto, torch.cuda.is_initialized()]))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env={**env, AUTOLOAD_ENV: "1"}, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    before, after, auto, cuda_initialized = json.loads(result.stdout)
    assert "torch_npu" in before[0], "torch did not autoload torch_npu"
    assert after == before and before[1:] == [False, False]
    assert not cuda_initialized
    if not real:  # the stand-in has a visible NPU; a real machine may not
        assert auto == "npu"


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
