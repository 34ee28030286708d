"""Unit tests of the fault hook, the OOM back-off and the driver guards (no trainer run)."""

from __future__ import annotations

import errno
import logging

import pytest
import torch

from rlfoundry.trainer.reliability import NonFiniteGuard, checkpoint_save_guard
from rlfoundry.utils import faults
from rlfoundry.utils.errors import CheckpointSaveError, NonFiniteLossError, TrainingOutOfMemoryError
from rlfoundry.checkpoint import layout as ckpt_dirs
from rlfoundry.engines.oom import MicroBatchBackoff, update_or_explain_oom


def test_fault_specs_parse_and_bad_ones_are_errors():
    assert faults.parse_specs("save.staged@2, compute_log_prob>1:oom") == (
        faults.FaultSpec("save.staged", 2, None, "kill"), faults.FaultSpec("compute_log_prob", None, 1, "oom"))
    with pytest.raises(ValueError, match="cannot parse 'update_actor:explode'"):
        faults.parse_specs("update_actor:explode")


def test_fault_fires_only_on_its_hit_and_size(monkeypatch):
    monkeypatch.setenv(faults.ENV_VAR, "p@2:enospc,q>2:oom")
    faults.inject("p")  # hit 1: nothing
    with pytest.raises(OSError) as err:
        faults.inject("p")
    assert err.value.errno == errno.ENOSPC
    faults.inject("p")  # hit 3: nothing
    faults.inject("q", size=2)
    with pytest.raises(torch.OutOfMemoryError):
        faults.inject("q", size=3)
    tensors = {"a": torch.ones(2)}
    monkeypatch.setenv(faults.ENV_VAR, "r:nan")
    faults.inject("r", tensors=tensors, nan_key="a")
    assert torch.isnan(tensors["a"]).all()


def test_backoff_halves_until_it_fits_logs_and_keeps_the_size(caplog):
    calls = []

    def pass_that_fits_at_2(size):
        calls.append(size)
        if size > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return size

    backoff = MicroBatchBackoff()
    with caplog.at_level(logging.WARNING, logger="rlfoundry.engines.oom"):
        assert backoff.run("compute_log_prob", 8, pass_that_fits_at_2) == 2
    assert calls == [8, 4, 2]  # 8 → 4 → 2
    assert "compute_log_prob ran out of memory with 8 rows per micro-batch; retrying with 4" in caplog.text
    assert backoff.run("compute_log_prob", 8, pass_that_fits_at_2) == 2 and calls[-1] == 2  # kept, no retry


def test_backoff_gives_up_at_the_floor_with_a_message():
    def never_fits(size):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.raises(TrainingOutOfMemoryError, match="even with 1 rows per micro-batch.*max_response_length"):
        MicroBatchBackoff().run("compute_values", 4, never_fits)


@pytest.mark.parametrize("role,keys", [
    ("actor", ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
               "actor_rollout_ref.model.enable_gradient_checkpointing", "actor_rollout_ref.actor.fsdp_config.param_offload"]),
    ("critic", ["critic.ppo_micro_batch_size_per_gpu", "critic.ppo_max_token_len_per_gpu",
                "critic.model.enable_gradient_checkpointing", "critic.model.fsdp_config.param_offload"]),
])
def test_update_oom_names_the_keys_to_lower(role, keys):
    def update():
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    with pytest.raises(TrainingOutOfMemoryError) as err:
        update_or_explain_oom(role, update, micro_batch_size=4)
    message = str(err.value)
    for key in keys + ["data.max_response_length", "response_length", "optimizer_offload", "(now 4)"]:
        assert key in message, key


def test_nan_guard_counts_consecutive_skipped_steps_only():
    guard = NonFiniteGuard(3)
    for skipped in (1, 1, 0, 1, 1):  # the finite step resets the count
        guard.check({"actor/nan_skipped": skipped}, step=0)
    with pytest.raises(NonFiniteLossError, match=r"critic was NaN/Inf in 3 consecutive steps \(up to step 9\)") as err:
        guard.check({"critic/nan_skipped": 1.0}, step=9)
    for cause in ("optim.lr", "grad_clip", "reward", "trainer.max_consecutive_nan_steps"):
        assert cause in str(err.value)
    never = NonFiniteGuard(0)
    for _ in range(10):
        never.check({"actor/nan_skipped": 1}, step=1)


def test_failed_save_removes_the_partial_step_and_names_the_intact_one(tmp_path):
    good = tmp_path / "global_step_1"
    good.mkdir()
    (good / "data.pt").write_bytes(b"x")
    ckpt_dirs.write_latest_checkpointed_iteration(tmp_path, 1)
    with pytest.raises(CheckpointSaveError, match=r"previous checkpoint \S+global_step_1 is intact") as err:
        with checkpoint_save_guard(tmp_path, 2):
            (tmp_path / "global_step_2" / "actor.tmp").mkdir(parents=True)
            raise OSError(errno.ENOSPC, "No space left on device")
    assert "No space left on device" in str(err.value) and "resume_mode=auto" in str(err.value)
    assert not (tmp_path / "global_step_2").exists() and ckpt_dirs.is_complete_step_dir(good)
    with pytest.raises(KeyError):  # not a disk problem: passes through untouched
        with checkpoint_save_guard(tmp_path, 2):
            raise KeyError("bug")


def test_timeouts_are_config_keys_that_reach_the_workers(monkeypatch, tiny_model_dir):
    from rlfoundry.single_controller.base import ClassWithInitArgs, Dispatch, Worker, register
    from rlfoundry.trainer.config import ConfigError, load_config, validate_config
    from rlfoundry.trainer.main_ppo import local_factory

    class Probe(Worker):
        @register(dispatch_mode=Dispatch.ONE_TO_ALL)
        def dist_timeout(self):
            return self.runtime.dist_timeout_s  # what init_distributed() uses for every collective

    cfg = load_config([f"actor_rollout_ref.model.path={tiny_model_dir}", "trainer.device=cpu",
                       "trainer.dist_timeout_s=42", "trainer.worker_call_timeout_s=7"])
    assert cfg.trainer.worker_call_timeout_s == 7  # handed to RayWorkerGroup(call_timeout_s=...) by ray_factory
    assert local_factory(cfg)({"probe": ClassWithInitArgs(Probe)})["probe"].dist_timeout() == [42.0]
    with pytest.raises(ConfigError, match="trainer.worker_call_timeout_s=-1.0 must be positive"):
        validate_config(load_config(["trainer.worker_call_timeout_s=-1", "trainer.max_consecutive_nan_steps=2"]))
