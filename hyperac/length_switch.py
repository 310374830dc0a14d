"""Plans per length bucket, switched at each training forward (``mode="auto"``, ``max_seq_len=``).

A plan made for the longest batch, ``max_seq_len``, recomputes more than a short batch needs: its
activations are a fraction of the long one's, so a plan with fewer recomputed layers fits the same
budget and runs faster. The planner makes one plan per length bucket from the same fitted costs
(NOTE [Bucket bounds] in hyperac/planner/lengths.py); this module runs the right one per step.

NOTE [Plans per length bucket]
At apply, every plan (one per bucket, and ``full`` on every layer for batches longer than
``max_seq_len``) is installed once, in turn, each through apply's one installation path, and what
each set on a module (its forward overrides) is collected; each module then gets one
:class:`SwitchedForward` holding those overrides by bucket, and the model a :class:`LengthSwitch`
forward pre-hook. At each training forward (grad enabled, ``model.training``) the pre-hook reads
the batch's length (its first tensor argument or keyword argument with more than ``seq_dim``
dimensions, that dimension) and sets the bucket, an index the applied state holds as data, and
on each switched module the override of that bucket (``current``), which the module calls. A
switch is an attribute write per switched module: nothing is installed, removed or compiled
per step. A layer's replay uses the mode its forward ran in, however
the bucket changes before its backward (accumulation of micro-batches of different lengths, or
interleaved pipeline stages): the mode's override builds the replay's contexts at the layer's
forward (``torch.utils.checkpoint`` keeps them with the saved tensors) and replays the layer's own
forward. Inside it, a submodule's override is read again; those that matter to a replay (a module
the region excludes, or forces to recompute) run the module's own forward where no region is
around it, so they stay installed in every bucket, and the replay finds them whatever the switch
did since. Evaluation and ``no_grad`` forwards switch nothing (each override then runs the
module's own forward). A training batch longer than ``max_seq_len``, one larger than the sample in
another dimension (the fit models the length only: a bigger batch), or one whose length cannot be
read, warns once per shape and runs the most memory-saving plan: ``full`` on every layer, swapping
where the default plan swaps; never the default plan over its budget, silently.

NOTE [Switching under torch.compile]
A user may compile the applied eager model: ``layer.compile()`` per layer, or
``torch.compile(model)``. Dynamo guards on what a traced frame reads. Were a switched module to
index its overrides by the bucket, every compiled layer (one code object for all of them) would
guard on the bucket's value and on the override there, a cache entry per (bucket, mode) pair,
past dynamo's ``recompile_limit`` (8) with four buckets, after which layers run uncompiled. It
reads ``current`` instead, so a layer guards on the override it calls, as an unswitched one
does, and compiles a graph per distinct mode (two: a first static shape, then dynamic). Under
``torch.compile(model)`` the pre-hook is traced too: the bucket is chosen by comparisons with the
length (``bisect``, a C builtin, would break the graph), and the model compiles a graph per
distinct plan (buckets with equal plans share one; ``full`` for longer batches is one more), plus
one for the first, static, shape: within the limit for up to 7 distinct plans (measured: 8
buckets on 2 layers, 3 distinct plans with ``full``, 4 graphs). This holds for ``off`` and ``full``
layers: a selective-family layer applied eagerly records its ops in a dispatch mode dynamo skips, a
graph break at that layer (exact gradients, uncompiled ops), as without buckets; compiled
selective layers come from ``compile=True``, which buckets do not support yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .errors import warn_once
from .planner.group import ALONE, PlanGroup
from .state import AppliedState, Installed, Override

__all__ = ["LengthSwitch", "SwitchedForward", "install_switched"]


class LengthSwitch(Installed):
    """Forward pre-hook on the model: each training forward runs the plan of the smallest length
    bucket that holds its batch (``bounds``: the buckets' upper bounds, ascending), or past the last
    one ``full`` on every layer, with a warning once per shape (NOTE [Plans per length bucket])."""

    def __init__(self, owner: AppliedState, bounds: tuple[int, ...], seq_dim: int,
                 batch_shape: tuple[int, ...] | None, switched: tuple[SwitchedForward, ...],
                 group: PlanGroup = ALONE) -> None:
        self.owner, self.fqn = owner, ""
        self.bounds, self.seq_dim, self.batch_shape, self.switched = bounds, seq_dim, batch_shape, switched
        self.group = group

    def __call__(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        tensors = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        first = next((v for v in tensors if v.dim() > self.seq_dim), None)
        outside = self._outside(first, tensors)
        # bisect_left, which dynamo cannot trace (NOTE [Switching under torch.compile])
        bucket = len(self.bounds) if outside is not None else sum(
            1 for bound in self.bounds if bound < first.shape[self.seq_dim])
        self._switch(self.group.agreed_bucket(bucket, tensors[0].device if tensors else torch.device("cpu")))
        if outside is None:
            return
        what, fix = outside
        warn_once(f"hyperac: a training batch {what}, so it runs full recompute on every layer (the most memory-saving "
                  f"plan), which may still exceed the budget; {fix}", self.owner.warned, stacklevel=4)

    def _switch(self, bucket: int) -> None:
        self.owner.bucket = bucket
        for forward in self.switched:
            forward.current = forward.variants[bucket]

    def _outside(self, first: torch.Tensor | None, tensors: list[torch.Tensor]) -> tuple[str, str] | None:
        """What puts the batch outside the plans, and the fix; ``None`` if a bucket holds it."""
        dim, longest = self.seq_dim, self.bounds[-1]
        if first is None:
            return (f"with tensor arguments of shapes {[list(t.shape) for t in tensors]} has none with a dimension "
                    f"{dim} to read its sequence length from", "name the sequence dimension with seq_dim= in apply.")
        length = first.shape[dim]
        if length > longest:
            return (f"of shape {list(first.shape)} has {length} positions in dimension {dim}, more than the "
                    f"max_seq_len={longest} the plan was made for",
                    f"apply mode='auto' again with max_seq_len={length} or more.")
        shape = self.batch_shape
        if shape is not None and first.dim() == len(shape) and any(
                n > limit for i, (n, limit) in enumerate(zip(first.shape, shape)) if i != dim):
            return (f"of shape {list(first.shape)} is larger than the shape {list(shape)} the plans were made for in a "
                    f"dimension other than {dim}, which the costs fitted to the length do not model",
                    "apply mode='auto' again with a sample of that shape.")
        return None


class SwitchedForward(Override):
    """A module's forward per length bucket: ``variants[bucket]`` is the override that bucket's plan
    installed on the module, ``None`` where it left the module's own forward; ``current``, the one
    of the bucket the switch last set (NOTE [Plans per length bucket])."""

    def __init__(self, module: nn.Module, owner: AppliedState, fqn: str, variants: tuple[Override | None, ...]) -> None:
        super().__init__(module, owner, fqn)
        self.variants, self.current = variants, variants[owner.bucket]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        variant = self.current
        if variant is None:
            return self.module_and_forward()[1](*args, **kwargs)
        return variant(*args, **kwargs)


def install_switched(modules: list[tuple[str, nn.Module]], owner: AppliedState, plans: int,
                     install: Callable[[int], None]) -> tuple[SwitchedForward, ...]:
    """Install ``plans`` plans to switch between: ``install(k)`` installs plan ``k`` as if alone;
    what it set on each of ``modules`` is collected, then a :class:`SwitchedForward` holds it
    (NOTE [Plans per length bucket]). Returns them, for the :class:`LengthSwitch`."""
    collected: dict[int, tuple[str, nn.Module, list[Override | None]]] = {}
    for k in range(plans):
        install(k)
        for fqn, module in modules:
            override = module.__dict__.get("forward")
            if isinstance(override, Override) and override.owner is owner:
                override.restore(module)
                collected.setdefault(id(module), (fqn, module, [None] * plans))[2][k] = override
    for _, _, variants in collected.values():
        present = [variant for variant in variants if variant is not None]
        if all(variant.inert_outside_regions for variant in present):
            # A module a region excludes (or forces) keeps that override in every plan: the replay of a
            # region recorded under one bucket may run after the switch to a bucket without it.
            variants[:] = [present[0] if variant is None else variant for variant in variants]
    switched = tuple(SwitchedForward(module, owner, fqn, tuple(variants)) for fqn, module, variants in
                     collected.values())
    for forward in switched:
        forward.install()
    return switched
