"""A replay routes as its forward did, in every mode (NOTE [Routing is kept] in hyperac/replay/routing.py).

On a GPU a replay's router inputs can differ from the forward's in the last bits, and ``topk`` then
sends some tokens to other experts. Here tiny HF Mixtral and Qwen3-MoE models, with grouped and eager
experts, get router noise of 1e-3 on their logits drawn from a module-level generator, which hyperac's
Python-state snapshot does not reach (NOTE [Python state in the replay] in replay/python_state.py): the replay
draws other noise, as a GPU's replay computes other last bits. Every call of a router records the experts
it picked in a module-level table (also out of the snapshot's reach), so a replay's picks are compared
with its forward's. The control, plain ``torch.utils.checkpoint`` through HF's gradient checkpointing,
shows the same setup flipping tokens when routing is recomputed.
"""

from __future__ import annotations

import copy
import types
from typing import Any

import pytest
import torch
from hyperac_testing import (
    BiasedMlp,
    Stack,
    assert_parity,
    lm_loss,
    tiny_mixtral,
    tiny_qwen2,
    tiny_qwen3_moe,
    train_step,
)
from torch import nn
from torch.nn import functional
from torch.utils._python_dispatch import TorchDispatchMode

import hyperac

NOISE = torch.Generator()
"""The routers' noise (module level: no replay restores it)."""
PICKS: dict[int, list[torch.Tensor]] = {}
"""Router id -> the experts it picked per call, forward then replays (module level, as ``NOISE``)."""

FAMILIES = {"mixtral": tiny_mixtral, "qwen3_moe": tiny_qwen3_moe}
EXPERTS = ("grouped_mm", "eager")
MODES = ("off", "full", "selective", "selective-even", "pointwise", "auto")
LOSS = lm_loss(batch=4, seq=64)  # 256 tokens a layer: enough near-ties for the noise to flip some


def _noisy_router(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Mixtral's router (and Qwen3-MoE's, with ``norm_topk_prob``), with noise of 1e-3 on its logits and
    the renormalization writing into ``topk``'s output in place, as theirs does."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = functional.linear(hidden_states, self.weight)
    logits = logits + 1e-3 * torch.randn(logits.shape, generator=NOISE, dtype=logits.dtype)
    top_value, top_index = torch.topk(torch.softmax(logits.float(), dim=-1), self.top_k, dim=-1)
    top_value /= top_value.sum(dim=-1, keepdim=True)
    PICKS.setdefault(id(self), []).append(top_index.clone())
    return logits, top_value.to(logits.dtype), top_index


def _noisy_moe(family: str, experts: str) -> nn.Module:
    model = FAMILIES[family](num_layers=2, experts_implementation=experts)
    for layer in model.model.layers:
        layer.mlp.gate.forward = types.MethodType(_noisy_router, layer.mlp.gate)
    return model


def _flipped() -> int:
    """Tokens whose experts a replay picked otherwise than its forward, over the calls in ``PICKS``."""
    return sum(int((picks[0] != replayed).any(-1).sum()) for picks in PICKS.values() for replayed in picks[1:])


@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_control_flips_tokens_when_routing_is_recomputed(family, experts):
    """Plain checkpointing recomputes ``topk`` on the replay's noisy logits: some tokens go elsewhere (with
    eager experts the replay then saves tensors of other shapes, which torch's own check catches after
    the routers ran)."""
    model = _noisy_moe(family, experts)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    PICKS.clear()
    NOISE.manual_seed(0)
    try:
        train_step(model, LOSS)
    except torch.utils.checkpoint.CheckpointError:  # raised in the last layer's replay, the first to run
        assert experts == "eager"
    assert max(len(picks) for picks in PICKS.values()) == 2
    assert _flipped() > 0


