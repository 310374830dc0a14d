"""Config.save_ops (the kept-op list, torchtitan's get_save_ops override) and Config.force_recompute
(modules whose ops keep nothing, torchtitan's force_recompute_mm_shapes_by_fqns by module): FLOPs
replayed counted exactly, gradients bitwise, errors."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from hyperac_testing import BiasedMlp, Stack, assert_parity, lm_loss, tiny_llama, train_step

import hyperac
from hyperac import ConfigError
from hyperac.measure import flop_counter

WIDTH, ROWS = 32, 4
ONE_MATMUL = 2 * ROWS * WIDTH * WIDTH


_X = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(0))


def _loss(model):
    return model(_X).sum()


def _replayed_matmuls(**options) -> float:
    """Matmuls replayed per layer: the step's FLOPs over the un-applied model's, in matmuls."""
    def flops(model) -> int:
        with flop_counter() as counter:
            _loss(model).backward()
        return counter.get_total_flops()

    model = Stack(BiasedMlp, num_blocks=3)
    base = flops(model)
    hyperac.apply(model, layers="blocks", backend="cpu", **options)
    return (flops(model) - base) / (3 * ONE_MATMUL)


# Backward never needs ``down``'s output, so no mode replays it; the others count.
@pytest.mark.parametrize(("options", "matmuls"), [
    (dict(mode="selective"), 1),  # up (1st) kept, gate (2nd) replayed
    (dict(mode="selective", save_ops=["aten::mm"]), 2),  # addmm unlisted: up and gate replayed
    (dict(mode="selective", save_ops=[torch.ops.aten.addmm.default, torch.ops.aten.mm]), 1),
    (dict(mode="pointwise", save_ops=["aten::addmm"]), 0),
    (dict(mode="selective", save_ops=[]), 2),  # nothing kept: what full replays
    (dict(mode="full"), 2),
    (dict(mode="selective", force_recompute=["up"]), 1),  # up replayed and not counted: gate is the 1st, kept
    (dict(mode="selective-even", force_recompute=["up"]), 2),  # ... and here gate, the 1st, is replayed
    (dict(mode="pointwise", force_recompute=["gate"]), 1),
    (dict(mode="pointwise", force_recompute=["up", "g*"]), 2),
    (dict(mode="selective", compile=True), 1),  # the compiled policy counts as the eager one ...
    (dict(mode="selective", compile=True, save_ops=["aten::mm"]), 2),  # ... with the same save list
], ids=lambda value: str(value) if not isinstance(value, dict) else ",".join(f"{k}={v}" for k, v in value.items()))
def test_replayed_matmuls_follow_the_save_list_and_forced_modules(options, matmuls):
    assert _replayed_matmuls(**options) == matmuls


def test_gradients_bitwise_on_llama_with_a_save_list_and_forced_modules():
    model, loss_fn = tiny_llama(2), lm_loss()
    reference = train_step(model, loss_fn)
    plan = hyperac.apply(model, mode="selective", force_recompute=["mlp.*_proj"],
                         save_ops=["aten::mm", "aten::_scaled_dot_product_flash_attention_for_cpu"])
    assert_parity(reference, train_step(model, loss_fn))
    forced = [name for name, module in model.named_modules()
              if type(module.__dict__.get("forward")).__name__ == "ForcedRecomputeForward"]
    projections = ("gate_proj", "up_proj", "down_proj")
    assert forced == [f"model.layers.{i}.mlp.{proj}" for i in range(2) for proj in projections]
    assert plan.layers[0].mode == "selective"
    hyperac.remove(model)
    assert not any("forward" in module.__dict__ for module in model.modules())


@pytest.mark.parametrize("copy_model", [copy.deepcopy, lambda model: pickle.loads(pickle.dumps(model))],
                         ids=["deepcopy", "pickle"])
def test_copies_keep_the_save_list_and_forced_modules(copy_model):
    model = Stack(BiasedMlp, num_blocks=3)
    hyperac.apply(model, layers="blocks", backend="cpu", mode="selective", save_ops=["aten::mm"],
                  force_recompute=["up"])
    clone = copy_model(model)
    with flop_counter() as original:
        _loss(model).backward()
    with flop_counter() as copied:
        _loss(clone).backward()
    assert copied.get_total_flops() == original.get_total_flops()
    hyperac.remove(clone)
    assert "forward" in model.blocks[0].up.__dict__ and "forward" not in clone.blocks[0].up.__dict__


def test_errors_name_the_value_and_a_fix():
    with pytest.raises(ConfigError, match=r"Config\.save_ops holds 3, which is not an op.*'aten::mm'"):
        hyperac.Config(mode="selective", save_ops=["aten::mm", 3])
    with pytest.raises(ConfigError, match=r"Config\.save_ops must be None or a collection of ops, got 'aten::mm'"):
        hyperac.Config(mode="selective", save_ops="aten::mm")
    with pytest.raises(ConfigError, match=r"Config\.force_recompute must be a list of module names.*got \[1\]"):
        hyperac.Config(mode="selective", force_recompute=[1])
    with pytest.raises(ConfigError, match=r"Config\.save_ops= does not combine with mode='auto'"):
        hyperac.Config(mode="auto", budget=0.5, sample={}, save_ops=[])
    with pytest.raises(ConfigError, match=r"Config\.force_recompute= tunes the selective modes, but the modes are "
                                          r"\['full', 'off'\]; use mode='selective'"):
        hyperac.Config(layers={"0-1": "off"}, force_recompute=["up"])
    with pytest.raises(ConfigError, match=r"force_recompute=\['up'\] does not combine with compile=True"):
        hyperac.Config(mode="selective", compile=True, force_recompute=["up"])
    model = Stack(BiasedMlp, num_blocks=3)
    with pytest.raises(ConfigError, match=r"Config\.save_ops names 'aten::no_such_op', which is no registered op"):
        hyperac.apply(model, layers="blocks", backend="cpu", mode="selective", save_ops=["aten::no_such_op"])
    with pytest.raises(ConfigError, match=r"force_recompute=\['mlp'\] matches no module inside the selective layers "
                                          r"\(\['blocks\.0', 'blocks\.1', 'blocks\.2'\]\).*\['up', 'gate', 'down'\]"):
        hyperac.apply(model, layers="blocks", backend="cpu", mode="selective", force_recompute=["up", "mlp"])
    assert hyperac.applied_plan(model) is None
    assert not any("forward" in module.__dict__ for module in model.modules() if module is not model)


def test_op_sets_are_immutable_and_their_cache_read_only():
    """OpSets is a value: frozen fields of frozensets, hashable; classify's cache is seen only
    through a read-only view, and a copy starts with an empty one."""
    from hyperac.backends import get_backend
    from hyperac.policy import resolve_op_sets

    ops = resolve_op_sets(get_backend("cpu"), ("aten::mm",))
    # Only the collectives are kept besides the list (NOTE [Collectives by their schema]).
    assert ops.matmul == frozenset(_all_mm_overloads()) and ops.keep == ops.communication != frozenset()
    assert ops.classify(torch.ops.aten.mm.default) == ops.table[id(torch.ops.aten.mm.default)][0]
    with pytest.raises(TypeError):
        ops.table[0] = None
    with pytest.raises(dataclasses.FrozenInstanceError):
        ops.keep = frozenset()
    clone = copy.deepcopy(ops)
    assert clone == ops and hash(clone) == hash(ops) and not clone.table


def test_what_the_modes_ask_of_an_op_is_read_once_per_op():
    """NOTE [Per op, not per call] in policy.py: :meth:`OpSets.classify` answers, once per op, whether it is a
    view, whether it is a collective that fills the buffers it is given, what it writes, and what runs it."""
    from hyperac.backends import get_backend
    from hyperac.policy import _COLLECTIVE, calls_op_directly, resolve_op_sets

    ops = resolve_op_sets(get_backend("cpu"))
    aten = torch.ops.aten
    view = ops.classify(aten.view.default)
    # the overload's _op where OpOverload.__call__ only forwards to it (torch 2.13), else the overload (2.15)
    assert view.view and not view.fills
    assert view.run is (aten.view.default._op if calls_op_directly() else aten.view.default)
    assert ops.classify(aten.view.default) is view
    assert ops.classify(aten.t.default).view and ops.classify(aten.slice.Tensor).view
    assert not ops.classify(aten.mm.default).view
    assert not ops.classify(aten._unsafe_view.default).view  # no alias in its schema (NOTE [Aliases with ...])
    assert ops.classify(aten.add_.Tensor).writes == ((0, "self"),)
    gather = ops.classify(torch.ops.c10d.allgather_.default)
    assert gather.kind == _COLLECTIVE and gather.fills and not gather.view
    functional = ops.classify(torch.ops._c10d_functional.all_gather_into_tensor.default)
    assert functional.kind == _COLLECTIVE and not functional.fills
    assert not ops.classify(aten.copy_.default).fills  # not a collective
    cond = ops.classify(torch.ops.higher_order.cond)
    assert cond.keyed and not cond.view and cond.run is torch.ops.higher_order.cond


def _all_mm_overloads():
    return [getattr(torch.ops.aten.mm, name) for name in torch.ops.aten.mm.overloads()]
