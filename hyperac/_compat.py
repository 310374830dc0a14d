"""Which torch internals hyperac relies on, and whether this torch has them.

Selective recompute uses a few private helpers of ``torch.utils.checkpoint`` and op schemas, and
swap reads a private storage use count, rather than copying PyTorch's code. The price is that any
release may change them without a deprecation, and a changed internal rarely fails loudly: the
protection of kept outputs against in-place writes silently turning off gives wrong gradients, and
a storage freed while someone still reads it gives wrong activations. So before
:func:`hyperac.apply` installs a mode that needs them, :func:`require` checks by behaviour, once
per process, that they work as hyperac expects, and raises
:class:`~hyperac.errors.TorchVersionError` (naming this torch and the tested range) when they do
not. The first check costs well under a millisecond of work; later ones are a cache lookup.

NOTE [Probed torch internals]
``selective`` (policy.py records and replays with its own dispatch modes):

* ``torch.utils.checkpoint._detach_helper(t)`` returns an alias of ``t`` outside autograd that
  shares its storage and its version counter: a kept output, whose in-place change the replay
  must see (NOTE [Writes into kept outputs]).
* ``OpOverload._schema``: ``is_mutable`` and ``arguments[i].alias_info.is_write`` tell which
  tensors an op writes (the copies made before a write into a kept output).
* ``torch.utils.checkpoint.SAC_IGNORED_OPS`` holds ``aten::detach`` (which checkpoint runs a
  different number of times in forward and recompute), and ``_sac_storage_key(op, args)`` is the
  op itself for an ordinary op (it splits compiled regions inside an eager region).
* ``torch.Tag.nondeterministic_seeded`` marks ops that draw random numbers (a kept attention with
  dropout), and ``torch._ops.HigherOrderOperator`` exists.

``compile=True`` layers use PyTorch's public ``create_selective_checkpoint_contexts``, whose
cached tensors bypass ``saved_tensors_hooks`` (a user's ``save_on_cpu``) up to torch 2.14.
torch 2.14 added ``checkpoint(..., respect_saved_tensors_hooks=)`` and announced that the default
will route them through the hooks; hyperac passes ``False`` (:data:`SAC_CHECKPOINT_KWARGS`), so
both sides of that change behave as torch 2.13 does.

``swap_selective_outputs`` (swap.py):

* ``torch._C._storage_Use_Count(storage._cdata)`` counts each tensor on the storage and its Python
  storage object; a detached alias or a view adds one.
* ``untyped_storage().resize_(0)`` frees the bytes, and growing it back keeps the tensor valid.

Swap under ``compile=True`` (hyperac/compiled.py, NOTE [Swap under torch.compile]) sets
``torch._functorch.config`` options (``enable_activation_offloading``,
``activation_offload_separate_stream``, ``activation_offload_cpu_gpu_bw``, ``joint_custom_pass``)
and reads and writes FX node ``meta["recompute"]`` / ``meta["should_offload"]``; apply checks
that the options and ``CheckpointPolicy.MUST_CPU_OFFLOAD`` exist (``compiled.offloading_available``)
and raises :class:`~hyperac.errors.TorchVersionError` where they do not.

Recompute under ``compile=True`` (recompute.py, NOTE [Python side effects in a compiled region]) runs
each region's forward through dynamo's
``torch._dynamo.utils._disable_side_effect_safety_checks_for_current_subtracer``; apply probes it (one
small compile per process) and raises :class:`~hyperac.errors.TorchVersionError` naming ``compile=False``
where it is missing or no longer keeps a region's writes in one graph.

The knapsack modes under ``compile=True`` (NOTE [Knapsack layers] in compiled.py) use the prototype
``torch.autograd.graph.region_activation_memory_budget``; where it is missing applying one raises
:class:`~hyperac.errors.TorchVersionError`.

``torch._C._dynamo.eval_frame.set_eval_frame`` (torch.compile's frame hook) lets the eager
recording and replay modes turn frame compilation off once per region (NOTE [Dispatch modes and
torch.compile] in policy.py); where it is missing they keep torch's per-op guard.

Imported directly, so a missing one fails ``import hyperac`` loudly rather than changing behaviour:
``torch.utils._pytree``, ``torch.utils._python_dispatch`` (``TorchDispatchMode``,
``_disable_current_modes``) and ``torch.utils.flop_counter`` (``sdpa_flop_count``,
``sdpa_backward_flop_count``).

NOTE [Every private torch piece]: :data:`PRIVATE_TORCH` is the one table of every private piece of
torch that hyperac relies on anywhere, with the file that uses it and a probe of the behaviour it
relies on; :func:`probe_private_torch` runs them all (tests/test_compat.py does, on every torch in
the tested range). The features above are also checked at ``apply``; the others are used in
paths where a mismatch fails loudly (an AttributeError, a dynamo error), so the table is how a new
torch release is judged before it is added to the tested range.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import checkpoint as torch_recompute

from .config import RECOMPUTE_MODES, SELECTIVE_MODES, Config
from .errors import HyperACWarning, TorchVersionError

__all__ = [
    "FRAME_HOOK_AVAILABLE", "MIN_TORCH", "PRIVATE_TORCH", "SAC_CHECKPOINT_KWARGS", "TESTED_TORCH",
    "pause_frame_compilation", "probe_private_torch", "require", "require_for", "resume_frame_compilation",
    "storage_use_count",
]

# The torch releases the whole suite runs on (tox -e cpu, tox -e torch-newest), and the floor
# pyproject.toml declares (older releases lack the internals probed below). Newer releases are not
# capped in pyproject: a cap would make pip replace the user's torch; the probes judge them instead,
# and apply warns once that the release is untested (NOTE [A torch newer than the tested range]).
TESTED_TORCH = ("2.13", "2.14", "2.15")
MIN_TORCH = TESTED_TORCH[0]
TESTED_RANGE = f"{TESTED_TORCH[0]}-{TESTED_TORCH[-1]}"


def _storage_use_count_missing(cdata: int) -> int:
    raise _mismatch("swap_selective_outputs=True", "torch._C has no _storage_Use_Count")


storage_use_count: Any = getattr(torch._C, "_storage_Use_Count", _storage_use_count_missing)

# Every checkpoint() call with a selective context passes these (NOTE [Probed torch internals]).
SAC_CHECKPOINT_KWARGS: dict[str, Any] = (
    {"respect_saved_tensors_hooks": False}
    if "respect_saved_tensors_hooks" in inspect.signature(torch_recompute.checkpoint).parameters
    else {}
)


_FULL_INSTEAD = "or use mode='full', which needs no torch internals"
_FEATURES = {"selective": "the selective modes (selective, selective-even, pointwise)",
             "swap_selective_outputs": "swap_selective_outputs=True",
             "compiled_regions": "recompute under compile=True (its regions keep their Python side effects)"}
_FIXES = {"compiled_regions": "or apply with compile=False (eager recompute needs no compiler internals)"}


def _mismatch(feature: str, detail: str, fix: str = _FULL_INSTEAD) -> TorchVersionError:
    return TorchVersionError(
        f"torch {torch.__version__} lacks or changed a torch internal needed by {feature}: {detail}. "
        f"hyperac is tested with torch {TESTED_RANGE}; install one "
        f"(e.g. pip install 'torch=={TESTED_TORCH[-1]}.0'), {fix}."
    )


def require(*features: str) -> None:
    """Raise :class:`TorchVersionError` unless this torch has what ``features`` need.

    ``features``: ``"selective"`` (selective modes in eager), ``"swap_selective_outputs"`` and
    ``"compiled_regions"`` (recompute regions under ``compile=True``).
    Each is checked once per process; a failed check is repeated on the next call.
    """
    for feature in features:
        _check(feature)


def require_for(modes: list[str], swaps: list[bool], config: Config) -> None:
    """:func:`require` what a plan needs: ``selective`` for eager selective layers,
    ``swap_selective_outputs`` where their outputs swap, ``compiled_regions`` for recomputed layers under
    ``compile=True``. Eager ``full`` and ``swap`` layers need none; eager regions probe, once, whether their
    hook pair can do checkpoint's hooks' work (NOTE [Checkpoint's hooks in the region's pair] in
    replay/region_saves.py), and call checkpoint's hooks where not."""
    selective = [swap for mode, swap in zip(modes, swaps) if mode in SELECTIVE_MODES and not config.compile]
    swapped = config.swap_selective_outputs and any(selective)
    compiled = bool(config.compile) and any(mode in RECOMPUTE_MODES for mode in modes)
    require(*["selective"] * bool(selective), *["swap_selective_outputs"] * swapped, *["compiled_regions"] * compiled)
    if not config.compile:  # NOTE [Checkpoint's hooks in the region's pair] in replay/region_saves.py
        from .replay.region_saves import probe_checkpoint_hooks

        probe_checkpoint_hooks()


