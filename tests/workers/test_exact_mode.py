"""Exact mode (``rollout.exact_log_probs``; docs/on_policy.md): through the real worker, the HF rollout's
log-probs equal the actor's and the reference's bit for bit (``torch.equal``), whatever the scoring batch,
its micro-batches, padding or packing, in fp32 and under bf16; the first mini-batch's ratio is exactly 1."""

import pytest
import torch

from tests.workers import local_worker, make_prompts, worker_config

EXACT = ["rollout.exact_log_probs=true"]
BF16 = ["actor.fsdp_config.mixed_precision.param_dtype=bf16", "ref.fsdp_config.mixed_precision.param_dtype=bf16"]
TEXTS = ["hello world", "a", "the quick brown fox", "12+7=", "xyz", "Once upon a time"]


def _rollout(group, tokenizer, temperature=1.0):
    prompts = make_prompts(tokenizer, TEXTS)
    prompts.meta_info = {"eos_token_id": list(range(0, 260, 9)), "temperature": temperature}  # varied lengths
    data = group.generate_sequences(prompts)
    data.meta_info = {"temperature": temperature}
    return data


def _assert_equal_on_tokens(got, data, key="old_log_probs"):
    mask = data.batch["response_mask"].bool()
    lengths = mask.sum(-1)
    assert lengths.min() < lengths.max() < mask.shape[1] + 1  # responses of several lengths: right padding varies
    want = data.batch["rollout_log_probs"][mask]
    assert torch.equal(got.batch[key][mask], want), float((got.batch[key][mask] - want).abs().max())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_rollout_log_probs_equal_the_actors_for_any_micro_batching_and_packing(tiny_model_dir, tokenizer, dtype):
    extra = BF16 if dtype == "bf16" else []
    sampler = local_worker(worker_config(tiny_model_dir, EXACT + extra + ["rollout.n=2"]))
    data = _rollout(sampler, tokenizer, temperature=0.8)
    assert sampler.compute_log_prob(data).meta_info["compute_dtype"] == ("bfloat16" if extra else "float32")
    # (packed, micro-batch size, shared prompt: each prompt once, its rows continuing from its KV cache)
    for packed, micro, shared in ((False, 1, False), (False, 5, False), (True, 3, False), (True, 12, False),
                                  (False, 4, True)):
        scorer = local_worker(worker_config(tiny_model_dir, EXACT + extra + [
            f"model.use_remove_padding={packed}", f"rollout.log_prob_micro_batch_size_per_gpu={micro}",
            f"ref.log_prob_micro_batch_size_per_gpu={micro}", f"model.use_shared_prompt={shared}"]))
        _assert_equal_on_tokens(scorer.compute_log_prob(data), data)
        _assert_equal_on_tokens(scorer.compute_ref_log_prob(data), data, key="ref_log_prob")
        # another scoring batch: a subset of the rows, in another order
        rows = [7, 2, 10]
        part = data.select_idxs(rows) if hasattr(data, "select_idxs") else data[rows]
        _assert_equal_on_tokens(scorer.compute_log_prob(part), part)


