"""The actor's micro-batch loss with on-policy distillation (``DataParallelPPOActor.policy_loss``): the task
loss plus ``distillation_loss_coef`` × the distillation term with task rewards, the term alone without,
each part recomputed here from the pure functions it must be made of."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.algos import core_algos
from rlfoundry.algos.distillation import distillation_loss
from rlfoundry.config.schema import ActorConfig, DistillationLossConfig
from rlfoundry.config.typed import to_typed
from rlfoundry.engines.base import GlobalBatchInfo
from rlfoundry.workers.actor import DataParallelPPOActor

B, T = 3, 4


def _batch():
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    old = -torch.rand(B, T, generator=g) - 0.5
    return {"response_mask": mask, "old_log_probs": old, "advantages": torch.randn(B, T, generator=g),
            "teacher_logprobs": -torch.rand(B, T, generator=g) - 0.5}, old + 0.05 * torch.randn(B, T, generator=g)


@pytest.mark.parametrize("use_task_rewards", [True, False])
@pytest.mark.parametrize("use_pg,mode", [(False, "k3"), (True, "k1")])
def test_the_loss_is_task_plus_coef_times_distillation_or_distillation_alone(use_task_rewards, use_pg, mode):
    actor_cfg = to_typed(ActorConfig, {"entropy_coeff": 0.0, "use_kl_loss": False})
    dcfg = to_typed(DistillationLossConfig, {"loss_mode": mode, "use_policy_gradient": use_pg,
                                              "use_task_rewards": use_task_rewards, "distillation_loss_coef": 0.5,
                                              "loss_max_clamp": 0.3})
    batch, log_prob = _batch()
    info = GlobalBatchInfo(dp_size=1, batch_num_tokens=int(batch["response_mask"].sum()), global_batch_size=B)
    actor = DataParallelPPOActor(actor_cfg, engine=None, distillation_loss=dcfg)
    out = actor.policy_loss({"log_probs": log_prob}, batch, info)

    task, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=batch["old_log_probs"], log_prob=log_prob, advantages=batch["advantages"],
        response_mask=batch["response_mask"], config=core_algos.with_global_batch_info(actor_cfg, info))
    term, _ = distillation_loss(log_prob, batch["old_log_probs"], batch["teacher_logprobs"], batch["response_mask"],
                                dcfg, "token-mean", info)
    expected = task + 0.5 * term if use_task_rewards else term
    torch.testing.assert_close(out.loss, expected, atol=1e-7, rtol=0)
    assert abs(float(task)) > 1e-3 and abs(float(term)) > 1e-3  # neither part is vacuous
    torch.testing.assert_close(out.summed["distillation/loss"], term.detach())
    assert "distillation/loss_max" in out.maxed and "distillation/abs_loss" in out.weighted


@pytest.mark.parametrize("use_task_rewards", [True, False])
def test_the_top_k_loss_reads_the_forward_s_log_probs_of_the_teacher_s_ids(use_task_rewards):
    """With ``forward_kl_topk`` the distillation term is ``topk_distillation_loss`` on the forward's
    ``log_probs_at`` (the student's log-probs of ``teacher_ids``) and the batch's ``teacher_logprobs``
    (B, T, k); the update asks the engine for those and reads the teacher's keys from the batch."""
    from rlfoundry.algos.distillation import topk_distillation_loss

    actor_cfg = to_typed(ActorConfig, {"entropy_coeff": 0.0, "use_kl_loss": False})
    dcfg = to_typed(DistillationLossConfig, {"loss_mode": "forward_kl_topk", "topk": 3, "use_task_rewards": use_task_rewards,
                                              "distillation_loss_coef": 0.5, "log_prob_min_clamp": -2.0})
    batch, log_prob = _batch()
    g = torch.Generator().manual_seed(1)
    batch["teacher_logprobs"] = torch.log_softmax(torch.randn(B, T, 6, generator=g), -1)[..., :3]
    batch["teacher_ids"] = torch.randint(0, 6, (B, T, 3), generator=g)
    outputs = {"log_probs": log_prob, "log_probs_at": -torch.rand(B, T, 3, generator=g) * 3,
               "topk_ids": torch.randint(0, 6, (B, T, 3), generator=g)}
    info = GlobalBatchInfo(dp_size=1, batch_num_tokens=int(batch["response_mask"].sum()), global_batch_size=B)
    actor = DataParallelPPOActor(actor_cfg, engine=None, distillation_loss=dcfg)
    out = actor.policy_loss(outputs, batch, info)

    task, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=batch["old_log_probs"], log_prob=log_prob, advantages=batch["advantages"],
        response_mask=batch["response_mask"], config=core_algos.with_global_batch_info(actor_cfg, info))
    term, _ = topk_distillation_loss(log_prob, batch["old_log_probs"], outputs["log_probs_at"], batch["teacher_logprobs"],
                                     batch["teacher_ids"], outputs["topk_ids"], batch["response_mask"], dcfg,
                                     "token-mean", info)
    torch.testing.assert_close(out.loss, task + 0.5 * term if use_task_rewards else term, atol=1e-7, rtol=0)
    assert abs(float(term)) > 1e-3
    assert "distillation/teacher_mass_max" in out.maxed and "distillation/overlap_ratio" in out.weighted
    assert actor._topk_output() == {"topk": 3, "log_probs_at": "teacher_ids"}
