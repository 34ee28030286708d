"""Seconds per training step, phase by phase, from bandwidths and FLOP/s (lower bounds at a stated
efficiency, not measurements).

  generate: decode is bound by reading the active weights and the KV cache once per token step
            (batch-aware: a MoE layer with b tokens in flight touches more experts than top-k), or by
            2·N_active FLOPs per token when the batch is large; prefill by 2·N_active·prompt FLOPs.
  log-prob / values: 2·N_active FLOPs per token (forward only).
  update: 6·N_active per token (forward 2 + backward 4; + 2 for the recomputed forward under
          gradient checkpointing; LoRA skips the frozen weights' gradients: 4), per PPO epoch.
  weight sync: the policy's bf16 weights once over the link (NVLink within a node, the network across
          nodes or to a separate rollout pool).
Attention's own FLOPs (∝ context²) are left out: under ~10 % while the context is below ~6·hidden.
"""

from __future__ import annotations

from typing import Any

from rlfoundry.plan.hardware import Hardware
from rlfoundry.plan.model import ModelShape, expert_params, kv_bytes_per_token, mlp_params, param_counts

MFU = 0.40  # fraction of peak FLOP/s a training/prefill matmul reaches (flag: --mfu)
HBM_EFFICIENCY = 0.70  # fraction of datasheet bandwidth a decode step's weight reads reach


def experts_touched(experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts a layer reads for ``tokens`` tokens routed uniformly to top-k of E:
    E·(1 − (1 − k/E)^tokens). One token: k; many: all E."""
    if experts == 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def decode_step_bytes(m: ModelShape, batch: int, context: float, weight_bytes: int, tp: int) -> float:
    """Bytes one decode step reads on one tp rank: the non-expert weights, the experts the batch
    touches, and the batch's KV cache at the current context length."""
    total, _ = param_counts(m)
    experts = expert_params(m)
    per_expert = mlp_params(m.moe_intermediate, m.hidden) * m.moe_layers
    touched = experts_touched(m.experts, m.experts_per_token, batch) * per_expert
    weights = (total - experts + touched) * weight_bytes / tp
    kv = kv_bytes_per_token(m, weight_bytes) * context * batch / (1 if m.kv_lora_rank else min(tp, m.kv_heads))
    return weights + kv


def generation_seconds(m: ModelShape, hw: Hardware, batch: int, prompt: int, response: int, weight_bytes: int,
                       tp: int, mfu: float) -> float:
    """One replica generating ``batch`` sequences: prefill + ``response`` decode steps, each the slower of
    its memory reads (at HBM_EFFICIENCY) and its FLOPs (at ``mfu``); the average context is
    prompt + response/2."""
    _, active = param_counts(m)
    flops_rate = hw.tflops * 1e12 * mfu * tp
    read = decode_step_bytes(m, batch, prompt + response / 2, weight_bytes, tp) / (hw.hbm_gbps * 1e9 * HBM_EFFICIENCY)
    step = max(read, 2 * active * batch / flops_rate)
    prefill = 2 * active * batch * prompt / flops_rate
    return prefill + response * step


def kv_waves(m: ModelShape, r: Any, hw: Hardware) -> int:
    """How many rounds a vLLM/SGLang replica needs when its KV cache cannot hold every sequence at full
    length at once (it then runs what fits and queues the rest); 1 for the HF engine."""
    from rlfoundry.plan.memory import kv_cache_needed, rollout_phase

    if r.name == "hf":
        return 1
    available = rollout_phase(m, r, hw.memory_bytes).device["kv cache"]
    if available < kv_cache_needed(m, r) / r.sequences_per_replica:
        return 1  # not one sequence fits: the engine does not start (the plan's problems say so)
    return max(1, -(-int(kv_cache_needed(m, r)) // available))


def flops_seconds(flops: float, ranks: int, hw: Hardware, mfu: float) -> float:
    return flops / (ranks * hw.tflops * 1e12 * mfu)


def _update_factor(spec: Any) -> int:
    factor = 4 if spec.lora_rank else 6
    return factor + (2 if spec.checkpointing else 0)


def sync_seconds(m: ModelShape, hw: Hardware, nnodes: int, separate: bool) -> float:
    """The policy's weights in bf16 across the slowest link they cross."""
    link = hw.network_gbps if (nnodes > 1 or separate) else hw.nvlink_gbps
    return param_counts(m)[0] * 2 / (link * 1e9)


def phase_times(cfg: Any, m: ModelShape, roles: Any, hw: Hardware, mfu: float = MFU) -> dict[str, float]:
    """Seconds per step for each phase (``timing_s/*`` names where the trainer has one)."""
    data, ro = cfg.data, cfg.actor_rollout_ref.rollout
    prompt, response = int(data.max_prompt_length), int(data.max_response_length)
    sequences = int(data.gen_batch_size or data.train_batch_size) * int(ro.n)
    tokens = sequences * (prompt + response)
    ranks = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    _, active = param_counts(m)
    r = roles.rollout
    waves = kv_waves(m, r, hw)
    per_wave = -(-r.sequences_per_replica // waves)
    out = {"gen": waves * generation_seconds(m, hw, per_wave, prompt, response, r.weight_bytes, r.tp, mfu)}
    if roles.actor_forward:
        out["old_log_prob"] = flops_seconds(2 * active * tokens, ranks, hw, mfu)
    if roles.ref:
        out["ref"] = flops_seconds(2 * active * tokens, ranks, hw, mfu)
    if roles.critic:
        c_active = param_counts(roles.critic_model)[1]
        out["values"] = flops_seconds(2 * c_active * tokens, ranks, hw, mfu)
        out["update_critic"] = flops_seconds(_update_factor(roles.critic) * c_active * tokens
                                             * int(cfg.critic.ppo_epochs), ranks, hw, mfu)
    epochs = int(cfg.actor_rollout_ref.actor.ppo_epochs)
    out["update_actor"] = flops_seconds(_update_factor(roles.actor) * active * tokens * epochs, ranks, hw, mfu)
    out["sync_weights"] = sync_seconds(m, hw, int(cfg.trainer.nnodes), bool(int(cfg.rollout.n_gpus_per_node)))
    out["step"] = sum(out.values())
    return out
