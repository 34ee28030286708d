"""The PPO trainer: one driver loop over worker groups (``PPOTrainer``; verl's name ``RayPPOTrainer``).

The step reads top to bottom like the algorithm box (see DESIGN.md):

    [sample source: generate → reward] → old log-probs → ref log-probs → teacher log-probs → values → KL-in-reward
             → advantages → critic update → actor update (the rollout shares the actor's weights)

Where the scored batch comes from is a sample source (``sources.py``): synchronous generation,
DAPO's dynamic sampling, one-step-off or fully asynchronous pipelines; the rest is one code path.

Each phase is one method timed by ``marked_timer``; variants (ReMax's greedy baseline, KL in the
reward vs in the loss, critic warm-up) live inside the phase they change. ``apply_kl_penalty`` and
``compute_advantage`` are pure functions of the batch. The worker groups come from a factory, so
the same trainer runs on the in-process back end and on Ray.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import OmegaConf

from rlfoundry.config.schema import SUM_PI_SQUARED_ESTIMATORS, PPOConfig, starts_from_dist_checkpoint
from rlfoundry.algos import core_algos, rollout_corr
from rlfoundry.algos.spin import reference_to_checkpoint, refreshes_reference
from rlfoundry.trainer.ppo import mismatch
from rlfoundry.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
from rlfoundry.trainer.ppo.teachers import teacher_log_probs, teacher_roles, teacher_topk
from rlfoundry.single_controller.base import ClassWithInitArgs, WorkerGroup
from rlfoundry.trainer.config import ConfigError, need_reference_policy, world_size
from rlfoundry.trainer.metric_utils import (
    compute_data_metrics,
    compute_throughout_metrics,
    compute_timing_metrics,
    marked_timer,
    process_validation_metrics,
    reduce_metrics,
)
from rlfoundry.utils.fs import rename_then_delete
from rlfoundry.utils.tokenizer import pad_id
from rlfoundry.utils.trajectories import generation_records, write_generations
from rlfoundry.utils.torch_functional import masked_mean
from rlfoundry.trainer.ppo.sources import DynamicSamplingSource, SampleSource, SyncSource

__all__ = ["PPOTrainer", "RayPPOTrainer", "WorkerGroupFactory", "apply_kl_penalty", "balance_batch", "compute_advantage",
           "order_groups"]

# (role name → worker class with init args) → (role name → worker group view); see main_ppo.
WorkerGroupFactory = Callable[[dict[str, ClassWithInitArgs]], dict[str, WorkerGroup]]
logger = logging.getLogger(__name__)
MISMATCH_LOG_EVERY = 10  # steps between two mismatch diagnoses naming the same cause (a changed cause: at once)
TRAINER_STATE_FILE = "data.pt"  # the name verl uses for the trainer/loader state
REF_DIR = "ref"  # SPIN's refreshed reference: model shards only, beside actor/ (docs/checkpoints.md)


# ───────────────────────────────────── pure phase functions ─────────────────────────────────────


def apply_kl_penalty(data: DataProto, kl_ctrl: Any, kl_penalty: str = "kl") -> tuple[DataProto, dict[str, float]]:
    """token_level_rewards = token_level_scores − β·KL(old ‖ ref) per response token (Ziegler et al. 2019).

    Reads ``token_level_scores``, ``old_log_probs``, ``ref_log_prob``, ``response_mask`` (B, Tr);
    writes ``token_level_rewards``. β is ``kl_ctrl.value`` *before* this step's update; the
    controller is then updated with the batch-mean sequence KL (mean over tokens, then sequences)
    and ``n_steps`` = B, as verl does. Returns the batch and ``actor/reward_kl_penalty{,_coeff}``.
    """
    mask = data.batch["response_mask"].to(data.batch["token_level_scores"].dtype)
    kld = core_algos.kl_penalty(data.batch["old_log_probs"], data.batch["ref_log_prob"], kl_penalty=kl_penalty) * mask
    beta = float(kl_ctrl.value)
    data.batch["token_level_rewards"] = data.batch["token_level_scores"] - beta * kld
    current_kl = float(masked_mean(kld, mask, axis=-1).mean().item())
    kl_ctrl.update(current_kl=current_kl, n_steps=len(data))
    return data, {"actor/reward_kl_penalty": current_kl, "actor/reward_kl_penalty_coeff": beta}


def compute_advantage(
    data: DataProto,
    adv_estimator: str,
    gamma: float = 1.0,
    lam: float = 1.0,
    num_repeat: int = 1,
    norm_adv_by_std_in_grpo: bool = True,
    config: Any = None,
    generator: torch.Generator | None = None,
) -> DataProto:
    """``advantages`` and ``returns`` (B, Tr) from any registered estimator, called with one kwargs set.

    Every estimator takes ``**kwargs``, so the same call serves all of them: ``values`` (GAE),
    ``index`` = ``uid`` (group baselines), ``reward_baselines`` (ReMax) are passed when the batch
    has them; the optimal token baselines also get ``old_log_probs``, ``sum_pi_squared`` and
    ``rollout_is_weights`` (``_optimal_token_baseline_inputs``). ``num_repeat`` is kept for verl's signature (groups come from ``uid``). With GAE and
    ``config.use_pf_ppo`` the batch is then resampled by score (PF-PPO, ``algos/pf_ppo.py``; only
    after GAE, as in verl), drawing with ``generator``.
    """
    fn = core_algos.get_adv_estimator_fn(adv_estimator)
    tensors = data.batch
    kwargs: dict[str, Any] = {
        "token_level_rewards": tensors["token_level_rewards"],
        "response_mask": tensors["response_mask"],
        "gamma": gamma,
        "lam": lam,
        "norm_adv_by_std_in_grpo": norm_adv_by_std_in_grpo,
        "config": config if config is not None else {"gamma": gamma, "lam": lam},
    }
    for key in ("values", "reward_baselines"):
        if key in tensors.keys():
            kwargs[key] = tensors[key]
    if "uid" in data.non_tensor_batch:
        kwargs["index"] = data.non_tensor_batch["uid"]
    if adv_estimator == "gdpo":  # its reward components (carried by carry_gdpo_components)
        kwargs["non_tensor_batch"] = data.non_tensor_batch
    if adv_estimator in SUM_PI_SQUARED_ESTIMATORS:
        kwargs |= _optimal_token_baseline_inputs(data, adv_estimator)
    advantages, returns = fn(**kwargs)
    data.batch["advantages"] = advantages
    data.batch["returns"] = returns
    if adv_estimator == "gae" and config is not None and config.get("use_pf_ppo", False):
        pf = config.get("pf_ppo") or {}
        data = core_algos.compute_pf_ppo_reweight_data(data, pf.get("reweight_method", "pow"),
                                                       float(pf.get("weight_pow", 2.0)), generator=generator)
    return data


def _optimal_token_baseline_inputs(data: DataProto, adv_estimator: str) -> dict[str, Any]:
    """What the optimal token baselines read besides rewards (verl passes the same): the actor's
    ``old_log_probs`` and ``sum_pi_squared`` (B, Tr), and ``rollout_is_weights`` (B, Tr) when rollout
    correction wrote them (W_t is then scaled by their square)."""
    tensors = data.batch
    missing = [k for k in ("old_log_probs", "sum_pi_squared") if k not in tensors.keys()]
    if missing:  # config validation requires calculate_sum_pi_squared; this is the batch's own check
        raise KeyError(f"algorithm.adv_estimator={adv_estimator} needs {missing} in the batch: the actor's "
                       "compute_log_prob writes them with actor_rollout_ref.actor.calculate_sum_pi_squared=true")
    weights = tensors["rollout_is_weights"] if "rollout_is_weights" in tensors.keys() else None
    return {"old_log_probs": tensors["old_log_probs"], "sum_pi_squared": tensors["sum_pi_squared"],
            "rollout_is_weights": weights}


def balance_batch(data: DataProto, world_size: int) -> tuple[DataProto, dict[str, float]]:
    """Reorder rows so each dp rank's contiguous chunk gets a similar token count (verl's balance_batch).

    Karmarkar–Karp partitioning into ``gcd(rows, world_size)`` equal-size parts over per-row token
    counts: ``world_size`` where the rows divide the ranks; else a multiple of the data-parallel size
    (which divides both), whose contiguous shares an unpadded update trains (``update_rows``). A no-op for
    one part. Row order inside the batch does not change any estimator (groups come from ``uid``), only
    which rank computes which row.
    """
    from rlfoundry.utils.seqlen_balancing import get_seqlen_balanced_partitions

    seqlens = data.batch["attention_mask"].sum(-1).tolist()
    k = math.gcd(len(seqlens), world_size)
    if k <= 1:
        return data, {}
    parts = get_seqlen_balanced_partitions(seqlens, k_partitions=k, equal_size=True)
    order = [i for part in parts for i in part]
    data.reorder(torch.tensor(order))
    sums = [sum(seqlens[i] for i in part) for part in parts]
    return data, {"training/seqlen_max_rank_tokens": float(max(sums)), "training/seqlen_min_rank_tokens": float(min(sums))}


def order_groups(data: DataProto, world_size: int, balance: bool = True) -> tuple[DataProto, dict[str, float]]:
    """Rows reordered so each prompt's group (``uid``) is in consecutive rows and each rank's contiguous
    chunk holds whole groups, numbered in ``uid_tensor`` (B,) int64: what GVPO's loss reads
    (``algos/gvpo.py``), as verl's recipe reorders its batch. With ``balance``, ``balance_batch`` by group:
    Karmarkar–Karp over the groups' token counts into ``world_size`` equal shares (when they divide)."""
    from rlfoundry.algos.gvpo import GROUP_KEY
    from rlfoundry.utils.seqlen_balancing import get_seqlen_balanced_partitions

    members: dict[Any, list[int]] = {}
    for i, uid in enumerate(data.non_tensor_batch["uid"]):
        members.setdefault(uid, []).append(i)
    groups, stats = list(members.values()), {}
    if balance and world_size > 1 and len(groups) % world_size == 0:
        seqlens = data.batch["attention_mask"].sum(-1).tolist()
        tokens = [sum(seqlens[i] for i in g) for g in groups]
        parts = get_seqlen_balanced_partitions(tokens, k_partitions=world_size, equal_size=True)
        groups = [groups[j] for part in parts for j in part]
        sums = [sum(tokens[j] for j in part) for part in parts]
        stats = {"training/seqlen_max_rank_tokens": float(max(sums)), "training/seqlen_min_rank_tokens": float(min(sums))}
    data.reorder(torch.tensor([i for g in groups for i in g]))
    data.batch[GROUP_KEY] = torch.repeat_interleave(torch.arange(len(groups)), torch.tensor([len(g) for g in groups]))
    return data, stats