# NOTE [A torch newer than the tested range]
# The probes catch a changed internal that hyperac calls; they cannot catch a release that changes
# what it computes around them (a new decomposition, a dynamo rule that splits a graph). So ``apply``
# on a torch whose major.minor is newer than :data:`TESTED_TORCH` (pre-releases and nightlies of it
# included: 2.16.0a0, 2.16.0.dev20261201) warns once per process, naming the tested range; the
# warning is keyed by the version string, so a test that fakes one sees it whatever ran before.
# Older releases are refused by pip (pyproject's floor), not here.


def untested_torch(version: str) -> bool:
    """Whether ``version`` (a ``torch.__version__``) is a major.minor newer than :data:`TESTED_TORCH`."""
    found = re.match(r"(\d+)\.(\d+)", version)
    newest = tuple(int(part) for part in TESTED_TORCH[-1].split("."))
    return found is not None and (int(found[1]), int(found[2])) > newest


@functools.cache
def warn_if_untested(version: str) -> None:
    """Warn once per process (per ``version``) that torch ``version`` is newer than the tested range
    (NOTE [A torch newer than the tested range]); called by :func:`hyperac.apply`."""
    if untested_torch(version):
        warnings.warn(
            f"hyperac is tested with torch {TESTED_RANGE}; torch {version} is newer. apply checks the torch "
            "internals it relies on (a changed one raises TorchVersionError), but an untested release can change "
            "what the compiler or autograd do around them. If gradients or memory look wrong, install a tested "
            f"torch: pip install 'torch=={TESTED_TORCH[-1]}.0'.",
            HyperACWarning, stacklevel=3,
        )


