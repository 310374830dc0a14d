"""A snapshot taken again (NOTE [A snapshot taken again] in replay/python_state.py) is the snapshot a new walk
would take, and a replay that starts from it sees the forward's state and leaves the state it found.

Random sequences of writes (hypothesis, shrinking to a minimal one) between two invocations of a module that
reaches lists, dicts, sets, deques, plain objects two and three levels down, a module held in a list and in a
namespace, a tuple's object, generators, forward hooks and their closures, global hooks and requires_grad
flags: what ``Snapshots.take`` returns equals a fresh ``PythonState`` entry by entry, value by value
(by identity, generators by state); and a replay entered after more writes sees the snapshot's state and
leaves what it found. Plus the training-level check: gradients equal the un-applied model's when such writes
happen between steps and between a forward and its backward."""

from __future__ import annotations

import collections
import functools
import random
import types
import weakref
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import hyperac
from hyperac.replay import python_state
from hyperac.replay.python_state import PythonState, Snapshots, module_tree


class Plain:
    pass


class Slotted:
    __slots__ = ("a",)


class Reaching(nn.Module):
    """A module whose forward reads what it reaches (so a replay would see other values if the state it
    starts from were not the forward's) and appends to a list its parent reads."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.norm = nn.LayerNorm(4)
        self.stats: list[Any] = []
        self.table: dict[str, Any] = {"a": [], "scale": 1.0}
        self.box = Plain()
        self.box.inner = Plain()
        self.box.inner.count = 0
        self.box.items = [1]
        self.shared = [nn.Linear(4, 4)]
        self.ns = types.SimpleNamespace(mods=[], deep=Plain())
        self.ns.deep.sub = Plain()  # looked through for modules, not snapshotted: three levels down
        self.ns.deep.more: list[Any] = []  # the same, a list
        self.rng = random.Random(0)
        self.tags: set[Any] = set()
        self.queue: collections.deque = collections.deque()
        self.pair = (Plain(),)
        self.pair[0].value = 0.5
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.table["scale"] + self.box.inner.count + len(self.stats) + self.pair[0].value
        x = self.norm(self.linear(x)) * scale
        for module in self.shared + self.ns.mods:
            x = x + module(x)
        self.stats.append(float(len(self.queue)))
        return x * (1.0 + self.rng.random()) if self.tags else x


def _hook(count: list[int]) -> Any:
    calls = 0

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        count.append(calls)
        return output * 1.5

    return hook


def _write(layer: Reaching, kind: int, pick: int) -> None:
    """One write of the kind a training loop, a callback or another layer makes between invocations."""
    lists = [layer.stats, layer.table["a"], layer.box.items, layer.shared, layer.ns.mods]
    target = lists[pick % len(lists)]
    if kind == 0:
        layer.calls += 1
    elif kind == 1:
        target.append(nn.Linear(4, 4) if target is layer.shared or target is layer.ns.mods else pick)
    elif kind == 2 and target:
        target.pop()
    elif kind == 3:
        target.clear()
    elif kind == 4:
        layer.table["scale"] = float(pick % 3)
    elif kind == 5:
        layer.table.pop("extra", None) if pick % 2 else layer.table.update(extra=[pick])
    elif kind == 6:
        layer.box.inner.count = pick % 4
    elif kind == 7:
        layer.ns.deep.module = nn.Linear(4, 4)  # three levels down: a module the walk finds
    elif kind == 8:
        layer.linear = nn.Linear(4, 4)
    elif kind == 9:
        layer.add_module(f"extra{pick % 2}", nn.Identity())
    elif kind == 10:
        layer.register_forward_hook(_hook([]))
    elif kind == 11:
        layer._forward_hooks.clear()
    elif kind == 12:
        layer.norm.weight.requires_grad_(not layer.norm.weight.requires_grad)
    elif kind == 13:
        layer.rng.random()
    elif kind == 14:
        random.random()
    elif kind == 15:
        layer.tags.add(pick % 3)
    elif kind == 16:
        layer.queue.append(pick)
    elif kind == 17:
        layer.box.__dict__ = dict(layer.box.__dict__)  # the same attributes in another dict, then written
        layer.box.flag = pick
    elif kind == 18:
        layer.pair[0].value = float(pick % 2)
    elif kind == 19:
        layer.box.inner = types.SimpleNamespace(count=pick % 3) if pick % 2 else layer.box.inner
    elif kind == 20:
        layer.table["a"] = layer.table["a"]  # the same object again: a version moves, nothing changes
    elif kind == 21:
        layer.slotted = Slotted()
    elif kind == 22:
        OUTSIDE.append(Plain())
        layer.proxy = weakref.proxy(OUTSIDE[-1])
    elif kind == 23 and layer.shared:
        layer.ns.mods.append(layer.shared[0])
    elif kind == 24:
        layer.ns.deep.value = pick
    elif kind == 25:
        layer.linear.weight = nn.Parameter(layer.linear.weight.detach().clone())
    elif kind == 26:
        layer.ns.deep.sub.module = nn.Linear(4, 4)
    elif kind == 27:
        GLOBAL_HOOKS.append(nn.modules.module.register_module_forward_hook(_hook([])))
    elif kind == 28:
        OUTSIDE.clear()  # what a weak proxy points at dies
    elif kind == 29:
        layer.ns.deep.more.append(nn.Linear(4, 4))
    elif kind == 30:
        layer.call = functools.partial(print, sink=[])
    elif kind == 31 and "call" in vars(layer):
        layer.call.keywords["sink"] = [pick]  # a partial's keywords, written in place
    elif kind == 32:
        layer.register_forward_pre_hook(lambda module, args: None)
    elif kind == 33:
        layer.ns.deep.slotted = Slotted()
    elif kind == 34 and hasattr(layer.ns.deep, "slotted"):
        layer.ns.deep.slotted.a = nn.Linear(4, 4)  # a module in a slot, two levels down


OUTSIDE: list[Any] = []
"""What a weak proxy of a module points at, held by nothing the snapshot reaches."""


GLOBAL_HOOKS: list[Any] = []
"""Handles of hooks registered for every module by a write, removed after each test (_no_global_hooks)."""


@pytest.fixture(autouse=True)
def _no_global_hooks():
    yield
    while GLOBAL_HOOKS:
        GLOBAL_HOOKS.pop().remove()
    OUTSIDE.clear()


KINDS = 35
WRITES = st.lists(st.tuples(st.integers(0, KINDS - 1), st.integers(0, 9)), max_size=6)


def _plainly(value: Any) -> Any:
    """A snapshot value in a form compared by identity (generators by state)."""
    if type(value) is dict:
        return tuple((key, ("@", id(item))) for key, item in value.items())
    if type(value) in (list, tuple, collections.deque):
        return tuple(("@", id(item)) for item in value)
    if type(value) is set:
        return frozenset(("@", id(item)) for item in value)
    if isinstance(value, bytes):
        return bytes(value)
    if type(value).__name__ == "_TwisterState":
        return value.words, value.gauss_next
    return "@", id(value)


def _view(state: PythonState) -> tuple:
    """Each entry's kind, target and values, and the borrowed modules: what a snapshot is."""
    entries = []
    for entry in state.entries:
        values = entry.values
        if type(entry).__name__ == "_Module":
            attributes, flags, hooks, _ = values
            values = (_plainly(attributes), flags, tuple(("@", id(parameter)) for parameter in entry.parameters),
                      tuple((table, ("@", key), ("@", id(hook)), marks) for table, key, hook, marks in hooks))
        else:
            values = _plainly(values)
        entries.append((type(entry).__name__, ("@", id(entry.target)), values))
    return tuple(entries), tuple(("@", id(module)) for module in state.borrowed)


