"""On-policy distillation losses (verl's ``distillation.distillation_loss``), as pure tensor functions.

The student samples a response; a teacher scores the same tokens. Per response token t with student
log-prob s_t = log pi(y_t) and teacher log-prob q_t = log pi_T(y_t), the one-sample estimators of the
reverse KL(pi || pi_T) (core_algos.kl_penalty, logprob = student, ref = teacher) are the per-token loss:
k1 = s - q, k3 = e^(q-s) - 1 - (q - s), abs, k2 = (s-q)^2/2. That loss is used in one of two ways:

- supervised (``use_policy_gradient=false``, Agarwal et al. 2023, arXiv:2306.13649): aggregate it with
  ``loss_agg_mode`` and backpropagate through the student's log-probs (k1's gradient does not depend on
  the teacher, hence verl's and our start-up error for k1 here);
- as a reward (``use_policy_gradient=true``, Thinking Machines' "On-Policy Distillation", 2025): -loss,
  detached, is a per-token advantage of a PPO-clip term (``clip_ratio*`` of the distillation config)
  against the rollout's ``old_log_probs``.

The top-k mode (``forward_kl_topk``, GKD's forward KL, Agarwal et al. 2023) reads distributions instead:
with the teacher's k likeliest tokens v_1..v_k at each position and their log-probs q_i (temperature 1),
and the student's log-probs s_i of the same tokens (at the rollout temperature, normalised over the whole
vocabulary), the per-token loss is sum_i e^(q_i) (q_i - s_i), not renormalised over the k tokens, q and s
floored at ``log_prob_min_clamp`` first; the top-k sums fall short of 1, so it can be negative and is
floored at 0 (as verl's ``compute_forward_kl_topk``).

``loss_max_clamp`` clamps the per-token loss to [-c, c] first (k1 can be negative). With
``use_task_rewards`` the task's PPO loss (pg + entropy + KL loss) is kept and the distillation term is
added with ``distillation_loss_coef``; without, the task loss is dropped and the coefficient is 1.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

from rlfoundry.algos import core_algos

__all__ = ["distillation_token_losses", "distillation_loss", "forward_kl_topk", "topk_distillation_loss",
           "combine_with_task_loss"]


def distillation_token_losses(student_log_prob: torch.Tensor, teacher_log_prob: torch.Tensor, loss_mode: str,
                              loss_max_clamp: float | None = None) -> torch.Tensor:
    """Per-token distillation loss (B, T) from student and teacher log-probs of the sampled tokens (B, T).

    ``loss_mode`` is a KL estimator of ``core_algos.kl_penalty`` (k1, k3, ...) of KL(student || teacher);
    ``loss_max_clamp`` (None: none) clamps the result to [-c, c].
    """
    losses = core_algos.kl_penalty(student_log_prob, teacher_log_prob, loss_mode)
    if loss_max_clamp is not None:
        losses = losses.clamp(min=-loss_max_clamp, max=loss_max_clamp)
    return losses


def distillation_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    teacher_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    loss_config: Any,
    loss_agg_mode: str = "token-mean",
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The distillation term of one micro-batch and its metrics. All tensors (B, T).

    ``loss_config``: ``loss_mode``, ``loss_max_clamp``, ``use_policy_gradient`` and, for the latter,
    ``clip_ratio``/``clip_ratio_low``/``clip_ratio_high`` (a ``DistillationLossConfig``).
    ``global_batch_info``: ``agg_loss``'s mini-batch counts (dp_size, batch_num_tokens, ...).
    Metrics: ``distillation/abs_loss`` (mean |loss| before the clamp), ``distillation/loss_max``
    (over valid tokens, before the clamp), and with the policy gradient the PPO-clip's ratios as
    ``distillation/pg_clipfrac``, ``distillation/ppo_kl``, ``distillation/pg_clipfrac_lower``.
    """
    raw = distillation_token_losses(log_prob, teacher_log_prob, loss_config.loss_mode)
    return _aggregate(raw, log_prob, old_log_prob, response_mask, loss_config, loss_agg_mode, global_batch_info)


