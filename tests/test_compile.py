"""hyperac under ``torch.compile``: apply (with ``compile=True``), then compile each layer or the model.

The compiled graphs must keep hyperac's recompute: the backward graph of a recomputed layer holds
the forward ops it replays (RMSNorm's ``rsqrt``; in full mode the matmuls too), and the FLOPs of a
step match the eager run of the same mode. ``aot_eager`` (AOTAutograd, no code generation) keeps
this fast on CPU; Inductor needs a C++ build (about 70 s on 2 cores) and runs only with
``HYPERAC_TEST_INDUCTOR=1``.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from hyperac_testing import BiasedMlp, Stack, assert_parity, lm_loss, saved_for_backward, tiny_llama, train_step

import hyperac
from hyperac.measure import flop_counter
from hyperac.plan import mode_letters


@pytest.fixture(scope="module")
def base_model():
    return tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class RecordingBackend:
    """``aot_eager`` that keeps the forward and backward graphs it compiles."""

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.forward_graphs: list[torch.fx.GraphModule] = []
        self.backward_graphs: list[torch.fx.GraphModule] = []

        def keep(graphs):
            def compiler(graph, example_inputs):
                graphs.append(graph)
                return make_boxed_func(graph.forward)
            return compiler

        self.backend = aot_autograd(fw_compiler=keep(self.forward_graphs), bw_compiler=keep(self.backward_graphs))

    @staticmethod
    def count(graphs: list[torch.fx.GraphModule], op) -> list[int]:
        return [sum(1 for node in graph.graph.nodes if node.target is op) for graph in graphs]


COUNTING_GRAPHS: list[torch.fx.GraphModule] = []


@torch._dynamo.register_backend(name="hyperac_test_counting")
def counting_backend(graph, inputs):
    """``aot_eager_decomp_partition`` that notes each graph it compiles in :data:`COUNTING_GRAPHS`."""
    COUNTING_GRAPHS.append(graph)
    return torch._dynamo.lookup_backend("aot_eager_decomp_partition")(graph, inputs)


def compiled_step(model, loss_fn, options, backend):
    """Apply ``options`` (``None``: leave hyperac out), compile each layer, run one step; also its FLOPs."""
    if options is not None:
        hyperac.apply(model, **options)
    for layer in model.model.layers:
        layer.compile(backend=backend)
    step = train_step(model, loss_fn)
    with flop_counter() as flops:
        train_step(model, loss_fn)
    return step, flops.get_total_flops()


def eager_flops(model, loss_fn, options):
    hyperac.apply(model, **options)
    with flop_counter() as flops:
        train_step(model, loss_fn)
    return flops.get_total_flops()


@pytest.fixture(scope="module")
def uncompiled_baseline(base_model, loss_fn):
    """Backward-graph op counts and FLOPs of the compiled layers without hyperac."""
    torch._dynamo.reset()
    recorder = RecordingBackend()
    _, flops = compiled_step(copy.deepcopy(base_model), loss_fn, None, recorder.backend)
    aten = torch.ops.aten
    counts = {op: recorder.count(recorder.backward_graphs, op) for op in (aten.mm.default, aten.rsqrt.default)}
    torch._dynamo.reset()
    return counts, flops


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_compiled_layers_keep_parity_and_recompute(base_model, loss_fn, reference, uncompiled_baseline, mode):
    baseline_counts, baseline_flops = uncompiled_baseline
    recorder = RecordingBackend()
    options = dict(mode=mode, compile=True)
    step, flops = compiled_step(copy.deepcopy(base_model), loss_fn, options, recorder.backend)
    assert_parity(reference, step, exact=False)  # bitwise on torch 2.13 + aot_eager; exactness is not promised
    aten = torch.ops.aten
    assert recorder.backward_graphs, "no backward graph was compiled"
    # Without hyperac the backward graph reads RMSNorm's saved rsqrt; with it, the norm is replayed.
    assert max(baseline_counts[aten.rsqrt.default]) == 0
    assert min(recorder.count(recorder.backward_graphs, aten.rsqrt.default)) > 0, "nothing was recomputed"
    backward_mm = recorder.count(recorder.backward_graphs, aten.mm.default)
    if mode == "full":  # the forward matmuls are replayed too
        assert min(backward_mm) > max(baseline_counts[aten.mm.default])
        assert flops > baseline_flops
    else:  # as in eager mode, every other matmul is kept and the others replayed
        assert min(backward_mm) > max(baseline_counts[aten.mm.default])
        assert flops > baseline_flops
    assert flops == eager_flops(copy.deepcopy(base_model), loss_fn, options), "compiled and eager recompute differ"


def compiled_step_keeps_parity(base_model, loss_fn, reference, **options):
    """Apply to a copy, compile the whole model (aot_eager), train one step: parity with the
    un-applied model. Returns the compiled model."""
    model = copy.deepcopy(base_model)
    hyperac.apply(model, **options)
    compiled = torch.compile(model, backend="aot_eager")
    model.train()
    torch.manual_seed(1)
    loss = loss_fn(compiled)
    loss.backward()
    assert_parity(reference, (loss.detach(), {n: p.grad for n, p in model.named_parameters()}), exact=False)
    return compiled


def test_whole_model_compiled_after_apply(base_model, loss_fn, reference):
    compiled = compiled_step_keeps_parity(base_model, loss_fn, reference, mode="selective", compile=True)
    with pytest.raises(hyperac.UnsupportedModelError, match="already compiled"):
        hyperac.apply(compiled, mode="selective", compile=True)


@pytest.mark.parametrize("mode", ["selective", "pointwise", "full"])
def test_eager_layers_inside_a_compiled_model(base_model, loss_fn, reference, mode, monkeypatch):
    """Applied without ``compile=True``, then the whole model compiled: the regions run eagerly
    between graphs (NOTE [Eager regions under torch.compile]) instead of failing inside dynamo's
    checkpoint support ("checkpoint not implemented for ... context_fn"), and still recompute."""
    from hyperac import policy

    replayed = []
    original = policy._ReplayMode.__torch_dispatch__
    monkeypatch.setattr(policy._ReplayMode, "__torch_dispatch__",
                        lambda self, *args, **kwargs: replayed.append(1) or original(self, *args, **kwargs))
    compiled_step_keeps_parity(base_model, loss_fn, reference, mode=mode)
    assert bool(replayed) == (mode != "full")


def test_swap_mode_inside_a_compiled_model(base_model, loss_fn, reference):
    """``mode="swap"`` (saved tensors in host memory, no recompute) and then the whole model
    compiled: the layers run eagerly between graphs (NOTE [Eager regions under torch.compile])
    instead of recursing through dynamo's resumes of the swap manager, and every saved tensor the
    swap sees still goes to host memory."""
    from hyperac.backends.sim import SimBackend

    compiled = compiled_step_keeps_parity(base_model, loss_fn, reference, mode="swap", backend=SimBackend(),
                                          min_swap_bytes=0)
    assert hyperac.swap_stats(compiled._orig_mod).offloaded_bytes > 0


def test_layers_compiled_before_apply(base_model, loss_fn, reference):
    """``layer.compile()`` only marks the layer; tracing waits for the first call, so apply may come after."""
    model = copy.deepcopy(base_model)
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    hyperac.apply(model, mode="full", compile=True)
    assert_parity(reference, train_step(model, loss_fn), exact=False)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("HYPERAC_TEST_INDUCTOR") != "1",
                    reason="Inductor builds C++ for about 70 s on 2 CPU cores; set HYPERAC_TEST_INDUCTOR=1")
def test_inductor(base_model, loss_fn, reference):
    model = copy.deepcopy(base_model)
    hyperac.apply(model, mode="selective", compile=True)
    for layer in model.model.layers:
        layer.compile(backend="inductor")
    assert_parity(reference, train_step(model, loss_fn), exact=False)


DEEP_PLANS = {
    "full": dict(mode="full"),
    "selective": dict(mode="selective"),
    "mixed": dict(layers={"0-2": "full", "3-5": "selective", "6-8": "pointwise", "9-10": "selective-even", 11: "off"}),
    "knapsack": dict(layers={"0-5": "knapsack-0.25", "6-10": "knapsack-0.5", 11: "off"}),
}


def assert_only_knapsack_breaks(modes):
    """No graph break, except the one a knapsack layer starts its own graph with (NOTE [Knapsack layers])."""
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    knapsack = any(mode.startswith("knapsack") for mode in modes)
    assert bool(breaks) == knapsack and all("graph_break()" in reason for reason in breaks), breaks


@pytest.fixture(scope="module")
def deep_model():
    """12 layers, more than dynamo's default ``recompile_limit`` (8); no KV cache, as in training."""
    return tiny_llama(num_layers=12, hidden_size=32, intermediate_size=64, use_cache=False)


