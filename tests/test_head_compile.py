"""The chunked LM head under ``torch.compile`` (NOTE [The chunked head under torch.compile] in
hyperac/head.py): compiled per layer and as a whole model, the head and the loss run eagerly in
chunks between graphs, with the loss and the gradients of the eager chunked head, and the logits are
never saved whole. ``aot_eager`` keeps it fast on CPU; Inductor runs with ``HYPERAC_TEST_INDUCTOR=1``."""

from __future__ import annotations

import copy
import os
import warnings
from typing import Any

import pytest
import torch
from hyperac_testing import saved_for_backward, tiny_llama, tiny_qwen2
from test_head import HEAD_BOUND, VOCAB, batch, step, tiny_gemma2
from torch import nn

import hyperac
from hyperac.head import DeferredLogits

FAMILIES = {
    "llama": lambda: tiny_llama(2, vocab_size=VOCAB, hidden_size=32, intermediate_size=64),
    "qwen2-tied": lambda: tiny_qwen2(2, vocab_size=VOCAB, tie_word_embeddings=True),
    "gemma2-softcap": tiny_gemma2,
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(model: nn.Module, how: str, backend: str = "aot_eager", fullgraph: bool = False) -> nn.Module:
    """``model`` compiled per layer (``"layers"``, as torchtitan does) or whole (``"model"``)."""
    if how == "layers":
        for layer in model.model.layers:
            layer.compile(backend=backend, fullgraph=fullgraph)
        return model
    return torch.compile(model, backend=backend, fullgraph=fullgraph)


def compiled_step(model: nn.Module, runner: nn.Module, inputs: dict[str, Any]
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor], Any, list[torch.Tensor]]:
    """One step of ``runner`` (``model`` compiled): loss, gradients by ``model``'s names, the output and
    every tensor saved for backward."""
    model.train()
    model.zero_grad(set_to_none=True)
    output, saved = saved_for_backward(lambda: runner(**inputs))
    output.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.loss.detach(), grads, output, saved


def assert_within_the_bound(reference: tuple[torch.Tensor, dict[str, torch.Tensor]],
                            loss: torch.Tensor, grads: dict[str, torch.Tensor]) -> None:
    assert torch.equal(loss, reference[0]), (loss, reference[0])
    assert grads.keys() == reference[1].keys()
    for name, grad in reference[1].items():
        error = (grads[name] - grad).abs().max().item()
        assert error <= HEAD_BOUND * grad.abs().max().item(), f"gradient of {name} off by {error!r}"


def assert_logits_never_saved_whole(saved: list[torch.Tensor], inputs: dict[str, Any]) -> None:
    whole = inputs["input_ids"].numel() * VOCAB
    assert saved and max(t.numel() for t in saved) < whole, sorted(t.numel() for t in saved)[-3:]


@pytest.mark.parametrize("family, mode, how", [
    ("llama", "selective", "layers"),
    ("qwen2-tied", "full", "model"),
    ("gemma2-softcap", "selective", "model"),
])
def test_compiled_chunked_head_matches_the_model(family: str, mode: str, how: str) -> None:
    """Loss bitwise and every gradient within docs/correctness.md's bound of the un-applied model; per
    layer with fullgraph=True (torchtitan), whole with its graph broken before the head; the loss
    went through the chunks (the logits stayed deferred) and no saved tensor holds them whole."""
    model = FAMILIES[family]()
    inputs = batch()
    reference = step(model, inputs)[:2]
    chunked = copy.deepcopy(model)
    plan = hyperac.apply(chunked, mode=mode, head="chunked", head_chunk=16, compile=True)
    assert plan.head == "chunked" and "note: under torch.compile: the chunked head and loss run eagerly" in str(plan)
    runner = compiled(chunked, how, fullgraph=how == "layers")
    for _ in range(2):  # the second step runs the graphs compiled by the first
        loss, grads, output, saved = compiled_step(chunked, runner, inputs)
        assert_within_the_bound(reference, loss, grads)
    assert isinstance(output.logits, DeferredLogits) and output.logits.value is None
    assert_logits_never_saved_whole(saved, inputs)


