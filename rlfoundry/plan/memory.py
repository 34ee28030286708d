"""Per-rank memory of each role, from the model's shape and the role's layout (pure arithmetic).

Every function returns bytes on one rank. The role's layout (``RoleSpec``) is read from the run's
typed config in ``plan/build.py``; nothing here knows the config's key names.

Dtypes: ``storage`` is what the engine keeps its parameters in (FSDP: ``fsdp_config.model_dtype``,
fp32 by default, so those fp32 parameters are the master weights; Megatron: ``megatron.dtype`` bf16
parameters beside fp32 main copies in the distributed optimizer); ``compute`` is the forward's
dtype (FSDP: ``mixed_precision.param_dtype``, bf16 on CUDA and fp32 on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rlfoundry.plan.model import (
    ModelShape,
    expert_params,
    kv_bytes_per_token,
    layer_activation_bytes_per_token,
    lora_params,
    param_counts,
)

DTYPE_BYTES = {"fp32": 4, "float32": 4, "float": 4, "bf16": 2, "bfloat16": 2, "fp16": 2, "float16": 2, "half": 2}
# the chunked log-prob/entropy kernels' block: 2**25 fp32 values (utils/torch_functional.CHUNK_ELEMENTS)
CHUNK_ELEMENTS = 2**25


def dtype_bytes(name: str | None, default: int) -> int:
    """Bytes per value of a dtype spelling (verl's fp32/bf16 or torch's names); ``default`` for None."""
    if name is None:
        return default
    return DTYPE_BYTES.get(str(name).removeprefix("torch.").lower(), default)


@dataclass(frozen=True)
class Parallel:
    dp: int = 1  # data-parallel ranks (FSDP shards over these)
    tp: int = 1
    pp: int = 1
    cp: int = 1  # Megatron context parallel
    ep: int = 1  # expert parallel (Megatron; FSDP: fsdp_config.expert_parallel_size)
    etp: int = 1  # expert tensor parallel
    sp: int = 1  # Ulysses sequence parallel (FSDP)
    vpp: int = 1


@dataclass(frozen=True)
class RoleSpec:
    """One training-engine role (actor, reference, critic) as its engine lays it out on a rank."""

    name: str
    strategy: str  # fsdp | megatron
    trainable: bool
    par: Parallel
    storage_bytes: int
    compute_bytes: int
    tokens_per_micro: int  # tokens one micro-batch puts on a rank (before sequence/context parallel)
    checkpointing: bool = False
    fused_head: bool = False
    lora_rank: int = 0
    value_head: bool = False  # critic: a 1-wide head instead of the vocabulary
    param_offload: bool = False
    optimizer_offload: bool = False
    grad_offload: bool = False
    wrapped: bool = True  # FSDP2 wraps it (single_rank=auto leaves a lone rank unwrapped)
    distributed_optimizer: bool = True  # Megatron's use_distributed_optimizer (false: every rank all the state)
    # megatron-core's CPU optimizer (override_optimizer_config.optimizer_cpu_offload): the share
    # optimizer_offload_fraction of the parameters keeps its moments and fp32 master copy on the host
    cpu_optimizer_fraction: float = 0.0


@dataclass
class Breakdown:
    """Named byte counts; ``device`` is on the rank's accelerator, ``host`` is offloaded to the host."""

    device: dict[str, int] = field(default_factory=dict)
    host: dict[str, int] = field(default_factory=dict)

    @property
    def device_total(self) -> int:
        return sum(self.device.values())

    @property
    def host_total(self) -> int:
        return sum(self.host.values())


# ───────────────────────────────────── weights and states ─────────────────────────────────────


def role_param_count(m: ModelShape, value_head: bool) -> int:
    """Parameters of the role's model: a critic swaps the LM head (vocab × hidden) for hidden × 1."""
    total, _ = param_counts(m)
    if value_head:
        total += m.hidden - (0 if m.tied else m.vocab * m.hidden)
    return total


def params_on_rank(m: ModelShape, spec: RoleSpec) -> float:
    """How many parameters this rank stores.
    FSDP2: every parameter sharded evenly over the dp·sp ranks (Ulysses ranks shard too).
    Megatron: dense weights split by tp·pp, routed experts by ep·etp·pp; the embedding and the LM
    head (vocab × h each, split by tp) sit on the first and last stage: both on a lone stage, one of
    them on each end stage under pipeline parallelism."""
    p = spec.par
    if spec.strategy != "megatron":
        return role_param_count(m, spec.value_head) / (p.dp * p.sp)
    return sum(megatron_params_on_rank(m, spec))


