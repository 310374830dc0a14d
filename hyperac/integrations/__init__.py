"""hyperac inside training stacks.

* :mod:`hyperac.integrations.transformers`: HuggingFace ``Trainer`` (``HyperACCallback``,
  ``apply_from_training_args``); importing it needs ``transformers``.

PyTorch's own parallel wrappers need no integration code: apply hyperac, then wrap (FSDP2's
``fully_shard``, ``DistributedDataParallel``, ``torch.compile``); the README's "Training stacks"
section gives the order and what each composition was tested with.

Nothing here is imported by ``import hyperac``.
"""
