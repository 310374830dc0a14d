"""Every random source a region's forward drew from is replayed (design invariant 15): generators a
kept op moved, tagged or not (NOTE [Kept ops that draw random numbers]), and registered RNG trackers
(NOTE [RNG trackers])."""

import copy
import sys
import types

import pytest
import torch
from hyperac_testing import CpuRNGStatesTracker, Stack, assert_parity, train_step
from torch import nn

import hyperac
from hyperac.replay.random_sources import draws_since, watch_generators

RECOMPUTING = ("full", "selective", "selective-even", "pointwise")


def _attention_probs(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)


@torch.library.custom_op("hyperac_test::dropout_attention", mutates_args=())
def dropout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention kernel with dropout registered without ``torch.Tag.nondeterministic_seeded``, as a
    vendor's fused attention (torch_npu's ``npu_fusion_attention_v3`` with ``keep_prob``) or a custom
    kernel is: it draws its mask from the default generator. Returns the output and the kept mask."""
    keep = (torch.rand(q.shape[:-1] + k.shape[-2:-1]) >= p).to(q.dtype) / (1 - p)
    return (_attention_probs(q, k) * keep) @ v, keep


@dropout_attention.register_fake
def _(q, k, v, p):
    return torch.empty_like(q), q.new_empty(q.shape[:-1] + k.shape[-2:-1])


def _setup(ctx, inputs, output):
    q, k, v, _ = inputs
    ctx.save_for_backward(q, k, v, output[1])


def _backward(ctx, grad, grad_keep):
    q, k, v, keep = ctx.saved_tensors
    probs = _attention_probs(q, k)
    grad_v = (probs * keep).transpose(-1, -2) @ grad
    grad_probs = (grad @ v.transpose(-1, -2)) * keep
    grad_scores = probs * (grad_probs - (grad_probs * probs).sum(-1, keepdim=True)) * q.shape[-1] ** -0.5
    return grad_scores @ k, grad_scores.transpose(-1, -2) @ q, grad_v, None


dropout_attention.register_autograd(_backward, setup_context=_setup)


class DropoutAttentionBlock(nn.Module):
    """The untagged attention kernel, then a projection and an ``nn.Dropout`` drawing after it."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h, _ = dropout_attention(q, k, v, 0.2)
        return x + self.drop(self.out(h))


def _loss():
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    return lambda model: model(x).pow(2).sum()


@pytest.mark.parametrize("mode", RECOMPUTING)
def test_kept_untagged_random_kernel_then_dropout_is_bitwise(mode):
    """The kept kernel does not run in the replay; the dropout after it must still draw the forward's
    mask, although the kernel carries no tag saying it draws (issue 25)."""
    assert torch.Tag.nondeterministic_seeded not in torch.ops.hyperac_test.dropout_attention.default.tags
    model, loss_fn = Stack(DropoutAttentionBlock), _loss()
    reference = copy.deepcopy(model)
    kept = None if mode == "full" else ["hyperac_test::dropout_attention", "aten::addmm"]
    hyperac.apply(model, mode=mode, layers="blocks", backend="cpu", save_ops=kept)
    for seed in (1, 2):
        assert_parity(train_step(reference, loss_fn, seed), train_step(model, loss_fn, seed))


def test_watch_sees_a_generator_given_to_the_op_and_only_what_moved():
    given = torch.Generator().manual_seed(3)
    x = torch.zeros(4)
    before = watch_generators((x,), {"generator": given})
    assert draws_since(before) is None
    torch.rand(2, generator=given)
    moved = draws_since(before)
    assert [source for source, _ in moved] == [given]
    assert torch.equal(moved[0][1], given.get_state())


# ---------------------------------------------------------------------------------------------
# NOTE [RNG trackers]


class ForkedDropoutBlock(nn.Module):
    """Draws one dropout inside the tracker's ``fork()`` (Megatron's attention dropout on a
    tensor-parallel rank's heads) and one outside it (hidden dropout)."""

    def __init__(self, tracker, width: int = 16) -> None:
        super().__init__()
        self.tracker = tracker
        self.up = nn.Linear(width, width)
        self.down = nn.Linear(width, width)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        h = self.up(x).relu()
        with self.tracker().fork():
            h = self.drop(h)
        return x + self.drop(self.down(h))


@pytest.fixture
def tracker():
    tracker = CpuRNGStatesTracker()
    yield tracker
    hyperac.unregister_rng_tracker("test")


def _tracked_steps(model, tracker):
    """Two steps, the tracker seeded as a stack seeds it once per run."""
    tracker.reset()
    tracker.add("model-parallel-rng", 1234)
    return [train_step(model, _loss(), seed) for seed in (1, 2)]


