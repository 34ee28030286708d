"""The asynchronous pipelines end to end, through the CLI as a user runs them (each run in its own
process: a rollout pool of its own is a second set of processes).

- Fully async with staleness 0 (one generation call per step, a sync after every step) trains on
  exactly the samples the synchronous colocated run trains on and makes the same updates; the
  rollout pool's log-probs equal the trainer's at every step — which only holds if every sync
  arrived (step 2 on, a skipped sync leaves the rollout one update behind).
- One-step-off trains on the synchronous run's prompts in the same order, one update behind
  (staleness 0, then 1).
- With partial rollout, syncs meet generations between chunks and samples span two versions, the
  bound still holding.
- A SIGKILLed run (either pipeline) resumed from its checkpoint trains every prompt of the
  uninterrupted run, in the same steps, none twice; a rollout worker that dies stops the run naming it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainer import _e2e as E

pytestmark = pytest.mark.slow

STEPS = 3


def _args(model: Path, run: Path, *extra: str) -> list[str]:
    # a dense reward and a large learning rate: one update visibly moves the policy (a skipped sync shows)
    reward = E.write_reward_file(model.parent)
    return [*E.tiny_overrides(model, run, "actor_rollout_ref.actor.use_rollout_log_probs=false",
                              f"custom_reward_function.path={reward}",
                              "actor_rollout_ref.actor.optim.lr=0.02",
                              f"trainer.rollout_data_dir={run / 'gens'}", f"trainer.total_training_steps={STEPS}",
                              "trainer.logger=file"), *extra]


def _cli(args: list[str], config_name: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    flags = ["--config-name", config_name] if config_name else []
    return subprocess.run([sys.executable, "-m", "rlfoundry", "train", *flags, *args], capture_output=True, text=True,
                          env=env or E.subprocess_env(), timeout=600)


def _ok(out: subprocess.CompletedProcess) -> None:
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def _trained(run: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run / "gens" / f"{step}.jsonl").read_text().splitlines()]


def _steps(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in E.read_records(run) if "timing_s/step" in r}


_ASYNC = ["rollout.n_gpus_per_node=1"]  # the overlays' token-level IS stays on: its rollout_corr/* metrics
# compare the rollout's log-probs with the trainer's (probabilities of a tiny byte-level model are too
# small for training/rollout_probs_diff to show one update)


@pytest.fixture(scope="module")
def sync_run(tiny_model_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("sync")
    _ok(_cli(_args(tiny_model_dir, run, "algorithm.rollout_correction.rollout_is=token")))
    return run


@pytest.mark.numerics
def test_fully_async_with_staleness_zero_trains_what_the_synchronous_run_trains(tiny_model_dir, tmp_path, sync_run):
    run = tmp_path / "async"
    _ok(_cli(_args(tiny_model_dir, run, *_ASYNC, "data.gen_batch_size=2", "async_training.require_batches=1",
                   "async_training.staleness_threshold=0"), config_name="fully_async_ppo_trainer"))
    sync, fully = _steps(sync_run), _steps(run)
    for step in range(1, STEPS + 1):
        ours, theirs = _trained(run, step), _trained(sync_run, step)
        # the engine's log-probs of the same tokens, within float rounding (the two pipelines' engines batch them
        # differently: 1 ulp apart seen); every other field (prompts, tokens, masks, scores) equal
        log_probs = lambda rows: [x for r in rows for x in r.pop("rollout_log_probs")]  # noqa: E731
        assert log_probs(ours) == pytest.approx(log_probs(theirs), rel=1e-6, abs=1e-7)
        assert ours == theirs  # same prompts, responses and scores
        assert fully[step]["async/staleness_max"] == 0
        assert fully[step]["rollout_corr/log_ppl_abs_diff"] <= 1e-6  # the sync arrived, every time
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy"):
            # the same ranks, batches and update code as the synchronous run: bit for bit in practice, a stale or lost
            # sync moves them by >1e-2
            assert fully[step][key] == pytest.approx(sync[step][key], rel=1e-5, abs=1e-7), key


def test_one_step_off_trains_the_same_prompts_one_update_behind(tiny_model_dir, tmp_path, sync_run):
    run = tmp_path / "one-step-off"
    _ok(_cli(_args(tiny_model_dir, run, *_ASYNC), config_name="one_step_off_ppo_trainer"))
    steps = _steps(run)
    assert [steps[s]["async/staleness_max"] for s in range(1, STEPS + 1)] == [0, 1, 1]
    assert steps[1]["rollout_corr/log_ppl_abs_diff"] <= 1e-6  # step 1: the rollout holds the trainer's weights
    assert steps[2]["rollout_corr/log_ppl_abs_diff"] > 1e-3  # then one update behind, really
    for step in range(1, STEPS + 1):
        assert [r["index"] for r in _trained(run, step)] == [r["index"] for r in _trained(sync_run, step)]
        # recomputed old log-probs: one mini-batch, one epoch, so the update's ratio starts at exactly 1
        assert abs(steps[step]["actor/ppo_kl"]) < 1e-6
    assert all(steps[s]["async/sync_megabytes"] > 0 for s in steps)


def test_one_step_off_with_delta_syncs_sends_the_few_bf16_weights_a_small_step_moved(tiny_model_dir, tmp_path):
    """verl's ``checkpoint_engine.backend=delta_sharded`` (workers/checkpoint_engine.py): the first sync is whole,
    then, with bf16 weights and lr 1e-6, each sync carries the ~1-2% of elements whose bits one step changed
    (measured: 2120 and 1216 of 107584); every sync's load is verified (verify=true) or the run fails."""
    run = tmp_path / "delta"
    _ok(_cli([*_args(tiny_model_dir, run, *_ASYNC, "actor_rollout_ref.rollout.checkpoint_engine.backend=delta_sharded",
                     "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.delta_sharded.encoding=indices",
                     "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"), "actor_rollout_ref.actor.optim.lr=1e-6"],
             config_name="one_step_off_ppo_trainer"))
    steps = _steps(run)
    full = steps[1]["async/sync_megabytes"]
    assert steps[1]["checkpoint_engine/changed_ratio"] == 1.0 and full * 2**20 == 2 * 107584  # bf16, whole
    for step in (2, 3):  # after one update each: a few percent changed, (4 + 2) bytes each
        ratio, payload = steps[step]["checkpoint_engine/changed_ratio"], steps[step]["async/sync_megabytes"]
        assert 0 < ratio < 0.05 and payload <= ratio * 107584 * 6 / 2**20 < full / 10
        assert steps[step]["checkpoint_engine/payload_mbytes"] == payload
        assert steps[step]["async/sync_wire_megabytes"] - payload < 0.01  # headers and JSON metadata: ~4.5 KB for 27 tensors


