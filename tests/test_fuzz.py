"""Random layer programs (tests/program_fuzzer.py) in every mode, bit for bit against the un-applied model.

Each example is a program of 2 or 3 layers and one backward kind (plain, ``retain_graph`` twice,
``create_graph`` then a backward through the gradients); it runs un-applied and in full, selective,
selective-even, pointwise and auto, for two SGD steps each. Every mode must give the un-applied
losses, gradients, parameters and buffers bit for bit, or raise a documented hyperac error
(``InputWrittenError``, ``RecomputeMismatchError``); a wrong result or any other exception fails,
and hypothesis shrinks the program to a minimal one. Programs the un-applied model cannot run (a
write into a tensor autograd saved) are skipped.

A second generator (tests/feature_fuzzer.py) draws models written the way users write them: autocast,
forward hooks, Python attributes changed in forward, auxiliary-loss lists, modules the parent owns,
parametrizations under ``parametrize.cached()``, the user's own checkpoint, data-dependent branches,
``ModelOutput`` returns, float64 islands, a layer run twice, a loss over two lengths; the same oracle.

The default suite runs a quick profile (``HYPERAC_FUZZ_EXAMPLES``, default 30 programs and 10 models, fixed
seeds, about 40 s of CPU; the variable sets both counts); ``tox -e fuzz`` the long one (2,000 of each). With
``HYPERAC_FUZZ_REPORT=path`` the counts per generator, mode and outcome are written there as JSON.
"""

from __future__ import annotations

import collections
import json
import os

import pytest
from feature_fuzzer import build, feature_programs, loss_fn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from program_fuzzer import BACKWARDS, MODES, outcome, programs, reference

EXAMPLES = int(os.environ.get("HYPERAC_FUZZ_EXAMPLES", "30"))
MODEL_EXAMPLES = int(os.environ.get("HYPERAC_FUZZ_EXAMPLES", "10"))
COUNTS: collections.Counter = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    path = os.environ.get("HYPERAC_FUZZ_REPORT")
    if path:
        with open(path, "w") as file:
            json.dump({" ".join(key): count for key, count in sorted(COUNTS.items())}, file, indent=1)


@pytest.mark.filterwarnings("ignore::hyperac.HyperACWarning")
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(program=programs(), backward=st.sampled_from(BACKWARDS))
def test_random_programs_match_the_unapplied_model_or_raise_a_documented_error(program, backward):
    expected = reference(program, backward)
    if isinstance(expected, str):
        COUNTS["programs", "(un-applied fails)", "invalid"] += 1
        return
    for mode in MODES:
        result, detail = outcome(program, mode, backward, expected)
        COUNTS["programs", mode, result] += 1
        assert result in ("parity", "error"), f"{mode}, {backward} backward: {result}: {detail}"


@pytest.mark.filterwarnings("ignore::hyperac.HyperACWarning")
@settings(max_examples=MODEL_EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(program=feature_programs(), backward=st.sampled_from(BACKWARDS))
def test_models_written_like_users_match_the_unapplied_model_or_raise_a_documented_error(program, backward):
    loss = loss_fn(program)
    expected = reference(program, backward, build, loss)
    if isinstance(expected, str):
        COUNTS["models", "(un-applied fails)", "invalid"] += 1
        return
    for mode in MODES:
        result, detail = outcome(program, mode, backward, expected, build, loss)
        COUNTS["models", mode, result] += 1
        assert result in ("parity", "error"), f"{mode}, {backward} backward: {result}: {detail}"
