"""One plan per job: ``mode="auto"`` as a collective over the ranks that train together, at the
price of a small ``all_gather_object`` per planning step (and, with length buckets, an all-reduce
of one integer per training forward), and of every rank planning for the slowest one.

Ranks that plan apart install different plans: each times its own layers, on a host whose speed
drifts, and a rank with another plan runs other recompute. A layer holding collectives (TP, SP,
EP, ZeRO-3, FSDP) then deadlocks or trains apart. So when ``torch.distributed`` is initialised,
the planner runs over a process group (design invariant 20).

NOTE [One plan per job]
Every rank of the group runs the same planning, and the ranks meet at agreed points, each one
:meth:`PlanGroup.gather`: every rank runs its part, then all of them exchange the results (or
the error a rank raised) with one ``all_gather_object``. The points are: the options (budget,
sample shapes, length and swap options, ``compile``, the backend and the layers found must be the
same on every rank, else every rank raises :class:`~hyperac.ConfigError`; the pinned host budget is
the least of any rank's), each profiled and each timed step, compiled ones too (so that a step,
whose layers may run collectives, is never entered by some ranks only), the end of each timed
round (the rounds stop when every rank would stop, NOTE [When the rounds stop] in profile.py),
the groups of identical layers (layers alike on every rank), the cost model of each rank (the
job's is the slowest rank's: per layer and mode, the largest seconds, bytes and FLOPs any rank
measured, :func:`slowest`), and the installation. Every rank then solves the same cost model
with the same deterministic solver and installs the same plan. With length buckets each training
forward runs the bucket of the group's longest batch (:meth:`PlanGroup.agreed_bucket`), so the
ranks never run different plans in one step. A rank that raises at any of
these makes every rank raise: its own error there, :class:`~hyperac.RankFailedError` naming it
on the others (each undoes what it installed). What a rank cannot report is a failure inside
a step while the other ranks wait in a collective of that step: they wait there until the
process group's timeout, as they would in training.

A plan made by a group is its group's: :attr:`hyperac.Plan.group_size` records how many ranks
made it. The budget is per process: each rank's activations must fit it, and the job's cost
model holds the most any rank keeps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist

from ..budget import parse_budget
from ..errors import ConfigError, RankFailedError

if TYPE_CHECKING:
    from .cost import Estimate

__all__ = ["ALONE", "PlanGroup", "agree_on_options", "plan_group", "slowest"]

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class PlanGroup:
    """The ranks that plan together (``group=None`` and ``size == 1``: this process alone)."""

    group: Any = None
    size: int = 1
    rank: int = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> PlanGroup:
        return self  # a copy of an applied model in this process switches buckets with the same ranks

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A process group does not pickle: a model a group planned, loaded elsewhere, agrees over that
        # process's default group; one planned alone stays alone (it runs no collective to switch buckets).
        return (PlanGroup, ()) if self.size == 1 else (plan_group, (None,))

    def agreed_bucket(self, bucket: int, device: torch.device) -> int:
        """The largest of the ranks' length buckets: every rank runs the plan for the longest batch of
        the step (NOTE [Plans per length bucket] in hyperac/length_switch.py)."""
        if self.size == 1:
            return bucket
        largest = torch.tensor([bucket], device=device)
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=self.group)
        return int(largest.item())

    def run(self, compute: Callable[[], T], what: str) -> T:
        """``compute()`` on this rank, then a meeting of every rank (NOTE [One plan per job]): if any
        rank raised, every rank raises, its own error or :class:`RankFailedError`."""
        result: T = self._meet(compute, what, share=False)[self.rank]
        return result

    def gather(self, compute: Callable[[], T], what: str) -> list[T]:
        """As :meth:`run`, and every rank's result, in rank order."""
        return self._meet(compute, what, share=True)

    def all(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` holds on every rank."""
        return all(self.gather(lambda: flag, what))

    def any(self, flag: bool, what: str) -> bool:
        """Whether ``flag`` holds on some rank."""
        return any(self.gather(lambda: flag, what))

    def _meet(self, compute: Callable[[], T], what: str, share: bool) -> list[Any]:
        if self.size == 1:
            return [compute()]
        error = None
        try:
            value = compute()
        except Exception as raised:  # reported to every rank, then raised here again
            value, error = None, raised
        everything: list[Any] = [None] * self.size
        mine = (value if share else None, None if error is None else f"{type(error).__name__}: {error}")
        dist.all_gather_object(everything, mine, group=self.group)
        if error is not None:
            raise error
        failed = [(rank, message) for rank, (_, message) in enumerate(everything) if message is not None]
        if failed:
            rank, message = failed[0]
            raise RankFailedError(
                f"rank {rank} of the {self.size} ranks planning mode='auto' together failed {what}: {message}. Every "
                "rank of the group raises (this one installed nothing); fix that rank's error and apply again on every "
                "rank."
            )
        everything[self.rank] = (value, None)
        return [result for result, _ in everything]


ALONE = PlanGroup()
"""This process planning alone."""


def plan_group(requested: Any) -> PlanGroup:
    """The group ``mode="auto"`` plans over: ``requested`` (``Config.group``), else the default group
    where ``torch.distributed`` is initialised, else this process alone."""
    if not (dist.is_available() and dist.is_initialized()):
        if requested is not None:
            raise ConfigError(
                f"Config.group={requested!r} names a process group, but torch.distributed is not initialised in this "
                "process; call torch.distributed.init_process_group first, or drop group=."
            )
        return ALONE
    group = requested if requested is not None else dist.group.WORLD
    if group is dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ConfigError(f"Config.group={requested!r} does not hold this rank; pass the group of the ranks that hold "
                          "this rank's layers (a pipeline stage's group on a pipeline stage).")
    return PlanGroup(group, dist.get_world_size(group), dist.get_rank(group))


def _shapes(sample: Any) -> Any:
    """What must match across ranks in a sample: its tensors' shapes and dtypes, by key."""
    if callable(sample) and not isinstance(sample, Mapping):
        return "a callable"
    return {key: (tuple(value.shape), str(value.dtype)) if isinstance(value, torch.Tensor) else type(value).__name__
            for key, value in sample.items()}


def _budget(budget: Any) -> Any:
    parsed = parse_budget(budget)
    return parsed if parsed >= 0 else f"{parse_budget(budget, 10**6) / 10**4:g}% of the no-recompute peak"


def agree_on_options(plan_group: PlanGroup, budget: Any, sample: Any, layer_names: Sequence[str],
                     others: dict[str, Any]) -> None:
    """Refuse, on every rank, options that differ between the ranks of the group (NOTE [One plan per
    job]): ``budget``, the shapes of ``sample``, the layers found and ``others`` (by name, e.g.
    ``{"max_seq_len=": 4096}``)."""
    if plan_group.size == 1:
        return
    mine = {"budget=": _budget(budget), "sample= shapes": _shapes(sample), **others,
            "the layers found": list(layer_names)}
    everything = plan_group.gather(lambda: mine, "checking its options")
    for name, value in mine.items():
        # Ranks on other planning paths (one holds the LM head, one compiles) send other names: absent differs.
        differ = {rank: options.get(name, "not given") for rank, options in enumerate(everything)
                  if options.get(name, "not given") != value}
        if differ:
            rank, other = next(iter(differ.items()))
            hint = ("pass group= the ranks that hold the same layers (a pipeline stage's group)"
                    if name == "the layers found" else f"give every rank the same {name.split()[0]}")
            raise ConfigError(
                f"mode='auto' plans one plan for the {plan_group.size} ranks of its group, so {name} must be the same "
                f"on each, but rank {plan_group.rank} has {value!r} and rank {rank} {other!r}; {hint}."
            )


def slowest(estimates: Sequence[Estimate], size: int) -> Estimate:
    """The job's cost model from every rank's: per layer and mode the most seconds, bytes and FLOPs
    any rank measured, so that the plan fits every rank and is timed at the slowest (NOTE [One plan
    per job])."""
    if len(estimates) == 1:
        return estimates[0]
    first = estimates[0]

    def most(values: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return {key: max(value[key] for value in values) for key in values[0]}

    layers = tuple(
        dataclasses.replace(
            layer,
            kept_bytes=most([e.layers[p].kept_bytes for e in estimates]),
            recompute_flops=most([e.layers[p].recompute_flops for e in estimates]),
            forward_peak_bytes=most([e.layers[p].forward_peak_bytes for e in estimates]),
            backward_peak_bytes=most([e.layers[p].backward_peak_bytes for e in estimates]),
            seconds=most([e.layers[p].seconds for e in estimates]),
            noise_seconds=max(e.layers[p].noise_seconds for e in estimates),
            route_bytes=max(e.layers[p].route_bytes for e in estimates),
            offload_storages={mode: max((e.layers[p].offload_storages[mode] for e in estimates), key=sum)
                              for mode in layer.offload_storages},
        )
        for p, layer in enumerate(first.layers)
    )
    return dataclasses.replace(
        first, layers=layers, outside_bytes=max(e.outside_bytes for e in estimates),
        link_bandwidth=min(e.link_bandwidth for e in estimates),
        base_flops=max(e.base_flops for e in estimates),
        outside_peak_bytes=tuple(map(max, zip(*(e.outside_peak_bytes for e in estimates)))),
        outside_seconds=max(e.outside_seconds for e in estimates),
        timing=f"{first.timing}, the slowest of {size} ranks per layer and mode",
    )
