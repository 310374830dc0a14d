"""Run one training step per uniform mode and record what each layer costs in it.

Per mode, one step runs under :class:`_Profiler`, a dispatch mode that attributes every op to the
layer running it (through forward hooks on the profiled model's own modules, removed afterwards:
nothing global) and records a :class:`~hyperac.measure.StorageTimeline`, the FLOPs, the bytes each
op moves and the op counts. On real tensors, further steps then run without the profiler, timed
at the layers' boundaries (:class:`_Clock`), since a dispatch mode slows every op it sees, in
interleaved rounds (NOTE [Timing on a drifting host]).

NOTE [Peak phases]
The step's peak is predicted for any mix of per-layer modes from uniform-mode profiles. At each op
the live activation bytes split into the kept bytes of the layers that are "behind" the op (in
forward, the layers whose forward has finished; in backward, the layers whose backward has not
started yet, i.e. those below the layer running) and a residual: what the running layer holds
(its own saved tensors, the transient of its recompute, the activation gradients alive then) or,
outside the layers, the embeddings, logits and loss. Per layer and mode the profile keeps the
largest forward and backward residual, and outside the layers the largest residual per count of
layers behind; the cost model adds them to the kept bytes of the layers behind under the plan's
own modes (``Estimate.peak_bytes`` in cost.py).

NOTE [What a swap would move]
A layer that swaps hands its group what autograd saves for backward while its forward runs,
outside any recompute region of its own (``SwapManager.run_layer``): a recomputed layer's inputs,
or every saved tensor of a layer without recompute. The profiled step records the same, through a
saved-tensors hook around the whole step that attributes each saved storage to the running layer,
and keeps, per layer, the sizes of the storages a swap would actually free: swappable
(``swap_ineligible``), created during the step (not a parameter or a buffer), saved by no other
layer nor by ops outside the layers, and not held past the step or returned to the caller (NOTE
[Tensors that outlive the layer] in swap.py: those stay on the device). The cost model leaves out
those below ``min_swap_bytes``, as ``SwapManager`` does.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes as _quiet
from torch.utils._pytree import tree_flatten

from ..lifecycle import HookOps
from ..measure import StepMode, StorageTimeline, created_storages, flop_counter, gradients, op_tensors
from ..policy import routing_ops
from ..swap import swap_ineligible
from .group import ALONE, PlanGroup

__all__ = ["ModeProfile", "profile_modes"]


@dataclasses.dataclass
class ModeProfile:
    """One uniform mode's step, per layer position (``None``: outside the layers)."""

    kept: dict[int | None, int]
    """Activation bytes alive when backward starts, by the layer that created them."""
    forward_peak: dict[int, int]
    """Largest residual during each layer's forward (NOTE [Peak phases])."""
    backward_peak: dict[int, int]
    """Largest residual during each layer's backward, its recompute included."""
    outside_peak: dict[int, int]
    """Largest residual of ops outside the layers, by how many layers are behind them."""
    backward_flops: dict[int | None, int]
    """FLOPs run in backward (the gradients, plus any replay), by layer."""
    total_flops: int
    forward_ops: dict[int | None, int]
    backward_ops: dict[int | None, int]
    work: dict[int | None, list[tuple[int, int, torch.dtype | None]]]
    """``(FLOPs, bytes moved, dtype)`` of every op, forward and backward, by layer: the roofline's
    input on ``meta``."""
    seconds: dict[int | None, float] = dataclasses.field(default_factory=dict)
    """Measured forward plus backward seconds by layer (real tensors only)."""
    offloadable: dict[int, list[int]] = dataclasses.field(default_factory=dict)
    """Per layer, the bytes of each storage a swap of the layer would move to host memory (NOTE
    [What a swap would move])."""
    noise: dict[int, float] = dataclasses.field(default_factory=dict)
    """Per layer, the seconds its timing cannot resolve (NOTE [Ties within the noise] in solver.py),
    the same in every mode's profile (real tensors only)."""
    routes: dict[int, int] = dataclasses.field(default_factory=dict)
    """Per layer that routes, the bytes its forward's routing ops returned: what every mode that replays
    keeps of them (NOTE [Routing is kept] in replay/routing.py)."""


