"""Higher-order ops inside applied layers (NOTE [Higher-order operators] in hyperac/higher_order.py).

Each mode trains a layer that calls flex attention, a compiled region or a user's own higher-order op
with the gradients of the un-applied model, bitwise, and runs a kept op once per step. What cannot run
here: torch 2.13 refuses flex attention's backward on CPU in ``flex_attention()`` itself
(``_validate_device``) though its higher-order op trains on CPU, so these tests lift that one check;
Inductor's CPU flex attention compiles the forward only (its backward fails in lowering), so the
compiled flex attention here is ``aot_eager``'s, which runs the same higher-order op; eager (not
compiled) flex attention is trained in every mode too (NOTE [Traces inside a region] in
hyperac/higher_order.py). ``inductor_compiled_code`` is made by
Inductor (C++, tens of seconds here) only with ``HYPERAC_TEST_INDUCTOR=1``; the default suite calls
the same higher-order op on a Python callable, as Inductor's output code calls it on its kernels.
"""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch
from hyperac_testing import assert_parity
from torch import nn
from torch._higher_order_ops.wrap import InductorCompiledCallable, inductor_compiled_code
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode

import hyperac
from hyperac import higher_order
from hyperac.backends import resolve_ops
from hyperac.backends.cpu import CpuBackend
from hyperac.policy import resolve_op_sets
from hyperac.swap import live_group_count

MODES = ["off", "full", "selective", "selective-even", "pointwise", "swap", "auto"]
WIDTH, HEADS, SEQ = 16, 2, 16


class HopRuns(TorchDispatchMode):
    """Counts the runs of one higher-order op below hyperac's modes (entered around the whole step)."""

    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, op: HigherOrderOperator) -> None:
        super().__init__()
        self.op, self.runs = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.runs += func is self.op
        return func(*args, **(kwargs or {}))


