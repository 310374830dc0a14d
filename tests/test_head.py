"""The LM head and its loss computed per chunk of tokens (NOTE [The head and the loss in chunks] in
hyperac/head.py): parity with the un-chunked model, the options, FLOPs and memory."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hyperac_testing import tiny_llama, tiny_qwen2
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import hyperac
from hyperac.head import DeferredLogits
from hyperac.measure import step_peak

VOCAB = 1000
HEAD_BOUND = 1e-5
"""docs/correctness.md: with the head chunked, every gradient is within this fraction of its
largest entry (max |chunked - un-chunked| <= HEAD_BOUND * max |un-chunked|); the loss is bitwise."""


def tiny_gemma2(num_layers: int = 2, **overrides: Any) -> nn.Module:
    """A Gemma 2 with final-logit soft-capping (tied embeddings, as Gemma ships)."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    settings = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=8, final_logit_softcapping=3.0,
                    max_position_embeddings=64)
    settings.update(overrides)
    torch.manual_seed(0)
    return Gemma2ForCausalLM(Gemma2Config(**settings))


FAMILIES = {
    "llama-untied": lambda: tiny_llama(2, vocab_size=VOCAB),
    "llama-tied": lambda: tiny_llama(2, vocab_size=VOCAB, tie_word_embeddings=True),
    "qwen2-tied": lambda: tiny_qwen2(2, vocab_size=VOCAB, tie_word_embeddings=True),
    "gemma2-softcap": tiny_gemma2,
}


def batch(seq: int = 37, seed: int = 0, **extra: Any) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, seq), generator=generator)
    labels = ids.clone()
    labels[0, :9] = -100  # a prompt that is not trained on
    return {"input_ids": ids, "labels": labels, **extra}


def step(model: nn.Module, inputs: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any]:
    model.train()
    model.zero_grad(set_to_none=True)
    output = model(**inputs)
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.loss.detach(), grads, output


def assert_head_parity(reference: nn.Module, chunked: nn.Module, inputs: dict[str, Any], exact: bool = False) -> None:
    loss, grads, _ = step(reference, inputs)
    chunked_loss, chunked_grads, _ = step(chunked, inputs)
    assert torch.equal(chunked_loss, loss), f"loss {chunked_loss.item()!r} != {loss.item()!r}"
    assert chunked_grads.keys() == grads.keys()
    for name, grad in grads.items():
        if exact:
            assert torch.equal(chunked_grads[name], grad), f"gradient of {name} differs"
        else:
            error = (chunked_grads[name] - grad).abs().max().item()
            assert error <= HEAD_BOUND * grad.abs().max().item(), f"gradient of {name} off by {error!r}"


def chunked_copy(model: nn.Module, **options: Any) -> tuple[nn.Module, hyperac.Plan]:
    clone = copy.deepcopy(model)
    return clone, hyperac.apply(clone, **{"mode": "off", "head": "chunked", **options})


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [5, 32, None])
def test_chunked_head_matches_the_model_within_the_bound(family: str, chunk: int | None) -> None:
    model = FAMILIES[family]()
    chunked, plan = chunked_copy(model, head_chunk=chunk)
    assert plan.head == "chunked"
    assert_head_parity(model, chunked, batch())


@pytest.mark.parametrize("family", FAMILIES)
def test_one_chunk_is_bitwise(family: str) -> None:
    model = FAMILIES[family]()
    chunked, _ = chunked_copy(model, head_chunk=10**6)
    assert_head_parity(model, chunked, batch(), exact=True)


def test_layer_modes_combine_with_the_chunked_head() -> None:
    model = FAMILIES["llama-tied"]()
    chunked, plan = chunked_copy(model, mode="full", head_chunk=8)
    assert plan.count("full") == 2
    assert_head_parity(model, chunked, batch())


@pytest.mark.parametrize("num_items", [torch.tensor(50), 50])
def test_num_items_in_batch_divides_the_summed_loss(num_items: Any) -> None:
    model = FAMILIES["llama-untied"]()
    chunked, _ = chunked_copy(model, head_chunk=8)
    assert_head_parity(model, chunked, batch(num_items_in_batch=num_items))


def test_shift_labels_and_chunks_with_only_ignored_tokens() -> None:
    model = FAMILIES["qwen2-tied"]()
    chunked, _ = chunked_copy(model, head_chunk=4)
    inputs = batch()
    shifted = torch.full_like(inputs["labels"], -100)
    shifted[:, 20:30] = inputs["input_ids"][:, 21:31]  # chunks 0-4 hold no trained token
    inputs = {"input_ids": inputs["input_ids"], "labels": inputs["labels"], "shift_labels": shifted}
    assert_head_parity(model, chunked, inputs)


