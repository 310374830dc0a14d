"""Random layer plans and sessions (tests/plan_fuzzer.py), bit for bit against the un-applied model.

Each example draws a tiny model (HF Llama, GPT-2, BERT, or a plain ``ModuleList``/``nn.Sequential``
stack with BatchNorm statistics and dropout) in float32, bfloat16 or float64, a plan (a uniform mode
or ``layers=`` ranges with an override, all six eager modes, ``swap`` on the ``sim`` backend,
``swap_inputs``, ``save_ops=``, ``force_recompute=``) and a session of training steps of random
shapes, ``no_grad`` forwards in train and eval mode, a training step in eval mode and
remove-then-apply cycles to new plans. Losses, gradients, parameters and buffers must equal the
un-applied model's bit for bit, and after ``remove`` every module's and config's attributes must be
the un-applied model's; hypothesis shrinks a failure to a minimal case.

The default suite runs a quick profile (``HYPERAC_PLAN_FUZZ_EXAMPLES``, default 25 cases, fixed
seeds, about 7 s of CPU); ``tox -e fuzz`` a long one (2,000 cases, about 3 min).
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, given, settings
from plan_fuzzer import cases, compare

EXAMPLES = int(os.environ.get("HYPERAC_PLAN_FUZZ_EXAMPLES", "25"))


@pytest.mark.filterwarnings("ignore::hyperac.HyperACWarning")
@settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=cases())
def test_random_plans_and_sessions_match_the_unapplied_model(case):
    assert compare(case) == []