def _applied(model: nn.Module, mode: str) -> hyperac.Plan:
    if mode != "auto":
        return hyperac.apply(model, mode=mode, backend="cpu")
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(0))
    NOISE.manual_seed(0)
    plan = hyperac.apply(model, mode="auto", backend="cpu", budget=0.6,
                         sample={"input_ids": ids, "labels": ids})
    assert plan.count("off") < 2, str(plan)  # a layer recomputes
    return plan


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("experts", EXPERTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_the_replay_routes_as_the_forward_did(family, experts, mode):
    """0 tokens route otherwise in the replay than in the forward, in every mode; and the last layer's
    experts, which see only the routes and the exact gradient from the head, get the un-applied model's
    gradients bitwise (the noise reaches only the routers' own gradients and what flows back through them)."""
    reference = _noisy_moe(family, experts)
    PICKS.clear()
    NOISE.manual_seed(0)
    expected = train_step(reference, LOSS)
    model = _noisy_moe(family, experts)
    plan = _applied(model, mode)
    calls = {"off": 1, "full": 2, "selective": 2, "selective-even": 2, "pointwise": 2}
    recomputes = [layer.mode != "off" for layer in plan.layers]
    result: list = []
    PICKS.clear()
    NOISE.manual_seed(0)
    result.append(train_step(model, LOSS))
    picks = list(PICKS.values())
    assert len(picks) == 2 and [len(p) for p in picks] == [calls.get(mode, 1 + flag) for flag in recomputes]
    assert _flipped() == 0
    last = "model.layers.1.mlp.experts."
    assert_parity((expected[0], {k: v for k, v in expected[1].items() if k.startswith(last)}),
                  (result[0][0], {k: v for k, v in result[0][1].items() if k.startswith(last)}))


class _TopkRuns(TorchDispatchMode):
    """Counts the ``topk`` calls that run, spanning a step's forward and backward."""

    def __init__(self) -> None:
        super().__init__()
        self.runs = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.runs += func is torch.ops.aten.topk.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("mode", ("full", "selective", "pointwise"))
def test_topk_runs_once_and_a_router_writing_into_it_stays_exact(family, mode):
    """Without noise, kept routes change nothing: bitwise parity over two steps, with the router writing
    into ``topk``'s output in place, for both kinds of experts; and ``topk`` runs in the forward only."""
    for experts in EXPERTS:
        model = FAMILIES[family](num_layers=2, experts_implementation=experts)
        reference = train_step(model, LOSS)
        hyperac.apply(model, mode=mode, backend="cpu")
        for _ in range(2):  # the first step finds the routing layers, the second runs them as found
            with _TopkRuns() as counter:
                assert_parity(reference, train_step(model, LOSS))
            assert counter.runs == 2, (experts, counter.runs)


SPLITS: dict[int, list[list[int]]] = {}
"""Layer id -> the split sizes it gave its experts per call, forward then replays (module level, as ``PICKS``)."""


class _Router(nn.Module):
    """Picks one expert per token from noisy scores (``NOISE``) and counts the tokens per expert."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self.proj(x) + 0.5 * torch.randn(x.shape[0], 4, generator=NOISE)
        order = torch.argsort(scores.argmax(-1))
        return order, torch.bincount(scores.argmax(-1)[order], minlength=4)


class _SplitMoe(nn.Module):
    """Experts fed by split sizes from the router's counts (``.tolist()``), as an all-to-all is."""

    def __init__(self) -> None:
        super().__init__()
        self.router = _Router()
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order, counts = self.router(x)
        SPLITS.setdefault(id(self), []).append(counts.tolist())
        parts = x[order].split(counts.tolist())
        out = torch.cat([expert(part) for expert, part in zip(self.experts, parts)])
        return x + torch.zeros_like(x).index_copy(0, order, out)


@pytest.mark.parametrize("mode", ("full", "selective", "selective-even", "pointwise"))
def test_split_sizes_from_kept_counts_match_in_every_replay(mode):
    """Counts made into split sizes (``bincount`` then ``.tolist()``, as an expert-parallel all-to-all takes
    them) are the forward's in the replay, under noise of 0.5 on the router's scores, and so in a second
    replay through a retained graph."""
    model = Stack(_SplitMoe)
    x = torch.randn(64, 16, requires_grad=True)
    hyperac.apply(model, mode=mode, backend="cpu", layers="blocks")
    SPLITS.clear()
    NOISE.manual_seed(0)
    loss = model(x).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    assert [len(splits) for splits in SPLITS.values()] == [3, 3]
    for splits in SPLITS.values():
        assert splits[1] == splits[2] == splits[0], splits


@pytest.mark.parametrize("mode", ("full", "selective"))
def test_a_second_replay_routes_as_the_forward_did(mode):
    """A second backward through a retained graph replays again, with the forward's routes too."""
    model = _noisy_moe("mixtral", "grouped_mm")
    hyperac.apply(model, mode=mode, backend="cpu")
    model.train()
    PICKS.clear()
    NOISE.manual_seed(0)
    loss = LOSS(model)
    loss.backward(retain_graph=True)
    loss.backward()
    assert [len(picks) for picks in PICKS.values()] == [3, 3]
    assert _flipped() == 0


def test_a_router_named_in_force_recompute_gives_up_the_guarantee_with_a_hyperac_error():
    """``force_recompute=`` naming the router wins: its routing ops are run again, the split sizes come out
    otherwise, and the kept matmul of an expert no longer fits its input. That is a RecomputeMismatchError
    naming the layer and the op, not a raw shape error from a later op."""
    model = Stack(_SplitMoe)
    x = torch.randn(64, 16, requires_grad=True)
    NOISE.manual_seed(0)
    reference = model(x).sum()
    hyperac.apply(model, mode="selective", backend="cpu", layers="blocks", force_recompute=["router"])
    NOISE.manual_seed(0)
    loss = model(x).sum()
    assert torch.equal(loss, reference)
    with pytest.raises(hyperac.RecomputeMismatchError, match=(
            r"layer 'blocks\.1' diverged from its forward at op \d+ of \d+ \(aten\.addmm\.default\): the forward "
            r"ran it on tensors of shapes \[16\], \[\d+, 16\], \[16, 16\], "
            r"the recompute on \[16\], \[\d+, 16\], \[16, 16\], which the output the forward kept does not fit")):
        loss.backward()


def test_routes_are_counted_in_plans_and_shown_in_print_plan():
    """``full`` keeps a routing layer's input and its routes: Mixtral's grouped experts route with ``topk``
    (values and indices of 256 tokens x 2), ``sort`` of the 512 expert ids (values and indices) and
    ``histc`` (4 counts); the estimate's bytes say so, and an auto plan's print names them."""
    tokens, top_k = 4 * 64, 2
    routes = tokens * top_k * (4 + 8) + tokens * top_k * (8 + 8) + 4 * 4
    ids = torch.randint(0, 128, (4, 64), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "labels": ids}
    estimate = hyperac.estimate(tiny_mixtral(num_layers=2, experts_implementation="grouped_mm"), sample, backend="cpu")
    for layer in estimate.layers:
        assert layer.route_bytes == routes
        assert layer.kept_bytes["full"] == tokens * 32 * 4 + routes  # the layer input, float32, and the routes
    plain = hyperac.estimate(tiny_qwen2(num_layers=2), sample, backend="cpu")
    assert {layer.route_bytes for layer in plain.layers} == {0}
    assert {layer.kept_bytes["full"] for layer in plain.layers} == {tokens * 32 * 4}
    plan = hyperac.apply(tiny_mixtral(num_layers=2, experts_implementation="grouped_mm"), mode="auto", backend="cpu",
                         budget=0.6, sample=sample)
    assert (f"note: 2 recomputed layer(s) route data-dependently (model.layers.0, model.layers.1): their replays take "
            f"the forward's routes, kept for backward, {2 * routes / 2**10:.1f} KiB per step") in str(plan)


MODES_SEEN: list[int] = []
"""How many dispatch modes were active as a watched module ran, per call (module level, as ``PICKS``)."""


def _modes_inside(module: nn.Module, args: tuple) -> None:
    MODES_SEEN.append(torch._C._len_torch_dispatch_stack())


def test_full_layers_that_route_nothing_pay_nothing_after_their_first_forward():
    """``full`` finds routing layers on their first training forward; from the second step on, a layer that
    routed nothing runs its forward and replay under no dispatch mode, and a routing layer under one."""
    for model, routing in ((tiny_qwen2(num_layers=2), False), (tiny_mixtral(num_layers=2), True)):
        model.model.layers[0].post_attention_layernorm.register_forward_pre_hook(_modes_inside)
        hyperac.apply(model, mode="full", backend="cpu")
        MODES_SEEN.clear()
        train_step(model, LOSS)
        assert MODES_SEEN == [1, 1]  # the first forward is watched, and so is its replay
        MODES_SEEN.clear()
        train_step(model, LOSS)
        assert MODES_SEEN == ([1, 1] if routing else [0, 0])


ROUTE_NOW = [True]
"""Whether ``_SometimesRouting`` routes in this step (module level, out of the snapshot's reach)."""


class _SometimesRouting(nn.Module):
    """Routes with ``topk`` in the steps ``ROUTE_NOW`` says, and in the others not."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        y = self.proj(self.norm(x))
        if ROUTE_NOW[0]:
            y = y.gather(-1, y.topk(2, dim=-1).indices).sum(-1, keepdim=True) * y
        return torch.tanh(y)


def test_a_full_layer_that_routed_once_keeps_its_routes_in_later_steps():
    """A layer found routing on its first forward is watched in every later step, also after a step in which
    it routed nothing (that step turned the watch off for good before)."""
    model = Stack(_SometimesRouting, num_blocks=2)
    model.blocks[0].norm.register_forward_pre_hook(_modes_inside)
    hyperac.apply(model, mode="full", layers="blocks", backend="cpu")
    x = torch.randn(4, 8, requires_grad=True)
    for route_now in (True, False, True):
        ROUTE_NOW[0] = route_now
        MODES_SEEN.clear()
        model(x).sum().backward()
        assert MODES_SEEN == [1, 1], route_now  # the forward and its replay, under the routes' mode
    ROUTE_NOW[0] = True


DECISIONS: dict[int, list[object]] = {}
"""Layer id -> the route it decided per call, forward then replays (module level, as ``PICKS``)."""

ROUTES = {
    "topk": lambda s: s.topk(2, dim=-1).indices,
    "sort": lambda s: s.sort(dim=-1).indices,
    "argsort": lambda s: s.argsort(dim=-1, stable=True),
    "argmax": lambda s: s.argmax(-1),
    "argmin": lambda s: s.argmin(-1),
    "max over a dim": lambda s: s.max(dim=-1).indices,
    "min over a dim": lambda s: s.min(dim=-1).indices,
    "kthvalue": lambda s: s.kthvalue(2, dim=-1).indices,
    "nonzero": lambda s: torch.nonzero(s[:, 0] > 0),
    "where(mask)": lambda s: torch.where(s[:, 0] > 0)[0],
    "bincount": lambda s: torch.bincount((s[:, 0] * 2).clamp(-1, 1).round().long() + 1, minlength=3),
    "histc": lambda s: torch.histc(s[:, 0], bins=4, min=-1, max=1),
    "unique": lambda s: torch.unique((s[:, 0] * 2).round(), return_counts=True)[1],
    ".item()": lambda s: (s[:, 0] > 0).sum().item(),
}


class _Deciding(nn.Module):
    """Decides a route with ``self.route`` from noisy scores (``NOISE``) and records it."""

    def __init__(self, route: str) -> None:
        super().__init__()
        self.route = route
        self.proj = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.proj(x) + 0.5 * torch.randn(x.shape[0], 4, generator=NOISE)
        decided = ROUTES[self.route](scores)
        DECISIONS.setdefault(id(self), []).append(decided.clone() if isinstance(decided, torch.Tensor) else decided)
        return x + scores.tanh().sum(-1, keepdim=True)


@pytest.mark.parametrize("mode", ("full", "selective", "pointwise"))
@pytest.mark.parametrize("route", ROUTES)
def test_every_routing_op_decides_as_in_the_forward(route, mode):
    """Each kind of op that decides a data-dependent route is taken from the forward in the replay."""
    model = Stack(lambda: _Deciding(route))
    hyperac.apply(model, mode=mode, backend="cpu", layers="blocks")
    DECISIONS.clear()
    NOISE.manual_seed(0)
    model(torch.randn(64, 16, requires_grad=True)).sum().backward()
    assert [len(decided) for decided in DECISIONS.values()] == [2, 2]
    for forward, replayed in DECISIONS.values():
        assert type(forward) is type(replayed)
        assert torch.equal(forward, replayed) if isinstance(forward, torch.Tensor) else forward == replayed


STATISTICS: list[int] = []
"""What ``_weight_statistic`` read from the weights, per call (module level, as ``PICKS``)."""


def _weight_statistic(module: nn.Module, args: tuple) -> None:
    """A stack's parameter pre-hook reading a statistic of the weight to the host: ``argmax`` and ``.item()``,
    routing ops that are no route of the layer."""
    with torch.no_grad():
        STATISTICS.append(module.weight.abs().argmax().item())


def test_routing_ops_a_parameter_hook_runs_are_no_routes():
    """``full``'s routing watch leaves out the routing ops a sharding stack's parameter hook runs, as the selective
    recording does: the layer keeps no routes (it runs under no dispatch mode from its second step on, and the
    planner counts no route bytes), and stays bitwise exact."""
    x = torch.randn(16, 32, requires_grad=True)
    reference = train_step(Stack(BiasedMlp), lambda model: model(x).sum())
    model = Stack(BiasedMlp)
    for block in model.blocks:
        block.up.register_forward_pre_hook(_weight_statistic)
    model.blocks[0].gate.register_forward_pre_hook(_modes_inside)
    estimate = hyperac.estimate(model, lambda model: model(x).sum(), backend="cpu", layers="blocks")
    assert [layer.route_bytes for layer in estimate.layers] == [0, 0]
    hyperac.apply(model, mode="full", backend="cpu", layers="blocks")
    for _ in range(2):
        MODES_SEEN.clear()
        assert_parity(reference, train_step(model, lambda model: model(x).sum()))
    assert MODES_SEEN == [0, 0]  # a layer found routing would run its forward and replay under the routes' mode
    assert len(set(STATISTICS)) == 2  # the hooks ran, in the forward and in the replay


@torch.library.custom_op("hyperac_test::router_noise", mutates_args=())
def _router_noise(logits: torch.Tensor) -> torch.Tensor:
    """Noise on router logits from ``NOISE``, as one op the compiler traces (a generator argument would break the
    graph) and the backward graph runs again where it recomputes the route: other noise there."""
    return 0.5 * torch.randn(logits.shape, generator=NOISE, dtype=logits.dtype)


@_router_noise.register_fake
def _(logits: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(logits)


class _CompiledRouter(nn.Module):
    """Picks two of four columns per token with ``topk`` of noisy scores, renormalizing the picked scores in place
    (Mixtral's ``router_top_value /= ...``), and mixes them into its output."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.router, self.up = nn.LayerNorm(16), nn.Linear(16, 4), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        logits = self.router(h)
        value, index = (logits + _router_noise(logits.detach())).softmax(-1).topk(2, dim=-1)
        value /= value.sum(-1, keepdim=True)
        y = self.up(h)
        return x + y * value.sum(-1, keepdim=True) + y.gather(-1, index * 4).sum(-1, keepdim=True)


def _keeping(graphs: dict[str, list[torch.fx.GraphModule]]) -> Any:
    """``aot_eager`` that keeps the forward and backward graphs it compiles in ``graphs``."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def keep(phase: str) -> Any:
        def compiler(graph: torch.fx.GraphModule, inputs: Any) -> Any:
            graphs[phase].append(graph)
            return make_boxed_func(graph.forward)
        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))


def _runs(graph: torch.fx.GraphModule, op: Any) -> int:
    return sum(node.target is op for node in graph.graph.nodes)


@pytest.mark.parametrize("mode", ("full", "selective", "selective-even", "pointwise"))
def test_compiled_layers_keep_their_routes(mode):
    """A layer compiled in one graph (``compile=True``, ``aot_eager``) saves its routes: the backward graph runs no
    ``topk``, and under noise that the backward graph would draw anew the last layer's ``up``, which sees the
    routes and the exact gradient from the loss, gets the un-applied model's gradients bitwise."""
    torch._dynamo.reset()
    x = torch.randn(64, 16)
    base = Stack(_CompiledRouter)
    NOISE.manual_seed(0)
    expected = train_step(copy.deepcopy(base), lambda model: model(x).sum())
    model = copy.deepcopy(base)
    hyperac.apply(model, mode=mode, compile=True, backend="cpu", layers="blocks")
    graphs: dict[str, list[torch.fx.GraphModule]] = {"forward": [], "backward": []}
    for block in model.blocks:
        block.compile(backend=_keeping(graphs))
    NOISE.manual_seed(0)
    result = train_step(model, lambda model: model(x).sum())
    torch._dynamo.reset()
    topk = torch.ops.aten.topk.default
    assert [_runs(graph, topk) for graph in graphs["forward"]] == [1, 1]
    assert [_runs(graph, topk) for graph in graphs["backward"]] == [0, 0]
    last = "blocks.1.up."
    assert_parity((expected[0], {k: v for k, v in expected[1].items() if k.startswith(last)}),
                  (result[0], {k: v for k, v in result[1].items() if k.startswith(last)}))
