"""griffe extensions for the API reference: show ``hyperac.apply``'s keyword defaults as values,
and Sphinx roles in docstrings (``:func:`apply` ``) as code.

``apply`` and ``estimate`` default their keywords to ``_D[name]``, a sentinel that reads (``repr``)
as the ``hyperac.Config`` field's default, so ``help(hyperac.apply)`` shows ``mode: str = 'full'``.
griffe reads the source without importing it and would print ``_D['mode']``; this extension puts
the ``Config`` default there instead, as ``help`` does. The docstrings follow
``torch.utils.checkpoint``'s style, Sphinx roles included, which Markdown would show raw.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SENTINEL = re.compile(r"^_D\[['\"](\w+)['\"]\]$")
_ROLE = re.compile(r":(?:func|class|meth|attr|data|mod|exc):`~?([^`]+)`")


class SphinxRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(r"`\1`", obj.docstring.value)


class ConfigDefaults(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "hyperac":
            return
        fields = pkg["config"]["Config"].members
        for name in ("apply", "estimate"):
            for parameter in pkg["api"][name].parameters:
                match = _SENTINEL.match(str(parameter.default))
                if match:
                    parameter.default = fields[match[1]].value
