"""Every replay is checked against its forward: a divergence is an error, never a silent result.

NOTE [Every replay is checked]
The selective modes check their replay op by op against the forward's tape (policy.py, NOTE [Replays
that cannot use the tape]). ``full`` replays through torch.utils.checkpoint, which compares only the
metadata (shape, dtype, device) of the tensors saved for backward, and with its early stop not even
their number: a replay that takes the other side of an ``if`` whose two sides save tensors of equal
metadata (``relu`` or ``sigmoid``), or that computes a weight three times where the forward computed
it once, gives other gradients and no error.

So a ``full`` region fingerprints each tensor its forward saves for backward, as it is saved (by the
region's one hook pair in front of checkpoint's own, NOTE [One hook pair per region] in region_saves.py;
no dispatch mode): the autograd node that made it (``SigmoidBackward0``), or "made outside the region"
(an input, a parameter, a tensor made before the region started, an autocast cast of a leaf), its shape
and its dtype. The replay fingerprints what it
saves the same way, and as it ends (inside checkpoint's unpack, before any tensor it saved reaches a
gradient) its list is compared with the forward's: in one comparison where they are equal, entry by entry
where not, so the first difference raises :class:`~hyperac.RecomputeMismatchError` naming the layer, the
position, the ops that made both tensors and the likely causes. A replay that raised on the way (torch's
"trying to save more tensors", an op given another shape) is compared as far as it got, its error the
cause of the divergence found there; one that ends having saved fewer tensors than the forward is a
divergence too. The cost is one Python call per saved tensor in forward and in replay, under 1 µs each
(benchmarks/host_overhead.py measures it per layer). Torch's own check (the
metadata of every saved tensor, kept in forward under ``no_grad`` and compared after the replay: about as
much again) holds nothing this one does not, nor does it for the selective modes, whose replays are checked
op by op (policy.py): every eager region passes ``determinism_check="none"``.
Tensors made by an excluded module (NOTE [Excluded modules] in recompute.py) are made outside the region
in the replay (they are returned from the forward), so there an entry made outside the replay matches
any maker. Which ops a composite op becomes depends on whether a dispatch mode is active (``reshape`` is
``_reshape_alias`` without one and ``view`` under one; other composites choose out-of-place variants for
"tensor subclass-like" inputs): the reshape family is one maker, and a replay whose dispatch-mode state
differs from its forward's (a memory meter or ``FlopCounterMode`` around the forward only) is compared by
shape and dtype alone, as torch's own check does.

NOTE [Autocast casts served from the cache]
Inside an autocast region torch caches the lower-precision cast of each leaf that requires grad (a
weight): the first use casts (``aten._to_copy``), later uses in the same region take the cached cast.
A replay runs in backward under a fresh autocast region, so where the forward's cast was served from
the cache (a weight cast by an earlier layer that shares it, a second autocast block in one layer), the
replay casts, and where the forward cast, a replay inside the user's autocast region may be served.
Either way the values are equal: a cast of a leaf is no divergence. The selective replay accounts for
such casts (:func:`cast_of_a_leaf`: one side's ``_to_copy`` that the other lacks is run, or skipped, not
matched), and the fingerprint counts a cast of a leaf as made outside the region. Disabling the cache
instead would give each use of a weight a cast of its own, whose gradients are summed in float32
instead of the cast's dtype: not the un-applied gradients.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

from ..errors import RecomputeMismatchError

__all__ = ["FIELDS", "NODE_MAKERS", "RESHAPES", "armed_check", "cast_of_a_leaf", "divergence", "full_replay_contexts",
           "maker", "node_maker"]

_LIKELY_CAUSES = (
    "The layer's training forward reads state that changed between its forward and its replay and that hyperac "
    "does not restore (NOTE [Python state in the replay]): a module-level global, a class attribute, an object "
    "three levels below a module attribute, an iterator, an in-place write into a tensor or array held as a plain "
    "attribute; so running it again takes another path. Or it built a sub-module or parameter on its first call, "
    "which the replay does not build again: run one forward before hyperac.apply"
)


def divergence(layer: str, index: int | None, where: str, forward: str, replay: str,
               stacks: str = "") -> RecomputeMismatchError:
    """The error for a replay of ``layer`` (flat index ``index``) that differs from its forward at ``where``;
    ``stacks``: what to say instead of turning the layer off where a sharding stack's hooks ran in it
    (:func:`hyperac.lifecycle.stacks_note`), since every layer would diverge alike."""
    head = f"hyperac: the recompute of layer {layer!r} diverged from its forward at {where}: the forward {forward}, " \
        f"the recompute {replay}."
    if stacks:
        return RecomputeMismatchError(head + stacks)
    return RecomputeMismatchError(
        f"{head} {_LIKELY_CAUSES}. Return such values from the forward instead of storing them, or "
        "leave the layer out of recompute: hyperac.apply(model, ..., "
        f"layers={{{index if index is not None else '<index>'}: 'off'}}) for this one."
    )


_TO_COPY = torch.ops.aten._to_copy.default


def cast_of_a_leaf(op: Any, args: tuple, kwargs: dict | None = None) -> bool:
    """Whether ``op(*args, **kwargs)`` may be an autocast cast of a leaf, which autocast caches (NOTE
    [Autocast casts served from the cache]): a ``_to_copy`` of a leaf that requires grad, to another
    dtype. Without arguments (an op on a forward's tape), whether ``op`` is a ``_to_copy``. (Inside the
    op, autocast reads as disabled: its dispatch key is excluded while its kernel runs.)"""
    if op is not _TO_COPY:
        return False
    if not args:
        return True
    source, dtype = args[0], (kwargs or {}).get("dtype")
    return (isinstance(source, torch.Tensor) and source.is_leaf and source.requires_grad and dtype is not None
            and dtype != source.dtype)


RESHAPES = frozenset({"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0", "AliasBackward0",
                       "AsStridedBackward0"})
"""Nodes of ops that only give a tensor another shape over the same storage: which of them ``reshape``
becomes depends on what dispatches it (a dispatch mode active in forward, such as a memory meter, and not
in the replay, or the other way round), so they are one maker, ``"a reshape"``."""


NODE_MAKERS: dict[type, str] = {}
"""Each autograd node type's maker (its name, or ``"a reshape"``), where the type names one kind of node."""


