"""One-step-off-policy PPO (verl's ``one_step_off_ppo_trainer``): generation of batch k+1 runs in
the rollout's own pool while the trainer's pool updates on batch k.

    step k:  wait for batch k's samples → send the weights after update k−1 to the rollout
             → start generating batch k+1 (no wait) → rewards, log-probs, advantages, update k

Batch k+1 is therefore sampled by the policy one update behind the one that trains on it
(staleness 1; the first batch, and the first after a resume, 0). The trainer's old log-probs are
recomputed under its own weights (the decoupled PPO objective); the rollout's log-probs stay in the
batch for ``algorithm.rollout_correction`` and the ``rollout_corr/*`` metrics. Everything after
the rewards is the synchronous trainer's code (``RayPPOTrainer._train_on``).

Checkpoints store the loader's position *before* the batch in flight: a resumed run generates that
batch again (under the restored weights, so with staleness 0) — no prompt is trained twice or
skipped.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from rlfoundry.trainer.metric_utils import marked_timer
from rlfoundry.trainer.ppo.ray_trainer import RayPPOTrainer

__all__ = ["OneStepOffPPOTrainer", "staleness_metrics"]


def staleness_metrics(staleness: list[int]) -> dict[str, float]:
    """Per-sample staleness (trainer updates − updates the sampling weights had): min / mean / max."""
    if not staleness:
        return {}
    return {"async/staleness_min": float(min(staleness)), "async/staleness_mean": sum(staleness) / len(staleness),
            "async/staleness_max": float(max(staleness))}


class OneStepOffPPOTrainer(RayPPOTrainer):
    """The synchronous trainer with generation moved one step ahead, on a rollout pool of its own."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: Any = None  # the WorkerFuture of the next batch's generation
        self._pending_version = 0  # training steps reflected in the weights that sample it
        self._lookahead: tuple[int, dict] | None = None
        self._base: Iterator[tuple[int, dict]] | None = None
        self._loader_state: dict | None = None  # the loader before the batch in flight

    def _batches(self) -> Iterator[tuple[int, dict]]:
        """The base sequence; a step pulls the next batch early (``_pull_next``) and it comes next."""
        self._base = super()._batches()
        while True:
            item, self._lookahead = self._lookahead or next(self._base, None), None
            if item is None:
                return
            yield item

    def _pull_next(self) -> dict | None:
        # the base generator stops here when this step is the budget's last
        self._loader_state = self.train_dataloader.state_dict()
        self._lookahead = next(self._base, None)
        return None if self._lookahead is None else self._lookahead[1]

    def train_step(self, batch_dict: dict, more_batches: Iterator[dict] | None = None) -> dict[str, float]:
        metrics: dict[str, float] = {}
        timing: dict[str, float] = {}
        done = self.state.global_steps - 1  # updates applied before this step's
        with marked_timer("step", timing):
            if self._pending is None:  # the first step, or the first after a resume: nothing in flight
                self._start_generation(batch_dict, done)
            with marked_timer("gen", timing):  # the part of the generation the trainer waits for
                batch = self._generated(self._pending.get())
            metrics["timing_s/rollout_gen"] = float(batch.meta_info.get("generate_seconds", 0.0))
            metrics |= staleness_metrics([done - self._pending_version] * len(batch))
            self._pending = None
            metrics |= self._sync_weights(timing)
            upcoming = self._pull_next()
            if upcoming is not None:
                self._start_generation(upcoming, done)
            batch, m = self._reward(batch, timing); metrics |= m  # noqa: E702
            batch, m = self._train_on(batch, timing); metrics |= m  # noqa: E702
        return metrics | self._step_metrics(batch, timing)

    def _validate(self) -> dict[str, float]:
        """On the trainer's latest weights (the rollout otherwise holds those of one update earlier)."""
        self._sync_weights({})
        return super()._validate()

    def _start_generation(self, batch_dict: dict, version: int) -> None:
        self._pending = self.rollout_wg.generate_sequences.future(self._prompts(batch_dict))
        self._pending_version = version

    def _trainer_state(self) -> dict[str, Any]:
        state = super()._trainer_state()
        if self._loader_state is not None:  # the batch in flight is generated again after a resume
            state["dataloader"] = self._loader_state
        return state
