"""The selective policy's decisions, proven by what runs again in backward."""

import collections
import copy

import pytest
import torch
from hyperac_testing import BiasedMlp, Stack, assert_parity, lm_loss, tiny_llama, train_step
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import hyperac
from hyperac.measure import flop_counter


class WriteThroughView(nn.Module):
    """`torch.matmul` on 3-d input returns `_unsafe_view(mm)`: the in-place add writes into the kept
    `mm` output through a tensor that does not share its version counter."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x):
        y = torch.matmul(x, self.weight)
        y += x
        return y.tanh()


def _loss_fn():
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(0))
    return lambda model: model(x).pow(2).sum()


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_write_into_kept_output_through_unsafe_view_keeps_gradients_exact(mode):
    model, loss_fn = Stack(WriteThroughView), _loss_fn()
    reference = train_step(model, loss_fn)
    hyperac.apply(model, mode=mode, layers="blocks", backend="cpu")
    assert_parity(reference, train_step(model, loss_fn))


def _flops(model, loss_fn) -> int:
    with flop_counter() as counter:
        loss_fn(model).backward()
    return counter.get_total_flops()


def test_mm_and_addmm_alternate_alike():
    """Selective keeps the 1st and 3rd matmul of each layer whatever their kind, recomputes the 2nd:
    the recompute costs exactly one forward matmul per layer."""
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    loss_fn = lambda model: model(x).sum()  # noqa: E731
    model = Stack(BiasedMlp, num_blocks=3)
    base = _flops(model, loss_fn)
    hyperac.apply(model, mode="selective", layers="blocks", backend="cpu")
    one_matmul = 2 * 4 * 32 * 32
    assert _flops(model, loss_fn) - base == 3 * one_matmul


def test_flop_counter_counts_grouped_matmuls():
    """torch 2.13 counts no FLOPs for `_grouped_mm` (MoE experts); hyperac's counter does."""
    a = torch.randn(16, 16, dtype=torch.bfloat16)
    b = torch.randn(2, 16, 16, dtype=torch.bfloat16)
    offsets = torch.tensor([8, 16], dtype=torch.int32)
    with flop_counter() as counter:
        torch._grouped_mm(a, b, offs=offsets)
    assert counter.get_total_flops() == 2 * 16 * 16 * 16


# ---------------------------------------------------------------------------------------------
# NOTE [Writes into kept outputs]: writes PyTorch sees (in-place activations, `x += bias`)

SELECTIVE = ["selective", "selective-even", "pointwise"]


class ConvSiLUInPlace(nn.Module):
    """A convolution (kept) whose output an in-place SiLU rewrites, then a squeeze-excite gate whose
    first Linear (kept) an in-place ReLU rewrites (torchvision/timm squeeze-excite blocks)."""

    def __init__(self, channels: int = 4) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.act = nn.SiLU(inplace=True)
        self.fc1 = nn.Linear(channels, channels)
        self.relu = nn.ReLU(inplace=True)
        self.fc2 = nn.Linear(channels, channels)

    def forward(self, x):
        h = self.act(self.conv(x))
        scale = self.fc2(self.relu(self.fc1(h.mean((2, 3))))).sigmoid()
        return x + h * scale[:, :, None, None]


