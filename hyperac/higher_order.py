"""Higher-order operators in hyperac's dispatch modes: what the selective modes do with each.

A higher-order operator (HOP) is an op that takes functions: ``flex_attention`` takes its score and
mask functions, ``cond`` its branches, ``inductor_compiled_code`` a compiled region. A dispatch mode
sees one only if it says it can (``supports_higher_order_operators``), and then sees the HOP as one
op: torch runs it with the mode popped, so the ops inside stay hidden from the mode. hyperac's
recording and replay modes and the modes its planner and meters run say they can, and each HOP gets
a rule here (NOTE [Higher-order operators]). Private torch internals used: none beyond
``torch._ops.HigherOrderOperator`` and the HOP names.

NOTE [Higher-order operators]
A selective region either keeps a HOP's output (the replay returns it, the HOP runs once) or
replays it (the replay runs it again, whole). Both give the un-applied model's gradients when the HOP
is a deterministic function of its inputs and draws from no generator the replay cannot restore;
keeping also holds for one that is not, since the kept value *is* the forward's. So a HOP is replayed
only where hyperac knows what it is, and the rule per HOP torch 2.13 ships is:

* ``attention``: ``flex_attention``, kept under the attention cost rule (NOTE [Attention kept by its
  cost per byte] in policy.py), key length at dimension ``-2`` as with SDPA. Its score and mask
  functions (and the tensors they capture, passed as ``score_mod_other_buffers`` /
  ``mask_mod_other_buffers``) are arguments of the op, not part of what is kept or compared: as in
  torch's own selective checkpoint, the op is matched by itself, because each forward makes a new
  closure. A replayed flex_attention runs with the replay's functions, which compute what the
  forward's did from the replayed buffers.
* ``keep``: regions whose work hyperac cannot see and whose outputs already hold what their backward
  reads: ``inductor_compiled_code`` (a ``torch.compile``'d function called from an eager layer, with
  ``torch._inductor.config.wrap_inductor_compiled_regions``; its outputs are the region's outputs and
  the activations AOTAutograd saves for it), ``invoke_subgraph`` (``nested_compile_region``),
  ``aoti_call_delegate`` / ``executorch_call_delegate`` (ahead-of-time compiled code),
  ``triton_kernel_wrapper_functional`` (a user's Triton kernel; a user writes one for heavy work),
  ``auto_functionalized`` / ``_v2`` (a mutating custom op made functional: a vendor kernel or an
  in-place collective, never safe to run twice), ``out_dtype`` (a matmul with another output dtype),
  ``local_map_hop`` (a DTensor region's local body), ``flex_attention_backward`` (met in a forward
  only where it differentiates through flex attention, as a gradient penalty does). As with the
  other kept ops, ``Config.save_ops`` decides instead when given, and what is not named is replayed.
* ``once``: kept in every recording mode, whatever ``save_ops`` says, and never dropped by NOTE
  [Never keep more than off], as collectives are: HOPs with effects a replay must not repeat
  (``with_effects``, ``print``, ``call_torchbind``), user code hyperac cannot judge
  (``invoke_leaf_function``), DTensor's random ops (``run_dtensor_rng_op``, whose generator offset a
  replay does not rewind), and every HOP not named here (a user's own ``HigherOrderOperator``, one a
  later torch adds): the forward's output is the one the un-applied model uses, so keeping it is
  exact whatever the op does. One exception: a HOP that writes into its inputs (a tensor argument's
  version moved across the call) is replayed, as an in-place op is, since skipping it would leave the
  replay's tensors unwritten.
* ``replay``: HOPs whose bodies are traced graphs of ordinary ops, deterministic given their inputs:
  control flow (``cond``, ``while_loop``, ``while_loop_stack_output``, ``map_impl``, ``scan``,
  ``associative_scan``), wrappers of elementwise or bookkeeping work (``foreach_map``,
  ``inline_asm_elementwise``, ``invoke_quant``, ``invoke_quant_packed``, ``hints_wrapper``,
  ``strict_mode``, ``run_const_graph``, ``_export_tracepoint``, ``trace_wrapped``,
  ``control_deps``), functionalized random ops that carry their generator state as an argument
  (``run_with_rng_state``, ``run_and_save_rng_state``, ``graphsafe_run_with_rng_state``), and
  ``triton_kernel_wrapper_mutation``, which writes into its ``kwargs`` tensors: a kept output among
  them is copied first (NOTE [Writes into kept outputs] in policy.py), since the kernel's writes move
  no version counter. Control flow runs again in backward as its own autograd does anyway; a
  collective inside a branch would run again too (torch's control flow does not support them).
* ``body``: HOPs that never reach a dispatch mode in eager code, since their ``__call__`` runs the
  wrapped function directly: ``wrap``, ``wrap_with_autocast``, ``wrap_with_set_grad_enabled``,
  ``wrap_activation_checkpoint``, ``tag_activation_checkpoint``, ``dynamo_bypassing_wrapper``,
  ``autograd_function_apply``, ``custom_function_call``, ``flat_apply``, ``register_hook``. Their
  bodies' ops meet the policy one by one (a matmul inside ``wrap_with_autocast`` counts in the
  alternation as any other). Should one reach a mode, it is replayed.

Under ``compile=True`` PyTorch's selective checkpoint modes trace the region; hyperac lets them take
every HOP too (they have rules for a few), and its policy decides each by the same rules.

A kept HOP's outputs stay kept when the region's forward ends, as collectives' do: NOTE [Never keep
more than off] in policy.py weighs kept outputs by whether autograd saved them, and the activations a
HOP's own autograd saves (a compiled region's, returned by its forward) have no autograd node of the
region to be told by. A kept HOP may have drawn random numbers (a compiled region with dropout): the
replay sets the generators it moved to where the forward left them (NOTE [Kept ops that draw random
numbers] in replay/random_sources.py).

NOTE [Traces inside a region]
Eager ``flex_attention`` (torch runs it through ``torch.compile(backend="eager")``) traces its score
function's joint forward-backward graph with ``make_fx`` on fake tensors, inside the layer's forward,
and that trace runs a backward of its own (``create_fw_bw_graph``). The fake tensors its ops save for
that backward meet whatever saved-tensor hooks are in effect. ``make_fx`` knows a tensor by identity,
and a hook gives back another one: ``torch.utils.checkpoint`` takes each fake for an activation, and
when the trace's backward unpacks it, recomputes the region in the middle of its forward and hands
back the fake of that other run; swap's hooks give back a detached alias. Either way the traced joint
graph holds an unknown tensor as a constant (uninitialized memory when it runs), and the score
function's gradients come out wrong with no error: a captured bias's (measured: off by 1e17 to 1e30),
and q/k/v's where the score function's own ops save tensors (Gemma 2's ``tanh`` soft-capping). q/k/v
are exact with a score function that saves nothing, which hid the bug. The selective modes saw the
nested recompute and raised ``RecomputeMismatchError``. Plain ``torch.utils.checkpoint`` has the same
bug; compiled flex attention traces at compile time, outside any region, and never had it.
A fake tensor holds no data and is no activation, so inside a recomputed region (its one hook pair,
region_saves.py) and a swap group (:class:`FakeTensorsKept`, entered innermost) every fake tensor saved
stays out of the region's hooks,
and every real tensor goes to them as before: the forward and the recompute save the same real
tensors, in the same order, and the trace's backward reads its own tensors. A fake is kept as an
alias made by ``detach`` under the tracer's modes (so ``make_fx`` records it), not as itself: a fake
an op saves of its own output (``tanh``'s) would otherwise close a cycle fake -> grad_fn -> saved ->
fake that the garbage collector cannot see through (NOTE [Saved tensors under hooks] in swap.py), and
each step would leak the trace's graph and, through the hooks it holds, the region's checkpoint frame
or swap group (measured: two per step).
The rule is by tensor, not by op: any op whose eager autograd traces with fake tensors inside the
region is covered. hyperac's profiler already passes fake tensors through (``planner/profile.py``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake
from torch.utils._pytree import tree_leaves

__all__ = ["ATTENTION", "BODY", "KEEP", "ONCE", "REPLAY", "RULES", "FakeTensorsKept", "ops_with_rule", "rule",
           "tensor_versions", "written_arguments", "wrote"]

ATTENTION, KEEP, ONCE, REPLAY, BODY = "attention", "keep", "once", "replay", "body"

RULES: dict[str, str] = {
    "flex_attention": ATTENTION,
    **dict.fromkeys((
        "inductor_compiled_code", "invoke_subgraph", "aoti_call_delegate", "executorch_call_delegate",
        "triton_kernel_wrapper_functional", "auto_functionalized", "auto_functionalized_v2", "out_dtype",
        "local_map_hop", "flex_attention_backward",
    ), KEEP),
    **dict.fromkeys(("with_effects", "print", "call_torchbind", "invoke_leaf_function", "run_dtensor_rng_op"), ONCE),
    **dict.fromkeys((
        "cond", "while_loop", "while_loop_stack_output", "map_impl", "scan", "associative_scan", "foreach_map",
        "inline_asm_elementwise", "invoke_quant", "invoke_quant_packed", "hints_wrapper", "strict_mode",
        "run_const_graph", "_export_tracepoint", "trace_wrapped", "control_deps", "run_with_rng_state",
        "run_and_save_rng_state", "graphsafe_run_with_rng_state", "triton_kernel_wrapper_mutation",
    ), REPLAY),
    **dict.fromkeys((
        "wrap", "wrap_with_autocast", "wrap_with_set_grad_enabled", "wrap_activation_checkpoint",
        "tag_activation_checkpoint", "dynamo_bypassing_wrapper", "autograd_function_apply", "custom_function_call",
        "flat_apply", "register_hook",
    ), BODY),
}
"""The rule of each HOP torch 2.13 ships, by name (NOTE [Higher-order operators]); any other HOP is ``once``."""


KEYWORD_ONLY = sys.maxsize
"""The position :func:`written_arguments` gives an argument passed only by keyword."""

_WRITTEN = {"triton_kernel_wrapper_mutation": ((KEYWORD_ONLY, "kwargs"),)}


def rule(op: torch._ops.HigherOrderOperator) -> str:
    """``op``'s rule (NOTE [Higher-order operators]): one of :data:`ATTENTION`, :data:`KEEP`,
    :data:`ONCE`, :data:`REPLAY`, :data:`BODY`."""
    return RULES.get(op.name(), ONCE)


def ops_with_rule(*rules: str) -> frozenset:
    """The HOPs registered now whose rule is one of ``rules``."""
    return frozenset(op for name, op in torch._ops._higher_order_ops.items() if RULES.get(name, ONCE) in rules)


def written_arguments(op: torch._ops.HigherOrderOperator) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of the arguments ``op`` writes into without moving their version counters."""
    return _WRITTEN.get(op.name(), ())


