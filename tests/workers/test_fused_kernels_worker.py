"""``actor_rollout_ref.model.use_fused_kernels`` through the worker: the typed config reaches the actor's
and the reference's engines, and a generate → log-prob → update round gives what it gives without."""

from __future__ import annotations

import pytest
import torch

from tests.workers import full_params, local_worker, make_prompts, one_thread, worker_config  # noqa: F401

TEXTS = ["hello world", "a", "the quick brown fox", "12+7="]
FUSED = ["model.use_fused_kernels=true", "model.fused_kernel_options.impl_backend=torch",
         "rollout.temperature=0.8", "actor.entropy_coeff=0.01"]


def test_actor_and_reference_take_the_fused_head_and_give_the_same_round(tiny_model_dir, tokenizer):
    prompts = make_prompts(tokenizer, TEXTS)
    plain = local_worker(worker_config(tiny_model_dir, FUSED[2:]), role="actor_rollout_ref")
    fused = local_worker(worker_config(tiny_model_dir, FUSED), role="actor_rollout_ref")
    assert plain.worker.engine.lm.fused is None and plain.worker.ref_policy.engine.lm.fused is None
    assert fused.worker.engine.lm.fused is not None and fused.worker.ref_policy.engine.lm.fused is not None
    data = plain.generate_sequences(prompts)  # the same sampled rows for both
    outs = {}
    for name, group in (("plain", plain), ("fused", fused)):
        scored = data.union(group.compute_log_prob(data)).union(group.compute_ref_log_prob(data))
        mask = scored.batch["response_mask"]
        scored.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
        outs[name] = scored, group.update_actor(scored), full_params(group.worker.actor.module)
    (p_data, p_metrics, p_params), (f_data, f_metrics, f_params) = outs["plain"], outs["fused"]
    for key in ("old_log_probs", "ref_log_prob"):
        torch.testing.assert_close(f_data.batch[key], p_data.batch[key], atol=1e-5, rtol=1e-5, msg=key)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        assert f_metrics.meta_info["metrics"][key] == pytest.approx(p_metrics.meta_info["metrics"][key], rel=1e-4)
    for name in p_params:
        torch.testing.assert_close(f_params[name], p_params[name], atol=1e-6, rtol=0, msg=name)
