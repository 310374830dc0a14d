"""A sharding stack's parameter lifecycle is not part of a layer's program (design invariant 19; NOTE
[Parameter lifecycles are not the layer's program] in hyperac/lifecycle.py).

A stack in miniature stands in for DeepSpeed ZeRO-3 (tests/test_deepspeed.py runs the real one under
``tox -e deepspeed``): a forward pre-hook on every Linear gathers its weight from a flat shard buffer
under ``torch.no_grad()``, unless its coordinator finds it gathered already, as ZeRO-3's does in a
layer's replay. The forward then runs gather ops that the replay does not; every mode is exact all the
same. A collective in a layer's forward (sequence parallel's activation all-gather, inside an
``autograd.Function``, where autograd is off too) is the layer's and kept.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hyperac_testing import BiasedMlp, Stack, assert_parity, lm_loss, tiny_llama, train_step
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hyperac
from hyperac.measure import flop_counter

MODES = ["full", "selective", "selective-even", "pointwise", "swap"]
GATHERED: set[int] = set()
"""The toy coordinator's state: the modules whose weights are gathered. It lives outside the model, as
ZeRO-3's coordinator does (on the engine), where the replay's Python state does not reach."""


class ToyShards:
    """Each Linear's weight lives in a flat shard buffer; a pre-hook gathers it into the parameter (through
    a slice of the stack's flat gather buffer, as ZeRO-3's) once per step, and not again while it is gathered.
    ``grad_enabled``: it gathers with autograd on. ``touch_inputs``: when it gathers, it also passes the
    module's input on through an op (``x * 1``), which autograd tracks: an op hyperac cannot tell from
    the layer's own."""

    def __init__(self, model: nn.Module, grad_enabled: bool = False, touch_inputs: bool = False) -> None:
        self.grad_enabled, self.touch_inputs = grad_enabled, touch_inputs
        self.shards, self.buffers = {}, {}
        for module in model.modules():
            if isinstance(module, nn.Linear):
                self.shards[module] = module.weight.detach().clone().reshape(-1)
                self.buffers[module] = torch.empty(2 * module.weight.numel())  # the stack's flat gather buffer
                module.register_forward_pre_hook(self.gather)
        model.register_forward_pre_hook(lambda module, args: GATHERED.clear())  # a new step

    def gather(self, module: nn.Module, args: tuple) -> tuple | None:
        if id(module) in GATHERED:
            return None
        weight = dict.__getitem__(module._parameters, "weight")  # not through the stack's own dict
        with torch.set_grad_enabled(self.grad_enabled):
            shard, flat = self.shards[module], self.buffers[module]
            flat[: shard.numel()].copy_(shard)
            gathered = flat.narrow(0, 0, shard.numel()).view_as(weight)
            with torch.no_grad():
                weight.copy_(gathered)
        GATHERED.add(id(module))
        return (args[0] * 1,) if self.touch_inputs else None


class GatheringParameters(dict):
    """A module's parameter dict that gathers a parameter when it is read, with autograd on, as ZeRO-3's
    ``ZeROOrderedDict`` does for a parameter a forward reads outside its own module's hooks."""

    def __init__(self, module: nn.Module, shards: ToyShards) -> None:
        super().__init__(module._parameters)
        self.module, self.shards = module, shards

    def __getitem__(self, name: str) -> nn.Parameter:
        if name == "weight" and id(self.module) not in GATHERED:
            self.shards.gather(self.module, ())
        return super().__getitem__(name)


def sharded_llama(on_access: bool = False) -> nn.Module:
    model = tiny_llama(num_layers=2)
    shards = ToyShards(model, grad_enabled=on_access)
    if on_access:
        for module in shards.shards:
            module._forward_pre_hooks.clear()
            module._parameters = GatheringParameters(module, shards)
    return model


@pytest.mark.parametrize("on_access", [False, True], ids=["in_hooks", "on_access"])
@pytest.mark.parametrize("mode", MODES + ["plan"])
def test_gathers_the_replay_does_not_run_are_not_the_layers(mode, on_access):
    """The replay finds every weight gathered and runs no gather: loss and gradients are the un-applied
    model's, bitwise, in every mode (``selective`` raised RecomputeMismatchError before), whether the
    stack gathers in module hooks with autograd off or when a parameter is read."""
    loss_fn = lm_loss(seq=16)
    reference = train_step(sharded_llama(on_access), loss_fn)
    model = sharded_llama(on_access)
    options = dict(mode="off", layers={0: "selective", 1: "pointwise"}) if mode == "plan" else dict(mode=mode)
    if mode == "swap":
        options.update(backend="sim", min_swap_bytes=0)
    hyperac.apply(model, **options)
    for _ in range(2):
        assert_parity(reference, train_step(model, loss_fn))


