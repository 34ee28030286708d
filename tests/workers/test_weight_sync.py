"""Syncs that prove themselves (workers/weight_sync.py, ActorRolloutRefWorker): digests, the verify
mode's catch of a skipped or corrupted sync, and ``param_version`` on every sample."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from rlfoundry.utils import faults
from rlfoundry.utils.errors import StaleWeightsError
from rlfoundry.workers.weight_sync import DigestRecorder, compare_digests, tensor_digest
from tests.workers import full_params, local_worker, make_prompts, one_thread, worker_config  # noqa: F401

TEXTS = ["hello world", "a", "the quick brown fox", "12+7="]


# ---- the digest ---------------------------------------------------------------------------------

def test_a_digest_sees_one_ulp_and_is_taken_in_the_engines_dtype():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    y = x.clone()
    y[417] = torch.nextafter(y[417], torch.tensor(float("inf")))  # one ulp, one element
    assert tensor_digest(x) == tensor_digest(x.clone()) and tensor_digest(x) != tensor_digest(y)
    # cast first, as a bf16 engine's loader does: the fp32 tensor hashes as its bf16 copy does
    assert tensor_digest(x, torch.bfloat16) == tensor_digest(x.to(torch.bfloat16))
    assert tensor_digest(x, torch.bfloat16) != tensor_digest(x)
    # a truncated copy differs; so does an all-zero tensor from an empty one of the same bits
    assert tensor_digest(x[:999]) != tensor_digest(x) and tensor_digest(torch.zeros(0)) != tensor_digest(torch.zeros(1))


def test_a_digest_adds_up_over_the_parts_of_a_fused_or_sharded_tensor():
    q, k, v = (torch.randn(8, 4, generator=torch.Generator().manual_seed(i)) for i in range(3))
    fused = torch.cat([q, k, v])  # vLLM's qkv_proj
    assert tensor_digest(fused) == (tensor_digest(q) + tensor_digest(k) + tensor_digest(v)) % 2**64


def test_compare_names_the_first_tensor_that_differs_or_is_missing():
    expected = {"a": 1, "b": 2, "c": 3}
    compare_digests(expected, {"a": 1, "b": 2, "c": 3, "extra": 9}, where="x", version=4)
    with pytest.raises(StaleWeightsError, match=r"to x \(param_version 4\): tensor 'b' differs .*\(2 of 3 tensors"):
        compare_digests(expected, {"a": 1, "b": 5, "c": 6}, where="x", version=4)
    with pytest.raises(StaleWeightsError, match="the engine has no tensor 'c'"):
        compare_digests(expected, {"a": 1, "b": 2}, where="x", version=4)


def test_an_engine_that_fuses_is_compared_under_its_names_and_names_the_parts():
    """vLLM's qkv_proj holds q/k/v_proj: the sent digests fold into it by addition, a tied lm_head
    (None) is left out, and an error names the engine's tensor with the sent tensors in it."""
    from rlfoundry.workers.weight_sync import fold_digests

    parts = {n: torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i, n in enumerate("qkvo")}
    sent = {f"attn.{n}_proj.weight": tensor_digest(t) for n, t in parts.items()} | {"lm_head.weight": 7}
    fused = {"attn.qkv_proj.weight": tensor_digest(torch.cat([parts[n] for n in "qkv"])),
             "attn.o_proj.weight": tensor_digest(parts["o"])}

    def engine_name(name: str) -> str | None:
        if name == "lm_head.weight":
            return None
        return re.sub(r"\.[qkv]_proj\.", ".qkv_proj.", name)

    folded, names = fold_digests(sent, engine_name)
    assert folded == fused and names["attn.qkv_proj.weight"] == ["attn.q_proj.weight", "attn.k_proj.weight",
                                                                  "attn.v_proj.weight"]
    compare_digests(sent, fused, where="x", version=1, engine_name=engine_name)
    stale = fused | {"attn.qkv_proj.weight": tensor_digest(torch.cat([parts["q"], parts["k"], parts["k"]]))}
    with pytest.raises(StaleWeightsError, match=r"tensor 'attn\.qkv_proj\.weight' \(the engine's tensor holding "
                                                r"attn\.q_proj\.weight, attn\.k_proj\.weight, attn\.v_proj\.weight\) "
                                                r"differs .*\(1 of 2 tensors"):
        compare_digests(sent, stale, where="x", version=1, engine_name=engine_name)
    with pytest.raises(StaleWeightsError, match=r"no tensor 'attn\.o_proj\.weight' after"):
        compare_digests(sent, {"attn.qkv_proj.weight": fused["attn.qkv_proj.weight"]}, where="x", version=1,
                        engine_name=engine_name)


