"""Python state a recomputed forward reads and changes, seen by each replay as the forward saw it.

NOTE [Python state in the replay]
A replay runs the layer's forward again in backward, Python included. A forward that changes Python
state (``self.calls += 1``, an MoE layer appending its auxiliary loss to a list its parent owns, a
forward hook recording activations, a lazily cached constant) would change it again in every replay,
and a forward that reads it would read the changed value: a counter used as a value or a branch taken
on it gives other gradients (silently in ``full``, whose saved tensors may have equal metadata), an
auxiliary-loss list gets a stale entry per replay, a hook records twice. torch.utils.checkpoint does
the same; hyperac promises the un-applied gradients without the user writing a checkpoint call.

So as a region's forward starts, hyperac takes a shallow snapshot of the Python state it can reach:
the attributes in the ``__dict__`` of every module the region runs (its own, and the modules it is given
as arguments or holds other than as registered children, found up to three levels down through lists,
tuples, dicts, sets, deques and plain objects; ``nn.Module``'s own bookkeeping excluded, ``training``
included), whether their parameters require grad (one frozen between forward and backward was recorded
requiring it) and the user's hooks in their forward hook tables (a hook registered lazily on the first
call, or removed by the forward or between forward and backward, is as the forward had it); what the
forward hooks and pre-hooks of those modules, and those registered for every module
(``register_module_forward_hook``), hold (closure variables, the functions found there and what their
closures hold, a hook object, a bound hook's owner); and the non-tensor arguments. Of each value found
so, its contents and one level into what it holds: a ``list``, ``dict``, ``set``, ``deque`` or plain
object (its ``__dict__`` or ``__slots__``), also behind a ``weakref`` or ``weakref.proxy``, a bound
method or a ``functools.partial``; and where each random generator found there stands (torch's,
``random.Random``, numpy's), as do the global ones behind ``random.random()`` and ``np.random.rand()``.
Objects and hooks of torch and of hyperac itself are left as they are: the planner's profiler hooks
layers to see every replay run. A replay first puts back every entry that differs from the snapshot (by
identity, so tensors are never compared by value; generators by state), runs, and then puts back what
was there before it, every entry as the replay found it (the forward's own change, and whatever happened
since: an auxiliary-loss list its parent read and emptied stays empty, also where the replay's snapshot of
it was empty too): the forward changed the state once, and the replay read what the forward read. One
exception: an attribute the forward turned into a sub-module, parameter or buffer (``self.proj = None``,
built on the first call) stays the one the forward built. The snapshot holds references to the values it
saw (no copies) until the region's backward is done. A container that holds parameters is a sharding stack's
bookkeeping, left as it is (NOTE [Parameter bookkeeping is the stack's]). Its cost is per entry, in every
layer invocation: each module the region runs is one entry (attributes, ``requires_grad`` flags, hook
tables), and a put-back compares each entry with the live state without copying it, one Python call per entry
where nothing changed, and without looking at a ``__dict__``'s entries where its version has not moved (NOTE
[Dict versions]; benchmarks/host_overhead.py); where nothing the snapshot saw has changed since a layer's last
invocation, the walk, the copies and the comparisons are replaced by one check (NOTE [A snapshot taken again]).

Not reached: module-level globals (a hook appending to a global list), class attributes
(``type(self).calls += 1``), objects three levels below a module attribute, a module behind a weak
reference, iterators (``itertools.count``), in-place writes into a tensor or numpy array held as a plain
attribute, hooks registered for every module between forward and backward, and side effects outside
Python (printing, logging, files). A forward that branches on such state so that its replay runs other
ops or saves other tensors is caught: every mode checks its replay and raises
:class:`~hyperac.RecomputeMismatchError` (replay_check.py, NOTE [Every replay is checked]). One that
reads such state as a number trains with the replay's value: the docs say so. A forward that builds a
sub-module on its first call runs ops its replay does not: ``full`` is exact, the selective modes raise
:class:`~hyperac.RecomputeMismatchError` (run one forward before training, or give that layer ``full``).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import itertools
import operator
import pickle
import random
import struct
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from .memory import MEMORY, reader

__all__ = ["PythonState", "Snapshots", "module_tree"]

_MODULE_BOOKKEEPING = (frozenset(nn.Module().__dict__) - {"training"}) | {"forward"}
"""Keys of a module's ``__dict__`` that are nn.Module's own (parameters, buffers, children, hooks) or
hyperac's (the instance ``forward`` it installs): never restored. ``training`` is restored: a replay after
``model.eval()`` runs as its forward did."""

_OPAQUE = (torch.Tensor, nn.Module, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
           types.ModuleType, types.CellType, functools.partial)
_CONTAINERS = (list, dict, set, collections.deque)
_MISSING = object()


def _state_of(value: Any) -> dict[str, Any] | None:
    """The ``__dict__`` of a plain object (not a torch object, a function, a class or a module), else
    ``None``. Read by type, past the class's attribute hooks: HF configs override ``__getattribute__``,
    which ``isinstance`` and ``vars`` would call."""
    if not _plain(value):
        return None
    try:
        return object.__getattribute__(value, "__dict__")
    except AttributeError:
        return None


_WATCHERS = frozenset({"torch", __name__.partition(".")[0]})
"""Packages whose objects are never restored: torch's (its hooks' state is its own) and hyperac's (the
planner's profiler and the meters hook layers to see every replay run, NOTE [Python state in the replay])."""


def _plain(value: Any) -> bool:
    """Whether ``value``'s state is the user's: not a builtin (a number, a string; containers are read as
    such), a torch or hyperac object, a function, a class or a module."""
    return _plain_kind(type(value))


@functools.lru_cache(maxsize=1024)
def _plain_kind(kind: type) -> bool:
    """:func:`_plain` by type (a cache: read at every snapshot and put back)."""
    package = (kind.__module__ or "").partition(".")[0]
    return package != "builtins" and package not in _WATCHERS and not issubclass(kind, _OPAQUE)


def _slots_of(value: Any) -> dict[str, Any] | None:
    """The ``__slots__`` attributes of a plain object without a ``__dict__`` (``@dataclass(slots=True)``),
    by name (``_MISSING`` for one not set), else ``None``."""
    if not _plain(value):
        return None
    names = _slot_names(type(value))
    if not names:
        return None
    return {name: _slot(value, name) for name in names}


@functools.lru_cache(maxsize=1024)
def _slot_names(kind: type) -> tuple[str, ...]:
    """The ``__slots__`` names of ``kind`` and its bases (a cache: a class's slots are fixed)."""
    names = []
    for base in kind.__mro__:
        slots = base.__dict__.get("__slots__", ())
        names += [slots] if isinstance(slots, str) else [name for name in slots if name != "__weakref__"]
    return tuple(names)


def _slot(value: Any, name: str) -> Any:
    try:
        return object.__getattribute__(value, name)
    except AttributeError:
        return _MISSING


_MODULE_DEPTH = 3
"""How many levels of lists, tuples, dicts, sets, deques and plain objects :func:`_modules_in` looks
through for modules (a BatchNorm in a list held by a ``SimpleNamespace`` attribute is two)."""


_ATOMS = frozenset({int, float, bool, str, bytes, complex, type(None)})
"""Types that hold no module, skipped without a look (most of what a config object holds)."""