def _loss(model: nn.Module, sample: Any) -> tuple[torch.Tensor, Any]:
    """The step's loss, and the model's output (the caller's, not activations)."""
    if callable(sample):
        loss = sample(model)
        return loss, loss
    output = model(**sample)
    loss = getattr(output, "loss", None)
    if loss is None:
        first = output if isinstance(output, torch.Tensor) else next(
            v for v in tree_flatten(output)[0] if isinstance(v, torch.Tensor)
        )
        loss = first.float().mean()
    return loss, output


class _Enter:
    """Forward pre-hook: the module's layer is running (hooks on the profiled model only)."""

    def __init__(self, profiler: _Profiler, position: int) -> None:
        self.profiler, self.position = profiler, position

    def __call__(self, module: nn.Module, args: Any) -> None:
        self.profiler.stack.append(self.position)


class _Leave:
    """Forward hook (always called): the module's layer is done; a top-level layer finished. A layer
    that runs more than once per forward (ALBERT's one shared layer, weight sharing) counts as
    finished from its first call on: the layers behind are a prefix of the layer list."""

    def __init__(self, profiler: _Profiler, position: int | None) -> None:
        self.profiler, self.position = profiler, position

    def __call__(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.profiler.stack:
            self.profiler.stack.pop()
        if self.position is not None and not self.profiler.backward:
            self.profiler.finished = max(self.profiler.finished, self.position + 1)


class _Profiler(StepMode):
    """Attributes each op to the running layer and records the step's storage timeline."""

    def __init__(self, count: int, device_type: str) -> None:
        super().__init__()
        self.count = count
        self.device_type = device_type
        self.saved_by: dict[int, set[int | None]] = defaultdict(set)
        self.stack: list[int] = []
        self.backward = False
        self.finished = 0
        self.frontier = count
        self.timeline = StorageTimeline()
        self.events: list[tuple[bool, int | None, int]] = [(False, None, 0)]
        self.owner_of: list[int | None] = []
        self.flops: dict[int | None, int] = defaultdict(int)
        self.ops = (defaultdict(int), defaultdict(int))
        self.work: dict[int | None, list] = defaultdict(list)
        self.total_flops = 0
        self.registry = flop_counter().flop_registry
        self.mark = 0
        self.backward_layer: int | None = None
        self.routing = frozenset(id(op) for op in routing_ops())
        self.routes: dict[int, int] = defaultdict(int)
        self.hook_ops = HookOps()

    def boundary(self, position: int, kind: str) -> None:
        if kind == "backward-start":
            self.backward_layer = position
            self.frontier = min(self.frontier, position)
        elif kind == "backward-end" and self.backward_layer == position:
            self.backward_layer = None

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        """Saved-tensors hook: note which layer saves the storage (NOTE [What a swap would move]);
        autograd keeps a detached alias (NOTE [Saved tensors under hooks] in swap.py). A fake tensor is
        saved while torch.compile traces code the step calls (``torch.cond``'s autograd): not the
        step's, and left to the tracer's fake mode, which detaching outside it would leave."""
        if isinstance(tensor, FakeTensor):
            return tensor
        if not self.backward and swap_ineligible(tensor, self.device_type) is None:
            key = self.timeline.id_of(tensor.untyped_storage())
            if key is not None:
                self.saved_by[key].add(self.stack[-1] if self.stack else None)
        with _quiet():
            return tensor.detach()

    @staticmethod
    def unpack(alias: torch.Tensor) -> torch.Tensor:
        return alias

    def offloadable(self, excluded: set[int]) -> dict[int, list[int]]:
        """Per layer, the storages only it saved, still alive in no one's hands after the step."""
        sizes: dict[int, list[int]] = defaultdict(list)
        for key, owners in self.saved_by.items():
            owner = next(iter(owners)) if len(owners) == 1 else None
            _, nbytes, alive = self.timeline.births[key]
            if owner is not None and key not in excluded and key not in self.timeline.released and alive() is None:
                sizes[owner].append(nbytes)
        return dict(sizes)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].device.type == "meta":
            return True if args[0].dtype is torch.bool else 1
        self.timeline.tick()
        out = func(*args, **kwargs)
        owner = self.stack[-1] if self.stack else self.backward_layer if self.backward else None
        if self.backward:
            behind = owner if owner is not None else self.frontier
        else:
            behind = self.finished
        self.events.append((self.backward, owner, behind))
        formula = self.registry.get(getattr(func, "_overloadpacket", func))  # a higher-order op is its own key
        flops = int(formula(*args, **kwargs, out_val=out)) if formula is not None else 0
        self.total_flops += flops
        if self.backward:
            self.flops[owner] += flops
        self.ops[self.backward][owner] += 1
        inputs, outputs = op_tensors((args, kwargs)), op_tensors(out)
        # A routing op a sharding stack's parameter hook runs is no route (NOTE [Routing is kept] in replay/routing.py).
        if id(func) in self.routing and owner is not None and not self.backward and not self.hook_ops.owns(args, False):
            self.routes[owner] += sum(t.nbytes for t in outputs)
        moved = sum(t.nbytes for t in inputs) + sum(t.nbytes for t in outputs)
        self.work[owner].append((flops, moved, outputs[0].dtype if outputs else None))
        for storage in created_storages(inputs, outputs):
            if self.timeline.add(storage) == len(self.owner_of):
                self.owner_of.append(owner)
        return out

    def result(self, grads: Sequence[torch.Tensor]) -> ModeProfile:
        """The profile, the parameters' gradients ``grads`` left out of the activation bytes."""
        excluded = self.timeline.ids(grads)
        live = self.timeline.live_bytes(excluded)
        kept: dict[int | None, int] = defaultdict(int)
        for key, (born, nbytes, _) in enumerate(self.timeline.births):
            if key not in excluded and born <= self.mark < self.timeline.alive_until(key):
                kept[self.owner_of[key]] += nbytes
        behind = [0]
        for position in range(self.count):
            behind.append(behind[-1] + kept.get(position, 0))
        forward_peak: dict[int, int] = defaultdict(int)
        backward_peak: dict[int, int] = defaultdict(int)
        outside_peak: dict[int, int] = defaultdict(int)
        for index, (backward, owner, layers_behind) in enumerate(self.events):
            residual = live[index] - behind[layers_behind]
            table = outside_peak if owner is None else backward_peak if backward else forward_peak
            key = layers_behind if owner is None else owner
            table[key] = max(table[key], residual)
        return ModeProfile(
            kept=dict(kept), forward_peak=dict(forward_peak), backward_peak=dict(backward_peak),
            outside_peak=dict(outside_peak), backward_flops=dict(self.flops), total_flops=self.total_flops,
            forward_ops=dict(self.ops[False]), backward_ops=dict(self.ops[True]),
            work=dict(self.work), offloadable=self.offloadable(excluded), routes=dict(self.routes),
        )