class Stack(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(block() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def loss_fn(model: nn.Module) -> torch.Tensor:
    return model(torch.randn(2, SEQ, WIDTH, generator=torch.Generator().manual_seed(0))).square().mean()


def step(model: nn.Module, op: HigherOrderOperator) -> tuple[tuple, int]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    with HopRuns(op) as counter:
        loss = loss_fn(model)
        loss.backward()
    return (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}), counter.runs


def applied(base: nn.Module, mode: str, budget: float = 0.9, **options) -> nn.Module:
    model = copy.deepcopy(base)
    if mode == "auto":
        hyperac.apply(model, mode="auto", layers="layers", budget=budget, sample=loss_fn, **options)
    elif mode != "off":
        hyperac.apply(model, mode=mode, layers="layers", **options)
    return model


def kept_runs(model: nn.Module) -> int:
    """Runs per step of an op each layer keeps: once per layer, twice in a layer that recomputes fully."""
    plan = hyperac.applied_plan(model)
    return 2 if plan is None else sum(2 if layer.mode == "full" else 1 for layer in plan.layers)


# --- flex attention ---


@pytest.fixture
def flex(monkeypatch):
    """``flex_attention`` compiled with ``aot_eager``, its CPU backward check lifted (see the module docstring)."""
    from torch.nn.attention import flex_attention as module

    monkeypatch.setattr(module, "_validate_device", lambda *tensors: None)
    torch._dynamo.reset()
    yield torch.compile(module.flex_attention, backend="aot_eager")
    torch._dynamo.reset()


class FlexBlock(nn.Module):
    """Causal flex attention with a learned per-head bias captured by its score function."""

    function = None

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH)
        self.head_bias = nn.Parameter(torch.randn(HEADS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.nn.attention.flex_attention import create_block_mask

        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        bias = self.head_bias

        def score_mod(score, b, h, q_index, kv_index):
            return score + bias[h]

        def causal(b, h, q_index, kv_index):
            return q_index >= kv_index

        mask = create_block_mask(causal, None, None, length, length, device="cpu")
        y = FlexBlock.function(q, k, v, score_mod=score_mod, block_mask=mask)
        return x + self.out(y.transpose(1, 2).reshape(batch, length, WIDTH))


@pytest.fixture
def flex_model(flex):
    FlexBlock.function = flex
    return Stack(FlexBlock)


@pytest.mark.parametrize("mode", MODES)
def test_compiled_flex_attention_in_every_mode(flex_model, mode):
    """Bitwise gradients in every mode; flex attention is kept (attention costs more per byte than the
    projections at this length) so it runs once per layer per step, except in full recompute."""
    assert_flex_attention_exact(flex_model, mode)


def assert_flex_attention_exact(base: nn.Module, mode: str) -> None:
    """``base`` applied with ``mode`` has its gradients, bitwise; flex attention runs once per layer per
    step (it is kept), twice in full recompute."""
    hop = torch.ops.higher_order.flex_attention
    reference, reference_runs = step(base, hop)
    assert reference_runs == 2
    model = applied(base, mode)
    result, runs = step(model, hop)
    assert_parity(reference, result)
    assert runs == kept_runs(model) == (4 if mode == "full" else runs), runs


def test_flex_attention_replayed_where_cheap_for_its_bytes(flex_model, monkeypatch):
    """At a length where attention costs fewer FLOPs per byte than the projections (NOTE [Attention kept
    by its cost per byte]), selective recomputes it: it runs again in backward, gradients still exact."""
    hop = torch.ops.higher_order.flex_attention
    monkeypatch.setitem(globals(), "SEQ", 4)
    reference, _ = step(flex_model, hop)
    result, runs = step(applied(flex_model, "selective"), hop)
    assert_parity(reference, result)
    assert runs == 4


def test_save_ops_names_flex_attention(flex_model):
    """``higher_order::flex_attention`` resolves (a higher-order op has no ``.default``) and keeps it."""
    hop = torch.ops.higher_order.flex_attention
    assert resolve_ops(["higher_order::flex_attention"]) == {hop}
    assert hop in resolve_op_sets(CpuBackend()).attention
    reference, _ = step(flex_model, hop)
    for save_ops in (["higher_order::flex_attention", "aten::addmm"], [hop]):
        result, runs = step(applied(flex_model, "selective", save_ops=save_ops), hop)
        assert_parity(reference, result)
        assert runs == 2
    result, runs = step(applied(flex_model, "selective", save_ops=["aten::addmm"]), hop)
    assert_parity(reference, result)
    assert runs == 4, "flex attention not named in save_ops is replayed"


def test_flex_attention_in_compiled_layers(flex_model):
    """``compile=True``: torch's selective checkpoint modes ask hyperac's policy about flex attention as
    AOTAutograd traces it (NOTE [Selective recompute under torch.compile] in policy.py), and the
    partitioner keeps it as the eager region does: it runs once per layer per step."""
    hop = torch.ops.higher_order.flex_attention
    reference, _ = step(flex_model, hop)
    model = applied(flex_model, "selective", compile=True)
    for layer in model.layers:
        layer.compile(backend="aot_eager")
    result, runs = step(model, hop)
    assert_parity(reference, result)
    assert runs == 2, runs


@pytest.fixture
def eager_flex(monkeypatch):
    """Eager ``flex_attention`` (torch runs it through ``torch.compile(backend="eager")``, tracing the score
    function's joint graph with fake tensors in the layer's forward), its CPU backward check lifted."""
    from torch.nn.attention import flex_attention as module

    monkeypatch.setattr(module, "_validate_device", lambda *tensors: None)
    monkeypatch.setattr(FlexBlock, "function", module.flex_attention)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class SoftCappedFlexBlock(FlexBlock):
    """Gemma 2's attention-logit soft-capping over the head bias: a score function whose own ops save
    tensors (``tanh``), so flex attention's trace of its joint graph runs a backward that reads them."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.qkv(x).view(batch, length, 3, HEADS, WIDTH // HEADS).permute(2, 0, 3, 1, 4)
        bias = self.head_bias

        def soft_cap(score, b, h, q_index, kv_index):
            return 2.0 * torch.tanh((score + bias[h]) / 2.0)

        y = FlexBlock.function(q, k, v, score_mod=soft_cap)
        return x + self.out(y.transpose(1, 2).reshape(batch, length, WIDTH))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block", [FlexBlock, SoftCappedFlexBlock], ids=["captured-bias", "soft-cap"])
def test_eager_flex_attention_in_every_mode(eager_flex, mode, block):
    """Eager flex attention traces its score function with fake tensors inside the layer's forward; the
    saved fake tensors stay out of the region's hooks (NOTE [Traces inside a region]), so the gradients of
    the captured bias and of q/k/v through the soft-cap are the un-applied model's, bitwise, and flex
    attention runs once per layer per step (twice in full recompute)."""
    assert_flex_attention_exact(Stack(block), mode)


# --- a compiled region called from an eager layer ---

REGION_RUNS = []


def _region_kernels(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Stands in for Inductor's kernels: the region's output and the activation its backward reads.
    They draw from the generator too, as a region with dropout does."""
    x, weight = inputs
    REGION_RUNS.append(1)
    torch.rand(1)
    hidden = x @ weight
    return [torch.nn.functional.gelu(hidden), hidden]


REGION = InductorCompiledCallable(_region_kernels)


class _Region(torch.autograd.Function):
    """What AOTAutograd's runtime does with an Inductor region under a dispatch mode: the forward calls
    ``inductor_compiled_code``, and saves the activations it returned."""

    @staticmethod
    def forward(ctx, x, weight):
        out, hidden = inductor_compiled_code(REGION, [x, weight])
        ctx.save_for_backward(x, weight, hidden)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, weight, hidden = ctx.saved_tensors
        grad_hidden = torch.ops.aten.gelu_backward(grad, hidden)
        return grad_hidden @ weight.T, (x.reshape(-1, x.shape[-1]).T @ grad_hidden.reshape(-1, grad_hidden.shape[-1]))


class RegionBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH)
        self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.dropout(_Region.apply(self.up(x).relu(), self.weight), 0.5, self.training)


@pytest.mark.parametrize("mode", MODES)
def test_compiled_region_in_every_mode(mode):
    """``inductor_compiled_code`` is kept: its kernels run once per layer per step, except in full
    recompute; the dropout after it draws the forward's mask in the replay, although the kept region
    drew from the generator and does not run again."""
    model = Stack(RegionBlock)
    reference, _ = step(model, inductor_compiled_code)
    model = applied(model, mode)
    REGION_RUNS.clear()
    result, runs = step(model, inductor_compiled_code)
    assert_parity(reference, result)
    assert len(REGION_RUNS) == runs == kept_runs(model) == (4 if mode == "full" else runs), (REGION_RUNS, runs)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("HYPERAC_TEST_INDUCTOR") != "1",
                    reason="Inductor builds C++ for tens of seconds on 2 CPU cores; set HYPERAC_TEST_INDUCTOR=1")
