"""Plans per length bucket, switched at each training forward (NOTE [Plans per length bucket] in
hyperac/length_switch.py, NOTE [Bucket bounds] in hyperac/planner/lengths.py).

One 4-layer Llama planned for 64 tokens from a 16-token sample at half of the no-recompute peak
at 64: its buckets (16, 32, 48, 64) differ in how many layers recompute, so the FLOPs of a step
tell which bucket ran it.
"""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from hyperac_testing import hook_count, tiny_llama
from torch.utils.flop_counter import FlopCounterMode

import hyperac
from hyperac.backends.sim import SimBackend
from hyperac.measure import step_peak
from hyperac.plan import mode_letters
from hyperac.planner.lengths import bucket_bounds
from hyperac.state import STATE_KEY

L = 64
LONGER = 80
BUDGET = 0.5


def ids_of(length, seed=0):
    return torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(seed))


def loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def peak(model, ids):
    return step_peak(model, {"input_ids": ids, "labels": ids})


def step_flops(model, *batches):
    """FLOPs of the forwards of ``batches`` and one backward of their summed loss."""
    with FlopCounterMode(display=False) as counter:
        sum(loss(model, ids) for ids in batches).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops()


def grads_after(model, *batches):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    total = sum(loss(model, ids) for ids in batches)
    total.backward()
    return total.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def base():
    # No KV cache in training: an applied model drops it (NOTE [KV caches in replays]), so peaks compare.
    return tiny_llama(num_layers=4, use_cache=False)


@pytest.fixture(scope="module")
def off_peak(base):
    return peak(copy.deepcopy(base), ids_of(L))


@pytest.fixture(scope="module")
def applied(base, off_peak):
    model = copy.deepcopy(base)
    sample = {"input_ids": ids_of(L)[:, :16], "labels": ids_of(L)[:, :16]}
    plan = hyperac.apply(model, mode="auto", budget=int(BUDGET * off_peak), sample=sample, max_seq_len=L,
                         backend="cpu")
    return model, plan


@pytest.fixture(scope="module")
def plan_flops(base):
    """``plan_flops(modes, ids)``: the FLOPs a model applied with those per-layer modes (a fixed plan,
    no buckets) replays in a step on ``ids``."""
    def replayed_by(modes, ids):
        reference = copy.deepcopy(base)
        hyperac.apply(reference, layers=dict(enumerate(modes)), backend="cpu")
        return replayed(reference, base, ids)

    return replayed_by


def bucket_lines(plan):
    return [line for line in str(plan).splitlines() if line.startswith(("  up to", "  longer than"))]


def replayed(model, base, *batches):
    return step_flops(model, *batches) - step_flops(base, *batches)


def test_buckets_are_planned_from_one_profile_and_shown(applied):
    model, plan = applied
    assert [b.max_len for b in plan.buckets] == bucket_bounds(L, 4) == [16, 32, 48, 64]
    assert plan.buckets[-1].modes == tuple(layer.mode for layer in plan.layers)
    assert plan.buckets[-1].predicted_peak_bytes == plan.predicted_peak_bytes
    recomputed = [sum(mode != "off" for mode in b.modes) for b in plan.buckets]
    assert recomputed == sorted(recomputed) and recomputed[0] < recomputed[-1], plan
    seconds = [b.predicted_step_seconds / b.max_len for b in plan.buckets]
    assert seconds[0] < seconds[-1], "the short bucket's plan is no faster per token than the default"
    assert all(b.predicted_peak_bytes <= plan.budget_bytes for b in plan.buckets)
    assert hyperac.applied_plan(model) is plan
    text = str(plan)
    for bucket in plan.buckets:
        letters, mib = mode_letters(bucket.modes), bucket.predicted_peak_bytes / 2**20
        assert f"up to {bucket.max_len}: {letters}  peak {mib:.2f} MiB" in text, text
    assert text.count("(default)") == 1 and f"up to {L}: {mode_letters(plan.buckets[-1].modes)}" in text
    assert f"longer than {L}: FFFF (full on every layer), after a warning" in text