def _fresh(layer: nn.Module) -> PythonState:
    return PythonState(module_tree(layer), (), {})


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(before=WRITES, between=WRITES)
def test_a_snapshot_taken_again_is_the_one_a_new_walk_takes(before, between):
    torch.manual_seed(0)
    layer = Reaching()
    for kind, pick in before:
        _write(layer, kind, pick)
    snapshots = Snapshots()
    first = snapshots.take(layer, (), {})
    for kind, pick in between:
        _write(layer, kind, pick)
    again = snapshots.take(layer, (), {})
    assert _view(again) == _view(_fresh(layer))
    if not between and not {kind for kind, _ in before} & {21, 22, 30, 33}:  # nothing written: not walked anew
        assert again.witness is first.witness


@pytest.mark.parametrize("kind", range(KINDS))
@pytest.mark.parametrize("pick", [0, 1])
def test_each_write_alone_is_seen(kind, pick):
    """Each kind of write alone between two invocations (after the write it needs, where it needs one)."""
    before = {28: [(22, 0)], 31: [(30, 0)], 34: [(33, 0)]}.get(kind, [])
    test_a_snapshot_taken_again_is_the_one_a_new_walk_takes.hypothesis.inner_test(before=before, between=[(kind, pick)])


def _replayed(before: list, forward: list, between: list, witnessed: bool) -> tuple:
    """What a replay of a snapshot taken again sees and leaves behind, with its witness or without (each entry
    compared and put back, as before snapshots were taken again); ids numbered in order of appearance."""
    torch.manual_seed(0)
    random.seed(0)
    layer = Reaching()
    snapshots = Snapshots()
    try:
        snapshots.take(layer, (), {})  # an earlier invocation
        for kind, pick in before:
            _write(layer, kind, pick)
        taken = snapshots.take(layer, (), {})
        if not witnessed:
            taken.witness = None
        for kind, pick in forward + between:
            _write(layer, kind, pick)
        states = [PythonState(module_tree(layer), (), {})]  # held: no id of the views is reused
        with taken:
            states.append(_fresh(layer))
            for kind, pick in forward:  # the replay writes what the forward wrote
                _write(layer, kind, pick)
        states.append(_fresh(layer))
        return _numbered((_view(states[1]), _view(states[2])), {})
    finally:
        while GLOBAL_HOOKS:
            GLOBAL_HOOKS.pop().remove()
        OUTSIDE.clear()