@pytest.mark.parametrize("mode", ["selective", "pointwise"])
def test_inductor_region_inside_a_layer(mode):
    """A ``torch.compile``'d function (Inductor, regions wrapped for dispatch modes) called by an eager
    layer: kept, its forward region run once per layer per step (its backward region once too);
    gradients those of the un-applied model."""

    def mlp(x, weight):
        return torch.nn.functional.gelu(x @ weight).sin()

    class Block(nn.Module):
        compiled = torch.compile(mlp, backend="inductor")

        def __init__(self) -> None:
            super().__init__()
            self.up = nn.Linear(WIDTH, WIDTH)
            self.weight = nn.Parameter(torch.randn(WIDTH, WIDTH) / 4)

        def forward(self, x):
            return x + Block.compiled(self.up(x), self.weight)

    torch._dynamo.reset()
    with torch._inductor.config.patch(wrap_inductor_compiled_regions=True):
        model = Stack(Block)
        reference, reference_runs = step(model, inductor_compiled_code)
        result, runs = step(applied(model, mode), inductor_compiled_code)
    torch._dynamo.reset()
    assert_parity(reference, result)
    assert runs == reference_runs == 4, runs  # forward and backward regions, the forward's not again


@pytest.mark.parametrize("options", [dict(mode="auto", budget=0.9, sample=loss_fn),
                                     dict(mode="selective", swap_selective_outputs=True, min_swap_bytes=0),
                                     dict(mode="swap", min_swap_bytes=0),
                                     dict(mode="full", swap_inputs=True, min_swap_bytes=0)],
                         ids=["auto", "swapped-selective", "swap", "full-swapped-inputs"])