def test_logits_are_returned_when_read() -> None:
    model = FAMILIES["gemma2-softcap"]()
    chunked, _ = chunked_copy(model, head_chunk=8)
    inputs = batch()
    expected = model(**inputs).logits
    output = chunked(**inputs)
    assert isinstance(output.logits, DeferredLogits) and output.logits.shape == expected.shape
    assert torch.equal(output.logits * 1, expected)  # read: computed whole, soft-capped as the model does


def test_logits_read_into_the_loss_train_as_without_hyperac() -> None:
    model = FAMILIES["llama-untied"]()
    chunked, _ = chunked_copy(model, head_chunk=8)
    inputs = batch()

    def run(m: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        m.zero_grad(set_to_none=True)
        output = m(**inputs)
        total = output.loss + output.logits.square().mean()
        total.backward()
        return total.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}

    (loss, grads), (chunked_loss, chunked_grads) = run(model), run(chunked)
    assert torch.equal(chunked_loss, loss)
    for name, grad in grads.items():
        assert (chunked_grads[name] - grad).abs().max() <= HEAD_BOUND * grad.abs().max(), name


def test_labels_that_do_not_match_the_logits_fail_as_without_hyperac() -> None:
    model = FAMILIES["llama-untied"]()
    chunked, _ = chunked_copy(model)
    inputs = batch(logits_to_keep=5)  # logits for 5 positions, labels for 37
    errors = []
    for m in (model, chunked):
        with pytest.raises(ValueError) as error:
            m(**inputs)
        errors.append(str(error.value))
    assert errors[0] == errors[1] and "Expected input batch_size (10) to match target batch_size (74)" in errors[0]


def test_without_grad_the_head_runs_as_it_is() -> None:
    model = FAMILIES["llama-tied"]()
    chunked, _ = chunked_copy(model)
    with torch.no_grad():
        logits = chunked(input_ids=batch()["input_ids"]).logits
        expected = model(input_ids=batch()["input_ids"]).logits
    assert type(logits) is torch.Tensor and torch.equal(logits, expected)


def test_recorded_ops_replay_per_chunk_and_other_ops_compute_the_logits() -> None:
    torch.manual_seed(0)
    hidden, weight = torch.randn(3, 5, 8), torch.randn(11, 8)
    deferred = DeferredLogits(hidden, weight, None)
    capped = torch.tanh(deferred / 2.0) * 2.0
    expected = torch.tanh(nn.functional.linear(hidden, weight) / 2.0) * 2.0
    assert isinstance(capped, DeferredLogits) and capped.value is None and len(capped.steps) == 3
    assert torch.equal(capped.chunk(hidden[1]), expected[1])
    assert torch.equal(capped[..., :4], expected[..., :4])  # slicing is not recorded: computed whole
    assert capped.value is not None


class _Counter(TorchDispatchMode):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.count = name, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += func.overloadpacket.__name__ == self.name
        return func(*args, **(kwargs or {}))


def test_flops_show_one_more_head_projection() -> None:
    model = tiny_llama(1, vocab_size=4000, tie_word_embeddings=True)
    chunked, _ = chunked_copy(model, head_chunk=16)
    inputs = batch(seq=64)
    inputs["input_ids"] = inputs["input_ids"] * 3
    counts = []
    for m in (model, chunked):
        with FlopCounterMode(display=False) as counter:
            m(**inputs).loss.backward()
        counts.append(counter.get_total_flops())
    tokens, hidden = inputs["input_ids"].numel(), model.config.hidden_size
    assert counts[1] - counts[0] == 2 * tokens * hidden * 4000


def test_tied_embedding_builds_no_dense_gradient() -> None:
    model = FAMILIES["qwen2-tied"]()
    chunked, _ = chunked_copy(model, head_chunk=8)
    inputs = batch()
    for m, dense in ((model, 1), (chunked, 0)):
        with _Counter("embedding_dense_backward") as counter:
            m(**inputs).loss.backward()
        assert counter.count == dense
    assert_head_parity(model, chunked, inputs)


