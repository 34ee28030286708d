"""The planner's formulas against hand-derived figures and published parameter counts."""

from __future__ import annotations

import dataclasses

import pytest

from rlfoundry.plan import memory as mem
from rlfoundry.plan.model import (
    kv_bytes_per_token,
    layer_activation_bytes_per_token,
    lora_params,
    param_counts,
    shape_from_config,
)
from rlfoundry.plan.timing import experts_touched
from tests.plan.configs import DEEPSEEK_V3, QWEN3_30B_A3B, QWEN3_235B_A22B, QWEN25_7B, QWEN25_32B, QWEN25_72B

# (total, active) as the model cards publish them
PUBLISHED = [(QWEN25_7B, 7.61e9, 7.61e9), (QWEN25_32B, 32.8e9, 32.8e9), (QWEN25_72B, 72.7e9, 72.7e9),
             (QWEN3_30B_A3B, 30.5e9, 3.3e9), (QWEN3_235B_A22B, 235e9, 22e9), (DEEPSEEK_V3, 671e9, 37e9)]


@pytest.mark.parametrize("cfg,total,active", PUBLISHED)
def test_parameter_counts_match_the_published_figures(cfg, total, active):
    got_total, got_active = param_counts(shape_from_config(cfg))
    # the cards round to 2-3 significant figures: within 0.5 % of the total, 2 % of the active count
    assert got_total == pytest.approx(total, rel=0.005)
    assert got_active == pytest.approx(active, rel=0.02)


def test_qwen25_7b_count_by_hand():
    # embed + head: 2·152064·3584 = 1,089,994,752; per layer: q 3584·3584+3584, k and v 3584·512+512 each,
    # o 3584·3584, MLP 3·3584·18944, two norms 2·3584 = 233,057,792; 28 layers + final norm 3584
    assert param_counts(shape_from_config(QWEN25_7B))[0] == 1_089_994_752 + 28 * 233_057_792 + 3584 == 7_615_616_512


def test_kv_cache_per_token():
    # 2 (K and V) · 28 layers · 4 KV heads · 128 head_dim · 2 bytes (bf16)
    assert kv_bytes_per_token(shape_from_config(QWEN25_7B), 2) == 2 * 28 * 4 * 128 * 2 == 57_344
    # MLA caches the 512-wide latent and the 64-wide rope key per layer: 61 · 576 · 2
    assert kv_bytes_per_token(shape_from_config(DEEPSEEK_V3), 2) == 61 * 576 * 2


def test_lora_params_all_linear():
    # r·(in+out) per projection; per layer q (3584+3584), k, v (3584+512) each, o (3584+3584), gate and up
    # (3584+18944) each, down (18944+3584) = 90,112; × r=8 × 28 layers = 20,185,088 (peft's figure)
    assert lora_params(shape_from_config(QWEN25_7B), 8) == 20_185_088


def _spec(**kw) -> mem.RoleSpec:
    base = dict(name="actor", strategy="fsdp", trainable=True, par=mem.Parallel(), storage_bytes=4, compute_bytes=2,
                tokens_per_micro=4096)
    return mem.RoleSpec(**(base | kw))


def test_fsdp_states_are_16_bytes_per_param_sharded_over_dp():
    m = shape_from_config(QWEN25_7B)
    n = param_counts(m)[0]
    one = mem.weight_states(m, _spec())
    # fp32 weights (the master copy) 4 + fp32 gradients 4 + AdamW's two fp32 moments 8
    assert one == {"weights": 4 * n, "gradients": 4 * n, "optimizer": 8 * n}
    eight = mem.weight_states(m, _spec(par=mem.Parallel(dp=8)))
    assert all(eight[k] == pytest.approx(one[k] / 8) for k in one)


def test_megatron_states_bf16_weights_fp32_master_and_moments_over_dp():
    m = shape_from_config(QWEN25_7B)
    spec = _spec(strategy="megatron", storage_bytes=2, par=mem.Parallel(dp=4, tp=2))
    per_rank = mem.params_on_rank(m, spec)
    s = mem.weight_states(m, spec)
    assert s["weights"] == pytest.approx(2 * per_rank) and s["gradients"] == pytest.approx(4 * per_rank)
    assert s["optimizer"] == pytest.approx(8 * per_rank / 4) and s["master weights"] == pytest.approx(4 * per_rank / 4)
    # tp=2 halves everything but the embedding, which is vocab-split too: exactly half of the whole model
    assert per_rank == pytest.approx(param_counts(m)[0] / 2)


