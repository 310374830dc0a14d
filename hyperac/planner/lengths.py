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
once per shape (:class:`LengthCheck`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import ConfigError, warn_once
from ..policy import weighing_attention_at
from ..state import AppliedState, Installed
from .cost import Estimate

__all__ = ["LengthCheck", "at_length", "fitted_estimate", "sequence_length", "truncated"]


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


def fitted_estimate(estimate_at: Callable[[int, bool], Estimate], length: int, max_seq_len: int) -> Estimate:
    """The estimate at ``max_seq_len`` from ``estimate_at(n, timed)`` at the sample's ``length``
    (timed) and at half of it (not timed; NOTE [Costs as functions of the length])."""
    half = max(length // 2, 1)
    with weighing_attention_at(max_seq_len):  # the policy's choices at max_seq_len, at both lengths
        long = estimate_at(length, True)
        return at_length(estimate_at(half, False), long, half, length, max_seq_len)


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


class LengthCheck(Installed):
    """Forward pre-hook on the model of a plan made for ``max_seq_len``: a training batch longer than
    that warns, once per shape (its first tensor argument, dimension ``seq_dim``)."""

    def __init__(self, owner: AppliedState, max_seq_len: int, seq_dim: int) -> None:
        self.owner, self.fqn = owner, ""
        self.max_seq_len, self.seq_dim = max_seq_len, seq_dim

    def __call__(self, module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        first = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor) and v.dim() > self.seq_dim),
                     None)
        if first is not None and first.shape[self.seq_dim] > self.max_seq_len:
            length = first.shape[self.seq_dim]
            warn_once(
                f"hyperac: a training batch of shape {list(first.shape)} has {length} positions in dimension "
                f"{self.seq_dim}, more than the max_seq_len={self.max_seq_len} the plan was made for, so its peak "
                f"may exceed the budget; apply mode='auto' again with max_seq_len={length} or more.",
                self.owner.warned, stacklevel=4,
            )
