"""``rlfoundry train`` on image rows: GRPO on the tiny Qwen2-VL with the synthetic shapes task (CPU).

The run goes through the real entry point's builder (``main_ppo.build_trainer``): the processor is
loaded from the model directory, the data set reads verl's image rows, the rollout samples from the
pixels, and the actor's log-prob and update forwards take them.
"""

from __future__ import annotations

import math

import pytest
import torch

from rlfoundry.protocol import DataProto
from tests.trainer import _e2e as E


@pytest.fixture(scope="module")
def shapes_dir(tmp_path_factory):
    return E.preprocess_shapes(tmp_path_factory.mktemp("shapes"), 8, 4, seed=3)


def _overrides(model, run_dir, data, *extra):
    return E.tiny_overrides(
        model, run_dir, f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        "data.max_prompt_length=128", "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.actor.use_kl_loss=true",
        "trainer.worker_backend=process", *extra)


def test_grpo_two_steps_on_image_rows_update_the_policy(tiny_vlm_dir, shapes_dir, tmp_path):
    # a dense score (the exact-answer rule gives an untrained policy 0 everywhere: zero GRPO advantages)
    reward = E.write_reward_file(tmp_path)
    run = E.train(_overrides(tiny_vlm_dir, tmp_path / "run", shapes_dir, f"custom_reward_function.path={reward}"),
                  keep_trainer=True)
    assert run.summary["global_step"] == 2 and len(run.batches) == 2
    for step in (1, 2):
        rec = run.step(step)
        assert math.isfinite(rec["actor/pg_loss"]), rec
        assert rec["response_length/mean"] > 0
        assert math.isfinite(rec["actor/kl_loss"])  # the reference's log-probs on the image rows
        assert "critic/score/mean" in rec

    batch = run.batches[0]
    assert batch["advantages"].abs().max() > 0  # the update had something to learn from
    # the actor was trained on image rows: the pixel inputs and 3-D positions travelled with the batch
    assert batch["position_ids"].dim() == 3 and batch["position_ids"].shape[1] == 3
    mm = batch["multi_modal_inputs"]
    assert len(mm) == len(batch["responses"]) and all(r["pixel_values"].shape[0] > 0 for r in mm)
    image_token = run.trainer.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert (batch["prompts"] == image_token).any(dim=1).all()

    # The step-1 batch rescored by the policy after two updates: its log-probs moved (the update's
    # forward took the pixels; without them the VLM's forward refuses the image tokens).
    tensors = {k: v for k, v in batch.items() if isinstance(v, torch.Tensor)}
    data = DataProto.from_dict(tensors=tensors, non_tensors={"multi_modal_inputs": mm},
                               meta_info={"temperature": 1.0, "micro_batch_size": 8})
    after = run.trainer.actor_rollout_wg.compute_log_prob(data).batch["old_log_probs"]
    mask = batch["response_mask"].bool()
    moved = (after - batch["old_log_probs"]).abs()[mask]
    assert moved.max() > 1e-3, moved.max()


def test_image_and_video_keys_are_no_longer_no_effect_keys():
    from rlfoundry.config.verl_compat import no_effect_keys_set
    from rlfoundry.trainer.config import load_config

    keys = ["data.image_key", "data.video_key"]
    cfg = load_config([f"{k}=x" for k in keys])
    assert no_effect_keys_set(cfg, keys) == []
    assert no_effect_keys_set(cfg, ["actor_rollout_ref.rollout.multi_stage_wake_up"])  # the check itself works
