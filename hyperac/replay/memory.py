"""The process's memory as 8-byte words, where the replay's checks read private layouts that probes found.

A check that runs at every layer invocation and reads a few dozen values through Python calls (a dict's
version, a torch flag's getter) costs more in a step than the values are worth: each call's code and data
have left the caches since the last layer. Read as words of :data:`MEMORY` with one ``operator.itemgetter``
(:func:`reader`), the same values are one C call. Only addresses a probe has checked are read (NOTE [Dict
versions] in python_state.py, NOTE [Torch's flags read as memory] in replay_context.py), and the objects
there are kept alive by whoever reads them.
"""

from __future__ import annotations

import ctypes
import operator
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["MEMORY", "reader"]

MEMORY: Any = (ctypes.c_uint64 * (sys.maxsize // 8)).from_address(0)
"""The process's memory as 8-byte words: ``MEMORY[address // 8]`` is the word at ``address`` (8-aligned)."""


def reader(words: Sequence[int]) -> Callable[[Any], tuple[int, ...]]:
    """What reads the words at ``words`` (indexes into :data:`MEMORY`, at least one) in one call, as a tuple of one
    value per word (an ``itemgetter`` of one index returns the value itself, not a tuple)."""
    if len(words) == 1:
        return _OneWord(words[0])
    return operator.itemgetter(*words)


class _OneWord:
    """:func:`reader` of one word."""

    __slots__ = ("word",)

    def __init__(self, word: int) -> None:
        self.word = word

    def __call__(self, memory: Any) -> tuple[int]:
        return (memory[self.word],)
