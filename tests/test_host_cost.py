"""What keeps a recomputed region's host cost down stays exact (issue 33): the region's hook pair doing
checkpoint's own hooks' work (NOTE [Checkpoint's hooks in the region's pair] in replay/region_saves.py), the
snapshot's comparisons by dict version (NOTE [Dict versions] in replay/python_state.py), and ``full`` layers
reading only the routing ops. Each with its fallback where a probe fails."""

from __future__ import annotations

import collections
import contextlib
import copy
import functools
import random
import sys

import pytest
import torch
from program_fuzzer import differences, train
from test_replay_divergence import Counting, D, Rereading, Stack, _input
from torch import nn
from torch.utils import checkpoint as torch_recompute

import hyperac
import hyperac.recompute
from hyperac import _compat, lifecycle, policy
from hyperac.replay import python_state, region_saves, replay_context

_CHECKPOINT_PACKS = {"pack_hook", "unpack_hook"}


def _checkpoint_hook_calls(step) -> int:
    """How many times ``step()`` enters checkpoint's own pack or unpack hooks (torch/utils/checkpoint.py)."""
    calls = [0]
    source = torch_recompute.__file__

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name in _CHECKPOINT_PACKS and frame.f_code.co_filename == source:
            calls[0] += 1

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return calls[0]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return Stack([Rereading(1), Rereading(1)])


def _step(model: nn.Module) -> None:
    model.zero_grad(set_to_none=True)
    _input(model).backward()


def test_after_its_first_forward_a_full_region_goes_through_checkpoints_hooks_only_to_replay():
    """Each saved tensor is held, filed and handed out by the region's pair: checkpoint's hooks run for the
    first read of each region in a backward (which replays), not per saved tensor."""
    model = _model()
    hyperac.apply(model, mode="full", backend="cpu", layers="layers")
    first = _checkpoint_hook_calls(lambda: _step(model))  # the freed-saves watch: checkpoint's pack below it
    later = _checkpoint_hook_calls(lambda: _step(model))
    assert later == 2  # one unpack per region: the read that replays it
    assert first > 4 * later


def _exact(backward: str = "plain") -> None:
    """Three SGD steps (the last two through the pair doing checkpoint's work) equal the un-applied ones."""
    reference = _model()
    model = copy.deepcopy(reference)
    expected = train(reference, backward, _input, steps=3)
    hyperac.apply(model, mode="full", backend="cpu", layers="layers")
    assert differences(expected, train(model, backward, _input, steps=3)) == []


@pytest.mark.parametrize("backward", ["plain", "retain_graph", "create_graph"])
def test_the_pair_that_does_checkpoints_work_is_exact_over_steps_and_second_backwards(backward):
    _exact(backward)


_FLAG = [True]


class Flagged(nn.Module):
    """Takes the other side of an ``if`` when a global flag changes between its forward and its replay."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return torch.relu(x) if _FLAG[0] else torch.sigmoid(x)


def test_a_replay_that_diverges_after_the_first_step_is_caught():
    """The fingerprint still compares every saved tensor where checkpoint's own check is off."""
    model = Stack([Flagged(), Flagged()])
    hyperac.apply(model, mode="full", backend="cpu", layers="layers")
    _step(model)
    loss = _input(model)
    _FLAG[0] = False
    try:
        with pytest.raises(hyperac.RecomputeMismatchError, match=r"layer 'layers\.1' diverged from its forward"):
            loss.backward()
    finally:
        _FLAG[0] = True


def test_without_early_stop_the_pair_is_exact():
    with torch_recompute.set_checkpoint_early_stop(False):
        _exact()


@pytest.fixture
def probe_fails(monkeypatch):
    monkeypatch.setattr(region_saves, "_CODES", None)
    yield region_saves.probe_checkpoint_hooks(again=True)
    monkeypatch.undo()
    assert region_saves.probe_checkpoint_hooks(again=True) is None


