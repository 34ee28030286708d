"""The PPO actor role: response log-probs and the policy-gradient loss, on any training engine.

The role brings the loss; the engine (``engines/``) runs it. Batch semantics (verl's): the rows a
rank receives are split into mini-batches of ``mini_batch_size`` rows (``ppo_mini_batch_size``
prompts × ``rollout.n`` / dp size); each mini-batch is one optimiser step, taken ``ppo_epochs``
times over the data (reshuffled each epoch when ``shuffle``); a mini-batch is cut into
micro-batches of ``ppo_micro_batch_size_per_gpu`` rows (or by token budget with
``use_dynamic_bsz``) whose gradients accumulate. Every micro-batch loss is aggregated with the
mini-batch-wide token and sequence counts (``agg_loss``'s global-batch contract), so one step is
the same, to float rounding, whatever the micro-batch size and however many ranks share it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from rlfoundry.algos import core_algos, distillation, flowrl, gvpo, spin
from rlfoundry.config.schema import DISTILLATION_TOPK_MODES
from rlfoundry.engines.base import GlobalBatchInfo, LogProbs, LossOutput, MicroBatching, TrainingEngine, UpdatePlan
from rlfoundry.engines.fsdp.forward import MODEL_INPUTS, ROUTED_EXPERTS
from rlfoundry.protocol import DataProto
from rlfoundry.workers.flowrl_head import prompt_log_z
from rlfoundry.workers.utils.plan import ppo_update_plan

__all__ = ["DataParallelPPOActor", "ActorBatchSizes", "ROUTING_OUTPUTS"]

# What a log-prob pass adds under MoE routing replay (docs/moe.md): R2's record (B, Tp+Tr, layers, top_k), and
# R3's per-row counts (B,) of response tokens the trainer's own router would have routed elsewhere / with a record
ROUTING_OUTPUTS = (ROUTED_EXPERTS, "routing_changed_tokens", "routing_counted_tokens")
# top-k distillation (docs/distillation.md): the teacher's top-k log-probs and token ids, (B, Tr, k) each
TEACHER_TOPK_KEYS = ("teacher_logprobs", "teacher_ids")


@dataclass(frozen=True)
class ActorBatchSizes:
    """Per-rank row counts, resolved once by the worker from the global config (never mutated)."""

    mini_batch_size: int = 0  # rows per optimiser step on this rank (0: whole batch)
    micro_batch_size: int = 1  # rows per forward/backward (ignored with use_dynamic_bsz)
    max_token_len: int = 16384  # token budget per micro-batch with use_dynamic_bsz


def _log_ratio_abs(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """|log π_θ − log π_old| over the valid tokens (B, Tr): mean and max. In the first mini-batch of
    the first epoch (before any optimiser step) with the rollout's log-probs as ``old_log_probs``,
    this is how far the trainer's forward is from the sampler's: the PPO ratio's starting offset."""
    valid = mask.bool()
    diff = (log_prob.detach().float() - old_log_prob.float()).abs().masked_fill(~valid, 0.0)
    mean = diff.sum() / valid.sum().clamp(min=1)
    return {"actor/log_ratio_abs_mean": mean, "actor/log_ratio_abs_max": diff.max()}


