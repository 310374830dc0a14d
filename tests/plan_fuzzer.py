"""Random layer plans for tests/test_plan_fuzz.py, and the oracle that trains them applied and un-applied.

Where tests/program_fuzzer.py draws the layers' programs, this draws what a user passes to
:func:`hyperac.apply` and how the model is then used. A case is data:

* a model: tiny HF Llama, GPT-2 (dropout) or BERT (dropout, an encoder), or a plain stack of blocks
  (linear, SDPA attention, LayerNorm, dropout, BatchNorm statistics) in an ``nn.ModuleList`` or an
  ``nn.Sequential``; 2 to 4 layers; float32, bfloat16 or float64;
* plans: a uniform mode or a ``layers=`` dict of ranges (closed and open) with a single-index
  override inside one, modes drawn from the six eager ones (``swap`` runs on the stream-faithful ``sim``
  backend), ``swap_inputs`` and ``swap_selective_outputs``, an adapter excluding a module from the
  replay, ``save_ops=`` and ``force_recompute=`` where a layer is selective;
* a session: training steps of random batch and sequence sizes, forwards under ``torch.no_grad`` in
  train and eval mode, a training forward whose graph is dropped unused, a training step in eval
  mode, gradients accumulated over two batches of different shapes, the first layer frozen or
  unfrozen, the model cast to another dtype, its ``state_dict`` saved and loaded back,
  remove-then-apply cycles to a new plan, and to the applied plan again through ``plan=``.

:func:`run_session` plays the session on the un-applied model and on an applied copy (for the
latter each cycle removes and applies again) and :func:`compare` returns what differs bit for bit:
each step's loss and gradients, then parameters and buffers, and, after a final ``remove``, the
modules' and configs' attributes against the un-applied model's.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from hyperac_testing import tiny_gpt2, tiny_llama
from hypothesis import strategies as st
from program_fuzzer import differences
from test_applied_state import snapshot
from torch import nn

import hyperac
from hyperac.config import KNAPSACK_MODES, MODES, SELECTIVE_MODES

FAMILIES = ("llama", "gpt2", "bert", "modulelist", "sequential")
DTYPES = (torch.float32, torch.bfloat16, torch.float64)
WIDTH, VOCAB = 16, 64
FORCED = {"llama": "mlp.*_proj", "gpt2": "mlp.c_fc", "bert": "intermediate.dense", "modulelist": "mlp.0",
          "sequential": "mlp.0"}
"""A ``force_recompute=`` pattern per family: a module inside each layer."""
REGIONS = {"llama": hyperac.Adapter(region_patterns=("model.layers.*",), exclude_patterns=("*.self_attn",)),
           "modulelist": hyperac.Adapter(region_patterns=("layers.*",), exclude_patterns=("*.stats",))}
"""An adapter per family that has one here: recompute regions with a module excluded from the replay."""
STEPS = ("train", "train_in_eval", "no_grad", "no_grad_eval", "discard", "accumulate", "freeze", "cast", "checkpoint",
         "cycle", "replan")


class Block(nn.Module):
    """A pre-norm transformer block with training BatchNorm statistics on the MLP's input."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)
        self.stats = nn.BatchNorm1d(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Dropout(0.1), nn.Linear(2 * WIDTH, WIDTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(self.norm(x)).view(batch, seq, 3, 2, WIDTH // 2).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.1 if self.training else 0.0)
        x = x + self.out(attended.transpose(1, 2).reshape(batch, seq, WIDTH))
        return x + self.mlp(self.stats(x.transpose(1, 2)).transpose(1, 2))


class Stack(nn.Module):
    """Embedding, ``layers`` (a ``ModuleList`` or an ``nn.Sequential`` of blocks) and a head."""

    def __init__(self, num_layers: int, sequential: bool) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        blocks = [Block() for _ in range(num_layers)]
        self.layers = nn.Sequential(*blocks) if sequential else nn.ModuleList(blocks)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        if isinstance(self.layers, nn.Sequential):
            x = self.layers(x)
        else:
            for layer in self.layers:
                x = layer(x)
        return F.cross_entropy(self.head(x).flatten(0, 1).float(), ids.flatten())


def build(case: dict) -> nn.Module:
    family, num_layers = case["family"], case["num_layers"]
    torch.manual_seed(case["seed"])
    if family == "llama":
        model = tiny_llama(num_layers, hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_attention_heads=2,
                           num_key_value_heads=1, vocab_size=VOCAB)
    elif family == "gpt2":
        # Its training cache changes the float32 bits of the un-applied gradients (test_models.py,
        # Family.cache_changes_bits); a recomputing plan builds none, so the reference builds none either.
        model = tiny_gpt2(num_layers, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, use_cache=False)
    elif family == "bert":
        from transformers import BertConfig, BertForMaskedLM

        model = BertForMaskedLM(BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=num_layers,
                                           num_attention_heads=2, intermediate_size=2 * WIDTH,
                                           max_position_embeddings=64))
    else:
        model = Stack(num_layers, sequential=family == "sequential")
    return model.to(case["dtype"]).train()


def loss(model: nn.Module, family: str, batch: int, seq: int, seed: int) -> torch.Tensor:
    """The model's loss on random tokens; HF models get a padding mask on the last sequence's tail
    (``seed`` odd), its labels ignored."""
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    if family in ("modulelist", "sequential"):
        return model(ids)
    mask = torch.ones_like(ids)
    mask[-1, seq // 2:] = seed % 2 == 0
    return model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100)).loss.float()


@st.composite
def plans(draw: Callable, family: str, num_layers: int) -> dict:
    """``apply`` options: a mode or a ``layers=`` dict, a backend, and the selective options."""
    modes = st.sampled_from([mode for mode in MODES if mode not in KNAPSACK_MODES])  # those need compile=
    options: dict[str, Any] = {"mode": draw(modes)}
    effective = [options["mode"]] * num_layers
    if draw(st.booleans()):
        split = draw(st.integers(0, num_layers))
        spec: dict[Any, str] = {}
        if split > 0:  # a range of one layer is that layer's index ('0-0' and 0 would name it twice)
            key = f"0-{split - 1}" if split > 1 else 0
            spec[key] = draw(modes)
            effective[:split] = [spec[key]] * split
        if split < num_layers:
            spec[f"{split}-"] = draw(modes)
            effective[split:] = [spec[f"{split}-"]] * (num_layers - split)
        if draw(st.booleans()):
            index = draw(st.integers(0, num_layers - 1))
            spec[index] = effective[index] = draw(modes)
        options["layers"] = spec
    swapping = "swap" in effective or draw(st.booleans())
    options.update(backend="sim", min_swap_bytes=0) if swapping else options.update(backend="cpu")
    if swapping and any(mode not in ("off", "swap") for mode in effective):
        options["swap_inputs"] = draw(st.booleans())
    if swapping and any(mode in SELECTIVE_MODES for mode in effective):
        options["swap_selective_outputs"] = draw(st.booleans())
    if family in REGIONS and any(mode not in ("off", "swap") for mode in effective) and draw(st.booleans()):
        options["adapter"] = REGIONS[family]
    if any(mode in SELECTIVE_MODES for mode in effective):
        if draw(st.booleans()):
            options["save_ops"] = draw(st.sampled_from([("aten::mm",), ("aten::mm", "aten::addmm"), ()]))
        if draw(st.booleans()):
            options["force_recompute"] = [FORCED[family]]
    return options


@st.composite
def cases(draw: Callable, max_steps: int = 5) -> dict:
    family = draw(st.sampled_from(FAMILIES))
    num_layers = draw(st.integers(2, 4))
    steps = []
    for _ in range(draw(st.integers(1, max_steps))):
        kind = draw(st.sampled_from(STEPS))
        if kind == "cycle":
            steps.append((kind, draw(plans(family, num_layers))))
        elif kind == "cast":
            steps.append((kind, draw(st.sampled_from(DTYPES))))
        elif kind in ("freeze", "checkpoint", "replan"):
            steps.append((kind,))
        else:
            steps.append((kind, draw(st.integers(1, 3)), draw(st.integers(2, 12))))
    return {"family": family, "num_layers": num_layers, "dtype": draw(st.sampled_from(DTYPES)),
            "seed": draw(st.integers(0, 2**16)), "plan": draw(plans(family, num_layers)), "steps": tuple(steps)}


def run_session(case: dict, applied: bool) -> tuple[list[tuple[str, torch.Tensor]], Any]:
    """(Everything the session produces: per step its loss and gradients, then parameters and
    buffers; the modules' and configs' attributes at the end). ``applied``: with ``case["plan"]``
    applied, applied again with the cycle's plan at each cycle, and removed at the end."""
    model = build(case)
    options = case["plan"]
    if applied:
        hyperac.apply(model, **options)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    record: list[tuple[str, torch.Tensor]] = []
    for position, (kind, *arguments) in enumerate(case["steps"]):
        if kind == "cycle":
            options = arguments[0]
            if applied:
                hyperac.remove(model)
                hyperac.apply(model, **options)
            continue
        if kind == "replan":
            if applied:
                plan = hyperac.applied_plan(model)
                hyperac.remove(model)
                again = hyperac.apply(model, plan=plan.to_dict(),
                                      **{k: v for k, v in options.items() if k not in ("mode", "layers")})
                assert again.layers == plan.layers, (plan, again)
            continue
        if kind == "cast":
            model.to(arguments[0])
            continue
        if kind == "checkpoint":
            state = {name: value.clone() for name, value in model.state_dict().items()}
            record += [(f"{position} saved {name}", value) for name, value in state.items()]
            model.load_state_dict(state)
            continue
        if kind == "freeze":
            for name, parameter in model.named_parameters():
                if ".0." in name:  # the first layer, in every family
                    parameter.requires_grad_(not parameter.requires_grad)
            continue
        batch, seq = arguments
        torch.manual_seed(position)
        model.train(kind not in ("train_in_eval", "no_grad_eval"))
        if kind.startswith("no_grad"):
            with torch.no_grad():
                record.append((f"{position} no_grad loss", loss(model, case["family"], batch, seq, position)))
            continue
        if kind == "discard":
            record.append((f"{position} discarded loss", loss(model, case["family"], batch, seq, position).detach()))
            continue
        optimizer.zero_grad(set_to_none=True)
        for micro in range(2 if kind == "accumulate" else 1):
            value = loss(model, case["family"], batch, seq + micro, position)
            value.backward()
            record.append((f"{position}.{micro} loss", value.detach()))
        record += [(f"{position} grad {n}", p.grad.clone()) for n, p in model.named_parameters() if p.grad is not None]
        optimizer.step()
    model.train()
    if applied:
        hyperac.remove(model)
    return record + [(f"state {n}", v.clone()) for n, v in model.state_dict().items()], snapshot(model, False)


def compare(case: dict) -> list[str]:
    """What differs between the un-applied and the applied session, bit for bit."""
    expected, expected_modules = run_session(case, applied=False)
    actual, actual_modules = run_session(copy.deepcopy(case), applied=True)
    found = differences(expected, actual)
    return found + (["module or config attributes after remove"] if actual_modules != expected_modules else [])
