"""One-step-off-policy PPO (verl's ``one_step_off_ppo_trainer``): generation of batch k+1 runs in
the rollout's own pool while the trainer's pool updates on batch k.

    step k:  wait for batch k's samples → send the weights after update k−1 to the rollout
             → start generating batch k+1 (no wait) → rewards, log-probs, advantages, update k

Batch k+1 is therefore sampled by the policy one update behind the one that trains on it
(staleness 1; the first batch, and the first after a resume, 0). The trainer's old log-probs are
recomputed under its own weights (the decoupled PPO objective); the rollout's log-probs stay in the
batch for ``algorithm.rollout_correction`` and the ``rollout_corr/*`` metrics. This is a sample
source (``sources.py``): everything after the rewards is the trainer's one code path (``PPOTrainer.train_on``).

Checkpoints store the loader's position *before* the batch in flight, and the rollout pool's sampling
position before its generation call: a resumed run generates that batch again (under the restored
weights, so with staleness 0) — no prompt is trained twice or skipped.
"""

from __future__ import annotations

from typing import Any

from rlfoundry.protocol import DataProto
from rlfoundry.trainer.metric_utils import marked_timer
from rlfoundry.trainer.ppo.sources import SampleSource, loader_batches, rewound_sampling_state

__all__ = ["OneStepOffSource", "staleness_metrics"]


def staleness_metrics(staleness: list[int]) -> dict[str, float]:
    """Per-sample staleness (trainer updates − updates the sampling weights had): min / mean / max."""
    if not staleness:
        return {}
    return {"async/staleness_min": float(min(staleness)), "async/staleness_mean": sum(staleness) / len(staleness),
            "async/staleness_max": float(max(staleness))}


class OneStepOffSource(SampleSource):
    """Generation moved one step ahead, on a rollout pool of its own."""

    def __init__(self, trainer: Any) -> None:
        super().__init__(trainer)
        self.loader = loader_batches(trainer.train_dataloader)
        self._pending: Any = None  # the WorkerFuture of the next batch's generation
        self._pending_version = 0  # training steps reflected in the weights that sample it
        self._loader_state: dict | None = None  # the loader before the batch in flight

    def next_batch(self, timing: dict) -> tuple[DataProto, dict[str, float]]:
        trainer, metrics = self.trainer, {}
        done = trainer.state.global_steps - 1  # updates applied before this step's
        if self._pending is None:  # the first step, or the first after a resume: nothing in flight
            self._start_generation(next(self.loader), done)
        with marked_timer("gen", timing):  # the part of the generation the trainer waits for
            batch = trainer.generated(self._pending.get())
        metrics["timing_s/rollout_gen"] = float(batch.meta_info.get("generate_seconds", 0.0))
        metrics |= staleness_metrics([done - self._pending_version] * len(batch))
        self._pending = None
        metrics |= trainer.sync_weights(timing)
        # the loader after this step's batch: what a checkpoint records unless a next batch is in flight
        self._loader_state = trainer.train_dataloader.state_dict()
        if trainer.state.global_steps < trainer.total_training_steps:  # no generation past the last step
            self._start_generation(next(self.loader), done)
        batch, m = trainer.reward(batch, timing)
        return batch, metrics | m

    def before_validation(self) -> None:
        """On the trainer's latest weights (the rollout otherwise holds those of one update earlier)."""
        self.trainer.sync_weights({})

    def _start_generation(self, batch_dict: dict, version: int) -> None:
        self._pending = self.trainer.rollout_wg.generate_sequences.future(self.trainer.prompts(batch_dict))
        self._pending_version = version

    def checkpoint_state(self) -> dict[str, Any]:
        # the batch in flight is generated again after a resume (the pool answers the state query after
        # that generation, whose call it then counts: one call to redo)
        if self._loader_state is None:
            return {}
        return {"dataloader": self._loader_state,
                "rollout_sampling": rewound_sampling_state(self.trainer, int(self._pending is not None))}

    def on_resume(self, state: dict[str, Any]) -> None:
        if "rollout_sampling" in state:
            self.trainer.rollout_wg.load_rollout_sampling_state(state["rollout_sampling"])