def _modules_in(value: Any, visited: dict[int, Any], depth: int = _MODULE_DEPTH) -> list[nn.Module]:
    """Modules ``value`` is, is a bound method of, or holds up to ``depth`` levels down, through
    containers and plain objects not in ``visited`` (by id, each with the object looked through; not through
    modules: their sub-modules are found by ``modules()``)."""
    kind = type(value)
    if kind in _ATOMS:
        return []
    if issubclass(kind, nn.Module):
        return [value]
    if kind is types.MethodType:
        value = value.__self__
        if issubclass(type(value), nn.Module):
            return [value]
    if depth == 0 or id(value) in visited:
        return []
    visited[id(value)] = value
    return [module for item in _items_of(value) for module in _modules_in(item, visited, depth - 1)]


def _items_of(value: Any) -> Iterable[Any]:
    """What a list, tuple, set, deque, dict (its values) or plain object (its attributes) holds, numbers
    and strings left out."""
    kind = type(value)
    if issubclass(kind, (list, tuple, set, frozenset, collections.deque)):
        items: Iterable[Any] = value
    elif issubclass(kind, dict):
        items = value.values()
    else:
        items = (_state_of(value) or _slots_of(value) or {}).values()
    return [item for item in items if type(item) not in _ATOMS]


def _held_leaves(value: Any, leaves: list[Any]) -> list[Any]:
    """The leaves of ``value`` (as ``tree_leaves`` finds them) that may hold Python state: not tensors,
    numbers or strings; appended to ``leaves``. Tuples, lists and dicts are looked through here (the
    usual arguments, without pytree's per-leaf cost), other containers by ``tree_leaves``."""
    kind = type(value)
    if kind in _ATOMS or issubclass(kind, torch.Tensor):
        return leaves
    if kind is tuple or kind is list or kind is dict:
        for item in value.values() if kind is dict else value:
            if type(item) not in _ATOMS and not issubclass(type(item), torch.Tensor):  # most items: no call
                _held_leaves(item, leaves)
    else:
        leaves.extend(leaf for leaf in tree_leaves(value)
                      if type(leaf) not in _ATOMS and not issubclass(type(leaf), torch.Tensor))
    return leaves


def _users(hook: Callable[..., Any]) -> bool:
    """Whether ``hook`` is the user's: not a function or object of torch's or hyperac's (``_WATCHERS``),
    seen through ``functools.partial`` and bound methods."""
    while type(hook) is functools.partial:
        hook = hook.func
    if type(hook) is types.MethodType:
        hook = hook.__self__
    module = hook.__module__ if type(hook) is types.FunctionType else type(hook).__module__
    return (module or "").partition(".")[0] not in _WATCHERS


def _hook_holders(hooks: Iterable[Callable[..., Any]]) -> Iterator[Any]:
    """What the user's forward hooks and pre-hooks hold (:func:`_users`): the hook itself (a function,
    whose closure is followed, or an object with ``__call__``, a recorder keeping what it saw), its bound
    ``self``, the arguments of a ``functools.partial``."""
    for hook in filter(_users, hooks):
        while type(hook) is functools.partial:
            yield from (*hook.args, *hook.keywords.values())
            hook = hook.func
        if type(hook) is types.MethodType:
            yield hook.__self__
            hook = hook.__func__
        yield hook


def _global_hooks() -> list[Callable[..., Any]]:
    """The forward hooks and pre-hooks registered for every module (``register_module_forward_hook``):
    they run in the replay of every module too."""
    registry = nn.modules.module
    return [*registry._global_forward_pre_hooks.values(), *registry._global_forward_hooks.values()]


def _global_generators() -> list[Any]:
    """The generators behind Python's ``random`` functions and, once numpy's ``random`` is imported,
    numpy's legacy ``np.random`` functions (their bound methods' owners: no private names)."""
    generators: list[Any] = [random.getstate.__self__]  # type: ignore[attr-defined]
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        generators.append(numpy_random.get_state.__self__)
    return generators


def _contents(value: Any) -> Any:
    """A shallow copy of what ``value`` holds, or ``_MISSING`` for a value that holds nothing hyperac restores."""
    kind = type(value)
    for container in _CONTAINERS:
        if issubclass(kind, container):
            return container(value)
    state = _state_of(value)
    if state is not None:
        return dict(state)
    slots = _slots_of(value)
    return _MISSING if slots is None else slots


def _same(first: Any, second: Any) -> bool:
    """Equal shallow contents, compared by identity."""
    if type(first) is dict:  # in the same order (else they read as changed, and are set back: no harm)
        return (len(first) == len(second) and all(map(operator.is_, first.values(), second.values()))
                and all(map(operator.is_, first, second)))
    if type(first) in (list, collections.deque):
        return len(first) == len(second) and all(map(operator.is_, first, second))
    return first == second


class _Entry:
    """One piece of the snapshot: ``now()`` reads ``target``'s state, ``put(values)`` sets it, ``values``
    is what the snapshot saw."""

    __slots__ = ("target", "values")

    def __init__(self, target: Any) -> None:
        self.target = target
        self.values = self.now()

    def now(self) -> Any:
        raise NotImplementedError

    def put(self, values: Any) -> None:
        raise NotImplementedError

    def holds(self, values: Any) -> bool:
        """Whether ``target``'s state is ``values``, by identity (tensors never compared by value; generators
        by state)."""
        now = self.now()
        return now is values or _same(now, values)

    def vouch(self, witness: _Witness) -> bool:
        """Add what tells that this entry still holds to ``witness``; False where nothing can (NOTE [A snapshot
        taken again]). Compared as a put-back compares it, by default."""
        witness.compared.append(self)
        return True


class _Attributes(_Entry):
    """A module's own attributes (its ``__dict__`` less nn.Module's bookkeeping), by identity. Read as a
    copy of the whole ``__dict__`` (one C call; the bookkeeping's objects stay the same ones, so they
    compare as unchanged) and set back without the bookkeeping."""

    __slots__ = ()

    def now(self) -> dict[str, Any]:
        return self.target.__dict__.copy()

    def holds(self, values: dict[str, Any]) -> bool:
        """:meth:`_Entry.holds`, on the live ``__dict__`` (no copy)."""
        return _same_dict(self.target.__dict__, values)

    def own(self) -> list[Any]:
        """The values of the attributes the snapshot restores that may hold Python state (numbers and
        strings left out: they hold nothing to look into)."""
        return _own(self.values)

    def vouch(self, witness: _Witness) -> bool:
        witness.stamp(self.target.__dict__, owner=self.target)
        return True

    def put(self, values: dict[str, Any]) -> None:
        """Set the attributes to ``values``, but for a name the forward has since made a sub-module,
        parameter or buffer (``self.proj = None``, built on the first call): the replay uses the one the
        forward built, as autograd recorded it, and builds no second one; and for a parameter's view, then or
        now (NOTE [Parameter bookkeeping is the stack's])."""
        state = self.target.__dict__
        for name in state.keys() - _MODULE_BOOKKEEPING - values.keys():
            if not _parameter_view(state[name]):
                del state[name]
        registered = state["_modules"].keys() | state["_parameters"].keys() | state["_buffers"].keys()
        state.update((name, value) for name, value in values.items()
                     if name not in registered and name not in _MODULE_BOOKKEEPING
                     and not _parameter_view(value) and not _parameter_view(state.get(name)))