class LinearSiLUInPlace(nn.Module):
    """`addmm` (the 1st matmul, kept) rewritten by an in-place SiLU; SiLU is not idempotent, so a
    replay that applies it to the written value is wrong."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.act = nn.SiLU(inplace=True)
        self.down = nn.Linear(width, width)

    def forward(self, x):
        return x + self.down(self.act(self.up(x))).tanh()


class MatmulPlusBias(nn.Module):
    """`y = x @ w; y += bias` (HF convbert's pattern), on 2-d input: the write is visible."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width) / width**0.5)
        self.bias = nn.Parameter(torch.randn(width))
        self.out = nn.Parameter(torch.randn(width, width) / width**0.5)

    def forward(self, x):
        y = x @ self.weight
        y += self.bias
        return x + (y.tanh() @ self.out).tanh()


def _conv_loss():
    x = torch.randn(2, 4, 6, 6, generator=torch.Generator().manual_seed(0))
    return lambda model: model(x).pow(2).sum()


def _flat_loss():
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    return lambda model: model(x).pow(2).sum()


class _OpCounter(TorchDispatchMode):
    def __init__(self, op) -> None:
        super().__init__()
        self.op, self.count = op, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is self.op
        return func(*args, **(kwargs or {}))


def _step_counting(model, loss_fn, op) -> int:
    """How often ``op`` runs in one forward and backward."""
    counter = _OpCounter(op)
    with counter:
        train_step(model, loss_fn)
    return counter.count


_aten = torch.ops.aten


@pytest.mark.parametrize("mode", SELECTIVE)
@pytest.mark.parametrize(("block", "make_loss", "write"), [
    (ConvSiLUInPlace, _conv_loss, _aten.silu_.default), (LinearSiLUInPlace, _flat_loss, _aten.silu_.default),
    (MatmulPlusBias, _flat_loss, _aten.add_.Tensor),
], ids=["conv-silu_", "linear-silu_", "mm-plus-bias"])
def test_visible_write_into_kept_output_keeps_gradients_exact_and_recomputes(block, make_loss, write, mode):
    """Without the protection torch raises "Tensor cached during selective activation checkpoint has
    been mutated" (and skipping its check replays the write twice: wrong gradients)."""
    model, loss_fn = Stack(block, num_blocks=3), make_loss()
    reference = train_step(model, loss_fn)
    base_flops, base_writes = _flops(model, loss_fn), _step_counting(model, loss_fn, write)
    hyperac.apply(model, mode=mode, layers="blocks", backend="cpu")
    assert_parity(reference, train_step(model, loss_fn))
    assert _step_counting(model, loss_fn, write) == 2 * base_writes, "the write runs once in forward, once in replay"
    flops = _flops(model, loss_fn)
    if mode == "pointwise":  # keeps every matmul and convolution
        assert flops == base_flops
    else:  # the 2nd matmul is recomputed, the kept ones (and the convolution) are not
        assert base_flops < flops
        hyperac.remove(model)
        hyperac.apply(model, mode="full", layers="blocks", backend="cpu")
        assert flops < _flops(model, loss_fn)


class EscapingMatmul(nn.Module):
    """Returns a kept `addmm` output, which the caller rewrites in place after the region returned,
    where no recording mode sees it; the replay needs it (to recompute `exp`, which saves its result)."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        h = self.proj(x.tanh())
        return h, h.exp()


class RewritingStack(Stack):
    def forward(self, x):
        for block in self.blocks:
            h, e = block(x)
            h.mul_(0.5)
            x = h + e
        return x


def test_write_after_the_region_returned_recomputes_the_kept_op():
    model, loss_fn = RewritingStack(EscapingMatmul), _flat_loss()
    reference = train_step(model, loss_fn)
    hyperac.apply(model, mode="selective", layers="blocks", backend="cpu")
    assert_parity(reference, train_step(model, loss_fn))


def test_allow_cache_entry_mutation_is_gone():
    """Writes are always handled, so the option that skipped torch's check (and gave wrong gradients
    for writes that are not idempotent) no longer exists."""
    with pytest.raises(TypeError, match="allow_cache_entry_mutation"):
        hyperac.apply(Stack(MatmulPlusBias), mode="selective", layers="blocks", allow_cache_entry_mutation=True)
    with pytest.raises(TypeError, match="allow_cache_entry_mutation"):
        hyperac.Config(allow_cache_entry_mutation=True)


def _hf_loss(vocab: int = 64):
    ids = torch.randint(0, vocab, (2, 12), generator=torch.Generator().manual_seed(0))
    return lambda model: model(input_ids=ids, labels=ids).loss


def _tiny_convbert():
    from transformers import ConvBertConfig, ConvBertForMaskedLM

    torch.manual_seed(0)
    return ConvBertForMaskedLM(ConvBertConfig(
        vocab_size=64, hidden_size=32, embedding_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=32,
    ))


def _tiny_gpt_oss():
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    return GptOssForCausalLM(GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ))


@pytest.mark.parametrize("build", [_tiny_convbert, _tiny_gpt_oss], ids=["convbert", "gpt_oss"])
def test_hf_models_that_write_into_kept_outputs(build):
    model, loss_fn = build(), _hf_loss()
    reference = train_step(copy.deepcopy(model), loss_fn)
    base_flops = _flops(copy.deepcopy(model), loss_fn)
    for mode in SELECTIVE:
        applied = copy.deepcopy(model)
        hyperac.apply(applied, mode=mode, backend="cpu")
        assert_parity(reference, train_step(applied, loss_fn))
        flops = _flops(applied, loss_fn)
        assert flops == base_flops if mode == "pointwise" else flops > base_flops, f"{mode}: {flops} vs {base_flops}"


# ---------------------------------------------------------------------------------------------
# NOTE [Replays that cannot use the tape]: second backwards


def _llama(attention: str):
    return tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, attn_implementation=attention)


def _retained_step(model, loss_fn):
    """`backward(retain_graph=True)` then a second backward: gradients accumulate twice."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = loss_fn(model)
    loss.backward(retain_graph=True)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _penalty_step(model, loss_fn):
    """A gradient penalty: `autograd.grad(create_graph=True)`, then a backward through the gradients."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    loss = loss_fn(model)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, params, create_graph=True)
    (loss + sum(g.pow(2).sum() for g in grads)).backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["full", *SELECTIVE])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_backward_twice_with_retained_graph(attention, mode):
    model, loss_fn = _llama(attention), lm_loss(batch=2, seq=8, vocab=128)
    reference = _retained_step(copy.deepcopy(model), loss_fn)
    hyperac.apply(model, mode=mode, backend="cpu")
    assert_parity(reference, _retained_step(model, loss_fn))
    assert_parity(train_step(copy.deepcopy(_llama(attention)), loss_fn), train_step(model, loss_fn))


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_backward_twice_through_a_region_with_an_excluded_module(mode):
    """An excluded module's queued output is returned by every replay of its region (NOTE [Excluded
    modules]), not by the first only: the second backward replays the region again."""
    model, loss_fn = _llama("sdpa"), lm_loss(batch=2, seq=8, vocab=128)
    reference = _retained_step(copy.deepcopy(model), loss_fn)
    hyperac.apply(model, mode=mode, backend="cpu",
                  adapter=hyperac.Adapter(region_patterns=("model.layers.*",), exclude_patterns=("*.self_attn",)))
    assert_parity(reference, _retained_step(model, loss_fn))


@pytest.mark.parametrize("mode", ["full", *SELECTIVE])
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_double_backward_through_gradients(attention, mode):
    """CPU flash attention has no double backward (un-applied too): sdpa runs its math kernel here."""
    model, loss_fn = _llama(attention), lm_loss(batch=2, seq=8, vocab=128)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        reference = _penalty_step(copy.deepcopy(model), loss_fn)
        hyperac.apply(model, mode=mode, backend="cpu")
        assert_parity(reference, _penalty_step(model, loss_fn))


# ---------------------------------------------------------------------------------------------
# stateful forwards


_CALLS = collections.Counter()


class CountingBlock(nn.Module):
    """A training forward that updates a counter no module holds (a module-level global, which hyperac
    cannot put back for the replay) and branches on it: its recompute runs other ops than its forward."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        _CALLS[id(self)] += 1
        h = self.proj(x)
        h = h.exp() if _CALLS[id(self)] % 2 else h.sin()
        return x + h.tanh()


