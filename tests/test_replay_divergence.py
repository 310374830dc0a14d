"""A replay that would diverge from its forward is made exact or caught, in every mode (issue 26).

Each test builds a small model the way a user writes one (Python state changed in forward, forward
hooks, a module owned by the parent, ``parametrize.cached()``, autocast with shared weights, a layer
run twice, a gradient penalty) and trains it un-applied and applied, two SGD steps, comparing losses,
gradients, parameters and buffers bit for bit (``program_fuzzer.train``/``differences``), or expects a
hyperac error that names the layer and the fix.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import gc
import itertools
import random
import types
import weakref
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from program_fuzzer import ReadsTwice, apply_mode, differences, train
from torch import nn
from torch.nn.utils import parametrize
from torch.utils import checkpoint as torch_recompute
from torch.utils.flop_counter import FlopCounterMode

import hyperac

RECOMPUTE_MODES = ("full", "selective", "selective-even", "pointwise")
D = 8


def _input(model: nn.Module) -> torch.Tensor:
    return model(torch.randn(4, D))


def _parity(make: Callable[[], nn.Module], mode: str, loss_fn: Callable = _input, backward: str = "plain",
            **options) -> None:
    """``make()`` trains the same applied in ``mode`` as un-applied, bit for bit."""
    torch.manual_seed(0)
    model = make()
    reference = copy.deepcopy(model)
    expected = train(reference, backward, loss_fn)
    hyperac.apply(model, mode=mode, **{"backend": "cpu", **options})
    actual = train(model, backward, loss_fn)
    assert differences(expected, actual) == []


class Stack(nn.Module):
    """A linear, then ``layers`` in a ``ModuleList``."""

    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


# --- Python state changed by the forward -------------------------------------------------------------

class Counting(nn.Module):
    """Counts its calls in a Python attribute and uses the count as a value."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.linear(x)) * self.calls


class Branching(Counting):
    """README's "stateful forwards": branches on how often it ran."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.linear(x)
        return torch.relu(x) if self.calls % 2 else torch.sigmoid(x)


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
@pytest.mark.parametrize("block", [Branching, Counting])
def test_a_python_attribute_changed_in_forward_is_seen_by_the_replay_as_the_forward_saw_it(block, mode):
    _parity(lambda: Stack([block() for _ in range(3)]), mode, layers="layers")
    model = Stack([block() for _ in range(3)])
    hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
    train(model, "plain", _input)
    assert [layer.calls for layer in model.layers] == [2, 2, 2]  # once per forward, never by a replay


class Recorder:
    """A forward hook object (``SaveOutput``): keeps what it saw, scales by how often it ran."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        self.outputs.append(output.detach())
        return output * (1 + 0.1 * len(self.outputs))


@dataclasses.dataclass(slots=True)
class Schedule:
    temperature: float = 1.0


class Owner:
    """A plain object a layer reaches only through a weak reference (a parent it must not keep alive);
    kept alive by ``_OWNERS``."""

    def __init__(self) -> None:
        self.calls = 0


_OWNERS: list[Owner] = []


def _kept_owner() -> Owner:
    """A new :class:`Owner`, kept alive by ``_OWNERS``; made by a layer's first forward, so that deepcopies
    of the layer do not share it."""
    _OWNERS.append(Owner())
    return _OWNERS[-1]