class _Boundary:
    """Forward hook (or pre-hook) on a layer: tells ``listener.boundary(position, kind)`` when the
    layer's forward starts and ends and, through pre-hooks on the autograd nodes that made its output
    and its input, when its backward starts and ends.

    NOTE [No hooks on the user's tensors]
    ``Tensor.register_hook`` on a layer's output crashes the process (a segfault in PyTorch 2.13)
    when the output is a view that the caller then writes through a further view
    (``v.unsqueeze(0).squeeze(0).sub_(...)``): profiling must not put the user's process at risk.
    A pre-hook on the node (``grad_fn.register_prehook``) fires at the same moment, when the node
    is about to run with the gradient complete, and touches no tensor. A node that a later in-place
    write takes out of the graph never fires; a leaf input has no node. Either way the layer's
    backward boundary is missing from the profile, and its backward ops count toward the nearest
    layer still running, as ops outside any layer do.
    """

    def __init__(self, listener: Any, position: int, kind: str) -> None:
        self.listener, self.position, self.kind = listener, position, kind

    def __call__(self, *args: Any) -> None:
        self.listener.boundary(self.position, self.kind)
        if not torch.is_grad_enabled() or self.kind.startswith("backward"):
            return
        # forward-start: (module, args, kwargs) -> the input; forward-end: (module, args, output).
        values = tree_flatten(args[1:] if self.kind == "forward-start" else args[2])[0]
        node = next((t.grad_fn for t in values if isinstance(t, torch.Tensor) and t.grad_fn is not None), None)
        if node is not None:  # NOTE [No hooks on the user's tensors]
            kind = "backward-end" if self.kind == "forward-start" else "backward-start"
            node.register_prehook(_Boundary(self.listener, self.position, kind))