def test_fused_experts_go_out_under_the_checkpoints_names_and_fold_into_the_engines_fused_moe(tiny_moe_dir):
    """transformers' fused 3-D experts leave as the per-expert tensors ``save_pretrained`` wrote (bit for bit,
    every other tensor untouched); those names map to an engine's fused MoE tensor (vLLM's
    ``experts.routed_experts.w13_weight``), their dtypes are listed under them, and their digests fold into it."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlfoundry.workers.weight_sync import FusedNames, checkpoint_named, fold_digests

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    sent = dict(checkpoint_named(lambda: model, ((n, p.detach()) for n, p in model.named_parameters())))
    saved = load_file(str(tiny_moe_dir / "model.safetensors"))
    assert sent.keys() == saved.keys() and all(torch.equal(sent[k], saved[k]) for k in saved)
    layer = "model.layers.0.mlp.experts"
    engine = {f"{layer}.routed_experts.w13_weight": torch.float32, f"{layer}.routed_experts.w2_weight": torch.float32}
    names = FusedNames(engine, {}, False, experts={name: 8 for name in engine})
    assert names.engine_name(f"{layer}.5.up_proj.weight") == f"{layer}.routed_experts.w13_weight"
    assert names.engine_name(f"{layer}.5.down_proj.weight") == f"{layer}.routed_experts.w2_weight"
    assert len(names.hf_dtypes()) == 8 * 3 and f"{layer}.7.gate_proj.weight" in names.hf_dtypes()
    ours = {k: tensor_digest(v) for k, v in sent.items() if k.startswith(layer + ".")}
    w13 = torch.cat([torch.cat([sent[f"{layer}.{e}.gate_proj.weight"], sent[f"{layer}.{e}.up_proj.weight"]])
                     for e in range(8)])
    folded, _ = fold_digests(ours, names.engine_name)
    assert folded[f"{layer}.routed_experts.w13_weight"] == tensor_digest(w13)


# ---- the verify mode on a rollout that holds a copy ----------------------------------------------

@pytest.fixture(scope="module")
def rollout_worker(tiny_model_dir):
    """A rollout pool's rank: a whole HF replica the syncs fill."""
    return local_worker(worker_config(tiny_model_dir), role="rollout").worker


def _trained(worker, scale: float) -> list[tuple[str, torch.Tensor]]:
    """The trainer's weights after an update the rollout has not seen."""
    return [(name, p.detach() * scale + 0.01) for name, p in worker.rollout.module.named_parameters()]


def test_a_verified_sync_passes_and_sets_the_engines_version(rollout_worker):
    weights = _trained(rollout_worker, 1.01)
    rollout_worker._load_into_rollout(iter(weights), 3, "test")
    assert rollout_worker.rollout_version == 3
    assert all(torch.equal(p, dict(weights)[n]) for n, p in rollout_worker.rollout.module.named_parameters())


def test_a_skipped_sync_is_caught(rollout_worker, monkeypatch):
    weights = _trained(rollout_worker, 1.02)
    monkeypatch.setattr(rollout_worker.rollout, "sync_weights", lambda named: None)  # an engine that ignores it
    with pytest.raises(StaleWeightsError, match=f"tensor {weights[0][0]!r} differs .*\\({len(weights)} of "):
        rollout_worker._load_into_rollout(iter(weights), 4, "test")