class DataParallelPPOActor:
    """Log-probs and PPO updates of one policy on one data-parallel rank.

    Args:
        config: the typed ``actor`` subtree (``ActorConfig``: clip ratios, ``entropy_coeff``,
            ``use_kl_loss``, ``kl_loss_coef``, ``kl_loss_type``, ``loss_agg_mode``,
            ``policy_loss.loss_mode``, ``ppo_epochs``, ``shuffle``, ``use_dynamic_bsz``, ``loss_scale_factor``),
            or ``RefConfig`` for a reference, which only computes log-probs.
        engine: the training engine holding the policy (without an optimiser for a reference).
        sizes: per-rank batch sizes (see ``ActorBatchSizes``).
        seed: base seed of the mini-batch shuffling.
        distillation_loss: ``distillation.distillation_loss`` (``DistillationLossConfig``) when on-policy
            distillation is on: the update then reads ``teacher_logprobs`` (docs/distillation.md).
    """

    def __init__(self, config: Any, engine: TrainingEngine, sizes: ActorBatchSizes | None = None, seed: int = 0,
                 distillation_loss: Any = None):
        self.config = config
        self.engine = engine
        self.sizes = sizes or ActorBatchSizes()
        self.seed = seed
        self.distillation_loss = distillation_loss
        self._head_draws = (-1, 0)  # FlowRL: (update call, log Z draws in it), _head_dropout_seed
        self._dpo_options: dict[str, Any] = {}  # SPIN: the update batch's algorithm keys (_spin_loss)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def compute_log_prob(
        self,
        data: DataProto,
        calculate_entropy: bool = False,
        micro_batch_size: int | None = None,
        max_token_len: int | None = None,
        temperature: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs (B, Tr) of ``responses`` under the current policy, and entropies if asked.

        Needs ``input_ids``, ``attention_mask``, ``position_ids`` (B, Tp+Tr), ``responses`` (B, Tr).
        The arguments default to verl's ``meta_info`` keys ``micro_batch_size``, ``max_token_len``
        (only with ``use_dynamic_bsz``) and ``temperature`` (required: the sampling temperature).
        """
        out = self.compute_log_prob_outputs(data, calculate_entropy, False, micro_batch_size, max_token_len, temperature)
        return out["log_probs"], out.get("entropy")

    def compute_log_prob_outputs(
        self,
        data: DataProto,
        calculate_entropy: bool = False,
        calculate_sum_pi_squared: bool = False,
        micro_batch_size: int | None = None,
        max_token_len: int | None = None,
        temperature: float | None = None,
        topk: int = 0,
    ) -> dict[str, torch.Tensor]:
        """``compute_log_prob``'s outputs by name: ``log_probs``, and as asked ``entropy`` and
        ``sum_pi_squared`` (sum_v pi(v|s_t)^2 at the same temperature), each (B, Tr), and with ``topk`` k > 0
        ``topk_log_probs``, ``topk_ids`` (B, Tr, k) (``LogProbs.topk``)."""
        meta = data.meta_info
        temperature = float(temperature if temperature is not None else meta["temperature"])
        micro_batch_size = micro_batch_size or meta.get("micro_batch_size")
        if max_token_len is None and meta.get("use_dynamic_bsz", False):
            max_token_len = meta["max_token_len"]
        mode = self._router_replay_mode(data)
        return self.engine.infer_batch(data.select(batch_keys=self._forward_keys(data, replay=mode == "R3")),
                                       LogProbs(temperature, entropy=calculate_entropy,
                                                sum_pi_squared=calculate_sum_pi_squared, routed_experts=mode == "R2",
                                                topk=topk),
                                       MicroBatching(micro_batch_size, max_token_len))

    def _router_replay_mode(self, data: DataProto | None = None) -> str:
        """``router_replay.mode`` (verl's; a reference's is always disabled: trainer/config.py). A batch whose
        ``meta_info["routing_replay"]`` is False is scored with the router's own routing (the mismatch audit's
        comparison)."""
        replay = getattr(self.config, "router_replay", None)
        if replay is None or (data is not None and data.meta_info.get("routing_replay") is False):
            return "disabled"
        return replay.mode

    def _forward_keys(self, data: DataProto, replay: bool) -> list[str]:
        """The model inputs, and with routing replay the experts to replay (R3: the rollout's; R2: the old-log-prob pass's)."""
        if not replay:
            return list(MODEL_INPUTS)
        if ROUTED_EXPERTS not in data.batch.keys():
            raise KeyError(f"actor_rollout_ref.actor.router_replay.mode={self._router_replay_mode()} but the batch has no "
                           "routed_experts: R3 needs actor_rollout_ref.rollout.enable_rollout_routing_replay=true (the HF "
                           "rollout records them); R2 needs compute_log_prob (use_rollout_log_probs=false) before the update")
        return [*MODEL_INPUTS, ROUTED_EXPERTS]

    # ---- update ---------------------------------------------------------------------------

    def _select_keys(self, data: DataProto) -> list[str]:
        keys = [*self._forward_keys(data, self._router_replay_mode() != "disabled"), "response_mask", "old_log_probs",
                "advantages"]
        if self.config.use_kl_loss or self._loss_mode == "spin":
            keys.append("ref_log_prob")
        if self._grouped_loss:
            keys.append(gvpo.GROUP_KEY)
        if data.batch is not None and "rollout_is_weights" in data.batch.keys():
            keys.append("rollout_is_weights")
        if self.distillation_loss is not None:
            keys.extend(TEACHER_TOPK_KEYS if self._topk_distillation else ["teacher_logprobs"])
        return keys

    @property
    def _loss_mode(self) -> str | None:
        return getattr(getattr(self.config, "policy_loss", None), "loss_mode", None)

    @property
    def _grouped_loss(self) -> bool:
        """Whether the policy loss reads whole prompt groups (GVPO: ``algos/gvpo.py``; SPIN's pairs:
        ``algos/spin.py``)."""
        return self._loss_mode in ("gvpo", "spin")

    @property
    def _topk_distillation(self) -> bool:
        return self.distillation_loss is not None and self.distillation_loss.loss_mode in DISTILLATION_TOPK_MODES

    def policy_loss(self, outputs: dict[str, torch.Tensor], batch: Any, info: GlobalBatchInfo,
                    on_policy: bool = False) -> LossOutput:
        """PPO's clipped surrogate (``policy_loss.loss_mode``), minus the entropy bonus, plus the KL
        loss against the reference (``use_kl_loss``), for one micro-batch. Metrics: ``actor/pg_loss``,
        ``actor/entropy``, ``actor/kl_loss`` (summed) and the loss function's ratios (weighted).
        ``loss_mode=flowrl`` is FlowRL's loss alone (``_flowrl_loss``)."""
        cfg = self.config
        if cfg.policy_loss.loss_mode == "flowrl":
            return self._flowrl_loss(outputs, batch, info, on_policy)
        if cfg.policy_loss.loss_mode == "spin":
            return self._spin_loss(outputs, batch, info)
        mask, log_prob, entropy = batch["response_mask"], outputs["log_probs"], outputs.get("entropy")
        mode, scale = cfg.loss_agg_mode, cfg.loss_scale_factor
        info = GlobalBatchInfo(info, **({"loss_scale_factor": scale} if scale is not None else {}))
        loss_fn = core_algos.get_policy_loss_fn(cfg.policy_loss.loss_mode)
        weights = batch["rollout_is_weights"] if "rollout_is_weights" in batch.keys() else None
        groups = {"index": batch[gvpo.GROUP_KEY]} if self._grouped_loss else {}
        pg_loss, ratios = loss_fn(
            old_log_prob=batch["old_log_probs"], log_prob=log_prob, advantages=batch["advantages"],
            response_mask=mask, loss_agg_mode=mode,
            config=core_algos.with_global_batch_info(cfg, info), rollout_is_weights=weights, **groups,
        )
        agg = {k: v for k, v in info.items() if k != "dp_size"}
        # metrics stay 0-d tensors: the engine reads a mini-batch's metrics to the host once, together
        loss, losses = pg_loss, {"actor/pg_loss": pg_loss.detach()}
        ratios, maxima = {**ratios, **_log_ratio_abs(log_prob, batch["old_log_probs"], mask)}, {}
        maxima["actor/log_ratio_abs_max"] = ratios.pop("actor/log_ratio_abs_max")
        entropy_coeff = cfg.entropy_coeff
        if entropy is not None:
            entropy_agg = core_algos.agg_loss(entropy, mask, mode, dp_size=info["dp_size"], **agg)
            if entropy_coeff != 0:
                loss = loss - entropy_coeff * entropy_agg
            losses["actor/entropy"] = entropy_agg.detach()
        if cfg.use_kl_loss:
            kld = core_algos.kl_penalty(log_prob, batch["ref_log_prob"], cfg.kl_loss_type)
            kl_loss = core_algos.agg_loss(kld, mask, mode, dp_size=info["dp_size"], **agg)
            loss = loss + cfg.kl_loss_coef * kl_loss
            losses["actor/kl_loss"] = kl_loss.detach()
        if self.distillation_loss is not None:
            loss = self._add_distillation(loss, outputs, batch, info, (losses, ratios, maxima))
        return LossOutput(loss, losses, ratios, maxima)

    def _flowrl_loss(self, outputs: dict[str, torch.Tensor], batch: Any, info: GlobalBatchInfo,
                     on_policy: bool) -> LossOutput:
        """FlowRL's flow-balance loss (``algos/flowrl.py``), with log Z from the policy's ``proj_z`` head on the
        prompt. As verl's actor: where the update is on-policy (one mini-batch, one epoch) the old log-probs
        are the forward's own, detached (importance weight exactly 1); no entropy bonus, no KL loss."""
        log_prob = outputs["log_probs"]
        old = log_prob.detach() if on_policy else batch["old_log_probs"]
        log_z = prompt_log_z(self.module, batch, self._head_dropout_seed())
        loss, ratios = flowrl.compute_policy_loss_flowrl(
            old, log_prob, batch["advantages"], batch["response_mask"],
            config=core_algos.with_global_batch_info(self.config, info), ref_log_prob=batch["ref_log_prob"],
            log_z=log_z)
        # verl's recipe logs the loss as actor/final_loss; actor/pg_loss is every loss's name here
        summed = {"actor/pg_loss": loss.detach(), "actor/final_loss": loss.detach()}
        summed |= {k: ratios.pop(k) for k in flowrl.SEQUENCE_METRICS}
        return LossOutput(loss, summed, ratios)

    def _spin_loss(self, outputs: dict[str, torch.Tensor], batch: Any, info: GlobalBatchInfo) -> LossOutput:
        """SPIN's DPO loss alone (``algos/spin.py``): no entropy bonus, no KL loss (verl's recipe actor has
        neither). beta is ``actor.dpo_beta``; the loss form and label smoothing come in the batch's
        ``meta_info`` from ``algorithm`` (as verl hands them over), kept by ``update_policy``."""
        options = {"dpo_beta": self.config.dpo_beta, **self._dpo_options}
        loss, metrics = spin.compute_policy_loss_spin(
            batch["old_log_probs"], outputs["log_probs"], batch["advantages"], batch["response_mask"],
            config=core_algos.with_global_batch_info(options, info), ref_log_prob=batch["ref_log_prob"],
            index=batch[gvpo.GROUP_KEY])
        return LossOutput(loss, {"actor/pg_loss": loss.detach(), **metrics}, {})

    def _head_dropout_seed(self) -> int:
        """A seed per (base seed, update call, rank, micro-batch of the call): the update counter is checkpointed,
        so the head's dropout masks repeat on resume (the process-wide generator is also drawn by the driver)."""
        calls = self.engine.update_calls
        count = self._head_draws[1] + 1 if self._head_draws[0] == calls else 0
        self._head_draws = (calls, count)
        rank, _ = self.engine.data_parallel_rank()
        return int(np.random.SeedSequence([self.seed, calls, rank, count]).generate_state(1)[0])

    def _add_distillation(self, task_loss: torch.Tensor, outputs: dict[str, torch.Tensor], batch: Any,
                          info: GlobalBatchInfo, metrics: tuple[dict, dict, dict]) -> torch.Tensor:
        """The actor's loss with the distillation term (algos/distillation.py); metrics ``distillation/*``."""
        dcfg, (losses, ratios, maxima) = self.distillation_loss, metrics
        common = (batch["response_mask"], dcfg, self.config.loss_agg_mode, info)
        if self._topk_distillation:  # the forward's log-probs of the teacher's ids (_update_output)
            term, found = distillation.topk_distillation_loss(
                outputs["log_probs"], batch["old_log_probs"], outputs["log_probs_at"], batch["teacher_logprobs"],
                batch["teacher_ids"], outputs["topk_ids"], *common)
        else:
            term, found = distillation.distillation_loss(outputs["log_probs"], batch["old_log_probs"],
                                                         batch["teacher_logprobs"], *common)
        losses["distillation/loss"] = term.detach()
        maxima |= {k: found.pop(k) for k in list(found) if k.endswith("_max")}
        ratios |= found
        return distillation.combine_with_task_loss(task_loss, term, dcfg.use_task_rewards, dcfg.distillation_loss_coef)

    def _topk_output(self) -> dict[str, Any]:
        """The update's extra forward outputs for top-k distillation: the log-probs of the teacher's ids
        (with gradient) and the student's own top-k ids (the overlap metrics)."""
        if not self._topk_distillation:
            return {}
        return {"topk": self.distillation_loss.topk, "log_probs_at": "teacher_ids"}

    def _whole_group_plan(self, data: DataProto, plan: UpdatePlan) -> UpdatePlan:
        """``plan`` cutting micro-batches in row order, after checking that this rank's rows hold whole
        groups that its mini- and micro-batches keep whole (the config checks make it so: config/gvpo.py)."""
        if gvpo.GROUP_KEY not in data.batch.keys():
            raise KeyError(f"policy_loss.loss_mode={self._loss_mode}: the batch has no {gvpo.GROUP_KEY!r} (the "
                           "trainer's group numbers, written when it orders the rows after generation)")
        cuts = [plan.mini_batch_size or len(data), plan.micro.size or len(data)]
        problem = gvpo.whole_group_problem(data.batch[gvpo.GROUP_KEY].tolist(), cuts)  # one read per update
        if problem:
            raise ValueError(f"policy_loss.loss_mode={self._loss_mode} needs whole groups in every micro-batch: "
                             f"{problem}; make actor.ppo_mini_batch_size and ppo_micro_batch_size_per_gpu multiples "
                             "of rollout.n per rank")
        return dataclasses.replace(plan, micro=dataclasses.replace(plan.micro, in_order=True))

    def update_policy(self, data: DataProto) -> dict[str, list[float]]:
        """Run ``ppo_epochs`` passes of mini-batch PPO steps over ``data``; metrics per mini-batch.

        Needs the forward keys plus ``response_mask``, ``old_log_probs``, ``advantages`` (and
        ``ref_log_prob`` with ``use_kl_loss``); ``meta_info["temperature"]`` as in
        ``compute_log_prob``. Returns ``{metric: [one value per optimiser step]}`` with verl's names:
        ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``actor/pg_clipfrac_lower``,
        ``actor/grad_norm``, ``actor/entropy`` (when ``entropy_coeff`` ≠ 0 or
        ``meta_info["calculate_entropy"]``; otherwise the trainer takes it from
        ``compute_log_prob``), ``actor/kl_loss`` (with ``use_kl_loss``),
        ``actor/log_ratio_abs_{mean,max}`` (|log π_θ − old_log_probs|, ``_log_ratio_abs``), and
        ``actor/nan_skipped`` (steps skipped in this call). Every value is the
        mini-batch-wide number, all-reduced, so it is the same on every rank.
        """
        in_loss = self.config.entropy_coeff != 0
        entropy_metric = bool(data.meta_info.get("calculate_entropy", False))
        output = LogProbs(float(data.meta_info["temperature"]), entropy=in_loss or entropy_metric, entropy_grad=in_loss,
                          **self._topk_output())
        plan = ppo_update_plan(
            self.config, self.sizes, self.seed,
            "(ppo_mini_batch_size × rollout.n / dp size); make train_batch_size a multiple of ppo_mini_batch_size",
        )
        if self._grouped_loss:
            plan = self._whole_group_plan(data, plan)
        dpo_keys = ("dpo_loss_type", "dpo_label_smoothing")
        self._dpo_options = {k: data.meta_info[k] for k in dpo_keys if k in data.meta_info}
        # verl's FlowRL actor: one mini-batch and one epoch make the update on-policy (_flowrl_loss)
        on_policy = plan.epochs == 1 and plan.mini_batch_size in (0, len(data))
        return self.engine.train_batch(data.select(batch_keys=self._select_keys(data)), output,
                                       partial(self.policy_loss, on_policy=on_policy), plan)