def test_gradients_accumulate_over_micro_batches() -> None:
    model = FAMILIES["qwen2-tied"]()
    chunked, _ = chunked_copy(model, head_chunk=8)
    grads = []
    for m in (model, chunked):
        m.zero_grad(set_to_none=True)
        for seed in (0, 1):  # the second step adds into the gradients the first left
            m(**batch(seed=seed, num_items_in_batch=torch.tensor(120))).loss.backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for name, grad in grads[0].items():
        assert (grads[1][name] - grad).abs().max() <= HEAD_BOUND * grad.abs().max(), name


def test_peak_memory_is_lower() -> None:
    model = tiny_llama(1, vocab_size=8000)
    chunked, _ = chunked_copy(model, head_chunk=16)
    inputs = batch(seq=128)
    reference, lower = step_peak(model, inputs), step_peak(chunked, inputs)
    logits = inputs["input_ids"].numel() * 8000 * 4
    assert lower < reference - 1.5 * logits, (reference, lower)  # the logits, their gradient and their softmax


def test_remove_restores_the_model_exactly() -> None:
    model = FAMILIES["llama-tied"]()
    before = {name: dict(m.__dict__) for name, m in model.named_modules()}
    hyperac.apply(model, mode="off", head="chunked")
    assert "_loss_function" in model.__dict__ and "forward" in model.lm_head.__dict__
    assert "forward" in model.model.embed_tokens.__dict__
    hyperac.remove(model)
    assert {name: dict(m.__dict__) for name, m in model.named_modules()} == before


def test_a_copy_of_an_applied_model_is_independent() -> None:
    model = FAMILIES["gemma2-softcap"]()
    chunked, _ = chunked_copy(model, head_chunk=8)
    twin = copy.deepcopy(chunked)
    hyperac.remove(chunked)
    assert twin.__dict__["_loss_function"].owner is twin.__dict__["_hyperac_state"]
    assert_head_parity(model, twin, batch())


def test_a_model_whose_loss_hyperac_cannot_see_keeps_its_head() -> None:
    from transformers import BertConfig, BertForMaskedLM

    model = BertForMaskedLM(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=64))
    with pytest.warns(hyperac.HyperACWarning, match="left the head and the loss as they are: BertForMaskedLM "
                                                    "computes a ForMaskedLM loss"):
        plan = hyperac.apply(model, mode="off", head="chunked")
    assert plan.head == "off" and "_loss_function" not in model.__dict__
    assert "note: Config.head='chunked' left the head and the loss as they are" in str(plan)


def test_plan_records_the_head_and_applies_it_again() -> None:
    model = FAMILIES["llama-untied"]()
    _, plan = chunked_copy(model)
    assert "head: chunked" in str(plan)
    again = hyperac.Plan.from_dict(plan.to_dict())
    assert again.head == "chunked"
    clone = copy.deepcopy(model)
    assert hyperac.apply(clone, plan=again).head == "chunked"
    assert "_loss_function" in clone.__dict__


