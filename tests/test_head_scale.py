"""The chunked head at real geometries (NOTE [The head in the plan] in hyperac/planner/head.py): minutes
of CPU each, so they run in ``tox -e scale`` (``HYPERAC_TEST_SCALE=1``), not in the default suite."""

from __future__ import annotations

import os

import pytest
import torch

import hyperac
from hyperac import cli
from hyperac.measure import step_peak

pytestmark = pytest.mark.skipif(not os.environ.get("HYPERAC_TEST_SCALE"),
                                reason="minutes of CPU at real geometries: tox -e scale")


def test_qwen2_half_billion_meets_half_of_its_peak_with_the_head_chunked() -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                                         tie_word_embeddings=True))
    ids = torch.randint(0, 151936, (1, 256), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "labels": ids}
    plan = hyperac.apply(model, mode="auto", budget=0.5, sample=sample)
    assert plan.head == "chunked"
    measured = step_peak(model, sample)
    assert abs(measured - plan.predicted_peak_bytes) <= 0.03 * plan.predicted_peak_bytes, (measured, str(plan))


def test_llama3_8b_at_8k_plans_within_a_tenth_of_no_recompute(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["plan", "--preset", "llama-3-8b", "--seq", "8192", "--budget", "0.1", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert "head: chunked;" in out
    predicted = out.split("predicted: peak ")[1]
    peak, off = float(predicted.split(" GiB")[0]), float(predicted.split("no recompute: ")[1].split(" GiB")[0])
    assert peak <= 0.1 * off, out