def forward_kl_topk(student_topk_log_prob: torch.Tensor, teacher_topk_log_prob: torch.Tensor,
                    log_prob_min_clamp: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token forward KL(teacher || student) over the teacher's top-k tokens, (B, T), floored at 0.

    ``student_topk_log_prob`` / ``teacher_topk_log_prob`` (B, T, k): the student's and the teacher's
    log-probs of the teacher's top-k tokens. Also returns, per token (B, T): ``student_mass`` and
    ``teacher_mass``, the probability each puts on those k tokens (before the clamp), and ``token_kl``
    (B, T, k), each token's term e^q (q - s) after the clamp (the overlap diagnostics read it).
    """
    student, teacher = student_topk_log_prob.float(), teacher_topk_log_prob.float()
    masses = {"student_mass": student.exp().sum(-1), "teacher_mass": teacher.exp().sum(-1)}
    if log_prob_min_clamp is not None:  # a floor on log q - log p where either is near 0
        student, teacher = student.clamp_min(log_prob_min_clamp), teacher.clamp_min(log_prob_min_clamp)
    token_kl = teacher.exp() * (teacher - student)
    # both sides miss the mass outside the k tokens, so the sum can dip below 0: floored, as in verl
    return token_kl.sum(-1).clamp_min(0.0), masses | {"token_kl": token_kl}


def topk_distillation_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    student_topk_log_prob: torch.Tensor,
    teacher_topk_log_prob: torch.Tensor,
    teacher_ids: torch.Tensor,
    student_ids: torch.Tensor,
    response_mask: torch.Tensor,
    loss_config: Any,
    loss_agg_mode: str = "token-mean",
    global_batch_info: Mapping[str, Any] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``distillation_loss`` of the top-k mode: per token ``forward_kl_topk``, then the same clamp,
    aggregation (or policy gradient on -loss) and metrics. (B, T, k) inputs: the student's log-probs of
    the teacher's ids, the teacher's log-probs, ``teacher_ids`` and the student's own top-k ids
    ``student_ids`` (for the overlap metrics only). Metrics besides ``distillation_loss``'s (over valid
    tokens): ``distillation/{student,teacher}_mass`` (means) and ``_max``, ``distillation/overlap_ratio``
    (|top-k of teacher ∩ top-k of student| / k) and ``distillation/overlap_token_advantage`` (-e^q (q - s)
    averaged over the shared tokens, then over positions sharing any; 0 where none does).
    """
    raw, parts = forward_kl_topk(student_topk_log_prob, teacher_topk_log_prob, loss_config.log_prob_min_clamp)
    loss, metrics = _aggregate(raw, log_prob, old_log_prob, response_mask, loss_config, loss_agg_mode,
                               global_batch_info)
    return loss, metrics | _topk_metrics(parts, teacher_ids, student_ids, response_mask)


def _topk_metrics(parts: dict[str, torch.Tensor], teacher_ids: torch.Tensor, student_ids: torch.Tensor,
                  mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The top-k mode's diagnostics over valid tokens; the overlap ones follow Li et al. 2026
    ("Rethinking On-Policy Distillation", arXiv:2604.13016), as verl logs them."""
    valid = mask.bool()
    shared = (teacher_ids.unsqueeze(-1) == student_ids.unsqueeze(-2)).any(-1)  # (B, T, k) teacher token in both
    count = shared.sum(-1)
    advantage = (-parts["token_kl"].detach() * shared).sum(-1) / count.clamp_min(1)
    overlapping = valid & (count > 0)
    metrics = {"distillation/overlap_ratio": _mean(count.float() / teacher_ids.shape[-1], valid),
               "distillation/overlap_token_advantage": _mean(advantage, overlapping)}
    for side in ("student", "teacher"):
        mass = parts[f"{side}_mass"].detach()
        metrics[f"distillation/{side}_mass"] = _mean(mass, valid)
        metrics[f"distillation/{side}_mass_max"] = mass[valid].max() if valid.any() else mass.new_zeros(())
    return metrics


def _mean(values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``where`` holds, 0 where it holds nowhere (no NaN, no read of a count)."""
    return (values * where).sum() / where.sum().clamp_min(1)


def _aggregate(raw: torch.Tensor, log_prob: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor,
               loss_config: Any, loss_agg_mode: str,
               global_batch_info: Mapping[str, Any] | None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token losses (B, T) -> the distillation term: clamped, then aggregated or a policy gradient."""
    info = dict(global_batch_info or {})
    metrics = _range_metrics(raw, response_mask)
    losses = raw if loss_config.loss_max_clamp is None else raw.clamp(-loss_config.loss_max_clamp,
                                                                       loss_config.loss_max_clamp)
    if not loss_config.use_policy_gradient:
        return core_algos.agg_loss(losses, response_mask, loss_agg_mode, **info), metrics
    policy_loss = core_algos.get_policy_loss_fn(loss_config.policy_loss_mode)
    # the advantage is -loss: a token the teacher finds likelier than the student does is reinforced
    loss, pg = policy_loss(old_log_prob=old_log_prob, log_prob=log_prob, advantages=-losses.detach(),
                           response_mask=response_mask, loss_agg_mode=loss_agg_mode,
                           config=core_algos.with_global_batch_info(loss_config, info))
    metrics |= {"distillation/" + k.removeprefix("actor/"): v for k, v in pg.items()}
    return loss, metrics


def _range_metrics(losses: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    valid = mask.bool()
    if not valid.any():  # an all-padding micro-batch: nothing to report, and no NaN either
        zero = losses.new_zeros(())
        return {"distillation/abs_loss": zero, "distillation/loss_max": zero}
    picked = losses.detach()[valid]
    return {"distillation/abs_loss": picked.abs().mean(), "distillation/loss_max": picked.max()}


def combine_with_task_loss(task_loss: torch.Tensor, distill_loss: torch.Tensor, use_task_rewards: bool,
                           distillation_loss_coef: float) -> torch.Tensor:
    """The actor's loss: task_loss + coef · distill_loss with task rewards; distill_loss alone without."""
    if not use_task_rewards:
        return distill_loss
    return task_loss + distillation_loss_coef * distill_loss