def test_expert_parallel_divides_the_experts_only():
    m = shape_from_config(QWEN3_30B_A3B)
    one = mem.params_on_rank(m, _spec(strategy="megatron"))
    ep8 = mem.params_on_rank(m, _spec(strategy="megatron", par=mem.Parallel(ep=8)))
    experts = 48 * 128 * 3 * 2048 * 768  # layers · experts · gate/up/down · hidden · moe_intermediate
    assert one - ep8 == pytest.approx(experts * 7 / 8)


def test_fsdp_expert_parallelism_gathers_a_ranks_own_experts_and_stores_the_same_share():
    """FSDP2 with expert_parallel_size=8 over 8 ranks: every parameter still stored 1/8 per rank, but a layer's
    gather holds 1/8 of its routed experts (two layers gathered, forward and backward: 2 × 2 × bytes)."""
    m = shape_from_config(QWEN3_30B_A3B)
    plain, ep8 = _spec(par=mem.Parallel(dp=8)), _spec(par=mem.Parallel(dp=8, ep=8))
    assert mem.params_on_rank(m, ep8) == mem.params_on_rank(m, plain)
    experts = 48 * 128 * 3 * 2048 * 768
    saved = mem.gathered_bytes(m, plain) - mem.gathered_bytes(m, ep8)
    assert saved == pytest.approx(2 * 2 * 2 * experts * 7 / 8 / 48)


def test_lora_trains_adapters_only():
    m = shape_from_config(QWEN25_7B)
    s = mem.weight_states(m, _spec(lora_rank=8))
    assert s["gradients"] == 4 * 20_185_088 and s["optimizer"] == 8 * 20_185_088


def test_checkpointing_keeps_layer_inputs_plus_one_layer():
    m = shape_from_config(QWEN25_7B)
    full = mem.training_activations(m, _spec())
    ckpt = mem.training_activations(m, _spec(checkpointing=True))
    per_layer = layer_activation_bytes_per_token(m, 2, moe=False) * 4096
    assert full == pytest.approx(28 * per_layer)
    assert ckpt == pytest.approx(28 * 3584 * 2 * 4096 + per_layer)
    # (4h + 2·heads·hd + 2·kv·hd + 4·I) values of 2 bytes: (14336 + 7168 + 1024 + 75776) · 2
    assert layer_activation_bytes_per_token(m, 2, moe=False) == 196_608


def test_pipeline_stage_zero_holds_all_layers_worth_of_activations():
    m = shape_from_config(QWEN25_7B)
    pp1 = mem.training_activations(m, _spec(strategy="megatron"))
    pp4 = mem.training_activations(m, _spec(strategy="megatron", par=mem.Parallel(pp=4)))
    assert pp4 == pytest.approx(pp1)  # 4 micro-batches in flight × 7 layers = 28 layers' worth


def test_fused_head_never_holds_the_whole_logits():
    m = shape_from_config(QWEN25_7B)
    plain = mem.head_buffers(m, _spec(), backward=True)
    # logits and their gradient in bf16, plus one fp32 block of 2**25 values
    assert plain == 4096 * 152064 * 2 * 2 + 2**25 * 4
    assert mem.head_buffers(m, _spec(fused_head=True), backward=True) == 3 * 2**25 * 4


def test_offload_moves_states_to_the_host_byte_for_byte():
    m = shape_from_config(QWEN25_7B)
    on = mem.idle_breakdown(m, _spec(optimizer_offload=True), on_gpu=True)
    off = mem.idle_breakdown(m, _spec(), on_gpu=True)
    assert on.host == {"optimizer": off.device["optimizer"]}
    assert on.device_total + on.host_total == off.device_total
    # on a CPU device there is nothing to offload to
    assert mem.idle_breakdown(m, _spec(optimizer_offload=True), on_gpu=False).host == {}