def test_where_the_probe_fails_regions_call_checkpoints_hooks_as_before(probe_fails):
    assert probe_fails == "torch.utils.checkpoint's hooks are not built as hyperac expects"
    model = _model()
    hyperac.apply(model, mode="full", backend="cpu", layers="layers")
    _step(model)
    assert _checkpoint_hook_calls(lambda: _step(model)) > 8
    _exact()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_where_the_probe_fails_an_input_written_after_the_layer_returned_raises_hyperacs_error(probe_fails, mode):
    """The region's unpack checks its inputs before checkpoint's replays (NOTE [Inputs written in place]), on the
    path that calls checkpoint's hooks too."""
    from test_ordinary_programs import test_input_written_in_place_raises_naming_the_layer_and_the_fix as written

    written(mode, "after the layer returned")


# --- the snapshot's comparisons by dict version --------------------------------------------------------------

class Restless(Counting):
    """Counts its calls and reads an optional attribute as a value; branches on the count."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = self.linear(x) * (1 + getattr(self, "extra", 0))
        return torch.tanh(x) if self.calls % 2 else torch.sigmoid(x)


_CHANGES = {
    "added": lambda layer: setattr(layer, "extra", layer.calls),  # a new key (rebound on later steps)
    "rebound": lambda layer: setattr(layer, "calls", layer.calls + 100),  # one key, another object
    "deleted": lambda layer: delattr(layer, "calls"),  # the replay must see it as the forward did
    "hook": lambda layer: layer.register_forward_hook(lambda module, args, out: out * 3),
    "frozen": lambda layer: layer.linear.weight.requires_grad_(False),
}


def _restless_training(apply: bool, change: str) -> list:
    """Three steps; between each forward and its backward every layer's state changes (``change``); between
    the second and the third a sub-module is swapped."""
    torch.manual_seed(0)
    model = Stack([Restless(), Restless()])
    if apply:
        hyperac.apply(model, mode="full", backend="cpu", layers="layers")
    record = []
    for step in range(3):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(step)
        loss = _input(model)
        for layer in model.layers:
            _CHANGES[change](layer)
        loss.backward()
        record.append(("loss", loss.detach()))
        record += [(name, parameter.grad.clone()) for name, parameter in model.named_parameters()
                   if parameter.grad is not None]
        for layer in model.layers:
            layer.linear.weight.requires_grad_(True)
            layer._forward_hooks.clear()
            layer.calls = getattr(layer, "calls", 0)
        if step == 1:
            swapped = nn.Linear(D, D)
            swapped.load_state_dict(model.layers[1].linear.state_dict())
            model.layers[0].linear = swapped
    return record


@pytest.mark.parametrize("change", list(_CHANGES))
@pytest.mark.parametrize("versions", [True, False])
def test_state_changed_between_forward_and_backward_is_seen_by_the_replay_as_the_forward_saw_it(
        versions, change, monkeypatch):
    """Each write between a forward and its replay moves a version (or, without versions, is compared): the
    replay sees the forward's state, and a sub-module swapped between steps is the one the next step runs."""
    if not versions:
        monkeypatch.setattr(python_state, "_VERSION_AT", None)
    assert differences(_restless_training(False, change), _restless_training(True, change)) == []


def test_dict_versions_are_found_on_this_python():
    assert python_state._VERSION_AT is not None
    state = {"a": 1}
    before = python_state._version(state)
    state["a"] = 2
    assert python_state._version(state) != before


def test_the_global_generators_are_read_as_bytes_on_this_python_and_numpy_and_read_their_state_exactly():
    """NOTE [Generators read as bytes]: the byte views are in use here (the probes passed), what they read is
    the state API's state after plain and Gaussian draws, and a put back of it gives the same draws again."""
    numpy = pytest.importorskip("numpy")
    if sys.implementation.name != "cpython":
        pytest.skip("the byte layouts are CPython's (elsewhere the state APIs are read)")

    def plain(state: tuple) -> tuple:  # a numpy state's key as a tuple, to compare by value
        return tuple(item.tolist() if isinstance(item, numpy.ndarray) else item for item in state)

    for generator, draw, read, expected in (
            (random.Random(3), lambda g: (g.random(), g.gauss(0, 1)), lambda value: value.python_state(),
             lambda g: g.getstate()),
            (numpy.random.RandomState(3), lambda g: (g.rand(), g.standard_normal()),
             lambda value: plain(value.numpy_state()), lambda g: plain(g.get_state())),
    ):
        entry = python_state._Generator(generator)
        assert entry.words is not None
        for _ in range(3):
            draw(generator)  # leaves a cached Gaussian (numpy) or gauss_next (Python) every second time
            assert read(entry.now()) == expected(generator)
            kept = entry.now()
            assert entry.holds(kept)
            drawn = draw(generator)
            assert not entry.holds(kept)
            entry.put(kept)
            assert entry.holds(kept) and draw(generator) == drawn