def _generative_reward_model(config: PPOConfig, tokenizer: Any, judge_wg: WorkerGroup) -> Any:
    """The driver's side of the judge: templates and parses; ``judge_wg`` generates the judgements."""
    from transformers import AutoTokenizer

    from rlfoundry.config import to_typed
    from rlfoundry.config.schema import GenerativeRewardModelConfig
    from rlfoundry.rewards.judge import GenerativeRewardModel

    judge = to_typed(GenerativeRewardModelConfig, config.reward.reward_model, name="reward.reward_model")
    judge_tokenizer = AutoTokenizer.from_pretrained(judge.model_path, trust_remote_code=judge.trust_remote_code)
    return GenerativeRewardModel(judge_wg.generate_sequences, tokenizer, judge_tokenizer, judge,
                                 reward_fn_key=str(config.data.reward_fn_key))


def _reward_model_server(config: PPOConfig, genrm_wg: WorkerGroup) -> Any:
    """verl's reward loop: ``reward_model.model.path`` on ``genrm_wg``'s engine behind SGLang's /generate."""
    from transformers import AutoTokenizer

    from rlfoundry.rewards.reward_loop import RewardModelServer

    rm = config.reward_model
    tokenizer = AutoTokenizer.from_pretrained(rm.model.path, trust_remote_code=bool(rm.model.trust_remote_code))
    server = RewardModelServer(genrm_wg.generate_sequences, tokenizer, rm.model.path,
                               prompt_cap=int(rm.rollout.prompt_length), response_cap=int(rm.rollout.response_length))
    server.trust_remote_code = bool(rm.model.trust_remote_code)  # scorer processes load its tokenizer so too
    return server


def carry_gdpo_components(batch: DataProto, result: dict[str, Any], algorithm: Any, failure_score: float = 0.0) -> None:
    """GDPO's reward components, the ``algorithm.gdpo_reward_keys`` columns of the reward function's
    ``reward_extra_info``, into ``batch.non_tensor_batch`` where the estimator reads them (as verl
    keeps them). A sample whose scorer failed has NaN there (counted in ``reward/errors``); like its
    score, its components become ``failure_score``. A key the function never returned is reported by
    the estimator."""
    if algorithm.adv_estimator != "gdpo":
        return
    info = result.get("reward_extra_info", {})
    for key in algorithm.gdpo_reward_keys or []:
        if key in info:
            column = _numeric_column(info[key])
            if column is None:
                raise ValueError(f"algorithm.gdpo_reward_keys names {key!r}, but the reward function's {key!r} values are "
                                 f"not all numbers (e.g. {info[key][:3]!r}); GDPO normalises numeric components only")
            batch.non_tensor_batch[key] = np.where(np.isnan(column), failure_score, column).astype(object)


def reward_result_metrics(result: dict[str, Any]) -> dict[str, float]:
    """Step metrics from a reward manager's ``return_dict`` result.

    ``reward_metrics`` (``reward/errors``, ``reward/errors/<kind>``: counts of failed samples) pass
    through as they are; each numeric ``reward_extra_info`` column becomes ``reward/<key>``, its
    NaN-mean: a sample whose scorer failed carries NaN there (its score is already counted as an
    error), and one failure must not turn the whole column's metric into NaN.
    """
    metrics = {k: float(v) for k, v in result.get("reward_metrics", {}).items()}
    for key, values in result.get("reward_extra_info", {}).items():
        column = _numeric_column(values)
        if column is not None and not np.isnan(column).all():
            metrics[f"reward/{key}"] = float(np.nanmean(column))
    return metrics


def _numeric_column(values: Any) -> np.ndarray | None:
    """``values`` as a float array when every entry is a number (bools count), else None."""
    if len(values) == 0 or not all(isinstance(v, (int, float, bool, np.number)) for v in values):
        return None
    return np.asarray(values, dtype=np.float64)


def rollout_probs_diff_metrics(rollout_log_probs: torch.Tensor, old_log_probs: torch.Tensor,
                               mask: torch.Tensor) -> dict[str, float]:
    """|p_rollout − p_actor| per valid token (verl's ``training/rollout_probs_diff_*``), and the same
    on the log scale (``training/rollout_log_probs_diff_{max,mean}``, |log p_rollout − log p_actor|).

    The rollout engine and the actor should score a sampled token alike; a gap means the engine
    samples from another distribution (stale weights, other dtype, top-k/top-p filtering), which
    makes the PPO ratio off-policy without anyone noticing. The log scale is the PPO ratio's:
    exp(diff) is how far off that token's ratio starts. All (B, Tr).
    """
    valid = mask.bool()
    if not valid.any():
        return {}
    diff = (rollout_log_probs.float().exp() - old_log_probs.float().exp()).abs()[valid]
    log_diff = (rollout_log_probs.float() - old_log_probs.float()).abs()[valid]
    return {"training/rollout_probs_diff_max": float(diff.max()), "training/rollout_probs_diff_mean": float(diff.mean()),
            "training/rollout_probs_diff_std": float(diff.std()) if diff.numel() > 1 else 0.0,
            "training/rollout_log_probs_diff_max": float(log_diff.max()),
            "training/rollout_log_probs_diff_mean": float(log_diff.mean())}