@pytest.mark.parametrize("mode", SELECTIVE)
def test_stateful_forward_raises_a_clear_error_naming_the_layer(mode):
    _CALLS.clear()  # keyed by id(): a block of an earlier case, freed, may have left a count at this id
    model, loss_fn = Stack(CountingBlock, num_blocks=3), _flat_loss()
    hyperac.apply(model, mode=mode, layers="blocks", backend="cpu")
    with pytest.raises(hyperac.RecomputeMismatchError, match=r"layer 'blocks\.2' diverged .*ran aten\.exp\.default, "
                       r"the recompute ran aten\.sin\.default.*layers=\{2: 'off'\}"):
        train_step(model, loss_fn)
    assert issubclass(hyperac.RecomputeMismatchError, RuntimeError)


class LazyConstantBlock(nn.Module):
    """Computes a constant on its first forward and caches it (HF ibert's `IntLayerNorm.dim_sqrt`):
    the replay does not run those ops, and need not."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.scale = None

    def forward(self, x):
        h = self.proj(x)
        if self.scale is None:
            self.scale = torch.tensor(float(x.shape[-1])).sqrt()
        return x + self.out((h / self.scale).tanh()).tanh()


@pytest.mark.parametrize("mode", SELECTIVE)
def test_forward_only_lazy_constant_is_not_a_divergence(mode):
    model, loss_fn = Stack(LazyConstantBlock), _flat_loss()
    reference = train_step(copy.deepcopy(model), loss_fn)
    hyperac.apply(model, mode=mode, layers="blocks", backend="cpu")
    assert_parity(reference, train_step(model, loss_fn))


# ---------------------------------------------------------------------------------------------
# NOTE [Kept ops that draw random numbers]


@torch.library.custom_op("hyperac_test::noisy_scale", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,))
def noisy_scale(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Stands in for an attention kernel with dropout (CUDA flash attention): it draws random numbers."""
    mask = (torch.rand_like(x) > 0.5).to(x.dtype) * 2
    return x * mask, mask