_LEADING = tuple(nn.Module().__dict__)
"""The keys nn.Module's ``__init__`` sets, in its order: the start of almost every module's ``__dict__``."""


def _own(attributes: dict[str, Any]) -> list[Any]:
    """The values of ``attributes`` (a module's ``__dict__``) that the snapshot restores and that may hold
    Python state (numbers and strings left out: they hold nothing to look into), in their order. Where the
    ``__dict__`` starts with nn.Module's own keys (:data:`_LEADING`, of which only ``training`` is
    restored), only the keys after them are looked at."""
    if type(attributes.get("training")) in _ATOMS and tuple(itertools.islice(attributes, len(_LEADING))) == _LEADING:
        items: Iterable[tuple[str, Any]] = itertools.islice(attributes.items(), len(_LEADING), None)
    else:
        items = attributes.items()
    return [value for name, value in items if type(value) not in _ATOMS and name not in _MODULE_BOOKKEEPING]


def module_tree(module: nn.Module) -> list[nn.Module]:
    """``list(module.modules())`` (the module, then its sub-modules, depth first, each once) in one Python call:
    read at every snapshot."""
    tree, seen, stack = [], set(), [module]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        tree.append(current)
        stack.extend(child for child in reversed(current._modules.values()) if child is not None)
    return tree


def _same_dict(state: dict[str, Any], values: dict[str, Any]) -> bool:
    """Whether ``state`` holds the keys and values of ``values``, in the same order, by identity."""
    return (len(state) == len(values) and all(map(operator.is_, state.values(), values.values()))
            and all(map(operator.is_, state, values)))


# NOTE [Dict versions]
# Most of a snapshot's cost is comparing each module's ``__dict__`` with the copy the forward saw, entry
# by entry, at the start and at the end of every replay, though almost always nothing changed. CPython
# gives every dict a version (PEP 509, ``ma_version_tag``) that moves whenever the dict is written (a
# value set to another object, a key added or deleted, a clear) and never otherwise; it is in the dict
# object at a fixed place, not in Python's API. So where a probe finds it (:func:`_version_offset`: a
# dict, a plain object's and a module's ``__dict__`` written in each way, and left alone while other
# dicts are written), each module entry notes its ``__dict__``'s version as it copies it, and a later
# comparison whose version is unchanged (and whose ``__dict__`` is still that dict) holds without looking
# at the entries; a moved version is compared entry by entry as before, so a write that sets an attribute
# back to the object it held reads as unchanged, as it does without versions. Where a Python build has no
# such version (3.14 keeps only watcher bits there), the probe fails and every comparison is entry by
# entry.


def _version_offset() -> int | None:
    """Where a dict keeps its version (NOTE [Dict versions]), checked on probes, or None."""
    if sys.implementation.name != "cpython":
        return None

    class Plain:
        pass

    for offset in range(2 * ctypes.sizeof(ctypes.c_void_p), 6 * ctypes.sizeof(ctypes.c_void_p), 8):
        try:
            if _versions_move(offset, Plain):
                return offset
        except (ValueError, OverflowError):
            continue
    return None


def _versions_move(offset: int, plain: type) -> bool:
    """Whether the word at ``offset`` in dicts moves on each kind of write and holds still otherwise."""
    module, thing, table = nn.Linear(1, 1), plain(), {"a": 1}
    thing.value = 1
    for state, write, unset in ((table, table.__setitem__, table.__delitem__),
                                (vars(thing), functools.partial(setattr, thing), functools.partial(delattr, thing)),
                                (vars(module), functools.partial(setattr, module), functools.partial(delattr, module))):
        view = ctypes.c_uint64.from_address(id(state) + offset)
        seen = [view.value]
        other = {"b": 2}
        other["c"] = 3  # another dict written: this one's word holds still
        seen.append(view.value)
        write("x", object())
        seen.append(view.value)
        value = object()
        write("x", value)
        seen.append(view.value)
        write("x", value)  # the same object again: no change
        seen.append(view.value)
        unset("x")
        seen.append(view.value)
        if not (seen[0] == seen[1] and len({seen[1], seen[2], seen[3], seen[5]}) == 4 and seen[3] == seen[4]):
            return False
    return True


_VERSION_AT = _version_offset()


