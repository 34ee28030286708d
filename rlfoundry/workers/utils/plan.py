"""verl's update keys, read the same way for every role that runs PPO-style mini-batch updates."""

from __future__ import annotations

from typing import Any

from rlfoundry.engines.base import MicroBatching, UpdatePlan

__all__ = ["ppo_update_plan"]


def ppo_update_plan(config: Any, sizes: Any, seed: int, fix_hint: str) -> UpdatePlan:
    """``ppo_epochs``, ``shuffle`` and ``use_dynamic_bsz`` of a typed ``actor``/``critic`` subtree with the
    role's resolved per-rank ``sizes`` (``mini_batch_size``, ``micro_batch_size``, ``max_token_len``)."""
    return UpdatePlan(
        mini_batch_size=sizes.mini_batch_size,
        micro=MicroBatching(sizes.micro_batch_size, sizes.max_token_len if config.use_dynamic_bsz else None),
        epochs=config.ppo_epochs, shuffle=config.shuffle,
        seed=seed, fix_hint=fix_hint,
    )