def test_a_sync_that_leaves_tensors_out_is_caught(rollout_worker, monkeypatch):
    weights = _trained(rollout_worker, 1.03)
    load = rollout_worker.rollout.sync_weights

    def first_half(named):  # a loader that stops early (the rest of the stream is never read)
        from itertools import islice

        params = dict(rollout_worker.rollout.module.named_parameters())
        with torch.no_grad():
            for name, tensor in islice(named, len(weights) // 2):
                params[name].copy_(tensor)

    monkeypatch.setattr(rollout_worker.rollout, "sync_weights", first_half)
    missed = weights[len(weights) // 2][0]
    with pytest.raises(StaleWeightsError, match=f"tensor {missed!r} differs"):
        rollout_worker._load_into_rollout(iter(weights), 5, "test")
    monkeypatch.setattr(rollout_worker.rollout, "sync_weights", load)


def test_a_corrupted_sync_is_caught_by_name(rollout_worker, monkeypatch):
    weights = _trained(rollout_worker, 1.04)
    monkeypatch.setenv(faults.ENV_VAR, "sync_weights.tensor@3:nan")  # the 3rd tensor reaches the engine as NaN
    faults.reset()
    with pytest.raises(StaleWeightsError, match=f"to test on rank 0 \\(param_version 6\\): tensor {weights[2][0]!r} "
                                                r"differs .*\(1 of "):
        rollout_worker._load_into_rollout(iter(weights), 6, "test")
    faults.reset()


def test_with_verify_off_a_skipped_sync_goes_unnoticed(tiny_model_dir, monkeypatch):
    """The control: the digest comparison, not something else, is what catches it above."""
    worker = local_worker(worker_config(tiny_model_dir, ["rollout.checkpoint_engine.verify=false"]), role="rollout").worker
    monkeypatch.setattr(worker.rollout, "sync_weights", lambda named: None)
    worker._load_into_rollout(iter(_trained(worker, 1.02)), 4, "test")
    assert worker.rollout_version == 4



def _copy_syncs_in_bf16(worker, tokenizer, monkeypatch) -> None:
    """A rollout copy in bf16 takes the trainer's fp32 tensors rounded, verified in its own dtype (a skipped
    sync still caught), and samples with finite log-probs."""
    assert {p.dtype for p in worker.rollout.module.parameters()} == {torch.bfloat16}
    weights = [(n, t.float()) for n, t in _trained(worker, 1.01)]
    worker._load_into_rollout(iter(weights), 3, "test")
    assert all(torch.equal(p, dict(weights)[n].to(p.device, torch.bfloat16))
               for n, p in worker.rollout.module.named_parameters())
    load = worker.rollout.sync_weights
    monkeypatch.setattr(worker.rollout, "sync_weights", lambda named: None)
    with pytest.raises(StaleWeightsError, match="differs"):
        worker._load_into_rollout(iter([(n, t * 1.5) for n, t in weights]), 4, "test")
    monkeypatch.setattr(worker.rollout, "sync_weights", load)
    out = worker.rollout.generate_sequences(make_prompts(tokenizer, TEXTS).to(worker.device))
    logp = out.batch["rollout_log_probs"][out.batch["response_mask"].bool()]
    assert logp.numel() and bool(torch.isfinite(logp).all()) and bool((logp <= 0).all())


def test_a_rollout_copy_takes_the_dtype_the_actor_computes_in(tiny_model_dir, tokenizer, monkeypatch):
    """A rollout pool's copy decodes in the actor's compute dtype (fp32 on a CPU by default, above;
    here mixed_precision.param_dtype=bf16), as the actor's shared module does."""
    worker = local_worker(worker_config(tiny_model_dir, ["actor.fsdp_config.mixed_precision.param_dtype=bf16"]),
                          role="rollout").worker
    _copy_syncs_in_bf16(worker, tokenizer, monkeypatch)


@pytest.mark.gpu
def test_a_rollout_copy_is_bf16_on_cuda_by_default(tiny_model_dir, tokenizer, monkeypatch):
    """On CUDA the actor computes in bf16 by default: a rollout pool's (or a judge's) copy is bf16 too,
    half the memory of the fp32 copy it held before, beside the trainer on the same GPU."""
    worker = local_worker(worker_config(tiny_model_dir), role="rollout").worker
    assert worker.device.type == "cuda"
    _copy_syncs_in_bf16(worker, tokenizer, monkeypatch)

# ---- param_version on the hybrid path -------------------------------------------------------------

def _scored(group, prompts):
    data = group.generate_sequences(prompts)
    data = data.union(group.compute_log_prob(data))
    mask = data.batch["response_mask"]
    data.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
    return data


def test_hybrid_samples_carry_the_version_that_generated_them_and_a_skipped_refresh_is_an_error(
        tiny_model_dir, tokenizer, monkeypatch):
    prompts = make_prompts(tokenizer, TEXTS)
    group = local_worker(worker_config(tiny_model_dir, ["actor.ppo_mini_batch_size=2"]), role="actor_rollout")
    first = _scored(group, prompts)
    assert list(first.non_tensor_batch["param_version"]) == [0] * len(first)
    metrics = group.update_actor(first).meta_info["metrics"]
    assert metrics["actor/param_version"] == [1] and metrics["rollout/param_staleness_max"] == [0.0]  # one per rank
    second = _scored(group, prompts)
    assert set(second.non_tensor_batch["param_version"]) == {1}
    # a batch sampled before the last update reaching the next one: a stale engine, not a silent drop
    with pytest.raises(StaleWeightsError, match="samples generated with param_version 0 reach update 2"):
        group.update_actor(first)
    # the rollout not refreshed after an update: generation refuses
    monkeypatch.setattr(group.worker, "_refresh_rollout", lambda: None)
    group.update_actor(second)
    with pytest.raises(StaleWeightsError, match="holds the weights of param_version 1 but the actor is at 2"):
        group.generate_sequences(prompts)


def test_the_version_survives_a_checkpoint(tiny_model_dir, tokenizer, tmp_path):
    prompts = make_prompts(tokenizer, TEXTS)
    a = local_worker(worker_config(tiny_model_dir, ["actor.ppo_mini_batch_size=2"]), role="actor_rollout")
    a.update_actor(_scored(a, prompts))
    a.save_checkpoint(str(tmp_path / "global_step_1" / "actor"), global_step=1)
    b = local_worker(worker_config(tiny_model_dir, ["actor.ppo_mini_batch_size=2"]), role="actor_rollout")
    assert b.load_checkpoint(str(tmp_path / "global_step_1" / "actor"))[0]["param_version"] == 1
    assert np.array_equal(b.generate_sequences(prompts).non_tensor_batch["param_version"], np.full(8, 1, dtype=object))


def test_a_digest_recorder_prefers_the_senders_digest_when_dtypes_agree():
    t = torch.arange(6, dtype=torch.float32)
    recorder = DigestRecorder({"w": torch.float32, "h": torch.bfloat16}, sent={"w": 123, "h": 456})
    list(recorder.wrap([("w", t), ("h", t)]))
    assert recorder.expected == {"w": 123, "h": tensor_digest(t, torch.bfloat16)}