_SETTING_CHANGES = {
    "deterministic": lambda: torch.use_deterministic_algorithms(True),
    "warn only": lambda: torch.use_deterministic_algorithms(True, warn_only=True),
    "one kernel": lambda: torch.nn.attention._sdpa_kernel([torch.nn.attention.SDPBackend.MATH]),
    "priority": lambda: torch._C._set_sdp_priority_order(list(reversed(torch._C._get_sdp_priority_order()))),
    "dtype": lambda: torch.set_default_dtype(torch.float64),
    "uninitialized memory left unfilled": lambda: torch._C._set_deterministic_fill_uninitialized_memory(False),
    "math kernel's half-precision reductions": lambda: torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True),
    **{f"{name} kernel": functools.partial(getattr(torch._C, f"_set_sdp_use_{name}"), False)
       for name in torch.nn.attention._backend_names},
}


@pytest.mark.parametrize("read_as_memory", [True, False])
@pytest.mark.parametrize("change", sorted(_SETTING_CHANGES))
def test_a_replay_runs_under_each_torch_setting_its_forward_ran_under_and_leaves_the_one_it_found(
        monkeypatch, change, read_as_memory):
    """NOTE [Torch's flags read as memory]: read as words on this torch (the probe passed), each setting changed
    between a forward and its replay is set back for the replay and left as found after it; the same through
    the getters."""
    if not read_as_memory:
        monkeypatch.setattr(replay_context, "_WORDS", None)
    elif not sys.platform.startswith("linux"):
        pytest.skip("the flags are read as memory on Linux only (elsewhere through their getters)")
    else:
        assert replay_context._WORDS is not None

    def now() -> tuple:
        return (torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled(),
                torch.is_deterministic_algorithms_warn_only_enabled(),
                torch.utils.deterministic.fill_uninitialized_memory,
                torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed(),
                torch.nn.attention._cur_sdpa_kernel_backends(True))

    forward = now()
    context = replay_context.ForwardContext()
    try:
        _SETTING_CHANGES[change]()
        found = now()
        assert found != forward
        with context:
            assert now() == forward
        assert now() == found
    finally:
        replay_context._apply(context.settings)
    assert now() == forward


def test_the_module_tree_is_modules_in_its_order():
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.Sequential(nn.ReLU(), shared, None or nn.Identity()), shared)
    assert python_state.module_tree(model) == list(model.modules())


# --- routing ops only ---------------------------------------------------------------------------------------

def test_a_full_apply_resolves_no_op_sets_per_layer(monkeypatch):
    """All-``full`` plans read the routing ops, resolved once per process, not every op set per layer."""
    calls = []
    monkeypatch.setattr(hyperac.recompute, "resolve_op_sets", lambda *args, **kwargs: calls.append(args))
    model = _model()
    hyperac.apply(model, mode="full", backend="cpu", layers="layers")
    _step(model)
    _step(model)
    assert calls == []


# --- the selective modes' work per op -----------------------------------------------------------------------

