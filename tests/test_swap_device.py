"""Swap on the selected backend's device: ``cuda`` (or ``npu``) under its tox env, in float32 with
exact gradients; elsewhere ``sim`` on the CPU, with every op of forward and backward checked
against the copies (``SimBackend.computing``).

The stress test trains with random batch shapes and optimizer steps, without synchronizing, and
compares the parameters bitwise with a copy that does not swap: a copy read before it landed or a
buffer reused too early gives wrong numbers only when consecutive batches differ, and one wrong
step shows in every parameter after it. ``ci/cuda.sh`` also runs this file under
``TORCH_CUDA_SANITIZER=1``, which reports unsynchronized accesses across streams.
"""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch
import torch.nn.functional as F
from hyperac_testing import assert_parity, tiny_llama, train_step
from torch import nn

import hyperac

SELECTED = os.environ.get("HYPERAC_TEST_BACKEND", "cpu")
BACKEND = SELECTED if SELECTED in ("cuda", "npu") else "sim"
ON_DEVICE = BACKEND != "sim"
# Large enough on a GPU that copies take longer than a kernel launch (a race has room to show).
WIDTH, MAX_SEQ, STEPS = (1024, 512, 12) if ON_DEVICE else (32, 48, 6)
PLANS = {
    "full+inputs": dict(mode="full", swap_inputs=True),
    "selective+outputs": dict(mode="selective", swap_selective_outputs=True),
    "pointwise+both": dict(mode="pointwise", swap_inputs=True, swap_selective_outputs=True),
    "swap": dict(mode="swap"),
}


@pytest.fixture(scope="module")
def device():
    return hyperac.get_backend(BACKEND).device()


@pytest.fixture(autouse=True)
def deterministic():
    """Bitwise parity on a GPU needs deterministic kernels (``CUBLAS_WORKSPACE_CONFIG`` is set by
    tox and ci/cuda.sh) and no TF32."""
    was = torch.are_deterministic_algorithms_enabled(), torch.backends.cuda.matmul.allow_tf32
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.use_deterministic_algorithms(was[0])
    torch.backends.cuda.matmul.allow_tf32 = was[1]


def checked(model: nn.Module) -> contextlib.AbstractContextManager:
    """On sim: every compute op checked against the copies; on a device: nothing to add."""
    backend = model.__dict__["_hyperac_state"].swap.backend
    return backend.computing() if BACKEND == "sim" else contextlib.nullcontext()


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, width: int, num_layers: int = 4, vocab: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(num_layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("plan", list(PLANS))
def test_random_shapes_and_optimizer_steps_keep_parameters_bitwise(plan, device):
    torch.manual_seed(0)
    base = Net(WIDTH).to(device)
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    hyperac.apply(model, backend=BACKEND, layers="blocks", min_swap_bytes=0, **PLANS[plan])
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (reference, model)]
    generator = torch.Generator().manual_seed(1)
    for _ in range(STEPS):
        batch, seq = (int(n) for n in (torch.randint(1, 5, (), generator=generator),
                                       torch.randint(8, MAX_SEQ, (), generator=generator)))
        ids = torch.randint(0, 256, (batch, seq + 1), generator=generator).to(device)
        for net, optimizer in zip((reference, model), optimizers):
            with checked(model) if net is model else contextlib.nullcontext():
                F.cross_entropy(net(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for (name, expected), actual in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(actual, expected), f"{name} differs after {STEPS} steps"
    stats = hyperac.swap_stats(model)
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes == stats.offloaded_bytes, stats


@pytest.mark.parametrize("plan", list(PLANS))
def test_llama_gradients_exact_on_the_device(plan, device):
    base = tiny_llama(num_layers=3, attn_implementation="eager").to(device)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
    loss_fn = lambda model: model(input_ids=ids, labels=ids).loss  # noqa: E731
    reference = train_step(copy.deepcopy(base), loss_fn)
    model = copy.deepcopy(base)
    hyperac.apply(model, backend=BACKEND, min_swap_bytes=0, **PLANS[plan])
    with checked(model):
        assert_parity(reference, train_step(model, loss_fn))
    stats = hyperac.swap_stats(model)
    assert stats.offloaded_bytes > 0 and stats.reloaded_bytes == stats.offloaded_bytes, stats