@functools.cache
def _check(feature: str) -> None:
    probe = {"selective": _probe_selective, "swap_selective_outputs": _probe_storage_use_count,
             "compiled_regions": _probe_side_effects_in_region}[feature]
    problem = _run(probe)
    if problem is not None:
        raise _mismatch(_FEATURES[feature], problem, _FIXES.get(feature, _FULL_INSTEAD))


def _run(probe: Callable[[], str | None]) -> str | None:
    try:
        return probe()
    except Exception as error:  # any failure of an internal's contract is a mismatch, whatever its type
        return f"probing it raised {type(error).__name__}: {error}"


def _probe_selective() -> str | None:
    """The internals hyperac's recording and replay modes use, each on a two-element tensor."""
    names = ("_detach_helper", "SAC_IGNORED_OPS", "_sac_storage_key")
    missing = [name for name in names if not hasattr(torch_recompute, name)]
    if missing:
        return f"torch.utils.checkpoint has no {', '.join(missing)}"
    if not hasattr(torch._ops, "HigherOrderOperator") or not hasattr(torch.Tag, "nondeterministic_seeded"):
        return "torch has no torch._ops.HigherOrderOperator or torch.Tag.nondeterministic_seeded"
    schema = torch.ops.aten.add_.Tensor._schema
    if not schema.is_mutable or not getattr(schema.arguments[0].alias_info, "is_write", False):
        return "the schema of aten::add_ does not mark its first argument as written"
    if torch.Tag.nondeterministic_seeded not in torch.ops.aten.native_dropout.default.tags:
        return "aten::native_dropout is not tagged nondeterministic_seeded"
    if torch.ops.aten.detach.default not in torch_recompute.SAC_IGNORED_OPS:
        return "torch.utils.checkpoint.SAC_IGNORED_OPS does not hold aten::detach"
    x = torch.full((2,), 0.5, requires_grad=True)
    mul = torch.ops.aten.mul.Tensor
    if torch_recompute._sac_storage_key(mul, (x, x)) is not mul:
        return "torch.utils.checkpoint._sac_storage_key of an ordinary op is not the op"
    output = x * x
    kept = torch_recompute._detach_helper(output)
    if kept.requires_grad or kept.untyped_storage()._cdata != output.untyped_storage()._cdata:
        return "torch.utils.checkpoint._detach_helper does not return a detached alias"
    versions = kept._version, output._version
    output.add_(1)
    if (kept._version, output._version) != (versions[0] + 1, versions[1] + 1):
        return "torch.utils.checkpoint._detach_helper's alias does not share the version counter"
    return None


