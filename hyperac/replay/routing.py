"""Routing is taken from the forward: a replay routes tokens as its forward did, in every mode.

NOTE [Routing is kept]
An MoE router picks experts with ``topk`` on scores it has just computed. On an accelerator the
replay's scores can differ from the forward's in the last bits (atomics in the previous layer's expert
combine, split-K matmuls), and ``topk`` then sends some tokens elsewhere: the replay computes another
function than the forward, its gradients are wrong with no error, and with expert parallelism the
all-to-all split sizes no longer match the other ranks' (torchtitan and NeMo users report it; plain
``torch.utils.checkpoint`` has the same flaw). So what decides a data-dependent route (``topk``,
``sort``/``argsort``, ``argmax``/``argmin``, ``max``/``min`` over a dimension, ``kthvalue``, ``nonzero``
and the ``where(mask)`` built on it, ``bincount``, ``histc``, ``unique``, ``.item()``; the list is
``_ROUTING_OPS`` in policy.py) is kept from the forward and handed to the replay, whatever the replay's
inputs to it. Counts and split sizes made from kept routes (``.tolist()`` of a kept ``bincount``, a
``sort`` of kept expert ids) follow. A comparison whose mask feeds arithmetic rather than an index is
no route and is recomputed.

* The selective modes keep these outputs on their tape like a kept matmul, never pruned (NOTE [Never
  keep more than off] in policy.py), and hand each to every replay as a copy, a second backward
  through a retained graph included. A router that writes into its ``topk`` output in place
  (Mixtral's ``router_top_value /= ...``) is exact: the tape holds the value ``topk`` returned (NOTE
  [Writes into kept outputs] in policy.py).
* ``full`` keeps only the layer input, and on a layer that routes, its routes: a dispatch mode
  (:class:`_KeptRoutes`) watches the region's forward for routing ops and keeps a copy of each output;
  the replay's routing ops return them in order. A routing op a sharding stack's parameter hook runs
  (``.item()`` of a parameter's statistic, ``nonzero`` over which shards to gather) is the stack's, not a
  route, as in the selective modes' recording (NOTE [Parameter lifecycles are not the layer's program] in
  lifecycle.py), and in the planner's count of route bytes. Only a layer that ran such an op pays for it: the
  layer's first forward in training finds out, and a layer that routed nothing runs without the mode
  from then on (a layer that routes only on some calls must route on its first). A replay whose
  routing op differs from the forward's, or whose arguments the kept output no longer fits, raises
  :class:`~hyperac.RecomputeMismatchError` naming the layer and the op.
* ``off`` and ``swap`` have no replay; ``auto`` plans these modes, and its profile counts the kept
  routes in each mode's bytes (they are alive at backward like any kept output).

A layer that is no router but runs such an op (``.item()`` of a norm's scalar check, ``nonzero`` of a padding
mask) counts as one: it stays exact (its replay takes the forward's value, which is what the un-applied layer
used) and pays for it. In ``full`` it runs its forward and replays under the watch (one dispatch per op) and
keeps the op's output (a few bytes for a scalar), for good; in the selective modes the output is kept like a
kept matmul's. Telling such an op from a route would take following its output to an index or a shape, per
op; hyperac does not, as the cost is small where the output is a scalar or a mask.

``force_recompute=`` naming the router still wins: its routing ops keep nothing and are run again, and
the guarantee is given up for it; a route that then comes out otherwise raises where a kept output no
longer fits (NOTE [Kept outputs that no longer fit] in policy.py) or trains with the replay's route.
Layers applied with ``compile=True`` run PyTorch's selective checkpoint, ``full`` included (with
torch's own policy for a checkpoint region, recompute every op, but for routes): where AOTAutograd traces
the region (its proxy mode is on as the policy is asked) a routing op is ``MUST_SAVE``, and the
partitioner saves it, a router's in-place write into it functionalized in the graph; the backward graph
runs no ``topk``. Where the compiler splits the region at a graph break (HF's eager experts make one), the
part it runs eagerly recomputes its routes: PyTorch's eager selective checkpoint refuses a write into a
cached output, which routers make.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from ..policy import OpSets, _EagerMode, _shapes, bypass_replay, unfit
from .replay_check import divergence

__all__ = ["RoutesSeen", "routes_in_full"]


class RoutesSeen:
    """Whether one ``full`` layer routes (NOTE [Routing is kept]): ``None`` until its first forward in
    training, then whether that forward ran a routing op. Plain data, owned by the layer's context."""

    __slots__ = ("routes",)

    def __init__(self) -> None:
        self.routes: bool | None = None