def _numbered(value: Any, numbers: dict[int, int]) -> Any:
    if type(value) is tuple and len(value) == 2 and value[0] == "@":
        return "@", numbers.setdefault(value[1], len(numbers))
    if type(value) in (tuple, frozenset):
        return type(value)(_numbered(item, numbers) for item in value)
    return value


@settings(max_examples=300, derandomize=True, deadline=None, database=None)
@given(before=WRITES, forward=WRITES, between=WRITES)
def test_a_replay_of_a_snapshot_taken_again_starts_and_ends_as_one_compared_entry_by_entry(before, forward, between):
    """``forward``: what the invocation's forward writes (again in its replay); ``between``: what is written
    before its replay. The witness's shortcut (nothing put back where it holds) changes nothing."""
    assert _replayed(before, forward, between, True) == _replayed(before, forward, between, False)


def test_objects_no_witness_vouches_for_are_walked_at_each_invocation():
    layer = Reaching()
    layer.proxy = weakref.proxy(layer.box)
    layer.slotted = Slotted()
    layer.call = functools.partial(print, sep="")
    snapshots = Snapshots()
    assert snapshots.take(layer, (), {}).witness is None
    assert snapshots.kept is None  # nothing kept: the next invocation walks anew


def test_without_dict_versions_every_invocation_walks(monkeypatch):
    monkeypatch.setattr(python_state, "_VERSION_AT", None)
    layer = Reaching()
    snapshots = Snapshots()
    assert snapshots.take(layer, (), {}).witness is None
    assert snapshots.kept is None


@pytest.mark.parametrize("count", [0, 1, 2, 5])
def test_a_witness_of_any_number_of_dicts_seals_holds_and_sees_each_written(count):
    """One dict is one word read (memory.reader reads it twice): a witness of it seals and holds as one of many."""
    tables = [{"key": index} for index in range(count)]
    witness = python_state._Witness()
    for table in tables:
        witness.stamp(table)
    assert witness.seal() and witness.holds(None)
    for table in tables:
        table["key"] = -1
        assert not witness.holds(None)
        table["key"] = object()
        assert not witness.holds(None)


def test_other_non_tensor_arguments_walk_anew():
    layer = Reaching()
    snapshots = Snapshots()
    config = Plain()
    first = snapshots.take(layer, (), {"config": config})
    assert snapshots.take(layer, (), {"config": config}).witness is first.witness
    assert snapshots.take(layer, (), {"config": Plain()}).witness is not first.witness