def _probe_storage_use_count() -> str | None:
    """A tensor, a detached alias and a view: the use counts swap's alias test expects."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return "torch._C has no _storage_Use_Count"
    tensor = torch.arange(4.0)
    storage = tensor.untyped_storage()
    alone = use_count(storage._cdata)
    alias, view = tensor.detach(), tensor[1:]
    counts = (alone, use_count(storage._cdata))
    del alias, view
    if counts != (2, 4) or use_count(storage._cdata) != 2:
        return f"torch._C._storage_Use_Count gave {counts} for a tensor alone, then with an alias and a view; " \
            "expected (2, 4)"
    storage.resize_(0)
    storage.resize_(4 * tensor.element_size())
    tensor.copy_(torch.arange(4.0))
    if tensor.tolist() != [0.0, 1.0, 2.0, 3.0]:
        return "a tensor whose storage was resized to zero and back does not hold new data"
    return None


try:
    from torch._C._dynamo.eval_frame import set_eval_frame as _set_eval_frame
except ImportError:  # a build without dynamo's frame hook: the modes keep torch's per-op guard
    _set_eval_frame = None
FRAME_HOOK_AVAILABLE = _set_eval_frame is not None


def pause_frame_compilation() -> Any:
    """Stop torch.compile from compiling the frames run from here on, if it was about to; returns
    what :func:`resume_frame_compilation` needs to restore it (NOTE [Dispatch modes and torch.compile])."""
    return None if _set_eval_frame is None else _set_eval_frame(None)


def resume_frame_compilation(paused: Any) -> None:
    if paused is not None:
        _set_eval_frame(paused)


def side_effects_once(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``; traced by dynamo inside a checkpoint region, the writes it makes to Python
    objects from outside the region are kept (applied once, not replayed) instead of breaking the graph
    (NOTE [Python side effects in a compiled region] in recompute.py). Only called while compiling, when
    ``torch._dynamo`` is imported."""
    return torch._dynamo.utils._disable_side_effect_safety_checks_for_current_subtracer(fn, *args, **kwargs)


def _probe_frame_hook() -> str | None:
    if _set_eval_frame is None:
        return "torch._C._dynamo.eval_frame has no set_eval_frame"
    return None


class _Outer:
    """An object from outside a compiled region, which the region writes to."""

    value: Any = None


def _region_writing_outside(outer: _Outer, x: torch.Tensor) -> torch.Tensor:
    # kernels' CompileableContextVar.set, then reset: a dict of objects dynamo cannot fold to a constant
    previous, outer.value = outer.value, {id(outer): (outer, _region_writing_outside)}
    try:
        return x.sin()
    finally:
        outer.value = previous