def test_logits_are_saved_whole_without_the_chunked_head() -> None:
    """The memory check above can fail: the same compiled model with the head as it is saves them."""
    model = FAMILIES["llama"]()
    hyperac.apply(model, mode="selective", compile=True)
    inputs = batch()
    *_, saved = compiled_step(model, compiled(model, "model"), inputs)
    with pytest.raises(AssertionError):
        assert_logits_never_saved_whole(saved, inputs)


def test_fullgraph_of_the_whole_model_says_why_and_the_fix() -> None:
    model = FAMILIES["qwen2-tied"]()
    hyperac.apply(model, mode="full", head="chunked", compile=True)
    runner = compiled(model, "model", fullgraph=True)
    with pytest.raises(torch._dynamo.exc.Unsupported, match=(
            r"hyperac: the chunked LM head and its loss \(Config.head='chunked'\) run outside the compiled graph "
            r".* compile each decoder layer instead \(layer.compile\(fullgraph=True\), as torchtitan does\), compile "
            r"the model without fullgraph=True, or apply with head='off'")):
        compiled_step(model, runner, batch())
    with torch.no_grad():  # without grad the head is the model's own: one graph
        logits = runner(input_ids=batch()["input_ids"]).logits
    assert type(logits) is torch.Tensor and logits.shape == (2, 37, VOCAB)


@pytest.mark.skipif(not os.environ.get("HYPERAC_TEST_INDUCTOR"), reason="Inductor's C++ build: HYPERAC_TEST_INDUCTOR=1")
def test_inductor_whole_model() -> None:
    model = FAMILIES["llama"]()
    inputs = batch()
    reference = step(model, inputs)[:2]
    hyperac.apply(model, mode="selective", head="chunked", head_chunk=16, compile=True)
    loss, grads, _, saved = compiled_step(model, compiled(model, "model", backend="inductor"), inputs)
    assert abs(loss - reference[0]) <= 1e-6 * reference[0]  # Inductor's layers may round as eager ones do not
    for name, grad in reference[1].items():
        assert (grads[name] - grad).abs().max() <= HEAD_BOUND * grad.abs().max(), name
    assert_logits_never_saved_whole(saved, inputs)


@pytest.mark.parametrize("head", [None, "auto"])
def test_auto_under_compile_chunks_the_head_to_meet_a_budget(monkeypatch: pytest.MonkeyPatch, head: str | None) -> None:
    """mode='auto' under compile weighs the head as eager auto does (NOTE [The head in the plan]): a
    budget below what compiled layers save with the head as the model computes it is met with the head
    chunked (head=None with a warning), and what the plan predicts is what the compiled model then
    saves: the forward's saves, not the chunks the head's backward recomputes one at a time."""
    from hyperac.planner import compiled as compiled_planner

    monkeypatch.setattr(compiled_planner, "TIMING_SECONDS", 0.0)  # the fewest timed rounds
    model = FAMILIES["llama"]()
    options = dict(mode="auto", budget=0.4, sample=batch(), head=head, head_chunk=16, compile="aot_eager")
    with pytest.raises(hyperac.ConfigError, match="is below the smallest plan"):
        hyperac.apply(copy.deepcopy(model), **{**options, "head": "off"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", hyperac.HyperACWarning)
        plan = hyperac.apply(model, **options)
    fallback = [w for w in caught if "mode='auto' chunked the LM head and its loss" in str(w.message)]
    assert len(fallback) == (head is None)
    assert plan.head == "chunked" and plan.predicted_bytes <= plan.budget_bytes
    assert "saved for backward with no recompute" in str(plan)
    runner = compiled(model, "layers")
    compiled_step(model, runner, batch())  # compiles
    *_, saved = compiled_step(model, runner, batch())
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    measured = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
                    if t.untyped_storage().data_ptr() not in parameters}.values())
    assert measured == plan.predicted_bytes, (measured, plan.predicted_bytes)


def test_a_plan_with_the_head_chunked_applies_under_compile() -> None:
    """A plan file's chunked head is installed with compile=True as head='chunked' is (it was refused)."""
    model = FAMILIES["llama"]()
    planned = hyperac.apply(copy.deepcopy(model), mode="selective", head="chunked")
    plan = hyperac.apply(model, plan=hyperac.Plan.from_dict(planned.to_dict()), compile=True)
    assert plan.head == "chunked" and "forward" in model.lm_head.__dict__
    assert "note: under torch.compile: the chunked head and loss run eagerly" in str(plan)
