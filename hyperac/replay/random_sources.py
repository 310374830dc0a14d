"""Random sources a region's forward draws from, set for its replay so that it draws the same numbers.

A recomputed region must draw, in its replay, the numbers its forward drew (the same dropout masks),
else its gradients differ from the un-applied model's, silently. Three kinds of source:

* torch's default generators, the CPU one and those of the devices the region's tensors live on:
  ``torch.utils.checkpoint`` sets them to the forward's states before each replay
  (``preserve_rng_state``), and restores them after;
* a generator an op is given (``generator=``) and the default generators, as seen across one op whose
  output a selective replay keeps instead of running (NOTE [Kept ops that draw random numbers]);
* RNG trackers: named generator states a training stack holds in Python and swaps into the device's
  generator while a block draws (Megatron-Core's and DeepSpeed's ``CudaRNGStatesTracker``, whose
  ``fork()`` draws tensor-parallel dropout masks). torch does not know them; a stack registers its
  tracker (:func:`register_rng_tracker`) and every region replays it (NOTE [RNG trackers]).

A tracker of a known stack that is in use but not registered is refused when hyperac is applied
(:func:`check_trackers_registered`), before the first step, rather than give other gradients.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch

from ..errors import ConfigError, UnsupportedModelError

__all__ = [
    "GeneratorStates", "RNGTracker", "TrackerReplay", "check_trackers_registered", "draws_since",
    "register_rng_tracker", "registered_trackers", "restore_generators", "rng_states", "set_rng_states",
    "unregister_rng_tracker", "watch_generators",
]


# ---------------------------------------------------------------------------------------------
# torch generators

_Source = Any
"""A generator: ``None`` (the CPU default generator), a ``torch.device`` (that device's default
generator) or a ``torch.Generator`` passed to an op."""

GeneratorStates = list[tuple[_Source, torch.Tensor]]
"""``(generator, state)`` pairs: where each generator stood at some point of a forward."""


def _state(source: _Source) -> torch.Tensor:
    if source is None:
        return torch.get_rng_state()
    if isinstance(source, torch.Generator):
        return source.get_state()
    return torch.get_device_module(source.type).get_rng_state(source)


def _set_state(source: _Source, state: torch.Tensor) -> None:
    if source is None:
        torch.set_rng_state(state)
    elif isinstance(source, torch.Generator):
        source.set_state(state)
    else:
        torch.get_device_module(source.type).set_rng_state(state, source)


def _sources(values: Any, found: list[_Source] | None = None) -> list[_Source]:
    """The CPU generator, the default generator of each accelerator a tensor or device in ``values``
    (an op's arguments, nested in lists, tuples and dicts) names, and each generator in ``values``."""
    sources: list[_Source] = [None] if found is None else found
    for leaf in values:
        if isinstance(leaf, torch.Tensor):
            if leaf.is_cpu or leaf.is_meta:
                continue
            leaf = leaf.device
        elif isinstance(leaf, (list, tuple)):
            _sources(leaf, sources)
            continue
        elif isinstance(leaf, dict):
            _sources(leaf.values(), sources)
            continue
        if isinstance(leaf, torch.device):
            if leaf.type in ("cpu", "meta"):
                continue
            if leaf.index is None:
                leaf = torch.device(leaf.type, torch.get_device_module(leaf.type).current_device())
        elif not isinstance(leaf, torch.Generator):
            continue
        if not any(leaf is known or leaf == known for known in sources[1:]):
            sources.append(leaf)
    return sources


def watch_generators(args: tuple, kwargs: dict) -> list[tuple[_Source, bytes]]:
    """Where each generator an op called with ``args`` and ``kwargs`` can draw from stands before it
    runs (NOTE [Kept ops that draw random numbers])."""
    return [(source, _state(source).numpy().tobytes()) for source in _sources((args, kwargs))]


def draws_since(before: list[tuple[_Source, bytes]]) -> GeneratorStates | None:
    """The states of the generators in ``before`` (:func:`watch_generators`) that moved since, as they
    are now; ``None`` where none moved."""
    moved = []
    for source, position in before:
        state = _state(source)
        if state.numpy().tobytes() != position:
            moved.append((source, state))
    return moved or None


def restore_generators(states: GeneratorStates) -> None:
    """Set each generator in ``states`` to its state there."""
    for source, state in states:
        _set_state(source, state)


# NOTE [Kept ops that draw random numbers]
# A selective replay does not run the ops whose outputs it kept; it hands out their outputs. An op
# that drew random numbers in forward (an attention kernel with dropout) would then leave the
# generator where it stood before the op, and a dropout after it in the layer would draw another
# mask. So the replay sets the generators the op moved to where the forward left them. Which ops draw
# is observed, not declared: torch tags its random kernels ``nondeterministic_seeded``, but a custom
# op (``torch.library``), a vendor's fused attention (Ascend's ``npu_fusion_attention_v3`` with
# ``keep_prob``) or an op given ``generator=`` need not be tagged. Only kept ops are watched, a
# fraction of a layer's ops, and a watch reads the state of each generator the op can reach (the CPU
# one, the default generator of each device its arguments name, any it is given) before and after it
# runs: on CPU a 5,056-byte Mersenne state (torch's CPU generator has no offset to read instead); a
# CUDA-like generator's state is its seed and offset (16 bytes). Measured on a loaded 2-core host:
# 1 us to find the generators, 8 us per kept op in all against 1.4 us for a 4x4 ``mm``; a tiny Llama
# layer keeps 4 of its 73 ops under ``selective``, so about 0.4 us per op of the region, against the
# recording's 11 us per op (benchmarks/recording_overhead.py). Only a generator that moved is set in
# the replay, so a kept op that draws nothing costs the replay nothing.


# ---------------------------------------------------------------------------------------------
# RNG trackers


@runtime_checkable
class RNGTracker(Protocol):
    """What hyperac needs of a training stack's RNG tracker: Megatron-Core's and DeepSpeed's
    ``CudaRNGStatesTracker`` have it as they are."""

    def get_states(self) -> Any:
        """A snapshot of every named generator state the tracker holds."""

    def set_states(self, states: Any) -> None:
        """Make the tracker hold ``states``, a snapshot from :meth:`get_states`."""


TrackerSource = RNGTracker | Callable[[], RNGTracker | None]
"""A tracker, or a function returning the current one (``None`` while there is none): a stack that
makes its tracker lazily or replaces it (Megatron-Core's ``get_cuda_rng_tracker``) registers the
function, so the tracker used is the one of the moment."""

_TRACKERS: dict[str, TrackerSource] = {}


def register_rng_tracker(name: str, tracker: TrackerSource) -> None:
    """Replay ``tracker``'s states in every recomputed region, as the training stack's own
    checkpoint function does: saved as each region's forward starts, set for its replay, and put back
    as they were after it (NOTE [RNG trackers]).

    ``tracker`` has ``get_states()`` and ``set_states(states)`` (:class:`RNGTracker`), or is a function
    of no arguments returning such a tracker or ``None``. Megatron-Core (also under MindSpeed)::

        from megatron.core import tensor_parallel
        hyperac.register_rng_tracker("megatron", tensor_parallel.get_cuda_rng_tracker)

    (:func:`hyperac.integrations.megatron.apply` does this for you). The registry holds the tracker or
    function, no model; it applies to every model hyperac recomputes in this process. Registering the
    same tracker again is a no-op; a different one under a taken name raises :class:`ConfigError`.
    """
    if not isinstance(name, str) or not name:
        raise ConfigError(f"register_rng_tracker needs a non-empty name, got {name!r}.")
    if not isinstance(tracker, RNGTracker) and not callable(tracker):
        raise ConfigError(
            f"register_rng_tracker({name!r}, ...) needs an object with get_states() and set_states(states), or a "
            f"function returning one; got {tracker!r}."
        )
    existing = _TRACKERS.setdefault(name, tracker)
    if existing is not tracker:
        raise ConfigError(
            f"an RNG tracker is already registered as {name!r} ({existing!r}); call "
            f"hyperac.unregister_rng_tracker({name!r}) first, or register this one under another name."
        )


def unregister_rng_tracker(name: str) -> None:
    """Stop replaying the tracker registered as ``name`` (an unknown name is ignored)."""
    _TRACKERS.pop(name, None)


def registered_trackers() -> list[RNGTracker]:
    """The registered trackers as they are now (a function's current tracker; ``None`` left out)."""
    trackers = []
    for source in _TRACKERS.values():
        tracker = source if isinstance(source, RNGTracker) else source()
        if tracker is not None and not any(tracker is known for known in trackers):
            trackers.append(tracker)
    return trackers


def _set_tracker(tracker: RNGTracker, states: Any) -> None:
    # Megatron's and DeepSpeed's trackers adopt the dict they are given and write into it in fork():
    # each replay gets a dict of its own, so a second replay sees the forward's states.
    tracker.set_states(dict(states) if isinstance(states, dict) else states)


class TrackerReplay:
    """A ``context_fn`` for ``torch.utils.checkpoint`` around ``context_fn`` (or none) that replays
    ``trackers`` (NOTE [RNG trackers]). Holds data only: the trackers and the wrapped function."""

    def __init__(self, trackers: list[RNGTracker], context_fn: Callable[[], tuple[Any, Any]] | None) -> None:
        self.trackers = trackers
        self.context_fn = context_fn

    @classmethod
    def wrap(cls, context_fn: Callable[[], tuple[Any, Any]] | None) -> Any:
        """``context_fn`` wrapped to replay the registered trackers, or itself if none is registered."""
        trackers = registered_trackers()
        return cls(trackers, context_fn) if trackers else context_fn

    def __call__(self) -> tuple[Any, Any]:
        # Called as the region's forward starts: the states saved here are those the forward starts from.
        forward, replay = (
            (contextlib.nullcontext(), contextlib.nullcontext()) if self.context_fn is None else self.context_fn()
        )
        states = [tracker.get_states() for tracker in self.trackers]
        return forward, _TrackersAsInForward(self.trackers, states, replay)


class _TrackersAsInForward:
    """The replay context of one region invocation: the trackers hold the states they held as the
    forward started while ``inner`` runs, and the states of the moment before it after it. Entered
    once per replay."""

    def __init__(self, trackers: list[RNGTracker], states: list[Any], inner: Any) -> None:
        self.trackers, self.states, self.inner = trackers, states, inner
        self.outside: list[list[Any]] = []

    def __enter__(self) -> None:
        self.outside.append([tracker.get_states() for tracker in self.trackers])
        for tracker, states in zip(self.trackers, self.states):
            _set_tracker(tracker, states)
        try:
            self.inner.__enter__()
        except BaseException:
            self._put_back()
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return self.inner.__exit__(*exc)
        finally:
            self._put_back()

    def _put_back(self) -> None:
        for tracker, states in zip(self.trackers, self.outside.pop()):
            tracker.set_states(states)


# NOTE [RNG trackers]
# Megatron-Core draws tensor-parallel dropout masks (attention dropout on each rank's heads) inside
# ``get_cuda_rng_tracker().fork()``, which swaps a named state held in Python into the device's
# generator and stores it back on exit; DeepSpeed's tracker does the same. A replay that restores
# only torch's generators finds the tracker moved on by the forward and draws other masks (issue 27:
# 4 of 106 gradients equal under full recompute at attention dropout 0.1). Megatron's
# ``CheckpointFunction`` saves the CPU and device generators and the tracker's states before the
# forward, and in backward sets all three, reruns the forward and puts the backward's states back;
# a region here does the same for every registered tracker, in every recompute mode (the tracker
# context sits outside the selective recording and replay modes; torch's checkpoint sets its own
# generators around it). Swap-only layers do not replay and need nothing. A module a region
# excludes (NOTE [Excluded modules] in recompute.py) does not run in the replay, so the trackers'
# states after it are set there with the generators' (:func:`rng_states`). A kept op that draws
# inside ``fork()`` is covered by the generator watch: the fork swapped the tracker's state into the
# device generator, and ``fork()``'s exit, which runs in the replay, stores it back. Under
# ``compile=True`` the tracker's Python state cannot be traced: :func:`check_trackers_registered`
# refuses that combination.


_KNOWN_TRACKERS = (
    ("Megatron-Core", "megatron.core.tensor_parallel.random", "_CUDA_RNG_STATE_TRACKER",
     "hyperac.integrations.megatron.apply(model, ...) registers it; or call "
     "hyperac.register_rng_tracker('megatron', megatron.core.tensor_parallel.get_cuda_rng_tracker)"),
    ("DeepSpeed", "deepspeed.runtime.activation_checkpointing.checkpointing", "_CUDA_RNG_STATE_TRACKER",
     "call hyperac.register_rng_tracker('deepspeed', "
     "deepspeed.runtime.activation_checkpointing.checkpointing.get_cuda_rng_tracker)"),
)
"""The RNG trackers hyperac can see without importing anything: ``(stack, module, attribute, fix)``.
A tracker is in use when its module is imported and it holds states (the stack seeded it)."""


def check_trackers_registered(compile: bool) -> None:
    """Refuse, before the first step, a random source hyperac would not replay: a known stack's RNG
    tracker that holds states but is not registered (:func:`register_rng_tracker`), or any registered
    tracker under ``compile`` (NOTE [RNG trackers])."""
    registered = registered_trackers()
    if compile and registered:
        raise ConfigError(
            f"Config.compile=True cannot replay the registered RNG trackers ({', '.join(sorted(_TRACKERS))}): their "
            "states live in Python, which a compiled region does not run again. Use compile=False."
        )
    for stack, module_name, attribute, fix in _KNOWN_TRACKERS:
        tracker = getattr(sys.modules.get(module_name), attribute, None)
        if tracker is None or any(tracker is known for known in registered):
            continue
        if isinstance(tracker, RNGTracker) and tracker.get_states():
            raise UnsupportedModelError(
                f"{stack}'s RNG tracker ({module_name}.{attribute}) holds generator states, which its dropout "
                "draws from inside tracker.fork(); hyperac replays a tracker only once it is registered, and a "
                f"replay without it would draw other dropout masks (other gradients). Register it: {fix}."
            )


# ---------------------------------------------------------------------------------------------
# All of them, at one point of a forward

RngStates = tuple[GeneratorStates, list[tuple[RNGTracker, Any]]]


def rng_states(*values: Any) -> RngStates:
    """The CPU generator's state, that of every accelerator holding a tensor in ``values``, and the
    registered trackers' states."""
    generators = [(source, _state(source)) for source in _sources(values) if not isinstance(source, torch.Generator)]
    return generators, [(tracker, tracker.get_states()) for tracker in registered_trackers()]


def set_rng_states(states: RngStates) -> None:
    """Undo the draws made since :func:`rng_states` returned ``states``."""
    generators, trackers = states
    restore_generators(generators)
    for tracker, tracker_states in trackers:
        _set_tracker(tracker, tracker_states)