def _probe_side_effects_in_region() -> str | None:
    import torch._dynamo.utils

    if not callable(getattr(torch._dynamo.utils, "_disable_side_effect_safety_checks_for_current_subtracer", None)):
        return "torch._dynamo.utils has no _disable_side_effect_safety_checks_for_current_subtracer"

    outer, frames = _Outer(), []

    def backend(graph: torch.fx.GraphModule, inputs: Any) -> Any:
        frames.append(graph)
        return graph.forward

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch_recompute.checkpoint(side_effects_once, _region_writing_outside, outer, x, use_reentrant=False)

    x = torch.ones(2, requires_grad=True)
    try:
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):
            torch.compile(step, backend=backend, fullgraph=True)(x).sum().backward()
    finally:  # the probe's own graph only: each probe compiles afresh, other compiled code keeps its graphs
        torch._dynamo.reset_code(step.__code__)
    if len(frames) != 1 or outer.value is not None or not torch.equal(x.grad, x.detach().cos()):
        return "dynamo's _disable_side_effect_safety_checks_for_current_subtracer no longer lets a checkpoint " \
            "region write to an outer object in one graph"
    return None


def _probe_disable_dynamo() -> str | None:
    wrapped = torch._disable_dynamo(lambda value: value + 1)
    return None if wrapped(1) == 2 else "torch._disable_dynamo changed what the function it wraps returns"


def _probe_dispatch_mode_overrides() -> str | None:
    from torch.utils._python_dispatch import TorchDispatchMode

    missing = [name for name in ("_should_skip_dynamo", "ignore_compile_internals")
               if not callable(getattr(TorchDispatchMode, name, None))]
    return f"TorchDispatchMode has no {', '.join(missing)} to override" if missing else None


def _probe_hook_dicts() -> str | None:
    module = torch.nn.Linear(1, 1)
    pre = module.register_forward_pre_hook(lambda m, args, kwargs: None, with_kwargs=True)
    post = module.register_forward_hook(lambda m, args, kwargs, out: None, with_kwargs=True, always_call=True)
    tables = (("_forward_pre_hooks", pre.id), ("_forward_hooks", post.id), ("_forward_pre_hooks_with_kwargs", pre.id),
              ("_forward_hooks_with_kwargs", post.id), ("_forward_hooks_always_called", post.id))
    missing = [name for name, key in tables if key not in getattr(module, name, {})]
    if missing:
        return f"nn.Module keeps no hook entry in {', '.join(missing)}"
    copy_, copied_pre, copied_post = copy.deepcopy((module, pre, post))
    copied_pre.remove(), copied_post.remove()
    if copy_._forward_pre_hooks or copy_._forward_hooks or pre.id not in module._forward_pre_hooks:
        return "a deepcopy of a RemovableHandle does not point into the copied module's hook tables"
    registry = torch.nn.modules.module
    for register, name in ((registry.register_module_forward_pre_hook, "_global_forward_pre_hooks"),
                           (registry.register_module_forward_hook, "_global_forward_hooks")):
        handle = register(lambda *args: None)
        try:
            if handle.id not in getattr(registry, name, {}):
                return f"torch.nn.modules.module keeps no {name} of the hooks registered for every module"
        finally:
            handle.remove()
    return None


def _probe_buffers_dict() -> str | None:
    module = torch.nn.BatchNorm1d(2)
    replacement = torch.ones(2)
    module._buffers["running_mean"] = replacement
    return None if module.running_mean is replacement else "nn.Module._buffers is not where buffers are looked up"


def _probe_tensor_base() -> str | None:
    base = torch.zeros(4)
    return None if base[1:]._base is base and base._base is None else "Tensor._base is not a view's base"


def _probe_region_budget() -> str | None:
    import torch.fx.traceback as fx_traceback

    budget = getattr(torch.autograd.graph, "region_activation_memory_budget", None)
    if budget is None or not hasattr(fx_traceback, "MEMORY_BUDGET_ANNOTATION_KEY"):
        return "torch.autograd.graph has no region_activation_memory_budget (or fx.traceback no MEMORY_BUDGET key)"
    try:
        budget(0.5)
    except RuntimeError:  # outside torch.compile it refuses: the prototype hyperac was written against
        return None
    return "region_activation_memory_budget no longer refuses eager use; check what it means outside a graph"