def tensor_versions(args: tuple, kwargs: dict) -> list[tuple[torch.Tensor, int]]:
    """Each tensor argument and its version now, for :func:`wrote`."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and not t.is_inference()]
    return [(t, t._version) for t in tensors]


def wrote(versions: list[tuple[torch.Tensor, int]]) -> bool:
    """Whether a tensor of ``versions`` (:func:`tensor_versions`) was written since."""
    return any(tensor._version != version for tensor, version in versions)



class FakeTensorsKept:
    """While entered, keep the fake tensors saved for backward (a detached alias), and pass every other
    saved tensor to the saved-tensor hooks in effect on entry (NOTE [Traces inside a region]); with no
    hooks in effect, nothing changes. The unpack hook, which autograd holds as long as the saved
    tensor, holds only the outer unpack hook, not the outer pack hook's owner (a swap group)."""

    def __init__(self) -> None:
        self.pushed = False

    def __enter__(self) -> None:
        outer = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if outer is not None:
            torch._C._autograd._push_saved_tensors_default_hooks(_pack_hook(outer[0]), _unpack_hook(outer[1]))
            self.pushed = True

    def __exit__(self, *exc: Any) -> None:
        if self.pushed:
            torch._C._autograd._pop_saved_tensors_default_hooks()
            self.pushed = False


_PLAIN = (torch.Tensor, torch.nn.Parameter)
"""Tensor types that are never fake: most saved tensors, told apart without ``is_fake``'s checks."""


def _pack_hook(pack: Callable[[torch.Tensor], Any]) -> Callable[[torch.Tensor], tuple[bool, Any]]:
    def hook(tensor: torch.Tensor) -> tuple[bool, Any]:
        fake = type(tensor) not in _PLAIN and is_fake(tensor)
        return (True, tensor.detach()) if fake else (False, pack(tensor))

    return hook


def _unpack_hook(unpack: Callable[[Any], torch.Tensor]) -> Callable[[tuple[bool, Any]], torch.Tensor]:
    def hook(saved: tuple[bool, Any]) -> torch.Tensor:
        fake, value = saved
        return value if fake else unpack(value)

    return hook
