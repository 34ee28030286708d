"""The asynchronous pipelines' pieces that need no model: the config keys and the ``Rollouter``.

The rollouter is driven here by a trainer loop that sleeps at random (slow trainer / slow rollout
schedules, seeded); its ``generate`` stands in for the rollout pool and sleeps at random too. The
bound of ``fully_async.py`` must hold on every sample; prompts reach the trainer in loader order,
each exactly once; a pause returns only once no generation is in flight.
"""

from __future__ import annotations

import math
import random
import threading
import time
import warnings

import pytest
import torch

from rlfoundry.protocol import DataProto
from rlfoundry.single_controller import WorkerDiedError
from rlfoundry.trainer.config import ConfigError, load_config, resolve_config
from rlfoundry.trainer.ppo.fully_async import Rollouter
from rlfoundry.utils.errors import RunAbortedError


def _load(*overrides: str, config_name: str | None = None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_config(list(overrides), config_name=config_name)


# ───────────────────────────────────── config ─────────────────────────────────────


def test_fully_async_config_fills_verl_zero_batch_and_picks_the_process_backend():
    cfg = _load(config_name="fully_async_ppo_trainer")
    assert cfg.data.train_batch_size == 2 * 8  # require_batches × ppo_mini_batch_size (verl's 0)
    resolved = resolve_config(cfg, steps_per_epoch=4, cuda_available=False)
    assert resolved.trainer.worker_backend == "process"
    assert resolved.actor_rollout_ref.actor.use_rollout_log_probs is False  # recomputed: the rollout lags
    assert resolved.data.gen_batch_size == 4
    prompts = resolve_config(_load("rollout.total_rollout_steps=64", config_name="fully_async_ppo_trainer"),
                             steps_per_epoch=4, cuda_available=False)
    assert prompts.trainer.total_training_steps == 64 // 16


@pytest.mark.parametrize("overrides, message", [
    (["rollout.n_gpus_per_node=1"], "only the asynchronous pipelines use"),
    (["async_training.mode=one_step_off"], "set rollout.n_gpus_per_node >= 1"),
    (["async_training.mode=one_step_off", "rollout.n_gpus_per_node=1", "trainer.worker_backend=local"],
     "needs two worker pools"),
    (["async_training.mode=one_step_off", "rollout.n_gpus_per_node=1", "async_training.partial_rollout=true"],
     "partial_rollout=true with one-step-off .* not supported"),
    (["async_training.mode=fully_async", "rollout.n_gpus_per_node=1", "data.train_batch_size=0",
      "async_training.partial_rollout=true", "actor_rollout_ref.rollout.multi_turn.enable=true",
      "actor_rollout_ref.rollout.agent.default_agent_loop=openai_agent"],
     "partial_rollout=true with rollout.agent.default_agent_loop=openai_agent .*use tool_agent.* not supported"),
    (["async_training.mode=one_step_off", "rollout.n_gpus_per_node=1", "algorithm.filter_groups.enable=true"],
     "filter_groups.enable=true is not supported with async_training.mode=one_step_off yet; verl's one_step_off "
     "trainer does not read it either .*set algorithm.filter_groups.enable=false to run as verl does"),
    (["async_training.mode=fully_async", "rollout.n_gpus_per_node=1", "data.train_batch_size=0",
      "algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc"],
     "verl's fully_async trainer does not read it either"),
    (["async_training.mode=one_step_off", "rollout.n_gpus_per_node=1", "actor_rollout_ref.actor.use_rollout_log_probs=true",
      "actor_rollout_ref.actor.calculate_sum_pi_squared=true"], "needs the actor's log-prob pass"),
    (["async_training.mode=one_step_off", "rollout.n_gpus_per_node=1", "async_training.compute_prox_log_prob=true"],
     "compute_prox_log_prob=true is the fully-async pipeline's.*--config-name fully_async_ppo_trainer"),
    (["async_training.mode=fully_async", "rollout.n_gpus_per_node=1", "data.train_batch_size=12"],
     r"trains async_training.require_batches × actor.ppo_mini_batch_size = 8 prompts.*set it to 8"),
    (["async_training.mode=fully_async", "rollout.n_gpus_per_node=1", "data.train_batch_size=0",
      "data.gen_batch_size=3"], "data.gen_batch_size=3 must divide the 8 prompts"),
])
def test_async_config_errors_name_the_key_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _load(*overrides)


def test_verls_fully_async_4_12_layout_is_refused_at_start_up_as_verl_refuses_it():
    # dapo_7b_math_fsdp2_4_12.sh: require_batches 4 x ppo_mini_batch_size 32 prompts x n 16 = 2048 samples per
    # step on 2 x 6 trainer GPUs. verl's first step stops on its balance_batch ("2048 % 12 != 0"), and with
    # balance_batch off on its dispatch and (August) on its worker's 512 % 12; here it stops before any worker
    # starts, naming the sizes that split (33 prompts: 528 = 12 x 44; or 16 trainer ranks: 512 = 16 x 32)
    layout = ["trainer.nnodes=2", "trainer.n_gpus_per_node=6", "rollout.nnodes=2", "rollout.n_gpus_per_node=2",
              "trainer.worker_backend=ray", "data.train_batch_size=0", "async_training.require_batches=4",
              "actor_rollout_ref.rollout.n=16", "actor_rollout_ref.actor.use_dynamic_bsz=true"]
    with pytest.raises(ConfigError) as e:
        _load(*layout, "actor_rollout_ref.actor.ppo_mini_batch_size=32", config_name="fully_async_ppo_trainer")
    assert "512 samples per mini-batch cannot be split evenly over 12 data-parallel ranks" in str(e.value)
    assert "verl does not run it as asked either" in str(e.value)
    assert "multiple of 3 (30 or 33)" in str(e.value)
    cfg = _load(*layout, "actor_rollout_ref.actor.ppo_mini_batch_size=33", config_name="fully_async_ppo_trainer")
    assert cfg.data.train_batch_size == 4 * 33


# ───────────────────────────────────── the rollouter ─────────────────────────────────────


def _prompt_batches(size: int):
    """(loader state, batch) with prompt ids 0, 1, 2 ... in order; the state is the next id."""
    start = 0
    while True:
        yield {"next": start}, {"input_ids": torch.arange(start, start + size).view(size, 1)}
        start += size


def _wait_until(condition, what: str, limit_s: float = 30.0) -> None:
    """Polls ``condition``; the limit only turns a hang into a failure, nothing is timed."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"still waiting for {what} after {limit_s} s"
        time.sleep(0.002)


class _Rollout:
    """Generation that takes a random while; checks that a pause never overlaps it."""

    def __init__(self, rng: random.Random, slow: float):
        self.rng, self.slow, self.running, self.calls = rng, slow, False, 0

    def __call__(self, batch_dict: dict, boundary) -> DataProto:
        self.running = True
        self.calls += 1
        time.sleep(self.rng.uniform(0, self.slow))
        self.running = False
        ids = batch_dict["input_ids"].repeat_interleave(2, dim=0)  # n = 2 samples per prompt
        return DataProto.from_dict(tensors={"input_ids": ids})


@pytest.mark.parametrize("staleness", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("seed, slow_rollout, slow_trainer", [(0, 0.01, 0.0), (1, 0.0, 0.01), (2, 0.005, 0.005)])
def test_the_staleness_bound_holds_under_random_schedules(staleness, seed, slow_rollout, slow_trainer):
    rng, step_prompts, sync_every, gen, steps = random.Random(seed), 4, 2, 2, 12
    rollout = _Rollout(random.Random(seed + 100), slow_rollout)
    rollouter = Rollouter(rollout, _prompt_batches(gen), per_sync=step_prompts * sync_every,
                          staleness_threshold=staleness, first_index=0, total_prompts=steps * step_prompts, version=0)
    rollouter.start(gen)
    seen, worst, deepest = [], 0, 0
    try:
        for step in range(1, steps + 1):
            version = (step - 1) // sync_every
            items = rollouter.take(step_prompts, timeout_s=30, trainer_version=version)  # the trainer's check on
            for item in items:
                assert 0 <= version - item.version <= math.ceil(staleness)
                worst = max(worst, version - item.version)
                seen += item.batch.batch["input_ids"][::2, 0].tolist()
            time.sleep(rng.uniform(0, slow_trainer))
            deepest = max(deepest, rollouter.queued_prompts())
            if step % sync_every == 0:
                rollouter.pause()
                assert not rollout.running  # the sync never meets a generation in flight
                rollouter.resume(version=step // sync_every)
    finally:
        rollouter.stop()
    assert seen == list(range(steps * step_prompts))  # loader order, each prompt exactly once
    assert deepest <= step_prompts * sync_every * (1 + staleness)  # the queue is bounded by the rule
    if staleness == 0:
        assert worst == 0


@pytest.mark.parametrize("staleness", [0.0, 0.5, 2.0])
def test_a_rollout_that_keeps_ahead_is_stopped_exactly_at_the_bound(staleness):
    """The trainer takes each step only once the queue holds every prompt the rule admits, so each step
    meets the rollout as far ahead as it may be. By hand (per_sync = 8, batches of 2, 48 prompts): at
    version v the rule admits prompts below min(8·(v + 1 + s), 48); step 2v + 1 has trained 8v; prompt
    8v was admitted under v - ceil(s) (s = 2: under v - 2, as 8v < 8·(v - 2 + 3)), so the stalest sample
    is ceil(s) versions old and the deepest queue is 8·(1 + s), the bound, reached and not passed."""
    step_prompts, sync_every, gen, steps = 4, 2, 2, 12
    per_sync, total = step_prompts * sync_every, steps * step_prompts
    rollouter = Rollouter(_Rollout(random.Random(0), 0.0), _prompt_batches(gen), per_sync=per_sync,
                          staleness_threshold=staleness, first_index=0, total_prompts=total, version=0)
    rollouter.start(gen)
    worst, deepest = 0, 0
    try:
        for step in range(1, steps + 1):
            version, trained = (step - 1) // sync_every, (step - 1) * step_prompts
            admitted = min(math.floor(per_sync * (version + 1 + staleness)), total)
            _wait_until(lambda: rollouter.queued_prompts() >= admitted - trained, f"step {step}'s prompts")
            deepest = max(deepest, rollouter.queued_prompts())
            worst = max(worst, *(version - item.version for item in rollouter.take(step_prompts, timeout_s=30)))
            if step % sync_every == 0:
                rollouter.pause()
                rollouter.resume(version=step // sync_every)
    finally:
        rollouter.stop()
    assert worst == math.ceil(staleness)
    assert deepest == per_sync * (1 + staleness)


@pytest.mark.parametrize("staleness", [0.0, 0.5, 1.0])
def test_samples_older_than_the_threshold_are_refused_not_trained(staleness):
    """The trainer's side holds the bound on its own: samples more than ⌈s⌉ versions older than the
    trainer (as a trainer that synced without telling the rollouter would meet) stop the run with an
    error; exactly at the bound they are trained. The refused samples stay queued."""
    rollouter = Rollouter(_Rollout(random.Random(0), 0.0), _prompt_batches(2), per_sync=4,
                          staleness_threshold=staleness, first_index=0, total_prompts=16, version=0)
    rollouter.start(2)
    try:
        _wait_until(lambda: rollouter.queued_prompts() >= 4, "version 0's prompts generated")
        bound = math.ceil(staleness)
        assert [item.version for item in rollouter.take(2, timeout_s=30, trainer_version=bound)] == [0]
        with pytest.raises(RunAbortedError, match=f"version 0 reached the trainer at version {bound + 1}"):
            rollouter.take(2, timeout_s=30, trainer_version=bound + 1)
        assert rollouter.queued_prompts() >= 2
    finally:
        rollouter.stop()


def test_a_paused_rollouter_reports_the_position_of_the_oldest_untrained_prompt():
    rollouter = Rollouter(_Rollout(random.Random(0), 0.0), _prompt_batches(2), per_sync=4,
                          staleness_threshold=1.0, first_index=0, total_prompts=16, version=0)
    rollouter.start(2)
    try:
        rollouter.take(4, timeout_s=30)  # prompts 0-3 trained
        _wait_until(lambda: rollouter.queued_prompts() >= 4, "prompts 4-7 generated ahead")
        rollouter.pause()
        state, regenerate = rollouter.position(lambda: {"next": -1})
        assert state == {"next": 4} and regenerate == 4  # a resume starts again at prompt 4
    finally:
        rollouter.stop()


def test_a_dead_rollout_worker_reaches_the_trainer_with_its_role_and_rank():
    def dies(batch_dict, boundary):
        raise WorkerDiedError("rollout_pool/rollout", 1, "generate_sequences", RuntimeError("process exit code -9"))

    rollouter = Rollouter(dies, _prompt_batches(2), per_sync=4, staleness_threshold=0.0, first_index=0,
                          total_prompts=8, version=0)
    rollouter.start(2)
    with pytest.raises(WorkerDiedError, match="'rollout_pool/rollout' rank 1 died while running 'generate_sequences'"):
        rollouter.take(4, timeout_s=30)
    rollouter.stop()


def test_the_trainer_never_waits_for_ever_on_an_empty_queue():
    """take() gives up once its clock passes the deadline, and not before. The injected clock reads
    0.0 to the rollouter until its generation is stuck, then 0.0 (take's start: deadline 0.3), 0.29
    (still waiting) and 0.31 (past it: the error, with no further reading)."""
    entered, release, readings = threading.Event(), threading.Event(), []

    def stuck(batch_dict, boundary):
        entered.set()
        release.wait(30)
        return DataProto.from_dict(tensors={"input_ids": batch_dict["input_ids"]})

    rollouter = Rollouter(stuck, _prompt_batches(2), per_sync=4, staleness_threshold=0.0, first_index=0,
                          total_prompts=8, version=0, clock=lambda: readings.pop(0) if readings else 0.0)
    rollouter.start(2)
    assert entered.wait(30)
    readings += [0.0, 0.29, 0.31]
    with pytest.raises(RunAbortedError, match=r"no samples from the rollout pool for 0.3 s .* rollouter generating"):
        rollouter.take(4, timeout_s=0.3)
    assert readings == []  # it read 0.29 and waited on, then gave up at 0.31
    release.set()
    rollouter.stop()


def test_a_pause_between_chunks_lets_the_sync_in_mid_generation_and_the_position_counts_it():
    """Partial rollout: the pause returns at the generation's next chunk boundary, not at its end;
    the generation then goes on under the new version, and a checkpoint taken meanwhile restarts
    at that generation's prompts."""
    first_chunk, versions = threading.Event(), []

    def chunked(batch_dict, boundary):
        versions.append(boundary())
        first_chunk.set()
        _wait_until(lambda: rollouter._paused, "the pause")  # the first chunk is under way when the trainer asks for it
        versions.append(boundary())  # the pause happens here
        return DataProto.from_dict(tensors={"input_ids": batch_dict["input_ids"]})

    rollouter = Rollouter(chunked, _prompt_batches(2), per_sync=4, staleness_threshold=1.0, first_index=0,
                          total_prompts=2, version=0)
    rollouter.start(2)
    try:
        assert first_chunk.wait(30)
        rollouter.pause()
        assert versions == [0]  # paused between the chunks: the generation has not finished
        assert rollouter.position(lambda: {"next": -1}) == ({"next": 0}, 2)
        rollouter.resume(version=1)
        items = rollouter.take(2, timeout_s=30)
        assert versions == [0, 1] and items[0].version == 0  # admitted under 0, finished under 1
        assert rollouter.stats()["async/paused_in_flight"] == 1
    finally:
        rollouter.stop()


def test_a_pause_at_a_generations_start_is_waited_out_there_and_not_counted_as_mid_way():
    """The first boundary of a chunked generation comes before any chunk: a sync that arrives
    between the admission and that first call is waited out there, and the whole generation samples
    under the new version; no sample spans two versions, so ``paused_in_flight`` stays 0."""
    admitted, versions = threading.Event(), []

    def chunked(batch_dict, boundary):
        admitted.set()
        _wait_until(lambda: rollouter._paused, "the pause")  # the trainer pauses before the first chunk
        versions.append(boundary())
        versions.append(boundary())
        return DataProto.from_dict(tensors={"input_ids": batch_dict["input_ids"]})

    rollouter = Rollouter(chunked, _prompt_batches(2), per_sync=4, staleness_threshold=1.0, first_index=0,
                          total_prompts=2, version=0)
    rollouter.start(2)
    try:
        assert admitted.wait(30)
        rollouter.pause()
        assert versions == []
        rollouter.resume(version=1)
        rollouter.take(2, timeout_s=30)
        assert versions == [1, 1]
        assert rollouter.stats()["async/paused_in_flight"] == 0
    finally:
        rollouter.stop()