def compiled_deep_step(model, loss_fn, options, per_layer, backend="aot_eager"):
    """Apply ``options`` (``None``: leave hyperac out), compile per layer or the whole model with a
    counting ``backend``, train one step; return the step, the counter and the plan's modes. Hitting
    the recompile limit raises instead of running layers uncompiled."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    if options is not None:
        hyperac.apply(model, compile=True, **options)
    counter = CompileCounterWithBackend(backend)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        if per_layer:
            for layer in model.model.layers:
                layer.compile(backend=counter)
            step = train_step(model, loss_fn)
        else:
            model.compile(backend=counter)
            step = train_step(model, loss_fn)
    return step, counter, {layer.mode for layer in hyperac.applied_plan(model).layers} if options else {"off"}


@pytest.fixture(scope="module")
def deep_reference(deep_model, loss_fn):
    """The deep model's step with its layers compiled (``aot_eager``) and no hyperac: one graph."""
    step, counter, _ = compiled_deep_step(copy.deepcopy(deep_model), loss_fn, None, per_layer=True)
    assert counter.frame_count == 1
    return step


@pytest.mark.parametrize("plan", list(DEEP_PLANS))
def test_deep_model_shares_one_graph_per_layer_plan(deep_model, deep_reference, loss_fn, plan):
    """Invariant 14 (NOTE [One graph per layer plan]): per-layer ``layer.compile()`` of a 12-layer
    model compiles one graph per distinct layer plan, reuses it in every layer (no recompile limit
    hit, no graph break but a knapsack layer's own), and gives the gradients of the compiled model
    without hyperac. Knapsack layers need the min-cut partitioner (``aot_eager_decomp_partition``),
    whose decompositions round differently (bitwise parity with it: test_knapsack_saves_what_torch_budget_saves)."""
    knapsack = plan == "knapsack"
    step, counter, modes = compiled_deep_step(copy.deepcopy(deep_model), loss_fn, DEEP_PLANS[plan], per_layer=True,
                                              backend="aot_eager_decomp_partition" if knapsack else "aot_eager")
    assert_parity(deep_reference, step, exact=not knapsack)
    assert_only_knapsack_breaks(modes)
    assert counter.frame_count == len(modes), (counter.frame_count, modes)