class _Positioned(nn.Module):
    """Adds position embeddings it is given, as a view of the model's embedding weight (DETR's decoder layers)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return x + self.proj(x + positions.view(-1, 32)).tanh()


class _PositionedStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.positions = nn.Embedding(4, 32)
        self.blocks = nn.ModuleList(_Positioned() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, self.positions.weight[None])  # a view of a parameter, given positionally
        return x


@pytest.mark.parametrize("mode", ["selective", "selective-even", "pointwise"])
def test_a_layer_given_a_view_of_a_parameter_replays_its_views_alike(mode):
    """Views of a parameter are on no tape (FSDP1 takes some in its first forward only); a layer given such a view
    gets the same view in its replay, not an alias of it that views no parameter, so the two tapes agree (DETR's
    decoder layers raised RecomputeMismatchError: 'the forward ran aten.mm.default, the recompute ran
    aten.view.default')."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    loss_fn = lambda model: model(x).square().sum()  # noqa: E731
    reference = train_step(_PositionedStack(), loss_fn)
    model = _PositionedStack()
    hyperac.apply(model, mode=mode, layers="blocks")
    assert_parity(reference, train_step(model, loss_fn))


@pytest.mark.parametrize("mode", ["selective", "selective-even", "pointwise"])
def test_a_view_a_hook_takes_in_forward_only_is_not_the_layers(mode):
    """torch's ModuleTracker, which FlopCounterMode runs, registers a multi-grad hook on each module's inputs
    in forward and not in the replay, taking a view (``view_as``, autograd on) of an input that is a leaf: a
    view a hook takes computes nothing and is not the layer's program, so the tape does not shift by one op
    (it raised RecomputeMismatchError: 'the forward ran aten.view.default, the recompute ran aten.t.default')."""
    def step(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0), requires_grad=True)  # a leaf, as a layer's
        with flop_counter():
            loss = model(x).square().sum()
            loss.backward()
        return loss, {"x": x.grad, **{name: p.grad for name, p in model.named_parameters()}}

    reference = step(Stack(BiasedMlp, num_blocks=3))
    model = Stack(BiasedMlp, num_blocks=3)
    hyperac.apply(model, mode=mode, layers="blocks")
    assert_parity(reference, step(model))


def test_auto_plans_over_the_stacks_hooks():
    """``auto`` profiles every mode on the layers (the selective ones raised RecomputeMismatchError before),
    and what it applies is exact."""
    loss_fn = lm_loss(seq=16)
    reference = train_step(sharded_llama(), loss_fn)
    model = sharded_llama()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    hyperac.apply(model, mode="auto", budget=0.8, sample={"input_ids": ids, "labels": ids})
    assert_parity(reference, train_step(model, loss_fn))


TRACE: dict[str, dict[int, frozenset[int]]] = {}
"""The toy stack's fetch trace (``recording``, then ``recorded``): outside the model and its hooks' reach,
as ZeRO-3's coordinator is."""


def traced_fetches(model: nn.Module) -> nn.Module:
    """ZeRO-3's external-parameter bookkeeping and fetch trace in miniature: each Linear keeps a dict of the
    parameters it fetches (ZeRO-3's ``module._external_params``), filled as the stack first gathers them;
    the first step records each module's dict, and every later step checks it against that record, as
    ZeRO-3's coordinator checks its fetch queue ("tracing error")."""
    TRACE.clear()
    TRACE["recording"] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.fetches = {}
            module.register_forward_pre_hook(_fetch)
    model.register_forward_pre_hook(_new_step)
    return model


def _new_step(module: nn.Module, args: tuple) -> None:
    if "recorded" not in TRACE and TRACE["recording"]:
        TRACE["recorded"] = TRACE["recording"]


def _fetch(module: nn.Module, args: tuple) -> None:
    if "recorded" not in TRACE:  # recording: the stack gathers the weight and registers it
        module.fetches.setdefault(id(module.weight), module.weight)
        TRACE["recording"][id(module)] = frozenset(module.fetches)
    elif frozenset(module.fetches) != TRACE["recorded"][id(module)]:
        raise RuntimeError(f"tracing error: a Linear fetches {len(module.fetches)} parameters, "
                           f"the trace {len(TRACE['recorded'][id(module)])}")


