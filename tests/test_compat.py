"""The torch internals hyperac relies on are checked at apply (design.md invariant 10).

Each case takes one internal away, or changes how it behaves, the way a torch release could, and
checks that ``apply`` refuses with a TorchVersionError naming this torch and the tested range,
while modes that need no internals still apply. The cases run on every torch in the tested range
(``tox -e cpu``, ``tox -e torch-newest``).
"""

from __future__ import annotations

import collections
import copy
import pathlib
import sys
import warnings

import pytest
import torch
from hyperac_testing import assert_parity, lm_loss, tiny_llama, train_step
from torch.utils import checkpoint as torch_recompute

import hyperac
from hyperac import _compat
from hyperac.errors import HyperACError, TorchVersionError

SIM = dict(backend="sim", min_swap_bytes=0)


@pytest.fixture(autouse=True)
def fresh_checks():
    """Each case checks this torch anew, and leaves no failed or patched result behind."""
    _compat._check.cache_clear()
    _compat.warn_if_untested.cache_clear()
    yield
    _compat._check.cache_clear()
    _compat.warn_if_untested.cache_clear()


def _state(model):
    return {name: dict(module.__dict__) for name, module in model.named_modules()}


def _refused(model, message, **options):
    before = _state(model)
    with pytest.raises(TorchVersionError, match=message) as caught:
        hyperac.apply(model, **options)
    text = str(caught.value)
    assert text.startswith(f"torch {torch.__version__} lacks or changed a torch internal needed by ")
    assert "tested with torch 2.13-2.15" in text and "mode='full'" in text
    assert isinstance(caught.value, RuntimeError) and isinstance(caught.value, HyperACError)
    assert _state(model) == before, "a refused apply changed the model"
    assert "_hyperac_state" not in model.__dict__


def test_this_torch_passes_and_the_check_is_cheap_after_the_first_call(monkeypatch):
    """Each feature's probe runs once per process: later calls run none (counted, not timed)."""
    probes = []
    real_run = _compat._run
    monkeypatch.setattr(_compat, "_run", lambda probe: probes.append(probe) or real_run(probe))
    _compat.require("selective", "swap_selective_outputs")
    assert len(probes) == 2
    for _ in range(2000):
        _compat.require("selective", "swap_selective_outputs")
    assert len(probes) == 2


def test_tested_range_is_what_pyproject_declares():
    major_minor = ".".join(torch.__version__.split(".")[:2])
    assert major_minor in _compat.TESTED_TORCH, f"torch {torch.__version__} is outside the tested releases"
    assert _compat.TESTED_TORCH == ("2.13", "2.14", "2.15") and _compat.TESTED_RANGE == "2.13-2.15"
    pyproject = pathlib.Path(__file__).parents[1] / "pyproject.toml"
    assert f'dependencies = ["torch>={_compat.MIN_TORCH}"]' in pyproject.read_text(encoding="utf-8")


def test_extras_cap_nothing_and_ci_pins_what_the_versions_page_names():
    """``pip install ".[hf]"`` leaves the newest transformers in place: the extras name floors only.
    CI pins its own envs (ci/constraints.txt), the Supported versions page names those pins, and
    ``tox -e torch-newest`` runs the newest torch of the tested range."""
    tomllib = pytest.importorskip("tomllib")
    root = pathlib.Path(__file__).parents[1]
    extras = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    for extra in ("hf", "test"):
        capped = [requirement for requirement in extras[extra] if "<" in requirement or "==" in requirement]
        assert not capped, f"the {extra} extra caps {capped}"
    lines = (root / "ci" / "constraints.txt").read_text(encoding="utf-8").splitlines()
    pins = dict(line.split("==") for line in lines if line and not line.startswith("#"))
    page = (root / "docs" / "versions.md").read_text(encoding="utf-8")
    for package in ("transformers", "kernels", "accelerate", "peft"):
        assert pins[package] in page, f"docs/versions.md does not name CI's {package} {pins[package]}"
    tox = (root / "tox.ini").read_text(encoding="utf-8")
    assert f"[testenv:torch-newest]\ndescription = the suite on the newest torch in the tested range " \
        f"({_compat.TESTED_TORCH[-1]}.0" in tox and f"deps = torch=={_compat.TESTED_TORCH[-1]}.0\n" in tox


@pytest.mark.parametrize("name", ["_detach_helper", "SAC_IGNORED_OPS", "_sac_storage_key"])
def test_selective_refused_when_a_sac_internal_is_missing(monkeypatch, name):
    model = tiny_llama(num_layers=2)
    monkeypatch.delattr(torch_recompute, name)
    _refused(model, rf"needed by the selective modes .*torch\.utils\.checkpoint has no {name}", mode="selective")
    _refused(model, "needed by the selective modes", mode="selective-even")
    hyperac.apply(model, mode="full")  # needs no torch internals