def test_deep_model_compiled_whole_stays_one_graph(deep_model, deep_reference, loss_fn):
    """Invariant 14 with ``model.compile()``: a mixed plan on 12 layers is one graph, no break (dynamo
    alone decides graphs and breaks: the ``eager`` backend keeps this cheap)."""
    step, counter, _ = compiled_deep_step(copy.deepcopy(deep_model), loss_fn, DEEP_PLANS["mixed"], per_layer=False,
                                          backend="eager")
    assert_parity(deep_reference, step, exact=False)  # a different graph than per-layer: same math
    assert counter.frame_count == 1
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


def test_deep_model_compiled_whole_with_knapsack_layers(deep_model, deep_reference, loss_fn):
    """``model.compile()`` with knapsack layers: each starts a graph of its own (torch refuses a budget
    that covers only part of a graph; test_knapsack_saves_what_torch_budget_saves compiles it), and
    nothing is per layer: one graph per knapsack plan, and the model's own frames split around the
    breaks (the graphs before the loop, the loop's resume, their callers' resumes: 4 to 5 here, 7
    graphs in all for 4 layers as for 12). Dynamo alone decides them: ``eager`` is cheap."""
    step, counter, modes = compiled_deep_step(copy.deepcopy(deep_model), loss_fn, DEEP_PLANS["knapsack"],
                                              per_layer=False, backend="eager")
    assert_parity(deep_reference, step, exact=False)  # a different graph than per-layer: same math
    assert_only_knapsack_breaks(modes)
    assert counter.frame_count <= len(modes) + 4, (counter.frame_count, modes)