def _noisy_setup(ctx, inputs, output):
    ctx.save_for_backward(output[1])


def _noisy_backward(ctx, grad, grad_mask):
    return grad * ctx.saved_tensors[0]


noisy_scale.register_autograd(_noisy_backward, setup_context=_noisy_setup)


def test_kept_op_that_draws_random_numbers_leaves_the_rng_where_the_forward_did():
    """The replay returns the kept op's output without running it; a dropout after it must still
    draw the forward's mask."""
    from hyperac.backends import get_backend
    from hyperac.policy import resolve_op_sets, selective_contexts

    ops = resolve_op_sets(get_backend("cpu"))
    ops = type(ops)(ops.matmul, ops.keep | {torch.ops.hyperac_test.noisy_scale.default}, ops.routing, ops.ignored)
    torch.manual_seed(0)
    layer = nn.Linear(16, 16)
    x = torch.randn(8, 16)

    def region(x):
        h, _ = noisy_scale(layer(x).tanh())
        return nn.functional.dropout(h.sin(), 0.5, training=True)

    def step(recompute: bool):
        layer.zero_grad()
        torch.manual_seed(1)
        if recompute:
            out = torch.utils.checkpoint.checkpoint(
                region, x, use_reentrant=False, context_fn=lambda: selective_contexts(ops)
            )
        else:
            out = region(x)
        out.pow(2).sum().backward()
        return out.detach(), {"weight": layer.weight.grad.clone(), "bias": layer.bias.grad.clone()}

    reference = step(recompute=False)
    assert_parity(reference, step(recompute=True))


@pytest.mark.parametrize("mode", ["selective", "pointwise"])
def test_recording_and_replay_pay_no_compiler_guard_per_op(mode):
    """torch wraps each dispatch mode's ``__torch_dispatch__`` in ``torch._dynamo.disable`` (a frame
    hook switch per op); hyperac's modes switch once per region instead (NOTE [Dispatch modes and
    torch.compile]). Seen in a profile of a whole step: hyperac's dispatch runs for every op, and
    never from dynamo's wrapper."""
    import cProfile
    import pstats

    model = tiny_llama(num_layers=2)
    hyperac.apply(model, mode=mode)
    loss_fn = lm_loss()
    train_step(model, loss_fn)
    profile = cProfile.Profile()
    profile.enable()
    train_step(model, loss_fn)
    profile.disable()
    dispatches = {key: entry for key, entry in pstats.Stats(profile).stats.items()
                  if key[0].endswith("policy.py") and key[2] == "__torch_dispatch__"}
    assert sum(entry[0] for entry in dispatches.values()) > 200  # recording and replay, every op
    callers = {caller for entry in dispatches.values() for caller in entry[4]}
    assert not [caller for caller in callers if "_dynamo" in caller[0] or caller[0].endswith("_compile.py")]