def test_normal_mode_is_not_exact_here(tiny_model_dir, tokenizer):
    """The control: the same rollout without exact mode differs from the actor in the last bits (the
    equality above is the mode's doing, not this model's luck)."""
    group = local_worker(worker_config(tiny_model_dir, ["rollout.n=2"]))
    data = _rollout(group, tokenizer)
    mask = data.batch["response_mask"].bool()
    old = group.compute_log_prob(data).batch["old_log_probs"][mask]
    assert not torch.equal(old, data.batch["rollout_log_probs"][mask])
    torch.testing.assert_close(old, data.batch["rollout_log_probs"][mask], atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_first_mini_batchs_ratio_is_exactly_one(tiny_model_dir, tokenizer, dtype):
    """update_actor with the rollout's log-probs as the old ones (``use_rollout_log_probs``'s case):
    |log π_θ - log π_old| of the first mini-batch is 0 on every token, so nothing is clipped."""
    extra = BF16 if dtype == "bf16" else []
    group = local_worker(worker_config(tiny_model_dir, EXACT + extra + [
        "rollout.n=2", "actor.ppo_mini_batch_size=3", "actor.ppo_micro_batch_size_per_gpu=2",
        "model.use_remove_padding=true"]))
    data = _rollout(group, tokenizer)
    data.batch["old_log_probs"] = data.batch["rollout_log_probs"].clone()
    mask = data.batch["response_mask"]
    data.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    data.meta_info |= {"temperature": 1.0}
    metrics = group.update_actor(data).meta_info["metrics"]
    # one entry per mini-batch: the first is scored by the weights that sampled it, the second after a step
    first, second = metrics["actor/log_ratio_abs_max"]
    assert first == 0.0 and metrics["actor/pg_clipfrac"][0] == 0.0
    assert second > 0.0  # the metric does see a gap where there is one


@pytest.mark.parametrize("overrides, message", [
    (["actor_rollout_ref.rollout.name=vllm"], r"exact_log_probs=true is built for the HF engine"),
    (["actor_rollout_ref.model.use_fused_kernels=true"], r"exact_log_probs=true: the fused head"),
    (["actor_rollout_ref.actor.strategy=megatron"], r"actor.strategy=megatron computes log-probs"),
    (["actor_rollout_ref.actor.use_torch_compile=true"], r"actor.use_torch_compile=true compiles the layers"),
    (["actor_rollout_ref.rollout.use_torch_compile=true"], r"rollout.use_torch_compile=true compiles the decode"),
])
def test_what_exact_mode_does_not_cover_is_a_start_up_error_naming_the_key(overrides, message):
    from rlfoundry.trainer.config import ConfigError, load_config, validate_config

    with pytest.raises(ConfigError, match=message):
        validate_config(load_config(["actor_rollout_ref.rollout.exact_log_probs=true", *overrides]))
    validate_config(load_config(["actor_rollout_ref.rollout.exact_log_probs=true"]))  # the default job takes it


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_static_cache_decode_reports_the_same_bits(tiny_model_dir, tokenizer, dtype):
    """The static-shape decode (static_decode.py: a StaticCache of 64-slot multiples, a bucketed batch that
    shrinks) samples the dynamic loop's tokens and reports the dynamic loop's, and so the actor's, log-probs."""
    from rlfoundry.workers.rollout.hf_rollout import HFRollout
    from rlfoundry.workers.rollout.static_decode import StaticDecoder

    extra = BF16 if dtype == "bf16" else []
    group = local_worker(worker_config(tiny_model_dir, EXACT + extra + ["rollout.n=2"]))
    dynamic = group.worker.rollout
    static = HFRollout(dynamic.module, dynamic.config, tokenizer.pad_token_id, tokenizer.eos_token_id,
                       static_decode=True)
    static._static = StaticDecoder(dynamic.module, sync_every=2)  # the bucket shrinks several times
    want, got = _rollout(group, tokenizer), _rollout(static, tokenizer)
    assert static._static.host_reads > 0  # the static loop ran
    assert torch.equal(got.batch["responses"], want.batch["responses"])
    assert torch.equal(got.batch["rollout_log_probs"], want.batch["rollout_log_probs"])
    _assert_equal_on_tokens(group.compute_log_prob(got), got)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_rollout_worker_of_its_own_samples_with_the_actors_bits(tiny_model_dir, tokenizer, dtype):
    """A rollout role without the actor (its own copy of the policy, ``_rollout_module``, loaded in the
    actor's compute dtype) is converted too."""
    extra = BF16 if dtype == "bf16" else []
    sampler = local_worker(worker_config(tiny_model_dir, EXACT + extra + ["rollout.n=2"]), role="rollout")
    scorer = local_worker(worker_config(tiny_model_dir, EXACT + extra + ["model.use_remove_padding=true"]))
    data = _rollout(sampler, tokenizer)
    _assert_equal_on_tokens(scorer.compute_log_prob(data), data)
