"""Plans for every sequence length up to a maximum: the cost model as a function of the length.

Activation memory grows with the sequence length, linearly (and quadratically where attention
materialises its scores), so a plan made for the sample's length exceeds its budget on the
first longer batch. With ``max_seq_len=L``, ``mode="auto"`` plans for ``L``: the planner profiles
the sample at its own length ``s`` and at ``s // 2`` and, per layer and mode, fits each byte and
FLOP count as ``a * n + b * n**2`` through the two (NOTE [Costs as functions of the length]),
then plans on the costs at ``L``. Memory only grows with the length, so that plan fits every batch
up to ``L``.

NOTE [Costs as functions of the length]
The fit has no constant term: activations, their gradients and replayed FLOPs are all made per
token (a constant, such as a tensor of fixed size made in forward, would be read as a small
linear term, exact at the two lengths profiled, over-predicted above them). A negative
quadratic term (a count that grows less than linearly between the two lengths, from rounding
of small tensors) is dropped and the line through the longer profile taken instead, so that no
count shrinks as the length grows. Seconds are the measured ones at ``s`` scaled by ``L / s``
(the short profile is not timed: its timing would double the planning cost for a figure that
only ranks plans). The sequence length is dimension 1 of every tensor in the sample that has
the sample's length there (``seq_dim=`` names another); a sample given as a callable cannot be
cut, and is refused with ``max_seq_len=``. A training batch longer than ``max_seq_len`` (its
first tensor argument's dimension ``seq_dim``) is outside what the plan was made for: it warns,
once per shape, and runs ``full`` on every layer (NOTE [Plans per length bucket] in
hyperac/length_switch.py).

NOTE [Bucket bounds]
The same two profiles give the costs at any length, so a plan per length bucket costs no profiling,
only a solve per bucket (milliseconds). The ``length_buckets`` bounds are evenly spaced up to ``L``
(default 4: L/4, L/2, 3L/4, L), each bucket planned at its upper bound, where its batches keep the
most. A batch just past a bound runs a plan made for up to L/4 more positions, so it recomputes more
than it needs: finer buckets waste less, but each adds an override variant per layer, a row in the
plan and, on the bucket boundaries, a step whose time jumps; four keep a batch of at least half of
``L`` within 1.5x of its own length's plan. Below ``L`` a bucket is planned among the recompute
modes only (swap is chosen at ``L`` alone), and takes the plan for ``L`` where that is predicted
faster (a swap that hides its copies behind compute), or where no recompute-only plan fits.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import ConfigError
from ..plan import LengthBucket
from ..policy import weighing_attention_at
from .cost import ESTIMATE_MODES, Estimate
from .solver import choose_modes

__all__ = ["at_length", "batch_shape", "bucket_bounds", "fitted_estimates", "length_buckets", "sequence_length",
           "truncated"]


def sequence_length(sample: Any, dim: int) -> int:
    """The sample's sequence length: dimension ``dim`` of its first tensor with that many dimensions."""
    if not isinstance(sample, Mapping):
        raise ConfigError(
            f"max_seq_len= needs sample= as a dict of model keyword arguments, to profile it at another "
            f"length; got a {type(sample).__name__}. Pass the batch as a dict, e.g. sample={{'input_ids': ids}}."
        )
    for value in sample.values():
        if isinstance(value, torch.Tensor) and value.dim() > dim:
            return value.shape[dim]
    raise ConfigError(
        f"max_seq_len= reads the sequence length from dimension {dim} of the sample's tensors, but no tensor in "
        f"sample= ({', '.join(sample)}) has {dim + 1} dimensions; name the sequence dimension with seq_dim=."
    )


def batch_shape(sample: Mapping[str, Any], dim: int, length: int) -> tuple[int, ...]:
    """The shape of the sample's first tensor with ``length`` positions in dimension ``dim``."""
    first = next(v for v in sample.values() if isinstance(v, torch.Tensor) and v.dim() > dim)
    return tuple(length if i == dim else n for i, n in enumerate(first.shape))


def truncated(sample: Mapping[str, Any], dim: int, length: int) -> dict[str, Any]:
    """The sample with every tensor of the sample's sequence length cut to its first ``length`` positions."""
    full = sequence_length(sample, dim)
    return {key: value.narrow(dim, 0, length).contiguous()
            if isinstance(value, torch.Tensor) and value.dim() > dim and value.shape[dim] == full else value
            for key, value in sample.items()}