def node_maker(node: Any) -> str:
    """The maker ``node``'s name gives (:data:`RESHAPES` are one), read once per node type: a node type of
    torch's own ops or of an ``autograd.Function`` is one kind of node, whose Python type has its name; a type
    shared by several kinds (C++ nodes without a Python type of their own) has another name, and is asked."""
    kind = type(node)
    name = NODE_MAKERS.get(kind)
    if name is None:
        own = node.name()
        name = "a reshape" if own in RESHAPES else own
        if kind.__name__ == own:
            NODE_MAKERS[kind] = name
    return name


def maker(tensor: torch.Tensor, first: int) -> str | None:
    """The name of the autograd node that made ``tensor`` in the region that started at sequence number
    ``first``, or ``None`` for a tensor made outside it (or an autocast cast of a leaf)."""
    node = tensor.grad_fn
    if node is None or node._sequence_nr() < first:
        return None
    name = node_maker(node)
    if name == "ToCopyBackward0":
        source = node.next_functions[0][0] if node.next_functions else None
        if source is None or source.name() == "torch::autograd::AccumulateGrad":
            return None
    return name


def _describe(entry: tuple[str | None, tuple[int, ...], torch.dtype] | None) -> str:
    if entry is None:
        return "saved nothing more"
    maker, shape, dtype = entry
    made = "a tensor made outside the region" if maker is None else f"the output of {maker}"
    return f"saved {made} ({str(dtype).removeprefix('torch.')} {list(shape)})"


class _Fingerprint:
    """What one region invocation's forward saved for backward (NOTE [Every replay is checked])."""

    __slots__ = ("entries", "index", "layer", "lenient", "under_modes")

    def __init__(self, layer: str, index: int | None, lenient: bool) -> None:
        self.entries: list[Any] = []
        """Each saved tensor's fingerprint, its :data:`FIELDS` items one after the other (no tuple per tensor)."""
        self.layer, self.index, self.lenient = layer, index, lenient
        self.under_modes = False
        """Whether the forward ran under a dispatch mode (NOTE [Every replay is checked])."""