def compiled_saved_bytes(model, loss_fn):
    """Bytes of the distinct storages a compiled step saves for backward, parameters excluded (after a
    first step, which compiles: its AOTAutograd tracing saves more than the compiled graph)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    train_step(model, loss_fn)
    loss, saved = saved_for_backward(lambda: loss_fn(model))
    loss.backward()
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
    return sum(n for ptr, n in storages.items() if ptr not in parameters)


def per_layer_compiled(model, backend):
    for layer in model.model.layers:
        layer.compile(backend=backend)
    return model


def test_knapsack_saves_what_torch_budget_saves(loss_fn):
    """A ``knapsack-0.5`` layer (NOTE [Knapsack layers]) saves what torch's global
    ``activation_memory_budget=0.5`` saves for that layer's graph, less than ``off``, with the
    gradients of the compiled model without hyperac; compiled whole, torch accepts its budget (the
    layer is a graph of its own) and it takes effect."""
    partitioned = "aot_eager_decomp_partition"  # the min-cut partitioner, which reads budgets
    base = tiny_llama(num_layers=1, hidden_size=32, intermediate_size=64, use_cache=False)
    plain = per_layer_compiled(copy.deepcopy(base), partitioned)
    reference = train_step(plain, loss_fn)
    off = compiled_saved_bytes(plain, loss_fn)
    torch._dynamo.reset()
    with torch._functorch.config.patch(activation_memory_budget=0.5):
        torch_bytes = compiled_saved_bytes(per_layer_compiled(copy.deepcopy(base), partitioned), loss_fn)
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    plan = hyperac.apply(model, mode="knapsack-0.5", compile=True)
    assert "knapsack-0.5 = torch's partitioner knapsack at budget 0.5" in str(plan)
    per_layer_compiled(model, partitioned)
    assert_parity(reference, train_step(model, loss_fn), exact=True)
    knapsack_bytes = compiled_saved_bytes(model, loss_fn)
    assert knapsack_bytes == torch_bytes < off, (knapsack_bytes, torch_bytes, off)
    torch._dynamo.reset()
    whole = copy.deepcopy(base)
    hyperac.apply(whole, mode="knapsack-0.5", compile=True)
    whole.compile(backend=partitioned)
    assert_parity(reference, train_step(whole, loss_fn), exact=False)  # other graphs: same math
    whole_bytes = compiled_saved_bytes(whole, loss_fn)  # the graphs around the layer save a little more than eager
    assert whole_bytes < (off + knapsack_bytes) / 2, (whole_bytes, knapsack_bytes, off)


def test_knapsack_plan_round_trips_and_needs_compile(base_model):
    """A plan with knapsack layers prints them (a digit, the mechanism), survives JSON, applies again
    with ``compile=True``, and is refused without it, leaving the model untouched."""
    model = copy.deepcopy(base_model)
    plan = hyperac.apply(model, layers={0: "knapsack-0.75", 1: "full"}, compile=True)
    assert mode_letters([layer.mode for layer in plan.layers]) == "7F"
    assert "1 full, 1 knapsack-0.75" in plan.summary()
    assert "knapsack-0.75  -     what torch's partitioner picks (compiled)" in str(plan)
    data = json.loads(json.dumps(plan.to_dict()))
    assert hyperac.Plan.from_dict(data) == plan
    other = copy.deepcopy(base_model)
    assert [layer.mode for layer in hyperac.apply(other, plan=data, compile=True).layers] == ["knapsack-0.75", "full"]
    hyperac.remove(other)
    assert "forward" not in other.model.layers[0].__dict__
    for options in (dict(plan=data), dict(mode="knapsack-0.5")):
        with pytest.raises(hyperac.ConfigError, match=r"\['knapsack-0\.\d+'\] are torch's partitioner knapsack, which "
                                                      r"exists only in a compiled graph, but Config.compile is False"):
            hyperac.apply(other, **options)
        assert hyperac.applied_plan(other) is None


def test_knapsack_layer_under_fullgraph_says_why(base_model, loss_fn, reference):
    """torchtitan compiles each block with ``fullgraph=True``, which refuses the graph break a knapsack
    layer starts with (NOTE [Knapsack layers]): dynamo's error carries hyperac's reason and the fix,
    and the same plan compiled without ``fullgraph`` trains with torch's gradients."""
    model = copy.deepcopy(base_model)
    hyperac.apply(model, mode="knapsack-0.5", compile=True)
    for layer in model.model.layers:
        layer.compile(backend="aot_eager_decomp_partition", fullgraph=True)
    refused = r"knapsack-\* layer starts a graph of its own .* cannot be compiled with fullgraph=True; compile without"
    with pytest.raises(torch._dynamo.exc.Unsupported, match=refused):
        train_step(model, loss_fn)
    torch._dynamo.reset()
    for layer in model.model.layers:
        layer.compile(backend="aot_eager_decomp_partition")
    assert_parity(reference, train_step(model, loss_fn), exact=False)