@pytest.mark.parametrize("block", ["flex", "eager-flex", "region"])
def test_higher_order_ops_on_the_sim_backend(request, block, options):
    """On the simulated accelerator: auto profiles under the sim's compute mode, and the kept outputs
    of a higher-order op, or what a layer saves, go to host memory and back; gradients exact, the op not
    run again. Eager flex attention's trace keeps its fake tensors out of swap's hooks too (NOTE [Traces
    inside a region])."""
    from hyperac.backends.sim import SimBackend

    if block == "flex":
        model, hop = request.getfixturevalue("flex_model"), torch.ops.higher_order.flex_attention
    elif block == "eager-flex":
        request.getfixturevalue("eager_flex")
        model, hop = Stack(SoftCappedFlexBlock), torch.ops.higher_order.flex_attention
    else:
        model, hop = Stack(RegionBlock), inductor_compiled_code
    reference, _ = step(model, hop)
    model = copy.deepcopy(model)
    hyperac.apply(model, layers="layers", backend=SimBackend(), **options)
    result, runs = step(model, hop)
    assert_parity(reference, result)
    assert runs == kept_runs(model), runs
    if options["mode"] != "auto":
        assert hyperac.swap_stats(model).offloaded_bytes > 0
    del model
    gc.collect()
    assert live_group_count() == 0, "a swap group outlived its model"


def test_eager_flex_attention_frees_its_trace(eager_flex):
    """The fake tensors eager flex attention's trace saves close no cycle through the region's hooks
    (``tanh`` saves its own output; NOTE [Traces inside a region]): no checkpoint frame outlives its step."""
    def frames() -> dict[int, object]:
        return {id(o): o for o in gc.get_objects() if type(o).__name__ == "_CheckpointFrame"}

    gc.collect()
    before = frames()  # frames other tests of the session still hold are not this test's
    model = applied(Stack(SoftCappedFlexBlock), "full")
    for _ in range(3):
        step(model, torch.ops.higher_order.flex_attention)
    gc.collect()
    assert not [frame for key, frame in frames().items() if key not in before]


# --- control flow ---


def _positive(hidden):
    return hidden.sin()


def _negative(hidden):
    return hidden.cos()


class CondBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        hidden = self.up(x)
        return x + torch.cond(hidden.sum() > 0, _positive, _negative, (hidden,))


@pytest.mark.parametrize("mode", MODES)
def test_cond_in_every_mode(mode):
    """``torch.cond`` is replayed: it runs once more per recomputing layer (its backward runs a ``cond``
    too, as without hyperac); auto profiles through it (its autograd traces under auto's hooks)."""
    hop = torch.ops.higher_order.cond
    model = Stack(CondBlock)
    torch._dynamo.reset()
    reference, reference_runs = step(model, hop)
    model = applied(model, mode, budget=1.0)
    result, runs = step(model, hop)
    assert_parity(reference, result)
    plan = hyperac.applied_plan(model)
    replaying = 0 if plan is None else sum(layer.mode not in ("off", "swap") for layer in plan.layers)
    assert runs == reference_runs + replaying, (runs, reference_runs, replaying)
    assert replaying == {"off": 0, "swap": 0, "auto": replaying}.get(mode, 2)


