"""Exceptions and the warning category of hyperac.

Every error inherits :class:`HyperACError` and the builtin a caller would already catch, so
``except ValueError`` keeps working around :func:`hyperac.apply`.
"""

from __future__ import annotations

import warnings

__all__ = [
    "BackendUnavailableError",
    "ConfigError",
    "HyperACError",
    "HyperACWarning",
    "InputWrittenError",
    "RankFailedError",
    "RecomputeMismatchError",
    "TorchVersionError",
    "UnsupportedModelError",
    "warn_once",
]


class HyperACError(Exception):
    """Base class of every error hyperac raises."""


class ConfigError(HyperACError, ValueError):
    """An option of :func:`hyperac.apply` has the wrong type or value, or options conflict."""


class BackendUnavailableError(HyperACError, RuntimeError):
    """An explicitly requested backend cannot run here (package missing or no device visible)."""


class UnsupportedModelError(HyperACError, TypeError):
    """The model has nothing hyperac can recompute, or is in a state hyperac must not touch."""


class RecomputeMismatchError(HyperACError, RuntimeError):
    """A recomputed layer ran other ops in backward than in forward: its forward depends on state
    that it changes (a counter, an observer), so the recompute cannot reproduce it."""


class InputWrittenError(HyperACError, RuntimeError):
    """A recomputed layer's input was written in place, by the layer itself or after it returned:
    its replay in backward would read the written value, not the one its forward read."""


class TorchVersionError(HyperACError, RuntimeError):
    """This torch lacks, or changed, a torch internal that the requested mode relies on."""


class HyperACWarning(UserWarning):
    """An option that has no effect here, or a fallback hyperac chose for the user."""


def warn_once(message: str, given: set[str], stacklevel: int = 3, key: str | None = None) -> None:
    """Emit ``message`` as a :class:`HyperACWarning` unless it (or ``key``, for a message that varies
    while the warning is one) is in ``given``, the set of warnings already given for one model (its
    applied state owns the set: a warning about one model never silences the same warning about
    another)."""
    key = message if key is None else key
    if key in given:
        return
    given.add(key)
    warnings.warn(message, HyperACWarning, stacklevel=stacklevel)


class RankFailedError(HyperACError, RuntimeError):
    """Another rank of the process group that plans ``mode="auto"`` together failed inside
    :func:`hyperac.apply`; every rank raises, this one with the failing rank's number and error
    (NOTE [One plan per job] in hyperac/planner/group.py)."""