def test_each_length_runs_its_buckets_plan(applied, base, plan_flops):
    """Recompute FLOPs per step are those of the plan of the bucket holding its length, which differ
    from bucket to bucket."""
    model, plan = applied
    assert len({b.modes for b in plan.buckets}) > 2, plan
    installed = [(vars(m).get("forward"), dict(m._forward_pre_hooks)) for m in model.modules()]
    by_length = {16: plan.buckets[0], 30: plan.buckets[1], 32: plan.buckets[1], 48: plan.buckets[2], L: plan.buckets[3]}
    for n, bucket in by_length.items():
        assert replayed(model, base, ids_of(n)) == plan_flops(bucket.modes, ids_of(n)), n
    with pytest.warns(hyperac.HyperACWarning, match=rf"shape \[2, {LONGER}\] has {LONGER} positions in dimension 1, "
                      rf"more than the max_seq_len={L} the plan was made for, so it runs full recompute on every "
                      rf"layer \(the most memory-saving plan\)"):
        assert replayed(model, base, ids_of(LONGER)) == plan_flops(["full"] * 4, ids_of(LONGER))
    wider = torch.randint(0, 128, (3, 32), generator=torch.Generator().manual_seed(2))
    assert plan.batch_shape == (2, L)
    with pytest.warns(hyperac.HyperACWarning, match=r"shape \[3, 32\] is larger than the shape \[2, 64\] the plans "
                      r"were made for in a dimension other than 1, .* so it runs full recompute on every layer"):
        assert replayed(model, base, wider) == plan_flops(["full"] * 4, wider)
    # switching installed nothing: the same overrides and hooks on every module
    assert [(vars(m).get("forward"), dict(m._forward_pre_hooks)) for m in model.modules()] == installed


