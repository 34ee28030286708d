"""Out-of-memory handling for the worker passes.

Forward-only passes (generation, log-probs, values) keep nothing between micro-batches, so an OOM
there is recoverable: :meth:`MicroBatchBackoff.run` retries the pass with half the micro-batch (down
to a floor, normally one row) and keeps the smaller size for the rest of the run, since the memory
peak that broke it will come back. An OOM in an update is not retried: the micro-batches already
done have accumulated gradients and earlier mini-batches of the call have stepped the optimiser,
so a retry would not be the step the config describes. :func:`update_or_explain_oom` stops the
run instead, naming the keys to lower.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from rlfoundry.utils import faults
from rlfoundry.utils.errors import TrainingOutOfMemoryError

__all__ = ["MicroBatchBackoff", "backoff_of", "update_or_explain_oom"]

logger = logging.getLogger(__name__)
T = TypeVar("T")

# role → (config prefix of its update keys, config prefix of its model keys)
_ROLE_KEYS = {"actor": ("actor_rollout_ref.actor", "actor_rollout_ref.model"), "critic": ("critic", "critic.model")}


def _free_cached_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class MicroBatchBackoff:
    """Per-pass caps on the micro-batch size, lowered on OOM and kept for the rest of the run."""

    def __init__(self) -> None:
        self.caps: dict[str, int] = {}

    def size(self, name: str, configured: int) -> int:
        return min(int(configured), self.caps.get(name, int(configured)))

    def run(self, name: str, configured: int, fn: Callable[[int], T], floor: int = 1, unit: str = "rows") -> T:
        """``fn(size)`` with ``size`` = the configured size or its cap; halve and retry on OOM."""
        while True:
            size = self.size(name, configured)
            try:
                faults.inject(name, size=size)
                return fn(size)
            except torch.OutOfMemoryError as e:
                if size <= floor:
                    raise TrainingOutOfMemoryError(
                        f"Out of memory in {name} even with {size} {unit} per micro-batch ({e}). Lower "
                        "data.max_prompt_length / data.max_response_length, or turn on "
                        "*.fsdp_config.param_offload; the last complete checkpoint is kept."
                    ) from e
                _free_cached_memory()
                self.caps[name] = max(floor, size // 2)
                logger.warning("%s ran out of memory with %d %s per micro-batch; retrying with %d "
                               "(kept for the rest of the run)", name, size, unit, self.caps[name])


def backoff_of(worker: Any) -> MicroBatchBackoff:
    """The worker's backoff state, created on first use (workers need no constructor change)."""
    return worker.__dict__.setdefault("_oom_backoff", MicroBatchBackoff())


def update_or_explain_oom(role: str, fn: Callable[[], T], micro_batch_size: Any = None) -> T:
    """Run a ``role`` ("actor" / "critic") update; an OOM stops the run naming the keys to lower."""
    try:
        return fn()
    except torch.OutOfMemoryError as e:
        update, model = _ROLE_KEYS[role]
        raise TrainingOutOfMemoryError(
            f"Out of memory in the {role} update ({e}). Updates are not retried with a smaller "
            f"micro-batch (the optimiser step would change). Lower {update}.ppo_micro_batch_size_per_gpu "
            f"(now {micro_batch_size}), or {update}.ppo_max_token_len_per_gpu with use_dynamic_bsz, or "
            f"data.max_response_length (rollout.response_length); or turn on "
            f"{model}.enable_gradient_checkpointing=True and the offload keys "
            f"{update if role == 'actor' else model}.fsdp_config.param_offload / optimizer_offload. "
            "The last complete checkpoint is kept: fix the config and resume with trainer.resume_mode=auto."
        ) from e