def _probe_parametrize_cache() -> str | None:
    from torch.nn.utils import parametrize

    module = torch.nn.Linear(2, 2)
    torch.nn.utils.parametrizations.weight_norm(module)
    with parametrize.cached():
        enabled, weight = parametrize._cache_enabled, module.weight
        cached = list(parametrize._cache.values())
    if enabled != 1 or parametrize._cache_enabled != 0 or len(cached) != 1 or cached[0] is not weight:
        return "parametrize._cache_enabled / _cache no longer hold the cached() state and its tensors"
    return None


def _probe_sdpa_backends() -> str | None:
    from torch.nn import attention

    backends = attention._cur_sdpa_kernel_backends(True)
    attention._sdpa_kernel(backends, set_priority=True)
    return None if attention._cur_sdpa_kernel_backends(True) == backends else "sdpa backends do not round-trip"


def _probe_context_flags() -> str | None:
    from .replay import memory, replay_context

    words = replay_context._WORDS
    flags = replay_context._flags()  # the getters, which the context calls where the probe found no bytes
    if words is not None and words.decode(words.read(memory.MEMORY)) != flags:
        return "the bytes found for the deterministic and attention kernels' flags no longer read as their getters"
    return None


def _probe_saved_tensor_hook_stack() -> str | None:
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        pack, unpack = torch._C._autograd._top_saved_tensors_default_hooks(True)
        torch._C._autograd._push_saved_tensors_default_hooks(lambda t: seen.append(t) or pack(t), unpack)
        try:
            start = torch._C._autograd._get_sequence_nr()
            x = torch.ones(2, requires_grad=True)
            (x.exp() * 2).sum().backward()
        finally:
            torch._C._autograd._pop_saved_tensors_default_hooks()
    made = [t.grad_fn for t in seen if t.grad_fn is not None]
    if not made or made[0].name() != "ExpBackward0" or made[0]._sequence_nr() < start:
        return "the saved-tensors hook stack or autograd sequence numbers changed"
    return None


class _ReadTwice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad * ctx.saved_tensors[0] + grad * ctx.saved_tensors[0]


def _read_twice_in_a_region(frames: list[Any], x: torch.Tensor) -> torch.Tensor:
    from .replay.region_saves import RegionSaves
    from .replay.reread import checkpoint_frame

    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    frames.append(None if hooks is None else checkpoint_frame(hooks[1]))
    with RegionSaves(replaying=False):
        return _ReadTwice.apply(x.exp())


def _probe_checkpoint_frame() -> str | None:
    frames: list[Any] = []
    x = torch.full((2,), 0.5, requires_grad=True)
    torch_recompute.checkpoint(_read_twice_in_a_region, frames, x, use_reentrant=False).sum().backward()
    if frames[0] is None:
        return "the closure of checkpoint's unpack hook holds no _CheckpointFrame"
    if not torch.equal(x.grad, 2 * x.detach().exp() ** 2):
        return "a region read twice in one backward gave another gradient"
    return None


def _probe_checkpoint_hooks() -> str | None:
    from .replay.region_saves import probe_checkpoint_hooks

    return probe_checkpoint_hooks(again=True)


def _probe_op_call() -> str | None:
    from .policy import calls_op_directly

    if not calls_op_directly():  # the modes call the overload itself (torch 2.15): no private piece in use
        return None
    mul, x = torch.ops.aten.mul.Tensor, torch.full((2,), 0.5)
    if not torch.equal(mul._op(x, x), mul(x, x)):
        return "an OpOverload's _op does not compute what the overload does"
    return None


def _probe_local_scalar_dense_on_meta() -> str | None:
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            if func is torch.ops.aten._local_scalar_dense.default:
                return 1
            return func(*args, **(kwargs or {}))

    with Record():
        torch.ones(1, device="meta").item()
    if torch.ops.aten._local_scalar_dense.default not in seen:
        return "Tensor.item() on meta does not dispatch aten::_local_scalar_dense"
    return None


