"""The ``budget`` option: bytes, a size string, or a fraction, parsed the same way everywhere.

``Config`` validates a budget with :func:`parse_budget` before any model is seen, the planner
resolves a fraction against the no-recompute step it measured, and ``hyperac plan --budget``
reads its argument through the same function, so the API and the command line accept and refuse
exactly the same values. What a budget bounds is the planner's business (``hyperac.planner``);
this module only reads the number.
"""

from __future__ import annotations

import re
from typing import Any

from .errors import ConfigError

__all__ = ["parse_budget"]

_UNITS = {"": 1, "b": 1, "k": 2**10, "kb": 10**3, "kib": 2**10, "m": 2**20, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}
_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*|%)\s*")


def _from_text(text: str) -> int | float | None:
    """``"0.5"`` and ``"50%"`` are fractions, ``"2048"`` and ``"24GiB"`` are bytes; ``None`` if unreadable."""
    match = _NUMBER.fullmatch(text)
    if match is None or (match.group(2).lower() not in _UNITS and match.group(2) != "%"):
        return None
    number, unit = match.group(1), match.group(2).lower()
    if unit == "%":
        return float(number) / 100
    if not unit and "." in number:
        return float(number)
    return int(float(number) * _UNITS[unit])


def parse_budget(budget: Any, reference_bytes: int | None = None) -> int:
    """Bytes from a budget: a positive int, a size string like ``"24GiB"``/``"512MB"``/``"2048"``,
    or a fraction in (0, 1] (a float, or a string like ``"0.5"`` or ``"50%"``) of ``reference_bytes``, what the
    model needs with nothing recomputed. A fraction with ``reference_bytes=None`` is only
    validated and returns -1.

    Raises:
        ConfigError: anything else (bools, zero, negatives, fractions above 1, NaN, unknown units).
    """
    value = _from_text(budget) if isinstance(budget, str) else budget
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, float) and 0 < value <= 1:
        return -1 if reference_bytes is None else int(value * reference_bytes)
    raise ConfigError(
        f"Config.budget must be a positive byte count, a size like '24GiB' or '512MB', or a fraction in (0, 1] "
        f"(or a percentage like '50%') of the no-recompute step's peak activation bytes; got {budget!r}. E.g. "
        "budget=0.5 or budget='24GiB'."
    )
