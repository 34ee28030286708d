"""verl's ``*.checkpoint.save_contents`` / ``load_contents`` on the actor and critic workers: what a
role directory holds, and what a load restores."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from rlfoundry.checkpoint import COMPONENT_MARKER, HF_CONFIG_DIR
from tests.workers import full_params, local_worker, make_prompts, one_thread, worker_config  # noqa: F401
from tests.workers.test_critic import _config, _critic, _params, _rollout_batch, _with_values
from tests.workers.test_fsdp_workers import OVERRIDES, TEXTS, _scored


def _actor(model_dir, *overrides):
    return local_worker(worker_config(model_dir, [*OVERRIDES, *overrides]), role="actor_rollout")


def _marker(path) -> dict:
    return json.loads((path / COMPONENT_MARKER).read_text())


def _adam_steps(group) -> list[float]:
    return [float(s["step"]) for s in group.worker.engine.optimizer.state.values()]


def test_actor_save_without_optimizer_and_extra_then_weights_alone(tiny_model_dir, tokenizer, tmp_path):
    prompts = make_prompts(tokenizer, TEXTS)
    a = _actor(tiny_model_dir, "actor.checkpoint.save_contents=[model]")
    a.update_actor(_scored(a, prompts))
    path = tmp_path / "global_step_1" / "actor"
    a.save_checkpoint(str(path), global_step=1)
    marker = _marker(path)
    assert (marker["has_optimizer"], marker["has_lr_scheduler"], marker["has_rng"]) == (False, False, False)
    assert not (path / "rng").exists() or not any((path / "rng").iterdir())
    assert not (path / "lr_scheduler.pt").exists()
    full = tmp_path / "full" / "actor"
    a_full = _actor(tiny_model_dir)
    a_full.update_actor(_scored(a_full, prompts))
    a_full.save_checkpoint(str(full), global_step=1)
    shards = lambda p: sum(f.stat().st_size for f in (p / "dcp").iterdir())  # noqa: E731
    assert shards(path) < shards(full) / 2  # AdamW's two moments are twice the weights

    # the default load_contents asks for the optimiser: an error naming the key, not a silent fresh one
    with pytest.raises(ValueError, match="load_contents"):
        _actor(tiny_model_dir).load_checkpoint(str(path))
    b = _actor(tiny_model_dir, "actor.checkpoint.load_contents=[model]")
    assert b.load_checkpoint(str(path))[0]["global_step"] == 1
    saved, loaded = full_params(a.worker.actor.module), full_params(b.worker.actor.module)
    for name in saved:
        torch.testing.assert_close(loaded[name], saved[name], atol=0, rtol=0, msg=name)
    assert _adam_steps(b) == []  # a fresh optimiser


def test_actor_load_without_optimizer_restores_the_weights_only(tiny_model_dir, tokenizer, tmp_path):
    prompts = make_prompts(tokenizer, TEXTS)
    a = _actor(tiny_model_dir)
    a.update_actor(_scored(a, prompts))
    path = tmp_path / "global_step_1" / "actor"
    a.save_checkpoint(str(path), global_step=1)
    everything = _actor(tiny_model_dir)
    everything.load_checkpoint(str(path))
    weights = _actor(tiny_model_dir, "actor.checkpoint.load_contents=[model,extra]")
    weights.load_checkpoint(str(path))
    assert _adam_steps(everything) == _adam_steps(a) != []
    assert _adam_steps(weights) == []
    mine, theirs = full_params(weights.worker.actor.module), full_params(everything.worker.actor.module)
    for name in mine:
        torch.testing.assert_close(mine[name], theirs[name], atol=0, rtol=0, msg=name)


def test_actor_hf_model_is_a_from_pretrained_directory_in_the_role(tiny_model_dir, tokenizer, tmp_path):
    a = _actor(tiny_model_dir, "actor.checkpoint.save_contents=[model,optimizer,extra,hf_model]")
    a.update_actor(_scored(a, make_prompts(tokenizer, TEXTS)))
    path = tmp_path / "global_step_1" / "actor"
    a.save_checkpoint(str(path), global_step=1)
    assert _marker(path)["has_hf_model"] and f"{HF_CONFIG_DIR}/model.safetensors" in _marker(path)["manifest"]
    exported = AutoModelForCausalLM.from_pretrained(path / HF_CONFIG_DIR)
    x = make_prompts(tokenizer, TEXTS).batch
    with torch.no_grad():
        mine = a.worker.actor.module(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).logits
        theirs = exported(input_ids=x["input_ids"], attention_mask=x["attention_mask"]).logits
    torch.testing.assert_close(theirs, mine)
    plain = tmp_path / "plain" / "actor"
    _actor(tiny_model_dir).save_checkpoint(str(plain), global_step=1)
    assert not list((plain / HF_CONFIG_DIR).glob("*.safetensors"))  # the default: config + tokenizer only


def test_critic_contents_follow_its_own_keys(tiny_critic_dir, tmp_path):
    data = _rollout_batch(seed=4)
    cfg = _config(tiny_critic_dir)
    cfg["checkpoint"] = {"save_contents": ["model", "hf_model"], "load_contents": ["model"]}
    first = _critic(cfg)
    data = _with_values(first, data)
    first.update_critic(data)
    path = tmp_path / "global_step_1" / "critic"
    first.save_checkpoint(str(path), global_step=1)
    assert not _marker(path)["has_optimizer"]
    exported = AutoModelForTokenClassification.from_pretrained(path / HF_CONFIG_DIR)
    torch.testing.assert_close(exported.score.weight, _params(first)["score.weight"])
    resumed = _critic(cfg)
    assert resumed.load_checkpoint(str(path)) == [1]
    torch.testing.assert_close(resumed.compute_values(data).batch["values"], first.compute_values(data).batch["values"],
                               atol=0, rtol=0)