def trim_prompt_padding(prompts: DataProto) -> DataProto:
    """Drop the left-padding columns that every prompt in the batch has.

    The dataset pads to ``data.max_prompt_length`` (verl's layout); the batch only needs its longest
    prompt. Every later pass (generation, log-probs, update) then runs on the shorter width: the
    benchmark measured a third of the step spent on such padding. Pad columns are masked, so the
    numbers do not change. Shapes: (B, Tp) -> (B, Tp') with Tp' = longest prompt in the batch.
    """
    mask = prompts.batch["attention_mask"]
    first = int(mask.any(dim=0).float().argmax())  # first column where some prompt has a token
    if first == 0:
        return prompts
    keys = [k for k in ("input_ids", "attention_mask", "position_ids") if k in prompts.batch.keys()]
    trimmed = {k: prompts.batch[k][..., first:] for k in keys}
    rest = {k: v for k, v in prompts.batch.items() if k not in trimmed}
    return DataProto.from_dict(tensors=trimmed | rest, non_tensors=dict(prompts.non_tensor_batch),
                               meta_info=dict(prompts.meta_info))


def _concat_generations(parts: list[DataProto], pad_id: int) -> DataProto:
    """Generated batches whose prompts were trimmed to different widths, left-padded to the widest and
    stacked (pad columns are masked: the numbers do not change)."""
    width = max(p.batch["prompts"].shape[1] for p in parts)
    padded = []
    for part in parts:
        extra = width - part.batch["prompts"].shape[1]
        tensors = dict(part.batch.items())
        for key, value in (("prompts", pad_id), ("input_ids", pad_id), ("attention_mask", 0), ("position_ids", 0)):
            if extra and key in tensors:
                tensors[key] = torch.nn.functional.pad(tensors[key], (extra, 0), value=value)
        if extra and "routed_experts" in tensors:  # (B, T, layers, top_k): token columns are dim 1; -1 = no record
            tensors["routed_experts"] = torch.nn.functional.pad(tensors["routed_experts"], (0, 0, 0, 0, extra, 0), value=-1)
        padded.append(DataProto.from_dict(tensors=tensors, non_tensors=dict(part.non_tensor_batch)))
    out = DataProto.concat(padded)
    out.meta_info = dict(parts[0].meta_info)
    return out


def val_generation_samples(records: list[dict[str, Any]], n: int) -> list[tuple[str, str, float]]:
    """``trainer.log_val_generations``: n (input, output, score) samples, chosen as verl chooses them
    (sorted by input, then shuffled with a fixed seed, 42): the same prompts at every validation,
    so the table shows one prompt's answers change over training."""
    samples = sorted(((r["input"], r["output"], float(r["score"])) for r in records), key=lambda s: s[0])
    np.random.RandomState(42).shuffle(samples)
    return samples[:n]


def compute_response_mask(data: DataProto) -> torch.Tensor:
    """1 on response tokens up to and including EOS: the response part of ``attention_mask``."""
    response_length = data.batch["responses"].shape[-1]
    return data.batch["attention_mask"][:, -response_length:]


# ───────────────────────────────────────── the trainer ─────────────────────────────────────────


def make_source(trainer: PPOTrainer) -> SampleSource:
    """The sample source ``async_training.mode`` (and ``algorithm.filter_groups``) asks for."""
    mode = trainer.config.async_training.mode
    if mode == "one_step_off":
        from rlfoundry.trainer.ppo.one_step_off import OneStepOffSource

        return OneStepOffSource(trainer)
    if mode == "fully_async":
        from rlfoundry.trainer.ppo.fully_async import FullyAsyncSource

        return FullyAsyncSource(trainer)
    if trainer.config.trainer.spo.enable:  # verl's SPO recipe: prioritised prompts, per-prompt baselines
        from rlfoundry.trainer.ppo.spo import SPOSource

        return SPOSource(trainer)
    if trainer.config.algorithm.filter_groups.enable:
        return DynamicSamplingSource(trainer)
    return SyncSource(trainer)


@dataclass
class _RunState:
    """What the loop carries between steps; saved in the checkpoint (with the loader state)."""

    global_steps: int = 0
    first_val: dict[str, float] = field(default_factory=dict)
    last_val: dict[str, float] = field(default_factory=dict)
    resumed_from: str | None = None
    last_ckpt: str | None = None


