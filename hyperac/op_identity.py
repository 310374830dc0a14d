"""What an op is to the selective policy, read from the op itself: whether it communicates, and
how long an attention kernel's keys are.

Names go stale: every library that moves tensors between ranks (torch's functional collectives,
symmetric memory, an expert-parallel dispatcher, a vendor's matmul fused with an all-reduce)
registers its own ops, and a list of names knows only the ones that existed when it was written.
What an op takes does not go stale: an op handed a process group, or the name of one, talks to
other ranks. So the policy asks the schema, once per op, at first sight (in
:meth:`hyperac.policy.OpSets.classify`), which also covers ops registered after hyperac was
imported or applied. Ops that communicate without any group in their schema (a dispatcher that
keeps its group in a buffer it built earlier) are still named by the backend's
``communication_ops()``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["communicates", "fills_buffers", "key_length"]

_GROUP_CLASSES = ("ProcessGroup", "SymmetricMemory")
"""TorchScript classes that are a handle on a group of ranks, in any namespace, by the start of their
name (``c10d.ProcessGroup``, ``c10d.SymmetricMemory``, the Ascend extension's
``npu_custom_dist.ProcessGroupHCCL``); ``c10d.ReduceOp``, a value, is not one."""


def communicates(op: Any) -> bool:
    """Whether ``op``'s schema takes a communication group: it is a collective.

    NOTE [Collectives by their schema]
    A collective replayed in backward runs on one rank only: the others are not replaying it, so
    it hangs or pairs with an unrelated collective; even when all ranks replay together (an
    expert-parallel dispatch), the bytes cross the network twice and a dispatcher that assigns
    receive slots atomically returns the tokens in another order. So the selective modes keep
    every collective's output and never replay it (design invariant 16). A collective is known
    by what it must be told: which ranks to talk to. Every collective API in use names them in
    its schema, in one of two ways:

    * a group object: ``c10d.ProcessGroup`` (``c10d::allreduce_``, ``c10d::send``,
      ``c10d::alltoall_base_``), ``c10d.SymmetricMemory`` (``symm_mem::nccl_put_signal``), a
      backend's own process group (the Ascend extension's ``npu_custom_dist::wrap_alltoallvc_inner``
      takes a ``ProcessGroupHCCL``);
    * a group's name, as a string or as ``Any`` (a name or a group object): ``group_name``
      (``_c10d_functional::*``, ``_dtensor::shard_dim_alltoall``, ``symm_mem::*``,
      ``hybridep::dispatch``), ``hcom`` (the Ascend NPU extension's matmuls fused with a collective,
      ``npu_mm_all_reduce_base``, ``npu_all_to_all_matmul``, ``npu_alltoallv_gmm``), ``group``
      (``_npu_distribute_barrier``), ``group_ep``/``group_tp`` (``npu_moe_distribute_dispatch``,
      ``_combine`` and their ``_v2``), ``process_group``.

    Only those names count, and only with a string or ``Any`` type: a string argument is not a
    group because it is a string (``reduce="sum"``, ``input_layout="BNSD"``, ``quant_mode``,
    ``comm_mode``, ``reduce_op``), and an integer named ``group``, ``groups`` or ``group_size``
    (convolution groups, group norm, grouped matmul sizes) is no group of ranks. The legacy
    ``c10d_functional::*`` ops (``str tag, int[] ranks, int group_size``) name their ranks as a
    list: ``ranks`` with ``group_size`` counts too.
    """
    schema = getattr(op, "_schema", None)
    if schema is None:
        return False
    names = set()
    for argument in schema.arguments:
        kind = _unwrapped(argument.type)
        if isinstance(kind, torch.ClassType):
            if kind.qualified_name().rpartition(".")[2].startswith(_GROUP_CLASSES):
                return True
        elif isinstance(kind, (torch.StringType, torch.AnyType)) and _names_a_group(argument.name):
            return True
        names.add(argument.name)
    return {"ranks", "group_size"} <= names


def fills_buffers(op: Any) -> bool:
    """Whether the collective ``op`` writes into tensors it is given (c10d's in-place form, its schema's name
    ending in ``_``: ``allgather_``, ``alltoall_base_``, ``recv_``), rather than returning what it computed
    (``_c10d_functional::*``, a matmul fused with a collective)."""
    schema = getattr(op, "_schema", None)
    return schema is not None and schema.name.endswith("_")


def _unwrapped(kind: Any) -> Any:
    """``T`` for ``T?`` and ``T[]``."""
    while isinstance(kind, (torch.OptionalType, torch.ListType)):
        kind = kind.getElementType()
    return kind


def _names_a_group(name: str) -> bool:
    return name in ("hcom", "group", "process_group") or name.startswith(("group_", "hcom_"))


_MAX_KEY_LENGTH_ARGUMENTS = {
    "aten::_flash_attention_forward": 6,
    "aten::_efficient_attention_forward": 7,
    "torch_attn::_varlen_attn": 6,
    "ffpa_attn::_varlen_fwd_cute": 6,
}
"""Position of the ``max_k`` argument of attention kernels that take packed variable-length
sequences (``(tokens, heads, dim)``, documents delimited by cumulative lengths)."""


def key_length(op: Any, args: tuple, dim: int) -> int:
    """How many keys each query of attention kernel ``op`` (called with ``args``) attends to: the
    length of ``key`` (its second argument) along ``dim``; for packed variable-length sequences the
    longest document's (``max_k``), not the batch's token count, which spans every document."""
    schema = getattr(op, "_schema", None)
    position = None if schema is None else _MAX_KEY_LENGTH_ARGUMENTS.get(schema.name)
    if position is not None and position < len(args) and args[position] is not None:
        return int(args[position])
    return args[1].shape[dim]