def _watch(listener: Any, layer_modules: Sequence[nn.Module]) -> list:
    handles = []
    for position, module in enumerate(layer_modules):
        handles.append(module.register_forward_pre_hook(_Boundary(listener, position, "forward-start"),
                                                        with_kwargs=True))
        handles.append(module.register_forward_hook(_Boundary(listener, position, "forward-end"), always_call=True))
    return handles


class _Clock:
    """Per-layer forward and backward time of one step, from readings at layer boundaries of
    ``clock`` (``Backend.clock``: it synchronises, so that asynchronous devices are timed too)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.readings: dict[tuple[int, str], float] = {}

    def boundary(self, position: int, kind: str) -> None:
        self.readings.setdefault((position, kind), self.clock())

    def seconds(self, count: int, start: float, end: float) -> dict[int | None, float]:
        read = self.readings
        per_layer: dict[int | None, float] = {}
        for position in range(count):
            forward = read.get((position, "forward-end"), start) - read.get((position, "forward-start"), start)
            backward = read.get((position, "backward-end"), end) - read.get((position, "backward-start"), end)
            per_layer[position] = max(forward, 0.0) + max(backward, 0.0)
        per_layer[None] = max(end - start - sum(per_layer.values()), 0.0)
        return per_layer


def _profiled_step(model: nn.Module, sample: Any, layer_modules: Sequence[nn.Module]) -> ModeProfile:
    first = next(iter(model.parameters()), None)
    profiler = _Profiler(len(layer_modules), "cpu" if first is None else first.device.type)
    handles = _watch(profiler, layer_modules)
    try:
        for position, layer in enumerate(layer_modules):
            for module in layer.modules():
                handles.append(module.register_forward_pre_hook(_Enter(profiler, position)))
                leave = _Leave(profiler, position if module is layer else None)
                handles.append(module.register_forward_hook(leave, always_call=True))
        torch.manual_seed(0)
        with profiler, torch.autograd.graph.saved_tensors_hooks(profiler.pack, profiler.unpack):
            loss, output = _loss(model, sample)
            profiler.timeline.release(output)
            profiler.mark = profiler.timeline.now
            profiler.backward = True
            grads = _backward(model, loss)
            del loss, output
    finally:
        for handle in handles:
            handle.remove()
    return profiler.result(grads)


def _timed_step(model: nn.Module, sample: Any, layer_modules: Sequence[nn.Module],
                clock: Callable[[], float]) -> dict[int | None, float]:
    layer_clock = _Clock(clock)
    handles = _watch(layer_clock, layer_modules)
    try:
        torch.manual_seed(0)
        start = clock()
        loss, output = _loss(model, sample)
        del output
        _backward(model, loss)
        end = clock()
    finally:
        for handle in handles:
            handle.remove()
    return layer_clock.seconds(len(layer_modules), start, end)


def _backward(model: nn.Module, loss: torch.Tensor) -> list[torch.Tensor]:
    """A profiled step's backward, which computes the parameters' gradients and hands them back instead
    of accumulating them.

    NOTE [Profiled steps leave the gradients alone]
    A model may be wrapped already when it is planned (``deepspeed.initialize``, DDP, HF's Trainer, which
    wraps before ``HyperACCallback`` applies): the wrapper's hooks on the parameters' gradient
    accumulation (ZeRO's reduce-scatter into its partitions, DDP's bucketed all-reduce) would take the
    profiling steps' gradients into the training step's, or, ZeRO-3's, fail on a parameter reduced
    twice in one step. So the profiled steps ask autograd for the gradients of the trainable parameters
    (``torch.autograd.grad``): the same backward ops, module hooks and peaks, but no accumulation into
    ``.grad`` and none of its hooks. The gradients are left out of the activation bytes as ``.grad`` is.
    """
    trainable = [parameter for parameter in model.parameters() if parameter.requires_grad]
    if not trainable or not loss.requires_grad:
        loss.backward()
        return gradients(model.parameters())
    return [grad for grad in torch.autograd.grad(loss, trainable, allow_unused=True) if grad is not None]


def profile_modes(
    model: nn.Module, sample: Any, layer_modules: Sequence[nn.Module], modes: Sequence[str],
    run_mode: Callable[[str | tuple[str, ...]], Callable[[], None]], rounds: int, clock: Callable[[], float],
    group: PlanGroup = ALONE,
) -> dict[str, ModeProfile]:
    """Profile every mode on every layer (NOTE [Identical layers measured once]), then time at
    least ``rounds`` rounds (NOTE [Timing on a drifting host]). ``modes`` include ``"off"``;
    ``run_mode`` applies a mode to every layer, or a tuple of per-layer modes, and returns an undo;
    ``clock`` synchronises the device and reads the time (``Backend.clock``). Outside the layers,
    ``off`` gets the largest residual any step saw (the cost model takes the largest over the modes,
    as it did from one step per mode). With a ``group`` of ranks, every step, the groups of identical
    layers and the number of timed rounds are agreed with the other ranks (NOTE [One plan per job]
    in group.py)."""
    count = len(layer_modules)
    off = group.run(lambda: _profiled_run(model, sample, layer_modules, run_mode, "off"), "in a profiled step")
    groups = _common_groups(group.gather(lambda: _identical_groups(layer_modules, off), "comparing its layers"))
    others = [mode for mode in modes if mode != "off"]
    profiles = {"off": off, **{mode: _copy(off) for mode in others}}
    for assignment in _assignments(groups, others, count):
        profile = group.run(lambda assignment=assignment: _profiled_run(model, sample, layer_modules, run_mode,
                                                                          assignment), "in a profiled step")
        for key, residual in profile.outside_peak.items():
            off.outside_peak[key] = max(off.outside_peak.get(key, 0), residual)
        for position, mode in enumerate(assignment):
            if mode != "off":
                for member in groups[position]:
                    _take(profiles[mode], profile, position, member)
    for profile in profiles.values():
        profile.total_flops = off.total_flops + sum(profile.backward_flops.get(p, 0) - off.backward_flops.get(p, 0)
                                                    for p in range(count))
    if rounds:
        timed, noise = _timed_rounds(model, sample, layer_modules, list(modes), run_mode, rounds, clock, groups,
                                     profiles, group)
        for mode, seconds in timed.items():
            profiles[mode].seconds, profiles[mode].noise = seconds, noise
    return profiles


def _profiled_run(model: nn.Module, sample: Any, layer_modules: Sequence[nn.Module],
                  run_mode: Callable[[Any], Callable[[], None]], assignment: str | tuple[str, ...]) -> ModeProfile:
    undo = run_mode(assignment)
    try:
        return _profiled_step(model, sample, layer_modules)
    finally:
        undo()
        model.zero_grad(set_to_none=True)


# NOTE [Identical layers measured once]
# Planning is paid for in training steps (a profiled step costs about four plain ones), so a
# layer's cost under a mode is measured once per group of identical layers: layers of one class
# with the same parameter shapes that, profiled without recompute, run the same ops, FLOPs and
# kept bytes. One step then runs a different mode on each member of a group (the first of four
# identical layers in ``pointwise``, the second in ``selective``...), and each member's costs
# stand for the whole group: a model of identical layers is profiled in two steps (``off``, then
# the other four modes side by side) rather than five, and timed in rounds of one or two steps
# (every mode on some member of each group, ``off`` on two where the group is large enough: the
# control of NOTE [Timing on a drifting host]). A layer's residual peaks are taken against the
# kept bytes of the layers behind it under that step's own modes (NOTE [Peak phases]), so they
# do not depend on what its neighbours ran. Without recompute a layer's backward residual does
# depend on where it sits (tiny Llama: 16 KiB less per layer, the gradients of what all layers
# share), which is why the groups are formed from the ``off`` step's work, not its peaks; under
# the recompute modes the residual measured on one member is every member's (the replay's
# transient dominates). Layers unlike any other get one step per mode.

_PER_LAYER = ("kept", "forward_peak", "backward_peak", "backward_flops", "forward_ops", "backward_ops", "work",
              "offloadable", "routes")
_SAME_WORK = ("kept", "backward_flops", "forward_ops", "backward_ops")


def structure(module: nn.Module) -> tuple:
    """What identical layers share before any runs: the class, and the names, shapes, dtypes (and
    for parameters ``requires_grad``) of the parameters and buffers."""
    return (type(module),
            tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in module.named_parameters()),
            tuple((name, tuple(b.shape), b.dtype) for name, b in module.named_buffers()))


def _identical_groups(layer_modules: Sequence[nn.Module], off: ModeProfile) -> list[tuple[int, ...]]:
    """Per position, the positions of the layers identical to it (itself included, in order)."""
    members: dict[tuple, list[int]] = defaultdict(list)
    for position, module in enumerate(layer_modules):
        members[(structure(module), *(getattr(off, field).get(position) for field in _SAME_WORK))].append(position)
    group_of = {position: tuple(group) for group in members.values() for position in group}
    return [group_of[position] for position in range(len(layer_modules))]


def _common_groups(partitions: Sequence[list[tuple[int, ...]]]) -> list[tuple[int, ...]]:
    """The groups of layers identical on every rank (one partition per rank): a layer whose work
    differs on one rank (an MoE layer's routing depends on its rank's batch) is measured apart."""
    members: dict[tuple, list[int]] = defaultdict(list)
    for position in range(len(partitions[0])):
        members[tuple(partition[position] for partition in partitions)].append(position)
    group_of = {position: tuple(group) for group in members.values() for position in group}
    return [group_of[position] for position in range(len(partitions[0]))]


def _assignments(groups: list[tuple[int, ...]], modes: Sequence[str], count: int,
                 start: int = 0) -> list[tuple[str, ...]]:
    """Per-layer modes of the fewest steps that run every mode on some member of each group; the
    ``j``-th member runs ``modes[(start + j + k * size) % len(modes)]`` in step ``k``, and members
    past the last mode run ``off``."""
    steps = max(math.ceil(len(modes) / len(group)) for group in groups)
    plans = []
    for step in range(steps):
        plan = []
        for position in range(count):
            group = groups[position]
            slot = group.index(position) + step * len(group)
            plan.append(modes[(start + slot) % len(modes)] if slot < len(modes) else "off")
        plans.append(tuple(plan))
    return plans


def _copy(profile: ModeProfile) -> ModeProfile:
    return dataclasses.replace(profile, **{field: dict(getattr(profile, field)) for field in _PER_LAYER})


def _take(target: ModeProfile, source: ModeProfile, position: int, member: int) -> None:
    """Layer ``member``'s entries in ``target`` become those layer ``position`` measured in ``source``."""
    for field in _PER_LAYER:
        table = getattr(target, field)
        value = getattr(source, field).get(position)
        if value is None:
            table.pop(member, None)
        else:
            table[member] = value