def _version(state: dict[str, Any]) -> int | None:
    """``state``'s version (NOTE [Dict versions]), or None without versions."""
    return None if _VERSION_AT is None else MEMORY[(id(state) + _VERSION_AT) // 8]  # type: ignore[index]


_requires_grad = operator.attrgetter("requires_grad")
_is_set = functools.partial(operator.is_not, None)


class _Module(_Attributes):
    """A module the region runs, as one entry (one Python call per module to read, to compare with the
    snapshot, or to set back): its attributes (:class:`_Attributes`); whether each of its parameters
    requires grad (a parameter frozen between the forward and the backward was recorded requiring it); and
    the user's forward hooks and pre-hooks, with their ``with_kwargs`` / ``always_call`` flags, by handle id
    (torch's and hyperac's own are left as they are): a hook the forward removed (a one-shot calibration
    hook) or registered (lazily, on its first call), or one removed between forward and backward, is as it
    was for the replay. One put back goes after the hooks its table holds. ``values`` is ``(attributes,
    flags, hooks, version)``: ``version``, the ``__dict__``'s version as it was copied (NOTE [Dict versions]),
    or None."""

    __slots__ = ("live", "parameters")

    def __init__(self, module: nn.Module) -> None:
        self.parameters = tuple(filter(_is_set, module._parameters.values()))
        self.target = module
        self.live = module.__dict__
        self.values = self.now()

    def now(self) -> tuple[dict[str, Any], tuple[bool, ...], tuple[tuple[str, int, Any, tuple[bool, ...]], ...],
                           int | None]:
        module = self.target
        state = module.__dict__
        version = _version(state) if state is self.live else None
        return (state.copy(), tuple(map(_requires_grad, self.parameters)),
                self._hooks() if module._forward_pre_hooks or module._forward_hooks else (), version)

    def holds(self, values: tuple[dict[str, Any], tuple[bool, ...], tuple, int | None]) -> bool:
        attributes, flags, hooks, version = values
        module = self.target
        state = module.__dict__  # _same_dict, inlined: one Python call per module and put-back
        return ((version is not None and state is self.live and _version(state) == version)
                or (len(state) == len(attributes) and all(map(operator.is_, state.values(), attributes.values()))
                    and all(map(operator.is_, state, attributes)))) and (
            tuple(map(_requires_grad, self.parameters)) == flags
            and ((not hooks and not (module._forward_pre_hooks or module._forward_hooks))
                 or _same(self._hooks(), hooks)))

    def own(self) -> list[Any]:
        return _own(self.values[0])

    def vouch(self, witness: _Witness) -> bool:
        """The tables the walk read (children, parameters) by version; where the module has no forward hooks,
        its ``__dict__`` and hook tables by version and its flags with the others', else the entry compared."""
        module = self.target
        if self._walked_and_hooked(witness):
            return super(_Attributes, self).vouch(witness)
        witness.stamp(self.live, self.values[3], owner=module)
        witness.stamp(module._forward_pre_hooks)
        witness.stamp(module._forward_hooks)
        witness.parameters.extend(self.parameters)
        return True

    def _walked_and_hooked(self, witness: _Witness) -> bool:
        """Vouch in ``witness``'s walk for what the walk read of the module (its children and parameter tables);
        whether the module has forward hooks."""
        module = self.target
        witness.walk.stamp(module._modules)  # type: ignore[union-attr]
        witness.walk.stamp(module._parameters)  # type: ignore[union-attr]
        return bool(self.values[2] or module._forward_pre_hooks or module._forward_hooks)

    def vouch_as_root(self, witness: _Witness) -> None:
        """:meth:`vouch` for the region's own module, which a snapshot kept for the next invocation must not hold
        (the module holds the snapshots: a reference cycle, NOTE [A snapshot taken again]): its ``__dict__`` by
        id and version, its user hooks compared where it has forward hooks, else its tables by version."""
        module = self.target
        hooked = self._walked_and_hooked(witness)
        witness.root = (id(self.live), self.values[3], self.values[2] if hooked else None)
        if not hooked:
            witness.stamp(module._forward_pre_hooks)
            witness.stamp(module._forward_hooks)
        witness.parameters.extend(self.parameters)

    def put(self, values: tuple[dict[str, Any], tuple[bool, ...], tuple, int | None]) -> None:
        attributes, flags, hooks, _ = values
        super().put(attributes)
        for parameter, flag in zip(self.parameters, flags):
            if parameter.requires_grad is not flag:
                parameter.requires_grad_(flag)
        if not _same(self._hooks(), hooks):
            self._put_hooks(hooks)

    def _hooks(self) -> tuple[tuple[str, int, Any, tuple[bool, ...]], ...]:
        return _hooks_of(self.target)

    def _put_hooks(self, hooks: tuple[tuple[str, int, Any, tuple[bool, ...]], ...]) -> None:
        module = self.target
        kept = {(table, key) for table, key, _, _ in hooks}
        for table, flags in _HOOK_TABLES.items():
            entries = getattr(module, table)
            for key in [key for key, hook in entries.items() if (table, key) not in kept and _users(hook)]:
                del entries[key]
                for flag in flags:
                    getattr(module, flag).pop(key, None)
        for table, key, hook, marks in hooks:
            getattr(module, table)[key] = hook
            for flag, marked in zip(_HOOK_TABLES[table], marks):
                if marked:
                    getattr(module, flag)[key] = True
                else:
                    getattr(module, flag).pop(key, None)


def _hooks_of(module: nn.Module) -> tuple[tuple[str, int, Any, tuple[bool, ...]], ...]:
    """The user's forward hooks and pre-hooks of ``module`` with their flags, by handle id (:class:`_Module`)."""
    if not (module._forward_pre_hooks or module._forward_hooks):
        return ()
    return tuple((table, key, hook, tuple(key in getattr(module, flag) for flag in flags))
                 for table, flags in _HOOK_TABLES.items()
                 for key, hook in getattr(module, table).items() if _users(hook))


_HOOK_TABLES = {"_forward_pre_hooks": ("_forward_pre_hooks_with_kwargs",),
                "_forward_hooks": ("_forward_hooks_with_kwargs", "_forward_hooks_always_called")}
"""A module's forward hook tables, each with the tables of its hooks' flags (by handle id)."""


class _Cell(_Entry):
    """A hook's closure variable (``nonlocal count``)."""

    __slots__ = ()

    def now(self) -> Any:
        try:
            return self.target.cell_contents
        except ValueError:  # not bound yet
            return _MISSING

    def holds(self, value: Any) -> bool:
        return self.now() is value

    def put(self, value: Any) -> None:
        if value is _MISSING:
            del self.target.cell_contents
        else:
            self.target.cell_contents = value


class _Contents(_Entry):
    """What a list, dict, set, deque or plain object holds (``values`` is ``_MISSING`` for a value that
    holds nothing hyperac restores). Of a dict or ``__dict__``, the version as ``values`` was copied is
    noted too (NOTE [Dict versions])."""

    __slots__ = ("live", "version")

    def __init__(self, target: Any) -> None:
        self.target = target
        live = target if isinstance(target, dict) else _state_of(target)
        self.live = live
        self.version = None if live is None else _version(live)
        self.values = self.now()

    def now(self) -> Any:
        return _contents(self.target)

    def holds(self, contents: Any) -> bool:
        """:meth:`_Entry.holds`, on the live list, deque, dict or ``__dict__`` (no copy)."""
        target = self.target
        if type(contents) is dict:
            live = target if isinstance(target, dict) else _state_of(target)
            if (contents is self.values and live is self.live and self.version is not None
                    and _version(live) == self.version):
                return True
            if live is not None:
                return _same_dict(live, contents)
        elif type(contents) in (list, collections.deque):
            return len(target) == len(contents) and all(map(operator.is_, target, contents))
        return super().holds(contents)

    def vouch(self, witness: _Witness) -> bool:
        """A ``dict`` or a plain object's ``__dict__`` by version, other containers compared; an object with
        ``__slots__`` not at all."""
        target = self.target
        if type(target) is dict:
            witness.stamp(target, self.version)
        elif isinstance(target, _CONTAINERS):
            witness.compared.append(self)
        elif _slot_names(type(target)):
            return False
        else:
            witness.stamp(self.live, self.version, owner=target)  # type: ignore[arg-type]
        return True

    def put(self, contents: Any) -> None:
        kind = type(self.target)
        if _holds_parameters(contents) or _holds_parameters(_contents(self.target)):
            return  # NOTE [Parameter bookkeeping is the stack's]
        if issubclass(kind, list):
            self.target[:] = contents
        elif issubclass(kind, collections.deque):
            self.target.clear()
            self.target.extend(contents)
        elif issubclass(kind, (dict, set)):
            self.target.clear()
            self.target.update(contents)
        elif (state := _state_of(self.target)) is not None:
            state.clear()
            state.update(contents)
        else:
            for name, item in contents.items():
                if item is _MISSING:
                    if _slot(self.target, name) is not _MISSING:
                        object.__delattr__(self.target, name)
                else:
                    object.__setattr__(self.target, name, item)


# NOTE [Parameter bookkeeping is the stack's]
# A list, deque, set or dict that holds a parameter, when the snapshot is taken or when it would be put
# back, is left as it is: in a replay, and when profiling ends (planner/restore.py). Which parameters a
# container holds is a parameter lifecycle's bookkeeping (NOTE [Parameter lifecycles are not the layer's
# program] in lifecycle.py), kept in step with the stack's own records, not the layer's Python state:
# DeepSpeed ZeRO-3 registers a parameter a module reads outside its own forward (PEFT's LoRA layer reading
# its adapter's weight) in a dict on that module as it first gathers it, and its coordinator records that
# module's fetches, with the parameter, in the trace it checks each later step against. Put back to the
# empty dict the snapshot saw, the module no longer fetches what the trace says it does, and the next step
# that prefetches the parameter fails ZeRO-3's trace check ("tracing error ... expected the next 1
# parameters in the parameter fetch queue"): ``auto`` on a ZeRO-3 engine's LoRA model, whose profiled
# steps made the trace. Likewise a module attribute that is a parameter or a view of one, in the snapshot
# or when it would be put back: FSDP1 (``FullyShardedDataParallel``) sets a wrapped module's ``weight`` to a
# plain view of its gathered flat parameter while the parameter is gathered and registers the sharded
# parameter again when it releases it; put back to the snapshot's (no ``weight`` in ``__dict__``), a replay
# that starts with the parameter gathered deletes the view, and the module has no ``weight``. Told by what
# the container or attribute holds, as lifecycle.py tells a stack's ops by what they do, not by the stack's
# names. Given up: a forward or hook that appends parameters to a list of its own
# appends them again in each replay.


def _parameter_view(value: Any) -> bool:
    """Whether ``value`` is a parameter or a view of one: what FSDP1 sets as a module's attribute while it
    holds the parameter gathered (NOTE [Parameter bookkeeping is the stack's])."""
    return issubclass(type(value), torch.Tensor) and (  # by type: a dead weak proxy raises on isinstance
        isinstance(value, nn.Parameter) or isinstance(value._base, nn.Parameter))


def _holds_parameters(contents: Any) -> bool:
    """Whether a list, deque, set or dict (its values) holds a parameter (NOTE [Parameter bookkeeping is
    the stack's])."""
    if not isinstance(contents, _CONTAINERS):
        return False
    items = contents.values() if isinstance(contents, dict) else contents
    return any(issubclass(type(item), torch.Tensor) and isinstance(item, nn.Parameter) for item in items)


class _Generator(_Entry):
    """Where a random generator the layer reaches stands: a ``torch.Generator``
    (``torch.bernoulli(x, generator=self.g)``), a ``random.Random``, a numpy ``RandomState`` or
    ``Generator``, and the global ones behind ``random.random()`` and ``np.random.rand()``. Its state is
    kept in a form compared by value (bytes, or Python's own state tuple) and set back exactly; read
    as bytes where its layout allows (NOTE [Generators read as bytes])."""

    __slots__ = ("bits", "cached", "words")

    def __init__(self, target: Any) -> None:
        self.target = target
        self._lay()
        self.values = self.now()

    def _lay(self) -> None:
        """Lay the byte arrays over the generator's state (NOTE [Generators read as bytes]); ``bits``, a numpy
        ``RandomState``'s bit generator they lie in (another one, given since, has its state elsewhere)."""
        self.words, self.cached = _twister_views(self.target)
        self.bits = None if self.cached is None else self.target._bit_generator

    def now(self) -> Any:
        if self.cached is not None and self.target._bit_generator is not self.bits:
            self._lay()  # np.random.set_bit_generator(), or __init__ again: the old state may be freed
        if self.words is not None:  # NOTE [Generators read as bytes]
            if self.cached is None:
                return _TwisterState(self.words.raw, self.target.gauss_next)
            return _LegacyNumpyState(self.words.raw + self.cached.raw)
        target = self.target
        if type(target) is torch.Generator:
            return target.get_state().numpy().tobytes()
        if isinstance(target, random.Random):
            return target.getstate()
        return pickle.dumps(target.bit_generator.state if hasattr(target, "bit_generator") else target.get_state())

    def holds(self, values: Any) -> bool:
        if self.words is None or (self.cached is not None and self.target._bit_generator is not self.bits):
            return self.now() == values
        if self.cached is None:
            return self.words.raw == values.words and self.target.gauss_next == values.gauss_next
        return values.startswith(self.words.raw) and values.endswith(self.cached.raw)  # no copy of the whole

    def put(self, state: Any) -> None:
        target = self.target
        if type(target) is torch.Generator:
            target.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        elif type(state) is _TwisterState:
            target.setstate(state.python_state())
        elif isinstance(target, random.Random):
            target.setstate(state)
        elif type(state) is _LegacyNumpyState:
            target.set_state(state.numpy_state())
        elif hasattr(target, "bit_generator"):
            target.bit_generator.state = pickle.loads(state)
        else:
            target.set_state(pickle.loads(state))


# NOTE [Generators read as bytes]
# Python's and numpy's global generators are reached by every layer, and their state APIs build it
# anew at each read (``random.getstate()`` a tuple of 625 ints; numpy's ``get_state()`` copies its key
# word by word, a few hundred microseconds, and was pickled to compare): most of the Python state's
# cost, three times per layer invocation. Both are Mersenne Twisters whose state is 2,500 bytes in one
# place: CPython's ``random.Random`` holds its index and 624 words right after the object header,
# numpy's MT19937 publishes the address of its key and position (``bit_generator.ctypes.state_address``).
# hyperac reads those bytes (a copy, compared by value: exact), with what else a draw can change: Python's
# ``gauss_next`` (an attribute), and numpy's cached Gaussian (``has_gauss`` and ``gauss`` of a
# ``RandomState``, which a legacy Gaussian draw takes without moving the key), found in the object where
# probes put a known value. Each layout is probed once against the generator's own state API (as NOTE
# [Every private torch piece] in _compat.py does for torch's): where a Python or numpy build lays them
# out otherwise, the state APIs are read as before. A read is then a copy of 2.5 KB, through a ctypes
# array laid over those bytes once (its ``raw``: no foreign call per read, where ``ctypes.string_at``'s
# cost a few microseconds each in a step, six times per layer invocation), and a put back (rare: only
# where a draw moved it) goes through the state API.

_TWISTER_BYTES = 4 + 624 * 4
"""A Mersenne Twister's index (or position) and its 624 32-bit words."""


@functools.cache
def _twister_bytes_readable() -> bool:
    """Whether a ``random.Random``'s state is the 2,500 bytes after its object header, checked on a probe."""
    base = random.Random.__mro__[1]
    if sys.implementation.name != "cpython" or base.__basicsize__ < object.__basicsize__ + _TWISTER_BYTES:
        return False
    probe = random.Random(12345)
    probe.random()
    return _TwisterState(_twister_view(probe).raw, None).python_state() == probe.getstate()


def _twister_view(generator: random.Random) -> Any:
    """A byte array over a ``random.Random``'s index and words, right after its object header."""
    return _view(id(generator) + object.__basicsize__, _TWISTER_BYTES)


def _twister_views(target: Any) -> tuple[Any, Any]:
    """Byte arrays laid over a Mersenne Twister's words and over a numpy ``RandomState``'s cached Gaussian (None
    for Python's ``random.Random``, whose ``gauss_next`` is an attribute); ``(None, None)`` for a generator read
    through its state API (NOTE [Generators read as bytes]). ``target`` keeps the bytes they lie over alive, but for
    a ``RandomState`` given another bit generator since (:class:`_Generator` lays them anew then)."""
    kind = type(target)
    if kind is random.Random and _twister_bytes_readable():
        return _twister_view(target), None
    bits = _legacy_twister(target)
    if bits is None:
        return None, None
    return _numpy_views(bits.ctypes.state_address, id(target) + _numpy_gauss_at(kind))  # type: ignore[operator]


def _view(address: int, size: int) -> Any:
    return (ctypes.c_char * size).from_address(address)


class _TwisterState:
    """A ``random.Random``'s state as its bytes and ``gauss_next``, compared by value."""

    __slots__ = ("gauss_next", "words")

    def __init__(self, words: bytes, gauss_next: float | None) -> None:
        self.words, self.gauss_next = words, gauss_next

    def __eq__(self, other: object) -> bool:
        return (type(other) is _TwisterState and self.words == other.words
                and self.gauss_next == other.gauss_next)

    __hash__ = None  # type: ignore[assignment]

    def python_state(self) -> tuple[int, tuple[int, ...], float | None]:
        index, *words = struct.unpack(f"=i{len(self.words) // 4 - 1}I", self.words)
        return 3, (*words, index), self.gauss_next


def _legacy_twister(target: Any) -> Any:
    """The MT19937 bit generator of a numpy ``RandomState`` whose state is readable as bytes, else None."""
    bits = getattr(target, "_bit_generator", None)
    kind = type(target)
    if type(bits).__name__ != "MT19937" or kind.__name__ != "RandomState" or _numpy_gauss_at(kind) is None:
        return None
    return bits


@functools.cache
def _numpy_gauss_at(kind: type) -> int | None:
    """Where a numpy ``RandomState`` (``kind``) keeps ``has_gauss`` (an int, then at 8 bytes further the
    cached Gaussian, a double) in its object, found on probes and checked against ``get_state()``, with its
    MT19937 state readable at ``ctypes.state_address``; None where not so (NOTE [Generators read as bytes])."""
    size = kind.__basicsize__
    probes = [kind(seed) for seed in (1, 2)]
    found: set[int] | None = None
    try:
        for probe in probes:
            probe.standard_normal()  # leaves a cached Gaussian
            state = probe.get_state()
            memory = ctypes.string_at(id(probe), size)
            gauss = struct.pack("=d", state[4])
            at = {offset for offset in range(object.__basicsize__, size - 16 + 1, 8)
                  if memory[offset + 8:offset + 16] == gauss and struct.unpack_from("=i", memory, offset)[0] == 1}
            found = at if found is None else found & at
        if found is None or len(found) != 1:
            return None
        offset = found.pop()

        def read(probe: Any) -> tuple:
            words, cached = _numpy_views(probe._bit_generator.ctypes.state_address, id(probe) + offset)
            return _LegacyNumpyState(words.raw + cached.raw).numpy_state()

        for probe in probes:
            if not _same_numpy_state(read(probe), probe.get_state()):
                return None
            probe.standard_normal()  # takes the cached Gaussian
            if not _same_numpy_state(read(probe), probe.get_state()):
                return None
    except (AttributeError, TypeError, ValueError, struct.error):
        return None
    return offset


def _numpy_views(words_at: int, cached_at: int) -> tuple[Any, Any]:
    """Byte arrays over a ``RandomState``'s MT19937 key and position (at ``words_at``), and over its ``has_gauss``
    and cached Gaussian (at ``cached_at``: an int, then at 8 bytes further a double)."""
    return _view(words_at, _TWISTER_BYTES), _view(cached_at, _GAUSS_BYTES)


_GAUSS_BYTES = 16
"""A ``RandomState``'s ``has_gauss`` (an int, padded to 8 bytes) and cached Gaussian (a double)."""


def _same_numpy_state(first: tuple, second: tuple) -> bool:
    return first[0] == second[0] and (first[1] == second[1]).all() and first[2:] == second[2:]


class _LegacyNumpyState(bytes):
    """A numpy ``RandomState``'s state as the bytes its views read (:func:`_numpy_views`: the key and position,
    then ``has_gauss``, its padding and the cached Gaussian), compared by value."""

    __slots__ = ()

    def numpy_state(self) -> tuple:
        numpy = sys.modules["numpy"]
        key = numpy.frombuffer(self, dtype="=u4", count=624).copy()
        position, has_gauss = struct.unpack_from("=ii", self, _TWISTER_BYTES - 4)
        return "MT19937", key, position, has_gauss, struct.unpack_from("=d", self, _TWISTER_BYTES + 8)[0]


def _is_generator(value: Any) -> bool:
    """A torch, Python (not ``SystemRandom``: it has no state) or numpy random generator."""
    kind = type(value)
    if kind is torch.Generator or (issubclass(kind, random.Random) and not issubclass(kind, random.SystemRandom)):
        return True
    numpy_random = sys.modules.get("numpy.random")
    return numpy_random is not None and issubclass(kind, (numpy_random.RandomState, numpy_random.Generator))


# NOTE [A snapshot taken again]
# Walking what a layer can reach and copying it (NOTE [Python state in the replay]) at every invocation, and
# comparing it entry by entry at each replay's start and end, was most of what ``full`` cost over torch's
# checkpoint on a host-bound step (benchmarks/host_overhead.py), though a layer's state almost never changes
# from one invocation to the next. So each snapshot keeps a witness (:class:`_Witness`): the versions of the
# dicts it copied (NOTE [Dict versions]: every module's ``__dict__`` and forward hook tables, the plain
# objects' ``__dict__`` and the dicts found), the ``requires_grad`` of the parameters, and the entries no version
# covers (lists, sets, deques, closure cells, generators, a module with forward hooks), each compared as a
# put-back compares it; and a second witness, ``walk``, of what only the walk read: the modules' children and
# parameter tables, the objects the search for modules looked through (dicts and ``__dict__``s by version,
# lists, sets and deques compared), the global hook tables and ``sys.modules`` (an import could add numpy's
# generator). Where both hold, the state is the one the snapshot saw, in every place the snapshot and its walk
# read: a region's next invocation with the same non-tensor arguments (by identity) takes the same snapshot
# again (:class:`Snapshots`, one per recomputed module) instead of walking and copying; a replay that starts
# and ends with the first witness holding puts nothing back, without comparing entry by entry. Where it does
# not hold, everything runs as before: a new walk, and each entry compared and put back. A witness reads all
# its versions in one C call (an ``itemgetter`` over the process's memory as 8-byte words, at addresses the
# dicts it holds keep alive), then the owners of ``__dict__``s and the flags in C-level loops, then one
# comparison per unversioned entry: for a Llama decoder layer 47 versions and Python's and numpy's generators,
# where the walk and its copies were about 60 Python calls. Kept only where every object the walk met is of
# those kinds (no ``__slots__``, weak proxies or ``functools.partial``), and where the Python build has dict
# versions; otherwise each invocation walks anew, as before. What is kept (``Snapshots.kept``) is the snapshot
# less its region's own module's entry: the module holds its override, which holds the kept snapshot, so an
# entry holding the module or its ``__dict__`` would be a reference cycle, and a dropped model would wait for
# the garbage collector (a test drops one with the collector off). The witness checks that module by the id
# and version of its ``__dict__`` on the module each check is given, and each invocation takes its entry anew
# (one copy of its ``__dict__``). A kept snapshot holds the other references it saw until the module's next
# invocation (a region held them until its backward was done): only objects the live state held as that
# invocation's forward started. Tested against a new walk after random writes of every kind
# (tests/test_snapshot_again.py).


_DICT = itertools.repeat("__dict__")


class _Witness:
    """What tells, in a few C-level loops, that the state a snapshot saw is all still there (NOTE [A snapshot
    taken again]): :meth:`holds`. Its ``walk`` tells the same of what only the snapshot's walk read (the
    modules' children and parameter tables, the objects looked through for modules, the global hook tables),
    which a replay does not put back."""

    __slots__ = ("compared", "flags", "held", "owners", "parameters", "read", "read_all", "root", "states",
                 "versions", "versions_all", "walk")

    def __init__(self, walk: _Witness | None = None) -> None:
        self.walk = walk
        self.held: list[dict[str, Any]] = []
        """The dicts vouched for by version, held (their words are read by address)."""
        self.versions: Any = []
        self.owners: list[Any] = []
        self.states: list[dict[str, Any]] = []
        self.parameters: list[torch.Tensor] = []
        self.compared: list[_Entry] = []
        self.flags: tuple[bool, ...] = ()
        self.read: Callable[[Any], Any] = _nothing
        self.read_all: Callable[[Any], Any] = _nothing
        """The versions of this witness's dicts and its walk's, in one read (as a snapshot is taken again)."""
        self.versions_all: Any = ()
        self.root: tuple[int, int, tuple | None] | None = None
        """The region's own module: its ``__dict__``'s id and version, and its user hooks where it has forward
        hooks (:meth:`_Module.vouch_as_root`); checked on the module each check is given."""

    def stamp(self, state: dict[str, Any], version: int | None = None, owner: Any = None) -> None:
        """Vouch for ``state`` by its version (``version``, as its copy was taken, or now), and where it is
        ``owner``'s ``__dict__``, for ``owner`` still having it."""
        self.held.append(state)
        self.versions.append(_version(state) if version is None else version)
        if owner is not None:
            self.owners.append(owner)
            self.states.append(state)

    def seal(self) -> bool:
        """Fix what :meth:`holds` reads; False where a version moved while the snapshot was taken."""
        if self.held:
            self.read = reader(self._words())
        now = self.read(MEMORY)
        if now != tuple(self.versions):
            return False
        self.versions = now
        self.flags = tuple(map(_requires_grad, self.parameters))
        if self.walk is None:
            return True
        words = self._words() + self.walk._words()
        if words:
            self.read_all = reader(words)
        self.versions_all = self.read_all(MEMORY)
        return self.walk.seal()

    def _words(self) -> list[int]:
        """Where the version of each dict held lies, as an index into :data:`MEMORY`."""
        return [(id(state) + _VERSION_AT) // 8 for state in self.held]  # type: ignore[operator]

    def holds(self, root: nn.Module | None) -> bool:
        """Whether the state is the one the snapshot saw, ``root`` its region's own module."""
        return self.read(MEMORY) == self.versions and self._rest_holds() and self._root_holds(root)

    def holds_with_walk(self, root: nn.Module) -> bool:
        """:meth:`holds`, and the walk's, with the versions of both read at once."""
        return (self.read_all(MEMORY) == self.versions_all and self._rest_holds()
                and self.walk._rest_holds() and self._root_holds(root))  # type: ignore[union-attr]

    def _root_holds(self, root: nn.Module | None) -> bool:
        if self.root is None:
            return True
        state_id, version, hooks = self.root
        state = object.__getattribute__(root, "__dict__")
        return (id(state) == state_id and MEMORY[(state_id + _VERSION_AT) // 8] == version  # type: ignore[index, operator]
                and (hooks is None or _same(_hooks_of(root), hooks)))  # type: ignore[arg-type]

    def _rest_holds(self) -> bool:
        """What :meth:`holds` checks past the versions."""
        return (all(map(operator.is_, map(object.__getattribute__, self.owners, _DICT), self.states))
                and tuple(map(_requires_grad, self.parameters)) == self.flags
                and all(entry.holds(entry.values) for entry in self.compared))


def _nothing(memory: Any) -> tuple:
    return ()


def _witness_of(entries: list[_Entry], walked: Iterable[Any], irregular: bool, root_at: int | None
                ) -> _Witness | None:
    """The witness of a snapshot of ``entries`` whose search for modules looked through ``walked``, the region's
    own module's entry at ``root_at``, or None where one cannot vouch for it (NOTE [A snapshot taken again])."""
    if irregular or _VERSION_AT is None:
        return None
    witness = _Witness(walk=_Witness())
    walk = witness.walk
    covered = set()
    for position, entry in enumerate(entries):
        covered.add(id(entry.target))
        if position == root_at:
            entry.vouch_as_root(witness)  # type: ignore[attr-defined]
        elif not entry.vouch(witness):
            return None
    for value in walked:  # what _items_of read of each
        kind = type(value)
        if id(value) in covered or issubclass(kind, (tuple, frozenset)) or not (
                isinstance(value, _CONTAINERS) or _plain(value)):
            continue
        if isinstance(value, dict):
            walk.stamp(value)
        elif isinstance(value, _CONTAINERS):
            walk.compared.append(_Contents(value))
        elif _slot_names(kind):
            return None
        elif (state := _state_of(value)) is not None:
            walk.stamp(state, owner=value)
    registry = nn.modules.module
    for table in (registry._global_forward_pre_hooks, registry._global_forward_hooks, sys.modules):
        walk.stamp(table)
    return witness if witness.seal() else None


class PythonState:
    """The Python state one region invocation's forward starts from (NOTE [Python state in the
    replay]); a context manager that makes a replay start from it, entered once per replay.

    ``modules`` are the region's own; :attr:`borrowed` lists the modules its forward is given (in
    ``args`` and ``kwargs``, or as bound methods) or its modules hold without registering them (a plain
    attribute, a list), with their sub-modules; their state is part of the snapshot too.
    """

    def __init__(self, modules: Iterable[nn.Module], args: tuple, kwargs: dict[str, Any]) -> None:
        self.entries: list[_Entry] = []
        self.seen: set[int] = set()
        self.irregular = False
        """Whether the walk met an object no witness vouches for (NOTE [A snapshot taken again])."""
        self.found: list[list[Any] | None] = []
        own = list(modules)
        self.root = own[0] if own else None
        """The region's own module (the first given)."""
        self.root_at: int | None = None
        """Where its entry is in :attr:`entries` (after those of the arguments)."""
        self.seen.update(map(id, own))
        found: list[nn.Module] = []
        walked: dict[int, Any] = {}  # what the search for modules looked through
        self.leaves = _held_leaves((args, kwargs), [])
        for leaf in self.leaves:
            found.extend(_modules_in(leaf, walked))
            self._add_deep(leaf)
        self.root_at = len(self.entries) if own else None
        for module in own:
            found.extend(self._add_module(module, walked))
        for value in _hook_holders(_global_hooks()):
            self._add_held(value)
        for generator in _global_generators():
            self._add_contents(generator)
        self.borrowed: list[nn.Module] = []
        for candidate in found:
            for module in module_tree(candidate):
                if id(module) not in self.seen:
                    self.seen.add(id(module))
                    self.borrowed.append(module)
                    self._add_module(module, walked)
        self.witness = _witness_of(self.entries, walked.values(), self.irregular, self.root_at)

    def kept(self) -> _Kept | None:
        """What of this snapshot a later invocation can take again (NOTE [A snapshot taken again]): all but the
        region's own module and its ``forward`` (the override, which holds the kept part), which it must not
        hold; None where no witness vouches for it."""
        if self.witness is None or self.root_at is None:
            return None
        entries: list[_Entry | None] = list(self.entries)
        root = entries[self.root_at]
        entries[self.root_at] = None
        attributes, flags, hooks, version = root.values  # type: ignore[union-attr]
        if "forward" in attributes:  # the override, which holds this: never restored, so stood in for
            attributes = {**attributes, "forward": _MISSING}
        return _Kept(entries, self.root_at, root.parameters, (attributes, flags, hooks, version),  # type: ignore[union-attr]
                     self.borrowed, self.leaves, self.witness)

    @classmethod
    def again(cls, kept: _Kept, root: nn.Module) -> PythonState:
        """The snapshot ``kept`` is of, for another invocation of ``root`` whose forward starts from the same
        state: the same entries, the root's on the module again (its ``__dict__``'s version unchanged, so what
        was copied is still what it holds, but for ``forward``, which is never restored), replays of its own."""
        entry = object.__new__(_Module)  # what _Module(root) reads, as the witness holds: no copy
        entry.target, entry.live, entry.parameters, entry.values = root, root.__dict__, kept.parameters, kept.values
        state = object.__new__(cls)
        state.entries = list(kept.entries)  # type: ignore[arg-type]
        state.entries[kept.root_at] = entry
        state.root, state.root_at, state.borrowed, state.leaves, state.witness = (
            root, kept.root_at, kept.borrowed, kept.leaves, kept.witness)
        state.found = []
        return state

    def _add_module(self, module: nn.Module, walked: dict[int, Any]) -> list[nn.Module]:
        """Snapshot ``module``'s attributes (each with :meth:`_add_deep`), its parameters' ``requires_grad``,
        its hook tables and what its hooks hold; returns the modules among its attributes."""
        attributes = _Module(module)
        self.entries.append(attributes)
        held = []
        for value in attributes.own():
            held.extend(_modules_in(value, walked))
            self._add_deep(value)
        if module._forward_pre_hooks or module._forward_hooks:
            for value in _hook_holders((*module._forward_pre_hooks.values(), *module._forward_hooks.values())):
                self._add_held(value)
        return held

    def _add_held(self, value: Any) -> None:
        """What a hook holds: a closure cell (and one level into its value), a module's attributes (the
        model a ``self.seen.append`` hook closes over), or the value and one level into what it holds (a
        hook object's list of what it recorded, also where the object is a module's attribute as well)."""
        kind = type(value)
        if id(value) in self.seen and (kind in (types.CellType, types.FunctionType) or issubclass(kind, nn.Module)):
            return
        if kind is types.FunctionType:  # a function a hook calls or is: what its closure holds
            self.seen.add(id(value))
            if _users(value):
                for cell in value.__closure__ or ():
                    self._add_held(cell)
        elif kind is types.CellType:
            self.seen.add(id(value))
            cell = _Cell(value)
            self.entries.append(cell)
            if cell.values is not _MISSING:
                self._add_held(cell.values)
        elif issubclass(kind, nn.Module):
            self.seen.add(id(value))
            attributes = _Attributes(value)
            self.entries.append(attributes)
            for item in attributes.own():
                self._add_deep(item)
        else:
            self._add_deep(value)

    def _add_deep(self, value: Any) -> None:
        """``value``'s contents and one level into what it holds: a hook object's list of what it
        recorded, ``self.a.b`` (``self.a.b.c += 1``), a dict of lists (``stats[name].append(...)``)."""
        if type(value) in _ATOMS or id(value) in self.seen:
            return
        self._add_contents(value)
        for item in _items_of(value):
            self._add_contents(item)

    def _add_contents(self, value: Any) -> None:
        """One level into ``value``: what a list, dict, set or plain object holds (not a module: its
        attributes are snapshotted where it is found to run)."""
        if type(value) in _ATOMS or id(value) in self.seen or issubclass(type(value), nn.Module):
            return
        self.seen.add(id(value))
        if _is_generator(value):
            self.entries.append(_Generator(value))
            return
        kind = type(value)
        if issubclass(kind, weakref.ref):
            self._add_contents(value())  # what the weak reference points at, while it lives
            return
        if kind in (weakref.ProxyType, weakref.CallableProxyType):
            self.irregular = True  # its referent may die: NOTE [A snapshot taken again]
            try:  # a proxy answers for its referent: its class, its __dict__
                if _plain_kind(value.__class__):
                    self._add_contents(value.__dict__)
            except (ReferenceError, AttributeError):  # dead, or no __dict__
                pass
            return
        if kind in (types.MethodType, types.BuiltinMethodType):
            self._add_contents(value.__self__)  # self.coin = random.Random(0).random
            return
        if kind is functools.partial:
            self.irregular = True  # its keywords are a dict no version is read of: NOTE [A snapshot taken again]
            for item in (value.func, *value.args, *value.keywords.values()):
                self._add_contents(item)
            return
        contents = _Contents(value)
        if contents.values is not _MISSING:
            self.entries.append(contents)

    def put_back(self) -> list[Any]:
        """Make the state what it was when this snapshot was taken; returns the state each entry had just
        before (what a replay leaves behind), one Python call per entry where it is the snapshot's."""
        found = []
        for entry in self.entries:
            if entry.holds(entry.values):
                found.append(entry.values)
            else:
                found.append(entry.now())
                entry.put(entry.values)
        return found

    def __enter__(self) -> None:
        if self.witness is not None and self.witness.holds(self.root):  # NOTE [A snapshot taken again]
            self.found.append(None)
        else:
            self.found.append(self.put_back())

    def __exit__(self, *exc: Any) -> None:
        found = self.found.pop()
        if found is None:  # the replay started from the snapshot's state itself
            if self.witness.holds(self.root):  # type: ignore[union-attr]
                return
            found = [entry.values for entry in self.entries]
        for entry, value in zip(reversed(self.entries), reversed(found)):
            if not entry.holds(value):
                entry.put(value)


class _Kept(NamedTuple):
    """A snapshot without its region's own module (:meth:`PythonState.kept`)."""

    entries: list[_Entry | None]
    root_at: int
    parameters: tuple[torch.Tensor, ...]
    """The root's parameters, then its entry's values, its ``forward`` stood in for."""
    values: tuple[dict[str, Any], tuple[bool, ...], tuple, int | None]
    borrowed: list[nn.Module]
    leaves: list[Any]
    witness: _Witness


class Snapshots:
    """The snapshots of one recomputed module's invocations: each taken anew, or the last one taken again
    where its witness holds and the forward is given the same non-tensor arguments (NOTE [A snapshot taken
    again]). Holds no reference to the module (which holds this). Copied and pickled empty."""

    __slots__ = ("kept",)

    def __init__(self) -> None:
        self.kept: _Kept | None = None

    def __reduce__(self) -> tuple[type, tuple]:
        return Snapshots, ()

    def take(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> PythonState:
        """The snapshot of an invocation of ``module`` on ``args`` and ``kwargs``, as its forward starts."""
        kept = self.kept
        if kept is not None:
            leaves = _held_leaves((args, kwargs), [])
            if (len(leaves) == len(kept.leaves) and all(map(operator.is_, leaves, kept.leaves))
                    and kept.witness.holds_with_walk(module)):
                return PythonState.again(kept, module)
        state = PythonState(module_tree(module), args, kwargs)
        self.kept = state.kept()
        return state
