"""The NPU backend against a stand-in torch_npu 2.14 (``tests/npu_stand_in.py``).

This machine has no Ascend NPU and cannot install torch_npu, so these tests run hyperac's NPU path
against a stand-in: the real wheel's ``npu::`` schemas and tags (``tests/npu_schemas.json``) with
CPU kernels, a device module that behaves like ``torch.npu`` (rejecting devices of another type),
and torch's autoload of a torch_npu distribution. They show which device-module functions hyperac
calls and with which devices, which ops it keeps and which it replays, and what it says when
torch_npu is broken. They cannot show that an Ascend kernel, stream, event, pinned buffer or HCCL
collective behaves as its stand-in does: that needs the hardware (``test_backends.py``'s tests
marked ``npu``, ``tox -e npu``).

On a machine where torch has imported the real torch_npu, the stand-in device module replaces
``torch.npu`` for a test, the CPU kernels are added to the real ops, and the autoload tests use
the real distribution, so these tests run there too.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import npu_stand_in
import pytest
import torch
from hyperac_testing import Stack, applied_copy, assert_parity, train_step
from npu_stand_in import FORMATS, KERNEL_RUNS, SCHEMAS, install_device_module, op_name
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hyperac
from hyperac.backends.cpu import CpuBackend
from hyperac.backends.npu import AUTOLOAD_ENV, NpuBackend
from hyperac.errors import ConfigError, HyperACWarning
from hyperac.measure import PeakMeter
from hyperac.policy import resolve_op_sets
from hyperac.swap import SwapGroup, SwapManager

# the issue's names, spelled out so that a change to the wheel or the list cannot drop one unnoticed
_NAMED_COLLECTIVES = (
    "npu_moe_distribute_dispatch", "npu_moe_distribute_combine", "npu_moe_distribute_dispatch_v2",
    "npu_moe_distribute_combine_v2", "npu_all_to_all_matmul", "npu_matmul_all_to_all", "npu_alltoallv_gmm",
    "npu_gmm_alltoallv", "npu_quant_mm_reduce_scatter", "npu_all_gather_quant_mm", "npu_mm_all_reduce_base",
    "npu_all_gather_base_mm", "npu_mm_reduce_scatter_base",
)
_GROUP_ARGUMENT = re.compile(r"^(hcom|group|group_\w+)$")
"""The names torch_npu gives an HCCL communicator or group argument (``str hcom``, ``str group_ep``)."""


def _real_torch_npu() -> bool:
    module = sys.modules.get("torch_npu")
    return module is not None and getattr(module, "__file__", None) is not None


@pytest.fixture
def stand_in_npu(monkeypatch) -> npu_stand_in.NpuDeviceModule:
    """``torch.npu`` is the stand-in, whose devices are this CPU (the stand-in NPU tensors live here)."""
    return install_device_module(monkeypatch)


@pytest.fixture(scope="module")
def npu_ops():
    """The real wheel's ``npu::`` schemas, with CPU kernels for the ops these tests run; yields the NPU
    backend's op handles resolved before they were registered."""
    before = NpuBackend().attention_ops() | NpuBackend().communication_ops()
    library = npu_stand_in.register_ops()
    yield before
    library._destroy()


class _NpuOnCpu(NpuBackend):
    """The NPU backend whose device tensors are the stand-in's CPU tensors. This host has no pinned
    allocator (torch_npu serves ``pin_memory=True`` on an Ascend machine), so its buffers are plain."""

    @property
    def device_type(self) -> str:
        return "cpu"

    def supports_pinned_memory(self) -> bool:
        return False


def _group_arguments(op) -> list[str]:
    return [a.name for a in op._schema.arguments if str(a.type) in ("str", "str?") and _GROUP_ARGUMENT.match(a.name)]


def _wheel_ops() -> list:
    """Every overload the schema file names, resolved (the ``npu_ops`` fixture registered them)."""
    ops = []
    for entry in SCHEMAS["ops"]:
        base, _, overload = op_name(entry["schema"]).partition(".")
        ops.append(getattr(getattr(torch.ops.npu, base), overload or "default"))
    return ops