# NOTE [Timing on a drifting host]
# A shared host's speed drifts: on a 2-core CI machine the same step's thread CPU time varies
# 1.4-1.7x from one step to the next. Modes timed one after another (all of one mode's steps, then
# the next's) then compare readings from different speeds, and the plan follows the noise (a mode
# timed in a fast moment looks cheap). So the modes are timed in interleaved rounds, each running
# every mode on some member of each group of identical layers (NOTE [Identical layers measured
# once]; the modes' places rotate from round to round), each reading is divided by the group's
# ``off`` readings of its round, and a layer's seconds are the median of those ratios times the
# median ``off`` reading: a plan's predicted time is on the scale of the median step. The profiled
# steps before the rounds warm each mode up (first-call costs stay out of the rounds). Rounds stop
# after one when more could not change the ranking (NOTE [When the rounds stop]), else once at
# least ``rounds`` ran and the modes' order by seconds (modes within the noise of each other tied)
# is the one of the round before, or after ``MAX_ROUNDS`` rounds.
#
# The rounds measure their own noise: where a group runs ``off`` on two or more members in a round
# (members past the modes run ``off``: the demo model's four layers run five modes in two steps,
# ``off`` on four of the eight slots), the spread between them (an off-vs-off control: identical
# work) is the timing's noise for that group. Where a mode's seconds lie within that noise of what
# the cost model says (the ``off`` seconds plus a cost per replayed FLOP and per extra dispatched
# op, fitted to the group's readings), the cost model's figure is taken: differences the timing
# cannot tell apart are decided by replayed FLOPs and dispatched ops, not by the noise (``hyperac demo --plot`` on a
# loaded machine chose a selective plan that uniform ``full`` beat in both peak and time).

