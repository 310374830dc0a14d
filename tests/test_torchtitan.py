"""hyperac.integrations.torchtitan: the torch it refuses, and the inherited torchtitan AC fields it
refuses rather than ignores. (Training through torchtitan's parallelize_llama is
tests/test_parallel.py::test_torchtitan_llama3_debug_model, in ``tox -e torchtitan``.)"""

from __future__ import annotations

import importlib
import re

import pytest
import torch
from torch import nn

from hyperac import ConfigError, TorchVersionError

OLD_TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2]) < (2, 14)


@pytest.mark.skipif(not OLD_TORCH, reason="this torch is one torchtitan 0.3 runs on")
def test_import_refuses_a_torch_older_than_torchtitan_needs():
    """On torch 2.13 (the CPU env) the integration says so before torchtitan is imported at all."""
    pattern = (rf"torch {re.escape(torch.__version__)} is older than the torch 2\.14 that torchtitan 0\.3 needs.*"
               r"pip install 'torch==2\.14\.1' 'torchtitan==0\.3\.0'")
    with pytest.raises(TorchVersionError, match=pattern):
        importlib.import_module("hyperac.integrations.torchtitan")


@pytest.fixture
def integration():
    if OLD_TORCH:
        pytest.skip("torchtitan 0.3 needs torch 2.14 (tox -e torchtitan)")
    pytest.importorskip("torchtitan")
    return importlib.import_module("hyperac.integrations.torchtitan")


def test_check_torch_reads_local_versions(integration):
    integration.check_torch("2.14.1+cu130")
    integration.check_torch("2.15.0.dev20260101")
    with pytest.raises(TorchVersionError, match=r"torch 2\.13\.0\+cpu is older"):
        integration.check_torch("2.13.0+cpu")


@pytest.mark.parametrize(("field", "value", "default"), [
    ("preserve_rng_state", False, "True"), ("determinism_check", "none", "'default'"), ("debug", True, "False"),
])
def test_inherited_fields_other_than_their_default_are_refused(integration, field, value, default):
    model = nn.Module()
    model.layers = nn.ModuleDict({"0": nn.Sequential(nn.Linear(4, 4)), "1": nn.Sequential(nn.Linear(4, 4))})
    recompute = integration.HyperACRecompute(integration.HyperACRecompute.Config(**{field: value}))
    with pytest.raises(ConfigError, match=rf"HyperACRecompute\.Config\.{field}={value!r} has no effect in hyperac.*"
                                          rf"leave it at its default, {default}"):
        recompute.apply(model)
    assert "forward" not in model.layers["0"].__dict__  # nothing applied