def test_cond_in_compiled_layers():
    """``compile=True``: PyTorch's selective checkpoint modes, which have no rule for ``cond``, take it as
    one op (NOTE [Higher-order operators]) instead of failing the compile; gradients those of eager."""
    model = Stack(CondBlock)
    torch._dynamo.reset()
    reference, _ = step(model, torch.ops.higher_order.cond)
    model = applied(model, "selective", compile=True)
    for layer in model.layers:
        layer.compile(backend="aot_eager")
    result, _ = step(model, torch.ops.higher_order.cond)
    torch._dynamo.reset()
    assert_parity(reference, result)


# --- a higher-order op hyperac has no rule for ---


class UserOp(HigherOrderOperator):
    """A user's own higher-order op: ``user_op(function, x, *counters)`` runs ``function(x)`` and adds
    one to each of ``counters`` in place."""

    def __init__(self) -> None:
        super().__init__("hyperac_test_user_op")

    def __call__(self, function, x, *counters):
        return super().__call__(function, x, *counters)


user_op = UserOp()
USER_RUNS = []


@user_op.py_impl(torch._C.DispatchKey.CompositeExplicitAutograd)
def _user_op_dense(function, x, *counters):
    USER_RUNS.append(1)
    for counter in counters:
        counter.add_(1)
    return function(x)


class _UserOpFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, function, x, *counters):
        ctx.function = function
        ctx.save_for_backward(x)
        with torch._C._AutoDispatchBelowAutograd():
            return user_op(function, x, *counters)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_()
            grad_x = torch.autograd.grad(ctx.function(leaf), leaf, grad)[0]
        return None, grad_x, *[None] * (len(ctx.needs_input_grad) - 2)


@user_op.py_impl(torch._C.DispatchKey.Autograd)
def _user_op_autograd(function, x, *counters):
    return _UserOpFunction.apply(function, x, *counters)


class UserBlock(nn.Module):
    writes = False

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        hidden = self.up(x)
        if UserBlock.writes:  # counts in place: replayed, so that the replay counts as the forward did
            count = torch.zeros(())
            return x + user_op(torch.sin, hidden, count) * hidden * (1 + count)
        return x + user_op(torch.sin, hidden) * hidden


@pytest.mark.parametrize("writes", [False, True])
@pytest.mark.parametrize("mode", ["selective", "selective-even", "pointwise"])
def test_unknown_higher_order_op(mode, writes, monkeypatch):
    """A higher-order op hyperac has no rule for is kept (it runs once per layer per step, never in
    backward), or replayed where it wrote into its input; gradients exact either way."""
    monkeypatch.setattr(UserBlock, "writes", writes)
    assert higher_order.rule(user_op) == higher_order.ONCE
    model = Stack(UserBlock)
    reference, _ = step(model, user_op)
    USER_RUNS.clear()
    result, runs = step(applied(model, mode), user_op)
    assert_parity(reference, result)
    assert len(USER_RUNS) == runs == (4 if writes else 2), (USER_RUNS, runs)


def test_every_torch_higher_order_op_has_a_rule():
    """Invariant 17: each higher-order op torch registers (its own modules imported) has a stated rule."""
    import importlib
    import pkgutil

    import torch._higher_order_ops as package

    if ".".join(torch.__version__.split(".")[:2]) != "2.13":
        pytest.skip("the rules name torch 2.13's higher-order ops; another torch may add some (they are 'once')")
    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    importlib.import_module("torch._inductor.fx_passes.control_dependencies")
    registered = set(torch._ops._higher_order_ops) - {user_op.name()}
    assert registered <= set(higher_order.RULES), sorted(registered - set(higher_order.RULES))
