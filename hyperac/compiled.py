"""``compile=True``: what each plan letter becomes in the compiled graph, and swap carried into it.

Under ``torch.compile`` hyperac's eager machinery (recording and replay modes, swap hooks) cannot
run inside a graph, so each mode maps to a mechanism the compiler itself honours:

* ``full``: a ``torch.utils.checkpoint`` region; the backward graph replays every forward op but the
  routing ops, whose outputs it saves (NOTE [Routing is kept] in replay/routing.py);
* ``selective``, ``selective-even``, ``pointwise``: the same region with PyTorch's selective
  checkpoint contexts around hyperac's counting policy: its decisions become the ``recompute`` tags
  of the op nodes, which the partitioner obeys (NOTE [Selective recompute under torch.compile] in
  policy.py), so the three keep what their eager versions keep and differ in saved bytes;
* ``knapsack-0.25``, ``knapsack-0.5``, ``knapsack-0.75``: no checkpoint region; the layer's graph
  gets torch's own partitioner knapsack at that activation budget (NOTE [Knapsack layers]). These
  exist only compiled: eagerly the layer keeps what ``off`` keeps;
* swap: torch's activation offloading. The policy tags what a swapping layer keeps with
  ``CheckpointPolicy.MUST_CPU_OFFLOAD`` (``PREFER_CPU_OFFLOAD`` for a ``swap`` layer, which keeps
  what the partitioner would keep anyway), and :class:`OffloadMarker`, a joint-graph pass, turns
  the tag into the ``meta["should_offload"]`` marker that makes the partitioner insert the
  device-to-host copies after the forward op and the reloads before the backward op
  (NOTE [Swap under torch.compile]).

NOTE [Swap under torch.compile]
torch 2.13 has the pieces but nothing connects them: ``MUST_CPU_OFFLOAD`` is read by nothing (the
partitioner treats the node as untagged), and ``torch._functorch.config.enable_activation_offloading``
offloads only nodes marked ``should_offload``, which nothing sets. The pass and the options live
in ``torch._functorch.config``, which is process-wide and read when a graph is compiled (after
dynamo traced the layer, outside hyperac's code), so they cannot be scoped to one call. They are
reference-counted per applied model instead: each applied model that swaps under compile holds an
:class:`OffloadLease` in its state, a copy of the model (``copy.deepcopy``, pickle) takes a lease of
its own, and the options stay set while any lease is held; the last one released (by ``remove``,
or when its model is garbage-collected unremoved) restores what was there before:

* the pass chains after a pass the user set (``joint_custom_pass``), never replaces it, and marks
  only nodes carrying hyperac's tags, so graphs of other models are unchanged;
* offloading runs on a separate stream (``activation_offload_separate_stream``), with reloads
  prefetched by a schedule sized from the host link bandwidth hyperac uses for its own swap costs
  (``activation_offload_cpu_gpu_bw``, in GB/s);
* ``joint_custom_pass`` is not part of AOTAutograd's cache key: a graph compiled earlier in the
  process without the pass is reused as it was. Compile after apply.

The copies are ``device_put`` nodes: on CPU they are present in the graph but move nothing (the
tests inspect them there); the stream path needs an accelerator.

NOTE [Knapsack layers]
hyperac's own compiled menu tags ops by kind (matmuls saved, pointwise ops recomputed), so it
cannot express the saved set torch's min-cut knapsack finds for a layer (on the hidden-512 Llama,
q/k after RoPE and the norms' rsqrt saved, where ``pointwise`` saves the projections and
recomputes RoPE and the norm reductions). A ``knapsack-b`` layer runs its forward inside
``torch.autograd.graph.region_activation_memory_budget(b)`` (a prototype in torch 2.13), which
gives that graph the budget torch's global ``activation_memory_budget`` would: ``b`` of the way
from recomputing everything (0) to the partitioner's default saved set (1). torch accepts the
annotation only when it covers every forward op of a graph, so the region starts with a graph
break: under per-layer compile (``layer.compile()``) the layer's graph is the region; under
whole-model compile the model's graph splits around each knapsack layer. ``fullgraph=True``
refuses the break, per layer too (``torch.compile(block, fullgraph=True)``, as torchtitan
compiles), with hyperac's reason and fix as dynamo's message. A region takes a budget or a
selective-checkpoint policy, not both (torch rejects the mix), so these layers have no checkpoint
region. The grid 0.25 / 0.5 / 0.75 lies
between hyperac's other options (one-layer Llama, hidden 64: off 302 KB, knapsack 236 / 211 /
153 KB, full 104 KB). ``mode="auto"`` does not plan them (planner/compiled.py says why): a user
names them with ``layers=`` or ``plan=``.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.checkpoint import CheckpointPolicy

from .config import KNAPSACK_MODES
from .errors import ConfigError, TorchVersionError

__all__ = ["MECHANISMS", "OffloadLease", "OffloadMarker", "knapsack_available", "mechanism_note",
           "offloading_available", "release_offloading", "require_knapsack", "require_offloading"]

MECHANISMS = {
    "full": "checkpoint region (backward replays every op but routing ops, whose outputs are saved)",
    "selective": "SAC tags: odd matmuls (and attention worth its bytes) MUST_SAVE, the rest recomputed",
    "selective-even": "SAC tags: even matmuls (and attention worth its bytes) MUST_SAVE, the rest recomputed",
    "pointwise": "SAC tags: every matmul and attention MUST_SAVE, pointwise ops recomputed",
    "knapsack-0.25": "torch's partitioner knapsack at budget 0.25 for the layer's graph",
    "knapsack-0.5": "torch's partitioner knapsack at budget 0.5 for the layer's graph",
    "knapsack-0.75": "torch's partitioner knapsack at budget 0.75 for the layer's graph",
    "swap": "activation offloading: kept tensors tagged MUST_CPU_OFFLOAD (swap layers PREFER_) -> should_offload",
}
"""What ``compile=True`` compiles each mode to (``print(plan)`` shows the modes a plan uses)."""

_OPTIONS = ("joint_custom_pass", "enable_activation_offloading", "activation_offload_separate_stream",
            "activation_offload_cpu_gpu_bw")


def mechanism_note(modes: Sequence[str], swaps: Sequence[bool]) -> str:
    """The plan note of a ``compile=True`` apply: the mechanism of each mode it uses."""
    used = [mode for mode in MECHANISMS if mode in modes and mode != "swap"]
    parts = [f"{mode} = {MECHANISMS[mode]}" for mode in used]
    if any(swaps):
        parts.append(f"swap = {MECHANISMS['swap']}")
    return "under torch.compile: " + "; ".join(parts) if parts else "under torch.compile: nothing to change"


def knapsack_available() -> bool:
    """Whether this torch gives one compiled region its own activation budget (NOTE [Knapsack layers])."""
    return hasattr(torch.autograd.graph, "region_activation_memory_budget")


def require_knapsack(modes: Sequence[str], compile: bool | str) -> None:
    """Refuse knapsack modes without ``compile`` (:class:`ConfigError`) or on a torch without
    region budgets (:class:`TorchVersionError`)."""
    used = sorted({mode for mode in modes if mode in KNAPSACK_MODES})
    if used and not compile:
        raise ConfigError(
            f"the modes {used} are torch's partitioner knapsack, which exists only in a compiled graph, but "
            "Config.compile is False; apply with compile=True (or a backend name) and compile the layers, or "
            "use an eager mode such as 'selective' for those layers."
        )
    if used and not knapsack_available():
        raise TorchVersionError(
            f"the modes {used} need torch.autograd.graph.region_activation_memory_budget, which torch "
            f"{torch.__version__} lacks; use torch 2.13 or newer, or a mode such as 'pointwise' for those layers."
        )


def offloading_available() -> bool:
    """Whether this torch has the activation offloading a compiled swap needs."""
    config = torch._functorch.config
    return all(hasattr(config, name) for name in _OPTIONS) and hasattr(CheckpointPolicy, "MUST_CPU_OFFLOAD")


class OffloadMarker:
    """The joint-graph pass: ``*_CPU_OFFLOAD`` tags become the ``should_offload`` marker (NOTE [Swap
    under torch.compile]). Runs the pass it replaced first; restores the options it changed when the
    last :class:`OffloadLease` on it is released."""

    def __init__(self, previous: dict[str, Any]) -> None:
        self.previous = previous
        self.users = 0

    def __call__(self, graph: torch.fx.GraphModule, inputs: Any) -> torch.fx.GraphModule:
        user_pass = self.previous["joint_custom_pass"]
        if callable(user_pass):
            graph = user_pass(graph, inputs)
        for node in graph.graph.nodes:
            tag = node.meta.get("recompute")
            if tag == CheckpointPolicy.MUST_CPU_OFFLOAD:
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE  # saved, on the host
                node.meta["should_offload"] = True
            elif tag == CheckpointPolicy.PREFER_CPU_OFFLOAD:
                node.meta.pop("recompute")  # the partitioner chooses, as for an untagged op
                node.meta["should_offload"] = True
        return graph


class OffloadLease:
    """One applied model's hold on activation offloading (NOTE [Swap under torch.compile]): taken at
    apply, released by :meth:`release` (remove) or when dropped unreleased (the model was
    garbage-collected). A copy (``copy.deepcopy``, pickle) is a new lease with the same settings, so
    a copied model keeps offloading after the original is removed, also in another process."""

    def __init__(self, link_bandwidth: float, separate_stream: bool) -> None:
        self.settings = (link_bandwidth, separate_stream)
        marker = _acquire(link_bandwidth, separate_stream)
        self.release = weakref.finalize(self, _release, marker)

    def __reduce__(self) -> tuple:
        return OffloadLease, self.settings


def require_offloading(link_bandwidth: float, separate_stream: bool) -> OffloadLease:
    """Turn on activation offloading with hyperac's marker pass (NOTE [Swap under torch.compile]);
    ``link_bandwidth`` in bytes/s sizes the reload prefetch; ``separate_stream``: copy on a side
    stream (an accelerator; on CPU the synchronous ``device_put`` path). Returns the applied model's
    lease, to hand back to :func:`release_offloading` at remove."""
    return OffloadLease(link_bandwidth, separate_stream)


def _acquire(link_bandwidth: float, separate_stream: bool) -> OffloadMarker:
    if not offloading_available():
        raise TorchVersionError(
            f"swap under compile=True needs torch's activation offloading (torch._functorch.config."
            f"enable_activation_offloading, joint_custom_pass, CheckpointPolicy.MUST_CPU_OFFLOAD), which torch "
            f"{torch.__version__} lacks; use torch 2.13 or newer, or compile=False (eager swap)."
        )
    config = torch._functorch.config
    marker = config.joint_custom_pass
    if not isinstance(marker, OffloadMarker):
        marker = OffloadMarker({name: getattr(config, name) for name in _OPTIONS})
        config.joint_custom_pass = marker
        config.enable_activation_offloading = True
        config.activation_offload_separate_stream = separate_stream
        if math.isfinite(link_bandwidth):
            config.activation_offload_cpu_gpu_bw = link_bandwidth / 1e9
    marker.users += 1
    return marker


def release_offloading(lease: OffloadLease) -> None:
    """Undo one :func:`require_offloading`; the last one restores the options as they were. Releasing
    a lease twice releases it once."""
    lease.release()


def _release(marker: OffloadMarker) -> None:
    marker.users -= 1
    config = torch._functorch.config
    if marker.users == 0 and config.joint_custom_pass is marker:
        for name, value in marker.previous.items():
            setattr(config, name, value)