MAX_ROUNDS = 3

# NOTE [When the rounds stop]
# A round costs two steps or more, and planning is paid for in training steps (issue 20: at most
# about ten; the two profiled steps take four to five): the rounds stop after the first as soon as more
# of them could not change the plan's ranking. That is the case, for every group with an
# off-vs-off control, when either
# - the host is quiet (a spread of at most ``QUIET`` of the ``off`` reading) and each mode's ratio
#   to ``off`` is more than ``CLEAR_MARGIN`` times the noise away from the modes ranked next to it
#   (the noise taken as at least ``NOISE_FLOOR``: one round's control can agree with itself by
#   chance), or
# - the host is busy (a spread above ``QUIET``): the modes within that noise of the cost model get
#   its figures (below), and further rounds do not settle them. Measured on the demo model under a
#   load average of 3-4 on two cores: the control's spread was 0.1-0.7 in every round, and after
#   two to four rounds every mode but ``off`` was still tied.
# Only a quiet host whose modes lie between one and ``CLEAR_MARGIN`` noises apart, a group without
# a control (fewer members than modes plus one), and a round that read a mode faster than ``off``
# (every mode runs at least ``off``'s work: hidden 512 under load, ``pointwise`` at 0.93x ``off``
# in one round, pulled the cost model's fit to "``pointwise`` costs nothing") run further rounds.