class _Routes:
    """The routing ops of one region invocation's forward and a copy of each output, in order."""

    __slots__ = ("index", "layer", "ops", "outputs", "shapes")

    def __init__(self, layer: str, index: int | None) -> None:
        self.layer, self.index = layer, index
        self.ops: list[Any] = []
        self.outputs: list[Any] = []
        self.shapes: list[tuple] = []


def _copy(value: Any) -> Any:
    return tree_map_only(torch.Tensor, torch.clone, value)


class _KeptRoutes(_EagerMode):
    """The forward of a ``full`` region: runs every op, keeps a copy of what each routing op returned
    (a copy: the router may write into the output, as Mixtral's does into ``topk``'s values)."""

    def __init__(self, routes: _Routes, routing: frozenset, seen: RoutesSeen) -> None:
        super().__init__()
        self.routes, self.routing, self.seen = routes, routing, seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if id(func) not in self.routing or bypass_replay.get() or torch._C._current_graph_task_id() != self.task:
            return func(*args, **(kwargs or {}))
        if self.hook_ops.owns(args, False):
            return self._stack_op(func, args, kwargs or {})
        out = func(*args, **(kwargs or {}))
        self.routes.ops.append(func)
        self.routes.outputs.append(_copy(out))
        self.routes.shapes.append(_shapes(args))
        return out

    def __exit__(self, exc_type, exc_value, traceback):
        super().__exit__(exc_type, exc_value, traceback)
        if exc_type is None:  # a layer that routed once keeps its routes, also on a call that routes nothing
            self.seen.routes = bool(self.seen.routes) or bool(self.routes.ops)


class _ReplayedRoutes(_EagerMode):
    """The replay of a ``full`` region: each routing op returns a copy of what its forward returned (a
    copy: the replay may write into it, and a second backward replays again)."""

    def __init__(self, routes: _Routes, routing: frozenset) -> None:
        super().__init__()
        self.routes, self.routing = routes, routing
        self.cursor = 0

    def __enter__(self):
        self.cursor = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if id(func) not in self.routing or bypass_replay.get() or torch._C._current_graph_task_id() != self.task:
            return func(*args, **(kwargs or {}))
        if self.hook_ops.owns(args, False):
            return self._stack_op(func, args, kwargs or {})
        routes, position = self.routes, self.cursor
        self.cursor += 1
        where = f"routing op {position} of {len(routes.ops)}"
        if position >= len(routes.ops) or routes.ops[position] is not func:
            recorded = routes.ops[position] if position < len(routes.ops) else "nothing more"
            raise divergence(routes.layer, routes.index, where, f"ran {recorded}", f"ran {func}")
        if routes.shapes[position] != _shapes(args):  # NOTE [Kept outputs that no longer fit] in policy.py
            raise unfit(routes.layer, routes.index, f"{where} ({func})", routes.shapes[position], args)
        return _copy(routes.outputs[position])


def routes_in_full(seen: RoutesSeen, ops: OpSets, layer: str, index: int | None) -> tuple[Any, Any] | None:
    """The (forward, replay) dispatch modes that keep the routes of one ``full`` region invocation of ``layer``
    (flat index ``index``), or ``None`` where the layer routed nothing on its first forward (NOTE [Routing is
    kept])."""
    if seen.routes is False:
        return None
    routes = _Routes(layer, index)
    return _KeptRoutes(routes, ops.routing_ids, seen), _ReplayedRoutes(routes, ops.routing_ids)
