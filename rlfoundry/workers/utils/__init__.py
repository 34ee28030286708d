"""Plumbing shared by the worker roles (actor, ref, critic, reward model).

- ``seqlen_balancing``: token-budget micro-batches (``use_dynamic_bsz``) and the trainer's
  ``balance_batch`` partitions.
- ``padding``: padding removal for forward passes (``model.use_remove_padding``).
- ``checkpoint``: sharded save/load with ``torch.distributed.checkpoint``, HF export, and the
  atomic ``latest_checkpointed_iteration.txt`` protocol the trainer resumes from.

Import from the submodules; this package keeps its import cheap.
"""
