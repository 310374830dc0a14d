"""Swap on the ``sim`` backend (side-stream copies land only when their event is waited on).

The cases check gradients bitwise against the model without hyperac (CPU float32), that swap
brought back what it moved out (``reloaded == offloaded`` where backward ran), and that no tensor
anyone can still read lost its storage. They are the reference system's swap bugs
(seed-behaviour.md B.9): tensors shared across layers, tensors returned to the user, views and
expanded tensors, a module called twice, forwards without backward, exceptions, leaks; and the
sim backend's own promise that a missing wait shows.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import gc
import os
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F
from hyperac_testing import (
    applied_copy,
    assert_parity,
    freed_storage_tensors,
    hook_count,
    hyperac_lines,
    lm_loss,
    measure,
    saved_for_backward,
    tiny_llama,
    tiny_mixtral,
    train_step,
)
from torch import nn

import hyperac
from hyperac import ConfigError, HyperACWarning
from hyperac.backends.sim import SimBackend, SimRaceError
from hyperac.swap import (
    GroupState,
    HostPool,
    SwapGroup,
    SwapManager,
    SwapStats,
    container_memory_limit,
    current_group,
    default_host_budget,
    live_group_count,
)

SIM = dict(backend="sim", min_swap_bytes=0)

PLANS = {
    "full+inputs": dict(mode="full", swap_inputs=True),
    "selective+inputs": dict(mode="selective", swap_inputs=True),
    "selective+outputs": dict(mode="selective", swap_selective_outputs=True),
    "pointwise+both": dict(mode="pointwise", swap_inputs=True, swap_selective_outputs=True),
    "swap": dict(mode="swap"),
}
# The plans whose layer inputs go to host memory.
INPUT_PLANS = ("full+inputs", "selective+inputs", "swap")
CORE_PLANS = ("full+inputs", "selective+outputs", "swap")


# --- A plain model: every case can be built from it. ---


class Block(nn.Module):
    """Pre-norm tanh MLP with a residual. ``shared`` (positional) scales the normed input, ``scale``
    (keyword) the branch; ``fail`` raises half-way through the forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.fail = False

    def forward(self, x, shared=None, *, scale=None):
        normed = self.norm(x)
        h = self.fc1(normed if shared is None else normed * shared)
        if self.fail:
            raise RuntimeError("block failed on purpose")
        h = self.fc2(torch.tanh(h))
        return x + (h if scale is None else h * scale)


class Net(nn.Module):
    """Embedding, ``blocks`` called in ``order`` (an index twice shares that block's weights), head.

    ``extras``: every block also gets ``sigmoid(embedding)`` positionally (a recompute input that
    requires grad) and a rotary-like table as a keyword; both are kept in ``self.extras_seen``.
    """

    def __init__(self, num_layers=3, width=32, vocab=64, order=None, extras=False, block=Block):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(block(width) for _ in range(num_layers))
        self.head = nn.Linear(width, vocab)
        self.order = list(range(num_layers)) if order is None else order
        self.extras = extras
        self.extras_seen = None

    def forward(self, ids, hidden=None):
        x = self.embed(ids)
        args, kwargs = (), {}
        if self.extras:
            position = torch.arange(ids.shape[1], dtype=x.dtype)[:, None]
            table = 1 + 0.1 * torch.cos(position * torch.linspace(0.1, 1.0, x.shape[-1]))
            args, kwargs = (torch.sigmoid(x),), dict(scale=table)
            self.extras_seen = (args[0], table)
        for index in self.order:
            x = self.blocks[index](x, *args, **kwargs)
            if hidden is not None:
                hidden.append(x)
        return self.head(x)


def make_net(**options) -> Net:
    torch.manual_seed(0)
    return Net(**options)


def token_batch(batch=2, seq=8, vocab=64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq + 1), generator=generator)


def net_loss(seed=0, **batch):
    ids = token_batch(seed=seed, **batch)
    return lambda model, **kw: F.cross_entropy(model(ids[:, :-1], **kw).flatten(0, 1), ids[:, 1:].flatten())


def swapped(base, **options):
    """A copy of ``base`` with swap applied on ``sim`` (tiny tensors swap too)."""
    if isinstance(base, Net):
        options.setdefault("layers", "blocks")
    return applied_copy(base, **{**SIM, **options})[0]


def manager(model) -> SwapManager:
    return model.__dict__["_hyperac_state"].swap


def checked_step(model, loss_fn):
    """``train_step`` with every op of forward and backward checked against the sim's copies."""
    with manager(model).backend.computing():
        return train_step(model, loss_fn)


def grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_round_trip(model):
    """Swap moved something out, and backward brought all of it back."""
    stats = hyperac.swap_stats(model)
    assert stats.offloaded_bytes > 0, stats
    assert stats.reloaded_bytes == stats.offloaded_bytes, stats


def assert_intact(tensors, expected):
    for tensor, reference in zip(tensors, expected, strict=True):
        assert tensor.untyped_storage().nbytes() >= tensor.numel() * tensor.element_size()
        assert torch.equal(tensor, reference)


@pytest.fixture(autouse=True)
def no_group_outlives_the_test():
    if live_group_count():
        gc.collect()
    before = live_group_count()  # 0 unless an earlier test failed
    yield
    if live_group_count() > before:
        gc.collect()
    assert live_group_count() <= before


@pytest.fixture(scope="module")
def llama():
    return tiny_llama(num_layers=3)


@pytest.fixture(scope="module")
def llama_loss():
    return lm_loss(batch=2, seq=16)


@pytest.fixture(scope="module")
def net():
    return make_net()


# --- Parity on a real model ---


@pytest.mark.parametrize("plan", list(PLANS))
def test_llama_gradients_exact_and_everything_reloaded(llama, llama_loss, plan):
    reference = train_step(copy.deepcopy(llama), llama_loss)
    model = swapped(llama, **PLANS[plan])
    assert_parity(reference, train_step(model, llama_loss))
    assert_round_trip(model)
    # Groups die with the graph: no cycle waits for the garbage collector.
    assert live_group_count() == 0
    assert current_group() is None  # ops after the last layer (norm, head, loss) belong to no group
    stats = hyperac.swap_stats(model)
    assert stats.skipped["last_layer"] > 0 and stats.waits > 0 and stats.wait_seconds >= 0


def test_mixed_plan_chains_across_modes(llama, llama_loss):
    layers = {"model.layers": {0: "swap", 1: "full", 2: "selective"}}
    reference = train_step(copy.deepcopy(llama), llama_loss)
    model = swapped(llama, layers=layers, swap_inputs=True, swap_selective_outputs=True)
    assert [row.swap for row in hyperac.applied_plan(model).layers] == [True, True, False]
    for _ in range(2):
        assert_parity(reference, train_step(model, llama_loss))
    assert_round_trip(model)


# --- B.9.2: tensors shared by several layers ---