def test_knapsack_needs_region_budgets(base_model, monkeypatch):
    """A torch without ``region_activation_memory_budget`` (mocked: this torch has it): applying a
    knapsack mode is a clear error."""
    monkeypatch.delattr(torch.autograd.graph, "region_activation_memory_budget")
    model = copy.deepcopy(base_model)
    with pytest.raises(hyperac.TorchVersionError, match="need torch.autograd.graph.region_activation_memory_budget"):
        hyperac.apply(model, mode="knapsack-0.25", compile=True)
    assert hyperac.applied_plan(model) is None


def test_compiled_menu_is_graded(base_model, loss_fn):
    """Under ``compile=True`` each selective letter compiles to its own saved set (NOTE [Selective
    recompute under torch.compile]): full < selective, selective-even < pointwise < off, and the
    FLOPs of each equal its eager run; the plan says which mechanism each mode became. (On Llama the
    two alternating modes save tensors of equal sizes: q/o, k/v and gate/up have the same shapes, and
    the partitioner saves and replays only what backward reads, so here they also cost the same.)"""
    saved, flops = {}, {}
    for mode in ("off", "full", "selective", "selective-even", "pointwise"):
        torch._dynamo.reset()
        model = copy.deepcopy(base_model)
        plan = hyperac.apply(model, mode=mode, compile=True)
        for layer in model.model.layers:
            layer.compile(backend="aot_eager")
        saved[mode] = compiled_saved_bytes(model, loss_fn)
        with flop_counter() as counter:
            train_step(model, loss_fn)
        flops[mode] = counter.get_total_flops()
        assert flops[mode] == eager_flops(copy.deepcopy(base_model), loss_fn, dict(mode=mode)), mode
        if mode != "off":
            assert any(note.startswith(f"under torch.compile: {mode} = ") for note in plan.notes), plan.notes
    assert saved["full"] < min(saved["selective"], saved["selective-even"])
    assert max(saved["selective"], saved["selective-even"]) < saved["pointwise"] < saved["off"], saved
    assert flops["off"] == flops["pointwise"] < min(flops["selective"], flops["selective-even"]), flops
    assert max(flops["selective"], flops["selective-even"]) < flops["full"], flops


@pytest.mark.parametrize("options", [dict(mode="swap"), dict(mode="selective", swap_selective_outputs=True)],
                         ids=["swap", "selective"])