def test_one_step_off_with_delta_syncs_sends_an_fp32_actor_in_its_bf16_rollouts_dtype(tiny_model_dir, tmp_path):
    """An fp32 actor computing in bf16 (``mixed_precision.param_dtype=bf16``: the HF rollout's copy is bf16): the
    sender casts to bf16 before diffing (workers/checkpoint_engine.py ``wire_dtype``), so a sync is half the
    fp32 bytes and a delta carries the elements whose bf16 bits moved (measured: 4160 and 3031 of 107584;
    sent in fp32, ~87% changed); verify=true proves every load against the sender's bf16 digests."""
    run = tmp_path / "narrow"
    _ok(_cli([*_args(tiny_model_dir, run, *_ASYNC, "actor_rollout_ref.rollout.checkpoint_engine.backend=delta_sharded",
                     "+actor_rollout_ref.rollout.checkpoint_engine.engine_kwargs.delta_sharded.encoding=indices",
                     "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16"),
              "actor_rollout_ref.actor.optim.lr=1e-6"], config_name="one_step_off_ppo_trainer"))
    steps = _steps(run)
    full = steps[1]["async/sync_megabytes"]
    assert steps[1]["checkpoint_engine/changed_ratio"] == 1.0 and full * 2**20 == 2 * 107584  # bf16, not fp32's 4
    for step in (2, 3):
        ratio, payload = steps[step]["checkpoint_engine/changed_ratio"], steps[step]["async/sync_megabytes"]
        assert 0 < ratio < 0.1 and payload <= ratio * 107584 * 6 / 2**20 < full / 5


def test_one_step_off_with_verls_use_rollout_log_probs_takes_the_ratio_against_the_sampling_version(
        tiny_model_dir, tmp_path):
    """verl's async default (``async_training.use_rollout_log_probs=true``, any trigger_parameter_sync_step):
    the old log-probs are the rollout's, so from step 2 (samples one update behind) PPO's ratio is
    against the version that sampled, not the trainer's current weights as in the run above."""
    run = tmp_path / "reuse"
    out = _cli(_args(tiny_model_dir, run, *_ASYNC, "actor_rollout_ref.actor.use_rollout_log_probs=null",
                     "async_training.use_rollout_log_probs=true"),
               config_name="one_step_off_ppo_trainer")
    _ok(out)
    assert "has no effect with actor.use_rollout_log_probs=true" in out.stdout + out.stderr  # the overlay's IS
    steps = _steps(run)
    assert abs(steps[1]["actor/ppo_kl"]) < 1e-6  # the HF engine at the trainer's weights: its log-probs are the actor's
    assert all(abs(steps[s]["actor/ppo_kl"]) > 1e-4 for s in (2, 3)), [steps[s]["actor/ppo_kl"] for s in steps]
    assert not any("rollout_corr/log_ppl_abs_diff" in steps[s] for s in steps)  # nothing recomputed, nothing compared