class _Hooked:
    """Sees each tensor saved for backward while entered, through the region's hook pair (NOTE [One hook
    pair per region] in region_saves.py), which takes it with :func:`armed_check` as the region starts and
    lists each tensor's fingerprint in :attr:`entries`: ``maker(tensor, first), shape, dtype``, flat."""

    def __init__(self, fingerprint: _Fingerprint) -> None:
        self.fingerprint = fingerprint
        self.first = 0
        self.token: Any = None
        self.entries: list[Any] = []

    def __enter__(self) -> None:
        self.first = torch._C._autograd._get_sequence_nr()
        self.token = _armed.set(self)

    def __exit__(self, *exc: Any) -> None:
        _armed.reset(self.token)


_armed: contextvars.ContextVar[_Hooked | None] = contextvars.ContextVar("hyperac_armed_check", default=None)


def armed_check() -> _Hooked | None:
    """The fingerprint context entered for the region whose forward or replay starts now, taken: a region
    nested in it (which checkpoint gives contexts of its own) finds none."""
    check = _armed.get()
    if check is not None:
        _armed.set(None)
    return check


class _Recording(_Hooked):
    def __init__(self, fingerprint: _Fingerprint) -> None:
        super().__init__(fingerprint)
        self.entries = fingerprint.entries

    def __enter__(self) -> None:
        self.fingerprint.under_modes = torch._C._len_torch_dispatch_stack() > 0
        super().__enter__()


class _Checking(_Hooked):
    """A replay's fingerprint, compared with the forward's as the replay ends, in one comparison of the two
    lists where they are equal (the usual case), entry by entry where not; inside checkpoint's unpack,
    before any saved tensor of the replay reaches a gradient."""

    def __init__(self, fingerprint: _Fingerprint) -> None:
        super().__init__(fingerprint)
        self.by_metadata = False

    def __enter__(self) -> None:
        self.entries = []
        self.by_metadata = (torch._C._len_torch_dispatch_stack() > 0) != self.fingerprint.under_modes
        super().__enter__()

    def __exit__(self, exc_type: Any, exc: Any, *rest: Any) -> None:
        super().__exit__(exc_type, exc, *rest)
        if self.entries == self.fingerprint.entries:
            return
        replayed, entries = _fingerprints(self.entries), _fingerprints(self.fingerprint.entries)
        # A replay that stops early (checkpoint's early stop) raises out of the region having saved as many
        # tensors as the forward; one that raised otherwise is compared as far as it got, and its error is
        # the cause of a divergence found there.
        position = next((position for position, entry in enumerate(replayed)
                         if not self._matches(entry, entries[position] if position < len(entries) else None)), None)
        if position is not None:
            raise self._diverged(position, replayed[position]) from exc
        if exc_type is None and len(replayed) < len(entries):
            raise self._diverged(len(replayed), None)

    def _matches(self, entry: tuple[str | None, tuple[int, ...], torch.dtype],
                 expected: tuple[str | None, tuple[int, ...], torch.dtype] | None) -> bool:
        return entry == expected or (expected is not None and entry[1:] == expected[1:] and (
            self.by_metadata or (self.fingerprint.lenient and entry[0] is None)))

    def _diverged(self, position: int,
                  entry: tuple[str | None, tuple[int, ...], torch.dtype] | None) -> RecomputeMismatchError:
        fingerprint = self.fingerprint
        entries = _fingerprints(fingerprint.entries)
        expected = entries[position] if position < len(entries) else None
        return divergence(
            fingerprint.layer, fingerprint.index,
            f"tensor {position} of the {len(entries)} it saved for backward",
            _describe(expected), _describe(entry),
        )


FIELDS = 3
"""Items of one saved tensor's fingerprint: its maker, shape and dtype."""


def _fingerprints(entries: list[Any]) -> list[tuple[str | None, tuple[int, ...], torch.dtype]]:
    """The flat :attr:`_Fingerprint.entries` as one tuple per saved tensor."""
    return list(zip(*[iter(entries)] * FIELDS))


def full_replay_contexts(layer: str, index: int | None, lenient: bool) -> tuple[Any, Any]:
    """The (forward, replay) contexts of one ``full`` region invocation of ``layer`` (flat index ``index``)
    that check its replay (NOTE [Every replay is checked]); ``lenient`` for regions with excluded modules."""
    fingerprint = _Fingerprint(layer, index, lenient)
    return _Recording(fingerprint), _Checking(fingerprint)
