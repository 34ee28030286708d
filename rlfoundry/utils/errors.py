"""Errors that stop a run on purpose, with a message that says what to change.

``main_ppo`` prints them as one paragraph and exits with ``EXIT_RUN_ABORTED`` (config mistakes,
found before training, exit with 2). Raised from worker processes, they reach the driver wrapped
by Ray in a class that still subclasses them, so one ``except RunAbortedError`` catches both.
"""

from __future__ import annotations

__all__ = ["EXIT_RUN_ABORTED", "RunAbortedError", "NonFiniteLossError", "TrainingOutOfMemoryError",
           "CheckpointSaveError", "CheckpointCorruptError", "CheckpointMismatchError", "WeightSyncError",
           "StaleWeightsError"]

EXIT_RUN_ABORTED = 3


class RunAbortedError(RuntimeError):
    """Training cannot usefully continue; the last complete checkpoint is kept."""


class NonFiniteLossError(RunAbortedError):
    """Too many consecutive steps had a NaN/Inf loss or gradient (every one of them was skipped)."""


class TrainingOutOfMemoryError(RunAbortedError):
    """Out of memory in an update, or in a forward pass already down to its smallest micro-batch."""


class CheckpointSaveError(RunAbortedError):
    """Writing a checkpoint failed (disk full, permissions ...); the previous one is intact."""


class CheckpointMismatchError(RunAbortedError):
    """An intact checkpoint of a different model layout (a LoRA adapter vs a whole model, another rank)."""


class WeightSyncError(RunAbortedError):
    """A weight sync between the trainer and a rollout pool failed or timed out; the message names the
    rank that did not join or stopped answering (``workers/checkpoint_engine.py``)."""


class StaleWeightsError(RunAbortedError):
    """After a sync the rollout engine's weights differ from the trainer's, or a sample was generated
    with an older policy version than the trainer expects (``workers/weight_sync.py``)."""


class CheckpointCorruptError(RunAbortedError):
    """A checkpoint file no longer matches the size or checksum recorded when it was saved.

    ``path`` and ``problem`` (e.g. ``"is missing"``) let a caller that tried several steps list
    each step's damaged file in one short message.
    """

    def __init__(self, message: str, path: str | None = None, problem: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.problem = problem