def test_fully_async_compute_prox_log_prob_scores_a_sync_period_under_its_first_weights(tiny_model_dir, tmp_path):
    """verl's ``compute_prox_log_prob`` with trigger_parameter_sync_step=2 (staleness 0: the period's first
    weights sampled its rows): the trainer's old log-probs equal the rollout's at every step, step 2 included,
    where the current weights are one update on (recomputing under them puts them >1e-3 apart, as the
    one-step-off run above shows); so step 2's ratio is against the period's first weights, not 1."""
    run = tmp_path / "prox"
    out = _cli(_args(tiny_model_dir, run, *_ASYNC, "data.gen_batch_size=2", "async_training.require_batches=1",
                     "async_training.staleness_threshold=0", "async_training.trigger_parameter_sync_step=2",
                     "actor_rollout_ref.actor.use_rollout_log_probs=null", "async_training.use_rollout_log_probs=true",
                     "async_training.compute_prox_log_prob=true"), config_name="fully_async_ppo_trainer")
    _ok(out)
    assert "has no effect" not in out.stdout + out.stderr  # the overlay's token IS corrects against them again
    steps = _steps(run)
    assert [steps[s]["async/staleness_max"] for s in range(1, STEPS + 1)] == [0, 0, 0]
    assert all(steps[s]["rollout_corr/log_ppl_abs_diff"] <= 1e-6 for s in steps), \
        [steps[s]["rollout_corr/log_ppl_abs_diff"] for s in steps]  # same weights, same module
    assert abs(steps[1]["actor/ppo_kl"]) < 1e-6 and abs(steps[2]["actor/ppo_kl"]) > 1e-4