def _fit(short: int, long: int, short_length: int, long_length: int, target: int) -> int:
    """``a * n + b * n**2`` through ``(short_length, short)`` and ``(long_length, long)``, at ``target``
    (NOTE [Costs as functions of the length])."""
    s, t = short_length, long_length
    b = (long * s - short * t) / (s * t * (t - s))
    if b < 0:
        return math.ceil(long * target / t)
    a = (short * t * t - long * s * s) / (s * t * (t - s))
    return math.ceil(a * target + b * target * target)


def _fit_dict(short: Mapping[str, int], long: Mapping[str, int], *lengths: int) -> dict[str, int]:
    return {key: _fit(short.get(key, 0), value, *lengths) for key, value in long.items()}


def bucket_bounds(max_seq_len: int, count: int) -> list[int]:
    """The upper bounds of ``count`` length buckets up to ``max_seq_len`` (NOTE [Bucket bounds])."""
    return sorted({math.ceil(max_seq_len * k / count) for k in range(1, count + 1)})


def fitted_estimates(estimate_at: Callable[[int, bool], Estimate], length: int, bounds: list[int]) -> list[Estimate]:
    """The estimate at each of ``bounds`` from ``estimate_at(n, timed)`` at the sample's ``length``
    (timed) and at half of it (not timed; NOTE [Costs as functions of the length])."""
    half = max(length // 2, 1)
    with weighing_attention_at(bounds[-1]):  # the policy's choices at max_seq_len, at both lengths
        long = estimate_at(length, True)
        short = estimate_at(half, False)
    return [at_length(short, long, half, length, bound) for bound in bounds]


def length_buckets(bounds: list[int], estimates: list[Estimate], default: list[str], default_modes: list[str],
                   budget_bytes: int) -> tuple[LengthBucket, ...]:
    """One :class:`LengthBucket` per bound: the fastest recompute-only plan within ``budget_bytes``
    at the bound, or the plan for the last bound (``default``, solver options; ``default_modes``,
    as applied) where that is predicted faster or no recompute-only plan fits (NOTE [Bucket bounds])."""
    buckets = []
    for bound, estimate in zip(bounds, estimates):
        chosen, modes = default, default_modes
        if bound < bounds[-1]:
            try:
                shorter = choose_modes(estimate, budget_bytes, ESTIMATE_MODES)
            except ConfigError:  # only swap fits: the default's
                shorter = default
            if estimate.step_seconds(shorter) <= estimate.step_seconds(default):
                chosen, modes = shorter, shorter
        buckets.append(LengthBucket(
            bound, tuple(modes), estimate.peak_bytes(chosen), estimate.step_seconds(chosen),
            estimate.total_bytes(chosen), estimate.total_recompute_flops(chosen)))
    return tuple(buckets)


def at_length(short: Estimate, long: Estimate, short_length: int, long_length: int, target: int) -> Estimate:
    """The estimate at sequence length ``target`` from estimates at two lengths (NOTE [Costs as
    functions of the length]); ``long``'s seconds, scaled."""
    lengths = (short_length, long_length, target)
    scale = target / long_length
    layers = tuple(
        dataclasses.replace(
            layer,
            kept_bytes=_fit_dict(small.kept_bytes, layer.kept_bytes, *lengths),
            recompute_flops=_fit_dict(small.recompute_flops, layer.recompute_flops, *lengths),
            forward_peak_bytes=_fit_dict(small.forward_peak_bytes, layer.forward_peak_bytes, *lengths),
            backward_peak_bytes=_fit_dict(small.backward_peak_bytes, layer.backward_peak_bytes, *lengths),
            seconds={mode: seconds * scale for mode, seconds in layer.seconds.items()},
            noise_seconds=layer.noise_seconds * scale,
            offload_storages={mode: tuple(math.ceil(n * scale) for n in sizes)
                              for mode, sizes in layer.offload_storages.items()},
        )
        for small, layer in zip(short.layers, long.layers)
    )
    return dataclasses.replace(
        long, layers=layers, outside_bytes=_fit(short.outside_bytes, long.outside_bytes, *lengths),
        base_flops=_fit(short.base_flops, long.base_flops, *lengths),
        outside_peak_bytes=tuple(_fit(a, b, *lengths) for a, b in zip(short.outside_peak_bytes,
                                                                       long.outside_peak_bytes)),
        outside_seconds=long.outside_seconds * scale,
        timing=f"{long.timing}; bytes fitted from lengths {short_length} and {long_length} to {target}",
    )