class Stateful(nn.Module):
    """State a forward changes, held where a user puts it: a hook object, a bound hook's owner, a slots
    dataclass, a deque, a BatchNorm in a plain object (or in a list in one), a generator it draws from
    (torch's, Python's, numpy's), an object behind a weak reference."""

    def __init__(self, holder: str) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)
        self.holder = holder
        if holder == "hook_object":
            self.linear.register_forward_hook(Recorder())
        elif holder == "bound_hook":
            self.recorder = Recorder()
            self.linear.register_forward_hook(self.recorder.__call__)
        self.schedule = Schedule()
        self.history: collections.deque = collections.deque(maxlen=3)
        self.held = types.SimpleNamespace(norm=nn.BatchNorm1d(D), norms=[nn.BatchNorm1d(D)])
        self.generator = torch.Generator().manual_seed(5)
        self.python_generator = random.Random(5)
        if holder == "numpy_generator":
            self.numpy_generator = pytest.importorskip("numpy").random.default_rng(5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if self.holder == "slots_dataclass":
            self.schedule.temperature *= 0.5
            h = h * self.schedule.temperature
        elif self.holder == "deque":
            self.history.append(float(len(self.history)))
            h = h * sum(self.history)
        elif self.holder == "plain_object_norm":
            h = self.held.norm(h)
        elif self.holder == "list_in_plain_object_norm":
            h = self.held.norms[0](h)
        elif self.holder == "generator":
            h = h * torch.bernoulli(torch.full_like(h, 0.5), generator=self.generator)
        elif self.holder == "python_generator":
            h = h * self.python_generator.random()
        elif self.holder == "numpy_generator":
            h = h * float(self.numpy_generator.random())
        elif self.holder == "weakref":
            if "owner" not in self.__dict__:
                self.owner = weakref.ref(_kept_owner())
            owner = self.owner()
            owner.calls += 1
            h = h * owner.calls
        return torch.tanh(h)


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
@pytest.mark.parametrize("holder", ["hook_object", "bound_hook", "slots_dataclass", "deque", "plain_object_norm",
                                    "list_in_plain_object_norm", "generator", "python_generator", "numpy_generator",
                                    "weakref"])
def test_state_a_forward_changes_where_users_hold_it_is_seen_by_the_replay_as_the_forward_saw_it(holder, mode):
    _parity(lambda: Stack([Stateful(holder) for _ in range(2)]), mode, layers="layers")


def test_a_hook_object_records_each_forward_once_and_a_borrowed_norm_counts_each_step_once():
    model = Stack([Stateful("hook_object"), Stateful("plain_object_norm"), Stateful("list_in_plain_object_norm")])
    hyperac.apply(model, mode="full", backend="cpu", layers="layers")
    train(model, "plain", _input)
    assert [len(hook.outputs) for hook in model.layers[0].linear._forward_hooks.values()] == [2]
    assert model.layers[1].held.norm.num_batches_tracked.item() == 2
    assert model.layers[2].held.norms[0].num_batches_tracked.item() == 2


class GlobalDraws(nn.Module):
    """Scales by draws from Python's and numpy's global generators (``random.random()``, ``np.random.rand()``),
    or by Gaussian draws (``random.gauss``, ``np.random.randn()``), which come in pairs: every second layer
    takes the Gaussian its generator cached, moving nothing but the cache."""

    def __init__(self, gaussian: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)
        self.gaussian = gaussian

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        numpy = pytest.importorskip("numpy")
        if self.gaussian:
            scale = random.gauss(0, 1) + float(numpy.random.randn())
        else:
            scale = random.random() + float(numpy.random.rand())  # drawn before the last saved op: the replay draws
        return torch.tanh(self.linear(x) * scale)


@pytest.mark.parametrize("gaussian", [False, True])
@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_draws_from_the_global_python_and_numpy_generators_are_replayed_and_leave_them_where_the_forward_did(
        mode, gaussian):
    numpy = pytest.importorskip("numpy")

    def seeded_train(model: nn.Module) -> tuple[list, tuple, float]:
        random.seed(1)
        numpy.random.seed(1)
        return train(model, "plain", _input), random.getstate(), numpy.random.rand()

    torch.manual_seed(0)
    model = Stack([GlobalDraws(gaussian) for _ in range(3)])
    expected, python_state, numpy_draw = seeded_train(copy.deepcopy(model))
    hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
    actual, applied_python_state, applied_numpy_draw = seeded_train(model)
    assert differences(expected, actual) == []
    assert (applied_python_state, applied_numpy_draw) == (python_state, numpy_draw)


class OwnAndGlobalDraws(nn.Module):
    """Scales by a draw from numpy's global generator and one from a ``RandomState`` of its own."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)
        self.generator = pytest.importorskip("numpy").random.RandomState(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = float(pytest.importorskip("numpy").random.rand()) + float(self.generator.rand())
        return torch.tanh(self.linear(x) * scale)


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_numpy_generators_given_new_bit_generators_between_forward_and_backward_replay_what_the_forward_drew(mode):
    """NOTE [Generators read as bytes]: ``np.random.set_bit_generator`` and a ``RandomState``'s ``__init__`` give it
    another MT19937 (the old one freed, its memory reused here); the replay draws what the forward drew."""
    numpy = pytest.importorskip("numpy")
    original = numpy.random.get_bit_generator()

    def seeded_train(model: nn.Module) -> tuple[list, float]:
        steps = itertools.count()

        def loss_fn(model: nn.Module) -> torch.Tensor:
            loss, step = _input(model), next(steps)
            numpy.random.set_bit_generator(numpy.random.MT19937(100 + step))
            for layer in model.layers:
                layer.generator.__init__(200 + step)
            assert [numpy.random.MT19937(1) for _ in range(20)]  # memory the old ones held, reused
            return loss

        numpy.random.set_bit_generator(numpy.random.MT19937(1))
        try:
            return train(model, "plain", loss_fn), numpy.random.rand()
        finally:
            numpy.random.set_bit_generator(original)

    torch.manual_seed(0)
    model = Stack([OwnAndGlobalDraws(seed) for seed in range(2)])
    expected, draw = seeded_train(copy.deepcopy(model))
    hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
    actual, applied_draw = seeded_train(model)
    assert differences(expected, actual) == []
    assert applied_draw == draw


class Seen:
    """A hook registered for every module that counts the Linear outputs it saw."""

    def __init__(self) -> None:
        self.outputs: list[torch.Tensor] = []

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        if isinstance(module, nn.Linear):
            self.outputs.append(output.detach())


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
@pytest.mark.parametrize("kind", ["object", "closure"])
def test_a_hook_registered_for_every_module_sees_each_forward_once(kind, mode):
    """``register_module_forward_hook``: what it holds is part of every layer's Python state."""
    def seen_by_hook(apply: bool) -> int:
        seen = Seen()
        outputs: list[torch.Tensor] = []

        def closure(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if isinstance(module, nn.Linear):
                outputs.append(output.detach())

        torch.manual_seed(0)
        model = Stack([nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(2)])
        if apply:
            hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
        handle = nn.modules.module.register_module_forward_hook(seen if kind == "object" else closure)
        try:
            train(model, "plain", _input)
        finally:
            handle.remove()
        return len(seen.outputs if kind == "object" else outputs)

    assert seen_by_hook(apply=True) == seen_by_hook(apply=False) == 6  # 2 steps x 3 Linears


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_a_replay_after_model_eval_runs_as_its_training_forward_did(mode):
    """``model.eval()`` between forward and backward (an evaluation callback before ``loss.backward()``)."""
    def train_then_eval(model: nn.Module) -> list[torch.Tensor]:
        model.train()
        torch.manual_seed(3)
        loss = model(torch.randn(4, D))
        model.eval()
        loss.backward()
        return [loss.detach(), *(p.grad for p in model.parameters())]

    torch.manual_seed(0)
    model = Stack([nn.Sequential(nn.Linear(D, D), nn.Dropout(0.3), nn.Tanh()) for _ in range(2)])
    expected = train_then_eval(copy.deepcopy(model))
    hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
    assert all(torch.equal(a, b) for a, b in zip(expected, train_then_eval(model), strict=True))


class Collector:
    """What a parent gives its layers to register with (``self.layers.append(...)``, two levels down)."""

    def __init__(self) -> None:
        self.layers: list[nn.Module] = []


class Habit(nn.Module):
    """Python a user's layer runs once, or holds in a way one level of snapshot does not reach."""

    def __init__(self, habit: str, collector: Collector) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(D, D), nn.Linear(D, D)
        self.habit, self.collector = habit, collector
        self.registered = False
        self.amax: float | None = None
        self.handle = self.first.register_forward_hook(self._calibrate) if habit == "one_shot_hook" else None
        self.nested = types.SimpleNamespace(inner=types.SimpleNamespace(calls=0))

    def _calibrate(self, module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        self.amax = out.detach().abs().max().item()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0
        if self.habit == "lazy_registry" and not self.registered:  # register with the parent on the first call
            self.collector.layers.append(self)
            self.registered = True
        elif self.habit == "lazy_hook" and not self.registered:  # add a hook on the first call
            self.first.register_forward_hook(lambda module, args, out: out * 0.5)
            self.registered = True
        elif self.habit == "bound_method_generator":
            if "coin" not in self.__dict__:  # made by the first forward, so that deepcopies do not share it
                self.coin = random.Random(3).random  # a generator held only through a bound method
            scale = 0.5 + self.coin()
        elif self.habit == "weakref_proxy":
            if "owner" not in self.__dict__:
                self.owner = weakref.proxy(_kept_owner())
            self.owner.calls += 1
            scale = float(self.owner.calls)
        elif self.habit == "nested_object":
            self.nested.inner.calls += 1
            scale = float(self.nested.inner.calls)
        h = self.first(x) * scale
        if self.handle is not None:  # a one-shot calibration hook, removed once it ran
            self.handle.remove()
            self.handle = None
        if self.amax is not None:
            h = h / self.amax
        h = torch.tanh(h)
        self.aux = h.square().mean()
        return x + self.second(h)


class Habits(nn.Module):
    def __init__(self, habit: str) -> None:
        super().__init__()
        self.collector = Collector()
        self.embed = nn.Linear(D, D)
        self.layers = nn.ModuleList(Habit(habit, self.collector) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x.square().mean() + 0.1 * sum(layer.aux for layer in self.collector.layers)


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
@pytest.mark.parametrize("habit", ["lazy_registry", "lazy_hook", "one_shot_hook", "bound_method_generator",
                                   "weakref_proxy", "nested_object"])
def test_python_a_layer_runs_once_or_holds_deeper_is_as_the_forward_left_it(habit, mode):
    """A flag-guarded first-call setup (registering with the parent, adding a hook) and a hook the forward
    removes must not run again, or go missing, in the replay (the flag is put back: so are the hook tables
    and the parent's list); a generator behind a bound method, an object behind a weakref.proxy and
    ``self.a.b.c += 1`` are part of the snapshot."""
    _parity(lambda: Habits(habit), mode, layers="layers")
    model = Habits(habit)
    hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
    train(model, "plain", _input)
    assert len(model.collector.layers) == (2 if habit == "lazy_registry" else 0)
    assert [len(layer.first._forward_hooks) for layer in model.layers] == [int(habit == "lazy_hook")] * 2


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_a_hook_removed_between_forward_and_backward_runs_in_the_replay(mode):
    """Register, forward, remove (a steering vector added for one forward): the replay runs with it, as
    the forward did. torch.utils.checkpoint replays without it and gives other gradients."""
    def steered(model: nn.Module) -> torch.Tensor:
        vector = torch.full((D,), 0.5)
        handles = [layer[0].register_forward_hook(lambda module, args, out: out + vector) for layer in model.layers]
        loss = _input(model)
        for handle in handles:
            handle.remove()
        return loss

    _parity(lambda: Stack([nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(2)]), mode, steered,
            layers="layers")


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_a_hook_appending_to_a_dict_of_lists_records_each_forward_once(mode):
    """``stats = defaultdict(list)``; a hook per Linear appends to ``stats[name]`` (two levels below the
    model the hook closes over)."""
    def recorded(apply: bool) -> dict[str, int]:
        torch.manual_seed(0)
        model = Stack([nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(2)])
        model.stats = collections.defaultdict(list)

        def recorder(name: str) -> Callable:
            return lambda module, args, out: model.stats[name].append(out.detach().mean())

        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                module.register_forward_hook(recorder(name))
        if apply:
            hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
        train(model, "plain", _input, steps=3)
        return {name: len(values) for name, values in model.stats.items()}

    assert recorded(apply=True) == recorded(apply=False) == {"embed": 3, "layers.0.0": 3, "layers.1.0": 3}


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_a_parameter_frozen_between_forward_and_backward_is_replayed_as_recorded(mode):
    """``requires_grad_(False)`` after the forward (a freezing schedule run from a callback): the graph was
    recorded with the parameter requiring grad; before, every mode raised (the replay saved fewer tensors)."""
    def freezing(model: nn.Module) -> torch.Tensor:
        model.requires_grad_(True)
        loss = _input(model)
        model.layers[1][0].weight.requires_grad_(False)
        return loss

    _parity(lambda: Stack([nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(2)]), mode, freezing,
            layers="layers")


class Forces(nn.Module):
    """Runs a backward in its forward: forces from an energy (interatomic potentials, PINNs)."""

    def __init__(self) -> None:
        super().__init__()
        self.energy = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            energy = torch.tanh(self.energy(x)).square().sum()
            (force,) = torch.autograd.grad(energy, x, create_graph=True)
        return x + 0.1 * force


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_a_backward_inside_a_forward_is_no_divergence(mode):
    """NOTE [A backward inside a forward]: its nodes may run in another order in the replay; before, the
    selective modes raised RecomputeMismatchError."""
    _parity(lambda: Stack([Forces() for _ in range(2)]), mode, layers="layers")


_CALLS = [0]


class GloballyBranching(nn.Module):
    """Branches on state no module holds: no replay can see it as the forward did."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _CALLS[0] += 1
        x = self.linear(x)
        return torch.relu(x) if _CALLS[0] % 2 else torch.sigmoid(x)


def test_a_replay_that_diverges_from_its_forward_raises_in_every_mode_full_included():
    """Both branches save tensors of equal metadata: torch's own check passes, the fingerprint does not."""
    for mode in RECOMPUTE_MODES:
        model = Stack([GloballyBranching() for _ in range(2)])
        hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
        loss = model(torch.randn(4, D))
        with pytest.raises(hyperac.RecomputeMismatchError, match=r"layer 'layers\.1' diverged from its forward.*"
                           r"layers=\{1: 'off'\}"):
            loss.backward()


def test_the_full_mode_error_names_the_saved_tensor_and_the_ops_that_made_it():
    model = Stack([GloballyBranching() for _ in range(2)])
    hyperac.apply(model, mode="full", backend="cpu", layers="layers")
    loss = model(torch.randn(4, D))
    with pytest.raises(hyperac.RecomputeMismatchError, match=r"at tensor \d+ of the \d+ it saved for backward: the "
                       r"forward saved the output of (Relu|Sigmoid)Backward0 \(float32 \[4, 8\]\), the recompute "
                       r"saved the output of (Relu|Sigmoid)Backward0 .*module-level global"):
        loss.backward()


class Expert(nn.Module):
    """An MoE-style layer that appends its auxiliary loss to a list its parent owns."""

    def __init__(self, losses: list) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)
        self.losses = losses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        self.losses.append(y.softmax(-1).square().mean())
        return torch.tanh(y)


class WithAuxiliaryLosses(Stack):
    def __init__(self) -> None:
        self_losses: list = []
        super().__init__([Expert(self_losses) for _ in range(3)])
        self.aux = self_losses

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.aux.clear()
        main = super().forward(x)
        return main + 0.1 * sum(self.aux)


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_an_auxiliary_loss_list_gets_one_entry_per_forward_and_exact_losses(mode):
    _parity(WithAuxiliaryLosses, mode, layers="layers")
    model = WithAuxiliaryLosses()
    hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
    model(torch.randn(4, D)).backward()
    assert len(model.aux) == 3


class ReadThenClear(Stack):
    """A parent that adds its layers' auxiliary losses, then empties the list inside its forward (the usual
    MoE pattern in hand-written models), in each of the ways Python empties one: ``clear()``,
    ``del lst[:]``, ``pop()`` until empty, a new list bound in its place (the layers reach it through
    their parent), and a dict of lists."""

    def __init__(self, form: str) -> None:
        self.form = form
        self.aux: list | dict = {"balance": [], "z": []} if form == "dict" else []
        super().__init__([Expert(self.aux) for _ in range(3)])
        if form == "dict":
            for layer in self.layers:
                layer.losses = self.aux["balance" if layer is self.layers[0] else "z"]
        if form == "rebound":
            for layer in self.layers:
                layer.losses = _Through(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        main = super().forward(x)
        form, aux = self.form, self.aux
        if form == "dict":
            loss = main + 0.1 * sum(aux["balance"]) + 0.01 * sum(aux["z"])
            for losses in aux.values():
                losses.clear()
            return loss
        loss = main + 0.1 * sum(aux)
        if form == "clear":
            aux.clear()
        elif form == "del":
            del aux[:]
        elif form == "pop":
            while aux:
                aux.pop()
        else:
            self.aux = []
        return loss


class _Through:
    """Appends to its owner's current ``aux`` list, whichever list that is now."""

    def __init__(self, owner: nn.Module) -> None:
        self.owner = (owner,)

    def append(self, value: torch.Tensor) -> None:
        self.owner[0].aux.append(value)


@pytest.mark.parametrize("form", ["clear", "del", "pop", "rebound", "dict"])
@pytest.mark.parametrize("mode", ["off", *RECOMPUTE_MODES, "swap", "auto"])
def test_a_parent_that_reads_its_auxiliary_losses_then_empties_the_list_trains_exactly(form, mode):
    torch.manual_seed(0)
    model = ReadThenClear(form)
    reference = copy.deepcopy(model)
    expected = train(reference, "plain", _input, steps=3)
    apply_mode(model, mode, _input)
    assert differences(expected, train(model, "plain", _input, steps=3)) == []
    assert not any(model.aux.values()) if form == "dict" else model.aux == []


class Hooked(Stack):
    """A forward hook on a sub-module of each layer records activations into a list."""

    def __init__(self) -> None:
        super().__init__([nn.Sequential(nn.Linear(D, D), nn.Tanh()) for _ in range(2)])
        self.seen: list = []
        for layer in self.layers:
            layer[0].register_forward_hook(lambda module, args, output: self.seen.append(output.detach().clone()))


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_a_forward_hook_recording_activations_sees_each_forward_once(mode):
    torch.manual_seed(0)
    reference = Hooked()
    torch.manual_seed(0)
    model = Hooked()
    reference(torch.ones(4, D)).backward()
    hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
    model(torch.ones(4, D)).backward()
    assert len(model.seen) == len(reference.seen) == 2
    assert all(torch.equal(a, b) for a, b in zip(model.seen, reference.seen))


# --- modules the layer runs but does not own ------------------------------------------------------------

class NormedBy(nn.Module):
    """Normalizes with a BatchNorm it is given, or holds in a plain list (not a registered child)."""

    def __init__(self, held: list) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)
        self.held = held

    def forward(self, x: torch.Tensor, norm: nn.Module | None = None) -> torch.Tensor:
        return torch.tanh((norm or self.held[0])(self.linear(x)))


class SharedNorm(nn.Module):
    """A BatchNorm the parent owns and hands to each layer as a keyword argument (or gave each layer at init)."""

    def __init__(self, passed: bool = True) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)
        self.norm = nn.BatchNorm1d(D)
        self.passed = passed
        self.layers = nn.ModuleList(NormedBy([] if passed else [self.norm]) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, norm=self.norm) if self.passed else layer(x)
        return x.square().mean()


@pytest.mark.parametrize("passed", [True, False], ids=["passed", "held"])
def test_buffers_of_a_module_the_layer_does_not_own_update_once_per_step(passed):
    for mode in RECOMPUTE_MODES:
        _parity(lambda: SharedNorm(passed), mode, layers="layers")
        model = SharedNorm(passed)
        hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
        train(model, "plain", _input)
        assert model.norm.num_batches_tracked.item() == 6


# --- the forward's context -------------------------------------------------------------------------------

class Parametrized(nn.Module):
    """Reads its parametrized weight three times (computed once under ``parametrize.cached()``)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)
        if kind == "orthogonal":
            torch.nn.utils.parametrizations.orthogonal(self.linear)
        elif kind == "weight_norm":
            torch.nn.utils.parametrizations.weight_norm(self.linear)
        else:
            torch.nn.utils.parametrizations.spectral_norm(self.linear)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.linear.weight
        y = torch.tanh(x @ w.t()) + torch.sigmoid(x @ self.linear.weight)
        return y * self.linear.weight.sum()


def _cached_loss(model: nn.Module) -> torch.Tensor:
    with parametrize.cached():
        return model(torch.randn(4, D))


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
@pytest.mark.parametrize("kind", ["orthogonal", "weight_norm", "spectral_norm"])
def test_a_replay_runs_under_the_parametrize_cache_its_forward_ran_under(kind, mode):
    _parity(lambda: Stack([Parametrized(kind) for _ in range(2)]), mode, _cached_loss, layers="layers")


class SettingsReader(nn.Module):
    """Attention whose kernel choice changes its output, and a constant made in the default dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, -1, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)
        return x + attended * (torch.full((), 0.1) ** 3).to(x.dtype)


def _settings_loss(model: nn.Module) -> torch.Tensor:
    """The forward under other process-wide settings than the backward runs under: one attention kernel, first in
    the priority order, and another default dtype."""
    kernels = [torch.nn.attention.SDPBackend.MATH]
    dtype, x = torch.get_default_dtype(), torch.randn(16, D)
    with torch.nn.attention.sdpa_kernel(kernels, set_priority=True):
        torch.set_default_dtype(torch.float64)
        try:
            return model(x)
        finally:
            torch.set_default_dtype(dtype)


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_a_replay_runs_under_the_attention_kernels_and_default_dtype_its_forward_ran_under(mode):
    x = torch.randn(1, 2, 16, D // 2)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        math = F.scaled_dot_product_attention(x, x, x)
    assert not torch.equal(math, F.scaled_dot_product_attention(x, x, x))  # the kernels differ on this machine
    before = (torch.nn.attention._cur_sdpa_kernel_backends(True), torch.get_default_dtype())
    _parity(lambda: Stack([SettingsReader() for _ in range(2)]), mode, _settings_loss, layers="layers")
    assert (torch.nn.attention._cur_sdpa_kernel_backends(True), torch.get_default_dtype()) == before


class HalfAttention(nn.Module):
    """Attention in bfloat16, where the math kernel's half-precision reductions change its output."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, -1, 3, 2, D // 2).permute(2, 0, 3, 1, 4).to(torch.bfloat16)
        return x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape).float()


def _reduced_loss(model: nn.Module) -> torch.Tensor:
    """The forward with the math kernel's half-precision reductions allowed; the backward runs without."""
    torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
    try:
        return model(torch.randn(64, D))
    finally:
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_a_replay_runs_with_the_half_precision_reductions_its_forward_ran_with(mode):
    """NOTE [The forward's context in the replay]: ``allow_fp16_bf16_reduction_math_sdp`` around the forward only."""
    x = torch.randn(1, 2, 64, D // 2, dtype=torch.bfloat16)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        plain = F.scaled_dot_product_attention(x, x, x)
        torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
        try:
            reduced = F.scaled_dot_product_attention(x, x, x)
        finally:
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(False)
        assert not torch.equal(plain, reduced)  # the switch changes the output on this machine
        _parity(lambda: Stack([HalfAttention() for _ in range(2)]), mode, _reduced_loss, layers="layers")
    assert not torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()


class SharedWeights(nn.Module):
    """One Linear run twice inside each layer (two autocast casts of one weight: the second hits the cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(self.linear(x))).float()


def _autocast_loss(model: nn.Module) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(torch.randn(4, D))


def test_an_autocast_cast_served_from_the_cache_in_forward_is_no_divergence():
    def make() -> nn.Module:
        shared = SharedWeights()
        return Stack([shared, SharedWeights(), shared])

    for mode in RECOMPUTE_MODES:
        _parity(make, mode, _autocast_loss, layers="layers")


class Conv1DLayer(nn.Module):
    """Two HF GPT-2 ``Conv1D``s: ``addmm(bias, x, weight)``, whose autocast casts come right before the matmul
    the selective modes keep (no ``t`` between them, as ``nn.Linear`` has)."""

    def __init__(self) -> None:
        super().__init__()
        self.weights = nn.ParameterList(nn.Parameter(torch.randn(D, D) / 3) for _ in range(2))
        self.biases = nn.ParameterList(nn.Parameter(torch.zeros(D)) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(torch.addmm(self.biases[0], x, self.weights[0]))
        return x + torch.addmm(self.biases[1], h, self.weights[1])


@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_autocast_casts_right_before_a_kept_op_are_no_divergence(mode):
    """The replay runs its casts of leaves untracked and skips the forward's; the skip reached the kept
    ``addmm`` and stopped there instead of matching it (RecomputeMismatchError in the selective modes)."""
    _parity(lambda: Stack([Conv1DLayer() for _ in range(2)]), mode, _autocast_loss, layers="layers")


def test_an_autocast_cast_served_from_the_cache_in_the_replay_is_no_divergence():
    """backward inside the autocast region: the replay's casts hit the cache the forward filled."""
    def step(model: nn.Module) -> torch.Tensor:
        torch.manual_seed(1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, D))
            loss.backward()
        return loss

    for mode in RECOMPUTE_MODES:
        torch.manual_seed(0)
        model = Stack([SharedWeights() for _ in range(2)])
        reference = copy.deepcopy(model)
        expected = step(reference)
        hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
        assert torch.equal(step(model), expected)
        for (name, a), b in zip(reference.named_parameters(), model.parameters()):
            assert torch.equal(a.grad, b.grad), name


# --- layers run more than once per forward ----------------------------------------------------------------

def _albert() -> nn.Module:
    from transformers import AlbertConfig, AlbertModel

    torch.manual_seed(0)
    return AlbertModel(AlbertConfig(vocab_size=64, embedding_size=16, hidden_size=32, num_hidden_layers=3,
                                    num_attention_heads=2, intermediate_size=64, max_position_embeddings=32,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _albert_loss(model: nn.Module) -> torch.Tensor:
    ids = torch.arange(24).reshape(2, 12) % 64
    return model(input_ids=ids).last_hidden_state.square().mean()


def test_auto_plans_a_model_whose_layer_runs_several_times_per_forward():
    model = _albert()
    reference = copy.deepcopy(model)
    plan = hyperac.apply(model, mode="auto", backend="cpu", budget="1GiB", sample=_albert_loss)
    assert len(plan.layers) == 1
    assert differences(train(reference, "plain", _albert_loss), train(model, "plain", _albert_loss)) == []


# --- a saved tensor read twice in one backward ------------------------------------------------------------

class OutputSavingWrite(nn.Module):
    """An in-place op that saves its output, on a view of an intermediate (issue 26's class 7)."""

    def __init__(self, write: str) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)
        self.write = write

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = (self.linear(x) * 2).reshape(2, 2, D)
        if self.write == "sigmoid_":
            y.transpose(1, 2)[:, 0].sigmoid_()
        else:
            nn.ReLU(inplace=True)(y[..., : D // 2])
        return torch.sigmoid(y).reshape(4, D)


@pytest.mark.parametrize("write", ["sigmoid_", "relu_"])
@pytest.mark.parametrize("mode, options", [
    *((mode, {}) for mode in RECOMPUTE_MODES),
    ("full", {"swap_inputs": True, "backend": "sim"}),
    ("selective", {"swap_selective_outputs": True, "backend": "sim"}),
])
def test_a_gradient_penalty_through_an_in_place_op_on_a_view_that_saves_its_output(mode, options, write):
    """The second backward reads the op's saved output twice (NOTE [A saved tensor read twice in one
    backward]); before, torch's "Unpack is being triggered ... already unpacked once" in every mode."""
    _parity(lambda: Stack([OutputSavingWrite(write) for _ in range(2)]), mode, backward="create_graph",
            layers="layers", **options)


class Rereading(nn.Module):
    def __init__(self, reads: int) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)
        self.scale = nn.Parameter(torch.rand(D))
        self.reads = reads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x)
        return torch.tanh(ReadsTwice.apply(y, self.scale.expand_as(y), self.reads))


@pytest.mark.parametrize("backward", ["plain", "create_graph"])
@pytest.mark.parametrize("mode", RECOMPUTE_MODES)
def test_an_autograd_function_that_reads_its_saved_tensors_twice(mode, backward):
    _parity(lambda: Stack([Rereading(2), Rereading(2)]), mode, backward=backward, layers="layers")


def _backward_flops(reads: tuple[int, int], applied: bool) -> int:
    torch.manual_seed(0)
    model = Stack([Rereading(n) for n in reads])
    if applied:
        hyperac.apply(model, mode="full", backend="cpu", layers="layers")
    loss = _input(model)
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops()


def test_a_second_read_costs_one_more_replay_of_that_layer_only():
    """Proven by FLOPs in full recompute: each layer replays once per backward; a layer read twice
    replays twice, the other layer still once."""
    replay_both = _backward_flops((1, 1), True) - _backward_flops((1, 1), False)
    assert replay_both > 0
    assert _backward_flops((2, 1), True) - _backward_flops((2, 1), False) == 3 * replay_both // 2


def _replayed_bytes_held(frames: list) -> int:
    return sum(value.nbytes for frame in frames for values in frame.recomputed.values() for value in values.values())


@pytest.mark.parametrize("reads", [1, 2])
def test_a_second_read_holds_no_replayed_value_after_its_backward(reads):
    """A ``retain_graph`` backward keeps every saved tensor alive; the values of the second replay
    that the backward read already are let go, so no replayed value outlives the backward."""
    def frames() -> list:
        return [obj for obj in gc.get_objects() if type(obj) is torch_recompute._CheckpointFrame]

    before = frames()  # held, so that no new frame takes an old one's id
    torch.manual_seed(0)
    model = Stack([Rereading(reads), Rereading(1)])
    hyperac.apply(model, mode="full", backend="cpu", layers="layers")
    loss = _input(model)
    loss.backward(retain_graph=True)  # the graph, and so each saved tensor, lives as long as loss
    new = [frame for frame in frames() if not any(frame is old for old in before)]
    assert len(new) == 2
    assert _replayed_bytes_held(new) == 0


def test_the_readme_stateful_forward_is_exact_in_full():
    _parity(lambda: nn.Sequential(nn.Linear(D, D), nn.Sequential(Branching(), Branching(), Branching()),
                                  _SquareMean()), "full")


class _SquareMean(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(x, torch.zeros_like(x))