@pytest.mark.parametrize(
    "helper, message",
    [(lambda t: t.detach().clone(), "does not return a detached alias"),
     (lambda t: torch.empty(0).set_(t.untyped_storage(), t.storage_offset(), t.shape, t.stride()),
      "does not share the version counter")],
    ids=["copy", "own-version-counter"],
)
def test_selective_refused_when_kept_outputs_would_not_see_writes(monkeypatch, helper, message):
    """A kept output that is a copy, or an alias with its own version counter: an in-place write
    after the op would go unnoticed by the replay (wrong gradients, no error)."""
    monkeypatch.setattr(torch_recompute, "_detach_helper", helper)
    _refused(tiny_llama(num_layers=2), message, mode="selective")


def test_selective_refused_when_detach_is_no_longer_ignored(monkeypatch):
    monkeypatch.setattr(torch_recompute, "SAC_IGNORED_OPS", set())
    _refused(tiny_llama(num_layers=2), "SAC_IGNORED_OPS does not hold aten::detach", mode="pointwise")


def test_compile_and_full_need_no_sac_internals(monkeypatch):
    """hyperac's recording modes' own use of a SAC internal (``_detach_helper``; torch's compiled checkpoint
    calls ``_sac_storage_key`` itself, so a torch without it could not compile a region at all)."""
    monkeypatch.delattr(torch_recompute, "_detach_helper")
    hyperac.apply(tiny_llama(num_layers=2), mode="selective", compile=True)
    hyperac.apply(tiny_llama(num_layers=2), mode="full", swap_inputs=True, **SIM)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compiled_recompute_refused_without_the_side_effect_switch(monkeypatch, mode):
    """A torch without dynamo's switch for writes inside a checkpoint region: apply(compile=True) refuses
    with the fix (compile=False), instead of an AttributeError at the first compiled step; eager modes and
    compiled layers that recompute nothing need no switch."""
    import torch._dynamo.utils

    monkeypatch.delattr(torch._dynamo.utils, "_disable_side_effect_safety_checks_for_current_subtracer")
    model = tiny_llama(num_layers=2)
    before = _state(model)
    with pytest.raises(TorchVersionError, match=r"needed by recompute under compile=True .*"
                       r"_disable_side_effect_safety_checks_for_current_subtracer.*apply with compile=False"):
        hyperac.apply(model, mode=mode, compile=True)
    assert _state(model) == before and "_hyperac_state" not in model.__dict__
    ids = torch.randint(0, 128, (1, 8))
    with pytest.raises(TorchVersionError, match="apply with compile=False"):  # refused before profiling compiles
        hyperac.apply(model, mode="auto", compile=True, budget=0.9, sample={"input_ids": ids, "labels": ids})
    assert _state(model) == before
    hyperac.apply(model, mode=mode)
    hyperac.remove(model)
    hyperac.apply(model, mode="knapsack-0.5", compile=True)


def test_swap_of_selective_outputs_refused_without_the_storage_use_count(monkeypatch):
    monkeypatch.delattr(torch._C, "_storage_Use_Count")
    model = tiny_llama(num_layers=2)
    _refused(model, r"needed by swap_selective_outputs=True: torch\._C has no _storage_Use_Count",
             mode="selective", swap_selective_outputs=True, **SIM)
    hyperac.apply(model, mode="selective", swap_inputs=True, **SIM)  # the cache stays on the device


def test_swap_of_selective_outputs_refused_when_the_use_count_counts_differently(monkeypatch):
    monkeypatch.setattr(torch._C, "_storage_Use_Count", lambda cdata: 1)
    _refused(tiny_llama(num_layers=2), r"gave \(1, 1\).*expected \(2, 4\)",
             mode="selective", swap_selective_outputs=True, **SIM)


def test_compiled_selective_layers_choose_how_kept_tensors_meet_saved_tensors_hooks():
    """``compile=True`` layers use PyTorch's selective modes, also when they run eagerly. Under a
    user's saved_tensors_hooks (``save_on_cpu``) torch 2.14 warns that their kept tensors will go
    through the hooks; hyperac chooses the torch 2.13 behaviour explicitly (kept tensors bypass the
    hooks), so there is no FutureWarning, and gradients equal the un-applied model's."""
    base = tiny_llama(num_layers=3)
    loss_fn = lm_loss(batch=2, seq=8)
    reference = train_step(copy.deepcopy(base), loss_fn)
    model = copy.deepcopy(base)
    hyperac.apply(model, mode="selective", compile=True)
    packed: list[torch.Tensor] = []
    with warnings.catch_warnings(), torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t) or t,
                                                                             lambda t: t):
        warnings.simplefilter("error", FutureWarning)
        assert_parity(reference, train_step(model, loss_fn))
    assert packed, "the hooks saw nothing"