def test_auto_leaves_the_stacks_parameter_bookkeeping():
    """``auto``'s profiled steps record the stack's trace and fill its per-module dicts of the parameters it
    fetches; profiling puts back the model's Python state, but not those dicts (NOTE [Parameter bookkeeping
    is the stack's]), so the next step fetches as the trace says and is exact. Putting them back to the
    empty dicts raised the stack's tracing error, as ZeRO-3 did under ``auto`` with LoRA."""
    loss_fn = lm_loss(seq=16)
    reference = traced_fetches(tiny_llama(num_layers=2))
    expected = [train_step(reference, loss_fn) for _ in range(2)]
    model = traced_fetches(tiny_llama(num_layers=2))
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    hyperac.apply(model, mode="auto", budget=0.8, sample={"input_ids": ids, "labels": ids})
    for step in expected:
        assert_parity(step, train_step(model, loss_fn))


def test_containers_of_parameters_are_left_as_the_stack_left_them():
    """A replay's snapshot puts back a module's containers (an auxiliary-loss list), but leaves those that hold
    parameters, before or after, as the stack left them: one it registered a parameter in (ZeRO-3's external
    parameters), one it unregistered a parameter from (ZeRO-3 moves a dangling parameter to the outer module)."""
    from hyperac.replay.python_state import PythonState

    module = nn.Linear(2, 2)
    module.registered, module.unregistered, module.losses = {}, {id(module.weight): module.weight}, []
    snapshot = PythonState([module], (), {})
    module.registered[id(module.bias)] = module.bias
    module.unregistered.clear()
    module.losses.append(torch.ones(()))
    snapshot.put_back()
    assert list(map(id, module.registered.values())) == [id(module.bias)]
    assert not module.unregistered
    assert not module.losses


def test_hooks_hyperac_cannot_tell_name_the_stack_and_full_mode():
    """A hook's op on what autograd tracks looks like the layer's own: the replay, which does not run it,
    diverges, and the error names the package whose hooks ran (this file) and ``mode='full'``, not a
    layer to turn off (every layer would diverge alike)."""
    model = tiny_llama(num_layers=2)
    ToyShards(model, touch_inputs=True)
    hyperac.apply(model, mode="selective")
    with pytest.raises(hyperac.RecomputeMismatchError) as raised:
        train_step(model, lm_loss(seq=16))
    message = str(raised.value)
    assert "layer 'model.layers.1' diverged from its forward" in message
    assert "parameter hooks of test_lifecycle" in message and "mode='full'" in message
    assert "layers={" not in message


class _GatherSequence(torch.autograd.Function):
    """Sequence parallel's all-gather of activations (Megatron's ``gather_from_sequence_parallel_region``):
    ``c10d::_allgather_base_`` in a forward, where autograd is off; one rank, so its backward is the identity."""

    @staticmethod
    def forward(ctx, x):
        out = torch.empty((dist.get_world_size() * x.shape[0], *x.shape[1:]), dtype=x.dtype)
        dist.all_gather_into_tensor(out, x.contiguous())
        return out

    @staticmethod
    def backward(ctx, grad):
        return grad


class SequenceParallelBlock(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)

    def forward(self, x):
        return x + self.down(_GatherSequence.apply(self.up(x)).relu())


class _CountGathers(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func._schema.name == "c10d::_allgather_base_"
        return func(*args, **(kwargs or {}))


@pytest.fixture
def one_rank():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with gloo")
@pytest.mark.parametrize("mode", ["selective", "selective-even", "pointwise", "full"])
def test_activation_all_gather_is_kept(one_rank, mode):
    """The selective modes keep the activation all-gather's output and never run it in backward, as without
    hyperac (it was run again in every replay, ignored by name for FSDP2's parameter all-gather); ``full``
    replays it, once per layer."""
    model = Stack(SequenceParallelBlock)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    reference = train_step(model, lambda m: m(x).pow(2).sum())
    hyperac.apply(model, mode=mode, layers="blocks")
    model.zero_grad(set_to_none=True)
    loss = model(x).pow(2).sum()
    with _CountGathers() as gathers:
        loss.backward()
    assert gathers.count == (2 if mode == "full" else 0)
    assert_parity(reference, train_step(model, lambda m: m(x).pow(2).sum()))
