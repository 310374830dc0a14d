"""Profile a deep stack of identical layers on ``meta`` through a prefix of it.

NOTE [A prefix of a deep stack]
``hyperac plan --preset llama-3-70b`` builds 80 decoder layers on ``meta``, and each profiled step
ran all of them: about 270 ops a layer, each through torch's Python meta functions and the
profiler, 5.5 s of CPU for the two steps (of 8.3 s for the command after its imports). The profile
needs one layer of each kind (NOTE [Identical layers measured once] in :mod:`.profile`): so where
every layer is in one container and all share one structure (class, parameter and buffer names,
shapes, dtypes), the container holds only its first ``PREFIX_LAYERS`` children while the profiled
steps run (removed and put back with ``delattr``/``register_module``, in order), and the profiles
are extended to the whole stack: the prefix's last layer stands for the stack's last (the one whose
output the head reads), the one before it for every layer in between. Residuals are taken against
the kept bytes of the layers behind (NOTE [Peak phases]), so depth leaves them alone but for one
thing: without recompute a layer's backward residual grows by a fixed amount per layer whose
backward already ran (tiny Llama: one hidden-state-sized tensor each), and so does the residual
after the last backward. That growth is read off the prefix (its first two layers) and added per
layer of the whole stack.

The extension is checked before it is used: a prefix one layer longer is profiled too, and it must
be exactly what the shorter prefix's extension predicts for it (kept bytes, residuals, FLOPs, ops,
the roofline's work, outside the layers); where it is not, or where the model's forward fails
without all its layers (it indexes them up to a count of its own), every layer is profiled. Four steps on
seven layers or fewer instead of two on 80: 0.8 s of CPU for llama-3-70b.

Only on ``meta``, where seconds are a roofline of each op's FLOPs and bytes: layers that differ only
in what a mask selects (sliding-window against full attention) cost the same there, attention being
costed as one fused kernel over the whole length (NOTE [Fused attention on meta]). On real tensors
every layer runs, and layers of one structure that do different work stay apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence

from torch import nn

from ..discovery import Layer
from .profile import _PER_LAYER, ModeProfile, structure

__all__ = ["PREFIX_LAYERS", "extended", "prefix_length", "prefix_only", "profiled_stack"]

PREFIX_LAYERS = 6
"""Layers profiled of a deep stack: four members for the four modes besides ``off`` in one step,
plus a last layer, with a first and middle ones around them."""


def prefix_length(layers: Sequence[Layer]) -> int:
    """How many of ``layers`` the profiled steps run (NOTE [A prefix of a deep stack])."""
    if len(layers) <= PREFIX_LAYERS or len({layer.container for layer in layers}) != 1:
        return len(layers)
    if len({structure(layer.module) for layer in layers}) != 1:
        return len(layers)
    return PREFIX_LAYERS


@contextlib.contextmanager
def prefix_only(model: nn.Module, layers: Sequence[Layer], length: int) -> Iterator[None]:
    """In the body, the container of ``layers`` holds only the first ``length`` of them."""
    container = model.get_submodule(layers[0].container)
    names = [layer.fqn.removeprefix(f"{layers[0].container}.") for layer in layers]
    children = dict(container._modules)  # the order too: a child after the layers (a final norm) stays last
    for name in names[length:]:
        delattr(container, name)
    try:
        yield
    finally:
        container._modules.clear()
        container._modules.update(children)


def _source(index: int, length: int, count: int) -> int:
    """The prefix position (``length`` layers) that stands for position ``index`` of ``count``."""
    if index < length - 1:
        return index
    return length - 1 if index == count - 1 else length - 2


def extended(profiles: dict[str, ModeProfile], length: int, count: int) -> dict[str, ModeProfile]:
    """Profiles of a ``length``-layer prefix as the profiles of the whole ``count``-layer stack
    (NOTE [A prefix of a deep stack]: backward residuals grow by the prefix's own step per layer
    behind in backward)."""
    if length == count:
        return profiles
    sources = {index: _source(index, length, count) for index in range(count)}
    behind = {**sources, count: length}  # outside_peak: by layers behind, 0..count

    def layer_flops(profile: ModeProfile, position: int) -> int:
        return sum(flops for flops, _, _ in profile.work.get(position, ()))

    def growth(profile: ModeProfile) -> int:  # backward residual per further layer whose backward ran
        return profile.backward_peak.get(0, 0) - profile.backward_peak.get(1, 0)

    result = {}
    for mode, profile in profiles.items():
        tables = {}
        for field in _PER_LAYER:
            table = getattr(profile, field)
            tables[field] = {index: table[source] for index, source in sources.items() if source in table}
            if None in table:
                tables[field][None] = table[None]
        for index, source in sources.items():  # layers whose backward ran before this one's
            if index in tables["backward_peak"]:
                tables["backward_peak"][index] += growth(profile) * ((count - 1 - index) - (length - 1 - source))
        peaks = profile.outside_peak  # off's, for every mode (profile_modes)
        outside = {key: peaks[source] for key, source in behind.items() if source in peaks}
        outside[0] = outside.get(0, 0) + growth(profiles["off"]) * (count - length)  # after every layer's backward
        total = profile.total_flops + sum(layer_flops(profile, source) for source in sources.values()) - sum(
            layer_flops(profile, position) for position in range(length))
        result[mode] = dataclasses.replace(profile, **tables, outside_peak=outside, total_flops=total)
    return result


def profiled_stack(model: nn.Module, layers: Sequence[Layer], on_meta: bool,
                   profile: Callable[[Sequence[Layer]], dict[str, ModeProfile]]) -> dict[str, ModeProfile]:
    """``profile(layers)``, or on ``meta`` its extension from a prefix, where a prefix one layer
    longer gives exactly what the extension predicts for it (else every layer is profiled)."""
    length = prefix_length(layers) if on_meta else len(layers)
    if length == len(layers):
        return profile(layers)
    try:
        with prefix_only(model, layers, length):
            short = profile(layers[:length])
        with prefix_only(model, layers, length + 1):
            longer = profile(layers[:length + 1])
    except Exception:  # noqa: BLE001 - a forward that needs every layer (indexes them up to a count): profile all
        return profile(layers)
    if extended(short, length, length + 1) == longer:
        return extended(longer, length + 1, len(layers))
    return profile(layers)
