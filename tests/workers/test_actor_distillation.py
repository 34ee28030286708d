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
