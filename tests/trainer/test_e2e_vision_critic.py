"""PPO with a critic (GAE) on image rows: ``rlfoundry train`` with a vision-language critic
(``models/vision_value.py``) built from the tiny Qwen2-VL, through the real builder, in process."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlfoundry.protocol import DataProto
from tests.trainer import _e2e as E
from tests.trainer.test_e2e_algorithms import _gae_returns
from tests.trainer.test_e2e_vision import shapes_dir  # noqa: F401 - fixture

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

_CRITIC_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


def _overrides(model, run_dir, data, reward, *extra):
    return E.tiny_overrides(
        model, run_dir, f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        "data.max_prompt_length=128", "algorithm.adv_estimator=gae", "algorithm.gamma=0.9", "algorithm.lam=0.8",
        f"critic.model.path={model}", "critic.optim.lr=1e-2", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.rollout.temperature=1.0", f"custom_reward_function.path={reward}",
        "trainer.worker_backend=local", *extra)


def _as_proto(batch, blank: bool = False) -> DataProto:
    rows = [dict(r) for r in batch["multi_modal_inputs"]]
    if blank:
        rows = [{**r, "pixel_values": torch.zeros_like(r["pixel_values"])} for r in rows]
    return DataProto.from_dict(tensors={k: batch[k] for k in _CRITIC_INPUTS},
                               non_tensors={"multi_modal_inputs": np.array(rows + [None], dtype=object)[:-1]})


def test_ppo_with_a_vision_language_critic_on_image_rows(tiny_vlm_dir, shapes_dir, tmp_path):
    run = E.train(_overrides(tiny_vlm_dir, tmp_path / "run", shapes_dir, E.write_reward_file(tmp_path)),
                  keep_trainer=True)
    assert run.summary["global_step"] == 2
    for step in (1, 2):
        rec = run.step(step)
        assert math.isfinite(rec["critic/vf_loss"]) and rec["critic/vf_loss"] > 0, rec
        assert math.isfinite(rec["actor/pg_loss"]) and math.isfinite(rec["critic/grad_norm"])
    first, second = run.batches
    for batch in run.batches:  # the critic's batch: image rows, 3-D positions
        assert batch["position_ids"].dim() == 3 and all(r["pixel_values"].numel() for r in batch["multi_modal_inputs"])
    mask = second["response_mask"].bool()
    # step 1's values come from the zero-initialised head; step 2's from the head step 1's update trained
    assert first["values"].abs().max() == 0 and second["values"][mask].abs().min() > 0
    expected = _gae_returns(second["token_level_rewards"], second["values"], second["response_mask"].float(), 0.9, 0.8)
    torch.testing.assert_close(second["returns"][mask], expected[mask], atol=1e-5, rtol=1e-5)
    # the trained critic, through its worker group: the recorded pixels give other values than blank images
    critic = run.trainer.critic_wg
    seen, blank = (critic.compute_values(_as_proto(second, b)).batch["values"] for b in (False, True))
    assert (seen - blank)[mask].abs().max() > 1e-4


@pytest.mark.numerics
def test_a_resumed_ppo_run_on_image_rows_repeats_the_critics_next_step(tiny_vlm_dir, shapes_dir, tmp_path):
    """Save at step 2, resume for step 3: the critic's values, the returns and advantages, and its loss
    and gradient norm are the uninterrupted run's (the critic's weights and optimiser came back)."""
    reward = E.write_reward_file(tmp_path)

    def overrides(run_dir, steps, *extra):
        return _overrides(tiny_vlm_dir, tmp_path / run_dir, shapes_dir, reward, f"trainer.total_training_steps={steps}",
                          *extra)

    straight = E.train(overrides("straight", 3))
    E.train(overrides("split", 2, "trainer.save_freq=2"))
    resumed = E.train(overrides("split", 3))
    assert len(resumed.batches) == 1
    want, got = straight.batches[-1], resumed.batches[0]
    assert want["values"].abs().max() > 0
    for key in ("responses", "values", "returns", "advantages", "old_log_probs"):
        # resume repeats the straight run's arithmetic (bit for bit in practice); a resume bug (another batch or lost
        # optimiser state) moves these by >1e-2
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0, msg=key)
    step3 = [next(r for r in E.read_records(tmp_path / d) if r["step"] == 3 and "critic/vf_loss" in r)
             for d in ("straight", "split")]
    for key in ("critic/vf_loss", "critic/grad_norm", "critic/vpred_mean", "actor/pg_loss"):
        # resume repeats the straight run's arithmetic (bit for bit in practice); a resume bug (another batch or lost
        # optimiser state) moves these by >1e-2
        assert step3[1][key] == pytest.approx(step3[0][key], rel=1e-5, abs=1e-7), key