def test_snapshots_travel_empty():
    import copy
    import pickle

    layer = Reaching()
    snapshots = Snapshots()
    snapshots.take(layer, (), {})
    assert snapshots.kept is not None and copy.deepcopy(snapshots).kept is None
    assert pickle.loads(pickle.dumps(snapshots)).kept is None


class Parent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Reaching(), Reaching()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        reads = sum(len(layer.stats) for layer in self.layers)
        for layer in self.layers:
            layer.stats.clear()  # read, then cleared: the usual auxiliary-loss pattern
        return x.sum() * (1 + reads)


@pytest.mark.parametrize("mode", ["full", "selective"])
@settings(max_examples=12, derandomize=True, deadline=None, database=None)
@given(writes=st.lists(st.tuples(st.integers(0, 2), st.integers(0, KINDS - 1), st.integers(0, 9)), max_size=8))
def test_training_with_writes_between_steps_and_before_backward_matches_the_unapplied_model(mode, writes):
    """``(when, kind, pick)``: a write before a step's forward (0), between its forward and backward (1), or
    after its backward (2), to one of the layers, over three steps; gradients and the state left equal the
    un-applied model's."""
    writes = [write for write in writes if write[1] not in (27, 28)]  # global: would outlive the first run
    results = []
    for applied in (False, True):
        torch.manual_seed(0)
        random.seed(0)
        model = Parent()
        if applied:
            hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
        record = []
        x = torch.randn(2, 4)
        for step in range(3):
            model.zero_grad(set_to_none=True)
            for when, kind, pick in writes:
                if when == 0 and kind not in (8, 9, 10, 11, 17, 21, 22):
                    _write(model.layers[pick % 2], kind, pick + step)
            loss = model(x)
            for when, kind, pick in writes:
                if when == 1 and kind not in (8, 9, 10, 11, 12, 17, 21, 22, 25, 26):
                    _write(model.layers[pick % 2], kind, pick + step)
            loss.backward()
            record.append(loss.detach())
            record += [p.grad.clone() if p.grad is not None else None for p in model.parameters()]
            for when, kind, pick in writes:
                if when == 2:
                    _write(model.layers[pick % 2], kind, pick + step)
        record += [layer.calls for layer in model.layers] + [len(layer.stats) for layer in model.layers]
        results.append(record)
    expected, actual = results
    assert len(expected) == len(actual)
    for a, b in zip(expected, actual):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b)
        else:
            assert a == b


@pytest.mark.parametrize("mode", ["full", "selective", "pointwise"])
def test_layers_whose_state_stays_walk_once(mode, monkeypatch):
    """Two layers, three steps, no writes but the parent's read-then-clear of its layers' lists: each layer
    walks what it reaches once, and every later invocation takes that snapshot again."""
    walks = []
    init = PythonState.__init__

    def counted(self, *args, **kwargs):
        walks.append(args[0][0])
        init(self, *args, **kwargs)

    monkeypatch.setattr(PythonState, "__init__", counted)
    torch.manual_seed(0)
    model = Parent()
    hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        model(torch.randn(2, 4)).backward()
    assert walks == list(model.layers)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_dropped_model_is_freed_without_the_garbage_collector(mode):
    """The snapshots a layer keeps for its next invocation hold no reference to the layer (which holds them): a
    model of plain modules (its layers holding lists, plain objects, a module in a list), trained two steps and
    dropped, is freed by reference counting alone."""
    import gc

    torch.manual_seed(0)
    model = Parent()
    hyperac.apply(model, mode=mode, backend="cpu", layers="layers")
    for _ in range(2):
        model(torch.randn(2, 4)).backward()
    assert all(vars(layer)["forward"].snapshots.kept is not None for layer in model.layers)  # kept snapshots
    refs = [weakref.ref(module) for module in model.modules()]
    enabled = gc.isenabled()
    gc.disable()
    try:
        del model
        assert [ref() for ref in refs] == [None] * len(refs)
    finally:
        if enabled:
            gc.enable()
