"""Driver-side guards of the training loop: non-finite steps, failed saves, the per-step record.

Each piece is called from one line of ``PPOTrainer.fit`` / ``_maybe_validate_and_save``:

- :class:`NonFiniteGuard` stops the run after ``trainer.max_consecutive_nan_steps`` steps in a row
  whose update was skipped for a NaN/Inf loss or gradient (the workers skip the optimiser step,
  so the weights never see the NaN; a run that keeps producing them is not learning).
- :func:`checkpoint_save_guard` turns a failed save (disk full, permissions) into a message that
  says the previous checkpoint is intact, after removing the partial one.
- :func:`log_extra` adds the validation / checkpoint metrics to the step's record, which the loop
  wrote *before* saving: a crash between a checkpoint and its record would otherwise leave a
  resumable step with no line in ``metrics.jsonl`` (resuming drops records after the checkpoint,
  so records and checkpoints must only ever err on the side of the record).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from rlfoundry.utils.errors import CheckpointSaveError, NonFiniteLossError

__all__ = ["NonFiniteGuard", "checkpoint_save_guard", "log_extra", "NAN_METRICS"]

# Per-step counts of optimiser steps skipped for a non-finite loss/gradient (workers/actor.py, critic.py).
NAN_METRICS = ("actor/nan_skipped", "critic/nan_skipped")


class NonFiniteGuard:
    """Counts consecutive training steps with a skipped (non-finite) update; raises at the limit."""

    def __init__(self, max_consecutive: int) -> None:
        self.max_consecutive = int(max_consecutive)
        self.consecutive = 0

    def check(self, metrics: Mapping[str, Any], step: int) -> None:
        skipped = sum(float(metrics.get(k, 0.0) or 0.0) for k in NAN_METRICS)
        self.consecutive = self.consecutive + 1 if skipped > 0 else 0
        if self.max_consecutive > 0 and self.consecutive >= self.max_consecutive:
            raise NonFiniteLossError(self._message(metrics, step))

    def _message(self, metrics: Mapping[str, Any], step: int) -> str:
        which = [k.split("/")[0] for k in NAN_METRICS if float(metrics.get(k, 0.0) or 0.0) > 0]
        return (
            f"The loss or gradient of the {' and '.join(which)} was NaN/Inf in {self.consecutive} consecutive "
            f"steps (up to step {step}); every such update was skipped, so the weights hold no NaN, but the "
            "run is not learning. Likely causes: a learning rate too high (actor_rollout_ref.actor.optim.lr, "
            "critic.optim.lr), gradient clipping off or too loose (*.grad_clip), rewards on a huge scale or "
            "non-finite (check the reward function; normalise scores to about [-1, 1]), or a clip ratio that "
            "lets the importance ratio explode (actor_rollout_ref.actor.clip_ratio*). Fix it and resume from "
            f"the last checkpoint (trainer.resume_mode=auto), or raise trainer.max_consecutive_nan_steps "
            f"(now {self.max_consecutive})."
        )


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind ``e``, also when Ray wrapped it (``RayTaskError.cause``)."""
    for candidate in (e, getattr(e, "cause", None), e.__cause__):
        if isinstance(candidate, OSError):
            return candidate
    return None


@contextlib.contextmanager
def checkpoint_save_guard(root: str | Path, step: int) -> Iterator[None]:
    """Around one checkpoint save: on an OSError, clean up and raise :class:`CheckpointSaveError`."""
    from rlfoundry import checkpoint as ckpt

    try:
        yield
    except Exception as e:
        cause = _os_error(e)
        if cause is None:
            raise
        ckpt.cleanup_partial_checkpoints(root)  # no save is running any more: debris only
        previous = ckpt.find_latest_ckpt_path(root)
        kept = (f"the previous checkpoint {previous} is intact (latest_checkpointed_iteration.txt still points "
                f"at it)" if previous else "there is no earlier checkpoint")
        raise CheckpointSaveError(
            f"Saving the checkpoint of step {step} under {root} failed: {cause}. Nothing complete was lost: "
            f"{kept}, and the partial step {step} was removed. Free disk space (or set trainer.default_local_dir "
            "to a writable disk with room) and rerun with trainer.resume_mode=auto."
        ) from e


def log_extra(tracker: Any, metrics: Mapping[str, Any], step: int) -> None:
    """Merge validation/checkpoint metrics into step ``step``'s record (already logged).

    The console back end only gets them when they hold validation numbers: a second console line
    saying just how long the save took would be noise.
    """
    if not metrics:
        return
    has_val = any(k.startswith("val") for k in metrics)
    backends = None if has_val else [name for name in tracker.logger if name != "console"]
    tracker.log(dict(metrics), step=step, backend=backends)