CLEAR_MARGIN = 2.0
NOISE_FLOOR = 0.03
QUIET = 0.1


def _timed_rounds(
    model: nn.Module, sample: Any, layer_modules: Sequence[nn.Module], modes: list[str],
    run_mode: Callable[[Any], Callable[[], None]], rounds: int, clock: Callable[[], float],
    groups: list[tuple[int, ...]], profiles: dict[str, ModeProfile], group: PlanGroup,
) -> tuple[dict[str, dict[int | None, float]], dict[int, float]]:
    """Per mode, the seconds by layer (``None``: outside the layers) of NOTE [Timing on a drifting
    host], and per layer the noise of NOTE [Ties within the noise] in solver.py. The rounds stop
    when they would on every rank of ``group``."""
    count = len(layer_modules)
    heads = sorted(set(group[0] for group in groups))
    ratios: dict[tuple[int, str], list[float]] = defaultdict(list)
    scales: dict[int, list[float]] = defaultdict(list)
    spreads: dict[int, list[float]] = defaultdict(list)
    outside: list[float] = []
    ranking = None
    for done in range(max(MAX_ROUNDS, rounds)):
        readings: dict[tuple[int, str], list[float]] = defaultdict(list)
        for assignment in _assignments(groups, modes, count, start=done):
            seconds = group.run(lambda assignment=assignment: _timed_run(model, sample, layer_modules, run_mode,
                                                                         assignment, clock), "in a timed step")
            outside.append(seconds[None])
            for position, mode in enumerate(assignment):
                readings[groups[position][0], mode].append(seconds[position])
        for head in heads:
            offs = readings[head, "off"]
            reference = statistics.fmean(offs)
            scales[head].append(reference)
            if len(offs) > 1 and reference > 0:
                spreads[head].append((max(offs) - min(offs)) / reference)
            for mode in modes:
                ratios[head, mode].append(statistics.fmean(readings[head, mode]) / reference if reference else 0.0)
        medians = {head: {m: statistics.median(ratios[head, m]) for m in modes} for head in heads}
        noises = {head: statistics.median(spreads[head]) if spreads[head] else None for head in heads}
        order = [_ranking(medians[head], noises[head] or 0.0) for head in heads]
        stop = all(_settled(medians[head], noises[head]) for head in heads) or (done + 1 >= rounds and order == ranking)
        if group.all(stop, "at the end of a timed round"):
            break
        ranking = order
    result: dict[str, dict[int | None, float]] = {mode: {None: statistics.median(outside)} for mode in modes}
    noise_by_layer: dict[int, float] = {}
    for head in heads:
        scale = statistics.median(scales[head])
        measured = {mode: scale * statistics.median(ratios[head, mode]) for mode in modes}
        noise = scale * statistics.median(spreads[head]) if spreads[head] else 0.0
        decided = _decide_within_noise(measured, noise, profiles, head)
        for mode in modes:
            result[mode].update(dict.fromkeys(groups[head], decided[mode]))
        noise_by_layer.update(dict.fromkeys(groups[head], max(noise, NOISE_FLOOR * decided["off"])))
    return result, noise_by_layer


