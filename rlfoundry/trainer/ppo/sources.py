"""Where each training step's batch comes from: sample sources feeding one ``PPOTrainer.train_on``.

A source hands the trainer a batch that is generated and scored; everything after the rewards
(log-probs, values, advantages, the updates) is the trainer's one code path. The sources:

- ``SyncSource``: the next prompts from the loader, generated on the trainer's pool (verl's default);
- ``DynamicSamplingSource`` (``algorithm.filter_groups``, DAPO): generates and scores further batches
  from the same loader until enough groups whose metric varies are kept;
- ``OneStepOffSource`` (``one_step_off.py``): generation of batch k+1 overlaps update k, on a
  rollout pool of its own;
- ``FullyAsyncSource`` (``fully_async.py``): a rollouter streams samples, the trainer takes them.

A source also says what a checkpoint must record for it (the loader's position before the batches
in flight), what quiets it for validation and saving, and what it does after each update (weight
syncs to its pool).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from rlfoundry.algos import filter_groups
from rlfoundry.protocol import DataProto
from rlfoundry.utils.errors import RunAbortedError

__all__ = ["DynamicSamplingSource", "SampleSource", "SyncSource", "loader_batches", "rewound_sampling_state"]


def rewound_sampling_state(trainer: Any, calls_to_redo: int) -> dict[str, Any]:
    """The rollout pool's sampling state as it was before the last ``calls_to_redo`` generation calls
    (those of prompts a resumed run generates again), for a checkpoint: the engines count their calls
    and seed each call's draws from that count (``HFRollout._next_generator``), so a resumed pool that
    restarted from 0 would sample the regenerated prompts with other draws than the uninterrupted run."""
    state = dict(trainer.rollout_wg.rollout_sampling_state())
    if "calls" in state:
        state["calls"] = max(0, int(state["calls"]) - calls_to_redo)
    return state


def loader_batches(loader: Any, with_state: bool = False) -> Iterator[Any]:
    """The loader's batches (with ``with_state``: (the loader's state before it, batch)), epoch after
    epoch, continuing a restored loader mid-epoch. A loader restored exactly at an epoch boundary may
    yield nothing on its first pass (verl then skipped a whole epoch); here that empty pass rolls over
    into the next. The caller decides when to stop, so the loader is never advanced past the last
    batch a step took."""
    empty_passes = 0
    while True:
        yielded = False
        state = loader.state_dict() if with_state else None
        for batch_dict in loader:
            yielded = True
            yield (state, batch_dict) if with_state else batch_dict
            state = loader.state_dict() if with_state else None
        empty_passes = 0 if yielded else empty_passes + 1
        if empty_passes > 1:
            raise RuntimeError("the training data loader yields no batches")


class SampleSource:
    """The synchronous trainer's defaults; the other sources override what they change."""

    def __init__(self, trainer: Any):
        self.trainer = trainer  # the PPOTrainer: its generate / reward / sync_weights phases

    def next_batch(self, timing: dict) -> tuple[DataProto, dict[str, float]]:
        """This step's batch, generated and scored, and the metrics of getting it."""
        raise NotImplementedError

    def steps_per_epoch(self) -> int:
        return len(self.trainer.train_dataloader)

    def after_update(self, timing: dict) -> dict[str, float]:
        """After the step's updates (weight syncs to a pool of its own)."""
        return {}

    def before_validation(self) -> None:
        """Before validation generates (a rollout pool of its own takes the latest weights)."""

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Validation and checkpoints run inside this (a rollouter pauses for them)."""
        yield

    def checkpoint_state(self) -> dict[str, Any]:
        """What the trainer's checkpoint state must hold for this source (replacing its defaults)."""
        return {}

    def on_resume(self, state: dict[str, Any]) -> None:
        """After the trainer restored ``state`` from a checkpoint."""

    def close(self) -> None:
        """The run ends (also on an error)."""


class SyncSource(SampleSource):
    """The next prompts from the loader, generated on the trainer's pool and scored."""

    def __init__(self, trainer: Any):
        super().__init__(trainer)
        self.loader = loader_batches(trainer.train_dataloader)

    def next_batch(self, timing: dict) -> tuple[DataProto, dict[str, float]]:
        batch = self.trainer.generate(next(self.loader), timing)
        return self.trainer.reward_in_background(batch, timing)  # = reward unless launch_reward_fn_async


class DynamicSamplingSource(SyncSource):
    """DAPO dynamic sampling: generate and score batches, keep the groups whose
    ``filter_groups.metric`` varies, until ``data.train_batch_size`` groups are kept (the first ones,
    in order); the loader moves on by every batch used, so a resumed run continues alike."""

    def next_batch(self, timing: dict) -> tuple[DataProto, dict[str, float]]:
        trainer = self.trainer
        cfg, want = trainer.config.algorithm.filter_groups, int(trainer.config.data.train_batch_size)
        kept: list[DataProto] = []
        counts = {"num_gen_batches": 0, "kept_groups": 0, "dropped_groups": 0}
        reward_metrics: dict[str, float] = {}
        while counts["kept_groups"] < want:
            if counts["num_gen_batches"]:
                self._check_budget(cfg, counts, want)
            counts["num_gen_batches"] += 1
            batch = trainer.generate(next(self.loader), timing, balance=False)
            batch, result = trainer.reward(batch, timing, return_result=True)
            for key, value in trainer.reward_metrics(result).items():  # error counts add up; the rest: last batch
                reward_metrics[key] = reward_metrics.get(key, 0.0) + value if key.startswith("reward/errors") else value
            uids = batch.non_tensor_batch["uid"]
            keep = filter_groups.informative_rows(uids, self._metric(batch, result, cfg.metric))
            counts["kept_groups"] += len(set(uids[keep]))
            counts["dropped_groups"] += len(set(uids[~keep]))
            kept.append(batch.select_idxs(np.flatnonzero(keep)))
        batch = trainer.concat_generations(kept)
        batch = batch.select_idxs(np.flatnonzero(filter_groups.first_groups(batch.non_tensor_batch["uid"], want)))
        batch = trainer.finish_generation(batch)
        return batch, reward_metrics | {f"train/{k}": float(v) for k, v in counts.items()}

    @staticmethod
    def _check_budget(cfg: Any, counts: dict[str, int], want: int) -> None:
        if cfg.max_num_gen_batches > 0 and counts["num_gen_batches"] >= cfg.max_num_gen_batches:
            raise RunAbortedError(
                f"algorithm.filter_groups: {counts['num_gen_batches']} generated batches "
                f"(max_num_gen_batches={cfg.max_num_gen_batches}) kept {counts['kept_groups']} of the {want} "
                f"informative groups needed ({counts['dropped_groups']} groups had the same {cfg.metric} in every "
                "sample). Raise algorithm.filter_groups.max_num_gen_batches (0: no cap), rollout.n or the "
                "temperature, or choose a metric that varies within groups.")

    @staticmethod
    def _metric(batch: DataProto, result: dict, metric: str) -> np.ndarray:
        if metric in ("seq_reward", "seq_final_reward"):  # no KL in the reward (config check): final = scores
            return batch.batch["token_level_scores"].sum(-1).cpu().numpy()  # host whatever device scored it
        info = result.get("reward_extra_info", {})
        if metric not in info:
            raise RunAbortedError(f"algorithm.filter_groups.metric={metric!r} is neither seq_reward, seq_final_reward nor "
                                  f"a reward_extra_info key of the reward function (it gives {sorted(info)})")
        return np.asarray(info[metric], dtype=np.float64)