def test_vllm_takes_its_share_of_the_device():
    m = shape_from_config(QWEN25_7B)
    r = mem.RolloutSpec("vllm", tp=1, weight_bytes=2, gpu_memory_utilization=0.5, sequences_per_replica=64,
                        context=4096, releases_memory=True, shares_actor_weights=False)
    b = mem.rollout_phase(m, r, 80 * 1024**3)
    assert b.device_total == pytest.approx(0.5 * 80 * 1024**3, abs=1)
    assert b.device["rollout weights"] == 2 * param_counts(m)[0]
    assert mem.rollout_idle(m, r, 80 * 1024**3).device_total == 0  # sleep mode: all released
    awake = dataclasses.replace(r, releases_memory=False)
    assert mem.rollout_idle(m, awake, 80 * 1024**3).device_total == b.device_total


def test_experts_touched_by_a_batch():
    assert experts_touched(128, 8, 1) == pytest.approx(8)
    assert experts_touched(128, 8, 2) == pytest.approx(128 * (1 - (120 / 128) ** 2))
    assert experts_touched(128, 8, 10_000) == pytest.approx(128)


def test_megatron_fp32_parameters_have_no_master_copy():
    m = shape_from_config(QWEN25_7B)
    s = mem.weight_states(m, _spec(strategy="megatron", storage_bytes=4, par=mem.Parallel(dp=2)))
    assert s["master weights"] == 0 and s["weights"] == pytest.approx(4 * param_counts(m)[0])


def test_vllm_and_sglang_on_the_cpu_hold_the_kv_cache_of_their_batch_not_a_memory_share():
    """The CPU rollouts size their KV cache to the batch (vllm_rollout._cpu_kv_cache_bytes, SGLang's
    max_total_tokens), so a CPU plan must not charge them gpu_memory_utilization of the host (a CI run on a
    loaded machine was refused for a 9 GiB KV cache its engine never allocates)."""
    m = shape_from_config(QWEN25_7B)
    for name in ("vllm", "sglang"):
        r = mem.RolloutSpec(name, tp=1, weight_bytes=4, gpu_memory_utilization=0.5, sequences_per_replica=8,
                            context=64, releases_memory=False, shares_actor_weights=False, kv_sized_to_batch=True)
        b = mem.rollout_phase(m, r, 22 * 1024**3)
        # 8 sequences × 64 tokens × (2 · 28 layers · 4 KV heads · 128 · 4 bytes)
        assert b.device["kv cache"] == 8 * 64 * 2 * 28 * 4 * 128 * 4
        assert b.device["rollout weights"] == 4 * param_counts(m)[0]


def test_megatron_keeps_its_gradient_buffer_between_updates_unless_grad_offload():
    m = shape_from_config(QWEN25_7B)
    spec = _spec(strategy="megatron", storage_bytes=2, par=mem.Parallel(dp=4, tp=2))
    idle = mem.idle_breakdown(m, spec, on_gpu=True)
    # DDP's contiguous fp32 buffer: 4 bytes per parameter on the rank, zeroed after the step, not freed
    assert idle.device["gradients"] == int(4 * mem.params_on_rank(m, spec))
    assert "gradients" not in mem.idle_breakdown(m, dataclasses.replace(spec, grad_offload=True), on_gpu=True).device
    assert "gradients" not in mem.idle_breakdown(m, _spec(), on_gpu=True).device  # FSDP sets them to None


def test_megatron_cpu_optimizer_keeps_its_share_of_the_state_on_the_host_even_in_the_step():
    m = shape_from_config(QWEN25_7B)
    spec = _spec(strategy="megatron", storage_bytes=2, par=mem.Parallel(dp=4, tp=2))
    whole = mem.weight_states(m, spec)
    state = whole["optimizer"] + whole["master weights"]  # 12 bytes per parameter of this rank's optimizer shard
    for fraction in (0.0, 0.5, 1.0):
        hybrid = dataclasses.replace(spec, cpu_optimizer_fraction=fraction)
        for phase in (mem.step_phase(m, hybrid, on_gpu=True), mem.idle_breakdown(m, hybrid, on_gpu=True)):
            on_device = phase.device["optimizer"] + phase.device["master weights"]
            assert on_device == pytest.approx((1 - fraction) * state, abs=2)
            assert phase.host.get("optimizer", 0) + phase.host.get("master weights", 0) == pytest.approx(fraction * state, abs=2)
    # on a CPU "device" the host is the device: nothing moves
    assert "optimizer" not in mem.step_phase(m, dataclasses.replace(spec, cpu_optimizer_fraction=1.0), on_gpu=False).host


