"""verl's FlowRL recipe through its entry module's config (``rlfoundry.recipe.flowrl.main_flowrl``: the packaged
``flowrl_trainer``) on the tiny model: the loss the actor reports is FlowRL's, recomputed here from the batch
and the model directory; the log Z head trains, stays out of the rollout's weights, and a resumed run
reproduces the straight run's next loss (the head and its optimiser state are in the checkpoint)."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.recipe.flowrl.main_flowrl import ENTRY
from tests.trainer import _e2e as E

pytestmark = pytest.mark.slow

# proj_layer=1: the head is one Linear (no dropout), so its value at step 1 is its seeded start
HEAD_1 = "actor_rollout_ref.actor.proj_layer=1"


def _run(model, run_dir, *extra, keep=False):
    return E.train(E.tiny_overrides(model, run_dir, *extra), keep_trainer=keep, config_name=ENTRY.config_name)


def _recomputed_step1_loss(model_dir, batch) -> float:
    """mean_i (log Z_i + mean_t old - 15 mean_t A - mean_t ref)^2: one mini-batch and one epoch, so the
    importance weight is 1 and log pi = old_log_probs (the same weights). log Z by hand: the model's last
    hidden states over the prompt columns but the last (verl's slice), mean, through the seeded head."""
    from transformers import AutoModelForCausalLM

    from rlfoundry.workers.flowrl_head import add_log_z_head

    module = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    add_log_z_head(1)(module)
    ids, attn = batch["input_ids"], batch["attention_mask"]
    tp = ids.shape[1] - batch["responses"].shape[1]
    with torch.no_grad():
        hidden = module(input_ids=ids[:, :tp], attention_mask=attn[:, :tp], position_ids=batch["position_ids"][:, :tp],
                        output_hidden_states=True).hidden_states[-1]
        m = attn[:, : tp - 1].unsqueeze(-1).float()
        log_z = module.proj_z((hidden[:, : tp - 1] * m).sum(1) / m.sum(1)).squeeze(-1)
    mask = batch["response_mask"].float()
    mean = lambda x: (x * mask).sum(-1) / mask.sum(-1)  # noqa: E731
    delta = log_z + mean(batch["old_log_probs"]) - 15.0 * mean(batch["advantages"]) - mean(batch["ref_log_prob"])
    return float(delta.square().mean())


def test_the_actor_reports_flowrls_loss_and_the_head_trains_outside_the_rollout(tiny_model_dir, tmp_path):
    reward = E.write_reward_file(tmp_path)
    # wrapped in FSDP2 on the one rank, as on several: the head, called outside the model's forward, is a unit
    run = _run(tiny_model_dir, tmp_path / "run", HEAD_1, f"custom_reward_function.path={reward}",
               "trainer.total_training_steps=1", "actor_rollout_ref.actor.fsdp_config.single_rank=fsdp", keep=True)
    step = run.step(1)
    assert step["actor/pg_loss"] == pytest.approx(_recomputed_step1_loss(tiny_model_dir, run.batches[0]), rel=1e-4)
    assert step["actor/importance_weight"] == 1.0  # on-policy: verl's actor takes the forward's own log-probs
    assert "actor/kl_loss" not in step  # FlowRL's loss replaces the KL loss (use_kl_loss only brings the reference)
    engine = run.trainer.actor_rollout_wg.worker.workers["actor_rollout"].engine  # the in-process worker
    names = [n for n, _ in engine.iter_hf_weights()]  # what a weight sync streams to vLLM / SGLang
    assert "model.embed_tokens.weight" in names and not any(n.startswith("proj_z.") for n in names)
    head = [p for n, p in engine.module.named_parameters() if n.startswith("proj_z.")]
    optimised = {id(p) for group in engine.optimizer.param_groups for p in group["params"]}
    assert head and all(id(p) in optimised for p in head)  # trained by the actor's optimiser
    from safetensors import safe_open

    exported = engine.save_hf_model(str(tmp_path / "hf"))  # an HF directory vLLM can load: no head in it
    keys = [k for f in sorted((tmp_path / "hf").glob("*.safetensors")) for k in safe_open(str(f), "pt").keys()]
    assert exported and "model.embed_tokens.weight" in keys and not any(k.startswith("proj_z.") for k in keys)


def test_resume_reproduces_the_next_steps_loss(tiny_model_dir, tmp_path):
    """A head (or its optimiser moments) missing from the checkpoint would restart log Z and move the loss."""
    reward = E.write_reward_file(tmp_path)
    common = (f"custom_reward_function.path={reward}", "actor_rollout_ref.rollout.temperature=1.5")
    straight = _run(tiny_model_dir, tmp_path / "straight", *common, "trainer.total_training_steps=3")
    _run(tiny_model_dir, tmp_path / "split", *common, "trainer.total_training_steps=2", "trainer.save_freq=2")
    resumed = _run(tiny_model_dir, tmp_path / "split", *common, "trainer.total_training_steps=3")
    assert len(resumed.batches) == 1
    for key in ("actor/pg_loss", "actor/log_z"):
        assert resumed.step(3)[key] == pytest.approx(straight.step(3)[key], rel=1e-5, abs=1e-7), key
    assert straight.step(3)["actor/log_z"] != pytest.approx(straight.step(1)["actor/log_z"], abs=1e-4)  # it trains