def test_swap_under_compile_offloads_in_the_graph(base_model, loss_fn, reference, options):
    """NOTE [Swap under torch.compile]: a swapping layer's kept tensors are copied to the host after
    the forward op and back before the backward op (``device_put`` nodes torch's activation
    offloading inserts, present but moving nothing on CPU); gradients are unchanged; remove puts
    torch's options back, a user's joint pass included, which keeps running before hyperac's."""
    from hyperac.backends.sim import SimBackend

    config = torch._functorch.config
    seen = []

    def user_pass(graph, inputs):
        seen.append(len(graph.graph.nodes))
        return graph

    recorder = RecordingBackend()
    model = tiny_llama(num_layers=3, hidden_size=32, intermediate_size=64, use_cache=False)
    expected = train_step(copy.deepcopy(model), loss_fn)
    with torch._functorch.config.patch(joint_custom_pass=user_pass):
        plan = hyperac.apply(model, compile=True, backend=SimBackend(), min_swap_bytes=0, **options)
        assert config.enable_activation_offloading and config.joint_custom_pass is not user_pass
        for layer in model.model.layers:
            layer.compile(backend=recorder.backend)
        step = train_step(model, loss_fn)
        hyperac.remove(model)
        assert config.joint_custom_pass is user_pass and not config.enable_activation_offloading
    assert_parity(expected, step, exact=True)
    assert seen, "the user's joint pass did not run"
    assert [layer.swap for layer in plan.layers] == [True, True, False]
    offloads = [[n for n in g.graph.nodes if n.name.startswith("cpu_offload_")] for g in recorder.forward_graphs]
    reloads = [[n for n in g.graph.nodes if n.name.startswith("gpu_reload_")] for g in recorder.backward_graphs]
    # One graph for the two swapping layers (copies in it), one for the last layer (none).
    assert sorted(map(len, offloads))[0] == 0 and sorted(map(len, offloads))[-1] > 0, offloads
    assert sorted(map(len, offloads)) == sorted(map(len, reloads))
    assert all(n.target is torch.ops.prims.device_put.default for nodes in offloads for n in nodes)
    if options["mode"] == "selective":  # what is offloaded is what the policy keeps: matmul outputs
        assert {n.args[0].target for nodes in offloads for n in nodes} == {torch.ops.aten.mm.default}


def test_swap_under_compile_needs_activation_offloading(base_model, monkeypatch):
    """A torch without activation offloading (mocked: this torch has it) gets a clear error at apply."""
    from hyperac.backends.sim import SimBackend

    monkeypatch.delattr(torch._functorch.config, "enable_activation_offloading")
    model = copy.deepcopy(base_model)
    with pytest.raises(hyperac.TorchVersionError, match="swap under compile=True needs torch's activation offloading"):
        hyperac.apply(model, mode="swap", compile=True, backend=SimBackend(), min_swap_bytes=0)
    assert hyperac.applied_plan(model) is None


def test_auto_plans_for_compiled_layers(loss_fn):
    """``mode="auto"`` with ``compile=`` a backend measures the layers compiled with that backend (the
    one they will run under): the budget is a fraction of what compiled ``off`` saves, the plan fits
    it, and its predicted saved bytes are what the layers save when compiled as a user compiles them
    (within 5%)."""
    COUNTING_GRAPHS.clear()
    base = tiny_llama(num_layers=4, hidden_size=32, intermediate_size=64, use_cache=False)
    off = copy.deepcopy(base)
    for layer in off.model.layers:
        layer.compile(backend="aot_eager_decomp_partition")
    off_bytes = compiled_saved_bytes(off, loss_fn)
    torch._dynamo.reset()
    model = copy.deepcopy(base)
    plan = hyperac.apply(model, mode="auto", compile="hyperac_test_counting", budget=0.5, sample=loss_fn)
    assert len(COUNTING_GRAPHS) >= 5, "each of the five options is timed compiled with the backend named"
    assert not any(layer.mode.startswith("knapsack") for layer in plan.layers), "knapsack modes are named, not planned"
    assert plan.predicted_peak_bytes is None and "saved for backward by the compiled layers" in str(plan)
    assert abs(plan.budget_bytes - 0.5 * off_bytes) <= 0.05 * off_bytes, (plan.budget_bytes, off_bytes)
    assert {layer.mode for layer in plan.layers} != {"off"}
    for layer in model.model.layers:
        layer.compile(backend="aot_eager_decomp_partition")
    measured = compiled_saved_bytes(model, loss_fn)
    assert measured <= plan.budget_bytes * 1.05
    assert abs(measured - plan.predicted_bytes) <= 0.05 * measured, (measured, plan.predicted_bytes)