class PPOTrainer:
    """Driver of PPO-family training: a sample source (``sources.py``: synchronous, dynamic sampling,
    one-step-off or fully asynchronous, by ``async_training.mode`` and ``algorithm.filter_groups``)
    hands each step a generated, scored batch; ``train_on`` does the rest. ``config`` is the
    resolved, typed config (``PPOConfig``, see ``resolve_config``)."""

    reward_metrics = staticmethod(reward_result_metrics)  # the step metrics of a reward result

    def __init__(
        self,
        config: PPOConfig,
        tokenizer: Any,
        worker_group_factory: WorkerGroupFactory,
        worker_classes: dict[str, ClassWithInitArgs],
        reward_fn: Callable,
        val_reward_fn: Callable,
        train_dataloader: Any,
        val_dataloader: Any = None,
    ) -> None:
        self.config, self.tokenizer = config, tokenizer
        self.reward_fn, self.val_reward_fn = reward_fn, val_reward_fn
        self.train_dataloader, self.val_dataloader = train_dataloader, val_dataloader
        self._factory, self._worker_classes = worker_group_factory, worker_classes
        self.use_critic = bool(config.critic.enable)
        from rlfoundry.config.verl_compat import serves_reward_model

        # verl's reward loop with a custom function: the model is served to it (no classifier pass)
        self.serves_rm = serves_reward_model(config)
        self.use_rm = bool(config.reward_model.enable) and not self.serves_rm
        self.reward_server = None  # rewards/reward_loop.RewardModelServer, set by init_workers
        self.judge = None  # the generative reward model (reward.reward_model.enable), set by init_workers
        self.use_reference_policy = need_reference_policy(config)
        self.teacher_wgs: dict[str, WorkerGroup] = {}  # on-policy distillation's teachers, set by init_workers
        self.world_size = world_size(config)
        self.total_training_steps = int(config.trainer.total_training_steps)
        self.kl_ctrl = core_algos.get_kl_controller(config.algorithm.kl_ctrl)
        self.state = _RunState()
        self.tracker = None
        self._reward_thread, self._pending_reward = None, None  # reward_model.launch_reward_fn_async
        self._last_diagnosis: tuple[int, str] = (-MISMATCH_LOG_EVERY, "")  # (step, cause) of the last one logged
        self._last_fp32_check = -MISMATCH_LOG_EVERY  # step of the mismatch audit's last fp32 recompute
        self.source = make_source(self)

    # ---- workers -------------------------------------------------------------------------------

    def init_workers(self) -> None:
        """Start the worker groups (all roles colocated, one process per rank) and load the models.

        With a ``rollout`` class (the asynchronous pipelines) the rollout gets a pool of its own,
        joined to the trainer's by the checkpoint engine; ``self.rollout_wg`` generates either way."""
        classes = dict(self._worker_classes)
        rollout_cls = classes.pop("rollout", None)
        # a generative reward model (the judge, or the reward loop's served model) in a pool of its own
        apart = {"judge": self.config.reward.reward_model, "genrm": self.config.reward_model}
        judge_key = next((k for k in apart if k in classes and apart[k].enable_resource_pool), None)
        judge_cls = classes.pop(judge_key) if judge_key else None
        # the own pools first: their processes start before this one hosts any rank of the trainer's
        self.rollout_wg = self._factory({"rollout": rollout_cls}, pool="rollout_pool")["rollout"] if rollout_cls else None
        own = self._factory({judge_key: judge_cls}, pool="reward_pool") if judge_cls else {}
        groups = self._factory(classes)
        self.actor_rollout_wg = groups["actor_rollout"]
        self.critic_wg = groups.get("critic")
        self.rm_wg = groups.get("rm")
        self.judge_wg = own.get("judge") or groups.get("judge")
        self.genrm_wg = own.get("genrm") or groups.get("genrm")
        # on-policy distillation: routing key -> its teacher's group (trainer/ppo/teachers.py)
        self.teacher_wgs = {key: groups[role] for key, role in teacher_roles(self.config.distillation).items()}
        for wg in (self.rollout_wg, self.judge_wg, self.actor_rollout_wg, self.critic_wg, self.rm_wg, self.genrm_wg,
                   *self.teacher_wgs.values()):
            if wg is not None:
                wg.init_model()
        if self.judge_wg is not None:
            self.judge = _generative_reward_model(self.config, self.tokenizer, self.judge_wg)
        if self.genrm_wg is not None:
            self.reward_server = _reward_model_server(self.config, self.genrm_wg)
            for manager in {id(f): f for f in (self.reward_fn, self.val_reward_fn) if f is not None}.values():
                manager.serve_reward_model(self.reward_server)
        if self.rollout_wg is None:
            self.rollout_wg = self.actor_rollout_wg
        else:
            host, port = self.actor_rollout_wg.open_weight_bridge()
            # the rollout side first: the process back end runs the trainer's rank 0 in this thread
            joined = self.rollout_wg.connect_weight_bridge.future(host, port, self.rollout_wg.world_size)
            self.actor_rollout_wg.connect_weight_bridge(host, port, self.rollout_wg.world_size)
            joined.get()

    @property
    def disaggregated(self) -> bool:
        """Whether the rollout runs in a pool of its own (the asynchronous pipelines)."""
        return getattr(self, "rollout_wg", None) not in (None, self.actor_rollout_wg)

    def sync_weights(self, timing: dict) -> dict[str, float]:
        """The trainer's weights into the rollout pool (checkpoint engine); nothing when colocated."""
        if not self.disaggregated:
            return {}
        with marked_timer("sync_weights", timing):
            received = self.rollout_wg.receive_weights.future()
            stats = self.actor_rollout_wg.send_weights()[0]
            received.get()
        metrics = {"async/sync_megabytes": stats["bytes"] / 2**20, "async/sync_buckets": float(stats["buckets"]),
                   "async/sync_wire_megabytes": (stats["bytes"] + stats["meta_bytes"]) / 2**20}
        if self.config.actor_rollout_ref.rollout.checkpoint_engine.backend == "delta_sharded":  # verl's names
            metrics.update({"checkpoint_engine/changed_ratio": stats["changed"] / max(stats["elements"], 1),
                            "checkpoint_engine/changed_elems": float(stats["changed"]),
                            "checkpoint_engine/payload_mbytes": stats["bytes"] / 2**20})
        return metrics

    # ---- the loop ------------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train until ``total_training_steps``; validate, checkpoint and log on the way. Returns the summary."""
        start = time.time()
        try:
            return self._fit(start)
        finally:
            self.source.close()
            if self._reward_thread is not None:
                self._reward_thread.shutdown(wait=True, cancel_futures=True)
            if self.reward_server is not None:
                self.reward_server.shutdown()

    def _fit(self, start: float) -> dict[str, Any]:
        from rlfoundry.trainer.reliability import NonFiniteGuard, log_extra
        from rlfoundry.utils.profiler import StepProfiler, profile_dir

        self._load_checkpoint()
        if self.state.resumed_from or starts_from_dist_checkpoint(self.config.actor_rollout_ref.actor):
            self.sync_weights({})  # a rollout pool of its own takes the restored (or dist-checkpoint) weights
        self.tracker = self._make_tracker()
        # Not on resume: the checkpoint holds the first validation, and an extra generation pass here
        # would move the sampling RNG, so step k+1 would differ from the uninterrupted run's.
        if self.val_dataloader is not None and self.config.trainer.val_before_train and not self.state.resumed_from:
            self._log_validation()
        if self.config.trainer.val_only:
            return self._finish(start)
        profiler = StepProfiler(self.config.trainer.profile_steps, profile_dir(self.config))
        nan_guard = NonFiniteGuard(self.config.trainer.max_consecutive_nan_steps)
        try:
            while self.state.global_steps < self.total_training_steps:
                self.state.global_steps += 1
                step = self.state.global_steps
                with profiler.step(step):
                    metrics = self.train_step()
                metrics |= {"training/global_step": step, "training/epoch": (step - 1) // self.source.steps_per_epoch()}
                if step % self.config.trainer.log_freq == 0:  # verl's SPIN trainer's key; 1 by default
                    self.tracker.log(metrics, step=step)  # before the checkpoint: see trainer/reliability.py
                nan_guard.check(metrics, step)
                log_extra(self.tracker, self._maybe_validate_and_save(step), step)
        except BaseException:
            self.tracker.finish()  # a run that stops on purpose still closes its metrics file
            raise
        return self._finish(start)

    def _done(self) -> bool:
        return self.state.global_steps >= self.total_training_steps

    def _validates_or_saves(self, step: int) -> tuple[bool, bool]:
        trainer, last = self.config.trainer, step >= self.total_training_steps
        validate = self.val_dataloader is not None and trainer.test_freq > 0 and (last or step % trainer.test_freq == 0)
        return validate, trainer.save_freq > 0 and (last or step % trainer.save_freq == 0)

    def _maybe_validate_and_save(self, step: int) -> dict[str, float]:
        from rlfoundry.trainer.reliability import checkpoint_save_guard

        validate, save = self._validates_or_saves(step)
        metrics: dict[str, float] = {}
        timing: dict[str, float] = {}
        if not (validate or save):
            return metrics
        with self.source.quiet():
            if validate:
                with marked_timer("testing", timing):
                    metrics |= self._validate()
                self.state.last_val = {k: v for k, v in metrics.items() if k.startswith("val-core/")}
            if save:
                with marked_timer("save_checkpoint", timing), checkpoint_save_guard(self._ckpt_root(), step):
                    self._save_checkpoint()
        return metrics | {f"timing_s/{k}": v for k, v in timing.items()}

    # ---- one training step ---------------------------------------------------------------------

    def train_step(self) -> dict[str, float]:
        """One PPO step on the source's next batch; the step's metrics."""
        timing: dict[str, float] = {}
        with marked_timer("step", timing):
            batch, metrics = self.source.next_batch(timing)
            batch, m = self.train_on(batch, timing); metrics |= m  # noqa: E702 - one line per phase
            metrics |= self.source.after_update(timing)
        self._update_curriculum(batch)
        return metrics | self._step_metrics(batch, timing)

    def _update_curriculum(self, batch: DataProto) -> None:
        """A curriculum sampler (``data.sampler``, ``data/sampler.py``) learns from the trained batch, as in verl."""
        from rlfoundry.data.sampler import AbstractCurriculumSampler

        sampler = getattr(self.train_dataloader, "sampler", None)
        if isinstance(sampler, AbstractCurriculumSampler):
            sampler.update(batch=batch)

    def train_on(self, batch: DataProto, timing: dict) -> tuple[DataProto, dict[str, float]]:
        """Everything after the rewards: old / ref log-probs, values, advantages, the updates. A reward
        still being computed (``reward_in_background``) is collected before the advantages need it."""
        metrics: dict[str, float] = {}
        record = self._replay_recorder(batch)
        batch, m = self._old_log_prob(batch, timing); metrics |= m  # noqa: E702
        batch = self._ref_log_prob(batch, timing)
        batch = self._teacher_log_prob(batch, timing)
        batch = self._values(batch, timing)
        batch, m = self._collect_reward(batch, timing); metrics |= m  # noqa: E702
        if record is not None:
            record.scored(batch)
        if self.config.trainer.rollout_data_dir:
            scores = batch.batch["token_level_scores"].sum(-1).tolist()
            write_generations(generation_records(batch, scores, self.tokenizer, self.state.global_steps),
                              Path(self.config.trainer.rollout_data_dir), self.state.global_steps)
        batch, m = self._advantage(batch, timing); metrics |= m  # noqa: E702
        metrics |= self._update_critic(batch, timing)
        metrics |= self._update_actor(batch, timing)
        if record is not None:
            record.save(batch, OmegaConf.to_yaml(self.config))
        return batch, metrics

    def _replay_recorder(self, batch: DataProto) -> Any:
        """``trainer.replay_records``: this step's batch and phases for ``rlfoundry replay`` (ppo/replay.py)."""
        if not self.config.trainer.replay_records:
            return None
        from rlfoundry.trainer.ppo.replay import StepRecorder

        recorder = StepRecorder(Path(self.config.trainer.run_dir), self.state.global_steps)
        recorder.start(batch)
        return recorder

    def _step_metrics(self, batch: DataProto, timing: dict) -> dict[str, float]:
        workers = self.world_size + (self.rollout_wg.world_size if self.disaggregated else 0)
        return (compute_data_metrics(batch, use_critic=self.use_critic) | compute_timing_metrics(batch, timing)
                | compute_throughout_metrics(batch, timing, n_gpus=workers))

    def generate(self, batch_dict: dict, timing: dict, balance: bool = True) -> DataProto:
        """Sample n responses per prompt (interleaved rows); ReMax also scores a greedy baseline."""
        prompts = self.prompts(batch_dict)
        with marked_timer("gen", timing):
            batch = self.rollout_wg.generate_sequences(prompts)
            if self.config.algorithm.adv_estimator == "remax":
                batch.batch["reward_baselines"] = self._greedy_baseline(prompts)
        return self.generated(batch, balance)

    @staticmethod
    def prompts(batch_dict: dict) -> DataProto:
        prompts = trim_prompt_padding(DataProto.from_single_dict(batch_dict))
        # one id per prompt: its n samples share it, so group estimators (GRPO, RLOO ...) find them
        prompts.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(prompts))], dtype=object)
        return prompts

    def generated(self, batch: DataProto, balance: bool = True) -> DataProto:
        if "response_mask" not in batch.batch.keys():
            batch.batch["response_mask"] = compute_response_mask(batch)
        return self.finish_generation(batch) if balance else batch

    def concat_generations(self, parts: list[DataProto]) -> DataProto:
        return _concat_generations(parts, pad_id(self.tokenizer))

    def finish_generation(self, batch: DataProto) -> DataProto:
        batch.meta_info["global_token_num"] = batch.batch["attention_mask"].sum(-1).tolist()
        batch.meta_info["max_prompt_length"] = int(self.config.data.max_prompt_length)
        # GVPO's groups, SPIN's pairs: whole per micro-batch
        if self.config.actor_rollout_ref.actor.policy_loss.loss_mode in ("gvpo", "spin"):
            batch, _ = order_groups(batch, self.world_size, self.config.trainer.balance_batch)
        elif self.config.trainer.balance_batch:
            batch, _ = balance_batch(batch, self.world_size)
        return batch

    def _greedy_baseline(self, prompts: DataProto) -> torch.Tensor:
        """ReMax (Li et al. 2023): the reward of the greedy response, repeated for the prompt's n samples."""
        greedy_in = DataProto.from_dict(
            tensors=dict(prompts.batch.items()), non_tensors=dict(prompts.non_tensor_batch),
            meta_info={"do_sample": False, "n": 1},
        )
        greedy = self.rollout_wg.generate_sequences(greedy_in)
        if "response_mask" not in greedy.batch.keys():
            greedy.batch["response_mask"] = compute_response_mask(greedy)
        scores = self.reward_fn(self._judged(greedy), return_dict=True)["reward_tensor"].sum(-1)
        return scores.repeat_interleave(int(self.config.actor_rollout_ref.rollout.n))

    def reward(self, batch: DataProto, timing: dict, return_result: bool = False) -> tuple[DataProto, Any]:
        """``token_level_scores`` from the reward models (when enabled) and/or the reward function;
        with the step's reward metrics (or the reward manager's whole result)."""
        with marked_timer("reward", timing):
            if self.use_rm:
                batch = batch.union(self.rm_wg.compute_rm_score(batch))
            batch = self._judged(batch)
            result = self.reward_fn(batch, return_dict=True)
            self._settle_reward_server()
        batch.batch["token_level_scores"] = result["reward_tensor"]
        carry_gdpo_components(batch, result, self.config.algorithm, self._failure_score())
        return batch, (result if return_result else reward_result_metrics(result))

    def _settle_reward_server(self) -> None:
        """No generation of the served reward model outlives the reward phase (a timed-out sample's request
        would otherwise reach the workers while the trainer calls them)."""
        if self.reward_server is not None and not self.reward_server.settle(timeout_s=self.reward_server.request_timeout_s):
            raise RuntimeError(f"the reward-model server at {self.reward_server.address} was still generating "
                               f"{self.reward_server.request_timeout_s:g}s after the reward phase ended")

    def reward_in_background(self, batch: DataProto, timing: dict) -> tuple[DataProto, dict[str, float]]:
        """verl's ``reward_model.launch_reward_fn_async``: the reward function scores in a thread while the
        log-prob and value passes run; ``train_on`` collects it before the advantages. Only a reward
        that needs no worker (no reward model, no judge) can overlap them: otherwise this is ``reward``."""
        if not self.config.reward_model.launch_reward_fn_async or self.use_rm or self.judge is not None \
                or self.reward_server is not None:
            return self.reward(batch, timing)
        if self._reward_thread is None:
            from concurrent.futures import ThreadPoolExecutor

            self._reward_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlfoundry-reward")
        # its own containers of the batch's columns: the passes add theirs to the batch meanwhile
        columns = batch.select(batch_keys=list(batch.batch.keys()), non_tensor_batch_keys=list(batch.non_tensor_batch))
        self._pending_reward = (self._reward_thread.submit(self.reward_fn, columns, return_dict=True),
                                time.perf_counter())
        return batch, {}

    def _collect_reward(self, batch: DataProto, timing: dict) -> tuple[DataProto, dict[str, float]]:
        """The scores of ``reward_in_background`` (nothing to do when the batch came scored); ``timing_s/reward``
        is the time the step waited for them, ``timing_s/reward_overlapped`` how long they ran in all."""
        if self._pending_reward is None:
            return batch, {}
        future, started = self._pending_reward
        self._pending_reward = None
        with marked_timer("reward", timing):
            result = future.result()
        batch.batch["token_level_scores"] = result["reward_tensor"]
        carry_gdpo_components(batch, result, self.config.algorithm, self._failure_score())
        return batch, reward_result_metrics(result) | {"timing_s/reward_overlapped": time.perf_counter() - started}

    def _failure_score(self) -> float:
        """The reward manager's score for a failed sample (``reward_kwargs.failure_score``; 0 for a custom one)."""
        return float(getattr(getattr(self.reward_fn, "options", None), "failure_score", 0.0))

    def _judged(self, batch: DataProto) -> DataProto:
        """The batch with the generative reward model's judgements (``judge_scores`` ...), if there is one."""
        return batch if self.judge is None else batch.union(self.judge.compute_rm_score(batch))

    def _old_log_prob(self, batch: DataProto, timing: dict) -> tuple[DataProto, dict[str, float]]:
        """``old_log_probs`` under the policy that sampled; ``actor/entropy`` from the same pass."""
        correction = self.config.algorithm.rollout_correction
        reuse = bool(self.config.actor_rollout_ref.actor.use_rollout_log_probs)
        prox = reuse and bool(self.config.async_training.compute_prox_log_prob)  # verl ignores it otherwise
        if (reuse and not prox) or correction.bypass_mode:
            return self._reuse_rollout_log_probs(batch), {}
        with marked_timer("old_log_prob", timing):
            out = self._prox_log_prob(batch) if prox else self.actor_rollout_wg.compute_log_prob(batch)
        mask = batch.batch["response_mask"]
        entropy = core_algos.agg_loss(out.batch["entropys"], mask, self.config.actor_rollout_ref.actor.loss_agg_mode)
        out.pop(batch_keys=["entropys"])
        metrics = {"actor/entropy": float(entropy.item())} | self._routing_replay(batch, out)
        if "rollout_log_probs" in batch.batch.keys():
            metrics |= rollout_probs_diff_metrics(batch.batch["rollout_log_probs"], out.batch["old_log_probs"], mask)
            if self.config.trainer.mismatch_audit:
                metrics |= self._audit_mismatch(batch, out, timing)
        batch = batch.union(out)
        if any(correction[k] is not None for k in ("rollout_is", "rollout_rs", "rollout_token_veto_threshold")):
            batch, m = self._correct_rollout(batch, correction); metrics |= m  # noqa: E702
        return batch, metrics

    def _prox_log_prob(self, batch: DataProto) -> DataProto:
        """verl's fully-async ``compute_prox_log_prob``: old log-probs under the weights this sync period
        started with (the version the rollout pool was synced to), in the trainer's own kernels; the
        rollout's log-probs stay the behaviour policy's for ``rollout_correction``. Periods start at
        update counts that are multiples of ``trigger_parameter_sync_step``; at a period's first step
        those weights are the current ones."""
        period, done = int(self.config.async_training.trigger_parameter_sync_step), self.state.global_steps - 1
        if period == 1:  # every step starts a period: no copy to keep
            return self.actor_rollout_wg.compute_log_prob(batch)
        asked = DataProto(batch=batch.batch, non_tensor_batch=batch.non_tensor_batch,
                          meta_info={**batch.meta_info, "prox_version": done - done % period})
        return self.actor_rollout_wg.compute_prox_log_prob(asked)

    def _routing_replay(self, batch: DataProto, out: DataProto) -> dict[str, float]:
        """MoE routing replay (docs/moe.md). R2: the old-log-prob pass's recorded experts replace any the rollout
        recorded (verl's choice). R3: the share of response tokens the trainer's router would have routed
        elsewhere, and with the mismatch audit on, the rollout-vs-trainer |Δ log p| without the replay (one
        more forward) beside the replayed one."""
        if "routed_experts" in out.batch.keys() and "routed_experts" in batch.batch.keys():
            batch.pop(batch_keys=["routed_experts"])
        if "routing_counted_tokens" not in out.batch.keys():
            return {}
        counts = out.pop(batch_keys=["routing_changed_tokens", "routing_counted_tokens"]).batch
        metrics = {"actor/router_replay/changed_token_frac": mismatch.routing_changed_frac(
            counts["routing_changed_tokens"], counts["routing_counted_tokens"])}
        out.meta_info["routing_changed_frac"] = metrics["actor/router_replay/changed_token_frac"]
        if self.config.trainer.mismatch_audit and "rollout_log_probs" in batch.batch.keys():
            plain = DataProto(batch=batch.batch, non_tensor_batch=batch.non_tensor_batch,
                              meta_info={**batch.meta_info, "routing_replay": False})
            own = self.actor_rollout_wg.compute_log_prob(plain).batch["old_log_probs"]
            metrics |= mismatch.replay_gap_metrics(batch.batch["rollout_log_probs"], out.batch["old_log_probs"], own,
                                                   batch.batch["response_mask"])
        return metrics

    def _audit_mismatch(self, batch: DataProto, scored: DataProto, timing: dict) -> dict[str, float]:
        """The mismatch audit (``trainer.mismatch_audit``; trainer/ppo/mismatch.py): |Δ log p| by position,
        turn and data source; past ``trainer.mismatch_audit_threshold``, a diagnosis in the log, once a step
        and, while the named cause stays the same, every ``MISMATCH_LOG_EVERY`` steps."""
        with marked_timer("mismatch_audit", timing):
            threshold, facts = float(self.config.trainer.mismatch_audit_threshold), self._step_facts(batch, scored)
            metrics, mean_gap, findings = mismatch.audit(batch, scored.batch["old_log_probs"], facts, threshold)
            if findings is not None:
                findings = self._check_precision(batch, scored.batch["old_log_probs"], facts, findings)
                self._log_diagnosis(mismatch.diagnosis_message(self.state.global_steps, mean_gap, threshold, findings),
                                    findings[0].cause if findings else "none")
        return metrics

    def _check_precision(self, batch: DataProto, old_log_probs: torch.Tensor, facts: mismatch.StepFacts,
                         findings: list[mismatch.Finding]) -> list[mismatch.Finding]:
        """A precision candidate decided by the actor's fp32 recompute of the step's worst rows
        (``mismatch.PRECISION_ROWS``), on a diagnosed step, every ``MISMATCH_LOG_EVERY`` steps at most."""
        step = self.state.global_steps
        if not mismatch.wants_fp32_recompute(findings, facts) or step - self._last_fp32_check < MISMATCH_LOG_EVERY:
            return findings
        self._last_fp32_check = step
        rollout, mask = batch.batch["rollout_log_probs"], batch.batch["response_mask"]
        rows = mismatch.worst_rows(rollout, old_log_probs, mask)
        fp32 = self.actor_rollout_wg.compute_log_prob_fp32(batch.select_idxs(rows)).batch["fp32_log_probs"]
        return mismatch.settle_precision(findings, mismatch.precision_finding(
            rollout[rows], old_log_probs[rows], fp32, mask[rows], facts.dtypes))

    def _step_facts(self, batch: DataProto, scored: DataProto) -> mismatch.StepFacts:
        """What the driver knows of how the rows were sampled and scored (the diagnosis's evidence)."""
        rollout, meta = self.config.actor_rollout_ref.rollout, scored.meta_info
        actor_dtype = meta.get("compute_dtype")
        dtypes = {"actor": actor_dtype, "rollout": actor_dtype if rollout.name == "hf" else rollout.dtype}
        return mismatch.StepFacts(
            trainer_version=meta.get("param_version"), asynchronous=self.disaggregated,
            rollout_temperature=float(batch.meta_info.get("temperature", rollout.temperature)),
            trainer_temperature=float(meta.get("temperature", rollout.temperature)),
            top_p=float(batch.meta_info.get("top_p", rollout.top_p)), top_k=int(batch.meta_info.get("top_k", rollout.top_k)),
            engine=rollout.name, fire=bool(rollout.use_fire_sampling), digests_verified=bool(rollout.checkpoint_engine.verify),
            dtypes={k: v for k, v in dtypes.items() if v is not None}, moe_layers=int(meta.get("moe_layers", 0)),
            router_replay=self.config.actor_rollout_ref.actor.router_replay.mode,
            routing_changed_frac=meta.get("routing_changed_frac"), fp32_recompute=bool(meta.get("fp32_recompute")))

    def _log_diagnosis(self, message: str, cause: str) -> None:
        """Log once a step at most; the same cause again only every ``MISMATCH_LOG_EVERY`` steps."""
        if mismatch.should_log(self.state.global_steps, cause, self._last_diagnosis, MISMATCH_LOG_EVERY):
            self._last_diagnosis = (self.state.global_steps, cause)
            logger.warning("mismatch audit: %s", message)

    def _correct_rollout(self, batch: DataProto, correction: Any) -> tuple[DataProto, dict[str, float]]:
        """``algorithm.rollout_correction``: IS weights into the batch (the actor's loss multiplies by
        them), rejected tokens out of ``response_mask`` (so out of advantages and losses too)."""
        if "rollout_log_probs" not in batch.batch.keys():
            raise RuntimeError("algorithm.rollout_correction needs the rollout's log-probs, but the rollout "
                               "returned no rollout_log_probs")
        weights, mask, metrics = rollout_corr.rollout_correction(
            batch.batch["old_log_probs"], batch.batch["rollout_log_probs"], batch.batch["response_mask"],
            **{k: correction[k] for k in ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold",
                                          "rollout_rs_threshold_lower", "rollout_token_veto_threshold",
                                          "rollout_is_batch_normalize")})
        batch.batch["response_mask"] = mask
        if weights is not None:
            batch.batch["rollout_is_weights"] = weights
        return batch, metrics

    def _reuse_rollout_log_probs(self, batch: DataProto) -> DataProto:
        """The HF engine's sampling log-probs as ``old_log_probs``: no extra forward pass.

        They come from the same module at the same temperature (config validation allows this only
        then), so they equal ``compute_log_prob`` to float rounding. ``actor/entropy`` then comes
        from the update, which asks for it with ``meta_info["calculate_entropy"]``.
        """
        if "rollout_log_probs" not in batch.batch.keys():
            raise RuntimeError("actor.use_rollout_log_probs=true, but the rollout returned no rollout_log_probs; "
                               "set actor_rollout_ref.actor.use_rollout_log_probs=false.")
        # a copy: rollout_log_probs stays the engine's record, whatever later phases do to old_log_probs
        batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"].clone()
        batch.meta_info["calculate_entropy"] = True
        return batch

    def _ref_log_prob(self, batch: DataProto, timing: dict) -> DataProto:
        """``ref_log_prob`` under the reference, only when a KL term or SPIN's loss needs it. SPIN (verl's
        recipe) first copies the actor into the reference every ``trainer.ref_update_freq`` steps, so its
        DPO step is measured against the policy of that step's start."""
        if not self.use_reference_policy:
            return batch
        with marked_timer("ref", timing):
            if self._spin and refreshes_reference(self.state.global_steps, self.config.trainer.ref_update_freq):
                self.actor_rollout_wg.refresh_ref_from_actor()
            return batch.union(self.actor_rollout_wg.compute_ref_log_prob(batch))

    @property
    def _spin(self) -> bool:
        return self.config.actor_rollout_ref.actor.policy_loss.loss_mode == "spin"

    def _teacher_log_prob(self, batch: DataProto, timing: dict) -> DataProto:
        """``teacher_logprobs`` (B, Tr), or (B, Tr, k) with ``teacher_ids`` for a top-k loss: each row scored
        by its teacher, with on-policy distillation."""
        if not self.teacher_wgs:
            return batch
        with marked_timer("teacher", timing):
            distillation = self.config.distillation
            scored = teacher_log_probs(batch, self.teacher_wgs, distillation.teacher_key, teacher_topk(distillation))
        return batch.union(DataProto.from_dict(tensors=scored))

    def _values(self, batch: DataProto, timing: dict) -> DataProto:
        if not self.use_critic:
            return batch
        with marked_timer("values", timing):
            return batch.union(self.critic_wg.compute_values(batch))

    def _advantage(self, batch: DataProto, timing: dict) -> tuple[DataProto, dict[str, float]]:
        """Rewards (scores, minus β·KL when the KL is in the reward), then the estimator's advantages."""
        alg, metrics = self.config.algorithm, {}
        with marked_timer("adv", timing):
            if alg.use_kl_in_reward:
                batch, metrics = apply_kl_penalty(batch, self.kl_ctrl, kl_penalty=alg.kl_penalty)
            else:
                batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
            # SPO's tracker baselines (trainer/ppo/spo.py) replace the estimator, as in verl's recipe
            estimator = "spo" if self.config.trainer.spo.enable else alg.adv_estimator
            batch = compute_advantage(
                batch, estimator, gamma=alg.gamma, lam=alg.lam,
                num_repeat=int(self.config.actor_rollout_ref.rollout.n),
                norm_adv_by_std_in_grpo=alg.norm_adv_by_std_in_grpo, config=alg, generator=self._step_generator(),
            )
        return batch, metrics

    def _step_generator(self) -> torch.Generator:
        """A generator seeded by (trainer.seed, step): a draw in the driver (PF-PPO's resampling) is
        the same in a resumed run as in the uninterrupted one, and independent of earlier draws."""
        return torch.Generator().manual_seed(int(self.config.trainer.seed) * 1_000_003 + self.state.global_steps)

    def _update_critic(self, batch: DataProto, timing: dict) -> dict[str, float]:
        if not self.use_critic:
            return {}
        with marked_timer("update_critic", timing):
            out = self.critic_wg.update_critic(batch)
        return reduce_metrics(out.meta_info["metrics"])

    def _update_actor(self, batch: DataProto, timing: dict) -> dict[str, float]:
        """The PPO update; skipped during the critic warm-up (the critic learns values first)."""
        if self.state.global_steps <= self.config.trainer.critic_warmup:
            return {}
        if self._spin:  # verl's SPIN trainer hands its algorithm keys to the actor in meta_info
            alg = self.config.algorithm
            batch.meta_info |= {"dpo_loss_type": alg.dpo_loss_type, "dpo_label_smoothing": alg.dpo_label_smoothing}
        with marked_timer("update_actor", timing):
            out = self.actor_rollout_wg.update_actor(batch)
        return reduce_metrics(out.meta_info["metrics"])

    # ---- validation ----------------------------------------------------------------------------

    def _validate(self) -> dict[str, float]:
        """Generate with ``rollout.val_kwargs`` over the validation set; ``val-core/<source>/reward/mean@N``."""
        self.source.before_validation()
        sources, prompts, infos = [], [], {"reward": []}
        errors: dict[str, float] = {}
        records: list[dict[str, Any]] = []
        for batch_dict in self.val_dataloader:
            batch = self._judged(self._val_generate(trim_prompt_padding(DataProto.from_single_dict(batch_dict))))
            result = self.val_reward_fn(batch, return_dict=True)
            self._settle_reward_server()
            scores = result["reward_tensor"].sum(-1).tolist()
            infos["reward"] += scores
            records += generation_records(batch, scores, self.tokenizer, self.state.global_steps,
                                          token_scores=result["reward_tensor"])
            for key, values in result.get("reward_extra_info", {}).items():
                infos.setdefault(key, []).extend(list(values))
            for key, count in result.get("reward_metrics", {}).items():  # failed-sample counts: summed
                errors[f"val-aux/{key}"] = errors.get(f"val-aux/{key}", 0.0) + float(count)
            sources += list(batch.non_tensor_batch.get("data_source", ["unknown"] * len(batch)))
            prompts += self.tokenizer.batch_decode(batch.batch["prompts"], skip_special_tokens=True)
        infos = {k: v for k, v in infos.items() if len(v) == len(sources)}
        self._report_val_generations(records, infos)
        return process_validation_metrics(sources, prompts, infos, seed=int(self.config.trainer.seed)) | errors

    def _report_val_generations(self, records: list[dict[str, Any]], infos: dict[str, list]) -> None:
        """``trainer.log_val_generations`` samples to the loggers; ``trainer.validation_data_dir``:
        every sample as JSON lines with the reward function's extra info (verl's dump)."""
        trainer, step = self.config.trainer, self.state.global_steps
        if trainer.log_val_generations > 0:
            self.tracker.log_generations(val_generation_samples(records, int(trainer.log_val_generations)), step)
        if trainer.validation_data_dir:
            rows = [record | {k: v[i] for k, v in infos.items()} for i, record in enumerate(records)]
            write_generations(rows, Path(trainer.validation_data_dir), step)

    def _val_generate(self, prompts: DataProto) -> DataProto:
        """Pad to a multiple of the rank count (validation sets need not divide), generate, unpad."""
        val_n = int(self.config.actor_rollout_ref.rollout.val_kwargs.n)
        prompts.meta_info.update({"validate": True, "n": val_n})
        prompts.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(len(prompts))], dtype=object)
        padded, pad = pad_dataproto_to_divisor(prompts, self.rollout_wg.world_size)
        out = self.rollout_wg.generate_sequences(padded)
        out = unpad_dataproto(out, pad * val_n)
        if "response_mask" not in out.batch.keys():
            out.batch["response_mask"] = compute_response_mask(out)
        return out

    def _log_validation(self) -> None:
        metrics = self._validate()
        core = {k: v for k, v in metrics.items() if k.startswith("val-core/")}
        self.state.last_val = core
        if not self.state.first_val:
            self.state.first_val = core
        self.tracker.log(metrics, step=self.state.global_steps)

    # ---- checkpoints ---------------------------------------------------------------------------

    def _ckpt_root(self) -> Path:
        return Path(self.config.trainer.default_local_dir)

    def _save_checkpoint(self) -> None:
        """Workers' shards, then the trainer state, then — last, atomically — the ``latest`` pointer.

        Old checkpoints beyond ``max_*_ckpt_to_keep`` are removed only after the new one is complete.
        """
        from rlfoundry import checkpoint as ckpt

        step, trainer = self.state.global_steps, self.config.trainer
        step_dir = self._ckpt_root() / f"global_step_{step}"
        self.actor_rollout_wg.save_checkpoint(str(step_dir / "actor"), global_step=step)
        if self._spin and reference_to_checkpoint(step, trainer.ref_update_freq):
            self.actor_rollout_wg.save_ref_checkpoint(str(step_dir / REF_DIR))  # refreshed: not the model path's
        if self.use_critic:
            self.critic_wg.save_checkpoint(str(step_dir / "critic"), global_step=step)
        ckpt.save_trainer_state(step_dir / TRAINER_STATE_FILE, self._trainer_state())
        ckpt.write_latest_checkpointed_iteration(self._ckpt_root(), step)
        self.state.last_ckpt = str(step_dir)
        for actor_dir in ckpt.remove_old_checkpoints(self._ckpt_root(), trainer.max_actor_ckpt_to_keep,
                                                     component="actor"):
            ref_dir = Path(actor_dir).parent / REF_DIR  # SPIN's reference is of no use without its actor
            if ref_dir.is_dir():
                rename_then_delete(ref_dir, fault_point="save.pruning")
        if self.use_critic:
            ckpt.remove_old_checkpoints(self._ckpt_root(), trainer.max_critic_ckpt_to_keep, component="critic")

    def _trainer_state(self) -> dict[str, Any]:
        return {
            "global_step": self.state.global_steps,
            "dataloader": self.train_dataloader.state_dict(),
            "kl_coef": float(self.kl_ctrl.value),
            "first_val": dict(self.state.first_val),
            "config": OmegaConf.to_yaml(self.config),  # lets `rlfoundry export` rebuild the model
        } | self.source.checkpoint_state()  # e.g. the loader before the batches still in flight

    def _resume_path(self) -> str | None:
        """The step to resume from. Its files are checked against the sizes and checksums recorded
        at save time first: ``auto`` skips a damaged step (warning naming the file) for the newest
        intact one, and stops (CheckpointCorruptError) if every step is damaged rather than train
        from scratch over them; an explicit ``resume_from_path`` that is damaged stops the run with
        the file named."""
        from rlfoundry import checkpoint as ckpt

        trainer = self.config.trainer
        if trainer.resume_mode == "disable":
            return None
        ckpt.cleanup_partial_checkpoints(self._ckpt_root())  # debris of a save killed half-way
        if trainer.resume_mode == "auto":
            return ckpt.find_latest_ckpt_path(self._ckpt_root(), verify=True)
        path = Path(trainer.resume_from_path).expanduser()
        if not ckpt.is_complete_step_dir(path):
            raise ConfigError(f"trainer.resume_from_path={path} is not a complete checkpoint (no readable step "
                              "marker, or a role directory is unfinished or was pruned by max_*_ckpt_to_keep); "
                              "pick another global_step_N, or set trainer.resume_mode=auto.")
        ckpt.verify_step_dir(path)
        return str(path)

    def _load_checkpoint(self) -> None:
        """Restore workers, loader position, KL coefficient and step from the chosen checkpoint (if any)."""
        from rlfoundry import checkpoint as ckpt

        path = self._resume_path()
        if path is None:
            return
        # verify=False: _resume_path checked every file of the step already (sizes and checksums)
        self.actor_rollout_wg.load_checkpoint(str(Path(path) / "actor"), verify=False)
        if self.use_critic:
            self.critic_wg.load_checkpoint(str(Path(path) / "critic"), verify=False)
        state = ckpt.load_trainer_state(Path(path) / TRAINER_STATE_FILE)
        self.state.global_steps = int(state["global_step"])
        self._load_reference(Path(path))
        self.train_dataloader.load_state_dict(state["dataloader"])
        self.kl_ctrl.value = float(state["kl_coef"])
        self.state.first_val = dict(state.get("first_val", {}))
        self.state.resumed_from = path
        print(f"[rlfoundry] resumed from {path} (global step {self.state.global_steps})", flush=True)
        self.source.on_resume(state)

    def _load_reference(self, step_dir: Path) -> None:
        """SPIN's refreshed reference, where the checkpoint holds it (``algos/spin.reference_to_checkpoint``);
        otherwise the reference stays the one built from the model path, which is then the right one."""
        if self._spin and (step_dir / REF_DIR).is_dir():
            self.actor_rollout_wg.load_ref_checkpoint(str(step_dir / REF_DIR), verify=False)
        elif self._spin and reference_to_checkpoint(self.state.global_steps, self.config.trainer.ref_update_freq):
            logger.warning("%s has no %s/ (saved before SPIN checkpointed its reference, or with another "
                           "trainer.ref_update_freq): the reference restarts from the model until its next refresh, "
                           "so the next steps' DPO losses differ from an uninterrupted run's", step_dir, REF_DIR)

    # ---- tracking and summary ------------------------------------------------------------------

    def _make_tracker(self) -> Any:
        from rlfoundry.utils.tracking import Tracking

        trainer = self.config.trainer
        return Tracking(
            project_name=trainer.project_name, experiment_name=trainer.experiment_name,
            default_backend=list(trainer.logger), config=self.config,
            run_dir=trainer.run_dir, total_training_steps=self.total_training_steps,
            resume_step=self.state.global_steps if self.state.resumed_from else None,
        )

    def _finish(self, start: float) -> dict[str, Any]:
        """Close the trackers, draw the report and print where everything is."""
        self.tracker.finish()
        summary = {
            "global_step": self.state.global_steps,
            "wall_time_s": time.time() - start,
            "val_start": self.state.first_val,
            "val_end": self.state.last_val,
            "checkpoint": self.state.last_ckpt or self.state.resumed_from,
            "metrics": str(self.tracker.metrics_path) if self.tracker.metrics_path else None,
            "plot": self._write_plot(),
        }
        print(format_summary(summary), flush=True)
        return summary

    def _write_plot(self) -> str | None:
        try:
            from rlfoundry.trainer.report import write_report

            return str(write_report(self.config.trainer.run_dir)["png"])
        except Exception as e:  # noqa: BLE001 - a missing plot must not fail a finished run
            print(f"[rlfoundry] no plot: {e}", flush=True)
            return None


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run box: validation start → end per headline metric, time, and where files went."""
    lines = ["", "=" * 72, f"rlfoundry: finished at step {summary['global_step']} in {summary['wall_time_s']:.0f} s"]
    start, end = summary["val_start"], summary["val_end"]
    for key in sorted(set(start) | set(end)):
        a, b = start.get(key), end.get(key)
        fa = f"{a:.3f}" if a is not None else "  -  "
        fb = f"{b:.3f}" if b is not None else "  -  "
        lines.append(f"  {key}: {fa} -> {fb}")
    for what in ("checkpoint", "metrics", "plot"):
        lines.append(f"  {what:<10} {summary[what] or '(none)'}")
    lines.append("=" * 72)
    return "\n".join(lines)


RayPPOTrainer = PPOTrainer  # verl's name (verl.trainer.ppo.ray_trainer.RayPPOTrainer)
