"""``--config-name ppo_megatron_trainer`` with verl's ``megatron.use_dist_checkpointing`` on two CPU
processes at tensor parallel 2: ``model.path`` is the project's tiny model and the actor and the
reference start from a dist checkpoint of another model of the same shape (``other``, converted with
``python -m rlfoundry.scripts.converter_hf_to_mcore``). The run equals, step for step, the run whose
``model.path`` is ``other`` itself: the same samples from step 1 on (the HF rollout's copy, loaded from
``model.path``, takes the actor's weights before it samples), scores, losses and gradient norms."""

from __future__ import annotations

import pytest

from tests.engines.test_megatron_dist_weights import convert_other
from tests.trainer._e2e import write_reward_file
from tests.trainer.test_e2e_megatron import LAYOUTS, _run

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]


@pytest.mark.heavy  # CI: the engine starts bitwise equal to the HF-loaded one (tests/engines/test_megatron_dist_weights.py)
def test_grpo_from_a_dist_checkpoint_equals_grpo_from_its_hf_model(tiny_model_dir, tmp_path, converted):
    other, ckpt = converted
    reward = write_reward_file(tmp_path)
    layout = [f"actor_rollout_ref.{role}.megatron.{LAYOUTS['tp2']}" for role in ("actor", "ref")]
    steps = ["trainer.total_training_steps=2"]
    from_hf = _run(tmp_path, "hf", other, reward, [*layout, *steps], config_name="ppo_megatron_trainer")
    dist_keys = [f"actor_rollout_ref.{role}.megatron.{k}" for role in ("actor", "ref")
                 for k in ("use_dist_checkpointing=true", f"dist_checkpointing_path={ckpt}")]
    from_dist = _run(tmp_path, "dist", tiny_model_dir, reward, [*layout, *steps, *dist_keys],
                     config_name="ppo_megatron_trainer")
    assert [r["step"] for r in from_dist] == [1, 2]
    for a, b in zip(from_hf, from_dist):
        # the same weights everywhere, the same arithmetic: model.path's weights would sample other texts
        for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), (a["step"], key)


def test_a_rollout_pool_of_its_own_samples_with_the_dist_checkpoint_weights_from_step_1(tiny_model_dir, tmp_path,
                                                                                        converted):
    """One-step-off: the pool loads model.path; the trainer's weights (from the dist checkpoint) reach
    it before the first generation, so the pool's log-probs equal the trainer's at step 1 (model.path's
    weights: 0.07 apart here, another model's)."""
    from tests.trainer import test_e2e_async as A
    from tests.trainer._e2e import read_records

    _, ckpt = converted
    run = tmp_path / "one-step-off"
    dist_keys = [f"actor_rollout_ref.{role}.megatron.{k}" for role in ("actor", "ref")
                 for k in ("use_dist_checkpointing=true", f"dist_checkpointing_path={ckpt}")]
    A._ok(A._cli(A._args(tiny_model_dir, run, *A._ASYNC, "trainer.total_training_steps=1", *dist_keys),
                 config_name="one_step_off_ppo_megatron_trainer"))
    [step] = [r for r in read_records(run) if "timing_s/step" in r]
    assert step["rollout_corr/log_ppl_abs_diff"] <= 1e-6 and step["async/sync_megabytes"] > 0


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """``other`` (the tiny model's shape, seed 7) and its float32 dist checkpoint, converted once for the
    module (the tests only read it)."""
    other, ckpt, _ = convert_other(tmp_path_factory.mktemp("converted"))
    return other, ckpt