def megatron_params_on_rank(m: ModelShape, spec: RoleSpec) -> tuple[float, float]:
    """(dense, routed-expert) parameters a Megatron rank stores (``params_on_rank``'s split): the two
    are sharded over different data-parallel groups by the distributed optimizer."""
    p = spec.par
    experts = expert_params(m)
    embed = m.vocab * m.hidden
    heads = embed * (1 if m.tied or spec.value_head else 2)
    body = role_param_count(m, spec.value_head) - experts - heads
    ends = heads if p.pp == 1 else embed
    return body / (p.tp * p.pp) + ends / p.tp, experts / (p.ep * p.etp * p.pp)


def megatron_optimizer_params(m: ModelShape, spec: RoleSpec) -> float:
    """Parameters whose optimizer state (and fp32 master copy) this rank's distributed optimizer holds.
    megatron-core shards each parameter's state over the ranks that hold a replica of it: dense weights
    over data parallel × context parallel (its DDP reduces over the group with context parallel), the
    experts over the expert-data-parallel group, ranks / (ep · etp · pp). The EP ranks come out of the
    data-parallel ones, so a rank holds 1/ep of the experts but shards them over ep times fewer replicas:
    their state per rank is the same at every EP (at etp = tp), the weights and gradients are not."""
    dense, experts = megatron_params_on_rank(m, spec)
    p = spec.par
    if not spec.distributed_optimizer:
        return dense + experts
    expert_dp = max(1, p.dp * p.tp * p.cp // (p.ep * p.etp))
    return dense / (p.dp * p.cp) + experts / expert_dp


def weight_states(m: ModelShape, spec: RoleSpec) -> dict[str, float]:
    """The role's persistent state on this rank, before offload decides where it lives.
      weights: stored parameters × storage bytes
      gradients (trainable): FSDP in the storage dtype (sharded like the weights); Megatron's DDP
        buffer in fp32 (4 bytes, not sharded by dp)
      optimizer (AdamW, two moments): FSDP in the storage dtype (torch's AdamW keeps state in the
        parameter's dtype: 8 bytes/param over fp32 weights); Megatron's distributed optimizer 8 bytes
        fp32 moments + 4 bytes fp32 master weights (bf16 parameters only), sharded over each
        parameter's replicas (``megatron_optimizer_params``)
    LoRA: the base weights are frozen; gradients and moments exist for the adapters alone (r·(in+out)
    per adapted linear), stored in the storage dtype."""
    n = params_on_rank(m, spec)
    out = {"weights": n * spec.storage_bytes}
    if not spec.trainable:
        return out
    if spec.lora_rank > 0:
        shard = spec.par.dp * spec.par.sp if spec.strategy != "megatron" else spec.par.tp * spec.par.pp
        adapters = lora_params(m, spec.lora_rank) / shard
        out["weights"] += adapters * spec.storage_bytes
        return out | {"gradients": adapters * spec.storage_bytes, "optimizer": 2 * adapters * spec.storage_bytes}
    if spec.strategy == "megatron":  # fp32 parameters are their own main copy: no master weights then
        sharded = megatron_optimizer_params(m, spec)
        master = 4 * sharded if spec.storage_bytes < 4 else 0.0
        return out | {"gradients": 4 * n, "optimizer": 8 * sharded, "master weights": master}
    return out | {"gradients": n * spec.storage_bytes, "optimizer": 2 * n * spec.storage_bytes}


def gathered_bytes(m: ModelShape, spec: RoleSpec) -> float:
    """FSDP2's unsharded working set in the compute dtype: the root unit (embeddings, LM head, final
    norm stay gathered through the forward) plus two decoder layers (the current one and the
    prefetched next), and in backward their unsharded gradients (none for LoRA's frozen base). Under the
    FSDP engine's expert parallelism a layer gathers 1/ep of its routed experts (a rank's own). Nothing
    for an unwrapped lone rank or for Megatron (it never gathers)."""
    if spec.strategy == "megatron" or not spec.wrapped:
        return 0.0
    total, _ = param_counts(m)
    root = m.vocab * m.hidden * (1 if m.tied else 2)
    experts = expert_params(m)
    layer = (total - root - experts + experts / spec.par.ep) / m.layers
    per_gather = (root + 2 * layer) * spec.compute_bytes
    return per_gather * (2 if spec.trainable and not spec.lora_rank else 1)


# ───────────────────────────────────── activations ─────────────────────────────────────


def tokens_on_rank(spec: RoleSpec) -> float:
    """A micro-batch's tokens on one rank: Ulysses and context parallel split the sequence."""
    return spec.tokens_per_micro / (spec.par.sp * spec.par.cp)


def layers_on_rank(m: ModelShape, spec: RoleSpec) -> tuple[int, int]:
    """(dense, MoE) decoder layers this rank computes: all of them, or one pipeline stage's share."""
    pp = spec.par.pp if spec.strategy == "megatron" else 1
    return -(-(m.layers - m.moe_layers) // pp), -(-m.moe_layers // pp)


def training_activations(m: ModelShape, spec: RoleSpec) -> float:
    """Saved activations of one micro-batch's forward, held until its backward.
    Without checkpointing: per layer the values ``layer_activation_bytes_per_token`` counts, over the
    rank's layers, divided by tp (Megatron's sequence parallel shards every saved value).
    With checkpointing: each layer keeps its input (hidden values) and one layer's full set is
    rebuilt at a time during backward.
    Pipeline parallel (1F1B): the first stage holds pp micro-batches in flight, pp × layers/pp =
    all layers' worth (Korthikanti et al. 2022, §4.2.3), so pp does not reduce this figure."""
    t, c = tokens_on_rank(spec), spec.compute_bytes
    dense, moe = layers_on_rank(m, spec)
    inflight = spec.par.pp if spec.strategy == "megatron" else 1
    tp = spec.par.tp if spec.strategy == "megatron" else 1
    full_dense = layer_activation_bytes_per_token(m, c, moe=False) * t / tp
    full_moe = layer_activation_bytes_per_token(m, c, moe=True) * t / tp
    if spec.checkpointing:
        kept = (dense + moe) * inflight * m.hidden * c * t / tp
        return kept + (full_moe if moe else full_dense)
    return inflight * (dense * full_dense + moe * full_moe)


def head_buffers(m: ModelShape, spec: RoleSpec, backward: bool) -> float:
    """The LM head's output. Unfused: the (tokens, vocab) logits in the compute dtype and, in
    backward, their gradient (two such tensors), plus one fp32 block of the chunked log-prob/entropy
    kernel. Fused (``use_fused_kernels``): the logits never exist whole; a few fp32 blocks of
    CHUNK_ELEMENTS values at most (the block's logits, softmax and gradient: 3). Megatron splits the vocabulary
    over tp. A critic's head is 1 wide (negligible)."""
    if spec.value_head:
        return tokens_on_rank(spec) * 4.0
    tp = spec.par.tp if spec.strategy == "megatron" else 1
    values = tokens_on_rank(spec) * m.vocab / tp
    block = min(values, CHUNK_ELEMENTS) * 4
    if spec.fused_head:
        return 3.0 * block
    return values * spec.compute_bytes * (2 if backward else 1) + block


def forward_only_activations(m: ModelShape, spec: RoleSpec) -> float:
    """A no-grad forward (log-probs, values): nothing is saved; the live set is one layer's
    intermediates for the micro-batch (bounded by the training set of one layer)."""
    t, c = tokens_on_rank(spec), spec.compute_bytes
    tp = spec.par.tp if spec.strategy == "megatron" else 1
    return layer_activation_bytes_per_token(m, c, moe=m.is_moe) * t / tp


# ───────────────────────────────────── one role, one rank ─────────────────────────────────────


def place_states(states: dict[str, float], spec: RoleSpec, on_gpu: bool) -> Breakdown:
    """Where each state lives while the role is idle (other roles' phases): with ``param_offload``
    the weights (and FSDP's gradients and moments: FSDP2's CPUOffloadPolicy steps on the host) sit in
    host memory; ``optimizer_offload`` moves the moments (and Megatron's master copies) there. On a
    CPU device there is no offload: everything is host memory already."""
    out = Breakdown()
    for name, value in states.items():
        offloaded = on_gpu and (
            spec.param_offload and (name == "weights" or spec.strategy != "megatron")
            or spec.optimizer_offload and name in ("optimizer", "master weights")
            or spec.grad_offload and name == "gradients")
        (out.host if offloaded else out.device)[name] = int(value)
    return _host_optimizer(out, spec, on_gpu)


def _host_optimizer(b: Breakdown, spec: RoleSpec, on_gpu: bool) -> Breakdown:
    """megatron-core's CPU optimizer (``HybridDeviceOptimizer``): its share of the optimizer state lives and
    steps on the host in every phase, the step included; only the device's share is ever on the device."""
    if not on_gpu or spec.cpu_optimizer_fraction <= 0:
        return b
    for name in ("optimizer", "master weights"):
        if name in b.device:
            moved = int(b.device[name] * spec.cpu_optimizer_fraction)
            b.device[name] -= moved
            b.host[name] = b.host.get(name, 0) + moved
    return b


def idle_breakdown(m: ModelShape, spec: RoleSpec, on_gpu: bool) -> Breakdown:
    """What the role keeps on its rank while another phase runs: weights and optimizer state, minus what
    is offloaded. Gradients: FSDP frees them after each step (``zero_grad(set_to_none)``); Megatron's
    DDP keeps its contiguous fp32 gradient buffer allocated between updates (zeroed, not freed) unless
    ``grad_offload`` releases it (engines/megatron/offload.py)."""
    kept = spec.strategy == "megatron" and not spec.grad_offload
    states = {k: v for k, v in weight_states(m, spec).items() if k != "gradients" or kept}
    return place_states(states, spec, on_gpu)


def _megatron_brings_back(b: Breakdown, spec: RoleSpec, names: tuple[str, ...]) -> Breakdown:
    """Megatron's offload releases states between uses and loads them back for each use
    (engines/megatron/offload.py): while the role computes they are on the device."""
    if spec.strategy == "megatron":
        for name in names:
            if name in b.host:
                b.device[name] = b.host.pop(name)
    return b


def update_phase(m: ModelShape, spec: RoleSpec, on_gpu: bool) -> Breakdown:
    """The peak of a training step's forward + backward: the states where offload puts them (FSDP2's
    CPUOffloadPolicy keeps parameters and gradients on the host and gathers layer by layer; an
    offloaded optimizer stays off the device until the step), the gathered layers, one micro-batch's
    saved activations and the head's buffers."""
    b = _megatron_brings_back(place_states(weight_states(m, spec), spec, on_gpu), spec, ("weights", "gradients"))
    b.device["gathered layers"] = int(gathered_bytes(m, spec))
    b.device["activations"] = int(training_activations(m, spec))
    b.device["logits"] = int(head_buffers(m, spec, backward=True))
    return b


def step_phase(m: ModelShape, spec: RoleSpec, on_gpu: bool) -> Breakdown:
    """The optimizer step: weights, gradients and optimizer state together on the device (offloaded
    moments are loaded back for it) unless FSDP2's CPUOffloadPolicy steps on the host."""
    states = {k: int(v) for k, v in weight_states(m, spec).items()}
    if on_gpu and spec.param_offload and spec.strategy != "megatron":
        return Breakdown(host=states)
    return _host_optimizer(Breakdown(device=states), spec, on_gpu)


def forward_phase(m: ModelShape, spec: RoleSpec, on_gpu: bool) -> Breakdown:
    """A log-prob / value pass: the idle states (Megatron's offloaded weights brought back), the
    gathered layers (no gradients), one layer's live activations and the head's output for one
    micro-batch."""
    b = _megatron_brings_back(idle_breakdown(m, spec, on_gpu), spec, ("weights",))
    b.device["gathered layers"] = int(gathered_bytes(m, spec) / (2 if spec.trainable and not spec.lora_rank else 1))
    b.device["activations"] = int(forward_only_activations(m, spec))
    b.device["logits"] = int(head_buffers(m, spec, backward=False))
    return b


def largest_tensor(m: ModelShape) -> int:
    """Values in the model's largest whole HF tensor: the embedding or LM head (vocab × hidden), the
    fused gate/up projection (2·I × hidden), or a MoE layer's experts as transformers holds them in
    memory (``gate_up_proj``: E × 2·I_moe × hidden)."""
    experts = m.experts * 2 * m.moe_intermediate * m.hidden if m.is_moe else 0
    return max(m.vocab * m.hidden, 2 * m.intermediate * m.hidden, experts)


def export_breakdown(m: ModelShape, spec: RoleSpec, on_gpu: bool) -> Breakdown:
    """The weight sync to a rollout engine with weights of its own: the actor idle (Megatron's offloaded
    weights brought back to export them) and the tensor in flight. The export hands over whole HF
    tensors one at a time; Megatron gathers each over tensor parallel (the shards beside their
    concatenation) or takes it from its pipeline stage (a pickled copy beside the tensor): twice the
    largest tensor then; FSDP's ``full_tensor`` once. A Megatron MoE layer's experts are collected
    before they are handed on (moe.fuse_experts): a copy of every expert's gate, up and down (3·E·I·h)
    beside the stacked gate_up and down (3·E·I·h more). On the CPU these were the terms missing from
    Megatron runs' peaks: 0.09-0.15 GB of a 100M-parameter model at TP=2 and PP=2, 0.2 GB of the
    16-expert model at EP=2 (docs/plan.md)."""
    b = _megatron_brings_back(idle_breakdown(m, spec, on_gpu), spec, ("weights",))
    megatron = spec.strategy == "megatron"
    values = (2 if megatron and spec.par.tp * spec.par.pp > 1 else 1) * largest_tensor(m)
    if megatron and m.is_moe:
        values = max(values, 6 * m.experts * m.moe_intermediate * m.hidden)
    b.device["weight export"] = int(values * spec.compute_bytes)
    return b


# ───────────────────────────────────── the rollout engine ─────────────────────────────────────


@dataclass(frozen=True)
class RolloutSpec:
    name: str  # hf | vllm | sglang
    tp: int
    weight_bytes: int  # dtype of the served weights
    gpu_memory_utilization: float
    sequences_per_replica: int  # prompts × n on one replica
    context: int  # prompt + response tokens
    releases_memory: bool  # sleep mode / free_cache_engine: nothing kept outside generation
    shares_actor_weights: bool  # HF engine decoding the FSDP actor's own module
    # vLLM/SGLang on the CPU size their KV cache to the batch (the rollouts' CPU paths), not to a memory share
    kv_sized_to_batch: bool = False


# vLLM/SGLang's own non-KV reserve inside their budget (CUDA graphs, sampler, activations at
# max_num_batched_tokens): a stated figure, not measured here
ENGINE_RESERVE_BYTES = 2 * 1024**3


def rollout_weights(m: ModelShape, r: RolloutSpec) -> float:
    """The served copy: every parameter once per replica, split over its tp ranks."""
    return param_counts(m)[0] * r.weight_bytes / r.tp


def kv_cache_needed(m: ModelShape, r: RolloutSpec) -> float:
    """KV cache for all of a replica's sequences at full length on one of its tp ranks (KV heads are
    split by tp; MLA's latent is replicated)."""
    per_token = kv_bytes_per_token(m, r.weight_bytes) / (1 if m.kv_lora_rank else min(r.tp, m.kv_heads))
    return per_token * r.context * r.sequences_per_replica


def rollout_phase(m: ModelShape, r: RolloutSpec, memory_bytes: int) -> Breakdown:
    """Generation on one rank. vLLM/SGLang take ``gpu_memory_utilization`` of the device: their weights,
    a reserve, and KV cache filling the rest (what the batch does not use stays reserved). The HF
    engine decodes the actor's own module (no second copy) and allocates the KV its batch needs, as vLLM and
    SGLang do on the CPU (``kv_sized_to_batch``: ``_cpu_kv_cache_bytes`` / ``max_total_tokens`` there)."""
    if r.name == "hf" or r.kv_sized_to_batch:
        weights = 0 if r.shares_actor_weights else rollout_weights(m, r)
        return Breakdown(device={"rollout weights": int(weights), "kv cache": int(kv_cache_needed(m, r))})
    budget = r.gpu_memory_utilization * memory_bytes
    weights = rollout_weights(m, r)
    kv = max(0.0, budget - weights - ENGINE_RESERVE_BYTES)
    return Breakdown(device={"rollout weights": int(weights), "engine reserve": ENGINE_RESERVE_BYTES, "kv cache": int(kv)})


def rollout_idle(m: ModelShape, r: RolloutSpec, memory_bytes: int) -> Breakdown:
    """Outside generation: nothing with sleep mode / free_cache_engine (weights to the host, KV
    discarded); without, the engine keeps its whole budget. The HF engine frees its KV cache after each
    batch; decoding the actor's own module it holds nothing else, but beside a Megatron actor it decodes
    a copy of its own (hf_rollout.py: the weight sync copies the actor's export into it), which stays
    on the device through the other phases: on the CPU that copy was a 0.4 GB term missing from a
    100M-parameter Megatron run's update (docs/plan.md, calibration)."""
    if r.name == "hf":
        weights = 0 if r.shares_actor_weights else int(rollout_weights(m, r))
        return Breakdown(device={"rollout weights": weights} if weights else {})
    if r.releases_memory:
        return Breakdown(host={"rollout weights": int(rollout_weights(m, r))})
    return rollout_phase(m, r, memory_bytes)
