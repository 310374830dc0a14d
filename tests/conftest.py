"""Backend selection for the suite: ``HYPERAC_TEST_BACKEND`` (set by each tox env), default cpu.

Tests marked ``cuda`` or ``npu`` run only when that backend is selected; the selected backend
must be usable, or the session stops (an all-skipped hardware run must not pass).
"""

import os

import pytest
import torch

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
        for hardware in ("cuda", "npu"):
            if hardware in item.keywords and SELECTED != hardware:
                item.add_marker(pytest.mark.skip(reason=f"needs backend={hardware} (tox -e {hardware})"))


@pytest.fixture(scope="session")
def backend_name():
    """The backend this run targets."""
    return SELECTED