PRIVATE_TORCH: dict[str, tuple[str, Callable[[], str | None]]] = {
    "torch.utils.checkpoint: _detach_helper, SAC_IGNORED_OPS, _sac_storage_key; op schemas and tags": (
        "policy.py (selective record and replay)", _probe_selective),
    "torch._C._storage_Use_Count, UntypedStorage.resize_": (
        "swap.py (swap_selective_outputs)", _probe_storage_use_count),
    "torch._C._dynamo.eval_frame.set_eval_frame": (
        "policy.py (frame compilation paused per region)", _probe_frame_hook),
    "torch._disable_dynamo": ("recompute.py (eager regions under torch.compile)", _probe_disable_dynamo),
    "torch._dynamo.utils._disable_side_effect_safety_checks_for_current_subtracer": (
        "recompute.py (compiled regions keep their Python side effects)", _probe_side_effects_in_region),
    "TorchDispatchMode._should_skip_dynamo, .ignore_compile_internals (overridden)": (
        "policy.py (dispatch modes and torch.compile)", _probe_dispatch_mode_overrides),
    "nn.Module._forward_pre_hooks, _forward_hooks (read), their with_kwargs / always_called flags and global "
    "tables; RemovableHandle copied with the module": (
        "state.py, planner/verify.py, python_state.py (hooks found by scanning, removed by their handles, also in "
        "copies; the user's hooks, and what they hold, restored around a replay)",
        _probe_hook_dicts),
    "nn.Module._buffers": ("buffers.py (buffer snapshots restored in place)", _probe_buffers_dict),
    "Tensor._base": ("swap.py (views of parameters stay on the device)", _probe_tensor_base),
    "torch.autograd.graph.region_activation_memory_budget (prototype)": (
        "compiled.py (knapsack modes under compile=True)", _probe_region_budget),
    "torch.nn.utils.parametrize._cache_enabled, _cache": (
        "replay_context.py (a replay under the forward's parametrize.cached())", _probe_parametrize_cache),
    "torch.nn.attention._cur_sdpa_kernel_backends, _sdpa_kernel": (
        "replay_context.py (a replay under the forward's SDPA kernels)", _probe_sdpa_backends),
    "at::globalContext() (libtorch's symbol) and its deterministic and attention-kernel fields' bytes, read as "
    "memory where found; torch._C's getters and setters of those flags": (
        "replay_context.py (a replay under the forward's flags; NOTE [Torch's flags read as memory])",
        _probe_context_flags),
    "torch._C._autograd saved-tensors hook stack (_top/_push/_pop), _get_sequence_nr, Node._sequence_nr": (
        "replay_check.py (full-mode replay fingerprint)", _probe_saved_tensor_hook_stack),
    "torch.utils.checkpoint: the frame in the unpack hook's closure, _CheckpointFrame's per-backward state, "
    "_Holder.handles, GraphExecGroup": (
        "reread.py (a saved tensor read twice in one backward)", _probe_checkpoint_frame),
    "torch.utils.checkpoint: its forward pack, unpack and replay pack (code, closures), _CheckpointFrame's "
    "weak_holders, recomp_counter, recomputed, is_recomputed, early_stop, ignore_saved_mismatch; _Holder, _Handle, "
    "_StopRecomputationError": (
        "region_saves.py (checkpoint's hooks' work done in the region's pair)", _probe_checkpoint_hooks),
    "OpOverload._op, which OpOverload.__call__ only forwards to": (
        "policy.py (the selective modes run an aten op through it; where not, through the overload)", _probe_op_call),
    "aten::_local_scalar_dense on meta (answered by a dispatch mode)": (
        "planner/profile.py (.item() of a meta model's tensors)", _probe_local_scalar_dense_on_meta),
}
"""Every private torch piece hyperac uses: name -> (where, probe returning a problem or None)."""


def probe_private_torch() -> dict[str, str]:
    """The problems :data:`PRIVATE_TORCH`'s probes find in this torch, by piece (empty: none)."""
    problems = {name: _run(probe) for name, (_, probe) in PRIVATE_TORCH.items()}
    return {name: problem for name, problem in problems.items() if problem is not None}
