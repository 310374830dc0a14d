"""What :func:`hyperac.apply` leaves on a model, kept as data the model owns.

NOTE [Applied state is data]
apply changes a model in three ways, and only these: ``model.__dict__["_hyperac_state"]`` holds an
:class:`AppliedState` (the plan, the swap manager, the warnings already given); some modules get an
instance attribute (``forward``, an override; an HF model's ``_loss_function``, NOTE [The head and the
loss in chunks] in head.py); some HF model modules get a forward pre-hook. Every override
and hook is an instance of a module-level subclass of :class:`Installed` that names its owner
state and holds plain data, never a closure over the model. So:

* ``copy.deepcopy``, pickle and ``torch.save`` of an applied model give an independent applied
  model: the copy's overrides and hooks name the copy's state, which has its own swap manager;
* ``remove`` finds what to undo by scanning the model's modules for objects its state owns, so it
  touches nothing of another model, and undoing does not depend on the order of removes;
* an apply that would reach a module another apply owns (a child applied before its parent, two
  models sharing a layer) is refused before anything changes (:func:`find_owned`).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from .compiled import OffloadLease, release_offloading
from .plan import Plan
from .swap import SwapManager

__all__ = ["STATE_KEY", "AppliedState", "Attribute", "Installed", "Override", "find_owned", "install_hook", "undo"]

STATE_KEY = "_hyperac_state"


@dataclasses.dataclass(eq=False)
class AppliedState:
    """What one :func:`hyperac.apply` did, owned by the model (``model.__dict__["_hyperac_state"]``)."""

    plan: Plan
    owner: str
    """The class name of the model apply was called on (for messages)."""
    swap: SwapManager | None = None
    warned: set[str] = dataclasses.field(default_factory=set)
    """Warnings already given for this model (each is given once per model, not once per process)."""
    offload: OffloadLease | None = None
    """Under ``compile=True`` with swap: the activation offloading this apply turned on (compiled.py)."""
    bucket: int = 0
    """With length buckets: the position in ``plan.buckets`` of the plan the next layer forwards run
    (one past the last: ``full`` on every layer), set by each training forward (length_switch.py)."""

    def __post_init__(self) -> None:
        self._tie_teardown()

    def __setstate__(self, state: dict[str, Any]) -> None:
        # A copy (deepcopy, pickle) gets its own teardown, tied to its own lifetime.
        self.__dict__.update(state)
        self._tie_teardown()

    def _tie_teardown(self) -> None:
        # Dropping the model drops its state: the host buffers go then, even while the graph of a
        # forward never run backward still holds swap groups (and so the manager).
        if self.swap is not None:
            weakref.finalize(self, self.swap.release)


class Installed:
    """Base of every object hyperac installs on a module: a forward override or a hook.

    ``owner`` is the :class:`AppliedState` of the apply that installed it; ``fqn`` the module's name
    in the model that apply was called on. A hook keeps the handle its registration returned
    (:func:`install_hook`), which ``undo`` removes it by.
    """

    owner: AppliedState
    fqn: str
    handle: RemovableHandle | None = None


class Attribute(Installed):
    """An instance attribute hyperac sets on a module (one of ``_ATTRIBUTES``); ``restore`` undoes it."""

    def restore(self, module: nn.Module) -> None:
        raise NotImplementedError


def install_hook(module: nn.Module, hook: Installed, *, pre: bool, **options: Any) -> None:
    """Register ``hook`` as a forward (``pre``: pre-) hook of ``module``, keeping its handle on it.

    NOTE [Hook handles in copies]: a ``RemovableHandle`` pickles the hook tables it points into, so
    a deepcopy or pickle of the model, which copies the hook (and so its handle) with the module's
    tables, gives a handle into the copy's tables: removing it there leaves the original alone.
    """
    register = module.register_forward_pre_hook if pre else module.register_forward_hook
    hook.handle = register(hook, **options)


class Override(Attribute):
    """A forward hyperac sets on one module instance (``module.forward``), in place of ``original``:
    the instance forward found at apply, or ``None`` for the class's own.

    It reaches its module through a weak reference (module -> override -> module would be a cycle
    that only the garbage collector frees); a copy or pickle carries the module strongly and the
    copy points at the copied module.
    """

    inert_outside_regions = False
    """Whether it runs the module's own forward unchanged where no recompute region is around it (a
    module a region excludes or forces): such an override stays in place whatever plan runs."""

    def __init__(self, module: nn.Module, owner: AppliedState, fqn: str) -> None:
        self.owner, self.fqn = owner, fqn
        self.original = module.__dict__.get("forward")
        self._module = weakref.ref(module)

    def install(self) -> None:
        self._module().forward = self

    def restore(self, module: nn.Module) -> None:
        if self.original is None:
            del module.__dict__["forward"]
        else:
            module.forward = self.original

    def module_and_forward(self) -> tuple[nn.Module, Any]:
        """The module and the forward this override stands in front of."""
        module = self._module()
        return module, self.original if self.original is not None else type(module).forward.__get__(module)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_module": self._module()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._module = weakref.ref(state["_module"])


# The hook tables hyperac registers in (read to find its hooks; they are removed by their handles).
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_hooks")
# The instance attributes hyperac sets (each value has ``restore(module)``, which undoes it).
_ATTRIBUTES = ("forward", "_loss_function")


def _installed(module: nn.Module) -> Iterator[Installed]:
    for name in _ATTRIBUTES:
        value = module.__dict__.get(name)
        if isinstance(value, Installed):
            yield value
    for name in _HOOK_DICTS:
        yield from (hook for hook in module.__dict__.get(name, {}).values() if isinstance(hook, Installed))


def find_owned(modules: list[tuple[str, nn.Module]]) -> tuple[str, AppliedState, str] | None:
    """The first module another apply owns: (its name here, the owner state, its name there).

    A sub-module that is itself an applied model counts too; its name there is ``""``.
    """
    for name, module in modules:
        state = module.__dict__.get(STATE_KEY)
        if state is not None:
            return name, state, ""
        for installed in _installed(module):
            return name, installed.owner, installed.fqn
    return None


def undo(model: nn.Module, state: AppliedState) -> None:
    """Remove every override and hook ``state`` owns from ``model``'s modules, drop the state and
    free its swap buffers."""
    for module in model.modules():
        for name in _ATTRIBUTES:
            value = module.__dict__.get(name)
            if isinstance(value, Attribute) and value.owner is state:
                value.restore(module)
        for hook in [hook for hook in _installed(module) if hook.handle is not None and hook.owner is state]:
            hook.handle.remove()
    if model.__dict__.get(STATE_KEY) is state:
        del model.__dict__[STATE_KEY]
    if state.swap is not None:
        state.swap.release()
    if state.offload is not None:
        release_offloading(state.offload)
        state.offload = None