@pytest.mark.parametrize("options, message", [
    (dict(head="chunked", bitwise=True), "Config.head='chunked' with bitwise=True: the chunked head sums its weight's "
                                         "gradient chunk by chunk"),
    (dict(head="sometimes"), "Config.head must be None, 'off', 'chunked' or 'auto', got 'sometimes'"),
    (dict(head="auto"), "Config.head='auto' lets mode='auto' weigh the chunked head, but mode='full'"),
    (dict(head_chunk=0), "Config.head_chunk must be None or an int >= 1 (tokens per chunk), got 0"),
    (dict(bitwise="yes"), "Config.bitwise must be a bool (True or False), got 'yes'"),
])
def test_head_options_are_validated(options: dict[str, Any], message: str) -> None:
    with pytest.raises(hyperac.ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        hyperac.Config(**options)


def test_a_plan_with_the_head_chunked_is_held_to_the_same_refusals() -> None:
    """A plan applied with head=None installs its head as it was planned: bitwise=True refuses it as it
    refuses head='chunked' (it installed it before). compile=True takes it (tests/test_head_compile.py)."""
    plan = {**hyperac.Plan(backend="cpu", adapter="none", layers=()).to_dict(), "head": "chunked"}
    with pytest.raises(hyperac.ConfigError, match=r"Config.plan's head 'chunked' with bitwise=True"):
        hyperac.Config(plan=plan, bitwise=True)
    hyperac.Config(plan=plan, head="off", bitwise=True)  # the user's head= wins over the plan's
    assert hyperac.Config(plan=plan, compile=True).plan.head == "chunked"


def test_a_bad_head_in_a_plan_dict_is_named() -> None:
    plan = hyperac.Plan(backend="cpu", adapter="none", layers=()).to_dict()
    with pytest.raises(hyperac.ConfigError, match="Config.plan\\['head'\\] is 'sliced'; give 'off' .* or 'chunked'"):
        hyperac.Plan.from_dict({**plan, "head": "sliced"})


def _auto_model_and_sample() -> tuple[nn.Module, dict[str, Any]]:
    model = tiny_llama(2, vocab_size=32000)
    ids = torch.randint(0, 32000, (1, 128), generator=torch.Generator().manual_seed(0))
    return model, {"input_ids": ids, "labels": ids}


def test_auto_meets_a_budget_below_the_layers_floor_with_the_head_chunked() -> None:
    model, sample = _auto_model_and_sample()
    with pytest.raises(hyperac.ConfigError, match="is below the smallest plan"):
        hyperac.apply(copy.deepcopy(model), mode="auto", budget=0.5, sample=sample, head="off")
    with pytest.warns(hyperac.HyperACWarning, match="mode='auto' chunked the LM head and its loss to meet the budget"):
        plan = hyperac.apply(model, mode="auto", budget=0.5, sample=sample, head_chunk=16)
    assert plan.head == "chunked" and plan.predicted_peak_bytes <= plan.budget_bytes
    measured = step_peak(model, sample)
    assert abs(measured - plan.predicted_peak_bytes) <= 0.03 * plan.predicted_peak_bytes, (measured, plan)
    assert any(note.startswith("the head and the loss (NOTE [The head in the plan])") for note in plan.notes)


def test_auto_keeps_the_head_where_a_plan_fits_with_it_unless_asked_to_weigh() -> None:
    model, sample = _auto_model_and_sample()
    plan = hyperac.apply(copy.deepcopy(model), mode="auto", budget=1.0, sample=sample)
    assert plan.head == "off" and not any("The head in the plan" in note for note in plan.notes)
    weighed = hyperac.apply(model, mode="auto", budget=1.0, sample=sample, head="auto", head_chunk=16)
    assert any(note.startswith("the head and the loss (NOTE [The head in the plan])") for note in weighed.notes)


def test_auto_never_chunks_the_head_where_results_must_be_bitwise() -> None:
    model, sample = _auto_model_and_sample()
    with pytest.raises(hyperac.ConfigError, match="is below the smallest plan"):
        hyperac.apply(model, mode="auto", budget=0.5, sample=sample, bitwise=True, head_chunk=16)
    assert hyperac.apply(model, mode="auto", budget=1.0, sample=sample, bitwise=True, head_chunk=16).head == "off"


def test_estimate_refuses_head_auto_in_its_own_words() -> None:
    model = FAMILIES["llama-untied"]()
    with pytest.raises(hyperac.ConfigError, match=r"^estimate\(head='auto'\): an estimate profiles the head one way; "
                                                  r"give head='off' or head='chunked'"):
        hyperac.estimate(model, batch(), head="auto")


def test_auto_with_max_seq_len_plans_the_head_as_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plans per length bucket do not weigh the head: head='chunked' profiles every length with it
    chunked and installs it; head='auto' keeps it as the model computes it and says so."""
    from hyperac import head

    chunked_loss, calls = head.chunked_causal_loss, [0]

    def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls[0] += 1
        return chunked_loss(*args, **kwargs)

    monkeypatch.setattr(head, "chunked_causal_loss", counted)
    model = FAMILIES["llama-untied"]()
    sample = batch(seq=32)
    plan = hyperac.apply(copy.deepcopy(model), mode="auto", budget=1.0, sample=sample, max_seq_len=64,
                         head="chunked", head_chunk=16)
    assert plan.head == "chunked" and plan.max_seq_len == 64 and calls[0] > 0
    message = ("Config.head='auto' kept the head and the loss as the model computes them: mode='auto' with "
               "max_seq_len= (plans per length bucket) does not weigh the chunked head yet; head='chunked' plans the "
               "layers with them chunked.")
    calls[0] = 0
    with pytest.warns(hyperac.HyperACWarning, match=message.replace("(", r"\(").replace(")", r"\)")):
        plan = hyperac.apply(model, mode="auto", budget=1.0, sample=sample, max_seq_len=64, head="auto")
    assert plan.head == "off" and f"note: {message}" in str(plan) and calls[0] == 0