# ---------------------------------------------------------------------------------------------
# Op schemas and the backend's op lists
# ---------------------------------------------------------------------------------------------


def test_schema_script_repeats_torch_npus_registration():
    """``scripts/npu_schemas.py`` rewrites the YAML schemas as torch_npu's code generator does before
    ``m.def``: ``self`` becomes ``input``, several ``out`` tensors one ``Tensor[] out``. (It also checks
    each result against the strings of the wheel's ``libtorch_npu.so``, which needs the wheel.)"""
    path = Path(__file__).parent.parent / "scripts" / "npu_schemas.py"
    spec = importlib.util.spec_from_file_location("npu_schemas", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.registered_schema("get_npu_format(Tensor self) -> int", 0) == "get_npu_format(Tensor input) -> int"
    out = "f.out(Tensor self, int n, *, Tensor(a!) x, Tensor(b!) y) -> (Tensor(a!), Tensor(b!))"
    assert script.out_count(out) == 2
    assert script.registered_schema(out, 2) == "f.out(Tensor input, int n, *, Tensor[] out) -> (Tensor, Tensor)"
    single = "g.out(Tensor self, *, Tensor(a!) out) -> Tensor(a!)"
    assert script.out_count(single) == 1
    assert script.registered_schema(single, 1) == "g.out(Tensor input, *, Tensor(a!) out) -> Tensor(a!)"
    names = [op_name(entry["schema"]) for entry in SCHEMAS["ops"]]
    assert names == sorted(set(names))


def test_stand_in_ops_carry_the_wheels_schemas_and_tags(npu_ops):
    """Every op of the schema file is registered with exactly the wheel's schema and tags: the
    stand-ins are called, dispatched and classified as torch_npu's ops are."""
    if _real_torch_npu() and sys.modules["torch_npu"].__version__.split("+")[0] != SCHEMAS["torch_npu"]:
        pytest.skip(f"torch_npu {sys.modules['torch_npu'].__version__} is loaded; the file is {SCHEMAS['torch_npu']}")
    assert len(SCHEMAS["ops"]) > 400
    for entry, op in zip(SCHEMAS["ops"], _wheel_ops(), strict=True):
        assert op._schema == torch._C.parse_schema(f"npu::{entry['schema']}"), entry["schema"]
        assert sorted(tag.name for tag in op.tags if tag.name != "pt2_compliant_tag") == entry["tags"]
    attention = torch.ops.npu.npu_fusion_attention.default
    assert [a.name for a in attention._schema.arguments][5] == "pse"
    assert [str(r.type) for r in attention._schema.returns] == ["Tensor"] * 4 + ["int"] * 3
    assert torch.Tag.nondeterministic_seeded in attention.tags
    assert torch.Tag.nondeterministic_seeded in torch.ops.npu.npu_fusion_attention_v2.default.tags
    v3 = torch.ops.npu.npu_fusion_attention_v3.default
    assert torch.Tag.nondeterministic_seeded not in v3.tags and "keep_prob" in [a.name for a in v3._schema.arguments]
    assert [str(r.type) for r in v3._schema.returns] == ["Tensor"] * 6


def test_npu_communication_ops_are_every_op_taking_an_hcom_or_group(npu_ops):
    """An op of the wheel whose schema takes a ``str hcom`` or group name is a collective: every
    one is in the NPU backend's communication set, and every ``npu::`` name the backend lists is
    one of them (no stale name)."""
    communication = NpuBackend().communication_ops()
    collectives = {op for op in _wheel_ops() if _group_arguments(op)}
    assert len(collectives) >= 21
    missing = sorted(str(op) for op in collectives - communication)
    assert not missing, f"collectives of torch_npu {SCHEMAS['torch_npu']} the NPU backend would replay: {missing}"
    listed = {op for op in communication if op.namespace == "npu"}
    assert listed == collectives
    for name in _NAMED_COLLECTIVES:
        assert getattr(torch.ops.npu, name).default in communication, name
    assert not communication & NpuBackend().attention_ops()


def test_npu_op_handles_resolve_lazily(npu_ops):
    """The ``npu::`` ops are registered after hyperac was imported; the backend resolves them when asked."""
    attention = torch.ops.npu.npu_fusion_attention.default
    v2, v3 = torch.ops.npu.npu_fusion_attention_v2.default, torch.ops.npu.npu_fusion_attention_v3.default
    mc2 = torch.ops.npu.npu_mm_all_reduce_base.default
    if not _real_torch_npu():
        assert attention not in npu_ops and mc2 not in npu_ops
    backend = NpuBackend()
    assert {attention, v2, v3, torch.ops.aten.scaled_dot_product_attention.default} <= backend.attention_ops()
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in backend.attention_ops()
    ops = resolve_op_sets(backend)
    assert {attention, v2, v3, mc2} <= ops.keep and mc2 in ops.communication
    assert not {attention, v2, v3} & (ops.matmul | ops.routing)
    cpu_ops = resolve_op_sets(CpuBackend())
    # The composite SDPA is attention on every backend (one that decomposes it never shows it to the policy).
    assert attention not in cpu_ops.keep and torch.ops.aten.scaled_dot_product_attention.default in cpu_ops.attention


# ---------------------------------------------------------------------------------------------
# Kept and replayed ops, counted by kernel runs
# ---------------------------------------------------------------------------------------------


class _AttentionBlock(nn.Module):
    """Pre-norm attention through one of torch_npu's fused attention ops, in BSH layout (BSND for v2)."""

    def __init__(self, variant: str = "npu_fusion_attention", keep_prob: float = 1.0, dropout: float = 0.0,
                 dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.variant, self.keep_prob, self.heads = variant, keep_prob, heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        scale = (x.shape[-1] // self.heads) ** -0.5
        op = getattr(torch.ops.npu, self.variant)
        if self.variant == "npu_fusion_attention_v2":
            q, k, v = (t.unflatten(-1, (self.heads, -1)) for t in (q, k, v))
            attn = op(q, k, v, self.heads, "BSND", scale=scale, keep_prob=self.keep_prob)[0].flatten(-2)
        else:  # pse, padding_mask, atten_mask positional, then scale and keep_prob
            attn = op(q, k, v, self.heads, "BSH", None, None, None, scale, self.keep_prob)[0]
        return x + self.dropout(self.out(attn))


_VARIANTS = ("npu_fusion_attention", "npu_fusion_attention_v2", "npu_fusion_attention_v3")


def _kernel_runs(model: nn.Module, x: torch.Tensor, mode: str, backend: str = "npu", steps: int = 1) -> list[dict]:
    """The stand-in kernels' runs in each of ``steps`` training steps of ``model`` applied with ``mode``;
    every step's loss and gradients are bitwise those of the un-applied model."""
    loss = lambda m: m(x).square().mean()  # noqa: E731
    reference = train_step(model, loss)
    applied, plan = applied_copy(model, layers="blocks", mode=mode, backend=backend)
    assert plan.backend == backend
    runs = []
    for _ in range(steps):
        KERNEL_RUNS.clear()
        assert_parity(reference, train_step(applied, loss))
        runs.append(dict(KERNEL_RUNS))
    return runs


@pytest.mark.parametrize("variant", _VARIANTS)
@pytest.mark.parametrize(
    ("backend", "mode", "runs_per_layer"),
    [("npu", "selective", 1), ("npu", "pointwise", 1), ("npu", "full", 2), ("cpu", "selective", 2), ("npu", "off", 1)],
)
def test_selective_keeps_npu_fused_attention(stand_in_npu, npu_ops, variant, backend, mode, runs_per_layer):
    """With ``backend="npu"`` the selective modes keep the fused attention's output, so backward does
    not run its kernel again; full recompute runs it twice, and so does selective on a backend that
    does not know the op. Gradients are bitwise those of the un-applied model."""
    model = Stack(functools.partial(_AttentionBlock, variant))
    runs = _kernel_runs(model, torch.randn(2, 6, 16), mode, backend, steps=2)
    assert runs == [{variant: runs_per_layer * len(model.blocks)}] * 2


@pytest.mark.parametrize("variant", ["npu_fusion_attention", "npu_fusion_attention_v2", "npu_fusion_attention_v3"])
@pytest.mark.parametrize("mode", ["selective", "pointwise"])
def test_kept_npu_attention_with_dropout_and_a_dropout_after_it(stand_in_npu, npu_ops, variant, mode):
    """The fused attentions draw their dropout seed from the generator (v1 and v2 say so with the
    ``nondeterministic_seeded`` tag, v3 does not); kept, the replay must leave the generator where
    the forward left it, so the dropout after them draws the forward's mask again: bitwise
    gradients, one kernel run per layer."""
    model = Stack(functools.partial(_AttentionBlock, variant, keep_prob=0.8, dropout=0.3))
    assert _kernel_runs(model, torch.randn(2, 6, 16), mode) == [{variant: len(model.blocks)}]


class _MoeBlock(nn.Module):
    """An expert-parallel MoE layer and a tensor-parallel projection, through torch_npu's fused
    collectives (one rank: the all-to-all and all-reduce move nothing, their kernels still run)."""

    def __init__(self, dim: int = 16, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.experts, self.top_k = experts, top_k
        self.router = nn.Linear(dim, experts)
        self.expert = nn.Linear(dim, dim)
        self.proj = nn.Parameter(torch.randn(dim, dim) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.flatten(0, 1)
        scores = self.router(tokens).softmax(-1)
        weights, expert_ids = scores.topk(self.top_k, dim=-1)
        dispatched = torch.ops.npu.npu_moe_distribute_dispatch_v2(tokens, expert_ids, "ep_group", 1, 0, self.experts)
        expanded, assist, ep_counts = dispatched[0], dispatched[2], dispatched[4]
        combined = torch.ops.npu.npu_moe_distribute_combine_v2(
            torch.relu(self.expert(expanded)), expert_ids, assist, ep_counts, weights, "ep_group", 1, 0, self.experts)
        mixed = torch.ops.npu.npu_mm_all_reduce_base(combined, self.proj, "tp_hcom")
        return x + mixed.view_as(x)


@pytest.mark.parametrize("mode", ["selective", "selective-even", "pointwise"])
def test_selective_never_replays_npu_collectives(stand_in_npu, npu_ops, mode):
    """torch_npu's MoE dispatch and combine and its matmul fused with an all-reduce run once per
    layer under every selective mode with ``backend="npu"``: a replay would send the all-to-all
    again in backward. Gradients are bitwise those of the un-applied model."""
    model = Stack(_MoeBlock)
    runs = len(model.blocks)
    assert _kernel_runs(model, torch.randn(2, 5, 16), mode) == [
        {"npu_moe_distribute_dispatch_v2": runs, "npu_moe_distribute_combine_v2": runs, "npu_mm_all_reduce_base": runs}]


# ---------------------------------------------------------------------------------------------
# The device module
# ---------------------------------------------------------------------------------------------


def test_npu_probe_and_auto_with_stand_in(stand_in_npu):
    """With a visible NPU the real probe succeeds and ``auto`` picks NPU over CUDA and CPU."""
    assert NpuBackend.unavailable_reason() is None
    assert type(hyperac.get_backend("npu")) is NpuBackend
    assert type(hyperac.get_backend("auto")) is NpuBackend
    assert hyperac.available_backends()[0] == "npu"
    assert NpuBackend()._module() is stand_in_npu


def test_npu_streams_and_events_go_to_device_module(stand_in_npu):
    """Streams, events, waits and synchronize are the device module's own. ``current_stream()``
    returns a new wrapper on each call, as torch_npu's does: the backend compares them with ``==``."""
    backend = hyperac.get_backend("npu")
    stand_in_npu.calls.clear()
    side = backend.new_stream()
    event = backend.new_event()
    default = backend.current_stream()
    assert default == backend.current_stream() and default is not backend.current_stream() and side != default
    with backend.use_stream(side):
        assert backend.current_stream() == side
        event.record()
        backend.wait(event)  # the side stream is current: it waits
    assert backend.current_stream() == default
    backend.wait(event)
    backend.synchronize()
    assert stand_in_npu.calls == [
        ("Stream",), ("Event",), ("stream.enter", "side1"), ("record", "event1", "side1"),
        ("wait", "side1", "event1"), ("stream.exit", "side1"), ("wait", "default", "event1"), ("synchronize",),
    ]


def test_npu_device_of_the_tensor_reaches_the_device_module(stand_in_npu):
    """Streams and the statistics a PeakMeter reads are asked for the tensors' device; a device of
    another type (a model still on ``meta`` or the host) is never passed to the device module,
    which would raise ``ValueError: Expected a npu device``: the current device is meant."""
    backend = _NpuOnCpu()
    stand_in_npu.calls.clear()
    other = torch.device("cpu", 1)
    assert backend.new_stream(other).device_index == 1 and backend.current_stream(other).device_index == 1
    with PeakMeter([torch.zeros(1)], backend=backend):
        pass
    with PeakMeter([torch.zeros(1, device="meta")], backend=backend):
        pass
    backend.synchronize(torch.device("meta"))
    assert stand_in_npu.calls == [
        ("Stream", 1),
        ("synchronize", 0), ("reset_peak_memory_stats", 0), ("memory_allocated", 0),
        ("synchronize", 0), ("max_memory_allocated", 0),
        ("synchronize",), ("reset_peak_memory_stats",), ("memory_allocated",),
        ("synchronize",), ("max_memory_allocated",),
        ("synchronize",),
    ]
    with pytest.raises(ValueError, match="Expected a npu device, but got: meta"):
        stand_in_npu.synchronize(torch.device("meta"))


def test_npu_memory_stats_current_device_and_host_link(stand_in_npu, monkeypatch):
    """Memory statistics come from ``torch.npu``; the host link is measured on ``current_device()``."""
    backend = _NpuOnCpu()
    stand_in_npu.calls.clear()
    assert backend.memory_allocated() == 1 << 20
    assert backend.max_memory_allocated() == 3 << 20
    backend.reset_peak_memory_stats()
    assert backend.max_memory_allocated() == 1 << 20
    monkeypatch.delenv("HYPERAC_HOST_LINK_BANDWIDTH", raising=False)
    monkeypatch.setattr("hyperac.backends.base._MEASURED_LINKS", {})
    assert backend.host_link_bandwidth() > 0
    assert stand_in_npu.names() == [
        "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "max_memory_allocated",
        "current_device", *["synchronize"] * 4,
    ]
    assert {call[1] for call in stand_in_npu.calls if call[0] == "synchronize"} == {0}


def test_npu_host_buffers_are_asked_pinned(stand_in_npu):
    """Host buffers are asked for pinned from torch's allocator, which torch_npu's host allocator
    serves on an Ascend machine. Here no accelerator serves it, so the request itself is seen."""
    backend = hyperac.get_backend("npu")
    assert backend.supports_pinned_memory()
    like = torch.zeros(3, 5, dtype=torch.bfloat16)
    host = backend.host_empty(like, pinned=False)
    assert host.shape == like.shape and host.dtype == like.dtype and host.device.type == "cpu"
    assert not host.is_pinned()
    if torch._C._get_accelerator().type == "npu":
        assert backend.host_empty(like, pinned=True).is_pinned()
    else:
        # torch's CPU build says no accelerator serves pinning; its CUDA build (tox -e torch-newest) that
        # it finds no driver
        refused = "pin_memory=True requires a CUDA or other accelerator backend|Found no NVIDIA driver"
        with pytest.raises(RuntimeError, match=refused):
            backend.host_empty(like, pinned=True)


def test_npu_swap_refuses_a_capturing_stream(stand_in_npu):
    """``torch.npu.is_current_stream_capturing()`` (no argument, as torch_npu's) is asked before a
    layer swaps: a captured graph would not redo the host copies."""
    model, _ = applied_copy(Stack(_AttentionBlock), layers="blocks", mode="swap", backend=_NpuOnCpu(),
                            min_swap_bytes=0)
    stand_in_npu.capturing = True
    with pytest.raises(ConfigError, match="swap cannot run while the npu stream is capturing a graph"):
        model(torch.randn(2, 6, 16))
    assert ("is_current_stream_capturing",) in stand_in_npu.calls


def test_npu_internal_format_stays_on_device_and_is_named(npu_ops):
    """The stand-in ``npu::get_npu_format`` reports FRACTAL_NZ for one tensor: swap keeps it on the
    device, says why once, and swaps the plain one."""
    manager = SwapManager(_NpuOnCpu(), min_swap_bytes=0, host_budget_bytes=1 << 20)
    nz, plain, odd = torch.randn(16, 16), torch.randn(16, 16), torch.randn(4)
    FORMATS[nz.untyped_storage().data_ptr()] = 29
    FORMATS[odd.untyped_storage().data_ptr()] = 41
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
        FORMATS.clear()


class _HyperacOps(TorchDispatchMode):
    """The dispatcher ops issued by hyperac's own code: those whose innermost caller outside torch is a
    file of the hyperac package (the model's ops have the model's code there, autograd's the caller
    of ``backward``)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.package = str(Path(hyperac.__file__).parent)
        self.torch = str(Path(torch.__file__).parent)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        callers = [frame.filename for frame in traceback.extract_stack()[:-1] if not frame.filename.startswith(
            self.torch)]
        if callers and callers[-1].startswith(self.package):
            self.ops.append(f"{func} from {Path(callers[-1]).name}")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("backend", ["npu_on_cpu", "sim"])
def test_swap_hooks_issue_no_op_a_dispatch_mode_sees(stand_in_npu, npu_ops, backend):
    """A user's dispatch mode around forward and backward of swapped layers sees no op of swap's
    hooks (format queries, copies, allocations, rebuilds): they run in swap's quiet context. On the
    NPU backend (the stand-in) the hooks ask ``npu::get_npu_format`` of every tensor they swap, and
    the copies go through the device module's streams and events. Gradients are bitwise those of the
    un-applied model."""
    model = Stack(_AttentionBlock, 3)
    x = torch.randn(2, 6, 16)
    loss = lambda m: m(x).square().mean()  # noqa: E731
    reference = train_step(model, loss)
    applied, _ = applied_copy(model, layers="blocks", mode="swap", min_swap_bytes=0,
                              backend=_NpuOnCpu() if backend == "npu_on_cpu" else "sim")
    KERNEL_RUNS.clear()
    stand_in_npu.calls.clear()
    with _HyperacOps() as seen:
        assert_parity(reference, train_step(applied, loss))
    assert seen.ops == []
    assert hyperac.swap_stats(applied).offloaded_tensors > 0
    on_npu = backend == "npu_on_cpu"
    assert (KERNEL_RUNS["get_npu_format"] > 0) == on_npu
    if on_npu:
        assert {"Stream", "Event", "record", "wait", "stream.enter"} <= set(stand_in_npu.names())


# ---------------------------------------------------------------------------------------------
# Autoload, modelled: torch imports torch_npu through its entry point
# ---------------------------------------------------------------------------------------------


class _BrokenTorchNpuFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``torch_npu`` but fails to import it, like a torch-npu wheel without Ascend CANN: its
    ``__init__`` turns autoload off before it imports torch, then fails before it turns it back on."""

    def find_spec(self, name, path=None, target=None):
        return importlib.machinery.ModuleSpec(name, self) if name == "torch_npu" else None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        os.environ[AUTOLOAD_ENV] = "0"
        raise ImportError("libhccl.so: cannot open shared object file: No such file or directory")


@pytest.mark.parametrize("autoload", ["0", None])
def test_npu_import_failure_is_a_reason_not_a_crash(monkeypatch, autoload):
    """With autoload off (``0``), or a torch_npu without an autoload entry point (unset), ``import
    torch`` succeeded and the probe imports torch_npu: its failure is a reason, ``auto`` falls back,
    and the autoload switch is as the user left it (torch_npu's failed import left it ``0``)."""
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    monkeypatch.setattr(sys, "meta_path", [_BrokenTorchNpuFinder(), *sys.meta_path])
    if autoload is None:
        monkeypatch.delenv(AUTOLOAD_ENV, raising=False)
    else:
        monkeypatch.setenv(AUTOLOAD_ENV, autoload)
    reason = NpuBackend.unavailable_reason()
    assert reason.startswith("the torch_npu package is installed but failed to import (ImportError: libhccl.so")
    how = ("TORCH_DEVICE_BACKEND_AUTOLOAD=0 kept `import torch` from importing it" if autoload
           else "this torch_npu registers no autoload entry point")
    assert how in reason and reason.endswith("Install Ascend CANN and source its set_env.sh, or uninstall torch-npu")
    assert os.environ.get(AUTOLOAD_ENV) == autoload
    assert hyperac.get_backend("auto").name != "npu"


def _run(script: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env,
                          timeout=300, check=False)


def test_broken_torch_npu_fails_import_torch_unless_autoload_is_off(tmp_path):
    """torch imports a torch_npu that registers a ``torch.backends`` entry point during ``import
    torch``: a broken one (here a stand-in distribution failing as the wheel without CANN does) makes
    ``import torch`` itself fail, before hyperac runs. With ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` torch
    and hyperac import, and the NPU backend is unavailable with the reason."""
    root = npu_stand_in.write_distribution(tmp_path, broken=True)
    failed = _run("import torch", npu_stand_in.stand_in_environment(root, **{AUTOLOAD_ENV: "1"}))
    assert failed.returncode != 0
    assert "RuntimeError: Failed to load the backend extension: torch_npu" in failed.stderr
    assert "libhccl.so" in failed.stderr
    result = _run("""
        import json, os, sys
        import torch, hyperac
        from hyperac.backends.npu import NpuBackend
        print(json.dumps([NpuBackend.unavailable_reason(), hyperac.get_backend("auto").name,
                          os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"], sys.modules.get("torch_npu") is None]))
    """, npu_stand_in.stand_in_environment(root, **{AUTOLOAD_ENV: "0"}))
    assert result.returncode == 0, result.stderr
    reason, auto, autoload, not_imported = json.loads(result.stdout)
    assert "failed to import (ImportError: libhccl.so" in reason and "AUTOLOAD=0 kept `import torch`" in reason
    assert auto in ("cuda", "cpu") and autoload == "0" and not_imported


def test_autoloaded_npu_backend_through_the_device_module(tmp_path):
    """torch autoloads the stand-in distribution: ``npu`` is a device type, ``torch.npu`` the stand-in
    module, the ``npu::`` ops registered. hyperac's NPU backend then passes ``npu`` devices to it and
    never one of another type, and the planner's RNG guard saves and restores the NPU generators
    through ``get_rng_state`` / ``set_rng_state``."""
    root = npu_stand_in.write_distribution(tmp_path)
    result = _run("""
        import json
        import torch
        import hyperac
        from hyperac.planner.restore import side_effects_undone
        npu = torch.npu
        backend = hyperac.get_backend("auto")
        npu.calls.clear()
        backend.synchronize(torch.device("npu", 1))
        backend.synchronize(torch.device("cpu"))
        stream = backend.new_stream(torch.device("npu", 1))
        before = npu.get_rng_state(1)
        with side_effects_undone(torch.nn.Linear(2, 2), backend.device_type):
            torch.randint(10, (4,), generator=npu.generators[1])
        restored = bool(torch.equal(npu.get_rng_state(1), before))
        print(json.dumps([backend.name, str(backend.device(0)), stream.device_index, restored, npu.calls,
                          hasattr(torch.ops.npu, "npu_fusion_attention")]))
    """, npu_stand_in.stand_in_environment(root, **{AUTOLOAD_ENV: "1"}))
    assert result.returncode == 0, result.stderr
    name, device, stream_device, restored, calls, ops = json.loads(result.stdout)
    assert (name, device, stream_device, restored, ops) == ("npu", "npu:0", 1, True, True)
    assert [tuple(call) for call in calls] == [
        ("synchronize", 1), ("synchronize",), ("Stream", 1), ("get_rng_state", 1),
        ("get_rng_state", 0), ("get_rng_state", 1), ("set_rng_state", 0), ("set_rng_state", 1),
        ("get_rng_state", 1),
    ]