@pytest.mark.parametrize("plan", CORE_PLANS)
def test_tensor_shared_by_every_layer(plan):
    """``sigmoid(embedding)`` reaches every block positionally (each recompute keeps it as an input,
    each swap-mode block saves it), a table as a keyword: swapping one layer's copy must not touch
    the others', and neither may lose its storage."""
    base = make_net(extras=True)
    loss_fn = net_loss()
    reference_model = copy.deepcopy(base)
    reference = train_step(reference_model, loss_fn)
    expected = [t.detach().clone() for t in reference_model.extras_seen]

    model = swapped(base, **PLANS[plan])
    model.train()
    model.zero_grad()
    torch.manual_seed(1)
    loss = loss_fn(model)
    assert_intact(model.extras_seen, expected)  # between forward and backward
    loss.backward()
    assert_intact(model.extras_seen, expected)
    assert_parity(reference, (loss.detach(), grads(model)))
    assert_round_trip(model)
    stats = hyperac.swap_stats(model)
    if plan in INPUT_PLANS:
        # The model still holds it when each group loads: backward rebuilds the saved tensors on
        # it instead of reloading a second copy.
        assert stats.skipped["shared"] > 0


def test_llama_rotary_tables_stay_on_device_in_swap_mode(llama, llama_loss):
    """Every layer saves the rotary cos/sin tables; still alive when each group loads, they are used
    in place (shared) rather than reloaded; the rest comes back from host memory."""
    model = swapped(llama, mode="swap")
    assert_parity(train_step(copy.deepcopy(llama), llama_loss), train_step(model, llama_loss))
    stats = hyperac.swap_stats(model)
    assert stats.skipped["shared"] > 0
    assert_round_trip(model)


# --- B.9.3: tensors that escape the layer ---


@pytest.mark.parametrize("plan", CORE_PLANS)
def test_llama_hidden_states_returned_to_the_user(llama, plan):
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def run(model):
        model.train()
        torch.manual_seed(1)
        out = model(input_ids=ids, labels=ids, output_hidden_states=True)
        return out, [h.detach().clone() for h in out.hidden_states]

    reference_model = copy.deepcopy(llama)
    reference_out, expected = run(reference_model)
    reference_out.loss.backward()

    model = swapped(llama, **PLANS[plan])
    out, _ = run(model)
    for hidden, want in zip(out.hidden_states, expected, strict=True):
        assert torch.equal(hidden, want)
    out.loss.backward()
    assert_intact(out.hidden_states, expected)
    assert_parity((reference_out.loss.detach(), grads(reference_model)), (out.loss.detach(), grads(model)))
    stats = hyperac.swap_stats(model)
    assert stats.reloaded_bytes == stats.offloaded_bytes
    if plan == "full+inputs":
        # Every layer input is also a returned hidden state: nothing to free by moving it.
        assert stats.skipped["shared"] == 2 and stats.offloaded_bytes == 0


@pytest.mark.parametrize("plan", CORE_PLANS)
def test_layer_outputs_returned_to_the_user(net, plan):
    loss_fn = net_loss()
    reference_model = copy.deepcopy(net)
    reference_model.train()
    torch.manual_seed(1)
    reference_hidden = []
    reference_loss = loss_fn(reference_model, hidden=reference_hidden)
    reference_loss.backward()
    expected = [h.detach().clone() for h in reference_hidden]

    model = swapped(net, **PLANS[plan])
    model.train()
    torch.manual_seed(1)
    hidden = []
    loss = loss_fn(model, hidden=hidden)
    assert_intact(hidden, expected)
    loss.backward()
    assert_intact(hidden, expected)
    assert_parity((reference_loss.detach(), grads(reference_model)), (loss.detach(), grads(model)))