def test_selective_refused_when_schemas_do_not_say_what_an_op_writes(monkeypatch):
    """Without write annotations the protection of kept outputs would silently turn off."""
    add_ = torch.ops.aten.add_.Tensor
    monkeypatch.setattr(add_, "_schema", torch._C.parse_schema(str(add_._schema).replace("(a!)", "")))
    _refused(tiny_llama(num_layers=2), "does not mark its first argument as written", mode="selective")


def test_every_private_torch_piece_is_probed_and_present():
    """NOTE [Every private torch piece]: the one table, each piece probed on this torch."""
    assert _compat.probe_private_torch() == {}
    names = " ".join(_compat.PRIVATE_TORCH)
    for piece in ("_disable_dynamo", "_should_skip_dynamo", "ignore_compile_internals", "_forward_hooks", "_buffers",
                  "Tensor._base", "_local_scalar_dense", "_storage_Use_Count", "_detach_helper", "set_eval_frame",
                  "OpOverload._op", "_disable_side_effect_safety_checks_for_current_subtracer", "globalContext"):
        assert piece in names, piece


_HOOK_TABLES = ("nn.Module._forward_pre_hooks, _forward_hooks (read), their with_kwargs / always_called flags and "
                "global tables; RemovableHandle copied with the module")


@pytest.mark.parametrize(("name", "breaks"), [
    ("torch._disable_dynamo", lambda monkeypatch: monkeypatch.setattr(torch, "_disable_dynamo", lambda fn: None)),
    ("nn.Module._buffers", lambda monkeypatch: monkeypatch.setattr(
        torch.nn.Module, "__getattr__", lambda self, name: torch.zeros(2))),
    ("Tensor._base", lambda monkeypatch: monkeypatch.setattr(torch.Tensor, "_base", None)),
    ("torch._dynamo.utils._disable_side_effect_safety_checks_for_current_subtracer", lambda monkeypatch: (
        monkeypatch.setattr(_compat, "side_effects_once", lambda fn, *args, **kwargs: fn(*args, **kwargs)))),
    (_HOOK_TABLES, lambda monkeypatch: monkeypatch.setattr(  # a copied handle points nowhere
        torch.utils.hooks.RemovableHandle, "__getstate__", lambda self: (None, self.id))),
    (_HOOK_TABLES, lambda monkeypatch: monkeypatch.setattr(  # global hooks kept in a table of their own
        torch.nn.modules.module, "register_module_forward_hook",
        lambda hook: torch.utils.hooks.RemovableHandle(collections.OrderedDict()))),
])
def test_a_changed_private_piece_is_reported(monkeypatch, name, breaks):
    breaks(monkeypatch)
    assert name in _compat.probe_private_torch()


def test_flags_whose_bytes_no_longer_read_as_their_getters_are_reported(monkeypatch):
    """NOTE [Torch's flags read as memory]: where the bytes found no longer hold the flags (here the priority
    order read one entry off), the table says so."""
    from hyperac.replay import replay_context

    if replay_context._WORDS is None and not sys.platform.startswith("linux"):
        pytest.skip("the flags are read as memory on Linux only (elsewhere through their getters)")
    monkeypatch.setattr(replay_context, "_WORDS", replay_context._WORDS._replace(
        priority=replay_context._WORDS.priority + 4))
    name = next(piece for piece in _compat.PRIVATE_TORCH if "globalContext" in piece)
    assert name in _compat.probe_private_torch()


def _apply_warnings(version, monkeypatch):
    """The HyperACWarnings of two applies under torch ``version`` (faked; the model really applies)."""
    monkeypatch.setattr(torch, "__version__", version)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            hyperac.apply(tiny_llama(num_layers=2), mode="full")
    return [str(w.message) for w in caught if issubclass(w.category, hyperac.HyperACWarning)]


@pytest.mark.parametrize("version", ["2.16.0", "2.16.0a0+git1234567", "2.16.0.dev20261201+cpu", "3.0.0rc1"])
def test_a_torch_newer_than_the_tested_range_warns_once(monkeypatch, version):
    """NOTE [A torch newer than the tested range]: a newer major.minor, pre-releases included, warns once
    per process (two applies: one warning), naming the version and the tested range; the warning is
    keyed by the version, so it does not depend on what ran before."""
    caught = _apply_warnings(version, monkeypatch)
    assert len(caught) == 1, caught
    assert caught[0].startswith(f"hyperac is tested with torch 2.13-2.15; torch {version} is newer.")
    assert "pip install 'torch==2.15.0'" in caught[0]


@pytest.mark.parametrize("version", ["2.13.0+cpu", "2.14.1", "2.15.0", "2.15.1+cu130", "2.15.0rc2"])
def test_a_tested_torch_applies_without_a_warning(monkeypatch, version):
    assert _apply_warnings(version, monkeypatch) == []