def test_save_ops_reach_the_compiled_policy(base_model, loss_fn):
    """``save_ops=`` (torchtitan's save-list override) under ``compile=True``: the compiled layers
    replay what eager layers with the same list replay, which is not what the default list replays."""
    flops = {}
    for name, options in (("default", {}), ("nothing", dict(save_ops=[]))):
        torch._dynamo.reset()
        model = copy.deepcopy(base_model)
        hyperac.apply(model, mode="selective", compile=True, **options)
        for layer in model.model.layers:
            layer.compile(backend="aot_eager")
        compiled_saved_bytes(model, loss_fn)  # compiles outside the FLOP counter
        with flop_counter() as counter:
            train_step(model, loss_fn)
        flops[name] = counter.get_total_flops()
        assert flops[name] == eager_flops(copy.deepcopy(base_model), loss_fn, dict(mode="selective", **options)), name
    assert flops["nothing"] > flops["default"], flops


def test_swap_inputs_under_compile_is_ignored_with_a_warning(base_model):
    """A compiled layer's input is the previous graph's output: ``swap_inputs`` cannot offload it, so
    selective layers must not take the flag as a request to offload their kept outputs instead."""
    model = copy.deepcopy(base_model)
    with pytest.warns(hyperac.HyperACWarning, match="swap_inputs is ignored"):
        plan = hyperac.apply(model, mode="selective", swap_inputs=True, compile=True, backend="sim")
    assert not any(layer.swap for layer in plan.layers), plan
    hyperac.remove(model)
    plan = hyperac.apply(model, mode="selective", swap_inputs=True, swap_selective_outputs=True, compile=True,
                         backend="sim")
    assert all(layer.swap for layer in plan.layers[:-1]), plan


def test_copy_of_a_swapping_model_keeps_offloading_after_the_original_is_removed(loss_fn):
    """NOTE [Swap under torch.compile]: torch's offloading options are held per applied model, copies
    included. ``copy.deepcopy(applied)`` then ``remove(original)`` leaves the copy offloading in its
    compiled graph with unchanged gradients; the options go back when the last holder is removed, or
    garbage-collected unremoved."""
    import gc

    from hyperac.backends.sim import SimBackend

    config = torch._functorch.config
    model = tiny_llama(num_layers=3, hidden_size=32, intermediate_size=64, use_cache=False)
    expected = train_step(copy.deepcopy(model), loss_fn)
    hyperac.apply(model, mode="swap", compile=True, backend=SimBackend(), min_swap_bytes=0)
    twin = copy.deepcopy(model)
    hyperac.remove(model)
    assert config.enable_activation_offloading and callable(config.joint_custom_pass)
    recorder = RecordingBackend()
    for layer in twin.model.layers:
        layer.compile(backend=recorder.backend)
    assert_parity(expected, train_step(twin, loss_fn), exact=True)
    assert any(n.name.startswith("cpu_offload_") for g in recorder.forward_graphs for n in g.graph.nodes)
    third = copy.deepcopy(twin)
    hyperac.remove(twin)
    assert config.enable_activation_offloading, "the third copy still holds the options"
    del third
    gc.collect()
    assert not config.enable_activation_offloading and config.joint_custom_pass is None


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_kv_cache_under_compile_warns_once_and_keeps_gradients(base_model, mode):
    """NOTE [KV caches under torch.compile]: a compiled layer given a KV cache in a training forward
    cannot be traced; it runs eagerly outside the graph with one warning per model naming the layer
    and the fix, and gradients equal the un-applied model's on the same cache; without a cache the
    layers stay compiled (no graph break)."""
    from torch._dynamo.utils import counters
    from transformers import DynamicCache

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def cached_loss(model):
        return model(input_ids=ids, labels=ids, cache=DynamicCache(config=model.config)).loss

    expected = train_step(copy.deepcopy(base_model), cached_loss)
    model = copy.deepcopy(base_model)
    hyperac.apply(model, mode=mode, compile=True)
    for layer in model.model.layers:
        layer.compile(backend="aot_eager")
    with pytest.warns(hyperac.HyperACWarning) as caught:
        first = train_step(model, cached_loss)
        train_step(model, cached_loss)
    about_compile = [str(w.message) for w in caught if "cannot be traced" in str(w.message)]
    assert len(about_compile) == 1, about_compile
    assert "compile=True layer 'model.layers.0'" in about_compile[0] and "use_cache=False" in about_compile[0]
    assert_parity(expected, first, exact=True)
    counters.clear()
    train_step(model, lm_loss(batch=2, seq=16))
    assert not counters["graph_break"], dict(counters["graph_break"])