def test_expert_optimizer_state_is_sharded_over_the_expert_data_parallel_ranks():
    m = shape_from_config(QWEN3_30B_A3B)
    one = mem.weight_states(m, _spec(strategy="megatron", storage_bytes=2, par=mem.Parallel(dp=8)))
    ep8 = mem.weight_states(m, _spec(strategy="megatron", storage_bytes=2, par=mem.Parallel(dp=8, ep=8)))
    experts = 48 * 128 * 3 * 2048 * 768
    # each rank holds 1/8 of the experts, replicated on 8/8 = 1 rank: all of that eighth's state is its own;
    # at EP=1 every rank holds all the experts, their state sharded over the 8 replicas: the same bytes
    assert one["weights"] - ep8["weights"] == pytest.approx(2 * experts * 7 / 8)
    assert one["optimizer"] == pytest.approx(ep8["optimizer"]) and one["master weights"] == pytest.approx(ep8["master weights"])
    # without the distributed optimizer every rank keeps the whole state of what it holds
    whole = mem.weight_states(m, _spec(strategy="megatron", storage_bytes=2, par=mem.Parallel(dp=8),
                                       distributed_optimizer=False))
    assert whole["optimizer"] == pytest.approx(8 * param_counts(m)[0])


def test_an_hf_rollout_beside_megatron_keeps_its_own_copy_between_generations():
    m = shape_from_config(QWEN25_7B)
    r = mem.RolloutSpec("hf", tp=1, weight_bytes=2, gpu_memory_utilization=0.5, sequences_per_replica=8,
                        context=64, releases_memory=False, shares_actor_weights=False)
    assert mem.rollout_idle(m, r, 80 * 1024**3).device == {"rollout weights": 2 * param_counts(m)[0]}
    assert mem.rollout_idle(m, dataclasses.replace(r, shares_actor_weights=True), 80 * 1024**3).device == {}


def test_weight_export_holds_the_largest_tensor_twice_when_megatron_gathers_it():
    m = shape_from_config(QWEN25_7B)
    # the embedding, 152064 × 3584 values, is larger than the fused gate/up projection (2 · 18944 × 3584)
    assert mem.largest_tensor(m) == 152064 * 3584
    tp2 = mem.export_breakdown(m, _spec(strategy="megatron", storage_bytes=2, par=mem.Parallel(tp=2)), on_gpu=True)
    assert tp2.device["weight export"] == 2 * 152064 * 3584 * 2  # the shards beside their concatenation, bf16
    fsdp = mem.export_breakdown(m, _spec(par=mem.Parallel(dp=8)), on_gpu=True)
    assert fsdp.device["weight export"] == 152064 * 3584 * 2  # full_tensor once, in the compute dtype


def test_the_cpu_optimizer_share_is_read_from_verls_override_keys():
    from types import SimpleNamespace

    from rlfoundry.plan.build import _cpu_optimizer_fraction

    def policy(strategy="megatron", **overrides):
        return SimpleNamespace(strategy=strategy, optim=SimpleNamespace(override_optimizer_config=overrides))

    assert _cpu_optimizer_fraction(policy(optimizer_cpu_offload=True, optimizer_offload_fraction=1)) == 1.0
    assert _cpu_optimizer_fraction(policy(optimizer_cpu_offload=True, optimizer_offload_fraction=0.25)) == 0.25
    assert _cpu_optimizer_fraction(policy(optimizer_cpu_offload=True)) == 0.0  # megatron-core's default share
    assert _cpu_optimizer_fraction(policy(optimizer_offload_fraction=1)) == 0.0  # no CPU optimizer
    assert _cpu_optimizer_fraction(policy("fsdp", optimizer_cpu_offload=True, optimizer_offload_fraction=1)) == 0.0
