"""The run's typed config → the planner's role layouts, pools and phases → a ``Plan``.

This is the one module that reads config keys; ``memory.py`` and ``timing.py`` are arithmetic on
what it extracts. Phases of a pool run one after another (verl's hybrid engine): a rank's peak is the
largest phase, where the active role's working set sits beside what the idle roles keep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlfoundry.config.roles import need_reference_policy, use_critic
from rlfoundry.plan import memory as mem
from rlfoundry.plan.hardware import GIB, Hardware
from rlfoundry.plan.model import ModelShape, load_shape, param_counts

# per-rank memory no formula above counts: on CUDA the context, NCCL's buffers and the caching
# allocator's fragmentation; on the CPU the process itself (Python, torch, transformers)
RUNTIME_BYTES = {"cuda": 2 * GIB, "cpu": GIB // 2}


@dataclass
class Phase:
    name: str
    device: dict[str, int]  # "<role> <item>" -> bytes on one rank
    host: dict[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.device.values())


@dataclass
class Pool:
    name: str
    ranks: int
    ranks_per_node: int
    rank_label: str  # which rank the figures are for (the worst one)
    phases: list[Phase]

    @property
    def peak(self) -> Phase:
        return max(self.phases, key=lambda p: p.total)


@dataclass
class Plan:
    model: ModelShape
    hardware: Hardware
    pools: list[Pool]
    capacity_bytes: int  # per rank (cpu: the host's share per rank)
    times: dict[str, float]  # phase -> seconds per step
    assumptions: list[str]
    layout: dict[str, Any]
    problems: list[str] = field(default_factory=list)  # what fails however much memory is left

    @property
    def worst(self) -> tuple[Pool, Phase]:
        pool = max(self.pools, key=lambda p: p.peak.total)
        return pool, pool.peak

    @property
    def fits(self) -> bool:
        return self.headroom_bytes >= 0 and not self.problems

    @property
    def headroom_bytes(self) -> int:
        return self.capacity_bytes - self.worst[1].total


# ───────────────────────────────────── config → layouts ─────────────────────────────────────


def _parallel(policy: Any, ranks: int, model: ModelShape, fsdp: Any = None) -> mem.Parallel:
    """The role's layout over its pool's ranks, as its engine builds it (``fsdp``: its FSDP config, for the
    FSDP engine's expert parallelism)."""
    if policy.strategy == "megatron":
        meg = policy.megatron
        tp, pp, cp = int(meg.tensor_model_parallel_size), int(meg.pipeline_model_parallel_size), int(meg.context_parallel_size)
        ep = int(meg.expert_model_parallel_size) if model.is_moe else 1
        etp = int(meg.expert_tensor_parallel_size or tp) if model.is_moe else 1
        return mem.Parallel(dp=max(1, ranks // (tp * pp * cp)), tp=tp, pp=pp, cp=cp, ep=ep, etp=etp,
                            vpp=int(meg.virtual_pipeline_model_parallel_size or 1))
    sp = int(policy.ulysses_sequence_parallel_size or 1)
    ep = int(getattr(fsdp, "expert_parallel_size", 1) or 1) if model.is_moe else 1
    return mem.Parallel(dp=max(1, ranks // sp), sp=sp, ep=ep)


def _dtypes(policy: Any, fsdp: Any, device: str) -> tuple[int, int]:
    """(storage, compute) bytes: FSDP's model_dtype and mixed_precision.param_dtype (bf16 on CUDA,
    fp32 on the CPU by default); Megatron's megatron.dtype on CUDA, fp32 on the CPU."""
    if policy.strategy == "megatron":
        b = mem.dtype_bytes(policy.megatron.dtype, 2) if device == "cuda" else 4
        return b, b
    compute = mem.dtype_bytes((fsdp.mixed_precision or {}).get("param_dtype"), 2 if device == "cuda" else 4)
    return mem.dtype_bytes(fsdp.model_dtype, 4), compute


def _tokens(dynamic: bool, budget: int, micro: int | None, seq_len: int, sp: int) -> int:
    """Tokens of one micro-batch: a token budget per rank (verl multiplies it by the Ulysses size and
    splits the sequence back over those ranks), or micro-batch sequences × (prompt + response)."""
    return int(budget) * sp if dynamic else int(micro or 1) * seq_len


def _role(name: str, policy: Any, fsdp: Any, model_cfg: Any, model: ModelShape, ranks: int, device: str,
          trainable: bool, tokens: int, value_head: bool = False) -> mem.RoleSpec:
    par = _parallel(policy, ranks, model, fsdp)
    storage, compute = _dtypes(policy, fsdp, device)
    offload = policy.megatron if policy.strategy == "megatron" else fsdp
    lone = par.dp * par.sp == 1 and fsdp.single_rank == "auto" and not (fsdp.param_offload and device == "cuda")
    return mem.RoleSpec(
        name=name, strategy=policy.strategy, trainable=trainable, par=par, storage_bytes=storage,
        compute_bytes=compute, tokens_per_micro=tokens,
        checkpointing=bool(model_cfg.enable_gradient_checkpointing) and trainable,
        fused_head=bool(getattr(model_cfg, "use_fused_kernels", False)),
        lora_rank=int(model_cfg.lora_rank or 0) if trainable else 0, value_head=value_head,
        param_offload=bool(offload.param_offload), optimizer_offload=bool(offload.optimizer_offload),
        grad_offload=bool(getattr(offload, "grad_offload", False)) and policy.strategy == "megatron",
        wrapped=not lone,
        distributed_optimizer=policy.strategy != "megatron" or bool(policy.megatron.use_distributed_optimizer),
        cpu_optimizer_fraction=_cpu_optimizer_fraction(policy) if trainable else 0.0)


def _cpu_optimizer_fraction(policy: Any) -> float:
    """The share of a Megatron role's optimizer state megatron-core's CPU optimizer keeps on the host
    (its ``optimizer_offload_fraction``, default 0, under ``optimizer_cpu_offload``)."""
    overrides = dict(getattr(getattr(policy, "optim", None), "override_optimizer_config", None) or {})
    if policy.strategy != "megatron" or not overrides.get("optimizer_cpu_offload"):
        return 0.0
    return min(1.0, max(0.0, float(overrides.get("optimizer_offload_fraction") or 0.0)))


@dataclass(frozen=True)
class Roles:
    actor: mem.RoleSpec
    actor_forward: mem.RoleSpec | None  # the old-log-prob pass (None: the rollout's log-probs are reused)
    ref: mem.RoleSpec | None
    critic: mem.RoleSpec | None
    critic_forward: mem.RoleSpec | None
    critic_model: ModelShape | None
    rollout: mem.RolloutSpec


def roles_of(cfg: Any, model: ModelShape, hw: Hardware) -> Roles:
    """Every role's layout from the resolved config."""
    arr, data, device = cfg.actor_rollout_ref, cfg.data, hw.device
    seq = int(data.max_prompt_length) + int(data.max_response_length)
    trainer_ranks = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    actor, model_cfg, ro = arr.actor, arr.model, arr.rollout
    sp = int(actor.ulysses_sequence_parallel_size or 1)
    train_tokens = _tokens(actor.use_dynamic_bsz, actor.ppo_max_token_len_per_gpu, actor.ppo_micro_batch_size_per_gpu, seq, sp)
    fwd_tokens = _tokens(ro.log_prob_use_dynamic_bsz, ro.log_prob_max_token_len_per_gpu, ro.log_prob_micro_batch_size_per_gpu, seq, sp)
    a = _role("actor", actor, actor.fsdp_config, model_cfg, model, trainer_ranks, device, True, train_tokens)
    reuse = actor.use_rollout_log_probs and not cfg.async_training.compute_prox_log_prob  # else an actor pass runs
    a_fwd = None if reuse else _role("actor", actor, actor.fsdp_config, model_cfg, model,
                                     trainer_ranks, device, True, fwd_tokens)
    ref = None
    if need_reference_policy(cfg) and not int(model_cfg.lora_rank or 0):  # LoRA: the actor with its adapter off
        rtok = _tokens(arr.ref.log_prob_use_dynamic_bsz, arr.ref.log_prob_max_token_len_per_gpu,
                       arr.ref.log_prob_micro_batch_size_per_gpu, seq, int(arr.ref.ulysses_sequence_parallel_size or 1))
        ref = _role("ref", arr.ref, arr.ref.fsdp_config, model_cfg, model, trainer_ranks, device, False, rtok)
    critic = critic_fwd = critic_model = None
    if use_critic(cfg):
        c = cfg.critic
        critic_model = load_shape(c.model.path) if c.model.path else model
        csp = int(c.ulysses_sequence_parallel_size or 1)
        ctok = _tokens(c.use_dynamic_bsz, c.ppo_max_token_len_per_gpu, c.ppo_micro_batch_size_per_gpu, seq, csp)
        ftok = _tokens(c.use_dynamic_bsz, c.forward_max_token_len_per_gpu, c.forward_micro_batch_size_per_gpu, seq, csp)
        critic = _role("critic", c, c.model.fsdp_config, c.model, critic_model, trainer_ranks, device, True, ctok, True)
        critic_fwd = _role("critic", c, c.model.fsdp_config, c.model, critic_model, trainer_ranks, device, True, ftok, True)
    return Roles(a, a_fwd, ref, critic, critic_fwd, critic_model, rollout_spec(cfg, hw, trainer_ranks, seq))


def rollout_ranks(cfg: Any, trainer_ranks: int) -> int:
    """The rollout's own pool (``rollout.nnodes × rollout.n_gpus_per_node``) or the trainer's ranks."""
    own = int(cfg.rollout.nnodes) * int(cfg.rollout.n_gpus_per_node)
    return own or trainer_ranks


def rollout_spec(cfg: Any, hw: Hardware, trainer_ranks: int, seq: int) -> mem.RolloutSpec:
    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    # one replica per rank: the hybrid vLLM and SGLang engines run TP 1 whatever the key says
    # (workers/rollout/vllm_rollout.py, sglang_rollout.py), and the HF engine generates on the actor's own module
    replicas = max(1, rollout_ranks(cfg, trainer_ranks))
    sequences = int(cfg.data.gen_batch_size or cfg.data.train_batch_size) * int(ro.n)
    colocated = not int(cfg.rollout.n_gpus_per_node)
    return mem.RolloutSpec(
        name=ro.name, tp=1, weight_bytes=mem.dtype_bytes(ro.dtype, 2) if hw.device == "cuda" else 4,
        gpu_memory_utilization=float(ro.gpu_memory_utilization), sequences_per_replica=-(-sequences // replicas),
        context=seq, releases_memory=bool(ro.free_cache_engine and ro.enable_sleep_mode),
        shares_actor_weights=ro.name == "hf" and actor.strategy == "fsdp" and colocated,
        kv_sized_to_batch=hw.device != "cuda")


# ───────────────────────────────────── phases of a pool ─────────────────────────────────────


def _named(role: str, b: mem.Breakdown) -> tuple[dict[str, int], dict[str, int]]:
    return ({f"{role} {k}": int(v) for k, v in b.device.items() if v},
            {f"{role} {k}": int(v) for k, v in b.host.items() if v})


def _phase(name: str, active: list[tuple[str, mem.Breakdown]], runtime: int) -> Phase:
    device, host = {}, {}
    for role, b in active:
        d, h = _named(role, b)
        device |= d
        host |= h
    return Phase(name, device | ({"runtime": runtime} if runtime else {}), host)


def trainer_phases(r: Roles, model: ModelShape, hw: Hardware, with_rollout: bool, runtime: int) -> list[Phase]:
    """Generation (if colocated), each log-prob / value pass, each update and step, in step order."""
    gpu = hw.device == "cuda"
    cm = r.critic_model or model
    idle = {"actor": mem.idle_breakdown(model, r.actor, gpu)}
    if r.ref:
        idle["ref"] = mem.idle_breakdown(model, r.ref, gpu)
    if r.critic:
        idle["critic"] = mem.idle_breakdown(cm, r.critic, gpu)
    if with_rollout:
        idle["rollout"] = mem.rollout_idle(model, r.rollout, hw.memory_bytes)

    def during(role: str, b: mem.Breakdown) -> list[tuple[str, mem.Breakdown]]:
        return [(k, v) for k, v in idle.items() if k != role] + [(role, b)]

    work: list[tuple[str, str, mem.Breakdown]] = []
    if with_rollout:
        work.append(("generate", "rollout", mem.rollout_phase(model, r.rollout, hw.memory_bytes)))
    if r.actor_forward:
        work.append(("actor log-prob", "actor", mem.forward_phase(model, r.actor_forward, gpu)))
    if r.ref:
        work.append(("ref log-prob", "ref", mem.forward_phase(model, r.ref, gpu)))
    if r.critic:
        work += [("critic values", "critic", mem.forward_phase(cm, r.critic_forward, gpu)),
                 ("critic update", "critic", mem.update_phase(cm, r.critic, gpu)),
                 ("critic step", "critic", mem.step_phase(cm, r.critic, gpu))]
    work += [("actor update", "actor", mem.update_phase(model, r.actor, gpu)),
             ("actor step", "actor", mem.step_phase(model, r.actor, gpu))]
    if with_rollout and r.rollout.shares_actor_weights:  # the HF engine decodes the actor's module
        gen = mem.forward_phase(model, r.actor, gpu)
        work[0] = ("generate", "rollout", mem.Breakdown(
            device={**mem.rollout_phase(model, r.rollout, hw.memory_bytes).device,
                    "gathered layers": gen.device.get("gathered layers", 0)}))
    phases = [_phase(name, during(role, b), runtime) for name, role, b in work]
    if with_rollout and not r.rollout.shares_actor_weights:
        # the rollout's weights are on the device to receive the sync (vLLM/SGLang wake them before
        # their KV cache), the actor's export beside them
        woken = {**idle, "rollout": mem.Breakdown(device={"rollout weights": int(mem.rollout_weights(model, r.rollout))})}
        sync = [(k, v) for k, v in woken.items() if k != "actor"] + [("actor", mem.export_breakdown(model, r.actor, gpu))]
        phases.append(_phase("weight sync", sync, runtime))
    return phases


def _rank_label(spec: mem.RoleSpec) -> str:
    if spec.strategy == "megatron" and spec.par.pp > 1:
        return "rank 0 (pipeline stage 0: the embedding and pp micro-batches in flight)"
    return "rank 0 (every rank alike)"


def assumptions_of(hw: Hardware, r: Roles) -> list[str]:
    gpu = hw.device == "cuda"
    out = [f"runtime per rank: {RUNTIME_BYTES[hw.device] / GIB:g} GiB ("
           + ("CUDA context, NCCL buffers, allocator slack" if gpu else "the Python process with torch") + ")",
           "activations: flash/SDPA attention (no seq×seq scores); sequences padded to prompt + response length "
           "unless use_dynamic_bsz (then the token budget)",
           "AdamW: two moments in the parameters' dtype (FSDP) or fp32 with fp32 master copies (Megatron's "
           "distributed optimizer)"]
    if r.rollout.name != "hf" and gpu:
        out.append(f"{r.rollout.name}: takes gpu_memory_utilization × device memory: weights, a "
                   f"{mem.ENGINE_RESERVE_BYTES / GIB:g} GiB reserve (graphs, sampler), KV cache in the rest")
    if not gpu:
        out.append("cpu: every rank of a node shares the host's memory; no offload (it is host memory already)")
    return out


def plan_config(cfg: Any, hw: Hardware, model: ModelShape | None = None, mfu: float | None = None) -> Plan:
    """The plan of a resolved ``PPOConfig`` on ``hw`` (``model``: read from ``model.path``'s config.json;
    ``mfu``: the training matmuls' fraction of peak FLOP/s, timing.MFU by default)."""
    from rlfoundry.plan.timing import MFU, phase_times

    model = model or load_shape(cfg.actor_rollout_ref.model.path)
    r = roles_of(cfg, model, hw)
    runtime = RUNTIME_BYTES[hw.device]
    per_node = int(cfg.trainer.n_gpus_per_node)
    trainer_ranks = int(cfg.trainer.nnodes) * per_node
    separate = bool(int(cfg.rollout.n_gpus_per_node))
    pools = [Pool("trainer pool", trainer_ranks, per_node, _rank_label(r.actor),
                  trainer_phases(r, model, hw, not separate, runtime))]
    if separate:
        gen = mem.rollout_phase(model, r.rollout, hw.memory_bytes)
        pools.append(Pool("rollout pool", rollout_ranks(cfg, trainer_ranks), int(cfg.rollout.n_gpus_per_node),
                          "rollout rank 0 (every rank alike)", [_phase("generate", [("rollout", gen)], runtime)]))
    capacity = hw.memory_bytes if hw.device == "cuda" else hw.memory_bytes // max(p.ranks_per_node for p in pools)
    total, active = param_counts(model)
    layout = {"ranks": trainer_ranks, "actor": r.actor.par.__dict__, "rollout_tp": r.rollout.tp,
              "params_total": total, "params_active": active, "separate_rollout_pool": separate}
    mfu = mfu or MFU
    assumptions = assumptions_of(hw, r) + [f"training and prefill matmuls at {mfu:.0%} of {hw.tflops:g} TFLOP/s"]
    model_cfg = cfg.actor_rollout_ref.model
    if model_cfg.use_shared_prompt and not model_cfg.enable_gradient_checkpointing:
        assumptions.append("model.use_shared_prompt: planned as the plain forward; measured on the CPU it held "
                           "about 0.4 GB more in the update of a 100M-parameter model (docs/plan.md, calibration)")
    return Plan(model, hw, pools, capacity, phase_times(cfg, model, r, hw, mfu), assumptions, layout,
                rollout_problems(model, r.rollout, hw))


def rollout_problems(model: ModelShape, r: mem.RolloutSpec, hw: Hardware) -> list[str]:
    """vLLM/SGLang refuse to start when their share of the device cannot hold the weights, their
    reserve and one whole sequence's KV cache."""
    if r.name == "hf" or hw.device != "cuda":
        return []
    budget = r.gpu_memory_utilization * hw.memory_bytes
    need = mem.rollout_weights(model, r) + mem.ENGINE_RESERVE_BYTES + mem.kv_cache_needed(model, r) / r.sequences_per_replica
    if need <= budget:
        return []
    return [f"rollout: weights {need / GIB:.1f} GiB with the reserve and one sequence's KV exceed gpu_memory_utilization="
            f"{r.gpu_memory_utilization} × {hw.memory_gib:.1f} GiB = {budget / GIB:.1f} GiB ({r.name} would not start); "
            "raise actor_rollout_ref.rollout.gpu_memory_utilization, or generate with rollout.name=hf (on the actor's "
            f"own sharded weights); the hybrid {r.name} engine runs tensor_parallel_size=1 here, each GPU holding the "
            "whole model (rollout tensor parallelism is not built)"]
