"""Backend selection for the suite: ``HYPERAC_TEST_BACKEND`` (set by each tox env), default cpu.

Tests marked ``cuda`` or ``npu`` run only when that backend is selected; the selected backend
must be usable, or the session stops (an all-skipped hardware run must not pass).
"""

import copy
import os

import pytest
import torch
from hyperac_testing import lm_loss, tiny_llama, train_step

import hyperac

SELECTED = os.environ.get("HYPERAC_TEST_BACKEND", "cpu")


def pytest_sessionstart(session):
    # The models under test are tiny: one thread is faster than two, and steadier on a busy machine.
    torch.set_num_threads(1)
    try:
        hyperac.get_backend(SELECTED)
    except hyperac.HyperACError as error:
        pytest.exit(f"HYPERAC_TEST_BACKEND={SELECTED!r} cannot run here: {error}", returncode=4)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("dist") and not os.environ.get("HYPERAC_TEST_DIST"):
            item.add_marker(pytest.mark.skip(reason="a slower multi-process or integration test: run with tox -e dist"))
        for hardware in ("cuda", "npu"):
            if hardware in item.keywords and SELECTED != hardware:
                item.add_marker(pytest.mark.skip(reason=f"needs backend={hardware} (tox -e {hardware})"))


@pytest.fixture(scope="session")
def backend_name():
    """The backend this run targets."""
    return SELECTED


@pytest.fixture(scope="module")
def base_model():
    """A tiny 4-layer Llama, built once per test module (a module may define its own)."""
    return tiny_llama(num_layers=4)


@pytest.fixture
def model(base_model):
    """A fresh copy of ``base_model`` for one test."""
    return copy.deepcopy(base_model)


@pytest.fixture(scope="module")
def loss_fn():
    """A causal-LM loss on a fixed 2 x 16 batch."""
    return lm_loss(batch=2, seq=16)


@pytest.fixture(scope="module")
def reference(base_model, loss_fn):
    """One un-applied training step of ``base_model``: (loss, grads)."""
    return train_step(copy.deepcopy(base_model), loss_fn)