def test_each_replay_uses_its_forwards_mode_across_buckets(applied, base, plan_flops):
    """Two micro-batches of different buckets, then one backward, in both orders: each layer replays
    as its forward ran, and gradients are bitwise those of the un-applied model."""
    model, plan = applied
    short, long = ids_of(16, seed=3), ids_of(L, seed=4)
    expected = plan_flops(plan.buckets[0].modes, short) + plan_flops(plan.buckets[3].modes, long)
    assert expected != plan_flops(plan.buckets[3].modes, short) + plan_flops(plan.buckets[3].modes, long)
    assert replayed(model, base, short, long) == expected
    assert replayed(model, base, long, short) == expected
    for batches in ((short, long), (long, short), (ids_of(48, seed=5),), (ids_of(30, seed=6), ids_of(30, seed=7))):
        reference = grads_after(base, *batches)
        got = grads_after(model, *batches)
        torch.testing.assert_close(got[0], reference[0], rtol=0, atol=0)
        assert got[1].keys() == reference[1].keys()
        for name, grad in reference[1].items():
            torch.testing.assert_close(got[1][name], grad, rtol=0, atol=0, msg=name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", hyperac.HyperACWarning)  # the longer batch warns (tested above)
        reference, got = grads_after(base, ids_of(LONGER, seed=8), short), grads_after(model, ids_of(LONGER, seed=8),
                                                                                        short)
    assert all(torch.equal(got[1][name], grad) for name, grad in reference[1].items())


def test_peaks_per_length_fit_the_budget_as_predicted(applied):
    model, plan = applied
    for bucket in plan.buckets:
        measured = peak(model, ids_of(L)[:, :bucket.max_len])
        assert measured <= 1.03 * plan.budget_bytes, (bucket, measured)
        assert bucket.predicted_peak_bytes == pytest.approx(measured, rel=0.05), bucket


def test_eval_and_no_grad_forwards_switch_nothing(applied):
    model, plan = applied
    state = model.__dict__[STATE_KEY]
    loss(model, ids_of(16)).backward()
    model.zero_grad(set_to_none=True)
    assert state.bucket == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning for a longer batch outside training
        with torch.no_grad():
            loss(model, ids_of(LONGER))
        model.eval()
        try:
            loss(model, ids_of(LONGER))
        finally:
            model.train()
    assert state.bucket == 0


def test_a_plan_round_trips_through_json_with_its_buckets(applied, base, plan_flops):
    model, plan = applied
    written = json.loads(json.dumps(plan.to_dict()))
    again = copy.deepcopy(base)
    reapplied = hyperac.apply(again, plan=written)
    assert reapplied.buckets == plan.buckets and reapplied.max_seq_len == L and reapplied.batch_shape == (2, L)
    assert bucket_lines(reapplied) == bucket_lines(plan) and len(bucket_lines(plan)) == 5
    assert replayed(again, base, ids_of(16)) == plan_flops(plan.buckets[0].modes, ids_of(16))
    assert replayed(again, base, ids_of(L)) == plan_flops(plan.buckets[3].modes, ids_of(L))
    hyperac.remove(again)
    with pytest.raises(hyperac.ConfigError, match=r"Config.seq_dim=2 contradicts the plan's seq_dim=1, the dimension "
                                                  r"its length buckets were planned along; drop seq_dim="):
        hyperac.apply(again, plan=written, seq_dim=2)
    hyperac.apply(again, plan={**written, "seq_dim": 2})  # no tensor argument has a dimension 2: the length is unknown
    with pytest.warns(hyperac.HyperACWarning, match=r"tensor arguments of shapes \[\[2, 16\], \[2, 16\]\] has none "
                      r"with a dimension 2 to read its sequence length from, so it runs full recompute on every layer"):
        assert replayed(again, base, ids_of(16)) == plan_flops(["full"] * 4, ids_of(16))
    with pytest.raises(hyperac.ConfigError, match=r"Config.plan\['buckets'\]\[0\]\['modes'\] is \['off'\]; give one "
                                                  r"mode per layer of Config\.plan\['layers'\] \(4\)"):
        hyperac.apply(copy.deepcopy(base), plan={**written, "buckets": [{"max_len": 16, "modes": ["off"]}]})
    with pytest.raises(hyperac.ConfigError, match=r"a plan with length buckets needs 'max_seq_len'"):
        hyperac.Plan.from_dict({**written, "max_seq_len": None})
    with pytest.raises(hyperac.ConfigError, match="length buckets .* not supported with compile=True"):
        hyperac.apply(copy.deepcopy(base), plan=written, compile=True)


class Channelled(torch.nn.Module):
    """A causal LM fed ids of shape (batch, 1, seq): the sequence length is dimension 2."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids, labels):
        return self.lm(input_ids=input_ids[:, 0], labels=labels[:, 0])


def test_a_plan_keeps_its_seq_dim(base, off_peak, plan_flops):
    """A plan made with ``seq_dim=2`` switches along dimension 2 when applied again from JSON with no
    ``seq_dim=``; one that says otherwise is refused; a plan written before ``seq_dim`` was kept reads 1."""
    ids = ids_of(L)[:, None]
    model = Channelled(copy.deepcopy(base))
    plan = hyperac.apply(model, mode="auto", budget=int(BUDGET * off_peak), sample={"input_ids": ids[..., :16],
                         "labels": ids[..., :16]}, max_seq_len=L, seq_dim=2, backend="cpu", length_buckets=2)
    assert plan.seq_dim == 2 and plan.batch_shape == (2, 1, L)
    assert "by the batch's length, dimension 2 of its first tensor" in str(plan)
    assert plan.buckets[0].modes != plan.buckets[1].modes, plan
    written = json.loads(json.dumps(plan.to_dict()))
    assert written["seq_dim"] == 2
    reference = Channelled(base)
    for given in ({}, {"seq_dim": 2}):  # none: the plan's; the plan's again: agrees
        again = Channelled(copy.deepcopy(base))
        assert hyperac.apply(again, plan=written, **given).seq_dim == 2
        for bucket in plan.buckets:
            n = bucket.max_len
            assert replayed(again, reference, ids[..., :n]) == plan_flops(bucket.modes, ids_of(L)[:, :n]), n
    with pytest.raises(hyperac.ConfigError, match=r"Config.seq_dim=1 contradicts the plan's seq_dim=2"):
        hyperac.apply(Channelled(copy.deepcopy(base)), plan=written, seq_dim=1)
    older = {key: value for key, value in written.items() if key != "seq_dim"}
    assert hyperac.Plan.from_dict(older).seq_dim is None
    with pytest.raises(hyperac.ConfigError, match=r"Config.plan\['seq_dim'\] is -1; give the sequence dimension"):
        hyperac.Plan.from_dict({**written, "seq_dim": -1})


def test_hyperac_plan_output_applies_with_its_buckets(tmp_path, capsys):
    from transformers import AutoConfig, LlamaForCausalLM

    from hyperac import cli

    settings = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=128, max_position_embeddings=128)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **settings}))
    path = tmp_path / "plan.json"
    assert cli.main(["plan", "--config", str(tmp_path / "config.json"), "--seq", "32", "--max-seq-len", "128",
                     "--budget", "0.6", "--device", "cpu", "--output", str(path)]) == 0
    out = capsys.readouterr().out
    written = json.loads(path.read_text())
    assert [b["max_len"] for b in written["buckets"]] == [32, 64, 96, 128] and written["batch_shape"] == [1, 128]
    assert written["seq_dim"] == 1
    for bucket in written["buckets"]:
        assert f"  batches up to {bucket['max_len']}: {mode_letters(bucket['modes'])}, peak" in out
    model = LlamaForCausalLM(AutoConfig.for_model("llama", **settings))
    plan = hyperac.apply(model, plan=written)
    assert [b.max_len for b in plan.buckets] == [32, 64, 96, 128]
    assert plan.buckets[-1].modes == tuple(layer.mode for layer in plan.layers)


def test_remove_leaves_no_switch_behind(base, off_peak):
    model = copy.deepcopy(base)
    before = {name: dict(vars(module)) for name, module in model.named_modules()}
    hyperac.apply(model, mode="auto", budget=int(BUDGET * off_peak), sample={"input_ids": ids_of(16), "labels":
                  ids_of(16)}, max_seq_len=L, backend="cpu", length_buckets=2)
    assert hook_count(model) > 0 and any("forward" in vars(m) for m in model.modules())
    hyperac.remove(model)
    assert hook_count(model) == 0
    after = {name: dict(vars(module)) for name, module in model.named_modules()}
    assert after.keys() == before.keys()
    for name, attributes in before.items():
        assert after[name].keys() == attributes.keys(), name


def test_a_copy_switches_by_its_own_state(applied, base, plan_flops):
    model, plan = applied
    twin = copy.deepcopy(model)
    state, twin_state = model.__dict__[STATE_KEY], twin.__dict__[STATE_KEY]
    loss(model, ids_of(L)).backward()
    model.zero_grad(set_to_none=True)
    assert replayed(twin, base, ids_of(16)) == plan_flops(plan.buckets[0].modes, ids_of(16))
    assert twin_state.bucket == 0 and state.bucket == len(plan.buckets) - 1
    hyperac.remove(twin)
    assert hook_count(twin) == 0 and hyperac.applied_plan(model) is plan


def test_one_bucket_runs_the_plan_for_max_seq_len_on_every_shorter_batch(base, off_peak, plan_flops):
    model = copy.deepcopy(base)
    plan = hyperac.apply(model, mode="auto", budget=int(BUDGET * off_peak), sample={"input_ids": ids_of(16),
                         "labels": ids_of(16)}, max_seq_len=L, backend="cpu", length_buckets=1)
    assert [b.max_len for b in plan.buckets] == [L]
    assert replayed(model, base, ids_of(16)) == plan_flops(plan.buckets[0].modes, ids_of(16))
    assert plan.buckets[0].modes == tuple(layer.mode for layer in plan.layers)
    with pytest.raises(hyperac.ConfigError, match=r"Config.length_buckets must be an int >= 1, got 0"):
        hyperac.Config(mode="auto", budget=0.5, sample={"input_ids": ids_of(16)}, max_seq_len=L, length_buckets=0)


def test_bucket_bounds_are_evenly_spaced_up_to_max_seq_len():
    assert bucket_bounds(4096, 4) == [1024, 2048, 3072, 4096]
    assert bucket_bounds(10, 4) == [3, 5, 8, 10]
    assert bucket_bounds(2, 4) == [1, 2]


def test_swap_is_chosen_for_max_seq_len_only(base):
    """On ``sim`` with a fast link, the plan for 128 tokens swaps; shorter buckets that fit without
    swap recompute only and move nothing to host memory; a longer batch swaps as the default does."""
    model = copy.deepcopy(base)
    ids = ids_of(128)
    backend = SimBackend(1e12, 50e-6)
    plan = hyperac.apply(model, mode="auto", budget=0.6, sample={"input_ids": ids[:, :32], "labels": ids[:, :32]},
                         max_seq_len=128, backend=backend, min_swap_bytes=0)
    assert any(layer.swap for layer in plan.layers), plan
    default = plan.buckets[-1].modes
    own = [b for b in plan.buckets if b.modes != default]
    assert own and all("swap" not in b.modes for b in own), plan
    short = own[0].max_len

    def moved(n):
        before = hyperac.swap_stats(model).offloaded_bytes
        reference = grads_after(base, ids_of(n))
        got = grads_after(model, ids_of(n))
        assert all(torch.equal(got[1][name], grad) for name, grad in reference[1].items())
        return hyperac.swap_stats(model).offloaded_bytes - before

    assert moved(short) == 0
    assert moved(128) > 0
    reference = grads_after(base, ids_of(short), ids_of(128))  # one backward over a swapping and a plain forward
    got = grads_after(model, ids_of(short), ids_of(128))
    assert all(torch.equal(got[1][name], grad) for name, grad in reference[1].items())
    with pytest.warns(hyperac.HyperACWarning, match="runs full recompute on every layer"):
        assert moved(160) > 0


@pytest.fixture(scope="module")
def two_layers():
    """For ``torch.compile(model)``, whose tracing of the whole 4-layer model takes ~35 s: 2 layers,
    2 buckets, whose plans differ."""
    base = tiny_llama(num_layers=2, use_cache=False)
    model = copy.deepcopy(base)
    plan = hyperac.apply(model, mode="auto", budget=0.75, sample={"input_ids": ids_of(16), "labels": ids_of(16)},
                         max_seq_len=L, backend="cpu", length_buckets=2)
    return model, plan, base


def with_buckets(base, plan, modes):
    """A copy of ``base`` applied with ``plan`` whose buckets run ``modes`` (the last also its layers')."""
    data = plan.to_dict()
    assert len(data["buckets"]) == len(modes)
    for bucket, bucket_modes in zip(data["buckets"], modes):
        bucket["modes"] = list(bucket_modes)
    for layer, mode in zip(data["layers"], modes[-1]):
        layer["mode"] = mode
    model = copy.deepcopy(base)
    return model, hyperac.apply(model, plan=data, backend="cpu")


@pytest.mark.parametrize("per_layer", [True, False], ids=["layer.compile", "torch.compile(model)"])
def test_a_user_compiled_bucketed_model_switches_within_the_recompile_limit(request, per_layer):
    """NOTE [Switching under torch.compile]: compiled after ``apply`` (``eager`` backend: dynamo alone
    decides graphs), steps of every bucket and a longer one compile a graph per distinct layer mode
    (per layer) or plan (the whole model), and one for the first, static, shape; they hit no
    recompile limit, break no graph, and give the gradients of the un-applied model compiled the
    same way, bitwise."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model, plan, base = (*request.getfixturevalue("applied"), request.getfixturevalue("base")) if per_layer else \
        request.getfixturevalue("two_layers")
    # Fixed bucket plans (auto's own follow its timing), of off and full: a selective-family layer
    # applied eagerly records its ops in a dispatch mode that dynamo skips, a graph break (NOTE
    # [Switching under torch.compile]).
    model, plan = with_buckets(base, plan, (("off", "off", "off", "off"), ("full", "off", "off", "off"),
                                            ("full", "full", "off", "off"), ("full", "full", "full", "off"))
                               if per_layer else (("off", "off"), ("full", "off")))
    lengths = (16, 30, 48, L, LONGER, 8, 40, 20, 56) if per_layer else (16, 40, L, LONGER, 8, 20)

    def compiled_grads(module):
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        counter = CompileCounterWithBackend("eager")
        module = copy.deepcopy(module)
        if per_layer:
            for layer in module.model.layers:
                layer.compile(backend=counter)
        else:
            module = torch.compile(module, backend=counter)
        with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True), warnings.catch_warnings():
            warnings.simplefilter("ignore", hyperac.HyperACWarning)  # the longer batch warns (tested above)
            grads = [grads_after(module, ids_of(n, seed=n))[1] for n in lengths]
        assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])
        return grads, counter.frame_count

    got, graphs = compiled_grads(model)
    reference, _ = compiled_grads(base)
    plans = {b.modes for b in plan.buckets} | {("full",) * len(plan.layers)}
    distinct = {mode for modes in plans for mode in modes} if per_layer else plans
    assert len(plans) >= 2 and graphs <= len(distinct) + 1, (graphs, plans)
    for n, expected, grads in zip(lengths, reference, got):
        for name, grad in expected.items():
            torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=f"{n}: {name}")