class _Pointwise(nn.Module):
    """Only ops on what autograd tracks, none of them kept: the selective modes' common path."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.scale).sin().cos()


def test_an_ordinary_op_costs_the_selective_modes_one_python_call():
    """NOTE [Per op, not per call] in policy.py: for an op on what autograd tracks, the recording and the replay
    modes' ``__torch_dispatch__`` calls one Python function, :meth:`HookOps.owns`, which calls none (no generator,
    no look up the stack), and runs the op without ``OpOverload.__call__`` where that only forwards to the op's
    builtin (torch 2.13; 2.15's does more, and is called); what depends on the op alone was read when it was
    first seen."""
    torch.manual_seed(0)
    model = Stack([_Pointwise(), _Pointwise()])
    hyperac.apply(model, mode="selective", backend="cpu", layers="layers")
    _step(model)  # the ops first seen
    modes = {policy._RecordingMode.__torch_dispatch__.__code__: "record",
             policy._ReplayMode.__torch_dispatch__.__code__: "replay"}
    owns = lifecycle.HookOps.owns.__code__
    calls: collections.Counter = collections.Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        if frame.f_code in modes:
            calls[modes[frame.f_code]] += 1
        elif frame.f_back is not None and (frame.f_back.f_code in modes or frame.f_back.f_code is owns):
            calls[(frame.f_back.f_code.co_name, frame.f_code.co_name)] += 1

    sys.setprofile(profile)
    try:
        _step(model)
    finally:
        sys.setprofile(None)
    assert calls["record"] >= 6 and calls["replay"] >= 6, calls  # 3 ops per layer, 2 layers, each way
    overload = set() if policy.calls_op_directly() else {("__torch_dispatch__", "__call__")}  # 2.15: the fallback
    assert set(calls) == {"record", "replay", ("__torch_dispatch__", "owns")} | overload, calls
    assert calls["__torch_dispatch__", "owns"] <= calls["record"] + calls["replay"]


def test_where_an_op_overload_does_more_than_call_its_op_the_modes_call_the_overload(monkeypatch):
    """The modes run an overload's ``_op`` only where ``OpOverload.__call__`` does nothing else (NOTE [Per op, not
    per call] in policy.py); where it does more (a later torch, a patch), they call the overload, and train the
    same."""
    torch.manual_seed(0)
    base = Stack([_Pointwise(), Counting()])
    expected = train(copy.deepcopy(base), "plain", _input, steps=3)  # un-applied
    seen = collections.Counter()
    plain = torch._ops.OpOverload.__call__
    direct = policy.calls_op_directly()  # torch 2.13: True; 2.15's __call__ does more, so False there too

    def call(self, /, *args, **kwargs):
        seen[self] += 1
        return self._op(*args, **kwargs)

    monkeypatch.setattr(torch._ops.OpOverload, "__call__", call)
    assert not policy.calls_op_directly()
    assert _compat._probe_op_call() is None  # the overload itself is called: nothing private to probe
    model = copy.deepcopy(base)
    hyperac.apply(model, mode="selective", backend="cpu", layers="layers")
    assert differences(expected, train(model, "plain", _input, steps=3)) == []
    assert seen[torch.ops.aten.sin.default] >= 3 * 2  # forward and replay, each step
    monkeypatch.setattr(torch._ops.OpOverload, "__call__", plain)
    assert policy.calls_op_directly() == direct and _compat._probe_op_call() is None


# --- what a replay enters ------------------------------------------------------------------------------------

class _Logged:
    def __init__(self, name: str, log: list, fails: bool = False) -> None:
        self.name, self.log, self.fails = name, log, fails

    def __enter__(self) -> None:
        self.log.append(("enter", self.name, hyperac.policy.bypass_replay.get()))
        if self.fails:
            raise ValueError(self.name)

    def __exit__(self, *exc) -> None:
        self.log.append(("exit", self.name, None if exc[0] is None else exc[0].__name__))


@pytest.mark.parametrize("failing", [None, "state", "context", "buffers", "body"])
def test_a_replays_contexts_are_entered_in_order_and_left_in_reverse_as_an_exit_stack_would(failing):
    """``_AsInForward`` against ``contextlib.ExitStack`` over the same three contexts: the same calls in the same
    order, the bypass of buffer copies set while entering only, and the same exception out."""
    logs = []
    for stacked in (False, True):
        log: list = []
        contexts = [_Logged(name, log, failing == name) for name in ("state", "context", "buffers")]
        try:
            if stacked:
                with contextlib.ExitStack() as stack:
                    token = hyperac.policy.bypass_replay.set(True)
                    try:
                        for context in contexts:
                            stack.enter_context(context)
                    finally:
                        hyperac.policy.bypass_replay.reset(token)
                    if failing == "body":
                        raise ValueError("body")
            else:
                with hyperac.recompute._AsInForward(*contexts):
                    if failing == "body":
                        raise ValueError("body")
        except ValueError as error:
            log.append(("raised", str(error), None))
        logs.append(log)
    assert logs[0] == logs[1]
