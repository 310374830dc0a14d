"""Cost attention on ``meta`` as the fused kernel an accelerator runs, not as SDPA's math path.

NOTE [Fused attention on meta]
On ``meta`` tensors ``F.scaled_dot_product_attention`` has no fused kernel to choose and takes its
math path, which materialises and keeps a seq x seq attention matrix per head that no accelerator
run keeps. While a ``meta`` profile runs, the function is routed to the CPU flash kernel, whose
meta functions give the shapes, saved tensors and FLOPs of fused attention.

Why a function swap and not a ``TorchFunctionMode`` (which would be thread-local): torch function
modes are not active inside the backward pass, so a full or selective recompute would replay the
math path against a forward recorded on the flash path, and torch's checkpoint refuses the
mismatch. The swap is therefore process-wide, and made safe by three rules: it is installed only
for ``meta`` profiles (a profile on real tensors never touches it), the wrapper passes every
non-``meta`` call through to the original unchanged (a thread training on real tensors meanwhile
computes exactly what it would have), and installs are counted under a lock, so that concurrent
``meta`` profiles in several threads restore the original function exactly once, last out.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.nn import functional as F

__all__ = ["fused_attention_on_meta"]

_lock = threading.Lock()
_users = 0
_original = None


def _fused(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if query.device.type != "meta":
        return _original(query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
    if enable_gqa and key.shape[-3] != query.shape[-3]:
        repeats = query.shape[-3] // key.shape[-3]
        key, value = key.repeat_interleave(repeats, -3), value.repeat_interleave(repeats, -3)
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale
    )[0]


@contextlib.contextmanager
def fused_attention_on_meta(enabled: bool) -> Iterator[None]:
    """Route SDPA on ``meta`` tensors to the fused kernel for the duration (see NOTE [Fused
    attention on meta]); ``enabled=False`` (a profile on real tensors) changes nothing."""
    global _users, _original
    if not enabled:
        yield
        return
    with _lock:
        if _users == 0:
            _original = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _fused
        _users += 1
    try:
        yield
    finally:
        with _lock:
            _users -= 1
            if _users == 0:
                F.scaled_dot_product_attention = _original
                _original = None
