"""ActorRolloutRefWorker as a whole: checkpoint round trip, HF export, roles, config handling."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfoundry.protocol import DataProto
from tests.workers import (assert_same_gradients, first_step_gradients, full_params, local_worker,  # noqa: F401
                           make_prompts, one_thread, reassociation_bound, vocab_rows, worker_config)

TEXTS = ["hello world", "a", "the quick brown fox", "12+7="]
OVERRIDES = ["actor.ppo_mini_batch_size=2", "actor.optim.lr_warmup_steps=2", "actor.optim.warmup_style=cosine",
             "actor.optim.total_training_steps=5"]


def _scored(group, prompts) -> DataProto:
    data = group.generate_sequences(prompts)
    data = data.union(group.compute_log_prob(data))
    mask = data.batch["response_mask"]
    data.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    return data


@pytest.mark.numerics
def test_save_load_resumes_generation_update_and_schedule(tiny_model_dir, tokenizer, tmp_path):
    prompts = make_prompts(tokenizer, TEXTS)
    a = local_worker(worker_config(tiny_model_dir, OVERRIDES), role="actor_rollout")
    a.update_actor(_scored(a, prompts))
    step_dir = tmp_path / "global_step_1" / "actor"
    a.save_checkpoint(str(step_dir), global_step=1)
    next_batch = _scored(a, prompts)  # draws from the sampler's saved position
    metrics_a = a.update_actor(next_batch).meta_info["metrics"]

    b = local_worker(worker_config(tiny_model_dir, OVERRIDES), role="actor_rollout")
    extra = b.load_checkpoint(str(step_dir))[0]
    assert extra["global_step"] == 1
    again = b.generate_sequences(prompts)
    assert torch.equal(again.batch["responses"], next_batch.batch["responses"])
    metrics_b = b.update_actor(next_batch).meta_info["metrics"]
    assert metrics_b["actor/lr"] == metrics_a["actor/lr"] == [pytest.approx(5e-4)]  # warm-up step 1 of 2
    # the resumed update repeats the uninterrupted one's arithmetic (weights, Adam's moments, the lr
    # schedule, the batch all restored): bit for bit in practice, 1e-7 (1/5000 of the lr) at most
    params_a, params_b = full_params(a.worker.actor.module), full_params(b.worker.actor.module)
    for name in params_a:
        torch.testing.assert_close(params_b[name], params_a[name], atol=1e-7, rtol=0, msg=name)


@pytest.mark.numerics
def test_hf_export_loads_with_from_pretrained(tiny_model_dir, tokenizer, tmp_path):
    group = local_worker(worker_config(tiny_model_dir), role="actor")
    group.save_hf_model(str(tmp_path / "hf"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    x = make_prompts(tokenizer, TEXTS).batch
    with torch.no_grad():
        mine = group.worker.actor.module(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).logits
        theirs = exported(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).logits
    torch.testing.assert_close(theirs, mine)
    assert (tmp_path / "hf" / "tokenizer.json").is_file()


@pytest.mark.numerics
def test_gradient_checkpointing_gives_the_same_update(tiny_model_dir, tokenizer):
    prompts = make_prompts(tokenizer, TEXTS)
    plain = local_worker(worker_config(tiny_model_dir), role="actor_rollout")
    batch = _scored(plain, prompts)
    ckpt = local_worker(worker_config(tiny_model_dir, ["model.enable_gradient_checkpointing=true"]), role="actor_rollout")
    for group in (plain, ckpt):
        group.update_actor(batch)  # one mini-batch of 8 rows: one optimiser step
    # The gradients of that step, not the weights after it: the recompute repeats the forward's ops,
    # but should any of them round differently, Adam's ~lr * sign(g) first step would turn it into up
    # to lr on a weight whose gradient is near zero (#51). A recompute that misses a layer's input or
    # its dropout/rotary state is off by O(1).
    g1 = first_step_gradients(plain.worker.optimizer, plain.worker.actor.module)
    g2 = first_step_gradients(ckpt.worker.optimizer, ckpt.worker.actor.module)
    bound = reassociation_bound(vocab_rows(g1), int(batch.batch["input_ids"].numel()))
    assert_same_gradients(g2, g1, bound, "checkpointed")


def test_roles_build_only_what_they_need(tiny_model_dir):
    ref = local_worker(worker_config(tiny_model_dir), role="ref").worker
    assert ref.actor is None and ref.rollout is None and ref.optimizer is None
    assert not any(p.requires_grad for p in ref.ref_policy.module.parameters())
    rollout = local_worker(worker_config(tiny_model_dir), role="rollout").worker
    assert rollout.optimizer is None and rollout.ref_policy is None and rollout.rollout is not None
    # the HF engine samples with the actor's own module: no second copy of the weights
    hybrid = local_worker(worker_config(tiny_model_dir), role="actor_rollout").worker
    assert hybrid.rollout.module is hybrid.actor.module


def test_inconsistent_batch_sizes_name_the_numbers(tiny_model_dir):
    from rlfoundry.workers.fsdp_workers import ActorRolloutRefWorker

    cfg = worker_config(tiny_model_dir, ["actor.ppo_mini_batch_size=3", "actor.ppo_micro_batch_size_per_gpu=4"])
    with pytest.raises(ValueError, match="mini-batch of 6 rows.*ppo_micro_batch_size_per_gpu=4"):
        ActorRolloutRefWorker(cfg, "actor")
    with pytest.raises(ValueError, match="role must be one of"):
        ActorRolloutRefWorker(cfg, "critic")


def test_workers_take_typed_config_with_the_schemas_defaults(tiny_model_dir):
    """A partial subtree gets config/schema.py's defaults (no fallbacks of the workers' own); a misspelt
    key is a ConfigError naming the full key and the nearest valid one, before any model loads."""
    from rlfoundry.config.schema import CriticConfig, RewardModelConfig
    from rlfoundry.config.typed import ConfigError
    from rlfoundry.workers.critic import CriticWorker
    from rlfoundry.workers.fsdp_workers import ActorRolloutRefWorker
    from rlfoundry.workers.reward_model import RewardModelWorker

    actor = ActorRolloutRefWorker({"model": {"path": str(tiny_model_dir)}, "rollout": {"n": 4}}, "actor")
    assert actor.config.model.use_shared_prompt is True and actor.config.actor.optim.eps == 1e-8
    # ref.log_prob_use_dynamic_bsz follows actor.use_dynamic_bsz inside the subtree, as in verl's YAML
    linked = ActorRolloutRefWorker({"actor": {"use_dynamic_bsz": True}, "rollout": {"n": 4}}, "actor")
    assert linked.config.ref.log_prob_use_dynamic_bsz is True
    critic = CriticWorker({"model": {"path": str(tiny_model_dir)}}, rollout_n=2)
    assert critic.sizes.micro_batch_size == CriticConfig().ppo_micro_batch_size_per_gpu
    assert critic.sizes.forward_micro_batch_size == critic.sizes.micro_batch_size  # follows the update's
    assert RewardModelWorker({}).config.micro_batch_size_per_gpu == RewardModelConfig().micro_batch_size_per_gpu
    with pytest.raises(ConfigError, match="actor_rollout_ref.actor.ppo_mini_batch.*ppo_mini_batch_size"):
        ActorRolloutRefWorker({"actor": {"ppo_mini_batch": 4}}, "actor")
    with pytest.raises(ConfigError, match="critic.cliprange_value.*number"):
        CriticWorker({"cliprange_value": "wide"}, rollout_n=2)
    with pytest.raises(ConfigError, match="reward_model.model.cpu_kernels='fast' is not one of"):
        RewardModelWorker({"model": {"cpu_kernels": "fast"}})


def test_config_is_never_modified(tiny_model_dir, tokenizer):
    cfg = worker_config(tiny_model_dir)
    before = cfg.copy()
    group = local_worker(cfg, role="actor_rollout_ref")
    _scored(group, make_prompts(tokenizer, TEXTS))
    assert cfg == before