def _timed_run(model: nn.Module, sample: Any, layer_modules: Sequence[nn.Module],
               run_mode: Callable[[Any], Callable[[], None]], assignment: tuple[str, ...],
               clock: Callable[[], float]) -> dict[int | None, float]:
    undo = run_mode(assignment)
    try:
        return _timed_step(model, sample, layer_modules, clock)
    finally:
        undo()


def _ranking(ratios: dict[str, float], noise: float) -> list[frozenset[str]]:
    """The modes from fastest to slowest, those within ``noise`` of the one before tied together."""
    ranked: list[list[str]] = []
    previous = None
    for mode in sorted(ratios, key=ratios.get):
        if previous is None or ratios[mode] - ratios[previous] > noise:
            ranked.append([])
        ranked[-1].append(mode)
        previous = mode
    return [frozenset(tie) for tie in ranked]


def _settled(ratios: dict[str, float], noise: float | None) -> bool:
    """Whether more rounds could not reorder ``ratios`` (NOTE [When the rounds stop]); ``noise``:
    the group's off-vs-off spread, ``None`` without a control."""
    if noise is None or min(ratios.values()) < ratios["off"]:  # a mode faster than off: the round misread
        return False
    if noise > QUIET:
        return True
    margin = CLEAR_MARGIN * max(noise, NOISE_FLOOR)
    classes = _ranking(ratios, max(noise, NOISE_FLOOR))
    return all(min(ratios[m] for m in slower) - max(ratios[m] for m in faster) > margin
               for faster, slower in zip(classes, classes[1:]))


def _decide_within_noise(measured: dict[str, float], noise: float, profiles: dict[str, ModeProfile],
                         position: int) -> dict[str, float]:
    """Each mode's seconds: the cost model's where the measurement is within ``noise`` of it
    (NOTE [Timing on a drifting host]). The model: the ``off`` seconds plus ``a`` per replayed
    FLOP plus ``b`` per extra dispatched op, ``a, b >= 0`` fitted by least squares."""
    off = profiles["off"]

    def extra(mode: str) -> tuple[float, float]:
        profile = profiles[mode]
        flops = profile.backward_flops.get(position, 0) - off.backward_flops.get(position, 0)
        ops = sum(getattr(profile, f).get(position, 0) - getattr(off, f).get(position, 0)
                  for f in ("forward_ops", "backward_ops"))
        return float(max(flops, 0)), float(max(ops, 0))

    rows = [(*extra(mode), measured[mode] - measured["off"]) for mode in measured if mode != "off"]
    a, b = _nonnegative_fit(rows)
    modelled = {mode: measured["off"] + a * extra(mode)[0] + b * extra(mode)[1] for mode in measured}
    return {mode: modelled[mode] if abs(measured[mode] - modelled[mode]) <= noise else measured[mode]
            for mode in measured}


def _nonnegative_fit(rows: Sequence[tuple[float, float, float]]) -> tuple[float, float]:
    """``(a, b) >= 0`` minimising the squares of ``a * x + b * y - z`` over ``rows`` of ``(x, y, z)``."""
    sxx, syy, sxy = (sum(r[i] * r[j] for r in rows) for i, j in ((0, 0), (1, 1), (0, 1)))
    sxz, syz = (sum(r[i] * r[2] for r in rows) for i in (0, 1))
    det = sxx * syy - sxy * sxy
    if det > 0:
        a, b = (sxz * syy - syz * sxy) / det, (syz * sxx - sxz * sxy) / det
        if a >= 0 and b >= 0:
            return a, b
    only_a = max(sxz / sxx, 0.0) if sxx else 0.0
    only_b = max(syz / syy, 0.0) if syy else 0.0

    def residual(a: float, b: float) -> float:
        return sum((a * x + b * y - z) ** 2 for x, y, z in rows)

    return min(((only_a, 0.0), (0.0, only_b)), key=lambda ab: residual(*ab))
