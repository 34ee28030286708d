"""The start-up checks ask the training engines' plug-ins, and a strategy no engine is registered
under is a config error naming the key, never a traceback from the registry."""

from __future__ import annotations

import pytest

from rlfoundry.trainer.config import ConfigError, load_config, resolve_config


def test_a_misspelt_strategy_is_a_config_error_with_the_nearest_name():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref.actor.strategy='fsdq' is not one of .*did you mean 'fsdp'"):
        load_config(["actor_rollout_ref.actor.strategy=fsdq"])


def test_deprecated_global_micro_batches_divide_over_the_data_parallel_ranks():
    """verl divides a global micro-batch over the data-parallel ranks: 2 ranks in one Ulysses group of
    2 are 1 data-parallel rank, so ppo_micro_batch_size=4 is 4 per rank (over the 2 ranks it would be 2)."""
    cfg = load_config(["trainer.n_gpus_per_node=2", "actor_rollout_ref.actor.ppo_micro_batch_size=4",
                       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=null",
                       "actor_rollout_ref.actor.ulysses_sequence_parallel_size=2",
                       "actor_rollout_ref.model.use_remove_padding=true"])
    resolved = resolve_config(cfg, steps_per_epoch=1, cuda_available=False)
    assert resolved.actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu == 4


def test_a_curriculum_sampler_is_refused_by_the_fully_asynchronous_pipeline():
    from types import SimpleNamespace

    from rlfoundry.data.sampler import AbstractCurriculumSampler
    from rlfoundry.trainer.ppo.fully_async import _refuse_curriculum

    class Curriculum(AbstractCurriculumSampler):
        def __init__(self):
            pass

        def __iter__(self):
            return iter(())

        def __len__(self):
            return 0

        def update(self, batch):
            pass

    _refuse_curriculum(SimpleNamespace(sampler=None))  # a plain loader is fine
    with pytest.raises(ConfigError, match="curriculum sampler.*async_training.mode=one_step_off"):
        _refuse_curriculum(SimpleNamespace(sampler=Curriculum()))