@pytest.mark.parametrize("mode", ("off", "swap", *RECOMPUTING))
def test_registered_tracker_is_replayed_in_every_mode(tracker, mode):
    model = Stack(lambda: ForkedDropoutBlock(lambda: tracker))
    reference = _tracked_steps(copy.deepcopy(model), tracker)
    hyperac.register_rng_tracker("test", tracker)
    hyperac.apply(model, mode=mode, layers="blocks", backend="cpu")
    for expected, got in zip(reference, _tracked_steps(model, tracker)):
        assert_parity(expected, got)


def test_tracker_found_through_a_function_is_the_current_one(tracker):
    """A stack that replaces its tracker (Megatron's ``get_cuda_rng_tracker`` makes one lazily)
    registers the function; the region replays the tracker of the moment."""
    current = {"tracker": CpuRNGStatesTracker()}
    model = Stack(lambda: ForkedDropoutBlock(lambda: current["tracker"]))
    reference = _tracked_steps(copy.deepcopy(model), current["tracker"])
    hyperac.register_rng_tracker("test", lambda: current["tracker"])
    hyperac.apply(model, mode="selective", layers="blocks", backend="cpu")
    current["tracker"] = tracker
    for expected, got in zip(reference, _tracked_steps(model, tracker)):
        assert_parity(expected, got)


def test_tracker_replay_puts_the_backward_states_back(tracker):
    """After a replay the tracker holds what it held before it, as Megatron's CheckpointFunction
    leaves it: a draw in backward (or the next step) is not rewound."""
    model = Stack(lambda: ForkedDropoutBlock(lambda: tracker))
    hyperac.register_rng_tracker("test", tracker)
    hyperac.apply(model, mode="full", layers="blocks", backend="cpu")
    tracker.add("model-parallel-rng", 1234)
    loss = _loss()(model)
    after_forward = tracker.get_states()["model-parallel-rng"]
    loss.backward()
    assert torch.equal(tracker.get_states()["model-parallel-rng"], after_forward)


def test_register_rng_tracker_checks_its_arguments(tracker):
    hyperac.register_rng_tracker("test", tracker)
    hyperac.register_rng_tracker("test", tracker)  # the same again: a no-op
    with pytest.raises(hyperac.ConfigError, match=r"already registered as 'test'.*unregister_rng_tracker\('test'\)"):
        hyperac.register_rng_tracker("test", CpuRNGStatesTracker())
    with pytest.raises(hyperac.ConfigError, match=r"needs an object with get_states\(\) and set_states\(states\)"):
        hyperac.register_rng_tracker("other", 3)
    with pytest.raises(hyperac.ConfigError, match="needs a non-empty name"):
        hyperac.register_rng_tracker("", tracker)
    hyperac.unregister_rng_tracker("test")
    hyperac.unregister_rng_tracker("test")  # unknown: ignored
    assert isinstance(tracker, hyperac.RNGTracker)


def test_known_stack_tracker_in_use_but_not_registered_is_refused_before_the_first_step(monkeypatch, tracker):
    """Megatron-Core keeps its tracker in a module global; hyperac looks there (never importing the
    stack) and refuses to apply while it holds states and is not registered."""
    stack = types.ModuleType("megatron.core.tensor_parallel.random")
    stack._CUDA_RNG_STATE_TRACKER = tracker
    monkeypatch.setitem(sys.modules, stack.__name__, stack)
    model = Stack(lambda: ForkedDropoutBlock(lambda: tracker))
    hyperac.apply(model, mode="full", layers="blocks", backend="cpu")  # seeded by no one yet: nothing drawn
    hyperac.remove(model)
    tracker.add("model-parallel-rng", 1234)
    hyperac.apply(model, mode="swap", layers="blocks", backend="cpu")  # swap replays nothing
    hyperac.remove(model)
    with pytest.raises(hyperac.UnsupportedModelError,
                       match=r"Megatron-Core's RNG tracker \(megatron\.core\.tensor_parallel\.random\._CUDA_RNG_STATE_"
                             r"TRACKER\) holds generator states.*hyperac.integrations.megatron.apply"):
        hyperac.apply(model, mode="selective", layers="blocks", backend="cpu")
    hyperac.register_rng_tracker("test", tracker)
    hyperac.apply(model, mode="selective", layers="blocks", backend="cpu")


def test_registered_tracker_under_compile_is_refused(tracker):
    hyperac.register_rng_tracker("test", tracker)
    with pytest.raises(hyperac.ConfigError, match="compile=True cannot replay the registered RNG trackers"):
        hyperac.apply(Stack(lambda: ForkedDropoutBlock(lambda: tracker)), mode="selective", layers="blocks",
                      backend="cpu", compile=True)