def test_mixtral_router_logits_recorded_by_hooks():
    """HF records each layer's router logits with a hook; they are a kept matmul output that is in
    no layer's output. Resizing them away would break the auxiliary loss after the last layer."""
    base = tiny_mixtral(num_layers=2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(model):
        model.train()
        model.zero_grad()
        torch.manual_seed(1)
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
        logits = [t.detach().clone() for t in out.router_logits]
        out.loss.backward()
        return out, logits

    reference_out, reference_logits = step(copy.deepcopy(base))
    model = swapped(base, mode="selective", swap_selective_outputs=True)
    out, logits = step(model)
    assert torch.equal(out.aux_loss, reference_out.aux_loss)
    assert_intact(out.router_logits, reference_logits)
    assert all(torch.equal(a, b) for a, b in zip(logits, reference_logits, strict=True))
    stats = hyperac.swap_stats(model)
    assert stats.skipped["shared"] > 0
    assert_round_trip(model)


class TappedBlock(Block):
    """``fc1`` carries a forward hook that records its output (a kept op output), as HF's output
    recorders do."""

    def __init__(self, width: int) -> None:
        super().__init__(width)
        self.recorded = []
        self.fc1.register_forward_hook(self.record)

    def record(self, module, args, output):
        self.recorded.append(output)

    def forward(self, x, shared=None, *, scale=None):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


def test_kept_output_recorded_by_a_hook_stays_on_device():
    base = make_net(block=TappedBlock)
    loss_fn = net_loss()
    reference_model = copy.deepcopy(base)
    reference = train_step(reference_model, loss_fn)
    model = swapped(base, mode="selective", swap_selective_outputs=True)
    model.train()
    model.zero_grad()
    torch.manual_seed(1)
    loss = loss_fn(model)
    for block, reference_block in zip(model.blocks, reference_model.blocks, strict=True):
        assert_intact(block.recorded, reference_block.recorded)
    loss.backward()
    assert_parity(reference, (loss.detach(), grads(model)))
    assert hyperac.swap_stats(model).skipped["shared"] >= 2


def test_kept_output_kept_as_a_detached_alias_stays_on_device():
    """Nothing keeps the op output's tensor object alive, only a detached alias of it (another
    tensor object on the same storage): the storage's use count still shows it."""

    class AliasBlock(Block):
        def forward(self, x, shared=None, *, scale=None):
            h = self.fc1(self.norm(x))
            self.alias = h.detach()
            return x + self.fc2(torch.tanh(h))

    base = make_net(block=AliasBlock)
    loss_fn = net_loss()
    reference = train_step(copy.deepcopy(base), loss_fn)
    model = swapped(base, mode="selective", swap_selective_outputs=True)
    model.train()
    torch.manual_seed(1)
    loss = loss_fn(model)
    aliases = [block.alias.clone() for block in model.blocks]
    loss.backward()
    assert_intact([block.alias for block in model.blocks], aliases)
    assert_parity(reference, (loss.detach(), grads(model)))
    assert hyperac.swap_stats(model).skipped["shared"] > 0


# --- B.9.4 and B.9.5: views, slices, transposes, expanded and non-contiguous tensors ---


class ViewBlock(nn.Module):
    """Saves many views of one storage for backward: slices with equal shapes at different
    offsets, a slice with another shape, a transpose, an expanded (stride-0) tensor and a
    non-contiguous strided slice."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, 2 * width)

    def forward(self, x):
        batch, seq, width = x.shape
        h = self.proj(x)
        left, right = h[..., :width], h[..., width:]
        head = h[:, : seq // 2]
        turned = h.transpose(1, 2)
        spread = h.mean(1, keepdim=True).expand(batch, seq, 2 * width)
        strided = h[:, ::2, ::3]
        y = left * right
        y = y + (head * head).sum(1, keepdim=True)[..., :width]
        y = y + (turned * turned.flip(-1)).transpose(1, 2)[..., width:]
        y = y + (spread * h)[..., :width]
        return x + y + (strided * strided).mean()


def test_views_slices_transposes_and_expanded_tensors():
    base = make_net(num_layers=2, block=ViewBlock)
    loss_fn = net_loss()
    reference_model = copy.deepcopy(base)
    reference = train_step(reference_model, loss_fn)
    model = swapped(base, mode="swap")
    assert_parity(reference, train_step(model, loss_fn))
    assert_round_trip(model)

    # Only block 0 offloads (block 1 is the last swapping layer). Each storage moves once, whole,
    # however many views of it were saved.
    ids = token_batch()[:, :-1]
    x = reference_model.embed(ids)
    _, saved = saved_for_backward(lambda: reference_model.blocks[0](x))
    swappable = [t for t in saved if manager(model).ineligible(t) is None]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in swappable}
    assert len(swappable) > len(storages) >= 3
    assert any(0 in t.stride() for t in swappable) and any(not t.is_contiguous() for t in swappable)
    stats = hyperac.swap_stats(model)
    assert stats.offloaded_bytes == sum(storages.values())
    assert stats.offloaded_tensors == len(swappable)


# --- B.9.1: the schedule must not depend on each layer running once, forward then backward ---


@pytest.mark.parametrize("order", [[0, 1, 0, 2], [0, 1, 2, 2]], ids=["shared-middle", "shared-last"])
@pytest.mark.parametrize("plan", CORE_PLANS)
def test_module_called_twice(plan, order):
    base = make_net(order=order)
    loss_fn = net_loss()
    reference = train_step(copy.deepcopy(base), loss_fn)
    model = swapped(base, **PLANS[plan])
    for _ in range(2):  # every op checked against the copies (tests/test_swap_device.py does so for each plan)
        assert_parity(reference, checked_step(model, loss_fn))
    assert_round_trip(model)


@pytest.mark.parametrize("plan", CORE_PLANS)
def test_gradient_accumulation_one_backward_over_summed_losses(net, plan):
    losses = [net_loss(seed=seed) for seed in range(3)]

    def step(model):
        model.train()
        model.zero_grad()
        torch.manual_seed(1)
        total = sum(loss_fn(model) for loss_fn in losses)
        total.backward()
        return total.detach(), grads(model)

    reference = step(copy.deepcopy(net))
    model = swapped(net, **PLANS[plan])
    assert_parity(reference, step(model))
    assert_round_trip(model)


@pytest.mark.parametrize("backward_order", ["in-order", "reversed"])
@pytest.mark.parametrize("plan", CORE_PLANS)
def test_gradient_accumulation_separate_backwards(net, plan, backward_order):
    first, second = net_loss(seed=0), net_loss(seed=1)

    def step(model):
        model.train()
        model.zero_grad()
        torch.manual_seed(1)
        losses = [first(model), second(model)]
        for loss in losses if backward_order == "in-order" else losses[::-1]:
            loss.backward()
        return torch.stack(losses).detach(), grads(model)

    reference = step(copy.deepcopy(net))
    model = swapped(net, **PLANS[plan])
    assert_parity(reference, step(model))
    assert_round_trip(model)


@pytest.mark.parametrize("plan", CORE_PLANS)
def test_forward_never_backwarded_then_a_normal_step(net, plan):
    loss_fn = net_loss()
    reference = train_step(copy.deepcopy(net), loss_fn)
    model = swapped(net, **PLANS[plan])
    pool = manager(model).pool
    assert_parity(reference, train_step(model, loss_fn))
    stats = hyperac.swap_stats(model)
    sizes = []
    for _ in range(4):
        model.train()
        logged = loss_fn(model).detach()  # e.g. a loss computed for logging only
        del logged
        offloaded, reloaded = stats.offloaded_bytes, stats.reloaded_bytes
        assert_parity(reference, train_step(model, loss_fn))
        # The next step swaps as usual (no state left waiting for a backward that never came).
        assert stats.offloaded_bytes - offloaded == stats.reloaded_bytes - reloaded > 0
        sizes.append(pool.allocated_bytes)
    assert len(set(sizes)) == 1, f"host pool grows: {sizes}"

    # The un-backwarded graph kept alive across a step (held for logging) costs one step of host
    # memory, no more, and nothing of it is loaded back.
    model.train()
    held = loss_fn(model)
    reloaded, offloaded = stats.reloaded_bytes, stats.offloaded_bytes
    assert_parity(reference, train_step(model, loss_fn))
    assert stats.reloaded_bytes - reloaded == stats.offloaded_bytes - offloaded
    del held
    gc.collect()
    assert live_group_count() == 0
    assert pool.allocated_bytes <= 2 * sizes[0]
    assert not manager(model).copy_stream().pending


@pytest.mark.parametrize("plan", CORE_PLANS)
def test_eval_forward_between_training_steps(net, plan):
    loss_fn = net_loss()
    reference_model = copy.deepcopy(net)
    model = swapped(net, **PLANS[plan])
    ids = token_batch(seed=3)[:, :-1]
    assert_parity(train_step(reference_model, loss_fn), train_step(model, loss_fn))
    stats = hyperac.swap_stats(model)
    before = (stats.offloaded_bytes, stats.reloaded_bytes, sum(stats.skipped.values()))
    reference_model.eval()
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids), reference_model(ids))
    assert torch.equal(model(ids), reference_model(ids))  # eval mode, grad enabled
    model.train()
    reference_model.train()
    with torch.no_grad():
        assert torch.equal(model(ids), reference_model(ids))  # training mode, no grad
    assert (stats.offloaded_bytes, stats.reloaded_bytes, sum(stats.skipped.values())) == before
    assert_parity(train_step(reference_model, loss_fn), train_step(model, loss_fn))
    assert_round_trip(model)


@pytest.mark.parametrize("plan", PLANS)
def test_backward_twice_with_retain_graph(net, plan):
    loss_fn = net_loss()

    def step(model):
        model.train()
        model.zero_grad()
        torch.manual_seed(1)
        loss = loss_fn(model)
        loss.backward(retain_graph=True)
        once = grads(model)
        loss.backward(retain_graph=True)
        return loss, once, grads(model)

    reference_loss, reference_once, reference_twice = step(copy.deepcopy(net))
    model = swapped(net, **PLANS[plan])
    loss, once, twice = step(model)
    assert_parity((reference_loss.detach(), reference_once), (loss.detach(), once))
    assert_parity((reference_loss.detach(), reference_twice), (loss.detach(), twice))
    for name, grad in once.items():
        assert torch.equal(twice[name], 2 * grad)
    assert_round_trip(model)  # loaded once, used twice
    # The graph is still held: every tensor it (or anyone) holds has its storage.
    assert freed_storage_tensors() == []
    del loss


@pytest.mark.parametrize("plan", CORE_PLANS)
def test_exception_in_the_middle_of_a_forward(net, plan):
    loss_fn = net_loss()
    reference = train_step(copy.deepcopy(net), loss_fn)
    model = swapped(net, **PLANS[plan])
    mgr = manager(model)
    assert_parity(reference, train_step(model, loss_fn))
    sizes = []
    for _ in range(3):
        model.blocks[1].fail = True
        model.train()
        with pytest.raises(RuntimeError, match="failed on purpose") as failure:
            loss_fn(model)
        assert current_group() is None
        model.blocks[1].fail = False
        # The traceback still holds the abandoned graph: the next step must not prefetch from it.
        stats = hyperac.swap_stats(model)
        reloaded, offloaded = stats.reloaded_bytes, stats.offloaded_bytes
        assert_parity(reference, train_step(model, loss_fn))
        assert stats.reloaded_bytes - reloaded == stats.offloaded_bytes - offloaded
        del failure
        gc.collect()
        assert live_group_count() == 0
        sizes.append(mgr.pool.allocated_bytes)
    assert len(set(sizes)) == 1
    assert not mgr.copy_stream().pending and not mgr.copy_stream().faults


@pytest.mark.parametrize("drop_waits", [False, True], ids=["as-is", "without-the-drop-wait"])
def test_backward_that_stops_early_drains_the_prefetch(net, drop_waits, monkeypatch):
    """``autograd.grad`` up to the first block's output: block 0's group was prefetched but its
    backward never runs. Dropped with its load in flight, it must wait for it first, or the copy
    lands in freed device memory (on a GPU: in whatever the allocator gave that memory to next)."""
    if drop_waits:
        monkeypatch.setattr(SwapGroup, "__del__", lambda group: None)
    model = swapped(net, mode="full", swap_inputs=True)
    model.train()
    hidden = []
    loss = net_loss()(model, hidden=hidden)
    (gradient,) = torch.autograd.grad(loss, hidden[0])
    assert gradient.abs().sum() > 0
    stats = hyperac.swap_stats(model)
    assert stats.reloaded_bytes == stats.offloaded_bytes > 0  # group 0 was prefetched
    del loss, hidden
    gc.collect()
    assert live_group_count() == 0
    stream = manager(model).copy_stream()
    stream.synchronize()
    assert bool(stream.faults) == drop_waits, stream.faults


def test_two_models_do_not_share_swap_state():
    first, second = make_net(), make_net(num_layers=4, width=48)
    loss_first, loss_second = net_loss(seed=0), net_loss(seed=1, vocab=64)
    references = train_step(copy.deepcopy(first), loss_first), train_step(copy.deepcopy(second), loss_second)
    alone = []
    for base, loss_fn, options in ((first, loss_first, PLANS["full+inputs"]), (second, loss_second, PLANS["swap"])):
        model = swapped(base, **options)
        train_step(model, loss_fn)
        stats = hyperac.swap_stats(model)
        alone.append((stats.offloaded_bytes, stats.reloaded_bytes, dict(stats.skipped)))

    a, b = swapped(first, **PLANS["full+inputs"]), swapped(second, **PLANS["swap"])
    assert hyperac.swap_stats(a) is not hyperac.swap_stats(b)
    assert manager(a).pool is not manager(b).pool
    for model in (a, b):
        model.train()
        model.zero_grad()
    torch.manual_seed(1)
    loss_a = loss_first(a)
    torch.manual_seed(1)
    loss_b = loss_second(b)  # interleaved: a's forward, b's forward, b's backward, a's backward
    loss_b.backward()
    loss_a.backward()
    assert manager(a).copy_stream() is not manager(b).copy_stream()
    assert_parity(references[0], (loss_a.detach(), grads(a)))
    assert_parity(references[1], (loss_b.detach(), grads(b)))
    for model, expected in zip((a, b), alone, strict=True):
        stats = hyperac.swap_stats(model)
        assert (stats.offloaded_bytes, stats.reloaded_bytes, dict(stats.skipped)) == expected


# --- B.9.7 and B.9.10: teardown and leaks ---


def test_500_apply_step_remove_or_drop_cycles_leave_nothing():
    """Nothing is left behind, and a cycle late in the run does the work one early in it does:
    hyperac lines run, summed over a period of the six kinds of cycle (the same plan, applied to
    ``base`` or a copy), a few percent apart at most (the collector's finalizers run in any cycle)."""
    base = make_net(num_layers=2)
    loss_fn = net_loss()
    plans = [PLANS["full+inputs"], PLANS["swap"], PLANS["selective+outputs"]]
    managers, dropped = [], []
    lines = collections.Counter()
    early, late = range(6, 12), range(492, 498)  # the six kinds of cycle, in the same order
    for cycle in range(500):
        period = "early" if cycle in early else "late" if cycle in late else None
        with hyperac_lines(lines, period) if period else contextlib.nullcontext():
            model = base if cycle % 2 == 0 else copy.deepcopy(base)
            hyperac.apply(model, layers="blocks", **SIM, **plans[cycle % 3])
            managers.append(manager(model))
            model.train()
            loss_fn(model).backward()
            if cycle % 2 == 0:
                hyperac.remove(model)
                assert hook_count(model) == 0
            else:
                dropped.append(weakref.ref(model))
            del model
    gc.collect()
    assert 0 < lines["late"] <= 1.05 * lines["early"], f"work grows per cycle: {lines}"
    assert live_group_count() == 0
    assert [ref for ref in dropped if ref() is not None] == []
    assert sum(m.pool.allocated_bytes for m in managers) == 0
    assert all(not m.pool._free for m in managers)
    assert hook_count(base) == 0 and hyperac.applied_plan(base) is None
    base.zero_grad()


def test_remove_frees_the_pool_while_a_graph_is_still_held(net):
    """A graph made before ``remove`` can still run backward; its host buffers are dropped, not
    pooled, when it is done."""
    loss_fn = net_loss()
    reference = train_step(copy.deepcopy(net), loss_fn)
    model = swapped(net, mode="swap")
    mgr = manager(model)
    model.train()
    model.zero_grad()
    torch.manual_seed(1)
    loss = loss_fn(model)
    hyperac.remove(model)
    assert mgr.pool.allocated_bytes == 0 and hook_count(model) == 0
    loss.backward()
    assert_parity(reference, (loss.detach(), grads(model)))
    assert mgr.stats.reloaded_bytes == mgr.stats.offloaded_bytes > 0
    del loss
    assert not mgr.pool._free and mgr.pool.allocated_bytes == 0


# --- What swap saves, measured ---


def test_swap_inputs_frees_every_offloaded_layer_input():
    base = make_net(num_layers=4, width=64)
    loss_fn = net_loss(batch=4, seq=16)
    kept, _ = measure(swapped(base, mode="full"), loss_fn)  # same plan without swap
    model = swapped(base, mode="full", swap_inputs=True)
    with_swap, _ = measure(model, loss_fn)
    stats = hyperac.swap_stats(model)
    layer_input = 4 * 16 * 64 * 4
    assert stats.offloaded_bytes >= 3 * layer_input  # every layer but the last
    assert kept - with_swap >= stats.offloaded_bytes
    assert stats.skipped["last_layer"] == 1


def test_llama_swap_inputs_frees_what_it_offloads(llama, llama_loss):
    kept, _ = measure(swapped(llama, mode="full"), llama_loss)
    model = swapped(llama, mode="full", swap_inputs=True)
    with_swap, _ = measure(model, llama_loss)
    offloaded = hyperac.swap_stats(model).offloaded_bytes
    assert offloaded >= 2 * 2 * 16 * 64 * 4
    assert kept - with_swap >= offloaded


@pytest.mark.parametrize("mode", ["selective", "pointwise"])
def test_selective_outputs_leave_the_device_and_come_back(net, mode, monkeypatch):
    loss_fn = net_loss(batch=4, seq=16)
    kept, _ = measure(swapped(net, mode=mode), loss_fn)
    model = swapped(net, mode=mode, swap_selective_outputs=True)
    with_swap, _ = measure(model, loss_fn)
    stats = hyperac.swap_stats(model)
    assert kept - with_swap >= stats.offloaded_bytes > 0
    assert_round_trip(model)

    # Between forward and backward the kept outputs' storages are resized to zero; the replay
    # finds them restored, and the gradients are exact.
    resized = []
    real_finish = SwapGroup.finish_offload

    def finish(group):
        real_finish(group)
        resized.extend(e.device_bytes for e in group.entries.values() if e.in_place)

    reference = train_step(copy.deepcopy(net), loss_fn)
    model = swapped(net, mode=mode, swap_selective_outputs=True)
    monkeypatch.setattr(SwapGroup, "finish_offload", finish)
    model.train()
    model.zero_grad()
    torch.manual_seed(1)
    loss = loss_fn(model)
    assert resized and all(t.untyped_storage().nbytes() == 0 for t in resized)
    loss.backward()
    assert all(t.untyped_storage().nbytes() == t.numel() for t in resized)
    assert_parity(reference, (loss.detach(), grads(model)))
    resized.clear()
    del loss
    assert freed_storage_tensors() == []


class OutputIsKeptBlock(nn.Module):
    """Returns its only matmul's output: the kept op output is the layer output."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x):
        return self.fc(torch.tanh(x))


def test_kept_output_that_is_the_layer_output_stays_on_device():
    base = make_net(block=OutputIsKeptBlock)
    loss_fn = net_loss()
    reference_model = copy.deepcopy(base)
    reference_hidden = []
    reference_model.train()
    torch.manual_seed(1)
    reference_loss = loss_fn(reference_model, hidden=reference_hidden)
    reference_loss.backward()

    model = swapped(base, mode="selective", swap_selective_outputs=True)
    model.train()
    torch.manual_seed(1)
    hidden = []
    loss = loss_fn(model, hidden=hidden)
    assert_intact(hidden, [h.detach() for h in reference_hidden])
    loss.backward()
    assert_parity((reference_loss.detach(), grads(reference_model)), (loss.detach(), grads(model)))
    stats = hyperac.swap_stats(model)
    assert stats.skipped["shared"] >= 2
    assert stats.reloaded_bytes == stats.offloaded_bytes


def test_swap_selective_outputs_alone_keeps_layer_inputs_on_device(net):
    loss_fn = net_loss()
    outputs_only = swapped(net, mode="selective", swap_selective_outputs=True)
    both = swapped(net, mode="selective", swap_selective_outputs=True, swap_inputs=True)
    train_step(outputs_only, loss_fn)
    train_step(both, loss_fn)
    assert hyperac.swap_stats(outputs_only).offloaded_bytes < hyperac.swap_stats(both).offloaded_bytes


# --- The sim backend itself ---


def test_sim_copy_lands_only_when_its_event_is_waited_on():
    backend = hyperac.get_backend("sim")
    stream = backend.new_stream()
    source, first, second = torch.arange(4.0), torch.zeros(4), torch.zeros(4)
    stream.wait_stream(backend.current_stream())
    with backend.use_stream(stream):
        backend.copy_(first, source)
        event = backend.new_event()
        event.record()  # on the current stream: the side stream
        backend.copy_(second, source)
    assert torch.equal(first, torch.zeros(4)) and not event.query()
    source.add_(10)  # the copy reads its source when it lands, as a late one would on a GPU
    backend.wait(event)
    assert torch.equal(first, source) and event.query()
    assert torch.equal(second, torch.zeros(4)), "a copy queued after the event landed with it"
    backend.synchronize()
    assert torch.equal(second, source) and not stream.pending
    plain = torch.zeros(4)
    backend.copy_(plain, source)  # the compute stream runs at once
    assert torch.equal(plain, source)


def side_copy(backend, destination, source):
    """Queue ``destination <- source`` on a new side stream ordered after compute; return the stream."""
    stream = backend.new_stream()
    stream.wait_stream(backend.current_stream())
    with backend.use_stream(stream):
        backend.copy_(destination, source)
    return stream


def test_sim_copy_holds_neither_end_alive():
    """As on a GPU: a source freed before the copy lands gives garbage, a destination freed before
    it lands is a write into freed memory (recorded as a fault)."""
    backend = hyperac.get_backend("sim")
    source, destination = torch.arange(4.0), torch.zeros(4)
    stream = side_copy(backend, destination, source)
    del source
    stream.synchronize()
    assert destination.isnan().all()
    resized = torch.arange(4.0)
    stream.wait_stream(backend.current_stream())
    with backend.use_stream(stream):
        backend.copy_(destination, resized)
    resized.untyped_storage().resize_(0)
    stream.synchronize()
    assert destination.isnan().all()
    stream.wait_stream(backend.current_stream())
    with backend.use_stream(stream):
        backend.copy_(torch.zeros(4), torch.arange(4.0))  # the destination dies at once
    assert not stream.faults
    stream.synchronize()
    assert len(stream.faults) == 1 and "freed" in stream.faults[0]


@pytest.mark.parametrize("plan", CORE_PLANS)
def test_a_missing_wait_is_caught(net, plan, monkeypatch):
    """Fill each host buffer and each reloaded device buffer with NaN bits until its copy lands:
    with the waits, gradients are exact; without them, they are not."""
    loss_fn = net_loss()
    reference = train_step(copy.deepcopy(net), loss_fn)
    real_close, real_load = SwapGroup.close, SwapGroup.start_load

    def close(group, protected):
        real_close(group, protected)
        for entry in group.entries.values():
            if entry.host is not None:
                entry.host.fill_(255)

    def start_load(group):
        loading = group.state in (GroupState.COPYING, GroupState.HOST)
        real_load(group)
        if loading:
            for entry in group.entries.values():
                entry.device_bytes.fill_(255)

    monkeypatch.setattr(SwapGroup, "close", close)
    monkeypatch.setattr(SwapGroup, "start_load", start_load)
    model = swapped(net, **PLANS[plan])
    assert_parity(reference, train_step(model, loss_fn))
    assert_round_trip(model)

    monkeypatch.setattr(SwapManager, "wait", lambda self, event, stream: None)
    model = swapped(net, **PLANS[plan])
    _, broken = train_step(model, loss_fn)
    assert any(not torch.equal(broken[name], grad) for name, grad in reference[1].items())


def test_compute_read_before_the_load_is_waited_names_both_ops():
    backend = hyperac.get_backend("sim")
    source, destination = torch.arange(4.0), torch.zeros(4)
    side = side_copy(backend, destination, source)
    done = backend.new_event()
    done.record(side)
    with pytest.raises(SimRaceError, match=r"aten.add.Tensor \(compute\) on sim:0 compute reads a buffer that "
                       r"copy #1 on sim:0 side stream \d+ writes"), backend.computing():
        destination + 1
    side.wait_event(done)  # the side stream waiting on its own event orders nothing
    with pytest.raises(SimRaceError), backend.computing():
        destination + 1
    backend.wait(done)
    with backend.computing():
        assert torch.equal(destination + 1, source + 1)


def test_copy_not_ordered_after_compute_names_the_compute_op():
    backend = hyperac.get_backend("sim")
    side = backend.new_stream()
    ready = backend.new_event()
    ready.record(side)  # recorded on the wrong stream
    side.wait_event(ready)
    with backend.use_stream(side), pytest.raises(SimRaceError, match="never waited on an event recorded there"):
        backend.copy_(torch.zeros(4), torch.ones(4))


def _two_saved(backend, stream_of_second):
    """Group 0 saves ``a`` and ``b`` (one ``mul``); unpack ``a`` on the compute stream and ``b`` on
    ``stream_of_second``, then read ``b`` there."""
    mgr = SwapManager(backend, min_swap_bytes=0, host_budget_bytes=1 << 20)
    a, b = (torch.randn(8, requires_grad=True) for _ in range(2))
    out = mgr.run_layer(True, lambda: (a.exp() * b.exp()), ((), {}))
    mgr.run_layer(False, lambda: out.sum(), ((), {}))  # ends group 0's offload
    first = out.grad_fn._saved_self  # the compute stream unpacks first and waits on the load
    with backend.use_stream(stream_of_second):
        second = out.grad_fn._saved_other
        backend.check_read(second, "a read of the second unpacked tensor")
    return first, second, (a, b)


def test_unpack_on_a_second_stream_waits_on_the_load():
    """Autograd may run a node's backward on another stream than the first unpack's: that stream
    must wait on the load too, or it reads the reloaded tensor before the copy lands."""
    backend = hyperac.get_backend("sim")
    first, second, (a, b) = _two_saved(backend, backend.new_stream())
    assert torch.equal(first, a.exp()) and torch.equal(second, b.exp())


def test_group_dropped_while_the_copy_stream_is_current(net):
    """A group dropped by the collector while another stream is current (here the copy stream)
    still makes its own compute stream wait for its copies before its device memory is freed:
    block 0's group is prefetched by a backward that stops before it, then dropped."""
    model = swapped(net, mode="full", swap_inputs=True)
    mgr = manager(model)
    model.train()
    hidden = []
    loss = net_loss()(model, hidden=hidden)
    torch.autograd.grad(loss, hidden[0])
    with mgr.backend.use_stream(mgr.copy_stream()):
        del loss, hidden
        gc.collect()
    assert live_group_count() == 0
    mgr.copy_stream().synchronize()
    assert not mgr.copy_stream().faults


def test_model_on_a_device_that_is_not_current():
    """Device sim:1 is current, the model lives on sim:0: streams, events and waits must be those
    of the tensors' device (a copy on a sim:1 stream of sim:0 memory raises)."""
    loss_fn = net_loss()
    net = make_net()
    reference = train_step(copy.deepcopy(net), loss_fn)
    model = applied_copy(net, backend=SimBackend(current_device=1), layers="blocks", mode="swap", min_swap_bytes=0)[0]
    assert_parity(reference, checked_step(model, loss_fn))
    assert_round_trip(model)
    assert manager(model).copy_stream().device == 0


def test_swap_during_graph_capture_is_refused(net):
    model = swapped(net, mode="swap")
    with manager(model).backend.capturing(), pytest.raises(ConfigError, match="capturing a graph.*without swap"):
        net_loss()(model)
    assert live_group_count() == 0
    loss_fn = net_loss()
    assert_parity(train_step(copy.deepcopy(net), loss_fn), train_step(model, loss_fn))  # fine after it


# --- Budget, in-place changes, odd tensors ---


def test_host_budget_keeps_the_rest_on_device_and_warns_once(net):
    loss_fn = net_loss()
    reference = train_step(copy.deepcopy(net), loss_fn)
    model = swapped(net, mode="swap", host_budget_bytes=4096)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert_parity(reference, train_step(model, loss_fn))
    messages = [str(w.message) for w in caught if issubclass(w.category, HyperACWarning)]
    assert len(messages) == 1 and "host_budget_bytes" in messages[0] and "4096" in messages[0]
    stats = hyperac.swap_stats(model)
    assert stats.skipped["budget"] > 0
    assert_round_trip(model)
    assert manager(model).pool.allocated_bytes <= 4096
    other = swapped(net, mode="swap", host_budget_bytes=4096)
    with pytest.warns(HyperACWarning, match="host budget of 4096 bytes is spent"):  # told about this model too
        train_step(other, loss_fn)


def test_varying_sequence_lengths_keep_offloading_under_a_budget(net, monkeypatch):
    """Steps at lengths 256, 100, 60, 256 under a host budget of 1.5x one length-256 step: the
    shorter steps reuse the long step's buffers, so the second 256 step offloads what the first
    did, and no host buffer is allocated after the first step (NOTE [Host pool size classes])."""
    probe = swapped(net, mode="swap")
    train_step(probe, net_loss(seq=256))
    budget = manager(probe).pool.allocated_bytes * 3 // 2
    model = swapped(net, mode="swap", host_budget_bytes=budget)
    pool, stats = manager(model).pool, hyperac.swap_stats(model)
    allocated = []
    real_host_empty = SimBackend.host_empty
    monkeypatch.setattr(SimBackend, "host_empty", lambda *a, **k: allocated.append(1) or real_host_empty(*a, **k))
    offloaded, allocations = [], []
    for seq in (256, 100, 60, 256):
        stats.reset()
        assert_parity(train_step(copy.deepcopy(net), net_loss(seq=seq)), train_step(model, net_loss(seq=seq)))
        assert stats.skipped["budget"] == 0, (seq, stats)
        assert_round_trip(model)
        offloaded.append(stats.offloaded_bytes)
        allocations.append(len(allocated))
    assert offloaded[3] == offloaded[0] > offloaded[1] > offloaded[2]
    assert allocations == [allocations[0]] * 4, "host buffers were allocated in a step after the first"
    assert pool.allocated_bytes <= budget


def test_pool_serves_from_larger_buffers_and_evicts_idle_ones_on_pressure():
    pool = HostPool(hyperac.get_backend("sim"), budget_bytes=4096)
    held = [pool.acquire(1000) for _ in range(4)]  # 4 x 1024: the budget is spent
    assert pool.acquire(1000) is None
    for buffer in held[1:]:
        pool.release(buffer)
    small = pool.acquire(300)
    assert small.numel() == 1024  # a smaller tensor from a larger free buffer
    assert pool.acquire(3000) is None  # 2 x 1024 in use: evicting the idle two would not make room
    assert sum(len(b) for b in pool._free.values()) == 2 and pool.allocations == 4
    pool.release(held[0])
    pool.release(small)
    assert pool.acquire(3000).numel() == 4096  # the idle 1024 buffers are evicted for it
    assert pool.allocated_bytes == 4096 and pool.allocations == 5 and not any(pool._free.values())


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_default_host_budget_is_bounded_by_the_container_limit(tmp_path, monkeypatch, version):
    """A fake cgroup root (v2 ``memory.max`` or v1 ``memory/memory.limit_in_bytes``) with a limit
    below physical memory bounds the default budget; "max" and v1's huge "unlimited" do not."""
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    folder = tmp_path / ("memory" if version == "v1" else "")
    folder.mkdir(exist_ok=True)
    file = folder / ("memory.limit_in_bytes" if version == "v1" else "memory.max")
    file.write_text("max\n" if version == "v2" else "9223372036854771712\n")
    assert container_memory_limit(str(tmp_path)) is None
    assert default_host_budget(str(tmp_path)) == physical // 2
    file.write_text(f"{1 << 30}\n")
    assert container_memory_limit(str(tmp_path)) == 1 << 30
    assert default_host_budget(str(tmp_path)) == min(physical, 1 << 30) // 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert default_host_budget(str(tmp_path)) == min(physical, 1 << 30) // 8


class InPlaceBlock(Block):
    """Changes a tensor autograd saved (tanh's output) in place before the layer ends."""

    def forward(self, x, shared=None, *, scale=None):
        h = torch.tanh(self.fc1(self.norm(x)))
        out = self.fc2(h)
        h.mul_(2)
        return x + out


def test_in_place_change_of_a_saved_tensor_keeps_autograd_error():
    base = make_net(block=InPlaceBlock)
    loss_fn = net_loss()
    message = (r"modified by an inplace operation: \[torch\.FloatTensor \[16, 64\]\].* "
               r"is at version 1; expected version 0 instead")
    with pytest.raises(RuntimeError, match=message):
        train_step(copy.deepcopy(base), loss_fn)
    model = swapped(base, mode="swap")
    with pytest.raises(RuntimeError, match=message):
        train_step(model, loss_fn)
    assert hyperac.swap_stats(model).skipped["modified"] > 0


class SavesOutputBlock(Block):
    """Ends with ``tanh``, which saves its own output; ``touch_input`` changes its input in place."""

    touch_input = False

    def forward(self, x, shared=None, *, scale=None):
        if self.touch_input:
            x.mul_(1.0)
        return torch.tanh(x + self.fc2(torch.tanh(self.fc1(self.norm(x)))))


@pytest.mark.parametrize("where", ["next-layer", "user-after-forward"])
def test_in_place_change_after_the_layer_ended_still_raises(where):
    """The saved tensor was moved to host memory; the change comes later (the next layer writes its
    input, which the previous layer saved as its output; the user writes a returned hidden state).
    Autograd's own check is off under saved-tensor hooks, so swap must make it."""
    base = make_net(num_layers=4, block=SavesOutputBlock)
    loss_fn = net_loss()

    def step(model):
        model.train()
        model.blocks[2].touch_input = where == "next-layer"
        hidden = []
        loss = loss_fn(model, hidden=hidden)
        if where == "user-after-forward":
            hidden[0].mul_(1.0)
        loss.backward()

    message = (r"modified by an inplace operation: \[torch\.FloatTensor \[2, 8, 32\]\].* "
               r"is at version 1; expected version 0")
    with pytest.raises(RuntimeError, match=message):
        step(copy.deepcopy(base))
    model = swapped(base, mode="swap")
    with pytest.raises(RuntimeError, match=message):
        step(model)
    assert hyperac.swap_stats(model).offloaded_bytes > 0


@pytest.mark.parametrize("min_swap_bytes", [0, 1 << 30], ids=["swapped", "too-small-to-swap"])
def test_graph_never_backwarded_is_freed_without_the_collector(min_swap_bytes):
    """tanh saves its own output. Had the pack hook returned that tensor, the cycle output ->
    grad_fn -> saved -> output would keep the whole graph alive, even through gc."""
    model = swapped(make_net(block=SavesOutputBlock), mode="swap", min_swap_bytes=min_swap_bytes)
    model.train()
    hidden = []
    loss_fn = net_loss()
    loss = loss_fn(model, hidden=hidden)
    outputs = [weakref.ref(h) for h in hidden]
    del loss, hidden
    assert [ref for ref in outputs if ref() is not None] == []
    assert live_group_count() == 0
    gc.collect()
    assert [ref for ref in outputs if ref() is not None] == []


class ComplexBlock(nn.Module):
    """Saves lazily conjugated views (``conj()``) for backward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width, dtype=torch.complex64) / width**0.5)

    def forward(self, x):
        y = x @ self.weight
        return y + y.conj() * y.conj()


class ComplexChain(nn.Module):
    def __init__(self, num_layers: int = 3, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(ComplexBlock(width) for _ in range(num_layers))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x.abs().mean()


def test_conjugate_views_stay_on_device():
    """A tensor rebuilt on reloaded bytes would lose the conjugate bit: wrong gradients, no error."""
    torch.manual_seed(0)
    chain = ComplexChain()
    x = torch.randn(4, 16, dtype=torch.complex64)

    def loss_fn(model):
        return model(x)

    reference = train_step(copy.deepcopy(chain), loss_fn)
    model = swapped(chain, mode="swap", layers="blocks")
    assert_parity(reference, train_step(model, loss_fn))
    assert hyperac.swap_stats(model).skipped["layout"] > 0


class SparseBlock(Block):
    """Multiplies by a sparse matrix, which autograd saves for backward."""

    def forward(self, x, shared=None, *, scale=None):
        h = self.fc1(self.norm(x))
        mixer = torch.eye(h.shape[-1]).to_sparse()
        mixed = torch.sparse.mm(mixer, h.flatten(0, 1).T).T.reshape(h.shape)
        return x + self.fc2(torch.tanh(mixed))


def test_sparse_saved_tensor_stays_on_device():
    base = make_net(block=SparseBlock)
    loss_fn = net_loss()
    reference = train_step(copy.deepcopy(base), loss_fn)
    model = swapped(base, mode="swap")
    assert_parity(reference, train_step(model, loss_fn))
    assert hyperac.swap_stats(model).skipped["layout"] > 0
    assert_round_trip(model)


def test_small_tensors_and_parameters_stay_on_device(net):
    model = swapped(net, mode="swap", min_swap_bytes=1 << 30)
    loss_fn = net_loss()
    assert_parity(train_step(copy.deepcopy(net), loss_fn), train_step(model, loss_fn))
    stats = hyperac.swap_stats(model)
    assert stats.offloaded_bytes == 0 and stats.skipped["small"] > 0 and stats.skipped["parameter"] > 0


def test_stats_reset_keeps_timing_waits(net):
    """Waits are timed on the sim's virtual clock (NOTE [The virtual clock]): compute takes no time
    here, so no copy hides and a step waits exactly the link time of the bytes it moved both ways."""
    link = 2**20  # bytes/s: a whole number of ticks per byte
    model = swapped(net, mode="swap", backend=SimBackend(link))
    train_step(model, net_loss())
    stats = hyperac.swap_stats(model)
    stats.reset()
    assert stats == SwapStats(wait_seconds=0.0)
    train_step(model, net_loss())
    assert stats.waits > 0 and stats.wait_seconds == (stats.offloaded_bytes + stats.reloaded_bytes) / link > 0
    assert "swap: offloaded" in str(stats)


# --- Where swap cannot run, and bad options ---


@pytest.mark.parametrize("options", [dict(mode="full", swap_inputs=True), dict(mode="swap"),
                                     dict(mode="selective", swap_selective_outputs=True)])
def test_cpu_backend_warns_once_per_apply_and_keeps_tensors(net, options):
    with pytest.warns(HyperACWarning, match="no effect on the 'cpu' backend") as caught:
        model, plan = applied_copy(net, backend="cpu", layers="blocks", min_swap_bytes=0, **options)
    assert len([w for w in caught if issubclass(w.category, HyperACWarning)]) == 1
    assert not any(row.swap for row in plan.layers)
    assert hyperac.swap_stats(model) is None
    with pytest.warns(HyperACWarning, match="no effect on the 'cpu' backend") as caught:
        applied_copy(net, backend="cpu", layers="blocks", **options)  # another model is told too
    assert len([w for w in caught if issubclass(w.category, HyperACWarning)]) == 1
    loss_fn = net_loss()
    assert_parity(train_step(copy.deepcopy(net), loss_fn), train_step(model, loss_fn))


def test_compile_with_swap_warns_and_disables(net):
    with pytest.warns(HyperACWarning, match="compile=True"):
        model, plan = applied_copy(net, backend="sim", layers="blocks", mode="full", swap_inputs=True, compile=True)
    assert not any(row.swap for row in plan.layers)
    assert hyperac.swap_stats(model) is None
    assert any("compile=True" in note for note in plan.notes)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(min_swap_bytes=True), r"Config\.min_swap_bytes must be a byte count >= 0, got True"),
        (dict(min_swap_bytes=1.5), r"Config\.min_swap_bytes must be a byte count >= 0, got 1\.5"),
        (dict(min_swap_bytes="1MiB"), r"Config\.min_swap_bytes must be a byte count >= 0, got '1MiB'"),
        (dict(min_swap_bytes=-1), r"Config\.min_swap_bytes must be a byte count >= 0, got -1"),
        (dict(min_swap_bytes=None), r"Config\.min_swap_bytes must be a byte count >= 0, got None"),
        (dict(host_budget_bytes=False), r"Config\.host_budget_bytes must be a byte count >= 0 or None, got False"),
        (dict(host_budget_bytes=2.0), r"Config\.host_budget_bytes must be a byte count >= 0 or None, got 2\.0"),
        (dict(host_budget_bytes="8GiB"), r"Config\.host_budget_bytes must be .* got '8GiB'"),
        (dict(host_budget_bytes=-4096), r"Config\.host_budget_bytes must be .* got -4096"),
        (dict(mode="off", swap_inputs=True), r"swap_inputs=True needs layers that recompute.*use mode='swap'"),
        (dict(mode="swap", swap_inputs=True), r"swap_inputs=True needs layers that recompute.*use mode='swap'"),
        (dict(mode="full", swap_selective_outputs=True), r"swap_selective_outputs=True needs selective layers"),
        (dict(mode="off", layers={0: "full"}, swap_selective_outputs=True),
         r"swap_selective_outputs=True needs selective layers"),
        (dict(swap_inputs=1), r"Config\.swap_inputs must be a bool"),
        (dict(swap_selective_outputs="yes"), r"Config\.swap_selective_outputs must be a bool"),
    ],
)
def test_bad_swap_options_raise_config_error(net, options, match):
    with pytest.raises(ConfigError, match=match):
        hyperac.Config(**options)
    model = copy.deepcopy(net)
    with pytest.raises(ConfigError, match=match):
        hyperac.apply(model, backend="sim", **{"layers": "blocks", **options})
    assert hyperac.applied_plan(model) is None and hook_count(model) == 0


def test_group_states_through_one_step(net, monkeypatch):
    """Each layer invocation's group: copied out after its forward (the last one, whose backward comes
    first, keeps its tensors), loaded back in backward."""
    groups = []
    real_close = SwapGroup.close

    def close(group, protected):
        real_close(group, protected)
        groups.append(group)

    monkeypatch.setattr(SwapGroup, "close", close)
    model = swapped(net, mode="swap")
    loss = net_loss()(model)
    after_forward = [group.state for group in groups]
    loss.backward()
    assert len(groups) == len(net.blocks)
    assert after_forward[-1] is GroupState.KEPT
    assert set(after_forward[:-1]) <= {GroupState.COPYING, GroupState.HOST}
    assert [group.state for group in groups] == [GroupState.LOADED] * (len(groups) - 1) + [GroupState.KEPT]
    assert_round_trip(model)
