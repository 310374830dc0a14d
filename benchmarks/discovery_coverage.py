"""Which models hyperac handles with no paths, as a new user would try it: tiny models of every HF head family.

For each model type transformers knows, builds one tiny model from its config (small widths, two layers,
nothing downloaded; the first head of ``HEADS`` the type has), then:

* discovery: ``hyperac.apply(model)`` without ``layers=`` finds layers (and how: ``found_by``), or raises
  an error that names what to pass;
* parity (models whose inputs this script can make: token ids, images, raw audio): one training step in
  ``full`` and ``selective`` gives the un-applied loss, gradients and buffers, bitwise.

Model types run in the order of ``HEADS`` (every causal LM first). Slow (minutes per hundred models on one
core) and not part of the test suite; ``--budget`` stops starting new models after that many seconds::

    PYTHONPATH=. python benchmarks/discovery_coverage.py [--only llama,resnet] [--no-parity] [--budget 2400]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import copy
import json
import signal
import time
import warnings
from typing import Any

import numpy
import torch
from torch import nn

import hyperac

HEADS = (
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
    "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "MODEL_FOR_CTC_MAPPING_NAMES",
    "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES",
    "MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES", "MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",
    "MODEL_MAPPING_NAMES",
)
_TOKEN_HEADS = (*HEADS[:3], HEADS[4])
_IMAGE_HEAD = HEADS[3]
_AUDIO_HEADS = (HEADS[5], HEADS[9])
_SMALL = {
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "d_embed"), 32),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "n_layers", "num_layers", "encoder_layers", "decoder_layers",
                     "num_decoder_layers", "num_encoder_layers"), 2),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "num_heads"), 2),
    **dict.fromkeys(("num_key_value_heads",), 1),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner",
                     "d_inner"), 64),
    "head_dim": 16,
    **dict.fromkeys(("rotary_dim", "qk_rope_head_dim", "qk_nope_head_dim"), 8),  # within head_dim
    **dict.fromkeys(("v_head_dim", "kv_lora_rank", "q_lora_rank"), 16),
    "d_kv": 16,
    "vocab_size": 256,
    "num_labels": 2,
    "max_position_embeddings": 128,
}
_SUB_CONFIGS = ("text_config", "vision_config", "audio_config", "encoder", "decoder", "backbone_config")


def _set(config: Any, name: str, value: Any) -> None:
    try:
        setattr(config, name, value)
    except (NotImplementedError, AttributeError, ValueError, TypeError):  # derived or validated fields stay
        pass


def _shrink(config: Any) -> Any:
    for name, value in _SMALL.items():
        current = getattr(config, name, None)
        if isinstance(current, int) and not isinstance(current, bool) and current > value:
            _set(config, name, value)
    for name in ("hidden_sizes", "embed_dims", "embed_dim_list"):
        value = getattr(config, name, None)
        if isinstance(value, list) and all(isinstance(v, int) for v in value):
            _set(config, name, [min(v, 16 * (i + 1)) for i, v in enumerate(value)])
    for name in ("depths", "num_layers_per_stage"):
        value = getattr(config, name, None)
        if isinstance(value, list) and all(isinstance(v, int) for v in value):
            _set(config, name, [min(v, 2) for v in value])
    for name in _SUB_CONFIGS:
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "to_dict"):
            _shrink(sub)
    return config


def build(model_type: str) -> tuple[nn.Module, str]:
    """A tiny seeded model of ``model_type`` and the head mapping its class came from."""
    import transformers
    from transformers.models.auto import modeling_auto

    config = _shrink(transformers.AutoConfig.for_model(model_type))
    for head in HEADS:
        class_name = getattr(modeling_auto, head).get(model_type)
        if isinstance(class_name, (list, tuple)):
            class_name = class_name[0]
        if class_name and hasattr(transformers, class_name):
            torch.manual_seed(0)
            return getattr(transformers, class_name)(config), head
    raise LookupError(f"no model class for {model_type}")


def model_types() -> list[str]:
    from transformers.models.auto import modeling_auto

    types: dict[str, None] = {}
    for head in HEADS:
        types.update(dict.fromkeys(sorted(getattr(modeling_auto, head))))
    return list(types)


def loss_fn(model: nn.Module, head: str) -> Any:
    """A loss for models whose inputs this script can make, else ``None``."""
    config = model.config
    generator = torch.Generator().manual_seed(0)
    if head in _TOKEN_HEADS:
        ids = torch.randint(5, min(getattr(config, "vocab_size", 256) or 256, 256), (2, 16), generator=generator)
        labels = torch.tensor([0, 1]) if "SEQUENCE" in head else ids
        return lambda m: m(input_ids=ids, labels=labels).loss
    if head == _IMAGE_HEAD:
        size = getattr(config, "image_size", 64)
        size = size[0] if isinstance(size, (list, tuple)) else size
        pixels = torch.randn(2, getattr(config, "num_channels", 3), size, size, generator=generator)
        return lambda m: m(pixel_values=pixels, labels=torch.tensor([0, 1])).loss
    if head in _AUDIO_HEADS and model.main_input_name == "input_values":
        audio = torch.randn(2, 4000, generator=generator)
        vocab = min(getattr(config, "vocab_size", 32) or 32, 32)
        labels = torch.randint(1, vocab, (2, 2), generator=generator) if head == HEADS[5] else torch.tensor([0, 1])
        return lambda m: m(input_values=audio, labels=labels).loss
    return None


def step(model: nn.Module, loss: Any) -> tuple[torch.Tensor, dict, dict]:
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    numpy.random.seed(1)  # SpecAugment's time masks (wav2vec2 and kin) draw from numpy
    value = loss(model)
    value.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return value.detach(), grads, {n: b.clone() for n, b in model.named_buffers()}


def compare(reference: tuple, other: tuple) -> str | None:
    if not torch.equal(reference[0], other[0]):
        return "loss"
    if reference[1].keys() != other[1].keys() or any(not torch.equal(g, other[1][n]) for n, g in reference[1].items()):
        return "gradients"
    if any(not torch.equal(b, other[2][n]) for n, b in reference[2].items()):
        return "buffers"
    return None


def _without_cache(model: nn.Module, loss: Any) -> tuple[torch.Tensor, dict, dict]:
    """The un-applied step with ``use_cache=False``.

    NOTE [use_cache in training]
    hyperac turns ``use_cache`` off, as HF's own gradient checkpointing does. A few models compute another
    training step with a cache (dory's recurrent loops: another loss; mamba2 and gated-delta mixers, nemotron_h,
    falcon_h1, lara_mini: gradients about 1e-8 relative apart); their applied step equals this one bitwise.
    """
    model = copy.deepcopy(model)
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", None):
            config.use_cache = False
    return step(model, loss)


class _Timeout(Exception):
    pass


def _alarm(*_: Any) -> None:
    raise _Timeout


def check(model_type: str, parity: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"type": model_type}
    try:
        model, head = build(model_type)
    except Exception as error:  # noqa: BLE001 - a model the script cannot build is reported, not a failure
        return {**row, "status": "not built", "error": f"{type(error).__name__}: {str(error)[:120]}"}
    row["head"] = head.removeprefix("MODEL_").removesuffix("_MAPPING_NAMES").lower()
    row["causal_lm"] = head == HEADS[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plan = hyperac.apply(copy.deepcopy(model), backend="cpu", mode="full")
        except hyperac.HyperACError as error:
            return {**row, "status": "refused", "error": str(error)[:300]}
        row.update(status="found", layers=len(plan.layers),
                   found_by=sorted({layer.found_by for layer in plan.layers}), notes=list(plan.notes))
        loss = loss_fn(model, head) if parity else None
        if loss is None:
            return row
        try:
            reference = step(copy.deepcopy(model), loss)
        except Exception as error:  # noqa: BLE001
            row["parity"] = f"un-applied step fails: {type(error).__name__}"
            return row
        for mode in ("full", "selective"):
            applied = copy.deepcopy(model)
            try:
                hyperac.apply(applied, backend="cpu", mode=mode)
                result = step(applied, loss)
                row[mode] = compare(reference, result) or "equal"
                if row[mode] != "equal" and compare(_without_cache(model, loss), result) is None:
                    row[mode] = "equal to use_cache=False"  # NOTE [use_cache in training]
            except Exception as error:  # noqa: BLE001
                row[mode] = f"error {type(error).__name__}: {str(error)[:160]}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types")
    parser.add_argument("--no-parity", action="store_true", help="discovery only")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per model")
    parser.add_argument("--budget", type=float, help="start no model after this many seconds")
    parser.add_argument("--json", help="write every row here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    types = args.only.split(",") if args.only else model_types()
    rows = []
    signal.signal(signal.SIGALRM, _alarm)
    start = time.monotonic()
    for model_type in types:
        if args.budget is not None and time.monotonic() - start > args.budget:
            print(f"budget spent: {len(types) - len(rows)} of {len(types)} model types not run", flush=True)
            break
        signal.alarm(args.timeout)
        try:
            row = check(model_type, not args.no_parity)
        except _Timeout:
            row = {"type": model_type, "status": "timeout"}
        finally:
            signal.alarm(0)
        rows.append(row)
        print(json.dumps(row), flush=True)
    built = [r for r in rows if r["status"] in ("found", "refused")]
    found = [r for r in built if r["status"] == "found"]
    causal = [r for r in built if r.get("causal_lm")]
    counts = collections.Counter(r[mode].split(":")[0] for r in found for mode in ("full", "selective") if mode in r)
    print(f"built {len(built)} of {len(rows)}; discovered {len(found)} of {len(built)} "
          f"({100 * len(found) / max(len(built), 1):.1f}%); causal LMs {sum(r['status'] == 'found' for r in causal)} "
          f"of {len(causal)}")
    print("found by:", dict(collections.Counter(b for r in found for b in r["found_by"])))
    print("parity (full and selective runs):", dict(counts))
    for head in sorted({r["head"] for r in built}):
        ours = [r for r in found if r["head"] == head]
        equal = {mode: sum(str(r.get(mode)).startswith("equal") for r in ours) for mode in ("full", "selective")}
        print(f"  {head}: discovered {len(ours)} of {sum(r['head'] == head for r in built)}; "
              f"parity full {equal['full']}, selective {equal['selective']} of {sum('full' in r for r in ours)}")
    print("refused:", [r["type"] for r in built if r["status"] == "refused"])
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