@pytest.mark.parametrize("config_name", ["fully_async_ppo_trainer", "one_step_off_ppo_trainer"])
def test_a_killed_run_resumes_without_repeating_or_losing_prompts(tiny_model_dir, tmp_path, config_name):
    def args(run):
        return _args(tiny_model_dir, run, *_ASYNC, "data.gen_batch_size=1", "async_training.require_batches=1",
                     "async_training.staleness_threshold=1.0", "trainer.save_freq=2",
                     "trainer.total_training_steps=4")

    whole = tmp_path / "whole"
    _ok(_cli(args(whole), config_name=config_name))
    killed = tmp_path / "killed"
    cmd = [sys.executable, "-m", "rlfoundry", "train", "--config-name", config_name, *args(killed)]
    proc = subprocess.Popen(cmd, env=E.subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.monotonic() + 300
    while not (killed / "gens" / "3.jsonl").exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the driver and both pools, mid step 3
    proc.wait()
    resumed = _cli(args(killed), config_name=config_name)
    _ok(resumed)
    assert "resumed from" in resumed.stdout
    assert config_name != "fully_async_ppo_trainer" or "generated again" in resumed.stdout
    trained = {s: [r["index"] for r in _trained(killed, s)] for s in range(1, 5)}
    assert trained == {s: [r["index"] for r in _trained(whole, s)] for s in range(1, 5)}
    flat = [i for s in trained for i in trained[s][::4]]  # one entry per prompt (n = 4 samples)
    assert len(flat) == len(set(flat)) == 8


def test_partial_rollout_lets_syncs_meet_generations_mid_way_within_the_bound(tiny_model_dir, tmp_path):
    # each generation sleeps 1 s after each of its first chunks (fault action "slow"): the rollouter is
    # the bottleneck, always generating, so a step's sync meets a generation with tokens already
    # sampled (on its own, whether a sync came mid-way depended on this machine's speed)
    run = tmp_path / "partial"
    env = {**E.subprocess_env(), "RLFOUNDRY_FAULT_INJECT": "partial_rollout.between_chunks:slow"}
    _ok(_cli(_args(tiny_model_dir, run, *_ASYNC, "data.gen_batch_size=1", "async_training.require_batches=1",
                   "async_training.staleness_threshold=1.0", "async_training.partial_rollout=true",
                   "async_training.partial_rollout_chunk_tokens=1", "trainer.total_training_steps=4"),
             config_name="fully_async_ppo_trainer", env=env))
    steps = _steps(run)
    assert len(steps) == 4 and all(steps[s]["async/staleness_max"] <= 1 for s in steps)
    assert sum(steps[s]["async/paused_in_flight"] for s in steps) > 0  # a sync came between two chunks
    assert any(steps[s]["async/partial_samples_fraction"] > 0 for s in steps)  # samples spanning two versions


def test_multi_turn_partial_rollout_runs_the_agent_loops_in_the_driver_and_syncs_mid_flight(tiny_model_dir, tmp_path):
    # verl's retool line's combination (tool agent loop + partial rollout): the driver's agent loops send
    # their turns' chunks to the rollout pool's plain engine; slowed chunks make syncs meet them mid-way
    run = tmp_path / "multi_turn"
    env = {**E.subprocess_env(), "RLFOUNDRY_FAULT_INJECT": "partial_rollout.between_chunks:slow"}
    _ok(_cli(_args(tiny_model_dir, run, *_ASYNC, "data.gen_batch_size=1", "async_training.require_batches=1",
                   "async_training.staleness_threshold=1.0", "async_training.partial_rollout=true",
                   "async_training.partial_rollout_chunk_tokens=2", "trainer.total_training_steps=4",
                   "actor_rollout_ref.rollout.multi_turn.enable=true", "data.max_prompt_length=192",
                   "actor_rollout_ref.rollout.multi_turn.tool_config_path=rlfoundry://config/tools/calculator.yaml"),
             config_name="fully_async_ppo_trainer", env=env))
    steps = _steps(run)
    assert len(steps) == 4 and all(steps[s]["async/staleness_max"] <= 1 for s in steps)
    assert sum(steps[s]["async/paused_in_flight"] for s in steps) > 0
    assert any(steps[s]["async/partial_samples_fraction"] > 0 for s in steps)
    assert all("num_turns/mean" in steps[s] for s in steps)  # the agent loops' columns reached the trainer
    rows = [r for s in steps for r in _trained(run, s)]
    assert all(r["param_version_start"] <= r["param_version_end"] <= r["param_version_start"] + 1 for r in rows)


@pytest.mark.parametrize("config_name", ["one_step_off_ppo_trainer", "fully_async_ppo_trainer"])
def test_both_pipelines_run_on_ray_with_two_pools(tiny_model_dir, tmp_path, config_name):
    run = tmp_path / "ray"
    _ok(_cli(_args(tiny_model_dir, run, *_ASYNC, "trainer.worker_backend=ray", "async_training.require_batches=1",
                   "data.gen_batch_size=1", "trainer.total_training_steps=2"), config_name=config_name))
    steps = _steps(run)
    assert sorted(steps) == [1, 2] and all(steps[s]["async/sync_megabytes"] > 0 for s in steps)
    assert steps[1]["rollout_corr/log_ppl_abs_diff"] <= 1e-6  # the pools start from the same weights


def test_a_dead_rollout_worker_stops_the_run_naming_it(tiny_model_dir, tmp_path):
    env = {**E.subprocess_env(), "RLFOUNDRY_FAULT_INJECT": "generate_sequences@2"}
    start = time.monotonic()
    out = _cli(_args(tiny_model_dir, tmp_path / "run", *_ASYNC, "data.gen_batch_size=1", "async_training.require_batches=1"),
               config_name="fully_async_ppo_trainer", env=env)
    assert out.returncode != 0
    assert "worker group 'rollout_pool/rollout' rank 0 died while running 'rollout_generate_sequences'" in (
        out.stdout + out.stderr)
    assert "Traceback" not in out.stderr
    assert time.monotonic() - start < 300


def test_one_step_off_with_spawned_ranks_exits_after_its_last_step(tiny_model_dir, tmp_path):
    """Issue 33: on a GPU (where the ranks are spawned: the driver holds a CUDA context) the run printed
    ``finished at step 4`` and never exited. The timeout only bounds the test: the old code never ends."""
    cmd = [sys.executable, "-m", "rlfoundry", "train", "--config-name", "one_step_off_ppo_trainer",
           *_args(tiny_model_dir, tmp_path / "run", *_ASYNC, "trainer.worker_backend=process",
                  "trainer.process_start_method=spawn")]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, env=E.subprocess_env(), timeout=240)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the run did not exit: {(err.stdout or b'')[-2000:]!r}")
    _ok(out)
    assert f"finished at step {STEPS}" in out.stdout