class _ActiveKernels:
    """What transformers 5.25's ``kernels`` layers write under compile: a module-level object
    (``kernels``' ``CompileableContextVar``) whose attribute a layer sets for its call and resets after."""

    def __init__(self) -> None:
        self.funcs = None


ACTIVE_KERNELS = _ActiveKernels()


class KernelizedBlock(BiasedMlp):
    """Sets and resets :data:`ACTIVE_KERNELS` around its forward, as ``use_kernelized_func`` does."""

    def forward(self, x):
        # keyed by the kernel function (one for all layers), the layer's own wrapper as the value
        previous, ACTIVE_KERNELS.funcs = ACTIVE_KERNELS.funcs, {id(BiasedMlp): (self.up, type(self.up).forward)}
        try:
            return super().forward(x)
        finally:
            ACTIVE_KERNELS.funcs = previous


class CountingBlock(BiasedMlp):
    """Counts its calls in an attribute: a write that lasts."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


def compiled_stack_step(block, options, steps=1):
    """A 10-block :class:`Stack` of ``block`` (more than dynamo's recompile limit), applied with
    ``options`` (``None``: no hyperac), each block compiled (``aot_eager``); its step, counter and model."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.utils.counters.clear()
    model = Stack(block, num_blocks=10)
    if options is not None:
        hyperac.apply(model, compile=True, **options)
    counter = CompileCounterWithBackend("aot_eager")
    for layer in model.blocks:
        layer.compile(backend=counter)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0)).requires_grad_()  # as every layer's input
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for _ in range(steps):
            step = train_step(model, lambda model: model(x).square().mean())
    return step, counter, model


@pytest.mark.parametrize("mode", ["full", "selective", "pointwise"])
def test_layers_that_set_and_reset_a_global_stay_one_graph(mode):
    """NOTE [Python side effects in a compiled region]: layers that set a global object's attribute for
    their call and reset it (transformers 5.25's ``kernels`` hub layers) compile to one graph per layer
    plan with no graph break, give the gradients of the compiled un-applied stack bitwise, and leave
    the global as it was."""
    reference, reference_counter, _ = compiled_stack_step(KernelizedBlock, None)
    assert reference_counter.frame_count == 1 and not torch._dynamo.utils.counters["graph_break"]
    torch._dynamo.reset()
    step, counter, _ = compiled_stack_step(KernelizedBlock, {"mode": mode})
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert counter.frame_count == 1
    assert_parity(reference, step)
    assert ACTIVE_KERNELS.funcs is None


def test_a_lasting_write_in_a_compiled_layer_happens_once_per_step():
    """A compiled layer's write that lasts (a call counter) happens once per forward, as in the
    un-applied model and in hyperac's eager regions (NOTE [Python state in the replay]): the replay in
    the backward graph does not run it again, and the layer stays one graph."""
    expected, plain_counter, plain = compiled_stack_step(CountingBlock, None, steps=2)
    torch._dynamo.reset()
    step, counter, model = compiled_stack_step(CountingBlock, {"mode": "full"}, steps=2)
    assert [block.calls for block in model.blocks] == [block.calls for block in plain.blocks] == [2] * 10
    # dynamo specializes on the count (a graph per value), with hyperac as without
    assert counter.frame_count == plain_counter.frame_count == 2
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
    assert_parity(expected, step)
